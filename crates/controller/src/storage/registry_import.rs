//! The DataVolume `registry` source (CDI's `spec.source.registry`): checks the source
//! ([`image_of_source`], pure: `url` with `docker://`, `pullMethod` `pod` or `node`, no
//! `imageStream`), gathers what the pull needs — credentials from `secretRef` (keys
//! `accessKeyId`/`secretKey`), CAs from `certConfigMap`, the insecure registries of the
//! HyperConverged and CDI objects — and hands a [`RegistryImportRequest`] to
//! `ferrovirt_storage::registry::import` (pull the image, take the file under `/disk/`,
//! validate it like any import, convert it to raw). Both pull methods pull in the importer;
//! ferrovirt has no container runtime to delegate `node` to.

use std::path::PathBuf;

use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ApiResource, DynamicObject, ListParams};

use ferrovirt_api::cdi::RegistrySource;
use ferrovirt_storage::http::BasicAuth;
use ferrovirt_storage::netpolicy::{AddressPolicy, Cidr};
use ferrovirt_storage::registry::{ClientOptions, ImageRef, RegistryImportRequest, reference};

use crate::error::ControllerError;

/// What the import needs, or why it cannot start.
#[derive(Debug)]
pub enum Prepared {
    Ready(Box<RegistryImportRequest>),
    /// A referenced object is missing (it may appear).
    Wait(String),
    /// The source can never work.
    Invalid(String),
}

/// The image a registry source names, or why the source is invalid (pure).
pub fn image_of_source(src: &RegistrySource) -> Result<ImageRef, String> {
    if src.image_stream.is_some() {
        return Err(
            "spec.source.registry.imageStream is not supported (no OpenShift image streams); \
             use url"
                .into(),
        );
    }
    match src.pull_method.as_deref() {
        None | Some("pod") | Some("node") => {}
        Some(other) => {
            return Err(format!(
                "spec.source.registry.pullMethod: {other:?} is not one of pod, node"
            ));
        }
    }
    let url = src
        .url
        .as_deref()
        .filter(|u| !u.trim().is_empty())
        .ok_or("spec.source.registry.url is required")?;
    if !url.trim_start().starts_with("docker://") {
        return Err(format!(
            "spec.source.registry.url: {url:?} must start with docker://"
        ));
    }
    reference::parse("spec.source.registry.url", url).map_err(|e| e.to_string())
}

fn resource(group: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: group.into(),
        version: "v1beta1".into(),
        api_version: format!("{group}/v1beta1"),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// The HyperConverged and CDI objects (as JSON; empty when not served).
pub async fn config_objects(
    client: &kube::Client,
) -> Result<(Vec<serde_json::Value>, Vec<serde_json::Value>), ControllerError> {
    let list = |r: ApiResource| {
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &r);
        async move {
            Ok::<_, ControllerError>(match api.list(&ListParams::default()).await {
                Ok(l) => l
                    .items
                    .into_iter()
                    .map(|o| serde_json::to_value(o).unwrap_or_default())
                    .collect(),
                // Not served (or not allowed): no configuration.
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 403 => Vec::new(),
                Err(e) => return Err(e.into()),
            })
        }
    };
    let hcos = list(resource(
        "hco.kubevirt.io",
        "HyperConverged",
        "hyperconvergeds",
    ))
    .await?;
    let cdis = list(resource("cdi.kubevirt.io", "CDI", "cdis")).await?;
    Ok((hcos, cdis))
}

/// The insecure registries configured in the CDI objects (the HyperConverged's reach them
/// through its reconcile).
pub async fn insecure_registries(client: &kube::Client) -> Result<Vec<String>, ControllerError> {
    let (_, cdis) = config_objects(client).await?;
    Ok(ferrovirt_api::hco::insecure_registries(&cdis))
}

/// The transfer limits of an import into a claim of `capacity` bytes: at most
/// [`ferrovirt_storage::http::transfer_limit`] bytes, the timeouts of the HyperConverged or
/// CDI configuration (`transferStallTimeoutSeconds`, `transferTimeoutSeconds`).
pub async fn transfer_limits(
    client: &kube::Client,
    capacity: u64,
) -> Result<ferrovirt_storage::http::TransferLimits, ControllerError> {
    let (hcos, cdis) = config_objects(client).await?;
    let (stall, overall) = ferrovirt_api::hco::transfer_timeouts(&hcos, &cdis);
    let mut l = ferrovirt_storage::http::TransferLimits {
        max_bytes: ferrovirt_storage::http::transfer_limit(capacity),
        ..Default::default()
    };
    if let Some(s) = stall {
        l.stall_timeout = std::time::Duration::from_secs(s);
    }
    if let Some(o) = overall {
        l.overall_timeout = std::time::Duration::from_secs(o);
    }
    Ok(l)
}

/// The address policy of imports: the default refusals, less the ranges of the server flag
/// (`flag`) and of HyperConverged `spec.storageImport.allowedImportCIDRs` (`Err`: an entry
/// there is not a range, named).
pub async fn address_policy(
    client: &kube::Client,
    flag: &[Cidr],
) -> Result<Result<AddressPolicy, String>, ControllerError> {
    let (hcos, _) = config_objects(client).await?;
    Ok(policy_of(
        flag,
        &ferrovirt_api::hco::allowed_import_cidrs(&hcos),
    ))
}

