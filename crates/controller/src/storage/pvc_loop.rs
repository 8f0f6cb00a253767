//! The PVC controller loop: watches PersistentVolumeClaims (and VMIs, whose scheduling
//! selects the node of WaitForFirstConsumer claims), applies [`super::pvc::decide`]:
//! provisions volume directories — `shared` ones here with `ferrovirt_storage`, node-local
//! ones by the node's agent ([`super::nodes`]) — creates the PersistentVolume,
//! binds claim and volume (PV `claimRef` + both statuses `Bound`), attaches the loop device
//! of Block-mode volumes ([`super::block`]) and grows bound volumes whose claims grew
//! ([`super::expansion`]). [`reclaim_loop`] deletes (with their directories, detaching loop
//! devices first; a node-local volume by its node's agent, and its PV only once the agent
//! removed it) or releases volumes whose claims are gone, and re-attaches shared Block
//! volumes.
//! Volumes, classes and VMIs are read from the shared reflector caches
//! ([`crate::runtime::stores`]); a decision to bind or provision is re-checked against a fresh
//! list first (the caches may lag a write just made), so steady state lists nothing.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use serde_json::json;

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_storage::provisioner::VolumeRoot;

use super::Dirs;
use super::block;
use super::classes::{self, Builtin};
use super::expansion::{self, Expansion};
use super::nodes::{self, Placement};
use super::pvc::{self, ProvisionPlan, PvcDecision, Reclaim};
use crate::error::ControllerError;
use crate::runtime::events::{EventRecorder, object_ref};
use crate::runtime::resources::Vmi;
use crate::runtime::stores::{Kind, Stores};
use ferrovirt_agent::nodestore::CreateVolume;

/// Component name on Events.
pub const COMPONENT: &str = "persistentvolume-controller";

struct Ctx {
    client: kube::Client,
    stores: Stores,
    dirs: Dirs,
    /// The agents' endpoint token ([`super::StorageOptions::agent_token`]).
    agent_token: Option<String>,
    recorder: EventRecorder,
    /// (claim uid, reason) pairs already reported, so a waiting claim gets one Event.
    reported: Mutex<HashSet<(String, String)>>,
}

/// The claims (in the VMI's namespace) a VMI's volumes use: `persistentVolumeClaim`,
/// `dataVolume` (same-named claim) and `ephemeral` volumes.
pub fn claims_of(vmi: &VirtualMachineInstance) -> Vec<String> {
    vmi.spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|v| {
            v.persistent_volume_claim
                .as_ref()
                .map(|c| c.claim_name.clone())
                .or_else(|| v.data_volume.as_ref().map(|d| d.name.clone()))
                .or_else(|| {
                    v.ephemeral
                        .as_ref()
                        .and_then(|e| e.persistent_volume_claim.as_ref())
                        .map(|c| c.claim_name.clone())
                })
        })
        .collect()
}

/// Run the PVC controller until its watch ends or the future is dropped.
pub async fn run(
    client: kube::Client,
    dirs: Dirs,
    agent_token: Option<String>,
    stores: Stores,
) -> Result<(), ControllerError> {
    let pvcs: Api<PersistentVolumeClaim> = Api::all(client.clone());
    let vmis: Api<Vmi> = Api::all(client.clone());
    let ctx = Arc::new(Ctx {
        recorder: EventRecorder::new(client.clone(), COMPONENT),
        client,
        stores,
        dirs,
        agent_token,
        reported: Mutex::new(HashSet::new()),
    });
    // Decisions read the volume and class caches: not before they hold their first lists.
    ctx.stores.ready().await;
    crate::runtime::drive(
        Controller::new(pvcs, watcher::Config::default())
            .watches(vmis, watcher::Config::default(), |vmi: Vmi| {
                let ns = vmi.0.metadata.namespace.clone().unwrap_or_default();
                let scheduled = vmi
                    .0
                    .status
                    .as_ref()
                    .and_then(|s| s.node_name.as_ref())
                    .is_some();
                let claims = if scheduled {
                    claims_of(&vmi.0)
                } else {
                    Vec::new()
                };
                claims
                    .into_iter()
                    .map(move |c| ObjectRef::<PersistentVolumeClaim>::new(&c).within(&ns))
            })
            .run(
                crate::runtime::metrics::timed("PVC", reconcile),
                |_, _, _| Action::requeue(Duration::from_secs(2)),
                ctx,
            ),
        COMPONENT,
        "PVC",
    )
    .await
}

