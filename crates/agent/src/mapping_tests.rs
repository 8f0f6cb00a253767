//! Tests of `mapping`: the VMI spec → `LaunchSpec` translation and its refusals.

use super::*;
use serde_json::json;

fn vmi(v: serde_json::Value) -> VirtualMachineInstance {
    serde_json::from_value(v).expect("vmi")
}

fn base() -> serde_json::Value {
    json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "t1", "namespace": "ns1", "uid": "11111111-2222-3333-4444-555555555555"},
        "spec": {
            "domain": {
                "cpu": {"cores": 2},
                "memory": {"guest": "128Mi"},
                "firmware": {"uuid": "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", "serial": "S1"},
                "devices": {
                    "disks": [{"name": "root", "disk": {"bus": "virtio"}, "bootOrder": 1},
                              {"name": "ci", "disk": {}}],
                    "interfaces": [{"name": "default", "masquerade": {}, "ports": [{"port": 80}]}]
                }
            },
            "networks": [{"name": "default", "pod": {}}],
            "volumes": [{"name": "root", "persistentVolumeClaim": {"claimName": "c"}},
                        {"name": "ci", "cloudInitNoCloud": {"userData": "#!/bin/sh\n"}}]
        }
    })
}

#[test]
fn multiqueue_nics_get_a_queue_pair_per_vcpu() {
    let mut v = base();
    assert_eq!(nic_queues(&vmi(v.clone()), "default"), 1);
    v["spec"]["domain"]["devices"]["networkInterfaceMultiqueue"] = json!(true);
    assert_eq!(nic_queues(&vmi(v.clone()), "default"), 2);
    v["spec"]["domain"]["cpu"] = json!({"sockets": 2, "cores": 2, "threads": 2});
    assert_eq!(nic_queues(&vmi(v.clone()), "default"), 8);
    v["spec"]["domain"]["cpu"] = json!({"sockets": 300});
    assert_eq!(nic_queues(&vmi(v.clone()), "default"), MAX_NIC_QUEUES);
    // Other models ignore it; so does an unknown interface.
    assert_eq!(nic_queues(&vmi(v.clone()), "other"), 1);
    v["spec"]["domain"]["devices"]["interfaces"][0]["model"] = json!("e1000e");
    assert_eq!(nic_queues(&vmi(v.clone()), "default"), 1);
    // The tap backend carries the count into the launch spec.
    let mut v = base();
    v["spec"]["domain"]["devices"]["networkInterfaceMultiqueue"] = json!(true);
    let mut c = ctx();
    c.pod_taps.insert(
        "default".into(),
        PodTap {
            ifname: "tap0".into(),
            mac: "02:00:00:00:00:01".into(),
        },
    );
    let ls = launch_spec(&vmi(v), &c).unwrap();
    assert_eq!(
        ls.nics[0].backend,
        NicBackend::Tap {
            ifname: "tap0".into(),
            queues: 2,
        }
    );
    ls.validate().unwrap();
}

fn ctx() -> MappingContext {
    let mut c = MappingContext::new("/run/fv/vmi1", Accel::Tcg);
    c.volumes.insert(
        "root".into(),
        PreparedVolume {
            path: "/pv/disk.img".into(),
            format: DiskFormat::Raw,
            source: DiskSource::File,
            readonly: false,
            backing: Vec::new(),
        },
    );
    c.volumes.insert(
        "ci".into(),
        PreparedVolume {
            path: "/run/fv/vmi1/ci.iso".into(),
            format: DiskFormat::Raw,
            source: DiskSource::File,
            readonly: true,
            backing: Vec::new(),
        },
    );
    c.port_forwards.insert(80, 18080);
    c.port_forwards.insert(22, 18022);
    c
}

