//! The audit log (`--audit-log-path`): one JSON line per request in Kubernetes'
//! `audit.k8s.io/v1` Event format, written when the response starts (stage `ResponseComplete`,
//! `ResponseStarted` for watches and upgraded streams). Levels: `Metadata` (who, what, when,
//! the answer's code) and `Request` (also the request body as `requestObject`, for JSON bodies
//! within the body limit). Secret bodies are never written, at any level: a Secret (or
//! anything under `secrets`) is logged at Metadata. [`event`] is pure.

use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

use serde_json::{Value, json};

use crate::auth::rbac::{Attributes, UserInfo};

/// How much of a request is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Metadata,
    Request,
}

impl std::str::FromStr for Level {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "Metadata" => Ok(Level::Metadata),
            "Request" => Ok(Level::Request),
            other => Err(format!(
                "audit level {other:?} is not supported (Metadata, Request)"
            )),
        }
    }
}

/// The open log.
pub struct AuditLog {
    pub level: Level,
    file: Mutex<std::fs::File>,
}

impl AuditLog {
    /// Opens (creates, 0600) `path` for appending.
    pub fn open(path: &Path, level: Level) -> std::io::Result<AuditLog> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)?;
        Ok(AuditLog {
            level,
            file: Mutex::new(file),
        })
    }

    /// Appends one event as a line.
    pub fn write(&self, ev: &Value) {
        let mut line = serde_json::to_vec(ev).unwrap_or_default();
        line.push(b'\n');
        let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = f.write_all(&line) {
            tracing::warn!("audit log: {e}");
        }
    }
}

/// Whether a request's body may be written at level Request: never for Secrets.
pub fn may_log_body(a: &Attributes) -> bool {
    a.resource_request && a.resource != "secrets"
}

/// What the event says about one request.
pub struct Request<'a> {
    pub audit_id: &'a str,
    pub method: &'a str,
    pub uri: &'a str,
    pub user_agent: &'a str,
    pub source_ip: &'a str,
    pub received: &'a str,
    pub completed: &'a str,
    pub long_running: bool,
}

/// The `audit.k8s.io/v1` Event for one request (`user` None: not authenticated).
pub fn event(
    level: Level,
    r: &Request<'_>,
    user: Option<&UserInfo>,
    a: &Attributes,
    code: u16,
    body: Option<&Value>,
) -> Value {
    let mut ev = json!({
        "kind": "Event",
        "apiVersion": "audit.k8s.io/v1",
        "level": match level { Level::Metadata => "Metadata", Level::Request => "Request" },
        "auditID": r.audit_id,
        "stage": if r.long_running { "ResponseStarted" } else { "ResponseComplete" },
        "requestURI": r.uri,
        "verb": a.verb,
        "user": match user {
            Some(u) => json!({"username": u.name, "uid": u.uid, "groups": u.groups}),
            None => json!({}),
        },
        "sourceIPs": if r.source_ip.is_empty() { json!([]) } else { json!([r.source_ip]) },
        "userAgent": r.user_agent,
        "responseStatus": {"metadata": {}, "code": code},
        "requestReceivedTimestamp": r.received,
        "stageTimestamp": r.completed,
    });
    if a.resource_request {
        let mut obj = json!({"resource": a.resource, "apiGroup": a.api_group});
        for (k, v) in [
            ("namespace", &a.namespace),
            ("name", &a.name),
            ("subresource", &a.subresource),
        ] {
            if !v.is_empty() {
                obj[k] = json!(v);
            }
        }
        ev["objectRef"] = obj;
    }
    if level == Level::Request
        && may_log_body(a)
        && let Some(b) = body
    {
        ev["requestObject"] = b.clone();
    }
    let _ = r.method;
    ev
}

