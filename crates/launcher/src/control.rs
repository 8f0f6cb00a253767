//! The agent ↔ launcher protocol: JSON lines over the unix socket `control.sock` in the VMI's
//! directory. The first exchange is a versioned handshake (`hello`); after it, each request line
//! gets one reply line. Also the files a launcher keeps in its directory (`spec.json`,
//! `meta.json`, `exit.json`) and the client the agent uses.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

use crate::error::{Error, Result};

/// Version of the control protocol. A launcher refuses a hello with another major version.
pub const PROTOCOL_VERSION: u32 = 1;

/// File names inside a VMI directory.
pub mod files {
    pub const SPEC: &str = "spec.json";
    pub const META: &str = "meta.json";
    pub const CONTROL: &str = "control.sock";
    pub const EXIT: &str = "exit.json";
    pub const PID: &str = "launcher.pid";
    /// QEMU's pid, written when it started (the agent kills a QEMU whose launcher died
    /// without a report).
    pub const QEMU_PID: &str = "qemu.pid";
    pub const LOG: &str = "launcher.log";
    pub const QEMU_LOG: &str = "qemu.log";
    /// QEMU's argv (JSON array, without the binary).
    pub const QEMU_ARGV: &str = "qemu-argv.json";
}

/// Who this launcher runs for (written by the agent next to `spec.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LaunchMeta {
    pub vmi_uid: String,
    pub namespace: String,
    pub name: String,
    /// terminationGracePeriodSeconds: used when the launcher itself is asked to stop (SIGTERM).
    pub grace_seconds: u64,
    /// Path of the QEMU binary.
    #[serde(default = "default_qemu")]
    pub qemu_binary: PathBuf,
    /// Self-fencing ([`crate::fence`]): kill QEMU when the node's lease cannot be confirmed.
    /// Absent: the VM keeps running whatever happens to the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<crate::fence::FenceSpec>,
    /// The VMI's interface names by index (`spec.domain.devices.interfaces[i].name`, NIC
    /// `net<i>`): the `interface` label of the agent's network metrics.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<String>,
    /// Labels of the VMI's `kubevirt_vmi_info` metric known when it started (`os`,
    /// `workload`, `flavor`, `instance_type`, `preference`).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub info_labels: std::collections::BTreeMap<String, String>,
}

fn default_qemu() -> PathBuf {
    PathBuf::from("qemu-system-x86_64")
}

