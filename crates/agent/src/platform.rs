//! Honour or refuse the VMI's platform fields: `domain.features`, `domain.clock`,
//! `domain.rebootPolicy`, `domain.chassis`, `domain.cpu` beyond topology and model, the
//! `domain.devices` flags and devices besides disks and NICs. What the launcher carries out is
//! mapped onto its [`Platform`] (and the video model); everything else refuses the VMI naming the
//! field (docs/vmi-platform.md lists both), so no field is dropped silently. Pure.

use ferrovirt_api::kubevirt::domain::{FeatureState, Features, Timer};
use ferrovirt_api::kubevirt::vmi::VirtualMachineInstanceSpec;
use ferrovirt_launcher::platform::{Chassis, Platform, SoundModel, TabletBus, WatchdogAction};
use ferrovirt_launcher::spec::{Accel, VideoModel};

use crate::error::AgentError;

const D: &str = "spec.domain";

fn refuse(field: impl Into<String>, why: impl Into<String>) -> AgentError {
    AgentError::unsupported(field, why)
}

fn enabled(f: &Option<FeatureState>) -> Option<bool> {
    // A feature given as `{}` is on.
    f.as_ref().map(|s| s.enabled.unwrap_or(true))
}

/// The launcher's platform and video model for a VMI spec, or the first field ferrovirt does
/// not carry out. `now`: when the VM starts (the RTC base of a clock offset or timezone).
pub fn map(
    spec: &VirtualMachineInstanceSpec,
    accel: Accel,
    now: jiff::Timestamp,
) -> Result<(Platform, VideoModel), AgentError> {
    let d = &spec.domain;
    let mut p = Platform::default();
    cpu(spec, &mut p)?;
    memory_and_firmware(spec)?;
    if let Some(f) = &d.features {
        features(f, accel, &mut p)?;
    }
    let secure_boot = d
        .firmware
        .as_ref()
        .and_then(|f| f.bootloader.as_ref())
        .and_then(|b| b.efi.as_ref())
        .is_some_and(|e| e.secure_boot != Some(false));
    if secure_boot && p.smm == Some(false) {
        return Err(AgentError::invalid(
            format!("{D}.features.smm.enabled"),
            "EFI secure boot needs SMM",
        ));
    }
    if let Some(c) = &d.clock {
        if let Some(tz) = &c.timezone {
            let zone = jiff::tz::TimeZone::get(tz).map_err(|e| {
                AgentError::invalid(
                    format!("{D}.clock.timezone"),
                    format!("unknown time zone {tz:?}: {e}"),
                )
            })?;
            let offset = zone.to_offset(now).seconds();
            p.rtc_base = rtc_base(now, i64::from(offset));
        } else if let Some(off) = c.utc.as_ref().and_then(|u| u.offset_seconds) {
            p.rtc_base = rtc_base(now, i64::from(off));
        }
        if let Some(t) = &c.timer {
            timers(t, accel, &mut p)?;
        }
    }
    match d.reboot_policy.as_deref() {
        None | Some("Reboot") => {}
        Some("Terminate") => p.no_reboot = true,
        Some(other) => {
            return Err(refuse(
                format!("{D}.rebootPolicy"),
                format!("unknown reboot policy {other:?} (Reboot, Terminate)"),
            ));
        }
    }
    if let Some(c) = &d.chassis {
        p.chassis = Some(Chassis {
            manufacturer: c.manufacturer.clone(),
            version: c.version.clone(),
            serial: c.serial.clone(),
            asset: c.asset.clone(),
            sku: c.sku.clone(),
        });
    }
    if d.io_threads_policy.is_some() || d.io_threads.is_some() {
        return Err(refuse(
            format!("{D}.ioThreadsPolicy"),
            "dedicated I/O threads are not carried out by ferrovirt's launcher",
        ));
    }
    let video = devices(spec, &mut p)?;
    Ok((p, video))
}

