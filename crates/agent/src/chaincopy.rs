//! Carrying a node-local volume's snapshot chain in a block migration (docs/migration.md
//! "Node-local disks with snapshots"). A volume with snapshots is a chain of images
//! (`chain.json`: the raw `disk.img` at the bottom, qcow2 layers above, detached layers a
//! revert left); every layer but the top is frozen and never written again while it is in the
//! record. Before the target's QEMU starts, the source agent sends the target agent, on the
//! agents' authenticated channel, a [`Manifest`] per volume (the `chain.json` bytes, then each
//! frozen layer's name, size and SHA-256) followed by the layers' bytes; the target writes each
//! layer beside its fresh volume directory, checks size and digest before the layer takes its
//! name, writes the same `chain.json` and makes an empty top over the copied chain. QEMU's
//! mirror then copies only the top's data (`sync: top`).
//!
//! What can be carried ([`plan`]) and the checks of what arrives ([`check_manifest`],
//! [`target_top`]) are pure; the file work ([`manifest_of`], [`receive_layer`],
//! [`finish_target`]) is small and tested on real directories.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use ferrovirt_storage::checksum::{Algorithm, Hasher};
use ferrovirt_storage::snapshot::{CHAIN_FILE, Chain, Layer, LayerFormat};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

/// The marker in the source's VMI directory while its volumes' chains are being carried (and
/// until the migration ends): online snapshots and online merges of the VMI are refused while
/// it exists, since a layer frozen or merged now would not be on the target.
pub const CARRYING_FILE: &str = "chain-carried.json";

/// Suffix of a layer being received (it takes its name once its digest is checked).
const PART: &str = ".part";

/// One frozen layer as sent: its file name in the volume directory, size and SHA-256 (hex).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerSum {
    pub file: String,
    pub bytes: u64,
    pub sha256: String,
}

/// What the source sends for one volume with a chain: the `chain.json` bytes as they are on
/// the source, and the frozen layers in the order their bytes follow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub chain_json: String,
    pub layers: Vec<LayerSum>,
}

impl Manifest {
    /// The bytes of all layers.
    pub fn total_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.bytes).sum()
    }
}

/// The source's offer on the channel: per claim copied, its volume's manifest (`None`: a
/// plain volume, nothing to carry), or why the chains cannot be carried.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Offer {
    pub volumes: Vec<(String, Option<Manifest>)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The target's answer once every layer is in place (or why not).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The frozen layers of `chain` to copy, in order (the live chain below the top, then the
/// detached layers); the top is QEMU's to mirror. Refused, naming the state, while an online
/// merge is unfinished (its journal pending: the files are mid-change).
pub fn plan(chain: &Chain) -> Result<Vec<String>, String> {
    if let Some(j) = &chain.journal {
        return Err(format!(
            "an online merge of the volume is unfinished (journal entry {:?} pending); \
             migrate once it is resolved",
            j.id
        ));
    }
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    let frozen = chain.layers[..chain.layers.len().saturating_sub(1)]
        .iter()
        .map(|l| &l.file)
        .chain(chain.detached.iter().map(|d| &d.file));
    for f in frozen {
        if seen.insert(f.clone()) {
            out.push(f.clone());
        }
    }
    Ok(out)
}

/// Whether a mirror of the volume with `chain` copies only the top (`sync: top`): the chain
/// below it is carried.
pub fn mirror_top_only(chain: &Chain) -> bool {
    chain.layers.len() > 1
}

/// The target's check of a manifest: a well-formed `chain.json` whose frozen layers are
/// exactly the listed ones, each with a plausible digest. Returns the chain.
pub fn check_manifest(m: &Manifest) -> Result<Chain, String> {
    let chain: Chain =
        serde_json::from_str(&m.chain_json).map_err(|e| format!("the source's chain.json: {e}"))?;
    ferrovirt_storage::snapshot::validate_chain(&chain).map_err(|e| e.to_string())?;
    let want = plan(&chain)?;
    let got: Vec<String> = m.layers.iter().map(|l| l.file.clone()).collect();
    if want != got {
        return Err(format!(
            "the layers sent ({got:?}) are not the chain's frozen layers ({want:?})"
        ));
    }
    for l in &m.layers {
        if l.sha256.len() != 64 || !l.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!("layer {}: bad sha256 {:?}", l.file, l.sha256));
        }
    }
    Ok(chain)
}