/// A request from the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "camelCase")]
pub enum Request {
    Hello {
        version: u32,
    },
    Status,
    Pause,
    Unpause,
    Reset,
    SoftReboot,
    /// ACPI power button; QEMU is killed after `grace_seconds`.
    #[serde(rename_all = "camelCase")]
    Shutdown {
        grace_seconds: u64,
    },
    /// Guest agent data: OS info, hostname, users, filesystems, interfaces.
    GuestInfo,
    /// Port forwarding into a guest on user-mode networking: the launcher adds a QEMU host
    /// forward from a free `127.0.0.1` port to the guest's TCP `port` and replies
    /// [`OpenedPort`]. The caller connects to it, then sends [`Request::ClosePort`].
    OpenPort {
        port: u16,
    },
    /// Removes a forward made by [`Request::OpenPort`] (connections made through it stay).
    #[serde(rename_all = "camelCase")]
    ClosePort {
        host_port: u16,
    },
    /// Grows a raw disk to `bytes` while the VM runs (QMP `block_resize`, after the volume
    /// behind it grew): never shrinks; a size not above the current one changes nothing.
    /// Replies [`ResizedDisk`].
    ResizeDisk {
        disk: String,
        bytes: u64,
    },
    /// Live migration, either side: makes this side's ephemeral TLS certificate for one
    /// migration (a fresh key pair kept in the launcher, [`crate::migtls`]) and replies
    /// [`MigrationCert`]; the agents exchange the certificates over their authenticated
    /// channel.
    MigrationCert {
        endpoint: crate::migtls::Endpoint,
    },
    /// Live migration, source side: the launcher connects to `fdSocket` (the agent's unix
    /// socket in the VMI directory), receives the TCP connection to the target node on it
    /// (SCM_RIGHTS) and hands it to QEMU (`getfd`, `migrate fd:`); with `peerCert` (the
    /// target's ephemeral certificate) QEMU encrypts the stream with TLS trusting exactly
    /// it. At most `maxBandwidth` bytes per second when given, throttling the guest's vCPUs
    /// when it does not converge if `autoConverge`. Replies as soon as the migration
    /// started; follow it with [`Request::MigrationStatus`].
    #[serde(rename_all = "camelCase")]
    Migrate {
        fd_socket: PathBuf,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        peer_cert: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_bandwidth: Option<u64>,
        #[serde(default)]
        auto_converge: bool,
        /// A block migration: QEMU pauses before the switch-over (`pause-before-switchover`)
        /// so the disk mirrors finish first ([`BlockOp::SwitchOver`]).
        #[serde(default)]
        block: bool,
        /// Post-copy allowed: the `postcopy-ram` capability is set (the target must have it
        /// too, [`Request::MigrateIncoming`]), so that [`Request::StartPostCopy`] may switch.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        post_copy: bool,
    },
    /// Live migration, target side (QEMU started with `-incoming defer`): receives the
    /// source node's accepted TCP connection on `fdSocket` as [`Request::Migrate`] does and
    /// starts `migrate-incoming` on it; with `peerCert` (the source's ephemeral
    /// certificate) QEMU's TLS requires exactly it from the source.
    #[serde(rename_all = "camelCase")]
    MigrateIncoming {
        fd_socket: PathBuf,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        peer_cert: Option<String>,
        /// Post-copy allowed: the `postcopy-ram` capability is set before `migrate-incoming`
        /// (QEMU then needs userfaultfd: `vm.unprivileged_userfaultfd=1` for a QEMU that
        /// dropped root).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        post_copy: bool,
    },
    /// QMP `migrate-start-postcopy` on the source of a migration started with `postCopy`:
    /// the guest runs on the target from then on and pages it lacks are fetched from the
    /// source on demand. The source can no longer resume the guest.
    StartPostCopy,
    /// Post-copy recovery, target side (its QEMU in `postcopy-paused`): receives a new
    /// connection from the source node on `fdSocket` as [`Request::MigrateIncoming`] does
    /// and makes it QEMU's stream (`migrate-recover` out of band, the launcher relaying:
    /// `migrate::recover_from`). QEMU's TLS uses the credentials loaded for the
    /// original stream (the same ephemeral certificates). Added within protocol version 1.
    #[serde(rename_all = "camelCase")]
    MigrateRecover {
        fd_socket: PathBuf,
    },
    /// Post-copy recovery, source side (its QEMU in `postcopy-paused`, the target's already
    /// recovering): `migrate` with `resume: true` on the new connection handed over on
    /// `fdSocket`, under the TLS parameters of the original stream. Added within protocol
    /// version 1.
    #[serde(rename_all = "camelCase")]
    MigrateResume {
        fd_socket: PathBuf,
    },
    /// A step of a block migration (node-local disks mirrored over NBD,
    /// [`crate::blockmig`]).
    Block {
        step: BlockOp,
    },
    /// QMP `query-migrate`, raw: `{"status": "active"|"completed"|"failed"|…, "ram": …,
    /// "downtime": ms, "total-time": ms, "error-desc": …}`.
    MigrationStatus,
    /// Waits until QEMU has reported more than `after` migration or block-job events
    /// (`MIGRATION`, `BLOCK_JOB_READY`, `BLOCK_JOB_COMPLETED`, …) since the launcher started,
    /// or `waitMs` passed (at most [`MAX_EVENT_WAIT_MS`]); answers the count. A follower asks
    /// [`Request::MigrationStatus`] after each answer instead of polling on a timer: a state
    /// change is seen the moment QEMU announces it. Answered without the VM's command loop.
    /// Added within protocol version 1 (an older launcher answers it with an error).
    #[serde(rename_all = "camelCase")]
    JobEvents {
        after: u64,
        wait_ms: u64,
    },
    /// QMP `migrate_cancel`: the source runs on.
    MigrateCancel,
    /// Statistics for metrics: `{"blockstats": <QMP query-blockstats, raw>}`, with the guest's
    /// memory statistics from the balloon when there are some (`guestStats`, `balloon`:
    /// [`crate::stats`]). Added within protocol version 1 (an older launcher answers it with
    /// an error: no such series).
    Stats,
    /// Online snapshot (`crate::online_snapshot`): switch each disk to the empty qcow2 overlay
    /// the agent prepared over its current top, in one QMP transaction, under a guest-agent
    /// filesystem freeze bounded by `freezeTimeoutMs` and always thawed. Replies
    /// [`crate::online_snapshot::OnlineSnapshotDone`].
    #[serde(rename_all = "camelCase")]
    OnlineSnapshot {
        disks: Vec<crate::online_snapshot::OverlayDisk>,
        freeze_timeout_ms: u64,
    },
    /// Freezes the guest's filesystems through the guest agent and holds the freeze until
    /// [`Request::Unfreeze`], or at the latest `unfreezeTimeoutSeconds` from now, when the
    /// launcher thaws on its own (`crate::freeze`). Asked again while held, it only moves
    /// the deadline. Added within protocol version 1.
    #[serde(rename_all = "camelCase")]
    Freeze {
        unfreeze_timeout_seconds: u64,
    },
    /// Thaws the guest's filesystems (a guest that is not frozen stays as it is).
    Unfreeze,
    /// Runs `command` (path first) in the guest through the guest agent and waits for it,
    /// at most `timeoutSeconds` (capped, `crate::guestexec`); replies
    /// [`crate::guestexec::ExecDone`]. Added within protocol version 1.
    #[serde(rename_all = "camelCase")]
    GuestExec {
        command: Vec<String>,
        timeout_seconds: u64,
    },
    /// Merge released snapshot layers of one disk under the running VM
    /// (`crate::online_reclaim`): QEMU `block-stream`/`block-commit` jobs followed to their
    /// end, the dropped nodes deleted. Replies [`crate::online_reclaim::MergeDone`].
    MergeLayers {
        merge: crate::online_reclaim::MergeRequest,
    },
    /// The layer files one disk runs on now (`crate::disk_layers`): what an agent resolves
    /// an online merge's journal from. Replies [`crate::disk_layers::DiskLayers`]. Added
    /// within protocol version 1 (an older launcher answers it with an error).
    DiskLayers {
        disk: crate::disk_layers::DiskLayersRequest,
    },
    /// The VM now runs on the migration target and the VMI was moved there: this launcher
    /// stops holding the disks (no more storage-lease renewals, none released) and quits
    /// QEMU; its exit report says [`ExitReason::Migrated`].
    MigratedAway,
}

