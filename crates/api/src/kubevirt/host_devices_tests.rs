//! Unit tests of the host device rules (`super`).

use serde_json::json;

use super::*;

fn vmi_spec(devices: Value) -> VirtualMachineInstanceSpec {
    serde_json::from_value(json!({"domain": {"devices": devices}})).unwrap()
}

fn kv(p: Value) -> Value {
    json!({"configuration": {"permittedHostDevices": p}})
}

#[test]
fn the_kubevirt_list_is_parsed_with_kubevirts_normal_forms() {
    let spec = kv(json!({
        "pciHostDevices": [
            {"pciVendorSelector": "10DE:1EB8", "resourceName": "nvidia.com/TU104GL_Tesla_T4"},
            {"pciVendorSelector": "8086:6f54", "resourceName": "intel.com/qat",
             "externalResourceProvider": true},
            {"resourceName": "no-selector.io/x"}
        ],
        "mediatedDevices": [{"mdevNameSelector": "GRID T4-1Q ", "resourceName": "nvidia.com/GRID_T4-1Q"}],
        "usb": [
            {"resourceName": "kubevirt.io/storage",
             "selectors": [{"vendor": "46f4", "product": "0001"}, {"vendor": "1b1c", "product": "1ab1"}]},
            {"resourceName": "kubevirt.io/bad", "selectors": [{"vendor": "zz", "product": "1"}]}
        ]
    }));
    let p = PermittedHostDevices::from_kubevirt_spec(Some(&spec)).unwrap();
    assert_eq!(p.pci.len(), 2, "an entry without a selector is skipped");
    assert_eq!(p.pci[0].selector, "10de:1eb8");
    assert!(p.pci[1].external);
    assert_eq!(p.mediated[0].selector, "GRID_T4-1Q");
    assert_eq!(
        p.usb[0].selectors,
        [
            UsbSelector {
                vendor: 0x46f4,
                product: 1
            },
            UsbSelector {
                vendor: 0x1b1c,
                product: 0x1ab1
            }
        ]
    );
    assert!(
        p.usb[1].selectors.is_empty(),
        "a bad selector matches nothing"
    );
    assert_eq!(p.resource_names().len(), 5);
    assert!(!p.node_resources().contains("intel.com/qat"), "external");
    assert_eq!(p.node_resources().len(), 4);
    // No list at all: None (everything allowed); an empty one: Some (nothing allowed).
    assert_eq!(
        PermittedHostDevices::from_kubevirt_spec(Some(&json!({}))),
        None
    );
    assert_eq!(
        PermittedHostDevices::from_kubevirt_spec(Some(&kv(json!({})))),
        Some(PermittedHostDevices::default())
    );
}

#[test]
fn the_first_cr_that_sets_a_list_gives_it() {
    let none = json!({"spec": {}});
    let one = json!({"spec": kv(json!({"pciHostDevices": [
        {"pciVendorSelector": "1af4:1000", "resourceName": "example.org/a"}]}))});
    let two = json!({"spec": kv(json!({}))});
    let p = PermittedHostDevices::from_kubevirts([&none, &one, &two]).unwrap();
    assert_eq!(p.pci[0].resource_name, "example.org/a");
    assert_eq!(PermittedHostDevices::from_kubevirts([&none]), None);
}

#[test]
fn kubevirts_render_rule_names_the_field() {
    let spec = vmi_spec(json!({
        "gpus": [{"name": "g", "deviceName": "nvidia.com/A"}],
        "hostDevices": [{"name": "h", "deviceName": "example.org/nic"},
                        {"name": "d", "claimName": "c", "requestName": "r"}]
    }));
    // No list: anything goes.
    assert!(not_permitted(&spec, None).is_empty());
    let p = PermittedHostDevices::from_kubevirt_spec(Some(&kv(json!({"pciHostDevices": [
        {"pciVendorSelector": "1af4:1000", "resourceName": "example.org/nic"}]}))))
    .unwrap();
    assert_eq!(
        not_permitted(&spec, Some(&p)),
        [
            "spec.domain.devices.gpus[0].deviceName: GPU nvidia.com/A is not permitted in \
          permittedHostDevices configuration"
        ]
    );
    // An empty list permits nothing.
    let empty = PermittedHostDevices::default();
    assert_eq!(not_permitted(&spec, Some(&empty)).len(), 2);
    assert!(
        not_permitted(&spec, Some(&empty))[1].starts_with(
            "spec.domain.devices.hostDevices[0].deviceName: HostDevice example.org/nic"
        )
    );
    let counts = request_counts(&vmi_spec(json!({"hostDevices": [
        {"name": "a", "deviceName": "x.io/y"}, {"name": "b", "deviceName": "x.io/y"}]})));
    assert_eq!(counts.get("x.io/y"), Some(&2));
}

