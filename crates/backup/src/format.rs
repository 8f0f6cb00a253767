//! The repository's object layout and record types (docs/backup.md "Repository format"), and the
//! pure checks on names. Everything here is plain data; `repo` does the I/O.
//!
//! ```text
//! <prefix>/config.json                 plaintext: format, chunk size, salt, key check
//! <prefix>/chunks/<id[0..2]>/<id>      one sealed 4 MiB (or last, shorter) chunk
//! <prefix>/backups/<name>/disks/<disk>.index   sealed Index: chunk ids + sizes, zeros marked
//! <prefix>/backups/<name>/manifest     sealed Manifest: VM definitions, referenced objects
//! <prefix>/catalog/<name>              sealed CatalogEntry, written LAST
//! ```

use serde::{Deserialize, Serialize};

use crate::BackupError;

/// The fixed chunk size: 4 MiB.
pub const CHUNK_SIZE: usize = 4 << 20;
/// The repository format this code writes and reads.
pub const FORMAT: u32 = 1;
/// The plaintext sealed into `config.json`'s key check.
pub const KEY_CHECK_PLAINTEXT: &[u8] = b"ferrovirt-backup key check v1";
/// The name the key check is sealed under.
pub const KEY_CHECK_NAME: &str = "config.json#keyCheck";

/// `config.json`: the only plaintext object.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RepoConfig {
    pub format: u32,
    pub chunk_size: usize,
    /// HKDF salt, hex.
    pub salt: String,
    /// [`KEY_CHECK_PLAINTEXT`] sealed as [`KEY_CHECK_NAME`], hex: a wrong key fails here first.
    pub key_check: String,
}

/// One chunk of a disk, in order. `id: None` is a chunk of zeros, not stored.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ChunkRef {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    pub len: u32,
}

/// The full index of one disk in one backup (a restore needs no other backup).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Index {
    pub disk: String,
    pub size: u64,
    pub chunk_size: usize,
    pub chunks: Vec<ChunkRef>,
}

/// What one disk (or a whole backup) cost: bytes read, stored as new, found already present.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Stats {
    pub bytes_read: u64,
    /// Plaintext bytes of chunks uploaded by this backup.
    pub bytes_new: u64,
    /// Plaintext bytes of chunks already in the repository (or earlier in this backup).
    pub bytes_deduplicated: u64,
    /// Bytes of all-zero chunks (marked in the index, never stored).
    pub bytes_zero: u64,
    pub chunks_new: u64,
    pub chunks_deduplicated: u64,
    /// Sealed (compressed + encrypted) bytes uploaded.
    pub bytes_uploaded: u64,
    /// Bytes of unchanged chunks taken over from the previous backup's index, not read (an
    /// incremental read: `bytes_read + bytes_reused` is the disk's size; zero chunks among them
    /// are also counted in `bytes_zero`).
    #[serde(default)]
    pub bytes_reused: u64,
    #[serde(default)]
    pub chunks_reused: u64,
}

impl Stats {
    pub fn add(&mut self, o: &Stats) {
        self.bytes_read += o.bytes_read;
        self.bytes_new += o.bytes_new;
        self.bytes_deduplicated += o.bytes_deduplicated;
        self.bytes_zero += o.bytes_zero;
        self.chunks_new += o.chunks_new;
        self.chunks_deduplicated += o.chunks_deduplicated;
        self.bytes_uploaded += o.bytes_uploaded;
        self.bytes_reused += o.bytes_reused;
        self.chunks_reused += o.chunks_reused;
    }
}

/// One disk of a backup as the manifest lists it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DiskEntry {
    /// The disk's name in the backup (the claim's name for VM backups).
    pub name: String,
    pub size: u64,
    pub stats: Stats,
}

/// Everything a restore needs besides the chunks: the VMs and what they reference.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub name: String,
    /// RFC 3339, set by the writer.
    pub created_at: String,
    /// VirtualMachine objects (server-set metadata and status stripped by the writer).
    #[serde(default)]
    pub vms: Vec<serde_json::Value>,
    /// Objects the VMs reference: DataVolumes, PVCs, Secrets, ConfigMaps, …
    #[serde(default)]
    pub objects: Vec<serde_json::Value>,
    #[serde(default)]
    pub disks: Vec<DiskEntry>,
    #[serde(default)]
    pub stats: Stats,
    /// Seconds the backup took up to the manifest.
    #[serde(default)]
    pub duration_seconds: f64,
}

/// The catalog's entry of one completed backup: a summary of its manifest.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CatalogEntry {
    pub name: String,
    pub created_at: String,
    /// `namespace/name` of each VM.
    pub vms: Vec<String>,
    pub disks: Vec<String>,
    pub size: u64,
    pub stats: Stats,
    pub duration_seconds: f64,
}

impl CatalogEntry {
    pub fn of(m: &Manifest) -> Self {
        let vm_name = |v: &serde_json::Value| {
            let md = &v["metadata"];
            format!(
                "{}/{}",
                md["namespace"].as_str().unwrap_or(""),
                md["name"].as_str().unwrap_or("")
            )
        };
        Self {
            name: m.name.clone(),
            created_at: m.created_at.clone(),
            vms: m.vms.iter().map(vm_name).collect(),
            disks: m.disks.iter().map(|d| d.name.clone()).collect(),
            size: m.disks.iter().map(|d| d.size).sum(),
            stats: m.stats,
            duration_seconds: m.duration_seconds,
        }
    }
}

