//! The agent's node-storage routes (served by [`crate::endpoint`] behind its token check):
//!
//! - `PUT /storage/volumes/{name}` [`CreateVolume`] → [`CreatedVolume`]: a thin `disk.img`
//!   of the size (a loop device over it for Block volumes); idempotent, data kept;
//! - `DELETE /storage/volumes/{name}`: stops a running population, detaches loop devices,
//!   removes the directory (a missing volume is not an error);
//! - `POST /storage/volumes/{name}/resize` [`ResizeVolume`]: grows `disk.img` (and the loop
//!   device's capacity);
//! - `POST /storage/volumes/{name}/populate` [`Populate`]: runs the import / blank / clone
//!   with `ferrovirt_storage` and answers newline-delimited [`JobLine`]s; the client
//!   closing the connection stops the job, and a new population of the same volume replaces
//!   a running one;
//! - `POST /storage/volumes/{name}/upload?capacity=N&limit=M`: the body is an uploaded image
//!   (forwarded by the API server's upload proxy), validated and converted like an import;
//!   answered like a population (409 when the body was interrupted or empty, 413 when it
//!   exceeds the limit).
//!
//! - the snapshot routes of [`super::snapshots`], the export read route of [`super::export`].
//!
//! Every name is a PV name resolved inside [`volume_root`]; bad names and refused sources are
//! answered 400 (the controller fails the DataVolume at once), I/O trouble 500.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{post, put};
use ferrovirt_storage::StorageError;
use ferrovirt_storage::block;
use ferrovirt_storage::importer::{self, ImportRequest};
use ferrovirt_storage::provisioner::{VolumeRoot, create_sparse, image_of};
use ferrovirt_storage::registry::RegistryImportRequest;
use http::StatusCode;
use serde_json::json;

use super::{
    CreateVolume, CreatedVolume, JobLine, Populate, ResizeVolume, Source, progress_step,
    scratch_root, shared_source_ok, volume_root,
};

/// How often a running population repeats its progress when nothing changed.
const HEARTBEAT: Duration = Duration::from_secs(5);

struct StorageState {
    data_dir: PathBuf,
    /// Running populations: volume name → (job number, its task).
    jobs: Mutex<HashMap<String, (u64, tokio::task::AbortHandle)>>,
    next_job: std::sync::atomic::AtomicU64,
}

impl StorageState {
    fn root(&self) -> VolumeRoot {
        VolumeRoot::new(volume_root(&self.data_dir))
    }

    fn stop_job(&self, name: &str) {
        if let Some((_, h)) = self.jobs.lock().expect("lock").remove(name) {
            h.abort();
        }
    }
}

/// The routes, with their state; the caller adds authentication.
pub fn router(data_dir: PathBuf) -> Router {
    let st = Arc::new(StorageState {
        data_dir,
        jobs: Mutex::new(HashMap::new()),
        next_job: std::sync::atomic::AtomicU64::new(1),
    });
    Router::new()
        .route(
            "/storage/volumes/{name}",
            put(create_volume).delete(delete_volume),
        )
        .route("/storage/volumes/{name}/resize", post(resize_volume))
        .route("/storage/volumes/{name}/populate", post(populate))
        .route("/storage/volumes/{name}/upload", post(upload))
        .with_state(st.clone())
        .merge(super::snapshots::router(st.data_dir.clone()))
        .merge(super::export::router(st.data_dir.clone()))
}

fn error(code: StatusCode, message: impl Into<String>) -> Response {
    let body = json!({"code": code.as_u16(), "message": message.into()});
    (code, axum::Json(body)).into_response()
}

/// A request the routes answer with an error.
struct Refusal(StatusCode, String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        error(self.0, self.1)
    }
}

fn refusal(e: &StorageError) -> Refusal {
    let code = if e.is_permanent() {
        StatusCode::BAD_REQUEST
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    };
    Refusal(code, e.to_string())
}

fn storage_error(e: &StorageError) -> Response {
    refusal(e).into_response()
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StorageError> + Send + 'static,
) -> Result<T, StorageError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StorageError::Tool {
            tool: "volume task".into(),
            message: e.to_string(),
        })?
}

/// Parses a JSON body, answering 400 with the reason.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Refusal> {
    serde_json::from_slice(body)
        .map_err(|e| Refusal(StatusCode::BAD_REQUEST, format!("request body: {e}")))
}

