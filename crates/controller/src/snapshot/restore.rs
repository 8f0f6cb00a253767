//! The VirtualMachineRestore step (pure): from the restore, its snapshot and content, the
//! target VM and the namespace's claims, decide what to create or change and the status to
//! write (KubeVirt's `complete`, `restoreTime`, `restores`, conditions `Progressing`/`Ready`).
//!
//! Order: a target VM that does not exist is created from the captured VM (new name: its
//! explicit MACs, firmware UUID and serial are dropped, so it gets its own, derived from its
//! name); the VM is marked `status.restoreInProgress` (it does not start meanwhile); each
//! volume backup becomes a claim restored from its VolumeSnapshot (`dataSource`), named by
//! `volumeRestorePolicy` (`RandomizeNames`: `restore-<restore uid>-<volume>`,
//! `PrefixTargetName`: `<target>-<volume>`, an override's `restoreName` first) — or, with
//! `InPlace`, the claim keeps its name and its volume is pointed back at the snapshot (constant
//! time, the claim must still be on the snapshotted volume); once every claim is bound the
//! VM's spec becomes the captured one with its volumes on the restored claims; then the
//! restore is complete and the mark cleared.
//!
//! A running target waits (`WaitEventually`), fails at once (`FailImmediate`) or waits
//! at most five minutes (`WaitGracePeriod`, the default).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    PersistentVolumeClaim, PersistentVolumeClaimSpec, TypedLocalObjectReference,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;

use ferrovirt_api::kubevirt::snapshot::{
    RestoreStatus, VirtualMachineRestore, VirtualMachineSnapshot, VirtualMachineSnapshotContent,
    VolumeRestore,
};
use ferrovirt_api::kubevirt::vm::{VirtualMachine, VirtualMachineSpec};
use ferrovirt_api::kubevirt::vmi::Condition;
use ferrovirt_api::kubevirt::volumes::PvcVolumeSource;

use crate::conditions::{condition, set};

/// How long a running target is waited for under `WaitGracePeriod`.
pub const GRACE_PERIOD: Duration = Duration::from_secs(300);
/// The label naming the restore on restored claims.
pub const RESTORE_NAME_LABEL: &str = "restore.kubevirt.io/source-vm-name";

/// The annotation a restored VM carries: `<restore name>-<restore uid>` of the last restore
/// that wrote its spec.
pub const LAST_RESTORE_ANNOTATION: &str = "restore.kubevirt.io/lastRestoreUID";

/// The value of [`LAST_RESTORE_ANNOTATION`] for `r`.
pub fn restore_id(r: &VirtualMachineRestore) -> String {
    format!(
        "{}-{}",
        r.metadata.name.as_deref().unwrap_or(""),
        r.metadata.uid.as_deref().unwrap_or("")
    )
}

/// What a restore sees.
pub struct RestoreInput<'a> {
    pub restore: &'a VirtualMachineRestore,
    pub snapshot: Option<&'a VirtualMachineSnapshot>,
    pub content: Option<&'a VirtualMachineSnapshotContent>,
    pub target: Option<&'a VirtualMachine>,
    /// The target's VMI exists and has not finished.
    pub target_running: bool,
    /// The namespace's claims by name.
    pub claims: &'a BTreeMap<String, PersistentVolumeClaim>,
    /// The node holding each VolumeSnapshot's source volume (node-local volumes), by
    /// VolumeSnapshot name: restored claims are placed there.
    pub snapshot_nodes: &'a BTreeMap<String, String>,
    /// The PV each VolumeSnapshot was taken of and its handle (`<pv>/<layer>`), by name.
    pub snapshot_handles: &'a BTreeMap<String, String>,
    pub now: Timestamp,
}

/// What the VM's `status.restoreInProgress` should become.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestoreMark {
    Leave,
    Set(String),
    Clear(String),
}

/// A claim to point back at its snapshot in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revert {
    pub claim: String,
    /// `<pv>/<layer>` of the snapshot.
    pub handle: String,
}

/// The step's decision.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RestoreStep {
    pub create_vm: Option<Box<VirtualMachine>>,
    pub mark: Option<RestoreMark>,
    pub create_claims: Vec<PersistentVolumeClaim>,
    pub reverts: Vec<Revert>,
    /// The target VM's new spec (written with [`LAST_RESTORE_ANNOTATION`]).
    pub update_vm_spec: Option<Box<VirtualMachineSpec>>,
    /// The target's labels and annotations after the restore's `patches`, written with the
    /// spec (an existing target; a new one got them at creation).
    pub update_vm_metadata: Option<Box<ObjectMeta>>,
    pub status: RestoreStatus,
    pub requeue: Option<Duration>,
    /// Stop the running target (`targetReadinessPolicy: StopTarget`): its `runStrategy`
    /// becomes `Halted`; the restored spec written at the end brings the captured one back.
    pub stop_target: bool,
}

