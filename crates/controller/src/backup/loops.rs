//! The Backup controller and the BackupTarget checker (I/O; decisions in [`super::plan`]).
//!
//! A Backup is carried out by one task per object in this process: Pending → Running →
//! Succeeded | Failed. The task reads each VM's claims where they are (the node agent's export
//! route for `local` volumes, the volume directory on this machine for shared ones — the same
//! paths VirtualMachineExport reads), writes them to the repository, then the manifest and
//! the catalog entry. A Backup found `Running` with no task here (the server restarted) is run
//! again from the start: the interrupted attempt left no catalog entry, and the chunks it did
//! upload are found and not uploaded twice. A claim with a usable backup point
//! ([`super::incremental`]) is read incrementally: only the chunks written since, the others
//! taken from the earlier backup's index; otherwise whole, with the reason in its status.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{
    ConfigMap, Node, PersistentVolume, PersistentVolumeClaim, Secret,
};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::discovery::ApiResource;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use serde_json::{Value, json};

use ferrovirt_api::backup::{BackupSpec, Consistency as ConsistencyOpts, ENCRYPTION_KEY, phase};
use ferrovirt_backup::repo::Create;
use ferrovirt_backup::{Repository, Stats, Target};
use ferrovirt_storage::export::ByteStream;

use super::incremental::{self, Since};
use super::online;
use super::plan;
use super::resources::{self, BackupRun};
use super::{freeze, hooks};
use crate::error::ControllerError;
use crate::runtime::events::{EventRecorder, object_ref};
use crate::runtime::resources::{Vm, Vmi};
use crate::storage::nodes::{self, Placement};
use ferrovirt_api::kubevirt::vmi::VmiPhase;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

/// How often a running backup writes its progress, and targets are checked.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);
const TARGET_CHECK_EVERY: Duration = Duration::from_secs(30);
/// A volume whose chain changes under the read for a moment (a stopping VM's QEMU, a merge of
/// a released layer: [`plan::volume_busy`]) is opened again, this often, this many times.
const LOCK_RETRY_AFTER: Duration = Duration::from_secs(2);
const LOCK_RETRIES: u32 = 15;

struct Ctx {
    client: kube::Client,
    agent_token: Option<String>,
    /// UIDs of Backups with a task in this process, running or finished with their result
    /// written: a reconcile from a cache that has not seen the result yet (still `Running`)
    /// must not start the backup again. One entry per Backup this process ran.
    running: Mutex<HashSet<String>>,
    events: EventRecorder,
}

/// Runs the Backup controller, the BackupTarget checker, the BackupPlan and BackupRestore
/// controllers until one stops.
pub async fn run(client: kube::Client, agent_token: Option<String>) -> Result<(), ControllerError> {
    let restores = super::restore_loop::run(client.clone(), agent_token.clone());
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        agent_token,
        running: Mutex::new(HashSet::new()),
        events: EventRecorder::new(client.clone(), super::COMPONENT),
    });
    let backups = crate::runtime::drive(
        Controller::new(
            Api::<BackupRun>::all(client.clone()),
            watcher::Config::default(),
        )
        .run(
            crate::runtime::metrics::timed("Backup", reconcile),
            error_policy,
            ctx.clone(),
        ),
        super::COMPONENT,
        "Backup",
    );
    tokio::select! {
        r = backups => r,
        r = check_targets(ctx) => r,
        r = super::plans::run(client) => r,
        r = restores => r,
    }
}

fn error_policy(_o: Arc<BackupRun>, err: &ControllerError, _ctx: Arc<Ctx>) -> Action {
    tracing::debug!(error = %err, "backup reconcile failed");
    Action::requeue(Duration::from_secs(2))
}

fn now() -> String {
    Timestamp::now().to_string()
}

async fn patch_status(
    ctx: &Ctx,
    ns: &str,
    name: &str,
    status: Value,
) -> Result<(), ControllerError> {
    let api: Api<BackupRun> = Api::namespaced(ctx.client.clone(), ns);
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": status})),
    )
    .await?;
    Ok(())
}

