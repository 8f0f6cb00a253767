//! Named network namespaces (`ip netns` style, under /run/netns): checking that one exists and
//! running a closure on a short-lived thread that has entered one (sockets created there keep
//! belonging to that namespace after the thread ends). No unsafe: nix's `setns`.

use std::path::PathBuf;

use nix::sched::{CloneFlags, setns};

use crate::error::{Error, Result};

/// Where iproute2 keeps named namespaces.
pub const NETNS_DIR: &str = "/run/netns";

/// The bind-mount path of the named namespace `name`.
pub fn path(name: &str) -> PathBuf {
    PathBuf::from(NETNS_DIR).join(name)
}

/// Whether the named namespace exists.
pub fn exists(name: &str) -> bool {
    path(name).exists()
}

/// The command prefix that runs a program inside the named namespace:
/// `nsenter --net=/run/netns/NAME --`. Unlike `ip netns exec` it switches only the network
/// namespace: `ip netns exec` also enters a new mount namespace with a fresh /sys, which hides
/// /sys/fs/cgroup from the launcher.
pub fn exec_prefix(name: &str) -> Vec<String> {
    vec![
        "nsenter".to_string(),
        format!("--net={}", path(name).display()),
        "--".to_string(),
    ]
}

/// Runs `f` on a fresh thread inside the namespace `netns` (the caller's own namespace when
/// `None`) and returns its result. Only that thread switches; the caller is unaffected.
pub fn run_in<T, F>(netns: Option<&str>, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let target = match netns {
        Some(n) => {
            let p = path(n);
            Some(
                std::fs::File::open(&p)
                    .map_err(|e| Error::io(format!("opening {}", p.display()), e))?,
            )
        }
        None => None,
    };
    let handle = std::thread::Builder::new()
        .name("fv-netns".into())
        .spawn(move || -> Result<T> {
            if let Some(fd) = target {
                setns(&fd, CloneFlags::CLONE_NEWNET).map_err(|e| {
                    Error::io("entering network namespace", std::io::Error::from(e))
                })?;
            }
            Ok(f())
        })
        .map_err(|e| Error::io("spawning a thread", e))?;
    handle
        .join()
        .map_err(|_| Error::io("netns thread", std::io::Error::other("panicked")))?
}
