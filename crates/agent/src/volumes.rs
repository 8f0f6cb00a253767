//! VMI volumes on the node. [`plan`] is the pure part: from the VMI and the objects it
//! references (PVC → PV path, Secrets, ConfigMaps) it decides what to use or create for each
//! volume. [`execute`] does it (qemu-img, genisoimage, sparse files) and returns the prepared
//! volumes the QEMU mapping needs.
//!
//! Formats are recorded, never guessed: a claim's or host disk's image is raw (what our
//! storage makes, as KubeVirt treats `disk.img`), an overlay is qcow2 over a backing whose
//! format is known (a raw claim, or the containerDisk cache's recorded format), and the
//! whole chain goes to QEMU explicitly. Nothing here reads a guest-writable image's header.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_launcher::spec::{BackingImage, DiskFormat, DiskSource};

use crate::cloudinit::{self, CloudInitKind, InstanceIdentity, IsoImage, SecretData};
use crate::error::AgentError;
use crate::mapping::PreparedVolume;

/// A bound claim as the agent resolved it: the host path of its PersistentVolume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimInfo {
    /// `spec.hostPath.path` or `spec.local.path` of the bound PV: a directory holding
    /// `disk.img` (Filesystem mode), an image file, or a block device.
    pub path: PathBuf,
    pub read_only: bool,
    /// Made by ferrovirt's own provisioners ([`crate::hostpath::made_by_us`]): exempt from the
    /// allowed-roots and data-dir checks other PV host paths get.
    pub ours: bool,
}

/// Referenced objects, looked up by the agent before planning.
#[derive(Debug, Clone, Default)]
pub struct ResolvedRefs {
    /// By claim name (a DataVolume's claim has the DataVolume's name).
    pub claims: BTreeMap<String, ClaimInfo>,
    pub secrets: BTreeMap<String, SecretData>,
    pub config_maps: BTreeMap<String, BTreeMap<String, Vec<u8>>>,
    /// containerDisk volumes: the cached (read-only) disk and the format recorded when it
    /// was pulled, by volume name ([`crate::containerdisk`]).
    pub container_disks: BTreeMap<String, (PathBuf, DiskFormat)>,
    /// The claims' `spec.accessModes`, by claim name (whether a disk is usable from another
    /// node, [`crate::fencing`]).
    pub claim_access_modes: BTreeMap<String, Vec<String>>,
    /// serviceAccount volumes: a token bound to the VMI, by ServiceAccount name (none for a
    /// ServiceAccount that does not exist).
    pub service_account_tokens: BTreeMap<String, String>,
    /// The PEM of the CA that signed the API server's certificate (a serviceAccount disk's
    /// `ca.crt`; none when the agent was not told it).
    pub api_ca_pem: Option<String>,
}

/// What to do for one volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeAction {
    /// Use an existing raw image file or block device (a claim's `disk.img`, a host disk).
    UseExisting {
        name: String,
        path: PathBuf,
        readonly: bool,
    },
    /// Create a sparse raw file of `size` bytes when `path` does not exist (hostDisk
    /// DiskOrCreate), then use it.
    CreateRawIfMissing {
        name: String,
        path: PathBuf,
        size: u64,
    },
    /// Create a fresh sparse qcow2 of `size` bytes (emptyDisk).
    CreateQcow2 {
        name: String,
        path: PathBuf,
        size: u64,
    },
    /// Create a qcow2 overlay over `backing` (ephemeral, containerDisk): writes go to the
    /// overlay. `backing_format` is the backing's recorded format.
    CreateOverlay {
        name: String,
        path: PathBuf,
        backing: PathBuf,
        backing_format: DiskFormat,
    },
    /// Build an ISO image with the given files (cloud-init, configMap, secret, serviceAccount).
    BuildIso {
        name: String,
        path: PathBuf,
        image: IsoImage,
    },
}

