//! ferrovirt-launcher: runs one VM as one QEMU process, driven over QMP (no libvirt).
//!
//! - [`spec`]: `LaunchSpec`, the VM as QEMU needs it (no API types).
//! - [`cmdline`]: the pure `LaunchSpec` → argv function and accelerator detection.
//! - [`qmp`], [`qga`], [`console`]: clients for QEMU's monitor, the guest agent and the serial
//!   console.
//! - [`process`], [`lifecycle`]: start and supervise QEMU; shutdown, pause, reset, reboot.

pub mod blockmig;
pub mod cgroup;
pub mod cmdline;
pub mod console;
pub mod control;
pub mod daemon;
pub mod disk_layers;
pub mod early;
pub mod error;
pub mod fence;
pub mod freeze;
pub mod guestexec;
pub mod hostdev;
pub mod lifecycle;
pub mod migrate;
pub mod migtls;
pub mod online_reclaim;
pub mod online_snapshot;
pub mod platform;
pub mod process;
pub mod qga;
pub mod qmp;
pub mod seriallog;
pub mod spec;
pub mod stats;
pub mod timing;

pub use cmdline::{detect_accel, qemu_command};
pub use error::{Error, Result};
pub use lifecycle::{ShutdownOutcome, ShutdownPolicy, StartOptions, Vm, VmState};
pub use spec::LaunchSpec;
