//! The launcher process (`ferrovirt launcher --dir DIR`): one per VMI, detached from the agent.
//! It reads `spec.json` and `meta.json` from its directory, starts QEMU, serves the control
//! protocol on `control.sock`, follows QMP events and the guest agent, and when QEMU is gone
//! writes `exit.json` (why) and exits. SIGTERM means "shut the VM down within its grace period".
//! A launcher with a [`crate::fence::FenceSpec`] in its meta fences itself: it starts QEMU only
//! before its fence deadline and once its storage leases are free, and a watcher thread kills
//! QEMU when the deadline passes without a newer heartbeat from the agent.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Mutex, mpsc, oneshot};

use crate::control::{
    ExitReason, ExitReport, LaunchMeta, LauncherStatus, OpenedPort, PROTOCOL_VERSION, Reply,
    Request, RunPhase, files, write_json_atomic,
};
use crate::error::{Error, Result};
use crate::fence;
use crate::lifecycle::{ShutdownOutcome, ShutdownPolicy, StartOptions, Vm, VmState};
use crate::process::QemuOptions;
use crate::qga::QgaOptions;
use crate::qmp::EventKind;
use crate::spec::LaunchSpec;

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// What the main loop is asked to do by a control connection.
enum Command {
    Pause,
    Unpause,
    Reset,
    SoftReboot,
    Shutdown {
        grace: Duration,
    },
    GuestInfo,
    OpenPort {
        port: u16,
    },
    ClosePort {
        host_port: u16,
    },
    ResizeDisk {
        disk: String,
        bytes: u64,
    },
    MigrationCert(crate::migtls::Endpoint),
    Migrate {
        fd_socket: PathBuf,
        outgoing: crate::migrate::Outgoing,
    },
    MigrateIncoming {
        fd_socket: PathBuf,
        peer_cert: Option<String>,
        post_copy: bool,
    },
    StartPostCopy,
    MigrateRecover(PathBuf),
    MigrateResume(PathBuf),
    Block(crate::control::BlockOp),
    MigrationStatus,
    MigrateCancel,
    MigratedAway,
    Stats,
    OnlineSnapshot {
        disks: Vec<crate::online_snapshot::OverlayDisk>,
        freeze_timeout: Duration,
    },
    Freeze(Duration),
    Unfreeze,
    GuestExec(Vec<String>, Duration),
    MergeLayers(crate::online_reclaim::MergeRequest),
    DiskLayers(crate::disk_layers::DiskLayersRequest),
}

type Responder = oneshot::Sender<Reply>;

/// How long `query-migrate` may take before the launcher answers without it. Short of the
/// usual command deadline: the target of a broken post-copy migration may have its main
/// loop blocked on a guest page until the recovery, which must not wait behind it.
const MIGRATION_STATUS_WAIT: Duration = Duration::from_secs(8);

/// The pure mapping from the VM's state to the phase the launcher reports.
pub fn run_phase(state: VmState) -> RunPhase {
    match state {
        VmState::Starting => RunPhase::Starting,
        VmState::Running => RunPhase::Running,
        VmState::Paused => RunPhase::Paused,
        VmState::ShuttingDown => RunPhase::ShuttingDown,
        VmState::Shutdown | VmState::Crashed => RunPhase::Exited,
    }
}

/// Decides why QEMU ended, from what the launcher saw.
pub fn exit_reason(
    shutdown: Option<ShutdownOutcome>,
    guest_shutdown_event: bool,
    exit_success: bool,
) -> ExitReason {
    match shutdown {
        Some(ShutdownOutcome::Killed) => ExitReason::Killed,
        Some(_) => ExitReason::Shutdown,
        None if guest_shutdown_event && exit_success => ExitReason::GuestShutdown,
        None => ExitReason::Crashed,
    }
}

