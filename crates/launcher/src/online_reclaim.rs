//! Merging released snapshot layers under a running VM (docs/snapshots.md, "Reclaiming
//! layers while the VM runs"): the QEMU side of `ferrovirt_storage::snapshot::plan_reclaim`.
//!
//! The agent sends the volume's recorded chain (layer file names, bottom first) and the
//! plan's steps as [`MergeStep`]s. The launcher pairs the recorded layers with the running
//! chain's format nodes ([`running_chain`]: the command line's `fmt-<disk>-b<k>` backings
//! below `fmt-<disk>`, then the online snapshots' `fmt-<disk>-s<n>` overlays in order) and
//! turns each step into one QEMU block job ([`plan_jobs`], pure):
//!
//! - [`MergeStep::Stream`] → `block-stream` into the layer above a run of released layers,
//!   with `base-node` the held layer below (the layer above keeps reading the same bytes);
//! - [`MergeStep::CommitActive`] → `block-commit` of the active layer and everything below it
//!   into the bottom (no frozen layer is held any more), `job-complete` once it is ready (the
//!   disk then writes the bottom image directly).
//!
//! A node the job writes that QEMU opened read-only (a backing from the command line) is
//! reopened writable first on a descriptor the launcher opens (`add-fd`, a new protocol node,
//! `blockdev-reopen`): QEMU runs under its own uid and cannot open files in the 0700 volume
//! directories. Each job is followed to its end (`query-jobs`, `job-dismiss`); QEMU's error
//! fails the request and leaves the disk as it is (the layers stay, nothing is lost). After
//! the jobs the dropped nodes are deleted (`blockdev-del`, `remove-fd`), and the answer
//! lists the files of the volume directory QEMU still has open (`/proc/<pid>/fd`), which the
//! agent never deletes.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::cmdline::disk_node_name;
use crate::error::{Error, Result};
use crate::lifecycle::Vm;
use crate::online_snapshot::Tops;

/// One step of a merge, in layer file names of the volume directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "camelCase")]
pub enum MergeStep {
    /// Pull every layer between `base` (kept) and `image` into `image`.
    Stream { image: String, base: String },
    /// Commit the active layer and every layer above `base` into `base`.
    CommitActive { base: String },
}

/// `MergeLayers`: merge released layers of disk `disk` (image files in `dir`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MergeRequest {
    pub disk: String,
    pub dir: PathBuf,
    /// The volume's recorded chain, bottom first (file names in `dir`).
    pub layers: Vec<String>,
    pub steps: Vec<MergeStep>,
    /// The pivot marker (a plain file name in `dir`) written, synced, once an active commit
    /// pivoted and before the guest runs on (`ferrovirt_storage::snapshot::journal`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pivot_marker: Option<String>,
}

/// The answer to a [`MergeRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MergeDone {
    /// Files of the request's `dir` QEMU still has open after the merge.
    pub open: Vec<String>,
}

/// What a QEMU block job does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobKind {
    Stream,
    /// An active commit: `job-complete` once ready.
    CommitActive,
}

/// One QEMU block job of a merge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    pub kind: JobKind,
    /// The node written (the stream's image, the commit's base) and its layer file.
    pub target: String,
    pub target_file: String,
    /// The node under the target after the job (`None`: the bottom).
    pub target_backing: Option<String>,
    /// The stream's base node / the commit's top node.
    pub other: String,
    /// The backing file name the job records in the image above the base.
    pub backing_file: String,
    /// Format nodes that leave the chain.
    pub dropped: Vec<String>,
}

/// The disk's running chain (format nodes, bottom first) among QEMU's node names: the command
/// line's backings `fmt-<disk>-b<k>` (highest `k` lowest), `fmt-<disk>`, then the online
/// snapshots' overlays `fmt-<disk>-s<n>` by `n`.
pub fn running_chain<'a>(disk: &str, names: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let top = disk_node_name(disk);
    let mut backs: Vec<(u32, String)> = Vec::new();
    let mut overlays: Vec<(u32, String)> = Vec::new();
    let mut has_top = false;
    for n in names {
        if n == top {
            has_top = true;
            continue;
        }
        let Some(rest) = n.strip_prefix(&top).and_then(|r| r.strip_prefix('-')) else {
            continue;
        };
        let num = |p: &str| rest.strip_prefix(p).and_then(|k| k.parse::<u32>().ok());
        if let Some(k) = num("b") {
            backs.push((k, n.to_string()));
        } else if let Some(k) = num("s") {
            overlays.push((k, n.to_string()));
        }
    }
    backs.sort_by_key(|b| std::cmp::Reverse(b.0));
    overlays.sort();
    let mut out: Vec<String> = backs.into_iter().map(|(_, n)| n).collect();
    if has_top {
        out.push(top);
    }
    out.extend(overlays.into_iter().map(|(_, n)| n));
    out
}

