//! The API server side of KubeVirt's virt-api subresources (`subresources.kubevirt.io/v1`),
//! served through `ferrovirt_apiserver::ServerOptions::extra_routes` behind the server's
//! bearer-token authentication:
//!
//! - VMI `pause`, `unpause`, `softreboot`, `reset` (PUT), `guestosinfo`, `userlist`,
//!   `filesystemlist` (GET): the VMI must be Running on a node; the call is forwarded to that
//!   node's agent endpoint ([`crate::endpoint`], found in the Node's
//!   [`ENDPOINT_ANNOTATION`]), and guest-agent data is converted to KubeVirt's shapes.
//!
//! Agent connections are HTTPS pinned to the certificate fingerprint the agent published on its
//! Node ([`FINGERPRINT_ANNOTATION`], see [`crate::tls`]); a different certificate is answered
//! 502. Nodes of agents without TLS (http URL, no fingerprint) are reached over plain HTTP only
//! on loopback addresses. Requests carry the server's bearer token in both cases.
//! - VMI `console`, `vnc` (GET, websocket, subprotocol `plain.kubevirt.io`): binary frames are
//!   pumped to and from the agent's upgraded raw stream of the VMI's unix socket.
//! - VMI and VM `portforward/{port}[/tcp]` (GET, websocket, `plain.kubevirt.io`): one TCP
//!   connection to the guest's port per websocket, opened by the node's agent
//!   ([`crate::portforward`]); the VM form forwards to the VMI of the same name.
//! - VM `start`, `stop`, `restart` (PUT): a pure decision ([`plan_vm`]) turns the VM (and its
//!   VMI) into JSON patches (run strategy flip or `status.stateChangeRequests`) or a 409; the VM
//!   controller acts on the result.
//! - Discovery: `/apis/subresources.kubevirt.io` and `/apis/subresources.kubevirt.io/v1`.
//! - The Node subresource `GET /api/v1/nodes/{name}/proxy/{metrics|healthz}` ([`node`]): the
//!   agent's answer passed back; every other path refused 403.
//!
//! Errors are metav1.Status objects.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{FromRequestParts, Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use futures::{SinkExt, StreamExt};
use http::{Method, StatusCode, header};
use http_body_util::{BodyExt, Empty};
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::endpoint::{self, STREAM_PROTOCOL, StreamKind, VmiAction};
use crate::node::{ENDPOINT_ANNOTATION, FINGERPRINT_ANNOTATION};
use crate::tls;

/// The API group of KubeVirt's subresources.
pub const GROUP: &str = "subresources.kubevirt.io";
/// The websocket subprotocol KubeVirt's console and VNC streams speak.
pub const WS_PROTOCOL: &str = "plain.kubevirt.io";

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const AGENT_TIMEOUT: Duration = Duration::from_secs(45);
/// The largest answer body read from a node agent (guest info, file system and user lists are
/// guest-controlled); a larger one is refused with 502, never collected.
pub const MAX_AGENT_BODY: usize = 4 << 20;

/// A metav1.Status error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiErr {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
}

impl ApiErr {
    pub fn new(code: u16, message: impl Into<String>) -> ApiErr {
        let reason = match code {
            400 => "BadRequest",
            401 => "Unauthorized",
            403 => "Forbidden",
            404 => "NotFound",
            405 => "MethodNotAllowed",
            409 => "Conflict",
            503 => "ServiceUnavailable",
            504 => "Timeout",
            _ => "InternalError",
        };
        ApiErr {
            code,
            reason,
            message: message.into(),
        }
    }
    fn conflict(message: impl Into<String>) -> ApiErr {
        ApiErr::new(409, message)
    }
    fn not_found(plural: &str, name: &str) -> ApiErr {
        ApiErr::new(404, format!("{plural}.kubevirt.io \"{name}\" not found"))
    }

    /// The metav1.Status body.
    pub fn to_status(&self) -> Value {
        json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        })
    }
}

impl IntoResponse for ApiErr {
    fn into_response(self) -> Response {
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (code, axum::Json(self.to_status())).into_response()
    }
}

fn kube_err(e: kube::Error) -> ApiErr {
    match e {
        kube::Error::Api(s) => {
            let mut err = ApiErr::new(s.code, s.message);
            if s.code == 422 && err.message.contains("testing value") {
                // A JSON patch `test` failed: somebody changed the object meanwhile.
                err = ApiErr::conflict(err.message);
            }
            err
        }
        other => ApiErr::new(500, other.to_string()),
    }
}

