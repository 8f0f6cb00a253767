//! A simulated node agent (benchmark harness only, see the crate doc): the real agent's API
//! traffic for a node whose VMIs all start at once, without launchers or QEMU.
//!
//! What is the agent's own code: the Node and Lease objects ([`ferrovirt_agent::node`]), the
//! watch's field selector ([`ferrovirt_agent::runtime::vmi_selector`]) and every per-VMI decision
//! and status ([`ferrovirt_agent::decide::decide`]). What is the harness's: a pretend launcher
//! that is Running the moment it is started ([`pretend_launcher`]) and stops the moment it is
//! asked, and the loop below that applies the decisions in the order the agent's runtime does
//! (finalizer and `Started` Event; on the next watch event the Running status, its phase Event
//! and the pid annotations; on deletion the finalizer comes off).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrovirt_agent::decide::{self, Action, FINALIZER, Observed, Report};
use ferrovirt_agent::node::{self, HostFacts, LEASE_NAMESPACE};
use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_launcher::control::{LauncherStatus, RunPhase};
use ferrovirt_launcher::spec::Accel;
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Namespace, Node};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::runtime::reflector::{self, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::{Value, json};

/// Errors of the harness.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("API: {0}")]
    Kube(#[from] kube::Error),
    #[error("store: {0}")]
    Store(#[from] ferrovirt_store::StoreError),
    #[error("sqlite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("{0}")]
    Other(String),
}

/// Attempts of a VMI write that fails in transport.
const PATCH_ATTEMPTS: u32 = 5;

/// The annotation the benchmark writes to measure watch delivery: nanoseconds since the
/// harness process's [`Probes::epoch`] at the moment the write was sent.
pub const PROBE_ANNOTATION: &str = "bench.ferrovirt.io/probe-sent-ns";

/// VMIs per simulated node the Node advertises room for (`pods` capacity).
pub const SIM_PODS: u32 = 1000;

/// Write-to-event latencies seen by the simulated nodes' watches.
#[derive(Debug)]
pub struct Probes {
    pub epoch: Instant,
    seen: Mutex<HashSet<(String, String)>>,
    latencies: Mutex<Vec<Duration>>,
    /// When each probe value was first delivered, since the epoch.
    delivered: Mutex<HashMap<String, Duration>>,
    /// When each probe value's write was acknowledged, since the epoch.
    acked: Mutex<HashMap<String, Duration>>,
}

impl Default for Probes {
    fn default() -> Self {
        Probes {
            epoch: Instant::now(),
            seen: Mutex::new(HashSet::new()),
            latencies: Mutex::new(Vec::new()),
            delivered: Mutex::new(HashMap::new()),
            acked: Mutex::new(HashMap::new()),
        }
    }
}

/// One probe's timeline, each instant since [`Probes::epoch`]: sent (the stamp), its write
/// acknowledged (the PATCH response read), delivered by the node's watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeTimes {
    pub sent: Duration,
    pub acked: Option<Duration>,
    pub delivered: Option<Duration>,
}

impl ProbeTimes {
    /// Sent → acknowledged: the PATCH request path (admission, store commit, response).
    pub fn ack_latency(&self) -> Option<Duration> {
        self.acked.map(|a| a.saturating_sub(self.sent))
    }

    /// Acknowledged → delivered: the watch fan-out and the node's stream after the commit
    /// (zero when the watch delivered before the response was read).
    pub fn after_ack(&self) -> Option<Duration> {
        Some(self.delivered?.saturating_sub(self.acked?))
    }
}

impl Probes {
    /// The probe value to write now.
    pub fn stamp(&self) -> String {
        self.epoch.elapsed().as_nanos().to_string()
    }

    /// Records the latency of a probe seen on a VMI (once per uid and value).
    pub fn observe(
        &self,
        uid: &str,
        annotations: Option<&std::collections::BTreeMap<String, String>>,
    ) {
        let Some(v) = annotations.and_then(|a| a.get(PROBE_ANNOTATION)) else {
            return;
        };
        let now = self.epoch.elapsed();
        if let Some(lat) = probe_latency(v, now)
            && lock(&self.seen).insert((uid.to_string(), v.clone()))
        {
            lock(&self.latencies).push(lat);
            lock(&self.delivered).entry(v.clone()).or_insert(now);
        }
    }

    /// Records that the write of probe `value` was acknowledged now.
    pub fn ack(&self, value: &str) {
        let now = self.epoch.elapsed();
        lock(&self.acked).insert(value.to_string(), now);
    }

    /// Every probe written (acknowledged or delivered), in the order sent.
    pub fn timelines(&self) -> Vec<ProbeTimes> {
        let acked = lock(&self.acked).clone();
        let delivered = lock(&self.delivered).clone();
        let mut values: Vec<&String> = acked.keys().chain(delivered.keys()).collect();
        values.sort();
        values.dedup();
        let mut out: Vec<ProbeTimes> = values
            .into_iter()
            .filter_map(|v| {
                Some(ProbeTimes {
                    sent: Duration::from_nanos(v.parse().ok()?),
                    acked: acked.get(v).copied(),
                    delivered: delivered.get(v).copied(),
                })
            })
            .collect();
        out.sort_by_key(|t| t.sent);
        out
    }

    /// Every latency recorded so far.
    pub fn latencies(&self) -> Vec<Duration> {
        lock(&self.latencies).clone()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The latency of a probe written at `sent` (nanoseconds since the epoch) and seen at `now`;
/// `None` for a value that is not a number or lies in the future.
pub fn probe_latency(sent: &str, now: Duration) -> Option<Duration> {
    let ns: u64 = sent.parse().ok()?;
    now.checked_sub(Duration::from_nanos(ns))
}

/// The host facts a simulated node reports: a large TCG host, so that 100 VMIs of the benchmark
/// fit on every node with room to spare.
pub fn sim_facts(name: &str) -> HostFacts {
    HostFacts {
        hostname: name.to_string(),
        cpus: 64,
        memory_bytes: 512 << 30,
        cpu_model: "simulated".into(),
        cpu_flags: vec![],
        accel: Accel::Tcg,
        kernel_version: "simulated".into(),
        os_image: "ferrovirt-simnodes (benchmark harness)".into(),
        address: "127.0.0.1".into(),
    }
}

/// The Node a simulated node registers: the agent's [`node::node_object`] with room for
/// [`SIM_PODS`] VMIs and a `ferrovirt.io/simulated` label saying what it is.
pub fn sim_node(name: &str, now: Timestamp) -> Node {
    let mut n = node::node_object(name, &sim_facts(name), "", "", now);
    n.metadata
        .labels
        .get_or_insert_default()
        .insert("ferrovirt.io/simulated".into(), "true".into());
    let status = n.status.get_or_insert_default();
    for list in [&mut status.capacity, &mut status.allocatable] {
        list.get_or_insert_default()
            .insert("pods".into(), Quantity(SIM_PODS.to_string()));
    }
    n
}

/// What the pretend launcher of a started VMI reports: Running, no guest agent.
pub fn pretend_launcher(uid: &str, pid: u32) -> LauncherStatus {
    LauncherStatus {
        version: 1,
        launcher_pid: pid,
        qemu_pid: Some(pid + 1),
        vmi_uid: uid.to_string(),
        phase: RunPhase::Running,
        guest_agent_connected: false,
        started_at: 0,
        fs_frozen: false,
    }
}

fn vmi_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstance"),
        "virtualmachineinstances",
    )
}

fn now_string() -> String {
    Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// How a simulated node runs.
#[derive(Debug, Clone)]
pub struct SimNodeOptions {
    pub name: String,
    pub lease_duration: Duration,
    pub renew_interval: Duration,
    pub node_status_interval: Duration,
    /// Delay of this node's renewals after its first one (see [`heartbeat_phase`]).
    pub phase: Duration,
}

/// The phase of node `index` of `count`: their renewals spread evenly over one `interval`, as
/// nodes that started at different moments renew at different moments (100 nodes started
/// together would otherwise renew in the same millisecond every interval, a burst of 100 writes
/// no real cluster sends).
pub fn heartbeat_phase(index: usize, count: usize, interval: Duration) -> Duration {
    if count == 0 {
        return Duration::ZERO;
    }
    let nanos = interval.as_nanos() * (index % count) as u128 / count as u128;
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

impl SimNodeOptions {
    /// The real agent's defaults: its Lease duration
    /// ([`ferrovirt_api::fencing::DEFAULT_LEASE_DURATION_SECONDS`], 16 s) renewed as often as
    /// the agent renews it ([`ferrovirt_api::fencing::FenceTiming::renew_interval_millis`],
    /// 4 s), the Node status looked at every 10 s. (Before the eleventh pass of docs/scale.md
    /// the harness renewed a 15 s Lease every 3 s, two thirds of the agent's renewals.)
    pub fn new(name: impl Into<String>) -> Self {
        let timing = ferrovirt_api::fencing::FenceTiming::default();
        SimNodeOptions {
            name: name.into(),
            lease_duration: Duration::from_secs(u64::from(timing.lease_duration_seconds)),
            renew_interval: Duration::from_millis(timing.renew_interval_millis()),
            node_status_interval: Duration::from_secs(10),
            phase: Duration::ZERO,
        }
    }

    /// A Lease of `secs` seconds instead of the default, renewed as the agent renews it (every
    /// quarter of it); refused where admission would refuse it in a HyperConverged.
    pub fn with_lease_seconds(mut self, secs: u32) -> Result<Self, SimError> {
        let timing = ferrovirt_api::fencing::FenceTiming {
            lease_duration_seconds: secs,
            ..Default::default()
        };
        timing
            .validate()
            .map_err(|e| SimError::Other(format!("--lease-seconds: {}", e.message)))?;
        self.lease_duration = Duration::from_secs(u64::from(secs));
        self.renew_interval = Duration::from_millis(timing.renew_interval_millis());
        Ok(self)
    }
}

/// One simulated node.
pub struct SimNode {
    client: kube::Client,
    opts: SimNodeOptions,
    probes: Arc<Probes>,
    /// VMIs whose pretend launcher runs (by uid), with its pretend pid (stable, as a real
    /// launcher's: the pid annotations are written once).
    started: Mutex<HashMap<String, u32>>,
    /// The next pretend pid, so annotations differ per VMI.
    next_pid: std::sync::atomic::AtomicU32,
}

impl SimNode {
    pub fn new(client: kube::Client, opts: SimNodeOptions, probes: Arc<Probes>) -> Arc<SimNode> {
        Arc::new(SimNode {
            client,
            opts,
            probes,
            started: Mutex::new(HashMap::new()),
            next_pid: std::sync::atomic::AtomicU32::new(1000),
        })
    }

    /// Registers the Node (create, then its status) and the lease namespace, as the agent does.
    pub async fn register(&self) -> Result<(), SimError> {
        let desired = sim_node(&self.opts.name, Timestamp::now());
        let nodes: Api<Node> = Api::all(self.client.clone());
        match nodes.create(&PostParams::default(), &desired).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
        nodes
            .patch_status(
                &self.opts.name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": desired.status})),
            )
            .await?;
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        if namespaces.get_opt(LEASE_NAMESPACE).await?.is_none() {
            let ns = Namespace {
                metadata: ObjectMeta {
                    name: Some(LEASE_NAMESPACE.into()),
                    ..Default::default()
                },
                ..Default::default()
            };
            let _ = namespaces.create(&PostParams::default(), &ns).await;
        }
        Ok(())
    }

    /// Renews the Lease every `renew_interval` (one PUT of the last written Lease, a GET or
    /// create only when there is none or a write was refused) and looks at the Node's Ready
    /// condition every `node_status_interval` (read from a watch of the Node alone, a write
    /// only when due), like the agent's heartbeat. Runs forever.
    pub async fn heartbeat(self: Arc<Self>) {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), LEASE_NAMESPACE);
        let nodes: Api<Node> = Api::all(self.client.clone());
        let (own, keep) = node::watch_own(nodes.clone(), &self.opts.name);
        tokio::spawn(keep);
        let secs = i32::try_from(self.opts.lease_duration.as_secs()).unwrap_or(15);
        let mut cached: Option<Lease> = None;
        let mut tick = tokio::time::interval(self.opts.renew_interval);
        let mut node_tick = Instant::now();
        let mut first = true;
        loop {
            tick.tick().await;
            if first && !self.opts.phase.is_zero() {
                // The first renewal now (the Node needs its Lease), the next ones on the phase.
                first = false;
                let mut t = tokio::time::interval_at(
                    tokio::time::Instant::now() + self.opts.phase,
                    self.opts.renew_interval,
                );
                std::mem::swap(&mut tick, &mut t);
            }
            let name = &self.opts.name;
            let written = match cached.take() {
                Some(mut l) => {
                    let spec = l.spec.get_or_insert_with(Default::default);
                    spec.renew_time = Some(MicroTime(Timestamp::now()));
                    leases.replace(name, &PostParams::default(), &l).await
                }
                None => match leases.get_opt(name).await {
                    Ok(Some(mut l)) => {
                        let spec = l.spec.get_or_insert_with(Default::default);
                        spec.renew_time = Some(MicroTime(Timestamp::now()));
                        spec.holder_identity = Some(name.clone());
                        spec.lease_duration_seconds = Some(secs);
                        leases.replace(name, &PostParams::default(), &l).await
                    }
                    Ok(None) => {
                        let l = node::lease_object(name, secs, Timestamp::now());
                        leases.create(&PostParams::default(), &l).await
                    }
                    Err(e) => Err(e),
                },
            };
            match written {
                Ok(l) => cached = Some(l),
                Err(e) => tracing::warn!(node = %name, "lease renewal failed: {e}"),
            }
            if node_tick.elapsed() >= self.opts.node_status_interval {
                node_tick = Instant::now();
                self.report_status(&nodes, &own).await;
            }
        }
    }

    /// Looks at the Node's conditions (from the watch's cache; a GET while it has none) and
    /// writes Ready when due, as the agent's status task does ([`node::report_status_cached`]: on
    /// a change, or every five minutes).
    async fn report_status(&self, nodes: &Api<Node>, own: &reflector::Store<Node>) {
        let name = &self.opts.name;
        let now = Timestamp::now();
        let desired = vec![node::ready_condition(now)];
        if let Err(e) = node::report_status_cached(nodes, own, name, desired, now).await {
            tracing::warn!(node = %name, "node status: {e}");
        }
    }

    /// Watches this node's VMIs (the agent's field selector, through a reflector) and
    /// reconciles each one its watch event names, one at a time. `ready` is told once the
    /// first list is done. Runs until the watch ends.
    pub async fn watch(self: Arc<Self>, ready: tokio::sync::mpsc::Sender<String>) {
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &vmi_resource());
        let cfg = watcher::Config::default()
            .fields(&ferrovirt_agent::runtime::vmi_selector(&self.opts.name));
        let writer = reflector::store::Writer::<DynamicObject>::new(vmi_resource());
        let mut events = reflector(writer, watcher(api, cfg).default_backoff()).boxed();
        while let Some(ev) = events.next().await {
            match ev {
                Ok(watcher::Event::Apply(obj) | watcher::Event::InitApply(obj)) => {
                    self.probes.observe(
                        obj.metadata.uid.as_deref().unwrap_or(""),
                        obj.metadata.annotations.as_ref(),
                    );
                    self.reconcile(&obj).await;
                }
                Ok(watcher::Event::InitDone) => {
                    let _ = ready.try_send(self.opts.name.clone());
                }
                Ok(watcher::Event::Delete(_) | watcher::Event::Init) => {}
                Err(e) => tracing::warn!(node = %self.opts.name, "watching VMIs: {e}"),
            }
        }
    }

    fn observed(&self, uid: &str) -> Observed {
        match lock(&self.started).get(uid) {
            Some(&pid) => Observed::Running(pretend_launcher(uid, pid)),
            None => Observed::NoLauncher,
        }
    }

    /// One VMI through the agent's decision with the pretend launcher, actions applied as the
    /// agent's runtime applies them.
    async fn reconcile(&self, obj: &DynamicObject) {
        let Ok(vmi) =
            serde_json::to_value(obj).and_then(serde_json::from_value::<VirtualMachineInstance>)
        else {
            return;
        };
        if vmi.status.as_ref().and_then(|s| s.node_name.as_deref()) != Some(&self.opts.name) {
            return;
        }
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        // A stopped VMI is decided again at once (the pretend launcher is gone immediately):
        // two rounds cover stop → cleanup.
        for _ in 0..2 {
            let observed = self.observed(&uid);
            let actions = decide::decide(
                &vmi,
                &observed,
                &self.opts.name,
                &now_string(),
                Report::default(),
            );
            let mut again = false;
            for action in actions {
                match action {
                    Action::Start => {
                        self.set_finalizer(&vmi, true).await;
                        let pid = self
                            .next_pid
                            .fetch_add(2, std::sync::atomic::Ordering::Relaxed);
                        lock(&self.started).insert(uid.clone(), pid);
                        self.event(&vmi, "Normal", "Started", "VirtualMachineInstance started")
                            .await;
                        // Running is reported from the next watch event (the finalizer's),
                        // as the agent reports it once the launcher answers.
                    }
                    Action::Stop { .. } => {
                        lock(&self.started).remove(&uid);
                        again = true;
                    }
                    Action::PatchStatus(status) => self.patch_status(&vmi, status).await,
                    Action::Annotate(a) => {
                        let patch = json!({"metadata": {"annotations": a}});
                        self.merge_patch(&vmi, &patch).await;
                    }
                    Action::Cleanup => {
                        lock(&self.started).remove(&uid);
                        self.set_finalizer(&vmi, false).await;
                    }
                }
            }
            if !again {
                break;
            }
        }
    }

    async fn merge_patch(&self, vmi: &VirtualMachineInstance, patch: &Value) {
        let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
        let name = vmi.metadata.name.as_deref().unwrap_or("");
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), ns, &vmi_resource());
        // A write lost to the transport (a kept-alive connection the server closed just as it
        // was reused, seen under load) is sent again, as the agent's next reconcile would; an
        // answer from the API (a conflict, a refusal) is not.
        for attempt in 1..=PATCH_ATTEMPTS {
            match api
                .patch(name, &PatchParams::default(), &Patch::Merge(patch))
                .await
            {
                Ok(_) => return,
                Err(kube::Error::Api(s)) if s.code == 404 => return,
                Err(e @ kube::Error::Api(_)) => {
                    tracing::warn!(node = %self.opts.name, vmi = name, "patch: {e}");
                    return;
                }
                Err(e) if attempt == PATCH_ATTEMPTS => {
                    tracing::warn!(node = %self.opts.name, vmi = name, "patch: {e}");
                }
                Err(e) => {
                    tracing::info!(node = %self.opts.name, vmi = name, attempt, "patch: {e}; retrying");
                    tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt))).await;
                }
            }
        }
    }

    async fn set_finalizer(&self, vmi: &VirtualMachineInstance, present: bool) {
        let mut fins = vmi.metadata.finalizers.clone().unwrap_or_default();
        if fins.iter().any(|f| f == FINALIZER) == present {
            return;
        }
        if present {
            fins.push(FINALIZER.into());
        } else {
            fins.retain(|f| f != FINALIZER);
        }
        let patch = json!({"metadata": {"finalizers": fins, "resourceVersion": vmi.metadata.resource_version}});
        self.merge_patch(vmi, &patch).await;
    }

    async fn patch_status(&self, vmi: &VirtualMachineInstance, status: Value) {
        let new_phase = status
            .get("phase")
            .and_then(|p| p.as_str())
            .map(String::from);
        self.merge_patch(vmi, &json!({"status": status})).await;
        let old = vmi
            .status
            .as_ref()
            .and_then(|s| s.phase.as_ref())
            .and_then(|p| serde_json::to_value(p).ok())
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default();
        if let Some(p) = new_phase
            && p != old
        {
            let t = if p == "Failed" { "Warning" } else { "Normal" };
            self.event(vmi, t, &p, &format!("VirtualMachineInstance is {p}"))
                .await;
        }
    }

    async fn event(&self, vmi: &VirtualMachineInstance, type_: &str, reason: &str, message: &str) {
        let now = Timestamp::now();
        let ev =
            ferrovirt_agent::runtime::vmi_event(vmi, &self.opts.name, now, type_, reason, message);
        let ns = ev.metadata.namespace.clone().unwrap_or_default();
        let events: Api<Event> = Api::namespaced(self.client.clone(), &ns);
        if let Err(e) = events.create(&PostParams::default(), &ev).await {
            tracing::warn!(node = %self.opts.name, "recording event {reason}: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(node: &str, phase: &str) -> VirtualMachineInstance {
        serde_json::from_value(json!({
            "metadata": {"name": "v", "namespace": "default", "uid": "u1"},
            "spec": {"domain": {"devices": {}}},
            "status": {"phase": phase, "nodeName": node},
        }))
        .unwrap()
    }

    #[test]
    fn sim_node_has_room_and_says_it_is_simulated() {
        let n = sim_node("sim-001", Timestamp::now());
        let labels = n.metadata.labels.unwrap();
        assert_eq!(labels["ferrovirt.io/simulated"], "true");
        assert_eq!(labels["kubevirt.io/schedulable"], "true");
        let st = n.status.unwrap();
        assert_eq!(st.allocatable.unwrap()["pods"].0, SIM_PODS.to_string());
        assert_eq!(st.capacity.unwrap()["cpu"].0, "64");
    }

    #[test]
    fn the_agents_decision_with_a_pretend_launcher_reports_running() {
        let v = bound("sim-001", "Scheduled");
        let none = Report::default();
        let first = decide::decide(&v, &Observed::NoLauncher, "sim-001", "t", none);
        assert_eq!(first, vec![Action::Start]);
        let running = Observed::Running(pretend_launcher("u1", 1000));
        let next = decide::decide(&v, &running, "sim-001", "t", none);
        let Action::PatchStatus(st) = &next[0] else {
            panic!("expected a status patch first: {next:?}");
        };
        assert_eq!(st["phase"], "Running");
        assert_eq!(st["nodeName"], "sim-001");
        let ready = st["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Ready")
            .unwrap();
        assert_eq!(ready["status"], "True");
        assert!(matches!(next[1], Action::Annotate(_)));
    }

    #[test]
    fn heartbeat_phases_spread_over_one_interval() {
        let i = Duration::from_secs(3);
        assert_eq!(heartbeat_phase(0, 100, i), Duration::ZERO);
        assert_eq!(heartbeat_phase(50, 100, i), Duration::from_millis(1500));
        assert_eq!(heartbeat_phase(99, 100, i), Duration::from_millis(2970));
        assert_eq!(heartbeat_phase(100, 100, i), Duration::ZERO);
        assert_eq!(heartbeat_phase(3, 0, i), Duration::ZERO);
        let all: std::collections::BTreeSet<_> =
            (0..100).map(|k| heartbeat_phase(k, 100, i)).collect();
        assert_eq!(all.len(), 100);
    }

    #[test]
    fn a_longer_lease_is_renewed_every_quarter_of_it_as_the_agent_does() {
        let d = SimNodeOptions::new("n");
        assert_eq!(
            (d.lease_duration, d.renew_interval),
            (Duration::from_secs(16), Duration::from_secs(4))
        );
        let o = SimNodeOptions::new("n").with_lease_seconds(40).unwrap();
        assert_eq!(
            (o.lease_duration, o.renew_interval),
            (Duration::from_secs(40), Duration::from_secs(10))
        );
        let e = SimNodeOptions::new("n").with_lease_seconds(2).unwrap_err();
        assert!(e.to_string().contains("--lease-seconds"), "{e}");
    }

    #[test]
    fn probe_timelines_join_acks_and_deliveries_by_value() {
        let p = Probes::default();
        let mut a = std::collections::BTreeMap::new();
        a.insert(PROBE_ANNOTATION.to_string(), "1000".to_string());
        p.observe("u1", Some(&a));
        p.ack("1000");
        p.ack("5");
        let t = p.timelines();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].sent, Duration::from_nanos(5));
        assert!(t[0].acked.is_some() && t[0].delivered.is_none());
        assert_eq!(t[1].sent, Duration::from_nanos(1000));
        assert!(t[1].delivered.is_some() && t[1].acked >= t[1].delivered);
    }

    #[test]
    fn probe_latencies_once_per_value() {
        let p = Probes::default();
        std::thread::sleep(Duration::from_millis(2));
        let mut a = std::collections::BTreeMap::new();
        a.insert(PROBE_ANNOTATION.to_string(), "0".to_string());
        p.observe("u1", Some(&a));
        p.observe("u1", Some(&a));
        p.observe("u2", None);
        let l = p.latencies();
        assert_eq!(l.len(), 1);
        assert!(l[0] >= Duration::from_millis(2));
        assert_eq!(probe_latency("x", Duration::from_secs(1)), None);
        assert_eq!(probe_latency("2000000000", Duration::from_secs(1)), None);
        assert_eq!(
            probe_latency("500000000", Duration::from_secs(1)),
            Some(Duration::from_millis(500))
        );
    }
}
