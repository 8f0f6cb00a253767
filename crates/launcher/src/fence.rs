//! Self-fencing (docs/fencing.md): a launcher whose VM may be restarted on another node kills
//! its QEMU when it cannot confirm, by a deadline, that its node still holds its Lease. The
//! node agent writes a heartbeat file after every successful Lease renewal carrying the
//! `renewTime` it put into the Lease (not the time of the write, so a slow PUT cannot stretch
//! the deadline) and the `leaseDurationSeconds`; the launcher's deadline is
//! `renewTime + leaseDuration`, the same instant the control plane computes from the Lease
//! (which then waits a margin more before it replaces the VM). A hung, dead or cut-off agent
//! stops writing, so QEMU is killed by the deadline without any help from it.
//!
//! The check runs on a thread of its own (not the launcher's async main loop, which may be
//! busy in a graceful shutdown or a guest-agent call) every [`CHECK_INTERVAL`], and kills
//! QEMU through a pidfd taken while QEMU is an unreaped child, so the signal can never reach
//! a recycled pid.
//!
//! Second line of defence on shared storage: a storage lease, a small file next to each
//! shared disk (`<volume dir>/.ferrovirt-lease`, or `<image>.ferrovirt-lease`) naming its
//! holder (node, VMI uid) and an expiry equal to the holder's fence deadline. The watcher
//! renews it while the heartbeat is fresh and never after its deadline; a launcher does not
//! start QEMU while another holder's lease is unexpired.
//!
//! Our own code rather than a crate: the logic is a few comparisons of timestamps and one
//! syscall; no maintained crate does launcher-side lease fencing.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustix::process::{Pid, PidfdFlags, Signal};
use serde::{Deserialize, Serialize};

use crate::control::write_json_atomic;
use crate::error::Result;

/// How often the watcher reads the heartbeat.
pub const CHECK_INTERVAL: Duration = Duration::from_millis(250);
/// Name of the node-level heartbeat file in the agent's data dir.
pub const HEARTBEAT_FILE: &str = "heartbeat.json";
/// Suffix/name of a storage lease file.
pub const STORAGE_LEASE: &str = ".ferrovirt-lease";

/// What the agent writes after each successful Lease renewal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Heartbeat {
    pub node: String,
    /// The Lease's `renewTime`, milliseconds since the Unix epoch.
    pub renew_time_ms: i64,
    /// The Lease's `leaseDurationSeconds`.
    pub lease_duration_seconds: u32,
}

impl Heartbeat {
    /// `renewTime + leaseDuration`, milliseconds since the Unix epoch.
    pub fn deadline_ms(&self) -> i64 {
        self.renew_time_ms
            .saturating_add(i64::from(self.lease_duration_seconds) * 1000)
    }
}

/// How a launcher fences (part of `meta.json`; absent: it never fences).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FenceSpec {
    /// The agent's heartbeat file.
    pub heartbeat: PathBuf,
    /// The agent's last successful renewal when it started this launcher (used until a
    /// newer heartbeat is read).
    pub initial: Heartbeat,
    /// The node, written into storage leases.
    pub node: String,
    /// Storage lease files to hold (one per shared file-backed disk).
    #[serde(default)]
    pub storage_leases: Vec<PathBuf>,
}

/// A storage lease file's contents.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StorageLease {
    pub node: String,
    pub vmi_uid: String,
    /// The holder's fence deadline, milliseconds since the Unix epoch.
    pub expires_ms: i64,
}

/// Milliseconds since the Unix epoch (wall clock, the clock `renewTime` is on).
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// The fence deadline: that of the latest renewal known, the heartbeat file's or the one
/// the launcher was started with, each with its own duration (a shortened lease applies from
/// the renewal that wrote it, exactly as the control plane reads it from the Lease).
pub fn deadline(spec: &FenceSpec, heartbeat: Option<&Heartbeat>) -> i64 {
    match heartbeat {
        Some(hb) if hb.renew_time_ms >= spec.initial.renew_time_ms => hb.deadline_ms(),
        _ => spec.initial.deadline_ms(),
    }
}

