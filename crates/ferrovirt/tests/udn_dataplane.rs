//! The Primary Layer2 UserDefinedNetwork data plane across two nodes (issue #22; docs/
//! networking.md "User-defined networks"): node A is the server's embedded agent in network
//! namespace A, node B a `ferrovirt agent` in namespace B, joined by an underlay veth.
//! Namespaces `ua` and `ub` are labelled `k8s.ovn.org/primary-user-defined-network` and each
//! has a Primary Layer2 UDN `net` on the SAME subnet 10.100.0.0/24 (lifecycle Persistent).
//! VMs a1 (A) and a2 (B) in ua, b1 (A) and b2 (B) in ub, bridge binding on the pod network:
//! each guest leases the address the controller annotated, with the network's gateway (both
//! nodes have an uplink) as router, through which it reaches the other node's underlay address
//! but not its own node; a1 pings a2 and b1 pings b2 across the nodes; an address that exists only in ub (added by the test in b1's guest, reached by
//! b2 as the positive control) and every ub address that no ua guest holds are unreachable
//! from a1 and a2; node B's agent restarted after its VXLAN devices were deleted makes them
//! again; a1 restarted (stop/start) keeps its address (IPAMClaim); a2 (shared disk) live-
//! migrates to node A keeping its address; deleting the VMs removes the networks' namespaces
//! on both nodes.

mod udnkit;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ferrovirt_testkit::Cluster;
use ferrovirt_testkit::netns::{Netns, NodePair};
use serde_json::Value;
use udnkit::{
    Attach, Guest, Machine, Underlay, disk_claim, node_dir, pings, udn_namespaces, wait_running,
};

const A_IP: &str = "192.168.249.1";
const B_IP: &str = "192.168.249.2";
const B_CIDR: &str = "10.244.210.0/24";
/// The networks' gateway (the first address of their subnet).
const GATEWAY: &str = "10.100.0.1";
/// An address the test adds in b1's guest: it exists only in ub's network.
const ONLY_IN_UB: &str = "10.100.0.250";
const UNDERLAY: Underlay = Underlay {
    prefix: "fvu",
    a_ip: A_IP,
    b_ip: B_IP,
    b_cidr: B_CIDR,
    uplink: true,
};

fn udn_yaml(ns: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Namespace
metadata:
  name: {ns}
  labels: {{k8s.ovn.org/primary-user-defined-network: ""}}
---
apiVersion: k8s.ovn.org/v1
kind: UserDefinedNetwork
metadata: {{name: net, namespace: {ns}}}
spec:
  topology: Layer2
  layer2:
    role: Primary
    subnets: ["10.100.0.0/24"]
    ipam: {{lifecycle: Persistent}}
"#
    )
}

