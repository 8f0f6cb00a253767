use super::*;
use serde_json::json;

fn ts(secs: i64) -> Timestamp {
    Timestamp::from_second(1_700_000_000 + secs).unwrap()
}

fn clone_of(spec: serde_json::Value) -> VirtualMachineClone {
    serde_json::from_value(json!({
        "metadata": {"name": "c1", "namespace": "default", "uid": "abcdef0123"},
        "spec": spec,
    }))
    .unwrap()
}

fn vm_source() -> VirtualMachineClone {
    clone_of(json!({
        "source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "vm1"},
        "target": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "vm2"},
        "labelFilters": ["*", "!secret/*"],
        "template": {"labelFilters": ["keep"]},
        "newMacAddresses": {"default": "02:00:00:00:00:42"},
        "patches": ["{\"op\": \"add\", \"path\": \"/metadata/labels/cloned\", \"value\": \"yes\"}"],
    }))
}

fn captured() -> CapturedVirtualMachine {
    serde_json::from_value(json!({
        "metadata": {"name": "vm1", "labels": {"app": "x", "secret/a": "1"},
                     "annotations": {"note": "n"}},
        "spec": {"runStrategy": "Always", "template": {
            "metadata": {"labels": {"keep": "1", "drop": "2"}},
            "spec": {"domain": {"devices": {"interfaces": [{"name": "default", "masquerade": {}}]}}}}},
    }))
    .unwrap()
}

fn ready_snapshot() -> VirtualMachineSnapshot {
    serde_json::from_value(json!({"metadata": {"name": "tmp-snapshot-abcdef0123"},
        "status": {"phase": "Succeeded", "readyToUse": true}}))
    .unwrap()
}

fn content() -> VirtualMachineSnapshotContent {
    serde_json::from_value(json!({"metadata": {"name": "x"},
        "spec": {"source": {"virtualMachine": captured()}}}))
    .unwrap()
}

#[test]
fn the_patches_carry_the_clone_s_changes() {
    let p = clone_patches(&vm_source(), &captured());
    let ops: Vec<serde_json::Value> = p.iter().map(|s| serde_json::from_str(s).unwrap()).collect();
    let has = |op: &str, path: &str| ops.iter().any(|o| o["op"] == op && o["path"] == path);
    assert!(has("remove", "/metadata/labels/secret~1a"), "{ops:?}");
    assert!(!has("remove", "/metadata/labels/app"));
    assert!(has("add", "/metadata/annotations/note"));
    assert!(has("remove", "/spec/template/metadata/labels/drop"));
    assert!(!has("remove", "/spec/template/metadata/labels/keep"));
    assert!(has(
        "add",
        "/spec/template/spec/domain/devices/interfaces/0/macAddress"
    ));
    let fw = ops
        .iter()
        .find(|o| o["path"] == "/spec/template/spec/domain/firmware")
        .unwrap();
    assert_eq!(fw["value"]["serial"], "abcdef0123", "a generated serial");
    assert_eq!(
        ops.last().unwrap()["path"],
        "/metadata/labels/cloned",
        "user patches last"
    );
    // They apply to the VM the restore creates.
    let vm: VirtualMachine = serde_json::from_value(json!({
        "metadata": {"name": "vm2", "labels": {"app": "x", "secret/a": "1"}, "annotations": {}},
        "spec": captured().spec,
    }))
    .unwrap();
    let out = super::super::restore::apply_patches(&vm, &p, false).unwrap();
    let labels = out.metadata.labels.unwrap();
    assert!(labels.contains_key("app") && !labels.contains_key("secret/a"));
    assert_eq!(labels["cloned"], "yes");
    let t = out.spec.unwrap().template;
    assert_eq!(
        t.spec.unwrap().domain.devices.interfaces.unwrap()[0]
            .mac_address
            .as_deref(),
        Some("02:00:00:00:00:42")
    );
}

