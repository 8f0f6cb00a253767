//! Full-backup throughput of one raw image to an S3 endpoint (bench/backup.sh): each run writes
//! the image as a new backup under a fresh prefix (so nothing is deduplicated against an
//! earlier run) and prints the seconds and MiB/s.
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
    }
    Ok(())
}
