//! The pure translation of a VirtualMachineInstance spec into the launcher's `LaunchSpec`:
//! CPU topology and model, memory, firmware (BIOS or OVMF), SMBIOS UUID/serial, disks (from the
//! volumes the agent prepared), NICs, RNG, balloon, and the per-VMI socket paths. No I/O.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ferrovirt_api::kubevirt::devices::{Disk as ApiDisk, Interface};
use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_api::kubevirt::volumes::Network;
use ferrovirt_launcher::spec::{
    Accel, CacheMode, CpuModel, CpuSpec, Disk, DiskBus, DiskFormat, DiskSource, Firmware,
    HostForward, LaunchSpec, MAX_NIC_QUEUES, Nic, NicBackend, NicModel, SocketPaths,
};

use crate::error::AgentError;

/// A volume made ready on the host by [`crate::volumes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedVolume {
    pub path: PathBuf,
    pub format: DiskFormat,
    pub source: DiskSource,
    /// The volume itself is read-only (cloud-init, config maps, secrets).
    pub readonly: bool,
    /// The recorded backing chain of a qcow2 overlay (empty: none).
    pub backing: Vec<ferrovirt_launcher::spec::BackingImage>,
}

/// Where OVMF lives (Debian's `ovmf` package).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OvmfPaths {
    pub code: PathBuf,
    pub vars_template: PathBuf,
    pub secure_code: PathBuf,
    pub secure_vars_template: PathBuf,
}

impl Default for OvmfPaths {
    fn default() -> Self {
        OvmfPaths {
            code: "/usr/share/OVMF/OVMF_CODE_4M.fd".into(),
            vars_template: "/usr/share/OVMF/OVMF_VARS_4M.fd".into(),
            secure_code: "/usr/share/OVMF/OVMF_CODE_4M.ms.fd".into(),
            secure_vars_template: "/usr/share/OVMF/OVMF_VARS_4M.ms.fd".into(),
        }
    }
}

/// Node-side facts the translation needs.
#[derive(Debug, Clone)]
pub struct MappingContext {
    /// The VMI's private directory (sockets, generated images, NVRAM).
    pub vmi_dir: PathBuf,
    pub accel: Accel,
    /// Prepared volumes by volume name.
    pub volumes: BTreeMap<String, PreparedVolume>,
    pub tcg_tb_size_mib: Option<u32>,
    pub sandbox: bool,
    pub ovmf: OvmfPaths,
    /// Host ports to forward to the guest for masquerade interfaces (guest port → host port).
    pub port_forwards: BTreeMap<u16, u16>,
    /// Unprivileged user QEMU drops to (`-runas`).
    pub run_as: Option<String>,
    /// Put the VM in a memory cgroup named after this (the VMI uid), limited to its memory
    /// plus overhead.
    pub cgroup_name: Option<String>,
    /// pids.max of that cgroup.
    pub pids_max: Option<u64>,
    /// Bound of `serial.log` (rotated to `serial.log.1`).
    pub serial_log_max_bytes: Option<u64>,
    /// Taps the node's pod network prepared, by interface name: such a masquerade or bridge
    /// interface gets a tap backend instead of user-mode networking.
    pub pod_taps: BTreeMap<String, PodTap>,
    /// When the VM starts: the RTC base of a clock offset or time zone.
    pub now: jiff::Timestamp,
    /// The named CPU models this node's QEMU runs ([`crate::cpu_models`]).
    pub cpu_models: std::collections::BTreeSet<String>,
}

/// A tap prepared by `ferrovirt_network::pod::setup` for one interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodTap {
    pub ifname: String,
    /// The guest MAC the pod network's DHCP server answers.
    pub mac: String,
}

/// The VMI's interface on the pod network, as the node's pod network needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInterface {
    /// Interface (and network) name in the VMI spec.
    pub name: String,
    pub binding: ferrovirt_network::Binding,
    /// The guest NIC's MAC (`macAddress` or the derived one).
    pub mac: ferrovirt_network::MacAddr,
}

