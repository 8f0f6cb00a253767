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
        let dir = cfg.vmi_dir(&meta.vmi_uid);
        std::fs::create_dir_all(&dir).map_err(|e| AgentError::io(&dir, e))?;
        crate::isolation::restrict_dir(&dir).map_err(|e| AgentError::io(&dir, e))?;
        let _ = std::fs::remove_file(dir.join(files::EXIT));
        write_json_atomic(&dir.join(files::SPEC), spec)?;
        write_json_atomic(&dir.join(files::META), meta)?;
        let log_path = dir.join(files::LOG);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| AgentError::io(&log_path, e))?;
        let log2 = log.try_clone().map_err(|e| AgentError::io(&log_path, e))?;
        let child = {
            use std::os::unix::process::CommandExt;
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
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(log2)
                // A process group of its own: signals to the agent's group do not reach it.
                .process_group(0)
                .spawn()
                .map_err(|e| AgentError::io(&cfg.binary, e))?
        };
        self.children.insert(meta.vmi_uid.clone(), child);
        Ok(())
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
        None => Observed::NoLauncher,
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
    crate::isolation::release_uid(dir);
    if dir.exists()
        && let Err(e) = std::fs::remove_dir_all(dir)
    {
        tracing::warn!("removing {}: {e}", dir.display());
    }
}
