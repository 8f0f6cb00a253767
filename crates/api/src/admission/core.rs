//! Defaults Kubernetes itself applies to core kinds on write (Secret `stringData`, the
//! namespace name label, PVC/PV/StorageClass policies), so kubectl sees what it expects.

use k8s_openapi::ByteString;
use serde_json::{Map, Value, json};

use crate::registry::ResourceDef;

fn insert_if_unset(m: &mut Map<String, Value>, key: &str, value: Value) {
    if m.get(key).is_none_or(Value::is_null) {
        m.insert(key.into(), value);
    }
}

/// Apply core-kind defaults in place (values of the wrong type are left alone).
pub(super) fn default_core(def: &ResourceDef, obj: &mut Value) {
    let Some(root) = obj.as_object_mut() else {
        return;
    };
    match (def.group, def.kind) {
        ("", "Secret") => {
            insert_if_unset(root, "type", json!("Opaque"));
            merge_string_data(root);
        }
        ("", "Namespace") => {
            let name = root
                .get("metadata")
                .and_then(|m| m.get("name"))
                .and_then(Value::as_str)
                .map(str::to_owned);
            if let Some(name) = name
                && let Some(Value::Object(meta)) = root.get_mut("metadata")
            {
                let labels = meta
                    .entry("labels")
                    .or_insert_with(|| Value::Object(Map::new()));
                if labels.is_null() {
                    *labels = Value::Object(Map::new());
                }
                if let Some(labels) = labels.as_object_mut() {
                    labels.insert("kubernetes.io/metadata.name".into(), json!(name));
                }
            }
            if let Some(Value::Object(spec)) = root.get_mut("spec") {
                insert_if_unset(spec, "finalizers", json!(["kubernetes"]));
            } else if root.get("spec").is_none() {
                root.insert("spec".into(), json!({"finalizers": ["kubernetes"]}));
            }
        }
        ("", "PersistentVolumeClaim") => {
            if let Some(Value::Object(spec)) = root.get_mut("spec") {
                insert_if_unset(spec, "volumeMode", json!("Filesystem"));
            }
        }
        ("", "PersistentVolume") => {
            if let Some(Value::Object(spec)) = root.get_mut("spec") {
                insert_if_unset(spec, "volumeMode", json!("Filesystem"));
                insert_if_unset(spec, "persistentVolumeReclaimPolicy", json!("Retain"));
            }
        }
        ("storage.k8s.io", "StorageClass") => {
            insert_if_unset(root, "reclaimPolicy", json!("Delete"));
            insert_if_unset(root, "volumeBindingMode", json!("Immediate"));
        }
        _ => {}
    }
}

/// `stringData` is write-only: its entries are base64-encoded into `data` (winning over
/// existing keys) and the field is dropped.
fn merge_string_data(root: &mut Map<String, Value>) {
    let Some(Value::Object(string_data)) = root.remove("stringData") else {
        return;
    };
    let data = root
        .entry("data")
        .or_insert_with(|| Value::Object(Map::new()));
    if data.is_null() {
        *data = Value::Object(Map::new());
    }
    let Some(data) = data.as_object_mut() else {
        return;
    };
    for (k, v) in string_data {
        if let Value::String(s) = v
            && let Ok(encoded) = serde_json::to_value(ByteString(s.into_bytes()))
        {
            data.insert(k, encoded);
        }
    }
}
