//! The DataVolume controller loop (cdi.kubevirt.io/v1beta1): creates each DataVolume's PVC
//! (from `pvc:`, or `storage:` completed with the class's StorageProfile), waits for it to be
//! bound (choosing the node of WaitForFirstConsumer claims unless that is honoured), then
//! populates the volume in a task — HTTP(S) import, blank, or a copy of another PVC — and
//! reports phase, progress, conditions and Events. A `sourceRef` DataSource is resolved to
//! a PVC copy first ([`super::datasource`]); Block volumes are written on their loop device.
//! A node-local (`local`-class) volume is populated by its node's agent ([`super::nodes`]):
//! the work is decided and prepared here (sources, Secrets, CAs, checksum, address policy)
//! and sent to the agent, whose progress lines feed the same job state; a clone between
//! node-local claims on different nodes, or from a node-local claim into another class, is
//! refused with a clear reason.
//! Transfer failures are retried with exponential backoff; checksum mismatches, refused
//! images and untrusted TLS certificates fail the DataVolume at once.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, ObjectReference, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use serde_json::json;

use ferrovirt_api::cdi::{DataVolume, DataVolumeSpec, dv_phase};
use ferrovirt_storage::StorageError;
use ferrovirt_storage::importer;
use ferrovirt_storage::provisioner::image_of;

use super::classes;
use super::datasource;
use super::datavolume::{self as dvd, SourceKind, Stage};
use super::dv_work::{self, CloneSource, PrepareCtx, Prepared, RemoteWork, Work, remote_source};
use super::nodes::{self, Placement};
use super::pvc::{SELECTED_NODE, quantity_bytes};
use super::pvc_import;
use super::resources::{CDI_API_VERSION, Dv, Profile};
use super::{Dirs, StorageOptions};
use crate::error::ControllerError;
use crate::runtime::events::{EventRecorder, object_ref};
use ferrovirt_agent::nodestore::Populate;

/// Component name on Events.
pub const COMPONENT: &str = "datavolume-controller";

/// A failed population.
#[derive(Debug, Clone)]
struct Failure {
    /// Retrying cannot help (checksum mismatch, refused image, invalid source).
    permanent: bool,
    message: String,
}

impl From<StorageError> for Failure {
    fn from(e: StorageError) -> Self {
        let permanent = e.is_permanent();
        Failure {
            permanent,
            message: e.to_string(),
        }
    }
}

/// A running population.
struct Job {
    clone: bool,
    progress: Mutex<Option<f64>>,
    outcome: Mutex<Option<Result<(), Failure>>>,
    abort: Mutex<Option<tokio::task::AbortHandle>>,
    /// Signalled once `outcome` is set, so a reconcile waiting on a running job sees the end
    /// at once instead of at its next requeue.
    done: tokio::sync::Notify,
}

pub(super) struct Ctx {
    pub(super) client: kube::Client,
    /// Shared caches: StorageClasses and Nodes are read here, never listed.
    stores: crate::runtime::stores::Stores,
    dirs: Dirs,
    opts: StorageOptions,
    recorder: EventRecorder,
    jobs: Mutex<HashMap<String, Arc<Job>>>,
    /// When a failed population is tried again, and the restart count it had then.
    retry_at: Mutex<HashMap<String, (Instant, i32)>>,
    /// Populations that ended (Succeeded, or Failed for good), by uid, with their final stage
    /// and restart count: a reconcile of an object the cache shows stale (a claim's or the
    /// object's own earlier event queued it before the final status arrived) reports that
    /// end again instead of starting the transfer over.
    ended: Mutex<HashMap<String, (Stage, i32)>>,
    reported: Mutex<HashSet<(String, String)>>,
}

impl Ctx {
    fn job(&self, uid: &str) -> Option<Arc<Job>> {
        self.jobs.lock().expect("lock").get(uid).cloned()
    }

    /// Whether a population job for `uid` exists (running or finished, not yet collected).
    pub(super) fn has_job(&self, uid: &str) -> bool {
        self.job(uid).is_some()
    }

    /// Forgets everything about `uid` (its object is being deleted).
    pub(super) fn forget(&self, uid: &str) {
        self.drop_job(uid);
        self.retry_at.lock().expect("lock").remove(uid);
        self.ended.lock().expect("lock").remove(uid);
    }

