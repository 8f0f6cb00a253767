//! The cross-node overlay (pure): one VXLAN device per node (`fv-vx0`, holding the `.0` of the
//! node's pod subnet) and, for every other node, a route to its pod subnet via that node's
//! `.0` on the overlay, a permanent neighbour entry giving that `.0` the node's VTEP MAC, and an
//! FDB entry sending frames for that MAC to the node's underlay address (flannel's VXLAN
//! scheme: no learning, no multicast). VTEP MACs are derived from node names, so a node only
//! publishes its pod subnet and its underlay address (`spec.podCIDR`, InternalIP).
//! [`sync_actions`] turns (what the kernel holds, what the Nodes say) into the steps that add,
//! change and remove peers; [`crate::pod::sync_overlay`] reads the kernel and applies them.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ipam::{Ipv4Cidr, MacAddr};
use crate::plan::NodeNetwork;
use crate::render::{Action, ip, strs};

/// The overlay device in the node's namespace.
pub const OVERLAY_DEVICE: &str = "fv-vx0";
/// The VXLAN network identifier of the pod network.
pub const DEFAULT_VNI: u32 = 4244;
/// IANA's VXLAN port.
pub const DEFAULT_PORT: u16 = 4789;

/// This node's end of the overlay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Overlay {
    pub device: String,
    pub vni: u32,
    pub port: u16,
    /// The node's underlay address (VXLAN source address; published as InternalIP).
    pub local_ip: Ipv4Addr,
    /// The device's MAC ([`vtep_mac`] of the node name).
    pub vtep_mac: MacAddr,
}

impl Overlay {
    /// Defaults: device `fv-vx0`, VNI 4244, UDP port 4789.
    pub fn new(node_name: &str, local_ip: Ipv4Addr) -> Self {
        Overlay {
            device: OVERLAY_DEVICE.into(),
            vni: DEFAULT_VNI,
            port: DEFAULT_PORT,
            local_ip,
            vtep_mac: vtep_mac(node_name),
        }
    }
}

/// The VTEP MAC of the node `name` (every node derives every other node's the same way).
pub fn vtep_mac(name: &str) -> MacAddr {
    MacAddr::stable(&["ferrovirt-vtep", name])
}

/// Another node, as its Node object describes it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Peer {
    pub name: String,
    pub pod_cidr: Ipv4Cidr,
    pub underlay: Ipv4Addr,
}

impl Peer {
    /// The peer's overlay address: the network address of its pod subnet.
    pub fn gateway(&self) -> Ipv4Addr {
        self.pod_cidr.network()
    }

    pub fn mac(&self) -> MacAddr {
        vtep_mac(&self.name)
    }
}

/// What a Node says about itself (name, `spec.podCIDR`, InternalIP).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    pub pod_cidr: Option<String>,
    pub internal_ip: Option<String>,
}

/// The peers of node `me` among `nodes`: every other node with a pod subnet inside the cluster
/// CIDR and a non-loopback underlay address. Nodes that cannot be peers (no subnet yet, a
/// loopback address, a subnet overlapping this node's or an earlier peer's) are skipped and
/// named in the returned notes.
pub fn peers(node: &NodeNetwork, me: &str, nodes: &[NodeInfo]) -> (Vec<Peer>, Vec<String>) {
    let mut out: Vec<Peer> = Vec::new();
    let mut notes = Vec::new();
    let mut sorted: Vec<&NodeInfo> = nodes.iter().filter(|n| n.name != me).collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    for n in sorted {
        let Some(cidr) = n.pod_cidr.as_deref() else {
            notes.push(format!("node {} has no podCIDR yet", n.name));
            continue;
        };
        let cidr: Ipv4Cidr = match cidr.parse() {
            Ok(c) => c,
            Err(e) => {
                notes.push(format!("node {}: podCIDR: {e}", n.name));
                continue;
            }
        };
        let ip = n
            .internal_ip
            .as_deref()
            .and_then(|a| a.parse::<Ipv4Addr>().ok());
        let Some(ip) = ip.filter(|a| !a.is_loopback() && !a.is_unspecified()) else {
            notes.push(format!(
                "node {} has no usable InternalIP ({:?}) for the overlay",
                n.name, n.internal_ip
            ));
            continue;
        };
        if !node.ipam.cluster.contains(cidr.network()) {
            notes.push(format!(
                "node {}: podCIDR {cidr} is outside the cluster CIDR {}",
                n.name, node.ipam.cluster
            ));
            continue;
        }
        if cidr.overlaps(node.node_subnet) {
            notes.push(format!(
                "node {}: podCIDR {cidr} overlaps this node's {}",
                n.name, node.node_subnet
            ));
            continue;
        }
        if let Some(p) = out.iter().find(|p| p.pod_cidr.overlaps(cidr)) {
            notes.push(format!(
                "node {}: podCIDR {cidr} overlaps node {}'s {}",
                n.name, p.name, p.pod_cidr
            ));
            continue;
        }
        out.push(Peer {
            name: n.name.clone(),
            pod_cidr: cidr,
            underlay: ip,
        });
    }
    (out, notes)
}

