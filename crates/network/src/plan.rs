//! Plans (pure): the node's pod network ([`NodeNetwork`]: bridge, gateway, NAT out of an
//! uplink) and, per VMI interface, a [`PodPlan`] naming every namespace, link, address, route,
//! nft table and DHCP lease to create, so that the same plan both applies and cleans up.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use crate::dhcp::LeaseConfig;
use crate::error::{Error, Result};
use crate::ipam::{Ipam, Ipv4Cidr, MacAddr, allocate_vmi_address, check_disjoint};

/// KubeVirt's masquerade network inside the VMI namespace: gateway `.1`, guest `.2`.
pub const MASQUERADE_CIDR: &str = "10.0.2.0/24";
/// The link-local address the bridge binding's DHCP server speaks from (as KubeVirt does).
pub const BRIDGE_DHCP_ADDR: Ipv4Addr = Ipv4Addr::new(169, 254, 75, 10);
/// The VMI end of the veth pair, as in a pod.
pub const POD_VETH: &str = "eth0";
/// The bridge inside the VMI namespace that the tap hangs off.
pub const POD_BRIDGE: &str = "k6t-eth0";
/// The tap QEMU opens.
pub const POD_TAP: &str = "tap0";
/// Default DHCP lease time.
pub const DEFAULT_LEASE_SECS: u32 = 86_400;

/// Node-wide pod network settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeNetwork {
    pub ipam: Ipam,
    /// This node's share of the cluster CIDR; its first address is the gateway on the bridge.
    pub node_subnet: Ipv4Cidr,
    /// The node bridge every VMI's veth is attached to.
    pub bridge: String,
    /// Interface that cluster traffic leaving the cluster CIDR is masqueraded out of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uplink: Option<String>,
    /// The node's namespace (named, under /run/netns); `None` for the agent's own namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<String>,
    /// The nft table this crate owns (in the node's and in each VMI namespace).
    pub nft_table: String,
    /// Prefix of VMI namespace names (`<prefix><uid>`).
    pub netns_prefix: String,
    /// Prefix of node-side veth names (`<prefix><hash>`, at most 15 characters in all).
    pub veth_prefix: String,
    pub mtu: u16,
    /// DNS servers handed to guests.
    #[serde(default)]
    pub dns: Vec<Ipv4Addr>,
    /// DNS search domains handed to guests (DHCP options 119 and 15).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub search: Vec<String>,
}

impl NodeNetwork {
    /// Defaults: bridge `fv-br0`, table `ferrovirt`, namespaces `fv-<uid>`, MTU 1500.
    pub fn new(ipam: Ipam, node_subnet: Ipv4Cidr) -> Self {
        NodeNetwork {
            ipam,
            node_subnet,
            bridge: "fv-br0".into(),
            uplink: None,
            netns: None,
            nft_table: "ferrovirt".into(),
            netns_prefix: "fv-".into(),
            veth_prefix: "fv".into(),
            mtu: 1500,
            dns: Vec::new(),
            search: Vec::new(),
        }
    }

    /// The gateway address on the node bridge.
    pub fn gateway(&self) -> Ipv4Addr {
        self.node_subnet.gateway()
    }

    /// Rejects subnets outside the cluster CIDR, overlaps with the masquerade network and
    /// names the kernel would refuse.
    pub fn validate(&self) -> Result<()> {
        let masq: Ipv4Cidr = MASQUERADE_CIDR.parse()?;
        check_disjoint(&[
            ("cluster CIDR", self.ipam.cluster),
            ("masquerade network", masq),
        ])?;
        if !self.ipam.cluster.contains(self.node_subnet.network())
            || self.node_subnet.prefix() < self.ipam.cluster.prefix()
        {
            return Err(Error::InvalidPlan(format!(
                "node subnet {} is not inside the cluster CIDR {}",
                self.node_subnet, self.ipam.cluster
            )));
        }
        check_ifname(&self.bridge)?;
        if let Some(u) = &self.uplink {
            check_ifname(u)?;
        }
        check_ifname(&format!("{}{}", self.veth_prefix, "0".repeat(HASH_CHARS)))?;
        if self.nft_table.is_empty()
            || !self
                .nft_table
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(Error::InvalidPlan(format!(
                "invalid nft table name {:?}",
                self.nft_table
            )));
        }
        for d in &self.search {
            crate::dhcp::search_domain(d)?;
        }
        if self.mtu < 576 {
            return Err(Error::InvalidPlan(format!("MTU {} is too small", self.mtu)));
        }
        Ok(())
    }
}