async fn create_volume(
    State(st): State<Arc<StorageState>>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    let req: CreateVolume = match parse(&body) {
        Ok(r) => r,
        Err(r) => return r.into_response(),
    };
    let root = st.root();
    let made = blocking(move || {
        let dir = root.create(&name, req.bytes)?;
        if req.block {
            if !block::loop_devices_available() {
                return Err(StorageError::Refused(
                    "Block volumes need loop devices (/dev/loop-control) on the node".into(),
                ));
            }
            block::make_block_volume(&dir)?;
        }
        tracing::info!(volume = %name, path = %dir.display(), bytes = req.bytes, "created node-local volume");
        Ok(dir)
    })
    .await;
    match made {
        Ok(dir) => axum::Json(CreatedVolume {
            path: dir.to_string_lossy().into_owned(),
        })
        .into_response(),
        Err(e) => storage_error(&e),
    }
}

async fn delete_volume(State(st): State<Arc<StorageState>>, Path(name): Path<String>) -> Response {
    let dir = match st.root().dir(&name) {
        Ok(d) => d,
        Err(e) => return storage_error(&e),
    };
    st.stop_job(&name);
    let root = st.root();
    let scratch = scratch_root(&st.data_dir).join(&name);
    let done = blocking(move || {
        if dir.is_dir()
            && let Err(e) = block::detach_all(&image_of(&dir))
        {
            // Removing the file still frees it once the device goes.
            tracing::warn!(volume = %name, error = %e, "detaching loop devices failed");
        }
        root.delete(&name)?;
        let _ = std::fs::remove_dir_all(&scratch);
        tracing::info!(volume = %name, "deleted node-local volume");
        Ok(())
    })
    .await;
    match done {
        Ok(()) => axum::Json(json!({})).into_response(),
        Err(e) => storage_error(&e),
    }
}

async fn resize_volume(
    State(st): State<Arc<StorageState>>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    let req: ResizeVolume = match parse(&body) {
        Ok(r) => r,
        Err(r) => return r.into_response(),
    };
    let dir = match st.root().dir(&name) {
        Ok(d) => d,
        Err(e) => return storage_error(&e),
    };
    if !dir.is_dir() {
        return error(
            StatusCode::NOT_FOUND,
            format!("volume {name} does not exist on this node"),
        );
    }
    let done = blocking(move || {
        ferrovirt_storage::snapshot::check_growable(&dir)?;
        if block::is_block_volume(&dir) {
            block::grow(&dir, req.bytes).map(drop)
        } else {
            create_sparse(&image_of(&dir), req.bytes)
        }
    })
    .await;
    match done {
        Ok(()) => axum::Json(json!({})).into_response(),
        Err(e) => storage_error(&e),
    }
}

/// What a population runs.
enum Work {
    Import(Box<ImportRequest>),
    Registry(Box<RegistryImportRequest>),
    Blank,
    Clone(PathBuf),
    /// A volume's chain (up to a snapshot's layer, or its live top) converted to raw.
    Export {
        dir: PathBuf,
        handle: Option<String>,
    },
}

/// Resolves a request into work on `target` (pure apart from existence checks of sources).
fn plan(
    st: &StorageState,
    name: &str,
    req: Populate,
    target: PathBuf,
) -> Result<(Work, PathBuf), Refusal> {
    let scratch = scratch_root(&st.data_dir).join(name);
    let work = match req.source {
        Source::Http { download, checksum } => Work::Import(Box::new(ImportRequest {
            source: download,
            checksum,
            scratch_dir: scratch,
            target: target.clone(),
            capacity: req.capacity,
        })),
        Source::Registry { image, client } => Work::Registry(Box::new(RegistryImportRequest {
            image,
            client,
            scratch_dir: scratch,
            target: target.clone(),
            capacity: req.capacity,
        })),
        Source::Blank => Work::Blank,
        Source::Volume { name: src } => {
            let dir = st.root().dir(&src).map_err(|e| refusal(&e))?;
            if !dir.is_dir() {
                return Err(Refusal(
                    StatusCode::BAD_REQUEST,
                    format!("clone source volume {src} does not exist on this node"),
                ));
            }
            if block::is_block_volume(&dir) {
                Work::Clone(block::device_of(&dir).map_err(|e| refusal(&e))?)
            } else if dir.join(ferrovirt_storage::snapshot::CHAIN_FILE).exists() {
                // A volume with snapshots is its whole chain, not its bottom `disk.img`.
                Work::Export { dir, handle: None }
            } else {
                Work::Clone(image_of(&dir))
            }
        }
        Source::Snapshot { volume, handle } => {
            let dir = st.root().dir(&volume).map_err(|e| refusal(&e))?;
            if !dir.is_dir() {
                return Err(Refusal(
                    StatusCode::BAD_REQUEST,
                    format!("snapshot source volume {volume} does not exist on this node"),
                ));
            }
            let chain = ferrovirt_storage::snapshot::read_chain(&dir).map_err(|e| refusal(&e))?;
            ferrovirt_storage::snapshot::prefix_to(&chain, &handle).map_err(|e| refusal(&e))?;
            Work::Export {
                dir,
                handle: Some(handle),
            }
        }
        Source::SharedImage { path } => {
            let p = PathBuf::from(&path);
            shared_source_ok(&p, &st.data_dir).map_err(|m| Refusal(StatusCode::BAD_REQUEST, m))?;
            Work::Clone(p)
        }
    };
    Ok((work, target))
}

