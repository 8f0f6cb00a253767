//! Reading a volume out for export (docs/export.md): the raw bytes of a volume, or of one of
//! its snapshots, as a stream, plus gzip of such a stream (the system's `gzip -1`).
//!
//! A plain volume (or a snapshot whose prefix is only the bottom raw `disk.img`) is read
//! straight from the file. A layer chain is read flattened through `qemu-nbd` serving the
//! `json:` description of exactly the recorded layers (never a backing name found in an
//! image), read-only, on a private unix socket; [`nbd`] is the small NBD client that reads
//! it in order. Nothing is copied to a temporary file.

use std::path::{Path, PathBuf};
use std::pin::Pin;

use bytes::Bytes;
use futures::Stream;
use futures::StreamExt;

use crate::error::StorageError;
use crate::snapshot::{Chain, Layer, LayerFormat, blockdev_json, prefix_to, read_resolved};

pub mod changed;
pub mod nbd;

/// A stream of a volume's bytes.
pub type ByteStream = Pin<Box<dyn Stream<Item = std::io::Result<Bytes>> + Send>>;

/// A volume opened for export: its size (the raw image's length) and its bytes.
pub struct ExportRead {
    pub size: u64,
    pub stream: ByteStream,
}

impl std::fmt::Debug for ExportRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportRead")
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

/// How a volume (or snapshot) is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadPlan {
    /// One raw file: read it as it is.
    File(String),
    /// A qcow2 layer chain (bottom first): read flattened through qemu-nbd.
    Chain(Vec<Layer>),
}

/// How to read `handle` of a volume with `chain` (its live chain when `None`).
pub fn read_plan(chain: &Chain, handle: Option<&str>) -> Result<ReadPlan, StorageError> {
    let layers = match handle {
        Some(h) => prefix_to(chain, h)?,
        None => chain.layers.clone(),
    };
    match &layers[..] {
        [one] if one.format == LayerFormat::Raw => Ok(ReadPlan::File(one.file.clone())),
        _ => Ok(ReadPlan::Chain(layers)),
    }
}

/// The size of a chunk read from a file or from qemu-nbd.
pub const CHUNK: usize = 4 << 20;

/// Opens `handle` of the volume in `dir` (its live chain when `None`) for reading.
pub async fn open(dir: &Path, handle: Option<&str>) -> Result<ExportRead, StorageError> {
    let d = dir.to_path_buf();
    let h = handle.map(str::to_string);
    let plan = tokio::task::spawn_blocking(move || read_plan(&read_resolved(&d)?, h.as_deref()))
        .await
        .map_err(|e| StorageError::Tool {
            tool: "export".into(),
            message: e.to_string(),
        })??;
    match plan {
        ReadPlan::File(f) => open_file(&dir.join(f)).await,
        ReadPlan::Chain(layers) => {
            let spec = format!("json:{}", blockdev_json(dir, &layers));
            nbd::open(&spec).await
        }
    }
}

async fn open_file(path: &Path) -> Result<ExportRead, StorageError> {
    let mut file = tokio::fs::File::open(path)
        .await
        .map_err(|e| StorageError::io(path, e))?;
    let size = file
        .metadata()
        .await
        .map_err(|e| StorageError::io(path, e))?
        .len();
    // The whole file is read once, in order: ask the kernel for its larger sequential
    // readahead (a cold volume is read at the disk's streaming rate, not in 128 KiB steps).
    // Only a hint: a filesystem that ignores it reads the same bytes.
    let _ = nix::fcntl::posix_fadvise(
        &file,
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_SEQUENTIAL,
    );
    // Big reads (CHUNK per blocking read, not tokio's 2 MiB default) into the stream's own
    // buffer, which is not zeroed first and is reused once the sent chunks are dropped.
    file.set_max_buf_size(CHUNK);
    Ok(ExportRead {
        size,
        stream: Box::pin(tokio_util::io::ReaderStream::with_capacity(file, CHUNK)),
    })
}

