//! Only the platform writes a VMI's user-defined network addresses. The VMI annotation
//! `k8s.ovn.org/pod-networks` (written by the user-defined network controller) decides which
//! address the node gives a VMI on a UDN, so a tenant who could write it could take another
//! VMI's address on a network shared with other namespaces. A write that sets, changes or
//! removes it on a VirtualMachineInstance, or in the VMI template of a VirtualMachine,
//! VirtualMachineInstanceReplicaSet or VirtualMachinePool (whose controllers would copy it), is
//! refused (403) unless the writer is in `system:masters` (the server and its controllers).
//! [`offending_field`] is the pure part.

use serde_json::Value;

use ferrovirt_api::udn::POD_NETWORKS_ANNOTATION;

use super::rbac::{MASTERS, UserInfo};
use crate::error::ApiError;

/// Where a kind keeps the annotations of the VMI it is or makes.
fn annotations_path(group: &str, kind: &str) -> Option<(&'static [&'static str], &'static str)> {
    Some(match (group, kind) {
        ("kubevirt.io", "VirtualMachineInstance") => {
            (&["metadata", "annotations"], "metadata.annotations")
        }
        ("kubevirt.io", "VirtualMachine" | "VirtualMachineInstanceReplicaSet") => (
            &["spec", "template", "metadata", "annotations"],
            "spec.template.metadata.annotations",
        ),
        ("pool.kubevirt.io", "VirtualMachinePool") => (
            &[
                "spec",
                "virtualMachineTemplate",
                "spec",
                "template",
                "metadata",
                "annotations",
            ],
            "spec.virtualMachineTemplate.spec.template.metadata.annotations",
        ),
        _ => return None,
    })
}

fn value_at<'a>(obj: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter()
        .try_fold(obj, |v, k| v.get(k))
        .and_then(|a| a.get(POD_NETWORKS_ANNOTATION))
}

/// The field a write of `obj` (over `old`, None on create) sets, changes or removes the
/// annotation at, if it does (pure).
pub fn offending_field(
    group: &str,
    kind: &str,
    obj: &Value,
    old: Option<&Value>,
) -> Option<String> {
    let (path, field) = annotations_path(group, kind)?;
    let new = value_at(obj, path);
    let before = old.and_then(|o| value_at(o, path));
    (new != before).then(|| format!("{field}[{POD_NETWORKS_ANNOTATION}]"))
}

/// Refuses (403) a write by anyone outside `system:masters` that touches the annotation.
pub(crate) fn check(
    user: Option<&UserInfo>,
    group: &str,
    kind: &str,
    obj: &Value,
    old: Option<&Value>,
) -> Result<(), ApiError> {
    let Some(field) = offending_field(group, kind, obj, old) else {
        return Ok(());
    };
    let name = match user {
        Some(u) if u.groups.iter().any(|g| g == MASTERS) => return Ok(()),
        Some(u) => u.name.as_str(),
        None => "",
    };
    Err(ApiError::forbidden(format!(
        "{field}: written by the user-defined network controller only; User {name:?} may not set, \
         change or remove it"
    )))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn setting_changing_or_removing_the_addresses_is_found_elsewhere_nothing() {
        let ann =
            json!({POD_NETWORKS_ANNOTATION: "{\"a/n\":{\"ip_addresses\":[\"10.0.0.9/24\"]}}"});
        let vmi = json!({"metadata": {"name": "v", "annotations": ann}});
        let plain = json!({"metadata": {"name": "v", "annotations": {"x": "y"}}});
        let g = "kubevirt.io";
        assert_eq!(
            offending_field(g, "VirtualMachineInstance", &vmi, None).as_deref(),
            Some("metadata.annotations[k8s.ovn.org/pod-networks]")
        );
        assert!(offending_field(g, "VirtualMachineInstance", &vmi, Some(&vmi)).is_none());
        assert!(offending_field(g, "VirtualMachineInstance", &plain, Some(&vmi)).is_some());
        assert!(offending_field(g, "VirtualMachineInstance", &plain, None).is_none());
        let vm = json!({"spec": {"template": {"metadata": {"annotations": ann}}}});
        assert_eq!(
            offending_field(g, "VirtualMachine", &vm, None).as_deref(),
            Some("spec.template.metadata.annotations[k8s.ovn.org/pod-networks]")
        );
        let pool = json!({"spec": {"virtualMachineTemplate": {"spec": {"template":
            {"metadata": {"annotations": ann}}}}}});
        assert!(offending_field("pool.kubevirt.io", "VirtualMachinePool", &pool, None).is_some());
        assert!(offending_field("", "Pod", &vmi, None).is_none());
    }

    #[test]
    fn only_masters_may() {
        let vmi = json!({"metadata": {"annotations": {POD_NETWORKS_ANNOTATION: "{}"}}});
        let bob = UserInfo {
            name: "bob".into(),
            groups: vec!["system:authenticated".into()],
            ..UserInfo::default()
        };
        let e = check(
            Some(&bob),
            "kubevirt.io",
            "VirtualMachineInstance",
            &vmi,
            None,
        )
        .expect_err("bob may not");
        assert_eq!(e.code, 403);
        let root = UserInfo {
            name: "root".into(),
            groups: vec![MASTERS.into()],
            ..UserInfo::default()
        };
        assert!(
            check(
                Some(&root),
                "kubevirt.io",
                "VirtualMachineInstance",
                &vmi,
                None
            )
            .is_ok()
        );
    }
}
