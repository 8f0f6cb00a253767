//! Discovery over sysfs trees built in a temporary directory.

use std::collections::BTreeSet;
use std::os::unix::fs::symlink;
use std::path::Path;

use ferrovirt_api::kubevirt::host_devices::PermittedHostDevices;
use serde_json::json;

use super::*;

fn permitted(p: serde_json::Value) -> PermittedHostDevices {
    PermittedHostDevices::from_kubevirt_spec(Some(
        &json!({"configuration": {"permittedHostDevices": p}}),
    ))
    .unwrap()
}

fn write(p: &Path, s: &str) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, s).unwrap();
}

/// A PCI function: vendor/device files, a driver link (if any), an IOMMU group link (if any).
fn pci(sys: &Path, addr: &str, id: (&str, &str), driver: Option<&str>, group: Option<&str>) {
    let d = sys.join("bus/pci/devices").join(addr);
    write(&d.join("vendor"), &format!("0x{}\n", id.0));
    write(&d.join("device"), &format!("0x{}\n", id.1));
    if let Some(drv) = driver {
        symlink(format!("../../../bus/pci/drivers/{drv}"), d.join("driver")).unwrap();
    }
    if let Some(g) = group {
        symlink(
            format!("../../../kernel/iommu_groups/{g}"),
            d.join("iommu_group"),
        )
        .unwrap();
    }
}

fn usb(sys: &Path, name: &str, vendor: &str, product: &str, bus: u32, dev: u32) {
    let d = sys.join("bus/usb/devices").join(name);
    write(&d.join("idVendor"), &format!("{vendor}\n"));
    write(&d.join("idProduct"), &format!("{product}\n"));
    write(&d.join("busnum"), &format!("{bus}\n"));
    write(&d.join("devnum"), &format!("{dev}\n"));
}

fn counts(inv: &Inventory) -> Vec<(String, usize)> {
    inv.iter().map(|(r, u)| (r.clone(), u.len())).collect()
}

#[test]
fn pci_functions_bound_to_vfio_with_a_group_are_found() {
    let t = tempfile::tempdir().unwrap();
    let sys = t.path();
    pci(
        sys,
        "0000:65:00.0",
        ("10de", "1eb8"),
        Some("vfio-pci"),
        Some("41"),
    );
    pci(
        sys,
        "0000:66:00.0",
        ("10DE", "1EB8"),
        Some("vfio-pci"),
        Some("42"),
    );
    // Same group as 65:00.0: VFIO hands the group out once.
    pci(
        sys,
        "0000:65:00.1",
        ("10de", "1eb8"),
        Some("vfio-pci"),
        Some("41"),
    );
    // Bound to its host driver, unbound, no IOMMU group, another id: ignored.
    pci(
        sys,
        "0000:67:00.0",
        ("10de", "1eb8"),
        Some("nvidia"),
        Some("43"),
    );
    pci(sys, "0000:68:00.0", ("10de", "1eb8"), None, Some("44"));
    pci(
        sys,
        "0000:69:00.0",
        ("10de", "1eb8"),
        Some("vfio-pci"),
        None,
    );
    pci(
        sys,
        "0000:6a:00.0",
        ("8086", "1572"),
        Some("vfio-pci"),
        Some("45"),
    );
    // A group name that is not a number never becomes a path.
    pci(
        sys,
        "0000:6b:00.0",
        ("10de", "1eb8"),
        Some("vfio-pci"),
        Some(".."),
    );
    let p = permitted(json!({"pciHostDevices": [
        {"pciVendorSelector": "10DE:1EB8", "resourceName": "nvidia.com/T4"},
        {"pciVendorSelector": "8086:1572", "resourceName": "intel.com/x710",
         "externalResourceProvider": true},
        {"pciVendorSelector": "1af4:1000", "resourceName": "example.org/none"}
    ]}));
    let inv = scan(sys, &p);
    assert_eq!(
        counts(&inv),
        [
            ("example.org/none".to_string(), 0),
            ("nvidia.com/T4".to_string(), 2)
        ],
        "the external resource is not counted here"
    );
    assert_eq!(
        inv["nvidia.com/T4"][1].devices,
        [Dev::Pci {
            address: "0000:66:00.0".into(),
            iommu_group: "42".into()
        }]
    );
}

#[test]
fn mediated_devices_are_found_by_type_name() {
    let t = tempfile::tempdir().unwrap();
    let sys = t.path();
    let m = sys.join("bus/mdev/devices");
    let a = m.join("4b20d080-1b54-4048-85b3-a6a62d165c01");
    write(&a.join("mdev_type/name"), "GRID T4-1Q\n");
    symlink("../../../kernel/iommu_groups/90", a.join("iommu_group")).unwrap();
    // No name file: the type directory's name.
    let b = m.join("4b20d080-1b54-4048-85b3-a6a62d165c02");
    std::fs::create_dir_all(sys.join("types/nvidia-222")).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    symlink(sys.join("types/nvidia-222"), b.join("mdev_type")).unwrap();
    symlink("../../../kernel/iommu_groups/91", b.join("iommu_group")).unwrap();
    // Another type, and one without a group.
    let c = m.join("4b20d080-1b54-4048-85b3-a6a62d165c03");
    write(&c.join("mdev_type/name"), "GRID T4-2Q\n");
    symlink("../../../kernel/iommu_groups/92", c.join("iommu_group")).unwrap();
    let d = m.join("4b20d080-1b54-4048-85b3-a6a62d165c04");
    write(&d.join("mdev_type/name"), "GRID T4-1Q\n");
    let p = permitted(json!({"mediatedDevices": [
        {"mdevNameSelector": "GRID T4-1Q", "resourceName": "nvidia.com/GRID_T4-1Q"},
        {"mdevNameSelector": "nvidia-222", "resourceName": "nvidia.com/222"}
    ]}));
    let inv = scan(sys, &p);
    assert_eq!(
        counts(&inv),
        [
            ("nvidia.com/222".to_string(), 1),
            ("nvidia.com/GRID_T4-1Q".to_string(), 1)
        ]
    );
    assert_eq!(
        inv["nvidia.com/GRID_T4-1Q"][0].devices[0].launch(Path::new("/sys")),
        ferrovirt_launcher::hostdev::HostDevice::Mdev {
            sysfs_path: "/sys/bus/mdev/devices/4b20d080-1b54-4048-85b3-a6a62d165c01".into()
        }
    );
}

