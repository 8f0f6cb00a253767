//! Backups of running VMs: a running VM's claims are read through an online
//! VirtualMachineSnapshot the backup takes (as a VirtualMachineExport of a running VM does),
//! never while the guest writes them. The snapshot is owned by the Backup (garbage-collected
//! with it), `deletionPolicy: Delete`; it is deleted when the backup fails, and kept as the VM's
//! backup point (for the next, incremental read: [`super::incremental`]) when it succeeds.
//!
//! [`backup_snapshot`] (pure) builds it; [`take`] creates it, waits until it is ready and
//! says where each claim's frozen layer is; [`delete`] removes it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::PersistentVolume;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};

use ferrovirt_api::kubevirt::snapshot::VirtualMachineSnapshot;

use crate::export::plan::SourceState;
use crate::export::resolve;
use crate::snapshot::resources::VmSnapshot;

/// The label naming the Backup a snapshot was taken for.
pub const BACKUP_LABEL: &str = "backup.ferrovirt.io/backup";

/// The online snapshot's name for VM `vm` in Backup `backup`.
pub fn snapshot_name(backup: &str, vm: &str) -> String {
    format!("backup-{backup}-{vm}")
}

/// Where a Backup writes: its BackupTarget and its name there.
#[derive(Debug, Clone, Copy)]
pub struct Destination<'a> {
    pub target: &'a str,
    pub backup_name: &'a str,
}

/// The online snapshot of running VM `vm` that Backup `backup` (owner `owner`) reads (pure),
/// labelled with the VM and annotated with where the backup goes (to find it as a backup
/// point later).
pub fn backup_snapshot(
    ns: &str,
    backup: &str,
    owner: &OwnerReference,
    vm: &str,
    dest: Destination<'_>,
) -> VirtualMachineSnapshot {
    use super::incremental::{NAME_ANNOTATION, TARGET_ANNOTATION, VM_LABEL};
    crate::export::plan::owned_vm_snapshot(
        ObjectMeta {
            name: Some(snapshot_name(backup, vm)),
            namespace: Some(ns.to_string()),
            owner_references: Some(vec![owner.clone()]),
            labels: Some(
                [
                    (BACKUP_LABEL.to_string(), backup.to_string()),
                    (VM_LABEL.to_string(), vm.to_string()),
                ]
                .into(),
            ),
            annotations: Some(
                [
                    (TARGET_ANNOTATION.to_string(), dest.target.to_string()),
                    (NAME_ANNOTATION.to_string(), dest.backup_name.to_string()),
                ]
                .into(),
            ),
            ..Default::default()
        },
        vm,
    )
}

/// Where a claim is read from: its volume and the snapshot layer.
pub type Frozen = HashMap<String, (PersistentVolume, Option<String>)>;

/// How long a backup waits for its online snapshot.
const READY_WITHIN: Duration = Duration::from_secs(300);

/// Creates `snap` (an existing one of that name is reused), waits until it is ready to use,
/// and returns, by claim name, the volume and layer each claim is read from.
pub(super) async fn take(
    client: &kube::Client,
    ns: &str,
    snap: VirtualMachineSnapshot,
) -> Result<Frozen, String> {
    let name = snap.metadata.name.clone().unwrap_or_default();
    let api: Api<VmSnapshot> = Api::namespaced(client.clone(), ns);
    match api.create(&PostParams::default(), &VmSnapshot(snap)).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.is_already_exists() => {}
        Err(e) => return Err(format!("creating the online snapshot {name}: {e}")),
    }
    let start = Instant::now();
    loop {
        let current = api
            .get_opt(&name)
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("the online snapshot {name} was deleted"))?;
        let st = current.0.status.unwrap_or_default();
        if st.phase.as_deref() == Some("Failed") {
            let why = st
                .error
                .and_then(|e| e.message)
                .unwrap_or_else(|| "no reason given".into());
            return Err(format!("the online snapshot {name} failed: {why}"));
        }
        if st.ready_to_use == Some(true) {
            let resolved = resolve::snapshot_source(client, ns, &name)
                .await
                .map_err(|e| format!("reading the online snapshot {name}: {e}"))?;
            if let SourceState::Ready { .. } = resolved.state {
                return Ok(resolved
                    .volumes
                    .into_iter()
                    .map(|v| (v.name, (v.pv, v.handle)))
                    .collect());
            }
        }
        if start.elapsed() > READY_WITHIN {
            return Err(format!(
                "the online snapshot {name} was not ready within {}s (phase {})",
                READY_WITHIN.as_secs(),
                st.phase.as_deref().unwrap_or("unknown")
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Deletes the online snapshot `name` (its contents and volume snapshots go with it).
pub(super) async fn delete(client: &kube::Client, ns: &str, name: &str) {
    let api: Api<VmSnapshot> = Api::namespaced(client.clone(), ns);
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.is_not_found() => {}
        Err(e) => {
            tracing::warn!(snapshot = %name, error = %e, "deleting a backup's online snapshot failed")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_online_snapshot_is_owned_by_the_backup_and_deletes_its_content() {
        let owner = OwnerReference {
            api_version: "backup.ferrovirt.io/v1alpha1".into(),
            kind: "Backup".into(),
            name: "b0".into(),
            uid: "u".into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        };
        let dest = Destination {
            target: "s3",
            backup_name: "ns-b0",
        };
        let s = backup_snapshot("ns", "b0", &owner, "vm1", dest);
        assert_eq!(s.metadata.name.as_deref(), Some("backup-b0-vm1"));
        assert_eq!(s.metadata.owner_references.as_deref(), Some(&[owner][..]));
        let spec = s.spec.unwrap();
        assert_eq!(spec.source.kind, "VirtualMachine");
        assert_eq!(spec.source.name, "vm1");
        assert_eq!(spec.deletion_policy.as_deref(), Some("Delete"));
        let labels = s.metadata.labels.unwrap();
        assert_eq!(labels[BACKUP_LABEL], "b0");
        assert_eq!(labels[super::super::incremental::VM_LABEL], "vm1");
        let ann = s.metadata.annotations.unwrap();
        assert_eq!(ann[super::super::incremental::TARGET_ANNOTATION], "s3");
        assert_eq!(ann[super::super::incremental::NAME_ANNOTATION], "ns-b0");
    }
}
