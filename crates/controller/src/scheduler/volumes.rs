//! Volume topology, as Kubernetes' VolumeBinding filter does it for bound claims: a VMI
//! whose claims are bound to PersistentVolumes with `spec.nodeAffinity` (the `local`
//! class's volumes live on one node) may only run on nodes matching every such affinity.
//! Unbound WaitForFirstConsumer claims add no constraint: they are provisioned on the node
//! the VMI is scheduled to.
//!
//! Shared filesystems: a claim whose StorageClass declares a shared mount
//! (`ferrovirt.io/shared-mount`, docs/storage.md) can only be used on a node whose agent found
//! that mount ([`ferrovirt_storage::shared_mount::MOUNTED_ANNOTATION`] lists the class); other
//! nodes are refused with a reason naming the claim and the class.

use k8s_openapi::api::core::v1::{Node, NodeSelector, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;

use ferrovirt_api::shared_mount;

use crate::storage::classes;

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

/// The claims (already looked up) that are being deleted (pvc-protection keeps them
/// Terminating while they are in use; no new user may start on one).
pub fn deleting_claims(claims: &[PersistentVolumeClaim]) -> Vec<String> {
    claims
        .iter()
        .filter(|c| c.metadata.deletion_timestamp.is_some())
        .filter_map(|c| c.metadata.name.clone())
        .collect()
}

/// The unschedulable message of a VMI using claims that are being deleted (Kubernetes'
/// words), or None when it uses none.
pub fn deleting_claim_message(deleting: &[String], num_nodes: usize) -> Option<String> {
    let first = deleting.first()?;
    Some(format!(
        "0/{num_nodes} nodes are available: persistentvolumeclaim \"{first}\" is being deleted."
    ))
}

/// A claim of the VMI whose class keeps its volumes on a declared shared filesystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedMountNeed {
    pub claim: String,
    pub class: String,
}

/// The claims (already looked up) whose class declares a shared mount: the class is the bound
/// PV's, else the claim's `storageClassName`, else the default class.
pub fn shared_mount_needs(
    claims: &[PersistentVolumeClaim],
    pvs: &[PersistentVolume],
    all_classes: &[StorageClass],
) -> Vec<SharedMountNeed> {
    claims
        .iter()
        .filter_map(|c| {
            let spec = c.spec.as_ref();
            let pv_class = spec
                .and_then(|s| s.volume_name.as_deref())
                .and_then(|n| pvs.iter().find(|pv| pv.metadata.name.as_deref() == Some(n)))
                .and_then(|pv| pv.spec.as_ref()?.storage_class_name.clone());
            let class_name = pv_class
                .or_else(|| spec.and_then(|s| s.storage_class_name.clone()))
                .or_else(|| classes::default_class(all_classes)?.metadata.name.clone())?;
            let class = all_classes
                .iter()
                .find(|k| k.metadata.name.as_deref() == Some(class_name.as_str()))?;
            classes::shared_mount(class)?.ok()?;
            Some(SharedMountNeed {
                claim: c.metadata.name.clone().unwrap_or_default(),
                class: class_name,
            })
        })
        .collect()
}

/// Why `node` cannot take these claims: the first whose class's mount the node does not
/// report.
pub fn unmounted_reason(needs: &[SharedMountNeed], node: &Node) -> Option<String> {
    let listed = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(shared_mount::MOUNTED_ANNOTATION))
        .map(String::as_str);
    needs
        .iter()
        .find(|n| !shared_mount::lists(listed, &n.class))
        .map(|n| {
            format!(
                "node(s) did not have the shared filesystem of StorageClass {:?} (claim {:?}) mounted",
                n.class, n.claim
            )
        })
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
    fn claims_being_deleted_keep_a_vmi_unscheduled() {
        let mut gone: PersistentVolumeClaim = claim("old", Some("pv1"));
        gone.metadata.deletion_timestamp =
            serde_json::from_value(json!("2026-12-03T00:00:00Z")).unwrap();
        let claims = [claim("fine", Some("pv2")), gone];
        let deleting = deleting_claims(&claims);
        assert_eq!(deleting, ["old"]);
        assert_eq!(
            deleting_claim_message(&deleting, 3).as_deref(),
            Some("0/3 nodes are available: persistentvolumeclaim \"old\" is being deleted.")
        );
        assert_eq!(deleting_claim_message(&[], 3), None);
    }

    #[test]
    fn shared_mount_classes_need_nodes_that_report_the_mount() {
        let class = |name: &str, mount: Option<&str>| -> StorageClass {
            serde_json::from_value(json!({
                "metadata": {"name": name},
                "provisioner": crate::storage::classes::PROVISIONER_SHARED,
                "parameters": mount.map(|m| json!({shared_mount::MOUNT_PARAMETER: m})),
            }))
            .unwrap()
        };
        let all = [
            class("vmstore", Some("/mnt/vmstore")),
            class("shared", None),
        ];
        let with_class = |name: &str, c: &str| -> PersistentVolumeClaim {
            serde_json::from_value(json!({
                "metadata": {"name": name}, "spec": {"storageClassName": c}
            }))
            .unwrap()
        };
        let pv: PersistentVolume = serde_json::from_value(json!({
            "metadata": {"name": "pv-b"}, "spec": {"storageClassName": "vmstore"}
        }))
        .unwrap();
        let claims = [
            with_class("disk", "vmstore"),
            with_class("plain", "shared"),
            claim("bound", Some("pv-b")),
            claim("no-class", None),
        ];
        let needs = shared_mount_needs(&claims, std::slice::from_ref(&pv), &all);
        assert_eq!(
            needs,
            [
                SharedMountNeed {
                    claim: "disk".into(),
                    class: "vmstore".into()
                },
                SharedMountNeed {
                    claim: "bound".into(),
                    class: "vmstore".into()
                },
            ]
        );
        let mut n1 = node("node1");
        n1.metadata.annotations = Some(
            [(
                shared_mount::MOUNTED_ANNOTATION.to_string(),
                "other,vmstore".to_string(),
            )]
            .into(),
        );
        assert_eq!(unmounted_reason(&needs, &n1), None);
        let reason = unmounted_reason(&needs, &node("node2")).unwrap();
        assert_eq!(
            reason,
            "node(s) did not have the shared filesystem of StorageClass \"vmstore\" (claim \"disk\") mounted"
        );
        assert_eq!(unmounted_reason(&[], &node("node2")), None);
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
