//! The BackupRestore controller (I/O; decisions in [`super::restore`]).
//!
//! One task per BackupRestore in this process: Pending → Running → Succeeded | Failed. The
//! task opens the repository on the target with the key (never creating one), reads the
//! backup's manifest (the catalog names it: no Backup object is needed), checks every name it
//! will create against what is here (a VM, DataVolume, claim, Secret or ConfigMap of another
//! owner fails the restore, nothing is overwritten), creates the Secrets and ConfigMaps, one
//! DataVolume with an `upload` source per disk and writes the disk's chunks into it — through
//! the node agent's upload route for a node-local volume (which validates and converts it
//! like any upload), straight into the volume on this machine for a shared one — marks the
//! DataVolume Succeeded, then creates the VM. Everything it creates carries the restore's UID
//! (`backup.ferrovirt.io/restore-uid`), so a restore found Running with no task here (the
//! server restarted) runs again from the start and takes its own objects as done or to fill.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::discovery::ApiResource;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use serde_json::{Value, json};

use ferrovirt_api::backup::{BackupRestoreSpec, phase};
use ferrovirt_api::cdi::dv_phase;
use ferrovirt_backup::repo::Create;
use ferrovirt_backup::{BackupError, Manifest, Repository};

use super::loops::{read_key, resolve_target};
use super::plan;
use super::resources::Restore;
use super::restore::{self, Found, ObjectAction, Step, VmPlan};
use crate::error::ControllerError;
use crate::runtime::events::{EventRecorder, object_ref};
use crate::storage::datavolume::{self as dvd, Stage};
use crate::storage::nodes::{self, Placement};
use crate::storage::resources::Dv;

/// How often a running restore writes its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);
/// How long a DataVolume may take to become UploadReady.
const DV_READY_WITHIN: Duration = Duration::from_secs(300);

struct Ctx {
    client: kube::Client,
    agent_token: Option<String>,
    /// UIDs of BackupRestores with a task in this process, running or finished (a finished
    /// one stays: a watch event older than its final status must not start it again).
    running: Mutex<HashSet<String>>,
    events: EventRecorder,
}

/// Runs the BackupRestore controller.
pub async fn run(client: kube::Client, agent_token: Option<String>) -> Result<(), ControllerError> {
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        agent_token,
        running: Mutex::new(HashSet::new()),
        events: EventRecorder::new(client.clone(), super::COMPONENT),
    });
    crate::runtime::drive(
        Controller::new(Api::<Restore>::all(client), watcher::Config::default()).run(
            crate::runtime::metrics::timed("BackupRestore", reconcile),
            error_policy,
            ctx,
        ),
        super::COMPONENT,
        "BackupRestore",
    )
    .await
}

fn error_policy(_o: Arc<Restore>, err: &ControllerError, _ctx: Arc<Ctx>) -> Action {
    tracing::debug!(error = %err, "backup restore reconcile failed");
    Action::requeue(Duration::from_secs(2))
}

fn now() -> String {
    Timestamp::now().to_string()
}

async fn patch_status(
    client: &kube::Client,
    ns: &str,
    name: &str,
    status: Value,
) -> Result<(), ControllerError> {
    let api: Api<Restore> = Api::namespaced(client.clone(), ns);
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": status})),
    )
    .await?;
    Ok(())
}

