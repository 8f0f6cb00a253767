//! Instancetype and preference expansion: the VMI spec a VM runs with, given the
//! instancetype and preference it refers to. A pure function of its inputs.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::admission::{FieldError, Invalid, instancetype_conflicts};
use crate::kubevirt::domain::{Bios, Bootloader, Cpu, Efi, Firmware, Machine, Memory};
use crate::kubevirt::domain::{Features, ResourceRequirements};
use crate::kubevirt::instancetype::{InstancetypeSpec, PreferenceSpec};
use crate::kubevirt::vmi::VirtualMachineInstanceSpec;
use crate::quantity;

/// Path of the template spec errors are reported against.
const TEMPLATE: &str = "spec.template.spec";

/// Expand a VM's template spec with its instancetype (CPU, memory, devices it owns; setting
/// them in the VM too is an error naming the field) and preference (defaults used only where
/// the template leaves a field unset).
pub fn expand(
    template: &VirtualMachineInstanceSpec,
    instancetype: Option<&InstancetypeSpec>,
    preference: Option<&PreferenceSpec>,
) -> Result<VirtualMachineInstanceSpec, Invalid> {
    let mut spec = template.clone();
    let mut errors = Vec::new();
    if let Some(it) = instancetype {
        errors.extend(instancetype_conflicts(TEMPLATE, template, Some(it)));
        if errors.is_empty() {
            apply_instancetype(&mut spec, it, preference);
        }
    }
    if let Some(pref) = preference {
        errors.extend(check_requirements(&spec, instancetype, pref));
        apply_preference(&mut spec, pref);
    }
    Invalid::check(errors)?;
    Ok(spec)
}

/// Guest vCPUs of a spec: sockets × cores × threads (each defaulting to 1).
pub fn vcpus(spec: &VirtualMachineInstanceSpec) -> u64 {
    let cpu = spec.domain.cpu.as_ref();
    let get = |f: fn(&Cpu) -> Option<u32>| u64::from(cpu.and_then(f).unwrap_or(1).max(1));
    get(|c| c.sockets) * get(|c| c.cores) * get(|c| c.threads)
}

fn topology(guest: u32, preference: Option<&PreferenceSpec>) -> (u32, u32, u32) {
    let cpu_pref = preference.and_then(|p| p.cpu.as_ref());
    let preferred = cpu_pref
        .and_then(|c| c.preferred_cpu_topology.as_deref())
        .unwrap_or("sockets");
    match preferred {
        "cores" | "preferCores" => (1, guest, 1),
        "threads" | "preferThreads" => (1, 1, guest),
        "spread" | "preferSpread" => {
            let ratio = cpu_pref
                .and_then(|c| c.spread_options.as_ref())
                .and_then(|s| s.ratio)
                .or_else(|| preference.and_then(|p| p.prefer_spread_socket_to_core_ratio))
                .unwrap_or(2)
                .max(1);
            if guest.is_multiple_of(ratio) {
                (guest / ratio, ratio, 1)
            } else {
                (guest, 1, 1)
            }
        }
        // "sockets", "any" and anything unknown.
        _ => (guest, 1, 1),
    }
}

fn apply_instancetype(
    spec: &mut VirtualMachineInstanceSpec,
    it: &InstancetypeSpec,
    preference: Option<&PreferenceSpec>,
) {
    let d = &mut spec.domain;
    let cpu = d.cpu.get_or_insert_with(Cpu::default);
    let (sockets, cores, threads) = topology(it.cpu.guest.max(1), preference);
    cpu.sockets = Some(sockets);
    cpu.cores = Some(cores);
    cpu.threads = Some(threads);
    fill(&mut cpu.model, &it.cpu.model);
    fill(
        &mut cpu.dedicated_cpu_placement,
        &it.cpu.dedicated_cpu_placement,
    );
    fill(
        &mut cpu.isolate_emulator_thread,
        &it.cpu.isolate_emulator_thread,
    );
    fill(&mut cpu.numa, &it.cpu.numa);
    fill(&mut cpu.realtime, &it.cpu.realtime);
    fill(&mut cpu.max_sockets, &it.cpu.max_sockets);

    let mem = d.memory.get_or_insert_with(Memory::default);
    mem.guest = Some(it.memory.guest.clone());
    fill(&mut mem.hugepages, &it.memory.hugepages);
    fill(&mut mem.max_guest, &it.memory.max_guest);
    if let Some(pct) = it.memory.overcommit_percent
        && (1..=100).contains(&pct)
        && let Ok(bytes) = quantity::parse(&it.memory.guest.0)
    {
        let request = bytes * f64::from(100 - pct) / 100.0;
        let res = d
            .resources
            .get_or_insert_with(ResourceRequirements::default);
        res.requests
            .get_or_insert_with(BTreeMap::new)
            .insert("memory".into(), Quantity(format_bytes(request)));
    }
    if let Some(gpus) = &it.gpus {
        d.devices
            .gpus
            .get_or_insert_with(Vec::new)
            .extend(gpus.iter().cloned());
    }
    if let Some(hds) = &it.host_devices {
        d.devices
            .host_devices
            .get_or_insert_with(Vec::new)
            .extend(hds.iter().cloned());
    }
    fill(&mut d.io_threads_policy, &it.io_threads_policy);
    fill(&mut spec.node_selector, &it.node_selector);
    fill(&mut spec.scheduler_name, &it.scheduler_name);
}

