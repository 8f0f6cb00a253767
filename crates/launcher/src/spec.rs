//! `LaunchSpec`: a plain, serde-friendly description of one VM as QEMU needs it.
//!
//! It carries no Kubernetes types; the agent maps a VMI onto it. `cmdline::qemu_command` turns a
//! validated spec into an argv; [`LaunchSpec::validate`] rejects combinations QEMU cannot run.

use std::collections::HashSet;
use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Everything needed to start one VM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LaunchSpec {
    /// VM name (QEMU `-name guest=…`); also the default SMBIOS product is left to QEMU.
    pub name: String,
    /// SMBIOS system UUID (also `-uuid`), e.g. `5f0e6f4c-…`.
    pub uuid: String,
    #[serde(default)]
    pub smbios: Smbios,
    #[serde(default)]
    pub cpu: CpuSpec,
    /// Guest memory in MiB.
    pub memory_mib: u64,
    /// QEMU machine type; `q35` by default.
    #[serde(default = "default_machine")]
    pub machine: String,
    #[serde(default)]
    pub firmware: Firmware,
    /// Direct kernel boot; when set, QEMU loads the kernel itself instead of booting a disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_boot: Option<KernelBoot>,
    #[serde(default)]
    pub disks: Vec<Disk>,
    #[serde(default)]
    pub nics: Vec<Nic>,
    /// Attach a virtio-rng device fed from the host's /dev/urandom.
    #[serde(default)]
    pub rng: bool,
    /// Attach a virtio memory balloon.
    #[serde(default)]
    pub balloon: bool,
    /// Host-side unix sockets QEMU listens on.
    pub sockets: SocketPaths,
    /// Video device to attach when a VNC socket is configured.
    #[serde(default)]
    pub video: VideoModel,
    #[serde(default)]
    pub accel: Accel,
    /// TCG translation-cache size in MiB (`-accel tcg,tb-size=N`); ignored under KVM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcg_tb_size_mib: Option<u32>,
    /// Enable QEMU's seccomp sandbox (`-sandbox on,…`).
    #[serde(default)]
    pub sandbox: bool,
    /// Start with the vCPUs stopped (`-S`); `cont` over QMP starts the guest.
    #[serde(default)]
    pub start_paused: bool,
    /// Drop QEMU's root privileges to this user once it has opened its files (`-runas`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_as: Option<String>,
    /// Put the launcher and QEMU in a memory cgroup of this name and limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<crate::cgroup::CgroupSpec>,
    /// Bound of the serial log file (`sockets.serialLog`): when it would grow past this, it is
    /// rotated to `<name>.1` (replacing an older one). Unset: [`DEFAULT_SERIAL_LOG_MAX`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial_log_max_bytes: Option<u64>,
    /// Live-migration target: QEMU waits for the incoming migration stream (`-incoming
    /// defer`) instead of booting the guest; `migrate-incoming` on the connection the agent
    /// hands over starts it ([`crate::migrate::start_incoming`]) and the guest runs once the
    /// stream is complete.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub incoming: bool,
    /// Features, clock, reboot policy, chassis, CPU flags, watchdog, panic, tablets, sound.
    #[serde(default)]
    pub platform: crate::platform::Platform,
    /// Host devices passed through ([`crate::hostdev`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_devices: Vec<crate::hostdev::HostDevice>,
    /// Extra arguments appended verbatim at the end (tests, debugging).
    #[serde(default)]
    pub extra_args: Vec<String>,
}

/// The serial log bound when a spec gives none.
pub const DEFAULT_SERIAL_LOG_MAX: u64 = 4 << 20;

fn default_machine() -> String {
    "q35".to_string()
}

/// SMBIOS type 1 (system information) strings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Smbios {
    #[serde(default = "default_manufacturer")]
    pub manufacturer: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sku: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub family: Option<String>,
}

fn default_manufacturer() -> String {
    "ferrovirt".to_string()
}

impl Default for Smbios {
    fn default() -> Self {
        Smbios {
            manufacturer: default_manufacturer(),
            product: None,
            version: None,
            serial: None,
            sku: None,
            family: None,
        }
    }
}

/// vCPU topology and model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CpuSpec {
    pub sockets: u32,
    pub cores: u32,
    pub threads: u32,
    #[serde(default)]
    pub model: CpuModel,
}

impl CpuSpec {
    /// Total number of vCPUs.
    pub fn vcpus(&self) -> u32 {
        self.sockets * self.cores * self.threads
    }
}

