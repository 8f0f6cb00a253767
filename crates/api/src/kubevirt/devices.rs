//! `spec.domain.devices`: disks, interfaces and the other virtual devices of a VMI.

use super::domain::Empty;

kstruct! {
    /// The devices attached to the guest.
    pub struct Devices {
        /// Use virtio transitional devices, so guests with pre-1.0 virtio drivers (old kernels) see them.
        pub use_virtio_transitional: Option<bool>,
        /// Do not reserve room for hot-plugged devices.
        pub disable_hotplug: Option<bool>,
        /// The guest's disks, CD-ROMs and LUNs; each is backed by the volume with the same name.
        pub disks: Option<Vec<Disk>>,
        /// A watchdog device and what happens when the guest stops feeding it.
        pub watchdog: Option<Watchdog>,
        /// The guest's network interfaces; each connects to the network with the same name.
        pub interfaces: Option<Vec<Interface>>,
        /// Input devices such as a USB or virtio tablet.
        pub inputs: Option<Vec<Input>>,
        /// Add a default interface on the pod network when none is listed (default true).
        pub autoattach_pod_interface: Option<bool>,
        /// Add a VGA/virtio graphics device with a VNC server (default true).
        pub autoattach_graphics_device: Option<bool>,
        /// Add a serial console reachable with `virtctl console` (default true).
        pub autoattach_serial_console: Option<bool>,
        /// Add a virtio memory balloon device (default true).
        pub autoattach_mem_balloon: Option<bool>,
        /// Add a tablet input device matching the graphics device.
        pub autoattach_input_device: Option<bool>,
        /// Add a virtio-vsock device with a cluster-unique CID.
        #[serde(rename = "autoattachVSOCK")]
        pub autoattach_vsock: Option<bool>,
        /// Add a virtio random number generator fed from the host.
        pub rng: Option<Empty>,
        /// Give virtio disks one queue per vCPU.
        pub block_multi_queue: Option<bool>,
        /// Give virtio NICs one queue pair per vCPU.
        pub network_interface_multiqueue: Option<bool>,
        /// GPUs given to the guest (device-plugin resources or DRA claims).
        pub gpus: Option<Vec<Gpu>>,
        /// Host PCI or mediated devices given to the guest.
        pub host_devices: Option<Vec<HostDevice>>,
        /// Volumes shared with the guest as virtiofs filesystems instead of disks.
        pub filesystems: Option<Vec<Filesystem>>,
        /// Allow USB devices from a client to be redirected into the guest.
        pub client_passthrough: Option<Empty>,
        /// An emulated sound card.
        pub sound: Option<SoundDevice>,
        /// An emulated TPM 2.0 device, optionally persistent across restarts.
        pub tpm: Option<Tpm>,
        /// Keep a log of the serial console output (default true).
        pub log_serial_console: Option<bool>,
        /// The guest's video device (`type`: `virtio`, `vga`, `bochs`, `cirrus`, `ramfb`).
        pub video: Option<Video>,
        /// A virtio-serial port carrying host metrics (vhostmd).
        pub downward_metrics: Option<Empty>,
        /// Panic notifier devices.
        pub panic_devices: Option<Vec<PanicDevice>>,
    }
}

kstruct! {
    /// The video device and its model.
    pub struct Video {
        /// The video device model.
        #[serde(rename = "type")]
        pub type_: Option<String>,
    }
}

kstruct! {
    /// A panic notifier (`model`: `isa`, `hyperv`, `pvpanic`, `s390`).
    pub struct PanicDevice {
        /// The panic device model.
        pub model: Option<String>,
    }
}

kstruct! {
    /// A guest disk backed by the volume of the same name.
    pub struct Disk {
        /// The disk's name; it must match a volume in `spec.volumes`.
        pub name: String,
        /// Attach as a plain disk.
        pub disk: Option<DiskTarget>,
        /// Attach as a SCSI LUN.
        pub lun: Option<LunTarget>,
        /// Attach as a CD-ROM drive.
        pub cdrom: Option<CdromTarget>,
        /// Position in the boot order (1 first); unset disks are not booted from.
        pub boot_order: Option<u32>,
        /// Serial number the guest sees for this disk.
        pub serial: Option<String>,
        /// Give this disk its own IOThread.
        #[serde(rename = "dedicatedIOThread")]
        pub dedicated_io_thread: Option<bool>,
        /// Host cache mode: `none`, `writethrough` or `writeback`.
        pub cache: Option<String>,
        /// Host I/O mode: `native` or `threads`.
        pub io: Option<String>,
        /// A tag passed to the guest in the device metadata.
        pub tag: Option<String>,
        /// Logical and physical block sizes the guest sees.
        pub block_size: Option<BlockSize>,
        /// Allow the disk to be attached to several VMs at once.
        pub shareable: Option<bool>,
        /// What to do on an I/O error: `stop`, `ignore`, `report` or `enospace`.
        pub error_policy: Option<String>,
        /// Track changed blocks (incremental backup) of this disk.
        pub changed_block_tracking: Option<bool>,
    }
}

