//! Populating a volume: [`import`] downloads an HTTP(S) source into a scratch directory (verifying
//! its checksum while it streams), decompresses gzip/xz (their tools) and zstd (the `zstd` crate,
//! in process), checks the image with `qemu-img info` and `qemu-img check` under resource limits
//! (no backing or external data files, not corrupt, virtual size within the claim) and converts it
//! to raw into the volume: into a temporary file renamed over `disk.img` on success (Filesystem
//! mode), or in place onto the loop device (Block mode; discarded again on failure), so a failed
//! import leaves the volume as blank as it was. [`blank`] and [`clone_image`] are the other two
//! populators. Progress is reported as a percentage of the whole job through a callback.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use crate::block;
use crate::checksum::{self, Checksum, Hasher};
use crate::error::StorageError;
use crate::header;
use crate::http::{self, DownloadRequest};
use crate::provisioner;
use crate::qemu_img::{self, ConvertRequest, ImageInfo};

/// Share of the progress bar taken by the download (the rest is the conversion).
pub const DOWNLOAD_SHARE: f64 = 50.0;

/// A compression wrapper recognised by its magic bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    Gzip,
    Xz,
    Zstd,
}

/// The largest zstd window accepted (2^27 = 128 MiB, libzstd's own default limit): a frame
/// declaring a larger one is refused instead of making the decoder allocate it.
pub const ZSTD_MAX_WINDOW_LOG: u32 = 27;

impl Compression {
    /// The decompressing tool (reads the file, writes to stdout); zstd is decoded in process
    /// with the `zstd` crate, and this is the name its errors carry.
    pub fn tool(self) -> &'static str {
        match self {
            Compression::Gzip => "gzip",
            Compression::Xz => "xz",
            Compression::Zstd => "zstd",
        }
    }
}

/// Detect a compression wrapper from the first bytes of a file.
pub fn detect_compression(head: &[u8]) -> Option<Compression> {
    if head.starts_with(&[0x1f, 0x8b]) {
        Some(Compression::Gzip)
    } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0x00]) {
        Some(Compression::Xz)
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Some(Compression::Zstd)
    } else {
        None
    }
}

/// Overall progress (0–100) during the download: `received` of `total` bytes.
pub fn download_progress(received: u64, total: Option<u64>) -> Option<f64> {
    let t = total.filter(|t| *t > 0)?;
    Some((received.min(t) as f64 / t as f64) * DOWNLOAD_SHARE)
}

/// Overall progress (0–100) while converting at `convert_percent`.
pub fn convert_progress(convert_percent: f64) -> f64 {
    DOWNLOAD_SHARE + convert_percent.clamp(0.0, 100.0) * (100.0 - DOWNLOAD_SHARE) / 100.0
}

/// What to import where.
#[derive(Debug, Clone)]
pub struct ImportRequest {
    pub source: DownloadRequest,
    pub checksum: Option<Checksum>,
    /// A private directory for the download and the decompressed image (removed after).
    pub scratch_dir: PathBuf,
    /// The volume's image file (`<volume>/disk.img`).
    pub target: PathBuf,
    /// The claim's size in bytes: the image's virtual size must fit and `disk.img` ends up
    /// this large.
    pub capacity: u64,
}

/// Download, verify, decompress, validate and convert `req.source` into `req.target`.
/// Returns what `qemu-img info` said about the source image.
pub async fn import(
    req: &ImportRequest,
    mut progress: impl FnMut(f64) + Send,
) -> Result<ImageInfo, StorageError> {
    let scratch = &req.scratch_dir;
    std::fs::create_dir_all(scratch).map_err(|e| StorageError::io(scratch, e))?;
    let result = import_in(req, &mut progress).await;
    let _ = std::fs::remove_dir_all(scratch);
    result
}

