//! What a VMI's volumes reference, looked up by name when its launcher starts: claims with
//! their access modes and the paths of their PersistentVolumes, Secrets (cloud-init, secret
//! volumes) and ConfigMaps.

use std::collections::BTreeMap;
use std::path::Path;

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, PersistentVolumeClaim, Secret};
use kube::api::Api;

use super::{Agent, kube_err, ns_name};
use crate::error::AgentError;
use crate::volumes::{ClaimInfo, ResolvedRefs};

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
        }
        Ok(refs)
    }
}
