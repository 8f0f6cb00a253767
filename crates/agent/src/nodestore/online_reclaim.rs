//! Merging a running VMI's released snapshot layers on its node (docs/snapshots.md,
//! "Reclaiming layers while the VM runs"): `POST /storage/vmis/{uid}/reclaim`
//! [`ReclaimOnline`] → `ferrovirt_storage::snapshot::OnlineReport`, behind the endpoint's
//! token check like the other storage routes.
//!
//! The agent finds the volume's launcher disk as an online snapshot does
//! (`online::plan_disks`, a layer of the volume directory's recorded chain), plans the merge
//! exactly as offline (`plan_reclaim` over the layers still held), turns the plan's steps into
//! the launcher's [`MergeStep`]s ([`merge_steps`], pure) and has the launcher run them in QEMU
//! (`ferrovirt_launcher::online_reclaim`). Before the launcher is asked, the plan is recorded
//! as a journal in `chain.json` (`snapshot::journal::begin_online`; a pending one is resolved
//! first, [`super::journal`]). Only once the launcher says the jobs ended is `chain.json`
//! rewritten, and the dropped files are deleted last, except those QEMU still has open
//! (`finish_online`). A failure resolves the journal from the layers QEMU runs (normally the
//! chain as it was). One online merge or online snapshot runs on a node at a time.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::response::{IntoResponse, Response};
use ferrovirt_launcher::control::{LauncherClient, Request as LauncherRequest};
use ferrovirt_launcher::online_reclaim::{MergeDone, MergeRequest, MergeStep};
use ferrovirt_storage::snapshot::{self, ReclaimPlan, reclaim::Step};
use http::StatusCode;
use serde::{Deserialize, Serialize};

use super::online::{OnlineState, check_volume_dir, plan_disks, refuse};

/// `POST /storage/vmis/{uid}/reclaim`: merge the released layers of the VMI's volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReclaimOnline {
    /// The VMI's volume name.
    pub volume: String,
}

/// The launcher steps of a reclaim plan (pure): a rebase of a run of released layers is a
/// stream into the layer above from the held layer below; committing everything into the raw
/// bottom is an active commit.
pub fn merge_steps(plan: &ReclaimPlan) -> Vec<MergeStep> {
    plan.steps
        .iter()
        .filter_map(|s| match s {
            Step::Rebase { image, onto, .. } => Some(MergeStep::Stream {
                image: image.file.clone(),
                base: onto.last()?.file.clone(),
            }),
            Step::CommitAll { layers } => Some(MergeStep::CommitActive {
                base: layers.first()?.file.clone(),
            }),
        })
        .collect()
}

/// How long one merge may take in the launcher (its jobs are bounded by 30 min).
const MERGE_TIMEOUT: Duration = Duration::from_secs(31 * 60);

