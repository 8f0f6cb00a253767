//! Spawning and killing the QEMU process.
//!
//! [`QemuProcess::spawn`] validates the spec, prepares socket directories, removes stale sockets
//! and starts QEMU with the argv from [`crate::cmdline::qemu_command`]. QEMU's stdout and stderr
//! go to a log file when one is given, otherwise into a bounded in-memory buffer; either way
//! [`QemuProcess::stderr_tail`] shows why QEMU died.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};

use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

use crate::cmdline::qemu_command;
use crate::error::{Error, Result};
use crate::spec::LaunchSpec;

/// How much QEMU output is kept in memory when there is no log file.
const OUTPUT_LIMIT: usize = 64 * 1024;

/// Where QEMU is and where its output goes.
#[derive(Debug, Clone)]
pub struct QemuOptions {
    /// The emulator binary; `qemu-system-x86_64` from PATH by default.
    pub binary: PathBuf,
    /// Append QEMU's stdout and stderr to this file.
    pub log_path: Option<PathBuf>,
    /// SIGKILL QEMU when the [`QemuProcess`] is dropped (tests; a crashed launcher).
    pub kill_on_drop: bool,
}

impl Default for QemuOptions {
    fn default() -> Self {
        QemuOptions {
            binary: PathBuf::from("qemu-system-x86_64"),
            log_path: None,
            kill_on_drop: true,
        }
    }
}

/// A running (or exited) QEMU child process.
#[derive(Debug)]
pub struct QemuProcess {
    child: Child,
    pid: Option<u32>,
    argv: Vec<String>,
    output: Output,
    exit: Option<ExitStatus>,
    /// The task copying the serial log FIFO into the bounded log.
    serial_log: Option<tokio::task::JoinHandle<()>>,
    /// When the spawn began and when it returned (the exec had happened), on CLOCK_BOOTTIME
    /// ([`crate::timing`]).
    spawn_us: (u64, u64),
}

impl Drop for QemuProcess {
    fn drop(&mut self) {
        if let Some(t) = &self.serial_log {
            t.abort();
        }
    }
}

#[derive(Debug, Clone)]
enum Output {
    File(PathBuf),
    Memory(Arc<Mutex<Vec<u8>>>),
}

impl QemuProcess {
    /// Starts QEMU for `spec`. Returns once the process exists, not once it is ready: connect QMP
    /// for that (see [`crate::lifecycle::Vm::start`]).
    pub fn spawn(spec: &LaunchSpec, opts: &QemuOptions) -> Result<QemuProcess> {
        spec.validate()?;
        for sock in spec.sockets.all() {
            prepare_socket_path(sock)?;
        }
        let serial_log = match &spec.sockets.serial_log {
            Some(log) => {
                create_parent(log)?;
                let max = spec
                    .serial_log_max_bytes
                    .unwrap_or(crate::spec::DEFAULT_SERIAL_LOG_MAX);
                Some(crate::seriallog::spawn(log, max)?)
            }
            None => None,
        };
        if let Some(bytes) = crate::hostdev::memlock_bytes(&spec.host_devices, spec.memory_mib) {
            // Inherited by QEMU, which keeps it after dropping to its uid.
            let limit = rustix::process::Rlimit {
                current: Some(bytes),
                maximum: Some(bytes),
            };
            if let Err(e) = rustix::process::setrlimit(rustix::process::Resource::Memlock, limit) {
                tracing::warn!("raising RLIMIT_MEMLOCK to {bytes} for VFIO: {e}");
            }
        }
        let argv = qemu_command(spec);
        let mut cmd = Command::new(&opts.binary);
        cmd.args(&argv)
            .stdin(Stdio::null())
            .kill_on_drop(opts.kill_on_drop);
        let output = match &opts.log_path {
            Some(path) => {
                create_parent(path)?;
                let open = || {
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(path)
                        .map_err(|e| Error::io(format!("opening {}", path.display()), e))
                };
                cmd.stdout(open()?).stderr(open()?);
                Output::File(path.clone())
            }
            None => {
                cmd.stdout(Stdio::null()).stderr(Stdio::piped());
                Output::Memory(Arc::new(Mutex::new(Vec::new())))
            }
        };
        let spawn_start = crate::timing::boottime_us();
        let mut child = cmd
            .spawn()
            .map_err(|e| Error::io(format!("starting {}", opts.binary.display()), e))?;
        if let (Output::Memory(buf), Some(mut stderr)) = (&output, child.stderr.take()) {
            let buf = buf.clone();
            tokio::spawn(async move {
                let mut chunk = [0u8; 4096];
                while let Ok(n) = stderr.read(&mut chunk).await {
                    if n == 0 {
                        break;
                    }
                    let mut b = buf.lock().unwrap_or_else(|p| p.into_inner());
                    b.extend_from_slice(&chunk[..n]);
                    if b.len() > OUTPUT_LIMIT {
                        let cut = b.len() - OUTPUT_LIMIT;
                        b.drain(..cut);
                    }
                }
            });
        }
        let spawn_us = (spawn_start, crate::timing::boottime_us());
        let pid = child.id();
        tracing::info!(pid, name = %spec.name, "started QEMU: {}", argv.join(" "));
        Ok(QemuProcess {
            child,
            pid,
            argv,
            output,
            exit: None,
            serial_log,
            spawn_us,
        })
    }

