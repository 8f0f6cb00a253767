//! Reclaiming a deleted snapshot's layers while the VM runs (docs/snapshots.md "Reclaiming
//! layers while the VM runs"), against the real binary, kubectl and a TCG guest: a VM on an
//! imported root claim, a blank `local` data claim and a blank `shared` one writes a marker on
//! both data disks, is snapshotted online, writes a second marker, and its
//! VirtualMachineSnapshot is deleted while it runs. Within a bounded time every volume is a
//! plain raw image again (no released layer in `chain.json`, the layer files gone) — merged in
//! the running QEMU — while the guest ran on (same VMI, its uptime grew) and reads both
//! markers; a third marker written afterwards, the VM is stopped and started: all three are
//! on both disks.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest, serve_files};

const BOOT: Duration = Duration::from_secs(120);
const STEP: Duration = Duration::from_secs(60);
/// How long the merge of the deleted snapshot's layers may take under the running VM.
const MERGED_WITHIN: Duration = Duration::from_secs(60);
const MARKERS: [(&str, u32); 3] = [
    ("RECLAIM-FIRST", 0),
    ("RECLAIM-SECOND", 2048),
    ("RECLAIM-THIRD", 4096),
];
const DISKS: [&str; 2] = ["/dev/vdb", "/dev/vdc"];

fn vm_yaml(url: &str) -> String {
    format!(
        r#"
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: rc-root, namespace: default}}
spec:
  source: {{http: {{url: "{url}"}}}}
  storage: {{resources: {{requests: {{storage: 64Mi}}}}}}
---
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: rc-local, namespace: default}}
spec:
  source: {{blank: {{}}}}
  storage: {{resources: {{requests: {{storage: 16Mi}}}}}}
---
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: rc-shared, namespace: default}}
spec:
  source: {{blank: {{}}}}
  storage: {{storageClassName: shared, resources: {{requests: {{storage: 16Mi}}}}}}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: rcvm, namespace: default}}
spec:
  runStrategy: Always
  template:
    spec:
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - name: root
            disk: {{bus: virtio}}
          - name: local
            disk: {{bus: virtio}}
          - name: shared
            disk: {{bus: virtio}}
      volumes:
      - name: root
        dataVolume: {{name: rc-root}}
      - name: local
        dataVolume: {{name: rc-local}}
      - name: shared
        dataVolume: {{name: rc-shared}}
"#
    )
}

