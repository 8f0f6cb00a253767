//! VirtualMachineExport (export.kubevirt.io; docs/export.md): a PVC, a stopped VM's volumes
//! or a VM snapshot's volumes offered for download over the API server's HTTPS port.
//!
//! - [`plan`] (pure): the export's status from what its source looks like now — phase,
//!   conditions, links (`raw`/`gzip` per volume, the `all` and `auth-header-secret`
//!   manifests), token Secret name, TTL expiry;
//! - [`resolve`]: reads the source (claims, PVs, VMIs, snapshot contents) into what the plan
//!   and the download routes need: which volumes, where their bytes are, or why not now;
//! - [`manifests`] (pure): the VM and DataVolumes that recreate the export elsewhere;
//! - [`loops`]: the controller (token Secret, status, deletion at TTL expiry);
//! - [`serve`]: the download and manifest routes, authenticated by the export token (not the
//!   API token), streaming bytes from the server's disk or the volume's node agent.

pub mod loops;
pub mod manifests;
pub mod plan;
pub mod resolve;
pub mod resources;
pub mod serve;

pub use loops::run;

/// Component name on Events and logs.
pub const COMPONENT: &str = "export-controller";
