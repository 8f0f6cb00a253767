//! Live migration of a VMI booted from a containerDisk, end to end (docs/migration.md
//! "Node-local disks"). Two nodes (the server's node1 and an agent node2), Debian's
//! `docker-registry` on 127.0.0.1 holding the test guest as a containerDisk image. The VMI
//! also has a cloud-init NoCloud disk. The guest writes a marker into its root disk (the
//! writable overlay over the node's cached image); a VirtualMachineInstanceMigration moves it
//! to the other node: the target pulls the image into its own cache and makes a fresh
//! overlay, the source mirrors the disk into it over NBD, then the memory. After the move the
//! guest has not rebooted, reads its marker back from the copied overlay with its page cache
//! dropped, and still reads its cloud-init data from the disk regenerated on the target.

use std::time::{Duration, Instant};

use ferrovirt_testkit::console::SerialConsole;
use ferrovirt_testkit::{Cluster, ClusterOptions, Registry, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(180);
const MIGRATE: Duration = Duration::from_secs(300);
/// Written by the guest at 26 MiB into its 27 MiB root disk, read back after the move.
const MARKER: &str = "FERROVIRT-OVERLAY-MIGRATED-DATA";
/// In the cloud-init user data; the guest finds it on its cloud-init disk before and after.
const CLOUD_INIT_MARKER: &str = "FERROVIRT-CLOUD-INIT-DATA";

fn two_nodes() -> anyhow::Result<Cluster> {
    TestGuest::get()?;
    Cluster::with_nodes(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")), 2)
}

fn node_dir(c: &Cluster, node: &str) -> std::path::PathBuf {
    if node == "node1" {
        c.agent_dir()
    } else {
        c.extra_agent_dir(node)
    }
}

/// The guest's uptime in seconds.
fn uptime(console: &SerialConsole) -> anyhow::Result<f64> {
    let (out, rc) = console.exec("cat /proc/uptime", Duration::from_secs(20))?;
    anyhow::ensure!(rc == 0, "cat /proc/uptime: {out}");
    out.lines()
        .filter_map(|l| l.split_whitespace().next()?.parse::<f64>().ok())
        .next_back()
        .ok_or_else(|| anyhow::anyhow!("no uptime in {out:?}"))
}

/// Whether the guest finds the cloud-init marker on its second disk (page cache dropped).
fn reads_cloud_init(console: &SerialConsole) -> anyhow::Result<bool> {
    let (out, _) = console.exec(
        &format!("echo 3 > /proc/sys/vm/drop_caches; grep -c {CLOUD_INIT_MARKER} /dev/vdb"),
        Duration::from_secs(30),
    )?;
    Ok(out
        .lines()
        .any(|l| l.trim().parse::<u32>().is_ok_and(|n| n > 0)))
}

#[test]
fn a_container_disk_vm_migrates_with_its_overlay_and_cloud_init() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let reg = Registry::start()?;
    reg.push_disk("fv/guest", "v1", &guest.disk_qcow2, "guest.qcow2", false)?;
    let c = two_nodes()?;
    c.apply(&format!(
        r##"
apiVersion: v1
kind: Namespace
metadata: {{name: kubevirt-hyperconverged}}
---
apiVersion: hco.kubevirt.io/v1beta1
kind: HyperConverged
metadata: {{name: kubevirt-hyperconverged, namespace: kubevirt-hyperconverged}}
spec:
  storageImport:
    insecureRegistries: ["{reg}"]
---
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: cdmig, namespace: default}}
spec:
  terminationGracePeriodSeconds: 5
  domain:
    memory: {{guest: 128Mi}}
    devices:
      disks:
      - name: root
        disk: {{bus: virtio}}
      - name: ci
        disk: {{bus: virtio}}
  volumes:
  - name: root
    containerDisk: {{image: "{reg}/fv/guest:v1", imagePullPolicy: IfNotPresent}}
  - name: ci
    cloudInitNoCloud: {{userData: "#cloud-config\n# {CLOUD_INIT_MARKER}\n"}}
"##,
        reg = reg.addr
    ))?;
    let uid = c.wait_booted("cdmig", BOOT)?;
    let v = c.get_json(&["vmi", "cdmig"])?;
    let from = v["status"]["nodeName"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let to = if from == "node1" { "node2" } else { "node1" };
    let src = node_dir(&c, &from).join("vmis").join(&uid);
    let dst = node_dir(&c, to).join("vmis").join(&uid);
    c.wait_until("LiveMigratable=True", Duration::from_secs(30), || {
        let v = c.get_json(&["vmi", "cdmig"])?;
        Ok(v["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "LiveMigratable" && c["status"] == "True")
            .then_some(()))
    })?;

    // The guest writes into its overlay and flushes; it reads its cloud-init disk.
    let console = SerialConsole::connect(&src.join("serial.sock"), Duration::from_secs(10))?;
    let (out, rc) = console.exec(
        &format!("echo {MARKER} | dd of=/dev/vda bs=1M seek=26 conv=fsync 2>&1; sync"),
        Duration::from_secs(30),
    )?;
    assert_eq!(rc, 0, "{out}");
    assert!(
        reads_cloud_init(&console)?,
        "cloud-init data on node {from}"
    );
    let before = uptime(&console)?;
    drop(console);

    let t0 = Instant::now();
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstanceMigration
metadata: {name: cdmig-1, namespace: default}
spec: {vmiName: cdmig}
"#,
    )?;
    let m: Value = c.wait_until("the migration finished", MIGRATE, || {
        let v = c.get_json(&["vmim", "cdmig-1"])?;
        let phase = v["status"]["phase"].as_str().unwrap_or_default();
        Ok(matches!(phase, "Succeeded" | "Failed").then_some(v))
    })?;
    eprintln!(
        "containerDisk migration {from} → {to} took {:?}",
        t0.elapsed()
    );
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    let v = c.get_json(&["vmi", "cdmig"])?;
    assert_eq!(v["metadata"]["uid"], uid.as_str(), "the same VMI");
    assert_eq!(v["status"]["nodeName"], to);
    assert_eq!(v["status"]["migrationMethod"], "BlockMigration");
    // The target pulled the image into its own cache and runs on its own overlay.
    assert!(
        dst.join("containerdisk-root.qcow2").exists(),
        "an overlay in the target's VMI directory"
    );
    let cache = node_dir(&c, to).join("containerdisks");
    assert!(cache.exists(), "the target's image cache at {cache:?}");

    let console = SerialConsole::connect(&dst.join("serial.sock"), Duration::from_secs(10))?;
    let after = uptime(&console)?;
    assert!(after > before, "no reboot: uptime {before} s → {after} s");
    let (out, rc) = console.exec(
        "echo 3 > /proc/sys/vm/drop_caches; dd if=/dev/vda bs=1M skip=26 count=1 2>/dev/null | head -c 64",
        Duration::from_secs(30),
    )?;
    assert_eq!(rc, 0, "{out}");
    assert!(out.contains(MARKER), "the overlay's data on {to}: {out:?}");
    assert!(reads_cloud_init(&console)?, "cloud-init data on node {to}");
    Ok(())
}
