//! Read-only Pod views of the platform's components in the platform namespace
//! (`kubevirt-hyperconverged`), so `kubectl get pods -n kubevirt-hyperconverged` shows the
//! platform as `oc get pods -n openshift-cnv` does: `virt-api-0` (the API server answering),
//! `virt-controller-<leader>` (the holder of the controllers' leader Lease) and
//! `virt-handler-<node>` per Node (Ready as the Node's Ready condition). Pure; never stored.

use serde_json::{Value, json};

use crate::hco::desired::PLATFORM_NAMESPACE;

/// The controllers' leader Lease (namespace, name).
pub const LEADER_LEASE: (&str, &str) = ("kube-system", "ferrovirt-controllers");

/// The node a `virt-handler` Pod view stands for (KubeVirt's node label).
pub const NODE_LABEL: &str = "kubevirt.io/nodeName";

/// The label every platform Pod view carries (`kubevirt.io: virt-handler`, …), as KubeVirt's.
pub const COMPONENT_LABEL: &str = "kubevirt.io";

fn pod(name: &str, component: &str, node: Option<&str>, ready: bool, since: &Value) -> Value {
    let ready_str = if ready { "True" } else { "False" };
    let spec =
        json!({"containers": [{"name": component, "image": format!("ferrovirt/{component}")}]});
    // The node is a label, not `spec.nodeName`: `kubectl drain` selects a node's Pods by
    // `spec.nodeName` and would try to evict these views (in KubeVirt, DaemonSet Pods it skips).
    let mut labels = json!({COMPONENT_LABEL: component, "app.kubernetes.io/managed-by": "hco-operator",
                            "app.kubernetes.io/part-of": "hyperconverged-cluster"});
    if let Some(n) = node {
        labels[NODE_LABEL] = json!(n);
    }
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": PLATFORM_NAMESPACE,
            "uid": format!("platform-{name}"),
            "creationTimestamp": since,
            "labels": labels,
        },
        "spec": spec,
        "status": {
            "phase": if ready { "Running" } else { "Unknown" },
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": ready_str},
                {"type": "ContainersReady", "status": ready_str},
            ],
            "containerStatuses": [{
                "name": component, "image": format!("ferrovirt/{component}"), "imageID": "",
                "ready": ready, "restartCount": 0, "started": true,
                "state": {"running": {"startedAt": since}},
            }],
        },
    })
}

/// The component Pods from the Nodes and the leader Lease (both as JSON); `virt-api-0` is as
/// old as `api_since` (the platform namespace's creation).
pub fn pods(nodes: &[Value], leader_lease: Option<&Value>, api_since: &Value) -> Vec<Value> {
    let mut out = vec![pod("virt-api-0", "virt-api", None, true, api_since)];
    if let Some(holder) = leader_lease
        .and_then(|l| l.pointer("/spec/holderIdentity"))
        .and_then(Value::as_str)
        .filter(|h| !h.is_empty())
    {
        let suffix = holder
            .strip_prefix("ferrovirt-controller-")
            .unwrap_or(holder);
        let since = leader_lease
            .and_then(|l| l.pointer("/spec/acquireTime"))
            .cloned()
            .unwrap_or(Value::Null);
        out.push(pod(
            &format!("virt-controller-{suffix}"),
            "virt-controller",
            None,
            true,
            &since,
        ));
    }
    for n in nodes {
        let Some(name) = n.pointer("/metadata/name").and_then(Value::as_str) else {
            continue;
        };
        let ready = n
            .pointer("/status/conditions")
            .and_then(Value::as_array)
            .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
            .is_some_and(|c| c["status"] == "True");
        let since = n
            .pointer("/metadata/creationTimestamp")
            .cloned()
            .unwrap_or(Value::Null);
        out.push(pod(
            &format!("virt-handler-{name}"),
            "virt-handler",
            Some(name),
            ready,
            &since,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn one_pod_per_component_and_node() {
        let nodes = [
            json!({"metadata": {"name": "node1"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}),
            json!({"metadata": {"name": "node2"}, "status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}),
        ];
        let lease = json!({"spec": {"holderIdentity": "ferrovirt-controller-42"}});
        let pods = super::pods(&nodes, Some(&lease), &json!("2026-01-01T00:00:00Z"));
        let names: Vec<&str> = pods
            .iter()
            .filter_map(|p| p.pointer("/metadata/name").and_then(|n| n.as_str()))
            .collect();
        assert_eq!(
            names,
            vec![
                "virt-api-0",
                "virt-controller-42",
                "virt-handler-node1",
                "virt-handler-node2"
            ]
        );
        assert_eq!(pods[3]["status"]["phase"], "Unknown");
        assert_eq!(
            pods[3]["metadata"]["labels"]["kubevirt.io/nodeName"],
            "node2"
        );
        assert!(pods[3]["spec"].get("nodeName").is_none());
        assert_eq!(pods[2]["status"]["containerStatuses"][0]["ready"], true);
    }
}