async fn run(
    work: Work,
    target: PathBuf,
    capacity: u64,
    mut report: impl FnMut(f64) + Send,
) -> Result<(), StorageError> {
    match work {
        Work::Import(req) => importer::import(&req, report).await.map(drop),
        Work::Registry(req) => ferrovirt_storage::registry::import(&req, report)
            .await
            .map(drop),
        Work::Blank => {
            importer::blank(&target, capacity).await?;
            report(100.0);
            Ok(())
        }
        Work::Clone(source) => importer::clone_image(&source, &target, capacity, report).await,
        Work::Export { dir, handle } => {
            blocking(move || super::snapshots::export(&dir, handle.as_deref(), &target)).await?;
            report(100.0);
            Ok(())
        }
    }
}

/// Aborts the population when the answer stream is dropped (the client went away).
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The volume directory of `name` (404 when the node has none) and where its data is
/// written: the loop device of a Block volume, else `disk.img`.
async fn target_of(st: &StorageState, name: &str) -> Result<PathBuf, Refusal> {
    let dir = st.root().dir(name).map_err(|e| refusal(&e))?;
    if !dir.is_dir() {
        return Err(Refusal(
            StatusCode::NOT_FOUND,
            format!("volume {name} does not exist on this node"),
        ));
    }
    if block::is_block_volume(&dir) {
        blocking(move || block::device_of(&dir))
            .await
            .map_err(|e| refusal(&e))
    } else {
        Ok(image_of(&dir))
    }
}

async fn populate(
    State(st): State<Arc<StorageState>>,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    let req: Populate = match parse(&body) {
        Ok(r) => r,
        Err(r) => return r.into_response(),
    };
    let target = match target_of(&st, &name).await {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    let capacity = req.capacity;
    let (work, target) = match plan(&st, &name, req, target) {
        Ok(w) => w,
        Err(r) => return r.into_response(),
    };
    job_response(&st, &name, move |report| {
        run(work, target, capacity, report)
    })
}

/// `POST /storage/volumes/{name}/upload?capacity=N&limit=M`.
#[derive(Debug, serde::Deserialize)]
struct UploadQuery {
    capacity: u64,
    /// The most bytes the body may have.
    limit: u64,
}

/// An upload forwarded by the API server's upload proxy: the body is streamed to the node's
/// scratch space (at most `limit` bytes), then decompressed, validated and converted to raw
/// into the volume exactly like an import; the answer is [`JobLine`]s as for a population
/// (progress is the conversion's half, 50–100).
async fn upload(
    State(st): State<Arc<StorageState>>,
    Path(name): Path<String>,
    axum::extract::Query(q): axum::extract::Query<UploadQuery>,
    body: Body,
) -> Response {
    let target = match target_of(&st, &name).await {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    let scratch = scratch_root(&st.data_dir).join(format!("upload-{name}"));
    let file = match receive(body, &scratch, q.limit).await {
        Ok(f) => f,
        Err(r) => {
            let _ = std::fs::remove_dir_all(&scratch);
            return r.into_response();
        }
    };
    let capacity = q.capacity;
    job_response(&st, &name, move |mut report| async move {
        let out = async {
            let image =
                importer::decompress_if_needed(&file, &scratch.join("image"), q.limit).await?;
            // Checked like any import (format from its header, self-contained, within the
            // claim), never copied as it is.
            let info = importer::inspect(&image, capacity).await?;
            importer::write_raw(&image, &info.format, &target, capacity, |p| {
                report(importer::convert_progress(p))
            })
            .await
        }
        .await;
        let _ = std::fs::remove_dir_all(&scratch);
        out
    })
}

/// Streams `body` into `<scratch>/upload`, at most `limit` bytes.
async fn receive(body: Body, scratch: &std::path::Path, limit: u64) -> Result<PathBuf, Refusal> {
    use futures::StreamExt;
    use tokio::io::AsyncWriteExt;
    let io = |e: std::io::Error| Refusal(StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    let _ = std::fs::remove_dir_all(scratch);
    tokio::fs::create_dir_all(scratch).await.map_err(io)?;
    let path = scratch.join("upload");
    let mut file = tokio::fs::File::create(&path).await.map_err(io)?;
    let mut stream = body.into_data_stream();
    let mut total = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            Refusal(
                StatusCode::CONFLICT,
                format!("the upload was interrupted: {e}"),
            )
        })?;
        total += chunk.len() as u64;
        if total > limit {
            return Err(Refusal(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("image refused: the upload exceeds {limit} bytes"),
            ));
        }
        file.write_all(&chunk).await.map_err(io)?;
    }
    file.flush().await.map_err(io)?;
    if total == 0 {
        return Err(Refusal(
            StatusCode::CONFLICT,
            "the upload was interrupted: the body is empty".into(),
        ));
    }
    Ok(path)
}

