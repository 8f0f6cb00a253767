//! The agent's control loop against the API server (kube-rs): registers the Node, renews its
//! Lease on a task of its own and writes the launchers' heartbeat after each renewal
//! ([`crate::fencing`]; the launchers fence themselves when it goes stale), and reconciles
//! every VMI bound to this node by applying [`crate::decide`]'s actions: start launchers,
//! stop them, write status, clean up.
//! The VMIs come from a reflector cache of a watch on this node's VMIs only
//! (`status.nodeName=<node>`, see [`vmi_selector`]): a watch event reconciles its VMI, the
//! periodic resync re-checks the local launchers against the cache; the agent never lists in
//! steady state. What a VMI references (claims, volumes, Secrets, ConfigMaps) is read by name
//! when it starts; configuration objects and, for the duplicate-MAC check, the cluster's VMIs
//! come from watch-fed caches ([`caches`]), never from a list per start.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_launcher::control::Request;
use ferrovirt_launcher::spec::Accel;
use ferrovirt_launcher::timing::Timeline;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Namespace, Node, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::runtime::reflector;
use serde_json::{Value, json};
use tokio::sync::Mutex;

use crate::decide::{self, Action, FINALIZER, Observed};
use crate::error::AgentError;
use crate::launchers::{self, LauncherConfig, Launchers};
use crate::node::{self, HostFacts, LEASE_NAMESPACE};
use crate::volumes::ResolvedRefs;

mod blockmig;
mod caches;
mod chainmig;
mod cpu_labels;
mod devices;
mod migration;
mod migresume;
mod migsetup;
mod mounts;
mod postcopy;
mod refs;
mod start;
mod sync;
pub use sync::vmi_selector;
use sync::{sync_loop, watch_vmis};

/// How the agent runs.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    pub node_name: String,
    pub data_dir: PathBuf,
    /// The `ferrovirt` binary, run as `ferrovirt launcher` for each VMI.
    pub launcher_binary: PathBuf,
    pub qemu_binary: PathBuf,
    /// Address reported as the node's InternalIP.
    pub address: String,
    /// The Lease duration until a HyperConverged sets `spec.nodeFailure.leaseDurationSeconds`.
    pub lease_duration: Duration,
    /// The renewal interval at the default lease duration: the period of the mount checks and
    /// how long a start waits for a first renewal. The renewals themselves run every quarter
    /// of the lease duration in force.
    pub renew_interval: Duration,
    /// How often every local VMI is reconciled even without watch events.
    pub resync_interval: Duration,
    /// Accelerator override (tests); `None` detects.
    pub accel: Option<Accel>,
    /// TCG translation-cache size in MiB for every VM (keeps TCG memory small).
    pub tcg_tb_size_mib: Option<u32>,
    /// Where the agent's endpoint ([`crate::endpoint`]) listens; published on the Node.
    pub endpoint_listen: SocketAddr,
    /// The agent's API token: the bearer token its endpoint requires. `None` refuses all.
    pub api_token: Option<String>,
    /// The bearer token the API server presents to this node's endpoint, when the agent has
    /// no API token (a joined node gets it with its credential, [`crate::join`]).
    pub endpoint_token: Option<String>,
    /// A joined node's client CA: its endpoint then requires the API server's client
    /// certificate with `endpoint_token` ([`crate::endpoint::EndpointAuth::client_ca`]).
    pub endpoint_client_ca: Option<String>,
    /// The node's pod network (docs/networking.md): masquerade and bridge interfaces get a tap
    /// in a per-VMI network namespace, Multus bridge networks a veth from a host bridge, the
    /// overlay connects the nodes. `None`: masquerade on QEMU user-mode networking.
    pub pod_network: Option<crate::network::PodNetworkOptions>,
    /// Per-VM QEMU uids, cgroup limits, serial log bound, allowed host paths
    /// ([`crate::isolation`]).
    pub isolation: crate::isolation::IsolationOptions,
    /// Where host devices are looked for ([`crate::hostdev`]).
    pub host_devices: crate::hostdev::HostDevOptions,
    /// The PEM of the CA that signed the API server's certificate: the `ca.crt` of
    /// serviceAccount disks.
    pub api_ca_pem: Option<String>,
    /// NodeNetworkConfigurationPolicies applied to this node's network ([`crate::nmstate`]);
    /// `None` (the default): never touched.
    pub nmstate: Option<crate::nmstate::NmstateOptions>,
}