/// The steps of a block migration (docs/migration.md "Node-local disks").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "camelCase")]
pub enum BlockOp {
    /// Target: serves `disks` (disk ids) writable over NBD on the listening TCP socket the
    /// agent hands over on `fdSocket` (SCM_RIGHTS; the agent bound it on the node address
    /// and filtered it to the source node): `nbd-server-start` on it, at most one
    /// connection per disk, `block-export-add` named after each disk. With `peerCert` (the
    /// source's ephemeral certificate) QEMU's TLS requires exactly it from the client, with
    /// this side's ephemeral pair ([`Request::MigrationCert`] first).
    #[serde(rename_all = "camelCase")]
    Export {
        fd_socket: PathBuf,
        disks: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        peer_cert: Option<String>,
    },
    /// Source: mirrors each disk to the target's export on the TCP connection handed over
    /// for it: `blockdev-add` of an NBD client on the passed connection (with `peerCert`,
    /// the target's ephemeral certificate: QEMU's TLS trusting exactly it), the same size
    /// checked, `blockdev-mirror` with `sync: full`.
    #[serde(rename_all = "camelCase")]
    Mirror {
        disks: Vec<MirrorDisk>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        peer_cert: Option<String>,
    },
    /// Source: the mirror jobs, raw (`query-block-jobs`).
    Jobs,
    /// Source, paused before the switch-over: completes every mirror (a final copy of the
    /// dirty blocks, no pivot), drops the NBD clients, then `migrate-continue`.
    SwitchOver,
    /// Source: cancels the mirrors and drops the NBD clients; the VM keeps its disks.
    Cancel,
    /// Target, after its guest runs: stops the NBD server.
    StopExport,
}

