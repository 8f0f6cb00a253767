//! The Node's CPU-model labels (KubeVirt's node-labeller, docs/hyperconverged.md "CPU models"):
//! the models this node's QEMU runs are probed once at start ([`probe`]); the labels
//! `cpu-model.node.kubevirt.io/<Model>` and `cpu-model-migration.node.kubevirt.io/<Model>` are
//! kept for every one the KubeVirt CR does not list in `obsoleteCPUModels` and removed for the
//! others, following the agent's KubeVirt watch ([`follow_obsolete`], [`run`]): a change of the
//! obsolete list takes effect without a restart.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrovirt_api::kubevirt::cpu_model;
use ferrovirt_launcher::spec::Accel;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};
use tokio::sync::watch;

use super::{Agent, kube_err};

/// The named models this node's QEMU runs under `accel`; none (logged) when QEMU cannot be
/// asked, so a VMI naming a model is never placed here.
pub(super) async fn probe(qemu: &Path, accel: Accel) -> BTreeSet<String> {
    let started = Instant::now();
    match crate::cpu_models::probe(qemu, accel).await {
        Ok(defs) => {
            let usable = crate::cpu_models::usable_models(&defs);
            tracing::info!(
                accel = %accel,
                took_ms = started.elapsed().as_millis() as u64,
                models = %usable.iter().cloned().collect::<Vec<_>>().join(","),
                "named CPU models this node's QEMU runs"
            );
            usable
        }
        Err(e) => {
            tracing::warn!("asking QEMU for its CPU models: {e}; no named model is offered");
            BTreeSet::new()
        }
    }
}

/// Called with the KubeVirt objects after each change of the agent's watch: sends the
/// obsolete models they set (the HyperConverged's own CR first) when they changed.
pub(super) fn follow_obsolete(kubevirts: &[Value], tx: &watch::Sender<BTreeSet<String>>) {
    let mut ordered: Vec<&Value> = kubevirts.iter().collect();
    ferrovirt_api::hco::desired::order_kubevirts(&mut ordered);
    let now = cpu_model::obsolete_models(ordered);
    tx.send_if_modified(|cur| {
        let differs = *cur != now;
        if differs {
            *cur = now;
        }
        differs
    });
}

/// Writes the CPU-model labels for the obsolete list now and after every change of it
/// (a failed write is tried again every 2 s).
pub(super) async fn run(agent: Arc<Agent>, mut obsolete: watch::Receiver<BTreeSet<String>>) {
    loop {
        let now = obsolete.borrow_and_update().clone();
        let labels = cpu_model::node_labels(&agent.cpu_models, &now);
        match patch(&agent, &labels).await {
            Ok(()) => {
                tracing::info!(obsolete = ?now, "CPU-model labels written");
                if obsolete.changed().await.is_err() {
                    return;
                }
            }
            Err(e) => {
                tracing::warn!("writing the CPU-model labels: {e}");
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    }
}

async fn patch(
    agent: &Agent,
    labels: &std::collections::BTreeMap<String, Option<String>>,
) -> Result<(), crate::AgentError> {
    if labels.is_empty() {
        return Ok(());
    }
    let nodes: Api<Node> = Api::all(agent.client.clone());
    nodes
        .patch(
            &agent.opts.node_name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"labels": labels}})),
        )
        .await
        .map_err(kube_err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_obsolete_list_follows_the_hyperconvergeds_kubevirt() {
        let (tx, mut rx) = watch::channel(cpu_model::obsolete_models([]));
        rx.borrow_and_update();
        // No CR sets a list: KubeVirt's default, no change.
        follow_obsolete(&[json!({"metadata": {"name": "x"}, "spec": {}})], &tx);
        assert!(!rx.has_changed().unwrap());
        let owned = json!({"metadata": {"name": "kubevirt-kubevirt-hyperconverged"},
            "spec": {"configuration": {"obsoleteCPUModels": {"Nehalem": true}}}});
        let other = json!({"metadata": {"name": "a", "creationTimestamp": "2020-01-01T00:00:00Z"},
            "spec": {"configuration": {"obsoleteCPUModels": {"Penryn": true}}}});
        follow_obsolete(&[other.clone(), owned.clone()], &tx);
        assert!(rx.has_changed().unwrap());
        assert_eq!(
            rx.borrow_and_update().iter().collect::<Vec<_>>(),
            ["Nehalem"]
        );
        follow_obsolete(&[owned, other], &tx);
        assert!(
            !rx.has_changed().unwrap(),
            "the same list is not sent again"
        );
    }
}
