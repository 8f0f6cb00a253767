//! The storage crate's error type.

use std::path::PathBuf;

/// Why a storage operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// A file operation failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// An external tool (qemu-img, gzip, xz) or the zstd decoder failed or could not be
    /// started.
    #[error("{tool} failed: {message}")]
    Tool { tool: String, message: String },
    /// The HTTP transfer failed.
    #[error("download of {url} failed: {message}")]
    Http { url: String, message: String },
    /// The request or source is invalid (bad URL, bad checksum syntax, bad header).
    #[error("invalid {what}: {message}")]
    Invalid { what: &'static str, message: String },
    /// The server's TLS certificate is not trusted (or the handshake failed): retrying does
    /// not help until the source or its `certConfigMap` changes.
    #[error("download of {url} failed: TLS: {message}")]
    Tls { url: String, message: String },
    /// The address policy refused a host of the transfer (SSRF defence): permanent until an
    /// administrator allows the range.
    #[error("download of {url} refused: {refusal}")]
    AddressRefused {
        url: String,
        refusal: crate::netpolicy::Refusal,
    },
    /// The downloaded data does not match the expected checksum.
    #[error("checksum mismatch: expected {expected}, got {actual}")]
    ChecksumMismatch { expected: String, actual: String },
    /// The image was refused (too large, backing file, unsupported format).
    #[error("image refused: {0}")]
    Refused(String),
    /// The volume is in use in a way that forbids the operation now (retried later).
    #[error("volume in use: {0}")]
    InUse(String),
}

impl StorageError {
    /// An [`StorageError::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        StorageError::Io {
            path: path.into(),
            source,
        }
    }

    /// Whether retrying cannot help: checksum mismatches, refused images, invalid sources,
    /// untrusted TLS certificates and refused addresses fail a population at once.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            StorageError::ChecksumMismatch { .. }
                | StorageError::Refused(_)
                | StorageError::Invalid { .. }
                | StorageError::Tls { .. }
                | StorageError::AddressRefused { .. }
        )
    }

    /// An [`StorageError::Invalid`].
    pub fn invalid(what: &'static str, message: impl Into<String>) -> Self {
        StorageError::Invalid {
            what,
            message: message.into(),
        }
    }
}