/// A disk to mirror: its id and the unix socket on which the agent hands over the TCP
/// connection to the target's NBD server (SCM_RIGHTS).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MirrorDisk {
    pub disk: String,
    pub socket: PathBuf,
    /// Copy only the top layer's data (`sync: top`): the target holds the same frozen
    /// layers below it (a snapshot chain carried by the agents).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub top_only: bool,
}

/// The reply to [`Request::ResizeDisk`]: the disk's size after the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResizedDisk {
    pub bytes: u64,
    /// False when the disk already had at least the asked size.
    pub grown: bool,
}

/// The reply to [`Request::MigrationCert`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigrationCert {
    /// PEM.
    pub cert: String,
}

/// The reply to [`Request::OpenPort`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OpenedPort {
    pub host_port: u16,
}

/// One reply line: exactly one of `ok` / `error`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Reply {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ok: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Reply {
    pub fn ok(v: impl Serialize) -> Reply {
        Reply {
            ok: Some(serde_json::to_value(v).unwrap_or(Value::Null)),
            error: None,
        }
    }
    pub fn err(e: impl std::fmt::Display) -> Reply {
        Reply {
            ok: None,
            error: Some(e.to_string()),
        }
    }
}

/// The longest [`Request::JobEvents`] wait.
pub const MAX_EVENT_WAIT_MS: u64 = 5_000;

/// Whether a QMP event moves a migration or a block job along ([`Request::JobEvents`]).
pub fn is_job_event(event: &str) -> bool {
    event == "MIGRATION" || event == "MIGRATION_PASS" || event.starts_with("BLOCK_JOB_")
}

/// The VM's state as the launcher reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunPhase {
    Starting,
    Running,
    Paused,
    ShuttingDown,
    Exited,
}

/// Answer to `hello` and `status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LauncherStatus {
    pub version: u32,
    pub launcher_pid: u32,
    pub qemu_pid: Option<u32>,
    pub vmi_uid: String,
    pub phase: RunPhase,
    /// The guest agent answered its last ping.
    pub guest_agent_connected: bool,
    /// Seconds since the Unix epoch when QEMU started.
    pub started_at: u64,
    /// A freeze requested through [`Request::Freeze`] holds the guest's filesystems frozen.
    #[serde(default)]
    pub fs_frozen: bool,
}

/// Why QEMU is gone (written to `exit.json` before the launcher exits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExitReason {
    /// The guest powered itself off.
    GuestShutdown,
    /// A requested shutdown completed within the grace period.
    Shutdown,
    /// A requested shutdown ran out of grace and QEMU was killed.
    Killed,
    /// QEMU ended without being asked (crash, kill from outside).
    Crashed,
    /// QEMU could not be started.
    StartFailed,
    /// The launcher killed QEMU because the node's lease could not be confirmed in time
    /// (self-fencing, [`crate::fence`]), or did not start it for that reason.
    Fenced,
    /// The VM was live-migrated to another node and runs there; this QEMU quit.
    Migrated,
}

impl ExitReason {
    /// Whether the VMI ends Succeeded (else Failed).
    pub fn succeeded(self) -> bool {
        matches!(
            self,
            ExitReason::GuestShutdown
                | ExitReason::Shutdown
                | ExitReason::Killed
                | ExitReason::Migrated
        )
    }
}

