//! Validation of VMI specs (standalone or as VM/replica-set templates), VMs and DataVolumes.
//! Every check appends to the list so that one answer names every problem.

use std::collections::{HashMap, HashSet};

use serde_json::Value;

use super::FieldError;
use super::meta::{is_dns1123_label, is_dns1123_subdomain};
use crate::kubevirt::devices::Interface;
use crate::kubevirt::domain::DomainSpec;
use crate::kubevirt::instancetype::InstancetypeSpec;
use crate::kubevirt::vm::VirtualMachine;
use crate::kubevirt::vmi::{Probe, VirtualMachineInstanceSpec};
use crate::kubevirt::volumes::Volume;
use crate::quantity::{self, MIN_GUEST_MEMORY};

/// Disk buses ferrovirt accepts.
pub const DISK_BUSES: &[&str] = &["virtio", "sata", "scsi", "usb"];

/// Which checks apply beyond those shared by VMIs and templates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecChecks {
    /// VMI-only checks: every volume needs a disk or filesystem, memory must be sized.
    pub standalone_vmi: bool,
}

impl SpecChecks {
    /// Checks for a VirtualMachineInstance.
    pub fn vmi() -> Self {
        SpecChecks {
            standalone_vmi: true,
        }
    }
    /// Checks for a VMI template inside a VM or replica set.
    pub fn template() -> Self {
        SpecChecks {
            standalone_vmi: false,
        }
    }
}

fn list<T>(v: &Option<Vec<T>>) -> &[T] {
    v.as_deref().unwrap_or_default()
}

/// Validate a VMI spec whose path is `p` (`spec` or `spec.template.spec`).
pub fn validate_vmi_spec(
    p: &str,
    spec: &VirtualMachineInstanceSpec,
    checks: SpecChecks,
) -> Vec<FieldError> {
    let mut e = Vec::new();
    if let Some(h) = &spec.hostname
        && !is_dns1123_label(h)
    {
        e.push(FieldError::invalid(
            format!("{p}.hostname"),
            format!("hostname \"{h}\" is not a valid DNS-1123 label"),
        ));
    }
    if let Some(s) = &spec.subdomain
        && !is_dns1123_subdomain(s)
    {
        e.push(FieldError::invalid(
            format!("{p}.subdomain"),
            format!("subdomain \"{s}\" is not a valid DNS-1123 subdomain"),
        ));
    }
    if let Some(t) = spec.termination_grace_period_seconds
        && t < 0
    {
        e.push(FieldError::invalid(
            format!("{p}.terminationGracePeriodSeconds"),
            "must be greater than or equal to 0",
        ));
    }
    if let Some(s) = &spec.eviction_strategy
        && !["None", "LiveMigrate", "LiveMigrateIfPossible", "External"].contains(&s.as_str())
    {
        e.push(FieldError::not_supported(
            format!("{p}.evictionStrategy"),
            format!(
                "Unsupported value: \"{s}\": supported values: \"None\", \"LiveMigrate\", \
                 \"LiveMigrateIfPossible\", \"External\""
            ),
        ));
    }
    validate_domain(p, &spec.domain, checks, &mut e);
    let volumes = validate_volumes(p, spec, checks, &mut e);
    validate_disks(p, spec, &volumes, &mut e);
    validate_networks(p, spec, &mut e);
    for (name, probe) in [
        ("livenessProbe", &spec.liveness_probe),
        ("readinessProbe", &spec.readiness_probe),
    ] {
        if let Some(probe) = probe {
            validate_probe(&format!("{p}.{name}"), probe, &mut e);
        }
    }
    for (i, c) in list(&spec.access_credentials).iter().enumerate() {
        let n = usize::from(c.ssh_public_key.is_some()) + usize::from(c.user_password.is_some());
        if n != 1 {
            e.push(FieldError::invalid(
                format!("{p}.accessCredentials[{i}]"),
                "must have exactly one of sshPublicKey or userPassword",
            ));
        }
    }
    e
}

pub(super) fn check_quantity(path: String, q: &str, e: &mut Vec<FieldError>) -> Option<f64> {
    match quantity::parse(q) {
        Ok(v) if v < 0.0 => {
            e.push(FieldError::invalid(
                path,
                format!("Invalid value: \"{q}\": must be greater than or equal to 0"),
            ));
            None
        }
        Ok(v) => Some(v),
        Err(err) => {
            e.push(FieldError::invalid(
                path,
                format!("Invalid value: \"{q}\": {err}"),
            ));
            None
        }
    }
}

