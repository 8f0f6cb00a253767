//! CDI's upload API, served by the API server through `ServerOptions::extra_routes`:
//!
//! - `POST /apis/upload.cdi.kubevirt.io/v1beta1/namespaces/{ns}/uploadtokenrequests` with
//!   `spec.pvcName` answers the `UploadTokenRequest` with `status.token`: an HMAC-signed,
//!   short-lived token for that claim ([`super::upload_token`]). The kind itself is in the
//!   API server's resource table (create-only), so discovery, `kubectl api-resources` and
//!   `kubectl create -f` know it; this route answers the create.
//! - `POST /v1beta1/upload` (CDI's upload proxy path; `/v1beta1/upload-async` is the same
//!   here): the body is the image. The API server authenticates every route with its admin
//!   bearer token, so `Authorization: Bearer` carries that token and the upload token goes
//!   in the `X-Upload-Token` header (401 when missing, forged or expired). The claim must
//!   belong to a DataVolume with an `upload` source in phase `UploadReady`. The body is
//!   streamed to `<data dir>/import-scratch/upload-<dv uid>/`, decompressed (gzip/xz/zstd)
//!   and validated and converted exactly as an import (`qemu-img info`: no backing file, a
//!   known format, a virtual size within the claim; then raw into `disk.img`). A node-local
//!   (`local`-class) volume is never written here: the body is streamed on to the agent of
//!   its node ([`ferrovirt_agent::nodestore`]), which validates and converts it the same way
//!   into its volume. The DataVolume becomes `Succeeded`, or `Failed` with the reason (the
//!   answer is then 400 with the same message). An interrupted transfer leaves it
//!   `UploadReady` for another try (503 when the node's agent cannot be reached).

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures::StreamExt;
use http::{HeaderMap, StatusCode};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

use ferrovirt_api::cdi::dv_phase;
use ferrovirt_storage::importer;
use ferrovirt_storage::provisioner::image_of;

use super::Dirs;
use super::datavolume::{self as dvd, Stage};
use super::dv_loop::volume_path_and_size;
use super::resources::{CDI_API_VERSION, Dv};
use super::upload_token::{DEFAULT_TTL_SECS, UploadKey, unix_now};
use crate::runtime::events::{EventRecorder, object_ref};

/// The API group of upload token requests.
pub const GROUP: &str = "upload.cdi.kubevirt.io";
/// Its version.
pub const VERSION: &str = "v1beta1";
/// The upload path (CDI's upload proxy).
pub const UPLOAD_PATH: &str = "/v1beta1/upload";
/// The header carrying the upload token (the admin token is in `Authorization`).
pub const TOKEN_HEADER: &str = "x-upload-token";
/// Name of the signing key file in the data directory.
pub const KEY_FILE: &str = "upload-token.key";
/// Component name on Events.
pub const COMPONENT: &str = "upload-server";

/// Where the upload API keeps its key and scratch space.
#[derive(Debug, Clone)]
pub struct UploadOptions {
    /// The server's data directory (the key file; volumes and scratch as in
    /// [`super::StorageOptions::data_dir`]).
    pub data_dir: PathBuf,
    /// Lifetime of issued tokens.
    pub token_ttl: Duration,
}

impl UploadOptions {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        UploadOptions {
            data_dir: data_dir.into(),
            token_ttl: Duration::from_secs(DEFAULT_TTL_SECS),
        }
    }
}

struct Service {
    client: kube::Client,
    recorder: EventRecorder,
    key: UploadKey,
    dirs: Dirs,
    ttl: u64,
    busy: Mutex<HashSet<String>>,
    /// The agents' endpoint token, to stream uploads of node-local volumes to their node.
    agent_token: Option<String>,
}

type Slot = Arc<OnceLock<Arc<Service>>>;

/// Gives the routes their API client once the server runs.
pub struct Handle {
    slot: Slot,
    key: Mutex<Option<UploadKey>>,
    opts: UploadOptions,
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle").finish_non_exhaustive()
    }
}

