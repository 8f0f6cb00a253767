//! Node lifecycle decisions, pure: from a Node, its coordination.k8s.io Lease and the time,
//! the node's health (Ready / NotReady / Unknown), the Ready condition and taints to write,
//! and what happens to the VMIs bound to it.
//!
//! Timeline (docs/fencing.md; defaults from [`ferrovirt_api::fencing`]): an agent renews its
//! Lease every quarter of its `leaseDurationSeconds` (16: every 4 s). At `renewTime +
//! leaseDuration` (the fence deadline) the node turns Unknown and is tainted unreachable, and
//! every self-fencing launcher on it has killed its QEMU (they check the agent's heartbeat,
//! which carries the same `renewTime`). At the deadline plus the fence margin (4 s: clock skew between nodes,
//! the launchers' check interval, the kill) the VMIs whose agent announced a self-fencing
//! launcher (`ferrovirt.io/fencing: enabled`), and those no launcher was started for, are
//! marked Failed with reason `NodeUnresponsive`, so their VMs are recreated elsewhere: ≤ 22 s
//! from the last renewal to a new VMI. VMIs that cannot move (node-local disks, hostDisk,
//! runStrategy Manual, …: `fencing: disabled`) are never replaced: they turn `Unknown` and
//! wait for their node.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, NodeCondition, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use ferrovirt_api::fencing::{self, VmiFencing};
use ferrovirt_api::kubevirt::vmi::{VirtualMachineInstance, VmiPhase};

use crate::scheduler::taints::{NO_EXECUTE, NO_SCHEDULE, find_toleration, node_taints};
use crate::scheduler::{TAINT_NOT_READY, TAINT_UNREACHABLE, TAINT_UNSCHEDULABLE};

/// Namespace holding the node heartbeat Leases (one per node, named like it).
pub const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";
/// VMI `status.reason` when its node stopped responding.
pub const REASON_NODE_UNRESPONSIVE: &str = "NodeUnresponsive";
/// Event reason on a VMI of a failed node whose launcher fenced (killed) its QEMU.
pub const REASON_FENCED: &str = "Fenced";
/// Event reason when a VMI is deleted for an untolerated NoExecute taint.
pub const REASON_TAINT_EVICTION: &str = "TaintManagerEviction";

/// Tunables of the node lifecycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeLifecycleOptions {
    /// Lease duration assumed when a Lease does not say (and for nodes without a Lease).
    pub default_lease_duration: Duration,
    /// How long after the fence deadline (`renewTime + leaseDuration`) a failed node's
    /// self-fenced VMIs are failed and replaced: covers clock skew between the node and the
    /// controller, the launchers' check interval and the kill.
    pub fence_margin: Duration,
    /// How often to look at a node when nothing is about to expire.
    pub resync: Duration,
}

impl Default for NodeLifecycleOptions {
    fn default() -> Self {
        Self {
            default_lease_duration: Duration::from_secs(u64::from(
                fencing::DEFAULT_LEASE_DURATION_SECONDS,
            )),
            fence_margin: Duration::from_secs(u64::from(fencing::DEFAULT_FENCE_MARGIN_SECONDS)),
            resync: Duration::from_secs(10),
        }
    }
}

/// The node's health as the controllers see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeHealth {
    Ready,
    NotReady,
    Unknown,
}

/// What to do about a node.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeDecision {
    pub health: NodeHealth,
    /// A Ready condition to write (replacing the current one), if it must change.
    pub ready_condition: Option<NodeCondition>,
    /// The full `spec.taints` to write, if they must change.
    pub taints: Option<Vec<Taint>>,
    /// The node's failure timeline (meaningful once it is Unknown).
    pub timeline: Timeline,
    /// The node has been unresponsive past its fence deadline plus the margin: fail (or mark
    /// Unknown) its VMIs.
    pub fail_vmis: bool,
    /// When to look at this node again.
    pub requeue_after: Duration,
}

fn to_signed(d: Duration) -> SignedDuration {
    SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX)
}

fn until(from: Timestamp, to: Timestamp) -> Duration {
    if to > from {
        Duration::try_from(to.duration_since(from)).unwrap_or(Duration::ZERO)
    } else {
        Duration::ZERO
    }
}

fn ready_condition(node: &Node) -> Option<&NodeCondition> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")
}

/// The last sign of life: the Lease's renewTime, else the Ready condition's heartbeat, else
/// the node's creation.
pub fn last_heartbeat(node: &Node, lease: Option<&Lease>) -> Option<Timestamp> {
    lease
        .and_then(|l| l.spec.as_ref())
        .and_then(|s| s.renew_time.as_ref())
        .map(|t| t.0)
        .or_else(|| {
            ready_condition(node)
                .and_then(|c| c.last_heartbeat_time.as_ref())
                .map(|t| t.0)
        })
        .or_else(|| node.metadata.creation_timestamp.as_ref().map(|t| t.0))
}

fn managed_taint(key: &str, effect: &str, now: Timestamp) -> Taint {
    Taint {
        key: key.into(),
        value: None,
        effect: effect.into(),
        time_added: Some(Time(now)),
    }
}

