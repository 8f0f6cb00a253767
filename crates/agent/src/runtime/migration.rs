//! Live migration, the node's side at run time (docs/migration.md; the decisions are
//! [`crate::migration`]'s): a second VMI watch, on `status.migrationState.targetNode=<node>`,
//! finds the migrations this node receives; the target prepares a launcher whose QEMU waits
//! for the stream and reports where to send it; the source, seeing that address on its VMI,
//! sets the stream up with the target agent ([`crate::migstream`]: certificates exchanged,
//! the data connection handed to both launchers, QEMU to QEMU with QEMU's own TLS), moves the
//! VMI to the target in one write once QEMU reports the migration completed, and lets its
//! launcher go without the VMI ever looking failed.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_launcher::control::Request;
use futures::StreamExt;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, reflector};
use kube::runtime::watcher::{self, watcher};
use serde_json::json;

use super::{Agent, now_string, ns_name, vmi_resource};
use crate::decide::Observed;
use crate::error::AgentError;
use crate::launchers;
use crate::migration::{self as mig, SourceStep, TargetStep};
use crate::migstream as ms;
use crate::postcopy;
use ferrovirt_launcher::migtls::Endpoint;

/// How often the source asks its launcher how the migration goes.
const POLL: Duration = Duration::from_millis(50);
/// The longest wait for QEMU's next migration event before the follow loop looks anyway.
const POLL_MAX: Duration = Duration::from_millis(250);
/// The follow loop's wait for the figures of a completed migration.
const QUICK: Duration = Duration::from_millis(10);
/// How long the target's QEMU may take to come up waiting for the stream.
const TARGET_START: Duration = Duration::from_secs(30);
/// How long each step of the stream's setup between the agents may take.
pub(super) const SETUP_STEP: Duration = Duration::from_secs(30);

/// The field selector of the VMIs migrating to `node`.
pub fn target_selector(node: &str) -> String {
    format!("status.migrationState.targetNode={node}")
}

/// Watches the VMIs migrating to this node and acts on each change (and every resync).
pub(super) async fn target_loop(agent: Arc<Agent>) {
    let api: Api<DynamicObject> = Api::all_with(agent.client.clone(), &vmi_resource());
    let cfg = watcher::Config::default().fields(&target_selector(&agent.opts.node_name));
    let writer = reflector::store::Writer::<DynamicObject>::new(vmi_resource());
    let store = writer.as_reader();
    let mut events = reflector(writer, watcher(api, cfg).default_backoff())
        .touched_objects()
        .boxed();
    let mut resync = tokio::time::interval(agent.opts.resync_interval);
    let mut synced = false;
    loop {
        tokio::select! {
            ev = events.next() => match ev {
                Some(Err(e)) => { tracing::warn!("watching incoming migrations: {e}"); continue }
                Some(Ok(_)) => {}
                None => return,
            },
            _ = resync.tick() => {}
            // The first list is in (possibly empty): mark the targets known.
            _ = store.wait_until_ready(), if !synced => {}
        }
        let vmis: Vec<VirtualMachineInstance> = store
            .state()
            .iter()
            .filter_map(|o| {
                serde_json::to_value(&**o)
                    .ok()
                    .and_then(|v| serde_json::from_value(v).ok())
            })
            .collect();
        let uids: HashSet<String> = vmis.iter().filter_map(|v| v.metadata.uid.clone()).collect();
        let gone: Vec<String> = {
            let mut targets = agent.targets.lock().unwrap_or_else(|p| p.into_inner());
            let gone = targets.difference(&uids).cloned().collect();
            targets.extend(uids.iter().cloned());
            gone
        };
        if !synced
            && futures::FutureExt::now_or_never(store.wait_until_ready()).is_some_and(|r| r.is_ok())
        {
            synced = true;
            agent
                .targets_synced
                .store(true, std::sync::atomic::Ordering::Release);
        }
        for vmi in vmis {
            agent.reconcile_target(&vmi).await;
        }
        // A VMI that left the selection (deleted, or its migration replaced by another):
        // a launcher still waiting for it is abandoned unless the VMI now runs here.
        for uid in gone {
            agent
                .targets
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&uid);
            let preparing = agent.preparing.lock().await.contains(&uid);
            if !preparing && !agent.runs_here(&uid) {
                agent.abandon_target(&uid).await;
            }
        }
    }
}