impl Default for CpuSpec {
    fn default() -> Self {
        CpuSpec {
            sockets: 1,
            cores: 1,
            threads: 1,
            model: CpuModel::default(),
        }
    }
}

/// CPU model: `max` (everything the accelerator offers), `host` (KVM passthrough) or a named
/// QEMU model such as `Skylake-Client`. Serialized as a plain string.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum CpuModel {
    #[default]
    Max,
    Host,
    Named(String),
}

impl From<String> for CpuModel {
    fn from(s: String) -> Self {
        match s.as_str() {
            "max" => CpuModel::Max,
            "host" | "host-passthrough" => CpuModel::Host,
            _ => CpuModel::Named(s),
        }
    }
}

impl From<CpuModel> for String {
    fn from(m: CpuModel) -> Self {
        m.to_string()
    }
}

impl fmt::Display for CpuModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CpuModel::Max => f.write_str("max"),
            CpuModel::Host => f.write_str("host"),
            CpuModel::Named(n) => f.write_str(n),
        }
    }
}

/// Guest firmware.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "type")]
pub enum Firmware {
    /// SeaBIOS (QEMU's built-in default).
    #[default]
    Bios,
    /// OVMF from two pflash images: read-only code and a per-VM writable vars copy.
    #[serde(rename_all = "camelCase")]
    Efi {
        #[serde(default)]
        secure_boot: bool,
        code_path: PathBuf,
        vars_path: PathBuf,
    },
}

/// Direct kernel boot (`-kernel`, `-initrd`, `-append`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KernelBoot {
    pub kernel: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
}

/// One disk or CD-ROM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Disk {
    /// Unique id; QEMU device id and the base of its block node names. `[A-Za-z][A-Za-z0-9_-]*`.
    pub id: String,
    pub path: PathBuf,
    #[serde(default)]
    pub format: DiskFormat,
    #[serde(default)]
    pub bus: DiskBus,
    #[serde(default)]
    pub readonly: bool,
    /// Present the disk as a CD-ROM (implies read-only; not possible on the virtio bus).
    #[serde(default)]
    pub cdrom: bool,
    /// A CD-ROM drive with no medium (`path` empty, no backing chain): the guest sees the
    /// drive, a volume can be inserted later. Only with `cdrom`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub empty: bool,
    /// Boot priority (lower boots first); `bootindex` on the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_order: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// Host cache mode; QEMU's default (writeback) when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheMode>,
    /// Whether `path` is a regular file or a block device.
    #[serde(default)]
    pub source: DiskSource,
    /// The backing chain of a qcow2 disk as the agent recorded it, nearest first. Empty: the
    /// disk has no backing file. Either way QEMU is told explicitly (`backing` is a node name
    /// or `null`), so a backing file named inside an image header is never opened.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backing: Vec<BackingImage>,
}

/// One read-only image in a disk's backing chain, with its recorded format.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackingImage {
    pub path: PathBuf,
    pub format: DiskFormat,
    #[serde(default)]
    pub source: DiskSource,
}

/// The first position in `d`'s chain (0 = the disk itself) where a raw image would have a
/// backing image after it.
fn chain_break(d: &Disk) -> Option<usize> {
    let formats = std::iter::once(d.format).chain(d.backing.iter().map(|b| b.format));
    let n = d.backing.len();
    formats
        .enumerate()
        .find(|(i, f)| *f == DiskFormat::Raw && *i < n)
        .map(|(i, _)| i)
}

