//! Full-backup throughput of one raw image to an S3 endpoint (bench/backup.sh): each run writes
//! the image as a new backup under a fresh prefix (so nothing is deduplicated against an
//! earlier run) and prints the seconds and MiB/s. Then, in the same repository, 5 % of the image
//! is rewritten with new random bytes (three runs of whole chunks) and an incremental backup
//! writes only those chunks (read from the file at their offsets, as the layer chain names
//! them; the rest from the full backup's index): its seconds, bytes read and uploaded. Last, the
//! full backup is restored into a new file beside the image (every chunk fetched, authenticated,
//! decompressed and written, as a BackupRestore writes a disk), checked byte for byte against
//! the image, and its seconds and MiB/s printed.
//! Usage: backup_bench ENDPOINT BUCKET IMAGE RUNS

use std::time::Instant;

use ferrovirt_backup::repo::{Create, Repository};
use ferrovirt_backup::{S3Target, Target};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args: Vec<String> = std::env::args().collect();
    let [_, endpoint, bucket, image, runs] = &args[..] else {
        return Err("usage: backup_bench ENDPOINT BUCKET IMAGE RUNS".into());
    };
    let size = std::fs::metadata(image)?.len() as f64;
    for run in 0..runs.parse::<u32>()? {
        let target = Target::S3 {
            s3: S3Target {
                endpoint: endpoint.clone(),
                bucket: bucket.clone(),
                access_key_id: "testing".into(),
                secret_access_key: "testing".into(),
                path_style: true,
                ..Default::default()
            },
            prefix: format!("bench-{}-{run}", std::process::id()),
        };
        let t0 = Instant::now();
        let repo =
            Repository::open(&target, b"benchmark key 0123456789", Create::IfMissing).await?;
        let mut w = repo.begin("full").await?;
        let file = tokio::fs::File::open(image).await?;
        w.write_disk("disk", file, &|_| {}).await?;
        w.commit("2026-01-01T00:00:00Z", vec![], vec![]).await?;
        let secs = t0.elapsed().as_secs_f64();
        println!(
            "run={run} seconds={secs:.3} mib_s={:.1}",
            size / secs / 1048576.0
        );
        incremental(&repo, image, run).await?;
        restore(&repo, image, run).await?;
    }
    Ok(())
}

/// The changed chunks of a 5 % rewrite: three runs of whole chunks at 10 %, 50 % and 90 %.
fn changed_chunks(count: u64) -> Vec<u64> {
    let per_run = (count * 5).div_ceil(100).div_ceil(3).max(1);
    let mut out: Vec<u64> = [count / 10, count / 2, count * 9 / 10]
        .iter()
        .flat_map(|&start| start..(start + per_run).min(count))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

async fn incremental(
    repo: &Repository,
    image: &str,
    run: u32,
) -> Result<(), Box<dyn std::error::Error>> {
    use ferrovirt_backup::format::CHUNK_SIZE;
    use std::io::{Read, Seek, SeekFrom};
    let size = std::fs::metadata(image)?.len();
    let chunks = changed_chunks(size.div_ceil(CHUNK_SIZE as u64));
    // The changed chunks' new bytes (fresh random data), as the chain would serve them.
    let mut f = std::fs::File::open(image)?;
    let mut changed = Vec::new();
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ u64::from(run);
    for &i in &chunks {
        let off = i * CHUNK_SIZE as u64;
        let len = (size - off).min(CHUNK_SIZE as u64) as usize;
        let mut buf = vec![0u8; len];
        f.seek(SeekFrom::Start(off))?;
        f.read_exact(&mut buf)?;
        for b in buf.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        changed.extend_from_slice(&buf);
    }
    let t0 = Instant::now();
    let base = repo.index("full", "disk").await?;
    let mut w = repo.begin("incremental").await?;
    let e = w
        .write_disk_changed("disk", &base, size, &chunks, &changed[..], &|_| {})
        .await?;
    w.commit("2026-01-01T01:00:00Z", vec![], vec![]).await?;
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "incremental run={run} seconds={secs:.3} changed_pct={:.1} read={} uploaded={} reused={}",
        e.stats.bytes_read as f64 * 100.0 / size as f64,
        e.stats.bytes_read,
        e.stats.bytes_uploaded,
        e.stats.bytes_reused
    );
    Ok(())
}

async fn restore(
    repo: &Repository,
    image: &str,
    run: u32,
) -> Result<(), Box<dyn std::error::Error>> {
    use tokio::io::AsyncWriteExt;
    let out_path = format!("{image}.restored");
    let t0 = Instant::now();
    let mut out = tokio::fs::File::create(&out_path).await?;
    let n = repo.restore_disk("full", "disk", &mut out, &|_| {}).await?;
    out.flush().await?;
    drop(out);
    let secs = t0.elapsed().as_secs_f64();
    if !same_contents(image, &out_path)? {
        return Err(format!("restored {out_path} differs from {image}").into());
    }
    std::fs::remove_file(&out_path)?;
    println!(
        "restore run={run} seconds={secs:.3} mib_s={:.1} bytes={n}",
        n as f64 / secs / 1048576.0
    );
    Ok(())
}

/// Whether two files hold the same bytes.
fn same_contents(a: &str, b: &str) -> std::io::Result<bool> {
    use std::io::Read;
    let (mut fa, mut fb) = (std::fs::File::open(a)?, std::fs::File::open(b)?);
    if fa.metadata()?.len() != fb.metadata()?.len() {
        return Ok(false);
    }
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let n = fa.read(&mut ba)?;
        if n == 0 {
            return Ok(true);
        }
        fb.read_exact(&mut bb[..n])?;
        if ba[..n] != bb[..n] {
            return Ok(false);
        }
    }
}