async fn reconcile(obj: Arc<BackupRun>, ctx: Arc<Ctx>) -> Result<Action, ControllerError> {
    let b = &obj.0;
    let phase = b
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("");
    if phase == phase::SUCCEEDED || phase == phase::FAILED {
        return Ok(Action::await_change());
    }
    let uid = b.metadata.uid.clone().unwrap_or_default();
    #[allow(clippy::unwrap_used)]
    if !ctx.running.lock().unwrap().insert(uid.clone()) {
        return Ok(Action::await_change());
    }
    let ns = b.metadata.namespace.clone().unwrap_or_default();
    let name = b.metadata.name.clone().unwrap_or_default();
    let spec = b.spec.clone().unwrap_or_default();
    let started = b
        .status
        .as_ref()
        .and_then(|s| s.start_time.clone())
        .map(|t| t.0.to_string())
        .unwrap_or_else(now);
    let backup_name = plan::backup_name(&ns, &name, &spec);
    patch_status(
        &ctx,
        &ns,
        &name,
        json!({"phase": phase::RUNNING, "startTime": started, "backupName": backup_name,
               "progress": "0%"}),
    )
    .await?;
    let oref = object_ref(
        &format!(
            "{}/{}",
            ferrovirt_api::backup::GROUP,
            ferrovirt_api::backup::VERSION
        ),
        "Backup",
        &b.metadata,
    );
    let owner = OwnerReference {
        api_version: format!(
            "{}/{}",
            ferrovirt_api::backup::GROUP,
            ferrovirt_api::backup::VERSION
        ),
        kind: "Backup".into(),
        name: name.clone(),
        uid: uid.clone(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    };
    let task_ctx = ctx.clone();
    tokio::spawn(async move {
        let t0 = std::time::Instant::now();
        let job = Job {
            ctx: &task_ctx,
            ns: &ns,
            name: &name,
            spec: &spec,
            backup_name: &backup_name,
            owner: &owner,
        };
        let result = carry_out(&job).await;
        let secs = t0.elapsed().as_secs_f64();
        let (status, warning, reason, msg) = match result {
            Ok(mut st) => {
                let msg = format!(
                    "backup {backup_name} written: {} bytes read, {} new, {} deduplicated in {secs:.1}s",
                    st["bytesRead"], st["bytesNew"], st["bytesDeduplicated"]
                );
                st["phase"] = json!(phase::SUCCEEDED);
                st["progress"] = json!("100%");
                st["completionTime"] = json!(now());
                st["durationSeconds"] = json!(secs);
                st["conditions"] =
                    json!([plan::condition("Ready", true, "Succeeded", &msg, &now())]);
                (st, false, "Succeeded", msg)
            }
            Err(msg) => (
                json!({"phase": phase::FAILED, "completionTime": now(), "durationSeconds": secs,
                       "conditions": [plan::condition("Ready", false, "Failed", &msg, &now())]}),
                true,
                "Failed",
                msg,
            ),
        };
        let written = patch_status(&task_ctx, &ns, &name, status).await;
        task_ctx.events.record(&oref, warning, reason, &msg).await;
        if let Err(e) = written {
            tracing::warn!(error = %e, backup = %name, "writing the backup's result failed");
            // Not recorded: the next reconcile runs it again.
            #[allow(clippy::unwrap_used)]
            task_ctx.running.lock().unwrap().remove(&uid);
        }
    });
    Ok(Action::await_change())
}

/// The repository target of BackupTarget `name` (its credentials Secret read).
pub(super) async fn resolve_target(client: &kube::Client, name: &str) -> Result<Target, String> {
    let t = Api::<resources::Target>::all(client.clone())
        .get_opt(name)
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("BackupTarget {name} (spec.target) not found"))?;
    let spec = t.0.spec.unwrap_or_default();
    let creds = match &spec.s3 {
        Some(s3) => {
            let r = &s3.credentials_secret_ref;
            let s = Api::<Secret>::namespaced(client.clone(), &r.namespace)
                .get_opt(&r.name)
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| {
                    format!("credentials Secret {}/{} not found", r.namespace, r.name)
                })?;
            s.data
        }
        None => None,
    };
    plan::target_of(&spec, creds.as_ref())
}

