//! Block migration on the node (docs/migration.md "Node-local disks"): which node-local
//! claims can be copied to another node, the target's fresh copies of them (made in its own
//! volume root, marked with the VMI uid until the VM runs there, deleted when the migration
//! fails), and the PersistentVolume's move to the target once it runs the VM. The decisions
//! are pure; the file work is small and tested on real directories.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::volumes::ClaimInfo;

/// The marker in a target's fresh volume directory: the uid of the VMI migrating in.
pub const TARGET_MARKER: &str = ".ferrovirt-migrating-in";

/// Whether a claim that is not shared can be copied by a block migration: a Filesystem
/// volume of the `local` class, made by ferrovirt in this node's volume root (with or without
/// snapshots: a layer chain is carried, [`crate::chaincopy`]).
pub fn claim_block_ok(info: Option<&ClaimInfo>, volume_root: &Path) -> Result<(), String> {
    let Some(info) = info else {
        return Err("its volume is unknown".into());
    };
    if !info.ours || info.path.parent() != Some(volume_root) {
        return Err(format!(
            "its volume {} is not a node-local volume made by ferrovirt",
            info.path.display()
        ));
    }
    if ferrovirt_storage::block::is_block_volume(&info.path) {
        return Err("it is a Block-mode volume (a loop device), which is not copied".into());
    }
    Ok(())
}

/// The PV name of a volume directory in a volume root (the provisioner names it so).
pub fn pv_of(path: &Path) -> Option<String> {
    path.file_name().map(|n| n.to_string_lossy().into_owned())
}

/// Creates the target's empty copy `root/<pv>/disk.img` of `bytes`, marked for `uid`.
/// Refuses a directory that exists already: it may hold another volume's data.
pub fn create_target_volume(
    root: &Path,
    pv: &str,
    bytes: u64,
    uid: &str,
) -> Result<PathBuf, String> {
    if pv.is_empty() || pv.contains('/') || pv.starts_with('.') {
        return Err(format!("bad volume name {pv:?}"));
    }
    let dir = root.join(pv);
    if dir.exists() {
        return Err(format!(
            "{} exists on this node already: the copy is not made over it",
            dir.display()
        ));
    }
    std::fs::create_dir_all(root).map_err(|e| format!("{}: {e}", root.display()))?;
    std::fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    std::fs::write(dir.join(TARGET_MARKER), uid).map_err(|e| format!("marker: {e}"))?;
    let img = dir.join("disk.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(bytes))
        .map_err(|e| format!("{}: {e}", img.display()))?;
    Ok(dir)
}

/// The volume directories in `root` marked as copies for `uid`.
pub fn marked_for(root: &Path, uid: &str) -> Vec<PathBuf> {
    std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| std::fs::read_to_string(p.join(TARGET_MARKER)).is_ok_and(|m| m.trim() == uid))
        .collect()
}

/// Deletes the partial copies made for `uid` (a failed or cancelled migration).
pub fn remove_target_volumes(root: &Path, uid: &str) -> Vec<PathBuf> {
    let dirs = marked_for(root, uid);
    for d in &dirs {
        if let Err(e) = std::fs::remove_dir_all(d) {
            tracing::warn!("removing the partial copy {}: {e}", d.display());
        }
    }
    dirs
}

/// The copies made for `uid` now hold the running VM's disks: unmark them.
pub fn keep_target_volumes(root: &Path, uid: &str) -> Vec<PathBuf> {
    let dirs = marked_for(root, uid);
    for d in &dirs {
        let _ = std::fs::remove_file(d.join(TARGET_MARKER));
    }
    dirs
}

/// The merge patch moving a `local` PV to `node`, its volume at `path` there.
pub fn pv_move_patch(path: &Path, node: &str) -> Value {
    json!({"spec": {
        "local": {"path": path.display().to_string()},
        "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}}
    }})
}

/// The source's copy may go: the PV names another node's volume now (`pv_path`: its
/// `local.path`, `own`: the source's directory).
pub fn source_copy_released(pv_path: Option<&str>, own: &Path) -> bool {
    pv_path.is_some_and(|p| Path::new(p) != own)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(path: PathBuf, ours: bool) -> ClaimInfo {
        ClaimInfo {
            path,
            read_only: false,
            ours,
        }
    }

    #[test]
    fn only_our_plain_local_volumes_are_copied() {
        let root = tempfile::tempdir().unwrap();
        let vol = root.path().join("pv-a");
        std::fs::create_dir(&vol).unwrap();
        assert_eq!(
            claim_block_ok(Some(&info(vol.clone(), true)), root.path()),
            Ok(())
        );
        assert!(claim_block_ok(Some(&info(vol.clone(), false)), root.path()).is_err());
        assert!(claim_block_ok(Some(&info("/elsewhere/x".into(), true)), root.path()).is_err());
        assert!(claim_block_ok(None, root.path()).is_err());
        // A volume with snapshots is copied with its chain.
        std::fs::write(vol.join(ferrovirt_storage::snapshot::CHAIN_FILE), "{}").unwrap();
        assert_eq!(claim_block_ok(Some(&info(vol, true)), root.path()), Ok(()));
    }

    #[test]
    fn target_copies_are_made_fresh_and_removed_only_for_their_vmi() {
        let root = tempfile::tempdir().unwrap();
        let d = create_target_volume(root.path(), "pv-a", 1 << 20, "uid-1").unwrap();
        assert_eq!(
            std::fs::metadata(d.join("disk.img")).unwrap().len(),
            1 << 20
        );
        // Never over an existing volume, never outside the root.
        assert!(create_target_volume(root.path(), "pv-a", 1, "uid-2").is_err());
        assert!(create_target_volume(root.path(), "../x", 1, "uid-2").is_err());
        let other = root.path().join("pv-b");
        std::fs::create_dir(&other).unwrap();
        assert!(remove_target_volumes(root.path(), "uid-2").is_empty());
        assert_eq!(remove_target_volumes(root.path(), "uid-1"), vec![d.clone()]);
        assert!(!d.exists() && other.exists());
        // Kept copies lose their mark and are never removed as partial copies again.
        let d = create_target_volume(root.path(), "pv-c", 1, "uid-3").unwrap();
        assert_eq!(keep_target_volumes(root.path(), "uid-3"), vec![d.clone()]);
        assert!(remove_target_volumes(root.path(), "uid-3").is_empty());
        assert!(d.join("disk.img").exists());
    }

    #[test]
    fn the_pv_moves_and_the_source_copy_waits_for_it() {
        let p = pv_move_patch(Path::new("/d/volumes/pv-a"), "node2");
        assert_eq!(p["spec"]["local"]["path"], "/d/volumes/pv-a");
        assert_eq!(
            p["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
                [0],
            "node2"
        );
        let own = Path::new("/n1/volumes/pv-a");
        assert!(!source_copy_released(Some("/n1/volumes/pv-a"), own));
        assert!(!source_copy_released(None, own));
        assert!(source_copy_released(Some("/n2/volumes/pv-a"), own));
    }
}
