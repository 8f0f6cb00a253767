//! Services on Primary user-defined networks (pure; docs/networking.md "Services on Primary
//! user-defined networks"). A Service in a namespace whose primary network is a UDN
//! ([`primary_networks`]: the namespace's NetworkAttachmentDefinition with role primary)
//! selects VMIs on that network; the endpoints controller marks its EndpointSlice with
//! [`ENDPOINTSLICE_NETWORK_ANNOTATION`] (OVN-Kubernetes' convention) so that the pod
//! network's table skips it, and each node carries it out in the network's own namespace
//! (`fvn-…`) with the table [`nft_script`] writes: `ClusterIP:port` from the network's bridge
//! is DNATed to a ready endpoint (`numgen random mod N`), nothing else. The client's address
//! is kept; the endpoint answers it directly on the network, and the reply passes the client
//! node's namespace (bridged: br_netfilter; Layer3: routed), where conntrack reverses the DNAT.
//!
//! Layer2 networks have the same gateway address and MAC on every node, so the namespace
//! cannot talk to another node's guest from it (its ARP and frames from the gateway MAC are
//! kept on the node). DNATed connections are therefore routed (fwmark [`SERVICE_MARK`], table
//! [`ROUTE_TABLE`]) out of a veth [`SVC_VETH`] whose peer [`SVC_PORT`] is a port of the
//! bridge: a MAC of its own and a link-local address [`SVC_ADDR`] for its ARP requests (never
//! the gateway's), `arp_ignore` so that it never answers for the gateway. Frames coming back
//! into the bridge from that port are not tracked again (a bridge-family `notrack`): the
//! connection is the DNATed one, tracked once. Layer3 networks route as they are (each node's
//! gateway is its own).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::Ipv4Addr;

use crate::ipam::Ipv4Cidr;
use crate::render::{Action, add_veth_pair, ip, replace_table};
use crate::services::{SERVICE_MARK, ServicePort, dnat_rule};
use crate::udn::{BRIDGE, UdnNetwork, parse_nad_config};

/// The annotation on an EndpointSlice naming the user-defined network its addresses are on.
pub const ENDPOINTSLICE_NETWORK_ANNOTATION: &str = "k8s.ovn.org/endpointslice-network";
/// The Service table in each network's namespace (`ip` family; Layer2 also `bridge`).
pub const TABLE: &str = "ferrovirt-udnsvc";
/// The veth end in the network's namespace that DNATed connections leave through (Layer2).
pub const SVC_VETH: &str = "udn-svc";
/// Its peer, a port of the network's bridge.
pub const SVC_PORT: &str = "udn-svcp";
/// The link-local address of [`SVC_VETH`] (the sender of its ARP requests).
pub const SVC_ADDR: Ipv4Addr = Ipv4Addr::new(169, 254, 127, 254);
/// The routing table (and rule preference) of DNATed connections in a Layer2 namespace.
pub const ROUTE_TABLE: &str = "4245";

/// A namespace's primary user-defined network, from its NAD.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrimaryNet {
    /// The network's name (NAD config `name`): the annotation's value.
    pub name: String,
    pub layer3: bool,
    /// The network's whole IPv4 range (Layer3: all host subnets); endpoints outside it are
    /// never targets.
    pub cidr: Option<Ipv4Cidr>,
}

/// [`primary_networks`] of NAD objects given as (namespace, the object's JSON with
/// `spec.config`), as the agent's and the controller's NAD caches hold them; objects without
/// either are skipped.
pub fn primary_networks_of<'a>(
    nads: impl IntoIterator<Item = (Option<&'a str>, &'a serde_json::Value)>,
) -> BTreeMap<String, PrimaryNet> {
    let list: Vec<(String, String)> = nads
        .into_iter()
        .filter_map(|(ns, data)| {
            Some((
                ns?.to_string(),
                data["spec"]["config"].as_str()?.to_string(),
            ))
        })
        .collect();
    primary_networks(&list)
}

