//! PVC expansion: [`decide`] (pure) compares a bound claim's requested size with its
//! volume's capacity and its class's `allowVolumeExpansion`; [`expand`] grows the volume
//! (sparse `disk.img`, plus `losetup -c` for Block volumes; a node-local volume is grown by
//! its node's agent, [`Expansion::GrowOnNode`]) and [`record`] writes the new size on the
//! PV (`spec.capacity`) and the claim (`status.capacity`, `status.allocatedResources`, no
//! resize conditions left) as Kubernetes' resizer does. Raw disks need no filesystem step,
//! so there is no `FileSystemResizePending`. Shrinking is refused by admission.

use std::path::PathBuf;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use super::Dirs;
use super::pvc::quantity_bytes;
use crate::error::ControllerError;

/// What to do about a bound claim's size.
#[derive(Debug, Clone, PartialEq)]
pub enum Expansion {
    /// Sizes agree.
    Nothing,
    /// Grow the volume at `dir` to `bytes` (`size` as the user wrote it).
    Grow {
        dir: PathBuf,
        bytes: u64,
        size: Quantity,
    },
    /// Have node `node`'s agent grow its volume `volume` to `bytes`.
    GrowOnNode {
        node: String,
        volume: String,
        bytes: u64,
        size: Quantity,
    },
    /// The volume already has the size; only the claim's status lags behind.
    SyncStatus { size: Quantity },
    /// The claim asks for more than the volume has but it cannot grow; `message` says why.
    Refused { message: String },
}

fn requested(pvc: &PersistentVolumeClaim) -> Option<&Quantity> {
    pvc.spec
        .as_ref()?
        .resources
        .as_ref()?
        .requests
        .as_ref()?
        .get("storage")
}

fn pv_capacity(pv: &PersistentVolume) -> Option<&Quantity> {
    pv.spec.as_ref()?.capacity.as_ref()?.get("storage")
}

/// Decide whether the bound claim `pvc` on `pv` (of `class`) must grow. Only volumes inside
/// the ferrovirt volume roots (`dirs`) can grow.
pub fn decide(
    pvc: &PersistentVolumeClaim,
    pv: &PersistentVolume,
    class: Option<&StorageClass>,
    dirs: &Dirs,
) -> Expansion {
    let (Some(want), Some(have)) = (requested(pvc), pv_capacity(pv)) else {
        return Expansion::Nothing;
    };
    let (Ok(want_b), Ok(have_b)) = (quantity_bytes(want), quantity_bytes(have)) else {
        return Expansion::Nothing;
    };
    if want_b <= have_b {
        let status_cap = pvc
            .status
            .as_ref()
            .and_then(|s| s.capacity.as_ref())
            .and_then(|c| c.get("storage"))
            .and_then(|q| quantity_bytes(q).ok());
        return match status_cap {
            Some(c) if c != have_b => Expansion::SyncStatus { size: have.clone() },
            _ => Expansion::Nothing,
        };
    }
    let class_name = class
        .and_then(|c| c.metadata.name.clone())
        .unwrap_or_default();
    if class.and_then(|c| c.allow_volume_expansion) != Some(true) {
        return Expansion::Refused {
            message: format!(
                "only dynamically provisioned pvc can be resized and the storageclass that \
                 provisions the pvc must support resize (storageclass {class_name:?} has no \
                 allowVolumeExpansion: true)"
            ),
        };
    }
    match super::nodes::placement(pv) {
        super::nodes::Placement::Node { node, volume } => Expansion::GrowOnNode {
            node,
            volume,
            bytes: want_b,
            size: want.clone(),
        },
        super::nodes::Placement::Path(d) if dirs.owns(&d) => Expansion::Grow {
            dir: d,
            bytes: want_b,
            size: want.clone(),
        },
        _ => Expansion::Refused {
            message: format!(
                "volume {} was not provisioned by ferrovirt and cannot be resized",
                pv.metadata.name.as_deref().unwrap_or_default()
            ),
        },
    }
}

