//! The Primary Layer3 UserDefinedNetwork data plane across two nodes (issue #22;
//! docs/networking.md "User-defined networks"): node A is the server's embedded agent in
//! network namespace A, node B a `ferrovirt agent` in namespace B, joined by an underlay veth.
//! Namespace `l3` is labelled `k8s.ovn.org/primary-user-defined-network` and has a Primary
//! Layer3 UDN `net` (10.150.0.0/16, host subnets /24). VMIs g1 (node A) and g2 (node B), bridge
//! binding on the pod network: each guest leases the address the controller gave it from its
//! node's host subnet with that subnet's gateway as router; g1 and g2 ping each other across
//! the nodes (routed between the host subnets); both are LiveMigratable=False naming the
//! Layer3 network; deleting the VMIs removes the network's namespaces.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ferrovirt_testkit::netns::{Netns, NodePair, pod_network_args, wait_vmi_netns_gone};
use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(240);
const A_IP: &str = "192.168.247.1";
const B_IP: &str = "192.168.247.2";
const B_CIDR: &str = "10.244.212.0/24";

fn udn_yaml() -> String {
    r#"
apiVersion: v1
kind: Namespace
metadata:
  name: l3
  labels: {k8s.ovn.org/primary-user-defined-network: ""}
---
apiVersion: k8s.ovn.org/v1
kind: UserDefinedNetwork
metadata: {name: net, namespace: l3}
spec:
  topology: Layer3
  layer3:
    role: Primary
    subnets: [{cidr: 10.150.0.0/16, hostSubnet: 24}]
"#
    .to_string()
}

fn disk_claim(c: &Cluster, vm: &str) -> anyhow::Result<()> {
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
metadata: {{name: {vm}-root, namespace: l3}}
spec:
  accessModes: [ReadWriteOnce]
  resources: {{requests: {{storage: 1Gi}}}}
  volumeName: pv-l3-{vm}
"#,
        dir = dir.display()
    ))?;
    Ok(())
}

fn vmi_yaml(name: &str, node: &str) -> String {
    format!(
        r##"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: {name}, namespace: l3}}
spec:
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  domain:
    memory: {{guest: 128Mi}}
    devices:
      disks:
      - {{name: root, disk: {{bus: virtio}}}}
      - {{name: ci, disk: {{bus: virtio}}}}
      interfaces:
      - {{name: default, bridge: {{}}}}
  networks:
  - {{name: default, pod: {{}}}}
  volumes:
  - {{name: root, persistentVolumeClaim: {{claimName: {name}-root}}}}
  - {{name: ci, cloudInitNoCloud: {{userData: "#!/bin/sh\ntrue\n"}}}}
"##
    )
}

struct Guest {
    uid: String,
    ip: String,
    console: SerialConsole,
}

