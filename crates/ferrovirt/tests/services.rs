//! Services to VMs (issue #23) with real guests on two pod-network nodes (network namespaces
//! A and B joined by a veth the test makes): a NodePort Service in front of web1 (node A) and
//! web2 (node B) answers from node A's address and spreads over both; a ClusterIP Service
//! answers a third VM (client, node A); stopping web2 removes it from the EndpointSlice and
//! the traffic goes to web1 only; `ferrovirt expose vm` makes a Service selecting the VM's
//! template labels. `kubectl get svc,endpointslices` prints Kubernetes' columns.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use ferrovirt_testkit::netns::{Netns, NodePair, wait_vmi_netns_gone};
use ferrovirt_testkit::{Cluster, SerialConsole, TestGuest};

const BOOT: Duration = Duration::from_secs(180);
const A_IP: &str = "192.168.252.1";
const B_IP: &str = "192.168.252.2";
const B_CIDR: &str = "10.244.210.0/24";

fn vm_yaml(name: &str, node: &str, app: &str) -> String {
    format!(
        r##"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {name}, namespace: default}}
spec:
  runStrategy: Always
  template:
    metadata:
      labels: {{app: {app}, kubevirt.io/domain: {name}}}
    spec:
      nodeSelector: {{kubernetes.io/hostname: {node}}}
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - {{name: root, disk: {{bus: virtio}}}}
          - {{name: ci, disk: {{bus: virtio}}}}
          interfaces:
          - name: default
            masquerade: {{}}
            ports: [{{name: http, port: 80}}]
      networks:
      - {{name: default, pod: {{}}}}
      volumes:
      - {{name: root, persistentVolumeClaim: {{claimName: {name}-root}}}}
      - {{name: ci, cloudInitNoCloud: {{userData: "#!/bin/sh\ntrue\n"}}}}
"##
    )
}

/// `hostname=` of the page at `url`, fetched from inside namespace `ns`.
fn fetch_in(ns: &Netns, url: &str) -> Option<String> {
    let out = ns.exec(&["curl", "-s", "--max-time", "5", url]).ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix("hostname=").map(|h| h.trim().to_string()))
}