/// Contents of `exit.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExitReport {
    pub reason: ExitReason,
    pub message: String,
    /// Seconds since the Unix epoch.
    pub at: u64,
}

/// Reads `exit.json` from a VMI directory, if the launcher wrote one.
pub fn read_exit_report(dir: &Path) -> Option<ExitReport> {
    let text = std::fs::read_to_string(dir.join(files::EXIT)).ok()?;
    serde_json::from_str(&text).ok()
}

/// Writes `value` as JSON to `path` atomically (temp file + rename).
pub fn write_json_atomic(path: &Path, value: &impl Serialize) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_vec_pretty(value).map_err(|e| Error::Protocol(e.to_string()))?;
    std::fs::write(&tmp, text).map_err(|e| Error::io(tmp.display().to_string(), e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path.display().to_string(), e))
}

/// The agent's side of a control connection.
#[derive(Debug)]
pub struct LauncherClient {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    /// What the launcher answered to `hello`.
    pub hello: LauncherStatus,
    timeout: Duration,
}

impl LauncherClient {
    /// Connects to `dir/control.sock` and does the handshake.
    pub async fn connect(dir: &Path, timeout: Duration) -> Result<LauncherClient> {
        let path = dir.join(files::CONTROL);
        let stream = tokio::time::timeout(timeout, UnixStream::connect(&path))
            .await
            .map_err(|_| Error::timeout("the launcher's control socket", timeout))?
            .map_err(|e| Error::io(path.display().to_string(), e))?;
        let (r, w) = stream.into_split();
        let mut c = LauncherClient {
            reader: BufReader::new(r),
            writer: w,
            hello: LauncherStatus {
                version: 0,
                launcher_pid: 0,
                qemu_pid: None,
                vmi_uid: String::new(),
                phase: RunPhase::Starting,
                guest_agent_connected: false,
                started_at: 0,
                fs_frozen: false,
            },
            timeout,
        };
        let v = c
            .request(&Request::Hello {
                version: PROTOCOL_VERSION,
            })
            .await?;
        c.hello = serde_json::from_value(v).map_err(|e| Error::Protocol(e.to_string()))?;
        Ok(c)
    }

    /// Sends one request and returns the `ok` value (an `error` reply becomes `Err`).
    pub async fn request(&mut self, req: &Request) -> Result<Value> {
        self.request_with_timeout(req, self.timeout).await
    }

    /// Like [`request`](Self::request) with its own timeout (long operations: shutdown).
    pub async fn request_with_timeout(
        &mut self,
        req: &Request,
        timeout: Duration,
    ) -> Result<Value> {
        let mut line = serde_json::to_string(req).map_err(|e| Error::Protocol(e.to_string()))?;
        line.push('\n');
        let exchange = async {
            self.writer
                .write_all(line.as_bytes())
                .await
                .map_err(|e| Error::Protocol(format!("writing to the launcher: {e}")))?;
            let mut reply = String::new();
            let n = self
                .reader
                .read_line(&mut reply)
                .await
                .map_err(|e| Error::Protocol(format!("reading from the launcher: {e}")))?;
            if n == 0 {
                return Err(Error::Protocol("the launcher closed the connection".into()));
            }
            let reply: Reply =
                serde_json::from_str(&reply).map_err(|e| Error::Protocol(e.to_string()))?;
            match (reply.ok, reply.error) {
                (_, Some(e)) => Err(Error::Protocol(e)),
                (Some(v), None) => Ok(v),
                (None, None) => Ok(Value::Null),
            }
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| Error::timeout("the launcher's reply", timeout))?
    }

