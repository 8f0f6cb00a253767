//! Primary Layer2 user-defined networks on one node (pure; docs/networking.md "User-defined
//! networks"). Each network gets, on every node that runs one of its VMIs, a network
//! namespace of its own ([`netns_name`]) holding a bridge and a VXLAN device with the
//! network's VNI (its UDP socket in the node's namespace, head-end replication to every
//! overlay peer: [`fdb_sync_actions`]). A VMI joins it as the bridge binding joins the pod
//! network ([`vmi_plan`]: the node side of its veth is a port of the network's bridge, the
//! guest holds the address the controller annotated, served by the VMI's DHCP server).
//! Isolation between two networks, even with the same subnet, comes from the separate
//! namespaces and VNIs: nothing routes between them.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ipam::{Ipam, Ipv4Cidr, MacAddr};
use crate::plan::{Binding, NodeNetwork, PodPlan, PodRequest};
use crate::render::{Action, ip, strs};

/// Annotation on a UDN's NetworkAttachmentDefinition: the network's VNI (decimal).
pub const VNI_ANNOTATION: &str = "ferrovirt.io/udn-vni";
/// Annotation on a VMI: its addresses on user-defined networks (OVN-K's pod annotation).
pub const POD_NETWORKS_ANNOTATION: &str = "k8s.ovn.org/pod-networks";
/// Prefix of the networks' namespaces on a node.
pub const NETNS_PREFIX: &str = "fvn-";
/// The bridge in a network's namespace.
pub const BRIDGE: &str = "udn-br0";
/// The VXLAN device in a network's namespace.
pub const VXLAN: &str = "udn-vx0";
/// The VXLAN UDP port (shared with the pod overlay's socket; VNIs tell them apart).
pub const VXLAN_PORT: u16 = 4789;
/// The lowest VNI a user-defined network may have (the pod overlay uses 4244).
pub const MIN_VNI: u32 = 10_000;
/// OVN-Kubernetes' default MTU for user-defined networks.
pub const DEFAULT_MTU: u16 = 1400;
/// The all-zero MAC of head-end replication FDB entries.
const FLOOD_MAC: &str = "00:00:00:00:00:00";

/// What the agent reads from a UDN's NetworkAttachmentDefinition (`spec.config`, OVN-K's
/// `ovn-k8s-cni-overlay` config, and the VNI annotation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NadConfig {
    /// The network (`<ns>_<udn>` or `cluster_udn_<cudn>`): one per UDN or CUDN.
    pub name: String,
    /// `layer2`, `layer3` or `localnet`.
    pub topology: String,
    /// `primary` or `secondary`.
    pub role: String,
    /// `subnets`, comma-separated CIDRs.
    pub subnets: Vec<String>,
    pub mtu: Option<u16>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawConfig {
    #[serde(default)]
    name: String,
    #[serde(default)]
    topology: String,
    #[serde(default)]
    role: String,
    #[serde(default)]
    subnets: String,
    #[serde(default)]
    mtu: Option<u16>,
}

/// Parses a UDN NAD's `spec.config`; errors name the field.
pub fn parse_nad_config(config: &str) -> Result<NadConfig> {
    let raw: RawConfig = serde_json::from_str(config)
        .map_err(|e| Error::InvalidNetworkConfig(format!("spec.config: {e}")))?;
    if raw.name.is_empty() {
        return Err(Error::InvalidNetworkConfig(
            "spec.config.name: required".into(),
        ));
    }
    Ok(NadConfig {
        name: raw.name,
        topology: raw.topology.to_ascii_lowercase(),
        role: raw.role.to_ascii_lowercase(),
        subnets: raw
            .subnets
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect(),
        mtu: raw.mtu,
    })
}

/// Parses the VNI annotation: `None` when absent (the controller has not written it yet).
pub fn parse_vni(annotation: Option<&str>) -> Result<Option<u32>> {
    let Some(a) = annotation else {
        return Ok(None);
    };
    match a.trim().parse::<u32>() {
        Ok(v) if (MIN_VNI..(1 << 24)).contains(&v) => Ok(Some(v)),
        _ => Err(Error::InvalidNetworkConfig(format!(
            "metadata.annotations[{VNI_ANNOTATION}]: {a:?} is not a VNI ({MIN_VNI}-16777215)"
        ))),
    }
}

