//! Node-local storage done by the node's agent (docs/storage.md, "Where the bytes move"): the
//! controllers decide which node, which volume, phases and retries; the agent of the node that
//! holds a `local`-class volume does every byte of work on it — create it, populate it (HTTP
//! or registry import, blank, clone from a volume on the same node or from a shared path),
//! grow it and delete it. The controllers reach the agent over its endpoint
//! ([`crate::endpoint`]: TLS pinned to the Node's published fingerprint, bearer token), so a
//! node's storage never has to be visible to the server.
//!
//! - this module: the wire types and the pure checks both sides share;
//! - [`server`]: the endpoint routes that execute requests with `ferrovirt_storage`;
//! - [`client`]: what the controllers (and the upload proxy) call;
//! - [`export`]: the read route of VirtualMachineExport downloads.
//!
//! Volumes live in `<agent data dir>/volumes/<pv name>/disk.img` ([`volume_root`]); a
//! request names a volume by its PV name and the agent resolves it inside that root, so no
//! request can name a path outside it (clone sources from shared storage excepted, see
//! [`Source::SharedImage`]).

#[cfg(test)]
mod attack_tests;
pub mod client;
pub mod export;
pub mod journal;
pub mod online;
pub mod online_reclaim;
pub mod server;
pub mod snapshots;

use std::path::{Component, Path, PathBuf};

use ferrovirt_storage::checksum::Checksum;
use ferrovirt_storage::http::DownloadRequest;
use ferrovirt_storage::registry::ImageRef;
use ferrovirt_storage::registry::client::ClientOptions;
use serde::{Deserialize, Serialize};

/// Where the node's volumes live, under the agent's data dir.
pub fn volume_root(data_dir: &Path) -> PathBuf {
    data_dir.join("volumes")
}

/// Scratch space of the node's imports, under the agent's data dir.
pub fn scratch_root(data_dir: &Path) -> PathBuf {
    data_dir.join("import-scratch")
}

/// `PUT /storage/volumes/{name}`: create (or keep) a volume of `bytes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateVolume {
    pub bytes: u64,
    /// `volumeMode: Block`: the volume gets a loop device over its `disk.img`.
    #[serde(default)]
    pub block: bool,
}

/// The answer to [`CreateVolume`]: the volume directory on the node (the PV's `local.path`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatedVolume {
    pub path: String,
}

/// `POST /storage/volumes/{name}/resize`: grow the volume to `bytes` (never shrinks).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResizeVolume {
    pub bytes: u64,
}

/// Where a population's data comes from.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Source {
    /// HTTP(S) import (`spec.source.http`), with the address policy the controller resolved
    /// (`--import-allowed-cidrs` plus the HyperConverged's ranges) inside `download`.
    Http {
        download: DownloadRequest,
        checksum: Option<Checksum>,
    },
    /// Registry import (`spec.source.registry`), address policy inside `client`.
    Registry {
        image: ImageRef,
        client: ClientOptions,
    },
    /// An empty disk.
    Blank,
    /// A copy of another volume on this node (its PV name).
    Volume { name: String },
    /// A copy of a `shared`-class volume's image: shared storage is mounted at the same path
    /// on every node.
    SharedImage { path: String },
    /// The bytes of snapshot `handle` of another volume on this node (restoring a
    /// VolumeSnapshot into a new claim; docs/snapshots.md).
    Snapshot { volume: String, handle: String },
}

/// `POST /storage/volumes/{name}/snapshots`: the answer, the new snapshot's handle (the
/// frozen layer; a VolumeSnapshotContent's `snapshotHandle` is `<pv>/<handle>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TakenSnapshot {
    pub handle: String,
    /// Bytes the volume holds on the node (`restoreSize`).
    pub size: u64,
}

/// `POST /storage/volumes/{name}/revert`: point the volume back at snapshot `handle` of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevertVolume {
    pub handle: String,
}

/// `POST /storage/volumes/{name}/reclaim`: record that the snapshots holding `release`
/// (handles, i.e. frozen layer names) were deleted, then, when `merge` (no VM uses the
/// volume), drop every released layer (docs/snapshots.md "Reclaiming layers").
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReclaimVolume {
    #[serde(default)]
    pub release: Vec<String>,
    #[serde(default)]
    pub merge: bool,
}

/// `POST /storage/volumes/{name}/populate`: fill the volume of `capacity` bytes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Populate {
    pub capacity: u64,
    pub source: Source,
}

/// One line of a population's answer (newline-delimited JSON): progress lines while it runs
/// (also every few seconds without change, so a stalled connection is noticed), then one
/// final `done` or `failed`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum JobLine {
    Progress { percent: f64 },
    Done,
    Failed { message: String, permanent: bool },
}

