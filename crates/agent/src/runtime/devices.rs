//! Host devices at run time ([`crate::hostdev`]): the counts of the permitted devices this
//! node has are written into its Node's `status.capacity` and `status.allocatable` (as
//! KubeVirt's device plugins have the kubelet do), again after every change of the KubeVirt
//! CR's `permittedHostDevices` ([`follow_permitted`]) and every rescan period, only when they
//! changed; a resource no longer permitted goes to 0. The resources advertised are kept in
//! `<data dir>/host-device-resources.json`, so a restarted agent still zeroes one dropped
//! while it was away. A starting VMI gets its devices here ([`Agent::assign_host_devices`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrovirt_api::kubevirt::host_devices::{self, PermittedHostDevices};
use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_launcher::hostdev::HostDevice;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};
use tokio::sync::watch;

use super::{Agent, kube_err};
use crate::error::AgentError;
use crate::hostdev::{self, Record};

/// The file listing the resources this agent advertised.
const ADVERTISED_FILE: &str = "host-device-resources.json";

/// Serialises assignments on this node (two starts never pick the same device).
static ASSIGN: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Called with the KubeVirt objects after each change of the agent's watch: sends the
/// permitted list they set (the HyperConverged's own CR first) when it changed; `Some` once
/// the watch has listed, so nothing is written before the configuration is known.
pub(super) fn follow_permitted(
    kubevirts: &[Value],
    tx: &watch::Sender<Option<Option<PermittedHostDevices>>>,
) {
    let mut ordered: Vec<&Value> = kubevirts.iter().collect();
    ferrovirt_api::hco::desired::order_kubevirts(&mut ordered);
    let now = Some(PermittedHostDevices::from_kubevirts(ordered));
    tx.send_if_modified(|cur| {
        let differs = *cur != now;
        if differs {
            *cur = now;
        }
        differs
    });
}

fn read_advertised(data_dir: &Path) -> BTreeSet<String> {
    std::fs::read(data_dir.join(ADVERTISED_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Keeps the Node's device counts: after each configuration change and every
/// `opts.host_devices.rescan`, written when they differ from the last write (a failed write
/// is tried again at the next round).
pub(super) async fn run(
    agent: Arc<Agent>,
    mut permitted: watch::Receiver<Option<Option<PermittedHostDevices>>>,
) {
    let opts = agent.opts.host_devices.clone();
    let mut before = read_advertised(&agent.opts.data_dir);
    let mut written: Option<BTreeMap<String, u64>> = None;
    loop {
        let now = permitted.borrow_and_update().clone();
        if let Some(list) = now {
            let list = list.unwrap_or_default();
            let sysfs = opts.sysfs.clone();
            let inv = tokio::task::spawn_blocking(move || hostdev::discover::scan(&sysfs, &list))
                .await
                .unwrap_or_default();
            let counts = hostdev::advertised(&inv, &before);
            if written.as_ref() != Some(&counts) {
                match patch(&agent, &counts).await {
                    Ok(()) => {
                        tracing::info!(?counts, "host device resources written");
                        before = inv.keys().cloned().collect();
                        let path = agent.opts.data_dir.join(ADVERTISED_FILE);
                        if let Ok(bytes) = serde_json::to_vec(&before)
                            && let Err(e) = crate::isolation::write_new_file(&path, &bytes)
                        {
                            tracing::warn!("writing {}: {e}", path.display());
                        }
                        written = Some(counts);
                    }
                    Err(e) => tracing::warn!("writing the host device resources: {e}"),
                }
            }
        }
        tokio::select! {
            r = permitted.changed() => if r.is_err() { return },
            _ = tokio::time::sleep(opts.rescan) => {}
        }
    }
}

async fn patch(agent: &Agent, counts: &BTreeMap<String, u64>) -> Result<(), AgentError> {
    if counts.is_empty() {
        return Ok(());
    }
    let q: BTreeMap<&String, String> = counts.iter().map(|(r, n)| (r, n.to_string())).collect();
    let nodes: Api<Node> = Api::all(agent.client.clone());
    nodes
        .patch_status(
            &agent.opts.node_name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"capacity": q, "allocatable": q}})),
        )
        .await
        .map_err(kube_err)?;
    Ok(())
}

