//! Unit tests of [`super::decide`]: run strategies, state change requests, crash loop,
//! printable status and conditions.

use super::*;
use crate::vm::testutil::{vm, vmi_of};
use ferrovirt_api::kubevirt::vm::RunStrategy::*;

fn ts(s: i64) -> Timestamp {
    Timestamp::from_second(s).unwrap()
}

struct Case<'a> {
    vm: &'a VirtualMachine,
    vmi: Option<&'a VirtualMachineInstance>,
    volumes: VolumeReadiness,
    spec: Result<VirtualMachineInstanceSpec, String>,
    now: i64,
}

fn case<'a>(vm: &'a VirtualMachine, vmi: Option<&'a VirtualMachineInstance>) -> Case<'a> {
    Case {
        vm,
        vmi,
        volumes: VolumeReadiness::Ready,
        spec: Ok(Default::default()),
        now: 1000,
    }
}

fn run(c: Case<'_>) -> VmDecision {
    decide(
        &VmInput {
            vm: c.vm,
            vmi: c.vmi,
            volumes: &c.volumes,
            spec: &c.spec,
            now: ts(c.now),
        },
        &VmOptions::default(),
    )
}

fn go(vm: &VirtualMachine, vmi: Option<&VirtualMachineInstance>) -> VmDecision {
    run(case(vm, vmi))
}

fn printable(d: &VmDecision) -> PrintableStatus {
    d.status.printable_status.unwrap()
}

fn is_create(d: &VmDecision) -> bool {
    matches!(d.action, VmAction::CreateVmi(_))
}

fn is_delete(d: &VmDecision) -> bool {
    matches!(d.action, VmAction::DeleteVmi { .. })
}

fn requests(d: &VmDecision) -> Vec<String> {
    d.status
        .state_change_requests
        .iter()
        .flatten()
        .map(|r| {
            format!(
                "{}{}",
                r.action,
                r.uid
                    .as_deref()
                    .map(|u| format!("({u})"))
                    .unwrap_or_default()
            )
        })
        .collect()
}

fn cond<'a>(d: &'a VmDecision, t: &str) -> Option<&'a Condition> {
    conditions::find(d.status.conditions.as_deref(), t)
}

#[test]
fn running_field_maps_to_strategies() {
    assert_eq!(run_strategy(&vm("a").running(true).build()), Always);
    assert_eq!(run_strategy(&vm("a").running(false).build()), Halted);
    assert_eq!(run_strategy(&vm("a").build()), Halted);
    assert_eq!(
        run_strategy(&vm("a").strategy(Manual).running(true).build()),
        Manual
    );
}

#[test]
fn always_creates_a_vmi() {
    let v = vm("web").strategy(Always).generation(3).build();
    let d = go(&v, None);
    let VmAction::CreateVmi(vmi) = &d.action else {
        panic!("{:?}", d.action)
    };
    assert_eq!(vmi.metadata.name.as_deref(), Some("web"));
    assert_eq!(printable(&d), PrintableStatus::Starting);
    assert_eq!(d.status.created, Some(false));
    assert_eq!(d.status.ready, Some(false));
    assert_eq!(d.status.run_strategy, Some(Always));
    assert_eq!(d.status.desired_generation, Some(3));
    let ready = cond(&d, "Ready").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_deref()),
        ("False", Some("VMINotExists"))
    );
    assert_eq!(d.events[0].reason, REASON_SUCCESSFUL_CREATE);
    assert!(!d.events[0].warning);
}

#[test]
fn running_vmi_is_reported() {
    let v = vm("web").strategy(Always).generation(2).build();
    let vmi = vmi_of(&vm("web").generation(1).build(), "u1", VmiPhase::Running)
        .condition("Ready", "True", "")
        .build();
    let d = go(&v, Some(&vmi));
    assert_eq!(d.action, VmAction::Nothing);
    assert_eq!(printable(&d), PrintableStatus::Running);
    assert_eq!(d.status.ready, Some(true));
    assert_eq!(d.status.created, Some(true));
    assert_eq!(cond(&d, "Ready").unwrap().status, "True");
    assert_eq!(d.status.observed_generation, Some(1));
    assert_eq!(d.status.desired_generation, Some(2));
    assert!(d.events.is_empty());
}

