//! Restoring a VolumeSnapshot into a newly provisioned claim (`dataSource`/`dataSourceRef` of
//! kind VolumeSnapshot), called by the PVC controller between provisioning the volume and
//! binding it: the snapshot's layers are converted into the new volume's `disk.img` where the
//! bytes are — by the node's agent for a `local` snapshot (the new volume must be on the same
//! node; restoring across nodes is refused with the reason), here for a `shared` one.

use std::path::Path;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::Api;

use ferrovirt_agent::nodestore::{Populate, Source};

use super::resources::{VolSnap, VolSnapContent};
use super::volume::{snapshot_source, split_handle};
use crate::runtime::stores::Stores;
use crate::storage::classes::Builtin;
use crate::storage::nodes::{self, Placement};
use crate::storage::pvc::ProvisionPlan;

/// What [`populate_claim`] needs besides the claim.
pub struct PopulateCtx<'a> {
    pub client: &'a kube::Client,
    pub stores: &'a Stores,
    pub agent_token: Option<&'a str>,
}

/// Fill the volume just provisioned for `pvc` (`plan`, at `dir`) from its VolumeSnapshot
/// source; `Ok` at once for a claim without one. The error says why (retried by the caller).
pub async fn populate_claim(
    ctx: &PopulateCtx<'_>,
    pvc: &PersistentVolumeClaim,
    plan: &ProvisionPlan,
    dir: &Path,
) -> Result<(), String> {
    let Some(vs_name) = snapshot_source(pvc) else {
        return Ok(());
    };
    let ns = pvc
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let api_err = |e: kube::Error| e.to_string();
    let vs = Api::<VolSnap>::namespaced(ctx.client.clone(), &ns)
        .get_opt(&vs_name)
        .await
        .map_err(api_err)?
        .ok_or_else(|| format!("VolumeSnapshot {vs_name} does not exist"))?;
    let st = vs.0.status.clone().unwrap_or_default();
    let (Some(true), Some(content)) = (st.ready_to_use, st.bound_volume_snapshot_content_name)
    else {
        return Err(format!("VolumeSnapshot {vs_name} is not ready to use"));
    };
    let content = Api::<VolSnapContent>::all(ctx.client.clone())
        .get_opt(&content)
        .await
        .map_err(api_err)?
        .ok_or_else(|| format!("VolumeSnapshotContent {content} does not exist"))?;
    let handle = content
        .0
        .status
        .as_ref()
        .and_then(|s| s.snapshot_handle.clone())
        .unwrap_or_default();
    let Some((src_pv, layer)) = split_handle(&handle) else {
        return Err(format!(
            "VolumeSnapshotContent of {vs_name} has no ferrovirt snapshot handle ({handle:?})"
        ));
    };
    let Some(pv) = ctx
        .stores
        .pv_list()
        .into_iter()
        .find(|p| p.metadata.name.as_deref() == Some(src_pv))
    else {
        return Err(format!(
            "the volume {src_pv} of VolumeSnapshot {vs_name} no longer exists"
        ));
    };
    match nodes::placement(&pv) {
        Placement::Node { node, volume } => {
            if plan.builtin != Builtin::Local || plan.node.as_deref() != Some(node.as_str()) {
                return Err(format!(
                    "restoring across nodes is not supported: VolumeSnapshot {vs_name} is on node {node}, the claim's volume on {}",
                    plan.node.as_deref().unwrap_or("the server (shared class)")
                ));
            }
            let storage = nodes::storage_of(ctx.stores, &node, ctx.agent_token)?;
            let req = Populate {
                capacity: plan.bytes,
                source: Source::Snapshot {
                    volume,
                    handle: layer.to_string(),
                },
            };
            storage
                .populate(&plan.pv_name, &req, |_| {})
                .await
                .map_err(|e| e.message)
        }
        Placement::Path(src_dir) => {
            if plan.builtin != Builtin::Shared {
                return Err(format!(
                    "VolumeSnapshot {vs_name} is of a shared volume; restore it into a claim of a shared class"
                ));
            }
            let (layer, target) = (
                layer.to_string(),
                dir.join(ferrovirt_storage::provisioner::DISK_IMAGE),
            );
            tokio::task::spawn_blocking(move || {
                ferrovirt_storage::snapshot::export_raw(&src_dir, Some(&layer), &target)
            })
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())
        }
        Placement::Unknown => Err(format!("the volume {src_pv} has no known location")),
    }
}
