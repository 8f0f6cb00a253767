//! hco.kubevirt.io/v1beta1 HyperConverged: the one configuration object for the whole stack.
//! Fields ferrovirt reads are typed; the rest are kept as given.

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
        pub feature_gates: Option<BTreeMap<String, bool>>,
        pub live_migration_config: Option<LiveMigrationConfig>,
        pub eviction_strategy: Option<String>,
        pub infra: Option<HcoComponentConfig>,
        pub workloads: Option<HcoComponentConfig>,
        #[serde(rename = "defaultCPUModel")]
        pub default_cpu_model: Option<String>,
        pub default_runtime_class: Option<String>,
        pub vm_state_storage_class: Option<String>,
        pub higher_workload_density: Option<HigherWorkloadDensity>,
        pub uninstall_strategy: Option<String>,
        pub common_templates_namespace: Option<String>,
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
    /// Where infra or workload components run.
    pub struct HcoComponentConfig {
        pub node_placement: Option<NodePlacement>,
    }
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