/// `-rtc base=` for a start `offset` seconds east of UTC; None at UTC itself.
fn rtc_base(now: jiff::Timestamp, offset: i64) -> Option<String> {
    if offset == 0 {
        return None;
    }
    let t = jiff::Timestamp::from_second(now.as_second().saturating_add(offset)).ok()?;
    Some(t.strftime("%Y-%m-%dT%H:%M:%S").to_string())
}

fn cpu(spec: &VirtualMachineInstanceSpec, p: &mut Platform) -> Result<(), AgentError> {
    let Some(c) = &spec.domain.cpu else {
        return Ok(());
    };
    for (i, f) in c.features.iter().flatten().enumerate() {
        let field = format!("{D}.cpu.features[{i}]");
        if f.name.is_empty()
            || !f
                .name
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '-' | '_' | '.'))
        {
            return Err(AgentError::invalid(
                format!("{field}.name"),
                format!("{:?} is not a CPU feature name", f.name),
            ));
        }
        // libvirt's policies as QEMU flags: require fails the start when the CPU lacks it.
        match f.policy.as_deref().unwrap_or("require") {
            "require" => {
                p.cpu_flags.push(format!("+{}", f.name));
                p.cpu_enforce = true;
            }
            "force" | "optional" => p.cpu_flags.push(format!("+{}", f.name)),
            "disable" | "forbid" => p.cpu_flags.push(format!("-{}", f.name)),
            other => {
                return Err(refuse(
                    format!("{field}.policy"),
                    format!("unknown policy {other:?}"),
                ));
            }
        }
    }
    let sockets = c.sockets.unwrap_or(1).max(1);
    if c.max_sockets.is_some_and(|m| m > sockets) {
        return Err(refuse(
            format!("{D}.cpu.maxSockets"),
            "CPU hotplug is not carried out by ferrovirt",
        ));
    }
    for (set, name) in [
        (c.numa.is_some(), "numa"),
        (c.realtime.is_some(), "realtime"),
        (
            c.isolate_emulator_thread == Some(true),
            "isolateEmulatorThread",
        ),
    ] {
        if set {
            return Err(refuse(
                format!("{D}.cpu.{name}"),
                "vCPU pinning and NUMA placement are not carried out by ferrovirt's launcher",
            ));
        }
    }
    Ok(())
}

fn memory_and_firmware(spec: &VirtualMachineInstanceSpec) -> Result<(), AgentError> {
    let d = &spec.domain;
    if let Some(m) = &d.memory {
        if let (Some(max), Some(guest)) = (&m.max_guest, &m.guest)
            && max.0 != guest.0
        {
            return Err(refuse(
                format!("{D}.memory.maxGuest"),
                "memory hotplug is not carried out by ferrovirt",
            ));
        }
        if m.reserved_overhead.is_some() {
            return Err(refuse(
                format!("{D}.memory.reservedOverhead"),
                "not carried out by ferrovirt (its memory overhead is a fixed constant)",
            ));
        }
    }
    if d.firmware.as_ref().is_some_and(|f| f.acpi.is_some()) {
        return Err(refuse(
            format!("{D}.firmware.acpi"),
            "ACPI SLIC/MSDM tables are not carried out by ferrovirt",
        ));
    }
    Ok(())
}

fn features(f: &Features, accel: Accel, p: &mut Platform) -> Result<(), AgentError> {
    let fd = format!("{D}.features");
    p.acpi = enabled(&f.acpi);
    p.smm = enabled(&f.smm);
    if let Some(apic) = &f.apic {
        if apic.enabled == Some(false) {
            return Err(refuse(
                format!("{fd}.apic.enabled"),
                "a q35 machine always has an APIC",
            ));
        }
        if apic.end_of_interrupt == Some(true) {
            return Err(refuse(
                format!("{fd}.apic.endOfInterrupt"),
                "not carried out by ferrovirt's launcher",
            ));
        }
    }
    if f.hyperv.is_some() || enabled(&f.hyperv_passthrough) == Some(true) {
        let which = if f.hyperv.is_some() {
            "hyperv"
        } else {
            "hypervPassthrough"
        };
        return Err(refuse(
            format!("{fd}.{which}"),
            "Hyper-V enlightenments are not carried out by ferrovirt's launcher",
        ));
    }
    if let Some(kvm) = &f.kvm {
        p.kvm_hidden = kvm.hidden == Some(true);
    }
    // The PV spinlock hint exists only under KVM: disabling it under TCG holds trivially.
    p.pv_unhalt_off = enabled(&f.pvspinlock) == Some(false) && accel == Accel::Kvm;
    Ok(())
}

