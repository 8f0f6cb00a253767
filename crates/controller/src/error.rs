//! The controllers' error type.

/// Why a controller (or the whole controller manager) stopped or a reconcile failed.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// A request to the API server failed.
    #[error("API request failed: {0}")]
    Kube(#[from] kube::Error),
    /// A watch stream failed.
    #[error("watch failed: {0}")]
    Watch(#[from] kube::runtime::watcher::Error),
    /// An object could not be converted to or from JSON.
    #[error("JSON conversion failed: {0}")]
    Json(#[from] serde_json::Error),
    /// An object lacks a field the controller needs.
    #[error("{kind} is missing {field}")]
    MissingField {
        kind: &'static str,
        field: &'static str,
    },
    /// The system random number generator failed (export tokens).
    #[error("the system random number generator failed")]
    Randomness,
    /// A storage operation on a node or here failed (retried).
    #[error("{0}")]
    Storage(String),
    /// A controller task ended unexpectedly.
    #[error("controller {name} stopped: {reason}")]
    TaskStopped { name: &'static str, reason: String },
}
