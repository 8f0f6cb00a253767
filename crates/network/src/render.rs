//! Plans → actions (pure): the ordered, idempotent list of iproute2 / sysctl / nft steps that
//! sets up the node or one VMI's network, the teardown list, and the nft scripts themselves.
//! [`crate::apply`] runs them.

use std::fmt::Write as _;

use crate::plan::{Binding, NodeNetwork, PodPlan, Port, PortProtocol};

/// One step. Every step is safe to repeat: creations are skipped when the object exists,
/// `ip` changes use `replace`/`set`, nft scripts atomically replace this crate's own table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// `ip netns add NAME`, unless it exists.
    AddNetns(String),
    /// `ip [-n NETNS] ARGS…` creating the link `name`, unless that link exists in `netns`.
    AddLink {
        netns: Option<String>,
        name: String,
        args: Vec<String>,
    },
    /// An idempotent `ip [-n NETNS] ARGS…`.
    Ip {
        netns: Option<String>,
        args: Vec<String>,
    },
    /// Writes `/proc/sys/<key>` inside `netns`.
    Sysctl {
        netns: Option<String>,
        key: String,
        value: String,
    },
    /// `nft -f -` inside `netns`.
    Nft {
        netns: Option<String>,
        script: String,
    },
    /// `ip [-n NETNS] link del NAME`, if it exists.
    DelLink { netns: Option<String>, name: String },
    /// `ip netns del NAME`, if it exists.
    DelNetns(String),
    /// `bridge [-n NETNS] ARGS…` (VLANs, FDB entries); a failure is ignored when
    /// `tolerate_failure` (removing what is already gone).
    Bridge {
        netns: Option<String>,
        args: Vec<String>,
        tolerate_failure: bool,
    },
    /// `nft delete table FAMILY NAME` inside `netns`, if it exists.
    DelNftTable {
        netns: Option<String>,
        family: String,
        table: String,
    },
}

impl Action {
    /// The `ip`/`bridge` command line of the action (`ip -n NS link add …`), for logs and
    /// tests; other actions in their Debug form.
    pub fn command_line(&self) -> String {
        let with_ns = |tool: &str, netns: &Option<String>, args: &[String]| {
            let ns = netns
                .as_ref()
                .map(|n| format!("-n {n} "))
                .unwrap_or_default();
            format!("{tool} {ns}{}", args.join(" "))
        };
        match self {
            Action::Ip { netns, args } | Action::AddLink { netns, args, .. } => {
                with_ns("ip", netns, args)
            }
            Action::Bridge { netns, args, .. } => with_ns("bridge", netns, args),
            other => format!("{other:?}"),
        }
    }
}

/// Creates the veth pair `host` (in `node_ns`) ↔ `peer` (moved into namespace `netns`).
pub(crate) fn add_veth_pair(
    node_ns: &Option<String>,
    host: &str,
    peer: &str,
    netns: &str,
    mtu: &str,
) -> Action {
    Action::AddLink {
        netns: node_ns.clone(),
        name: host.into(),
        args: strs(&[
            "link", "add", host, "mtu", mtu, "type", "veth", "peer", "name", peer, "netns", netns,
        ]),
    }
}

/// `ip tuntap add` arguments for a tap with `queues` queue pairs: `multi_queue` when more
/// than one (QEMU then opens one file descriptor per queue pair).
pub(crate) fn tuntap_add_args(tap: &str, queues: u32) -> Vec<String> {
    let mut v = strs(&["tuntap", "add", "dev", tap, "mode", "tap"]);
    if queues > 1 {
        v.push("multi_queue".into());
    }
    v
}

pub(crate) fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

pub(crate) fn ip(netns: &Option<String>, args: &[&str]) -> Action {
    Action::Ip {
        netns: netns.clone(),
        args: strs(args),
    }
}

/// nft's idiom for an atomic replace of one table: create (no-op if present), delete, define.
pub(crate) fn replace_table(family: &str, table: &str, body: &str) -> String {
    format!(
        "table {family} {table}\ndelete table {family} {table}\ntable {family} {table} {{\n{body}}}\n"
    )
}

