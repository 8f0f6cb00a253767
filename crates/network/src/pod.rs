//! The agent-facing API: set up / tear down the node's pod network and one VMI's network
//! ([`setup`] returns the namespace and tap to start QEMU with, and owns the DHCP server).

use std::net::Ipv4Addr;

use crate::apply::{apply_all, apply_all_best_effort};
use crate::dhcp::{DhcpServer, ServerOptions};
use crate::error::Result;
use crate::ipam::MacAddr;
use crate::plan::{NodeNetwork, PodPlan};
use crate::render;

/// A VMI attached to the pod network. Keep it while the VMI runs: dropping it stops the DHCP
/// server (the links stay until [`teardown`]).
#[derive(Debug)]
pub struct Attached {
    /// Run the launcher (and so QEMU) inside this namespace: see [`Attached::exec_prefix`].
    pub netns: String,
    /// `NicBackend::Tap { ifname: tap }`.
    pub tap: String,
    /// The guest NIC's MAC (`Nic::mac`); DHCP answers only this MAC.
    pub mac: MacAddr,
    /// The VMI's pod-network address (status.interfaces[].ipAddress).
    pub address: Ipv4Addr,
    /// The running DHCP server.
    pub dhcp: DhcpServer,
}

impl Attached {
    /// `nsenter --net=/run/netns/<netns> --`: prepend it to the launcher's command line.
    pub fn exec_prefix(&self) -> Vec<String> {
        crate::netns::exec_prefix(&self.netns)
    }
}

/// Creates (or repairs) the node bridge, its gateway address, forwarding and the node NAT.
/// Idempotent.
pub async fn setup_node(node: &NodeNetwork) -> Result<()> {
    node.validate()?;
    apply_all(&render::node_actions(node)).await
}

/// Removes the node bridge and the node's nft table.
pub async fn teardown_node(node: &NodeNetwork) -> Result<()> {
    apply_all_best_effort(&render::node_teardown_actions(node)).await
}

/// Creates (or repairs) everything in `plan` without starting a DHCP server. Idempotent and
/// safe while QEMU runs: existing links (the tap QEMU holds) are kept, addresses and routes
/// are replaced with the same values, and the nft table is swapped atomically (conntrack
/// entries, hence open connections, survive).
///
/// Runs [`render::pod_phases`]: the namespace, then its filters and the node side of the veth
/// concurrently (independent: one touches only the namespace's nft tables, the other only
/// node-side links), then the links inside the namespace.
pub async fn setup_links(plan: &PodPlan) -> Result<()> {
    let p = render::pod_phases(plan);
    apply_all(&p.netns).await?;
    let (filters, node_side) = tokio::join!(apply_all(&p.filters), apply_all(&p.node_side));
    filters?;
    node_side?;
    apply_all(&p.inside).await
}

/// Starts the DHCP server of `plan` on the VMI namespace's bridge.
pub async fn start_dhcp(plan: &PodPlan) -> Result<DhcpServer> {
    DhcpServer::spawn(ServerOptions::new(
        Some(plan.netns.clone()),
        plan.pod_bridge.clone(),
        plan.lease.clone(),
    ))
    .await
}

/// [`setup_links`] then [`start_dhcp`]. Call [`setup_node`] once before. When re-applying in
/// the same process, drop the previous [`Attached`] first (one DHCP server per VMI).
pub async fn setup(plan: &PodPlan) -> Result<Attached> {
    setup_links(plan).await?;
    let dhcp = start_dhcp(plan).await?;
    Ok(Attached {
        netns: plan.netns.clone(),
        tap: plan.tap.clone(),
        mac: plan.guest_mac,
        address: plan.address,
        dhcp,
    })
}

/// Removes the VMI's veth and namespace (with its bridge, tap and nft table). Call it after
/// QEMU has exited; removing what is already gone is not an error.
pub async fn teardown(plan: &PodPlan) -> Result<()> {
    apply_all_best_effort(&render::pod_teardown_actions(plan)).await
}

