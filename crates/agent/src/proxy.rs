//! The API server side of KubeVirt's virt-api subresources (`subresources.kubevirt.io/v1`),
//! served through `ferrovirt_apiserver::ServerOptions::extra_routes` behind the server's
//! bearer-token authentication:
//!
//! - VMI `pause`, `unpause`, `softreboot`, `reset` (PUT), `guestosinfo`, `userlist`,
//!   `filesystemlist` (GET): the VMI must be Running on a node; the call is forwarded to that
//!   node's agent endpoint ([`crate::endpoint`], found in the Node's
//!   [`ENDPOINT_ANNOTATION`]), and guest-agent data is converted to KubeVirt's shapes.
//! - VMI `console`, `vnc` (GET, websocket, subprotocol `plain.kubevirt.io`): binary frames are
//!   pumped to and from the agent's upgraded raw stream of the VMI's unix socket.
//! - VM `start`, `stop`, `restart` (PUT): a pure decision ([`plan_vm`]) turns the VM (and its
//!   VMI) into JSON patches (run strategy flip or `status.stateChangeRequests`) or a 409; the VM
//!   controller acts on the result.
//! - Discovery: `/apis/subresources.kubevirt.io` and `/apis/subresources.kubevirt.io/v1`.
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
use crate::node::ENDPOINT_ANNOTATION;

/// The API group of KubeVirt's subresources.
pub const GROUP: &str = "subresources.kubevirt.io";
/// The websocket subprotocol KubeVirt's console and VNC streams speak.
pub const WS_PROTOCOL: &str = "plain.kubevirt.io";

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const AGENT_TIMEOUT: Duration = Duration::from_secs(45);

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
    ("virtualmachineinstances", "guestosinfo", "get"),
    ("virtualmachineinstances", "userlist", "get"),
    ("virtualmachineinstances", "filesystemlist", "get"),
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

fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    path.iter().try_fold(v, |v, k| v.get(k))?.as_str()
}

fn has_condition(vmi: &Value, type_: &str) -> bool {
    vmi.pointer("/status/conditions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|c| {
            c.get("type").and_then(Value::as_str) == Some(type_)
                && c.get("status").and_then(Value::as_str) == Some("True")
        })
}

/// Where a running VMI lives: (uid, node name).
pub fn running_target(vmi: &Value) -> Result<(String, String), ApiErr> {
    let phase = str_at(vmi, &["status", "phase"]).unwrap_or("");
    let node = str_at(vmi, &["status", "nodeName"]).unwrap_or("");
    let uid = str_at(vmi, &["metadata", "uid"]).unwrap_or("");
    if phase != "Running" || node.is_empty() || uid.is_empty() {
        return Err(ApiErr::conflict("VMI is not running"));
    }
    Ok((uid.to_string(), node.to_string()))
}

/// KubeVirt answers guest-agent queries only while the agent is connected.
pub fn check_agent_connected(vmi: &Value) -> Result<(), ApiErr> {
    if has_condition(vmi, "AgentConnected") {
        Ok(())
    } else {
        Err(ApiErr::conflict("VMI does not have guest agent connected"))
    }
}

fn opt_str(v: &Value, keys: &[&str]) -> Value {
    keys.iter()
        .find_map(|k| v.get(*k).and_then(Value::as_str))
        .map(|s| Value::String(s.to_string()))
        .unwrap_or(Value::String(String::new()))
}

