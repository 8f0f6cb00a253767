//! Pod-network routes that follow a migrated VMI (pure; docs/networking.md "Addresses that
//! move"). A VMI keeps its address when it is live-migrated, so it may run on a node whose pod
//! subnet does not hold that address. The node that runs it publishes the address on its Node
//! (annotation [`ROUTES_ANNOTATION`], a JSON list) and every node routes it as a `/32`:
//! through the overlay to the publishing node's `.0` (the home node included: the `/32`
//! overrides its on-link subnet route), and on the running node itself to the node bridge,
//! where the VMI's veth answers for it. [`desired`] decides the routes from Node facts,
//! [`parse_observed`] reads what the kernel holds (only routes of protocol [`ROUTE_PROTO`],
//! so no other route is ever touched) and [`sync_actions`] turns the difference into steps.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::overlay::Peer;
use crate::plan::NodeNetwork;
use crate::render::{Action, ip};

/// The Node annotation listing the addresses of VMIs the node runs outside its pod subnet.
pub const ROUTES_ANNOTATION: &str = "ferrovirt.io/pod-routes";
/// The routing protocol number marking this module's routes (`ip route … proto 77`).
pub const ROUTE_PROTO: &str = "77";

/// How one moved address is reached from this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum HostRoute {
    /// The VMI runs here: the address is on the node bridge (`dev fv-br0 scope link`).
    Local,
    /// The VMI runs on the peer whose overlay address this is (`via G dev fv-vx0 onlink`).
    Via(Ipv4Addr),
}

/// Parses a [`ROUTES_ANNOTATION`] value: a JSON list of IPv4 addresses.
pub fn parse_claims(value: &str) -> Result<Vec<Ipv4Addr>> {
    serde_json::from_str::<Vec<Ipv4Addr>>(value)
        .map_err(|e| Error::InvalidPlan(format!("{ROUTES_ANNOTATION} {value:?}: {e}")))
}

/// The [`ROUTES_ANNOTATION`] value for `addrs` (`None`: no annotation).
pub fn encode_claims(addrs: &BTreeSet<Ipv4Addr>) -> Option<String> {
    if addrs.is_empty() {
        return None;
    }
    serde_json::to_string(&addrs.iter().collect::<Vec<_>>()).ok()
}

/// The addresses among `hosted` (those of the VMIs this node runs) that lie outside the
/// node's pod subnet: what the node publishes.
pub fn away_addresses(node: &NodeNetwork, hosted: &BTreeSet<Ipv4Addr>) -> BTreeSet<Ipv4Addr> {
    hosted
        .iter()
        .copied()
        .filter(|a| !node.node_subnet.contains(*a) && node.ipam.cluster.contains(*a))
        .collect()
}

/// The `/32` routes this node should hold. `peers`: the overlay peers ([`crate::overlay::peers`]);
/// `claims`: the other Nodes' published addresses (node name → addresses); `hosted`: the
/// addresses of the VMIs running on this node. A claim is ignored (and named in the notes)
/// when its node is no overlay peer, when the address lies outside the cluster CIDR, in the
/// claimer's own subnet, or is a node's network or gateway address (no node can take over
/// another's `.0`/`.1`), and when an earlier node (name order) claims it too. An address this
/// node runs itself is never routed elsewhere.
pub fn desired(
    node: &NodeNetwork,
    peers: &[Peer],
    claims: &BTreeMap<String, Vec<Ipv4Addr>>,
    hosted: &BTreeSet<Ipv4Addr>,
) -> (BTreeMap<Ipv4Addr, HostRoute>, Vec<String>) {
    let mut out: BTreeMap<Ipv4Addr, HostRoute> = away_addresses(node, hosted)
        .into_iter()
        .map(|a| (a, HostRoute::Local))
        .collect();
    let mut owner: BTreeMap<Ipv4Addr, &str> = BTreeMap::new();
    let mut notes = Vec::new();
    let reserved = |a: Ipv4Addr| {
        std::iter::once(node.node_subnet)
            .chain(peers.iter().map(|p| p.pod_cidr))
            .any(|c| a == c.network() || a == c.gateway())
    };
    for (name, addrs) in claims {
        let Some(peer) = peers.iter().find(|p| &p.name == name) else {
            if !addrs.is_empty() {
                notes.push(format!(
                    "node {name} publishes pod routes but is no overlay peer"
                ));
            }
            continue;
        };
        for &a in addrs {
            if !node.ipam.cluster.contains(a) || peer.pod_cidr.contains(a) || reserved(a) {
                notes.push(format!(
                    "node {name}: pod route {a} refused (outside the cluster CIDR, in its own subnet, or a node address)"
                ));
                continue;
            }
            if hosted.contains(&a) {
                continue;
            }
            if let Some(first) = owner.get(&a) {
                notes.push(format!(
                    "pod route {a} claimed by nodes {first} and {name}: {first} kept"
                ));
                continue;
            }
            owner.insert(a, name);
            out.insert(a, HostRoute::Via(peer.gateway()));
        }
    }
    (out, notes)
}

