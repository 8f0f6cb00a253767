//! Services on a Primary Layer2 UserDefinedNetwork (issues #22/#23; docs/networking.md
//! "Services on Primary user-defined networks") with real guests on two namespace nodes
//! (no uplink: the networks' gateway is there for DHCP and Services, nothing leaves).
//! Namespaces `ua` and `ub` each have a Primary Layer2 UDN on the SAME subnet 10.100.0.0/24.
//! Guest s (ua, node A) serves HTTP behind the ClusterIP Service `ua/web`; its EndpointSlice
//! lists s's UDN address and is marked `k8s.ovn.org/endpointslice-network: ua_net`. Guest c
//! (ua, node B) gets s's page through the ClusterIP (DNATed in ua's network namespace on node
//! B, across the nodes to s); guest u (ub, node B, same subnet) does not, nor do the nodes'
//! own namespaces (the pod network side); only ua's network namespaces carry the rule; a
//! NodePort Service in ua gets a Warning Event `NodePortNotCarriedOut`. Then,
//! on the same cluster, a Primary Layer3 UDN (namespace `l3`): guest c3 (node B) gets the pages
//! of s3 (node A, another host subnet) and t3 (node B) through the ClusterIP of `l3/web`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ferrovirt_testkit::netns::{Netns, NodePair};
use ferrovirt_testkit::{Cluster, SerialConsole, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(240);
const A_IP: &str = "192.168.243.1";
const B_IP: &str = "192.168.243.2";
const B_CIDR: &str = "10.244.210.0/24";
const GATEWAY: &str = "10.100.0.1";

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
"#
    )
}

/// A PV with a copy of the test guest's disk and the claim `<vm>-root` in `ns` bound to it.
fn disk_claim(c: &Cluster, ns: &str, vm: &str) -> anyhow::Result<()> {
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
  volumeName: pv-{ns}-{vm}
"#,
        dir = dir.display()
    ))?;
    Ok(())
}

fn vm_yaml(ns: &str, name: &str, node: &str, app: &str) -> String {
    format!(
        r##"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {name}, namespace: {ns}}}
spec:
  runStrategy: Always
  template:
    metadata:
      labels: {{app: {app}}}
    spec:
      nodeSelector: {{kubernetes.io/hostname: {node}}}
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - {{name: root, disk: {{bus: virtio}}}}
          - {{name: ci, disk: {{bus: virtio}}}}
          interfaces:
          - {{name: default, binding: {{name: l2bridge}}}}
      networks:
      - {{name: default, pod: {{}}}}
      volumes:
      - {{name: root, persistentVolumeClaim: {{claimName: {name}-root}}}}
      - {{name: ci, cloudInitNoCloud: {{userData: "#!/bin/sh\ntrue\n"}}}}
"##
    )
}

/// The VMI `ns/name` Running with an address in status.
fn wait_running(c: &Cluster, ns: &str, name: &str) -> anyhow::Result<Value> {
    c.wait_until(
        &format!("VMI {ns}/{name} Running with an address"),
        BOOT,
        || {
            let out = c.kubectl(&["get", "vmi", name, "-n", ns, "-o", "json"])?;
            if !out.status.success() {
                return Ok(None);
            }
            let v: Value = serde_json::from_slice(&out.stdout)?;
            if v["status"]["phase"] == "Failed" {
                anyhow::bail!("VMI {ns}/{name} failed: {}", v["status"]["conditions"]);
            }
            let ok = v["status"]["phase"] == "Running"
                && v["status"]["interfaces"][0]["ipAddress"].is_string();
            Ok(ok.then_some(v))
        },
    )
}

/// The guest's console once it is ready, and its DHCP lease line.
fn console(c: &Cluster, v: &Value, node_dir: PathBuf) -> anyhow::Result<(SerialConsole, String)> {
    let uid = v["metadata"]["uid"].as_str().unwrap_or_default();
    let dir = node_dir.join("vmis").join(uid);
    let lease = c.wait_until("guest ready with its lease", BOOT, || {
        let log = std::fs::read(dir.join("serial.log")).unwrap_or_default();
        let log = String::from_utf8_lossy(&log).into_owned();
        if !log.contains("FERROVIRT-READY") {
            return Ok(None);
        }
        Ok(log
            .lines()
            .find(|l| l.contains("FERROVIRT-DHCP eth0"))
            .map(String::from))
    })?;
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    Ok((console, lease))
}