impl AgentOptions {
    pub fn new(node_name: impl Into<String>, data_dir: impl Into<PathBuf>) -> Self {
        AgentOptions {
            node_name: node_name.into(),
            data_dir: data_dir.into(),
            launcher_binary: std::env::current_exe().unwrap_or_else(|_| "ferrovirt".into()),
            qemu_binary: "qemu-system-x86_64".into(),
            address: "127.0.0.1".into(),
            lease_duration: Duration::from_secs(u64::from(
                ferrovirt_api::fencing::DEFAULT_LEASE_DURATION_SECONDS,
            )),
            renew_interval: Duration::from_secs(u64::from(
                ferrovirt_api::fencing::DEFAULT_RENEW_SECONDS,
            )),
            resync_interval: Duration::from_secs(2),
            accel: None,
            tcg_tb_size_mib: Some(64),
            endpoint_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            api_token: None,
            endpoint_token: None,
            endpoint_client_ca: None,
            pod_network: None,
            isolation: crate::isolation::IsolationOptions::default(),
            host_devices: crate::hostdev::HostDevOptions::default(),
            api_ca_pem: None,
            nmstate: None,
        }
    }
}

pub(crate) fn vmi_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstance"),
        "virtualmachineinstances",
    )
}

fn now_ts() -> Timestamp {
    Timestamp::now()
}

