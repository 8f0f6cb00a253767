//! A real etcd for tests (Debian `etcd-server`, or `$FERROVIRT_ETCD_BIN`): one member on free
//! loopback ports in a temporary directory, killed on drop. Fails (never skips) when etcd is
//! missing.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// A running single-member etcd.
pub struct Etcd {
    pub dir: tempfile::TempDir,
    pub client_port: u16,
    child: Child,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd")
            .field("client_port", &self.client_port)
            .finish_non_exhaustive()
    }
}

impl Etcd {
    /// Starts etcd and waits until `/health` answers.
    pub fn start() -> anyhow::Result<Etcd> {
        let bin = std::env::var_os("FERROVIRT_ETCD_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/bin/etcd"));
        if !bin.is_file() {
            bail!(
                "etcd not found at {} (install Debian's etcd-server or set FERROVIRT_ETCD_BIN)",
                bin.display()
            );
        }
        let dir = tempfile::Builder::new().prefix("fv-etcd-").tempdir()?;
        let client_port = crate::free_port()?;
        let peer_port = crate::free_port()?;
        let client = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let log = std::fs::File::create(dir.path().join("etcd.log"))?;
        let child = Command::new(&bin)
            .args(["--name", "fv-test"])
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("fv-test={peer}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut e = Etcd {
            dir,
            client_port,
            child,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(s) = e.child.try_wait()? {
                bail!("etcd exited ({s}): {}", e.log());
            }
            if let Ok(body) = crate::http_get(client_port, "/health", Duration::from_millis(300))
                && body.contains("true")
            {
                return Ok(e);
            }
            if Instant::now() > deadline {
                bail!("etcd not healthy after 30 s: {}", e.log());
            }
        }
    }

    /// The client URL (`http://127.0.0.1:PORT`).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// What etcd logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
