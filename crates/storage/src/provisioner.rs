//! Volume directories of the built-in provisioners. A volume is a directory `<root>/<pv
//! name>/` holding `disk.img`, a thin (sparse) raw file of the claim's size: the `shared`
//! class keeps its root on the server's machine (`DATA_DIR/volumes`), the `local` class one
//! per node. The agent finds the directory through the PersistentVolume's
//! `spec.hostPath.path` / `spec.local.path`.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};

use crate::error::StorageError;

/// The file holding a volume's data inside its directory.
pub const DISK_IMAGE: &str = "disk.img";

/// A root directory holding volume directories.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRoot {
    pub root: PathBuf,
}

/// Whether `name` can be a volume directory name: one path component of `[a-z0-9.-]`, not
/// `.`/`..` (PV names are DNS subdomains).
pub fn valid_volume_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

impl VolumeRoot {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        VolumeRoot { root: root.into() }
    }

    /// The directory of volume `name`.
    pub fn dir(&self, name: &str) -> Result<PathBuf, StorageError> {
        if !valid_volume_name(name) {
            return Err(StorageError::invalid(
                "volume name",
                format!("{name:?} is not a DNS subdomain"),
            ));
        }
        Ok(self.root.join(name))
    }

    /// Create (or grow) volume `name` with a sparse `disk.img` of `size` bytes. Idempotent:
    /// existing data is kept. Returns the volume directory.
    pub fn create(&self, name: &str, size: u64) -> Result<PathBuf, StorageError> {
        let dir = self.dir(name)?;
        std::fs::create_dir_all(&dir).map_err(|e| StorageError::io(&dir, e))?;
        let img = dir.join(DISK_IMAGE);
        create_sparse(&img, size)?;
        Ok(dir)
    }

    /// Remove volume `name` and its data; a missing volume is not an error.
    pub fn delete(&self, name: &str) -> Result<(), StorageError> {
        let dir = self.dir(name)?;
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StorageError::io(dir, e)),
        }
    }
}

/// Create `path` as a sparse file of `size` bytes, or grow it to `size` (never shrinks).
pub fn create_sparse(path: &Path, size: u64) -> Result<(), StorageError> {
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| StorageError::io(path, e))?;
    let len = f.metadata().map_err(|e| StorageError::io(path, e))?.len();
    if len < size {
        f.set_len(size).map_err(|e| StorageError::io(path, e))?;
    }
    Ok(())
}

/// Empty a volume's `disk.img` back to all zeros (sparse) of `size` bytes: used before a
/// retried import so no partial data survives.
pub fn reset_sparse(path: &Path, size: u64) -> Result<(), StorageError> {
    let f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(path)
        .map_err(|e| StorageError::io(path, e))?;
    f.set_len(size).map_err(|e| StorageError::io(path, e))
}

/// The image file of a volume path as a PV names it: `<dir>/disk.img` for a directory, the
/// path itself otherwise (an image file or block device).
pub fn image_of(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join(DISK_IMAGE)
    } else {
        path.to_path_buf()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn names() {
        assert!(valid_volume_name("pvc-1234-abcd"));
        assert!(!valid_volume_name("../etc"));
        assert!(!valid_volume_name(".."));
        assert!(!valid_volume_name("A"));
        assert!(!valid_volume_name(""));
    }

    #[test]
    fn create_is_sparse_idempotent_and_deletable() {
        let d = tempfile::tempdir().unwrap();
        let root = VolumeRoot::new(d.path().join("volumes"));
        let dir = root.create("pvc-a", 1 << 30).unwrap();
        let img = dir.join(DISK_IMAGE);
        let m = std::fs::metadata(&img).unwrap();
        assert_eq!(m.len(), 1 << 30);
        assert!(m.blocks() * 512 < 1 << 20, "not sparse");
        std::fs::write(dir.join("marker"), b"x").unwrap();
        root.create("pvc-a", 1 << 20).unwrap();
        assert_eq!(std::fs::metadata(&img).unwrap().len(), 1 << 30);
        assert_eq!(image_of(&dir), img);
        assert_eq!(image_of(&img), img);
        root.delete("pvc-a").unwrap();
        assert!(!dir.exists());
        root.delete("pvc-a").unwrap();
        assert!(root.create("../x", 1).is_err());
    }
}
