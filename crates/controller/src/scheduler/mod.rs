//! The VMI scheduler as pure functions: filter each Node (readiness, `spec.unschedulable`,
//! taints, nodeSelector and node affinity, named CPU models, resources and KVM, VMI affinity),
//! score the
//! feasible ones (least requested, preferred node affinity, PreferNoSchedule taints,
//! preferred VMI affinity) and pick the best, or explain why none fits in Kubernetes' words:
//! `0/3 nodes are available: 1 node(s) didn't match node selector, 2 Insufficient memory.`
//!
//! Filters run in the order of Kubernetes' default plugins and a node reports the reasons of
//! the first filter it fails, so the counts in the message add up to the node count.

pub mod capabilities;
pub mod cpu_model;
pub mod devices;
pub mod interpod;
pub mod placement;
pub mod resources;
pub mod selectors;
pub mod taints;
#[cfg(test)]
pub(crate) mod testutil;
pub mod volumes;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use k8s_openapi::api::core::v1::{Node, NodeSelector, Taint, Toleration};

use ferrovirt_api::kubevirt::overcommit::Overcommit;
use ferrovirt_api::kubevirt::vmi::{VirtualMachineInstance, VmiPhase};

use interpod::Placed;
use resources::{Resources, VMI_MEMORY_OVERHEAD_BYTES};

/// Reason for nodes whose `nodeSelector`/required node affinity does not match.
pub const REASON_NODE_SELECTOR: &str = "node(s) didn't match node selector";
/// Reason for cordoned nodes (`spec.unschedulable`).
pub const REASON_UNSCHEDULABLE: &str = "node(s) were unschedulable";
/// Reason for nodes without KVM when the VMI needs it.
pub const REASON_NO_KVM: &str = "Insufficient devices.kubevirt.io/kvm";
/// Message when there are no nodes at all.
pub const NO_NODES: &str = "no nodes available to schedule pods";
/// Taint key Kubernetes puts on NotReady nodes.
pub const TAINT_NOT_READY: &str = "node.kubernetes.io/not-ready";
/// Taint key Kubernetes puts on nodes whose status is Unknown.
pub const TAINT_UNREACHABLE: &str = "node.kubernetes.io/unreachable";
/// Taint key Kubernetes puts on cordoned nodes.
pub const TAINT_UNSCHEDULABLE: &str = "node.kubernetes.io/unschedulable";

/// Tunables of the scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerOptions {
    /// Added to every VMI's memory request; see [`VMI_MEMORY_OVERHEAD_BYTES`].
    pub memory_overhead_bytes: u64,
    /// The KubeVirt CR's overcommit settings (the CPU a VMI without a request asks per vCPU).
    pub overcommit: Overcommit,
    /// The KubeVirt CR's `obsoleteCPUModels`: a VMI naming one fits no node.
    pub obsolete_cpu_models: BTreeSet<String>,
    /// The KubeVirt CR's workloads placement: the nodes VMs may run on (None: all).
    pub workloads: Option<placement::WorkloadsPlacement>,
}

impl Default for SchedulerOptions {
    fn default() -> Self {
        Self {
            memory_overhead_bytes: VMI_MEMORY_OVERHEAD_BYTES,
            overcommit: Overcommit::default(),
            obsolete_cpu_models: ferrovirt_api::kubevirt::cpu_model::obsolete_models([]),
            workloads: None,
        }
    }
}

/// What to schedule and onto what.
#[derive(Debug, Clone, Copy)]
pub struct ScheduleRequest<'a> {
    /// The VMI to place.
    pub vmi: &'a VirtualMachineInstance,
    /// Every node.
    pub nodes: &'a [Node],
    /// Every VMI; those bound to a node (`status.nodeName`) and not finished count against it.
    pub vmis: &'a [VirtualMachineInstance],
    /// Required node selectors of the PVs the VMI's claims are bound to
    /// ([`volumes::required_selectors`]).
    pub volume_affinity: &'a [NodeSelector],
    /// Claims whose class keeps volumes on a declared shared filesystem
    /// ([`volumes::shared_mount_needs`]).
    pub shared_mounts: &'a [volumes::SharedMountNeed],
}

