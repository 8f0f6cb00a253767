//! Where the released layers of a volume are merged (docs/snapshots.md, "Reclaiming layers
//! while the VM runs"): [`decide`] (pure) says offline (no unfinished VMI uses the claim),
//! online through the node agent of the VMI that runs on it, or wait (the VMI is not running
//! yet, or migrating); [`merge_online`] asks that agent
//! (`POST /storage/vmis/{uid}/reclaim`), which has the VMI's launcher run QEMU's block jobs.

use ferrovirt_api::kubevirt::vmi::{VirtualMachineInstance, VmiPhase};

use crate::runtime::stores::Stores;
use crate::storage::nodes;

/// Where a volume's released layers are merged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Where {
    /// No VM runs on it: `qemu-img` on the volume (the existing path).
    Offline,
    /// In the QEMU of VMI `uid` on `node`, whose volume `volume` is the claim.
    Online {
        node: String,
        uid: String,
        volume: String,
    },
    /// Not now; the reason.
    Wait(String),
}

/// Where the released layers of claim `claim` are merged, given the unfinished VMI using it
/// (pure).
pub fn decide(vmi: Option<&VirtualMachineInstance>, claim: &str) -> Where {
    let Some(vmi) = vmi else {
        return Where::Offline;
    };
    let status = vmi.status.as_ref();
    if status.and_then(|s| s.phase) != Some(VmiPhase::Running) {
        return Where::Wait("its VMI is not running yet".into());
    }
    if status
        .and_then(|s| s.migration_state.as_ref())
        .is_some_and(|m| m.completed != Some(true) && m.failed != Some(true))
    {
        return Where::Wait("its VMI is migrating".into());
    }
    let (Some(node), Some(uid)) = (
        status.and_then(|s| s.node_name.clone()),
        vmi.metadata.uid.clone(),
    ) else {
        return Where::Wait("its VMI has no node yet".into());
    };
    let volume = vmi
        .spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .into_iter()
        .flatten()
        .find(|v| {
            v.persistent_volume_claim
                .as_ref()
                .is_some_and(|c| c.claim_name == claim)
                || v.data_volume.as_ref().is_some_and(|d| d.name == claim)
        });
    match volume {
        Some(v) => Where::Online {
            node,
            uid,
            volume: v.name.clone(),
        },
        None => Where::Wait(format!(
            "its VMI uses claim {claim} only through an ephemeral overlay"
        )),
    }
}

/// Merges the released layers of `volume` of VMI `uid` on `node` in its QEMU; returns the
/// dropped layer files.
pub async fn merge_online(
    stores: &Stores,
    token: Option<&str>,
    node: &str,
    uid: &str,
    volume: &str,
) -> Result<Vec<String>, String> {
    let storage = nodes::storage_of(stores, node, token)?;
    storage
        .reclaim_online(uid, volume)
        .await
        .map(|r| r.dropped)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vmi(v: serde_json::Value) -> VirtualMachineInstance {
        serde_json::from_value(v).unwrap()
    }

    fn running() -> serde_json::Value {
        json!({"metadata": {"name": "vm", "namespace": "ns", "uid": "u1"},
               "spec": {"domain": {"devices": {}}, "volumes": [
                   {"name": "root", "containerDisk": {"image": "x"}},
                   {"name": "data", "persistentVolumeClaim": {"claimName": "pvc-data"}},
                   {"name": "dv", "dataVolume": {"name": "dv-1"}}]},
               "status": {"phase": "Running", "nodeName": "n1"}})
    }

    #[test]
    fn a_running_vmi_merges_online_on_its_node_by_its_volume_name() {
        assert_eq!(decide(None, "pvc-data"), Where::Offline);
        assert_eq!(
            decide(Some(&vmi(running())), "pvc-data"),
            Where::Online {
                node: "n1".into(),
                uid: "u1".into(),
                volume: "data".into()
            }
        );
        assert!(matches!(
            decide(Some(&vmi(running())), "dv-1"),
            Where::Online { volume, .. } if volume == "dv"
        ));
    }

    #[test]
    fn a_vmi_not_running_or_migrating_waits() {
        let mut v = running();
        v["status"]["phase"] = json!("Scheduled");
        assert!(
            matches!(decide(Some(&vmi(v)), "pvc-data"), Where::Wait(r) if r.contains("not running"))
        );
        let mut v = running();
        v["status"]["migrationState"] = json!({"targetNode": "n2"});
        assert!(
            matches!(decide(Some(&vmi(v.clone())), "pvc-data"), Where::Wait(r) if r.contains("migrating"))
        );
        v["status"]["migrationState"]["completed"] = json!(true);
        assert!(matches!(
            decide(Some(&vmi(v)), "pvc-data"),
            Where::Online { .. }
        ));
        assert!(matches!(
            decide(Some(&vmi(running())), "other"),
            Where::Wait(_)
        ));
    }
}
