//! Online snapshots on the node (docs/snapshots.md, "Online snapshots"):
//! `POST /storage/vmis/{uid}/snapshot` [`OnlineSnapshot`] → [`TakenOnline`], behind the
//! endpoint's token check like the other storage routes.
//!
//! For each named volume of the running VMI the agent finds the launcher's disk
//! ([`plan_disks`], pure: the disk id of the volume, a file disk whose image is a layer of its
//! volume directory's recorded chain), creates the empty qcow2 overlay over the chain's top
//! (`ferrovirt_storage::snapshot::prepare_online`, not yet in `chain.json`), and asks the
//! VMI's launcher to switch QEMU to the overlays under a bounded guest-agent freeze
//! (`ferrovirt_launcher::online_snapshot`). Only when the launcher says the switch happened is
//! each chain recorded (`record_snapshot`); on any failure the overlay files are removed and
//! the volumes are as before. One online snapshot runs on a node at a time.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use ferrovirt_launcher::control::{LauncherClient, Request as LauncherRequest, files};
use ferrovirt_launcher::online_snapshot::{OnlineSnapshotDone, OverlayDisk};
use ferrovirt_launcher::spec::{DiskSource, LaunchSpec};
use ferrovirt_storage::snapshot::{self, SnapshotPlan};
use http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::Mutex;

/// `POST /storage/vmis/{uid}/snapshot`: snapshot these volumes of the running VMI at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OnlineSnapshot {
    /// The VMI's volume names.
    pub volumes: Vec<String>,
    /// How long the guest's filesystems may stay frozen.
    pub freeze_timeout_ms: u64,
}

/// One volume of a [`TakenOnline`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TakenVolume {
    pub volume: String,
    /// The frozen layer (a content's `snapshotHandle` is `<pv>/<handle>`).
    pub handle: String,
    /// The volume's size in bytes (`restoreSize`).
    pub size: u64,
}

/// The answer to [`OnlineSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TakenOnline {
    pub volumes: Vec<TakenVolume>,
    /// KubeVirt's indications (`Online`, `GuestAgent` | `NoGuestAgent` | `Paused`,
    /// `QuiesceTimeout`).
    pub indications: Vec<String>,
}

/// The longest freeze a request may ask for.
pub const MAX_FREEZE: Duration = Duration::from_secs(60);

/// One volume's disk in the launcher's spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedDisk {
    pub volume: String,
    pub disk: String,
    /// The disk's image as the VMI started (a layer of the volume's chain).
    pub image: PathBuf,
    /// The volume directory.
    pub dir: PathBuf,
}

/// The launcher disk of each volume (pure): the disk whose id is the volume's
/// (`mapping::disk_id`), a writable file image in a directory. Every refusal names the volume.
pub fn plan_disks(spec: &LaunchSpec, volumes: &[String]) -> Result<Vec<PlannedDisk>, String> {
    if volumes.is_empty() {
        return Err("no volume to snapshot".into());
    }
    let mut out: Vec<PlannedDisk> = Vec::new();
    for v in volumes {
        if out.iter().any(|p| &p.volume == v) {
            return Err(format!("volume {v} is named twice"));
        }
        let id = crate::mapping::disk_id(v);
        let Some(d) = spec.disks.iter().find(|d| d.id == id) else {
            return Err(format!("the VMI has no disk for volume {v}"));
        };
        if d.source == DiskSource::Block {
            return Err(format!(
                "volume {v} is a Block-mode volume: snapshots of Block volumes are not supported"
            ));
        }
        if d.is_readonly() || d.empty {
            return Err(format!("the disk of volume {v} is read-only or empty"));
        }
        let Some(dir) = d.path.parent().filter(|p| !p.as_os_str().is_empty()) else {
            return Err(format!("the disk of volume {v} has no volume directory"));
        };
        out.push(PlannedDisk {
            volume: v.clone(),
            disk: d.id.clone(),
            image: d.path.clone(),
            dir: dir.to_path_buf(),
        });
    }
    Ok(out)
}

