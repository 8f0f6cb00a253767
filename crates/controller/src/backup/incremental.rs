//! Incremental reads of a Backup (docs/backup.md "Incremental reads"): the backup point.
//!
//! A running VM is backed up through an online VirtualMachineSnapshot `backup-<backup>-<vm>`.
//! Once the Backup succeeds that snapshot is **kept** (labelled `backup.ferrovirt.io/base=true`,
//! still owned by the Backup) as the VM's backup point on that target: the layer it froze
//! holds the disk as that backup read it, and every cluster written since lies in the layers
//! above it. The next Backup of the VM to the same target finds it ([`choose_base`]), and for
//! each claim ([`since`]) reads only the chunks written above that layer (the node's
//! `qemu-img map`, `ferrovirt_storage::export::changed`), taking every other chunk id from the
//! earlier backup's index in the repository. When it succeeds, its own snapshot becomes the
//! point and the older ones are deleted ([`older_points`]); when it fails they stay as they
//! were. A stopped VM is read directly (no new snapshot), incrementally from the kept point,
//! which stays the point.
//!
//! Any doubt means a full read with the reason in the volume's status: no point kept (first
//! backup, Backup deleted), the claim not in it or on another volume now, the earlier backup not
//! readable in the repository, the point's layer no longer below the snapshot in the chain
//! (reverted past it, the volume recreated), a size change. The decisions here are pure;
//! [`find_point`], [`keep_point`] and [`drop_points`] do the API calls.

use std::collections::HashMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use serde_json::json;

use crate::export::plan::SourceState;
use crate::export::resolve;
use crate::snapshot::resources::VmSnapshot;

/// Label: the VM an online backup snapshot is of.
pub const VM_LABEL: &str = "backup.ferrovirt.io/vm";
/// Label: `true` once the snapshot's Backup succeeded (it is then a backup point).
pub const POINT_LABEL: &str = "backup.ferrovirt.io/base";
/// Annotation: the BackupTarget the snapshot's Backup wrote to.
pub const TARGET_ANNOTATION: &str = "backup.ferrovirt.io/target";
/// Annotation: the backup's name on the target.
pub const NAME_ANNOTATION: &str = "backup.ferrovirt.io/backup-name";

/// A kept backup point as listed.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    /// The VirtualMachineSnapshot.
    pub snapshot: String,
    pub target: String,
    /// The backup on the target whose indexes describe the point.
    pub backup_name: String,
    pub created: Option<Time>,
    pub ready: bool,
}

/// Where the next read starts for one claim: the earlier backup and the layer it read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Since {
    pub backup_name: String,
    /// The point's layer of the claim's volume.
    pub layer: String,
}

/// The point's volumes: claim → (PersistentVolume name, frozen layer).
pub type PointVolumes = HashMap<String, (String, String)>;

/// The newest ready point of `target` among `points`, not `own` (this Backup's snapshot).
pub fn choose_base<'a>(points: &'a [Point], target: &str, own: &str) -> Option<&'a Point> {
    points
        .iter()
        .filter(|p| p.ready && p.target == target && p.snapshot != own)
        .max_by(|a, b| {
            (a.created.as_ref().map(|t| t.0), &a.snapshot)
                .cmp(&(b.created.as_ref().map(|t| t.0), &b.snapshot))
        })
}

/// The points of `target` to delete once the snapshot `keep` is the point.
pub fn older_points(points: &[Point], target: &str, keep: &str) -> Vec<String> {
    points
        .iter()
        .filter(|p| p.target == target && p.snapshot != keep)
        .map(|p| p.snapshot.clone())
        .collect()
}

/// Where claim `claim` (now on PersistentVolume `pv`) is read from incrementally, or why it is
/// read whole. `point` is the VM's kept point and its volumes (or why there is none).
pub fn since(
    point: &Result<(Point, PointVolumes), String>,
    claim: &str,
    pv: &str,
) -> Result<Since, String> {
    let (p, volumes) = point.as_ref().map_err(Clone::clone)?;
    let (base_pv, layer) = volumes.get(claim).ok_or_else(|| {
        format!(
            "claim {claim} is not in the previous backup {}",
            p.backup_name
        )
    })?;
    if base_pv != pv {
        return Err(format!(
            "claim {claim} is on volume {pv} now; the previous backup {} read {base_pv}",
            p.backup_name
        ));
    }
    Ok(Since {
        backup_name: p.backup_name.clone(),
        layer: layer.clone(),
    })
}

/// The kept points of VM `vm` in `ns` (every target).
async fn points_of(client: &kube::Client, ns: &str, vm: &str) -> Result<Vec<Point>, String> {
    let api: Api<VmSnapshot> = Api::namespaced(client.clone(), ns);
    let list = api
        .list(&ListParams::default().labels(&format!("{VM_LABEL}={vm},{POINT_LABEL}=true")))
        .await
        .map_err(|e| format!("listing the backup points of {vm}: {e}"))?;
    Ok(list
        .items
        .into_iter()
        .filter(|s| s.0.metadata.deletion_timestamp.is_none())
        .map(|s| {
            let ann = s.0.metadata.annotations.clone().unwrap_or_default();
            Point {
                snapshot: s.0.metadata.name.clone().unwrap_or_default(),
                target: ann.get(TARGET_ANNOTATION).cloned().unwrap_or_default(),
                backup_name: ann.get(NAME_ANNOTATION).cloned().unwrap_or_default(),
                created: s.0.metadata.creation_timestamp.clone(),
                ready: s.0.status.as_ref().and_then(|st| st.ready_to_use) == Some(true),
            }
        })
        .collect())
}

