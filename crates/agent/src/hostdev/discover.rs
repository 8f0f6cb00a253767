//! Discovery of the host devices the cluster permits, over a sysfs root (`/sys` on a node, a
//! tree in a temporary directory in tests), as KubeVirt's device plugins find them:
//!
//! - PCI: `bus/pci/devices/<address>/{vendor,device}` matching a `vendor:device` selector,
//!   bound to `vfio-pci` (the `driver` link) and in an IOMMU group (the `iommu_group` link);
//!   one unit per IOMMU group (VFIO hands out whole groups).
//! - mediated: `bus/mdev/devices/<uuid>` whose type name (`mdev_type/name`, else the name of
//!   the `mdev_type` link; spaces as `_`) matches, with an IOMMU group.
//! - USB: `bus/usb/devices/*` with `idVendor`/`idProduct`/`busnum`/`devnum` (root hubs `usb*`
//!   and interfaces, which have no `idVendor`, are skipped); a unit of a resource is one
//!   device per selector, each device in one unit of one resource at most.
//!
//! External resources (`externalResourceProvider`) are never looked for.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use ferrovirt_api::kubevirt::host_devices::{PermittedHostDevices, UsbSelector, mdev_type_name};

use super::{Dev, Inventory, Unit};

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// The last component of the link `p` points to.
fn link_name(p: &Path) -> Option<String> {
    let target = std::fs::read_link(p).ok()?;
    target.file_name()?.to_str().map(str::to_string)
}

/// An IOMMU group name as the kernel gives it: decimal digits only (it becomes a path
/// under `/dev/vfio/`).
fn iommu_group(dev: &Path) -> Option<String> {
    link_name(&dev.join("iommu_group"))
        .filter(|g| !g.is_empty() && g.bytes().all(|b| b.is_ascii_digit()))
}

fn entries(dir: &Path) -> Vec<(String, std::path::PathBuf)> {
    let mut out: Vec<(String, std::path::PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| Some((e.file_name().into_string().ok()?, e.path())))
        .collect();
    out.sort();
    out
}

fn hex_id(p: &Path) -> Option<String> {
    let s = read_trim(p)?.to_ascii_lowercase();
    let s = s.strip_prefix("0x").unwrap_or(&s).to_string();
    (s.len() == 4 && s.bytes().all(|b| b.is_ascii_hexdigit())).then_some(s)
}

/// The permitted devices present under `sysfs`, by resource (every permitted, non-external
/// resource has an entry, empty when none is found).
pub fn scan(sysfs: &Path, permitted: &PermittedHostDevices) -> Inventory {
    let mut inv: Inventory = permitted
        .node_resources()
        .into_iter()
        .map(|r| (r, Vec::new()))
        .collect();
    pci(sysfs, permitted, &mut inv);
    mdev(sysfs, permitted, &mut inv);
    usb(sysfs, permitted, &mut inv);
    inv
}

/// A PCI function as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciFunction {
    pub address: String,
    /// `vendor:device`, lower-case hex without `0x`.
    pub id: String,
    /// The bound driver's name (`vfio-pci`, `nvidia`, …), if any.
    pub driver: Option<String>,
    /// The IOMMU group, if the function is in one (digits only).
    pub iommu_group: Option<String>,
}

/// Every PCI function under `sysfs` with a readable id, in address order.
pub fn pci_functions(sysfs: &Path) -> Vec<PciFunction> {
    entries(&sysfs.join("bus/pci/devices"))
        .into_iter()
        .filter_map(|(address, path)| {
            let (v, d) = (hex_id(&path.join("vendor"))?, hex_id(&path.join("device"))?);
            Some(PciFunction {
                address,
                id: format!("{v}:{d}"),
                driver: link_name(&path.join("driver")),
                iommu_group: iommu_group(&path),
            })
        })
        .collect()
}

