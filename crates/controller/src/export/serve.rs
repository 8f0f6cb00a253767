//! The export routes, served by the API server on its HTTPS port **outside** its bearer-token
//! check (`ServerOptions::public_routes`): each request is authenticated by the export's own
//! token instead, as KubeVirt's export proxy does.
//!
//! Under `/api/export.kubevirt.io/{v1|v1beta1}/namespaces/{ns}/virtualmachineexports/{name}`:
//!
//! - `GET volumes/{volume}/disk.img` — the volume's raw bytes (`Content-Length` set);
//! - `GET volumes/{volume}/disk.img.gz` — the same, gzip-compressed on the fly;
//! - `GET volumes/{volume}/dir[/…]`, `disk.tar.gz` — refused (404) with the reason: every
//!   ferrovirt volume is a disk image ([`NOT_AN_ARCHIVE`]);
//! - `GET {internal|external}/manifests/all` — the VM and DataVolumes that recreate the
//!   export elsewhere ([`super::manifests`]), YAML when `Accept` names yaml, else a JSON `List`;
//! - `GET {internal|external}/manifests/secret` — the `auth-header-secret` manifest.
//!
//! The token comes in the `x-kubevirt-export-token` header or query parameter and is compared
//! in constant time with the export's token Secret: none or a wrong one is 401. An export past
//! its TTL is 410 (it is being deleted); an unknown export or volume 404. The source is read
//! again for every request ([`super::resolve`]): a running VM's export serves the export's
//! own online snapshot once it is ready (409 until then), never a torn read.
//! A node-local volume's bytes come from its node's agent (`/storage/volumes/{pv}/export`,
//! pinned TLS and the agents' token) — or straight from the volume root when that node's
//! agent is embedded in this process — a volume on the server's machine is read here; a layer
//! chain (snapshots) is flattened on the fly, never staged in a temporary copy.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::StreamExt;
use http::{HeaderMap, StatusCode, header};
use k8s_openapi::api::core::v1::{Node, Secret};
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use serde_json::{Value, json};

use ferrovirt_api::kubevirt::export::{TOKEN_HEADER, TOKEN_KEY, VirtualMachineExport, phase};
use ferrovirt_storage::export::ByteStream;

use super::plan::{self, Endpoint, SourceState};
use super::resolve::{self, Volume};
use super::resources::VmExport;
use crate::storage::nodes::{self, Placement};

struct Service {
    client: kube::Client,
    agent_token: Option<String>,
    endpoint: Endpoint,
    local_node: Option<LocalNode>,
}

/// The node whose agent runs in this very process (the embedded agent): its volumes are read
/// from its volume root directly, not through its HTTPS route (one TLS hop less).
#[derive(Debug, Clone)]
pub struct LocalNode {
    /// The node's name.
    pub name: String,
    /// Its agent's data directory (volumes under `volumes/`).
    pub agent_data_dir: std::path::PathBuf,
}

/// What the routes serve with (see [`Handle::set`]).
pub struct ServeOptions {
    /// A client of this very server.
    pub client: kube::Client,
    /// The agents' token (node-local volumes are read by their node).
    pub agent_token: Option<String>,
    /// Where the server is reached.
    pub endpoint: Endpoint,
    /// The embedded agent's node, if any.
    pub local_node: Option<LocalNode>,
}

type Slot = Arc<OnceLock<Arc<Service>>>;

/// Gives the routes their API client once the server runs.
#[derive(Debug)]
pub struct Handle {
    slot: Slot,
}

impl std::fmt::Debug for ServeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeOptions")
            .field("endpoint", &self.endpoint)
            .field("local_node", &self.local_node)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service").finish_non_exhaustive()
    }
}

impl Handle {
    /// Start serving.
    pub fn set(&self, o: ServeOptions) {
        let _ = self.slot.set(Arc::new(Service {
            client: o.client,
            agent_token: o.agent_token,
            endpoint: o.endpoint,
            local_node: o.local_node,
        }));
    }
}

/// The routes (answering 503 until [`Handle::set`]).
pub fn deferred() -> (Router, Handle) {
    let slot: Slot = Arc::new(OnceLock::new());
    let base = "/api/export.kubevirt.io/{version}/namespaces/{ns}/virtualmachineexports/{name}";
    let router = Router::new()
        .route(&format!("{base}/volumes/{{volume}}/{{file}}"), get(volume))
        .route(
            &format!("{base}/volumes/{{volume}}/dir/{{*rest}}"),
            get(dir_entry),
        )
        .route(
            &format!("{base}/{{scope}}/manifests/{{which}}"),
            get(manifest),
        )
        .with_state(slot.clone());
    (router, Handle { slot })
}

/// An error answer (metav1.Status).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub code: u16,
    pub message: String,
}

