//! An empty CD-ROM (issue #14): a `disks[]` entry with `cdrom: {}` and no volume of its name
//! (admission allows it for declarative hotplug) starts as a drive without a medium. The VMI
//! has one on the scsi bus (virtio-scsi: the test guest's kernel has virtio_scsi and sr_mod)
//! and one on the default sata bus (QEMU accepts it; the guest's cloud kernel has no AHCI
//! driver, so it cannot see that one). The VMI runs, the launch spec marks both drives
//! empty with no image, QEMU's command line has both CD-ROM devices without a drive, and the
//! guest sees exactly one CD-ROM, `sr0`, with no medium (size 0).

use std::time::Duration;

use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest};

const BOOT: Duration = Duration::from_secs(180);

const VMI: &str = r##"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: cdless, namespace: default}
spec:
  domain:
    memory: {guest: 128Mi}
    devices:
      disks:
      - {name: root, disk: {bus: virtio}}
      - {name: hotplug-cd, cdrom: {bus: scsi}}
      - {name: sata-cd, cdrom: {}}
  volumes:
  - {name: root, persistentVolumeClaim: {claimName: cdless-root}}
"##;

#[test]
fn a_cdrom_without_a_volume_starts_as_an_empty_drive() -> anyhow::Result<()> {
    TestGuest::get()?;
    let c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    c.guest_disk_claim("cdless-root")?;
    c.apply(VMI)?;
    let uid = c.wait_booted("cdless", BOOT)?;
    let dir = c.agent_dir().join("vmis").join(&uid);

    // The launch spec: both CD-ROMs empty, no image path.
    let spec: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("spec.json"))?)?;
    let disks = spec["disks"].as_array().cloned().unwrap_or_default();
    for id in ["disk-hotplug-cd", "disk-sata-cd"] {
        let d = disks
            .iter()
            .find(|d| d["id"] == id)
            .unwrap_or_else(|| panic!("{id} in {disks:?}"));
        assert_eq!(d["empty"], true, "{d}");
        assert_eq!(d["cdrom"], true, "{d}");
        assert_eq!(d["path"], "", "{d}");
    }

    // QEMU's command line: the devices, no drive behind them.
    let qemu = c.wait_until("QEMU's command line", Duration::from_secs(30), || {
        for pid in ferrovirt_testkit::cluster::pids_matching(&uid) {
            let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let argv: Vec<String> = raw
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            if argv.first().is_some_and(|a| a.contains("qemu-system")) {
                return Ok(Some(argv));
            }
        }
        Ok(None)
    })?;
    let scsi_cd = qemu
        .iter()
        .find(|a| a.starts_with("scsi-cd,") && a.contains("id=disk-hotplug-cd"))
        .unwrap_or_else(|| panic!("no scsi-cd in {qemu:?}"));
    let ide_cd = qemu
        .iter()
        .find(|a| a.starts_with("ide-cd,") && a.contains("id=disk-sata-cd"))
        .unwrap_or_else(|| panic!("no ide-cd in {qemu:?}"));
    assert!(!scsi_cd.contains("drive="), "{scsi_cd}");
    assert!(!ide_cd.contains("drive="), "{ide_cd}");
    assert!(
        !qemu
            .iter()
            .any(|a| a.contains("file-disk-hotplug-cd") || a.contains("file-disk-sata-cd")),
        "no block node for an empty drive: {qemu:?}"
    );

    // The guest sees the virtio-scsi CD-ROM, without a medium.
    c.wait_until("the guest ready", BOOT, || {
        let log =
            String::from_utf8_lossy(&std::fs::read(dir.join("serial.log")).unwrap_or_default())
                .into_owned();
        Ok(log.contains("FERROVIRT-READY").then_some(()))
    })?;
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    let out = c.wait_until("sr0 in the guest", Duration::from_secs(30), || {
        let (out, rc) = console.exec(
            "ls -d /sys/block/sr* && cat /sys/block/sr0/device/type",
            Duration::from_secs(20),
        )?;
        Ok((rc == 0).then_some(out))
    })?;
    let lines: Vec<&str> = out.lines().map(str::trim).collect();
    assert_eq!(
        lines,
        ["/sys/block/sr0", "5"],
        "exactly one CD-ROM (SCSI type 5): {out}"
    );
    // No medium: reading the drive fails.
    let (read, rc) = console.exec(
        "dd if=/dev/sr0 of=/dev/null bs=2048 count=1",
        Duration::from_secs(20),
    )?;
    assert_ne!(rc, 0, "an empty drive has nothing to read: {read}");
    assert!(read.contains("No medium found"), "{read}");
    eprintln!("guest: {} | {}", lines.join(" | "), read.trim());
    drop(console);
    c.kubectl_ok(&["delete", "vmi", "cdless", "--timeout=120s"])?;
    Ok(())
}
