//! The agent's side of networking (docs/networking.md): the node's pod network (its subnet from
//! the Node's `spec.podCIDR`, set by the node IPAM controller or recorded from `--pod-cidr`),
//! the VXLAN overlay to the other nodes (kept in sync with the Node objects), and per VMI the
//! attachments: the pod-network interface (namespace, veth, tap, DHCP server) and secondary
//! interfaces on Multus bridge networks (NetworkAttachmentDefinitions). Plans are kept in the
//! VMI directory, so teardown is exact and an agent restart re-attaches running VMIs.

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_network::{
    Ipv4Cidr, NetworkMode, NodeInfo, NodeNetwork, Overlay, RequestedMode, SecondaryPlan,
};
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use serde_json::json;
use tokio::sync::Mutex;

use crate::error::AgentError;
use crate::launchers::{self, LauncherConfig};
use crate::mapping::{self, PodTap};

mod secondary;

pub(crate) use secondary::read_secondary_plans;
pub use secondary::{SecondaryInterface, secondary_interfaces};
use secondary::{nad_resource, secondary_field, write_secondary_plans};

/// How the node's pod network is configured (`--network-mode` and friends).
#[derive(Debug, Clone)]
pub struct PodNetworkOptions {
    /// `Auto`: the pod network when the node can build it, else restricted QEMU user
    /// networking (logged as a warning); `Pod`: refuse to start without it. (`User` is
    /// expressed as no `PodNetworkOptions` at all.)
    pub requested: RequestedMode,
    /// Node settings. Its `node_subnet` is replaced by the Node's `spec.podCIDR` unless
    /// `pod_cidr` is given.
    pub node: NodeNetwork,
    /// This node's subnet, overriding the node IPAM controller; recorded on the Node.
    pub pod_cidr: Option<Ipv4Cidr>,
    /// The node's underlay address: the overlay's VXLAN endpoint, published as the Node's
    /// InternalIP. `None`: no overlay (VMIs reach only their own node's VMIs).
    pub node_ip: Option<Ipv4Addr>,
}

/// What [`AgentNet::attach`] needs besides the VMI.
#[derive(Debug, Clone, Default)]
pub struct AttachOptions {
    /// The launcher receives a live migration: the pod interface keeps the address the VMI's
    /// status records, even from another node's subnet.
    pub incoming: bool,
    /// Addresses of the cluster's other VMIs (wherever they run): never handed out.
    pub reserved: std::collections::BTreeSet<Ipv4Addr>,
}

/// How long the agent waits for the node IPAM controller before it keeps retrying quietly.
const CIDR_WAIT_LOG: Duration = Duration::from_secs(10);
/// Overlay resync interval (besides Node watch events).
const OVERLAY_RESYNC: Duration = Duration::from_secs(30);

fn net_err(e: ferrovirt_network::Error) -> AgentError {
    AgentError::Reference(format!("pod network: {e}"))
}

fn kube_err(e: kube::Error) -> AgentError {
    AgentError::Reference(format!("API: {e}"))
}

/// What the launcher of one VMI needs from its network attachments.
#[derive(Debug, Default)]
pub struct Attachment {
    /// Taps by interface name (pod and secondary interfaces).
    pub taps: BTreeMap<String, PodTap>,
    /// Command prefix entering the VMI's network namespace; empty without one.
    pub exec_prefix: Vec<String>,
    /// The VMI's network namespace (`/run/netns/<name>`), the one `exec_prefix` enters.
    pub netns: Option<PathBuf>,
    /// The Primary user-defined network the pod interface is on, if any.
    pub primary_udn: Option<String>,
    /// A Layer3 network an interface is on (its addresses belong to this node: the VMI is
    /// not live-migratable).
    pub layer3_udn: Option<String>,
}

/// The explicit MAC addresses (`macAddress`) of `vmi`'s interfaces, normalized.
/// Whether `vmi` asks for a MAC address of its own on any interface.
pub fn has_explicit_macs(vmi: &VirtualMachineInstance) -> bool {
    !explicit_macs(vmi).is_empty()
}

fn explicit_macs(vmi: &VirtualMachineInstance) -> Vec<(usize, String)> {
    vmi.spec
        .as_ref()
        .and_then(|s| s.domain.devices.interfaces.as_ref())
        .into_iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, iface)| {
            iface
                .mac_address
                .as_ref()
                .map(|m| (i, m.replace('-', ":").to_lowercase()))
        })
        .collect()
}

fn is_final(vmi: &VirtualMachineInstance) -> bool {
    let phase = vmi
        .status
        .as_ref()
        .and_then(|s| s.phase.as_ref())
        .and_then(|p| serde_json::to_value(p).ok())
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default();
    phase == "Succeeded" || phase == "Failed"
}

