//! Online disk growth end to end: a VM boots from a DataVolume imported (over HTTP from a
//! server this test runs on 127.0.0.1) into the expandable `shared` class; its claim is grown
//! with `kubectl patch` while the guest runs, and the guest's virtio disk grows without a
//! restart (`/sys/block/vda/size` read on the serial console).

use std::time::{Duration, Instant};

use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest, serve_files};

const BOOT: Duration = Duration::from_secs(180);
const IMPORT: Duration = Duration::from_secs(120);

/// The guest's `vda` size in 512-byte sectors.
fn guest_sectors(console: &SerialConsole) -> anyhow::Result<u64> {
    let (out, rc) = console.exec("cat /sys/block/vda/size", Duration::from_secs(20))?;
    anyhow::ensure!(rc == 0, "cat /sys/block/vda/size failed: {out}");
    Ok(out.trim().parse()?)
}

#[test]
fn running_guest_sees_its_grown_claim() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    let url = serve_files(vec![("disk.qcow2".into(), guest.disk_qcow2.clone())])? + "/disk.qcow2";
    c.apply(&format!(
        r#"
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: grow-root, namespace: default}}
spec:
  source: {{http: {{url: "{url}"}}}}
  storage:
    storageClassName: shared
    resources: {{requests: {{storage: 64Mi}}}}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: grower, namespace: default}}
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
      volumes:
      - name: root
        dataVolume: {{name: grow-root}}
"#
    ))?;
    c.wait_until("DataVolume grow-root Succeeded", IMPORT, || {
        let v = c.get_json(&["datavolume", "grow-root", "-n", "default"])?;
        anyhow::ensure!(v["status"]["phase"] != "Failed", "import failed: {v}");
        Ok((v["status"]["phase"] == "Succeeded").then_some(()))
    })?;
    let uid = c.wait_booted("grower", BOOT)?;
    let dir = c.agent_dir().join("vmis").join(&uid);
    c.wait_until("guest shell ready", BOOT, || {
        let log = std::fs::read(dir.join("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    assert_eq!(guest_sectors(&console)?, (64 << 20) / 512);

    c.kubectl_ok(&[
        "patch",
        "pvc",
        "grow-root",
        "-n",
        "default",
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"resources":{"requests":{"storage":"96Mi"}}}}"#,
    ])?;
    let grown_at = Instant::now();
    c.wait_until("the guest sees 96Mi", Duration::from_secs(60), || {
        Ok((guest_sectors(&console)? == (96 << 20) / 512).then_some(()))
    })?;
    eprintln!("guest saw the grown disk after {:?}", grown_at.elapsed());

    // Same VMI (no restart), and the growth is recorded as an event on it.
    let vmi = c.get_json(&["vmi", "grower", "-n", "default"])?;
    assert_eq!(vmi["metadata"]["uid"], uid.as_str(), "{vmi}");
    assert_eq!(vmi["status"]["phase"], "Running", "{vmi}");
    let events = c.get_json(&["events", "-n", "default"])?;
    let resized: Vec<&str> = events["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["reason"] == "DiskResized")
        .filter_map(|e| e["message"].as_str())
        .collect();
    assert_eq!(
        resized,
        ["disk disk-root grown to 100663296 bytes"],
        "{events}"
    );
    let pvc = c.get_json(&["pvc", "grow-root", "-n", "default"])?;
    assert_eq!(pvc["status"]["capacity"]["storage"], "96Mi", "{pvc}");
    Ok(())
}
