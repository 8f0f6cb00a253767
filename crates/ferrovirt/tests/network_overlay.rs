//! The pod network across two nodes (issue #8, acceptance a, b, c, e): node A is the server's
//! embedded agent in network namespace A, node B a `ferrovirt agent` in namespace B, and an
//! underlay veth between A and B is made by the test. The node IPAM controller gives A its
//! podCIDR, B records its `--pod-cidr`, a third agent with an overlapping `--pod-cidr` is
//! refused, and the VXLAN overlay follows the Node objects (a removed Node's route and FDB
//! entry go). Three guests: a1 (masquerade) and a2 (bridge binding) on A, b1 (masquerade) on B;
//! a1 fetches a2's and b1's HTTP page by VMI address, b1 fetches a2's, `ferrovirt port-forward`
//! reaches all three through the API, the bridge-bound guest
//! holds its VMI address, and deleting the VMIs leaves no namespace or veth behind.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ferrovirt_testkit::netns::{Netns, NodePair, sh, wait_vmi_netns_gone};
use ferrovirt_testkit::{SerialConsole, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(180);
const A_IP: &str = "192.168.251.1";
const B_IP: &str = "192.168.251.2";
const C_IP: &str = "192.168.251.3";
const B_CIDR: &str = "10.244.200.0/24";

fn vmi_yaml(name: &str, node: &str, binding: &str) -> String {
    format!(
        r##"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: {name}, namespace: default}}
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
  networks:
  - {{name: default, pod: {{}}}}
  volumes:
  - {{name: root, persistentVolumeClaim: {{claimName: {name}-root}}}}
  - {{name: ci, cloudInitNoCloud: {{userData: "#!/bin/sh\ntrue\n"}}}}
"##
    )
}

/// The average of `ping`'s rtt summary line (`rtt min/avg/max/mdev = a/b/c/d ms`).
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

struct Guest {
    uid: String,
    ip: String,
    console: SerialConsole,
}

fn console_of(dir: PathBuf) -> anyhow::Result<SerialConsole> {
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    Ok(console)
}

/// `wget` from inside a guest; retried while the network settles.
fn guest_wget(g: &Guest, url: &str) -> anyhow::Result<String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (out, rc) = g
            .console
            .exec(&format!("wget -qO- {url}"), Duration::from_secs(20))?;
        if rc == 0 && out.contains("hostname=") {
            return Ok(out);
        }
        if Instant::now() > deadline {
            anyhow::bail!("wget {url} from the guest failed (rc {rc}): {out}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn two_nodes_overlay_bindings_and_cleanup() -> anyhow::Result<()> {
    let started = Instant::now();
    TestGuest::get()?;
    let pair = NodePair::new("fvo", A_IP, B_IP)?;
    let mut c = pair.start_cluster(env!("CARGO_BIN_EXE_ferrovirt"), [A_IP, B_IP], B_CIDR)?;
    let NodePair {
        a: node_a,
        b: node_b,
    } = pair;

    // Node subnets: A's from the node IPAM controller, B's recorded from --pod-cidr.
    let cidrs = c.wait_until("both nodes with a podCIDR", Duration::from_secs(60), || {
        let a = c.get_json(&["node", "node-a"])?;
        let b = c.get_json(&["node", "node-b"])?;
        let a = a["spec"]["podCIDR"].as_str().map(String::from);
        let b = b["spec"]["podCIDR"].as_str().map(String::from);
        Ok(a.zip(b))
    })?;
    assert!(
        cidrs.0.starts_with("10.244.") && cidrs.0.ends_with("/24"),
        "{cidrs:?}"
    );
    assert_eq!(cidrs.1, B_CIDR);
    let a_cidr = cidrs.0.clone();
    let node_b_obj = c.get_json(&["node", "node-b"])?;
    assert_eq!(node_b_obj["spec"]["podCIDRs"][0], B_CIDR);
    assert!(
        node_b_obj["status"]["addresses"]
            .as_array()
            .is_some_and(|a| a
                .iter()
                .any(|x| x["type"] == "InternalIP" && x["address"] == B_IP)),
        "{}",
        node_b_obj["status"]["addresses"]
    );

    // A third node asking for an overlapping subnet is refused with a clear error.
    c.start_agent_with(
        "node-c",
        &[
            "--pod-network",
            "--node-netns",
            node_b.name(),
            "--node-ip",
            C_IP,
            "--pod-cidr",
            "10.244.200.128/25",
        ],
    )?;
    let msg = c.wait_until("node-c refused", Duration::from_secs(30), || {
        let log = c.agent_log("node-c");
        Ok(log
            .lines()
            .find(|l| l.contains("overlaps"))
            .map(String::from))
    })?;
    assert!(
        msg.contains(
            "pod CIDR 10.244.200.128/25 of node node-c overlaps 10.244.200.0/24 of node node-b"
        ),
        "{msg}"
    );
    // node-c stays registered (address 192.168.251.3) and gets a subnet from the controller:
    // both overlays route to it until its Node is deleted.
    let c_cidr = c.wait_until("node-c's podCIDR", Duration::from_secs(30), || {
        Ok(c.get_json(&["node", "node-c"])?["spec"]["podCIDR"]
            .as_str()
            .map(String::from))
    })?;
    assert_ne!(c_cidr, B_CIDR);
    let routes_a = c.wait_until("A's overlay routes", Duration::from_secs(30), || {
        let r = node_a.ip(&["route", "show", "dev", "fv-vx0"])?;
        Ok((r.contains(B_CIDR) && r.contains(&c_cidr)).then_some(r))
    })?;
    assert!(
        routes_a.contains(&format!("{B_CIDR} via 10.244.200.0")),
        "{routes_a}"
    );
    c.kubectl_ok(&["delete", "node", "node-c"])?;
    let (routes_a, fdb_a) = c.wait_until(
        "node-c's route and FDB entry removed",
        Duration::from_secs(30),
        || {
            let r = node_a.ip(&["route", "show", "dev", "fv-vx0"])?;
            let f = node_a.bridge(&["fdb", "show", "dev", "fv-vx0"])?;
            Ok((!r.contains(&c_cidr) && !f.contains(C_IP)).then_some((r, f)))
        },
    )?;
    assert!(routes_a.contains(B_CIDR), "{routes_a}");
    assert!(fdb_a.contains(B_IP), "{fdb_a}");
    let b_routes = node_b.ip(&["route", "show", "dev", "fv-vx0"])?;
    assert!(b_routes.contains(&a_cidr), "{b_routes}");

    // VXLAN from an address that is no Node's InternalIP is dropped by node A (its drop
    // counter counts it); the peers' own VXLAN (the guests' traffic below) still flows.
    node_b.ip(&["addr", "add", "192.168.251.9/24", "dev", "under0"])?;
    let drops = |ns: &Netns| -> anyhow::Result<u64> {
        let out = ns.exec(&["nft", "list", "table", "ip", "ferrovirt-vxlan"])?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        Ok(text
            .split("counter packets ")
            .nth(1)
            .and_then(|t| t.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no VXLAN filter counter on node A: {text}")))
    };
    let filter = c.wait_until("A's VXLAN filter names B", Duration::from_secs(30), || {
        let out = node_a.exec(&["nft", "list", "table", "ip", "ferrovirt-vxlan"])?;
        let t = String::from_utf8_lossy(&out.stdout).into_owned();
        Ok((t.contains(B_IP) && !t.contains(C_IP)).then_some(t))
    })?;
    assert!(filter.contains("udp dport 4789 ip saddr != "), "{filter}");
    let before = drops(&node_a)?;
    let inject = node_b.exec(&[
        "python3",
        "-c",
        "import socket\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n\
         s.bind(('192.168.251.9',0))\n\
         [s.sendto(b'\\x08'+b'\\x00'*63,('192.168.251.1',4789)) for _ in range(5)]",
    ])?;
    assert!(inject.status.success(), "{inject:?}");
    let after = c.wait_until("the spoofed VXLAN counted", Duration::from_secs(10), || {
        let n = drops(&node_a)?;
        Ok((n >= before + 5).then_some(n))
    })?;
    eprintln!(
        "VXLAN from a non-node address: {} packets dropped",
        after - before
    );
    node_b.ip(&["addr", "del", "192.168.251.9/24", "dev", "under0"])?;

    // The nodes' nft rules before any VMI (per-VMI rules live in the VMI namespaces);
    // counters are left out of the comparison.
    let rules = |ns: &Netns| -> anyhow::Result<String> {
        let out = ns.exec(&["nft", "list", "ruleset"])?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        Ok(text
            .lines()
            .map(|l| match l.find("counter packets") {
                Some(i) => format!(
                    "{}counter{}",
                    &l[..i],
                    &l[l.find(" drop").unwrap_or(l.len())..]
                ),
                None => l.to_string(),
            })
            .collect::<Vec<_>>()
            .join("\n"))
    };
    let nft_before: Vec<String> = [&node_a, &node_b]
        .iter()
        .map(|n| rules(n))
        .collect::<anyhow::Result<_>>()?;
    assert!(
        nft_before[0].contains("table ip ferrovirt"),
        "{}",
        nft_before[0]
    );

    // Three guests.
    for (name, node, binding) in [
        ("a1", "node-a", "masquerade"),
        ("a2", "node-a", "bridge"),
        ("b1", "node-b", "masquerade"),
    ] {
        c.guest_disk_claim(&format!("{name}-root"))?;
        c.apply(&vmi_yaml(name, node, binding))?;
    }
    let mut vmis: BTreeMap<&str, Value> = BTreeMap::new();
    for name in ["a1", "a2", "b1"] {
        let v = c.wait_until(&format!("VMI {name} Running with an address"), BOOT, || {
            let v = c.get_json(&["vmi", name])?;
            let ok = v["status"]["phase"] == "Running"
                && v["status"]["interfaces"][0]["ipAddress"].is_string();
            Ok(ok.then_some(v))
        })?;
        vmis.insert(name, v);
    }
    let boot_done = started.elapsed();
    let mut guests: BTreeMap<&str, Guest> = BTreeMap::new();
    let mut guards = Vec::new();
    for (name, v) in &vmis {
        let uid = v["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let ip = v["status"]["interfaces"][0]["ipAddress"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let mac = v["status"]["interfaces"][0]["mac"]
            .as_str()
            .unwrap_or_default();
        assert!(mac.starts_with("02:"), "{mac}");
        let expect_net = if name.starts_with('a') {
            &a_cidr
        } else {
            B_CIDR
        };
        let prefix = expect_net.rsplit_once('.').map(|x| x.0).unwrap_or_default();
        assert!(
            ip.starts_with(&format!("{prefix}.")),
            "{name}: {ip} not in {expect_net}"
        );
        guards.push(Netns::guard(&format!("fv-{uid}")));
        let dir = if name.starts_with('a') {
            c.agent_dir()
        } else {
            c.extra_agent_dir("node-b")
        }
        .join("vmis")
        .join(&uid);
        c.wait_until(&format!("{name} ready"), BOOT, || {
            let log = std::fs::read(dir.join("serial.log")).unwrap_or_default();
            Ok(String::from_utf8_lossy(&log)
                .contains("FERROVIRT-READY")
                .then_some(()))
        })?;
        let console = console_of(dir)?;
        guests.insert(name, Guest { uid, ip, console });
    }
    // c) The bridge-bound guest leased the VMI's own address.
    let (out, _) = guests["a2"]
        .console
        .exec("ip -4 addr show dev eth0", Duration::from_secs(10))?;
    assert!(
        out.contains(&format!("inet {}/24", guests["a2"].ip)),
        "{out}"
    );
    let (out, _) = guests["a1"]
        .console
        .exec("ip -4 addr show dev eth0", Duration::from_secs(10))?;
    assert!(out.contains("inet 10.0.2.2/24"), "masquerade guest: {out}");

    // a) same node, b) across the overlay, in both directions.
    let body = guest_wget(&guests["a1"], &format!("http://{}/", guests["a2"].ip))?;
    assert!(body.contains("hostname=a2"), "{body}");
    let body = guest_wget(&guests["a1"], &format!("http://{}/", guests["b1"].ip))?;
    assert!(body.contains("hostname=b1"), "{body}");
    let body = guest_wget(&guests["b1"], &format!("http://{}/", guests["a2"].ip))?;
    assert!(body.contains("hostname=a2"), "{body}");

    let b = c.get_json(&["node", "node-b"])?;
    let url = b["metadata"]["annotations"]["ferrovirt.io/agent-endpoint"]
        .as_str()
        .unwrap_or_default();
    assert!(url.starts_with("https://127.0.0.1:"), "{url}");

    // port-forward through the API reaches a masquerade guest (from inside its namespace),
    // a bridge-bound guest (from node A's namespace) and a guest on the other node.
    for name in ["a1", "a2", "b1"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrovirt"))
            .arg("--kubeconfig")
            .arg(&c.kubeconfig)
            .args(["port-forward", "--stdio", &format!("vmi/{name}"), "80"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write;
                if let Some(mut i) = child.stdin.take() {
                    i.write_all(b"GET / HTTP/1.0\r\n\r\n")?;
                }
                child.wait_with_output()
            })?;
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains(&format!("hostname={name}")),
            "port-forward to {name}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // Latency, same node vs across nodes (TCG guests: numbers are for comparison only).
    let (same, _) = guests["a1"].console.exec(
        &format!("ping -c 10 -i 0.2 {}", guests["a2"].ip),
        Duration::from_secs(20),
    )?;
    let (cross, _) = guests["a1"].console.exec(
        &format!("ping -c 10 -i 0.2 {}", guests["b1"].ip),
        Duration::from_secs(20),
    )?;
    eprintln!(
        "RTT a1->a2 (same node) avg {:?} ms; a1->b1 (across the overlay) avg {:?} ms",
        ping_avg_ms(&same),
        ping_avg_ms(&cross)
    );
    assert!(ping_avg_ms(&same).is_some(), "{same}");
    assert!(ping_avg_ms(&cross).is_some(), "{cross}");

    // e) Deleting the VMIs leaves no namespace, veth or tap behind.
    let uids: Vec<String> = guests.values().map(|g| g.uid.clone()).collect();
    drop(guests);
    c.kubectl_ok(&["delete", "vmi", "a1", "a2", "b1", "--timeout=120s"])?;
    wait_vmi_netns_gone(&c, &uids, Duration::from_secs(60))?;
    for (i, node) in [&node_a, &node_b].into_iter().enumerate() {
        assert_eq!(rules(node)?, nft_before[i], "nft rules left behind");
        let links = c.wait_until("node veths removed", Duration::from_secs(30), || {
            let links = node.links()?;
            let left: Vec<&String> = links
                .iter()
                .filter(|l| l.starts_with("fv") && *l != "fv-br0" && *l != "fv-vx0")
                .collect();
            Ok(left.is_empty().then_some(links.clone()))
        })?;
        assert!(links.iter().any(|l| l == "fv-br0"), "{links:?}");
        let bridge_ports = sh(&[
            "ip",
            "-n",
            node.name(),
            "-o",
            "link",
            "show",
            "master",
            "fv-br0",
        ])?;
        assert!(bridge_ports.trim().is_empty(), "{bridge_ports}");
    }
    eprintln!(
        "VMIs Running after {boot_done:?}; whole test {:?}",
        started.elapsed()
    );
    drop(guards);
    Ok(())
}