/// Hex characters of the uid hash in node-side veth names.
const HASH_CHARS: usize = 10;

/// Linux interface names: 1..=15 bytes, no '/', ':' or whitespace.
pub fn check_ifname(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 15
        && name
            .chars()
            .all(|c| c.is_ascii_graphic() && c != '/' && c != ':');
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidPlan(format!(
            "invalid interface name {name:?} (1-15 characters, no '/', ':' or spaces)"
        )))
    }
}

/// Transport protocol of a forwarded port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PortProtocol {
    Tcp,
    Udp,
}

impl PortProtocol {
    pub fn nft(self) -> &'static str {
        match self {
            PortProtocol::Tcp => "tcp",
            PortProtocol::Udp => "udp",
        }
    }
}

/// A port of the interface (`spec.domain.devices.interfaces[].ports`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Port {
    pub protocol: PortProtocol,
    pub port: u16,
}

/// How the guest NIC is connected.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "type")]
pub enum Binding {
    /// Guest on 10.0.2.2 behind NAT; the listed ports (all when empty) of the VMI address are
    /// forwarded to it.
    Masquerade {
        #[serde(default)]
        ports: Vec<Port>,
    },
    /// The guest owns the VMI address on the node bridge's L2 segment.
    Bridge,
}

/// What the agent knows about one VMI interface.
#[derive(Debug, Clone)]
pub struct PodRequest {
    pub uid: String,
    /// VMI namespace and name (the MAC is derived from them and the interface name).
    pub namespace: String,
    pub name: String,
    /// The interface name in the VMI spec (`default` for the pod network).
    pub interface: String,
    pub binding: Binding,
    /// Addresses already given to other VMIs of this node (to probe past on collisions).
    pub used: BTreeSet<Ipv4Addr>,
    /// Keep this address (e.g. recorded in status before an agent restart).
    pub address: Option<Ipv4Addr>,
    /// The guest MAC (`macAddress`), else a stable derived one.
    pub mac: Option<MacAddr>,
    /// An incoming live migration: `address` is kept even outside this node's subnet (it
    /// stays the VMI's; the routes follow it, see [`crate::routes`]).
    pub migrated: bool,
    /// Queue pairs of the guest NIC (KubeVirt `networkInterfaceMultiqueue`); more than 1
    /// makes a multi-queue tap.
    pub queues: u32,
}

impl PodRequest {
    pub fn new(uid: impl Into<String>, namespace: &str, name: &str, binding: Binding) -> Self {
        PodRequest {
            uid: uid.into(),
            namespace: namespace.into(),
            name: name.into(),
            interface: "default".into(),
            binding,
            used: BTreeSet::new(),
            address: None,
            mac: None,
            migrated: false,
            queues: 1,
        }
    }
}

