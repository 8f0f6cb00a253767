//! Core-kind defaults, the smaller kinds' validation, pruning and subresource helpers.

use ferrovirt_api::admission::{Operation, admit};
use ferrovirt_api::registry::{find, find_kind, prune_unknown_fields, scale_subresource};
use serde_json::{Value, json};

fn admit_new(obj: &mut Value) -> Result<(), Vec<String>> {
    let def = find_kind(
        obj["apiVersion"].as_str().unwrap(),
        obj["kind"].as_str().unwrap(),
    )
    .unwrap();
    admit(&def, Operation::Create, obj, None)
        .map_err(|e| e.0.into_iter().map(|f| f.field).collect())
}

#[test]
fn secret_string_data_is_encoded_into_data() {
    let mut s = json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "s"},
        "data": {"a": "eA=="},
        "stringData": {"b": "hello", "a": "y"}
    });
    admit_new(&mut s).unwrap();
    assert_eq!(s["data"], json!({"a": "eQ==", "b": "aGVsbG8="}));
    assert!(s.get("stringData").is_none());
    assert_eq!(s["type"], "Opaque");
}

#[test]
fn namespace_gets_its_name_label() {
    let mut ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "demo"}});
    admit_new(&mut ns).unwrap();
    assert_eq!(
        ns["metadata"]["labels"]["kubernetes.io/metadata.name"],
        "demo"
    );
    assert_eq!(ns["spec"]["finalizers"], json!(["kubernetes"]));
}

#[test]
fn pvc_and_storage_class_defaults() {
    let mut pvc = json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "p"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    });
    admit_new(&mut pvc).unwrap();
    assert_eq!(pvc["spec"]["volumeMode"], "Filesystem");
    let mut sc = json!({
        "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
        "metadata": {"name": "local"}, "provisioner": "ferrovirt.io/local"
    });
    admit_new(&mut sc).unwrap();
    assert_eq!(sc["reclaimPolicy"], "Delete");
    assert_eq!(sc["volumeBindingMode"], "Immediate");
}

#[test]
fn shared_mount_classes_need_a_usable_path_and_keep_it() {
    let class = |mount: &str| {
        json!({
            "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
            "metadata": {"name": "vmstore"}, "provisioner": "ferrovirt.io/shared",
            "parameters": {"ferrovirt.io/shared-mount": mount}
        })
    };
    for bad in ["relative/dir", "/", "/mnt/../etc"] {
        assert_eq!(
            admit_new(&mut class(bad)).unwrap_err(),
            vec!["parameters[ferrovirt.io/shared-mount]"],
            "{bad}"
        );
    }
    let mut good = class("/mnt/vmstore");
    admit_new(&mut good).unwrap();
    // Another provisioner's parameter of that name is not ours to judge.
    let mut other = class("relative");
    other["provisioner"] = json!("example.com/nfs");
    admit_new(&mut other).unwrap();
    // The mount cannot move under its volumes.
    let old = good.clone();
    let mut moved = class("/mnt/elsewhere");
    let def = find("storage.k8s.io", "storageclasses").unwrap();
    let err = admit(&def, Operation::Update, &mut moved, Some(&old)).unwrap_err();
    assert_eq!(err.0[0].field, "parameters");
    assert_eq!(err.0[0].reason, "FieldValueForbidden");
    let mut same = good.clone();
    admit(&def, Operation::Update, &mut same, Some(&old)).unwrap();
}

#[test]
fn migration_needs_a_vmi_and_is_immutable() {
    let mut m = json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
        "metadata": {"name": "m", "namespace": "ns"}, "spec": {}
    });
    assert_eq!(admit_new(&mut m).unwrap_err(), vec!["spec.vmiName"]);
    m["spec"]["vmiName"] = json!("a");
    admit_new(&mut m).unwrap();
    let old = m.clone();
    m["spec"]["vmiName"] = json!("b");
    let def = find("kubevirt.io", "virtualmachineinstancemigrations").unwrap();
    let err = admit(&def, Operation::Update, &mut m, Some(&old)).unwrap_err();
    assert_eq!(err.0[0].field, "spec");
    assert_eq!(err.0[0].reason, "FieldValueForbidden");
}

#[test]
fn snapshot_source_must_be_a_vm() {
    let mut s = json!({
        "apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineSnapshot",
        "metadata": {"name": "s", "namespace": "ns"},
        "spec": {"source": {"apiGroup": "kubevirt.io", "kind": "Pod", "name": "x"}}
    });
    assert_eq!(admit_new(&mut s).unwrap_err(), vec!["spec.source.kind"]);
}