    /// The current status.
    pub async fn status(&mut self) -> Result<LauncherStatus> {
        let v = self.request(&Request::Status).await?;
        serde_json::from_value(v).map_err(|e| Error::Protocol(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_events_are_migration_and_block_job_events() {
        assert_eq!(
            serde_json::to_string(&Request::JobEvents {
                after: 3,
                wait_ms: 250
            })
            .unwrap(),
            r#"{"op":"jobEvents","after":3,"waitMs":250}"#
        );
        for e in [
            "MIGRATION",
            "MIGRATION_PASS",
            "BLOCK_JOB_READY",
            "BLOCK_JOB_COMPLETED",
        ] {
            assert!(is_job_event(e), "{e}");
        }
        for e in ["RESUME", "STOP", "SHUTDOWN", "BALLOON_CHANGE"] {
            assert!(!is_job_event(e), "{e}");
        }
    }

    #[test]
    fn wire_format_is_stable() {
        assert_eq!(
            serde_json::to_string(&Request::Shutdown { grace_seconds: 5 }).unwrap(),
            r#"{"op":"shutdown","graceSeconds":5}"#
        );
        assert_eq!(
            serde_json::to_string(&Request::Hello { version: 1 }).unwrap(),
            r#"{"op":"hello","version":1}"#
        );
        assert_eq!(
            serde_json::to_string(&Request::SoftReboot).unwrap(),
            r#"{"op":"softReboot"}"#
        );
        assert_eq!(
            serde_json::to_string(&Request::Migrate {
                fd_socket: "/x".into(),
                peer_cert: None,
                max_bandwidth: Some(1024),
                auto_converge: false,
                block: true,
                post_copy: false,
            })
            .unwrap(),
            r#"{"op":"migrate","fdSocket":"/x","maxBandwidth":1024,"autoConverge":false,"block":true}"#
        );
        assert_eq!(
            serde_json::to_string(&Request::MigrateIncoming {
                fd_socket: "/y".into(),
                peer_cert: Some("P".into()),
                post_copy: false,
            })
            .unwrap(),
            r#"{"op":"migrateIncoming","fdSocket":"/y","peerCert":"P"}"#
        );
        let pc: Request =
            serde_json::from_str(r#"{"op":"migrateIncoming","fdSocket":"/y","postCopy":true}"#)
                .unwrap();
        assert!(matches!(
            pc,
            Request::MigrateIncoming {
                post_copy: true,
                ..
            }
        ));
        assert_eq!(
            serde_json::to_string(&Request::StartPostCopy).unwrap(),
            r#"{"op":"startPostCopy"}"#
        );
        assert_eq!(
            serde_json::to_string(&Request::MigrateRecover {
                fd_socket: "/d/in.sock".into()
            })
            .unwrap(),
            r#"{"op":"migrateRecover","fdSocket":"/d/in.sock"}"#
        );
        assert_eq!(
            serde_json::to_string(&Request::MigrateResume {
                fd_socket: "/d/out.sock".into()
            })
            .unwrap(),
            r#"{"op":"migrateResume","fdSocket":"/d/out.sock"}"#
        );
        assert_eq!(
            serde_json::to_string(&Request::MigrationCert {
                endpoint: crate::migtls::Endpoint::Server
            })
            .unwrap(),
            r#"{"op":"migrationCert","endpoint":"server"}"#
        );
        assert_eq!(
            serde_json::to_string(&Request::Block {
                step: BlockOp::SwitchOver
            })
            .unwrap(),
            r#"{"op":"block","step":{"op":"switchOver"}}"#
        );
        assert_eq!(
            serde_json::to_string(&Request::MigratedAway).unwrap(),
            r#"{"op":"migratedAway"}"#
        );
        assert_eq!(
            serde_json::to_string(&Request::Stats).unwrap(),
            r#"{"op":"stats"}"#
        );
        assert_eq!(
            serde_json::to_string(&Reply::err("x")).unwrap(),
            r#"{"error":"x"}"#
        );
    }

    #[test]
    fn exit_reasons_map_to_phases() {
        assert!(ExitReason::GuestShutdown.succeeded());
        assert!(ExitReason::Shutdown.succeeded());
        assert!(!ExitReason::Crashed.succeeded());
        assert!(!ExitReason::StartFailed.succeeded());
    }
}
