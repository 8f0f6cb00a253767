//! VirtualMachine (kubevirt.io/v1): a stateful VM definition controlled by a run strategy.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use super::vmi::{Condition, VirtualMachineInstanceTemplateSpec};
use crate::cdi::{DataVolumeSpec, DataVolumeStatus};

resource! {
    /// A virtual machine.
    VirtualMachine, VirtualMachineSpec, VirtualMachineStatus
}

kstruct! {
    /// What the VM is and whether it should run.
    pub struct VirtualMachineSpec {
        /// Deprecated: use `runStrategy`. Mutually exclusive with it.
        pub running: Option<bool>,
        /// When a VMI should exist: `Always`, `Halted`, `Manual`, `RerunOnFailure`, `Once` or `WaitAsReceiver`.
        pub run_strategy: Option<RunStrategy>,
        /// The instancetype the VM's resources and devices come from.
        pub instancetype: Option<InstancetypeMatcher>,
        /// The preference the VM's defaults come from.
        pub preference: Option<PreferenceMatcher>,
        /// The VMI the VM starts: its metadata and spec.
        #[serde(default)]
        pub template: VirtualMachineInstanceTemplateSpec,
        /// DataVolumes created with the VM and owned by it, for its disks.
        pub data_volume_templates: Option<Vec<DataVolumeTemplateSpec>>,
        /// How volume changes reach a running VM: `Replacement` or `Migration`.
        pub update_volumes_strategy: Option<String>,
    }
}

kenum! {
    /// When the VM's VMI should exist.
    pub enum RunStrategy {
        Always,
        Halted,
        Manual,
        RerunOnFailure,
        Once,
        WaitAsReceiver,
    }
}

impl RunStrategy {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            RunStrategy::Always => "Always",
            RunStrategy::Halted => "Halted",
            RunStrategy::Manual => "Manual",
            RunStrategy::RerunOnFailure => "RerunOnFailure",
            RunStrategy::Once => "Once",
            RunStrategy::WaitAsReceiver => "WaitAsReceiver",
        }
    }
}

kstruct! {
    /// Reference to a (Cluster)Instancetype.
    pub struct InstancetypeMatcher {
        pub name: Option<String>,
        /// `VirtualMachineInstancetype` or `VirtualMachineClusterInstancetype` (default).
        pub kind: Option<String>,
        pub revision_name: Option<String>,
        pub infer_from_volume: Option<String>,
        pub infer_from_volume_failure_policy: Option<String>,
    }
}

kstruct! {
    /// Reference to a (Cluster)Preference.
    pub struct PreferenceMatcher {
        pub name: Option<String>,
        /// `VirtualMachinePreference` or `VirtualMachineClusterPreference` (default).
        pub kind: Option<String>,
        pub revision_name: Option<String>,
        pub infer_from_volume: Option<String>,
        pub infer_from_volume_failure_policy: Option<String>,
    }
}

kstruct! {
    /// A DataVolume created and owned by the VM.
    pub struct DataVolumeTemplateSpec {
        pub api_version: Option<String>,
        pub kind: Option<String>,
        pub metadata: Option<ObjectMeta>,
        #[serde(default)]
        pub spec: DataVolumeSpec,
        pub status: Option<DataVolumeStatus>,
    }
}

kenum! {
    /// The human-readable status `kubectl get vm` prints.
    pub enum PrintableStatus {
        Stopped,
        Provisioning,
        Starting,
        Running,
        Paused,
        Stopping,
        Terminating,
        CrashLoopBackOff,
        Migrating,
        Unknown,
        ErrorUnschedulable,
        ErrImagePull,
        ImagePullBackOff,
        ErrorPvcNotFound,
        DataVolumeError,
        WaitingForVolumeBinding,
        WaitingForReceiver,
    }
}

/// VM condition types.
pub mod vm_condition {
    pub const READY: &str = "Ready";
    pub const FAILURE: &str = "Failure";
    pub const PAUSED: &str = "Paused";
    pub const RESTART_REQUIRED: &str = "RestartRequired";
    pub const INITIALIZED: &str = "Initialized";
    pub const LIVE_MIGRATABLE: &str = "LiveMigratable";
    pub const AGENT_CONNECTED: &str = "AgentConnected";
    pub const DATA_VOLUMES_READY: &str = "DataVolumesReady";
}

kstruct! {
    /// Observed state of a VM.
    pub struct VirtualMachineStatus {
        /// The snapshot being taken now, if any.
        pub snapshot_in_progress: Option<String>,
        /// The restore being done now, if any.
        pub restore_in_progress: Option<String>,
        /// Whether the VM's VMI exists.
        pub created: Option<bool>,
        /// Whether the VM's VMI is running and ready.
        pub ready: Option<bool>,
        /// A one-word summary of the VM's state (`Running`, `Stopped`, ...).
        pub printable_status: Option<PrintableStatus>,
        /// The VM's current conditions (Ready, Paused, ...).
        pub conditions: Option<Vec<Condition>>,
        /// Pending start and stop requests for the controller.
        pub state_change_requests: Option<Vec<StateChangeRequest>>,
        /// Whether each volume supports snapshots.
        pub volume_snapshot_statuses: Option<Vec<VolumeSnapshotStatus>>,
        /// Recent start failures and when the next retry is.
        pub start_failure: Option<StartFailure>,
        /// The generation of the VM the controller last acted on.
        pub observed_generation: Option<i64>,
        /// The latest generation of the VM spec.
        pub desired_generation: Option<i64>,
        /// The run strategy in effect.
        pub run_strategy: Option<RunStrategy>,
        /// The instancetype revision the VM uses.
        pub instancetype_ref: Option<InstancetypeStatusRef>,
        /// The preference revision the VM uses.
        pub preference_ref: Option<InstancetypeStatusRef>,
    }
}

kstruct! {
    /// A pending start/stop request.
    pub struct StateChangeRequest {
        /// `Start` or `Stop`.
        pub action: String,
        pub data: Option<std::collections::BTreeMap<String, String>>,
        pub uid: Option<String>,
    }
}

kstruct! {
    /// Whether a volume can be snapshotted.
    pub struct VolumeSnapshotStatus {
        pub name: String,
        pub enabled: bool,
        pub reason: Option<String>,
    }
}

kstruct! {
    /// Crash-loop back-off tracking.
    pub struct StartFailure {
        pub retry_after_timestamp: Option<Time>,
        pub consecutive_fail_count: Option<i32>,
        pub last_failed_vmi_uid: Option<String>,
    }
}

kstruct! {
    /// The instancetype or preference revision the VM is bound to.
    pub struct InstancetypeStatusRef {
        pub name: Option<String>,
        pub kind: Option<String>,
        pub controller_revision_ref: Option<ControllerRevisionRef>,
    }
}

kstruct! {
    /// A ControllerRevision by name.
    pub struct ControllerRevisionRef {
        pub name: String,
    }
}