/// Steps that create (or repair) the overlay device of `node`.
pub fn device_actions(node: &NodeNetwork, ov: &Overlay) -> Vec<Action> {
    let ns = &node.netns;
    let dev = ov.device.as_str();
    let addr = format!("{}/32", node.node_subnet.network());
    vec![
        Action::AddLink {
            netns: ns.clone(),
            name: dev.into(),
            args: strs(&[
                "link",
                "add",
                dev,
                "address",
                &ov.vtep_mac.to_string(),
                "type",
                "vxlan",
                "id",
                &ov.vni.to_string(),
                "local",
                &ov.local_ip.to_string(),
                "dstport",
                &ov.port.to_string(),
                "nolearning",
            ]),
        },
        // VXLAN adds 50 bytes; the device keeps the pod MTU and the kernel fragments the
        // outer packets when the underlay is smaller (see docs/networking.md).
        ip(
            ns,
            &["link", "set", dev, "mtu", &node.mtu.to_string(), "up"],
        ),
        ip(ns, &["addr", "replace", &addr, "dev", dev]),
    ]
}

/// Steps that remove the overlay device (its routes, neighbours and FDB entries go with it)
/// and its source filter.
pub fn device_teardown_actions(node: &NodeNetwork, ov: &Overlay) -> Vec<Action> {
    vec![
        Action::DelLink {
            netns: node.netns.clone(),
            name: ov.device.clone(),
        },
        Action::DelNftTable {
            netns: node.netns.clone(),
            family: "ip".into(),
            table: filter_table(node),
        },
    ]
}

/// The nft table (family `ip`, in the node's namespace) with the overlay's source filter.
pub fn filter_table(node: &NodeNetwork) -> String {
    format!("{}-vxlan", node.nft_table)
}

/// The overlay's source filter: UDP to the VXLAN port is dropped (and counted) unless it comes
/// from a peer's underlay address (a Node's InternalIP), so no other host can inject frames
/// into the pod network. With no peers every VXLAN packet is dropped.
pub fn filter_script(node: &NodeNetwork, ov: &Overlay, peers: &[Peer]) -> String {
    let mut sources: Vec<Ipv4Addr> = peers.iter().map(|p| p.underlay).collect();
    sources.sort_unstable();
    sources.dedup();
    let port = ov.port;
    let rule = if sources.is_empty() {
        format!("    udp dport {port} counter drop\n")
    } else {
        let set = sources
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        format!("    udp dport {port} ip saddr != {{ {set} }} counter drop\n")
    };
    let body = format!(
        "  chain input {{\n    type filter hook input priority -10; policy accept;\n{rule}  }}\n"
    );
    crate::render::replace_table("ip", &filter_table(node), &body)
}

/// The step that installs [`filter_script`] (an atomic replace of its table).
pub fn filter_action(node: &NodeNetwork, ov: &Overlay, peers: &[Peer]) -> Action {
    Action::Nft {
        netns: node.netns.clone(),
        script: filter_script(node, ov, peers),
    }
}

