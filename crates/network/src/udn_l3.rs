//! Layer3 user-defined networks, Primary and Secondary (pure; docs/networking.md "Layer3 data
//! plane"). A Layer3 network is split per node: the controller writes each node's host subnet
//! of each network into the Node annotation [`NODE_SUBNETS_ANNOTATION`] (OVN-K's shape,
//! `{"<network>": ["10.150.1.0/24"]}`). On a node the network's namespace (`fvn-…`, as for
//! Layer2) holds the host subnet's gateway (its first address) on the network's bridge and a
//! VXLAN device of the network's VNI that is no bridge port ([`routed_steps`]): traffic to
//! another node's host subnet is routed through it, exactly as the pod overlay routes pod
//! subnets ([`crate::overlay::sync_actions`] is reused by [`route_sync`]: a route per peer's
//! host subnet via the subnet's network address `onlink`, a permanent neighbour entry with the
//! peer's VTEP MAC — per network and node, [`vtep_name`] — and an FDB entry sending that MAC
//! to the peer's underlay address); the rest of the network's subnet ([`network_cidr`]) is
//! unreachable there. A Primary network's egress is [`crate::udn::gateway_steps`] (on nodes
//! with an uplink); a Secondary network's interface gets no router but a classless static
//! route for the network via the node's gateway ([`secondary_lease`]).

use std::net::Ipv4Addr;

use crate::error::{Error, Result};
use crate::ipam::{Ipam, Ipv4Cidr};
use crate::overlay::{Observed, Overlay, Peer};
use crate::plan::NodeNetwork;
use crate::render::{Action, ip};
use crate::udn::{BRIDGE, UdnNetwork, VXLAN};

/// The Node annotation with the node's host subnets of every Layer3 network.
pub const NODE_SUBNETS_ANNOTATION: &str = "k8s.ovn.org/node-subnets";

/// The node's IPv4 host subnet of `network` from its [`NODE_SUBNETS_ANNOTATION`] value;
/// `None` while the controller has not given it one. A value that cannot be read is an error
/// naming the annotation.
pub fn host_subnet(annotation: Option<&str>, network: &str) -> Result<Option<Ipv4Cidr>> {
    let Some(text) = annotation else {
        return Ok(None);
    };
    let field = format!("metadata.annotations[{NODE_SUBNETS_ANNOTATION}]");
    let all: std::collections::BTreeMap<String, serde_json::Value> = serde_json::from_str(text)
        .map_err(|e| Error::InvalidNetworkConfig(format!("{field}: {e}")))?;
    let Some(v) = all.get(network) else {
        return Ok(None);
    };
    // OVN-K writes a list; a single string is accepted as its older shape.
    let list: Vec<&str> = match v {
        serde_json::Value::String(s) => vec![s.as_str()],
        serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_str()).collect(),
        _ => {
            return Err(Error::InvalidNetworkConfig(format!(
                "{field}[{network:?}]: not a list of subnets"
            )));
        }
    };
    Ok(list.iter().find_map(|s| s.parse::<Ipv4Cidr>().ok()))
}

/// The network's whole IPv4 subnet from a Layer3 NAD's `subnets` (`cidr/hostSubnet` or
/// `cidr` entries, OVN-K's shape); an error naming the field when there is none.
pub fn network_cidr(subnets: &[String]) -> Result<Ipv4Cidr> {
    subnets
        .iter()
        .find_map(|s| {
            let cidr = match s.match_indices('/').nth(1) {
                Some((i, _)) => &s[..i],
                None => s.as_str(),
            };
            cidr.parse::<Ipv4Cidr>().ok()
        })
        .ok_or_else(|| {
            Error::InvalidNetworkConfig(format!(
                "spec.config.subnets {:?}: no IPv4 subnet (IPv6-only networks are not carried out)",
                subnets.join(",")
            ))
        })
}

/// A Secondary Layer3 interface's lease (`lease`: the annotated address, no router): the
/// address must lie in this node's host subnet with its prefix (else an error naming the
/// annotation), and a classless static route (DHCP option 121) sends the network's whole
/// subnet via the node's gateway, the host subnet's first address. Other networks: unchanged.
pub fn secondary_lease(net: &UdnNetwork, lease: &mut crate::dhcp::LeaseConfig) -> Result<()> {
    if !net.layer3 {
        return Ok(());
    }
    let host = net.subnet;
    if !host.contains(lease.address) || lease.subnet.prefix() != host.prefix() {
        return Err(Error::InvalidNetworkConfig(format!(
            "metadata.annotations[{}]: {}/{} is not in this node's host subnet {host} of \
             network {}",
            crate::udn::POD_NETWORKS_ANNOTATION,
            lease.address,
            lease.subnet.prefix(),
            net.name
        )));
    }
    lease.router = None;
    lease.subnet = host;
    if let Some(cidr) = net.network_cidr {
        lease.routes = vec![crate::dhcp::StaticRoute {
            destination: cidr,
            gateway: host.gateway(),
        }];
    }
    Ok(())
}

