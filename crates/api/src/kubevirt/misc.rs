//! Smaller kubevirt.io/v1 kinds (VirtualMachineInstanceMigration, VirtualMachineInstanceReplicaSet,
//! KubeVirt) and migrations.kubevirt.io/v1alpha1 MigrationPolicy.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};
use serde_json::Map;
use serde_json::Value;

use super::vmi::{Condition, MigrationState, VirtualMachineInstanceTemplateSpec};

resource! {
    /// A request to live-migrate a VMI.
    VirtualMachineInstanceMigration, MigrationSpec, MigrationStatus
}

kstruct! {
    /// Which VMI to migrate.
    pub struct MigrationSpec {
        /// The VMI to migrate (in the migration's namespace).
        pub vmi_name: Option<String>,
        /// Extra node labels the migration target must have.
        pub added_node_selector: Option<BTreeMap<String, String>>,
        /// Cross-cluster migration: the source side.
        pub send_to: Option<MigrationSource>,
        /// Cross-cluster migration: the target side.
        pub receive: Option<MigrationTarget>,
        /// `system-critical`, `user-triggered` or `system-maintenance`.
        pub priority: Option<String>,
    }
}

kstruct! {
    /// Where a decentralized migration sends the VMI.
    pub struct MigrationSource {
        #[serde(rename = "migrationID")]
        pub migration_id: String,
        #[serde(rename = "connectURL")]
        pub connect_url: String,
    }
}

kstruct! {
    /// The receiving side of a decentralized migration.
    pub struct MigrationTarget {
        #[serde(rename = "migrationID")]
        pub migration_id: String,
    }
}

kenum! {
    /// Phase of a migration.
    pub enum MigrationPhase {
        #[serde(rename = "")]
        Unset,
        Pending,
        Scheduling,
        Scheduled,
        PreparingTarget,
        TargetReady,
        Running,
        Succeeded,
        Failed,
        WaitingForSync,
        Synchronizing,
    }
}

kstruct! {
    /// Observed state of a migration.
    pub struct MigrationStatus {
        pub phase: Option<MigrationPhase>,
        pub conditions: Option<Vec<Condition>>,
        pub phase_transition_timestamps: Option<Vec<MigrationPhaseTransition>>,
        pub migration_state: Option<MigrationState>,
    }
}

kstruct! {
    /// When a migration entered a phase.
    pub struct MigrationPhaseTransition {
        pub phase: Option<MigrationPhase>,
        pub phase_transition_timestamp: Option<Time>,
    }
}

resource! {
    /// A set of identical VMIs.
    VirtualMachineInstanceReplicaSet, ReplicaSetSpec, ReplicaSetStatus
}

kstruct! {
    /// Desired replicas and their template.
    pub struct ReplicaSetSpec {
        /// How many VMIs to keep (default 1).
        pub replicas: Option<i32>,
        pub selector: Option<LabelSelector>,
        #[serde(default)]
        pub template: VirtualMachineInstanceTemplateSpec,
        /// Stop adding and removing VMIs while true.
        pub paused: Option<bool>,
    }
}

kstruct! {
    /// Observed replicas.
    pub struct ReplicaSetStatus {
        pub replicas: Option<i32>,
        pub ready_replicas: Option<i32>,
        pub conditions: Option<Vec<Condition>>,
        pub label_selector: Option<String>,
    }
}

resource! {
    /// KubeVirt's installation and cluster-wide configuration.
    KubeVirt, KubeVirtSpec, KubeVirtStatus
}

kstruct! {
    /// Install options and configuration.
    pub struct KubeVirtSpec {
        /// Tag of the component images.
        pub image_tag: Option<String>,
        /// Registry the component images come from.
        pub image_registry: Option<String>,
        /// Pull policy of the KubeVirt component images.
        pub image_pull_policy: Option<String>,
        /// Namespace Prometheus runs in.
        pub monitor_namespace: Option<String>,
        /// Prometheus service account allowed to scrape.
        pub monitor_account: Option<String>,
        /// Whether removal waits for VMs to go (`BlockUninstallIfWorkloadsExist`).
        pub uninstall_strategy: Option<String>,
        pub certificate_rotate_strategy: Option<FreeForm>,
        pub workload_update_strategy: Option<FreeForm>,
        pub configuration: Option<KubeVirtConfiguration>,
        pub infra: Option<ComponentConfig>,
        pub workloads: Option<ComponentConfig>,
        pub customize_components: Option<FreeForm>,
        pub image_pull_secrets: Option<Vec<k8s_openapi::api::core::v1::LocalObjectReference>>,
        /// Product name label put on the deployed components.
        pub product_name: Option<String>,
        /// Product version label put on the deployed components.
        pub product_version: Option<String>,
        /// Product component label put on the deployed components.
        pub product_component: Option<String>,
        /// Namespace ServiceMonitors are created in.
        pub service_monitor_namespace: Option<String>,
    }
}