impl Agent {
    /// Asks VMI `uid`'s launcher to cancel its outgoing migration (QMP `migrate_cancel`); an
    /// error is left to the follow loop, which sees the migration's state at its next poll.
    pub(super) async fn cancel_migration(&self, uid: &str) {
        if let Err(e) = launchers::request(
            &self.cfg,
            uid,
            &Request::MigrateCancel,
            Duration::from_secs(10),
        )
        .await
        {
            tracing::debug!(%uid, "cancelling the migration: {e}");
        }
    }

    /// Whether the VMI with `uid` is bound to this node (its reflector says so).
    fn runs_here(&self, uid: &str) -> bool {
        self.bound_uids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(uid)
    }

    async fn reconcile_target(self: &Arc<Self>, vmi: &VirtualMachineInstance) {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        let launcher = self.cfg.vmi_dir(&uid).exists();
        let preparing = self.preparing.lock().await.contains(&uid);
        // A block migration's copies to take over (also after this agent restarted).
        self.resume_block_target(vmi, launcher, preparing).await;
        match mig::target_step(vmi, &self.opts.node_name, launcher, preparing) {
            TargetStep::Nothing => {}
            TargetStep::Abandon => {
                if !self.runs_here(&uid) {
                    self.abandon_target(&uid).await;
                }
            }
            TargetStep::Prepare => {
                self.preparing.lock().await.insert(uid.clone());
                let me = self.clone();
                let vmi = vmi.clone();
                tokio::spawn(async move {
                    if let Err(e) = me.prepare_target(&vmi).await {
                        let msg = format!(
                            "preparing the migration target on {}: {e}",
                            me.opts.node_name
                        );
                        tracing::warn!(uid = %uid, "{msg}");
                        me.event(&vmi, "Warning", "FailedMigration", &msg).await;
                        let _ = me
                            .patch_status(&vmi, mig::failed_patch(&msg, &now_string()))
                            .await;
                        me.abandon_target(&uid).await;
                    }
                    me.preparing.lock().await.remove(&uid);
                });
            }
        }
    }

    /// Starts the launcher waiting for the incoming stream and the task that receives it
    /// ([`Agent::receive_stream`]), and reports the address on the VMI.
    async fn prepare_target(
        self: &Arc<Self>,
        vmi: &VirtualMachineInstance,
    ) -> Result<(), AgentError> {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        self.event(
            vmi,
            "Normal",
            "PreparingTarget",
            &format!(
                "Starting a launcher on {} for the incoming VM",
                self.opts.node_name
            ),
        )
        .await;
        // Node-local disks: empty copies here, filled by the source's mirrors; their
        // snapshot chains' frozen layers first, from the source agent.
        let block = self.prepare_block_target(vmi).await?;
        if !block.claim_paths.is_empty() {
            self.receive_chains(vmi, &block).await?;
        }
        let encrypted = !mig::tls_disabled(&mig::configuration(vmi));
        // The source node's identity is read while the launcher starts (independent).
        let started = async {
            self.start_with(
                vmi,
                &mut ferrovirt_launcher::timing::Timeline::default(),
                true,
                &block.claim_paths,
            )
            .await?;
            self.wait_target_qemu(&uid).await?;
            // Our ephemeral certificate, made before TargetReady: the source never waits
            // for it (a fresh target launcher answers its first request slowly, ~1 s).
            let t0 = Instant::now();
            let cert = match encrypted {
                true => Some(
                    self.launcher_cert(&uid, Endpoint::Server)
                        .await
                        .map_err(AgentError::Reference)?,
                ),
                false => None,
            };
            tracing::info!(uid = %uid, "migration setup: target certificate in {} ms (PreparingTarget)",
                t0.elapsed().as_millis());
            Ok::<_, AgentError>(cert)
        };
        let source_name = source_node(vmi);
        let (started, identity) = tokio::join!(started, self.node_identity(&source_name));
        let own_cert = started?;
        let (source, source_pin) = identity?;
        let ip: IpAddr = self
            .net
            .internal_ip()
            .unwrap_or_else(|| self.opts.address.clone())
            .parse()
            .map_err(|e| AgentError::Reference(format!("the node address: {e}")))?;
        let tls = if !encrypted {
            None
        } else {
            let pin = source_pin.ok_or_else(|| {
                AgentError::Reference(
                    "the source node publishes no certificate: the migration stream cannot be \
                     encrypted (set disableTLS in the migration configuration to allow it)"
                        .into(),
                )
            })?;
            Some(crate::tls::migration_server_config(&self.cert, pin)?)
        };
        let listener = mig::bind_in(self.net.node_netns(), ip)
            .await
            .map_err(|e| AgentError::Reference(format!("migration listener on {ip}: {e}")))?;
        let port = listener
            .local_addr()
            .map_err(|e| AgentError::Reference(e.to_string()))?
            .port();
        let nbd = self.nbd_listener(&block, ip, source).await?;
        let nbd_ports: Vec<u16> = nbd.iter().map(|n| n.1).collect();
        let me = self.clone();
        let u = uid.clone();
        let post_copy = mig::post_copy_allowed(&mig::configuration(vmi), !block.disks.is_empty());
        let receiver = tokio::spawn(async move {
            let stream = Stream {
                listener,
                source,
                tls,
                own_cert,
                post_copy,
                nbd: nbd.map(|n| n.0),
            };
            if let Err(e) = me.receive_stream(&u, stream).await {
                tracing::warn!(uid = %u, "receiving the migration: {e}");
            }
        });
        self.relays
            .lock()
            .await
            .insert(uid.clone(), receiver.abort_handle());
        self.patch_status(
            vmi,
            mig::target_ready_patch(ip, port, &nbd_ports, &now_string()),
        )
        .await?;
        tracing::info!(uid = %uid, "migration target ready on {ip}:{port}");
        if !block.disks.is_empty() {
            self.spawn_finish_block_target(vmi).await;
        }
        Ok(())
    }

