//! hco.kubevirt.io/v1beta1 HyperConverged: the one configuration object for the whole stack.
//! Fields ferrovirt reads are typed; the rest are kept as given. The reconcile's pure parts
//! live in the submodules: `desired` (defaults, the owned objects, drift), `common` (the common
//! instancetypes and preferences deployed), `admission` (honour
//! or refuse), `status` (conditions from component health); `operands` types SSP and
//! NetworkAddonsConfig.

pub mod admission;
pub mod common;
pub mod desired;
pub mod operands;
pub mod status;

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{Map, Value};

use crate::kubevirt::misc::{KubeVirtCondition, NodePlacement};

resource! {
    /// The HyperConverged configuration object.
    HyperConverged, HyperConvergedSpec, HyperConvergedStatus
}

kstruct! {
    /// Stack-wide configuration.
    pub struct HyperConvergedSpec {
        /// Optional features to turn on.
        pub feature_gates: Option<BTreeMap<String, bool>>,
        pub live_migration_config: Option<LiveMigrationConfig>,
        /// Cluster-wide eviction strategy of VMs (`LiveMigrate`, `None`, ...).
        pub eviction_strategy: Option<String>,
        pub infra: Option<HcoComponentConfig>,
        pub workloads: Option<HcoComponentConfig>,
        /// CPU model VMs get when they name none (KubeVirt's `configuration.cpuModel`,
        /// applied to a VMI without `spec.domain.cpu.model` when it is created).
        #[serde(rename = "defaultCPUModel")]
        pub default_cpu_model: Option<String>,
        /// CPU models no node offers (added to HCO's fixed list in KubeVirt's
        /// `configuration.obsoleteCPUModels`).
        #[serde(rename = "obsoleteCPUs")]
        pub obsolete_cpus: Option<ObsoleteCpus>,
        /// Runtime class VMs get when they name none.
        pub default_runtime_class: Option<String>,
        /// Storage class for persistent VM state (TPM, EFI variables).
        pub vm_state_storage_class: Option<String>,
        pub higher_workload_density: Option<HigherWorkloadDensity>,
        /// Whether removal waits for VMs and DataVolumes to go.
        pub uninstall_strategy: Option<String>,
        /// Namespace the common VM templates are put in.
        pub common_templates_namespace: Option<String>,
        /// Import settings (registries spoken to over plain HTTP).
        pub storage_import: Option<StorageImportConfig>,
        /// ferrovirt extension: node failure handling (docs/fencing.md). Not in KubeVirt's
        /// HyperConverged; safe defaults apply when absent.
        pub node_failure: Option<NodeFailureConfig>,
        #[serde(flatten)]
        pub other: Map<String, Value>,
    }
}

kstruct! {
    /// Live migration limits.
    pub struct LiveMigrationConfig {
        pub parallel_migrations_per_cluster: Option<u32>,
        pub parallel_outbound_migrations_per_node: Option<u32>,
        pub bandwidth_per_migration: Option<Quantity>,
        #[serde(rename = "completionTimeoutPerGiB")]
        pub completion_timeout_per_gib: Option<i64>,
        pub progress_timeout: Option<i64>,
        pub network: Option<String>,
        pub allow_auto_converge: Option<bool>,
        pub allow_post_copy: Option<bool>,
    }
}

kstruct! {
    /// Obsolete CPU models.
    pub struct ObsoleteCpus {
        /// Named CPU models VMs may not use: they are left off the Nodes'
        /// `cpu-model.node.kubevirt.io/<model>` labels, so a VMI asking for one stays
        /// unschedulable.
        pub cpu_models: Option<Vec<String>>,
        /// KubeVirt's minimal CPU model of the node labeller (not carried out by ferrovirt).
        #[serde(rename = "minCPUModel")]
        pub min_cpu_model: Option<String>,
    }
}

kstruct! {
    /// Where infra or workload components run.
    pub struct HcoComponentConfig {
        pub node_placement: Option<NodePlacement>,
    }
}

