//! Merging released snapshot layers under a running guest (`ferrovirt_launcher::online_reclaim`)
//! against QEMU and the test guest under TCG: a disk started on a recorded chain (its raw
//! bottom opened read-only) is snapshotted online, a released middle layer is streamed into
//! the top (`block-stream`) and then everything is committed into the raw bottom
//! (`block-commit` + `job-complete`, the bottom reopened writable on a launcher descriptor);
//! the guest reads every byte it wrote throughout, QEMU closes the dropped layers, and after
//! the commit its writes land in the raw image. Throughout, `DiskLayers` names the files
//! QEMU runs (an overlay on a launcher descriptor among them), and the commit's pivot
//! marker is written (a stream writes none) with the guest running again after it.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use ferrovirt_launcher::disk_layers::{self, DiskLayersRequest};
use ferrovirt_launcher::online_reclaim::{self, MergeRequest, MergeStep};
use ferrovirt_launcher::online_snapshot::{self, OverlayDisk, Tops};
use ferrovirt_launcher::spec::Disk;

const EXEC_TIMEOUT: Duration = Duration::from_secs(30);
const DISK_BYTES: u64 = 16 << 20;

fn qcow2_over(dir: &Path, name: &str, backing: &str, backing_fmt: &str) {
    let out = Command::new("qemu-img")
        .args([
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            backing_fmt,
            "-b",
            backing,
        ])
        .arg(dir.join(name))
        .arg(DISK_BYTES.to_string())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// Writes `text` at 4 KiB block `block` of the guest's data disk, flushed.
async fn write_block(
    console: &mut ferrovirt_launcher::console::SerialConsole,
    text: &str,
    block: u32,
) {
    let out = console
        .exec(
            &format!("echo {text} | dd of=/dev/vda bs=4096 seek={block} conv=fsync"),
            EXEC_TIMEOUT,
        )
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");
}

/// What the guest reads at blocks 0, 1 and 2 of its data disk, past its page cache.
async fn read_blocks(console: &mut ferrovirt_launcher::console::SerialConsole) -> String {
    let out = console
        .exec(
            "sync; echo 3 >/proc/sys/vm/drop_caches; for b in 0 1 2; do \
             dd if=/dev/vda bs=4096 skip=$b count=1 2>/dev/null | head -c 8; echo; done",
            EXEC_TIMEOUT,
        )
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");
    out.output
}

/// The disk images among open files (the test directory also holds QEMU's logs).
fn images(open: &[String]) -> Vec<&str> {
    open.iter()
        .map(String::as_str)
        .filter(|f| f.ends_with(".img") || f.ends_with(".qcow2"))
        .collect()
}

/// The layer files QEMU runs disk `disk-data` on (`DiskLayers`).
async fn layers(vm: &ferrovirt_launcher::Vm, tops: &Tops, d: &Path) -> Vec<String> {
    let req = DiskLayersRequest {
        disk: "disk-data".into(),
        dir: d.to_path_buf(),
    };
    disk_layers::disk_layers(vm, tops, &req)
        .await
        .unwrap()
        .layers
}

#[tokio::test]
async fn released_layers_merge_under_the_running_guest() {
    let guest = TestGuest::locate();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    std::fs::File::create(d.join("disk.img"))
        .unwrap()
        .set_len(DISK_BYTES)
        .unwrap();
    qcow2_over(&d, "layer-000001.qcow2", "disk.img", "raw");
    qcow2_over(&d, "layer-000002.qcow2", "layer-000001.qcow2", "qcow2");
    let mut spec = kernel_boot_spec(&guest, "onlinereclaim", &d);
    let disk: Disk = serde_json::from_value(serde_json::json!({
        "id": "disk-data", "path": d.join("layer-000001.qcow2"), "format": "qcow2",
        "bus": "virtio", "backing": [{"path": d.join("disk.img"), "format": "raw"}],
    }))
    .unwrap();
    spec.disks.push(disk);
    let t = TestVm::start(spec, dir, true).await;
    let (mut console, _events) = t.console_and_run().await;
    wait_ready(&mut console).await;
    write_block(&mut console, "AAAAAAAA", 0).await;

    let mut tops = Tops::default();
    online_snapshot::take(
        &t.vm,
        &mut tops,
        &[OverlayDisk {
            disk: "disk-data".into(),
            overlay: d.join("layer-000002.qcow2"),
        }],
        Duration::from_secs(30),
        online_snapshot::SnapshotGuest::Running,
    )
    .await
    .unwrap();
    write_block(&mut console, "BBBBBBBB", 1).await;
    // The files QEMU runs, the overlay on a launcher descriptor among them.
    assert_eq!(
        layers(&t.vm, &tops, &d).await,
        ["disk.img", "layer-000001.qcow2", "layer-000002.qcow2"]
    );

    // layer-000001 (frozen by a snapshot that was deleted) is streamed into the top.
    let done = online_reclaim::merge(
        &t.vm,
        &mut tops,
        &MergeRequest {
            disk: "disk-data".into(),
            dir: d.clone(),
            layers: vec![
                "disk.img".into(),
                "layer-000001.qcow2".into(),
                "layer-000002.qcow2".into(),
            ],
            steps: vec![MergeStep::Stream {
                image: "layer-000002.qcow2".into(),
                base: "disk.img".into(),
            }],
            pivot_marker: Some(".merge-s.pivoted".into()),
        },
    )
    .await
    .unwrap();
    assert_eq!(
        images(&done.open),
        ["disk.img", "layer-000002.qcow2"],
        "layer 1 closed"
    );
    let seen = read_blocks(&mut console).await;
    assert!(seen.starts_with("AAAAAAAA\nBBBBBBBB"), "{seen:?}");
    assert_eq!(
        layers(&t.vm, &tops, &d).await,
        ["disk.img", "layer-000002.qcow2"]
    );
    assert!(
        !d.join(".merge-s.pivoted").exists(),
        "a stream never pivots"
    );

    // Nothing held any more: everything into the raw bottom, which QEMU had read-only.
    let done = online_reclaim::merge(
        &t.vm,
        &mut tops,
        &MergeRequest {
            disk: "disk-data".into(),
            dir: d.clone(),
            layers: vec!["disk.img".into(), "layer-000002.qcow2".into()],
            steps: vec![MergeStep::CommitActive {
                base: "disk.img".into(),
            }],
            pivot_marker: Some(".merge-c.pivoted".into()),
        },
    )
    .await
    .unwrap();
    assert_eq!(
        images(&done.open),
        ["disk.img"],
        "only the raw image stays open"
    );
    assert_eq!(tops.top("disk-data"), "fmt-disk-data-b1");
    assert!(d.join(".merge-c.pivoted").exists(), "the pivot is marked");
    assert_eq!(
        layers(&t.vm, &tops, &d).await,
        ["disk.img"],
        "QEMU runs the raw image"
    );
    let st = t.vm.qmp().query_status().await.unwrap();
    assert!(st.running, "the guest runs again after the pivot: {st:?}");
    write_block(&mut console, "CCCCCCCC", 2).await;
    let seen = read_blocks(&mut console).await;
    assert!(seen.starts_with("AAAAAAAA\nBBBBBBBB\nCCCCCCCC"), "{seen:?}");
    let raw = std::fs::read(d.join("disk.img")).unwrap();
    assert_eq!(&raw[..8], b"AAAAAAAA");
    assert_eq!(&raw[4096..4104], b"BBBBBBBB");
    assert_eq!(
        &raw[8192..8200],
        b"CCCCCCCC",
        "the guest writes the raw image now"
    );

    // A step that does not match the running chain is refused, the disk untouched.
    let err = online_reclaim::merge(
        &t.vm,
        &mut tops,
        &MergeRequest {
            disk: "disk-data".into(),
            dir: d.clone(),
            layers: vec!["disk.img".into(), "layer-000002.qcow2".into()],
            steps: vec![],
            pivot_marker: None,
        },
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("records 2"), "{err}");
}
