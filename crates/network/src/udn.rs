//! Primary Layer2 user-defined networks on one node (pure; docs/networking.md "User-defined
//! networks"). Each network gets, on every node that runs one of its VMIs, a network
//! namespace of its own ([`netns_name`]) holding a bridge and a VXLAN device with the
//! network's VNI (its UDP socket in the node's namespace, head-end replication to every
//! overlay peer: [`fdb_sync_actions`]). A VMI joins it as the bridge binding joins the pod
//! network ([`vmi_plan`]: the node side of its veth is a port of the network's bridge, the
//! guest holds the address the controller annotated, served by the VMI's DHCP server). On a
//! node with an uplink the network has a gateway ([`gateway_steps`]: the subnet's first
//! address on the bridge, egress through a transit veth and NAT). Isolation between two
//! networks, even with the same subnet, comes from the separate namespaces and VNIs: nothing
//! routes between them. Layer3 networks (Primary and Secondary) are built here too, routed by
//! [`crate::udn_l3`]; a Primary Layer3 network's egress is [`gateway_steps`]' without the
//! anycast part.

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

/// A user-defined network as this node carries it out (Primary Layer2 or Layer3, Secondary
/// Layer2).
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
    /// The network's gateway on this node ([`gateway_steps`]); `None`: no gateway (the node
    /// has no uplink), the guests reach only their network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<UdnGateway>,
    /// A Layer3 network ([`crate::udn_l3`]): `subnet` is this node's host subnet, its first
    /// address the node's gateway on the network's bridge, other nodes' host subnets routed
    /// through the VXLAN device (no bridge port).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub layer3: bool,
    /// Layer3: the network's whole IPv4 subnet (the NAD's `subnets`), of which `subnet` is
    /// this node's host subnet: never sent out through the gateway, routed (Secondary) to
    /// the guests via the node's gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_cidr: Option<Ipv4Cidr>,
}

/// A network's gateway on a node: the subnet's first address on the network's bridge (the
/// same address and MAC on every node: each node answers its own guests), egress through a
/// veth to the node's namespace and out of its uplink, masqueraded twice (to the transit
/// address, then to the uplink's address).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UdnGateway {
    pub address: Ipv4Addr,
    /// The node's uplink (`--uplink`); `None`: the gateway serves the network (DHCP router,
    /// Services) but nothing leaves it.
    #[serde(default)]
    pub uplink: Option<String>,
}

/// Transit links between a network's namespace and the node's: `/30`s from this range, one
/// per network on the node (node side `.1`, network side `.2`).
pub const TRANSIT_RANGE: &str = "169.254.128.0/17";
/// The network side of the transit veth.
pub const GW_VETH: &str = "udn-gw";
/// Prefix of the node side of the transit veths.
pub const NODE_GW_VETH_PREFIX: &str = "fvg";
/// The nft table of the gateways (in the node's and each network's namespace).
pub const GW_TABLE: &str = "ferrovirt-udn";

