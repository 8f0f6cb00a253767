//! The scheduler loop: reads the controllers' shared reflector caches ([`Stores`]: Nodes, VMIs,
//! claims, PVs, StorageClasses; no cache of its own) and on every change of those kinds (and
//! periodically) places each unbound VMI with [`crate::scheduler::schedule`]. Binding writes
//! `status.nodeName`, phase `Scheduled`, condition PodScheduled=True and the
//! `kubevirt.io/nodeName` label in one patch guarded by resourceVersion; a VMI that fits nowhere gets phase Pending, condition
//! PodScheduled=False reason Unschedulable with Kubernetes' message, and a FailedScheduling
//! Event (only when the message changes). Bindings not yet seen in the cache are "assumed"
//! so a VMI is never bound twice and its resources count at once: an assumption lasts until the
//! cache shows that VMI (same uid) bound or gone, however long the cache lags (a binding is
//! never undone, so there is nothing to time out; a timeout let a lagging cache make the
//! scheduler bind again: a refused PATCH and a GET per VMI).
//!
//! A pass decides every pending VMI in creation order over one [`Snapshot`] of the cluster
//! (built once: a decision costs a pass over the nodes, not over every VMI), then writes the
//! binds concurrently ([`WRITE_CONCURRENCY`] in flight) with their `Scheduled` Events, then
//! the unschedulable marks; after [`MARK_CHUNK`] marks, a Node (or claim, PV, class, KubeVirt)
//! change that arrived meanwhile ends the pass's marks and starts the next pass at once
//! ([`marks_yield`]): binds do not wait behind thousands of stale marks.

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector;
use serde_json::json;

use ferrovirt_api::kubevirt::vmi::{VirtualMachineInstance, VmiPhase, vmi_condition};

use super::events::{EventRecorder, object_ref};
use super::resources::Vmi;
use super::stores::{Kind, Stores};
use super::vmi_index::uid;
use crate::conditions;
use crate::error::ControllerError;
use crate::scheduler::{Decision, SchedulerOptions, Snapshot, needs_scheduling};
use crate::vm::template::{KUBEVIRT_API_VERSION, LABEL_NODE_NAME};

/// Component name on Events (Kubernetes' scheduler reports as `default-scheduler`).
pub const COMPONENT: &str = "default-scheduler";
/// Binds (and unschedulable marks) of one pass in flight at once.
const WRITE_CONCURRENCY: usize = 64;
/// Unschedulable marks a pass writes before it looks whether a change that can make VMIs fit
/// arrived meanwhile ([`marks_yield`]).
const MARK_CHUNK: usize = 256;
/// The changes that can make a waiting VMI fit somewhere.
const CAPACITY_KINDS: &[Kind] = &[
    Kind::Node,
    Kind::PersistentVolumeClaim,
    Kind::PersistentVolume,
    Kind::StorageClass,
    Kind::KubeVirt,
];

/// Tunables of the scheduler loop.
#[derive(Debug, Clone)]
pub struct SchedulerLoopOptions {
    pub scheduler: SchedulerOptions,
    /// Schedule pending VMIs at least this often even without changes.
    pub resync: Duration,
}

impl Default for SchedulerLoopOptions {
    fn default() -> Self {
        Self {
            scheduler: SchedulerOptions::default(),
            resync: Duration::from_secs(5),
        }
    }
}

/// A binding written (or being written) that the cache may not show yet: the VMI's namespace
/// and name (to look it up in the cache) and the node. The loop keeps them by uid (as [`super::vmi_index`] knows VMIs):
/// testing a cached VMI against them borrows its uid, no key is formatted per cached VMI
/// (formatting `ns/name` for every cached VMI that still looked unbound was 12 % of the
/// server's CPU at 10,000 VMIs with a lagging cache, docs/scale.md "Ninth pass").
#[derive(Debug, Clone, PartialEq, Eq)]
struct Assumed {
    namespace: String,
    name: String,
    node: String,
}

impl Assumed {
    fn of(vmi: &VirtualMachineInstance, node: String) -> Assumed {
        Assumed {
            namespace: vmi.metadata.namespace.clone().unwrap_or_default(),
            name: vmi.metadata.name.clone().unwrap_or_default(),
            node,
        }
    }
}

/// How often the loop forgets the assumptions and marks the cache has caught up with. Both
/// are only memory: an assumption counts only for a VMI the cache still shows waiting, and a
/// mark only for the resourceVersion it was decided on, so one the cache has passed changes
/// no decision. Forgetting them looked every one up in the cache on every wake-up (14 % of
/// the server's CPU at 10,000 VMIs while a lagging cache held thousands).
const FORGET_EVERY: Duration = Duration::from_secs(1);

