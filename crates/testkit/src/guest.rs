//! The test guest fixture: finds (and if needed builds, via `scripts/build-test-guest.sh`) the
//! tiny guest OS that every end-to-end test boots.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use anyhow::{Context, bail};

/// Line the guest prints first: `FERROVIRT-BOOT serial=<serial> uuid=<uuid>`.
pub const BOOT_MARKER: &str = "FERROVIRT-BOOT";
/// Line the guest prints when network, data source, HTTP and the guest agent are up.
pub const READY_MARKER: &str = "FERROVIRT-READY";

/// Paths of the built test guest.
#[derive(Debug, Clone)]
pub struct TestGuest {
    pub dir: PathBuf,
    /// Bootable raw FAT disk (syslinux → kernel + initrd).
    pub disk_raw: PathBuf,
    /// The same disk as qcow2.
    pub disk_qcow2: PathBuf,
    /// Kernel and initramfs for direct kernel boot.
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    /// Kernel command line for direct kernel boot (serial console on ttyS0).
    pub cmdline: String,
}

static GUEST: OnceLock<Result<TestGuest, String>> = OnceLock::new();

impl TestGuest {
    /// The guest under `$FERROVIRT_TEST_GUEST_DIR` or `<repo>/target/test-guest`, built by the
    /// script first when missing or stale. Fails (never skips) when it cannot be built.
    pub fn get() -> anyhow::Result<TestGuest> {
        GUEST
            .get_or_init(|| Self::build().map_err(|e| format!("{e:#}")))
            .clone()
            .map_err(|e| anyhow::anyhow!(e))
    }

    fn build() -> anyhow::Result<TestGuest> {
        let dir = match std::env::var_os("FERROVIRT_TEST_GUEST_DIR") {
            Some(d) => PathBuf::from(d),
            None => crate::repo_root().join("target/test-guest"),
        };
        let script = crate::repo_root().join("scripts/build-test-guest.sh");
        let status = Command::new("bash")
            .arg(&script)
            .env("FERROVIRT_TEST_GUEST_DIR", &dir)
            .status()
            .with_context(|| format!("running {}", script.display()))?;
        if !status.success() {
            bail!("{} failed with {status}", script.display());
        }
        Self::at(&dir)
    }

    /// The guest already built in `dir`.
    pub fn at(dir: &Path) -> anyhow::Result<TestGuest> {
        let g = TestGuest {
            dir: dir.to_path_buf(),
            disk_raw: dir.join("disk.raw"),
            disk_qcow2: dir.join("disk.qcow2"),
            kernel: dir.join("vmlinuz"),
            initrd: dir.join("initrd.img"),
            cmdline: std::fs::read_to_string(dir.join("cmdline"))
                .with_context(|| format!("reading {}/cmdline", dir.display()))?
                .trim()
                .to_string(),
        };
        for p in [&g.disk_raw, &g.disk_qcow2, &g.kernel, &g.initrd] {
            if !p.exists() {
                bail!("test guest file {} is missing", p.display());
            }
        }
        Ok(g)
    }
}

/// Parses a boot marker line into (serial, uuid).
pub fn parse_boot_marker(line: &str) -> Option<(String, String)> {
    let rest = &line[line.find(BOOT_MARKER)? + BOOT_MARKER.len()..];
    let mut serial = None;
    let mut uuid = None;
    for word in rest.split_whitespace() {
        if let Some(v) = word.strip_prefix("serial=") {
            serial = Some(v.to_string());
        } else if let Some(v) = word.strip_prefix("uuid=") {
            uuid = Some(v.to_string());
        }
    }
    Some((serial.unwrap_or_default(), uuid.unwrap_or_default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_marker() {
        let (s, u) = parse_boot_marker("junk FERROVIRT-BOOT serial=abc uuid=1-2-3").unwrap();
        assert_eq!(s, "abc");
        assert_eq!(u, "1-2-3");
        let (s, u) = parse_boot_marker("FERROVIRT-BOOT serial= uuid=").unwrap();
        assert_eq!((s.as_str(), u.as_str()), ("", ""));
        assert!(parse_boot_marker("nothing here").is_none());
    }
}
