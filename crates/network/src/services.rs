//! The Service data plane of a node (pure): Service ports with their ready endpoints →
//! one nft table (`ip <name>`, replaced atomically) that DNATs `ClusterIP:port` and, for
//! NodePort Services, `<any local address>:nodePort` to an endpoint picked by `numgen random
//! mod N`, marks those connections and masquerades them on the way out, so replies come back
//! through this node (hairpin on the node bridge, or another node's VMI over the overlay).
//! Only endpoints inside the cluster (pod) CIDR are used: a Service never turns the node into
//! a relay to host or outside addresses.

use std::fmt::Write as _;
use std::net::Ipv4Addr;

use crate::ipam::Ipv4Cidr;
use crate::render::replace_table;

/// The conntrack mark bit of Service connections (masqueraded in postrouting).
pub const SERVICE_MARK: u32 = 0x4000;

/// A transport protocol of a Service port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    pub(crate) fn nft(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
    /// `TCP`/`UDP` as Kubernetes spells them; None for anything else.
    pub fn parse(s: &str) -> Option<Proto> {
        match s {
            "TCP" => Some(Proto::Tcp),
            "UDP" => Some(Proto::Udp),
            _ => None,
        }
    }
}

/// One Service port as the node carries it out.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServicePort {
    /// `namespace/name:port` (rule comments).
    pub id: String,
    pub cluster_ip: Option<Ipv4Addr>,
    pub port: u16,
    pub node_port: Option<u16>,
    pub proto: Proto,
    /// Ready endpoint addresses with the target port.
    pub endpoints: Vec<(Ipv4Addr, u16)>,
}

/// The nft script for table `table` carrying `ports`; endpoints outside `cluster` are
/// dropped from the rules.
pub fn services_nft_script(table: &str, cluster: Ipv4Cidr, ports: &[ServicePort]) -> String {
    let mut dispatch = String::new();
    let mut chains = String::new();
    for (i, p) in ports.iter().enumerate() {
        let mut eps: Vec<(Ipv4Addr, u16)> = p
            .endpoints
            .iter()
            .copied()
            .filter(|(ip, _)| cluster.contains(*ip))
            .collect();
        eps.sort_unstable();
        eps.dedup();
        if eps.is_empty() {
            continue;
        }
        let chain = format!("svc-{i}");
        let proto = p.proto.nft();
        let comment = p.id.replace('"', "");
        if let Some(ip) = p.cluster_ip {
            let _ = writeln!(
                dispatch,
                "    ip daddr {ip} {proto} dport {} jump {chain} comment \"{comment}\"",
                p.port
            );
        }
        if let Some(np) = p.node_port {
            let _ = writeln!(
                dispatch,
                "    fib daddr type local {proto} dport {np} jump {chain} comment \"{comment} nodePort\""
            );
        }
        let _ = writeln!(
            chains,
            "  chain {chain} {{\n    ct mark set ct mark | {SERVICE_MARK:#x}"
        );
        let _ = writeln!(chains, "    {}\n  }}", dnat_rule(proto, &eps));
    }
    let mut body = String::new();
    body.push_str(
        "  chain prerouting {\n    type nat hook prerouting priority -110; policy accept;\n    jump services\n  }\n",
    );
    body.push_str(
        "  chain output {\n    type nat hook output priority -110; policy accept;\n    jump services\n  }\n",
    );
    let _ = write!(body, "  chain services {{\n{dispatch}  }}\n");
    body.push_str(&chains);
    let _ = write!(
        body,
        "  chain postrouting {{\n    type nat hook postrouting priority 110; policy accept;\n    ct mark & {SERVICE_MARK:#x} == {SERVICE_MARK:#x} masquerade\n  }}\n"
    );
    replace_table("ip", table, &body)
}

