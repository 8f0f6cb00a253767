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
pub async fn setup_links(plan: &PodPlan) -> Result<()> {
    apply_all(&render::pod_actions(plan)).await
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
