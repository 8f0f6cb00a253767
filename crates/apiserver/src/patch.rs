//! JSON Patch (RFC 6902) and JSON Merge Patch (RFC 7386) on `serde_json::Value`, through the
//! `json-patch` crate, with the server's bounds (operation count, object size tracked while the
//! operations apply) and Kubernetes' null-test quirk. Strategic merge patch lives in `smp`.

use json_patch::{PatchErrorKind, PatchOperation};
use serde_json::Value;

/// A patch that is malformed or does not apply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatchError {
    #[error("invalid patch: {0}")]
    Invalid(String),
    #[error("the patch could not be applied: {0}")]
    Failed(String),
    /// The patch has too many operations or makes the object too large.
    #[error("{0}")]
    TooLarge(String),
}

/// Bounds on applying a JSON patch.
#[derive(Debug, Clone, Copy)]
pub struct PatchLimits {
    /// The most operations accepted.
    pub max_ops: usize,
    /// The largest document (compact JSON bytes) any operation may produce.
    pub max_bytes: usize,
}

impl Default for PatchLimits {
    fn default() -> Self {
        Self {
            max_ops: crate::limits::MAX_JSON_PATCH_OPS,
            max_bytes: crate::limits::MAX_OBJECT_BYTES,
        }
    }
}

/// Applies RFC 7386 merge patch `patch` to `target`.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    json_patch::merge(target, patch);
}

/// Applies RFC 6902 operations to `doc` within [`PatchLimits::default`]; on error `doc` may be
/// partly changed (callers patch a copy).
pub fn json_patch(doc: &mut Value, ops: &Value) -> Result<(), PatchError> {
    json_patch_limited(doc, ops, PatchLimits::default())
}

/// Applies RFC 6902 operations to `doc`, refusing more than `limits.max_ops` operations and
/// stopping as soon as the document could exceed `limits.max_bytes` (so that `copy` doubling
/// cannot build a huge document in memory first). The size is tracked as an upper bound (each
/// added value's size is added) and measured exactly only when that bound passes the limit.
pub fn json_patch_limited(
    doc: &mut Value,
    ops: &Value,
    limits: PatchLimits,
) -> Result<(), PatchError> {
    let ops = ops
        .as_array()
        .ok_or_else(|| PatchError::Invalid("a JSON patch must be an array of operations".into()))?;
    if ops.len() > limits.max_ops {
        return Err(PatchError::TooLarge(format!(
            "the JSON patch has {} operations, more than the limit of {}",
            ops.len(),
            limits.max_ops
        )));
    }
    let mut bound = crate::limits::json_len(doc);
    for (i, op) in ops.iter().enumerate() {
        apply_op(doc, op)?;
        bound = bound.saturating_add(added_size(op, doc));
        if bound > limits.max_bytes {
            bound = crate::limits::json_len(doc);
            if bound > limits.max_bytes {
                return Err(PatchError::TooLarge(format!(
                    "operation {i} of the JSON patch ({} {}) makes the object {bound} bytes, more than the limit of {} bytes",
                    op.get("op").and_then(Value::as_str).unwrap_or_default(),
                    crate::limits::shown(
                        op.get("path").and_then(Value::as_str).unwrap_or_default()
                    ),
                    limits.max_bytes
                )));
            }
        }
    }
    Ok(())
}

/// An upper bound on how many bytes operation `op` (already applied to `doc`) added.
fn added_size(op: &Value, doc: &Value) -> usize {
    let len = |v: Option<&Value>| v.map_or(0, crate::limits::json_len);
    let path_len = op.get("path").and_then(Value::as_str).map_or(0, str::len) + 4;
    match op.get("op").and_then(Value::as_str) {
        Some("add" | "replace") => len(op.get("value")) + path_len,
        // The copy equals its source, which is still in place.
        Some("copy") => {
            len(op
                .get("from")
                .and_then(Value::as_str)
                .and_then(|p| doc.pointer(p)))
                + path_len
        }
        // A move only adds the new key's name.
        Some("move") => path_len,
        _ => 0,
    }
}

