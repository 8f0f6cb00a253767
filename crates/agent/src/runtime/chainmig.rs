//! Carrying the node-local volumes' snapshot chains in a block migration, at run time
//! (docs/migration.md "Node-local disks with snapshots"; what is carried and the checks are
//! [`crate::chaincopy`]'s). Target, before its QEMU starts: a listening socket on the node
//! address reported on the VMI ([`mig::chain_ready_patch`]), the source node's authenticated
//! channel accepted on it (mutual TLS pinned to both nodes, as the stream's), the source's
//! [`Offer`] read, each frozen layer received and checked, `chain.json` and an empty top
//! written, [`Done`] answered. Source: seeing that port, it records the chains it sends
//! ([`crate::chaincopy::CARRYING_FILE`]: online snapshots and merges of the VMI are refused
//! from then on), and sends the offer and the layers' bytes. The mirrors then copy the tops
//! only, and before the switch-over the source checks the chains did not change.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use tokio::io::AsyncWriteExt;

use super::blockmig::BlockTarget;
use super::migration::{SETUP_STEP, timeout};
use super::{Agent, now_string};
use crate::chaincopy::{self as cc, Done, Offer};
use crate::error::AgentError;
use crate::migration as mig;
use crate::migstream as ms;

/// How long the layers' transfer may take in all.
const TRANSFER: Duration = Duration::from_secs(600);

impl Agent {
    /// Target: the snapshot chains of the node-local volumes `block` copies, received from the
    /// source agent into the fresh volume directories before the launcher starts.
    pub(super) async fn receive_chains(
        &self,
        vmi: &VirtualMachineInstance,
        block: &BlockTarget,
    ) -> Result<(), AgentError> {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        let source_name = vmi
            .status
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        let (source, pin) = self.node_identity(&source_name).await?;
        let tls = if mig::tls_disabled(&mig::configuration(vmi)) {
            None
        } else {
            let pin = pin.ok_or_else(|| {
                AgentError::Reference(
                    "the source node publishes no certificate: the snapshot chains cannot be \
                     carried encrypted (set disableTLS in the migration configuration to allow it)"
                        .into(),
                )
            })?;
            Some(crate::tls::migration_server_config(&self.cert, pin)?)
        };
        let ip: IpAddr = self
            .net
            .internal_ip()
            .unwrap_or_else(|| self.opts.address.clone())
            .parse()
            .map_err(|e| AgentError::Reference(format!("the node address: {e}")))?;
        let listener = mig::bind_in(self.net.node_netns(), ip)
            .await
            .map_err(|e| AgentError::Reference(format!("chain listener on {ip}: {e}")))?;
        let port = listener
            .local_addr()
            .map_err(|e| AgentError::Reference(e.to_string()))?
            .port();
        self.patch_status(vmi, mig::chain_ready_patch(ip, port))
            .await?;
        let waited = Instant::now();
        let mut ch =
            tokio::time::timeout(SETUP_STEP * 2, ms::accept_channel(&listener, source, tls))
                .await
                .map_err(|_| {
                    AgentError::Reference(format!(
                        "the source node sent no snapshot chains within {:?}",
                        SETUP_STEP * 2
                    ))
                })?
                .map_err(|e| AgentError::Reference(format!("the source's chain channel: {e}")))?;
        let t0 = Instant::now();
        let received = tokio::time::timeout(TRANSFER, receive_offer(&mut ch, block))
            .await
            .unwrap_or_else(|_| Err(format!("the layers did not arrive within {TRANSFER:?}")));
        let answer = Done {
            error: received.as_ref().err().cloned(),
        };
        let _ = timeout(ms::send(&mut ch, &answer)).await;
        let (layers, bytes) = received.map_err(AgentError::Reference)?;
        let ms_taken = t0.elapsed().as_millis();
        tracing::info!(uid = %uid,
            "block migration: {layers} snapshot layer(s), {bytes} bytes, received in {ms_taken} ms (channel after {} ms)",
            waited.elapsed().as_millis() - ms_taken);
        if layers > 0 {
            self.event(
                vmi,
                "Normal",
                "SnapshotChainsCarried",
                &format!(
                    "Received {layers} snapshot layer(s) ({bytes} bytes) from {source_name} in \
                     {ms_taken} ms, checked (size and SHA-256)"
                ),
            )
            .await;
        }
        Ok(())
    }

