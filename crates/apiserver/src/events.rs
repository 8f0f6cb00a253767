//! Events: events.k8s.io/v1 ⇄ core/v1 conversion (both are stored as core/v1 events, so
//! `kubectl describe` sees events written through either API), and [`record_event`] for
//! in-process controllers.

use ferrovirt_store::Store;
use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::objects::{encode, meta_str};
use crate::timefmt;

fn copy(from: &Value, to: &mut Map<String, Value>, src: &str, dst: &str) {
    if let Some(v) = from.get(src).filter(|v| !v.is_null()) {
        to.insert(dst.to_string(), v.clone());
    }
}

/// events.k8s.io/v1 Event → core/v1 Event.
pub fn v1_to_core(v: &Value) -> Value {
    let mut out = Map::new();
    out.insert("apiVersion".into(), json!("v1"));
    out.insert("kind".into(), json!("Event"));
    for (src, dst) in [
        ("metadata", "metadata"),
        ("regarding", "involvedObject"),
        ("related", "related"),
        ("note", "message"),
        ("reason", "reason"),
        ("type", "type"),
        ("action", "action"),
        ("eventTime", "eventTime"),
        ("series", "series"),
        ("reportingController", "reportingComponent"),
        ("reportingInstance", "reportingInstance"),
        ("deprecatedSource", "source"),
        ("deprecatedFirstTimestamp", "firstTimestamp"),
        ("deprecatedLastTimestamp", "lastTimestamp"),
        ("deprecatedCount", "count"),
    ] {
        copy(v, &mut out, src, dst);
    }
    if !out.contains_key("source")
        && let Some(c) = v.get("reportingController")
    {
        out.insert("source".into(), json!({"component": c}));
    }
    if !out.contains_key("involvedObject") {
        out.insert("involvedObject".into(), json!({}));
    }
    Value::Object(out)
}

/// core/v1 Event → events.k8s.io/v1 Event.
pub fn core_to_v1(c: &Value) -> Value {
    let mut out = Map::new();
    out.insert("apiVersion".into(), json!("events.k8s.io/v1"));
    out.insert("kind".into(), json!("Event"));
    for (src, dst) in [
        ("metadata", "metadata"),
        ("involvedObject", "regarding"),
        ("related", "related"),
        ("message", "note"),
        ("reason", "reason"),
        ("type", "type"),
        ("action", "action"),
        ("eventTime", "eventTime"),
        ("series", "series"),
        ("reportingComponent", "reportingController"),
        ("reportingInstance", "reportingInstance"),
        ("source", "deprecatedSource"),
        ("firstTimestamp", "deprecatedFirstTimestamp"),
        ("lastTimestamp", "deprecatedLastTimestamp"),
        ("count", "deprecatedCount"),
    ] {
        copy(c, &mut out, src, dst);
    }
    if !out.contains_key("reportingController")
        && let Some(comp) = c.pointer("/source/component")
    {
        out.insert("reportingController".into(), comp.clone());
    }
    Value::Object(out)
}

/// An event to record about an object.
#[derive(Debug, Clone)]
pub struct EventRecord {
    /// The object the event is about (its apiVersion, kind and metadata are used).
    pub involved: Value,
    /// "Normal" or "Warning".
    pub type_: String,
    pub reason: String,
    pub message: String,
    /// The reporting component, e.g. "virtualmachine-controller".
    pub component: String,
}

/// Writes a core/v1 Event about `rec.involved` into its namespace (`default` for cluster-scoped
/// objects). Returns the stored event.
pub async fn record_event(store: &dyn Store, rec: &EventRecord) -> Result<Value, ApiError> {
    let o = &rec.involved;
    let obj_name = meta_str(o, "name").unwrap_or("unknown");
    let ns = meta_str(o, "namespace")
        .filter(|s| !s.is_empty())
        .unwrap_or("default");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let name = format!("{obj_name}.{nanos:x}");
    let now = timefmt::now_rfc3339();
    let mut involved = json!({
        "apiVersion": o.get("apiVersion").cloned().unwrap_or_default(),
        "kind": o.get("kind").cloned().unwrap_or_default(),
        "name": obj_name,
        "uid": meta_str(o, "uid").unwrap_or_default(),
        "resourceVersion": meta_str(o, "resourceVersion").unwrap_or_default(),
    });
    if let Some(n) = meta_str(o, "namespace").filter(|s| !s.is_empty()) {
        involved["namespace"] = json!(n);
    }
    let ev = json!({
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": uuid::Uuid::new_v4().to_string(),
            "creationTimestamp": now,
            "generation": 1,
        },
        "involvedObject": involved,
        "reason": rec.reason,
        "message": rec.message,
        "type": rec.type_,
        "source": {"component": rec.component},
        "reportingComponent": rec.component,
        "reportingInstance": "",
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    });
    let key = format!("/registry/core/events/{ns}/{name}");
    let kv = store
        .create(&key, encode(&ev))
        .await
        .map_err(ApiError::from_store)?;
    let mut ev = ev;
    ev["metadata"]["resourceVersion"] = json!(kv.mod_revision.to_string());
    Ok(ev)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip() {
        let v1 = json!({
            "apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"name": "e", "namespace": "d"},
            "regarding": {"kind": "VirtualMachine", "name": "vm1", "namespace": "d"},
            "note": "started", "reason": "Started", "type": "Normal",
            "reportingController": "ctl", "reportingInstance": "i", "action": "Start",
            "eventTime": "2026-01-01T00:00:00.000000Z"
        });
        let core = v1_to_core(&v1);
        assert_eq!(core["involvedObject"]["name"], "vm1");
        assert_eq!(core["message"], "started");
        assert_eq!(core["source"]["component"], "ctl");
        let back = core_to_v1(&core);
        for k in [
            "regarding",
            "note",
            "reason",
            "type",
            "reportingController",
            "eventTime",
            "metadata",
        ] {
            assert_eq!(back[k], v1[k], "{k}");
        }
    }
}
