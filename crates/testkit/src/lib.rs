//! Test support shared by every ferrovirt test that needs a real guest: the [`TestGuest`]
//! fixture (paths of the images that `scripts/build-test-guest.sh` builds), a [`QemuVm`] that
//! boots QEMU directly, a [`SerialConsole`] that waits for lines the guest prints and runs
//! commands in its shell, a tiny blocking QMP client, and small helpers (free ports, accel
//! detection). Errors are `anyhow` here: this crate only serves tests.

pub mod cluster;
pub mod console;
pub mod cutoff;
pub mod etcd;
pub mod fileserver;
pub mod guest;
pub mod mountns;
pub mod netns;
pub mod qemu;
pub mod qmp;
pub mod registry;
pub mod requests;

pub use cluster::{Cluster, ClusterOptions};
pub use console::SerialConsole;
pub use etcd::{Etcd, EtcdCluster};
pub use fileserver::serve_files;
pub use guest::TestGuest;
pub use netns::Netns;
pub use qemu::{Accel, BootSource, QemuVm, QemuVmOptions};
pub use qmp::QmpClient;
pub use registry::Registry;

use std::net::TcpListener;
use std::path::PathBuf;

/// The repository root (two levels above this crate's manifest).
pub fn repo_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .and_then(|p| p.parent())
        .map(PathBuf::from)
        .unwrap_or(manifest)
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> anyhow::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// A plain HTTP/1.0 GET to 127.0.0.1:`port`, retried until `timeout`; returns the body.
pub fn http_get(port: u16, path: &str, timeout: std::time::Duration) -> anyhow::Result<String> {
    use std::io::{Read, Write};
    let deadline = std::time::Instant::now() + timeout;
    let mut last_err = anyhow::anyhow!("no attempt");
    while std::time::Instant::now() < deadline {
        let attempt = (|| -> anyhow::Result<String> {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
            s.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
            s.write_all(format!("GET {path} HTTP/1.0\r\nHost: guest\r\n\r\n").as_bytes())?;
            let mut resp = String::new();
            s.read_to_string(&mut resp)?;
            let (head, body) = resp
                .split_once("\r\n\r\n")
                .ok_or_else(|| anyhow::anyhow!("no HTTP response: {resp:?}"))?;
            if !head.starts_with("HTTP/1.") || !head.contains(" 200") {
                anyhow::bail!("HTTP error: {head}");
            }
            Ok(body.to_string())
        })();
        match attempt {
            Ok(b) => return Ok(b),
            Err(e) => last_err = e,
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    Err(last_err.context(format!("GET http://127.0.0.1:{port}{path}")))
}
