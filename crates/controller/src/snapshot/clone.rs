//! The VirtualMachineClone step (pure; clone.kubevirt.io/v1beta1, docs/snapshots.md "Clone"):
//! a clone is built on a snapshot and a restore into a new VM, both owned by the clone and
//! deleted once it succeeded. Phases `SnapshotInProgress` (a VM source: `tmp-snapshot-<uid>`,
//! online when the VM runs) → `CreatingTargetVM` (`tmp-restore-<uid>` created with the clone's
//! changes as JSON patches) → `RestoreInProgress` → `Succeeded`, or `Failed` with the reason;
//! conditions `Ready` and `Progressing`.
//!
//! What differs in the copy ([`clone_patches`]): the source's labels and annotations filtered
//! (`labelFilters`, `annotationFilters`, the same for the template), MACs (`newMacAddresses`;
//! interfaces not named get a new one: the restore drops them), the SMBIOS serial
//! (`newSMBiosSerial`, else the clone's uid), the user's `patches`, and the volume names
//! (`volumeNamePolicy` → the restore's `volumeRestorePolicy`).

use std::time::Duration;

use k8s_openapi::api::core::v1::TypedLocalObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;
use serde_json::json;

use ferrovirt_api::kubevirt::clone::{CloneStatus, VirtualMachineClone, filter_keeps};
use ferrovirt_api::kubevirt::snapshot::{
    CapturedVirtualMachine, RestoreSpec, SnapshotSpec, VirtualMachineRestore,
    VirtualMachineSnapshot, VirtualMachineSnapshotContent,
};
use ferrovirt_api::kubevirt::vm::VirtualMachine;
use ferrovirt_api::kubevirt::vmi::Condition;

use crate::conditions::{condition, set};

pub const SNAPSHOT_IN_PROGRESS: &str = "SnapshotInProgress";
pub const CREATING_TARGET_VM: &str = "CreatingTargetVM";
pub const RESTORE_IN_PROGRESS: &str = "RestoreInProgress";
pub const SUCCEEDED: &str = "Succeeded";
pub const FAILED: &str = "Failed";

/// What a clone sees.
pub struct CloneInput<'a> {
    pub clone: &'a VirtualMachineClone,
    /// The source VM (a VM source).
    pub source_vm: Option<&'a VirtualMachine>,
    /// The snapshot the clone is made from: its own `tmp-snapshot-<uid>` (a VM source) or the
    /// source snapshot.
    pub snapshot: Option<&'a VirtualMachineSnapshot>,
    pub content: Option<&'a VirtualMachineSnapshotContent>,
    /// Its `tmp-restore-<uid>`.
    pub restore: Option<&'a VirtualMachineRestore>,
    /// A VM of the target's name exists.
    pub target_exists: bool,
    pub now: Timestamp,
}

/// The step's decision.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CloneStep {
    pub create_snapshot: Option<Box<VirtualMachineSnapshot>>,
    pub create_restore: Option<Box<VirtualMachineRestore>>,
    /// The intermediate snapshot and restore to delete (a succeeded clone).
    pub delete_snapshot: Option<String>,
    pub delete_restore: Option<String>,
    pub status: CloneStatus,
    pub requeue: Option<Duration>,
}

fn uid(c: &VirtualMachineClone) -> String {
    c.metadata.uid.clone().unwrap_or_else(|| "unknown".into())
}

/// The clone's own snapshot of a VM source.
pub fn snapshot_name(c: &VirtualMachineClone) -> String {
    format!("tmp-snapshot-{}", uid(c))
}

/// The clone's restore.
pub fn restore_name(c: &VirtualMachineClone) -> String {
    format!("tmp-restore-{}", uid(c))
}

/// Whether the source is a VirtualMachineSnapshot (else a VM).
pub fn from_snapshot(c: &VirtualMachineClone) -> bool {
    c.spec
        .as_ref()
        .is_some_and(|s| s.source.kind == "VirtualMachineSnapshot")
}

/// The target VM's name: `spec.target.name`, else `clone-<first 8 of the uid>`.
pub fn target_name(c: &VirtualMachineClone) -> String {
    c.spec
        .as_ref()
        .and_then(|s| s.target.as_ref())
        .map(|t| t.name.clone())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| format!("clone-{}", uid(c).chars().take(8).collect::<String>()))
}

/// The snapshot the clone reads: its own or the source snapshot.
pub fn used_snapshot(c: &VirtualMachineClone) -> String {
    if from_snapshot(c) {
        c.spec
            .as_ref()
            .map(|s| s.source.name.clone())
            .unwrap_or_default()
    } else {
        snapshot_name(c)
    }
}

