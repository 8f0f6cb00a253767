use super::online::ActiveVmi;
use super::*;
use serde_json::json;

fn ts(secs: i64) -> Timestamp {
    Timestamp::from_second(1_700_000_000 + secs).unwrap()
}

fn snapshot(deadline: Option<&str>) -> VirtualMachineSnapshot {
    let mut spec =
        json!({"source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "vm1"}});
    if let Some(d) = deadline {
        spec["failureDeadline"] = json!(d);
    }
    serde_json::from_value(json!({
        "metadata": {"name": "snap1", "namespace": "default", "uid": "u1",
                     "creationTimestamp": "2023-11-14T22:13:20Z"},
        "spec": spec,
    }))
    .unwrap()
}

fn vm() -> VirtualMachine {
    serde_json::from_value(json!({
        "metadata": {"name": "vm1", "namespace": "default", "uid": "vmuid"},
        "spec": {"runStrategy": "Halted", "template": {"spec": {
            "domain": {"devices": {}},
            "volumes": [
                {"name": "root", "dataVolume": {"name": "vm1-root"}},
                {"name": "data", "persistentVolumeClaim": {"claimName": "vm1-data"}},
                {"name": "ci", "cloudInitNoCloud": {"userData": "x"}}
            ]}}}
    }))
    .unwrap()
}

fn claims() -> BTreeMap<String, PersistentVolumeClaim> {
    ["vm1-root", "vm1-data"]
        .into_iter()
        .map(|n| {
            let c: PersistentVolumeClaim = serde_json::from_value(json!({
                "metadata": {"name": n, "namespace": "default"},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
            }))
            .unwrap();
            (n.to_string(), c)
        })
        .collect()
}

struct World {
    snap: VirtualMachineSnapshot,
    vm: Option<VirtualMachine>,
    vmi: Option<ActiveVmi>,
    content: Option<VirtualMachineSnapshotContent>,
    vss: BTreeMap<String, VolumeSnapshot>,
    claims: BTreeMap<String, PersistentVolumeClaim>,
    now: Timestamp,
}

impl World {
    fn new() -> Self {
        World {
            snap: snapshot(None),
            vm: Some(vm()),
            vmi: None,
            content: None,
            vss: BTreeMap::new(),
            claims: claims(),
            now: ts(1),
        }
    }
    fn step(&self) -> SnapshotStep {
        step(&SnapshotInput {
            snapshot: &self.snap,
            vm: self.vm.as_ref(),
            vmi: self.vmi.clone(),
            content: self.content.as_ref(),
            volume_snapshots: &self.vss,
            claims: &self.claims,
            now: self.now,
        })
    }
    /// Applies a step the way the runtime does.
    fn apply(&mut self, s: &SnapshotStep) {
        if let Some(mut c) = s.create_content.clone() {
            c.metadata.uid = Some("cuid".into());
            self.content = Some(c);
        }
        for vs in &s.create_volume_snapshots {
            self.vss
                .insert(vs.metadata.name.clone().unwrap(), vs.clone());
        }
        if let Some(st) = &s.content_status {
            self.content.as_mut().unwrap().status = Some(st.clone());
        }
        if let VmMark::Set(n) = &s.vm_mark {
            self.vm
                .as_mut()
                .unwrap()
                .status
                .get_or_insert_default()
                .snapshot_in_progress = Some(n.clone());
        }
        if let VmMark::Clear(_) = &s.vm_mark {
            self.vm
                .as_mut()
                .unwrap()
                .status
                .get_or_insert_default()
                .snapshot_in_progress = None;
        }
        self.snap.status = Some(s.status.clone());
    }
}

fn cond<'a>(st: &'a SnapshotStatus, t: &str) -> &'a Condition {
    st.conditions
        .as_ref()
        .unwrap()
        .iter()
        .find(|c| c.type_ == t)
        .unwrap()
}

