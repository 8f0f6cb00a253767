//! The agent's side of self-fencing (docs/fencing.md): after every successful Lease renewal
//! it writes the node's heartbeat file (the `renewTime` it put into the Lease and the lease
//! duration, [`ferrovirt_launcher::fence::Heartbeat`]); before it starts a launcher it decides
//! whether the VM is fenceable (its VM restarts it elsewhere and every disk is usable from
//! another node, [`ferrovirt_api::fencing::fenceable`]), announces that on the VMI
//! (`ferrovirt.io/fencing`) and gives the launcher its [`FenceSpec`]: the heartbeat path, the
//! deadline of the last renewal, and a storage lease per shared file-backed disk. VMs that
//! cannot move get no fence spec and keep running whatever happens to the agent.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ferrovirt_api::fencing;
use ferrovirt_api::kubevirt::vm::RunStrategy;
use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_launcher::fence::{FenceSpec, HEARTBEAT_FILE, Heartbeat, storage_lease_path};
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use serde_json::Value;

use crate::error::AgentError;
use crate::volumes::ResolvedRefs;

/// The node's heartbeat file under the agent's data dir.
pub fn heartbeat_path(data_dir: &Path) -> PathBuf {
    data_dir.join(HEARTBEAT_FILE)
}

/// The run strategy of a VirtualMachine object (`spec.runStrategy`, else the deprecated
/// `spec.running`: true is Always, false Halted).
pub fn run_strategy_of(vm: &Value) -> Option<RunStrategy> {
    let spec = vm.get("spec")?;
    if let Some(s) = spec.get("runStrategy") {
        return serde_json::from_value(s.clone()).ok();
    }
    match spec.get("running").and_then(Value::as_bool) {
        Some(true) => Some(RunStrategy::Always),
        Some(false) => Some(RunStrategy::Halted),
        None => None,
    }
}

/// The name of the VirtualMachine controlling `vmi`, if any.
pub fn owner_vm(vmi: &VirtualMachineInstance) -> Option<String> {
    vmi.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.kind == "VirtualMachine" && o.controller == Some(true))
        .map(|o| o.name.clone())
}

/// Reads the run strategy of the VM owning `vmi` (`None`: no owner, or it is gone).
pub async fn owner_run_strategy(
    client: &Client,
    vmi: &VirtualMachineInstance,
) -> Result<Option<RunStrategy>, AgentError> {
    let Some(name) = owner_vm(vmi) else {
        return Ok(None);
    };
    let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
        "virtualmachines",
    );
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    let vm = api
        .get_opt(&name)
        .await
        .map_err(|e| AgentError::Reference(format!("reading VM {name}: {e}")))?;
    Ok(vm
        .map(|v| serde_json::to_value(v).unwrap_or(Value::Null))
        .and_then(|v| run_strategy_of(&v)))
}

/// What the agent needs to decide a launcher's fencing.
#[derive(Debug, Clone)]
pub struct FenceInputs<'a> {
    pub node: &'a str,
    pub data_dir: &'a Path,
    /// The owning VM's run strategy.
    pub run_strategy: Option<RunStrategy>,
    /// The last successful renewal, if any.
    pub last_renewal: Option<&'a Heartbeat>,
    /// Now, ms since the epoch.
    pub now_ms: i64,
}

/// The launcher's fence spec, pure: `Ok(None)` for a VM that cannot move; an error when the
/// VM is fenceable but the node's lease is not confirmed (a launcher started now would fence
/// at once).
pub fn fence_spec(
    vmi: &VirtualMachineInstance,
    refs: &ResolvedRefs,
    claim_access_modes: &BTreeMap<String, Vec<String>>,
    inputs: &FenceInputs<'_>,
) -> Result<Option<FenceSpec>, AgentError> {
    let modes = |c: &str| claim_access_modes.get(c).cloned();
    if !fencing::fenceable(vmi, inputs.run_strategy, modes) {
        return Ok(None);
    }
    let initial = inputs
        .last_renewal
        .filter(|hb| hb.deadline_ms() > inputs.now_ms)
        .cloned()
        .ok_or_else(|| {
            AgentError::Reference(
                "the node's lease is not confirmed: a self-fencing VM cannot start".into(),
            )
        })?;
    let storage_leases = refs
        .claims
        .iter()
        .filter(|(name, _)| {
            claim_access_modes
                .get(*name)
                .is_some_and(|m| fencing::is_shared_access(m))
        })
        .filter(|(_, c)| !c.read_only && (c.path.is_dir() || c.path.is_file()))
        .map(|(_, c)| storage_lease_path(&c.path))
        .collect();
    Ok(Some(FenceSpec {
        heartbeat: heartbeat_path(inputs.data_dir),
        initial,
        node: inputs.node.to_string(),
        storage_leases,
    }))
}

/// The lease duration (seconds) the HyperConverged objects ask for (`spec.nodeFailure`), or
/// `None` when none sets it.
pub fn configured_lease_seconds(hcos: &[Value]) -> Option<u32> {
    hcos.iter()
        .any(|h| h.pointer("/spec/nodeFailure").is_some())
        .then(|| ferrovirt_api::hco::node_failure_timing(hcos).lease_duration_seconds)
}