kstruct! {
    /// Cluster-wide configuration; fields ferrovirt does not model are kept as given.
    pub struct KubeVirtConfiguration {
        pub developer_configuration: Option<DeveloperConfiguration>,
        pub eviction_strategy: Option<String>,
        pub vm_rollout_strategy: Option<String>,
        pub migrations: Option<MigrationConfiguration>,
        pub machine_type: Option<String>,
        /// CPU model a VMI without `spec.domain.cpu.model` gets when it is created.
        pub cpu_model: Option<String>,
        /// Named CPU models no node offers (model → true).
        #[serde(rename = "obsoleteCPUModels")]
        pub obsolete_cpu_models: Option<std::collections::BTreeMap<String, bool>>,
        #[serde(flatten)]
        pub other: Map<String, Value>,
    }
}

kstruct! {
    /// Feature gates and developer knobs.
    pub struct DeveloperConfiguration {
        pub feature_gates: Option<Vec<String>>,
        pub use_emulation: Option<bool>,
        #[serde(flatten)]
        pub other: Map<String, Value>,
    }
}

kstruct! {
    /// Cluster-wide migration limits.
    pub struct MigrationConfiguration {
        pub parallel_migrations_per_cluster: Option<u32>,
        pub parallel_outbound_migrations_per_node: Option<u32>,
        pub bandwidth_per_migration: Option<Quantity>,
        #[serde(rename = "completionTimeoutPerGiB")]
        pub completion_timeout_per_gib: Option<i64>,
        pub progress_timeout: Option<i64>,
        pub allow_auto_converge: Option<bool>,
        pub allow_post_copy: Option<bool>,
        pub allow_workload_disruption: Option<bool>,
        pub network: Option<String>,
        #[serde(flatten)]
        pub other: Map<String, Value>,
    }
}

kstruct! {
    /// Placement of infra or workload components.
    pub struct ComponentConfig {
        pub node_placement: Option<NodePlacement>,
        pub replicas: Option<u8>,
    }
}

kstruct! {
    /// Node selector, affinity and tolerations.
    pub struct NodePlacement {
        pub node_selector: Option<BTreeMap<String, String>>,
        pub affinity: Option<Affinity>,
        pub tolerations: Option<Vec<Toleration>>,
    }
}

kstruct! {
    /// An object whose fields are kept as given.
    pub struct FreeForm {
        #[serde(flatten)]
        pub fields: Map<String, Value>,
    }
}

kstruct! {
    /// Install progress.
    pub struct KubeVirtStatus {
        pub phase: Option<String>,
        pub conditions: Option<Vec<KubeVirtCondition>>,
        pub operator_version: Option<String>,
        pub target_kube_virt_version: Option<String>,
        pub observed_kube_virt_version: Option<String>,
        pub observed_generation: Option<i64>,
        pub default_architecture: Option<String>,
    }
}

kstruct! {
    /// An operator condition (Available, Progressing, Degraded, Created).
    pub struct KubeVirtCondition {
        #[serde(rename = "type")]
        pub type_: String,
        pub status: String,
        pub last_probe_time: Option<Time>,
        pub last_transition_time: Option<Time>,
        pub last_heartbeat_time: Option<Time>,
        pub reason: Option<String>,
        pub message: Option<String>,
    }
}

resource! {
    /// Migration settings for VMIs matching selectors.
    MigrationPolicy, MigrationPolicySpec, MigrationPolicyStatus
}

kstruct! {
    /// Settings and which VMIs they apply to.
    pub struct MigrationPolicySpec {
        pub selectors: Option<MigrationPolicySelectors>,
        /// Throttle the guest's vCPUs when a migration does not converge.
        pub allow_auto_converge: Option<bool>,
        pub bandwidth_per_migration: Option<Quantity>,
        /// Seconds per GiB of guest memory before a migration is cancelled.
        #[serde(rename = "completionTimeoutPerGiB")]
        pub completion_timeout_per_gib: Option<i64>,
        /// Allow switching to post-copy migration when pre-copy does not converge.
        pub allow_post_copy: Option<bool>,
        /// Allow pausing the guest to finish a migration.
        pub allow_workload_disruption: Option<bool>,
        /// Longest pause of the guest allowed at the switch-over, in milliseconds.
        pub max_downtime_ms: Option<u64>,
        pub experimental: Option<FreeForm>,
    }
}

kstruct! {
    /// Label selectors on namespaces and VMIs.
    pub struct MigrationPolicySelectors {
        pub namespace_selector: Option<BTreeMap<String, String>>,
        pub virtual_machine_instance_selector: Option<BTreeMap<String, String>>,
    }
}

kstruct! {
    /// MigrationPolicy status (currently empty).
    pub struct MigrationPolicyStatus {}
}
