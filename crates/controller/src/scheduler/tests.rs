//! Unit tests of the scheduler (`super`).

use super::testutil::{HOSTNAME, node, vmi};
use super::*;
use k8s_openapi::api::core::v1::{NodeSelectorRequirement, NodeSelectorTerm};

fn run(v: &VirtualMachineInstance, nodes: &[Node], vmis: &[VirtualMachineInstance]) -> Decision {
    schedule(
        &ScheduleRequest {
            vmi: v,
            nodes,
            vmis,
            volume_affinity: &[],
            shared_mounts: &[],
        },
        &SchedulerOptions::default(),
    )
}

fn message(d: Decision) -> String {
    match d {
        Decision::Unschedulable(e) => e.to_string(),
        Decision::Bind { node } => panic!("bound to {node}"),
    }
}

fn bound(d: Decision) -> String {
    match d {
        Decision::Bind { node } => node,
        Decision::Unschedulable(e) => panic!("unschedulable: {e}"),
    }
}

fn term(key: &str, op: &str, values: &[&str]) -> NodeSelectorTerm {
    NodeSelectorTerm {
        match_expressions: Some(vec![NodeSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: Some(values.iter().map(|s| s.to_string()).collect()),
        }]),
        match_fields: None,
    }
}

#[test]
fn message_matches_kubernetes() {
    let nodes = [
        node("a").alloc("4", "1Gi").build(),
        node("b").alloc("4", "1Gi").build(),
        node("c").build(),
    ];
    let v = vmi("v").requests("1", "2Gi").selector("zone", "x").build();
    // c has memory but no zone label; a and b fail... the selector first.
    assert_eq!(
        message(run(&v, &nodes, &[])),
        "0/3 nodes are available: 3 node(s) didn't match node selector."
    );
    let nodes = [
        node("a").alloc("4", "1Gi").label("zone", "x").build(),
        node("b").alloc("4", "1Gi").label("zone", "x").build(),
        node("c").build(),
    ];
    assert_eq!(
        message(run(&v, &nodes, &[])),
        "0/3 nodes are available: 1 node(s) didn't match node selector, 2 Insufficient memory."
    );
    assert_eq!(message(run(&v, &[], &[])), NO_NODES);
}

#[test]
fn ready_and_unschedulable_filters() {
    let nodes = [
        node("a").ready("False").build(),
        node("b").ready("Unknown").build(),
        node("c").unschedulable().build(),
    ];
    assert_eq!(
        message(run(&vmi("v").build(), &nodes, &[])),
        "0/3 nodes are available: 1 node(s) had untolerated taint {node.kubernetes.io/not-ready: }, \
             1 node(s) had untolerated taint {node.kubernetes.io/unreachable: }, 1 node(s) were unschedulable."
    );
    let tolerant = vmi("v")
        .toleration(Toleration {
            key: Some(TAINT_UNSCHEDULABLE.into()),
            operator: Some("Exists".into()),
            ..Default::default()
        })
        .build();
    assert_eq!(bound(run(&tolerant, &nodes, &[])), "c");
}

#[test]
fn resources_count_bound_vmis() {
    let nodes = [
        node("a").alloc("4", "4Gi").build(),
        node("b").alloc("4", "4Gi").build(),
    ];
    let big = |n: &str| vmi(n).requests("1", "3Gi").build();
    let on_a = vmi("x")
        .requests("1", "3Gi")
        .bound("a", VmiPhase::Running)
        .build();
    assert_eq!(
        bound(run(&big("v"), &nodes, std::slice::from_ref(&on_a))),
        "b"
    );
    let on_b = vmi("y")
        .requests("1", "3Gi")
        .bound("b", VmiPhase::Scheduled)
        .build();
    assert_eq!(
        message(run(&big("v"), &nodes, &[on_a.clone(), on_b])),
        "0/2 nodes are available: 2 Insufficient memory."
    );
    // Finished VMIs release their node.
    let done = vmi("y")
        .requests("1", "3Gi")
        .bound("b", VmiPhase::Succeeded)
        .build();
    assert_eq!(bound(run(&big("v"), &nodes, &[on_a, done])), "b");
}

