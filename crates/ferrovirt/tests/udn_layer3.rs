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

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ferrovirt_testkit::netns::{Netns, NodePair, pod_network_args, wait_vmi_netns_gone};
use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(240);
const A_IP: &str = "192.168.247.1";
const B_IP: &str = "192.168.247.2";
const B_CIDR: &str = "10.244.212.0/24";
/// The Secondary Layer3 networks' subnet (both namespaces').
const SEC_CIDR: &str = "10.210.0.0/16";

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

fn disk_claim(c: &Cluster, ns: &str, vm: &str) -> anyhow::Result<()> {
    let g = TestGuest::get()?;
    let dir = c.dir().join("pvs").join(vm);
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(&g.disk_raw, dir.join("disk.img"))?;
    c.apply(&format!(
        r#"
apiVersion: v1
kind: PersistentVolume
metadata: {{name: pv-l3-{vm}}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  hostPath: {{path: {dir}}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {vm}-root, namespace: {ns}}}
spec:
  accessModes: [ReadWriteOnce]
  resources: {{requests: {{storage: 1Gi}}}}
  volumeName: pv-l3-{vm}
"#,
        dir = dir.display()
    ))?;
    Ok(())
}

/// In l3 the pod network is the Primary network (bridge binding); elsewhere masquerade.
fn vmi_yaml(ns: &str, name: &str, node: &str) -> String {
    let binding = if ns == "l3" { "bridge" } else { "masquerade" };
    format!(
        r##"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: {name}, namespace: {ns}}}
spec:
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  domain:
    memory: {{guest: 128Mi}}
    devices:
      disks:
      - {{name: root, disk: {{bus: virtio}}}}
      - {{name: ci, disk: {{bus: virtio}}}}
      interfaces:
      - {{name: default, {binding}: {{}}}}
      - {{name: sec, bridge: {{}}}}
  networks:
  - {{name: default, pod: {{}}}}
  - {{name: sec, multus: {{networkName: sec}}}}
  volumes:
  - {{name: root, persistentVolumeClaim: {{claimName: {name}-root}}}}
  - {{name: ci, cloudInitNoCloud: {{userData: "#!/bin/sh\ntrue\n"}}}}
"##
    )
}

struct Guest {
    uid: String,
    /// The address on the Primary network (l3 only).
    ip: String,
    /// The address on `sec` (eth1) and the node's gateway there.
    sec_ip: String,
    sec_gw: String,
    console: SerialConsole,
}