/// Runs the launcher in `dir` until QEMU is gone. Returns the exit report it wrote.
pub async fn run(dir: &Path) -> Result<ExitReport> {
    let mut timing = crate::timing::Timeline::default();
    timing.instant("launcher_main");
    let read = |name: &str| -> Result<String> {
        let p = dir.join(name);
        std::fs::read_to_string(&p).map_err(|e| Error::io(p.display().to_string(), e))
    };
    let spec: LaunchSpec = serde_json::from_str(&read(files::SPEC)?)?;
    let meta: LaunchMeta = serde_json::from_str(&read(files::META)?)?;
    let _ = std::fs::remove_file(dir.join(files::EXIT));
    let _ = std::fs::write(dir.join(files::PID), std::process::id().to_string());

    let opts = StartOptions {
        qemu: QemuOptions {
            binary: meta.qemu_binary.clone(),
            log_path: Some(dir.join(files::QEMU_LOG)),
            kill_on_drop: true,
        },
        qga: QgaOptions {
            connect_timeout: Duration::from_secs(1),
            sync_timeout: Duration::from_secs(1),
            command_timeout: Duration::from_secs(5),
        },
        ..Default::default()
    };
    timing.span("read_spec", timing.spans[0].end_us);
    // The launcher joins the VM's memory cgroup first, so QEMU starts inside it.
    let cgroups_start = crate::timing::boottime_us();
    let cgroup = spec.cgroup.clone().and_then(|cg| {
        let h = crate::cgroup::detect(Path::new("/sys/fs/cgroup"))?;
        match crate::cgroup::join(&h, &cg, std::process::id()) {
            Ok(dir) => {
                tracing::info!(
                    "memory cgroup {} (limit {} bytes)",
                    dir.display(),
                    cg.memory_limit_bytes
                );
                Some((h, cg.name))
            }
            Err(e) => {
                tracing::warn!("no memory cgroup for this VM: {e}");
                None
            }
        }
    });
    timing.span("cgroups", cgroups_start);
    let result = start_and_supervise(dir, spec, &meta, &opts, timing).await;
    if let Some((h, name)) = cgroup {
        crate::cgroup::leave(&h, &name, std::process::id());
    }
    result
}

/// Before QEMU starts: a launcher past its fence deadline must not start it, and one whose
/// shared disks' storage leases are held by another VMI waits (bounded) for them. Returns the
/// exit report when QEMU must not start. A live-migration target (`incoming`) takes no
/// storage lease here: it holds the disks only once its guest runs (docs/migration.md).
async fn fence_gate(meta: &LaunchMeta, incoming: bool) -> Option<ExitReport> {
    let spec = meta.fence.clone()?;
    let deadline = fence::deadline(&spec, fence::read_heartbeat(&spec.heartbeat).as_ref());
    if fence::now_ms() > deadline {
        return Some(ExitReport {
            reason: ExitReason::Fenced,
            message: "self-fencing: the node's lease could not be confirmed; QEMU was not \
                      started"
                .into(),
            at: now_secs(),
        });
    }
    if incoming {
        return None;
    }
    let uid = meta.vmi_uid.clone();
    let waited = tokio::task::spawn_blocking(move || {
        fence::acquire_storage_leases(&spec, &uid, deadline, STORAGE_LEASE_WAIT)
    })
    .await;
    match waited {
        Ok(Ok(())) => None,
        Ok(Err(held)) => Some(ExitReport {
            reason: ExitReason::StartFailed,
            message: format!("a shared disk is in use elsewhere: {held}"),
            at: now_secs(),
        }),
        Err(e) => Some(ExitReport {
            reason: ExitReason::StartFailed,
            message: format!("storage lease task: {e}"),
            at: now_secs(),
        }),
    }
}

/// How long `query-blockstats` may take for a metrics scrape (the agent gives up sooner).
const STATS_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a launcher waits for another VMI's storage lease to expire before it gives up.
const STORAGE_LEASE_WAIT: Duration = Duration::from_secs(30);