    /// Source: sends the VMI's volumes' snapshot chains to the target waiting at `at`. A
    /// failure fails the migration (the VM runs on here).
    pub(super) async fn send_chains(self: Arc<Self>, vmi: VirtualMachineInstance, at: SocketAddr) {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        if let Err(why) = self.send_chains_to(&vmi, at).await {
            tracing::warn!(uid = %uid, "carrying the snapshot chains: {why}");
            let _ = std::fs::remove_file(self.cfg.vmi_dir(&uid).join(cc::CARRYING_FILE));
            let reason = format!("carrying the snapshot chains to the target: {why}");
            self.event(&vmi, "Warning", "FailedMigration", &reason)
                .await;
            let _ = self
                .patch_status(&vmi, mig::failed_patch(&reason, &now_string()))
                .await;
        }
    }

    async fn send_chains_to(
        &self,
        vmi: &VirtualMachineInstance,
        at: SocketAddr,
    ) -> Result<(), String> {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        let vmi_dir = self.cfg.vmi_dir(&uid);
        let target_node = vmi
            .status
            .as_ref()
            .and_then(|s| s.migration_state.as_ref())
            .and_then(|m| m.target_node.clone())
            .unwrap_or_default();
        let root = crate::nodestore::volume_root(&self.opts.data_dir);
        let dirs = mig::read_volume_dirs(&vmi_dir);
        // From here on the VMI's snapshots and merges are refused (their layers would not be
        // on the target); what was sent is recorded for the check before the switch-over.
        cc::record_carried(&vmi_dir, &BTreeMap::new())?;
        let t0 = Instant::now();
        let offer = {
            let dirs = dirs.clone();
            let root = root.clone();
            tokio::task::spawn_blocking(move || {
                let mut offer = Offer::default();
                for (claim, name) in &dirs {
                    let dir = mig::volume_dir(&root, name)
                        .ok_or_else(|| format!("PVC {claim}: bad volume directory {name:?}"))?;
                    let m = cc::manifest_of(&dir).map_err(|e| format!("PVC {claim}: {e}"))?;
                    offer.volumes.push((claim.clone(), m));
                }
                Ok::<_, String>(offer)
            })
            .await
            .map_err(|e| e.to_string())?
        };
        let offer = match offer {
            Ok(o) => o,
            Err(e) => Offer {
                volumes: Vec::new(),
                error: Some(e),
            },
        };
        let digests_ms = t0.elapsed().as_millis();
        let sent: BTreeMap<String, String> = offer
            .volumes
            .iter()
            .filter_map(|(c, m)| m.as_ref().map(|m| (c.clone(), m.chain_json.clone())))
            .collect();
        cc::record_carried(&vmi_dir, &sent)?;
        let tls = self
            .channel_tls(&target_node, &mig::configuration(vmi))
            .await?;
        let (mut ch, _) = timeout(ms::connect_channel(self.net.node_netns(), at, tls))
            .await
            .map_err(|e| format!("the target agent at {at}: {e}"))?;
        timeout(ms::send(&mut ch, &offer)).await?;
        if let Some(e) = offer.error {
            return Err(e);
        }
        let mut bytes = 0u64;
        let total: u64 = offer
            .volumes
            .iter()
            .filter_map(|(_, m)| m.as_ref().map(cc::Manifest::total_bytes))
            .sum();
        for (claim, m) in &offer.volumes {
            let Some(m) = m else { continue };
            let dir = dirs
                .get(claim)
                .and_then(|n| mig::volume_dir(&root, n))
                .ok_or_else(|| format!("PVC {claim}: no volume directory"))?;
            for l in &m.layers {
                let path = dir.join(&l.file);
                let n = tokio::time::timeout(TRANSFER, cc::send_layer(&path, l, &mut ch))
                    .await
                    .map_err(|_| format!("sending layer {} took over {TRANSFER:?}", l.file))??;
                bytes += n;
            }
        }
        ch.flush().await.map_err(|e| e.to_string())?;
        let done: Done = tokio::time::timeout(TRANSFER, ms::recv(&mut ch))
            .await
            .map_err(|_| "the target did not confirm the layers".to_string())?
            .map_err(|e| format!("the target's answer: {e}"))?;
        if let Some(e) = done.error {
            return Err(format!("the target refused the layers: {e}"));
        }
        tracing::info!(uid = %uid,
            "block migration: snapshot chains of {} volume(s) sent ({} bytes of layers, {bytes} bytes of data) in {} ms (digests {digests_ms} ms)",
            sent.len(), total, t0.elapsed().as_millis());
        Ok(())
    }

