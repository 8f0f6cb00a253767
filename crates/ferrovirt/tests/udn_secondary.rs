//! Secondary Layer2 UserDefinedNetworks as Multus interfaces across two nodes (issue #22;
//! docs/networking.md "User-defined networks"): node A is the server's embedded agent in
//! network namespace A, node B a `ferrovirt agent` in namespace B, joined by an underlay veth.
//! Namespaces `sa` and `sb` each have a Secondary Layer2 UDN `blue` on the SAME subnet
//! 10.120.0.0/24. VMIs s1 (node A) and s2 (node B) in sa, t1 (node B) in sb, each with the pod
//! network (masquerade) and `blue` as second interface (bridge): the guests lease, on eth1,
//! the address the controller annotated (no router); s1 and s2 ping each other across the
//! nodes; t1 (its address replaced by one only sb has) reaches neither, and s1 never reaches
//! t1's; node B's agent restarted after its VXLAN devices were deleted makes them again; s2
//! (shared disk) live-migrates to node A and s1 reaches it there; deleting the VMIs removes
//! the networks' namespaces on both nodes.

mod udnkit;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ferrovirt_testkit::Cluster;
use ferrovirt_testkit::netns::{Netns, NodePair};
use udnkit::{Attach, Guest, Machine, Underlay, disk_claim, pings, udn_namespaces};

const A_IP: &str = "192.168.248.1";
const B_IP: &str = "192.168.248.2";
const B_CIDR: &str = "10.244.211.0/24";
/// The address t1 takes on sb's network: no sa guest holds it.
const ONLY_IN_SB: &str = "10.120.0.250";
const UNDERLAY: Underlay = Underlay {
    prefix: "fvs",
    a_ip: A_IP,
    b_ip: B_IP,
    b_cidr: B_CIDR,
    uplink: false,
};

fn udn_yaml(ns: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Namespace
metadata: {{name: {ns}}}
---
apiVersion: k8s.ovn.org/v1
kind: UserDefinedNetwork
metadata: {{name: blue, namespace: {ns}}}
spec:
  topology: Layer2
  layer2:
    role: Secondary
    subnets: ["10.120.0.0/24"]
"#
    )
}

/// The VMI Running with its blue address annotated; its guest leases that address on eth1.
fn guest(c: &Cluster, ns: &str, name: &str, node_dir: PathBuf) -> anyhow::Result<Guest> {
    let v = udnkit::wait_phase_running(c, ns, name)?;
    let ann = udnkit::pod_networks(&v)?;
    let entry = &ann[format!("{ns}/blue")];
    assert_eq!(entry["role"], "secondary", "{ann}");
    let cidr = entry["ip_addresses"][0].as_str().unwrap_or_default();
    assert!(
        cidr.starts_with("10.120.0.") && cidr.ends_with("/24"),
        "{ann}"
    );
    let ip = cidr.trim_end_matches("/24").to_string();
    let node_dir = &node_dir;
    let g = Guest::attach(
        c,
        &v,
        Attach {
            ip: ip.clone(),
            node_dir,
            eth0_lease: None,
        },
    )?;
    // The test guest leases eth0 only: ask for eth1's lease (the agent's DHCP server on the
    // VMI-side bridge offers the annotated address, without a router).
    let out = g.lease_eth1(name, "")?;
    assert!(out.contains(&format!("inet {ip}/24")), "{name}: {out}");
    let lease = udnkit::lease_line(c, &g.dir, "eth1", Duration::from_secs(20))?;
    assert!(lease.contains(&format!("ip={ip}/24 router=")), "{lease}");
    assert!(lease.trim_end().ends_with("router="), "no router: {lease}");
    Ok(g)
}