/// Whether the binding assumed for the VMI of uid `assumed_uid` must still be remembered,
/// given the VMI of that name as the cache shows it now (pure): while the cache shows the same
/// VMI still waiting for a node.
/// Once it shows the binding (or the VMI finished, is being deleted, was replaced by another
/// of the same name, or is gone) the cache answers by itself.
fn keep_assumption(assumed_uid: &str, cached: Option<&VirtualMachineInstance>) -> bool {
    cached.is_some_and(|v| uid(v) == assumed_uid && needs_scheduling(v))
}

fn key(vmi: &VirtualMachineInstance) -> String {
    format!(
        "{}/{}",
        vmi.metadata.namespace.as_deref().unwrap_or(""),
        vmi.metadata.name.as_deref().unwrap_or("")
    )
}

/// The cache changes that can change a decision.
const WAKE_ON: &[Kind] = &[
    Kind::Vmi,
    Kind::Node,
    Kind::PersistentVolumeClaim,
    Kind::PersistentVolume,
    Kind::StorageClass,
    Kind::KubeVirt,
];

/// Run the scheduler loop over the shared caches `stores` (whose task the caller drives) until
/// the caches are gone or the future is dropped.
pub async fn run(
    client: kube::Client,
    opts: SchedulerLoopOptions,
    stores: Stores,
) -> Result<(), ControllerError> {
    // Subscribed before the first pass: a change during a pass wakes the next one.
    let mut changes = stores.changes();
    let recorder = EventRecorder::new(client.clone(), COMPONENT);
    stores.ready().await;
    let vmis = &stores.vmis;
    // Keyed by uid (see [`Assumed`]).
    let mut assumed: HashMap<String, Assumed> = HashMap::new();
    let mut forgotten_at = tokio::time::Instant::now();
    // Unschedulable marks written here that the cache may not show yet (see [`mark_in_flight`]).
    let mut marked: HashMap<String, Mark> = HashMap::new();
    // Whether the last pass found VMIs to place; with none, a wake-up in which no VMI changed
    // (a Node status patch: ten a second with a hundred nodes) has nothing to place either.
    let mut had_pending = true;
    let mut vmis_changed = true;
    // Changes taken from the queue during a pass's marks (see [`marks_yield`]): the next
    // pass follows at once instead of waiting for them.
    let mut carried = super::stores::Changed::default();
    loop {
        if !must_look(vmis_changed, had_pending) {
            match wait(&mut changes, opts.resync).await {
                Some(v) => vmis_changed = v,
                None => return Ok(()),
            }
            continue;
        }
        // Bindings the cache has not caught up with count as made; those the cache now
        // shows are forgotten (looked up by name: no pass over every VMI), at most once per
        // FORGET_EVERY.
        if forgotten_at.elapsed() >= FORGET_EVERY {
            forgotten_at = tokio::time::Instant::now();
            assumed.retain(|u, a| {
                let r = reflector::ObjectRef::<Vmi>::new(&a.name).within(&a.namespace);
                keep_assumption(u, vmis.get(&r).as_deref().map(|v| &v.0))
            });
            // Marks the cache now shows (the VMI moved past the version they were decided
            // on), or of VMIs gone, are forgotten.
            marked.retain(|k, m| {
                k.split_once('/').is_some_and(|(ns, name)| {
                    let r = reflector::ObjectRef::<Vmi>::new(name).within(ns);
                    vmis.get(&r)
                        .is_some_and(|v| v.0.metadata.resource_version == m.decided_on)
                })
            });
        }
        // Nothing to place — every waiting VMI's binding is assumed — asked of the index of
        // waiting VMIs (no pass over every VMI per VMI change: at 10,000 VMIs that pass was
        // 16 % of the server's CPU while the cache caught up, docs/scale.md): wait.
        let unassumed = stores
            .vmi_index()
            .any_waiting_except(|u| assumed.contains_key(u));
        if !unassumed {
            had_pending = false;
            crate::runtime::metrics::set_depth("scheduler", 0);
            match wait(&mut changes, opts.resync).await {
                Some(v) => vmis_changed = v,
                None => return Ok(()),
            }
            continue;
        }
        // Read only now: the reflector updates the cache concurrently, so a copy taken before
        // the assumptions were checked could still show a VMI unbound whose binding the check
        // just saw (and forgot), and the VMI would be bound again with its old
        // resourceVersion (a 409). The cache only moves forward: this copy shows every
        // binding the check saw.
        let cached = vmis.state();
        let mut pending: Vec<&VirtualMachineInstance> = Vec::new();
        let mut assumed_here: Vec<(&VirtualMachineInstance, String)> = Vec::new();
        for v in cached.iter().map(|v| &v.0).filter(|v| needs_scheduling(v)) {
            match assumed.get(uid(v)) {
                Some(a) => assumed_here.push((v, a.node.clone())),
                None => pending.push(v),
            }
        }
        let pass_us = boottime_us();
        crate::runtime::metrics::set_depth("scheduler", pending.len());
        had_pending = !pending.is_empty();
        if pending.is_empty() {
            // Nothing to place: no snapshot (a pass over every VMI) on this wake-up.
            match wait(&mut changes, opts.resync).await {
                Some(v) => vmis_changed = v,
                None => return Ok(()),
            }
            continue;
        }
        // Copied only when there is something to place (a wake-up per Node status patch
        // otherwise copies every Node for nothing).
        let node_list = stores.node_list();
        // One snapshot for the whole pass: every decision counts the ones before it.
        // The KubeVirt CR's overcommit settings as they are now.
        let kubevirt = stores.kubevirt();
        let sched_opts = SchedulerOptions {
            overcommit: stores.overcommit(),
            obsolete_cpu_models: stores.obsolete_cpu_models(),
            workloads: kubevirt.workloads.clone(),
            ..opts.scheduler.clone()
        };
        let mut snap = Snapshot::new(&node_list, cached.iter().map(|v| &v.0), &sched_opts);
        for (v, node) in &assumed_here {
            snap.assume(v, node);
        }
        pending.sort_by_key(|v| (v.metadata.creation_timestamp.clone(), key(v)));
        let mut binds = Vec::new();
        let mut unschedulable = Vec::new();
        for v in pending {
            let (affinity, shared_mounts, deleting) = volume_constraints(&client, &stores, v).await;
            // A claim being deleted is never given a new user (as Kubernetes' VolumeBinding
            // pre-filter): the VMI waits, unschedulable, naming it.
            if let Some(message) =
                crate::scheduler::volumes::deleting_claim_message(&deleting, snap.node_count())
            {
                unschedulable.push((v, message));
                continue;
            }
            // KubeVirt's render-time rule: a device the cluster does not permit.
            let refused = v.spec.as_ref().map_or_else(Vec::new, |spec| {
                ferrovirt_api::kubevirt::host_devices::not_permitted(
                    spec,
                    kubevirt.permitted_host_devices.as_ref(),
                )
            });
            if !refused.is_empty() {
                let message = format!("failed to render launch manifest: {}", refused.join(" "));
                unschedulable.push((v, message));
                continue;
            }
            match snap.schedule(v, &affinity, &shared_mounts) {
                Decision::Bind { node } => {
                    snap.assume(v, &node);
                    assumed.insert(uid(v).to_owned(), Assumed::of(v, node.clone()));
                    binds.push((v, node));
                }
                Decision::Unschedulable(fit) => unschedulable.push((v, fit.to_string())),
            }
        }
        // The writes of the pass, WRITE_CONCURRENCY at a time: decisions are made in
        // order above, only the API round trips overlap. A failed bind forgets its
        // assumption, so the next pass decides that VMI again from the cache.
        let mut outcomes = Vec::new();
        let mut inflight = futures::stream::FuturesUnordered::new();
        let bound_any = !binds.is_empty();
        for (v, node) in binds {
            inflight.push(bind_and_record(&client, &recorder, v, node, pass_us));
            if inflight.len() >= WRITE_CONCURRENCY
                && let Some(o) = inflight.next().await
            {
                outcomes.push(o);
            }
        }
        while let Some(o) = inflight.next().await {
            outcomes.push(o);
        }
        // A VMI found bound already counts where it is; a failed bind is decided again.
        for (k, outcome) in outcomes {
            match outcome {
                BindOutcome::Bound(node) => {
                    if let Some(a) = assumed.get_mut(&k) {
                        a.node = node;
                    }
                }
                BindOutcome::Failed => {
                    assumed.remove(&k);
                }
            }
        }
        let now = Timestamp::now();
        let mut inflight = futures::stream::FuturesUnordered::new();
        let mut failed = Vec::new();
        let mut written = 0usize;
        for (v, message) in unschedulable {
            let k = key(v);
            if mark_in_flight(marked.get(&k), v, &message)
                || !remark_needed(v, &message, bound_any, now)
            {
                continue;
            }
            if written >= MARK_CHUNK {
                match changes.take_queued(WAKE_ON) {
                    Some(c) => carried.merge(c),
                    None => return Ok(()),
                }
                if marks_yield(written, &carried) {
                    // The rest is decided again, on the new state, by the next pass.
                    tracing::debug!(written, "unschedulable marks yield to a new pass");
                    break;
                }
            }
            written += 1;
            marked.insert(
                k,
                Mark {
                    decided_on: v.metadata.resource_version.clone(),
                    message: message.clone(),
                },
            );
            inflight.push(mark_unschedulable_logged(&client, &recorder, v, message));
            if inflight.len() >= WRITE_CONCURRENCY
                && let Some(Some(k)) = inflight.next().await
            {
                failed.push(k);
            }
        }
        while let Some(f) = inflight.next().await {
            failed.extend(f);
        }
        // A failed mark is decided again by the next pass.
        for k in failed {
            marked.remove(&k);
        }
        if !carried.is_empty() {
            vmis_changed = carried.contains(Kind::Vmi);
            carried = super::stores::Changed::default();
            continue;
        }
        match wait(&mut changes, opts.resync).await {
            Some(v) => vmis_changed = v,
            None => return Ok(()),
        }
    }
}

