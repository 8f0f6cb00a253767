//! Shared filesystems declared in StorageClasses (docs/storage.md, "Shared filesystems across
//! machines"): the names the provisioner, the node agents and the scheduler agree on, and the
//! pure validation of the [`MOUNT_PARAMETER`] that admission runs (a bad path is refused with
//! a 422 naming the parameter). The marker I/O is `ferrovirt_storage::shared_mount`.

use std::path::{Path, PathBuf};

/// The provisioner of shared classes (the built-in `shared` class and declared mounts).
pub const PROVISIONER: &str = "ferrovirt.io/shared";
/// StorageClass parameter naming the mount point of a shared filesystem.
pub const MOUNT_PARAMETER: &str = "ferrovirt.io/shared-mount";
/// Node condition reporting whether every declared shared mount is present.
pub const CONDITION: &str = "SharedStorageMounted";
/// Node annotation listing (comma-separated, sorted) the shared-mount classes whose mount
/// the node's agent found; the scheduler places a VMI with such a class's volume only on a
/// node listing the class.
pub const MOUNTED_ANNOTATION: &str = "storage.ferrovirt.io/shared-mounts";

/// Whether `mount` is an acceptable mount path: absolute, plain names only, not `/`.
pub fn valid_mount_path(mount: &str) -> Result<PathBuf, String> {
    let p = Path::new(mount);
    let plain = !mount.split('/').any(|s| s == "." || s == "..");
    if !p.is_absolute() || !plain || p.parent().is_none() {
        return Err(format!(
            "parameter {MOUNT_PARAMETER} must be an absolute path of plain names other than /, not {mount:?}"
        ));
    }
    Ok(p.to_path_buf())
}

/// The mount a StorageClass (`provisioner`, `parameters`) declares: `None` when it declares
/// none (no [`MOUNT_PARAMETER`], or another provisioner), `Some(Err)` naming the parameter
/// when its value is not a usable path.
pub fn declared(
    provisioner: &str,
    parameters: Option<&std::collections::BTreeMap<String, String>>,
) -> Option<Result<PathBuf, String>> {
    if provisioner != PROVISIONER {
        return None;
    }
    Some(valid_mount_path(parameters?.get(MOUNT_PARAMETER)?))
}

/// Whether a [`MOUNTED_ANNOTATION`] value lists `class`.
pub fn lists(annotation: Option<&str>, class: &str) -> bool {
    annotation.is_some_and(|a| a.split(',').any(|c| c.trim() == class))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_paths_are_absolute_and_plain() {
        assert!(valid_mount_path("/mnt/vmstore").is_ok());
        for bad in ["", "/", "mnt/x", "/mnt/../etc", "/mnt/./x"] {
            let e = valid_mount_path(bad).unwrap_err();
            assert!(e.contains(MOUNT_PARAMETER), "{bad}: {e}");
        }
    }

    #[test]
    fn only_the_shared_provisioner_declares_mounts() {
        let params = std::collections::BTreeMap::from([(
            MOUNT_PARAMETER.to_string(),
            "/mnt/vmstore".to_string(),
        )]);
        assert_eq!(
            declared(PROVISIONER, Some(&params)),
            Some(Ok(PathBuf::from("/mnt/vmstore")))
        );
        assert_eq!(declared("ferrovirt.io/local", Some(&params)), None);
        assert_eq!(declared(PROVISIONER, None), None);
    }

    #[test]
    fn annotation_lists_classes() {
        assert!(lists(Some("a,vmstore"), "vmstore"));
        assert!(!lists(Some("vmstore2"), "vmstore"));
        assert!(!lists(None, "vmstore"));
        assert!(!lists(Some(""), "vmstore"));
    }
}