async fn reconcile(obj: Arc<Restore>, ctx: Arc<Ctx>) -> Result<Action, ControllerError> {
    let r = &obj.0;
    let current = r.status.as_ref().and_then(|s| s.phase.as_deref());
    if restore::step(current) == Step::Done {
        return Ok(Action::await_change());
    }
    let uid = r.metadata.uid.clone().unwrap_or_default();
    #[allow(clippy::unwrap_used)]
    if !ctx.running.lock().unwrap().insert(uid.clone()) {
        return Ok(Action::await_change());
    }
    let ns = r.metadata.namespace.clone().unwrap_or_default();
    let name = r.metadata.name.clone().unwrap_or_default();
    let spec = r.spec.clone().unwrap_or_default();
    let started = r
        .status
        .as_ref()
        .and_then(|s| s.start_time.clone())
        .map(|t| t.0.to_string())
        .unwrap_or_else(now);
    if let Err(e) = patch_status(
        &ctx.client,
        &ns,
        &name,
        json!({"phase": phase::RUNNING, "startTime": started, "progress": "0%"}),
    )
    .await
    {
        #[allow(clippy::unwrap_used)]
        ctx.running.lock().unwrap().remove(&uid);
        return Err(e);
    }
    let oref = object_ref(
        &format!(
            "{}/{}",
            ferrovirt_api::backup::GROUP,
            ferrovirt_api::backup::VERSION
        ),
        "BackupRestore",
        &r.metadata,
    );
    let again = current == Some(phase::RUNNING);
    let msg = if again {
        format!(
            "restoring backup {} again from the start (the last attempt was interrupted)",
            spec.backup_name
        )
    } else {
        format!("restoring backup {}", spec.backup_name)
    };
    ctx.events.record(&oref, false, "Started", &msg).await;
    let task_ctx = ctx.clone();
    tokio::spawn(async move {
        let done = Arc::new(AtomicU64::new(0));
        let total = Arc::new(AtomicU64::new(0));
        let ticker = {
            let (client, ns, name) = (task_ctx.client.clone(), ns.clone(), name.clone());
            let (done, total) = (done.clone(), total.clone());
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(PROGRESS_EVERY);
                loop {
                    tick.tick().await;
                    let (d, t) = (done.load(Ordering::Relaxed), total.load(Ordering::Relaxed));
                    if t > 0 {
                        let st = json!({"progress": plan::percent(d, t),
                            "bytesWritten": i64::try_from(d).unwrap_or(i64::MAX)});
                        let _ = patch_status(&client, &ns, &name, st).await;
                    }
                }
            })
        };
        let io = Io {
            ctx: &task_ctx,
            ns: &ns,
            uid: &uid,
            done: &done,
            total: &total,
        };
        let result = io.carry_out(&spec).await;
        ticker.abort();
        let (status, warning, reason, msg) = match result {
            Ok(mut st) => {
                let msg = format!(
                    "backup {} restored: {} ({} bytes written)",
                    spec.backup_name,
                    st["restoredVirtualMachines"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join(", "),
                    st["bytesWritten"]
                );
                st["phase"] = json!(phase::SUCCEEDED);
                st["progress"] = json!("100%");
                st["completionTime"] = json!(now());
                st["conditions"] =
                    json!([plan::condition("Ready", true, "Succeeded", &msg, &now())]);
                (st, false, "Succeeded", msg)
            }
            Err(msg) => (
                json!({"phase": phase::FAILED, "completionTime": now(),
                       "conditions": [plan::condition("Ready", false, "Failed", &msg, &now())]}),
                true,
                "Failed",
                msg,
            ),
        };
        if let Err(e) = patch_status(&task_ctx.client, &ns, &name, status).await {
            tracing::warn!(error = %e, restore = %name, "writing the restore's result failed");
        }
        task_ctx.events.record(&oref, warning, reason, &msg).await;
    });
    Ok(Action::await_change())
}

fn res(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: if group.is_empty() {
            version.into()
        } else {
            format!("{group}/{version}")
        },
        kind: kind.into(),
        plural: plural.into(),
    }
}

