//! Error types: [`ApiError`], every failed request as a metav1.Status (reason, code, details,
//! causes) with kubectl-style messages, and [`ServerError`] for start-up failures.

use axum::response::{IntoResponse, Response};
use ferrovirt_api::admission::Invalid;
use ferrovirt_api::registry::ResourceDef;
use ferrovirt_store::StoreError;
use http::StatusCode;
use serde_json::{Value, json};

/// Failure to start or run the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("i/o error on {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("TLS setup failed: {0}")]
    Tls(String),
    #[error("store error: {0}")]
    Store(#[from] StoreError),
    #[error("invalid configuration: {0}")]
    Config(String),
}

impl ServerError {
    pub(crate) fn io(path: impl std::fmt::Display, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_string(),
            source,
        }
    }
}

/// A request failure, rendered as a metav1.Status.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{code} {reason}: {message}")]
pub struct ApiError {
    pub code: u16,
    /// metav1.StatusReason, e.g. `NotFound`.
    pub reason: &'static str,
    pub message: String,
    /// metav1.StatusDetails, when known.
    pub details: Option<Value>,
}

/// `plural.group` as kubectl prints resources (`virtualmachines.kubevirt.io`, `configmaps`).
pub fn qualified(def: &ResourceDef) -> String {
    if def.group.is_empty() {
        def.plural.to_string()
    } else {
        format!("{}.{}", def.plural, def.group)
    }
}

fn details(def: &ResourceDef, name: &str, kind: &str) -> Value {
    json!({"name": name, "group": def.group, "kind": kind})
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    pub fn unauthorized() -> Self {
        Self::new(401, "Unauthorized", "Unauthorized")
    }

    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(403, "Forbidden", message)
    }

    /// A path the server does not serve.
    pub fn path_not_found() -> Self {
        Self::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )
    }

    pub fn not_found(def: &ResourceDef, name: &str) -> Self {
        Self {
            details: Some(details(def, name, def.plural)),
            ..Self::new(
                404,
                "NotFound",
                format!("{} {name:?} not found", qualified(def)),
            )
        }
    }

    pub fn method_not_allowed(method: &str) -> Self {
        Self::new(
            405,
            "MethodNotAllowed",
            format!("the server does not allow this method on the requested resource ({method})"),
        )
    }

    pub fn already_exists(def: &ResourceDef, name: &str) -> Self {
        Self {
            details: Some(details(def, name, def.plural)),
            ..Self::new(
                409,
                "AlreadyExists",
                format!("{} {name:?} already exists", qualified(def)),
            )
        }
    }

    pub fn conflict(def: &ResourceDef, name: &str, why: &str) -> Self {
        Self {
            details: Some(details(def, name, def.plural)),
            ..Self::new(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on {} {name:?}: {why}",
                    qualified(def)
                ),
            )
        }
    }

    /// 409 for a stale `resourceVersion`.
    pub fn stale(def: &ResourceDef, name: &str) -> Self {
        Self::conflict(
            def,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    pub fn gone(message: impl Into<String>) -> Self {
        Self::new(410, "Gone", message)
    }

    /// 410 Expired, for compacted resource versions and continue tokens.
    pub fn expired(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(
            413,
            "RequestEntityTooLarge",
            format!("Request entity too large: limit is {limit}"),
        )
    }

    pub fn unsupported_media_type(ct: &str) -> Self {
        Self::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json (got {ct:?})"
            ),
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "InternalError", message)
    }

    /// 422 Invalid with one cause per field problem.
    pub fn invalid(def: &ResourceDef, name: &str, causes: Vec<(String, String, String)>) -> Self {
        let parts: Vec<String> = causes.iter().map(|(_, f, m)| format!("{f}: {m}")).collect();
        let summary = if parts.len() == 1 {
            parts[0].clone()
        } else {
            format!("[{}]", parts.join(", "))
        };
        let causes: Vec<Value> = causes
            .into_iter()
            .map(|(reason, field, message)| json!({"reason": reason, "message": message, "field": field}))
            .collect();
        let mut d = details(def, name, def.kind);
        d["causes"] = Value::Array(causes);
        Self {
            details: Some(d),
            ..Self::new(
                422,
                "Invalid",
                format!("{} {name:?} is invalid: {summary}", def.kind),
            )
        }
    }

    /// 422 from admission.
    pub fn from_invalid(def: &ResourceDef, name: &str, inv: Invalid) -> Self {
        let causes = inv
            .0
            .into_iter()
            .map(|e| (e.reason.to_string(), e.field, e.message))
            .collect();
        Self::invalid(def, name, causes)
    }

    /// 422 for a single field.
    pub fn invalid_field(def: &ResourceDef, name: &str, field: &str, message: String) -> Self {
        Self::invalid(
            def,
            name,
            vec![("FieldValueInvalid".into(), field.into(), message)],
        )
    }

    /// Maps store errors that handlers do not treat specially.
    pub fn from_store(e: StoreError) -> Self {
        match e {
            StoreError::Compacted {
                requested,
                compacted,
            } => Self::expired(format!(
                "too old resource version: {requested} ({compacted})"
            )),
            other => Self::internal(other.to_string()),
        }
    }

    /// The metav1.Status body.
    pub fn status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(d) = &self.details {
            s["details"] = d.clone();
        }
        s
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_vec(&self.status()).unwrap_or_default();
        let mut resp = (code, body).into_response();
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        resp
    }
}
