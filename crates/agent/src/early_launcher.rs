//! A VMI's launcher started before its spec exists (issue #15's start path, docs/scale.md
//! "Start path"). Joining a cgroup costs ~12 ms on the first write of a pid to `cgroup.procs`
//! (the kernel waits for an RCU grace period), and the launcher used to pay it after the pod
//! network was up, on the critical path, after an `nsenter` exec. Now the agent starts
//! `ferrovirt launcher --dir DIR --early-cgroup NAME` as soon as the VMI's directory exists:
//! the launcher joins the VM's cgroups while the agent prepares the volumes and the network,
//! then waits for a word on its stdin ([`ferrovirt_launcher::early`]). [`EarlyLauncher::go`]
//! sends it, with the VMI's network namespace, which the launcher enters itself before its
//! runtime starts; dropping an [`EarlyLauncher`] without `go` (the start failed) closes its
//! stdin and the launcher exits having written nothing.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};

use ferrovirt_launcher::early::go_word;

use crate::error::AgentError;
use crate::launchers::{LauncherConfig, launcher_command};

/// A launcher started early, waiting for [`EarlyLauncher::go`].
#[derive(Debug)]
pub struct EarlyLauncher {
    child: Option<Child>,
    /// Its cgroups, removed when it is let go without running.
    cgroups: Vec<PathBuf>,
}

impl EarlyLauncher {
    /// Starts the launcher of the VMI with `uid` (its directory prepared as
    /// [`crate::launchers::Launchers::start`] prepares it: private, no QEMU of an earlier
    /// launcher left, no exit report), to join the cgroups named `cgroup_name` and wait.
    pub fn start(cfg: &LauncherConfig, uid: &str, cgroup_name: &str) -> Result<Self, AgentError> {
        let (_, mut cmd) = launcher_command(cfg, uid, &[])?;
        let child = cmd
            .arg("--early-cgroup")
            .arg(cgroup_name)
            .stdin(Stdio::piped())
            .spawn()
            .map_err(|e| AgentError::io(&cfg.binary, e))?;
        let cgroups = ferrovirt_launcher::cgroup::detect(Path::new("/sys/fs/cgroup"))
            .map(|h| ferrovirt_launcher::cgroup::cgroup_dirs(&h, cgroup_name))
            .unwrap_or_default();
        Ok(EarlyLauncher {
            child: Some(child),
            cgroups,
        })
    }

    /// Lets the launcher run, inside the network namespace `netns` when given; returns its
    /// process. An error when it is gone already (the caller starts one the ordinary way).
    pub fn go(mut self, netns: Option<&Path>) -> std::io::Result<Child> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| std::io::Error::other("the early launcher was already used"))?;
        let sent = child
            .stdin
            .take()
            .ok_or_else(|| std::io::Error::other("no stdin"))
            .and_then(|mut w| w.write_all(&go_word(netns)));
        match sent {
            Ok(()) => Ok(child),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }
}

impl Drop for EarlyLauncher {
    /// Closes the launcher's stdin (it exits having written nothing), reaps it and removes
    /// the cgroups it joined, off the caller's thread.
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        drop(child.stdin.take());
        let cgroups = std::mem::take(&mut self.cgroups);
        std::thread::spawn(move || {
            let _ = child.wait();
            for d in &cgroups {
                let _ = std::fs::remove_dir(d);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(dir: &Path, binary: &Path) -> LauncherConfig {
        LauncherConfig {
            binary: binary.into(),
            data_dir: dir.to_path_buf(),
            qemu_binary: "qemu-system-x86_64".into(),
        }
    }

    /// A stand-in for `ferrovirt launcher --dir DIR --early-cgroup NAME`: it copies its
    /// stdin into DIR/word and notes it ran.
    fn fake_launcher(dir: &Path) -> PathBuf {
        let bin = dir.join("fake-launcher");
        std::fs::write(
            &bin,
            "#!/bin/sh\ncat > \"$3/word\"\necho ran > \"$3/ran\"\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        bin
    }

    #[test]
    fn go_sends_the_word_and_a_drop_closes_stdin() {
        let tmp = tempfile::tempdir().unwrap();
        let bin = fake_launcher(tmp.path());
        let c = cfg(tmp.path(), &bin);

        let early = EarlyLauncher::start(&c, "u1", "u1").unwrap();
        let mut child = early.go(Some(Path::new("/run/netns/fv-x"))).unwrap();
        assert!(child.wait().unwrap().success());
        let word = std::fs::read(c.vmi_dir("u1").join("word")).unwrap();
        assert_eq!(word, b"g/run/netns/fv-x\0");

        let early = EarlyLauncher::start(&c, "u2", "u2").unwrap();
        drop(early);
        let ran = c.vmi_dir("u2").join("ran");
        let t = std::time::Instant::now();
        while !ran.exists() && t.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // The fake copies nothing but EOF: the real launcher exits on it.
        assert_eq!(std::fs::read(c.vmi_dir("u2").join("word")).unwrap(), b"");
    }
}