fn validate_domain(p: &str, d: &DomainSpec, checks: SpecChecks, e: &mut Vec<FieldError>) {
    let dp = format!("{p}.domain");
    let mut request_mem = None;
    if let Some(res) = &d.resources {
        for (section, map) in [("requests", &res.requests), ("limits", &res.limits)] {
            for (k, q) in map.iter().flatten() {
                let path = format!("{dp}.resources.{section}.{k}");
                let v = check_quantity(path.clone(), &q.0, e);
                if k == "memory"
                    && let Some(v) = v
                {
                    if v < MIN_GUEST_MEMORY {
                        e.push(FieldError::invalid(
                            path,
                            format!("'{}' must be greater than or equal to 1Mi", q.0),
                        ));
                    } else if section == "requests" {
                        request_mem = Some(v);
                    }
                }
            }
        }
    }
    let mut guest_mem = None;
    if let Some(mem) = &d.memory {
        if let Some(g) = &mem.guest {
            let path = format!("{dp}.memory.guest");
            if let Some(v) = check_quantity(path.clone(), &g.0, e) {
                if v < MIN_GUEST_MEMORY {
                    e.push(FieldError::invalid(
                        path,
                        format!("'{}' must be greater than or equal to 1Mi", g.0),
                    ));
                }
                guest_mem = Some(v);
            }
        }
        if let Some(m) = &mem.max_guest
            && let Some(max) = check_quantity(format!("{dp}.memory.maxGuest"), &m.0, e)
            && let Some(g) = guest_mem
            && max < g
        {
            e.push(FieldError::invalid(
                format!("{dp}.memory.maxGuest"),
                "must be greater than or equal to the guest memory",
            ));
        }
        if let Some(hp) = &mem.hugepages
            && let Some(size) = &hp.page_size
        {
            if quantity::parse(size).is_err() {
                e.push(FieldError::invalid(
                    format!("{dp}.memory.hugepages.pageSize"),
                    format!("Invalid value: \"{size}\": not a valid quantity"),
                ));
            } else if !HUGEPAGE_SIZES.contains(&size.as_str()) {
                e.push(FieldError::not_supported(
                    format!("{dp}.memory.hugepages.pageSize"),
                    format!("Unsupported value: \"{size}\": supported values: \"2Mi\", \"1Gi\""),
                ));
            }
        }
    }
    for (i, g) in list(&d.devices.gpus).iter().enumerate() {
        check_device_source(
            format!("{dp}.devices.gpus[{i}]"),
            &g.device_name,
            &g.claim_name,
            &g.request_name,
            e,
        );
    }
    for (i, h) in list(&d.devices.host_devices).iter().enumerate() {
        check_device_source(
            format!("{dp}.devices.hostDevices[{i}]"),
            &h.device_name,
            &h.claim_name,
            &h.request_name,
            e,
        );
    }
    e.extend(crate::kubevirt::host_devices::refused(&d.devices, &dp));
    if let (Some(g), Some(r)) = (guest_mem, request_mem)
        && g < r
    {
        // Allowed by KubeVirt (overhead); nothing to report.
    }
    let has_hugepages = d.memory.as_ref().is_some_and(|m| m.hugepages.is_some());
    if checks.standalone_vmi && guest_mem.is_none() && request_mem.is_none() && !has_hugepages {
        e.push(FieldError::required(
            format!("{dp}.resources.requests.memory"),
            format!(
                "no memory requested, at least one of '{dp}.memory.guest', \
                 '{dp}.memory.hugepages.pageSize' or '{dp}.resources.requests.memory' must be set"
            ),
        ));
    }
    if let Some(cpu) = &d.cpu {
        for (k, v) in [
            ("cores", cpu.cores),
            ("sockets", cpu.sockets),
            ("threads", cpu.threads),
        ] {
            if v == Some(0) {
                e.push(FieldError::invalid(
                    format!("{dp}.cpu.{k}"),
                    "must be greater than 0",
                ));
            }
        }
        for (i, f) in list(&cpu.features).iter().enumerate() {
            if let Some(pol) = &f.policy
                && !["", "force", "require", "optional", "disable", "forbid"]
                    .contains(&pol.as_str())
            {
                e.push(FieldError::not_supported(
                    format!("{dp}.cpu.features[{i}].policy"),
                    format!(
                        "CPU feature {} uses policy {pol} that is not supported",
                        f.name
                    ),
                ));
            }
        }
    }
    for (i, input) in list(&d.devices.inputs).iter().enumerate() {
        if let Some(bus) = &input.bus
            && !["", "virtio", "usb"].contains(&bus.as_str())
        {
            e.push(FieldError::invalid(
                format!("{dp}.devices.inputs[{i}].bus"),
                "Input device can have only virtio or usb bus.",
            ));
        }
        if input.type_ != "tablet" {
            e.push(FieldError::invalid(
                format!("{dp}.devices.inputs[{i}].type"),
                "Input device can have only tablet type.",
            ));
        }
    }
}