/// The node's tables: guests never reach the node itself (nothing arriving from the node
/// bridge or the overlay is delivered locally unless it answers a connection the node
/// opened, over IPv4 (`ip`) and IPv6 (`ip6`, link-local addresses included): no service on
/// any node address, such as an agent endpoint or etcd listening on 0.0.0.0 or `::`, is
/// reachable from a VMI); nothing from them is routed to a link-local destination
/// (169.254.0.0/16: a cloud metadata service beyond the uplink, RFC 3927 forbids forwarding
/// those anyway); other forwarded traffic between VMIs and out of the uplink is not affected.
/// And the NAT: traffic from the cluster CIDR to anywhere else leaves masqueraded through the
/// uplink (no rule without an uplink).
pub fn node_nft_script(node: &NodeNetwork) -> String {
    let guests = format!(
        "{{ \"{br}\", \"{vx}\" }}",
        br = node.bridge,
        vx = crate::overlay::OVERLAY_DEVICE,
    );
    let input = input_chain(&guests, false);
    let mut body = input.clone();
    let _ = write!(
        body,
        "  chain forward {{\n    type filter hook forward priority 0; policy accept;\n    \
         iifname {guests} ip daddr {LINK_LOCAL} counter drop\n  }}\n",
    );
    body.push_str(
        "  chain postrouting {\n    type nat hook postrouting priority 100; policy accept;\n",
    );
    if let Some(up) = &node.uplink {
        let c = node.ipam.cluster;
        let _ = writeln!(
            body,
            "    ip saddr {c} ip daddr != {c} oifname \"{up}\" masquerade"
        );
    }
    body.push_str("  }\n");
    let mut script = replace_table("ip", &node.nft_table, &body);
    script.push_str(&replace_table("ip6", &node.nft_table, &input));
    script
}

/// IPv4 link-local addresses, never forwarded for a guest.
pub const LINK_LOCAL: &str = "169.254.0.0/16";

/// An input chain dropping (and counting) what arrives on `ifaces` (an nft interface name or
/// set) unless it answers a connection opened from this side; DHCP to the local server first
/// when `dhcp`.
fn input_chain(ifaces: &str, dhcp: bool) -> String {
    let dhcp = if dhcp {
        format!("    iifname {ifaces} udp dport 67 accept\n")
    } else {
        String::new()
    };
    format!(
        "  chain input {{\n    type filter hook input priority 0; policy accept;\n{dhcp}    \
         iifname {ifaces} ct state established,related accept\n    \
         iifname {ifaces} counter drop\n  }}\n"
    )
}

fn port_rules(ports: &[Port], prefix: &str, target: &str) -> String {
    let mut out = String::new();
    if ports.is_empty() {
        let _ = writeln!(out, "    {prefix} dnat to {target}");
        return out;
    }
    for proto in [PortProtocol::Tcp, PortProtocol::Udp] {
        let mut list: Vec<u16> = ports
            .iter()
            .filter(|p| p.protocol == proto)
            .map(|p| p.port)
            .collect();
        list.sort_unstable();
        list.dedup();
        if list.is_empty() {
            continue;
        }
        let set = list
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(
            out,
            "    {prefix} {} dport {{ {set} }} dnat to {target}",
            proto.nft()
        );
    }
    out
}

/// The masquerade binding's NAT inside the VMI namespace: the guest's traffic leaves as the
/// VMI address; the listed ports (all traffic when none are listed) of the VMI address, from
/// outside or from the namespace itself, go to the guest.
pub fn masquerade_nft_script(plan: &PodPlan, ports: &[Port]) -> String {
    let vmi = plan.address;
    let guest = plan.lease.address;
    let veth = &plan.pod_veth;
    let mut body = String::new();
    body.push_str(
        "  chain prerouting {\n    type nat hook prerouting priority -100; policy accept;\n",
    );
    body.push_str(&port_rules(
        ports,
        &format!("iifname \"{veth}\" ip daddr {vmi}"),
        &guest.to_string(),
    ));
    body.push_str("  }\n");
    body.push_str("  chain output {\n    type nat hook output priority -100; policy accept;\n");
    body.push_str(&port_rules(
        ports,
        &format!("ip daddr {vmi}"),
        &guest.to_string(),
    ));
    body.push_str("  }\n");
    body.push_str(
        "  chain postrouting {\n    type nat hook postrouting priority 100; policy accept;\n",
    );
    let _ = writeln!(
        body,
        "    ip saddr {guest} oifname \"{veth}\" snat to {vmi}"
    );
    body.push_str("  }\n");
    body.push_str(&guest_input_chain(plan));
    let mut s = replace_table("ip", &plan.node.nft_table, &body);
    s.push_str(&guest_input6_table(plan));
    s
}

