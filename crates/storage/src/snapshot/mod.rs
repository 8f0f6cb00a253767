//! Copy-on-write volume snapshots: a volume's **layer chain**.
//!
//! A volume directory starts as one raw `disk.img` (see [`crate::provisioner`]). Taking a
//! snapshot freezes the volume's current top layer and puts a new, empty qcow2 layer over it
//! (`layer-000001.qcow2`, backed by the frozen one); the chain is recorded in
//! `chain.json` beside the images — recorded, never probed, like every other format in
//! ferrovirt: nothing here reads a guest-writable image's header to learn its format or
//! backing. The cost of a snapshot is one small `qemu-img create` and one JSON write,
//! whatever the size of the disk or how much of it was written (the filesystems of these
//! machines are ext4, which has no reflinks, so a file clone would copy every written byte).
//!
//! A snapshot is named by its **handle** `<layer file>`: the layer it froze. Layers are never
//! reused and never written again once frozen, so the handle keeps meaning the same bytes for
//! the volume's life. Reading a snapshot means reading the chain up to and including that
//! layer: [`export_raw`] converts that prefix into a new raw image (restoring into a new
//! claim); [`revert`] points the volume back at it with a fresh top layer (an in-place restore,
//! also constant time).
//!
//! Frozen layers that a revert leaves above the reverted point stay readable as **detached**
//! layers (recorded with their backing), so the snapshots they hold keep their bytes.
//! [`reclaim`] (module [`reclaim`]) merges away the layers no snapshot holds any more, once
//! the volume is not in use (docs/snapshots.md).
//!
//! The decisions ([`plan_snapshot`], [`prefix_to`], [`plan_revert`]) are pure; the I/O
//! functions run `qemu-img` synchronously (callers on async runtimes use `spawn_blocking`).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

use crate::error::StorageError;
use crate::provisioner::DISK_IMAGE;

pub mod journal;
pub mod reclaim;
pub use journal::{Facts, Journal, read_resolved, resolve_on_disk};
pub use reclaim::{
    OnlineReport, ReclaimPlan, finish_online, held_layers, plan_reclaim, reclaim, release,
};

/// The file recording a volume's layer chain inside its directory.
pub const CHAIN_FILE: &str = "chain.json";

/// A layer's recorded image format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerFormat {
    Raw,
    Qcow2,
}

impl LayerFormat {
    /// The qemu name of the format.
    pub fn as_str(self) -> &'static str {
        match self {
            LayerFormat::Raw => "raw",
            LayerFormat::Qcow2 => "qcow2",
        }
    }
}

/// One image of a volume's chain, a file name inside the volume directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layer {
    pub file: String,
    pub format: LayerFormat,
}

/// A volume's images, bottom (the original raw `disk.img`) first; the last one is the
/// writable top, every other one is frozen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chain {
    pub layers: Vec<Layer>,
    /// The number of the next layer file (`layer-<n>.qcow2`); never reused.
    pub next: u32,
    /// Frozen layers no longer in the live chain (a revert went below them), kept while a
    /// snapshot may hold them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub detached: Vec<Detached>,
    /// Frozen layers (live or detached) whose snapshot was deleted: [`reclaim`] drops them
    /// once the volume is not in use.
    #[serde(default, skip_serializing_if = "std::collections::BTreeSet::is_empty")]
    pub released: std::collections::BTreeSet<String>,
    /// An online merge in progress ([`journal`]): `layers` stay the old chain until it is
    /// resolved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<Journal>,
}

/// A frozen qcow2 layer outside the live chain, with the layer it is backed by (a layer of
/// the live chain or another detached one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Detached {
    pub file: String,
    pub backing: String,
}

impl Default for Chain {
    /// A fresh volume: just the raw `disk.img`.
    fn default() -> Self {
        Chain {
            layers: vec![Layer {
                file: DISK_IMAGE.to_string(),
                format: LayerFormat::Raw,
            }],
            next: 1,
            detached: Vec::new(),
            released: Default::default(),
            journal: None,
        }
    }
}

