//! ferrovirt's typed API: the resource kinds it serves (KubeVirt's, CDI's, Kubernetes' core
//! kinds), their OpenAPI schemas, defaulting and validation. Pure functions, no I/O; the API
//! server calls [`admission::admit`] on every create and update.

#[macro_use]
mod macros;

pub mod admission;
pub mod backup;
pub mod backup_schedule;
pub mod cdi;
pub mod eviction;
pub mod expand;
pub mod fencing;
pub mod hco;
pub mod jointoken;
pub mod jsonpath;
pub mod kubevirt;
pub mod launcher_pod;
pub mod migration;
pub mod migration_policy;
pub mod network;
pub mod nmstate;
pub mod platform_pod;
pub mod quantity;
pub mod registry;
pub mod scale;
pub mod schema;
pub mod service;
pub mod shared_mount;
pub mod udn;
pub mod volumesnapshot;
pub mod yaml;

pub use k8s_openapi;
