//! Volume topology, as Kubernetes' VolumeBinding filter does it for bound claims: a VMI
//! whose claims are bound to PersistentVolumes with `spec.nodeAffinity` (the `local`
//! class's volumes live on one node) may only run on nodes matching every such affinity.
//! Unbound WaitForFirstConsumer claims add no constraint: they are provisioned on the node
//! the VMI is scheduled to.

use k8s_openapi::api::core::v1::{Node, NodeSelector, PersistentVolume, PersistentVolumeClaim};

use super::selectors;

/// Kubernetes' reason for nodes that do not match a bound volume's node affinity.
pub const REASON_VOLUME_AFFINITY: &str = "node(s) had volume node affinity conflict";

/// The required node selectors of the PVs the given (already looked-up) claims are bound to.
pub fn required_selectors(
    claims: &[PersistentVolumeClaim],
    pvs: &[PersistentVolume],
) -> Vec<NodeSelector> {
    claims
        .iter()
        .filter_map(|c| c.spec.as_ref()?.volume_name.as_deref())
        .filter_map(|name| {
            pvs.iter()
                .find(|pv| pv.metadata.name.as_deref() == Some(name))
        })
        .filter_map(|pv| pv.spec.as_ref()?.node_affinity.as_ref()?.required.clone())
        .collect()
}

/// Whether `node` satisfies every volume node selector.
pub fn fits(selectors_: &[NodeSelector], node: &Node) -> bool {
    selectors_
        .iter()
        .all(|s| selectors::matches_node_selector(s, node))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn local_pv(name: &str, node: &str) -> PersistentVolume {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"local": {"path": "/v"}, "nodeAffinity": {"required": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}
            ]}}}
        }))
        .unwrap()
    }

    fn claim(name: &str, volume: Option<&str>) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"volumeName": volume}
        }))
        .unwrap()
    }

    fn node(name: &str) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}
        }))
        .unwrap()
    }

    #[test]
    fn bound_local_volumes_pin_the_node() {
        let pvs = [
            local_pv("pv-a", "node2"),
            serde_json::from_value(json!({
                "metadata": {"name": "pv-shared"}, "spec": {"hostPath": {"path": "/s"}}
            }))
            .unwrap(),
        ];
        let claims = [
            claim("a", Some("pv-a")),
            claim("s", Some("pv-shared")),
            claim("wffc", None),
        ];
        let sel = required_selectors(&claims, &pvs);
        assert_eq!(sel.len(), 1);
        assert!(fits(&sel, &node("node2")));
        assert!(!fits(&sel, &node("node1")));
        assert!(fits(&[], &node("node1")));
        let vmi: ferrovirt_api::kubevirt::vmi::VirtualMachineInstance =
            serde_json::from_value(json!({
                "metadata": {"name": "v"},
                "spec": {"domain": {"devices": {}}, "volumes": [
                    {"name": "a", "persistentVolumeClaim": {"claimName": "a"}},
                    {"name": "b", "dataVolume": {"name": "b"}},
                    {"name": "c", "ephemeral": {"persistentVolumeClaim": {"claimName": "c"}}},
                    {"name": "d", "emptyDisk": {"capacity": "1Gi"}}
                ]}
            }))
            .unwrap();
        assert_eq!(crate::storage::pvc_loop::claims_of(&vmi), ["a", "b", "c"]);
    }
}