impl MappingContext {
    pub fn new(vmi_dir: impl Into<PathBuf>, accel: Accel) -> Self {
        MappingContext {
            vmi_dir: vmi_dir.into(),
            accel,
            volumes: BTreeMap::new(),
            tcg_tb_size_mib: None,
            sandbox: false,
            ovmf: OvmfPaths::default(),
            port_forwards: BTreeMap::new(),
            run_as: None,
            cgroup_name: None,
            pids_max: None,
            serial_log_max_bytes: None,
            pod_taps: BTreeMap::new(),
            now: jiff::Timestamp::now(),
            cpu_models: Default::default(),
        }
    }
}

/// The socket and file paths of one VMI directory.
pub fn socket_paths(vmi_dir: &Path) -> SocketPaths {
    SocketPaths {
        qmp: vmi_dir.join("qmp.sock"),
        serial: Some(vmi_dir.join("serial.sock")),
        serial_log: Some(vmi_dir.join("serial.log")),
        vnc: Some(vmi_dir.join("vnc.sock")),
        guest_agent: Some(vmi_dir.join("qga.sock")),
    }
}

/// Memory in MiB from `domain.memory.guest`, else `resources.requests.memory`, else limits.
pub fn guest_memory_mib(vmi: &VirtualMachineInstance) -> Result<u64, AgentError> {
    let domain = vmi.spec.as_ref().map(|s| &s.domain);
    let field = "spec.domain.memory.guest";
    let q = domain
        .and_then(|d| d.memory.as_ref())
        .and_then(|m| m.guest.as_ref())
        .map(|q| (field, q))
        .or_else(|| {
            let r = domain?.resources.as_ref()?;
            r.requests
                .as_ref()
                .and_then(|m| m.get("memory"))
                .map(|q| ("spec.domain.resources.requests.memory", q))
                .or_else(|| {
                    r.limits
                        .as_ref()
                        .and_then(|m| m.get("memory"))
                        .map(|q| ("spec.domain.resources.limits.memory", q))
                })
        });
    let Some((field, q)) = q else {
        return Err(AgentError::invalid(field, "no guest memory is set"));
    };
    let bytes = ferrovirt_api::quantity::bytes(&q.0)
        .map_err(|e| AgentError::invalid(field, e.to_string()))?;
    let mib = bytes >> 20;
    if !(1..=16 << 20).contains(&mib) {
        return Err(AgentError::invalid(
            field,
            format!("{} is out of range", q.0),
        ));
    }
    Ok(mib)
}

/// A stable, locally administered unicast MAC for an interface without `macAddress`.
pub fn derived_mac(namespace: &str, name: &str, iface: &str) -> String {
    // FNV-1a over the identity: stable across restarts and agents.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in namespace
        .bytes()
        .chain([0])
        .chain(name.bytes())
        .chain([0])
        .chain(iface.bytes())
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let b = h.to_be_bytes();
    format!(
        "02:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        b[0], b[1], b[2], b[3], b[4]
    )
}

fn parse_bus(bus: Option<&str>, field: &str, default: DiskBus) -> Result<DiskBus, AgentError> {
    match bus {
        None => Ok(default),
        Some("virtio") => Ok(DiskBus::Virtio),
        Some("sata") => Ok(DiskBus::Sata),
        Some("scsi") => Ok(DiskBus::Scsi),
        Some("usb") => Ok(DiskBus::Usb),
        Some(other) => Err(AgentError::invalid(
            field,
            format!("unsupported bus {other:?} (virtio, sata, scsi, usb)"),
        )),
    }
}

fn parse_cache(cache: Option<&str>, field: &str) -> Result<Option<CacheMode>, AgentError> {
    Ok(match cache {
        None => None,
        Some("none") => Some(CacheMode::None),
        Some("writethrough") => Some(CacheMode::Writethrough),
        Some("writeback") => Some(CacheMode::Writeback),
        Some(other) => {
            return Err(AgentError::invalid(
                field,
                format!("unsupported cache mode {other:?}"),
            ));
        }
    })
}

/// The launch-spec disk id of the VMI disk named `name`: `disk-` and the name with every
/// character QEMU does not allow in node names as `-` (a second disk with the same id gets
/// `-2`, … appended by [`launch_spec`]).
pub fn disk_id(name: &str) -> String {
    let base: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    format!("disk-{base}")
}

