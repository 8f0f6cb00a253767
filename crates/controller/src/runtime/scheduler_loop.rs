//! The scheduler loop: keeps reflector caches of Nodes and VMIs, and on every change (and
//! periodically) places each unbound VMI with [`crate::scheduler::schedule`]. Binding writes
//! `status.nodeName`, phase `Scheduled`, condition PodScheduled=True and the
//! `kubevirt.io/nodeName` label in one patch guarded by resourceVersion; a VMI that fits nowhere gets phase Pending, condition
//! PodScheduled=False reason Unschedulable with Kubernetes' message, and a FailedScheduling
//! Event (only when the message changes). Bindings not yet seen in the cache are "assumed"
//! so a VMI is never bound twice and its resources count at once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde_json::json;
use tokio::sync::Notify;

use ferrovirt_api::kubevirt::vmi::{VirtualMachineInstance, VmiPhase, vmi_condition};

use super::events::{EventRecorder, object_ref};
use super::resources::Vmi;
use crate::conditions;
use crate::error::ControllerError;
use crate::scheduler::{Decision, ScheduleRequest, SchedulerOptions, needs_scheduling, schedule};
use crate::vm::template::{KUBEVIRT_API_VERSION, LABEL_NODE_NAME};

/// Component name on Events (Kubernetes' scheduler reports as `default-scheduler`).
pub const COMPONENT: &str = "default-scheduler";
/// How long a binding may stay unseen in the cache before it is forgotten.
const ASSUME_TTL: Duration = Duration::from_secs(30);

/// Tunables of the scheduler loop.
#[derive(Debug, Clone)]
pub struct SchedulerLoopOptions {
    pub scheduler: SchedulerOptions,
    /// Schedule pending VMIs at least this often even without changes.
    pub resync: Duration,
}

impl Default for SchedulerLoopOptions {
    fn default() -> Self {
        Self {
            scheduler: SchedulerOptions::default(),
            resync: Duration::from_secs(5),
        }
    }
}

fn key(vmi: &VirtualMachineInstance) -> String {
    format!(
        "{}/{}",
        vmi.metadata.namespace.as_deref().unwrap_or(""),
        vmi.metadata.name.as_deref().unwrap_or("")
    )
}

/// Run the scheduler loop until a watch fails for good or the future is dropped.
pub async fn run(client: kube::Client, opts: SchedulerLoopOptions) -> Result<(), ControllerError> {
    let wake = Arc::new(Notify::new());
    let (nodes, node_writer) = reflector::store::<Node>();
    let (vmis, vmi_writer) = reflector::store::<Vmi>();
    let node_stream = reflector(
        node_writer,
        watcher(Api::<Node>::all(client.clone()), watcher::Config::default()).default_backoff(),
    )
    .touched_objects()
    .map_ok(|_| ());
    let vmi_stream = reflector(
        vmi_writer,
        watcher(Api::<Vmi>::all(client.clone()), watcher::Config::default()).default_backoff(),
    )
    .touched_objects()
    .map_ok(|_| ());
    let w = wake.clone();
    let mut watches = Box::pin(futures::stream::select(node_stream, vmi_stream));
    let pump = async move {
        while let Some(item) = watches.next().await {
            if let Err(e) = item {
                tracing::warn!(error = %e, "scheduler watch error");
            }
            w.notify_one();
        }
    };
    let recorder = EventRecorder::new(client.clone(), COMPONENT);
    let work = async {
        let _ = nodes.wait_until_ready().await;
        let _ = vmis.wait_until_ready().await;
        let mut assumed: HashMap<String, (String, Instant)> = HashMap::new();
        loop {
            let node_list: Vec<Node> = nodes.state().iter().map(|n| (**n).clone()).collect();
            let mut all: Vec<VirtualMachineInstance> =
                vmis.state().iter().map(|v| v.0.clone()).collect();
            // Apply assumed bindings the cache has not caught up with; forget old ones.
            assumed.retain(|_, (_, at)| at.elapsed() < ASSUME_TTL);
            for v in &mut all {
                let k = key(v);
                if !needs_scheduling(v) {
                    assumed.remove(&k);
                } else if let Some((node, _)) = assumed.get(&k) {
                    let st = v.status.get_or_insert_default();
                    st.node_name = Some(node.clone());
                    st.phase = Some(VmiPhase::Scheduled);
                }
            }
            let mut pending: Vec<usize> = (0..all.len())
                .filter(|&i| needs_scheduling(&all[i]))
                .collect();
            pending.sort_by_key(|&i| (all[i].metadata.creation_timestamp.clone(), key(&all[i])));
            for i in pending {
                let (affinity, shared_mounts) = volume_constraints(&client, &all[i]).await;
                let decision = schedule(
                    &ScheduleRequest {
                        vmi: &all[i],
                        nodes: &node_list,
                        vmis: &all,
                        volume_affinity: &affinity,
                        shared_mounts: &shared_mounts,
                    },
                    &opts.scheduler,
                );
                match decision {
                    Decision::Bind { node } => match bind(&client, &all[i], &node).await {
                        Ok(()) => {
                            tracing::info!(vmi = %key(&all[i]), %node, "bound");
                            assumed.insert(key(&all[i]), (node.clone(), Instant::now()));
                            let st = all[i].status.get_or_insert_default();
                            st.node_name = Some(node.clone());
                            st.phase = Some(VmiPhase::Scheduled);
                            let reference = object_ref(
                                KUBEVIRT_API_VERSION,
                                "VirtualMachineInstance",
                                &all[i].metadata,
                            );
                            let msg = format!("Successfully assigned {} to {node}", key(&all[i]));
                            recorder.record(&reference, false, "Scheduled", &msg).await;
                        }
                        Err(e) => tracing::warn!(vmi = %key(&all[i]), error = %e, "binding failed"),
                    },
                    Decision::Unschedulable(fit) => {
                        let message = fit.to_string();
                        if let Err(e) =
                            mark_unschedulable(&client, &recorder, &all[i], &message).await
                        {
                            tracing::warn!(vmi = %key(&all[i]), error = %e, "recording unschedulable failed");
                        }
                    }
                }
            }
            let _ = tokio::time::timeout(opts.resync, wake.notified()).await;
        }
    };
    tokio::select! {
        _ = pump => Err(ControllerError::TaskStopped { name: "scheduler", reason: "watch streams ended".into() }),
        _ = work => Ok(()),
    }
}

