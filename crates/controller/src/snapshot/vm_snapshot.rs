//! The VirtualMachineSnapshot step (pure): from the snapshot, its source VM, whether the VM
//! runs, the snapshot's content and VolumeSnapshots, and the VM's claims, decide what to
//! create and the status to write. KubeVirt's phases (`InProgress` → `Succeeded` | `Failed`),
//! conditions (`Progressing`, `Ready`, `Failure`), indications and `snapshotVolumes`.
//!
//! A stopped VM's claims are snapshotted one VolumeSnapshot each (the VolumeSnapshot
//! controller takes them). A running VM's are taken all at once through its node's agent
//! ([`super::online`]: the step asks for an [`OnlineTake`]; the loop records the result as
//! pre-provisioned VolumeSnapshots and the indications). While a snapshot is in progress the
//! VM's `status.snapshotInProgress` names it, the VM controller does not start the VM and
//! admission refuses changes of the VM's spec (KubeVirt's rule; a stop is such a change).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use k8s_openapi::jiff::Timestamp;

use ferrovirt_api::kubevirt::snapshot::{
    CapturedClaim, CapturedVirtualMachine, SnapshotContentSource, SnapshotContentSpec,
    SnapshotContentStatus, SnapshotError, SnapshotStatus, SnapshotVolumesLists, SourceIndication,
    VirtualMachineSnapshot, VirtualMachineSnapshotContent, VolumeBackup, VolumeSnapshotState,
    failure_deadline,
};
use ferrovirt_api::kubevirt::vm::VirtualMachine;
use ferrovirt_api::kubevirt::vmi::Condition;
use ferrovirt_api::volumesnapshot::{VolumeSnapshot, VolumeSnapshotSource, VolumeSnapshotSpec};

use super::online::{self, ActiveVmi, OnlineTake, OnlineVolume};
use crate::conditions::{condition, set};

/// The phases.
pub const IN_PROGRESS: &str = "InProgress";
pub const SUCCEEDED: &str = "Succeeded";
pub const FAILED: &str = "Failed";

/// What the snapshot sees.
pub struct SnapshotInput<'a> {
    pub snapshot: &'a VirtualMachineSnapshot,
    pub vm: Option<&'a VirtualMachine>,
    /// The VM's VMI, when it exists and has not finished (an online snapshot).
    pub vmi: Option<ActiveVmi>,
    pub content: Option<&'a VirtualMachineSnapshotContent>,
    /// The VolumeSnapshots of the namespace by name.
    pub volume_snapshots: &'a BTreeMap<String, VolumeSnapshot>,
    /// The namespace's claims by name.
    pub claims: &'a BTreeMap<String, PersistentVolumeClaim>,
    pub now: Timestamp,
}

/// What the VM's `status.snapshotInProgress` should become.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmMark {
    Leave,
    Set(String),
    /// Clear it when it names this snapshot.
    Clear(String),
}

/// The step's decision.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotStep {
    pub create_content: Option<VirtualMachineSnapshotContent>,
    pub create_volume_snapshots: Vec<VolumeSnapshot>,
    /// The content's status to write (when it changed).
    pub content_status: Option<SnapshotContentStatus>,
    pub vm_mark: VmMark,
    pub status: SnapshotStatus,
    pub requeue: Option<Duration>,
    /// Take these claims' snapshots online now (the VM runs).
    pub online_take: Option<OnlineTake>,
}

/// The content's name for a snapshot (KubeVirt's `vmsnapshot-content-<snapshot uid>`).
pub fn content_name(snapshot: &VirtualMachineSnapshot) -> String {
    format!(
        "vmsnapshot-content-{}",
        snapshot.metadata.uid.as_deref().unwrap_or("unknown")
    )
}

/// The VolumeSnapshot of volume `volume` of a snapshot.
pub fn volume_snapshot_name(snapshot: &VirtualMachineSnapshot, volume: &str) -> String {
    format!(
        "vmsnapshot-{}-volume-{volume}",
        snapshot.metadata.uid.as_deref().unwrap_or("unknown")
    )
}

/// The claim behind each of a VM's volumes that can be snapshotted (`persistentVolumeClaim`,
/// `dataVolume`), and the names of the volumes that cannot (container disks, cloud-init, …).
pub fn vm_claims(vm: &VirtualMachine) -> (Vec<(String, String)>, Vec<String>) {
    let mut included = Vec::new();
    let mut excluded = Vec::new();
    let volumes = vm
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.volumes.clone())
        .unwrap_or_default();
    for v in volumes {
        let claim = v
            .persistent_volume_claim
            .as_ref()
            .map(|c| c.claim_name.clone())
            .or_else(|| v.data_volume.as_ref().map(|d| d.name.clone()));
        match claim {
            Some(c) => included.push((v.name, c)),
            None => excluded.push(v.name),
        }
    }
    (included, excluded)
}