fn items(v: &Value, key: &str) -> Vec<Value> {
    v.get(key)
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// The launcher's `guestInfo` users → KubeVirt's VirtualMachineInstanceGuestOSUser items.
fn users(raw: &Value) -> Vec<Value> {
    items(raw, "users")
        .iter()
        .map(|u| {
            let mut o = json!({"userName": opt_str(u, &["user", "userName"])});
            if let Some(d) = u.get("domain").and_then(Value::as_str) {
                o["domain"] = json!(d);
            }
            if let Some(t) = u.get("login-time").or_else(|| u.get("loginTime")) {
                o["loginTime"] = t.clone();
            }
            o
        })
        .collect()
}

/// The launcher's `guestInfo` filesystems → KubeVirt's VirtualMachineInstanceFileSystem items.
fn filesystems(raw: &Value) -> Vec<Value> {
    items(raw, "filesystems")
        .iter()
        .map(|f| {
            let num = |a: &str, b: &str| f.get(a).or_else(|| f.get(b)).cloned().unwrap_or(json!(0));
            json!({
                "diskName": opt_str(f, &["name"]),
                "mountPoint": opt_str(f, &["mountpoint", "mountPoint"]),
                "fileSystemType": opt_str(f, &["type", "fileSystemType"]),
                "usedBytes": num("used-bytes", "usedBytes"),
                "totalBytes": num("total-bytes", "totalBytes"),
            })
        })
        .collect()
}

/// The launcher's `guestInfo` → KubeVirt's VirtualMachineInstanceGuestAgentInfo.
pub fn guest_agent_info(raw: &Value) -> Value {
    let os = raw.get("osInfo").cloned().unwrap_or(Value::Null);
    let field = |kebab: &str| opt_str(&os, &[kebab]);
    json!({
        "kind": "VirtualMachineInstanceGuestAgentInfo",
        "apiVersion": "kubevirt.io/v1",
        "guestAgentVersion": opt_str(raw, &["guestAgentVersion", "version"]),
        "hostname": opt_str(raw, &["hostname"]),
        "os": {
            "name": field("name"),
            "kernelRelease": field("kernel-release"),
            "version": field("version"),
            "prettyName": field("pretty-name"),
            "versionId": field("version-id"),
            "kernelVersion": field("kernel-version"),
            "machine": field("machine"),
            "id": field("id"),
        },
        "timezone": opt_str(raw, &["timezone"]),
        "userList": users(raw),
        "fsInfo": {"disks": filesystems(raw)},
    })
}

/// The launcher's `guestInfo` → KubeVirt's VirtualMachineInstanceUserList.
pub fn user_list(raw: &Value) -> Value {
    json!({"kind": "VirtualMachineInstanceUserList", "apiVersion": "kubevirt.io/v1",
           "metadata": {}, "items": users(raw)})
}

/// The launcher's `guestInfo` → KubeVirt's VirtualMachineInstanceFileSystemList.
pub fn filesystem_list(raw: &Value) -> Value {
    json!({"kind": "VirtualMachineInstanceFileSystemList", "apiVersion": "kubevirt.io/v1",
           "metadata": {}, "items": filesystems(raw)})
}

/// The VM's run strategy (`spec.runStrategy`, else the deprecated `spec.running`).
pub fn run_strategy(vm: &Value) -> String {
    if let Some(s) = str_at(vm, &["spec", "runStrategy"]) {
        return s.to_string();
    }
    match vm.pointer("/spec/running").and_then(Value::as_bool) {
        Some(true) => "Always".into(),
        _ => "Halted".into(),
    }
}

fn vmi_phase(vmi: &Value) -> &str {
    str_at(vmi, &["status", "phase"]).unwrap_or("")
}

fn is_final(vmi: &Value) -> bool {
    matches!(vmi_phase(vmi), "Succeeded" | "Failed")
}

/// The body of a start/stop/restart request (all fields optional).
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VerbOptions {
    /// stop: the grace period to stop with.
    pub grace_period: Option<i64>,
    /// restart: only 0 (force) is supported, as in KubeVirt.
    pub grace_period_seconds: Option<i64>,
    /// start: start the VMI paused.
    #[serde(default)]
    pub paused: bool,
}

/// What a VM verb writes: JSON patches (RFC 6902) for the VMI, the VM and the VM's status.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VmPlan {
    pub vmi_patch: Option<Value>,
    pub vm_patch: Option<Value>,
    pub vm_status_patch: Option<Value>,
}

/// The spec patch that flips the run strategy to Always (`running`) or Halted.
fn running_patch(vm: &Value, running: bool) -> Value {
    if let Some(s) = vm.pointer("/spec/runStrategy") {
        let to = if running { "Always" } else { "Halted" };
        json!([{"op": "test", "path": "/spec/runStrategy", "value": s},
               {"op": "replace", "path": "/spec/runStrategy", "value": to}])
    } else if let Some(r) = vm.pointer("/spec/running") {
        json!([{"op": "test", "path": "/spec/running", "value": r},
               {"op": "replace", "path": "/spec/running", "value": running}])
    } else {
        let to = if running { "Always" } else { "Halted" };
        json!([{"op": "add", "path": "/spec/runStrategy", "value": to}])
    }
}

