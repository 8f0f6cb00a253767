//! snapshot.kubevirt.io/v1beta1: VirtualMachineSnapshot, VirtualMachineSnapshotContent and
//! VirtualMachineRestore.

use k8s_openapi::api::core::v1::{PersistentVolumeClaimSpec, TypedLocalObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use super::vm::{VirtualMachineSpec, VirtualMachineStatus};
use super::vmi::Condition;

resource! {
    /// A point-in-time snapshot of a VM.
    VirtualMachineSnapshot, SnapshotSpec, SnapshotStatus
}

kstruct! {
    /// What to snapshot.
    pub struct SnapshotSpec {
        pub source: TypedLocalObjectReference,
        /// `Delete` or `Retain`.
        pub deletion_policy: Option<String>,
        /// How long the snapshot may take before it fails (a duration).
        pub failure_deadline: Option<String>,
    }
}

kstruct! {
    /// Progress of a snapshot.
    pub struct SnapshotStatus {
        #[serde(rename = "sourceUID")]
        pub source_uid: Option<String>,
        pub virtual_machine_snapshot_content_name: Option<String>,
        pub creation_time: Option<Time>,
        /// `InProgress`, `Succeeded`, `Failed`, `Unknown`.
        pub phase: Option<String>,
        pub ready_to_use: Option<bool>,
        pub error: Option<SnapshotError>,
        pub conditions: Option<Vec<Condition>>,
        pub indications: Option<Vec<String>>,
    }
}

kstruct! {
    /// The last error of a snapshot or restore.
    pub struct SnapshotError {
        pub time: Option<Time>,
        pub message: Option<String>,
    }
}

resource! {
    /// The captured VM and volume snapshots behind a VirtualMachineSnapshot.
    VirtualMachineSnapshotContent, SnapshotContentSpec, SnapshotContentStatus
}

kstruct! {
    /// The captured content.
    pub struct SnapshotContentSpec {
        /// The snapshot this content belongs to.
        pub virtual_machine_snapshot_name: Option<String>,
        #[serde(default)]
        pub source: SnapshotContentSource,
        pub volume_backups: Option<Vec<VolumeBackup>>,
    }
}

kstruct! {
    /// The VM as it was.
    pub struct SnapshotContentSource {
        pub virtual_machine: Option<CapturedVirtualMachine>,
    }
}

kstruct! {
    /// A VM copy inside snapshot content.
    pub struct CapturedVirtualMachine {
        pub api_version: Option<String>,
        pub kind: Option<String>,
        pub metadata: Option<ObjectMeta>,
        pub spec: Option<VirtualMachineSpec>,
        pub status: Option<VirtualMachineStatus>,
    }
}

kstruct! {
    /// One volume's snapshot.
    pub struct VolumeBackup {
        pub volume_name: String,
        pub persistent_volume_claim: CapturedClaim,
        pub volume_snapshot_name: Option<String>,
    }
}

kstruct! {
    /// A PVC as captured.
    pub struct CapturedClaim {
        pub metadata: Option<ObjectMeta>,
        pub spec: Option<PersistentVolumeClaimSpec>,
    }
}

kstruct! {
    /// Readiness of the content.
    pub struct SnapshotContentStatus {
        pub creation_time: Option<Time>,
        pub ready_to_use: Option<bool>,
        pub error: Option<SnapshotError>,
        pub volume_snapshot_status: Option<Vec<VolumeSnapshotState>>,
    }
}

kstruct! {
    /// Readiness of one volume snapshot.
    pub struct VolumeSnapshotState {
        pub volume_snapshot_name: String,
        pub creation_time: Option<Time>,
        pub ready_to_use: Option<bool>,
        pub error: Option<SnapshotError>,
    }
}

resource! {
    /// Restore a VM from a snapshot.
    VirtualMachineRestore, RestoreSpec, RestoreStatus
}

kstruct! {
    /// Which snapshot into which target.
    pub struct RestoreSpec {
        pub target: TypedLocalObjectReference,
        /// The snapshot to restore from.
        pub virtual_machine_snapshot_name: String,
        /// JSON patches applied to the restored VM.
        pub patches: Option<Vec<String>>,
        /// When to restore into a running target: `StopTarget`, `WaitGracePeriod`, `WaitEventually`, `FailImmediate`.
        pub target_readiness_policy: Option<String>,
        /// How restored volumes are named: `RandomizeNames` or `InPlace`.
        pub volume_restore_policy: Option<String>,
        /// Who owns the restored volumes: `Vm` or `None`.
        pub volume_ownership_policy: Option<String>,
        pub volume_restore_overrides: Option<Vec<VolumeRestoreOverride>>,
    }
}

kstruct! {
    /// Name, labels and annotations of one restored volume.
    pub struct VolumeRestoreOverride {
        pub volume_name: Option<String>,
        pub restore_name: Option<String>,
        pub labels: Option<std::collections::BTreeMap<String, String>>,
        pub annotations: Option<std::collections::BTreeMap<String, String>>,
    }
}

kstruct! {
    /// Progress of a restore.
    pub struct RestoreStatus {
        pub restores: Option<Vec<VolumeRestore>>,
        pub restore_time: Option<Time>,
        pub deleted_data_volumes: Option<Vec<String>>,
        pub complete: Option<bool>,
        pub conditions: Option<Vec<Condition>>,
    }
}

kstruct! {
    /// One restored volume.
    pub struct VolumeRestore {
        pub volume_name: String,
        pub persistent_volume_claim: String,
        pub volume_snapshot_name: String,
        pub data_volume_name: Option<String>,
    }
}