impl Handle {
    /// Start serving with `client` (a client of this very server); `agent_token` reaches the
    /// node agents (uploads into node-local volumes are streamed to their node).
    pub fn set(&self, client: kube::Client, agent_token: Option<String>) {
        let Some(key) = self.key.lock().expect("lock").take() else {
            return;
        };
        let _ = self.slot.set(Arc::new(Service {
            recorder: EventRecorder::new(client.clone(), COMPONENT),
            client,
            key,
            dirs: Dirs::under(&self.opts.data_dir),
            ttl: self.opts.token_ttl.as_secs().max(1),
            busy: Mutex::new(HashSet::new()),
            agent_token,
        }));
    }
}

/// The routes (answering 503 until [`Handle::set`]); loads or creates the signing key.
pub fn deferred(opts: UploadOptions) -> std::io::Result<(Router, Handle)> {
    let key = UploadKey::load_or_create(&opts.data_dir.join(KEY_FILE))?;
    let slot: Slot = Arc::new(OnceLock::new());
    let router = Router::new()
        .route(
            &format!("/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/uploadtokenrequests"),
            post(token_request),
        )
        .route(UPLOAD_PATH, post(upload))
        .route("/v1beta1/upload-async", post(upload))
        .with_state(slot.clone());
    Ok((
        router,
        Handle {
            slot,
            key: Mutex::new(Some(key)),
            opts,
        },
    ))
}

/// A metav1.Status error answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub code: u16,
    pub message: String,
}

impl Failure {
    fn new(code: u16, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let reason = match self.code {
            400 => "BadRequest",
            401 => "Unauthorized",
            404 => "NotFound",
            409 => "Conflict",
            413 => "RequestEntityTooLarge",
            503 => "ServiceUnavailable",
            _ => "InternalError",
        };
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": self.message, "reason": reason, "code": self.code});
        (code, axum::Json(body)).into_response()
    }
}

fn kube_failure(e: kube::Error) -> Failure {
    match e {
        kube::Error::Api(s) => Failure::new(s.code, s.message),
        other => Failure::new(500, other.to_string()),
    }
}

fn service(slot: &Slot) -> Result<Arc<Service>, Failure> {
    slot.get()
        .cloned()
        .ok_or_else(|| Failure::new(503, "the upload API is starting"))
}

/// The answer to an UploadTokenRequest `req` in `ns` (pure, for tests).
pub fn token_response(ns: &str, req: &Value, token: &str, now: &Time) -> Result<Value, Failure> {
    let pvc = req
        .pointer("/spec/pvcName")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| Failure::new(400, "spec.pvcName is required"))?;
    let mut meta = req.get("metadata").cloned().unwrap_or_else(|| json!({}));
    meta["namespace"] = json!(ns);
    meta["creationTimestamp"] = json!(now);
    Ok(json!({
        "apiVersion": format!("{GROUP}/{VERSION}"),
        "kind": "UploadTokenRequest",
        "metadata": meta,
        "spec": {"pvcName": pvc},
        "status": {"token": token},
    }))
}

async fn token_request(
    State(slot): State<Slot>,
    Path(ns): Path<String>,
    body: Bytes,
) -> Result<Response, Failure> {
    let svc = service(&slot)?;
    let req: Value = serde_json::from_slice(&body)
        .map_err(|e| Failure::new(400, format!("decoding the UploadTokenRequest: {e}")))?;
    let pvc = req
        .pointer("/spec/pvcName")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    if !pvc.is_empty()
        && Api::<PersistentVolumeClaim>::namespaced(svc.client.clone(), &ns)
            .get_opt(&pvc)
            .await
            .map_err(kube_failure)?
            .is_none()
    {
        return Err(Failure::new(
            404,
            format!("persistentvolumeclaims \"{pvc}\" not found"),
        ));
    }
    let token = svc.key.sign(&ns, &pvc, unix_now(), svc.ttl);
    let answer = token_response(&ns, &req, &token, &Time(Timestamp::now()))?;
    Ok((StatusCode::CREATED, axum::Json(answer)).into_response())
}

/// Removes its key from the busy set when dropped.
struct Busy<'a>(&'a Mutex<HashSet<String>>, String);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.lock().expect("lock").remove(&self.1);
    }
}