/// Runs the request through authentication, authorization and its handler ([`crate::auth::check`])
/// and writes its event. At level Request a JSON body with a Content-Length within the body
/// limit is read first (never a Secret's).
pub(crate) async fn around(
    sh: &crate::server::Shared,
    log: &AuditLog,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let received = crate::timefmt::now_rfc3339();
    let a = crate::auth::attrs::of_request(req.method(), req.uri().path(), req.uri().query());
    let method = req.method().as_str().to_string();
    let uri = req.uri().to_string();
    // The headers are read in a block: a borrow of the request (its body is not Sync) must
    // not live across an await.
    let (user_agent, upgrade, length, json_body) = {
        let header = |name: http::header::HeaderName| {
            req.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string()
        };
        (
            header(http::header::USER_AGENT),
            !header(http::header::UPGRADE).is_empty(),
            header(http::header::CONTENT_LENGTH).parse::<usize>().ok(),
            header(http::header::CONTENT_TYPE).contains("json"),
        )
    };
    let mut req = req;
    let mut body = None;
    if log.level == Level::Request
        && may_log_body(&a)
        && json_body
        && length.is_some_and(|n| n > 0 && n <= sh.max_body)
    {
        let (parts, b) = req.into_parts();
        let read =
            tokio::time::timeout(sh.body_timeout, axum::body::to_bytes(b, sh.max_body)).await;
        let bytes = match read {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(_)) => {
                return crate::error::ApiError::new(
                    413,
                    "RequestEntityTooLarge",
                    "the request body is too large",
                )
                .into_response();
            }
            Err(_) => {
                return crate::error::ApiError::new(
                    408,
                    "Timeout",
                    "the request body was not sent in time",
                )
                .into_response();
            }
        };
        body = serde_json::from_slice::<Value>(&bytes).ok();
        req = axum::extract::Request::from_parts(parts, axum::body::Body::from(bytes));
    }
    let resp = crate::auth::check(sh, req, next).await;
    let user = resp.extensions().get::<std::sync::Arc<UserInfo>>().cloned();
    let completed = crate::timefmt::now_rfc3339();
    let audit_id = uuid::Uuid::new_v4().to_string();
    let r = Request {
        audit_id: &audit_id,
        method: &method,
        uri: &uri,
        user_agent: &user_agent,
        source_ip: "",
        received: &received,
        completed: &completed,
        long_running: a.verb == "watch" || upgrade,
    };
    log.write(&event(
        log.level,
        &r,
        user.as_deref(),
        &a,
        resp.status().as_u16(),
        body.as_ref(),
    ));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(resource: &str) -> Attributes {
        Attributes {
            verb: "create".into(),
            resource_request: true,
            resource: resource.into(),
            namespace: "a".into(),
            ..Default::default()
        }
    }

    #[test]
    fn events_have_kubernetes_shape_and_never_secret_bodies() {
        let r = Request {
            audit_id: "id",
            method: "POST",
            uri: "/api/v1/namespaces/a/configmaps",
            user_agent: "kubectl",
            source_ip: "127.0.0.1",
            received: "t0",
            completed: "t1",
            long_running: false,
        };
        let u = UserInfo {
            name: "bob".into(),
            uid: String::new(),
            groups: vec!["dev".into()],
        };
        let body = json!({"data": {"k": "v"}});
        let ev = event(
            Level::Request,
            &r,
            Some(&u),
            &attrs("configmaps"),
            201,
            Some(&body),
        );
        assert_eq!(ev["apiVersion"], "audit.k8s.io/v1");
        assert_eq!(ev["objectRef"]["resource"], "configmaps");
        assert_eq!(ev["objectRef"]["namespace"], "a");
        assert_eq!(ev["user"]["username"], "bob");
        assert_eq!(ev["responseStatus"]["code"], 201);
        assert_eq!(ev["requestObject"], body);
        let ev = event(
            Level::Request,
            &r,
            Some(&u),
            &attrs("secrets"),
            201,
            Some(&body),
        );
        assert!(ev.get("requestObject").is_none());
        let ev = event(
            Level::Metadata,
            &r,
            Some(&u),
            &attrs("configmaps"),
            201,
            Some(&body),
        );
        assert!(ev.get("requestObject").is_none());
    }
}