/// Everything to create for one VMI interface on the pod network.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodPlan {
    pub node: NodeNetwork,
    pub uid: String,
    /// The VMI's network namespace.
    pub netns: String,
    /// Node end of the veth pair (on the node bridge).
    pub host_veth: String,
    /// VMI-namespace end of the veth pair.
    pub pod_veth: String,
    /// The VMI's address on the pod network (in `node.node_subnet` unless `away`).
    pub address: Ipv4Addr,
    /// The address belongs to another node's subnet (the VMI was live-migrated here): it is
    /// held as a `/32` with an on-link default route via this node's gateway, and the node
    /// routes it to its bridge ([`crate::routes`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub away: bool,
    pub binding: Binding,
    /// Bridge in the VMI namespace holding the tap.
    pub pod_bridge: String,
    /// Address (with prefix) on `pod_bridge`: 10.0.2.1/24 (masquerade) or 169.254.75.10/32.
    pub pod_bridge_addr: (Ipv4Addr, u8),
    /// The tap QEMU opens (`NicBackend::Tap { ifname }`).
    pub tap: String,
    /// Queue pairs of the tap; more than 1: created `multi_queue` (the kernel refuses a
    /// single-queue open of a multi-queue tap and the other way round).
    #[serde(default = "one_queue", skip_serializing_if = "is_one_queue")]
    pub queues: u32,
    /// The guest NIC's MAC (QEMU `mac=`); the DHCP server answers only it.
    pub guest_mac: MacAddr,
    /// What the DHCP server on `pod_bridge` offers.
    pub lease: LeaseConfig,
    /// The interface is on a Primary user-defined network ([`crate::udn`]), not the pod
    /// network: `node` then describes that network's namespace and bridge on this node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udn: Option<crate::udn::UdnNetwork>,
}

pub(crate) fn one_queue() -> u32 {
    1
}

pub(crate) fn is_one_queue(q: &u32) -> bool {
    *q <= 1
}

pub(crate) fn hash_hex(s: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")[..HASH_CHARS].to_string()
}

impl PodPlan {
    /// Plans the pod network for one VMI interface.
    pub fn build(node: &NodeNetwork, req: &PodRequest) -> Result<PodPlan> {
        node.validate()?;
        if req.uid.is_empty() || req.uid.contains('/') || req.uid.contains(char::is_whitespace) {
            return Err(Error::InvalidPlan(format!("invalid VMI uid {:?}", req.uid)));
        }
        let address = match req.address {
            Some(a) if node.node_subnet.contains(a) => a,
            Some(a) if req.migrated && node.ipam.cluster.contains(a) => {
                if !matches!(req.binding, Binding::Masquerade { .. }) {
                    return Err(Error::InvalidPlan(format!(
                        "address {a} of another node's subnet: only the masquerade binding can keep it on this node"
                    )));
                }
                a
            }
            Some(a) => {
                return Err(Error::NotInSubnet {
                    addr: a,
                    subnet: node.node_subnet.to_string(),
                });
            }
            None => {
                let mut used = req.used.clone();
                used.insert(node.gateway());
                allocate_vmi_address(node.node_subnet, &req.uid, &used)?
            }
        };
        let guest_mac = req
            .mac
            .unwrap_or_else(|| MacAddr::stable(&[&req.namespace, &req.name, &req.interface]));
        let masq: Ipv4Cidr = MASQUERADE_CIDR.parse()?;
        let (pod_bridge_addr, lease) = match &req.binding {
            Binding::Masquerade { .. } => {
                let gw = masq.gateway();
                (
                    (gw, masq.prefix()),
                    LeaseConfig {
                        client_mac: guest_mac,
                        address: masq.nth(2).unwrap_or(gw),
                        subnet: masq,
                        router: Some(gw),
                        dns: node.dns.clone(),
                        search: node.search.clone(),
                        server_id: gw,
                        lease_secs: DEFAULT_LEASE_SECS,
                        hostname: Some(req.name.clone()),
                        mtu: Some(node.mtu),
                        routes: Vec::new(),
                    },
                )
            }
            Binding::Bridge => (
                (BRIDGE_DHCP_ADDR, 32),
                LeaseConfig {
                    client_mac: guest_mac,
                    address,
                    subnet: node.node_subnet,
                    router: Some(node.gateway()),
                    dns: node.dns.clone(),
                    search: node.search.clone(),
                    server_id: BRIDGE_DHCP_ADDR,
                    lease_secs: DEFAULT_LEASE_SECS,
                    hostname: Some(req.name.clone()),
                    mtu: Some(node.mtu),
                    routes: Vec::new(),
                },
            ),
        };
        Ok(PodPlan {
            node: node.clone(),
            uid: req.uid.clone(),
            netns: format!("{}{}", node.netns_prefix, req.uid),
            host_veth: format!("{}{}", node.veth_prefix, hash_hex(&req.uid)),
            pod_veth: POD_VETH.into(),
            address,
            away: !node.node_subnet.contains(address),
            binding: req.binding.clone(),
            pod_bridge: POD_BRIDGE.into(),
            pod_bridge_addr,
            tap: POD_TAP.into(),
            queues: req.queues.max(1),
            guest_mac,
            lease,
            udn: None,
        })
    }

