//! The snapshot controllers wired to the API server: VolumeSnapshots ([`super::volume`]),
//! VirtualMachineSnapshots ([`super::vm_snapshot`]) and VirtualMachineRestores
//! ([`super::restore`]). Each reconcile reads what its pure step needs (fresh from the API;
//! claims, PVs and VMIs from the shared caches), applies the step's creations and writes the
//! status through the `/status` subresource. At start the built-in VolumeSnapshotClasses
//! are created when absent.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use serde_json::json;

use ferrovirt_api::kubevirt::vmi::VmiPhase;
use ferrovirt_api::volumesnapshot::{
    API_VERSION, DEFAULT_CLASS_ANNOTATION, DRIVER, SHARED_DRIVER, VolumeSnapshotClass,
};

use super::online::{self, ActiveVmi, OnlineTake};
use super::resources::{
    VmRestore, VmSnapshot, VmSnapshotContent, VolSnap, VolSnapClass, VolSnapContent,
};
use super::restore::{self, RestoreInput, RestoreMark};
use super::vm_snapshot::{self, SnapshotInput, VmMark};
use super::volume::{self, VsDecision, VsInput};
use crate::error::ControllerError;
use crate::runtime::resources::{Vm, Vmi};
use crate::runtime::stores::Stores;
use crate::storage::nodes::{self, Placement};
use crate::storage::pvc_loop::claims_of;

/// Component name.
pub const COMPONENT: &str = "snapshot-controller";

struct Ctx {
    client: kube::Client,
    stores: Stores,
    agent_token: Option<String>,
}

/// Run the three snapshot controllers until one's watch ends or the future is dropped.
pub async fn run(
    client: kube::Client,
    stores: Stores,
    agent_token: Option<String>,
) -> Result<(), ControllerError> {
    ensure_classes(&client).await?;
    stores.ready().await;
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        stores,
        agent_token,
    });
    let vs = crate::runtime::drive(
        Controller::new(
            Api::<VolSnap>::all(client.clone()),
            watcher::Config::default(),
        )
        .run(
            crate::runtime::metrics::timed("VolumeSnapshot", reconcile_vs),
            error_policy,
            ctx.clone(),
        ),
        COMPONENT,
        "VolumeSnapshot",
    );
    let snaps = crate::runtime::drive(
        Controller::new(
            Api::<VmSnapshot>::all(client.clone()),
            watcher::Config::default(),
        )
        .run(
            crate::runtime::metrics::timed("VirtualMachineSnapshot", reconcile_snapshot),
            error_policy,
            ctx.clone(),
        ),
        COMPONENT,
        "VirtualMachineSnapshot",
    );
    let restores = crate::runtime::drive(
        Controller::new(
            Api::<VmRestore>::all(client.clone()),
            watcher::Config::default(),
        )
        .run(
            crate::runtime::metrics::timed("VirtualMachineRestore", reconcile_restore),
            error_policy,
            ctx.clone(),
        ),
        COMPONENT,
        "VirtualMachineRestore",
    );
    // A snapshot or restore deleted while in progress must not leave its VM held stopped:
    // VMs are re-checked when they change and when a snapshot or restore naming them changes
    // or goes away.
    let marks = crate::runtime::drive(
        Controller::new(Api::<Vm>::all(client.clone()), watcher::Config::default())
            .watches(
                Api::<VmSnapshot>::all(client.clone()),
                watcher::Config::default(),
                |s: VmSnapshot| {
                    let ns = s.0.metadata.namespace.clone()?;
                    let vm = s.0.spec.as_ref()?.source.name.clone();
                    Some(ObjectRef::<Vm>::new(&vm).within(&ns))
                },
            )
            .watches(
                Api::<VmRestore>::all(client.clone()),
                watcher::Config::default(),
                |r: VmRestore| {
                    let ns = r.0.metadata.namespace.clone()?;
                    let vm = r.0.spec.as_ref()?.target.name.clone();
                    Some(ObjectRef::<Vm>::new(&vm).within(&ns))
                },
            )
            .run(
                crate::runtime::metrics::timed(
                    "VirtualMachine snapshot/restore marks",
                    reconcile_marks,
                ),
                error_policy,
                ctx.clone(),
            ),
        COMPONENT,
        "VirtualMachine snapshot/restore marks",
    );
    let clones = super::clone_loop::run(client.clone());
    let reclaim =
        super::reclaim_loop::run(client.clone(), ctx.stores.clone(), ctx.agent_token.clone());
    tokio::select! {
        r = clones => r,
        r = reclaim => r,
        r = vs => r,
        r = snaps => r,
        r = restores => r,
        r = marks => r,
    }
}

