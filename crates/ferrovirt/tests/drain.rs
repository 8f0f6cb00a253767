//! Eviction and drain end to end (docs/migration.md "Eviction and drain"), with the real
//! kubectl: VMIs appear as launcher Pods (`kubectl get pods`, label and field selectors);
//! `kubectl drain` of a node running two LiveMigrate VMs on shared storage live-migrates both
//! to other nodes (the guests keep their uptime) and ends with the node cordoned; a VM whose
//! disk cannot migrate is never evicted (429 naming the reason); a `kubevirt.io/drain` taint
//! moves a LiveMigrate VM away by itself; draining a node under a VM with evictionStrategy None
//! stops the VMI and its VM starts it again on another node.

use std::time::Duration;

use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(180);
const MOVE: Duration = Duration::from_secs(240);

fn cluster(nodes: usize) -> anyhow::Result<Cluster> {
    TestGuest::get()?;
    Cluster::with_nodes(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")), nodes)
}

/// A VM (runStrategy Always) booting the test guest from `claim`.
fn vm(name: &str, claim: &str, strategy: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {name}, namespace: default}}
spec:
  runStrategy: Always
  template:
    metadata:
      labels: {{app: drain-test}}
    spec:
      evictionStrategy: {strategy}
      terminationGracePeriodSeconds: 5
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

