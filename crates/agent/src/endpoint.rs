//! The agent's HTTPS endpoint, called by the API server's virt-api subresources (see
//! [`crate::proxy`]): lifecycle requests (`POST /vmis/{uid}/pause|unpause|softreboot|reset`) and
//! guest-agent data (`GET /vmis/{uid}/guestinfo`) forwarded to the VMI's launcher, and console /
//! VNC streams (`GET /vmis/{uid}/console|vnc` with an HTTP/1.1 `Upgrade: ferrovirt-stream`, after
//! which the connection carries the raw bytes of the VMI's `serial.sock` / `vnc.sock`), and
//! port forwards (`GET /vmis/{uid}/portforward/{port}`, upgraded the same way, carrying a TCP
//! connection to the guest's port: see [`crate::portforward`]); and, for the controllers, the
//! node's local volumes (`/storage/volumes/...`: see [`crate::nodestore`]); and, for
//! Prometheus, the VMI metrics of this node (`GET /metrics`: see [`crate::metrics`]), and
//! `GET /healthz` (`ok`); both also through the API server's Node proxy ([`crate::proxy::node`]).
//!
//! It is served over TLS with the agent's self-signed certificate ([`crate::tls`]), whose
//! SHA-256 the agent publishes on its Node next to the `https://` URL; the API server pins it.
//! Every request must also carry `Authorization: Bearer <the agent's API token>`; anything else
//! is answered 401, except that `/metrics` and `/healthz` also take another bearer token that
//! the API server vouches for ([`crate::delegated`]: TokenReview, then SubjectAccessReview of
//! `nodes/metrics`), answered 401 or 403 otherwise. Errors are JSON
//! `{"code": N, "message": "..."}`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use ferrovirt_launcher::control::{LauncherClient, Request as LauncherRequest, RunPhase};
use http::{StatusCode, header};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixStream};

use crate::error::AgentError;
use crate::launchers::{CONTROL_TIMEOUT, LauncherConfig};
use crate::tls::{AgentCert, constant_time_eq};

/// The `Upgrade` protocol name of console / VNC streams between the API server and the agent.
pub const STREAM_PROTOCOL: &str = "ferrovirt-stream";

/// How long a guest-agent query may take (the launcher talks to QEMU's guest agent).
const GUEST_INFO_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a lifecycle request may take.
const ACTION_TIMEOUT: Duration = Duration::from_secs(15);

/// A lifecycle request for a running VMI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmiAction {
    Pause,
    Unpause,
    SoftReboot,
    Reset,
    /// Freeze the guest's filesystems, held until `unfreeze` or the unfreeze timeout
    /// (`?unfreezeTimeoutSeconds=`, default [`DEFAULT_UNFREEZE_TIMEOUT`]).
    Freeze,
    Unfreeze,
}

/// KubeVirt's default for a freeze without `unfreezeTimeout`: 5 minutes.
pub const DEFAULT_UNFREEZE_TIMEOUT: Duration = Duration::from_secs(300);

impl VmiAction {
    /// The action named by a URL segment.
    pub fn parse(s: &str) -> Option<VmiAction> {
        Some(match s {
            "pause" => VmiAction::Pause,
            "unpause" => VmiAction::Unpause,
            "softreboot" => VmiAction::SoftReboot,
            "reset" => VmiAction::Reset,
            "freeze" => VmiAction::Freeze,
            "unfreeze" => VmiAction::Unfreeze,
            _ => return None,
        })
    }