/// Creates (or repairs) one secondary interface (veth from the host bridge into the VMI
/// namespace, in-namespace bridge, tap). Fails with [`crate::Error::MissingBridge`] when the
/// node has no bridge of that name.
pub async fn setup_secondary(plan: &crate::SecondaryPlan) -> Result<()> {
    let bridges = crate::apply::bridges(&plan.node_netns).await?;
    if !bridges.iter().any(|b| b == &plan.bridge) {
        return Err(crate::Error::MissingBridge {
            interface: plan.interface.clone(),
            bridge: plan.bridge.clone(),
            netns: plan.node_netns.clone(),
        });
    }
    if let Some(vlan) = plan.vlan {
        // First, so a kernel without VLAN filtering fails before anything is created.
        let on = crate::secondary::vlan_filtering_action(plan);
        crate::apply::apply_one(&on).await.map_err(|e| {
            let reason = match e {
                crate::Error::Command { stderr, .. } => stderr,
                other => other.to_string(),
            };
            crate::Error::VlanUnsupported {
                interface: plan.interface.clone(),
                vlan,
                bridge: plan.bridge.clone(),
                reason,
            }
        })?;
    }
    apply_all(&crate::secondary::secondary_actions(plan)).await
}

/// Starts the DHCP server of a secondary interface whose plan carries a lease (a Localnet
/// with IPAM) on its in-namespace bridge; `None` without a lease.
pub async fn start_secondary_dhcp(plan: &crate::SecondaryPlan) -> Result<Option<DhcpServer>> {
    let Some(lease) = &plan.lease else {
        return Ok(None);
    };
    DhcpServer::spawn(ServerOptions::new(
        Some(plan.netns.clone()),
        plan.pod_bridge.clone(),
        lease.clone(),
    ))
    .await
    .map(Some)
}

/// Removes one secondary interface's veth (what is already gone is skipped).
pub async fn teardown_secondary(plan: &crate::SecondaryPlan) -> Result<()> {
    apply_all_best_effort(&crate::secondary::secondary_teardown_actions(plan)).await
}

/// Removes a VMI namespace (with everything still in it), if it exists.
pub async fn teardown_netns(name: &str) -> Result<()> {
    apply_all_best_effort(&[render::Action::DelNetns(name.to_string())]).await
}

/// Creates (or repairs) the node's overlay device, with a source filter that drops every
/// VXLAN packet until [`set_overlay_sources`] names the peers. Call after [`setup_node`].
pub async fn setup_overlay(node: &NodeNetwork, ov: &crate::Overlay) -> Result<()> {
    let mut actions = crate::overlay::device_actions(node, ov);
    actions.push(crate::overlay::filter_action(node, ov, &[]));
    apply_all(&actions).await
}

/// Accepts VXLAN packets only from the underlay addresses of `peers` (the Nodes' InternalIPs):
/// atomically replaces the overlay's source filter (its drop counter restarts at zero).
pub async fn set_overlay_sources(
    node: &NodeNetwork,
    ov: &crate::Overlay,
    peers: &[crate::Peer],
) -> Result<()> {
    apply_all(&[crate::overlay::filter_action(node, ov, peers)]).await
}

/// Removes the node's overlay device (and with it every peer's route and FDB entry).
pub async fn teardown_overlay(node: &NodeNetwork, ov: &crate::Overlay) -> Result<()> {
    apply_all_best_effort(&crate::overlay::device_teardown_actions(node, ov)).await
}

/// Reads the overlay device's routes, neighbours and FDB entries and makes them match
/// `peers` exactly (adds, changes and removes). Returns how many steps it ran.
pub async fn sync_overlay(
    node: &NodeNetwork,
    ov: &crate::Overlay,
    peers: &[crate::Peer],
) -> Result<usize> {
    use crate::apply::query;
    let ns = &node.netns;
    let dev = ov.device.as_str();
    let routes = query("ip", ns, &["-j", "route", "show", "dev", dev]).await?;
    let neigh = query("ip", ns, &["-j", "neigh", "show", "dev", dev]).await?;
    let fdb = query("bridge", ns, &["-j", "fdb", "show", "dev", dev]).await?;
    let observed = crate::overlay::parse_observed(&routes, &neigh, &fdb)?;
    let actions = crate::overlay::sync_actions(node, ov, &observed, peers);
    apply_all(&actions).await?;
    Ok(actions.len())
}

/// Reads this crate's `/32` routes of moved VMIs (protocol [`crate::routes::ROUTE_PROTO`]) in
/// the node's namespace and makes them equal to `desired` ([`crate::routes::desired`]).
/// Returns how many steps it ran.
pub async fn sync_routes(
    node: &NodeNetwork,
    overlay_device: &str,
    desired: &std::collections::BTreeMap<std::net::Ipv4Addr, crate::routes::HostRoute>,
) -> Result<usize> {
    let text = crate::apply::query(
        "ip",
        &node.netns,
        &["-j", "route", "show", "proto", crate::routes::ROUTE_PROTO],
    )
    .await?;
    let observed = crate::routes::parse_observed(node, overlay_device, &text)?;
    let actions = crate::routes::sync_actions(node, overlay_device, &observed, desired);
    apply_all(&actions).await?;
    Ok(actions.len())
}