    pub(super) fn drop_job(&self, uid: &str) {
        if let Some(j) = self.jobs.lock().expect("lock").remove(uid)
            && let Some(a) = j.abort.lock().expect("lock").take()
        {
            a.abort();
        }
    }
}

/// Run the DataVolume controller until its watch ends or the future is dropped.
pub async fn run(
    client: kube::Client,
    dirs: Dirs,
    opts: StorageOptions,
    stores: crate::runtime::stores::Stores,
) -> Result<(), ControllerError> {
    let dvs: Api<Dv> = Api::all(client.clone());
    let pvcs: Api<PersistentVolumeClaim> = Api::all(client.clone());
    let ctx = Arc::new(Ctx {
        recorder: EventRecorder::new(client.clone(), COMPONENT),
        client,
        stores,
        dirs,
        opts,
        jobs: Mutex::new(HashMap::new()),
        retry_at: Mutex::new(HashMap::new()),
        ended: Mutex::new(HashMap::new()),
        reported: Mutex::new(HashSet::new()),
    });
    let data_volumes = crate::runtime::drive(
        Controller::new(dvs, watcher::Config::default())
            .owns(pvcs.clone(), watcher::Config::default())
            .run(
                crate::runtime::metrics::timed("DataVolume", reconcile),
                |_, _, _| Action::requeue(Duration::from_secs(2)),
                ctx.clone(),
            ),
        COMPONENT,
        "DataVolume",
    );
    // CDI's annotated claims (no DataVolume), populated with the same jobs.
    let annotated = crate::runtime::drive(
        Controller::new(pvcs, watcher::Config::default()).run(
            crate::runtime::metrics::timed("PersistentVolumeClaim", pvc_import::reconcile),
            |_, _, _| Action::requeue(Duration::from_secs(2)),
            ctx,
        ),
        COMPONENT,
        "PersistentVolumeClaim",
    );
    tokio::select! {
        r = data_volumes => r,
        r = annotated => r,
    }
}

fn now() -> Time {
    Time(Timestamp::now())
}

/// What one reconcile observed and decided.
pub(super) struct Outcome {
    pub(super) stage: Stage,
    pub(super) restarts: i32,
    pub(super) requeue: Action,
    /// Whether the population is a clone.
    pub(super) clone: bool,
    /// The claim's annotations as read (None: the claim was not read), to report the stage
    /// on it as CDI does ([`pvc_import::annotations_for`]).
    pub(super) claim_annotations: Option<BTreeMap<String, String>>,
}

impl Outcome {
    pub(super) fn new(stage: Stage, restarts: i32, after: Duration) -> Self {
        Outcome {
            stage,
            restarts,
            requeue: Action::requeue(after),
            clone: false,
            claim_annotations: None,
        }
    }
}

/// What a population is for: a DataVolume, or the DataVolume an annotated claim stands for
/// ([`pvc_import`]); Events go to `reference`.
pub(super) struct Subject<'a> {
    pub(super) dv: &'a DataVolume,
    pub(super) reference: ObjectReference,
}

impl<'a> Subject<'a> {
    fn of(dv: &'a DataVolume) -> Self {
        Subject {
            dv,
            reference: object_ref(CDI_API_VERSION, "DataVolume", &dv.metadata),
        }
    }

    async fn event(&self, ctx: &Ctx, warning: bool, reason: &str, message: &str) {
        ctx.recorder
            .record(&self.reference, warning, reason, message)
            .await;
    }

    /// Records an Event once per (subject, reason, message).
    pub(super) async fn event_once(&self, ctx: &Ctx, warning: bool, reason: &str, message: &str) {
        let key = (
            self.dv.metadata.uid.clone().unwrap_or_default(),
            format!("{reason}/{message}"),
        );
        if ctx.reported.lock().expect("lock").insert(key) {
            self.event(ctx, warning, reason, message).await;
        }
    }
}

