//! `spec.domain` of a VirtualMachineInstance: CPU, memory, firmware, machine, features, clock
//! and resources (devices live in [`super::devices`]).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::devices::Devices;

kstruct! {
    /// The virtual hardware of a VMI.
    pub struct DomainSpec {
        /// Memory and CPU requests and limits of the VMI.
        pub resources: Option<ResourceRequirements>,
        /// vCPU topology, model and placement.
        pub cpu: Option<Cpu>,
        /// Guest memory size and backing (hugepages).
        pub memory: Option<Memory>,
        /// The emulated machine type.
        pub machine: Option<Machine>,
        /// Boot firmware (BIOS/EFI), SMBIOS identity and direct kernel boot.
        pub firmware: Option<Firmware>,
        /// The guest clock and its timers.
        pub clock: Option<Clock>,
        /// Hypervisor features exposed to the guest (ACPI, APIC, SMM, Hyper-V).
        pub features: Option<Features>,
        /// Disks, network interfaces and the other virtual devices of the guest.
        #[serde(default)]
        pub devices: Devices,
        /// How IOThreads are assigned to disks: `shared`, `auto` or `supplementalPool`.
        pub io_threads_policy: Option<String>,
        /// SMBIOS chassis information the guest sees.
        pub chassis: Option<Chassis>,
        /// Supplemental IOThread pool size (`ioThreadsPolicy: supplementalPool`).
        pub io_threads: Option<IoThreads>,
        /// `Terminate`: a guest reboot ends the VMI instead of rebooting in place.
        pub reboot_policy: Option<String>,
        /// Confidential computing (AMD SEV/SEV-ES/SNP, Intel TDX).
        pub launch_security: Option<LaunchSecurity>,
    }
}

kstruct! {
    /// IOThreads options.
    pub struct IoThreads {
        pub supplemental_pool_thread_count: Option<u32>,
    }
}

kstruct! {
    /// Memory encryption technology of a confidential VM.
    pub struct LaunchSecurity {
        pub sev: Option<Sev>,
        pub snp: Option<Empty>,
        pub tdx: Option<Empty>,
    }
}

kstruct! {
    /// AMD SEV options.
    pub struct Sev {
        pub policy: Option<SevPolicy>,
        pub attestation: Option<Empty>,
        pub session: Option<String>,
        pub dh_cert: Option<String>,
    }
}

kstruct! {
    /// AMD SEV guest policy.
    pub struct SevPolicy {
        /// SEV-ES.
        pub encrypted_state: Option<bool>,
    }
}

kstruct! {
    /// Requests and limits of the VMI's pod-equivalent (memory, cpu).
    pub struct ResourceRequirements {
        /// Resources the VMI needs (`memory`, `cpu`).
        pub requests: Option<BTreeMap<String, Quantity>>,
        /// Upper bounds of the resources the VMI may use.
        pub limits: Option<BTreeMap<String, Quantity>>,
        /// Do not add the virtualization overhead to the memory request.
        pub overcommit_guest_overhead: Option<bool>,
    }
}

kstruct! {
    /// Guest CPU topology and model.
    pub struct Cpu {
        /// Cores per socket (default 1).
        pub cores: Option<u32>,
        /// Sockets (default 1).
        pub sockets: Option<u32>,
        /// Threads per core (default 1).
        pub threads: Option<u32>,
        /// Most sockets the VM can grow to with CPU hotplug.
        pub max_sockets: Option<u32>,
        /// `host-model`, `host-passthrough` or a named model.
        pub model: Option<String>,
        /// CPU feature flags to require or disable.
        pub features: Option<Vec<CpuFeature>>,
        /// Pin each vCPU to a dedicated host CPU.
        pub dedicated_cpu_placement: Option<bool>,
        /// Give the emulator thread its own host CPU (with dedicated placement).
        pub isolate_emulator_thread: Option<bool>,
        /// Guest NUMA topology.
        pub numa: Option<CpuNuma>,
        /// Tune vCPUs for realtime workloads.
        pub realtime: Option<Realtime>,
    }
}

