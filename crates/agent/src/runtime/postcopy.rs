//! The agents' side of post-copy at run time (docs/migration.md "Post-copy"; the decisions
//! are [`crate::postcopy`]'s): `migrationState.mode: PostCopy` and an Event once the
//! migration has switched; the recovery of a broken post-copy stream — the source agent sets
//! up a new data connection exactly as the original stream's ([`crate::migstream`]: the
//! agents' authenticated channel, the announced source port, the SCM_RIGHTS hand-over; the
//! QEMUs keep their TLS credentials), the target's QEMU runs `migrate-recover` on it and the
//! source's `migrate` with `resume`; and the end of a guest lost when recovery cannot succeed
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

    /// Target of a migration that may switch to post-copy: serves the source's recoveries on
    /// the migration's `listener` (channels from `source` only, with the agents' pinned TLS)
    /// until the incoming migration ends.
    pub(super) async fn serve_recoveries(
        &self,
        uid: &str,
        listener: &tokio::net::TcpListener,
        source: IpAddr,
        tls: Option<std::sync::Arc<rustls::ServerConfig>>,
    ) {
        let ended = async {
            loop {
                tokio::time::sleep(SERVE_CHECK).await;
                let status = self.incoming_status(uid).await;
                if postcopy::target_serving_ends(view(&status)) {
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
            tracing::warn!(
                uid,
                "post-copy recovery: the source asks to recover the stream"
            );
            let outcome = self.recover_target(uid, &mut ch, listener, source).await;
            let reply = match &outcome {
                Ok(()) => ms::Reply::default(),
                Err(e) => ms::Reply {
                    error: Some(e.message.clone()),
                    unrecoverable: e.unrecoverable,
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

    /// Target: one recovery on the channel `ch`: the source's hello, the QEMU found paused
    /// (or not: refused), the announced data connection handed to the launcher, which runs
    /// `migrate-recover` on it.
    async fn recover_target(
        &self,
        uid: &str,
        ch: &mut ms::Channel,
        listener: &tokio::net::TcpListener,
        source: IpAddr,
    ) -> Result<(), SetupError> {
        let hello: ms::Hello = timeout(ms::recv(ch)).await?;
        if !hello.recover {
            return Err("not a recovery: the stream was set up already"
                .to_string()
                .into());
        }
        ms::check_hello(&hello, false)?;
        let deadline = Instant::now() + TARGET_PAUSE_WAIT;
        loop {
            let status = self.incoming_status(uid).await;
            match postcopy::target_recovery(view(&status)) {
                TargetRecovery::Recover => break,
                TargetRecovery::Wait if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                TargetRecovery::Wait => {
                    return Err(format!(
                        "the target's QEMU did not pause within {TARGET_PAUSE_WAIT:?} ({:?})",
                        view(&status)
                    )
                    .into());
                }
                TargetRecovery::Refuse(why) => {
                    return Err(SetupError {
                        message: why,
                        unrecoverable: true,
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

    /// Source: one recovery of the broken post-copy stream of `vmi` to `target_node`: the
    /// agents' channel to the target's migration port, a new data connection from an
    /// announced port (the target's QEMU runs `migrate-recover` on it), handed to our
    /// launcher, whose QEMU resumes the migration (`migrate` with `resume`). `Err` with
    /// `unrecoverable` when no recovery can succeed (the target's QEMU is gone, or nothing
    /// listens on the target's port any more).
    pub(super) async fn recover_out(
        &self,
        vmi: &VirtualMachineInstance,
        target_node: &str,
    ) -> Result<(), SetupError> {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
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
        let (ch, local) = match connected {
            Ok(Ok(c)) => c,
            // Nothing listens there: the target no longer serves this migration.
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                return Err(SetupError {
                    message: format!("the target agent at {target} no longer serves it: {e}"),
                    unrecoverable: true,
                });
            }
            Ok(Err(e)) => return Err(format!("the target agent at {target}: {e}").into()),
            Err(_) => {
                return Err(format!(
                    "the target agent at {target}: no answer within {SETUP_STEP:?}"
                )
                .into());
            }
        };
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

    /// Source: a recovery attempt announced (Event `MigrationRecovering`) and carried out.
    /// Returns why recovery cannot succeed at all, if the target said so.
    pub(super) async fn try_recovery(
        &self,
        vmi: &VirtualMachineInstance,
        target_node: &str,
        attempt: u32,
    ) -> Option<String> {
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
                None
            }
            Err(e) => {
                tracing::warn!(uid = %uid, "post-copy recovery {attempt} failed: {}", e.message);
                e.unrecoverable.then_some(e.message)
            }
        }
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

/// [`TargetView`] of what [`Agent::incoming_status`] found.
fn view(status: &Option<Result<String, ()>>) -> TargetView<'_> {
    match status {
        None => TargetView::Gone,
        Some(Err(())) => TargetView::NoAnswer,
        Some(Ok(s)) => TargetView::Status(s),
    }
}