/// What a subresource URL asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Vmi(VmiAction),
    Stream(StreamKind),
    GuestOsInfo,
    UserList,
    FilesystemList,
    Vm(VmVerb),
}

/// A VirtualMachine lifecycle verb.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmVerb {
    Start,
    Stop,
    Restart,
}

/// The subresources served: (resource, subresource, verb as in discovery).
const SUBRESOURCES: &[(&str, &str, &str)] = &[
    ("virtualmachineinstances", "console", "get"),
    ("virtualmachineinstances", "vnc", "get"),
    ("virtualmachineinstances", "pause", "update"),
    ("virtualmachineinstances", "unpause", "update"),
    ("virtualmachineinstances", "softreboot", "update"),
    ("virtualmachineinstances", "reset", "update"),
    ("virtualmachineinstances", "freeze", "update"),
    ("virtualmachineinstances", "unfreeze", "update"),
    ("virtualmachineinstances", "guestosinfo", "get"),
    ("virtualmachineinstances", "userlist", "get"),
    ("virtualmachineinstances", "filesystemlist", "get"),
    ("virtualmachineinstances", "portforward", "get"),
    ("virtualmachines", "portforward", "get"),
    ("virtualmachines", "start", "update"),
    ("virtualmachines", "stop", "update"),
    ("virtualmachines", "restart", "update"),
];

/// Parses `{resource}/{name}/{sub}` with the request method.
pub fn parse_op(resource: &str, sub: &str, method: &Method) -> Result<Op, ApiErr> {
    let Some(&(_, _, verb)) = SUBRESOURCES
        .iter()
        .find(|(r, s, _)| *r == resource && *s == sub)
    else {
        return Err(ApiErr::new(
            404,
            format!("the server could not find the requested resource ({resource}/{sub})"),
        ));
    };
    let method_ok = match verb {
        "get" => method == Method::GET,
        _ => method == Method::PUT,
    };
    if !method_ok {
        return Err(ApiErr::new(
            405,
            format!("{method} is not supported on {resource}/{sub}"),
        ));
    }
    let op = match (resource, sub) {
        ("virtualmachines", "start") => Op::Vm(VmVerb::Start),
        ("virtualmachines", "stop") => Op::Vm(VmVerb::Stop),
        ("virtualmachines", "restart") => Op::Vm(VmVerb::Restart),
        (_, "portforward") => {
            return Err(ApiErr::new(
                400,
                format!("{resource}/portforward needs a port: .../portforward/{{port}}[/tcp]"),
            ));
        }
        (_, "guestosinfo") => Op::GuestOsInfo,
        (_, "userlist") => Op::UserList,
        (_, "filesystemlist") => Op::FilesystemList,
        (_, s) => match (VmiAction::parse(s), StreamKind::parse(s)) {
            (Some(a), _) => Op::Vmi(a),
            (_, Some(k)) => Op::Stream(k),
            _ => return Err(ApiErr::new(404, format!("unknown subresource {s}"))),
        },
    };
    Ok(op)
}

/// `GET /apis/subresources.kubevirt.io/v1`.
pub fn resource_list() -> Value {
    let resources: Vec<Value> = SUBRESOURCES
        .iter()
        .map(|(r, s, verb)| {
            let kind = if *r == "virtualmachines" {
                "VirtualMachine"
            } else {
                "VirtualMachineInstance"
            };
            json!({"name": format!("{r}/{s}"), "singularName": "", "namespaced": true,
                   "kind": kind, "verbs": [verb]})
        })
        .collect();
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": format!("{GROUP}/v1"),
        "resources": resources,
    })
}

/// `GET /apis/subresources.kubevirt.io`.
pub fn api_group() -> Value {
    let v = json!({"groupVersion": format!("{GROUP}/v1"), "version": "v1"});
    json!({"kind": "APIGroup", "apiVersion": "v1", "name": GROUP, "versions": [v.clone()],
           "preferredVersion": v})
}

pub mod node;
mod plan;
mod portforward;
#[cfg(test)]
mod tests;

pub use plan::*;

pub(super) struct Ready {
    pub(super) client: Client,
    pub(super) token: String,
}