fn error_policy<K>(_o: Arc<K>, err: &ControllerError, _ctx: Arc<Ctx>) -> Action {
    tracing::debug!(error = %err, "snapshot reconcile failed");
    Action::requeue(Duration::from_secs(2))
}

/// The built-in VolumeSnapshotClasses (the `local` one the default), created when absent.
async fn ensure_classes(client: &kube::Client) -> Result<(), ControllerError> {
    let api: Api<VolSnapClass> = Api::all(client.clone());
    for (name, driver, default) in [
        (volume::LOCAL_CLASS, DRIVER, true),
        (volume::SHARED_CLASS, SHARED_DRIVER, false),
    ] {
        if api.get_opt(name).await?.is_some() {
            continue;
        }
        let class = VolSnapClass(VolumeSnapshotClass {
            api_version: Some(API_VERSION.into()),
            kind: Some("VolumeSnapshotClass".into()),
            metadata: ObjectMeta {
                name: Some(name.into()),
                annotations: default.then(|| {
                    BTreeMap::from([(DEFAULT_CLASS_ANNOTATION.to_string(), "true".to_string())])
                }),
                ..Default::default()
            },
            driver: driver.into(),
            deletion_policy: "Delete".into(),
            parameters: None,
        });
        match api.create(&PostParams::default(), &class).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn ns_of(meta: &ObjectMeta) -> (String, String) {
    (
        meta.namespace.clone().unwrap_or_else(|| "default".into()),
        meta.name.clone().unwrap_or_default(),
    )
}

/// A VMI of the namespace that has not finished and uses claim `claim`.
pub(super) fn claim_user(stores: &Stores, ns: &str, claim: &str) -> Option<String> {
    stores
        .vmis
        .state()
        .iter()
        .filter(|v| v.0.metadata.namespace.as_deref() == Some(ns))
        .filter(|v| {
            !matches!(
                v.0.status.as_ref().and_then(|s| s.phase),
                Some(VmiPhase::Succeeded | VmiPhase::Failed)
            )
        })
        .find(|v| claims_of(&v.0).iter().any(|c| c == claim))
        .and_then(|v| v.0.metadata.name.clone())
}

async fn reconcile_vs(obj: Arc<VolSnap>, ctx: Arc<Ctx>) -> Result<Action, ControllerError> {
    let vs = &obj.0;
    let (ns, name) = ns_of(&vs.metadata);
    let contents: Api<VolSnapContent> = Api::all(ctx.client.clone());
    let spec = vs.spec.clone().unwrap_or_default();
    let content_name = vs
        .status
        .as_ref()
        .and_then(|s| s.bound_volume_snapshot_content_name.clone())
        .or(spec.source.volume_snapshot_content_name.clone())
        .unwrap_or_else(|| volume::content_name(vs));
    let content = contents.get_opt(&content_name).await?.map(|c| c.0);
    let claim = spec
        .source
        .persistent_volume_claim_name
        .clone()
        .unwrap_or_default();
    // A pre-provisioned snapshot (an online one among them) names no claim.
    let pvc: Option<PersistentVolumeClaim> = if claim.is_empty() {
        None
    } else {
        Api::<PersistentVolumeClaim>::namespaced(ctx.client.clone(), &ns)
            .get_opt(&claim)
            .await?
    };
    let pv_name = pvc
        .as_ref()
        .and_then(|c| c.spec.as_ref())
        .and_then(|s| s.volume_name.clone());
    let pv = match &pv_name {
        Some(n) => {
            Api::<PersistentVolume>::all(ctx.client.clone())
                .get_opt(n)
                .await?
        }
        None => None,
    };
    let classes: Vec<VolumeSnapshotClass> = Api::<VolSnapClass>::all(ctx.client.clone())
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|c| c.0)
        .collect();
    let decision = volume::decide(&VsInput {
        classes: &classes,
        vs,
        content: content.as_ref(),
        pvc: pvc.as_ref(),
        pv: pv.as_ref(),
        in_use_by: claim_user(&ctx.stores, &ns, &claim),
    });
    let vss: Api<VolSnap> = Api::namespaced(ctx.client.clone(), &ns);
    match decision {
        VsDecision::Nothing => Ok(Action::await_change()),
        VsDecision::Error(message) => {
            let have = vs
                .status
                .as_ref()
                .and_then(|s| s.error.as_ref())
                .and_then(|e| e.message.clone());
            if have.as_deref() != Some(message.as_str()) {
                let patch = json!({"status": {"readyToUse": false,
                    "error": {"time": Time(Timestamp::now()), "message": message}}});
                vss.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
            }
            Ok(Action::requeue(Duration::from_secs(2)))
        }
        VsDecision::CreateContent(c) => {
            match contents
                .create(&PostParams::default(), &VolSnapContent(*c))
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.is_already_exists() => {}
                Err(e) => return Err(e.into()),
            }
            Ok(Action::requeue(Duration::from_millis(50)))
        }
        VsDecision::Take { content, at } => {
            let pv = pv_name.unwrap_or_default();
            let taken = take(&ctx, &at).await;
            match taken {
                Ok((handle, size)) => {
                    let ns_now = Timestamp::now().as_nanosecond() as i64;
                    let patch = json!({"status": {
                        "snapshotHandle": format!("{pv}/{handle}"),
                        "readyToUse": true,
                        "restoreSize": size,
                        "creationTime": ns_now,
                    }});
                    contents
                        .patch_status(&content, &PatchParams::default(), &Patch::Merge(&patch))
                        .await?;
                    Ok(Action::requeue(Duration::from_millis(50)))
                }
                Err(message) => {
                    let patch = json!({"status": {"readyToUse": false,
                        "error": {"time": Time(Timestamp::now()), "message": message}}});
                    vss.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await?;
                    Ok(Action::requeue(Duration::from_secs(3)))
                }
            }
        }
        VsDecision::Bind(status) => {
            let patch = json!({"status": *status});
            vss.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            Ok(Action::await_change())
        }
    }
}