/// Runs the job `make` builds (given the progress reporter) for volume `name` in a task and
/// answers its [`JobLine`]s; a new job for the same volume stops a running one, and the
/// client going away stops this one.
fn job_response<F, Fut>(st: &Arc<StorageState>, name: &str, make: F) -> Response
where
    F: FnOnce(Box<dyn FnMut(f64) + Send>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(), StorageError>> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<JobLine>();
    let id = st
        .next_job
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let task = {
        let tx = tx.clone();
        let st = st.clone();
        let name = name.to_string();
        tokio::spawn(async move {
            let progress_tx = tx.clone();
            let mut last = None;
            let report = move |p: f64| {
                if let Some(s) = progress_step(last, p) {
                    last = Some(s);
                    let _ = progress_tx.send(JobLine::Progress { percent: s });
                }
            };
            let result = make(Box::new(report)).await;
            let line = match result {
                Ok(()) => {
                    tracing::info!(volume = %name, "populated node-local volume");
                    JobLine::Done
                }
                Err(e) => {
                    tracing::warn!(volume = %name, error = %e, "populating node-local volume failed");
                    JobLine::Failed {
                        message: e.to_string(),
                        permanent: e.is_permanent(),
                    }
                }
            };
            let _ = tx.send(line);
            let mut jobs = st.jobs.lock().expect("lock");
            if jobs.get(&name).is_some_and(|(j, _)| *j == id) {
                jobs.remove(&name);
            }
        })
    };
    let guard = AbortOnDrop(task.abort_handle());
    if let Some((_, old)) = st
        .jobs
        .lock()
        .expect("lock")
        .insert(name.to_string(), (id, task.abort_handle()))
    {
        old.abort();
    }
    drop(tx);
    let stream = futures::stream::unfold(
        (rx, guard, 0.0_f64, false),
        |(mut rx, guard, mut last, finished)| async move {
            if finished {
                return None;
            }
            let line = match tokio::time::timeout(HEARTBEAT, rx.recv()).await {
                Ok(Some(l)) => l,
                // The task ended without a final line (aborted by a newer population).
                Ok(None) => JobLine::Failed {
                    message: "the population was stopped on the node".into(),
                    permanent: false,
                },
                Err(_) => JobLine::Progress { percent: last },
            };
            if let JobLine::Progress { percent } = line {
                last = percent;
            }
            let end = !matches!(line, JobLine::Progress { .. });
            let mut text = serde_json::to_vec(&line).unwrap_or_default();
            text.push(b'\n');
            Some((
                Ok::<_, std::convert::Infallible>(Bytes::from(text)),
                (rx, guard, last, end),
            ))
        },
    );
    Response::builder()
        .status(StatusCode::OK)
        .header(http::header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|e| error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}