/// The QEMU jobs of `steps` (pure): `nodes` is the running chain (bottom first), paired one
/// to one with the recorded `layers`. Every refusal says what does not match.
pub fn plan_jobs(nodes: &[String], layers: &[String], steps: &[MergeStep]) -> Result<Vec<Job>> {
    if nodes.len() != layers.len() {
        return Err(Error::InvalidSpec(format!(
            "the running disk has {} layers ({}), the volume records {} ({})",
            nodes.len(),
            nodes.join(", "),
            layers.len(),
            layers.join(", ")
        )));
    }
    let mut chain: Vec<(String, String)> =
        nodes.iter().cloned().zip(layers.iter().cloned()).collect();
    let pos = |chain: &[(String, String)], f: &str| {
        chain.iter().position(|(_, l)| l == f).ok_or_else(|| {
            Error::InvalidSpec(format!("layer {f} is not in the disk's running chain"))
        })
    };
    let mut jobs = Vec::new();
    for step in steps {
        match step {
            MergeStep::Stream { image, base } => {
                let (i, b) = (pos(&chain, image)?, pos(&chain, base)?);
                if b >= i {
                    return Err(Error::InvalidSpec(format!(
                        "stream into {image}: its base {base} is not below it"
                    )));
                }
                let dropped: Vec<String> = chain.drain(b + 1..i).map(|(n, _)| n).collect();
                let i = b + 1;
                jobs.push(Job {
                    kind: JobKind::Stream,
                    target: chain[i].0.clone(),
                    target_file: chain[i].1.clone(),
                    target_backing: Some(chain[b].0.clone()),
                    other: chain[b].0.clone(),
                    backing_file: base.clone(),
                    dropped,
                });
            }
            MergeStep::CommitActive { base } => {
                let b = pos(&chain, base)?;
                if b + 1 >= chain.len() {
                    return Err(Error::InvalidSpec(format!(
                        "commit into {base}: it is the active layer"
                    )));
                }
                let top = chain.last().map(|(n, _)| n.clone()).unwrap_or_default();
                let dropped: Vec<String> = chain.drain(b + 1..).map(|(n, _)| n).collect();
                jobs.push(Job {
                    kind: JobKind::CommitActive,
                    target: chain[b].0.clone(),
                    target_file: chain[b].1.clone(),
                    target_backing: b.checked_sub(1).map(|k| chain[k].0.clone()),
                    other: top,
                    backing_file: base.clone(),
                    dropped,
                });
            }
        }
    }
    Ok(jobs)
}

/// The QMP command and arguments that start `job` as `id` (never dismissed by itself).
pub fn job_command(job: &Job, id: &str) -> (&'static str, Value) {
    match job.kind {
        JobKind::Stream => (
            "block-stream",
            json!({"job-id": id, "device": job.target, "base-node": job.other,
                   "backing-file": job.backing_file, "auto-dismiss": false}),
        ),
        JobKind::CommitActive => (
            "block-commit",
            json!({"job-id": id, "device": job.other, "top-node": job.other,
                   "base-node": job.target, "auto-dismiss": false}),
        ),
    }
}

/// Where a job stands, from `query-jobs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobState {
    Running,
    /// An active commit caught up: `job-complete` switches the disk.
    Ready,
    /// Ended; `Some(error)` when it failed.
    Concluded(Option<String>),
    /// Not listed.
    Gone,
}

/// Job `id`'s state in a `query-jobs` answer (pure).
pub fn job_state(jobs: &Value, id: &str) -> JobState {
    let Some(j) = jobs
        .as_array()
        .and_then(|a| a.iter().find(|j| j["id"] == id))
    else {
        return JobState::Gone;
    };
    match j["status"].as_str().unwrap_or_default() {
        "ready" => JobState::Ready,
        "concluded" | "null" => {
            JobState::Concluded(j.get("error").and_then(Value::as_str).map(String::from))
        }
        _ => JobState::Running,
    }
}

/// The longest a merge job may run.
const JOB_LIMIT: Duration = Duration::from_secs(30 * 60);