/// Take a snapshot of the volume at `at`: by its node's agent, or here for a volume on a path
/// the server holds. The handle and the volume's size.
async fn take(ctx: &Ctx, at: &Placement) -> Result<(String, u64), String> {
    match at {
        Placement::Node { node, volume } => {
            let storage = nodes::storage_of(&ctx.stores, node, ctx.agent_token.as_deref())?;
            storage
                .snapshot(volume)
                .await
                .map(|t| (t.handle, t.size))
                .map_err(|e| e.to_string())
        }
        Placement::Path(dir) => {
            let dir = dir.clone();
            tokio::task::spawn_blocking(move || {
                let handle = ferrovirt_storage::snapshot::take(&dir)?;
                let img = dir.join(ferrovirt_storage::provisioner::DISK_IMAGE);
                let size = std::fs::metadata(&img)
                    .map_err(|e| ferrovirt_storage::StorageError::io(&img, e))?
                    .len();
                Ok::<_, ferrovirt_storage::StorageError>((handle, size))
            })
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())
        }
        Placement::Unknown => Err("the volume has no known location".into()),
    }
}

/// Point volume `pv` back at its snapshot `layer`, where its bytes are.
async fn revert(ctx: &Ctx, pv: &PersistentVolume, layer: &str) -> Result<(), String> {
    match nodes::placement(pv) {
        Placement::Node { node, volume } => {
            let storage = nodes::storage_of(&ctx.stores, &node, ctx.agent_token.as_deref())?;
            storage
                .revert(&volume, layer)
                .await
                .map_err(|e| e.to_string())
        }
        Placement::Path(dir) => {
            let layer = layer.to_string();
            tokio::task::spawn_blocking(move || ferrovirt_storage::snapshot::revert(&dir, &layer))
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())
        }
        Placement::Unknown => Err("the volume has no known location".into()),
    }
}

async fn vmi_active(client: &kube::Client, ns: &str, name: &str) -> Result<bool, ControllerError> {
    Ok(active_vmi(client, ns, name).await?.is_some())
}

