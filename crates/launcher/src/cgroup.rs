//! Cgroups for VMs: the launcher moves itself (and so the QEMU it starts) into
//! `ferrovirt/<name>` under each controller, limited to the guest's memory plus a computed
//! overhead, a number of tasks (`pids`) and a CPU bandwidth (`cpu`: quota per 100 ms period).
//! Supports cgroup v1 (one mount per controller: `/sys/fs/cgroup/{memory,pids,cpu}`) and v2
//! (unified, controllers enabled through `cgroup.subtree_control`). The layout and limit
//! decisions are pure; [`join`] and [`leave`] do the writes.

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
    /// pids.max: threads and processes of the launcher and QEMU together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids_max: Option<u64>,
    /// CPU bandwidth in thousandths of a CPU (cpu.cfs_quota_us / cpu.max per 100 ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_millis: Option<u64>,
}

/// The CPU bandwidth period, in microseconds.
pub const CPU_PERIOD_US: u64 = 100_000;

/// Which cgroup hierarchy the host has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    /// v1: the controllers' mount points (memory is required, pids and cpu are used when
    /// mounted).
    V1 {
        memory_root: PathBuf,
        pids_root: Option<PathBuf>,
        cpu_root: Option<PathBuf>,
    },
    /// v2: the unified mount point (with `memory` in cgroup.controllers) and which of
    /// `pids`/`cpu` it offers.
    V2 {
        root: PathBuf,
        pids: bool,
        cpu: bool,
    },
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
        let mount = |names: &[&str], file: &str| {
            names
                .iter()
                .map(|n| sys_fs_cgroup.join(n))
                .find(|d| d.join(file).exists())
        };
        return Some(Hierarchy::V1 {
            memory_root: v1,
            // The root group has no pids.max; a mounted pids controller has cgroup.procs.
            pids_root: mount(&["pids"], "cgroup.procs"),
            cpu_root: mount(&["cpu", "cpu,cpuacct"], "cpu.cfs_quota_us"),
        });
    }
    let controllers = std::fs::read_to_string(sys_fs_cgroup.join("cgroup.controllers")).ok()?;
    let has = |c: &str| controllers.split_whitespace().any(|x| x == c);
    has("memory").then(|| Hierarchy::V2 {
        root: sys_fs_cgroup.to_path_buf(),
        pids: has("pids"),
        cpu: has("cpu"),
    })
}

/// The files to write, in order, to create the VM's cgroups with their limits and join them
/// with `pid`: (path, content). Directories are the parents of these files.
pub fn join_plan(h: &Hierarchy, cg: &CgroupSpec, pid: u32) -> Vec<(PathBuf, String)> {
    let quota = cg.cpu_millis.map(|m| (m * CPU_PERIOD_US / 1000).max(1000));
    match h {
        Hierarchy::V1 {
            memory_root,
            pids_root,
            cpu_root,
        } => {
            let leaf = |root: &Path| root.join("ferrovirt").join(&cg.name);
            let mut plan = Vec::new();
            let mem = leaf(memory_root);
            plan.push((
                mem.join("memory.limit_in_bytes"),
                cg.memory_limit_bytes.to_string(),
            ));
            plan.push((mem.join("cgroup.procs"), pid.to_string()));
            if let (Some(root), Some(max)) = (pids_root, cg.pids_max) {
                let d = leaf(root);
                plan.push((d.join("pids.max"), max.to_string()));
                plan.push((d.join("cgroup.procs"), pid.to_string()));
            }
            if let (Some(root), Some(q)) = (cpu_root, quota) {
                let d = leaf(root);
                plan.push((d.join("cpu.cfs_period_us"), CPU_PERIOD_US.to_string()));
                plan.push((d.join("cpu.cfs_quota_us"), q.to_string()));
                plan.push((d.join("cgroup.procs"), pid.to_string()));
            }
            plan
        }
        Hierarchy::V2 { root, pids, cpu } => {
            let parent = root.join("ferrovirt");
            let dir = parent.join(&cg.name);
            let mut enable = String::from("+memory");
            if *pids && cg.pids_max.is_some() {
                enable.push_str(" +pids");
            }
            if *cpu && quota.is_some() {
                enable.push_str(" +cpu");
            }
            let mut plan = vec![
                (root.join("cgroup.subtree_control"), enable.clone()),
                (parent.join("cgroup.subtree_control"), enable),
                (dir.join("memory.max"), cg.memory_limit_bytes.to_string()),
            ];
            if let (true, Some(max)) = (*pids, cg.pids_max) {
                plan.push((dir.join("pids.max"), max.to_string()));
            }
            if let (true, Some(q)) = (*cpu, quota) {
                plan.push((dir.join("cpu.max"), format!("{q} {CPU_PERIOD_US}")));
            }
            plan.push((dir.join("cgroup.procs"), pid.to_string()));
            plan
        }
    }
}

