//! Primary user-defined networks (k8s.ovn.org) on the node: a VMI whose namespace is labelled
//! `k8s.ovn.org/primary-user-defined-network` asks for its pod-network interface to land on
//! the namespace's Primary UDN. ferrovirt does not carry that data plane out yet, so such a
//! VMI is refused naming its pod network, never silently put on the pod network.
//! [`primary_udn_refusal`] is the pure decision; [`check`] reads the namespace.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Namespace;
use kube::{Api, Client};

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_api::udn::PRIMARY_NAMESPACE_LABEL;

use crate::error::AgentError;

/// The refusal for a VMI on the pod network in a namespace that asks for a Primary UDN.
pub fn primary_udn_refusal(
    vmi: &VirtualMachineInstance,
    ns_labels: &BTreeMap<String, String>,
) -> Option<AgentError> {
    if !ns_labels.contains_key(PRIMARY_NAMESPACE_LABEL) {
        return None;
    }
    let spec = vmi.spec.as_ref()?;
    let field = match spec.networks.as_deref() {
        None => "spec.networks".to_string(),
        Some(nets) => {
            let i = nets.iter().position(|n| n.pod.is_some())?;
            format!("spec.networks[{i}].pod")
        }
    };
    let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
    Some(AgentError::unsupported(
        field,
        format!(
            "namespace {ns} is labelled {PRIMARY_NAMESPACE_LABEL}: its pod network is a Primary \
             UserDefinedNetwork, whose data plane ferrovirt does not carry out yet"
        ),
    ))
}

/// Refuses the VMI when its namespace asks for a Primary UDN (see [`primary_udn_refusal`]).
pub async fn check(client: &Client, vmi: &VirtualMachineInstance) -> Result<(), AgentError> {
    let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
    let labels = match Api::<Namespace>::all(client.clone()).get_opt(ns).await {
        Ok(n) => n.and_then(|n| n.metadata.labels).unwrap_or_default(),
        Err(e) => return Err(AgentError::Reference(format!("namespace {ns}: {e}"))),
    };
    match primary_udn_refusal(vmi, &labels) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_pod_network_vmi_in_a_primary_udn_namespace_is_refused_naming_it() {
        let vmi = |nets: serde_json::Value| -> VirtualMachineInstance {
            serde_json::from_value(json!({"metadata": {"name": "v", "namespace": "a"},
                "spec": {"domain": {"devices": {}}, "networks": nets}}))
            .unwrap()
        };
        let labelled = BTreeMap::from([(PRIMARY_NAMESPACE_LABEL.to_string(), String::new())]);
        let on_pod =
            vmi(json!([{"name": "s", "multus": {"networkName": "x"}}, {"name": "p", "pod": {}}]));
        let e = primary_udn_refusal(&on_pod, &labelled)
            .expect("refused")
            .to_string();
        assert!(
            e.contains("spec.networks[1].pod") && e.contains("Primary"),
            "{e}"
        );
        assert!(primary_udn_refusal(&on_pod, &BTreeMap::new()).is_none());
        let only_multus = vmi(json!([{"name": "s", "multus": {"networkName": "x"}}]));
        assert!(primary_udn_refusal(&only_multus, &labelled).is_none());
    }
}
