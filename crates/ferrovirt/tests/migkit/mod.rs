//! Helpers shared by the live-migration end-to-end tests (`migration.rs`,
//! `migration_postcopy.rs`, `migration_block_restart.rs`): two nodes, a claim holding the test guest, the VM and VMIM
//! manifests, where a VMI's QEMU runs, its guest's uptime, waiting for a migration's phases.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;
use std::time::Duration;

use ferrovirt_testkit::console::SerialConsole;
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use serde_json::Value;

pub const BOOT: Duration = Duration::from_secs(120);
pub const MIGRATE: Duration = Duration::from_secs(60);

pub fn two_nodes() -> anyhow::Result<Cluster> {
    TestGuest::get()?;
    Cluster::with_nodes(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")), 2)
}

/// A claim holding the test guest's disk; `shared`: ReadWriteMany.
pub fn claim(c: &Cluster, name: &str, shared: bool) -> anyhow::Result<PathBuf> {
    let dir = c.guest_disk_claim(name)?;
    if shared {
        let rwx = r#"{"spec":{"accessModes":["ReadWriteMany"]}}"#;
        c.kubectl_ok(&[
            "patch",
            "pv",
            &format!("pv-{name}"),
            "--type=merge",
            "-p",
            rwx,
        ])?;
        c.kubectl_ok(&["patch", "pvc", name, "--type=merge", "-p", rwx])
            .ok();
    }
    Ok(dir)
}

/// A `local` claim `name` whose PV holds the test guest's disk (grown to 1 GiB) in `node`'s
/// volume root; its directory.
pub fn local_claim(c: &Cluster, name: &str, node: &str) -> anyhow::Result<PathBuf> {
    let g = TestGuest::get()?;
    let pv = format!("pv-{name}");
    let dir = node_dir(c, node).join("volumes").join(&pv);
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(&g.disk_raw, dir.join("disk.img"))?;
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("disk.img"))?
        .set_len(1 << 30)?;
    c.apply(&format!(
        r#"
apiVersion: v1
kind: PersistentVolume
metadata:
  name: {pv}
  annotations: {{pv.kubernetes.io/provisioned-by: ferrovirt.io/local}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: local
  local: {{path: {dir}}}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions:
        - {{key: kubernetes.io/hostname, operator: In, values: [{node}]}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {name}, namespace: default}}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: local
  resources: {{requests: {{storage: 1Gi}}}}
  volumeName: {pv}
"#,
        dir = dir.display()
    ))?;
    Ok(dir)
}

/// The MigrationPolicy `slow`: 4 MiB/s for the VMIs labelled `speed: slow` ([`vm`]'s).
pub fn slow_policy(c: &Cluster) -> anyhow::Result<()> {
    c.apply(
        r#"
apiVersion: migrations.kubevirt.io/v1alpha1
kind: MigrationPolicy
metadata: {name: slow}
spec:
  bandwidthPerMigration: 4Mi
  selectors:
    virtualMachineInstanceSelector: {speed: slow}
"#,
    )?;
    Ok(())
}

