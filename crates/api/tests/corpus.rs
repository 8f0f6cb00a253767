//! Round-trip corpus: manifests in KubeVirt's documented style parse into the typed API,
//! serialize back unchanged, pass admission without losing fields, and have no unknown fields.

mod common;

use common::{at, corpus, def_of, strip_nulls, subset_diff, typed_roundtrip};
use ferrovirt_api::admission::{Operation, admit};
use ferrovirt_api::registry::unknown_fields;
use serde_json::json;

#[test]
fn corpus_is_not_empty() {
    assert!(corpus().len() >= 20);
}

#[test]
fn typed_round_trip_is_lossless() {
    for (name, obj) in corpus() {
        let back = typed_roundtrip(&obj);
        assert_eq!(strip_nulls(&obj), back, "{name}");
        // And stable: a second trip changes nothing.
        assert_eq!(typed_roundtrip(&back), back, "{name}");
    }
}

#[test]
fn admission_keeps_every_field() {
    for (name, obj) in corpus() {
        let def = def_of(&obj);
        let mut admitted = obj.clone();
        admit(&def, Operation::Create, &mut admitted, None)
            .unwrap_or_else(|e| panic!("{name}: {:?}", e.0));
        // `running` is stored as written (deprecated but served), like every other field.
        if let Some(diff) = subset_diff(&obj, &admitted, "") {
            panic!("{name}: {diff}");
        }
        // Defaulting is idempotent.
        let mut again = admitted.clone();
        admit(&def, Operation::Update, &mut again, Some(&admitted)).expect("re-admit");
        assert_eq!(again, admitted, "{name}");
    }
}

#[test]
fn corpus_has_no_unknown_fields() {
    for (name, obj) in corpus() {
        let unknown = unknown_fields(&def_of(&obj), &obj);
        assert!(unknown.is_empty(), "{name}: {unknown:?}");
    }
}

#[test]
fn unknown_fields_are_reported_with_paths() {
    let (_, mut vm) = corpus()
        .into_iter()
        .find(|(n, _)| n == "vm-containerdisk.yaml")
        .expect("vm");
    vm["spec"]["template"]["spec"]["domain"]["foo"] = json!(1);
    vm["spec"]["template"]["spec"]["domain"]["devices"]["disks"][1]["disk"]["speed"] = json!(1);
    vm["metadata"]["colour"] = json!("red");
    vm["spec"]["template"]["spec"]["domain"]["devices"]["interfaces"][0]["masquerade"]["x"] =
        json!(true);
    let got = unknown_fields(&def_of(&vm), &vm);
    assert_eq!(
        got,
        vec![
            ".metadata.colour",
            ".spec.template.spec.domain.devices.disks[1].disk.speed",
            ".spec.template.spec.domain.devices.interfaces[0].masquerade.x",
            ".spec.template.spec.domain.foo",
        ]
    );
}

#[test]
fn free_form_places_are_not_checked() {
    let (_, mut hco) = corpus()
        .into_iter()
        .find(|(n, _)| n == "hco.yaml")
        .expect("hco");
    hco["spec"]["somethingNew"] = json!({"a": 1});
    hco["metadata"]["managedFields"] =
        json!([{"manager": "kubectl", "fieldsV1": {"f:spec": {"f:x": {}}}}]);
    assert!(unknown_fields(&def_of(&hco), &hco).is_empty());
}

#[test]
fn vm_defaults_are_applied() {
    let (_, vm) = corpus()
        .into_iter()
        .find(|(n, _)| n == "vm-datavolumetemplates.yaml")
        .expect("vm");
    let mut obj = vm.clone();
    admit(&def_of(&vm), Operation::Create, &mut obj, None).expect("admit");
    assert_eq!(obj["spec"]["running"], vm["spec"]["running"]);
    assert!(obj["spec"].get("runStrategy").is_none());
    let uuid = at(&obj, "spec.template.spec.domain.firmware.uuid").expect("uuid");
    assert_eq!(
        uuid,
        &json!(ferrovirt_api::admission::firmware_uuid(
            "demo",
            "centos-persistent"
        ))
    );
    assert_eq!(
        at(&obj, "spec.template.spec.domain.machine.type"),
        Some(&json!("q35"))
    );
    // VMI defaults stay out of the stored VM (KubeVirt defaults the VMI it creates), so a later
    // change of the memory request reaches the next VMI.
    assert_eq!(
        at(&obj, "spec.template.spec.domain.memory.guest").cloned(),
        at(&vm, "spec.template.spec.domain.memory.guest").cloned()
    );
    assert_eq!(
        at(&obj, "spec.template.spec.domain.devices.interfaces").cloned(),
        at(&vm, "spec.template.spec.domain.devices.interfaces").cloned()
    );
}

