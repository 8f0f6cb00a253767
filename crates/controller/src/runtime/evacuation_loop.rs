//! The evacuation loop: on every change of VMIs, Nodes or VirtualMachineInstanceMigrations (and
//! every two seconds, for backoffs) applies [`crate::evacuation::plan`] when a VMI is marked
//! for evacuation or a node has the drain taint (`kubevirt.io/drain`, or the KubeVirt CR's
//! `migrations.nodeDrainTaintKey`): marks and clears `status.evacuationNodeName` (guarded by
//! the VMI's resourceVersion) and creates the evacuation migrations, with Events on the VMI.
//! The drain key, the cluster's `evictionStrategy` and the migration limits come from the
//! shared stores' KubeVirt settings (a change of them wakes the loop). Every VMI is looked at
//! only while one is marked for evacuation (asked of [`super::vmi_index`]) or a Node has work;
//! otherwise a wake-up looks at the Nodes alone.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::sync::Notify;

use ferrovirt_api::eviction::EVACUATION_ANNOTATION;
use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_api::migration_policy as policy;

use super::events::{EventRecorder, object_ref};
use super::resources::{Vmi, Vmim};
use super::stores::{Kind, Stores};
use crate::error::ControllerError;
use crate::evacuation::{self, Action, Inputs, reasons};
use crate::runtime::watched::watched_store;
use crate::vm::template::KUBEVIRT_API_VERSION;

/// Component name on Events (KubeVirt's evacuation controller runs in virt-controller).
pub const COMPONENT: &str = "evacuation-controller";
const RESYNC: Duration = Duration::from_secs(2);

/// Runs the evacuation loop until its watch ends.
pub async fn run(client: kube::Client, stores: Stores) -> Result<(), ControllerError> {
    let wake = Arc::new(Notify::new());
    let w = wake.clone();
    let (vmims, pump) = watched_store(
        Api::<Vmim>::all(client.clone()),
        "evacuation: migration",
        move || w.notify_one(),
    );
    let w = wake.clone();
    let mut changes = stores.changes();
    let follow = async move {
        while changes
            .next_batch(&[Kind::Vmi, Kind::Node, Kind::KubeVirt])
            .await
            .is_some()
        {
            w.notify_one();
        }
    };
    let recorder = EventRecorder::new(client.clone(), COMPONENT);
    let work = async {
        let _ = vmims.wait_until_ready().await;
        stores.ready().await;
        loop {
            // Whether a VMI is marked for evacuation, from the index kept from the cache's
            // events (no pass over every VMI per VMI change).
            let vmis_marked = stores.vmi_index().any_evacuating();
            let node_state = stores.nodes.state();
            let kv = stores.kubevirt();
            let drain_key = kv.drain_key.as_str();
            if vmis_marked
                || evacuation::nodes_have_work(node_state.iter().map(|n| n.as_ref()), drain_key)
            {
                let state = stores.vmis.state();
                let nodes: Vec<_> = node_state.iter().map(|n| (**n).clone()).collect();
                let vmis: Vec<VirtualMachineInstance> = state.iter().map(|v| v.0.clone()).collect();
                let migrations: Vec<_> = vmims.state().iter().map(|m| m.0.clone()).collect();
                // The HyperConverged's `evictionStrategy` reaches the KubeVirt CR through its
                // reconcile.
                let limits = (
                    kv.migrations
                        .parallel_migrations_per_cluster
                        .unwrap_or(policy::DEFAULT_PARALLEL_PER_CLUSTER),
                    kv.migrations
                        .parallel_outbound_migrations_per_node
                        .unwrap_or(policy::DEFAULT_PARALLEL_OUTBOUND_PER_NODE),
                );
                let actions = evacuation::plan(&Inputs {
                    vmis: &vmis,
                    nodes: &nodes,
                    migrations: &migrations,
                    cluster_strategy: (kv.eviction_strategy.as_deref(), None),
                    per_cluster: limits.0,
                    per_node: limits.1,
                    now: Timestamp::now().as_second(),
                    drain_key,
                });
                for a in actions {
                    if let Err(e) = apply(&client, &recorder, &vmis, &a).await {
                        tracing::warn!(error = %e, action = ?a, "evacuation step failed");
                    }
                }
            }
            let _ = tokio::time::timeout(RESYNC, wake.notified()).await;
        }
    };
    tokio::select! {
        _ = pump => Err(ControllerError::TaskStopped { name: "evacuation", reason: "watch stream ended".into() }),
        _ = follow => Err(ControllerError::TaskStopped { name: "evacuation", reason: "caches ended".into() }),
        _ = work => Ok(()),
    }
}

async fn apply(
    client: &kube::Client,
    recorder: &EventRecorder,
    vmis: &[VirtualMachineInstance],
    a: &Action,
) -> Result<(), kube::Error> {
    let (ns, name) = match a {
        Action::Mark {
            namespace, name, ..
        }
        | Action::Clear {
            namespace, name, ..
        }
        | Action::Migrate {
            namespace, name, ..
        } => (namespace.as_str(), name.as_str()),
    };
    let Some(vmi) = vmis.iter().find(|v| {
        v.metadata.name.as_deref() == Some(name)
            && v.metadata.namespace.as_deref().unwrap_or("default") == ns
    }) else {
        return Ok(());
    };
    let reference = object_ref(
        KUBEVIRT_API_VERSION,
        "VirtualMachineInstance",
        &vmi.metadata,
    );
    let vmi_api: Api<Vmi> = Api::namespaced(client.clone(), ns);
    let set = |value: Value| {
        json!({
            "metadata": {"resourceVersion": vmi.metadata.resource_version},
            "status": {"evacuationNodeName": value},
        })
    };
    match a {
        Action::Mark { node, message, .. } => {
            vmi_api
                .patch(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(&set(json!(node))),
                )
                .await?;
            recorder
                .record(&reference, false, reasons::DRAIN_TAINT, message)
                .await;
        }
        Action::Clear { node, .. } => {
            vmi_api
                .patch(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(&set(Value::Null)),
                )
                .await?;
            let now = vmi.status.as_ref().and_then(|s| s.node_name.clone());
            let message = match now {
                Some(n) if n != *node => format!("The VMI left node {node}: it runs on node {n}"),
                _ => format!("The VMI ended; its evacuation from node {node} is over"),
            };
            recorder
                .record(&reference, false, reasons::EVACUATED, &message)
                .await;
        }
        Action::Migrate { node, .. } => {
            let body: Vmim = serde_json::from_value(json!({
                "apiVersion": KUBEVIRT_API_VERSION,
                "kind": "VirtualMachineInstanceMigration",
                "metadata": {
                    "generateName": "kubevirt-evacuation-",
                    "namespace": ns,
                    "annotations": {EVACUATION_ANNOTATION: node},
                    "labels": {"kubevirt.io/vmi-name": name},
                },
                "spec": {"vmiName": name},
            }))
            .map_err(kube::Error::SerdeError)?;
            let api: Api<Vmim> = Api::namespaced(client.clone(), ns);
            let created = api.create(&PostParams::default(), &body).await?;
            let message = format!(
                "Migration {} created to move the VMI off node {node}",
                created.metadata.name.as_deref().unwrap_or("?")
            );
            recorder
                .record(&reference, false, reasons::MIGRATION_CREATED, &message)
                .await;
        }
    }
    Ok(())
}
