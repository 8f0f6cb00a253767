//! Device node grants: the nodes a VM's devices need (`/dev/vfio/<group>`,
//! `/dev/bus/usb/BBB/DDD`) are given to its QEMU uid (owner changed, mode kept) for the VM's
//! life and given back to their owner before when its directory goes. Only character
//! devices are touched: a link or any other file at such a path is refused, never followed.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// A device node handed to a VM, with its owner before.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub path: PathBuf,
    pub uid: u32,
    pub gid: u32,
}

/// Gives each of `nodes` to `uid` (its owner; group and mode stay). On an error the
/// grants made so far are given back. Returns what to give back later.
pub fn grant(nodes: &[PathBuf], uid: u32) -> std::io::Result<Vec<Grant>> {
    let mut done: Vec<Grant> = Vec::new();
    for node in nodes {
        if done.iter().any(|g| &g.path == node) {
            continue;
        }
        match grant_one(node, uid) {
            Ok(g) => done.push(g),
            Err(e) => {
                restore(&done);
                return Err(e);
            }
        }
    }
    Ok(done)
}

fn grant_one(node: &Path, uid: u32) -> std::io::Result<Grant> {
    let meta = std::fs::symlink_metadata(node)?;
    if !meta.file_type().is_char_device() {
        return Err(std::io::Error::other(format!(
            "{} is not a character device",
            node.display()
        )));
    }
    let g = Grant {
        path: node.to_path_buf(),
        uid: meta.uid(),
        gid: meta.gid(),
    };
    std::os::unix::fs::lchown(node, Some(uid), None)?;
    Ok(g)
}

/// Gives the nodes back to their owners before (a node that is no longer the character
/// device it was is left alone).
pub fn restore(grants: &[Grant]) {
    for g in grants {
        let still_device =
            std::fs::symlink_metadata(&g.path).is_ok_and(|m| m.file_type().is_char_device());
        if !still_device {
            continue;
        }
        if let Err(e) = std::os::unix::fs::lchown(&g.path, Some(g.uid), Some(g.gid)) {
            tracing::warn!(
                "giving {} back to {}:{}: {e}",
                g.path.display(),
                g.uid,
                g.gid
            );
        }
    }
}
