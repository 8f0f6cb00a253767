//! JSON Patch (RFC 6902) and JSON Merge Patch (RFC 7386) on `serde_json::Value`. Strategic merge
//! patch lives in `smp`.

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
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Default::default());
    }
    let Value::Object(t) = target else { return };
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

fn unescape(token: &str) -> String {
    token.replace("~1", "/").replace("~0", "~")
}

fn split_pointer(ptr: &str) -> Result<Vec<String>, PatchError> {
    if ptr.is_empty() {
        return Ok(Vec::new());
    }
    let rest = ptr
        .strip_prefix('/')
        .ok_or_else(|| PatchError::Invalid(format!("path {ptr:?} must start with '/'")))?;
    Ok(rest.split('/').map(unescape).collect())
}

fn array_index(tok: &str, len: usize, allow_end: bool) -> Result<usize, PatchError> {
    if allow_end && tok == "-" {
        return Ok(len);
    }
    let i: usize = tok
        .parse()
        .map_err(|_| PatchError::Failed(format!("invalid array index {tok:?}")))?;
    let max = if allow_end {
        len
    } else {
        len.saturating_sub(1)
    };
    if i > max || (!allow_end && len == 0) {
        return Err(PatchError::Failed(format!("array index {i} out of bounds")));
    }
    Ok(i)
}

/// The parent container of `path` and the last token.
fn parent_mut<'a>(
    doc: &'a mut Value,
    path: &[String],
) -> Result<(&'a mut Value, String), PatchError> {
    let (last, parents) = path
        .split_last()
        .ok_or_else(|| PatchError::Failed("the root cannot be the target".into()))?;
    let mut cur = doc;
    for tok in parents {
        cur = match cur {
            Value::Object(m) => m
                .get_mut(tok)
                .ok_or_else(|| PatchError::Failed(format!("path segment {tok:?} not found")))?,
            Value::Array(a) => {
                let i = array_index(tok, a.len(), false)?;
                &mut a[i]
            }
            _ => {
                return Err(PatchError::Failed(format!(
                    "path segment {tok:?} not found"
                )));
            }
        };
    }
    Ok((cur, last.clone()))
}

fn get_at<'a>(doc: &'a Value, path: &[String]) -> Option<&'a Value> {
    let mut cur = doc;
    for tok in path {
        cur = match cur {
            Value::Object(m) => m.get(tok)?,
            Value::Array(a) => a.get(tok.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(cur)
}

fn add(doc: &mut Value, path: &[String], value: Value) -> Result<(), PatchError> {
    if path.is_empty() {
        *doc = value;
        return Ok(());
    }
    let (parent, last) = parent_mut(doc, path)?;
    match parent {
        Value::Object(m) => {
            m.insert(last, value);
        }
        Value::Array(a) => {
            let i = array_index(&last, a.len(), true)?;
            a.insert(i, value);
        }
        _ => return Err(PatchError::Failed(format!("cannot add to {last:?}"))),
    }
    Ok(())
}

fn remove(doc: &mut Value, path: &[String]) -> Result<Value, PatchError> {
    let (parent, last) = parent_mut(doc, path)?;
    match parent {
        Value::Object(m) => m.shift_remove(&last).ok_or_else(|| {
            PatchError::Failed(format!("unable to remove nonexistent key {last:?}"))
        }),
        Value::Array(a) => {
            let i = array_index(&last, a.len(), false)?;
            Ok(a.remove(i))
        }
        _ => Err(PatchError::Failed(format!("cannot remove {last:?}"))),
    }
}

fn field<'a>(op: &'a Value, name: &str) -> Result<&'a Value, PatchError> {
    op.get(name)
        .ok_or_else(|| PatchError::Invalid(format!("operation is missing {name:?}")))
}

fn path_field(op: &Value, name: &str) -> Result<Vec<String>, PatchError> {
    let p = field(op, name)?
        .as_str()
        .ok_or_else(|| PatchError::Invalid(format!("{name:?} must be a string")))?;
    split_pointer(p)
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
            let from = op
                .get("from")
                .and_then(Value::as_str)
                .and_then(|p| split_pointer(p).ok());
            len(from.as_deref().and_then(|p| get_at(doc, p))) + path_len
        }
        // A move only adds the new key's name.
        Some("move") => path_len,
        _ => 0,
    }
}

fn apply_op(doc: &mut Value, op: &Value) -> Result<(), PatchError> {
    {
        let name = field(op, "op")?
            .as_str()
            .ok_or_else(|| PatchError::Invalid("\"op\" must be a string".into()))?;
        let path = path_field(op, "path")?;
        match name {
            "add" => add(doc, &path, field(op, "value")?.clone())?,
            "remove" => {
                remove(doc, &path)?;
            }
            "replace" => {
                if path.is_empty() {
                    *doc = field(op, "value")?.clone();
                } else {
                    remove(doc, &path)?;
                    add(doc, &path, field(op, "value")?.clone())?;
                }
            }
            "move" => {
                let from = path_field(op, "from")?;
                if path.starts_with(&from) && path.len() > from.len() {
                    return Err(PatchError::Failed("cannot move a value into itself".into()));
                }
                let v = remove(doc, &from)?;
                add(doc, &path, v)?;
            }
            "copy" => {
                let from = path_field(op, "from")?;
                let v = get_at(doc, &from)
                    .cloned()
                    .ok_or_else(|| PatchError::Failed("copy source not found".into()))?;
                add(doc, &path, v)?;
            }
            "test" => {
                let want = field(op, "value")?;
                // As Kubernetes' implementation does (and kube-rs' finalizer helper relies on),
                // testing for null succeeds when the path does not exist.
                let actual = get_at(doc, &path).unwrap_or(&Value::Null);
                if actual != want {
                    return Err(PatchError::Failed(format!(
                        "testing value {} failed",
                        op["path"].as_str().unwrap_or_default()
                    )));
                }
            }
            other => return Err(PatchError::Invalid(format!("unknown operation {other:?}"))),
        }
    }
    Ok(())
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