#[test]
fn instancetype_and_preference_checks() {
    let mut it = json!({
        "apiVersion": "instancetype.kubevirt.io/v1beta1",
        "kind": "VirtualMachineInstancetype",
        "metadata": {"name": "tiny", "namespace": "ns"},
        "spec": {"cpu": {"guest": 0}, "memory": {"guest": "1Ki"}}
    });
    assert_eq!(
        admit_new(&mut it).unwrap_err(),
        vec!["spec.cpu.guest", "spec.memory.guest"]
    );
    let mut p = json!({
        "apiVersion": "instancetype.kubevirt.io/v1beta1",
        "kind": "VirtualMachinePreference",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"devices": {"preferredDiskBus": "ide"}}
    });
    assert_eq!(
        admit_new(&mut p).unwrap_err(),
        vec!["spec.devices.preferredDiskBus"]
    );
}

#[test]
fn nad_config_must_be_json() {
    let mut n = json!({
        "apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
        "metadata": {"name": "n", "namespace": "ns"}, "spec": {"config": "{not json"}
    });
    assert_eq!(admit_new(&mut n).unwrap_err(), vec!["spec.config"]);
}

#[test]
fn pruning_removes_only_unknown_fields() {
    let def = find("kubevirt.io", "virtualmachineinstancemigrations").unwrap();
    let mut m = json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
        "metadata": {"name": "m", "bogus": 1}, "spec": {"vmiName": "a", "extra": {"x": 1}}
    });
    let pruned = prune_unknown_fields(&def, &mut m);
    assert_eq!(pruned, vec![".metadata.bogus", ".spec.extra"]);
    assert_eq!(m["spec"], json!({"vmiName": "a"}));
    assert_eq!(m["metadata"], json!({"name": "m"}));
}

#[test]
fn replica_sets_scale() {
    let rs = find("kubevirt.io", "virtualmachineinstancereplicasets").unwrap();
    assert_eq!(
        scale_subresource(&rs).unwrap().spec_replicas_path,
        ".spec.replicas"
    );
    let vm = find("kubevirt.io", "virtualmachines").unwrap();
    assert!(scale_subresource(&vm).is_none());
}

#[test]
fn pvc_storage_request_may_grow_but_not_shrink() {
    let pvc = |size: &str| {
        json!({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "c", "namespace": "default"},
            "spec": {"accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": size}}}
        })
    };
    let mut old = pvc("1Gi");
    admit_new(&mut old).unwrap();
    let def = find_kind("v1", "PersistentVolumeClaim").unwrap();
    let mut grown = pvc("2Gi");
    admit(&def, Operation::Update, &mut grown, Some(&old)).unwrap();
    let mut shrunk = pvc("512Mi");
    let e = admit(&def, Operation::Update, &mut shrunk, Some(&old)).unwrap_err();
    assert_eq!(e.0[0].field, "spec.resources.requests.storage");
    assert!(e.0[0].message.contains("less than previous value"), "{e:?}");
}

#[test]
fn hyperconverged_node_failure_timing_is_validated() {
    let hco = |nf: Value| {
        json!({
            "apiVersion": "hco.kubevirt.io/v1beta1", "kind": "HyperConverged",
            "metadata": {"name": "kubevirt-hyperconverged", "namespace": "kubevirt-hyperconverged"},
            "spec": {"nodeFailure": nf}
        })
    };
    admit_new(&mut hco(
        json!({"leaseDurationSeconds": 10, "fenceMarginSeconds": 5}),
    ))
    .unwrap();
    admit_new(&mut hco(json!({}))).unwrap();
    assert_eq!(
        admit_new(&mut hco(json!({"leaseDurationSeconds": 2}))).unwrap_err(),
        vec!["spec.nodeFailure.leaseDurationSeconds"]
    );
    assert_eq!(
        admit_new(&mut hco(json!({"fenceMarginSeconds": 1}))).unwrap_err(),
        vec!["spec.nodeFailure.fenceMarginSeconds"]
    );
    assert!(admit_new(&mut hco(json!({"leaseDurationSeconds": -3}))).is_err());
    // What the components use.
    let t = ferrovirt_api::hco::node_failure_timing(&[hco(json!({"fenceMarginSeconds": 6}))]);
    assert_eq!((t.lease_duration_seconds, t.fence_margin_seconds), (16, 6));
    let t = ferrovirt_api::hco::node_failure_timing(&[]);
    assert_eq!((t.lease_duration_seconds, t.fence_margin_seconds), (16, 4));
}
