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

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ferrovirt_testkit::netns::{Netns, NodePair, pod_network_args, wait_vmi_netns_gone};
use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(240);
const A_IP: &str = "192.168.248.1";
const B_IP: &str = "192.168.248.2";
const B_CIDR: &str = "10.244.211.0/24";
/// The address t1 takes on sb's network: no sa guest holds it.
const ONLY_IN_SB: &str = "10.120.0.250";

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

/// `shared`: ReadWriteMany (both nodes being one host: the VMI is live-migratable).
fn disk_claim(c: &Cluster, ns: &str, vm: &str, shared: bool) -> anyhow::Result<()> {
    let mode = if shared {
        "ReadWriteMany"
    } else {
        "ReadWriteOnce"
    };
    let g = TestGuest::get()?;
    let dir = c.dir().join("pvs").join(format!("{ns}-{vm}"));
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(&g.disk_raw, dir.join("disk.img"))?;
    c.apply(&format!(
        r#"
apiVersion: v1
kind: PersistentVolume
metadata: {{name: pv-{ns}-{vm}}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [{mode}]
  persistentVolumeReclaimPolicy: Retain
  hostPath: {{path: {dir}}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {vm}-root, namespace: {ns}}}
spec:
  accessModes: [{mode}]
  resources: {{requests: {{storage: 1Gi}}}}
  volumeName: pv-{ns}-{vm}
"#,
        dir = dir.display()
    ))?;
    Ok(())
}

/// `selector`: the nodeSelector entry (`key: value`).
fn vmi_yaml(ns: &str, name: &str, selector: &str) -> String {
    format!(
        r##"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: {name}, namespace: {ns}}}
spec:
  nodeSelector: {{{selector}}}
  domain:
    memory: {{guest: 128Mi}}
    devices:
      disks:
      - {{name: root, disk: {{bus: virtio}}}}
      - {{name: ci, disk: {{bus: virtio}}}}
      interfaces:
      - {{name: default, masquerade: {{}}}}
      - {{name: blue, bridge: {{}}}}
  networks:
  - {{name: default, pod: {{}}}}
  - {{name: blue, multus: {{networkName: blue}}}}
  volumes:
  - {{name: root, persistentVolumeClaim: {{claimName: {name}-root}}}}
  - {{name: ci, cloudInitNoCloud: {{userData: "#!/bin/sh\ntrue\n"}}}}
"##
    )
}

struct Guest {
    uid: String,
    /// The address on `blue` (the controller's, leased by DHCP on eth1).
    ip: String,
    console: SerialConsole,
}

/// The VMI Running with its blue address annotated; its guest leases that address on eth1.
fn guest(c: &Cluster, ns: &str, name: &str, node_dir: PathBuf) -> anyhow::Result<Guest> {
    let v = c.wait_until(&format!("VMI {ns}/{name} Running"), BOOT, || {
        let out = c.kubectl(&["get", "vmi", name, "-n", ns, "-o", "json"])?;
        if !out.status.success() {
            return Ok(None);
        }
        let v: Value = serde_json::from_slice(&out.stdout)?;
        if v["status"]["phase"] == "Failed" {
            anyhow::bail!("VMI {ns}/{name} failed: {}", v["status"]["conditions"]);
        }
        Ok((v["status"]["phase"] == "Running").then_some(v))
    })?;
    let ann: Value = serde_json::from_str(
        v["metadata"]["annotations"]["k8s.ovn.org/pod-networks"]
            .as_str()
            .unwrap_or("{}"),
    )?;
    let entry = &ann[format!("{ns}/blue")];
    assert_eq!(entry["role"], "secondary", "{ann}");
    let cidr = entry["ip_addresses"][0].as_str().unwrap_or_default();
    assert!(
        cidr.starts_with("10.120.0.") && cidr.ends_with("/24"),
        "{ann}"
    );
    let ip = cidr.trim_end_matches("/24").to_string();
    let uid = v["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let dir = node_dir.join("vmis").join(&uid);
    let serial = || {
        let log = std::fs::read(dir.join("serial.log")).unwrap_or_default();
        String::from_utf8_lossy(&log).into_owned()
    };
    c.wait_until("guest ready", BOOT, || {
        Ok(serial().contains("FERROVIRT-READY").then_some(()))
    })?;
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    // The test guest leases eth0 only: ask for eth1's lease (the agent's DHCP server on the
    // VMI-side bridge offers the annotated address, without a router).
    let (out, rc) = console.exec(
        "udhcpc -i eth1 -s /etc/udhcpc.script -q -n -t 10 -T 1 >/dev/null 2>&1; ip -4 -o addr show eth1",
        Duration::from_secs(60),
    )?;
    assert_eq!(rc, 0, "{name}: {out}");
    assert!(out.contains(&format!("inet {ip}/24")), "{name}: {out}");
    let lease = c.wait_until(
        "eth1's lease on the console",
        Duration::from_secs(20),
        || {
            Ok(serial()
                .lines()
                .find(|l| l.contains("FERROVIRT-DHCP eth1"))
                .map(String::from))
        },
    )?;
    assert!(lease.contains(&format!("ip={ip}/24 router=")), "{lease}");
    assert!(lease.trim_end().ends_with("router="), "no router: {lease}");
    Ok(Guest { uid, ip, console })
}

fn pings(g: &Guest, addr: &str, tries: u32) -> anyhow::Result<(bool, String)> {
    let mut last = String::new();
    for _ in 0..tries {
        let (out, rc) = g
            .console
            .exec(&format!("ping -c 3 -W 2 {addr}"), Duration::from_secs(20))?;
        if rc == 0 {
            return Ok((true, out));
        }
        last = out;
    }
    Ok((false, last))
}

fn udn_namespaces(node: &Netns) -> anyhow::Result<Vec<String>> {
    let out = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()?;
    let suffix = format!("-{}", node.name());
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("fvn-") && n.ends_with(&suffix))
        .map(String::from)
        .collect())
}

