//! What a DataVolume population runs ([`Work`]) and its preparation ([`prepare`]: sources,
//! Secrets, `certConfigMap` CAs, checksum, address policy, clone sources), and where: on this
//! machine for shared volumes, or as a request to the agent of the node holding a node-local
//! volume ([`remote_source`], pure: cross-node clones are refused with the reason).

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, PersistentVolumeClaim, Secret};
use kube::api::{Api, ApiResource, DynamicObject};

use ferrovirt_agent::nodestore::client::NodeStorage;
use ferrovirt_agent::nodestore::{Populate, Source};
use ferrovirt_api::cdi::{DataVolume, dv_phase};
use ferrovirt_storage::http::{BasicAuth, DownloadRequest};
use ferrovirt_storage::importer::ImportRequest;
use ferrovirt_storage::netpolicy::Cidr;
use ferrovirt_storage::provisioner::image_of;

use super::datavolume::{self as dvd, SourceKind};
use super::nodes::{self, Placement};
use super::resources::{CDI_API_VERSION, Dv};
use crate::error::ControllerError;

/// What [`prepare`] needs of the controller.
pub(super) struct PrepareCtx<'a> {
    pub client: &'a kube::Client,
    /// Import scratch space of this machine (one subdirectory per DataVolume uid).
    pub scratch: &'a Path,
    /// `--import-allowed-cidrs`.
    pub allowed: &'a [Cidr],
}

/// Where a clone's data is.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum CloneSource {
    /// An image file this machine reaches (shared storage).
    Path(PathBuf),
    /// A node-local volume on `node`.
    Node { node: String, volume: String },
}

/// What a node's agent runs for `work` into a volume on `node` (pure): the same source,
/// minus the paths of this machine. A clone source must be a volume on the same node or a
/// shared image; another node's volume is refused with the reason.
pub(super) fn remote_source(work: Work, node: &str) -> Result<Source, String> {
    Ok(match work {
        Work::Import(req) => Source::Http {
            download: req.source,
            checksum: req.checksum,
        },
        Work::Registry(req) => Source::Registry {
            image: req.image,
            client: req.client,
        },
        Work::Blank { .. } => Source::Blank,
        Work::Clone {
            source: CloneSource::Node { node: n, volume },
            ..
        } => {
            if n != node {
                return Err(format!(
                    "cloning across nodes is not supported: the source volume {volume} is on \
                     node {n}, the target on node {node} (node-local volumes are copied on \
                     their node only)"
                ));
            }
            Source::Volume { name: volume }
        }
        Work::Clone {
            source: CloneSource::Path(path),
            ..
        } => Source::SharedImage {
            path: path.to_string_lossy().into_owned(),
        },
        Work::Remote(r) => r.req.source,
    })
}

/// A population ready to run.
pub(super) enum Work {
    Import(Box<ImportRequest>),
    Registry(Box<ferrovirt_storage::registry::RegistryImportRequest>),
    Blank {
        target: PathBuf,
        capacity: u64,
    },
    Clone {
        source: CloneSource,
        target: PathBuf,
        capacity: u64,
    },
    /// Run by the agent of the node holding the volume.
    Remote(Box<RemoteWork>),
}

/// A population run by the agent of the node holding the volume.
pub(super) struct RemoteWork {
    pub storage: NodeStorage,
    pub volume: String,
    pub req: Populate,
}

pub(super) enum Prepared {
    Ready(Work),
    /// Not yet (clone source not ready).
    Wait(String),
    /// Never (bad checksum notation, missing Secret key).
    Invalid(String),
}

fn dv_resource() -> ApiResource {
    ApiResource {
        group: "cdi.kubevirt.io".into(),
        version: "v1beta1".into(),
        api_version: CDI_API_VERSION.into(),
        kind: "DataVolume".into(),
        plural: "datavolumes".into(),
    }
}