fn validate_volumes<'a>(
    p: &str,
    spec: &'a VirtualMachineInstanceSpec,
    checks: SpecChecks,
    e: &mut Vec<FieldError>,
) -> HashMap<&'a str, &'a Volume> {
    let mut by_name = HashMap::new();
    let used: HashSet<&str> = list(&spec.domain.devices.disks)
        .iter()
        .map(|d| d.name.as_str())
        .chain(
            list(&spec.domain.devices.filesystems)
                .iter()
                .map(|f| f.name.as_str()),
        )
        .chain(
            spec.domain
                .firmware
                .iter()
                .filter_map(|f| f.acpi.as_ref())
                .flat_map(|a| [a.slic_name_ref.as_deref(), a.msdm_name_ref.as_deref()])
                .flatten(),
        )
        .collect();
    for (i, v) in list(&spec.volumes).iter().enumerate() {
        let vp = format!("{p}.volumes[{i}]");
        if v.name.is_empty() {
            e.push(FieldError::required(
                format!("{vp}.name"),
                "volume name is required",
            ));
        } else if by_name.insert(v.name.as_str(), v).is_some() {
            e.push(FieldError::duplicate(
                format!("{vp}.name"),
                format!("Duplicate value: \"{}\"", v.name),
            ));
        }
        match v.source_count() {
            0 => e.push(FieldError::required(
                vp.clone(),
                "must have exactly one source type set",
            )),
            1 => {}
            _ => e.push(FieldError::invalid(
                vp.clone(),
                "must have exactly one source type set",
            )),
        }
        if let Some(cd) = &v.container_disk
            && cd.image.is_empty()
        {
            e.push(FieldError::required(
                format!("{vp}.containerDisk.image"),
                "image is required",
            ));
        }
        if let Some(ed) = &v.empty_disk {
            check_quantity(format!("{vp}.emptyDisk.capacity"), &ed.capacity.0, e);
        }
        if let Some(hd) = &v.host_disk {
            if !["Disk", "DiskOrCreate"].contains(&hd.type_.as_str()) {
                e.push(FieldError::not_supported(
                    format!("{vp}.hostDisk.type"),
                    "supported values: \"Disk\", \"DiskOrCreate\"",
                ));
            }
            if let Some(c) = &hd.capacity {
                check_quantity(format!("{vp}.hostDisk.capacity"), &c.0, e);
            }
        }
        if let Some(pvc) = &v.persistent_volume_claim
            && pvc.claim_name.is_empty()
        {
            e.push(FieldError::required(
                format!("{vp}.persistentVolumeClaim.claimName"),
                "claimName is required",
            ));
        }
        if let Some(dv) = &v.data_volume
            && dv.name.is_empty()
        {
            e.push(FieldError::required(
                format!("{vp}.dataVolume.name"),
                "name is required",
            ));
        }
        if checks.standalone_vmi
            && v.memory_dump.is_none()
            && !v.name.is_empty()
            && !used.contains(v.name.as_str())
        {
            e.push(FieldError::invalid(
                format!("{vp}.name"),
                format!("{vp}.name '{}' not found.", v.name),
            ));
        }
    }
    by_name
}

