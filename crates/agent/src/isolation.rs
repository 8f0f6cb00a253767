//! Isolation of VMs on the node: the node's isolation settings ([`IsolationOptions`]), the
//! uid each VM's QEMU drops to (`-runas uid:gid`: one uid per VMI from a configured range,
//! claimed with create-new files under `<data dir>/qemu-uids/` so concurrent starts never share
//! one, recorded in the VMI directory so a re-adopted launcher keeps it, released when the VMI
//! directory goes), the ownership and modes of a VM's images (readable only by root and that
//! uid) and the permissions of VMI directories. The older shared [`QEMU_USER`] remains for
//! agents that run QEMU without a range.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A range of uids (and equal gids) for VMs' QEMU processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UidRange {
    pub first: u32,
    pub count: u32,
}

impl UidRange {
    /// Parses `FIRST-LAST` (inclusive).
    pub fn parse(s: &str) -> Result<UidRange, String> {
        let (a, b) = s
            .split_once('-')
            .ok_or_else(|| format!("{s:?}: expected FIRST-LAST"))?;
        let first: u32 = a.trim().parse().map_err(|e| format!("{s:?}: {e}"))?;
        let last: u32 = b.trim().parse().map_err(|e| format!("{s:?}: {e}"))?;
        if first == 0 || last < first || last == u32::MAX {
            return Err(format!(
                "{s:?}: need 0 < FIRST <= LAST < 4294967295 (root is never a VM's uid)"
            ));
        }
        Ok(UidRange {
            first,
            count: last - first + 1,
        })
    }

    fn contains(&self, uid: u32) -> bool {
        uid >= self.first && uid - self.first < self.count
    }
}

/// The node's isolation settings (agent flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IsolationOptions {
    /// Directories hostDisk volumes and foreign PV host paths may lie under
    /// (`--host-disk-root`; none by default: such paths are refused).
    pub host_disk_roots: Vec<PathBuf>,
    /// ferrovirt's data directories besides the agent's own (the server's data dir).
    pub protected_dirs: Vec<PathBuf>,
    /// Per-VM QEMU uids (`--qemu-uid-range`).
    pub qemu_uids: UidRange,
    /// Bound of each VMI's `serial.log` (`--serial-log-max-bytes`), rotated to `serial.log.1`.
    pub serial_log_max_bytes: u64,
    /// `pids.max` of each VM's cgroup (`--vm-pids-max`).
    pub pids_max: u64,
}

impl Default for IsolationOptions {
    fn default() -> Self {
        IsolationOptions {
            host_disk_roots: Vec::new(),
            protected_dirs: Vec::new(),
            qemu_uids: UidRange {
                first: DEFAULT_UID_FIRST,
                count: DEFAULT_UID_COUNT,
            },
            serial_log_max_bytes: 4 << 20,
            pids_max: 4096,
        }
    }
}

/// Default first per-VM uid: far above login users and the usual subordinate-uid ranges.
pub const DEFAULT_UID_FIRST: u32 = 3_000_000_000;
/// Default number of per-VM uids.
pub const DEFAULT_UID_COUNT: u32 = 65_536;
/// The file in a VMI directory recording its QEMU uid.
pub const UID_FILE: &str = "qemu-uid";
const CLAIMS_DIR: &str = "qemu-uids";

/// The candidate order for a VMI: starting at a position derived from its uid (so restarts
/// tend to land on the same one), then every other uid of the range once. Pure.
pub fn uid_candidates(range: UidRange, vmi_uid: &str) -> impl Iterator<Item = u32> {
    let h = vmi_uid.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let start = (h % u64::from(range.count)) as u32;
    (0..range.count).map(move |i| range.first + (start + i) % range.count)
}

/// The QEMU uid of the VMI in `vmi_dir`: the one recorded there, else a newly claimed one.
/// `data_dir` holds the claims; a claim whose VMI directory is gone is stale and reused.
pub fn allocate_uid(
    data_dir: &Path,
    vmi_dir: &Path,
    vmi_uid: &str,
    range: UidRange,
) -> std::io::Result<u32> {
    if let Some(u) = recorded_uid(vmi_dir).filter(|u| range.contains(*u)) {
        return Ok(u);
    }
    let claims = data_dir.join(CLAIMS_DIR);
    std::fs::create_dir_all(&claims)?;
    restrict_dir(&claims)?;
    for candidate in uid_candidates(range, vmi_uid) {
        let claim = claims.join(candidate.to_string());
        // A second try after removing a stale claim.
        for _ in 0..2 {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&claim);
            match file {
                Ok(mut f) => {
                    f.write_all(vmi_uid.as_bytes())?;
                    write_new_file(&vmi_dir.join(UID_FILE), candidate.to_string().as_bytes())?;
                    return Ok(candidate);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let owner = std::fs::read_to_string(&claim).unwrap_or_default();
                    let stale = !owner.is_empty()
                        && owner != vmi_uid
                        && !data_dir.join("vmis").join(owner.trim()).exists();
                    if !stale {
                        break;
                    }
                    let _ = std::fs::remove_file(&claim);
                }
                Err(e) => return Err(e),
            }
        }
    }
    Err(std::io::Error::other(format!(
        "all {} QEMU uids from {} are in use",
        range.count, range.first
    )))
}

