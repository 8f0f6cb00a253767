use serde_json::json;

use super::*;

fn pvc(v: serde_json::Value) -> PersistentVolumeClaim {
    serde_json::from_value(v).unwrap()
}

fn pv(v: serde_json::Value) -> PersistentVolume {
    serde_json::from_value(v).unwrap()
}

fn claim(class: Option<&str>, annotations: serde_json::Value) -> PersistentVolumeClaim {
    let mut spec =
        json!({"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}});
    if let Some(c) = class {
        spec["storageClassName"] = json!(c);
    }
    pvc(
        json!({"metadata": {"name": "c", "namespace": "ns", "uid": "u1", "annotations": annotations},
        "spec": spec}),
    )
}

#[test]
fn named_volume_binds() {
    let c = pvc(
        json!({"metadata": {"name": "c", "namespace": "ns", "uid": "u1"},
        "spec": {"volumeName": "pv1"}}),
    );
    let free = pv(json!({"metadata": {"name": "pv1"}, "spec": {"capacity": {"storage": "1Gi"}}}));
    assert_eq!(
        decide(&c, &[free], &[]),
        PvcDecision::Bind { pv: "pv1".into() }
    );
    assert!(matches!(decide(&c, &[], &[]), PvcDecision::Pending { .. }));
    let other = pv(
        json!({"metadata": {"name": "pv1"}, "spec": {"claimRef": {"name": "x", "namespace": "ns", "uid": "u9"}}}),
    );
    assert!(
        matches!(decide(&c, &[other], &[]), PvcDecision::Pending { reason, .. } if reason == "VolumeMismatch")
    );
    let mut bound_c = c.clone();
    bound_c.status = Some(serde_json::from_value(json!({"phase": "Bound"})).unwrap());
    let bound_pv = pv(
        json!({"metadata": {"name": "pv1"}, "spec": {"claimRef": {"name": "c", "namespace": "ns", "uid": "u1"}}, "status": {"phase": "Bound"}}),
    );
    assert_eq!(decide(&bound_c, &[bound_pv], &[]), PvcDecision::Nothing);
}

#[test]
fn shared_class_provisions_immediately() {
    let classes = classes::builtin_classes();
    let d = decide(&claim(Some("shared"), json!({})), &[], &classes);
    let PvcDecision::Provision(plan) = d else {
        panic!("{d:?}")
    };
    assert_eq!(plan.pv_name, "pvc-u1");
    assert_eq!(
        (plan.builtin, plan.bytes, plan.node.clone()),
        (Builtin::Shared, 1 << 30, None)
    );
    assert_eq!(plan.reclaim_policy, "Delete");
    let p = build_pv(
        &plan,
        Path::new("/v/pvc-u1"),
        &claim(Some("shared"), json!({})),
    );
    let spec = p.spec.unwrap();
    assert_eq!(spec.host_path.unwrap().path, "/v/pvc-u1");
    assert_eq!(spec.claim_ref.unwrap().uid.as_deref(), Some("u1"));
    assert_eq!(spec.storage_class_name.as_deref(), Some("shared"));
}

#[test]
fn local_default_class_waits_for_consumer_then_pins_node() {
    let classes = classes::builtin_classes();
    assert_eq!(
        decide(&claim(None, json!({})), &[], &classes),
        PvcDecision::WaitForFirstConsumer
    );
    let c = claim(None, json!({SELECTED_NODE: "node1"}));
    let PvcDecision::Provision(plan) = decide(&c, &[], &classes) else {
        panic!()
    };
    assert_eq!(
        (plan.builtin, plan.node.as_deref(), plan.class.as_str()),
        (Builtin::Local, Some("node1"), "local")
    );
    let p = build_pv(&plan, Path::new("/l/node1/pvc-u1"), &c);
    let spec = p.spec.unwrap();
    assert_eq!(spec.local.unwrap().path, "/l/node1/pvc-u1");
    let term = &spec
        .node_affinity
        .unwrap()
        .required
        .unwrap()
        .node_selector_terms[0];
    assert_eq!(
        term.match_expressions.as_ref().unwrap()[0]
            .values
            .as_deref(),
        Some(&["node1".to_string()][..])
    );
}

#[test]
fn prebound_and_static_pvs_are_used() {
    let classes = classes::builtin_classes();
    let c = claim(Some("shared"), json!({}));
    let pre = pv(
        json!({"metadata": {"name": "pvc-u1"}, "spec": {"claimRef": {"name": "c", "namespace": "ns", "uid": "u1"}}}),
    );
    assert_eq!(
        decide(&c, &[pre], &classes),
        PvcDecision::Bind {
            pv: "pvc-u1".into()
        }
    );
    let small = pv(
        json!({"metadata": {"name": "small"}, "spec": {"storageClassName": "manual", "capacity": {"storage": "512Mi"}, "accessModes": ["ReadWriteOnce"]}}),
    );
    let big = pv(
        json!({"metadata": {"name": "big"}, "spec": {"storageClassName": "manual", "capacity": {"storage": "8Gi"}, "accessModes": ["ReadWriteOnce"]}}),
    );
    let fit = pv(
        json!({"metadata": {"name": "fit"}, "spec": {"storageClassName": "manual", "capacity": {"storage": "2Gi"}, "accessModes": ["ReadWriteOnce", "ReadWriteMany"]}}),
    );
    let c = claim(Some("manual"), json!({}));
    assert_eq!(
        decide(&c, &[small, big, fit], &classes),
        PvcDecision::Bind { pv: "fit".into() }
    );
    assert!(
        matches!(decide(&c, &[], &classes), PvcDecision::Pending { reason, .. } if reason == "ProvisioningFailed")
    );
}

#[test]
fn reclaim_policies() {
    let mk = |policy: &str, ours: bool, uid: Option<&str>| {
        let mut v = json!({"metadata": {"name": "p"}, "spec": {"persistentVolumeReclaimPolicy": policy,
            "hostPath": {"path": "/v/p"}, "claimRef": {"name": "c", "namespace": "ns"}}});
        if let Some(u) = uid {
            v["spec"]["claimRef"]["uid"] = json!(u);
        }
        if ours {
            v["metadata"]["annotations"] = json!({PROVISIONED_BY: classes::PROVISIONER_SHARED});
        }
        pv(v)
    };
    assert_eq!(
        reclaim(&mk("Delete", true, Some("u1")), Some("u1")),
        Reclaim::Keep
    );
    assert_eq!(
        reclaim(&mk("Delete", true, Some("u1")), None),
        Reclaim::Delete {
            remove_dir: Some("/v/p".into())
        }
    );
    assert_eq!(
        reclaim(&mk("Delete", false, Some("u1")), Some("u2")),
        Reclaim::Delete { remove_dir: None }
    );
    assert_eq!(
        reclaim(&mk("Retain", true, Some("u1")), None),
        Reclaim::Release
    );
    assert_eq!(reclaim(&mk("Retain", true, None), None), Reclaim::Keep);
    // Deleted while Bound (pv-protection holds it): its claim gone, it is still Released,
    // and once Released it is left to go.
    let deleted = |phase: &str| {
        let mut v = serde_json::to_value(mk("Retain", true, Some("u1"))).unwrap();
        v["metadata"]["deletionTimestamp"] = json!("2026-12-03T00:00:00Z");
        v["status"] = json!({ "phase": phase });
        pv(v)
    };
    assert_eq!(reclaim(&deleted("Bound"), None), Reclaim::Release);
    assert_eq!(reclaim(&deleted("Released"), None), Reclaim::Keep);
}

#[test]
fn quantities() {
    assert_eq!(quantity_bytes(&Quantity("1Gi".into())), Ok(1 << 30));
    assert_eq!(quantity_bytes(&Quantity("100M".into())), Ok(100_000_000));
    assert!(quantity_bytes(&Quantity("0".into())).is_err());
}
