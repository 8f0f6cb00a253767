//! The node lifecycle loop: on changes of Nodes or node Leases (namespace `kube-node-lease`)
//! in the shared caches ([`super::stores`]; at most one pass a second, [`CHANGE_PASS_GAP`]),
//! and when a lease is due to expire, reads Nodes, Leases, PVC access modes and VMIs from those caches (no API list),
//! applies [`crate::node_lifecycle`]'s decisions (Ready condition, taints) and fails, marks
//! Unknown or evicts VMIs bound to unresponsive or NoExecute-tainted nodes, with Events. A
//! Node write refused as stale is not decided again until the cache shows a newer version.
//! A node is decided again only when its Node or Lease changed or its last decision's
//! requeue time (at most the resync) came ([`Decided`]): a pass on one node's renewal does not
//! decide the hundred others.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;

use ferrovirt_api::fencing::{FenceTiming, vmi_fencing};
use ferrovirt_api::kubevirt::vmi::{VirtualMachineInstance, vmi_condition};

use super::events::{EventRecorder, object_ref};
use super::resources::Vmi;
use super::stores::{Kind, Stores};
use crate::conditions;
use crate::error::ControllerError;
use crate::node_lifecycle::{
    NODE_LEASE_NAMESPACE, NodeLifecycleOptions, REASON_FENCED, REASON_NODE_UNRESPONSIVE,
    VmiNodeAction, decide_node, decide_vmi,
};
use crate::scheduler::is_bound;
use crate::vm::template::KUBEVIRT_API_VERSION;

/// Component name on Events.
pub const COMPONENT: &str = "node-lifecycle-controller";

/// Run the node lifecycle loop until the future is dropped. Errors of one pass are logged
/// and the pass is retried.
pub async fn run(
    client: kube::Client,
    opts: NodeLifecycleOptions,
    stores: Stores,
) -> Result<(), ControllerError> {
    let recorder = EventRecorder::new(client.clone(), COMPONENT);
    let mut changes = stores.changes();
    let configured = Arc::new(std::sync::Mutex::new(None));
    tokio::spawn(follow_node_failure(client.clone(), configured.clone()));
    stores.ready().await;
    let mut refused = Refused::new();
    let mut decided = Decided::default();
    let mut last_opts: Option<NodeLifecycleOptions> = None;
    loop {
        let opts = effective_options(&opts, *configured.lock().unwrap_or_else(|p| p.into_inner()));
        if last_opts.as_ref() != Some(&opts) {
            // Other timing: every node is decided again.
            decided = Decided::default();
            last_opts = Some(opts.clone());
        }
        let mut memo = Memo {
            refused: &mut refused,
            decided: &mut decided,
        };
        let started = tokio::time::Instant::now();
        let wait = match pass(&client, &stores, &recorder, &opts, &mut memo).await {
            Ok(wait) => wait,
            Err(e) => {
                tracing::warn!(error = %e, "node lifecycle pass failed");
                Duration::from_secs(2)
            }
        };
        // The next lease expiry, or sooner when a Node or Lease changes; one pass covers every
        // change already queued (the caches hold them all by now), and the changes of the
        // rest of CHANGE_PASS_GAP after it.
        if let Ok(Some(_)) =
            tokio::time::timeout(wait, changes.wait_for(&[Kind::Node, Kind::Lease])).await
        {
            tokio::time::sleep_until(started + change_pass_delay(wait)).await;
            changes.drain();
        }
    }
}

/// Passes woken by changes start at most this often. Every Lease renewal is a change (50 a
/// second with a hundred agents renewing every 2 s), and a pass per renewal was a tenth of the
/// idle server's CPU (at 33 renewals a second); one pass a second sees them all. Kubernetes' node lifecycle controller
/// looks every 5 s (`--node-monitor-period`); a renewal changes a decision only for a node
/// marked unresponsive, which becomes Ready again at most a second later.
const CHANGE_PASS_GAP: Duration = Duration::from_secs(1);

/// How long after a pass began the next one woken by a change starts (pure), `wait` being the
/// time the pass asked to be woken after (a lease due to expire): [`CHANGE_PASS_GAP`], or that
/// time when sooner.
fn change_pass_delay(wait: Duration) -> Duration {
    CHANGE_PASS_GAP.min(wait)
}

