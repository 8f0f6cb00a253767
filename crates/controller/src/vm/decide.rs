//! The VirtualMachine reconcile decision, a pure function of the VM, its VMI (if any), the
//! readiness of its volumes, its expanded template and the time: one [`VmAction`] plus the
//! `status` to write and the Events to emit.
//!
//! Run strategies (KubeVirt's documented semantics):
//! - `Always` (`running: true`): a VMI always exists; a finished one is replaced.
//! - `RerunOnFailure`: started once; a Failed VMI is replaced, a Succeeded one is not.
//! - `Manual`: only `Start`/`Stop` state change requests start or stop it.
//! - `Halted` (`running: false`, or neither set): no VMI; an existing one is deleted.
//! - `Once`: started once; never replaced, whatever the outcome.
//!
//! State change requests (`status.stateChangeRequests`, appended by the start/stop/restart
//! subresources): `Stop` (optionally with the uid of the VMI to stop) deletes that VMI and is
//! dropped once it is gone; `Start` creates a VMI and is dropped once created. A restart is
//! `[Stop(uid), Start]`: Stopping, then Starting with a new VMI uid. Requests are processed in
//! order: a Start never runs before an earlier Stop is done.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use ferrovirt_api::kubevirt::vm::{
    PrintableStatus, RunStrategy, StateChangeRequest, VirtualMachine, VirtualMachineStatus,
    vm_condition,
};
use ferrovirt_api::kubevirt::vmi::{
    Condition, VirtualMachineInstance, VirtualMachineInstanceSpec, VmiPhase, vmi_condition,
};

use super::backoff::{self, BackoffOptions};
use super::template::{ANNOTATION_VM_GENERATION, build_vmi};
use crate::conditions;

/// How long to wait before looking again at volumes that are not ready, or at a template
/// that failed to expand (its instancetype may appear later).
pub const RECHECK_AFTER: Duration = Duration::from_secs(5);

/// Tunables of the VM decision.
#[derive(Debug, Clone, Default)]
pub struct VmOptions {
    pub backoff: BackoffOptions,
}

/// Whether the VM's volumes allow a VMI to start, aggregated over PVCs and DataVolumes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum VolumeReadiness {
    /// Every claim exists and is bound (or binds on first consumer).
    #[default]
    Ready,
    /// A DataVolume is still importing/cloning.
    Provisioning(String),
    /// A claim waits for a volume to bind.
    WaitingForBinding(String),
    /// A referenced claim does not exist.
    PvcNotFound(String),
    /// A DataVolume failed.
    DataVolumeError(String),
}

/// Everything the decision looks at.
#[derive(Debug, Clone, Copy)]
pub struct VmInput<'a> {
    pub vm: &'a VirtualMachine,
    /// The VMI named like the VM and controlled by it, if any.
    pub vmi: Option<&'a VirtualMachineInstance>,
    pub volumes: &'a VolumeReadiness,
    /// The template spec expanded with instancetype/preference, or why that failed.
    pub spec: &'a Result<VirtualMachineInstanceSpec, String>,
    pub now: Timestamp,
}

/// The one thing to do.
#[derive(Debug, Clone, PartialEq)]
pub enum VmAction {
    /// Create this VMI.
    CreateVmi(Box<VirtualMachineInstance>),
    /// Delete the VMI (precondition: this uid) with this grace period.
    DeleteVmi {
        uid: Option<String>,
        grace_period_seconds: Option<i64>,
    },
    /// Nothing now; look again after this long.
    Wait { requeue_after: Duration },
    /// Nothing to do until something changes.
    Nothing,
}

/// A core/v1 Event to emit about the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmEvent {
    /// `Warning` rather than `Normal`.
    pub warning: bool,
    pub reason: String,
    pub message: String,
}

impl VmEvent {
    fn normal(reason: &str, message: String) -> Self {
        Self {
            warning: false,
            reason: reason.into(),
            message,
        }
    }
    fn warning(reason: &str, message: String) -> Self {
        Self {
            warning: true,
            reason: reason.into(),
            message,
        }
    }
}

/// The decision: an action, the status to write, and Events. Events describing the action
/// are to be emitted only once it succeeded; on failure use [`VmDecision::action_failed`].
#[derive(Debug, Clone, PartialEq)]
pub struct VmDecision {
    pub action: VmAction,
    pub status: VirtualMachineStatus,
    pub events: Vec<VmEvent>,
}