impl Disk {
    /// True when the guest must not write to this disk.
    pub fn is_readonly(&self) -> bool {
        self.readonly || self.cdrom
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskFormat {
    #[default]
    Raw,
    Qcow2,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskBus {
    #[default]
    Virtio,
    Sata,
    Scsi,
    Usb,
}

/// Host page-cache policy, with libvirt's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheMode {
    /// O_DIRECT, guest write cache on.
    None,
    Writethrough,
    Writeback,
    /// O_DIRECT and guest write cache off.
    Directsync,
    /// Flushes are ignored.
    Unsafe,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskSource {
    #[default]
    File,
    Block,
}

/// One network interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Nic {
    /// Unique id (`[A-Za-z][A-Za-z0-9_-]*`); QEMU device id, netdev is `net-<id>`.
    pub id: String,
    /// `52:54:00:…`; QEMU picks one when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    #[serde(default)]
    pub model: NicModel,
    #[serde(default)]
    pub backend: NicBackend,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_order: Option<u32>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NicModel {
    #[default]
    VirtioNetPci,
    E1000e,
    E1000,
    Rtl8139,
}

impl NicModel {
    /// The QEMU device name.
    pub fn qemu_device(self) -> &'static str {
        match self {
            NicModel::VirtioNetPci => "virtio-net-pci",
            NicModel::E1000e => "e1000e",
            NicModel::E1000 => "e1000",
            NicModel::Rtl8139 => "rtl8139",
        }
    }
}

/// Where a NIC's traffic goes on the host side.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "type")]
pub enum NicBackend {
    /// QEMU user-mode networking (slirp) with optional host port forwards.
    #[serde(rename_all = "camelCase")]
    User {
        #[serde(default)]
        forwards: Vec<HostForward>,
    },
    /// An existing tap device prepared by the agent.
    #[serde(rename_all = "camelCase")]
    Tap {
        ifname: String,
        /// Queue pairs (KubeVirt `networkInterfaceMultiqueue`): more than 1 needs a tap
        /// created `multi_queue` and a virtio-net model; QEMU gets `queues=N` and `mq=on`.
        #[serde(default = "one_queue", skip_serializing_if = "is_one_queue")]
        queues: u32,
    },
    /// A NIC with no host connection.
    #[default]
    None,
}

/// A `hostfwd` rule of user-mode networking.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HostForward {
    #[serde(default)]
    pub protocol: ForwardProtocol,
    /// Host address to bind; loopback by default.
    #[serde(default = "default_forward_addr")]
    pub host_addr: String,
    pub host_port: u16,
    pub guest_port: u16,
}

fn one_queue() -> u32 {
    1
}

fn is_one_queue(q: &u32) -> bool {
    *q == 1
}

/// The most queue pairs a NIC may have (KubeVirt's cap, `multiQueueMaxQueues`).
pub const MAX_NIC_QUEUES: u32 = 256;

fn default_forward_addr() -> String {
    "127.0.0.1".to_string()
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ForwardProtocol {
    #[default]
    Tcp,
    Udp,
}

/// Unix socket paths QEMU listens on. Only QMP is mandatory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SocketPaths {
    pub qmp: PathBuf,
    /// Serial console (ttyS0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<PathBuf>,
    /// Copy of everything the guest writes to ttyS0 (kept even when no client is attached).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial_log: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vnc: Option<PathBuf>,
    /// Guest agent channel (virtio-serial port `org.qemu.guest_agent.0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_agent: Option<PathBuf>,
}

impl SocketPaths {
    /// All socket paths QEMU will create (not the serial log file).
    pub fn all(&self) -> Vec<&PathBuf> {
        let mut v = vec![&self.qmp];
        v.extend(self.serial.iter());
        v.extend(self.vnc.iter());
        v.extend(self.guest_agent.iter());
        v
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VideoModel {
    #[default]
    Vga,
    Bochs,
    VirtioGpu,
}

impl VideoModel {
    /// The QEMU device name.
    pub fn qemu_device(self) -> &'static str {
        match self {
            VideoModel::Vga => "VGA",
            VideoModel::Bochs => "bochs-display",
            VideoModel::VirtioGpu => "virtio-gpu-pci",
        }
    }
}

/// Hardware acceleration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    /// Software emulation; always works, slowly.
    #[default]
    Tcg,
}

impl fmt::Display for Accel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        })
    }
}

/// Maximum number of SATA disks: q35's built-in AHCI controller has six ports.
pub const MAX_SATA_DISKS: usize = 6;

impl LaunchSpec {
    /// A minimal spec: 1 vCPU, q35, BIOS, TCG, the given QMP socket; everything else off.
    pub fn new(
        name: impl Into<String>,
        uuid: impl Into<String>,
        memory_mib: u64,
        qmp: PathBuf,
    ) -> Self {
        LaunchSpec {
            name: name.into(),
            uuid: uuid.into(),
            smbios: Smbios::default(),
            cpu: CpuSpec::default(),
            memory_mib,
            machine: default_machine(),
            firmware: Firmware::Bios,
            kernel_boot: None,
            disks: Vec::new(),
            nics: Vec::new(),
            rng: false,
            balloon: false,
            sockets: SocketPaths {
                qmp,
                serial: None,
                serial_log: None,
                vnc: None,
                guest_agent: None,
            },
            video: VideoModel::default(),
            accel: Accel::default(),
            tcg_tb_size_mib: None,
            sandbox: false,
            start_paused: false,
            run_as: None,
            cgroup: None,
            serial_log_max_bytes: None,
            incoming: false,
            platform: crate::platform::Platform::default(),
            host_devices: Vec::new(),
            extra_args: Vec::new(),
        }
    }