async fn start_and_supervise(
    dir: &Path,
    spec: LaunchSpec,
    meta: &LaunchMeta,
    opts: &StartOptions,
    mut timing: crate::timing::Timeline,
) -> Result<ExitReport> {
    let incoming = spec.incoming;
    let gate_start = crate::timing::boottime_us();
    let gate = fence_gate(meta, incoming).await;
    timing.span("fence_gate", gate_start);
    if let Some(report) = gate {
        tracing::error!("{}", report.message);
        write_json_atomic(&dir.join(files::EXIT), &report)?;
        return Ok(report);
    }
    let vm = match Vm::start(spec, opts).await {
        Ok(vm) => vm,
        Err(e) => {
            let report = ExitReport {
                reason: ExitReason::StartFailed,
                message: e.to_string(),
                at: now_secs(),
            };
            write_json_atomic(&dir.join(files::EXIT), &report)?;
            return Ok(report);
        }
    };
    if let Some(pid) = vm.pid() {
        let _ = std::fs::write(dir.join(files::QEMU_PID), pid.to_string());
    }
    let (spawn_start, spawned) = vm.process().spawn_us();
    timing.push("qemu_spawn", spawn_start, spawned);
    timing.span("qmp_connect", spawned);
    tracing::info!("start timing: {}", timing.summary());
    let _ = timing.write(&dir.join(crate::timing::LAUNCHER_FILE));
    // The exact command line, for debugging and for benchmarks that replay it.
    let _ = write_json_atomic(&dir.join(files::QEMU_ARGV), &vm.process().argv());
    let status = Arc::new(Mutex::new(LauncherStatus {
        version: PROTOCOL_VERSION,
        launcher_pid: std::process::id(),
        qemu_pid: vm.pid(),
        vmi_uid: meta.vmi_uid.clone(),
        phase: RunPhase::Starting,
        guest_agent_connected: false,
        started_at: now_secs(),
        fs_frozen: false,
    }));
    if let Ok(s) = vm.status().await {
        status.lock().await.phase = run_phase(VmState::from_status(&s));
    }

    let sock_path = dir.join(files::CONTROL);
    let _ = std::fs::remove_file(&sock_path);
    let listener = UnixListener::bind(&sock_path)
        .map_err(|e| Error::io(sock_path.display().to_string(), e))?;
    let (tx, rx) = mpsc::channel::<(Command, Responder)>(16);
    let job_events = count_job_events(&vm);
    let server = tokio::spawn(serve(listener, status.clone(), tx, job_events.1));
    // Whether this launcher's QEMU may write the disks: a migration target only once its
    // guest runs, a migration source no longer once its state was sent.
    let holding = Arc::new(std::sync::atomic::AtomicBool::new(!incoming));
    let watcher = match (&meta.fence, vm.pid()) {
        (Some(f), Some(pid)) => Some(fence::watch_holding(
            f.clone(),
            meta.vmi_uid.clone(),
            pid,
            holding.clone(),
        )),
        _ => None,
    };
    let mut report = main_loop(vm, meta, status.clone(), rx, holding.clone()).await;
    if let Some(w) = &watcher {
        w.stop();
        if let Some(fenced) = w.fenced() {
            report.reason = ExitReason::Fenced;
            report.message = fenced.message();
        }
    }
    if let Some(f) = &meta.fence
        && holding.load(std::sync::atomic::Ordering::SeqCst)
    {
        fence::release_storage_leases(f, &meta.vmi_uid);
    }
    server.abort();
    job_events.0.abort();
    let _ = std::fs::remove_file(&sock_path);
    write_json_atomic(&dir.join(files::EXIT), &report)?;
    Ok(report)
}