/// Whether a pass stops writing unschedulable marks after `written` of them because
/// `queued` (the changes that arrived meanwhile) can make VMIs fit (pure): only after
/// [`MARK_CHUNK`] marks, so that every pass makes progress however often Nodes change, and
/// only for a change of a [`CAPACITY_KINDS`] kind (a VMI change, such as the marks' own
/// writes, does not make room). Marks are the least urgent writes of a pass: when nodes are
/// uncordoned one by one, the first pass sees all but one still cordoned and every waiting
/// VMI's message changes; writing all of them (2,000 PATCHes in the benchmark's backlog, ~3 s)
/// before the next pass delayed every bind by as much (docs/scale.md, eighth pass). The
/// marks not written are not remembered: the next pass decides those VMIs again.
fn marks_yield(written: usize, queued: &super::stores::Changed) -> bool {
    written >= MARK_CHUNK && CAPACITY_KINDS.iter().any(|k| queued.contains(*k))
}

/// An unschedulable mark this loop wrote: the VMI's resourceVersion it was decided on and
/// the message written.
struct Mark {
    decided_on: Option<String>,
    message: String,
}

/// Whether `vmi` (as cached), unschedulable with `message`, was marked so already by this
/// loop and the cache just does not show it yet (pure): the cached VMI is still the version
/// the mark was decided on. While VMIs stream in, each one's change wakes a pass, and every
/// VMI marked a moment before still looks unmarked in the cache: without this each was
/// written again (a PATCH and an Event) by every pass until its watch event arrived.
fn mark_in_flight(mark: Option<&Mark>, vmi: &VirtualMachineInstance, message: &str) -> bool {
    mark.is_some_and(|m| m.decided_on == vmi.metadata.resource_version && m.message == message)
}