#[derive(Clone, Default)]
pub(super) struct ProxyState {
    ready: Arc<OnceLock<Ready>>,
}

impl ProxyState {
    pub(super) fn ready(&self) -> Result<&Ready, ApiErr> {
        self.ready
            .get()
            .ok_or_else(|| ApiErr::new(503, "the subresource API is starting"))
    }
}

/// Completes a [`deferred`] router: from now on it serves with this client and token.
#[derive(Clone)]
pub struct ProxyHandle(ProxyState);

impl std::fmt::Debug for ProxyHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyHandle")
            .field("ready", &self.0.ready.get().is_some())
            .finish()
    }
}

impl ProxyHandle {
    /// Sets the kube client (to the API server itself) and the token presented to agents.
    /// Later calls are ignored.
    pub fn set(&self, client: Client, token: String) {
        let _ = self.0.ready.set(Ready { client, token });
    }
}

/// The subresource routes, serving with `client` (a client of the API server these routes
/// are part of) and presenting `token` to node agents.
pub fn router(client: Client, token: String) -> Router {
    let (r, h) = deferred();
    h.set(client, token);
    r
}

/// The routes before their client exists: they answer 503 until [`ProxyHandle::set`]. This
/// solves the start-up order of the API server, whose kubeconfig (and so the client) exists
/// only once the server that must already hold these routes has started.
pub fn deferred() -> (Router, ProxyHandle) {
    let st = ProxyState::default();
    let base = format!("/apis/{GROUP}");
    let r = Router::new()
        .route(&base, get(|| async { axum::Json(api_group()) }))
        .route(
            &format!("{base}/v1"),
            get(|| async { axum::Json(resource_list()) }),
        )
        .route(
            &format!("{base}/v1/namespaces/{{ns}}/{{resource}}/{{name}}/{{sub}}"),
            any(dispatch),
        )
        .route(
            &format!("{base}/v1/namespaces/{{ns}}/{{resource}}/{{name}}/portforward/{{port}}"),
            get(portforward::handle),
        )
        .route(
            &format!(
                "{base}/v1/namespaces/{{ns}}/{{resource}}/{{name}}/portforward/{{port}}/{{protocol}}"
            ),
            get(portforward::handle_with_protocol),
        )
        // The Node proxy subresource (metrics only): see [`node`].
        .route("/api/v1/nodes/{name}/proxy", any(node::handle))
        .route("/api/v1/nodes/{name}/proxy/", any(node::handle))
        .route("/api/v1/nodes/{name}/proxy/{*path}", any(node::handle))
        .route(
            &format!("{base}/{{*rest}}"),
            any(|| async { ApiErr::new(404, "the server could not find the requested resource") }),
        )
        .with_state(st.clone());
    (r, ProxyHandle(st))
}

fn vmi_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstance"),
        "virtualmachineinstances",
    )
}

fn vm_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
        "virtualmachines",
    )
}

async fn get_object(
    client: &Client,
    ar: &ApiResource,
    ns: &str,
    name: &str,
) -> Result<Option<Value>, ApiErr> {
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, ar);
    let obj = api.get_opt(name).await.map_err(kube_err)?;
    obj.map(|o| serde_json::to_value(o).map_err(|e| ApiErr::new(500, e.to_string())))
        .transpose()
}

async fn dispatch(
    State(st): State<ProxyState>,
    Path((ns, resource, name, sub)): Path<(String, String, String, String)>,
    req: Request,
) -> Response {
    let op = match parse_op(&resource, &sub, req.method()) {
        Ok(op) => op,
        Err(e) => return e.into_response(),
    };
    let ready = match st.ready() {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let result = match op {
        Op::Vm(verb) => vm_verb(ready, &ns, &name, verb, req).await,
        Op::Stream(kind) => stream(ready, &ns, &name, kind, req).await,
        Op::Vmi(VmiAction::Freeze) => match freeze_hold(req).await {
            Ok(hold) => {
                vmi_call(
                    ready,
                    &ns,
                    &name,
                    op,
                    &format!("?unfreezeTimeoutSeconds={hold}"),
                )
                .await
            }
            Err(e) => Err(e),
        },
        _ => vmi_call(ready, &ns, &name, op, "").await,
    };
    result.unwrap_or_else(IntoResponse::into_response)
}

/// A node's agent endpoint as its Node publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct AgentAddr {
    /// The node's name (the endpoint token is derived for it).
    pub(super) node: String,
    /// [`ENDPOINT_ANNOTATION`].
    pub(super) url: String,
    /// [`FINGERPRINT_ANNOTATION`] (absent for agents without TLS).
    pub(super) fingerprint: Option<String>,
}