fn ns_name(pvc: &PersistentVolumeClaim) -> (String, String) {
    (
        pvc.metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into()),
        pvc.metadata.name.clone().unwrap_or_default(),
    )
}

async fn reconcile(
    claim: Arc<PersistentVolumeClaim>,
    ctx: Arc<Ctx>,
) -> Result<Action, ControllerError> {
    let pvc = &*claim;
    let (ns, name) = ns_name(pvc);
    let mut pvs = ctx.stores.pv_list();
    let mut classes = ctx.stores.class_list();
    let mut decision = pvc::decide(pvc, &pvs, &classes);
    let writes = match decision {
        PvcDecision::Nothing => false,
        PvcDecision::Bind { .. } | PvcDecision::Provision(_) => true,
        // Pending and WaitForFirstConsumer write only a claim that is not Pending yet
        // ([`set_pending`]): a claim already Pending costs no lists on each requeue.
        _ => pvc.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Pending"),
    };
    if writes {
        // Writes are decided on fresh lists, not on caches that may lag: a bound claim whose
        // volume the cache had not seen yet (just created, or the caches still filling after
        // a restart) was marked Pending, and a backup that read it then failed ("claim ... is
        // not bound").
        pvs = Api::<PersistentVolume>::all(ctx.client.clone())
            .list(&ListParams::default())
            .await?
            .items;
        classes = Api::<StorageClass>::all(ctx.client.clone())
            .list(&ListParams::default())
            .await?
            .items;
        decision = pvc::decide(pvc, &pvs, &classes);
    }
    match decision {
        PvcDecision::Nothing => {
            resize_if_needed(&ctx, pvc, &pvs, &classes).await?;
            Ok(Action::requeue(Duration::from_secs(300)))
        }
        PvcDecision::Bind { pv } => {
            let pv = pvs
                .iter()
                .find(|p| p.metadata.name.as_deref() == Some(&pv))
                .cloned();
            if let Some(pv) = pv {
                bind(&ctx, pvc, &pv).await?;
            }
            Ok(Action::requeue(Duration::from_millis(500)))
        }
        PvcDecision::Provision(plan) => {
            if let Some(m) = plan.shared_mount.clone() {
                let written = tokio::task::spawn_blocking(move || {
                    ferrovirt_storage::shared_mount::write_marker(&m.mount, &m.class, &m.uid)
                })
                .await
                .map_err(|e| ControllerError::TaskStopped {
                    name: COMPONENT,
                    reason: e.to_string(),
                })?;
                if let Err(e) = written {
                    report(&ctx, pvc, true, "ProvisioningFailed", &e).await;
                    return Ok(Action::requeue(Duration::from_secs(10)));
                }
            }
            let dir = match plan.builtin {
                Builtin::Shared => provision_shared(&ctx, &plan).await?,
                Builtin::Local => provision_on_node(&ctx, &plan).await,
            };
            let dir: PathBuf = match dir {
                Ok(d) => d,
                Err(message) => {
                    report(&ctx, pvc, true, "ProvisioningFailed", &message).await;
                    return Ok(Action::requeue(Duration::from_secs(5)));
                }
            };
            // A claim restored from a VolumeSnapshot is filled before it is bound.
            let from_snapshot = crate::snapshot::populate::PopulateCtx {
                client: &ctx.client,
                stores: &ctx.stores,
                agent_token: ctx.agent_token.as_deref(),
            };
            if let Err(message) =
                crate::snapshot::populate::populate_claim(&from_snapshot, pvc, &plan, &dir).await
            {
                report(&ctx, pvc, true, "ProvisioningFailed", &message).await;
                return Ok(Action::requeue(Duration::from_secs(3)));
            }
            let pv = pvc::build_pv(&plan, &dir, pvc);
            let api: Api<PersistentVolume> = Api::all(ctx.client.clone());
            let created = match api.create(&PostParams::default(), &pv).await {
                Ok(p) => p,
                Err(kube::Error::Api(s)) if s.is_already_exists() => api.get(&plan.pv_name).await?,
                Err(e) => return Err(e.into()),
            };
            let msg = format!(
                "Successfully provisioned volume {} using {}",
                plan.pv_name, plan.class
            );
            report(&ctx, pvc, false, "ProvisioningSucceeded", &msg).await;
            bind(&ctx, pvc, &created).await?;
            Ok(Action::requeue(Duration::from_millis(500)))
        }
        PvcDecision::WaitForFirstConsumer => {
            if let Some(node) = consumer_node(&ctx.stores, &ns, &name) {
                let patch = json!({"metadata": {"annotations": {pvc::SELECTED_NODE: node}}});
                Api::<PersistentVolumeClaim>::namespaced(ctx.client.clone(), &ns)
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
                return Ok(Action::requeue(Duration::from_millis(100)));
            }
            set_pending(&ctx, pvc).await?;
            let msg = "waiting for first consumer to be created before binding";
            report(&ctx, pvc, false, "WaitForFirstConsumer", msg).await;
            Ok(Action::requeue(Duration::from_secs(5)))
        }
        PvcDecision::Pending { reason, message } => {
            set_pending(&ctx, pvc).await?;
            report(&ctx, pvc, true, &reason, &message).await;
            Ok(Action::requeue(Duration::from_secs(5)))
        }
    }
}