/// The top layer to create on the target over the copied chain, and the layer below it
/// (`None`: the chain is one raw image, made empty as a plain volume's).
pub fn target_top(chain: &Chain) -> Option<(Layer, Layer)> {
    let n = chain.layers.len();
    if n < 2 {
        return None;
    }
    Some((chain.layers[n - 1].clone(), chain.layers[n - 2].clone()))
}

/// The source's manifest of the volume in `dir` (`None`: no `chain.json`, or a plain
/// chain: nothing to carry). Reads every frozen layer once for its digest.
pub fn manifest_of(dir: &Path) -> Result<Option<Manifest>, String> {
    let raw = match std::fs::read_to_string(dir.join(CHAIN_FILE)) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", dir.join(CHAIN_FILE).display())),
    };
    let chain: Chain = serde_json::from_str(&raw).map_err(|e| format!("chain.json: {e}"))?;
    ferrovirt_storage::snapshot::validate_chain(&chain).map_err(|e| e.to_string())?;
    let files = plan(&chain)?;
    let mut layers = Vec::new();
    for f in files {
        let (bytes, sha256) = digest_file(&dir.join(&f))?;
        layers.push(LayerSum {
            file: f,
            bytes,
            sha256,
        });
    }
    Ok(Some(Manifest {
        chain_json: raw,
        layers,
    }))
}

/// Size and SHA-256 of a file.
pub fn digest_file(path: &Path) -> Result<(u64, String), String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut h = Hasher::new(Algorithm::Sha256);
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        total += n as u64;
    }
    Ok((total, h.finish()))
}

/// The data extents `(offset, length)` of the first `len` bytes of `file` (`SEEK_DATA` /
/// `SEEK_HOLE`): a sparse image's holes are not sent. A filesystem without hole reporting
/// gives one extent, the whole file.
pub fn data_extents(file: &std::fs::File, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    use rustix::fs::{SeekFrom, seek};
    let mut out = Vec::new();
    let mut at = 0u64;
    while at < len {
        let start = match seek(file, SeekFrom::Data(at)) {
            Ok(s) => s,
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        if start >= len {
            break;
        }
        let end = match seek(file, SeekFrom::Hole(start)) {
            Ok(e) => e.min(len),
            Err(rustix::io::Errno::NXIO) => len,
            Err(e) => return Err(e.into()),
        };
        out.push((start, end - start));
        at = end;
    }
    Ok(out)
}

/// One frame of a layer on the wire: `offset` and `length` (big-endian), then `length` bytes;
/// a frame of length 0 at the layer's size ends it.
fn frame_header(offset: u64, len: u64) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[..8].copy_from_slice(&offset.to_be_bytes());
    h[8..].copy_from_slice(&len.to_be_bytes());
    h
}

/// Source: sends layer `l` (the file at `path`) to `to` as its data extents; the bytes of
/// data sent.
pub async fn send_layer<W: tokio::io::AsyncWrite + Unpin>(
    path: &Path,
    l: &LayerSum,
    to: &mut W,
) -> Result<u64, String> {
    use tokio::io::AsyncSeekExt;
    let std_file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let len = std_file
        .metadata()
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    if len != l.bytes {
        return Err(format!(
            "layer {} changed size since its digest ({len} of {} bytes)",
            l.file, l.bytes
        ));
    }
    let extents = data_extents(&std_file, len).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut f = tokio::fs::File::from_std(std_file);
    let mut sent = 0u64;
    for (off, n) in extents {
        to.write_all(&frame_header(off, n))
            .await
            .map_err(|e| format!("sending layer {}: {e}", l.file))?;
        f.seek(std::io::SeekFrom::Start(off))
            .await
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let mut part = (&mut f).take(n);
        let copied = tokio::io::copy(&mut part, to)
            .await
            .map_err(|e| format!("sending layer {}: {e}", l.file))?;
        if copied != n {
            return Err(format!("layer {} shrank while it was sent", l.file));
        }
        sent += n;
    }
    to.write_all(&frame_header(l.bytes, 0))
        .await
        .map_err(|e| format!("sending layer {}: {e}", l.file))?;
    Ok(sent)
}

/// Target: reads layer `l` ([`send_layer`]'s frames) from `from` into `dir`, as
/// `<file>.part` first (holes stay holes), and gives it its name only once size and SHA-256
/// (over the whole layer, holes as zeros) match.
pub async fn receive_layer<R: AsyncRead + Unpin>(
    dir: &Path,
    l: &LayerSum,
    from: &mut R,
) -> Result<(), String> {
    let part = dir.join(format!("{}{PART}", l.file));
    let r = receive_into(&part, l, from).await;
    if r.is_err() {
        let _ = tokio::fs::remove_file(&part).await;
    }
    r?;
    tokio::fs::rename(&part, dir.join(&l.file))
        .await
        .map_err(|e| format!("{}: {e}", l.file))?;
    Ok(())
}

