//! Layer3 UserDefinedNetworks across two nodes (issue #22; docs/networking.md "User-defined
//! networks"): node A is the server's embedded agent in network namespace A, node B a
//! `ferrovirt agent` in namespace B, joined by an underlay veth; both agents run with
//! `--uplink` (the underlay). Namespace `l3` is labelled
//! `k8s.ovn.org/primary-user-defined-network` and has a Primary Layer3 UDN `net`
//! (10.150.0.0/16, host subnets /24) and a Secondary Layer3 UDN `sec` (10.210.0.0/16);
//! namespace `l3b` has its own Secondary Layer3 UDN `sec` on the SAME subnet. VMIs g1 (node A)
//! and g2 (node B) in l3: bridge binding on the pod network (the Primary network) plus `sec`
//! as a Multus interface; t1 (node B) in l3b: masquerade pod network plus l3b's `sec`. Each
//! guest leases the address the controller gave it from its node's host subnet: on eth0 with
//! that subnet's gateway as router; on eth1 without a router but with a classless static route
//! (option 121) for 10.210.0.0/16 via its node's gateway (checked in the guest's `ip route`).
//! g1 and g2 ping each other across the nodes on both networks (routed between the host
//! subnets) and reach the other node's underlay address through their own node's uplink
//! (Layer3 egress); t1 reaches its own gateway but neither g1 nor g2 (nor g2 t1); all are
//! LiveMigratable=False naming the Layer3 network; deleting the VMIs removes the networks'
//! namespaces.

mod udnkit;

use std::path::PathBuf;
use std::time::Instant;

use ferrovirt_testkit::Cluster;
use ferrovirt_testkit::netns::{Netns, NodePair};
use serde_json::Value;
use udnkit::{Attach, Machine, Underlay, disk_claim, pings, reach_all, reached, udn_namespaces};

const A_IP: &str = "192.168.247.1";
const B_IP: &str = "192.168.247.2";
const B_CIDR: &str = "10.244.212.0/24";
/// The Secondary Layer3 networks' subnet (both namespaces').
const SEC_CIDR: &str = "10.210.0.0/16";
const UNDERLAY: Underlay = Underlay {
    prefix: "fv3",
    a_ip: A_IP,
    b_ip: B_IP,
    b_cidr: B_CIDR,
    uplink: true,
};

fn udn_yaml() -> String {
    let sec = |ns: &str| {
        format!(
            r#"
---
apiVersion: k8s.ovn.org/v1
kind: UserDefinedNetwork
metadata: {{name: sec, namespace: {ns}}}
spec:
  topology: Layer3
  layer3:
    role: Secondary
    subnets: [{{cidr: {SEC_CIDR}, hostSubnet: 24}}]
"#
        )
    };
    format!(
        r#"
apiVersion: v1
kind: Namespace
metadata:
  name: l3
  labels: {{k8s.ovn.org/primary-user-defined-network: ""}}
---
apiVersion: v1
kind: Namespace
metadata: {{name: l3b}}
---
apiVersion: k8s.ovn.org/v1
kind: UserDefinedNetwork
metadata: {{name: net, namespace: l3}}
spec:
  topology: Layer3
  layer3:
    role: Primary
    subnets: [{{cidr: 10.150.0.0/16, hostSubnet: 24}}]
{}{}"#,
        sec("l3"),
        sec("l3b")
    )
}

/// A guest (its `ip`: the address on the Primary network, l3 only) with its address on `sec`
/// (eth1) and the node's gateway there.
struct L3Guest {
    guest: udnkit::Guest,
    sec_ip: String,
    sec_gw: String,
}

impl std::ops::Deref for L3Guest {
    type Target = udnkit::Guest;
    fn deref(&self) -> &udnkit::Guest {
        &self.guest
    }
}