/// What the kernel holds on the overlay device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// Routes on the device: destination → gateway.
    pub routes: BTreeMap<Ipv4Cidr, Option<Ipv4Addr>>,
    /// Neighbour entries: address → MAC.
    pub neighbours: BTreeMap<Ipv4Addr, Option<MacAddr>>,
    /// FDB entries with a remote: MAC → underlay address.
    pub fdb: BTreeMap<MacAddr, Ipv4Addr>,
}

#[derive(Deserialize)]
struct RouteJson {
    dst: String,
    #[serde(default)]
    gateway: Option<String>,
}

#[derive(Deserialize)]
struct NeighJson {
    dst: String,
    #[serde(default)]
    lladdr: Option<String>,
}

#[derive(Deserialize)]
struct FdbJson {
    mac: String,
    #[serde(default)]
    dst: Option<String>,
}

fn parse_json<T: serde::de::DeserializeOwned>(what: &str, text: &str) -> Result<Vec<T>> {
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    serde_json::from_str(text)
        .map_err(|e| Error::InvalidPlan(format!("unexpected `{what}` output: {e}")))
}

/// Parses `ip -j route show dev D`, `ip -j neigh show dev D` and `bridge -j fdb show dev D`.
/// Entries this crate never writes (IPv6, host routes without a prefix, FDB entries without
/// a remote) are left out, so they are never removed.
pub fn parse_observed(routes: &str, neighbours: &str, fdb: &str) -> Result<Observed> {
    let mut o = Observed::default();
    for r in parse_json::<RouteJson>("ip -j route", routes)? {
        if let Ok(c) = r.dst.parse::<Ipv4Cidr>() {
            o.routes
                .insert(c, r.gateway.and_then(|g| g.parse::<Ipv4Addr>().ok()));
        }
    }
    for n in parse_json::<NeighJson>("ip -j neigh", neighbours)? {
        if let Ok(a) = n.dst.parse::<Ipv4Addr>() {
            o.neighbours
                .insert(a, n.lladdr.and_then(|m| m.parse::<MacAddr>().ok()));
        }
    }
    for f in parse_json::<FdbJson>("bridge -j fdb", fdb)? {
        if let (Ok(m), Some(Ok(d))) = (
            f.mac.parse::<MacAddr>(),
            f.dst.map(|d| d.parse::<Ipv4Addr>()),
        ) {
            o.fdb.insert(m, d);
        }
    }
    Ok(o)
}

