//! kubevirt.io/v1 kinds and their sibling groups (instancetype, snapshot, migrations, pool).

pub mod clone;
pub mod cpu_model;
pub mod devices;
pub mod domain;
pub mod export;
pub mod host_devices;
pub mod instancetype;
pub mod misc;
pub mod overcommit;
pub mod pool;
pub mod preset;
pub mod snapshot;
pub mod vm;
pub mod vmi;
pub mod volumes;