    /// Source: whether to send `vmi`'s snapshot chains now ([`mig::chain_step`]); starts it.
    pub(super) fn reconcile_chains(self: &Arc<Self>, vmi: &VirtualMachineInstance) {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        let migration_uid = vmi
            .status
            .as_ref()
            .and_then(|s| s.migration_state.as_ref())
            .and_then(|m| m.migration_uid.clone())
            .unwrap_or_default();
        let at = {
            let mut sent = self.chains_sent.lock().unwrap_or_else(|p| p.into_inner());
            let at = mig::chain_step(
                vmi,
                &self.opts.node_name,
                sent.get(&uid).map(String::as_str),
            );
            if at.is_some() {
                sent.insert(uid.clone(), migration_uid);
            }
            at
        };
        // A migration that ended here without switching over releases the refusal of
        // snapshots (a successful one removes the VMI directory).
        let over = vmi
            .status
            .as_ref()
            .and_then(|s| s.migration_state.as_ref())
            .is_some_and(ferrovirt_api::migration::finished);
        if over {
            let _ = std::fs::remove_file(self.cfg.vmi_dir(&uid).join(cc::CARRYING_FILE));
        }
        if let Some(at) = at {
            tokio::spawn(self.clone().send_chains(vmi.clone(), at));
        }
    }
}

/// Target: reads the offer and every layer it announces from `ch` into the volume
/// directories of `block`; the layers and bytes received.
async fn receive_offer(ch: &mut ms::Channel, block: &BlockTarget) -> Result<(usize, u64), String> {
    let offer: Offer = timeout(ms::recv(ch)).await?;
    if let Some(e) = offer.error {
        return Err(format!("the source cannot send its snapshot chains: {e}"));
    }
    for claim in block.claim_paths.keys() {
        if !offer.volumes.iter().any(|(c, _)| c == claim) {
            return Err(format!("the source offered nothing for PVC {claim}"));
        }
    }
    let (mut layers, mut bytes) = (0usize, 0u64);
    for (claim, m) in &offer.volumes {
        let (Some(dir), Some(size)) = (block.claim_paths.get(claim), block.sizes.get(claim)) else {
            return Err(format!(
                "the source offered PVC {claim}, which is not copied here"
            ));
        };
        let Some(m) = m else { continue };
        cc::check_manifest(m).map_err(|e| format!("PVC {claim}: {e}"))?;
        for l in &m.layers {
            cc::receive_layer(dir, l, ch).await?;
            layers += 1;
            bytes += l.bytes;
        }
        let (dir, m, size) = (dir.clone(), m.clone(), *size);
        tokio::task::spawn_blocking(move || cc::finish_target(&dir, &m, size))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("PVC {claim}: {e}"))?;
    }
    Ok((layers, bytes))
}