async fn main_loop(
    mut vm: Vm,
    meta: &LaunchMeta,
    status: Arc<Mutex<LauncherStatus>>,
    mut rx: mpsc::Receiver<(Command, Responder)>,
    holding: Arc<std::sync::atomic::AtomicBool>,
) -> ExitReport {
    use std::sync::atomic::Ordering;
    let incoming = vm.spec().incoming;
    let mut migrated_away = false;
    let mut events = vm.qmp().subscribe();
    let mut state = run_phase_state(&status).await;
    let mut guest_shutdown = false;
    let mut shutdown_outcome: Option<ShutdownOutcome> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut sigterm =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let mut qga_tick = tokio::time::interval(Duration::from_secs(5));
    let mut tops = crate::online_snapshot::Tops::default();
    // The balloon's statistics polling, switched on by the first `stats` request.
    let mut balloon_polling = false;
    // What a block migration's mirrors copy per second (`Block(Jobs)` answers feed it).
    let mut disk_rate = crate::blockmig::DiskRate::default();
    // This side's ephemeral migration certificate, between `MigrationCert` and the start.
    let mut mig_cert: Option<crate::migtls::EphemeralCert> = None;
    // The deadline of a freeze held on request (`crate::freeze`): thawed then at the latest.
    let mut frozen_until: Option<tokio::time::Instant> = None;
    let exit_status = loop {
        tokio::select! {
            ev = events.recv() => {
                if let Ok(ev) = ev {
                    let kind = ev.kind();
                    if kind == EventKind::Shutdown && ev.guest_initiated() == Some(true) {
                        guest_shutdown = true;
                    }
                    if crate::migrate::migration_completed(&ev) && !incoming {
                        // The source's state is on the target: it never writes the disks again.
                        holding.store(false, Ordering::SeqCst);
                    }
                    state = state.apply(&kind);
                    if incoming && state == VmState::Running {
                        // The incoming stream is complete and the guest runs here: this QEMU
                        // holds the disks now (the watcher renews the storage leases).
                        holding.store(true, Ordering::SeqCst);
                    }
                    status.lock().await.phase = run_phase(state);
                }
            }
            cmd = rx.recv() => {
                let Some((cmd, respond)) = cmd else { continue };
                let reply = match cmd {
                    Command::Pause => vm.pause().await.map(|_| serde_json::Value::Null),
                    Command::Unpause => vm.unpause().await.map(|_| serde_json::Value::Null),
                    Command::Reset => vm.reset().await.map(|_| serde_json::Value::Null),
                    Command::SoftReboot => vm.soft_reboot().await.map(|_| serde_json::Value::Null),
                    Command::GuestInfo => guest_info(&vm).await,
                    Command::OpenPort { port } => vm
                        .open_port(port)
                        .await
                        .map(|host_port| serde_json::json!(OpenedPort { host_port })),
                    Command::ClosePort { host_port } => {
                        vm.close_port(host_port).await.map(|_| serde_json::Value::Null)
                    }
                    Command::ResizeDisk { disk, bytes } => vm
                        .resize_disk(&disk, bytes)
                        .await
                        .map(|r| serde_json::json!(r)),
                    Command::MigrationCert(endpoint) => {
                        crate::migtls::EphemeralCert::generate(endpoint).map(|c| {
                            let cert = c.cert_pem.clone();
                            mig_cert = Some(c);
                            serde_json::json!(crate::control::MigrationCert { cert })
                        })
                    }
                    Command::Migrate { fd_socket, outgoing } => {
                        let cert = mig_cert.take();
                        crate::migrate::outgoing_from(&vm, &fd_socket, cert.as_ref(), &outgoing)
                            .await
                            .map(|_| serde_json::Value::Null)
                    }
                    Command::MigrateIncoming { fd_socket, peer_cert, post_copy } => {
                        let cert = mig_cert.take();
                        let incoming = crate::migrate::Incoming {
                            peer_cert,
                            post_copy,
                        };
                        crate::migrate::incoming_from(&vm, &fd_socket, cert.as_ref(), &incoming)
                            .await
                            .map(|_| serde_json::Value::Null)
                    }
                    Command::StartPostCopy => crate::migrate::start_post_copy(&vm)
                        .await
                        .map(|_| serde_json::Value::Null),
                    Command::MigrateRecover(fd_socket) => {
                        tracing::info!("post-copy recovery: migrate-recover on a new connection");
                        crate::migrate::recover_from(&vm, &fd_socket)
                            .await
                            .map(|_| serde_json::Value::Null)
                    }
                    Command::MigrateResume(fd_socket) => {
                        tracing::info!("post-copy recovery: migrate resume on a new connection");
                        crate::migrate::resume_from(&vm, &fd_socket)
                            .await
                            .map(|_| serde_json::Value::Null)
                    }
                    Command::Block(step) => {
                        let jobs = matches!(step, crate::control::BlockOp::Jobs);
                        let answer = crate::blockmig::run(&vm, step, mig_cert.as_ref(), &tops).await;
                        if let (true, Ok(v)) = (jobs, &answer) {
                            disk_rate.observe(std::time::Instant::now(), v);
                        }
                        answer
                    }
                    Command::MigrationStatus => {
                        let mut answer = vm
                            .qmp()
                            .execute_with_timeout("query-migrate", None, MIGRATION_STATUS_WAIT)
                            .await;
                        // A block migration's mirrors: their copy rate beside QEMU's figures.
                        if let Ok(v) = &mut answer
                            && let Ok(jobs) = vm.qmp().execute("query-block-jobs", None).await
                            && let Some(rate) =
                                disk_rate.observe(std::time::Instant::now(), &jobs)
                            && let Some(o) = v.as_object_mut()
                        {
                            o.insert(crate::blockmig::DISK_RATE_KEY.into(), serde_json::json!(rate));
                        }
                        answer
                    }
                    Command::Stats => {
                        crate::stats::gather(&vm, STATS_TIMEOUT, &mut balloon_polling).await
                    }
                    Command::OnlineSnapshot { disks, freeze_timeout } => {
                        let guest = crate::freeze::snapshot_guest(
                            state == VmState::Paused,
                            frozen_until.is_some(),
                        );
                        crate::online_snapshot::take(&vm, &mut tops, &disks, freeze_timeout, guest)
                            .await
                            .map(|d| serde_json::json!(d))
                    }
                    Command::Freeze(hold) => {
                        let until = tokio::time::Instant::now() + hold;
                        let r = if frozen_until.is_some() {
                            Ok(serde_json::Value::Null)
                        } else {
                            crate::freeze::hold(&vm).await.map(|_| serde_json::Value::Null)
                        };
                        if r.is_ok() {
                            frozen_until = Some(until);
                            status.lock().await.fs_frozen = true;
                        }
                        r
                    }
                    Command::GuestExec(command, timeout) => {
                        crate::guestexec::run(&vm, &command, timeout)
                            .await
                            .map(|d| serde_json::json!(d))
                    }
                    Command::Unfreeze => {
                        crate::freeze::release(&vm).await;
                        frozen_until = None;
                        status.lock().await.fs_frozen = false;
                        Ok(serde_json::Value::Null)
                    }
                    Command::MergeLayers(req) => {
                        crate::online_reclaim::merge(&vm, &mut tops, &req)
                            .await
                            .map(|d| serde_json::json!(d))
                    }
                    Command::DiskLayers(req) => {
                        crate::disk_layers::disk_layers(&vm, &tops, &req)
                            .await
                            .map(|d| serde_json::json!(d))
                    }
                    Command::MigrateCancel => {
                        vm.qmp().execute("migrate_cancel", None).await.map(|_| serde_json::Value::Null)
                    }
                    Command::MigratedAway => {
                        holding.store(false, Ordering::SeqCst);
                        migrated_away = true;
                        let _ = respond.send(Reply::ok(serde_json::Value::Null));
                        if let Err(e) = vm.qmp().quit().await {
                            tracing::warn!("quitting the migrated-away QEMU: {e}; killing it");
                            let _ = vm.kill().await;
                        }
                        continue;
                    }
                    Command::Shutdown { grace } => {
                        status.lock().await.phase = RunPhase::ShuttingDown;
                        let _ = respond.send(Reply::ok(serde_json::Value::Null));
                        shutdown_outcome = Some(shutdown(&mut vm, grace).await);
                        continue;
                    }
                };
                let _ = respond.send(match reply {
                    Ok(v) => Reply::ok(v),
                    Err(e) => Reply::err(e),
                });
            }
            _ = qga_tick.tick(), if pings_guest_agent(state) => {
                let connected = match vm.guest_agent().await {
                    Ok(mut g) => g.ping().await.is_ok(),
                    Err(_) => false,
                };
                status.lock().await.guest_agent_connected = connected;
            }
            _ = async {
                match sigterm.as_mut() {
                    Some(s) => { s.recv().await; }
                    None => std::future::pending::<()>().await,
                }
            } => {
                status.lock().await.phase = RunPhase::ShuttingDown;
                shutdown_outcome = Some(shutdown(&mut vm, Duration::from_secs(meta.grace_seconds)).await);
            }
            _ = tokio::time::sleep_until(frozen_until.unwrap_or_else(tokio::time::Instant::now)),
                if frozen_until.is_some() =>
            {
                tracing::warn!("a requested freeze reached its unfreeze timeout; thawing");
                crate::freeze::release(&vm).await;
                frozen_until = None;
                status.lock().await.fs_frozen = false;
            }
            _ = tick.tick() => {}
        }
        if let Ok(Some(s)) = vm.try_exit_status() {
            break Some(s);
        }
        if shutdown_outcome.is_some() {
            // shutdown() returns only once QEMU is gone (or could not be killed).
            break vm.try_exit_status().ok().flatten();
        }
    };
    // QEMU may exit right after its last events: take those still queued (a guest-initiated
    // SHUTDOWN among them decides the exit reason).
    let drain_until = tokio::time::Instant::now() + Duration::from_millis(500);
    loop {
        match tokio::time::timeout_at(drain_until, events.recv()).await {
            Ok(Ok(ev)) => {
                if ev.kind() == EventKind::Shutdown && ev.guest_initiated() == Some(true) {
                    guest_shutdown = true;
                }
            }
            Ok(Err(tokio::sync::broadcast::error::RecvError::Lagged(_))) => continue,
            Ok(Err(_)) | Err(_) => break,
        }
    }
    status.lock().await.phase = RunPhase::Exited;
    let success = exit_status.is_some_and(|s| s.success());
    let reason = if migrated_away {
        ExitReason::Migrated
    } else {
        exit_reason(shutdown_outcome, guest_shutdown, success)
    };
    let message = match (reason, exit_status) {
        (ExitReason::Crashed, Some(s)) => format!(
            "QEMU exited unexpectedly ({s}): {}",
            vm.process().stderr_tail(2000).trim()
        ),
        (ExitReason::Crashed, None) => "QEMU could not be reaped".to_string(),
        (ExitReason::GuestShutdown, _) => "the guest powered off".to_string(),
        (ExitReason::Shutdown, _) => "shut down on request".to_string(),
        (ExitReason::Killed, _) => {
            "the guest did not power off within its grace period; QEMU was killed".to_string()
        }
        (ExitReason::StartFailed, _) => "QEMU did not start".to_string(),
        (ExitReason::Fenced, _) => "self-fencing".to_string(),
        (ExitReason::Migrated, _) => "live-migrated to another node".to_string(),
    };
    ExitReport {
        reason,
        message,
        at: now_secs(),
    }
}

