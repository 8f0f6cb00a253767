//! The disk of a containerDisk image: the one regular file under `/disk/` once all layers are
//! applied in order (a later layer replaces a file, `.wh.<name>` whiteouts and opaque
//! `.wh..wh..opq` markers remove earlier ones). Layers are untrusted: tar, gzip (by magic bytes) or
//! zstd (the `zstd` crate, window at most 128 MiB); only regular files directly under `disk/` are
//! written, each to a name this module chooses (entry names never become paths), up to a size
//! bound; symlinks, hard links, devices, subdirectories and `..` paths are ignored. Files are
//! written sparsely (zero blocks become holes).

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::error::StorageError;

/// At most this many tar entries per layer.
pub const MAX_ENTRIES: usize = 100_000;

/// What a tar entry path means for the disk directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiskEntry {
    /// A file directly under `disk/`.
    File(String),
    /// `disk/.wh.<name>`: remove `name`.
    Whiteout(String),
    /// `disk/.wh..wh..opq` or `.wh.disk`: remove everything earlier layers put there.
    Opaque,
    /// Anything else.
    Ignore,
}

/// Classifies a tar entry path (pure).
pub fn classify(path: &str) -> DiskEntry {
    let mut parts = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => return DiskEntry::Ignore,
            c => parts.push(c),
        }
    }
    match parts.as_slice() {
        [".wh.disk"] => DiskEntry::Opaque,
        ["disk", ".wh..wh..opq"] => DiskEntry::Opaque,
        ["disk", name] => match name.strip_prefix(".wh.") {
            Some(n) if !n.is_empty() => DiskEntry::Whiteout(n.to_string()),
            Some(_) => DiskEntry::Ignore,
            None => DiskEntry::File(name.to_string()),
        },
        _ => DiskEntry::Ignore,
    }
}

/// The files under `disk/` so far, staged in a private directory.
#[derive(Debug)]
pub struct DiskFiles {
    dir: PathBuf,
    files: BTreeMap<String, PathBuf>,
    next: u64,
}

impl DiskFiles {
    /// Stages files in `dir` (created).
    pub fn new(dir: &Path) -> Result<Self, StorageError> {
        std::fs::create_dir_all(dir).map_err(|e| StorageError::io(dir, e))?;
        Ok(DiskFiles {
            dir: dir.to_path_buf(),
            files: BTreeMap::new(),
            next: 0,
        })
    }

    fn remove(&mut self, name: &str) {
        if let Some(p) = self.files.remove(name) {
            let _ = std::fs::remove_file(p);
        }
    }

    fn clear(&mut self) {
        for (_, p) in std::mem::take(&mut self.files) {
            let _ = std::fs::remove_file(p);
        }
    }

    /// Applies the layer file `layer` (tar, gzip or zstd); files larger than `max_bytes` are
    /// refused.
    pub fn apply_layer(&mut self, layer: &Path, max_bytes: u64) -> Result<(), StorageError> {
        let mut head = [0u8; 4];
        let n = {
            let mut f = std::fs::File::open(layer).map_err(|e| StorageError::io(layer, e))?;
            f.read(&mut head).map_err(|e| StorageError::io(layer, e))?
        };
        let head = &head[..n];
        if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            let file = std::fs::File::open(layer).map_err(|e| StorageError::io(layer, e))?;
            let zstd_err = |e: std::io::Error| StorageError::Tool {
                tool: "zstd".into(),
                message: e.to_string(),
            };
            let mut decoder = zstd::stream::read::Decoder::new(file).map_err(zstd_err)?;
            decoder
                .window_log_max(crate::importer::ZSTD_MAX_WINDOW_LOG)
                .map_err(zstd_err)?;
            return self.apply_tar(decoder, layer, max_bytes);
        }
        let file = std::fs::File::open(layer).map_err(|e| StorageError::io(layer, e))?;
        let reader = std::io::BufReader::new(file);
        if head.starts_with(&[0x1f, 0x8b]) {
            self.apply_tar(flate2::read::MultiGzDecoder::new(reader), layer, max_bytes)
        } else {
            self.apply_tar(reader, layer, max_bytes)
        }
    }

    fn apply_tar(
        &mut self,
        reader: impl Read,
        layer: &Path,
        max_bytes: u64,
    ) -> Result<(), StorageError> {
        let bad = |m: String| StorageError::Refused(format!("layer {}: {m}", layer.display()));
        let mut archive = tar::Archive::new(reader);
        let entries = archive
            .entries()
            .map_err(|e| bad(format!("not a tar archive: {e}")))?;
        for (i, entry) in entries.enumerate() {
            if i >= MAX_ENTRIES {
                return Err(bad(format!("more than {MAX_ENTRIES} entries")));
            }
            let mut entry = entry.map_err(|e| bad(format!("broken tar entry: {e}")))?;
            let path = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
            let kind = entry.header().entry_type();
            match classify(&path) {
                DiskEntry::Ignore => {}
                DiskEntry::Opaque => self.clear(),
                DiskEntry::Whiteout(name) => self.remove(&name),
                DiskEntry::File(name) => {
                    // Any entry replaces an earlier file of the same name; only regular
                    // files take its place.
                    self.remove(&name);
                    if !kind.is_file() {
                        continue;
                    }
                    let size = entry.size();
                    if size > max_bytes {
                        return Err(bad(format!(
                            "disk/{name} is {size} bytes, more than the {max_bytes} bytes allowed"
                        )));
                    }
                    let dst = self.dir.join(format!("file-{}", self.next));
                    self.next += 1;
                    copy_sparse(&mut entry, &dst, max_bytes)
                        .map_err(|e| StorageError::io(&dst, e))?;
                    self.files.insert(name, dst);
                }
            }
        }
        Ok(())
    }

    /// The disk: the one file under `disk/` (its name and staged path).
    pub fn into_disk(self) -> Result<(String, PathBuf), StorageError> {
        let mut files = self.files.into_iter();
        match (files.next(), files.next()) {
            (Some(one), None) => Ok(one),
            (None, _) => Err(StorageError::Refused(
                "the image has no file under /disk/ (a containerDisk image holds its disk \
                 image as /disk/<name>)"
                    .into(),
            )),
            (Some((a, _)), Some((b, _))) => Err(StorageError::Refused(format!(
                "the image has more than one file under /disk/ ({a}, {b}, …); exactly one is \
                 expected"
            ))),
        }
    }
}

