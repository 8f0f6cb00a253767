//! Unit tests of the BackupRestore controller's pure decisions.

use super::*;
use ferrovirt_api::backup::RestoreVirtualMachine;

fn vm(ns: &str, name: &str, mac: Option<&str>) -> Value {
    let mut iface = json!({"name": "default", "masquerade": {}});
    if let Some(m) = mac {
        iface["macAddress"] = json!(m);
    }
    json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": "db"}},
        "spec": {"runStrategy": "Always", "template": {"spec": {
            "domain": {"devices": {"interfaces": [iface]}, "firmware": {"uuid": "old-uuid"}},
            "volumes": [{"name": "root", "dataVolume": {"name": format!("{name}-root")}}]}}}
    })
}

fn counter(prefix: &'static str) -> impl FnMut() -> String {
    let mut n = 0;
    move || {
        n += 1;
        format!("{prefix}{n}")
    }
}

fn plan(vms: &[Value], spec: &BackupRestoreSpec) -> Result<Vec<VmPlan>, String> {
    plan_vms(
        vms,
        "b1",
        spec,
        "dr",
        "uid-1",
        &mut counter("mac-"),
        &mut counter("uuid-"),
    )
}

#[test]
fn namespaces_map_only_into_the_restores_own() {
    let mut m = BTreeMap::new();
    assert_eq!(target_namespace("prod", None, "dr").unwrap(), "dr");
    m.insert("prod".to_string(), "dr".to_string());
    assert_eq!(target_namespace("prod", Some(&m), "dr").unwrap(), "dr");
    assert_eq!(target_namespace("other", Some(&m), "dr").unwrap(), "dr");
    m.insert("prod".to_string(), "elsewhere".to_string());
    let e = target_namespace("prod", Some(&m), "dr").unwrap_err();
    assert!(e.starts_with("spec.namespaceMapping.prod"), "{e}");
}

#[test]
fn all_vms_by_default_kept_identity_and_labelled() {
    let vms = [
        vm("prod", "a", Some("02:00:00:00:00:0a")),
        vm("prod", "b", None),
    ];
    let p = plan(&vms, &BackupRestoreSpec::default()).unwrap();
    assert_eq!(p.len(), 2);
    assert_eq!(p[0].source, "prod/a");
    assert_eq!(p[0].vm["metadata"]["namespace"], "dr");
    assert_eq!(p[0].vm["metadata"]["name"], "a");
    assert_eq!(p[0].vm["metadata"]["labels"]["app"], "db");
    assert_eq!(p[0].vm["metadata"]["labels"][RESTORE_UID_LABEL], "uid-1");
    assert_eq!(
        p[0].vm["metadata"]["annotations"]["backup.ferrovirt.io/restored-from"],
        "b1/prod/a"
    );
    assert_eq!(p[0].vm["spec"]["runStrategy"], "Halted");
    let dom = &p[0].vm["spec"]["template"]["spec"]["domain"];
    assert_eq!(
        dom["devices"]["interfaces"][0]["macAddress"],
        "02:00:00:00:00:0a"
    );
    assert_eq!(dom["firmware"]["uuid"], "old-uuid");
    assert_eq!(
        p[0].claims,
        [("a.a-root".to_string(), "a-root".to_string())]
    );
    assert!(
        p[1].vm["spec"]["template"]["spec"]["domain"]["devices"]["interfaces"][0]
            .get("macAddress")
            .is_none()
    );
}

#[test]
fn chosen_vms_new_names_new_macs_and_uuid() {
    let vms = [
        vm("prod", "a", Some("02:00:00:00:00:0a")),
        vm("prod", "b", None),
    ];
    let spec = BackupRestoreSpec {
        virtual_machines: Some(vec![RestoreVirtualMachine {
            name: "prod/b".into(),
            new_name: Some("b2".into()),
            volumes: None,
        }]),
        new_mac_addresses: true,
        new_firmware_uuid: true,
        start: true,
        ..Default::default()
    };
    let p = plan(&vms, &spec).unwrap();
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].name(), "b2");
    assert_eq!(
        p[0].claims,
        [("b.b-root".to_string(), "b2-b-root".to_string())]
    );
    assert_eq!(p[0].vm["spec"]["runStrategy"], "Always");
    let dom = &p[0].vm["spec"]["template"]["spec"]["domain"];
    assert_eq!(dom["devices"]["interfaces"][0]["macAddress"], "mac-1");
    assert_eq!(dom["firmware"]["uuid"], "uuid-1");
    // A VM the backup lacks is named with its field.
    let spec = BackupRestoreSpec {
        virtual_machines: Some(vec![RestoreVirtualMachine {
            name: "prod/zz".into(),
            new_name: None,
            volumes: None,
        }]),
        ..Default::default()
    };
    let e = plan(&vms, &spec).unwrap_err();
    assert!(
        e.starts_with("spec.virtualMachines[0].name") && e.contains("prod/a"),
        "{e}"
    );
}