    /// The URL segment.
    pub fn as_str(self) -> &'static str {
        match self {
            VmiAction::Pause => "pause",
            VmiAction::Unpause => "unpause",
            VmiAction::SoftReboot => "softreboot",
            VmiAction::Reset => "reset",
            VmiAction::Freeze => "freeze",
            VmiAction::Unfreeze => "unfreeze",
        }
    }

    /// The launcher request; `hold` is a freeze's unfreeze timeout.
    fn request(self, hold: Duration) -> LauncherRequest {
        match self {
            VmiAction::Pause => LauncherRequest::Pause,
            VmiAction::Unpause => LauncherRequest::Unpause,
            VmiAction::SoftReboot => LauncherRequest::SoftReboot,
            VmiAction::Reset => LauncherRequest::Reset,
            VmiAction::Freeze => LauncherRequest::Freeze {
                unfreeze_timeout_seconds: hold.as_secs().max(1),
            },
            VmiAction::Unfreeze => LauncherRequest::Unfreeze,
        }
    }

    /// Whether the action makes sense in the launcher's phase; `Err` is the conflict message.
    pub fn check(self, phase: RunPhase) -> Result<(), &'static str> {
        match (self, phase) {
            (_, RunPhase::Starting | RunPhase::ShuttingDown | RunPhase::Exited) => {
                Err("VMI is not running")
            }
            (VmiAction::Pause, RunPhase::Paused) => Err("VMI is already paused"),
            (VmiAction::Unpause, RunPhase::Running) => Err("VMI is not paused"),
            (VmiAction::SoftReboot | VmiAction::Freeze, RunPhase::Paused) => Err("VMI is paused"),
            _ => Ok(()),
        }
    }
}

/// The query of `POST /vmis/{uid}/{action}`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ActionQuery {
    /// A freeze's unfreeze timeout.
    unfreeze_timeout_seconds: Option<u64>,
}

/// A byte stream the endpoint can attach to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// The serial console (`serial.sock`).
    Console,
    /// The VNC display (`vnc.sock`).
    Vnc,
}

impl StreamKind {
    /// The stream named by a URL segment.
    pub fn parse(s: &str) -> Option<StreamKind> {
        match s {
            "console" => Some(StreamKind::Console),
            "vnc" => Some(StreamKind::Vnc),
            _ => None,
        }
    }

    /// The URL segment.
    pub fn as_str(self) -> &'static str {
        match self {
            StreamKind::Console => "console",
            StreamKind::Vnc => "vnc",
        }
    }

    /// The unix socket's file name in the VMI directory.
    pub fn socket_file(self) -> &'static str {
        match self {
            StreamKind::Console => "serial.sock",
            StreamKind::Vnc => "vnc.sock",
        }
    }
}