#[test]
fn halted_deletes_and_reports_stopped() {
    let v = vm("a").strategy(Halted).build();
    let vmi = vmi_of(&v, "u1", VmiPhase::Running).build();
    let d = go(&v, Some(&vmi));
    assert_eq!(
        d.action,
        VmAction::DeleteVmi {
            uid: Some("u1".into()),
            grace_period_seconds: None
        }
    );
    assert_eq!(printable(&d), PrintableStatus::Stopping);
    assert_eq!(d.events[0].reason, REASON_SUCCESSFUL_DELETE);
    let d = go(&v, None);
    assert_eq!(d.action, VmAction::Nothing);
    assert_eq!(printable(&d), PrintableStatus::Stopped);
    let v = vm("a").running(false).request("Start", None).build();
    let d = go(&v, None);
    assert!(requests(&d).is_empty());
    assert_eq!(d.events[0].reason, REASON_START_REFUSED);
}

#[test]
fn restart_is_stop_then_start() {
    let v = vm("a")
        .strategy(Manual)
        .request("Stop", Some("u1"))
        .request("Start", None)
        .build();
    let running = vmi_of(&v, "u1", VmiPhase::Running).build();
    let d = go(&v, Some(&running));
    assert!(is_delete(&d));
    assert_eq!(requests(&d), vec!["Stop(u1)", "Start"]);
    assert_eq!(printable(&d), PrintableStatus::Stopping);
    let terminating = vmi_of(&v, "u1", VmiPhase::Running).deleting().build();
    let d = go(&v, Some(&terminating));
    assert_eq!(d.action, VmAction::Nothing);
    assert_eq!(printable(&d), PrintableStatus::Stopping);
    let d = go(&v, None);
    assert!(is_create(&d));
    assert!(requests(&d).is_empty());
    assert_eq!(printable(&d), PrintableStatus::Starting);
}

#[test]
fn stale_stop_requests_are_dropped() {
    let v = vm("a")
        .strategy(Always)
        .request("Stop", Some("old"))
        .build();
    let vmi = vmi_of(&v, "new", VmiPhase::Running).build();
    let d = go(&v, Some(&vmi));
    assert_eq!(d.action, VmAction::Nothing);
    assert!(requests(&d).is_empty());
}

#[test]
fn manual_only_follows_requests() {
    let v = vm("a").strategy(Manual).build();
    let d = go(&v, None);
    assert_eq!(d.action, VmAction::Nothing);
    assert_eq!(printable(&d), PrintableStatus::Stopped);
    let started = vm("a").strategy(Manual).request("Start", None).build();
    assert!(is_create(&go(&started, None)));
    let done = vmi_of(&v, "u1", VmiPhase::Succeeded).build();
    let d = go(&v, Some(&done));
    assert_eq!(d.action, VmAction::Nothing);
    assert_eq!(printable(&d), PrintableStatus::Stopped);
    // Start with a finished VMI: delete it first, keep the Start.
    let d = go(&started, Some(&done));
    assert!(is_delete(&d));
    assert_eq!(requests(&d), vec!["Start"]);
    let stop = vm("a").strategy(Manual).request("Stop", None).build();
    let running = vmi_of(&v, "u1", VmiPhase::Running).build();
    assert!(is_delete(&go(&stop, Some(&running))));
    let d = go(&stop, None);
    assert!(requests(&d).is_empty());
    assert_eq!(printable(&d), PrintableStatus::Stopped);
}

#[test]
fn rerun_on_failure() {
    let fresh = vm("a").strategy(RerunOnFailure).build();
    assert!(is_create(&go(&fresh, None)));
    let seen = vm("a")
        .strategy(RerunOnFailure)
        .observed_strategy(RerunOnFailure)
        .build();
    // Stopped by request earlier: stays stopped.
    assert_eq!(go(&seen, None).action, VmAction::Nothing);
    let ok = vmi_of(&seen, "u1", VmiPhase::Succeeded).build();
    let d = go(&seen, Some(&ok));
    assert_eq!(d.action, VmAction::Nothing);
    assert_eq!(printable(&d), PrintableStatus::Stopped);
    let failed = vmi_of(&seen, "u1", VmiPhase::Failed).build();
    let d = go(&seen, Some(&failed));
    assert!(is_delete(&d));
    assert_eq!(requests(&d), vec!["Start"]);
    assert_eq!(printable(&d), PrintableStatus::CrashLoopBackOff);
}