kstruct! {
    /// A CPU feature flag and its policy (`require`, `disable`, `force`, `optional`, `forbid`).
    pub struct CpuFeature {
        pub name: String,
        pub policy: Option<String>,
    }
}

kstruct! {
    /// Guest NUMA options.
    pub struct CpuNuma {
        #[serde(rename = "guestMappingPassthrough")]
        pub guest_mapping_passthrough: Option<Empty>,
    }
}

kstruct! {
    /// Realtime vCPU options.
    pub struct Realtime {
        pub mask: Option<String>,
    }
}

kempty! {
    /// An empty marker object (`{}`).
    Empty
}

kstruct! {
    /// Guest memory.
    pub struct Memory {
        /// Back guest memory with hugepages.
        pub hugepages: Option<Hugepages>,
        /// Memory the guest sees; defaults to the memory request.
        pub guest: Option<Quantity>,
        /// Most memory the guest can grow to with memory hotplug.
        pub max_guest: Option<Quantity>,
        /// Extra memory reserved for the VMI beyond KubeVirt's computed overhead.
        pub reserved_overhead: Option<ReservedOverhead>,
    }
}

kstruct! {
    /// Reserved memory overhead.
    pub struct ReservedOverhead {
        pub added_overhead: Option<Quantity>,
        /// `Required` or `NotRequired`.
        pub mem_lock: Option<String>,
    }
}

kstruct! {
    /// Back guest memory with hugepages of this size (`2Mi`, `1Gi`).
    pub struct Hugepages {
        pub page_size: Option<String>,
    }
}

kstruct! {
    /// Emulated machine type (`q35`, `pc-q35-rhel9.4.0`, ...).
    pub struct Machine {
        /// The machine type (`q35`).
        #[serde(rename = "type")]
        pub type_: Option<String>,
    }
}

kstruct! {
    /// Firmware: boot loader, SMBIOS UUID and serial, direct kernel boot.
    pub struct Firmware {
        /// The SMBIOS system UUID the guest sees.
        pub uuid: Option<String>,
        /// BIOS or EFI boot.
        pub bootloader: Option<Bootloader>,
        /// The SMBIOS system serial number the guest sees.
        pub serial: Option<String>,
        /// Boot a kernel and initrd directly instead of from a disk.
        pub kernel_boot: Option<KernelBoot>,
        /// Extra ACPI tables (SLIC, MSDM) from volumes.
        pub acpi: Option<AcpiTables>,
    }
}

kstruct! {
    /// BIOS or EFI.
    pub struct Bootloader {
        /// Boot with legacy BIOS.
        pub bios: Option<Bios>,
        /// Boot with UEFI.
        pub efi: Option<Efi>,
    }
}

kstruct! {
    /// Legacy BIOS.
    pub struct Bios {
        /// Send BIOS output to the serial console.
        pub use_serial: Option<bool>,
    }
}

kstruct! {
    /// UEFI firmware.
    pub struct Efi {
        /// Enable UEFI Secure Boot (default true).
        pub secure_boot: Option<bool>,
        /// Keep the EFI variables across restarts.
        pub persistent: Option<bool>,
    }
}

kstruct! {
    /// Extra ACPI tables from volumes.
    pub struct AcpiTables {
        pub slic_name_ref: Option<String>,
        pub msdm_name_ref: Option<String>,
    }
}

kstruct! {
    /// Direct kernel boot from a container image.
    pub struct KernelBoot {
        pub kernel_args: Option<String>,
        pub container: Option<KernelBootContainer>,
    }
}

kstruct! {
    /// Container holding the kernel and initrd.
    pub struct KernelBootContainer {
        pub image: String,
        pub image_pull_secret: Option<String>,
        pub image_pull_policy: Option<String>,
        pub kernel_path: Option<String>,
        pub initrd_path: Option<String>,
    }
}

kstruct! {
    /// Guest clock.
    pub struct Clock {
        /// Keep the guest clock in UTC, with an optional offset.
        pub utc: Option<ClockOffsetUtc>,
        /// Keep the guest clock in this timezone (`Europe/Berlin`).
        pub timezone: Option<String>,
        /// Timers exposed to the guest.
        pub timer: Option<Timer>,
    }
}