/// Whether `uid` is safe to use as a directory name (a Kubernetes UID: letters, digits, `-`).
pub fn valid_uid(uid: &str) -> bool {
    !uid.is_empty()
        && uid.len() <= 128
        && uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// The bearer token presented in an `Authorization` header value.
pub fn bearer_token(value: &str) -> Option<&str> {
    value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .map(str::trim)
}

/// An error answer of the endpoint.
fn error(code: StatusCode, message: impl Into<String>) -> Response {
    let body = json!({"code": code.as_u16(), "message": message.into()});
    (code, axum::Json(body)).into_response()
}

/// The HTTP status for a launcher error.
fn launcher_error(e: &ferrovirt_launcher::Error) -> StatusCode {
    match e {
        ferrovirt_launcher::Error::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
        ferrovirt_launcher::Error::InvalidSpec(_) => StatusCode::CONFLICT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// Who the endpoint lets in.
#[derive(Debug, Default)]
pub struct EndpointAuth {
    /// The agent's API token, the API server's credential for every route. None: every
    /// request it would be needed for is refused (the agent was not given its token).
    pub token: Option<String>,
    /// The token the API server derived for this node ([`crate::tls::endpoint_token`]),
    /// given to a joined node that holds no API token.
    pub node_token: Option<String>,
    /// The client CA of a joined node: the endpoint verifies client certificates against it,
    /// and `node_token` opens a route only on a connection that presented the API server's
    /// client certificate ([`crate::tls::is_server_certificate`]).
    pub client_ca: Option<String>,
    /// Other bearer tokens on the scrape routes, reviewed with the API server.
    pub delegated: Option<Arc<crate::delegated::DelegatedAuth>>,
}

impl From<Option<String>> for EndpointAuth {
    fn from(token: Option<String>) -> EndpointAuth {
        EndpointAuth {
            token,
            node_token: None,
            client_ca: None,
            delegated: None,
        }
    }
}

struct EndpointState {
    cfg: LauncherConfig,
    /// This node's name (the `node` label of the metrics).
    node: String,
    auth: EndpointAuth,
}

/// The endpoint's routes (without a listener; tests serve it themselves).
pub fn router(cfg: LauncherConfig, node: &str, auth: impl Into<EndpointAuth>) -> Router {
    let storage = crate::nodestore::server::router(cfg.data_dir.clone());
    let st = Arc::new(EndpointState {
        cfg,
        node: node.to_string(),
        auth: auth.into(),
    });
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/vmis/{uid}/{op}", get(get_op).post(post_op))
        .route("/vmis/{uid}/portforward/{port}", get(port_forward))
        .with_state(st.clone())
        .merge(storage)
        .layer(axum::middleware::from_fn_with_state(st, authenticate))
}

/// A running endpoint.
#[derive(Debug)]
pub struct Endpoint {
    /// `https://ADDR:PORT`, published on the Node.
    pub url: String,
    /// SHA-256 of the served certificate (lower-case hex), published on the Node.
    pub fingerprint: String,
    pub task: tokio::task::JoinHandle<()>,
}

/// Binds `listen` and serves the endpoint of node `node` over TLS with `cert`. `advertise` is
/// the host put into the URL when the listener is bound to an unspecified address.
pub async fn serve(
    listen: SocketAddr,
    advertise: &str,
    node: &str,
    cfg: LauncherConfig,
    auth: impl Into<EndpointAuth>,
    cert: &AgentCert,
) -> Result<Endpoint, AgentError> {
    let auth = auth.into();
    if auth.token.is_none() && auth.node_token.is_none() {
        tracing::warn!("the agent has no API token: its endpoint refuses every request");
    }
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| AgentError::io(listen.to_string(), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| AgentError::io(listen.to_string(), e))?;
    let url = endpoint_url(addr, advertise);
    let fingerprint = cert.fingerprint_hex();
    let acceptor =
        tokio_rustls::TlsAcceptor::from(cert.server_config_with(auth.client_ca.as_deref())?);
    let app = router(cfg, node, auth);
    // The same accept loop as the API server's: connection caps, handshake and header-read
    // timeouts (until the task is aborted).
    let task = tokio::spawn(ferrovirt_serve::serve(
        "agent endpoint",
        listener,
        acceptor,
        app,
        ferrovirt_serve::Limits::default(),
        std::future::pending(),
    ));
    tracing::info!(%url, sha256 = %fingerprint, "agent endpoint listening");
    Ok(Endpoint {
        url,
        fingerprint,
        task,
    })
}

/// The URL of an endpoint bound to `addr`.
pub fn endpoint_url(addr: SocketAddr, advertise: &str) -> String {
    if addr.ip().is_unspecified() {
        let host = match advertise.parse::<std::net::IpAddr>() {
            Ok(std::net::IpAddr::V6(_)) => format!("[{advertise}]"),
            _ => advertise.to_string(),
        };
        format!("https://{host}:{}", addr.port())
    } else {
        format!("https://{addr}")
    }
}

async fn authenticate(State(st): State<Arc<EndpointState>>, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token);
    let Some(p) = presented else {
        return error(StatusCode::UNAUTHORIZED, "Unauthorized");
    };
    // The API server's credential: the token derived for this node
    // ([`crate::tls::endpoint_token`]; the API token itself is still accepted from local
    // callers that hold it).
    if let Some(t) = st.auth.token.as_deref()
        && (constant_time_eq(p.as_bytes(), t.as_bytes())
            || constant_time_eq(
                p.as_bytes(),
                crate::tls::endpoint_token(t, &st.node).as_bytes(),
            ))
    {
        return next.run(req).await;
    }
    if let Some(t) = st.auth.node_token.as_deref()
        && constant_time_eq(p.as_bytes(), t.as_bytes())
    {
        // A joined node: the token alone is not enough, the connection must also have
        // presented the API server's client certificate (mutual TLS).
        let server_cert = req
            .extensions()
            .get::<ferrovirt_serve::PeerCertificate>()
            .is_some_and(|c| crate::tls::is_server_certificate(&c.0));
        if st.auth.client_ca.is_some() && !server_cert {
            tracing::warn!("endpoint: the server's token without the server's client certificate");
            return error(
                StatusCode::UNAUTHORIZED,
                "Unauthorized: this endpoint requires the API server's client certificate \
                 (CN=system:ferrovirt-server) with its token",
            );
        }
        return next.run(req).await;
    }
    // A scraper's own token (Prometheus with a ServiceAccount), vouched for by the API server.
    let scrape = crate::delegated::scrape_subresource(req.uri().path())
        .filter(|_| req.method() == http::Method::GET);
    if let (Some(sub), Some(d)) = (scrape, st.auth.delegated.as_ref()) {
        return match d.check(p, sub).await {
            Ok(crate::delegated::Decision::Allowed) => next.run(req).await,
            Ok(crate::delegated::Decision::Forbidden(msg)) => error(StatusCode::FORBIDDEN, msg),
            Ok(crate::delegated::Decision::Unauthenticated) => {
                error(StatusCode::UNAUTHORIZED, "Unauthorized")
            }
            Err(e) => {
                tracing::warn!("cannot review a scrape token: {e}");
                error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the API server could not review the token",
                )
            }
        };
    }
    error(StatusCode::UNAUTHORIZED, "Unauthorized")
}

/// `GET /metrics`: this node's VMI metrics in the Prometheus text format.
async fn metrics(State(st): State<Arc<EndpointState>>) -> Response {
    let samples = crate::metrics::collect::collect(&st.cfg).await;
    let body = crate::metrics::render(&st.node, &samples);
    ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], body).into_response()
}

