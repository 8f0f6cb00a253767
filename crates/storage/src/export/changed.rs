//! Reading only what changed since an earlier snapshot of a volume (incremental backups,
//! docs/backup.md "Incremental reads").
//!
//! A volume's layer chain says what was written since a snapshot: every cluster written after
//! snapshot `since` froze its layer lives in a layer above it. So the changed [`CHUNK`]s of
//! snapshot `handle` (or of the live chain) since `since` are those where `qemu-img map` over
//! the chain up to `handle` finds the data (or a zero write) at a depth above `since`'s layer.
//! Layer merges never move written clusters below a layer a snapshot still holds (a released
//! layer is streamed *up* into the layer above it; the commit into the raw bottom happens only
//! when no layer is held), so while `since`'s snapshot exists the answer can only be too large
//! (a merge into a layer above it), never miss a write. A `since` that is not below `handle`
//! in the chain (reverted past it, merged away, another volume) is refused with the reason.
//!
//! [`layers_since`] and [`changed_chunks`] decide (pure); [`open_changed`] runs `qemu-img map`
//! and reads the chosen chunks through qemu-nbd.

use std::path::Path;

use serde::Deserialize;

use super::{CHUNK, ExportRead};
use crate::error::StorageError;
use crate::snapshot::{Chain, Layer, blockdev_json, prefix_to, read_resolved};

/// One extent of `qemu-img map --output=json`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct MapEntry {
    pub start: u64,
    pub length: u64,
    /// How many backing layers down the data was found (0: the top of the mapped chain).
    pub depth: u32,
}

/// The chunks of a snapshot that changed since another, and their bytes.
pub struct ChangedRead {
    /// The size of the whole disk.
    pub size: u64,
    /// The changed chunks' indices (ascending), in [`CHUNK`]s.
    pub chunks: Vec<u64>,
    /// Those chunks' bytes, in order (`read.size` is their total).
    pub read: ExportRead,
}

impl std::fmt::Debug for ChangedRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChangedRead")
            .field("size", &self.size)
            .field("chunks", &self.chunks.len())
            .finish_non_exhaustive()
    }
}

/// The first line of a changed-chunks stream sent over HTTP ([`frame`]): what follows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChangedHeader {
    /// The size of the whole disk.
    pub size: u64,
    pub chunk_size: u64,
    /// The chunks that follow, by index, ascending.
    pub chunks: Vec<u64>,
}

/// The largest header line [`unframe`] accepts (a 1 TiB disk with every chunk listed fits).
const MAX_HEADER: usize = 4 << 20;

/// `c` as one byte stream: its [`ChangedHeader`] as a JSON line, then the chunks' bytes; with
/// the stream's whole length (for `Content-Length`).
pub fn frame(c: ChangedRead) -> (u64, super::ByteStream) {
    use futures::StreamExt;
    let header = ChangedHeader {
        size: c.size,
        chunk_size: CHUNK as u64,
        chunks: c.chunks,
    };
    let mut line = serde_json::to_vec(&header).unwrap_or_default();
    line.push(b'\n');
    let len = line.len() as u64 + c.read.size;
    let head = futures::stream::once(async move { Ok(bytes::Bytes::from(line)) });
    (len, Box::pin(head.chain(c.read.stream)))
}

