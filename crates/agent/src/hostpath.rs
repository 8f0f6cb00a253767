//! Host paths a VMI may name: `hostDisk` volumes and the host paths of PersistentVolumes that
//! ferrovirt's provisioners did not make. A host path is used only when
//! - (hostDisk) the HyperConverged feature gate `HostDisk` is on, as in KubeVirt;
//! - it is absolute and plain (no `.`/`..`), lies under one of the node's allowed roots
//!   (`--host-disk-root`), and not under `/proc`, `/sys`, `/dev` or ferrovirt's own data
//!   directories (tokens, keys, other VMs' files);
//! - no component of it is a symbolic link, and what it names is a regular file or directory
//!   (never a device node, FIFO or socket); the walk uses `lstat`, so nothing is followed.
//!
//! [`check_lexical`] is the pure part; [`check_on_disk`] walks the path. Refusals name the
//! field and the path.

use std::path::{Component, Path, PathBuf};

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;

use crate::error::AgentError;
use crate::volumes::ResolvedRefs;

/// What the node allows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostPathPolicy {
    /// The HyperConverged `spec.featureGates.HostDisk`.
    pub host_disk_gate: bool,
    /// Directories under which host paths may lie (`--host-disk-root`; none by default).
    pub allowed_roots: Vec<PathBuf>,
    /// ferrovirt's own data directories: never reachable through a host path.
    pub protected: Vec<PathBuf>,
}

/// The kernel's and devices' trees: never a disk.
const SYSTEM_TREES: [&str; 3] = ["/proc", "/sys", "/dev"];

/// True when `path` is absolute and made of plain names only.
fn plain(path: &Path) -> bool {
    path.is_absolute()
        && path
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
}

