//! The agents' side of post-copy at run time (docs/migration.md "Post-copy"; the decisions
//! are [`crate::postcopy`]'s): `migrationState.mode: PostCopy` and an Event once the
//! migration has switched; the recovery of a broken post-copy stream — the source agent sets
//! up a new data connection exactly as the original stream's ([`crate::migstream`]: the
//! agents' authenticated channel, the announced source port, the SCM_RIGHTS hand-over; the
//! QEMUs keep their TLS credentials), the target's QEMU runs `migrate-recover` on it and the
//! source's `migrate` with `resume`; the source's query of the target when its QEMU sent
//! everything but never completes (the target's `completed` means switch over); and the end of
//! a guest lost when recovery cannot succeed
//! (the VMI failed, the source QEMU stopped; the target agent abandons its launcher on the
//! failed state).

use std::net::IpAddr;
use std::time::{Duration, Instant};

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_launcher::control::Request;

use super::migration::{AbortOnDrop, SETUP_STEP, timeout};
use super::migsetup::SetupError;
use super::{Agent, now_string};
use crate::decide::Observed;
use crate::launchers;
use crate::migration as mig;
use crate::migstream as ms;
use crate::postcopy::{self, TargetRecovery, TargetView};

/// How long the target waits for its QEMU to notice the break (`postcopy-paused`).
const TARGET_PAUSE_WAIT: Duration = Duration::from_secs(10);
/// How often the target checks whether its incoming migration ended.
const SERVE_CHECK: Duration = Duration::from_secs(1);

impl Agent {
    /// Records that the migration of `vmi` runs in post-copy: the guest runs on
    /// `target_node` now.
    pub(super) async fn record_post_copy(&self, vmi: &VirtualMachineInstance, target_node: &str) {
        if let Err(e) = self.patch_status(vmi, postcopy::mode_patch()).await {
            tracing::warn!("recording the post-copy mode: {e}");
        }
        self.event(
            vmi,
            "Normal",
            "MigrationPostCopy",
            &format!(
                "The migration did not complete within its completion timeout and switched to \
                 post-copy: the guest runs on {target_node}, its remaining memory follows on \
                 demand from {}; it can no longer return here",
                self.opts.node_name
            ),
        )
        .await;
    }

    /// A post-copy migration broke: the guest is lost. The VMI fails (with the migration),
    /// and the source QEMU, paused since the switch, is stopped; the target agent stops its
    /// half of the guest when it sees the failed migration. Never a QEMU resumed on either
    /// side.
    pub(super) async fn lose_guest(&self, vmi: &VirtualMachineInstance, reason: &str) {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        tracing::error!(uid = %uid, "{reason}");
        self.event(vmi, "Warning", "FailedMigration", reason).await;
        let patch = postcopy::lost_patch(reason, &now_string());
        let mut tries = 0u32;
        while let Err(e) = self.patch_status(vmi, patch.clone()).await {
            tries += 1;
            tracing::warn!("recording the guest lost in post-copy ({e}); retrying");
            if tries >= 20 {
                break;
            }
            tokio::time::sleep(crate::migration::switch_over_backoff(tries)).await;
        }
        let _ = launchers::request(
            &self.cfg,
            &uid,
            &Request::Shutdown { grace_seconds: 0 },
            Duration::from_secs(30),
        )
        .await;
    }

    /// Target: its QEMU's `query-migrate` status (`none` when QEMU reports none yet);
    /// `None` when no launcher runs, `Some(Err(()))` when it does not answer.
    async fn incoming_status(&self, uid: &str) -> Option<Result<String, ()>> {
        if !matches!(
            launchers::observe(&self.cfg, uid).await,
            Observed::Running(_)
        ) {
            return None;
        }
        let v = launchers::request(
            &self.cfg,
            uid,
            &Request::MigrationStatus,
            Duration::from_secs(5),
        )
        .await;
        Some(
            v.map(|v| v["status"].as_str().unwrap_or("none").to_string())
                .map_err(|e| tracing::debug!(uid, "the target launcher's migration: {e}")),
        )
    }

