//! VirtualMachineInstance (kubevirt.io/v1): a running VM. Spec, status, phases and conditions.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, ExecAction, HTTPGetAction, PodDNSConfig, TCPSocketAction, Toleration,
    TopologySpreadConstraint,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use super::domain::{DomainSpec, Empty};
use super::volumes::{Network, Volume};

resource! {
    /// A running virtual machine.
    VirtualMachineInstance, VirtualMachineInstanceSpec, VirtualMachineInstanceStatus
}

kstruct! {
    /// What a VMI runs.
    pub struct VirtualMachineInstanceSpec {
        /// The priority class of the VMI, for scheduling and preemption.
        pub priority_class_name: Option<String>,
        /// The virtual hardware: CPU, memory, firmware, features and devices.
        #[serde(default)]
        pub domain: DomainSpec,
        /// Labels a node must have to run the VMI.
        pub node_selector: Option<BTreeMap<String, String>>,
        /// Node and VMI affinity and anti-affinity rules for scheduling.
        pub affinity: Option<Affinity>,
        /// The scheduler that places the VMI.
        pub scheduler_name: Option<String>,
        /// Node taints the VMI tolerates.
        pub tolerations: Option<Vec<Toleration>>,
        /// How VMIs spread across topology domains (zones, nodes).
        pub topology_spread_constraints: Option<Vec<TopologySpreadConstraint>>,
        /// `None`, `LiveMigrate`, `LiveMigrateIfPossible` or `External`.
        pub eviction_strategy: Option<String>,
        /// `Paused` to start paused.
        pub start_strategy: Option<String>,
        /// Seconds the guest gets to shut down after an ACPI power-off before it is killed.
        pub termination_grace_period_seconds: Option<i64>,
        /// Storage the disks and filesystems are backed by, matched by name.
        pub volumes: Option<Vec<Volume>>,
        /// Restart the VMI when this probe fails.
        pub liveness_probe: Option<Probe>,
        /// Mark the VMI ready only when this probe succeeds.
        pub readiness_probe: Option<Probe>,
        /// The guest hostname (defaults to the VMI name).
        pub hostname: Option<String>,
        /// With a headless Service of this name, the guest gets a DNS name under it.
        pub subdomain: Option<String>,
        /// Networks the interfaces connect to, matched by name.
        pub networks: Option<Vec<Network>>,
        /// How the guest's DNS is configured (`ClusterFirst`, `Default`, `None`).
        pub dns_policy: Option<String>,
        /// Extra DNS settings (nameservers, searches, options).
        pub dns_config: Option<PodDNSConfig>,
        /// SSH keys and passwords injected into the guest.
        pub access_credentials: Option<Vec<AccessCredential>>,
        /// The CPU architecture of the guest (`amd64`, `arm64`, `s390x`).
        pub architecture: Option<String>,
        /// The ServiceAccount the VMI runs as.
        pub service_account_name: Option<String>,
        /// DRA resource claims the VMI's devices use.
        pub resource_claims: Option<Vec<PodResourceClaim>>,
        /// Volumes for utilities (backup targets) not attached to the guest.
        pub utility_volumes: Option<Vec<UtilityVolume>>,
    }
}

kstruct! {
    /// A named DRA resource claim, by claim or by claim template.
    pub struct PodResourceClaim {
        pub name: String,
        pub resource_claim_name: Option<String>,
        pub resource_claim_template_name: Option<String>,
    }
}

kstruct! {
    /// A PVC mounted for a utility, not the guest.
    pub struct UtilityVolume {
        pub name: String,
        pub claim_name: String,
        pub read_only: Option<bool>,
        #[serde(rename = "type")]
        pub type_: Option<String>,
    }
}

kstruct! {
    /// Template of a VMI inside a VM or replica set.
    pub struct VirtualMachineInstanceTemplateSpec {
        /// Labels and annotations of the VMIs made from this template.
        pub metadata: Option<ObjectMeta>,
        /// The spec of the VMIs made from this template.
        pub spec: Option<VirtualMachineInstanceSpec>,
    }
}