/// The status patch that appends `changes` to `status.stateChangeRequests` (KubeVirt's rules:
/// onto an empty list; a lone Stop replaces pending requests; anything else is a conflict).
pub fn change_requests_patch(vm: &Value, changes: Vec<Value>) -> Result<Value, ApiErr> {
    let status = vm
        .get("status")
        .filter(|s| s.as_object().is_some_and(|o| !o.is_empty()));
    let Some(status) = status else {
        return Ok(json!([{"op": "add", "path": "/status",
                          "value": {"stateChangeRequests": changes}}]));
    };
    let mut ops = Vec::new();
    match status.get("stateChangeRequests") {
        None | Some(Value::Null) => {
            ops.push(json!({"op": "add", "path": "/status/stateChangeRequests", "value": changes}));
        }
        Some(existing) => {
            let empty = existing.as_array().is_none_or(Vec::is_empty);
            let lone_stop = changes.len() == 1 && changes[0]["action"] == "Stop";
            if !empty && !lone_stop {
                return Err(ApiErr::conflict(
                    "unable to complete request: stop/start already underway",
                ));
            }
            ops.push(
                json!({"op": "test", "path": "/status/stateChangeRequests", "value": existing}),
            );
            ops.push(
                json!({"op": "replace", "path": "/status/stateChangeRequests", "value": changes}),
            );
        }
    }
    if status.get("startFailure").is_some_and(|v| !v.is_null()) {
        ops.push(json!({"op": "remove", "path": "/status/startFailure"}));
    }
    Ok(Value::Array(ops))
}

fn grace_patch(vmi: &Value, grace: i64) -> Value {
    let mut ops = Vec::new();
    if let Some(old) = vmi.pointer("/spec/terminationGracePeriodSeconds") {
        ops.push(
            json!({"op": "test", "path": "/spec/terminationGracePeriodSeconds", "value": old}),
        );
    }
    ops.push(json!({"op": "add", "path": "/spec/terminationGracePeriodSeconds", "value": grace}));
    Value::Array(ops)
}

fn stop_request(vmi: &Value) -> Value {
    json!({"action": "Stop", "uid": str_at(vmi, &["metadata", "uid"]).unwrap_or("")})
}