/// A Primary Layer2 network as this node carries it out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UdnNetwork {
    /// The network's name (NAD config `name`).
    pub name: String,
    pub vni: u32,
    /// Its IPv4 subnet.
    pub subnet: Ipv4Cidr,
    pub mtu: u16,
    /// The network's namespace on this node ([`netns_name`]).
    pub netns: String,
    /// The node's namespace (`--node-netns`); `None`: the agent's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_netns: Option<String>,
    /// The node's underlay address (the VXLAN endpoint); `None`: no VXLAN device, the network
    /// spans only this node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<Ipv4Addr>,
}

/// The network's namespace on a node: `fvn-<8 hex of the name's hash>`, with
/// `-<node namespace>` appended when nodes are namespaces of one host (`--node-netns`).
pub fn netns_name(network: &str, node_netns: Option<&str>) -> String {
    let h = &crate::plan::hash_hex(network)[..8];
    match node_netns {
        Some(n) => format!("{NETNS_PREFIX}{h}-{n}"),
        None => format!("{NETNS_PREFIX}{h}"),
    }
}

/// Whether `name` (an entry of /run/netns) is a network namespace this node made (see
/// [`netns_name`]): namespaces of other nodes on the same host are never this node's.
pub fn is_own_netns(name: &str, node_netns: Option<&str>) -> bool {
    let Some(rest) = name.strip_prefix(NETNS_PREFIX) else {
        return false;
    };
    let (hash, tail) = match rest.split_once('-') {
        Some((h, t)) => (h, Some(t)),
        None => (rest, None),
    };
    hash.len() == 8 && hash.chars().all(|c| c.is_ascii_hexdigit()) && tail == node_netns
}

impl UdnNetwork {
    /// Decides the network from its NAD: only a Primary Layer2 network with an IPv4 subnet is
    /// carried out; anything else is refused naming the field.
    pub fn from_nad(
        config: &NadConfig,
        vni: u32,
        node_netns: Option<&str>,
        local: Option<Ipv4Addr>,
    ) -> Result<UdnNetwork> {
        if config.role != "primary" {
            return Err(Error::InvalidNetworkConfig(format!(
                "spec.config.role {:?}: not a primary network",
                config.role
            )));
        }
        match config.topology.as_str() {
            "layer2" => {}
            "layer3" => {
                return Err(Error::InvalidNetworkConfig(
                    "spec.config.topology: topology Layer3 on a Primary UserDefinedNetwork is \
                     not carried out yet (use Layer2)"
                        .into(),
                ));
            }
            other => {
                return Err(Error::InvalidNetworkConfig(format!(
                    "spec.config.topology {other:?}: a Primary UserDefinedNetwork must be Layer2"
                )));
            }
        }
        let subnet = config
            .subnets
            .iter()
            .find_map(|s| s.parse::<Ipv4Cidr>().ok())
            .ok_or_else(|| {
                Error::InvalidNetworkConfig(format!(
                    "spec.config.subnets {:?}: no IPv4 subnet (IPv6-only networks are not carried out)",
                    config.subnets.join(",")
                ))
            })?;
        if subnet.prefix() > 30 {
            return Err(Error::InvalidNetworkConfig(format!(
                "spec.config.subnets: {subnet} is too small"
            )));
        }
        let mtu = config.mtu.unwrap_or(DEFAULT_MTU);
        if !(576..=9000).contains(&mtu) {
            return Err(Error::InvalidNetworkConfig(format!(
                "spec.config.mtu {mtu}: not carried out (576-9000)"
            )));
        }
        Ok(UdnNetwork {
            name: config.name.clone(),
            vni,
            subnet,
            mtu,
            netns: netns_name(&config.name, node_netns),
            node_netns: node_netns.map(String::from),
            local,
        })
    }

    fn ns(&self) -> Option<String> {
        Some(self.netns.clone())
    }
}

/// The network's steps on this node, in three parts so that the VXLAN device is made from
/// the node's namespace (its UDP socket stays there) only when the network's namespace does
/// not hold it yet: run `before`, then `vxlan` when the device is missing, then `after`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkSteps {
    pub before: Vec<Action>,
    /// `ip [-n NODE] link add udn-vx0 netns fvn-… type vxlan id VNI local IP dstport 4789`.
    pub vxlan: Option<Action>,
    pub after: Vec<Action>,
}