/// The VM's VMI when it exists and has not finished.
async fn active_vmi(
    client: &kube::Client,
    ns: &str,
    name: &str,
) -> Result<Option<ActiveVmi>, ControllerError> {
    let vmi = Api::<Vmi>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await?;
    Ok(vmi
        .filter(|v| {
            !matches!(
                v.0.status.as_ref().and_then(|s| s.phase),
                Some(VmiPhase::Succeeded | VmiPhase::Failed)
            )
        })
        .map(|v| ActiveVmi {
            uid: v.0.metadata.uid.clone().unwrap_or_default(),
            node: v.0.status.as_ref().and_then(|s| s.node_name.clone()),
        }))
}

/// Takes an online snapshot through the VMI's node agent and records each volume as a
/// VolumeSnapshot bound to a ready pre-provisioned content. The indications.
async fn take_online(
    ctx: &Ctx,
    ns: &str,
    content: &ferrovirt_api::kubevirt::snapshot::VirtualMachineSnapshotContent,
    take: &OnlineTake,
) -> Result<Vec<String>, String> {
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), ns);
    let pvs = ctx.stores.pv_list();
    let mut where_ = Vec::new();
    for v in &take.volumes {
        let pvc = claims
            .get_opt(&v.claim)
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("claim {} does not exist", v.claim))?;
        let pv_name = pvc
            .spec
            .and_then(|s| s.volume_name)
            .ok_or_else(|| format!("claim {} is not bound", v.claim))?;
        let pv = pvs
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(pv_name.as_str()))
            .ok_or_else(|| format!("the volume of claim {} is unknown", v.claim))?;
        let driver = volume::driver_of(pv).ok_or_else(|| {
            format!(
                "the volume of claim {} was not made by a ferrovirt provisioner; it cannot be snapshotted",
                v.claim
            )
        })?;
        where_.push((pv_name, driver));
    }
    let storage = nodes::storage_of(&ctx.stores, &take.node, ctx.agent_token.as_deref())?;
    let req = ferrovirt_agent::nodestore::online::OnlineSnapshot {
        volumes: take.volumes.iter().map(|v| v.volume.clone()).collect(),
        freeze_timeout_ms: take.freeze_timeout.as_millis() as u64,
    };
    let taken = storage
        .online_snapshot(&take.vmi_uid, &req)
        .await
        .map_err(|e| e.to_string())?;
    let vss: Api<VolSnap> = Api::namespaced(ctx.client.clone(), ns);
    let contents: Api<VolSnapContent> = Api::all(ctx.client.clone());
    for (v, (pv, driver)) in take.volumes.iter().zip(&where_) {
        let t = taken
            .volumes
            .iter()
            .find(|t| t.volume == v.volume)
            .ok_or_else(|| format!("the agent did not snapshot volume {}", v.volume))?;
        let vs = online::volume_snapshot(content, v, driver);
        let vs = match vss.create(&PostParams::default(), &VolSnap(vs)).await {
            Ok(vs) => vs,
            Err(kube::Error::Api(s)) if s.is_already_exists() => vss
                .get(&v.volume_snapshot)
                .await
                .map_err(|e| e.to_string())?,
            Err(e) => return Err(e.to_string()),
        };
        let handle = format!("{pv}/{}", t.handle);
        let c = online::volume_snapshot_content(&vs.0, driver, &handle);
        let cname = c.metadata.name.clone().unwrap_or_default();
        match contents
            .create(&PostParams::default(), &VolSnapContent(c))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => return Err(e.to_string()),
        }
        let patch = json!({"status": {
            "snapshotHandle": handle,
            "readyToUse": true,
            "restoreSize": t.size,
            "creationTime": Timestamp::now().as_nanosecond() as i64,
        }});
        contents
            .patch_status(&cname, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(taken.indications)
}

async fn mark_vm(
    client: &kube::Client,
    ns: &str,
    vm: &str,
    field: &str,
    value: Option<&str>,
) -> Result<(), ControllerError> {
    let patch = json!({"status": {field: value}});
    match Api::<Vm>::namespaced(client.clone(), ns)
        .patch_status(vm, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
        Err(e) => Err(e.into()),
    }
}

