//! Block-mode volumes: a volume directory holding `disk.img` (the sparse backing file) and
//! the marker file [`BLOCK_MARKER`] is exposed as a loop device. Loop devices are attached on
//! demand ([`attach`] is idempotent: it reuses the device already backed by the file, so a
//! reboot or an agent restart simply attaches again), resized with `losetup -c` after the
//! backing file grew ([`refresh`]), and detached before the volume is removed
//! ([`detach_all`]). Everything shells out to util-linux `losetup`; the parsing is pure.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::StorageError;
use crate::provisioner::{self, DISK_IMAGE};

/// Marker file inside a volume directory: the volume is consumed as a block device.
pub const BLOCK_MARKER: &str = "volume-mode-block";

/// Whether the loop-device facility exists on this machine (`/dev/loop-control`).
pub fn loop_devices_available() -> bool {
    Path::new("/dev/loop-control").exists()
}

/// Whether the volume directory `dir` is a Block-mode volume.
pub fn is_block_volume(dir: &Path) -> bool {
    dir.join(BLOCK_MARKER).exists()
}

/// Turn the (already created) volume directory `dir` into a Block-mode volume and attach its
/// loop device. Returns the device path.
pub fn make_block_volume(dir: &Path) -> Result<PathBuf, StorageError> {
    let marker = dir.join(BLOCK_MARKER);
    std::fs::write(&marker, b"Block\n").map_err(|e| StorageError::io(&marker, e))?;
    attach(&dir.join(DISK_IMAGE))
}

/// The block device of a Block-mode volume directory (attached if it is not).
pub fn device_of(dir: &Path) -> Result<PathBuf, StorageError> {
    attach(&dir.join(DISK_IMAGE))
}

fn losetup(args: &[&std::ffi::OsStr]) -> Result<String, StorageError> {
    let out = Command::new("losetup")
        .args(args)
        .output()
        .map_err(|e| StorageError::Tool {
            tool: "losetup".into(),
            message: format!("cannot start losetup: {e}"),
        })?;
    if !out.status.success() {
        return Err(StorageError::Tool {
            tool: "losetup".into(),
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Parse `losetup -j FILE` output (`/dev/loop3: [2049]:1234 (/path/disk.img)` per line) into
/// the device paths.
pub fn parse_associated(output: &str) -> Vec<PathBuf> {
    output
        .lines()
        .filter_map(|l| l.split_once(':').map(|(dev, _)| dev.trim()))
        .filter(|d| d.starts_with("/dev/"))
        .map(PathBuf::from)
        .collect()
}

/// Loop devices currently backed by `file`.
pub fn associated(file: &Path) -> Result<Vec<PathBuf>, StorageError> {
    let out = losetup(&["-j".as_ref(), file.as_os_str()])?;
    Ok(parse_associated(&out))
}

/// The loop device backed by `file`: the existing one, else a newly attached one
/// (`losetup --find --show`).
pub fn attach(file: &Path) -> Result<PathBuf, StorageError> {
    if !file.is_file() {
        return Err(StorageError::io(
            file,
            std::io::Error::new(std::io::ErrorKind::NotFound, "backing file missing"),
        ));
    }
    if let Some(dev) = associated(file)?.into_iter().next() {
        return Ok(dev);
    }
    let out = losetup(&["--find".as_ref(), "--show".as_ref(), file.as_os_str()])?;
    let dev = out.trim();
    if !dev.starts_with("/dev/") {
        return Err(StorageError::Tool {
            tool: "losetup".into(),
            message: format!("unexpected output {dev:?}"),
        });
    }
    tracing::info!(file = %file.display(), device = dev, "attached loop device");
    Ok(PathBuf::from(dev))
}

/// Detach every loop device backed by `file` (a missing file is fine). Returns the devices.
pub fn detach_all(file: &Path) -> Result<Vec<PathBuf>, StorageError> {
    if !file.exists() {
        return Ok(Vec::new());
    }
    let devs = associated(file)?;
    for d in &devs {
        losetup(&["-d".as_ref(), d.as_os_str()])?;
        tracing::info!(file = %file.display(), device = %d.display(), "detached loop device");
    }
    Ok(devs)
}

/// Grow the backing file of Block-mode volume `dir` to `size` bytes and make its loop
/// device see the new capacity (`losetup -c`).
pub fn grow(dir: &Path, size: u64) -> Result<PathBuf, StorageError> {
    let img = dir.join(DISK_IMAGE);
    provisioner::create_sparse(&img, size)?;
    let dev = attach(&img)?;
    refresh(&dev)?;
    Ok(dev)
}

/// Re-read the size of the backing file of loop device `dev` (`losetup -c`).
pub fn refresh(dev: &Path) -> Result<(), StorageError> {
    losetup(&["-c".as_ref(), dev.as_os_str()]).map(drop)
}

/// The size in bytes of block device `dev` (from sysfs).
pub fn device_size(dev: &Path) -> Result<u64, StorageError> {
    let name = dev
        .file_name()
        .ok_or_else(|| StorageError::invalid("device", format!("{}", dev.display())))?;
    let p = Path::new("/sys/class/block").join(name).join("size");
    let s = std::fs::read_to_string(&p).map_err(|e| StorageError::io(&p, e))?;
    s.trim()
        .parse::<u64>()
        .map(|sectors| sectors * 512)
        .map_err(|e| StorageError::invalid("device size", e.to_string()))
}

/// Whether `path` is a block device.
pub fn is_block_device(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device())
}

/// Whether `losetup` can list devices here (root with loop support).
pub fn losetup_usable() -> bool {
    Command::new("losetup")
        .arg("-a")
        .output()
        .is_ok_and(|o| o.status.success())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_losetup_j() {
        let out =
            "/dev/loop3: [2049]:1234 (/v/pvc-1/disk.img)\n/dev/loop7: []: (/v/pvc-1/disk.img)\n";
        assert_eq!(
            parse_associated(out),
            vec![PathBuf::from("/dev/loop3"), PathBuf::from("/dev/loop7")]
        );
        assert!(parse_associated("").is_empty());
        assert!(parse_associated("garbage line\n").is_empty());
    }

    /// Attach, reuse, grow and detach a real loop device (skipped where there are none or
    /// this process may not create them).
    #[test]
    fn loop_device_lifecycle() {
        if !loop_devices_available() || !losetup_usable() {
            eprintln!("skipping: no usable loop devices");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("pvc-b");
        std::fs::create_dir_all(&dir).unwrap();
        provisioner::create_sparse(&dir.join(DISK_IMAGE), 4 << 20).unwrap();
        let dev = make_block_volume(&dir).unwrap();
        assert!(is_block_volume(&dir));
        assert!(is_block_device(&dev));
        assert_eq!(device_of(&dir).unwrap(), dev, "attach is idempotent");
        assert_eq!(device_size(&dev).unwrap(), 4 << 20);
        assert_eq!(grow(&dir, 8 << 20).unwrap(), dev);
        assert_eq!(device_size(&dev).unwrap(), 8 << 20);
        assert_eq!(detach_all(&dir.join(DISK_IMAGE)).unwrap(), vec![dev]);
        assert!(associated(&dir.join(DISK_IMAGE)).unwrap().is_empty());
    }
}