    /// Rejects specs QEMU cannot run or that `qemu_command` cannot express safely.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::InvalidSpec(msg));
        if self.name.is_empty() {
            return bad("name is empty".into());
        }
        if !is_uuid(&self.uuid) {
            return bad(format!("uuid {:?} is not a UUID", self.uuid));
        }
        if self.memory_mib == 0 {
            return bad("memory must be positive".into());
        }
        if self.cpu.sockets == 0 || self.cpu.cores == 0 || self.cpu.threads == 0 {
            return bad("cpu sockets, cores and threads must be positive".into());
        }
        if self.machine.is_empty() || self.machine.contains(',') {
            return bad(format!("invalid machine type {:?}", self.machine));
        }
        if let CpuModel::Named(n) = &self.cpu.model
            && (n.is_empty() || n.contains(','))
        {
            return bad(format!("invalid CPU model {n:?}"));
        }
        crate::hostdev::validate(&self.host_devices).map_err(Error::InvalidSpec)?;
        let mut ids = HashSet::new();
        let mut boot = HashSet::new();
        let mut sata = 0usize;
        for d in &self.disks {
            check_id("disk", &d.id)?;
            if !ids.insert(d.id.as_str()) {
                return bad(format!("duplicate device id {:?}", d.id));
            }
            if d.empty && (!d.cdrom || !d.path.as_os_str().is_empty() || !d.backing.is_empty()) {
                return bad(format!(
                    "disk {:?}: only a CD-ROM can be empty, and an empty drive has no image",
                    d.id
                ));
            }
            if d.empty && !matches!(d.bus, DiskBus::Sata | DiskBus::Scsi) {
                // usb-storage has no removable-medium drive without an image.
                return bad(format!(
                    "disk {:?}: an empty CD-ROM needs the sata or scsi bus",
                    d.id
                ));
            }
            if d.cdrom && d.bus == DiskBus::Virtio {
                return bad(format!(
                    "disk {:?}: a CD-ROM cannot use the virtio bus",
                    d.id
                ));
            }
            if d.bus == DiskBus::Sata {
                sata += 1;
                if d.readonly && !d.cdrom {
                    // QEMU's ide-hd refuses read-only nodes (libvirt rejects this as well).
                    return bad(format!("disk {:?}: a SATA disk cannot be read-only", d.id));
                }
            }
            if let Some(i) = chain_break(d) {
                return bad(format!(
                    "disk {:?}: a raw image cannot have a backing file (backing chain entry {i})",
                    d.id
                ));
            }
            if let Some(o) = d.boot_order
                && !boot.insert(o)
            {
                return bad(format!("boot order {o} used twice"));
            }
        }
        if sata > MAX_SATA_DISKS {
            return bad(format!("at most {MAX_SATA_DISKS} SATA disks, got {sata}"));
        }
        for n in &self.nics {
            check_id("nic", &n.id)?;
            if !ids.insert(n.id.as_str()) {
                return bad(format!("duplicate device id {:?}", n.id));
            }
            if let Some(mac) = &n.mac
                && !is_mac(mac)
            {
                return bad(format!("nic {:?}: invalid MAC {mac:?}", n.id));
            }
            if let Some(o) = n.boot_order
                && !boot.insert(o)
            {
                return bad(format!("boot order {o} used twice"));
            }
            match &n.backend {
                NicBackend::Tap { ifname, .. } if ifname.is_empty() || ifname.contains(',') => {
                    return bad(format!("nic {:?}: invalid tap name {ifname:?}", n.id));
                }
                NicBackend::Tap { queues, .. } if *queues == 0 || *queues > MAX_NIC_QUEUES => {
                    return bad(format!(
                        "nic {:?}: {queues} queues (1 to {MAX_NIC_QUEUES})",
                        n.id
                    ));
                }
                NicBackend::Tap { queues, .. }
                    if *queues > 1 && n.model != NicModel::VirtioNetPci =>
                {
                    return bad(format!(
                        "nic {:?}: multiple queues need the virtio model",
                        n.id
                    ));
                }
                NicBackend::User { forwards }
                    if forwards
                        .iter()
                        .any(|f| !f.host_addr.is_empty() && !is_ipv4(&f.host_addr)) =>
                {
                    return bad(format!("nic {:?}: invalid forward address", n.id));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

fn check_id(kind: &str, id: &str) -> Result<()> {
    let mut chars = id.chars();
    let ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        && id.len() <= 30;
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidSpec(format!(
            "{kind} id {id:?} must match [A-Za-z][A-Za-z0-9_-]* (at most 30 characters)"
        )))
    }
}

fn is_uuid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.chars().all(|c| c.is_ascii_hexdigit()))
}