/// Creates a `shared` volume directory here (the server's machine holds the shared root).
async fn provision_shared(
    ctx: &Ctx,
    plan: &ProvisionPlan,
) -> Result<Result<PathBuf, String>, ControllerError> {
    let root = match &plan.shared_mount {
        Some(m) => ferrovirt_storage::shared_mount::volume_root(&m.mount),
        None => ctx.dirs.shared.clone(),
    };
    let (pv_name, bytes) = (plan.pv_name.clone(), plan.bytes);
    let dir = tokio::task::spawn_blocking(move || VolumeRoot::new(root).create(&pv_name, bytes))
        .await
        .map_err(|e| ControllerError::TaskStopped {
            name: COMPONENT,
            reason: e.to_string(),
        })?;
    let dir = match dir {
        Ok(d) => d,
        Err(e) => return Ok(Err(e.to_string())),
    };
    if plan.volume_mode == block::BLOCK
        && let Err(e) = block::provision(&dir).await
    {
        return Ok(Err(e.to_string()));
    }
    Ok(Ok(dir))
}

/// Has the node's agent create a node-local volume; its directory on the node.
async fn provision_on_node(ctx: &Ctx, plan: &ProvisionPlan) -> Result<PathBuf, String> {
    let node = plan.node.as_deref().unwrap_or_default();
    let storage = nodes::storage_of(&ctx.stores, node, ctx.agent_token.as_deref())?;
    let req = CreateVolume {
        bytes: plan.bytes,
        block: plan.volume_mode == block::BLOCK,
    };
    storage
        .create(&plan.pv_name, &req)
        .await
        .map(PathBuf::from)
        .map_err(|e| e.to_string())
}

/// The node of a scheduled VMI in `ns` that uses claim `name` (from the VMI cache).
fn consumer_node(stores: &Stores, ns: &str, name: &str) -> Option<String> {
    stores
        .vmis
        .state()
        .iter()
        .filter(|v| v.0.metadata.namespace.as_deref() == Some(ns))
        .filter(|v| v.0.metadata.deletion_timestamp.is_none())
        .filter(|v| claims_of(&v.0).iter().any(|c| c == name))
        .find_map(|v| v.0.status.as_ref().and_then(|s| s.node_name.clone()))
}