/// Splits a [`frame`]d stream into its header and the chunks' bytes (checked: ascending,
/// inside the disk, the expected chunk size).
pub async fn unframe(
    mut stream: super::ByteStream,
) -> Result<(ChangedHeader, super::ByteStream), StorageError> {
    use futures::StreamExt;
    let bad = |m: String| StorageError::invalid("changed chunks", m);
    let mut buf = bytes::BytesMut::new();
    let nl = loop {
        if let Some(p) = buf.iter().position(|b| *b == b'\n') {
            break p;
        }
        if buf.len() > MAX_HEADER {
            return Err(bad("the header line is too long".into()));
        }
        match stream.next().await {
            Some(Ok(b)) => buf.extend_from_slice(&b),
            Some(Err(e)) => return Err(bad(format!("reading the header: {e}"))),
            None => return Err(bad("the stream ended before its header".into())),
        }
    };
    let rest = buf.split_off(nl + 1).freeze();
    let header: ChangedHeader =
        serde_json::from_slice(&buf[..nl]).map_err(|e| bad(format!("bad header: {e}")))?;
    let count = header.size.div_ceil(CHUNK as u64);
    if header.chunk_size != CHUNK as u64
        || header.chunks.windows(2).any(|w| w[0] >= w[1])
        || header.chunks.last().is_some_and(|&l| l >= count)
    {
        return Err(bad(format!(
            "the header's chunk list does not fit a disk of {} bytes in {CHUNK}-byte chunks",
            header.size
        )));
    }
    let head = futures::stream::iter((!rest.is_empty()).then_some(Ok(rest)));
    Ok((header, Box::pin(head.chain(stream))))
}

/// The layers that make snapshot `handle` (the live chain when `None`) and how many of them,
/// from the top, lie above layer `since`: the layers written since `since` was frozen.
/// Refused when `since` is not a frozen layer below `handle`.
pub fn layers_since(
    chain: &Chain,
    handle: Option<&str>,
    since: &str,
) -> Result<(Vec<Layer>, u32), StorageError> {
    let layers = match handle {
        Some(h) => prefix_to(chain, h)?,
        None => chain.layers.clone(),
    };
    let pos = layers
        .iter()
        .position(|l| l.file == since)
        .filter(|&p| p + 1 < layers.len())
        .ok_or_else(|| {
            StorageError::invalid(
                "since",
                format!(
                    "layer {since:?} of the earlier snapshot is not below {} in the volume's \
                     chain (reverted past it, merged away, or another volume)",
                    handle.map_or("the live top".to_string(), |h| format!("{h:?}"))
                ),
            )
        })?;
    let above = (layers.len() - 1 - pos) as u32;
    Ok((layers, above))
}

/// The indices of the `chunk`-sized chunks of a `size`-byte disk that hold any extent found at
/// a depth below `above` (written in one of the `above` top layers), ascending. Extents past
/// `size` are ignored.
pub fn changed_chunks(map: &[MapEntry], above: u32, size: u64, chunk: u64) -> Vec<u64> {
    let count = size.div_ceil(chunk);
    let mut changed = vec![false; count as usize];
    for e in map.iter().filter(|e| e.depth < above && e.length > 0) {
        let end = (e.start.saturating_add(e.length)).min(size);
        if e.start >= end {
            continue;
        }
        for i in e.start / chunk..=(end - 1) / chunk {
            changed[i as usize] = true;
        }
    }
    (0..count).filter(|&i| changed[i as usize]).collect()
}

