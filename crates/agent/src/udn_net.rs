//! The node side of user-defined networks (Primary, and Secondary Layer2 and Layer3 ones
//! named as Multus networks) (docs/networking.md "User-defined
//! networks"): [`AgentNet`]'s per-network namespaces (made when the first VMI of a network
//! starts on the node, their head-end replication kept equal to the overlay peers, removed
//! when no VMI of the node uses the network any more and, at agent start, when left over).
//! The decisions are `ferrovirt_network::udn`'s; this module runs them.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_network::NodeNetwork;
use ferrovirt_network::udn::UdnNetwork;

use crate::error::AgentError;
use crate::launchers;
use crate::network::AgentNet;

/// What the agent keeps about user-defined networks; its lock is held while a network is
/// made, synced or removed, so a network is never removed under a VMI that is joining it.
#[derive(Default)]
pub struct UdnState(tokio::sync::Mutex<Inner>);

#[derive(Default)]
struct Inner {
    /// The overlay peers' underlay addresses, once the overlay loop has seen the Nodes.
    peers: Option<BTreeSet<Ipv4Addr>>,
    /// The Nodes as Layer3 networks see them (name, underlay, host subnets), and this node's
    /// name, once the overlay loop has seen them.
    l3_nodes: Option<(String, Vec<ferrovirt_network::udn_l3::L3Node>)>,
}

/// Syncs a network's forwarding state with the peers: a Layer2 network's flood list, a
/// Layer3 network's routes to the other nodes' host subnets.
async fn sync_one(net: &UdnNetwork, st: &Inner) -> Result<usize, ferrovirt_network::Error> {
    if net.layer3 {
        let Some((me, nodes)) = &st.l3_nodes else {
            return Ok(0);
        };
        let peers = ferrovirt_network::udn_l3::peers(&net.name, me, net.subnet, nodes);
        return ferrovirt_network::pod::sync_udn_routes(net, &peers).await;
    }
    match &st.peers {
        Some(peers) => ferrovirt_network::pod::sync_udn_fdb(net, peers).await,
        None => Ok(0),
    }
}

/// The VMI's plan on its Primary UDN (`pi`: its pod-network interface); an incoming live
/// migration's namespace is named as [`crate::network::incoming_netns`] says.
pub fn vmi_plan(
    u: &crate::udn::PrimaryUdn,
    vmi: &VirtualMachineInstance,
    uid: &str,
    pi: &crate::mapping::PodInterface,
    node: &NodeNetwork,
    incoming: bool,
) -> Result<ferrovirt_network::PodPlan, AgentError> {
    let ns = vmi
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let name = vmi.metadata.name.clone().unwrap_or_default();
    let v = ferrovirt_network::udn::UdnVmi {
        uid,
        namespace: &ns,
        name: &name,
        interface: &pi.name,
        mac: Some(pi.mac),
        queues: crate::mapping::nic_queues(vmi, &pi.name),
        node,
    };
    let mut plan = ferrovirt_network::udn::vmi_plan(&u.network, &v, u.address)
        .map_err(|e| AgentError::Reference(format!("{}: {e}", u.nad)))?;
    plan.netns = crate::network::incoming_netns(
        &plan.netns,
        incoming,
        node.netns.as_deref(),
        ferrovirt_network::netns::exists(&plan.netns),
    );
    Ok(plan)
}

impl AgentNet {
    /// The VMI's Primary UDN, if its namespace has one ([`crate::udn::resolve`]); a Layer2
    /// network always has its gateway (the subnet's first address, which the controller never
    /// hands out: DHCP router, Services), egress only on a node with an uplink; a Layer3
    /// network's gateway (its host subnet's first address) is on its bridge anyway, the
    /// gateway here adds the egress on a node with an uplink.
    pub(crate) async fn primary_udn(
        &self,
        client: &kube::Client,
        vmi: &VirtualMachineInstance,
        node: &NodeNetwork,
    ) -> Result<Option<crate::udn::PrimaryUdn>, AgentError> {
        let local = self.opts.as_ref().and_then(|o| o.node_ip);
        let mut u = crate::udn::resolve(client, vmi, node.netns.as_deref(), local).await?;
        if let Some(u) = u.as_mut()
            && (!u.network.layer3 || node.uplink.is_some())
        {
            u.network.gateway = Some(ferrovirt_network::udn::UdnGateway {
                address: u.network.subnet.gateway(),
                uplink: node.uplink.clone(),
            });
        }
        Ok(u)
    }

    /// A VMI's Secondary UDN from its NAD's config `c` and VNI, with the host bridge of its
    /// interface (the network's bridge, its MTU). Layer3: waits (bounded by
    /// [`crate::udn::ANNOTATION_WAIT`], reading the Node again) for this node's host subnet of
    /// the network in the Node annotation `k8s.ovn.org/node-subnets`; never guessed.
    pub(crate) async fn secondary_udn(
        &self,
        client: &kube::Client,
        vmi: &VirtualMachineInstance,
        c: &ferrovirt_network::udn::NadConfig,
        vni: u32,
        node: &NodeNetwork,
    ) -> Result<(ferrovirt_network::BridgeConfig, UdnNetwork), ferrovirt_network::Error> {
        let local = self.opts.as_ref().and_then(|o| o.node_ip);
        let host = match c.topology.as_str() {
            "layer3" => Some(wait_host_subnet(client, vmi, &c.name).await?),
            _ => None,
        };
        let net = UdnNetwork::from_secondary_nad(c, vni, host, node.netns.as_deref(), local)?;
        let b = ferrovirt_network::BridgeConfig {
            bridge: ferrovirt_network::udn::BRIDGE.into(),
            vlan: None,
            mtu: Some(net.mtu),
        };
        Ok((b, net))
    }

