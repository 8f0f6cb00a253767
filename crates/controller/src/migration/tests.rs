//! Unit tests of the migration controller's decisions.

use serde_json::json;

use super::*;
use crate::scheduler::testutil::node;

const NOW: Now<'static> = Now {
    rfc3339: "2026-01-01T00:01:00Z",
    epoch_secs: 1_767_225_660,
};

fn vmim(phase: Option<&str>) -> VirtualMachineInstanceMigration {
    let mut v = json!({"metadata": {"name": "m", "namespace": "default", "uid": "mig-1"},
        "spec": {"vmiName": "vm"}});
    if let Some(p) = phase {
        v["status"] = json!({"phase": p, "phaseTransitionTimestamps": [
            {"phase": p, "phaseTransitionTimestamp": "2026-01-01T00:00:30Z"}]});
    }
    serde_json::from_value(v).unwrap()
}

fn vmi(state: serde_json::Value) -> VirtualMachineInstance {
    serde_json::from_value(json!({"metadata": {"name": "vm", "namespace": "default"},
        "spec": {"domain": {}},
        "status": {"phase": "Running", "nodeName": "node1", "migrationState": state}}))
    .unwrap()
}

fn no_pick(_: &VirtualMachineInstance) -> Result<Chosen, String> {
    panic!("no target is needed in this step")
}

fn to(node: &str) -> Result<Chosen, String> {
    Ok(Chosen {
        node: node.into(),
        configuration: json!({"bandwidthPerMigration": "1Mi"}),
        policy: Some("slow".into()),
    })
}

const ROOM: Limits = Limits {
    active_in_cluster: 0,
    active_from_node: 0,
    per_cluster: 5,
    per_node: 2,
};

fn phase_of(step: &Step) -> Option<String> {
    step.migration_status.as_ref()?["phase"]
        .as_str()
        .map(String::from)
}

#[test]
fn a_new_migration_walks_pending_scheduling_then_chooses_a_target() {
    let v = vmi(serde_json::Value::Null);
    let s = decide(&vmim(None), Some(&v), no_pick, ROOM, NOW);
    assert_eq!(phase_of(&s).as_deref(), Some("Pending"));
    let s = decide(&vmim(Some("Pending")), Some(&v), no_pick, ROOM, NOW);
    assert_eq!(phase_of(&s).as_deref(), Some("Scheduling"));
    let ts = &s.migration_status.as_ref().unwrap()["phaseTransitionTimestamps"];
    assert_eq!(
        ts.as_array().unwrap().len(),
        2,
        "Pending kept, Scheduling added"
    );
    let s = decide(
        &vmim(Some("Scheduling")),
        Some(&v),
        |_| to("node2"),
        ROOM,
        NOW,
    );
    let st = &s.vmi_status.as_ref().unwrap()["migrationState"];
    assert_eq!(st["targetNode"], "node2");
    assert_eq!(st["sourceNode"], "node1");
    assert_eq!(st["migrationUid"], "mig-1");
    assert_eq!(
        st["completed"],
        serde_json::Value::Null,
        "old state cleared"
    );
    assert!(
        s.migration_status.is_none(),
        "the VMIM follows the VMI next pass"
    );
}

#[test]
fn the_migration_follows_the_vmis_migration_state() {
    let base = json!({"migrationUid": "mig-1", "sourceNode": "node1", "targetNode": "node2"});
    let with = |extra: serde_json::Value| {
        let mut s = base.clone();
        s.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        vmi(s)
    };
    let cases = [
        (Some("Scheduling"), json!({}), Some("Scheduled")),
        (Some("Scheduled"), json!({}), Some("PreparingTarget")),
        (Some("PreparingTarget"), json!({}), None),
        (
            Some("PreparingTarget"),
            json!({"targetNodeAddress": "10.0.0.2"}),
            Some("TargetReady"),
        ),
        (
            Some("TargetReady"),
            json!({"targetNodeAddress": "10.0.0.2", "startTimestamp": "2026-01-01T00:00:59Z"}),
            Some("Running"),
        ),
        (
            Some("Running"),
            json!({"startTimestamp": "2026-01-01T00:00:59Z", "completed": true}),
            Some("Succeeded"),
        ),
        (
            Some("Running"),
            json!({"failed": true, "failureReason": "target gone"}),
            Some("Failed"),
        ),
    ];
    for (cur, extra, want) in cases {
        let v = with(extra.clone());
        let s = decide(&vmim(cur), Some(&v), no_pick, ROOM, NOW);
        assert_eq!(phase_of(&s).as_deref(), want, "{cur:?} + {extra}");
    }
    let failed = decide(
        &vmim(Some("Running")),
        Some(&with(
            json!({"failed": true, "failureReason": "target gone"}),
        )),
        no_pick,
        ROOM,
        NOW,
    );
    assert!(
        failed
            .events
            .iter()
            .any(|e| e.on == On::Vmi && e.warning && e.message == "target gone")
    );
    // Finished migrations are left alone.
    assert_eq!(
        decide(&vmim(Some("Succeeded")), None, no_pick, ROOM, NOW),
        Step::default()
    );
}