#[test]
fn offline_snapshot_runs_to_succeeded() {
    let mut w = World::new();
    let s1 = w.step();
    assert_eq!(s1.vm_mark, VmMark::Set("snap1".into()));
    let content = s1.create_content.clone().unwrap();
    assert_eq!(
        content.metadata.name.as_deref(),
        Some("vmsnapshot-content-u1")
    );
    let spec = content.spec.as_ref().unwrap();
    let backups = spec.volume_backups.as_ref().unwrap();
    assert_eq!(backups.len(), 2);
    assert_eq!(
        backups[0].volume_snapshot_name.as_deref(),
        Some("vmsnapshot-u1-volume-root")
    );
    let captured = spec.source.virtual_machine.as_ref().unwrap();
    assert_eq!(
        captured.metadata.as_ref().unwrap().name.as_deref(),
        Some("vm1")
    );
    assert_eq!(s1.status.phase.as_deref(), Some(IN_PROGRESS));
    let vols = s1.status.snapshot_volumes.as_ref().unwrap();
    assert_eq!(vols.included_volumes.as_deref().unwrap(), ["root", "data"]);
    assert_eq!(vols.excluded_volumes.as_deref().unwrap(), ["ci"]);
    w.apply(&s1);

    let s2 = w.step();
    assert_eq!(s2.create_volume_snapshots.len(), 2);
    let vs = &s2.create_volume_snapshots[0];
    assert_eq!(
        vs.spec
            .as_ref()
            .unwrap()
            .source
            .persistent_volume_claim_name
            .as_deref(),
        Some("vm1-root")
    );
    assert_eq!(s2.status.phase.as_deref(), Some(IN_PROGRESS));
    assert_eq!(cond(&s2.status, "Progressing").status, "True");
    w.apply(&s2);
    assert_eq!(w.step().status.phase.as_deref(), Some(IN_PROGRESS));

    for vs in w.vss.values_mut() {
        vs.status = Some(ferrovirt_api::volumesnapshot::VolumeSnapshotStatus {
            ready_to_use: Some(true),
            ..Default::default()
        });
    }
    let s3 = w.step();
    assert_eq!(s3.status.phase.as_deref(), Some(SUCCEEDED));
    assert_eq!(s3.status.ready_to_use, Some(true));
    assert!(s3.status.creation_time.is_some());
    assert_eq!(cond(&s3.status, "Ready").status, "True");
    assert_eq!(cond(&s3.status, "Progressing").status, "False");
    assert_eq!(s3.content_status.as_ref().unwrap().ready_to_use, Some(true));
    assert_eq!(s3.vm_mark, VmMark::Clear("snap1".into()));
    w.apply(&s3);
    // Terminal: nothing more happens.
    let s4 = w.step();
    assert!(s4.create_content.is_none() && s4.create_volume_snapshots.is_empty());
    assert_eq!(s4.status.phase.as_deref(), Some(SUCCEEDED));
}

#[test]
fn a_missing_source_fails_at_the_deadline_with_the_reason() {
    let mut w = World::new();
    w.snap = snapshot(Some("10s"));
    w.vm = None;
    let s = w.step();
    assert_eq!(s.status.phase.as_deref(), Some(IN_PROGRESS));
    let requeue = s.requeue.unwrap();
    assert!(requeue <= Duration::from_secs(9), "{requeue:?}");
    w.now = ts(11);
    let s = w.step();
    assert_eq!(s.status.phase.as_deref(), Some(FAILED));
    let msg = s.status.error.unwrap().message.unwrap();
    assert!(msg.contains("failureDeadline"), "{msg}");
    assert!(msg.contains("vm1 does not exist"), "{msg}");
    assert_eq!(s.requeue, None);
}

