//! Instancetype and preference expansion.

use ferrovirt_api::expand::{expand, vcpus};
use ferrovirt_api::kubevirt::instancetype::{InstancetypeSpec, PreferenceSpec};
use ferrovirt_api::kubevirt::vmi::VirtualMachineInstanceSpec;
use serde_json::json;

fn template() -> VirtualMachineInstanceSpec {
    serde_json::from_value(json!({
        "domain": {
            "devices": {
                "disks": [{"name": "root"}, {"name": "iso", "cdrom": {"bus": "sata"}}],
                "interfaces": [{"name": "default"}]
            }
        },
        "networks": [{"name": "default", "pod": {}}],
        "volumes": [
            {"name": "root", "dataVolume": {"name": "root"}},
            {"name": "iso", "containerDisk": {"image": "iso"}}
        ]
    }))
    .unwrap()
}

fn instancetype() -> InstancetypeSpec {
    serde_json::from_value(json!({
        "cpu": {"guest": 4, "model": "host-passthrough"},
        "memory": {"guest": "8Gi", "overcommitPercent": 25}
    }))
    .unwrap()
}

fn preference() -> PreferenceSpec {
    serde_json::from_value(json!({
        "cpu": {"preferredCPUTopology": "cores"},
        "devices": {
            "preferredDiskBus": "scsi",
            "preferredCdromBus": "scsi",
            "preferredInterfaceModel": "e1000e",
            "preferredInterfaceMasquerade": {}
        },
        "machine": {"preferredMachineType": "pc-q35-9.0"},
        "firmware": {"preferredUseEfi": true, "preferredUseSecureBoot": false},
        "preferredTerminationGracePeriodSeconds": 30
    }))
    .unwrap()
}

#[test]
fn instancetype_sizes_the_domain() {
    let out = expand(&template(), Some(&instancetype()), None).unwrap();
    let cpu = out.domain.cpu.as_ref().unwrap();
    assert_eq!(
        (cpu.sockets, cpu.cores, cpu.threads),
        (Some(4), Some(1), Some(1))
    );
    assert_eq!(cpu.model.as_deref(), Some("host-passthrough"));
    assert_eq!(vcpus(&out), 4);
    let mem = out.domain.memory.as_ref().unwrap();
    assert_eq!(mem.guest.as_ref().unwrap().0, "8Gi");
    let req = out
        .domain
        .resources
        .as_ref()
        .unwrap()
        .requests
        .as_ref()
        .unwrap();
    assert_eq!(req["memory"].0, "6Gi");
}

#[test]
fn preference_fills_only_unset_fields() {
    let out = expand(&template(), Some(&instancetype()), Some(&preference())).unwrap();
    let cpu = out.domain.cpu.as_ref().unwrap();
    assert_eq!(
        (cpu.sockets, cpu.cores, cpu.threads),
        (Some(1), Some(4), Some(1))
    );
    let disks = out.domain.devices.disks.as_ref().unwrap();
    assert_eq!(disks[0].disk.as_ref().unwrap().bus.as_deref(), Some("scsi"));
    // Explicit bus wins over the preference.
    assert_eq!(
        disks[1].cdrom.as_ref().unwrap().bus.as_deref(),
        Some("sata")
    );
    let iface = &out.domain.devices.interfaces.as_ref().unwrap()[0];
    assert_eq!(iface.model.as_deref(), Some("e1000e"));
    assert!(iface.masquerade.is_some());
    assert_eq!(
        out.domain.machine.as_ref().unwrap().type_.as_deref(),
        Some("pc-q35-9.0")
    );
    let efi = out
        .domain
        .firmware
        .as_ref()
        .unwrap()
        .bootloader
        .as_ref()
        .unwrap()
        .efi
        .as_ref();
    assert_eq!(efi.unwrap().secure_boot, Some(false));
    assert_eq!(out.termination_grace_period_seconds, Some(30));
}

#[test]
fn conflicts_name_the_field() {
    let mut t = template();
    t.domain.cpu = Some(serde_json::from_value(json!({"sockets": 2})).unwrap());
    t.domain.memory = Some(serde_json::from_value(json!({"guest": "1Gi"})).unwrap());
    let err = expand(&t, Some(&instancetype()), None).unwrap_err();
    let fields: Vec<_> = err.0.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "spec.template.spec.domain.cpu.sockets",
            "spec.template.spec.domain.memory.guest"
        ]
    );
}

#[test]
fn preference_requirements_are_enforced() {
    let pref: PreferenceSpec =
        serde_json::from_value(json!({"requirements": {"cpu": {"guest": 8}}})).unwrap();
    let err = expand(&template(), Some(&instancetype()), Some(&pref)).unwrap_err();
    assert_eq!(err.0[0].field, "spec.instancetype");
}

#[test]
fn nothing_to_expand_is_identity() {
    assert_eq!(expand(&template(), None, None).unwrap(), template());
}