/// The scheduler's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Bind the VMI to this node.
    Bind { node: String },
    /// No node fits.
    Unschedulable(FitError),
}

/// Why no node fits: per node, the reasons of the first filter it failed.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FitError {
    pub num_nodes: usize,
    pub node_reasons: BTreeMap<String, Vec<String>>,
}

impl fmt::Display for FitError {
    /// Kubernetes' format: `0/N nodes are available: <count> <reason>, ….` with the
    /// `<count> <reason>` strings sorted, as `sort.Strings` does.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.num_nodes == 0 {
            return f.write_str(NO_NODES);
        }
        let mut histogram: BTreeMap<&str, usize> = BTreeMap::new();
        for reason in self.node_reasons.values().flatten() {
            *histogram.entry(reason.as_str()).or_default() += 1;
        }
        let mut parts: Vec<String> = histogram.iter().map(|(r, n)| format!("{n} {r}")).collect();
        parts.sort();
        write!(f, "0/{} nodes are available", self.num_nodes)?;
        if parts.is_empty() {
            f.write_str(".")
        } else {
            write!(f, ": {}.", parts.join(", "))
        }
    }
}

impl std::error::Error for FitError {}

/// Whether a VMI still holds its node's resources (bound and not finished).
pub fn is_bound(vmi: &VirtualMachineInstance) -> Option<&str> {
    let status = vmi.status.as_ref()?;
    if matches!(status.phase, Some(VmiPhase::Succeeded | VmiPhase::Failed)) {
        return None;
    }
    status.node_name.as_deref().filter(|n| !n.is_empty())
}

/// `spec.schedulerName` values this scheduler serves (unset also means it).
pub const SCHEDULER_NAMES: &[&str] = &["", "default-scheduler", "ferrovirt-scheduler"];

/// Whether the VMI waits for this scheduler: phase unset/Pending/Scheduling, no
/// `status.nodeName`, not being deleted, and no other `spec.schedulerName`.
pub fn needs_scheduling(vmi: &VirtualMachineInstance) -> bool {
    let status = vmi.status.as_ref();
    let phase = status.and_then(|s| s.phase).unwrap_or(VmiPhase::Unset);
    let ours = vmi
        .spec
        .as_ref()
        .and_then(|s| s.scheduler_name.as_deref())
        .is_none_or(|n| SCHEDULER_NAMES.contains(&n));
    ours && vmi.metadata.deletion_timestamp.is_none()
        && matches!(
            phase,
            VmiPhase::Unset | VmiPhase::Pending | VmiPhase::Scheduling
        )
        && status
            .and_then(|s| s.node_name.as_deref())
            .is_none_or(str::is_empty)
}

fn same_object(a: &VirtualMachineInstance, b: &VirtualMachineInstance) -> bool {
    a.metadata.namespace == b.metadata.namespace && a.metadata.name == b.metadata.name
}

fn tolerations(vmi: &VirtualMachineInstance) -> &[Toleration] {
    vmi.spec
        .as_ref()
        .and_then(|s| s.tolerations.as_deref())
        .unwrap_or_default()
}

/// The node's Ready condition status (`True`, `False`, `Unknown`), if reported.
pub fn node_ready_status(node: &Node) -> Option<&str> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.status.as_str())
}

struct NodeState<'a> {
    node: &'a Node,
    used: Resources,
    /// Host devices the bound VMIs hold there ([`devices`]).
    devices: Option<&'a devices::DeviceCounts>,
}

struct Ctx<'a> {
    vmi: &'a VirtualMachineInstance,
    volume_affinity: &'a [NodeSelector],
    shared_mounts: &'a [volumes::SharedMountNeed],
    want: Resources,
    needs_kvm: bool,
    obsolete_cpu_models: &'a BTreeSet<String>,
    workloads: Option<&'a placement::WorkloadsPlacement>,
    placed: &'a [Placed<'a>],
    /// The placed VMIs that declare required anti-affinity (a subset of `placed`).
    holders: &'a [Placed<'a>],
}

fn implicit_taint(key: &str) -> Taint {
    Taint {
        key: key.into(),
        value: None,
        effect: taints::NO_SCHEDULE.into(),
        time_added: None,
    }
}