/// The VM's cgroup directories (one per v1 controller, one on v2).
pub fn cgroup_dirs(h: &Hierarchy, name: &str) -> Vec<PathBuf> {
    match h {
        Hierarchy::V1 {
            memory_root,
            pids_root,
            cpu_root,
        } => std::iter::once(memory_root)
            .chain(pids_root.iter())
            .chain(cpu_root.iter())
            .map(|r| r.join("ferrovirt").join(name))
            .collect(),
        Hierarchy::V2 { root, .. } => vec![root.join("ferrovirt").join(name)],
    }
}

/// Whether the `cgroup.procs` contents `procs` list `pid`.
pub fn lists(procs: &str, pid: u32) -> bool {
    procs.lines().any(|l| l.trim().parse() == Ok(pid))
}

/// Creates the cgroups, sets their limits and moves `pid` into them. Returns the memory
/// cgroup's directory. A cgroup that lists `pid` already is not joined again: the agent's
/// early-forked launcher joins its cgroups before its exec (the first write of a pid to a
/// `cgroup.procs` waits ~12 ms for an RCU grace period, and a second write would wait again).
pub fn join(h: &Hierarchy, cg: &CgroupSpec, pid: u32) -> Result<PathBuf> {
    let dirs = cgroup_dirs(h, &cg.name);
    for dir in &dirs {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    }
    for (path, content) in join_plan(h, cg, pid) {
        if path.file_name() == Some(std::ffi::OsStr::new("cgroup.procs"))
            && std::fs::read_to_string(&path).is_ok_and(|p| lists(&p, pid))
        {
            continue;
        }
        std::fs::write(&path, &content)
            .map_err(|e| Error::io(format!("writing {content:?} to {}", path.display()), e))?;
    }
    Ok(dirs[0].clone())
}

/// Moves `pid` back to each hierarchy's root and removes the VM's cgroups.
pub fn leave(h: &Hierarchy, name: &str, pid: u32) {
    for dir in cgroup_dirs(h, name) {
        if let Some(root) = dir.parent().and_then(Path::parent) {
            let _ = std::fs::write(root.join("cgroup.procs"), pid.to_string());
        }
        let _ = std::fs::remove_dir(&dir);
    }
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
    fn procs_listing() {
        assert!(lists("12\n345\n", 345));
        assert!(!lists("12\n3456\n", 345));
        assert!(!lists("", 1));
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
            pids_max: Some(512),
            cpu_millis: Some(2000),
        };
        let v1 = join_plan(
            &Hierarchy::V1 {
                memory_root: "/sys/fs/cgroup/memory".into(),
                pids_root: Some("/sys/fs/cgroup/pids".into()),
                cpu_root: Some("/sys/fs/cgroup/cpu".into()),
            },
            &cg,
            42,
        );
        assert!(v1.contains(&(
            "/sys/fs/cgroup/pids/ferrovirt/uid-1/pids.max".into(),
            "512".into()
        )));
        assert!(v1.contains(&(
            "/sys/fs/cgroup/cpu/ferrovirt/uid-1/cpu.cfs_quota_us".into(),
            "200000".into()
        )));
        assert!(v1.contains(&(
            "/sys/fs/cgroup/cpu/ferrovirt/uid-1/cgroup.procs".into(),
            "42".into()
        )));
        assert_eq!(
            v1[0].0,
            PathBuf::from("/sys/fs/cgroup/memory/ferrovirt/uid-1/memory.limit_in_bytes")
        );
        assert_eq!(v1[1].1, "42");
        let v2 = join_plan(
            &Hierarchy::V2 {
                root: "/sys/fs/cgroup".into(),
                pids: true,
                cpu: true,
            },
            &cg,
            42,
        );
        assert_eq!(v2[0].1, "+memory +pids +cpu");
        assert!(v2.contains(&(
            "/sys/fs/cgroup/ferrovirt/uid-1/cpu.max".into(),
            "200000 100000".into()
        )));
        assert!(v2.contains(&(
            "/sys/fs/cgroup/ferrovirt/uid-1/pids.max".into(),
            "512".into()
        )));
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
                root: d.path().to_path_buf(),
                pids: true,
                cpu: true,
            })
        );
        std::fs::create_dir_all(d.path().join("memory")).unwrap();
        std::fs::write(d.path().join("memory/memory.limit_in_bytes"), "1").unwrap();
        assert!(matches!(detect(d.path()), Some(Hierarchy::V1 { .. })));
    }
}
