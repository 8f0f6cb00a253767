//! The `/scale` subresource as autoscaling/v1 `Scale` objects (what `kubectl scale` reads and
//! patches), built from and written back into a scalable object along the paths its
//! [`ScaleSubresource`] declares. Pure; the API server does the I/O.

use serde_json::{Map, Value, json};

use crate::admission::FieldError;
use crate::registry::ScaleSubresource;

/// `.spec.replicas` → `/spec/replicas`.
fn pointer(path: &str) -> String {
    path.replace('.', "/")
}

/// The autoscaling/v1 Scale view of `obj`.
pub fn scale_of(sub: &ScaleSubresource, obj: &Value) -> Value {
    let meta = obj.get("metadata").cloned().unwrap_or_default();
    let mut m = Map::new();
    for k in [
        "name",
        "namespace",
        "uid",
        "resourceVersion",
        "creationTimestamp",
    ] {
        if let Some(v) = meta.get(k) {
            m.insert(k.into(), v.clone());
        }
    }
    let spec_replicas = obj
        .pointer(&pointer(sub.spec_replicas_path))
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let status_replicas = obj
        .pointer(&pointer(sub.status_replicas_path))
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let mut status = json!({"replicas": status_replicas});
    if let Some(sel) = obj
        .pointer(&pointer(sub.label_selector_path))
        .and_then(Value::as_str)
    {
        status["selector"] = json!(sel);
    }
    json!({
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": m,
        "spec": {"replicas": spec_replicas},
        "status": status,
    })
}

/// The desired replicas a (client-sent or patched) Scale asks for.
pub fn replicas_of(scale: &Value) -> Result<i32, FieldError> {
    match scale.pointer("/spec/replicas") {
        None | Some(Value::Null) => Ok(0),
        Some(v) => v
            .as_i64()
            .and_then(|n| i32::try_from(n).ok())
            .filter(|n| *n >= 0)
            .ok_or_else(|| {
                FieldError::invalid(
                    "spec.replicas",
                    format!("Invalid value: {v}: must be a non-negative 32-bit integer"),
                )
            }),
    }
}

/// `obj` with its desired replicas set to `n`.
pub fn with_replicas(sub: &ScaleSubresource, obj: &Value, n: i32) -> Value {
    let mut out = obj.clone();
    let mut cur = &mut out;
    let parts: Vec<&str> = sub
        .spec_replicas_path
        .trim_start_matches('.')
        .split('.')
        .collect();
    for (i, part) in parts.iter().enumerate() {
        if !cur.is_object() {
            *cur = json!({});
        }
        let map = cur.as_object_mut().expect("made an object above");
        if i + 1 == parts.len() {
            map.insert((*part).to_string(), json!(n));
            break;
        }
        cur = map.entry(*part).or_insert_with(|| json!({}));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{find, scale_subresource};

    #[test]
    fn a_pool_as_a_scale_and_back() {
        let def = find("pool.kubevirt.io", "virtualmachinepools").unwrap();
        let sub = scale_subresource(&def).unwrap();
        let pool = json!({"metadata": {"name": "p", "namespace": "d", "resourceVersion": "7",
            "labels": {"x": "y"}},
            "spec": {"replicas": 2}, "status": {"replicas": 1, "labelSelector": "app=p"}});
        let s = scale_of(&sub, &pool);
        assert_eq!(s["kind"], "Scale");
        assert_eq!(s["apiVersion"], "autoscaling/v1");
        assert_eq!(s["metadata"]["resourceVersion"], "7");
        assert!(s["metadata"].get("labels").is_none());
        assert_eq!(s["spec"]["replicas"], 2);
        assert_eq!(s["status"], json!({"replicas": 1, "selector": "app=p"}));
        let back = with_replicas(&sub, &pool, 5);
        assert_eq!(back["spec"]["replicas"], 5);
        assert_eq!(back["status"], pool["status"]);
        assert_eq!(
            with_replicas(&sub, &json!({}), 1),
            json!({"spec": {"replicas": 1}})
        );
    }

    #[test]
    fn replicas_must_be_non_negative() {
        assert_eq!(replicas_of(&json!({"spec": {"replicas": 3}})), Ok(3));
        assert_eq!(replicas_of(&json!({"spec": {}})), Ok(0));
        for bad in [json!(-1), json!("2"), json!(1u64 << 40)] {
            let e = replicas_of(&json!({"spec": {"replicas": bad}})).unwrap_err();
            assert_eq!(e.field, "spec.replicas");
        }
    }
}
