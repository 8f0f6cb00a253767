//! ferrovirt's controllers. Each reconcile is split into a pure decision (in [`scheduler`],
//! [`vm`], [`node_lifecycle`]) of (object, observed state) → desired changes, unit-tested
//! without a server, and the I/O that applies it against the API server ([`runtime`]).
//! [`node_ipam`] gives Nodes their pod subnets (`spec.podCIDR`).
//! [`storage`] holds the StorageClass/PVC/DataVolume controllers, [`snapshot`] the
//! VolumeSnapshot, VirtualMachineSnapshot and VirtualMachineRestore controllers, [`export`]
//! VirtualMachineExport (controller and download routes), [`endpoints`] the EndpointSlices and
//! Endpoints of Services in front of VMIs, [`udn`] the NetworkAttachmentDefinitions of
//! k8s.ovn.org user-defined networks.
//!
//! Start everything with [`run`]`(client, ControllerOptions::default())`.

pub mod backup;
pub mod conditions;
pub mod endpoints;
pub mod error;
pub mod evacuation;
pub mod export;
pub mod hco;
pub mod migration;
pub mod node_ipam;
pub mod node_lifecycle;
pub mod pool;
pub mod runtime;
pub mod scheduler;
pub mod snapshot;
pub mod storage;
pub mod udn;
pub mod vm;

pub use error::ControllerError;
pub use runtime::{ControllerOptions, run};