/// Event reasons.
pub const REASON_SUCCESSFUL_CREATE: &str = "SuccessfulCreate";
pub const REASON_SUCCESSFUL_DELETE: &str = "SuccessfulDelete";
pub const REASON_FAILED_CREATE: &str = "FailedCreate";
pub const REASON_FAILED_DELETE: &str = "FailedDelete";
pub const REASON_CRASH_LOOP: &str = "CrashLoopBackOff";
pub const REASON_START_REFUSED: &str = "FailedStart";

/// The effective run strategy: `spec.runStrategy`, else `running` (true → Always, false →
/// Halted), else Halted.
pub fn run_strategy(vm: &VirtualMachine) -> RunStrategy {
    let spec = vm.spec.as_ref();
    spec.and_then(|s| s.run_strategy)
        .or_else(|| {
            spec.and_then(|s| s.running).map(|r| {
                if r {
                    RunStrategy::Always
                } else {
                    RunStrategy::Halted
                }
            })
        })
        .unwrap_or(RunStrategy::Halted)
}

fn phase(vmi: &VirtualMachineInstance) -> VmiPhase {
    vmi.status
        .as_ref()
        .and_then(|s| s.phase)
        .unwrap_or(VmiPhase::Unset)
}

fn is_final(vmi: &VirtualMachineInstance) -> bool {
    matches!(phase(vmi), VmiPhase::Succeeded | VmiPhase::Failed)
}

fn vmi_conditions(vmi: &VirtualMachineInstance) -> Option<&[Condition]> {
    vmi.status.as_ref().and_then(|s| s.conditions.as_deref())
}

fn delete(vmi: &VirtualMachineInstance) -> VmAction {
    VmAction::DeleteVmi {
        uid: vmi.metadata.uid.clone(),
        grace_period_seconds: vmi
            .spec
            .as_ref()
            .and_then(|s| s.termination_grace_period_seconds),
    }
}

/// Whether the VM wants a VMI running, after state change requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Desire {
    /// Have an active VMI (replacing a finished one).
    Run,
    /// Have no VMI at all.
    Remove,
    /// Leave whatever is there.
    Keep,
}

fn desire(
    strategy: RunStrategy,
    vmi: Option<&VirtualMachineInstance>,
    start: bool,
    first: bool,
) -> Desire {
    let ph = vmi.map(phase);
    match strategy {
        RunStrategy::Always => Desire::Run,
        RunStrategy::Halted => Desire::Remove,
        RunStrategy::RerunOnFailure => match ph {
            None => {
                if start || first {
                    Desire::Run
                } else {
                    Desire::Keep
                }
            }
            Some(VmiPhase::Succeeded) => {
                if start {
                    Desire::Run
                } else {
                    Desire::Keep
                }
            }
            Some(_) => Desire::Run,
        },
        RunStrategy::Manual => {
            if start {
                Desire::Run
            } else {
                Desire::Keep
            }
        }
        RunStrategy::Once => match ph {
            None if start || first => Desire::Run,
            Some(VmiPhase::Succeeded | VmiPhase::Failed) if start => Desire::Run,
            _ => Desire::Keep,
        },
        RunStrategy::WaitAsReceiver => Desire::Keep,
    }
}

