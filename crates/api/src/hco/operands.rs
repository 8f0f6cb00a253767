//! The kinds a HyperConverged owns besides KubeVirt and CDI: ssp.kubevirt.io/v1beta2 SSP and
//! networkaddonsoperator.network.kubevirt.io/v1 NetworkAddonsConfig. Field names are the
//! published ones; ferrovirt deploys none of SSP's or the network operator's components, so
//! every field is kept as given (typed where the HyperConverged reconcile writes it).

use serde_json::{Map, Value};

use crate::kubevirt::misc::{KubeVirtCondition, NodePlacement};

resource! {
    /// Scheduling, Scale and Performance: common templates and their validator.
    Ssp, SspSpec, OperandStatus
}

kstruct! {
    /// SSP's configuration.
    pub struct SspSpec {
        /// Where the common VM templates go.
        pub common_templates: Option<CommonTemplates>,
        /// The template validator's replicas and placement.
        pub template_validator: Option<TemplateValidator>,
        #[serde(flatten)]
        pub other: Map<String, Value>,
    }
}

kstruct! {
    /// The common templates' namespace and the golden image import crons.
    pub struct CommonTemplates {
        /// Namespace the common templates are put in.
        pub namespace: Option<String>,
        /// DataImportCron templates for golden images.
        pub data_import_cron_templates: Option<Vec<Value>>,
    }
}

kstruct! {
    /// The template validator deployment.
    pub struct TemplateValidator {
        pub replicas: Option<i32>,
        pub placement: Option<NodePlacement>,
    }
}

resource! {
    /// Cluster Network Addons: which network components run (Multus, Linux bridge CNI,
    /// KubeMacPool, …).
    NetworkAddonsConfig, NetworkAddonsConfigSpec, OperandStatus
}

kstruct! {
    /// The network addons to deploy; an absent addon is not deployed.
    pub struct NetworkAddonsConfigSpec {
        /// Multus, the meta CNI plugin for secondary networks.
        pub multus: Option<Map<String, Value>>,
        /// The Linux bridge CNI plugin.
        pub linux_bridge: Option<Map<String, Value>>,
        /// KubeMacPool: MAC addresses from a pool for VM interfaces.
        pub kube_mac_pool: Option<Map<String, Value>>,
        /// The Open vSwitch CNI plugin.
        pub ovs: Option<Map<String, Value>>,
        /// The macvtap CNI plugin.
        pub macvtap: Option<Map<String, Value>>,
        /// DNS names for secondary interfaces.
        #[serde(rename = "kubeSecondaryDNS")]
        pub kube_secondary_dns: Option<Map<String, Value>>,
        /// Hot-plugging of secondary networks.
        pub multus_dynamic_networks: Option<Map<String, Value>>,
        /// Pull policy of the addon images.
        pub image_pull_policy: Option<String>,
        /// Where infra and workload components run.
        pub placement_configuration: Option<PlacementConfiguration>,
        #[serde(flatten)]
        pub other: Map<String, Value>,
    }
}

kstruct! {
    /// Placement of the network components.
    pub struct PlacementConfiguration {
        pub infra: Option<NodePlacement>,
        pub workloads: Option<NodePlacement>,
    }
}

kstruct! {
    /// An operand's observed state (SSP, NetworkAddonsConfig).
    pub struct OperandStatus {
        pub phase: Option<String>,
        pub conditions: Option<Vec<KubeVirtCondition>>,
        pub observed_version: Option<String>,
        pub target_version: Option<String>,
        pub operator_version: Option<String>,
        pub observed_generation: Option<i64>,
        #[serde(flatten)]
        pub other: Map<String, Value>,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn keeps_unmodelled_fields() {
        let nac: super::NetworkAddonsConfig = serde_json::from_value(json!({
            "spec": {"multus": {}, "linuxBridge": {}, "selfSignConfiguration": {"caRotateInterval": "48h"}}
        }))
        .unwrap();
        let spec = nac.spec.unwrap();
        assert!(spec.multus.is_some() && spec.ovs.is_none());
        assert!(spec.other.contains_key("selfSignConfiguration"));
        let ssp: super::Ssp = serde_json::from_value(
            json!({"spec": {"commonTemplates": {"namespace": "openshift"}}}),
        )
        .unwrap();
        assert_eq!(
            ssp.spec
                .unwrap()
                .common_templates
                .unwrap()
                .namespace
                .as_deref(),
            Some("openshift")
        );
    }
}