    /// Target of a migration that may switch to post-copy: serves the source's recoveries
    /// and queries on the migration's `listener` (channels from `source` only, with the
    /// agents' pinned TLS) until the incoming migration ends (a completed one
    /// [`postcopy::COMPLETED_SERVE`] later: a source whose QEMU never completes asks then).
    pub(super) async fn serve_recoveries(
        &self,
        uid: &str,
        listener: &tokio::net::TcpListener,
        source: IpAddr,
        tls: Option<std::sync::Arc<rustls::ServerConfig>>,
    ) {
        let ended = async {
            let mut completed_since: Option<Instant> = None;
            loop {
                tokio::time::sleep(SERVE_CHECK).await;
                let status = self.incoming_status(uid).await;
                if view(&status) == TargetView::Status("completed") {
                    completed_since.get_or_insert_with(Instant::now);
                }
                let completed_for = completed_since.map_or(Duration::ZERO, |t| t.elapsed());
                if postcopy::target_serving_ends(view(&status), completed_for) {
                    tracing::info!(uid, ?status, "post-copy recovery: no longer served");
                    return;
                }
            }
        };
        tokio::pin!(ended);
        loop {
            let ch = tokio::select! {
                _ = &mut ended => return,
                ch = ms::accept_channel(listener, source, tls.clone()) => ch,
            };
            let mut ch = match ch {
                Ok(ch) => ch,
                Err(e) => {
                    tracing::warn!(uid, "post-copy recovery: the migration listener: {e}");
                    return;
                }
            };
            let hello: ms::Hello = match timeout(ms::recv(&mut ch)).await {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!(uid, "post-copy recovery: the source's hello: {e}");
                    continue;
                }
            };
            if hello.query {
                let reply = self.answer_query(uid, &hello).await;
                tracing::info!(uid, status = ?reply.status, "post-copy: the source asked how the target stands");
                let _ = timeout(ms::send(&mut ch, &reply)).await;
                continue;
            }
            tracing::warn!(
                uid,
                "post-copy recovery: the source asks to recover the stream"
            );
            let outcome = self
                .recover_target(uid, &hello, &mut ch, listener, source)
                .await;
            let reply = match &outcome {
                Ok(()) => ms::Reply::default(),
                Err(e) => ms::Reply {
                    error: Some(e.message.clone()),
                    unrecoverable: e.unrecoverable,
                    status: e.target_status.clone(),
                    ..ms::Reply::default()
                },
            };
            match &outcome {
                Ok(()) => tracing::info!(uid, "post-copy recovery: migrate-recover started"),
                Err(e) => tracing::warn!(uid, "post-copy recovery refused: {}", e.message),
            }
            let _ = timeout(ms::send(&mut ch, &reply)).await;
        }
    }

    /// Target: the answer to the source's query ([`ms::Hello::query`]): what our QEMU
    /// reports of the incoming migration (`gone` without a launcher; no status when the
    /// launcher does not answer, which the source counts as no answer).
    async fn answer_query(&self, uid: &str, hello: &ms::Hello) -> ms::Reply {
        if let Err(e) = ms::check_hello(hello, false) {
            return ms::Reply {
                error: Some(e),
                ..ms::Reply::default()
            };
        }
        let status = self.incoming_status(uid).await;
        ms::Reply {
            status: status_word(&status),
            error: matches!(status, Some(Err(())))
                .then(|| "the target launcher did not answer".into()),
            ..ms::Reply::default()
        }
    }

    /// Target: one recovery on the channel `ch` after the source's `hello`: the QEMU found
    /// paused (or not: refused, with what it reports), the announced data connection handed
    /// to the launcher, which runs `migrate-recover` on it.
    async fn recover_target(
        &self,
        uid: &str,
        hello: &ms::Hello,
        ch: &mut ms::Channel,
        listener: &tokio::net::TcpListener,
        source: IpAddr,
    ) -> Result<(), SetupError> {
        if !hello.recover {
            return Err("not a recovery: the stream was set up already"
                .to_string()
                .into());
        }
        ms::check_hello(hello, false)?;
        let asked = Instant::now();
        let deadline = asked + TARGET_PAUSE_WAIT;
        loop {
            let status = self.incoming_status(uid).await;
            match postcopy::target_recovery(view(&status), asked.elapsed()) {
                TargetRecovery::Recover => break,
                TargetRecovery::Wait if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                TargetRecovery::Wait => {
                    return Err(SetupError {
                        message: format!(
                            "the target's QEMU did not pause within {TARGET_PAUSE_WAIT:?} ({:?})",
                            view(&status)
                        ),
                        target_status: status_word(&status),
                        ..SetupError::default()
                    });
                }
                TargetRecovery::Refuse(why) => {
                    return Err(SetupError {
                        message: why,
                        unrecoverable: true,
                        target_status: status_word(&status),
                    });
                }
            }
        }
        timeout(ms::send(ch, &ms::Reply::default())).await?;
        let data = timeout(ms::accept_data(listener, source, hello.data_port)).await?;
        let sock = mig::incoming_socket(&self.cfg.vmi_dir(uid));
        let conn = ms::into_fd(data).map_err(|e| e.to_string())?;
        let _hand_over = AbortOnDrop(
            ms::hand_over(&sock, conn)
                .map_err(|e| format!("{}: {e}", sock.display()))?
                .abort_handle(),
        );
        launchers::request(
            &self.cfg,
            uid,
            &Request::MigrateRecover { fd_socket: sock },
            SETUP_STEP,
        )
        .await
        .map_err(|e| format!("the target launcher: {e}"))?;
        Ok(())
    }

    /// Source: the agents' channel to the target's migration port for a recovery or a
    /// query; `unrecoverable` when nothing listens there any more (the target no longer
    /// serves this migration).
    async fn recovery_channel(
        &self,
        vmi: &VirtualMachineInstance,
        target_node: &str,
    ) -> Result<(ms::Channel, std::net::SocketAddr, std::net::SocketAddr), SetupError> {
        let st = vmi
            .status
            .as_ref()
            .and_then(|s| s.migration_state.as_ref())
            .ok_or_else(|| "the VMI has no migration state".to_string())?;
        let target = mig::target_endpoint(st)
            .ok_or_else(|| "the VMI names no migration target address".to_string())?;
        let tls = self
            .channel_tls(target_node, &mig::configuration(vmi))
            .await?;
        let connected = tokio::time::timeout(
            SETUP_STEP,
            ms::connect_channel(self.net.node_netns(), target, tls),
        )
        .await;
        match connected {
            Ok(Ok((ch, local))) => Ok((ch, local, target)),
            // Nothing listens there: the target no longer serves this migration.
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => Err(SetupError {
                message: format!("the target agent at {target} no longer serves it: {e}"),
                unrecoverable: true,
                ..SetupError::default()
            }),
            Ok(Err(e)) => Err(format!("the target agent at {target}: {e}").into()),
            Err(_) => {
                Err(format!("the target agent at {target}: no answer within {SETUP_STEP:?}").into())
            }
        }
    }

    /// Source: one recovery of the broken post-copy stream of `vmi` to `target_node`: the
    /// agents' channel to the target's migration port, a new data connection from an
    /// announced port (the target's QEMU runs `migrate-recover` on it), handed to our
    /// launcher, whose QEMU resumes the migration (`migrate` with `resume`). `Err` with
    /// `unrecoverable` when no recovery can succeed (the target's QEMU is gone, or nothing
    /// listens on the target's port any more), and with the target's QEMU status when the
    /// target refused.
    pub(super) async fn recover_out(
        &self,
        vmi: &VirtualMachineInstance,
        target_node: &str,
    ) -> Result<(), SetupError> {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        let (ch, local, target) = self.recovery_channel(vmi, target_node).await?;
        let (conn, _) = self
            .open_stream(vmi, target, (ch, local, None), &[], true)
            .await?;
        let sock = self.cfg.vmi_dir(&uid).join(mig::OUTGOING_SOCKET);
        let _hand_over = AbortOnDrop(
            ms::hand_over(&sock, conn)
                .map_err(|e| format!("{}: {e}", sock.display()))?
                .abort_handle(),
        );
        launchers::request(
            &self.cfg,
            &uid,
            &Request::MigrateResume { fd_socket: sock },
            SETUP_STEP,
        )
        .await
        .map_err(|e| format!("resuming the migration: {e}"))?;
        Ok(())
    }

    /// Source: asks the target agent what its QEMU reports of the incoming migration
    /// (`postcopy::Action::ProbeTarget`); `Err`: no answer, why.
    pub(super) async fn probe_target(
        &self,
        vmi: &VirtualMachineInstance,
        target_node: &str,
    ) -> Result<String, String> {
        let (mut ch, _, _) = self
            .recovery_channel(vmi, target_node)
            .await
            .map_err(String::from)?;
        let hello = ms::Hello {
            cert: None,
            data_port: 0,
            recover: true,
            query: true,
        };
        timeout(ms::send(&mut ch, &hello)).await?;
        let reply: ms::Reply = timeout(ms::recv(&mut ch)).await?;
        match (reply.status, reply.error) {
            (Some(s), _) => Ok(s),
            (None, e) => Err(e.unwrap_or_else(|| "the target answered no status".into())),
        }
    }

    /// Source: `postcopy::Action::ProbeTarget`, query `attempt` of the target while our QEMU
    /// reports `qemu_status` with everything sent; a completion by the target is recorded,
    /// a lost guest is ended ([`Agent::lose_guest`]).
    pub(super) async fn probe(
        &self,
        vmi: &VirtualMachineInstance,
        target_node: &str,
        attempt: u32,
        qemu_status: &str,
    ) -> Probe {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        tracing::warn!(uid = %uid,
            "post-copy: everything sent but QEMU did not complete within {:?}; asking the target",
            postcopy::DRAIN_LIMIT);
        let answer = match self.probe_target(vmi, target_node).await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(uid = %uid, "post-copy: the target did not answer ({attempt} of {}): {e}",
                    postcopy::MAX_PROBES);
                return Probe::NoAnswer;
            }
        };
        match postcopy::probed(&answer, qemu_status) {
            postcopy::Probed::Completed => {
                self.record_completed_on_target(vmi, target_node, qemu_status)
                    .await;
                Probe::SwitchOver
            }
            postcopy::Probed::Wait => {
                tracing::info!(uid = %uid, "post-copy: the target still receives ({answer})");
                Probe::Wait
            }
            postcopy::Probed::Lost(why) => {
                let reason = postcopy::lost_reason(qemu_status, &format!("; {why}"));
                self.lose_guest(vmi, &reason).await;
                Probe::Lost
            }
        }
    }

    /// Source: a recovery attempt announced (Event `MigrationRecovering`) and carried out.
    pub(super) async fn try_recovery(
        &self,
        vmi: &VirtualMachineInstance,
        target_node: &str,
        attempt: u32,
    ) -> Recovery {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        tokio::time::sleep(postcopy::recovery_backoff(attempt)).await;
        let msg = format!(
            "The post-copy migration stream to {target_node} broke (QEMU: postcopy-paused): \
             recovering it over a new connection, attempt {attempt} of {}",
            postcopy::MAX_RECOVERIES
        );
        tracing::warn!(uid = %uid, "{msg}");
        self.event(vmi, "Warning", "MigrationRecovering", &msg)
            .await;
        match self.recover_out(vmi, target_node).await {
            Ok(()) => {
                tracing::info!(uid = %uid, "post-copy recovery {attempt}: the stream resumes");
                Recovery::Resumed
            }
            // The target holds the whole guest: nothing is left to recover.
            Err(e)
                if e.target_status
                    .as_deref()
                    .map(|s| postcopy::probed(s, "postcopy-paused"))
                    == Some(postcopy::Probed::Completed) =>
            {
                Recovery::Completed
            }
            Err(e) => {
                tracing::warn!(uid = %uid, "post-copy recovery {attempt} failed: {}", e.message);
                Recovery::Failed(e.unrecoverable.then_some(e.message))
            }
        }
    }

    /// Source: the target received the whole guest although our QEMU did not complete
    /// (`qemu_status`): recorded before the switch-over (Event `MigrationCompletedOnTarget`).
    pub(super) async fn record_completed_on_target(
        &self,
        vmi: &VirtualMachineInstance,
        target_node: &str,
        qemu_status: &str,
    ) {
        let msg = format!(
            "The target {target_node} received the whole guest although this node's QEMU did \
             not complete the post-copy migration (QEMU: {qemu_status}, its stream broke at \
             the end): switching over"
        );
        tracing::warn!(uid = %vmi.metadata.uid.as_deref().unwrap_or_default(), "{msg}");
        self.event(vmi, "Normal", "MigrationCompletedOnTarget", &msg)
            .await;
    }

    /// Source: the stream runs again after a recovery (Event `MigrationRecovered`).
    pub(super) async fn record_recovered(&self, vmi: &VirtualMachineInstance, attempt: u32) {
        let msg = format!(
            "The post-copy migration stream was recovered (attempt {attempt}); the remaining \
             memory follows to the target again"
        );
        tracing::info!(uid = %vmi.metadata.uid.as_deref().unwrap_or_default(), "{msg}");
        self.event(vmi, "Normal", "MigrationRecovered", &msg).await;
    }
}

/// What the follow loop does after asking the target ([`Agent::probe`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Probe {
    /// No answer: counted, asked again later.
    NoAnswer,
    /// The target still receives: followed on.
    Wait,
    /// The target holds the whole guest: switch over.
    SwitchOver,
    /// The guest was lost (recorded): the follow loop ends.
    Lost,
}

/// How a recovery attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Recovery {
    /// The source's QEMU resumes the migration on a new connection.
    Resumed,
    /// The target said its QEMU completed: the guest is whole there.
    Completed,
    /// It failed; with why no recovery can succeed, when the target said so.
    Failed(Option<String>),
}

/// What the target answers of its QEMU (`gone` without a launcher, `None` when it did not
/// answer).
fn status_word(status: &Option<Result<String, ()>>) -> Option<String> {
    match status {
        None => Some("gone".into()),
        Some(Err(())) => None,
        Some(Ok(s)) => Some(s.clone()),
    }
}

/// [`TargetView`] of what [`Agent::incoming_status`] found.
fn view(status: &Option<Result<String, ()>>) -> TargetView<'_> {
    match status {
        None => TargetView::Gone,
        Some(Err(())) => TargetView::NoAnswer,
        Some(Ok(s)) => TargetView::Status(s),
    }
}
