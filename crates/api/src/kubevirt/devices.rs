//! `spec.domain.devices`: disks, interfaces and the other virtual devices of a VMI.

use super::domain::Empty;

kstruct! {
    /// The devices attached to the guest.
    pub struct Devices {
        pub use_virtio_transitional: Option<bool>,
        pub disable_hotplug: Option<bool>,
        pub disks: Option<Vec<Disk>>,
        pub watchdog: Option<Watchdog>,
        pub interfaces: Option<Vec<Interface>>,
        pub inputs: Option<Vec<Input>>,
        pub autoattach_pod_interface: Option<bool>,
        pub autoattach_graphics_device: Option<bool>,
        pub autoattach_serial_console: Option<bool>,
        pub autoattach_mem_balloon: Option<bool>,
        pub autoattach_input_device: Option<bool>,
        #[serde(rename = "autoattachVSOCK")]
        pub autoattach_vsock: Option<bool>,
        pub rng: Option<Empty>,
        pub block_multi_queue: Option<bool>,
        pub network_interface_multiqueue: Option<bool>,
        pub gpus: Option<Vec<Gpu>>,
        pub host_devices: Option<Vec<HostDevice>>,
        pub filesystems: Option<Vec<Filesystem>>,
        pub client_passthrough: Option<Empty>,
        pub sound: Option<SoundDevice>,
        pub tpm: Option<Tpm>,
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
        #[serde(rename = "type")]
        pub type_: Option<String>,
    }
}

kstruct! {
    /// A panic notifier (`model`: `isa`, `hyperv`, `pvpanic`, `s390`).
    pub struct PanicDevice {
        pub model: Option<String>,
    }
}

kstruct! {
    /// A guest disk backed by the volume of the same name.
    pub struct Disk {
        pub name: String,
        pub disk: Option<DiskTarget>,
        pub lun: Option<LunTarget>,
        pub cdrom: Option<CdromTarget>,
        pub boot_order: Option<u32>,
        pub serial: Option<String>,
        #[serde(rename = "dedicatedIOThread")]
        pub dedicated_io_thread: Option<bool>,
        pub cache: Option<String>,
        pub io: Option<String>,
        pub tag: Option<String>,
        pub block_size: Option<BlockSize>,
        pub shareable: Option<bool>,
        pub error_policy: Option<String>,
        /// Track changed blocks (incremental backup) of this disk.
        pub changed_block_tracking: Option<bool>,
    }
}

kstruct! {
    /// A plain disk: bus `virtio`, `sata`, `scsi` or `usb`.
    pub struct DiskTarget {
        pub bus: Option<String>,
        pub readonly: Option<bool>,
        pub pci_address: Option<String>,
    }
}

kstruct! {
    /// A SCSI LUN.
    pub struct LunTarget {
        pub bus: Option<String>,
        pub readonly: Option<bool>,
        pub reservation: Option<bool>,
    }
}

kstruct! {
    /// A CD-ROM drive.
    pub struct CdromTarget {
        pub bus: Option<String>,
        pub readonly: Option<bool>,
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
        pub name: String,
        /// `virtio`, `e1000`, `e1000e`, `igb`, `ne2k_pci`, `pcnet`, `rtl8139`.
        pub model: Option<String>,
        pub bridge: Option<Empty>,
        pub masquerade: Option<Empty>,
        pub sriov: Option<Empty>,
        pub slirp: Option<Empty>,
        pub passt: Option<Empty>,
        /// The core passt binding (no plugin).
        pub passt_binding: Option<Empty>,
        pub macvtap: Option<Empty>,
        pub binding: Option<PluginBinding>,
        pub ports: Option<Vec<Port>>,
        /// Port ranges forwarded to the guest (passt binding).
        pub port_ranges: Option<Vec<PortRange>>,
        pub mac_address: Option<String>,
        pub boot_order: Option<u32>,
        pub pci_address: Option<String>,
        pub dhcp_options: Option<DhcpOptions>,
        pub tag: Option<String>,
        pub acpi_index: Option<u32>,
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
        pub name: Option<String>,
        pub protocol: Option<String>,
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
        pub name: String,
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
        pub name: String,
        pub bus: Option<String>,
        #[serde(rename = "type")]
        pub type_: String,
    }
}

kstruct! {
    /// A GPU passed through or mediated: a device plugin resource (`deviceName`) or a DRA
    /// claim (`claimName` + `requestName`).
    pub struct Gpu {
        pub name: String,
        pub device_name: Option<String>,
        pub claim_name: Option<String>,
        pub request_name: Option<String>,
        #[serde(rename = "virtualGPUOptions")]
        pub virtual_gpu_options: Option<VgpuOptions>,
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
        pub name: String,
        pub device_name: Option<String>,
        pub claim_name: Option<String>,
        pub request_name: Option<String>,
        pub tag: Option<String>,
    }
}

kstruct! {
    /// A virtiofs filesystem backed by the volume of the same name.
    pub struct Filesystem {
        pub name: String,
        pub virtiofs: Option<Empty>,
    }
}

kstruct! {
    /// A sound device.
    pub struct SoundDevice {
        pub name: String,
        pub model: Option<String>,
    }
}

kstruct! {
    /// An emulated TPM.
    pub struct Tpm {
        pub enabled: Option<bool>,
        pub persistent: Option<bool>,
    }
}