#[test]
fn a_running_vm_is_snapshotted_online_all_claims_at_once() {
    let mut w = World::new();
    w.vmi = Some(ActiveVmi {
        uid: "vmi-uid".into(),
        node: Some("node1".into()),
    });
    let s1 = w.step();
    assert_eq!(s1.vm_mark, VmMark::Set("snap1".into()));
    assert!(s1.create_content.is_some(), "the VM is captured first");
    assert!(s1.online_take.is_none());
    w.apply(&s1);

    let s2 = w.step();
    assert!(
        s2.create_volume_snapshots.is_empty(),
        "no claim-sourced VolumeSnapshot of a disk in use"
    );
    let take = s2.online_take.clone().unwrap();
    assert_eq!(take.node, "node1");
    assert_eq!(take.vmi_uid, "vmi-uid");
    let vols: Vec<(&str, &str)> = take
        .volumes
        .iter()
        .map(|v| (v.volume.as_str(), v.claim.as_str()))
        .collect();
    assert_eq!(vols, [("root", "vm1-root"), ("data", "vm1-data")]);
    assert_eq!(take.volumes[0].volume_snapshot, "vmsnapshot-u1-volume-root");
    // The default 5m failureDeadline leaves more than the freeze bound.
    assert_eq!(take.freeze_timeout, super::online::MAX_FREEZE);
    assert_eq!(s2.status.phase.as_deref(), Some(IN_PROGRESS));
    w.apply(&s2);

    // The loop took it and recorded ready VolumeSnapshots and the indications.
    let content = w.content.clone().unwrap();
    for v in &take.volumes {
        let mut vs =
            super::online::volume_snapshot(&content, v, ferrovirt_api::volumesnapshot::DRIVER);
        vs.status = Some(ferrovirt_api::volumesnapshot::VolumeSnapshotStatus {
            ready_to_use: Some(true),
            ..Default::default()
        });
        w.vss.insert(v.volume_snapshot.clone(), vs);
    }
    let st = w.snap.status.get_or_insert_default();
    st.indications = Some(vec!["Online".into(), "GuestAgent".into()]);
    let s3 = w.step();
    assert!(s3.online_take.is_none());
    assert_eq!(s3.status.phase.as_deref(), Some(SUCCEEDED));
    assert_eq!(
        s3.status.indications.as_deref().unwrap(),
        ["Online", "GuestAgent"],
        "the indications the take recorded stay"
    );
    assert_eq!(s3.vm_mark, VmMark::Clear("snap1".into()));
}

#[test]
fn an_online_snapshot_waits_for_a_placed_vmi_and_fails_at_the_deadline() {
    let mut w = World::new();
    w.snap = snapshot(Some("10s"));
    w.vmi = Some(ActiveVmi {
        uid: "vmi-uid".into(),
        node: None,
    });
    let s1 = w.step();
    w.apply(&s1);
    let s2 = w.step();
    assert!(s2.online_take.is_none());
    assert!(
        cond(&s2.status, "Progressing")
            .message
            .as_deref()
            .unwrap()
            .contains("not on a node")
    );
    // The freeze is bounded by the deadline left.
    w.vmi.as_mut().unwrap().node = Some("n".into());
    w.now = ts(7);
    let take = w.step().online_take.unwrap();
    assert!(take.freeze_timeout <= Duration::from_secs(4), "{take:?}");
    w.now = ts(11);
    let s = w.step();
    assert!(s.online_take.is_none());
    assert_eq!(s.status.phase.as_deref(), Some(FAILED));
}

#[test]
fn one_snapshot_at_a_time_and_none_during_a_restore() {
    let mut w = World::new();
    w.vm.as_mut()
        .unwrap()
        .status
        .get_or_insert_default()
        .snapshot_in_progress = Some("other".into());
    let s = w.step();
    assert!(s.create_content.is_none());
    assert_eq!(s.vm_mark, VmMark::Leave);
    assert!(
        cond(&s.status, "Progressing")
            .message
            .as_deref()
            .unwrap()
            .contains("other")
    );
    let mut w = World::new();
    w.vm.as_mut()
        .unwrap()
        .status
        .get_or_insert_default()
        .restore_in_progress = Some("r".into());
    assert!(w.step().create_content.is_none());
}

#[test]
fn missing_claims_wait() {
    let mut w = World::new();
    w.claims.remove("vm1-data");
    let s = w.step();
    assert!(s.create_content.is_none());
    assert!(
        cond(&s.status, "Progressing")
            .message
            .as_deref()
            .unwrap()
            .contains("vm1-data")
    );
}

#[test]
fn retained_contents_are_not_owned_by_their_snapshot() {
    let mut w = World::new();
    let owned = w.step().create_content.unwrap();
    assert_eq!(owned.metadata.owner_references.unwrap()[0].name, "snap1");
    w.snap.spec.as_mut().unwrap().deletion_policy = Some("Retain".into());
    let kept = w.step().create_content.unwrap();
    assert!(kept.metadata.owner_references.is_none());
}