#[test]
fn two_vms_under_one_name_are_refused() {
    let vms = [vm("prod", "a", None), vm("test", "a", None)];
    let e = plan(&vms, &BackupRestoreSpec::default()).unwrap_err();
    assert!(e.contains("prod/a and test/a"), "{e}");
    let spec = BackupRestoreSpec {
        virtual_machines: Some(vec![
            RestoreVirtualMachine {
                name: "prod/a".into(),
                new_name: None,
                volumes: None,
            },
            RestoreVirtualMachine {
                name: "test/a".into(),
                new_name: Some("a-test".into()),
                volumes: None,
            },
        ]),
        ..Default::default()
    };
    assert_eq!(plan(&vms, &spec).unwrap().len(), 2);
    let mut mapping = BTreeMap::new();
    mapping.insert("prod".to_string(), "x".to_string());
    let spec = BackupRestoreSpec {
        namespace_mapping: Some(mapping),
        ..spec
    };
    assert!(
        plan(&vms, &spec)
            .unwrap_err()
            .contains("namespaceMapping.prod")
    );
}

#[test]
fn found_objects_are_ours_or_conflicts() {
    assert_eq!(found(None, "u"), Found::Absent);
    let ours = json!({"metadata": {"labels": {RESTORE_UID_LABEL: "u"}}});
    assert_eq!(found(Some(&ours), "u"), Found::Ours);
    assert_eq!(found(Some(&ours), "v"), Found::Conflict);
    assert_eq!(found(Some(&json!({"metadata": {}})), "u"), Found::Conflict);
}

#[test]
fn secrets_created_reused_or_refused() {
    let s = json!({"kind": "Secret", "metadata": {"name": "ud", "namespace": "prod"},
        "type": "Opaque", "data": {"userdata": "eA=="}});
    assert_eq!(object_action(None, &s), ObjectAction::Create);
    let mut here = s.clone();
    here["metadata"]["uid"] = json!("other");
    assert_eq!(object_action(Some(&here), &s), ObjectAction::Reuse);
    here["data"]["userdata"] = json!("eQ==");
    assert_eq!(object_action(Some(&here), &s), ObjectAction::Conflict);
    let c = object_to_create(&s, "dr", "u");
    assert_eq!(c["metadata"]["namespace"], "dr");
    assert_eq!(c["metadata"]["labels"][RESTORE_UID_LABEL], "u");
}

#[test]
fn data_volumes_follow_the_backed_up_claim() {
    let claim = json!({"kind": "PersistentVolumeClaim",
        "metadata": {"name": "a-root", "namespace": "prod"},
        "spec": {"accessModes": ["ReadWriteMany"], "volumeMode": "Filesystem",
                 "storageClassName": "shared"}});
    let objects = [claim.clone()];
    assert_eq!(
        backed_up_claim(&objects, "prod", "a.a-root", "a"),
        Some(&claim)
    );
    assert_eq!(backed_up_claim(&objects, "test", "a.a-root", "a"), None);
    let dv = data_volume(
        "x-a-root",
        "dr",
        (64 << 20) + 1,
        Some(&claim),
        &["shared".into()],
        "u",
    );
    assert_eq!(dv["spec"]["source"], json!({"upload": {}}));
    let st = &dv["spec"]["storage"];
    assert_eq!(st["resources"]["requests"]["storage"], "65Mi");
    assert_eq!(st["accessModes"], json!(["ReadWriteMany"]));
    assert_eq!(st["storageClassName"], "shared");
    assert_eq!(dv["metadata"]["labels"][RESTORE_UID_LABEL], "u");
    // A class this cluster lacks: the default class.
    let dv = data_volume("x", "dr", 1, Some(&claim), &["local".into()], "u");
    assert!(dv["spec"]["storage"].get("storageClassName").is_none());
    assert_eq!(
        dv["spec"]["storage"]["resources"]["requests"]["storage"],
        "1Mi"
    );
}

#[test]
fn phase_steps() {
    assert_eq!(step(None), Step::Run);
    assert_eq!(step(Some("Pending")), Step::Run);
    assert_eq!(step(Some("Running")), Step::Run);
    assert_eq!(step(Some("Succeeded")), Step::Done);
    assert_eq!(step(Some("Failed")), Step::Done);
}

#[test]
fn chosen_volumes_restore_only_those_claims_and_no_vm() {
    let mut two = vm("prod", "a", None);
    two["spec"]["template"]["spec"]["volumes"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "data", "persistentVolumeClaim": {"claimName": "a-data"}}));
    let spec = BackupRestoreSpec {
        virtual_machines: Some(vec![RestoreVirtualMachine {
            name: "prod/a".into(),
            new_name: Some("copy".into()),
            volumes: Some(vec!["a-data".into()]),
        }]),
        ..Default::default()
    };
    let p = plan(std::slice::from_ref(&two), &spec).unwrap();
    assert!(p[0].volumes_only);
    assert_eq!(
        p[0].claims,
        [("a.a-data".to_string(), "copy-a-data".to_string())]
    );
    let spec = BackupRestoreSpec {
        virtual_machines: Some(vec![RestoreVirtualMachine {
            name: "prod/a".into(),
            new_name: None,
            volumes: Some(vec!["a-data".into(), "nope".into()]),
        }]),
        ..Default::default()
    };
    let e = plan(std::slice::from_ref(&two), &spec).unwrap_err();
    assert!(
        e.starts_with("spec.virtualMachines[0].volumes[1]") && e.contains("a-root, a-data"),
        "{e}"
    );
    let all = plan(std::slice::from_ref(&two), &BackupRestoreSpec::default()).unwrap();
    assert!(!all[0].volumes_only);
    assert_eq!(all[0].claims.len(), 2);
}