/// Reads the heartbeat (`None`: missing or unreadable; the last good deadline stands).
pub fn read_heartbeat(path: &Path) -> Option<Heartbeat> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// Writes the heartbeat atomically (temp file + rename).
pub fn write_heartbeat(path: &Path, hb: &Heartbeat) -> Result<()> {
    write_json_atomic(path, hb)
}

/// The storage lease file for a shared disk at `path` (a volume directory holding the
/// image, or the image file itself).
pub fn storage_lease_path(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join(STORAGE_LEASE)
    } else {
        let mut name = path.file_name().unwrap_or_default().to_os_string();
        name.push(STORAGE_LEASE);
        path.with_file_name(name)
    }
}

/// Whether `lease` keeps `vmi_uid` from starting at `now`: another holder's unexpired lease.
pub fn held_by_other(lease: &StorageLease, vmi_uid: &str, now: i64) -> bool {
    lease.vmi_uid != vmi_uid && lease.expires_ms > now
}

fn read_storage_lease(path: &Path) -> Option<StorageLease> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// Takes every storage lease of `spec` for `vmi_uid` until `deadline`, waiting (up to
/// `max_wait`) for other holders' leases to expire. Errors name the holder.
pub fn acquire_storage_leases(
    spec: &FenceSpec,
    vmi_uid: &str,
    deadline: i64,
    max_wait: Duration,
) -> std::result::Result<(), String> {
    let give_up = now_ms().saturating_add(i64::try_from(max_wait.as_millis()).unwrap_or(0));
    for path in &spec.storage_leases {
        loop {
            let now = now_ms();
            match read_storage_lease(path) {
                Some(l) if held_by_other(&l, vmi_uid, now) => {
                    if now >= give_up {
                        return Err(format!(
                            "{} is held by VMI {} on node {} until {} ms (epoch)",
                            path.display(),
                            l.vmi_uid,
                            l.node,
                            l.expires_ms
                        ));
                    }
                    std::thread::sleep(CHECK_INTERVAL);
                }
                _ => break,
            }
        }
    }
    renew_storage_leases(spec, vmi_uid, deadline);
    Ok(())
}

/// Writes our storage leases with expiry `deadline` (only ever called before it).
pub fn renew_storage_leases(spec: &FenceSpec, vmi_uid: &str, deadline: i64) {
    for path in &spec.storage_leases {
        let lease = StorageLease {
            node: spec.node.clone(),
            vmi_uid: vmi_uid.to_string(),
            expires_ms: deadline,
        };
        if let Err(e) = write_json_atomic(path, &lease) {
            tracing::warn!("storage lease {}: {e}", path.display());
        }
    }
}