/// The steps that make (or repair) the network's namespace, bridge and VXLAN device.
/// Idempotent: existing links are kept.
pub fn network_steps(net: &UdnNetwork) -> NetworkSteps {
    let ns = net.ns();
    let mtu = net.mtu.to_string();
    let mut before = vec![
        Action::AddNetns(net.netns.clone()),
        ip(&ns, &["link", "set", "lo", "up"]),
        Action::AddLink {
            netns: ns.clone(),
            name: BRIDGE.into(),
            args: strs(&["link", "add", BRIDGE, "type", "bridge"]),
        },
    ];
    // No IPv6 chatter (router solicitations, DAD) from the namespace's own links.
    before.push(Action::Sysctl {
        netns: ns.clone(),
        key: "net/ipv6/conf/default/disable_ipv6".into(),
        value: "1".into(),
    });
    let mut after = Vec::new();
    let vxlan = net.local.map(|local| {
        after.push(ip(
            &ns,
            &["link", "set", VXLAN, "master", BRIDGE, "mtu", &mtu, "up"],
        ));
        Action::Ip {
            netns: net.node_netns.clone(),
            args: strs(&[
                "link",
                "add",
                VXLAN,
                "netns",
                &net.netns,
                "mtu",
                &mtu,
                "type",
                "vxlan",
                "id",
                &net.vni.to_string(),
                "local",
                &local.to_string(),
                "dstport",
                &VXLAN_PORT.to_string(),
            ]),
        }
    });
    after.push(ip(&ns, &["link", "set", BRIDGE, "mtu", &mtu, "up"]));
    NetworkSteps {
        before,
        vxlan,
        after,
    }
}

/// The steps that remove the network from this node: the VXLAN device first (its VNI is free
/// in the node's namespace at once; a namespace's links go asynchronously), then the namespace.
pub fn network_teardown(netns: &str) -> Vec<Action> {
    vec![
        Action::DelLink {
            netns: Some(netns.to_string()),
            name: VXLAN.into(),
        },
        Action::DelNetns(netns.to_string()),
    ]
}

#[derive(Deserialize)]
struct FdbJson {
    mac: String,
    #[serde(default)]
    dst: Option<String>,
}

/// The head-end replication entries (`00:00:00:00:00:00 dst IP`) in `bridge -j fdb show dev
/// udn-vx0`; learned entries are left out.
pub fn parse_flood_entries(fdb: &str) -> Result<BTreeSet<Ipv4Addr>> {
    if fdb.trim().is_empty() {
        return Ok(BTreeSet::new());
    }
    let entries: Vec<FdbJson> = serde_json::from_str(fdb)
        .map_err(|e| Error::InvalidPlan(format!("unexpected `bridge -j fdb` output: {e}")))?;
    Ok(entries
        .into_iter()
        .filter(|e| e.mac == FLOOD_MAC)
        .filter_map(|e| e.dst?.parse().ok())
        .collect())
}

/// The steps that make the network's flood list equal to the overlay peers' underlay
/// addresses (never this node's own): appends the missing, deletes the others.
pub fn fdb_sync_actions(
    net: &UdnNetwork,
    observed: &BTreeSet<Ipv4Addr>,
    peers: &BTreeSet<Ipv4Addr>,
) -> Vec<Action> {
    let Some(local) = net.local else {
        return Vec::new();
    };
    let want: BTreeSet<Ipv4Addr> = peers.iter().copied().filter(|p| *p != local).collect();
    let fdb = |verb: &str, dst: &Ipv4Addr, tolerate: bool| Action::Bridge {
        netns: net.ns(),
        args: strs(&[
            "fdb",
            verb,
            FLOOD_MAC,
            "dev",
            VXLAN,
            "dst",
            &dst.to_string(),
        ]),
        tolerate_failure: tolerate,
    };
    let mut a: Vec<Action> = want
        .difference(observed)
        .map(|d| fdb("append", d, false))
        .collect();
    a.extend(observed.difference(&want).map(|d| fdb("del", d, true)));
    a
}

/// A VMI's address on a network, from its `k8s.ovn.org/pod-networks` annotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdnAddress {
    pub address: Ipv4Addr,
    pub prefix: u8,
    /// The first of `gateway_ips`, if any (not offered: this data plane has no gateway).
    pub gateway: Option<Ipv4Addr>,
}

#[derive(Deserialize)]
struct PodNetworkJson {
    #[serde(default)]
    ip_addresses: Vec<String>,
    #[serde(default)]
    gateway_ips: Vec<String>,
}