async fn reconcile(dv: Arc<Dv>, ctx: Arc<Ctx>) -> Result<Action, ControllerError> {
    let dv = &dv.0;
    let uid = dv.metadata.uid.clone().unwrap_or_default();
    let name = dv.metadata.name.clone().unwrap_or_default();
    let ns = dv
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    if dv.metadata.deletion_timestamp.is_some() {
        ctx.forget(&uid);
        return Ok(Action::await_change());
    }
    let phase = dv.status.as_ref().and_then(|s| s.phase.clone());
    let has_job = ctx.job(&uid).is_some();
    if phase.as_deref() == Some(dv_phase::SUCCEEDED)
        || (phase.as_deref() == Some(dv_phase::FAILED) && !has_job)
    {
        return Ok(Action::await_change());
    }
    let out = match observe_and_act(&ctx, dv, &ns, &name, &uid).await {
        Ok(o) => o,
        Err(e) => {
            tracing::warn!(dv = %format!("{ns}/{name}"), error = %e, "DataVolume reconcile failed");
            return Err(e);
        }
    };
    let status = dvd::status_for(dv.status.as_ref(), &name, &out.stage, out.restarts, &now());
    if dvd::status_changed(dv.status.as_ref(), &status) {
        let was_bound = dv
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Bound" && c.status == "True"));
        let now_bound = status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Bound" && c.status == "True");
        let api: Api<Dv> = Api::namespaced(ctx.client.clone(), &ns);
        let patch = json!({"status": status});
        match api
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_not_found() => {
                ctx.drop_job(&uid);
                return Ok(Action::await_change());
            }
            Err(e) => return Err(e.into()),
        }
        if now_bound && !was_bound {
            Subject::of(dv)
                .event(&ctx, false, "Bound", &format!("PVC {name} Bound"))
                .await;
        }
    }
    // The claim reports the stage too, as CDI's importer does on its claims (after the
    // DataVolume's own status: the claim's change queues another reconcile).
    if let Some(current) = &out.claim_annotations {
        let desired = pvc_import::annotations_for(&out.stage, out.restarts, out.clone);
        let changes = pvc_import::changed(Some(current), &desired);
        pvc_import::report(&ctx.client, &ns, &name, &changes).await?;
    }
    Ok(out.requeue)
}

async fn observe_and_act(
    ctx: &Arc<Ctx>,
    dv: &DataVolume,
    ns: &str,
    name: &str,
    uid: &str,
) -> Result<Outcome, ControllerError> {
    let restarts = dv
        .status
        .as_ref()
        .and_then(|s| s.restart_count)
        .unwrap_or(0);
    let subject = Subject::of(dv);
    let spec = dv.spec.clone().unwrap_or_default();
    // `sourceRef: {kind: DataSource}` becomes a clone of the PVC the DataSource names.
    let spec = match datasource::resolve_spec(&ctx.client, ns, &spec).await? {
        Ok(s) => s,
        Err(message) => {
            subject
                .event_once(ctx, true, "DataSourceNotReady", &message)
                .await;
            let stage = Stage::ClaimPending { message };
            return Ok(Outcome::new(stage, restarts, Duration::from_secs(2)));
        }
    };
    let source = match dvd::source_kind(&spec, ns) {
        Ok(s) => s,
        Err(message) => {
            subject
                .event_once(ctx, true, "ErrInvalidSource", &message)
                .await;
            let stage = Stage::Failed {
                reason: "InvalidSource".into(),
                message,
            };
            return Ok(Outcome::new(stage, restarts, Duration::from_secs(300)));
        }
    };
    let clone = matches!(source, SourceKind::Pvc { .. });
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), ns);
    let Some(claim) = claims.get_opt(name).await? else {
        let message = match create_claim(ctx, dv, &spec, &source).await? {
            Ok(()) => format!("PVC {name} Pending"),
            Err(message) => {
                subject
                    .event_once(ctx, true, "ErrClaimNotValid", &message)
                    .await;
                message
            }
        };
        let stage = Stage::ClaimPending { message };
        return Ok(Outcome::new(stage, restarts, Duration::from_millis(500)));
    };
    let owned = claim
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.uid == uid);
    if !owned {
        let message = format!("PVC {name} already exists and is not owned by DataVolume {name}");
        subject
            .event_once(ctx, true, "ErrResourceExists", &message)
            .await;
        let stage = Stage::Failed {
            reason: "ErrResourceExists".into(),
            message,
        };
        return Ok(Outcome::new(stage, restarts, Duration::from_secs(30)));
    }
    let mut out = if claim.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Bound") {
        let stage = unbound_stage(ctx, &claim).await?;
        Outcome::new(stage, restarts, Duration::from_secs(1))
    } else {
        populate(ctx, &subject, &claim, &source, restarts).await?
    };
    out.clone = clone;
    out.claim_annotations = Some(claim.metadata.annotations.clone().unwrap_or_default());
    Ok(out)
}

