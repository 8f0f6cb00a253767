//! Block migration at run time (docs/migration.md "Node-local disks"; the decisions are
//! [`crate::blockmig`]'s and [`ferrovirt_launcher::blockmig`]'s). Target: empty copies of the
//! node-local claims in its own volume root (the PV's size), its QEMU exporting every copied
//! disk over NBD, one relay per disk that accepts only the source node (mutual TLS), and —
//! once the guest runs here — the copies kept, the PVs moved to this node and the export
//! stopped. Source: one outgoing relay per disk, the mirrors started and followed until all
//! are in sync, and after the switch-over its own copies deleted once the PV names the
//! target's.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
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

/// The target's NBD server socket in the VMI directory.
pub const NBD_SOCKET: &str = "nbd-in.sock";
/// How long the mirrors may take to get in sync.
const MIRROR_SYNC: Duration = Duration::from_secs(600);

/// What the target prepared for a block migration.
#[derive(Debug, Default)]
pub(super) struct BlockTarget {
    /// The disks (QEMU ids) exported.
    pub disks: Vec<String>,
    /// Claims whose volume is the fresh copy here.
    pub claim_paths: BTreeMap<String, PathBuf>,
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
        // The source decided what can be copied; the target copies what is not shared.
        let method = ferrovirt_api::migration::live_migratable(
            vmi,
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
            out.claim_paths.insert(claim, dir);
        }
        Ok(out)
    }

    /// Target, QEMU up: exports the disks and starts one relay per disk (only `source`, with
    /// `tls`); returns the relays' ports.
    pub(super) async fn export_block_target(
        &self,
        uid: &str,
        block: &BlockTarget,
        ip: IpAddr,
        source: IpAddr,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> Result<Vec<u16>, AgentError> {
        if block.disks.is_empty() {
            return Ok(Vec::new());
        }
        let sock = self.cfg.vmi_dir(uid).join(NBD_SOCKET);
        let step = BlockOp::Export {
            socket: sock.clone(),
            disks: block.disks.clone(),
        };
        launchers::request(
            &self.cfg,
            uid,
            &Request::Block { step },
            Duration::from_secs(10),
        )
        .await?;
        let mut ports = Vec::new();
        for i in 0..block.disks.len() {
            let listener = mig::bind_in(self.net.node_netns(), ip)
                .await
                .map_err(|e| AgentError::Reference(format!("NBD relay on {ip}: {e}")))?;
            let port = listener
                .local_addr()
                .map_err(|e| AgentError::Reference(e.to_string()))?
                .port();
            let relay = tokio::spawn(mig::relay_incoming(
                listener,
                source,
                sock.clone(),
                tls.clone(),
            ));
            self.relays
                .lock()
                .await
                .insert(format!("{uid}#nbd{i}"), relay.abort_handle());
            ports.push(port);
        }
        Ok(ports)
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
        for k in (0..16).map(|i| format!("{uid}#nbd{i}")) {
            if let Some(r) = self.relays.lock().await.remove(&k) {
                r.abort();
            }
        }
    }

    /// Target: a migration that will not complete here leaves no partial copies.
    pub(super) async fn abandon_block_target(&self, uid: &str) {
        for k in (0..16).map(|i| format!("{uid}#nbd{i}")) {
            if let Some(r) = self.relays.lock().await.remove(&k) {
                r.abort();
            }
        }
        for d in bm::remove_target_volumes(&self.volume_root(), uid) {
            tracing::info!(uid, "removed the partial copy {}", d.display());
        }
    }

    /// Source: relays to the target's NBD ports, the mirrors started and followed until all
    /// are in sync. Returns the relays (dropping them stops them). `Err`: why (the mirrors
    /// are cancelled, the VM keeps its disks).
    pub(super) async fn mirror_out(
        &self,
        vmi: &VirtualMachineInstance,
        block: &[BlockVolume],
        target: IpAddr,
        tls: Option<Arc<rustls::ClientConfig>>,
    ) -> Result<Vec<super::migration::AbortOnDrop>, String> {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        let dir = self.cfg.vmi_dir(&uid);
        let state = vmi.status.as_ref().and_then(|s| s.migration_state.as_ref());
        let ports = state.map(mig::block_ports).unwrap_or_default();
        if ports.len() < block.len() {
            return Err(format!(
                "the target offers {} NBD relays for {} disks to copy",
                ports.len(),
                block.len()
            ));
        }
        let mut relays = Vec::new();
        let mut disks = Vec::new();
        for (i, (b, port)) in block.iter().zip(ports).enumerate() {
            let sock = dir.join(format!("nbd-out-{i}.sock"));
            let _ = std::fs::remove_file(&sock);
            let listener = tokio::net::UnixListener::bind(&sock)
                .map_err(|e| format!("NBD socket {}: {e}", sock.display()))?;
            let relay = tokio::spawn(mig::relay_outgoing(
                listener,
                SocketAddr::new(target, port),
                self.net.node_netns(),
                tls.clone(),
            ));
            relays.push(super::migration::AbortOnDrop(relay.abort_handle()));
            disks.push(MirrorDisk {
                disk: crate::mapping::disk_id(&b.volume),
                socket: sock,
            });
        }
        let ids: Vec<String> = disks.iter().map(|d| d.disk.clone()).collect();
        let step = BlockOp::Mirror { disks };
        launchers::request(
            &self.cfg,
            &uid,
            &Request::Block { step },
            Duration::from_secs(30),
        )
        .await
        .map_err(|e| format!("starting the disk mirrors: {e}"))?;
        let started = Instant::now();
        let mut last_check = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
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
        Ok(relays)
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