/// The DNAT statement spreading a connection over `eps` (sorted, deduplicated, not empty) by
/// `numgen random mod N`: one target port for all (the endpoints controller keeps one port
/// set per slice), else address-and-port arms.
pub(crate) fn dnat_rule(proto: &str, eps: &[(Ipv4Addr, u16)]) -> String {
    let same_port = eps.iter().all(|(_, tp)| *tp == eps[0].1);
    let n = eps.len();
    if same_port {
        let arms: Vec<String> = eps
            .iter()
            .enumerate()
            .map(|(k, (ip, _))| format!("{k} : {ip}"))
            .collect();
        format!(
            "meta l4proto {proto} dnat to numgen random mod {n} map {{ {} }} : {}",
            arms.join(", "),
            eps[0].1
        )
    } else {
        let arms: Vec<String> = eps
            .iter()
            .enumerate()
            .map(|(k, (ip, tp))| format!("{k} : {ip} . {tp}"))
            .collect();
        format!(
            "meta l4proto {proto} dnat ip addr . port to numgen random mod {n} map {{ {} }}",
            arms.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(ip: Option<[u8; 4]>, np: Option<u16>, eps: &[([u8; 4], u16)]) -> ServicePort {
        ServicePort {
            id: "ns/web:80".into(),
            cluster_ip: ip.map(Ipv4Addr::from),
            port: 80,
            node_port: np,
            proto: Proto::Tcp,
            endpoints: eps.iter().map(|(a, p)| (Ipv4Addr::from(*a), *p)).collect(),
        }
    }

    fn cluster() -> Ipv4Cidr {
        "10.244.0.0/16".parse().unwrap()
    }

    #[test]
    fn cluster_ip_and_node_port_spread_over_the_endpoints() {
        let s = services_nft_script(
            "fv-svc",
            cluster(),
            &[port(
                Some([10, 96, 0, 10]),
                Some(30080),
                &[([10, 244, 1, 2], 8080), ([10, 244, 0, 2], 8080)],
            )],
        );
        assert!(
            s.starts_with("table ip fv-svc\ndelete table ip fv-svc\n"),
            "{s}"
        );
        assert!(
            s.contains("ip daddr 10.96.0.10 tcp dport 80 jump svc-0"),
            "{s}"
        );
        assert!(
            s.contains("fib daddr type local tcp dport 30080 jump svc-0"),
            "{s}"
        );
        assert!(
            s.contains("meta l4proto tcp dnat to numgen random mod 2 map { 0 : 10.244.0.2, 1 : 10.244.1.2 } : 8080"),
            "{s}"
        );
        assert!(s.contains("ct mark & 0x4000 == 0x4000 masquerade"), "{s}");
    }

    #[test]
    fn endpoints_outside_the_pod_network_are_never_targets() {
        let s = services_nft_script(
            "fv-svc",
            cluster(),
            &[port(
                Some([10, 96, 0, 10]),
                Some(30080),
                &[
                    ([127, 0, 0, 1], 22),
                    ([192, 168, 1, 1], 22),
                    ([10, 244, 0, 2], 22),
                ],
            )],
        );
        assert!(
            !s.contains("127.0.0.1") && !s.contains("192.168.1.1"),
            "{s}"
        );
        assert!(s.contains("mod 1 map { 0 : 10.244.0.2 } : 22"), "{s}");
        // Only outside addresses: no rule at all.
        let s = services_nft_script(
            "fv-svc",
            cluster(),
            &[port(
                Some([10, 96, 0, 10]),
                Some(30080),
                &[([169, 254, 169, 254], 80)],
            )],
        );
        assert!(!s.contains("jump svc-0") && !s.contains("169.254"), "{s}");
    }

    #[test]
    fn mixed_target_ports_use_address_and_port_arms() {
        let s = services_nft_script(
            "fv-svc",
            cluster(),
            &[port(
                None,
                Some(30001),
                &[([10, 244, 0, 2], 80), ([10, 244, 0, 3], 81)],
            )],
        );
        assert!(
            s.contains("dnat ip addr . port to numgen random mod 2 map { 0 : 10.244.0.2 . 80, 1 : 10.244.0.3 . 81 }"),
            "{s}"
        );
        assert!(!s.contains("ip daddr"), "{s}");
    }
}