/// Carries out `req` (see the module doc).
pub async fn merge(vm: &Vm, tops: &mut Tops, req: &MergeRequest) -> Result<MergeDone> {
    let named = vm
        .qmp()
        .execute("query-named-block-nodes", Some(json!({"flat": true})))
        .await?;
    let list = named.as_array().cloned().unwrap_or_default();
    let names = list.iter().filter_map(|n| n["node-name"].as_str());
    let nodes = running_chain(&req.disk, names);
    let jobs = plan_jobs(&nodes, &req.layers, &req.steps)?;
    let marker = match &req.pivot_marker {
        Some(m) if m.is_empty() || m.contains('/') || m == "." || m == ".." => {
            return Err(Error::InvalidSpec(format!(
                "pivot marker {m:?} is not a plain file name"
            )));
        }
        Some(m) => Some(req.dir.join(m)),
        None => None,
    };
    let mut replaced_files = Vec::new();
    for (k, job) in jobs.iter().enumerate() {
        let read_only = list
            .iter()
            .find(|n| n["node-name"] == job.target.as_str())
            .is_some_and(|n| n["ro"] == true);
        if read_only {
            replaced_files.push(make_writable(vm, tops, &list, job, &req.dir).await?);
        }
        let id = format!("reclaim-{}-{k}", req.disk);
        run_job(vm, job, &id, marker.as_deref()).await?;
        if job.kind == JobKind::CommitActive {
            tops.set_top(&req.disk, &job.target);
        }
    }
    // The dropped nodes (and protocol nodes replaced by a reopen) close their files now.
    let fdsets = file_fdsets(&list);
    let mut to_delete: Vec<String> = Vec::new();
    for job in &jobs {
        for fmt in &job.dropped {
            to_delete.push(fmt.clone());
            to_delete.push(tops.file_of(fmt));
        }
    }
    to_delete.extend(replaced_files);
    for node in to_delete {
        if let Err(e) = vm
            .qmp()
            .execute("blockdev-del", Some(json!({"node-name": node})))
            .await
        {
            tracing::warn!(%node, "blockdev-del after a merge: {e}");
            continue;
        }
        if let Some(id) = fdsets.iter().find(|(n, _)| *n == node).map(|(_, id)| *id)
            && let Err(e) = vm
                .qmp()
                .execute("remove-fd", Some(json!({"fdset-id": id})))
                .await
        {
            tracing::warn!(fdset = id, "remove-fd after a merge: {e}");
        }
    }
    Ok(MergeDone {
        open: open_files(vm.pid(), &req.dir)?,
    })
}

/// Protocol nodes opened on a descriptor set: `(node, fdset id)`.
fn file_fdsets(list: &[Value]) -> Vec<(String, u64)> {
    list.iter()
        .filter_map(|n| {
            let id = n["file"]
                .as_str()?
                .strip_prefix("/dev/fdset/")?
                .parse()
                .ok()?;
            Some((n["node-name"].as_str()?.to_string(), id))
        })
        .collect()
}

/// Reopens `job.target` writable on a descriptor the launcher opens; returns the protocol
/// node it replaced (deleted once the merge is done).
async fn make_writable(
    vm: &Vm,
    tops: &mut Tops,
    list: &[Value],
    job: &Job,
    dir: &std::path::Path,
) -> Result<String> {
    use std::os::fd::AsFd;
    if job.target_file.contains('/') {
        return Err(Error::InvalidSpec(format!(
            "layer name {:?} has a /",
            job.target_file
        )));
    }
    let file = crate::online_snapshot::open_overlay(&dir.join(&job.target_file))?;
    let r = vm
        .qmp()
        .execute_with_fd("add-fd", Some(json!({})), file.as_fd())
        .await?;
    drop(file);
    let fdset = r
        .get("fdset-id")
        .and_then(Value::as_u64)
        .ok_or_else(|| Error::Protocol(format!("add-fd answered without an fdset-id: {r}")))?;
    let new_file = format!(
        "file-{}-w{}",
        job.target.strip_prefix("fmt-").unwrap_or(&job.target),
        tops.next_seq()
    );
    vm.qmp()
        .execute(
            "blockdev-add",
            Some(
                json!({"driver": "file", "filename": format!("/dev/fdset/{fdset}"),
                        "node-name": new_file}),
            ),
        )
        .await?;
    let drv = list
        .iter()
        .find(|n| n["node-name"] == job.target.as_str())
        .and_then(|n| n["drv"].as_str())
        .unwrap_or("raw")
        .to_string();
    let mut opts = json!({"driver": drv, "node-name": job.target, "file": new_file,
                          "read-only": false});
    if drv == "qcow2" {
        opts["backing"] = match &job.target_backing {
            Some(b) => json!(b),
            None => Value::Null,
        };
    }
    let old = tops.file_of(&job.target);
    if let Err(e) = vm
        .qmp()
        .execute("blockdev-reopen", Some(json!({"options": [opts]})))
        .await
    {
        let _ = vm
            .qmp()
            .execute("blockdev-del", Some(json!({"node-name": new_file})))
            .await;
        let _ = vm
            .qmp()
            .execute("remove-fd", Some(json!({"fdset-id": fdset})))
            .await;
        return Err(e);
    }
    tops.files.insert(job.target.clone(), new_file);
    Ok(old)
}