/// The taints the node should have: its own, plus not-ready/unreachable (NoSchedule and
/// NoExecute) by health and unschedulable (NoSchedule) when cordoned. Existing managed taints
/// keep their timeAdded.
pub fn desired_taints(node: &Node, health: NodeHealth, now: Timestamp) -> Vec<Taint> {
    let current = node_taints(node);
    let managed = [TAINT_NOT_READY, TAINT_UNREACHABLE, TAINT_UNSCHEDULABLE];
    let mut want: Vec<Taint> = current
        .iter()
        .filter(|t| !managed.contains(&t.key.as_str()))
        .cloned()
        .collect();
    let mut add = |key: &str, effect: &str| {
        let t = current
            .iter()
            .find(|t| t.key == key && t.effect == effect)
            .cloned()
            .unwrap_or_else(|| managed_taint(key, effect, now));
        want.push(t);
    };
    match health {
        NodeHealth::Ready => {}
        NodeHealth::NotReady => {
            add(TAINT_NOT_READY, NO_SCHEDULE);
            add(TAINT_NOT_READY, NO_EXECUTE);
        }
        NodeHealth::Unknown => {
            add(TAINT_UNREACHABLE, NO_SCHEDULE);
            add(TAINT_UNREACHABLE, NO_EXECUTE);
        }
    }
    if node
        .spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false)
    {
        add(TAINT_UNSCHEDULABLE, NO_SCHEDULE);
    }
    want
}

/// When a node that stopped renewing its Lease is fenced and may be replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeline {
    /// The last sign of life ([`last_heartbeat`]), on the node's clock.
    pub renewed: Timestamp,
    /// The Lease's duration (its `leaseDurationSeconds`, else the default).
    pub lease_duration: Duration,
    /// `renewed + lease_duration`: the lease has expired and every self-fencing launcher on
    /// the node has killed its QEMU (same clock as `renewed`).
    pub fence_deadline: Timestamp,
    /// `fence_deadline + fence_margin`: replacements may be created (controller's clock).
    pub replace_at: Timestamp,
}

/// The failure timeline of a node, pure: replacement only after the launchers' fence
/// deadline plus the margin.
pub fn timeline(
    node: &Node,
    lease: Option<&Lease>,
    now: Timestamp,
    opts: &NodeLifecycleOptions,
) -> Timeline {
    let lease_duration = lease
        .and_then(|l| l.spec.as_ref())
        .and_then(|s| s.lease_duration_seconds)
        .and_then(|s| u64::try_from(s).ok())
        .map(Duration::from_secs)
        .unwrap_or(opts.default_lease_duration);
    let renewed = last_heartbeat(node, lease).unwrap_or(now);
    let fence_deadline = renewed
        .checked_add(to_signed(lease_duration))
        .unwrap_or(renewed);
    let replace_at = fence_deadline
        .checked_add(to_signed(opts.fence_margin))
        .unwrap_or(fence_deadline);
    Timeline {
        renewed,
        lease_duration,
        fence_deadline,
        replace_at,
    }
}

/// Decide a node's health and the writes it needs.
pub fn decide_node(
    node: &Node,
    lease: Option<&Lease>,
    now: Timestamp,
    opts: &NodeLifecycleOptions,
) -> NodeDecision {
    let tl = timeline(node, lease, now, opts);
    let (heartbeat, expires, evict_at) = (tl.renewed, tl.fence_deadline, tl.replace_at);
    let current = ready_condition(node);
    let fresh = now <= expires;
    let (health, ready_condition) = if !fresh {
        let write = current.is_none_or(|c| c.status != "Unknown");
        let cond = NodeCondition {
            type_: "Ready".into(),
            status: "Unknown".into(),
            reason: Some("NodeStatusUnknown".into()),
            message: Some("Kubelet stopped posting node status.".into()),
            last_heartbeat_time: current.and_then(|c| c.last_heartbeat_time.clone()),
            last_transition_time: Some(Time(now)),
        };
        (NodeHealth::Unknown, write.then_some(cond))
    } else {
        match current.map(|c| c.status.as_str()) {
            Some("True") => (NodeHealth::Ready, None),
            Some("False") => (NodeHealth::NotReady, None),
            // Fresh lease but Unknown (set by us earlier) or no condition: the agent is back.
            _ => (
                NodeHealth::Ready,
                Some(NodeCondition {
                    type_: "Ready".into(),
                    status: "True".into(),
                    reason: Some("KubeletReady".into()),
                    message: Some("node agent is renewing its lease".into()),
                    last_heartbeat_time: Some(Time(heartbeat)),
                    last_transition_time: Some(Time(now)),
                }),
            ),
        }
    };
    let want = desired_taints(node, health, now);
    let taints = (want.as_slice() != node_taints(node)).then_some(want);
    let fail_vmis = health == NodeHealth::Unknown && now >= evict_at;
    let requeue_after = match health {
        NodeHealth::Unknown if !fail_vmis => until(now, evict_at),
        NodeHealth::Ready | NodeHealth::NotReady => until(now, expires),
        NodeHealth::Unknown => opts.resync,
    }
    .min(opts.resync)
    // Wake at the deadline itself (plus a hair, so that `now >= deadline` holds then).
    .max(Duration::from_millis(20));
    NodeDecision {
        health,
        ready_condition,
        taints,
        timeline: tl,
        fail_vmis,
        requeue_after,
    }
}

