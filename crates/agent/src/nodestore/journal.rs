//! Resolving the journals of online layer merges on this node (docs/snapshots.md, "Order
//! and crashes"): a volume's `chain.json` holds a journal from just before the launcher
//! runs a merge until the agent records the result. A journal still pending (the agent
//! process died in between) is resolved from facts (`ferrovirt_storage::snapshot::journal`):
//!
//! - while the VMI's launcher answers, from the layer files its QEMU runs the disk on
//!   (`DiskLayers`; the launcher answers once a merge it is still running has ended);
//! - otherwise from the files (`read_resolved`: refused while a QEMU holds the images).
//!
//! [`resolve_at_start`] is the agent's pass over its VMIs' volumes and its `local` volumes
//! at start; [`resolve_running`] runs before an online merge or snapshot of a VMI's volume
//! and after a failed merge. The offline users of a volume resolve it through
//! `read_resolved` themselves (a VM's start, snapshot, revert, export, offline merge).
//!
//! **Test-only failpoint**: with `FERROVIRT_FAILPOINT=online-reclaim-after-merge` (or
//! `online-reclaim-after-merge:<VMI volume name>`) in its environment the agent aborts right
//! after the launcher answered a merge and before the record is rewritten ([`failpoint`]) —
//! the crash the journal exists for, performed by
//! `crates/ferrovirt/tests/snapshot_reclaim_crash.rs`. Nothing sets it outside tests.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ferrovirt_launcher::control::{LauncherClient, Request as LauncherRequest, files};
use ferrovirt_launcher::disk_layers::{DiskLayers, DiskLayersRequest};
use ferrovirt_launcher::spec::{DiskSource, LaunchSpec};
use ferrovirt_storage::snapshot::{self, Facts, journal::Resolved};

use super::online::PlannedDisk;

/// The environment variable naming a test-only failpoint.
pub const FAILPOINT_ENV: &str = "FERROVIRT_FAILPOINT";

/// Aborts the process when the test-only failpoint `name` is set, for any volume or for
/// `volume` (see the module doc).
pub fn failpoint(name: &str, volume: &str) {
    let Ok(set) = std::env::var(FAILPOINT_ENV) else {
        return;
    };
    if failpoint_hit(&set, name, volume) {
        tracing::error!("failpoint {name} at volume {volume}: aborting (test only)");
        std::process::abort();
    }
}

/// Whether the failpoint setting `set` names `name` at `volume` (pure).
pub fn failpoint_hit(set: &str, name: &str, volume: &str) -> bool {
    match set.split_once(':') {
        Some((n, v)) => n == name && v == volume,
        None => set == name,
    }
}

/// How long the launcher may take to answer (it finishes a merge it runs first).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(31 * 60);

/// Resolves the pending journal of `p`'s volume, asking the VMI's launcher in `vmi_dir`
/// which layers its QEMU runs; from the files when no launcher answers. `Ok(None)`: no
/// journal was pending.
pub async fn resolve_running(vmi_dir: &Path, p: &PlannedDisk) -> Result<Option<Resolved>, String> {
    let dir = p.dir.clone();
    let pending = tokio::task::spawn_blocking(move || snapshot::read_chain(&dir))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("volume {}: {e}", p.volume))?
        .journal
        .is_some();
    if !pending {
        return Ok(None);
    }
    let dir = p.dir.clone();
    let facts = match LauncherClient::connect(vmi_dir, Duration::from_secs(10)).await {
        Ok(mut client) => {
            let req = LauncherRequest::DiskLayers {
                disk: DiskLayersRequest {
                    disk: p.disk.clone(),
                    dir: p.dir.clone(),
                },
            };
            let v = client
                .request_with_timeout(&req, ANSWER_TIMEOUT)
                .await
                .map_err(|e| format!("asking the launcher which layers run: {e}"))?;
            let layers: DiskLayers = serde_json::from_value(v).map_err(|e| e.to_string())?;
            tracing::info!(dir = %p.dir.display(), disk = %p.disk, layers = ?layers.layers,
                "a pending online merge's journal: the launcher says which layers QEMU runs");
            Some(Facts::Running(layers.layers))
        }
        Err(_) => None,
    };
    let volume = p.volume.clone();
    tokio::task::spawn_blocking(move || match facts {
        Some(f) => snapshot::resolve_on_disk(&dir, &f),
        None => snapshot::read_resolved(&dir).map(|chain| {
            Some(Resolved {
                chain,
                delete: Vec::new(),
                merged: false,
            })
        }),
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| format!("volume {volume}: resolving its online merge's journal: {e}"))
}

/// The file disks of a VMI's launch spec that are layers of a volume directory.
fn spec_disks(spec: &LaunchSpec) -> Vec<PlannedDisk> {
    spec.disks
        .iter()
        .filter(|d| d.source == DiskSource::File && !d.is_readonly() && !d.empty)
        .filter_map(|d| {
            let dir = d.path.parent()?;
            dir.join(snapshot::CHAIN_FILE)
                .exists()
                .then(|| PlannedDisk {
                    volume: d.id.clone(),
                    disk: d.id.clone(),
                    image: d.path.clone(),
                    dir: dir.to_path_buf(),
                })
        })
        .collect()
}

/// The agent's pass at start: every pending journal of a volume of a VMI on this node
/// (through its launcher while it answers) and of a `local` volume of this node.
pub async fn resolve_at_start(data_dir: PathBuf) {
    let vmis = data_dir.join("vmis");
    for entry in std::fs::read_dir(&vmis).into_iter().flatten().flatten() {
        let vmi_dir = entry.path();
        let Some(spec) = std::fs::read(vmi_dir.join(files::SPEC))
            .ok()
            .and_then(|b| serde_json::from_slice::<LaunchSpec>(&b).ok())
        else {
            continue;
        };
        for p in spec_disks(&spec) {
            log(&p.dir, resolve_running(&vmi_dir, &p).await);
        }
    }
    let root = super::volume_root(&data_dir);
    for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
        let dir = entry.path();
        let pending = snapshot::read_chain(&dir).is_ok_and(|c| c.journal.is_some());
        if !pending {
            continue;
        }
        let d = dir.clone();
        let r = tokio::task::spawn_blocking(move || snapshot::read_resolved(&d)).await;
        match r {
            Ok(Ok(chain)) => tracing::info!(
                dir = %dir.display(),
                layers = ?chain.layers.iter().map(|l| &l.file).collect::<Vec<_>>(),
                "an online merge's journal resolved from the files"
            ),
            Ok(Err(e)) => tracing::warn!(dir = %dir.display(), "{e}"),
            Err(e) => tracing::warn!(dir = %dir.display(), "{e}"),
        }
    }
}

fn log(dir: &Path, r: Result<Option<Resolved>, String>) {
    match r {
        Ok(Some(r)) => tracing::info!(
            dir = %dir.display(),
            merged = r.merged,
            layers = ?r.chain.layers.iter().map(|l| &l.file).collect::<Vec<_>>(),
            deleted = ?r.delete,
            "an online merge's journal resolved"
        ),
        Ok(None) => {}
        Err(e) => tracing::warn!(dir = %dir.display(), "{e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failpoints_name_a_point_and_maybe_a_volume() {
        let p = "online-reclaim-after-merge";
        assert!(failpoint_hit(p, p, "data"));
        assert!(failpoint_hit("online-reclaim-after-merge:data", p, "data"));
        assert!(!failpoint_hit("online-reclaim-after-merge:root", p, "data"));
        assert!(!failpoint_hit("other", p, "data"));
        assert!(!failpoint_hit("", p, "data"));
    }
}