impl VolumeAction {
    pub fn name(&self) -> &str {
        match self {
            VolumeAction::UseExisting { name, .. }
            | VolumeAction::CreateRawIfMissing { name, .. }
            | VolumeAction::CreateQcow2 { name, .. }
            | VolumeAction::CreateOverlay { name, .. }
            | VolumeAction::BuildIso { name, .. } => name,
        }
    }
}

pub(crate) fn quantity_bytes(field: &str, q: &str) -> Result<u64, AgentError> {
    let v =
        ferrovirt_api::quantity::bytes(q).map_err(|e| AgentError::invalid(field, e.to_string()))?;
    if !(1..=1u64 << 50).contains(&v) {
        return Err(AgentError::invalid(field, format!("{q} is out of range")));
    }
    Ok(v)
}

fn file_name(volume: &str) -> String {
    volume
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn claim<'a>(
    refs: &'a ResolvedRefs,
    field: &str,
    claim: &str,
) -> Result<&'a ClaimInfo, AgentError> {
    refs.claims.get(claim).ok_or_else(|| {
        AgentError::Reference(format!(
            "{field}: PersistentVolumeClaim {claim:?} is not bound to a volume on this node"
        ))
    })
}

/// The data of a referenced ConfigMap or Secret: a missing optional one is empty, a missing
/// required one the error `missing()` describes.
fn key_files(
    found: Option<&BTreeMap<String, Vec<u8>>>,
    optional: Option<bool>,
    missing: impl FnOnce() -> String,
) -> Result<BTreeMap<String, Vec<u8>>, AgentError> {
    match found {
        Some(d) => Ok(d.clone()),
        None if optional == Some(true) => Ok(BTreeMap::new()),
        None => Err(AgentError::Reference(missing())),
    }
}

