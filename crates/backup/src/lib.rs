//! ferrovirt-backup: the backup repository (docs/backup.md).
//!
//! A repository lives on a [`target::Target`] (an S3 bucket or a directory) and holds
//! deduplicated, compressed, encrypted 4 MiB chunks, a full index per disk per backup, a manifest
//! per backup (the VM definitions and what they reference) and a catalog entry per completed
//! backup, written last, so an interrupted backup leaves nothing listed.
//!
//! - [`crypto`]: keys derived from the Secret's key (HKDF-SHA256), keyed chunk ids
//!   (HMAC-SHA256), sealed objects (zstd + AES-256-GCM, a random nonce each);
//! - [`format`]: the object layout, the record types and the pure checks on them;
//! - [`target`]: S3 and filesystem stores through `object_store`, and the target of a
//!   BackupTarget's spec and credentials;
//! - [`repo`]: open (key check), write a backup (dedup, stats, progress), list, read a
//!   manifest, restore a disk, verify;
//! - [`restore`] (pure): what a restore makes of a backed-up VM (names, claims, MAC
//!   addresses, firmware UUID), shared by the CLI and the BackupRestore controller;
//! - [`incremental`] (pure): which chunks of a disk are read and which are taken over from the
//!   previous backup's index when the layer chain says what changed;
//! - [`gc`]: delete a backup (prune), garbage-collect unreferenced chunks under a lock protocol
//!   that is safe against a backup running at the same time.

pub mod crypto;
pub mod format;
pub mod gc;
pub mod incremental;
pub mod repo;
pub mod restore;
pub mod target;

pub use format::{CatalogEntry, DiskEntry, Index, Manifest, Stats};
pub use gc::{GcOptions, GcReport};
pub use repo::{BackupWriter, Repository, VerifyProblem, VerifyReport};
pub use target::{S3Target, Target};

/// What can go wrong with a backup repository.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error("the encryption key is {len} bytes; at least {min} are needed")]
    KeyTooShort { len: usize, min: usize },
    #[error("wrong encryption key: the repository's key check does not open with this key")]
    WrongKey,
    #[error("no backup repository at this target (config.json missing)")]
    NotInitialized,
    #[error("repository format {0} is not supported (this build reads format 1)")]
    UnsupportedFormat(u32),
    #[error("corrupted object {object}: {reason}")]
    Corrupt { object: String, reason: String },
    #[error("missing object {object}")]
    Missing { object: String },
    #[error("backup {0} not found in the catalog")]
    BackupNotFound(String),
    #[error("backup {0} already exists in the catalog")]
    AlreadyExists(String),
    #[error("disk {disk} is not in backup {backup}")]
    DiskNotFound { backup: String, disk: String },
    #[error("invalid {what} name {name:?}")]
    InvalidName { what: &'static str, name: String },
    #[error("target: {0}")]
    Target(String),
    #[error("object store: {0}")]
    Store(#[from] object_store::Error),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("compression: {0}")]
    Compress(std::io::Error),
    #[error("encryption failure")]
    Crypto,
    #[error("encoding: {0}")]
    Json(#[from] serde_json::Error),
    #[error("a garbage collection is running on this repository (locks/gc); try again later")]
    GcRunning,
    #[error(
        "chunk {id} was removed by a concurrent garbage collection while this backup ran; \
         run the backup again"
    )]
    ChunkCollected { id: String },
    #[error("task: {0}")]
    Task(String),
}