fn fail(code: u16, message: impl Into<String>) -> Failure {
    Failure {
        code,
        message: message.into(),
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let reason = match self.code {
            400 => "BadRequest",
            401 => "Unauthorized",
            404 => "NotFound",
            409 => "Conflict",
            410 => "Gone",
            503 => "ServiceUnavailable",
            _ => "InternalError",
        };
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": self.message, "reason": reason, "code": self.code});
        let mut resp = (code, axum::Json(body)).into_response();
        if self.code == 401 {
            resp.headers_mut()
                .insert(header::CONNECTION, http::HeaderValue::from_static("close"));
        }
        resp
    }
}

fn kube_failure(e: impl std::fmt::Display) -> Failure {
    fail(500, e.to_string())
}

/// The token a request presents: the header, else the query parameter.
pub fn presented_token<'a>(
    headers: &'a HeaderMap,
    query: &'a HashMap<String, String>,
) -> Option<&'a str> {
    headers
        .get(TOKEN_HEADER)
        .and_then(|v| v.to_str().ok())
        .or_else(|| query.get(TOKEN_HEADER).map(String::as_str))
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

/// Whether `presented` is `expected`, compared in constant time.
pub fn token_matches(presented: &str, expected: &[u8]) -> bool {
    !expected.is_empty() && subtle::ConstantTimeEq::ct_eq(presented.as_bytes(), expected).into()
}

/// Whether the export may serve at `now` (pure): past its TTL or terminated is 410.
pub fn check_live(e: &VirtualMachineExport, now: Timestamp) -> Result<(), Failure> {
    if plan::expiry(e).is_some_and(|u| now >= u) {
        return Err(fail(410, "the export has expired (ttlDuration)"));
    }
    if e.status.as_ref().and_then(|s| s.phase.as_deref()) == Some(phase::TERMINATED) {
        return Err(fail(410, "the export is terminated"));
    }
    Ok(())
}

fn valid_version(v: &str) -> Result<(), Failure> {
    if matches!(v, "v1" | "v1beta1") {
        Ok(())
    } else {
        Err(fail(404, format!("export.kubevirt.io/{v} is not served")))
    }
}

/// The export, once the request's token is its token; with that token.
async fn authorize(
    svc: &Service,
    ns: &str,
    name: &str,
    headers: &HeaderMap,
    query: &HashMap<String, String>,
) -> Result<(VirtualMachineExport, String), Failure> {
    let Some(presented) = presented_token(headers, query) else {
        return Err(fail(401, format!("the {TOKEN_HEADER} header is required")));
    };
    let export = Api::<VmExport>::namespaced(svc.client.clone(), ns)
        .get_opt(name)
        .await
        .map_err(kube_failure)?
        .ok_or_else(|| fail(404, format!("VirtualMachineExport {ns}/{name} not found")))?
        .0;
    let secret_name = export
        .status
        .as_ref()
        .and_then(|s| s.token_secret_ref.clone())
        .unwrap_or_else(|| plan::token_secret_name(&export));
    let secret = Api::<Secret>::namespaced(svc.client.clone(), ns)
        .get_opt(&secret_name)
        .await
        .map_err(kube_failure)?;
    let expected = secret
        .and_then(|s| s.data)
        .and_then(|mut d| d.remove(TOKEN_KEY))
        .map(|b| b.0)
        .unwrap_or_default();
    if !token_matches(presented, &expected) {
        return Err(fail(401, "the export token is not valid for this export"));
    }
    check_live(&export, Timestamp::now())?;
    Ok((export, String::from_utf8_lossy(&expected).into_owned()))
}

/// The export's volumes now, or why they cannot be served now.
async fn ready_volumes(
    svc: &Service,
    e: &VirtualMachineExport,
) -> Result<resolve::Resolved, Failure> {
    let r = resolve::resolve(&svc.client, e)
        .await
        .map_err(kube_failure)?;
    match &r.state {
        SourceState::Ready { .. } => Ok(r),
        SourceState::InUse(m)
        | SourceState::NotReady(m)
        | SourceState::Nothing(m)
        | SourceState::SnapshotInProgress(m)
        | SourceState::SnapshotFailed(m) => Err(fail(409, format!("the export is not ready: {m}"))),
        SourceState::NeedsSnapshot { vm } => Err(fail(
            409,
            format!(
                "the export is not ready: VirtualMachine {vm} is running; its online \
                 snapshot is about to be taken"
            ),
        )),
        SourceState::NotFound(m) => Err(fail(404, m.clone())),
    }
}

fn service(slot: &Slot) -> Result<Arc<Service>, Failure> {
    slot.get()
        .cloned()
        .ok_or_else(|| fail(503, "the export server is starting"))
}