/// Another node as a Layer3 network sees it: its name, underlay address and annotation.
#[derive(Debug, Clone, Default)]
pub struct L3Node {
    pub name: String,
    pub underlay: Option<Ipv4Addr>,
    /// The node's [`NODE_SUBNETS_ANNOTATION`] value.
    pub node_subnets: Option<String>,
}

/// The peers of node `me` on `network`: every other node with an underlay address and a host
/// subnet of the network (as overlay [`Peer`]s: `pod_cidr` is the host subnet). Nodes
/// without one, or whose subnet overlaps `mine` or an earlier peer's, are left out.
pub fn peers(network: &str, me: &str, mine: Ipv4Cidr, nodes: &[L3Node]) -> Vec<Peer> {
    let mut sorted: Vec<&L3Node> = nodes.iter().filter(|n| n.name != me).collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut out: Vec<Peer> = Vec::new();
    for n in sorted {
        let (Some(underlay), Ok(Some(subnet))) =
            (n.underlay, host_subnet(n.node_subnets.as_deref(), network))
        else {
            continue;
        };
        if subnet.overlaps(mine) || out.iter().any(|p| p.pod_cidr.overlaps(subnet)) {
            continue;
        }
        out.push(Peer {
            // The overlay derives a peer's VTEP MAC from its name: per network and node.
            name: vtep_name(network, underlay),
            pod_cidr: subnet,
            underlay,
        });
    }
    out
}

/// The name a node's VTEP MAC on `network` is derived from ([`crate::overlay::vtep_mac`]):
/// every node derives every other node's MAC on every network the same way, and no two
/// networks share one.
pub fn vtep_name(network: &str, underlay: Ipv4Addr) -> String {
    format!("{network}@{underlay}")
}

/// The network's VXLAN device as an overlay end (device `udn-vx0` in the network's
/// namespace, this node's VTEP MAC on the network), for [`crate::overlay::sync_actions`].
pub fn overlay_end(net: &UdnNetwork, local: Ipv4Addr) -> Result<(NodeNetwork, Overlay)> {
    let mut node = NodeNetwork::new(Ipam::new(net.subnet, net.subnet.prefix())?, net.subnet);
    node.netns = Some(net.netns.clone());
    let mut ov = Overlay::new(&vtep_name(&net.name, local), local);
    ov.device = VXLAN.into();
    ov.vni = net.vni;
    Ok((node, ov))
}

/// The steps that make the node's side of a Layer3 network routed, after the network's
/// namespace, bridge and VXLAN device exist: forwarding on in the namespace, the VXLAN device
/// (no bridge port) with the node's VTEP MAC on the network, the host subnet's gateway
/// (`net.subnet`'s first address) on the bridge, and the network's whole subnet unreachable
/// but for the more specific host subnets (its own, the peers' routed through the VXLAN
/// device): what belongs to the network never leaves through a default route (egress).
pub fn routed_steps(net: &UdnNetwork) -> Vec<Action> {
    let ns = Some(net.netns.clone());
    let host = net.subnet;
    let gw = format!("{}/{}", host.gateway(), host.prefix());
    let mut a = vec![Action::Sysctl {
        netns: ns.clone(),
        key: "net/ipv4/ip_forward".into(),
        value: "1".into(),
    }];
    if let Some(local) = net.local {
        let mac = crate::overlay::vtep_mac(&vtep_name(&net.name, local)).to_string();
        let mtu = net.mtu.to_string();
        a.push(ip(
            &ns,
            &["link", "set", VXLAN, "address", &mac, "mtu", &mtu, "up"],
        ));
    }
    a.push(ip(&ns, &["addr", "replace", &gw, "dev", BRIDGE]));
    if let Some(cidr) = net.network_cidr.filter(|c| c.prefix() < host.prefix()) {
        a.push(ip(
            &ns,
            &["route", "replace", "unreachable", &cidr.to_string()],
        ));
    }
    a
}