/// Decides what to do for every volume of `vmi`. Files go under `vmi_dir`.
pub fn plan(
    vmi: &VirtualMachineInstance,
    refs: &ResolvedRefs,
    vmi_dir: &Path,
) -> Result<Vec<VolumeAction>, AgentError> {
    let spec = vmi
        .spec
        .as_ref()
        .ok_or_else(|| AgentError::invalid("spec", "a VMI needs a spec"))?;
    let name = vmi.metadata.name.clone().unwrap_or_default();
    let identity = InstanceIdentity {
        instance_id: vmi.metadata.uid.clone().unwrap_or_else(|| name.clone()),
        hostname: spec.hostname.clone().unwrap_or_else(|| name.clone()),
        uuid: spec
            .domain
            .firmware
            .as_ref()
            .and_then(|f| f.uuid.clone())
            .unwrap_or_default(),
    };
    let mut actions = Vec::new();
    for (i, v) in spec.volumes.iter().flatten().enumerate() {
        let field = format!("spec.volumes[{i}]");
        let n = v.name.clone();
        let fname = file_name(&n);
        let action = if let Some(pvc) = &v.persistent_volume_claim {
            let c = claim(
                refs,
                &format!("{field}.persistentVolumeClaim.claimName"),
                &pvc.claim_name,
            )?;
            VolumeAction::UseExisting {
                name: n,
                path: c.path.clone(),
                readonly: pvc.read_only.unwrap_or(false) || c.read_only,
            }
        } else if let Some(dv) = &v.data_volume {
            let c = claim(refs, &format!("{field}.dataVolume.name"), &dv.name)?;
            VolumeAction::UseExisting {
                name: n,
                path: c.path.clone(),
                readonly: c.read_only,
            }
        } else if let Some(eph) = &v.ephemeral {
            let claim_name = eph
                .persistent_volume_claim
                .as_ref()
                .map(|c| c.claim_name.as_str())
                .ok_or_else(|| {
                    AgentError::invalid(
                        format!("{field}.ephemeral.persistentVolumeClaim"),
                        "an ephemeral volume needs a persistentVolumeClaim",
                    )
                })?;
            let c = claim(
                refs,
                &format!("{field}.ephemeral.persistentVolumeClaim.claimName"),
                claim_name,
            )?;
            VolumeAction::CreateOverlay {
                name: n,
                path: vmi_dir.join(format!("ephemeral-{fname}.qcow2")),
                backing: c.path.clone(),
                backing_format: DiskFormat::Raw,
            }
        } else if let Some(e) = &v.empty_disk {
            VolumeAction::CreateQcow2 {
                name: n,
                path: vmi_dir.join(format!("empty-{fname}.qcow2")),
                size: quantity_bytes(&format!("{field}.emptyDisk.capacity"), &e.capacity.0)?,
            }
        } else if let Some(h) = &v.host_disk {
            let path = PathBuf::from(&h.path);
            if !path.is_absolute() {
                return Err(AgentError::invalid(
                    format!("{field}.hostDisk.path"),
                    "must be an absolute path",
                ));
            }
            match h.type_.as_str() {
                "Disk" => VolumeAction::UseExisting {
                    name: n,
                    path,
                    readonly: false,
                },
                "DiskOrCreate" => {
                    let cap = h.capacity.as_ref().ok_or_else(|| {
                        AgentError::invalid(
                            format!("{field}.hostDisk.capacity"),
                            "DiskOrCreate needs a capacity",
                        )
                    })?;
                    VolumeAction::CreateRawIfMissing {
                        name: n,
                        path,
                        size: quantity_bytes(&format!("{field}.hostDisk.capacity"), &cap.0)?,
                    }
                }
                other => {
                    return Err(AgentError::invalid(
                        format!("{field}.hostDisk.type"),
                        format!("unsupported type {other:?} (Disk, DiskOrCreate)"),
                    ));
                }
            }
        } else if let Some(ci) = v
            .cloud_init_no_cloud
            .as_ref()
            .map(|c| (CloudInitKind::NoCloud, c, "cloudInitNoCloud"))
            .or_else(|| {
                v.cloud_init_config_drive
                    .as_ref()
                    .map(|c| (CloudInitKind::ConfigDrive, c, "cloudInitConfigDrive"))
            })
        {
            let (kind, src, key) = ci;
            let user_secret = src
                .secret_ref
                .as_ref()
                .map(|r| &r.name)
                .and_then(|s| refs.secrets.get(s));
            let net_secret = src
                .network_data_secret_ref
                .as_ref()
                .map(|r| &r.name)
                .and_then(|s| refs.secrets.get(s));
            let (user, network) = cloudinit::cloud_init_payload(
                &format!("{field}.{key}"),
                src,
                user_secret,
                net_secret,
            )?;
            VolumeAction::BuildIso {
                name: n,
                path: vmi_dir.join(format!("{fname}.iso")),
                image: cloudinit::cloud_init_image(kind, &identity, user, network),
            }
        } else if let Some(cm) = &v.config_map {
            let cm_name = cm.name.clone().unwrap_or_default();
            let data = key_files(refs.config_maps.get(&cm_name), cm.optional, || {
                format!("{field}.configMap.name: ConfigMap {cm_name:?} not found")
            })?;
            let label = cm.volume_label.clone().unwrap_or_else(|| "cfgdata".into());
            VolumeAction::BuildIso {
                name: n,
                path: vmi_dir.join(format!("{fname}.iso")),
                image: cloudinit::key_files_image(&label, &data),
            }
        } else if let Some(s) = &v.secret {
            let s_name = s.secret_name.clone().unwrap_or_default();
            let data = key_files(refs.secrets.get(&s_name), s.optional, || {
                format!("{field}.secret.secretName: Secret {s_name:?} not found")
            })?;
            let label = s.volume_label.clone().unwrap_or_else(|| "secdata".into());
            VolumeAction::BuildIso {
                name: n,
                path: vmi_dir.join(format!("{fname}.iso")),
                image: cloudinit::key_files_image(&label, &data),
            }
        } else if let Some(sa) = &v.service_account {
            VolumeAction::BuildIso {
                name: n,
                path: vmi_dir.join(format!("{fname}.iso")),
                image: cloudinit::key_files_image(
                    SERVICE_ACCOUNT_LABEL,
                    &service_account_files(vmi, &field, sa, refs)?,
                ),
            }
        } else if v.container_disk.is_some() {
            // An ephemeral overlay on the node's cached copy of the image's disk.
            let (base, format) = refs.container_disks.get(&n).ok_or_else(|| {
                AgentError::Reference(format!(
                    "{field}.containerDisk: the image of volume {n:?} has not been pulled"
                ))
            })?;
            VolumeAction::CreateOverlay {
                name: n,
                path: vmi_dir.join(format!("containerdisk-{fname}.qcow2")),
                backing: base.clone(),
                backing_format: *format,
            }
        } else {
            return Err(AgentError::unsupported(
                field,
                format!(
                    "volume {:?} has a source this node does not support",
                    v.name
                ),
            ));
        };
        actions.push(action);
    }
    Ok(actions)
}