impl Chain {
    /// The writable top layer.
    pub fn top(&self) -> &Layer {
        self.layers.last().expect("a chain always has a layer")
    }

    /// Whether this is a plain single raw image (no snapshot was ever taken).
    pub fn is_plain(&self) -> bool {
        self.layers.len() == 1 && self.layers[0].format == LayerFormat::Raw
    }
}

/// What taking a snapshot does to a chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotPlan {
    /// The snapshot's handle: the layer frozen by it.
    pub handle: String,
    /// The new empty top layer to create, backed by the frozen one.
    pub new_top: Layer,
    /// The chain to record once the new top exists.
    pub chain: Chain,
}

fn layer_file(n: u32) -> String {
    format!("layer-{n:06}.qcow2")
}

/// Plan a snapshot of `chain`: freeze its top, add a new qcow2 top.
pub fn plan_snapshot(chain: &Chain) -> SnapshotPlan {
    let new_top = Layer {
        file: layer_file(chain.next),
        format: LayerFormat::Qcow2,
    };
    let mut next = chain.clone();
    next.layers.push(new_top.clone());
    next.next += 1;
    SnapshotPlan {
        handle: chain.top().file.clone(),
        new_top,
        chain: next,
    }
}

/// The layers that hold snapshot `handle`'s bytes: the chain up to and including it (for a
/// detached layer: the live layers below it, then its detached backings). A handle that is
/// the live top (not frozen) or absent is refused.
pub fn prefix_to(chain: &Chain, handle: &str) -> Result<Vec<Layer>, StorageError> {
    if let Some(pos) = chain.layers.iter().position(|l| l.file == handle) {
        if pos + 1 == chain.layers.len() {
            return Err(StorageError::invalid(
                "snapshot handle",
                format!("{handle:?} is the volume's writable top, not a frozen snapshot"),
            ));
        }
        return Ok(chain.layers[..=pos].to_vec());
    }
    // A detached layer: follow its backings down to the live chain.
    let mut above = Vec::new();
    let mut at = handle;
    while let Some(d) = chain.detached.iter().find(|d| d.file == at) {
        if above.len() > chain.detached.len() {
            break; // a loop in a hand-edited record
        }
        above.push(Layer {
            file: d.file.clone(),
            format: LayerFormat::Qcow2,
        });
        at = &d.backing;
        if let Some(pos) = chain.layers.iter().position(|l| l.file == at) {
            let mut layers = chain.layers[..=pos].to_vec();
            layers.extend(above.into_iter().rev());
            return Ok(layers);
        }
    }
    Err(StorageError::invalid(
        "snapshot handle",
        format!("{handle:?} is not a layer of this volume"),
    ))
}

/// What reverting a volume to snapshot `handle` does: the chain becomes the snapshot's prefix
/// plus a new empty top over it.
/// The frozen live layers above the reverted point become detached (a snapshot may hold
/// them); the old writable top is dropped from the record (the caller deletes its file).
pub fn plan_revert(chain: &Chain, handle: &str) -> Result<SnapshotPlan, StorageError> {
    let prefix = prefix_to(chain, handle)?;
    // Detached layers the reverted point goes through are live again.
    let mut detached: Vec<Detached> = chain
        .detached
        .iter()
        .filter(|d| !prefix.iter().any(|p| p.file == d.file))
        .cloned()
        .collect();
    // Live frozen layers above the reverted point (not the live top) leave the live chain.
    let live_frozen = &chain.layers[..chain.layers.len() - 1];
    for (i, l) in live_frozen.iter().enumerate().skip(1) {
        if !prefix.iter().any(|p| p.file == l.file) {
            detached.push(Detached {
                file: l.file.clone(),
                backing: live_frozen[i - 1].file.clone(),
            });
        }
    }
    let base = Chain {
        layers: prefix,
        next: chain.next,
        detached,
        released: chain.released.clone(),
        journal: None,
    };
    let mut plan = plan_snapshot(&base);
    plan.handle = handle.to_string();
    Ok(plan)
}