/// The extents of the image made by `layers` (bottom first) in `dir`, from `qemu-img map`
/// over their `json:` description (opened read-only, sharing: the layers are frozen).
fn map(dir: &Path, layers: &[Layer]) -> Result<Vec<MapEntry>, StorageError> {
    let spec = format!("json:{}", blockdev_json(dir, layers));
    let out = std::process::Command::new("qemu-img")
        .args(["map", "--output=json", "-U", &spec])
        .output()
        .map_err(|e| StorageError::Tool {
            tool: "qemu-img".into(),
            message: format!("cannot start: {e}"),
        })?;
    if !out.status.success() {
        return Err(StorageError::Tool {
            tool: "qemu-img map".into(),
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    serde_json::from_slice(&out.stdout).map_err(|e| StorageError::Tool {
        tool: "qemu-img map".into(),
        message: format!("unreadable answer: {e}"),
    })
}

/// Opens the chunks of snapshot `handle` of the volume in `dir` (its live chain when `None`)
/// that changed since snapshot `since` (a layer handle of the same volume) for reading.
pub async fn open_changed(
    dir: &Path,
    handle: Option<&str>,
    since: &str,
) -> Result<ChangedRead, StorageError> {
    let d = dir.to_path_buf();
    let h = handle.map(str::to_string);
    let s = since.to_string();
    let (layers, entries, above) = tokio::task::spawn_blocking(move || {
        let chain = read_resolved(&d)?;
        let (layers, above) = layers_since(&chain, h.as_deref(), &s)?;
        let entries = map(&d, &layers)?;
        Ok::<_, StorageError>((layers, entries, above))
    })
    .await
    .map_err(|e| StorageError::Tool {
        tool: "export".into(),
        message: e.to_string(),
    })??;
    let size = entries
        .iter()
        .map(|e| e.start + e.length)
        .max()
        .unwrap_or(0);
    let chunks = changed_chunks(&entries, above, size, CHUNK as u64);
    let spec = format!("json:{}", blockdev_json(dir, &layers));
    let want = chunks.clone();
    let mut nbd_size = 0;
    let (read, chunks) = super::nbd::open_chunks(&spec, |s| {
        nbd_size = s;
        Some(want)
    })
    .await?;
    if nbd_size != size {
        return Err(StorageError::Tool {
            tool: "export".into(),
            message: format!("qemu-img map covers {size} bytes, qemu-nbd serves {nbd_size}"),
        });
    }
    Ok(ChangedRead { size, chunks, read })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::{self, plan_snapshot};
    use futures::StreamExt;

    fn e(start: u64, length: u64, depth: u32) -> MapEntry {
        MapEntry {
            start,
            length,
            depth,
        }
    }

    #[test]
    fn only_extents_above_the_base_mark_chunks_and_partial_chunks_count() {
        let map = [
            e(0, 10, 2),  // in the base: unchanged
            e(10, 5, 1),  // chunk 1 (10..15 with chunk 8 → chunk 1)
            e(15, 9, 2),  // unchanged
            e(24, 1, 0),  // chunk 3
            e(25, 15, 2), // unchanged
        ];
        assert_eq!(changed_chunks(&map, 2, 40, 8), vec![1, 3]);
        // The base itself one layer higher: depth 1 is the base now.
        assert_eq!(changed_chunks(&map, 1, 40, 8), vec![3]);
        // Extents across chunk boundaries mark every chunk they touch; a short last chunk.
        assert_eq!(changed_chunks(&[e(7, 10, 0)], 1, 20, 8), vec![0, 1, 2]);
        // Nothing above the base: nothing changed; past the size: ignored.
        assert!(changed_chunks(&[e(0, 40, 3), e(40, 8, 0)], 1, 40, 8).is_empty());
    }

    #[tokio::test]
    async fn a_framed_stream_unframes_to_its_header_and_bytes_and_lies_are_refused() {
        let read = ExportRead {
            size: 6,
            stream: Box::pin(futures::stream::iter(vec![
                Ok(bytes::Bytes::from_static(b"abc")),
                Ok(bytes::Bytes::from_static(b"def")),
            ])),
        };
        let c = ChangedRead {
            size: 3 * CHUNK as u64,
            chunks: vec![0, 2],
            read,
        };
        let (len, stream) = frame(c);
        let (h, rest) = unframe(stream).await.unwrap();
        assert_eq!(h.chunks, vec![0, 2]);
        let body: Vec<u8> = rest
            .map(|b| b.unwrap().to_vec())
            .collect::<Vec<_>>()
            .await
            .concat();
        assert_eq!(body, b"abcdef");
        assert!(len > 6);
        for lie in [
            r#"{"size":8,"chunkSize":4194304,"chunks":[1]}"#,
            r#"{"size":99999999,"chunkSize":4194304,"chunks":[2,1]}"#,
            r#"{"size":99999999,"chunkSize":4096,"chunks":[1]}"#,
        ] {
            let line = format!("{lie}\n");
            let s: crate::export::ByteStream =
                Box::pin(futures::stream::iter(vec![Ok(bytes::Bytes::from(line))]));
            assert!(unframe(s).await.is_err(), "{lie}");
        }
    }

    #[test]
    fn the_base_must_be_a_frozen_layer_below_the_snapshot() {
        let c0 = Chain::default();
        let c1 = plan_snapshot(&c0).chain; // disk.img frozen, layer 1 top
        let c2 = plan_snapshot(&c1).chain; // layer 1 frozen, layer 2 top
        let (layers, above) = layers_since(&c2, Some("layer-000001.qcow2"), "disk.img").unwrap();
        assert_eq!((layers.len(), above), (2, 1));
        let (layers, above) = layers_since(&c2, None, "disk.img").unwrap();
        assert_eq!((layers.len(), above), (3, 2));
        // The same layer, a layer above, an unknown one, the live top: refused.
        for (h, s) in [
            (Some("layer-000001.qcow2"), "layer-000001.qcow2"),
            (Some("disk.img"), "layer-000001.qcow2"),
            (None, "layer-000009.qcow2"),
            (None, "layer-000002.qcow2"),
        ] {
            let err = layers_since(&c2, h, s).unwrap_err().to_string();
            assert!(
                err.contains("is not") || err.contains("writable top"),
                "{err}"
            );
        }
        // Reverted below the base: the base is no longer in the live chain.
        let reverted = snapshot::plan_revert(&c2, "disk.img").unwrap().chain;
        assert!(layers_since(&reverted, None, "layer-000001.qcow2").is_err());
    }

    /// A real chain: 16 MiB raw bottom written whole, a snapshot, writes in two chunks of the
    /// layer above, a second snapshot: only those two chunks are read, and they are its bytes.
    #[tokio::test]
    async fn a_snapshot_reads_only_the_chunks_written_since_the_base() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let img = dir.join("disk.img");
        crate::provisioner::create_sparse(&img, 16 << 20).unwrap();
        let io = |fmt: &str, cmd: &str, file: &str| {
            let ok = std::process::Command::new("qemu-io")
                .args(["-f", fmt, "-c", cmd])
                .arg(dir.join(file))
                .output()
                .unwrap();
            assert!(ok.status.success(), "{ok:?}");
        };
        io("raw", "write -P 0x11 0 16M", "disk.img");
        let base = snapshot::take(dir).unwrap();
        let top = snapshot::read_chain(dir).unwrap().top().file.clone();
        io("qcow2", "write -P 0x22 5M 64k", &top); // chunk 1
        io("qcow2", "write -z 13M 4k", &top); // chunk 3 (a zero write is a change)
        let second = snapshot::take(dir).unwrap();
        assert_eq!(second, top);
        let c = open_changed(dir, Some(&second), &base).await.unwrap();
        assert_eq!(c.size, 16 << 20);
        assert_eq!(c.chunks, vec![1, 3]);
        assert_eq!(c.read.size, 8 << 20);
        let mut all = Vec::new();
        let mut s = c.read.stream;
        while let Some(b) = s.next().await {
            all.extend_from_slice(&b.unwrap());
        }
        assert_eq!(all.len(), 8 << 20);
        let (c1, c3) = all.split_at(4 << 20);
        assert!(c1[1 << 20..(1 << 20) + 65536].iter().all(|b| *b == 0x22));
        assert!(c1[..1 << 20].iter().all(|b| *b == 0x11));
        assert!(c3[1 << 20..(1 << 20) + 4096].iter().all(|b| *b == 0));
        assert!(c3[..1 << 20].iter().all(|b| *b == 0x11));
        // Nothing written since the second snapshot: the live chain has no changed chunk.
        let none = open_changed(dir, None, &second).await.unwrap();
        assert!(none.chunks.is_empty());
        assert_eq!(none.read.size, 0);
        // A base that is not below: refused, naming it.
        let err = open_changed(dir, Some(&base), &second).await.unwrap_err();
        assert!(err.to_string().contains(&second), "{err}");
    }
}