/// Inside the VMI namespace: what the guest sends to the namespace itself is dropped, except
/// DHCP to its server and answers to connections the namespace opened (port-forward).
fn guest_input_chain(plan: &PodPlan) -> String {
    input_chain(&format!("\"{}\"", plan.pod_bridge), true)
}

/// The same over IPv6 (the bridge's link-local address): a table `ip6 <nft_table>` with only
/// the input filter (no DHCP exception: the DHCP server is IPv4).
fn guest_input6_table(plan: &PodPlan) -> String {
    replace_table(
        "ip6",
        &plan.node.nft_table,
        &input_chain(&format!("\"{}\"", plan.pod_bridge), false),
    )
}

/// The bridge binding's `ip` and `ip6` tables in the VMI namespace: only the guest input
/// filters.
pub fn bridge_guest_input_script(plan: &PodPlan) -> String {
    let mut s = replace_table("ip", &plan.node.nft_table, &guest_input_chain(plan));
    s.push_str(&guest_input6_table(plan));
    s
}

/// The bridge binding's filter inside the VMI namespace: DHCP stays between the guest and its
/// own server (the guest's requests never reach the node's segment, foreign offers never
/// reach the guest).
pub fn bridge_nft_script(plan: &PodPlan) -> String {
    let tap = &plan.tap;
    let veth = &plan.pod_veth;
    let body = format!(
        "  chain forward {{\n    type filter hook forward priority 0; policy accept;\n    \
         iifname \"{tap}\" oifname \"{veth}\" udp dport 67 drop\n    \
         iifname \"{veth}\" oifname \"{tap}\" udp sport 67 drop\n  }}\n"
    );
    replace_table("bridge", &plan.node.nft_table, &body)
}

/// Steps that set up the node: its bridge with the gateway, forwarding, NAT.
pub fn node_actions(node: &NodeNetwork) -> Vec<Action> {
    let ns = &node.netns;
    let br = node.bridge.as_str();
    let gw = format!("{}/{}", node.gateway(), node.node_subnet.prefix());
    let mtu = node.mtu.to_string();
    vec![
        Action::AddLink {
            netns: ns.clone(),
            name: br.into(),
            args: strs(&["link", "add", br, "type", "bridge"]),
        },
        ip(ns, &["addr", "replace", &gw, "dev", br]),
        ip(ns, &["link", "set", br, "mtu", &mtu, "up"]),
        Action::Sysctl {
            netns: ns.clone(),
            key: "net/ipv4/ip_forward".into(),
            value: "1".into(),
        },
        Action::Nft {
            netns: ns.clone(),
            script: node_nft_script(node),
        },
    ]
}

/// Steps that remove what [`node_actions`] created.
pub fn node_teardown_actions(node: &NodeNetwork) -> Vec<Action> {
    vec![
        Action::DelNftTable {
            netns: node.netns.clone(),
            family: "ip".into(),
            table: node.nft_table.clone(),
        },
        Action::DelNftTable {
            netns: node.netns.clone(),
            family: "ip6".into(),
            table: node.nft_table.clone(),
        },
        Action::DelLink {
            netns: node.netns.clone(),
            name: node.bridge.clone(),
        },
    ]
}

/// The steps of [`pod_actions`] in the phases [`crate::setup_links`] runs: the namespace;
/// then, concurrently, its forwarding sysctl and whole nft ruleset (one `nft -f -`: the rules
/// name interfaces, so they can exist before the links, and nothing in the namespace is up
/// before its filters are) and the node side of the veth (one `ip` batch); then everything
/// inside the namespace (one `ip -n NS` batch), the bridge brought up last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodPhases {
    pub netns: Vec<Action>,
    pub filters: Vec<Action>,
    pub node_side: Vec<Action>,
    pub inside: Vec<Action>,
}