/// KubeVirt's start/stop/restart semantics as a pure function of the VM, its VMI (same name,
/// if any) and the request body: the patches to write, or the error to answer.
pub fn plan_vm(
    verb: VmVerb,
    vm: &Value,
    vmi: Option<&Value>,
    opts: &VerbOptions,
) -> Result<VmPlan, ApiErr> {
    let strategy = run_strategy(vm);
    let active = vmi.filter(|v| !is_final(v));
    let mut plan = VmPlan::default();
    match verb {
        VmVerb::Start => {
            if active.is_some_and(|v| !matches!(vmi_phase(v), "" | "Unknown")) {
                return Err(ApiErr::conflict("VM is already running"));
            }
            let mut start = json!({"action": "Start"});
            if opts.paused {
                start["data"] = json!({"paused": "true"});
            }
            match strategy.as_str() {
                "Halted" if opts.paused => {
                    plan.vm_status_patch = Some(change_requests_patch(vm, vec![start])?);
                }
                "Halted" => plan.vm_patch = Some(running_patch(vm, true)),
                "Manual" | "RerunOnFailure" => {
                    let phase = vmi.map(vmi_phase).unwrap_or("");
                    if strategy == "RerunOnFailure" && phase == "Failed" {
                        return Err(ApiErr::conflict(
                            "RerunOnFailure does not support starting VM from failed state",
                        ));
                    }
                    let restart = match vmi {
                        Some(v) if strategy == "Manual" => is_final(v),
                        Some(_) => phase == "Succeeded",
                        None => false,
                    };
                    let changes = match vmi {
                        Some(v) if restart => vec![stop_request(v), start],
                        _ => vec![start],
                    };
                    plan.vm_status_patch = Some(change_requests_patch(vm, changes)?);
                }
                other => {
                    return Err(ApiErr::conflict(format!(
                        "{other} does not support manual start requests"
                    )));
                }
            }
        }
        VmVerb::Stop => {
            if let (Some(v), Some(g)) = (active, opts.grace_period) {
                if g < 0 {
                    return Err(ApiErr::new(
                        400,
                        "gracePeriod has to be greater or equal to 0",
                    ));
                }
                plan.vmi_patch = Some(grace_patch(v, g));
            }
            match strategy.as_str() {
                "Halted" | "Manual" | "RerunOnFailure" => {
                    let Some(v) = active else {
                        return Err(ApiErr::conflict("VM is not running"));
                    };
                    if strategy == "Halted" {
                        let old = v
                            .pointer("/spec/terminationGracePeriodSeconds")
                            .and_then(Value::as_i64);
                        let shorter = match (opts.grace_period, old) {
                            (None, _) => false,
                            (Some(g), Some(o)) => g < o,
                            (Some(_), None) => true,
                        };
                        if !shorter {
                            return Err(ApiErr::conflict(
                                "Halted only supports manual stop requests with a shorter graceperiod",
                            ));
                        }
                    }
                    plan.vm_status_patch = Some(change_requests_patch(vm, vec![stop_request(v)])?);
                }
                _ => plan.vm_patch = Some(running_patch(vm, false)),
            }
        }
        VmVerb::Restart => {
            match opts.grace_period_seconds {
                Some(g) if g > 0 => {
                    return Err(ApiErr::new(
                        400,
                        "For force restart, only gracePeriod=0 is supported for now",
                    ));
                }
                Some(g) if g < 0 => {
                    return Err(ApiErr::new(
                        400,
                        "gracePeriod has to be greater or equal to 0",
                    ));
                }
                _ => {}
            }
            if matches!(strategy.as_str(), "Halted" | "Once") {
                return Err(ApiErr::conflict(format!(
                    "RunStrategy {strategy} does not support manual restart requests"
                )));
            }
            let Some(v) = vmi else {
                return Err(ApiErr::conflict("VM is not running"));
            };
            if opts.grace_period_seconds == Some(0) && !is_final(v) {
                plan.vmi_patch = Some(grace_patch(v, 0));
            }
            let changes = vec![stop_request(v), json!({"action": "Start"})];
            plan.vm_status_patch = Some(change_requests_patch(vm, changes)?);
        }
    }
    Ok(plan)
}

// ---------------------------------------------------------------------------------------------
// The router.

struct Ready {
    client: Client,
    token: String,
}

#[derive(Clone, Default)]
struct ProxyState {
    ready: Arc<OnceLock<Ready>>,
}

impl ProxyState {
    fn ready(&self) -> Result<&Ready, ApiErr> {
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
        _ => vmi_call(ready, &ns, &name, op).await,
    };
    result.unwrap_or_else(IntoResponse::into_response)
}

/// The running VMI `ns/name`, its uid and its node's agent endpoint.
async fn locate(ready: &Ready, ns: &str, name: &str) -> Result<(Value, String, String), ApiErr> {
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
    let url = n
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ENDPOINT_ANNOTATION))
        .filter(|u| !u.is_empty())
        .cloned()
        .ok_or_else(|| ApiErr::new(503, format!("node {node} publishes no agent endpoint")))?;
    Ok((vmi, uid, url))
}

