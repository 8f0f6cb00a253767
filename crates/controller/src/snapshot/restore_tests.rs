use super::*;
use serde_json::json;

fn ts(secs: i64) -> Timestamp {
    Timestamp::from_second(1_700_000_000 + secs).unwrap()
}

fn restore(target: &str, policy: Option<&str>) -> VirtualMachineRestore {
    let mut spec = json!({"target": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": target},
                          "virtualMachineSnapshotName": "snap1"});
    if let Some(p) = policy {
        spec["volumeRestorePolicy"] = json!(p);
    }
    serde_json::from_value(json!({
        "metadata": {"name": "r1", "namespace": "default", "uid": "ruid",
                     "creationTimestamp": "2023-11-14T22:13:20Z"},
        "spec": spec,
    }))
    .unwrap()
}

fn snapshot() -> VirtualMachineSnapshot {
    serde_json::from_value(json!({
        "metadata": {"name": "snap1", "namespace": "default"},
        "spec": {"source": {"kind": "VirtualMachine", "name": "vm1"}},
        "status": {"readyToUse": true, "phase": "Succeeded"}
    }))
    .unwrap()
}

fn vm_spec() -> serde_json::Value {
    json!({"runStrategy": "Always", "template": {"spec": {
        "domain": {"devices": {"interfaces": [{"name": "default", "masquerade": {}, "macAddress": "02:00:00:00:00:01"}]},
                   "firmware": {"uuid": "11111111-2222-3333-4444-555555555555", "serial": "S1"}},
        "volumes": [
            {"name": "root", "dataVolume": {"name": "vm1-root"}},
            {"name": "ci", "cloudInitNoCloud": {"userData": "x"}}
        ]}},
        "dataVolumeTemplates": [{"metadata": {"name": "vm1-root"}, "spec": {"source": {"blank": {}}}}]})
}

fn content() -> VirtualMachineSnapshotContent {
    serde_json::from_value(json!({
        "metadata": {"name": "vmsnapshot-content-u1", "namespace": "default"},
        "spec": {"virtualMachineSnapshotName": "snap1",
            "source": {"virtualMachine": {"metadata": {"name": "vm1", "namespace": "default"}, "spec": vm_spec()}},
            "volumeBackups": [{"volumeName": "root", "volumeSnapshotName": "vs-root",
                "persistentVolumeClaim": {"metadata": {"name": "vm1-root"},
                    "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "local",
                             "volumeName": "pvc-1", "resources": {"requests": {"storage": "1Gi"}}}}}]}
    }))
    .unwrap()
}

fn vm(name: &str, mark: Option<&str>) -> VirtualMachine {
    let mut spec = vm_spec();
    spec["runStrategy"] = json!("Halted");
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default", "uid": "vmuid"},
        "spec": spec,
        "status": {"restoreInProgress": mark}
    }))
    .unwrap()
}

fn bound(name: &str, pv: &str) -> PersistentVolumeClaim {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"volumeName": pv},
        "status": {"phase": "Bound"}
    }))
    .unwrap()
}

struct W {
    r: VirtualMachineRestore,
    target: Option<VirtualMachine>,
    running: bool,
    claims: BTreeMap<String, PersistentVolumeClaim>,
}

impl W {
    fn step(&self) -> RestoreStep {
        let (s, c) = (snapshot(), content());
        let nodes = BTreeMap::from([("vs-root".to_string(), "node1".to_string())]);
        let handles = BTreeMap::from([("vs-root".to_string(), "pvc-1/disk.img".to_string())]);
        step(&RestoreInput {
            restore: &self.r,
            snapshot: Some(&s),
            content: Some(&c),
            target: self.target.as_ref(),
            target_running: self.running,
            claims: &self.claims,
            snapshot_nodes: &nodes,
            snapshot_handles: &handles,
            now: ts(5),
        })
    }
}