/// The running VMI `ns/name`, its uid and its node's agent endpoint.
pub(super) async fn locate(
    ready: &Ready,
    ns: &str,
    name: &str,
) -> Result<(Value, String, AgentAddr), ApiErr> {
    let vmi = get_object(&ready.client, &vmi_resource(), ns, name)
        .await?
        .ok_or_else(|| ApiErr::not_found("virtualmachineinstances", name))?;
    let (uid, node) = running_target(&vmi)?;
    let nodes: Api<Node> = Api::all(ready.client.clone());
    let n = nodes
        .get_opt(&node)
        .await
        .map_err(kube_err)?
        .ok_or_else(|| ApiErr::new(503, format!("node {node} of the VMI does not exist")))?;
    let annotation = |key: &str| {
        n.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(key))
            .filter(|u| !u.is_empty())
            .cloned()
    };
    let url = annotation(ENDPOINT_ANNOTATION)
        .ok_or_else(|| ApiErr::new(503, format!("node {node} publishes no agent endpoint")))?;
    let fingerprint = annotation(FINGERPRINT_ANNOTATION);
    Ok((
        vmi,
        uid,
        AgentAddr {
            node,
            url,
            fingerprint,
        },
    ))
}

/// The seconds a freeze is held from its body (KubeVirt's `{"unfreezeTimeout": "5m"}`, a Go
/// duration; absent or empty body: 5 minutes); 400 naming the field when it is not a
/// positive duration.
async fn freeze_hold(req: Request) -> Result<u64, ApiErr> {
    let body = axum::body::to_bytes(req.into_body(), 64 * 1024)
        .await
        .map_err(|e| ApiErr::new(400, format!("reading the request body: {e}")))?;
    unfreeze_timeout(&body)
}

/// [`freeze_hold`]'s decision (pure).
pub fn unfreeze_timeout(body: &[u8]) -> Result<u64, ApiErr> {
    let default = endpoint::DEFAULT_UNFREEZE_TIMEOUT.as_secs();
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(default);
    }
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiErr::new(400, format!("the request body is not JSON: {e}")))?;
    let t = match &v["unfreezeTimeout"] {
        Value::Null => return Ok(default),
        Value::String(t) => t,
        other => {
            return Err(ApiErr::new(
                400,
                format!("unfreezeTimeout: {other} is not a duration (e.g. \"5m\")"),
            ));
        }
    };
    let d = ferrovirt_api::kubevirt::snapshot::parse_go_duration(t)
        .map_err(|e| ApiErr::new(400, format!("unfreezeTimeout: {e}")))?;
    if d.as_secs() == 0 {
        return Err(ApiErr::new(
            400,
            "unfreezeTimeout: must be at least 1s (a freeze is never held without an end)",
        ));
    }
    Ok(d.as_secs())
}

async fn vmi_call(
    ready: &Ready,
    ns: &str,
    name: &str,
    op: Op,
    query: &str,
) -> Result<Response, ApiErr> {
    let (vmi, uid, url) = locate(ready, ns, name).await?;
    match op {
        Op::Vmi(action) => {
            let path = format!("/vmis/{uid}/{}{query}", action.as_str());
            agent_call(&url, Method::POST, &path, &ready.token).await?;
            Ok(StatusCode::OK.into_response())
        }
        _ => {
            check_agent_connected(&vmi)?;
            let body = agent_call(
                &url,
                Method::GET,
                &format!("/vmis/{uid}/guestinfo"),
                &ready.token,
            )
            .await?;
            let raw: Value = serde_json::from_slice(&body)
                .map_err(|e| ApiErr::new(500, format!("bad guest info from the agent: {e}")))?;
            let out = match op {
                Op::UserList => user_list(&raw),
                Op::FilesystemList => filesystem_list(&raw),
                _ => guest_agent_info(&raw),
            };
            Ok(axum::Json(out).into_response())
        }
    }
}

type AgentConn = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;