    /// Target: waits until the launcher of `uid` runs its QEMU (`-incoming defer`).
    async fn wait_target_qemu(&self, uid: &str) -> Result<(), AgentError> {
        let deadline = Instant::now() + TARGET_START;
        loop {
            match launchers::observe(&self.cfg, uid).await {
                Observed::Running(_) => break,
                Observed::Exited(rep) => {
                    return Err(AgentError::Reference(format!(
                        "the target launcher exited: {}",
                        rep.message
                    )));
                }
                _ if Instant::now() > deadline => {
                    return Err(AgentError::Reference(format!(
                        "the target QEMU did not come up within {TARGET_START:?}"
                    )));
                }
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        Ok(())
    }

    /// Target: the stream's setup with the source agent ([`crate::migstream`]): the
    /// authenticated channel from the source node, the certificates exchanged, the announced
    /// data connection handed to the launcher, whose QEMU starts `migrate-incoming` on it.
    /// An error after the channel is up is told to the source.
    async fn receive_stream(&self, uid: &str, stream: Stream) -> Result<(), String> {
        let Stream {
            listener,
            source,
            tls,
            own_cert,
            post_copy,
            nbd,
        } = stream;
        // With disks to copy, the source mirrors them before it opens the data connection.
        let data_wait = match nbd {
            Some(_) => super::blockmig::MIRROR_SYNC + SETUP_STEP,
            None => SETUP_STEP,
        };
        let encrypted = tls.is_some();
        // Our ephemeral certificate was made before TargetReady (`own_cert`).
        let waiting = Instant::now();
        let recovery_tls = tls.clone();
        let ch = ms::accept_channel(&listener, source, tls).await;
        tracing::info!(uid = %uid, "migration setup: the source's channel after {} ms",
            waiting.elapsed().as_millis());
        let mut ch = ch.map_err(|e| format!("the source's channel: {e}"))?;
        let steps = async {
            let t0 = Instant::now();
            let hello: ms::Hello = timeout(ms::recv(&mut ch)).await?;
            ms::check_hello(&hello, encrypted)?;
            let t_cert = t0.elapsed().as_millis();
            if let Some(nbd) = nbd {
                // QEMU's NBD server, with QEMU's TLS trusting only the source's certificate.
                self.export_disks(uid, nbd, hello.cert.clone()).await?;
                tracing::info!(uid = %uid, "block migration: hello in {t_cert} ms, NBD export in {} ms",
                    t0.elapsed().as_millis() - t_cert);
            }
            let reply = ms::Reply {
                cert: own_cert,
                ..ms::Reply::default()
            };
            timeout(ms::send(&mut ch, &reply)).await?;
            let data = timeout_for(
                data_wait,
                ms::accept_data(&listener, source, hello.data_port),
            )
            .await?;
            let sock = mig::incoming_socket(&self.cfg.vmi_dir(uid));
            let conn = ms::into_fd(data).map_err(|e| e.to_string())?;
            let _hand_over = AbortOnDrop(
                ms::hand_over(&sock, conn)
                    .map_err(|e| format!("{}: {e}", sock.display()))?
                    .abort_handle(),
            );
            let req = Request::MigrateIncoming {
                fd_socket: sock,
                peer_cert: hello.cert,
                post_copy,
            };
            launchers::request(&self.cfg, uid, &req, SETUP_STEP)
                .await
                .map_err(|e| format!("the target launcher: {e}"))?;
            Ok::<_, String>(())
        }
        .await;
        let reply = ms::Reply {
            error: steps.clone().err(),
            ..ms::Reply::default()
        };
        let _ = timeout(ms::send(&mut ch, &reply)).await;
        // Post-copy allowed: the listener stays, for the source's recoveries of a broken
        // post-copy stream, until the incoming migration ends.
        if steps.is_ok() && post_copy {
            drop(ch);
            self.serve_recoveries(uid, &listener, source, recovery_tls)
                .await;
        }
        steps
    }

    /// Stops and removes a target launcher that will not receive its VM.
    async fn abandon_target(&self, uid: &str) {
        if let Some(r) = self.relays.lock().await.remove(uid) {
            r.abort();
        }
        self.abandon_block_target(uid).await;
        let dir = self.cfg.vmi_dir(uid);
        if !dir.exists() {
            return;
        }
        tracing::info!(uid, "abandoning a migration target");
        if let Observed::Running(_) = launchers::observe(&self.cfg, uid).await {
            let _ = launchers::request(
                &self.cfg,
                uid,
                &Request::Shutdown { grace_seconds: 0 },
                Duration::from_secs(30),
            )
            .await;
        }
        self.net.detach(uid).await;
        launchers::remove_dir(&dir);
    }

    /// The source's part, called from the ordinary reconcile of a VMI bound here.
    pub(super) async fn reconcile_source(self: &Arc<Self>, vmi: &VirtualMachineInstance) -> bool {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        self.reconcile_chains(vmi);
        let driving = self.busy.lock().await.contains(&uid);
        let SourceStep::Migrate {
            target,
            target_node,
            migration_uid,
        } = mig::source_step(vmi, &self.opts.node_name, driving)
        else {
            // A migration this node was sending before the agent restarted.
            if crate::migresume::resumable(vmi, &self.opts.node_name, driving) {
                self.busy.lock().await.insert(uid.clone());
                tokio::spawn(self.clone().resume_out(vmi.clone()));
                return true;
            }
            return false;
        };
        self.busy.lock().await.insert(uid.clone());
        let me = self.clone();
        let vmi = vmi.clone();
        tokio::spawn(async move {
            let outcome = me
                .migrate_out(&vmi, target, &target_node, &migration_uid)
                .await;
            if let Err(reason) = outcome {
                me.fail_out(&vmi, &reason).await;
            }
            me.busy.lock().await.remove(&uid);
        });
        true
    }

    /// Records a failed migration this node was sending (the source runs on): the disk
    /// mirrors cancelled, a `FailedMigration` Event, `failed` with the reason (and
    /// `abortStatus: Succeeded` when it was cancelled on request).
    pub(super) async fn fail_out(&self, vmi: &VirtualMachineInstance, reason: &str) {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        tracing::warn!(uid = %uid, "migration failed: {reason}");
        if !mig::read_block_volumes(&self.cfg.vmi_dir(&uid)).is_empty() {
            self.cancel_mirrors(&uid).await;
        }
        self.event(vmi, "Warning", "FailedMigration", reason).await;
        let mut patch = mig::failed_patch(reason, &now_string());
        if self.abort_requested(vmi).await {
            patch["migrationState"]["abortStatus"] = json!("Succeeded");
        }
        if let Err(e) = self.patch_status(vmi, patch).await {
            tracing::warn!("recording the failed migration: {e}");
        }
    }

    /// Sends the VM to `target`, switches over, lets the source launcher go. `Err`: why it
    /// failed (the source runs on).
    async fn migrate_out(
        &self,
        vmi: &VirtualMachineInstance,
        target: std::net::SocketAddr,
        target_node: &str,
        migration_uid: &str,
    ) -> Result<(), String> {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        let dir = self.cfg.vmi_dir(&uid);
        let config = mig::configuration(vmi);
        // A chain in a state that cannot be carried (an online merge unfinished).
        if let Some(Err((_, why))) =
            mig::read_migratable_now(&dir, &crate::nodestore::volume_root(&self.opts.data_dir))
        {
            return Err(why);
        }
        let block = mig::read_block_volumes(&dir);
        let tls = self.channel_tls(target_node, &config).await?;
        let encrypted = tls.is_some();
        // The channel (TLS handshake) and our launcher's ephemeral certificate are made
        // together, while the start is written and announced: none waits for another.
        let setup_started = Instant::now();
        let setup = async {
            let connect = timeout(ms::connect_channel(self.net.node_netns(), target, tls));
            let connect = async {
                connect
                    .await
                    .map_err(|e| format!("the target agent at {target}: {e}"))
            };
            let cert = async {
                match encrypted {
                    true => self.launcher_cert(&uid, Endpoint::Client).await.map(Some),
                    false => Ok(None),
                }
            };
            let r = tokio::try_join!(connect, cert);
            tracing::info!(uid = %uid, "migration setup: channel and certificate in {} ms",
                setup_started.elapsed().as_millis());
            r
        };
        let (setup, announced) = tokio::join!(
            setup,
            self.announce_out(vmi, target, target_node, block.len())
        );
        tracing::info!(uid = %uid, "migration setup: start announced in {} ms",
            setup_started.elapsed().as_millis());
        announced?;
        let ((ch, local), cert) = setup?;
        // Node-local disks first (inside the stream's setup, once the target's certificate
        // is known): every mirror in sync before the memory moves.
        let copy_started = Instant::now();
        let (conn, peer_cert) = self
            .open_stream(vmi, target, (ch, local, cert), &block, false)
            .await?;
        if !block.is_empty() {
            tracing::info!(uid = %uid, "block migration: disks in sync and the stream connected {} ms after the start",
                copy_started.elapsed().as_millis());
        }
        let sock = dir.join(mig::OUTGOING_SOCKET);
        let _hand_over = AbortOnDrop(
            ms::hand_over(&sock, conn)
                .map_err(|e| format!("{}: {e}", sock.display()))?
                .abort_handle(),
        );
        let req = Request::Migrate {
            fd_socket: sock,
            peer_cert,
            max_bandwidth: ferrovirt_api::migration_policy::bandwidth_bytes(&config),
            auto_converge: config.allow_auto_converge == Some(true),
            block: !block.is_empty(),
            post_copy: mig::post_copy_allowed(&config, !block.is_empty()),
        };
        launchers::request(&self.cfg, &uid, &req, SETUP_STEP)
            .await
            .map_err(|e| format!("starting the migration: {e}"))?;
        self.follow_out(FollowOut {
            vmi,
            target_node,
            migration_uid,
            block: &block,
            copy_started,
            abort: None,
        })
        .await
    }

    /// Follows the migration QEMU sends (`query-migrate` at each of its migration events,
    /// at least every [`POLL_MAX`]: the block
    /// switch-over, timeouts, a cancel), then switches over: the VMI moves to the target in
    /// one write, the launcher is told `MigratedAway` and its directory removed. `Err`: why
    /// it failed (the source runs on). Used by the original path and by a restarted agent
    /// ([`crate::migresume`]).
    pub(super) async fn follow_out(&self, f: FollowOut<'_>) -> Result<(), String> {
        let FollowOut {
            vmi,
            target_node,
            migration_uid,
            block,
            copy_started,
            abort,
        } = f;
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        let dir = self.cfg.vmi_dir(&uid);
        let config = mig::configuration(vmi);
        let started = Instant::now();
        let mut progress = mig::Progress::default();
        let mut last_check = Instant::now();
        let mut abort = abort;
        let mut final_tries = 0;
        let mut switched = false;
        let allow_post_copy = mig::post_copy_allowed(&config, !block.is_empty());
        let no_completion_timeout = ferrovirt_api::kubevirt::misc::MigrationConfiguration {
            completion_timeout_per_gib: None,
            ..config.clone()
        };
        let mut post_copy = false;
        let mut cancel_refused = false;
        let mut start_refusals = 0u32;
        // Post-copy recovery: attempts so far, why none can succeed (once known), since when
        // QEMU is in `postcopy-recover`, and whether a recovery awaits its success.
        let mut recoveries = 0u32;
        let mut unrecoverable: Option<String> = None;
        let mut recovering_since: Option<Instant> = None;
        let mut recovery_pending = false;
        // Post-copy with nothing left to send but no completion: since when (or since the
        // target's last answer), and the target's unanswered queries.
        let mut drained_since: Option<Instant> = None;
        let mut probes = 0u32;
        // QEMU is asked again when it reports an event (a state change: pre-switchover,
        // completed, a pass), at least every POLL_MAX for the timeouts and the cancel check;
        // a completion whose figures are not in yet is asked again after QUICK.
        let mut events = launchers::JobEvents::new(POLL);
        let mut quick = false;
        let info = loop {
            match std::mem::take(&mut quick) {
                true => tokio::time::sleep(QUICK).await,
                false => events.next(&self.cfg, &uid, POLL_MAX).await,
            }
            let v = launchers::request(
                &self.cfg,
                &uid,
                &Request::MigrationStatus,
                Duration::from_secs(10),
            )
            .await
            .map_err(|e| format!("following the migration: {e}"))?;
            let status = v["status"].as_str().unwrap_or_default();
            if postcopy::in_post_copy(status) && !post_copy {
                // Switched (by this loop, or before an agent restart): recorded once.
                post_copy = true;
                self.record_post_copy(vmi, target_node).await;
            }
            if recovery_pending && matches!(status, "postcopy-active" | "completed") {
                recovery_pending = false;
                self.record_recovered(vmi, recoveries).await;
            }
            recovering_since = match status {
                "postcopy-recover" => Some(recovering_since.unwrap_or_else(Instant::now)),
                _ => None,
            };
            let drained = status == "postcopy-active" && v["ram"]["remaining"].as_u64() == Some(0);
            drained_since = drained.then(|| drained_since.unwrap_or_else(Instant::now));
            match status {
                // QEMU sets the figures a moment after the state: ask again until they are in.
                "completed" if mig::figures(&v).0.unwrap_or(0) > 0 || final_tries >= 10 => {
                    break v;
                }
                "completed" => {
                    final_tries += 1;
                    quick = true;
                    continue;
                }
                // Paused before the switch-over (block migration): the mirrors complete
                // (a last copy), then the last round of memory goes.
                "pre-switchover" if !switched && abort.is_none() => {
                    switched = true;
                    let paused = Instant::now();
                    if let Err(e) = launchers::request(
                        &self.cfg,
                        &uid,
                        &Request::Block {
                            step: ferrovirt_launcher::control::BlockOp::SwitchOver,
                        },
                        Duration::from_secs(150),
                    )
                    .await
                    {
                        let why = format!("completing the disk mirrors: {e}");
                        self.cancel_migration(&uid).await;
                        abort = Some(why);
                    }
                    tracing::info!(uid = %uid,
                        "block migration: pre-switchover {} ms after the memory started, mirrors completed in {} ms",
                        started.elapsed().as_millis(), paused.elapsed().as_millis());
                    continue;
                }
                "failed" | "cancelled" if !post_copy => {
                    return Err(abort.unwrap_or_else(|| {
                        format!(
                            "QEMU: migration {status}: {}",
                            v["error-desc"].as_str().unwrap_or("no reason given")
                        )
                    }));
                }
                _ => {}
            }
            if abort.is_some() {
                continue;
            }
            progress.observe(&v, started.elapsed());
            let elapsed = started.elapsed().as_secs();
            let memory = v["ram"]["total"].as_u64().unwrap_or(0);
            use ferrovirt_api::migration_policy::timed_out;
            // A cancel (the VMIM deleted) shows as abortRequested on the VMI.
            let cancelled = if last_check.elapsed() >= Duration::from_millis(500) {
                last_check = Instant::now();
                self.abort_requested(vmi).await
            } else {
                false
            };
            let poll = postcopy::Poll {
                qemu_status: status,
                completion_timeout: timed_out(&config, memory, elapsed, 0),
                progress_timeout: timed_out(
                    &no_completion_timeout,
                    memory,
                    elapsed,
                    progress.stalled_for(started.elapsed()).as_secs(),
                ),
                cancelled,
                allow_post_copy,
                block: !block.is_empty(),
                post_copy_requested: post_copy,
                recoveries,
                unrecoverable: unrecoverable.clone(),
                recover_stuck: recovering_since
                    .is_some_and(|t| t.elapsed() > postcopy::RECOVER_LIMIT),
                drained_stuck: drained_since.is_some_and(|t| t.elapsed() > postcopy::DRAIN_LIMIT),
                probes,
            };
            match postcopy::decide(&poll) {
                postcopy::Action::Continue => {}
                postcopy::Action::Cancel(why) => {
                    tracing::info!(uid = %uid, "aborting the migration: {why}");
                    self.cancel_migration(&uid).await;
                    abort = Some(why);
                }
                postcopy::Action::StartPostCopy => {
                    tracing::info!(uid = %uid, "completion timeout: switching to post-copy");
                    match launchers::request(
                        &self.cfg,
                        &uid,
                        &Request::StartPostCopy,
                        Duration::from_secs(10),
                    )
                    .await
                    {
                        Ok(_) => {
                            post_copy = true;
                            self.record_post_copy(vmi, target_node).await;
                        }
                        // Whether QEMU switched is read at the next poll (a post-copy state is
                        // followed, never cancelled); one that stays in pre-copy after a few
                        // refusals is cancelled, which is safe while it is pre-copy.
                        Err(e) if start_refusals < 2 => {
                            start_refusals += 1;
                            tracing::warn!(uid = %uid, "switching to post-copy: {e}");
                        }
                        Err(e) => {
                            let why = format!("switching to post-copy: {e}");
                            self.cancel_migration(&uid).await;
                            abort = Some(why);
                        }
                    }
                }
                postcopy::Action::RefuseCancel => {
                    if !cancel_refused {
                        cancel_refused = true;
                        self.event(
                            vmi,
                            "Warning",
                            "MigrationAbortRefused",
                            "The migration runs in post-copy: the guest runs on the target and \
                             can no longer return to the source, so it cannot be cancelled",
                        )
                        .await;
                    }
                }
                postcopy::Action::Recover { attempt } => {
                    recoveries = attempt;
                    match self.try_recovery(vmi, target_node, attempt).await {
                        super::postcopy::Recovery::Completed => {
                            self.record_completed_on_target(vmi, target_node, status)
                                .await;
                            break v;
                        }
                        super::postcopy::Recovery::Resumed => recovery_pending = true,
                        super::postcopy::Recovery::Failed(why) => {
                            recovery_pending = why.is_none();
                            unrecoverable = why;
                        }
                    }
                }
                postcopy::Action::ProbeTarget { attempt } => {
                    drained_since = Some(Instant::now());
                    match self.probe(vmi, target_node, attempt, status).await {
                        super::postcopy::Probe::NoAnswer => probes = attempt,
                        super::postcopy::Probe::Wait => {}
                        super::postcopy::Probe::SwitchOver => break v,
                        super::postcopy::Probe::Lost => return Ok(()),
                    }
                }
                postcopy::Action::Lost(why) => {
                    self.lose_guest(vmi, &why).await;
                    return Ok(());
                }
            }
        };
        // Mirror start → QEMU's `completed`, the span the raw baseline of bench/migration.py
        // times too; the switch-over write below is logged on its own.
        let copied_in = copy_started.elapsed();
        let write_started = Instant::now();
        // Switch-over: the VMI belongs to the target from this write on. The source QEMU is
        // paused (post-migrate) and never runs again.
        self.moved
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(uid.clone(), migration_uid.to_string());
        let (ns, name) = ns_name(vmi);
        let patch = mig::switch_over_patch(vmi.metadata.uid.as_deref(), target_node, &now_string());
        // The target runs the guest from here on: the source must never resume, so the
        // write is retried until the API server takes it (backing off to 5 s), with an
        // error logged and a Warning recorded once it has failed for a while.
        let mut tries = 0u32;
        loop {
            match self
                .vmi_api(&ns)
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {
                    // The guest runs on the target: this node stops routing its address
                    // here (the target publishes it once it sees the VMI).
                    self.net.unhost(&uid);
                    break;
                }
                Err(e) => {
                    tries += 1;
                    tracing::warn!("switch-over write failed ({e}); retrying");
                    if tries == 20 {
                        tracing::error!(
                            uid = %uid,
                            "switch-over write still failing after 20 tries ({e}): the source \
                             QEMU stays paused until it is written"
                        );
                        self.event(
                            vmi,
                            "Warning",
                            "SwitchOverPending",
                            &format!("The VM runs on {target_node}; moving the VMI there keeps failing: {e}"),
                        )
                        .await;
                    }
                    let wait = mig::switch_over_backoff(tries);
                    tokio::time::sleep(wait).await;
                }
            }
        }
        let (total, downtime) = mig::figures(&info);
        let mut msg = format!(
            "Migrated to {target_node} (total {} ms, downtime {} ms)",
            total.map_or("?".into(), |t| t.to_string()),
            downtime.map_or("?".into(), |t| t.to_string())
        );
        if !block.is_empty() {
            msg.push_str(&format!(
                "; {} disk(s) mirrored, disks and memory {} ms",
                block.len(),
                copied_in.as_millis()
            ));
        }
        tracing::info!(uid = %uid, "{msg}; switch-over written in {} ms",
            write_started.elapsed().as_millis());
        self.event(vmi, "Normal", "Migrated", &msg).await;
        let _ = launchers::request(
            &self.cfg,
            &uid,
            &Request::MigratedAway,
            Duration::from_secs(10),
        )
        .await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(
            launchers::observe(&self.cfg, &uid).await,
            Observed::Running(_)
        ) && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.guest_info.lock().await.remove(&uid);
        self.disk_sizes.lock().await.remove(&uid);
        self.net.detach(&uid).await;
        if !block.is_empty() {
            self.release_source_copies(vmi).await;
        }
        launchers::remove_dir(&dir);
        Ok(())
    }

    /// Whether the VMI (read now) asks for its migration to be aborted.
    pub(super) async fn abort_requested(&self, vmi: &VirtualMachineInstance) -> bool {
        let (ns, name) = ns_name(vmi);
        match self.vmi_api(&ns).get_opt(&name).await {
            Ok(Some(o)) => {
                let st = &o.data["status"]["migrationState"];
                st["abortRequested"] == true
                    && st["migrationUid"].as_str()
                        == vmi
                            .status
                            .as_ref()
                            .and_then(|s| s.migration_state.as_ref())
                            .and_then(|m| m.migration_uid.as_deref())
            }
            _ => false,
        }
    }

    /// Forgets the VMIs moved away that the VMI cache no longer holds (`known`: the uids it
    /// holds): only a cached stale copy needs the entry, and a VMI that comes back carries
    /// another migration uid. Keeps the map as small as the migrations still in view.
    pub(super) fn forget_moved(&self, known: &std::collections::HashSet<String>) {
        self.moved
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|uid, _| known.contains(uid));
    }

