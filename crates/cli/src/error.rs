//! The CLI's error type; [`CliError`]'s Display is what the user sees.

/// Everything a verb can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// No usable kubeconfig / server.
    #[error("{0}")]
    Config(String),
    /// The server answered with an error: printed as kubectl does,
    /// `Error from server (Reason): message`.
    #[error("Error from server ({reason}): {message}")]
    Server {
        code: u16,
        reason: String,
        message: String,
    },
    #[error("{0}")]
    Transport(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl CliError {
    /// From a server's HTTP status and body (a metav1.Status when it is one).
    pub fn from_response(code: u16, body: &str) -> CliError {
        let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
        let reason = v["reason"]
            .as_str()
            .filter(|s| !s.is_empty())
            .map(String::from);
        let message = v["message"]
            .as_str()
            .map(String::from)
            .unwrap_or_else(|| body.trim().to_string());
        CliError::Server {
            code,
            reason: reason.unwrap_or_else(|| format!("HTTP {code}")),
            message,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_errors_read_like_kubectl() {
        let e = CliError::from_response(
            404,
            r#"{"kind":"Status","reason":"NotFound","message":"virtualmachines.kubevirt.io \"x\" not found"}"#,
        );
        assert_eq!(
            e.to_string(),
            "Error from server (NotFound): virtualmachines.kubevirt.io \"x\" not found"
        );
        let e = CliError::from_response(502, "bad gateway");
        assert_eq!(e.to_string(), "Error from server (HTTP 502): bad gateway");
    }
}