/// The VM's point on `target` (not `own`) and where each of its claims was, or why there is
/// none to read from.
pub(super) async fn find_point(
    client: &kube::Client,
    ns: &str,
    vm: &str,
    target: &str,
    own: &str,
) -> Result<(Point, PointVolumes), String> {
    let points = points_of(client, ns, vm).await?;
    let p = choose_base(&points, target, own).cloned().ok_or_else(|| {
        format!(
            "no earlier backup point of VirtualMachine {vm} on target {target} \
             (a first backup, or its Backup was deleted)"
        )
    })?;
    let resolved = resolve::snapshot_source(client, ns, &p.snapshot)
        .await
        .map_err(|e| format!("reading the backup point {}: {e}", p.snapshot))?;
    match resolved.state {
        SourceState::Ready { .. } => {}
        SourceState::NotFound(m) | SourceState::NotReady(m) => {
            return Err(format!("the backup point {} is unusable: {m}", p.snapshot));
        }
        other => {
            return Err(format!(
                "the backup point {} is unusable: {other:?}",
                p.snapshot
            ));
        }
    }
    let volumes = resolved
        .volumes
        .into_iter()
        .filter_map(|v| {
            let pv = v.pv.metadata.name.clone()?;
            Some((v.name, (pv, v.handle?)))
        })
        .collect();
    Ok((p, volumes))
}

/// Marks snapshot `name` (of a Backup that succeeded) as its VM's backup point.
pub(super) async fn keep_point(client: &kube::Client, ns: &str, name: &str) -> Result<(), String> {
    let api: Api<VmSnapshot> = Api::namespaced(client.clone(), ns);
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {POINT_LABEL: "true"}}})),
    )
    .await
    .map(|_| ())
    .map_err(|e| format!("marking {name} as the backup point: {e}"))
}

/// Deletes VM `vm`'s older points on `target` now that `keep` is the point.
pub(super) async fn drop_points(
    client: &kube::Client,
    ns: &str,
    vm: &str,
    target: &str,
    keep: &str,
) {
    let points = match points_of(client, ns, vm).await {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "listing older backup points failed");
            return;
        }
    };
    let api: Api<VmSnapshot> = Api::namespaced(client.clone(), ns);
    for name in older_points(&points, target, keep) {
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_not_found() => {}
            Err(e) => {
                tracing::warn!(snapshot = %name, error = %e, "deleting an older backup point failed")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(snapshot: &str, target: &str, at: &str, ready: bool) -> Point {
        Point {
            snapshot: snapshot.into(),
            target: target.into(),
            backup_name: format!("ns-{snapshot}"),
            created: Some(Time(at.parse().unwrap())),
            ready,
        }
    }

    #[test]
    fn the_newest_ready_point_of_the_target_is_the_base_and_the_others_go() {
        let points = [
            point("backup-b1-vm", "s3", "2026-12-04T10:00:00Z", true),
            point("backup-b2-vm", "s3", "2026-12-04T11:00:00Z", true),
            point("backup-b3-vm", "s3", "2026-12-04T12:00:00Z", false),
            point("backup-c1-vm", "nfs", "2026-12-04T13:00:00Z", true),
        ];
        assert_eq!(
            choose_base(&points, "s3", "backup-b4-vm").map(|p| p.snapshot.as_str()),
            Some("backup-b2-vm")
        );
        // Its own snapshot (a rerun after a restart) is never its base.
        assert_eq!(
            choose_base(&points, "s3", "backup-b2-vm").map(|p| p.snapshot.as_str()),
            Some("backup-b1-vm")
        );
        assert_eq!(
            choose_base(&points, "nfs", "x").map(|p| p.snapshot.as_str()),
            Some("backup-c1-vm")
        );
        assert!(choose_base(&points, "other", "x").is_none());
        assert_eq!(
            older_points(&points, "s3", "backup-b4-vm"),
            ["backup-b1-vm", "backup-b2-vm", "backup-b3-vm"]
        );
        assert_eq!(
            older_points(&points, "nfs", "backup-c1-vm"),
            Vec::<String>::new()
        );
    }

    #[test]
    fn a_claim_is_read_incrementally_only_from_its_own_volume_in_the_point() {
        let p = point("backup-b1-vm", "s3", "2026-12-04T10:00:00Z", true);
        let vols: PointVolumes = [(
            "data".to_string(),
            ("pvc-1".to_string(), "layer-000002.qcow2".to_string()),
        )]
        .into();
        let ok = Ok((p, vols));
        assert_eq!(
            since(&ok, "data", "pvc-1"),
            Ok(Since {
                backup_name: "ns-backup-b1-vm".into(),
                layer: "layer-000002.qcow2".into()
            })
        );
        let other = since(&ok, "data", "pvc-2").unwrap_err();
        assert!(
            other.contains("volume pvc-2") && other.contains("pvc-1"),
            "{other}"
        );
        let new = since(&ok, "root", "pvc-3").unwrap_err();
        assert!(
            new.contains("claim root is not in the previous backup"),
            "{new}"
        );
        let none = Err("no earlier backup point".to_string());
        assert_eq!(
            since(&none, "data", "pvc-1"),
            Err("no earlier backup point".into())
        );
    }
}
