use super::*;
use serde_json::json;

fn vs(source: serde_json::Value) -> VolumeSnapshot {
    serde_json::from_value(json!({
        "metadata": {"name": "s1", "namespace": "default", "uid": "vsuid"},
        "spec": {"source": source}
    }))
    .unwrap()
}

fn pvc(bound: bool) -> PersistentVolumeClaim {
    serde_json::from_value(json!({
        "metadata": {"name": "disk", "namespace": "default"},
        "spec": {"volumeName": "pvc-1", "resources": {"requests": {"storage": "1Gi"}}},
        "status": {"phase": if bound {"Bound"} else {"Pending"}}
    }))
    .unwrap()
}

fn pv(by: &str) -> PersistentVolume {
    serde_json::from_value(json!({
        "metadata": {"name": "pvc-1", "annotations": {PROVISIONED_BY: by}},
        "spec": {"local": {"path": "/n/volumes/pvc-1"}, "nodeAffinity": {"required": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node1"]}]}]}}}
    }))
    .unwrap()
}

#[test]
fn a_claim_snapshot_creates_content_then_takes_then_binds() {
    let v = vs(json!({"persistentVolumeClaimName": "disk"}));
    let (c, p) = (pvc(true), pv(PROVISIONER_LOCAL));
    let mut input = VsInput {
        vs: &v,
        content: None,
        pvc: Some(&c),
        pv: Some(&p),
        in_use_by: None,
        classes: &classes(),
    };
    let VsDecision::CreateContent(content) = decide(&input) else {
        panic!("{:?}", decide(&input))
    };
    assert_eq!(content.metadata.name.as_deref(), Some("snapcontent-vsuid"));
    let spec = content.spec.as_ref().unwrap();
    assert_eq!(spec.driver, DRIVER);
    assert_eq!(spec.source.volume_handle.as_deref(), Some("pvc-1"));
    assert_eq!(
        spec.volume_snapshot_class_name.as_deref(),
        Some(LOCAL_CLASS)
    );
    let mut content = *content;
    let taken = content.clone();
    input.content = Some(&taken);
    assert_eq!(
        decide(&input),
        VsDecision::Take {
            content: "snapcontent-vsuid".into(),
            at: Placement::Node {
                node: "node1".into(),
                volume: "pvc-1".into()
            }
        }
    );
    content.status = Some(ferrovirt_api::volumesnapshot::VolumeSnapshotContentStatus {
        snapshot_handle: Some("pvc-1/disk.img".into()),
        creation_time: Some(1_700_000_000_000_000_000),
        ready_to_use: Some(true),
        restore_size: Some(1 << 30),
        error: None,
    });
    input.content = Some(&content);
    let VsDecision::Bind(st) = decide(&input) else {
        panic!()
    };
    assert_eq!(st.ready_to_use, Some(true));
    assert_eq!(st.restore_size.as_deref(), Some("1073741824"));
    assert_eq!(
        st.bound_volume_snapshot_content_name.as_deref(),
        Some("snapcontent-vsuid")
    );
    assert!(st.creation_time.is_some());
}

#[test]
fn what_cannot_be_snapshotted_is_said() {
    let v = vs(json!({"persistentVolumeClaimName": "disk"}));
    let (c, p) = (pvc(true), pv(PROVISIONER_LOCAL));
    let unbound = pvc(false);
    let foreign = pv("example.com/csi");
    let err = |input: VsInput<'_>| match decide(&input) {
        VsDecision::Error(e) => e,
        d => panic!("{d:?}"),
    };
    let cls = classes();
    let base = || VsInput {
        vs: &v,
        content: None,
        pvc: Some(&c),
        pv: Some(&p),
        in_use_by: None,
        classes: &cls,
    };
    assert!(
        err(VsInput {
            pvc: None,
            ..base()
        })
        .contains("does not exist")
    );
    assert!(
        err(VsInput {
            pvc: Some(&unbound),
            ..base()
        })
        .contains("not bound")
    );
    assert!(
        err(VsInput {
            pv: Some(&foreign),
            ..base()
        })
        .contains("not made by")
    );
    let content = match decide(&base()) {
        VsDecision::CreateContent(c) => *c,
        d => panic!("{d:?}"),
    };
    let e = err(VsInput {
        content: Some(&content),
        in_use_by: Some("vm1".into()),
        ..base()
    });
    assert!(e.contains("running VMI vm1"), "{e}");
}

#[test]
fn claims_name_their_snapshot_source() {
    let c: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "r"},
        "spec": {"dataSource": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "s1"}}
    }))
    .unwrap();
    assert_eq!(snapshot_source(&c).as_deref(), Some("s1"));
    let c: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "r"},
        "spec": {"dataSource": {"kind": "PersistentVolumeClaim", "name": "x"}}
    }))
    .unwrap();
    assert_eq!(snapshot_source(&c), None);
    assert_eq!(split_handle("pvc-1/disk.img"), Some(("pvc-1", "disk.img")));
    assert_eq!(split_handle("pvc-1/../x/y"), None);
    assert_eq!(split_handle("/x"), None);
}

fn classes() -> Vec<VolumeSnapshotClass> {
    let class = |name: &str, driver: &str, policy: &str, default: bool| {
        serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": if default {
                json!({ferrovirt_api::volumesnapshot::DEFAULT_CLASS_ANNOTATION: "true"})
            } else { json!({}) }},
            "driver": driver, "deletionPolicy": policy
        }))
        .unwrap()
    };
    vec![
        class("other-local", DRIVER, "Retain", false),
        class(LOCAL_CLASS, DRIVER, "Delete", true),
        class(SHARED_CLASS, SHARED_DRIVER, "Delete", false),
    ]
}

#[test]
fn classes_choose_the_deletion_policy_and_must_fit_the_driver() {
    let cls = classes();
    let (c, p) = (pvc(true), pv(PROVISIONER_LOCAL));
    let mut v = vs(json!({"persistentVolumeClaimName": "disk"}));
    let content = |v: &VolumeSnapshot| match decide(&VsInput {
        vs: v,
        content: None,
        pvc: Some(&c),
        pv: Some(&p),
        in_use_by: None,
        classes: &cls,
    }) {
        VsDecision::CreateContent(c) => Ok(*c),
        VsDecision::Error(e) => Err(e),
        d => panic!("{d:?}"),
    };
    let retained = {
        v.spec.as_mut().unwrap().volume_snapshot_class_name = Some("other-local".into());
        content(&v).unwrap()
    };
    assert_eq!(retained.spec.as_ref().unwrap().deletion_policy, "Retain");
    assert!(retained.metadata.owner_references.is_none());
    v.spec.as_mut().unwrap().volume_snapshot_class_name = Some(SHARED_CLASS.into());
    assert!(content(&v).unwrap_err().contains("driver"));
    v.spec.as_mut().unwrap().volume_snapshot_class_name = Some("nope".into());
    assert!(content(&v).unwrap_err().contains("does not exist"));
}