/// Creates (or repairs) a Primary user-defined network's namespace, bridge and VXLAN device
/// on this node ([`crate::udn::network_steps`]). Idempotent: the VXLAN device is made (from
/// the node's namespace, so its UDP socket lives there) only when the network's namespace
/// does not hold it yet.
///
/// With a gateway ([`crate::udn::gateway_steps`]) the network keeps its transit link; a new
/// one gets the lowest transit index no other network of the node holds (call it under one
/// lock per node, as the agent does).
pub async fn setup_udn_network(
    net: &crate::udn::UdnNetwork,
    cluster: crate::Ipv4Cidr,
) -> Result<()> {
    let steps = crate::udn::network_steps(net);
    apply_all(&steps.before).await?;
    if let Some(vx) = &steps.vxlan
        && !crate::apply::link_exists(&Some(net.netns.clone()), crate::udn::VXLAN).await?
    {
        crate::apply::apply_one(vx).await?;
    }
    apply_all(&steps.after).await?;
    match &net.gateway {
        None => return Ok(()),
        Some(g) if g.uplink.is_none() => {
            return apply_all(&crate::udn::gateway_steps(net, 0, cluster)).await;
        }
        Some(_) => {}
    }
    let index = match transit_of(&net.netns).await? {
        Some(i) => i,
        None => {
            let mut used = std::collections::BTreeSet::new();
            for ns in udn_namespaces(net.node_netns.as_deref()) {
                if let Some(i) = transit_of(&ns).await? {
                    used.insert(i);
                }
            }
            crate::udn::pick_transit(&used)?
        }
    };
    apply_all(&crate::udn::gateway_steps(net, index, cluster)).await
}

/// The transit index a network's namespace holds, if it has its gateway link.
async fn transit_of(netns: &str) -> Result<Option<u16>> {
    let ns = Some(netns.to_string());
    if !crate::apply::link_exists(&ns, crate::udn::GW_VETH).await? {
        return Ok(None);
    }
    let text = crate::apply::query(
        "ip",
        &ns,
        &["-j", "-4", "addr", "show", "dev", crate::udn::GW_VETH],
    )
    .await?;
    Ok(crate::udn::parse_transit(&text))
}

/// Makes the network's head-end replication list equal to `peers` (the overlay peers'
/// underlay addresses). Returns how many steps it ran.
pub async fn sync_udn_fdb(
    net: &crate::udn::UdnNetwork,
    peers: &std::collections::BTreeSet<Ipv4Addr>,
) -> Result<usize> {
    if net.local.is_none() {
        return Ok(0);
    }
    let text = crate::apply::query(
        "bridge",
        &Some(net.netns.clone()),
        &["-j", "fdb", "show", "dev", crate::udn::VXLAN],
    )
    .await?;
    let observed = crate::udn::parse_flood_entries(&text)?;
    let actions = crate::udn::fdb_sync_actions(net, &observed, peers);
    apply_all(&actions).await?;
    Ok(actions.len())
}

/// Makes a Layer3 network's VXLAN device route to exactly `peers`' host subnets
/// ([`crate::udn_l3::peers`]); returns how many steps it ran.
pub async fn sync_udn_routes(net: &crate::udn::UdnNetwork, peers: &[crate::Peer]) -> Result<usize> {
    let Some(local) = net.local else {
        return Ok(0);
    };
    let (node, ov) = crate::udn_l3::overlay_end(net, local)?;
    sync_overlay(&node, &ov, peers).await
}

/// Removes a user-defined network's namespace from this node (its VXLAN device first).
pub async fn teardown_udn_network(netns: &str) -> Result<()> {
    apply_all_best_effort(&crate::udn::network_teardown(netns)).await
}

/// The user-defined network namespaces this node made ([`crate::udn::is_own_netns`]).
pub fn udn_namespaces(node_netns: Option<&str>) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(crate::netns::NETNS_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| crate::udn::is_own_netns(n, node_netns))
        .collect();
    out.sort();
    out
}
