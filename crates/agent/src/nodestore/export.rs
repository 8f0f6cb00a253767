//! The agent's export read route (docs/export.md), beside [`super::server`]'s and behind the
//! same token check: `GET /storage/volumes/{name}/export[?handle=LAYER]` streams the raw
//! bytes of the volume (its live chain flattened), or of its snapshot `LAYER` (a handle the
//! volume's recorded chain holds), with `Content-Length`. The API server's export routes
//! stream it on to the downloader; nothing is written on the node. With `&since=LAYER` (an
//! earlier snapshot's layer: an incremental backup) only the chunks written since that layer
//! was frozen are sent, after a JSON line naming them
//! ([`ferrovirt_storage::export::changed::frame`]); a `since` that is not below the snapshot
//! in the chain is answered 400 with the reason.

use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use ferrovirt_storage::provisioner::VolumeRoot;
use http::{StatusCode, header};
use serde::Deserialize;
use serde_json::json;

use super::volume_root;

struct ExportState {
    data_dir: PathBuf,
}

/// `?handle=` of the read route.
#[derive(Debug, Deserialize)]
pub struct ReadQuery {
    pub handle: Option<String>,
    /// Only the chunks changed since this layer was frozen.
    pub since: Option<String>,
}

/// The export route; the caller adds authentication.
pub fn router(data_dir: PathBuf) -> Router {
    Router::new()
        .route("/storage/volumes/{name}/export", get(read))
        .with_state(Arc::new(ExportState { data_dir }))
}

fn answer(code: StatusCode, message: String) -> Response {
    (
        code,
        axum::Json(json!({"code": code.as_u16(), "message": message})),
    )
        .into_response()
}

async fn read(
    State(st): State<Arc<ExportState>>,
    Path(name): Path<String>,
    Query(q): Query<ReadQuery>,
) -> Response {
    let dir = match VolumeRoot::new(volume_root(&st.data_dir)).dir(&name) {
        Ok(d) => d,
        Err(e) => return answer(StatusCode::BAD_REQUEST, e.to_string()),
    };
    if !dir.is_dir() {
        return answer(
            StatusCode::NOT_FOUND,
            format!("volume {name} does not exist on this node"),
        );
    }
    if let Some(since) = &q.since {
        return match ferrovirt_storage::export::changed::open_changed(
            &dir,
            q.handle.as_deref(),
            since,
        )
        .await
        {
            Ok(c) => {
                let (len, stream) = ferrovirt_storage::export::changed::frame(c);
                (
                    [
                        (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                        (header::CONTENT_LENGTH, len.to_string()),
                    ],
                    Body::from_stream(stream),
                )
                    .into_response()
            }
            Err(e) if e.is_permanent() => answer(StatusCode::BAD_REQUEST, e.to_string()),
            Err(e) => answer(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
    }
    match ferrovirt_storage::export::open(&dir, q.handle.as_deref()).await {
        Ok(r) => (
            [
                (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                (header::CONTENT_LENGTH, r.size.to_string()),
            ],
            Body::from_stream(r.stream),
        )
            .into_response(),
        Err(e) if e.is_permanent() => answer(StatusCode::BAD_REQUEST, e.to_string()),
        Err(e) => answer(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}