/// The transit addresses of index `i`: (node side, network side).
pub fn transit(i: u16) -> (Ipv4Addr, Ipv4Addr) {
    let base = u32::from(Ipv4Addr::new(169, 254, 128, 0)) + 4 * u32::from(i);
    (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
}

/// The transit index of a network side address ([`transit`]), if it is one.
pub fn transit_index(addr: Ipv4Addr) -> Option<u16> {
    let off = u32::from(addr).checked_sub(u32::from(Ipv4Addr::new(169, 254, 128, 0)))?;
    (off % 4 == 2 && off / 4 < 8192).then_some((off / 4) as u16)
}

/// The lowest transit index no other network of the node uses.
pub fn pick_transit(used: &BTreeSet<u16>) -> Result<u16> {
    (0..8192u16)
        .find(|i| !used.contains(i))
        .ok_or_else(|| Error::InvalidPlan("no free transit link for a network gateway".into()))
}

/// The network side transit address in `ip -j -4 addr show dev udn-gw`, if any.
pub fn parse_transit(addr_json: &str) -> Option<u16> {
    let v: serde_json::Value = serde_json::from_str(addr_json).ok()?;
    v.as_array()?
        .iter()
        .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
        .filter_map(|a| a["local"].as_str()?.parse::<Ipv4Addr>().ok())
        .find_map(transit_index)
}

/// The MAC of a network's gateway: the same on every node.
pub fn gateway_mac(net: &UdnNetwork) -> MacAddr {
    MacAddr::stable(&["ferrovirt-udn-gw", &net.name])
}

/// The node side of a network's transit veth: `fvg<8 hex of the name's hash>`.
pub fn node_gw_veth(net: &UdnNetwork) -> String {
    format!(
        "{NODE_GW_VETH_PREFIX}{}",
        &crate::plan::hash_hex(&net.name)[..8]
    )
}

/// The node's gateway table (the same for every network): nothing from a transit veth is
/// delivered to the node unless it answers the node's own connection, nothing is forwarded
/// from one into the cluster CIDR (the pod network, other nodes' pod subnets) or to link-local
/// addresses (other networks' transit links, metadata services), and what leaves the uplink
/// from the transit range is masqueraded.
pub fn node_gateway_script(cluster: Ipv4Cidr, uplink: &str) -> String {
    let ifs = format!("\"{NODE_GW_VETH_PREFIX}*\"");
    let body = format!(
        "  chain input {{\n    type filter hook input priority 0; policy accept;\n    \
         iifname {ifs} ct state established,related accept\n    \
         iifname {ifs} counter drop\n  }}\n  \
         chain forward {{\n    type filter hook forward priority 0; policy accept;\n    \
         iifname {ifs} ip daddr {{ {cluster}, {ll} }} counter drop\n  }}\n  \
         chain postrouting {{\n    type nat hook postrouting priority 100; policy accept;\n    \
         ip saddr {TRANSIT_RANGE} oifname \"{uplink}\" masquerade\n  }}\n",
        ll = crate::render::LINK_LOCAL,
    );
    crate::render::replace_table("ip", GW_TABLE, &body)
}

/// The node's gateway table ([`node_gateway_script`]) goes with the last network that has an
/// egress on the node (`egress_left`: one is still in use).
pub fn node_gateway_cleanup(node_netns: Option<&str>, egress_left: bool) -> Option<Action> {
    (!egress_left).then(|| Action::DelNftTable {
        netns: node_netns.map(String::from),
        family: "ip".into(),
        table: GW_TABLE.into(),
    })
}

/// The network namespace's gateway tables: guests' traffic leaving through the transit veth
/// is masqueraded to the transit address, nothing from the node's side starts a connection
/// in, guests reach the gateway's own address only with ICMP echo, and no frame from the
/// gateway's MAC leaves through the VXLAN device (each node's gateway answers its own guests).
pub fn network_gateway_script(net: &UdnNetwork) -> String {
    let mac = gateway_mac(net);
    let ip = format!(
        "  chain input {{\n    type filter hook input priority 0; policy accept;\n    \
         ct state established,related accept\n    \
         iifname \"{BRIDGE}\" icmp type echo-request accept\n    \
         counter drop\n  }}\n  \
         chain forward {{\n    type filter hook forward priority 0; policy accept;\n    \
         iifname \"{GW_VETH}\" ct state established,related accept\n    \
         iifname \"{GW_VETH}\" counter drop\n  }}\n  \
         chain postrouting {{\n    type nat hook postrouting priority 100; policy accept;\n    \
         oifname \"{GW_VETH}\" masquerade\n  }}\n"
    );
    let bridge = format!(
        "  chain output {{\n    type filter hook output priority 0; policy accept;\n    \
         oifname \"{VXLAN}\" ether saddr {mac} counter drop\n  }}\n"
    );
    let mut s = crate::render::replace_table("ip", GW_TABLE, &ip);
    // Layer3: the VXLAN device is no bridge port, each node's gateway its own address.
    if !net.layer3 {
        s.push_str(&crate::render::replace_table("bridge", GW_TABLE, &bridge));
    }
    s
}

/// The steps of the network's gateway on this node with transit index `i` (after
/// [`network_steps`]); `cluster` is the cluster CIDR. A Layer3 network's gateway address
/// (its host subnet's first) is already on the bridge ([`crate::udn_l3::routed_steps`]):
/// only the egress is added, with the same protections. Without an uplink only the address
/// (and its tables): no transit link, no egress.
pub fn gateway_steps(net: &UdnNetwork, i: u16, cluster: Ipv4Cidr) -> Vec<Action> {
    let Some(gw) = &net.gateway else {
        return Vec::new();
    };
    let ns = net.ns();
    let nn = net.node_netns.clone();
    let hv = node_gw_veth(net);
    let (node_t, net_t) = transit(i);
    let gw_addr = format!("{}/{}", gw.address, net.subnet.prefix());
    let mut steps = vec![
        Action::Sysctl {
            netns: ns.clone(),
            key: "net/ipv4/ip_forward".into(),
            value: "1".into(),
        },
        Action::Nft {
            netns: ns.clone(),
            script: network_gateway_script(net),
        },
    ];
    if !net.layer3 {
        steps.extend([
            ip(
                &ns,
                &[
                    "link",
                    "set",
                    BRIDGE,
                    "address",
                    &gateway_mac(net).to_string(),
                ],
            ),
            ip(&ns, &["addr", "replace", &gw_addr, "dev", BRIDGE]),
        ]);
    }
    let Some(uplink) = &gw.uplink else {
        return steps;
    };
    steps.extend([
        Action::Nft {
            netns: nn.clone(),
            script: node_gateway_script(cluster, uplink),
        },
        crate::render::add_veth_pair(&nn, &hv, GW_VETH, &net.netns, "1500"),
        ip(
            &nn,
            &["addr", "replace", &format!("{node_t}/30"), "dev", &hv],
        ),
        ip(&nn, &["link", "set", &hv, "up"]),
        ip(
            &ns,
            &["addr", "replace", &format!("{net_t}/30"), "dev", GW_VETH],
        ),
        ip(&ns, &["link", "set", GW_VETH, "up"]),
        ip(
            &ns,
            &[
                "route",
                "replace",
                "default",
                "via",
                &node_t.to_string(),
                "dev",
                GW_VETH,
            ],
        ),
    ]);
    steps
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
        Self::build(config, vni, node_netns, local, true)
    }

    /// Decides a Primary Layer3 network on this node from its NAD and the node's host subnet
    /// of it ([`crate::udn_l3::host_subnet`]): the host subnet is the network's subnet here.
    pub fn from_layer3_nad(
        config: &NadConfig,
        vni: u32,
        host: Ipv4Cidr,
        node_netns: Option<&str>,
        local: Option<Ipv4Addr>,
    ) -> Result<UdnNetwork> {
        if config.role != "primary" || config.topology != "layer3" {
            return Err(Error::InvalidNetworkConfig(format!(
                "spec.config: topology {:?} role {:?} is not a Primary Layer3 network",
                config.topology, config.role
            )));
        }
        Self::layer3(config, vni, host, node_netns, local)
    }

    /// A Layer3 network on this node: the host subnet is its subnet here (inside the NAD's
    /// `subnets`, kept as `network_cidr`).
    fn layer3(
        config: &NadConfig,
        vni: u32,
        host: Ipv4Cidr,
        node_netns: Option<&str>,
        local: Option<Ipv4Addr>,
    ) -> Result<UdnNetwork> {
        let cidr = crate::udn_l3::network_cidr(&config.subnets)?;
        if !cidr.contains(host.network()) || host.prefix() < cidr.prefix() {
            return Err(Error::InvalidNetworkConfig(format!(
                "metadata.annotations[{}][{:?}]: host subnet {host} is not in the network's \
                 subnet {cidr}",
                crate::udn_l3::NODE_SUBNETS_ANNOTATION,
                config.name
            )));
        }
        let mut c = config.clone();
        c.subnets = vec![host.to_string()];
        let mut n = Self::build(&c, vni, node_netns, local, true)?;
        n.layer3 = true;
        n.network_cidr = Some(cidr);
        Ok(n)
    }

    /// Decides a Secondary network (a VMI's Multus interface on it) from its NAD. Layer2: the
    /// same namespace, bridge and VXLAN device as a Primary one, never a gateway; without
    /// `subnets` (IPAM disabled) the network has no addresses: `subnet` is then `0.0.0.0/0`,
    /// which nothing reads (no gateway, no lease). Layer3: `host` is this node's host subnet
    /// of the network (required), routed as a Primary Layer3 network's, never an egress.
    /// Other roles and topologies are refused naming the field.
    pub fn from_secondary_nad(
        config: &NadConfig,
        vni: u32,
        host: Option<Ipv4Cidr>,
        node_netns: Option<&str>,
        local: Option<Ipv4Addr>,
    ) -> Result<UdnNetwork> {
        if config.role != "secondary" {
            return Err(Error::InvalidNetworkConfig(format!(
                "spec.config.role {:?}: not a secondary network",
                config.role
            )));
        }
        match (config.topology.as_str(), host) {
            ("layer2", _) => {
                Self::build(config, vni, node_netns, local, !config.subnets.is_empty())
            }
            ("layer3", Some(h)) => Self::layer3(config, vni, h, node_netns, local),
            ("layer3", None) => Err(Error::InvalidNetworkConfig(format!(
                "metadata.annotations[{}]: this node has no host subnet of network {:?}",
                crate::udn_l3::NODE_SUBNETS_ANNOTATION,
                config.name
            ))),
            (other, _) => Err(Error::InvalidNetworkConfig(format!(
                "spec.config.topology {other:?}: not a Secondary Layer2 or Layer3 network"
            ))),
        }
    }

    fn build(
        config: &NadConfig,
        vni: u32,
        node_netns: Option<&str>,
        local: Option<Ipv4Addr>,
        needs_subnet: bool,
    ) -> Result<UdnNetwork> {
        let subnet = match config
            .subnets
            .iter()
            .find_map(|s| s.parse::<Ipv4Cidr>().ok())
        {
            Some(s) => s,
            None if !needs_subnet => Ipv4Cidr::new(Ipv4Addr::UNSPECIFIED, 0)?,
            None => {
                return Err(Error::InvalidNetworkConfig(format!(
                    "spec.config.subnets {:?}: no IPv4 subnet (IPv6-only networks are not carried out)",
                    config.subnets.join(",")
                )));
            }
        };
        if needs_subnet && subnet.prefix() > 30 {
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
            gateway: None,
            layer3: false,
            network_cidr: None,
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
    let before = vec![
        Action::AddNetns(net.netns.clone()),
        // No IPv6 chatter (router solicitations, DAD) from the namespace's own links.
        Action::Sysctl {
            netns: ns.clone(),
            key: "net/ipv6/conf/default/disable_ipv6".into(),
            value: "1".into(),
        },
        ip(&ns, &["link", "set", "lo", "up"]),
        Action::AddLink {
            netns: ns.clone(),
            name: BRIDGE.into(),
            args: strs(&["link", "add", BRIDGE, "type", "bridge"]),
        },
    ];
    let mut after = Vec::new();
    let vxlan = net.local.map(|local| {
        if !net.layer3 {
            after.push(ip(
                &ns,
                &["link", "set", VXLAN, "master", BRIDGE, "mtu", &mtu, "up"],
            ));
        }
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
    if net.layer3 {
        after.extend(crate::udn_l3::routed_steps(net));
    }
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
/// network's MTU, the gateway as router when the network has one on this node, and no DNS.
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
    plan.lease.router = match net.layer3 {
        true => Some(net.subnet.gateway()),
        false => net.gateway.as_ref().map(|g| g.address),
    };
    plan.lease.dns.clear();
    plan.lease.search.clear();
    plan.udn = Some(net.clone());
    Ok(plan)
}

/// A VMI's Multus interface on a Secondary Layer2 or Layer3 network: the secondary plan's "host" side
/// becomes the network's bridge in the network's namespace (no VLAN, the network's MTU), and
/// the plan names the network so that the node keeps it while the interface exists.
pub fn join_secondary(plan: &mut crate::SecondaryPlan, net: &UdnNetwork) {
    plan.node_netns = Some(net.netns.clone());
    plan.bridge = BRIDGE.into();
    plan.vlan = None;
    plan.mtu = net.mtu;
    plan.udn = Some(net.clone());
}

#[cfg(test)]
#[path = "udn_tests.rs"]
mod tests;
