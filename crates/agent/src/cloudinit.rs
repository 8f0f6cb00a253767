//! Data volumes presented to the guest as ISO 9660 images: cloud-init NoCloud (label `cidata`),
//! cloud-init ConfigDrive (label `config-2`), and ConfigMap / Secret / ServiceAccount disks.
//! The file layout is a pure function; [`write_iso`] runs `genisoimage`.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use base64::Engine;
use ferrovirt_api::kubevirt::volumes::CloudInitSource;

use crate::error::AgentError;

/// One ISO image to build: its volume label and files (path inside the image → content).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IsoImage {
    pub label: String,
    pub files: BTreeMap<String, Vec<u8>>,
}

/// Which cloud-init data source to emulate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloudInitKind {
    NoCloud,
    ConfigDrive,
}

/// Identity written into the meta-data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceIdentity {
    pub instance_id: String,
    pub hostname: String,
    pub uuid: String,
}

/// Secret data looked up for `secretRef` / `networkDataSecretRef` (key → bytes).
pub type SecretData = BTreeMap<String, Vec<u8>>;

fn decode_b64(field: &str, s: &str) -> Result<Vec<u8>, AgentError> {
    base64::engine::general_purpose::STANDARD
        .decode(s.trim())
        .map_err(|e| AgentError::invalid(field, format!("invalid base64: {e}")))
}

fn from_secret(
    field: &str,
    secret: Option<&SecretData>,
    keys: &[&str],
) -> Result<Option<Vec<u8>>, AgentError> {
    let Some(data) = secret else {
        return Err(AgentError::Reference(format!(
            "{field}: the referenced secret does not exist"
        )));
    };
    Ok(keys.iter().find_map(|k| data.get(*k).cloned()))
}

/// The (user-data, network-data) of a cloud-init volume, from inline text, base64, or secrets.
pub fn cloud_init_payload(
    field: &str,
    src: &CloudInitSource,
    user_secret: Option<&SecretData>,
    network_secret: Option<&SecretData>,
) -> Result<(Vec<u8>, Option<Vec<u8>>), AgentError> {
    let user = if let Some(u) = &src.user_data {
        u.clone().into_bytes()
    } else if let Some(b) = &src.user_data_base64 {
        decode_b64(&format!("{field}.userDataBase64"), b)?
    } else if src.secret_ref.is_some() {
        from_secret(
            &format!("{field}.secretRef"),
            user_secret,
            &["userdata", "userData"],
        )?
        .ok_or_else(|| {
            AgentError::Reference(format!(
                "{field}.secretRef: the secret has no userdata or userData key"
            ))
        })?
    } else {
        Vec::new()
    };
    let network = if let Some(n) = &src.network_data {
        Some(n.clone().into_bytes())
    } else if let Some(b) = &src.network_data_base64 {
        Some(decode_b64(&format!("{field}.networkDataBase64"), b)?)
    } else if src.network_data_secret_ref.is_some() {
        from_secret(
            &format!("{field}.networkDataSecretRef"),
            network_secret,
            &["networkdata", "networkData"],
        )?
    } else {
        None
    };
    Ok((user, network))
}

fn json_string(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

/// The files of a cloud-init data source image.
pub fn cloud_init_image(
    kind: CloudInitKind,
    id: &InstanceIdentity,
    user_data: Vec<u8>,
    network_data: Option<Vec<u8>>,
) -> IsoImage {
    let mut files = BTreeMap::new();
    match kind {
        CloudInitKind::NoCloud => {
            files.insert(
                "meta-data".into(),
                format!(
                    "instance-id: {}\nlocal-hostname: {}\n",
                    id.instance_id, id.hostname
                )
                .into_bytes(),
            );
            files.insert("user-data".into(), user_data);
            if let Some(n) = network_data {
                files.insert("network-config".into(), n);
            }
            IsoImage {
                label: "cidata".into(),
                files,
            }
        }
        CloudInitKind::ConfigDrive => {
            let meta = format!(
                "{{\"instance_id\":{},\"uuid\":{},\"hostname\":{},\"name\":{}}}\n",
                json_string(&id.instance_id),
                json_string(&id.uuid),
                json_string(&id.hostname),
                json_string(&id.hostname)
            );
            files.insert("openstack/latest/meta_data.json".into(), meta.into_bytes());
            files.insert("openstack/latest/user_data".into(), user_data);
            if let Some(n) = network_data {
                files.insert("openstack/latest/network_data.json".into(), n);
            }
            IsoImage {
                label: "config-2".into(),
                files,
            }
        }
    }
}

/// An image holding one file per key (ConfigMap, Secret, ServiceAccount disks).
pub fn key_files_image(label: &str, data: &BTreeMap<String, Vec<u8>>) -> IsoImage {
    IsoImage {
        label: label.chars().take(32).collect(),
        files: data.clone(),
    }
}

fn safe_relative(path: &str) -> bool {
    !path.is_empty()
        && !path.starts_with('/')
        && path
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

/// Writes `img` as an ISO 9660 (Joliet + Rock Ridge) file at `out`. The files (Secret data
/// among them) are staged in a fresh directory with a random name next to `staging` (created,
/// never reused: mode 0700, files create-new 0600) and the image is built under a random
/// temporary name, then renamed to `out`; both are removed on every path.
pub fn write_iso(img: &IsoImage, staging: &Path, out: &Path) -> Result<(), AgentError> {
    use std::os::unix::fs::DirBuilderExt;
    let _ = std::fs::remove_dir_all(staging);
    let random = |p: &Path| {
        let mut name = p.file_name().unwrap_or_default().to_os_string();
        name.push(format!(".{:016x}", fastrand::u64(..)));
        p.with_file_name(name)
    };
    let dir = random(staging);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|e| AgentError::io(&dir, e))?;
    let tmp_out = random(out);
    let result = build_iso(img, &dir, &tmp_out)
        .and_then(|()| std::fs::rename(&tmp_out, out).map_err(|e| AgentError::io(out, e)));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&tmp_out);
    result
}