    /// The command prefix that runs a process (the launcher, QEMU) inside the VMI namespace;
    /// see [`crate::netns::exec_prefix`].
    pub fn exec_prefix(&self) -> Vec<String> {
        crate::netns::exec_prefix(&self.netns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn node() -> NodeNetwork {
        let ipam = Ipam::default();
        let mut n = NodeNetwork::new(ipam, ipam.node_subnet(3).unwrap());
        n.uplink = Some("uplink0".into());
        n.dns = vec![Ipv4Addr::new(10, 96, 0, 10)];
        n
    }

    #[test]
    fn masquerade_plan_uses_kubevirt_addressing() {
        let req = PodRequest::new(
            "uid-1",
            "default",
            "vm1",
            Binding::Masquerade { ports: vec![] },
        );
        let p = PodPlan::build(&node(), &req).unwrap();
        assert_eq!(p.netns, "fv-uid-1");
        assert!(p.host_veth.starts_with("fv") && p.host_veth.len() == 12);
        assert!(node().node_subnet.contains(p.address));
        assert_ne!(p.address, node().gateway());
        assert_eq!(p.pod_bridge_addr, (Ipv4Addr::new(10, 0, 2, 1), 24));
        assert_eq!(p.lease.address, Ipv4Addr::new(10, 0, 2, 2));
        assert_eq!(p.lease.router, Some(Ipv4Addr::new(10, 0, 2, 1)));
        assert_eq!(p.lease.server_id, Ipv4Addr::new(10, 0, 2, 1));
        assert_eq!(p.lease.client_mac, p.guest_mac);
        assert_eq!(p.lease.hostname.as_deref(), Some("vm1"));
        assert_eq!(p.lease.dns, vec![Ipv4Addr::new(10, 96, 0, 10)]);
        assert_eq!(p.guest_mac, MacAddr::stable(&["default", "vm1", "default"]));
        assert_eq!(
            p.exec_prefix(),
            ["nsenter", "--net=/run/netns/fv-uid-1", "--"]
        );
        // Stable: the same request plans the same thing.
        assert_eq!(p, PodPlan::build(&node(), &req).unwrap());
    }

    #[test]
    fn search_domains_reach_the_lease_and_bad_ones_are_refused() {
        let mut n = node();
        n.search = vec!["ns.svc.cluster.local".into(), "cluster.local".into()];
        let req = PodRequest::new("uid-s", "ns", "vm1", Binding::Bridge);
        let p = PodPlan::build(&n, &req).unwrap();
        assert_eq!(p.lease.search, n.search);
        n.search.push("bad domain".into());
        let e = PodPlan::build(&n, &req).unwrap_err().to_string();
        assert!(e.contains("\"bad domain\""), "{e}");
    }

    #[test]
    fn bridge_plan_hands_the_vmi_address_to_the_guest() {
        let req = PodRequest::new("uid-2", "ns", "vm2", Binding::Bridge);
        let p = PodPlan::build(&node(), &req).unwrap();
        assert_eq!(p.lease.address, p.address);
        assert_eq!(p.lease.subnet, node().node_subnet);
        assert_eq!(p.lease.router, Some(node().gateway()));
        assert_eq!(p.lease.server_id, BRIDGE_DHCP_ADDR);
        assert_eq!(p.pod_bridge_addr, (BRIDGE_DHCP_ADDR, 32));
    }

    #[test]
    fn keeps_a_given_address_and_mac_and_probes_past_used_ones() {
        let mut req = PodRequest::new("uid-3", "ns", "vm3", Binding::Bridge);
        let first = PodPlan::build(&node(), &req).unwrap().address;
        req.used.insert(first);
        let second = PodPlan::build(&node(), &req).unwrap().address;
        assert_ne!(first, second);
        req.address = Some(Ipv4Addr::new(10, 244, 3, 99));
        req.mac = Some("52:54:00:00:00:09".parse().unwrap());
        let p = PodPlan::build(&node(), &req).unwrap();
        assert_eq!(p.address, Ipv4Addr::new(10, 244, 3, 99));
        assert_eq!(p.guest_mac.to_string(), "52:54:00:00:00:09");
        req.address = Some(Ipv4Addr::new(10, 244, 4, 99));
        let e = PodPlan::build(&node(), &req).unwrap_err().to_string();
        assert!(e.contains("not in 10.244.3.0/24"), "{e}");
    }

    #[test]
    fn an_incoming_migration_keeps_its_address_from_another_subnet() {
        let mut req = PodRequest::new("uid-m", "ns", "vm", Binding::Masquerade { ports: vec![] });
        req.address = Some(Ipv4Addr::new(10, 244, 4, 99));
        req.migrated = true;
        let p = PodPlan::build(&node(), &req).unwrap();
        assert_eq!(p.address, Ipv4Addr::new(10, 244, 4, 99));
        assert!(p.away);
        // Its own subnet's address is not away; one outside the cluster CIDR is refused.
        req.address = Some(Ipv4Addr::new(10, 244, 3, 99));
        assert!(!PodPlan::build(&node(), &req).unwrap().away);
        req.address = Some(Ipv4Addr::new(192, 168, 0, 9));
        let e = PodPlan::build(&node(), &req).unwrap_err().to_string();
        assert!(e.contains("not in 10.244.3.0/24"), "{e}");
        // The bridge binding's guest holds the address itself: refused, naming why.
        req.address = Some(Ipv4Addr::new(10, 244, 4, 99));
        req.binding = Binding::Bridge;
        let e = PodPlan::build(&node(), &req).unwrap_err().to_string();
        assert!(e.contains("only the masquerade binding"), "{e}");
    }

    #[test]
    fn rejects_inconsistent_node_settings() {
        let mut n = node();
        n.ipam = Ipam::new("10.0.0.0/8".parse().unwrap(), 24).unwrap();
        n.node_subnet = "10.0.3.0/24".parse().unwrap();
        let e = n.validate().unwrap_err().to_string();
        assert!(e.contains("overlaps masquerade network 10.0.2.0/24"), "{e}");

        let mut n = node();
        n.node_subnet = "192.168.0.0/24".parse().unwrap();
        assert!(n.validate().unwrap_err().to_string().contains("not inside"));

        let mut n = node();
        n.bridge = "a-very-long-bridge-name".into();
        assert!(n.validate().is_err());
        let mut n = node();
        n.veth_prefix = "toolongprefix".into();
        assert!(n.validate().is_err());
        let mut n = node();
        n.nft_table = "bad name".into();
        assert!(n.validate().is_err());

        let req = PodRequest::new("has space", "ns", "vm", Binding::Bridge);
        assert!(PodPlan::build(&node(), &req).is_err());
    }

    #[test]
    fn plans_serialize() {
        let req = PodRequest::new(
            "u",
            "ns",
            "vm",
            Binding::Masquerade {
                ports: vec![Port {
                    protocol: PortProtocol::Tcp,
                    port: 80,
                }],
            },
        );
        let p = PodPlan::build(&node(), &req).unwrap();
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(json["binding"]["type"], "masquerade");
        assert_eq!(json["binding"]["ports"][0]["protocol"], "tcp");
        assert_eq!(json["guestMac"], p.guest_mac.to_string());
        assert_eq!(json["node"]["nodeSubnet"], "10.244.3.0/24");
        let back: PodPlan = serde_json::from_value(json).unwrap();
        assert_eq!(back, p);
    }
}