/// The VMI once Running and LiveMigratable is decided: (uid, node).
fn running(c: &Cluster, name: &str) -> anyhow::Result<(String, String)> {
    c.wait_until(&format!("{name} Running"), BOOT, || {
        let v = c.get_json(&["vmi", name])?;
        if v["status"]["phase"] == "Failed" {
            anyhow::bail!("{name} failed: {}", v["status"]);
        }
        let decided = v["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "LiveMigratable");
        Ok((v["status"]["phase"] == "Running" && decided).then(|| {
            let s = |p: &str| {
                v.pointer(p)
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string()
            };
            (s("/metadata/uid"), s("/status/nodeName"))
        }))
    })
}

/// Waits until the guest of `uid` on `node` printed its ready marker; its uptime then.
fn booted_uptime(c: &Cluster, node: &str, uid: &str) -> anyhow::Result<f64> {
    let log = c.node_dir(node).join("vmis").join(uid).join("serial.log");
    c.wait_until("the guest ready", BOOT, || {
        let text = std::fs::read(&log).unwrap_or_default();
        Ok(String::from_utf8_lossy(&text)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    c.guest_uptime(node, uid)
}

fn launcher_pods(c: &Cluster, extra: &[&str]) -> anyhow::Result<Vec<Value>> {
    let mut args = vec!["pods", "-A", "-l", "kubevirt.io=virt-launcher"];
    args.extend_from_slice(extra);
    let v = c.get_json(&args)?;
    Ok(v["items"].as_array().cloned().unwrap_or_default())
}

fn pod_name_of(c: &Cluster, vmi: &str) -> anyhow::Result<String> {
    let pods = launcher_pods(c, &[])?;
    pods.iter()
        .find(|p| p["metadata"]["labels"]["vm.kubevirt.io/name"] == vmi)
        .and_then(|p| p["metadata"]["name"].as_str().map(String::from))
        .ok_or_else(|| anyhow::anyhow!("no launcher Pod of {vmi} in {pods:?}"))
}

fn drain(c: &Cluster, node: &str) -> anyhow::Result<std::process::Output> {
    c.kubectl(&[
        "drain",
        node,
        "--ignore-daemonsets",
        "--delete-emptydir-data",
        "--pod-selector=kubevirt.io=virt-launcher",
        "--timeout=300s",
    ])
}

#[test]
fn kubectl_drain_live_migrates_two_vms_away_and_refuses_one_that_cannot_move() -> anyhow::Result<()>
{
    let c = cluster(3)?;
    // Both VMs on node2: the others cordoned while they start.
    c.kubectl_ok(&["cordon", "node1", "node3"])?;
    for n in ["d1", "d2"] {
        c.shared_guest_disk_claim(n)?;
        c.apply(&vm(n, n, "LiveMigrate"))?;
    }
    let mut before = Vec::new();
    for n in ["d1", "d2"] {
        let (uid, node) = running(&c, n)?;
        assert_eq!(node, "node2", "{n} placed on the only uncordoned node");
        let up = booted_uptime(&c, &node, &uid)?;
        before.push((n, uid, up));
    }
    c.kubectl_ok(&["uncordon", "node1", "node3"])?;

    // The launcher Pod views: labels, owner, node; field and label selectors; table output.
    let pods = launcher_pods(&c, &["--field-selector", "spec.nodeName=node2"])?;
    assert_eq!(pods.len(), 2, "{pods:?}");
    for p in &pods {
        let vmi = p["metadata"]["labels"]["vm.kubevirt.io/name"]
            .as_str()
            .unwrap_or_default();
        let (_, uid, _) = before.iter().find(|b| b.0 == vmi).expect("a pod per VMI");
        assert_eq!(
            p["metadata"]["labels"]["kubevirt.io/created-by"],
            uid.as_str()
        );
        assert_eq!(
            p["metadata"]["ownerReferences"][0]["kind"],
            "VirtualMachineInstance"
        );
        assert_eq!(p["metadata"]["ownerReferences"][0]["controller"], true);
        assert_eq!(p["status"]["phase"], "Running");
        assert!(
            p["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .starts_with(&format!("virt-launcher-{vmi}-"))
        );
    }
    assert!(launcher_pods(&c, &["--field-selector", "spec.nodeName=node1"])?.is_empty());
    let table = c.kubectl_ok(&["get", "pods", "-o", "wide"])?;
    assert!(
        table.contains("virt-launcher-d1-") && table.contains("node2"),
        "{table}"
    );
    let old_pods: Vec<String> = pods
        .iter()
        .filter_map(|p| p["metadata"]["name"].as_str().map(String::from))
        .collect();
    // Deleting a launcher Pod is refused, naming the way to do it.
    let del = c.kubectl(&["delete", "pod", &old_pods[0]])?;
    assert!(!del.status.success());
    let err = String::from_utf8_lossy(&del.stderr);
    assert!(err.contains("evict"), "{err}");

    let out = drain(&c, "node2")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "kubectl drain failed:\n{text}\n{}",
        c.server_log()
    );
    // kubectl evicts both, is told to retry (429) while they migrate, and ends when their
    // Pods are gone (404).
    assert!(text.contains("node/node2 drained"), "{text}");
    for p in &old_pods {
        assert!(
            text.contains(&format!("evicting pod default/{p}")),
            "{text}"
        );
    }
    assert!(
        text.contains("Eviction triggered evacuation of VMI default/d1"),
        "kubectl was told to retry: {text}"
    );

    for (n, uid, up) in &before {
        let v = c.get_json(&["vmi", n])?;
        assert_eq!(
            v["metadata"]["uid"],
            uid.as_str(),
            "the same VMI, not a replacement"
        );
        assert_eq!(v["status"]["phase"], "Running");
        let node = v["status"]["nodeName"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(node == "node1" || node == "node3", "{n} moved to {node}");
        assert_eq!(v["status"]["migrationState"]["completed"], true);
        let after = c.guest_uptime(&node, uid)?;
        assert!(
            after > *up,
            "{n}: uptime {after} after the drain, {up} before: rebooted?"
        );
        c.wait_until("the evacuation mark cleared", MOVE, || {
            let v = c.get_json(&["vmi", n])?;
            Ok(v["status"]
                .get("evacuationNodeName")
                .is_none()
                .then_some(()))
        })?;
    }
    let node2 = c.get_json(&["node", "node2"])?;
    assert_eq!(
        node2["spec"]["unschedulable"], true,
        "drain cordons the node"
    );
    assert!(launcher_pods(&c, &["--field-selector", "spec.nodeName=node2"])?.is_empty());
    let now: Vec<String> = launcher_pods(&c, &[])?
        .iter()
        .filter_map(|p| p["metadata"]["name"].as_str().map(String::from))
        .collect();
    assert!(
        old_pods.iter().all(|p| !now.contains(p)),
        "new placements are new Pods: {now:?}"
    );
    let events = c.kubectl_ok(&[
        "get",
        "events",
        "--field-selector",
        "involvedObject.name=d1",
    ])?;
    assert!(events.contains("EvictionTriggeredEvacuation"), "{events}");
    assert!(events.contains("EvacuationMigrationCreated"), "{events}");

    // A VM on a node-local (ReadWriteOnce) disk with LiveMigrate: never evicted.
    c.guest_disk_claim("local")?;
    c.apply(&vm("pinned", "local", "LiveMigrate"))?;
    let (uid, node) = running(&c, "pinned")?;
    let pod = pod_name_of(&c, "pinned")?;
    let path = format!("/api/v1/namespaces/default/pods/{pod}/eviction");
    let body = c.dir().join("eviction.json");
    std::fs::write(
        &body,
        format!(
            r#"{{"apiVersion":"policy/v1","kind":"Eviction","metadata":{{"name":"{pod}","namespace":"default"}}}}"#
        ),
    )?;
    let out = c.kubectl(&["create", "--raw", &path, "-f", &body.display().to_string()])?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("TooManyRequests") || err.contains("429"),
        "{err}"
    );
    assert!(
        err.contains("not live-migratable") && err.contains("DisksNotLiveMigratable"),
        "{err}"
    );
    let v = c.get_json(&["vmi", "pinned"])?;
    assert_eq!(v["metadata"]["uid"], uid.as_str());
    assert_eq!(v["status"]["nodeName"], node.as_str());
    assert!(
        v["status"].get("evacuationNodeName").is_none(),
        "not marked"
    );
    Ok(())
}

#[test]
fn a_drain_taint_moves_a_vm_and_an_eviction_stops_a_none_vm() -> anyhow::Result<()> {
    let c = cluster(2)?;
    c.shared_guest_disk_claim("t1")?;
    c.apply(&vm("t1", "t1", "LiveMigrate"))?;
    let (uid, from) = running(&c, "t1")?;
    let up = booted_uptime(&c, &from, &uid)?;
    c.kubectl_ok(&[
        "taint",
        "nodes",
        &from,
        "kubevirt.io/drain=draining:NoSchedule",
    ])?;
    let to = c.wait_until("t1 moved off the tainted node", MOVE, || {
        let v = c.get_json(&["vmi", "t1"])?;
        let node = v["status"]["nodeName"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        Ok((node != from && v["status"]["phase"] == "Running").then_some(node))
    })?;
    let v = c.get_json(&["vmi", "t1"])?;
    assert_eq!(v["metadata"]["uid"], uid.as_str());
    let after = c.guest_uptime(&to, &uid)?;
    assert!(after > up, "uptime {after} after, {up} before: rebooted?");
    let vmims = c.get_json(&["vmim"])?;
    let evac = vmims["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["metadata"]["annotations"]["kubevirt.io/evacuationMigration"] == from.as_str())
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no evacuation migration: {vmims}"))?;
    assert!(
        evac["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .starts_with("kubevirt-evacuation-")
    );
    assert_eq!(evac["status"]["phase"], "Succeeded");
    c.kubectl_ok(&["taint", "nodes", &from, "kubevirt.io/drain-"])?;

    // evictionStrategy None: `kubectl drain` evicts the Pod, the VMI is stopped and the VM
    // (runStrategy Always) starts a new one on the other node.
    c.shared_guest_disk_claim("n1")?;
    c.apply(&vm("n1", "n1", "None"))?;
    let (uid, node) = running(&c, "n1")?;
    let out = drain(&c, &node)?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "kubectl drain failed:\n{text}");
    let (new_uid, new_node) = c.wait_until("n1 running again elsewhere", BOOT, || {
        let v = c.get_json(&["vmi", "n1"]);
        let Ok(v) = v else { return Ok(None) };
        let s = |p: &str| {
            v.pointer(p)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        Ok(
            (s("/status/phase") == "Running" && s("/metadata/uid") != uid)
                .then(|| (s("/metadata/uid"), s("/status/nodeName"))),
        )
    })?;
    assert_ne!(new_uid, uid);
    assert_ne!(new_node, node, "not on the cordoned node");
    let events = c.kubectl_ok(&[
        "get",
        "events",
        "--field-selector",
        "involvedObject.name=n1",
    ])?;
    assert!(events.contains("Evicted"), "{events}");
    Ok(())
}
