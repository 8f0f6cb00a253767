//! The agent's error type.

/// Everything that can go wrong in the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The VMI asks for something this node cannot provide; the message names the field.
    #[error("{field}: {message}")]
    Unsupported { field: String, message: String },
    /// The VMI spec is inconsistent (admission should have caught it).
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    /// A referenced object (PVC, PV, Secret, ConfigMap) is missing or unusable.
    #[error("{0}")]
    Reference(String),
    #[error("I/O on {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// An external tool (qemu-img, genisoimage) failed.
    #[error("{tool} failed: {message}")]
    Tool { tool: String, message: String },
    #[error(transparent)]
    Launcher(#[from] ferrovirt_launcher::Error),
    /// The endpoint's certificate or TLS configuration ([`crate::tls`]).
    #[error("endpoint TLS: {0}")]
    Tls(String),
    /// Joining the cluster with a join token ([`crate::join`]).
    #[error("joining the cluster: {0}")]
    Join(String),
    /// A bad agent setting (the message names the flag).
    #[error("{0}")]
    Config(String),
    /// A containerDisk image could not be pulled (Kubernetes' ErrImagePull).
    #[error("failed to pull image {image}: {message}")]
    ImagePull { image: String, message: String },
}

impl AgentError {
    /// The reason written on the VMI and its Event when starting it fails.
    pub fn reason(&self) -> &'static str {
        match self {
            AgentError::ImagePull { .. } => "ErrImagePull",
            _ => "SyncFailed",
        }
    }
    pub(crate) fn io(path: impl AsRef<std::path::Path>, source: std::io::Error) -> Self {
        AgentError::Io {
            path: path.as_ref().display().to_string(),
            source,
        }
    }
    pub(crate) fn unsupported(field: impl Into<String>, message: impl Into<String>) -> Self {
        AgentError::Unsupported {
            field: field.into(),
            message: message.into(),
        }
    }
    pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        AgentError::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
}