kstruct! {
    /// HCO's `storageImport`: settings of volume imports and containerDisk pulls.
    pub struct StorageImportConfig {
        /// Registries (`host[:port]`, `*.domain`) reached over plain HTTP; all others over
        /// HTTPS.
        pub insecure_registries: Option<Vec<String>>,
        /// Seconds an import's or upload's transfer may stall before it fails (default 60).
        pub transfer_stall_timeout_seconds: Option<u64>,
        /// Seconds an import's transfer may take in all (default 4 hours).
        pub transfer_timeout_seconds: Option<u64>,
        /// ferrovirt's extension (not in HCO): address ranges (`10.0.0.0/8`, `fd00::/8`)
        /// imports may reach although they are loopback, link-local, multicast or this
        /// machine's own addresses, refused by default.
        #[serde(rename = "allowedImportCIDRs")]
        pub allowed_import_cidrs: Option<Vec<String>>,
    }
}

/// The ranges of `spec.storageImport.allowedImportCIDRs` of every HyperConverged object (as
/// JSON), in order, without duplicates; an entry that is not a string is kept as its JSON
/// text so that parsing it names it.
pub fn allowed_import_cidrs(hcos: &[Value]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for list in hcos
        .iter()
        .filter_map(|h| h.pointer("/spec/storageImport/allowedImportCIDRs"))
    {
        let items = match list.as_array() {
            Some(a) => a.clone(),
            None => vec![list.clone()],
        };
        for r in items {
            let r = r
                .as_str()
                .map(String::from)
                .unwrap_or_else(|| r.to_string());
            if !out.contains(&r) {
                out.push(r);
            }
        }
    }
    out
}

/// The transfer timeouts `(stall, overall)` in seconds: `spec.storageImport.…` of the first
/// HyperConverged object that sets them, else `spec.config.…` of a CDI object (same names).
pub fn transfer_timeouts(hcos: &[Value], cdis: &[Value]) -> (Option<u64>, Option<u64>) {
    let pick = |field: &str| {
        hcos.iter()
            .filter_map(|h| h.pointer(&format!("/spec/storageImport/{field}")))
            .chain(
                cdis.iter()
                    .filter_map(|c| c.pointer(&format!("/spec/config/{field}"))),
            )
            .find_map(|v| v.as_u64())
            .filter(|v| *v > 0)
    };
    (
        pick("transferStallTimeoutSeconds"),
        pick("transferTimeoutSeconds"),
    )
}

/// The registries to reach over plain HTTP: `spec.config.insecureRegistries` of every CDI
/// object (as JSON; the HyperConverged's `spec.storageImport.insecureRegistries` reaches
/// them through its reconcile), without duplicates.
pub fn insecure_registries(cdis: &[Value]) -> Vec<String> {
    let lists = cdis
        .iter()
        .filter_map(|c| c.pointer("/spec/config/insecureRegistries"));
    let mut out: Vec<String> = Vec::new();
    for list in lists {
        for r in list
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r.as_str())
        {
            if !out.iter().any(|o| o == r) {
                out.push(r.to_string());
            }
        }
    }
    out
}

kstruct! {
    /// How long a silent node keeps its VMs (ferrovirt extension). A node's launchers of VMs
    /// that may run elsewhere kill QEMU `leaseDurationSeconds` after the node's last Lease
    /// renewal; the control plane replaces them `fenceMarginSeconds` later.
    pub struct NodeFailureConfig {
        /// The node Lease's duration: the launchers' fence deadline after its renewTime
        /// (default 8, at least 4).
        pub lease_duration_seconds: Option<u32>,
        /// Extra wait after the fence deadline before a replacement (default 4, at least 2):
        /// covers clock skew between nodes, the launchers' check interval and the kill.
        pub fence_margin_seconds: Option<u32>,
    }
}

/// The node failure timing from the HyperConverged objects (as JSON): the first one that sets
/// `spec.nodeFailure`, each field defaulted; the defaults when none does or it is unsafe.
pub fn node_failure_timing(hcos: &[Value]) -> crate::fencing::FenceTiming {
    let d = crate::fencing::FenceTiming::default();
    let Some(cfg) = hcos.iter().find_map(|h| {
        serde_json::from_value::<NodeFailureConfig>(h.pointer("/spec/nodeFailure")?.clone()).ok()
    }) else {
        return d;
    };
    let t = crate::fencing::FenceTiming {
        lease_duration_seconds: cfg
            .lease_duration_seconds
            .unwrap_or(d.lease_duration_seconds),
        fence_margin_seconds: cfg.fence_margin_seconds.unwrap_or(d.fence_margin_seconds),
    };
    if t.validate().is_ok() { t } else { d }
}