/// The core/v1 Event the agent of `node` records about `vmi` at `now` (pure; the simulation
/// harness of `bench/scale` records the same).
pub fn vmi_event(
    vmi: &VirtualMachineInstance,
    node: &str,
    now: Timestamp,
    type_: &str,
    reason: &str,
    message: &str,
) -> Event {
    let ns = vmi
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let name = vmi.metadata.name.clone().unwrap_or_default();
    Event {
        metadata: ObjectMeta {
            generate_name: Some(format!("{name}.")),
            namespace: Some(ns.clone()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("kubevirt.io/v1".into()),
            kind: Some("VirtualMachineInstance".into()),
            name: Some(name),
            namespace: Some(ns),
            uid: vmi.metadata.uid.clone(),
            ..Default::default()
        },
        reason: Some(reason.into()),
        message: Some(message.into()),
        type_: Some(type_.into()),
        count: Some(1),
        first_timestamp: Some(Time(now)),
        last_timestamp: Some(Time(now)),
        reporting_component: Some("ferrovirt-agent".into()),
        reporting_instance: Some(node.to_string()),
        source: Some(k8s_openapi::api::core::v1::EventSource {
            component: Some("ferrovirt-agent".into()),
            host: Some(node.to_string()),
        }),
        ..Default::default()
    }
}

fn now_string() -> String {
    now_ts().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

struct Agent {
    client: Client,
    opts: AgentOptions,
    accel: Accel,
    cfg: LauncherConfig,
    launchers: Mutex<Launchers>,
    /// VMIs with an operation (start/stop) in flight.
    busy: Mutex<HashSet<String>>,
    /// Source: the migration uid each VMI's snapshot chains were last sent for
    /// ([`crate::chaincopy`]).
    chains_sent: std::sync::Mutex<HashMap<String, String>>,
    /// The Lease duration in seconds: `opts.lease_duration` unless a HyperConverged object
    /// sets `spec.nodeFailure.leaseDurationSeconds` (followed from the HyperConverged cache
    /// by [`crate::fencing::follow_lease_duration`]).
    lease_seconds: Arc<std::sync::atomic::AtomicU32>,
    /// The last successful Lease renewal, as written into the heartbeat file.
    last_renewal: std::sync::Mutex<Option<ferrovirt_launcher::fence::Heartbeat>>,
    /// The Lease as the last renewal wrote it (its resourceVersion guards the next one).
    lease: Mutex<Option<Lease>>,
    /// The endpoint's URL, published as the Node's [`node::ENDPOINT_ANNOTATION`].
    endpoint_url: String,
    /// Its certificate's SHA-256, published as [`node::FINGERPRINT_ANNOTATION`].
    endpoint_fingerprint: String,
    /// The endpoint's certificate, also this node's identity on live-migration streams.
    cert: crate::tls::AgentCert,
    /// Unprivileged user for QEMU (when the agent runs as root).
    qemu_user: Option<String>,
    /// Wakes the sync loop early (VMI watch events, a launcher that came up).
    wake: tokio::sync::Notify,
    /// Last guest-agent report per VMI uid (refreshed every [`GUEST_INFO_REFRESH`]).
    guest_info: Mutex<HashMap<String, (Instant, Value)>>,
    /// Pod network, overlay and secondary networks ([`crate::network`]).
    net: crate::network::AgentNet,
    /// The node's containerDisk image cache ([`crate::containerdisk`]).
    container_disks: crate::containerdisk::ContainerDisks,
    /// Per VMI uid: the size last sent in a `ResizeDisk` for each claim disk ([`crate::resize`]).
    disk_sizes: Mutex<HashMap<String, BTreeMap<String, u64>>>,
    /// The node's shared-mount condition as last found ([`mounts`]); the heartbeat sends it
    /// with Ready.
    shared_mounts: Mutex<Option<k8s_openapi::api::core::v1::NodeCondition>>,
    /// HyperConverged/CDI objects and (on demand) every VMI, from watches ([`caches`]).
    caches: caches::Caches,
    /// The named CPU models this node's QEMU runs under `accel` ([`crate::cpu_models`],
    /// probed once at start), labelled on the Node unless obsolete ([`cpu_labels`]).
    cpu_models: std::collections::BTreeSet<String>,
    /// Live migration ([`migration`]): VMIs whose target launcher is being prepared here.
    preparing: Mutex<HashSet<String>>,
    /// The tasks receiving the migrations to this node (the stream's setup and hand-over),
    /// by VMI uid.
    relays: Mutex<HashMap<String, tokio::task::AbortHandle>>,
    /// Block migrations to this node whose copies are being taken over once the guest runs
    /// here (`finish_block_target`), by VMI uid.
    finishing: Mutex<HashSet<String>>,
    /// VMI uid → migration uid of the VMIs this node migrated away (until the watch shows it).
    moved: std::sync::Mutex<HashMap<String, String>>,
    /// VMIs migrating to this node (their launchers are no orphans).
    targets: std::sync::Mutex<HashSet<String>>,
    /// The incoming-migration watch has listed once: until then `targets` may miss a target
    /// launcher this node runs (after an agent restart), so no launcher is an orphan yet.
    targets_synced: std::sync::atomic::AtomicBool,
    /// VMIs bound to this node as the sync loop last saw them.
    bound_uids: std::sync::Mutex<HashSet<String>>,
}

/// How often a connected guest agent is asked for OS info and interfaces.
const GUEST_INFO_REFRESH: Duration = Duration::from_secs(20);

/// Runs the agent until an unrecoverable error.
pub async fn run(client: Client, opts: AgentOptions) -> Result<(), AgentError> {
    let accel = opts.accel.unwrap_or_else(ferrovirt_launcher::detect_accel);
    std::fs::create_dir_all(opts.data_dir.join("vmis"))
        .map_err(|e| AgentError::io(&opts.data_dir, e))?;
    let cfg = LauncherConfig {
        binary: opts.launcher_binary.clone(),
        data_dir: opts.data_dir.clone(),
        qemu_binary: opts.qemu_binary.clone(),
    };
    let mut net = crate::network::AgentNet::new(opts.pod_network.clone(), cfg.clone());
    net.resolve().await?;
    let cert = crate::tls::load_or_create(&opts.data_dir, std::slice::from_ref(&opts.address))?;
    let endpoint = crate::endpoint::serve(
        opts.endpoint_listen,
        &opts.address,
        &opts.node_name,
        cfg.clone(),
        crate::endpoint::EndpointAuth {
            token: opts.api_token.clone(),
            node_token: opts.endpoint_token.clone(),
            client_ca: opts.endpoint_client_ca.clone(),
            delegated: Some(Arc::new(crate::delegated::DelegatedAuth::new(
                client.clone(),
                &opts.node_name,
            ))),
        },
        &cert,
    )
    .await?;
    let default_lease = u32::try_from(opts.lease_duration.as_secs()).unwrap_or(u32::MAX);
    let lease_seconds = Arc::new(std::sync::atomic::AtomicU32::new(default_lease));
    let cpu_models = cpu_labels::probe(&opts.qemu_binary, accel).await;
    let (obsolete_tx, obsolete) =
        tokio::sync::watch::channel(ferrovirt_api::kubevirt::cpu_model::obsolete_models([]));
    let (permitted_tx, permitted) = tokio::sync::watch::channel(None);
    let caches = caches::Caches::start(
        &client,
        {
            let lease_seconds = lease_seconds.clone();
            Box::new(move |hcos| {
                crate::fencing::follow_lease_duration(hcos, &lease_seconds, default_lease)
            })
        },
        Box::new(move |kubevirts| {
            cpu_labels::follow_obsolete(kubevirts, &obsolete_tx);
            devices::follow_permitted(kubevirts, &permitted_tx);
        }),
    );
    let agent = Arc::new(Agent {
        endpoint_url: endpoint.url.clone(),
        endpoint_fingerprint: endpoint.fingerprint.clone(),
        cert: cert.clone(),
        client,
        accel,
        cfg,
        launchers: Mutex::new(Launchers::default()),
        busy: Mutex::new(HashSet::new()),
        chains_sent: std::sync::Mutex::new(HashMap::new()),
        last_renewal: std::sync::Mutex::new(None),
        lease_seconds,
        lease: Mutex::new(None),
        qemu_user: crate::isolation::ensure_qemu_user(),
        wake: tokio::sync::Notify::new(),
        guest_info: Mutex::new(HashMap::new()),
        net,
        container_disks: crate::containerdisk::ContainerDisks::new(&opts.data_dir),
        disk_sizes: Mutex::new(HashMap::new()),
        shared_mounts: Mutex::new(None),
        caches,
        cpu_models,
        preparing: Mutex::new(HashSet::new()),
        finishing: Mutex::new(HashSet::new()),
        relays: Mutex::new(HashMap::new()),
        moved: std::sync::Mutex::new(HashMap::new()),
        targets: std::sync::Mutex::new(HashSet::new()),
        targets_synced: std::sync::atomic::AtomicBool::new(false),
        bound_uids: std::sync::Mutex::new(HashSet::new()),
        opts,
    });
    agent.register_node().await?;
    tracing::info!(node = %agent.opts.node_name, accel = %accel, "agent registered its node");
    tokio::spawn(cpu_labels::run(agent.clone(), obsolete));
    tokio::spawn(devices::run(agent.clone(), permitted));
    agent.net.init(&agent.client, &agent.opts.node_name).await?;
    if let Some(o) = agent.opts.nmstate.clone() {
        tokio::spawn(crate::nmstate::run(
            agent.client.clone(),
            agent.opts.node_name.clone(),
            agent.opts.data_dir.clone(),
            o,
        ));
    }
    let overlay = tokio::spawn({
        let agent = agent.clone();
        async move {
            let client = agent.client.clone();
            let name = agent.opts.node_name.clone();
            agent.net.run_overlay(client, name).await
        }
    });
    // One Service and one EndpointSlice watch for both Service tables (pod network nodes).
    let (svc_caches, svc_watches) = crate::services::ServiceCaches::new(&agent.client);
    if agent.net.node_network().is_some() {
        tokio::spawn(svc_watches);
    }
    let services = tokio::spawn({
        let agent = agent.clone();
        let caches = svc_caches.clone();
        async move { crate::services::run(&agent.net, caches).await }
    });
    tokio::spawn({
        let agent = agent.clone();
        async move { crate::udn_svc::run(&agent.net, agent.client.clone(), svc_caches).await }
    });
    // Online merges a killed agent left unrecorded (docs/snapshots.md "Order and crashes").
    tokio::spawn(crate::nodestore::journal::resolve_at_start(
        agent.opts.data_dir.clone(),
    ));
    let hb = tokio::spawn(heartbeat(agent.clone()));
    let mounts = tokio::spawn(mounts::run(agent.clone()));
    let writer = reflector::store::Writer::<DynamicObject>::new(vmi_resource());
    let cache = writer.as_reader();
    let (triggers, events) = tokio::sync::mpsc::unbounded_channel();
    let watch = tokio::spawn(watch_vmis(agent.clone(), writer, triggers));
    let sync = tokio::spawn(sync_loop(agent.clone(), cache, events));
    let incoming = tokio::spawn(migration::target_loop(agent.clone()));
    let r = tokio::select! {
        r = incoming => r,
        r = hb => r,
        r = sync => r,
        r = endpoint.task => r,
        r = watch => r,
        r = overlay => r,
        r = services => r,
        r = mounts => r,
    };
    r.map_err(|e| AgentError::Reference(format!("agent task ended: {e}")))
}

impl Agent {
    async fn register_node(&self) -> Result<(), AgentError> {
        let address = self
            .net
            .internal_ip()
            .unwrap_or_else(|| self.opts.address.clone());
        let facts = HostFacts::gather(self.accel, &address);
        let mut desired = node::node_object(
            &self.opts.node_name,
            &facts,
            &self.endpoint_url,
            &self.endpoint_fingerprint,
            now_ts(),
        );
        desired.metadata.labels.get_or_insert_default().insert(
            ferrovirt_network::mode::NODE_LABEL.to_string(),
            self.net.mode().to_string(),
        );
        // The CPU-model labels at KubeVirt's default obsolete list; `cpu_labels::run` follows
        // the KubeVirt CR's from here on.
        let obsolete = ferrovirt_api::kubevirt::cpu_model::obsolete_models([]);
        for (k, v) in ferrovirt_api::kubevirt::cpu_model::node_labels(&self.cpu_models, &obsolete) {
            if let Some(v) = v {
                desired.metadata.labels.get_or_insert_default().insert(k, v);
            }
        }
        let nodes: Api<Node> = Api::all(self.client.clone());
        match nodes
            .get_opt(&self.opts.node_name)
            .await
            .map_err(kube_err)?
        {
            None => {
                nodes
                    .create(&PostParams::default(), &desired)
                    .await
                    .map_err(kube_err)?;
            }
            Some(_) => {
                let meta = json!({"metadata": {
                    "labels": desired.metadata.labels,
                    "annotations": desired.metadata.annotations,
                }});
                nodes
                    .patch(
                        &self.opts.node_name,
                        &PatchParams::default(),
                        &Patch::Merge(&meta),
                    )
                    .await
                    .map_err(kube_err)?;
            }
        }
        let status = json!({"status": desired.status});
        nodes
            .patch_status(
                &self.opts.node_name,
                &PatchParams::default(),
                &Patch::Merge(&status),
            )
            .await
            .map_err(kube_err)?;
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        if namespaces
            .get_opt(LEASE_NAMESPACE)
            .await
            .map_err(kube_err)?
            .is_none()
        {
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

    /// Renews the node's Lease: one `PUT` of the Lease the last renewal returned; a `GET`
    /// (or create) only when there is none yet or the write was refused (a conflict).
    /// Writes `lease_seconds` as the duration; returns the `renewTime` written.
    async fn renew_lease(&self, lease_seconds: u32) -> Result<Timestamp, AgentError> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), LEASE_NAMESPACE);
        let secs = i32::try_from(lease_seconds).unwrap_or(i32::MAX);
        let now = now_ts();
        let mut cached = self.lease.lock().await;
        let current = match cached.take() {
            Some(l) => Some(l),
            None => leases
                .get_opt(&self.opts.node_name)
                .await
                .map_err(kube_err)?,
        };
        let written = match current {
            None => leases
                .create(
                    &PostParams::default(),
                    &node::lease_object(&self.opts.node_name, secs, now),
                )
                .await
                .map_err(kube_err)?,
            Some(mut l) => {
                let spec = l.spec.get_or_insert_with(Default::default);
                spec.renew_time = Some(MicroTime(now));
                spec.holder_identity = Some(self.opts.node_name.clone());
                spec.lease_duration_seconds = Some(secs);
                // A refused write leaves the cache empty: the next renewal reads it again.
                leases
                    .replace(&self.opts.node_name, &PostParams::default(), &l)
                    .await
                    .map_err(kube_err)?
            }
        };
        *cached = Some(written);
        Ok(now)
    }

    /// After a successful renewal: the heartbeat the launchers check, with the `renewTime`
    /// and duration the Lease got (not the time of this write).
    fn record_renewal(&self, renewed: Timestamp, lease_seconds: u32) {
        let hb = ferrovirt_launcher::fence::Heartbeat {
            node: self.opts.node_name.clone(),
            renew_time_ms: renewed.as_millisecond(),
            lease_duration_seconds: lease_seconds,
        };
        let path = crate::fencing::heartbeat_path(&self.opts.data_dir);
        if let Err(e) = ferrovirt_launcher::fence::write_heartbeat(&path, &hb) {
            tracing::warn!("writing the heartbeat {}: {e}", path.display());
        }
        *self.last_renewal.lock().unwrap_or_else(|p| p.into_inner()) = Some(hb);
    }

    /// The launcher's fence spec for `vmi` (`None`: it cannot move and never fences), after
    /// waiting a moment for a first renewal when the agent has just started.
    async fn fence_spec(
        &self,
        vmi: &VirtualMachineInstance,
        refs: &ResolvedRefs,
    ) -> Result<Option<ferrovirt_launcher::fence::FenceSpec>, AgentError> {
        let run_strategy = crate::fencing::owner_run_strategy(&self.client, vmi).await?;
        let wait_until = Instant::now() + 2 * self.opts.renew_interval;
        loop {
            let last = self
                .last_renewal
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            let inputs = crate::fencing::FenceInputs {
                node: &self.opts.node_name,
                data_dir: &self.opts.data_dir,
                run_strategy,
                last_renewal: last.as_ref(),
                now_ms: ferrovirt_launcher::fence::now_ms(),
            };
            match crate::fencing::fence_spec(vmi, refs, &refs.claim_access_modes, &inputs) {
                Err(_) if Instant::now() < wait_until => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                r => return r,
            }
        }
    }

    async fn event(&self, vmi: &VirtualMachineInstance, type_: &str, reason: &str, message: &str) {
        let ev = vmi_event(vmi, &self.opts.node_name, now_ts(), type_, reason, message);
        let ns = ev.metadata.namespace.clone().unwrap_or_default();
        let events: Api<Event> = Api::namespaced(self.client.clone(), &ns);
        if let Err(e) = events.create(&PostParams::default(), &ev).await {
            tracing::warn!("recording event {reason}: {e}");
        }
    }

    fn vmi_api(&self, ns: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), ns, &vmi_resource())
    }

    async fn patch_status(
        &self,
        vmi: &VirtualMachineInstance,
        status: Value,
    ) -> Result<(), AgentError> {
        let (ns, name) = ns_name(vmi);
        // VMIs have no /status subresource (as in KubeVirt): status is written on the object.
        // The uid is a precondition: a decision about an older VMI of the same name (say,
        // one this agent fenced while it was stopped) never lands on its replacement.
        let patch = json!({"metadata": {"uid": vmi.metadata.uid}, "status": status});
        self.vmi_api(&ns)
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(kube_err)?;
        Ok(())
    }

    async fn set_finalizer(
        &self,
        vmi: &VirtualMachineInstance,
        present: bool,
    ) -> Result<(), AgentError> {
        let mut fins = vmi.metadata.finalizers.clone().unwrap_or_default();
        let has = fins.iter().any(|f| f == FINALIZER);
        if has == present {
            return Ok(());
        }
        if present {
            fins.push(FINALIZER.into());
        } else {
            fins.retain(|f| f != FINALIZER);
        }
        let (ns, name) = ns_name(vmi);
        let patch = json!({"metadata": {"finalizers": fins, "resourceVersion": vmi.metadata.resource_version}});
        match self
            .vmi_api(&ns)
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(kube_err(e)),
        }
    }

    async fn reconcile(self: &Arc<Self>, vmi: VirtualMachineInstance, seen_us: u64) {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        if uid.is_empty() || self.busy.lock().await.contains(&uid) || self.moved_away(&vmi) {
            return;
        }
        if self.reconcile_source(&vmi).await {
            return;
        }
        let observed = launchers::observe(&self.cfg, &uid).await;
        if let Observed::Exited(rep) = &observed
            && rep.reason == ferrovirt_launcher::control::ExitReason::Migrated
        {
            // What a migration left behind here; the VMI runs elsewhere.
            self.net.detach(&uid).await;
            launchers::remove_dir(&self.cfg.vmi_dir(&uid));
            return;
        }
        // A launcher this agent just started may not listen yet: don't start a second one.
        if observed == Observed::NoLauncher && self.launchers.lock().await.is_child_alive(&uid) {
            return;
        }
        if let Observed::Running(_) = &observed {
            self.net.reattach(&uid).await;
            self.net.host(&uid);
            self.grow_disks(&vmi, &uid).await;
        }
        let guest = self.guest_info_for(&uid, &observed).await;
        let pod = self.net.pod_report(&vmi, &uid);
        let migratable = crate::migration::read_migratable_now(
            &self.cfg.vmi_dir(&uid),
            &crate::nodestore::volume_root(&self.opts.data_dir),
        );
        let report = decide::Report {
            guest: guest.as_ref(),
            pod: pod.as_ref().map(|(i, a)| (i.as_str(), a.as_str())),
            migratable: migratable.as_ref().map(|m| match m {
                Ok(()) => Ok(()),
                Err((r, msg)) => Err((r.as_str(), msg.as_str())),
            }),
        };
        for action in decide::decide(&vmi, &observed, &self.opts.node_name, &now_string(), report) {
            match action {
                Action::Start => {
                    self.busy.lock().await.insert(uid.clone());
                    let me = self.clone();
                    let vmi = vmi.clone();
                    let uid = uid.clone();
                    tokio::spawn(async move {
                        let mut timing = Timeline::default();
                        timing.push("watch", seen_us, seen_us);
                        match me.start(&vmi, &mut timing).await {
                            Ok(()) => {
                                // The launcher child is tracked now: no second start can
                                // happen, so the VMI may be reconciled again.
                                me.busy.lock().await.remove(&uid);
                                me.event(
                                    &vmi,
                                    "Normal",
                                    "Started",
                                    "VirtualMachineInstance started",
                                )
                                .await;
                                me.wake_when_launcher_answers(&uid).await;
                            }
                            Err(e) => {
                                let msg = e.to_string();
                                tracing::warn!(vmi = ?vmi.metadata.name, "start failed: {msg}");
                                me.event(&vmi, "Warning", e.reason(), &msg).await;
                                let st =
                                    decide::start_failed_status(e.reason(), &msg, &now_string());
                                let _ = me.patch_status(&vmi, st).await;
                            }
                        }
                        me.busy.lock().await.remove(&uid);
                    });
                }
                Action::Stop { grace_seconds } => {
                    self.busy.lock().await.insert(uid.clone());
                    let me = self.clone();
                    let vmi = vmi.clone();
                    let uid = uid.clone();
                    tokio::spawn(async move {
                        me.event(
                            &vmi,
                            "Normal",
                            "ShuttingDown",
                            &format!("Signaled graceful shutdown (grace period {grace_seconds}s)"),
                        )
                        .await;
                        let timeout = Duration::from_secs(grace_seconds + 30);
                        if let Err(e) = launchers::request(
                            &me.cfg,
                            &uid,
                            &Request::Shutdown { grace_seconds },
                            timeout,
                        )
                        .await
                        {
                            tracing::warn!("shutdown request: {e}");
                        }
                        me.busy.lock().await.remove(&uid);
                    });
                }
                Action::PatchStatus(status) => {
                    let phase_change = status
                        .get("phase")
                        .and_then(|p| p.as_str())
                        .map(String::from);
                    let fenced = (status["reason"] == decide::REASON_FENCED).then(|| {
                        status["conditions"][0]["message"]
                            .as_str()
                            .unwrap_or_default()
                            .to_string()
                    });
                    match self.patch_status(&vmi, status).await {
                        Ok(()) => {
                            if let (Some(p), Some(old)) = (
                                phase_change,
                                vmi.status.as_ref().and_then(|s| s.phase.as_ref()),
                            ) {
                                let old = serde_json::to_value(old)
                                    .ok()
                                    .and_then(|v| v.as_str().map(String::from))
                                    .unwrap_or_default();
                                if let Some(msg) = &fenced {
                                    self.event(&vmi, "Warning", decide::REASON_FENCED, msg)
                                        .await;
                                }
                                if p != old {
                                    let (t, msg) = if p == "Failed" {
                                        ("Warning", format!("VirtualMachineInstance is {p}"))
                                    } else {
                                        ("Normal", format!("VirtualMachineInstance is {p}"))
                                    };
                                    self.event(&vmi, t, &p, &msg).await;
                                }
                            }
                        }
                        Err(e) => tracing::debug!("status patch: {e}"),
                    }
                }
                Action::Annotate(annotations) => {
                    let (ns, name) = ns_name(&vmi);
                    let patch = json!({"metadata": {
                        "uid": vmi.metadata.uid, "annotations": annotations
                    }});
                    if let Err(e) = self
                        .vmi_api(&ns)
                        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                    {
                        tracing::debug!("annotating VMI: {e}");
                    }
                }
                Action::Cleanup => {
                    self.guest_info.lock().await.remove(&uid);
                    self.disk_sizes.lock().await.remove(&uid);
                    self.net.detach(&uid).await;
                    launchers::remove_dir(&self.cfg.vmi_dir(&uid));
                    if let Err(e) = self.set_finalizer(&vmi, false).await {
                        tracing::warn!("removing finalizer: {e}");
                    }
                }
            }
        }
    }

    /// Online disk growth ([`crate::resize`]): claim disks of the running VMI whose volume is
    /// larger than the size last sent are grown by its launcher (`ResizeDisk`).
    async fn grow_disks(&self, vmi: &VirtualMachineInstance, uid: &str) {
        let dir = self.cfg.vmi_dir(uid);
        let Some(spec) = std::fs::read(dir.join(ferrovirt_launcher::control::files::SPEC))
            .ok()
            .and_then(|b| serde_json::from_slice::<ferrovirt_launcher::spec::LaunchSpec>(&b).ok())
        else {
            return;
        };
        let measured: Vec<(String, u64)> = crate::resize::claim_disks(vmi, &spec, &dir)
            .into_iter()
            .filter_map(|(id, path)| crate::resize::measure(&path).ok().map(|b| (id, b)))
            .collect();
        let last = self
            .disk_sizes
            .lock()
            .await
            .get(uid)
            .cloned()
            .unwrap_or_default();
        for (disk, bytes) in crate::resize::plan(&measured, &last) {
            let req = Request::ResizeDisk {
                disk: disk.clone(),
                bytes,
            };
            match launchers::request(&self.cfg, uid, &req, Duration::from_secs(10)).await {
                Ok(v) => {
                    self.disk_sizes
                        .lock()
                        .await
                        .entry(uid.to_string())
                        .or_default()
                        .insert(disk.clone(), bytes);
                    if v["grown"] == true {
                        let msg = format!("disk {disk} grown to {} bytes", v["bytes"]);
                        tracing::info!(uid, "{msg}");
                        self.event(vmi, "Normal", "DiskResized", &msg).await;
                    }
                }
                Err(e) => tracing::warn!(uid, "resizing disk {disk}: {e}"),
            }
        }
    }

    /// The guest-agent report for `uid`: cached, refreshed when the agent is connected and the
    /// cache is older than [`GUEST_INFO_REFRESH`].
    async fn guest_info_for(&self, uid: &str, observed: &Observed) -> Option<Value> {
        let Observed::Running(st) = observed else {
            return None;
        };
        let cached = self.guest_info.lock().await.get(uid).cloned();
        let fresh = cached
            .as_ref()
            .is_some_and(|(at, _)| at.elapsed() < GUEST_INFO_REFRESH);
        if !st.guest_agent_connected || fresh {
            return cached.map(|(_, v)| v);
        }
        match launchers::request(&self.cfg, uid, &Request::GuestInfo, Duration::from_secs(10)).await
        {
            Ok(v) => {
                self.guest_info
                    .lock()
                    .await
                    .insert(uid.to_string(), (Instant::now(), v.clone()));
                Some(v)
            }
            Err(e) => {
                tracing::debug!("guest info of {uid}: {e}");
                cached.map(|(_, v)| v)
            }
        }
    }

    /// Waits (up to 30 s) until the new launcher of `uid` answers, then wakes the sync loop so
    /// the VMI is reported Running without waiting for the next resync.
    async fn wake_when_launcher_answers(&self, uid: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if !matches!(
                launchers::observe(&self.cfg, uid).await,
                Observed::NoLauncher
            ) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        self.wake.notify_one();
    }

    /// Launchers whose VMI no longer exists (deleted while the agent was away): stop and remove.
    async fn collect_orphans(self: &Arc<Self>, known: &HashSet<String>) {
        if !self
            .targets_synced
            .load(std::sync::atomic::Ordering::Acquire)
        {
            // A restarted agent: a launcher receiving a migration is not known yet.
            return;
        }
        for uid in self.cfg.local_uids() {
            if known.contains(&uid)
                || self.busy.lock().await.contains(&uid)
                || self.preparing.lock().await.contains(&uid)
                || self
                    .targets
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .contains(&uid)
            {
                continue;
            }
            match launchers::observe(&self.cfg, &uid).await {
                Observed::Running(_) => {
                    let _ = launchers::request(
                        &self.cfg,
                        &uid,
                        &Request::Shutdown { grace_seconds: 0 },
                        Duration::from_secs(30),
                    )
                    .await;
                }
                _ => {
                    self.net.detach(&uid).await;
                    launchers::remove_dir(&self.cfg.vmi_dir(&uid));
                }
            }
        }
    }
}