async fn vmi_call(ready: &Ready, ns: &str, name: &str, op: Op) -> Result<Response, ApiErr> {
    let (vmi, uid, url) = locate(ready, ns, name).await?;
    match op {
        Op::Vmi(action) => {
            let path = format!("/vmis/{uid}/{}", action.as_str());
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

async fn agent_connect(url: &str) -> Result<(AgentConn, String), ApiErr> {
    let authority = url
        .strip_prefix("http://")
        .unwrap_or(url)
        .trim_end_matches('/')
        .to_string();
    let unreachable = |e: String| ApiErr::new(503, format!("agent at {url} unreachable: {e}"));
    let tcp = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(&authority))
        .await
        .map_err(|_| unreachable("timed out".into()))?
        .map_err(|e| unreachable(e.to_string()))?;
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!("agent connection: {e}");
        }
    });
    Ok((send, authority))
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
async fn agent_call(url: &str, method: Method, path: &str, token: &str) -> Result<Bytes, ApiErr> {
    let (mut send, authority) = agent_connect(url).await?;
    let req = agent_request(method, &authority, path, token)
        .body(Empty::<Bytes>::new())
        .map_err(|e| ApiErr::new(500, e.to_string()))?;
    let exchange = async {
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| ApiErr::new(503, format!("agent request failed: {e}")))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| ApiErr::new(503, format!("agent answer: {e}")))?
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
async fn agent_stream(
    url: &str,
    uid: &str,
    kind: StreamKind,
    token: &str,
) -> Result<TokioIo<Upgraded>, ApiErr> {
    let (mut send, authority) = agent_connect(url).await?;
    let path = format!("/vmis/{uid}/{}", kind.as_str());
    let req = agent_request(Method::GET, &authority, &path, token)
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
        let body = resp
            .into_body()
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
    let agent = agent_stream(&url, &uid, kind, &ready.token).await?;
    tracing::info!(%ns, %name, stream = kind.as_str(), "streaming");
    Ok(ws
        .protocols([WS_PROTOCOL])
        .on_upgrade(move |socket| pump_ws(socket, agent)))
}

