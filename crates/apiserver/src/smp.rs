//! Strategic merge patch (what `kubectl apply/edit/patch` send for core kinds): merge-patch
//! semantics for maps, plus lists merged by their Kubernetes merge key (containers by `name`,
//! conditions by `type`, …), the `$patch` (replace/delete), `$retainKeys`,
//! `$deleteFromPrimitiveList/…` and `$setElementOrder/…` directives. Lists without a known merge
//! key are replaced, as merge patch does.

use serde_json::{Map, Value};

/// Merge key of well-known list fields of the Kubernetes core API (patchMergeKey).
fn merge_key(field: &str, sample: Option<&Value>) -> Option<&'static str> {
    Some(match field {
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "volumes"
        | "env"
        | "imagePullSecrets"
        | "secrets"
        | "resourceClaims"
        | "readinessGates" => {
            if field == "readinessGates" {
                "conditionType"
            } else {
                "name"
            }
        }
        "ports" => {
            if sample.is_some_and(|s| s.get("containerPort").is_some()) {
                "containerPort"
            } else {
                "port"
            }
        }
        "volumeMounts" => "mountPath",
        "volumeDevices" => "devicePath",
        "conditions" => "type",
        "ownerReferences" => "uid",
        "hostAliases" => "ip",
        "topologySpreadConstraints" => "topologyKey",
        "podIPs" | "hostIPs" => "ip",
        "taints" => "key",
        "addresses" => "type",
        _ => return None,
    })
}

/// Lists of scalars merged as sets (patchStrategy: merge).
fn is_primitive_merge_list(field: &str) -> bool {
    matches!(field, "finalizers")
}

/// Removes `$…` directives from a value that is inserted as-is.
fn clean(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| !k.starts_with('$'))
                .map(|(k, v)| (k.clone(), clean(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(
            a.iter()
                .filter(|x| x.get("$patch").is_none())
                .map(clean)
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Applies a strategic merge patch `patch` to `target` (both JSON objects at the top).
pub fn strategic_merge(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    match p.get("$patch").and_then(Value::as_str) {
        Some("replace") => {
            *target = clean(patch);
            return;
        }
        Some("delete") => {
            *target = Value::Object(Map::new());
            return;
        }
        _ => {}
    }
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(t) = target else { return };
    let mut orders: Vec<(String, Vec<Value>)> = Vec::new();
    for (k, v) in p {
        if let Some(field) = k.strip_prefix("$setElementOrder/") {
            if let Some(a) = v.as_array() {
                orders.push((field.to_string(), a.clone()));
            }
            continue;
        }
        if let Some(field) = k.strip_prefix("$deleteFromPrimitiveList/") {
            if let (Some(Value::Array(cur)), Some(del)) = (t.get_mut(field), v.as_array()) {
                cur.retain(|x| !del.contains(x));
            }
            continue;
        }
        if k.starts_with('$') {
            continue;
        }
        if v.is_null() {
            t.shift_remove(k);
            continue;
        }
        match (t.get_mut(k), v) {
            (Some(cur @ Value::Object(_)), Value::Object(pm)) => {
                if pm.get("$patch").and_then(Value::as_str) == Some("delete") {
                    t.shift_remove(k);
                } else {
                    strategic_merge(cur, v);
                }
            }
            (Some(Value::Array(cur)), Value::Array(pa)) => merge_list(k, cur, pa),
            (_, Value::Object(pm))
                if pm.get("$patch").and_then(Value::as_str) == Some("delete") =>
            {
                t.shift_remove(k);
            }
            _ => {
                t.insert(k.clone(), clean(v));
            }
        }
    }
    if let Some(keep) = p.get("$retainKeys").and_then(Value::as_array) {
        t.retain(|k, _| keep.iter().any(|x| x.as_str() == Some(k)));
    }
    for (field, order) in orders {
        if let Some(Value::Array(cur)) = t.get_mut(&field) {
            reorder(&field, cur, &order);
        }
    }
}

fn merge_list(field: &str, cur: &mut Vec<Value>, patch: &[Value]) {
    if patch
        .iter()
        .any(|x| x.get("$patch").and_then(Value::as_str) == Some("replace"))
    {
        *cur = patch
            .iter()
            .filter(|x| x.get("$patch").is_none())
            .map(clean)
            .collect();
        return;
    }
    if is_primitive_merge_list(field) {
        for v in patch {
            if !cur.contains(v) {
                cur.push(v.clone());
            }
        }
        return;
    }
    let key = merge_key(field, patch.first().or(cur.first()));
    let Some(key) = key.filter(|_| patch.iter().all(Value::is_object)) else {
        *cur = patch.iter().map(clean).collect();
        return;
    };
    for item in patch {
        let id = item.get(key);
        let pos = id.and_then(|id| cur.iter().position(|c| c.get(key) == Some(id)));
        let delete = item.get("$patch").and_then(Value::as_str) == Some("delete");
        match (pos, delete) {
            (Some(i), true) => {
                cur.remove(i);
            }
            (None, true) => {}
            (Some(i), false) => strategic_merge(&mut cur[i], item),
            (None, false) => cur.push(clean(item)),
        }
    }
}

/// Orders `cur` by `order` (items or their merge keys); unlisted items keep their place at the end.
fn reorder(field: &str, cur: &mut [Value], order: &[Value]) {
    let key = merge_key(field, order.first());
    let rank = |v: &Value| {
        order
            .iter()
            .position(|o| match key {
                Some(k) if o.is_object() => o.get(k) == v.get(k),
                _ => o == v,
            })
            .unwrap_or(usize::MAX)
    };
    cur.sort_by_key(rank);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn maps_and_named_lists() {
        let mut t = json!({
            "metadata": {"labels": {"a": "1", "b": "2"}, "finalizers": ["x"]},
            "spec": {"containers": [
                {"name": "c1", "image": "i1", "env": [{"name": "A", "value": "1"}]},
                {"name": "c2", "image": "i2"}
            ], "tolerations": [{"key": "t"}]}
        });
        strategic_merge(
            &mut t,
            &json!({
                "metadata": {"labels": {"a": null, "c": "3"}, "finalizers": ["y"]},
                "spec": {
                    "$setElementOrder/containers": [{"name": "c2"}, {"name": "c1"}],
                    "containers": [
                        {"name": "c1", "env": [{"name": "B", "value": "2"}]},
                        {"name": "c2", "$patch": "delete"}
                    ],
                    "tolerations": [{"key": "u"}]
                }
            }),
        );
        assert_eq!(
            t,
            json!({
                "metadata": {"labels": {"b": "2", "c": "3"}, "finalizers": ["x", "y"]},
                "spec": {"containers": [
                    {"name": "c1", "image": "i1", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]}
                ], "tolerations": [{"key": "u"}]}
            })
        );
    }

    #[test]
    fn directives() {
        let mut t = json!({"data": {"a": "1"}, "spec": {"x": 1, "y": 2}, "metadata": {"finalizers": ["a", "b"]}});
        strategic_merge(
            &mut t,
            &json!({
                "data": {"$patch": "replace", "b": "2"},
                "spec": {"$retainKeys": ["y"], "y": 3},
                "metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]}
            }),
        );
        assert_eq!(
            t,
            json!({"data": {"b": "2"}, "spec": {"y": 3}, "metadata": {"finalizers": ["b"]}})
        );
    }
}