async fn volume(
    State(slot): State<Slot>,
    Path((version, ns, name, vol, file)): Path<(String, String, String, String, String)>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    match serve_volume(&slot, &version, &ns, &name, &vol, &file, &headers, &query).await {
        Ok(r) => r,
        Err(f) => f.into_response(),
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve_volume(
    slot: &Slot,
    version: &str,
    ns: &str,
    name: &str,
    vol: &str,
    file: &str,
    headers: &HeaderMap,
    query: &HashMap<String, String>,
) -> Result<Response, Failure> {
    valid_version(version)?;
    let svc = service(slot)?;
    let (export, _) = authorize(&svc, ns, name, headers, query).await?;
    let gz = file_format(file)?;
    let r = ready_volumes(&svc, &export).await?;
    let Some(v) = r.volumes.iter().find(|v| v.name == vol) else {
        return Err(fail(404, format!("the export has no volume {vol}")));
    };
    let (size, stream) = open_volume(&svc, v).await?;
    tracing::info!(namespace = %ns, export = %name, volume = %vol, gzip = gz, "export download");
    if gz {
        let body = Body::from_stream(ferrovirt_storage::export::gzip(stream));
        Ok(([(header::CONTENT_TYPE, "application/gzip")], body).into_response())
    } else {
        Ok((
            [
                (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                (header::CONTENT_LENGTH, size.to_string()),
            ],
            Body::from_stream(stream),
        )
            .into_response())
    }
}

/// Why `dir` and `tar.gz` are not served (docs/export.md).
pub const NOT_AN_ARCHIVE: &str = "every ferrovirt volume is a disk image (disk.img); the dir \
     and tar.gz formats KubeVirt serves for filesystem (contentType archive) PVCs do not apply: \
     download disk.img (raw) or disk.img.gz (gzip)";

/// Whether `file` (below `volumes/{volume}/`) is the gzip format (pure): `disk.img` raw,
/// `disk.img.gz` gzip; `dir`/`disk.tar.gz` refused with the reason; anything else 404.
pub fn file_format(file: &str) -> Result<bool, Failure> {
    match file {
        "disk.img" => Ok(false),
        "disk.img.gz" => Ok(true),
        "dir" | "disk.tar.gz" => Err(fail(404, format!("{file}: {NOT_AN_ARCHIVE}"))),
        other => Err(fail(
            404,
            format!("{other}: the formats served are disk.img (raw) and disk.img.gz (gzip)"),
        )),
    }
}

async fn dir_entry(
    State(slot): State<Slot>,
    Path((version, ns, name, vol, _rest)): Path<(String, String, String, String, String)>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    match serve_volume(&slot, &version, &ns, &name, &vol, "dir", &headers, &query).await {
        Ok(r) => r,
        Err(f) => f.into_response(),
    }
}

/// The raw bytes of an exported volume, where they are.
async fn open_volume(svc: &Service, v: &Volume) -> Result<(u64, ByteStream), Failure> {
    match nodes::placement(&v.pv) {
        Placement::Node { node, volume }
            if svc.local_node.as_ref().is_some_and(|l| l.name == node) =>
        {
            // The embedded agent's volume: read here, with the agent's own name check.
            let l = svc.local_node.as_ref().expect("checked");
            let root = ferrovirt_agent::nodestore::volume_root(&l.agent_data_dir);
            let dir = ferrovirt_storage::provisioner::VolumeRoot::new(root)
                .dir(&volume)
                .map_err(|e| fail(400, e.to_string()))?;
            if !dir.is_dir() {
                return Err(fail(
                    404,
                    format!("volume {volume} does not exist on node {node}"),
                ));
            }
            let r = ferrovirt_storage::export::open(&dir, v.handle.as_deref())
                .await
                .map_err(|e| fail(if e.is_permanent() { 400 } else { 500 }, e.to_string()))?;
            Ok((r.size, r.stream))
        }
        Placement::Node { node, volume } => {
            let token = svc
                .agent_token
                .as_deref()
                .ok_or_else(|| fail(503, "the server has no agent token to read node storage"))?;
            let n = Api::<Node>::all(svc.client.clone())
                .get_opt(&node)
                .await
                .map_err(kube_failure)?
                .ok_or_else(|| fail(503, format!("node {node} of the volume does not exist")))?;
            let storage = ferrovirt_agent::nodestore::client::NodeStorage::of(&n, token)
                .map_err(|e| fail(503, e.to_string()))?;
            let resp = storage
                .read_export(&volume, v.handle.as_deref())
                .await
                .map_err(|e| fail(if e.is_permanent() { 500 } else { 503 }, e.to_string()))?;
            let size = resp
                .headers()
                .get(header::CONTENT_LENGTH)
                .and_then(|l| l.to_str().ok())
                .and_then(|l| l.parse().ok())
                .ok_or_else(|| fail(502, "the agent sent no Content-Length"))?;
            let stream = Body::new(resp.into_body())
                .into_data_stream()
                .map(|r| r.map_err(std::io::Error::other));
            Ok((size, Box::pin(stream)))
        }
        Placement::Path(dir) => {
            let r = ferrovirt_storage::export::open(&dir, v.handle.as_deref())
                .await
                .map_err(|e| fail(500, e.to_string()))?;
            Ok((r.size, r.stream))
        }
        Placement::Unknown => Err(fail(500, "the volume has no known location")),
    }
}

async fn manifest(
    State(slot): State<Slot>,
    Path((version, ns, name, scope, which)): Path<(String, String, String, String, String)>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let run = async {
        valid_version(&version)?;
        if !matches!(scope.as_str(), "internal" | "external") {
            return Err(fail(404, format!("{scope}: not internal or external")));
        }
        let svc = service(&slot)?;
        let (export, token) = authorize(&svc, &ns, &name, &headers, &query).await?;
        let docs = match which.as_str() {
            "secret" => vec![super::manifests::header_secret(&name, &token)],
            "all" => {
                let r = ready_volumes(&svc, &export).await?;
                let SourceState::Ready { volumes, .. } = &r.state else {
                    return Err(fail(409, "the export is not ready"));
                };
                let links = plan::links(&svc.endpoint, &ns, &name, volumes);
                let link = if scope == "internal" {
                    links.internal
                } else {
                    links.external
                }
                .unwrap_or_default();
                let vols: Vec<_> = r
                    .volumes
                    .iter()
                    .map(|v| (v.name.clone(), v.claim.clone()))
                    .collect();
                super::manifests::all(&name, &link, &vols, r.vm.as_ref())
            }
            other => {
                return Err(fail(
                    404,
                    format!("{other}: the manifests are all and secret"),
                ));
            }
        };
        Ok(render(&docs, &headers))
    };
    match run.await {
        Ok(r) => r,
        Err(f) => f.into_response(),
    }
}

/// Multi-document YAML when the client asks for yaml, else a JSON `List`.
fn render(docs: &[Value], headers: &HeaderMap) -> Response {
    let yaml = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("yaml"));
    if yaml {
        let mut out = String::new();
        for d in docs {
            out.push_str("---\n");
            out.push_str(&ferrovirt_api::yaml::to_string(d).unwrap_or_default());
            if !out.ends_with('\n') {
                out.push('\n');
            }
        }
        ([(header::CONTENT_TYPE, "application/yaml")], out).into_response()
    } else {
        axum::Json(json!({"apiVersion": "v1", "kind": "List", "metadata": {}, "items": docs}))
            .into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_come_from_the_header_or_the_query() {
        let mut h = HeaderMap::new();
        let mut q = HashMap::new();
        assert_eq!(presented_token(&h, &q), None);
        q.insert(TOKEN_HEADER.to_string(), "q".to_string());
        assert_eq!(presented_token(&h, &q), Some("q"));
        h.insert(TOKEN_HEADER, "h".parse().unwrap());
        assert_eq!(presented_token(&h, &q), Some("h"));
    }

    #[test]
    fn raw_and_gzip_are_served_dir_and_tar_gz_refused_with_the_reason() {
        assert!(!file_format("disk.img").unwrap());
        assert!(file_format("disk.img.gz").unwrap());
        for f in ["dir", "disk.tar.gz"] {
            let e = file_format(f).unwrap_err();
            assert_eq!(e.code, 404);
            assert!(e.message.contains("disk image"), "{}", e.message);
        }
        assert!(file_format("../disk.img").is_err());
    }

    #[test]
    fn tokens_must_match_exactly() {
        assert!(token_matches("abc", b"abc"));
        assert!(!token_matches("abd", b"abc"));
        assert!(!token_matches("ab", b"abc"));
        assert!(!token_matches("abcd", b"abc"));
        assert!(!token_matches("", b""));
    }

    #[test]
    fn expired_and_terminated_exports_are_gone() {
        let e: VirtualMachineExport = serde_json::from_value(json!({
            "metadata": {"name": "ex", "namespace": "ns", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"source": {"kind": "PersistentVolumeClaim", "name": "p"}, "ttlDuration": "1m"}
        }))
        .unwrap();
        let t = |s: &str| s.parse::<Timestamp>().unwrap();
        assert!(check_live(&e, t("2026-01-01T00:00:59Z")).is_ok());
        assert_eq!(
            check_live(&e, t("2026-01-01T00:01:00Z")).unwrap_err().code,
            410
        );
        let mut term = e.clone();
        term.status = Some(ferrovirt_api::kubevirt::export::ExportStatus {
            phase: Some("Terminated".into()),
            ..Default::default()
        });
        assert_eq!(
            check_live(&term, t("2026-01-01T00:00:01Z"))
                .unwrap_err()
                .code,
            410
        );
    }
}
