//! Validation of `metadata`: object names as Kubernetes requires them.

use serde_json::Value;

use super::{FieldError, Operation};
use crate::registry::ResourceDef;

/// A DNS-1123 label: at most 63 characters of `[a-z0-9-]`, starting and ending alphanumeric.
pub fn is_dns1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// A DNS-1123 subdomain: at most 253 characters, dot-separated DNS-1123 labels.
pub fn is_dns1123_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns1123_label)
}

/// Kinds whose names must be DNS-1123 labels rather than subdomains.
fn needs_label(def: &ResourceDef) -> bool {
    def.group.is_empty() && def.kind == "Namespace"
}

pub(super) fn validate_metadata(def: &ResourceDef, obj: &Value, op: Operation) -> Vec<FieldError> {
    let mut errors = Vec::new();
    let meta = obj.get("metadata");
    let name = meta.and_then(|m| m.get("name"));
    let generate_name = meta
        .and_then(|m| m.get("generateName"))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty());
    match name {
        Some(Value::String(n)) if !n.is_empty() => {
            let ok = if needs_label(def) {
                is_dns1123_label(n)
            } else {
                is_dns1123_subdomain(n)
            };
            if !ok {
                let what = if needs_label(def) {
                    "a lowercase RFC 1123 label must consist of lower case alphanumeric \
                     characters or '-', and must start and end with an alphanumeric character"
                } else {
                    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric \
                     characters, '-' or '.', and must start and end with an alphanumeric character"
                };
                errors.push(FieldError::invalid(
                    "metadata.name",
                    format!("Invalid value: \"{n}\": {what}"),
                ));
            }
        }
        Some(Value::String(_)) | Some(Value::Null) | None => {
            if generate_name.is_none() || op == Operation::Update {
                errors.push(FieldError::required(
                    "metadata.name",
                    "name or generateName is required",
                ));
            }
        }
        Some(_) => errors.push(FieldError::type_invalid(
            "metadata.name",
            "name must be a string",
        )),
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(is_dns1123_label("vm-1"));
        assert!(!is_dns1123_label("VM"));
        assert!(!is_dns1123_label("-a"));
        assert!(!is_dns1123_label(&"a".repeat(64)));
        assert!(is_dns1123_subdomain("a.b-c.d"));
        assert!(!is_dns1123_subdomain("a..b"));
        assert!(!is_dns1123_subdomain("a_b"));
    }
}