fn slice_addresses(c: &Cluster) -> anyhow::Result<Vec<String>> {
    let l = c.get_json(&["endpointslices", "-l", "kubernetes.io/service-name=web"])?;
    Ok(l["items"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
        .filter(|e| e["conditions"]["ready"] == true)
        .filter_map(|e| e["addresses"][0].as_str().map(String::from))
        .collect())
}

#[test]
fn node_port_and_cluster_ip_reach_vms_and_follow_their_state() -> anyhow::Result<()> {
    let started = Instant::now();
    TestGuest::get()?;
    let pair = NodePair::new("fvs", A_IP, B_IP)?;
    let c = pair.start_cluster(env!("CARGO_BIN_EXE_ferrovirt"), [A_IP, B_IP], B_CIDR)?;
    let NodePair {
        a: node_a,
        b: _node_b,
    } = pair;
    for (name, node, app) in [
        ("web1", "node-a", "web"),
        ("web2", "node-b", "web"),
        ("client", "node-a", "client"),
    ] {
        c.guest_disk_claim(&format!("{name}-root"))?;
        c.apply(&vm_yaml(name, node, app))?;
    }
    c.kubectl_ok(&[
        "create",
        "service",
        "nodeport",
        "web",
        "--tcp=80:http",
        "--node-port=30080",
    ])?;
    // kubectl create service selects app=<name>.
    let svc = c.get_json(&["svc", "web"])?;
    assert_eq!(svc["spec"]["selector"]["app"], "web", "{svc}");
    let cluster_ip = svc["spec"]["clusterIP"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(cluster_ip.starts_with("10.96."), "{svc}");

    let mut ips = Vec::new();
    for name in ["web1", "web2", "client"] {
        let v = c.wait_until(&format!("VMI {name} Running with an address"), BOOT, || {
            let v = c.get_json(&["vmi", name])?;
            let ok = v["status"]["phase"] == "Running"
                && v["status"]["interfaces"][0]["ipAddress"].is_string();
            Ok(ok.then_some(v))
        })?;
        ips.push(
            v["status"]["interfaces"][0]["ipAddress"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        );
    }
    let booted = started.elapsed();
    let both: BTreeSet<String> = ips[..2].iter().cloned().collect();
    c.wait_until("both web VMIs in the EndpointSlice", BOOT, || {
        let got: BTreeSet<String> = slice_addresses(&c)?.into_iter().collect();
        Ok((got == both).then_some(()))
    })?;
    let table = c.kubectl_ok(&["get", "svc,endpointslices"])?;
    assert!(
        table.contains("NAME")
            && table.contains("TYPE")
            && table.contains("CLUSTER-IP")
            && table.contains("PORT(S)")
            && table.contains("80:30080/TCP"),
        "{table}"
    );
    assert!(
        table.contains("ADDRESSTYPE") && table.contains("IPv4"),
        "{table}"
    );

    // NodePort on node A's address, spread over both VMs (web2 through the overlay).
    let url = format!("http://{A_IP}:30080/");
    let seen = c.wait_until("NodePort answers from both VMs", BOOT, || {
        let mut seen = BTreeSet::new();
        for _ in 0..16 {
            if let Some(h) = fetch_in(&node_a, &url) {
                seen.insert(h);
            }
        }
        Ok((seen.len() == 2).then_some(seen))
    })?;
    assert_eq!(
        seen,
        ["web1", "web2"].map(String::from).into_iter().collect()
    );

    // ClusterIP from the third VM.
    let uid = c.get_json(&["vmi", "client"])?["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let dir = c.agent_dir().join("vmis").join(&uid);
    c.wait_until("client ready", BOOT, || {
        let log = std::fs::read(dir.join("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    let body = c.wait_until(
        "ClusterIP answers the client VM",
        Duration::from_secs(60),
        || {
            let (out, rc) = console.exec(
                &format!("wget -qO- http://{cluster_ip}/"),
                Duration::from_secs(20),
            )?;
            Ok((rc == 0 && out.contains("hostname=web")).then_some(out))
        },
    )?;
    assert!(body.contains("hostname=web"), "{body}");

    // `ferrovirt expose vm` selects the template labels; the named target port resolves.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrovirt"))
        .args([
            "expose",
            "vm",
            "web1",
            "--port",
            "8080",
            "--target-port",
            "http",
            "--name",
            "web1-http",
            "--kubeconfig",
        ])
        .arg(&c.kubeconfig)
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let exposed = c.get_json(&["svc", "web1-http"])?;
    assert_eq!(
        exposed["spec"]["selector"]["kubevirt.io/domain"], "web1",
        "{exposed}"
    );
    c.wait_until("web1-http's EndpointSlice", Duration::from_secs(30), || {
        let l = c.get_json(&[
            "endpointslices",
            "-l",
            "kubernetes.io/service-name=web1-http",
        ])?;
        let s = &l["items"][0];
        Ok(
            (s["endpoints"][0]["addresses"][0] == ips[0].as_str() && s["ports"][0]["port"] == 80)
                .then_some(()),
        )
    })?;

    // Stopping web2 removes it from the slice; the traffic goes to web1 only.
    c.set_run_strategy("web2", "Halted")?;
    c.wait_until("web2 gone from the EndpointSlice", BOOT, || {
        let got = slice_addresses(&c)?;
        Ok((got == vec![ips[0].clone()]).then_some(()))
    })?;
    c.wait_until("the node table follows", Duration::from_secs(30), || {
        let out = node_a.exec(&["nft", "list", "ruleset"])?;
        let t = String::from_utf8_lossy(&out.stdout).into_owned();
        Ok((t.contains("mod 1 map") && !t.contains(&ips[1])).then_some(()))
    })?;
    for _ in 0..8 {
        assert_eq!(fetch_in(&node_a, &url).as_deref(), Some("web1"));
    }

    // Deleting the VMs leaves no VMI network namespace behind.
    let mut uids = Vec::new();
    for vm in ["web1", "client"] {
        let v = c.get_json(&["vmi", vm])?;
        uids.push(v["metadata"]["uid"].as_str().unwrap_or("?").to_string());
    }
    c.kubectl_ok(&["delete", "vm", "web1", "web2", "client", "--timeout=120s"])?;
    wait_vmi_netns_gone(&c, &uids, Duration::from_secs(60))?;
    eprintln!(
        "services e2e: VMs running after {booted:?}, whole test {:?}",
        started.elapsed()
    );
    Ok(())
}
