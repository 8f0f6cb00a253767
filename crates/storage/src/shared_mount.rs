//! Shared filesystems declared in StorageClasses (docs/storage.md, "Shared filesystems across
//! machines"): a class of the `ferrovirt.io/shared` provisioner with the parameter
//! `ferrovirt.io/shared-mount` names a directory where the administrator has mounted the same
//! shared filesystem (NFS, CephFS, …) on every node. Its volumes live in `<mount>/volumes/<pv>/`.
//!
//! Whether a node sees *the same* filesystem is decided by a marker: the server's provisioner
//! writes `<mount>/.ferrovirt-class-<class>` holding the class's uid ([`write_marker`]); a node
//! whose `<mount>` shows that file with that uid has the filesystem mounted ([`check`]). An
//! empty directory (the mount missing), a different filesystem at the path, or a marker of an
//! older class of the same name all fail the check, with a message naming the class and path.
//! The names (parameter, condition, annotation) and the parameter's validation live in
//! `ferrovirt_api::shared_mount`, where admission uses them; this module only does the I/O.

use std::path::{Path, PathBuf};

/// Subdirectory of the mount holding the class's volumes.
pub const VOLUMES_DIR: &str = "volumes";

/// The marker file of `class` under `mount`.
pub fn marker_path(mount: &Path, class: &str) -> PathBuf {
    mount.join(format!(".ferrovirt-class-{class}"))
}

/// The volume root of a class mounted at `mount`.
pub fn volume_root(mount: &Path) -> PathBuf {
    mount.join(VOLUMES_DIR)
}

/// Writes (or refreshes) the marker of `class` (uid `uid`) at `mount`. The mount point must
/// exist already (never created here: writing into the unmounted directory would hide the
/// missing mount). Returns whether the file was (re)written.
pub fn write_marker(mount: &Path, class: &str, uid: &str) -> Result<bool, String> {
    if !mount.is_dir() {
        return Err(format!(
            "shared mount {} of StorageClass {class:?} does not exist on the server's machine",
            mount.display()
        ));
    }
    let path = marker_path(mount, class);
    if std::fs::read_to_string(&path).is_ok_and(|s| s.trim() == uid) {
        return Ok(false);
    }
    let tmp = mount.join(format!(".ferrovirt-class-{class}.tmp"));
    std::fs::write(&tmp, format!("{uid}\n"))
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(true)
}

/// One declared shared mount as a node sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountState {
    pub class: String,
    pub mount: PathBuf,
    /// `None`: mounted; `Some(why)`: missing, and why.
    pub problem: Option<String>,
}

/// What a node sees at `mount` for `class` (uid `uid`), given how to read a file.
pub fn check_with(
    class: &str,
    uid: &str,
    mount: &Path,
    read: impl Fn(&Path) -> std::io::Result<String>,
) -> MountState {
    let marker = marker_path(mount, class);
    let problem = match read(&marker) {
        Ok(s) if s.trim() == uid => None,
        Ok(_) => Some(format!(
            "{} belongs to another StorageClass {class:?} (a different filesystem or an older class)",
            marker.display()
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(format!(
            "{} is not mounted here (no marker {})",
            mount.display(),
            marker.display()
        )),
        Err(e) => Some(format!("{}: {e}", marker.display())),
    };
    MountState {
        class: class.into(),
        mount: mount.into(),
        problem,
    }
}

/// [`check_with`] on this machine's files.
pub fn check(class: &str, uid: &str, mount: &Path) -> MountState {
    check_with(class, uid, mount, |p| std::fs::read_to_string(p))
}

/// The value of the Node annotation `storage.ferrovirt.io/shared-mounts` for these states: the
/// mounted classes, sorted.
pub fn mounted_list(states: &[MountState]) -> String {
    let mut names: Vec<&str> = states
        .iter()
        .filter(|s| s.problem.is_none())
        .map(|s| s.class.as_str())
        .collect();
    names.sort_unstable();
    names.join(",")
}

/// `(status, reason, message)` of the Node condition `SharedStorageMounted` for these states.
pub fn condition(states: &[MountState]) -> (&'static str, &'static str, String) {
    if states.is_empty() {
        return (
            "True",
            "NoSharedMounts",
            "no StorageClass declares a shared mount".to_string(),
        );
    }
    let missing: Vec<String> = states
        .iter()
        .filter_map(|s| {
            let why = s.problem.as_ref()?;
            Some(format!("StorageClass {:?}: {why}", s.class))
        })
        .collect();
    if missing.is_empty() {
        let all: Vec<String> = states
            .iter()
            .map(|s| format!("{} at {}", s.class, s.mount.display()))
            .collect();
        ("True", "AllMounted", format!("mounted: {}", all.join(", ")))
    } else {
        ("False", "MountMissing", missing.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Error, ErrorKind};

    #[test]
    fn the_marker_decides() {
        let m = Path::new("/mnt/vmstore");
        let ok = check_with("vmstore", "u1", m, |_| Ok("u1\n".into()));
        assert_eq!(ok.problem, None);
        let absent = check_with("vmstore", "u1", m, |_| {
            Err(Error::from(ErrorKind::NotFound))
        });
        let why = absent.problem.clone().unwrap();
        assert!(why.contains("/mnt/vmstore is not mounted"), "{why}");
        let other = check_with("vmstore", "u1", m, |_| Ok("u0".into()));
        assert!(other.problem.unwrap().contains("another StorageClass"));
        let denied = check_with("vmstore", "u1", m, |_| {
            Err(Error::from(ErrorKind::PermissionDenied))
        });
        assert!(denied.problem.is_some());

        let states = vec![ok.clone(), absent.clone()];
        assert_eq!(mounted_list(&states), "vmstore");
        let (status, reason, msg) = condition(&states);
        assert_eq!((status, reason), ("False", "MountMissing"));
        assert!(msg.contains("StorageClass \"vmstore\""), "{msg}");
        assert_eq!(condition(std::slice::from_ref(&ok)).0, "True");
        assert_eq!(condition(&[]).1, "NoSharedMounts");
        assert_eq!(mounted_list(&[absent]), "");
    }

    #[test]
    fn markers_are_written_only_into_an_existing_mount() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("absent");
        let e = write_marker(&missing, "c", "u1").unwrap_err();
        assert!(e.contains("does not exist"), "{e}");
        assert!(!missing.exists());
        assert!(write_marker(dir.path(), "c", "u1").unwrap());
        assert!(!write_marker(dir.path(), "c", "u1").unwrap());
        assert_eq!(check("c", "u1", dir.path()).problem, None);
        assert!(write_marker(dir.path(), "c", "u2").unwrap());
        assert!(check("c", "u1", dir.path()).problem.is_some());
    }
}