/// Connects to the agent at `addr`: TLS pinned to its published fingerprint, or plain HTTP
/// for a loopback agent that publishes none ([`tls::transport`]). Returns the request sender
/// and the authority to send as `Host`.
async fn agent_connect(addr: &AgentAddr) -> Result<(AgentConn, String), ApiErr> {
    let url = &addr.url;
    let target = tls::transport(url, addr.fingerprint.as_deref())
        .map_err(|e| ApiErr::new(503, e.to_string()))?;
    let unreachable = |e: String| ApiErr::new(503, format!("agent at {url} unreachable: {e}"));
    let connect = async {
        let tcp = tokio::net::TcpStream::connect(&target.authority)
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        let Some(pin) = target.pin else {
            return http1(tcp).await.map_err(|e| unreachable(e.to_string()));
        };
        let stream = tls::connect(tcp, &target.host, pin).await.map_err(|e| {
            if tls::is_pin_mismatch(&e) {
                ApiErr::new(
                    502,
                    format!(
                        "the certificate of the agent at {url} does not match its Node's \
                         {FINGERPRINT_ANNOTATION}"
                    ),
                )
            } else {
                unreachable(format!("TLS: {e}"))
            }
        })?;
        http1(stream).await.map_err(|e| unreachable(e.to_string()))
    };
    let send = tokio::time::timeout(CONNECT_TIMEOUT, connect)
        .await
        .map_err(|_| unreachable("timed out".into()))??;
    Ok((send, target.authority))
}

/// An HTTP/1.1 client connection (with upgrades) over `io`, driven by a background task.
async fn http1<I>(io: I) -> Result<AgentConn, hyper::Error>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!("agent connection: {e}");
        }
    });
    Ok(send)
}

fn agent_request(
    method: Method,
    authority: &str,
    path: &str,
    token: &str,
) -> http::request::Builder {
    http::Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, authority)
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
}

/// The error an agent's non-success answer becomes.
pub fn agent_error(status: u16, body: &[u8]) -> ApiErr {
    let msg = endpoint::error_message(body);
    match status {
        400 | 404 | 409 | 504 => ApiErr::new(status, msg),
        401 => ApiErr::new(500, "the node agent refused the server's credentials"),
        _ => ApiErr::new(500, msg),
    }
}

/// One request to an agent; the body of its 2xx answer.
async fn agent_call(
    url: &AgentAddr,
    method: Method,
    path: &str,
    token: &str,
) -> Result<Bytes, ApiErr> {
    let (mut send, authority) = agent_connect(url).await?;
    let req = agent_request(
        method,
        &authority,
        path,
        &tls::endpoint_token(token, &url.node),
    )
    .body(Empty::<Bytes>::new())
    .map_err(|e| ApiErr::new(500, e.to_string()))?;
    let exchange = async {
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| ApiErr::new(503, format!("agent request failed: {e}")))?;
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), MAX_AGENT_BODY)
            .collect()
            .await
            .map_err(|e| ApiErr::new(502, format!("agent answer: {e}")))?
            .to_bytes();
        Ok::<_, ApiErr>((status, body))
    };
    let (status, body) = tokio::time::timeout(AGENT_TIMEOUT, exchange)
        .await
        .map_err(|_| ApiErr::new(504, "the node agent did not answer in time"))??;
    if status.is_success() {
        Ok(body)
    } else {
        Err(agent_error(status.as_u16(), &body))
    }
}

/// Opens the agent's raw stream of the VMI's console or VNC socket.
pub(super) async fn agent_stream(
    url: &AgentAddr,
    path: &str,
    token: &str,
) -> Result<TokioIo<Upgraded>, ApiErr> {
    let (mut send, authority) = agent_connect(url).await?;
    let req = agent_request(
        Method::GET,
        &authority,
        path,
        &tls::endpoint_token(token, &url.node),
    )
    .header(header::CONNECTION, "Upgrade")
    .header(header::UPGRADE, STREAM_PROTOCOL)
    .body(Empty::<Bytes>::new())
    .map_err(|e| ApiErr::new(500, e.to_string()))?;
    let resp = tokio::time::timeout(AGENT_TIMEOUT, send.send_request(req))
        .await
        .map_err(|_| ApiErr::new(504, "the node agent did not answer in time"))?
        .map_err(|e| ApiErr::new(503, format!("agent request failed: {e}")))?;
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        let status = resp.status().as_u16();
        let body = http_body_util::Limited::new(resp.into_body(), MAX_AGENT_BODY)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        return Err(agent_error(status, &body));
    }
    let up = hyper::upgrade::on(resp)
        .await
        .map_err(|e| ApiErr::new(503, format!("agent stream: {e}")))?;
    Ok(TokioIo::new(up))
}

