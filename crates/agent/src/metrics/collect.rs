//! Gathering one scrape's [`VmiSample`]s on this node: for every VMI directory, who it is
//! (`meta.json`) and its guest memory (`spec.json`), the launcher's run phase and QEMU pid
//! (the control handshake), its block statistics (the `stats` request) and, for a running
//! QEMU, its outgoing migration (`query-migrate`), then QEMU's CPU
//! time, resident memory, vCPU threads and tap counters from `/proc`. Every launcher is asked at the same
//! time and given [`LAUNCHER_BUDGET`] in all: a VMI whose launcher does not answer in time is
//! left out of the scrape (a launcher that answers the handshake but not `stats` keeps its
//! info, CPU and memory series and lacks the storage ones).

use std::path::Path;
use std::time::Duration;

use ferrovirt_launcher::control::{LaunchMeta, LauncherClient, Request, RunPhase, files};
use ferrovirt_launcher::spec::{LaunchSpec, NicBackend};

use super::parse::{self, DriveStats};
use super::{ProcessSample, VmiSample, phase_label};
use crate::launchers::LauncherConfig;

/// How long one launcher may take for its handshake and its stats together (below a
/// Prometheus scrape timeout of 1 s).
pub const LAUNCHER_BUDGET: Duration = Duration::from_millis(750);

/// Every VMI on this node that answers in time, sorted by namespace and name.
pub async fn collect(cfg: &LauncherConfig) -> Vec<VmiSample> {
    let uids = cfg.local_uids();
    let tasks = uids.into_iter().map(|uid| {
        let dir = cfg.vmi_dir(&uid);
        async move {
            tokio::time::timeout(LAUNCHER_BUDGET, from_launcher(&dir))
                .await
                .ok()
                .flatten()
                .map(|partial| (dir, partial))
        }
    });
    let answered: Vec<_> = futures::future::join_all(tasks)
        .await
        .into_iter()
        .flatten()
        .collect();
    // The /proc and file reads are blocking: off the async workers.
    let mut samples = tokio::task::spawn_blocking(move || {
        answered
            .into_iter()
            .filter_map(|(dir, partial)| finish(&dir, partial))
            .collect::<Vec<_>>()
    })
    .await
    .unwrap_or_default();
    samples.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    samples
}

/// What the launcher said: run phase, QEMU's pid, drives and the guest's memory (when
/// `stats` answered).
struct FromLauncher {
    phase: &'static str,
    qemu_pid: Option<u32>,
    drives: Vec<DriveStats>,
    guest_memory: Option<parse::GuestMemory>,
    migration: Option<super::migration::MigrationSample>,
    disk_transfer_rate: Option<f64>,
}