/// Whether the periodic guest-agent ping runs in `state`: not before the guest first runs
/// (`-S`, a migration target's `-incoming`). Nothing could answer, and the ping would hold the
/// command loop for its sync timeout: a migration target's first request (its ephemeral
/// certificate) waited ~1 s for it.
fn pings_guest_agent(state: VmState) -> bool {
    state != VmState::Starting
}

async fn run_phase_state(status: &Arc<Mutex<LauncherStatus>>) -> VmState {
    match status.lock().await.phase {
        RunPhase::Starting => VmState::Starting,
        RunPhase::Running => VmState::Running,
        RunPhase::Paused => VmState::Paused,
        RunPhase::ShuttingDown => VmState::ShuttingDown,
        RunPhase::Exited => VmState::Shutdown,
    }
}

async fn shutdown(vm: &mut Vm, grace: Duration) -> ShutdownOutcome {
    let policy = ShutdownPolicy {
        grace,
        ..Default::default()
    };
    match vm.shutdown(&policy).await {
        Ok(o) => o,
        Err(e) => {
            tracing::error!("shutdown failed: {e}");
            let _ = vm.kill().await;
            ShutdownOutcome::Killed
        }
    }
}

async fn guest_info(vm: &Vm) -> Result<serde_json::Value> {
    let mut g = vm.guest_agent().await?;
    let os = g.os_info().await.ok();
    let host = g.host_name().await.ok();
    let users = g.users().await.ok();
    let fs = g.fs_info().await.ok();
    let ifaces = g.network_interfaces().await.ok();
    Ok(serde_json::json!({
        "osInfo": os, "hostname": host, "users": users, "filesystems": fs, "interfaces": ifaces
    }))
}

