//! The launcher's one error type, shared by the QMP, guest-agent, console and process modules.

use std::time::Duration;

/// Everything that can go wrong while launching or driving a VM.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O operation failed; `context` says which one.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// Something did not happen within its deadline.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: String, after: Duration },
    /// QEMU or the guest agent answered a command with an error object.
    #[error("command {command} failed: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    /// The peer spoke something that is not the expected protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The connection was closed (for QMP usually: QEMU exited).
    #[error("connection closed")]
    Disconnected,
    /// A JSON value could not be encoded or decoded.
    #[error("JSON error: {0}")]
    Json(#[from] serde_json::Error),
    /// QEMU exited before it became usable (its stderr tail is attached).
    #[error("QEMU exited ({status}) before it was ready: {stderr}")]
    QemuExited { status: String, stderr: String },
    /// The launch spec cannot be turned into a working command line.
    #[error("invalid launch spec: {0}")]
    InvalidSpec(String),
    /// A block migration step could not be carried out (the VM keeps its own disks).
    #[error("block migration: {0}")]
    BlockMigration(String),
    /// A live-migration step could not be carried out (the source keeps running).
    #[error("migration: {0}")]
    Migration(String),
    /// A console pattern is not a valid regular expression.
    #[error("invalid pattern: {0}")]
    Pattern(#[from] regex::Error),
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn timeout(what: impl Into<String>, after: Duration) -> Self {
        Error::Timeout {
            what: what.into(),
            after,
        }
    }

    /// True for errors that mean the peer is gone (socket closed or reset).
    pub fn is_disconnect(&self) -> bool {
        match self {
            Error::Disconnected => true,
            Error::Io { source, .. } => matches!(
                source.kind(),
                std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::UnexpectedEof
            ),
            _ => false,
        }
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