    /// Whether the cached VMI is the stale copy of one this agent moved away (its watch has
    /// not delivered the switch-over yet): nothing may be done about it here.
    pub(super) fn moved_away(&self, vmi: &VirtualMachineInstance) -> bool {
        let uid = vmi.metadata.uid.as_deref().unwrap_or_default();
        let current = vmi
            .status
            .as_ref()
            .and_then(|s| s.migration_state.as_ref())
            .and_then(|m| m.migration_uid.as_deref());
        self.moved
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(uid)
            .is_some_and(|m| Some(m.as_str()) == current)
    }
}

/// What the target's [`Agent::receive_stream`] receives on.
struct Stream {
    listener: tokio::net::TcpListener,
    /// The source node's address: the only peer accepted.
    source: IpAddr,
    tls: Option<Arc<rustls::ServerConfig>>,
    /// Our launcher's ephemeral certificate (`None` with `disableTLS`).
    own_cert: Option<String>,
    /// `postcopy-ram` on the target's QEMU ([`mig::post_copy_allowed`]).
    post_copy: bool,
    /// A block migration's NBD socket, handed to QEMU once the source's certificate is known.
    nbd: Option<super::blockmig::NbdListener>,
}

/// What [`Agent::follow_out`] follows.
pub(super) struct FollowOut<'a> {
    pub(super) vmi: &'a VirtualMachineInstance,
    pub(super) target_node: &'a str,
    pub(super) migration_uid: &'a str,
    /// The node-local disks mirrored (empty: shared storage only).
    pub(super) block: &'a [ferrovirt_api::migration::BlockVolume],
    /// When the disks' copy (or, without disks, the sending) started, for the Event.
    pub(super) copy_started: Instant,
    /// Already being cancelled, for this reason.
    pub(super) abort: Option<String>,
}

/// The VMI's current (source) node.
fn source_node(vmi: &VirtualMachineInstance) -> String {
    vmi.status
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default()
}

/// `f` bounded by [`SETUP_STEP`]; its error as text.
pub(super) async fn timeout<T, E: std::fmt::Display>(
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    timeout_for(SETUP_STEP, f).await
}

/// `f` bounded by `limit`; its error as text.
async fn timeout_for<T, E: std::fmt::Display>(
    limit: Duration,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {limit:?}")),
    }
}

/// Aborts its task when dropped.
pub(super) struct AbortOnDrop(pub(super) tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