/// The encryption key from Secret `name` (key `key`) in `ns`.
pub(super) async fn read_key(
    client: &kube::Client,
    ns: &str,
    name: &str,
    field: &str,
) -> Result<Vec<u8>, String> {
    let s = Api::<Secret>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("encryption key Secret {name} ({field}) not found"))?;
    s.data
        .and_then(|mut d| d.remove(ENCRYPTION_KEY))
        .map(|b| b.0)
        .ok_or_else(|| format!("Secret {name} ({field}) has no key {ENCRYPTION_KEY:?}"))
}

/// One claim to read.
struct Source {
    vm: String,
    claim: String,
    pv: PersistentVolume,
    /// The online snapshot's layer to read (a running VM), else the live volume.
    handle: Option<String>,
    /// The backup point to read incrementally from, or why the claim is read whole.
    since: Result<Since, String>,
}

/// A running VM's online snapshot taken by this Backup: `(vm, snapshot)`.
type Taken = Vec<(String, String)>;

async fn get_json<K>(api: &Api<K>, name: &str) -> Result<Option<Value>, String>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    match api.get_opt(name).await {
        Ok(Some(o)) => serde_json::to_value(o).map(Some).map_err(|e| e.to_string()),
        Ok(None) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// What the backup reads and writes: the VMs, the objects they reference, the claims' bytes.
/// A running VM's claims are read through an online snapshot taken here (owned by `owner`);
/// `(vm, snapshot)` is pushed onto `snapshots` for the caller to keep or delete. Each claim's
/// backup point (or why there is none) comes with it.
async fn collect(
    job: &Job<'_>,
    snapshots: &mut Taken,
) -> Result<(Vec<Value>, Vec<Value>, Vec<Source>), String> {
    let Job {
        ctx,
        ns,
        spec,
        owner,
        backup_name,
        ..
    } = *job;
    let client = &ctx.client;
    let vms: Api<Vm> = Api::namespaced(client.clone(), ns);
    let vmis: Api<Vmi> = Api::namespaced(client.clone(), ns);
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let dv_res = ApiResource {
        group: "cdi.kubevirt.io".into(),
        version: "v1beta1".into(),
        api_version: "cdi.kubevirt.io/v1beta1".into(),
        kind: "DataVolume".into(),
        plural: "datavolumes".into(),
    };
    let dvs: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &dv_res);
    let (mut vm_docs, mut objects, mut sources) = (Vec::new(), Vec::new(), Vec::new());
    for (i, name) in spec.virtual_machines.iter().enumerate() {
        let field = format!("spec.virtualMachines[{i}]");
        let vm = get_json(&vms, name)
            .await?
            .ok_or_else(|| format!("VirtualMachine {ns}/{name} ({field}) not found"))?;
        // Live: the VMI exists and has not finished, so its disks may be written (also while
        // it is still scheduled or starting): they are read through an online snapshot.
        // Narrower than `freeze::running` (phase Running, on a node: a guest to freeze or to
        // run a command in).
        let live = vmis
            .get_opt(name)
            .await
            .map_err(|e| e.to_string())?
            .is_some_and(|vmi| {
                !matches!(
                    vmi.0.status.as_ref().and_then(|s| s.phase),
                    Some(VmiPhase::Succeeded | VmiPhase::Failed)
                )
            });
        let refs = plan::references(&vm);
        let own = online::snapshot_name(&owner.name, name);
        let point = if refs.claims.is_empty() {
            Err(String::new())
        } else {
            incremental::find_point(client, ns, name, &spec.target, &own).await
        };
        // A running VM is read through its online snapshot, never while it writes.
        let frozen = if live && !refs.claims.is_empty() {
            let dest = online::Destination {
                target: &spec.target,
                backup_name,
            };
            let snap = online::backup_snapshot(ns, &owner.name, owner, name, dest);
            snapshots.push((name.clone(), own.clone()));
            Some(
                online::take(client, ns, snap)
                    .await
                    .map_err(|e| format!("VirtualMachine {ns}/{name} ({field}) is running: {e}"))?,
            )
        } else {
            None
        };
        for claim in &refs.claims {
            let pvc = pvcs
                .get_opt(claim)
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("claim {ns}/{claim} of VirtualMachine {name} not found"))?;
            let pv_name = pvc
                .spec
                .as_ref()
                .and_then(|s| s.volume_name.clone())
                .filter(|_| pvc.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
                .ok_or_else(|| {
                    format!("claim {ns}/{claim} of VirtualMachine {name} is not bound")
                })?;
            let pv = pvs
                .get_opt(&pv_name)
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("PersistentVolume {pv_name} of claim {claim} not found"))?;
            let mut pvc_doc = serde_json::to_value(&pvc).map_err(|e| e.to_string())?;
            if let Some(s) = pvc_doc["spec"].as_object_mut() {
                s.remove("volumeName");
            }
            objects.push(plan::strip(pvc_doc));
            let (pv, handle) = match &frozen {
                Some(f) => f.get(claim).cloned().ok_or_else(|| {
                    format!(
                        "claim {ns}/{claim} of VirtualMachine {name} is not in its online snapshot"
                    )
                })?,
                None => (pv, None),
            };
            let pv_name = pv.metadata.name.clone().unwrap_or_default();
            sources.push(Source {
                vm: name.clone(),
                claim: claim.clone(),
                since: incremental::since(&point, claim, &pv_name),
                pv,
                handle,
            });
        }
        for dv in &refs.data_volumes {
            if let Some(d) = get_json(&dvs, dv).await? {
                objects.push(plan::strip(d));
            }
        }
        for s in &refs.secrets {
            let doc = get_json(&secrets, s)
                .await?
                .ok_or_else(|| format!("Secret {ns}/{s} of VirtualMachine {name} not found"))?;
            objects.push(plan::strip(doc));
        }
        for c in &refs.config_maps {
            let doc = get_json(&cms, c)
                .await?
                .ok_or_else(|| format!("ConfigMap {ns}/{c} of VirtualMachine {name} not found"))?;
            objects.push(plan::strip(doc));
        }
        vm_docs.push(plan::strip(vm));
    }
    Ok((vm_docs, objects, sources))
}