fn validate_disks(
    p: &str,
    spec: &VirtualMachineInstanceSpec,
    volumes: &HashMap<&str, &Volume>,
    e: &mut Vec<FieldError>,
) {
    let mut names = HashSet::new();
    let mut boot_orders: HashMap<u32, String> = HashMap::new();
    for (i, d) in list(&spec.domain.devices.disks).iter().enumerate() {
        let dp = format!("{p}.domain.devices.disks[{i}]");
        if d.name.is_empty() {
            e.push(FieldError::required(
                format!("{dp}.name"),
                "disk name is required",
            ));
        } else if !names.insert(d.name.as_str()) {
            e.push(FieldError::duplicate(
                format!("{dp}.name"),
                format!("Duplicate value: \"{}\"", d.name),
            ));
        }
        let volume = volumes.get(d.name.as_str());
        // An empty CD-ROM drive (declarative hotplug: the volume comes later).
        let empty_cdrom = d.cdrom.is_some() && d.disk.is_none() && d.lun.is_none();
        if volume.is_none() && !d.name.is_empty() && !empty_cdrom {
            e.push(FieldError::invalid(
                format!("{dp}.name"),
                format!("{dp}.name '{}' not found.", d.name),
            ));
        }
        let targets = [
            ("disk", d.disk.as_ref().map(|t| &t.bus)),
            ("lun", d.lun.as_ref().map(|t| &t.bus)),
            ("cdrom", d.cdrom.as_ref().map(|t| &t.bus)),
        ];
        if targets.iter().filter(|(_, t)| t.is_some()).count() > 1 {
            e.push(FieldError::invalid(
                dp.clone(),
                format!("{dp} can only have a single target type defined"),
            ));
        }
        for (kind, bus) in targets {
            if let Some(Some(bus)) = bus
                && !DISK_BUSES.contains(&bus.as_str())
            {
                e.push(FieldError::not_supported(
                    format!("{dp}.{kind}.bus"),
                    format!(
                        "Unsupported value: \"{bus}\": supported values: \"virtio\", \"sata\", \
                         \"scsi\", \"usb\""
                    ),
                ));
            }
        }
        if d.lun.is_some()
            && let Some(v) = volume
            && v.persistent_volume_claim.is_none()
            && v.data_volume.is_none()
        {
            e.push(FieldError::invalid(
                format!("{dp}.lun"),
                format!(
                    "{dp}.lun can only be mapped to a DataVolume or PersistentVolumeClaim volume."
                ),
            ));
        }
        if let Some(order) = d.boot_order {
            check_boot_order(format!("{dp}.bootOrder"), order, &mut boot_orders, e);
        }
    }
    for (i, iface) in list(&spec.domain.devices.interfaces).iter().enumerate() {
        if let Some(order) = iface.boot_order {
            let path = format!("{p}.domain.devices.interfaces[{i}].bootOrder");
            check_boot_order(path, order, &mut boot_orders, e);
        }
    }
}

fn check_boot_order(
    path: String,
    order: u32,
    seen: &mut HashMap<u32, String>,
    e: &mut Vec<FieldError>,
) {
    if order == 0 {
        e.push(FieldError::invalid(
            path,
            "must have a boot order > 0, if supplied",
        ));
    } else if let Some(first) = seen.get(&order) {
        e.push(FieldError::invalid(
            path.clone(),
            format!("Boot order for {path} already set for a different device ({first})."),
        ));
    } else {
        seen.insert(order, path);
    }
}

/// NIC models KubeVirt accepts.
const INTERFACE_MODELS: [&str; 7] = [
    "e1000", "e1000e", "igb", "ne2k_pci", "pcnet", "rtl8139", "virtio",
];

/// Hugepage sizes KubeVirt accepts.
const HUGEPAGE_SIZES: [&str; 2] = ["2Mi", "1Gi"];

/// A GPU or host device names either a device plugin resource or a DRA claim and request.
fn check_device_source(
    path: String,
    device_name: &Option<String>,
    claim: &Option<String>,
    request: &Option<String>,
    e: &mut Vec<FieldError>,
) {
    let plugin = device_name.as_deref().is_some_and(|s| !s.is_empty());
    let dra = claim.is_some() || request.is_some();
    if plugin == dra {
        e.push(FieldError::invalid(
            path,
            "exactly one of deviceName or claimName with requestName must be set",
        ));
    } else if dra
        && (claim.as_deref().unwrap_or("").is_empty()
            || request.as_deref().unwrap_or("").is_empty())
    {
        e.push(FieldError::required(
            path,
            "a DRA device needs both claimName and requestName",
        ));
    }
}

