//! Block migration at run time (docs/migration.md "Node-local disks"; the decisions are
//! [`crate::blockmig`]'s and [`ferrovirt_launcher::blockmig`]'s). Target: empty copies of the
//! node-local claims in its own volume root (the PV's size), one listening socket on the node
//! address that only the source node can reach ([`crate::nbdpeer`]), handed to its QEMU's NBD
//! server with QEMU's TLS once the source's ephemeral certificate is known, and — once the
//! guest runs here — the copies kept, the PVs moved to this node and the export stopped.
//! Source: one connection per disk to that socket, handed to its QEMU's NBD clients, the
//! mirrors started and followed until all are in sync, and after the switch-over its own
//! copies deleted once the PV names the target's. The agents never copy the disks' bytes.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_api::migration::{BlockVolume, Method};
use ferrovirt_launcher::control::{BlockOp, MirrorDisk, Request, RunPhase};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use super::{Agent, kube_err, ns_name};
use crate::blockmig as bm;
use crate::error::AgentError;
use crate::launchers;
use crate::migration as mig;

/// The unix socket in the VMI directory on which the target agent hands its NBD listening
/// socket to the launcher.
pub const NBD_SOCKET: &str = "nbd-in.sock";
/// How long the mirrors may take to get in sync.
pub(super) const MIRROR_SYNC: Duration = Duration::from_secs(600);

/// What the target prepared for a block migration.
#[derive(Debug, Default)]
pub(super) struct BlockTarget {
    /// The disks (QEMU ids) exported.
    pub disks: Vec<String>,
    /// Claims whose volume is the fresh copy here.
    pub claim_paths: BTreeMap<String, PathBuf>,
    /// Each copied claim's volume size (its PV's capacity).
    pub sizes: BTreeMap<String, u64>,
}

/// The target's NBD socket until the source's certificate is known.
#[derive(Debug)]
pub(super) struct NbdListener {
    pub listener: OwnedFd,
    pub disks: Vec<String>,
}

impl Agent {
    fn volume_root(&self) -> PathBuf {
        crate::nodestore::volume_root(&self.opts.data_dir)
    }