/// Opens a claim's bytes where they are (as VirtualMachineExport does).
async fn open_volume(
    ctx: &Ctx,
    pv: &PersistentVolume,
    handle: Option<&str>,
) -> Result<(u64, ByteStream), String> {
    match nodes::placement(pv) {
        Placement::Node { node, volume } => {
            let token = ctx
                .agent_token
                .as_deref()
                .ok_or("the server has no agent token to read node storage")?;
            let n = Api::<Node>::all(ctx.client.clone())
                .get_opt(&node)
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("node {node} of volume {volume} does not exist"))?;
            let storage = ferrovirt_agent::nodestore::client::NodeStorage::of(&n, token)
                .map_err(|e| e.to_string())?;
            let resp = storage
                .read_export(&volume, handle)
                .await
                .map_err(|e| e.to_string())?;
            let size = resp
                .headers()
                .get(http::header::CONTENT_LENGTH)
                .and_then(|l| l.to_str().ok())
                .and_then(|l| l.parse().ok())
                .ok_or("the agent sent no Content-Length")?;
            let stream = http_body_util::BodyDataStream::new(resp.into_body())
                .map(|r| r.map_err(std::io::Error::other));
            Ok((size, Box::pin(stream)))
        }
        Placement::Path(dir) => {
            let r = ferrovirt_storage::export::open(&dir, handle)
                .await
                .map_err(|e| e.to_string())?;
            Ok((r.size, r.stream))
        }
        Placement::Unknown => Err("the volume has no known location".into()),
    }
}