/// Decide what to do for a VM. See the module docs for the semantics.
pub fn decide(input: &VmInput<'_>, opts: &VmOptions) -> VmDecision {
    let vm = input.vm;
    let vm_name = vm.metadata.name.as_deref().unwrap_or("");
    let prev = vm.status.clone().unwrap_or_default();
    let strategy = run_strategy(vm);
    let mut requests: Vec<StateChangeRequest> =
        prev.state_change_requests.clone().unwrap_or_default();
    let mut events = Vec::new();
    let vmi = input.vmi;
    let vmi_deleting = vmi.is_some_and(|v| v.metadata.deletion_timestamp.is_some());

    let tracked = backoff::track(prev.start_failure.as_ref(), vmi, input.now, &opts.backoff);
    if let Some((count, wait)) = tracked.new_failure {
        events.push(VmEvent::warning(
            REASON_CRASH_LOOP,
            format!(
                "VMI {} failed ({count} consecutive failure(s)); next start in {}s",
                vmi.and_then(|v| v.metadata.uid.as_deref()).unwrap_or(""),
                wait.as_secs()
            ),
        ));
    }
    let auto_restart = matches!(strategy, RunStrategy::Always | RunStrategy::RerunOnFailure);
    let backoff_left = if auto_restart {
        backoff::remaining(tracked.start_failure.as_ref(), input.now)
    } else {
        None
    };
    let mut sync_error: Option<(String, String)> = None;
    let mut wants_run = false;

    let action = if vm.metadata.deletion_timestamp.is_some() {
        match vmi {
            // `propagationPolicy: Orphan`: the VMI stays.
            Some(v) if !vmi_deleting && !super::finalize::orphaning(vm) => delete(v),
            _ => VmAction::Nothing,
        }
    } else {
        // Stop requests come first, in order.
        let mut stop_action = None;
        while let Some(i) = requests.iter().position(|r| r.action == "Stop") {
            let targets = vmi.is_some_and(|v| {
                requests[i]
                    .uid
                    .as_deref()
                    .is_none_or(|u| Some(u) == v.metadata.uid.as_deref())
            });
            match vmi {
                Some(v) if targets => {
                    stop_action = Some(if vmi_deleting {
                        VmAction::Nothing
                    } else {
                        delete(v)
                    });
                    break;
                }
                _ => {
                    requests.remove(i);
                }
            }
        }
        if let Some(a) = stop_action {
            a
        } else {
            let start = requests.iter().any(|r| r.action == "Start");
            let first = prev.run_strategy != Some(strategy);
            match desire(strategy, vmi, start, first) {
                Desire::Remove => {
                    if start {
                        events.push(VmEvent::warning(
                            REASON_START_REFUSED,
                            "Start request ignored: runStrategy is Halted".into(),
                        ));
                        requests.retain(|r| r.action != "Start");
                    }
                    match vmi {
                        Some(v) if !vmi_deleting => delete(v),
                        _ => VmAction::Nothing,
                    }
                }
                Desire::Keep => VmAction::Nothing,
                Desire::Run => {
                    wants_run = true;
                    match vmi {
                        Some(_) if vmi_deleting => VmAction::Nothing,
                        Some(v) if is_final(v) => {
                            // Replace it: remember to start once it is gone.
                            if !start {
                                requests.push(StateChangeRequest {
                                    action: "Start".into(),
                                    data: None,
                                    uid: None,
                                });
                            }
                            delete(v)
                        }
                        Some(_) => {
                            requests.retain(|r| r.action != "Start");
                            VmAction::Nothing
                        }
                        None if *input.volumes != VolumeReadiness::Ready => VmAction::Wait {
                            requeue_after: RECHECK_AFTER,
                        },
                        // A snapshot or restore holds the VM stopped (KubeVirt's
                        // `status.snapshotInProgress` / `restoreInProgress`).
                        None if prev.snapshot_in_progress.is_some()
                            || prev.restore_in_progress.is_some() =>
                        {
                            VmAction::Wait {
                                requeue_after: RECHECK_AFTER,
                            }
                        }
                        None if backoff_left.is_some() => VmAction::Wait {
                            requeue_after: backoff_left.unwrap_or_default(),
                        },
                        None => match input.spec {
                            Ok(spec) => {
                                requests.retain(|r| r.action != "Start");
                                VmAction::CreateVmi(Box::new(build_vmi(vm, spec.clone())))
                            }
                            Err(e) => {
                                sync_error = Some((REASON_FAILED_CREATE.into(), e.clone()));
                                events.push(VmEvent::warning(
                                    REASON_FAILED_CREATE,
                                    format!("Error creating VirtualMachineInstance {vm_name}: {e}"),
                                ));
                                VmAction::Wait {
                                    requeue_after: RECHECK_AFTER,
                                }
                            }
                        },
                    }
                }
            }
        }
    };

    match &action {
        VmAction::CreateVmi(_) => events.push(VmEvent::normal(
            REASON_SUCCESSFUL_CREATE,
            format!(
                "Started the virtual machine by creating the new virtual machine instance {vm_name}"
            ),
        )),
        VmAction::DeleteVmi { uid, .. } => {
            let uid = uid.as_deref().unwrap_or(vm_name);
            // A failed VMI is deleted to be replaced: say why it failed (e.g. NodeUnresponsive
            // after its node's launcher fenced it, docs/fencing.md).
            let failed = vmi
                .and_then(|v| v.status.as_ref())
                .filter(|s| s.phase == Some(VmiPhase::Failed))
                .and_then(|s| s.reason.clone());
            let message = match failed {
                Some(reason) if auto_restart => format!(
                    "Deleted the failed virtual machine instance {uid} (reason: {reason}) to \
                     start a new one"
                ),
                _ => format!(
                    "Stopped the virtual machine by deleting the virtual machine instance {uid}"
                ),
            };
            events.push(VmEvent::normal(REASON_SUCCESSFUL_DELETE, message));
        }
        _ => {}
    }

    let printable = printable_status(&PrintableInput {
        vm,
        vmi,
        action: &action,
        volumes: input.volumes,
        wants_run,
        backoff_active: backoff_left.is_some(),
        strategy,
    });
    let now = Time(input.now);
    let mut conds = prev.conditions.clone().unwrap_or_default();
    sync_conditions(&mut conds, vmi, sync_error.as_ref(), &now);
    let ready = vmi.is_some_and(|v| {
        phase(v) == VmiPhase::Running
            && conditions::is_true(vmi_conditions(v), vmi_condition::READY)
    });
    let observed_generation = vmi
        .and_then(|v| v.metadata.annotations.as_ref())
        .and_then(|a| a.get(ANNOTATION_VM_GENERATION))
        .and_then(|g| g.parse().ok())
        .or(prev.observed_generation)
        .or(vm.metadata.generation);
    // The strategy counts as acted upon (see `first`) unless a wanted start is still held
    // back (volumes, back-off, template errors).
    let run_strategy = if wants_run && matches!(action, VmAction::Wait { .. }) {
        prev.run_strategy
    } else {
        Some(strategy)
    };
    let status = VirtualMachineStatus {
        created: Some(vmi.is_some()),
        ready: Some(ready),
        printable_status: Some(printable),
        conditions: Some(conds),
        state_change_requests: (!requests.is_empty()).then_some(requests),
        start_failure: tracked.start_failure,
        observed_generation,
        desired_generation: vm.metadata.generation,
        run_strategy,
        ..prev
    };
    VmDecision {
        action,
        status,
        events,
    }
}

