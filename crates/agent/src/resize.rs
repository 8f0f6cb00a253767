//! Online disk growth (KubeVirt's ExpandDisks): when the volume behind a running VMI's
//! PersistentVolumeClaim or DataVolume disk grew (claim expansion grows `disk.img` or the loop
//! device), the agent asks the VMI's launcher to grow the disk (`ResizeDisk`, QMP
//! `block_resize`), so the guest sees the new size without a restart.
//!
//! Pure parts: [`claim_disks`] (which disks of the launch spec are claim-backed, writable and
//! raw) and [`plan`] (which of them to resize, given their measured sizes and the sizes last
//! sent). [`measure`] reads a file's or block device's size.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Seek, SeekFrom};
use std::path::Path;

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_launcher::spec::{DiskFormat, LaunchSpec};

/// The launch-spec disks (id, host path) that can grow online: those whose volume is a
/// `persistentVolumeClaim` or `dataVolume` (not an ephemeral overlay), writable, raw, and
/// outside `vmi_dir` (the VMI's own files are never claims).
pub fn claim_disks(
    vmi: &VirtualMachineInstance,
    spec: &LaunchSpec,
    vmi_dir: &Path,
) -> Vec<(String, std::path::PathBuf)> {
    let ids: BTreeSet<String> = vmi
        .spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter(|v| v.persistent_volume_claim.is_some() || v.data_volume.is_some())
        .map(|v| crate::mapping::disk_id(&v.name))
        .collect();
    spec.disks
        .iter()
        .filter(|d| {
            ids.contains(&d.id)
                && !d.is_readonly()
                && d.format == DiskFormat::Raw
                && !d.path.starts_with(vmi_dir)
        })
        .map(|d| (d.id.clone(), d.path.clone()))
        .collect()
}

/// The disks to ask the launcher to resize: every measured disk larger than the size last
/// sent for it, and every disk not sent yet (the launcher ignores sizes that are not larger
/// than the disk, so after an agent restart this is a harmless check). Never a smaller size.
pub fn plan(measured: &[(String, u64)], last_sent: &BTreeMap<String, u64>) -> Vec<(String, u64)> {
    measured
        .iter()
        .filter(|(id, bytes)| last_sent.get(id).is_none_or(|last| bytes > last))
        .cloned()
        .collect()
}

/// The size of a file or block device (seeking to its end works for both).
pub fn measure(path: &Path) -> std::io::Result<u64> {
    std::fs::File::open(path)?.seek(SeekFrom::End(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vmi() -> VirtualMachineInstance {
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "v", "namespace": "default"},
            "spec": {
                "domain": {"devices": {"disks": [
                    {"name": "root"}, {"name": "data.1"}, {"name": "eph"}, {"name": "ro"},
                    {"name": "scratch"}, {"name": "q"},
                ]}},
                "volumes": [
                    {"name": "root", "persistentVolumeClaim": {"claimName": "c"}},
                    {"name": "data.1", "dataVolume": {"name": "dv"}},
                    {"name": "eph", "ephemeral": {"persistentVolumeClaim": {"claimName": "c"}}},
                    {"name": "ro", "persistentVolumeClaim": {"claimName": "r", "readOnly": true}},
                    {"name": "scratch", "emptyDisk": {"capacity": "1Mi"}},
                    {"name": "q", "persistentVolumeClaim": {"claimName": "q"}},
                ],
            },
        }))
        .unwrap()
    }

    fn spec() -> LaunchSpec {
        let mut s = LaunchSpec::new("v", "u", 64, "/tmp/q".into());
        let disk = |id: &str, path: &str, format: &str, readonly: bool| {
            serde_json::from_value(json!({
                "id": id, "path": path, "format": format, "readonly": readonly,
            }))
            .unwrap()
        };
        s.disks = vec![
            disk("disk-root", "/vol/pvc-1/disk.img", "raw", false),
            disk("disk-data-1", "/dev/loop3", "raw", false),
            disk("disk-eph", "/vmis/u/ephemeral-eph.qcow2", "qcow2", false),
            disk("disk-ro", "/vol/pvc-2/disk.img", "raw", true),
            disk(
                "disk-scratch",
                "/vmis/u/empty-scratch.qcow2",
                "qcow2",
                false,
            ),
            disk("disk-q", "/vol/pvc-3/disk.img", "qcow2", false),
        ];
        s
    }

    #[test]
    fn only_writable_raw_claim_disks_grow() {
        let got = claim_disks(&vmi(), &spec(), Path::new("/vmis/u"));
        let ids: Vec<&str> = got.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["disk-root", "disk-data-1"]);
        assert_eq!(got[1].1, Path::new("/dev/loop3"));
    }

    #[test]
    fn plans_growth_only() {
        let mib = 1u64 << 20;
        let mut last = BTreeMap::new();
        let measured = vec![
            ("disk-a".to_string(), 64 * mib),
            ("disk-b".to_string(), 8 * mib),
        ];
        // First sight: every disk is checked once.
        assert_eq!(plan(&measured, &last), measured);
        last.insert("disk-a".to_string(), 64 * mib);
        last.insert("disk-b".to_string(), 8 * mib);
        assert!(plan(&measured, &last).is_empty());
        // Grown: resize; smaller (never happens for claims, but still): nothing.
        let measured = vec![
            ("disk-a".to_string(), 96 * mib),
            ("disk-b".to_string(), 4 * mib),
        ];
        assert_eq!(plan(&measured, &last), [("disk-a".to_string(), 96 * mib)]);
    }

    #[test]
    fn measures_files() {
        let dir = std::env::temp_dir().join(format!("fv-resize-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("disk.img");
        std::fs::File::create(&f).unwrap().set_len(3 << 20).unwrap();
        assert_eq!(measure(&f).unwrap(), 3 << 20);
        assert!(measure(&dir.join("missing")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