    /// Target: the volumes a block migration of `vmi` copies, and an empty copy of each
    /// node-local claim's volume (the PV's capacity) in this node's volume root.
    pub(super) async fn prepare_block_target(
        &self,
        vmi: &VirtualMachineInstance,
    ) -> Result<BlockTarget, AgentError> {
        let (ns, _) = ns_name(vmi);
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), &ns);
        let pvs: Api<PersistentVolume> = Api::all(self.client.clone());
        let mut claims: BTreeMap<String, (Vec<String>, Option<String>)> = BTreeMap::new();
        for v in vmi.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
            let claim = v
                .persistent_volume_claim
                .as_ref()
                .map(|c| c.claim_name.clone())
                .or_else(|| v.data_volume.as_ref().map(|d| d.name.clone()))
                .or_else(|| {
                    // An ephemeral overlay's base claim (it must be shared to be opened here).
                    v.ephemeral
                        .as_ref()
                        .and_then(|e| e.persistent_volume_claim.as_ref())
                        .map(|c| c.claim_name.clone())
                });
            if let Some(c) = claim
                && let Some(pvc) = pvcs.get_opt(&c).await.map_err(kube_err)?
            {
                let spec = pvc.spec.unwrap_or_default();
                claims.insert(c, (spec.access_modes.unwrap_or_default(), spec.volume_name));
            }
        }
        // The source decided what can be copied (and that the VMI may move at all: a pod
        // bridge interface only on a Primary UDN, judged through `udn::migratable_view` there
        // too); the target copies what is not shared.
        let method = ferrovirt_api::migration::live_migratable(
            &crate::udn::migratable_view(vmi),
            |c| claims.get(c).map(|m| m.0.clone()),
            |_| Ok(()),
        )
        .map_err(|e| AgentError::Reference(e.to_string()))?;
        let Method::Block(vols) = method else {
            return Ok(BlockTarget::default());
        };
        let mut out = BlockTarget::default();
        for BlockVolume { volume, claim } in vols {
            out.disks.push(crate::mapping::disk_id(&volume));
            let Some(claim) = claim else { continue };
            let pv_name = claims
                .get(&claim)
                .and_then(|c| c.1.clone())
                .ok_or_else(|| AgentError::Reference(format!("claim {claim} is not bound")))?;
            let pv = pvs.get(&pv_name).await.map_err(kube_err)?;
            let cap = pv
                .spec
                .as_ref()
                .and_then(|s| s.capacity.as_ref())
                .and_then(|c| c.get("storage"))
                .ok_or_else(|| AgentError::Reference(format!("PV {pv_name} has no capacity")))?;
            let bytes = crate::volumes::quantity_bytes("capacity", &cap.0)?;
            let dir = bm::create_target_volume(&self.volume_root(), &pv_name, bytes, &uid)
                .map_err(AgentError::Reference)?;
            out.sizes.insert(claim.clone(), bytes);
            out.claim_paths.insert(claim, dir);
        }
        Ok(out)
    }

    /// Target, QEMU up: the NBD listening socket on `ip` that only `source` can reach, and
    /// its port (`None` without disks to copy). QEMU gets it from [`Agent::export_disks`].
    pub(super) async fn nbd_listener(
        &self,
        block: &BlockTarget,
        ip: IpAddr,
        source: IpAddr,
    ) -> Result<Option<(NbdListener, u16)>, AgentError> {
        if block.disks.is_empty() {
            return Ok(None);
        }
        let l = mig::in_netns(self.net.node_netns(), move || {
            crate::nbdpeer::listen_for(ip, source)
        })
        .await
        .map_err(|e| AgentError::Reference(format!("NBD socket on {ip}: {e}")))?;
        let port = l
            .local_addr()
            .map_err(|e| AgentError::Reference(e.to_string()))?
            .port();
        let listener = NbdListener {
            listener: OwnedFd::from(l),
            disks: block.disks.clone(),
        };
        Ok(Some((listener, port)))
    }

    /// Target, the source's certificate known (`None`: `disableTLS`): the NBD listening
    /// socket handed to QEMU, which serves the disks on it.
    pub(super) async fn export_disks(
        &self,
        uid: &str,
        nbd: NbdListener,
        peer_cert: Option<String>,
    ) -> Result<(), String> {
        let sock = self.cfg.vmi_dir(uid).join(NBD_SOCKET);
        let _hand_over = super::migration::AbortOnDrop(
            crate::migstream::hand_over(&sock, nbd.listener)
                .map_err(|e| format!("{}: {e}", sock.display()))?
                .abort_handle(),
        );
        let step = BlockOp::Export {
            fd_socket: sock,
            disks: nbd.disks,
            peer_cert,
        };
        launchers::request(
            &self.cfg,
            uid,
            &Request::Block { step },
            Duration::from_secs(30),
        )
        .await
        .map_err(|e| format!("the target's NBD server: {e}"))?;
        Ok(())
    }

    /// Target: [`Agent::finish_block_target`] once per VMI (the original path, and a restarted
    /// agent that finds copies still marked, [`crate::migresume::target_finish_pending`]).
    pub(super) async fn spawn_finish_block_target(self: &Arc<Self>, vmi: &VirtualMachineInstance) {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        if !self.finishing.lock().await.insert(uid.clone()) {
            return;
        }
        let me = self.clone();
        let vmi = vmi.clone();
        tokio::spawn(async move {
            me.clone().finish_block_target(vmi).await;
            me.finishing.lock().await.remove(&uid);
        });
    }

    /// Target: a block migration whose copies this agent must still take over (it restarted
    /// while receiving, or before the guest ran here): the same task as the original path.
    pub(super) async fn resume_block_target(
        self: &Arc<Self>,
        vmi: &VirtualMachineInstance,
        launcher: bool,
        preparing: bool,
    ) {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        let busy = preparing || self.finishing.lock().await.contains(&uid);
        if busy || !launcher {
            return;
        }
        let marked = !bm::marked_for(&self.volume_root(), &uid).is_empty();
        if crate::migresume::target_finish_pending(
            vmi,
            &self.opts.node_name,
            launcher,
            marked,
            busy,
        ) {
            tracing::info!(uid = %uid, "taking over the block migration's copies");
            self.event(
                vmi,
                "Normal",
                "MigrationResumed",
                &format!(
                    "{} takes over the copied disks once the guest runs here",
                    self.opts.node_name
                ),
            )
            .await;
            self.spawn_finish_block_target(vmi).await;
        }
    }

    /// Target: once the guest runs here (the migration completed), the copies are the VM's
    /// disks: unmarked, their PVs moved to this node, the NBD export stopped. Gives up when
    /// the launcher goes away first (the migration failed; abandoning removes the copies).
    pub(super) async fn finish_block_target(self: Arc<Self>, vmi: VirtualMachineInstance) {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            match launchers::observe(&self.cfg, &uid).await {
                crate::decide::Observed::Running(s) if s.phase == RunPhase::Running => break,
                crate::decide::Observed::Running(_) => continue,
                _ => return,
            }
        }
        let kept = bm::keep_target_volumes(&self.volume_root(), &uid);
        let pvs: Api<PersistentVolume> = Api::all(self.client.clone());
        for dir in kept {
            let Some(pv) = bm::pv_of(&dir) else { continue };
            let patch = bm::pv_move_patch(&dir, &self.opts.node_name);
            if let Err(e) = pvs
                .patch(&pv, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                tracing::error!(uid = %uid, "moving PV {pv} to this node: {e}");
            } else {
                tracing::info!(uid = %uid, "PV {pv} now on {}", self.opts.node_name);
            }
        }
        let _ = launchers::request(
            &self.cfg,
            &uid,
            &Request::Block {
                step: BlockOp::StopExport,
            },
            Duration::from_secs(10),
        )
        .await;
    }

    /// Target: a migration that will not complete here leaves no partial copies.
    pub(super) async fn abandon_block_target(&self, uid: &str) {
        for d in bm::remove_target_volumes(&self.volume_root(), uid) {
            tracing::info!(uid, "removed the partial copy {}", d.display());
        }
    }

    /// Source: one connection per disk to the target's NBD socket, handed to QEMU's NBD
    /// clients (with `peer_cert`, the target's ephemeral certificate: QEMU's TLS), the
    /// mirrors started and followed until all are in sync. `Err`: why (the mirrors are
    /// cancelled, the VM keeps its disks).
    pub(super) async fn mirror_out(
        &self,
        vmi: &VirtualMachineInstance,
        block: &[BlockVolume],
        target: IpAddr,
        peer_cert: Option<String>,
    ) -> Result<(), String> {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        let dir = self.cfg.vmi_dir(&uid);
        let state = vmi.status.as_ref().and_then(|s| s.migration_state.as_ref());
        let Some(port) = state.and_then(|s| mig::block_ports(s).first().copied()) else {
            return Err("the target offers no NBD port for the disks to copy".into());
        };
        let at = SocketAddr::new(target, port);
        let t0 = Instant::now();
        // Volumes whose frozen layers were carried ([`crate::chaincopy`]): the top only.
        let volume_dirs = self.carried_volume_dirs(&dir);
        let chained: BTreeMap<String, bool> = volume_dirs
            .iter()
            .map(|(c, d)| {
                let top = ferrovirt_storage::snapshot::read_chain(d)
                    .is_ok_and(|ch| crate::chaincopy::mirror_top_only(&ch));
                (c.clone(), top)
            })
            .collect();
        let mut hand_overs = Vec::new();
        let mut disks = Vec::new();
        for (i, b) in block.iter().enumerate() {
            let conn = mig::connect_in(self.net.node_netns(), at)
                .await
                .map_err(|e| format!("the target's NBD socket {at}: {e}"))?;
            let _ = conn.set_nodelay(true);
            let conn = crate::migstream::into_fd(conn).map_err(|e| e.to_string())?;
            let sock = dir.join(format!("nbd-out-{i}.sock"));
            let task = crate::migstream::hand_over(&sock, conn)
                .map_err(|e| format!("{}: {e}", sock.display()))?;
            hand_overs.push(super::migration::AbortOnDrop(task.abort_handle()));
            disks.push(MirrorDisk {
                disk: crate::mapping::disk_id(&b.volume),
                socket: sock,
                top_only: b
                    .claim
                    .as_ref()
                    .and_then(|c| chained.get(c))
                    .copied()
                    .unwrap_or(false),
            });
        }
        let ids: Vec<String> = disks.iter().map(|d| d.disk.clone()).collect();
        let step = BlockOp::Mirror { disks, peer_cert };
        let connected = t0.elapsed().as_millis();
        let v = launchers::request(
            &self.cfg,
            &uid,
            &Request::Block { step },
            Duration::from_secs(30),
        )
        .await
        .map_err(|e| format!("starting the disk mirrors: {e}"))?;
        drop(hand_overs);
        tracing::info!(uid = %uid, "block migration: mirrors started in {} ms (connected after {connected} ms; launcher steps, ms: {})",
            t0.elapsed().as_millis(), v["steps"]);
        let started = Instant::now();
        let mut last_check = Instant::now();
        // Looked at again when QEMU reports a job event (BLOCK_JOB_READY), at least every
        // 500 ms (the cancel check).
        let mut events = launchers::JobEvents::new(Duration::from_millis(50));
        loop {
            events
                .next(&self.cfg, &uid, Duration::from_millis(500))
                .await;
            let jobs = launchers::request(
                &self.cfg,
                &uid,
                &Request::Block {
                    step: BlockOp::Jobs,
                },
                Duration::from_secs(10),
            )
            .await
            .map_err(|e| format!("following the disk mirrors: {e}"))?;
            match ferrovirt_launcher::blockmig::all_ready(&jobs, &ids) {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => return Err(e),
            }
            if started.elapsed() > MIRROR_SYNC {
                return Err(format!(
                    "the disk mirrors were not in sync within {MIRROR_SYNC:?}"
                ));
            }
            if last_check.elapsed() >= Duration::from_millis(500) {
                last_check = Instant::now();
                if self.abort_requested(vmi).await {
                    return Err("the migration was cancelled".into());
                }
            }
        }
        tracing::info!(uid = %uid, "disk mirrors in sync after {:?}", started.elapsed());
        // A chain that changed since it was sent (a snapshot or merge that raced the refusal)
        // would leave a layer behind: the migration stops here, the VM keeps its disks.
        crate::chaincopy::check_unchanged(&dir, &volume_dirs)?;
        Ok(())
    }

    /// The node-local claims of the VMI in `vmi_dir` a block migration copies, and their
    /// volume directories here.
    pub(super) fn carried_volume_dirs(&self, vmi_dir: &Path) -> BTreeMap<String, PathBuf> {
        let root = self.volume_root();
        mig::read_volume_dirs(vmi_dir)
            .into_iter()
            .filter_map(|(c, n)| mig::volume_dir(&root, &n).map(|d| (c, d)))
            .collect()
    }

    /// Source, after a failed block migration: the mirrors stop, the VM keeps its disks.
    pub(super) async fn cancel_mirrors(&self, uid: &str) {
        let _ = launchers::request(
            &self.cfg,
            uid,
            &Request::Block {
                step: BlockOp::Cancel,
            },
            Duration::from_secs(30),
        )
        .await;
    }

    /// Source, after the switch-over: each copied claim's own volume is deleted once its PV
    /// names the target's copy (never before: a PV must always name a volume).
    pub(super) async fn release_source_copies(&self, vmi: &VirtualMachineInstance) {
        let (ns, _) = ns_name(vmi);
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        let block = mig::read_block_volumes(&self.cfg.vmi_dir(&uid));
        let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), &ns);
        let pvs: Api<PersistentVolume> = Api::all(self.client.clone());
        for claim in block.iter().filter_map(|b| b.claim.as_ref()) {
            let Ok(Some(pvc)) = pvcs.get_opt(claim).await else {
                continue;
            };
            let Some(pv) = pvc.spec.and_then(|s| s.volume_name) else {
                continue;
            };
            let own = self.volume_root().join(&pv);
            let deadline = Instant::now() + Duration::from_secs(60);
            let released = loop {
                let path = pvs
                    .get_opt(&pv)
                    .await
                    .ok()
                    .flatten()
                    .and_then(|p| p.spec)
                    .and_then(|s| s.local)
                    .map(|l| l.path);
                if bm::source_copy_released(path.as_deref(), &own) {
                    break true;
                }
                if Instant::now() > deadline {
                    break false;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            };
            if released {
                remove_volume(&own);
                tracing::info!(uid = %uid, "deleted the source copy {}", own.display());
            } else {
                tracing::error!(
                    uid = %uid,
                    "PV {pv} still names {} a minute after the switch-over: the source copy is kept",
                    own.display()
                );
            }
        }
    }
}

fn remove_volume(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        tracing::warn!("removing {}: {e}", dir.display());
    }
}

/// The patch writing `status.migrationMethod` with the migration's start.
pub(super) fn method_patch(block: bool) -> serde_json::Value {
    json!(if block {
        ferrovirt_api::migration::METHOD_BLOCK
    } else {
        ferrovirt_api::migration::METHOD_LIVE
    })
}
