//! Incremental backups end to end (docs/backup.md "Incremental reads"), against the real
//! binary, kubectl and a TCG guest, to a filesystem target.
//!
//! A running VM has a node-local 1 GiB data disk filled with random bytes. Backup `b1` reads it
//! whole (no backup point yet: the reason is in the volume's status) and keeps its online
//! snapshot as the VM's backup point. The guest rewrites 51 MiB (5 %) of the disk with random
//! data at three offsets and syncs; backup `b2` reads and uploads at most 10 % of the disk (its
//! status: `incremental: true`, `baseBackup`, bytes read, reused and uploaded), and becomes the
//! point (b1's snapshot is deleted). The VM is stopped; a BackupRestore of `b2` gives a volume
//! whose SHA-256 equals the guest's disk as b2 read it (the stopped volume's chain flattened).
//! The point survives the VM's restart and a block migration: started again (a new VMI,
//! launcher and QEMU) and migrated to a second node (its chain, b2's point included, carried),
//! the guest writes 4 MiB and backup `b3` of the running VM reads only that chunk since b2's
//! point.
//! Fallback: b3's catalog entry is removed from the target; backup `b4` (of the stopped VM,
//! read directly) reads the disk whole, naming the missing backup in the volume's reason.

use std::process::Command;
use std::time::{Duration, Instant};

use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest, serve_files};

const BIN: &str = env!("CARGO_BIN_EXE_ferrovirt");
const BOOT: Duration = Duration::from_secs(180);
const STEP: Duration = Duration::from_secs(300);
const KEY: &str = "a-backup-key-of-32-bytes-000001";
const GIB: u64 = 1 << 30;

fn setup_yaml(store: &std::path::Path, url: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Secret
metadata: {{name: bk-key, namespace: default}}
stringData: {{key: "{KEY}"}}
---
apiVersion: backup.ferrovirt.io/v1alpha1
kind: BackupTarget
metadata: {{name: fs}}
spec: {{filesystem: {{path: "{}", prefix: e2e}}}}
---
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: inc-root, namespace: default}}
spec:
  source: {{http: {{url: "{url}"}}}}
  storage: {{resources: {{requests: {{storage: 64Mi}}}}}}
---
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: inc-data, namespace: default}}
spec:
  source: {{blank: {{}}}}
  storage: {{resources: {{requests: {{storage: 1Gi}}}}}}
"#,
        store.display()
    )
}

const VM: &str = r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: incvm, namespace: default}
spec:
  runStrategy: Always
  template:
    spec:
      domain:
        memory: {guest: 128Mi}
        devices:
          disks:
          - {name: root, disk: {bus: virtio}}
          - {name: data, disk: {bus: virtio}}
      volumes:
      - {name: root, dataVolume: {name: inc-root}}
      - {name: data, dataVolume: {name: inc-data}}
"#;

/// The volume directory of claim `pvc` (a `local` or hostPath PV on this machine).
fn volume_dir(c: &Cluster, pvc: &str) -> anyhow::Result<std::path::PathBuf> {
    let claim = c.get_json(&["pvc", pvc, "-n", "default"])?;
    let pv = c.get_json(&["pv", claim["spec"]["volumeName"].as_str().unwrap_or("")])?;
    let dir = pv["spec"]["local"]["path"]
        .as_str()
        .or(pv["spec"]["hostPath"]["path"].as_str())
        .unwrap_or("");
    anyhow::ensure!(!dir.is_empty(), "claim {pvc} has no volume directory: {pv}");
    Ok(dir.into())
}

/// SHA-256 (hex) of the first `len` bytes of `path`.
fn sha256(path: &std::path::Path, len: u64) -> anyhow::Result<String> {
    let out = Command::new("sh")
        .args([
            "-c",
            &format!("head -c {len} '{}' | sha256sum", path.display()),
        ])
        .output()?;
    anyhow::ensure!(out.status.success(), "sha256sum {}", path.display());
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_string())
}