/// Run the filters for one node; `Err` carries the reasons of the first failing filter.
fn filter_node(ctx: &Ctx<'_>, state: &NodeState<'_>) -> Result<(), Vec<String>> {
    let node = state.node;
    let tols = tolerations(ctx.vmi);
    // Readiness: a node that is not Ready behaves as if it had the not-ready/unreachable taint.
    match node_ready_status(node) {
        Some("True") => {}
        Some("Unknown") => {
            return Err(vec![taints::untolerated_reason(&implicit_taint(
                TAINT_UNREACHABLE,
            ))]);
        }
        _ => {
            return Err(vec![taints::untolerated_reason(&implicit_taint(
                TAINT_NOT_READY,
            ))]);
        }
    }
    // NodeUnschedulable.
    if node
        .spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false)
        && taints::find_toleration(tols, &implicit_taint(TAINT_UNSCHEDULABLE)).is_none()
    {
        return Err(vec![REASON_UNSCHEDULABLE.to_string()]);
    }
    // TaintToleration.
    if let Some(t) = taints::first_untolerated(taints::node_taints(node), tols) {
        return Err(vec![taints::untolerated_reason(t)]);
    }
    // NodeAffinity (nodeSelector and required node affinity).
    let spec = ctx.vmi.spec.as_ref();
    let selector_ok = spec
        .and_then(|s| s.node_selector.as_ref())
        .is_none_or(|sel| selectors::matches_node_selector_map(sel, node));
    let affinity_ok = spec
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|na| {
            na.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .is_none_or(|req| selectors::matches_node_selector(req, node));
    if !(selector_ok && affinity_ok) {
        return Err(vec![REASON_NODE_SELECTOR.to_string()]);
    }
    // The workloads placement (where KubeVirt would run virt-handler).
    if let Some(reason) = placement::unmet(ctx.workloads, node) {
        return Err(vec![reason]);
    }
    // The named CPU model (KubeVirt puts it into the launcher Pod's node selector).
    if let Some(reason) = cpu_model::unmet(ctx.vmi, node, ctx.obsolete_cpu_models) {
        return Err(vec![reason]);
    }
    // NodeResourcesFit, with KVM as an extended resource.
    let mut reasons =
        resources::insufficient(ctx.want, state.used, resources::node_allocatable(node));
    if ctx.needs_kvm && !resources::node_has_kvm(node) {
        reasons.push(REASON_NO_KVM.to_string());
    }
    if !reasons.is_empty() {
        return Err(reasons);
    }
    // Honour or refuse: devices and features the node must offer.
    let unmet = capabilities::unmet(ctx.vmi, node);
    if !unmet.is_empty() {
        return Err(unmet);
    }
    // Host devices, counted (NodeResourcesFit over the device plugins' resources).
    let short = devices::insufficient(
        ctx.vmi,
        state.devices.unwrap_or(&devices::DeviceCounts::new()),
        node,
    );
    if !short.is_empty() {
        return Err(short);
    }
    // VolumeBinding: bound volumes with node affinity (local volumes).
    if !volumes::fits(ctx.volume_affinity, node) {
        return Err(vec![volumes::REASON_VOLUME_AFFINITY.to_string()]);
    }
    // Shared filesystems the node must have mounted.
    if let Some(reason) = volumes::unmounted_reason(ctx.shared_mounts, node) {
        return Err(vec![reason]);
    }
    // InterPodAffinity among VMIs.
    interpod::filter_with(ctx.vmi, node, ctx.placed, ctx.holders).map_err(|r| vec![r])
}

/// Raw preferred node affinity score: the sum of weights of matching preferred terms.
fn node_affinity_score(vmi: &VirtualMachineInstance, node: &Node) -> i64 {
    vmi.spec
        .as_ref()
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|na| {
            na.preferred_during_scheduling_ignored_during_execution
                .as_deref()
        })
        .unwrap_or_default()
        .iter()
        .filter(|p| selectors::matches_node_selector_term(&p.preference, node))
        .map(|p| i64::from(p.weight))
        .sum()
}