async fn connect(st: &EndpointState, uid: &str) -> Result<LauncherClient, Response> {
    if !valid_uid(uid) {
        return Err(error(
            StatusCode::BAD_REQUEST,
            format!("invalid VMI uid {uid:?}"),
        ));
    }
    LauncherClient::connect(&st.cfg.vmi_dir(uid), CONTROL_TIMEOUT)
        .await
        .map_err(|e| {
            tracing::debug!(%uid, "no launcher: {e}");
            error(
                StatusCode::CONFLICT,
                format!("VMI {uid} is not running on this node"),
            )
        })
}

async fn post_op(
    State(st): State<Arc<EndpointState>>,
    Path((uid, op)): Path<(String, String)>,
    axum::extract::Query(q): axum::extract::Query<ActionQuery>,
    body: axum::body::Bytes,
) -> Response {
    if op == "exec" {
        return guest_exec(&st, &uid, &body).await;
    }
    let Some(action) = VmiAction::parse(&op) else {
        return error(StatusCode::NOT_FOUND, format!("unknown action {op:?}"));
    };
    let mut client = match connect(&st, &uid).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let status = match client.status().await {
        Ok(s) => s,
        Err(e) => return error(launcher_error(&e), e.to_string()),
    };
    if let Err(msg) = action.check(status.phase) {
        return error(StatusCode::CONFLICT, msg);
    }
    if action == VmiAction::Freeze && !status.guest_agent_connected {
        return error(StatusCode::CONFLICT, "guest agent is not connected");
    }
    let hold = q
        .unfreeze_timeout_seconds
        .map_or(DEFAULT_UNFREEZE_TIMEOUT, Duration::from_secs);
    // A freeze may take the guest agent up to its own bound.
    let timeout = match action {
        VmiAction::Freeze | VmiAction::Unfreeze => ACTION_TIMEOUT * 4,
        _ => ACTION_TIMEOUT,
    };
    match client
        .request_with_timeout(&action.request(hold), timeout)
        .await
    {
        Ok(_) => {
            tracing::info!(%uid, action = action.as_str(), "VMI action done");
            (StatusCode::OK, axum::Json(json!({}))).into_response()
        }
        Err(e) => error(launcher_error(&e), e.to_string()),
    }
}