#[test]
fn usb_sets_take_one_device_per_selector() {
    let t = tempfile::tempdir().unwrap();
    let sys = t.path();
    // Root hub and an interface: skipped.
    usb(sys, "usb1", "1d6b", "0002", 1, 1);
    write(&sys.join("bus/usb/devices/1-1:1.0/bInterfaceClass"), "08\n");
    usb(sys, "1-1", "46f4", "0001", 1, 2);
    usb(sys, "1-2", "46f4", "0001", 1, 3);
    usb(sys, "1-3", "1b1c", "1ab1", 1, 4);
    usb(sys, "2-1", "045e", "07a5", 2, 2);
    let p = permitted(json!({"usb": [
        // A pair: two storage devices and a keyboard… only one keyboard: one set.
        {"resourceName": "example.org/pair",
         "selectors": [{"vendor": "46f4", "product": "0001"}, {"vendor": "1b1c", "product": "1ab1"}]},
        // What the pair left.
        {"resourceName": "example.org/storage", "selectors": [{"vendor": "46f4", "product": "1"}]},
        {"resourceName": "example.org/mouse", "selectors": [{"vendor": "045e", "product": "07a5"}],
         "externalResourceProvider": true},
        {"resourceName": "example.org/bad", "selectors": [{"vendor": "xyz", "product": "1"}]}
    ]}));
    let inv = scan(sys, &p);
    assert_eq!(
        counts(&inv),
        [
            ("example.org/bad".to_string(), 0),
            ("example.org/pair".to_string(), 1),
            ("example.org/storage".to_string(), 1)
        ]
    );
    assert_eq!(
        inv["example.org/pair"][0].devices,
        [Dev::Usb { bus: 1, dev: 2 }, Dev::Usb { bus: 1, dev: 4 }]
    );
    assert_eq!(
        inv["example.org/storage"][0].devices,
        [Dev::Usb { bus: 1, dev: 3 }]
    );
    assert_eq!(
        Dev::Usb { bus: 1, dev: 3 }.node(Path::new("/dev")),
        Path::new("/dev/bus/usb/001/003")
    );
}

#[test]
fn an_empty_or_missing_tree_finds_nothing() {
    let t = tempfile::tempdir().unwrap();
    let p = permitted(json!({"pciHostDevices": [
        {"pciVendorSelector": "10de:1eb8", "resourceName": "nvidia.com/T4"}]}));
    let inv = scan(&t.path().join("absent"), &p);
    assert_eq!(counts(&inv), [("nvidia.com/T4".to_string(), 0)]);
}

/// The host's own /sys (a real kernel's layout: `0x` ids with a newline, driver and group
/// links): every function listed there is read with its id and driver, and only those bound
/// to vfio-pci in an IOMMU group count. `FERROVIRT_SYS_REPORT=<file>` writes what was read.
#[test]
fn the_hosts_own_sys_is_read_and_only_vfio_functions_count() {
    let sys = Path::new("/sys");
    let listed = std::fs::read_dir(sys.join("bus/pci/devices"))
        .map(|d| d.count())
        .unwrap_or(0);
    let fns = pci_functions(sys);
    assert_eq!(fns.len(), listed, "{fns:?}");
    let mut report = String::new();
    for f in &fns {
        let raw =
            std::fs::read_to_string(sys.join("bus/pci/devices").join(&f.address).join("vendor"))
                .unwrap();
        assert_eq!(
            &f.id[..4],
            raw.trim().trim_start_matches("0x").to_ascii_lowercase()
        );
        let driver =
            std::fs::read_link(sys.join("bus/pci/devices").join(&f.address).join("driver"))
                .ok()
                .and_then(|l| l.file_name().map(|n| n.to_string_lossy().into_owned()));
        assert_eq!(f.driver, driver, "{}", f.address);
        report.push_str(&format!(
            "{} {} driver={:?} group={:?}\n",
            f.address, f.id, f.driver, f.iommu_group
        ));
    }
    let ids: BTreeSet<String> = fns.iter().map(|f| f.id.clone()).collect();
    let list: Vec<serde_json::Value> = ids
        .iter()
        .map(|id| {
            json!({"pciVendorSelector": id.to_ascii_uppercase(),
                         "resourceName": format!("test.example/{}", id.replace(':', "-"))})
        })
        .collect();
    let inv = scan(sys, &permitted(json!({"pciHostDevices": list})));
    for id in &ids {
        let groups: BTreeSet<&String> = fns
            .iter()
            .filter(|f| &f.id == id && f.driver.as_deref() == Some("vfio-pci"))
            .filter_map(|f| f.iommu_group.as_ref())
            .collect();
        let r = format!("test.example/{}", id.replace(':', "-"));
        assert_eq!(inv[&r].len(), groups.len(), "{r}");
        report.push_str(&format!("{r}: {}\n", inv[&r].len()));
    }
    if let Ok(path) = std::env::var("FERROVIRT_SYS_REPORT") {
        std::fs::write(path, report).unwrap();
    }
}