kstruct! {
    /// UTC clock with an offset.
    pub struct ClockOffsetUtc {
        pub offset_seconds: Option<i32>,
    }
}

kstruct! {
    /// Guest timers.
    pub struct Timer {
        pub hpet: Option<TimerAttrs>,
        pub kvm: Option<TimerAttrs>,
        pub pit: Option<TimerAttrs>,
        pub rtc: Option<RtcTimer>,
        pub hyperv: Option<TimerAttrs>,
    }
}

kstruct! {
    /// Presence and tick policy of one timer.
    pub struct TimerAttrs {
        pub tick_policy: Option<String>,
        pub present: Option<bool>,
    }
}

kstruct! {
    /// The RTC timer.
    pub struct RtcTimer {
        pub tick_policy: Option<String>,
        pub present: Option<bool>,
        pub track: Option<String>,
    }
}

kstruct! {
    /// Hypervisor features.
    pub struct Features {
        /// ACPI support (default enabled).
        pub acpi: Option<FeatureState>,
        /// The APIC.
        pub apic: Option<FeatureApic>,
        /// System management mode (needed by Secure Boot).
        pub smm: Option<FeatureState>,
        /// Hyper-V enlightenments for Windows guests.
        pub hyperv: Option<FeatureHyperv>,
        /// KVM options (hiding the hypervisor).
        pub kvm: Option<FeatureKvm>,
        /// Paravirtual spinlocks.
        pub pvspinlock: Option<FeatureState>,
        /// Pass every Hyper-V enlightenment the host supports.
        pub hyperv_passthrough: Option<FeatureState>,
    }
}

kstruct! {
    /// A feature switch; an empty object means enabled.
    pub struct FeatureState {
        pub enabled: Option<bool>,
    }
}

kstruct! {
    /// APIC options.
    pub struct FeatureApic {
        pub enabled: Option<bool>,
        pub end_of_interrupt: Option<bool>,
    }
}

kstruct! {
    /// KVM options.
    pub struct FeatureKvm {
        pub hidden: Option<bool>,
    }
}

kstruct! {
    /// Hyper-V enlightenments.
    pub struct FeatureHyperv {
        pub relaxed: Option<FeatureState>,
        pub vapic: Option<FeatureState>,
        pub spinlocks: Option<FeatureSpinlocks>,
        pub vpindex: Option<FeatureState>,
        pub runtime: Option<FeatureState>,
        pub synic: Option<FeatureState>,
        pub synictimer: Option<SyNicTimer>,
        pub reset: Option<FeatureState>,
        pub vendorid: Option<FeatureVendorId>,
        pub frequencies: Option<FeatureState>,
        pub reenlightenment: Option<FeatureState>,
        pub tlbflush: Option<FeatureTlbflush>,
        pub ipi: Option<FeatureState>,
        pub evmcs: Option<FeatureState>,
    }
}

kstruct! {
    /// Hyper-V TLB flush and its direct/extended variants.
    pub struct FeatureTlbflush {
        pub enabled: Option<bool>,
        pub direct: Option<FeatureState>,
        pub extended: Option<FeatureState>,
    }
}

kstruct! {
    /// Hyper-V spinlock retries.
    pub struct FeatureSpinlocks {
        pub enabled: Option<bool>,
        pub spinlocks: Option<u32>,
    }
}

kstruct! {
    /// Hyper-V synthetic timer.
    pub struct SyNicTimer {
        pub enabled: Option<bool>,
        pub direct: Option<FeatureState>,
    }
}

kstruct! {
    /// Hyper-V vendor id.
    pub struct FeatureVendorId {
        pub enabled: Option<bool>,
        pub vendorid: Option<String>,
    }
}

kstruct! {
    /// SMBIOS chassis information.
    pub struct Chassis {
        /// Chassis manufacturer.
        pub manufacturer: Option<String>,
        /// Chassis version.
        pub version: Option<String>,
        /// Chassis serial number.
        pub serial: Option<String>,
        /// Chassis asset tag.
        pub asset: Option<String>,
        /// Chassis SKU.
        pub sku: Option<String>,
    }
}