#[test]
fn a_vmi_that_cannot_migrate_fails_the_migration_at_once_with_the_reason() {
    let v: VirtualMachineInstance = serde_json::from_value(json!({
        "metadata": {"name": "vm"}, "spec": {"domain": {}},
        "status": {"phase": "Running", "nodeName": "node1", "conditions": [{
            "type": "LiveMigratable", "status": "False", "reason": "DisksNotLiveMigratable",
            "message": "PVC d is not shared"}]}}))
    .unwrap();
    let s = decide(&vmim(None), Some(&v), no_pick, ROOM, NOW);
    assert_eq!(phase_of(&s).as_deref(), Some("Failed"));
    let msg = &s.events[0].message;
    assert!(
        msg.contains("DisksNotLiveMigratable") && msg.contains("PVC d"),
        "{msg}"
    );
    // A VMI that does not run, or does not exist, fails it too.
    let mut stopped = vmi(serde_json::Value::Null);
    stopped.status.as_mut().unwrap().phase = Some(VmiPhase::Succeeded);
    assert_eq!(
        phase_of(&decide(&vmim(None), Some(&stopped), no_pick, ROOM, NOW)).as_deref(),
        Some("Failed")
    );
    assert_eq!(
        phase_of(&decide(&vmim(None), None, no_pick, ROOM, NOW)).as_deref(),
        Some("Failed")
    );
    // No node to go to.
    let s = decide(
        &vmim(Some("Scheduling")),
        Some(&vmi(serde_json::Value::Null)),
        |_| Err("0/1 nodes are available".into()),
        ROOM,
        NOW,
    );
    assert_eq!(phase_of(&s).as_deref(), Some("Failed"));
}

#[test]
fn a_target_that_never_gets_ready_fails_the_migration() {
    let v = vmi(json!({"migrationUid": "mig-1", "sourceNode": "node1", "targetNode": "node2"}));
    // Entered PreparingTarget 30 s ago: still waiting.
    assert_eq!(
        decide(&vmim(Some("PreparingTarget")), Some(&v), no_pick, ROOM, NOW),
        Step::default()
    );
    let late = Now {
        rfc3339: "2026-01-01T00:05:00Z",
        epoch_secs: NOW.epoch_secs + 240,
    };
    let s = decide(
        &vmim(Some("PreparingTarget")),
        Some(&v),
        no_pick,
        ROOM,
        late,
    );
    let st = &s.vmi_status.unwrap()["migrationState"];
    assert_eq!(st["failed"], true);
    assert!(st["failureReason"].as_str().unwrap().contains("node2"));
}

#[test]
fn a_second_migration_waits_for_the_first() {
    let v = vmi(json!({"migrationUid": "other", "targetNode": "node2"}));
    assert_eq!(
        decide(&vmim(Some("Pending")), Some(&v), no_pick, ROOM, NOW),
        Step::default()
    );
}

#[test]
fn the_target_is_never_the_current_node_and_honours_added_selectors() {
    let nodes = vec![
        node("node1").build(),
        node("node2").build(),
        node("node3").label("zone", "b").build(),
    ];
    let v = vmi(serde_json::Value::Null);
    let opts = SchedulerOptions::default();
    let mut inputs = TargetInputs {
        nodes: &nodes,
        vmis: &[],
        added_node_selector: None,
        volume_affinity: &[],
        shared_mounts: &[],
        opts: &opts,
    };
    assert_ne!(pick_target(&v, &inputs).unwrap(), "node1");
    let zone_b: BTreeMap<String, String> = [("zone".to_string(), "b".to_string())].into();
    inputs.added_node_selector = Some(&zone_b);
    assert_eq!(pick_target(&v, &inputs).unwrap(), "node3");
    let only = vec![node("node1").build()];
    inputs.nodes = &only;
    assert!(pick_target(&v, &inputs).is_err());
}

#[test]
fn parallel_limits_keep_a_migration_pending() {
    let v = vmi(serde_json::Value::Null);
    let full = Limits {
        active_from_node: 2,
        ..ROOM
    };
    assert!(!full.room());
    assert_eq!(
        decide(&vmim(Some("Pending")), Some(&v), no_pick, full, NOW),
        Step::default()
    );
    let cluster_full = Limits {
        active_in_cluster: 5,
        ..ROOM
    };
    assert!(!cluster_full.room());
    assert!(is_active(MigrationPhase::Running));
    assert!(is_active(MigrationPhase::Scheduling));
    assert!(!is_active(MigrationPhase::Pending));
    assert!(!is_active(MigrationPhase::Succeeded));
}

