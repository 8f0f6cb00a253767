//! Block migration in the launcher (docs/migration.md "Node-local disks"): the QMP side of
//! copying node-local disks to the migration target, QEMU to QEMU. The target's QEMU
//! (waiting with `-incoming`) serves its fresh, same-sized disks writable over NBD on the
//! listening TCP socket its agent bound on the node address and hands over; the source's
//! QEMU opens an NBD client per disk on a connection its agent made and hands over, both with
//! QEMU's own TLS from the migration's ephemeral certificates (`tls-creds-x509`, the peer's
//! certificate the only one trusted), mirrors each disk with `blockdev-mirror`, and, paused
//! before the switch-over, completes the mirrors (a last copy, no pivot: the source keeps its
//! own disks) before the memory's last round is sent. No agent copies a byte. The argument
//! builders are pure and unit-tested.

use std::collections::VecDeque;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::cmdline::disk_node_name;
use crate::control::{BlockOp, MirrorDisk};
use crate::error::{Error, Result};
use crate::lifecycle::Vm;
use crate::migtls::{self, EphemeralCert};

/// How fast a block migration's mirrors copy, from the `query-block-jobs` answers the launcher
/// sees (the agent's follow loop asks every 50 ms): bytes per second over the last
/// [`DiskRate::WINDOW`]. Pure over the instants it is given.
#[derive(Debug, Default)]
pub struct DiskRate {
    samples: VecDeque<(Instant, u64)>,
}

impl DiskRate {
    /// The span the rate is measured over.
    pub const WINDOW: Duration = Duration::from_secs(2);
    /// The shortest span a rate is given for.
    const MIN_SPAN: Duration = Duration::from_millis(100);

    /// Records the mirrors' progress in `jobs` (a `query-block-jobs` answer) at `now`; the
    /// rate, once two answers at least [`Self::MIN_SPAN`] apart are in the window. No mirror
    /// job (none started, or they ended) forgets what was seen; so does progress going back
    /// (new mirrors).
    pub fn observe(&mut self, now: Instant, jobs: &Value) -> Option<f64> {
        let mirrors: Vec<&Value> = jobs
            .as_array()
            .into_iter()
            .flatten()
            .filter(|j| {
                j["device"]
                    .as_str()
                    .is_some_and(|d| d.starts_with("mirror-"))
            })
            .collect();
        if mirrors.is_empty() {
            self.samples.clear();
            return None;
        }
        let copied: u64 = mirrors
            .iter()
            .map(|j| j["offset"].as_u64().unwrap_or(0))
            .sum();
        if self.samples.back().is_some_and(|&(_, last)| copied < last) {
            self.samples.clear();
        }
        self.samples.push_back((now, copied));
        while self
            .samples
            .front()
            .is_some_and(|&(t, _)| now.duration_since(t) > Self::WINDOW)
        {
            self.samples.pop_front();
        }
        let &(t0, first) = self.samples.front()?;
        let span = now.duration_since(t0);
        (span >= Self::MIN_SPAN).then(|| (copied - first) as f64 / span.as_secs_f64())
    }
}

/// The key under which the launcher adds the mirrors' rate (bytes per second) to its answer
/// to a migration status request, beside QEMU's `query-migrate` figures.
pub const DISK_RATE_KEY: &str = "ferrovirtDiskTransferRate";

/// The NBD client node the source mirrors `disk` into.
pub fn client_node(disk: &str) -> String {
    format!("nbd-{disk}")
}

/// The mirror job of `disk`.
pub fn job_id(disk: &str) -> String {
    format!("mirror-{disk}")
}

/// `block-export-add`: `disk`'s format node, writable, exported under the disk's id.
pub fn export_args(disk: &str) -> Value {
    json!({"type": "nbd", "id": format!("export-{disk}"), "node-name": disk_node_name(disk),
           "name": disk, "writable": true})
}

/// `blockdev-add` of the NBD client for `disk` on the connection passed as `fdname`; with
/// `tls`, QEMU's TLS under the NBD credentials object, the target's certificate required to
/// name [`migtls::TARGET_HOSTNAME`] (mandatory on an fd: there is no host name to check).
pub fn client_args(disk: &str, fdname: &str, tls: bool) -> Value {
    let mut a = json!({"driver": "nbd", "node-name": client_node(disk),
           "server": {"type": "fd", "str": fdname}, "export": disk});
    if tls {
        a["tls-creds"] = json!(migtls::NBD_CREDS_ID);
        a["tls-hostname"] = json!(migtls::TARGET_HOSTNAME);
    }
    a
}

