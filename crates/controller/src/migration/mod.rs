//! The live-migration controller's decisions, pure (docs/migration.md): from a
//! VirtualMachineInstanceMigration (VMIM) and its VMI as stored, the next step — which phase the
//! VMIM enters (Pending → Scheduling → Scheduled → PreparingTarget → TargetReady → Running →
//! Succeeded | Failed, each with its `phaseTransitionTimestamps` entry), what to write into the
//! VMI's `status.migrationState` (the target node when one is chosen, a failure when the target
//! never became ready) and which Events explain it. The agents do the rest: the target node's
//! agent starts a launcher waiting for the incoming stream and reports its address, the source
//! node's agent runs the migration and moves the VMI. Target selection is the scheduler's pure
//! filters over every node but the current one ([`pick_target`]).

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeSelector};
use serde_json::{Value, json};

use ferrovirt_api::kubevirt::misc::{MigrationPhase, VirtualMachineInstanceMigration};
use ferrovirt_api::kubevirt::vmi::{MigrationState, VirtualMachineInstance, VmiPhase};
use ferrovirt_api::migration::{self as mig, MODE_PRE_COPY};

use crate::scheduler::{self, Decision, ScheduleRequest, SchedulerOptions};

/// How long a chosen target may take to get ready (its launcher waiting for the stream)
/// before the migration fails and the source runs on.
pub const TARGET_READY_TIMEOUT_SECS: i64 = 60;

/// Which object an Event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum On {
    Migration,
    Vmi,
}

/// One Event to record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    pub on: On,
    pub warning: bool,
    pub reason: &'static str,
    pub message: String,
}

/// What to do for one VMIM.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Step {
    /// Merge patch for the VMIM's `status`.
    pub migration_status: Option<Value>,
    /// Merge patch for the VMI's `status` (written first, guarded by the VMI's
    /// resourceVersion).
    pub vmi_status: Option<Value>,
    pub events: Vec<Note>,
}

/// Event reasons.
pub mod reasons {
    pub const SCHEDULED: &str = "MigrationTargetScheduled";
    pub const PREPARING: &str = "PreparingTarget";
    pub const TARGET_READY: &str = "MigrationTargetReady";
    pub const RUNNING: &str = "Migrating";
    pub const SUCCEEDED: &str = "Migrated";
    pub const FAILED: &str = "FailedMigration";
}

/// KubeVirt's condition on a migration whose target the namespace's ResourceQuota refuses.
pub const QUOTA_CONDITION: &str = "migrationRejectedByResourceQuota";
/// Its reason.
pub const QUOTA_REASON: &str = "ExceededQuota";

fn conditions_of(vmim: &VirtualMachineInstanceMigration) -> Vec<Value> {
    vmim.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .map(|c| serde_json::to_value(c).unwrap_or(Value::Null))
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
}

/// The VMIM status patch when the quota refused its target (the API server's 403 `message`):
/// it stays Pending (retried on every pass) with [`QUOTA_CONDITION`] True; `None` when the
/// condition already says this. Pure.
pub fn quota_rejected(
    vmim: &VirtualMachineInstanceMigration,
    message: &str,
    now: &str,
) -> Option<Value> {
    let mut conds = conditions_of(vmim);
    if conds
        .iter()
        .any(|c| c["type"] == QUOTA_CONDITION && c["status"] == "True" && c["message"] == message)
    {
        return None;
    }
    conds.retain(|c| c["type"] != QUOTA_CONDITION);
    conds.push(json!({
        "type": QUOTA_CONDITION, "status": "True", "reason": QUOTA_REASON, "message": message,
        "lastTransitionTime": now, "lastProbeTime": now,
    }));
    Some(json!({"conditions": conds}))
}

/// What target selection found: the node and the settings the migration runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Chosen {
    pub node: String,
    /// `migrationState.migrationConfiguration` (cluster config with the policy over it).
    pub configuration: Value,
    /// `migrationState.migrationPolicyName`.
    pub policy: Option<String>,
}

/// Whether one more migration may start: fewer than `parallelMigrationsPerCluster` run in
/// the cluster and fewer than `parallelOutboundMigrationsPerNode` leave the VMI's node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub active_in_cluster: usize,
    pub active_from_node: usize,
    pub per_cluster: u32,
    pub per_node: u32,
}

impl Limits {
    /// No limit reached.
    pub fn room(&self) -> bool {
        self.active_in_cluster < self.per_cluster as usize
            && self.active_from_node < self.per_node as usize
    }
}

