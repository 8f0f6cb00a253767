//! containerDisk volumes on the node: the image of each `containerDisk` volume is pulled
//! into the node's content-addressed cache (`<agent data dir>/containerdisks`, see
//! `ferrovirt_storage::registry::cache`: one read-only copy per manifest digest, concurrent
//! VMIs share a pull, every disk validated like an import) under the volume's
//! `imagePullPolicy`, with the credentials of its `imagePullSecret` (a
//! `kubernetes.io/dockerconfigjson` Secret) and the insecure registries of the HyperConverged
//! (`spec.storageImport.insecureRegistries`) and CDI (`spec.config.insecureRegistries`)
//! objects. Each VMI then gets an ephemeral qcow2 overlay on the cached disk in its own
//! directory ([`crate::volumes`]), removed with the VMI; the cache stays.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_storage::registry::cache::{self, CachedDisk, ImageCache};
use ferrovirt_storage::registry::{ClientOptions, ImageRef, auth, reference};
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;

use ferrovirt_launcher::spec::DiskFormat;

use crate::error::AgentError;

/// The largest layer or disk file the node pulls.
pub const MAX_IMAGE_BYTES: u64 = 64 << 30;

/// One containerDisk volume of a VMI, checked (pure).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerDiskVolume {
    pub volume: String,
    pub image: ImageRef,
    pub policy: cache::PullPolicy,
    pub pull_secret: Option<String>,
}

/// The containerDisk volumes of `vmi`, their images parsed and pull policies defaulted.
pub fn container_disk_volumes(
    vmi: &VirtualMachineInstance,
) -> Result<Vec<ContainerDiskVolume>, AgentError> {
    let mut out = Vec::new();
    let volumes = vmi.spec.as_ref().and_then(|s| s.volumes.as_ref());
    for (i, v) in volumes.into_iter().flatten().enumerate() {
        let Some(cd) = &v.container_disk else {
            continue;
        };
        let field = format!("spec.volumes[{i}].containerDisk");
        if let Some(p) = cd.path.as_deref()
            && !matches!(p.trim_end_matches('/'), "" | "/disk")
        {
            return Err(AgentError::unsupported(
                format!("{field}.path"),
                format!("{p:?}: only the /disk directory of an image is supported"),
            ));
        }
        let image = reference::parse("image", &cd.image)
            .map_err(|e| AgentError::invalid(format!("{field}.image"), e.to_string()))?;
        let policy = cache::pull_policy(cd.image_pull_policy.as_deref(), &image)
            .map_err(|e| AgentError::invalid(format!("{field}.imagePullPolicy"), e.to_string()))?;
        out.push(ContainerDiskVolume {
            volume: v.name.clone(),
            image,
            policy,
            pull_secret: cd.image_pull_secret.clone(),
        });
    }
    Ok(out)
}

/// The format the cache recorded for a pulled disk (`qemu-img info` at pull time, after the
/// importer's checks); QEMU is given exactly this, the cached file is never probed again.
pub fn recorded_format(recorded: &str) -> Option<DiskFormat> {
    match recorded {
        "qcow2" => Some(DiskFormat::Qcow2),
        "raw" => Some(DiskFormat::Raw),
        _ => None,
    }
}

/// The node's containerDisk cache.
#[derive(Debug)]
pub struct ContainerDisks {
    cache: ImageCache,
}

fn pull_err(image: &ImageRef, message: impl Into<String>) -> AgentError {
    AgentError::ImagePull {
        image: image.to_string(),
        message: message.into(),
    }
}

impl ContainerDisks {
    /// The cache under `<data_dir>/containerdisks`.
    pub fn new(data_dir: &Path) -> Self {
        ContainerDisks {
            cache: ImageCache::new(data_dir.join("containerdisks"), MAX_IMAGE_BYTES),
        }
    }

    /// The cache directory.
    pub fn root(&self) -> &Path {
        self.cache.root()
    }

    async fn credentials(
        &self,
        client: &kube::Client,
        ns: &str,
        v: &ContainerDiskVolume,
    ) -> Result<Option<ferrovirt_storage::http::BasicAuth>, AgentError> {
        let Some(name) = &v.pull_secret else {
            return Ok(None);
        };
        let secret = Api::<Secret>::namespaced(client.clone(), ns)
            .get_opt(name)
            .await
            .map_err(|e| AgentError::Reference(format!("API: {e}")))?
            .ok_or_else(|| pull_err(&v.image, format!("imagePullSecret {ns}/{name} not found")))?;
        let mut data: BTreeMap<String, Vec<u8>> = secret
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect();
        for (k, s) in secret.string_data.unwrap_or_default() {
            data.insert(k, s.into_bytes());
        }
        let config = data.get(".dockerconfigjson").ok_or_else(|| {
            pull_err(
                &v.image,
                format!("imagePullSecret {name} has no .dockerconfigjson"),
            )
        })?;
        auth::docker_config_auth(config, &v.image.registry)
            .map_err(|e| pull_err(&v.image, format!("imagePullSecret {name}: {e}")))
    }

