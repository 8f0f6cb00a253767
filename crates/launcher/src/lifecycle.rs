//! Driving one VM: start QEMU and wait for QMP, pause/unpause, reset, soft reboot through the
//! guest agent, graceful shutdown (ACPI power button, then SIGKILL after the grace period),
//! host port forwards and online disk growth (`block_resize`).
//!
//! The decisions are pure and unit-tested: [`ShutdownTracker::next`] says what the shutdown loop
//! does next, [`VmState::apply`] folds QMP events into the VM's state.

use std::process::ExitStatus;
use std::time::Duration;

use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};
use tokio::time::{Instant, sleep_until};

use crate::console::SerialConsole;
use crate::control::ResizedDisk;
use crate::error::{Error, Result};
use crate::process::{QemuOptions, QemuProcess};
use crate::qga::{GuestAgent, QgaOptions};
use crate::qmp::{EventKind, QmpClient, QmpOptions, RunState, StatusInfo};
use crate::spec::LaunchSpec;

/// How to start a VM.
#[derive(Debug, Clone, Default)]
pub struct StartOptions {
    pub qemu: QemuOptions,
    pub qmp: QmpOptions,
    /// Timeouts of the VM's guest-agent session.
    pub qga: QgaOptions,
}

/// The shutdown policy: ACPI power button, resent now and then, SIGKILL after `grace`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownPolicy {
    /// Time the guest gets to power off (KubeVirt: terminationGracePeriodSeconds).
    pub grace: Duration,
    /// Press the power button again at this interval (an early press can be lost while the
    /// guest is still booting); `None` presses once.
    pub resend_interval: Option<Duration>,
    /// After SIGKILL, how long to wait for the process to be reaped before giving up.
    pub kill_timeout: Duration,
}

impl Default for ShutdownPolicy {
    fn default() -> Self {
        ShutdownPolicy {
            grace: Duration::from_secs(30),
            resend_interval: Some(Duration::from_secs(5)),
            kill_timeout: Duration::from_secs(10),
        }
    }
}

/// How a shutdown ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownOutcome {
    /// QEMU had exited before anything was asked of it.
    AlreadyExited,
    /// The guest powered off within the grace period.
    Graceful,
    /// The grace period ran out and QEMU was killed.
    Killed,
}

/// The next step of the shutdown loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownAction {
    /// Press the ACPI power button (`system_powerdown`).
    SendPowerdown,
    /// Wait until this time (since the shutdown began) or until QEMU exits, then ask again.
    WaitUntil(Duration),
    /// Send SIGKILL.
    Kill,
    /// Finished.
    Done(ShutdownOutcome),
    /// QEMU survived SIGKILL for `kill_timeout`: report an error.
    GiveUp,
}

/// The shutdown state machine. Feed it the time since the shutdown began and whether QEMU has
/// exited; it answers with the next action. Pure: no clocks, no I/O.
#[derive(Debug, Clone)]
pub struct ShutdownTracker {
    policy: ShutdownPolicy,
    last_powerdown: Option<Duration>,
    killed_at: Option<Duration>,
}

impl ShutdownTracker {
    pub fn new(policy: ShutdownPolicy) -> Self {
        ShutdownTracker {
            policy,
            last_powerdown: None,
            killed_at: None,
        }
    }

    pub fn next(&mut self, now: Duration, exited: bool) -> ShutdownAction {
        if exited {
            return ShutdownAction::Done(if self.killed_at.is_some() {
                ShutdownOutcome::Killed
            } else if self.last_powerdown.is_some() {
                ShutdownOutcome::Graceful
            } else {
                ShutdownOutcome::AlreadyExited
            });
        }
        if let Some(killed) = self.killed_at {
            let give_up = killed + self.policy.kill_timeout;
            return if now >= give_up {
                ShutdownAction::GiveUp
            } else {
                ShutdownAction::WaitUntil(give_up)
            };
        }
        if now >= self.policy.grace {
            self.killed_at = Some(now);
            return ShutdownAction::Kill;
        }
        let resend_due = match (self.last_powerdown, self.policy.resend_interval) {
            (None, _) => Some(now),
            (Some(last), Some(every)) if !every.is_zero() => Some(last + every),
            _ => None,
        };
        match resend_due {
            Some(due) if now >= due => {
                self.last_powerdown = Some(now);
                ShutdownAction::SendPowerdown
            }
            Some(due) => ShutdownAction::WaitUntil(due.min(self.policy.grace)),
            None => ShutdownAction::WaitUntil(self.policy.grace),
        }
    }
}