/// How stale an unschedulable VMI's message may get while other VMIs are being bound.
const REMARK_AFTER: std::time::Duration = std::time::Duration::from_secs(30);

/// Whether `vmi`, unschedulable in this pass with `message`, must be written (pure, `now`
/// given): always when it is not marked Pending + PodScheduled=False yet, never when the
/// message is the same; a changed message is written at once when the pass bound nothing,
/// and otherwise only once the last write (`lastProbeTime`) is [`REMARK_AFTER`] old. While a
/// backlog drains, each pass binds some VMIs and changes the message of all the others ("N
/// node(s) didn't have free …" counts): rewriting every waiting VMI (a PATCH and an Event
/// each) per pass cost more than the binds and made binds conflict with the marks (a 409 and
/// a GET each). Kubernetes' scheduler likewise backs a pod that failed off before trying it
/// (and writing its condition) again.
fn remark_needed(
    vmi: &VirtualMachineInstance,
    message: &str,
    pass_bound_any: bool,
    now: Timestamp,
) -> bool {
    let current = conditions::find(
        vmi.status.as_ref().and_then(|s| s.conditions.as_deref()),
        vmi_condition::POD_SCHEDULED,
    );
    let phase = vmi.status.as_ref().and_then(|s| s.phase);
    let Some(c) = current.filter(|c| c.status == "False" && phase == Some(VmiPhase::Pending))
    else {
        return true;
    };
    if c.message.as_deref() == Some(message) {
        return false;
    }
    if !pass_bound_any {
        return true;
    }
    c.last_probe_time
        .as_ref()
        .is_none_or(|t| now.duration_since(t.0).as_secs_f64() >= REMARK_AFTER.as_secs_f64())
}

/// Whether a wake-up needs a look at every cached VMI (pure): when a VMI changed (a new one
/// to place, a binding to confirm) or the last look left VMIs unplaced (a Node or claim change
/// may make them fit). Otherwise no VMI waits and none came.
fn must_look(vmis_changed: bool, had_pending: bool) -> bool {
    vmis_changed || had_pending
}

/// Waits for a change of a kind in [`WAKE_ON`] or `resync`, then takes every change already
/// queued (one pass covers them all). `Some(whether VMIs may have changed)`: a resync counts
/// as a VMI change, so every VMI is looked at once per `resync` whatever happened. `None`
/// once the caches are gone.
async fn wait(changes: &mut super::stores::Changes, resync: Duration) -> Option<bool> {
    match tokio::time::timeout(resync, changes.next_batch(WAKE_ON)).await {
        Ok(None) => None,
        Ok(Some(c)) => Some(c.contains(Kind::Vmi)),
        Err(_) => changes.drain().then_some(true),
    }
}

/// Microseconds since boot (CLOCK_BOOTTIME), the clock of the start-path timing
/// (docs/scale.md "Start path"): the "bound" log line carries when the pass began
/// (`pass_us`) and when the bind was written (`bound_us`).
fn boottime_us() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    u64::try_from(t.tv_sec).unwrap_or(0) * 1_000_000 + u64::try_from(t.tv_nsec).unwrap_or(0) / 1000
}