/// The volume label of a serviceAccount disk.
pub const SERVICE_ACCOUNT_LABEL: &str = "sadata";

/// The files of a serviceAccount disk (KubeVirt's, from the launcher Pod's token volume):
/// `namespace`, `token` (bound to the VMI) and `ca.crt` (when known). A ServiceAccount that has
/// no token (it does not exist) fails the VMI naming the field.
fn service_account_files(
    vmi: &VirtualMachineInstance,
    field: &str,
    sa: &ferrovirt_api::kubevirt::volumes::ServiceAccountVolumeSource,
    refs: &ResolvedRefs,
) -> Result<BTreeMap<String, Vec<u8>>, AgentError> {
    let name = sa.service_account_name.clone().unwrap_or_default();
    let field = format!("{field}.serviceAccount.serviceAccountName");
    if name.is_empty() {
        return Err(AgentError::invalid(field, "Required value"));
    }
    let token = refs.service_account_tokens.get(&name).ok_or_else(|| {
        AgentError::Reference(format!("{field}: ServiceAccount {name:?} not found"))
    })?;
    let mut data = BTreeMap::new();
    data.insert(
        "namespace".to_string(),
        vmi.metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into())
            .into_bytes(),
    );
    data.insert("token".to_string(), token.clone().into_bytes());
    if let Some(ca) = &refs.api_ca_pem {
        data.insert("ca.crt".to_string(), ca.clone().into_bytes());
    }
    Ok(data)
}

/// Turns a PV path into the image to open: `disk.img` inside a directory, the loop device of
/// a Block-mode volume directory (attached again if it is missing, e.g. after a reboot),
/// else the path.
fn resolve_image(path: &Path) -> Result<(PathBuf, DiskSource), AgentError> {
    use std::os::unix::fs::FileTypeExt;
    let meta = std::fs::metadata(path).map_err(|e| AgentError::io(path, e))?;
    if meta.is_dir() && ferrovirt_storage::block::is_block_volume(path) {
        let dev = ferrovirt_storage::block::device_of(path).map_err(|e| AgentError::Tool {
            tool: "losetup".into(),
            message: format!("{}: {e}", path.display()),
        })?;
        Ok((dev, DiskSource::Block))
    } else if meta.is_dir() {
        let img = path.join("disk.img");
        if !img.exists() {
            return Err(AgentError::Reference(format!(
                "volume directory {} holds no disk.img",
                path.display()
            )));
        }
        Ok((img, DiskSource::File))
    } else if meta.file_type().is_block_device() {
        Ok((path.to_path_buf(), DiskSource::Block))
    } else {
        Ok((path.to_path_buf(), DiskSource::File))
    }
}