fn bindings(iface: &Interface) -> Vec<&'static str> {
    [
        (iface.bridge.is_some(), "bridge"),
        (iface.masquerade.is_some(), "masquerade"),
        (iface.sriov.is_some(), "sriov"),
        (iface.slirp.is_some(), "slirp"),
        (iface.passt.is_some(), "passt"),
        (iface.macvtap.is_some(), "macvtap"),
        (iface.binding.is_some(), "binding"),
        (iface.passt_binding.is_some(), "passtBinding"),
    ]
    .into_iter()
    .filter(|(set, _)| *set)
    .map(|(_, n)| n)
    .collect()
}

fn is_mac(s: &str) -> bool {
    let parts: Vec<&str> = s.split([':', '-']).collect();
    parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.chars().all(|c| c.is_ascii_hexdigit()))
}

fn validate_networks(p: &str, spec: &VirtualMachineInstanceSpec, e: &mut Vec<FieldError>) {
    let networks = list(&spec.networks);
    let interfaces = list(&spec.domain.devices.interfaces);
    let mut net_names = HashMap::new();
    let mut pod_seen = false;
    for (i, n) in networks.iter().enumerate() {
        let np = format!("{p}.networks[{i}]");
        if n.name.is_empty() {
            e.push(FieldError::required(
                format!("{np}.name"),
                "network name is required",
            ));
        } else if net_names.insert(n.name.as_str(), n).is_some() {
            e.push(FieldError::duplicate(
                format!("{np}.name"),
                format!("Duplicate value: \"{}\"", n.name),
            ));
        }
        match (
            n.pod.is_some() || n.resource_claim.is_some(),
            n.multus.as_ref(),
        ) {
            (false, None) => e.push(FieldError::required(
                np.clone(),
                "should have a network type",
            )),
            (true, Some(_)) => e.push(FieldError::invalid(
                np.clone(),
                "should have only one network type",
            )),
            (false, Some(m)) if m.network_name.is_empty() => e.push(FieldError::required(
                format!("{np}.multus.networkName"),
                "CNI delegating plugin must have a networkName",
            )),
            _ => {}
        }
        if n.pod.is_some() {
            if pod_seen {
                e.push(FieldError::duplicate(
                    format!("{np}.pod"),
                    "more than one pod network is listed",
                ));
            }
            pod_seen = true;
        }
        if !n.name.is_empty() && !interfaces.iter().any(|iface| iface.name == n.name) {
            e.push(FieldError::invalid(
                format!("{np}.name"),
                format!("{np}.name '{}' not found.", n.name),
            ));
        }
    }
    let mut iface_names = HashSet::new();
    let mut macs = HashSet::new();
    for (i, iface) in interfaces.iter().enumerate() {
        let ip = format!("{p}.domain.devices.interfaces[{i}]");
        if iface.name.is_empty() {
            e.push(FieldError::required(
                format!("{ip}.name"),
                "interface name is required",
            ));
        } else if !iface_names.insert(iface.name.as_str()) {
            e.push(FieldError::duplicate(
                format!("{ip}.name"),
                format!("Duplicate value: \"{}\"", iface.name),
            ));
        }
        let network = net_names.get(iface.name.as_str());
        if network.is_none() && !iface.name.is_empty() {
            e.push(FieldError::invalid(
                format!("{ip}.name"),
                format!("{ip}.name '{}' not found.", iface.name),
            ));
        }
        let b = bindings(iface);
        if b.len() > 1 {
            e.push(FieldError::invalid(
                ip.clone(),
                format!("only one binding method may be set, found {}", b.join(", ")),
            ));
        }
        if iface.masquerade.is_some()
            && let Some(net) = network
            && net.pod.is_none()
        {
            e.push(FieldError::invalid(
                format!("{ip}.masquerade"),
                "Masquerade interface only implemented with pod network",
            ));
        }
        if let Some(mac) = &iface.mac_address {
            if !is_mac(mac) {
                e.push(FieldError::invalid(
                    format!("{ip}.macAddress"),
                    format!("\"{mac}\" is not a valid MAC address"),
                ));
            } else if !macs.insert(mac.replace('-', ":").to_lowercase()) {
                e.push(FieldError::duplicate(
                    format!("{ip}.macAddress"),
                    format!("Duplicate value: \"{mac}\" (MAC addresses must be unique)"),
                ));
            }
        }
        if let Some(model) = &iface.model
            && !INTERFACE_MODELS.contains(&model.as_str())
        {
            e.push(FieldError::not_supported(
                format!("{ip}.model"),
                format!(
                    "Unsupported value: \"{model}\": supported values: {}",
                    INTERFACE_MODELS.map(|m| format!("\"{m}\"")).join(", ")
                ),
            ));
        }
        for (j, port) in list(&iface.ports).iter().enumerate() {
            if !(1..=65535).contains(&port.port) {
                e.push(FieldError::invalid(
                    format!("{ip}.ports[{j}].port"),
                    "port must be between 1 and 65535",
                ));
            }
            if let Some(proto) = &port.protocol
                && !["TCP", "UDP"].contains(&proto.as_str())
            {
                e.push(FieldError::not_supported(
                    format!("{ip}.ports[{j}].protocol"),
                    "supported values: \"TCP\", \"UDP\"",
                ));
            }
        }
    }
}