/// Steps that set up one VMI's namespace, veth, bridge, tap, addresses and NAT: the phases of
/// [`pod_phases`] in order (a valid sequential order too).
pub fn pod_actions(plan: &PodPlan) -> Vec<Action> {
    let p = pod_phases(plan);
    [p.netns, p.filters, p.node_side, p.inside].concat()
}

/// [`pod_actions`] by phase.
pub fn pod_phases(plan: &PodPlan) -> PodPhases {
    let node_ns = &plan.node.netns;
    let pod = Some(plan.netns.clone());
    let mtu = plan.node.mtu.to_string();
    let (veth, hveth, br, tap) = (
        plan.pod_veth.as_str(),
        plan.host_veth.as_str(),
        plan.pod_bridge.as_str(),
        plan.tap.as_str(),
    );
    let br_addr = format!("{}/{}", plan.pod_bridge_addr.0, plan.pod_bridge_addr.1);
    let netns = vec![Action::AddNetns(plan.netns.clone())];
    let mut filters = Vec::new();
    match &plan.binding {
        Binding::Masquerade { ports } => filters.extend([
            Action::Sysctl {
                netns: pod.clone(),
                key: "net/ipv4/ip_forward".into(),
                value: "1".into(),
            },
            Action::Nft {
                netns: pod.clone(),
                script: masquerade_nft_script(plan, ports),
            },
        ]),
        Binding::Bridge => {
            let mut script = bridge_nft_script(plan);
            script.push_str(&bridge_guest_input_script(plan));
            filters.push(Action::Nft {
                netns: pod.clone(),
                script,
            });
        }
    }
    let node_side = vec![
        add_veth_pair(node_ns, hveth, veth, &plan.netns, &mtu),
        ip(
            node_ns,
            &[
                "link",
                "set",
                hveth,
                "master",
                &plan.node.bridge,
                "mtu",
                &mtu,
                "up",
            ],
        ),
    ];
    let mut a = vec![
        ip(&pod, &["link", "set", "lo", "up"]),
        // The bridge's MAC is the guest's gateway MAC (masquerade: 10.0.2.1): derived from the
        // uid, so a guest live-migrated to another node finds its cached gateway there too.
        Action::AddLink {
            netns: pod.clone(),
            name: br.into(),
            args: strs(&[
                "link",
                "add",
                br,
                "address",
                &pod_bridge_mac(plan).to_string(),
                "type",
                "bridge",
            ]),
        },
        Action::AddLink {
            netns: pod.clone(),
            name: tap.into(),
            args: tuntap_add_args(tap, plan.queues),
        },
        ip(&pod, &["link", "set", tap, "master", br, "mtu", &mtu, "up"]),
        ip(&pod, &["addr", "replace", &br_addr, "dev", br]),
    ];
    match &plan.binding {
        Binding::Masquerade { .. } => {
            // An address from another node's subnet (a migrated VMI) is a /32 here and
            // its gateway, this node's, is on-link.
            let prefix = if plan.away {
                32
            } else {
                plan.node.node_subnet.prefix()
            };
            let vmi = format!("{}/{prefix}", plan.address);
            let gw = plan.node.gateway().to_string();
            let mut route = vec!["route", "replace", "default", "via", &gw, "dev", veth];
            if plan.away {
                route.push("onlink");
            }
            a.extend([
                ip(&pod, &["link", "set", veth, "mtu", &mtu, "up"]),
                ip(&pod, &["addr", "replace", &vmi, "dev", veth]),
                ip(&pod, &route),
            ]);
        }
        Binding::Bridge => {
            a.push(ip(
                &pod,
                &["link", "set", veth, "master", br, "mtu", &mtu, "up"],
            ));
        }
    }
    a.push(ip(&pod, &["link", "set", br, "mtu", &mtu, "up"]));
    PodPhases {
        netns,
        filters,
        node_side,
        inside: a,
    }
}

/// The MAC of the bridge in the VMI namespace: the same on every node for one VMI.
pub fn pod_bridge_mac(plan: &PodPlan) -> crate::ipam::MacAddr {
    crate::ipam::MacAddr::stable(&["ferrovirt-k6t", &plan.uid])
}