/// The most bytes accepted for a claim of `capacity` bytes, compressed or decompressed
/// (images may carry metadata; a larger body cannot hold an image that fits).
pub fn upload_limit(capacity: u64) -> u64 {
    ferrovirt_storage::http::transfer_limit(capacity)
}

async fn upload(
    State(slot): State<Slot>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Failure> {
    let svc = service(&slot)?;
    let token = headers
        .get(TOKEN_HEADER)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| Failure::new(401, format!("the {TOKEN_HEADER} header is required")))?;
    let grant = svc
        .key
        .verify(token, unix_now())
        .map_err(|e| Failure::new(401, e.to_string()))?;
    let (ns, claim_name) = (grant.namespace, grant.pvc);
    let claim = Api::<PersistentVolumeClaim>::namespaced(svc.client.clone(), &ns)
        .get_opt(&claim_name)
        .await
        .map_err(kube_failure)?
        .ok_or_else(|| {
            Failure::new(
                404,
                format!("persistentvolumeclaims \"{claim_name}\" not found"),
            )
        })?;
    let dv_name = claim
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(dvd::POPULATED_FOR))
        .cloned()
        .ok_or_else(|| {
            Failure::new(
                400,
                format!("PVC {ns}/{claim_name} does not belong to a DataVolume"),
            )
        })?;
    let dvs: Api<Dv> = Api::namespaced(svc.client.clone(), &ns);
    let dv = dvs
        .get_opt(&dv_name)
        .await
        .map_err(kube_failure)?
        .ok_or_else(|| Failure::new(404, format!("DataVolume {ns}/{dv_name} not found")))?
        .0;
    let is_upload = dv
        .spec
        .as_ref()
        .and_then(|s| s.source.as_ref())
        .is_some_and(|s| s.upload.is_some());
    let phase = dv
        .status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_default();
    if !is_upload || phase != dv_phase::UPLOAD_READY {
        return Err(Failure::new(
            409,
            format!("DataVolume {ns}/{dv_name} is not ready for upload (phase {phase:?})"),
        ));
    }
    let volume = claim
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.clone())
        .unwrap_or_default();
    let pv = Api::<PersistentVolume>::all(svc.client.clone())
        .get_opt(&volume)
        .await
        .map_err(kube_failure)?;
    let (path, capacity) = pv
        .as_ref()
        .and_then(volume_path_and_size)
        .ok_or_else(|| Failure::new(409, format!("volume {volume:?} has no local path")))?;
    let key = format!("{ns}/{claim_name}");
    if !svc.busy.lock().expect("lock").insert(key.clone()) {
        return Err(Failure::new(
            409,
            format!("an upload into PVC {key} is already in progress"),
        ));
    }
    let _busy = Busy(&svc.busy, key);
    let uid = dv.metadata.uid.clone().unwrap_or_default();
    let scratch = svc.dirs.scratch.join(format!("upload-{uid}"));
    let length = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let progress = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let ticker = tokio::spawn(report_progress(
        dvs.clone(),
        dv_name.clone(),
        progress.clone(),
        stop.clone(),
    ));
    let _stop_ticker = AbortOnDrop(ticker.abort_handle());
    let on_node = match pv.as_ref().map(super::nodes::placement) {
        Some(super::nodes::Placement::Node { node, volume }) => Some((node, volume)),
        _ => None,
    };
    let received = match on_node {
        Some((node, volume)) => {
            Err(forward(&svc, &node, &volume, body, capacity, length, &progress).await?)
        }
        None => Ok(receive(body, &scratch, upload_limit(capacity), length, &progress).await),
    };
    let result = match received {
        Err(forwarded) => forwarded,
        Ok(received) => match received {
            Err(Received::Interrupted(m)) => {
                let _ = std::fs::remove_dir_all(&scratch);
                return Err(Failure::new(
                    400,
                    format!("the upload was interrupted: {m}"),
                ));
            }
            Err(Received::TooLarge(n)) => Err(format!(
                "image refused: the upload exceeds {n} bytes, more than a PVC of {capacity} bytes can hold"
            )),
            Ok(file) => {
                let out = async {
                    let target = match pv.as_ref() {
                        Some(pv) => super::block::target(pv, &path).await?,
                        None => image_of(&path),
                    };
                    let image = importer::decompress_if_needed(
                        &file,
                        &scratch.join("image"),
                        upload_limit(capacity),
                    )
                    .await?;
                    // Checked like any import (format from its header, self-contained, within
                    // the claim), never copied as it is.
                    let info = importer::inspect(&image, capacity).await?;
                    importer::write_raw(&image, &info.format, &target, capacity, |p| {
                        set_progress(&progress, importer::convert_progress(p))
                    })
                    .await
                }
                .await;
                out.map_err(|e| e.to_string())
            }
        },
    };
    let _ = std::fs::remove_dir_all(&scratch);
    // Let a progress write in flight land before the final status.
    stop.store(true, Ordering::Relaxed);
    let _ = tokio::time::timeout(Duration::from_secs(10), ticker).await;
    let stage = match &result {
        Ok(()) => Stage::Succeeded,
        Err(m) => Stage::Failed {
            reason: "Error".into(),
            message: m.clone(),
        },
    };
    let restarts = dv
        .status
        .as_ref()
        .and_then(|s| s.restart_count)
        .unwrap_or(0);
    let status = dvd::status_for(
        dv.status.as_ref(),
        &claim_name,
        &stage,
        restarts,
        &Time(Timestamp::now()),
    );
    dvs.patch_status(
        &dv_name,
        &PatchParams::default(),
        &Patch::Merge(&json!({"status": status})),
    )
    .await
    .map_err(kube_failure)?;
    let r = object_ref(CDI_API_VERSION, "DataVolume", &dv.metadata);
    match result {
        Ok(()) => {
            let msg = format!("Successfully uploaded into PVC {claim_name}");
            svc.recorder
                .record(&r, false, "UploadSucceeded", &msg)
                .await;
            tracing::info!(dv = %format!("{ns}/{dv_name}"), "upload succeeded");
            Ok((StatusCode::OK, "").into_response())
        }
        Err(m) => {
            svc.recorder.record(&r, true, "ErrUploadFailed", &m).await;
            tracing::warn!(dv = %format!("{ns}/{dv_name}"), error = %m, "upload failed");
            Err(Failure::new(400, m))
        }
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Progress in hundredths of a percent.
fn set_progress(p: &AtomicU64, percent: f64) {
    p.store(
        (percent.clamp(0.0, 100.0) * 100.0) as u64,
        Ordering::Relaxed,
    );
}

/// Writes `status.progress` of the DataVolume every second while it changes.
async fn report_progress(
    dvs: Api<Dv>,
    name: String,
    progress: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) {
    let mut last = u64::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let now = progress.load(Ordering::Relaxed);
        if now == last {
            continue;
        }
        last = now;
        let text = dvd::format_progress(now as f64 / 100.0);
        let patch = json!({"status": {"progress": text}});
        if let Err(e) = dvs
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            tracing::debug!(dv = %name, error = %e, "writing upload progress failed");
        }
    }
}