impl VmDecision {
    /// The status to write when the action failed with `message`: the previous state change
    /// requests and observed run strategy (so the next attempt retries), and a Failure
    /// condition; plus a Warning Event.
    pub fn action_failed(
        &self,
        prev: Option<&VirtualMachineStatus>,
        message: &str,
        now: Timestamp,
    ) -> (VirtualMachineStatus, VmEvent) {
        let reason = match self.action {
            VmAction::DeleteVmi { .. } => REASON_FAILED_DELETE,
            _ => REASON_FAILED_CREATE,
        };
        let mut status = self.status.clone();
        status.state_change_requests = prev.and_then(|p| p.state_change_requests.clone());
        status.run_strategy = prev.and_then(|p| p.run_strategy);
        let conds = status.conditions.get_or_insert_default();
        conditions::set(
            conds,
            conditions::condition(vm_condition::FAILURE, true, Some(reason), Some(message)),
            &Time(now),
        );
        (status, VmEvent::warning(reason, message.to_string()))
    }
}

/// Ready mirrors the VMI's Ready condition; Failure reflects a sync error; every other VMI
/// condition (Paused, PodScheduled, AgentConnected, …) is copied, and dropped when the VMI
/// no longer has it.
fn sync_conditions(
    conds: &mut Vec<Condition>,
    vmi: Option<&VirtualMachineInstance>,
    sync_error: Option<&(String, String)>,
    now: &Time,
) {
    let ready = match vmi {
        None => conditions::condition(
            vm_condition::READY,
            false,
            Some("VMINotExists"),
            Some("VMI does not exist"),
        ),
        Some(v) => match conditions::find(vmi_conditions(v), vmi_condition::READY) {
            Some(c) => c.clone(),
            None => conditions::condition(
                vm_condition::READY,
                false,
                Some("VMIConditionMissing"),
                Some("VMI is missing the Ready condition"),
            ),
        },
    };
    let copied_time = ready.last_transition_time.clone();
    conditions::set(conds, ready, now);
    if let Some(t) = copied_time
        && let Some(c) = conds.iter_mut().find(|c| c.type_ == vm_condition::READY)
    {
        c.last_transition_time = Some(t);
    }
    match sync_error {
        Some((reason, message)) => conditions::set(
            conds,
            conditions::condition(vm_condition::FAILURE, true, Some(reason), Some(message)),
            now,
        ),
        None => conditions::remove(conds, vm_condition::FAILURE),
    }
    let from_vmi: Vec<Condition> = vmi
        .and_then(vmi_conditions)
        .unwrap_or_default()
        .iter()
        .filter(|c| c.type_ != vm_condition::READY && c.type_ != vm_condition::FAILURE)
        .cloned()
        .collect();
    conds.retain(|c| {
        c.type_ == vm_condition::READY
            || c.type_ == vm_condition::FAILURE
            || from_vmi.iter().any(|v| v.type_ == c.type_)
    });
    for c in from_vmi {
        match conds.iter_mut().find(|x| x.type_ == c.type_) {
            Some(x) => *x = c,
            None => conds.push(c),
        }
    }
}