#[test]
fn deleting_a_migration_cancels_it() {
    let before = vmi(json!({"migrationUid": "gone", "targetNode": "node2"}));
    let p = cancel_patch(&before, |_| false, "t").unwrap();
    assert_eq!(
        p["migrationState"]["failed"], true,
        "not started: fails at once"
    );
    let sending = vmi(json!({"migrationUid": "gone", "targetNode": "node2",
        "startTimestamp": "2026-01-01T00:00:00Z"}));
    let p = cancel_patch(&sending, |_| false, "t").unwrap();
    assert_eq!(p["migrationState"]["abortRequested"], true);
    assert!(
        p["migrationState"].get("failed").is_none(),
        "the source aborts it"
    );
    assert!(
        cancel_patch(&sending, |u| u == "gone", "t").is_none(),
        "still exists"
    );
    let done = vmi(json!({"migrationUid": "gone", "completed": true}));
    assert!(cancel_patch(&done, |_| false, "t").is_none());
}

#[test]
fn the_target_must_offer_the_source_nodes_cpu_features() {
    let f = "cpu-feature.node.kubevirt.io/avx2";
    let nodes = vec![
        node("node1").label(f, "true").build(),
        node("node2").build(),
        node("node3").label(f, "true").build(),
    ];
    let v = vmi(serde_json::Value::Null);
    let opts = SchedulerOptions::default();
    let inputs = TargetInputs {
        nodes: &nodes,
        vmis: &[],
        added_node_selector: None,
        volume_affinity: &[],
        shared_mounts: &[],
        opts: &opts,
    };
    assert_eq!(pick_target(&v, &inputs).unwrap(), "node3");
    assert_eq!(
        missing_cpu_features(&nodes[0], &nodes[1]),
        vec!["avx2".to_string()]
    );
    assert!(
        missing_cpu_features(&nodes[1], &nodes[0]).is_empty(),
        "more is fine"
    );
    let two = vec![nodes[0].clone(), nodes[1].clone()];
    let inputs = TargetInputs {
        nodes: &two,
        ..inputs
    };
    let e = pick_target(&v, &inputs).unwrap_err();
    assert!(e.contains("node2 lacks avx2"), "{e}");
}

#[test]
fn a_cordoned_or_drain_tainted_node_is_never_a_target() {
    let nodes = vec![
        node("node1").build(),
        node("node2").unschedulable().build(),
        node("node3").build(),
    ];
    let v = vmi(serde_json::Value::Null);
    let opts = SchedulerOptions::default();
    let mut inputs = TargetInputs {
        nodes: &nodes,
        vmis: &[],
        added_node_selector: None,
        volume_affinity: &[],
        shared_mounts: &[],
        opts: &opts,
    };
    for _ in 0..5 {
        assert_eq!(pick_target(&v, &inputs).unwrap(), "node3");
    }
    let mut drained = node("node3").build();
    drained.spec.get_or_insert_default().taints = Some(vec![
        serde_json::from_value(
            json!({"key": ferrovirt_api::eviction::DRAIN_TAINT, "effect": "NoSchedule"}),
        )
        .unwrap(),
    ]);
    let only_bad = vec![
        node("node1").build(),
        node("node2").unschedulable().build(),
        drained,
    ];
    inputs.nodes = &only_bad;
    let why = pick_target(&v, &inputs).unwrap_err();
    assert!(why.contains("unschedulable"), "{why}");
}