/// Copies `src` into the new file `dst`, leaving holes for all-zero 64 KiB blocks, failing
/// with `InvalidData` past `max` bytes.
pub fn copy_sparse(src: &mut impl Read, dst: &Path, max: u64) -> std::io::Result<u64> {
    const BLOCK: usize = 64 << 10;
    let mut out = std::fs::File::create(dst)?;
    let mut buf = vec![0u8; BLOCK];
    let mut total = 0u64;
    loop {
        let mut filled = 0;
        while filled < BLOCK {
            let n = src.read(&mut buf[filled..])?;
            if n == 0 {
                break;
            }
            filled += n;
        }
        if filled == 0 {
            break;
        }
        total += filled as u64;
        if total > max {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("more than {max} bytes"),
            ));
        }
        if buf[..filled].iter().all(|b| *b == 0) {
            out.seek(SeekFrom::Current(filled as i64))?;
        } else {
            out.write_all(&buf[..filled])?;
        }
        if filled < BLOCK {
            break;
        }
    }
    out.set_len(total)?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_paths() {
        assert_eq!(classify("disk/a.qcow2"), DiskEntry::File("a.qcow2".into()));
        assert_eq!(classify("./disk/a.img"), DiskEntry::File("a.img".into()));
        assert_eq!(classify("/disk//b"), DiskEntry::File("b".into()));
        assert_eq!(classify("disk/"), DiskEntry::Ignore);
        assert_eq!(classify("disk/sub/a"), DiskEntry::Ignore);
        assert_eq!(classify("disk/../etc/passwd"), DiskEntry::Ignore);
        assert_eq!(classify("../disk/a"), DiskEntry::Ignore);
        assert_eq!(classify("other/a"), DiskEntry::Ignore);
        assert_eq!(classify("disk/.wh.a"), DiskEntry::Whiteout("a".into()));
        assert_eq!(classify("disk/.wh..wh..opq"), DiskEntry::Opaque);
        assert_eq!(classify(".wh.disk"), DiskEntry::Opaque);
    }

    fn header(path: &str, size: u64, kind: tar::EntryType) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_path(path).unwrap();
        h.set_size(size);
        h.set_entry_type(kind);
        h.set_mode(0o644);
        h.set_cksum();
        h
    }

    fn layer(dir: &Path, name: &str, files: &[(&str, &[u8], tar::EntryType)], gz: bool) -> PathBuf {
        let mut b = tar::Builder::new(Vec::new());
        for (p, data, kind) in files {
            let mut h = header(p, data.len() as u64, *kind);
            if *kind == tar::EntryType::Symlink {
                h.set_link_name("/etc/shadow").unwrap();
                h.set_size(0);
                h.set_cksum();
                b.append(&h, &[][..]).unwrap();
            } else {
                b.append(&h, *data).unwrap();
            }
        }
        let tar = b.into_inner().unwrap();
        let bytes = if gz {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(&tar).unwrap();
            e.finish().unwrap()
        } else {
            tar
        };
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn applies_layers_in_order() {
        use tar::EntryType::{Directory, Regular, Symlink};
        let d = tempfile::tempdir().unwrap();
        let l1 = layer(
            d.path(),
            "l1",
            &[
                ("disk/", b"", Directory),
                ("disk/old.img", b"old", Regular),
                ("etc/passwd", b"x", Regular),
            ],
            true,
        );
        let l2 = layer(
            d.path(),
            "l2",
            &[
                ("disk/.wh.old.img", b"", Regular),
                ("disk/link", b"", Symlink),
                ("disk/sub/x", b"y", Regular),
                ("disk/new.qcow2", b"new disk", Regular),
            ],
            false,
        );
        let mut files = DiskFiles::new(&d.path().join("stage")).unwrap();
        files.apply_layer(&l1, 1 << 20).unwrap();
        files.apply_layer(&l2, 1 << 20).unwrap();
        let (name, path) = files.into_disk().unwrap();
        assert_eq!(name, "new.qcow2");
        assert_eq!(std::fs::read(path).unwrap(), b"new disk");
        // Nothing else was written outside the staging directory's own names.
        let staged: Vec<_> = std::fs::read_dir(d.path().join("stage"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(staged.len(), 1, "{staged:?}");
    }

    #[test]
    fn refuses_empty_ambiguous_and_oversized_disks() {
        use tar::EntryType::Regular;
        let d = tempfile::tempdir().unwrap();
        let none = layer(d.path(), "n", &[("x/a", b"1", Regular)], false);
        let mut f = DiskFiles::new(&d.path().join("s1")).unwrap();
        f.apply_layer(&none, 10).unwrap();
        assert!(f.into_disk().unwrap_err().to_string().contains("no file"));

        let two = layer(
            d.path(),
            "t",
            &[("disk/a", b"1", Regular), ("disk/b", b"2", Regular)],
            true,
        );
        let mut f = DiskFiles::new(&d.path().join("s2")).unwrap();
        f.apply_layer(&two, 10).unwrap();
        assert!(
            f.into_disk()
                .unwrap_err()
                .to_string()
                .contains("more than one")
        );

        let big = layer(d.path(), "b", &[("disk/a", &[1u8; 100], Regular)], false);
        let mut f = DiskFiles::new(&d.path().join("s3")).unwrap();
        let e = f.apply_layer(&big, 99).unwrap_err().to_string();
        assert!(e.contains("more than the 99 bytes"), "{e}");

        let junk = d.path().join("junk");
        std::fs::write(&junk, vec![7u8; 1000]).unwrap();
        let mut f = DiskFiles::new(&d.path().join("s4")).unwrap();
        assert!(f.apply_layer(&junk, 10).is_err());
    }

    #[test]
    fn zstd_layers_and_sparse_copies() {
        use tar::EntryType::Regular;
        let d = tempfile::tempdir().unwrap();
        let mut data = vec![0u8; 256 << 10];
        data[200_000] = 5;
        let plain = layer(d.path(), "z", &[("disk/d.raw", &data, Regular)], false);
        let packed = zstd::stream::encode_all(&std::fs::read(&plain).unwrap()[..], 3).unwrap();
        std::fs::write(d.path().join("z.zst"), packed).unwrap();
        // The size cap holds inside a zstd layer too (a zero-filled file is a small bomb).
        let mut f = DiskFiles::new(&d.path().join("s0")).unwrap();
        let e = f
            .apply_layer(&d.path().join("z.zst"), 100_000)
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than the 100000 bytes"), "{e}");
        // Corrupt zstd data is an error, not a panic.
        let mut junk = vec![0x28, 0xb5, 0x2f, 0xfd];
        junk.extend([0xffu8; 64]);
        std::fs::write(d.path().join("junk.zst"), junk).unwrap();
        let mut f = DiskFiles::new(&d.path().join("s1")).unwrap();
        assert!(f.apply_layer(&d.path().join("junk.zst"), 1 << 20).is_err());
        let mut f = DiskFiles::new(&d.path().join("s")).unwrap();
        f.apply_layer(&d.path().join("z.zst"), 1 << 20).unwrap();
        let (_, p) = f.into_disk().unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), data);
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(&p).unwrap();
        assert!(
            m.blocks() * 512 < m.len(),
            "not sparse: {} blocks",
            m.blocks()
        );
    }
}
