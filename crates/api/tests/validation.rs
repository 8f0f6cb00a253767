//! One test per validation rule, each asserting the reported field path.

use ferrovirt_api::admission::{FieldError, Operation, admit};
use ferrovirt_api::registry::{ResourceDef, find_kind};
use serde_json::{Value, json};

fn vmi() -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "t", "namespace": "ns"},
        "spec": {
            "domain": {
                "memory": {"guest": "256Mi"},
                "devices": {
                    "disks": [
                        {"name": "root", "disk": {"bus": "virtio"}},
                        {"name": "ci", "disk": {"bus": "virtio"}}
                    ],
                    "interfaces": [{"name": "default", "masquerade": {}}]
                }
            },
            "networks": [{"name": "default", "pod": {}}],
            "volumes": [
                {"name": "root", "containerDisk": {"image": "img"}},
                {"name": "ci", "cloudInitNoCloud": {"userData": "#cloud-config"}}
            ]
        }
    })
}

fn vm() -> Value {
    let template = vmi()["spec"].clone();
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": "t", "namespace": "ns"},
        "spec": {"runStrategy": "Always", "template": {"spec": template}}
    })
}

fn dv() -> Value {
    json!({
        "apiVersion": "cdi.kubevirt.io/v1beta1",
        "kind": "DataVolume",
        "metadata": {"name": "d", "namespace": "ns"},
        "spec": {
            "source": {"http": {"url": "https://example.org/disk.img"}},
            "storage": {"resources": {"requests": {"storage": "1Gi"}}}
        }
    })
}

fn def(obj: &Value) -> ResourceDef {
    find_kind(
        obj["apiVersion"].as_str().unwrap(),
        obj["kind"].as_str().unwrap(),
    )
    .unwrap()
}

fn errors(mut obj: Value) -> Vec<FieldError> {
    let d = def(&obj);
    match admit(&d, Operation::Create, &mut obj, None) {
        Ok(()) => Vec::new(),
        Err(e) => e.0,
    }
}

#[track_caller]
fn assert_field(obj: Value, field: &str, reason: &str) {
    let errs = errors(obj);
    assert!(
        errs.iter().any(|e| e.field == field && e.reason == reason),
        "expected {reason} at {field}, got {errs:#?}"
    );
}

#[test]
fn baselines_are_valid() {
    assert_eq!(errors(vmi()), vec![]);
    assert_eq!(errors(vm()), vec![]);
    assert_eq!(errors(dv()), vec![]);
}

#[test]
fn disk_naming_a_missing_volume() {
    let mut o = vmi();
    o["spec"]["domain"]["devices"]["disks"][1]["name"] = json!("nope");
    assert_field(o, "spec.domain.devices.disks[1].name", "FieldValueInvalid");
}

#[test]
fn disk_naming_a_missing_volume_in_vm_template() {
    let mut o = vm();
    o["spec"]["template"]["spec"]["domain"]["devices"]["disks"][0]["name"] = json!("nope");
    assert_field(
        o,
        "spec.template.spec.domain.devices.disks[0].name",
        "FieldValueInvalid",
    );
}

#[test]
fn volume_without_disk_on_vmi_gets_a_disk() {
    // As KubeVirt's mutating webhook does.
    let mut o = vmi();
    o["spec"]["volumes"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "extra", "emptyDisk": {"capacity": "1Gi"}}));
    let def =
        ferrovirt_api::registry::find_kind("kubevirt.io/v1", "VirtualMachineInstance").unwrap();
    admit(&def, Operation::Create, &mut o, None).expect("admitted");
    let disks = o["spec"]["domain"]["devices"]["disks"].as_array().unwrap();
    assert!(
        disks
            .iter()
            .any(|d| d["name"] == "extra" && d["disk"]["bus"] == "virtio"),
        "{disks:?}"
    );
}

#[test]
fn volume_without_disk_allowed_for_memory_dump_and_vm_templates() {
    let mut o = vmi();
    o["spec"]["volumes"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "dump", "memoryDump": {"claimName": "dump-pvc"}}));
    assert_eq!(errors(o), vec![]);
    let mut o = vm();
    o["spec"]["template"]["spec"]["volumes"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "spare", "persistentVolumeClaim": {"claimName": "spare"}}));
    assert_eq!(errors(o), vec![]);
}