/// How a claim is read.
enum Reading {
    /// Every byte.
    Full(ByteStream),
    /// Only the chunks changed since the point; the others from `base`, the earlier index.
    Changed {
        base: ferrovirt_backup::Index,
        size: u64,
        chunks: Vec<u64>,
        stream: ByteStream,
    },
}

/// The chunks of a claim changed since layer `since` was frozen (as [`open_volume`] reads).
async fn open_changed(
    ctx: &Ctx,
    pv: &PersistentVolume,
    handle: Option<&str>,
    since: &str,
) -> Result<
    (
        ferrovirt_storage::export::changed::ChangedHeader,
        ByteStream,
    ),
    String,
> {
    use ferrovirt_storage::export::changed;
    match nodes::placement(pv) {
        Placement::Node { node, volume } => {
            let token = ctx
                .agent_token
                .as_deref()
                .ok_or("the server has no agent token to read node storage")?;
            let n = Api::<Node>::all(ctx.client.clone())
                .get_opt(&node)
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("node {node} of volume {volume} does not exist"))?;
            let storage = ferrovirt_agent::nodestore::client::NodeStorage::of(&n, token)
                .map_err(|e| e.to_string())?;
            let resp = storage
                .read_export_since(&volume, handle, Some(since))
                .await
                .map_err(|e| e.to_string())?;
            let stream = http_body_util::BodyDataStream::new(resp.into_body())
                .map(|r| r.map_err(std::io::Error::other));
            changed::unframe(Box::pin(stream))
                .await
                .map_err(|e| e.to_string())
        }
        Placement::Path(dir) => {
            let c = changed::open_changed(&dir, handle, since)
                .await
                .map_err(|e| e.to_string())?;
            let header = changed::ChangedHeader {
                size: c.size,
                chunk_size: ferrovirt_storage::export::CHUNK as u64,
                chunks: c.chunks,
            };
            Ok((header, c.read.stream))
        }
        Placement::Unknown => Err("the volume has no known location".into()),
    }
}

/// Opens claim `s` incrementally from `since`: the earlier backup's index of its disk and the
/// changed chunks; the reason when that cannot be done.
async fn open_incremental(
    ctx: &Ctx,
    repo: &Repository,
    s: &Source,
    since: &Since,
) -> Result<(u64, Reading), String> {
    let disk = plan::disk_name(&s.vm, &s.claim);
    let base = repo.index(&since.backup_name, &disk).await.map_err(|e| {
        format!(
            "the previous backup {} cannot be read from the repository: {e}",
            since.backup_name
        )
    })?;
    match repo.first_missing_chunk(&base).await {
        Ok(None) => {}
        Ok(Some(id)) => {
            return Err(format!(
                "chunk {id} of the previous backup {} is missing from the target",
                since.backup_name
            ));
        }
        Err(e) => return Err(format!("checking the previous backup's chunks: {e}")),
    }
    let mut tries = 0;
    let (header, stream) = loop {
        match open_changed(ctx, &s.pv, s.handle.as_deref(), &since.layer).await {
            Err(e) if plan::volume_busy(&e) && tries < LOCK_RETRIES => tries += 1,
            r => break r,
        }
        tokio::time::sleep(LOCK_RETRY_AFTER).await;
    }
    .map_err(|e| format!("the changes since the previous backup cannot be read: {e}"))?;
    if header.size != base.size {
        return Err(format!(
            "the disk's size changed from {} to {} bytes since the previous backup {}",
            base.size, header.size, since.backup_name
        ));
    }
    let bytes = plan::chunk_bytes(header.size, header.chunk_size, &header.chunks);
    Ok((
        bytes,
        Reading::Changed {
            base,
            size: header.size,
            chunks: header.chunks,
            stream,
        },
    ))
}

