//! Tests of `platform`: each honoured field's launcher setting, each refused field's name.

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstanceSpec;
use ferrovirt_launcher::platform::{SoundModel, TabletBus, WatchdogAction};
use ferrovirt_launcher::spec::{Accel, VideoModel};
use serde_json::{Value, json};

use super::map;
use crate::error::AgentError;

fn spec(domain: Value) -> VirtualMachineInstanceSpec {
    serde_json::from_value(json!({ "domain": domain })).expect("spec")
}

/// 2001-09-09T01:46:40Z.
fn now() -> jiff::Timestamp {
    jiff::Timestamp::from_second(1_000_000_000).unwrap()
}

fn refused(domain: Value, accel: Accel) -> String {
    match map(&spec(domain), accel, now()) {
        Err(AgentError::Unsupported { field, .. } | AgentError::Invalid { field, .. }) => field,
        other => panic!("not refused: {other:?}"),
    }
}

#[test]
fn a_plain_vmi_gets_qemu_defaults() {
    let (p, video) = map(&spec(json!({"cpu": {"cores": 2}})), Accel::Tcg, now()).unwrap();
    assert_eq!(p, Default::default());
    assert_eq!(video, VideoModel::Vga);
}

#[test]
fn honoured_fields_reach_the_launcher() {
    let d = json!({
        "cpu": {"cores": 2, "features": [
            {"name": "avx2", "policy": "require"},
            {"name": "vmx", "policy": "disable"},
            {"name": "pdpe1gb", "policy": "optional"}]},
        "features": {"acpi": {}, "apic": {}, "smm": {"enabled": false},
                     "kvm": {"hidden": true}, "pvspinlock": {"enabled": false}},
        "clock": {"utc": {"offsetSeconds": 3600},
                  "timer": {"hpet": {"present": false}, "pit": {"tickPolicy": "delay"},
                            "rtc": {"tickPolicy": "catchup", "track": "guest"}}},
        "rebootPolicy": "Terminate",
        "chassis": {"manufacturer": "Acme", "asset": "A-1"},
        "devices": {
            "watchdog": {"name": "w", "i6300esb": {"action": "poweroff"}},
            "panicDevices": [{"model": "isa"}],
            "inputs": [{"name": "t", "type": "tablet", "bus": "virtio"}],
            "sound": {"name": "s", "model": "ac97"},
            "video": {"type": "virtio"},
            "blockMultiQueue": true,
            "disableHotplug": true,
            "networkInterfaceMultiqueue": false
        }
    });
    let (p, video) = map(&spec(d.clone()), Accel::Kvm, now()).unwrap();
    assert_eq!(p.cpu_flags, ["+avx2", "-vmx", "+pdpe1gb"]);
    assert!(p.cpu_enforce);
    assert_eq!(
        (p.acpi, p.smm, p.hpet),
        (Some(true), Some(false), Some(false))
    );
    assert!(p.kvm_hidden && p.pv_unhalt_off && p.no_reboot);
    assert_eq!(p.rtc_base.as_deref(), Some("2001-09-09T02:46:40"));
    assert!(p.rtc_catchup && p.rtc_track_guest);
    assert_eq!(p.watchdog, Some(WatchdogAction::Poweroff));
    assert!(p.pvpanic);
    assert_eq!(p.tablets, [TabletBus::Virtio]);
    assert_eq!(p.sound, Some(SoundModel::Ac97));
    let chassis = p.chassis.unwrap();
    assert_eq!(chassis.manufacturer.as_deref(), Some("Acme"));
    assert_eq!(chassis.asset.as_deref(), Some("A-1"));
    assert_eq!(video, VideoModel::VirtioGpu);
    // Under TCG there is no PV spinlock hint to turn off.
    let (p, _) = map(&spec(d), Accel::Tcg, now()).unwrap();
    assert!(!p.pv_unhalt_off);
}

#[test]
fn a_timezone_starts_the_rtc_at_its_local_time() {
    let d = json!({"clock": {"timezone": "Asia/Kolkata"}});
    let (p, _) = map(&spec(d), Accel::Tcg, now()).unwrap();
    // UTC+05:30.
    assert_eq!(p.rtc_base.as_deref(), Some("2001-09-09T07:16:40"));
    assert_eq!(
        refused(json!({"clock": {"timezone": "Mars/Olympus"}}), Accel::Tcg),
        "spec.domain.clock.timezone"
    );
}

