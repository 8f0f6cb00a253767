//! Node agents on machines of their own, as far as files go: [`Cluster::start_agent_in_mount_ns`]
//! runs an extra agent in a new mount namespace (`unshare --mount --propagation private`)
//! with a tmpfs mounted over its data dir inside that namespace, so its VMI directories and
//! node-local volumes are invisible to the server and the test (the directory is empty from
//! outside). [`MountNsAgent`] looks inside with `nsenter --mount=/proc/PID/ns/mnt`.
//!
//! [`hide_path_wrapper`] is a command prefix that runs
//! a program in its own mount namespace (`unshare --mount`, private propagation) with an empty
//! tmpfs mounted over a path, so a node agent started through it (see
//! [`crate::Cluster::start_agent_in`]) sees an empty directory where the other nodes see a
//! shared filesystem: exactly a node on which the administrator forgot the mount. Needs root.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{Context, bail};

use crate::cluster::{Cluster, default_network_mode, spawn_logged};

/// An agent in its own mount namespace.
#[derive(Debug, Clone)]
pub struct MountNsAgent {
    pub node: String,
    /// The agent's process (its mount namespace is `/proc/PID/ns/mnt`).
    pub pid: u32,
    /// Its data dir: a private tmpfs inside the namespace, an empty directory outside.
    pub data_dir: PathBuf,
}

impl MountNsAgent {
    /// Runs `args` inside the agent's mount namespace.
    pub fn exec(&self, args: &[&str]) -> anyhow::Result<Output> {
        Command::new("nsenter")
            .arg(format!("--mount=/proc/{}/ns/mnt", self.pid))
            .arg("--")
            .args(args)
            .output()
            .context("running nsenter")
    }

    /// Whether `path` exists as the agent sees it.
    pub fn exists(&self, path: &Path) -> anyhow::Result<bool> {
        let p = path.to_string_lossy();
        Ok(self.exec(&["test", "-e", &p])?.status.success())
    }

    /// The contents of `path` as the agent sees it (`None` when it cannot be read).
    pub fn read(&self, path: &Path) -> anyhow::Result<Option<Vec<u8>>> {
        let p = path.to_string_lossy();
        let out = self.exec(&["cat", &p])?;
        Ok(out.status.success().then_some(out.stdout))
    }

    /// Waits until the guest of VMI `uid` on this node printed the boot marker.
    pub fn wait_boot_marker(
        &self,
        cluster: &Cluster,
        uid: &str,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let log = self.data_dir.join("vmis").join(uid).join("serial.log");
        cluster.wait_until(
            &format!("FERROVIRT-BOOT in {} on {}", log.display(), self.node),
            timeout,
            || {
                let text = self.read(&log)?.unwrap_or_default();
                Ok(String::from_utf8_lossy(&text)
                    .contains("FERROVIRT-BOOT")
                    .then_some(()))
            },
        )
    }
}

impl Cluster {
    /// Starts an extra agent `node` in a new mount namespace with a private tmpfs over its
    /// data dir (see the module doc).
    pub fn start_agent_in_mount_ns(&mut self, node: &str) -> anyhow::Result<MountNsAgent> {
        let data = self.extra_agent_dir(node);
        std::fs::create_dir_all(&data)?;
        let script = r#"mount -t tmpfs -o mode=0755 "ferrovirt-$1" "$2" && shift 2 && exec "$@""#;
        let mut cmd = Command::new("unshare");
        cmd.args([
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            script,
            "sh",
        ])
        .arg(node)
        .arg(&data)
        .arg(&self.binary)
        .arg("agent")
        .arg("--kubeconfig")
        .arg(&self.kubeconfig)
        .args(["--node-name", node])
        .arg("--data-dir")
        .arg(&data)
        .args(default_network_mode::<&str>(&[]))
        .env("RUST_LOG", "info");
        let log = self.dir.path().join(format!("agent-{node}.log"));
        let child = spawn_logged(&mut cmd, &log)?;
        let pid = child.id();
        self.agents.push((node.to_string(), child));
        let agent = MountNsAgent {
            node: node.to_string(),
            pid,
            data_dir: data,
        };
        // Wait until the tmpfs is mounted in the namespace (the agent then writes into it).
        self.wait_until(
            &format!("agent {node} in its mount namespace"),
            Duration::from_secs(30),
            || {
                let mine = std::fs::read_link("/proc/self/ns/mnt")?;
                let theirs = match std::fs::read_link(format!("/proc/{pid}/ns/mnt")) {
                    Ok(t) => t,
                    Err(_) => bail!("agent {node} exited:\n{}", self.agent_log(node)),
                };
                Ok((mine != theirs && agent.exists(&agent.data_dir.join("vmis"))?).then_some(()))
            },
        )?;
        Ok(agent)
    }
}

/// `unshare … sh -c 'mount -t tmpfs … PATH && exec "$@"'`: the prefix, the program and its
/// arguments follow.
pub fn hide_path_wrapper(path: &Path) -> Vec<String> {
    [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        r#"mount -t tmpfs -o size=1m fv-hidden "$0" && exec "$@""#,
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([path.display().to_string()])
    .collect()
}
