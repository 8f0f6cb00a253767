//! instancetype.kubevirt.io/v1beta1: (Cluster)Instancetypes size a VM, (Cluster)Preferences
//! fill in defaults.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::devices::{Gpu, HostDevice};
use super::domain::{Clock, CpuFeature, Efi, Empty, Hugepages, Timer};
use super::domain::{CpuNuma, FeatureApic, FeatureHyperv, FeatureKvm, FeatureState, Realtime};

resource! {
    /// Namespaced instance type.
    VirtualMachineInstancetype, InstancetypeSpec
}

resource! {
    /// Cluster-wide instance type.
    VirtualMachineClusterInstancetype, InstancetypeSpec
}

resource! {
    /// Namespaced preference.
    VirtualMachinePreference, PreferenceSpec
}

resource! {
    /// Cluster-wide preference.
    VirtualMachineClusterPreference, PreferenceSpec
}

kstruct! {
    /// Resources an instance type gives a VM.
    pub struct InstancetypeSpec {
        #[serde(default)]
        pub cpu: InstancetypeCpu,
        #[serde(default)]
        pub memory: InstancetypeMemory,
        pub gpus: Option<Vec<Gpu>>,
        pub host_devices: Option<Vec<HostDevice>>,
        /// IOThreads policy of the VMIs (`shared`, `auto`).
        #[serde(rename = "ioThreadsPolicy")]
        pub io_threads_policy: Option<String>,
        /// Annotations added to the VMIs that use this instancetype.
        pub annotations: Option<BTreeMap<String, String>>,
        /// Node labels the VMIs must be scheduled on.
        pub node_selector: Option<BTreeMap<String, String>>,
        /// Scheduler of the VMIs.
        pub scheduler_name: Option<String>,
        pub launch_security: Option<super::domain::LaunchSecurity>,
        pub io_threads: Option<super::domain::IoThreads>,
    }
}

kstruct! {
    /// vCPUs of an instance type.
    pub struct InstancetypeCpu {
        pub guest: u32,
        pub model: Option<String>,
        #[serde(rename = "dedicatedCPUPlacement")]
        pub dedicated_cpu_placement: Option<bool>,
        pub numa: Option<CpuNuma>,
        pub isolate_emulator_thread: Option<bool>,
        pub realtime: Option<Realtime>,
        pub max_sockets: Option<u32>,
    }
}

kstruct! {
    /// Memory of an instance type.
    pub struct InstancetypeMemory {
        pub guest: Quantity,
        pub hugepages: Option<Hugepages>,
        pub overcommit_percent: Option<i32>,
        pub max_guest: Option<Quantity>,
    }
}

kstruct! {
    /// Defaults a preference applies where the VM leaves a field unset.
    pub struct PreferenceSpec {
        pub clock: Option<ClockPreferences>,
        pub cpu: Option<CpuPreferences>,
        pub devices: Option<DevicePreferences>,
        pub features: Option<FeaturePreferences>,
        pub firmware: Option<FirmwarePreferences>,
        pub machine: Option<MachinePreferences>,
        pub volumes: Option<VolumePreferences>,
        /// Subdomain preferred for the VMIs.
        pub preferred_subdomain: Option<String>,
        /// Grace period preferred for the VMIs' shutdown, in seconds.
        pub preferred_termination_grace_period_seconds: Option<i64>,
        pub requirements: Option<PreferenceRequirements>,
        /// Annotations added to the VMIs that use this preference.
        pub annotations: Option<BTreeMap<String, String>>,
        /// Cores per socket when vCPUs are spread over sockets and cores.
        pub prefer_spread_socket_to_core_ratio: Option<u32>,
        /// CPU architecture preferred for the VM.
        pub preferred_architecture: Option<String>,
        pub preferred_launch_security: Option<super::domain::LaunchSecurity>,
    }
}

kstruct! {
    /// Clock preferences.
    pub struct ClockPreferences {
        pub preferred_clock_offset: Option<Clock>,
        pub preferred_timer: Option<Timer>,
    }
}

