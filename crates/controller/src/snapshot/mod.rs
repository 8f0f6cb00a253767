//! Snapshots and restores (docs/snapshots.md): KubeVirt's VirtualMachineSnapshot /
//! VirtualMachineSnapshotContent / VirtualMachineRestore (snapshot.kubevirt.io/v1beta1) on top
//! of Kubernetes' VolumeSnapshot / VolumeSnapshotContent / VolumeSnapshotClass
//! (snapshot.storage.k8s.io/v1), which ferrovirt's provisioners implement with
//! copy-on-write layer chains (`ferrovirt_storage::snapshot`).
//!
//! - [`vm_snapshot`]: the VirtualMachineSnapshot step (pure); [`online`]: a running VM's
//!   snapshot taken through its node's agent (pure parts);
//! - [`volume`]: the VolumeSnapshot decision (pure) and the restore of a claim whose
//!   `dataSource` is a VolumeSnapshot;
//! - [`populate`]: a claim provisioned from a VolumeSnapshot filled from its layers;
//! - [`restore`]: the VirtualMachineRestore step (pure);
//! - [`clone`]: the VirtualMachineClone step (pure), applied by `clone_loop`;
//! - [`loops`]: the controllers that apply them; [`reclaim_loop`]: deleted snapshots' layers
//!   released and merged away;
//! - [`resources`]: `kube::Resource` wrappers of the kinds.

pub mod clone;
mod clone_loop;
pub mod loops;
pub mod online;
pub mod populate;
pub mod reclaim_loop;
pub mod reclaim_online;
pub mod resources;
pub mod restore;
pub mod vm_snapshot;
pub mod volume;

pub use loops::run;

use ferrovirt_api::kubevirt::vmi::Condition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::conditions::{condition, set};

/// The conditions of a finished snapshot or restore: Progressing False and Ready True, both
/// with reason `Succeeded`.
fn set_succeeded(conditions: &mut Vec<Condition>, now: &Time) {
    set(
        conditions,
        condition(
            "Progressing",
            false,
            Some("Succeeded"),
            Some("Operation complete"),
        ),
        now,
    );
    set(
        conditions,
        condition("Ready", true, Some("Succeeded"), Some("Operation complete")),
        now,
    );
}