/// Populates the bound `claim` for `subject` from `source`: starts the transfer, follows
/// it, retries it with backoff, and says at which stage it is.
pub(super) async fn populate(
    ctx: &Arc<Ctx>,
    subject: &Subject<'_>,
    claim: &PersistentVolumeClaim,
    source: &SourceKind,
    restarts: i32,
) -> Result<Outcome, ControllerError> {
    let dv = subject.dv;
    let uid = dv.metadata.uid.as_deref().unwrap_or_default();
    let ns = dv.metadata.namespace.as_deref().unwrap_or("default");
    let name = claim.metadata.name.as_deref().unwrap_or_default();
    let clone = matches!(source, SourceKind::Pvc { .. });
    if let Some((stage, restarts)) = ctx.ended.lock().expect("lock").get(uid).cloned() {
        return Ok(Outcome::new(stage, restarts, Duration::from_secs(300)));
    }
    // Bound: find the volume's image and size.
    let volume = claim
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.clone())
        .unwrap_or_default();
    let pv = Api::<PersistentVolume>::all(ctx.client.clone())
        .get_opt(&volume)
        .await?;
    let Some((path, capacity)) = pv.as_ref().and_then(volume_path_and_size) else {
        let stage = Stage::ClaimPending {
            message: format!("volume {volume} has no local path"),
        };
        return Ok(Outcome::new(stage, restarts, Duration::from_secs(5)));
    };
    if *source == SourceKind::Upload {
        // The upload endpoint (`upload_api`) populates the volume and sets the final phase.
        return Ok(Outcome::new(
            Stage::UploadReady,
            restarts,
            Duration::from_secs(5),
        ));
    }
    if let Some(job) = ctx.job(uid) {
        if job.outcome.lock().expect("lock").is_none() {
            // Wait a little for the end of the job: finishing is reported without delay,
            // progress about once a second.
            let _ = tokio::time::timeout(Duration::from_millis(900), job.done.notified()).await;
        }
        let outcome = job.outcome.lock().expect("lock").clone();
        return Ok(match outcome {
            None => {
                let progress = *job.progress.lock().expect("lock");
                Outcome::new(
                    Stage::InProgress { clone, progress },
                    restarts,
                    Duration::from_millis(100),
                )
            }
            Some(Ok(())) => {
                ctx.drop_job(uid);
                ctx.retry_at.lock().expect("lock").remove(uid);
                ctx.ended
                    .lock()
                    .expect("lock")
                    .insert(uid.into(), (Stage::Succeeded, restarts));
                let (reason, what) = if clone {
                    ("CloneSucceeded", "cloned")
                } else {
                    ("ImportSucceeded", "imported")
                };
                let msg = format!("Successfully {what} into PVC {name}");
                subject.event(ctx, false, reason, &msg).await;
                Outcome::new(Stage::Succeeded, restarts, Duration::from_secs(300))
            }
            Some(Err(f)) => {
                ctx.drop_job(uid);
                let restarts = restarts + 1;
                let reason = if clone {
                    "ErrCloneFailed"
                } else {
                    "ErrImportFailed"
                };
                subject.event(ctx, true, reason, &f.message).await;
                if f.permanent || restarts as u32 > ctx.opts.max_retries {
                    let stage = Stage::Failed {
                        reason: "Error".into(),
                        message: f.message,
                    };
                    ctx.ended
                        .lock()
                        .expect("lock")
                        .insert(uid.into(), (stage.clone(), restarts));
                    Outcome::new(stage, restarts, Duration::from_secs(300))
                } else {
                    let delay = dvd::retry_delay(ctx.opts.retry_backoff, restarts as u32);
                    ctx.retry_at
                        .lock()
                        .expect("lock")
                        .insert(uid.into(), (Instant::now() + delay, restarts));
                    Outcome::new(Stage::Scheduled { clone }, restarts, delay)
                }
            }
        });
    }
    let retry = ctx.retry_at.lock().expect("lock").get(uid).copied();
    if let Some((at, restarts)) = retry
        && at > Instant::now()
    {
        return Ok(Outcome::new(
            Stage::Scheduled { clone },
            restarts,
            at - Instant::now(),
        ));
    }
    // The restart count of the last failure, not the (maybe stale) object's.
    let restarts = retry.map_or(restarts, |(_, r)| r.max(restarts));
    let placement = pv.as_ref().map(nodes::placement);
    let remote = match &placement {
        Some(Placement::Node { node, volume }) => {
            match nodes::storage_of(&ctx.stores, node, ctx.opts.agent_token.as_deref()) {
                Ok(s) => Some((s, volume.clone())),
                Err(message) => {
                    let stage = Stage::ClaimPending { message };
                    return Ok(Outcome::new(stage, restarts, Duration::from_secs(5)));
                }
            }
        }
        _ => None,
    };
    let target = match pv.as_ref() {
        // The node's agent resolves its own target.
        _ if remote.is_some() => PathBuf::new(),
        Some(pv) => match super::block::target(pv, &path).await {
            Ok(t) => t,
            Err(e) => {
                let stage = Stage::ClaimPending {
                    message: format!("volume {volume}: {e}"),
                };
                return Ok(Outcome::new(stage, restarts, Duration::from_secs(5)));
            }
        },
        None => image_of(&path),
    };
    let pctx = PrepareCtx {
        client: &ctx.client,
        scratch: &ctx.dirs.scratch,
        allowed: &ctx.opts.import_allowed_cidrs,
    };
    let work = match dv_work::prepare(&pctx, dv, ns, source, target, capacity).await? {
        Prepared::Ready(w) => w,
        Prepared::Wait(message) => {
            let reason = if clone {
                "CloneSourcePending"
            } else {
                "SourcePending"
            };
            subject.event_once(ctx, false, reason, &message).await;
            return Ok(Outcome::new(
                Stage::Scheduled { clone },
                restarts,
                Duration::from_secs(2),
            ));
        }
        Prepared::Invalid(message) => {
            subject
                .event_once(ctx, true, "ErrInvalidSource", &message)
                .await;
            let stage = Stage::Failed {
                reason: "Error".into(),
                message,
            };
            return Ok(Outcome::new(stage, restarts, Duration::from_secs(300)));
        }
    };
    let work = match (remote, work) {
        (Some((storage, volume)), work) => match remote_source(work, storage.node()) {
            Ok(source) => Work::Remote(Box::new(RemoteWork {
                storage,
                volume,
                req: Populate { capacity, source },
            })),
            Err(message) => {
                subject
                    .event_once(ctx, true, "ErrInvalidSource", &message)
                    .await;
                let stage = Stage::Failed {
                    reason: "Error".into(),
                    message,
                };
                return Ok(Outcome::new(stage, restarts, Duration::from_secs(300)));
            }
        },
        (
            None,
            Work::Clone {
                source: CloneSource::Node { node, .. },
                ..
            },
        ) => {
            let message = format!(
                "cloning a node-local claim (on node {node}) into a claim of another class is \
                 not supported: clone it into a local-class claim on the same node"
            );
            subject
                .event_once(ctx, true, "ErrInvalidSource", &message)
                .await;
            let stage = Stage::Failed {
                reason: "Error".into(),
                message,
            };
            return Ok(Outcome::new(stage, restarts, Duration::from_secs(300)));
        }
        (None, work) => work,
    };
    start_job(ctx, uid, clone, work);
    let (reason, msg) = if clone {
        ("CloneScheduled", format!("Cloning into PVC {name}"))
    } else {
        ("ImportScheduled", format!("Import into {name} scheduled"))
    };
    subject.event(ctx, false, reason, &msg).await;
    Ok(Outcome::new(
        Stage::InProgress {
            clone,
            progress: Some(0.0),
        },
        restarts,
        Duration::from_millis(500),
    ))
}

