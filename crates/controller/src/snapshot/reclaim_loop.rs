//! Reclaiming the layers of deleted snapshots (docs/snapshots.md "Reclaiming layers").
//!
//! Every VolumeSnapshotContent of ferrovirt's drivers with deletion policy `Delete` carries
//! the finalizer [`FINALIZER`]. When such a content is deleted, its frozen layer is released
//! where the volume's bytes are (the node's agent for `local` volumes, here for `shared` ones)
//! and the finalizer is dropped; when no running VM uses the volume the released layers are
//! merged away at once, when one runs they are merged in its QEMU through its node's agent
//! ([`super::reclaim_online`]); a merge that cannot happen now (the VMI not running yet, a
//! failure: a Warning Event on the claim names it) is retried on VMI changes and every 30 s. A content whose volume or node is gone, or
//! whose handle another content still names, is let go without a release. [`decide`] is the
//! pure decision.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use serde_json::json;

use ferrovirt_api::volumesnapshot::{DRIVER, SHARED_DRIVER, VolumeSnapshotContent};

use super::reclaim_online::{self, Where};
use super::resources::VolSnapContent;
use crate::error::ControllerError;
use crate::runtime::events::EventRecorder;
use crate::runtime::stores::{Kind, Stores};
use crate::storage::nodes::{self, Placement};

/// The finalizer that holds a deleted content until its layer is released.
pub const FINALIZER: &str = "snapshot.ferrovirt.io/layer-reclaim";

/// What to do with a VolumeSnapshotContent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Not ours, or nothing to do.
    Ignore,
    /// A live content of ours without the finalizer.
    AddFinalizer,
    /// Deleted: release layer `layer` of volume `pv`, then drop the finalizer.
    Release { pv: String, layer: String },
    /// Deleted, with nothing to release (no handle, or a `Retain` content).
    DropFinalizer,
}

/// The `<pv>/<layer>` handle of a content (dynamic: its status; pre-provisioned: its source).
pub fn handle(c: &VolumeSnapshotContent) -> Option<(String, String)> {
    let h = c
        .status
        .as_ref()
        .and_then(|s| s.snapshot_handle.clone())
        .or_else(|| c.spec.as_ref()?.source.snapshot_handle.clone())?;
    let (pv, layer) = h.split_once('/')?;
    (!pv.is_empty() && !layer.is_empty() && !layer.contains('/'))
        .then(|| (pv.to_string(), layer.to_string()))
}

/// The decision for content `c` (pure).
pub fn decide(c: &VolumeSnapshotContent) -> Decision {
    let Some(spec) = c.spec.as_ref() else {
        return Decision::Ignore;
    };
    let ours = spec.driver == DRIVER || spec.driver == SHARED_DRIVER;
    let has = c
        .metadata
        .finalizers
        .as_ref()
        .is_some_and(|f| f.iter().any(|x| x == FINALIZER));
    let deleting = c.metadata.deletion_timestamp.is_some();
    match (deleting, has) {
        (false, false) if ours && spec.deletion_policy == "Delete" => Decision::AddFinalizer,
        (false, _) => Decision::Ignore,
        (true, false) => Decision::Ignore,
        (true, true) => match handle(c) {
            Some((pv, layer)) if spec.deletion_policy == "Delete" => {
                Decision::Release { pv, layer }
            }
            _ => Decision::DropFinalizer,
        },
    }
}

struct Ctx {
    client: kube::Client,
    stores: Stores,
    agent_token: Option<String>,
    /// Volumes with released layers whose merge has not happened yet.
    pending: Mutex<BTreeSet<String>>,
    recorder: EventRecorder,
}

/// Run the reclaim controller until its watch ends or the future is dropped.
pub async fn run(
    client: kube::Client,
    stores: Stores,
    agent_token: Option<String>,
) -> Result<(), ControllerError> {
    stores.ready().await;
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        stores,
        agent_token,
        pending: Mutex::new(BTreeSet::new()),
        recorder: EventRecorder::new(client.clone(), super::loops::COMPONENT),
    });
    let contents = crate::runtime::drive(
        Controller::new(
            Api::<VolSnapContent>::all(client.clone()),
            watcher::Config::default(),
        )
        .run(
            crate::runtime::metrics::timed("VolumeSnapshotContent layer reclaim", reconcile),
            error_policy,
            ctx.clone(),
        ),
        super::loops::COMPONENT,
        "VolumeSnapshotContent layer reclaim",
    );
    tokio::select! {
        r = contents => r,
        () = merge_pending(ctx) => Ok(()),
    }
}