/// Whether a VMIM in this phase counts against the parallel limits.
pub fn is_active(p: MigrationPhase) -> bool {
    (rank(MigrationPhase::Scheduling)..rank(MigrationPhase::Succeeded)).contains(&rank(p))
}

/// What the controller knows besides the two objects.
#[derive(Debug, Clone, Copy)]
pub struct Now<'a> {
    /// RFC 3339, for timestamps written.
    pub rfc3339: &'a str,
    /// Seconds since the epoch, for timeouts.
    pub epoch_secs: i64,
}

fn phase_name(p: MigrationPhase) -> String {
    serde_json::to_value(p)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default()
}

/// The VMIM's current phase (`Unset` when none).
pub fn current_phase(vmim: &VirtualMachineInstanceMigration) -> MigrationPhase {
    vmim.status
        .as_ref()
        .and_then(|s| s.phase)
        .unwrap_or(MigrationPhase::Unset)
}

/// Whether the VMIM is finished.
pub fn is_final(p: MigrationPhase) -> bool {
    matches!(p, MigrationPhase::Succeeded | MigrationPhase::Failed)
}

/// The order of the phases this controller drives (for "never go back").
fn rank(p: MigrationPhase) -> u8 {
    use MigrationPhase::*;
    match p {
        Unset => 0,
        Pending => 1,
        Scheduling => 2,
        Scheduled => 3,
        PreparingTarget => 4,
        TargetReady => 5,
        Running => 6,
        Succeeded | Failed => 7,
        WaitingForSync | Synchronizing => 0,
    }
}

/// The VMIM status patch entering `to` (appending its transition timestamp), with the VMI's
/// migration state copied when given.
fn enter(
    vmim: &VirtualMachineInstanceMigration,
    to: MigrationPhase,
    state: Option<&MigrationState>,
    now: &str,
) -> Value {
    let mut transitions: Vec<Value> = vmim
        .status
        .as_ref()
        .and_then(|s| s.phase_transition_timestamps.as_ref())
        .map(|t| serde_json::to_value(t).unwrap_or(Value::Null))
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default();
    transitions.push(json!({"phase": phase_name(to), "phaseTransitionTimestamp": now}));
    let mut out = json!({"phase": phase_name(to), "phaseTransitionTimestamps": transitions});
    if let Some(s) = state {
        out["migrationState"] = serde_json::to_value(s).unwrap_or(Value::Null);
    }
    out
}

/// When the VMIM entered its current phase (seconds since the epoch).
fn entered_at(vmim: &VirtualMachineInstanceMigration) -> Option<i64> {
    let st = vmim.status.as_ref()?;
    let t = st
        .phase_transition_timestamps
        .as_ref()?
        .iter()
        .rev()
        .find(|t| t.phase == st.phase)?;
    t.phase_transition_timestamp
        .as_ref()
        .map(|t| t.0.as_second())
}

fn failed_step(
    vmim: &VirtualMachineInstanceMigration,
    state: Option<&MigrationState>,
    message: String,
    now: &str,
) -> Step {
    let mut status = enter(vmim, MigrationPhase::Failed, state, now);
    status["conditions"] = json!([{
        "type": "Failed", "status": "True", "reason": reasons::FAILED, "message": message,
        "lastTransitionTime": now, "lastProbeTime": null,
    }]);
    Step {
        migration_status: Some(status),
        vmi_status: None,
        events: vec![
            Note {
                on: On::Migration,
                warning: true,
                reason: reasons::FAILED,
                message: message.clone(),
            },
            Note {
                on: On::Vmi,
                warning: true,
                reason: reasons::FAILED,
                message,
            },
        ],
    }
}

/// The VMI's `LiveMigratable` condition when it is False: (reason, message).
pub fn not_migratable(vmi: &VirtualMachineInstance) -> Option<(String, String)> {
    let c = vmi
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == ferrovirt_api::kubevirt::vmi::vmi_condition::LIVE_MIGRATABLE)?;
    (c.status == "False").then(|| {
        (
            c.reason.clone().unwrap_or_default(),
            c.message.clone().unwrap_or_default(),
        )
    })
}