#[test]
fn restore_into_the_same_vm_with_new_claims() {
    let mut w = W {
        r: restore("vm1", None),
        target: Some(vm("vm1", None)),
        running: false,
        claims: BTreeMap::new(),
    };
    assert_eq!(w.step().mark, Some(RestoreMark::Set("r1".into())));
    w.target = Some(vm("vm1", Some("r1")));
    let s = w.step();
    assert_eq!(s.create_claims.len(), 1);
    let c = &s.create_claims[0];
    assert_eq!(c.metadata.name.as_deref(), Some("restore-ruid-root"));
    let cs = c.spec.as_ref().unwrap();
    assert_eq!(cs.data_source.as_ref().unwrap().name, "vs-root");
    assert_eq!(cs.volume_name, None, "a new claim gets a new volume");
    assert_eq!(
        c.metadata.annotations.as_ref().unwrap()[crate::storage::pvc::SELECTED_NODE],
        "node1"
    );
    assert_eq!(
        c.metadata.owner_references.as_ref().unwrap()[0].uid,
        "vmuid"
    );
    let restores = s.status.restores.as_ref().unwrap();
    assert_eq!(restores[0].persistent_volume_claim, "restore-ruid-root");
    w.claims.insert(
        "restore-ruid-root".into(),
        bound("restore-ruid-root", "pvc-9"),
    );
    let s = w.step();
    let spec = s.update_vm_spec.unwrap();
    let vols = spec
        .template
        .spec
        .as_ref()
        .unwrap()
        .volumes
        .as_ref()
        .unwrap();
    assert_eq!(
        vols[0].persistent_volume_claim.as_ref().unwrap().claim_name,
        "restore-ruid-root"
    );
    assert!(vols[0].data_volume.is_none());
    assert!(spec.data_volume_templates.is_none());
    // Same VM: identity kept.
    let t = spec.template.spec.as_ref().unwrap();
    assert_eq!(
        t.domain.firmware.as_ref().unwrap().serial.as_deref(),
        Some("S1")
    );
    let t = w.target.as_mut().unwrap();
    t.spec = Some(*spec);
    // Admission may default the written spec: completion is the annotation, not equality.
    t.spec
        .as_mut()
        .unwrap()
        .template
        .spec
        .as_mut()
        .unwrap()
        .hostname = Some("x".into());
    assert!(w.step().update_vm_spec.is_some(), "not yet annotated");
    t_annotate(w.target.as_mut().unwrap(), &w.r);
    let s = w.step();
    assert_eq!(s.status.complete, Some(true));
    assert!(s.status.restore_time.is_some());
    assert_eq!(s.mark, Some(RestoreMark::Clear("r1".into())));
}

#[test]
fn restore_into_a_new_vm_creates_it_with_a_new_identity() {
    let mut w = W {
        r: restore("vm2", Some("PrefixTargetName")),
        target: None,
        running: false,
        claims: BTreeMap::new(),
    };
    let s = w.step();
    let created = s.create_vm.unwrap();
    assert_eq!(created.metadata.name.as_deref(), Some("vm2"));
    let spec = created.spec.as_ref().unwrap();
    assert_eq!(
        spec.run_strategy,
        Some(ferrovirt_api::kubevirt::vm::RunStrategy::Halted)
    );
    let t = spec.template.spec.as_ref().unwrap();
    assert_eq!(t.domain.firmware.as_ref().unwrap().uuid, None);
    assert_eq!(t.domain.firmware.as_ref().unwrap().serial, None);
    assert_eq!(
        t.domain.devices.interfaces.as_ref().unwrap()[0].mac_address,
        None
    );
    assert_eq!(
        t.volumes.as_ref().unwrap()[0]
            .persistent_volume_claim
            .as_ref()
            .unwrap()
            .claim_name,
        "vm2-root"
    );
    let mut created = *created;
    created.metadata.uid = Some("vm2uid".into());
    created.status = Some(Default::default());
    created.status.as_mut().unwrap().restore_in_progress = Some("r1".into());
    w.target = Some(created);
    let s = w.step();
    assert_eq!(
        s.create_claims[0].metadata.name.as_deref(),
        Some("vm2-root")
    );
    w.claims
        .insert("vm2-root".into(), bound("vm2-root", "pvc-9"));
    let spec = w.step().update_vm_spec.unwrap();
    assert_eq!(
        spec.run_strategy,
        Some(ferrovirt_api::kubevirt::vm::RunStrategy::Always),
        "the captured run strategy once restored"
    );
}