/// The options with the HyperConverged's node failure timing (when one sets it): its margin,
/// and its lease duration for nodes whose Lease does not say.
fn effective_options(
    opts: &NodeLifecycleOptions,
    configured: Option<FenceTiming>,
) -> NodeLifecycleOptions {
    let mut o = opts.clone();
    if let Some(t) = configured {
        o.fence_margin = Duration::from_secs(u64::from(t.fence_margin_seconds));
        o.default_lease_duration = Duration::from_secs(u64::from(t.lease_duration_seconds));
    }
    o
}

/// Follows the HyperConverged objects with a watch (no polling): `spec.nodeFailure` of the
/// first that sets it, or `None`.
async fn follow_node_failure(
    client: kube::Client,
    configured: Arc<std::sync::Mutex<Option<FenceTiming>>>,
) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, reflector, watcher};
    let ar = kube::api::ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk("hco.kubevirt.io", "v1beta1", "HyperConverged"),
        "hyperconvergeds",
    );
    let api: Api<kube::api::DynamicObject> = Api::all_with(client, &ar);
    let writer = reflector::store::Writer::<kube::api::DynamicObject>::new(ar);
    let store = writer.as_reader();
    let mut events = std::pin::pin!(
        reflector::reflector(writer, watcher(api, watcher::Config::default()))
            .default_backoff()
            .touched_objects()
    );
    while let Some(ev) = events.next().await {
        if let Err(e) = ev {
            tracing::debug!("watching hyperconvergeds: {e}");
            continue;
        }
        let hcos: Vec<serde_json::Value> = store
            .state()
            .iter()
            .map(|o| serde_json::to_value(&**o).unwrap_or_default())
            .collect();
        let set = hcos
            .iter()
            .any(|h| h.pointer("/spec/nodeFailure").is_some());
        let timing = set.then(|| ferrovirt_api::hco::node_failure_timing(&hcos));
        *configured.lock().unwrap_or_else(|p| p.into_inner()) = timing;
    }
}

/// Whether a write was refused because the cached object is stale (the change that made it
/// stale is on its way through the watch and runs the next pass).
fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// Nodes whose write was refused as stale, with the cached resourceVersion it was decided
/// on: node name → resourceVersion.
type Refused = HashMap<String, String>;

/// Whether a Node's writes are decided on this pass (pure): not while the cache still shows
/// the very version a write was already refused for (the cache lags; deciding on it again
/// only repeats the refused PATCH, on every Lease renewal of every node). A newer version is
/// decided on again.
fn may_write(refused: &Refused, name: &str, resource_version: Option<&str>) -> bool {
    refused.get(name).map(String::as_str) != resource_version
}

/// Each node's last decision: the Node's and its Lease's resourceVersions it was made on
/// and until when it holds (its requeue time, at most the resync). The decision is a pure
/// function of those objects, the options and the time, so it is made again only when one
/// of them moved.
#[derive(Debug, Default)]
struct Decided(HashMap<String, (Option<String>, Option<String>, Instant)>);

impl Decided {
    /// Pure: how long `name`'s decision on these versions still holds at `now` (`None`:
    /// decide it now).
    fn holds(
        &self,
        name: &str,
        node_rv: Option<&str>,
        lease_rv: Option<&str>,
        now: Instant,
    ) -> Option<Duration> {
        let (n, l, until) = self.0.get(name)?;
        (n.as_deref() == node_rv && l.as_deref() == lease_rv && now < *until)
            .then(|| until.duration_since(now))
    }

    /// Forgets the decisions of Nodes no longer in `nodes`, only when there are more
    /// decisions than Nodes (a Node was deleted): a pass runs on every renewal, and comparing
    /// every decision with every Node each time was a third of this loop's CPU. A decision
    /// left over for a while is only memory: a Node created again under the name has another
    /// resourceVersion, so it is decided anew.
    fn forget_gone(&mut self, nodes: &[Arc<Node>]) {
        if self.0.len() <= nodes.len() {
            return;
        }
        let names: std::collections::HashSet<&str> = nodes
            .iter()
            .filter_map(|n| n.metadata.name.as_deref())
            .collect();
        self.0.retain(|n, _| names.contains(n.as_str()));
    }

