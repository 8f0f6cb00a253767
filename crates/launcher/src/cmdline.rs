//! The QEMU command line: a pure function from [`LaunchSpec`] to argv, plus accelerator detection.
//!
//! Block devices use `-blockdev` in its JSON form (no comma escaping needed for paths); every
//! other option uses QEMU's `key=value` syntax, with commas in values doubled.

use serde_json::{Value, json};

use crate::platform;
use crate::spec::{
    Accel, CacheMode, CpuModel, Disk, DiskBus, DiskFormat, DiskSource, Firmware, ForwardProtocol,
    LaunchSpec, Nic, NicBackend,
};

/// The virtio-serial port name the QEMU guest agent listens on inside the guest.
pub const GUEST_AGENT_PORT: &str = "org.qemu.guest_agent.0";
/// QOM id of the serial console character device.
pub const SERIAL_CHARDEV_ID: &str = "serial0";
/// QOM id of the SCSI controller created when any disk uses the SCSI bus.
pub const SCSI_CONTROLLER_ID: &str = "scsi0";
/// QOM id of the USB controller created when any disk uses the USB bus.
pub const USB_CONTROLLER_ID: &str = "usb";

/// Builds QEMU's argv (without the binary) for a spec. Pure: touches no files.
///
/// The spec should have passed [`LaunchSpec::validate`]; invalid specs still produce an argv, which
/// QEMU will then reject.
pub fn qemu_command(spec: &LaunchSpec) -> Vec<String> {
    let mut a = Args::default();
    a.opt(
        "-name",
        format!("guest={},debug-threads=on", esc(&spec.name)),
    );
    a.opt("-uuid", &spec.uuid);
    a.opt("-machine", machine_opts(spec));
    match spec.accel {
        Accel::Kvm => a.opt("-accel", "kvm"),
        Accel::Tcg => match spec.tcg_tb_size_mib {
            Some(n) => a.opt("-accel", format!("tcg,tb-size={n}")),
            None => a.opt("-accel", "tcg"),
        },
    }
    a.opt("-cpu", cpu_model(spec));
    let c = &spec.cpu;
    a.opt(
        "-smp",
        format!(
            "{},sockets={},cores={},threads={}",
            c.vcpus(),
            c.sockets,
            c.cores,
            c.threads
        ),
    );
    a.opt("-m", format!("{}M", spec.memory_mib));
    a.flag("-nodefaults");
    a.flag("-no-user-config");
    a.opt("-display", "none");
    a.opt("-smbios", smbios_opts(spec));
    a.opt("-rtc", platform::rtc_opts(&spec.platform));
    a.opt("-msg", "timestamp=on");
    if spec.start_paused {
        a.flag("-S");
    }
    if spec.incoming {
        // The connection comes later, over QMP (`migrate-incoming fd:`).
        a.opt("-incoming", "defer");
    }
    if spec.sandbox {
        // Dropping to another user (-runas) needs set*id once; after the drop QEMU holds no
        // capability to regain root, so the filter may allow those calls then.
        let elevate = if spec.run_as.is_some() {
            "allow"
        } else {
            "deny"
        };
        a.opt(
            "-sandbox",
            format!("on,obsolete=deny,elevateprivileges={elevate},spawn=deny,resourcecontrol=deny"),
        );
    }
    if let Some(user) = &spec.run_as {
        a.opt("-runas", user);
    }
    firmware_args(spec, &mut a);
    if let Some(k) = &spec.kernel_boot {
        a.opt("-kernel", k.kernel.display().to_string());
        if let Some(initrd) = &k.initrd {
            a.opt("-initrd", initrd.display().to_string());
        }
        if let Some(cmdline) = &k.cmdline {
            a.opt("-append", cmdline);
        }
    }
    chardev_args(spec, &mut a);
    disk_args(spec, &mut a);
    for nic in &spec.nics {
        nic_args(nic, &mut a);
    }
    if spec.rng {
        a.opt("-object", "rng-random,id=rng0,filename=/dev/urandom");
        a.opt("-device", "virtio-rng-pci,rng=rng0");
    }
    if spec.balloon {
        a.opt("-device", "virtio-balloon-pci,id=balloon0");
    }
    a.0.extend(crate::hostdev::device_args(
        &spec.host_devices,
        USB_CONTROLLER_ID,
    ));
    a.0.extend(platform::device_args(&spec.platform, USB_CONTROLLER_ID));
    a.0.extend(spec.extra_args.iter().cloned());
    a.0
}