#[test]
fn maps_the_basics() {
    let ls = launch_spec(&vmi(base()), &ctx()).unwrap();
    assert_eq!(ls.name, "ns1_t1");
    assert_eq!(ls.uuid, "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee");
    assert_eq!(ls.smbios.serial.as_deref(), Some("S1"));
    assert_eq!(ls.smbios.manufacturer, "ferrovirt");
    assert_eq!(ls.memory_mib, 128);
    assert_eq!((ls.cpu.sockets, ls.cpu.cores, ls.cpu.threads), (1, 2, 1));
    assert_eq!(ls.cpu.model, CpuModel::Max);
    assert_eq!(ls.disks.len(), 2);
    assert_eq!(ls.disks[0].boot_order, Some(1));
    assert!(!ls.disks[0].readonly);
    assert!(ls.disks[1].readonly, "cloud-init volume is read-only");
    assert_eq!(ls.sockets.qmp, PathBuf::from("/run/fv/vmi1/qmp.sock"));
    assert!(ls.balloon);
    assert!(ls.run_as.is_none() && ls.cgroup.is_none());
    match &ls.nics[0].backend {
        NicBackend::User { forwards } => {
            assert_eq!(forwards.len(), 1, "only the listed port is forwarded");
            assert_eq!((forwards[0].guest_port, forwards[0].host_port), (80, 18080));
        }
        other => panic!("{other:?}"),
    }
    ls.validate().unwrap();
}

#[test]
fn isolation_settings_carry_over() {
    let mut c = ctx();
    c.run_as = Some("ferrovirt-qemu".into());
    c.cgroup_name = Some("uid-1".into());
    c.sandbox = true;
    let ls = launch_spec(&vmi(base()), &c).unwrap();
    assert_eq!(ls.run_as.as_deref(), Some("ferrovirt-qemu"));
    assert!(ls.sandbox);
    let cg = ls.cgroup.clone().unwrap();
    assert_eq!(cg.name, "uid-1");
    assert!(cg.memory_limit_bytes > 128 * 1024 * 1024);
    let argv = ferrovirt_launcher::qemu_command(&ls).join(" ");
    assert!(argv.contains("-runas ferrovirt-qemu"), "{argv}");
    assert!(argv.contains("elevateprivileges=allow"), "{argv}");
}

#[test]
fn kvm_uses_host_model_unless_named() {
    let mut c = ctx();
    c.accel = Accel::Kvm;
    let ls = launch_spec(&vmi(base()), &c).unwrap();
    assert_eq!(ls.cpu.model, CpuModel::Host);
    let mut v = base();
    v["spec"]["domain"]["cpu"]["model"] = json!("Skylake-Client");
    let e = launch_spec(&vmi(v.clone()), &c).unwrap_err().to_string();
    assert!(
        e.starts_with("spec.domain.cpu.model: CPU model Skylake-Client"),
        "{e}"
    );
    c.cpu_models.insert("Skylake-Client".into());
    let ls = launch_spec(&vmi(v), &c).unwrap();
    assert_eq!(ls.cpu.model, CpuModel::Named("Skylake-Client".into()));
    assert!(ls.platform.cpu_enforce, "a named model is enforced");
}

#[test]
fn tcg_runs_a_named_model_as_itself() {
    let mut c = ctx();
    c.cpu_models.insert("Westmere".into());
    let mut v = base();
    v["spec"]["domain"]["cpu"]["model"] = json!("Westmere");
    let ls = launch_spec(&vmi(v), &c).unwrap();
    assert_eq!(ls.cpu.model, CpuModel::Named("Westmere".into()));
    let argv = ferrovirt_launcher::qemu_command(&ls);
    let i = argv.iter().position(|a| a == "-cpu").unwrap();
    assert_eq!(argv[i + 1], "Westmere,enforce");
    let mut v = base();
    v["spec"]["domain"]["cpu"]["model"] = json!("host-passthrough");
    assert_eq!(launch_spec(&vmi(v), &c).unwrap().cpu.model, CpuModel::Max);
}

#[test]
fn memory_falls_back_to_requests() {
    let mut v = base();
    v["spec"]["domain"]["memory"] = json!(null);
    v["spec"]["domain"]["resources"] = json!({"requests": {"memory": "1Gi"}});
    assert_eq!(launch_spec(&vmi(v), &ctx()).unwrap().memory_mib, 1024);
    let mut v = base();
    v["spec"]["domain"]["memory"] = json!(null);
    let e = launch_spec(&vmi(v), &ctx()).unwrap_err().to_string();
    assert!(e.contains("spec.domain.memory.guest"), "{e}");
}

#[test]
fn unprepared_volume_names_the_disk() {
    let mut c = ctx();
    c.volumes.remove("ci");
    let e = launch_spec(&vmi(base()), &c).unwrap_err().to_string();
    assert!(e.contains("spec.domain.devices.disks[1].name"), "{e}");
}

