//! Memory cgroups for VMs: the launcher moves itself (and so the QEMU it starts) into
//! `ferrovirt/<name>` under the memory controller, limited to the guest's memory plus a computed
//! overhead. Supports cgroup v1 (`/sys/fs/cgroup/memory`) and v2 (unified, memory controller
//! enabled). The layout and limit decisions are pure; [`join`] and [`leave`] do the writes.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::spec::{Accel, LaunchSpec};

/// The cgroup a VM runs in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CgroupSpec {
    /// Leaf name under `ferrovirt/` (the VMI's uid).
    pub name: String,
    /// memory.limit_in_bytes (v1) / memory.max (v2).
    pub memory_limit_bytes: u64,
}

/// Which cgroup hierarchy the host has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    /// v1: the memory controller's mount point.
    V1 { memory_root: PathBuf },
    /// v2: the unified mount point (with `memory` in cgroup.controllers).
    V2 { root: PathBuf },
}

const MIB: u64 = 1024 * 1024;

/// Memory QEMU and the launcher use beyond guest RAM: process baseline, the TCG translation
/// cache, video RAM, per-vCPU stacks and the guest's page-table/bookkeeping share.
pub fn memory_overhead_bytes(spec: &LaunchSpec) -> u64 {
    let base = 96 * MIB; // QEMU binary, libraries, main loop, the launcher itself
    let tcg = match spec.accel {
        Accel::Tcg => u64::from(spec.tcg_tb_size_mib.unwrap_or(256)) * MIB + 32 * MIB,
        Accel::Kvm => 0,
    };
    let video = if spec.sockets.vnc.is_some() {
        16 * MIB
    } else {
        0
    };
    let vcpus = u64::from(spec.cpu.vcpus()) * 4 * MIB;
    let guest_share = spec.memory_mib * MIB / 64;
    base + tcg + video + vcpus + guest_share
}

/// Guest memory plus overhead.
pub fn memory_limit_bytes(spec: &LaunchSpec) -> u64 {
    spec.memory_mib * MIB + memory_overhead_bytes(spec)
}

/// Finds the host's hierarchy from what exists under `sys_fs_cgroup` (normally
/// `/sys/fs/cgroup`); `None` when no memory controller is usable.
pub fn detect(sys_fs_cgroup: &Path) -> Option<Hierarchy> {
    let v1 = sys_fs_cgroup.join("memory");
    if v1.join("memory.limit_in_bytes").exists() {
        return Some(Hierarchy::V1 { memory_root: v1 });
    }
    let controllers = std::fs::read_to_string(sys_fs_cgroup.join("cgroup.controllers")).ok()?;
    controllers
        .split_whitespace()
        .any(|c| c == "memory")
        .then(|| Hierarchy::V2 {
            root: sys_fs_cgroup.to_path_buf(),
        })
}

/// The files to write, in order, to create the VM's cgroup with its limit and join it
/// with `pid`: (path, content). Directories are the parents of these files.
pub fn join_plan(h: &Hierarchy, cg: &CgroupSpec, pid: u32) -> Vec<(PathBuf, String)> {
    match h {
        Hierarchy::V1 { memory_root } => {
            let dir = memory_root.join("ferrovirt").join(&cg.name);
            vec![
                (
                    dir.join("memory.limit_in_bytes"),
                    cg.memory_limit_bytes.to_string(),
                ),
                (dir.join("cgroup.procs"), pid.to_string()),
            ]
        }
        Hierarchy::V2 { root } => {
            let parent = root.join("ferrovirt");
            let dir = parent.join(&cg.name);
            vec![
                (root.join("cgroup.subtree_control"), "+memory".into()),
                (parent.join("cgroup.subtree_control"), "+memory".into()),
                (dir.join("memory.max"), cg.memory_limit_bytes.to_string()),
                (dir.join("cgroup.procs"), pid.to_string()),
            ]
        }
    }
}

/// The VM's cgroup directory.
pub fn cgroup_dir(h: &Hierarchy, name: &str) -> PathBuf {
    match h {
        Hierarchy::V1 { memory_root } => memory_root.join("ferrovirt").join(name),
        Hierarchy::V2 { root } => root.join("ferrovirt").join(name),
    }
}

/// Creates the cgroup, sets its limit and moves `pid` into it.
pub fn join(h: &Hierarchy, cg: &CgroupSpec, pid: u32) -> Result<PathBuf> {
    let dir = cgroup_dir(h, &cg.name);
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    for (path, content) in join_plan(h, cg, pid) {
        std::fs::write(&path, &content)
            .map_err(|e| Error::io(format!("writing {content:?} to {}", path.display()), e))?;
    }
    Ok(dir)
}

/// Moves `pid` back to the hierarchy's root and removes the VM's cgroup.
pub fn leave(h: &Hierarchy, name: &str, pid: u32) {
    let root = match h {
        Hierarchy::V1 { memory_root } => memory_root.clone(),
        Hierarchy::V2 { root } => root.clone(),
    };
    let _ = std::fs::write(root.join("cgroup.procs"), pid.to_string());
    let _ = std::fs::remove_dir(cgroup_dir(h, name));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> LaunchSpec {
        let mut s = LaunchSpec::new(
            "v",
            "00000000-0000-0000-0000-000000000001",
            128,
            "/q".into(),
        );
        s.tcg_tb_size_mib = Some(64);
        s
    }

    #[test]
    fn limit_is_guest_plus_overhead() {
        let s = spec();
        let o = memory_overhead_bytes(&s);
        assert_eq!(memory_limit_bytes(&s), 128 * MIB + o);
        // TCG: base 96 + tb 64 + 32 + vcpu 4 + 2 (128/64), no VNC in a bare spec.
        assert_eq!(o, (96 + 64 + 32 + 4 + 2) * MIB);
        let mut k = spec();
        k.accel = Accel::Kvm;
        assert!(memory_overhead_bytes(&k) < o);
    }

    #[test]
    fn plans_for_both_hierarchies() {
        let cg = CgroupSpec {
            name: "uid-1".into(),
            memory_limit_bytes: 1000,
        };
        let v1 = join_plan(
            &Hierarchy::V1 {
                memory_root: "/sys/fs/cgroup/memory".into(),
            },
            &cg,
            42,
        );
        assert_eq!(
            v1[0].0,
            PathBuf::from("/sys/fs/cgroup/memory/ferrovirt/uid-1/memory.limit_in_bytes")
        );
        assert_eq!(v1[1].1, "42");
        let v2 = join_plan(
            &Hierarchy::V2 {
                root: "/sys/fs/cgroup".into(),
            },
            &cg,
            42,
        );
        assert_eq!(
            v2[2].0,
            PathBuf::from("/sys/fs/cgroup/ferrovirt/uid-1/memory.max")
        );
        assert_eq!(v2.last().map(|x| x.1.as_str()), Some("42"));
    }

    #[test]
    fn detects_from_a_fake_tree() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(detect(d.path()), None);
        std::fs::write(d.path().join("cgroup.controllers"), "cpu memory pids").unwrap();
        assert_eq!(
            detect(d.path()),
            Some(Hierarchy::V2 {
                root: d.path().to_path_buf()
            })
        );
        std::fs::create_dir_all(d.path().join("memory")).unwrap();
        std::fs::write(d.path().join("memory/memory.limit_in_bytes"), "1").unwrap();
        assert!(matches!(detect(d.path()), Some(Hierarchy::V1 { .. })));
    }
}