/// [`address_policy`] from its inputs (pure).
pub fn policy_of(flag: &[Cidr], hco: &[String]) -> Result<AddressPolicy, String> {
    let mut allowed = flag.to_vec();
    for r in hco {
        let c = r
            .parse::<Cidr>()
            .map_err(|e| format!("HyperConverged spec.storageImport.allowedImportCIDRs: {e}"))?;
        allowed.push(c);
    }
    Ok(AddressPolicy::allowing(allowed))
}

/// Gathers credentials, CAs, the insecure list and the address policy (`allowed`: the server
/// flag's ranges) for importing `src` into `target`.
#[allow(clippy::too_many_arguments)]
pub async fn prepare(
    client: &kube::Client,
    ns: &str,
    allowed: &[Cidr],
    src: &RegistrySource,
    scratch_dir: PathBuf,
    target: PathBuf,
    capacity: u64,
) -> Result<Prepared, ControllerError> {
    let image = match image_of_source(src) {
        Ok(i) => i,
        Err(m) => return Ok(Prepared::Invalid(m)),
    };
    let auth = match &src.secret_ref {
        Some(s) => {
            let Some(sec) = Api::<Secret>::namespaced(client.clone(), ns)
                .get_opt(s)
                .await?
            else {
                return Ok(Prepared::Wait(format!("Secret {ns}/{s} not found")));
            };
            let mut data: std::collections::BTreeMap<String, String> = sec
                .data
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()))
                .collect();
            data.extend(sec.string_data.unwrap_or_default());
            match (data.get("accessKeyId"), data.get("secretKey")) {
                (Some(u), Some(p)) => Some(BasicAuth {
                    user: u.clone(),
                    password: p.clone(),
                }),
                _ => {
                    return Ok(Prepared::Invalid(format!(
                        "Secret {s} needs the keys accessKeyId and secretKey"
                    )));
                }
            }
        }
        None => None,
    };
    let mut extra_ca_pem = Vec::new();
    if let Some(cm) = &src.cert_config_map {
        let Some(map) = Api::<ConfigMap>::namespaced(client.clone(), ns)
            .get_opt(cm)
            .await?
        else {
            return Ok(Prepared::Wait(format!("certConfigMap {ns}/{cm} not found")));
        };
        for v in map.data.unwrap_or_default().into_values() {
            extra_ca_pem.extend_from_slice(v.as_bytes());
            extra_ca_pem.push(b'\n');
        }
        for v in map.binary_data.unwrap_or_default().into_values() {
            extra_ca_pem.extend_from_slice(&v.0);
            extra_ca_pem.push(b'\n');
        }
        if let Err(e) = ferrovirt_storage::registry::client::tls_config(&extra_ca_pem) {
            return Ok(Prepared::Invalid(format!("certConfigMap {cm}: {e}")));
        }
    }
    let address_policy = match address_policy(client, allowed).await? {
        Ok(p) => p,
        Err(m) => return Ok(Prepared::Invalid(m)),
    };
    Ok(Prepared::Ready(Box::new(RegistryImportRequest {
        image,
        client: ClientOptions {
            insecure_registries: insecure_registries(client).await?,
            extra_ca_pem,
            auth,
            address_policy,
        },
        scratch_dir,
        target,
        capacity,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn src(url: Option<&str>) -> RegistrySource {
        RegistrySource {
            url: url.map(Into::into),
            ..Default::default()
        }
    }

    #[test]
    fn address_policy_adds_flag_and_hco_ranges() {
        let flag = vec!["127.0.0.2/32".parse().unwrap()];
        let p = policy_of(&flag, &["10.0.0.0/8".into()]).unwrap();
        assert_eq!(p.allowed.len(), 2);
        assert!(!p.unrestricted);
        assert!(p.check("127.0.0.2".parse().unwrap()).is_ok());
        assert!(p.check("127.0.0.1".parse().unwrap()).is_err());
        let e = policy_of(&flag, &["10.0.0.0/99".into()]).unwrap_err();
        assert!(
            e.contains("allowedImportCIDRs") && e.contains("10.0.0.0/99"),
            "{e}"
        );
    }

    #[test]
    fn checks_registry_sources() {
        let i = image_of_source(&src(Some("docker://127.0.0.1:5000/fv/guest:v1"))).unwrap();
        assert_eq!(i.registry, "127.0.0.1:5000");
        assert_eq!(i.reference(), "v1");
        let e = image_of_source(&src(None)).unwrap_err();
        assert!(e.contains("url is required"), "{e}");
        let e = image_of_source(&src(Some("127.0.0.1:5000/fv/guest"))).unwrap_err();
        assert!(e.contains("docker://"), "{e}");
        let e = image_of_source(&src(Some("docker://h/UP"))).unwrap_err();
        assert!(e.contains("spec.source.registry.url"), "{e}");
        let mut s = src(Some("docker://h/a"));
        s.pull_method = Some("node".into());
        assert!(image_of_source(&s).is_ok());
        s.pull_method = Some("daemon".into());
        assert!(image_of_source(&s).unwrap_err().contains("pullMethod"));
        let mut s = src(None);
        s.image_stream = Some("is".into());
        assert!(image_of_source(&s).unwrap_err().contains("imageStream"));
    }
}