fn map_disk(
    i: usize,
    d: &ApiDisk,
    has_volume: bool,
    ctx: &MappingContext,
    used_ids: &mut BTreeMap<String, usize>,
) -> Result<Disk, AgentError> {
    let field = format!("spec.domain.devices.disks[{i}]");
    // A CD-ROM without a volume of its name (admission allows it for declarative hotplug) is
    // an empty drive: QEMU gets the device with no medium.
    let empty_cdrom = d.cdrom.is_some() && d.disk.is_none() && d.lun.is_none() && !has_volume;
    let no_medium = PreparedVolume {
        path: PathBuf::new(),
        format: DiskFormat::Raw,
        source: DiskSource::File,
        readonly: true,
        backing: Vec::new(),
    };
    let (vol, empty) = match ctx.volumes.get(&d.name) {
        Some(v) => (v, false),
        None if empty_cdrom => (&no_medium, true),
        None => {
            return Err(AgentError::invalid(
                format!("{field}.name"),
                format!("volume {:?} was not prepared", d.name),
            ));
        }
    };
    let (bus, readonly, cdrom) = if let Some(c) = &d.cdrom {
        (
            parse_bus(
                c.bus.as_deref(),
                &format!("{field}.cdrom.bus"),
                DiskBus::Sata,
            )?,
            c.readonly.unwrap_or(true),
            true,
        )
    } else if let Some(l) = &d.lun {
        (
            parse_bus(l.bus.as_deref(), &format!("{field}.lun.bus"), DiskBus::Scsi)?,
            l.readonly.unwrap_or(false),
            false,
        )
    } else {
        let t = d.disk.as_ref();
        (
            parse_bus(
                t.and_then(|t| t.bus.as_deref()),
                &format!("{field}.disk.bus"),
                DiskBus::Virtio,
            )?,
            t.and_then(|t| t.readonly).unwrap_or(false),
            false,
        )
    };
    let mut id = disk_id(&d.name);
    let n = used_ids.entry(id.clone()).or_insert(0);
    *n += 1;
    if *n > 1 {
        id = format!("{id}-{n}");
    }
    Ok(Disk {
        id,
        path: vol.path.clone(),
        format: vol.format,
        bus,
        readonly: readonly || vol.readonly,
        cdrom,
        empty,
        boot_order: d.boot_order,
        serial: d.serial.clone(),
        cache: parse_cache(d.cache.as_deref(), &format!("{field}.cache"))?,
        source: vol.source,
        backing: vol.backing.clone(),
    })
}

fn parse_mac(mac: &str, field: &str) -> Result<String, AgentError> {
    let parts: Vec<&str> = mac.split([':', '-']).collect();
    let ok = parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.chars().all(|c| c.is_ascii_hexdigit()));
    if !ok {
        return Err(AgentError::invalid(
            field,
            format!("{mac:?} is not a MAC address"),
        ));
    }
    Ok(parts.join(":").to_lowercase())
}

pub(crate) fn nic_mac(
    i: usize,
    iface: &Interface,
    vmi: &VirtualMachineInstance,
) -> Result<String, AgentError> {
    match &iface.mac_address {
        Some(m) => parse_mac(
            m,
            &format!("spec.domain.devices.interfaces[{i}].macAddress"),
        ),
        None => Ok(derived_mac(
            vmi.metadata.namespace.as_deref().unwrap_or("default"),
            vmi.metadata.name.as_deref().unwrap_or(""),
            &iface.name,
        )),
    }
}