#[test]
fn autoattached_input_is_a_usb_tablet() {
    let d = json!({"devices": {"autoattachInputDevice": true}});
    let (p, _) = map(&spec(d), Accel::Tcg, now()).unwrap();
    assert_eq!(p.tablets, [TabletBus::Usb]);
}

#[test]
fn what_is_not_carried_out_is_refused_naming_the_field() {
    let cases = [
        (
            json!({"features": {"hyperv": {"relaxed": {}}}}),
            "spec.domain.features.hyperv",
        ),
        (
            json!({"features": {"hypervPassthrough": {"enabled": true}}}),
            "spec.domain.features.hypervPassthrough",
        ),
        (
            json!({"features": {"apic": {"enabled": false}}}),
            "spec.domain.features.apic.enabled",
        ),
        (
            json!({"clock": {"timer": {"hyperv": {}}}}),
            "spec.domain.clock.timer.hyperv",
        ),
        (
            json!({"clock": {"timer": {"kvm": {"present": true}}}}),
            "spec.domain.clock.timer.kvm.present",
        ),
        (
            json!({"clock": {"timer": {"pit": {"tickPolicy": "discard"}}}}),
            "spec.domain.clock.timer.pit.tickPolicy",
        ),
        (
            json!({"cpu": {"numa": {"guestMappingPassthrough": {}}}}),
            "spec.domain.cpu.numa",
        ),
        (json!({"cpu": {"realtime": {}}}), "spec.domain.cpu.realtime"),
        (
            json!({"cpu": {"sockets": 1, "maxSockets": 4}}),
            "spec.domain.cpu.maxSockets",
        ),
        (
            json!({"cpu": {"features": [{"name": "a,b", "policy": "require"}]}}),
            "spec.domain.cpu.features[0].name",
        ),
        (
            json!({"memory": {"guest": "1Gi", "maxGuest": "4Gi"}}),
            "spec.domain.memory.maxGuest",
        ),
        (
            json!({"ioThreadsPolicy": "shared"}),
            "spec.domain.ioThreadsPolicy",
        ),
        (
            json!({"rebootPolicy": "Sometimes"}),
            "spec.domain.rebootPolicy",
        ),
        (json!({"devices": {"tpm": {}}}), "spec.domain.devices.tpm"),
        (
            json!({"devices": {"autoattachVSOCK": true}}),
            "spec.domain.devices.autoattachVSOCK",
        ),
        (
            json!({"devices": {"downwardMetrics": {}}}),
            "spec.domain.devices.downwardMetrics",
        ),
        (
            json!({"devices": {"clientPassthrough": {}}}),
            "spec.domain.devices.clientPassthrough",
        ),
        (
            json!({"devices": {"filesystems": [{"name": "f", "virtiofs": {}}]}}),
            "spec.domain.devices.filesystems",
        ),
        (
            json!({"devices": {"useVirtioTransitional": true}}),
            "spec.domain.devices.useVirtioTransitional",
        ),
        (
            json!({"devices": {"logSerialConsole": false}}),
            "spec.domain.devices.logSerialConsole",
        ),
        (
            json!({"devices": {"inputs": [{"name": "k", "type": "keyboard"}]}}),
            "spec.domain.devices.inputs[0].type",
        ),
        (
            json!({"devices": {"video": {"type": "cirrus"}}}),
            "spec.domain.devices.video.type",
        ),
        (
            json!({"devices": {"watchdog": {"name": "w", "diag288": {}}}}),
            "spec.domain.devices.watchdog.diag288",
        ),
        (
            json!({"firmware": {"bootloader": {"efi": {}}}, "features": {"smm": {"enabled": false}}}),
            "spec.domain.features.smm.enabled",
        ),
    ];
    for (domain, field) in cases {
        assert_eq!(refused(domain.clone(), Accel::Tcg), field, "{domain}");
    }
    // Multi-queue NICs are honoured (mapping::nic_queues), with any vCPU count.
    for cores in [1, 2] {
        let d = json!({"cpu": {"cores": cores}, "devices": {"networkInterfaceMultiqueue": true}});
        assert!(map(&spec(d), Accel::Tcg, now()).is_ok());
    }
    // kvmclock exists under KVM.
    let d = json!({"clock": {"timer": {"kvm": {"present": true}}}});
    assert!(map(&spec(d), Accel::Kvm, now()).is_ok());
}