impl Agent {
    /// The devices `vmi` gets on this node, recorded in its directory `dir` with their device
    /// nodes handed to the VM's QEMU uid (when the agent runs QEMU under per-VM uids). None
    /// asked: nothing. A device not permitted or none free: an error naming the field.
    pub(super) async fn assign_host_devices(
        &self,
        vmi: &VirtualMachineInstance,
        dir: &Path,
    ) -> Result<Vec<HostDevice>, AgentError> {
        let Some(spec) = vmi.spec.as_ref() else {
            return Ok(Vec::new());
        };
        let requests = host_devices::requested(spec);
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let (kubevirts, _) = self.caches.kubevirt_and_cdi().await;
        let mut ordered: Vec<&Value> = kubevirts.iter().collect();
        ferrovirt_api::hco::desired::order_kubevirts(&mut ordered);
        let permitted = PermittedHostDevices::from_kubevirts(ordered);
        if let Some(msg) = host_devices::not_permitted(spec, permitted.as_ref()).first() {
            let (field, message) = msg.split_once(": ").unwrap_or(("spec.domain.devices", msg));
            return Err(AgentError::unsupported(field, message));
        }
        let opts = self.opts.host_devices.clone();
        let node = self.opts.node_name.clone();
        let me = vmi.metadata.uid.clone().unwrap_or_default();
        let others: Vec<PathBuf> = self
            .cfg
            .local_uids()
            .into_iter()
            .filter(|u| *u != me)
            .map(|u| self.cfg.vmi_dir(&u))
            .collect();
        let dir = dir.to_path_buf();
        let qemu_uid = crate::isolation::recorded_uid(&dir)
            .filter(|_| crate::isolation::effective_uid() == Some(0));
        tokio::task::spawn_blocking(move || {
            let inv = hostdev::discover::scan(&opts.sysfs, &permitted.unwrap_or_default());
            let _one = ASSIGN.lock().unwrap_or_else(|p| p.into_inner());
            let assignments = hostdev::assign(&requests, &inv, &hostdev::held_by(others), &node)
                .map_err(|(field, message)| AgentError::unsupported(field, message))?;
            let devs: Vec<&hostdev::Dev> =
                assignments.iter().flat_map(|a| &a.unit.devices).collect();
            let grants = match qemu_uid {
                Some(uid) => {
                    let nodes: Vec<PathBuf> = devs.iter().map(|d| d.node(&opts.dev)).collect();
                    hostdev::grant(&nodes, uid).map_err(|e| AgentError::io(&opts.dev, e))?
                }
                None => Vec::new(),
            };
            let launch = devs.iter().map(|d| d.launch(&opts.sysfs)).collect();
            let rec = Record {
                assignments,
                grants,
            };
            if let Err(e) = hostdev::write_record(&dir, &rec) {
                hostdev::restore(&rec.grants);
                return Err(AgentError::io(&dir, e));
            }
            Ok(launch)
        })
        .await
        .map_err(|e| AgentError::Reference(format!("host device assignment task: {e}")))?
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_permitted_list_follows_the_hyperconvergeds_kubevirt() {
        let (tx, mut rx) = watch::channel(None);
        rx.borrow_and_update();
        // Listed, no CR sets a list: known now (Some), and it is "none set".
        follow_permitted(&[json!({"metadata": {"name": "x"}, "spec": {}})], &tx);
        assert!(rx.has_changed().unwrap());
        assert_eq!(*rx.borrow_and_update(), Some(None));
        let owned = json!({"metadata": {"name": "kubevirt-kubevirt-hyperconverged"},
            "spec": {"configuration": {"permittedHostDevices": {"pciHostDevices": [
                {"pciVendorSelector": "1AF4:1041", "resourceName": "example.org/net"}]}}}});
        let other = json!({"metadata": {"name": "a", "creationTimestamp": "2020-01-01T00:00:00Z"},
            "spec": {"configuration": {"permittedHostDevices": {}}}});
        follow_permitted(&[other.clone(), owned.clone()], &tx);
        let now = rx.borrow_and_update().clone().flatten().unwrap();
        assert_eq!(now.pci[0].selector, "1af4:1041");
        follow_permitted(&[owned, other], &tx);
        assert!(
            !rx.has_changed().unwrap(),
            "the same list is not sent again"
        );
    }
}