/// The primary network of each namespace, from the user-defined networks' NADs given as
/// `(namespace, spec.config)`: role primary, Layer2 or Layer3. A namespace with two (the
/// agent refuses its VMIs) or a config that cannot be read has none.
pub fn primary_networks(nads: &[(String, String)]) -> BTreeMap<String, PrimaryNet> {
    let mut out: BTreeMap<String, Option<PrimaryNet>> = BTreeMap::new();
    for (ns, config) in nads {
        let Ok(c) = parse_nad_config(config) else {
            continue;
        };
        if c.role != "primary" || !matches!(c.topology.as_str(), "layer2" | "layer3") {
            continue;
        }
        let net = PrimaryNet {
            name: c.name.clone(),
            layer3: c.topology == "layer3",
            cidr: crate::udn_l3::network_cidr(&c.subnets).ok(),
        };
        out.entry(ns.clone())
            .and_modify(|e| *e = None)
            .or_insert(Some(net));
    }
    out.into_iter()
        .filter_map(|(ns, n)| Some((ns, n?)))
        .collect()
}

/// The steps that make a Layer2 network's Service link in its namespace (none for Layer3):
/// bridge netfilter on (br_netfilter; it fails where the kernel lacks it), forwarding, the
/// veth [`SVC_VETH`]/[`SVC_PORT`], its address and route table. The fwmark rule is
/// [`rule_args`] (not idempotent: add it only when `ip rule show pref` lacks it).
pub fn link_steps(net: &UdnNetwork) -> Vec<Action> {
    let ns = Some(net.netns.clone());
    let sysctl = |key: &str| Action::Sysctl {
        netns: ns.clone(),
        key: key.into(),
        value: "1".into(),
    };
    let mut a = vec![
        sysctl("net/bridge/bridge-nf-call-iptables"),
        sysctl("net/ipv4/ip_forward"),
    ];
    if net.layer3 {
        return a;
    }
    let mtu = net.mtu.to_string();
    a.extend([
        add_veth_pair(&ns, SVC_PORT, SVC_VETH, &net.netns, &mtu),
        ip(&ns, &["link", "set", SVC_PORT, "master", BRIDGE, "up"]),
        sysctl(&format!("net/ipv4/conf/{SVC_VETH}/arp_ignore")),
        ip(
            &ns,
            &[
                "addr",
                "replace",
                &format!("{SVC_ADDR}/32"),
                "dev",
                SVC_VETH,
                "scope",
                "link",
            ],
        ),
        ip(&ns, &["link", "set", SVC_VETH, "up"]),
        ip(
            &ns,
            &[
                "route",
                "replace",
                &net.subnet.to_string(),
                "dev",
                SVC_VETH,
                "table",
                ROUTE_TABLE,
            ],
        ),
    ]);
    a
}