#[test]
fn bound_local_volumes_restrict_nodes() {
    use k8s_openapi::api::core::v1::NodeSelector;
    let nodes = [node("a").build(), node("b").build()];
    let v = vmi("v").build();
    let pin = |n: &str| NodeSelector {
        node_selector_terms: vec![NodeSelectorTerm {
            match_expressions: Some(vec![NodeSelectorRequirement {
                key: HOSTNAME.into(),
                operator: "In".into(),
                values: Some(vec![n.into()]),
            }]),
            match_fields: None,
        }],
    };
    let sched = |aff: &[NodeSelector]| {
        schedule(
            &ScheduleRequest {
                vmi: &v,
                nodes: &nodes,
                vmis: &[],
                volume_affinity: aff,
                shared_mounts: &[],
            },
            &SchedulerOptions::default(),
        )
    };
    assert_eq!(bound(sched(&[pin("b")])), "b");
    assert_eq!(
        message(sched(&[pin("a"), pin("b")])),
        "0/2 nodes are available: 2 node(s) had volume node affinity conflict."
    );
}

#[test]
fn shared_mounts_restrict_nodes_and_name_claim_and_class() {
    let mut with_mount = node("a").alloc("4", "8Gi").build();
    with_mount.metadata.annotations = Some(
        [(
            ferrovirt_api::shared_mount::MOUNTED_ANNOTATION.to_string(),
            "vmstore".to_string(),
        )]
        .into(),
    );
    let without = node("b").alloc("8", "16Gi").build();
    let v = vmi("v").guest("1Gi").build();
    let needs = [volumes::SharedMountNeed {
        claim: "disk".into(),
        class: "vmstore".into(),
    }];
    let sched = |nodes: &[Node]| {
        schedule(
            &ScheduleRequest {
                vmi: &v,
                nodes,
                vmis: &[],
                volume_affinity: &[],
                shared_mounts: &needs,
            },
            &SchedulerOptions::default(),
        )
    };
    // b has more room (it would win on score) but lacks the mount.
    assert_eq!(bound(sched(&[with_mount.clone(), without.clone()])), "a");
    assert_eq!(
        message(sched(&[without])),
        "0/1 nodes are available: 1 node(s) did not have the shared filesystem of \
             StorageClass \"vmstore\" (claim \"disk\") mounted."
    );
}

#[test]
fn overhead_is_added() {
    let nodes = [node("a").alloc("4", "1Gi").build()];
    let v = vmi("v").guest("1Gi").build();
    assert_eq!(
        message(run(&v, &nodes, &[])),
        "0/1 nodes are available: 1 Insufficient memory."
    );
    let d = schedule(
        &ScheduleRequest {
            vmi: &v,
            nodes: &nodes,
            vmis: &[],
            volume_affinity: &[],
            shared_mounts: &[],
        },
        &SchedulerOptions {
            memory_overhead_bytes: 0,
            ..SchedulerOptions::default()
        },
    );
    assert_eq!(bound(d), "a");
}

#[test]
fn cpu_insufficient() {
    let nodes = [node("a").alloc("2", "64Gi").build()];
    // 32 vCPUs at KubeVirt's default ratio 10 ask 3.2 CPUs; 4 vCPUs ask 400m and fit.
    let v = vmi("v").topology(8, 4, 1).build();
    assert_eq!(
        message(run(&v, &nodes, &[])),
        "0/1 nodes are available: 1 Insufficient cpu."
    );
    let four = vmi("w").topology(2, 2, 1).build();
    assert_eq!(bound(run(&four, &nodes, &[])), "a");
    // At ratio 1 a vCPU is a CPU: the 4 vCPUs no longer fit.
    let one = SchedulerOptions {
        overcommit: Overcommit {
            cpu_allocation_ratio: 1,
            ..Overcommit::default()
        },
        ..SchedulerOptions::default()
    };
    let snap = Snapshot::new(&nodes, [], &one);
    assert!(matches!(
        snap.schedule(&four, &[], &[]),
        Decision::Unschedulable(_)
    ));
}

#[test]
fn spreads_by_least_requested() {
    let nodes = [node("a").build(), node("b").build()];
    let on_a = vmi("x")
        .requests("4", "8Gi")
        .bound("a", VmiPhase::Running)
        .build();
    assert_eq!(
        bound(run(&vmi("v").requests("1", "1Gi").build(), &nodes, &[on_a])),
        "b"
    );
    // Ties go to the first name.
    assert_eq!(bound(run(&vmi("v").build(), &nodes, &[])), "a");
}

