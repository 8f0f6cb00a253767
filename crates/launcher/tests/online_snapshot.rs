//! Online snapshots against the real test guest under TCG (`ferrovirt_launcher::online_snapshot`):
//! the disk switches to a new qcow2 overlay while the guest runs, under a guest-agent freeze the
//! guest reports (its qemu-ga fsfreeze hook prints on the console), later guest writes land in
//! the overlay and leave the frozen image alone; a freeze the guest refuses fails the snapshot
//! and leaves the guest thawed and QEMU without the overlay's nodes; a freeze slower than its
//! bound is thawed at the deadline (`QuiesceTimeout`).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use ferrovirt_launcher::console::Pattern;
use ferrovirt_launcher::online_snapshot::{self, OverlayDisk, Tops};
use ferrovirt_launcher::spec::Disk;

const EXEC_TIMEOUT: Duration = Duration::from_secs(30);
const DISK_BYTES: u64 = 16 << 20;

/// A raw data disk of 16 MiB and an empty qcow2 overlay over it.
fn disk_and_overlay(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let disk = dir.join("data.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(DISK_BYTES)
        .unwrap();
    let overlay = dir.join("layer-000001.qcow2");
    let out = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b", "data.img"])
        .arg(&overlay)
        .arg(DISK_BYTES.to_string())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    (disk, overlay)
}

fn data_disk(path: &Path) -> Disk {
    serde_json::from_value(serde_json::json!({
        "id": "disk-data", "path": path, "format": "raw", "bus": "virtio",
    }))
    .unwrap()
}

#[tokio::test]
async fn the_disk_switches_to_its_overlay_under_a_freeze_the_guest_sees() {
    let guest = TestGuest::locate();
    let dir = tempfile::tempdir().unwrap();
    let (disk, overlay) = disk_and_overlay(dir.path());
    let mut spec = kernel_boot_spec(&guest, "onlinesnap", dir.path());
    spec.disks.push(data_disk(&disk));
    let t = TestVm::start(spec, dir, true).await;
    let (mut console, _events) = t.console_and_run().await;
    wait_ready(&mut console).await;
    t.vm.guest_agent().await.unwrap().ping().await.unwrap();
    let out = console
        .exec(
            "echo BEFORE-SNAPSHOT | dd of=/dev/vda bs=512 seek=0 conv=fsync",
            EXEC_TIMEOUT,
        )
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");

    let mut tops = Tops::default();
    let done = online_snapshot::take(
        &t.vm,
        &mut tops,
        &[OverlayDisk {
            disk: "disk-data".into(),
            overlay: overlay.clone(),
        }],
        Duration::from_secs(30),
        online_snapshot::SnapshotGuest::Running,
    )
    .await
    .unwrap();
    assert_eq!(done.indications, ["Online", "GuestAgent"]);
    assert_eq!(tops.top("disk-data"), "fmt-disk-data-s1");
    console
        .wait_for(
            &Pattern::substring("FERROVIRT-FSFREEZE freeze"),
            EXEC_TIMEOUT,
        )
        .await
        .unwrap();
    console
        .wait_for(&Pattern::substring("FERROVIRT-FSFREEZE thaw"), EXEC_TIMEOUT)
        .await
        .unwrap();
    let status =
        t.vm.guest_agent()
            .await
            .unwrap()
            .execute("guest-fsfreeze-status", None)
            .await
            .unwrap();
    assert_eq!(status, "thawed");

    // The guest writes on: through the overlay, the frozen image keeps the old bytes.
    let out = console
        .exec(
            "echo AFTER-SNAPSHOT | dd of=/dev/vda bs=512 seek=0 conv=fsync && \
             dd if=/dev/vda bs=512 count=1 2>/dev/null | head -c 14; echo",
            EXEC_TIMEOUT,
        )
        .await
        .unwrap();
    assert!(out.output.contains("AFTER-SNAPSHOT"), "{out:?}");
    let base = std::fs::read(t.dir.path().join("data.img")).unwrap();
    assert_eq!(&base[..15], b"BEFORE-SNAPSHOT");
    let overlay_len = std::fs::metadata(&overlay).unwrap().len();
    assert!(
        overlay_len > 200 * 1024,
        "the write went to the overlay: {overlay_len}"
    );
}

/// The overlay's block nodes (`…-s1`) QEMU still has.
async fn overlay_nodes(t: &TestVm) -> Vec<String> {
    let nodes =
        t.vm.qmp()
            .execute("query-named-block-nodes", None)
            .await
            .unwrap();
    nodes
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["node-name"].as_str())
        .filter(|n| n.ends_with("-s1"))
        .map(String::from)
        .collect()
}

async fn freeze_status(t: &TestVm) -> serde_json::Value {
    t.vm.guest_agent()
        .await
        .unwrap()
        .execute("guest-fsfreeze-status", None)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_refused_freeze_fails_the_snapshot_and_a_slow_one_is_thawed_at_the_deadline() {
    let guest = TestGuest::locate();
    let dir = tempfile::tempdir().unwrap();
    let (disk, overlay) = disk_and_overlay(dir.path());
    let mut spec = kernel_boot_spec(&guest, "onlinefail", dir.path());
    spec.disks.push(data_disk(&disk));
    let t = TestVm::start(spec, dir, true).await;
    let (mut console, _events) = t.console_and_run().await;
    wait_ready(&mut console).await;
    let disks = [OverlayDisk {
        disk: "disk-data".into(),
        overlay,
    }];

    // The guest refuses to freeze (its hook fails): the snapshot fails, nothing moved.
    let out = console
        .exec("touch /run/fsfreeze-fail", EXEC_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");
    let mut tops = Tops::default();
    let err = online_snapshot::take(
        &t.vm,
        &mut tops,
        &disks,
        Duration::from_secs(30),
        online_snapshot::SnapshotGuest::Running,
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("freezing"), "{err}");
    assert_eq!(
        tops.top("disk-data"),
        "fmt-disk-data",
        "the disk did not move"
    );
    assert_eq!(freeze_status(&t).await, "thawed");
    assert_eq!(overlay_nodes(&t).await, Vec::<String>::new());

    // The guest freezes too slowly (6 s against a 2 s bound): thawed at the deadline, the
    // snapshot is taken and says QuiesceTimeout.
    let out = console
        .exec(
            "rm /run/fsfreeze-fail && echo 6 >/run/fsfreeze-slow",
            EXEC_TIMEOUT,
        )
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");
    let done = online_snapshot::take(
        &t.vm,
        &mut tops,
        &disks,
        Duration::from_secs(2),
        online_snapshot::SnapshotGuest::Running,
    )
    .await
    .unwrap();
    assert_eq!(done.indications, ["Online", "GuestAgent", "QuiesceTimeout"]);
    assert_eq!(freeze_status(&t).await, "thawed");
    assert_eq!(tops.top("disk-data"), "fmt-disk-data-s2");
    // And the guest still writes its disk.
    let out = console
        .exec(
            "rm /run/fsfreeze-slow; echo STILL-WRITES | dd of=/dev/vda bs=512 seek=0 conv=fsync",
            EXEC_TIMEOUT,
        )
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");
}