kstruct! {
    /// A liveness or readiness probe.
    pub struct Probe {
        pub exec: Option<ExecAction>,
        pub http_get: Option<HTTPGetAction>,
        pub tcp_socket: Option<TCPSocketAction>,
        pub guest_agent_ping: Option<Empty>,
        pub initial_delay_seconds: Option<i32>,
        pub timeout_seconds: Option<i32>,
        pub period_seconds: Option<i32>,
        pub success_threshold: Option<i32>,
        pub failure_threshold: Option<i32>,
    }
}

kstruct! {
    /// SSH keys or passwords injected into the guest.
    pub struct AccessCredential {
        pub ssh_public_key: Option<SshPublicKeyAccessCredential>,
        pub user_password: Option<UserPasswordAccessCredential>,
    }
}

kstruct! {
    /// Authorized keys from a Secret.
    pub struct SshPublicKeyAccessCredential {
        pub source: CredentialSource,
        pub propagation_method: CredentialPropagation,
    }
}

kstruct! {
    /// User passwords from a Secret.
    pub struct UserPasswordAccessCredential {
        pub source: CredentialSource,
        pub propagation_method: CredentialPropagation,
    }
}

kstruct! {
    /// Where credentials come from.
    pub struct CredentialSource {
        pub secret: Option<SecretRef>,
    }
}

kstruct! {
    /// A Secret by name.
    pub struct SecretRef {
        pub secret_name: String,
    }
}

kstruct! {
    /// How credentials reach the guest.
    pub struct CredentialPropagation {
        pub config_drive: Option<Empty>,
        pub no_cloud: Option<Empty>,
        pub qemu_guest_agent: Option<QemuGuestAgentPropagation>,
    }
}

kstruct! {
    /// Propagation through the guest agent for these users.
    pub struct QemuGuestAgentPropagation {
        pub users: Option<Vec<String>>,
    }
}

kenum! {
    /// Lifecycle phase of a VMI.
    pub enum VmiPhase {
        #[serde(rename = "")]
        Unset,
        Pending,
        Scheduling,
        Scheduled,
        Running,
        Succeeded,
        Failed,
        Unknown,
    }
}

/// VMI condition types.
pub mod vmi_condition {
    pub const READY: &str = "Ready";
    pub const LIVE_MIGRATABLE: &str = "LiveMigratable";
    pub const STORAGE_LIVE_MIGRATABLE: &str = "StorageLiveMigratable";
    pub const PAUSED: &str = "Paused";
    pub const AGENT_CONNECTED: &str = "AgentConnected";
    pub const PROVISIONING: &str = "Provisioning";
    pub const SYNCHRONIZED: &str = "Synchronized";
    pub const FAILURE: &str = "Failure";
    pub const POD_SCHEDULED: &str = "PodScheduled";
    pub const DATA_VOLUMES_READY: &str = "DataVolumesReady";
    pub const MIGRATION_REQUIRED: &str = "MigrationRequired";
}

kstruct! {
    /// A status condition of a VMI or VM (KubeVirt's shape, with lastProbeTime).
    pub struct Condition {
        #[serde(rename = "type")]
        pub type_: String,
        /// `True`, `False` or `Unknown`.
        pub status: String,
        pub last_probe_time: Option<Time>,
        pub last_transition_time: Option<Time>,
        pub reason: Option<String>,
        pub message: Option<String>,
    }
}