/// Steps that remove one VMI's network: the node-side veth (its peer goes with it) and the
/// namespace (with the bridge, tap and nft table in it).
pub fn pod_teardown_actions(plan: &PodPlan) -> Vec<Action> {
    vec![
        Action::DelLink {
            netns: plan.node.netns.clone(),
            name: plan.host_veth.clone(),
        },
        Action::DelNetns(plan.netns.clone()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipam::Ipam;
    use crate::plan::{PodRequest, PortProtocol};

    fn node() -> NodeNetwork {
        let ipam = Ipam::default();
        let mut n = NodeNetwork::new(ipam, ipam.node_subnet(1).unwrap());
        n.uplink = Some("uplink0".into());
        n.nft_table = "ferrovirt-t1".into();
        n
    }

    fn plan(binding: Binding) -> PodPlan {
        let mut req = PodRequest::new("uid-1", "default", "vm1", binding);
        req.address = Some("10.244.1.20".parse().unwrap());
        PodPlan::build(&node(), &req).unwrap()
    }

    #[test]
    fn multi_queue_pod_tap() {
        let mut req = PodRequest::new("uid-1", "default", "vm1", Binding::Bridge);
        req.address = Some("10.244.1.20".parse().unwrap());
        req.queues = 2;
        let p = PodPlan::build(&node(), &req).unwrap();
        let a: Vec<String> = pod_actions(&p).iter().map(Action::command_line).collect();
        assert!(
            a.contains(&"ip -n fv-uid-1 tuntap add dev tap0 mode tap multi_queue".to_string()),
            "{a:?}"
        );
        // One queue: a plain tap, and the plan's JSON has no queues field (old plans read back).
        let one = plan(Binding::Bridge);
        assert_eq!(one.queues, 1);
        assert!(serde_json::to_value(&one).unwrap().get("queues").is_none());
        assert_eq!(tuntap_add_args("t", 1).len(), 6);
    }

    #[test]
    fn node_nat_masquerades_the_cluster_cidr_out_of_the_uplink() {
        let s = node_nft_script(&node());
        assert!(s.starts_with("table ip ferrovirt-t1\ndelete table ip ferrovirt-t1\n"));
        assert!(s.contains(
            "ip saddr 10.244.0.0/16 ip daddr != 10.244.0.0/16 oifname \"uplink0\" masquerade"
        ));
        let mut n = node();
        n.uplink = None;
        assert!(!node_nft_script(&n).contains("masquerade"));
    }

    #[test]
    fn guests_never_reach_the_node_itself() {
        let s = node_nft_script(&node());
        assert!(s.contains("type filter hook input priority 0"), "{s}");
        assert!(
            s.contains("iifname { \"fv-br0\", \"fv-vx0\" } ct state established,related accept"),
            "{s}"
        );
        assert!(
            s.contains("iifname { \"fv-br0\", \"fv-vx0\" } counter drop"),
            "{s}"
        );
        // Over IPv6 too (link-local addresses of fv-br0), and no forwarding to link-local
        // destinations (a metadata service beyond the uplink).
        let v6 = &s[s.find("table ip6 ferrovirt-t1 {").expect("an ip6 table")..];
        assert!(
            v6.contains("iifname { \"fv-br0\", \"fv-vx0\" } counter drop"),
            "{v6}"
        );
        assert!(!v6.contains("masquerade"), "{v6}");
        assert!(
            s.contains("type filter hook forward priority 0")
                && s.contains(
                    "iifname { \"fv-br0\", \"fv-vx0\" } ip daddr 169.254.0.0/16 counter drop"
                ),
            "{s}"
        );
        // Inside the VMI namespace: DHCP only, nothing over IPv6.
        let p = plan(Binding::Masquerade { ports: vec![] });
        let s = masquerade_nft_script(&p, &[]);
        let v6 = &s[s.find("table ip6 ferrovirt-t1 {").expect("an ip6 table")..];
        assert!(v6.contains("iifname \"k6t-eth0\" counter drop"), "{v6}");
        assert!(!v6.contains("dport 67") && !v6.contains("dnat"), "{v6}");
        assert!(
            s.contains("iifname \"k6t-eth0\" udp dport 67 accept"),
            "{s}"
        );
        assert!(s.contains("iifname \"k6t-eth0\" counter drop"), "{s}");
        let b = plan(Binding::Bridge);
        let s = bridge_guest_input_script(&b);
        assert!(s.starts_with("table ip ferrovirt-t1\n"), "{s}");
        assert!(s.contains("iifname \"k6t-eth0\" counter drop"), "{s}");
        assert!(s.contains("table ip6 ferrovirt-t1 {"), "{s}");
    }

    #[test]
    fn node_actions_create_the_bridge_with_the_gateway() {
        let a: Vec<String> = node_actions(&node())
            .iter()
            .map(Action::command_line)
            .collect();
        assert_eq!(a[0], "ip link add fv-br0 type bridge");
        assert_eq!(a[1], "ip addr replace 10.244.1.1/24 dev fv-br0");
        assert_eq!(a[2], "ip link set fv-br0 mtu 1500 up");
        assert!(a[3].contains("ip_forward"));
        let t = node_teardown_actions(&node());
        assert!(matches!(&t[1], Action::DelNftTable { family, .. } if family == "ip6"));
        assert!(matches!(&t[2], Action::DelLink { name, .. } if name == "fv-br0"));
    }

    #[test]
    fn masquerade_forwards_listed_ports_and_snats_the_guest() {
        let ports = [
            Port {
                protocol: PortProtocol::Tcp,
                port: 80,
            },
            Port {
                protocol: PortProtocol::Tcp,
                port: 22,
            },
            Port {
                protocol: PortProtocol::Udp,
                port: 53,
            },
            Port {
                protocol: PortProtocol::Tcp,
                port: 80,
            },
        ];
        let p = plan(Binding::Masquerade {
            ports: ports.to_vec(),
        });
        let s = masquerade_nft_script(&p, &ports);
        assert!(
            s.contains(
                "iifname \"eth0\" ip daddr 10.244.1.20 tcp dport { 22, 80 } dnat to 10.0.2.2"
            ),
            "{s}"
        );
        assert!(
            s.contains("iifname \"eth0\" ip daddr 10.244.1.20 udp dport { 53 } dnat to 10.0.2.2")
        );
        assert!(s.contains("    ip daddr 10.244.1.20 tcp dport { 22, 80 } dnat to 10.0.2.2"));
        assert!(s.contains("ip saddr 10.0.2.2 oifname \"eth0\" snat to 10.244.1.20"));
        let all = masquerade_nft_script(&p, &[]);
        assert!(all.contains("iifname \"eth0\" ip daddr 10.244.1.20 dnat to 10.0.2.2"));
    }

    #[test]
    fn a_migrated_vmi_holds_its_foreign_address_as_a_host_route() {
        let mut req = PodRequest::new(
            "uid-1",
            "default",
            "vm1",
            Binding::Masquerade { ports: vec![] },
        );
        req.address = Some("10.244.7.20".parse().unwrap());
        req.migrated = true;
        let p = PodPlan::build(&node(), &req).unwrap();
        let a: Vec<String> = pod_actions(&p).iter().map(Action::command_line).collect();
        assert!(
            a.contains(&"ip -n fv-uid-1 addr replace 10.244.7.20/32 dev eth0".to_string()),
            "{a:?}"
        );
        assert!(
            a.contains(
                &"ip -n fv-uid-1 route replace default via 10.244.1.1 dev eth0 onlink".to_string()
            ),
            "{a:?}"
        );
        // The same NAT as at a start, for the kept address.
        let s = masquerade_nft_script(&p, &[]);
        assert!(s.contains("iifname \"eth0\" ip daddr 10.244.7.20 dnat to 10.0.2.2"));
        assert!(s.contains("ip saddr 10.0.2.2 oifname \"eth0\" snat to 10.244.7.20"));
        // The gateway MAC the guest cached on its first node is this bridge's too.
        let home = plan(Binding::Masquerade { ports: vec![] });
        assert_eq!(pod_bridge_mac(&p), pod_bridge_mac(&home));
        assert!(a.iter().any(|l| l.contains(&format!(
            "link add k6t-eth0 address {} type bridge",
            pod_bridge_mac(&p)
        ))));
    }

    #[test]
    fn masquerade_pod_actions_in_order() {
        let p = plan(Binding::Masquerade { ports: vec![] });
        let a: Vec<String> = pod_actions(&p).iter().map(Action::command_line).collect();
        let hv = &p.host_veth;
        assert_eq!(a[0], "AddNetns(\"fv-uid-1\")");
        assert!(a[1].starts_with("Sysctl"), "{}", a[1]);
        // The NAT and filters exist before any link does.
        assert!(a[2].starts_with("Nft"), "{}", a[2]);
        let expect = [
            format!("ip link add {hv} mtu 1500 type veth peer name eth0 netns fv-uid-1"),
            format!("ip link set {hv} master fv-br0 mtu 1500 up"),
            "ip -n fv-uid-1 link set lo up".into(),
            format!(
                "ip -n fv-uid-1 link add k6t-eth0 address {} type bridge",
                pod_bridge_mac(&p)
            ),
            "ip -n fv-uid-1 tuntap add dev tap0 mode tap".into(),
            "ip -n fv-uid-1 link set tap0 master k6t-eth0 mtu 1500 up".into(),
            "ip -n fv-uid-1 addr replace 10.0.2.1/24 dev k6t-eth0".into(),
            "ip -n fv-uid-1 link set eth0 mtu 1500 up".into(),
            "ip -n fv-uid-1 addr replace 10.244.1.20/24 dev eth0".into(),
            "ip -n fv-uid-1 route replace default via 10.244.1.1 dev eth0".into(),
        ];
        assert_eq!(&a[3..3 + expect.len()], &expect);
        assert!(a.last().unwrap().ends_with("link set k6t-eth0 mtu 1500 up"));
        assert_eq!(a.len(), 3 + expect.len() + 1);
        // The phases run concurrently only where independent: the filters touch only the
        // namespace's nft tables, the node side only links in the node's namespace.
        let ph = pod_phases(&p);
        assert!(ph.filters.iter().all(|x| matches!(
            x,
            Action::Nft { netns, .. } | Action::Sysctl { netns, .. } if netns.as_deref() == Some("fv-uid-1")
        )));
        assert!(ph.node_side.iter().all(|x| matches!(
            x,
            Action::Ip { netns: None, .. } | Action::AddLink { netns: None, .. }
        )));
    }

    #[test]
    fn bridge_pod_actions_enslave_the_veth_and_keep_dhcp_local() {
        let p = plan(Binding::Bridge);
        let a: Vec<String> = pod_actions(&p).iter().map(Action::command_line).collect();
        assert!(
            a.contains(&"ip -n fv-uid-1 link set eth0 master k6t-eth0 mtu 1500 up".to_string())
        );
        assert!(
            a.contains(&"ip -n fv-uid-1 addr replace 169.254.75.10/32 dev k6t-eth0".to_string())
        );
        assert!(
            !a.iter().any(|c| c.contains("10.244.1.20")),
            "no VMI address in the netns"
        );
        // One nft transaction with the DHCP filter and the guest input filters, first.
        let scripts: Vec<String> = pod_actions(&p)
            .into_iter()
            .filter_map(|x| match x {
                Action::Nft { script, .. } => Some(script),
                _ => None,
            })
            .collect();
        assert_eq!(scripts.len(), 1);
        let script = &scripts[0];
        assert!(script.starts_with(&bridge_nft_script(&p)));
        assert!(script.ends_with(&bridge_guest_input_script(&p)));
        assert!(a[1].starts_with("Nft"), "{}", a[1]);
        let s = bridge_nft_script(&p);
        assert!(s.starts_with("table bridge ferrovirt-t1\n"));
        assert!(s.contains("iifname \"tap0\" oifname \"eth0\" udp dport 67 drop"));
    }

    #[test]
    fn teardown_removes_the_veth_and_the_namespace() {
        let p = plan(Binding::Bridge);
        let t = pod_teardown_actions(&p);
        assert_eq!(
            t,
            vec![
                Action::DelLink {
                    netns: None,
                    name: p.host_veth.clone()
                },
                Action::DelNetns("fv-uid-1".into()),
            ]
        );
    }
}
