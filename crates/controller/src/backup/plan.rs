//! Pure decisions of the backup controller: the repository target of a BackupTarget, the
//! backup's name on the target, what a VM references (claims, Secrets, ConfigMaps) and how
//! objects are stripped for the manifest, and the status figures.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use serde_json::{Value, json};

use ferrovirt_api::backup::{BackupSpec, BackupTargetSpec, BackupVolumeStatus};
use ferrovirt_backup::{DiskEntry, Target};

/// The repository target of a BackupTarget; `creds` is the data of its credentials Secret
/// (S3 only). An error names the missing or bad field.
pub fn target_of(
    spec: &BackupTargetSpec,
    creds: Option<&BTreeMap<String, ByteString>>,
) -> Result<Target, String> {
    let creds: Option<BTreeMap<String, Vec<u8>>> =
        creds.map(|c| c.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect());
    ferrovirt_backup::target::from_spec(spec, creds.as_ref())
}

/// The backup's name on the target: `spec.backupName`, else `<namespace>-<name>`.
pub fn backup_name(ns: &str, name: &str, spec: &BackupSpec) -> String {
    spec.backup_name
        .clone()
        .unwrap_or_else(|| format!("{ns}-{name}"))
}

/// What a VM's volumes reference, by name, in the VM's namespace.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Refs {
    /// Claims (`persistentVolumeClaim` and `dataVolume` volumes), in volume order.
    pub claims: Vec<String>,
    /// DataVolumes named by `dataVolume` volumes.
    pub data_volumes: Vec<String>,
    pub secrets: Vec<String>,
    pub config_maps: Vec<String>,
}

fn push(v: &mut Vec<String>, s: Option<&str>) {
    if let Some(s) = s.filter(|s| !s.is_empty())
        && !v.iter().any(|x| x == s)
    {
        v.push(s.to_string());
    }
}

/// The objects the VM (as JSON) references through `spec.template.spec.volumes`: claims and
/// DataVolumes, cloud-init user/network data Secrets, `secret` and `configMap` volumes.
pub fn references(vm: &Value) -> Refs {
    let mut r = Refs::default();
    let vols = vm["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for v in &vols {
        push(
            &mut r.claims,
            v["persistentVolumeClaim"]["claimName"].as_str(),
        );
        push(&mut r.claims, v["dataVolume"]["name"].as_str());
        push(&mut r.data_volumes, v["dataVolume"]["name"].as_str());
        for ci in ["cloudInitNoCloud", "cloudInitConfigDrive"] {
            push(&mut r.secrets, v[ci]["secretRef"]["name"].as_str());
            push(
                &mut r.secrets,
                v[ci]["networkDataSecretRef"]["name"].as_str(),
            );
        }
        push(&mut r.secrets, v["secret"]["secretName"].as_str());
        push(&mut r.config_maps, v["configMap"]["name"].as_str());
    }
    r
}

/// An object as the manifest keeps it: no status, no server-set metadata.
pub fn strip(mut obj: Value) -> Value {
    if let Some(o) = obj.as_object_mut() {
        o.remove("status");
    }
    if let Some(md) = obj["metadata"].as_object_mut() {
        for k in [
            "uid",
            "resourceVersion",
            "generation",
            "creationTimestamp",
            "managedFields",
            "ownerReferences",
            "finalizers",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ] {
            md.remove(k);
        }
        if let Some(a) = md.get_mut("annotations").and_then(Value::as_object_mut) {
            a.remove("kubectl.kubernetes.io/last-applied-configuration");
        }
    }
    obj
}

/// The disk name of a VM's claim in the backup: `<vm>.<claim>` (unique across the backup's
/// VMs of one namespace; a valid repository disk name).
pub fn disk_name(vm: &str, claim: &str) -> String {
    format!("{vm}.{claim}")
}

/// `42%` of `done` out of `total` bytes (100% when there is nothing to read).
pub fn percent(done: u64, total: u64) -> String {
    if total == 0 {
        return "100%".into();
    }
    format!("{}%", (done.min(total) * 100 / total))
}

/// A volume's status line.
pub fn volume_status(vm: &str, claim: &str, d: &DiskEntry, mode: &ReadMode) -> BackupVolumeStatus {
    let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let (incremental, base_backup, full_read_reason) = match mode {
        ReadMode::Incremental { base } => (true, Some(base.clone()), None),
        ReadMode::Full { reason } => (false, None, Some(reason.clone())),
    };
    BackupVolumeStatus {
        virtual_machine: vm.to_string(),
        name: claim.to_string(),
        size_bytes: i(d.size),
        bytes_read: i(d.stats.bytes_read),
        bytes_new: i(d.stats.bytes_new),
        bytes_deduplicated: i(d.stats.bytes_deduplicated),
        bytes_zero: i(d.stats.bytes_zero),
        bytes_uploaded: Some(i(d.stats.bytes_uploaded)),
        bytes_reused: Some(i(d.stats.bytes_reused)),
        incremental: Some(incremental),
        base_backup,
        full_read_reason,
    }
}

/// How a volume was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadMode {
    /// Only the chunks changed since backup `base`'s point.
    Incremental { base: String },
    /// Whole, and why.
    Full { reason: String },
}

/// Whether opening a volume failed only because its chain was changing under the read: another
/// process holds one of its images (QEMU's image lock: a VM stopping, a layer merge running)
/// or a merge just deleted a layer the recorded chain named a moment before. Worth trying again
/// shortly (the chain is read again each time).
pub fn volume_busy(error: &str) -> bool {
    error.contains("Failed to get shared \"write\" lock")
        || error.contains("Failed to get \"write\" lock")
        || error.contains("Failed to get \"consistent read\" lock")
        || (error.contains("Could not open") && error.contains("No such file or directory"))
}