/// The restored claim's name of `volume` under the restore's policy.
pub fn restored_claim_name(
    restore: &VirtualMachineRestore,
    volume: &str,
    original_claim: &str,
) -> String {
    let spec = restore.spec.clone().unwrap_or_default();
    if let Some(o) = spec
        .volume_restore_overrides
        .iter()
        .flatten()
        .find(|o| o.volume_name.as_deref() == Some(volume))
        && let Some(n) = &o.restore_name
    {
        return n.clone();
    }
    match spec.volume_restore_policy.as_deref() {
        Some("InPlace") => original_claim.to_string(),
        Some("PrefixTargetName") => format!("{}-{volume}", spec.target.name),
        _ => format!(
            "restore-{}-{volume}",
            restore.metadata.uid.as_deref().unwrap_or("unknown")
        ),
    }
}

fn in_place(restore: &VirtualMachineRestore) -> bool {
    restore
        .spec
        .as_ref()
        .and_then(|s| s.volume_restore_policy.as_deref())
        == Some("InPlace")
}

/// The captured VM spec with its claims renamed (`dataVolume` volumes become claims: the
/// restored claim has no DataVolume) and, for a new VM, its identity dropped.
pub fn restored_spec(
    captured: &VirtualMachineSpec,
    renames: &BTreeMap<String, String>,
    new_vm: bool,
) -> VirtualMachineSpec {
    let mut spec = captured.clone();
    if let Some(t) = spec.template.spec.as_mut() {
        for v in t.volumes.iter_mut().flatten() {
            if let Some(new) = renames.get(&v.name) {
                let read_only = v.persistent_volume_claim.as_ref().and_then(|p| p.read_only);
                v.data_volume = None;
                v.persistent_volume_claim = Some(PvcVolumeSource {
                    claim_name: new.clone(),
                    read_only,
                    hotpluggable: None,
                });
            }
        }
        if new_vm {
            if let Some(fw) = t.domain.firmware.as_mut() {
                fw.uuid = None;
                fw.serial = None;
            }
            for i in t.domain.devices.interfaces.iter_mut().flatten() {
                i.mac_address = None;
            }
        }
    }
    // DataVolume templates of restored volumes would re-import over them.
    let restored: Vec<&String> = renames.keys().collect();
    let captured_volumes = captured
        .template
        .spec
        .as_ref()
        .and_then(|s| s.volumes.clone())
        .unwrap_or_default();
    let dv_names: Vec<String> = captured_volumes
        .iter()
        .filter(|v| restored.contains(&&v.name))
        .filter_map(|v| v.data_volume.as_ref().map(|d| d.name.clone()))
        .collect();
    if let Some(t) = spec.data_volume_templates.as_mut() {
        t.retain(|d| {
            d.metadata
                .as_ref()
                .and_then(|m| m.name.as_ref())
                .is_none_or(|n| !dv_names.contains(n))
        });
    }
    if spec
        .data_volume_templates
        .as_ref()
        .is_some_and(Vec::is_empty)
    {
        spec.data_volume_templates = None;
    }
    spec
}

/// Applies JSON patch operations (one JSON object per string, as KubeVirt's restore and clone
/// `patches`) to `vm`; `spec_only`: only the operations on `/spec…`.
pub fn apply_patches(
    vm: &VirtualMachine,
    patches: &[String],
    spec_only: bool,
) -> Result<VirtualMachine, String> {
    let mut ops = Vec::new();
    for (i, p) in patches.iter().enumerate() {
        let op: json_patch::PatchOperation =
            serde_json::from_str(p).map_err(|e| format!("spec.patches[{i}]: {e}"))?;
        if spec_only && !op.path().to_string().starts_with("/spec") {
            continue;
        }
        ops.push(op);
    }
    if ops.is_empty() {
        return Ok(vm.clone());
    }
    let mut v = serde_json::to_value(vm).map_err(|e| e.to_string())?;
    json_patch::patch(&mut v, &ops).map_err(|e| format!("spec.patches: {e}"))?;
    serde_json::from_value(v).map_err(|e| format!("spec.patches: the patched VM is invalid: {e}"))
}

fn claim_bound(c: &PersistentVolumeClaim) -> bool {
    c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
}