    /// Pulls (or finds) the image of every containerDisk volume of `vmi`; returns the
    /// cached disk and the format recorded when it was pulled, by volume name.
    pub async fn prepare(
        &self,
        client: &kube::Client,
        vmi: &VirtualMachineInstance,
        insecure: &[String],
    ) -> Result<BTreeMap<String, (PathBuf, DiskFormat)>, AgentError> {
        let volumes = container_disk_volumes(vmi)?;
        let mut out = BTreeMap::new();
        if volumes.is_empty() {
            return Ok(out);
        }
        let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
        for v in volumes {
            let opts = ClientOptions {
                insecure_registries: insecure.to_vec(),
                extra_ca_pem: Vec::new(),
                auth: self.credentials(client, ns, &v).await?,
                // containerDisk pulls are not under the import address policy yet (the
                // agent has no allowed-ranges setting): see docs/security.md.
                address_policy: ferrovirt_storage::netpolicy::AddressPolicy::unrestricted(),
            };
            let disk: CachedDisk = self
                .cache
                .ensure(&v.image, v.policy, &opts)
                .await
                .map_err(|e| pull_err(&v.image, e.to_string()))?;
            if disk.pulled {
                tracing::info!(image = %v.image, digest = %disk.info.digest, "pulled containerDisk");
            }
            let format = recorded_format(&disk.info.format).ok_or_else(|| {
                pull_err(
                    &v.image,
                    format!(
                        "the cache recorded format {:?} for this image (qcow2 or raw expected)",
                        disk.info.format
                    ),
                )
            })?;
            out.insert(v.volume, (disk.path, format));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vmi(volumes: serde_json::Value) -> VirtualMachineInstance {
        serde_json::from_value(json!({
            "metadata": {"name": "v", "namespace": "ns"},
            "spec": {"domain": {"devices": {}}, "volumes": volumes}
        }))
        .unwrap()
    }

    #[test]
    fn finds_container_disks_and_defaults_policies() {
        let v = vmi(json!([
            {"name": "root", "containerDisk": {"image": "127.0.0.1:5000/fv/guest:v1"}},
            {"name": "data", "emptyDisk": {"capacity": "1Gi"}},
            {"name": "other", "containerDisk": {"image": "quay.io/x/y", "imagePullSecret": "s"}}
        ]));
        let cds = container_disk_volumes(&v).unwrap();
        assert_eq!(cds.len(), 2);
        assert_eq!(cds[0].volume, "root");
        assert_eq!(cds[0].policy, cache::PullPolicy::IfNotPresent);
        assert_eq!(cds[1].policy, cache::PullPolicy::Always);
        assert_eq!(cds[1].pull_secret.as_deref(), Some("s"));
    }

    #[test]
    fn only_recorded_qcow2_and_raw_are_used() {
        assert_eq!(recorded_format("qcow2"), Some(DiskFormat::Qcow2));
        assert_eq!(recorded_format("raw"), Some(DiskFormat::Raw));
        assert_eq!(recorded_format("vmdk"), None);
        assert_eq!(recorded_format(""), None);
    }

    #[test]
    fn bad_container_disks_name_the_field() {
        let v = vmi(json!([{"name": "r", "containerDisk": {"image": "h/UPPER"}}]));
        let e = container_disk_volumes(&v).unwrap_err().to_string();
        assert!(e.contains("spec.volumes[0].containerDisk.image"), "{e}");
        let v = vmi(
            json!([{"name": "r", "containerDisk": {"image": "h/a", "imagePullPolicy": "Maybe"}}]),
        );
        let e = container_disk_volumes(&v).unwrap_err().to_string();
        assert!(e.contains("imagePullPolicy"), "{e}");
        let v = vmi(json!([{"name": "r", "containerDisk": {"image": "h/a", "path": "/other"}}]));
        let e = container_disk_volumes(&v).unwrap_err().to_string();
        assert!(e.contains("containerDisk.path"), "{e}");
    }
}