#[test]
fn required_node_affinity() {
    let nodes = [node("a").label("gpu", "yes").build(), node("b").build()];
    let v = vmi("v").node_affinity(term("gpu", "Exists", &[])).build();
    assert_eq!(bound(run(&v, &nodes, &[])), "a");
    let v = vmi("v")
        .node_affinity(term("gpu", "DoesNotExist", &[]))
        .build();
    assert_eq!(bound(run(&v, &nodes, &[])), "b");
    let v = vmi("v").node_affinity(term("gpu", "In", &["no"])).build();
    assert_eq!(
        message(run(&v, &nodes, &[])),
        "0/2 nodes are available: 2 node(s) didn't match node selector."
    );
}

#[test]
fn preferred_node_affinity_scores() {
    let nodes = [node("a").build(), node("b").label("fast", "1").build()];
    let v = vmi("v")
        .preferred_node_affinity(term("fast", "Exists", &[]), 50)
        .build();
    assert_eq!(bound(run(&v, &nodes, &[])), "b");
}

#[test]
fn taints_filter_and_prefer() {
    let nodes = [
        node("a").taint("dedicated", "db", "NoSchedule").build(),
        node("b").taint("maint", "", "NoExecute").build(),
    ];
    assert_eq!(
        message(run(&vmi("v").build(), &nodes, &[])),
        "0/2 nodes are available: 1 node(s) had untolerated taint {dedicated: db}, \
             1 node(s) had untolerated taint {maint: }."
    );
    let v = vmi("v")
        .toleration(Toleration {
            key: Some("dedicated".into()),
            value: Some("db".into()),
            effect: Some("NoSchedule".into()),
            ..Default::default()
        })
        .build();
    assert_eq!(bound(run(&v, &nodes, &[])), "a");
    let nodes = [
        node("a").taint("soft", "", "PreferNoSchedule").build(),
        node("b").build(),
    ];
    assert_eq!(bound(run(&vmi("v").build(), &nodes, &[])), "b");
}

#[test]
fn kvm_only_on_kvm_nodes() {
    let nodes = [
        node("a").build(),
        node("b").label(resources::ACCEL_LABEL, "kvm").build(),
    ];
    let v = vmi("v").annotation(resources::ACCEL_LABEL, "kvm").build();
    assert_eq!(bound(run(&v, &nodes, &[])), "b");
    let v = vmi("v")
        .requests_extra(resources::KVM_RESOURCE, "1")
        .build();
    assert_eq!(
        message(run(&v, &nodes[..1], &[])),
        "0/1 nodes are available: 1 Insufficient devices.kubevirt.io/kvm."
    );
}

#[test]
fn a_snapshot_counts_the_bindings_it_assumes() {
    // Two nodes with room for two VMIs each: a batch of four over one snapshot fills both
    // (each decision sees the ones before it), a fifth fits nowhere.
    let nodes = [
        node("a").alloc("2", "8Gi").build(),
        node("b").alloc("2", "8Gi").build(),
    ];
    let vmis: Vec<_> = (0..5)
        .map(|i| vmi(&format!("v{i}")).requests("1", "256Mi").build())
        .collect();
    let opts = SchedulerOptions::default();
    let mut snap = Snapshot::new(&nodes, [], &opts);
    let mut placed = Vec::new();
    for v in &vmis[..4] {
        let n = bound(snap.schedule(v, &[], &[]));
        snap.assume(v, &n);
        placed.push(n);
    }
    placed.sort();
    assert_eq!(placed, ["a", "a", "b", "b"]);
    assert_eq!(
        message(snap.schedule(&vmis[4], &[], &[])),
        "0/2 nodes are available: 2 Insufficient cpu."
    );
    // Required anti-affinity of an assumed VMI keeps its peers off its node.
    let db0 = vmi("db-0")
        .label("app", "db")
        .anti_affinity("app", "db", HOSTNAME)
        .build();
    let db1 = vmi("db-1").label("app", "db").build();
    let mut snap = Snapshot::new(&nodes, [], &opts);
    snap.assume(&db0, "a");
    assert_eq!(bound(snap.schedule(&db1, &[], &[])), "b");
    // A binding to a node the snapshot does not know holds nothing: the tie between the
    // two empty nodes still goes to the first name.
    let mut snap = Snapshot::new(&nodes, [], &opts);
    snap.assume(&vmis[0], "gone");
    assert_eq!(bound(snap.schedule(&vmis[1], &[], &[])), "a");
}