/// JSON pointer escaping of one path segment.
fn esc(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

/// The clone's changes to the restored copy of `captured`, as JSON patch operations (see the
/// module doc), the user's `patches` last.
pub fn clone_patches(c: &VirtualMachineClone, captured: &CapturedVirtualMachine) -> Vec<String> {
    let spec = c.spec.clone().unwrap_or_default();
    let meta = captured.metadata.clone().unwrap_or_default();
    let mut ops = Vec::new();
    let label_filters = spec.label_filters.clone().unwrap_or_default();
    for k in meta.labels.iter().flatten().map(|(k, _)| k) {
        if !filter_keeps(&label_filters, k) {
            ops.push(json!({"op": "remove", "path": format!("/metadata/labels/{}", esc(k))}));
        }
    }
    let annotation_filters = spec.annotation_filters.clone().unwrap_or_default();
    for (k, v) in meta.annotations.iter().flatten() {
        if filter_keeps(&annotation_filters, k) && !k.starts_with("restore.") {
            ops.push(json!({"op": "add", "path": format!("/metadata/annotations/{}", esc(k)), "value": v}));
        }
    }
    let vm_spec = captured.spec.clone().unwrap_or_default();
    let tmeta = vm_spec.template.metadata.clone().unwrap_or_default();
    let tf = spec.template.clone().unwrap_or_default();
    let (tl, ta) = (
        tf.label_filters.unwrap_or_default(),
        tf.annotation_filters.unwrap_or_default(),
    );
    for k in tmeta.labels.iter().flatten().map(|(k, _)| k) {
        if !filter_keeps(&tl, k) {
            ops.push(json!({"op": "remove", "path": format!("/spec/template/metadata/labels/{}", esc(k))}));
        }
    }
    for k in tmeta.annotations.iter().flatten().map(|(k, _)| k) {
        if !filter_keeps(&ta, k) {
            ops.push(json!({"op": "remove", "path": format!("/spec/template/metadata/annotations/{}", esc(k))}));
        }
    }
    let tspec = vm_spec.template.spec.clone().unwrap_or_default();
    let macs = spec.new_mac_addresses.clone().unwrap_or_default();
    for (i, iface) in tspec.domain.devices.interfaces.iter().flatten().enumerate() {
        if let Some(mac) = macs.get(&iface.name) {
            let mac = ferrovirt_api::kubevirt::clone::normalize_mac(mac).unwrap_or(mac.clone());
            ops.push(json!({"op": "add",
                "path": format!("/spec/template/spec/domain/devices/interfaces/{i}/macAddress"),
                "value": mac}));
        }
    }
    let serial = spec.new_sm_bios_serial.clone().unwrap_or_else(|| uid(c));
    if tspec.domain.firmware.is_some() {
        ops.push(json!({"op": "add", "path": "/spec/template/spec/domain/firmware/serial", "value": serial}));
    } else {
        ops.push(json!({"op": "add", "path": "/spec/template/spec/domain/firmware", "value": {"serial": serial}}));
    }
    let mut out: Vec<String> = ops.iter().map(|o| o.to_string()).collect();
    out.extend(spec.patches.clone().unwrap_or_default());
    out
}

fn owner(c: &VirtualMachineClone) -> OwnerReference {
    OwnerReference {
        api_version: "clone.kubevirt.io/v1beta1".into(),
        kind: "VirtualMachineClone".into(),
        name: c.metadata.name.clone().unwrap_or_default(),
        uid: uid(c),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

fn restore_failure(r: &VirtualMachineRestore) -> Option<String> {
    r.status
        .as_ref()?
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "Failure" && c.status == "True")
        .map(|c| c.message.clone().unwrap_or_default())
}

/// Decide one step of a VirtualMachineClone.
pub fn step(input: &CloneInput<'_>) -> CloneStep {
    let c = input.clone;
    let now = Time(input.now);
    let mut status = c.status.clone().unwrap_or_default();
    let mut out = CloneStep::default();
    let phase = status.phase.clone().unwrap_or_default();
    let target = target_name(c);
    if phase == SUCCEEDED || phase == FAILED {
        if phase == SUCCEEDED {
            out.delete_restore = input.restore.map(|_| restore_name(c));
            out.delete_snapshot =
                (!from_snapshot(c) && input.snapshot.is_some()).then(|| snapshot_name(c));
        }
        out.status = status;
        return out;
    }
    status.target_name = Some(target.clone());
    status.creation_timestamp.get_or_insert_with(|| now.clone());
    let mut conditions: Vec<Condition> = status.conditions.clone().unwrap_or_default();
    let progressing =
        |mut status: CloneStatus, mut conditions: Vec<Condition>, phase: &str, msg: &str| {
            if !phase.is_empty() {
                status.phase = Some(phase.into());
            }
            set(
                &mut conditions,
                condition("Progressing", true, Some(phase), Some(msg)),
                &now,
            );
            set(
                &mut conditions,
                condition("Ready", false, Some(phase), Some(msg)),
                &now,
            );
            status.conditions = Some(conditions);
            status
        };
    let fail = |mut status: CloneStatus, mut conditions: Vec<Condition>, msg: &str| {
        status.phase = Some(FAILED.into());
        set(
            &mut conditions,
            condition("Progressing", false, Some(FAILED), Some(msg)),
            &now,
        );
        set(
            &mut conditions,
            condition("Ready", false, Some(FAILED), Some(msg)),
            &now,
        );
        status.conditions = Some(conditions);
        status
    };
    if input.target_exists && input.restore.is_none() {
        out.status = fail(
            status,
            conditions,
            &format!("target VirtualMachine {target} already exists"),
        );
        return out;
    }
    let spec = c.spec.clone().unwrap_or_default();

    // 1. The snapshot.
    let Some(snap) = input.snapshot else {
        if from_snapshot(c) {
            out.status = progressing(
                status,
                conditions,
                "",
                &format!(
                    "source VirtualMachineSnapshot {} does not exist",
                    spec.source.name
                ),
            );
            out.requeue = Some(Duration::from_secs(2));
            return out;
        }
        if input.source_vm.is_none() {
            out.status = progressing(
                status,
                conditions,
                "",
                &format!("source VirtualMachine {} does not exist", spec.source.name),
            );
            out.requeue = Some(Duration::from_secs(2));
            return out;
        }
        status.snapshot_name = Some(snapshot_name(c));
        out.create_snapshot = Some(Box::new(VirtualMachineSnapshot {
            api_version: Some("snapshot.kubevirt.io/v1beta1".into()),
            kind: Some("VirtualMachineSnapshot".into()),
            metadata: ObjectMeta {
                name: Some(snapshot_name(c)),
                namespace: c.metadata.namespace.clone(),
                owner_references: Some(vec![owner(c)]),
                ..Default::default()
            },
            spec: Some(SnapshotSpec {
                source: TypedLocalObjectReference {
                    api_group: Some("kubevirt.io".into()),
                    kind: "VirtualMachine".into(),
                    name: spec.source.name.clone(),
                },
                deletion_policy: Some("Delete".into()),
                failure_deadline: None,
            }),
            status: None,
        }));
        out.status = progressing(
            status,
            conditions,
            SNAPSHOT_IN_PROGRESS,
            "snapshotting the source VM",
        );
        out.requeue = Some(Duration::from_millis(500));
        return out;
    };
    let sst = snap.status.clone().unwrap_or_default();
    if sst.phase.as_deref() == Some("Failed") {
        let why = sst.error.and_then(|e| e.message).unwrap_or_default();
        out.status = fail(
            status,
            conditions,
            &format!("snapshot {} failed: {why}", used_snapshot(c)),
        );
        return out;
    }
    let (true, Some(content)) = (sst.ready_to_use == Some(true), input.content) else {
        out.status = progressing(
            status,
            conditions,
            SNAPSHOT_IN_PROGRESS,
            &format!("waiting for snapshot {}", used_snapshot(c)),
        );
        out.requeue = Some(Duration::from_secs(1));
        return out;
    };

    // 2. The restore into the new VM.
    let Some(restore) = input.restore else {
        let Some(captured) = content
            .spec
            .as_ref()
            .and_then(|s| s.source.virtual_machine.as_ref())
        else {
            out.status = fail(status, conditions, "the snapshot content holds no VM");
            return out;
        };
        status.restore_name = Some(restore_name(c));
        out.create_restore = Some(Box::new(VirtualMachineRestore {
            api_version: Some("snapshot.kubevirt.io/v1beta1".into()),
            kind: Some("VirtualMachineRestore".into()),
            metadata: ObjectMeta {
                name: Some(restore_name(c)),
                namespace: c.metadata.namespace.clone(),
                owner_references: Some(vec![owner(c)]),
                ..Default::default()
            },
            spec: Some(RestoreSpec {
                target: TypedLocalObjectReference {
                    api_group: Some("kubevirt.io".into()),
                    kind: "VirtualMachine".into(),
                    name: target.clone(),
                },
                virtual_machine_snapshot_name: used_snapshot(c),
                patches: Some(clone_patches(c, captured)),
                volume_restore_policy: Some(
                    spec.volume_name_policy
                        .clone()
                        .unwrap_or_else(|| "RandomizeNames".into()),
                ),
                ..Default::default()
            }),
            status: None,
        }));
        out.status = progressing(
            status,
            conditions,
            CREATING_TARGET_VM,
            &format!("creating VirtualMachine {target}"),
        );
        out.requeue = Some(Duration::from_millis(500));
        return out;
    };
    if let Some(why) = restore_failure(restore) {
        out.status = fail(
            status,
            conditions,
            &format!("restore {} failed: {why}", restore_name(c)),
        );
        return out;
    }
    if restore.status.as_ref().and_then(|s| s.complete) != Some(true) {
        out.status = progressing(
            status,
            conditions,
            RESTORE_IN_PROGRESS,
            &format!("restoring into VirtualMachine {target}"),
        );
        out.requeue = Some(Duration::from_secs(1));
        return out;
    }

    // 3. Done: the intermediate objects go.
    status.phase = Some(SUCCEEDED.into());
    set(
        &mut conditions,
        condition(
            "Progressing",
            false,
            Some(SUCCEEDED),
            Some("Operation complete"),
        ),
        &now,
    );
    set(
        &mut conditions,
        condition("Ready", true, Some(SUCCEEDED), Some("Operation complete")),
        &now,
    );
    status.conditions = Some(conditions);
    out.status = status;
    out.delete_restore = Some(restore_name(c));
    out.delete_snapshot = (!from_snapshot(c)).then(|| snapshot_name(c));
    out
}

#[cfg(test)]
#[path = "clone_tests.rs"]
mod tests;