/// `POST /vmis/{uid}/exec` `{"command": [path, args…], "timeoutSeconds": n}`: runs the
/// command in the guest through its guest agent (a backup's pre/post commands; the API
/// server's credential only — no subresource exposes it). Replies the launcher's
/// `ExecDone`; 409 when the VMI is not running or its guest agent is not connected, 400 for
/// an empty command.
async fn guest_exec(st: &EndpointState, uid: &str, body: &[u8]) -> Response {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct ExecRequest {
        command: Vec<String>,
        timeout_seconds: u64,
    }
    let req: ExecRequest = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("exec request: {e}")),
    };
    if req.command.first().is_none_or(|p| !p.starts_with('/')) {
        return error(
            StatusCode::BAD_REQUEST,
            "command: the first element must be an absolute path",
        );
    }
    let mut client = match connect(st, uid).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let status = match client.status().await {
        Ok(s) => s,
        Err(e) => return error(launcher_error(&e), e.to_string()),
    };
    if status.phase != RunPhase::Running {
        return error(StatusCode::CONFLICT, "VMI is not running");
    }
    if !status.guest_agent_connected {
        return error(StatusCode::CONFLICT, "guest agent is not connected");
    }
    let timeout = Duration::from_secs(req.timeout_seconds.clamp(1, 120));
    let launcher_req = LauncherRequest::GuestExec {
        command: req.command,
        timeout_seconds: timeout.as_secs(),
    };
    match client
        .request_with_timeout(&launcher_req, timeout + Duration::from_secs(10))
        .await
    {
        Ok(v) => (StatusCode::OK, axum::Json(v)).into_response(),
        Err(e) => error(launcher_error(&e), e.to_string()),
    }
}

async fn get_op(
    State(st): State<Arc<EndpointState>>,
    Path((uid, op)): Path<(String, String)>,
    req: Request,
) -> Response {
    if op == "guestinfo" {
        return guest_info(&st, &uid).await;
    }
    match StreamKind::parse(&op) {
        Some(kind) => stream(&st, &uid, kind, req).await,
        None => error(StatusCode::NOT_FOUND, format!("unknown resource {op:?}")),
    }
}

async fn guest_info(st: &EndpointState, uid: &str) -> Response {
    let mut client = match connect(st, uid).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    match client
        .request_with_timeout(&LauncherRequest::GuestInfo, GUEST_INFO_TIMEOUT)
        .await
    {
        Ok(v) => (StatusCode::OK, axum::Json(v)).into_response(),
        // Typically: the guest agent is not (yet) connected.
        Err(e) => error(StatusCode::CONFLICT, format!("guest agent: {e}")),
    }
}

async fn stream(st: &EndpointState, uid: &str, kind: StreamKind, req: Request) -> Response {
    if !valid_uid(uid) {
        return error(StatusCode::BAD_REQUEST, format!("invalid VMI uid {uid:?}"));
    }
    if !wants_stream(&req) {
        return error(
            StatusCode::BAD_REQUEST,
            format!("{} needs Upgrade: {STREAM_PROTOCOL}", kind.as_str()),
        );
    }
    let path = st.cfg.vmi_dir(uid).join(kind.socket_file());
    let sock = match UnixStream::connect(&path).await {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!("connecting to {}: {e}", path.display());
            return error(
                StatusCode::CONFLICT,
                format!("VMI {uid} has no {} on this node", kind.as_str()),
            );
        }
    };
    upgrade_and_pump(req, sock, format!("{uid} {}", kind.as_str()))
}