/// The image the VMI started with must be a layer of its directory's recorded chain: only a
/// claim volume (never a container disk's or a host disk's image) is snapshotted.
pub(super) fn check_volume_dir(p: &PlannedDisk) -> Result<(), String> {
    if ferrovirt_storage::block::is_block_volume(&p.dir) {
        return Err(format!(
            "volume {} is a Block-mode volume: snapshots of Block volumes are not supported",
            p.volume
        ));
    }
    let chain = snapshot::read_chain(&p.dir).map_err(|e| format!("volume {}: {e}", p.volume))?;
    if !p.dir.join(snapshot::CHAIN_FILE).exists()
        && !p
            .dir
            .join(ferrovirt_storage::provisioner::DISK_IMAGE)
            .exists()
    {
        return Err(format!("volume {} is not a ferrovirt volume", p.volume));
    }
    if !chain.layers.iter().any(|l| p.dir.join(&l.file) == p.image) {
        return Err(format!(
            "the disk of volume {} is not a layer of a ferrovirt volume",
            p.volume
        ));
    }
    Ok(())
}

pub(super) struct OnlineState {
    pub(super) data_dir: PathBuf,
    /// One online snapshot or online merge at a time on the node.
    pub(super) one_at_a_time: Mutex<()>,
}

/// The route; the caller adds authentication.
pub fn router(data_dir: PathBuf) -> Router {
    Router::new()
        .route("/storage/vmis/{uid}/snapshot", post(take))
        .route(
            "/storage/vmis/{uid}/reclaim",
            post(super::online_reclaim::reclaim),
        )
        .with_state(Arc::new(OnlineState {
            data_dir,
            one_at_a_time: Mutex::new(()),
        }))
}

pub(super) fn refuse(code: StatusCode, message: impl Into<String>) -> Response {
    let body = json!({"code": code.as_u16(), "message": message.into()});
    (code, axum::Json(body)).into_response()
}

fn remove_overlays(prepared: &[(PlannedDisk, SnapshotPlan)]) {
    for (p, plan) in prepared {
        let _ = std::fs::remove_file(p.dir.join(&plan.new_top.file));
    }
}

/// Why an online snapshot or merge of the VMI in `vmi_dir` is refused now: its volumes'
/// snapshot chains are being carried by a block migration ([`crate::chaincopy`]), and a layer
/// frozen or merged now would not be on the target.
pub(super) fn carrying(vmi_dir: &std::path::Path) -> Option<String> {
    vmi_dir
        .join(crate::chaincopy::CARRYING_FILE)
        .exists()
        .then(|| {
            "the VMI is being migrated and its volumes' snapshot chains are carried to the \
             target node: snapshots and merges of its volumes are refused until the \
             migration ends"
                .to_string()
        })
}

/// A request about a VMI running here: its body, the VMI's directory and the launch spec its
/// launcher runs; else why not (400 for a bad body or uid, 409 when no launch spec says the
/// VMI runs on this node).
pub(super) fn running_request<T: serde::de::DeserializeOwned>(
    st: &OnlineState,
    uid: &str,
    body: &[u8],
) -> Result<(T, std::path::PathBuf, LaunchSpec), (StatusCode, String)> {
    let req: T = serde_json::from_slice(body)
        .map_err(|e| (StatusCode::BAD_REQUEST, format!("request body: {e}")))?;
    if !crate::endpoint::valid_uid(uid) {
        return Err((StatusCode::BAD_REQUEST, format!("invalid VMI uid {uid:?}")));
    }
    let vmi_dir = ferrovirt_launcher::daemon::vmi_dir(&st.data_dir, uid);
    let spec: LaunchSpec = std::fs::read(vmi_dir.join(files::SPEC))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or_else(|| {
            (
                StatusCode::CONFLICT,
                format!("VMI {uid} is not running on this node"),
            )
        })?;
    Ok((req, vmi_dir, spec))
}