#[test]
fn vm_with_only_a_memory_request_is_stored_as_written() {
    let vm = json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": "small", "namespace": "ns"},
        "spec": {
            "runStrategy": "Halted",
            "template": {"spec": {
                "domain": {
                    "resources": {"requests": {"memory": "128Mi"}},
                    "devices": {}
                },
                "volumes": [{"name": "root", "containerDisk": {"image": "img"}}]
            }}
        }
    });
    let mut obj = vm.clone();
    admit(&def_of(&vm), Operation::Create, &mut obj, None).expect("admit");
    let t = &obj["spec"]["template"]["spec"];
    assert!(t["domain"].get("memory").is_none(), "{t}");
    assert!(t["domain"].get("cpu").is_none(), "{t}");
    assert!(t["domain"]["devices"].get("interfaces").is_none(), "{t}");
    assert!(t["domain"]["devices"].get("disks").is_none(), "{t}");
    assert!(t.get("networks").is_none(), "{t}");
    assert_eq!(
        t["domain"]["resources"]["requests"]["memory"],
        json!("128Mi")
    );
}

#[test]
fn vmi_defaults_are_applied() {
    let mut vmi = json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "tiny", "namespace": "ns"},
        "spec": {
            "domain": {
                "cpu": {"cores": 2},
                "memory": {"guest": "128Mi"},
                "devices": {"disks": [{"name": "root"}, {"name": "iso", "cdrom": {}}]}
            },
            "volumes": [
                {"name": "root", "containerDisk": {"image": "img"}},
                {"name": "iso", "containerDisk": {"image": "iso"}}
            ]
        }
    });
    let def = def_of(&vmi);
    admit(&def, Operation::Create, &mut vmi, None).expect("admit");
    let s = &vmi["spec"];
    assert_eq!(s["terminationGracePeriodSeconds"], json!(180));
    assert_eq!(s["domain"]["machine"]["type"], json!("q35"));
    assert_eq!(
        s["domain"]["cpu"],
        json!({"cores": 2, "sockets": 1, "threads": 1})
    );
    assert_eq!(
        s["domain"]["resources"]["requests"]["memory"],
        json!("128Mi")
    );
    assert_eq!(
        s["domain"]["devices"]["disks"][0]["disk"]["bus"],
        json!("virtio")
    );
    assert_eq!(
        s["domain"]["devices"]["disks"][1]["cdrom"]["bus"],
        json!("sata")
    );
    assert_eq!(
        s["domain"]["devices"]["interfaces"],
        json!([{"name": "default", "masquerade": {}}])
    );
    assert_eq!(s["networks"], json!([{"name": "default", "pod": {}}]));
    let uuid = s["domain"]["firmware"]["uuid"].as_str().expect("uuid");
    assert_eq!(uuid, ferrovirt_api::admission::firmware_uuid("ns", "tiny"));
    assert_ne!(uuid, ferrovirt_api::admission::firmware_uuid("ns", "tiny2"));
}

#[test]
fn no_pod_network_when_autoattach_is_false() {
    let (_, mut vmi) = corpus()
        .into_iter()
        .find(|(n, _)| n == "vmi-many-volumes.yaml")
        .expect("vmi");
    admit(&def_of(&vmi.clone()), Operation::Create, &mut vmi, None).expect("admit");
    assert!(vmi["spec"].get("networks").is_none());
    assert!(vmi["spec"]["domain"]["devices"].get("interfaces").is_none());
}

#[test]
fn numeric_quantities_are_accepted() {
    let mut dv = json!({
        "apiVersion": "cdi.kubevirt.io/v1beta1",
        "kind": "DataVolume",
        "metadata": {"name": "n"},
        "spec": {"source": {"blank": {}}, "storage": {"resources": {"requests": {"storage": 1073741824}}}}
    });
    admit(&def_of(&dv.clone()), Operation::Create, &mut dv, None).expect("admit");
    let typed: ferrovirt_api::cdi::DataVolume = serde_json::from_value(dv).expect("typed");
    let storage = typed.spec.and_then(|s| s.storage).and_then(|s| s.resources);
    let q = storage
        .and_then(|r| r.requests)
        .and_then(|r| r.get("storage").cloned());
    assert_eq!(q.map(|q| q.0), Some("1073741824".to_string()));
}