/// Picks KVM or TCG for this host: KVM only when `/dev/kvm` opens read-write and the CPU reports
/// hardware virtualization (vmx or svm).
pub fn detect_accel() -> Accel {
    let kvm_openable = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    choose_accel(kvm_openable, &cpuinfo)
}

/// The decision behind [`detect_accel`], on observed facts.
pub fn choose_accel(kvm_openable: bool, cpuinfo: &str) -> Accel {
    if kvm_openable && cpu_has_virtualization(cpuinfo) {
        Accel::Kvm
    } else {
        Accel::Tcg
    }
}

/// True when any `flags` line of /proc/cpuinfo lists `vmx` (Intel VT-x) or `svm` (AMD-V).
pub fn cpu_has_virtualization(cpuinfo: &str) -> bool {
    cpuinfo.lines().any(|line| {
        let Some((key, flags)) = line.split_once(':') else {
            return false;
        };
        key.trim() == "flags"
            && flags
                .split_whitespace()
                .any(|flag| flag == "vmx" || flag == "svm")
    })
}

/// Doubles commas, as QEMU's `key=value,…` syntax requires inside values.
pub fn esc(value: &str) -> String {
    value.replace(',', ",,")
}

#[derive(Default)]
struct Args(Vec<String>);

impl Args {
    fn flag(&mut self, f: &str) {
        self.0.push(f.to_string());
    }
    fn opt(&mut self, f: &str, v: impl Into<String>) {
        self.0.push(f.to_string());
        self.0.push(v.into());
    }
}

fn machine_opts(spec: &LaunchSpec) -> String {
    let mut m = spec.machine.clone();
    let mut smm_forced = false;
    if let Firmware::Efi { secure_boot, .. } = &spec.firmware {
        m.push_str(",pflash0=fw-code,pflash1=fw-vars");
        smm_forced = *secure_boot;
    }
    m.push_str(&platform::machine_props(&spec.platform, smm_forced));
    m
}

fn cpu_model(spec: &LaunchSpec) -> String {
    let model = match (&spec.cpu.model, spec.accel) {
        // `host` needs KVM; under TCG the closest is everything TCG can emulate.
        (CpuModel::Host, Accel::Tcg) => "max".to_string(),
        (model, _) => model.to_string(),
    };
    model + &platform::cpu_suffix(&spec.platform, spec.accel)
}

fn smbios_opts(spec: &LaunchSpec) -> String {
    let s = &spec.smbios;
    let mut o = format!("type=1,manufacturer={}", esc(&s.manufacturer));
    for (key, value) in [
        ("product", &s.product),
        ("version", &s.version),
        ("serial", &s.serial),
    ] {
        if let Some(v) = value {
            o.push_str(&format!(",{key}={}", esc(v)));
        }
    }
    o.push_str(&format!(",uuid={}", spec.uuid));
    for (key, value) in [("sku", &s.sku), ("family", &s.family)] {
        if let Some(v) = value {
            o.push_str(&format!(",{key}={}", esc(v)));
        }
    }
    o
}

fn firmware_args(spec: &LaunchSpec, a: &mut Args) {
    let Firmware::Efi {
        secure_boot,
        code_path,
        vars_path,
    } = &spec.firmware
    else {
        return;
    };
    a.opt(
        "-blockdev",
        blockdev(json!({
            "driver": "file",
            "filename": code_path.display().to_string(),
            "node-name": "fw-code",
            "read-only": true,
        })),
    );
    a.opt(
        "-blockdev",
        blockdev(json!({
            "driver": "file",
            "filename": vars_path.display().to_string(),
            "node-name": "fw-vars",
            "read-only": false,
        })),
    );
    if *secure_boot {
        a.opt("-global", "driver=cfi.pflash01,property=secure,value=on");
    }
}

fn socket_chardev(id: &str, path: &std::path::Path) -> String {
    format!(
        "socket,id={id},path={},server=on,wait=off",
        esc(&path.display().to_string())
    )
}