#[derive(Debug, Clone)]
enum Received {
    Interrupted(String),
    TooLarge(u64),
}

/// Streams the upload `body` to the agent of `node`, which writes it into its volume
/// `volume`: the transfer is the first half of `progress` (counted here, at most
/// [`upload_limit`] bytes), the node's conversion the second. `Ok(Err(message))` when the
/// image failed (the DataVolume fails); `Err` when the transfer broke (it stays
/// `UploadReady`).
async fn forward(
    svc: &Service,
    node: &str,
    volume: &str,
    body: Body,
    capacity: u64,
    length: Option<u64>,
    progress: &Arc<AtomicU64>,
) -> Result<Result<(), String>, Failure> {
    let node_obj = Api::<k8s_openapi::api::core::v1::Node>::all(svc.client.clone())
        .get_opt(node)
        .await
        .map_err(kube_failure)?
        .ok_or_else(|| Failure::new(503, format!("node {node} of the volume does not exist")))?;
    let token = svc
        .agent_token
        .as_deref()
        .ok_or_else(|| Failure::new(503, "the upload proxy has no token for the node agents"))?;
    let storage = ferrovirt_agent::nodestore::client::NodeStorage::of(&node_obj, token)
        .map_err(|e| Failure::new(503, e.to_string()))?;
    let limit = upload_limit(capacity);
    let broke: Arc<Mutex<Option<Received>>> = Arc::new(Mutex::new(None));
    let counted = {
        let (progress, broke) = (progress.clone(), broke.clone());
        let mut total = 0u64;
        body.into_data_stream().map(move |chunk| {
            let stop = |r: Received| {
                *broke.lock().expect("lock") = Some(r);
                Err(std::io::Error::other("upload stopped"))
            };
            let chunk = match chunk {
                Ok(c) => c,
                Err(e) => return stop(Received::Interrupted(e.to_string())),
            };
            total += chunk.len() as u64;
            if total > limit {
                return stop(Received::TooLarge(limit));
            }
            if let Some(p) = importer::download_progress(total, length) {
                set_progress(&progress, p);
            }
            Ok(chunk)
        })
    };
    let body = ferrovirt_agent::nodestore::client::stream_body(counted);
    let answer = storage
        .upload(volume, capacity, limit, body, |p| set_progress(progress, p))
        .await;
    let broke = broke.lock().expect("lock").take();
    match (broke, answer) {
        (Some(Received::TooLarge(n)), _) => Ok(Err(format!(
            "image refused: the upload exceeds {n} bytes, more than a PVC of {capacity} bytes can hold"
        ))),
        (Some(Received::Interrupted(m)), _) => Err(Failure::new(
            400,
            format!("the upload was interrupted: {m}"),
        )),
        (None, Ok(Ok(()))) => Ok(Ok(())),
        (None, Ok(Err(f))) => Ok(Err(f.message)),
        (
            None,
            Err(ferrovirt_agent::nodestore::NodeStoreError::Answer {
                status: 413,
                message,
                ..
            }),
        ) => Ok(Err(message)),
        (
            None,
            Err(ferrovirt_agent::nodestore::NodeStoreError::Answer {
                status: 409,
                message,
                ..
            }),
        ) => Err(Failure::new(400, message)),
        (None, Err(e)) => Err(Failure::new(503, e.to_string())),
    }
}