/// The `json:` blockdev description of the image made by `layers` (bottom first), each layer
/// with its recorded format and its backing given explicitly, so that qemu-img never opens a
/// backing file named inside an image.
pub fn blockdev_json(dir: &Path, layers: &[Layer]) -> serde_json::Value {
    let mut node = serde_json::Value::Null;
    for l in layers {
        let file = serde_json::json!({"driver": "file", "filename": dir.join(&l.file)});
        node = match l.format {
            LayerFormat::Raw => serde_json::json!({"driver": "raw", "file": file}),
            LayerFormat::Qcow2 => {
                serde_json::json!({"driver": "qcow2", "file": file, "backing": node})
            }
        };
    }
    node
}

/// A volume's chain as recorded; a volume without `chain.json` is its plain raw `disk.img`.
pub fn read_chain(dir: &Path) -> Result<Chain, StorageError> {
    let path = dir.join(CHAIN_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => {
            let chain: Chain = serde_json::from_slice(&bytes)
                .map_err(|e| StorageError::invalid("chain.json", e.to_string()))?;
            validate_chain(&chain)?;
            Ok(chain)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Chain::default()),
        Err(e) => Err(StorageError::io(path, e)),
    }
}

/// A recorded chain is well formed: at least one layer, plain file names, only the bottom
/// raw (a raw image cannot have a backing).
pub fn validate_chain(chain: &Chain) -> Result<(), StorageError> {
    if chain.layers.is_empty() {
        return Err(StorageError::invalid("chain.json", "no layers"));
    }
    for (i, l) in chain.layers.iter().enumerate() {
        if !plain_name(&l.file) {
            return Err(StorageError::invalid(
                "chain.json",
                format!("layer {:?} is not a plain file name", l.file),
            ));
        }
        if i > 0 && l.format == LayerFormat::Raw {
            return Err(StorageError::invalid(
                "chain.json",
                format!("layer {:?} is raw above the bottom", l.file),
            ));
        }
    }
    for d in &chain.detached {
        for name in [&d.file, &d.backing] {
            if !plain_name(name) {
                return Err(StorageError::invalid(
                    "chain.json",
                    format!("detached layer {name:?} is not a plain file name"),
                ));
            }
        }
    }
    journal::validate(chain)
}

/// Whether `name` is a plain file name of a volume directory (no `/`, no `..`).
pub(crate) fn plain_name(name: &str) -> bool {
    crate::provisioner::valid_volume_name(&name.to_ascii_lowercase()) && !name.contains('/')
}

/// The images of `dir`'s volume as a disk: the top path and format, then its backing images
/// (nearest first) with their formats — what the launcher is given.
/// A pending online merge's journal is resolved first ([`read_resolved`]).
pub fn disk_chain(dir: &Path) -> Result<Vec<(PathBuf, LayerFormat)>, StorageError> {
    let chain = read_resolved(dir)?;
    Ok(chain
        .layers
        .iter()
        .rev()
        .map(|l| (dir.join(&l.file), l.format))
        .collect())
}

pub(crate) fn write_chain(dir: &Path, chain: &Chain) -> Result<(), StorageError> {
    let path = dir.join(CHAIN_FILE);
    let tmp = dir.join(".chain.json.tmp");
    let body = serde_json::to_vec_pretty(chain).expect("a chain serializes");
    std::fs::write(&tmp, body).map_err(|e| StorageError::io(&tmp, e))?;
    let f = std::fs::File::open(&tmp).map_err(|e| StorageError::io(&tmp, e))?;
    f.sync_all().map_err(|e| StorageError::io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| StorageError::io(&path, e))
}