/// `nbd-server-start` on the listening socket passed as `fdname`, at most one connection
/// per disk; with `tls`, only a client completing QEMU's TLS with the source's certificate.
pub fn server_args(fdname: &str, disks: usize, tls: bool) -> Value {
    let mut a = json!({"addr": {"type": "fd", "data": {"str": fdname}},
                       "max-connections": disks});
    if tls {
        a["tls-creds"] = json!(migtls::NBD_CREDS_ID);
    }
    a
}

/// `blockdev-mirror` of `disk` (what the guest sees, its format node) to its NBD client;
/// the target is empty, so everything is copied — or, with `top_only`, the target's empty
/// top lies over the same frozen layers (carried by the agents), so only the data of the
/// source's top layer is (`sync: top`).
/// `device`: the disk's current top node (`fmt-<disk>`, or an online snapshot's overlay).
pub fn mirror_args(disk: &str, device: &str, top_only: bool) -> Value {
    json!({"job-id": job_id(disk), "device": device,
           "target": client_node(disk), "sync": if top_only { "top" } else { "full" }})
}

/// The virtual size of each named block node in a `query-named-block-nodes` answer.
pub fn node_size(nodes: &Value, node: &str) -> Option<u64> {
    nodes
        .as_array()?
        .iter()
        .find(|n| n["node-name"] == node)?
        .get("image")?
        .get("virtual-size")?
        .as_u64()
}

/// Whether every job of `disks` is in `query-block-jobs` and ready (in sync); `Err` names
/// a disk whose job is gone (it failed).
pub fn all_ready(jobs: &Value, disks: &[String]) -> std::result::Result<bool, String> {
    let list = jobs.as_array().cloned().unwrap_or_default();
    let mut ready = true;
    for d in disks {
        match list.iter().find(|j| j["device"] == job_id(d)) {
            None => return Err(format!("the mirror of disk {d} stopped")),
            Some(j) => ready &= j["ready"] == true,
        }
    }
    Ok(ready)
}

/// Runs one block-migration step on `vm`; `cert`: this side's ephemeral migration pair
/// (needed when the step names the peer's certificate).
/// `tops`: each disk's current top node (online snapshots move it).
pub async fn run(
    vm: &Vm,
    step: BlockOp,
    cert: Option<&EphemeralCert>,
    tops: &crate::online_snapshot::Tops,
) -> Result<Value> {
    match step {
        BlockOp::Export {
            fd_socket,
            disks,
            peer_cert,
        } => {
            let listener = receive(&fd_socket).await?;
            if let Some(peer) = &peer_cert {
                let ours = crate::migrate::needs_cert(cert, migtls::Endpoint::Server)?;
                crate::migrate::install_creds_as(vm, migtls::NBD_CREDS_ID, ours, peer).await?;
            }
            vm.qmp()
                .execute_with_fd(
                    "getfd",
                    Some(json!({"fdname": "nbd-listen"})),
                    listener.as_fd(),
                )
                .await?;
            vm.qmp()
                .execute(
                    "nbd-server-start",
                    Some(server_args("nbd-listen", disks.len(), peer_cert.is_some())),
                )
                .await?;
            for d in &disks {
                vm.qmp()
                    .execute("block-export-add", Some(export_args(d)))
                    .await?;
            }
            Ok(Value::Null)
        }
        BlockOp::Mirror { disks, peer_cert } => {
            let mut steps = Steps::default();
            if let Some(peer) = &peer_cert {
                let ours = crate::migrate::needs_cert(cert, migtls::Endpoint::Client)?;
                crate::migrate::install_creds_as(vm, migtls::NBD_CREDS_ID, ours, peer).await?;
                steps.mark("creds");
            }
            mirror(vm, &disks, peer_cert.is_some(), tops, &mut steps).await?;
            Ok(json!({"steps": steps.0}))
        }
        BlockOp::Jobs => vm.qmp().execute("query-block-jobs", None).await,
        BlockOp::SwitchOver => switch_over(vm).await,
        BlockOp::Cancel => {
            cancel(vm).await;
            Ok(Value::Null)
        }
        BlockOp::StopExport => vm.qmp().execute("nbd-server-stop", None).await,
    }
}

/// The socket the agent hands over on `path`.
async fn receive(path: &std::path::Path) -> Result<std::os::fd::OwnedFd> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || crate::migrate::receive_fd(&path))
        .await
        .map_err(|e| Error::BlockMigration(e.to_string()))?
}

