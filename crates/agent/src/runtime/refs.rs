//! What a VMI's volumes reference, looked up by name when its launcher starts: claims with
//! their access modes and the paths of their PersistentVolumes, Secrets (cloud-init, secret
//! volumes) and ConfigMaps, and a token bound to the VMI for each serviceAccount volume
//! (TokenRequest, [`SERVICE_ACCOUNT_TOKEN_SECONDS`]).

use std::collections::BTreeMap;
use std::path::Path;

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, PersistentVolume, PersistentVolumeClaim, Secret, ServiceAccount,
};
use kube::api::{Api, PostParams};

use super::{Agent, kube_err, ns_name};
use crate::error::AgentError;
use crate::volumes::{ClaimInfo, ResolvedRefs};

/// The lifetime of a serviceAccount disk's token: one year (the longest the API server issues),
/// because the disk is read-only in the guest and never rewritten while the VMI runs (as in
/// KubeVirt); the token is bound to the VMI and stops working when the VMI is gone, which is
/// what ends it in practice (as Kubernetes extends the kubelet's bound Pod tokens to a year).
pub const SERVICE_ACCOUNT_TOKEN_SECONDS: i64 = 365 * 86_400;

/// The TokenRequest for a serviceAccount volume of the VMI `name` (uid `uid`). Pure.
pub fn token_request(name: &str, uid: &str) -> TokenRequest {
    TokenRequest {
        spec: TokenRequestSpec {
            // The API server's own audience.
            audiences: Vec::new(),
            expiration_seconds: Some(SERVICE_ACCOUNT_TOKEN_SECONDS),
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("kubevirt.io/v1".into()),
                kind: Some("VirtualMachineInstance".into()),
                name: Some(name.into()),
                uid: Some(uid.into()),
            }),
        },
        ..Default::default()
    }
}

impl Agent {
    /// Looks up what the VMI's volumes reference.
    pub(super) async fn resolve_refs(
        &self,
        vmi: &VirtualMachineInstance,
    ) -> Result<ResolvedRefs, AgentError> {
        let (ns, _) = ns_name(vmi);
        let mut refs = ResolvedRefs::default();
        let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), &ns);
        let pvs: Api<PersistentVolume> = Api::all(self.client.clone());
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &ns);
        let cms: Api<ConfigMap> = Api::namespaced(self.client.clone(), &ns);
        let sas: Api<ServiceAccount> = Api::namespaced(self.client.clone(), &ns);
        refs.api_ca_pem = self.opts.api_ca_pem.clone();
        let Some(spec) = &vmi.spec else {
            return Ok(refs);
        };
        for v in spec.volumes.iter().flatten() {
            let claim = v
                .persistent_volume_claim
                .as_ref()
                .map(|c| c.claim_name.clone())
                .or_else(|| v.data_volume.as_ref().map(|d| d.name.clone()))
                .or_else(|| {
                    v.ephemeral
                        .as_ref()
                        .and_then(|e| e.persistent_volume_claim.as_ref())
                        .map(|c| c.claim_name.clone())
                });
            if let Some(claim) = claim
                && let Some(pvc) = pvcs.get_opt(&claim).await.map_err(kube_err)?
            {
                let modes = pvc.spec.as_ref().and_then(|s| s.access_modes.clone());
                refs.claim_access_modes
                    .insert(claim.clone(), modes.unwrap_or_default());
                let pv_name = pvc.spec.as_ref().and_then(|s| s.volume_name.clone());
                if let Some(pv_name) = pv_name
                    && let Some(pv) = pvs.get_opt(&pv_name).await.map_err(kube_err)?
                {
                    let spec = pv.spec.unwrap_or_default();
                    let path = spec
                        .host_path
                        .map(|h| h.path)
                        .or_else(|| spec.local.map(|l| l.path));
                    if let Some(path) = path {
                        let ours = crate::hostpath::made_by_us(
                            Path::new(&path),
                            pv.metadata
                                .annotations
                                .as_ref()
                                .and_then(|a| a.get("pv.kubernetes.io/provisioned-by"))
                                .map(String::as_str),
                        );
                        let ro = spec
                            .access_modes
                            .unwrap_or_default()
                            .iter()
                            .all(|m| m == "ReadOnlyMany");
                        refs.claims.insert(
                            claim,
                            ClaimInfo {
                                path: path.into(),
                                read_only: ro,
                                ours,
                            },
                        );
                    }
                }
            }
            let mut secret_names = Vec::new();
            for ci in [&v.cloud_init_no_cloud, &v.cloud_init_config_drive]
                .into_iter()
                .flatten()
            {
                secret_names.extend(ci.secret_ref.as_ref().map(|r| r.name.clone()));
                secret_names.extend(ci.network_data_secret_ref.as_ref().map(|r| r.name.clone()));
            }
            secret_names.extend(v.secret.as_ref().and_then(|s| s.secret_name.clone()));
            for s in secret_names {
                if let Some(sec) = secrets.get_opt(&s).await.map_err(kube_err)? {
                    let mut data: BTreeMap<String, Vec<u8>> = sec
                        .data
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(k, v)| (k, v.0))
                        .collect();
                    for (k, v) in sec.string_data.unwrap_or_default() {
                        data.insert(k, v.into_bytes());
                    }
                    refs.secrets.insert(s, data);
                }
            }
            if let Some(cm_name) = v.config_map.as_ref().and_then(|c| c.name.clone())
                && let Some(cm) = cms.get_opt(&cm_name).await.map_err(kube_err)?
            {
                let mut data: BTreeMap<String, Vec<u8>> = cm
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, v.into_bytes()))
                    .collect();
                for (k, v) in cm.binary_data.unwrap_or_default() {
                    data.insert(k, v.0);
                }
                refs.config_maps.insert(cm_name, data);
            }
            if let Some(sa) = v
                .service_account
                .as_ref()
                .and_then(|s| s.service_account_name.clone())
                .filter(|s| !s.is_empty() && !refs.service_account_tokens.contains_key(s))
            {
                let (name, uid) = (
                    vmi.metadata.name.clone().unwrap_or_default(),
                    vmi.metadata.uid.clone().unwrap_or_default(),
                );
                match sas
                    .create_token_request(&sa, &PostParams::default(), &token_request(&name, &uid))
                    .await
                {
                    Ok(tr) => {
                        let token = tr.status.map(|s| s.token).unwrap_or_default();
                        refs.service_account_tokens.insert(sa, token);
                    }
                    // A missing ServiceAccount: planning fails the VMI naming the field.
                    Err(kube::Error::Api(s))
                        if s.code == 404 && s.message.contains("serviceaccounts") => {}
                    Err(e) => return Err(kube_err(e)),
                }
            }
        }
        Ok(refs)
    }
}