#[derive(Deserialize)]
struct RouteJson {
    dst: String,
    #[serde(default)]
    gateway: Option<String>,
    #[serde(default)]
    dev: Option<String>,
}

/// Parses `ip -j route show proto 77` (the node namespace): host routes on the overlay device
/// (with a gateway) or on the node bridge. Anything else is left out, so never removed.
pub fn parse_observed(
    node: &NodeNetwork,
    overlay_device: &str,
    text: &str,
) -> Result<BTreeMap<Ipv4Addr, HostRoute>> {
    let mut out = BTreeMap::new();
    if text.trim().is_empty() {
        return Ok(out);
    }
    let routes: Vec<RouteJson> = serde_json::from_str(text)
        .map_err(|e| Error::InvalidPlan(format!("unexpected `ip -j route` output: {e}")))?;
    for r in routes {
        let dst = r.dst.strip_suffix("/32").unwrap_or(&r.dst);
        let Ok(dst) = dst.parse::<Ipv4Addr>() else {
            continue;
        };
        let dev = r.dev.unwrap_or_default();
        let gw = r.gateway.and_then(|g| g.parse::<Ipv4Addr>().ok());
        match gw {
            Some(g) if dev == overlay_device => {
                out.insert(dst, HostRoute::Via(g));
            }
            None if dev == node.bridge => {
                out.insert(dst, HostRoute::Local);
            }
            _ => {}
        }
    }
    Ok(out)
}