/// Scale raw scores to 0–100 by the maximum (Kubernetes' default normalisation).
fn normalize_max(raw: &[i64], reverse: bool) -> Vec<i64> {
    let max = raw.iter().copied().max().unwrap_or(0);
    raw.iter()
        .map(|&s| {
            let v = if max > 0 { s * 100 / max } else { 0 };
            if reverse { 100 - v } else { v }
        })
        .collect()
}

/// Scale raw scores to 0–100 between their minimum and maximum.
fn normalize_min_max(raw: &[i64]) -> Vec<i64> {
    let (min, max) = (
        raw.iter().copied().min().unwrap_or(0),
        raw.iter().copied().max().unwrap_or(0),
    );
    raw.iter()
        .map(|&s| {
            if max > min {
                (s - min) * 100 / (max - min)
            } else {
                0
            }
        })
        .collect()
}

/// Plugin weights, as in Kubernetes' default profile.
const W_RESOURCES: i64 = 1;
const W_NODE_AFFINITY: i64 = 2;
const W_TAINTS: i64 = 3;
const W_INTERPOD: i64 = 2;

/// Score of every feasible node, in the order given.
fn score_nodes(ctx: &Ctx<'_>, feasible: &[&NodeState<'_>]) -> Vec<i64> {
    let tols = tolerations(ctx.vmi);
    let least: Vec<i64> = feasible
        .iter()
        .map(|s| {
            let mut after = s.used;
            after += ctx.want;
            resources::least_requested_score(after, resources::node_allocatable(s.node))
        })
        .collect();
    let node_aff = normalize_max(
        &feasible
            .iter()
            .map(|s| node_affinity_score(ctx.vmi, s.node))
            .collect::<Vec<_>>(),
        false,
    );
    let taint = normalize_max(
        &feasible
            .iter()
            .map(|s| {
                taints::count_intolerable_prefer_no_schedule(taints::node_taints(s.node), tols)
                    as i64
            })
            .collect::<Vec<_>>(),
        true,
    );
    let interpod = normalize_min_max(
        &feasible
            .iter()
            .map(|s| interpod::preferred_score(ctx.vmi, s.node, ctx.placed))
            .collect::<Vec<_>>(),
    );
    (0..feasible.len())
        .map(|i| {
            least[i] * W_RESOURCES
                + node_aff[i] * W_NODE_AFFINITY
                + taint[i] * W_TAINTS
                + interpod[i] * W_INTERPOD
        })
        .collect()
}

/// Choose a node for `req.vmi`: the highest score among nodes passing every filter, ties to
/// the lexicographically first node name; or a [`FitError`]. One decision over a fresh
/// [`Snapshot`]; a loop placing many VMIs builds the snapshot once instead.
pub fn schedule(req: &ScheduleRequest<'_>, opts: &SchedulerOptions) -> Decision {
    let others = req.vmis.iter().filter(|o| !same_object(o, req.vmi));
    Snapshot::new(req.nodes, others, opts).schedule(req.vmi, req.volume_affinity, req.shared_mounts)
}

/// The cluster as the scheduler sees it at one moment, prepared once for many decisions:
/// nodes by name, the resources the bound VMIs hold on each, and the placed VMIs (those that
/// declare required anti-affinity also apart). Building it is one pass over the VMIs; each
/// decision is then one pass over the nodes, plus the placed VMIs only where affinity terms ask
/// for them. [`Snapshot::assume`] adds a binding just decided, so that the next decision of the
/// same pass counts it.
#[derive(Debug)]
pub struct Snapshot<'a> {
    by_name: BTreeMap<&'a str, &'a Node>,
    used: BTreeMap<&'a str, Resources>,
    /// Host devices held per node.
    devices: BTreeMap<&'a str, devices::DeviceCounts>,
    placed: Vec<Placed<'a>>,
    holders: Vec<Placed<'a>>,
    memory_overhead_bytes: u64,
    overcommit: Overcommit,
    obsolete_cpu_models: BTreeSet<String>,
    workloads: Option<placement::WorkloadsPlacement>,
}

impl<'a> Snapshot<'a> {
    /// How many nodes the snapshot holds.
    pub fn node_count(&self) -> usize {
        self.by_name.len()
    }