fn pci(sysfs: &Path, permitted: &PermittedHostDevices, inv: &mut Inventory) {
    let mut by_selector: BTreeMap<&str, &str> = BTreeMap::new();
    for d in permitted.pci.iter().filter(|d| !d.external) {
        by_selector
            .entry(d.selector.as_str())
            .or_insert(d.resource_name.as_str());
    }
    if by_selector.is_empty() {
        return;
    }
    let mut groups: BTreeSet<String> = BTreeSet::new();
    for f in pci_functions(sysfs) {
        let Some(resource) = by_selector.get(f.id.as_str()) else {
            continue;
        };
        if f.driver.as_deref() != Some("vfio-pci") {
            continue;
        }
        let Some(group) = f.iommu_group else {
            continue;
        };
        if !groups.insert(group.clone()) {
            // Another function of the same group: VFIO assigns the group once.
            continue;
        }
        inv.entry(resource.to_string()).or_default().push(Unit {
            devices: vec![Dev::Pci {
                address: f.address,
                iommu_group: group,
            }],
        });
    }
}

fn mdev(sysfs: &Path, permitted: &PermittedHostDevices, inv: &mut Inventory) {
    let mut by_type: BTreeMap<&str, &str> = BTreeMap::new();
    for d in permitted.mediated.iter().filter(|d| !d.external) {
        by_type
            .entry(d.selector.as_str())
            .or_insert(d.resource_name.as_str());
    }
    if by_type.is_empty() {
        return;
    }
    for (uuid, path) in entries(&sysfs.join("bus/mdev/devices")) {
        let name = std::fs::read_to_string(path.join("mdev_type/name"))
            .ok()
            .or_else(|| link_name(&path.join("mdev_type")));
        let Some(name) = name.map(|n| mdev_type_name(&n)) else {
            continue;
        };
        let Some(resource) = by_type.get(name.as_str()) else {
            continue;
        };
        let uuid_ok = uuid.len() == 36 && uuid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-');
        let Some(group) = iommu_group(&path).filter(|_| uuid_ok) else {
            continue;
        };
        inv.entry(resource.to_string()).or_default().push(Unit {
            devices: vec![Dev::Mdev {
                uuid,
                iommu_group: group,
            }],
        });
    }
}

/// A USB device found on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct UsbFound {
    id: UsbSelector,
    bus: u32,
    dev: u32,
}

fn usb(sysfs: &Path, permitted: &PermittedHostDevices, inv: &mut Inventory) {
    let wanted: Vec<_> = permitted.usb.iter().filter(|d| !d.external).collect();
    if wanted.is_empty() {
        return;
    }
    let mut found: Vec<UsbFound> = Vec::new();
    for (name, path) in entries(&sysfs.join("bus/usb/devices")) {
        if name.starts_with("usb") {
            continue;
        }
        let num = |f: &str| read_trim(&path.join(f)).and_then(|s| s.parse::<u32>().ok());
        let id = |f: &str| {
            read_trim(&path.join(f))
                .and_then(|s| ferrovirt_api::kubevirt::host_devices::parse_usb_id(&s))
        };
        let (Some(vendor), Some(product), Some(bus), Some(dev)) = (
            id("idVendor"),
            id("idProduct"),
            num("busnum"),
            num("devnum"),
        ) else {
            continue;
        };
        found.push(UsbFound {
            id: UsbSelector { vendor, product },
            bus,
            dev,
        });
    }
    found.sort_by_key(|f| (f.bus, f.dev));
    let mut used = vec![false; found.len()];
    for w in wanted {
        if w.selectors.is_empty() {
            continue;
        }
        // Whole sets, one device per selector, until one selector finds none left.
        'sets: loop {
            let mut set = Vec::new();
            for sel in &w.selectors {
                let Some(i) = (0..found.len())
                    .find(|&i| !used[i] && !set.contains(&i) && found[i].id == *sel)
                else {
                    break 'sets;
                };
                set.push(i);
            }
            for &i in &set {
                used[i] = true;
            }
            inv.entry(w.resource_name.clone()).or_default().push(Unit {
                devices: set
                    .iter()
                    .map(|&i| Dev::Usb {
                        bus: found[i].bus,
                        dev: found[i].dev,
                    })
                    .collect(),
            });
        }
    }
}

#[cfg(test)]
#[path = "discover_tests.rs"]
mod tests;