/// `GET /vmis/{uid}/portforward/{port}` (`Upgrade: ferrovirt-stream`): the connection carries
/// the bytes of a new TCP connection to the guest's port.
async fn port_forward(
    State(st): State<Arc<EndpointState>>,
    Path((uid, port)): Path<(String, String)>,
    req: Request,
) -> Response {
    if !valid_uid(&uid) {
        return error(StatusCode::BAD_REQUEST, format!("invalid VMI uid {uid:?}"));
    }
    if !wants_stream(&req) {
        return error(
            StatusCode::BAD_REQUEST,
            format!("portforward needs Upgrade: {STREAM_PROTOCOL}"),
        );
    }
    let port = match crate::portforward::parse_port(&port, None) {
        Ok(p) => p,
        Err(msg) => return error(StatusCode::BAD_REQUEST, msg),
    };
    match crate::portforward::dial(&st.cfg, &uid, port).await {
        Ok(conn) => {
            tracing::info!(%uid, port, "port forward");
            upgrade_and_pump(req, conn, format!("{uid} port {port}"))
        }
        Err((code, msg)) => error(code, msg),
    }
}

fn wants_stream(req: &Request) -> bool {
    req.headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(STREAM_PROTOCOL))
}

/// Answers 101 and, once the connection is upgraded, pumps it to and from `conn`.
fn upgrade_and_pump<S>(mut req: Request, conn: S, label: String) -> Response
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Some(on_upgrade) = req.extensions_mut().remove::<hyper::upgrade::OnUpgrade>() else {
        return error(StatusCode::BAD_REQUEST, "the connection cannot be upgraded");
    };
    tokio::spawn(async move {
        match on_upgrade.await {
            Ok(up) => {
                pump(TokioIo::new(up), conn).await;
                tracing::debug!(stream = %label, "stream closed");
            }
            Err(e) => tracing::warn!(stream = %label, "upgrade failed: {e}"),
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "Upgrade")
        .header(header::UPGRADE, STREAM_PROTOCOL)
        .body(Body::empty())
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "building the response"))
}

/// Copies bytes both ways until either side closes (then both are dropped).
pub async fn pump<A, B>(a: A, b: B)
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let (mut ar, mut aw) = tokio::io::split(a);
    let (mut br, mut bw) = tokio::io::split(b);
    tokio::select! {
        _ = tokio::io::copy(&mut ar, &mut bw) => {}
        _ = tokio::io::copy(&mut br, &mut aw) => {}
    }
}