/// The backup itself; the final status fields on success, the reason on failure.
/// The VMs' definitions, what they reference and the claims to read, with the running VMs'
/// online snapshots taken — under the backup's consistency (docs/backup.md "Consistency"):
/// `preFreezeCommand` in every running guest first, a `Group` freeze around the snapshots,
/// `postThawCommand` after them (also when they failed).
async fn snapshot_phase(
    job: &Job<'_>,
    snapshots: &mut Taken,
) -> Result<(Vec<Value>, Vec<Value>, Vec<Source>), String> {
    let Job {
        ctx,
        ns,
        name,
        spec,
        ..
    } = *job;
    let c = spec.consistency.as_ref();
    let hold = ConsistencyOpts::group_hold(c);
    let pre = c.and_then(|c| c.pre_freeze_command.as_deref());
    let post = c.and_then(|c| c.post_thaw_command.as_deref());
    if hold.is_none() && pre.is_none() && post.is_none() {
        return collect(job, snapshots).await;
    }
    let running = freeze::running(&ctx.client, ns, &spec.virtual_machines).await?;
    let guests = hooks::Guests {
        client: &ctx.client,
        token: ctx.agent_token.as_deref(),
        ns,
        running: &running,
        timeout: ConsistencyOpts::command_timeout(c),
    };
    let mut pre_reached = None;
    let collected = async {
        if let Some(pre) = pre {
            let (reached, r) = guests.run_all(pre, "preFreezeCommand").await;
            pre_reached = Some(reached);
            r?;
        }
        let Some(hold) = hold else {
            return collect(job, snapshots).await;
        };
        let held = freeze::freeze_all(&ctx.client, ns, &running, hold).await?;
        let collected = collect(job, snapshots).await;
        let thawed = freeze::thaw_all(&ctx.client, ns, held).await;
        let _ = patch_status(ctx, ns, name, json!({"freeze": thawed.status})).await;
        let collected = collected?;
        if thawed.outlasted {
            return Err(format!(
                "group freeze: the snapshots took {:.1}s, longer than \
                 spec.consistency.freezeTimeout ({}s) allows: the guests may have been thawed \
                 between two snapshots",
                thawed.held.as_secs_f64(),
                hold.as_secs()
            ));
        }
        Ok(collected)
    }
    .await;
    if let Some(post) = post {
        let targets = hooks::post_targets(&running, pre_reached);
        let (_, r) = guests.run_in(targets, post, "postThawCommand").await;
        match (&collected, r) {
            (Ok(_), Err(e)) => return Err(e),
            (Err(_), Err(e)) => tracing::warn!(namespace = %ns, backup = %name, "{e}"),
            _ => {}
        }
    }
    collected
}

/// One Backup being carried out: what each of its steps reads.
#[derive(Clone, Copy)]
struct Job<'a> {
    ctx: &'a Ctx,
    ns: &'a str,
    /// The Backup object's name.
    name: &'a str,
    spec: &'a BackupSpec,
    /// The backup's name in the repository.
    backup_name: &'a str,
    /// The Backup, owner of the online snapshots taken for it.
    owner: &'a OwnerReference,
}