#[test]
fn a_vm_clone_goes_through_snapshot_restore_and_cleans_up() {
    let c = vm_source();
    let vm: VirtualMachine = serde_json::from_value(json!({"metadata": {"name": "vm1"}})).unwrap();
    let mut input = CloneInput {
        clone: &c,
        source_vm: Some(&vm),
        snapshot: None,
        content: None,
        restore: None,
        target_exists: false,
        now: ts(0),
    };
    let s1 = step(&input);
    let snap = s1.create_snapshot.unwrap();
    assert_eq!(
        snap.metadata.name.as_deref(),
        Some("tmp-snapshot-abcdef0123")
    );
    assert_eq!(
        snap.metadata.owner_references.unwrap()[0].kind,
        "VirtualMachineClone"
    );
    assert_eq!(s1.status.phase.as_deref(), Some(SNAPSHOT_IN_PROGRESS));
    assert_eq!(s1.status.target_name.as_deref(), Some("vm2"));

    let snap = ready_snapshot();
    let content = content();
    input.snapshot = Some(&snap);
    input.content = Some(&content);
    let s2 = step(&input);
    let r = s2.create_restore.unwrap();
    let rs = r.spec.unwrap();
    assert_eq!(rs.target.name, "vm2");
    assert_eq!(rs.virtual_machine_snapshot_name, "tmp-snapshot-abcdef0123");
    assert_eq!(rs.volume_restore_policy.as_deref(), Some("RandomizeNames"));
    assert!(!rs.patches.unwrap().is_empty());
    assert_eq!(s2.status.phase.as_deref(), Some(CREATING_TARGET_VM));

    let restore: VirtualMachineRestore =
        serde_json::from_value(json!({"metadata": {"name": "tmp-restore-abcdef0123"}})).unwrap();
    input.restore = Some(&restore);
    input.target_exists = true;
    let s3 = step(&input);
    assert_eq!(s3.status.phase.as_deref(), Some(RESTORE_IN_PROGRESS));
    let mut done = restore.clone();
    done.status = Some(serde_json::from_value(json!({"complete": true})).unwrap());
    let s4 = step(&CloneInput {
        restore: Some(&done),
        ..input
    });
    assert_eq!(s4.status.phase.as_deref(), Some(SUCCEEDED));
    let ready = s4
        .status
        .conditions
        .as_ref()
        .unwrap()
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(ready.status, "True");
    assert_eq!(s4.delete_restore.as_deref(), Some("tmp-restore-abcdef0123"));
    assert_eq!(
        s4.delete_snapshot.as_deref(),
        Some("tmp-snapshot-abcdef0123")
    );
}

#[test]
fn failures_say_why() {
    let c = vm_source();
    let vm: VirtualMachine = serde_json::from_value(json!({"metadata": {"name": "vm1"}})).unwrap();
    let input = CloneInput {
        clone: &c,
        source_vm: Some(&vm),
        snapshot: None,
        content: None,
        restore: None,
        target_exists: true,
        now: ts(0),
    };
    let s = step(&input);
    assert_eq!(s.status.phase.as_deref(), Some(FAILED));
    let msg = s.status.conditions.unwrap()[0].message.clone().unwrap();
    assert!(msg.contains("vm2 already exists"), "{msg}");

    let failed: VirtualMachineSnapshot = serde_json::from_value(json!({"metadata": {"name": "s"},
        "status": {"phase": "Failed", "error": {"message": "boom"}}}))
    .unwrap();
    let s = step(&CloneInput {
        snapshot: Some(&failed),
        target_exists: false,
        ..input
    });
    assert_eq!(s.status.phase.as_deref(), Some(FAILED));
    assert!(
        s.status.conditions.unwrap()[0]
            .message
            .as_deref()
            .unwrap()
            .contains("boom")
    );
}

#[test]
fn a_snapshot_source_is_used_as_is_and_kept() {
    let c = clone_of(json!({
        "source": {"apiGroup": "snapshot.kubevirt.io", "kind": "VirtualMachineSnapshot", "name": "snap1"},
    }));
    assert_eq!(target_name(&c), "clone-abcdef01");
    assert_eq!(used_snapshot(&c), "snap1");
    let missing = step(&CloneInput {
        clone: &c,
        source_vm: None,
        snapshot: None,
        content: None,
        restore: None,
        target_exists: false,
        now: ts(0),
    });
    assert!(missing.create_snapshot.is_none());
    let snap = ready_snapshot();
    let content = content();
    let restore: VirtualMachineRestore =
        serde_json::from_value(json!({"metadata": {"name": "r"}, "status": {"complete": true}}))
            .unwrap();
    let done = step(&CloneInput {
        clone: &c,
        source_vm: None,
        snapshot: Some(&snap),
        content: Some(&content),
        restore: Some(&restore),
        target_exists: true,
        now: ts(0),
    });
    assert_eq!(done.status.phase.as_deref(), Some(SUCCEEDED));
    assert!(done.delete_snapshot.is_none(), "the user's snapshot stays");
}