/// Why a request to a node's storage failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeStoreError {
    /// The Node is missing or publishes no agent endpoint.
    #[error("node {node}: {message}")]
    NoEndpoint { node: String, message: String },
    /// The agent could not be reached (retry later).
    #[error("the agent of node {node} is unreachable: {message}")]
    Unreachable { node: String, message: String },
    /// The agent answered with an error.
    #[error("the agent of node {node} answered {status}: {message}")]
    Answer {
        node: String,
        status: u16,
        message: String,
    },
}

impl NodeStoreError {
    /// Whether retrying cannot help: the agent refused the request itself (400).
    pub fn is_permanent(&self) -> bool {
        matches!(self, NodeStoreError::Answer { status: 400, .. })
    }
}

/// Whether `path` may be read as a shared-class clone source: absolute, plain (no `.`/`..`),
/// a `disk.img` of a volume directory in a `volumes/` root — the layout of the `shared`
/// provisioner — and not inside this agent's own data dir.
pub fn shared_source_ok(path: &Path, own_data_dir: &Path) -> Result<(), String> {
    let plain = path.is_absolute()
        && path
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    fn name(p: Option<&Path>) -> Option<&str> {
        p.and_then(Path::file_name).and_then(|n| n.to_str())
    }
    let volume = path.parent();
    let root = volume.and_then(Path::parent);
    if !plain
        || name(Some(path)) != Some(ferrovirt_storage::provisioner::DISK_IMAGE)
        || name(root) != Some("volumes")
    {
        return Err(format!(
            "clone source {:?} is not the disk of a shared volume",
            path.display()
        ));
    }
    if path.starts_with(own_data_dir) {
        return Err(format!(
            "clone source {:?} lies in the agent's own data dir; name the volume instead",
            path.display()
        ));
    }
    Ok(())
}

/// The progress worth reporting after `last` (whole-percent steps, and always 100).
pub fn progress_step(last: Option<f64>, now: f64) -> Option<f64> {
    let now = now.clamp(0.0, 100.0);
    match last {
        Some(l) if now < 100.0 && (now - l).abs() < 1.0 => None,
        Some(l) if now >= 100.0 && l >= 100.0 => None,
        _ => Some(now),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_shared_volume_disks_are_clone_sources() {
        let own = Path::new("/var/lib/ferrovirt/agent");
        assert!(shared_source_ok(Path::new("/srv/fv/volumes/pvc-1/disk.img"), own).is_ok());
        for bad in [
            "/etc/shadow",
            "relative/volumes/pvc-1/disk.img",
            "/srv/fv/volumes/../volumes/pvc-1/disk.img",
            "/srv/fv/volumes/pvc-1/other.img",
            "/srv/fv/pvc-1/disk.img",
            "/var/lib/ferrovirt/agent/volumes/pvc-2/disk.img",
        ] {
            assert!(shared_source_ok(Path::new(bad), own).is_err(), "{bad}");
        }
    }

    #[test]
    fn progress_is_reported_in_steps() {
        assert_eq!(progress_step(None, 0.0), Some(0.0));
        assert_eq!(progress_step(Some(10.0), 10.5), None);
        assert_eq!(progress_step(Some(10.0), 11.2), Some(11.2));
        assert_eq!(progress_step(Some(99.5), 100.0), Some(100.0));
        assert_eq!(progress_step(Some(100.0), 100.0), None);
        assert_eq!(progress_step(Some(5.0), 250.0), Some(100.0));
    }

    #[test]
    fn wire_format_round_trips() {
        let p = Populate {
            capacity: 64 << 20,
            source: Source::Volume {
                name: "pvc-1".into(),
            },
        };
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(v["source"]["volume"]["name"], "pvc-1");
        let back: Populate = serde_json::from_value(v).unwrap();
        assert_eq!(back.capacity, 64 << 20);
        let line = serde_json::to_string(&JobLine::Failed {
            message: "checksum mismatch".into(),
            permanent: true,
        })
        .unwrap();
        assert_eq!(
            serde_json::from_str::<JobLine>(&line).unwrap(),
            JobLine::Failed {
                message: "checksum mismatch".into(),
                permanent: true
            }
        );
        // Cidrs travel as text and are validated when read.
        let policy: ferrovirt_storage::netpolicy::AddressPolicy = serde_json::from_value(
            serde_json::json!({"allowed": ["127.0.0.0/8"], "unrestricted": false}),
        )
        .unwrap();
        assert_eq!(policy.allowed[0].to_string(), "127.0.0.0/8");
        assert!(
            serde_json::from_value::<ferrovirt_storage::netpolicy::AddressPolicy>(
                serde_json::json!({"allowed": ["127.0.0.0/99"], "unrestricted": false})
            )
            .is_err()
        );
    }
}