async fn carry_out(job: &Job<'_>) -> Result<Value, String> {
    let Job {
        ctx,
        ns,
        name,
        spec,
        backup_name,
        ..
    } = *job;
    let target = resolve_target(&ctx.client, &spec.target).await?;
    let key = read_key(
        &ctx.client,
        ns,
        &spec.encryption_key_secret_ref,
        "spec.encryptionKeySecretRef",
    )
    .await?;
    let mut snapshots = Vec::new();
    let result = async {
        let (vms, objects, sources) = snapshot_phase(job, &mut snapshots).await?;
        let repo = Repository::open(&target, &key, Create::IfMissing)
            .await
            .map_err(|e| format!("target {}: {e}", spec.target))?;
        let mut writer = repo.begin(backup_name).await.map_err(|e| e.to_string())?;
        let mut opened = Vec::new();
        for s in &sources {
            let incremental = match &s.since {
                Ok(since) => open_incremental(ctx, &repo, s, since)
                    .await
                    .map(|r| (r, since.backup_name.clone())),
                Err(why) => Err(why.clone()),
            };
            let (size, reading, mode) = match incremental {
                Ok(((size, reading), base)) => {
                    (size, reading, plan::ReadMode::Incremental { base })
                }
                Err(why) => {
                    let mut tries = 0;
                    let (size, stream) = loop {
                        match open_volume(ctx, &s.pv, s.handle.as_deref()).await {
                            Err(e) if plan::volume_busy(&e) && tries < LOCK_RETRIES => tries += 1,
                            r => break r,
                        }
                        tokio::time::sleep(LOCK_RETRY_AFTER).await;
                    }
                    .map_err(|e| format!("reading claim {ns}/{}: {e}", s.claim))?;
                    (
                        size,
                        Reading::Full(stream),
                        plan::ReadMode::Full { reason: why },
                    )
                }
            };
            opened.push((s, size, reading, mode));
        }
        let total: u64 = opened.iter().map(|(_, size, _, _)| size).sum();
        let mut done = 0u64;
        let mut volumes = Vec::new();
        let mut sum = Stats::default();
        for (s, _, reading, mode) in opened {
            let disk = plan::disk_name(&s.vm, &s.claim);
            let seen = Arc::new(Mutex::new(0u64));
            let seen2 = seen.clone();
            let progress = move |st: &Stats| {
                #[allow(clippy::unwrap_used)]
                {
                    *seen2.lock().unwrap() = st.bytes_read;
                }
            };
            let mut held = None;
            let write = match reading {
                Reading::Full(stream) => {
                    let reader = tokio_util::io::StreamReader::new(stream);
                    futures::future::Either::Left(writer.write_disk(&disk, reader, &progress))
                }
                Reading::Changed {
                    base,
                    size,
                    chunks,
                    stream,
                } => {
                    let reader = tokio_util::io::StreamReader::new(stream);
                    let (base, chunks) = &*held.insert((base, chunks));
                    futures::future::Either::Right(
                        writer.write_disk_changed(&disk, base, size, chunks, reader, &progress),
                    )
                }
            };
            tokio::pin!(write);
            let mut tick = tokio::time::interval(PROGRESS_EVERY);
            let entry = loop {
                tokio::select! {
                    r = &mut write => break r,
                    _ = tick.tick() => {
                        #[allow(clippy::unwrap_used)]
                        let now_read = done + *seen.lock().unwrap();
                        let _ = patch_status(ctx, ns, name,
                            json!({"progress": plan::percent(now_read, total)})).await;
                    }
                }
            }
            .map_err(|e| format!("writing claim {ns}/{} to the target: {e}", s.claim))?;
            done += entry.stats.bytes_read;
            sum.add(&entry.stats);
            volumes.push(plan::volume_status(&s.vm, &s.claim, &entry, &mode));
        }
        writer
            .commit(&now(), vms, objects)
            .await
            .map_err(|e| format!("writing the manifest and catalog: {e}"))?;
        let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        Ok(json!({
            "volumes": volumes,
            "bytesRead": i(sum.bytes_read),
            "bytesNew": i(sum.bytes_new),
            "bytesDeduplicated": i(sum.bytes_deduplicated),
        }))
    }
    .await;
    // The online snapshots were read: on success each becomes its VM's backup point (the older
    // points of the target go); on failure they go and the older points stay.
    for (vm, snap) in &snapshots {
        let kept = match &result {
            Ok(_) => incremental::keep_point(&ctx.client, ns, snap).await,
            Err(_) => Err(String::new()),
        };
        match kept {
            Ok(()) => incremental::drop_points(&ctx.client, ns, vm, &spec.target, snap).await,
            Err(e) => {
                if !e.is_empty() {
                    tracing::warn!(error = %e, "keeping a backup point failed");
                }
                online::delete(&ctx.client, ns, snap).await
            }
        }
    }
    result
}