/// The pure checks on a host path's text. `ours`: a PV our provisioner made (inside a
/// protected directory by design), for which only the system trees are refused.
pub fn check_lexical(path: &Path, policy: &HostPathPolicy, ours: bool) -> Result<(), String> {
    let shown = path.display();
    if !plain(path) {
        return Err(format!(
            "{shown:?} must be an absolute path without \".\" or \"..\""
        ));
    }
    if let Some(t) = SYSTEM_TREES.iter().find(|t| path.starts_with(t)) {
        return Err(format!("{shown:?} lies under {t}, which is never a disk"));
    }
    if ours {
        return Ok(());
    }
    if let Some(p) = policy
        .protected
        .iter()
        .find(|p| path.starts_with(p) || p.starts_with(path))
    {
        return Err(format!(
            "{shown:?} reaches ferrovirt's data directory {}",
            p.display()
        ));
    }
    if policy.allowed_roots.is_empty() {
        return Err(format!(
            "{shown:?}: this node allows no host paths (the agent's --host-disk-root is not set)"
        ));
    }
    if !policy.allowed_roots.iter().any(|r| path.starts_with(r)) {
        return Err(format!(
            "{shown:?} is not under an allowed root ({})",
            policy
                .allowed_roots
                .iter()
                .map(|r| r.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Ok(())
}

/// Whether a PV at `path` with provisioner annotation `provisioned_by` was made by our
/// provisioners: the annotation names one and the path has their layout, a volume directory
/// directly in a `volumes/` root (shared, and local ones in an agent's data dir) or in
/// `local-volumes/<node>/` (local volumes of earlier versions, made by the server). A standalone
/// agent does not know the server's data dir, so the layout, not the location, is checked;
/// such PVs still get the system-tree, symlink and device checks.
pub fn made_by_us(path: &Path, provisioned_by: Option<&str>) -> bool {
    let annotated = matches!(
        provisioned_by,
        Some("ferrovirt.io/local" | "ferrovirt.io/shared")
    );
    fn name_of(p: Option<&Path>) -> Option<&str> {
        p.and_then(Path::file_name).and_then(|n| n.to_str())
    }
    let parent = path.parent();
    let grandparent = parent.and_then(Path::parent);
    annotated
        && plain(path)
        && path.file_name().is_some()
        && (name_of(parent) == Some("volumes") || name_of(grandparent) == Some("local-volumes"))
}

/// Walks `path` with `lstat`: no component may be a symbolic link, and an existing leaf must
/// be a regular file or a directory (a `disk.img` inside it is checked the same way). A
/// missing leaf (or missing parents) is allowed only when `may_create`.
pub fn check_on_disk(path: &Path, may_create: bool) -> Result<(), String> {
    let shown = path.display();
    let mut at = PathBuf::from("/");
    let mut components = path.components().skip(1).peekable();
    while let Some(c) = components.next() {
        at.push(c);
        let last = components.peek().is_none();
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(format!(
                    "{shown:?}: {} is a symbolic link (host paths are opened without following links)",
                    at.display()
                ));
            }
            Ok(m) if !last && !m.is_dir() => {
                return Err(format!("{shown:?}: {} is not a directory", at.display()));
            }
            Ok(m) if last => {
                if m.is_dir() {
                    let img = at.join("disk.img");
                    if let Ok(im) = std::fs::symlink_metadata(&img)
                        && !im.file_type().is_file()
                    {
                        return Err(format!(
                            "{shown:?}: {} is not a regular file",
                            img.display()
                        ));
                    }
                } else if !m.is_file() {
                    return Err(format!(
                        "{shown:?} is not a regular file or directory (device nodes, FIFOs and sockets are refused)"
                    ));
                }
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && may_create => return Ok(()),
            Err(e) => return Err(format!("{shown:?}: {}: {e}", at.display())),
        }
    }
    Ok(())
}

/// Every host path `vmi` names, checked: `hostDisk` paths (with the feature gate) and the
/// host paths of its claims' PersistentVolumes. The error names the field and the path.
pub fn verify(
    vmi: &VirtualMachineInstance,
    refs: &ResolvedRefs,
    policy: &HostPathPolicy,
) -> Result<(), AgentError> {
    let volumes = vmi.spec.as_ref().and_then(|s| s.volumes.as_ref());
    for (i, v) in volumes.into_iter().flatten().enumerate() {
        let field = format!("spec.volumes[{i}]");
        if let Some(h) = &v.host_disk {
            let f = format!("{field}.hostDisk.path");
            if !policy.host_disk_gate {
                return Err(AgentError::unsupported(
                    f,
                    format!(
                        "{:?}: hostDisk volumes need the HyperConverged feature gate HostDisk (spec.featureGates.HostDisk: true)",
                        h.path
                    ),
                ));
            }
            let path = Path::new(&h.path);
            check_lexical(path, policy, false).map_err(|m| AgentError::invalid(&f, m))?;
            check_on_disk(path, h.type_ == "DiskOrCreate")
                .map_err(|m| AgentError::invalid(&f, m))?;
        }
        let claim = v
            .persistent_volume_claim
            .as_ref()
            .map(|c| {
                (
                    format!("{field}.persistentVolumeClaim.claimName"),
                    &c.claim_name,
                )
            })
            .or_else(|| {
                v.data_volume
                    .as_ref()
                    .map(|d| (format!("{field}.dataVolume.name"), &d.name))
            })
            .or_else(|| {
                v.ephemeral
                    .as_ref()
                    .and_then(|e| e.persistent_volume_claim.as_ref())
                    .map(|c| {
                        (
                            format!("{field}.ephemeral.persistentVolumeClaim.claimName"),
                            &c.claim_name,
                        )
                    })
            });
        if let Some((f, name)) = claim
            && let Some(c) = refs.claims.get(name)
        {
            let pv = |m: String| {
                AgentError::invalid(&f, format!("the PersistentVolume of claim {name:?}: {m}"))
            };
            check_lexical(&c.path, policy, c.ours).map_err(pv)?;
            check_on_disk(&c.path, false).map_err(pv)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> HostPathPolicy {
        HostPathPolicy {
            host_disk_gate: true,
            allowed_roots: vec!["/srv/disks".into()],
            protected: vec!["/var/lib/ferrovirt".into()],
        }
    }

    #[test]
    fn lexical_refusals_name_the_path() {
        let p = policy();
        check_lexical(Path::new("/srv/disks/a.img"), &p, false).unwrap();
        for (path, needle) in [
            ("/srv/disks/../etc/shadow", "without"),
            ("relative.img", "absolute"),
            ("/proc/1/root/etc/shadow", "/proc"),
            ("/sys/kernel/x", "/sys"),
            ("/dev/sda", "/dev"),
            ("/var/lib/ferrovirt/token", "data directory"),
            ("/var/lib", "data directory"),
            ("/etc/shadow", "not under an allowed root"),
        ] {
            let e = check_lexical(Path::new(path), &p, false).unwrap_err();
            assert!(e.contains(needle) && e.contains(path), "{path}: {e}");
        }
        let none = HostPathPolicy::default();
        let e = check_lexical(Path::new("/srv/disks/a"), &none, false).unwrap_err();
        assert!(e.contains("--host-disk-root"), "{e}");
        // Our own PVs live in the data dir; only the system trees stay closed to them.
        check_lexical(Path::new("/var/lib/ferrovirt/volumes/pvc-1"), &p, true).unwrap();
        assert!(check_lexical(Path::new("/proc/self"), &p, true).is_err());
    }

    #[test]
    fn only_our_provisioners_volume_dirs_are_ours() {
        assert!(made_by_us(
            Path::new("/d/volumes/pvc-1"),
            Some("ferrovirt.io/shared")
        ));
        assert!(made_by_us(
            Path::new("/d/local-volumes/n1/pvc-1"),
            Some("ferrovirt.io/local")
        ));
        assert!(!made_by_us(Path::new("/d/volumes/pvc-1"), None));
        assert!(!made_by_us(
            Path::new("/d/volumes/pvc-1"),
            Some("other.io/x")
        ));
        assert!(!made_by_us(
            Path::new("/d/token"),
            Some("ferrovirt.io/local")
        ));
        assert!(!made_by_us(
            Path::new("/d/volumes/../token"),
            Some("ferrovirt.io/local")
        ));
        assert!(!made_by_us(
            Path::new("/d/volumes"),
            Some("ferrovirt.io/local")
        ));
    }

    #[test]
    fn verify_gates_host_disks_and_checks_foreign_pvs() {
        use crate::volumes::ClaimInfo;
        let d = tempfile::tempdir().unwrap();
        let vmi = |vols: serde_json::Value| -> VirtualMachineInstance {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "v"},
                "spec": {"domain": {"devices": {}}, "volumes": vols}
            }))
            .unwrap()
        };
        let img = d.path().join("a.img");
        std::fs::write(&img, b"x").unwrap();
        let hd = vmi(serde_json::json!([
            {"name": "h", "hostDisk": {"path": img.display().to_string(), "type": "Disk"}}
        ]));
        let mut p = HostPathPolicy {
            host_disk_gate: false,
            allowed_roots: vec![d.path().to_path_buf()],
            protected: vec!["/var/lib/ferrovirt".into()],
        };
        let refs = ResolvedRefs::default();
        let e = verify(&hd, &refs, &p).unwrap_err().to_string();
        assert!(
            e.contains("spec.volumes[0].hostDisk.path") && e.contains("HostDisk"),
            "{e}"
        );
        p.host_disk_gate = true;
        verify(&hd, &refs, &p).unwrap();
        let pvc = vmi(serde_json::json!([
            {"name": "r", "persistentVolumeClaim": {"claimName": "c"}}
        ]));
        let mut refs = ResolvedRefs::default();
        refs.claims.insert(
            "c".into(),
            ClaimInfo {
                path: "/etc".into(),
                read_only: false,
                ours: false,
            },
        );
        let e = verify(&pvc, &refs, &p).unwrap_err().to_string();
        assert!(
            e.contains("spec.volumes[0].persistentVolumeClaim.claimName") && e.contains("/etc"),
            "{e}"
        );
    }

    #[test]
    fn on_disk_refuses_links_and_special_files() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        std::fs::write(root.join("f.img"), b"x").unwrap();
        check_on_disk(&root.join("f.img"), false).unwrap();
        check_on_disk(&root.join("new/sub/x.img"), true).unwrap();
        assert!(check_on_disk(&root.join("missing.img"), false).is_err());
        std::os::unix::fs::symlink(root.join("f.img"), root.join("link.img")).unwrap();
        let e = check_on_disk(&root.join("link.img"), false).unwrap_err();
        assert!(e.contains("symbolic link"), "{e}");
        std::os::unix::fs::symlink(root, root.join("dirlink")).unwrap();
        let e = check_on_disk(&root.join("dirlink/f.img"), false).unwrap_err();
        assert!(e.contains("dirlink") && e.contains("symbolic link"), "{e}");
        let e = check_on_disk(Path::new("/dev/null"), false).unwrap_err();
        assert!(e.contains("device nodes"), "{e}");
        std::fs::create_dir(root.join("pv")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("pv/disk.img")).unwrap();
        let e = check_on_disk(&root.join("pv"), false).unwrap_err();
        assert!(e.contains("disk.img"), "{e}");
    }
}