/// How a bind ended: the node the VMI is bound to now, or a failure (the next pass decides
/// that VMI again).
#[derive(Debug, Clone, PartialEq, Eq)]
enum BindOutcome {
    Bound(String),
    Failed,
}

/// What to do after a bind was refused with a conflict, from the VMI as the API has it now
/// (pure): bound already (a binding the cache had not shown yet: nothing to write), still
/// waiting (bind again with its current resourceVersion), or neither (gone, finished or being
/// deleted: give up).
fn after_conflict(fresh: Option<&VirtualMachineInstance>) -> Option<Result<String, ()>> {
    let fresh = fresh?;
    if let Some(node) = crate::scheduler::is_bound(fresh) {
        return Some(Ok(node.to_string()));
    }
    needs_scheduling(fresh).then_some(Err(()))
}

/// Binds `vmi` to `node` and records the `Scheduled` Event. A bind refused with a conflict (the
/// cached copy was older than the API's) reads the VMI again: found bound, it counts as bound
/// there; still waiting, it is bound once more with the current resourceVersion. Returns the
/// VMI's uid (its assumption's key) with the outcome.
async fn bind_and_record(
    client: &kube::Client,
    recorder: &EventRecorder,
    vmi: &VirtualMachineInstance,
    node: String,
    pass_us: u64,
) -> (String, BindOutcome) {
    let mut result = bind(client, vmi, &node).await;
    if let Err(kube::Error::Api(s)) = &result
        && s.code == 409
    {
        let name = vmi.metadata.name.as_deref().unwrap_or("");
        let fresh = vmi_api(client, vmi).get_opt(name).await.ok().flatten();
        match after_conflict(fresh.as_ref().map(|f| &f.0)) {
            Some(Ok(bound_to)) => {
                tracing::debug!(vmi = %key(vmi), node = %bound_to, "bind conflict: already bound");
                return (uid(vmi).to_owned(), BindOutcome::Bound(bound_to));
            }
            Some(Err(())) => {
                if let Some(f) = &fresh {
                    result = bind(client, &f.0, &node).await;
                }
            }
            None => {}
        }
    }
    match result {
        Ok(()) => {
            let bound_us = boottime_us();
            tracing::info!(vmi = %key(vmi), %node, pass_us, bound_us, "bound");
            let reference = object_ref(
                KUBEVIRT_API_VERSION,
                "VirtualMachineInstance",
                &vmi.metadata,
            );
            let msg = format!("Successfully assigned {} to {node}", key(vmi));
            // Recorded beside the pass, not in it: the next binds do not wait for the Event's
            // round trip (the pass's throughput was 32 / (bind + Event) a second).
            let recorder = recorder.clone();
            tokio::spawn(async move {
                recorder.record(&reference, false, "Scheduled", &msg).await;
            });
            (uid(vmi).to_owned(), BindOutcome::Bound(node))
        }
        Err(e) => {
            tracing::warn!(vmi = %key(vmi), error = %e, "binding failed");
            (uid(vmi).to_owned(), BindOutcome::Failed)
        }
    }
}

/// [`mark_unschedulable`], a failure logged: the VMI's key when it failed.
async fn mark_unschedulable_logged(
    client: &kube::Client,
    recorder: &EventRecorder,
    vmi: &VirtualMachineInstance,
    message: String,
) -> Option<String> {
    let e = mark_unschedulable(client, recorder, vmi, &message)
        .await
        .err()?;
    tracing::warn!(vmi = %key(vmi), error = %e, "recording unschedulable failed");
    Some(key(vmi))
}