fn wget(g: &SerialConsole, url: &str) -> anyhow::Result<(String, i32)> {
    g.exec(
        // busybox's wget -T crashes in the test guest: bounded by timeout(1) instead.
        &format!("timeout 6 wget -qO- {url} 2>&1"),
        Duration::from_secs(20),
    )
}

/// The network namespaces of user-defined networks on the host, with their Service table.
fn udn_tables() -> anyhow::Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/run/netns")? {
        let name = e?.file_name().to_string_lossy().into_owned();
        if !name.starts_with("fvn-") {
            continue;
        }
        let t = std::process::Command::new("ip")
            .args(["netns", "exec", &name, "nft", "list", "table", "ip"])
            .arg("ferrovirt-udnsvc")
            .output()?;
        out.push((name, String::from_utf8_lossy(&t.stdout).into_owned()));
    }
    Ok(out)
}

/// The network namespaces' Service state and node B's agent log, for a failure message.
fn diagnose(c: &Cluster, nodes: &[&str]) -> String {
    let mut out = String::new();
    for e in std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("fvn-") || !nodes.iter().any(|n| name.ends_with(n)) {
            continue;
        }
        for cmd in [
            "nft list ruleset",
            "ip rule",
            "ip route show table all",
            "ip -br link",
            "ip neigh",
            "cat /proc/sys/net/bridge/bridge-nf-call-iptables",
        ] {
            let argv: Vec<&str> = cmd.split(' ').collect();
            if let Ok(o) = std::process::Command::new("ip")
                .args(["netns", "exec", &name])
                .args(&argv)
                .output()
            {
                out.push_str(&format!(
                    "--- {name}: {cmd}\n{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                ));
            }
        }
    }
    let log = c.agent_log("node-b");
    let tail: Vec<&str> = log.lines().filter(|l| l.contains("udn")).collect();
    out.push_str(&format!(
        "--- node-b agent (udn lines)\n{}",
        tail.join("\n")
    ));
    out
}

#[test]
fn cluster_ip_on_a_primary_udn_reaches_its_network_only() -> anyhow::Result<()> {
    let started = Instant::now();
    TestGuest::get()?;
    let pair = NodePair::new("fvw", A_IP, B_IP)?;
    let c = pair.start_cluster(env!("CARGO_BIN_EXE_ferrovirt"), [A_IP, B_IP], B_CIDR)?;
    let NodePair {
        a: node_a,
        b: node_b,
    } = pair;
    for ns in ["ua", "ub"] {
        c.apply(&udn_yaml(ns))?;
    }
    let vms = [
        ("ua", "s", "node-a", "web"),
        ("ua", "c", "node-b", "client"),
        ("ub", "u", "node-b", "web"),
    ];
    for (ns, name, node, app) in vms {
        disk_claim(&c, ns, name)?;
        c.apply(&vm_yaml(ns, name, node, app))?;
    }
    // The Service selects app=web in ua (u in ub has the same label and stays out).
    c.kubectl_ok(&[
        "create",
        "service",
        "clusterip",
        "web",
        "--tcp=80:80",
        "-n",
        "ua",
    ])?;
    let svc = c.get_json(&["svc", "web", "-n", "ua"])?;
    let cip = svc["spec"]["clusterIP"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(cip.starts_with("10.96."), "{svc}");

    let mut guests = Vec::new();
    let mut guards = Vec::new();
    for (ns, name, node, _) in vms {
        let v = wait_running(&c, ns, name)?;
        let ip = v["status"]["interfaces"][0]["ipAddress"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(ip.starts_with("10.100.0."), "{name}: {ip}");
        let dir = match node {
            "node-a" => c.agent_dir(),
            _ => c.extra_agent_dir("node-b"),
        };
        let (con, lease) = console(&c, &v, dir)?;
        // No uplink, yet the network has its gateway (DHCP router).
        assert!(
            lease.contains(&format!("ip={ip}/24 router={GATEWAY}")),
            "{name}: {lease}"
        );
        guards.push(Netns::guard(&format!(
            "fv-{}",
            v["metadata"]["uid"].as_str().unwrap_or_default()
        )));
        guests.push((ip, con));
    }
    // The networks' namespaces go with the test, whatever its outcome.
    for (n, _) in udn_tables()? {
        if n.ends_with(node_a.name()) || n.ends_with(node_b.name()) {
            guards.push(Netns::guard(&n));
        }
    }
    let booted = started.elapsed();
    let [(s_ip, _), (_, con_c), (_, con_u)] = &guests[..] else {
        unreachable!()
    };

    // The slice lists s's UDN address, marked with ua's network.
    let slice = c.wait_until("ua/web's EndpointSlice", Duration::from_secs(60), || {
        let l = c.get_json(&[
            "endpointslices",
            "-n",
            "ua",
            "-l",
            "kubernetes.io/service-name=web",
        ])?;
        let s = l["items"][0].clone();
        Ok((s["endpoints"][0]["addresses"][0] == s_ip.as_str()
            && s["endpoints"][0]["conditions"]["ready"] == true)
            .then_some(s))
    })?;
    assert_eq!(
        slice["metadata"]["annotations"]["k8s.ovn.org/endpointslice-network"], "ua_net",
        "{slice}"
    );

    // c (node B) reaches s (node A) through the ClusterIP.
    let url = format!("http://{cip}/");
    let t = Instant::now();
    let body = c
        .wait_until("the ClusterIP answers c", Duration::from_secs(60), || {
            let (out, rc) = wget(con_c, &url)?;
            Ok((rc == 0 && out.contains("hostname=s")).then_some(out))
        })
        .map_err(|e| anyhow::anyhow!("{e}\n{}", diagnose(&c, &[node_a.name(), node_b.name()])))?;
    let first_answer = t.elapsed();
    assert!(body.contains("hostname=s"), "{body}");
    for _ in 0..3 {
        let (out, rc) = wget(con_c, &url)?;
        assert!(rc == 0 && out.contains("hostname=s"), "{out}");
    }

    // u (ub, same subnet, same node as c): its network works (the gateway answers), the
    // ClusterIP of ua does not.
    let (out, rc) = con_u.exec(
        &format!("ping -c 2 -W 2 {GATEWAY}"),
        Duration::from_secs(20),
    )?;
    assert_eq!(rc, 0, "u -> its gateway: {out}");
    for _ in 0..2 {
        let (out, rc) = wget(con_u, &url)?;
        assert!(
            rc != 0 && !out.contains("hostname="),
            "u (ub) reached ua's Service: {out}"
        );
    }
    // The nodes' own namespaces (the pod network side) neither.
    for node in [&node_a, &node_b] {
        let out = node.exec(&["curl", "-s", "--max-time", "3", &url])?;
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(!text.contains("hostname="), "{}: {text}", node.name());
        let rules = node.exec(&["nft", "list", "ruleset"])?;
        let rules = String::from_utf8_lossy(&rules.stdout);
        assert!(!rules.contains(s_ip.as_str()), "{}: {rules}", node.name());
    }
    // Only ua's network namespaces carry the Service (node B's, where c is; node A's, s's).
    let tables = udn_tables()?;
    let with: Vec<&String> = tables
        .iter()
        .filter(|(n, t)| {
            (n.ends_with(node_a.name()) || n.ends_with(node_b.name())) && t.contains(&cip)
        })
        .map(|(n, _)| n)
        .collect();
    assert_eq!(with.len(), 2, "{tables:?}");
    // ub's network on node B (no Service there): neither the table nor the Service link
    // (nor br_netfilter, set with the link).
    let without: Vec<&(String, String)> = tables
        .iter()
        .filter(|(n, t)| n.ends_with(node_b.name()) && !t.contains(&cip))
        .collect();
    assert_eq!(without.len(), 1, "{tables:?}");
    for (n, t) in without {
        assert!(t.trim().is_empty(), "{n}: {t}");
        let links = std::process::Command::new("ip")
            .args(["netns", "exec", n, "ip", "-br", "link"])
            .output()?;
        let links = String::from_utf8_lossy(&links.stdout);
        assert!(links.contains("udn-br0"), "{n}: {links}");
        assert!(!links.contains("udn-svc"), "{n}: {links}");
    }
    // A NodePort Service there: said not carried out (a Warning Event on the Service).
    c.kubectl_ok(&[
        "create",
        "service",
        "nodeport",
        "webnp",
        "--tcp=80:80",
        "-n",
        "ua",
    ])?;
    let ev = c.wait_until(
        "the NodePort refusal Event",
        Duration::from_secs(30),
        || {
            let l = c.get_json(&["events", "-n", "ua"])?;
            Ok(l["items"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|e| e["reason"] == "NodePortNotCarriedOut")
                .cloned())
        },
    )?;
    assert_eq!(ev["involvedObject"]["name"], "webnp", "{ev}");
    assert_eq!(ev["type"], "Warning", "{ev}");
    let layer2_done = started.elapsed();
    // Layer3 on the same cluster, the Layer2 guests out of the way.
    for (ns, vm) in [("ua", "s"), ("ua", "c"), ("ub", "u")] {
        c.kubectl_ok(&["delete", "vm", vm, "-n", ns, "--wait=false"])?;
    }
    layer3(&c, &[node_a.name(), node_b.name()], &mut guards)?;
    eprintln!(
        "udn_services e2e: Layer2 guests ready after {booted:?}, first ClusterIP answer after \
         {first_answer:?}, Layer2 part {layer2_done:?}, whole test {:?}",
        started.elapsed()
    );
    Ok(())
}

/// Layer3: guests s3 (node A) and t3 (node B) behind the ClusterIP Service `l3/web`; guest c3
/// (node B) gets the pages of both: DNATed in node B's namespace of the network, to s3 routed
/// through `udn-vx0` to node A's host subnet and back, to t3 on node B's own bridge (the reply
/// bridged, un-DNATed by br_netfilter).
fn layer3(c: &Cluster, nodes: &[&str], guards: &mut Vec<Netns>) -> anyhow::Result<()> {
    let t = Instant::now();
    c.apply(
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
"#,
    )?;
    let vms = [
        ("s3", "node-a", "web"),
        ("t3", "node-b", "web"),
        ("c3", "node-b", "client"),
    ];
    for (name, node, app) in vms {
        disk_claim(c, "l3", name)?;
        c.apply(&vm_yaml("l3", name, node, app))?;
    }
    c.kubectl_ok(&[
        "create",
        "service",
        "clusterip",
        "web",
        "--tcp=80:80",
        "-n",
        "l3",
    ])?;
    let cip = c.get_json(&["svc", "web", "-n", "l3"])?["spec"]["clusterIP"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let mut g = Vec::new();
    for (name, node, _) in vms {
        let v = wait_running(c, "l3", name)?;
        let ip = v["status"]["interfaces"][0]["ipAddress"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(ip.starts_with("10.150."), "{name}: {ip}");
        guards.push(Netns::guard(&format!(
            "fv-{}",
            v["metadata"]["uid"].as_str().unwrap_or_default()
        )));
        let dir = match node {
            "node-a" => c.agent_dir(),
            _ => c.extra_agent_dir("node-b"),
        };
        let (con, _) = console(c, &v, dir)?;
        g.push((ip, con));
    }
    for (n, _) in udn_tables()? {
        if nodes.iter().any(|x| n.ends_with(x)) && !guards.iter().any(|gd| gd.name() == n) {
            guards.push(Netns::guard(&n));
        }
    }
    let [(s3_ip, _), (t3_ip, _), (c3_ip, con_c3)] = &g[..] else {
        unreachable!()
    };
    // Two host subnets: the Service crosses a routed hop.
    let subnet = |ip: &str| ip.rsplit_once('.').map(|(a, _)| a.to_string());
    assert_ne!(subnet(s3_ip), subnet(c3_ip), "{s3_ip} {c3_ip}");
    let want: std::collections::BTreeSet<&str> = [s3_ip.as_str(), t3_ip.as_str()].into();
    let slice = c.wait_until("l3/web's EndpointSlice", Duration::from_secs(60), || {
        let l = c.get_json(&[
            "endpointslices",
            "-n",
            "l3",
            "-l",
            "kubernetes.io/service-name=web",
        ])?;
        let s = l["items"][0].clone();
        let ready: std::collections::BTreeSet<&str> = s["endpoints"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["conditions"]["ready"] == true)
            .filter_map(|e| e["addresses"][0].as_str())
            .collect();
        Ok((ready == want).then(|| s.clone()))
    })?;
    assert_eq!(
        slice["metadata"]["annotations"]["k8s.ovn.org/endpointslice-network"], "l3_net",
        "{slice}"
    );
    let url = format!("http://{cip}/");
    // Both endpoints answer: s3 across the nodes, t3 on c3's own node.
    let mut seen = std::collections::BTreeSet::new();
    c.wait_until(
        "the Layer3 ClusterIP answers c3 from s3 and t3",
        Duration::from_secs(90),
        || {
            let (out, rc) = wget(con_c3, &url)?;
            if rc == 0 {
                for h in ["s3", "t3"] {
                    if out.contains(&format!("hostname={h}")) {
                        seen.insert(h);
                    }
                }
            }
            Ok((seen.len() == 2).then_some(()))
        },
    )
    .map_err(|e| anyhow::anyhow!("{e} (seen {seen:?})\n{}", diagnose(c, nodes)))?;
    eprintln!("udn_services e2e: Layer3 part {:?}", t.elapsed());
    Ok(())
}