/// The VM's state as the agent reports it, folded from `query-status` and QMP events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmState {
    /// QEMU is up, the guest has not run yet (started with `-S`, or incoming migration).
    Starting,
    Running,
    Paused,
    /// A shutdown was requested (power button pressed); the guest is still running.
    ShuttingDown,
    /// The guest powered off or QEMU is quitting.
    Shutdown,
    /// The guest reported a panic.
    Crashed,
}

impl VmState {
    /// Maps a `query-status` answer.
    pub fn from_status(status: &StatusInfo) -> VmState {
        match status.status {
            RunState::Running => VmState::Running,
            RunState::Prelaunch | RunState::Inmigrate => VmState::Starting,
            RunState::Shutdown => VmState::Shutdown,
            RunState::GuestPanicked | RunState::InternalError => VmState::Crashed,
            _ if status.running => VmState::Running,
            _ => VmState::Paused,
        }
    }

    /// The state after an event.
    pub fn apply(self, event: &EventKind) -> VmState {
        use VmState::*;
        match (self, event) {
            (Shutdown, _) | (Crashed, _) => self,
            (_, EventKind::Shutdown) => Shutdown,
            (_, EventKind::GuestPanicked) => Crashed,
            (Running | Starting, EventKind::Powerdown) => ShuttingDown,
            (_, EventKind::Stop) | (_, EventKind::Suspend) => Paused,
            (ShuttingDown, EventKind::Resume) => ShuttingDown,
            (_, EventKind::Resume) | (_, EventKind::Wakeup) => Running,
            // A reset (reboot) clears a pending power-button request: the guest starts over.
            (ShuttingDown, EventKind::Reset) => Running,
            (state, _) => state,
        }
    }
}

/// One running VM: its QEMU process, QMP session and (lazily connected) guest-agent session.
#[derive(Debug)]
pub struct Vm {
    spec: LaunchSpec,
    process: QemuProcess,
    qmp: QmpClient,
    /// QEMU serves the agent channel to one client at a time, so the VM owns the one session.
    qga: Mutex<Option<GuestAgent>>,
    qga_opts: QgaOptions,
}

impl Vm {
    /// Starts QEMU and connects QMP. Fails with QEMU's stderr when QEMU exits first.
    pub async fn start(spec: LaunchSpec, opts: &StartOptions) -> Result<Vm> {
        let mut process = QemuProcess::spawn(&spec, &opts.qemu)?;
        let connect = QmpClient::connect(&spec.sockets.qmp, &opts.qmp);
        let qmp = tokio::select! {
            r = connect => match r {
                Ok(q) => q,
                Err(e) => {
                    let _ = process.kill().await;
                    return Err(early_exit_or(&mut process, e));
                }
            },
            status = process.wait() => {
                let status = status?;
                // Give the stderr reader a moment to drain.
                tokio::time::sleep(Duration::from_millis(50)).await;
                return Err(Error::QemuExited {
                    status: status.to_string(),
                    stderr: process.stderr_tail(4000),
                });
            }
        };
        Ok(Vm {
            spec,
            process,
            qmp,
            qga: Mutex::new(None),
            qga_opts: opts.qga.clone(),
        })
    }

    pub fn spec(&self) -> &LaunchSpec {
        &self.spec
    }

    pub fn qmp(&self) -> &QmpClient {
        &self.qmp
    }