/// `stream` gzip-compressed at the fast level by the system's `gzip -1` (as the importer
/// decompresses with the tools): the raw bytes are written to its stdin by a task of their
/// own while its stdout is the answer, so reading and compressing overlap. The process is
/// killed when the answer is dropped.
pub fn gzip(mut stream: ByteStream) -> ByteStream {
    use tokio::io::AsyncWriteExt;
    let child = tokio::process::Command::new("gzip")
        .args(["-1", "-c", "-n"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            let err = std::io::Error::other(format!("cannot start gzip: {e}"));
            return Box::pin(futures::stream::once(async move { Err(err) }));
        }
    };
    let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        return Box::pin(futures::stream::once(async {
            Err(std::io::Error::other("gzip has no pipes"))
        }));
    };
    let (err_tx, err_rx) = tokio::sync::oneshot::channel::<std::io::Error>();
    tokio::spawn(async move {
        while let Some(chunk) = stream.next().await {
            let written = match chunk {
                Ok(c) => stdin.write_all(&c).await,
                Err(e) => Err(e),
            };
            if let Err(e) = written {
                // A read failure must not end as a valid (truncated) gzip stream.
                let _ = err_tx.send(e);
                return;
            }
        }
        let _ = stdin.shutdown().await;
    });
    let out = tokio_util::io::ReaderStream::with_capacity(stdout, 1 << 20);
    let tail = futures::stream::once(async move {
        let status = child.wait().await;
        match (err_rx.await, status) {
            (Ok(e), _) => Some(Err(e)),
            (Err(_), Ok(s)) if s.success() => None,
            (Err(_), Ok(s)) => Some(Err(std::io::Error::other(format!("gzip: {s}")))),
            (Err(_), Err(e)) => Some(Err(e)),
        }
    })
    .filter_map(|x| async move { x });
    Box::pin(out.chain(tail))
}

/// A private scratch directory for qemu-nbd's socket (removed on drop).
pub(crate) fn socket_dir() -> Result<PathBuf, StorageError> {
    let base = std::env::temp_dir();
    for _ in 0..16 {
        let mut rnd = [0u8; 8];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut rnd).map_err(
            |_| StorageError::Tool {
                tool: "export".into(),
                message: "no randomness".into(),
            },
        )?;
        let name = rnd.iter().map(|b| format!("{b:02x}")).collect::<String>();
        let dir = base.join(format!("ferrovirt-export-{name}"));
        match std::fs::DirBuilder::new().mode_0700().create(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(StorageError::io(&dir, e)),
        }
    }
    Err(StorageError::Tool {
        tool: "export".into(),
        message: "could not make a socket directory".into(),
    })
}

trait Mode0700 {
    fn mode_0700(&mut self) -> &mut Self;
}

impl Mode0700 for std::fs::DirBuilder {
    fn mode_0700(&mut self) -> &mut Self {
        std::os::unix::fs::DirBuilderExt::mode(self, 0o700)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::plan_snapshot;

    #[tokio::test]
    async fn gzip_streams_decompress_to_the_input_and_errors_are_not_hidden() {
        use std::io::Read;
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let chunks: Vec<std::io::Result<Bytes>> = data
            .chunks(1 << 20)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let gz: Vec<u8> = gzip(Box::pin(futures::stream::iter(chunks)))
            .map(|c| c.unwrap())
            .collect::<Vec<_>>()
            .await
            .concat();
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_end(&mut out)
            .unwrap();
        assert_eq!(out, data);
        let broken: Vec<std::io::Result<Bytes>> = vec![
            Ok(Bytes::from_static(b"abc")),
            Err(std::io::Error::other("disk gone")),
        ];
        let results: Vec<_> = gzip(Box::pin(futures::stream::iter(broken)))
            .collect()
            .await;
        assert!(results.last().unwrap().is_err());
    }

    #[test]
    fn plain_volumes_and_bottom_snapshots_are_read_as_files() {
        let c = Chain::default();
        assert_eq!(
            read_plan(&c, None).unwrap(),
            ReadPlan::File("disk.img".into())
        );
        let c1 = plan_snapshot(&c).chain;
        assert_eq!(
            read_plan(&c1, Some("disk.img")).unwrap(),
            ReadPlan::File("disk.img".into())
        );
        match read_plan(&c1, None).unwrap() {
            ReadPlan::Chain(l) => assert_eq!(l.len(), 2),
            p => panic!("{p:?}"),
        }
        assert!(read_plan(&c1, Some("nope.qcow2")).is_err());
    }
}