/// Starts `job` as `id` and follows it to its end. An active commit pivots with the
/// guest's vCPUs stopped (when they ran), and `marker` is written and synced after the
/// pivot and before they run again: a guest write to the new top only ever follows the
/// marker (docs/snapshots.md "Order and crashes").
async fn run_job(vm: &Vm, job: &Job, id: &str, marker: Option<&std::path::Path>) -> Result<()> {
    let mut stopped = None;
    let r = follow_job(vm, job, id, marker, &mut stopped).await;
    if let Some(since) = stopped {
        match vm.qmp().execute("cont", None).await {
            Ok(_) => tracing::info!(
                paused_ms = since.elapsed().as_millis() as u64,
                "the guest resumed after a layer merge's pivot"
            ),
            Err(e) => tracing::warn!("resuming the guest after a layer merge's pivot: {e}"),
        }
    }
    r
}

async fn follow_job(
    vm: &Vm,
    job: &Job,
    id: &str,
    marker: Option<&std::path::Path>,
    stopped: &mut Option<std::time::Instant>,
) -> Result<()> {
    let (cmd, args) = job_command(job, id);
    vm.qmp().execute(cmd, Some(args)).await?;
    let until = tokio::time::Instant::now() + JOB_LIMIT;
    let mut completing = false;
    loop {
        let jobs = vm.qmp().execute("query-jobs", None).await?;
        match job_state(&jobs, id) {
            JobState::Running => {}
            JobState::Ready if !completing => {
                if vm.qmp().query_status().await?.running {
                    vm.qmp().execute("stop", None).await?;
                    *stopped = Some(std::time::Instant::now());
                }
                vm.qmp()
                    .execute("job-complete", Some(json!({"id": id})))
                    .await?;
                completing = true;
            }
            JobState::Ready => {}
            JobState::Concluded(err) => {
                let _ = vm
                    .qmp()
                    .execute("job-dismiss", Some(json!({"id": id})))
                    .await;
                if completing
                    && err.is_none()
                    && let Some(m) = marker
                    && let Err(e) = write_marker(m)
                {
                    // The agent records the merge itself once it hears back; only a crash
                    // of the agent and of this VM's QEMU before then would miss the marker.
                    tracing::warn!("writing the pivot marker {}: {e}", m.display());
                }
                return match err {
                    None => Ok(()),
                    Some(e) => Err(Error::Protocol(format!("{cmd} of {}: {e}", job.target))),
                };
            }
            JobState::Gone => {
                return Err(Error::Protocol(format!("{cmd} job {id} disappeared")));
            }
        }
        if tokio::time::Instant::now() >= until {
            let _ = vm
                .qmp()
                .execute("job-cancel", Some(json!({"id": id, "force": true})))
                .await;
            return Err(Error::Protocol(format!(
                "{cmd} of {} did not end within {} s: cancelled",
                job.target,
                JOB_LIMIT.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Creates `path` and syncs it and its directory.
fn write_marker(path: &std::path::Path) -> std::io::Result<()> {
    let f = std::fs::File::create(path)?;
    f.sync_all()?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// The files of `dir` the QEMU process `pid` has open (none when QEMU is gone).
pub(crate) fn open_files(pid: Option<u32>, dir: &std::path::Path) -> Result<Vec<String>> {
    let Some(pid) = pid else {
        return Ok(Vec::new());
    };
    let fds = format!("/proc/{pid}/fd");
    let entries = std::fs::read_dir(&fds).map_err(|e| Error::io(format!("reading {fds}"), e))?;
    let mut out: Vec<String> = entries
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter(|p| p.parent() == Some(dir))
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().to_string()))
        .collect();
    out.sort();
    out.dedup();
    Ok(out)
}

#[cfg(test)]
#[path = "online_reclaim_tests.rs"]
mod tests;