/// The directory/file of a bound PV and its capacity in bytes.
pub(crate) fn volume_path_and_size(pv: &PersistentVolume) -> Option<(PathBuf, u64)> {
    let spec = pv.spec.as_ref()?;
    let path = spec
        .host_path
        .as_ref()
        .map(|h| h.path.clone())
        .or_else(|| spec.local.as_ref().map(|l| l.path.clone()))?;
    let size = quantity_bytes(spec.capacity.as_ref()?.get("storage")?).ok()?;
    Some((path.into(), size))
}

/// The stage of a DataVolume whose claim is not bound; selects a node for
/// WaitForFirstConsumer claims unless that is honoured.
pub(super) async fn unbound_stage(
    ctx: &Ctx,
    claim: &PersistentVolumeClaim,
) -> Result<Stage, ControllerError> {
    let name = claim.metadata.name.clone().unwrap_or_default();
    let ns = claim.metadata.namespace.clone().unwrap_or_default();
    let has_node = claim
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(SELECTED_NODE));
    let class_name = claim
        .spec
        .as_ref()
        .and_then(|s| s.storage_class_name.clone());
    let classes: Vec<StorageClass> = ctx.stores.class_list();
    let class = match &class_name {
        Some(c) => classes.iter().find(|k| k.metadata.name.as_ref() == Some(c)),
        None => classes::default_class(&classes),
    };
    let wffc = class.is_some_and(classes::waits_for_consumer);
    if !wffc || has_node {
        return Ok(Stage::ClaimPending {
            message: format!("PVC {name} Pending"),
        });
    }
    if ctx.opts.honor_wait_for_first_consumer {
        return Ok(Stage::WaitForFirstConsumer);
    }
    let Some(node) = pick_node(&ctx.stores) else {
        return Ok(Stage::WaitForFirstConsumer);
    };
    let patch = json!({"metadata": {"annotations": {SELECTED_NODE: node}}});
    Api::<PersistentVolumeClaim>::namespaced(ctx.client.clone(), &ns)
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(Stage::ClaimPending {
        message: format!("PVC {name} Pending: provisioning on node {node}"),
    })
}