fn timers(t: &Timer, accel: Accel, p: &mut Platform) -> Result<(), AgentError> {
    let td = format!("{D}.clock.timer");
    if let Some(h) = &t.hpet {
        p.hpet = h.present;
        if h.tick_policy.is_some() {
            return Err(refuse(
                format!("{td}.hpet.tickPolicy"),
                "not carried out by ferrovirt's launcher",
            ));
        }
    }
    if let Some(pit) = &t.pit {
        if pit.present == Some(false) {
            return Err(refuse(
                format!("{td}.pit.present"),
                "a q35 machine always has a PIT",
            ));
        }
        // QEMU's PIT delivers late ticks late: libvirt's `delay`, its default.
        if pit.tick_policy.as_deref().is_some_and(|t| t != "delay") {
            return Err(refuse(
                format!("{td}.pit.tickPolicy"),
                "only delay is carried out",
            ));
        }
    }
    if let Some(rtc) = &t.rtc {
        if rtc.present == Some(false) {
            return Err(refuse(
                format!("{td}.rtc.present"),
                "a q35 machine always has an RTC",
            ));
        }
        match rtc.tick_policy.as_deref() {
            None | Some("delay") => {}
            Some("catchup") => p.rtc_catchup = true,
            Some(other) => {
                return Err(refuse(
                    format!("{td}.rtc.tickPolicy"),
                    format!("{other:?} is not carried out (delay, catchup)"),
                ));
            }
        }
        match rtc.track.as_deref() {
            None | Some("wall") => {}
            Some("guest") => p.rtc_track_guest = true,
            Some(other) => {
                return Err(refuse(
                    format!("{td}.rtc.track"),
                    format!("unknown value {other:?} (guest, wall)"),
                ));
            }
        }
    }
    if let Some(kvm) = &t.kvm {
        // kvmclock exists only under KVM (where QEMU offers it by default).
        if kvm.present == Some(true) && accel != Accel::Kvm {
            return Err(refuse(
                format!("{td}.kvm.present"),
                "kvmclock needs KVM, which this node does not use",
            ));
        }
        if kvm.present == Some(false) && accel == Accel::Kvm {
            p.cpu_flags.push("-kvmclock".into());
        }
    }
    if t.hyperv.as_ref().is_some_and(|h| h.present != Some(false)) {
        return Err(refuse(
            format!("{td}.hyperv"),
            "Hyper-V enlightenments are not carried out by ferrovirt's launcher",
        ));
    }
    Ok(())
}

