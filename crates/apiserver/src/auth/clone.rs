//! CDI's authorization of cross-namespace clones: a DataVolume (or a VirtualMachine's
//! `dataVolumeTemplates`) whose source is a claim, a snapshot or a DataSource in **another**
//! namespace may be written only by a user who may `create` the `datavolumes/source`
//! subresource (group `cdi.kubevirt.io`) in that source namespace — CDI's rule, so that a user
//! of namespace b cannot copy a disk out of namespace a by naming it. The check is made with
//! the writer's own identity at admission (the controllers that later create the DataVolume
//! from a template act for it); on an update only sources the old object did not have are
//! checked. [`cross_namespace_sources`] is the pure part.

use serde_json::Value;

use super::rbac::{Attributes, UserInfo, authorize};
use crate::error::ApiError;
use crate::server::Shared;

const CDI: &str = "cdi.kubevirt.io";

/// The (field, namespace) of every clone source of `obj` (a `kind` DataVolume or
/// VirtualMachine) that names a namespace other than `ns` (pure).
pub fn cross_namespace_sources(kind: &str, ns: &str, obj: &Value) -> Vec<(String, String)> {
    let mut specs: Vec<(String, &Value)> = Vec::new();
    match kind {
        "DataVolume" => specs.push(("spec".into(), &obj["spec"])),
        "VirtualMachine" => {
            for (i, t) in obj["spec"]["dataVolumeTemplates"]
                .as_array()
                .into_iter()
                .flatten()
                .enumerate()
            {
                specs.push((format!("spec.dataVolumeTemplates[{i}].spec"), &t["spec"]));
            }
        }
        _ => {}
    }
    let mut out = Vec::new();
    for (field, spec) in specs {
        let named = [
            (
                format!("{field}.source.pvc.namespace"),
                &spec["source"]["pvc"],
            ),
            (
                format!("{field}.source.snapshot.namespace"),
                &spec["source"]["snapshot"],
            ),
            (format!("{field}.sourceRef.namespace"), &spec["sourceRef"]),
        ];
        for (f, src) in named {
            if let Some(n) = src["namespace"].as_str()
                && !n.is_empty()
                && n != ns
            {
                out.push((f, n.to_string()));
            }
        }
    }
    out
}

/// Refuses (403) a write of `obj` whose new cross-namespace clone sources `user` may not
/// read as CDI requires; see the module doc.
pub(crate) fn check(
    sh: &Shared,
    user: Option<&UserInfo>,
    kind: &str,
    group: &str,
    ns: &str,
    obj: &Value,
    old: Option<&Value>,
) -> Result<(), ApiError> {
    let ours = matches!(
        (group, kind),
        (CDI, "DataVolume") | ("kubevirt.io", "VirtualMachine")
    );
    if !ours {
        return Ok(());
    }
    let sources = cross_namespace_sources(kind, ns, obj);
    if sources.is_empty() {
        return Ok(());
    }
    let before = old
        .map(|o| cross_namespace_sources(kind, ns, o))
        .unwrap_or_default();
    let user = user.ok_or_else(|| ApiError::forbidden("forbidden: no user on the request"))?;
    let policy = sh.auth.policy.get();
    for (field, src_ns) in sources.iter().filter(|s| !before.contains(s)) {
        let a = Attributes {
            verb: "create".into(),
            resource_request: true,
            api_group: CDI.into(),
            resource: "datavolumes".into(),
            subresource: "source".into(),
            namespace: src_ns.clone(),
            name: String::new(),
            path: String::new(),
        };
        if !authorize(&policy, user, &a).allowed() {
            return Err(ApiError::forbidden(format!(
                "{field}: cloning from namespace {src_ns:?} is forbidden: User {:?} cannot \
                 create resource \"datavolumes/source\" in API group \"{CDI}\" in the namespace \
                 {src_ns:?}",
                user.name
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_sources_in_other_namespaces_count() {
        let dv = json!({"spec": {"source": {"pvc": {"namespace": "a", "name": "disk"}}}});
        assert_eq!(
            cross_namespace_sources("DataVolume", "b", &dv),
            [("spec.source.pvc.namespace".to_string(), "a".to_string())]
        );
        assert!(cross_namespace_sources("DataVolume", "a", &dv).is_empty());
        let same = json!({"spec": {"source": {"pvc": {"name": "disk"}}}});
        assert!(cross_namespace_sources("DataVolume", "b", &same).is_empty());
        let vm = json!({"spec": {"dataVolumeTemplates": [
            {"spec": {"source": {"blank": {}}}},
            {"spec": {"sourceRef": {"kind": "DataSource", "namespace": "images", "name": "f"}}},
            {"spec": {"source": {"snapshot": {"namespace": "a", "name": "s"}}}}]}});
        assert_eq!(
            cross_namespace_sources("VirtualMachine", "b", &vm),
            [
                (
                    "spec.dataVolumeTemplates[1].spec.sourceRef.namespace".to_string(),
                    "images".to_string()
                ),
                (
                    "spec.dataVolumeTemplates[2].spec.source.snapshot.namespace".to_string(),
                    "a".to_string()
                )
            ]
        );
        assert!(cross_namespace_sources("ConfigMap", "b", &dv).is_empty());
    }
}