async fn receive_into<R: AsyncRead + Unpin>(
    part: &Path,
    l: &LayerSum,
    from: &mut R,
) -> Result<(), String> {
    use tokio::io::AsyncSeekExt;
    let io = |e: std::io::Error| format!("{}: {e}", part.display());
    let wire = |e: std::io::Error| format!("receiving layer {}: {e}", l.file);
    let mut out = tokio::fs::File::create(part).await.map_err(io)?;
    let mut h = Hasher::new(Algorithm::Sha256);
    let zeros = vec![0u8; 1 << 20];
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = 0u64;
    loop {
        let mut hdr = [0u8; 16];
        from.read_exact(&mut hdr).await.map_err(|e| {
            format!(
                "layer {}: the source stopped at byte {pos} of {} ({e})",
                l.file, l.bytes
            )
        })?;
        let off = u64::from_be_bytes(hdr[..8].try_into().expect("8 bytes"));
        let n = u64::from_be_bytes(hdr[8..].try_into().expect("8 bytes"));
        if off < pos || off.checked_add(n).is_none_or(|end| end > l.bytes) {
            return Err(format!(
                "layer {}: a frame at {off} of {n} bytes is outside the layer's {} bytes or \
                 behind byte {pos}",
                l.file, l.bytes
            ));
        }
        // The hole before the frame: zeros in the digest, nothing written.
        let mut gap = off - pos;
        while gap > 0 {
            let k = gap.min(zeros.len() as u64) as usize;
            h.update(&zeros[..k]);
            gap -= k as u64;
        }
        pos = off;
        if n == 0 {
            if off != l.bytes {
                return Err(format!("layer {}: ended at {off} of {}", l.file, l.bytes));
            }
            break;
        }
        out.seek(std::io::SeekFrom::Start(off)).await.map_err(io)?;
        let mut left = n;
        while left > 0 {
            let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            let got = from.read(&mut buf[..want]).await.map_err(wire)?;
            if got == 0 {
                return Err(format!(
                    "layer {}: the source stopped at byte {pos} of {}",
                    l.file, l.bytes
                ));
            }
            h.update(&buf[..got]);
            if buf[..got].iter().all(|b| *b == 0) {
                out.seek(std::io::SeekFrom::Current(got as i64))
                    .await
                    .map_err(io)?;
            } else {
                out.write_all(&buf[..got]).await.map_err(io)?;
            }
            left -= got as u64;
            pos += got as u64;
        }
    }
    out.set_len(l.bytes).await.map_err(io)?;
    out.sync_all().await.map_err(io)?;
    let got = h.finish();
    if got != l.sha256 {
        return Err(format!(
            "layer {}: SHA-256 {got} does not match the source's {}",
            l.file, l.sha256
        ));
    }
    Ok(())
}

/// Target, every layer received: the source's `chain.json` written as it was, and an empty
/// top of `bytes` (the volume's size) over the copied chain. Owner and mode of the layers
/// follow the fresh volume's `disk.img`.
pub fn finish_target(dir: &Path, m: &Manifest, bytes: u64) -> Result<PathBuf, String> {
    let chain = check_manifest(m)?;
    let Some((top, below)) = target_top(&chain) else {
        // One raw image: the fresh, empty disk.img is the top; only the record is copied.
        write_chain_json(dir, &m.chain_json)?;
        return Ok(dir.join(&chain.top().file));
    };
    if top.format != LayerFormat::Qcow2 {
        return Err(format!("top layer {} is not qcow2", top.file));
    }
    let path = dir.join(&top.file);
    let _ = std::fs::remove_file(&path);
    let status = std::process::Command::new("qemu-img")
        .args([
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            below.format.as_str(),
            "-b",
        ])
        .arg(&below.file)
        .args(["-o", "cluster_size=65536"])
        .arg(&path)
        .arg(bytes.to_string())
        .output()
        .map_err(|e| format!("qemu-img: {e}"))?;
    if !status.status.success() {
        return Err(format!(
            "qemu-img create {}: {}",
            path.display(),
            String::from_utf8_lossy(&status.stderr).trim()
        ));
    }
    write_chain_json(dir, &m.chain_json)?;
    Ok(path)
}

fn write_chain_json(dir: &Path, text: &str) -> Result<(), String> {
    let tmp = dir.join(format!("{CHAIN_FILE}{PART}"));
    std::fs::write(&tmp, text).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join(CHAIN_FILE)).map_err(|e| format!("{CHAIN_FILE}: {e}"))
}