#[test]
fn hco_maps_into_kubevirts_names_and_drops_disabled_entries() {
    let hco = json!({
        "pciHostDevices": [
            {"pciDeviceSelector": "10DE:1DB6", "resourceName": "nvidia.com/GV100GL_Tesla_V100"},
            {"pciDeviceSelector": "10DE:1EB8", "resourceName": "nvidia.com/TU104GL_Tesla_T4",
             "disabled": true},
            {"pciDeviceSelector": "8086:6F54", "resourceName": "intel.com/qat",
             "externalResourceProvider": true}
        ],
        "mediatedDevices": [{"mdevNameSelector": "GRID T4-1Q", "resourceName": "nvidia.com/GRID_T4-1Q",
                             "disabled": true}],
        "usbHostDevices": [{"resourceName": "kubevirt.io/peripherals",
                            "selectors": [{"vendor": "045e", "product": "07a5"}]}]
    });
    assert_eq!(
        hco_to_kubevirt(Some(&hco)).unwrap(),
        json!({
            "pciHostDevices": [
                {"pciVendorSelector": "10DE:1DB6", "resourceName": "nvidia.com/GV100GL_Tesla_V100"},
                {"pciVendorSelector": "8086:6F54", "resourceName": "intel.com/qat",
                 "externalResourceProvider": true}
            ],
            "usb": [{"resourceName": "kubevirt.io/peripherals",
                     "selectors": [{"vendor": "045e", "product": "07a5"}]}]
        })
    );
    assert_eq!(hco_to_kubevirt(None), None);
    assert_eq!(hco_to_kubevirt(Some(&Value::Null)), None);
    let all_off = json!({"pciHostDevices": [{"pciDeviceSelector": "10DE:1DB6",
        "resourceName": "nvidia.com/x", "disabled": true}]});
    assert_eq!(hco_to_kubevirt(Some(&all_off)), Some(json!({})));
}

#[test]
fn the_hco_shape_is_checked_naming_the_field() {
    let check = |v: Value| {
        let mut e = Vec::new();
        validate_hco(&v, "spec.permittedHostDevices", &mut e);
        e.into_iter().map(|e| e.field).collect::<Vec<_>>()
    };
    assert!(
        check(json!({
            "pciHostDevices": [{"pciDeviceSelector": "10de:1EB8", "resourceName": "nvidia.com/T4",
                                "externalResourceProvider": false, "disabled": true}],
            "mediatedDevices": [{"mdevNameSelector": "GRID T4-1Q", "resourceName": "nvidia.com/GRID_T4-1Q"}],
            "usbHostDevices": [{"resourceName": "kubevirt.io/storage",
                                "selectors": [{"vendor": "46f4", "product": "1"}]}]
        }))
        .is_empty()
    );
    assert_eq!(
        check(
            json!({"pciHostDevices": [{"pciDeviceSelector": "10de-1eb8", "resourceName": "T4"}]})
        ),
        [
            "spec.permittedHostDevices.pciHostDevices[0].resourceName",
            "spec.permittedHostDevices.pciHostDevices[0].pciDeviceSelector"
        ]
    );
    assert_eq!(
        check(json!({"pciHostDevices": [{"pciDeviceSelector": "10de:1eb8",
                                         "resourceName": "kubernetes.io/gpu"}]})),
        ["spec.permittedHostDevices.pciHostDevices[0].resourceName"]
    );
    assert_eq!(
        check(json!({"mediatedDevices": [{"resourceName": "a.io/b", "x": 1}]})),
        [
            "spec.permittedHostDevices.mediatedDevices[0].x",
            "spec.permittedHostDevices.mediatedDevices[0].mdevNameSelector"
        ]
    );
    assert_eq!(
        check(json!({"usbHostDevices": [{"resourceName": "a.io/b",
                                         "selectors": [{"vendor": "12345", "product": "1"}]}]})),
        ["spec.permittedHostDevices.usbHostDevices[0].selectors[0].vendor"]
    );
    assert_eq!(
        check(json!({"usbHostDevices": [{"resourceName": "a.io/b"}]})),
        ["spec.permittedHostDevices.usbHostDevices[0].selectors"]
    );
    assert_eq!(check(json!({"usb": []})), ["spec.permittedHostDevices.usb"]);
}

#[test]
fn resource_names_follow_kubernetes_extended_resource_rules() {
    assert!(valid_resource_name("nvidia.com/TU104GL_Tesla_T4"));
    assert!(valid_resource_name("kubevirt.io/storage"));
    assert!(!valid_resource_name("gpu"));
    assert!(!valid_resource_name("kubernetes.io/gpu"));
    assert!(!valid_resource_name("x.kubernetes.io/gpu"));
    assert!(!valid_resource_name("Example.com/gpu"));
    assert!(!valid_resource_name("example.com/-gpu"));
    assert!(!valid_resource_name(&format!(
        "example.com/{}",
        "a".repeat(64)
    )));
    assert!(valid_pci_selector("10DE:1eb8"));
    assert!(!valid_pci_selector("10de:1eb"));
    assert_eq!(parse_usb_id("1"), Some(1));
    assert_eq!(parse_usb_id("ffff"), Some(0xffff));
    assert_eq!(parse_usb_id("0x12"), None);
}

#[test]
fn a_vgpu_display_and_tags_are_refused() {
    let spec = vmi_spec(json!({
        "gpus": [
            {"name": "a", "deviceName": "nvidia.com/A", "virtualGPUOptions": {"display": {"enabled": false}}},
            {"name": "b", "deviceName": "nvidia.com/A", "virtualGPUOptions": {"display": {}}},
            {"name": "c", "deviceName": "nvidia.com/A", "tag": "t"}
        ],
        "hostDevices": [{"name": "h", "deviceName": "x.io/y", "tag": "t"}]
    }));
    let fields: Vec<String> = refused(&spec.domain.devices, "spec.domain")
        .into_iter()
        .map(|e| e.field)
        .collect();
    assert_eq!(
        fields,
        [
            "spec.domain.devices.gpus[1].virtualGPUOptions.display",
            "spec.domain.devices.gpus[2].tag",
            "spec.domain.devices.hostDevices[0].tag"
        ]
    );
}