/// How long each step of a block operation took (milliseconds, in order), for the agent's
/// log: where a mirror's start goes.
#[derive(Debug)]
struct Steps(Vec<(&'static str, u64)>, Instant);

impl Default for Steps {
    fn default() -> Self {
        Steps(Vec::new(), Instant::now())
    }
}

impl Steps {
    fn mark(&mut self, step: &'static str) {
        let now = Instant::now();
        self.0
            .push((step, now.duration_since(self.1).as_millis() as u64));
        self.1 = now;
    }
}

async fn mirror(
    vm: &Vm,
    disks: &[MirrorDisk],
    tls: bool,
    tops: &crate::online_snapshot::Tops,
    steps: &mut Steps,
) -> Result<()> {
    for d in disks {
        let conn = receive(&d.socket).await?;
        steps.mark("receive");
        let fdname = format!("nbd-{}", d.disk);
        vm.qmp()
            .execute_with_fd("getfd", Some(json!({"fdname": fdname})), conn.as_fd())
            .await?;
        drop(conn);
        steps.mark("getfd");
        if let Err(e) = vm
            .qmp()
            .execute("blockdev-add", Some(client_args(&d.disk, &fdname, tls)))
            .await
        {
            cancel(vm).await;
            return Err(e);
        }
        steps.mark("blockdev-add");
        let nodes = vm
            .qmp()
            .execute("query-named-block-nodes", Some(json!({"flat": true})))
            .await?;
        let top = tops.top(&d.disk);
        let ours = node_size(&nodes, &top);
        let theirs = node_size(&nodes, &client_node(&d.disk));
        if ours != theirs {
            cancel(vm).await;
            return Err(Error::BlockMigration(format!(
                "disk {}: the target's copy has {theirs:?} bytes, the source {ours:?}",
                d.disk
            )));
        }
        steps.mark("sizes");
        vm.qmp()
            .execute(
                "blockdev-mirror",
                Some(mirror_args(&d.disk, &top, d.top_only)),
            )
            .await?;
        steps.mark("blockdev-mirror");
    }
    Ok(())
}

/// The mirror jobs' device names now running.
async fn jobs(vm: &Vm) -> Vec<String> {
    vm.qmp()
        .execute("query-block-jobs", None)
        .await
        .ok()
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|j| j["device"].as_str().map(String::from))
        .filter(|d| d.starts_with("mirror-"))
        .collect()
}

/// The NBD client nodes present.
async fn clients(vm: &Vm) -> Vec<String> {
    vm.qmp()
        .execute("query-named-block-nodes", Some(json!({"flat": true})))
        .await
        .ok()
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|n| n["node-name"].as_str().map(String::from))
        .filter(|n| n.starts_with("nbd-"))
        .collect()
}

async fn switch_over(vm: &Vm) -> Result<Value> {
    let mut events = vm.qmp().subscribe();
    let running = jobs(vm).await;
    for j in &running {
        // A ready mirror's cancel copies what is still dirty and ends without a pivot.
        vm.qmp()
            .execute("block-job-cancel", Some(json!({"device": j})))
            .await?;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let mut done = 0;
    while done < running.len() {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Ok(ev)) if ev.event == "BLOCK_JOB_COMPLETED" => {
                if let Some(err) = ev.data.get("error").and_then(|e| e.as_str()) {
                    cancel(vm).await;
                    return Err(Error::BlockMigration(format!(
                        "completing the mirror {}: {err}",
                        ev.data["device"].as_str().unwrap_or("?")
                    )));
                }
                done += 1;
            }
            Ok(Ok(ev)) if ev.event == "BLOCK_JOB_CANCELLED" => {
                cancel(vm).await;
                return Err(Error::BlockMigration(format!(
                    "the mirror {} was cancelled before it completed",
                    ev.data["device"].as_str().unwrap_or("?")
                )));
            }
            Ok(Ok(_)) | Ok(Err(tokio::sync::broadcast::error::RecvError::Lagged(_))) => {
                // Events may have been missed: the job list decides.
                if jobs(vm).await.is_empty() {
                    break;
                }
            }
            Ok(Err(_)) | Err(_) => {
                cancel(vm).await;
                return Err(Error::BlockMigration(
                    "the mirrors did not complete in time".into(),
                ));
            }
        }
    }
    for n in clients(vm).await {
        vm.qmp()
            .execute("blockdev-del", Some(json!({"node-name": n})))
            .await?;
    }
    vm.qmp()
        .execute("migrate-continue", Some(json!({"state": "pre-switchover"})))
        .await
}