    /// When the spawn began and when it returned (QEMU's exec had happened: std's spawn
    /// waits for it), microseconds on CLOCK_BOOTTIME.
    pub fn spawn_us(&self) -> (u64, u64) {
        self.spawn_us
    }

    /// The OS process id (None once reaped).
    pub fn pid(&self) -> Option<u32> {
        self.pid
    }

    /// The arguments QEMU was started with.
    pub fn argv(&self) -> &[String] {
        &self.argv
    }

    /// The exit status if QEMU has exited; never blocks.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        if self.exit.is_none() {
            self.exit = self
                .child
                .try_wait()
                .map_err(|e| Error::io("checking on QEMU", e))?;
        }
        Ok(self.exit)
    }

    /// Waits until QEMU exits. Cancel-safe.
    pub async fn wait(&mut self) -> Result<ExitStatus> {
        if let Some(s) = self.exit {
            return Ok(s);
        }
        let s = self
            .child
            .wait()
            .await
            .map_err(|e| Error::io("waiting for QEMU", e))?;
        self.exit = Some(s);
        Ok(s)
    }

    /// Sends SIGKILL without waiting (no-op when QEMU already exited).
    pub fn start_kill(&mut self) -> Result<()> {
        if self.try_wait()?.is_some() {
            return Ok(());
        }
        match self.child.start_kill() {
            Ok(()) => Ok(()),
            // Exited between the check and the kill.
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => Ok(()),
            Err(e) => Err(Error::io("killing QEMU", e)),
        }
    }

    /// SIGKILLs QEMU and reaps it.
    pub async fn kill(&mut self) -> Result<ExitStatus> {
        self.start_kill()?;
        self.wait().await
    }

    /// The last `max` bytes of QEMU's stdout/stderr.
    pub fn stderr_tail(&self, max: usize) -> String {
        let bytes = match &self.output {
            Output::File(p) => std::fs::read(p).unwrap_or_default(),
            Output::Memory(b) => b.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        };
        let start = bytes.len().saturating_sub(max);
        String::from_utf8_lossy(&bytes[start..]).into_owned()
    }
}

fn create_parent(path: &Path) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    }
    Ok(())
}

/// Creates the socket's directory and removes a stale socket left by an earlier QEMU, so that
/// connecting never reaches a dead listener. Refuses to remove anything that is not a socket.
fn prepare_socket_path(path: &Path) -> Result<()> {
    create_parent(path)?;
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(Error::InvalidSpec(format!(
                    "{} exists and is not a socket",
                    path.display()
                )));
            }
            std::fs::remove_file(path)
                .map_err(|e| Error::io(format!("removing stale {}", path.display()), e))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(format!("inspecting {}", path.display()), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_sockets_are_removed_but_files_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("sub/qmp.sock");
        prepare_socket_path(&sock).unwrap();
        assert!(sock.parent().unwrap().is_dir());
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        prepare_socket_path(&sock).unwrap();
        assert!(!sock.exists());
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(prepare_socket_path(&file).is_err());
        assert!(file.exists());
    }

    #[tokio::test]
    async fn spawn_failure_and_output_capture() {
        let dir = tempfile::tempdir().unwrap();
        let spec = LaunchSpec::new(
            "t",
            "12345678-9abc-def0-1234-56789abcdef0",
            64,
            dir.path().join("q.sock"),
        );
        let missing = QemuOptions {
            binary: "/nonexistent/qemu".into(),
            ..QemuOptions::default()
        };
        assert!(matches!(
            QemuProcess::spawn(&spec, &missing),
            Err(Error::Io { .. })
        ));
        // `sh -c` treats the first argv entry as the script: "-name" fails and says so on stderr.
        let sh = QemuOptions {
            binary: "/bin/sh".into(),
            ..QemuOptions::default()
        };
        let mut p = QemuProcess::spawn(&spec, &sh).unwrap();
        let status = p.wait().await.unwrap();
        assert!(!status.success());
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(!p.stderr_tail(1000).is_empty());
        assert_eq!(p.try_wait().unwrap(), Some(status));
    }

    #[tokio::test]
    async fn kill_reaps_a_running_process_and_logs_go_to_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut spec = LaunchSpec::new(
            "t",
            "12345678-9abc-def0-1234-56789abcdef0",
            64,
            dir.path().join("q.sock"),
        );
        spec.extra_args.clear();
        let script = dir.path().join("fake-qemu");
        std::fs::write(&script, "#!/bin/sh\necho started >&2\nexec sleep 30\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let log = dir.path().join("logs/qemu.log");
        let opts = QemuOptions {
            binary: script,
            log_path: Some(log.clone()),
            kill_on_drop: true,
        };
        let mut p = QemuProcess::spawn(&spec, &opts).unwrap();
        assert!(p.pid().is_some());
        assert!(p.argv().contains(&"-nodefaults".to_string()));
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert_eq!(p.try_wait().unwrap(), None);
        let status = p.kill().await.unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(9));
        assert!(p.stderr_tail(100).contains("started"));
        // killing an exited process is fine
        p.kill().await.unwrap();
    }
}
