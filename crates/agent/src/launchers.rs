//! Launcher processes on this node: starting one detached `ferrovirt launcher` per VMI (its own
//! process group, so an agent restart or kill leaves VMs running), finding them again from their
//! directories (adoption is stateless: a live `control.sock` is a running launcher), and talking
//! to them over the control protocol.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ferrovirt_launcher::LaunchSpec;
use ferrovirt_launcher::control::{
    LaunchMeta, LauncherClient, Request, files, read_exit_report, write_json_atomic,
};

use crate::decide::Observed;
use crate::error::AgentError;

/// How to start launchers.
#[derive(Debug, Clone)]
pub struct LauncherConfig {
    /// The `ferrovirt` binary (run as `ferrovirt launcher --dir DIR`).
    pub binary: PathBuf,
    /// Where VMI directories live (`<data_dir>/vmis/<uid>`).
    pub data_dir: PathBuf,
    pub qemu_binary: PathBuf,
}

/// Tracks the launcher children this agent process started, to reap them when they exit.
#[derive(Debug, Default)]
pub struct Launchers {
    children: HashMap<String, Child>,
}

/// How long a control request may take before the launcher counts as unresponsive.
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);

impl LauncherConfig {
    /// The directory of the VMI with `uid`.
    pub fn vmi_dir(&self, uid: &str) -> PathBuf {
        ferrovirt_launcher::daemon::vmi_dir(&self.data_dir, uid)
    }

    /// UIDs of every VMI directory on this node.
    pub fn local_uids(&self) -> Vec<String> {
        let Ok(rd) = std::fs::read_dir(self.data_dir.join("vmis")) else {
            return Vec::new();
        };
        rd.filter_map(|e| e.ok())
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().into_string().ok())
            .collect()
    }
}

impl Launchers {
    /// Writes the spec and metadata and starts a detached launcher for it.
    pub fn start(
        &mut self,
        cfg: &LauncherConfig,
        spec: &LaunchSpec,
        meta: &LaunchMeta,
    ) -> Result<(), AgentError> {
        self.start_in(cfg, spec, meta, &[])
    }

    /// Like [`Launchers::start`], with the launcher's command line prefixed by `exec_prefix`
    /// (`nsenter --net=/run/netns/<ns> --` to run it in the VMI's network namespace).
    pub fn start_in(
        &mut self,
        cfg: &LauncherConfig,
        spec: &LaunchSpec,
        meta: &LaunchMeta,
        exec_prefix: &[String],
    ) -> Result<(), AgentError> {
        let (dir, mut cmd) = launcher_command(cfg, &meta.vmi_uid, exec_prefix)?;
        write_json_atomic(&dir.join(files::SPEC), spec)?;
        write_json_atomic(&dir.join(files::META), meta)?;
        let child = cmd
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| AgentError::io(&cfg.binary, e))?;
        self.children.insert(meta.vmi_uid.clone(), child);
        Ok(())
    }

    /// Writes the spec and metadata and lets `early`, the launcher started while they were
    /// prepared ([`crate::early_launcher`]), run inside `netns`. Where it is gone, the
    /// launcher is spawned as [`Launchers::start_in`] spawns it, with `exec_prefix`.
    pub fn start_early(
        &mut self,
        cfg: &LauncherConfig,
        spec: &LaunchSpec,
        meta: &LaunchMeta,
        early: crate::early_launcher::EarlyLauncher,
        netns: Option<&Path>,
        exec_prefix: &[String],
    ) -> Result<(), AgentError> {
        let dir = cfg.vmi_dir(&meta.vmi_uid);
        write_json_atomic(&dir.join(files::SPEC), spec)?;
        write_json_atomic(&dir.join(files::META), meta)?;
        match early.go(netns) {
            Ok(child) => {
                self.children.insert(meta.vmi_uid.clone(), child);
                Ok(())
            }
            Err(e) => {
                tracing::warn!(vmi = %meta.name, "the early launcher is gone ({e}); spawning one now");
                self.start_in(cfg, spec, meta, exec_prefix)
            }
        }
    }

    /// Reaps launchers that exited (their status comes from `exit.json`).
    pub fn reap(&mut self) {
        self.children
            .retain(|_, c| !matches!(c.try_wait(), Ok(Some(_)) | Err(_)));
    }

    /// Whether this agent process started the launcher of `uid` and it has not exited yet.
    pub fn is_child_alive(&mut self, uid: &str) -> bool {
        match self.children.get_mut(uid) {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }
}