#[test]
fn duplicate_disk_names() {
    let mut o = vmi();
    o["spec"]["domain"]["devices"]["disks"][1]["name"] = json!("root");
    assert_field(
        o,
        "spec.domain.devices.disks[1].name",
        "FieldValueDuplicate",
    );
}

#[test]
fn duplicate_volume_names() {
    let mut o = vmi();
    o["spec"]["volumes"][1]["name"] = json!("root");
    assert_field(o, "spec.volumes[1].name", "FieldValueDuplicate");
}

#[test]
fn duplicate_interface_names() {
    let mut o = vmi();
    o["spec"]["domain"]["devices"]["interfaces"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "default", "bridge": {}}));
    assert_field(
        o,
        "spec.domain.devices.interfaces[1].name",
        "FieldValueDuplicate",
    );
}

#[test]
fn duplicate_network_names() {
    let mut o = vmi();
    o["spec"]["networks"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "default", "multus": {"networkName": "x"}}));
    assert_field(o, "spec.networks[1].name", "FieldValueDuplicate");
}

#[test]
fn running_and_run_strategy_together() {
    let mut o = vm();
    o["spec"]["running"] = json!(true);
    assert_field(o, "spec.running", "FieldValueInvalid");
}

#[test]
fn instancetype_with_domain_cpu_and_memory() {
    let mut o = vm();
    o["spec"]["instancetype"] = json!({"name": "u1.small"});
    o["spec"]["template"]["spec"]["domain"]["cpu"] = json!({"cores": 2});
    let errs = errors(o);
    for f in [
        "spec.template.spec.domain.cpu.cores",
        "spec.template.spec.domain.memory.guest",
    ] {
        assert!(errs.iter().any(|e| e.field == f), "{f}: {errs:#?}");
    }
}

#[test]
fn bad_quantity() {
    let mut o = vmi();
    o["spec"]["domain"]["resources"] = json!({"requests": {"memory": "lots"}});
    assert_field(
        o,
        "spec.domain.resources.requests.memory",
        "FieldValueInvalid",
    );
    let mut o = dv();
    o["spec"]["storage"]["resources"]["requests"]["storage"] = json!("1GB");
    assert_field(
        o,
        "spec.storage.resources.requests.storage",
        "FieldValueInvalid",
    );
}

#[test]
fn unknown_disk_bus() {
    let mut o = vmi();
    o["spec"]["domain"]["devices"]["disks"][0]["disk"]["bus"] = json!("ide");
    assert_field(
        o,
        "spec.domain.devices.disks[0].disk.bus",
        "FieldValueNotSupported",
    );
}

#[test]
fn masquerade_on_multus_network() {
    let mut o = vmi();
    o["spec"]["networks"][0] = json!({"name": "default", "multus": {"networkName": "lan"}});
    assert_field(
        o,
        "spec.domain.devices.interfaces[0].masquerade",
        "FieldValueInvalid",
    );
}

#[test]
fn pod_network_listed_twice() {
    let mut o = vmi();
    o["spec"]["networks"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "second", "pod": {}}));
    o["spec"]["domain"]["devices"]["interfaces"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "second", "bridge": {}}));
    assert_field(o, "spec.networks[1].pod", "FieldValueDuplicate");
}

#[test]
fn duplicate_mac_within_one_vmi() {
    let mut o = vmi();
    o["spec"]["domain"]["devices"]["interfaces"][0]["macAddress"] = json!("02:00:00:00:00:0A");
    o["spec"]["networks"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "sec", "multus": {"networkName": "br"}}));
    o["spec"]["domain"]["devices"]["interfaces"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "sec", "bridge": {}, "macAddress": "02-00-00-00-00-0a"}));
    assert_field(
        o,
        "spec.domain.devices.interfaces[1].macAddress",
        "FieldValueDuplicate",
    );
}

#[test]
fn name_not_dns1123() {
    let mut o = vmi();
    o["metadata"]["name"] = json!("Bad_Name");
    assert_field(o, "metadata.name", "FieldValueInvalid");
    let mut o = dv();
    o["metadata"]["name"] = json!("-x");
    assert_field(o, "metadata.name", "FieldValueInvalid");
    let mut ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "a.b"}});
    assert_field(ns.clone(), "metadata.name", "FieldValueInvalid");
    ns["metadata"]["name"] = json!("ab");
    assert_eq!(errors(ns), vec![]);
}