fn devices(spec: &VirtualMachineInstanceSpec, p: &mut Platform) -> Result<VideoModel, AgentError> {
    let dev = &spec.domain.devices;
    let dd = format!("{D}.devices");
    if let Some(w) = &dev.watchdog {
        if w.diag288.is_some() {
            return Err(refuse(
                format!("{dd}.watchdog.diag288"),
                "the s390x watchdog does not exist on x86_64",
            ));
        }
        let action = w.i6300esb.as_ref().and_then(|i| i.action.as_deref());
        p.watchdog = Some(match action {
            None | Some("reset") => WatchdogAction::Reset,
            Some("poweroff") => WatchdogAction::Poweroff,
            Some("shutdown") => WatchdogAction::Shutdown,
            Some(other) => {
                return Err(refuse(
                    format!("{dd}.watchdog.i6300esb.action"),
                    format!("unknown action {other:?} (poweroff, reset, shutdown)"),
                ));
            }
        });
    }
    for (i, pd) in dev.panic_devices.iter().flatten().enumerate() {
        match pd.model.as_deref() {
            None | Some("isa") | Some("pvpanic") => p.pvpanic = true,
            Some(other) => {
                return Err(refuse(
                    format!("{dd}.panicDevices[{i}].model"),
                    format!("{other:?} is not carried out (isa)"),
                ));
            }
        }
    }
    for (i, input) in dev.inputs.iter().flatten().enumerate() {
        if input.type_ != "tablet" {
            return Err(refuse(
                format!("{dd}.inputs[{i}].type"),
                format!("{:?} is not carried out (tablet)", input.type_),
            ));
        }
        p.tablets.push(match input.bus.as_deref() {
            None | Some("usb") => TabletBus::Usb,
            Some("virtio") => TabletBus::Virtio,
            Some(other) => {
                return Err(refuse(
                    format!("{dd}.inputs[{i}].bus"),
                    format!("{other:?} is not carried out (usb, virtio)"),
                ));
            }
        });
    }
    if dev.autoattach_input_device == Some(true) && p.tablets.is_empty() {
        // KubeVirt's autoattached input device: a USB tablet.
        p.tablets.push(TabletBus::Usb);
    }
    if let Some(s) = &dev.sound {
        p.sound = Some(match s.model.as_deref() {
            None | Some("ich9") => SoundModel::Ich9,
            Some("ac97") => SoundModel::Ac97,
            Some(other) => {
                return Err(refuse(
                    format!("{dd}.sound.model"),
                    format!("{other:?} is not carried out (ich9, ac97)"),
                ));
            }
        });
    }
    let video = match dev.video.as_ref().and_then(|v| v.type_.as_deref()) {
        None | Some("vga") => VideoModel::Vga,
        Some("bochs") => VideoModel::Bochs,
        Some("virtio") => VideoModel::VirtioGpu,
        Some(other) => {
            return Err(refuse(
                format!("{dd}.video.type"),
                format!("{other:?} is not carried out (vga, bochs, virtio)"),
            ));
        }
    };
    let refusals: [(bool, &str, &str); 7] = [
        (
            dev.tpm.as_ref().is_some_and(|t| t.enabled != Some(false)),
            "tpm",
            "a virtual TPM (swtpm) is not carried out by ferrovirt's launcher",
        ),
        (
            dev.autoattach_vsock == Some(true),
            "autoattachVSOCK",
            "VSOCK is not carried out by ferrovirt's launcher",
        ),
        (
            dev.downward_metrics.is_some(),
            "downwardMetrics",
            "not carried out by ferrovirt's launcher",
        ),
        (
            dev.client_passthrough.is_some(),
            "clientPassthrough",
            "USB redirection is not carried out by ferrovirt",
        ),
        (
            !dev.filesystems.as_deref().unwrap_or_default().is_empty(),
            "filesystems",
            "virtiofs is not carried out by ferrovirt's launcher",
        ),
        (
            dev.use_virtio_transitional == Some(true),
            "useVirtioTransitional",
            "transitional virtio devices are not carried out by ferrovirt's launcher",
        ),
        (
            dev.log_serial_console == Some(false),
            "logSerialConsole",
            "ferrovirt always keeps the serial console's log (bounded, see --serial-log-max-bytes)",
        ),
    ];
    if let Some((_, field, why)) = refusals.iter().find(|(set, _, _)| *set) {
        return Err(refuse(format!("{dd}.{field}"), *why));
    }
    // blockMultiQueue: QEMU gives a virtio-blk disk one queue per vCPU by default.
    // networkInterfaceMultiqueue: a virtio tap NIC gets a queue pair per vCPU
    // (mapping::nic_queues, the network plans' multi_queue taps).
    // disableHotplug: the launcher reserves no hotplug ports in the first place.
    Ok(video)
}

#[cfg(test)]
#[path = "platform_tests.rs"]
mod tests;