/// Source: the `chain.json` of each carried volume as sent (claim → text), recorded in the
/// VMI directory ([`CARRYING_FILE`]).
pub fn record_carried(
    vmi_dir: &Path,
    sent: &std::collections::BTreeMap<String, String>,
) -> Result<(), String> {
    let tmp = vmi_dir.join(format!("{CARRYING_FILE}{PART}"));
    let text = serde_json::to_vec(sent).map_err(|e| e.to_string())?;
    std::fs::write(&tmp, text).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, vmi_dir.join(CARRYING_FILE)).map_err(|e| e.to_string())
}

/// Source, before the switch-over: each carried volume's `chain.json` (claim → volume
/// directory) is still the one sent; `Err` names the claim whose chain changed.
pub fn check_unchanged(
    vmi_dir: &Path,
    dirs: &std::collections::BTreeMap<String, PathBuf>,
) -> Result<(), String> {
    let Ok(bytes) = std::fs::read(vmi_dir.join(CARRYING_FILE)) else {
        return Ok(());
    };
    let sent: std::collections::BTreeMap<String, String> =
        serde_json::from_slice(&bytes).map_err(|e| format!("{CARRYING_FILE}: {e}"))?;
    for (claim, text) in &sent {
        let Some(dir) = dirs.get(claim) else { continue };
        let now = std::fs::read_to_string(dir.join(CHAIN_FILE)).unwrap_or_default();
        if &now != text {
            return Err(format!(
                "the snapshot chain of PVC {claim} changed while it was being carried (a \
                 snapshot or merge during the migration): migrate again"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrovirt_storage::snapshot::{Detached, plan_snapshot};

    fn chain(n: usize) -> Chain {
        let mut c = Chain::default();
        for _ in 0..n {
            c = plan_snapshot(&c).chain;
        }
        c
    }

    #[test]
    fn the_frozen_layers_are_carried_and_the_top_is_mirrored() {
        assert_eq!(plan(&Chain::default()).unwrap(), Vec::<String>::new());
        assert!(!mirror_top_only(&Chain::default()));
        let c = chain(2);
        assert_eq!(plan(&c).unwrap(), vec!["disk.img", "layer-000001.qcow2"]);
        assert!(mirror_top_only(&c));
        let (top, below) = target_top(&c).unwrap();
        assert_eq!(top.file, "layer-000002.qcow2");
        assert_eq!(below.file, "layer-000001.qcow2");
        // Detached layers (a revert went below them) keep their snapshots' bytes: carried.
        let mut d = c.clone();
        d.detached.push(Detached {
            file: "layer-000009.qcow2".into(),
            backing: "disk.img".into(),
        });
        assert_eq!(
            plan(&d).unwrap(),
            vec!["disk.img", "layer-000001.qcow2", "layer-000009.qcow2"]
        );
    }

    #[test]
    fn a_pending_merge_is_not_carried() {
        let mut c = chain(2);
        c.journal = Some(ferrovirt_storage::snapshot::Journal {
            id: "j1".into(),
            commit: true,
            layers: c.layers[..1].to_vec(),
            detached: Vec::new(),
            delete: vec!["layer-000001.qcow2".into()],
        });
        let e = plan(&c).unwrap_err();
        assert!(e.contains("online merge") && e.contains("j1"), "{e}");
    }

    fn manifest(c: &Chain) -> Manifest {
        Manifest {
            chain_json: serde_json::to_string(c).unwrap(),
            layers: plan(c)
                .unwrap()
                .into_iter()
                .map(|f| LayerSum {
                    file: f,
                    bytes: 1,
                    sha256: "0".repeat(64),
                })
                .collect(),
        }
    }

    #[test]
    fn the_target_checks_what_it_is_sent() {
        let c = chain(2);
        assert_eq!(check_manifest(&manifest(&c)).unwrap(), c);
        // A layer left out, one more, a name that is a path, a bad digest, a broken record.
        let mut m = manifest(&c);
        m.layers.pop();
        assert!(check_manifest(&m).is_err());
        let mut m = manifest(&c);
        m.layers.push(m.layers[0].clone());
        assert!(check_manifest(&m).is_err());
        let mut bad = c.clone();
        bad.layers[0].file = "../../etc/passwd".into();
        let mut m = manifest(&c);
        m.chain_json = serde_json::to_string(&bad).unwrap();
        assert!(check_manifest(&m).is_err());
        let mut m = manifest(&c);
        m.layers[0].sha256 = "zz".into();
        assert!(check_manifest(&m).unwrap_err().contains("sha256"));
        let mut m = manifest(&c);
        m.chain_json = "{".into();
        assert!(check_manifest(&m).is_err());
    }

    #[tokio::test]
    async fn layers_arrive_checked_and_the_chain_is_rebuilt() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        let size = 4u64 << 20;
        let disk = src.path().join("disk.img");
        let f = std::fs::File::create(&disk).unwrap();
        f.set_len(size).unwrap();
        drop(f);
        {
            use std::io::{Seek, Write};
            let mut f = std::fs::OpenOptions::new().write(true).open(&disk).unwrap();
            f.seek(std::io::SeekFrom::Start(1 << 20)).unwrap();
            f.write_all(b"marker A").unwrap();
        }
        let taken = ferrovirt_storage::snapshot::take(src.path()).unwrap();
        assert_eq!(taken, "disk.img");
        let m = manifest_of(src.path()).unwrap().expect("a chain");
        assert_eq!(m.layers.len(), 1);
        assert_eq!(m.total_bytes(), size);
        let mut wire = Vec::new();
        for l in &m.layers {
            let sent = send_layer(&src.path().join(&l.file), l, &mut wire)
                .await
                .unwrap();
            // Only the data extents travel (the filesystem's block, not the 4 MiB).
            assert!(sent < size / 8, "{sent} bytes sent");
        }
        let mut from = wire.as_slice();
        for l in &m.layers {
            receive_layer(dst.path(), l, &mut from).await.unwrap();
        }
        assert!(from.is_empty());
        let top = finish_target(dst.path(), &m, size).unwrap();
        assert_eq!(top, dst.path().join("layer-000001.qcow2"));
        assert_eq!(
            std::fs::read(dst.path().join("disk.img")).unwrap(),
            std::fs::read(src.path().join("disk.img")).unwrap()
        );
        assert_eq!(
            std::fs::read_to_string(dst.path().join(CHAIN_FILE)).unwrap(),
            m.chain_json
        );
        // The copy is sparse: the zero blocks were not written.
        use std::os::unix::fs::MetadataExt;
        let blocks = std::fs::metadata(dst.path().join("disk.img"))
            .unwrap()
            .blocks();
        assert!(blocks * 512 < size / 2, "{blocks} blocks");
        // The rebuilt chain reads the frozen data through the new top.
        let chain = ferrovirt_storage::snapshot::read_chain(dst.path()).unwrap();
        assert_eq!(chain.layers.len(), 2);
        // A corrupted byte never takes the layer's name.
        let l = &m.layers[0];
        let mut bad = wire.clone();
        let at = bad
            .iter()
            .position(|b| *b == b'm')
            .expect("the marker on the wire");
        bad[at] ^= 1;
        let other = tempfile::tempdir().unwrap();
        let e = receive_layer(other.path(), l, &mut bad.as_slice())
            .await
            .unwrap_err();
        assert!(e.contains("SHA-256"), "{e}");
        assert!(!other.path().join(&l.file).exists());
        assert!(!other.path().join("disk.img.part").exists());
        // Short input, and a frame outside the layer, are refused too.
        let e = receive_layer(other.path(), l, &mut &wire[..wire.len() - 4])
            .await
            .unwrap_err();
        assert!(e.contains("stopped"), "{e}");
        let mut outside = frame_header(size - 1, 2).to_vec();
        outside.extend([1, 2]);
        let e = receive_layer(other.path(), l, &mut outside.as_slice())
            .await
            .unwrap_err();
        assert!(e.contains("outside"), "{e}");
    }

    #[test]
    fn a_chain_changed_after_it_was_sent_stops_the_migration() {
        let vmi = tempfile::tempdir().unwrap();
        let vol = tempfile::tempdir().unwrap();
        std::fs::write(vol.path().join(CHAIN_FILE), "one").unwrap();
        let dirs = [("data".to_string(), vol.path().to_path_buf())].into();
        assert!(check_unchanged(vmi.path(), &dirs).is_ok());
        record_carried(
            vmi.path(),
            &[("data".to_string(), "one".to_string())].into(),
        )
        .unwrap();
        assert!(check_unchanged(vmi.path(), &dirs).is_ok());
        std::fs::write(vol.path().join(CHAIN_FILE), "two").unwrap();
        let e = check_unchanged(vmi.path(), &dirs).unwrap_err();
        assert!(e.contains("PVC data") && e.contains("changed"), "{e}");
    }
}