/// `ip rule add` arguments of the Layer2 fwmark rule.
pub fn rule_args() -> Vec<String> {
    let mark = format!("{SERVICE_MARK:#x}/{SERVICE_MARK:#x}");
    [
        "rule",
        "add",
        "fwmark",
        &mark,
        "lookup",
        ROUTE_TABLE,
        "pref",
        ROUTE_TABLE,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The Service table of `net`'s namespace carrying `ports` (their ready endpoints on the
/// network, ClusterIPs only: node ports are not carried out on these networks); endpoints
/// outside `cidr` are never targets. Replaced atomically.
pub fn nft_script(net: &UdnNetwork, cidr: Ipv4Cidr, ports: &[ServicePort]) -> String {
    let layer2 = !net.layer3;
    let mut dispatch = String::new();
    let mut chains = String::new();
    for (i, p) in ports.iter().enumerate() {
        let Some(vip) = p.cluster_ip else {
            continue;
        };
        let mut eps: Vec<(Ipv4Addr, u16)> = p
            .endpoints
            .iter()
            .copied()
            .filter(|(a, _)| cidr.contains(*a) && *a != cidr.network() && *a != cidr.broadcast())
            .collect();
        eps.sort_unstable();
        eps.dedup();
        if eps.is_empty() {
            continue;
        }
        let proto = p.proto.nft();
        let comment = p.id.replace('"', "");
        let _ = writeln!(
            dispatch,
            "    ip daddr {vip} {proto} dport {} jump svc-{i} comment \"{comment}\"",
            p.port
        );
        let _ = writeln!(chains, "  chain svc-{i} {{");
        if layer2 {
            let _ = writeln!(chains, "    meta mark set meta mark | {SERVICE_MARK:#x}");
        }
        let _ = writeln!(chains, "    {}\n  }}", dnat_rule(proto, &eps));
    }
    let mut body = String::new();
    if layer2 {
        // Later packets of a DNATed connection take the same route as its first.
        let _ = writeln!(
            body,
            "  chain reroute {{\n    type filter hook prerouting priority -150; policy accept;\n    \
             ct direction original ct status dnat meta mark set meta mark | {SERVICE_MARK:#x}\n  }}"
        );
    }
    let _ = write!(
        body,
        "  chain prerouting {{\n    type nat hook prerouting priority -110; policy accept;\n    \
         iifname \"{BRIDGE}\" jump services\n  }}\n  chain services {{\n{dispatch}  }}\n{chains}"
    );
    let mut s = replace_table("ip", TABLE, &body);
    if layer2 {
        s.push_str(&replace_table(
            "bridge",
            TABLE,
            &format!(
                "  chain prerouting {{\n    type filter hook prerouting priority -300; policy accept;\n    \
                 iifname \"{SVC_PORT}\" notrack\n  }}\n"
            ),
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::services::Proto;

    fn cfg(ns: &str, topo: &str, role: &str, subnets: &str) -> (String, String) {
        (
            ns.into(),
            format!(
                r#"{{"name":"{ns}_net","topology":"{topo}","role":"{role}","subnets":"{subnets}"}}"#
            ),
        )
    }

    fn net(layer3: bool) -> UdnNetwork {
        UdnNetwork {
            name: "ua_net".into(),
            vni: 10001,
            subnet: "10.100.0.0/24".parse().unwrap(),
            mtu: 1400,
            netns: "fvn-12345678-na".into(),
            node_netns: Some("na".into()),
            local: None,
            gateway: None,
            layer3,
            network_cidr: None,
        }
    }

    fn port(vip: Option<[u8; 4]>, eps: &[[u8; 4]]) -> ServicePort {
        ServicePort {
            id: "ua/web:80".into(),
            cluster_ip: vip.map(Ipv4Addr::from),
            port: 80,
            node_port: Some(30080),
            proto: Proto::Tcp,
            endpoints: eps.iter().map(|a| (Ipv4Addr::from(*a), 8080)).collect(),
        }
    }

    #[test]
    fn primary_networks_by_namespace() {
        let got = primary_networks(&[
            cfg("ua", "layer2", "primary", "10.100.0.0/24"),
            cfg("l3", "layer3", "primary", "10.150.0.0/16/24"),
            cfg("sec", "layer2", "secondary", "10.1.0.0/24"),
            cfg("two", "layer2", "primary", "10.2.0.0/24"),
            cfg("two", "layer2", "primary", "10.3.0.0/24"),
            ("bad".into(), "{".into()),
        ]);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got["ua"].name, "ua_net");
        assert!(!got["ua"].layer3);
        assert_eq!(got["ua"].cidr.unwrap().to_string(), "10.100.0.0/24");
        assert!(got["l3"].layer3);
        assert_eq!(got["l3"].cidr.unwrap().to_string(), "10.150.0.0/16");
        // The same from NAD objects as the caches hold them; one without a namespace or a
        // config is skipped.
        let (ns, config) = cfg("ua", "layer2", "primary", "10.100.0.0/24");
        let obj = serde_json::json!({"spec": {"config": config}});
        let empty = serde_json::json!({"spec": {}});
        let got =
            primary_networks_of([(Some(ns.as_str()), &obj), (None, &obj), (Some("x"), &empty)]);
        assert_eq!(got.keys().collect::<Vec<_>>(), ["ua"]);
    }

    #[test]
    fn layer2_table_dnats_cluster_ips_routes_them_by_mark_and_skips_the_second_pass() {
        let cidr = "10.100.0.0/24".parse().unwrap();
        let s = nft_script(
            &net(false),
            cidr,
            &[port(
                Some([10, 96, 0, 10]),
                &[
                    [10, 100, 0, 7],
                    [10, 100, 0, 9],
                    [10, 244, 0, 2],
                    [127, 0, 0, 1],
                ],
            )],
        );
        assert!(
            s.starts_with("table ip ferrovirt-udnsvc\ndelete table ip ferrovirt-udnsvc\n"),
            "{s}"
        );
        assert!(s.contains("iifname \"udn-br0\" jump services"), "{s}");
        assert!(
            s.contains("ip daddr 10.96.0.10 tcp dport 80 jump svc-0"),
            "{s}"
        );
        assert!(s.contains("meta mark set meta mark | 0x4000\n    meta l4proto tcp dnat to numgen random mod 2 map { 0 : 10.100.0.7, 1 : 10.100.0.9 } : 8080"), "{s}");
        // Off-network endpoints (pod network, loopback) are never targets; no node port.
        assert!(!s.contains("10.244.0.2") && !s.contains("127.0.0.1"), "{s}");
        assert!(!s.contains("30080") && !s.contains("masquerade"), "{s}");
        assert!(
            s.contains("ct direction original ct status dnat meta mark set"),
            "{s}"
        );
        assert!(
            s.contains("table bridge ferrovirt-udnsvc {\n  chain prerouting {\n    type filter hook prerouting priority -300; policy accept;\n    iifname \"udn-svcp\" notrack"),
            "{s}"
        );
    }

    #[test]
    fn layer3_routes_without_mark_and_ports_without_endpoints_have_no_rule() {
        let cidr = "10.150.0.0/16".parse().unwrap();
        let s = nft_script(
            &net(true),
            cidr,
            &[
                port(Some([10, 96, 0, 10]), &[[10, 150, 3, 5]]),
                port(Some([10, 96, 0, 11]), &[]),
                port(None, &[[10, 150, 3, 5]]),
            ],
        );
        assert!(s.contains("mod 1 map { 0 : 10.150.3.5 } : 8080"), "{s}");
        assert!(!s.contains("10.96.0.11") && !s.contains("svc-2"), "{s}");
        assert!(!s.contains("mark") && !s.contains("bridge"), "{s}");
    }

    #[test]
    fn layer2_link_steps_and_rule() {
        let cmds: Vec<String> = link_steps(&net(false))
            .iter()
            .map(Action::command_line)
            .collect();
        let all = cmds.join("\n");
        assert!(all.contains("bridge-nf-call-iptables"), "{all}");
        assert!(
            all.contains("ip -n fvn-12345678-na link add udn-svcp mtu 1400 type veth peer name udn-svc netns fvn-12345678-na"),
            "{all}"
        );
        assert!(all.contains("udn-svc/arp_ignore"), "{all}");
        assert!(
            all.contains("addr replace 169.254.127.254/32 dev udn-svc scope link"),
            "{all}"
        );
        assert!(
            all.contains("route replace 10.100.0.0/24 dev udn-svc table 4245"),
            "{all}"
        );
        assert_eq!(
            rule_args().join(" "),
            "rule add fwmark 0x4000/0x4000 lookup 4245 pref 4245"
        );
        assert_eq!(link_steps(&net(true)).len(), 2);
    }

    #[test]
    fn a_gateway_without_uplink_has_its_address_and_no_egress() {
        let mut n = net(false);
        n.gateway = Some(crate::udn::UdnGateway {
            address: "10.100.0.1".parse().unwrap(),
            uplink: None,
        });
        let cluster = "10.244.0.0/16".parse().unwrap();
        let all: Vec<String> = crate::udn::gateway_steps(&n, 0, cluster)
            .iter()
            .map(Action::command_line)
            .collect();
        let all = all.join("\n");
        assert!(
            all.contains("addr replace 10.100.0.1/24 dev udn-br0"),
            "{all}"
        );
        assert!(all.contains("ip_forward"), "{all}");
        assert!(
            !all.contains("link add") && !all.contains("route replace default"),
            "{all}"
        );
        // A plan of an older agent (uplink a string) still reads.
        let g: crate::udn::UdnGateway =
            serde_json::from_str(r#"{"address":"10.100.0.1","uplink":"under0"}"#).unwrap();
        assert_eq!(g.uplink.as_deref(), Some("under0"));
    }
}