fn ns_name(vmi: &VirtualMachineInstance) -> (String, String) {
    (
        vmi.metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into()),
        vmi.metadata.name.clone().unwrap_or_default(),
    )
}

fn kube_err(e: kube::Error) -> AgentError {
    AgentError::Reference(format!("API: {e}"))
}

/// Renews the Lease every quarter of its duration
/// ([`ferrovirt_api::fencing::FenceTiming::renew_interval_millis`]: 4 s at the default 16 s,
/// 10 s where the HyperConverged asks for the kubelet's 40 s) on a task of its own
/// (reconciles never delay it; a renewal that hangs is abandoned after the lease duration)
/// and records each success in the heartbeat file. Another task refreshes the Node's Ready
/// condition.
async fn heartbeat(agent: Arc<Agent>) {
    tokio::spawn(node_status(agent.clone()));
    loop {
        let started = tokio::time::Instant::now();
        let secs = agent
            .lease_seconds
            .load(std::sync::atomic::Ordering::SeqCst);
        let lease = Duration::from_secs(u64::from(secs));
        match tokio::time::timeout(lease, agent.renew_lease(secs)).await {
            Ok(Ok(renewed)) => agent.record_renewal(renewed, secs),
            Ok(Err(e)) => tracing::warn!("lease renewal failed: {e}"),
            Err(_) => tracing::warn!("lease renewal timed out"),
        }
        let every = ferrovirt_api::fencing::FenceTiming {
            lease_duration_seconds: secs,
            ..Default::default()
        }
        .renew_interval_millis();
        tokio::time::sleep_until(started + Duration::from_millis(every)).await;
    }
}

/// Looks at the Node's conditions every 10 s and writes them when they changed (another writer
/// included) or every [`node::STATUS_REPORT_EVERY`] ([`node::report_status_cached`]), as the
/// kubelet does; the Node is read from a watch of it alone ([`node::watch_own`]), so a look
/// makes no request (a GET only while that cache has no Node yet), a write only when due.
async fn node_status(agent: Arc<Agent>) {
    let nodes: Api<Node> = Api::all(agent.client.clone());
    let name = agent.opts.node_name.clone();
    let (own, keep) = node::watch_own(nodes.clone(), &name);
    let looks = async {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            tick.tick().await;
            let desired = agent.node_conditions().await;
            if let Err(e) = node::report_status_cached(&nodes, &own, &name, desired, now_ts()).await
            {
                tracing::debug!("node status: {e}");
            }
        }
    };
    tokio::select! {
        () = keep => {}
        () = looks => {}
    }
}