fn validate_probe(p: &str, probe: &Probe, e: &mut Vec<FieldError>) {
    let handlers = [
        probe.exec.is_some(),
        probe.http_get.is_some(),
        probe.tcp_socket.is_some(),
        probe.guest_agent_ping.is_some(),
    ]
    .iter()
    .filter(|b| **b)
    .count();
    if handlers != 1 {
        e.push(FieldError::invalid(
            p.to_string(),
            "must have exactly one of exec, httpGet, tcpSocket or guestAgentPing",
        ));
    }
}

/// Fields of a VM template that an instancetype owns: setting them too is a conflict.
/// With `instancetype` given, optional fields it sets are checked as well.
pub fn instancetype_conflicts(
    p: &str,
    spec: &VirtualMachineInstanceSpec,
    instancetype: Option<&InstancetypeSpec>,
) -> Vec<FieldError> {
    let mut fields: Vec<String> = Vec::new();
    let d = &spec.domain;
    let dp = format!("{p}.domain");
    if let Some(cpu) = &d.cpu {
        for (k, set) in [
            ("sockets", cpu.sockets.is_some()),
            ("cores", cpu.cores.is_some()),
            ("threads", cpu.threads.is_some()),
        ] {
            if set {
                fields.push(format!("{dp}.cpu.{k}"));
            }
        }
        if let Some(it) = instancetype {
            for (k, mine, theirs) in [
                ("model", cpu.model.is_some(), it.cpu.model.is_some()),
                (
                    "dedicatedCpuPlacement",
                    cpu.dedicated_cpu_placement.is_some(),
                    it.cpu.dedicated_cpu_placement.is_some(),
                ),
                (
                    "isolateEmulatorThread",
                    cpu.isolate_emulator_thread.is_some(),
                    it.cpu.isolate_emulator_thread.is_some(),
                ),
                ("numa", cpu.numa.is_some(), it.cpu.numa.is_some()),
                (
                    "realtime",
                    cpu.realtime.is_some(),
                    it.cpu.realtime.is_some(),
                ),
                (
                    "maxSockets",
                    cpu.max_sockets.is_some(),
                    it.cpu.max_sockets.is_some(),
                ),
            ] {
                if mine && theirs {
                    fields.push(format!("{dp}.cpu.{k}"));
                }
            }
        }
    }
    if let Some(mem) = &d.memory {
        if mem.guest.is_some() {
            fields.push(format!("{dp}.memory.guest"));
        }
        if mem.hugepages.is_some() && instancetype.is_none_or(|it| it.memory.hugepages.is_some()) {
            fields.push(format!("{dp}.memory.hugepages"));
        }
        if mem.max_guest.is_some() && instancetype.is_none_or(|it| it.memory.max_guest.is_some()) {
            fields.push(format!("{dp}.memory.maxGuest"));
        }
    }
    if let Some(res) = &d.resources {
        for (section, map) in [("requests", &res.requests), ("limits", &res.limits)] {
            for k in ["cpu", "memory"] {
                if map.as_ref().is_some_and(|m| m.contains_key(k)) {
                    fields.push(format!("{dp}.resources.{section}.{k}"));
                }
            }
        }
    }
    if let Some(it) = instancetype {
        if it.io_threads_policy.is_some() && d.io_threads_policy.is_some() {
            fields.push(format!("{dp}.ioThreadsPolicy"));
        }
        if it.node_selector.is_some() && spec.node_selector.is_some() {
            fields.push(format!("{p}.nodeSelector"));
        }
        if it.scheduler_name.is_some() && spec.scheduler_name.is_some() {
            fields.push(format!("{p}.schedulerName"));
        }
    }
    fields
        .into_iter()
        .map(|f| {
            FieldError::invalid(
                f.clone(),
                format!("VM field {f} conflicts with selected instance type"),
            )
        })
        .collect()
}

