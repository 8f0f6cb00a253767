//! Host devices on this node (KubeVirt's PCI, mediated and USB device plugins): what the
//! cluster permits and the node has ([`discover`]), the counts the agent advertises in its
//! Node's `status.capacity`/`allocatable` ([`advertised`]), the devices a starting VMI gets
//! ([`assign`], pure, over the devices other VMIs here hold: each VMI directory records its
//! own in [`RECORD_FILE`]), and the device nodes (`/dev/vfio/<group>`,
//! `/dev/bus/usb/BBB/DDD`) handed to the VM's QEMU uid for its life and given back after
//! ([`grant`], [`release`]). docs/hyperconverged.md "Host devices", docs/security.md.

pub mod discover;
mod grant;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ferrovirt_launcher::hostdev::HostDevice;
use serde::{Deserialize, Serialize};

pub use grant::{Grant, grant, restore};

/// Where the agent looks for devices (agent options).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostDevOptions {
    /// The sysfs root (`/sys`).
    pub sysfs: PathBuf,
    /// The device root (`/dev`).
    pub dev: PathBuf,
    /// How often the devices are counted again without a configuration change.
    pub rescan: Duration,
}

impl Default for HostDevOptions {
    fn default() -> Self {
        HostDevOptions {
            sysfs: "/sys".into(),
            dev: "/dev".into(),
            rescan: Duration::from_secs(30),
        }
    }
}

/// One physical device.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum Dev {
    #[serde(rename_all = "camelCase")]
    Pci {
        address: String,
        iommu_group: String,
    },
    #[serde(rename_all = "camelCase")]
    Mdev {
        uuid: String,
        iommu_group: String,
    },
    Usb {
        bus: u32,
        dev: u32,
    },
}

impl Dev {
    /// A key naming the device on this node.
    pub fn key(&self) -> String {
        match self {
            Dev::Pci { address, .. } => format!("pci/{address}"),
            Dev::Mdev { uuid, .. } => format!("mdev/{uuid}"),
            Dev::Usb { bus, dev } => format!("usb/{bus}/{dev}"),
        }
    }

    /// The device node QEMU opens, under the device root `dev`.
    pub fn node(&self, dev: &Path) -> PathBuf {
        match self {
            Dev::Pci { iommu_group, .. } | Dev::Mdev { iommu_group, .. } => {
                dev.join("vfio").join(iommu_group)
            }
            Dev::Usb { bus, dev: d } => dev.join(format!("bus/usb/{bus:03}/{d:03}")),
        }
    }

    /// The launch spec's form, `sysfs` being the sysfs root.
    pub fn launch(&self, sysfs: &Path) -> HostDevice {
        match self {
            Dev::Pci { address, .. } => HostDevice::Pci {
                address: address.clone(),
            },
            Dev::Mdev { uuid, .. } => HostDevice::Mdev {
                sysfs_path: sysfs.join("bus/mdev/devices").join(uuid),
            },
            Dev::Usb { bus, dev } => HostDevice::Usb {
                bus: *bus,
                addr: *dev,
            },
        }
    }
}

/// What one request takes: a PCI function, an mdev, or a set of USB devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unit {
    pub devices: Vec<Dev>,
}

/// The permitted devices found, by resource name.
pub type Inventory = BTreeMap<String, Vec<Unit>>;

/// The counts to write into the Node's capacity and allocatable: every resource found now
/// (0 when none of its devices is here) and 0 for each one advertised before that is no
/// longer permitted (as a removed device plugin leaves it).
pub fn advertised(inv: &Inventory, before: &BTreeSet<String>) -> BTreeMap<String, u64> {
    let mut out: BTreeMap<String, u64> = inv
        .iter()
        .map(|(r, u)| (r.clone(), u.len() as u64))
        .collect();
    for r in before {
        out.entry(r.clone()).or_insert(0);
    }
    out
}

/// One request's assignment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    /// The VMI field that asked (`spec.domain.devices.hostDevices[0].deviceName`).
    pub field: String,
    pub resource: String,
    pub unit: Unit,
}

/// Picks a free unit of its resource for each request (`(field, resource)` in spec order):
/// the first whose devices none of `taken` (device keys held by other VMIs here) or an
/// earlier request holds. An error names the field that found none.
pub fn assign(
    requests: &[(String, String)],
    inv: &Inventory,
    taken: &BTreeSet<String>,
    node: &str,
) -> Result<Vec<Assignment>, (String, String)> {
    let mut held = taken.clone();
    let mut out = Vec::new();
    for (field, resource) in requests {
        let free = inv
            .get(resource)
            .into_iter()
            .flatten()
            .find(|u| u.devices.iter().all(|d| !held.contains(&d.key())));
        let Some(unit) = free else {
            return Err((
                field.clone(),
                format!("no free {resource} device on node {node}"),
            ));
        };
        held.extend(unit.devices.iter().map(Dev::key));
        out.push(Assignment {
            field: field.clone(),
            resource: resource.clone(),
            unit: unit.clone(),
        });
    }
    Ok(out)
}

/// The file in a VMI directory recording its devices and the grants to undo.
pub const RECORD_FILE: &str = "host-devices.json";

/// What a VMI directory records.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub assignments: Vec<Assignment>,
    /// Device nodes handed to the VM's uid, with their owners before.
    pub grants: Vec<Grant>,
}

/// The record of the VMI directory `dir` (none: no devices).
pub fn read_record(dir: &Path) -> Option<Record> {
    let bytes = std::fs::read(dir.join(RECORD_FILE)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Writes `rec` into `dir` (replacing any).
pub fn write_record(dir: &Path, rec: &Record) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(rec).map_err(std::io::Error::other)?;
    crate::isolation::write_new_file(&dir.join(RECORD_FILE), &bytes)
}

/// The device keys held by the VMI directories `dirs`.
pub fn held_by(dirs: impl IntoIterator<Item = PathBuf>) -> BTreeSet<String> {
    dirs.into_iter()
        .filter_map(|d| read_record(&d))
        .flat_map(|r| r.assignments)
        .flat_map(|a| a.unit.devices)
        .map(|d| d.key())
        .collect()
}

/// Gives back what the VMI directory `dir` was granted (its QEMU is gone) and forgets its
/// devices. Called whenever a VMI directory is removed.
pub fn release(dir: &Path) {
    if let Some(rec) = read_record(dir) {
        restore(&rec.grants);
        let _ = std::fs::remove_file(dir.join(RECORD_FILE));
    }
}

#[cfg(test)]
mod tests;