kstruct! {
    /// Observed state of a VMI.
    pub struct VirtualMachineInstanceStatus {
        pub node_name: Option<String>,
        pub reason: Option<String>,
        pub conditions: Option<Vec<Condition>>,
        pub phase: Option<VmiPhase>,
        pub phase_transition_timestamps: Option<Vec<PhaseTransition>>,
        pub interfaces: Option<Vec<VmiInterfaceStatus>>,
        #[serde(rename = "guestOSInfo")]
        pub guest_os_info: Option<GuestOsInfo>,
        /// `frozen` while a requested freeze (the `freeze` subresource) holds the guest's
        /// filesystems; absent otherwise.
        #[serde(rename = "fsFreezeStatus")]
        pub fs_freeze_status: Option<String>,
        pub migration_state: Option<MigrationState>,
        pub migration_method: Option<String>,
        pub qos_class: Option<String>,
        pub launcher_container_image_version: Option<String>,
        pub evacuation_node_name: Option<String>,
        pub active_pods: Option<BTreeMap<String, String>>,
        pub volume_status: Option<Vec<VolumeStatus>>,
        pub virtual_machine_revision_name: Option<String>,
        pub runtime_user: Option<i64>,
        #[serde(rename = "VSOCKCID")]
        pub vsock_cid: Option<u32>,
        pub machine: Option<super::domain::Machine>,
        #[serde(rename = "currentCPUTopology")]
        pub current_cpu_topology: Option<CpuTopology>,
        pub memory: Option<MemoryStatus>,
    }
}

kstruct! {
    /// When the VMI entered a phase.
    pub struct PhaseTransition {
        pub phase: Option<VmiPhase>,
        pub phase_transition_timestamp: Option<Time>,
    }
}

kstruct! {
    /// A guest NIC as observed.
    pub struct VmiInterfaceStatus {
        pub name: Option<String>,
        pub ip_address: Option<String>,
        pub ip_addresses: Option<Vec<String>>,
        pub mac: Option<String>,
        pub interface_name: Option<String>,
        pub info_source: Option<String>,
        pub queue_count: Option<i32>,
        pub link_state: Option<String>,
    }
}

kstruct! {
    /// Guest OS as reported by the guest agent.
    pub struct GuestOsInfo {
        pub name: Option<String>,
        pub kernel_release: Option<String>,
        pub version: Option<String>,
        pub pretty_name: Option<String>,
        pub version_id: Option<String>,
        pub kernel_version: Option<String>,
        pub machine: Option<String>,
        pub id: Option<String>,
    }
}

kstruct! {
    /// Progress of the latest live migration.
    pub struct MigrationState {
        pub start_timestamp: Option<Time>,
        pub end_timestamp: Option<Time>,
        pub target_node: Option<String>,
        pub target_node_address: Option<String>,
        pub target_pod: Option<String>,
        /// Ports on `targetNodeAddress` the source connects to (port → 0, as KubeVirt).
        pub target_direct_migration_node_ports: Option<BTreeMap<String, i32>>,
        /// The target's QEMU was seen waiting for the incoming stream.
        pub target_node_domain_detected: Option<bool>,
        pub target_node_domain_ready_timestamp: Option<Time>,
        pub source_node: Option<String>,
        pub completed: Option<bool>,
        pub failed: Option<bool>,
        pub abort_requested: Option<bool>,
        pub abort_status: Option<String>,
        pub failure_reason: Option<String>,
        pub migration_uid: Option<String>,
        pub mode: Option<String>,
        /// The settings this migration runs with (cluster config and policy merged).
        pub migration_configuration: Option<super::misc::MigrationConfiguration>,
        /// The MigrationPolicy that applied, if any.
        pub migration_policy_name: Option<String>,
    }
}

kstruct! {
    /// State of one volume.
    pub struct VolumeStatus {
        pub name: String,
        pub target: Option<String>,
        pub phase: Option<String>,
        pub reason: Option<String>,
        pub message: Option<String>,
        pub size: Option<i64>,
    }
}

kstruct! {
    /// vCPU topology in use.
    pub struct CpuTopology {
        pub cores: Option<u32>,
        pub sockets: Option<u32>,
        pub threads: Option<u32>,
    }
}

kstruct! {
    /// Guest memory as booted and as currently visible.
    pub struct MemoryStatus {
        pub guest_at_boot: Option<Quantity>,
        pub guest_current: Option<Quantity>,
        pub guest_requested: Option<Quantity>,
    }
}