kstruct! {
    /// A plain disk: bus `virtio`, `sata`, `scsi` or `usb`.
    pub struct DiskTarget {
        /// Bus the disk is attached to: `virtio`, `sata`, `scsi` or `usb`.
        pub bus: Option<String>,
        /// Expose the disk read-only.
        pub readonly: Option<bool>,
        /// The guest PCI address of the disk (`0000:81:01.0`).
        pub pci_address: Option<String>,
    }
}

kstruct! {
    /// A SCSI LUN.
    pub struct LunTarget {
        /// Bus the LUN is attached to (`scsi`).
        pub bus: Option<String>,
        /// Expose the LUN read-only.
        pub readonly: Option<bool>,
        /// Allow SCSI persistent reservations.
        pub reservation: Option<bool>,
    }
}

kstruct! {
    /// A CD-ROM drive.
    pub struct CdromTarget {
        /// Bus the drive is attached to (`sata`, `scsi`).
        pub bus: Option<String>,
        /// Expose the drive read-only (default true).
        pub readonly: Option<bool>,
        /// Tray state: `open` or `closed`.
        pub tray: Option<String>,
    }
}

kstruct! {
    /// Logical/physical block size of a disk.
    pub struct BlockSize {
        pub custom: Option<CustomBlockSize>,
        pub match_volume: Option<FeatureEnabled>,
    }
}

kstruct! {
    /// Explicit block sizes.
    pub struct CustomBlockSize {
        pub logical: u32,
        pub physical: u32,
        pub discard_granularity: Option<u32>,
    }
}

kstruct! {
    /// An `{enabled: bool}` switch.
    pub struct FeatureEnabled {
        pub enabled: Option<bool>,
    }
}

kstruct! {
    /// A guest NIC connected to the network of the same name.
    pub struct Interface {
        /// The interface's name; it must match a network in `spec.networks`.
        pub name: String,
        /// `virtio`, `e1000`, `e1000e`, `igb`, `ne2k_pci`, `pcnet`, `rtl8139`.
        pub model: Option<String>,
        /// Bridge binding: the guest gets the pod interface's address on a bridge.
        pub bridge: Option<Empty>,
        /// Masquerade binding: the guest sits behind NAT on the pod address.
        pub masquerade: Option<Empty>,
        /// SR-IOV binding: a virtual function passed through.
        pub sriov: Option<Empty>,
        /// Slirp binding: user-mode networking.
        pub slirp: Option<Empty>,
        /// Passt binding through the passt network binding plugin.
        pub passt: Option<Empty>,
        /// The core passt binding (no plugin).
        pub passt_binding: Option<Empty>,
        /// Macvtap binding through the macvtap network binding plugin.
        pub macvtap: Option<Empty>,
        /// A network binding plugin by name.
        pub binding: Option<PluginBinding>,
        /// Ports forwarded to the guest (masquerade); all ports when empty.
        pub ports: Option<Vec<Port>>,
        /// Port ranges forwarded to the guest (passt binding).
        pub port_ranges: Option<Vec<PortRange>>,
        /// The MAC address the guest sees (`de:ad:00:00:be:af`).
        pub mac_address: Option<String>,
        /// Position in the boot order for network boot (PXE).
        pub boot_order: Option<u32>,
        /// The guest PCI address of the NIC.
        pub pci_address: Option<String>,
        /// Extra DHCP options offered to the guest.
        pub dhcp_options: Option<DhcpOptions>,
        /// A tag passed to the guest in the device metadata.
        pub tag: Option<String>,
        /// ACPI index of the NIC, which fixes its name in the guest.
        pub acpi_index: Option<u32>,
        /// `up`, `down` or `absent` (hot-unplug).
        pub state: Option<String>,
    }
}