/// Prepares the directory of the VMI with `uid` for a new launcher (private, no QEMU a killed
/// launcher left behind, no exit report) and returns it with the launcher's command line,
/// prefixed by `exec_prefix`: `launcher --dir DIR`, its output appended to the launcher log,
/// in a process group of its own (signals to the agent's group do not reach it). The caller
/// sets stdin and spawns it.
pub(crate) fn launcher_command(
    cfg: &LauncherConfig,
    uid: &str,
    exec_prefix: &[String],
) -> Result<(PathBuf, Command), AgentError> {
    use std::os::unix::process::CommandExt;
    let dir = cfg.vmi_dir(uid);
    std::fs::create_dir_all(&dir).map_err(|e| AgentError::io(&dir, e))?;
    crate::isolation::restrict_dir(&dir).map_err(|e| AgentError::io(&dir, e))?;
    // Never a second QEMU beside one a killed launcher left behind.
    reap_orphan_qemu(&dir);
    let _ = std::fs::remove_file(dir.join(files::EXIT));
    let log_path = dir.join(files::LOG);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(|e| AgentError::io(&log_path, e))?;
    let log2 = log.try_clone().map_err(|e| AgentError::io(&log_path, e))?;
    let mut cmd = match exec_prefix.split_first() {
        Some((prog, args)) => {
            let mut c = Command::new(prog);
            c.args(args).arg(&cfg.binary);
            c
        }
        None => Command::new(&cfg.binary),
    };
    cmd.arg("launcher")
        .arg("--dir")
        .arg(&dir)
        .stdout(log)
        .stderr(log2)
        .process_group(0);
    Ok((dir, cmd))
}

/// What the node sees for the VMI with `uid`.
pub async fn observe(cfg: &LauncherConfig, uid: &str) -> Observed {
    let dir = cfg.vmi_dir(uid);
    if let Ok(mut c) = LauncherClient::connect(&dir, CONTROL_TIMEOUT).await
        && let Ok(st) = c.status().await
    {
        return Observed::Running(st);
    }
    match read_exit_report(&dir) {
        Some(rep) => Observed::Exited(rep),
        None => {
            reap_orphan_qemu(&dir);
            Observed::NoLauncher
        }
    }
}

/// Sends one request to the launcher of `uid`.
pub async fn request(
    cfg: &LauncherConfig,
    uid: &str,
    req: &Request,
    timeout: Duration,
) -> Result<serde_json::Value, AgentError> {
    let mut c = LauncherClient::connect(&cfg.vmi_dir(uid), CONTROL_TIMEOUT).await?;
    Ok(c.request_with_timeout(req, timeout).await?)
}

/// Follows a launcher's migration and block-job events ([`Request::JobEvents`]) so that a
/// follower looks at QEMU again the moment something changes instead of on a timer; with a
/// launcher that cannot wait (an older one) or does not answer, it sleeps `fallback`.
#[derive(Debug)]
pub struct JobEvents {
    seen: Option<u64>,
    fallback: Duration,
}

impl JobEvents {
    /// A follower that has seen no event yet.
    pub fn new(fallback: Duration) -> JobEvents {
        JobEvents {
            seen: Some(0),
            fallback,
        }
    }

    /// Returns once the launcher of `uid` reports an event not seen yet, or after `max`.
    pub async fn next(&mut self, cfg: &LauncherConfig, uid: &str, max: Duration) {
        let Some(after) = self.seen else {
            return tokio::time::sleep(self.fallback).await;
        };
        let req = Request::JobEvents {
            after,
            wait_ms: max.as_millis() as u64,
        };
        match request(cfg, uid, &req, max + CONTROL_TIMEOUT).await {
            Ok(v) => match v.as_u64() {
                Some(n) => self.seen = Some(n.max(after)),
                None => self.seen = None,
            },
            Err(e) => {
                tracing::debug!(
                    uid,
                    "waiting on the launcher's events: {e}; polling instead"
                );
                self.seen = None;
                tokio::time::sleep(self.fallback).await;
            }
        }
    }
}

/// The pod-network plan of a VMI, kept in its directory so that a restarted agent re-attaches
/// (DHCP) and finally tears down exactly what was set up.
pub const NETWORK_PLAN: &str = "network.json";

