//! `bench/snapshot.sh`'s measurement: snapshot creation time of fully written volumes of
//! several sizes (goal: the largest within 1.5× the smallest) and the time to restore one
//! into a new raw image, with `ferrovirt_storage::snapshot`, the code the node agents run.
//!
//! `cargo run --example snapshot_bench -p ferrovirt-storage -- DIR SIZE_GIB... [--runs N]
//! [--restore-max-gib N]` (restores only sizes up to N GiB, default 4: a second full copy)
//! writes each volume in DIR (deleted afterwards), takes the snapshots of all sizes in
//! interleaved rounds and prints one line per size.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use ferrovirt_storage::provisioner::{DISK_IMAGE, VolumeRoot};
use ferrovirt_storage::snapshot;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Fill `img` with non-zero data (every block written, nothing sparse).
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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut runs = 5;
    // Restoring writes a second full copy: only sizes up to this many GiB (disk space).
    let mut restore_max = 4;
    if let Some(i) = args.iter().position(|a| a == "--restore-max-gib") {
        restore_max = args.get(i + 1).ok_or("--restore-max-gib N")?.parse()?;
        args.drain(i..=i + 1);
    }
    if let Some(i) = args.iter().position(|a| a == "--runs") {
        runs = args.get(i + 1).ok_or("--runs N")?.parse()?;
        args.drain(i..=i + 1);
    }
    let dir = args
        .first()
        .ok_or("usage: snapshot_bench DIR SIZE_GIB...")?
        .clone();
    let root = VolumeRoot::new(&dir);
    // Every volume is written first; then the snapshots are taken in rounds, one of each
    // size per round (the order alternating), so a load spike of the shared machine falls
    // on all sizes alike instead of on whichever size was measured during it.
    type Vol = (
        u64,
        String,
        std::path::PathBuf,
        Duration,
        Vec<Duration>,
        Vec<String>,
    );
    let mut vols: Vec<Vol> = Vec::new();
    for size in &args[1..] {
        let gib: u64 = size.parse()?;
        let bytes = gib << 30;
        let name = format!("bench-{gib}g");
        let vol = root.create(&name, bytes)?;
        let t = Instant::now();
        fill(&vol.join(DISK_IMAGE), bytes)?;
        vols.push((gib, name, vol, t.elapsed(), Vec::new(), Vec::new()));
    }
    for round in 0..runs as usize {
        let order: Vec<usize> = if round.is_multiple_of(2) {
            (0..vols.len()).collect()
        } else {
            (0..vols.len()).rev().collect()
        };
        for i in order {
            let (_, _, vol, _, takes, handles) = &mut vols[i];
            let t = Instant::now();
            handles.push(snapshot::take(vol)?);
            takes.push(t.elapsed());
        }
    }
    for (gib, name, vol, write, takes, handles) in vols {
        // Restore the first snapshot (the full written disk) into a new image, once.
        let restore = if gib <= restore_max {
            let out = Path::new(&dir).join(format!("restored-{gib}g.img"));
            let t = Instant::now();
            snapshot::export_raw(&vol, Some(&handles[0]), &out)?;
            let took = t.elapsed();
            std::fs::remove_file(&out)?;
            format!("{:.1}s", took.as_secs_f64())
        } else {
            "skipped".to_string()
        };
        root.delete(&name)?;
        let mut sorted = takes.clone();
        sorted.sort();
        println!(
            "size={gib}GiB written_in={:.1}s snapshot_median={:.1}ms snapshot_max={:.1}ms runs={runs} restore_to_new_volume={} all_ms={:?}",
            write.as_secs_f64(),
            median(takes.clone()).as_secs_f64() * 1e3,
            takes.iter().max().unwrap().as_secs_f64() * 1e3,
            restore,
            sorted
                .iter()
                .map(|d| (d.as_secs_f64() * 1e4).round() / 10.0)
                .collect::<Vec<_>>()
        );
    }
    Ok(())
}