/// Format a byte count as the largest exact binary unit.
fn format_bytes(bytes: f64) -> String {
    let b = bytes.max(0.0).round() as u64;
    for (unit, size) in [("Gi", 1u64 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)] {
        if b >= size && b.is_multiple_of(size) {
            return format!("{}{unit}", b / size);
        }
    }
    b.to_string()
}

fn fill<T: Clone>(slot: &mut Option<T>, value: &Option<T>) {
    if slot.is_none() {
        slot.clone_from(value);
    }
}

fn check_requirements(
    spec: &VirtualMachineInstanceSpec,
    instancetype: Option<&InstancetypeSpec>,
    pref: &PreferenceSpec,
) -> Vec<FieldError> {
    let mut e = Vec::new();
    let Some(req) = &pref.requirements else {
        return e;
    };
    if let Some(cpu) = &req.cpu {
        let have = instancetype.map_or_else(|| vcpus(spec), |it| u64::from(it.cpu.guest));
        if have < u64::from(cpu.guest) {
            let field = if instancetype.is_some() {
                "spec.instancetype".to_string()
            } else {
                format!("{TEMPLATE}.domain.cpu")
            };
            e.push(FieldError::invalid(
                field,
                format!(
                    "insufficient CPU resources of {have} vCPU provided, preference requires {}",
                    cpu.guest
                ),
            ));
        }
    }
    if let Some(mem) = &req.memory {
        let have = spec
            .domain
            .memory
            .as_ref()
            .and_then(|m| m.guest.as_ref())
            .and_then(|q| quantity::parse(&q.0).ok());
        let need = quantity::parse(&mem.guest.0).ok();
        if let (Some(have), Some(need)) = (have, need)
            && have < need
        {
            let field = if instancetype.is_some() {
                "spec.instancetype".to_string()
            } else {
                format!("{TEMPLATE}.domain.memory")
            };
            e.push(FieldError::invalid(
                field,
                format!("insufficient memory, preference requires {}", mem.guest.0),
            ));
        }
    }
    e
}

fn apply_preference(spec: &mut VirtualMachineInstanceSpec, pref: &PreferenceSpec) {
    let d = &mut spec.domain;
    if let Some(cpu) = &pref.cpu
        && let Some(features) = &cpu.preferred_cpu_features
    {
        let c = d.cpu.get_or_insert_with(Cpu::default);
        fill(&mut c.features, &Some(features.clone()));
    }
    if let Some(m) = &pref.machine {
        let machine = d.machine.get_or_insert_with(Machine::default);
        if machine.type_.as_deref().unwrap_or("").is_empty() {
            machine.type_.clone_from(&m.preferred_machine_type);
        }
    }
    if let Some(c) = &pref.clock {
        if let Some(offset) = &c.preferred_clock_offset {
            fill(&mut d.clock, &Some(offset.clone()));
        }
        if let Some(timer) = &c.preferred_timer
            && let Some(clock) = &mut d.clock
        {
            fill(&mut clock.timer, &Some(timer.clone()));
        }
    }
    if let Some(f) = &pref.features {
        let features = d.features.get_or_insert_with(Features::default);
        fill(&mut features.acpi, &f.preferred_acpi);
        fill(&mut features.apic, &f.preferred_apic);
        fill(&mut features.hyperv, &f.preferred_hyperv);
        fill(&mut features.kvm, &f.preferred_kvm);
        fill(&mut features.pvspinlock, &f.preferred_pvspinlock);
        fill(&mut features.smm, &f.preferred_smm);
        if *features == Features::default() {
            d.features = None;
        }
    }
    if let Some(fw) = &pref.firmware {
        let firmware = d.firmware.get_or_insert_with(Firmware::default);
        if firmware.bootloader.is_none() {
            let efi = fw.preferred_efi.clone().or_else(|| {
                (fw.preferred_use_efi == Some(true) || fw.preferred_use_secure_boot.is_some())
                    .then_some(Efi {
                        secure_boot: fw.preferred_use_secure_boot,
                        persistent: None,
                    })
            });
            if let Some(efi) = efi {
                firmware.bootloader = Some(Bootloader {
                    bios: None,
                    efi: Some(efi),
                });
            } else if fw.preferred_use_bios == Some(true) {
                firmware.bootloader = Some(Bootloader {
                    bios: Some(Bios {
                        use_serial: fw.preferred_use_bios_serial,
                    }),
                    efi: None,
                });
            }
        }
        if *firmware == Firmware::default() {
            d.firmware = None;
        }
    }
    if let Some(dev) = &pref.devices {
        apply_device_preferences(spec, dev);
    }
    fill(&mut spec.subdomain, &pref.preferred_subdomain);
    fill(
        &mut spec.termination_grace_period_seconds,
        &pref.preferred_termination_grace_period_seconds,
    );
    fill(&mut spec.architecture, &pref.preferred_architecture);
}

