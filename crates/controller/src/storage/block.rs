//! Block-mode volumes on the controller side: whether a PV is `volumeMode: Block`, the path
//! the populators write to (the volume's loop device for Block, `disk.img` otherwise), and
//! the provisioning/re-attachment/detachment steps around `ferrovirt_storage::block`.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::PersistentVolume;

use ferrovirt_storage::StorageError;
use ferrovirt_storage::block;
use ferrovirt_storage::provisioner::{DISK_IMAGE, image_of};

/// `volumeMode: Block`.
pub const BLOCK: &str = "Block";

/// Whether `pv` is a Block-mode volume.
pub fn is_block(pv: &PersistentVolume) -> bool {
    pv.spec.as_ref().and_then(|s| s.volume_mode.as_deref()) == Some(BLOCK)
}

async fn blocking<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> Result<T, StorageError> + Send + 'static,
) -> Result<T, StorageError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StorageError::Tool {
            tool: what.into(),
            message: e.to_string(),
        })?
}

/// Where a populator writes the data of the volume at `path` (the PV's directory): the loop
/// device of a Block volume (attached if needed), else `disk.img`.
pub async fn target(pv: &PersistentVolume, path: &Path) -> Result<PathBuf, StorageError> {
    if is_block(pv) && path.is_dir() {
        let dir = path.to_path_buf();
        blocking("losetup", move || block::device_of(&dir)).await
    } else {
        Ok(image_of(path))
    }
}

/// Turn a freshly created volume directory into a Block volume (marker + loop device).
pub async fn provision(dir: &Path) -> Result<PathBuf, StorageError> {
    if !block::loop_devices_available() {
        return Err(StorageError::Refused(
            "Block volumes need loop devices (/dev/loop-control) on the node".into(),
        ));
    }
    let dir = dir.to_path_buf();
    blocking("losetup", move || block::make_block_volume(&dir)).await
}

/// Detach the loop devices of the volume directory `dir` before it is removed.
pub async fn detach(dir: &Path) -> Result<Vec<PathBuf>, StorageError> {
    let img = dir.join(DISK_IMAGE);
    blocking("losetup", move || block::detach_all(&img)).await
}

/// Re-attach the loop device of Block volume directory `dir` when it is missing (after a
/// reboot). Returns the device.
pub async fn ensure_attached(dir: &Path) -> Result<PathBuf, StorageError> {
    let dir = dir.to_path_buf();
    blocking("losetup", move || block::device_of(&dir)).await
}

/// Grow the volume directory `dir` to `size` bytes: the sparse `disk.img`, and for a Block
/// volume its loop device's capacity (`losetup -c`).
pub async fn grow(dir: &Path, size: u64) -> Result<(), StorageError> {
    let dir = dir.to_path_buf();
    blocking("resize", move || {
        // A `shared` volume with snapshots: growing its frozen bottom would be a lie.
        ferrovirt_storage::snapshot::check_growable(&dir)?;
        if block::is_block_volume(&dir) {
            block::grow(&dir, size).map(drop)
        } else {
            ferrovirt_storage::provisioner::create_sparse(&dir.join(DISK_IMAGE), size)
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn block_mode_from_the_pv() {
        let pv: PersistentVolume =
            serde_json::from_value(json!({"spec": {"volumeMode": "Block"}})).unwrap();
        assert!(is_block(&pv));
        let pv: PersistentVolume =
            serde_json::from_value(json!({"spec": {"volumeMode": "Filesystem"}})).unwrap();
        assert!(!is_block(&pv));
        assert!(!is_block(&PersistentVolume::default()));
    }
}
