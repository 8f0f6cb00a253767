//! backup.ferrovirt.io (docs/backup.md): VMs written to a backup repository
//! (`ferrovirt_backup`) on an S3 bucket or a directory.
//!
//! - [`plan`] (pure): the repository target from a BackupTarget and its credentials, the
//!   backup's name on the target, the objects a VM references (for the manifest) and how they
//!   are stripped, progress and status figures;
//! - [`resources`]: `kube::Resource` wrappers of the group's kinds;
//! - [`loops`]: the Backup controller (a stopped VM's claims read where they are — through
//!   the node agent for `local` volumes, on this machine for shared ones —, a running VM's
//!   through an online snapshot ([`online`]), and written to the
//!   target; status with per-volume figures) and the BackupTarget checker (reachable, bytes
//!   stored, last check);
//! - [`freeze`]: a `Group` consistency freeze (every running VM frozen before the online
//!   snapshots, all thawed after them); [`hooks`]: `preFreezeCommand`/`postThawCommand` in
//!   the running guests through their guest agents;
//! - [`incremental`]: backup points (a succeeded Backup's online snapshot kept per VM and
//!   target) and the pure choice of where each claim's next read starts, or why it is whole;
//! - [`restore`] (pure) and [`restore_loop`]: the BackupRestore controller (a backup found
//!   in the target's catalog restored into the restore's own namespace: DataVolumes filled
//!   from the repository, Secrets/ConfigMaps, the VMs; conflicts refused, never overwritten);
//! - [`runs`] (pure) and [`plans`]: the BackupPlan controller (scheduled runs as Backups owned
//!   by the plan, last result, GFS retention pruning the target, then garbage collection).

pub mod freeze;
pub mod hooks;
pub mod incremental;
pub mod loops;
pub mod online;
pub mod plan;
pub mod plans;
pub mod resources;
pub mod restore;
pub mod restore_loop;
pub mod runs;

pub use loops::run;

/// Component name on Events and logs.
pub const COMPONENT: &str = "backup-controller";