pub use ferrovirt_api::fencing::{can_run_elsewhere, is_shared_access};

/// What to do with one VMI bound to a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmiNodeAction {
    None,
    /// Set phase Failed with this reason and message (the VM controller recreates it).
    /// `fenced`: the message of a `Fenced` event (the launcher killed QEMU by then).
    Fail {
        reason: String,
        message: String,
        fenced: Option<String>,
    },
    /// Set phase Unknown: the node is gone but the VMI's disks are there.
    MarkUnknown {
        reason: String,
        message: String,
    },
    /// Delete the VMI: an untolerated NoExecute taint.
    Evict {
        reason: String,
        message: String,
    },
}

fn rfc3339(t: Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// Whether no launcher can have been started for a VMI in this phase (the agent writes
/// Running once its launcher answers; a fencing-aware agent announces fencing before it
/// starts one).
fn never_started(phase: VmiPhase) -> bool {
    matches!(
        phase,
        VmiPhase::Unset | VmiPhase::Pending | VmiPhase::Scheduling | VmiPhase::Scheduled
    )
}

/// Decide for one VMI on `node` given the node's decision; `fencing` is what the node's
/// agent announced for the VMI's launcher ([`fencing::vmi_fencing`]).
pub fn decide_vmi(
    vmi: &VirtualMachineInstance,
    node: &Node,
    decision: &NodeDecision,
    fencing: VmiFencing,
    now: Timestamp,
) -> VmiNodeAction {
    let status = vmi.status.as_ref();
    let phase = status.and_then(|s| s.phase).unwrap_or(VmiPhase::Unset);
    if matches!(phase, VmiPhase::Succeeded | VmiPhase::Failed)
        || vmi.metadata.deletion_timestamp.is_some()
    {
        return VmiNodeAction::None;
    }
    let node_name = node.metadata.name.as_deref().unwrap_or("");
    if decision.fail_vmis {
        let tl = &decision.timeline;
        let renewed = rfc3339(tl.renewed);
        let deadline = rfc3339(tl.fence_deadline);
        return match fencing {
            VmiFencing::Enabled => VmiNodeAction::Fail {
                reason: REASON_NODE_UNRESPONSIVE.into(),
                message: format!(
                    "node {node_name} is unresponsive: its lease was last renewed at {renewed}"
                ),
                fenced: Some(format!(
                    "the VMI's launcher on node {node_name} stopped QEMU by {deadline}: it \
                     could not confirm the node's lease (renewed at {renewed}, duration {}s); \
                     replaced after a margin of {}s",
                    tl.lease_duration.as_secs(),
                    tl.replace_at.duration_since(tl.fence_deadline).as_secs()
                )),
            },
            VmiFencing::Unannounced if never_started(phase) => VmiNodeAction::Fail {
                reason: REASON_NODE_UNRESPONSIVE.into(),
                message: format!(
                    "node {node_name} is unresponsive (lease last renewed at {renewed}) and \
                     had not started the VMI"
                ),
                fenced: None,
            },
            _ if phase != VmiPhase::Unknown => VmiNodeAction::MarkUnknown {
                reason: REASON_NODE_UNRESPONSIVE.into(),
                message: format!(
                    "node {node_name} is unresponsive (lease last renewed at {renewed}); the \
                     VMI cannot move (node-local disks or a run strategy that does not \
                     restart it), so it keeps running there and is not replaced"
                ),
            },
            _ => VmiNodeAction::None,
        };
    }
    let tolerations = vmi
        .spec
        .as_ref()
        .and_then(|s| s.tolerations.as_deref())
        .unwrap_or_default();
    for taint in node_taints(node) {
        // Health taints are handled above, on the lease timeline.
        if taint.effect != NO_EXECUTE
            || taint.key == TAINT_NOT_READY
            || taint.key == TAINT_UNREACHABLE
        {
            continue;
        }
        let evict = match find_toleration(tolerations, taint) {
            None => true,
            Some(t) => match (t.toleration_seconds, taint.time_added.as_ref()) {
                (Some(secs), Some(added)) => {
                    let deadline = added
                        .0
                        .checked_add(SignedDuration::from_secs(secs.max(0)))
                        .unwrap_or(added.0);
                    now >= deadline
                }
                (Some(secs), None) => secs <= 0,
                (None, _) => false,
            },
        };
        if evict {
            return VmiNodeAction::Evict {
                reason: REASON_TAINT_EVICTION.into(),
                message: format!(
                    "node {node_name} has taint {{{}: {}}}:NoExecute that the VMI does not tolerate",
                    taint.key,
                    taint.value.as_deref().unwrap_or("")
                ),
            };
        }
    }
    VmiNodeAction::None
}

#[cfg(test)]
#[path = "node_lifecycle_tests.rs"]
mod tests;