/// The VMI Running with its address; its guest leased it with its node's gateway as router.
fn guest(c: &Cluster, name: &str, node_dir: PathBuf) -> anyhow::Result<(Guest, Value)> {
    let v = c.wait_until(&format!("VMI l3/{name} Running"), BOOT, || {
        let v = c.get_json(&["vmi", name, "-n", "l3"])?;
        if v["status"]["phase"] == "Failed" {
            anyhow::bail!("VMI l3/{name} failed: {}", v["status"]["conditions"]);
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
    let entry = &ann["l3/net"];
    let cidr = entry["ip_addresses"][0].as_str().unwrap_or_default();
    let gw = entry["gateway_ips"][0]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let ip = cidr.split('/').next().unwrap_or_default().to_string();
    assert!(ip.starts_with("10.150.") && !gw.is_empty(), "{ann}");
    assert_eq!(v["status"]["interfaces"][0]["ipAddress"], ip.as_str());
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
    let lease = c.wait_until("eth0's lease", Duration::from_secs(60), || {
        Ok(serial()
            .lines()
            .find(|l| l.contains("FERROVIRT-DHCP eth0"))
            .map(String::from))
    })?;
    assert!(lease.contains(&format!("ip={cidr} router={gw}")), "{lease}");
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    Ok((Guest { uid, ip, console }, v))
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
fn primary_layer3_udn_routes_between_node_subnets() -> anyhow::Result<()> {
    let started = Instant::now();
    TestGuest::get()?;
    let NodePair {
        a: node_a,
        b: node_b,
    } = NodePair::new("fv3", A_IP, B_IP)?;
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
    c.apply(&udn_yaml())?;
    let vms = [("g1", "node-a"), ("g2", "node-b")];
    for (name, node) in vms {
        disk_claim(&c, name)?;
        c.apply(&vmi_yaml(name, node))?;
    }
    let mut guests = std::collections::BTreeMap::new();
    let mut guards = Vec::new();
    for (name, node) in vms {
        let dir = if node == "node-a" {
            c.agent_dir()
        } else {
            c.extra_agent_dir("node-b")
        };
        let (g, v) = guest(&c, name, dir)?;
        // A Layer3 address belongs to its node: never live-migratable, saying why.
        let cond = v["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == "LiveMigratable").cloned())
            .unwrap_or_default();
        assert_eq!(cond["status"], "False", "{name}: {cond}");
        assert!(
            cond["message"]
                .as_str()
                .unwrap_or_default()
                .contains("Layer3"),
            "{name}: {cond}"
        );
        guards.push(Netns::guard(&format!("fv-{}", g.uid)));
        guests.insert(name, g);
    }
    let booted = started.elapsed();
    let (g1, g2) = (&guests["g1"], &guests["g2"]);
    // Different host subnets (one per node).
    assert_ne!(
        g1.ip.rsplit_once('.').map(|x| x.0),
        g2.ip.rsplit_once('.').map(|x| x.0),
        "{} {}",
        g1.ip,
        g2.ip
    );
    let t = Instant::now();
    let (ok, out) = pings(g1, &g2.ip, 10)?;
    assert!(ok, "g1 -> g2: {out}");
    let (ok, out) = pings(g2, &g1.ip, 3)?;
    assert!(ok, "g2 -> g1: {out}");
    let pinged = t.elapsed();
    // Each node's network namespace routes the other node's host subnet through the VXLAN
    // device (no bridge port), and holds its own host subnet's gateway on the bridge.
    let mut routes = Vec::new();
    for (node, other) in [(&node_a, &g2.ip), (&node_b, &g1.ip)] {
        let ns = udn_namespaces(node)?;
        assert_eq!(ns.len(), 1, "{}", node.name());
        let out = std::process::Command::new("ip")
            .args(["-n", &ns[0], "route", "show", "dev", "udn-vx0"])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let subnet = format!("{}.0/24", other.rsplit_once('.').map(|x| x.0).unwrap_or(""));
        assert!(
            text.contains(&subnet) && text.contains("onlink"),
            "{}: {text}",
            node.name()
        );
        let out = std::process::Command::new("ip")
            .args(["-n", &ns[0], "link", "show", "udn-vx0"])
            .output()?;
        let link = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(!link.contains("master"), "{link}");
        routes.push(text.trim().to_string());
    }

    let (g1_ip, g2_ip) = (g1.ip.clone(), g2.ip.clone());
    let uids: Vec<String> = guests.values().map(|g| g.uid.clone()).collect();
    drop(guests);
    for (name, _) in vms {
        c.kubectl_ok(&["delete", "vmi", name, "-n", "l3", "--wait=false"])?;
    }
    wait_vmi_netns_gone(&c, &uids, Duration::from_secs(120))?;
    for node in [&node_a, &node_b] {
        c.wait_until(
            "the network's namespaces removed",
            Duration::from_secs(60),
            || Ok(udn_namespaces(node)?.is_empty().then_some(())),
        )?;
    }
    eprintln!(
        "g1 {} g2 {}; routes {routes:?}; guests leased and Running after {booted:?}; g1<->g2 \
         pinged in {pinged:?}; whole test {:?}",
        g1_ip,
        g2_ip,
        started.elapsed()
    );
    drop(guards);
    Ok(())
}