/// The first interface on the pod network with a masquerade or bridge binding (KubeVirt allows
/// one pod network per VMI), with its ports and MAC; `None` when there is none.
pub fn pod_interface(vmi: &VirtualMachineInstance) -> Result<Option<PodInterface>, AgentError> {
    use ferrovirt_network::{Binding, Port, PortProtocol};
    let Some(spec) = vmi.spec.as_ref() else {
        return Ok(None);
    };
    let networks: &[Network] = spec.networks.as_deref().unwrap_or(&[]);
    for (i, iface) in spec.domain.devices.interfaces.iter().flatten().enumerate() {
        let on_pod = networks
            .iter()
            .any(|n| n.name == iface.name && n.pod.is_some());
        if !on_pod {
            continue;
        }
        let binding = if iface.masquerade.is_some() {
            let mut ports = Vec::new();
            for (j, p) in iface.ports.iter().flatten().enumerate() {
                let field = format!("spec.domain.devices.interfaces[{i}].ports[{j}]");
                let protocol = match p.protocol.as_deref().unwrap_or("TCP") {
                    x if x.eq_ignore_ascii_case("tcp") => PortProtocol::Tcp,
                    x if x.eq_ignore_ascii_case("udp") => PortProtocol::Udp,
                    other => {
                        return Err(AgentError::unsupported(
                            format!("{field}.protocol"),
                            format!("protocol {other:?} is not supported (TCP, UDP)"),
                        ));
                    }
                };
                let port = u16::try_from(p.port)
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| {
                        AgentError::invalid(format!("{field}.port"), "not a port number")
                    })?;
                ports.push(Port { protocol, port });
            }
            Binding::Masquerade { ports }
        } else if iface.bridge.is_some() || is_l2bridge(iface) {
            Binding::Bridge
        } else {
            continue;
        };
        let mac = nic_mac(i, iface, vmi)?;
        let mac = mac.parse().map_err(|_| {
            AgentError::invalid(
                format!("spec.domain.devices.interfaces[{i}].macAddress"),
                format!("{mac:?} is not a MAC address"),
            )
        })?;
        return Ok(Some(PodInterface {
            name: iface.name.clone(),
            binding,
            mac,
        }));
    }
    Ok(None)
}

/// KubeVirt's `l2bridge` network binding plugin (a Primary user-defined network's interface,
/// carried out as the bridge binding: `crate::udn`).
fn is_l2bridge(iface: &Interface) -> bool {
    iface
        .binding
        .as_ref()
        .is_some_and(|b| b.name == crate::udn::L2BRIDGE_BINDING)
}

/// Queue pairs of a VMI interface, as KubeVirt gives them: with
/// `spec.domain.devices.networkInterfaceMultiqueue: true` a virtio interface gets one per vCPU
/// (capped at [`MAX_NIC_QUEUES`]); other models, and the flag unset, get one.
pub fn nic_queues(vmi: &VirtualMachineInstance, iface: &str) -> u32 {
    let Some(spec) = vmi.spec.as_ref() else {
        return 1;
    };
    let multiqueue = spec.domain.devices.network_interface_multiqueue == Some(true);
    let virtio = spec
        .domain
        .devices
        .interfaces
        .iter()
        .flatten()
        .find(|i| i.name == iface)
        .is_some_and(|i| matches!(i.model.as_deref(), None | Some("virtio")));
    if !multiqueue || !virtio {
        return 1;
    }
    let vcpus = ferrovirt_api::expand::vcpus(spec);
    u32::try_from(vcpus.min(u64::from(MAX_NIC_QUEUES))).unwrap_or(1)
}