/// Counts QEMU's migration and block-job events ([`crate::control::is_job_event`]) in a
/// task of its own, apart from the command loop (which may be busy with a long command):
/// [`Request::JobEvents`] waits on the count.
fn count_job_events(
    vm: &Vm,
) -> (
    tokio::task::JoinHandle<()>,
    tokio::sync::watch::Receiver<u64>,
) {
    let (seq, rx) = tokio::sync::watch::channel(0u64);
    let mut events = vm.qmp().subscribe();
    let task = tokio::spawn(async move {
        loop {
            match events.recv().await {
                Ok(ev) if crate::control::is_job_event(&ev.event) => seq.send_modify(|n| *n += 1),
                Ok(_) => {}
                // Missed events may have been job events: wake the waiters.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                    seq.send_modify(|n| *n += 1)
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    });
    (task, rx)
}

/// [`Request::JobEvents`]: the count once it passed `after`, or after `wait_ms`.
async fn wait_job_events(
    mut seq: tokio::sync::watch::Receiver<u64>,
    after: u64,
    wait_ms: u64,
) -> u64 {
    let wait = Duration::from_millis(wait_ms.min(crate::control::MAX_EVENT_WAIT_MS));
    let _ = tokio::time::timeout(wait, seq.wait_for(|n| *n > after)).await;
    *seq.borrow()
}

async fn serve(
    listener: UnixListener,
    status: Arc<Mutex<LauncherStatus>>,
    tx: mpsc::Sender<(Command, Responder)>,
    job_events: tokio::sync::watch::Receiver<u64>,
) {
    while let Ok((stream, _)) = listener.accept().await {
        tokio::spawn(connection(
            stream,
            status.clone(),
            tx.clone(),
            job_events.clone(),
        ));
    }
}

async fn connection(
    stream: UnixStream,
    status: Arc<Mutex<LauncherStatus>>,
    tx: mpsc::Sender<(Command, Responder)>,
    job_events: tokio::sync::watch::Receiver<u64>,
) {
    let (r, mut w) = stream.into_split();
    let mut lines = BufReader::new(r).lines();
    let mut greeted = false;
    while let Ok(Some(line)) = lines.next_line().await {
        let reply = match serde_json::from_str::<Request>(&line) {
            Err(e) => Reply::err(format!("bad request: {e}")),
            Ok(Request::Hello { version }) if version == PROTOCOL_VERSION => {
                greeted = true;
                Reply::ok(status.lock().await.clone())
            }
            Ok(Request::Hello { version }) => Reply::err(format!(
                "protocol version {version} is not supported (launcher speaks {PROTOCOL_VERSION})"
            )),
            Ok(_) if !greeted => Reply::err("send hello first"),
            Ok(Request::Status) => Reply::ok(status.lock().await.clone()),
            Ok(Request::JobEvents { after, wait_ms }) => Reply::ok(serde_json::json!(
                wait_job_events(job_events.clone(), after, wait_ms).await
            )),
            Ok(req) => {
                let cmd = match req {
                    Request::Pause => Command::Pause,
                    Request::Unpause => Command::Unpause,
                    Request::Reset => Command::Reset,
                    Request::SoftReboot => Command::SoftReboot,
                    Request::Shutdown { grace_seconds } => Command::Shutdown {
                        grace: Duration::from_secs(grace_seconds),
                    },
                    Request::GuestInfo => Command::GuestInfo,
                    Request::OpenPort { port } => Command::OpenPort { port },
                    Request::ClosePort { host_port } => Command::ClosePort { host_port },
                    Request::ResizeDisk { disk, bytes } => Command::ResizeDisk { disk, bytes },
                    Request::MigrationCert { endpoint } => Command::MigrationCert(endpoint),
                    Request::Migrate {
                        fd_socket,
                        peer_cert,
                        max_bandwidth,
                        auto_converge,
                        block,
                        post_copy,
                    } => Command::Migrate {
                        fd_socket,
                        outgoing: crate::migrate::Outgoing {
                            peer_cert,
                            max_bandwidth,
                            auto_converge,
                            block,
                            post_copy,
                        },
                    },
                    Request::MigrateIncoming {
                        fd_socket,
                        peer_cert,
                        post_copy,
                    } => Command::MigrateIncoming {
                        fd_socket,
                        peer_cert,
                        post_copy,
                    },
                    Request::StartPostCopy => Command::StartPostCopy,
                    Request::MigrateRecover { fd_socket } => Command::MigrateRecover(fd_socket),
                    Request::MigrateResume { fd_socket } => Command::MigrateResume(fd_socket),
                    Request::Block { step } => Command::Block(step),
                    Request::MigrationStatus => Command::MigrationStatus,
                    Request::MigrateCancel => Command::MigrateCancel,
                    Request::MigratedAway => Command::MigratedAway,
                    Request::Stats => Command::Stats,
                    Request::OnlineSnapshot {
                        disks,
                        freeze_timeout_ms,
                    } => Command::OnlineSnapshot {
                        disks,
                        freeze_timeout: Duration::from_millis(freeze_timeout_ms),
                    },
                    Request::Freeze {
                        unfreeze_timeout_seconds,
                    } => Command::Freeze(
                        Duration::from_secs(unfreeze_timeout_seconds).min(crate::freeze::MAX_HOLD),
                    ),
                    Request::Unfreeze => Command::Unfreeze,
                    Request::GuestExec {
                        command,
                        timeout_seconds,
                    } => Command::GuestExec(command, Duration::from_secs(timeout_seconds)),
                    Request::MergeLayers { merge } => Command::MergeLayers(merge),
                    Request::DiskLayers { disk } => Command::DiskLayers(disk),
                    Request::Hello { .. } | Request::Status | Request::JobEvents { .. } => {
                        continue;
                    }
                };
                let (rtx, rrx) = oneshot::channel();
                if tx.send((cmd, rtx)).await.is_err() {
                    Reply::err("the VM is gone")
                } else {
                    rrx.await.unwrap_or_else(|_| Reply::err("the VM is gone"))
                }
            }
        };
        let mut text = serde_json::to_string(&reply).unwrap_or_else(|_| "{}".into());
        text.push('\n');
        if w.write_all(text.as_bytes()).await.is_err() {
            break;
        }
    }
}

/// The directory a launcher for VMI `uid` uses under the agent's data dir.
pub fn vmi_dir(data_dir: &Path, uid: &str) -> PathBuf {
    data_dir.join("vmis").join(uid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_job_event_wait_ends_at_the_next_event_or_its_deadline() {
        let (seq, rx) = tokio::sync::watch::channel(0u64);
        // Nothing new: the deadline.
        let t = std::time::Instant::now();
        assert_eq!(wait_job_events(rx.clone(), 0, 50).await, 0);
        assert!(t.elapsed() >= Duration::from_millis(50));
        // Already past `after`: at once.
        seq.send_modify(|n| *n += 2);
        let t = std::time::Instant::now();
        assert_eq!(wait_job_events(rx.clone(), 1, 5_000).await, 2);
        assert!(t.elapsed() < Duration::from_secs(1));
        // An event while waiting ends the wait.
        let waiter = tokio::spawn(wait_job_events(rx.clone(), 2, 5_000));
        tokio::time::sleep(Duration::from_millis(20)).await;
        seq.send_modify(|n| *n += 1);
        let t = std::time::Instant::now();
        assert_eq!(waiter.await.unwrap(), 3);
        assert!(t.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn no_guest_agent_ping_before_the_guest_runs() {
        assert!(!pings_guest_agent(VmState::Starting));
        assert!(pings_guest_agent(VmState::Running));
        assert!(pings_guest_agent(VmState::Paused));
        assert!(pings_guest_agent(VmState::ShuttingDown));
    }

    #[test]
    fn exit_reasons() {
        assert_eq!(exit_reason(None, true, true), ExitReason::GuestShutdown);
        assert_eq!(exit_reason(None, false, true), ExitReason::Crashed);
        assert_eq!(exit_reason(None, true, false), ExitReason::Crashed);
        assert_eq!(
            exit_reason(Some(ShutdownOutcome::Graceful), true, true),
            ExitReason::Shutdown
        );
        assert_eq!(
            exit_reason(Some(ShutdownOutcome::Killed), false, false),
            ExitReason::Killed
        );
    }

    #[test]
    fn phases() {
        assert_eq!(run_phase(VmState::Paused), RunPhase::Paused);
        assert_eq!(run_phase(VmState::Crashed), RunPhase::Exited);
    }
}
