//! Several nodes on one machine: the server's embedded agent (node1) plus `ferrovirt agent`
//! processes (node2, node3) with their own data dirs. The scheduler honours nodeSelector, VMI
//! anti-affinity and taints, and explains an impossible request in an event; a VM on shared
//! (RWX) storage runs again on another node within 60 s of its node dying (agent and launchers
//! killed), never with two QEMUs on its disk; a node cut off from the control plane fences its
//! self-fencing VMs by the lease deadline (docs/fencing.md); with two servers on one etcd, killing the
//! controllers' leader hands reconciliation to the other server within the lease time.

use std::time::{Duration, Instant};

use ferrovirt_testkit::cluster::pids_matching;
use ferrovirt_testkit::{Cluster, ClusterOptions, Etcd, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(180);

fn three_nodes() -> anyhow::Result<Cluster> {
    TestGuest::get()?;
    let mut c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    c.start_agent("node2")?;
    c.start_agent("node3")?;
    c.wait_until("three Ready nodes", Duration::from_secs(60), || {
        let v = c.get_json(&["nodes"])?;
        let ready = v["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|n| {
                n["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
            .count();
        Ok((ready == 3).then_some(()))
    })?;
    Ok(c)
}

/// A VM (runStrategy Always) booting the test guest from claim `claim`, with extra template
/// spec lines (`affinity`, `nodeSelector`, …) inserted verbatim at template-spec level.
fn vm(name: &str, claim: &str, labels: &str, extra_spec: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {name}, namespace: default}}
spec:
  runStrategy: Always
  template:
    metadata:
      labels: {{{labels}}}
    spec:
      terminationGracePeriodSeconds: 10
{extra_spec}
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - name: root
            disk: {{bus: virtio}}
      volumes:
      - name: root
        persistentVolumeClaim: {{claimName: {claim}}}
"#
    )
}

fn vmi_node(c: &Cluster, name: &str) -> anyhow::Result<Option<String>> {
    let out = c.kubectl(&["get", "vmi", name, "-o", "json"])?;
    if !out.status.success() {
        return Ok(None);
    }
    let v: Value = serde_json::from_slice(&out.stdout)?;
    Ok(v["status"]["nodeName"].as_str().map(String::from))
}

fn wait_bound(c: &Cluster, name: &str) -> anyhow::Result<String> {
    c.wait_until(
        &format!("VMI {name} scheduled"),
        Duration::from_secs(60),
        || vmi_node(c, name),
    )
}

#[test]
fn scheduler_places_by_selector_anti_affinity_and_taints_and_explains_refusals()
-> anyhow::Result<()> {
    let c = three_nodes()?;
    c.kubectl_ok(&["label", "node", "node2", "disktype=ssd"])?;
    c.kubectl_ok(&["taint", "node", "node3", "dedicated=gpu:NoSchedule"])?;
    for claim in ["sel", "anti-a", "anti-b", "never"] {
        c.guest_disk_claim(claim)?;
    }
    // nodeSelector → the labelled node.
    c.apply(&vm(
        "sel",
        "sel",
        "app: sel",
        "      nodeSelector: {disktype: ssd}",
    ))?;
    assert_eq!(wait_bound(&c, "sel")?, "node2");
    // Two VMIs that must not share a node, and node3 is tainted: they take node1 and node2.
    let anti = "      affinity:\n        podAntiAffinity:\n          requiredDuringSchedulingIgnoredDuringExecution:\n          - labelSelector: {matchLabels: {app: web}}\n            topologyKey: kubernetes.io/hostname";
    c.apply(&vm("anti-a", "anti-a", "app: web", anti))?;
    let a = wait_bound(&c, "anti-a")?;
    c.apply(&vm("anti-b", "anti-b", "app: web", anti))?;
    let b = wait_bound(&c, "anti-b")?;
    assert_ne!(a, b, "anti-affinity put both VMIs on {a}");
    assert!(
        a != "node3" && b != "node3",
        "a tainted node was used: {a} {b}"
    );
    // Impossible: a selector no node matches. The VMI stays unscheduled and an event says why.
    c.apply(&vm(
        "never",
        "never",
        "app: never",
        "      nodeSelector: {disktype: nvme}",
    ))?;
    let msg = c.wait_until("a FailedScheduling event", Duration::from_secs(60), || {
        let ev = c.get_json(&["events", "--field-selector", "involvedObject.name=never"])?;
        Ok(ev["items"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["reason"] == "FailedScheduling")
            .and_then(|e| e["message"].as_str().map(String::from)))
    })?;
    assert!(msg.starts_with("0/3 nodes are available"), "{msg}");
    assert!(msg.contains("didn't match node selector"), "{msg}");
    assert_eq!(vmi_node(&c, "never")?, None);
    let vm = c.get_json(&["vm", "never"])?;
    assert_eq!(
        vm["status"]["printableStatus"], "ErrorUnschedulable",
        "{vm}"
    );
    Ok(())
}