#[test]
fn vmi_anti_affinity_spreads() {
    let nodes = [node("a").build(), node("b").build()];
    let first = vmi("db-0")
        .label("app", "db")
        .bound("a", VmiPhase::Running)
        .build();
    let v = vmi("db-1")
        .label("app", "db")
        .anti_affinity("app", "db", HOSTNAME)
        .build();
    assert_eq!(bound(run(&v, &nodes, std::slice::from_ref(&first))), "b");
    let second = vmi("db-2")
        .label("app", "db")
        .bound("b", VmiPhase::Running)
        .build();
    assert_eq!(
        message(run(&v, &nodes, &[first, second])),
        "0/2 nodes are available: 2 node(s) didn't match pod anti-affinity rules."
    );
}

#[test]
fn vmi_preferred_affinity_colocates() {
    let nodes = [node("a").build(), node("b").build()];
    let peer = vmi("cache")
        .label("app", "cache")
        .bound("b", VmiPhase::Running)
        .build();
    let v = vmi("web")
        .preferred_affinity("app", "cache", HOSTNAME, 100)
        .build();
    assert_eq!(bound(run(&v, &nodes, &[peer])), "b");
}

#[test]
fn scheduling_predicates() {
    let pending = vmi("v").build();
    assert!(needs_scheduling(&pending));
    let bound_vmi = vmi("v").bound("a", VmiPhase::Scheduled).build();
    assert!(!needs_scheduling(&bound_vmi));
    let mut other = vmi("v").build();
    other.spec.as_mut().unwrap().scheduler_name = Some("my-scheduler".into());
    assert!(!needs_scheduling(&other));
    assert_eq!(is_bound(&bound_vmi), Some("a"));
    // The VMI itself is not counted against a node.
    let nodes = [node("a").alloc("1", "2Gi").build()];
    let me = vmi("v")
        .requests("1", "1Gi")
        .bound("a", VmiPhase::Pending)
        .build();
    assert_eq!(
        bound(run(&vmi("v").requests("1", "1Gi").build(), &nodes, &[me])),
        "a"
    );
}

#[test]
fn host_devices_are_counted_per_node() {
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    let with_nic = |name: &str| {
        let mut n = node(name).build();
        if let Some(a) = n.status.as_mut().and_then(|s| s.allocatable.as_mut()) {
            a.insert("example.org/nic".into(), Quantity("1".into()));
        }
        n
    };
    let nodes = [with_nic("a"), with_nic("b")];
    let wants = |name: &str| {
        let mut v = vmi(name).build();
        v.spec.as_mut().unwrap().domain.devices.host_devices = Some(vec![
            serde_json::from_value(serde_json::json!(
                {"name": "nic", "deviceName": "example.org/nic"}
            ))
            .unwrap(),
        ]);
        v
    };
    let mut on_a = wants("x");
    on_a.status = vmi("x").bound("a", VmiPhase::Running).build().status;
    assert_eq!(
        bound(run(&wants("v"), &nodes, std::slice::from_ref(&on_a))),
        "b"
    );
    let mut on_b = wants("y");
    on_b.status = vmi("y").bound("b", VmiPhase::Scheduled).build().status;
    assert_eq!(
        message(run(&wants("v"), &nodes, &[on_a.clone(), on_b])),
        "0/2 nodes are available: 2 node(s) cannot honour \
         spec.domain.devices.hostDevices[0].deviceName: Insufficient example.org/nic."
    );
    // A finished VMI gives its device back; one passing through a snapshot counts at once.
    let mut done = wants("y");
    done.status = vmi("y").bound("b", VmiPhase::Failed).build().status;
    assert_eq!(bound(run(&wants("v"), &nodes, &[on_a.clone(), done])), "b");
    let mut snap = Snapshot::new(
        &nodes,
        std::slice::from_ref(&on_a),
        &SchedulerOptions::default(),
    );
    let first = wants("v1");
    snap.assume(&first, "b");
    assert!(matches!(
        snap.schedule(&wants("v2"), &[], &[]),
        Decision::Unschedulable(_)
    ));
}