async fn import_in(
    req: &ImportRequest,
    progress: &mut (impl FnMut(f64) + Send),
) -> Result<ImageInfo, StorageError> {
    let download = req.scratch_dir.join("download");
    let started = std::time::Instant::now();
    let bytes = {
        // Buffered: HTTP body frames are small, and one write(2) per frame costs more than
        // the copy.
        let mut file = std::io::BufWriter::with_capacity(
            1 << 20,
            std::fs::File::create(&download).map_err(|e| StorageError::io(&download, e))?,
        );
        let mut hasher = req.checksum.as_ref().map(|c| Hasher::new(c.algorithm));
        let bytes = http::download(
            &req.source,
            |chunk| {
                if let Some(h) = hasher.as_mut() {
                    h.update(chunk);
                }
                file.write_all(chunk)
                    .map_err(|e| StorageError::io(&download, e))
            },
            |received, total| {
                if let Some(p) = download_progress(received, total) {
                    progress(p);
                }
            },
        )
        .await?;
        file.flush().map_err(|e| StorageError::io(&download, e))?;
        if let (Some(expected), Some(h)) = (&req.checksum, hasher) {
            checksum::verify(expected, &h.finish())?;
        }
        bytes
    };
    let downloaded = started.elapsed();
    progress(DOWNLOAD_SHARE);
    let image = decompress_if_needed(
        &download,
        &req.scratch_dir.join("image"),
        req.source.limits.max_bytes,
    )
    .await?;
    let info = inspect(&image, req.capacity).await?;
    let inspected = started.elapsed();
    write_raw(&image, &info.format, &req.target, req.capacity, |p| {
        progress(convert_progress(p))
    })
    .await?;
    tracing::info!(
        url = %req.source.url,
        bytes,
        format = %info.format,
        download_ms = downloaded.as_millis() as u64,
        inspect_ms = (inspected - downloaded).as_millis() as u64,
        convert_ms = (started.elapsed() - inspected).as_millis() as u64,
        "imported"
    );
    Ok(info)
}

/// The checks of an untrusted image, all with the format given to `qemu-img` (never probed):
/// its format from its header ([`header::detect_file`], which refuses VMDK descriptors,
/// backing files and external data files before `qemu-img` opens anything), then
/// `qemu-img info -f` + [`qemu_img::validate`] + [`qemu_img::validate_self_contained`] (one
/// file, no extents elsewhere) + `qemu-img check -f`. An image qemu-img cannot open is
/// refused (retrying cannot fix it), as is a corrupt one.
pub async fn inspect(image: &Path, capacity: u64) -> Result<ImageInfo, StorageError> {
    let format = header::detect_file(image)?;
    let info = match qemu_img::info(image, format).await {
        Ok(i) => i,
        Err(StorageError::Tool { message, .. }) => {
            return Err(StorageError::Refused(format!(
                "not a valid {format} image: {message}"
            )));
        }
        Err(e) => return Err(e),
    };
    if info.format != format {
        return Err(StorageError::Refused(format!(
            "qemu-img reports format {:?} for a {format} image",
            info.format
        )));
    }
    qemu_img::validate(&info, capacity)?;
    qemu_img::validate_self_contained(&info, image)?;
    qemu_img::check(image, &info.format).await?;
    Ok(info)
}

/// Decompress `path` into `out` when it is gzip/xz/zstd, refusing output of more than
/// `limit` bytes while it streams (the decompressor is stopped there, so a compression bomb
/// never takes more scratch space than that); returns the image to use.
pub async fn decompress_if_needed(
    path: &Path,
    out: &Path,
    limit: u64,
) -> Result<PathBuf, StorageError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut head = [0u8; 8];
    let n = {
        use std::io::Read;
        let mut f = std::fs::File::open(path).map_err(|e| StorageError::io(path, e))?;
        f.read(&mut head).map_err(|e| StorageError::io(path, e))?
    };
    let Some(c) = detect_compression(&head[..n]) else {
        return Ok(path.to_path_buf());
    };
    let tool_err = |m: String| StorageError::Tool {
        tool: c.tool().into(),
        message: m,
    };
    if c == Compression::Zstd {
        let (src, dst) = (path.to_path_buf(), out.to_path_buf());
        tokio::task::spawn_blocking(move || decompress_zstd(&src, &dst, limit))
            .await
            .map_err(|e| tool_err(e.to_string()))??;
        let _ = std::fs::remove_file(path);
        return Ok(out.to_path_buf());
    }
    let mut child = tokio::process::Command::new(c.tool())
        .arg("-dc")
        .arg(path)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| tool_err(e.to_string()))?;
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let err_task = tokio::spawn(async move {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s).await;
        s
    });
    let mut dst = tokio::fs::File::create(out)
        .await
        .map_err(|e| StorageError::io(out, e))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = stdout
            .read(&mut buf)
            .await
            .map_err(|e| tool_err(e.to_string()))?;
        if n == 0 {
            break;
        }
        total += n as u64;
        if total > limit {
            let _ = child.kill().await;
            drop(dst);
            let _ = std::fs::remove_file(out);
            return Err(too_large(c, limit));
        }
        dst.write_all(&buf[..n])
            .await
            .map_err(|e| StorageError::io(out, e))?;
    }
    dst.flush().await.map_err(|e| StorageError::io(out, e))?;
    let status = child.wait().await.map_err(|e| tool_err(e.to_string()))?;
    if !status.success() {
        let stderr = err_task.await.unwrap_or_default();
        return Err(tool_err(stderr.trim().to_string()));
    }
    let _ = std::fs::remove_file(path);
    Ok(out.to_path_buf())
}