/// The steps that make the VXLAN device route to exactly `peers`' host subnets.
pub fn route_sync(
    net: &UdnNetwork,
    local: Ipv4Addr,
    observed: &Observed,
    peers: &[Peer],
) -> Result<Vec<Action>> {
    let (node, ov) = overlay_end(net, local)?;
    Ok(crate::overlay::sync_actions(&node, &ov, observed, peers))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net() -> UdnNetwork {
        UdnNetwork {
            name: "ua_l3".into(),
            vni: 10007,
            subnet: "10.150.1.0/24".parse().unwrap(),
            mtu: 1400,
            netns: crate::udn::netns_name("ua_l3", Some("na")),
            node_netns: Some("na".into()),
            local: Some(Ipv4Addr::new(192, 168, 1, 1)),
            gateway: None,
            layer3: true,
            network_cidr: Some("10.150.0.0/16".parse().unwrap()),
        }
    }

    #[test]
    fn host_subnets_from_the_node_annotation() {
        let ann = r#"{"ua_l3":["10.150.1.0/24"],"old":"10.9.0.0/24","v6":["fd00::/64"]}"#;
        assert_eq!(
            host_subnet(Some(ann), "ua_l3")
                .unwrap()
                .unwrap()
                .to_string(),
            "10.150.1.0/24"
        );
        assert_eq!(
            host_subnet(Some(ann), "old").unwrap().unwrap().to_string(),
            "10.9.0.0/24"
        );
        assert_eq!(host_subnet(Some(ann), "v6").unwrap(), None);
        assert_eq!(host_subnet(Some(ann), "none").unwrap(), None);
        assert_eq!(host_subnet(None, "ua_l3").unwrap(), None);
        for bad in ["nope", r#"{"ua_l3":7}"#] {
            let e = host_subnet(Some(bad), "ua_l3").unwrap_err().to_string();
            assert!(e.contains(NODE_SUBNETS_ANNOTATION), "{e}");
        }
    }

    #[test]
    fn peers_routes_and_the_gateway() {
        let mine: Ipv4Cidr = "10.150.1.0/24".parse().unwrap();
        let node = |n: &str, ip: Option<&str>, ann: Option<&str>| L3Node {
            name: n.into(),
            underlay: ip.map(|i| i.parse().unwrap()),
            node_subnets: ann.map(String::from),
        };
        let nodes = [
            node(
                "na",
                Some("192.168.1.1"),
                Some(r#"{"ua_l3":["10.150.1.0/24"]}"#),
            ),
            node(
                "nb",
                Some("192.168.1.2"),
                Some(r#"{"ua_l3":["10.150.2.0/24"]}"#),
            ),
            node("nc", None, Some(r#"{"ua_l3":["10.150.3.0/24"]}"#)),
            node(
                "nd",
                Some("192.168.1.4"),
                Some(r#"{"other":["10.150.4.0/24"]}"#),
            ),
            node(
                "ne",
                Some("192.168.1.5"),
                Some(r#"{"ua_l3":["10.150.1.0/24"]}"#),
            ),
        ];
        let p = peers("ua_l3", "na", mine, &nodes);
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(
            (
                p[0].name.as_str(),
                p[0].pod_cidr.to_string(),
                p[0].underlay.to_string()
            ),
            (
                "ua_l3@192.168.1.2",
                "10.150.2.0/24".into(),
                "192.168.1.2".into()
            )
        );
        let n = net();
        let local = Ipv4Addr::new(192, 168, 1, 1);
        let steps = route_sync(&n, local, &Observed::default(), &p).unwrap();
        let text = format!("{steps:?}");
        assert!(
            text.contains("10.150.2.0/24") && text.contains("onlink") && text.contains(VXLAN),
            "{text}"
        );
        assert!(
            text.contains(&n.netns) && text.contains("192.168.1.2"),
            "{text}"
        );
        let (_, ov) = overlay_end(&n, local).unwrap();
        // Per network and node: the peer's MAC is what it gives its own device.
        assert_eq!(
            ov.vtep_mac,
            crate::overlay::vtep_mac(&vtep_name("ua_l3", local))
        );
        assert_eq!(
            p[0].mac(),
            crate::overlay::vtep_mac(&vtep_name("ua_l3", "192.168.1.2".parse().unwrap()))
        );
        assert_ne!(
            p[0].mac(),
            crate::overlay::vtep_mac(&vtep_name("ub_l3", p[0].underlay))
        );
        assert_eq!(ov.vni, 10007);
        let r = format!("{:?}", routed_steps(&n));
        assert!(
            r.contains("10.150.1.1/24")
                && r.contains("ip_forward")
                && r.contains(&ov.vtep_mac.to_string()),
            "{r}"
        );
        // The VXLAN device is no bridge port on a Layer3 network.
        let steps = crate::udn::network_steps(&n);
        assert!(
            !format!("{:?}", steps.after).contains("master"),
            "{steps:?}"
        );
    }
}