/// The node affinity of the PVs the VMI's claims are bound to and the claims whose class
/// keeps volumes on a declared shared filesystem (looked up now; lookup errors add no
/// constraint and the agent reports a volume it cannot find).
async fn volume_constraints(
    client: &kube::Client,
    vmi: &VirtualMachineInstance,
) -> (
    Vec<k8s_openapi::api::core::v1::NodeSelector>,
    Vec<crate::scheduler::volumes::SharedMountNeed>,
) {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    use k8s_openapi::api::storage::v1::StorageClass;
    let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
    let claims_api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let pvs_api: Api<PersistentVolume> = Api::all(client.clone());
    let (mut claims, mut pvs) = (Vec::new(), Vec::new());
    for name in crate::storage::pvc_loop::claims_of(vmi) {
        let Ok(Some(claim)) = claims_api.get_opt(&name).await else {
            continue;
        };
        if let Some(v) = claim.spec.as_ref().and_then(|s| s.volume_name.clone())
            && let Ok(Some(pv)) = pvs_api.get_opt(&v).await
        {
            pvs.push(pv);
        }
        claims.push(claim);
    }
    // The classes named by the claims or their PVs, read by name; a claim naming none uses
    // the default class, which only a list finds.
    let class_api: Api<StorageClass> = Api::all(client.clone());
    let mut names: Vec<Option<String>> = claims
        .iter()
        .map(|c| {
            let pv_class = pvs
                .iter()
                .find(|pv| {
                    pv.metadata.name.is_some()
                        && pv.metadata.name == c.spec.as_ref().and_then(|s| s.volume_name.clone())
                })
                .and_then(|pv| pv.spec.as_ref()?.storage_class_name.clone());
            pv_class.or_else(|| c.spec.as_ref()?.storage_class_name.clone())
        })
        .collect();
    names.sort();
    names.dedup();
    let mut classes = Vec::new();
    if names.iter().any(Option::is_none) {
        classes = class_api
            .list(&Default::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default();
    } else {
        for name in names.into_iter().flatten() {
            if let Ok(Some(c)) = class_api.get_opt(&name).await {
                classes.push(c);
            }
        }
    }
    (
        crate::scheduler::volumes::required_selectors(&claims, &pvs),
        crate::scheduler::volumes::shared_mount_needs(&claims, &pvs, &classes),
    )
}

fn vmi_api(client: &kube::Client, vmi: &VirtualMachineInstance) -> Api<Vmi> {
    Api::namespaced(
        client.clone(),
        vmi.metadata.namespace.as_deref().unwrap_or("default"),
    )
}

fn conditions_with(
    vmi: &VirtualMachineInstance,
    new: ferrovirt_api::kubevirt::vmi::Condition,
) -> serde_json::Value {
    let mut conds = vmi
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    conditions::set(&mut conds, new, &Time(Timestamp::now()));
    serde_json::to_value(conds).unwrap_or_default()
}

/// Bind: one merge patch writing `status.nodeName`, phase Scheduled, PodScheduled=True and
/// the `kubevirt.io/nodeName` label (KubeVirt's VMI has no `/status` subresource: its status
/// is written on the object).
async fn bind(
    client: &kube::Client,
    vmi: &VirtualMachineInstance,
    node: &str,
) -> Result<(), kube::Error> {
    let name = vmi.metadata.name.as_deref().unwrap_or("");
    let conds = conditions_with(
        vmi,
        conditions::condition(vmi_condition::POD_SCHEDULED, true, None, None),
    );
    let patch = json!({
        "metadata": {
            "labels": {LABEL_NODE_NAME: node},
            "resourceVersion": vmi.metadata.resource_version,
        },
        "status": {"nodeName": node, "phase": "Scheduled", "conditions": conds}
    });
    vmi_api(client, vmi)
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// Record that no node fits, unless the VMI already says exactly that.
async fn mark_unschedulable(
    client: &kube::Client,
    recorder: &EventRecorder,
    vmi: &VirtualMachineInstance,
    message: &str,
) -> Result<(), kube::Error> {
    let current = conditions::find(
        vmi.status.as_ref().and_then(|s| s.conditions.as_deref()),
        vmi_condition::POD_SCHEDULED,
    );
    let phase = vmi.status.as_ref().and_then(|s| s.phase);
    if current.is_some_and(|c| c.status == "False" && c.message.as_deref() == Some(message))
        && phase == Some(VmiPhase::Pending)
    {
        return Ok(());
    }
    let conds = conditions_with(
        vmi,
        conditions::condition(
            vmi_condition::POD_SCHEDULED,
            false,
            Some("Unschedulable"),
            Some(message),
        ),
    );
    let status = json!({"status": {"phase": "Pending", "conditions": conds}});
    let name = vmi.metadata.name.as_deref().unwrap_or("");
    vmi_api(client, vmi)
        .patch(name, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    let reference = object_ref(
        KUBEVIRT_API_VERSION,
        "VirtualMachineInstance",
        &vmi.metadata,
    );
    recorder
        .record(&reference, true, "FailedScheduling", message)
        .await;
    Ok(())
}