/// The next step for `vmim` given its VMI (`None`: not found). `pick` chooses the target
/// node and the settings (called only when one is needed); `limits`: the parallel limits.
pub fn decide(
    vmim: &VirtualMachineInstanceMigration,
    vmi: Option<&VirtualMachineInstance>,
    pick: impl FnOnce(&VirtualMachineInstance) -> Result<Chosen, String>,
    limits: Limits,
    now: Now<'_>,
) -> Step {
    use MigrationPhase::*;
    let cur = current_phase(vmim);
    if is_final(cur) {
        return Step::default();
    }
    let uid = vmim.metadata.uid.clone().unwrap_or_default();
    let vmi_name = vmim
        .spec
        .as_ref()
        .and_then(|s| s.vmi_name.clone())
        .unwrap_or_default();
    let Some(vmi) = vmi else {
        return failed_step(
            vmim,
            None,
            format!("VirtualMachineInstance {vmi_name} does not exist"),
            now.rfc3339,
        );
    };
    if let Some(state) = mig::state_of(vmi, &uid) {
        // The agents drive it from here; the VMIM follows the VMI's migration state.
        let target = if state.failed == Some(true) {
            Failed
        } else if state.completed == Some(true) {
            Succeeded
        } else if state.start_timestamp.is_some() {
            Running
        } else if state.target_node_address.is_some() && !mig::chains_only(state) {
            TargetReady
        } else if cur == Scheduled || cur == PreparingTarget {
            PreparingTarget
        } else {
            Scheduled
        };
        if target == Failed {
            let reason = state
                .failure_reason
                .clone()
                .unwrap_or_else(|| "the migration failed".into());
            return failed_step(vmim, Some(state), reason, now.rfc3339);
        }
        if rank(target) > rank(cur) {
            let message = match target {
                Scheduled => format!(
                    "Migration target node {} chosen",
                    state.target_node.as_deref().unwrap_or("?")
                ),
                PreparingTarget => "The target node prepares a launcher for the incoming VM".into(),
                TargetReady => format!(
                    "The target is waiting for the migration stream at {}",
                    state.target_node_address.as_deref().unwrap_or("?")
                ),
                Running => "The source node is sending the VM's state".into(),
                _ => format!(
                    "The VirtualMachineInstance migrated from node {} to node {}",
                    state.source_node.as_deref().unwrap_or("?"),
                    state.target_node.as_deref().unwrap_or("?")
                ),
            };
            let reason = match target {
                Scheduled => reasons::SCHEDULED,
                PreparingTarget => reasons::PREPARING,
                TargetReady => reasons::TARGET_READY,
                Running => reasons::RUNNING,
                _ => reasons::SUCCEEDED,
            };
            let mut events = vec![Note {
                on: On::Migration,
                warning: false,
                reason,
                message: message.clone(),
            }];
            if target == Succeeded || target == Running {
                events.push(Note {
                    on: On::Vmi,
                    warning: false,
                    reason,
                    message,
                });
            }
            return Step {
                migration_status: Some(enter(vmim, target, Some(state), now.rfc3339)),
                vmi_status: None,
                events,
            };
        }
        // A target that never gets ready: fail it, the source runs on.
        if matches!(cur, Scheduled | PreparingTarget)
            && entered_at(vmim).is_some_and(|t| now.epoch_secs - t > TARGET_READY_TIMEOUT_SECS)
        {
            let reason = format!(
                "the target node {} did not get ready within {TARGET_READY_TIMEOUT_SECS} s",
                state.target_node.as_deref().unwrap_or("?")
            );
            return Step {
                vmi_status: Some(json!({"migrationState": {
                    "failed": true, "failureReason": reason, "endTimestamp": now.rfc3339,
                }})),
                ..Step::default()
            };
        }
        return Step::default();
    }
    if rank(cur) >= rank(Scheduled) {
        // Its state on the VMI was replaced by another migration's: it cannot go on.
        return failed_step(
            vmim,
            None,
            "the VMI's migration state belongs to another migration".into(),
            now.rfc3339,
        );
    }
    let phase = vmi.status.as_ref().and_then(|s| s.phase);
    if phase != Some(VmiPhase::Running) || vmi.metadata.deletion_timestamp.is_some() {
        return failed_step(
            vmim,
            None,
            format!("VirtualMachineInstance {vmi_name} is not running"),
            now.rfc3339,
        );
    }
    if let Some((reason, message)) = not_migratable(vmi) {
        return failed_step(
            vmim,
            None,
            format!(
                "VirtualMachineInstance {vmi_name} is not live-migratable ({reason}): {message}"
            ),
            now.rfc3339,
        );
    }
    let busy = vmi
        .status
        .as_ref()
        .and_then(|s| s.migration_state.as_ref())
        .is_some_and(|m| !mig::finished(m));
    match cur {
        Unset => Step {
            migration_status: Some(enter(vmim, Pending, None, now.rfc3339)),
            ..Step::default()
        },
        // Another migration of this VMI still runs, or the parallel limits are reached: wait.
        Pending if busy || !limits.room() => Step::default(),
        Pending => {
            let mut status = enter(vmim, Scheduling, None, now.rfc3339);
            // Proceeding: a quota rejection no longer holds.
            let conds = conditions_of(vmim);
            if conds.iter().any(|c| c["type"] == QUOTA_CONDITION) {
                let kept: Vec<Value> = conds
                    .into_iter()
                    .filter(|c| c["type"] != QUOTA_CONDITION)
                    .collect();
                status["conditions"] = Value::Array(kept);
            }
            Step {
                migration_status: Some(status),
                ..Step::default()
            }
        }
        _ => match pick(vmi) {
            Err(why) => failed_step(
                vmim,
                None,
                format!("no node can take the VM: {why}"),
                now.rfc3339,
            ),
            Ok(chosen) => {
                let target = chosen.node;
                let source = vmi.status.as_ref().and_then(|s| s.node_name.clone());
                // Every field of an older migration's state is cleared.
                let state = json!({
                    "migrationUid": uid,
                    "sourceNode": source,
                    "targetNode": target,
                    "mode": MODE_PRE_COPY,
                    "startTimestamp": null, "endTimestamp": null, "targetNodeAddress": null,
                    "targetDirectMigrationNodePorts": null, "targetNodeDomainDetected": null,
                    "targetNodeDomainReadyTimestamp": null, "targetPod": null,
                    "completed": null, "failed": null, "failureReason": null,
                    "abortRequested": null, "abortStatus": null,
                    "migrationConfiguration": chosen.configuration,
                    "migrationPolicyName": chosen.policy,
                });
                Step {
                    migration_status: None,
                    vmi_status: Some(json!({
                        "migrationState": state,
                        "migrationMethod": mig::METHOD_LIVE,
                    })),
                    events: Vec::new(),
                }
            }
        },
    }
}