/// Record `size` as the claim's capacity: `status.capacity`, `status.allocatedResources`,
/// and no resize conditions.
pub async fn set_claim_capacity(
    client: &kube::Client,
    pvc: &PersistentVolumeClaim,
    size: &Quantity,
) -> Result<(), ControllerError> {
    let ns = pvc.metadata.namespace.as_deref().unwrap_or("default");
    let name = pvc.metadata.name.as_deref().unwrap_or_default();
    let patch = json!({"status": {
        "capacity": {"storage": size},
        "allocatedResources": {"storage": size},
        "allocatedResourceStatuses": null,
        "conditions": null,
    }});
    Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// Grow the volume, then record the size on the PV and the claim. `Ok(Err(message))` when
/// the volume could not grow.
pub async fn expand(
    client: &kube::Client,
    pvc: &PersistentVolumeClaim,
    pv: &PersistentVolume,
    dir: &std::path::Path,
    bytes: u64,
    size: &Quantity,
) -> Result<Result<(), String>, ControllerError> {
    if let Err(e) = super::block::grow(dir, bytes).await {
        return Ok(Err(e.to_string()));
    }
    record(client, pvc, pv, size).await?;
    Ok(Ok(()))
}

/// Record a grown volume's `size` on its PV (`spec.capacity`) and on the claim.
pub async fn record(
    client: &kube::Client,
    pvc: &PersistentVolumeClaim,
    pv: &PersistentVolume,
    size: &Quantity,
) -> Result<(), ControllerError> {
    let pv_name = pv.metadata.name.as_deref().unwrap_or_default();
    let patch = json!({"spec": {"capacity": {"storage": size}}});
    Api::<PersistentVolume>::all(client.clone())
        .patch(pv_name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    set_claim_capacity(client, pvc, size).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn pvc(req: &str, status_cap: Option<&str>) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "default"},
            "spec": {"resources": {"requests": {"storage": req}}},
            "status": status_cap.map(|c| json!({"phase": "Bound", "capacity": {"storage": c}}))
        }))
        .unwrap()
    }

    fn pv(cap: &str, path: &str) -> PersistentVolume {
        serde_json::from_value(json!({
            "metadata": {"name": "pvc-1"},
            "spec": {"capacity": {"storage": cap}, "hostPath": {"path": path}}
        }))
        .unwrap()
    }

    fn class(allow: Option<bool>) -> StorageClass {
        serde_json::from_value(json!({
            "metadata": {"name": "shared"}, "provisioner": "ferrovirt.io/shared",
            "allowVolumeExpansion": allow
        }))
        .unwrap()
    }

    #[test]
    fn grows_only_when_allowed_and_ours() {
        let dirs = Dirs::under(Path::new("/data"));
        let v = pv("64Mi", "/data/volumes/pvc-1");
        let c = class(Some(true));
        assert_eq!(
            decide(&pvc("64Mi", Some("64Mi")), &v, Some(&c), &dirs),
            Expansion::Nothing
        );
        assert_eq!(
            decide(&pvc("128Mi", Some("64Mi")), &v, Some(&c), &dirs),
            Expansion::Grow {
                dir: "/data/volumes/pvc-1".into(),
                bytes: 128 << 20,
                size: Quantity("128Mi".into())
            }
        );
        assert!(matches!(
            decide(&pvc("128Mi", Some("64Mi")), &v, Some(&class(None)), &dirs),
            Expansion::Refused { message } if message.contains("allowVolumeExpansion")
        ));
        let foreign = pv("64Mi", "/mnt/disk");
        assert!(matches!(
            decide(&pvc("128Mi", Some("64Mi")), &foreign, Some(&c), &dirs),
            Expansion::Refused { message } if message.contains("not provisioned")
        ));
        // The volume grew already (e.g. the status patch was lost): only sync the claim.
        let grown = pv("128Mi", "/data/volumes/pvc-1");
        assert_eq!(
            decide(&pvc("128Mi", Some("64Mi")), &grown, Some(&c), &dirs),
            Expansion::SyncStatus {
                size: Quantity("128Mi".into())
            }
        );
        // A node-local volume of ours is grown by its node's agent.
        let local: PersistentVolume = serde_json::from_value(json!({
            "metadata": {"name": "pvc-9", "annotations": {
                "pv.kubernetes.io/provisioned-by": "ferrovirt.io/local"}},
            "spec": {"capacity": {"storage": "64Mi"}, "local": {"path": "/agent/volumes/pvc-9"},
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n2"]}]}]}}}
        }))
        .unwrap();
        assert_eq!(
            decide(&pvc("128Mi", Some("64Mi")), &local, Some(&c), &dirs),
            Expansion::GrowOnNode {
                node: "n2".into(),
                volume: "pvc-9".into(),
                bytes: 128 << 20,
                size: Quantity("128Mi".into())
            }
        );
        // A smaller request (admission refuses it) never shrinks anything.
        assert_eq!(
            decide(&pvc("32Mi", Some("64Mi")), &v, Some(&c), &dirs),
            Expansion::Nothing
        );
    }
}