/// One operation, through the `json-patch` crate. As Kubernetes' implementation does (and
/// kube-rs' finalizer helper relies on), testing for null succeeds when the path does not exist.
fn apply_op(doc: &mut Value, op: &Value) -> Result<(), PatchError> {
    let parsed: PatchOperation = serde_json::from_value(op.clone())
        .map_err(|e| PatchError::Invalid(format!("operation {op}: {e}")))?;
    if let PatchOperation::Test(t) = &parsed
        && t.value.is_null()
        && doc.pointer(t.path.as_str()).is_none()
    {
        return Ok(());
    }
    json_patch::patch_unsafe(doc, std::slice::from_ref(&parsed)).map_err(|e| match e.kind {
        PatchErrorKind::TestFailed => {
            PatchError::Failed(format!("testing value {} failed", e.path))
        }
        kind => PatchError::Failed(format!("{} {}: {kind}", op_name(&parsed), e.path)),
    })
}

fn op_name(op: &PatchOperation) -> &'static str {
    match op {
        PatchOperation::Add(_) => "add",
        PatchOperation::Remove(_) => "remove",
        PatchOperation::Replace(_) => "replace",
        PatchOperation::Move(_) => "move",
        PatchOperation::Copy(_) => "copy",
        PatchOperation::Test(_) => "test",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge() {
        let mut t = json!({"a": 1, "b": {"c": 2, "d": 3}, "l": [1, 2]});
        merge_patch(
            &mut t,
            &json!({"a": null, "b": {"c": 5}, "l": [3], "n": {"x": null}}),
        );
        assert_eq!(t, json!({"b": {"c": 5, "d": 3}, "l": [3], "n": {}}));
    }

    #[test]
    fn json_ops() {
        let mut d = json!({"metadata": {"labels": {"a/b": "1"}}, "list": [1, 2, 3]});
        json_patch(
            &mut d,
            &json!([
                {"op": "add", "path": "/metadata/labels/x", "value": "y"},
                {"op": "remove", "path": "/metadata/labels/a~1b"},
                {"op": "replace", "path": "/list/0", "value": 9},
                {"op": "add", "path": "/list/-", "value": 4},
                {"op": "test", "path": "/list/3", "value": 4},
                {"op": "copy", "from": "/list", "path": "/copy"},
                {"op": "move", "from": "/copy", "path": "/moved"}
            ]),
        )
        .unwrap();
        assert_eq!(
            d,
            json!({"metadata": {"labels": {"x": "y"}}, "list": [9, 2, 3, 4], "moved": [9, 2, 3, 4]})
        );
        assert!(json_patch(&mut d, &json!([{"op": "remove", "path": "/nope"}])).is_err());
        assert!(
            json_patch(
                &mut d,
                &json!([{"op": "test", "path": "/list/0", "value": 1}])
            )
            .is_err()
        );
        assert!(matches!(
            json_patch(&mut d, &json!({"op": "add"})),
            Err(PatchError::Invalid(_))
        ));
        assert!(
            json_patch(
                &mut d,
                &json!([{"op": "add", "path": "/list/9", "value": 1}])
            )
            .is_err()
        );
    }

    #[test]
    fn copy_doubling_stops_at_the_limit() {
        // Each `copy` doubles the document: 40 of them would need terabytes.
        let mut doc = json!({"a": ["x".repeat(1000)]});
        let mut ops = vec![json!({"op": "add", "path": "/b", "value": []})];
        for i in 0..40 {
            let (from, to) = if i % 2 == 0 {
                ("/a", "/b")
            } else {
                ("/b", "/a")
            };
            ops.push(json!({"op": "copy", "from": from, "path": format!("{to}/-")}));
        }
        let limits = PatchLimits {
            max_ops: 100,
            max_bytes: 1 << 20,
        };
        let err = json_patch_limited(&mut doc, &Value::Array(ops), limits).unwrap_err();
        assert!(matches!(err, PatchError::TooLarge(_)), "{err}");
        assert!(crate::limits::json_len(&doc) < 4 << 20);
        let many = Value::Array(vec![json!({"op": "test", "path": "", "value": null}); 101]);
        assert!(matches!(
            json_patch_limited(&mut doc, &many, limits),
            Err(PatchError::TooLarge(_))
        ));
    }

    #[test]
    fn test_null_on_missing_path() {
        let mut fresh = json!({"metadata": {}});
        json_patch(
            &mut fresh,
            &json!([
                {"op": "test", "path": "/metadata/finalizers", "value": null},
                {"op": "add", "path": "/metadata/finalizers", "value": ["f"]}
            ]),
        )
        .unwrap();
        assert_eq!(fresh["metadata"]["finalizers"], json!(["f"]));
    }
}