/// The abort of a migration whose VMIM was deleted (cancel): `None` when the VMI's migration
/// state is finished or belongs to an existing migration (`migration_exists`). Before the
/// source started sending, it fails at once; after, the source is asked to abort.
pub fn cancel_patch(
    vmi: &VirtualMachineInstance,
    migration_exists: impl Fn(&str) -> bool,
    now: &str,
) -> Option<Value> {
    let st = vmi.status.as_ref()?.migration_state.as_ref()?;
    let uid = st.migration_uid.as_deref()?;
    if mig::finished(st) || migration_exists(uid) || st.abort_requested == Some(true) {
        return None;
    }
    Some(if st.start_timestamp.is_none() {
        json!({"migrationState": {
            "abortRequested": true, "abortStatus": "Succeeded", "failed": true,
            "failureReason": "the migration was cancelled", "endTimestamp": now,
        }})
    } else {
        json!({"migrationState": {"abortRequested": true, "abortStatus": "Aborting"}})
    })
}

/// What target selection needs besides the VMI.
#[derive(Debug, Clone, Copy)]
pub struct TargetInputs<'a> {
    pub nodes: &'a [Node],
    pub vmis: &'a [VirtualMachineInstance],
    /// `spec.addedNodeSelector` of the VMIM.
    pub added_node_selector: Option<&'a BTreeMap<String, String>>,
    pub volume_affinity: &'a [NodeSelector],
    pub shared_mounts: &'a [scheduler::volumes::SharedMountNeed],
    pub opts: &'a SchedulerOptions,
}

/// The CPU feature labels (`cpu-feature.node.kubevirt.io/<flag>`) of `source` that `target`
/// lacks: a running guest may use any feature its node offered, so it can only move to a node
/// offering them all.
pub fn missing_cpu_features(source: &Node, target: &Node) -> Vec<String> {
    const PREFIX: &str = "cpu-feature.node.kubevirt.io/";
    let empty = BTreeMap::new();
    let has = target.metadata.labels.as_ref().unwrap_or(&empty);
    source
        .metadata
        .labels
        .as_ref()
        .unwrap_or(&empty)
        .iter()
        .filter(|(k, v)| k.starts_with(PREFIX) && v.as_str() == "true")
        .filter(|(k, _)| has.get(*k).map(String::as_str) != Some("true"))
        .map(|(k, _)| k.trim_start_matches(PREFIX).to_string())
        .collect()
}

/// KubeVirt's CPU model labels (the agent writes them: `ferrovirt_api::kubevirt::cpu_model`).
pub use ferrovirt_api::kubevirt::cpu_model::{CPU_MODEL_LABEL, HOST_MODEL_LABEL};

