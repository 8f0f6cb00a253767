//! Honour or refuse: VMI fields that need something a node may not offer (confidential
//! computing, DRA claims for GPUs and host devices, hugepages, dedicated CPUs). A node that cannot
//! honour one is filtered out with a reason naming the field, so the VMI stays unschedulable
//! instead of running without it.

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use k8s_openapi::api::core::v1::Node;

/// KubeVirt's extended resources for AMD SEV and Intel TDX.
pub const SEV_RESOURCE: &str = "devices.kubevirt.io/sev";
pub const TDX_RESOURCE: &str = "devices.kubevirt.io/tdx";
/// The label KubeVirt puts on nodes whose kubelet runs the static CPU manager.
pub const CPU_MANAGER_LABEL: &str = "cpumanager";

fn allocatable(node: &Node, resource: &str) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get(resource))
        .and_then(|q| ferrovirt_api::quantity::millis(&q.0).ok())
        .is_some_and(|v| v > 0)
}

fn reason(field: &str, why: &str) -> String {
    format!("node(s) cannot honour {field}: {why}")
}

/// Reasons `node` cannot honour `vmi`'s requirements (empty when it can).
pub fn unmet(vmi: &VirtualMachineInstance, node: &Node) -> Vec<String> {
    let mut out = Vec::new();
    let Some(spec) = vmi.spec.as_ref() else {
        return out;
    };
    let d = &spec.domain;
    if let Some(ls) = &d.launch_security {
        if (ls.sev.is_some() || ls.snp.is_some()) && !allocatable(node, SEV_RESOURCE) {
            out.push(reason("spec.domain.launchSecurity", "no AMD SEV"));
        }
        if ls.tdx.is_some() && !allocatable(node, TDX_RESOURCE) {
            out.push(reason("spec.domain.launchSecurity.tdx", "no Intel TDX"));
        }
    }
    // Device-plugin resources are counted by `super::devices`; DRA claims are refused.
    for (i, g) in d.devices.gpus.iter().flatten().enumerate() {
        if g.device_name.is_none() {
            out.push(reason(
                &format!("spec.domain.devices.gpus[{i}].claimName"),
                "DRA claims are not supported",
            ));
        }
    }
    for (i, h) in d.devices.host_devices.iter().flatten().enumerate() {
        if h.device_name.is_none() {
            out.push(reason(
                &format!("spec.domain.devices.hostDevices[{i}].claimName"),
                "DRA claims are not supported",
            ));
        }
    }
    if spec.resource_claims.as_ref().is_some_and(|c| !c.is_empty()) {
        out.push(reason(
            "spec.resourceClaims",
            "DRA claims are not supported",
        ));
    }
    for (i, n) in spec.networks.iter().flatten().enumerate() {
        if n.resource_claim.is_some() {
            out.push(reason(
                &format!("spec.networks[{i}].resourceClaim"),
                "DRA claims are not supported",
            ));
        }
    }
    if let Some(size) = d
        .memory
        .as_ref()
        .and_then(|m| m.hugepages.as_ref())
        .and_then(|h| h.page_size.as_deref())
        && !allocatable(node, &format!("hugepages-{size}"))
    {
        out.push(reason(
            "spec.domain.memory.hugepages.pageSize",
            &format!("no hugepages-{size}"),
        ));
    }
    let dedicated = d
        .cpu
        .as_ref()
        .is_some_and(|c| c.dedicated_cpu_placement == Some(true));
    let labelled = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(CPU_MANAGER_LABEL))
        .is_some_and(|v| v == "true");
    if dedicated && !labelled {
        out.push(reason(
            "spec.domain.cpu.dedicatedCpuPlacement",
            "no CPU manager",
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vmi(domain: serde_json::Value, extra: serde_json::Value) -> VirtualMachineInstance {
        let mut spec = json!({"domain": domain});
        if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
            s.extend(e.clone());
        }
        serde_json::from_value(json!({"metadata": {"name": "v"}, "spec": spec})).unwrap()
    }

    fn node(alloc: serde_json::Value, labels: serde_json::Value) -> Node {
        serde_json::from_value(json!({"metadata": {"name": "n", "labels": labels},
                                      "status": {"allocatable": alloc}}))
        .unwrap()
    }

    fn plain() -> Node {
        node(json!({"cpu": "4", "memory": "8Gi"}), json!({}))
    }

    fn one(v: &VirtualMachineInstance, n: &Node, field: &str) {
        let r = unmet(v, n);
        assert!(r.len() == 1 && r[0].contains(field), "{r:?}");
    }

    #[test]
    fn launch_security_needs_sev() {
        let v = vmi(json!({"launchSecurity": {"sev": {}}}), json!({}));
        one(&v, &plain(), "spec.domain.launchSecurity");
        assert!(unmet(&v, &node(json!({SEV_RESOURCE: "1"}), json!({}))).is_empty());
    }

    #[test]
    fn tdx_needs_tdx() {
        let v = vmi(json!({"launchSecurity": {"tdx": {}}}), json!({}));
        one(&v, &plain(), "spec.domain.launchSecurity.tdx");
    }

    #[test]
    fn device_plugin_resources_are_left_to_the_count() {
        let v = vmi(
            json!({"devices": {"gpus": [{"name": "g", "deviceName": "nvidia.com/A"}],
                               "hostDevices": [{"name": "h", "deviceName": "intel.com/qat"}]}}),
            json!({}),
        );
        assert!(unmet(&v, &plain()).is_empty());
    }

    #[test]
    fn dra_gpu_claim_is_refused() {
        let v = vmi(
            json!({"devices": {"gpus": [{"name": "g", "claimName": "c", "requestName": "r"}]}}),
            json!({}),
        );
        one(&v, &plain(), "spec.domain.devices.gpus[0].claimName");
    }

    #[test]
    fn dra_resource_claims_are_refused() {
        let v = vmi(
            json!({}),
            json!({"resourceClaims": [{"name": "c", "resourceClaimName": "x"}]}),
        );
        one(&v, &plain(), "spec.resourceClaims");
    }

    #[test]
    fn dra_network_claim_is_refused() {
        let v = vmi(
            json!({}),
            json!({"networks": [{"name": "n", "resourceClaim": {"claimName": "c"}}]}),
        );
        one(&v, &plain(), "spec.networks[0].resourceClaim");
    }

    #[test]
    fn hugepages_need_configured_pages() {
        let v = vmi(
            json!({"memory": {"hugepages": {"pageSize": "2Mi"}}}),
            json!({}),
        );
        one(&v, &plain(), "spec.domain.memory.hugepages.pageSize");
        assert!(unmet(&v, &node(json!({"hugepages-2Mi": "1Gi"}), json!({}))).is_empty());
    }

    #[test]
    fn dedicated_cpus_need_a_cpu_manager() {
        let v = vmi(json!({"cpu": {"dedicatedCpuPlacement": true}}), json!({}));
        one(&v, &plain(), "spec.domain.cpu.dedicatedCpuPlacement");
        assert!(unmet(&v, &node(json!({}), json!({CPU_MANAGER_LABEL: "true"}))).is_empty());
    }
}