/// Stops the mirrors and drops the NBD clients; errors are logged only (the VM keeps its
/// own disks whatever happens to the copies).
async fn cancel(vm: &Vm) {
    for j in jobs(vm).await {
        if let Err(e) = vm
            .qmp()
            .execute(
                "block-job-cancel",
                Some(json!({"device": j, "force": true})),
            )
            .await
        {
            tracing::warn!("cancelling the mirror {j}: {e}");
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !jobs(vm).await.is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for n in clients(vm).await {
        if let Err(e) = vm
            .qmp()
            .execute("blockdev-del", Some(json!({"node-name": n})))
            .await
        {
            tracing::warn!("removing the NBD client {n}: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_disk_rate_is_measured_over_the_window() {
        let t = Instant::now();
        let at = |ms: u64| t + Duration::from_millis(ms);
        let jobs = |a: u64, b: u64| {
            json!([{"device": "mirror-disk0", "offset": a, "len": 1u64 << 30},
                   {"device": "mirror-disk1", "offset": b, "len": 1u64 << 30},
                   {"device": "stream-x", "offset": 999_999_999u64}])
        };
        let mut r = DiskRate::default();
        assert_eq!(r.observe(at(0), &jobs(0, 0)), None);
        assert_eq!(r.observe(at(50), &jobs(1000, 0)), None, "too short a span");
        assert_eq!(
            r.observe(at(500), &jobs(40_000_000, 10_000_000)),
            Some(100_000_000.0)
        );
        // 3 s later the first samples left the window: the rate of the last 2 s.
        r.observe(at(1500), &jobs(100_000_000, 50_000_000));
        let rate = r
            .observe(at(3500), &jobs(150_000_000, 100_000_000))
            .unwrap();
        assert_eq!(rate, 50_000_000.0);
        // The mirrors ended: nothing; new mirrors start from zero.
        assert_eq!(r.observe(at(3600), &json!([])), None);
        assert_eq!(r.observe(at(3700), &jobs(5, 5)), None);
        r.observe(at(3800), &jobs(10, 10));
        assert_eq!(r.observe(at(3900), &jobs(1, 1)), None, "progress went back");
    }

    #[test]
    fn arguments() {
        assert_eq!(export_args("root")["node-name"], "fmt-root");
        assert_eq!(export_args("root")["writable"], true);
        assert_eq!(
            client_args("root", "nbd-root", false)["server"],
            json!({"type": "fd", "str": "nbd-root"})
        );
        assert!(
            client_args("root", "nbd-root", false)
                .get("tls-creds")
                .is_none()
        );
        let tls = client_args("root", "nbd-root", true);
        assert_eq!(tls["tls-creds"], "nbd-tls");
        assert_eq!(tls["tls-hostname"], migtls::TARGET_HOSTNAME);
        let srv = server_args("nbd-listen", 2, true);
        assert_eq!(
            srv["addr"],
            json!({"type": "fd", "data": {"str": "nbd-listen"}})
        );
        assert_eq!(srv["max-connections"], 2);
        assert_eq!(srv["tls-creds"], "nbd-tls");
        assert!(
            server_args("nbd-listen", 1, false)
                .get("tls-creds")
                .is_none()
        );
        let m = mirror_args("root", &disk_node_name("root"), false);
        assert_eq!(m["device"], "fmt-root");
        assert_eq!(m["target"], "nbd-root");
        assert_eq!(m["sync"], "full");
        let t = mirror_args("root", "overlay-root-1", true);
        assert_eq!(t["sync"], "top");
        assert_eq!(t["device"], "overlay-root-1");
        assert_eq!(t["job-id"], job_id("root"));
    }

    #[test]
    fn sizes_and_readiness() {
        let nodes = json!([{"node-name": "fmt-root", "image": {"virtual-size": 10}},
                           {"node-name": "nbd-root", "image": {"virtual-size": 12}}]);
        assert_eq!(node_size(&nodes, "fmt-root"), Some(10));
        assert_eq!(node_size(&nodes, "x"), None);
        let disks = vec!["a".to_string(), "b".to_string()];
        let jobs = json!([{"device": "mirror-a", "ready": true},
                          {"device": "mirror-b", "ready": false}]);
        assert_eq!(all_ready(&jobs, &disks), Ok(false));
        let jobs = json!([{"device": "mirror-a", "ready": true},
                          {"device": "mirror-b", "ready": true}]);
        assert_eq!(all_ready(&jobs, &disks), Ok(true));
        let jobs = json!([{"device": "mirror-a", "ready": true}]);
        assert!(all_ready(&jobs, &disks).unwrap_err().contains("disk b"));
    }
}
