//! Object metadata helpers: reading and writing `metadata` fields, name validation (DNS-1123),
//! `generateName`, and the stored form (JSON without `resourceVersion`, which is the store's
//! `mod_revision` and is filled in on every read).

use ferrovirt_api::registry::ResourceDef;
use ferrovirt_store::KeyValue;
use serde_json::{Map, Value, json};

use crate::error::ApiError;

/// `metadata` as a mutable map, created when absent.
pub fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.is_object() {
        *obj = json!({});
    }
    let Value::Object(o) = obj else {
        unreachable!("object ensured above")
    };
    let m = o.entry("metadata").or_insert_with(|| json!({}));
    if !m.is_object() {
        *m = json!({});
    }
    match m {
        Value::Object(m) => m,
        _ => unreachable!("metadata ensured above"),
    }
}

/// A string field of `metadata`.
pub fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(field)?.as_str()
}

pub fn name_of(obj: &Value) -> &str {
    meta_str(obj, "name").unwrap_or_default()
}

pub fn namespace_of(obj: &Value) -> Option<&str> {
    meta_str(obj, "namespace").filter(|s| !s.is_empty())
}

pub fn finalizers(obj: &Value) -> Vec<String> {
    obj.pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

pub fn is_deleting(obj: &Value) -> bool {
    obj.pointer("/metadata/deletionTimestamp")
        .is_some_and(|v| !v.is_null())
}

/// Decodes a stored value and sets `metadata.resourceVersion` from its revision.
pub fn decode(kv: &KeyValue) -> Result<Value, ApiError> {
    let mut v: Value = serde_json::from_slice(&kv.value)
        .map_err(|e| ApiError::internal(format!("corrupt object at {}: {e}", kv.key)))?;
    meta_mut(&mut v).insert(
        "resourceVersion".into(),
        Value::String(kv.mod_revision.to_string()),
    );
    Ok(v)
}

/// The stored bytes: the object without `resourceVersion`.
pub fn encode(obj: &Value) -> Vec<u8> {
    let mut o = obj.clone();
    meta_mut(&mut o).remove("resourceVersion");
    serde_json::to_vec(&o).unwrap_or_default()
}

/// `metadata.resourceVersion` parsed, if set.
pub fn resource_version(obj: &Value) -> Result<Option<i64>, ApiError> {
    match meta_str(obj, "resourceVersion") {
        None | Some("") => Ok(None),
        Some(s) => s
            .parse()
            .map(Some)
            .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {s:?}"))),
    }
}

const DNS1123_LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const DNS1123_SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";

/// A DNS-1123 label: 1–63 lower-case alphanumerics or '-', alphanumeric at both ends.
pub(crate) fn is_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// Validates an object name for `def`; returns the message for `metadata.name` when invalid.
pub fn validate_name(def: &ResourceDef, name: &str) -> Result<(), String> {
    if def.group == "rbac.authorization.k8s.io" {
        // path-segment names (e.g. `system:controller`)
        return if name.is_empty() || name == "." || name == ".." || name.contains(['/', '%']) {
            Err(format!(
                "Invalid value: {name:?}: may not contain '/' or '%' and may not be '.' or '..'"
            ))
        } else {
            Ok(())
        };
    }
    if def.kind == "Namespace" {
        return if is_label(name) {
            Ok(())
        } else {
            Err(format!("Invalid value: {name:?}: {DNS1123_LABEL_MSG}"))
        };
    }
    if name.len() <= 253 && name.split('.').all(is_label) {
        Ok(())
    } else {
        Err(format!("Invalid value: {name:?}: {DNS1123_SUBDOMAIN_MSG}"))
    }
}

/// `prefix` (cut to 58 bytes on a character boundary) plus five random characters, as the API
/// server does for `generateName`.
pub fn generate_name(prefix: &str) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let bytes = *uuid::Uuid::new_v4().as_bytes();
    let suffix: String = bytes[..5]
        .iter()
        .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
        .collect();
    format!("{}{suffix}", crate::limits::generate_name_base(prefix))
}

/// The object with `status` and `metadata` removed, to detect spec changes.
pub fn spec_part(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.as_object_mut() {
        m.remove("metadata");
        m.remove("status");
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let defs = ferrovirt_api::registry::resources();
        let cm = defs
            .iter()
            .find(|d| d.kind == "ConfigMap")
            .expect("ConfigMap");
        let ns = defs
            .iter()
            .find(|d| d.kind == "Namespace")
            .expect("Namespace");
        assert!(validate_name(cm, "a.b-c").is_ok());
        assert!(validate_name(cm, "Bad_Name").is_err());
        assert!(validate_name(cm, "-a").is_err());
        assert!(validate_name(ns, "a.b").is_err());
        let g = generate_name("vm-");
        assert!(g.starts_with("vm-") && g.len() == 8 && validate_name(cm, &g).is_ok());
    }

    #[test]
    fn stored_form() {
        let kv = KeyValue {
            key: "/k".into(),
            value: encode(&json!({"metadata": {"name": "a", "resourceVersion": "5"}})),
            create_revision: 3,
            mod_revision: 7,
        };
        assert!(!String::from_utf8_lossy(&kv.value).contains("resourceVersion"));
        let v = decode(&kv).unwrap();
        assert_eq!(meta_str(&v, "resourceVersion"), Some("7"));
        assert_eq!(resource_version(&v).unwrap(), Some(7));
    }
}