#[test]
fn the_cpu_model_is_matched_against_node_labels() {
    let with_model = |m: &str| -> VirtualMachineInstance {
        serde_json::from_value(json!({"metadata": {"name": "vm", "namespace": "default"},
            "spec": {"domain": {"cpu": {"model": m}}},
            "status": {"phase": "Running", "nodeName": "node1"}}))
        .unwrap()
    };
    let host = "host-model-cpu.node.kubevirt.io/Intel-Xeon";
    let nodes = vec![
        node("node1").label(host, "true").build(),
        node("node2")
            .label("host-model-cpu.node.kubevirt.io/AMD-EPYC", "true")
            .label("cpu-model.node.kubevirt.io/Skylake-Client", "true")
            .build(),
        node("node3").label(host, "true").build(),
    ];
    // An explicit model needs the target's cpu-model label.
    let sky = with_model("Skylake-Client");
    assert_eq!(cpu_model_mismatch(&sky, Some(&nodes[0]), &nodes[1]), None);
    let why = cpu_model_mismatch(&sky, Some(&nodes[0]), &nodes[2]).unwrap();
    assert!(
        why.contains("spec.domain.cpu.model")
            && why.contains("cpu-model.node.kubevirt.io/Skylake-Client"),
        "{why}"
    );
    // host-model, named or by default: the source's host model labels on the target.
    for v in [with_model("host-model"), vmi(serde_json::Value::Null)] {
        assert_eq!(cpu_model_mismatch(&v, Some(&nodes[0]), &nodes[2]), None);
        let why = cpu_model_mismatch(&v, Some(&nodes[0]), &nodes[1]).unwrap();
        assert!(why.contains("host-model") && why.contains(host), "{why}");
    }
    // host-passthrough is left to the feature labels; an unknown source asks nothing.
    let pass = with_model("host-passthrough");
    assert_eq!(cpu_model_mismatch(&pass, Some(&nodes[0]), &nodes[1]), None);
    assert_eq!(
        cpu_model_mismatch(&vmi(serde_json::Value::Null), None, &nodes[1]),
        None
    );

    let opts = SchedulerOptions::default();
    let inputs = TargetInputs {
        nodes: &nodes,
        vmis: &[],
        added_node_selector: None,
        volume_affinity: &[],
        shared_mounts: &[],
        opts: &opts,
    };
    for _ in 0..5 {
        assert_eq!(
            pick_target(&vmi(serde_json::Value::Null), &inputs).unwrap(),
            "node3"
        );
        assert_eq!(pick_target(&sky, &inputs).unwrap(), "node2");
    }
    // No node fits: the migration fails with the field and the label named.
    let two = vec![nodes[0].clone(), nodes[2].clone()];
    let inputs = TargetInputs {
        nodes: &two,
        ..inputs
    };
    let why = pick_target(&sky, &inputs).unwrap_err();
    assert!(
        why.contains("node3 spec.domain.cpu.model Skylake-Client"),
        "{why}"
    );
    let step = decide(
        &vmim(Some("Scheduling")),
        Some(&sky),
        |v| {
            pick_target(v, &inputs).map(|node| Chosen {
                node,
                configuration: json!({}),
                policy: None,
            })
        },
        ROOM,
        NOW,
    );
    let st = step.migration_status.unwrap();
    assert_eq!(st["phase"], "Failed", "{st}");
    assert!(st.to_string().contains("spec.domain.cpu.model"), "{st}");
}

#[test]
fn a_quota_rejection_keeps_it_pending_with_kubevirts_condition_until_it_proceeds() {
    let msg = "virtualmachineinstancemigrations.kubevirt.io \"m\" is forbidden: exceeded quota: q, requested: requests.memory=128Mi, used: requests.memory=128Mi, limited: requests.memory=200Mi";
    let mut m: VirtualMachineInstanceMigration = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
        "metadata": {"name": "m", "namespace": "default", "uid": "mu"},
        "spec": {"vmiName": "vm"},
        "status": {"phase": "Pending"},
    }))
    .unwrap();
    let st = quota_rejected(&m, msg, "2026-12-04T00:00:00Z").unwrap();
    let c = &st["conditions"][0];
    assert_eq!(c["type"], "migrationRejectedByResourceQuota");
    assert_eq!(c["status"], "True");
    assert_eq!(c["reason"], QUOTA_REASON);
    assert_eq!(c["message"], msg);
    // The phase is not touched (it stays Pending).
    assert!(st.get("phase").is_none());
    // Written once: the same refusal again changes nothing.
    m.status = serde_json::from_value(json!({"phase": "Pending", "conditions": st["conditions"]}))
        .unwrap();
    assert_eq!(quota_rejected(&m, msg, "2026-12-04T00:00:09Z"), None);
    // Another usage in the message: rewritten, still one condition.
    let again = quota_rejected(&m, "exceeded quota: q, other", "t").unwrap();
    assert_eq!(again["conditions"].as_array().unwrap().len(), 1);
    // Proceeding to Scheduling (the quota now admits it) drops the condition.
    let mut p = vmim(Some("Pending"));
    p.status.as_mut().unwrap().conditions = m.status.as_ref().unwrap().conditions.clone();
    let s = decide(&p, Some(&vmi(serde_json::Value::Null)), no_pick, ROOM, NOW);
    let st = s.migration_status.unwrap();
    assert_eq!(st["phase"], "Scheduling");
    assert_eq!(st["conditions"], json!([]));
    // Without such a condition, Scheduling writes no conditions.
    let s = decide(
        &vmim(Some("Pending")),
        Some(&vmi(serde_json::Value::Null)),
        no_pick,
        ROOM,
        NOW,
    );
    assert!(s.migration_status.unwrap().get("conditions").is_none());
}