fn build_iso(img: &IsoImage, staging: &Path, out: &Path) -> Result<(), AgentError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    for (name, content) in &img.files {
        if !safe_relative(name) {
            return Err(AgentError::invalid(
                "data",
                format!("key {name:?} is not a usable file name"),
            ));
        }
        let p = staging.join(name);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).map_err(|e| AgentError::io(parent, e))?;
        }
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&p)
            .and_then(|mut f| f.write_all(content))
            .map_err(|e| AgentError::io(&p, e))?;
    }
    let output = Command::new("genisoimage")
        .args(["-quiet", "-input-charset", "utf-8", "-J", "-R", "-V"])
        .arg(&img.label)
        .arg("-o")
        .arg(out)
        .arg(staging)
        .output()
        .map_err(|e| AgentError::Tool {
            tool: "genisoimage".into(),
            message: e.to_string(),
        })?;
    if !output.status.success() {
        return Err(AgentError::Tool {
            tool: "genisoimage".into(),
            message: String::from_utf8_lossy(&output.stderr).into_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> InstanceIdentity {
        InstanceIdentity {
            instance_id: "uid-1".into(),
            hostname: "vm1".into(),
            uuid: "u-u-i-d".into(),
        }
    }

    #[test]
    fn nocloud_layout() {
        let img = cloud_init_image(CloudInitKind::NoCloud, &id(), b"#!/bin/sh\n".to_vec(), None);
        assert_eq!(img.label, "cidata");
        assert_eq!(
            String::from_utf8_lossy(&img.files["meta-data"]),
            "instance-id: uid-1\nlocal-hostname: vm1\n"
        );
        assert_eq!(img.files["user-data"], b"#!/bin/sh\n");
        assert!(!img.files.contains_key("network-config"));
    }

    #[test]
    fn configdrive_layout() {
        let img = cloud_init_image(
            CloudInitKind::ConfigDrive,
            &id(),
            b"x".to_vec(),
            Some(b"{}".to_vec()),
        );
        assert_eq!(img.label, "config-2");
        let meta: serde_json::Value =
            serde_json::from_slice(&img.files["openstack/latest/meta_data.json"]).unwrap();
        assert_eq!(meta["hostname"], "vm1");
        assert_eq!(meta["uuid"], "u-u-i-d");
        assert!(img.files.contains_key("openstack/latest/network_data.json"));
    }

    #[test]
    fn payload_sources() {
        let src = CloudInitSource {
            user_data_base64: Some("IyEvYmluL3NoCg==".into()),
            ..Default::default()
        };
        let (u, n) = cloud_init_payload("f", &src, None, None).unwrap();
        assert_eq!(u, b"#!/bin/sh\n");
        assert!(n.is_none());

        let src = CloudInitSource {
            user_data_base64: Some("%%%".into()),
            ..Default::default()
        };
        let e = cloud_init_payload("spec.volumes[1].cloudInitNoCloud", &src, None, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("spec.volumes[1].cloudInitNoCloud.userDataBase64"),
            "{e}"
        );

        let src = CloudInitSource {
            secret_ref: Some(Default::default()),
            ..Default::default()
        };
        let e = cloud_init_payload("v", &src, None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("v.secretRef"), "{e}");
        let mut sec = SecretData::new();
        sec.insert("userdata".into(), b"hi".to_vec());
        let (u, _) = cloud_init_payload("v", &src, Some(&sec), None).unwrap();
        assert_eq!(u, b"hi");
    }

    #[test]
    fn refuses_escaping_names() {
        assert!(safe_relative("a/b"));
        assert!(!safe_relative("../x"));
        assert!(!safe_relative("/etc/passwd"));
        assert!(!safe_relative("a//b"));
    }
}