#[test]
fn vm_on_shared_storage_recovers_on_another_node_within_60s() -> anyhow::Result<()> {
    let mut c = three_nodes()?;
    // Keep the VM off node1 (the server's own agent) so that killing a node never kills the
    // control plane; it may land on node2 or node3.
    c.kubectl_ok(&["taint", "node", "node1", "controlplane=yes:NoSchedule"])?;
    let dir = c.guest_disk_claim("shared-root")?;
    // Shared storage: the volume is ReadWriteMany, so the VM may move between nodes.
    c.kubectl_ok(&[
        "patch",
        "pv",
        "pv-shared-root",
        "--type=merge",
        "-p",
        r#"{"spec":{"accessModes":["ReadWriteMany"]}}"#,
    ])?;
    c.kubectl_ok(&[
        "patch",
        "pvc",
        "shared-root",
        "--type=merge",
        "-p",
        r#"{"spec":{"accessModes":["ReadWriteMany"]}}"#,
    ])
    .ok();
    c.apply(&vm("mover", "shared-root", "app: mover", ""))?;
    let first = c.wait_until("VMI Running", BOOT, || {
        let v = c.get_json(&["vmi", "mover"])?;
        Ok((v["status"]["phase"] == "Running").then(|| {
            (
                v["status"]["nodeName"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                v["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        }))
    })?;
    let (dead, uid1) = first;
    assert_ne!(dead, "node1");
    let disk = dir.join("disk.img").display().to_string();
    let holders = || -> usize {
        pids_matching(&disk)
            .into_iter()
            .filter(|p| {
                std::fs::read(format!("/proc/{p}/cmdline"))
                    .map(|c| String::from_utf8_lossy(&c).starts_with("qemu-system"))
                    .unwrap_or(false)
            })
            .count()
    };
    assert_eq!(holders(), 1);

    // The node dies: its agent and all its launchers and QEMUs are killed.
    c.kill_agent(&dead)?;
    let t0 = Instant::now();
    let mut max_holders = 0;
    let moved = c.wait_until(
        "the VM running on another node",
        Duration::from_secs(90),
        || {
            max_holders = max_holders.max(holders());
            let v = c.get_json(&["vmi", "mover"])?;
            let node = v["status"]["nodeName"].as_str().unwrap_or_default();
            let uid = v["metadata"]["uid"].as_str().unwrap_or_default();
            Ok(
                (v["status"]["phase"] == "Running" && uid != uid1 && node != dead)
                    .then(|| node.to_string()),
            )
        },
    )?;
    let took = t0.elapsed();
    eprintln!("VM moved from {dead} to {moved} in {took:?}");
    assert!(took < Duration::from_secs(60), "recovery took {took:?}");
    assert!(
        max_holders <= 1,
        "{max_holders} QEMUs held the disk at once"
    );
    assert_eq!(holders(), 1);
    Ok(())
}

#[test]
fn second_server_on_etcd_takes_over_the_controllers_when_the_leader_dies() -> anyhow::Result<()> {
    let etcd = Etcd::start()?;
    let endpoint = etcd.endpoint();
    let mut oa = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
    oa.node_name = None;
    oa.extra_args = vec!["--datastore-endpoint".into(), endpoint.clone()];
    let mut a = Cluster::start(&oa)?;
    let mut ob = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
    ob.node_name = Some("node-b".into());
    ob.extra_args = vec!["--datastore-endpoint".into(), endpoint];
    ob.seed_from = Some(a.data_dir.clone());
    let b = Cluster::start(&ob)?;
    // A started first and holds the controllers' lease.
    let holder = b.wait_until("a lease holder", Duration::from_secs(30), || {
        let l = b.get_json(&["lease", "-n", "kube-system", "ferrovirt-controllers"])?;
        Ok(l["spec"]["holderIdentity"].as_str().map(String::from))
    })?;
    a.kill_server()?;
    let t0 = Instant::now();
    b.guest_disk_claim("after")?;
    b.apply(&vm("after-failover", "after", "app: x", ""))?;
    b.wait_until(
        "the VM reconciled by the second server",
        Duration::from_secs(60),
        || vmi_node(&b, "after-failover"),
    )?;
    let took = t0.elapsed();
    let now_holder = b.get_json(&["lease", "-n", "kube-system", "ferrovirt-controllers"])?["spec"]
        ["holderIdentity"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_ne!(now_holder, holder, "the lease did not move");
    eprintln!("failover: VMI created and scheduled {took:?} after the leader died");
    assert!(took < Duration::from_secs(30), "took {took:?} (lease 15 s)");
    Ok(())
}

#[test]
fn agent_that_cannot_renew_its_lease_fences_its_vms() -> anyhow::Result<()> {
    TestGuest::get()?;
    let mut c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    // 8 s node Leases (the default is 16 s), asked of the HyperConverged before node2 starts.
    c.patch_hco(r#"{"spec":{"nodeFailure":{"leaseDurationSeconds":8}}}"#)?;
    c.start_agent("node2")?;
    c.wait_until("node2 registered", Duration::from_secs(60), || {
        Ok(c.kubectl(&["get", "node", "node2"])?
            .status
            .success()
            .then_some(()))
    })?;
    c.wait_until(
        "node2's Lease renewed for 8 s",
        Duration::from_secs(30),
        || {
            let l = c.get_json(&["lease", "-n", "kube-node-lease", "node2"])?;
            Ok((l["spec"]["leaseDurationSeconds"] == 8).then_some(()))
        },
    )?;
    c.kubectl_ok(&["taint", "node", "node1", "controlplane=yes:NoSchedule"])?;
    c.guest_disk_claim("fenced-root")?;
    let rwx = r#"{"spec":{"accessModes":["ReadWriteMany"]}}"#;
    c.kubectl_ok(&["patch", "pv", "pv-fenced-root", "--type=merge", "-p", rwx])?;
    c.kubectl_ok(&["patch", "pvc", "fenced-root", "--type=merge", "-p", rwx])
        .ok();
    c.apply(&vm("fenced", "fenced-root", "app: f", ""))?;
    let uid = c.wait_until("VMI Running on node2", BOOT, || {
        let v = c.get_json(&["vmi", "fenced"])?;
        Ok(
            (v["status"]["phase"] == "Running" && v["status"]["nodeName"] == "node2").then(|| {
                v["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            }),
        )
    })?;
    let needle = c.extra_agent_dir("node2").join("vmis").join(&uid);
    let qemu = || {
        pids_matching(&needle.display().to_string())
            .into_iter()
            .filter(|p| {
                std::fs::read(format!("/proc/{p}/cmdline"))
                    .map(|c| String::from_utf8_lossy(&c).starts_with("qemu-system"))
                    .unwrap_or(false)
            })
            .count()
    };
    assert_eq!(qemu(), 1);
    // Keep the VMI once it ends (no restart), to read how it ended.
    c.kubectl_ok(&[
        "patch",
        "vm",
        "fenced",
        "--type=merge",
        "-p",
        r#"{"spec":{"runStrategy":"Manual"}}"#,
    ])?;
    // The control plane goes away: node2's agent can no longer renew its lease (8 s, renewed
    // every 2 s). The VM was started self-fencing (runStrategy Always on a claim usable from
    // another node, as announced on the VMI): its launcher kills QEMU by the deadline.
    assert_eq!(
        c.get_json(&["vmi", "fenced"])?["metadata"]["annotations"]["ferrovirt.io/fencing"],
        "enabled"
    );
    c.kill_server()?;
    let t0 = Instant::now();
    while qemu() > 0 && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let took = t0.elapsed();
    assert_eq!(
        qemu(),
        0,
        "the isolated node did not fence its VM within 60 s"
    );
    assert!(
        took >= Duration::from_secs(5),
        "fenced after {took:?}, before the lease could have expired"
    );
    assert!(took < Duration::from_secs(12), "fenced only after {took:?}");
    eprintln!("the launcher fenced its VM {took:?} after the API server went away");
    // The fenced VM did not finish its work: once the control plane is back, the VMI ends
    // Failed (Fenced from the agent, or NodeUnresponsive from the node controller), never
    // Succeeded.
    // The launcher writes its exit report just after QEMU is gone: give it a moment.
    let exit_file = needle.join("exit.json");
    let t1 = Instant::now();
    while !exit_file.exists() && t1.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let exit: Value = serde_json::from_slice(&std::fs::read(&exit_file)?)?;
    assert_eq!(exit["reason"], "Fenced", "{exit}");
    c.restart_server()?;
    let st = c.wait_until("the fenced VMI final", Duration::from_secs(60), || {
        let v = c.get_json(&["vmi", "fenced"])?;
        assert_eq!(v["metadata"]["uid"], uid.as_str(), "the VMI was replaced");
        let phase = v["status"]["phase"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert_ne!(phase, "Succeeded", "a fenced VMI reported Succeeded: {v}");
        Ok((phase == "Failed").then(|| v["status"].clone()))
    })?;
    let reason = st["reason"].as_str().unwrap_or_default();
    assert!(["Fenced", "NodeUnresponsive"].contains(&reason), "{st}");
    eprintln!("fenced VMI: Failed ({reason})");
    Ok(())
}
