//! The CLI's error type; [`CliError`]'s Display is what the user sees (kubectl's wording).

/// One field problem of a 422 Invalid answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cause {
    pub field: String,
    pub message: String,
}

/// An error answer of the server: printed as kubectl does, `Error from server (Reason):
/// message`, or for 422 with causes `The Kind "name" is invalid: field: message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerError {
    pub code: u16,
    pub reason: String,
    pub message: String,
    pub kind: String,
    pub name: String,
    pub causes: Vec<Cause>,
}

impl std::fmt::Display for ServerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&server_text(
            self.code,
            &self.reason,
            &self.message,
            &self.kind,
            &self.name,
            &self.causes,
        ))
    }
}

/// Everything a verb can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// No usable kubeconfig / server.
    #[error("{0}")]
    Config(String),
    /// The server answered with an error (see [`ServerError`]).
    #[error("{0}")]
    Server(Box<ServerError>),
    /// Errors already printed (several objects failed): only the exit code is left.
    #[error("")]
    Reported,
    /// A usage or local problem, printed as `error: ...`.
    #[error("error: {0}")]
    Usage(String),
    #[error("{0}")]
    Transport(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

fn server_text(
    code: u16,
    reason: &str,
    message: &str,
    kind: &str,
    name: &str,
    causes: &[Cause],
) -> String {
    if code == 422 && !causes.is_empty() && !kind.is_empty() {
        let lines: Vec<String> = causes
            .iter()
            .map(|c| {
                if c.field.is_empty() {
                    c.message.clone()
                } else {
                    format!("{}: {}", c.field, c.message)
                }
            })
            .collect();
        let body = if lines.len() == 1 {
            lines[0].clone()
        } else {
            lines.iter().map(|l| format!("\n* {l}")).collect::<String>()
        };
        return format!("The {kind} \"{name}\" is invalid: {body}");
    }
    format!("Error from server ({reason}): {message}")
}

impl CliError {
    /// A server error without details.
    pub fn server(code: u16, reason: impl Into<String>, message: impl Into<String>) -> CliError {
        CliError::Server(Box::new(ServerError {
            code,
            reason: reason.into(),
            message: message.into(),
            kind: String::new(),
            name: String::new(),
            causes: Vec::new(),
        }))
    }

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
        let d = &v["details"];
        let causes = d["causes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| Cause {
                field: c["field"].as_str().unwrap_or_default().into(),
                message: c["message"].as_str().unwrap_or_default().into(),
            })
            .collect();
        CliError::Server(Box::new(ServerError {
            code,
            reason: reason.unwrap_or_else(|| format!("HTTP {code}")),
            message,
            kind: d["kind"].as_str().unwrap_or_default().into(),
            name: d["name"].as_str().unwrap_or_default().into(),
            causes,
        }))
    }

    /// From a kube-rs client error.
    pub fn from_kube(e: kube::Error) -> CliError {
        match e {
            kube::Error::Api(s) => {
                let (kind, name, causes) = match &s.details {
                    Some(d) => (
                        d.kind.clone(),
                        d.name.clone(),
                        d.causes
                            .iter()
                            .map(|c| Cause {
                                field: c.field.clone(),
                                message: c.message.clone(),
                            })
                            .collect(),
                    ),
                    None => Default::default(),
                };
                let reason = if s.reason.is_empty() {
                    format!("HTTP {}", s.code)
                } else {
                    s.reason.clone()
                };
                CliError::Server(Box::new(ServerError {
                    code: s.code,
                    reason,
                    message: s.message.clone(),
                    kind,
                    name,
                    causes,
                }))
            }
            other => CliError::Transport(other.to_string()),
        }
    }

    /// Whether this is the server's 404.
    pub fn is_not_found(&self) -> bool {
        matches!(self, CliError::Server(e) if e.code == 404)
    }

    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> CliError {
        CliError::Io {
            context: context.into(),
            source,
        }
    }
}

impl From<kube::Error> for CliError {
    fn from(e: kube::Error) -> Self {
        CliError::from_kube(e)
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
        assert!(e.is_not_found());
        let e = CliError::from_response(502, "bad gateway");
        assert_eq!(e.to_string(), "Error from server (HTTP 502): bad gateway");
    }

    #[test]
    fn invalid_lists_field_paths() {
        let body = r#"{"reason":"Invalid","message":"m","details":{"kind":"VirtualMachine","name":"v",
            "causes":[{"field":"spec.a","message":"Required value"},{"field":"spec.b","message":"Invalid value: 3"}]}}"#;
        let e = CliError::from_response(422, body);
        assert_eq!(
            e.to_string(),
            "The VirtualMachine \"v\" is invalid: \n* spec.a: Required value\n* spec.b: Invalid value: 3"
        );
        let body = r#"{"reason":"Invalid","message":"m","details":{"kind":"VirtualMachine","name":"v",
            "causes":[{"field":"spec.a","message":"Required value"}]}}"#;
        assert_eq!(
            CliError::from_response(422, body).to_string(),
            "The VirtualMachine \"v\" is invalid: spec.a: Required value"
        );
    }
}