pub(super) async fn reclaim(
    State(st): State<Arc<OnlineState>>,
    UrlPath(uid): UrlPath<String>,
    body: Bytes,
) -> Response {
    let (req, vmi_dir, spec) =
        match super::online::running_request::<ReclaimOnline>(&st, &uid, &body) {
            Ok(r) => r,
            Err((code, message)) => return refuse(code, message),
        };
    let planned = match plan_disks(&spec, std::slice::from_ref(&req.volume)) {
        Ok(mut p) => p.remove(0),
        Err(e) => return refuse(StatusCode::BAD_REQUEST, e),
    };
    // Runs to its end even when the caller goes away: once QEMU's jobs ended, the record
    // must follow.
    match tokio::spawn(merge_volume(st, uid, req, planned, vmi_dir)).await {
        Ok(r) => r,
        Err(e) => refuse(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

async fn merge_volume(
    st: Arc<OnlineState>,
    uid: String,
    req: ReclaimOnline,
    planned: super::online::PlannedDisk,
    vmi_dir: std::path::PathBuf,
) -> Response {
    let _one = st.one_at_a_time.lock().await;
    if let Some(why) = super::online::carrying(&vmi_dir) {
        return refuse(StatusCode::CONFLICT, why);
    }
    if let Err(e) = super::journal::resolve_running(&vmi_dir, &planned).await {
        return refuse(StatusCode::CONFLICT, e);
    }
    let p = planned.clone();
    let chain = tokio::task::spawn_blocking(move || {
        check_volume_dir(&p)?;
        let chain = snapshot::read_chain(&p.dir).map_err(|e| e.to_string())?;
        let plan = snapshot::plan_reclaim(&chain, &snapshot::held_layers(&chain));
        Ok::<_, String>((chain, plan))
    })
    .await;
    let (chain, plan) = match chain {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return refuse(StatusCode::BAD_REQUEST, e),
        Err(e) => return refuse(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    if plan.is_empty() {
        return axum::Json(snapshot::OnlineReport {
            plain: chain.is_plain(),
            ..Default::default()
        })
        .into_response();
    }
    // The journal first: whatever happens to this process from here on, the record says
    // what the merge leaves.
    let journal = journal_of(&plan, &journal_id());
    let marker = snapshot::journal::marker_name(&journal.id);
    let (dir, planned_chain) = (planned.dir.clone(), chain.clone());
    let begun = tokio::task::spawn_blocking(move || {
        snapshot::journal::begin_online(&dir, &planned_chain, journal)
    })
    .await;
    match begun {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return refuse(StatusCode::CONFLICT, format!("recording the merge: {e}")),
        Err(e) => return refuse(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
    let merge = MergeRequest {
        disk: planned.disk.clone(),
        dir: planned.dir.clone(),
        layers: chain.layers.iter().map(|l| l.file.clone()).collect(),
        steps: merge_steps(&plan),
        pivot_marker: Some(marker),
    };
    let done = match ask_launcher(&vmi_dir, merge).await {
        Ok(d) => d,
        Err((code, e)) => {
            tracing::warn!(%uid, volume = %req.volume, "online layer merge failed: {e}");
            // QEMU may have done part of it (a stream step): record what it runs.
            if let Err(e) = super::journal::resolve_running(&vmi_dir, &planned).await {
                tracing::warn!(%uid, volume = %req.volume, "the merge's journal stays pending: {e}");
            }
            return refuse(code, format!("merging the layers in QEMU: {e}"));
        }
    };
    super::journal::failpoint("online-reclaim-after-merge", &req.volume);
    // QEMU's jobs ended: the record follows, the files go last.
    let dir = planned.dir.clone();
    let finished = tokio::task::spawn_blocking(move || {
        snapshot::finish_online(&dir, &chain, &plan, &done.open)
    })
    .await;
    match finished {
        Ok(Ok(report)) => {
            tracing::info!(%uid, volume = %req.volume, dropped = ?report.dropped,
                kept_open = ?report.kept_open, "released layers merged online");
            axum::Json(report).into_response()
        }
        Ok(Err(e)) => refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("recording the merge: {e}"),
        ),
        Err(e) => refuse(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// The journal of `plan` (pure): its resulting chain and the files it deletes.
pub fn journal_of(plan: &ReclaimPlan, id: &str) -> snapshot::Journal {
    snapshot::Journal {
        id: id.to_string(),
        commit: plan
            .steps
            .iter()
            .any(|s| matches!(s, Step::CommitAll { .. })),
        layers: plan.chain.layers.clone(),
        detached: plan.chain.detached.clone(),
        delete: plan.delete.clone(),
    }
}

/// A fresh journal id: the time in nanoseconds, in hex.
fn journal_id() -> String {
    let ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{ns:x}")
}

async fn ask_launcher(
    vmi_dir: &std::path::Path,
    merge: MergeRequest,
) -> Result<MergeDone, (StatusCode, String)> {
    let mut client = LauncherClient::connect(vmi_dir, Duration::from_secs(10))
        .await
        .map_err(|e| {
            (
                StatusCode::CONFLICT,
                format!("the VMI's launcher does not answer: {e}"),
            )
        })?;
    let v = client
        .request_with_timeout(&LauncherRequest::MergeLayers { merge }, MERGE_TIMEOUT)
        .await
        .map_err(|e| (StatusCode::CONFLICT, e.to_string()))?;
    serde_json::from_value(v).map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrovirt_storage::snapshot::{Chain, plan_snapshot};

    fn chain(n: usize, released: &[&str]) -> Chain {
        let mut c = Chain::default();
        for _ in 0..n {
            c = plan_snapshot(&c).chain;
        }
        c.released = released.iter().map(|s| s.to_string()).collect();
        c
    }

    fn steps(c: &Chain) -> Vec<MergeStep> {
        merge_steps(&snapshot::plan_reclaim(c, &snapshot::held_layers(c)))
    }

    #[test]
    fn a_deleted_only_snapshot_is_an_active_commit_into_the_raw_bottom() {
        assert_eq!(
            steps(&chain(1, &["disk.img"])),
            [MergeStep::CommitActive {
                base: "disk.img".into()
            }]
        );
    }

    #[test]
    fn the_journal_names_the_result_and_the_files_to_delete() {
        let c = chain(1, &["disk.img"]);
        let plan = snapshot::plan_reclaim(&c, &snapshot::held_layers(&c));
        let j = journal_of(&plan, "a1");
        assert!(j.commit);
        assert_eq!(j.layers, plan.chain.layers);
        assert_eq!(j.delete, ["layer-000001.qcow2"]);
        let c = chain(2, &["layer-000001.qcow2"]);
        let j = journal_of(
            &snapshot::plan_reclaim(&c, &snapshot::held_layers(&c)),
            "a2",
        );
        assert!(!j.commit, "a stream");
        assert_eq!(j.delete, ["layer-000001.qcow2"]);
        assert!(snapshot::journal::valid_id(&journal_id()));
    }

    #[test]
    fn released_runs_stream_into_the_layer_above_from_the_held_layer_below() {
        // disk.img (held), l1, l2 (released), l3 (held), top l4.
        let c = chain(4, &["layer-000001.qcow2", "layer-000002.qcow2"]);
        assert_eq!(
            steps(&c),
            [MergeStep::Stream {
                image: "layer-000003.qcow2".into(),
                base: "disk.img".into()
            }]
        );
        // The newest snapshot released: the top pulls it in.
        let c = chain(2, &["layer-000001.qcow2"]);
        assert_eq!(
            steps(&c),
            [MergeStep::Stream {
                image: "layer-000002.qcow2".into(),
                base: "disk.img".into()
            }]
        );
        // Nothing released: nothing to do.
        assert!(steps(&chain(2, &[])).is_empty());
    }
}