async fn take(
    State(st): State<Arc<OnlineState>>,
    UrlPath(uid): UrlPath<String>,
    body: Bytes,
) -> Response {
    let (req, vmi_dir, spec) = match running_request::<OnlineSnapshot>(&st, &uid, &body) {
        Ok(r) => r,
        Err((code, message)) => return refuse(code, message),
    };
    let planned = match plan_disks(&spec, &req.volumes) {
        Ok(p) => p,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, e),
    };
    let freeze = Duration::from_millis(req.freeze_timeout_ms).min(MAX_FREEZE);
    let _one = st.one_at_a_time.lock().await;
    if let Some(why) = carrying(&vmi_dir) {
        return refuse(StatusCode::CONFLICT, why);
    }
    for p in &planned {
        if let Err(e) = super::journal::resolve_running(&vmi_dir, p).await {
            return refuse(StatusCode::CONFLICT, e);
        }
    }
    let prepared = tokio::task::spawn_blocking(move || {
        let mut done: Vec<(PlannedDisk, SnapshotPlan)> = Vec::new();
        for p in planned {
            let plan = check_volume_dir(&p)
                .and_then(|()| snapshot::prepare_online(&p.dir).map_err(|e| e.to_string()));
            match plan {
                Ok(plan) => done.push((p, plan)),
                Err(e) => {
                    remove_overlays(&done);
                    return Err(e);
                }
            }
        }
        Ok(done)
    })
    .await;
    let prepared = match prepared {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return refuse(StatusCode::BAD_REQUEST, e),
        Err(e) => return refuse(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    let disks: Vec<OverlayDisk> = prepared
        .iter()
        .map(|(p, plan)| OverlayDisk {
            disk: p.disk.clone(),
            overlay: p.dir.join(&plan.new_top.file),
        })
        .collect();
    let switched = switch(&vmi_dir, disks, freeze).await;
    let done = match switched {
        Ok(d) => d,
        Err((code, e)) => {
            remove_overlays(&prepared);
            tracing::warn!(%uid, "online snapshot failed: {e}");
            return refuse(code, e);
        }
    };
    // QEMU writes the overlays now: record each chain.
    let recorded = tokio::task::spawn_blocking(move || {
        let mut taken = Vec::new();
        for (p, plan) in &prepared {
            snapshot::record_snapshot(&p.dir, plan).map_err(|e| e.to_string())?;
            let size = std::fs::metadata(p.dir.join(ferrovirt_storage::provisioner::DISK_IMAGE))
                .map(|m| m.len())
                .map_err(|e| e.to_string())?;
            taken.push(TakenVolume {
                volume: p.volume.clone(),
                handle: plan.handle.clone(),
                size,
            });
        }
        Ok::<_, String>(taken)
    })
    .await;
    match recorded {
        Ok(Ok(volumes)) => {
            tracing::info!(%uid, indications = ?done.indications, "online snapshot recorded");
            axum::Json(TakenOnline {
                volumes,
                indications: done.indications,
            })
            .into_response()
        }
        Ok(Err(e)) => refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("recording the snapshot: {e}"),
        ),
        Err(e) => refuse(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// Asks the VMI's launcher to switch its disks to `disks`.
async fn switch(
    vmi_dir: &Path,
    disks: Vec<OverlayDisk>,
    freeze: Duration,
) -> Result<OnlineSnapshotDone, (StatusCode, String)> {
    let mut client = LauncherClient::connect(vmi_dir, Duration::from_secs(10))
        .await
        .map_err(|e| {
            (
                StatusCode::CONFLICT,
                format!("the VMI's launcher does not answer: {e}"),
            )
        })?;
    let v = client
        .request_with_timeout(
            &LauncherRequest::OnlineSnapshot {
                disks,
                freeze_timeout_ms: freeze.as_millis() as u64,
            },
            // The freeze, the thaw retries and the QMP transaction at most.
            freeze + Duration::from_secs(100),
        )
        .await
        .map_err(|e| (StatusCode::CONFLICT, e.to_string()))?;
    serde_json::from_value(v).map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> LaunchSpec {
        serde_json::from_value(json!({
            "name": "x", "uuid": "u", "memoryMib": 64,
            "disks": [
                {"id": "disk-root", "path": "/d/volumes/pvc-a/disk.img"},
                {"id": "disk-data", "path": "/d/volumes/pvc-b/layer-000001.qcow2", "format": "qcow2"},
                {"id": "disk-blk", "path": "/dev/loop3", "source": "block"},
                {"id": "disk-cd", "path": "/d/x.iso", "cdrom": true},
            ],
            "sockets": {"qmp": "/q"},
        }))
        .unwrap()
    }

    /// While a block migration carries the VMI's chains, its online snapshots and merges are
    /// refused 409, naming why, before anything is prepared.
    #[tokio::test]
    async fn snapshots_and_merges_wait_while_the_chain_is_carried() {
        use http_body_util::BodyExt;
        let data = tempfile::tempdir().unwrap();
        let uid = "0ea9d96b-f045-4de8-850b-aaff50930433";
        let vmi_dir = ferrovirt_launcher::daemon::vmi_dir(data.path(), uid);
        std::fs::create_dir_all(&vmi_dir).unwrap();
        std::fs::write(
            vmi_dir.join(files::SPEC),
            serde_json::to_vec(&spec()).unwrap(),
        )
        .unwrap();
        std::fs::write(vmi_dir.join(crate::chaincopy::CARRYING_FILE), "{}").unwrap();
        let st = Arc::new(OnlineState {
            data_dir: data.path().to_path_buf(),
            one_at_a_time: Mutex::new(()),
        });
        let body = Bytes::from(r#"{"volumes": ["root"], "freezeTimeoutMs": 1000}"#);
        let r = take(State(st.clone()), UrlPath(uid.to_string()), body).await;
        assert_eq!(r.status(), StatusCode::CONFLICT);
        let text = r.into_body().collect().await.unwrap().to_bytes();
        assert!(
            String::from_utf8_lossy(&text).contains("being migrated"),
            "{text:?}"
        );
        let body = Bytes::from(r#"{"volume": "root"}"#);
        let r =
            super::super::online_reclaim::reclaim(State(st), UrlPath(uid.to_string()), body).await;
        assert_eq!(r.status(), StatusCode::CONFLICT);
        // No overlay was prepared anywhere.
        assert!(!std::path::Path::new("/d/volumes").exists());
    }

    #[test]
    fn volumes_map_to_their_disks_and_directories() {
        let p = plan_disks(&spec(), &["root".into(), "data".into()]).unwrap();
        assert_eq!(p[0].disk, "disk-root");
        assert_eq!(p[0].dir, PathBuf::from("/d/volumes/pvc-a"));
        assert_eq!(
            p[1].image,
            PathBuf::from("/d/volumes/pvc-b/layer-000001.qcow2")
        );
    }

    #[test]
    fn refusals_name_the_volume() {
        let s = spec();
        for (vols, want) in [
            (vec![], "no volume"),
            (vec!["nope"], "no disk for volume nope"),
            (vec!["blk"], "Block-mode"),
            (vec!["cd"], "read-only"),
            (vec!["root", "root"], "named twice"),
        ] {
            let vols: Vec<String> = vols.into_iter().map(String::from).collect();
            let e = plan_disks(&s, &vols).unwrap_err();
            assert!(e.contains(want), "{vols:?}: {e}");
        }
    }

    #[test]
    fn only_an_image_of_the_recorded_chain_is_snapshotted() {
        let dir = tempfile::tempdir().unwrap();
        let vol = dir.path().join("pvc-a");
        std::fs::create_dir(&vol).unwrap();
        std::fs::write(vol.join("disk.img"), vec![0u8; 4096]).unwrap();
        let ok = PlannedDisk {
            volume: "root".into(),
            disk: "disk-root".into(),
            image: vol.join("disk.img"),
            dir: vol.clone(),
        };
        assert!(check_volume_dir(&ok).is_ok());
        // A file beside it that the chain does not name (e.g. a container disk overlay).
        let other = PlannedDisk {
            image: vol.join("overlay.qcow2"),
            ..ok.clone()
        };
        assert!(
            check_volume_dir(&other)
                .unwrap_err()
                .contains("not a layer")
        );
        // A directory that is no volume at all.
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let none = PlannedDisk {
            image: empty.join("disk.img"),
            dir: empty,
            ..ok
        };
        assert!(check_volume_dir(&none).is_err());
    }
}
