//! The Node `proxy` subresource, `GET /api/v1/nodes/{name}/proxy/{path}`, as far as ferrovirt
//! serves it: the request is authorised like any other (RBAC verb `get` on `nodes/proxy`, by
//! the API server's authentication layer in front of these routes), then forwarded to the
//! node's agent endpoint (HTTPS pinned to the fingerprint on the Node, the server's bearer
//! token) and the agent's answer is passed back: status, content type and body.
//!
//! The agent endpoint also serves the console, VNC, port forwarding and VMI actions with the
//! same token, so only an allow-list of paths is forwarded ([`ALLOWED`]: `metrics`,
//! `healthz`). The decision ([`target`]) is pure and reads the raw request path: anything but
//! exactly an allowed name (a `..` segment, a percent escape, an extra segment, a query
//! string) is refused 403 with a metav1.Status naming it, and the path sent to the agent is
//! the allow-list's constant, never built from the request.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use http::{Method, StatusCode, header};
use http_body_util::{BodyExt, Empty};
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;

use super::{AgentAddr, ApiErr, MAX_AGENT_BODY, ProxyState, agent_connect, agent_request};
use crate::node::{ENDPOINT_ANNOTATION, FINGERPRINT_ANNOTATION};
use crate::tls;

/// The request prefix before the node name.
pub const PREFIX: &str = "/api/v1/nodes/";
/// The proxy paths forwarded to an agent, and the agent path each one becomes.
pub const ALLOWED: &[(&str, &str)] = &[("metrics", "/metrics"), ("healthz", "/healthz")];
/// How long the whole exchange with the agent may take (504 after).
pub const PROXY_TIMEOUT: Duration = Duration::from_secs(10);

/// What a node proxy request asks for: the node and the agent path to fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub node: String,
    /// One of [`ALLOWED`]'s agent paths.
    pub agent_path: &'static str,
}

fn forbidden(what: String) -> ApiErr {
    let allowed: Vec<&str> = ALLOWED.iter().map(|(p, _)| *p).collect();
    ApiErr::new(
        403,
        format!(
            "{what} is not forwarded by nodes/proxy: only {} are allowed",
            allowed.join(", ")
        ),
    )
}

/// Decides a request from its method, raw (still percent-encoded) path and query. Pure.
pub fn target(method: &Method, raw_path: &str, query: Option<&str>) -> Result<Target, ApiErr> {
    let not_proxy = || ApiErr::new(404, format!("{raw_path} is not a node proxy path"));
    let rest = raw_path.strip_prefix(PREFIX).ok_or_else(not_proxy)?;
    let (node, sub) = rest.split_once('/').unwrap_or((rest, ""));
    let path = match sub.strip_prefix("proxy") {
        Some("") => "",
        Some(p) => p.strip_prefix('/').ok_or_else(not_proxy)?,
        None => return Err(not_proxy()),
    };
    if node.is_empty() || node.contains('%') || node == "." || node == ".." {
        return Err(ApiErr::new(400, format!("invalid node name {node:?}")));
    }
    if *method != Method::GET && *method != Method::HEAD {
        return Err(ApiErr::new(
            405,
            format!("{method} is not supported on nodes/proxy (only GET)"),
        ));
    }
    if let Some(q) = query {
        return Err(forbidden(format!("the query string {q:?}")));
    }
    let agent_path = ALLOWED
        .iter()
        .find(|(p, _)| *p == path)
        .map(|(_, a)| *a)
        .ok_or_else(|| forbidden(format!("the path {path:?}")))?;
    Ok(Target {
        node: node.to_string(),
        agent_path,
    })
}

/// Why a Node cannot be proxied to now (None: it can): not Ready, or no endpoint published.
/// Pure.
pub fn unavailable(node: &Node) -> Option<String> {
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.status.as_str());
    if ready != Some("True") {
        return Some(format!(
            "node {name} is not ready (Ready={})",
            ready.unwrap_or("<none>")
        ));
    }
    let has_endpoint = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ENDPOINT_ANNOTATION))
        .is_some_and(|u| !u.is_empty());
    (!has_endpoint).then(|| format!("node {name} publishes no agent endpoint"))
}