/// Pumps websocket frames to and from the agent's raw stream until either side closes.
async fn pump_ws(socket: WebSocket, agent: TokioIo<Upgraded>) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(phase: &str, conds: Value) -> Value {
        json!({"metadata": {"name": "v", "uid": "u-1"},
               "spec": {"terminationGracePeriodSeconds": 30},
               "status": {"phase": phase, "nodeName": "node1", "conditions": conds}})
    }

    #[test]
    fn parses_subresource_paths() {
        let vmis = "virtualmachineinstances";
        assert_eq!(
            parse_op(vmis, "pause", &Method::PUT),
            Ok(Op::Vmi(VmiAction::Pause))
        );
        assert_eq!(
            parse_op(vmis, "vnc", &Method::GET),
            Ok(Op::Stream(StreamKind::Vnc))
        );
        assert_eq!(
            parse_op(vmis, "console", &Method::GET),
            Ok(Op::Stream(StreamKind::Console))
        );
        assert_eq!(
            parse_op(vmis, "guestosinfo", &Method::GET),
            Ok(Op::GuestOsInfo)
        );
        assert_eq!(parse_op(vmis, "userlist", &Method::GET), Ok(Op::UserList));
        assert_eq!(
            parse_op("virtualmachines", "restart", &Method::PUT),
            Ok(Op::Vm(VmVerb::Restart))
        );
        assert_eq!(parse_op(vmis, "pause", &Method::GET).unwrap_err().code, 405);
        assert_eq!(parse_op(vmis, "start", &Method::PUT).unwrap_err().code, 404);
        assert_eq!(
            parse_op("pods", "exec", &Method::GET).unwrap_err().code,
            404
        );
        let names: Vec<String> = resource_list()["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap().to_string())
            .collect();
        assert!(names.contains(&"virtualmachineinstances/console".to_string()));
        assert!(names.contains(&"virtualmachines/stop".to_string()));
        assert_eq!(
            api_group()["preferredVersion"]["groupVersion"],
            "subresources.kubevirt.io/v1"
        );
    }

    #[test]
    fn errors_are_statuses() {
        let s = ApiErr::not_found("virtualmachineinstances", "x").to_status();
        assert_eq!(s["kind"], "Status");
        assert_eq!(s["status"], "Failure");
        assert_eq!(s["reason"], "NotFound");
        assert_eq!(s["code"], 404);
        assert_eq!(
            s["message"],
            "virtualmachineinstances.kubevirt.io \"x\" not found"
        );
        let e = agent_error(409, br#"{"code":409,"message":"VMI is already paused"}"#);
        assert_eq!(
            (e.code, e.reason, e.message.as_str()),
            (409, "Conflict", "VMI is already paused")
        );
        assert_eq!(agent_error(401, b"").code, 500);
    }

    #[test]
    fn targets_need_a_running_vmi() {
        assert_eq!(
            running_target(&vmi("Running", json!([]))),
            Ok(("u-1".into(), "node1".into()))
        );
        assert_eq!(
            running_target(&vmi("Scheduled", json!([])))
                .unwrap_err()
                .code,
            409
        );
        assert!(check_agent_connected(&vmi("Running", json!([]))).is_err());
        let c = json!([{"type": "AgentConnected", "status": "True"}]);
        assert!(check_agent_connected(&vmi("Running", c)).is_ok());
    }

    #[test]
    fn guest_info_in_kubevirt_shapes() {
        let raw = json!({
            "osInfo": {"name": "Ferrovirt", "kernel-release": "6.1.0", "version": "1",
                       "pretty-name": "Ferrovirt 1", "version-id": "1",
                       "kernel-version": "#1 SMP", "machine": "x86_64",
                       "id": "ferrovirt-testguest"},
            "hostname": "g1",
            "users": [{"user": "root", "login-time": 1700000000.5, "domain": "d"}],
            "filesystems": [{"name": "vda1", "mountpoint": "/", "type": "vfat",
                             "used-bytes": 10, "total-bytes": 100, "disk": []}],
            "interfaces": []
        });
        let info = guest_agent_info(&raw);
        assert_eq!(info["hostname"], "g1");
        assert_eq!(info["os"]["id"], "ferrovirt-testguest");
        assert_eq!(info["os"]["kernelRelease"], "6.1.0");
        assert_eq!(info["os"]["versionId"], "1");
        assert_eq!(info["os"]["prettyName"], "Ferrovirt 1");
        assert_eq!(info["userList"][0]["userName"], "root");
        assert_eq!(info["fsInfo"]["disks"][0]["mountPoint"], "/");
        let users = user_list(&raw);
        assert_eq!(users["kind"], "VirtualMachineInstanceUserList");
        assert_eq!(
            users["items"][0],
            json!({"userName": "root", "domain": "d", "loginTime": 1700000000.5})
        );
        let fs = filesystem_list(&raw);
        assert_eq!(
            fs["items"][0],
            json!({"diskName": "vda1", "mountPoint": "/", "fileSystemType": "vfat",
                   "usedBytes": 10, "totalBytes": 100})
        );
        // Missing data gives empty values, not errors.
        let empty = guest_agent_info(&json!({"osInfo": null}));
        assert_eq!(empty["os"]["id"], "");
        assert_eq!(empty["userList"], json!([]));
    }

    fn vm(spec: Value, status: Value) -> Value {
        json!({"metadata": {"name": "v"}, "spec": spec, "status": status})
    }

    fn plan(verb: VmVerb, vm: &Value, vmi: Option<&Value>) -> Result<VmPlan, ApiErr> {
        plan_vm(verb, vm, vmi, &VerbOptions::default())
    }

    #[test]
    fn start_and_stop_flip_always_and_halted() {
        let halted = vm(json!({"runStrategy": "Halted"}), json!({}));
        let p = plan(VmVerb::Start, &halted, None).unwrap();
        assert_eq!(
            p.vm_patch,
            Some(
                json!([{"op": "test", "path": "/spec/runStrategy", "value": "Halted"},
                        {"op": "replace", "path": "/spec/runStrategy", "value": "Always"}])
            )
        );
        let always = vm(json!({"runStrategy": "Always"}), json!({}));
        let running = vmi("Running", json!([]));
        let e = plan(VmVerb::Start, &always, Some(&running)).unwrap_err();
        assert_eq!((e.code, e.message.as_str()), (409, "VM is already running"));
        let e = plan(VmVerb::Start, &always, None).unwrap_err();
        assert_eq!(e.message, "Always does not support manual start requests");
        let p = plan(VmVerb::Stop, &always, Some(&running)).unwrap();
        assert_eq!(p.vm_patch.unwrap()[1]["value"], "Halted");
        // The deprecated `running` field is flipped in place.
        let legacy = vm(json!({"running": false}), json!({}));
        let p = plan(VmVerb::Start, &legacy, None).unwrap();
        assert_eq!(
            p.vm_patch.unwrap()[1],
            json!({"op": "replace", "path": "/spec/running", "value": true})
        );
        // Halted stops only with a shorter grace period.
        let e = plan(VmVerb::Stop, &halted, Some(&running)).unwrap_err();
        assert_eq!(e.code, 409);
        let opts = VerbOptions {
            grace_period: Some(5),
            ..Default::default()
        };
        let p = plan_vm(VmVerb::Stop, &halted, Some(&running), &opts).unwrap();
        assert_eq!(p.vmi_patch.unwrap()[1]["value"], 5);
        assert_eq!(
            p.vm_status_patch.unwrap()[0]["value"]["stateChangeRequests"],
            json!([{"action": "Stop", "uid": "u-1"}])
        );
    }

    #[test]
    fn manual_strategies_use_state_change_requests() {
        let manual = vm(
            json!({"runStrategy": "Manual"}),
            json!({"printableStatus": "Stopped"}),
        );
        let p = plan(VmVerb::Start, &manual, None).unwrap();
        assert_eq!(
            p.vm_status_patch,
            Some(json!([{"op": "add", "path": "/status/stateChangeRequests",
                         "value": [{"action": "Start"}]}]))
        );
        let done = vmi("Succeeded", json!([]));
        let p = plan(VmVerb::Start, &manual, Some(&done)).unwrap();
        assert_eq!(
            p.vm_status_patch.unwrap()[0]["value"],
            json!([{"action": "Stop", "uid": "u-1"}, {"action": "Start"}])
        );
        let e = plan(VmVerb::Stop, &manual, None).unwrap_err();
        assert_eq!((e.code, e.message.as_str()), (409, "VM is not running"));
        let rerun = vm(json!({"runStrategy": "RerunOnFailure"}), json!({}));
        let failed = vmi("Failed", json!([]));
        assert_eq!(
            plan(VmVerb::Start, &rerun, Some(&failed)).unwrap_err().code,
            409
        );
        // Pending requests: a lone Stop replaces them, anything else conflicts.
        let pending = vm(
            json!({"runStrategy": "Manual"}),
            json!({"stateChangeRequests": [{"action": "Start"}], "startFailure": {}}),
        );
        let running = vmi("Running", json!([]));
        let p = plan(VmVerb::Stop, &pending, Some(&running)).unwrap();
        let ops = p.vm_status_patch.unwrap();
        assert_eq!(ops[0]["op"], "test");
        assert_eq!(ops[1]["value"], json!([{"action": "Stop", "uid": "u-1"}]));
        assert_eq!(
            ops[2],
            json!({"op": "remove", "path": "/status/startFailure"})
        );
        let e = plan(VmVerb::Restart, &pending, Some(&running)).unwrap_err();
        assert!(e.message.contains("already underway"), "{e:?}");
    }

    #[test]
    fn restart_is_stop_then_start() {
        let always = vm(json!({"runStrategy": "Always"}), json!({"ready": true}));
        let running = vmi("Running", json!([]));
        let p = plan(VmVerb::Restart, &always, Some(&running)).unwrap();
        assert_eq!(
            p.vm_status_patch.unwrap()[0]["value"],
            json!([{"action": "Stop", "uid": "u-1"}, {"action": "Start"}])
        );
        assert_eq!(plan(VmVerb::Restart, &always, None).unwrap_err().code, 409);
        let halted = vm(json!({"runStrategy": "Halted"}), json!({}));
        let e = plan(VmVerb::Restart, &halted, Some(&running)).unwrap_err();
        assert_eq!(
            e.message,
            "RunStrategy Halted does not support manual restart requests"
        );
        let force = VerbOptions {
            grace_period_seconds: Some(0),
            ..Default::default()
        };
        let p = plan_vm(VmVerb::Restart, &always, Some(&running), &force).unwrap();
        assert_eq!(p.vmi_patch.unwrap()[1]["value"], 0);
        let slow = VerbOptions {
            grace_period_seconds: Some(3),
            ..Default::default()
        };
        assert_eq!(
            plan_vm(VmVerb::Restart, &always, Some(&running), &slow)
                .unwrap_err()
                .code,
            400
        );
    }
}