/// Why `target` cannot run the guest's CPU model, as KubeVirt decides it (`None`: it can).
/// An explicit `spec.domain.cpu.model` needs the target's `cpu-model.node.kubevirt.io/<model>`
/// label; `host-model` (also the default when no model is given) needs every
/// `host-model-cpu.node.kubevirt.io/*` label of the `source` node (the guest runs the
/// source's host CPU model); `host-passthrough` is left to the feature labels
/// ([`missing_cpu_features`]).
pub fn cpu_model_mismatch(
    vmi: &VirtualMachineInstance,
    source: Option<&Node>,
    target: &Node,
) -> Option<String> {
    let empty = BTreeMap::new();
    let has = target.metadata.labels.as_ref().unwrap_or(&empty);
    let offers = |k: &str| has.get(k).map(String::as_str) == Some("true");
    let model = vmi
        .spec
        .as_ref()
        .and_then(|s| s.domain.cpu.as_ref())
        .and_then(|c| c.model.as_deref())
        .filter(|m| !m.is_empty());
    match model {
        Some("host-passthrough") => None,
        None | Some("host-model") => {
            let labels = source
                .and_then(|s| s.metadata.labels.as_ref())
                .unwrap_or(&empty);
            let missing: Vec<&str> = labels
                .iter()
                .filter(|(k, v)| k.starts_with(HOST_MODEL_LABEL) && v.as_str() == "true")
                .filter(|(k, _)| !offers(k))
                .map(|(k, _)| k.as_str())
                .collect();
            (!missing.is_empty()).then(|| {
                format!(
                    "spec.domain.cpu.model host-model: lacks the source's host CPU model ({})",
                    missing.join(", ")
                )
            })
        }
        Some(m) => {
            let label = format!("{CPU_MODEL_LABEL}{m}");
            (!offers(&label)).then(|| format!("spec.domain.cpu.model {m}: no label {label}"))
        }
    }
}

/// The migration target: the scheduler's filters and scores over every node except the
/// VMI's current one that offers the current node's CPU features ([`missing_cpu_features`])
/// and the guest's CPU model ([`cpu_model_mismatch`]),
/// with the VMIM's `addedNodeSelector` added to the VMI's nodeSelector.
pub fn pick_target(
    vmi: &VirtualMachineInstance,
    inputs: &TargetInputs<'_>,
) -> Result<String, String> {
    let current = vmi.status.as_ref().and_then(|s| s.node_name.as_deref());
    let source = inputs
        .nodes
        .iter()
        .find(|n| n.metadata.name.as_deref() == current);
    let others: Vec<&Node> = inputs
        .nodes
        .iter()
        .filter(|n| n.metadata.name.as_deref() != current)
        .collect();
    if others.is_empty() {
        return Err("there is no other node".into());
    }
    let mut missing = Vec::new();
    let mut model_misfits = Vec::new();
    let others: Vec<&Node> = others
        .into_iter()
        .filter(|n| match cpu_model_mismatch(vmi, source, n) {
            Some(why) => {
                model_misfits.push(format!(
                    "{} {why}",
                    n.metadata.name.as_deref().unwrap_or("?")
                ));
                false
            }
            None => true,
        })
        .collect();
    if others.is_empty() {
        return Err(format!(
            "no other node offers the guest's CPU model: {}",
            model_misfits.join("; ")
        ));
    }
    let nodes: Vec<Node> = others
        .into_iter()
        .filter(|n| match source.map(|s| missing_cpu_features(s, n)) {
            Some(m) if !m.is_empty() => {
                missing.push(format!(
                    "{} lacks {}",
                    n.metadata.name.as_deref().unwrap_or("?"),
                    m.join(", ")
                ));
                false
            }
            _ => true,
        })
        .cloned()
        .collect();
    if nodes.is_empty() {
        return Err(format!(
            "no other node offers the CPU features the guest may use: {}",
            missing.join("; ")
        ));
    }
    let mut want = vmi.clone();
    if let (Some(added), Some(spec)) = (inputs.added_node_selector, want.spec.as_mut()) {
        let sel = spec.node_selector.get_or_insert_default();
        for (k, v) in added {
            sel.insert(k.clone(), v.clone());
        }
    }
    let req = ScheduleRequest {
        vmi: &want,
        nodes: &nodes,
        vmis: inputs.vmis,
        volume_affinity: inputs.volume_affinity,
        shared_mounts: inputs.shared_mounts,
    };
    match scheduler::schedule(&req, inputs.opts) {
        Decision::Bind { node } => Ok(node),
        Decision::Unschedulable(fit) => Err(fit.to_string()),
    }
}