/// The first Ready, schedulable node by name (from the Node cache).
fn pick_node(stores: &crate::runtime::stores::Stores) -> Option<String> {
    let mut nodes: Vec<Node> = stores.node_list();
    nodes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    nodes
        .into_iter()
        .filter(|n| n.spec.as_ref().and_then(|s| s.unschedulable) != Some(true))
        .find(|n| {
            n.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .and_then(|n| n.metadata.name)
}

/// Create the DataVolume's claim; `Ok(Err(message))` when its spec cannot be completed.
async fn create_claim(
    ctx: &Ctx,
    dv: &DataVolume,
    spec: &DataVolumeSpec,
    source: &SourceKind,
) -> Result<Result<(), String>, ControllerError> {
    let ns = dv
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let classes: Vec<StorageClass> = ctx.stores.class_list();
    let default = classes::default_class(&classes).and_then(|c| c.metadata.name.clone());
    let class = spec
        .storage
        .as_ref()
        .and_then(|s| s.storage_class_name.clone())
        .or_else(|| default.clone());
    let profile = match &class {
        Some(c) => Api::<Profile>::all(ctx.client.clone())
            .get_opt(c)
            .await?
            .and_then(|p| p.0.status),
        None => None,
    };
    let source_size = match source {
        SourceKind::Pvc { namespace, name } => {
            Api::<PersistentVolumeClaim>::namespaced(ctx.client.clone(), namespace)
                .get_opt(name)
                .await?
                .and_then(|c| c.spec)
                .and_then(|s| s.resources)
                .and_then(|r| r.requests)
                .and_then(|r| r.get("storage").cloned())
        }
        _ => None,
    };
    let claim_spec = match dvd::claim_spec(
        spec,
        profile.as_ref(),
        default.as_deref(),
        source_size.as_ref(),
    ) {
        Ok(s) => s,
        Err(m) => return Ok(Err(m)),
    };
    let claim = dvd::claim_for(dv, claim_spec);
    match Api::<PersistentVolumeClaim>::namespaced(ctx.client.clone(), &ns)
        .create(&PostParams::default(), &claim)
        .await
    {
        Ok(_) => Ok(Ok(())),
        Err(kube::Error::Api(s)) if s.is_already_exists() => Ok(Ok(())),
        Err(kube::Error::Api(s)) if s.code == 422 || s.code == 400 => Ok(Err(s.message)),
        Err(e) => Err(e.into()),
    }
}

fn start_job(ctx: &Arc<Ctx>, uid: &str, clone: bool, work: Work) {
    let job = Arc::new(Job {
        clone,
        progress: Mutex::new(Some(0.0)),
        outcome: Mutex::new(None),
        abort: Mutex::new(None),
        done: tokio::sync::Notify::new(),
    });
    let j = job.clone();
    let handle = tokio::spawn(async move {
        let report = |p: f64| *j.progress.lock().expect("lock") = Some(p);
        let result: Result<(), StorageError> = match work {
            Work::Import(req) => importer::import(&req, report).await.map(drop),
            Work::Registry(req) => ferrovirt_storage::registry::import(&req, report)
                .await
                .map(drop),
            Work::Blank { target, capacity } => importer::blank(&target, capacity).await,
            Work::Clone {
                source: CloneSource::Path(source),
                target,
                capacity,
            } => importer::clone_image(&source, &target, capacity, report).await,
            Work::Clone {
                source: CloneSource::Node { node, volume },
                ..
            } => Err(StorageError::invalid(
                "clone source",
                format!("volume {volume} is on node {node}"),
            )),
            Work::Remote(r) => {
                let RemoteWork {
                    storage,
                    volume,
                    req,
                } = *r;
                let result = storage.populate(&volume, &req, report).await;
                let result = result.map_err(|f| Failure {
                    permanent: f.permanent,
                    message: f.message,
                });
                if let Err(f) = &result {
                    tracing::warn!(clone = j.clone, node = storage.node(), error = %f.message, "node-local volume population failed");
                }
                *j.outcome.lock().expect("lock") = Some(result);
                j.done.notify_one();
                return;
            }
        };
        if let Err(e) = &result {
            tracing::warn!(clone = j.clone, error = %e, "volume population failed");
        }
        *j.outcome.lock().expect("lock") = Some(result.map_err(Failure::from));
        j.done.notify_one();
    });
    *job.abort.lock().expect("lock") = Some(handle.abort_handle());
    ctx.jobs.lock().expect("lock").insert(uid.into(), job);
}

/// Create the DataVolumes of a VM's `dataVolumeTemplates` that do not exist yet (owned by
/// the VM, so they go when it goes). Called by the VM controller on every reconcile.
pub async fn ensure_template_data_volumes(
    client: &kube::Client,
    vm: &ferrovirt_api::kubevirt::vm::VirtualMachine,
) -> Result<(), ControllerError> {
    if vm.metadata.deletion_timestamp.is_some() {
        return Ok(());
    }
    let ns = vm
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let api: Api<Dv> = Api::namespaced(client.clone(), &ns);
    for dv in dvd::from_templates(vm) {
        let name = dv.metadata.name.clone().unwrap_or_default();
        if api.get_opt(&name).await?.is_some() {
            continue;
        }
        match api.create(&PostParams::default(), &Dv(dv)).await {
            Ok(_) => {
                tracing::info!(dv = %format!("{ns}/{name}"), "created DataVolume from template")
            }
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_permanent_only_when_retrying_cannot_help() {
        let f = Failure::from(StorageError::ChecksumMismatch {
            expected: "a".into(),
            actual: "b".into(),
        });
        assert!(f.permanent && f.message.contains("checksum mismatch"));
        assert!(Failure::from(StorageError::Refused("too big".into())).permanent);
        assert!(Failure::from(StorageError::invalid("URL", "x")).permanent);
        let net = Failure::from(StorageError::Http {
            url: "http://x".into(),
            message: "server answered 503".into(),
        });
        assert!(!net.permanent && net.message.contains("503"));
        let refused = StorageError::AddressRefused {
            url: "http://127.0.0.1/x".into(),
            refusal: ferrovirt_storage::netpolicy::Refusal {
                host: "127.0.0.1".into(),
                addr: "127.0.0.1".parse().unwrap(),
                class: ferrovirt_storage::netpolicy::AddressClass::Loopback,
            },
        };
        let f = Failure::from(refused);
        assert!(
            f.permanent && f.message.contains("loopback address"),
            "{}",
            f.message
        );
        let io = StorageError::io("/x", std::io::Error::other("disk full"));
        assert!(!Failure::from(io).permanent);
    }

    #[test]
    fn volume_paths() {
        let pv: PersistentVolume = serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "spec": {"capacity": {"storage": "64Mi"}, "local": {"path": "/l/n1/p"}}
        }))
        .unwrap();
        assert_eq!(
            volume_path_and_size(&pv),
            Some((PathBuf::from("/l/n1/p"), 64 << 20))
        );
        let no_path: PersistentVolume =
            serde_json::from_value(json!({"spec": {"capacity": {"storage": "1Gi"}}})).unwrap();
        assert_eq!(volume_path_and_size(&no_path), None);
    }
}