/// The VMI's IPv4 address on the NAD `key` (`<ns>/<name>`) from its pod-networks annotation;
/// `None` while the annotation (or its entry) is not there yet. A malformed entry, or an
/// address outside `subnet`, is an error naming the annotation.
pub fn parse_pod_networks(
    annotation: Option<&str>,
    key: &str,
    subnet: Ipv4Cidr,
) -> Result<Option<UdnAddress>> {
    let Some(text) = annotation else {
        return Ok(None);
    };
    let field = format!("metadata.annotations[{POD_NETWORKS_ANNOTATION}]");
    let all: std::collections::BTreeMap<String, PodNetworkJson> = serde_json::from_str(text)
        .map_err(|e| Error::InvalidNetworkConfig(format!("{field}: {e}")))?;
    let Some(entry) = all.get(key) else {
        return Ok(None);
    };
    let (address, prefix) = entry
        .ip_addresses
        .iter()
        .find_map(|a| {
            let (ip, p) = a.split_once('/')?;
            Some((ip.parse::<Ipv4Addr>().ok()?, p.parse::<u8>().ok()?))
        })
        .ok_or_else(|| {
            Error::InvalidNetworkConfig(format!(
                "{field}[{key:?}].ip_addresses {:?}: no IPv4 address with a prefix",
                entry.ip_addresses
            ))
        })?;
    if !subnet.contains(address) || prefix != subnet.prefix() {
        return Err(Error::InvalidNetworkConfig(format!(
            "{field}[{key:?}]: {address}/{prefix} is not in the network's subnet {subnet}"
        )));
    }
    let gateway = entry.gateway_ips.iter().find_map(|g| g.parse().ok());
    Ok(Some(UdnAddress {
        address,
        prefix,
        gateway,
    }))
}

/// What [`vmi_plan`] needs about the VMI.
#[derive(Debug, Clone)]
pub struct UdnVmi<'a> {
    pub uid: &'a str,
    pub namespace: &'a str,
    pub name: &'a str,
    /// The interface name in the VMI spec.
    pub interface: &'a str,
    pub mac: Option<MacAddr>,
    pub queues: u32,
    /// The node's nft table name and namespace/veth prefixes ([`NodeNetwork`]'s).
    pub node: &'a NodeNetwork,
}