/// Parses an endpoint error body (`{"code", "message"}`), falling back to the raw text.
pub fn error_message(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("message").and_then(Value::as_str).map(String::from))
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_actions_and_streams() {
        for a in [
            VmiAction::Pause,
            VmiAction::Unpause,
            VmiAction::SoftReboot,
            VmiAction::Reset,
        ] {
            assert_eq!(VmiAction::parse(a.as_str()), Some(a));
        }
        assert_eq!(VmiAction::parse("stop"), None);
        assert_eq!(StreamKind::parse("console"), Some(StreamKind::Console));
        assert_eq!(StreamKind::parse("vnc").unwrap().socket_file(), "vnc.sock");
        assert_eq!(StreamKind::Console.socket_file(), "serial.sock");
        assert_eq!(StreamKind::parse("spice"), None);
    }

    #[test]
    fn actions_are_checked_against_the_phase() {
        use RunPhase::*;
        assert_eq!(VmiAction::Pause.check(Running), Ok(()));
        assert_eq!(VmiAction::Pause.check(Paused), Err("VMI is already paused"));
        assert_eq!(VmiAction::Unpause.check(Paused), Ok(()));
        assert_eq!(VmiAction::Unpause.check(Running), Err("VMI is not paused"));
        assert_eq!(VmiAction::SoftReboot.check(Paused), Err("VMI is paused"));
        assert_eq!(VmiAction::Reset.check(Paused), Ok(()));
        for a in [VmiAction::Pause, VmiAction::Reset] {
            for p in [Starting, ShuttingDown, Exited] {
                assert_eq!(a.check(p), Err("VMI is not running"));
            }
        }
    }

    #[test]
    fn uids_and_tokens() {
        assert!(valid_uid("3f2a1b9c-0d4e-4f6a-8b7c-1d2e3f4a5b6c"));
        assert!(!valid_uid(""));
        assert!(!valid_uid("../etc"));
        assert!(!valid_uid("a/b"));
        assert_eq!(bearer_token("Bearer abc "), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
    }

    #[test]
    fn urls_and_error_bodies() {
        let a: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        assert_eq!(endpoint_url(a, "10.0.0.1"), "https://127.0.0.1:4000");
        let u: SocketAddr = "0.0.0.0:4000".parse().unwrap();
        assert_eq!(endpoint_url(u, "10.0.0.1"), "https://10.0.0.1:4000");
        assert_eq!(endpoint_url(u, "fd00::1"), "https://[fd00::1]:4000");
        assert_eq!(
            error_message(br#"{"code":409,"message":"VMI is not paused"}"#),
            "VMI is not paused"
        );
        assert_eq!(error_message(b" oops\n"), "oops");
    }

    fn tmp_cfg(dir: &std::path::Path) -> LauncherConfig {
        LauncherConfig {
            binary: "ferrovirt".into(),
            data_dir: dir.to_path_buf(),
            qemu_binary: "qemu-system-x86_64".into(),
        }
    }

    async fn start(token: Option<&str>, dir: &std::path::Path) -> Endpoint {
        let cert = crate::tls::load_or_create(dir, &[]).unwrap();
        serve(
            "127.0.0.1:0".parse().unwrap(),
            "127.0.0.1",
            "node1",
            tmp_cfg(dir),
            token.map(String::from),
            &cert,
        )
        .await
        .unwrap()
    }

    /// A TLS connection to the endpoint, pinning the fingerprint it publishes.
    async fn connect_tls(ep: &Endpoint) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
        let target = crate::tls::transport(&ep.url, Some(&ep.fingerprint)).unwrap();
        let tcp = tokio::net::TcpStream::connect(&target.authority)
            .await
            .unwrap();
        crate::tls::connect(tcp, &target.host, target.pin.unwrap())
            .await
            .unwrap()
    }

    /// One raw HTTP/1.1 exchange over TLS; returns the status line and the rest.
    async fn raw(ep: &Endpoint, request: &str) -> (String, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = connect_tls(ep).await;
        s.write_all(request.as_bytes()).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
        let (status, rest) = text.split_once("\r\n").unwrap_or((&text, ""));
        (status.to_string(), rest.to_string())
    }

    #[tokio::test]
    async fn refuses_requests_without_the_token() {
        let dir = tempfile::tempdir().unwrap();
        let ep = start(Some("secret"), dir.path()).await;
        let (st, _) = raw(
            &ep,
            "POST /vmis/abc/pause HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
        )
        .await;
        assert!(st.contains(" 401 "), "{st}");
        let (st, _) = raw(
            &ep,
            "POST /vmis/abc/pause HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\nContent-Length: 0\r\n\r\n",
        )
        .await;
        assert!(st.contains(" 401 "), "{st}");
        // A token-less agent refuses everyone.
        let ep2 = start(None, dir.path()).await;
        let (st, _) = raw(
            &ep2,
            "POST /vmis/abc/pause HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \r\nContent-Length: 0\r\n\r\n",
        )
        .await;
        assert!(st.contains(" 401 "), "{st}");
        ep.task.abort();
        ep2.task.abort();
    }

    #[tokio::test]
    async fn metrics_need_the_token() {
        let dir = tempfile::tempdir().unwrap();
        let ep = start(Some("t"), dir.path()).await;
        let (st, _) = raw(&ep, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(st.contains(" 401 "), "{st}");
        let (st, rest) = raw(
            &ep,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\n\r\n",
        )
        .await;
        assert!(st.contains(" 200 "), "{st}");
        assert!(rest.contains("text/plain; version=0.0.4"), "{rest}");
        // No VMI on this node: no series.
        assert!(!rest.contains("kubevirt_vmi_info"), "{rest}");
        ep.task.abort();
    }

    #[tokio::test]
    async fn missing_launchers_and_bad_requests() {
        let dir = tempfile::tempdir().unwrap();
        let ep = start(Some("t"), dir.path()).await;
        let auth = "Authorization: Bearer t\r\n";
        let (st, rest) = raw(
            &ep,
            &format!("POST /vmis/abc/pause HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 0\r\n\r\n"),
        )
        .await;
        assert!(st.contains(" 409 "), "{st}");
        assert!(rest.contains("not running on this node"), "{rest}");
        let (st, _) = raw(
            &ep,
            &format!(
                "POST /vmis/abc/explode HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 0\r\n\r\n"
            ),
        )
        .await;
        assert!(st.contains(" 404 "), "{st}");
        let (st, _) = raw(
            &ep,
            &format!("GET /vmis/abc/console HTTP/1.1\r\nHost: x\r\n{auth}\r\n"),
        )
        .await;
        assert!(st.contains(" 400 "), "{st}");
        ep.task.abort();
    }

    #[tokio::test]
    async fn streams_bytes_of_the_unix_socket() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tempfile::tempdir().unwrap();
        let vmi = dir.path().join("vmis").join("u1");
        std::fs::create_dir_all(&vmi).unwrap();
        // A fake QEMU serial socket that greets and echoes.
        let listener = tokio::net::UnixListener::bind(vmi.join("serial.sock")).unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            s.write_all(b"hello\n").await.unwrap();
            let mut buf = [0u8; 64];
            let n = s.read(&mut buf).await.unwrap();
            s.write_all(&buf[..n]).await.unwrap();
        });
        let ep = start(Some("t"), dir.path()).await;
        let mut s = connect_tls(&ep).await;
        s.write_all(
            format!(
                "GET /vmis/u1/console HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\nConnection: Upgrade\r\nUpgrade: {STREAM_PROTOCOL}\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        let mut got = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !String::from_utf8_lossy(&got).contains("hello\n") {
            let mut buf = [0u8; 256];
            let n = tokio::time::timeout_at(deadline, s.read(&mut buf))
                .await
                .unwrap()
                .unwrap();
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        let text = String::from_utf8_lossy(&got).into_owned();
        assert!(text.starts_with("HTTP/1.1 101"), "{text}");
        s.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&buf, b"ping");
        ep.task.abort();
    }

    #[tokio::test]
    async fn serves_tls_only_with_the_published_certificate() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tempfile::tempdir().unwrap();
        let ep = start(Some("t"), dir.path()).await;
        assert!(ep.url.starts_with("https://127.0.0.1:"), "{}", ep.url);
        let on_disk = crate::tls::load_or_create(dir.path(), &[]).unwrap();
        assert_eq!(ep.fingerprint, on_disk.fingerprint_hex());
        let target = crate::tls::transport(&ep.url, Some(&ep.fingerprint)).unwrap();
        // Another certificate's fingerprint is refused during the handshake.
        let other = crate::tls::AgentCert::generate(&["127.0.0.1".into()]).unwrap();
        let tcp = tokio::net::TcpStream::connect(&target.authority)
            .await
            .unwrap();
        let err = crate::tls::connect(tcp, &target.host, other.fingerprint())
            .await
            .unwrap_err();
        assert!(crate::tls::is_pin_mismatch(&err), "{err}");
        // Plain HTTP gets no HTTP answer.
        let mut s = tokio::net::TcpStream::connect(&target.authority)
            .await
            .unwrap();
        s.write_all(b"GET /vmis/abc/guestinfo HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 256];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap_or(0);
        assert!(!String::from_utf8_lossy(&buf[..n]).contains("HTTP/1.1"));
        ep.task.abort();
    }
}