/// The guest of VMI `v` once it leased the annotated address with the network's gateway as
/// its router.
fn guest(c: &Cluster, v: &Value, node_dir: std::path::PathBuf) -> anyhow::Result<Guest> {
    let ip = v["status"]["interfaces"][0]["ipAddress"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let eth0_lease = Some(format!("ip={ip}/24 router={GATEWAY}"));
    let node_dir = &node_dir;
    Guest::attach(
        c,
        v,
        Attach {
            ip,
            node_dir,
            eth0_lease,
        },
    )
}

fn ping_avg_ms(out: &str) -> Option<f64> {
    let line = out.lines().find(|l| l.contains("min/avg/max"))?;
    line.split('=')
        .nth(1)?
        .trim()
        .split('/')
        .nth(1)?
        .parse()
        .ok()
}

#[test]
fn primary_udns_with_one_subnet_are_isolated_across_nodes() -> anyhow::Result<()> {
    let started = Instant::now();
    let pair = UNDERLAY.nodes()?;
    let NodePair {
        a: node_a,
        b: node_b,
    } = pair;
    // Both nodes with an uplink (the underlay): the networks get their gateway.
    let mut c = UNDERLAY.start(&node_a, &node_b)?;

    // Two namespaces, each with its Primary UDN on the same subnet; the controller gives
    // each network its VNI.
    let mut vnis = BTreeMap::new();
    for ns in ["ua", "ub"] {
        c.apply(&udn_yaml(ns))?;
        let vni = c.wait_until(
            &format!("{ns}'s NAD with its VNI"),
            Duration::from_secs(30),
            || {
                let out = c.kubectl(&["get", "net-attach-def", "net", "-n", ns, "-o", "json"])?;
                if !out.status.success() {
                    return Ok(None);
                }
                let n: Value = serde_json::from_slice(&out.stdout)?;
                Ok(n["metadata"]["annotations"]["ferrovirt.io/udn-vni"]
                    .as_str()
                    .map(String::from))
            },
        )?;
        vnis.insert(ns, vni);
    }
    assert_ne!(vnis["ua"], vnis["ub"], "{vnis:?}");

    let vms = [
        ("ua", "a1", "node-a"),
        ("ua", "a2", "node-b"),
        ("ub", "b1", "node-a"),
        ("ub", "b2", "node-b"),
    ];
    // a2 is placed by a label node B has (node A gets it later, for a2's live migration).
    c.kubectl_ok(&["label", "node", "node-b", "udn-test/a2=yes"])?;
    for (ns, name, node) in vms {
        let selector = if name == "a2" {
            "udn-test/a2: \"yes\"".to_string()
        } else {
            format!("kubernetes.io/hostname: {node}")
        };
        disk_claim(&c, ns, name, name == "a2")?;
        let m = Machine {
            ns,
            name,
            selector: &selector,
            pod_binding: "bridge",
            multus: None,
        };
        c.apply(&m.vm_yaml())?;
    }
    let mut guests: BTreeMap<&str, Guest> = BTreeMap::new();
    let mut guards = Vec::new();
    for (ns, name, node) in vms {
        let v = wait_running(&c, ns, name)?;
        let ip = v["status"]["interfaces"][0]["ipAddress"]
            .as_str()
            .unwrap_or("");
        assert!(
            ip.starts_with("10.100.0.") && ip != "10.100.0.1",
            "{name}: {ip}"
        );
        // The address is the one the controller annotated.
        let ann = udnkit::pod_networks(&v)?;
        assert_eq!(
            ann[format!("{ns}/net")]["ip_addresses"][0],
            format!("{ip}/24"),
            "{ann}"
        );
        // Live-migratable exactly when the disk is shared: the UDN interface moves.
        let cond = udnkit::live_migratable(&v);
        let want = if name == "a2" { "True" } else { "False" };
        assert_eq!(cond["status"], want, "{name}: {cond}");
        if name != "a2" {
            assert_eq!(cond["reason"], "DisksNotLiveMigratable", "{name}: {cond}");
        }
        let g = guest(&c, &v, node_dir(&c, node))?;
        guards.push(Netns::guard(&format!("fv-{}", g.uid)));
        guests.insert(name, g);
    }
    let boot_done = started.elapsed();
    let addrs: BTreeMap<&str, String> = guests.iter().map(|(n, g)| (*n, g.ip.clone())).collect();
    // Each node runs one namespace per network.
    for node in [&node_a, &node_b] {
        let n = udn_namespaces(node)?;
        assert_eq!(n.len(), 2, "{}: {n:?}", node.name());
    }

    // Own peers across the nodes.
    let (ok, out) = pings(&guests["a1"], &guests["a2"].ip, 10)?;
    assert!(ok, "a1 -> a2: {out}");
    let rtt_a = ping_avg_ms(&out);
    let (ok, out) = pings(&guests["b1"], &guests["b2"].ip, 10)?;
    assert!(ok, "b1 -> b2: {out}");
    let rtt_b = ping_avg_ms(&out);
    let (ok, out) = pings(&guests["a2"], &guests["a1"].ip, 3)?;
    assert!(ok, "a2 -> a1: {out}");

    // The gateway: answered on each node; egress through the node's uplink (masqueraded:
    // node B sees node A's address, and the other way round); the guest's own node and the
    // pod network stay out of reach.
    for g in ["a1", "b2"] {
        let (ok, out) = pings(&guests[g], GATEWAY, 3)?;
        assert!(ok, "{g} -> gateway: {out}");
    }
    let (ok, out) = pings(&guests["a1"], B_IP, 3)?;
    assert!(ok, "a1 -> {B_IP} through node A's uplink: {out}");
    let (ok, out) = pings(&guests["b2"], A_IP, 3)?;
    assert!(ok, "b2 -> {A_IP} through node B's uplink: {out}");
    let a_gw = c.get_json(&["node", "node-a"])?["spec"]["podCIDR"]
        .as_str()
        .unwrap_or_default()
        .replace(".0/24", ".1");
    for own in [A_IP, a_gw.as_str()] {
        let (ok, out) = pings(&guests["a1"], own, 1)?;
        assert!(!ok, "a1 reached its own node's {own}: {out}");
    }
    let (ok, out) = pings(&guests["b2"], B_IP, 1)?;
    assert!(!ok, "b2 reached its own node's {B_IP}: {out}");

    // port-forward through the API reaches the guest from its network's namespace on its
    // node (the gateway's address is the source): a1 and b2 hold addresses of the same
    // subnet in two networks, each answers with its own page.
    for (ns, name) in [("ua", "a1"), ("ub", "b2")] {
        let page = c.port_forward_get(ns, name, 80)?;
        assert!(
            page.contains(&format!("hostname={name}")),
            "{ns}/{name}: {page}"
        );
    }

    // Never the other namespace's: an address only ub has (b1 holds it; b2 reaches it across
    // the nodes, the positive control) is unreachable from a1 (same node as b1) and a2.
    let (_, rc) = guests["b1"].console.exec(
        &format!("ip addr add {ONLY_IN_UB}/24 dev eth0"),
        Duration::from_secs(10),
    )?;
    assert_eq!(rc, 0);
    let (ok, out) = pings(&guests["b2"], ONLY_IN_UB, 5)?;
    assert!(ok, "b2 -> {ONLY_IN_UB} (positive control): {out}");
    for a in ["a1", "a2"] {
        let (ok, out) = pings(&guests[a], ONLY_IN_UB, 1)?;
        assert!(
            !ok,
            "{a} reached {ONLY_IN_UB}, an address only ub has: {out}"
        );
        let (neigh, _) = guests[a].console.exec(
            &format!("ip neigh show {ONLY_IN_UB}"),
            Duration::from_secs(10),
        )?;
        assert!(
            !neigh.contains("lladdr"),
            "{a} resolved {ONLY_IN_UB}: {neigh}"
        );
    }
    // ub's own addresses that no ua guest holds: unreachable from ua.
    let ua_ips = [&guests["a1"].ip, &guests["a2"].ip];
    for b in ["b1", "b2"] {
        let ip = &guests[b].ip;
        if ua_ips.contains(&ip) {
            continue;
        }
        let (ok, out) = pings(&guests["a1"], ip, 1)?;
        assert!(!ok, "a1 reached {b}'s {ip}: {out}");
    }

    // Node B's agent killed; meanwhile its networks lose their VXLAN devices. The restarted
    // agent re-attaches its running VMIs: the networks are made again (the flood lists too)
    // and the guests reach their peers on node A again.
    let b_nets = udnkit::kill_node_b_and_its_vxlans(&c, &node_b)?;
    let (ok, _) = pings(&guests["a2"], &guests["a1"].ip, 1)?;
    assert!(!ok, "a2 reached a1 without node B's VXLAN device");
    UNDERLAY.start_node_b(&mut c, &node_b)?;
    let restarted = Instant::now();
    c.wait_until(
        "node B's networks made again",
        Duration::from_secs(60),
        || {
            for n in &b_nets {
                let fdb = ferrovirt_testkit::netns::sh(&[
                    "bridge", "-n", n, "fdb", "show", "dev", "udn-vx0",
                ])
                .unwrap_or_default();
                if !fdb.contains(&format!("00:00:00:00:00:00 dst {A_IP}")) {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        },
    )?;
    let repaired = restarted.elapsed();
    let (ok, out) = pings(&guests["a2"], &guests["a1"].ip, 10)?;
    assert!(ok, "a2 -> a1 after node B's agent restart: {out}");
    let (ok, out) = pings(&guests["b2"], &guests["b1"].ip, 10)?;
    assert!(ok, "b2 -> b1 after node B's agent restart: {out}");

    // a1 restarted (stop/start): a new VMI with the same address (its IPAMClaim).
    let a1_ip = guests["a1"].ip.clone();
    let a1_uid = guests["a1"].uid.clone();
    let claims = c.kubectl_ok(&["get", "ipamclaims", "-n", "ua", "-o", "name"])?;
    assert!(!claims.trim().is_empty(), "no IPAMClaim in ua");
    drop(guests.remove("a1"));
    let patch = |s: &str| format!(r#"{{"spec":{{"runStrategy":"{s}"}}}}"#);
    c.kubectl_ok(&[
        "patch",
        "vm",
        "a1",
        "-n",
        "ua",
        "--type",
        "merge",
        "-p",
        &patch("Halted"),
    ])?;
    c.wait_until("a1's VMI gone", Duration::from_secs(120), || {
        let out = c.kubectl(&["get", "vmi", "a1", "-n", "ua"])?;
        Ok((!out.status.success()).then_some(()))
    })?;
    c.kubectl_ok(&[
        "patch",
        "vm",
        "a1",
        "-n",
        "ua",
        "--type",
        "merge",
        "-p",
        &patch("Always"),
    ])?;
    let v = wait_running(&c, "ua", "a1")?;
    assert_ne!(v["metadata"]["uid"].as_str(), Some(a1_uid.as_str()));
    let g = guest(&c, &v, node_dir(&c, "node-a"))?;
    assert_eq!(g.ip, a1_ip, "a1's address after the restart");
    guards.push(Netns::guard(&format!("fv-{}", g.uid)));
    let (ok, out) = pings(&g, &guests["a2"].ip, 10)?;
    assert!(ok, "restarted a1 -> a2: {out}");
    guests.insert("a1", g);

    // a2 live-migrated from node B to node A: the same VMI, address and MAC; a1 reaches it
    // there; node B no longer runs a VMI of ua, so ua's namespace leaves node B.
    let before = c.get_json(&["vmi", "a2", "-n", "ua"])?;
    // ua's namespace on node B, from a2's plan there.
    let plan: Value = serde_json::from_slice(&std::fs::read(
        node_dir(&c, "node-b")
            .join("vmis")
            .join(&guests["a2"].uid)
            .join("network.json"),
    )?)?;
    let ua_b = plan["udn"]["netns"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(udn_namespaces(&node_b)?.contains(&ua_b), "{ua_b}");
    guards.push(Netns::guard(&format!(
        "fv-{}-{}",
        guests["a2"].uid,
        node_a.name()
    )));
    c.kubectl_ok(&["label", "node", "node-a", "udn-test/a2=yes"])?;
    let migrated = Instant::now();
    let m = udnkit::migrate(&c, "ua", "a2")?;
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    let migration_took = migrated.elapsed();
    let after = udnkit::running_on(&c, "ua", "a2", "node-a")?;
    assert_eq!(after["metadata"]["uid"], before["metadata"]["uid"]);
    assert_eq!(
        after["status"]["interfaces"][0]["ipAddress"],
        guests["a2"].ip.as_str()
    );
    assert_eq!(
        after["status"]["interfaces"][0]["mac"],
        before["status"]["interfaces"][0]["mac"]
    );
    let (ok, out) = pings(&guests["a1"], &guests["a2"].ip, 10)?;
    assert!(ok, "a1 -> a2 after a2's migration: {out}");
    c.wait_until(
        "ua's namespace gone from node B",
        Duration::from_secs(60),
        || Ok((!udn_namespaces(&node_b)?.contains(&ua_b)).then_some(())),
    )?;

    // Deleting the VMs removes the VMI namespaces and, with the last VMI of a network on a
    // node, the network's namespace there.
    let uids: Vec<String> = guests.values().map(|g| g.uid.clone()).collect();
    drop(guests);
    let has_gw_table = |node: &Netns| -> anyhow::Result<bool> {
        let out = node.exec(&["nft", "list", "tables"])?;
        anyhow::ensure!(out.status.success(), "nft list tables: {out:?}");
        let tables = String::from_utf8_lossy(&out.stdout).into_owned();
        Ok(tables.lines().any(|l| l.trim() == "table ip ferrovirt-udn"))
    };
    assert!(
        has_gw_table(&node_a)?,
        "node A has no gateway table while its networks egress"
    );
    udnkit::delete_all(&c, "vm", &vms, &uids, &[&node_a, &node_b])?;
    // With the last network the node's gateway table goes too.
    for node in [&node_a, &node_b] {
        c.wait_until(
            "the node's ferrovirt-udn table removed",
            Duration::from_secs(30),
            || Ok((!has_gw_table(node)?).then_some(())),
        )?;
    }
    eprintln!(
        "addresses {addrs:?}; VNIs {vnis:?}; VMIs Running after {boot_done:?}; RTT a1->a2 {rtt_a:?} ms, b1->b2 \
         {rtt_b:?} ms (across nodes); node B's networks repaired {repaired:?} after its agent \
         restarted; a2's migration {migration_took:?}; whole test {:?}",
        started.elapsed()
    );
    drop(guards);
    Ok(())
}