    pub fn process(&self) -> &QemuProcess {
        &self.process
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// `query-status`.
    pub async fn status(&self) -> Result<StatusInfo> {
        self.qmp.query_status().await
    }

    /// Pauses the vCPUs.
    pub async fn pause(&self) -> Result<()> {
        self.qmp.stop().await
    }

    /// Resumes the vCPUs (also starts a VM launched with `start_paused`).
    pub async fn unpause(&self) -> Result<()> {
        self.qmp.cont().await
    }

    /// Hard reset.
    pub async fn reset(&self) -> Result<()> {
        self.qmp.system_reset().await
    }

    /// Adds a QEMU host forward `127.0.0.1:<free port>` → the guest's TCP `guest_port` on the
    /// first user-mode NIC; returns the host port. The port is picked by binding port 0 and
    /// releasing it, so a few attempts may be needed when another process takes it first.
    pub async fn open_port(&self, guest_port: u16) -> Result<u16> {
        let netdev = user_netdev(&self.spec).ok_or_else(|| {
            Error::InvalidSpec("the VMI has no user-mode network interface to forward to".into())
        })?;
        let mut last = String::new();
        for _ in 0..5 {
            let host_port = std::net::TcpListener::bind(("127.0.0.1", 0))
                .and_then(|l| l.local_addr())
                .map_err(|e| Error::io("picking a free port", e))?
                .port();
            let out = self
                .hmp(&hostfwd_add_command(&netdev, host_port, guest_port))
                .await?;
            if out.trim().is_empty() {
                return Ok(host_port);
            }
            last = out.trim().to_string();
        }
        Err(Error::Protocol(format!("hostfwd_add failed: {last}")))
    }

    /// Removes a host forward added by [`Vm::open_port`].
    pub async fn close_port(&self, host_port: u16) -> Result<()> {
        let netdev = user_netdev(&self.spec).ok_or_else(|| {
            Error::InvalidSpec("the VMI has no user-mode network interface".into())
        })?;
        let out = self
            .hmp(&format!(
                "hostfwd_remove {netdev} tcp:127.0.0.1:{host_port}"
            ))
            .await?;
        if out.trim().is_empty() || out.contains("removed") {
            Ok(())
        } else {
            Err(Error::Protocol(format!(
                "hostfwd_remove failed: {}",
                out.trim()
            )))
        }
    }

    /// Grows disk `disk_id` to `bytes` (rounded down to whole 512-byte sectors) with QMP
    /// `block_resize` on its format node, after its volume grew; the guest is told by the
    /// device (virtio-blk config change). Never shrinks: asking for no more than the current
    /// size changes nothing.
    pub async fn resize_disk(&self, disk_id: &str, bytes: u64) -> Result<ResizedDisk> {
        let node = crate::cmdline::disk_node_name(disk_id);
        let blocks = self.qmp.execute("query-block", None).await?;
        let current = virtual_size_of(&blocks, &node).ok_or_else(|| {
            Error::Protocol(format!("query-block does not list block node {node}"))
        })?;
        match resize_target(&self.spec, disk_id, bytes, current)? {
            None => Ok(ResizedDisk {
                bytes: current,
                grown: false,
            }),
            Some(size) => {
                self.qmp
                    .execute(
                        "block_resize",
                        Some(serde_json::json!({"node-name": node, "size": size})),
                    )
                    .await?;
                Ok(ResizedDisk {
                    bytes: size,
                    grown: true,
                })
            }
        }
    }

    /// A human monitor command through QMP; its text output.
    async fn hmp(&self, command_line: &str) -> Result<String> {
        let v = self
            .qmp
            .execute(
                "human-monitor-command",
                Some(serde_json::json!({"command-line": command_line})),
            )
            .await?;
        Ok(v.as_str().unwrap_or_default().to_string())
    }

    /// Connects to the serial console socket.
    pub async fn console(&self, connect_timeout: Duration) -> Result<SerialConsole> {
        let path =
            self.spec.sockets.serial.as_ref().ok_or_else(|| {
                Error::InvalidSpec("the VM has no serial console socket".to_string())
            })?;
        SerialConsole::connect(path, connect_timeout).await
    }

    /// The VM's guest-agent session, connected on first use. Hold the guard only for a few
    /// commands: every other user of the agent waits for it. (A second connection of one's own
    /// would not work: QEMU serves the channel to one client at a time.)
    pub async fn guest_agent(&self) -> Result<MappedMutexGuard<'_, GuestAgent>> {
        let mut slot = self.qga.lock().await;
        if slot.is_none() {
            let path = self.spec.sockets.guest_agent.as_ref().ok_or_else(|| {
                Error::InvalidSpec("the VM has no guest agent channel".to_string())
            })?;
            *slot = Some(GuestAgent::connect(path, &self.qga_opts).await?);
        }
        Ok(MutexGuard::map(slot, |s| {
            s.as_mut().expect("connected above")
        }))
    }