async fn from_launcher(dir: &Path) -> Option<FromLauncher> {
    let mut client = LauncherClient::connect(dir, LAUNCHER_BUDGET).await.ok()?;
    let hello = client.hello.clone();
    let (drives, guest_memory) = match client
        .request_with_timeout(&Request::Stats, LAUNCHER_BUDGET)
        .await
    {
        Ok(v) => (
            parse::parse_blockstats(v.get("blockstats").unwrap_or(&serde_json::Value::Null)),
            parse::parse_guest_memory(&v),
        ),
        Err(e) => {
            tracing::debug!(dir = %dir.display(), "no block stats: {e}");
            (Vec::new(), None)
        }
    };
    // A running QEMU may be sending itself: QMP `query-migrate` (answered at once, also
    // while the agent follows the migration).
    let status = match hello.phase {
        RunPhase::Running | RunPhase::Paused => client
            .request_with_timeout(&Request::MigrationStatus, LAUNCHER_BUDGET)
            .await
            .ok(),
        _ => None,
    };
    let migration = status
        .as_ref()
        .and_then(|v| super::migration::from_query_migrate(v, unix_now()));
    let disk_transfer_rate = status
        .as_ref()
        .and_then(super::migration::disk_transfer_rate);
    Some(FromLauncher {
        phase: phase_label(hello.phase),
        qemu_pid: hello.qemu_pid,
        drives,
        guest_memory,
        migration,
        disk_transfer_rate,
    })
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

/// Adds the VMI's identity, memory size and QEMU's `/proc` numbers; `None` without a
/// readable `meta.json`.
fn finish(dir: &Path, l: FromLauncher) -> Option<VmiSample> {
    let meta: LaunchMeta =
        serde_json::from_slice(&std::fs::read(dir.join(files::META)).ok()?).ok()?;
    let spec: Option<LaunchSpec> = std::fs::read(dir.join(files::SPEC))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let proc = Path::new("/proc");
    let interfaces = match (&spec, l.qemu_pid) {
        (Some(s), Some(pid)) => interface_stats(proc, pid, s, &meta.interfaces),
        _ => Vec::new(),
    };
    Some(VmiSample {
        name: meta.name,
        namespace: meta.namespace,
        phase: l.phase.to_string(),
        info: meta.info_labels,
        domain_bytes: spec.map(|s| s.memory_mib.saturating_mul(1 << 20)),
        process: l.qemu_pid.and_then(|pid| process_sample(proc, pid)),
        drives: l.drives,
        interfaces,
        guest_memory: l.guest_memory,
        migration: l.migration,
        disk_transfer_rate: l.disk_transfer_rate,
    })
}

/// The counters of the VMI's tap-backed NICs, read from `<proc>/<pid>/net/dev`: QEMU runs
/// in the VMI's network namespace, where its taps are.
pub fn interface_stats(
    proc: &Path,
    pid: u32,
    spec: &LaunchSpec,
    names: &[String],
) -> Vec<super::InterfaceStats> {
    let taps: Vec<(&str, &str)> = spec
        .nics
        .iter()
        .filter_map(|n| match &n.backend {
            NicBackend::Tap { ifname, .. } => Some((n.id.as_str(), ifname.as_str())),
            _ => None,
        })
        .collect();
    if taps.is_empty() {
        return Vec::new();
    }
    let Ok(text) = std::fs::read_to_string(proc.join(pid.to_string()).join("net/dev")) else {
        return Vec::new();
    };
    taps.into_iter()
        .filter_map(|(id, tap)| {
            let s = parse::parse_net_dev(&text, tap)?;
            Some(super::InterfaceStats::from_tap(
                &parse::interface_name(id, names),
                &s,
            ))
        })
        .collect()
}

/// QEMU's CPU time, resident memory and vCPU thread times from `<proc>/<pid>`.
pub fn process_sample(proc: &Path, pid: u32) -> Option<ProcessSample> {
    let dir = proc.join(pid.to_string());
    let stat = parse::parse_proc_stat(&std::fs::read_to_string(dir.join("stat")).ok()?)?;
    let ticks = rustix::param::clock_ticks_per_second();
    let page = rustix::param::page_size() as u64;
    let mut vcpu_seconds = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir.join("task")) {
        for task in rd.flatten() {
            let t = task.path();
            let Some(id) = std::fs::read_to_string(t.join("comm"))
                .ok()
                .and_then(|c| parse::vcpu_id(&c))
            else {
                continue;
            };
            if let Some(s) = std::fs::read_to_string(t.join("stat"))
                .ok()
                .and_then(|l| parse::parse_proc_stat(&l))
            {
                vcpu_seconds.push((id, s.cpu_seconds(ticks)));
            }
        }
    }
    vcpu_seconds.sort_by_key(|(id, _)| *id);
    Some(ProcessSample {
        cpu_seconds: stat.cpu_seconds(ticks),
        resident_bytes: stat.rss_pages.saturating_mul(page),
        vcpu_seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process_from_proc() {
        let p = process_sample(Path::new("/proc"), std::process::id()).unwrap();
        assert!(p.resident_bytes > 0);
        assert!(p.cpu_seconds >= 0.0);
        assert!(process_sample(Path::new("/proc"), u32::MAX).is_none());
    }

    /// A launcher that accepts the connection and never answers costs the scrape at most
    /// the budget, and its VMI is left out.
    #[tokio::test]
    async fn a_hung_launcher_is_left_out_within_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = LauncherConfig {
            binary: "ferrovirt".into(),
            data_dir: dir.path().to_path_buf(),
            qemu_binary: "qemu-system-x86_64".into(),
        };
        let vmi = cfg.vmi_dir("hung");
        std::fs::create_dir_all(&vmi).unwrap();
        let listener = tokio::net::UnixListener::bind(vmi.join(files::CONTROL)).unwrap();
        let _held = tokio::spawn(async move {
            let mut conns = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                conns.push(s); // never read, never answered
            }
        });
        // And a directory without any launcher.
        std::fs::create_dir_all(cfg.vmi_dir("gone")).unwrap();
        let t = std::time::Instant::now();
        let samples = collect(&cfg).await;
        assert!(samples.is_empty());
        assert!(
            t.elapsed() < LAUNCHER_BUDGET + Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
    }
}
