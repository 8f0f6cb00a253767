//! Bridge to the api crate's per-kind OpenAPI schemas and unknown-field detection (used by
//! `/openapi/*` and `fieldValidation`). ObjectMeta's fields are also checked here for every kind.

use ferrovirt_api::registry::{self, ResourceDef};
use serde_json::Value;

const OBJECT_META_FIELDS: &[&str] = &[
    "name",
    "generateName",
    "namespace",
    "selfLink",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
    "managedFields",
];

/// The OpenAPI v3 schema of one kind.
pub fn kind_schema(def: &ResourceDef) -> Value {
    registry::openapi_schema(def)
}

/// Field paths (`metadata.foo`, `spec.template.bar`) in `obj` that the kind does not define.
pub fn unknown_fields(def: &ResourceDef, obj: &Value) -> Vec<String> {
    let mut out: Vec<String> = registry::unknown_fields(def, obj)
        .into_iter()
        .map(|f| f.trim_start_matches('.').to_string())
        .collect();
    if let Some(meta) = obj.get("metadata").and_then(Value::as_object) {
        for k in meta.keys() {
            let f = format!("metadata.{k}");
            if !OBJECT_META_FIELDS.contains(&k.as_str()) && !out.contains(&f) {
                out.push(f);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unknown() {
        let defs = registry::resources();
        let vm = defs
            .iter()
            .find(|d| d.kind == "VirtualMachine")
            .expect("VirtualMachine");
        let obj = json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "a", "bogus": 1},
            "spec": {"runStrategy": "Halted", "nonsense": true}
        });
        let u = unknown_fields(vm, &obj);
        assert!(u.contains(&"metadata.bogus".to_string()), "{u:?}");
        assert!(u.contains(&"spec.nonsense".to_string()), "{u:?}");
        assert!(kind_schema(vm).is_object());
    }
}
