//! `bench/snapshot.sh`'s online measurement: the time of an online snapshot of a running VM
//! whose data disk is a fully written volume of each size — the agent's steps on the node
//! (`prepare_online`, the launcher's switch under a guest-agent freeze, `record_snapshot`),
//! with the test guest booted under TCG and its qemu-ga answering. Printed beside the offline
//! snapshot of the same volume measured in the same run. One guest carries one data disk per
//! size and the sizes are snapshotted in interleaved rounds.
//!
//! `cargo run --example online_snapshot_bench -p ferrovirt-agent -- DIR SIZE_GIB... [--runs N]`
//! (the test guest from `scripts/build-test-guest.sh`, found in `$FERROVIRT_TEST_GUEST_DIR`
//! or `target/test-guest`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ferrovirt_launcher::console::Pattern;
use ferrovirt_launcher::online_snapshot::{self, OverlayDisk, Tops};
use ferrovirt_launcher::process::QemuOptions;
use ferrovirt_launcher::qga::QgaOptions;
use ferrovirt_launcher::spec::{Accel, CpuModel, Disk, KernelBoot, LaunchSpec};
use ferrovirt_launcher::{StartOptions, Vm};
use ferrovirt_storage::provisioner::{DISK_IMAGE, VolumeRoot};
use ferrovirt_storage::snapshot;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn fill(img: &Path, bytes: u64) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new().write(true).open(img)?;
    let block = vec![0xa5u8; 4 << 20];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(block.len() as u64) as usize;
        f.write_all(&block[..n])?;
        left -= n as u64;
    }
    f.sync_all()
}

fn guest_dir() -> PathBuf {
    std::env::var_os("FERROVIRT_TEST_GUEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/test-guest"))
}

fn spec(dir: &Path, disks: &[(String, PathBuf)]) -> Result<LaunchSpec, Box<dyn std::error::Error>> {
    let g = guest_dir();
    let mut spec = LaunchSpec::new(
        "snapbench",
        "6f1c1f38-0b0e-4c55-9d6e-3a5f0f6a0b01",
        256,
        dir.join("qmp.sock"),
    );
    spec.kernel_boot = Some(KernelBoot {
        kernel: g.join("vmlinuz"),
        initrd: Some(g.join("initrd.img")),
        cmdline: Some(
            std::fs::read_to_string(g.join("cmdline"))?
                .trim()
                .to_string(),
        ),
    });
    spec.sockets.serial = Some(dir.join("serial.sock"));
    spec.sockets.serial_log = Some(dir.join("serial.log"));
    spec.sockets.guest_agent = Some(dir.join("qga.sock"));
    spec.accel = Accel::Tcg;
    spec.cpu.model = CpuModel::Max;
    spec.tcg_tb_size_mib = Some(64);
    spec.start_paused = true;
    for (id, path) in disks {
        let d: Disk = serde_json::from_value(serde_json::json!({
            "id": id, "path": path, "format": "raw", "bus": "virtio",
        }))?;
        spec.disks.push(d);
    }
    Ok(spec)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut runs = 5;
    if let Some(i) = args.iter().position(|a| a == "--runs") {
        runs = args.get(i + 1).ok_or("--runs N")?.parse()?;
        args.drain(i..=i + 1);
    }
    let dir = args
        .first()
        .ok_or("usage: online_snapshot_bench DIR SIZE_GIB...")?
        .clone();
    let root = VolumeRoot::new(&dir);
    // One guest with one data disk per size; the snapshots are taken in rounds, one of each
    // disk per round (the order alternating), so the shared machine's load spikes fall on
    // every size alike (measuring the sizes one after the other made the ratio swing).
    let mut vols = Vec::new();
    for size in &args[1..] {
        let gib: u64 = size.parse()?;
        let bytes = gib << 30;
        let name = format!("online-{gib}g");
        let vol = root.create(&name, bytes)?;
        fill(&vol.join(DISK_IMAGE), bytes)?;
        vols.push((gib, name, vol));
    }
    let vm_dir = Path::new(&dir).join("vm");
    std::fs::create_dir_all(&vm_dir)?;
    let opts = StartOptions {
        qemu: QemuOptions {
            log_path: Some(vm_dir.join("qemu.log")),
            ..QemuOptions::default()
        },
        qga: QgaOptions {
            sync_timeout: Duration::from_secs(20),
            command_timeout: Duration::from_secs(20),
            ..QgaOptions::default()
        },
        ..Default::default()
    };
    let disks: Vec<(String, PathBuf)> = vols
        .iter()
        .map(|(gib, _, vol)| (format!("disk-data-{gib}g"), vol.join(DISK_IMAGE)))
        .collect();
    let mut vm = Vm::start(spec(&vm_dir, &disks)?, &opts).await?;
    let mut console = vm.console(Duration::from_secs(10)).await?;
    vm.unpause().await?;
    console
        .wait_for(
            &Pattern::substring("FERROVIRT-READY"),
            Duration::from_secs(120),
        )
        .await?;
    vm.guest_agent().await?.ping().await?;
    let mut tops = Tops::default();
    let mut takes = vec![Vec::new(); vols.len()];
    let mut indications = Vec::new();
    let order = |round: usize| -> Vec<usize> {
        if round.is_multiple_of(2) {
            (0..vols.len()).collect()
        } else {
            (0..vols.len()).rev().collect()
        }
    };
    for round in 0..runs {
        for i in order(round) {
            let (_, _, vol) = &vols[i];
            let t = Instant::now();
            let plan = snapshot::prepare_online(vol)?;
            let overlay = [OverlayDisk {
                disk: disks[i].0.clone(),
                overlay: vol.join(&plan.new_top.file),
            }];
            let done = online_snapshot::take(
                &vm,
                &mut tops,
                &overlay,
                Duration::from_secs(60),
                online_snapshot::SnapshotGuest::Running,
            )
            .await?;
            snapshot::record_snapshot(vol, &plan)?;
            takes[i].push(t.elapsed());
            indications = done.indications;
        }
    }
    let _ = vm.kill().await;
    // The baseline, same volumes, same run: offline snapshots (no VM), interleaved alike.
    let mut offline = vec![Vec::new(); vols.len()];
    for round in 0..runs {
        for i in order(round) {
            let t = Instant::now();
            snapshot::take(&vols[i].2)?;
            offline[i].push(t.elapsed());
        }
    }
    let _ = std::fs::remove_dir_all(&vm_dir);
    for (i, (gib, name, _)) in vols.iter().enumerate() {
        root.delete(name)?;
        let mut sorted = takes[i].clone();
        sorted.sort();
        println!(
            "size={gib}GiB online_median={:.1}ms online_max={:.1}ms offline_median={:.1}ms online/offline={:.2} runs={runs} indications={} online_all_ms={:?}",
            median(takes[i].clone()).as_secs_f64() * 1e3,
            takes[i].iter().max().unwrap().as_secs_f64() * 1e3,
            median(offline[i].clone()).as_secs_f64() * 1e3,
            median(takes[i].clone()).as_secs_f64() / median(offline[i].clone()).as_secs_f64(),
            indications.join(","),
            sorted
                .iter()
                .map(|d| (d.as_secs_f64() * 1e4).round() / 10.0)
                .collect::<Vec<_>>()
        );
    }
    Ok(())
}