pub(crate) fn qemu_img(args: &[&str]) -> Result<(), StorageError> {
    let out = Command::new("qemu-img")
        .args(args)
        .output()
        .map_err(|e| StorageError::Tool {
            tool: "qemu-img".into(),
            message: format!("cannot start: {e}"),
        })?;
    if !out.status.success() {
        return Err(StorageError::Tool {
            tool: format!("qemu-img {}", args.first().copied().unwrap_or("")),
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

/// Create `new_top` in `dir` as an empty qcow2 over `backing` (its format given, its backing
/// recorded by name relative to the directory) of `size` bytes.
fn create_layer(
    dir: &Path,
    new_top: &Layer,
    backing: &Layer,
    size: u64,
) -> Result<(), StorageError> {
    let path = dir.join(&new_top.file);
    let _ = std::fs::remove_file(&path);
    let p = path.display().to_string();
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-F",
        backing.format.as_str(),
        "-b",
        &backing.file,
        "-o",
        "cluster_size=65536",
        &p,
        &size.to_string(),
    ])?;
    // Same owner and mode as the layer below: the VM's QEMU (its own uid) reads the whole chain
    // and writes the top.
    if let Ok(meta) = std::fs::metadata(dir.join(&backing.file)) {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let _ = std::os::unix::fs::chown(&path, Some(meta.uid()), Some(meta.gid()));
        let _ =
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(meta.mode() & 0o777));
    }
    Ok(())
}

/// The guest-visible size of the volume: the bottom raw image's length (layers are created
/// with the same size; a grown volume grows its bottom before any snapshot only).
fn volume_size(dir: &Path, chain: &Chain) -> Result<u64, StorageError> {
    let bottom = dir.join(&chain.layers[0].file);
    let meta = std::fs::metadata(&bottom).map_err(|e| StorageError::io(&bottom, e))?;
    Ok(meta.len())
}

/// Take a snapshot of the volume in `dir` (which no running VM writes: an online snapshot
/// adds the layer through the VM's QEMU instead, see [`record_snapshot`]). Returns the handle.
pub fn take(dir: &Path) -> Result<String, StorageError> {
    if crate::block::is_block_volume(dir) {
        return Err(StorageError::invalid(
            "volume",
            "snapshots of Block-mode volumes are not supported",
        ));
    }
    let chain = read_resolved(dir)?;
    let plan = plan_snapshot(&chain);
    let size = volume_size(dir, &chain)?;
    create_layer(dir, &plan.new_top, chain.top(), size)?;
    write_chain(dir, &plan.chain)?;
    Ok(plan.handle)
}

/// Whether the volume in `dir` may grow: only while it has no snapshots. A volume with
/// snapshots is a layer chain: growing its bottom `disk.img` (what growing a plain volume
/// does) would change a frozen snapshot's bytes and not the size the VM sees through the
/// top qcow2 layer; growing the top layer is not implemented (docs/snapshots.md).
pub fn check_growable(dir: &Path) -> Result<(), StorageError> {
    let chain = read_resolved(dir)?;
    if chain.is_plain() {
        return Ok(());
    }
    Err(StorageError::invalid(
        "resize",
        format!(
            "the volume has snapshots (a chain of {} qcow2/raw layers): growing a volume \
             with snapshots is not supported yet, and deleting its snapshots does not merge \
             the layers back (docs/snapshots.md)",
            chain.layers.len()
        ),
    ))
}

/// Prepare an online snapshot: create the new top layer file (not yet in the chain) and
/// return the plan; the caller has QEMU switch to it (`blockdev-snapshot`) and then calls
/// [`record_snapshot`].
/// Refused while an online merge's journal is pending (the node agent resolves it through
/// the launcher first).
pub fn prepare_online(dir: &Path) -> Result<SnapshotPlan, StorageError> {
    let chain = read_chain(dir)?;
    if chain.journal.is_some() {
        return Err(StorageError::InUse(
            "an online merge of the volume is unfinished (its journal is pending)".into(),
        ));
    }
    let plan = plan_snapshot(&chain);
    let size = volume_size(dir, &chain)?;
    create_layer(dir, &plan.new_top, chain.top(), size)?;
    Ok(plan)
}

/// Record a snapshot whose new top layer is in use.
pub fn record_snapshot(dir: &Path, plan: &SnapshotPlan) -> Result<(), StorageError> {
    write_chain(dir, &plan.chain)
}

/// Point the volume in `dir` back at snapshot `handle` with a new empty top (in-place
/// restore; no VM may be running on it).
pub fn revert(dir: &Path, handle: &str) -> Result<(), StorageError> {
    let chain = read_resolved(dir)?;
    let plan = plan_revert(&chain, handle)?;
    let size = volume_size(dir, &chain)?;
    let frozen = prefix_to(&chain, handle)?
        .last()
        .cloned()
        .expect("non-empty prefix");
    create_layer(dir, &plan.new_top, &frozen, size)?;
    write_chain(dir, &plan.chain)?;
    // The old writable top holds no snapshot: nothing reads it any more.
    let old_top = chain.top();
    if !plan.chain.layers.contains(old_top) && old_top.format == LayerFormat::Qcow2 {
        let _ = std::fs::remove_file(dir.join(&old_top.file));
    }
    Ok(())
}

/// Write snapshot `handle` of the volume in `src_dir` (its live chain when `None`: a clone of
/// a volume with snapshots) as a raw image at `dest` (restoring into a new volume). An
/// existing `dest` (a provisioned claim's thin `disk.img`) is written in place and keeps its
/// size, which must be at least the snapshot's. Holes stay holes, so a sparse disk stays
/// sparse.
pub fn export_raw(src_dir: &Path, handle: Option<&str>, dest: &Path) -> Result<(), StorageError> {
    let chain = read_resolved(src_dir)?;
    let layers = match handle {
        Some(h) => prefix_to(&chain, h)?,
        None => chain.layers.clone(),
    };
    let spec = format!("json:{}", blockdev_json(src_dir, &layers));
    let d = dest.display().to_string();
    if let Ok(meta) = std::fs::metadata(dest) {
        let size = volume_size(src_dir, &chain)?;
        if meta.len() < size {
            return Err(StorageError::Refused(format!(
                "the snapshot holds {size} bytes, more than the target's {}",
                meta.len()
            )));
        }
        qemu_img(&[
            "convert", "-q", "-n", "-W", "-m", "4", "-O", "raw", &spec, &d,
        ])
    } else {
        qemu_img(&["convert", "-q", "-W", "-m", "4", "-O", "raw", &spec, &d])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_freeze_the_top_and_add_a_layer() {
        let c = Chain::default();
        assert!(c.is_plain());
        let p = plan_snapshot(&c);
        assert_eq!(p.handle, "disk.img");
        assert_eq!(p.new_top.file, "layer-000001.qcow2");
        assert_eq!(p.chain.layers.len(), 2);
        assert_eq!(p.chain.next, 2);
        let p2 = plan_snapshot(&p.chain);
        assert_eq!(p2.handle, "layer-000001.qcow2");
        assert_eq!(p2.chain.top().file, "layer-000002.qcow2");
    }

    #[test]
    fn prefixes_and_reverts() {
        let c1 = plan_snapshot(&Chain::default()).chain;
        let c2 = plan_snapshot(&c1).chain;
        assert_eq!(prefix_to(&c2, "disk.img").unwrap().len(), 1);
        assert_eq!(prefix_to(&c2, "layer-000001.qcow2").unwrap().len(), 2);
        // The live top is not a snapshot; unknown handles are refused.
        assert!(prefix_to(&c2, "layer-000002.qcow2").is_err());
        assert!(prefix_to(&c2, "nope").is_err());
        let r = plan_revert(&c2, "disk.img").unwrap();
        assert_eq!(
            r.new_top.file, "layer-000003.qcow2",
            "layer names are never reused"
        );
        assert_eq!(
            r.chain
                .layers
                .iter()
                .map(|l| l.file.as_str())
                .collect::<Vec<_>>(),
            ["disk.img", "layer-000003.qcow2"]
        );
    }

    #[test]
    fn hostile_chains_are_refused() {
        let mut c = Chain::default();
        c.layers.push(Layer {
            file: "../../etc/shadow".into(),
            format: LayerFormat::Qcow2,
        });
        assert!(validate_chain(&c).is_err());
        let mut c = Chain::default();
        c.layers.push(Layer {
            file: "x.img".into(),
            format: LayerFormat::Raw,
        });
        assert!(validate_chain(&c).is_err(), "raw above the bottom");
        assert!(
            validate_chain(&Chain {
                layers: vec![],
                next: 1,
                detached: Vec::new(),
                released: Default::default(),
                journal: None,
            })
            .is_err()
        );
    }

    #[test]
    fn blockdev_json_names_every_backing() {
        let c = plan_snapshot(&Chain::default()).chain;
        let j = blockdev_json(Path::new("/v"), &c.layers);
        assert_eq!(j["driver"], "qcow2");
        assert_eq!(j["file"]["filename"], "/v/layer-000001.qcow2");
        assert_eq!(j["backing"]["driver"], "raw");
        assert_eq!(j["backing"]["file"]["filename"], "/v/disk.img");
    }

    fn write_at(path: &Path, offset: u64, data: &[u8]) {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        f.write_all_at(data, offset).unwrap();
    }

    fn read_at(path: &Path, offset: u64, len: usize) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open(path).unwrap();
        let mut buf = vec![0; len];
        f.read_exact_at(&mut buf, offset).unwrap();
        buf
    }

    /// Write 4 KiB of `pattern` through the chain's top with `qemu-io` (qemu-utils).
    fn qemu_io_write(dir: &Path, chain: &Chain, offset: u64, pattern: u8) -> bool {
        let spec = format!("json:{}", blockdev_json(dir, &chain.layers));
        Command::new("qemu-io")
            .args(["-c", &format!("write -P {pattern} {offset} 4096"), &spec])
            .output()
            .map(|o| o.status.success())
            .expect("qemu-io runs")
    }

    #[test]
    fn take_export_and_revert_on_disk() {
        let tmp = tempfile::tempdir().unwrap();
        let root = crate::provisioner::VolumeRoot::new(tmp.path());
        let dir = root.create("pv1", 4 << 20).unwrap();
        let img = dir.join(DISK_IMAGE);
        write_at(&img, 0, b"first");
        check_growable(&dir).unwrap();
        let h1 = take(&dir).unwrap();
        assert_eq!(h1, "disk.img");
        let refused = check_growable(&dir).unwrap_err().to_string();
        assert!(refused.contains("has snapshots"), "{refused}");
        let chain = read_chain(&dir).unwrap();
        assert_eq!(chain.top().file, "layer-000001.qcow2");
        assert!(
            qemu_io_write(&dir, &chain, 0, 0x42),
            "qemu-io (qemu-utils) writes"
        );
        // The snapshot still reads "first"; the live chain reads the new bytes.
        let out = tmp.path().join("restored.img");
        export_raw(&dir, Some(&h1), &out).unwrap();
        assert_eq!(read_at(&out, 0, 5), b"first");
        assert_eq!(std::fs::metadata(&out).unwrap().len(), 4 << 20);
        // A second snapshot, then revert to the first.
        let h2 = take(&dir).unwrap();
        assert_eq!(h2, "layer-000001.qcow2");
        let out2 = tmp.path().join("second.img");
        export_raw(&dir, Some(&h2), &out2).unwrap();
        assert_eq!(read_at(&out2, 0, 5), [0x42; 5]);
        revert(&dir, &h1).unwrap();
        let chain = read_chain(&dir).unwrap();
        assert_eq!(chain.layers.len(), 2);
        assert_eq!(chain.top().file, "layer-000003.qcow2");
        let out3 = tmp.path().join("reverted.img");
        let spec = format!("json:{}", blockdev_json(&dir, &chain.layers));
        qemu_img(&[
            "convert",
            "-q",
            "-O",
            "raw",
            &spec,
            &out3.display().to_string(),
        ])
        .unwrap();
        assert_eq!(read_at(&out3, 0, 5), b"first");
        assert!(export_raw(&dir, Some("layer-000003.qcow2"), &out3).is_err());
    }
}