/// Removes our storage leases (QEMU is gone). Only a lease this node holds for `vmi_uid`:
/// after a live migration the same VMI's lease belongs to the target node.
pub fn release_storage_leases(spec: &FenceSpec, vmi_uid: &str) {
    for path in &spec.storage_leases {
        if read_storage_lease(path).is_some_and(|l| l.vmi_uid == vmi_uid && l.node == spec.node) {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// What the watcher did: set once QEMU was killed for a lost lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fenced {
    /// When QEMU was killed (ms since the epoch).
    pub at_ms: i64,
    /// The deadline it missed.
    pub deadline_ms: i64,
    /// The last renewal the launcher saw (ms since the epoch), if any heartbeat was read.
    pub last_renew_ms: Option<i64>,
}

impl Fenced {
    /// The exit report's message.
    pub fn message(&self) -> String {
        let renewed = match self.last_renew_ms {
            Some(r) => format!("last renewal seen at {}", fmt_ms(r)),
            None => "no renewal seen since the launcher started".to_string(),
        };
        format!(
            "self-fencing: the node's lease could not be confirmed by {} ({renewed}); QEMU was \
             killed at {}",
            fmt_ms(self.deadline_ms),
            fmt_ms(self.at_ms)
        )
    }
}

fn fmt_ms(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms)
        .map(|t| t.to_string())
        .unwrap_or_else(|_| format!("{ms} ms"))
}

/// The watcher thread's handle: stop it once QEMU is gone, read whether it fenced.
#[derive(Debug, Clone)]
pub struct Watcher {
    stop: Arc<AtomicBool>,
    fenced: Arc<Mutex<Option<Fenced>>>,
}

impl Watcher {
    /// Stops the watcher (QEMU exited on its own).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Whether, when and why it killed QEMU.
    pub fn fenced(&self) -> Option<Fenced> {
        self.fenced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// A pidfd for `pid` (a child not yet reaped), so a later kill cannot hit a recycled pid.
fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    let pid = Pid::from_raw(i32::try_from(pid).ok()?)?;
    match rustix::process::pidfd_open(pid, PidfdFlags::empty()) {
        Ok(fd) => Some(fd),
        Err(e) => {
            tracing::warn!("fencing: pidfd_open: {e}; falling back to kill(2)");
            None
        }
    }
}

fn kill_qemu(pidfd: Option<&OwnedFd>, pid: u32) {
    let r = match pidfd {
        Some(fd) => rustix::process::pidfd_send_signal(fd, Signal::KILL),
        None => match i32::try_from(pid).ok().and_then(Pid::from_raw) {
            Some(pid) => rustix::process::kill_process(pid, Signal::KILL),
            None => return,
        },
    };
    if let Err(e) = r {
        tracing::warn!("fencing: killing QEMU: {e}");
    }
}

/// Starts the watcher for QEMU `qemu_pid` (an unreaped child of this process).
pub fn watch(spec: FenceSpec, vmi_uid: String, qemu_pid: u32) -> Watcher {
    watch_holding(spec, vmi_uid, qemu_pid, Arc::new(AtomicBool::new(true)))
}

/// [`watch`], renewing the storage leases only while `holding` is set: a live-migration
/// target holds its disks from the moment its guest runs, a migration source stops holding
/// them once its state was sent (docs/migration.md). The fence itself is always armed.
pub fn watch_holding(
    spec: FenceSpec,
    vmi_uid: String,
    qemu_pid: u32,
    holding: Arc<AtomicBool>,
) -> Watcher {
    let w = Watcher {
        stop: Arc::new(AtomicBool::new(false)),
        fenced: Arc::new(Mutex::new(None)),
    };
    let handle = w.clone();
    let pidfd = pidfd_open(qemu_pid);
    let spawned = std::thread::Builder::new()
        .name("fence".into())
        .spawn(move || {
            let mut last: Option<Heartbeat> = None;
            while !w.stop.load(Ordering::SeqCst) {
                if let Some(hb) = read_heartbeat(&spec.heartbeat) {
                    last = Some(hb);
                }
                let deadline = deadline(&spec, last.as_ref());
                let now = now_ms();
                if now > deadline {
                    kill_qemu(pidfd.as_ref(), qemu_pid);
                    let f = Fenced {
                        at_ms: now,
                        deadline_ms: deadline,
                        last_renew_ms: last.as_ref().map(|h| h.renew_time_ms),
                    };
                    tracing::error!("{}", f.message());
                    *w.fenced.lock().unwrap_or_else(|p| p.into_inner()) = Some(f);
                    break;
                }
                if holding.load(Ordering::SeqCst) {
                    renew_storage_leases(&spec, &vmi_uid, deadline);
                }
                std::thread::sleep(CHECK_INTERVAL);
            }
        });
    if let Err(e) = spawned {
        tracing::error!("fencing: cannot start the watcher thread: {e}; killing QEMU");
        kill_qemu(None, qemu_pid);
    }
    handle
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A spec started with a renewal whose deadline is `initial` (1 s lease).
    fn spec(dir: &Path, initial: i64) -> FenceSpec {
        FenceSpec {
            heartbeat: dir.join(HEARTBEAT_FILE),
            initial: Heartbeat {
                node: "n1".into(),
                renew_time_ms: initial - 1000,
                lease_duration_seconds: 1,
            },
            node: "n1".into(),
            storage_leases: vec![dir.join(STORAGE_LEASE)],
        }
    }

    #[test]
    fn deadline_is_renew_time_plus_duration_never_earlier_than_the_initial_one() {
        let d = tempfile::tempdir().unwrap();
        let s = spec(d.path(), 10_000);
        assert_eq!(deadline(&s, None), 10_000);
        let hb = Heartbeat {
            node: "n1".into(),
            renew_time_ms: 9_000,
            lease_duration_seconds: 8,
        };
        assert_eq!(deadline(&s, Some(&hb)), 17_000);
        let old = Heartbeat {
            renew_time_ms: 1_000,
            ..hb.clone()
        };
        assert_eq!(deadline(&s, Some(&old)), 10_000);
        // A shorter lease written by a newer renewal applies at once, even when the deadline
        // it gives is earlier than the initial one.
        let shorter = Heartbeat {
            renew_time_ms: 9_500,
            lease_duration_seconds: 0,
            ..hb.clone()
        };
        assert_eq!(deadline(&s, Some(&shorter)), 9_500);
        write_heartbeat(&s.heartbeat, &hb).unwrap();
        assert_eq!(read_heartbeat(&s.heartbeat), Some(hb));
    }

    #[test]
    fn storage_lease_paths() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(
            storage_lease_path(d.path()),
            d.path().join(".ferrovirt-lease")
        );
        assert_eq!(
            storage_lease_path(&d.path().join("disk.img")),
            d.path().join("disk.img.ferrovirt-lease")
        );
    }

    #[test]
    fn a_storage_lease_held_by_another_vmi_blocks_until_it_expires() {
        let d = tempfile::tempdir().unwrap();
        let s = spec(d.path(), 0);
        let now = now_ms();
        let other = StorageLease {
            node: "n2".into(),
            vmi_uid: "old".into(),
            expires_ms: now + 600,
        };
        assert!(held_by_other(&other, "new", now));
        assert!(!held_by_other(&other, "old", now), "our own lease");
        assert!(!held_by_other(&other, "new", now + 600), "expired");
        write_json_atomic(&s.storage_leases[0], &other).unwrap();
        // Not given time: refused, naming the holder.
        let err = acquire_storage_leases(&s, "new", now + 8000, Duration::ZERO).unwrap_err();
        assert!(err.contains("VMI old on node n2"), "{err}");
        // Given time: waits the holder out, then holds it.
        let t0 = std::time::Instant::now();
        acquire_storage_leases(&s, "new", now + 8000, Duration::from_secs(5)).unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(300));
        let mine = read_storage_lease(&s.storage_leases[0]).unwrap();
        assert_eq!(
            (mine.vmi_uid.as_str(), mine.expires_ms),
            ("new", now + 8000)
        );
        release_storage_leases(&s, "other");
        assert!(s.storage_leases[0].exists(), "only the holder releases");
        let mut elsewhere = s.clone();
        elsewhere.node = "node-b".into();
        release_storage_leases(&elsewhere, "new");
        assert!(
            s.storage_leases[0].exists(),
            "the same VMI on another node (a migration's other side) does not release it"
        );
        release_storage_leases(&s, "new");
        assert!(!s.storage_leases[0].exists());
    }

    #[test]
    fn watcher_kills_its_process_at_the_deadline_and_not_before() {
        let d = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let start = now_ms();
        let mut s = spec(d.path(), start + 700);
        s.storage_leases.clear();
        let w = watch(s.clone(), "u".into(), child.id());
        // A fresh heartbeat moves the deadline out: renewed now, 1 s lease.
        write_heartbeat(
            &s.heartbeat,
            &Heartbeat {
                node: "n1".into(),
                renew_time_ms: start,
                lease_duration_seconds: 1,
            },
        )
        .unwrap();
        let status = child.wait().unwrap();
        let took = now_ms() - start;
        assert!(!status.success());
        assert!(took >= 1000, "killed after {took} ms, before the deadline");
        assert!(took < 1000 + 600, "killed {took} ms after the start");
        let f = w.fenced().expect("fenced");
        assert_eq!(f.deadline_ms, start + 1000);
        assert!(
            f.message().contains("could not be confirmed"),
            "{}",
            f.message()
        );
    }

    #[test]
    fn a_stopped_watcher_kills_nothing() {
        let d = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("2")
            .spawn()
            .unwrap();
        let s = spec(d.path(), now_ms() + 300);
        let w = watch(s, "u".into(), child.id());
        w.stop();
        assert!(child.wait().unwrap().success());
        assert_eq!(w.fenced(), None);
    }
}