/// Refuses a `macAddress` that another live VMI of the cluster already asked for. The older
/// VMI (creation time, then namespace/name) keeps the address, so exactly one of two
/// conflicting VMIs fails, whichever node sees it first.
pub fn check_duplicate_macs(
    vmi: &VirtualMachineInstance,
    others: &[VirtualMachineInstance],
) -> Result<(), AgentError> {
    let key = |v: &VirtualMachineInstance| {
        (
            v.metadata.creation_timestamp.as_ref().map(|t| t.0),
            v.metadata.namespace.clone().unwrap_or_default(),
            v.metadata.name.clone().unwrap_or_default(),
        )
    };
    let mine = key(vmi);
    for (i, mac) in explicit_macs(vmi) {
        for o in others {
            if o.metadata.uid == vmi.metadata.uid
                || is_final(o)
                || o.metadata.deletion_timestamp.is_some()
                || key(o) > mine
            {
                continue;
            }
            if explicit_macs(o).iter().any(|(_, m)| *m == mac) {
                return Err(AgentError::invalid(
                    format!("spec.domain.devices.interfaces[{i}].macAddress"),
                    format!(
                        "MAC address {mac} is already in use by VirtualMachineInstance {}/{}",
                        o.metadata.namespace.as_deref().unwrap_or("default"),
                        o.metadata.name.as_deref().unwrap_or("")
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// The agent's networking state.
pub struct AgentNet {
    /// `None`: user networking (asked for, or the fallback of `auto`).
    pub(crate) opts: Option<PodNetworkOptions>,
    /// The mode in force (after [`AgentNet::resolve`]).
    mode: NetworkMode,
    pub(crate) cfg: LauncherConfig,
    /// The node network once its subnet is known ([`AgentNet::init`]).
    node: OnceLock<NodeNetwork>,
    /// Pod-network attachments (their DHCP servers) per VMI uid.
    attachments: Mutex<HashMap<String, ferrovirt_network::Attached>>,
    /// DHCP servers of secondary interfaces (Localnet with IPAM) per VMI uid and interface.
    secondary_dhcp: Mutex<HashMap<String, BTreeMap<String, ferrovirt_network::dhcp::DhcpServer>>>,
    /// The addresses of the VMIs this node runs (for the routes of moved addresses).
    hosted: crate::pod_routes::Hosted,
    /// Primary user-defined networks: held while one is made, synced or removed.
    pub(crate) udns: crate::udn_net::UdnState,
}

impl AgentNet {
    pub fn new(opts: Option<PodNetworkOptions>, cfg: LauncherConfig) -> Self {
        let mode = if opts.is_some() {
            NetworkMode::Pod
        } else {
            NetworkMode::User
        };
        AgentNet {
            opts,
            mode,
            cfg,
            node: OnceLock::new(),
            attachments: Mutex::new(HashMap::new()),
            secondary_dhcp: Mutex::new(HashMap::new()),
            hosted: Default::default(),
            udns: Default::default(),
        }
    }

    /// Whether the node has a pod network.
    pub fn enabled(&self) -> bool {
        self.opts.is_some()
    }

    /// The named namespace playing the node (`--node-netns`), if any: node-to-node sockets
    /// (the migration stream) are made there.
    pub fn node_netns(&self) -> Option<String> {
        self.opts.as_ref().and_then(|o| o.node.netns.clone())
    }

    /// Records that the VMI `uid` runs (its guest) on this node: an address of another
    /// node's subnet is then routed here and published on the Node.
    pub fn host(&self, uid: &str) {
        if self.opts.is_none() {
            return;
        }
        if let Some(p) = launchers::read_network_plan(&self.cfg.vmi_dir(uid))
            && p.udn.is_none()
        {
            self.hosted.insert(uid, p.address);
        }
    }

    /// Records that the VMI `uid` no longer runs here (moved away or stopped).
    pub fn unhost(&self, uid: &str) {
        self.hosted.remove(uid);
    }

    /// The address to publish as the Node's InternalIP, when the overlay defines one.
    pub fn internal_ip(&self) -> Option<String> {
        self.opts
            .as_ref()
            .and_then(|o| o.node_ip)
            .map(|ip| ip.to_string())
    }

    /// The network mode in force (reported on the Node as
    /// [`ferrovirt_network::mode::NODE_LABEL`]).
    pub fn mode(&self) -> NetworkMode {
        self.mode
    }

    /// Settles the network mode before anything else (so the agent fails early and clearly):
    /// checks the tools and privileges the pod network needs; `auto` without them falls back
    /// to user networking with a warning, an explicit `pod` is an error. Logs the decision.
    pub async fn resolve(&mut self) -> Result<NetworkMode, AgentError> {
        let requested = match &self.opts {
            Some(o) => o.requested,
            None => RequestedMode::User,
        };
        let preflight = match requested {
            RequestedMode::User => Ok(()),
            _ => ferrovirt_network::apply::preflight().await,
        };
        let d = ferrovirt_network::mode::decide(requested, &preflight).map_err(net_err)?;
        if d.fell_back {
            tracing::warn!(network_mode = %d.mode, "{}", d.reason);
        } else {
            tracing::info!(network_mode = %d.mode, "{}", d.reason);
        }
        if d.mode == NetworkMode::User {
            self.opts = None;
        }
        self.mode = d.mode;
        Ok(d.mode)
    }

    /// After the Node is registered: settles the node's subnet (records `--pod-cidr` on the
    /// Node after checking it against the other Nodes, or waits for the node IPAM controller
    /// to set `spec.podCIDR`), sets up the node bridge and NAT and the overlay device.
    pub async fn init(&self, client: &Client, node_name: &str) -> Result<(), AgentError> {
        let Some(opts) = &self.opts else {
            return Ok(());
        };
        let nodes: Api<Node> = Api::all(client.clone());
        let subnet = match opts.pod_cidr {
            Some(cidr) => {
                let list = nodes.list(&ListParams::default()).await.map_err(kube_err)?;
                let others: Vec<(String, Option<String>)> = list
                    .items
                    .iter()
                    .map(|n| (n.metadata.name.clone().unwrap_or_default(), pod_cidr_of(n)))
                    .collect();
                ferrovirt_network::node_cidrs::check_own(node_name, cidr, &others)
                    .map_err(|e| AgentError::Reference(format!("--pod-cidr: {e}")))?;
                let patch =
                    json!({"spec": {"podCIDR": cidr.to_string(), "podCIDRs": [cidr.to_string()]}});
                nodes
                    .patch(node_name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(kube_err)?;
                cidr
            }
            None => wait_for_pod_cidr(&nodes, node_name).await?,
        };
        let mut node = opts.node.clone();
        node.node_subnet = subnet;
        node.validate().map_err(net_err)?;
        ferrovirt_network::setup_node(&node)
            .await
            .map_err(net_err)?;
        if let Some(ip) = opts.node_ip {
            let ov = Overlay::new(node_name, ip);
            ferrovirt_network::pod::setup_overlay(&node, &ov)
                .await
                .map_err(net_err)?;
        }
        tracing::info!(subnet = %node.node_subnet, overlay = ?opts.node_ip, "pod network ready");
        let _ = self.node.set(node);
        // User-defined networks no VMI of this node uses any more (deleted while the agent
        // was down).
        self.gc_udns(None).await;
        Ok(())
    }

    /// The node network once known (None on user networking).
    pub fn node_network(&self) -> Option<&NodeNetwork> {
        self.node.get()
    }

    /// Keeps the overlay's peers equal to the other Nodes (watch plus periodic resync).
    /// Returns at once when the node has no overlay.
    pub async fn run_overlay(&self, client: Client, node_name: String) {
        use futures::StreamExt;
        use kube::runtime::WatchStreamExt;
        let (Some(node), Some(ip)) = (self.node.get(), self.opts.as_ref().and_then(|o| o.node_ip))
        else {
            return std::future::pending().await;
        };
        let ov = Overlay::new(&node_name, ip);
        let api: Api<Node> = Api::all(client);
        // Nodes come from a reflector cache (one list, then the watch): no list per pass.
        let (cache, writer) = kube::runtime::reflector::store::<Node>();
        let mut events = kube::runtime::reflector(
            writer,
            kube::runtime::watcher(api.clone(), Default::default()).default_backoff(),
        )
        .boxed();
        let mut last_notes = Vec::new();
        let mut last_sources: Option<Vec<Ipv4Addr>> = None;
        let mut routes = RouteState {
            api: api.clone(),
            node_name: node_name.clone(),
            notes: Vec::new(),
            published: None,
        };
        // The first pass waits for the first complete list (an empty cache has no peers).
        while let Some(ev) = events.next().await {
            if matches!(ev, Ok(kube::runtime::watcher::Event::InitDone)) {
                break;
            }
        }
        loop {
            let list = cache.state();
            let infos: Vec<NodeInfo> = list.iter().map(|n| node_info(n)).collect();
            let (peers, notes) = ferrovirt_network::overlay::peers(node, &node_name, &infos);
            if notes != last_notes {
                for n in &notes {
                    tracing::info!("overlay: {n}");
                }
                last_notes = notes;
            }
            // The source filter changes only with the peer set (a replace resets
            // its drop counter).
            let mut sources: Vec<Ipv4Addr> = peers.iter().map(|p| p.underlay).collect();
            sources.sort_unstable();
            sources.dedup();
            if last_sources.as_ref() != Some(&sources) {
                match ferrovirt_network::pod::set_overlay_sources(node, &ov, &peers).await {
                    Ok(()) => {
                        tracing::info!(?sources, "overlay: VXLAN accepted only from these nodes");
                        last_sources = Some(sources);
                    }
                    Err(e) => tracing::warn!("overlay source filter: {e}"),
                }
            }
            match ferrovirt_network::pod::sync_overlay(node, &ov, &peers).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(peers = peers.len(), steps = n, "overlay synced"),
                Err(e) => tracing::warn!("overlay sync: {e}"),
            }
            self.sync_moved_routes(node, &ov, &peers, &list, &mut routes)
                .await;
            let underlays = peers.iter().map(|p| p.underlay).collect();
            let l3: Vec<ferrovirt_network::udn_l3::L3Node> = list
                .iter()
                .map(|n| ferrovirt_network::udn_l3::L3Node {
                    name: n.metadata.name.clone().unwrap_or_default(),
                    underlay: node_info(n).internal_ip.and_then(|i| i.parse().ok()),
                    node_subnets: n.metadata.annotations.as_ref().and_then(|a| {
                        a.get(ferrovirt_network::udn_l3::NODE_SUBNETS_ANNOTATION)
                            .cloned()
                    }),
                })
                .collect();
            self.sync_udns(Some(underlays), Some((node_name.clone(), l3)))
                .await;
            // Wait for a Node change, a change of the VMIs run here, or the resync interval.
            let _ = tokio::time::timeout(OVERLAY_RESYNC, async {
                let hosted = self.hosted.changed();
                tokio::pin!(hosted);
                loop {
                    let ev = tokio::select! {
                        _ = &mut hosted => break,
                        ev = events.next() => ev,
                    };
                    match ev {
                        Some(Ok(kube::runtime::watcher::Event::Apply(_)))
                        | Some(Ok(kube::runtime::watcher::Event::Delete(_)))
                        | Some(Ok(kube::runtime::watcher::Event::InitDone)) => break,
                        Some(_) => {}
                        None => {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            break;
                        }
                    }
                }
            })
            .await;
        }
    }

    /// One pass over the routes of moved addresses: the `/32`s from the other Nodes' claims
    /// and this node's own VMIs ([`ferrovirt_network::routes::desired`]) into the kernel, then
    /// this node's claim onto its Node when it changed.
    async fn sync_moved_routes(
        &self,
        node: &NodeNetwork,
        ov: &Overlay,
        peers: &[ferrovirt_network::Peer],
        nodes: &[std::sync::Arc<Node>],
        state: &mut RouteState,
    ) {
        let nodes: Vec<Node> = nodes.iter().map(|n| (**n).clone()).collect();
        let (claims, mut notes) = crate::pod_routes::claims(&nodes, &state.node_name);
        let hosted = self.hosted.addresses();
        let (desired, more) = ferrovirt_network::routes::desired(node, peers, &claims, &hosted);
        notes.extend(more);
        if notes != state.notes {
            for n in &notes {
                tracing::warn!("pod routes: {n}");
            }
            state.notes = notes;
        }
        let claim = ferrovirt_network::routes::encode_claims(
            &ferrovirt_network::routes::away_addresses(node, &hosted),
        );
        // The claim is written while the local routes change: the other nodes start
        // routing here one API round trip sooner.
        let publish = async {
            if state.published.as_ref() == Some(&claim) {
                return None;
            }
            let patch = json!({"metadata": {"annotations": {
                ferrovirt_network::routes::ROUTES_ANNOTATION: claim
            }}});
            Some(
                state
                    .api
                    .patch(
                        &state.node_name,
                        &PatchParams::default(),
                        &Patch::Merge(&patch),
                    )
                    .await,
            )
        };
        let (synced, published) = tokio::join!(
            ferrovirt_network::pod::sync_routes(node, &ov.device, &desired),
            publish
        );
        match synced {
            Ok(0) => {}
            Ok(n) => tracing::info!(routes = desired.len(), steps = n, "pod routes synced"),
            Err(e) => tracing::warn!("pod routes: {e}"),
        }
        match published {
            None => {}
            Some(Ok(_)) => {
                tracing::info!(?claim, "pod routes published");
                state.published = Some(claim);
            }
            Some(Err(e)) => tracing::warn!("publishing pod routes: {e}"),
        }
    }

    /// Attaches the VMI's networks before its launcher starts: the pod-network interface
    /// (when the VMI has one) and every secondary interface. On failure whatever was created
    /// is removed again and the error names the interface or network at fault.
    pub async fn attach(
        &self,
        client: &Client,
        vmi: &VirtualMachineInstance,
        uid: &str,
        dir: &Path,
        opts: &AttachOptions,
    ) -> Result<Attachment, AgentError> {
        let secondaries = secondary_interfaces(vmi)?;
        if !opts.incoming
            && self.node.get().is_none()
            && crate::udn::wants_primary(client, vmi).await?
        {
            return Err(crate::udn::needs_pod_network(vmi));
        }
        let Some(node) = self.node.get() else {
            if let Some(s) = secondaries.first() {
                return Err(AgentError::unsupported(
                    s.network_field.clone(),
                    "secondary (multus) networks need the node's pod network (this node runs --network-mode user)",
                ));
            }
            return Ok(Attachment::default());
        };
        match self.attach_inner(client, node, vmi, uid, dir, opts).await {
            Ok(a) => Ok(a),
            Err(e) => {
                self.detach(uid).await;
                Err(e)
            }
        }
    }

    async fn attach_inner(
        &self,
        client: &Client,
        node: &NodeNetwork,
        vmi: &VirtualMachineInstance,
        uid: &str,
        dir: &Path,
        opts: &AttachOptions,
    ) -> Result<Attachment, AgentError> {
        let secondaries = &secondary_interfaces(vmi)?;
        let mut out = Attachment::default();
        // The namespace of the pod interface, which the secondary interfaces share.
        let mut pod_netns = None;
        // A live migration's target joins the same network with the same address (the
        // VMI's annotation moves with it).
        let udn = self.primary_udn(client, vmi, node).await?;
        if udn.is_none()
            && let Some(e) = crate::udn::l2bridge_outside_udn(vmi)
        {
            return Err(e);
        }
        if let Some(pi) = mapping::pod_interface(vmi)? {
            let plan = {
                // Held while allocating, so two VMIs starting together never pick one address.
                let mut attachments = self.attachments.lock().await;
                attachments.remove(uid); // one DHCP server per VMI
                match launchers::read_network_plan(dir) {
                    Some(p) => p,
                    None if udn.is_some() => {
                        let u = udn.as_ref().expect("checked");
                        let plan = crate::udn_net::vmi_plan(u, vmi, uid, &pi, node, opts.incoming)?;
                        launchers::write_network_plan(dir, &plan)?;
                        plan
                    }
                    None => {
                        let (ns, name) = ns_name(vmi);
                        let mut req =
                            ferrovirt_network::PodRequest::new(uid, &ns, &name, pi.binding.clone());
                        req.interface = pi.name.clone();
                        req.mac = Some(pi.mac);
                        req.queues = mapping::nic_queues(vmi, &pi.name);
                        req.used = self
                            .cfg
                            .local_uids()
                            .iter()
                            .filter(|u| u.as_str() != uid)
                            .filter_map(|u| launchers::read_network_plan(&self.cfg.vmi_dir(u)))
                            .map(|p| p.address)
                            .chain(opts.reserved.iter().copied())
                            .collect();
                        if opts.incoming {
                            // A live migration keeps the VMI's address (and MAC).
                            req.address = crate::pod_routes::status_address(vmi, &pi.name);
                            req.migrated = true;
                        }
                        let mut plan =
                            ferrovirt_network::PodPlan::build(node, &req).map_err(net_err)?;
                        plan.netns = incoming_netns(
                            &plan.netns,
                            opts.incoming,
                            node.netns.as_deref(),
                            ferrovirt_network::netns::exists(&plan.netns),
                        );
                        launchers::write_network_plan(dir, &plan)?;
                        plan
                    }
                }
            };
            pod_netns = Some(plan.netns.clone());
            if let Some(net) = &plan.udn {
                self.ensure_udn(net).await?;
                out.primary_udn = Some(net.name.clone());
                out.layer3_udn = net.layer3.then(|| net.name.clone());
            }
            let attached = ferrovirt_network::setup(&plan).await.map_err(net_err)?;
            out.taps.insert(
                pi.name.clone(),
                PodTap {
                    ifname: attached.tap.clone(),
                    mac: attached.mac.to_string(),
                },
            );
            out.exec_prefix = attached.exec_prefix();
            out.netns = Some(ferrovirt_network::netns::path(&attached.netns));
            self.attachments
                .lock()
                .await
                .insert(uid.to_string(), attached);
        }
        if secondaries.is_empty() {
            return Ok(out);
        }
        let mut plans = Vec::new();
        for (k, s) in secondaries.iter().enumerate() {
            let nad_api: Api<DynamicObject> =
                Api::namespaced_with(client.clone(), &s.nad_namespace, &nad_resource());
            let nad = nad_api.get_opt(&s.nad_name).await.map_err(kube_err)?;
            let Some(nad) = nad else {
                return Err(AgentError::invalid(
                    s.network_field.clone(),
                    format!(
                        "network {:?}: NetworkAttachmentDefinition {}/{} not found",
                        s.name, s.nad_namespace, s.nad_name
                    ),
                ));
            };
            let config = nad.data["spec"]["config"].as_str().unwrap_or("");
            let in_nad = |e: &dyn std::fmt::Display| {
                AgentError::invalid(
                    s.network_field.clone(),
                    format!(
                        "network {:?}: NetworkAttachmentDefinition {}/{}: {e}",
                        s.name, s.nad_namespace, s.nad_name
                    ),
                )
            };
            let (config, ipam, udn) = match secondary::nad_attach(&self.cfg.data_dir, vmi, config)
                .map_err(|e| in_nad(&e))?
            {
                secondary::NadAttach::Bridge(b, ipam) => (b, ipam, None),
                secondary::NadAttach::Udn(c) => {
                    let vni = secondary::wait_vni(&nad_api, &s.nad_name, &nad)
                        .await
                        .map_err(|e| in_nad(&e))?;
                    let net = self.secondary_udn(client, vmi, &c, vni, node).await;
                    let (b, net) = net.map_err(|e| in_nad(&e))?;
                    out.layer3_udn = out.layer3_udn.or(net.layer3.then(|| net.name.clone()));
                    (b, !c.subnets.is_empty(), Some(net))
                }
            };
            let req = ferrovirt_network::SecondaryRequest {
                uid: uid.to_string(),
                interface: s.name.clone(),
                nad: format!("{}/{}", s.nad_namespace, s.nad_name),
                config,
                index: k as u32 + 1,
                mac: s.mac,
                queues: mapping::nic_queues(vmi, &s.name),
            };
            let mut plan = SecondaryPlan::build(node, &req).map_err(net_err)?;
            if let Some(net) = &udn {
                ferrovirt_network::udn::join_secondary(&mut plan, net);
            }
            if ipam {
                // The controller allots the address (k8s.ovn.org/pod-networks); DHCP offers it.
                let (address, subnet) = secondary::wait_allotted(client, vmi, &req.nad)
                    .await
                    .map_err(|e| in_nad(&e))?;
                let (_, name) = ns_name(vmi);
                let mut l =
                    ferrovirt_network::localnet::lease(address, subnet, s.mac, plan.mtu, &name);
                if let Some(net) = &plan.udn {
                    ferrovirt_network::udn_l3::secondary_lease(net, &mut l)
                        .map_err(|e| in_nad(&e))?;
                }
                plan.lease = Some(l);
            }
            plan.netns = match &pod_netns {
                Some(n) => n.clone(),
                None => incoming_netns(
                    &plan.netns,
                    opts.incoming,
                    node.netns.as_deref(),
                    ferrovirt_network::netns::exists(&plan.netns),
                ),
            };
            plans.push(plan);
        }
        // Recorded before anything is created, so teardown finds it all.
        write_secondary_plans(dir, &plans)?;
        for p in &plans {
            if let Some(net) = &p.udn {
                self.ensure_udn(net).await.map_err(|e| {
                    AgentError::Reference(format!("{}: {e}", secondary_field(secondaries, p)))
                })?;
            }
            ferrovirt_network::pod::setup_secondary(p)
                .await
                .map_err(|e| {
                    AgentError::Reference(format!("{}: {e}", secondary_field(secondaries, p)))
                })?;
            self.start_secondary_dhcp(uid, p).await.map_err(|e| {
                AgentError::Reference(format!("{}: {e}", secondary_field(secondaries, p)))
            })?;
            out.taps.insert(
                p.interface.clone(),
                PodTap {
                    ifname: p.tap.clone(),
                    mac: p.mac.to_string(),
                },
            );
        }
        if out.exec_prefix.is_empty() {
            out.exec_prefix = ferrovirt_network::netns::exec_prefix(&plans[0].netns);
            out.netns = Some(ferrovirt_network::netns::path(&plans[0].netns));
        }
        Ok(out)
    }

    /// After an agent restart: re-applies the plans of a running VMI (links are kept) and
    /// restarts its DHCP server.
    pub async fn reattach(&self, uid: &str) {
        if self.node.get().is_none() || self.attachments.lock().await.contains_key(uid) {
            return;
        }
        let dir = self.cfg.vmi_dir(uid);
        if let Some(plan) = launchers::read_network_plan(&dir) {
            if let Some(net) = &plan.udn
                && let Err(e) = self.ensure_udn(net).await
            {
                tracing::warn!(%uid, "re-attaching user-defined network {}: {e}", net.name);
            }
            match ferrovirt_network::setup(&plan).await {
                Ok(a) => {
                    self.attachments.lock().await.insert(uid.to_string(), a);
                }
                Err(e) => tracing::warn!(%uid, "re-attaching the pod network: {e}"),
            }
        }
        for p in read_secondary_plans(&dir) {
            if let Some(net) = &p.udn
                && let Err(e) = self.ensure_udn(net).await
            {
                tracing::warn!(%uid, "re-attaching user-defined network {}: {e}", net.name);
            }
            if let Err(e) = ferrovirt_network::pod::setup_secondary(&p).await {
                tracing::warn!(%uid, "re-attaching network {}: {e}", p.interface);
            }
            if let Err(e) = self.start_secondary_dhcp(uid, &p).await {
                tracing::warn!(%uid, "DHCP of network {}: {e}", p.interface);
            }
        }
    }

    /// Starts (and keeps) the DHCP server of a secondary interface whose plan has a lease.
    async fn start_secondary_dhcp(
        &self,
        uid: &str,
        p: &SecondaryPlan,
    ) -> Result<(), ferrovirt_network::Error> {
        if let Some(server) = ferrovirt_network::pod::start_secondary_dhcp(p).await? {
            self.secondary_dhcp
                .lock()
                .await
                .entry(uid.to_string())
                .or_default()
                .insert(p.interface.clone(), server);
        }
        Ok(())
    }

    /// Stops the VMI's DHCP server and removes its namespace and veths (before its directory,
    /// which holds the plans, is removed).
    pub async fn detach(&self, uid: &str) {
        self.unhost(uid);
        self.attachments.lock().await.remove(uid);
        self.secondary_dhcp.lock().await.remove(uid);
        let dir = self.cfg.vmi_dir(uid);
        let mut netns = None;
        if let Some(plan) = launchers::read_network_plan(&dir) {
            if let Err(e) = ferrovirt_network::teardown(&plan).await {
                tracing::warn!(%uid, "tearing down the pod network: {e}");
            }
            netns = Some(plan.netns);
        }
        for p in read_secondary_plans(&dir) {
            if let Err(e) = ferrovirt_network::pod::teardown_secondary(&p).await {
                tracing::warn!(%uid, "tearing down network {}: {e}", p.interface);
            }
            netns.get_or_insert(p.netns);
        }
        if let Some(n) = netns
            && let Err(e) = ferrovirt_network::pod::teardown_netns(&n).await
        {
            tracing::warn!(%uid, "removing namespace {n}: {e}");
        }
        self.gc_udns(Some(uid)).await;
    }

    /// The pod-network interface name and address of a VMI, for its status.
    pub fn pod_report(&self, vmi: &VirtualMachineInstance, uid: &str) -> Option<(String, String)> {
        self.opts.as_ref()?;
        let p = launchers::read_network_plan(&self.cfg.vmi_dir(uid))?;
        let pi = mapping::pod_interface(vmi).ok().flatten()?;
        Some((pi.name, p.address.to_string()))
    }
}

/// The name of a VMI's network namespace on this node. Nodes played by namespaces of one
/// host (`--node-netns`) share /run/netns: an incoming migration whose usual name is `taken`
/// there (by the source node's namespace of the VMI) gets the node's namespace name appended.
/// On real nodes the usual name is never taken.
pub fn incoming_netns(
    usual: &str,
    incoming: bool,
    node_netns: Option<&str>,
    taken: bool,
) -> String {
    match node_netns {
        Some(n) if incoming && taken => format!("{usual}-{n}"),
        _ => usual.to_string(),
    }
}

/// What the overlay loop remembers between passes about the routes of moved addresses.
struct RouteState {
    /// Nodes, to write this node's claim.
    api: Api<Node>,
    node_name: String,
    notes: Vec<String>,
    /// The claim last written on the Node (`None`: not written yet by this process).
    published: Option<Option<String>>,
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

fn pod_cidr_of(n: &Node) -> Option<String> {
    n.spec.as_ref().and_then(|s| {
        s.pod_cidr
            .clone()
            .or_else(|| s.pod_cidrs.as_ref().and_then(|c| c.first().cloned()))
    })
}

fn node_info(n: &Node) -> NodeInfo {
    NodeInfo {
        name: n.metadata.name.clone().unwrap_or_default(),
        pod_cidr: pod_cidr_of(n),
        internal_ip: n
            .status
            .as_ref()
            .and_then(|s| s.addresses.as_ref())
            .and_then(|a| a.iter().find(|a| a.type_ == "InternalIP"))
            .map(|a| a.address.clone()),
    }
}

/// Waits until the node IPAM controller has set the Node's `spec.podCIDR`.
async fn wait_for_pod_cidr(nodes: &Api<Node>, name: &str) -> Result<Ipv4Cidr, AgentError> {
    let started = std::time::Instant::now();
    let mut logged = started;
    loop {
        match nodes.get_opt(name).await {
            Ok(Some(n)) => {
                if let Some(c) = pod_cidr_of(&n) {
                    return c.parse().map_err(|e| {
                        AgentError::Reference(format!("node {name}: spec.podCIDR: {e}"))
                    });
                }
            }
            Ok(None) => {}
            Err(e) => tracing::debug!("reading node {name}: {e}"),
        }
        if logged.elapsed() > CIDR_WAIT_LOG {
            logged = std::time::Instant::now();
            tracing::warn!(
                "node {name} has no spec.podCIDR after {:?}: is the node IPAM controller running (ferrovirt server without --disable-controllers)? Or give --pod-cidr",
                started.elapsed()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(
        name: &str,
        created: i64,
        macs: &[Option<&str>],
        multus: bool,
    ) -> VirtualMachineInstance {
        let ifaces: Vec<_> = macs
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let mut v = json!({"name": format!("n{i}"), "bridge": {}});
                if let Some(m) = m {
                    v["macAddress"] = json!(m);
                }
                v
            })
            .collect();
        let nets: Vec<_> = (0..macs.len())
            .map(|i| {
                if multus {
                    json!({"name": format!("n{i}"), "multus": {"networkName": if i == 0 { "br-test".to_string() } else { format!("other/nad{i}") }}})
                } else {
                    json!({"name": format!("n{i}"), "pod": {}})
                }
            })
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}"),
                         "creationTimestamp": format!("2026-01-01T00:00:{created:02}Z")},
            "spec": {"domain": {"devices": {"interfaces": ifaces}}, "networks": nets}
        }))
        .unwrap()
    }

    #[test]
    fn an_incoming_vmi_gets_a_namespace_of_its_own_on_a_shared_host() {
        assert_eq!(
            incoming_netns("fv-u", true, Some("nodeb"), true),
            "fv-u-nodeb"
        );
        assert_eq!(incoming_netns("fv-u", true, Some("nodeb"), false), "fv-u");
        assert_eq!(incoming_netns("fv-u", false, Some("nodeb"), true), "fv-u");
        assert_eq!(incoming_netns("fv-u", true, None, true), "fv-u");
    }

    #[test]
    fn the_older_vmi_keeps_a_duplicate_mac() {
        let a = vmi("a", 1, &[Some("02:00:00:00:00:01")], false);
        let b = vmi("b", 2, &[None, Some("02-00-00-00-00-01")], false);
        let c = vmi("c", 3, &[Some("02:00:00:00:00:02")], false);
        let all = [a.clone(), b.clone(), c.clone()];
        check_duplicate_macs(&a, &all).unwrap();
        check_duplicate_macs(&c, &all).unwrap();
        let e = check_duplicate_macs(&b, &all).unwrap_err().to_string();
        assert_eq!(
            e,
            "spec.domain.devices.interfaces[1].macAddress: MAC address 02:00:00:00:00:01 is already in use by VirtualMachineInstance default/a"
        );
        // A finished VMI no longer holds its MAC.
        let mut done = a.clone();
        done.status = serde_json::from_value(json!({"phase": "Succeeded"})).unwrap();
        check_duplicate_macs(&b, &[done, b.clone()]).unwrap();
    }

    #[test]
    fn secondary_interfaces_resolve_their_nad() {
        let v = vmi("s", 1, &[None, Some("02:00:00:00:00:09")], true);
        let s = secondary_interfaces(&v).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(
            (s[0].nad_namespace.as_str(), s[0].nad_name.as_str()),
            ("default", "br-test")
        );
        assert_eq!(
            (s[1].nad_namespace.as_str(), s[1].nad_name.as_str()),
            ("other", "nad1")
        );
        assert_eq!(
            s[0].mac.to_string(),
            mapping::derived_mac("default", "s", "n0")
        );
        assert_eq!(s[1].mac.to_string(), "02:00:00:00:00:09");
        assert_eq!(s[1].network_field, "spec.networks[1].multus.networkName");
        // Only the bridge binding.
        let mut raw = serde_json::to_value(&v).unwrap();
        raw["spec"]["domain"]["devices"]["interfaces"][0] = json!({"name": "n0", "masquerade": {}});
        let v: VirtualMachineInstance = serde_json::from_value(raw).unwrap();
        let e = secondary_interfaces(&v).unwrap_err().to_string();
        assert!(
            e.contains("interfaces[0]: interfaces on multus networks"),
            "{e}"
        );
    }
}