/// Whether KubeVirt feature gate `gate` (e.g. `HostDisk`) is on in any KubeVirt object (as
/// JSON): listed in `spec.configuration.developerConfiguration.featureGates` (where the
/// HyperConverged's `spec.featureGates` reaches through its reconcile).
pub fn feature_gate_on(kubevirts: &[Value], gate: &str) -> bool {
    kubevirts.iter().any(|k| {
        k.pointer("/spec/configuration/developerConfiguration/featureGates")
            .and_then(Value::as_array)
            .is_some_and(|g| g.iter().any(|g| g.as_str() == Some(gate)))
    })
}

kstruct! {
    /// Memory overcommit.
    pub struct HigherWorkloadDensity {
        pub memory_overcommit_percentage: Option<i32>,
    }
}

kstruct! {
    /// Health of the stack.
    pub struct HyperConvergedStatus {
        pub conditions: Option<Vec<KubeVirtCondition>>,
        pub related_objects: Option<Vec<k8s_openapi::api::core::v1::ObjectReference>>,
        pub versions: Option<Vec<ComponentVersion>>,
        pub observed_generation: Option<i64>,
        #[serde(flatten)]
        pub other: Map<String, Value>,
    }
}

kstruct! {
    /// A component and its version.
    pub struct ComponentVersion {
        pub name: String,
        pub version: String,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn reads_feature_gates() {
        let on = json!({"spec": {"configuration": {"developerConfiguration":
            {"featureGates": ["Snapshot", "HostDisk"]}}}});
        let off = json!({"spec": {"configuration": {"developerConfiguration":
            {"featureGates": ["Snapshot"]}}}});
        assert!(super::feature_gate_on(&[json!({}), on], "HostDisk"));
        assert!(!super::feature_gate_on(&[off], "HostDisk"));
        assert!(!super::feature_gate_on(&[], "HostDisk"));
    }

    #[test]
    fn collects_insecure_registries() {
        let a = json!({"spec": {"config": {"insecureRegistries": ["a:5000", "b"]}}});
        let cdi = json!({"spec": {"config": {"insecureRegistries": ["b", "c"]}}});
        assert_eq!(
            super::insecure_registries(&[a, json!({}), cdi]),
            vec!["a:5000", "b", "c"]
        );
        let typed: super::HyperConverged = serde_json::from_value(
            json!({"spec": {"storageImport": {"insecureRegistries": ["x"]}}}),
        )
        .unwrap();
        let spec = typed.spec.unwrap();
        assert_eq!(
            spec.storage_import.unwrap().insecure_registries.unwrap(),
            vec!["x"]
        );
        assert!(spec.other.is_empty());
    }

    #[test]
    fn transfer_timeouts_from_hco_then_cdi() {
        let hco = json!({"spec": {"storageImport": {"allowedImportCIDRs": ["10.0.0.0/8", 5]}}});
        assert_eq!(
            super::allowed_import_cidrs(&[hco.clone(), hco.clone()]),
            vec!["10.0.0.0/8".to_string(), "5".to_string()]
        );
        let typed: super::HyperConvergedSpec = serde_json::from_value(json!({
            "storageImport": {"allowedImportCIDRs": ["127.0.0.0/8"]}
        }))
        .unwrap();
        assert_eq!(
            typed.storage_import.unwrap().allowed_import_cidrs.unwrap(),
            vec!["127.0.0.0/8".to_string()]
        );
        let hco = json!({"spec": {"storageImport": {"transferStallTimeoutSeconds": 2}}});
        let cdi = json!({"spec": {"config": {"transferStallTimeoutSeconds": 9,
            "transferTimeoutSeconds": 30}}});
        assert_eq!(
            super::transfer_timeouts(&[hco], &[cdi]),
            (Some(2), Some(30))
        );
        assert_eq!(super::transfer_timeouts(&[], &[]), (None, None));
    }
}
