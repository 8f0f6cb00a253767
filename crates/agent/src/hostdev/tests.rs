//! Unit tests of assignment, advertised counts, records and device node grants.

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::*;

fn pci(addr: &str, group: &str) -> Unit {
    Unit {
        devices: vec![Dev::Pci {
            address: addr.into(),
            iommu_group: group.into(),
        }],
    }
}

fn inventory() -> Inventory {
    let mut inv = Inventory::new();
    inv.insert(
        "example.org/gpu".into(),
        vec![pci("0000:65:00.0", "41"), pci("0000:66:00.0", "42")],
    );
    inv.insert(
        "example.org/keys".into(),
        vec![Unit {
            devices: vec![Dev::Usb { bus: 1, dev: 2 }, Dev::Usb { bus: 1, dev: 3 }],
        }],
    );
    inv.insert("example.org/none".into(), vec![]);
    inv
}

fn req(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(f, r)| (f.to_string(), r.to_string()))
        .collect()
}

#[test]
fn requests_get_free_units_in_order() {
    let inv = inventory();
    let r = req(&[
        ("spec.domain.devices.gpus[0].deviceName", "example.org/gpu"),
        (
            "spec.domain.devices.hostDevices[0].deviceName",
            "example.org/gpu",
        ),
        (
            "spec.domain.devices.hostDevices[1].deviceName",
            "example.org/keys",
        ),
    ]);
    let a = assign(&r, &inv, &BTreeSet::new(), "n1").unwrap();
    assert_eq!(a[0].unit, pci("0000:65:00.0", "41"));
    assert_eq!(a[1].unit, pci("0000:66:00.0", "42"));
    assert_eq!(a[2].unit.devices.len(), 2);
    // Another VMI here holds the first GPU: one left, and a second request finds none.
    let taken: BTreeSet<String> = ["pci/0000:65:00.0".to_string()].into();
    let one = assign(&r[..1], &inv, &taken, "n1").unwrap();
    assert_eq!(one[0].unit, pci("0000:66:00.0", "42"));
    assert_eq!(
        assign(&r[..2], &inv, &taken, "n1").unwrap_err(),
        (
            "spec.domain.devices.hostDevices[0].deviceName".to_string(),
            "no free example.org/gpu device on node n1".to_string()
        )
    );
    // A USB set with one device held elsewhere is not free.
    let taken: BTreeSet<String> = ["usb/1/3".to_string()].into();
    assert!(assign(&r[2..], &inv, &taken, "n1").is_err());
    assert!(
        assign(
            &req(&[("f", "example.org/none")]),
            &inv,
            &BTreeSet::new(),
            "n1"
        )
        .is_err()
    );
    assert!(
        assign(
            &req(&[("f", "example.org/unknown")]),
            &inv,
            &BTreeSet::new(),
            "n1"
        )
        .is_err()
    );
}

#[test]
fn advertised_counts_zero_what_is_no_longer_permitted() {
    let inv = inventory();
    let before: BTreeSet<String> = ["example.org/gpu".into(), "example.org/old".into()].into();
    let a = advertised(&inv, &before);
    assert_eq!(a["example.org/gpu"], 2);
    assert_eq!(a["example.org/keys"], 1);
    assert_eq!(a["example.org/none"], 0);
    assert_eq!(a["example.org/old"], 0);
    assert_eq!(a.len(), 4);
}

#[test]
fn records_say_which_devices_are_held() {
    let t = tempfile::tempdir().unwrap();
    let (a, b) = (t.path().join("a"), t.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let inv = inventory();
    let assignments = assign(
        &req(&[("f", "example.org/keys")]),
        &inv,
        &BTreeSet::new(),
        "n",
    )
    .unwrap();
    write_record(
        &a,
        &Record {
            assignments,
            grants: vec![],
        },
    )
    .unwrap();
    let held = held_by([a.clone(), b.clone()]);
    assert_eq!(held, ["usb/1/2".to_string(), "usb/1/3".to_string()].into());
    release(&a);
    assert!(read_record(&a).is_none());
    assert!(held_by([a, b]).is_empty());
}

fn mknod(path: &Path) -> bool {
    std::process::Command::new("mknod")
        .arg(path)
        .args(["c", "1", "3"])
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn device_nodes_are_granted_to_the_vm_uid_and_given_back() {
    let t = tempfile::tempdir().unwrap();
    let node = t.path().join("vfio-41");
    if crate::isolation::effective_uid() != Some(0) || !mknod(&node) {
        eprintln!("skipped: needs root to make a device node");
        return;
    }
    let meta = |p: &Path| std::fs::symlink_metadata(p).unwrap();
    let (uid0, gid0) = (meta(&node).uid(), meta(&node).gid());
    let grants = grant(std::slice::from_ref(&node), 3_000_000_123).unwrap();
    assert_eq!(meta(&node).uid(), 3_000_000_123);
    assert_eq!(meta(&node).gid(), gid0, "the group stays");
    // Recorded in the VMI directory and given back when it goes.
    let dir = t.path().join("vmi");
    std::fs::create_dir_all(&dir).unwrap();
    write_record(
        &dir,
        &Record {
            assignments: vec![],
            grants,
        },
    )
    .unwrap();
    release(&dir);
    assert_eq!((meta(&node).uid(), meta(&node).gid()), (uid0, gid0));
}

#[test]
fn a_link_or_file_planted_at_a_device_path_is_never_granted() {
    // The attack: something at /dev/vfio/<group> that leads elsewhere (a link to a file the
    // VM's uid must not own, or a plain file). The grant refuses it and changes nothing.
    let t = tempfile::tempdir().unwrap();
    let secret = t.path().join("shadow");
    std::fs::write(&secret, "root only").unwrap();
    let before = std::fs::metadata(&secret).unwrap().uid();
    let link = t.path().join("vfio-7");
    std::os::unix::fs::symlink(&secret, &link).unwrap();
    let err = grant(std::slice::from_ref(&link), 3_000_000_124).unwrap_err();
    assert!(err.to_string().contains("not a character device"), "{err}");
    assert_eq!(std::fs::metadata(&secret).unwrap().uid(), before);
    let err = grant(std::slice::from_ref(&secret), 3_000_000_124).unwrap_err();
    assert!(err.to_string().contains("not a character device"));
    assert_eq!(std::fs::metadata(&secret).unwrap().uid(), before);
    // A failure half-way gives back what was granted before it.
    let node = t.path().join("usb-001-002");
    if crate::isolation::effective_uid() == Some(0) && mknod(&node) {
        let owner = std::fs::symlink_metadata(&node).unwrap().uid();
        let nodes: Vec<PathBuf> = vec![node.clone(), link];
        assert!(grant(&nodes, 3_000_000_124).is_err());
        assert_eq!(std::fs::symlink_metadata(&node).unwrap().uid(), owner);
    }
}