/// A claim's volume directory that has snapshots (`chain.json`, docs/snapshots.md) is its
/// qcow2 top layer over the recorded chain; `None` for a plain raw volume (or no directory).
fn snapshot_chain(path: &Path) -> Result<Option<PreparedVolume>, AgentError> {
    use ferrovirt_storage::snapshot::{self, LayerFormat};
    if !path.is_dir() || !path.join(snapshot::CHAIN_FILE).exists() {
        return Ok(None);
    }
    let chain = snapshot::disk_chain(path).map_err(|e| AgentError::Reference(e.to_string()))?;
    let format = |f: LayerFormat| match f {
        LayerFormat::Raw => DiskFormat::Raw,
        LayerFormat::Qcow2 => DiskFormat::Qcow2,
    };
    let mut layers = chain.into_iter();
    let Some((top, top_format)) = layers.next() else {
        return Ok(None);
    };
    Ok(Some(PreparedVolume {
        path: top,
        format: format(top_format),
        source: DiskSource::File,
        readonly: false,
        backing: layers
            .map(|(p, f)| BackingImage {
                path: p,
                format: format(f),
                source: DiskSource::File,
            })
            .collect(),
    }))
}

fn qemu_img(args: &[&str]) -> Result<(), AgentError> {
    let out = Command::new("qemu-img")
        .args(args)
        .output()
        .map_err(|e| AgentError::Tool {
            tool: "qemu-img".into(),
            message: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(AgentError::Tool {
            tool: "qemu-img".into(),
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

/// Carries out `actions` and returns the prepared volumes by name.
pub fn execute(actions: &[VolumeAction]) -> Result<BTreeMap<String, PreparedVolume>, AgentError> {
    let mut out = BTreeMap::new();
    for a in actions {
        let prepared = match a {
            VolumeAction::UseExisting { path, readonly, .. } => {
                let (img, source) = resolve_image(path)?;
                match snapshot_chain(path)? {
                    Some(prepared) => PreparedVolume {
                        readonly: *readonly,
                        ..prepared
                    },
                    None => PreparedVolume {
                        path: img,
                        format: DiskFormat::Raw,
                        source,
                        readonly: *readonly,
                        backing: Vec::new(),
                    },
                }
            }
            VolumeAction::CreateRawIfMissing { path, size, .. } => {
                if !path.exists() {
                    if let Some(parent) = path.parent() {
                        std::fs::create_dir_all(parent).map_err(|e| AgentError::io(parent, e))?;
                    }
                    let f = std::fs::File::create(path).map_err(|e| AgentError::io(path, e))?;
                    f.set_len(*size).map_err(|e| AgentError::io(path, e))?;
                }
                PreparedVolume {
                    path: path.clone(),
                    format: DiskFormat::Raw,
                    source: DiskSource::File,
                    readonly: false,
                    backing: Vec::new(),
                }
            }
            VolumeAction::CreateQcow2 { path, size, .. } => {
                let _ = std::fs::remove_file(path);
                let p = path.display().to_string();
                qemu_img(&["create", "-q", "-f", "qcow2", &p, &size.to_string()])?;
                PreparedVolume {
                    path: path.clone(),
                    format: DiskFormat::Qcow2,
                    source: DiskSource::File,
                    readonly: false,
                    backing: Vec::new(),
                }
            }
            VolumeAction::CreateOverlay {
                path,
                backing,
                backing_format,
                ..
            } => {
                let (img, source) = resolve_image(backing)?;
                let fmt = match backing_format {
                    DiskFormat::Qcow2 => "qcow2",
                    DiskFormat::Raw => "raw",
                };
                let _ = std::fs::remove_file(path);
                let (p, b) = (path.display().to_string(), img.display().to_string());
                qemu_img(&["create", "-q", "-f", "qcow2", "-F", fmt, "-b", &b, &p])?;
                PreparedVolume {
                    path: path.clone(),
                    format: DiskFormat::Qcow2,
                    source: DiskSource::File,
                    readonly: false,
                    backing: vec![BackingImage {
                        path: img,
                        format: *backing_format,
                        source,
                    }],
                }
            }
            VolumeAction::BuildIso { path, image, .. } => {
                let staging = path.with_extension("staging");
                cloudinit::write_iso(image, &staging, path)?;
                PreparedVolume {
                    path: path.clone(),
                    format: DiskFormat::Raw,
                    source: DiskSource::File,
                    readonly: true,
                    backing: Vec::new(),
                }
            }
        };
        out.insert(a.name().to_string(), prepared);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_with_snapshots_starts_from_its_recorded_chain() {
        let tmp = tempfile::tempdir().unwrap();
        let root = ferrovirt_storage::provisioner::VolumeRoot::new(tmp.path());
        let dir = root.create("pvc-1", 1 << 20).unwrap();
        let use_it = || {
            execute(&[VolumeAction::UseExisting {
                name: "d".into(),
                path: dir.clone(),
                readonly: false,
            }])
            .unwrap()
            .remove("d")
            .unwrap()
        };
        let plain = use_it();
        assert_eq!((plain.format, plain.backing.len()), (DiskFormat::Raw, 0));
        ferrovirt_storage::snapshot::take(&dir).unwrap();
        ferrovirt_storage::snapshot::take(&dir).unwrap();
        let chained = use_it();
        assert_eq!(chained.path, dir.join("layer-000002.qcow2"));
        assert_eq!(chained.format, DiskFormat::Qcow2);
        let backing: Vec<_> = chained
            .backing
            .iter()
            .map(|b| (b.path.clone(), b.format))
            .collect();
        assert_eq!(
            backing,
            [
                (dir.join("layer-000001.qcow2"), DiskFormat::Qcow2),
                (dir.join("disk.img"), DiskFormat::Raw)
            ],
            "nearest backing first, formats as recorded"
        );
    }
    use serde_json::json;

    fn vmi(volumes: serde_json::Value) -> VirtualMachineInstance {
        serde_json::from_value(json!({
            "metadata": {"name": "vm1", "namespace": "ns", "uid": "uid-1"},
            "spec": {"domain": {"devices": {}}, "volumes": volumes}
        }))
        .unwrap()
    }

    fn refs() -> ResolvedRefs {
        let mut r = ResolvedRefs::default();
        r.claims.insert(
            "root".into(),
            ClaimInfo {
                path: "/pv/root".into(),
                read_only: false,
                ours: false,
            },
        );
        r.service_account_tokens
            .insert("default".into(), "tok".into());
        r.api_ca_pem = Some("PEM".into());
        r
    }

    #[test]
    fn plans_each_kind() {
        let v = vmi(json!([
            {"name": "a", "persistentVolumeClaim": {"claimName": "root"}},
            {"name": "b", "emptyDisk": {"capacity": "1Gi"}},
            {"name": "c", "ephemeral": {"persistentVolumeClaim": {"claimName": "root"}}},
            {"name": "d", "hostDisk": {"path": "/h/d.img", "type": "DiskOrCreate", "capacity": "10Mi"}},
            {"name": "e", "cloudInitNoCloud": {"userData": "#!/bin/sh\necho hi\n"}},
            {"name": "f", "serviceAccount": {"serviceAccountName": "default"}}
        ]));
        let acts = plan(&v, &refs(), Path::new("/d")).unwrap();
        assert_eq!(
            acts[0],
            VolumeAction::UseExisting {
                name: "a".into(),
                path: "/pv/root".into(),
                readonly: false
            }
        );
        assert_eq!(
            acts[1],
            VolumeAction::CreateQcow2 {
                name: "b".into(),
                path: "/d/empty-b.qcow2".into(),
                size: 1 << 30
            }
        );
        assert!(
            matches!(&acts[2], VolumeAction::CreateOverlay { backing, .. } if backing == Path::new("/pv/root"))
        );
        assert!(
            matches!(&acts[3], VolumeAction::CreateRawIfMissing { size, .. } if *size == 10 << 20)
        );
        match &acts[4] {
            VolumeAction::BuildIso { image, path, .. } => {
                assert_eq!(image.label, "cidata");
                assert_eq!(path, Path::new("/d/e.iso"));
                assert!(
                    String::from_utf8_lossy(&image.files["meta-data"])
                        .contains("local-hostname: vm1")
                );
            }
            other => panic!("{other:?}"),
        }
        match &acts[5] {
            VolumeAction::BuildIso { image, .. } => {
                assert_eq!(image.label, SERVICE_ACCOUNT_LABEL);
                let names: Vec<&str> = image.files.keys().map(String::as_str).collect();
                assert_eq!(names, ["ca.crt", "namespace", "token"]);
                assert_eq!(image.files["token"], b"tok");
                assert_eq!(image.files["ca.crt"], b"PEM");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn missing_references_name_the_field() {
        let v = vmi(json!([{"name": "a", "dataVolume": {"name": "nope"}}]));
        let e = plan(&v, &refs(), Path::new("/d")).unwrap_err().to_string();
        assert!(e.contains("spec.volumes[0].dataVolume.name"), "{e}");
        let v = vmi(json!([{"name": "a", "configMap": {"name": "cm"}}]));
        let e = plan(&v, &refs(), Path::new("/d")).unwrap_err().to_string();
        assert!(e.contains("spec.volumes[0].configMap.name"), "{e}");
        let v = vmi(json!([{"name": "a", "configMap": {"name": "cm", "optional": true}}]));
        assert!(plan(&v, &refs(), Path::new("/d")).is_ok());
        let v = vmi(json!([{"name": "a", "serviceAccount": {"serviceAccountName": "gone"}}]));
        let e = plan(&v, &refs(), Path::new("/d")).unwrap_err().to_string();
        assert!(
            e.contains("spec.volumes[0].serviceAccount.serviceAccountName")
                && e.contains("\"gone\" not found"),
            "{e}"
        );
        let v = vmi(json!([{"name": "a", "hostDisk": {"path": "rel", "type": "Disk"}}]));
        let e = plan(&v, &refs(), Path::new("/d")).unwrap_err().to_string();
        assert!(e.contains("spec.volumes[0].hostDisk.path"), "{e}");
        let v = vmi(json!([{"name": "a", "containerDisk": {"image": "x"}}]));
        let e = plan(&v, &refs(), Path::new("/d")).unwrap_err().to_string();
        assert!(e.contains("spec.volumes[0].containerDisk"), "{e}");
        let mut r = refs();
        r.container_disks.insert(
            "a".into(),
            ("/cache/sha256/ab/disk".into(), DiskFormat::Qcow2),
        );
        assert_eq!(
            plan(&v, &r, Path::new("/d")).unwrap(),
            vec![VolumeAction::CreateOverlay {
                name: "a".into(),
                path: "/d/containerdisk-a.qcow2".into(),
                backing: "/cache/sha256/ab/disk".into(),
                backing_format: DiskFormat::Qcow2,
            }]
        );
    }

    #[test]
    fn block_volume_directories_become_loop_devices() {
        use ferrovirt_storage::block;
        if !block::loop_devices_available() || !block::losetup_usable() {
            eprintln!("skipping: no usable loop devices");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let pv = dir.path().join("pvc-b");
        std::fs::create_dir_all(&pv).unwrap();
        ferrovirt_storage::provisioner::create_sparse(&pv.join("disk.img"), 1 << 20).unwrap();
        std::fs::write(pv.join(block::BLOCK_MARKER), b"Block\n").unwrap();
        let mut r = ResolvedRefs::default();
        r.claims.insert(
            "root".into(),
            ClaimInfo {
                path: pv.clone(),
                read_only: false,
                ours: false,
            },
        );
        let v = vmi(json!([{"name": "a", "persistentVolumeClaim": {"claimName": "root"}}]));
        let prepared = execute(&plan(&v, &r, dir.path()).unwrap()).unwrap();
        let detached = block::detach_all(&pv.join("disk.img")).unwrap();
        assert_eq!(prepared["a"].source, DiskSource::Block);
        assert_eq!(prepared["a"].format, DiskFormat::Raw);
        assert_eq!(detached, vec![prepared["a"].path.clone()]);
    }

    #[test]
    fn a_claim_whose_bytes_look_like_qcow2_stays_raw() {
        let dir = tempfile::tempdir().unwrap();
        let pv = dir.path().join("pv");
        std::fs::create_dir_all(&pv).unwrap();
        // What a guest can write at the start of its own raw disk: a qcow2 header whose
        // backing file is a host file.
        let secret = dir.path().join("host-secret");
        std::fs::write(&secret, b"host secret").unwrap();
        let out = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
            .arg(&secret)
            .arg(pv.join("disk.img"))
            .arg("1M")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let mut r = ResolvedRefs::default();
        r.claims.insert(
            "root".into(),
            ClaimInfo {
                path: pv.clone(),
                read_only: false,
                ours: false,
            },
        );
        let v = vmi(json!([
            {"name": "a", "persistentVolumeClaim": {"claimName": "root"}},
            {"name": "c", "ephemeral": {"persistentVolumeClaim": {"claimName": "root"}}}
        ]));
        let prepared = execute(&plan(&v, &r, dir.path()).unwrap()).unwrap();
        assert_eq!(prepared["a"].format, DiskFormat::Raw);
        assert!(prepared["a"].backing.is_empty());
        assert_eq!(prepared["c"].backing.len(), 1);
        assert_eq!(prepared["c"].backing[0].format, DiskFormat::Raw);
        assert_eq!(prepared["c"].backing[0].path, pv.join("disk.img"));
    }

    #[test]
    fn executes_on_real_files() {
        let dir = tempfile::tempdir().unwrap();
        let pv = dir.path().join("pv");
        std::fs::create_dir_all(&pv).unwrap();
        std::fs::write(pv.join("disk.img"), vec![0u8; 1 << 20]).unwrap();
        let mut r = ResolvedRefs::default();
        r.claims.insert(
            "root".into(),
            ClaimInfo {
                path: pv.clone(),
                read_only: false,
                ours: false,
            },
        );
        let v = vmi(json!([
            {"name": "a", "persistentVolumeClaim": {"claimName": "root"}},
            {"name": "b", "emptyDisk": {"capacity": "16Mi"}},
            {"name": "c", "ephemeral": {"persistentVolumeClaim": {"claimName": "root"}}},
            {"name": "d", "hostDisk": {"path": dir.path().join("h/d.img").display().to_string(), "type": "DiskOrCreate", "capacity": "4Mi"}},
            {"name": "e", "cloudInitConfigDrive": {"userData": "#!/bin/sh\n"}}
        ]));
        let acts = plan(&v, &r, dir.path()).unwrap();
        let prepared = execute(&acts).unwrap();
        assert_eq!(prepared["a"].path, pv.join("disk.img"));
        assert_eq!(prepared["a"].format, DiskFormat::Raw);
        assert_eq!(prepared["b"].format, DiskFormat::Qcow2);
        assert_eq!(prepared["c"].format, DiskFormat::Qcow2);
        assert_eq!(
            prepared["c"].backing,
            vec![BackingImage {
                path: pv.join("disk.img"),
                format: DiskFormat::Raw,
                source: DiskSource::File,
            }]
        );
        assert_eq!(
            std::fs::metadata(&prepared["d"].path).unwrap().len(),
            4 << 20
        );
        let iso = std::fs::read(&prepared["e"].path).unwrap();
        // ISO 9660 primary volume descriptor at 32 KiB, volume id at offset 40.
        assert_eq!(&iso[0x8001..0x8006], b"CD001");
        assert!(String::from_utf8_lossy(&iso[0x8028..0x8048]).starts_with("config-2"));
    }
}