fn error_policy(_o: Arc<VolSnapContent>, err: &ControllerError, _ctx: Arc<Ctx>) -> Action {
    tracing::warn!(error = %err, "layer reclaim failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

async fn reconcile(obj: Arc<VolSnapContent>, ctx: Arc<Ctx>) -> Result<Action, ControllerError> {
    let c = &obj.0;
    let name = c.metadata.name.clone().unwrap_or_default();
    let api: Api<VolSnapContent> = Api::all(ctx.client.clone());
    let finalizers = c.metadata.finalizers.clone().unwrap_or_default();
    match decide(c) {
        Decision::Ignore => return Ok(Action::await_change()),
        Decision::AddFinalizer => {
            let mut f = finalizers;
            f.push(FINALIZER.to_string());
            let patch = json!({"metadata": {"finalizers": f,
                "resourceVersion": c.metadata.resource_version}});
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            return Ok(Action::await_change());
        }
        Decision::Release { pv, layer } => release(&ctx, &name, &pv, &layer).await?,
        Decision::DropFinalizer => {}
    }
    let left: Vec<String> = finalizers.into_iter().filter(|f| f != FINALIZER).collect();
    let patch = json!({"metadata": {"finalizers": left,
        "resourceVersion": c.metadata.resource_version}});
    api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(Action::await_change())
}

/// Release `layer` of volume `pv` for deleted content `content`, merging it away when no VM
/// uses the volume. Gone volumes and nodes, and handles another content names, are skipped.
async fn release(ctx: &Ctx, content: &str, pv: &str, layer: &str) -> Result<(), ControllerError> {
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let Some(volume) = pvs.get_opt(pv).await? else {
        return Ok(());
    };
    let all = Api::<VolSnapContent>::all(ctx.client.clone())
        .list(&ListParams::default())
        .await?;
    let shared = all.items.iter().any(|o| {
        o.0.metadata.name.as_deref() != Some(content)
            && o.0.metadata.deletion_timestamp.is_none()
            && handle(&o.0).is_some_and(|(p, l)| p == pv && l == layer)
    });
    if shared {
        return Ok(());
    }
    let merge = where_merged(&ctx.stores, &volume) == Where::Offline;
    match call(ctx, &volume, vec![layer.to_string()], merge).await {
        Ok(dropped) => {
            tracing::info!(pv, layer, merge, ?dropped, "snapshot layer released");
            if !merge {
                ctx.pending
                    .lock()
                    .expect("pending lock")
                    .insert(pv.to_string());
                // A running VM: merge in its QEMU now (retried by `merge_pending`).
                merge_one(ctx, &volume).await;
            }
            Ok(())
        }
        Err(Gone) => Ok(()),
        Err(Failed(e)) => Err(ControllerError::Storage(format!(
            "releasing snapshot layer {layer} of {pv}: {e}"
        ))),
    }
}

use CallError::{Failed, Gone};

enum CallError {
    /// The volume's node no longer exists: nothing to release.
    Gone,
    Failed(String),
}

/// Release `release` on `volume` where its bytes are; with `merge`, drop every released layer.
async fn call(
    ctx: &Ctx,
    volume: &PersistentVolume,
    release: Vec<String>,
    merge: bool,
) -> Result<Vec<String>, CallError> {
    match nodes::placement(volume) {
        Placement::Node { node, volume } => {
            let storage = match nodes::storage_of(&ctx.stores, &node, ctx.agent_token.as_deref()) {
                Ok(s) => s,
                // A node that no longer exists holds nothing to release.
                Err(_) if ctx.stores.nodes.get(&ObjectRef::new(&node)).is_none() => {
                    return Err(Gone);
                }
                Err(e) => return Err(Failed(e)),
            };
            storage
                .reclaim(&volume, release, merge)
                .await
                .map(|r| r.dropped)
                .map_err(|e| Failed(e.to_string()))
        }
        Placement::Path(dir) => tokio::task::spawn_blocking(move || {
            ferrovirt_storage::snapshot::release(&dir, &release)?;
            if merge {
                ferrovirt_storage::snapshot::reclaim(&dir).map(|r| r.dropped)
            } else {
                Ok(Vec::new())
            }
        })
        .await
        .map_err(|e| Failed(e.to_string()))?
        .map_err(|e| Failed(e.to_string())),
        Placement::Unknown => Err(Gone),
    }
}

/// Where the volume's released layers are merged: offline when no unfinished VMI uses its
/// claim, else in that VMI's QEMU.
fn where_merged(stores: &Stores, volume: &PersistentVolume) -> Where {
    let Some(claim) = volume.spec.as_ref().and_then(|s| s.claim_ref.as_ref()) else {
        return Where::Offline;
    };
    let (Some(ns), Some(name)) = (claim.namespace.as_deref(), claim.name.as_deref()) else {
        return Where::Offline;
    };
    let Some(user) = super::loops::claim_user(stores, ns, name) else {
        return Where::Offline;
    };
    let vmi = stores
        .vmis
        .get(&ObjectRef::new(&user).within(ns))
        .map(|v| v.0.clone());
    reclaim_online::decide(vmi.as_ref(), name)
}

/// Merges the released layers of a pending volume where [`where_merged`] says; a merge done
/// (or a volume gone) leaves the pending set. A failure is logged and, online, recorded as a
/// Warning Event on the claim; the layers stay as they are.
async fn merge_one(ctx: &Ctx, volume: &PersistentVolume) {
    let pv = volume.metadata.name.clone().unwrap_or_default();
    let done = |ctx: &Ctx| {
        ctx.pending.lock().expect("pending lock").remove(&pv);
    };
    match where_merged(&ctx.stores, volume) {
        Where::Wait(why) => tracing::debug!(pv, "merging released layers waits: {why}"),
        Where::Offline => match call(ctx, volume, Vec::new(), true).await {
            Ok(dropped) => {
                tracing::info!(pv, ?dropped, "released snapshot layers merged");
                done(ctx);
            }
            Err(Gone) => done(ctx),
            Err(Failed(e)) => tracing::warn!(pv, error = %e, "merging released layers"),
        },
        Where::Online {
            node,
            uid,
            volume: name,
        } => {
            match reclaim_online::merge_online(
                &ctx.stores,
                ctx.agent_token.as_deref(),
                &node,
                &uid,
                &name,
            )
            .await
            {
                Ok(dropped) => {
                    tracing::info!(pv, %uid, ?dropped, "released snapshot layers merged online");
                    done(ctx);
                }
                Err(e) => {
                    tracing::warn!(pv, %uid, error = %e, "merging released layers online");
                    if let Some(claim) = volume.spec.as_ref().and_then(|s| s.claim_ref.clone()) {
                        let object = k8s_openapi::api::core::v1::ObjectReference {
                            api_version: Some("v1".into()),
                            kind: Some("PersistentVolumeClaim".into()),
                            ..claim
                        };
                        let message = format!(
                            "merging the released snapshot layers of volume {pv} under the \
                             running VM failed (the layers stay; retried): {e}"
                        );
                        ctx.recorder
                            .record(&object, true, "SnapshotLayerMergeFailed", &message)
                            .await;
                    }
                }
            }
        }
    }
}

/// How often pending merges are retried besides VMI changes.
const RETRY_EVERY: Duration = Duration::from_secs(30);

/// Merge the pending volumes, on every VMI change and every [`RETRY_EVERY`].
async fn merge_pending(ctx: Arc<Ctx>) {
    let mut changes = ctx.stores.changes();
    loop {
        tokio::select! {
            b = changes.next_batch(&[Kind::Vmi]) => if b.is_none() { return },
            () = tokio::time::sleep(RETRY_EVERY) => {}
        }
        let pending: Vec<String> = ctx
            .pending
            .lock()
            .expect("pending lock")
            .iter()
            .cloned()
            .collect();
        for pv in pending {
            let Some(volume) = ctx.stores.pvs.get(&ObjectRef::new(&pv)) else {
                ctx.pending.lock().expect("pending lock").remove(&pv);
                continue;
            };
            merge_one(&ctx, &volume).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn content(v: serde_json::Value) -> VolumeSnapshotContent {
        serde_json::from_value(v).unwrap()
    }

    fn base(policy: &str, driver: &str) -> serde_json::Value {
        json!({"metadata": {"name": "c"}, "spec": {
            "volumeSnapshotRef": {"name": "s", "namespace": "ns"},
            "deletionPolicy": policy, "driver": driver,
            "source": {"volumeHandle": "pv1"}},
            "status": {"snapshotHandle": "pv1/layer-000001.qcow2"}})
    }

    #[test]
    fn ours_get_the_finalizer_and_release_their_layer() {
        let mut v = base("Delete", DRIVER);
        assert_eq!(decide(&content(v.clone())), Decision::AddFinalizer);
        v["metadata"]["finalizers"] = json!([FINALIZER]);
        assert_eq!(decide(&content(v.clone())), Decision::Ignore);
        v["metadata"]["deletionTimestamp"] = json!("2026-12-03T10:00:00Z");
        assert_eq!(
            decide(&content(v.clone())),
            Decision::Release {
                pv: "pv1".into(),
                layer: "layer-000001.qcow2".into()
            }
        );
        // A deleted content that never got a handle just lets go.
        v["status"] = json!({});
        assert_eq!(decide(&content(v)), Decision::DropFinalizer);
    }

    #[test]
    fn retained_and_foreign_contents_are_left_alone() {
        assert_eq!(
            decide(&content(base("Retain", DRIVER))),
            Decision::Ignore,
            "a Retain content keeps its layer"
        );
        assert_eq!(
            decide(&content(base("Delete", "csi.example.com"))),
            Decision::Ignore
        );
        let mut v = base("Delete", SHARED_DRIVER);
        assert_eq!(decide(&content(v.clone())), Decision::AddFinalizer);
        // A hostile handle never names a path.
        v["status"]["snapshotHandle"] = json!("pv1/../../etc");
        assert_eq!(handle(&content(v)), None);
    }
}