    /// Soft reboot: asks the guest agent to reboot the guest (fails when the agent does not
    /// answer a ping).
    pub async fn soft_reboot(&self) -> Result<()> {
        let mut qga = self.guest_agent().await?;
        qga.ping().await?;
        qga.reboot().await
    }

    /// Graceful shutdown: power button (resent per policy), SIGKILL when the grace period ends.
    pub async fn shutdown(&mut self, policy: &ShutdownPolicy) -> Result<ShutdownOutcome> {
        let started = Instant::now();
        let mut tracker = ShutdownTracker::new(*policy);
        loop {
            let exited = self.process.try_wait()?.is_some();
            match tracker.next(started.elapsed(), exited) {
                ShutdownAction::SendPowerdown => {
                    if let Err(e) = self.qmp.system_powerdown().await {
                        // QEMU may be exiting already; the next round sees it.
                        tracing::debug!("system_powerdown failed: {e}");
                    }
                }
                ShutdownAction::WaitUntil(at) => {
                    tokio::select! {
                        r = self.process.wait() => { r?; }
                        _ = sleep_until(started + at) => {}
                    }
                }
                ShutdownAction::Kill => {
                    tracing::warn!(name = %self.spec.name, "grace period over, killing QEMU");
                    self.process.start_kill()?;
                }
                ShutdownAction::Done(outcome) => return Ok(outcome),
                ShutdownAction::GiveUp => {
                    return Err(Error::timeout(
                        "QEMU to exit after SIGKILL",
                        policy.kill_timeout,
                    ));
                }
            }
        }
    }

    /// SIGKILLs QEMU at once.
    pub async fn kill(&mut self) -> Result<ExitStatus> {
        self.process.kill().await
    }

    /// Waits up to `wait` for QEMU to exit by itself.
    pub async fn wait_exit(&mut self, wait: Duration) -> Result<ExitStatus> {
        tokio::time::timeout(wait, self.process.wait())
            .await
            .map_err(|_| Error::timeout("QEMU to exit", wait))?
    }

    /// QEMU's exit status if it has exited.
    pub fn try_exit_status(&mut self) -> Result<Option<ExitStatus>> {
        self.process.try_wait()
    }
}

fn early_exit_or(process: &mut QemuProcess, e: Error) -> Error {
    match process.try_wait() {
        Ok(Some(status)) if !status.success() && status.code().is_some() => Error::QemuExited {
            status: status.to_string(),
            stderr: process.stderr_tail(4000),
        },
        _ => e,
    }
}

/// The netdev id of the spec's first user-mode (slirp) NIC.
pub fn user_netdev(spec: &LaunchSpec) -> Option<String> {
    spec.nics
        .iter()
        .find(|n| matches!(n.backend, crate::spec::NicBackend::User { .. }))
        .map(|n| format!("net-{}", n.id))
}

/// The size to grow disk `disk_id` to, given the asked `bytes` and its `current` size; `None`
/// when there is nothing to do (never shrinks). Only writable raw disks can be resized.
pub fn resize_target(
    spec: &LaunchSpec,
    disk_id: &str,
    bytes: u64,
    current: u64,
) -> Result<Option<u64>> {
    let d = spec
        .disks
        .iter()
        .find(|d| d.id == disk_id)
        .ok_or_else(|| Error::InvalidSpec(format!("disk: no disk {disk_id:?} in this VM")))?;
    if d.is_readonly() {
        return Err(Error::InvalidSpec(format!(
            "disk: {disk_id:?} is read-only and cannot be resized"
        )));
    }
    if d.format != crate::spec::DiskFormat::Raw {
        return Err(Error::InvalidSpec(format!(
            "disk: {disk_id:?} is not a raw image; only raw disks are resized"
        )));
    }
    let target = bytes / 512 * 512;
    Ok((target > current).then_some(target))
}

/// `inserted.image.virtual-size` of the `query-block` entry whose node is `node`.
pub fn virtual_size_of(query_block: &serde_json::Value, node: &str) -> Option<u64> {
    query_block
        .as_array()?
        .iter()
        .map(|b| &b["inserted"])
        .find(|i| i["node-name"] == node)
        .and_then(|i| i["image"]["virtual-size"].as_u64())
}