    /// The snapshot of `nodes` with `vmis` (the bound, unfinished ones count; see [`is_bound`]).
    pub fn new(
        nodes: &'a [Node],
        vmis: impl IntoIterator<Item = &'a VirtualMachineInstance>,
        opts: &SchedulerOptions,
    ) -> Snapshot<'a> {
        let by_name: BTreeMap<&'a str, &'a Node> = nodes
            .iter()
            .filter_map(|n| n.metadata.name.as_deref().map(|name| (name, n)))
            .collect();
        let mut snap = Snapshot {
            by_name,
            used: BTreeMap::new(),
            devices: BTreeMap::new(),
            placed: Vec::new(),
            holders: Vec::new(),
            memory_overhead_bytes: opts.memory_overhead_bytes,
            overcommit: opts.overcommit,
            obsolete_cpu_models: opts.obsolete_cpu_models.clone(),
            workloads: opts.workloads.clone(),
        };
        for vmi in vmis {
            if let Some(node) = is_bound(vmi) {
                snap.assume(vmi, node);
            }
        }
        snap
    }

    /// Counts `vmi` as placed on `node` (a node the snapshot does not know is ignored, as a
    /// VMI bound to a deleted node holds nothing).
    pub fn assume(&mut self, vmi: &'a VirtualMachineInstance, node: &str) {
        let Some((&name, &n)) = self.by_name.get_key_value(node) else {
            return;
        };
        let mut r = resources::vmi_requests(vmi, &self.overcommit);
        r.memory_bytes = r.memory_bytes.saturating_add(self.memory_overhead_bytes);
        *self.used.entry(name).or_default() += r;
        let d = devices::wanted(vmi);
        if !d.is_empty() {
            devices::add(self.devices.entry(name).or_default(), &d);
        }
        let p = Placed { vmi, node: n };
        if interpod::has_required_anti_affinity(vmi) {
            self.holders.push(p);
        }
        self.placed.push(p);
    }

    /// Choose a node for `vmi` (which must not be counted in the snapshot itself): the highest
    /// score among nodes passing every filter, ties to the lexicographically first node name;
    /// or a [`FitError`]. `volume_affinity`: see [`ScheduleRequest::volume_affinity`].
    pub fn schedule(
        &self,
        vmi: &VirtualMachineInstance,
        volume_affinity: &[NodeSelector],
        shared_mounts: &[volumes::SharedMountNeed],
    ) -> Decision {
        let mut want = resources::vmi_requests(vmi, &self.overcommit);
        want.memory_bytes = want.memory_bytes.saturating_add(self.memory_overhead_bytes);
        let ctx = Ctx {
            vmi,
            volume_affinity,
            shared_mounts,
            want,
            needs_kvm: resources::vmi_needs_kvm(vmi),
            obsolete_cpu_models: &self.obsolete_cpu_models,
            workloads: self.workloads.as_ref(),
            placed: &self.placed,
            holders: &self.holders,
        };
        let states: Vec<NodeState<'_>> = self
            .by_name
            .iter()
            .map(|(name, node)| NodeState {
                node,
                used: self.used.get(name).copied().unwrap_or_default(),
                devices: self.devices.get(name),
            })
            .collect();
        let mut fit = FitError {
            num_nodes: states.len(),
            node_reasons: BTreeMap::new(),
        };
        let mut feasible = Vec::new();
        for s in &states {
            match filter_node(&ctx, s) {
                Ok(()) => feasible.push(s),
                Err(reasons) => {
                    let name = s.node.metadata.name.clone().unwrap_or_default();
                    fit.node_reasons.insert(name, reasons);
                }
            }
        }
        let scores = score_nodes(&ctx, &feasible);
        let best =
            feasible
                .iter()
                .zip(scores)
                .fold(
                    None::<(&NodeState<'_>, i64)>,
                    |best, (s, score)| match best {
                        Some((_, b)) if b >= score => best,
                        _ => Some((s, score)),
                    },
                );
        match best {
            Some((s, _)) => Decision::Bind {
                node: s.node.metadata.name.clone().unwrap_or_default(),
            },
            None => Decision::Unschedulable(fit),
        }
    }
}

#[cfg(test)]
mod tests;