/// Writes the VMI's pod-network plan.
pub fn write_network_plan(dir: &Path, plan: &ferrovirt_network::PodPlan) -> Result<(), AgentError> {
    write_json_atomic(&dir.join(NETWORK_PLAN), plan)?;
    Ok(())
}

/// The VMI's pod-network plan, if it has one.
pub fn read_network_plan(dir: &Path) -> Option<ferrovirt_network::PodPlan> {
    let text = std::fs::read_to_string(dir.join(NETWORK_PLAN)).ok()?;
    serde_json::from_str(&text).ok()
}

/// Removes a VMI directory, releasing its QEMU uid.
pub fn remove_dir(dir: &Path) {
    reap_orphan_qemu(dir);
    crate::hostdev::release(dir);
    crate::isolation::release_uid(dir);
    if dir.exists()
        && let Err(e) = std::fs::remove_dir_all(dir)
    {
        tracing::warn!("removing {}: {e}", dir.display());
    }
}

/// Whether process `pid` runs with a command line naming `dir` (and, given, starting with
/// `prefix`).
fn process_of(pid: u32, dir: &Path, prefix: Option<&str>) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let text = String::from_utf8_lossy(&cmdline);
    text.contains(&*dir.to_string_lossy()) && prefix.is_none_or(|p| text.starts_with(p))
}

/// Whether the pid file `name` in `dir` names a live process of that directory.
fn live_pid(dir: &Path, name: &str, prefix: Option<&str>) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(dir.join(name))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    process_of(pid, dir, prefix).then_some(pid)
}

/// Kills the QEMU of a launcher that died without it (a launcher killed on its own: its
/// QEMU would run on unsupervised and unfenced on the VM's disks). Only when `qemu.pid`
/// names a live `qemu-system…` process of this directory and no launcher of it lives.
/// Returns the pid killed.
pub fn reap_orphan_qemu(dir: &Path) -> Option<u32> {
    if live_pid(dir, files::PID, None).is_some() {
        return None;
    }
    let pid = live_pid(dir, files::QEMU_PID, Some("qemu-system"))?;
    tracing::warn!(
        "killing QEMU {pid} of {}: its launcher is gone",
        dir.display()
    );
    let p = rustix::process::Pid::from_raw(pid as i32)?;
    let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
    for _ in 0..100 {
        if !process_of(pid, dir, Some("qemu-system")) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Some(pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process whose command line starts with `name` and names `dir`.
    fn fake(name: &str, dir: &Path) -> std::process::Child {
        let f = dir.join("f");
        std::fs::write(&f, "").unwrap();
        Command::new("bash")
            .arg("-c")
            .arg(format!("exec -a {name} tail -f {}", f.display()))
            .spawn()
            .unwrap()
    }

    #[test]
    fn a_qemu_left_by_a_dead_launcher_is_killed_a_supervised_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let mut qemu = fake("qemu-system-x86_64", dir.path());
        std::thread::sleep(Duration::from_millis(200));
        std::fs::write(dir.path().join(files::QEMU_PID), qemu.id().to_string()).unwrap();
        // The launcher lives: nothing is touched.
        let mut launcher = fake("ferrovirt-launcher", dir.path());
        std::thread::sleep(Duration::from_millis(200));
        std::fs::write(dir.path().join(files::PID), launcher.id().to_string()).unwrap();
        assert_eq!(reap_orphan_qemu(dir.path()), None);
        assert!(qemu.try_wait().unwrap().is_none(), "QEMU runs on");
        // The launcher killed on its own: its QEMU goes too.
        launcher.kill().unwrap();
        launcher.wait().unwrap();
        assert_eq!(reap_orphan_qemu(dir.path()), Some(qemu.id()));
        let status = qemu.wait().unwrap();
        assert!(!status.success());
        // A pid file naming a process of another directory is never acted on.
        let other = tempfile::tempdir().unwrap();
        let mut stranger = fake("qemu-system-x86_64", other.path());
        std::thread::sleep(Duration::from_millis(200));
        std::fs::write(dir.path().join(files::QEMU_PID), stranger.id().to_string()).unwrap();
        assert_eq!(reap_orphan_qemu(dir.path()), None);
        assert!(stranger.try_wait().unwrap().is_none());
        stranger.kill().unwrap();
        stranger.wait().unwrap();
    }
}
