//! The KubeVirt CR settings the API server itself applies: the overcommit settings
//! ([`Overcommit`]) behind a VMI's memory request at admission (`memoryOvercommit`, as
//! KubeVirt's VMI mutating webhook) and the launcher-pod CPU a quota charges
//! (`cpuAllocationRatio`), and the default CPU model a VMI without one gets at creation
//! (`cpuModel`, [`ferrovirt_api::kubevirt::cpu_model`]). Read from the store on each use: one
//! small list (ferrovirt keeps one KubeVirt CR) on a VMI create or a quota recount.

use ferrovirt_api::kubevirt::overcommit::Overcommit;
use ferrovirt_store::ListOptions;
use serde_json::Value;

use crate::objects::decode;
use crate::resources;
use crate::server::Shared;

/// The overcommit settings of the cluster's KubeVirt CRs (the HyperConverged's own, else the
/// oldest one's: `order_kubevirts`, as the controllers read them), the defaults when
/// there is none or the store cannot be read.
pub(crate) async fn overcommit(sh: &Shared) -> Overcommit {
    VmiDefaults::read(sh).await.overcommit
}

/// The KubeVirt CR settings a VMI's creation applies.
#[derive(Debug, Clone, Default)]
pub(crate) struct VmiDefaults {
    pub overcommit: Overcommit,
    /// `configuration.cpuModel`: the model a VMI without one gets.
    pub cpu_model: Option<String>,
}

impl VmiDefaults {
    /// Reads the cluster's KubeVirt CRs (the HyperConverged's own, else the oldest one's:
    /// `order_kubevirts`, as the controllers read them); the defaults when there is none or
    /// the store cannot be read.
    pub(crate) async fn read(sh: &Shared) -> VmiDefaults {
        let Some(def) = sh
            .resources
            .lookup("kubevirt.io", "v1", "kubevirts")
            .cloned()
        else {
            return VmiDefaults::default();
        };
        let Ok(list) = sh
            .store
            .list(&resources::list_prefix(&def, None), ListOptions::default())
            .await
        else {
            return VmiDefaults::default();
        };
        let crs: Vec<Value> = list.items.iter().filter_map(|kv| decode(kv).ok()).collect();
        let mut ordered: Vec<&Value> = crs.iter().collect();
        ferrovirt_api::hco::desired::order_kubevirts(&mut ordered);
        VmiDefaults {
            overcommit: Overcommit::from_kubevirts(ordered.iter().copied()),
            cpu_model: ferrovirt_api::kubevirt::cpu_model::default_model(ordered),
        }
    }
}