/// The bytes of the `chunk`-sized chunks `chunks` of a `size`-byte disk (the last one may be
/// shorter; indices past the end count nothing).
pub fn chunk_bytes(size: u64, chunk: u64, chunks: &[u64]) -> u64 {
    chunks
        .iter()
        .map(|&i| size.saturating_sub(i.saturating_mul(chunk)).min(chunk))
        .sum()
}

/// A condition as JSON (KubeVirt's shape).
pub fn condition(type_: &str, ok: bool, reason: &str, message: &str, now: &str) -> Value {
    json!({
        "type": type_,
        "status": if ok { "True" } else { "False" },
        "reason": reason,
        "message": message,
        "lastTransitionTime": now,
        "lastProbeTime": null,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_status_says_how_the_volume_was_read_and_changed_bytes_add_up() {
        let d = DiskEntry {
            name: "vm.data".into(),
            size: 10,
            stats: ferrovirt_backup::Stats {
                bytes_read: 4,
                bytes_reused: 6,
                bytes_uploaded: 3,
                ..Default::default()
            },
        };
        let inc = volume_status(
            "vm",
            "data",
            &d,
            &ReadMode::Incremental { base: "b1".into() },
        );
        assert_eq!(inc.incremental, Some(true));
        assert_eq!(inc.base_backup.as_deref(), Some("b1"));
        assert_eq!((inc.bytes_reused, inc.bytes_uploaded), (Some(6), Some(3)));
        assert!(inc.full_read_reason.is_none());
        let full = volume_status(
            "vm",
            "data",
            &d,
            &ReadMode::Full {
                reason: "no point".into(),
            },
        );
        assert_eq!(full.incremental, Some(false));
        assert_eq!(full.full_read_reason.as_deref(), Some("no point"));
        // 3 chunks of 4 over a 10-byte disk: 4 + 2 (the short last one).
        assert_eq!(chunk_bytes(10, 4, &[0, 2]), 6);
        assert_eq!(chunk_bytes(10, 4, &[]), 0);
        assert_eq!(chunk_bytes(10, 4, &[7]), 0);
        let locked = "qemu-nbd failed: Could not open backing file: Failed to get shared \"write\" \
                      lock\nIs another process using the image [/v/layer-000002.qcow2]?";
        assert!(volume_busy(locked));
        assert!(!volume_busy(
            "layer \"x\" of the earlier snapshot is not below"
        ));
        assert!(volume_busy(
            "Could not open backing file: Could not open '/v/layer-000001.qcow2': No such file or directory"
        ));
    }
    use ferrovirt_api::backup::{
        ACCESS_KEY_ID, FilesystemLocation, S3Location, SECRET_ACCESS_KEY, SecretReference,
    };

    #[test]
    fn targets_from_specs_and_secrets() {
        let fs = BackupTargetSpec {
            filesystem: Some(FilesystemLocation {
                path: "/mnt/b".into(),
                prefix: Some("x".into()),
            }),
            ..Default::default()
        };
        assert_eq!(
            target_of(&fs, None).unwrap(),
            Target::Filesystem {
                path: "/mnt/b".into(),
                prefix: "x".into()
            }
        );
        let s3 = BackupTargetSpec {
            s3: Some(S3Location {
                endpoint: Some("http://127.0.0.1:9".into()),
                bucket: "b".into(),
                credentials_secret_ref: SecretReference {
                    name: "c".into(),
                    namespace: "ns".into(),
                },
                path_style: true,
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut creds = BTreeMap::new();
        creds.insert(ACCESS_KEY_ID.to_string(), ByteString(b"AK\n".to_vec()));
        let err = target_of(&s3, Some(&creds)).unwrap_err();
        assert!(
            err.contains("secretAccessKey") && err.contains("ns/c"),
            "{err}"
        );
        creds.insert(SECRET_ACCESS_KEY.to_string(), ByteString(b"SK".to_vec()));
        let Target::S3 { s3: t, .. } = target_of(&s3, Some(&creds)).unwrap() else {
            panic!()
        };
        assert_eq!((t.access_key_id.as_str(), t.path_style), ("AK", true));
    }

    #[test]
    fn references_and_stripping() {
        let vm = json!({
            "metadata": {"name": "vm1", "uid": "u", "resourceVersion": "3",
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}", "a": "b"}},
            "status": {"ready": true},
            "spec": {"template": {"spec": {"volumes": [
                {"name": "root", "dataVolume": {"name": "vm1-root"}},
                {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
                {"name": "ci", "cloudInitNoCloud": {"secretRef": {"name": "ud"},
                    "networkDataSecretRef": {"name": "nd"}}},
                {"name": "s", "secret": {"secretName": "ud"}},
                {"name": "cm", "configMap": {"name": "conf"}},
                {"name": "cd", "containerDisk": {"image": "x"}}
            ]}}}
        });
        let r = references(&vm);
        assert_eq!(r.claims, ["vm1-root", "data"]);
        assert_eq!(r.data_volumes, ["vm1-root"]);
        assert_eq!(r.secrets, ["ud", "nd"]);
        assert_eq!(r.config_maps, ["conf"]);
        let s = strip(vm);
        assert!(s.get("status").is_none());
        assert!(s["metadata"].get("uid").is_none());
        assert_eq!(s["metadata"]["annotations"], json!({"a": "b"}));
    }

    #[test]
    fn names_and_progress() {
        let spec = BackupSpec::default();
        assert_eq!(backup_name("default", "b1", &spec), "default-b1");
        assert_eq!(disk_name("vm1", "vm1-root"), "vm1.vm1-root");
        assert_eq!(percent(1, 4), "25%");
        assert_eq!(percent(5, 4), "100%");
        assert_eq!(percent(0, 0), "100%");
    }
}