/// The VMI Running with its addresses; its guest leased them: in l3 on eth0 with its node's
/// gateway as router; on eth1 (asked for here: the guest leases eth0 only) with no router and
/// the route for the whole Secondary network via its node's gateway.
fn guest(c: &Cluster, ns: &str, name: &str, node_dir: PathBuf) -> anyhow::Result<(Guest, Value)> {
    let v = c.wait_until(&format!("VMI {ns}/{name} Running"), BOOT, || {
        let v = c.get_json(&["vmi", name, "-n", ns])?;
        if v["status"]["phase"] == "Failed" {
            anyhow::bail!("VMI {ns}/{name} failed: {}", v["status"]["conditions"]);
        }
        let ok = v["status"]["phase"] == "Running"
            && v["status"]["interfaces"][0]["ipAddress"].is_string();
        Ok(ok.then_some(v))
    })?;
    let ann: Value = serde_json::from_str(
        v["metadata"]["annotations"]["k8s.ovn.org/pod-networks"]
            .as_str()
            .unwrap_or("{}"),
    )?;
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
    if let Some(want) = cidr_gw {
        let lease = c.wait_until("eth0's lease", Duration::from_secs(60), || {
            Ok(serial()
                .lines()
                .find(|l| l.contains("FERROVIRT-DHCP eth0"))
                .map(String::from))
        })?;
        assert!(lease.contains(&want), "{lease}");
    }
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    let (out, rc) = console.exec(
        "udhcpc -i eth1 -s /etc/udhcpc.script -q -n -t 10 -T 1 >/dev/null 2>&1; \
         ip -4 -o addr show eth1; ip route",
        Duration::from_secs(60),
    )?;
    assert_eq!(rc, 0, "{name}: {out}");
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
    let g = Guest {
        uid,
        ip,
        sec_ip,
        sec_gw,
        console,
    };
    Ok((g, v))
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

/// The addresses among `addrs` that answered `count` pings from `g` (at least once, 2 s wait).
fn reached(g: &Guest, addrs: &[&str], count: u32) -> anyhow::Result<Vec<String>> {
    let list = addrs.join(" ");
    let (out, _) = g.console.exec(
        &format!(
            "for a in {list}; do ping -c {count} -W 2 $a >/dev/null 2>&1 && echo REACHED''-$a; done; true"
        ),
        Duration::from_secs(30),
    )?;
    Ok(out
        .lines()
        .filter_map(|l| l.trim().strip_prefix("REACHED-").map(String::from))
        .collect())
}

fn migratable(v: &Value) -> Value {
    v["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "LiveMigratable").cloned())
        .unwrap_or_default()
}

/// Pings `addrs` from `g` until each answered once, `tries` rounds at most; the ones that
/// never did.
fn reach_all(g: &Guest, addrs: &[&str], tries: u32) -> anyhow::Result<Vec<String>> {
    let mut missing: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
    for _ in 0..tries {
        let list: Vec<&str> = missing.iter().map(String::as_str).collect();
        let got = reached(g, &list, 2)?;
        missing.retain(|a| !got.contains(a));
        if missing.is_empty() {
            break;
        }
    }
    Ok(missing)
}

#[test]
fn layer3_udns_route_between_node_subnets_with_egress() -> anyhow::Result<()> {
    let started = Instant::now();
    TestGuest::get()?;
    let NodePair {
        a: node_a,
        b: node_b,
    } = NodePair::new("fv3", A_IP, B_IP)?;
    // Both nodes with an uplink (the underlay): the Primary network gets its egress.
    let mut opts = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
    opts.node_name = Some("node-a".into());
    opts.extra_args = pod_network_args(&node_a, A_IP, None)
        .into_iter()
        .chain(["--uplink", "under0"])
        .map(String::from)
        .collect();
    let mut c = Cluster::start(&opts)?;
    let mut b_args = pod_network_args(&node_b, B_IP, Some(B_CIDR));
    b_args.extend(["--uplink", "under0", "--endpoint-listen", "0.0.0.0:0"]);
    c.start_agent_with("node-b", &b_args)?;
    c.wait_until("both nodes with a podCIDR", Duration::from_secs(60), || {
        let a = c.get_json(&["node", "node-a"])?;
        let b = c.get_json(&["node", "node-b"])?;
        Ok((a["spec"]["podCIDR"].is_string() && b["spec"]["podCIDR"].is_string()).then_some(()))
    })?;
    c.apply(&udn_yaml())?;
    let vms = [
        ("l3", "g1", "node-a"),
        ("l3", "g2", "node-b"),
        ("l3b", "t1", "node-b"),
    ];
    for (ns, name, node) in vms {
        disk_claim(&c, ns, name)?;
        c.apply(&vmi_yaml(ns, name, node))?;
    }
    let mut guests = std::collections::BTreeMap::new();
    let mut guards = Vec::new();
    for (ns, name, node) in vms {
        let dir = if node == "node-a" {
            c.agent_dir()
        } else {
            c.extra_agent_dir("node-b")
        };
        let (g, v) = guest(&c, ns, name, dir)?;
        // A Layer3 address belongs to its node: never live-migratable, saying why (t1: its
        // Secondary interface's network).
        let cond = migratable(&v);
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
        "addresses {addrs:?}; routes {routes:?}; guests leased and Running after {booted:?}; \
         g1 -> g2 pinged in {pinged:?}; all pings and checks {checked:?}; whole test {:?}",
        started.elapsed()
    );
    drop(guards);
    Ok(())
}