/// Creates Backup `name` of the VM and waits for it to end; the object.
fn backup(c: &Cluster, name: &str) -> anyhow::Result<serde_json::Value> {
    c.apply(&format!(
        "apiVersion: backup.ferrovirt.io/v1alpha1\nkind: Backup\n\
         metadata: {{name: {name}, namespace: default}}\n\
         spec: {{target: fs, virtualMachines: [incvm], encryptionKeySecretRef: bk-key}}\n"
    ))?;
    c.wait_until(&format!("backup {name} finished"), STEP, || {
        let v = c.get_json(&["backup.backup.ferrovirt.io", name, "-n", "default"])?;
        let p = v["status"]["phase"].as_str().unwrap_or("");
        Ok((p == "Succeeded" || p == "Failed").then_some(v))
    })
}

/// The status of volume `claim` in Backup `b`.
fn volume<'a>(b: &'a serde_json::Value, claim: &str) -> &'a serde_json::Value {
    b["status"]["volumes"]
        .as_array()
        .and_then(|v| v.iter().find(|v| v["name"] == claim))
        .unwrap_or(&serde_json::Value::Null)
}

/// The VM's backup points (VirtualMachineSnapshots labelled as such).
fn points(c: &Cluster) -> anyhow::Result<Vec<String>> {
    let l = c.get_json(&[
        "virtualmachinesnapshot",
        "-n",
        "default",
        "-l",
        "backup.ferrovirt.io/vm=incvm,backup.ferrovirt.io/base=true",
    ])?;
    Ok(l["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["metadata"]["name"].as_str().map(str::to_string))
        .collect())
}

/// Waits until VM `incvm` runs with its guest's shell ready; the VMI's directory.
fn booted(c: &Cluster) -> anyhow::Result<std::path::PathBuf> {
    let uid = c.wait_booted("incvm", BOOT)?;
    let vmi_dir = c.agent_dir().join("vmis").join(&uid);
    c.wait_until("guest shell ready", BOOT, || {
        let log = std::fs::read(vmi_dir.join("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    Ok(vmi_dir)
}

#[test]
fn a_5_percent_change_reads_and_uploads_under_10_percent_and_restores_whole() -> anyhow::Result<()>
{
    let t0 = Instant::now();
    let guest = TestGuest::get()?;
    let store = tempfile::Builder::new().prefix("fv-bkinc-").tempdir()?;
    let mut c = Cluster::start(&ClusterOptions::new(BIN))?;
    let url = serve_files(vec![("disk.qcow2".into(), guest.disk_qcow2.clone())])? + "/disk.qcow2";
    c.apply(&setup_yaml(store.path(), &url))?;
    c.wait_until("DataVolumes Succeeded", STEP, || {
        let r = c.get_json(&["dv", "inc-root", "-n", "default"])?;
        let d = c.get_json(&["dv", "inc-data", "-n", "default"])?;
        Ok(
            (r["status"]["phase"] == "Succeeded" && d["status"]["phase"] == "Succeeded")
                .then_some(()),
        )
    })?;
    // 1 GiB of random bytes on the data disk, written on the host before the VM starts.
    let data_dir = volume_dir(&c, "inc-data")?;
    let filled = Command::new("dd")
        .args([
            "if=/dev/urandom",
            &format!("of={}", data_dir.join("disk.img").display()),
            "bs=4M",
            "count=256",
            "conv=notrunc,fsync",
            "status=none",
        ])
        .status()?;
    anyhow::ensure!(filled.success(), "filling the data disk");
    c.apply(VM)?;
    let vmi_dir = booted(&c)?;
    eprintln!(
        "[{:?}] VM running with a 1 GiB random data disk",
        t0.elapsed()
    );

    // b1: the first backup reads everything and keeps its snapshot as the backup point.
    let t = Instant::now();
    let b1 = backup(&c, "b1")?;
    let full_secs = t.elapsed().as_secs_f64();
    assert_eq!(b1["status"]["phase"], "Succeeded", "{b1}");
    let v1 = volume(&b1, "inc-data");
    assert_eq!(v1["incremental"], false, "{b1}");
    assert!(
        v1["fullReadReason"]
            .as_str()
            .is_some_and(|r| r.contains("no earlier backup point")),
        "{b1}"
    );
    assert_eq!(v1["sizeBytes"].as_u64(), Some(GIB), "{b1}");
    assert_eq!(v1["bytesRead"].as_u64(), Some(GIB), "{b1}");
    assert_eq!(points(&c)?, ["backup-b1-incvm"]);
    // The point is a layer chain on the node-local volume, which a block migration carries
    // (docs/migration.md "Node-local disks with snapshots"): the VMI stays live-migratable.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let v = c.get_json(&["vmi", "incvm"])?;
    let cond = v["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "LiveMigratable")
        .cloned()
        .unwrap_or_default();
    assert_eq!(cond["status"], "True", "{cond}");
    eprintln!("[{:?}] b1 (full) in {full_secs:.1}s: {v1}", t0.elapsed());

    // The guest rewrites 51 MiB (5 %) with random data at three offsets, then syncs.
    let console = SerialConsole::connect(&vmi_dir.join("serial.sock"), Duration::from_secs(10))?;
    for seek in [100, 517, 901] {
        let (out, rc) = console.exec(
            &format!("dd if=/dev/urandom of=/dev/vdb bs=1M count=17 seek={seek} conv=fsync"),
            Duration::from_secs(120),
        )?;
        anyhow::ensure!(rc == 0, "rewriting at {seek} MiB: {out}");
    }
    let (out, rc) = console.exec("sync", Duration::from_secs(60))?;
    anyhow::ensure!(rc == 0, "sync: {out}");
    drop(console);

    // b2: only the changed chunks are read and uploaded; it becomes the point.
    let t = Instant::now();
    let b2 = backup(&c, "b2")?;
    let inc_secs = t.elapsed().as_secs_f64();
    assert_eq!(b2["status"]["phase"], "Succeeded", "{b2}");
    let v2 = volume(&b2, "inc-data");
    assert_eq!(v2["incremental"], true, "{b2}");
    assert_eq!(v2["baseBackup"], "default-b1", "{b2}");
    let read = v2["bytesRead"].as_u64().unwrap_or(u64::MAX);
    let new = v2["bytesNew"].as_u64().unwrap_or(u64::MAX);
    let uploaded = v2["bytesUploaded"].as_u64().unwrap_or(u64::MAX);
    let reused = v2["bytesReused"].as_u64().unwrap_or(0);
    assert!(read >= 51 << 20, "the changes were read: {b2}");
    assert!(read <= GIB / 10, "read {read} > 10% of the disk: {b2}");
    assert!(uploaded <= GIB / 10, "uploaded {uploaded} > 10%: {b2}");
    assert!(new <= read, "{b2}");
    assert_eq!(read + reused, GIB, "every chunk read or reused: {b2}");
    assert_eq!(
        volume(&b2, "inc-root")["incremental"],
        true,
        "the root disk too: {b2}"
    );
    c.wait_until("b1's point deleted, b2's kept", STEP, || {
        Ok((points(&c)? == ["backup-b2-incvm"]).then_some(()))
    })?;
    eprintln!(
        "[{:?}] b2 (5% changed) in {inc_secs:.1}s (full: {full_secs:.1}s): read {read}, \
         uploaded {uploaded}, reused {reused}",
        t0.elapsed()
    );

    // The guest's disk as b2 read it: the VM stops (nothing wrote it since), its chain
    // flattened on the host.
    c.halt_vm("incvm", STEP)?;
    let flat = store.path().join("expected.raw");
    ferrovirt_storage::snapshot::export_raw(&data_dir, None, &flat)?;
    let expected = sha256(&flat, GIB)?;
    std::fs::remove_file(&flat)?;

    // A restore of b2 (a BackupRestore under a new name) holds exactly those bytes.
    c.apply(
        "apiVersion: backup.ferrovirt.io/v1alpha1\nkind: BackupRestore\n\
         metadata: {name: r2, namespace: default}\n\
         spec: {target: fs, encryptionKeySecretRef: bk-key, backupName: default-b2,\n\
         \x20 virtualMachines: [{name: default/incvm, newName: incvm2}]}\n",
    )?;
    let r2 = c.wait_until("restore r2 finished", STEP, || {
        let v = c.get_json(&["backuprestore", "r2", "-n", "default"])?;
        let p = v["status"]["phase"].as_str().unwrap_or("");
        Ok((p == "Succeeded" || p == "Failed").then_some(v))
    })?;
    assert_eq!(r2["status"]["phase"], "Succeeded", "{r2}");
    let restored = volume_dir(&c, "incvm2-inc-data")?.join("disk.img");
    assert_eq!(
        sha256(&restored, GIB)?,
        expected,
        "the restored disk is the disk b2 read"
    );
    eprintln!("[{:?}] b2 restored, SHA-256 equal", t0.elapsed());

    // The point survives a restart of the VM (new VMI, launcher, QEMU) and a block migration
    // to another node (the chain, b2's point layer included, carried: docs/migration.md
    // "Node-local disks with snapshots"): 4 MiB written by the guest afterwards are all b3
    // reads of the data disk.
    c.set_run_strategy("incvm", "Always")?;
    let uid = c.wait_booted("incvm", BOOT)?;
    booted(&c)?;
    c.start_agent("node2")?;
    c.wait_until("node2 Ready", STEP, || {
        let n = c.get_json(&["node", "node2"])?;
        Ok(n["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
            .then_some(()))
    })?;
    let t = Instant::now();
    c.apply(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\n\
         metadata: {name: inc-mig, namespace: default}\nspec: {vmiName: incvm}\n",
    )?;
    let m = c.wait_until("migration inc-mig finished", STEP, || {
        let v = c.get_json(&["vmim", "inc-mig"])?;
        let p = v["status"]["phase"].as_str().unwrap_or("");
        Ok((p == "Succeeded" || p == "Failed").then_some(v))
    })?;
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    let v = c.get_json(&["vmi", "incvm"])?;
    assert_eq!(v["status"]["nodeName"], "node2", "{}", v["status"]);
    assert_eq!(v["status"]["migrationMethod"], "BlockMigration");
    eprintln!(
        "[{:?}] migrated to node2 with the point's chain in {:.1}s",
        t0.elapsed(),
        t.elapsed().as_secs_f64()
    );
    let vmi_dir = c.node_dir("node2").join("vmis").join(&uid);
    let console = SerialConsole::connect(&vmi_dir.join("serial.sock"), Duration::from_secs(10))?;
    let (out, rc) = console.exec(
        "dd if=/dev/urandom of=/dev/vdb bs=1M count=4 seek=300 conv=fsync && sync",
        Duration::from_secs(120),
    )?;
    anyhow::ensure!(rc == 0, "writing after the restart: {out}");
    drop(console);
    let b3 = backup(&c, "b3")?;
    assert_eq!(b3["status"]["phase"], "Succeeded", "{b3}");
    let v3 = volume(&b3, "inc-data");
    assert_eq!(v3["incremental"], true, "{b3}");
    assert_eq!(v3["baseBackup"], "default-b2", "{b3}");
    assert_eq!(v3["bytesRead"].as_u64(), Some(4 << 20), "{b3}");
    c.wait_until("b3's point kept, b2's deleted", STEP, || {
        Ok((points(&c)? == ["backup-b3-incvm"]).then_some(()))
    })?;
    eprintln!(
        "[{:?}] after a VM restart and a migration: {v3}",
        t0.elapsed()
    );
    c.halt_vm("incvm", STEP)?;

    // Fallback: the base backup is gone from the target → a full read naming it.
    std::fs::remove_file(store.path().join("e2e/catalog/default-b3"))?;
    let b4 = backup(&c, "b4")?;
    assert_eq!(b4["status"]["phase"], "Succeeded", "{b4}");
    let v4 = volume(&b4, "inc-data");
    assert_eq!(v4["incremental"], false, "{b4}");
    let why = v4["fullReadReason"].as_str().unwrap_or("");
    assert!(
        why.contains("default-b3") && why.contains("repository"),
        "{b4}"
    );
    assert_eq!(v4["bytesRead"].as_u64(), Some(GIB), "{b4}");
    // A stopped VM makes no new point: b3's stays.
    assert_eq!(points(&c)?, ["backup-b3-incvm"]);
    eprintln!("[{:?}] fallback: {why}", t0.elapsed());
    Ok(())
}
