//! Host devices as counted resources (KubeVirt's device plugins, kube-scheduler's
//! NodeResourcesFit over extended resources): a VMI's `gpus[].deviceName` and
//! `hostDevices[].deviceName` each take one device of that resource; a node offers
//! `status.allocatable[<resource>]` of them, less those the VMIs bound there (not finished)
//! hold. A node without enough is filtered out with a reason naming the field and saying
//! `Insufficient <resource>`.

use std::collections::BTreeMap;

use ferrovirt_api::kubevirt::host_devices;
use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use k8s_openapi::api::core::v1::Node;

/// Devices per resource name.
pub type DeviceCounts = BTreeMap<String, u64>;

/// The devices `vmi` asks for, per resource.
pub fn wanted(vmi: &VirtualMachineInstance) -> DeviceCounts {
    vmi.spec
        .as_ref()
        .map(host_devices::request_counts)
        .unwrap_or_default()
}

/// How many devices of `resource` `node` offers (`status.allocatable`; 0 when absent).
pub fn allocatable(node: &Node, resource: &str) -> u64 {
    node.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get(resource))
        .and_then(|q| ferrovirt_api::quantity::millis(&q.0).ok())
        .map_or(0, |m| m / 1000)
}

/// Adds `more` into `into`.
pub fn add(into: &mut DeviceCounts, more: &DeviceCounts) {
    for (r, n) in more {
        *into.entry(r.clone()).or_insert(0) += n;
    }
}

/// Why `node` cannot take `vmi`'s devices with `used` of them already held there: one
/// reason per short resource, naming the first field that asks for it. Empty when they fit.
pub fn insufficient(vmi: &VirtualMachineInstance, used: &DeviceCounts, node: &Node) -> Vec<String> {
    let Some(spec) = vmi.spec.as_ref() else {
        return Vec::new();
    };
    let want = host_devices::request_counts(spec);
    let mut out = Vec::new();
    let mut named = std::collections::BTreeSet::new();
    for (field, r) in host_devices::requested(spec) {
        let free = allocatable(node, &r).saturating_sub(used.get(&r).copied().unwrap_or(0));
        if want.get(&r).copied().unwrap_or(0) > free && named.insert(r.clone()) {
            out.push(format!("node(s) cannot honour {field}: Insufficient {r}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vmi(devices: serde_json::Value) -> VirtualMachineInstance {
        serde_json::from_value(
            json!({"metadata": {"name": "v"}, "spec": {"domain": {"devices": devices}}}),
        )
        .unwrap()
    }

    fn node(alloc: serde_json::Value) -> Node {
        serde_json::from_value(json!({"metadata": {"name": "n"}, "status": {"allocatable": alloc}}))
            .unwrap()
    }

    #[test]
    fn devices_are_counted_against_what_the_node_allocates() {
        let two = vmi(json!({"hostDevices": [
            {"name": "a", "deviceName": "example.org/nic"},
            {"name": "b", "deviceName": "example.org/nic"}],
            "gpus": [{"name": "g", "deviceName": "nvidia.com/T4"}]}));
        assert_eq!(wanted(&two).get("example.org/nic"), Some(&2));
        let n = node(json!({"example.org/nic": "2", "nvidia.com/T4": "1"}));
        assert!(insufficient(&two, &DeviceCounts::new(), &n).is_empty());
        let mut used = DeviceCounts::new();
        add(&mut used, &[("example.org/nic".to_string(), 1)].into());
        assert_eq!(
            insufficient(&two, &used, &n),
            [
                "node(s) cannot honour spec.domain.devices.hostDevices[0].deviceName: \
              Insufficient example.org/nic"
            ]
        );
        // Zero, or absent: none.
        let empty = node(json!({"example.org/nic": "0"}));
        assert_eq!(insufficient(&two, &DeviceCounts::new(), &empty).len(), 2);
        assert_eq!(
            insufficient(&two, &DeviceCounts::new(), &node(json!({})))[0],
            "node(s) cannot honour spec.domain.devices.gpus[0].deviceName: Insufficient nvidia.com/T4"
        );
        assert!(insufficient(&vmi(json!({})), &DeviceCounts::new(), &empty).is_empty());
    }
}