/// The node affinity of the PVs the VMI's claims are bound to, the claims whose class
/// keeps volumes on a declared shared filesystem, and the claims being deleted (lookup errors add no constraint and the
/// agent reports a volume it cannot find). Read from the shared caches where a cached copy
/// cannot be out of date in a way that matters: a claim already bound (its `volumeName`
/// never changes again), its PV and the classes by name; a claim the cache does not hold or
/// holds unbound (it may have been bound since), a PV or class it does not hold, and every
/// lookup before the caches are ready are read from the API, as before.
pub(crate) async fn volume_constraints(
    client: &kube::Client,
    stores: &Stores,
    vmi: &VirtualMachineInstance,
) -> (
    Vec<k8s_openapi::api::core::v1::NodeSelector>,
    Vec<crate::scheduler::volumes::SharedMountNeed>,
    Vec<String>,
) {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    use k8s_openapi::api::storage::v1::StorageClass;
    let claim_names = crate::storage::pvc_loop::claims_of(vmi);
    if claim_names.is_empty() {
        return (Vec::new(), Vec::new(), Vec::new());
    }
    let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
    let claims_api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let pvs_api: Api<PersistentVolume> = Api::all(client.clone());
    let bound_to = |c: &PersistentVolumeClaim| c.spec.as_ref().and_then(|s| s.volume_name.clone());
    let (mut claims, mut pvs) = (Vec::new(), Vec::new());
    let cached = stores.is_ready();
    for name in claim_names {
        let claim = match stores
            .pvc(ns, &name)
            .filter(|c| cached_claim_will_do(cached, c))
        {
            Some(c) => (*c).clone(),
            None => match claims_api.get_opt(&name).await {
                Ok(Some(c)) => c,
                _ => continue,
            },
        };
        if let Some(v) = bound_to(&claim) {
            let from_cache = stores
                .pvs
                .get(&reflector::ObjectRef::new(&v))
                .filter(|_| cached);
            match from_cache {
                Some(pv) => pvs.push((*pv).clone()),
                None => {
                    if let Ok(Some(pv)) = pvs_api.get_opt(&v).await {
                        pvs.push(pv);
                    }
                }
            }
        }
        claims.push(claim);
    }
    // The classes named by the claims or their PVs; a claim naming none uses the default class.
    let mut names: Vec<Option<String>> = claims
        .iter()
        .map(|c| {
            let pv_class = pvs
                .iter()
                .find(|pv| pv.metadata.name.is_some() && pv.metadata.name == bound_to(c))
                .and_then(|pv| pv.spec.as_ref()?.storage_class_name.clone());
            pv_class.or_else(|| c.spec.as_ref()?.storage_class_name.clone())
        })
        .collect();
    names.sort();
    names.dedup();
    let class_api: Api<StorageClass> = Api::all(client.clone());
    let mut classes = Vec::new();
    if names.iter().any(Option::is_none) {
        classes = if cached {
            stores.class_list()
        } else {
            class_api
                .list(&Default::default())
                .await
                .map(|l| l.items)
                .unwrap_or_default()
        };
    } else {
        for name in names.into_iter().flatten() {
            let from_cache = stores
                .classes
                .get(&reflector::ObjectRef::new(&name))
                .filter(|_| cached);
            match from_cache {
                Some(c) => classes.push((*c).clone()),
                None => {
                    if let Ok(Some(c)) = class_api.get_opt(&name).await {
                        classes.push(c);
                    }
                }
            }
        }
    }
    (
        crate::scheduler::volumes::required_selectors(&claims, &pvs),
        crate::scheduler::volumes::shared_mount_needs(&claims, &pvs, &classes),
        crate::scheduler::volumes::deleting_claims(&claims),
    )
}

/// Whether the scheduler may use the cached copy of a claim (pure): only once the caches are
/// ready and only when the claim is bound — a bound claim's `volumeName` never changes again,
/// an unbound one may have been bound since the cache saw it.
fn cached_claim_will_do(
    caches_ready: bool,
    claim: &k8s_openapi::api::core::v1::PersistentVolumeClaim,
) -> bool {
    caches_ready
        && claim
            .spec
            .as_ref()
            .and_then(|s| s.volume_name.as_deref())
            .is_some_and(|v| !v.is_empty())
}

fn vmi_api(client: &kube::Client, vmi: &VirtualMachineInstance) -> Api<Vmi> {
    Api::namespaced(
        client.clone(),
        vmi.metadata.namespace.as_deref().unwrap_or("default"),
    )
}

fn conditions_with(
    vmi: &VirtualMachineInstance,
    new: ferrovirt_api::kubevirt::vmi::Condition,
) -> serde_json::Value {
    let mut conds = vmi
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    conditions::set(&mut conds, new, &Time(Timestamp::now()));
    serde_json::to_value(conds).unwrap_or_default()
}