#[test]
fn once_never_restarts() {
    let fresh = vm("a").strategy(Once).build();
    assert!(is_create(&go(&fresh, None)));
    let seen = vm("a").strategy(Once).observed_strategy(Once).build();
    let failed = vmi_of(&seen, "u1", VmiPhase::Failed).build();
    let d = go(&seen, Some(&failed));
    assert_eq!(d.action, VmAction::Nothing);
    assert_eq!(printable(&d), PrintableStatus::Stopped);
    assert_eq!(go(&seen, None).action, VmAction::Nothing);
}

#[test]
fn crash_loop_backs_off() {
    let v = vm("a").strategy(Always).observed_strategy(Always).build();
    let failed = vmi_of(&v, "u1", VmiPhase::Failed).build();
    let d = run(Case {
        now: 1000,
        ..case(&v, Some(&failed))
    });
    assert!(is_delete(&d));
    assert_eq!(printable(&d), PrintableStatus::CrashLoopBackOff);
    let sf = d.status.start_failure.clone().unwrap();
    assert_eq!(sf.consecutive_fail_count, Some(1));
    assert!(
        d.events
            .iter()
            .any(|e| e.reason == REASON_CRASH_LOOP && e.warning)
    );
    // VMI gone, 4 s later: wait the remaining 6 s.
    let v = vm("a")
        .strategy(Always)
        .start_failure(1, 1010, "u1")
        .build();
    let d = run(Case {
        now: 1004,
        ..case(&v, None)
    });
    assert_eq!(
        d.action,
        VmAction::Wait {
            requeue_after: Duration::from_secs(6)
        }
    );
    assert_eq!(printable(&d), PrintableStatus::CrashLoopBackOff);
    let d = run(Case {
        now: 1010,
        ..case(&v, None)
    });
    assert!(is_create(&d));
    // The history stays until a VMI runs long enough.
    assert_eq!(
        d.status.start_failure.unwrap().consecutive_fail_count,
        Some(1)
    );
}

#[test]
fn node_failure_restarts_without_backoff() {
    let v = vm("a").strategy(Always).build();
    let failed = vmi_of(&v, "u1", VmiPhase::Failed)
        .reason("NodeUnresponsive")
        .build();
    let d = go(&v, Some(&failed));
    assert!(is_delete(&d));
    assert_eq!(d.status.start_failure, None);
    assert_eq!(printable(&d), PrintableStatus::Starting);
    // The event says why the VMI is replaced.
    assert!(
        d.events.iter().any(|e| e.reason == REASON_SUCCESSFUL_DELETE
            && e.message.contains("reason: NodeUnresponsive")),
        "{:?}",
        d.events
    );
    // A launcher that fenced itself is an infrastructure failure too: no back-off.
    let fenced = vmi_of(&v, "u1", VmiPhase::Failed).reason("Fenced").build();
    let d = go(&v, Some(&fenced));
    assert!(is_delete(&d));
    assert_eq!(d.status.start_failure, None);
}

#[test]
fn paused_migrating_unschedulable() {
    let v = vm("a").strategy(Always).build();
    let paused = vmi_of(&v, "u", VmiPhase::Running)
        .condition("Paused", "True", "PausedByUser")
        .build();
    let d = go(&v, Some(&paused));
    assert_eq!(printable(&d), PrintableStatus::Paused);
    assert_eq!(
        cond(&d, "Paused").unwrap().reason.as_deref(),
        Some("PausedByUser")
    );
    // Unpaused: the Paused condition goes away.
    let prev_status = d.status.clone();
    let mut v2 = v.clone();
    v2.status = Some(prev_status);
    let running = vmi_of(&v, "u", VmiPhase::Running).build();
    let d = go(&v2, Some(&running));
    assert!(cond(&d, "Paused").is_none());
    let migrating = vmi_of(&v, "u", VmiPhase::Running).migrating().build();
    assert_eq!(
        printable(&go(&v, Some(&migrating))),
        PrintableStatus::Migrating
    );
    let pending = vmi_of(&v, "u", VmiPhase::Pending)
        .condition("PodScheduled", "False", "Unschedulable")
        .build();
    let d = go(&v, Some(&pending));
    assert_eq!(printable(&d), PrintableStatus::ErrorUnschedulable);
    assert_eq!(cond(&d, "PodScheduled").unwrap().status, "False");
    let scheduled = vmi_of(&v, "u", VmiPhase::Scheduled).build();
    assert_eq!(
        printable(&go(&v, Some(&scheduled))),
        PrintableStatus::Starting
    );
    let unknown = vmi_of(&v, "u", VmiPhase::Unknown).build();
    assert_eq!(printable(&go(&v, Some(&unknown))), PrintableStatus::Unknown);
}