/// Streams `body` into `<scratch>/upload` (at most `limit` bytes); the transfer is the first
/// half of `progress` when the body's `length` is known.
async fn receive(
    body: Body,
    scratch: &std::path::Path,
    limit: u64,
    length: Option<u64>,
    progress: &AtomicU64,
) -> Result<PathBuf, Received> {
    let io = |e: std::io::Error| Received::Interrupted(e.to_string());
    let _ = std::fs::remove_dir_all(scratch);
    tokio::fs::create_dir_all(scratch).await.map_err(io)?;
    let path = scratch.join("upload");
    let mut file = tokio::fs::File::create(&path).await.map_err(io)?;
    let mut stream = body.into_data_stream();
    let mut total = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| Received::Interrupted(e.to_string()))?;
        total += chunk.len() as u64;
        if total > limit {
            return Err(Received::TooLarge(limit));
        }
        file.write_all(&chunk).await.map_err(io)?;
        if let Some(p) = importer::download_progress(total, length) {
            set_progress(progress, p);
        }
    }
    file.flush().await.map_err(io)?;
    if total == 0 {
        return Err(Received::Interrupted("the body is empty".into()));
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_answers() {
        let now = Time(Timestamp::UNIX_EPOCH);
        let req = json!({"apiVersion": "upload.cdi.kubevirt.io/v1beta1",
            "kind": "UploadTokenRequest", "metadata": {"name": "t"}, "spec": {"pvcName": "d"}});
        let a = token_response("ns", &req, "tok", &now).unwrap();
        assert_eq!(a["status"]["token"], "tok");
        assert_eq!(a["metadata"]["namespace"], "ns");
        assert_eq!(a["metadata"]["name"], "t");
        assert_eq!(a["spec"]["pvcName"], "d");
        let e = token_response("ns", &json!({"spec": {}}), "tok", &now).unwrap_err();
        assert_eq!(e.code, 400);
    }

    #[test]
    fn limits() {
        assert_eq!(upload_limit(16 << 20), (17 << 20) + (64 << 20));
        assert_eq!(upload_limit(u64::MAX), u64::MAX);
    }
}
