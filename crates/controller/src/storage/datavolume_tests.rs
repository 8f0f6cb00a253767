use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use serde_json::json;

use super::*;
use ferrovirt_api::cdi::ClaimPropertySet;

fn dv_spec(v: serde_json::Value) -> DataVolumeSpec {
    serde_json::from_value(v).unwrap()
}

fn t(s: i64) -> Time {
    Time(Timestamp::from_second(s).unwrap())
}

fn rwx_profile() -> StorageProfileStatus {
    StorageProfileStatus {
        claim_property_sets: Some(vec![ClaimPropertySet {
            access_modes: Some(vec!["ReadWriteMany".into()]),
            volume_mode: Some("Filesystem".into()),
        }]),
        ..Default::default()
    }
}

#[test]
fn storage_spec_completed_from_profile() {
    let s = dv_spec(
        json!({"source": {"blank": {}}, "storage": {"resources": {"requests": {"storage": "1Gi"}}}}),
    );
    let c = claim_spec(&s, Some(&rwx_profile()), Some("local"), None).unwrap();
    assert_eq!(c.storage_class_name.as_deref(), Some("local"));
    assert_eq!(c.access_modes.unwrap(), vec!["ReadWriteMany"]);
    assert_eq!(c.volume_mode.as_deref(), Some("Filesystem"));
    assert_eq!(
        c.resources.unwrap().requests.unwrap()["storage"],
        Quantity("1Gi".into())
    );
}

#[test]
fn storage_spec_keeps_given_fields_and_uses_source_size() {
    let s = dv_spec(json!({"source": {"pvc": {"name": "a"}}, "storage": {
        "storageClassName": "shared", "accessModes": ["ReadWriteOnce"], "volumeMode": "Block"}}));
    let size = Quantity("2Gi".into());
    let c = claim_spec(&s, Some(&rwx_profile()), Some("local"), Some(&size)).unwrap();
    assert_eq!(c.storage_class_name.as_deref(), Some("shared"));
    assert_eq!(c.access_modes.unwrap(), vec!["ReadWriteOnce"]);
    assert_eq!(c.volume_mode.as_deref(), Some("Block"));
    assert_eq!(c.resources.unwrap().requests.unwrap()["storage"], size);
}

#[test]
fn storage_spec_errors() {
    let s = dv_spec(json!({"storage": {"resources": {"requests": {"storage": "1Gi"}}}}));
    assert!(
        claim_spec(&s, None, None, None)
            .unwrap_err()
            .contains("default StorageClass")
    );
    assert!(
        claim_spec(&s, None, Some("x"), None)
            .unwrap_err()
            .contains("claimPropertySets")
    );
    let s = dv_spec(json!({"storage": {}}));
    assert!(
        claim_spec(&s, Some(&rwx_profile()), Some("x"), None)
            .unwrap_err()
            .contains("storage is required")
    );
    let s = dv_spec(json!({}));
    assert!(claim_spec(&s, None, None, None).is_err());
    let s = dv_spec(json!({"pvc": {"accessModes": ["ReadWriteOnce"]}}));
    assert_eq!(
        claim_spec(&s, None, None, None)
            .unwrap()
            .access_modes
            .unwrap(),
        vec!["ReadWriteOnce"]
    );
}

#[test]
fn sources() {
    let s = dv_spec(json!({"source": {"http": {"url": "http://x"}}}));
    assert_eq!(source_kind(&s, "ns"), Ok(SourceKind::Http));
    let s = dv_spec(json!({"source": {"pvc": {"name": "a"}}}));
    assert_eq!(
        source_kind(&s, "ns"),
        Ok(SourceKind::Pvc {
            namespace: "ns".into(),
            name: "a".into()
        })
    );
    let s = dv_spec(json!({"source": {"registry": {"url": "docker://x"}}}));
    assert_eq!(source_kind(&s, "ns"), Ok(SourceKind::Registry));
    let s = dv_spec(json!({"source": {"s3": {"url": "s3://x"}}}));
    assert!(source_kind(&s, "ns").unwrap_err().contains("s3"));
    let s = dv_spec(json!({"source": {}}));
    assert!(source_kind(&s, "ns").is_err());
}

#[test]
fn archive_content_is_refused_naming_the_field() {
    for src in [
        json!({"http": {"url": "http://x/a.tar"}}),
        json!({"upload": {}}),
        json!({"pvc": {"name": "a"}}),
    ] {
        let s = dv_spec(json!({"source": src, "contentType": "archive"}));
        let err = source_kind(&s, "ns").unwrap_err();
        assert!(err.starts_with("spec.contentType"), "{err}");
        assert_eq!(err, ARCHIVE_REFUSED);
    }
    for ct in ["kubevirt", ""] {
        let s = dv_spec(json!({"source": {"http": {"url": "http://x"}}, "contentType": ct}));
        assert_eq!(source_kind(&s, "ns"), Ok(SourceKind::Http));
    }
}