fn chardev_args(spec: &LaunchSpec, a: &mut Args) {
    let s = &spec.sockets;
    a.opt("-chardev", socket_chardev("qmp", &s.qmp));
    a.opt("-mon", "chardev=qmp,mode=control");

    // QEMU writes the serial log into a FIFO the launcher drains into the bounded log
    // (`crate::seriallog`).
    let fifo = s.serial_log.as_deref().map(crate::seriallog::fifo_path);
    let log = fifo
        .as_ref()
        .map(|l| format!(",logfile={},logappend=on", esc(&l.display().to_string())));
    let serial = match (&s.serial, &log) {
        (Some(sock), _) => {
            Some(socket_chardev(SERIAL_CHARDEV_ID, sock) + log.as_deref().unwrap_or(""))
        }
        (None, Some(_)) => fifo.as_ref().map(|l| {
            format!(
                "file,id={SERIAL_CHARDEV_ID},path={}",
                esc(&l.display().to_string())
            )
        }),
        (None, None) => None,
    };
    if let Some(chardev) = serial {
        a.opt("-chardev", chardev);
        a.opt("-device", format!("isa-serial,chardev={SERIAL_CHARDEV_ID}"));
    }

    if let Some(qga) = &s.guest_agent {
        a.opt("-device", "virtio-serial-pci,id=virtio-serial0");
        a.opt("-chardev", socket_chardev("qga0", qga));
        a.opt(
            "-device",
            format!("virtserialport,bus=virtio-serial0.0,chardev=qga0,name={GUEST_AGENT_PORT}"),
        );
    }

    if let Some(vnc) = &s.vnc {
        a.opt("-vnc", format!("unix:{}", esc(&vnc.display().to_string())));
        a.opt("-device", format!("{},id=video0", spec.video.qemu_device()));
    }
}

fn blockdev(v: Value) -> String {
    v.to_string()
}

/// `cache.direct`, `cache.no-flush` and the device's `write-cache`, as libvirt maps its modes.
fn cache_flags(mode: CacheMode) -> (bool, bool, bool) {
    match mode {
        CacheMode::None => (true, false, true),
        CacheMode::Writethrough => (false, false, false),
        CacheMode::Writeback => (false, false, true),
        CacheMode::Directsync => (true, false, false),
        CacheMode::Unsafe => (false, true, true),
    }
}

fn disk_args(spec: &LaunchSpec, a: &mut Args) {
    if spec.disks.iter().any(|d| d.bus == DiskBus::Scsi) {
        a.opt(
            "-device",
            format!("virtio-scsi-pci,id={SCSI_CONTROLLER_ID}"),
        );
    }
    if spec.disks.iter().any(|d| d.bus == DiskBus::Usb)
        || spec.platform.needs_usb()
        || crate::hostdev::needs_usb(&spec.host_devices)
    {
        a.opt("-device", format!("qemu-xhci,id={USB_CONTROLLER_ID}"));
    }
    let (mut sata, mut scsi) = (0usize, 0usize);
    for d in &spec.disks {
        // An empty CD-ROM drive has no block nodes: the device comes up without a medium.
        if !d.empty {
            block_nodes(d, a);
        }
        let slot = match d.bus {
            DiskBus::Sata => {
                sata += 1;
                sata - 1
            }
            DiskBus::Scsi => {
                scsi += 1;
                scsi - 1
            }
            DiskBus::Virtio | DiskBus::Usb => 0,
        };
        a.opt("-device", disk_device(d, slot));
    }
}

/// Node name of a disk's format layer (what the device attaches to).
pub fn disk_node_name(disk_id: &str) -> String {
    format!("fmt-{disk_id}")
}

/// The `-blockdev` nodes of one disk: for each image (the disk, then its recorded backing
/// chain) a protocol node and a format node with the recorded format. Every qcow2 node names its
/// backing explicitly, the next image's format node or `null`, so QEMU never follows a backing
/// file written into an image header; backing images are read-only.
fn block_nodes(d: &Disk, a: &mut Args) {
    struct Layer<'a> {
        path: &'a std::path::Path,
        format: DiskFormat,
        source: DiskSource,
        suffix: String,
        read_only: bool,
    }
    let top = std::iter::once(Layer {
        path: &d.path,
        format: d.format,
        source: d.source,
        suffix: String::new(),
        read_only: d.is_readonly(),
    });
    let chain = d.backing.iter().enumerate().map(|(i, b)| Layer {
        path: &b.path,
        format: b.format,
        source: b.source,
        suffix: format!("-b{}", i + 1),
        read_only: true,
    });
    let layers: Vec<Layer> = top.chain(chain).collect();
    let cache = d.cache.map(|mode| {
        let (direct, no_flush, _) = cache_flags(mode);
        json!({"direct": direct, "no-flush": no_flush})
    });
    // Backing nodes first: a format node can only name nodes that exist already.
    for (i, l) in layers.iter().enumerate().rev() {
        let file_node = format!("file-{}{}", d.id, l.suffix);
        let mut file = json!({
            "driver": match l.source { DiskSource::File => "file", DiskSource::Block => "host_device" },
            "filename": l.path.display().to_string(),
            "node-name": file_node,
            "read-only": l.read_only,
        });
        let mut fmt = json!({
            "driver": match l.format { DiskFormat::Raw => "raw", DiskFormat::Qcow2 => "qcow2" },
            "file": file_node,
            "node-name": format!("{}{}", disk_node_name(&d.id), l.suffix),
            "read-only": l.read_only,
        });
        if l.format == DiskFormat::Qcow2 {
            fmt["backing"] = match layers.get(i + 1) {
                Some(next) => json!(format!("{}{}", disk_node_name(&d.id), next.suffix)),
                None => Value::Null,
            };
        }
        if let Some(cache) = &cache {
            file["cache"] = cache.clone();
            fmt["cache"] = cache.clone();
        }
        a.opt("-blockdev", blockdev(file));
        a.opt("-blockdev", blockdev(fmt));
    }
}