kstruct! {
    /// A network binding plugin by name.
    pub struct PluginBinding {
        pub name: String,
    }
}

kstruct! {
    /// A port forwarded to the guest (masquerade).
    pub struct Port {
        /// A name for the port.
        pub name: Option<String>,
        /// `TCP` (default) or `UDP`.
        pub protocol: Option<String>,
        /// The port number.
        pub port: i32,
    }
}

kstruct! {
    /// An inclusive range of ports.
    pub struct PortRange {
        pub start: i32,
        pub end: i32,
        pub protocol: Option<String>,
    }
}

kstruct! {
    /// Extra DHCP options offered to the guest.
    pub struct DhcpOptions {
        pub boot_file_name: Option<String>,
        pub tftp_server_name: Option<String>,
        pub ntp_servers: Option<Vec<String>>,
        pub private_options: Option<Vec<DhcpPrivateOption>>,
    }
}

kstruct! {
    /// A DHCP private option (224-254).
    pub struct DhcpPrivateOption {
        pub option: i32,
        pub value: String,
    }
}

kstruct! {
    /// A watchdog device.
    pub struct Watchdog {
        /// The watchdog's name.
        pub name: String,
        /// The Intel 6300ESB watchdog.
        pub i6300esb: Option<I6300esbWatchdog>,
        /// The s390x diag288 watchdog.
        pub diag288: Option<I6300esbWatchdog>,
    }
}

kstruct! {
    /// The i6300esb watchdog and its action (`poweroff`, `reset`, `shutdown`).
    pub struct I6300esbWatchdog {
        pub action: Option<String>,
    }
}

kstruct! {
    /// An input device (tablet).
    pub struct Input {
        /// The input device's name.
        pub name: String,
        /// Bus: `usb` or `virtio`.
        pub bus: Option<String>,
        /// Device type: `tablet`.
        #[serde(rename = "type")]
        pub type_: String,
    }
}

kstruct! {
    /// A GPU passed through or mediated: a device plugin resource (`deviceName`) or a DRA
    /// claim (`claimName` + `requestName`).
    pub struct Gpu {
        /// The GPU's name.
        pub name: String,
        /// The device-plugin resource name of the GPU.
        pub device_name: Option<String>,
        /// The DRA resource claim providing the GPU.
        pub claim_name: Option<String>,
        /// The request within the DRA claim.
        pub request_name: Option<String>,
        /// Display options of a vGPU.
        #[serde(rename = "virtualGPUOptions")]
        pub virtual_gpu_options: Option<VgpuOptions>,
        /// A tag passed to the guest in the device metadata.
        pub tag: Option<String>,
    }
}

kstruct! {
    /// Options of a mediated (vGPU) device.
    pub struct VgpuOptions {
        pub display: Option<VgpuDisplay>,
    }
}

kstruct! {
    /// A vGPU display.
    pub struct VgpuDisplay {
        pub enabled: Option<bool>,
        #[serde(rename = "ramFB")]
        pub ram_fb: Option<FeatureEnabled>,
    }
}

kstruct! {
    /// A host device passed through: a device plugin resource or a DRA claim.
    pub struct HostDevice {
        /// The device's name.
        pub name: String,
        /// The device-plugin resource name of the device.
        pub device_name: Option<String>,
        /// The DRA resource claim providing the device.
        pub claim_name: Option<String>,
        /// The request within the DRA claim.
        pub request_name: Option<String>,
        /// A tag passed to the guest in the device metadata.
        pub tag: Option<String>,
    }
}

kstruct! {
    /// A virtiofs filesystem backed by the volume of the same name.
    pub struct Filesystem {
        /// The filesystem's name; it must match a volume.
        pub name: String,
        /// Share through virtiofs.
        pub virtiofs: Option<Empty>,
    }
}

kstruct! {
    /// A sound device.
    pub struct SoundDevice {
        /// The sound device's name.
        pub name: String,
        /// `ich9` or `ac97`.
        pub model: Option<String>,
    }
}

kstruct! {
    /// An emulated TPM.
    pub struct Tpm {
        /// Whether the TPM is present (default true when `tpm` is set).
        pub enabled: Option<bool>,
        /// Keep the TPM's state across restarts.
        pub persistent: Option<bool>,
    }
}