/// Object names below the repository prefix.
pub mod paths {
    pub const CONFIG: &str = "config.json";
    pub const CHUNKS: &str = "chunks";
    pub const CATALOG: &str = "catalog";

    pub fn chunk(id: &str) -> String {
        format!("chunks/{}/{id}", &id[..2.min(id.len())])
    }
    pub fn index(backup: &str, disk: &str) -> String {
        format!("backups/{backup}/disks/{disk}.index")
    }
    pub fn manifest(backup: &str) -> String {
        format!("backups/{backup}/manifest")
    }
    pub fn catalog(backup: &str) -> String {
        format!("catalog/{backup}")
    }
}

/// A backup name: a DNS-1123 subdomain (lower-case alphanumerics, `-`, `.`; ≤ 253), so it is
/// safe as an object-name segment.
pub fn check_backup_name(name: &str) -> Result<(), BackupError> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.as_bytes()[name.len() - 1].is_ascii_alphanumeric()
        && !name.contains("..");
    if ok {
        Ok(())
    } else {
        Err(BackupError::InvalidName {
            what: "backup",
            name: name.to_string(),
        })
    }
}

/// A disk name: ASCII letters, digits, `-`, `_`, `.`, not starting with `.`, ≤ 253.
pub fn check_disk_name(name: &str) -> Result<(), BackupError> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(BackupError::InvalidName {
            what: "disk",
            name: name.to_string(),
        })
    }
}

/// A chunk id as written by this format: 64 lower-case hex digits.
pub fn is_chunk_id(id: &str) -> bool {
    id.len() == 64 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Whether a chunk is all zeros (marked in the index, never stored).
pub fn is_zero(chunk: &[u8]) -> bool {
    // 8 bytes at a time, then the tail.
    let words = chunk.chunks_exact(8);
    let tail = words.remainder();
    words
        .map(|c| u64::from_ne_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .all(|w| w == 0)
        && tail.iter().all(|&b| b == 0)
}

/// Checks an index read from the repository before it is used: sizes add up, every chunk but
/// the last is full, ids are well-formed.
pub fn check_index(ix: &Index, name: &str) -> Result<(), BackupError> {
    let bad = |reason: String| BackupError::Corrupt {
        object: name.to_string(),
        reason,
    };
    if ix.chunk_size != CHUNK_SIZE {
        return Err(bad(format!(
            "chunk size {} is not {CHUNK_SIZE}",
            ix.chunk_size
        )));
    }
    let mut total = 0u64;
    for (i, c) in ix.chunks.iter().enumerate() {
        let last = i + 1 == ix.chunks.len();
        if c.len as usize > CHUNK_SIZE || c.len == 0 || (!last && c.len as usize != CHUNK_SIZE) {
            return Err(bad(format!("chunk {i} has length {}", c.len)));
        }
        if let Some(id) = &c.id
            && !is_chunk_id(id)
        {
            return Err(bad(format!("chunk {i} has a malformed id")));
        }
        total += c.len as u64;
    }
    if total != ix.size {
        return Err(bad(format!(
            "chunks add up to {total}, size says {}",
            ix.size
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(check_backup_name("nightly-2026.12.01").is_ok());
        for bad in ["", "A", "../x", "a/b", "-a", "a..b", "a "] {
            assert!(check_backup_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_disk_name("rootdisk_1.img").is_ok());
        for bad in ["", ".", "..", "a/b", ".hidden", "a b"] {
            assert!(check_disk_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(paths::chunk("abcdef"), "chunks/ab/abcdef");
    }

    #[test]
    fn zero_detection() {
        assert!(is_zero(&[0u8; 4097]));
        let mut v = vec![0u8; 4097];
        v[4096] = 1;
        assert!(!is_zero(&v));
        v[4096] = 0;
        v[13] = 1;
        assert!(!is_zero(&v));
        assert!(is_zero(&[]));
    }

    #[test]
    fn index_checks() {
        let id = "a".repeat(64);
        let ok = Index {
            disk: "d".into(),
            size: CHUNK_SIZE as u64 + 10,
            chunk_size: CHUNK_SIZE,
            chunks: vec![
                ChunkRef {
                    id: Some(id.clone()),
                    len: CHUNK_SIZE as u32,
                },
                ChunkRef { id: None, len: 10 },
            ],
        };
        assert!(check_index(&ok, "i").is_ok());
        let mut short_middle = ok.clone();
        short_middle.chunks.swap(0, 1);
        assert!(check_index(&short_middle, "i").is_err());
        let mut bad_size = ok.clone();
        bad_size.size += 1;
        assert!(check_index(&bad_size, "i").is_err());
        let mut bad_id = ok;
        bad_id.chunks[0].id = Some("../../x".into());
        assert!(check_index(&bad_id, "i").is_err());
    }
}