/// `running` and `runStrategy` are mutually exclusive (checked on the raw object, before
/// `running` is translated).
pub(super) fn vm_run_strategy_conflict(obj: &Value) -> Vec<FieldError> {
    let spec = obj.get("spec");
    let set = |k: &str| spec.and_then(|s| s.get(k)).is_some_and(|v| !v.is_null());
    if set("running") && set("runStrategy") {
        vec![FieldError::invalid(
            "spec.running",
            "running and runStrategy are mutually exclusive; use runStrategy",
        )]
    } else {
        Vec::new()
    }
}

/// Validate a whole VirtualMachine (after defaulting).
pub(super) fn validate_vm(vm: &VirtualMachine) -> Vec<FieldError> {
    let mut e = Vec::new();
    let Some(spec) = &vm.spec else {
        e.push(FieldError::required("spec", "spec is required"));
        return e;
    };
    let tp = "spec.template.spec";
    match &spec.template.spec {
        Some(t) => {
            if spec.instancetype.is_some() {
                e.extend(instancetype_conflicts(tp, t, None));
            }
            e.extend(validate_vmi_spec(tp, t, SpecChecks::template()));
        }
        None => e.push(FieldError::required(tp, "template spec is required")),
    }
    for (field, name, kind, infer, kinds) in [
        (
            "instancetype",
            spec.instancetype.as_ref().map(|m| &m.name),
            spec.instancetype.as_ref().map(|m| &m.kind),
            spec.instancetype
                .as_ref()
                .is_some_and(|m| m.infer_from_volume.is_some()),
            [
                "VirtualMachineInstancetype",
                "VirtualMachineClusterInstancetype",
            ],
        ),
        (
            "preference",
            spec.preference.as_ref().map(|m| &m.name),
            spec.preference.as_ref().map(|m| &m.kind),
            spec.preference
                .as_ref()
                .is_some_and(|m| m.infer_from_volume.is_some()),
            [
                "VirtualMachinePreference",
                "VirtualMachineClusterPreference",
            ],
        ),
    ] {
        if let Some(name) = name
            && name.as_deref().unwrap_or("").is_empty()
            && !infer
        {
            e.push(FieldError::required(
                format!("spec.{field}.name"),
                "name or inferFromVolume is required",
            ));
        }
        if let Some(Some(k)) = kind
            && !kinds
                .iter()
                .any(|x| x.eq_ignore_ascii_case(k) || x.to_lowercase() + "s" == *k)
        {
            e.push(FieldError::not_supported(
                format!("spec.{field}.kind"),
                format!(
                    "Unsupported value: \"{k}\": supported values: \"{}\", \"{}\"",
                    kinds[0], kinds[1]
                ),
            ));
        }
    }
    let mut dv_names = HashSet::new();
    for (i, t) in list(&spec.data_volume_templates).iter().enumerate() {
        let tp = format!("spec.dataVolumeTemplates[{i}]");
        let name = t
            .metadata
            .as_ref()
            .and_then(|m| m.name.as_deref())
            .unwrap_or("");
        if name.is_empty() {
            e.push(FieldError::required(
                format!("{tp}.metadata.name"),
                "dataVolumeTemplate name is required",
            ));
        } else if !is_dns1123_subdomain(name) {
            e.push(FieldError::invalid(
                format!("{tp}.metadata.name"),
                format!("Invalid value: \"{name}\": must be a DNS-1123 subdomain"),
            ));
        } else if !dv_names.insert(name) {
            e.push(FieldError::duplicate(
                format!("{tp}.metadata.name"),
                format!("Duplicate value: \"{name}\""),
            ));
        }
        e.extend(super::datavolume::validate_dv_spec(
            &format!("{tp}.spec"),
            &t.spec,
        ));
    }
    e
}