fn map_nic(
    i: usize,
    iface: &Interface,
    networks: &[Network],
    vmi: &VirtualMachineInstance,
    ctx: &MappingContext,
) -> Result<Nic, AgentError> {
    let field = format!("spec.domain.devices.interfaces[{i}]");
    let net = networks
        .iter()
        .find(|n| n.name == iface.name)
        .ok_or_else(|| {
            AgentError::invalid(
                format!("{field}.name"),
                format!("no network named {:?}", iface.name),
            )
        })?;
    let model = match iface.model.as_deref() {
        None | Some("virtio") => NicModel::VirtioNetPci,
        Some("e1000e") => NicModel::E1000e,
        Some("e1000") => NicModel::E1000,
        Some("rtl8139") => NicModel::Rtl8139,
        Some(other) => {
            return Err(AgentError::invalid(
                format!("{field}.model"),
                format!("unsupported interface model {other:?}"),
            ));
        }
    };
    // Taps the node prepared: the pod network (masquerade, bridge) or a Multus bridge network.
    let pod_tap = ctx.pod_taps.get(&iface.name).filter(|_| {
        (net.pod.is_some()
            && (iface.masquerade.is_some() || iface.bridge.is_some() || is_l2bridge(iface)))
            || (net.multus.is_some() && iface.bridge.is_some())
    });
    let backend = if let Some(t) = pod_tap {
        // The node's pod network: a tap in the VMI's network namespace.
        NicBackend::Tap {
            ifname: t.ifname.clone(),
            queues: nic_queues(vmi, &iface.name),
        }
    } else if net.pod.is_some() && (iface.masquerade.is_some() || iface.slirp.is_some()) {
        // Masquerade semantics on QEMU's user-mode stack: the guest gets 10.0.2.2/24 with
        // gateway 10.0.2.1 by DHCP and reaches out through NAT; listed ports (or all forwarded
        // ports the agent chose) are forwarded from the host.
        let wanted: Vec<u16> = iface
            .ports
            .iter()
            .flatten()
            .filter(|p| {
                p.protocol
                    .as_deref()
                    .unwrap_or("TCP")
                    .eq_ignore_ascii_case("tcp")
            })
            .filter_map(|p| u16::try_from(p.port).ok())
            .collect();
        let forwards = ctx
            .port_forwards
            .iter()
            .filter(|(guest, _)| wanted.is_empty() || wanted.contains(guest))
            .map(|(guest, host)| HostForward {
                protocol: Default::default(),
                host_addr: "127.0.0.1".into(),
                host_port: *host,
                guest_port: *guest,
            })
            .collect();
        NicBackend::User { forwards }
    } else if net.pod.is_some() && iface.bridge.is_some() {
        return Err(AgentError::unsupported(
            format!("{field}.bridge"),
            "bridge binding on the pod network needs the node's pod network, which this \
             node does not provide yet; use masquerade",
        ));
    } else if net.multus.is_some() {
        return Err(AgentError::unsupported(
            format!(
                "spec.networks[{}].multus",
                networks
                    .iter()
                    .position(|n| n.name == net.name)
                    .unwrap_or(0)
            ),
            "secondary (multus) networks need the node's pod network (--pod-network) and the \
             bridge binding",
        ));
    } else {
        return Err(AgentError::unsupported(
            field,
            "only masquerade interfaces on the pod network are supported on this node",
        ));
    };
    let mac = match pod_tap {
        Some(t) => t.mac.clone(),
        None => nic_mac(i, iface, vmi)?,
    };
    Ok(Nic {
        id: format!("net{i}"),
        mac: Some(mac),
        model,
        backend,
        boot_order: iface.boot_order,
    })
}

