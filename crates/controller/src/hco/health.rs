//! What the HyperConverged reports about each platform component (the impure half of
//! `ferrovirt_api::hco::status`): the API server (its `/readyz`), the controllers' leader (the
//! leader Lease), each node agent (its Node's Ready condition, which the node lifecycle loop
//! turns Unknown when the agent's Lease expires) and the importer (`qemu-img` on this machine,
//! which every import and conversion runs).

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::Api;

use ferrovirt_api::hco::status::ComponentHealth;

use crate::runtime::leader::LeaderElectionOptions;

fn component(
    operand: &'static str,
    name: impl Into<String>,
    healthy: bool,
    critical: bool,
    detail: impl Into<String>,
) -> ComponentHealth {
    ComponentHealth {
        operand,
        component: name.into(),
        healthy,
        critical,
        detail: detail.into(),
    }
}

/// What [`node_agents`] reads of each Node (pure): its name and its Ready condition's status,
/// reason and message. The reconcile runs again on a Node change only when this changed (an
/// agent re-reports an unchanged status every 5 minutes and changes none of it).
pub fn node_readiness(nodes: &[std::sync::Arc<Node>]) -> Vec<NodeReadiness> {
    nodes
        .iter()
        .map(|n| {
            let ready = n
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
                .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()));
            (n.metadata.name.clone().unwrap_or_default(), ready)
        })
        .collect()
}

/// A Node's name and its Ready condition's (status, reason, message).
pub type NodeReadiness = (String, Option<(String, Option<String>, Option<String>)>);

/// The node agents' health from the Nodes (pure): one entry per Node (`virt-handler on node
/// N`), plus a critical one when no agent is Ready at all.
pub fn node_agents(nodes: &[Node]) -> Vec<ComponentHealth> {
    let mut out: Vec<ComponentHealth> = nodes
        .iter()
        .map(|n| {
            let name = n.metadata.name.clone().unwrap_or_default();
            let ready = n
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
            let (healthy, detail) = match ready {
                Some(c) if c.status == "True" => (true, "Ready".to_string()),
                Some(c) => (
                    false,
                    format!(
                        "not ready ({}{}{})",
                        c.reason.as_deref().unwrap_or(&c.status),
                        if c.message.is_some() { ": " } else { "" },
                        c.message.as_deref().unwrap_or("")
                    ),
                ),
                None => (false, "not ready (no Ready condition yet)".to_string()),
            };
            component(
                "KubeVirt",
                format!("virt-handler on node {name}"),
                healthy,
                false,
                detail,
            )
        })
        .collect();
    if !out.iter().any(|c| c.healthy) {
        let detail = if out.is_empty() {
            "no node agent has registered a Node"
        } else {
            "no node agent is Ready"
        };
        out.push(component("KubeVirt", "virt-handler", false, true, detail));
    }
    out
}

/// Every component's health now.
pub async fn gather(
    client: &kube::Client,
    leader: &LeaderElectionOptions,
    nodes: &[Node],
    importer: &Result<String, String>,
) -> Vec<ComponentHealth> {
    let mut out = Vec::new();
    let readyz = http::Request::get("/readyz")
        .body(Vec::new())
        .map_err(|e| e.to_string());
    let api = match readyz {
        Ok(req) => client.request_text(req).await.map_err(|e| e.to_string()),
        Err(e) => Err(e),
    };
    out.push(match api {
        Ok(_) => component("KubeVirt", "virt-api", true, true, "ready"),
        Err(e) => component("KubeVirt", "virt-api", false, true, format!("/readyz: {e}")),
    });
    let lease = Api::<Lease>::namespaced(client.clone(), &leader.lease_namespace)
        .get_opt(&leader.lease_name)
        .await;
    let holder = match &lease {
        Ok(Some(l)) => l.spec.as_ref().and_then(|s| s.holder_identity.clone()),
        _ => None,
    };
    out.push(match holder {
        Some(h) => component(
            "KubeVirt",
            "virt-controller",
            true,
            true,
            format!("leader {h}"),
        ),
        None => component(
            "KubeVirt",
            "virt-controller",
            false,
            true,
            format!("the Lease {} has no holder", leader.lease_name),
        ),
    });
    out.extend(node_agents(nodes));
    out.push(match importer {
        Ok(path) => component("CDI", "cdi-importer", true, false, path.clone()),
        Err(e) => component("CDI", "cdi-importer", false, false, e.clone()),
    });
    out
}

/// Where the importer's `qemu-img` is, or why it cannot run.
pub fn importer_tool() -> Result<String, String> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("qemu-img"))
        .find(|p| p.is_file())
        .map(|p| p.display().to_string())
        .ok_or_else(|| "qemu-img is not installed on the controllers' machine".to_string())
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{NodeCondition, NodeStatus};

    use super::*;

    #[test]
    fn a_heartbeat_leaves_the_readiness_as_it_was() {
        let node = |status: &str, beat: &str| -> std::sync::Arc<Node> {
            std::sync::Arc::new(
                serde_json::from_value(serde_json::json!({
                    "metadata": {"name": "n1"},
                    "status": {"conditions": [{"type": "Ready", "status": status,
                        "reason": "AgentReady", "lastHeartbeatTime": beat}]}
                }))
                .unwrap(),
            )
        };
        let a = node_readiness(&[node("True", "2026-01-01T00:00:00Z")]);
        let b = node_readiness(&[node("True", "2026-01-01T00:00:10Z")]);
        let c = node_readiness(&[node("Unknown", "2026-01-01T00:00:10Z")]);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, node_readiness(&[]));
    }

    fn node(name: &str, ready: &str, reason: &str) -> Node {
        Node {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            status: Some(NodeStatus {
                conditions: Some(vec![NodeCondition {
                    type_: "Ready".into(),
                    status: ready.into(),
                    reason: Some(reason.into()),
                    message: Some("Kubelet stopped posting node status.".into()),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_node_that_stopped_reporting_is_named() {
        let h = node_agents(&[
            node("node1", "True", "KubeletReady"),
            node("node2", "Unknown", "NodeStatusUnknown"),
        ]);
        assert_eq!(h.len(), 2);
        assert!(h[0].healthy);
        assert!(!h[1].healthy && !h[1].critical);
        assert_eq!(h[1].component, "virt-handler on node node2");
        assert_eq!(
            h[1].detail,
            "not ready (NodeStatusUnknown: Kubelet stopped posting node status.)"
        );
        let none = node_agents(&[node("node2", "Unknown", "NodeStatusUnknown")]);
        assert!(none.iter().any(|c| c.critical && !c.healthy));
        assert!(node_agents(&[])[0].critical);
    }
}