/// The VMI Running with its addresses; its guest leased them: in l3 on eth0 with its node's
/// gateway as router; on eth1 (asked for here: the guest leases eth0 only) with no router and
/// the route for the whole Secondary network via its node's gateway.
fn guest(c: &Cluster, ns: &str, name: &str, node_dir: PathBuf) -> anyhow::Result<(L3Guest, Value)> {
    let v = udnkit::wait_running(c, ns, name)?;
    let ann = udnkit::pod_networks(&v)?;
    let sec = &ann[format!("{ns}/sec")];
    assert_eq!(sec["role"], "secondary", "{ann}");
    assert!(sec["gateway_ips"].is_null(), "{ann}");
    let sec_cidr = sec["ip_addresses"][0].as_str().unwrap_or_default();
    assert!(
        sec_cidr.starts_with("10.210.") && sec_cidr.ends_with("/24"),
        "{ann}"
    );
    let sec_ip = sec_cidr.trim_end_matches("/24").to_string();
    let sec_gw = format!("{}.1", sec_ip.rsplit_once('.').map(|x| x.0).unwrap_or(""));
    let mut ip = String::new();
    let mut cidr_gw = None;
    if ns == "l3" {
        let entry = &ann["l3/net"];
        let cidr = entry["ip_addresses"][0].as_str().unwrap_or_default();
        let gw = entry["gateway_ips"][0].as_str().unwrap_or_default();
        ip = cidr.split('/').next().unwrap_or_default().to_string();
        assert!(ip.starts_with("10.150.") && !gw.is_empty(), "{ann}");
        assert_eq!(v["status"]["interfaces"][0]["ipAddress"], ip.as_str());
        cidr_gw = Some(format!("ip={cidr} router={gw}"));
    }
    let node_dir = &node_dir;
    let eth0_lease = cidr_gw;
    let guest = udnkit::Guest::attach(
        c,
        &v,
        Attach {
            ip,
            node_dir,
            eth0_lease,
        },
    )?;
    let out = guest.lease_eth1(name, "; ip route")?;
    assert!(out.contains(&format!("inet {sec_cidr}")), "{name}: {out}");
    assert!(
        out.contains(&format!("{SEC_CIDR} via {sec_gw} dev eth1")),
        "{name}: no route for the network via its node's gateway: {out}"
    );
    assert!(
        !out.lines()
            .any(|l| l.starts_with("default") && l.contains("eth1")),
        "{name}: a default route on the Secondary interface: {out}"
    );
    let g = L3Guest {
        guest,
        sec_ip,
        sec_gw,
    };
    Ok((g, v))
}