async fn set_pending(ctx: &Ctx, pvc: &PersistentVolumeClaim) -> Result<(), ControllerError> {
    if pvc.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending") {
        return Ok(());
    }
    let (ns, name) = ns_name(pvc);
    let patch = json!({"status": {"phase": "Pending"}});
    Api::<PersistentVolumeClaim>::namespaced(ctx.client.clone(), &ns)
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// Record an Event about the claim once per (claim, reason).
async fn report(ctx: &Ctx, pvc: &PersistentVolumeClaim, warning: bool, reason: &str, msg: &str) {
    let key = (
        pvc.metadata.uid.clone().unwrap_or_default(),
        format!("{reason}/{msg}"),
    );
    if !ctx.reported.lock().expect("lock").insert(key) {
        return;
    }
    let r = object_ref("v1", "PersistentVolumeClaim", &pvc.metadata);
    ctx.recorder.record(&r, warning, reason, msg).await;
}

/// Bind `pvc` and `pv`: the PV's claimRef, the claim's volumeName, both statuses Bound.
async fn bind(
    ctx: &Ctx,
    pvc: &PersistentVolumeClaim,
    pv: &PersistentVolume,
) -> Result<(), ControllerError> {
    let (ns, name) = ns_name(pvc);
    let pv_name = pv.metadata.name.clone().unwrap_or_default();
    let pvs: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let spec = pv.spec.clone().unwrap_or_default();
    if spec
        .claim_ref
        .as_ref()
        .and_then(|r| r.uid.as_ref())
        .is_none()
    {
        let patch = json!({"spec": {"claimRef": pvc::claim_ref(pvc)}});
        pvs.patch(&pv_name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }
    if pv.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Bound") {
        let patch = json!({"status": {"phase": "Bound"}});
        pvs.patch_status(&pv_name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
    if pvc
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_ref())
        .is_none()
    {
        let patch = json!({
            "metadata": {"annotations": {pvc::BIND_COMPLETED: "yes"}},
            "spec": {"volumeName": pv_name},
        });
        claims
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }
    let patch = json!({"status": {
        "phase": "Bound",
        "capacity": spec.capacity,
        "accessModes": spec.access_modes,
    }});
    claims
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    tracing::info!(claim = %format!("{ns}/{name}"), volume = %pv_name, "bound");
    Ok(())
}

/// On every PersistentVolume or claim change (and every `period`): reclaim volumes whose
/// claims are gone; every tenth `period` also refresh StorageProfiles.
pub async fn reclaim_loop(
    client: kube::Client,
    dirs: Dirs,
    agent_token: Option<String>,
    period: Duration,
    stores: Stores,
) -> Result<(), ControllerError> {
    let mut changes = stores.changes();
    stores.ready().await;
    let mut last_profiles = std::time::Instant::now();
    loop {
        let classes = stores.class_list();
        write_markers(&classes).await;
        if let Err(e) = reclaim_once(
            &client,
            &stores,
            &dirs.with_classes(&classes),
            agent_token.as_deref(),
        )
        .await
        {
            tracing::warn!(error = %e, "reclaiming volumes failed");
        }
        let woken = tokio::time::timeout(
            period,
            // StorageClass first: the kind named when several changed.
            changes.wait_for(&[
                Kind::StorageClass,
                Kind::PersistentVolume,
                Kind::PersistentVolumeClaim,
            ]),
        )
        .await;
        let class_changed = matches!(woken, Ok(Some(Kind::StorageClass)));
        if (class_changed || last_profiles.elapsed() >= period * 10)
            && let Err(e) = classes::ensure_with(&client, &stores.class_list()).await
        {
            tracing::warn!(error = %e, "refreshing StorageProfiles failed");
        }
        if class_changed || last_profiles.elapsed() >= period * 10 {
            last_profiles = std::time::Instant::now();
        }
    }
}

/// Writes the marker of every declared shared mount that exists on this machine (the nodes
/// compare it with the class's uid: `ferrovirt_storage::shared_mount`); a mount missing here
/// is logged once per class and path.
async fn write_markers(classes: &[StorageClass]) {
    static LOGGED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let declared = classes::declared_mounts(classes);
    if declared.is_empty() {
        return;
    }
    let results = tokio::task::spawn_blocking(move || {
        declared
            .into_iter()
            .map(|m| {
                let r = ferrovirt_storage::shared_mount::write_marker(&m.mount, &m.class, &m.uid);
                (m, r)
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap_or_default();
    for (m, r) in results {
        match r {
            Ok(true) => {
                tracing::info!(class = %m.class, mount = %m.mount.display(), "wrote the shared mount's marker")
            }
            Ok(false) => {}
            Err(e) => {
                let key = format!("{}\0{}", m.class, m.mount.display());
                let mut logged = LOGGED.lock().expect("lock");
                if logged.get_or_insert_default().insert(key) {
                    tracing::warn!(class = %m.class, "{e}");
                }
            }
        }
    }
}

/// The uid of claim `ns/name`: from the cache, confirmed with a read when the cache says it
/// is gone (it may not have seen the claim yet; a volume is never released on a lagging
/// cache).
async fn claim_uid(
    client: &kube::Client,
    stores: &Stores,
    ns: &str,
    name: &str,
    want: Option<&str>,
) -> Result<Option<String>, ControllerError> {
    let cached = stores.pvc(ns, name).and_then(|c| c.metadata.uid.clone());
    // Without a wanted uid the volume is kept whatever the claim is.
    if want.is_none() || (cached.is_some() && cached.as_deref() == want) {
        return Ok(cached);
    }
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    Ok(claims.get_opt(name).await?.and_then(|c| c.metadata.uid))
}

async fn reclaim_once(
    client: &kube::Client,
    stores: &Stores,
    dirs: &Dirs,
    agent_token: Option<&str>,
) -> Result<(), ControllerError> {
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    for pv in stores.pv_list() {
        reattach_if_block(&pv, dirs).await;
        let Some(r) = pv.spec.as_ref().and_then(|s| s.claim_ref.clone()) else {
            continue;
        };
        let ns = r.namespace.clone().unwrap_or_else(|| "default".into());
        let uid = claim_uid(
            client,
            stores,
            &ns,
            r.name.as_deref().unwrap_or(""),
            r.uid.as_deref(),
        )
        .await?;
        let uid = uid.as_deref();
        let name = pv.metadata.name.clone().unwrap_or_default();
        let mut decision = pvc::reclaim(&pv, uid);
        if decision != Reclaim::Keep {
            // Released or deleted only as the volume is now, not as the cache last saw it.
            decision = match pvs.get_opt(&name).await? {
                Some(fresh)
                    if fresh.spec.as_ref().and_then(|s| s.claim_ref.as_ref()) == Some(&r) =>
                {
                    pvc::reclaim(&fresh, uid)
                }
                _ => Reclaim::Keep,
            };
        }
        match decision {
            Reclaim::Keep => {}
            Reclaim::Release => {
                let patch = json!({"status": {"phase": "Released"}});
                pvs.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
            }
            Reclaim::Delete { remove_dir } => {
                if let Placement::Node { node, volume } = nodes::placement(&pv) {
                    // The node's agent removes the data; the PV stays until it has.
                    let removed = match nodes::storage_of(stores, &node, agent_token) {
                        Ok(s) => s.delete(&volume).await.map_err(|e| e.to_string()),
                        Err(m) => Err(m),
                    };
                    if let Err(m) = removed {
                        tracing::warn!(volume = %name, error = %m, "deleting a node-local volume failed; retrying");
                        continue;
                    }
                } else if let Some(dir) = remove_dir {
                    let dir = PathBuf::from(dir);
                    if dirs.owns(&dir) {
                        remove_volume_dir(&dir).await;
                    } else {
                        tracing::warn!(path = %dir.display(), "not removing a directory outside the volume roots");
                    }
                }
                // Released before deleted, so that pv-protection (which keeps a deleted
                // volume while Bound) lets it go.
                let phase = pv.status.as_ref().and_then(|s| s.phase.as_deref());
                if phase != Some("Released") {
                    let patch = json!({"status": {"phase": "Released"}});
                    match pvs
                        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                    {
                        Ok(_) => {}
                        Err(kube::Error::Api(s)) if s.is_not_found() => continue,
                        Err(e) => return Err(e.into()),
                    }
                }
                match pvs.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => tracing::info!(volume = %name, "deleted released volume"),
                    Err(kube::Error::Api(s)) if s.is_not_found() => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
    Ok(())
}

async fn remove_volume_dir(dir: &Path) {
    match block::detach(dir).await {
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(path = %dir.display(), error = %e, "detaching loop devices failed")
        }
    }
    let d = dir.to_path_buf();
    let res = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&d)).await;
    match res {
        Ok(Ok(())) => tracing::info!(path = %dir.display(), "removed volume data"),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {}
        Ok(Err(e)) => {
            tracing::warn!(path = %dir.display(), error = %e, "removing volume data failed")
        }
        Err(e) => tracing::warn!(error = %e, "removal task failed"),
    }
}

/// Block volumes keep a loop device attached (after a reboot the devices are gone; the
/// agent also attaches on use).
async fn reattach_if_block(pv: &PersistentVolume, dirs: &Dirs) {
    if !block::is_block(pv)
        || pv.metadata.deletion_timestamp.is_some()
        || matches!(nodes::placement(pv), Placement::Node { .. })
    {
        return;
    }
    let spec = pv.spec.as_ref();
    let Some(dir) = spec
        .and_then(|s| s.host_path.as_ref().map(|h| h.path.clone()))
        .or_else(|| spec.and_then(|s| s.local.as_ref().map(|l| l.path.clone())))
        .map(PathBuf::from)
        .filter(|d| dirs.owns(d) && d.is_dir())
    else {
        return;
    };
    if let Err(e) = block::ensure_attached(&dir).await {
        tracing::warn!(path = %dir.display(), error = %e, "attaching loop device failed");
    }
}

/// Grow a bound claim's volume when its request grew (see [`expansion`]).
async fn resize_if_needed(
    ctx: &Ctx,
    pvc: &PersistentVolumeClaim,
    pvs: &[PersistentVolume],
    classes: &[StorageClass],
) -> Result<(), ControllerError> {
    let Some(pv) = pvc
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .and_then(|n| pvs.iter().find(|p| p.metadata.name.as_deref() == Some(n)))
    else {
        return Ok(());
    };
    let class_name = pv
        .spec
        .as_ref()
        .and_then(|s| s.storage_class_name.as_deref());
    let class = classes
        .iter()
        .find(|c| c.metadata.name.as_deref() == class_name);
    match expansion::decide(pvc, pv, class, &ctx.dirs.with_classes(classes)) {
        Expansion::Nothing => {}
        Expansion::SyncStatus { size } => {
            expansion::set_claim_capacity(&ctx.client, pvc, &size).await?;
        }
        Expansion::Refused { message } => {
            report(ctx, pvc, true, "VolumeResizeFailed", &message).await;
        }
        Expansion::Grow { dir, bytes, size } => {
            let pv_name = pv.metadata.name.clone().unwrap_or_default();
            let msg = format!("resizing volume {pv_name} to {}", size.0);
            report(ctx, pvc, false, "Resizing", &msg).await;
            match expansion::expand(&ctx.client, pvc, pv, &dir, bytes, &size).await? {
                Ok(()) => {
                    let msg = format!("volume {pv_name} resized to {}", size.0);
                    report(ctx, pvc, false, "VolumeResizeSuccessful", &msg).await;
                }
                Err(m) => report(ctx, pvc, true, "VolumeResizeFailed", &m).await,
            }
        }
        Expansion::GrowOnNode {
            node,
            volume,
            bytes,
            size,
        } => {
            let msg = format!("resizing volume {volume} to {} on node {node}", size.0);
            report(ctx, pvc, false, "Resizing", &msg).await;
            let grown = match nodes::storage_of(&ctx.stores, &node, ctx.agent_token.as_deref()) {
                Ok(s) => s.resize(&volume, bytes).await.map_err(|e| e.to_string()),
                Err(m) => Err(m),
            };
            match grown {
                Ok(()) => {
                    expansion::record(&ctx.client, pvc, pv, &size).await?;
                    let msg = format!("volume {volume} resized to {}", size.0);
                    report(ctx, pvc, false, "VolumeResizeSuccessful", &msg).await;
                }
                Err(m) => report(ctx, pvc, true, "VolumeResizeFailed", &m).await,
            }
        }
    }
    Ok(())
}