fn is_mac(s: &str) -> bool {
    let parts: Vec<&str> = s.split(':').collect();
    parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.chars().all(|c| c.is_ascii_hexdigit()))
}

fn is_ipv4(s: &str) -> bool {
    s.parse::<std::net::Ipv4Addr>().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> LaunchSpec {
        LaunchSpec::new(
            "vm1",
            "12345678-9abc-def0-1234-56789abcdef0",
            128,
            "/run/vm1/qmp.sock".into(),
        )
    }

    fn disk(id: &str) -> Disk {
        Disk {
            id: id.into(),
            path: "/img/a.raw".into(),
            format: DiskFormat::Raw,
            bus: DiskBus::Virtio,
            readonly: false,
            cdrom: false,
            empty: false,
            boot_order: None,
            serial: None,
            cache: None,
            source: DiskSource::File,
            backing: Vec::new(),
        }
    }

    #[test]
    fn minimal_spec_is_valid_and_defaults_apply() {
        let s = spec();
        s.validate().unwrap();
        assert_eq!(s.machine, "q35");
        assert_eq!(s.smbios.manufacturer, "ferrovirt");
        assert_eq!(s.accel, Accel::Tcg);
        assert_eq!(s.cpu.vcpus(), 1);
    }

    #[test]
    fn raw_images_cannot_have_a_backing_chain() {
        let mut s = spec();
        let mut d = disk("root");
        d.format = DiskFormat::Qcow2;
        let img = |format| BackingImage {
            path: "/b".into(),
            format,
            source: DiskSource::File,
        };
        d.backing = vec![img(DiskFormat::Qcow2), img(DiskFormat::Raw)];
        s.disks = vec![d.clone()];
        s.validate().unwrap();
        d.backing = vec![img(DiskFormat::Raw), img(DiskFormat::Raw)];
        s.disks = vec![d.clone()];
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("backing chain entry 1"), "{e}");
        d.format = DiskFormat::Raw;
        d.backing = vec![img(DiskFormat::Raw)];
        s.disks = vec![d];
        assert!(s.validate().is_err());
    }

    #[test]
    fn deserializes_from_sparse_json_with_defaults() {
        let s: LaunchSpec = serde_json::from_value(serde_json::json!({
            "name": "vm",
            "uuid": "12345678-9abc-def0-1234-56789abcdef0",
            "memoryMib": 256,
            "cpu": {"sockets": 1, "cores": 2, "threads": 1, "model": "Skylake-Client"},
            "firmware": {"type": "efi", "secureBoot": true,
                         "codePath": "/c.fd", "varsPath": "/v.fd"},
            "disks": [{"id": "root", "path": "/r.qcow2", "format": "qcow2", "bootOrder": 1}],
            "nics": [{"id": "net0", "backend": {"type": "user",
                      "forwards": [{"hostPort": 2222, "guestPort": 22}]}}],
            "sockets": {"qmp": "/q.sock"}
        }))
        .unwrap();
        assert_eq!(s.machine, "q35");
        assert_eq!(s.smbios.manufacturer, "ferrovirt");
        assert_eq!(s.cpu.model, CpuModel::Named("Skylake-Client".into()));
        assert_eq!(s.cpu.vcpus(), 2);
        assert!(matches!(
            s.firmware,
            Firmware::Efi {
                secure_boot: true,
                ..
            }
        ));
        assert_eq!(s.disks[0].bus, DiskBus::Virtio);
        let NicBackend::User { forwards } = &s.nics[0].backend else {
            panic!("user backend expected")
        };
        assert_eq!(forwards[0].host_addr, "127.0.0.1");
        assert_eq!(forwards[0].protocol, ForwardProtocol::Tcp);
        assert_eq!(s.nics[0].model, NicModel::VirtioNetPci);
        s.validate().unwrap();
    }

    #[test]
    fn json_roundtrip_is_lossless() {
        let mut s = spec();
        s.cpu.model = CpuModel::Host;
        s.disks.push(disk("root"));
        s.kernel_boot = Some(KernelBoot {
            kernel: "/k".into(),
            initrd: None,
            cmdline: Some("console=ttyS0".into()),
        });
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["cpu"]["model"], "host");
        let back: LaunchSpec = serde_json::from_value(v).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn cpu_model_strings() {
        assert_eq!(CpuModel::from("max".to_string()), CpuModel::Max);
        assert_eq!(
            CpuModel::from("host-passthrough".to_string()),
            CpuModel::Host
        );
        assert_eq!(CpuModel::Named("EPYC".into()).to_string(), "EPYC");
    }

    #[test]
    fn rejects_bad_uuid_and_zero_sizes() {
        let mut s = spec();
        s.uuid = "not-a-uuid".into();
        assert!(s.validate().is_err());
        let mut s = spec();
        s.memory_mib = 0;
        assert!(s.validate().is_err());
        let mut s = spec();
        s.cpu.cores = 0;
        assert!(s.validate().is_err());
    }

    #[test]
    fn rejects_virtio_cdrom_duplicate_ids_and_boot_orders() {
        let mut s = spec();
        let mut d = disk("cd");
        d.cdrom = true;
        s.disks.push(d);
        assert!(s.validate().unwrap_err().to_string().contains("CD-ROM"));

        let mut s = spec();
        s.disks.push(disk("a"));
        s.disks.push(disk("a"));
        assert!(s.validate().unwrap_err().to_string().contains("duplicate"));

        let mut s = spec();
        let mut a = disk("a");
        a.boot_order = Some(1);
        let mut b = disk("b");
        b.boot_order = Some(1);
        s.disks.extend([a, b]);
        assert!(s.validate().unwrap_err().to_string().contains("boot order"));
    }

    #[test]
    fn rejects_ids_that_would_break_the_command_line() {
        let mut s = spec();
        s.disks.push(disk("a,b"));
        assert!(s.validate().is_err());
        let mut s = spec();
        s.disks.push(disk("1abc"));
        assert!(s.validate().is_err());
    }

    #[test]
    fn rejects_too_many_sata_disks_and_bad_macs() {
        let mut s = spec();
        for i in 0..7 {
            let mut d = disk(&format!("d{i}"));
            d.bus = DiskBus::Sata;
            s.disks.push(d);
        }
        assert!(s.validate().is_err());

        let mut s = spec();
        s.nics.push(Nic {
            id: "n".into(),
            mac: Some("52:54:00:zz:00:01".into()),
            model: NicModel::VirtioNetPci,
            backend: NicBackend::None,
            boot_order: None,
        });
        assert!(s.validate().is_err());
    }

    #[test]
    fn rejects_readonly_sata_disks_but_not_sata_cdroms() {
        let mut s = spec();
        let mut d = disk("ro");
        d.bus = DiskBus::Sata;
        d.readonly = true;
        s.disks.push(d.clone());
        assert!(s.validate().unwrap_err().to_string().contains("read-only"));
        s.disks[0].cdrom = true;
        s.validate().unwrap();
    }

    #[test]
    fn an_empty_drive_is_a_cdrom_without_an_image() {
        let mut s = spec();
        let mut d = disk("cd");
        d.path = "".into();
        d.cdrom = true;
        d.empty = true;
        d.bus = DiskBus::Scsi;
        s.disks.push(d.clone());
        s.validate().unwrap();
        assert!(s.disks[0].is_readonly());
        // The field is left out of spec.json when false, and round-trips when true.
        let json = serde_json::to_value(&s.disks[0]).unwrap();
        assert_eq!(json["empty"], true);
        assert!(
            serde_json::to_value(disk("a"))
                .unwrap()
                .get("empty")
                .is_none()
        );
        for (bad, why) in [
            (
                Disk {
                    cdrom: false,
                    ..d.clone()
                },
                "only a CD-ROM",
            ),
            (
                Disk {
                    path: "/img/x.iso".into(),
                    ..d.clone()
                },
                "no image",
            ),
            (
                Disk {
                    bus: DiskBus::Usb,
                    ..d.clone()
                },
                "sata or scsi",
            ),
        ] {
            s.disks = vec![bad];
            let e = s.validate().unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn cdrom_is_readonly() {
        let mut d = disk("cd");
        assert!(!d.is_readonly());
        d.cdrom = true;
        assert!(d.is_readonly());
    }
}