pub(super) async fn prepare(
    ctx: &PrepareCtx<'_>,
    dv: &DataVolume,
    ns: &str,
    source: &SourceKind,
    target: PathBuf,
    capacity: u64,
) -> Result<Prepared, ControllerError> {
    let name = dv.metadata.name.clone().unwrap_or_default();
    let uid = dv.metadata.uid.clone().unwrap_or_default();
    let src = dv
        .spec
        .as_ref()
        .and_then(|s| s.source.clone())
        .unwrap_or_default();
    match source {
        SourceKind::Blank => Ok(Prepared::Ready(Work::Blank { target, capacity })),
        SourceKind::Upload => Ok(Prepared::Invalid(
            "upload sources are filled through the upload endpoint".into(),
        )),
        SourceKind::Registry => {
            use super::registry_import::{self as ri, Prepared as P};
            let registry = src.registry.clone().unwrap_or_default();
            let scratch = ctx.scratch.join(&uid);
            Ok(
                match ri::prepare(
                    ctx.client,
                    ns,
                    ctx.allowed,
                    &registry,
                    scratch,
                    target,
                    capacity,
                )
                .await?
                {
                    P::Ready(req) => Prepared::Ready(Work::Registry(req)),
                    P::Wait(m) => Prepared::Wait(m),
                    P::Invalid(m) => Prepared::Invalid(m),
                },
            )
        }
        SourceKind::Http => {
            let http = src.http.unwrap_or_default();
            // `spec.source.http.checksum` is read from the stored object (the typed HttpSource
            // lacks it), else the `ferrovirt.io/checksum` annotation.
            let raw = Api::<DynamicObject>::namespaced_with(ctx.client.clone(), ns, &dv_resource())
                .get_opt(&name)
                .await?;
            let annotation = dv
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(dvd::CHECKSUM_ANNOTATION))
                .map(String::as_str);
            let checksum = raw
                .as_ref()
                .and_then(|o| o.data.pointer("/spec/source/http/checksum"))
                .and_then(|v| v.as_str())
                .or(annotation)
                .map(ferrovirt_storage::checksum::parse)
                .transpose();
            let checksum = match checksum {
                Ok(c) => c,
                Err(e) => return Ok(Prepared::Invalid(e.to_string())),
            };
            let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
            let headers = http.extra_headers.clone().unwrap_or_default();
            // secretExtraHeaders carry credentials: sent to the URL's origin only.
            let mut secret_headers = Vec::new();
            for s in http.secret_extra_headers.iter().flatten() {
                let Some(sec) = secrets.get_opt(s).await? else {
                    return Ok(Prepared::Invalid(format!("Secret {s} not found")));
                };
                for v in sec.data.unwrap_or_default().into_values() {
                    secret_headers.push(String::from_utf8_lossy(&v.0).into_owned());
                }
            }
            // certConfigMap: every value of the ConfigMap (in the DataVolume's namespace) is
            // a PEM bundle of CAs trusted in addition to the system roots, as in CDI.
            let mut ca_pems = Vec::new();
            if let Some(cm) = &http.cert_config_map {
                let Some(map) = Api::<ConfigMap>::namespaced(ctx.client.clone(), ns)
                    .get_opt(cm)
                    .await?
                else {
                    return Ok(Prepared::Wait(format!("certConfigMap {ns}/{cm} not found")));
                };
                ca_pems.extend(map.data.unwrap_or_default().into_values());
                ca_pems.extend(
                    map.binary_data
                        .unwrap_or_default()
                        .into_values()
                        .map(|b| String::from_utf8_lossy(&b.0).into_owned()),
                );
                if let Err(e) = ferrovirt_storage::http::parse_ca_pems(&ca_pems) {
                    return Ok(Prepared::Invalid(format!("certConfigMap {cm}: {e}")));
                }
            }
            let auth = match &http.secret_ref {
                Some(s) => {
                    let Some(sec) = secrets.get_opt(s).await? else {
                        return Ok(Prepared::Invalid(format!("Secret {s} not found")));
                    };
                    let data = sec.data.unwrap_or_default();
                    let get = |k: &str| {
                        data.get(k)
                            .map(|v| String::from_utf8_lossy(&v.0).into_owned())
                    };
                    match (get("accessKeyId"), get("secretKey")) {
                        (Some(user), Some(password)) => Some(BasicAuth { user, password }),
                        _ => {
                            return Ok(Prepared::Invalid(format!(
                                "Secret {s} needs the keys accessKeyId and secretKey"
                            )));
                        }
                    }
                }
                None => None,
            };
            let address_policy =
                match super::registry_import::address_policy(ctx.client, ctx.allowed).await? {
                    Ok(p) => p,
                    Err(m) => return Ok(Prepared::Invalid(m)),
                };
            Ok(Prepared::Ready(Work::Import(Box::new(ImportRequest {
                source: DownloadRequest {
                    url: http.url,
                    headers,
                    auth,
                    ca_pems,
                    secret_headers,
                    limits: super::registry_import::transfer_limits(ctx.client, capacity).await?,
                    insecure_skip_verify: http.insecure_skip_verify.unwrap_or(false),
                    address_policy,
                },
                checksum,
                scratch_dir: ctx.scratch.join(uid),
                target,
                capacity,
            }))))
        }
        SourceKind::Pvc {
            namespace,
            name: src_name,
        } => {
            let wait = |m: String| Ok(Prepared::Wait(m));
            let Some(src_claim) =
                Api::<PersistentVolumeClaim>::namespaced(ctx.client.clone(), namespace)
                    .get_opt(src_name)
                    .await?
            else {
                return wait(format!("clone source PVC {namespace}/{src_name} not found"));
            };
            // A source that is itself a DataVolume must have finished populating.
            let populated_for = src_claim
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(dvd::POPULATED_FOR))
                .cloned();
            if let Some(src_dv) = populated_for {
                let d = Api::<Dv>::namespaced(ctx.client.clone(), namespace)
                    .get_opt(&src_dv)
                    .await?;
                let phase = d.and_then(|d| d.0.status).and_then(|s| s.phase);
                if phase.as_deref() != Some(dv_phase::SUCCEEDED) {
                    return wait(format!(
                        "clone source DataVolume {namespace}/{src_dv} has not succeeded yet"
                    ));
                }
            }
            let volume = src_claim.spec.as_ref().and_then(|s| s.volume_name.clone());
            let pv = match volume {
                Some(v) => {
                    Api::<PersistentVolume>::all(ctx.client.clone())
                        .get_opt(&v)
                        .await?
                }
                None => None,
            };
            let source = match pv.as_ref().map(nodes::placement) {
                Some(Placement::Node { node, volume }) => CloneSource::Node { node, volume },
                Some(Placement::Path(path)) => CloneSource::Path(image_of(&path)),
                _ => {
                    return wait(format!(
                        "clone source PVC {namespace}/{src_name} is not bound"
                    ));
                }
            };
            Ok(Prepared::Ready(Work::Clone {
                source,
                target,
                capacity,
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_work_keeps_the_source_and_refuses_other_nodes() {
        let clone = |source| Work::Clone {
            source,
            target: PathBuf::new(),
            capacity: 1,
        };
        let same = remote_source(
            clone(CloneSource::Node {
                node: "n1".into(),
                volume: "pvc-s".into(),
            }),
            "n1",
        );
        assert!(matches!(same, Ok(Source::Volume { name }) if name == "pvc-s"));
        let other = remote_source(
            clone(CloneSource::Node {
                node: "n2".into(),
                volume: "pvc-s".into(),
            }),
            "n1",
        );
        assert!(
            matches!(&other, Err(m) if m.contains("across nodes") && m.contains("n2")),
            "{other:?}"
        );
        let shared = remote_source(
            clone(CloneSource::Path("/d/volumes/pvc-x/disk.img".into())),
            "n1",
        );
        assert!(
            matches!(shared, Ok(Source::SharedImage { path }) if path == "/d/volumes/pvc-x/disk.img")
        );
        let blank = remote_source(
            Work::Blank {
                target: PathBuf::new(),
                capacity: 1,
            },
            "n1",
        );
        assert!(matches!(blank, Ok(Source::Blank)));
        // The address policy travels with an HTTP import.
        let policy = ferrovirt_storage::netpolicy::AddressPolicy::allowing(
            ferrovirt_storage::netpolicy::parse_list("127.0.0.0/8").unwrap(),
        );
        let import = Work::Import(Box::new(ImportRequest {
            source: DownloadRequest {
                url: "http://127.0.0.1:1/d.img".into(),
                address_policy: policy.clone(),
                ..Default::default()
            },
            checksum: None,
            scratch_dir: PathBuf::new(),
            target: PathBuf::new(),
            capacity: 1,
        }));
        match remote_source(import, "n1") {
            Ok(Source::Http { download, .. }) => assert_eq!(download.address_policy, policy),
            other => panic!("{other:?}"),
        }
    }
}