/// The uid recorded in a VMI directory.
pub fn recorded_uid(vmi_dir: &Path) -> Option<u32> {
    std::fs::read_to_string(vmi_dir.join(UID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Releases the uid claim of the VMI directory `vmi_dir` (under `<data dir>/vmis/`).
pub fn release_uid(vmi_dir: &Path) {
    let (Some(uid), Some(data_dir)) = (
        recorded_uid(vmi_dir),
        vmi_dir.parent().and_then(Path::parent),
    ) else {
        return;
    };
    let _ = std::fs::remove_file(data_dir.join(CLAIMS_DIR).join(uid.to_string()));
}

/// Writes `data` to `path` through a random temporary name created with create-new
/// semantics (mode 0600), then renames it into place: no reader sees a partial file and no
/// pre-planted file or link at a predictable name is ever opened.
pub fn write_new_file(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    for _ in 0..16 {
        let tmp = dir.join(format!(".{name}.{:016x}", fastrand::u64(..)));
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp);
        match f {
            Ok(mut f) => {
                let r = f.write_all(data).and_then(|_| f.sync_all());
                if let Err(e) = r.and_then(|_| std::fs::rename(&tmp, path)) {
                    let _ = std::fs::remove_file(&tmp);
                    return Err(e);
                }
                return Ok(());
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other("no free temporary name"))
}

/// Gives a VM's image to its QEMU uid: owner `uid:uid`, mode 0600 (root, the agent, keeps
/// access). A directory holding the image (a claim's volume directory) becomes 0700 root.
pub fn own_image(image: &Path, uid: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::symlink_metadata(image)?;
    if !meta.file_type().is_file() {
        return Ok(()); // block devices keep the owner the host gave them
    }
    std::os::unix::fs::lchown(image, Some(uid), Some(uid))?;
    std::fs::set_permissions(image, std::fs::Permissions::from_mode(0o600))
}

/// Gives the images of a VM's prepared volumes to its QEMU uid ([`own_image`]); a claim's
/// volume directory (holding `disk.img`) becomes 0700 root. Shared read-only bases (the
/// containerDisk cache) are left alone.
pub fn own_volumes<'a>(
    volumes: impl IntoIterator<Item = &'a std::path::PathBuf>,
    uid: u32,
) -> std::io::Result<()> {
    for path in volumes {
        own_image(path, uid)?;
        let claim_image = |dir: &Path| {
            path.file_name().is_some_and(|n| n == "disk.img")
                || dir.join(ferrovirt_storage::snapshot::CHAIN_FILE).exists()
        };
        if let Some(dir) = path.parent()
            && claim_image(dir)
        {
            restrict_dir(dir)?;
        }
    }
    Ok(())
}

/// The `-runas` value for a uid.
pub fn run_as(uid: u32) -> String {
    format!("{uid}:{uid}")
}

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
    fn uid_ranges_parse_and_never_include_root() {
        assert_eq!(
            UidRange::parse("100-199"),
            Ok(UidRange {
                first: 100,
                count: 100
            })
        );
        assert!(UidRange::parse("0-10").is_err());
        assert!(UidRange::parse("10-5").is_err());
        assert!(UidRange::parse("10").is_err());
        let r = UidRange::parse("100-103").unwrap();
        let mut c: Vec<u32> = uid_candidates(r, "some-vmi").collect();
        c.sort();
        assert_eq!(c, vec![100, 101, 102, 103]);
    }

    #[test]
    fn uids_are_claimed_once_kept_and_released() {
        let d = tempfile::tempdir().unwrap();
        let range = UidRange::parse("5000-5001").unwrap();
        let vmi = |u: &str| {
            let p = d.path().join("vmis").join(u);
            std::fs::create_dir_all(&p).unwrap();
            p
        };
        let (a, b, c) = (vmi("a"), vmi("b"), vmi("c"));
        let ua = allocate_uid(d.path(), &a, "a", range).unwrap();
        let ub = allocate_uid(d.path(), &b, "b", range).unwrap();
        assert_ne!(ua, ub);
        assert_eq!(allocate_uid(d.path(), &a, "a", range).unwrap(), ua);
        assert!(allocate_uid(d.path(), &c, "c", range).is_err());
        release_uid(&a);
        std::fs::remove_dir_all(&a).unwrap();
        assert_eq!(allocate_uid(d.path(), &c, "c", range).unwrap(), ua);
        // A claim whose VMI directory vanished without a release is reused.
        std::fs::remove_dir_all(&b).unwrap();
        let e = vmi("e");
        assert_eq!(allocate_uid(d.path(), &e, "e", range).unwrap(), ub);
    }

    #[test]
    fn new_files_replace_atomically_and_ignore_planted_links() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("secret");
        std::fs::write(d.path().join("elsewhere"), b"keep").unwrap();
        std::os::unix::fs::symlink(d.path().join("elsewhere"), &target).unwrap();
        write_new_file(&target, b"new").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert_eq!(std::fs::read(d.path().join("elsewhere")).unwrap(), b"keep");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&target).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let left: Vec<_> = std::fs::read_dir(d.path()).unwrap().collect();
        assert_eq!(left.len(), 2, "no temporary file left behind");
    }

    #[test]
    fn parses_effective_uid() {
        assert_eq!(parse_euid("Name:\tx\nUid:\t1000\t0\t0\t0\n"), Some(0));
        assert_eq!(parse_euid("Uid:\t5 6 7 8"), Some(6));
        assert_eq!(parse_euid("nothing"), None);
    }
}