struct PrintableInput<'a> {
    vm: &'a VirtualMachine,
    vmi: Option<&'a VirtualMachineInstance>,
    action: &'a VmAction,
    volumes: &'a VolumeReadiness,
    wants_run: bool,
    backoff_active: bool,
    strategy: RunStrategy,
}

fn is_migrating(vmi: &VirtualMachineInstance) -> bool {
    vmi.status
        .as_ref()
        .and_then(|s| s.migration_state.as_ref())
        .is_some_and(|m| {
            m.start_timestamp.is_some() && m.completed != Some(true) && m.failed != Some(true)
        })
}

fn is_unschedulable(vmi: &VirtualMachineInstance) -> bool {
    conditions::find(vmi_conditions(vmi), vmi_condition::POD_SCHEDULED)
        .is_some_and(|c| c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
}

fn volume_status(v: &VolumeReadiness) -> Option<PrintableStatus> {
    match v {
        VolumeReadiness::Ready => None,
        VolumeReadiness::Provisioning(_) => Some(PrintableStatus::Provisioning),
        VolumeReadiness::WaitingForBinding(_) => Some(PrintableStatus::WaitingForVolumeBinding),
        VolumeReadiness::PvcNotFound(_) => Some(PrintableStatus::ErrorPvcNotFound),
        VolumeReadiness::DataVolumeError(_) => Some(PrintableStatus::DataVolumeError),
    }
}

/// `printableStatus`, first match wins: Terminating, Stopping, Migrating, Paused, Running,
/// Unknown, ErrorUnschedulable, volume states, CrashLoopBackOff, Starting, Stopped.
fn printable_status(p: &PrintableInput<'_>) -> PrintableStatus {
    if p.vm.metadata.deletion_timestamp.is_some() {
        return PrintableStatus::Terminating;
    }
    let active = p.vmi.filter(|v| !is_final(v));
    if let Some(v) = active {
        let deleting = v.metadata.deletion_timestamp.is_some()
            || matches!(p.action, VmAction::DeleteVmi { .. });
        if deleting {
            return PrintableStatus::Stopping;
        }
        return match phase(v) {
            VmiPhase::Running if is_migrating(v) => PrintableStatus::Migrating,
            VmiPhase::Running if conditions::is_true(vmi_conditions(v), vmi_condition::PAUSED) => {
                PrintableStatus::Paused
            }
            VmiPhase::Running => PrintableStatus::Running,
            VmiPhase::Unknown => PrintableStatus::Unknown,
            _ if is_unschedulable(v) => PrintableStatus::ErrorUnschedulable,
            _ => volume_status(p.volumes).unwrap_or(PrintableStatus::Starting),
        };
    }
    // No VMI, or a finished one.
    if p.wants_run {
        if let Some(s) = volume_status(p.volumes) {
            return s;
        }
        if p.backoff_active {
            return PrintableStatus::CrashLoopBackOff;
        }
        return PrintableStatus::Starting;
    }
    if p.strategy == RunStrategy::WaitAsReceiver {
        return PrintableStatus::WaitingForReceiver;
    }
    PrintableStatus::Stopped
}

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;
