//! The `/metrics` benchmark (`bench/metrics.sh`, an ignored test): N VMI directories, each
//! with a stand-in launcher on its `control.sock` that answers the handshake, `stats` and
//! `migrationStatus` (no migration) as a launcher does (a canned `query-blockstats` reply of two drives; this process as "QEMU",
//! so `/proc` is read for real, its `lo` as the VMI's tap), then the scrape path (`collect` + `render`) timed M times
//! against a baseline of reading `/proc/<pid>/stat` N times. Prints medians and the size.

use std::time::{Duration, Instant};

use ferrovirt_launcher::LaunchSpec;
use ferrovirt_launcher::control::{LaunchMeta, Reply, files};
use ferrovirt_launcher::spec::{Nic, NicBackend};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::launchers::LauncherConfig;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A stand-in launcher: answers every request line of every connection.
async fn fake_launcher(listener: tokio::net::UnixListener, uid: String) {
    let status = serde_json::json!({
        "version": 1, "launcherPid": std::process::id(), "qemuPid": std::process::id(),
        "vmiUid": uid, "phase": "Running", "guestAgentConnected": false, "startedAt": 0
    });
    let stats = serde_json::json!({"blockstats": [
        {"device": "", "qdev": "/machine/peripheral/disk-root/virtio-backend",
         "stats": {"rd_bytes": 123456789, "wr_bytes": 4096, "rd_operations": 3000,
                   "wr_operations": 10, "rd_total_time_ns": 1000000}},
        {"device": "", "qdev": "/machine/peripheral/disk-data/virtio-backend",
         "stats": {"rd_bytes": 1, "wr_bytes": 2}}
    ]});
    while let Ok((s, _)) = listener.accept().await {
        let (status, stats) = (status.clone(), stats.clone());
        tokio::spawn(async move {
            let (r, mut w) = s.into_split();
            let mut lines = BufReader::new(r).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let reply = if line.contains("\"stats\"") {
                    Reply::ok(&stats)
                } else if line.contains("\"migrationStatus\"") {
                    // QEMU's `query-migrate` without a migration.
                    Reply::ok(serde_json::json!({}))
                } else {
                    Reply::ok(&status)
                };
                let mut text = serde_json::to_string(&reply).unwrap_or_default();
                text.push('\n');
                if w.write_all(text.as_bytes()).await.is_err() {
                    break;
                }
            }
        });
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: bench/metrics.sh"]
async fn metrics_scrape_benchmark() {
    let n = env_or("FERROVIRT_METRICS_VMIS", 100);
    let rounds = env_or("FERROVIRT_METRICS_ROUNDS", 21);
    let dir = tempfile::tempdir().unwrap();
    let cfg = LauncherConfig {
        binary: "ferrovirt".into(),
        data_dir: dir.path().to_path_buf(),
        qemu_binary: "qemu-system-x86_64".into(),
    };
    for i in 0..n {
        let uid = format!("uid-{i}");
        let vmi = cfg.vmi_dir(&uid);
        std::fs::create_dir_all(&vmi).unwrap();
        let meta = LaunchMeta {
            vmi_uid: uid.clone(),
            namespace: "default".into(),
            name: format!("vm-{i}"),
            grace_seconds: 30,
            qemu_binary: "qemu-system-x86_64".into(),
            fence: None,
            interfaces: vec!["default".into()],
            info_labels: Default::default(),
        };
        std::fs::write(vmi.join(files::META), serde_json::to_vec(&meta).unwrap()).unwrap();
        // A real spec: 128 MiB and one tap NIC, played by this process's `lo`.
        let mut spec = LaunchSpec::new(format!("vm-{i}"), uid.clone(), 128, vmi.join("qmp.sock"));
        spec.nics.push(Nic {
            id: "net0".into(),
            mac: None,
            model: Default::default(),
            backend: NicBackend::Tap {
                ifname: "lo".into(),
                queues: 1,
            },
            boot_order: None,
        });
        std::fs::write(vmi.join(files::SPEC), serde_json::to_vec(&spec).unwrap()).unwrap();
        let listener = tokio::net::UnixListener::bind(vmi.join(files::CONTROL)).unwrap();
        tokio::spawn(fake_launcher(listener, uid));
    }
    let mut scrape = Vec::new();
    let mut rendering = Vec::new();
    let mut size = 0;
    let mut series = 0;
    for _ in 0..rounds {
        let t = Instant::now();
        let samples = super::collect::collect(&cfg).await;
        let r = Instant::now();
        let text = super::render("node1", &samples);
        rendering.push(r.elapsed());
        scrape.push(t.elapsed());
        assert_eq!(samples.len(), n);
        assert!(
            samples.iter().all(|s| s.domain_bytes.is_some()
                && s.interfaces.len() == 1
                && s.drives.len() == 2),
            "{:?}",
            samples.first()
        );
        size = text.len();
        series = text.lines().filter(|l| !l.starts_with('#')).count();
    }
    let stat = format!("/proc/{}/stat", std::process::id());
    let mut baseline = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(std::fs::read_to_string(&stat).unwrap());
        }
        baseline.push(t.elapsed());
    }
    println!(
        "metrics bench: {n} VMIs, {rounds} rounds: /metrics collect+render median {:.2} ms \
         (render {:.2} ms; {size} bytes, {series} series); baseline {n}× read /proc/PID/stat \
         median {:.2} ms",
        median(scrape).as_secs_f64() * 1e3,
        median(rendering).as_secs_f64() * 1e3,
        median(baseline).as_secs_f64() * 1e3,
    );
}