#[test]
fn a_cdrom_without_a_volume_is_an_empty_drive() {
    let mut v = base();
    v["spec"]["domain"]["devices"]["disks"]
        .as_array_mut()
        .unwrap()
        .extend([
            json!({"name": "hotplug-cd", "cdrom": {"bus": "scsi"}}),
            json!({"name": "sata-cd", "cdrom": {}}),
        ]);
    let ls = launch_spec(&vmi(v.clone()), &ctx()).unwrap();
    let cd = &ls.disks[2];
    assert_eq!(cd.id, "disk-hotplug-cd");
    assert!(cd.empty && cd.cdrom && cd.is_readonly());
    assert_eq!(cd.bus, DiskBus::Scsi);
    assert_eq!(cd.path, PathBuf::new());
    assert!(cd.backing.is_empty());
    assert_eq!(ls.disks[3].bus, DiskBus::Sata, "a CD-ROM's default bus");
    assert!(ls.disks[3].empty);
    assert!(!ls.disks[0].empty && !ls.disks[1].empty);
    ls.validate().unwrap();
    let argv = ferrovirt_launcher::qemu_command(&ls).join(" ");
    assert!(
        argv.contains("scsi-cd,bus=scsi0.0,channel=0,scsi-id=0,lun=0,id=disk-hotplug-cd "),
        "{argv}"
    );

    // A CD-ROM whose volume exists in the spec but was not prepared is still an error,
    // and so is a plain disk without a volume.
    let mut w = v.clone();
    w["spec"]["volumes"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "hotplug-cd", "persistentVolumeClaim": {"claimName": "iso"}}));
    let e = launch_spec(&vmi(w), &ctx()).unwrap_err().to_string();
    assert!(e.contains("spec.domain.devices.disks[2].name"), "{e}");
    let mut w = v;
    w["spec"]["domain"]["devices"]["disks"][2] = json!({"name": "nodisk", "disk": {}});
    let e = launch_spec(&vmi(w), &ctx()).unwrap_err().to_string();
    assert!(
        e.contains("disks[2].name") && e.contains("not prepared"),
        "{e}"
    );
}

#[test]
fn mac_is_stable_and_overridable() {
    let a = launch_spec(&vmi(base()), &ctx()).unwrap();
    let b = launch_spec(&vmi(base()), &ctx()).unwrap();
    assert_eq!(a.nics[0].mac, b.nics[0].mac);
    assert!(a.nics[0].mac.as_deref().unwrap().starts_with("02:"));
    let mut v = base();
    v["spec"]["domain"]["devices"]["interfaces"][0]["macAddress"] = json!("DE-AD-BE-EF-00-01");
    let c = launch_spec(&vmi(v), &ctx()).unwrap();
    assert_eq!(c.nics[0].mac.as_deref(), Some("de:ad:be:ef:00:01"));
    let mut v = base();
    v["spec"]["domain"]["devices"]["interfaces"][0]["macAddress"] = json!("nope");
    let e = launch_spec(&vmi(v), &ctx()).unwrap_err().to_string();
    assert!(e.contains("interfaces[0].macAddress"), "{e}");
    assert_ne!(derived_mac("a", "b", "c"), derived_mac("a", "b", "d"));
}

#[test]
fn unsupported_things_name_their_field() {
    let mut v = base();
    v["spec"]["domain"]["devices"]["interfaces"][0] = json!({"name": "default", "bridge": {}});
    let e = launch_spec(&vmi(v), &ctx()).unwrap_err().to_string();
    assert!(e.contains("interfaces[0].bridge"), "{e}");
    let mut v = base();
    v["spec"]["domain"]["machine"] = json!({"type": "pc-i440fx-7.2"});
    let e = launch_spec(&vmi(v), &ctx()).unwrap_err().to_string();
    assert!(e.contains("spec.domain.machine.type"), "{e}");
    let mut v = base();
    v["spec"]["domain"]["devices"]["disks"][0]["disk"]["bus"] = json!("ide");
    let e = launch_spec(&vmi(v), &ctx()).unwrap_err().to_string();
    assert!(e.contains("disks[0].disk.bus"), "{e}");
}

