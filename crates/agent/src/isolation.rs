//! Isolation of VMs on the node: the unprivileged user QEMU drops to (`-runas`), created once
//! when the agent runs as root, and the permissions of VMI directories.

use std::path::Path;
use std::process::Command;

/// The system user QEMU processes run as when the agent is root.
pub const QEMU_USER: &str = "ferrovirt-qemu";

/// The effective uid of this process, from /proc/self/status.
pub fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_euid(&status)
}

/// The effective uid from the text of /proc/PID/status ("Uid: real effective saved fs").
pub fn parse_euid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

fn user_exists(name: &str) -> bool {
    std::fs::read_to_string("/etc/passwd")
        .map(|p| p.lines().any(|l| l.split(':').next() == Some(name)))
        .unwrap_or(false)
}

/// When running as root: makes sure [`QEMU_USER`] exists and returns it. Otherwise (or when
/// the user cannot be created) `None`: QEMU then runs as the agent's own user.
pub fn ensure_qemu_user() -> Option<String> {
    if effective_uid() != Some(0) {
        return None;
    }
    if !user_exists(QEMU_USER) {
        let out = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
            ])
            .arg(QEMU_USER)
            .output();
        match out {
            Ok(o) if o.status.success() => {}
            Ok(o) => {
                tracing::warn!(
                    "cannot create user {QEMU_USER}: {}; QEMU will run as root",
                    String::from_utf8_lossy(&o.stderr).trim()
                );
                return None;
            }
            Err(e) => {
                tracing::warn!("cannot run useradd: {e}; QEMU will run as root");
                return None;
            }
        }
    }
    Some(QEMU_USER.to_string())
}

/// Makes a VMI directory private to its owner (root): other VMs' QEMU users cannot open it.
pub fn restrict_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_effective_uid() {
        assert_eq!(parse_euid("Name:\tx\nUid:\t1000\t0\t0\t0\n"), Some(0));
        assert_eq!(parse_euid("Uid:\t5 6 7 8"), Some(6));
        assert_eq!(parse_euid("nothing"), None);
    }
}