kstruct! {
    /// CPU preferences.
    pub struct CpuPreferences {
        /// `sockets` (default), `cores`, `threads`, `spread` or `any`.
        #[serde(rename = "preferredCPUTopology")]
        pub preferred_cpu_topology: Option<String>,
        pub spread_options: Option<SpreadOptions>,
        #[serde(rename = "preferredCPUFeatures")]
        pub preferred_cpu_features: Option<Vec<CpuFeature>>,
    }
}

kstruct! {
    /// How `spread` divides vCPUs.
    pub struct SpreadOptions {
        pub ratio: Option<u32>,
        pub across: Option<String>,
    }
}

kstruct! {
    /// Device preferences.
    pub struct DevicePreferences {
        pub preferred_autoattach_graphics_device: Option<bool>,
        pub preferred_autoattach_mem_balloon: Option<bool>,
        pub preferred_autoattach_pod_interface: Option<bool>,
        pub preferred_autoattach_serial_console: Option<bool>,
        pub preferred_autoattach_input_device: Option<bool>,
        pub preferred_disable_hotplug: Option<bool>,
        pub preferred_use_virtio_transitional: Option<bool>,
        pub preferred_input_bus: Option<String>,
        pub preferred_input_type: Option<String>,
        pub preferred_disk_bus: Option<String>,
        pub preferred_lun_bus: Option<String>,
        pub preferred_cdrom_bus: Option<String>,
        #[serde(rename = "preferredDiskDedicatedIoThread")]
        pub preferred_disk_dedicated_io_thread: Option<bool>,
        pub preferred_disk_cache: Option<String>,
        #[serde(rename = "preferredDiskIO")]
        pub preferred_disk_io: Option<String>,
        pub preferred_interface_model: Option<String>,
        pub preferred_rng: Option<Empty>,
        pub preferred_block_multi_queue: Option<bool>,
        pub preferred_network_interface_multi_queue: Option<bool>,
        #[serde(rename = "preferredTPM")]
        pub preferred_tpm: Option<super::devices::Tpm>,
        pub preferred_interface_masquerade: Option<Empty>,
        pub preferred_sound_model: Option<String>,
        pub preferred_video_type: Option<String>,
    }
}

kstruct! {
    /// Feature preferences.
    pub struct FeaturePreferences {
        pub preferred_acpi: Option<FeatureState>,
        pub preferred_apic: Option<FeatureApic>,
        pub preferred_hyperv: Option<FeatureHyperv>,
        pub preferred_kvm: Option<FeatureKvm>,
        pub preferred_pvspinlock: Option<FeatureState>,
        pub preferred_smm: Option<FeatureState>,
    }
}

kstruct! {
    /// Firmware preferences.
    pub struct FirmwarePreferences {
        pub preferred_use_bios: Option<bool>,
        pub preferred_use_bios_serial: Option<bool>,
        pub preferred_use_efi: Option<bool>,
        pub preferred_use_secure_boot: Option<bool>,
        pub preferred_efi: Option<Efi>,
    }
}

kstruct! {
    /// Machine preferences.
    pub struct MachinePreferences {
        pub preferred_machine_type: Option<String>,
    }
}

kstruct! {
    /// Volume preferences.
    pub struct VolumePreferences {
        pub preferred_storage_class_name: Option<String>,
    }
}

kstruct! {
    /// Minimum resources the preference demands.
    pub struct PreferenceRequirements {
        /// The architecture the VM must have (`amd64`, `arm64`, `s390x`).
        pub architecture: Option<String>,
        pub cpu: Option<CpuRequirement>,
        pub memory: Option<MemoryRequirement>,
    }
}

kstruct! {
    /// Minimum vCPUs.
    pub struct CpuRequirement {
        pub guest: u32,
    }
}

kstruct! {
    /// Minimum memory.
    pub struct MemoryRequirement {
        pub guest: Quantity,
    }
}