#[test]
fn secondary_layer2_udns_join_guests_across_nodes_and_stay_isolated() -> anyhow::Result<()> {
    let started = Instant::now();
    let NodePair {
        a: node_a,
        b: node_b,
    } = UNDERLAY.nodes()?;
    let mut c = UNDERLAY.start(&node_a, &node_b)?;
    for ns in ["sa", "sb"] {
        c.apply(&udn_yaml(ns))?;
        c.wait_until(&format!("{ns}/blue's NAD"), Duration::from_secs(30), || {
            let out = c.kubectl(&["get", "net-attach-def", "blue", "-n", ns])?;
            Ok(out.status.success().then_some(()))
        })?;
    }
    let vms = [
        ("sa", "s1", "node-a"),
        ("sa", "s2", "node-b"),
        ("sb", "t1", "node-b"),
    ];
    // s2 is placed by a label node B has (node A gets it later, for s2's live migration).
    c.kubectl_ok(&["label", "node", "node-b", "udn-test/s2=yes"])?;
    for (ns, name, node) in vms {
        let selector = if name == "s2" {
            "udn-test/s2: \"yes\"".to_string()
        } else {
            format!("kubernetes.io/hostname: {node}")
        };
        disk_claim(&c, ns, name, name == "s2")?;
        let m = Machine {
            ns,
            name,
            selector: &selector,
            pod_binding: "masquerade",
            multus: Some("blue"),
        };
        c.apply(&m.vmi_yaml())?;
    }
    let mut guests = std::collections::BTreeMap::new();
    let mut guards = Vec::new();
    for (ns, name, node) in vms {
        let g = guest(&c, ns, name, udnkit::node_dir(&c, node))?;
        guards.push(Netns::guard(&format!("fv-{}", g.uid)));
        guests.insert(name, g);
    }
    let booted = started.elapsed();
    // Node A carries sa's network; node B both (one namespace each).
    assert_eq!(udn_namespaces(&node_a)?.len(), 1);
    assert_eq!(udn_namespaces(&node_b)?.len(), 2);

    // sa's guests across the nodes.
    let t = Instant::now();
    let (ok, out) = pings(&guests["s1"], &guests["s2"].ip, 10)?;
    assert!(ok, "s1 -> s2: {out}");
    let (ok, out) = pings(&guests["s2"], &guests["s1"].ip, 3)?;
    assert!(ok, "s2 -> s1: {out}");
    let pinged = t.elapsed();

    // t1 (sb) takes an address only sb has: neither sa guest (s2 on its node, s1 across)
    // answers it, nor does s1 reach it.
    let (_, rc) = guests["t1"].console.exec(
        &format!("ip addr flush dev eth1 && ip addr add {ONLY_IN_SB}/24 dev eth1"),
        Duration::from_secs(10),
    )?;
    assert_eq!(rc, 0);
    for s in ["s1", "s2"] {
        let ip = &guests[s].ip;
        let (ok, out) = pings(&guests["t1"], ip, 1)?;
        assert!(!ok, "t1 (sb) reached {s}'s {ip} on sa: {out}");
        let (neigh, _) = guests["t1"]
            .console
            .exec(&format!("ip neigh show {ip}"), Duration::from_secs(10))?;
        assert!(!neigh.contains("lladdr"), "t1 resolved {s}'s {ip}: {neigh}");
    }
    let (ok, out) = pings(&guests["s1"], ONLY_IN_SB, 1)?;
    assert!(
        !ok,
        "s1 reached {ONLY_IN_SB}, an address only sb has: {out}"
    );

    // Node B's agent killed; meanwhile its networks lose their VXLAN devices. The restarted
    // agent re-attaches its running VMIs: the networks are made again and s2 reaches s1.
    udnkit::kill_node_b_and_its_vxlans(&c, &node_b)?;
    let (ok, _) = pings(&guests["s2"], &guests["s1"].ip, 1)?;
    assert!(!ok, "s2 reached s1 without node B's VXLAN device");
    UNDERLAY.start_node_b(&mut c, &node_b)?;
    let restarted = Instant::now();
    let (ok, out) = pings(&guests["s2"], &guests["s1"].ip, 30)?;
    assert!(ok, "s2 -> s1 after node B's agent restarted: {out}");
    let repaired = restarted.elapsed();

    // s2 (shared disk) live-migrates to node A with its blue interface: the target joins
    // the network, s1 reaches s2 there, sa's namespace leaves node B.
    let before = c.get_json(&["vmi", "s2", "-n", "sa"])?;
    let cond = udnkit::live_migratable(&before);
    assert_eq!(cond["status"], "True", "{cond}");
    guards.push(Netns::guard(&format!(
        "fv-{}-{}",
        guests["s2"].uid,
        node_a.name()
    )));
    c.kubectl_ok(&["label", "node", "node-a", "udn-test/s2=yes"])?;
    let migrated = Instant::now();
    let m = udnkit::migrate(&c, "sa", "s2")?;
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    let migration_took = migrated.elapsed();
    let after = udnkit::running_on(&c, "sa", "s2", "node-a")?;
    assert_eq!(after["metadata"]["uid"], before["metadata"]["uid"]);
    let (ok, out) = pings(&guests["s1"], &guests["s2"].ip, 10)?;
    assert!(ok, "s1 -> s2 after s2's migration: {out}");
    c.wait_until(
        "sa's namespace gone from node B",
        Duration::from_secs(60),
        || Ok((udn_namespaces(&node_b)?.len() == 1).then_some(())),
    )?;
    assert_eq!(udn_namespaces(&node_a)?.len(), 1);

    // Deleting the VMIs removes their namespaces and the networks' namespaces.
    let uids: Vec<String> = guests.values().map(|g| g.uid.clone()).collect();
    drop(guests);
    udnkit::delete_all(&c, "vmi", &vms, &uids, &[&node_a, &node_b])?;
    eprintln!(
        "guests leased and Running after {booted:?}; s1<->s2 pinged in {pinged:?}; node B's \
         networks repaired {repaired:?} after its agent restarted; s2's migration \
         {migration_took:?}; whole test {:?}",
        started.elapsed()
    );
    drop(guards);
    Ok(())
}