/// How long until a target last checked at `last` is due again (`None`: now). A check's own
/// status write wakes the target's reconcile, which then only waits out the rest.
pub(super) fn target_check_wait(last: Option<Timestamp>, now: Timestamp) -> Option<Duration> {
    let last = last?;
    let age = now.duration_since(last).unsigned_abs();
    (age < TARGET_CHECK_EVERY).then(|| TARGET_CHECK_EVERY - age)
}

/// Every 30 s: each BackupTarget's reachability and stored bytes. Driven by a watch of the
/// targets (no periodic LIST: agents and controllers only watch in steady state).
async fn check_targets(ctx: Arc<Ctx>) -> Result<(), ControllerError> {
    crate::runtime::drive(
        Controller::new(
            Api::<resources::Target>::all(ctx.client.clone()),
            watcher::Config::default(),
        )
        .run(
            crate::runtime::metrics::timed("BackupTarget", check_target),
            target_error_policy,
            ctx,
        ),
        super::COMPONENT,
        "BackupTarget",
    )
    .await
}

fn target_error_policy(
    _o: Arc<resources::Target>,
    err: &ControllerError,
    _ctx: Arc<Ctx>,
) -> Action {
    tracing::debug!(error = %err, "backup target check failed");
    Action::requeue(TARGET_CHECK_EVERY)
}

async fn check_target(t: Arc<resources::Target>, ctx: Arc<Ctx>) -> Result<Action, ControllerError> {
    let last =
        t.0.status
            .as_ref()
            .and_then(|s| s.last_check_time.as_ref())
            .map(|t| t.0);
    if let Some(wait) = target_check_wait(last, Timestamp::now()) {
        return Ok(Action::requeue(wait));
    }
    let name = t.0.metadata.name.clone().unwrap_or_default();
    let status = match resolve_target(&ctx.client, &name).await {
        Err(msg) => json!({"reachable": false, "lastCheckTime": now(),
            "conditions": [plan::condition("Reachable", false, "Invalid", &msg, &now())]}),
        Ok(target) => match ferrovirt_backup::repo::probe(&target).await {
            Ok(bytes) => json!({"reachable": true, "bytesStored": bytes,
                "lastCheckTime": now(),
                "conditions": [plan::condition("Reachable", true, "Listed",
                    "the target answered a listing", &now())]}),
            Err(e) => json!({"reachable": false, "lastCheckTime": now(),
                "conditions": [plan::condition("Reachable", false, "Unreachable",
                    &e.to_string(), &now())]}),
        },
    };
    let api: Api<resources::Target> = Api::all(ctx.client.clone());
    api.patch_status(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": status})),
    )
    .await?;
    Ok(Action::requeue(TARGET_CHECK_EVERY))
}

#[cfg(test)]
mod target_check_tests {
    use super::*;

    #[test]
    fn a_target_is_checked_when_never_checked_or_30s_after_its_last_check() {
        let now: Timestamp = "2026-12-02T12:00:00Z".parse().unwrap();
        assert_eq!(target_check_wait(None, now), None);
        let t = |s: &str| Some(s.parse::<Timestamp>().unwrap());
        assert_eq!(
            target_check_wait(t("2026-12-02T11:59:50Z"), now),
            Some(Duration::from_secs(20))
        );
        assert_eq!(target_check_wait(t("2026-12-02T11:59:30Z"), now), None);
        assert_eq!(target_check_wait(t("2026-12-02T11:00:00Z"), now), None);
    }
}