/// Waits until the guest whose VMI directory is `dir` printed that it is ready.
pub fn guest_ready(c: &Cluster, dir: &std::path::Path) -> anyhow::Result<()> {
    c.wait_until("the guest ready", BOOT, || {
        let log = std::fs::read(dir.join("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })
}

pub fn vm(name: &str, claim: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {name}, namespace: default}}
spec:
  runStrategy: Always
  template:
    metadata:
      labels: {{speed: slow}}
    spec:
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

pub fn migration(name: &str, vmi: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstanceMigration
metadata: {{name: {name}, namespace: default}}
spec: {{vmiName: {vmi}}}
"#
    )
}

/// The agent data dir of `node`.
pub fn node_dir(c: &Cluster, node: &str) -> PathBuf {
    if node == "node1" {
        c.agent_dir()
    } else {
        c.extra_agent_dir(node)
    }
}

/// The VMI once Running; (uid, node).
pub fn running(c: &Cluster, name: &str) -> anyhow::Result<(String, String)> {
    c.wait_until(&format!("{name} Running"), BOOT, || {
        let v = c.get_json(&["vmi", name])?;
        if v["status"]["phase"] == "Failed" {
            anyhow::bail!("{name} failed: {}", v["status"]);
        }
        Ok((v["status"]["phase"] == "Running").then(|| {
            (
                v["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                v["status"]["nodeName"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        }))
    })
}

/// The guest's uptime in seconds, read on a new connection to its serial console at `dir`.
pub fn uptime(dir: &std::path::Path) -> anyhow::Result<f64> {
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    uptime_on(&console)
}

/// The guest's uptime in seconds, read on `console`.
pub fn uptime_on(console: &SerialConsole) -> anyhow::Result<f64> {
    let (out, rc) = console.exec("cat /proc/uptime", Duration::from_secs(20))?;
    anyhow::ensure!(rc == 0, "cat /proc/uptime: {out}");
    let first = out
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse::<f64>().ok())
        .next_back();
    first.ok_or_else(|| anyhow::anyhow!("no uptime in {out:?}"))
}

/// The pid of the QEMU running from `dir`, if any.
pub fn qemu_in(dir: &std::path::Path) -> Option<u32> {
    let needle = dir.display().to_string();
    ferrovirt_testkit::cluster::pids_matching(&needle)
        .into_iter()
        .find(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).starts_with("qemu-system"))
                .unwrap_or(false)
        })
}

/// Waits until migration `name` is final; returns it.
pub fn finished(c: &Cluster, name: &str, timeout: Duration) -> anyhow::Result<Value> {
    c.wait_until(&format!("migration {name} finished"), timeout, || {
        let v = c.get_json(&["vmim", name])?;
        let phase = v["status"]["phase"].as_str().unwrap_or_default();
        Ok(matches!(phase, "Succeeded" | "Failed").then_some(v))
    })
}

pub fn other(node: &str) -> &'static str {
    if node == "node1" { "node2" } else { "node1" }
}

/// Checks the VMI runs on `to` after a migration from `from`: node, label, state, the QEMU
/// on `to` only, the guest's uptime past `before`; returns the uptime read.
pub fn check_moved(
    c: &Cluster,
    uid: &str,
    from: &str,
    to: &str,
    before: f64,
) -> anyhow::Result<f64> {
    let v = c.get_json(&["vmi", "mig"])?;
    assert_eq!(v["metadata"]["uid"], uid, "the same VMI, not a replacement");
    assert_eq!(v["status"]["nodeName"], to);
    assert_eq!(v["metadata"]["labels"]["kubevirt.io/nodeName"], to);
    let st = &v["status"]["migrationState"];
    assert_eq!(st["completed"], true, "{st}");
    assert_eq!(st["sourceNode"], from);
    assert_eq!(st["targetNode"], to);
    assert_eq!(v["status"]["migrationMethod"], "LiveMigration");
    let src = node_dir(c, from).join("vmis").join(uid);
    let dst = node_dir(c, to).join("vmis").join(uid);
    c.wait_until("the source QEMU gone", Duration::from_secs(20), || {
        Ok(qemu_in(&src).is_none().then_some(()))
    })?;
    assert!(qemu_in(&dst).is_some(), "the QEMU runs on {to}");
    // The ordinary reconcile on the target reports it Running there.
    c.wait_until(
        "the VMI Running on the target",
        Duration::from_secs(20),
        || {
            let v = c.get_json(&["vmi", "mig"])?;
            Ok((v["status"]["phase"] == "Running" && v["status"]["nodeName"] == to).then_some(()))
        },
    )?;
    let after = uptime(&dst)?;
    assert!(
        after > before,
        "the guest did not reboot: uptime {before} s before, {after} s after"
    );
    Ok(after)
}

/// Waits until migration `name` is Running and sending; returns the VMI's migration state.
pub fn sending(c: &Cluster, name: &str) -> anyhow::Result<Value> {
    c.wait_until(&format!("migration {name} Running"), MIGRATE, || {
        let m = c.get_json(&["vmim", name])?;
        anyhow::ensure!(
            m["status"]["phase"] != "Failed" && m["status"]["phase"] != "Succeeded",
            "{name} ended early: {}",
            m["status"]
        );
        if m["status"]["phase"] != "Running" {
            return Ok(None);
        }
        Ok(Some(
            c.get_json(&["vmi", "mig"])?["status"]["migrationState"].clone(),
        ))
    })
}