async fn reconcile_snapshot(
    obj: Arc<VmSnapshot>,
    ctx: Arc<Ctx>,
) -> Result<Action, ControllerError> {
    let snap = &obj.0;
    if snap.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let (ns, name) = ns_of(&snap.metadata);
    let vm_name = snap
        .spec
        .as_ref()
        .map(|s| s.source.name.clone())
        .unwrap_or_default();
    let vms: Api<Vm> = Api::namespaced(ctx.client.clone(), &ns);
    let vm = vms.get_opt(&vm_name).await?.map(|v| v.0);
    let active = active_vmi(&ctx.client, &ns, &vm_name).await?;
    let contents: Api<VmSnapshotContent> = Api::namespaced(ctx.client.clone(), &ns);
    let content = contents
        .get_opt(&vm_snapshot::content_name(snap))
        .await?
        .map(|c| c.0);
    let vss: Api<VolSnap> = Api::namespaced(ctx.client.clone(), &ns);
    let volume_snapshots = vss
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|v| (v.0.metadata.name.clone().unwrap_or_default(), v.0))
        .collect();
    // Claims fresh from the API: the content captures their specs.
    let claims = Api::<PersistentVolumeClaim>::namespaced(ctx.client.clone(), &ns)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|c| (c.metadata.name.clone().unwrap_or_default(), c))
        .collect();
    let step = vm_snapshot::step(&SnapshotInput {
        snapshot: snap,
        vm: vm.as_ref(),
        vmi: active,
        content: content.as_ref(),
        volume_snapshots: &volume_snapshots,
        claims: &claims,
        now: Timestamp::now(),
    });
    match &step.vm_mark {
        VmMark::Set(n) => {
            mark_vm(&ctx.client, &ns, &vm_name, "snapshotInProgress", Some(n)).await?;
        }
        VmMark::Clear(n)
            if vm
                .as_ref()
                .and_then(|v| v.status.as_ref())
                .and_then(|s| s.snapshot_in_progress.as_deref())
                == Some(n.as_str()) =>
        {
            mark_vm(&ctx.client, &ns, &vm_name, "snapshotInProgress", None).await?;
        }
        _ => {}
    }
    if let Some(c) = step.create_content {
        match contents
            .create(&PostParams::default(), &VmSnapshotContent(c))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => return Err(e.into()),
        }
    }
    for v in step.create_volume_snapshots {
        match vss.create(&PostParams::default(), &VolSnap(v)).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => return Err(e.into()),
        }
    }
    if let Some(st) = step.content_status
        && let Some(c) = &content
    {
        let patch = json!({"status": st});
        contents
            .patch_status(
                c.metadata.name.as_deref().unwrap_or_default(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await?;
    }
    let mut status = step.status;
    let mut requeue = step.requeue;
    if let Some(take) = &step.online_take
        && let Some(c) = &content
    {
        let now = Time(Timestamp::now());
        let mut conditions = status.conditions.clone().unwrap_or_default();
        match take_online(&ctx, &ns, c, take).await {
            Ok(indications) => {
                status.error = None;
                status.source_indications = Some(online::source_indications(&indications));
                status.indications = Some(indications);
                crate::conditions::set(
                    &mut conditions,
                    crate::conditions::condition(
                        "Progressing",
                        true,
                        Some("InProgress"),
                        Some("online snapshot taken; binding the volume snapshots"),
                    ),
                    &now,
                );
                requeue = Some(Duration::from_millis(200));
            }
            Err(e) => {
                tracing::warn!(snapshot = %name, error = %e, "online snapshot failed");
                status.error = Some(ferrovirt_api::kubevirt::snapshot::SnapshotError {
                    time: Some(now.clone()),
                    message: Some(format!("online snapshot failed: {e}")),
                });
                crate::conditions::set(
                    &mut conditions,
                    crate::conditions::condition(
                        "Progressing",
                        true,
                        Some("InProgress"),
                        Some(&format!("online snapshot failed, retrying: {e}")),
                    ),
                    &now,
                );
                requeue = Some(Duration::from_secs(2));
            }
        }
        status.conditions = Some(conditions);
    }
    if snap.status.as_ref() != Some(&status) {
        let api: Api<VmSnapshot> = Api::namespaced(ctx.client.clone(), &ns);
        let mut o = VmSnapshot(snap.clone());
        o.0.status = Some(status);
        match api.replace_status(&name, &PostParams::default(), &o).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {
                return Ok(Action::requeue(Duration::from_millis(100)));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(requeue
        .map(Action::requeue)
        .unwrap_or_else(Action::await_change))
}

async fn reconcile_restore(obj: Arc<VmRestore>, ctx: Arc<Ctx>) -> Result<Action, ControllerError> {
    let r = &obj.0;
    if r.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let (ns, name) = ns_of(&r.metadata);
    let spec = r.spec.clone().unwrap_or_default();
    let snapshot = Api::<VmSnapshot>::namespaced(ctx.client.clone(), &ns)
        .get_opt(&spec.virtual_machine_snapshot_name)
        .await?
        .map(|s| s.0);
    let content = match &snapshot {
        Some(s) => Api::<VmSnapshotContent>::namespaced(ctx.client.clone(), &ns)
            .get_opt(&vm_snapshot::content_name(s))
            .await?
            .map(|c| c.0),
        None => None,
    };
    let vms: Api<Vm> = Api::namespaced(ctx.client.clone(), &ns);
    let target = vms.get_opt(&spec.target.name).await?.map(|v| v.0);
    let running = vmi_active(&ctx.client, &ns, &spec.target.name).await?;
    let claims = Api::<PersistentVolumeClaim>::namespaced(ctx.client.clone(), &ns)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|c| (c.metadata.name.clone().unwrap_or_default(), c))
        .collect::<BTreeMap<_, _>>();
    // Where each VolumeSnapshot's bytes are: its content's handle and the source PV's node.
    let mut nodes_of = BTreeMap::new();
    let mut handles = BTreeMap::new();
    let pvs = ctx.stores.pv_list();
    for b in content
        .as_ref()
        .and_then(|c| c.spec.as_ref())
        .and_then(|s| s.volume_backups.clone())
        .unwrap_or_default()
    {
        let Some(vs_name) = b.volume_snapshot_name else {
            continue;
        };
        let Some(vs) = Api::<VolSnap>::namespaced(ctx.client.clone(), &ns)
            .get_opt(&vs_name)
            .await?
        else {
            continue;
        };
        let Some(cname) =
            vs.0.status
                .as_ref()
                .and_then(|s| s.bound_volume_snapshot_content_name.clone())
        else {
            continue;
        };
        let Some(vsc) = Api::<VolSnapContent>::all(ctx.client.clone())
            .get_opt(&cname)
            .await?
        else {
            continue;
        };
        let Some(handle) = vsc
            .0
            .status
            .as_ref()
            .and_then(|s| s.snapshot_handle.clone())
        else {
            continue;
        };
        if let Some((pv, _)) = volume::split_handle(&handle)
            && let Some(pv) = pvs.iter().find(|p| p.metadata.name.as_deref() == Some(pv))
            && let Placement::Node { node, .. } = nodes::placement(pv)
        {
            nodes_of.insert(vs_name.clone(), node);
        }
        handles.insert(vs_name, handle);
    }
    let step = restore::step(&RestoreInput {
        restore: r,
        snapshot: snapshot.as_ref(),
        content: content.as_ref(),
        target: target.as_ref(),
        target_running: running,
        claims: &claims,
        snapshot_nodes: &nodes_of,
        snapshot_handles: &handles,
        now: Timestamp::now(),
    });
    let mut status = step.status.clone();
    if let Some(vm) = step.create_vm {
        match vms.create(&PostParams::default(), &Vm(*vm)).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => return Err(e.into()),
        }
    }
    if step.stop_target {
        // targetReadinessPolicy StopTarget: the VM controller stops the VMI.
        let patch = json!({"spec": {"runStrategy": "Halted", "running": null}});
        vms.patch(
            &spec.target.name,
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    }
    match &step.mark {
        Some(RestoreMark::Set(n)) => {
            mark_vm(
                &ctx.client,
                &ns,
                &spec.target.name,
                "restoreInProgress",
                Some(n),
            )
            .await?;
        }
        Some(RestoreMark::Clear(n))
            if target
                .as_ref()
                .and_then(|v| v.status.as_ref())
                .and_then(|s| s.restore_in_progress.as_deref())
                == Some(n.as_str()) =>
        {
            mark_vm(
                &ctx.client,
                &ns,
                &spec.target.name,
                "restoreInProgress",
                None,
            )
            .await?;
        }
        _ => {}
    }
    let claims_api: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), &ns);
    for c in step.create_claims {
        match claims_api.create(&PostParams::default(), &c).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => return Err(e.into()),
        }
    }
    for rv in &step.reverts {
        let pv = claims
            .get(&rv.claim)
            .and_then(|c| c.spec.as_ref())
            .and_then(|s| s.volume_name.clone())
            .and_then(|n| {
                pvs.iter()
                    .find(|p| p.metadata.name.as_deref() == Some(&n))
                    .cloned()
            });
        let layer = volume::split_handle(&rv.handle).map(|(_, l)| l.to_string());
        let done = match (pv, layer) {
            (Some(pv), Some(layer)) => revert(&ctx, &pv, &layer).await,
            _ => Err(format!("claim {} has no volume to revert", rv.claim)),
        };
        if let Err(e) = done {
            tracing::warn!(restore = %name, claim = %rv.claim, error = %e, "in-place revert failed");
            // Not recorded as restored: the next step tries again.
            status.restores = r.status.as_ref().and_then(|s| s.restores.clone());
            break;
        }
    }
    if let Some(spec) = step.update_vm_spec
        && let Some(t) = &target
    {
        let mut vm = Vm(t.clone());
        vm.0.spec = Some(*spec);
        if let Some(meta) = step.update_vm_metadata {
            vm.0.metadata.labels = meta.labels;
            vm.0.metadata.annotations = meta.annotations;
        }
        vm.0.metadata.annotations.get_or_insert_default().insert(
            restore::LAST_RESTORE_ANNOTATION.into(),
            restore::restore_id(r),
        );
        vm.0.status = None;
        match vms
            .replace(&spec_name(t), &PostParams::default(), &vm)
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {
                return Ok(Action::requeue(Duration::from_millis(100)));
            }
            Err(e) => return Err(e.into()),
        }
    }
    if r.status.as_ref() != Some(&status) {
        let api: Api<VmRestore> = Api::namespaced(ctx.client.clone(), &ns);
        let mut o = VmRestore(r.clone());
        o.0.status = Some(status);
        match api.replace_status(&name, &PostParams::default(), &o).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {
                return Ok(Action::requeue(Duration::from_millis(100)));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(step
        .requeue
        .map(Action::requeue)
        .unwrap_or_else(Action::await_change))
}

fn spec_name(vm: &ferrovirt_api::kubevirt::vm::VirtualMachine) -> String {
    vm.metadata.name.clone().unwrap_or_default()
}

/// Clears a VM's `status.snapshotInProgress` / `restoreInProgress` when the snapshot or restore
/// it names is gone, being deleted, or finished (its own controller clears it otherwise).
async fn reconcile_marks(obj: Arc<Vm>, ctx: Arc<Ctx>) -> Result<Action, ControllerError> {
    let vm = &obj.0;
    let (ns, name) = ns_of(&vm.metadata);
    let status = vm.status.clone().unwrap_or_default();
    if let Some(s) = status.snapshot_in_progress {
        let snap = Api::<VmSnapshot>::namespaced(ctx.client.clone(), &ns)
            .get_opt(&s)
            .await?;
        let live = snap.is_some_and(|s| {
            s.0.metadata.deletion_timestamp.is_none()
                && !matches!(
                    s.0.status.as_ref().and_then(|st| st.phase.as_deref()),
                    Some(vm_snapshot::SUCCEEDED | vm_snapshot::FAILED)
                )
        });
        if !live {
            mark_vm(&ctx.client, &ns, &name, "snapshotInProgress", None).await?;
        }
    }
    if let Some(r) = status.restore_in_progress {
        let restore = Api::<VmRestore>::namespaced(ctx.client.clone(), &ns)
            .get_opt(&r)
            .await?;
        let live = restore.is_some_and(|r| {
            let st = r.0.status.clone().unwrap_or_default();
            let failed = st
                .conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == "Failure" && c.status == "True");
            r.0.metadata.deletion_timestamp.is_none() && st.complete != Some(true) && !failed
        });
        if !live {
            mark_vm(&ctx.client, &ns, &name, "restoreInProgress", None).await?;
        }
    }
    Ok(Action::await_change())
}