/// Boots VM `name`'s VMI to the guest's shell; the VMI uid and a console on it.
fn boot(c: &Cluster, name: &str) -> anyhow::Result<(String, SerialConsole)> {
    let uid = c.wait_booted(name, BOOT)?;
    let dir = c.agent_dir().join("vmis").join(&uid);
    c.wait_until(&format!("{name}: guest shell ready"), BOOT, || {
        let log = std::fs::read(dir.join("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    Ok((uid, console))
}

/// Writes marker `i` on both data disks, flushed to the host.
fn write_marker(console: &SerialConsole, i: usize) -> anyhow::Result<()> {
    let (marker, sector) = MARKERS[i];
    for disk in DISKS {
        let (out, rc) = console.exec(
            &format!("echo {marker} | dd of={disk} bs=512 seek={sector} conv=fsync && sync"),
            Duration::from_secs(30),
        )?;
        anyhow::ensure!(rc == 0, "writing {marker} on {disk}: {out}");
    }
    Ok(())
}

/// Checks that markers `0..n` read back from both data disks, past the guest's page cache.
fn check_markers(console: &SerialConsole, n: usize) -> anyhow::Result<()> {
    console.exec(
        "sync; echo 3 >/proc/sys/vm/drop_caches",
        Duration::from_secs(30),
    )?;
    for disk in DISKS {
        for (marker, sector) in &MARKERS[..n] {
            let (out, _) = console.exec(
                &format!(
                    "dd if={disk} bs=512 skip={sector} count=1 2>/dev/null | head -c {}; echo",
                    marker.len()
                ),
                Duration::from_secs(30),
            )?;
            let got = out.replace('\0', "");
            anyhow::ensure!(
                got.trim() == *marker,
                "{disk} at sector {sector}: {got:?}, want {marker}"
            );
        }
    }
    Ok(())
}

/// The guest's uptime in seconds.
fn uptime(console: &SerialConsole) -> anyhow::Result<f64> {
    let (out, _) = console.exec("cat /proc/uptime", Duration::from_secs(30))?;
    let first = out.split_whitespace().next().unwrap_or_default();
    first
        .parse()
        .map_err(|e| anyhow::anyhow!("uptime {out:?}: {e}"))
}

/// The directory of claim `claim`'s volume (`local.path` or `hostPath.path` of its PV).
fn volume_dir(c: &Cluster, claim: &str) -> anyhow::Result<PathBuf> {
    let pvc = c.get_json(&["pvc", claim, "-n", "default"])?;
    let pv = c.get_json(&["pv", pvc["spec"]["volumeName"].as_str().unwrap_or_default()])?;
    let path = pv["spec"]["local"]["path"]
        .as_str()
        .or(pv["spec"]["hostPath"]["path"].as_str())
        .unwrap_or_default();
    Ok(path.into())
}

fn chain(dir: &Path) -> anyhow::Result<serde_json::Value> {
    Ok(serde_json::from_slice(&std::fs::read(
        dir.join("chain.json"),
    )?)?)
}

fn qcow2_files(dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut v: Vec<String> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".qcow2"))
        .collect();
    v.sort();
    Ok(v)
}

#[test]
fn a_deleted_snapshot_is_merged_while_the_vm_runs() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    let url = serve_files(vec![("disk.qcow2".into(), guest.disk_qcow2.clone())])? + "/disk.qcow2";
    c.apply(&vm_yaml(&url))?;
    let (uid, console) = boot(&c, "rcvm")?;
    write_marker(&console, 0)?;

    c.apply(
        r#"
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineSnapshot
metadata: {name: rc1, namespace: default}
spec:
  source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: rcvm}
"#,
    )?;
    c.wait_until("snapshot rc1 ready", STEP, || {
        let v = c.get_json(&["vmsnapshot", "rc1", "-n", "default"])?;
        anyhow::ensure!(v["status"]["phase"] != "Failed", "{v}");
        Ok((v["status"]["readyToUse"] == true).then_some(v))
    })?;
    let dirs: Vec<PathBuf> = ["rc-root", "rc-local", "rc-shared"]
        .iter()
        .map(|claim| volume_dir(&c, claim))
        .collect::<anyhow::Result<_>>()?;
    for d in &dirs {
        let ch = chain(d)?;
        assert_eq!(ch["layers"].as_array().map(Vec::len), Some(2), "{ch}");
        assert_eq!(qcow2_files(d)?, ["layer-000001.qcow2"], "{}", d.display());
    }
    write_marker(&console, 1)?;
    let up_before = uptime(&console)?;

    // Deleted while the VM runs: its layers are merged in the running QEMU.
    let t = Instant::now();
    c.kubectl_ok(&["delete", "vmsnapshot", "rc1", "-n", "default"])?;
    c.wait_until("every volume plain again", MERGED_WITHIN, || {
        for d in &dirs {
            let ch = chain(d)?;
            let plain = ch["layers"].as_array().map(Vec::len) == Some(1)
                && ch.get("released").is_none()
                && qcow2_files(d)?.is_empty();
            if !plain {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })?;
    eprintln!("layers merged online {:?} after the delete", t.elapsed());
    let vmi = c.get_json(&["vmi", "rcvm", "-n", "default"])?;
    assert_eq!(vmi["metadata"]["uid"], uid.as_str(), "the VMI was replaced");
    assert_eq!(vmi["status"]["phase"], "Running", "{vmi}");
    let up_after = uptime(&console)?;
    assert!(
        up_after > up_before,
        "the guest rebooted: uptime {up_before} then {up_after}"
    );
    check_markers(&console, 2)?;
    write_marker(&console, 2)?;
    check_markers(&console, 3)?;
    drop(console);

    c.halt_vm("rcvm", STEP)?;
    c.set_run_strategy("rcvm", "Always")?;
    let (uid2, console) = boot(&c, "rcvm")?;
    assert_ne!(uid2, uid);
    check_markers(&console, 3)?;
    Ok(())
}