fn disk_device(d: &Disk, slot: usize) -> String {
    let model = match (d.bus, d.cdrom) {
        (DiskBus::Virtio, _) => "virtio-blk-pci".to_string(),
        (DiskBus::Sata, false) => format!("ide-hd,bus=ide.{slot}"),
        (DiskBus::Sata, true) => format!("ide-cd,bus=ide.{slot}"),
        (DiskBus::Scsi, cd) => format!(
            "{},bus={SCSI_CONTROLLER_ID}.0,channel=0,scsi-id={slot},lun=0",
            if cd { "scsi-cd" } else { "scsi-hd" }
        ),
        (DiskBus::Usb, _) => format!("usb-storage,bus={USB_CONTROLLER_ID}.0"),
    };
    let mut dev = format!("{model},id={}", d.id);
    if !d.empty {
        dev.push_str(&format!(",drive={}", disk_node_name(&d.id)));
    }
    if let Some(serial) = &d.serial {
        dev.push_str(&format!(",serial={}", esc(serial)));
    }
    if let Some(mode) = d.cache
        && !d.cdrom
    {
        let (_, _, write_cache) = cache_flags(mode);
        dev.push_str(if write_cache {
            ",write-cache=on"
        } else {
            ",write-cache=off"
        });
    }
    if let Some(n) = d.boot_order {
        dev.push_str(&format!(",bootindex={n}"));
    }
    dev
}

fn nic_args(nic: &Nic, a: &mut Args) {
    let netdev = format!("net-{}", nic.id);
    let has_netdev = match &nic.backend {
        NicBackend::User { forwards } => {
            // restrict=on: the guest reaches no host address (not 10.0.2.2 = the host's
            // loopback, not the host's own addresses, not slirp's DNS forwarder 10.0.2.3);
            // only the explicit hostfwd forwards (port-forward) still reach the guest.
            let mut o = format!("user,id={netdev},restrict=on");
            for f in forwards {
                let proto = match f.protocol {
                    ForwardProtocol::Tcp => "tcp",
                    ForwardProtocol::Udp => "udp",
                };
                o.push_str(&format!(
                    ",hostfwd={proto}:{}:{}-:{}",
                    f.host_addr, f.host_port, f.guest_port
                ));
            }
            a.opt("-netdev", o);
            true
        }
        NicBackend::Tap { ifname, queues } => {
            let mut o = format!(
                "tap,id={netdev},ifname={},script=no,downscript=no",
                esc(ifname)
            );
            if *queues > 1 {
                o.push_str(&format!(",queues={queues}"));
            }
            a.opt("-netdev", o);
            true
        }
        NicBackend::None => false,
    };
    let mut dev = format!("{},id={}", nic.model.qemu_device(), nic.id);
    if has_netdev {
        dev.push_str(&format!(",netdev={netdev}"));
    }
    if let NicBackend::Tap { queues, .. } = &nic.backend
        && *queues > 1
    {
        // One MSI-X vector per queue (rx and tx) plus config and control.
        dev.push_str(&format!(",mq=on,vectors={}", 2 * queues + 2));
    }
    if let Some(mac) = &nic.mac {
        dev.push_str(&format!(",mac={mac}"));
    }
    match nic.boot_order {
        Some(n) => dev.push_str(&format!(",bootindex={n}")),
        // No network boot wanted: skip loading the PXE option ROM.
        None => dev.push_str(",romfile="),
    }
    a.opt("-device", dev);
}

#[cfg(test)]
#[path = "cmdline_tests.rs"]
mod tests;