/// The refusal of a stream that decompresses past `limit`.
fn too_large(c: Compression, limit: u64) -> StorageError {
    StorageError::Refused(format!(
        "the {} stream decompresses to more than {limit} bytes, more than a claim of this size \
         accepts",
        c.tool()
    ))
}

/// Streams the zstd file `src` into `dst` with the `zstd` crate (window at most
/// [`ZSTD_MAX_WINDOW_LOG`]), stopping with a refusal once more than `limit` bytes came out
/// (the partial output is removed).
pub fn decompress_zstd(src: &Path, dst: &Path, limit: u64) -> Result<(), StorageError> {
    use std::io::{Read, Write};
    let bad = |e: std::io::Error| StorageError::Tool {
        tool: Compression::Zstd.tool().into(),
        message: e.to_string(),
    };
    let file = std::fs::File::open(src).map_err(|e| StorageError::io(src, e))?;
    let mut decoder = zstd::stream::read::Decoder::new(file).map_err(bad)?;
    decoder.window_log_max(ZSTD_MAX_WINDOW_LOG).map_err(bad)?;
    let mut out = std::fs::File::create(dst).map_err(|e| StorageError::io(dst, e))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    let result = loop {
        let n = match decoder.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => break Err(bad(e)),
        };
        total += n as u64;
        if total > limit {
            break Err(too_large(Compression::Zstd, limit));
        }
        if let Err(e) = out.write_all(&buf[..n]) {
            break Err(StorageError::io(dst, e));
        }
    };
    if result.is_err() {
        drop(out);
        let _ = std::fs::remove_file(dst);
    }
    result
}

/// Convert `src` (of `format`) to a raw file next to `target`, grow it sparsely to
/// `capacity`, and rename it over `target` (so a failed conversion leaves no partial data).
/// A block-device `target` is written in place and discarded again when that fails.
pub async fn write_raw(
    src: &Path,
    format: &str,
    target: &Path,
    capacity: u64,
    progress: impl FnMut(f64),
) -> Result<(), StorageError> {
    if block::is_block_device(target) {
        let res = qemu_img::convert(
            &ConvertRequest {
                src,
                src_format: format,
                dst: target,
                dst_format: "raw",
                existing_dst: true,
            },
            progress,
        )
        .await;
        if res.is_err() {
            let _ = discard(target).await;
        }
        return res;
    }
    let tmp = target.with_extension("img.importing");
    let _ = std::fs::remove_file(&tmp);
    let res = qemu_img::convert(
        &ConvertRequest {
            src,
            src_format: format,
            dst: &tmp,
            dst_format: "raw",
            existing_dst: false,
        },
        progress,
    )
    .await;
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    provisioner::create_sparse(&tmp, capacity)?;
    std::fs::rename(&tmp, target).map_err(|e| StorageError::io(target, e))
}

/// Populate `target` as an empty (all zeros, sparse) raw disk of `capacity` bytes; a block
/// device is discarded (reads as zeros afterwards).
pub async fn blank(target: &Path, capacity: u64) -> Result<(), StorageError> {
    if block::is_block_device(target) {
        return discard(target).await;
    }
    let t = target.to_path_buf();
    tokio::task::spawn_blocking(move || provisioner::reset_sparse(&t, capacity))
        .await
        .map_err(|e| StorageError::Tool {
            tool: "blank".into(),
            message: e.to_string(),
        })?
}