/// The axum handler of `/api/v1/nodes/{name}/proxy[/{*path}]`.
pub(super) async fn handle(State(st): State<ProxyState>, req: Request) -> Response {
    let t = match target(req.method(), req.uri().path(), req.uri().query()) {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    let ready = match st.ready() {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    forward(&ready.client, &ready.token, &t)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn forward(client: &kube::Client, token: &str, t: &Target) -> Result<Response, ApiErr> {
    let nodes: Api<Node> = Api::all(client.clone());
    let node = nodes
        .get_opt(&t.node)
        .await
        .map_err(super::kube_err)?
        .ok_or_else(|| ApiErr::new(404, format!("nodes \"{}\" not found", t.node)))?;
    if let Some(why) = unavailable(&node) {
        return Err(ApiErr::new(503, why));
    }
    let annotation = |key: &str| {
        node.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(key))
            .filter(|u| !u.is_empty())
            .cloned()
    };
    let addr = AgentAddr {
        node: t.node.clone(),
        url: annotation(ENDPOINT_ANNOTATION).unwrap_or_default(),
        fingerprint: annotation(FINGERPRINT_ANNOTATION),
    };
    let in_node = |e: ApiErr| ApiErr::new(e.code, format!("node {}: {}", t.node, e.message));
    let exchange = async {
        let (mut send, authority) = agent_connect(&addr).await.map_err(in_node)?;
        let token = tls::endpoint_token(token, &t.node);
        let req = agent_request(Method::GET, &authority, t.agent_path, &token)
            .body(Empty::<axum::body::Bytes>::new())
            .map_err(|e| ApiErr::new(500, e.to_string()))?;
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| in_node(ApiErr::new(503, format!("agent request failed: {e}"))))?;
        let status = resp.status();
        let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
        let body = http_body_util::Limited::new(resp.into_body(), MAX_AGENT_BODY)
            .collect()
            .await
            .map_err(|e| in_node(ApiErr::new(502, format!("agent answer: {e}"))))?
            .to_bytes();
        Ok::<_, ApiErr>((status, content_type, body))
    };
    let (status, content_type, body) = tokio::time::timeout(PROXY_TIMEOUT, exchange)
        .await
        .map_err(|_| {
            ApiErr::new(
                504,
                format!(
                    "node {}: the agent did not answer within {PROXY_TIMEOUT:?}",
                    t.node
                ),
            )
        })??;
    if status == StatusCode::UNAUTHORIZED {
        // Passed back as is, the client would read it as its own credentials refused.
        return Err(ApiErr::new(
            502,
            format!(
                "node {}: the agent refused the server's credentials",
                t.node
            ),
        ));
    }
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = status;
    if let Some(ct) = content_type {
        resp.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(path: &str) -> Target {
        target(&Method::GET, path, None).unwrap()
    }
    fn code(method: Method, path: &str, query: Option<&str>) -> (u16, String) {
        let e = target(&method, path, query).unwrap_err();
        (e.code, e.message)
    }

    #[test]
    fn allowed_paths_map_to_constants() {
        assert_eq!(
            ok("/api/v1/nodes/node1/proxy/metrics"),
            Target {
                node: "node1".into(),
                agent_path: "/metrics"
            }
        );
        assert_eq!(ok("/api/v1/nodes/n-2/proxy/healthz").agent_path, "/healthz");
    }

    #[test]
    fn everything_else_is_refused_naming_it() {
        for (path, named) in [
            ("/api/v1/nodes/node1/proxy/vmis/u/console", "vmis/u/console"),
            ("/api/v1/nodes/node1/proxy/../vmis/u/vnc", "../vmis/u/vnc"),
            (
                "/api/v1/nodes/node1/proxy/metrics/../vmis/u/vnc",
                "metrics/../vmis/u/vnc",
            ),
            (
                "/api/v1/nodes/node1/proxy/metrics%2F..%2Fvmis",
                "metrics%2F..%2Fvmis",
            ),
            ("/api/v1/nodes/node1/proxy/%6detrics", "%6detrics"),
            ("/api/v1/nodes/node1/proxy/metrics/", "metrics/"),
            ("/api/v1/nodes/node1/proxy//metrics", "/metrics"),
            ("/api/v1/nodes/node1/proxy/./metrics", "./metrics"),
            ("/api/v1/nodes/node1/proxy", ""),
            ("/api/v1/nodes/node1/proxy/", ""),
        ] {
            let (c, msg) = code(Method::GET, path, None);
            assert_eq!(c, 403, "{path}: {msg}");
            assert!(msg.contains(&format!("{named:?}")), "{path}: {msg}");
            assert!(msg.contains("metrics, healthz"), "{msg}");
        }
        let (c, msg) = code(
            Method::GET,
            "/api/v1/nodes/node1/proxy/metrics",
            Some("x=/vmis/u/console"),
        );
        assert_eq!(c, 403);
        assert!(msg.contains("x=/vmis/u/console"), "{msg}");
        assert_eq!(
            code(Method::POST, "/api/v1/nodes/node1/proxy/metrics", None).0,
            405
        );
        assert_eq!(
            code(Method::GET, "/api/v1/nodes/node1/proxyx/metrics", None).0,
            404
        );
        assert_eq!(
            code(Method::GET, "/api/v1/nodes/..%2F/proxy/metrics", None).0,
            400
        );
        assert_eq!(
            code(Method::GET, "/api/v1/nodes/../proxy/metrics", None).0,
            400
        );
        assert_eq!(
            code(Method::GET, "/api/v1/pods/p/proxy/metrics", None).0,
            404
        );
    }

    fn node(ready: Option<&str>, endpoint: Option<&str>) -> Node {
        let mut v =
            serde_json::json!({"metadata": {"name": "n1", "annotations": {}}, "status": {}});
        if let Some(r) = ready {
            v["status"]["conditions"] = serde_json::json!([{"type": "Ready", "status": r}]);
        }
        if let Some(e) = endpoint {
            v["metadata"]["annotations"][ENDPOINT_ANNOTATION] = e.into();
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn only_ready_nodes_with_an_endpoint_are_proxied() {
        assert_eq!(
            unavailable(&node(Some("True"), Some("https://127.0.0.1:1"))),
            None
        );
        assert_eq!(
            unavailable(&node(Some("Unknown"), Some("https://127.0.0.1:1"))).unwrap(),
            "node n1 is not ready (Ready=Unknown)"
        );
        assert_eq!(
            unavailable(&node(None, Some("https://x"))).unwrap(),
            "node n1 is not ready (Ready=<none>)"
        );
        assert_eq!(
            unavailable(&node(Some("True"), None)).unwrap(),
            "node n1 publishes no agent endpoint"
        );
    }
}