/// The steps that make the overlay device hold exactly the `desired` peers: routes,
/// neighbours and FDB entries are added or replaced where missing or different, and removed
/// where no peer wants them (a node that left, or changed its subnet or address).
pub fn sync_actions(
    node: &NodeNetwork,
    ov: &Overlay,
    observed: &Observed,
    desired: &[Peer],
) -> Vec<Action> {
    let ns = &node.netns;
    let dev = ov.device.as_str();
    let mut a = Vec::new();
    let mut want_routes = BTreeSet::new();
    let mut want_neigh = BTreeSet::new();
    let mut want_fdb = BTreeSet::new();
    for p in desired {
        let (gw, mac) = (p.gateway(), p.mac());
        want_routes.insert(p.pod_cidr);
        want_neigh.insert(gw);
        want_fdb.insert(mac);
        if observed.fdb.get(&mac) != Some(&p.underlay) {
            a.push(Action::Bridge {
                netns: ns.clone(),
                args: strs(&[
                    "fdb",
                    "replace",
                    &mac.to_string(),
                    "dev",
                    dev,
                    "dst",
                    &p.underlay.to_string(),
                    "self",
                    "permanent",
                ]),
                tolerate_failure: false,
            });
        }
        if observed.neighbours.get(&gw) != Some(&Some(mac)) {
            a.push(ip(
                ns,
                &[
                    "neigh",
                    "replace",
                    &gw.to_string(),
                    "lladdr",
                    &mac.to_string(),
                    "dev",
                    dev,
                    "nud",
                    "permanent",
                ],
            ));
        }
        if observed.routes.get(&p.pod_cidr) != Some(&Some(gw)) {
            a.push(ip(
                ns,
                &[
                    "route",
                    "replace",
                    &p.pod_cidr.to_string(),
                    "via",
                    &gw.to_string(),
                    "dev",
                    dev,
                    "onlink",
                ],
            ));
        }
    }
    for r in observed.routes.keys().filter(|r| !want_routes.contains(*r)) {
        a.push(ip(ns, &["route", "del", &r.to_string(), "dev", dev]));
    }
    for n in observed
        .neighbours
        .keys()
        .filter(|n| !want_neigh.contains(*n))
    {
        a.push(ip(ns, &["neigh", "del", &n.to_string(), "dev", dev]));
    }
    for m in observed.fdb.keys().filter(|m| !want_fdb.contains(*m)) {
        a.push(Action::Bridge {
            netns: ns.clone(),
            args: strs(&["fdb", "del", &m.to_string(), "dev", dev, "self"]),
            tolerate_failure: true,
        });
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipam::Ipam;

    fn node() -> NodeNetwork {
        let ipam = Ipam::default();
        let mut n = NodeNetwork::new(ipam, ipam.node_subnet(1).unwrap());
        n.netns = Some("node-a".into());
        n
    }

    fn info(name: &str, cidr: Option<&str>, ip: Option<&str>) -> NodeInfo {
        NodeInfo {
            name: name.into(),
            pod_cidr: cidr.map(String::from),
            internal_ip: ip.map(String::from),
        }
    }

    fn peer(name: &str, cidr: &str, ip: &str) -> Peer {
        Peer {
            name: name.into(),
            pod_cidr: cidr.parse().unwrap(),
            underlay: ip.parse().unwrap(),
        }
    }

    #[test]
    fn vxlan_is_accepted_only_from_peers() {
        let ov = Overlay::new("node-a", "192.168.1.1".parse().unwrap());
        let peers = [
            peer("node-c", "10.244.3.0/24", "192.168.1.3"),
            peer("node-b", "10.244.2.0/24", "192.168.1.2"),
        ];
        let s = filter_script(&node(), &ov, &peers);
        assert!(
            s.starts_with("table ip ferrovirt-vxlan\ndelete table ip ferrovirt-vxlan\n"),
            "{s}"
        );
        assert!(s.contains("type filter hook input"), "{s}");
        assert!(
            s.contains("udp dport 4789 ip saddr != { 192.168.1.2, 192.168.1.3 } counter drop"),
            "{s}"
        );
        // No peers: nothing is accepted.
        let s = filter_script(&node(), &ov, &[]);
        assert!(s.contains("    udp dport 4789 counter drop\n"), "{s}");
        let t = device_teardown_actions(&node(), &ov);
        assert!(matches!(&t[1], Action::DelNftTable { table, .. } if table == "ferrovirt-vxlan"));
    }

    fn render(a: &Action) -> String {
        match a {
            Action::Ip { args, .. } | Action::AddLink { args, .. } => {
                format!("ip {}", args.join(" "))
            }
            Action::Bridge { args, .. } => format!("bridge {}", args.join(" ")),
            other => format!("{other:?}"),
        }
    }

    #[test]
    fn peers_skip_self_incomplete_and_overlapping_nodes() {
        let nodes = [
            info("a", Some("10.244.1.0/24"), Some("192.168.7.1")),
            info("c", Some("10.244.3.0/24"), Some("192.168.7.3")),
            info("b", Some("10.244.2.0/24"), Some("192.168.7.2")),
            info("d", None, Some("192.168.7.4")),
            info("e", Some("10.244.5.0/24"), Some("127.0.0.1")),
            info("f", Some("10.244.1.0/24"), Some("192.168.7.6")),
            info("g", Some("10.244.2.0/25"), Some("192.168.7.7")),
            info("h", Some("192.168.0.0/24"), Some("192.168.7.8")),
        ];
        let (p, notes) = peers(&node(), "a", &nodes);
        assert_eq!(
            p,
            vec![
                peer("b", "10.244.2.0/24", "192.168.7.2"),
                peer("c", "10.244.3.0/24", "192.168.7.3")
            ]
        );
        let notes = notes.join("\n");
        assert!(notes.contains("node d has no podCIDR"), "{notes}");
        assert!(notes.contains("node e has no usable InternalIP"), "{notes}");
        assert!(
            notes.contains("node f: podCIDR 10.244.1.0/24 overlaps this node's"),
            "{notes}"
        );
        assert!(
            notes.contains("node g: podCIDR 10.244.2.0/25 overlaps node b's"),
            "{notes}"
        );
        assert!(
            notes.contains("node h: podCIDR 192.168.0.0/24 is outside"),
            "{notes}"
        );
    }

    #[test]
    fn device_gets_the_vtep_mac_and_the_subnet_network_address() {
        let ov = Overlay::new("a", "192.168.7.1".parse().unwrap());
        let a: Vec<String> = device_actions(&node(), &ov).iter().map(render).collect();
        assert_eq!(
            a[0],
            format!(
                "ip link add fv-vx0 address {} type vxlan id 4244 local 192.168.7.1 dstport 4789 nolearning",
                vtep_mac("a")
            )
        );
        assert_eq!(a[2], "ip addr replace 10.244.1.0/32 dev fv-vx0");
        assert_ne!(vtep_mac("a"), vtep_mac("b"));
    }

    #[test]
    fn sync_adds_missing_peers_and_removes_departed_ones() {
        let ov = Overlay::new("a", "192.168.7.1".parse().unwrap());
        let b = peer("b", "10.244.2.0/24", "192.168.7.2");
        let a: Vec<String> =
            sync_actions(&node(), &ov, &Observed::default(), std::slice::from_ref(&b))
                .iter()
                .map(render)
                .collect();
        let mb = vtep_mac("b");
        assert_eq!(
            a,
            vec![
                format!("bridge fdb replace {mb} dev fv-vx0 dst 192.168.7.2 self permanent"),
                format!("ip neigh replace 10.244.2.0 lladdr {mb} dev fv-vx0 nud permanent"),
                "ip route replace 10.244.2.0/24 via 10.244.2.0 dev fv-vx0 onlink".to_string(),
            ]
        );
        // In sync: nothing to do.
        let routes = r#"[{"dst":"10.244.2.0/24","gateway":"10.244.2.0","flags":["onlink"]}]"#;
        let neigh = format!(r#"[{{"dst":"10.244.2.0","lladdr":"{mb}","state":["PERMANENT"]}}]"#);
        let fdb = format!(
            r#"[{{"mac":"{mb}","dst":"192.168.7.2","flags":["self"],"state":"permanent"}}]"#
        );
        let obs = parse_observed(routes, &neigh, &fdb).unwrap();
        assert!(sync_actions(&node(), &ov, &obs, std::slice::from_ref(&b)).is_empty());
        // b moved to another underlay address: only its FDB entry changes.
        let moved = peer("b", "10.244.2.0/24", "192.168.7.22");
        let a: Vec<String> = sync_actions(&node(), &ov, &obs, &[moved])
            .iter()
            .map(render)
            .collect();
        assert_eq!(
            a,
            vec![format!(
                "bridge fdb replace {mb} dev fv-vx0 dst 192.168.7.22 self permanent"
            )]
        );
        // b left: everything of it goes.
        let a: Vec<String> = sync_actions(&node(), &ov, &obs, &[])
            .iter()
            .map(render)
            .collect();
        assert_eq!(
            a,
            vec![
                "ip route del 10.244.2.0/24 dev fv-vx0".to_string(),
                "ip neigh del 10.244.2.0 dev fv-vx0".to_string(),
                format!("bridge fdb del {mb} dev fv-vx0 self"),
            ]
        );
    }

    #[test]
    fn observed_ignores_foreign_entries() {
        let obs = parse_observed(
            r#"[{"dst":"fe80::/64"},{"dst":"default","gateway":"10.0.0.1"}]"#,
            "",
            r#"[{"mac":"00:00:00:00:00:00"},{"mac":"zz"}]"#,
        )
        .unwrap();
        assert_eq!(obs, Observed::default());
        assert!(parse_observed("not json", "", "").is_err());
    }
}
