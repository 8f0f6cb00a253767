//! Unit tests of [`super`]: lease expiry, conditions, taints, VMI failure and eviction.

use super::*;
use crate::scheduler::testutil::{node, vmi};
use ferrovirt_api::fencing::VmiFencing;
use ferrovirt_api::kubevirt::volumes::{DataVolumeSource, HostDiskSource, PvcVolumeSource, Volume};
use k8s_openapi::api::coordination::v1::LeaseSpec;
use k8s_openapi::api::core::v1::Toleration;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

fn ts(s: i64) -> Timestamp {
    Timestamp::from_second(s).unwrap()
}

fn lease(renew: i64, duration: Option<i32>) -> Lease {
    Lease {
        spec: Some(LeaseSpec {
            renew_time: Some(MicroTime(ts(renew))),
            lease_duration_seconds: duration,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn opts() -> NodeLifecycleOptions {
    NodeLifecycleOptions::default()
}

#[test]
fn fresh_lease_keeps_ready() {
    let n = node("n1").build();
    let d = decide_node(&n, Some(&lease(100, Some(15))), ts(110), &opts());
    assert_eq!(d.health, NodeHealth::Ready);
    assert_eq!(d.ready_condition, None);
    assert_eq!(d.taints, None);
    assert!(!d.fail_vmis);
    assert_eq!(d.requeue_after, Duration::from_secs(5));
}

#[test]
fn stale_lease_turns_unknown_then_fails_vmis() {
    let n = node("n1").build();
    let l = lease(100, Some(15));
    let d = decide_node(&n, Some(&l), ts(116), &opts());
    assert_eq!(d.health, NodeHealth::Unknown);
    let c = d.ready_condition.clone().unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_deref()),
        ("Unknown", Some("NodeStatusUnknown"))
    );
    let taints = d.taints.clone().unwrap();
    assert_eq!(taints.len(), 2);
    assert!(taints.iter().all(|t| t.key == TAINT_UNREACHABLE));
    assert!(!d.fail_vmis);
    // It wakes exactly at the fence deadline plus the margin: 100 + 15 + 4.
    assert_eq!(d.requeue_after, Duration::from_secs(3));
    assert_eq!(d.timeline.fence_deadline, ts(115));
    assert_eq!(d.timeline.replace_at, ts(119));
    let d = decide_node(&n, Some(&l), ts(118), &opts());
    assert!(!d.fail_vmis, "before the margin has passed");
    let d = decide_node(&n, Some(&l), ts(119), &opts());
    assert!(d.fail_vmis);
    // A node already marked Unknown is not rewritten.
    let unknown = node("n1")
        .ready("Unknown")
        .taint(TAINT_UNREACHABLE, "", "NoSchedule")
        .build();
    let d = decide_node(&unknown, Some(&l), ts(140), &opts());
    assert_eq!(d.ready_condition, None);
}

#[test]
fn recovers_when_the_lease_is_renewed() {
    let unknown = node("n1")
        .ready("Unknown")
        .taint(TAINT_UNREACHABLE, "", "NoSchedule")
        .taint(TAINT_UNREACHABLE, "", "NoExecute")
        .taint("user", "x", "NoSchedule")
        .build();
    let d = decide_node(&unknown, Some(&lease(200, None)), ts(201), &opts());
    assert_eq!(d.health, NodeHealth::Ready);
    assert_eq!(d.ready_condition.unwrap().status, "True");
    let taints = d.taints.unwrap();
    assert_eq!(taints.len(), 1);
    assert_eq!(taints[0].key, "user");
}

#[test]
fn not_ready_and_cordoned_taints() {
    let n = node("n1").ready("False").unschedulable().build();
    let d = decide_node(&n, Some(&lease(100, None)), ts(101), &opts());
    assert_eq!(d.health, NodeHealth::NotReady);
    let keys: Vec<_> = d
        .taints
        .unwrap()
        .iter()
        .map(|t| format!("{}:{}", t.key, t.effect))
        .collect();
    assert_eq!(
        keys,
        vec![
            "node.kubernetes.io/not-ready:NoSchedule",
            "node.kubernetes.io/not-ready:NoExecute",
            "node.kubernetes.io/unschedulable:NoSchedule"
        ]
    );
    assert!(!decide_node(&n, Some(&lease(100, None)), ts(101), &opts()).fail_vmis);
}

#[test]
fn no_lease_uses_heartbeat_or_creation() {
    let mut n = node("n1").build();
    n.metadata.creation_timestamp = Some(Time(ts(0)));
    assert_eq!(last_heartbeat(&n, None), Some(ts(0)));
    assert_eq!(
        decide_node(&n, None, ts(100), &opts()).health,
        NodeHealth::Unknown
    );
}

fn pvc(name: &str) -> Volume {
    Volume {
        name: name.into(),
        persistent_volume_claim: Some(PvcVolumeSource {
            claim_name: name.into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn disk_locality() {
    let mut v = vmi("v").build();
    assert!(can_run_elsewhere(&v, |_| None));
    let spec = v.spec.as_mut().unwrap();
    spec.volumes = Some(vec![
        pvc("shared"),
        Volume {
            name: "dv".into(),
            data_volume: Some(DataVolumeSource {
                name: "dv".into(),
                hotpluggable: None,
            }),
            ..Default::default()
        },
    ]);
    let rwx = |_: &str| Some(vec!["ReadWriteMany".to_string()]);
    assert!(can_run_elsewhere(&v, rwx));
    let mixed = |c: &str| {
        Some(vec![
            if c == "dv" {
                "ReadWriteOnce"
            } else {
                "ReadWriteMany"
            }
            .to_string(),
        ])
    };
    assert!(!can_run_elsewhere(&v, mixed));
    assert!(!can_run_elsewhere(&v, |_| None));
    let mut h = vmi("h").build();
    h.spec.as_mut().unwrap().volumes = Some(vec![Volume {
        name: "h".into(),
        host_disk: Some(HostDiskSource {
            path: "/x".into(),
            type_: "Disk".into(),
            ..Default::default()
        }),
        ..Default::default()
    }]);
    assert!(!can_run_elsewhere(&h, |_| None));
}

#[test]
fn vmis_on_dead_nodes() {
    let n = node("n1").build();
    let d = decide_node(&n, Some(&lease(0, None)), ts(100), &opts());
    assert!(d.fail_vmis);
    let running = vmi("v").bound("n1", VmiPhase::Running).build();
    // A self-fencing launcher: replaced, with a Fenced event naming the deadline.
    match decide_vmi(&running, &n, &d, VmiFencing::Enabled, ts(100)) {
        VmiNodeAction::Fail {
            reason,
            fenced: Some(fenced),
            ..
        } => {
            assert_eq!(reason, REASON_NODE_UNRESPONSIVE);
            assert!(fenced.contains("by 1970-01-01T00:00:16Z"), "{fenced}");
            assert!(
                fenced.contains("renewed at 1970-01-01T00:00:00Z"),
                "{fenced}"
            );
        }
        other => panic!("{other:?}"),
    }
    // A launcher that never fences (node-local disks, Manual): Unknown, never replaced.
    assert!(matches!(
        decide_vmi(&running, &n, &d, VmiFencing::Disabled, ts(100)),
        VmiNodeAction::MarkUnknown { .. }
    ));
    // Nothing announced but Running (an agent that predates fencing): never replaced.
    assert!(matches!(
        decide_vmi(&running, &n, &d, VmiFencing::Unannounced, ts(100)),
        VmiNodeAction::MarkUnknown { .. }
    ));
    // Nothing announced and never started: nothing can run there, replace it.
    let scheduled = vmi("v").bound("n1", VmiPhase::Scheduled).build();
    assert!(matches!(
        decide_vmi(&scheduled, &n, &d, VmiFencing::Unannounced, ts(100)),
        VmiNodeAction::Fail { fenced: None, .. }
    ));
    assert!(matches!(
        decide_vmi(&scheduled, &n, &d, VmiFencing::Disabled, ts(100)),
        VmiNodeAction::MarkUnknown { .. }
    ));
    let unknown = vmi("v").bound("n1", VmiPhase::Unknown).build();
    assert_eq!(
        decide_vmi(&unknown, &n, &d, VmiFencing::Disabled, ts(100)),
        VmiNodeAction::None
    );
    let done = vmi("v").bound("n1", VmiPhase::Succeeded).build();
    assert_eq!(
        decide_vmi(&done, &n, &d, VmiFencing::Enabled, ts(100)),
        VmiNodeAction::None
    );
}

#[test]
fn never_replaced_before_the_fence_deadline_plus_margin() {
    // Property over a range of lease durations, margins and times: whenever the decision
    // says fail, the launchers' deadline (renewTime + lease) lies at least the margin behind.
    let n = node("n1").build();
    for duration in [4, 8, 15, 40] {
        for margin in [2u64, 4, 10] {
            let o = NodeLifecycleOptions {
                fence_margin: Duration::from_secs(margin),
                ..opts()
            };
            let l = lease(1000, Some(duration));
            for t in 1000..1100 {
                let d = decide_node(&n, Some(&l), ts(t), &o);
                let deadline = 1000 + i64::from(duration);
                let margin = i64::try_from(margin).unwrap();
                assert_eq!(
                    d.fail_vmis,
                    t >= deadline + margin,
                    "{duration} {margin} {t}"
                );
                let running = vmi("v").bound("n1", VmiPhase::Running).build();
                let action = decide_vmi(&running, &n, &d, VmiFencing::Enabled, ts(t));
                assert_eq!(
                    matches!(action, VmiNodeAction::Fail { .. }),
                    t >= deadline + margin
                );
            }
        }
    }
    // The default timing reaches a replacement 20 s after the last renewal.
    let d = decide_node(&n, Some(&lease(0, Some(16))), ts(20), &opts());
    assert!(d.fail_vmis);
    assert!(!decide_node(&n, Some(&lease(0, Some(16))), ts(19), &opts()).fail_vmis);
}

#[test]
fn no_execute_taints_evict() {
    let mut n = node("n1").taint("maintenance", "", "NoExecute").build();
    n.spec.as_mut().unwrap().taints.as_mut().unwrap()[0].time_added = Some(Time(ts(100)));
    let d = decide_node(&n, Some(&lease(100, None)), ts(101), &opts());
    let plain = vmi("v").bound("n1", VmiPhase::Running).build();
    assert!(matches!(
        decide_vmi(&plain, &n, &d, VmiFencing::Enabled, ts(101)),
        VmiNodeAction::Evict { .. }
    ));
    let tol = |secs: Option<i64>| {
        vmi("v")
            .bound("n1", VmiPhase::Running)
            .toleration(Toleration {
                key: Some("maintenance".into()),
                operator: Some("Exists".into()),
                effect: Some("NoExecute".into()),
                toleration_seconds: secs,
                value: None,
            })
            .build()
    };
    assert_eq!(
        decide_vmi(&tol(None), &n, &d, VmiFencing::Enabled, ts(101)),
        VmiNodeAction::None
    );
    assert_eq!(
        decide_vmi(&tol(Some(60)), &n, &d, VmiFencing::Enabled, ts(150)),
        VmiNodeAction::None
    );
    assert!(matches!(
        decide_vmi(&tol(Some(60)), &n, &d, VmiFencing::Enabled, ts(160)),
        VmiNodeAction::Evict { .. }
    ));
    // Health taints do not evict on their own.
    let unreachable = node("n1").taint(TAINT_UNREACHABLE, "", "NoExecute").build();
    let d = decide_node(&unreachable, Some(&lease(100, None)), ts(101), &opts());
    assert_eq!(
        decide_vmi(&plain, &unreachable, &d, VmiFencing::Enabled, ts(101)),
        VmiNodeAction::None
    );
}