/// Bind: one merge patch writing `status.nodeName`, phase Scheduled, PodScheduled=True and
/// the `kubevirt.io/nodeName` label (KubeVirt's VMI has no `/status` subresource: its status
/// is written on the object).
async fn bind(
    client: &kube::Client,
    vmi: &VirtualMachineInstance,
    node: &str,
) -> Result<(), kube::Error> {
    let name = vmi.metadata.name.as_deref().unwrap_or("");
    let conds = conditions_with(
        vmi,
        conditions::condition(vmi_condition::POD_SCHEDULED, true, None, None),
    );
    let patch = json!({
        "metadata": {
            "labels": {LABEL_NODE_NAME: node},
            "resourceVersion": vmi.metadata.resource_version,
        },
        "status": {"nodeName": node, "phase": "Scheduled", "conditions": conds}
    });
    vmi_api(client, vmi)
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// Record that no node fits, unless the VMI already says exactly that.
async fn mark_unschedulable(
    client: &kube::Client,
    recorder: &EventRecorder,
    vmi: &VirtualMachineInstance,
    message: &str,
) -> Result<(), kube::Error> {
    let current = conditions::find(
        vmi.status.as_ref().and_then(|s| s.conditions.as_deref()),
        vmi_condition::POD_SCHEDULED,
    );
    let phase = vmi.status.as_ref().and_then(|s| s.phase);
    if current.is_some_and(|c| c.status == "False" && c.message.as_deref() == Some(message))
        && phase == Some(VmiPhase::Pending)
    {
        return Ok(());
    }
    // When this was last written, as Kubernetes' scheduler stamps PodScheduled
    // (`remark_needed` reads it).
    let previous = current
        .filter(|c| c.status == "False" && phase == Some(VmiPhase::Pending))
        .and_then(|c| c.message.as_deref());
    let event = event_needed(previous, message);
    let mut cond = conditions::condition(
        vmi_condition::POD_SCHEDULED,
        false,
        Some("Unschedulable"),
        Some(message),
    );
    cond.last_probe_time = Some(Time(Timestamp::now()));
    let conds = conditions_with(vmi, cond);
    let status = json!({"status": {"phase": "Pending", "conditions": conds}});
    let name = vmi.metadata.name.as_deref().unwrap_or("");
    vmi_api(client, vmi)
        .patch(name, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    let reference = object_ref(
        KUBEVIRT_API_VERSION,
        "VirtualMachineInstance",
        &vmi.metadata,
    );
    if event {
        recorder
            .record(&reference, true, "FailedScheduling", message)
            .await;
    }
    Ok(())
}

/// Whether a new unschedulable mark with `message` also records a FailedScheduling Event
/// (pure), `previous` being the message of the mark the VMI shows (None: not marked). A mark
/// whose message differs from the previous one only in its counts ("0/100 nodes are
/// available: 37 Insufficient memory" → "… 41 …") updates the condition but records no Event:
/// while a backlog drains every waiting VMI's counts change with each bind, and an Event per
/// change was most of the scheduler's writes (docs/scale.md). A new reason — another kind of
/// misfit, another selector — is a new Event.
fn event_needed(previous: Option<&str>, message: &str) -> bool {
    previous.is_none_or(|p| message_shape(p) != message_shape(message))
}

/// `message` with each run of digits replaced by `#`.
fn message_shape(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut in_digits = false;
    for c in message.chars() {
        if c.is_ascii_digit() {
            if !in_digits {
                out.push('#');
            }
            in_digits = true;
        } else {
            out.push(c);
            in_digits = false;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{PersistentVolumeClaim, PersistentVolumeClaimSpec};

    fn claim(volume: Option<&str>) -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            spec: Some(PersistentVolumeClaimSpec {
                volume_name: volume.map(String::from),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn waiting_vmis_are_not_rewritten_per_pass_while_others_are_bound() {
        use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
        use k8s_openapi::jiff::{SignedDuration, Timestamp};
        let now: Timestamp = "2026-12-04T12:00:00Z".parse().unwrap();
        let marked = |msg: &str, probed: Timestamp| -> VirtualMachineInstance {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "a", "namespace": "ns"},
                "spec": {"domain": {"devices": {}}},
                "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled",
                    "status": "False", "reason": "Unschedulable", "message": msg,
                    "lastProbeTime": probed.to_string()}]}
            }))
            .unwrap()
        };
        let fresh: VirtualMachineInstance = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "a", "namespace": "ns"},
            "spec": {"domain": {"devices": {}}}
        }))
        .unwrap();
        // Not marked yet: always written, binds or not.
        assert!(super::remark_needed(&fresh, "m", true, now));
        let recent = marked("old", now - SignedDuration::from_secs(3));
        // The same message: never.
        assert!(!super::remark_needed(&recent, "old", false, now));
        // A new message: at once when nothing was bound; while others are bound, not before
        // the last write is 30 s old.
        assert!(super::remark_needed(&recent, "new", false, now));
        assert!(!super::remark_needed(&recent, "new", true, now));
        let stale = marked("old", now - SignedDuration::from_secs(31));
        assert!(super::remark_needed(&stale, "new", true, now));
    }

    #[test]
    fn a_mark_the_cache_does_not_show_yet_is_not_written_again() {
        let mut v: super::VirtualMachineInstance = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "v", "namespace": "d", "resourceVersion": "7"}
        }))
        .unwrap();
        let mark = super::Mark {
            decided_on: Some("7".into()),
            message: "0/3 nodes are available".into(),
        };
        assert!(super::mark_in_flight(
            Some(&mark),
            &v,
            "0/3 nodes are available"
        ));
        // Another message is a new decision; no mark, nothing in flight.
        assert!(!super::mark_in_flight(
            Some(&mark),
            &v,
            "0/4 nodes are available"
        ));
        assert!(!super::mark_in_flight(None, &v, "0/3 nodes are available"));
        // The cache moved on (our write, or another): decided from the cache again.
        v.metadata.resource_version = Some("8".into());
        assert!(!super::mark_in_flight(
            Some(&mark),
            &v,
            "0/3 nodes are available"
        ));
    }

    #[test]
    fn a_mark_whose_counts_changed_records_no_new_event() {
        let a = "0/100 nodes are available: 37 Insufficient memory, 63 node(s) didn't match Pod's node affinity/selector.";
        let b = "0/100 nodes are available: 41 Insufficient memory, 59 node(s) didn't match Pod's node affinity/selector.";
        let c = "0/100 nodes are available: 100 Insufficient cpu.";
        // First mark: an Event.
        assert!(super::event_needed(None, a));
        // Only the counts changed: none.
        assert!(!super::event_needed(Some(a), b));
        assert!(!super::event_needed(Some(a), a));
        // Another reason: an Event.
        assert!(super::event_needed(Some(a), c));
        assert_eq!(super::message_shape("0/12 x 3"), "#/# x #");
    }

    #[test]
    fn marks_yield_to_a_capacity_change_after_a_chunk() {
        use super::super::stores::{Changed, Kind};
        let node = Changed::of(&[Kind::Node]);
        let vmi = Changed::of(&[Kind::Vmi]);
        // Every pass writes a chunk whatever arrived.
        assert!(!super::marks_yield(0, &node));
        assert!(!super::marks_yield(super::MARK_CHUNK - 1, &node));
        // Then a Node (claim, PV, class, KubeVirt) change ends the marks.
        assert!(super::marks_yield(super::MARK_CHUNK, &node));
        assert!(super::marks_yield(
            super::MARK_CHUNK,
            &Changed::of(&[Kind::PersistentVolumeClaim])
        ));
        assert!(super::marks_yield(
            super::MARK_CHUNK,
            &Changed::everything()
        ));
        // VMI changes (the marks' own writes among them) or nothing: go on marking.
        assert!(!super::marks_yield(super::MARK_CHUNK, &vmi));
        assert!(!super::marks_yield(
            10 * super::MARK_CHUNK,
            &Changed::default()
        ));
    }

    #[test]
    fn node_only_wake_ups_look_at_the_vmis_only_while_some_wait() {
        // Nothing waiting and no VMI changed (a Node status patch): no pass over the VMIs.
        assert!(!super::must_look(false, false));
        // A VMI changed (a new one, a binding to confirm), or some wait for a Node to fit.
        assert!(super::must_look(true, false));
        assert!(super::must_look(false, true));
        assert!(super::must_look(true, true));
    }

    #[test]
    fn a_conflicting_bind_is_settled_from_the_vmi_as_it_is_now() {
        use ferrovirt_api::kubevirt::vmi::{VirtualMachineInstance, VmiPhase};
        let mut v: VirtualMachineInstance = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "a", "namespace": "ns"},
            "spec": {"domain": {"devices": {}}}
        }))
        .unwrap();
        // Gone: give up.
        assert_eq!(super::after_conflict(None), None);
        // Still waiting (someone else changed it): bind again.
        assert_eq!(super::after_conflict(Some(&v)), Some(Err(())));
        // Bound already (our earlier bind, not yet in the cache): counts as bound there.
        let status = v.status.get_or_insert_default();
        status.node_name = Some("n1".into());
        status.phase = Some(VmiPhase::Scheduled);
        assert_eq!(super::after_conflict(Some(&v)), Some(Ok("n1".into())));
        // Finished: neither.
        v.status.as_mut().unwrap().phase = Some(VmiPhase::Succeeded);
        assert_eq!(super::after_conflict(Some(&v)), None);
    }

    #[test]
    fn an_assumed_binding_lasts_until_the_cache_shows_it_however_late() {
        use ferrovirt_api::kubevirt::vmi::{VirtualMachineInstance, VmiPhase};
        let waiting: VirtualMachineInstance = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "a", "namespace": "ns", "uid": "u1"},
            "spec": {"domain": {"devices": {}}}
        }))
        .unwrap();
        let a = "u1";
        // The cache still shows the VMI waiting (it lags our bind): keep it, with no time
        // limit, so the VMI is not bound a second time.
        assert!(super::keep_assumption(a, Some(&waiting)));
        // The cache shows the binding: forget it.
        let mut bound = waiting.clone();
        let st = bound.status.get_or_insert_default();
        st.node_name = Some("n1".into());
        st.phase = Some(VmiPhase::Scheduled);
        assert!(!super::keep_assumption(a, Some(&bound)));
        // Gone, or replaced by another VMI of the same name: forget it.
        assert!(!super::keep_assumption(a, None));
        let mut other = waiting.clone();
        other.metadata.uid = Some("u2".into());
        assert!(!super::keep_assumption(a, Some(&other)));
    }

    #[test]
    fn only_a_bound_claim_from_ready_caches_is_used_from_the_cache() {
        assert!(super::cached_claim_will_do(true, &claim(Some("pv-1"))));
        assert!(!super::cached_claim_will_do(false, &claim(Some("pv-1"))));
        assert!(!super::cached_claim_will_do(true, &claim(None)));
        assert!(!super::cached_claim_will_do(true, &claim(Some(""))));
        assert!(!super::cached_claim_will_do(
            true,
            &PersistentVolumeClaim::default()
        ));
    }
}