fn apply_device_preferences(
    spec: &mut VirtualMachineInstanceSpec,
    p: &crate::kubevirt::instancetype::DevicePreferences,
) {
    let pod_networks: Vec<String> = spec
        .networks
        .iter()
        .flatten()
        .filter(|n| n.pod.is_some())
        .map(|n| n.name.clone())
        .collect();
    let dev = &mut spec.domain.devices;
    fill(
        &mut dev.autoattach_graphics_device,
        &p.preferred_autoattach_graphics_device,
    );
    fill(
        &mut dev.autoattach_mem_balloon,
        &p.preferred_autoattach_mem_balloon,
    );
    fill(
        &mut dev.autoattach_pod_interface,
        &p.preferred_autoattach_pod_interface,
    );
    fill(
        &mut dev.autoattach_serial_console,
        &p.preferred_autoattach_serial_console,
    );
    fill(
        &mut dev.autoattach_input_device,
        &p.preferred_autoattach_input_device,
    );
    fill(&mut dev.disable_hotplug, &p.preferred_disable_hotplug);
    fill(
        &mut dev.use_virtio_transitional,
        &p.preferred_use_virtio_transitional,
    );
    fill(&mut dev.rng, &p.preferred_rng);
    fill(&mut dev.block_multi_queue, &p.preferred_block_multi_queue);
    fill(
        &mut dev.network_interface_multiqueue,
        &p.preferred_network_interface_multi_queue,
    );
    fill(&mut dev.tpm, &p.preferred_tpm);
    for disk in dev.disks.iter_mut().flatten() {
        if disk.disk.is_none() && disk.cdrom.is_none() && disk.lun.is_none() {
            disk.disk = Some(Default::default());
        }
        if let Some(t) = &mut disk.disk {
            fill(&mut t.bus, &p.preferred_disk_bus);
        }
        if let Some(t) = &mut disk.cdrom {
            fill(&mut t.bus, &p.preferred_cdrom_bus);
        }
        if let Some(t) = &mut disk.lun {
            fill(&mut t.bus, &p.preferred_lun_bus);
        }
        fill(
            &mut disk.dedicated_io_thread,
            &p.preferred_disk_dedicated_io_thread,
        );
        fill(&mut disk.cache, &p.preferred_disk_cache);
        fill(&mut disk.io, &p.preferred_disk_io);
    }
    for iface in dev.interfaces.iter_mut().flatten() {
        fill(&mut iface.model, &p.preferred_interface_model);
        let unbound = iface.bridge.is_none()
            && iface.masquerade.is_none()
            && iface.sriov.is_none()
            && iface.slirp.is_none()
            && iface.passt.is_none()
            && iface.macvtap.is_none()
            && iface.binding.is_none();
        if unbound && pod_networks.contains(&iface.name) {
            iface
                .masquerade
                .clone_from(&p.preferred_interface_masquerade);
        }
    }
    for input in dev.inputs.iter_mut().flatten() {
        fill(&mut input.bus, &p.preferred_input_bus);
    }
}