#[test]
fn pod_network_taps_replace_user_networking() {
    use ferrovirt_network::{Binding, Port, PortProtocol};
    let v = base();
    let pi = pod_interface(&vmi(v.clone())).unwrap().unwrap();
    assert_eq!(pi.name, "default");
    assert_eq!(
        pi.binding,
        Binding::Masquerade {
            ports: vec![Port {
                protocol: PortProtocol::Tcp,
                port: 80
            }]
        }
    );
    let plain = launch_spec(&vmi(v.clone()), &ctx()).unwrap();
    // The pod network derives the same MAC as the mapping.
    assert_eq!(plain.nics[0].mac, Some(pi.mac.to_string()));
    let mut c = ctx();
    c.pod_taps.insert(
        "default".into(),
        PodTap {
            ifname: "tap0".into(),
            mac: pi.mac.to_string(),
        },
    );
    let ls = launch_spec(&vmi(v), &c).unwrap();
    assert_eq!(
        ls.nics[0].backend,
        NicBackend::Tap {
            ifname: "tap0".into(),
            queues: 1,
        }
    );
    assert_eq!(ls.nics[0].mac, Some(pi.mac.to_string()));
    ls.validate().unwrap();

    // Bridge binding works once the node prepared a tap.
    let mut v = base();
    v["spec"]["domain"]["devices"]["interfaces"][0] = json!({"name": "default", "bridge": {}});
    let pi = pod_interface(&vmi(v.clone())).unwrap().unwrap();
    assert_eq!(pi.binding, Binding::Bridge);
    let ls = launch_spec(&vmi(v), &c).unwrap();
    assert!(matches!(ls.nics[0].backend, NicBackend::Tap { .. }));

    // KubeVirt's l2bridge binding plugin (a Primary UDN's interface) is the bridge binding.
    let mut v = base();
    v["spec"]["domain"]["devices"]["interfaces"][0] =
        json!({"name": "default", "binding": {"name": "l2bridge"}});
    let pi = pod_interface(&vmi(v.clone())).unwrap().unwrap();
    assert_eq!(pi.binding, Binding::Bridge);
    let ls = launch_spec(&vmi(v.clone()), &c).unwrap();
    assert!(matches!(ls.nics[0].backend, NicBackend::Tap { .. }));
    // Outside a Primary UDN namespace the agent refuses it naming the field.
    let e = crate::udn::l2bridge_outside_udn(&vmi(v))
        .unwrap()
        .to_string();
    assert!(
        e.contains("interfaces[0].binding.name") && e.contains("Primary UserDefinedNetwork"),
        "{e}"
    );

    // No pod interface, and refused port protocols.
    let mut v = base();
    v["spec"]["domain"]["devices"]["interfaces"] = json!([]);
    assert_eq!(pod_interface(&vmi(v)).unwrap(), None);
    let mut v = base();
    v["spec"]["domain"]["devices"]["interfaces"][0]["ports"] =
        json!([{"port": 9, "protocol": "SCTP"}]);
    let e = pod_interface(&vmi(v)).unwrap_err().to_string();
    assert!(e.contains("interfaces[0].ports[0].protocol"), "{e}");
}

#[test]
fn efi_secure_boot_and_paused_start() {
    let mut v = base();
    v["spec"]["domain"]["firmware"]["bootloader"] = json!({"efi": {"secureBoot": false}});
    v["spec"]["startStrategy"] = json!("Paused");
    let ls = launch_spec(&vmi(v), &ctx()).unwrap();
    match ls.firmware {
        Firmware::Efi {
            secure_boot,
            code_path,
            vars_path,
        } => {
            assert!(!secure_boot);
            assert_eq!(code_path, OvmfPaths::default().code);
            assert_eq!(vars_path, PathBuf::from("/run/fv/vmi1/OVMF_VARS.fd"));
        }
        Firmware::Bios => panic!("expected EFI"),
    }
    assert!(ls.start_paused);
}

#[test]
fn autoattach_switches_drop_sockets() {
    let mut v = base();
    v["spec"]["domain"]["devices"]["autoattachSerialConsole"] = json!(false);
    v["spec"]["domain"]["devices"]["autoattachGraphicsDevice"] = json!(false);
    v["spec"]["domain"]["devices"]["autoattachMemBalloon"] = json!(false);
    let ls = launch_spec(&vmi(v), &ctx()).unwrap();
    assert!(ls.sockets.serial.is_none());
    assert!(ls.sockets.vnc.is_none());
    assert!(!ls.balloon);
}