async fn stream(
    ready: &Ready,
    ns: &str,
    name: &str,
    kind: StreamKind,
    req: Request,
) -> Result<Response, ApiErr> {
    let (mut parts, _body) = req.into_parts();
    let ws = WebSocketUpgrade::from_request_parts(&mut parts, &())
        .await
        .map_err(|e| ApiErr::new(400, format!("{} needs a websocket: {e}", kind.as_str())))?;
    let (_, uid, url) = locate(ready, ns, name).await?;
    // Connect to the agent first, so that failures are answered as HTTP errors.
    let path = format!("/vmis/{uid}/{}", kind.as_str());
    let agent = agent_stream(&url, &path, &ready.token).await?;
    tracing::info!(%ns, %name, stream = kind.as_str(), "streaming");
    Ok(ws
        .protocols([WS_PROTOCOL])
        .on_upgrade(move |socket| pump_ws(socket, agent)))
}

/// Pumps websocket frames to and from the agent's raw stream until either side closes.
pub(super) async fn pump_ws(socket: WebSocket, agent: TokioIo<Upgraded>) {
    let (mut ar, mut aw) = tokio::io::split(agent);
    let (mut tx, mut rx) = socket.split();
    let up = async {
        while let Some(Ok(msg)) = rx.next().await {
            let data = match msg {
                Message::Binary(b) => b,
                Message::Text(t) => Bytes::copy_from_slice(t.as_str().as_bytes()),
                Message::Close(_) => break,
                Message::Ping(_) | Message::Pong(_) => continue,
            };
            if aw.write_all(&data).await.is_err() {
                break;
            }
        }
    };
    let down = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match ar.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let frame = Message::Binary(Bytes::copy_from_slice(&buf[..n]));
                    if tx.send(frame).await.is_err() {
                        return;
                    }
                }
            }
        }
        let _ = tx.send(Message::Close(None)).await;
    };
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

async fn vm_verb(
    ready: &Ready,
    ns: &str,
    name: &str,
    verb: VmVerb,
    req: Request,
) -> Result<Response, ApiErr> {
    let body = axum::body::to_bytes(req.into_body(), 64 * 1024)
        .await
        .map_err(|e| ApiErr::new(400, e.to_string()))?;
    let opts: VerbOptions = if body.iter().all(u8::is_ascii_whitespace) {
        VerbOptions::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiErr::new(400, format!("invalid request body: {e}")))?
    };
    let vm = get_object(&ready.client, &vm_resource(), ns, name)
        .await?
        .ok_or_else(|| ApiErr::not_found("virtualmachines", name))?;
    let vmi = get_object(&ready.client, &vmi_resource(), ns, name).await?;
    let plan = plan_vm(verb, &vm, vmi.as_ref(), &opts)?;
    let base = format!("/apis/kubevirt.io/v1/namespaces/{ns}");
    if let Some(p) = &plan.vmi_patch {
        json_patch(
            &ready.client,
            &format!("{base}/virtualmachineinstances/{name}"),
            p,
        )
        .await?;
    }
    if let Some(p) = &plan.vm_patch {
        json_patch(&ready.client, &format!("{base}/virtualmachines/{name}"), p).await?;
    }
    if let Some(p) = &plan.vm_status_patch {
        json_patch(
            &ready.client,
            &format!("{base}/virtualmachines/{name}/status"),
            p,
        )
        .await?;
    }
    Ok(StatusCode::ACCEPTED.into_response())
}

async fn json_patch(client: &Client, path: &str, patch: &Value) -> Result<(), ApiErr> {
    let req = http::Request::builder()
        .method(Method::PATCH)
        .uri(path)
        .header(header::CONTENT_TYPE, "application/json-patch+json")
        .body(serde_json::to_vec(patch).unwrap_or_default())
        .map_err(|e| ApiErr::new(500, e.to_string()))?;
    client
        .request::<Value>(req)
        .await
        .map(drop)
        .map_err(kube_err)
}