#[test]
fn phases_progress_and_conditions() {
    let st = status_for(
        None,
        "c",
        &Stage::InProgress {
            clone: false,
            progress: Some(45.0),
        },
        0,
        &t(1),
    );
    assert_eq!(st.phase.as_deref(), Some("ImportInProgress"));
    assert_eq!(st.progress.as_deref(), Some("45.00%"));
    let running = st
        .conditions
        .as_ref()
        .unwrap()
        .iter()
        .find(|c| c.type_ == "Running")
        .unwrap();
    assert_eq!(running.status, "True");
    let done = status_for(Some(&st), "c", &Stage::Succeeded, 0, &t(2));
    assert_eq!(done.phase.as_deref(), Some("Succeeded"));
    assert_eq!(done.progress.as_deref(), Some("100.0%"));
    let conds = done.conditions.as_ref().unwrap();
    let bound = conds.iter().find(|c| c.type_ == "Bound").unwrap();
    assert_eq!(
        bound.last_transition_time,
        Some(t(1)),
        "Bound did not change"
    );
    let ready = conds.iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.last_transition_time.clone()),
        ("True", Some(t(2)))
    );

    let failed = status_for(
        Some(&st),
        "c",
        &Stage::Failed {
            reason: "Error".into(),
            message: "checksum mismatch".into(),
        },
        1,
        &t(3),
    );
    assert_eq!(failed.phase.as_deref(), Some("Failed"));
    assert_eq!(failed.progress.as_deref(), Some("45.00%"));
    assert_eq!(failed.restart_count, Some(1));
    let r = failed
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "Running")
        .unwrap();
    assert_eq!(r.message.as_deref(), Some("checksum mismatch"));

    let w = status_for(None, "c", &Stage::WaitForFirstConsumer, 0, &t(1));
    assert_eq!(w.phase.as_deref(), Some("WaitForFirstConsumer"));
    let c = status_for(None, "c", &Stage::Scheduled { clone: true }, 0, &t(1));
    assert_eq!(c.phase.as_deref(), Some("CloneScheduled"));
    let p = status_for(
        None,
        "c",
        &Stage::ClaimPending {
            message: "x".into(),
        },
        0,
        &t(1),
    );
    assert_eq!(
        (p.phase.as_deref(), p.progress.as_deref()),
        (Some("Pending"), Some("N/A"))
    );
}

#[test]
fn heartbeat_only_is_no_change() {
    let a = status_for(None, "c", &Stage::Succeeded, 0, &t(1));
    let b = status_for(Some(&a), "c", &Stage::Succeeded, 0, &t(2));
    assert!(!status_changed(Some(&a), &b));
    assert!(status_changed(None, &b));
}

#[test]
fn progress_format_and_backoff() {
    assert_eq!(format_progress(45.0), "45.00%");
    assert_eq!(format_progress(123.0), "100.00%");
    assert_eq!(
        retry_delay(Duration::from_secs(2), 1),
        Duration::from_secs(2)
    );
    assert_eq!(
        retry_delay(Duration::from_secs(2), 3),
        Duration::from_secs(8)
    );
    assert_eq!(
        retry_delay(Duration::from_secs(2), 40),
        Duration::from_secs(300)
    );
}

#[test]
fn templates_become_owned_datavolumes() {
    let vm: VirtualMachine = serde_json::from_value(json!({
        "metadata": {"name": "vm", "namespace": "ns", "uid": "u1"},
        "spec": {"template": {"spec": {"domain": {"devices": {}}}},
          "dataVolumeTemplates": [
            {"metadata": {"name": "root", "labels": {"a": "b"}},
             "spec": {"source": {"blank": {}}, "storage": {"resources": {"requests": {"storage": "1Gi"}}}}},
            {"spec": {"source": {"blank": {}}}}
          ]}
    }))
    .unwrap();
    let dvs = from_templates(&vm);
    assert_eq!(dvs.len(), 1);
    let dv = &dvs[0];
    assert_eq!(dv.metadata.namespace.as_deref(), Some("ns"));
    let o = &dv.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (o.kind.as_str(), o.uid.as_str(), o.controller),
        ("VirtualMachine", "u1", Some(true))
    );
    let pvc = claim_for(dv, PersistentVolumeClaimSpec::default());
    assert_eq!(pvc.metadata.annotations.unwrap()[POPULATED_FOR], "root");
    // A chosen node is passed on to the claim.
    let mut placed = dv.clone();
    placed.metadata.annotations = Some(std::collections::BTreeMap::from([(
        crate::storage::pvc::SELECTED_NODE.to_string(),
        "node-b".to_string(),
    )]));
    let pvc = claim_for(&placed, PersistentVolumeClaimSpec::default());
    assert_eq!(
        pvc.metadata.annotations.unwrap()[crate::storage::pvc::SELECTED_NODE],
        "node-b"
    );
}

#[test]
fn upload_source_waits_in_upload_ready() {
    let s = dv_spec(json!({"source": {"upload": {}}, "storage": {}}));
    assert_eq!(source_kind(&s, "ns"), Ok(SourceKind::Upload));
    let st = status_for(None, "d", &Stage::UploadReady, 0, &t(1));
    assert_eq!(st.phase.as_deref(), Some(dv_phase::UPLOAD_READY));
    assert_eq!(st.progress.as_deref(), Some("N/A"));
    let conds = st.conditions.clone().unwrap();
    let get = |ty: &str| conds.iter().find(|c| c.type_ == ty).unwrap().status.clone();
    assert_eq!(get("Bound"), "True");
    assert_eq!(get("Ready"), "False");
    assert_eq!(get("Running"), "True");
    // Progress written by the upload endpoint is kept.
    let mut prev = st;
    prev.progress = Some("40.00%".into());
    let again = status_for(Some(&prev), "d", &Stage::UploadReady, 0, &t(2));
    assert_eq!(again.progress.as_deref(), Some("40.00%"));
    assert!(!status_changed(Some(&prev), &again));
}
