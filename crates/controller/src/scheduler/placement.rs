//! The KubeVirt CR's workloads placement (`spec.workloads.nodePlacement`, fed by HyperConverged
//! `spec.workloads.nodePlacement`): in KubeVirt it places virt-handler, so a VM can only run on
//! a node it selects. ferrovirt's agents run where the administrator starts them, so the
//! scheduler keeps VMIs (and migration targets) to the nodes the placement's `nodeSelector`
//! and required node affinity select. Its `tolerations` (where the handler may run despite
//! taints) are refused at HyperConverged admission: they have no meaning for an agent the
//! administrator started.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeSelector};
use serde_json::Value;

use super::selectors;

/// Why a node outside the placement does not fit.
pub const REASON_OUTSIDE: &str =
    "node(s) didn't match the workloads placement (KubeVirt spec.workloads.nodePlacement)";

/// The nodes VMs may run on.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkloadsPlacement {
    pub node_selector: BTreeMap<String, String>,
    /// `affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution`.
    pub required: Option<NodeSelector>,
}

impl WorkloadsPlacement {
    /// The placement of a KubeVirt CR's spec; None when it sets none (every node).
    pub fn from_kubevirt_spec(spec: Option<&Value>) -> Option<WorkloadsPlacement> {
        let p = spec?.pointer("/workloads/nodePlacement")?;
        let node_selector: BTreeMap<String, String> = p
            .get("nodeSelector")
            .and_then(|s| serde_json::from_value(s.clone()).ok())
            .unwrap_or_default();
        let required: Option<NodeSelector> = p
            .pointer("/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution")
            .and_then(|s| serde_json::from_value(s.clone()).ok());
        (!node_selector.is_empty() || required.is_some()).then_some(WorkloadsPlacement {
            node_selector,
            required,
        })
    }
}

/// Why `node` is outside `placement` (None: inside, or no placement).
pub fn unmet(placement: Option<&WorkloadsPlacement>, node: &Node) -> Option<String> {
    let p = placement?;
    let inside = selectors::matches_node_selector_map(&p.node_selector, node)
        && p.required
            .as_ref()
            .is_none_or(|r| selectors::matches_node_selector(r, node));
    (!inside).then(|| REASON_OUTSIDE.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(labels: Value) -> Node {
        serde_json::from_value(json!({"metadata": {"name": "n", "labels": labels}})).unwrap()
    }

    #[test]
    fn selector_and_required_affinity_both_hold() {
        let spec = json!({"workloads": {"nodePlacement": {
            "nodeSelector": {"role": "vms"},
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "zone", "operator": "In", "values": ["a", "b"]}]}]}}}}}});
        let p = WorkloadsPlacement::from_kubevirt_spec(Some(&spec)).unwrap();
        assert_eq!(
            unmet(Some(&p), &node(json!({"role": "vms", "zone": "a"}))),
            None
        );
        assert!(unmet(Some(&p), &node(json!({"role": "vms", "zone": "c"}))).is_some());
        assert_eq!(
            unmet(Some(&p), &node(json!({"zone": "a"}))).as_deref(),
            Some(REASON_OUTSIDE)
        );
    }

    #[test]
    fn no_placement_is_every_node() {
        assert_eq!(WorkloadsPlacement::from_kubevirt_spec(None), None);
        for spec in [
            json!({}),
            json!({"workloads": {}}),
            json!({"workloads": {"nodePlacement": {}}}),
        ] {
            assert_eq!(WorkloadsPlacement::from_kubevirt_spec(Some(&spec)), None);
        }
        assert_eq!(unmet(None, &node(json!({}))), None);
    }
}