    fn record(
        &mut self,
        name: &str,
        node_rv: Option<&str>,
        lease_rv: Option<&str>,
        until: Instant,
    ) {
        self.0.insert(
            name.to_string(),
            (node_rv.map(String::from), lease_rv.map(String::from), until),
        );
    }
}

/// The loop's memory between passes.
struct Memo<'a> {
    refused: &'a mut Refused,
    decided: &'a mut Decided,
}

async fn pass(
    client: &kube::Client,
    stores: &Stores,
    recorder: &EventRecorder,
    opts: &NodeLifecycleOptions,
    memo: &mut Memo<'_>,
) -> Result<Duration, ControllerError> {
    let Memo { refused, decided } = memo;
    let nodes: Api<Node> = Api::all(client.clone());
    // Shared handles on the cached objects, not copies: a pass runs on every Lease renewal
    // (tens per second with a hundred nodes), and copying every Node and Lease each time was
    // most of the server's idle CPU.
    let node_list = stores.nodes.state();
    let lease_list = stores.leases.state();
    let mut leases_by_node: HashMap<&str, &Lease> = HashMap::with_capacity(lease_list.len());
    leases_by_node.extend(
        lease_list
            .iter()
            .filter(|l| l.metadata.namespace.as_deref() == Some(NODE_LEASE_NAMESPACE))
            .filter_map(|l| Some((l.metadata.name.as_deref()?, &**l))),
    );
    let now = Timestamp::now();
    let instant = Instant::now();
    let mut next = opts.resync;
    let mut vmis_cache: Option<Vec<VirtualMachineInstance>> = None;
    decided.forget_gone(&node_list);
    for node in &node_list {
        let Some(name) = node.metadata.name.as_deref() else {
            continue;
        };
        let lease = leases_by_node.get(name).copied();
        let versions = (
            node.metadata.resource_version.as_deref(),
            lease.and_then(|l| l.metadata.resource_version.as_deref()),
        );
        if let Some(left) = decided.holds(name, versions.0, versions.1, instant) {
            next = next.min(left);
            continue;
        }
        let name = name.to_string();
        let decision = decide_node(node, lease, now, opts);
        next = next.min(decision.requeue_after);
        let has_no_execute = node
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|t| t.iter().any(|t| t.effect == "NoExecute"));
        // A node whose VMIs are acted on is decided on every pass (VMIs may be bound to it
        // since); the written ones are decided again on the change their write makes.
        if !decision.fail_vmis
            && !has_no_execute
            && decision.ready_condition.is_none()
            && decision.taints.is_none()
        {
            let hold = decision.requeue_after.min(opts.resync);
            decided.record(&name, versions.0, versions.1, instant + hold);
        }
        let node_ref = object_ref("v1", "Node", &node.metadata);
        let mut resource_version = node.metadata.resource_version.clone();
        if !may_write(refused, &name, resource_version.as_deref()) {
            continue;
        }
        refused.remove(&name);
        let cached_version = resource_version.clone().unwrap_or_default();
        if let Some(cond) = &decision.ready_condition {
            let mut conds = node
                .status
                .as_ref()
                .and_then(|s| s.conditions.clone())
                .unwrap_or_default();
            conds.retain(|c| c.type_ != "Ready");
            conds.push(cond.clone());
            // Guarded by resourceVersion: the agent writes the same list.
            let patch = json!({
                "metadata": {"resourceVersion": resource_version},
                "status": {"conditions": conds}
            });
            let updated = match nodes
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(n) => n,
                Err(e) if is_conflict(&e) => {
                    refused.insert(name.clone(), cached_version.clone());
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            resource_version = updated.metadata.resource_version;
            let (reason, msg) = match cond.status.as_str() {
                "True" => ("NodeReady", format!("Node {name} status is now: NodeReady")),
                _ => (
                    "NodeNotReady",
                    format!("Node {name} status is now: NodeNotReady"),
                ),
            };
            recorder
                .record(&node_ref, cond.status != "True", reason, &msg)
                .await;
            if cond.status == "Unknown" {
                let tl = &decision.timeline;
                let msg = format!(
                    "Node {name} stopped renewing its lease (last renewal {}); its self-fencing \
                     VMs are stopped by {} and replaced from {}; VMs that cannot move stay",
                    tl.renewed, tl.fence_deadline, tl.replace_at
                );
                recorder
                    .record(&node_ref, true, REASON_NODE_UNRESPONSIVE, &msg)
                    .await;
            }
        }
        if let Some(taints) = &decision.taints {
            let patch = json!({
                "metadata": {"resourceVersion": resource_version},
                "spec": {"taints": taints}
            });
            match nodes
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {}
                Err(e) if is_conflict(&e) => {
                    refused.insert(name.clone(), cached_version.clone());
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
        if !decision.fail_vmis && !has_no_execute {
            continue;
        }
        if vmis_cache.is_none() {
            vmis_cache = Some(stores.vmis.state().iter().map(|v| v.0.clone()).collect());
        }
        for vmi in vmis_cache
            .iter()
            .flatten()
            .filter(|v| is_bound(v) == Some(name.as_str()))
        {
            let action = decide_vmi(vmi, node, &decision, vmi_fencing(vmi), now);
            if let VmiNodeAction::Fail { .. } = action {
                // A replacement is for good: decide again on the VMI as the API has it now
                // (the cache may not have seen the agent announce a launcher yet).
                let Some(fresh) = fresh_vmi(client, vmi).await? else {
                    continue;
                };
                let action = decide_vmi(&fresh, node, &decision, vmi_fencing(&fresh), now);
                apply_vmi_action(client, recorder, &fresh, &action).await?;
            } else {
                apply_vmi_action(client, recorder, vmi, &action).await?;
            }
        }
    }
    Ok(next)
}

/// The VMI as the API has it now (`None`: gone).
async fn fresh_vmi(
    client: &kube::Client,
    vmi: &VirtualMachineInstance,
) -> Result<Option<VirtualMachineInstance>, ControllerError> {
    let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
    let name = vmi.metadata.name.as_deref().unwrap_or("");
    let api: Api<Vmi> = Api::namespaced(client.clone(), ns);
    let fresh = api.get_opt(name).await?.map(|v| v.0);
    // Another VMI of that name (already replaced) is not the one decided about.
    Ok(fresh.filter(|f| f.metadata.uid == vmi.metadata.uid))
}

/// The finalizer node agents keep on the VMIs they run (see `ferrovirt_agent::decide`).
pub const AGENT_FINALIZER: &str = "ferrovirt.io/node-agent";

async fn apply_vmi_action(
    client: &kube::Client,
    recorder: &EventRecorder,
    vmi: &VirtualMachineInstance,
    action: &VmiNodeAction,
) -> Result<(), ControllerError> {
    let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
    let name = vmi.metadata.name.as_deref().unwrap_or("");
    let api: Api<Vmi> = Api::namespaced(client.clone(), ns);
    let reference = object_ref(
        KUBEVIRT_API_VERSION,
        "VirtualMachineInstance",
        &vmi.metadata,
    );
    let (phase, reason, message) = match action {
        VmiNodeAction::None => return Ok(()),
        VmiNodeAction::Evict { reason, message } => {
            match api.delete(name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.is_not_found() => {}
                Err(e) => return Err(e.into()),
            }
            recorder.record(&reference, true, reason, message).await;
            return Ok(());
        }
        VmiNodeAction::Fail {
            reason, message, ..
        } => ("Failed", reason, message),
        VmiNodeAction::MarkUnknown { reason, message } => ("Unknown", reason, message),
    };
    let mut conds = vmi
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    conditions::set(
        &mut conds,
        conditions::condition(vmi_condition::READY, false, Some(reason), Some(message)),
        &Time(Timestamp::now()),
    );
    // The uid is a precondition: never a write into a newer VMI of the same name.
    let mut patch = json!({
        "metadata": {"uid": vmi.metadata.uid},
        "status": {"phase": phase, "reason": reason, "conditions": conds}
    });
    if phase == "Failed" {
        // The dead node's agent can no longer release the VMI: its launcher fenced itself
        // (killed QEMU) at the lease's fence deadline, which the margin that led here lies
        // behind (or no launcher was ever started). Drop the agent's finalizer so the VM
        // controller can replace the VMI elsewhere.
        let finalizers: Vec<String> = vmi
            .metadata
            .finalizers
            .iter()
            .flatten()
            .filter(|f| f.as_str() != AGENT_FINALIZER)
            .cloned()
            .collect();
        if finalizers.len() != vmi.metadata.finalizers.as_ref().map_or(0, Vec::len) {
            patch["metadata"]["finalizers"] = json!(finalizers);
        }
    }
    match api
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.is_not_found() || s.code == 409 => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    if let VmiNodeAction::Fail {
        fenced: Some(fenced),
        ..
    } = action
    {
        recorder
            .record(&reference, true, REASON_FENCED, fenced)
            .await;
    }
    recorder.record(&reference, true, reason, message).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn passes_on_changes_are_a_second_apart_unless_a_lease_expires_sooner() {
        use std::time::Duration;
        assert_eq!(
            super::change_pass_delay(Duration::from_secs(60)),
            super::CHANGE_PASS_GAP
        );
        assert_eq!(
            super::change_pass_delay(Duration::from_millis(300)),
            Duration::from_millis(300)
        );
    }

    use super::*;

    #[test]
    fn hyperconverged_timing_overrides_the_options() {
        let base = NodeLifecycleOptions::default();
        let same = effective_options(&base, None);
        assert_eq!(same.fence_margin, base.fence_margin);
        let t = FenceTiming {
            lease_duration_seconds: 20,
            fence_margin_seconds: 6,
        };
        let o = effective_options(&base, Some(t));
        assert_eq!(o.fence_margin, Duration::from_secs(6));
        assert_eq!(o.default_lease_duration, Duration::from_secs(20));
        assert_eq!(o.resync, base.resync);
    }

    #[test]
    fn a_decision_holds_until_its_node_or_lease_moves_or_its_time_comes() {
        let t0 = Instant::now();
        let mut d = super::Decided::default();
        assert_eq!(
            d.holds("n1", Some("5"), Some("7"), t0),
            None,
            "never decided"
        );
        d.record("n1", Some("5"), Some("7"), t0 + Duration::from_secs(10));
        assert_eq!(
            d.holds("n1", Some("5"), Some("7"), t0 + Duration::from_secs(4)),
            Some(Duration::from_secs(6))
        );
        // Its Lease renewed, its Node written, or its requeue time come: decided again.
        assert_eq!(d.holds("n1", Some("5"), Some("8"), t0), None);
        assert_eq!(d.holds("n1", Some("6"), Some("7"), t0), None);
        assert_eq!(
            d.holds("n1", Some("5"), None, t0),
            None,
            "its Lease deleted"
        );
        assert_eq!(
            d.holds("n1", Some("5"), Some("7"), t0 + Duration::from_secs(10)),
            None
        );
        // Another node's decision is its own.
        assert_eq!(d.holds("n2", Some("5"), Some("7"), t0), None);
        // A deleted Node's decision is forgotten once decisions outnumber Nodes.
        let node = |name: &str| {
            let mut n = Node::default();
            n.metadata.name = Some(name.into());
            Arc::new(n)
        };
        d.record("n2", Some("1"), Some("1"), t0 + Duration::from_secs(10));
        d.forget_gone(&[node("n1"), node("n2")]);
        assert_eq!(d.0.len(), 2);
        d.forget_gone(&[node("n2")]);
        assert_eq!(d.0.keys().collect::<Vec<_>>(), ["n2"]);
    }

    #[test]
    fn a_refused_version_is_not_decided_on_again() {
        let mut refused = super::Refused::new();
        assert!(super::may_write(&refused, "n1", Some("10")));
        refused.insert("n1".into(), "10".into());
        // The cache still shows the version the write was refused for: no new PATCH.
        assert!(!super::may_write(&refused, "n1", Some("10")));
        // It moved on: decide again; other nodes are not affected.
        assert!(super::may_write(&refused, "n1", Some("11")));
        assert!(super::may_write(&refused, "n2", Some("10")));
    }
}