async fn get(api: &Api<DynamicObject>, name: &str) -> Result<Option<Value>, String> {
    match api.get_opt(name).await {
        Ok(Some(o)) => serde_json::to_value(o).map(Some).map_err(|e| e.to_string()),
        Ok(None) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

async fn create(api: &Api<DynamicObject>, obj: Value) -> Result<(), String> {
    let what = format!(
        "{} {}",
        obj["kind"].as_str().unwrap_or("object"),
        obj["metadata"]["name"].as_str().unwrap_or("")
    );
    let o: DynamicObject = serde_json::from_value(obj).map_err(|e| e.to_string())?;
    api.create(&PostParams::default(), &o)
        .await
        .map(drop)
        .map_err(|e| format!("creating {what}: {e}"))
}

/// Fresh random bytes.
fn random<const N: usize>() -> [u8; N] {
    use ring::rand::SecureRandom;
    let mut b = [0u8; N];
    let _ = ring::rand::SystemRandom::new().fill(&mut b);
    b
}

/// The restore's I/O, with its progress counters.
struct Io<'a> {
    ctx: &'a Ctx,
    ns: &'a str,
    uid: &'a str,
    done: &'a AtomicU64,
    total: &'a AtomicU64,
}

impl Io<'_> {
    fn api(&self, r: &ApiResource) -> Api<DynamicObject> {
        Api::namespaced_with(self.ctx.client.clone(), self.ns, r)
    }

    /// The restore itself; the final status fields on success, the reason on failure.
    async fn carry_out(&self, spec: &BackupRestoreSpec) -> Result<Value, String> {
        let client = &self.ctx.client;
        let ns = self.ns;
        let target = resolve_target(client, &spec.target).await?;
        let key_ref = &spec.encryption_key_secret_ref;
        let key = read_key(client, ns, key_ref, "spec.encryptionKeySecretRef").await?;
        let repo = Repository::open(&target, &key, Create::Never)
            .await
            .map_err(|e| match e {
                BackupError::WrongKey | BackupError::KeyTooShort { .. } => {
                    format!("encryption key Secret {key_ref} (spec.encryptionKeySecretRef): {e}")
                }
                e => format!("target {} (spec.target): {e}", spec.target),
            })?;
        let backup = &spec.backup_name;
        let m = repo.manifest(backup).await.map_err(|e| match e {
            BackupError::BackupNotFound(_) => format!(
                "backup {backup} (spec.backupName) is not listed on target {}",
                spec.target
            ),
            e => format!("reading backup {backup}: {e}"),
        })?;
        let plans = restore::plan_vms(
            &m.vms,
            backup,
            spec,
            ns,
            self.uid,
            &mut || ferrovirt_backup::restore::mac_from(random()),
            &mut || ferrovirt_backup::restore::uuid_from(random()),
        )?;
        let classes: Vec<String> = Api::<StorageClass>::all(client.clone())
            .list(&Default::default())
            .await
            .map_err(|e| e.to_string())?
            .items
            .into_iter()
            .filter_map(|c| c.metadata.name)
            .collect();
        // Everything is checked before anything is created.
        let mut disks = Vec::new();
        for p in &plans {
            for (disk, dv) in &p.claims {
                let size = m
                    .disks
                    .iter()
                    .find(|d| &d.name == disk)
                    .map(|d| d.size)
                    .ok_or_else(|| {
                        format!("disk {disk} of {} is not in backup {backup}", p.source)
                    })?;
                disks.push((p, disk.clone(), dv.clone(), size));
            }
        }
        let objects = self.check(&plans, &disks, &m).await?;
        self.total
            .store(disks.iter().map(|d| d.3).sum(), Ordering::Relaxed);
        let secrets = self.api(&res("", "v1", "Secret", "secrets"));
        let cms = self.api(&res("", "v1", "ConfigMap", "configmaps"));
        for o in objects {
            let api = if o["kind"] == "Secret" {
                &secrets
            } else {
                &cms
            };
            create(api, o).await?;
        }
        let vms = self.api(&res(
            "kubevirt.io",
            "v1",
            "VirtualMachine",
            "virtualmachines",
        ));
        let mut restored_vms = Vec::new();
        let mut volumes = Vec::new();
        for p in &plans {
            for (_, disk, dv, size) in disks.iter().filter(|d| std::ptr::eq(d.0, p)) {
                let src_vm = p.source.rsplit('/').next().unwrap_or("");
                let claim = restore::backed_up_claim(&m.objects, &p.source_namespace, disk, src_vm);
                let doc = restore::data_volume(dv, ns, *size, claim, &classes, self.uid);
                self.restore_disk(&repo, backup, disk, dv, *size, doc)
                    .await
                    .map_err(|e| format!("disk {disk} into DataVolume {ns}/{dv}: {e}"))?;
                volumes.push(json!({"virtualMachine": format!("{ns}/{}", p.name()),
                    "name": dv, "disk": disk, "sizeBytes": i64::try_from(*size).unwrap_or(i64::MAX)}));
            }
            if p.volumes_only {
                continue;
            }
            if restore::found(get(&vms, p.name()).await?.as_ref(), self.uid) == Found::Absent {
                create(&vms, p.vm.clone()).await?;
            }
            restored_vms.push(format!("{ns}/{}", p.name()));
        }
        let written = self.done.load(Ordering::Relaxed);
        Ok(json!({
            "restoredVirtualMachines": restored_vms,
            "restoredVolumes": volumes,
            "bytesWritten": i64::try_from(written).unwrap_or(i64::MAX),
        }))
    }

    /// Refuses names taken by others: VMs, DataVolumes, claims, and Secrets/ConfigMaps with
    /// other contents. Returns the Secrets and ConfigMaps to create.
    async fn check(
        &self,
        plans: &[VmPlan],
        disks: &[(&VmPlan, String, String, u64)],
        m: &Manifest,
    ) -> Result<Vec<Value>, String> {
        let ns = self.ns;
        let hint = "restore under another name (spec.virtualMachines[].newName)";
        let vms = self.api(&res(
            "kubevirt.io",
            "v1",
            "VirtualMachine",
            "virtualmachines",
        ));
        for p in plans.iter().filter(|p| !p.volumes_only) {
            if restore::found(get(&vms, p.name()).await?.as_ref(), self.uid) == Found::Conflict {
                return Err(format!(
                    "VirtualMachine {ns}/{} already exists and was not made by this restore: {hint}",
                    p.name()
                ));
            }
        }
        let dvs = self.api(&res(
            "cdi.kubevirt.io",
            "v1beta1",
            "DataVolume",
            "datavolumes",
        ));
        let pvcs = self.api(&res(
            "",
            "v1",
            "PersistentVolumeClaim",
            "persistentvolumeclaims",
        ));
        for (_, _, dv, _) in disks {
            for (api, kind) in [(&dvs, "DataVolume"), (&pvcs, "PersistentVolumeClaim")] {
                if restore::found(get(api, dv).await?.as_ref(), self.uid) == Found::Conflict {
                    return Err(format!(
                        "{kind} {ns}/{dv} already exists and was not made by this restore: {hint}"
                    ));
                }
            }
        }
        let secrets = self.api(&res("", "v1", "Secret", "secrets"));
        let cms = self.api(&res("", "v1", "ConfigMap", "configmaps"));
        let mut create = Vec::new();
        let mut seen = HashSet::new();
        for p in plans.iter().filter(|p| !p.volumes_only) {
            let refs = plan::references(&p.vm);
            let wanted = refs
                .secrets
                .iter()
                .map(|s| ("Secret", s, &secrets))
                .chain(refs.config_maps.iter().map(|c| ("ConfigMap", c, &cms)));
            for (kind, name, api) in wanted {
                if !seen.insert((kind, name.clone())) {
                    continue;
                }
                let Some(obj) = m.objects.iter().find(|o| {
                    o["kind"] == kind
                        && o["metadata"]["name"].as_str() == Some(name)
                        && o["metadata"]["namespace"].as_str() == Some(&p.source_namespace)
                }) else {
                    continue;
                };
                match restore::object_action(get(api, name).await?.as_ref(), obj) {
                    ObjectAction::Create => {
                        create.push(restore::object_to_create(obj, ns, self.uid));
                    }
                    ObjectAction::Reuse => {}
                    ObjectAction::Conflict => {
                        return Err(format!(
                            "{kind} {ns}/{name} already exists with other contents than the \
                             backup's (VM {}): the restore does not overwrite it",
                            p.source
                        ));
                    }
                }
            }
        }
        Ok(create)
    }

    /// One disk: its DataVolume created (or this restore's from an earlier attempt), filled
    /// unless it already Succeeded, then marked Succeeded.
    async fn restore_disk(
        &self,
        repo: &Repository,
        backup: &str,
        disk: &str,
        name: &str,
        size: u64,
        doc: Value,
    ) -> Result<(), String> {
        let ns = self.ns;
        let dvs = self.api(&res(
            "cdi.kubevirt.io",
            "v1beta1",
            "DataVolume",
            "datavolumes",
        ));
        if get(&dvs, name).await?.is_none() {
            create(&dvs, doc).await?;
        }
        let typed: Api<Dv> = Api::namespaced(self.ctx.client.clone(), ns);
        let deadline = tokio::time::Instant::now() + DV_READY_WITHIN;
        let dv = loop {
            let dv = typed.get(name).await.map_err(|e| e.to_string())?.0;
            let phase = dv
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_default();
            match phase.as_str() {
                dv_phase::SUCCEEDED => {
                    // Filled by an earlier attempt of this restore (marked only when whole).
                    self.done.fetch_add(size, Ordering::Relaxed);
                    return Ok(());
                }
                dv_phase::UPLOAD_READY => break dv,
                dv_phase::FAILED => return Err(format!("the DataVolume failed ({phase})")),
                _ if tokio::time::Instant::now() > deadline => {
                    return Err(format!(
                        "the DataVolume is not ready for the restore after {}s (phase {phase:?})",
                        DV_READY_WITHIN.as_secs()
                    ));
                }
                _ => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        };
        let pvc = Api::<PersistentVolumeClaim>::namespaced(self.ctx.client.clone(), ns)
            .get(name)
            .await
            .map_err(|e| e.to_string())?;
        let volume = pvc
            .spec
            .as_ref()
            .and_then(|s| s.volume_name.clone())
            .unwrap_or_default();
        let pv = Api::<PersistentVolume>::all(self.ctx.client.clone())
            .get(&volume)
            .await
            .map_err(|e| format!("volume {volume}: {e}"))?;
        let (path, capacity) = crate::storage::dv_loop::volume_path_and_size(&pv)
            .ok_or_else(|| format!("volume {volume} has no local path"))?;
        if size > capacity {
            return Err(format!(
                "the disk is {size} bytes, volume {volume} holds {capacity}"
            ));
        }
        let base = self.done.load(Ordering::Relaxed);
        let done = self.done;
        let progress = move |n: u64| done.store(base + n, Ordering::Relaxed);
        match nodes::placement(&pv) {
            Placement::Node { node, volume } => {
                self.write_on_node(repo, backup, disk, &node, &volume, capacity, &progress)
                    .await?
            }
            Placement::Path(_) => {
                let target = crate::storage::block::target(&pv, &path)
                    .await
                    .map_err(|e| e.to_string())?;
                let mut f = tokio::fs::OpenOptions::new()
                    .write(true)
                    .open(&target)
                    .await
                    .map_err(|e| format!("opening {}: {e}", target.display()))?;
                repo.restore_disk(backup, disk, &mut f, &progress)
                    .await
                    .map_err(|e| e.to_string())?;
                f.sync_all().await.map_err(|e| e.to_string())?;
            }
            Placement::Unknown => return Err("the volume has no known location".into()),
        }
        self.done.store(base + size, Ordering::Relaxed);
        self.mark_succeeded(&typed, &dv, name).await
    }

    /// Streams the disk to the agent of `node`, which writes it into its volume.
    #[allow(clippy::too_many_arguments)]
    async fn write_on_node(
        &self,
        repo: &Repository,
        backup: &str,
        disk: &str,
        node: &str,
        volume: &str,
        capacity: u64,
        progress: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<(), String> {
        let token = self
            .ctx
            .agent_token
            .as_deref()
            .ok_or("the server has no agent token to write node storage")?;
        let n = Api::<Node>::all(self.ctx.client.clone())
            .get_opt(node)
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("node {node} of volume {volume} does not exist"))?;
        let storage = ferrovirt_agent::nodestore::client::NodeStorage::of(&n, token)
            .map_err(|e| e.to_string())?;
        let (reader, mut writer) = tokio::io::duplex(8 << 20);
        let (ok_tx, ok_rx) = tokio::sync::oneshot::channel::<bool>();
        let feed = async move {
            let r = repo.restore_disk(backup, disk, &mut writer, progress).await;
            let _ = ok_tx.send(r.is_ok());
            drop(writer);
            r
        };
        // A failed feed ends the body with an error, never as a short image.
        let tail = futures::stream::once(async move {
            match ok_rx.await {
                Ok(true) => None,
                _ => Some(Err(std::io::Error::other("the restore stream failed"))),
            }
        })
        .filter_map(|x| async move { x });
        let body = ferrovirt_agent::nodestore::client::stream_body(
            tokio_util::io::ReaderStream::with_capacity(reader, 1 << 20).chain(tail),
        );
        let limit = crate::storage::upload_api::upload_limit(capacity);
        let (fed, sent) = tokio::join!(feed, storage.upload(volume, capacity, limit, body, |_| {}));
        // A repository error (a damaged chunk, a missing object) is the cause when both fail.
        fed.map_err(|e| e.to_string())?;
        match sent {
            Ok(Ok(())) => Ok(()),
            Ok(Err(f)) => Err(format!("node {node}: {}", f.message)),
            Err(e) => Err(e.to_string()),
        }
    }

    /// The DataVolume's final phase (the restore is its upload), re-read and written again
    /// when the DataVolume controller's own status write raced it.
    async fn mark_succeeded(
        &self,
        api: &Api<Dv>,
        dv: &ferrovirt_api::cdi::DataVolume,
        name: &str,
    ) -> Result<(), String> {
        let restarts = dv
            .status
            .as_ref()
            .and_then(|s| s.restart_count)
            .unwrap_or(0);
        for _ in 0..5 {
            let status = dvd::status_for(
                dv.status.as_ref(),
                name,
                &Stage::Succeeded,
                restarts,
                &Time(Timestamp::now()),
            );
            api.patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": status})),
            )
            .await
            .map_err(|e| e.to_string())?;
            tokio::time::sleep(Duration::from_millis(300)).await;
            let now = api.get(name).await.map_err(|e| e.to_string())?.0;
            if now.status.and_then(|s| s.phase).as_deref() == Some(dv_phase::SUCCEEDED) {
                return Ok(());
            }
        }
        Err("the DataVolume did not keep its Succeeded phase".into())
    }
}