#[test]
fn layer3_udns_route_between_node_subnets_with_egress() -> anyhow::Result<()> {
    let started = Instant::now();
    let NodePair {
        a: node_a,
        b: node_b,
    } = UNDERLAY.nodes()?;
    // Both nodes with an uplink (the underlay): the Primary network gets its egress.
    let c = UNDERLAY.start(&node_a, &node_b)?;
    c.apply(&udn_yaml())?;
    let vms = [
        ("l3", "g1", "node-a"),
        ("l3", "g2", "node-b"),
        ("l3b", "t1", "node-b"),
    ];
    for (ns, name, node) in vms {
        disk_claim(&c, ns, name, false)?;
        // In l3 the pod network is the Primary network (bridge binding); elsewhere masquerade.
        let pod_binding = if ns == "l3" { "bridge" } else { "masquerade" };
        let selector = format!("kubernetes.io/hostname: {node}");
        let m = Machine {
            ns,
            name,
            selector: &selector,
            pod_binding,
            multus: Some("sec"),
        };
        c.apply(&m.vmi_yaml())?;
    }
    let mut guests = std::collections::BTreeMap::new();
    let mut guards = Vec::new();
    for (ns, name, node) in vms {
        let (g, v) = guest(&c, ns, name, udnkit::node_dir(&c, node))?;
        // A Layer3 address belongs to its node: never live-migratable, saying why (t1: its
        // Secondary interface's network).
        let cond = udnkit::live_migratable(&v);
        assert_eq!(cond["status"], "False", "{name}: {cond}");
        let msg = cond["message"].as_str().unwrap_or_default();
        let net = if ns == "l3" { "l3_net" } else { "l3b_sec" };
        assert!(
            msg.contains("Layer3") && msg.contains(net),
            "{name}: {cond}"
        );
        guards.push(Netns::guard(&format!("fv-{}", g.uid)));
        guests.insert(name, g);
    }
    let booted = started.elapsed();
    let (g1, g2, t1) = (&guests["g1"], &guests["g2"], &guests["t1"]);
    // Different host subnets (one per node), on both networks.
    let net24 = |ip: &str| ip.rsplit_once('.').map(|x| x.0.to_string());
    assert_ne!(net24(&g1.ip), net24(&g2.ip), "{} {}", g1.ip, g2.ip);
    assert_ne!(
        net24(&g1.sec_ip),
        net24(&g2.sec_ip),
        "{} {}",
        g1.sec_ip,
        g2.sec_ip
    );
    let t = Instant::now();
    let (ok, out) = pings(g1, &g2.ip, 10)?;
    assert!(ok, "g1 -> g2: {out}");
    let pinged = t.elapsed();
    // Back across the nodes on the Primary network; egress: each guest reaches the other
    // node's underlay address through its own node's uplink (masqueraded twice); the
    // Secondary Layer3 network across the nodes, through eth1's route.
    let missing = reach_all(g2, &[&g1.ip, A_IP, &g1.sec_ip], 10)?;
    assert!(missing.is_empty(), "g2 did not reach {missing:?}");
    let missing = reach_all(g1, &[B_IP, &g2.sec_ip], 10)?;
    assert!(missing.is_empty(), "g1 did not reach {missing:?}");
    // port-forward through the API: from the Primary network's namespace on each guest's
    // node (its gateway there is the source).
    for name in ["g1", "g2"] {
        let page = c.port_forward_get("l3", name, 80)?;
        assert!(
            page.contains(&format!("hostname={name}")),
            "l3/{name}: {page}"
        );
    }
    // l3b's network of the same subnet: t1 reaches its own node's gateway, but neither l3
    // guest, and g2 (same node, maybe the same host subnet) never reaches t1.
    assert!(
        ![&g1.sec_ip, &g2.sec_ip].contains(&&t1.sec_ip),
        "{}",
        t1.sec_ip
    );
    assert_eq!(reached(t1, &[&t1.sec_gw], 2)?, vec![t1.sec_gw.clone()]);
    let got = reached(t1, &[&g1.sec_ip, &g2.sec_ip], 1)?;
    assert!(got.is_empty(), "t1 (l3b) reached l3's guests: {got:?}");
    let got = reached(g2, &[&t1.sec_ip], 1)?;
    assert!(got.is_empty(), "g2 (l3) reached t1 (l3b): {got:?}");
    // Each node's namespace of the Primary network routes the other node's host subnet
    // through the VXLAN device (no bridge port), and sends the network's other addresses
    // nowhere (unreachable) rather than out of its egress.
    let mut routes = Vec::new();
    for (node, other) in [(&node_a, &g2.ip), (&node_b, &g1.ip)] {
        let ns = ferrovirt_network::udn::netns_name("l3_net", Some(node.name()));
        let out = std::process::Command::new("ip")
            .args(["-n", &ns, "route", "show"])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let subnet = format!("{}.0/24", net24(other).unwrap_or_default());
        assert!(
            text.lines()
                .any(|l| l.contains(&subnet) && l.contains("onlink") && l.contains("udn-vx0")),
            "{}: {text}",
            node.name()
        );
        assert!(
            text.contains("unreachable 10.150.0.0/16") && text.contains("default via 169.254.128."),
            "{}: {text}",
            node.name()
        );
        let out = std::process::Command::new("ip")
            .args(["-n", &ns, "link", "show", "udn-vx0"])
            .output()?;
        let link = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(!link.contains("master"), "{link}");
        routes.push(text.trim().to_string());
    }
    // Node A: l3's two networks; node B: also l3b's.
    assert_eq!(udn_namespaces(&node_a)?.len(), 2);
    assert_eq!(udn_namespaces(&node_b)?.len(), 3);
    let checked = t.elapsed();

    let addrs: Vec<(String, String)> = guests
        .values()
        .map(|g| (g.ip.clone(), g.sec_ip.clone()))
        .collect();
    let uids: Vec<String> = guests.values().map(|g| g.uid.clone()).collect();
    drop(guests);
    udnkit::delete_all(&c, "vmi", &vms, &uids, &[&node_a, &node_b])?;
    eprintln!(
        "addresses {addrs:?}; routes {routes:?}; guests leased and Running after {booted:?}; \
         g1 -> g2 pinged in {pinged:?}; all pings and checks {checked:?}; whole test {:?}",
        started.elapsed()
    );
    drop(guards);
    Ok(())
}