#[test]
fn volumes_gate_the_start() {
    let v = vm("a").strategy(Always).build();
    for (vol, want) in [
        (
            VolumeReadiness::Provisioning("dv".into()),
            PrintableStatus::Provisioning,
        ),
        (
            VolumeReadiness::WaitingForBinding("pvc".into()),
            PrintableStatus::WaitingForVolumeBinding,
        ),
        (
            VolumeReadiness::PvcNotFound("pvc".into()),
            PrintableStatus::ErrorPvcNotFound,
        ),
        (
            VolumeReadiness::DataVolumeError("dv".into()),
            PrintableStatus::DataVolumeError,
        ),
    ] {
        let d = run(Case {
            volumes: vol,
            ..case(&v, None)
        });
        assert_eq!(
            d.action,
            VmAction::Wait {
                requeue_after: RECHECK_AFTER
            }
        );
        assert_eq!(printable(&d), want);
    }
}

#[test]
fn terminating_vm_deletes_its_vmi() {
    let v = vm("a").strategy(Always).deleting().build();
    let vmi = vmi_of(&v, "u", VmiPhase::Running).build();
    let d = go(&v, Some(&vmi));
    assert!(is_delete(&d));
    assert_eq!(printable(&d), PrintableStatus::Terminating);
    assert_eq!(go(&v, None).action, VmAction::Nothing);
}

#[test]
fn orphaning_vm_leaves_its_vmi() {
    let mut v = vm("a").strategy(Always).deleting().build();
    v.metadata.finalizers = Some(vec!["orphan".into()]);
    let vmi = vmi_of(&v, "u", VmiPhase::Running).build();
    assert_eq!(go(&v, Some(&vmi)).action, VmAction::Nothing);
}

#[test]
fn expansion_errors_set_failure() {
    let v = vm("a").strategy(Always).build();
    let d = run(Case {
        spec: Err("instancetype u1.small not found".into()),
        ..case(&v, None)
    });
    assert!(matches!(d.action, VmAction::Wait { .. }));
    let f = cond(&d, "Failure").unwrap();
    assert_eq!(f.status, "True");
    assert_eq!(f.reason.as_deref(), Some(REASON_FAILED_CREATE));
    assert!(
        d.events
            .iter()
            .any(|e| e.warning && e.message.contains("u1.small"))
    );
    // Once it works, Failure is removed.
    let mut v2 = v.clone();
    v2.status = Some(d.status.clone());
    let d = go(&v2, None);
    assert!(cond(&d, "Failure").is_none());
}

#[test]
fn failed_actions_keep_requests() {
    let v = vm("a").strategy(Manual).request("Start", None).build();
    let d = go(&v, None);
    assert!(requests(&d).is_empty());
    let (status, event) = d.action_failed(v.status.as_ref(), "boom", ts(5));
    assert_eq!(status.state_change_requests.unwrap().len(), 1);
    assert_eq!(status.run_strategy, None);
    let f = conditions::find(status.conditions.as_deref(), "Failure").unwrap();
    assert_eq!(f.message.as_deref(), Some("boom"));
    assert_eq!(event.reason, REASON_FAILED_CREATE);
}

#[test]
fn held_back_first_start_is_not_forgotten() {
    let v = vm("a").strategy(RerunOnFailure).build();
    let d = run(Case {
        volumes: VolumeReadiness::Provisioning("dv".into()),
        ..case(&v, None)
    });
    assert!(matches!(d.action, VmAction::Wait { .. }));
    assert_eq!(d.status.run_strategy, None);
    let mut v2 = v.clone();
    v2.status = Some(d.status);
    assert!(is_create(&go(&v2, None)));
}

#[test]
fn a_snapshot_or_restore_in_progress_holds_the_vm_stopped() {
    for mark in ["snapshot", "restore"] {
        let mut v = vm("vm1").strategy(Always).build();
        let st = v.status.get_or_insert_with(Default::default);
        if mark == "snapshot" {
            st.snapshot_in_progress = Some("snap1".into());
        } else {
            st.restore_in_progress = Some("restore1".into());
        }
        assert!(!is_create(&go(&v, None)), "{mark} in progress");
        v.status = None;
        assert!(is_create(&go(&v, None)));
    }
}