#[test]
fn secondary_layer2_udns_join_guests_across_nodes_and_stay_isolated() -> anyhow::Result<()> {
    let started = Instant::now();
    TestGuest::get()?;
    let NodePair {
        a: node_a,
        b: node_b,
    } = NodePair::new("fvs", A_IP, B_IP)?;
    let mut opts = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
    opts.node_name = Some("node-a".into());
    opts.extra_args = pod_network_args(&node_a, A_IP, None)
        .into_iter()
        .map(String::from)
        .collect();
    let mut c = Cluster::start(&opts)?;
    let mut b_args = pod_network_args(&node_b, B_IP, Some(B_CIDR));
    b_args.extend(["--endpoint-listen", "0.0.0.0:0"]);
    c.start_agent_with("node-b", &b_args)?;
    c.wait_until("both nodes with a podCIDR", Duration::from_secs(60), || {
        let a = c.get_json(&["node", "node-a"])?;
        let b = c.get_json(&["node", "node-b"])?;
        Ok((a["spec"]["podCIDR"].is_string() && b["spec"]["podCIDR"].is_string()).then_some(()))
    })?;
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
        c.apply(&vmi_yaml(ns, name, &selector))?;
    }
    let mut guests = std::collections::BTreeMap::new();
    let mut guards = Vec::new();
    for (ns, name, node) in vms {
        let dir = if node == "node-a" {
            c.agent_dir()
        } else {
            c.extra_agent_dir("node-b")
        };
        let g = guest(&c, ns, name, dir)?;
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
    let pid = c.agent_pid("node-b").expect("node-b's agent");
    ferrovirt_testkit::cluster::signal(pid, "KILL");
    std::thread::sleep(Duration::from_millis(500));
    for n in udn_namespaces(&node_b)? {
        ferrovirt_testkit::netns::sh(&["ip", "-n", &n, "link", "del", "udn-vx0"])?;
    }
    let (ok, _) = pings(&guests["s2"], &guests["s1"].ip, 1)?;
    assert!(!ok, "s2 reached s1 without node B's VXLAN device");
    c.start_agent_with("node-b", &b_args)?;
    let restarted = Instant::now();
    let (ok, out) = pings(&guests["s2"], &guests["s1"].ip, 30)?;
    assert!(ok, "s2 -> s1 after node B's agent restarted: {out}");
    let repaired = restarted.elapsed();

    // s2 (shared disk) live-migrates to node A with its blue interface: the target joins
    // the network, s1 reaches s2 there, sa's namespace leaves node B.
    let before = c.get_json(&["vmi", "s2", "-n", "sa"])?;
    let cond = before["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "LiveMigratable").cloned())
        .unwrap_or_default();
    assert_eq!(cond["status"], "True", "{cond}");
    guards.push(Netns::guard(&format!(
        "fv-{}-{}",
        guests["s2"].uid,
        node_a.name()
    )));
    c.kubectl_ok(&["label", "node", "node-a", "udn-test/s2=yes"])?;
    let migrated = Instant::now();
    c.apply(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\n\
         metadata: {name: s2-mig, namespace: sa}\nspec: {vmiName: s2}\n",
    )?;
    let m = c.wait_until("s2's migration finished", Duration::from_secs(180), || {
        let v = c.get_json(&["vmim", "s2-mig", "-n", "sa"])?;
        let phase = v["status"]["phase"].as_str().unwrap_or_default();
        Ok(matches!(phase, "Succeeded" | "Failed").then_some(v))
    })?;
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    let migration_took = migrated.elapsed();
    let after = c.wait_until("s2 Running on node A", Duration::from_secs(60), || {
        let v = c.get_json(&["vmi", "s2", "-n", "sa"])?;
        Ok((v["status"]["phase"] == "Running" && v["status"]["nodeName"] == "node-a").then_some(v))
    })?;
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
    for (ns, name, _) in vms {
        c.kubectl_ok(&["delete", "vmi", name, "-n", ns, "--wait=false"])?;
    }
    wait_vmi_netns_gone(&c, &uids, Duration::from_secs(120))?;
    for node in [&node_a, &node_b] {
        c.wait_until(
            "the networks' namespaces removed",
            Duration::from_secs(60),
            || Ok(udn_namespaces(node)?.is_empty().then_some(())),
        )?;
    }
    eprintln!(
        "guests leased and Running after {booted:?}; s1<->s2 pinged in {pinged:?}; node B's \
         networks repaired {repaired:?} after its agent restarted; s2's migration \
         {migration_took:?}; whole test {:?}",
        started.elapsed()
    );
    drop(guards);
    Ok(())
}