    /// The networks the node's VMIs use (from their plans: the pod interface's Primary UDN
    /// and the Multus interfaces' Secondary UDNs), by namespace; `except` is left out
    /// (a VMI being detached).
    pub(crate) fn udns_in_use(&self, except: Option<&str>) -> BTreeMap<String, UdnNetwork> {
        self.cfg
            .local_uids()
            .iter()
            .filter(|u| Some(u.as_str()) != except)
            .flat_map(|u| {
                let dir = self.cfg.vmi_dir(u);
                let primary = launchers::read_network_plan(&dir).and_then(|p| p.udn);
                let secondary = crate::network::read_secondary_plans(&dir)
                    .into_iter()
                    .filter_map(|p| p.udn);
                primary.into_iter().chain(secondary)
            })
            .map(|n| (n.netns.clone(), n))
            .collect()
    }

    /// Makes (or repairs) the network's namespace, bridge and VXLAN device and its flood
    /// list or (Layer3) routes (when the peers are known). Call after the VMI's plan is written.
    pub(crate) async fn ensure_udn(&self, net: &UdnNetwork) -> Result<(), AgentError> {
        let st = self.udns.0.lock().await;
        let cluster = match self.node_network() {
            Some(n) => n.ipam.cluster,
            None => return Err(AgentError::Reference("the pod network is not ready".into())),
        };
        ferrovirt_network::pod::setup_udn_network(net, cluster)
            .await
            .map_err(|e| {
                AgentError::Reference(format!("user-defined network {}: {e}", net.name))
            })?;
        sync_one(net, &st).await.map_err(|e| {
            AgentError::Reference(format!("user-defined network {}: {e}", net.name))
        })?;
        Ok(())
    }

    /// One pass of the overlay loop: remembers the peers, removes unused networks and syncs
    /// the flood list of every network in use.
    pub(crate) async fn sync_udns(
        &self,
        peers: Option<BTreeSet<Ipv4Addr>>,
        l3_nodes: Option<(String, Vec<ferrovirt_network::udn_l3::L3Node>)>,
    ) {
        let node_netns = self.node_netns();
        let mut st = self.udns.0.lock().await;
        if peers.is_some() {
            st.peers = peers;
        }
        if l3_nodes.is_some() {
            st.l3_nodes = l3_nodes;
        }
        let in_use = self.udns_in_use(None);
        remove_unused(node_netns.as_deref(), &in_use).await;
        for net in in_use.values() {
            match sync_one(net, &st).await {
                Ok(0) => {}
                Ok(n) => {
                    tracing::info!(network = %net.name, steps = n, "user-defined network flood list synced")
                }
                Err(e) => {
                    tracing::warn!(network = %net.name, "user-defined network flood list: {e}")
                }
            }
        }
    }

    /// Removes the networks no VMI of this node uses (but `except`, being detached).
    pub(crate) async fn gc_udns(&self, except: Option<&str>) {
        if self.node_network().is_none() {
            return;
        }
        let node_netns = self.node_netns();
        let _st = self.udns.0.lock().await;
        let in_use = self.udns_in_use(except);
        remove_unused(node_netns.as_deref(), &in_use).await;
    }
}

/// This node's host subnet of Layer3 network `network` (the VMI's node's annotation).
async fn wait_host_subnet(
    client: &kube::Client,
    vmi: &VirtualMachineInstance,
    network: &str,
) -> Result<ferrovirt_network::Ipv4Cidr, ferrovirt_network::Error> {
    use ferrovirt_network::udn_l3::{NODE_SUBNETS_ANNOTATION, host_subnet};
    let node = vmi
        .status
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    let api: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client.clone());
    let started = std::time::Instant::now();
    loop {
        match api.get_opt(&node).await {
            Ok(n) => {
                let ann = n
                    .and_then(|n| n.metadata.annotations)
                    .and_then(|a| a.get(NODE_SUBNETS_ANNOTATION).cloned());
                if let Some(h) = host_subnet(ann.as_deref(), network)? {
                    return Ok(h);
                }
            }
            Err(e) => tracing::debug!("reading Node {node}: {e}"),
        }
        if started.elapsed() > crate::udn::ANNOTATION_WAIT {
            return Err(ferrovirt_network::Error::InvalidNetworkConfig(format!(
                "metadata.annotations[{NODE_SUBNETS_ANNOTATION}]: node {node:?} has no host \
                 subnet of network {network} after {}s",
                crate::udn::ANNOTATION_WAIT.as_secs()
            )));
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

/// Removes the networks' namespaces no VMI of the node uses; once one went, the node's
/// gateway table too when no network with an egress is left.
async fn remove_unused(node_netns: Option<&str>, in_use: &BTreeMap<String, UdnNetwork>) {
    let mut removed = false;
    for ns in ferrovirt_network::pod::udn_namespaces(node_netns) {
        if in_use.contains_key(&ns) {
            continue;
        }
        removed = true;
        match ferrovirt_network::pod::teardown_udn_network(&ns).await {
            Ok(()) => {
                tracing::info!(netns = %ns, "user-defined network no longer used here: removed")
            }
            Err(e) => tracing::warn!(netns = %ns, "removing user-defined network: {e}"),
        }
    }
    let egress_left = in_use
        .values()
        .any(|n| n.gateway.as_ref().is_some_and(|g| g.uplink.is_some()));
    if removed
        && let Some(a) = ferrovirt_network::udn::node_gateway_cleanup(node_netns, egress_left)
        && let Err(e) = ferrovirt_network::apply::apply_one(&a).await
    {
        tracing::warn!("removing the node's user-defined network gateway table: {e}");
    }
}