#[test]
fn in_place_reverts_the_volume() {
    let mut w = W {
        r: restore("vm1", Some("InPlace")),
        target: Some(vm("vm1", Some("r1"))),
        running: false,
        claims: BTreeMap::from([("vm1-root".to_string(), bound("vm1-root", "pvc-1"))]),
    };
    let s = w.step();
    assert!(s.create_claims.is_empty());
    assert_eq!(
        s.reverts,
        [Revert {
            claim: "vm1-root".into(),
            handle: "pvc-1/disk.img".into()
        }]
    );
    w.r.status = Some(s.status.clone());
    let s = w.step();
    assert!(s.reverts.is_empty());
    // Claim recreated on another volume: refused with the reason.
    let mut w = W {
        r: restore("vm1", Some("InPlace")),
        target: Some(vm("vm1", Some("r1"))),
        running: false,
        claims: BTreeMap::from([("vm1-root".to_string(), bound("vm1-root", "pvc-2"))]),
    };
    let s = w.step();
    assert!(s.reverts.is_empty());
    w.r.status = Some(s.status);
    assert!(
        w.r.status
            .as_ref()
            .unwrap()
            .conditions
            .as_ref()
            .unwrap()
            .iter()
            .any(|c| c.type_ == "Failure"
                && c.message
                    .as_deref()
                    .unwrap()
                    .contains("no longer on the snapshotted volume"))
    );
}

#[test]
fn a_running_target_waits_or_fails_by_policy() {
    let mut w = W {
        r: restore("vm1", None),
        target: Some(vm("vm1", None)),
        running: true,
        claims: BTreeMap::new(),
    };
    let s = w.step();
    assert!(s.mark.is_none() && s.status.complete == Some(false));
    assert!(s.requeue.is_some());
    w.r.spec.as_mut().unwrap().target_readiness_policy = Some("FailImmediate".into());
    let s = w.step();
    assert!(s.requeue.is_none());
    assert!(
        s.status
            .conditions
            .unwrap()
            .iter()
            .any(|c| c.type_ == "Failure" && c.status == "True")
    );
}

#[test]
fn stop_target_stops_a_running_target_once_no_snapshot_runs() {
    let mut w = W {
        r: restore("vm1", None),
        target: Some(vm("vm1", None)),
        running: true,
        claims: BTreeMap::new(),
    };
    w.r.spec.as_mut().unwrap().target_readiness_policy = Some("StopTarget".into());
    let s = w.step();
    assert!(s.stop_target && s.mark.is_none() && s.requeue.is_some());
    assert_eq!(s.status.complete, Some(false));
    // A snapshot of the target in progress: wait for it (the stop would be refused).
    w.target
        .as_mut()
        .unwrap()
        .status
        .get_or_insert_default()
        .snapshot_in_progress = Some("snap2".into());
    let s = w.step();
    assert!(!s.stop_target && s.requeue.is_some());
    // Stopped: the restore goes on as for a stopped target (the mark is set first).
    w.target.as_mut().unwrap().status = None;
    w.running = false;
    let s = w.step();
    assert!(!s.stop_target);
    assert_eq!(s.mark, Some(RestoreMark::Set("r1".into())));
}

fn t_annotate(vm: &mut VirtualMachine, r: &VirtualMachineRestore) {
    vm.metadata
        .annotations
        .get_or_insert_default()
        .insert(LAST_RESTORE_ANNOTATION.into(), restore_id(r));
}

#[test]
fn patches_apply_to_the_vm_and_a_bad_one_is_named() {
    let vm: VirtualMachine = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "t", "labels": {"a": "1"}},
        "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"devices": {}}}}},
    }))
    .unwrap();
    let patches = vec![
        r#"{"op": "remove", "path": "/metadata/labels/a"}"#.to_string(),
        r#"{"op": "replace", "path": "/spec/runStrategy", "value": "Always"}"#.to_string(),
    ];
    let all = apply_patches(&vm, &patches, false).unwrap();
    assert!(all.metadata.labels.unwrap().is_empty());
    let spec_only = apply_patches(&vm, &patches, true).unwrap();
    assert_eq!(spec_only.metadata.labels.unwrap()["a"], "1");
    assert_eq!(
        serde_json::to_value(spec_only.spec.unwrap().run_strategy).unwrap(),
        "Always"
    );
    let bad = vec![r#"{"op": "remove", "path": "/metadata/labels/nope"}"#.to_string()];
    assert!(
        apply_patches(&vm, &bad, false)
            .unwrap_err()
            .contains("spec.patches")
    );
}