fn owner(snapshot: &VirtualMachineSnapshot) -> OwnerReference {
    OwnerReference {
        api_version: "snapshot.kubevirt.io/v1beta1".into(),
        kind: "VirtualMachineSnapshot".into(),
        name: snapshot.metadata.name.clone().unwrap_or_default(),
        uid: snapshot.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// The VM as captured: identity, labels, annotations, spec (no status).
fn capture_vm(vm: &VirtualMachine) -> CapturedVirtualMachine {
    CapturedVirtualMachine {
        api_version: Some("kubevirt.io/v1".into()),
        kind: Some("VirtualMachine".into()),
        metadata: Some(ObjectMeta {
            name: vm.metadata.name.clone(),
            namespace: vm.metadata.namespace.clone(),
            uid: vm.metadata.uid.clone(),
            generation: vm.metadata.generation,
            labels: vm.metadata.labels.clone(),
            annotations: vm.metadata.annotations.clone().map(|mut a| {
                a.remove("kubectl.kubernetes.io/last-applied-configuration");
                a
            }),
            ..Default::default()
        }),
        spec: vm.spec.clone(),
        status: None,
    }
}

fn capture_claim(pvc: &PersistentVolumeClaim) -> CapturedClaim {
    CapturedClaim {
        metadata: Some(ObjectMeta {
            name: pvc.metadata.name.clone(),
            namespace: pvc.metadata.namespace.clone(),
            labels: pvc.metadata.labels.clone(),
            ..Default::default()
        }),
        spec: pvc.spec.clone(),
    }
}

fn is_ready(vs: &VolumeSnapshot) -> bool {
    vs.status
        .as_ref()
        .and_then(|s| s.ready_to_use)
        .unwrap_or(false)
}

fn vs_error(vs: &VolumeSnapshot) -> Option<String> {
    vs.status
        .as_ref()
        .and_then(|s| s.error.as_ref())
        .and_then(|e| e.message.clone())
}

/// Decide one step of a VirtualMachineSnapshot.
pub fn step(input: &SnapshotInput<'_>) -> SnapshotStep {
    let snap = input.snapshot;
    let name = snap.metadata.name.clone().unwrap_or_default();
    let now = Time(input.now);
    let mut status = snap.status.clone().unwrap_or_default();
    let mut out = SnapshotStep {
        create_content: None,
        create_volume_snapshots: Vec::new(),
        content_status: None,
        vm_mark: VmMark::Leave,
        status: status.clone(),
        requeue: None,
        online_take: None,
    };
    let phase = status.phase.clone().unwrap_or_default();
    if phase == SUCCEEDED || phase == FAILED {
        out.vm_mark = VmMark::Clear(name);
        return out;
    }
    status.phase = Some(IN_PROGRESS.into());
    status.ready_to_use = Some(false);
    let mut conditions: Vec<Condition> = status.conditions.clone().unwrap_or_default();
    let spec = snap.spec.clone().unwrap_or_default();

    let fail = |mut status: SnapshotStatus, mut conditions: Vec<Condition>, message: String| {
        status.phase = Some(FAILED.into());
        status.ready_to_use = Some(false);
        status.error = Some(SnapshotError {
            time: Some(now.clone()),
            message: Some(message.clone()),
        });
        set(
            &mut conditions,
            condition("Progressing", false, Some("Failed"), Some(&message)),
            &now,
        );
        set(
            &mut conditions,
            condition("Ready", false, Some("Failed"), Some(&message)),
            &now,
        );
        set(
            &mut conditions,
            condition("Failure", true, Some("Failed"), Some(&message)),
            &now,
        );
        status.conditions = Some(conditions);
        status
    };

    // The failure deadline counts from the snapshot's creation.
    let deadline = match failure_deadline(&spec) {
        Ok(d) => d,
        Err(e) => {
            out.status = fail(status, conditions, format!("spec.failureDeadline: {e}"));
            out.vm_mark = VmMark::Clear(name);
            return out;
        }
    };
    let created = snap
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0)
        .unwrap_or(input.now);
    let elapsed = input.now.duration_since(created).unsigned_abs();
    let left = (!deadline.is_zero()).then(|| deadline.saturating_sub(elapsed));
    let waiting = |status: SnapshotStatus, conditions: Vec<Condition>, reason: &str| {
        if left == Some(Duration::ZERO) {
            let message = format!(
                "snapshot did not finish within its failureDeadline ({}s): {reason}",
                deadline.as_secs()
            );
            return (fail(status, conditions, message), true);
        }
        let mut status = status;
        let mut conditions = conditions;
        set(
            &mut conditions,
            condition("Progressing", true, Some("InProgress"), Some(reason)),
            &now,
        );
        set(
            &mut conditions,
            condition("Ready", false, Some("NotReady"), Some(reason)),
            &now,
        );
        status.conditions = Some(conditions);
        (status, false)
    };
    let requeue_in =
        |d: Duration| Some(left.map_or(d, |l| d.min(l.max(Duration::from_millis(100)))));

    let Some(vm) = input.vm else {
        let reason = format!("source VirtualMachine {} does not exist", spec.source.name);
        let (st, failed) = waiting(status, conditions, &reason);
        out.status = st;
        out.requeue = (!failed)
            .then(|| requeue_in(Duration::from_secs(2)))
            .flatten();
        return out;
    };
    status.source_uid = vm.metadata.uid.clone();
    // Indications are written once the volumes are taken (online: by the loop, from what
    // the guest agent did); until then none.
    status.indications.get_or_insert_default();
    status
        .source_indications
        .get_or_insert_with(Vec::<SourceIndication>::new);
    let in_progress = vm
        .status
        .as_ref()
        .and_then(|s| s.snapshot_in_progress.clone());
    let restoring = vm
        .status
        .as_ref()
        .and_then(|s| s.restore_in_progress.clone());
    if let Some(other) = in_progress.as_ref().filter(|o| **o != name) {
        let (st, failed) = waiting(
            status,
            conditions,
            &format!("another snapshot ({other}) of the VM is in progress"),
        );
        out.status = st;
        out.requeue = (!failed)
            .then(|| requeue_in(Duration::from_secs(2)))
            .flatten();
        return out;
    }
    if let Some(r) = restoring {
        let (st, failed) = waiting(
            status,
            conditions,
            &format!("the VM is being restored ({r})"),
        );
        out.status = st;
        out.requeue = (!failed)
            .then(|| requeue_in(Duration::from_secs(2)))
            .flatten();
        return out;
    }
    if in_progress.is_none() {
        out.vm_mark = VmMark::Set(name.clone());
    }

    let (included, excluded) = vm_claims(vm);
    status.snapshot_volumes = Some(SnapshotVolumesLists {
        included_volumes: Some(included.iter().map(|(v, _)| v.clone()).collect()),
        excluded_volumes: Some(excluded),
    });
    let cname = content_name(snap);
    status.virtual_machine_snapshot_content_name = Some(cname.clone());
    let Some(content) = input.content else {
        let missing: Vec<&str> = included
            .iter()
            .filter(|(_, c)| !input.claims.contains_key(c))
            .map(|(_, c)| c.as_str())
            .collect();
        if !missing.is_empty() {
            let (st, failed) = waiting(
                status,
                conditions,
                &format!("claim(s) {} do not exist", missing.join(", ")),
            );
            out.status = st;
            out.requeue = (!failed)
                .then(|| requeue_in(Duration::from_secs(2)))
                .flatten();
            if failed {
                out.vm_mark = VmMark::Clear(name);
            }
            return out;
        }
        let backups = included
            .iter()
            .map(|(volume, claim)| VolumeBackup {
                volume_name: volume.clone(),
                persistent_volume_claim: capture_claim(&input.claims[claim]),
                volume_snapshot_name: Some(volume_snapshot_name(snap, volume)),
            })
            .collect();
        out.create_content = Some(VirtualMachineSnapshotContent {
            api_version: Some("snapshot.kubevirt.io/v1beta1".into()),
            kind: Some("VirtualMachineSnapshotContent".into()),
            metadata: ObjectMeta {
                name: Some(cname),
                namespace: snap.metadata.namespace.clone(),
                // `Retain`: the content outlives the snapshot.
                owner_references: (spec.deletion_policy.as_deref() != Some("Retain"))
                    .then(|| vec![owner(snap)]),
                ..Default::default()
            },
            spec: Some(SnapshotContentSpec {
                virtual_machine_snapshot_name: Some(name.clone()),
                source: SnapshotContentSource {
                    virtual_machine: Some(capture_vm(vm)),
                },
                volume_backups: Some(backups),
            }),
            status: None,
        });
        let (st, _) = waiting(status, conditions, "capturing the VM's definition");
        out.status = st;
        out.requeue = Some(Duration::from_millis(200));
        return out;
    };

    // The content exists: one VolumeSnapshot per backup, all ready → Succeeded.
    let backups = content
        .spec
        .as_ref()
        .and_then(|s| s.volume_backups.clone())
        .unwrap_or_default();
    let mut states = Vec::new();
    let mut pending = Vec::new();
    let mut online_volumes: Vec<OnlineVolume> = Vec::new();
    for b in &backups {
        let Some(vs_name) = b.volume_snapshot_name.clone() else {
            continue;
        };
        match input.volume_snapshots.get(&vs_name) {
            None if input.vmi.is_some() => {
                // The VM runs: its QEMU writes the top layers; taken together, online.
                online_volumes.push(OnlineVolume {
                    volume: b.volume_name.clone(),
                    claim: b
                        .persistent_volume_claim
                        .metadata
                        .as_ref()
                        .and_then(|m| m.name.clone())
                        .unwrap_or_default(),
                    volume_snapshot: vs_name.clone(),
                });
                // The last attempt's error (the loop writes it), so a deadline names it.
                let last = status
                    .error
                    .as_ref()
                    .and_then(|e| e.message.clone())
                    .map(|m| format!(": {m}"))
                    .unwrap_or_default();
                pending.push(format!("{vs_name} (taking it online{last})"));
            }
            None => {
                let claim = b
                    .persistent_volume_claim
                    .metadata
                    .as_ref()
                    .and_then(|m| m.name.clone())
                    .unwrap_or_default();
                out.create_volume_snapshots.push(VolumeSnapshot {
                    api_version: Some(ferrovirt_api::volumesnapshot::API_VERSION.into()),
                    kind: Some("VolumeSnapshot".into()),
                    metadata: ObjectMeta {
                        name: Some(vs_name.clone()),
                        namespace: snap.metadata.namespace.clone(),
                        owner_references: Some(vec![OwnerReference {
                            api_version: "snapshot.kubevirt.io/v1beta1".into(),
                            kind: "VirtualMachineSnapshotContent".into(),
                            name: content.metadata.name.clone().unwrap_or_default(),
                            uid: content.metadata.uid.clone().unwrap_or_default(),
                            controller: Some(true),
                            block_owner_deletion: Some(true),
                        }]),
                        ..Default::default()
                    },
                    spec: Some(VolumeSnapshotSpec {
                        source: VolumeSnapshotSource {
                            persistent_volume_claim_name: Some(claim),
                            volume_snapshot_content_name: None,
                        },
                        volume_snapshot_class_name: None,
                    }),
                    status: None,
                });
                pending.push(format!("{vs_name} (creating)"));
            }
            Some(vs) => {
                let st = vs.status.clone().unwrap_or_default();
                states.push(VolumeSnapshotState {
                    volume_snapshot_name: vs_name.clone(),
                    creation_time: st.creation_time.clone(),
                    ready_to_use: Some(is_ready(vs)),
                    error: st.error.as_ref().map(|e| SnapshotError {
                        time: e.time.clone(),
                        message: e.message.clone(),
                    }),
                });
                if !is_ready(vs) {
                    pending.push(match vs_error(vs) {
                        Some(e) => format!("{vs_name}: {e}"),
                        None => vs_name.clone(),
                    });
                }
            }
        }
    }
    let ready = pending.is_empty();
    let content_status = SnapshotContentStatus {
        creation_time: if ready {
            content
                .status
                .as_ref()
                .and_then(|s| s.creation_time.clone())
                .or(Some(now.clone()))
        } else {
            None
        },
        ready_to_use: Some(ready),
        error: None,
        volume_snapshot_status: Some(states),
    };
    if content.status.as_ref() != Some(&content_status) {
        out.content_status = Some(content_status.clone());
    }
    if !online_volumes.is_empty()
        && let Some(vmi) = &input.vmi
    {
        match &vmi.node {
            Some(node) if left != Some(Duration::ZERO) => {
                out.online_take = Some(OnlineTake {
                    node: node.clone(),
                    vmi_uid: vmi.uid.clone(),
                    volumes: online_volumes,
                    freeze_timeout: online::freeze_timeout(left),
                });
            }
            Some(_) => {}
            None => pending.push("the VM's VMI is not on a node yet".into()),
        }
    }
    if !ready {
        let (st, failed) = waiting(
            status,
            conditions,
            &format!("waiting for volume snapshots: {}", pending.join(", ")),
        );
        out.status = st;
        if failed {
            out.vm_mark = VmMark::Clear(name);
        } else {
            out.requeue = requeue_in(Duration::from_secs(1));
        }
        return out;
    }
    status.phase = Some(SUCCEEDED.into());
    status.ready_to_use = Some(true);
    status.creation_time = content_status.creation_time;
    status.error = None;
    super::set_succeeded(&mut conditions, &now);
    status.conditions = Some(conditions);
    out.status = status;
    out.vm_mark = VmMark::Clear(name);
    out
}

#[cfg(test)]
#[path = "vm_snapshot_tests.rs"]
mod tests;
