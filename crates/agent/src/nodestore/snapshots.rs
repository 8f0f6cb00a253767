//! The agent's volume-snapshot routes (docs/snapshots.md), beside [`super::server`]'s and
//! behind the same token check:
//!
//! - `POST /storage/volumes/{name}/snapshots` → [`TakenSnapshot`]: freeze the volume's top
//!   layer and put a new qcow2 layer over it (`ferrovirt_storage::snapshot::take`): constant
//!   time whatever the disk's size. The volume must not be in use by a running VM (the
//!   controller checks; online snapshots go through the VM's QEMU);
//! - `POST /storage/volumes/{name}/revert` [`RevertVolume`]: point the volume back at one of
//!   its snapshots with a fresh top (in-place restore);
//! - `POST /storage/volumes/{name}/reclaim` [`ReclaimVolume`]: record deleted snapshots'
//!   layers as released and, asked to merge, drop them (`ferrovirt_storage::snapshot::reclaim`;
//!   only a volume no running VM writes is merged, the controller checks).
//!
//! - `POST /storage/vmis/{uid}/snapshot`: an online snapshot of a running VMI's volumes
//!   ([`super::online`]).
//!
//! Restoring a snapshot into another volume is a population ([`super::Source::Snapshot`]),
//! done by [`export`].

use std::path::{Path, PathBuf};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use ferrovirt_storage::StorageError;
use ferrovirt_storage::provisioner::VolumeRoot;
use ferrovirt_storage::snapshot;
use http::StatusCode;
use serde_json::json;
use std::sync::Arc;

use super::{ReclaimVolume, RevertVolume, TakenSnapshot, volume_root};

struct SnapState {
    data_dir: PathBuf,
}

/// The snapshot routes; the caller adds authentication.
pub fn router(data_dir: PathBuf) -> Router {
    Router::new()
        .route("/storage/volumes/{name}/snapshots", post(take))
        .route("/storage/volumes/{name}/revert", post(revert))
        .route("/storage/volumes/{name}/reclaim", post(reclaim))
        .with_state(Arc::new(SnapState {
            data_dir: data_dir.clone(),
        }))
        .merge(super::online::router(data_dir))
}

fn answer(e: &StorageError) -> Response {
    let code = if e.is_permanent() {
        StatusCode::BAD_REQUEST
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    };
    let body = json!({"code": code.as_u16(), "message": e.to_string()});
    (code, axum::Json(body)).into_response()
}

/// The directory of volume `name`, or the answer refusing it (boxed: responses are large).
fn volume_dir(st: &SnapState, name: &str) -> Result<PathBuf, Box<Response>> {
    let dir = VolumeRoot::new(volume_root(&st.data_dir))
        .dir(name)
        .map_err(|e| Box::new(answer(&e)))?;
    if !dir.is_dir() {
        let body =
            json!({"code": 404, "message": format!("volume {name} does not exist on this node")});
        return Err(Box::new(
            (StatusCode::NOT_FOUND, axum::Json(body)).into_response(),
        ));
    }
    Ok(dir)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StorageError> + Send + 'static,
) -> Result<T, StorageError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StorageError::Tool {
            tool: "snapshot task".into(),
            message: e.to_string(),
        })?
}

async fn take(State(st): State<Arc<SnapState>>, UrlPath(name): UrlPath<String>) -> Response {
    let dir = match volume_dir(&st, &name) {
        Ok(d) => d,
        Err(r) => return *r,
    };
    let done = blocking(move || {
        let handle = snapshot::take(&dir)?;
        let size = std::fs::metadata(dir.join(ferrovirt_storage::provisioner::DISK_IMAGE))
            .map(|m| m.len())
            .map_err(|e| StorageError::io(&dir, e))?;
        Ok(TakenSnapshot { handle, size })
    })
    .await;
    match done {
        Ok(t) => axum::Json(t).into_response(),
        Err(e) => answer(&e),
    }
}

/// A request body of type `T` for volume `name` and the volume's directory, or the answer
/// refusing them.
fn request<T: serde::de::DeserializeOwned>(
    st: &SnapState,
    name: &str,
    body: &[u8],
) -> Result<(T, PathBuf), Box<Response>> {
    let req = serde_json::from_slice(body).map_err(|e| {
        Box::new(answer(&StorageError::invalid(
            "request body",
            e.to_string(),
        )))
    })?;
    Ok((req, volume_dir(st, name)?))
}

async fn revert(
    State(st): State<Arc<SnapState>>,
    UrlPath(name): UrlPath<String>,
    body: Bytes,
) -> Response {
    let (req, dir): (RevertVolume, _) = match request(&st, &name, &body) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    match blocking(move || snapshot::revert(&dir, &req.handle)).await {
        Ok(()) => axum::Json(json!({})).into_response(),
        Err(e) => answer(&e),
    }
}

async fn reclaim(
    State(st): State<Arc<SnapState>>,
    UrlPath(name): UrlPath<String>,
    body: Bytes,
) -> Response {
    let (req, dir): (ReclaimVolume, _) = match request(&st, &name, &body) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let done = blocking(move || {
        snapshot::release(&dir, &req.release)?;
        if req.merge {
            snapshot::reclaim(&dir)
        } else {
            Ok(Default::default())
        }
    })
    .await;
    match done {
        Ok(report) => axum::Json(report).into_response(),
        Err(e) => answer(&e),
    }
}

/// Write snapshot `handle` (the live chain when `None`) of the volume in `dir` into `target`.
pub fn export(dir: &Path, handle: Option<&str>, target: &Path) -> Result<(), StorageError> {
    snapshot::export_raw(dir, handle, target)
}