/// Discard every block of block device `dev` (`blkdiscard`): a loop device punches holes
/// into its backing file, so the device reads as zeros and takes no space.
pub async fn discard(dev: &Path) -> Result<(), StorageError> {
    let out = tokio::process::Command::new("blkdiscard")
        .arg(dev)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| StorageError::Tool {
            tool: "blkdiscard".into(),
            message: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(StorageError::Tool {
            tool: "blkdiscard".into(),
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

/// Copy the volume image `src` into `target` (a clone): a byte copy of a raw disk, never
/// probed (its first sector is whatever the guest wrote, perhaps an image header); its size
/// must fit in `capacity`; the copy stays sparse.
pub async fn clone_image(
    src: &Path,
    target: &Path,
    capacity: u64,
    progress: impl FnMut(f64),
) -> Result<(), StorageError> {
    let size = {
        use std::io::Seek;
        let mut f = std::fs::File::open(src).map_err(|e| StorageError::io(src, e))?;
        f.seek(std::io::SeekFrom::End(0))
            .map_err(|e| StorageError::io(src, e))?
    };
    if size > capacity {
        return Err(StorageError::Refused(format!(
            "the clone source is {size} bytes, larger than the target claim of {capacity} \
             bytes; a larger PVC is required"
        )));
    }
    write_raw(src, "raw", target, capacity, progress).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_compression() {
        assert_eq!(
            detect_compression(&[0x1f, 0x8b, 8]),
            Some(Compression::Gzip)
        );
        assert_eq!(
            detect_compression(&[0xfd, b'7', b'z', b'X', b'Z', 0]),
            Some(Compression::Xz)
        );
        assert_eq!(
            detect_compression(&[0x28, 0xb5, 0x2f, 0xfd]),
            Some(Compression::Zstd)
        );
        assert_eq!(detect_compression(b"QFI\xfb"), None);
        assert_eq!(detect_compression(&[]), None);
    }

    #[test]
    fn progress_splits_between_download_and_convert() {
        assert_eq!(download_progress(5, Some(10)), Some(25.0));
        assert_eq!(download_progress(5, None), None);
        assert_eq!(download_progress(20, Some(10)), Some(50.0));
        assert_eq!(convert_progress(0.0), 50.0);
        assert_eq!(convert_progress(50.0), 75.0);
        assert_eq!(convert_progress(100.0), 100.0);
    }

    #[tokio::test]
    async fn decompresses_xz_and_zstd() {
        let d = tempfile::tempdir().unwrap();
        for (tool, ext) in [("xz", "xz"), ("zstd", "zst")] {
            let src = d.path().join(format!("img-{tool}"));
            std::fs::write(&src, vec![3u8; 1 << 16]).unwrap();
            let status = std::process::Command::new(tool)
                .args(["-q", "-k"])
                .arg(&src)
                .status()
                .unwrap();
            assert!(status.success(), "{tool}");
            let packed = src.with_file_name(format!("img-{tool}.{ext}"));
            let out = d.path().join(format!("out-{tool}"));
            let img = decompress_if_needed(&packed, &out, 1 << 20).await.unwrap();
            assert_eq!(img, out);
            assert!(std::fs::read(&img).unwrap() == vec![3u8; 1 << 16], "{tool}");
        }
    }

    #[tokio::test]
    async fn zstd_is_decoded_in_process_and_capped() {
        let d = tempfile::tempdir().unwrap();
        // A small bomb: 64 MiB of zeros compress to a few KiB.
        let packed = d.path().join("bomb.zst");
        let data = zstd::stream::encode_all(&vec![0u8; 64 << 20][..], 19).unwrap();
        assert!(data.len() < 64 << 10, "{}", data.len());
        std::fs::write(&packed, &data).unwrap();
        let out = d.path().join("out");
        let e = decompress_if_needed(&packed, &out, 1 << 20)
            .await
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("zstd stream decompresses to more than"),
            "{e}"
        );
        assert!(!out.exists(), "the partial output is removed");
        assert!(packed.exists(), "the download stays until it is decoded");
        // Exactly at the limit is fine.
        let img = decompress_if_needed(&packed, &out, 64 << 20).await.unwrap();
        assert_eq!(std::fs::metadata(&img).unwrap().len(), 64 << 20);
        // Garbage after the magic bytes is an error naming zstd, not a panic.
        let junk = d.path().join("junk.zst");
        std::fs::write(
            &junk,
            [0x28, 0xb5, 0x2f, 0xfd, 0xff, 0xff, 0xff, 0xff, 1, 2, 3],
        )
        .unwrap();
        let e = decompress_if_needed(&junk, &d.path().join("o2"), 1 << 20)
            .await
            .unwrap_err();
        assert!(e.to_string().starts_with("zstd failed"), "{e}");
        assert!(!d.path().join("o2").exists());
    }

    #[test]
    fn zstd_windows_beyond_the_limit_are_refused() {
        let d = tempfile::tempdir().unwrap();
        // A frame made with a 2^28 window (long-distance mode) needs more than the decoder
        // accepts: refused before it allocates the window.
        let mut enc = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
        enc.long_distance_matching(true).unwrap();
        enc.window_log(ZSTD_MAX_WINDOW_LOG + 1).unwrap();
        enc.include_contentsize(false).unwrap();
        std::io::Write::write_all(&mut enc, &vec![7u8; 1 << 20]).unwrap();
        let packed = d.path().join("wide.zst");
        std::fs::write(&packed, enc.finish().unwrap()).unwrap();
        let e = decompress_zstd(&packed, &d.path().join("o"), 1 << 30).unwrap_err();
        assert!(e.to_string().contains("zstd failed"), "{e}");
    }

    #[tokio::test]
    async fn blank_clone_and_gzip() {
        let d = tempfile::tempdir().unwrap();
        let a = d.path().join("a.img");
        blank(&a, 4 << 20).await.unwrap();
        std::fs::write(d.path().join("x"), vec![1u8; 1 << 20]).unwrap();
        let status = std::process::Command::new("gzip")
            .arg(d.path().join("x"))
            .status()
            .unwrap();
        assert!(status.success());
        let img = decompress_if_needed(&d.path().join("x.gz"), &d.path().join("y"), 1 << 20)
            .await
            .unwrap();
        // Bounded while streaming: one byte less refuses, and the partial output is gone.
        std::fs::write(d.path().join("z"), vec![1u8; 1 << 20]).unwrap();
        std::process::Command::new("gzip")
            .arg(d.path().join("z"))
            .status()
            .unwrap();
        let e = decompress_if_needed(&d.path().join("z.gz"), &d.path().join("w"), (1 << 20) - 1)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("decompresses to more than"), "{e}");
        assert!(!d.path().join("w").exists());
        assert!(std::fs::read(&img).unwrap() == vec![1u8; 1 << 20]);
        let b = d.path().join("b.img");
        clone_image(&img, &b, 2 << 20, |_| {}).await.unwrap();
        assert_eq!(std::fs::metadata(&b).unwrap().len(), 2 << 20);
        let e = clone_image(&a, &b, 1 << 20, |_| {}).await.unwrap_err();
        assert!(matches!(e, StorageError::Refused(_)), "{e}");
    }

    /// Serve `body` once per connection on 127.0.0.1 (HTTP/1.0 style: Content-Length, close).
    fn serve(body: Vec<u8>) -> String {
        use std::io::{BufRead, BufReader, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                let mut r = BufReader::new(s.try_clone().unwrap());
                let mut line = String::new();
                while r.read_line(&mut line).unwrap_or(0) > 2 {
                    line.clear();
                }
                let mut s = s;
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = s.write_all(&body);
            }
        });
        format!("http://{addr}/disk.qcow2")
    }

    #[tokio::test]
    async fn imports_qcow2_over_http_with_checksum() {
        let d = tempfile::tempdir().unwrap();
        let raw = d.path().join("src.raw");
        std::fs::write(&raw, vec![9u8; 1 << 20]).unwrap();
        let q = d.path().join("src.qcow2");
        qemu_img::convert(
            &ConvertRequest {
                src: &raw,
                src_format: "raw",
                dst: &q,
                dst_format: "qcow2",
                existing_dst: false,
            },
            |_| {},
        )
        .await
        .unwrap();
        let bytes = std::fs::read(&q).unwrap();
        let mut h = Hasher::new(checksum::Algorithm::Sha256);
        h.update(&bytes);
        let sum = checksum::parse(&format!("sha256:{}", h.finish())).unwrap();
        let url = serve(bytes);
        let target = d.path().join("disk.img");
        let mut req = ImportRequest {
            source: DownloadRequest {
                url,
                headers: vec!["X-Test: 1".into()],
                auth: None,
                ca_pems: Vec::new(),
                address_policy: crate::netpolicy::AddressPolicy::allowing(vec![
                    "127.0.0.0/8".parse().unwrap(),
                ]),
                ..Default::default()
            },
            checksum: Some(sum),
            scratch_dir: d.path().join("scratch"),
            target: target.clone(),
            capacity: 4 << 20,
        };
        let mut seen = Vec::new();
        let info = import(&req, |p| seen.push(p)).await.unwrap();
        assert_eq!(info.format, "qcow2");
        assert_eq!(seen.last(), Some(&100.0));
        assert!(seen.windows(2).all(|w| w[0] <= w[1]), "{seen:?}");
        assert_eq!(std::fs::metadata(&target).unwrap().len(), 4 << 20);
        assert!(std::fs::read(&target).unwrap()[..1 << 20] == vec![9u8; 1 << 20][..]);
        assert!(!req.scratch_dir.exists());

        req.capacity = 1 << 19;
        let e = import(&req, |_| {}).await.unwrap_err();
        assert!(matches!(e, StorageError::Refused(_)), "{e}");
        req.capacity = 4 << 20;
        req.checksum = Some(checksum::parse(&format!("sha256:{}", "0".repeat(64))).unwrap());
        let e = import(&req, |_| {}).await.unwrap_err();
        assert!(matches!(e, StorageError::ChecksumMismatch { .. }), "{e}");
    }
}