/// Translates `vmi` into the launcher's spec. Every refusal names the VMI field at fault.
pub fn launch_spec(
    vmi: &VirtualMachineInstance,
    ctx: &MappingContext,
) -> Result<LaunchSpec, AgentError> {
    let spec = vmi
        .spec
        .as_ref()
        .ok_or_else(|| AgentError::invalid("spec", "a VMI needs a spec"))?;
    let domain = &spec.domain;
    let namespace = vmi.metadata.namespace.as_deref().unwrap_or("default");
    let name = vmi.metadata.name.as_deref().unwrap_or("vmi");

    let uuid = domain
        .firmware
        .as_ref()
        .and_then(|f| f.uuid.clone())
        .or_else(|| vmi.metadata.uid.clone())
        .ok_or_else(|| AgentError::invalid("spec.domain.firmware.uuid", "no UUID"))?;
    let mut ls = LaunchSpec::new(
        format!("{namespace}_{name}"),
        uuid,
        guest_memory_mib(vmi)?,
        ctx.vmi_dir.join("qmp.sock"),
    );
    ls.sockets = socket_paths(&ctx.vmi_dir);
    let devices = &domain.devices;
    if devices.autoattach_serial_console == Some(false) {
        ls.sockets.serial = None;
        ls.sockets.serial_log = None;
    }
    if devices.autoattach_graphics_device == Some(false) {
        ls.sockets.vnc = None;
    }
    ls.smbios.serial = domain.firmware.as_ref().and_then(|f| f.serial.clone());
    ls.smbios.product = Some("VirtualMachineInstance".into());
    ls.smbios.family = Some("ferrovirt".into());

    // CPU topology and model.
    let cpu = domain.cpu.as_ref();
    ls.cpu = CpuSpec {
        sockets: cpu.and_then(|c| c.sockets).unwrap_or(1).max(1),
        cores: cpu.and_then(|c| c.cores).unwrap_or(1).max(1),
        threads: cpu.and_then(|c| c.threads).unwrap_or(1).max(1),
        model: CpuModel::Max,
    };
    let (model, enforce) = crate::cpu_models::launch_model(
        ctx.accel,
        cpu.and_then(|c| c.model.as_deref()),
        &ctx.cpu_models,
    )?;
    ls.cpu.model = model;
    let (platform, video) = crate::platform::map(spec, ctx.accel, ctx.now)?;
    ls.platform = platform;
    ls.platform.cpu_enforce |= enforce;
    ls.video = video;
    if ls.cpu.vcpus() > 512 {
        return Err(AgentError::invalid(
            "spec.domain.cpu",
            format!("{} vCPUs is more than this node supports", ls.cpu.vcpus()),
        ));
    }
    if let Some(m) = domain.machine.as_ref().and_then(|m| m.type_.as_deref()) {
        let q35 = m == "q35" || m.starts_with("pc-q35");
        if !q35 {
            return Err(AgentError::unsupported(
                "spec.domain.machine.type",
                format!("machine type {m:?} is not supported (q35)"),
            ));
        }
        ls.machine = "q35".into();
    }

    // Firmware.
    if let Some(efi) = domain
        .firmware
        .as_ref()
        .and_then(|f| f.bootloader.as_ref())
        .and_then(|b| b.efi.as_ref())
    {
        let secure = efi.secure_boot.unwrap_or(true);
        ls.firmware = Firmware::Efi {
            secure_boot: secure,
            code_path: if secure {
                ctx.ovmf.secure_code.clone()
            } else {
                ctx.ovmf.code.clone()
            },
            vars_path: ctx.vmi_dir.join("OVMF_VARS.fd"),
        };
    }
    if domain
        .firmware
        .as_ref()
        .and_then(|f| f.kernel_boot.as_ref())
        .is_some_and(|k| k.container.is_some())
    {
        return Err(AgentError::unsupported(
            "spec.domain.firmware.kernelBoot.container",
            "kernel boot from a container image is not supported yet",
        ));
    }

    // Disks.
    let mut used_ids = BTreeMap::new();
    let volume_names: std::collections::BTreeSet<&str> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    for (i, d) in devices.disks.iter().flatten().enumerate() {
        let has_volume = volume_names.contains(d.name.as_str());
        ls.disks
            .push(map_disk(i, d, has_volume, ctx, &mut used_ids)?);
    }

    // NICs.
    let networks: &[Network] = spec.networks.as_deref().unwrap_or(&[]);
    for (i, iface) in devices.interfaces.iter().flatten().enumerate() {
        ls.nics.push(map_nic(i, iface, networks, vmi, ctx)?);
    }

    ls.rng = devices.rng.is_some();
    ls.balloon = devices.autoattach_mem_balloon != Some(false);
    ls.accel = ctx.accel;
    ls.tcg_tb_size_mib = ctx.tcg_tb_size_mib;
    ls.sandbox = ctx.sandbox;
    ls.start_paused = spec.start_strategy.as_deref() == Some("Paused");
    ls.run_as = ctx.run_as.clone();
    if let Some(name) = &ctx.cgroup_name {
        ls.cgroup = Some(ferrovirt_launcher::cgroup::CgroupSpec {
            name: name.clone(),
            memory_limit_bytes: ferrovirt_launcher::cgroup::memory_limit_bytes(&ls),
            pids_max: ctx.pids_max,
            // The vCPUs plus one CPU for QEMU's own threads (I/O, TCG helpers).
            cpu_millis: Some((u64::from(ls.cpu.vcpus()) + 1) * 1000),
        });
    }
    ls.serial_log_max_bytes = ctx.serial_log_max_bytes;
    Ok(ls)
}

#[cfg(test)]
#[path = "mapping_tests.rs"]
mod tests;