/// The VMI's plan on the network: the bridge binding's plan (namespace `fv-<uid>`, veth,
/// `k6t-eth0`, tap, DHCP server on the link-local server address) whose node side is the
/// network's bridge in the network's namespace. DHCP offers the annotated address with the
/// network's MTU and no router and no DNS (the network has no gateway here).
pub fn vmi_plan(net: &UdnNetwork, vmi: &UdnVmi<'_>, addr: UdnAddress) -> Result<PodPlan> {
    let ipam = Ipam {
        cluster: net.subnet,
        node_prefix: net.subnet.prefix(),
    };
    let mut node = NodeNetwork::new(ipam, net.subnet);
    node.bridge = BRIDGE.into();
    node.netns = Some(net.netns.clone());
    node.mtu = net.mtu;
    node.nft_table = vmi.node.nft_table.clone();
    node.netns_prefix = vmi.node.netns_prefix.clone();
    node.veth_prefix = vmi.node.veth_prefix.clone();
    let mut req = PodRequest::new(vmi.uid, vmi.namespace, vmi.name, Binding::Bridge);
    req.interface = vmi.interface.into();
    req.mac = vmi.mac;
    req.queues = vmi.queues;
    req.address = Some(addr.address);
    let mut plan = PodPlan::build(&node, &req)?;
    plan.lease.router = None;
    plan.lease.dns.clear();
    plan.lease.search.clear();
    plan.udn = Some(net.clone());
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = r#"{"cniVersion":"1.0.0","type":"ovn-k8s-cni-overlay","name":"ua_net",
        "netAttachDefName":"ua/net","topology":"layer2","role":"primary",
        "subnets":"10.100.0.0/24","mtu":1400,"allowPersistentIPs":true}"#;

    fn net(node_ns: Option<&str>) -> UdnNetwork {
        let c = parse_nad_config(CONFIG).unwrap();
        UdnNetwork::from_nad(&c, 10001, node_ns, Some(Ipv4Addr::new(192, 168, 1, 1))).unwrap()
    }

    #[test]
    fn the_nad_config_decides_the_network() {
        let n = net(Some("nodea"));
        assert_eq!(n.name, "ua_net");
        assert_eq!(n.subnet.to_string(), "10.100.0.0/24");
        assert_eq!(n.mtu, 1400);
        assert!(
            n.netns.starts_with("fvn-") && n.netns.ends_with("-nodea"),
            "{n:?}"
        );
        // The same name on one node is the same namespace; another network is another one.
        assert_eq!(n.netns, net(Some("nodea")).netns);
        assert_ne!(netns_name("ua_net", None), netns_name("ub_net", None));
        assert_eq!(netns_name("ua_net", None).len(), 12);
        // Layer3, secondary, IPv6-only are refused naming the field.
        let l3 = CONFIG.replace("layer2", "layer3");
        let e = UdnNetwork::from_nad(&parse_nad_config(&l3).unwrap(), 10001, None, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("spec.config.topology") && e.contains("Layer3"),
            "{e}"
        );
        let sec = CONFIG.replace("\"primary\"", "\"secondary\"");
        let e = UdnNetwork::from_nad(&parse_nad_config(&sec).unwrap(), 10001, None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("spec.config.role"), "{e}");
        let v6 = CONFIG.replace("10.100.0.0/24", "fd00::/64");
        let e = UdnNetwork::from_nad(&parse_nad_config(&v6).unwrap(), 10001, None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("spec.config.subnets"), "{e}");
        // No MTU in the config: OVN-K's default.
        let c = parse_nad_config(&CONFIG.replace(",\"mtu\":1400", "")).unwrap();
        assert_eq!(
            UdnNetwork::from_nad(&c, 10001, None, None).unwrap().mtu,
            DEFAULT_MTU
        );
    }

    #[test]
    fn vni_annotation() {
        assert_eq!(parse_vni(None).unwrap(), None);
        assert_eq!(parse_vni(Some("10005")).unwrap(), Some(10005));
        for bad in ["4244", "x", "16777216"] {
            let e = parse_vni(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(VNI_ANNOTATION), "{e}");
        }
    }

    #[test]
    fn own_namespaces_are_told_from_other_nodes_and_other_kinds() {
        let mine = netns_name("ua_net", Some("nodea"));
        assert!(is_own_netns(&mine, Some("nodea")));
        assert!(!is_own_netns(&mine, Some("nodeb")));
        assert!(!is_own_netns(&mine, None));
        assert!(is_own_netns(&netns_name("x", None), None));
        assert!(!is_own_netns("fv-1234", None));
        assert!(!is_own_netns("fvn-xyz", None));
    }

    #[test]
    fn network_steps_make_the_vxlan_from_the_node_namespace() {
        let n = net(Some("nodea"));
        let s = network_steps(&n);
        let vx = s.vxlan.expect("a VXLAN step").command_line();
        assert_eq!(
            vx,
            format!(
                "ip -n nodea link add udn-vx0 netns {} mtu 1400 type vxlan id 10001 local 192.168.1.1 dstport 4789",
                n.netns
            )
        );
        assert_eq!(s.before[0], Action::AddNetns(n.netns.clone()));
        let after: Vec<String> = s.after.iter().map(|a| a.command_line()).collect();
        assert_eq!(
            after,
            [
                format!(
                    "ip -n {} link set udn-vx0 master udn-br0 mtu 1400 up",
                    n.netns
                ),
                format!("ip -n {} link set udn-br0 mtu 1400 up", n.netns),
            ]
        );
        // Without an underlay address: a bridge only.
        let mut local_only = n.clone();
        local_only.local = None;
        let s = network_steps(&local_only);
        assert!(s.vxlan.is_none() && s.after.len() == 1);
        assert_eq!(
            network_teardown(&n.netns),
            vec![
                Action::DelLink {
                    netns: Some(n.netns.clone()),
                    name: VXLAN.into()
                },
                Action::DelNetns(n.netns.clone())
            ]
        );
    }

    #[test]
    fn flood_entries_follow_the_peers() {
        let n = net(None);
        let fdb = r#"[{"mac":"00:00:00:00:00:00","dst":"192.168.1.2","flags":["self"]},
            {"mac":"00:00:00:00:00:00","dst":"192.168.1.3"},
            {"mac":"5a:11:22:33:44:55","dst":"192.168.1.2"},
            {"mac":"33:33:00:00:00:01","flags":["self"]}]"#;
        let observed = parse_flood_entries(fdb).unwrap();
        assert_eq!(
            observed,
            BTreeSet::from([Ipv4Addr::new(192, 168, 1, 2), Ipv4Addr::new(192, 168, 1, 3)])
        );
        let peers = BTreeSet::from([
            Ipv4Addr::new(192, 168, 1, 1), // this node: never a flood target
            Ipv4Addr::new(192, 168, 1, 2),
            Ipv4Addr::new(192, 168, 1, 4),
        ]);
        let steps: Vec<String> = fdb_sync_actions(&n, &observed, &peers)
            .iter()
            .map(|a| a.command_line())
            .collect();
        assert_eq!(
            steps,
            [
                format!(
                    "bridge -n {} fdb append 00:00:00:00:00:00 dev udn-vx0 dst 192.168.1.4",
                    n.netns
                ),
                format!(
                    "bridge -n {} fdb del 00:00:00:00:00:00 dev udn-vx0 dst 192.168.1.3",
                    n.netns
                ),
            ]
        );
        // In sync: nothing to do.
        let synced = BTreeSet::from([Ipv4Addr::new(192, 168, 1, 2), Ipv4Addr::new(192, 168, 1, 4)]);
        assert!(fdb_sync_actions(&n, &synced, &peers).is_empty());
        assert!(parse_flood_entries("").unwrap().is_empty());
    }

    #[test]
    fn the_pod_networks_annotation_gives_the_address() {
        let subnet: Ipv4Cidr = "10.100.0.0/24".parse().unwrap();
        let ann = r#"{"ua/net":{"ip_addresses":["10.100.0.5/24"],"gateway_ips":["10.100.0.1"],"role":"primary"}}"#;
        let a = parse_pod_networks(Some(ann), "ua/net", subnet)
            .unwrap()
            .unwrap();
        assert_eq!(a.address, Ipv4Addr::new(10, 100, 0, 5));
        assert_eq!(a.prefix, 24);
        assert_eq!(a.gateway, Some(Ipv4Addr::new(10, 100, 0, 1)));
        // Not there yet: wait.
        assert_eq!(parse_pod_networks(None, "ua/net", subnet).unwrap(), None);
        assert_eq!(
            parse_pod_networks(Some(ann), "ub/net", subnet).unwrap(),
            None
        );
        // Outside the subnet, malformed: errors naming the annotation.
        let far = ann.replace("10.100.0.5/24", "10.200.0.5/24");
        let e = parse_pod_networks(Some(&far), "ua/net", subnet)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(POD_NETWORKS_ANNOTATION) && e.contains("10.200.0.5"),
            "{e}"
        );
        let e = parse_pod_networks(Some("{"), "ua/net", subnet)
            .unwrap_err()
            .to_string();
        assert!(e.contains(POD_NETWORKS_ANNOTATION), "{e}");
    }

    #[test]
    fn a_vmi_joins_the_network_bridge_with_its_annotated_address() {
        let n = net(Some("nodea"));
        let ipam = Ipam::default();
        let node = NodeNetwork::new(ipam, ipam.node_subnet(1).unwrap());
        let v = UdnVmi {
            uid: "uid-1",
            namespace: "ua",
            name: "a1",
            interface: "default",
            mac: None,
            queues: 1,
            node: &node,
        };
        let addr = UdnAddress {
            address: Ipv4Addr::new(10, 100, 0, 5),
            prefix: 24,
            gateway: Some(Ipv4Addr::new(10, 100, 0, 1)),
        };
        let p = vmi_plan(&n, &v, addr).unwrap();
        assert_eq!(p.netns, "fv-uid-1");
        assert_eq!(p.address, addr.address);
        assert_eq!(p.binding, Binding::Bridge);
        assert_eq!(p.node.netns.as_deref(), Some(n.netns.as_str()));
        assert_eq!(p.node.bridge, BRIDGE);
        assert_eq!(p.lease.address, addr.address);
        assert_eq!(p.lease.subnet, n.subnet);
        assert_eq!(p.lease.router, None);
        assert!(p.lease.dns.is_empty());
        assert_eq!(p.lease.mtu, Some(1400));
        assert_eq!(p.udn.as_ref(), Some(&n));
        assert!(!p.away);
        // The node side of the veth is a port of the network's bridge in its namespace.
        let steps: Vec<String> = crate::render::pod_actions(&p)
            .iter()
            .map(|a| a.command_line())
            .collect();
        assert!(
            steps.iter().any(|s| s
                == &format!(
                    "ip -n {} link set {} master udn-br0 mtu 1400 up",
                    n.netns, p.host_veth
                )),
            "{steps:#?}"
        );
    }
}