#[test]
fn missing_name_without_generate_name() {
    let mut o = vmi();
    o["metadata"] = json!({"namespace": "ns"});
    assert_field(o.clone(), "metadata.name", "FieldValueRequired");
    o["metadata"]["generateName"] = json!("t-");
    assert_eq!(errors(o), vec![]);
}

#[test]
fn duplicate_boot_order() {
    let mut o = vmi();
    o["spec"]["domain"]["devices"]["disks"][0]["bootOrder"] = json!(1);
    o["spec"]["domain"]["devices"]["disks"][1]["bootOrder"] = json!(1);
    assert_field(
        o,
        "spec.domain.devices.disks[1].bootOrder",
        "FieldValueInvalid",
    );
}

#[test]
fn memory_below_floor() {
    let mut o = vmi();
    o["spec"]["domain"]["memory"]["guest"] = json!("512Ki");
    assert_field(o, "spec.domain.memory.guest", "FieldValueInvalid");
}

#[test]
fn vmi_without_memory() {
    let mut o = vmi();
    o["spec"]["domain"]
        .as_object_mut()
        .unwrap()
        .remove("memory");
    assert_field(
        o,
        "spec.domain.resources.requests.memory",
        "FieldValueRequired",
    );
}

#[test]
fn interface_without_network() {
    let mut o = vmi();
    o["spec"]["domain"]["devices"]["interfaces"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "lan", "bridge": {}}));
    assert_field(
        o,
        "spec.domain.devices.interfaces[1].name",
        "FieldValueInvalid",
    );
}

#[test]
fn network_without_interface() {
    let mut o = vmi();
    o["spec"]["networks"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "lan", "multus": {"networkName": "lan"}}));
    assert_field(o, "spec.networks[1].name", "FieldValueInvalid");
}

#[test]
fn volume_needs_exactly_one_source() {
    let mut o = vmi();
    o["spec"]["volumes"][0]["emptyDisk"] = json!({"capacity": "1Gi"});
    assert_field(o, "spec.volumes[0]", "FieldValueInvalid");
}

#[test]
fn wrong_json_type_names_the_field() {
    let mut o = vmi();
    o["spec"]["domain"]["devices"]["disks"][0]["name"] = json!(5);
    assert_field(
        o,
        "spec.domain.devices.disks[0].name",
        "FieldValueTypeInvalid",
    );
}

#[test]
fn dv_needs_one_source_and_storage() {
    let mut o = dv();
    o["spec"]["source"]["blank"] = json!({});
    assert_field(o, "spec.source", "FieldValueInvalid");
    let mut o = dv();
    o["spec"].as_object_mut().unwrap().remove("storage");
    assert_field(o, "spec", "FieldValueRequired");
    let mut o = dv();
    o["spec"]["source"] = json!({"http": {"url": "ftp://x"}});
    assert_field(o, "spec.source.http.url", "FieldValueInvalid");
}

#[test]
fn vm_data_volume_template_is_validated() {
    let mut o = vm();
    o["spec"]["dataVolumeTemplates"] = json!([{
        "metadata": {"name": "root"},
        "spec": {"source": {"registry": {"url": "quay.io/x"}}, "storage": {}}
    }]);
    assert_field(
        o,
        "spec.dataVolumeTemplates[0].spec.source.registry.url",
        "FieldValueInvalid",
    );
}

#[test]
fn all_problems_are_reported_at_once() {
    let mut o = vmi();
    o["metadata"]["name"] = json!("UPPER");
    o["spec"]["domain"]["devices"]["disks"][0]["disk"]["bus"] = json!("ide");
    o["spec"]["domain"]["devices"]["disks"][1]["name"] = json!("root");
    o["spec"]["domain"]["memory"]["guest"] = json!("1k");
    let errs = errors(o);
    assert!(errs.len() >= 4, "{errs:#?}");
}

#[test]
fn non_object_input_is_rejected() {
    let d = def(&vmi());
    for mut v in [json!(null), json!([1]), json!("x"), json!(3)] {
        assert!(admit(&d, Operation::Create, &mut v, None).is_err());
    }
}