/// Decide one step of a VirtualMachineRestore.
pub fn step(input: &RestoreInput<'_>) -> RestoreStep {
    let r = input.restore;
    let name = r.metadata.name.clone().unwrap_or_default();
    let spec = r.spec.clone().unwrap_or_default();
    let now = Time(input.now);
    let mut status = r.status.clone().unwrap_or_default();
    let mut out = RestoreStep::default();
    if status.complete == Some(true) {
        out.mark = Some(RestoreMark::Clear(name));
        out.status = status;
        return out;
    }
    let mut conditions: Vec<Condition> = status.conditions.clone().unwrap_or_default();
    status.complete = Some(false);
    let failed_already = conditions
        .iter()
        .any(|c| c.type_ == "Failure" && c.status == "True");
    if failed_already {
        out.status = status;
        return out;
    }
    let progress = |mut status: RestoreStatus, mut conditions: Vec<Condition>, msg: &str| {
        set(
            &mut conditions,
            condition("Progressing", true, Some("InProgress"), Some(msg)),
            &now,
        );
        set(
            &mut conditions,
            condition("Ready", false, Some("InProgress"), Some(msg)),
            &now,
        );
        status.conditions = Some(conditions);
        status
    };
    let fail = |mut status: RestoreStatus, mut conditions: Vec<Condition>, msg: &str| {
        for (t, v) in [("Progressing", false), ("Ready", false), ("Failure", true)] {
            set(
                &mut conditions,
                condition(t, v, Some("Failed"), Some(msg)),
                &now,
            );
        }
        status.conditions = Some(conditions);
        status
    };

    let snap_ok = input
        .snapshot
        .is_some_and(|s| s.status.as_ref().and_then(|st| st.ready_to_use) == Some(true));
    let (true, Some(content)) = (snap_ok, input.content) else {
        out.status = progress(
            status,
            conditions,
            &format!(
                "waiting for VirtualMachineSnapshot {} to be ready",
                spec.virtual_machine_snapshot_name
            ),
        );
        out.requeue = Some(Duration::from_secs(2));
        return out;
    };
    let cspec = content.spec.clone().unwrap_or_default();
    let Some(captured) = cspec
        .source
        .virtual_machine
        .as_ref()
        .and_then(|v| v.spec.clone())
    else {
        out.status = fail(status, conditions, "the snapshot content holds no VM");
        return out;
    };
    let target_name = spec.target.name.clone();
    let source_name = cspec
        .source
        .virtual_machine
        .as_ref()
        .and_then(|v| v.metadata.as_ref())
        .and_then(|m| m.name.clone())
        .unwrap_or_default();
    let new_vm = target_name != source_name;
    let backups = cspec.volume_backups.clone().unwrap_or_default();
    if in_place(r) && new_vm {
        out.status = fail(
            status,
            conditions,
            "volumeRestorePolicy InPlace restores into the snapshotted VM only",
        );
        return out;
    }
    let renames: BTreeMap<String, String> = backups
        .iter()
        .map(|b| {
            let original = b
                .persistent_volume_claim
                .metadata
                .as_ref()
                .and_then(|m| m.name.clone())
                .unwrap_or_default();
            (
                b.volume_name.clone(),
                restored_claim_name(r, &b.volume_name, &original),
            )
        })
        .collect();

    // 1. The target VM.
    let Some(target) = input.target else {
        if !new_vm {
            out.status = fail(
                status,
                conditions,
                &format!("target VirtualMachine {target_name} does not exist"),
            );
            return out;
        }
        let mut vm_spec = restored_spec(&captured, &renames, true);
        // Created stopped: it starts, by its captured run strategy, once restored.
        let run_strategy = vm_spec.run_strategy;
        vm_spec.running = None;
        vm_spec.run_strategy = Some(ferrovirt_api::kubevirt::vm::RunStrategy::Halted);
        let captured_meta = cspec
            .source
            .virtual_machine
            .as_ref()
            .and_then(|v| v.metadata.clone())
            .unwrap_or_default();
        let mut annotations = BTreeMap::new();
        if let Some(rs) = run_strategy {
            annotations.insert(
                "restore.ferrovirt.io/run-strategy".to_string(),
                serde_json::to_value(rs)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
            );
        }
        let vm = VirtualMachine {
            api_version: Some("kubevirt.io/v1".into()),
            kind: Some("VirtualMachine".into()),
            metadata: ObjectMeta {
                name: Some(target_name.clone()),
                namespace: r.metadata.namespace.clone(),
                labels: captured_meta.labels,
                annotations: Some(annotations),
                ..Default::default()
            },
            spec: Some(vm_spec),
            status: None,
        };
        match apply_patches(&vm, spec.patches.as_deref().unwrap_or_default(), false) {
            Ok(vm) => out.create_vm = Some(Box::new(vm)),
            Err(e) => {
                out.status = fail(status, conditions, &e);
                return out;
            }
        }
        out.status = progress(status, conditions, "creating the target VirtualMachine");
        out.requeue = Some(Duration::from_millis(300));
        return out;
    };
    if input.target_running {
        let policy = spec
            .target_readiness_policy
            .as_deref()
            .unwrap_or("WaitGracePeriod");
        let created = r
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0)
            .unwrap_or(input.now);
        let waited = input.now.duration_since(created).unsigned_abs();
        if policy == "StopTarget" {
            let busy = target
                .status
                .as_ref()
                .and_then(|s| s.snapshot_in_progress.as_deref());
            let msg = match busy {
                // The stop would be refused: the VM's spec is frozen while it is snapshotted.
                Some(snap) => format!(
                    "a snapshot ({snap}) of the target VirtualMachine {target_name} is in \
                     progress; it is stopped once that completes (targetReadinessPolicy: \
                     StopTarget)"
                ),
                None => {
                    out.stop_target = true;
                    format!(
                        "stopping the target VirtualMachine {target_name} \
                         (targetReadinessPolicy: StopTarget)"
                    )
                }
            };
            out.status = progress(status, conditions, &msg);
            out.requeue = Some(Duration::from_secs(1));
            return out;
        }
        let msg = format!("the target VirtualMachine {target_name} is running; stop it to restore");
        if policy == "FailImmediate" || (policy == "WaitGracePeriod" && waited >= GRACE_PERIOD) {
            out.status = fail(status, conditions, &msg);
            return out;
        }
        out.status = progress(status, conditions, &msg);
        out.requeue = Some(Duration::from_secs(2));
        return out;
    }
    let mark = target
        .status
        .as_ref()
        .and_then(|s| s.restore_in_progress.clone());
    match mark.as_deref() {
        Some(m) if m == name => {}
        Some(other) => {
            out.status = progress(
                status,
                conditions,
                &format!("another restore ({other}) of the VM is in progress"),
            );
            out.requeue = Some(Duration::from_secs(2));
            return out;
        }
        None => {
            if target
                .status
                .as_ref()
                .and_then(|s| s.snapshot_in_progress.as_ref())
                .is_some()
            {
                out.status = progress(status, conditions, "a snapshot of the VM is in progress");
                out.requeue = Some(Duration::from_secs(2));
                return out;
            }
            out.mark = Some(RestoreMark::Set(name.clone()));
            out.status = progress(status, conditions, "restoring volumes");
            out.requeue = Some(Duration::from_millis(200));
            return out;
        }
    }

    // 2. The claims.
    let owner = target.metadata.uid.clone().map(|uid| OwnerReference {
        api_version: "kubevirt.io/v1".into(),
        kind: "VirtualMachine".into(),
        name: target_name.clone(),
        uid,
        controller: None,
        block_owner_deletion: None,
    });
    let own = spec.volume_ownership_policy.as_deref() != Some("None");
    let mut restores = Vec::new();
    let mut waiting = Vec::new();
    let reverted: Vec<String> = status
        .restores
        .iter()
        .flatten()
        .map(|v| v.persistent_volume_claim.clone())
        .collect();
    for b in &backups {
        let Some(vs_name) = b.volume_snapshot_name.clone() else {
            continue;
        };
        let claim_name = renames[&b.volume_name].clone();
        restores.push(VolumeRestore {
            volume_name: b.volume_name.clone(),
            persistent_volume_claim: claim_name.clone(),
            volume_snapshot_name: vs_name.clone(),
            data_volume_name: None,
        });
        if in_place(r) {
            if reverted.contains(&claim_name) {
                continue;
            }
            let Some(handle) = input.snapshot_handles.get(&vs_name) else {
                waiting.push(format!("{vs_name} (no snapshot handle)"));
                continue;
            };
            let on_volume = input.claims.get(&claim_name).is_some_and(|c| {
                c.spec.as_ref().and_then(|s| s.volume_name.as_deref())
                    == handle.split_once('/').map(|(pv, _)| pv)
            });
            if !on_volume {
                out.status = fail(
                    status,
                    conditions,
                    &format!(
                        "InPlace: claim {claim_name} is no longer on the snapshotted volume; use RandomizeNames"
                    ),
                );
                return out;
            }
            out.reverts.push(Revert {
                claim: claim_name,
                handle: handle.clone(),
            });
            continue;
        }
        match input.claims.get(&claim_name) {
            Some(c) if claim_bound(c) => {}
            Some(_) => waiting.push(claim_name),
            None => {
                let captured = &b.persistent_volume_claim;
                let cs = captured.spec.clone().unwrap_or_default();
                let mut labels = captured
                    .metadata
                    .as_ref()
                    .and_then(|m| m.labels.clone())
                    .unwrap_or_default();
                labels.insert(RESTORE_NAME_LABEL.into(), source_name.clone());
                let mut annotations = BTreeMap::new();
                if let Some(node) = input.snapshot_nodes.get(&vs_name) {
                    annotations
                        .insert(crate::storage::pvc::SELECTED_NODE.to_string(), node.clone());
                }
                if let Some(o) = spec
                    .volume_restore_overrides
                    .iter()
                    .flatten()
                    .find(|o| o.volume_name.as_deref() == Some(b.volume_name.as_str()))
                {
                    labels.extend(o.labels.clone().unwrap_or_default());
                    annotations.extend(o.annotations.clone().unwrap_or_default());
                }
                out.create_claims.push(PersistentVolumeClaim {
                    metadata: ObjectMeta {
                        name: Some(claim_name.clone()),
                        namespace: r.metadata.namespace.clone(),
                        labels: Some(labels),
                        annotations: Some(annotations),
                        owner_references: own.then(|| owner.clone()).flatten().map(|o| vec![o]),
                        ..Default::default()
                    },
                    spec: Some(PersistentVolumeClaimSpec {
                        access_modes: cs.access_modes,
                        resources: cs.resources,
                        storage_class_name: cs.storage_class_name,
                        volume_mode: cs.volume_mode,
                        data_source: Some(TypedLocalObjectReference {
                            api_group: Some("snapshot.storage.k8s.io".into()),
                            kind: "VolumeSnapshot".into(),
                            name: vs_name,
                        }),
                        ..Default::default()
                    }),
                    status: None,
                });
                waiting.push(claim_name);
            }
        }
    }
    status.restores = Some(restores);
    if !out.reverts.is_empty() || !waiting.is_empty() {
        let msg = if waiting.is_empty() {
            "restoring volumes in place".to_string()
        } else {
            format!("waiting for restored claims: {}", waiting.join(", "))
        };
        out.status = progress(status, conditions, &msg);
        out.requeue = Some(Duration::from_millis(500));
        return out;
    }

    // 3. The VM's spec.
    let mut want = restored_spec(&captured, &renames, new_vm);
    if new_vm {
        // Created Halted above; now the captured run strategy.
        let rs = target
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("restore.ferrovirt.io/run-strategy"))
            .and_then(|s| serde_json::from_value(serde_json::Value::String(s.clone())).ok());
        want.run_strategy = rs.or(Some(ferrovirt_api::kubevirt::vm::RunStrategy::Halted));
        want.running = None;
    }
    // Admission defaults the written spec (a new VM's firmware UUID, …), so "done" is the
    // annotation written with it, as KubeVirt records it.
    let restore_id = restore_id(r);
    let done = target
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(LAST_RESTORE_ANNOTATION))
        == Some(&restore_id);
    if !done {
        // The restore's patches: on a new VM its metadata got them at creation.
        let patches = spec.patches.clone().unwrap_or_default();
        let base = VirtualMachine {
            metadata: target.metadata.clone(),
            spec: Some(want),
            ..Default::default()
        };
        let patched = match apply_patches(&base, &patches, new_vm) {
            Ok(v) => v,
            Err(e) => {
                out.status = fail(status, conditions, &e);
                return out;
            }
        };
        let touches_metadata = patches.iter().any(|p| {
            serde_json::from_str::<json_patch::PatchOperation>(p)
                .is_ok_and(|op| !op.path().to_string().starts_with("/spec"))
        });
        if !new_vm && touches_metadata {
            out.update_vm_metadata = Some(Box::new(patched.metadata.clone()));
        }
        let want = patched.spec.unwrap_or_default();
        out.update_vm_spec = Some(Box::new(want));
        out.status = progress(status, conditions, "updating the VirtualMachine");
        out.requeue = Some(Duration::from_millis(200));
        return out;
    }

    // 4. Done.
    status.complete = Some(true);
    status.restore_time = Some(now.clone());
    super::set_succeeded(&mut conditions, &now);
    status.conditions = Some(conditions);
    out.status = status;
    out.mark = Some(RestoreMark::Clear(name));
    out
}

#[cfg(test)]
#[path = "restore_tests.rs"]
mod tests;