/// Stores the lease duration the HyperConverged objects `hcos` ask for in `lease_seconds`
/// (`default` when none sets it). The agent's HyperConverged cache calls it after each change
/// its watch reports (no polling, no watch of its own).
pub fn follow_lease_duration(
    hcos: &[Value],
    lease_seconds: &std::sync::atomic::AtomicU32,
    default: u32,
) {
    let secs = configured_lease_seconds(hcos).unwrap_or(default);
    let old = lease_seconds.swap(secs, std::sync::atomic::Ordering::SeqCst);
    if old != secs {
        tracing::info!("node lease duration now {secs} s (HyperConverged spec.nodeFailure)");
    }
}

/// The value of the VMI's `ferrovirt.io/fencing` announcement for a launcher with `spec`.
pub fn announcement(spec: Option<&FenceSpec>) -> &'static str {
    if spec.is_some() {
        fencing::FENCING_ENABLED
    } else {
        fencing::FENCING_DISABLED
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volumes::ClaimInfo;
    use serde_json::json;

    fn vmi(claim: &str) -> VirtualMachineInstance {
        serde_json::from_value(json!({"metadata": {"name": "a", "namespace": "default",
            "ownerReferences": [{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
                "name": "vm-a", "uid": "u", "controller": true}]},
            "spec": {"domain": {}, "volumes": [
                {"name": "r", "persistentVolumeClaim": {"claimName": claim}}]}}))
        .unwrap()
    }

    #[test]
    fn lease_duration_from_hyperconverged() {
        assert_eq!(configured_lease_seconds(&[]), None);
        assert_eq!(configured_lease_seconds(&[json!({"spec": {}})]), None);
        let hco = json!({"spec": {"nodeFailure": {"leaseDurationSeconds": 12}}});
        assert_eq!(configured_lease_seconds(&[hco]), Some(12));
        let defaulted = json!({"spec": {"nodeFailure": {"fenceMarginSeconds": 5}}});
        assert_eq!(configured_lease_seconds(&[defaulted]), Some(16));
    }

    #[test]
    fn run_strategies_and_owner() {
        assert_eq!(
            run_strategy_of(&json!({"spec": {"runStrategy": "RerunOnFailure"}})),
            Some(RunStrategy::RerunOnFailure)
        );
        assert_eq!(
            run_strategy_of(&json!({"spec": {"running": true}})),
            Some(RunStrategy::Always)
        );
        assert_eq!(run_strategy_of(&json!({"spec": {}})), None);
        assert_eq!(owner_vm(&vmi("c")).as_deref(), Some("vm-a"));
    }

    #[test]
    fn spec_for_fenceable_vms_only() {
        let dir = tempfile::tempdir().unwrap();
        let mut refs = ResolvedRefs::default();
        refs.claims.insert(
            "c".into(),
            ClaimInfo {
                path: dir.path().to_path_buf(),
                read_only: false,
                ours: false,
            },
        );
        let rwx = BTreeMap::from([("c".to_string(), vec!["ReadWriteMany".to_string()])]);
        let rwo = BTreeMap::from([("c".to_string(), vec!["ReadWriteOnce".to_string()])]);
        let hb = Heartbeat {
            node: "n1".into(),
            renew_time_ms: 10_000,
            lease_duration_seconds: 8,
        };
        let inputs = FenceInputs {
            node: "n1",
            data_dir: Path::new("/var/lib/fv"),
            run_strategy: Some(RunStrategy::Always),
            last_renewal: Some(&hb),
            now_ms: 11_000,
        };
        let s = fence_spec(&vmi("c"), &refs, &rwx, &inputs)
            .unwrap()
            .unwrap();
        assert_eq!(s.initial.deadline_ms(), 18_000);
        assert_eq!(s.heartbeat, Path::new("/var/lib/fv/heartbeat.json"));
        assert_eq!(s.storage_leases, vec![dir.path().join(".ferrovirt-lease")]);
        assert_eq!(announcement(Some(&s)), "enabled");
        // Node-local disk, or a VM that is not restarted: never fenced.
        assert_eq!(fence_spec(&vmi("c"), &refs, &rwo, &inputs).unwrap(), None);
        let manual = FenceInputs {
            run_strategy: Some(RunStrategy::Manual),
            ..inputs.clone()
        };
        assert_eq!(fence_spec(&vmi("c"), &refs, &rwx, &manual).unwrap(), None);
        assert_eq!(announcement(None), "disabled");
        // Fenceable but the lease is stale or was never renewed: refused.
        let stale = FenceInputs {
            now_ms: 18_001,
            ..inputs.clone()
        };
        assert!(fence_spec(&vmi("c"), &refs, &rwx, &stale).is_err());
        let never = FenceInputs {
            last_renewal: None,
            ..inputs
        };
        assert!(fence_spec(&vmi("c"), &refs, &rwx, &never).is_err());
    }
}