/// The HMP command adding a loopback TCP forward to the guest.
pub fn hostfwd_add_command(netdev: &str, host_port: u16, guest_port: u16) -> String {
    format!("hostfwd_add {netdev} tcp:127.0.0.1:{host_port}-:{guest_port}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{Nic, NicBackend, NicModel};

    #[test]
    fn disks_only_grow_and_only_raw_writable_ones() {
        use crate::spec::{Disk, DiskFormat};
        let mut spec = LaunchSpec::new("vm", "u", 64, "/tmp/q".into());
        let disk = |id: &str, format, readonly| -> Disk {
            serde_json::from_value(serde_json::json!({
                "id": id, "path": "/v/disk.img", "format": format, "readonly": readonly,
            }))
            .unwrap()
        };
        spec.disks = vec![
            disk("disk-root", "raw", false),
            disk("disk-ro", "raw", true),
            disk("disk-q", "qcow2", false),
        ];
        assert_eq!(spec.disks[2].format, DiskFormat::Qcow2);
        let mib = 1 << 20;
        assert_eq!(
            resize_target(&spec, "disk-root", 96 * mib, 64 * mib).unwrap(),
            Some(96 * mib)
        );
        // Whole sectors only; equal or smaller is a no-op.
        assert_eq!(
            resize_target(&spec, "disk-root", 64 * mib + 700, 64 * mib).unwrap(),
            Some(64 * mib + 512)
        );
        assert_eq!(
            resize_target(&spec, "disk-root", 64 * mib + 100, 64 * mib).unwrap(),
            None
        );
        assert_eq!(
            resize_target(&spec, "disk-root", 64 * mib, 64 * mib).unwrap(),
            None
        );
        assert_eq!(
            resize_target(&spec, "disk-root", 8 * mib, 64 * mib).unwrap(),
            None
        );
        for (id, want) in [
            ("disk-ro", "read-only"),
            ("disk-q", "not a raw image"),
            ("nope", "no disk"),
        ] {
            let e = resize_target(&spec, id, 96 * mib, 64 * mib)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want) && e.contains("disk"), "{e}");
        }
    }

    #[test]
    fn virtual_size_comes_from_the_disks_format_node() {
        let blocks = serde_json::json!([
            {"device": "", "qdev": "/machine/peripheral/disk-a/virtio-backend",
             "inserted": {"node-name": "fmt-disk-a", "image": {"virtual-size": 1024}}},
            {"device": "", "qdev": "/machine/peripheral/disk-b/virtio-backend",
             "inserted": {"node-name": "fmt-disk-b", "image": {"virtual-size": 4096}}},
            {"device": "ide1-cd0", "removable": true},
        ]);
        assert_eq!(virtual_size_of(&blocks, "fmt-disk-b"), Some(4096));
        assert_eq!(virtual_size_of(&blocks, "fmt-disk-c"), None);
    }

    #[test]
    fn port_forwards_use_the_first_user_nic() {
        let mut spec = LaunchSpec::new("vm", "u", 64, "/tmp/q".into());
        assert_eq!(user_netdev(&spec), None);
        let nic = |id: &str, backend| Nic {
            id: id.into(),
            mac: None,
            model: NicModel::default(),
            backend,
            boot_order: None,
        };
        spec.nics.push(nic(
            "tap0",
            NicBackend::Tap {
                ifname: "tap0".into(),
                queues: 1,
            },
        ));
        assert_eq!(user_netdev(&spec), None);
        spec.nics
            .push(nic("default", NicBackend::User { forwards: vec![] }));
        assert_eq!(user_netdev(&spec).as_deref(), Some("net-default"));
        assert_eq!(
            hostfwd_add_command("net-default", 40000, 80),
            "hostfwd_add net-default tcp:127.0.0.1:40000-:80"
        );
    }

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    fn policy(grace: u64, resend: Option<u64>) -> ShutdownPolicy {
        ShutdownPolicy {
            grace: s(grace),
            resend_interval: resend.map(s),
            kill_timeout: s(5),
        }
    }

    #[test]
    fn graceful_when_guest_powers_off_in_time() {
        let mut t = ShutdownTracker::new(policy(30, None));
        assert_eq!(t.next(s(0), false), ShutdownAction::SendPowerdown);
        assert_eq!(t.next(s(0), false), ShutdownAction::WaitUntil(s(30)));
        assert_eq!(
            t.next(s(4), true),
            ShutdownAction::Done(ShutdownOutcome::Graceful)
        );
    }

    #[test]
    fn already_exited_is_reported_as_such() {
        let mut t = ShutdownTracker::new(policy(30, Some(5)));
        assert_eq!(
            t.next(s(0), true),
            ShutdownAction::Done(ShutdownOutcome::AlreadyExited)
        );
    }

    #[test]
    fn resends_power_button_until_grace_then_kills() {
        let mut t = ShutdownTracker::new(policy(12, Some(5)));
        assert_eq!(t.next(s(0), false), ShutdownAction::SendPowerdown);
        assert_eq!(t.next(s(0), false), ShutdownAction::WaitUntil(s(5)));
        assert_eq!(t.next(s(5), false), ShutdownAction::SendPowerdown);
        assert_eq!(t.next(s(5), false), ShutdownAction::WaitUntil(s(10)));
        assert_eq!(t.next(s(10), false), ShutdownAction::SendPowerdown);
        // the next resend would be at 15 s, after the grace period: wait for the grace end
        assert_eq!(t.next(s(10), false), ShutdownAction::WaitUntil(s(12)));
        assert_eq!(t.next(s(12), false), ShutdownAction::Kill);
        assert_eq!(t.next(s(12), false), ShutdownAction::WaitUntil(s(17)));
        assert_eq!(
            t.next(s(13), true),
            ShutdownAction::Done(ShutdownOutcome::Killed)
        );
    }

    #[test]
    fn gives_up_when_kill_does_not_work() {
        let mut t = ShutdownTracker::new(policy(1, None));
        assert_eq!(t.next(s(0), false), ShutdownAction::SendPowerdown);
        assert_eq!(t.next(s(1), false), ShutdownAction::Kill);
        assert_eq!(t.next(s(3), false), ShutdownAction::WaitUntil(s(6)));
        assert_eq!(t.next(s(6), false), ShutdownAction::GiveUp);
    }

    #[test]
    fn zero_grace_kills_at_once() {
        let mut t = ShutdownTracker::new(policy(0, Some(5)));
        assert_eq!(t.next(s(0), false), ShutdownAction::Kill);
        assert_eq!(
            t.next(s(0), true),
            ShutdownAction::Done(ShutdownOutcome::Killed)
        );
    }

    #[test]
    fn late_wakeups_do_not_skip_the_kill() {
        let mut t = ShutdownTracker::new(policy(10, Some(5)));
        assert_eq!(t.next(s(0), false), ShutdownAction::SendPowerdown);
        // the loop overslept far past the grace period
        assert_eq!(t.next(s(40), false), ShutdownAction::Kill);
    }

    #[test]
    fn state_from_status() {
        let st = |status, running| VmState::from_status(&StatusInfo { running, status });
        assert_eq!(st(RunState::Running, true), VmState::Running);
        assert_eq!(st(RunState::Paused, false), VmState::Paused);
        assert_eq!(st(RunState::Prelaunch, false), VmState::Starting);
        assert_eq!(st(RunState::Shutdown, false), VmState::Shutdown);
        assert_eq!(st(RunState::GuestPanicked, false), VmState::Crashed);
        assert_eq!(st(RunState::Suspended, false), VmState::Paused);
    }

    #[test]
    fn state_follows_events() {
        use EventKind as E;
        let mut st = VmState::Starting;
        for (ev, want) in [
            (E::Resume, VmState::Running),
            (E::Stop, VmState::Paused),
            (E::Resume, VmState::Running),
            (E::Powerdown, VmState::ShuttingDown),
            (E::Stop, VmState::Paused),
            (E::Resume, VmState::Running),
            (E::Powerdown, VmState::ShuttingDown),
            (E::Reset, VmState::Running),
            (E::Other("RTC_CHANGE".into()), VmState::Running),
            (E::Shutdown, VmState::Shutdown),
            (E::Resume, VmState::Shutdown),
        ] {
            st = st.apply(&ev);
            assert_eq!(st, want, "after {ev:?}");
        }
        assert_eq!(VmState::Running.apply(&E::GuestPanicked), VmState::Crashed);
        assert_eq!(VmState::Crashed.apply(&E::Resume), VmState::Crashed);
    }
}