/// The steps that make the kernel hold exactly `desired`: a `replace` for every route missing
/// or different, a `del` for every route of ours no longer wanted.
pub fn sync_actions(
    node: &NodeNetwork,
    overlay_device: &str,
    observed: &BTreeMap<Ipv4Addr, HostRoute>,
    desired: &BTreeMap<Ipv4Addr, HostRoute>,
) -> Vec<Action> {
    let ns = &node.netns;
    let mut a = Vec::new();
    for (addr, route) in desired {
        if observed.get(addr) == Some(route) {
            continue;
        }
        let dst = format!("{addr}/32");
        a.push(match route {
            HostRoute::Local => ip(
                ns,
                &[
                    "route",
                    "replace",
                    &dst,
                    "dev",
                    &node.bridge,
                    "scope",
                    "link",
                    "proto",
                    ROUTE_PROTO,
                ],
            ),
            HostRoute::Via(g) => ip(
                ns,
                &[
                    "route",
                    "replace",
                    &dst,
                    "via",
                    &g.to_string(),
                    "dev",
                    overlay_device,
                    "onlink",
                    "proto",
                    ROUTE_PROTO,
                ],
            ),
        });
    }
    for addr in observed.keys().filter(|a| !desired.contains_key(*a)) {
        a.push(ip(
            ns,
            &["route", "del", &format!("{addr}/32"), "proto", ROUTE_PROTO],
        ));
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipam::Ipam;

    /// Node b (10.244.2.0/24) with peers a (10.244.1.0/24) and c (10.244.3.0/24).
    fn node() -> NodeNetwork {
        let ipam = Ipam::default();
        NodeNetwork::new(ipam, "10.244.2.0/24".parse().unwrap())
    }

    fn peers() -> Vec<Peer> {
        vec![
            Peer {
                name: "a".into(),
                pod_cidr: "10.244.1.0/24".parse().unwrap(),
                underlay: "192.168.7.1".parse().unwrap(),
            },
            Peer {
                name: "c".into(),
                pod_cidr: "10.244.3.0/24".parse().unwrap(),
                underlay: "192.168.7.3".parse().unwrap(),
            },
        ]
    }

    fn addr(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    fn claims(v: &[(&str, &[&str])]) -> BTreeMap<String, Vec<Ipv4Addr>> {
        v.iter()
            .map(|(n, a)| (n.to_string(), a.iter().map(|s| addr(s)).collect()))
            .collect()
    }

    fn lines(a: &[Action]) -> Vec<String> {
        a.iter().map(|a| a.command_line()).collect()
    }

    #[test]
    fn a_vmi_moved_from_a_to_c_is_routed_through_c_everywhere() {
        // On b (a bystander): the address of a's subnet now running on c goes to c.
        let (d, notes) = desired(
            &node(),
            &peers(),
            &claims(&[("c", &["10.244.1.7"])]),
            &BTreeSet::new(),
        );
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(
            d,
            BTreeMap::from([(addr("10.244.1.7"), HostRoute::Via(addr("10.244.3.0")))])
        );
        let a = sync_actions(&node(), "fv-vx0", &BTreeMap::new(), &d);
        assert_eq!(
            lines(&a),
            ["ip route replace 10.244.1.7/32 via 10.244.3.0 dev fv-vx0 onlink proto 77"]
        );
        // In sync: nothing to do.
        let obs = parse_observed(
            &node(),
            "fv-vx0",
            r#"[{"dst":"10.244.1.7","gateway":"10.244.3.0","dev":"fv-vx0","flags":["onlink"]}]"#,
        )
        .unwrap();
        assert!(sync_actions(&node(), "fv-vx0", &obs, &d).is_empty());
    }

    #[test]
    fn the_running_node_routes_the_address_to_its_bridge_and_publishes_it() {
        // b runs a VMI with an address of a's subnet (and one of its own).
        let hosted = BTreeSet::from([addr("10.244.1.7"), addr("10.244.2.9")]);
        assert_eq!(
            encode_claims(&away_addresses(&node(), &hosted)).as_deref(),
            Some(r#"["10.244.1.7"]"#)
        );
        assert_eq!(encode_claims(&BTreeSet::new()), None);
        assert_eq!(
            parse_claims(r#"["10.244.1.7"]"#).unwrap(),
            [addr("10.244.1.7")]
        );
        assert!(parse_claims("[\"x\"]").is_err());
        // A stale claim of the previous node (c) does not take it away from here.
        let (d, _) = desired(
            &node(),
            &peers(),
            &claims(&[("c", &["10.244.1.7"])]),
            &hosted,
        );
        assert_eq!(d, BTreeMap::from([(addr("10.244.1.7"), HostRoute::Local)]));
        let obs = parse_observed(
            &node(),
            "fv-vx0",
            r#"[{"dst":"10.244.1.7","gateway":"10.244.3.0","dev":"fv-vx0","flags":["onlink"]}]"#,
        )
        .unwrap();
        assert_eq!(
            lines(&sync_actions(&node(), "fv-vx0", &obs, &d)),
            ["ip route replace 10.244.1.7/32 dev fv-br0 scope link proto 77"]
        );
    }

    #[test]
    fn the_home_node_routes_its_own_address_away_and_back() {
        // On a (home of 10.244.1.7), the VMI runs on b (this node() plays b's peer list
        // from a's view: peers b and c).
        let ipam = Ipam::default();
        let home = NodeNetwork::new(ipam, "10.244.1.0/24".parse().unwrap());
        let peers = vec![Peer {
            name: "b".into(),
            pod_cidr: "10.244.2.0/24".parse().unwrap(),
            underlay: "192.168.7.2".parse().unwrap(),
        }];
        let (d, _) = desired(
            &home,
            &peers,
            &claims(&[("b", &["10.244.1.7"])]),
            &BTreeSet::new(),
        );
        assert_eq!(
            d,
            BTreeMap::from([(addr("10.244.1.7"), HostRoute::Via(addr("10.244.2.0")))])
        );
        // Back home: the VMI runs on a again, b withdrew: the /32 goes, the subnet route
        // (not ours) carries it.
        let obs = parse_observed(
            &home,
            "fv-vx0",
            r#"[{"dst":"10.244.1.7","gateway":"10.244.2.0","dev":"fv-vx0","flags":["onlink"]},
                {"dst":"10.244.2.0/24","gateway":"10.244.2.0","dev":"fv-vx0"},
                {"dst":"10.244.9.9","dev":"eth9"}]"#,
        )
        .unwrap();
        assert_eq!(obs.len(), 1, "{obs:?}");
        let hosted = BTreeSet::from([addr("10.244.1.7")]);
        let (d, _) = desired(&home, &peers, &BTreeMap::new(), &hosted);
        assert!(d.is_empty(), "a home address needs no /32: {d:?}");
        assert_eq!(
            lines(&sync_actions(&home, "fv-vx0", &obs, &d)),
            ["ip route del 10.244.1.7/32 proto 77"]
        );
    }

    #[test]
    fn claims_that_would_hijack_are_refused() {
        let (d, notes) = desired(
            &node(),
            &peers(),
            &claims(&[
                // a claims: a node gateway, an address outside the cluster, one of its own.
                (
                    "a",
                    &[
                        "10.244.2.1",
                        "10.244.3.0",
                        "8.8.8.8",
                        "10.244.1.20",
                        "10.244.3.5",
                        "10.244.9.5",
                    ],
                ),
                // c claims an address a claims too: the first name wins.
                ("c", &["10.244.9.5", "10.244.1.9"]),
                // x is no peer.
                ("x", &["10.244.1.10"]),
            ]),
            &BTreeSet::new(),
        );
        assert_eq!(
            d,
            BTreeMap::from([
                (addr("10.244.1.9"), HostRoute::Via(addr("10.244.3.0"))),
                (addr("10.244.3.5"), HostRoute::Via(addr("10.244.1.0"))),
                (addr("10.244.9.5"), HostRoute::Via(addr("10.244.1.0"))),
            ])
        );
        let notes = notes.join("\n");
        for refused in ["10.244.2.1", "10.244.3.0", "8.8.8.8", "10.244.1.20"] {
            assert!(
                notes.contains(&format!("pod route {refused} refused")),
                "{refused}: {notes}"
            );
        }
        assert!(
            notes.contains("claimed by nodes a and c: a kept"),
            "{notes}"
        );
        assert!(notes.contains("node x publishes pod routes but is no overlay peer"));
    }
}
