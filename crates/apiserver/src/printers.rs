//! Cells of Kubernetes' built-in kinds that a JSONPath cannot express (the registry marks
//! their columns [`ferrovirt_api::registry::COMPUTED`]): counts of data keys, short access
//! modes, node status and roles from conditions and labels, event objects as `kind/name`, the
//! `(default)` mark of a StorageClass and the defaults Kubernetes prints for unset fields.

use ferrovirt_api::registry::ResourceDef;
use serde_json::{Value, json};

use crate::timefmt;

const NONE: &str = "<none>";
const UNSET: &str = "<unset>";

fn s(v: Option<&Value>) -> Option<&str> {
    v.and_then(Value::as_str).filter(|s| !s.is_empty())
}

fn len(v: Option<&Value>) -> usize {
    match v {
        Some(Value::Object(m)) => m.len(),
        Some(Value::Array(a)) => a.len(),
        _ => 0,
    }
}

/// `ReadWriteOnce` → `RWO`, … joined with commas, as `kubectl get pv,pvc` prints them.
fn access_modes(v: Option<&Value>) -> Value {
    let modes: Vec<&str> = v
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(|m| match m {
                    "ReadWriteOnce" => "RWO",
                    "ReadOnlyMany" => "ROX",
                    "ReadWriteMany" => "RWX",
                    "ReadWriteOncePod" => "RWOP",
                    other => other,
                })
                .collect()
        })
        .unwrap_or_default();
    Value::String(modes.join(","))
}

fn age(t: Option<&str>) -> Value {
    match t {
        Some(t) => Value::String(timefmt::age_of(t)),
        None => Value::String("<unknown>".into()),
    }
}

fn node_status(obj: &Value) -> String {
    let ready = obj
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
        .and_then(|c| c["status"].as_str());
    let mut out = match ready {
        Some("True") => "Ready".to_string(),
        Some("False") => "NotReady".to_string(),
        _ => "Unknown".to_string(),
    };
    if obj.pointer("/spec/unschedulable") == Some(&Value::Bool(true)) {
        out.push_str(",SchedulingDisabled");
    }
    out
}

fn node_roles(obj: &Value) -> String {
    let mut roles: Vec<String> = obj
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
        .map(|labels| {
            labels
                .iter()
                .filter_map(|(k, v)| {
                    if let Some(r) = k.strip_prefix("node-role.kubernetes.io/") {
                        (!r.is_empty()).then(|| r.to_string())
                    } else if k == "kubernetes.io/role" {
                        v.as_str().filter(|r| !r.is_empty()).map(str::to_string)
                    } else {
                        None
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    roles.sort();
    roles.dedup();
    if roles.is_empty() {
        NONE.to_string()
    } else {
        roles.join(",")
    }
}

fn node_address(obj: &Value, kind: &str) -> String {
    let found: Vec<&str> = obj
        .pointer("/status/addresses")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter(|x| x["type"] == kind)
                .filter_map(|x| x["address"].as_str())
                .collect()
        })
        .unwrap_or_default();
    if found.is_empty() {
        NONE.to_string()
    } else {
        found.join(",")
    }
}

/// The object an event is about (core `involvedObject` or events.k8s.io `regarding`).
fn event_object(obj: &Value) -> Option<&Value> {
    obj.get("involvedObject").or_else(|| obj.get("regarding"))
}

fn event_last_seen(obj: &Value) -> Option<&str> {
    s(obj.get("lastTimestamp"))
        .or_else(|| s(obj.get("deprecatedLastTimestamp")))
        .or_else(|| s(obj.pointer("/series/lastObservedTime")))
        .or_else(|| s(obj.get("eventTime")))
        .or_else(|| s(obj.get("firstTimestamp")))
        .or_else(|| s(obj.get("deprecatedFirstTimestamp")))
        .or_else(|| s(obj.pointer("/metadata/creationTimestamp")))
}

fn event_first_seen(obj: &Value) -> Option<&str> {
    s(obj.get("firstTimestamp"))
        .or_else(|| s(obj.get("deprecatedFirstTimestamp")))
        .or_else(|| s(obj.get("eventTime")))
        .or_else(|| s(obj.pointer("/metadata/creationTimestamp")))
}

fn event_source(obj: &Value) -> String {
    let comp = s(obj.pointer("/source/component"))
        .or_else(|| s(obj.get("reportingController")))
        .or_else(|| s(obj.pointer("/deprecatedSource/component")));
    let host = s(obj.pointer("/source/host")).or_else(|| s(obj.pointer("/deprecatedSource/host")));
    match (comp, host) {
        (Some(c), Some(h)) => format!("{c}, {h}"),
        (Some(c), None) => c.to_string(),
        (None, Some(h)) => h.to_string(),
        (None, None) => String::new(),
    }
}

fn event_count(obj: &Value) -> Value {
    let n = obj
        .get("count")
        .or_else(|| obj.get("deprecatedCount"))
        .or_else(|| obj.pointer("/series/count"))
        .and_then(Value::as_i64)
        .unwrap_or(1);
    json!(n.max(1))
}

fn is_default_class(obj: &Value) -> bool {
    let ann = obj.pointer("/metadata/annotations");
    [
        "storageclass.kubernetes.io/is-default-class",
        "storageclass.beta.kubernetes.io/is-default-class",
    ]
    .iter()
    .any(|k| ann.and_then(|a| a.get(*k)).and_then(Value::as_str) == Some("true"))
}

fn pod_ready(obj: &Value) -> String {
    let total = len(obj.pointer("/spec/containers"));
    let ready = obj
        .pointer("/status/containerStatuses")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter(|c| c["ready"] == true).count())
        .unwrap_or(0);
    format!("{ready}/{total}")
}

fn pod_status(obj: &Value) -> String {
    if obj.pointer("/metadata/deletionTimestamp").is_some() {
        return "Terminating".into();
    }
    let waiting = obj
        .pointer("/status/containerStatuses")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().find_map(|c| s(c.pointer("/state/waiting/reason"))));
    s(obj.pointer("/status/reason"))
        .or(waiting)
        .or_else(|| s(obj.pointer("/status/phase")))
        .unwrap_or("Unknown")
        .to_string()
}

fn pod_restarts(obj: &Value) -> String {
    let n: i64 = obj
        .pointer("/status/containerStatuses")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|c| c["restartCount"].as_i64()).sum())
        .unwrap_or(0);
    n.to_string()
}

/// `kind.group/name` of the controller owner (`<none>` without one).
fn controller_of(obj: &Value) -> String {
    let owner = obj
        .pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().find(|o| o["controller"] == true));
    let Some(o) = owner else {
        return NONE.to_string();
    };
    let kind = o["kind"].as_str().unwrap_or_default().to_lowercase();
    let group = o["apiVersion"]
        .as_str()
        .and_then(|av| av.rsplit_once('/').map(|(g, _)| g))
        .unwrap_or_default();
    let name = o["name"].as_str().unwrap_or_default();
    if group.is_empty() {
        format!("{kind}/{name}")
    } else {
        format!("{kind}.{group}/{name}")
    }
}

/// A binding's subjects of one kind, comma-separated (`ns/name` for ServiceAccounts).
fn binding_subjects(obj: &Value, kind: &str) -> Value {
    let names: Vec<String> = obj["subjects"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|sub| sub["kind"] == kind)
        .map(|sub| match (s(sub.get("namespace")), s(sub.get("name"))) {
            (Some(ns), Some(n)) if kind == "ServiceAccount" => format!("{ns}/{n}"),
            (_, n) => n.unwrap_or_default().to_string(),
        })
        .collect();
    Value::String(names.join(", "))
}

/// `80/TCP,22:30022/TCP` as `kubectl get svc` prints a Service's ports.
fn service_ports(obj: &Value) -> String {
    let ports: Vec<String> = obj
        .pointer("/spec/ports")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|p| {
                    let port = p["port"].as_i64().unwrap_or(0);
                    let proto = p["protocol"].as_str().unwrap_or("TCP");
                    match p["nodePort"].as_i64().filter(|n| *n > 0) {
                        Some(np) => format!("{port}:{np}/{proto}"),
                        None => format!("{port}/{proto}"),
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    if ports.is_empty() {
        NONE.into()
    } else {
        ports.join(",")
    }
}

/// `k=v,k2=v2` sorted by key, `<none>` when empty.
fn selector(obj: &Value) -> String {
    let mut pairs: Vec<String> = obj
        .pointer("/spec/selector")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default();
    pairs.sort();
    if pairs.is_empty() {
        NONE.into()
    } else {
        pairs.join(",")
    }
}

/// At most three items then ` + N more...`, as Kubernetes' printers shorten lists.
fn shorten(items: &[String], empty: &str) -> String {
    match items.len() {
        0 => empty.into(),
        1..=3 => items.join(","),
        n => format!("{} + {} more...", items[..3].join(","), n - 3),
    }
}

fn endpoints_addresses(obj: &Value) -> String {
    let mut items = Vec::new();
    for subset in obj["subsets"].as_array().into_iter().flatten() {
        let ports: Vec<i64> = subset["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["port"].as_i64())
            .collect();
        for a in subset["addresses"].as_array().into_iter().flatten() {
            let ip = a["ip"].as_str().unwrap_or_default();
            if ports.is_empty() {
                items.push(ip.to_string());
            }
            items.extend(ports.iter().map(|p| format!("{ip}:{p}")));
        }
    }
    shorten(&items, NONE)
}

fn slice_ports(obj: &Value) -> String {
    let items: Vec<String> = obj["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["port"].as_i64())
        .map(|p| p.to_string())
        .collect();
    shorten(&items, UNSET)
}

fn slice_addresses(obj: &Value) -> String {
    let items: Vec<String> = obj["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|e| e["addresses"].as_array().into_iter().flatten())
        .filter_map(|a| a.as_str().map(str::to_string))
        .collect();
    shorten(&items, UNSET)
}

/// The cell of computed column `column` of `def` for `obj`; null for a column it does not know.
pub fn cell(def: &ResourceDef, column: &str, obj: &Value) -> Value {
    let str_or = |v: Option<&Value>, default: &str| Value::String(s(v).unwrap_or(default).into());
    match (def.kind, column) {
        ("ConfigMap", "Data") => json!(len(obj.get("data")) + len(obj.get("binaryData"))),
        ("Secret", "Data") => json!(len(obj.get("data"))),
        ("ServiceAccount", "Secrets") => json!(len(obj.get("secrets"))),
        ("RoleBinding" | "ClusterRoleBinding", "Role") => Value::String(format!(
            "{}/{}",
            s(obj.pointer("/roleRef/kind")).unwrap_or_default(),
            s(obj.pointer("/roleRef/name")).unwrap_or_default()
        )),
        ("RoleBinding" | "ClusterRoleBinding", "Users") => binding_subjects(obj, "User"),
        ("RoleBinding" | "ClusterRoleBinding", "Groups") => binding_subjects(obj, "Group"),
        ("RoleBinding" | "ClusterRoleBinding", "ServiceAccounts") => {
            binding_subjects(obj, "ServiceAccount")
        }
        ("Node", "Status") => Value::String(node_status(obj)),
        ("Node", "Roles") => Value::String(node_roles(obj)),
        ("Node", "Internal-IP") => Value::String(node_address(obj, "InternalIP")),
        ("Node", "External-IP") => Value::String(node_address(obj, "ExternalIP")),
        ("PersistentVolume", "Access Modes") => access_modes(obj.pointer("/spec/accessModes")),
        ("PersistentVolume", "Claim") => {
            match (
                s(obj.pointer("/spec/claimRef/namespace")),
                s(obj.pointer("/spec/claimRef/name")),
            ) {
                (Some(ns), Some(n)) => Value::String(format!("{ns}/{n}")),
                (None, Some(n)) => Value::String(n.into()),
                _ => Value::String(String::new()),
            }
        }
        ("PersistentVolumeClaim", "Access Modes") => {
            access_modes(obj.pointer("/status/accessModes"))
        }
        ("PersistentVolumeClaim", "StorageClass") => {
            Value::String(
                s(obj.pointer("/spec/storageClassName"))
                    .or_else(|| {
                        s(obj.pointer(
                            "/metadata/annotations/volume.beta.kubernetes.io~1storage-class",
                        ))
                    })
                    .unwrap_or_default()
                    .into(),
            )
        }
        ("PersistentVolume" | "PersistentVolumeClaim", "VolumeAttributesClass") => {
            str_or(obj.pointer("/spec/volumeAttributesClassName"), UNSET)
        }
        ("PersistentVolume" | "PersistentVolumeClaim", "VolumeMode") => {
            str_or(obj.pointer("/spec/volumeMode"), UNSET)
        }
        ("Event", "Last Seen") => age(event_last_seen(obj)),
        ("Event", "First Seen") => age(event_first_seen(obj)),
        ("Event", "Object") => {
            let o = event_object(obj);
            let kind = s(o.and_then(|o| o.get("kind")))
                .unwrap_or_default()
                .to_lowercase();
            let name = s(o.and_then(|o| o.get("name"))).unwrap_or_default();
            Value::String(format!("{kind}/{name}"))
        }
        ("Event", "Subobject") => Value::String(
            s(event_object(obj).and_then(|o| o.get("fieldPath")))
                .unwrap_or_default()
                .into(),
        ),
        ("Event", "Source") => Value::String(event_source(obj)),
        ("Event", "Message") => Value::String(
            s(obj.get("message"))
                .or_else(|| s(obj.get("note")))
                .unwrap_or_default()
                .into(),
        ),
        ("Event", "Count") => event_count(obj),
        ("StorageClass", "ReclaimPolicy") => str_or(obj.get("reclaimPolicy"), "Delete"),
        ("StorageClass", "VolumeBindingMode") => str_or(obj.get("volumeBindingMode"), "Immediate"),
        ("StorageClass", "AllowVolumeExpansion") => Value::String(
            obj.get("allowVolumeExpansion")
                .and_then(Value::as_bool)
                .unwrap_or(false)
                .to_string(),
        ),
        ("Pod", "Ready") => Value::String(pod_ready(obj)),
        ("Pod", "Status") => Value::String(pod_status(obj)),
        ("Pod", "Restarts") => Value::String(pod_restarts(obj)),
        ("Pod", "Nominated Node") => str_or(obj.pointer("/status/nominatedNodeName"), NONE),
        ("Pod", "Readiness Gates") => Value::String(NONE.into()),
        ("ControllerRevision", "Controller") => Value::String(controller_of(obj)),
        ("Service", "External-IP") => Value::String(NONE.into()),
        ("Service", "Port(s)") => Value::String(service_ports(obj)),
        ("Service", "Selector") => Value::String(selector(obj)),
        ("Endpoints", "Endpoints") => Value::String(endpoints_addresses(obj)),
        ("EndpointSlice", "Ports") => Value::String(slice_ports(obj)),
        ("EndpointSlice", "Endpoints") => Value::String(slice_addresses(obj)),
        _ => Value::Null,
    }
}

/// The NAME cell: a default StorageClass is marked `(default)` as kubectl shows it.
pub fn name_cell(def: &ResourceDef, obj: &Value) -> Value {
    let name = obj
        .pointer("/metadata/name")
        .cloned()
        .unwrap_or(Value::Null);
    match (&name, def.kind) {
        (Value::String(n), "StorageClass") if is_default_class(obj) => {
            Value::String(format!("{n} (default)"))
        }
        _ => name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrovirt_api::registry::find_kind;

    fn def(av: &str, kind: &str) -> ResourceDef {
        find_kind(av, kind).unwrap_or_else(|| panic!("{av} {kind}"))
    }

    #[test]
    fn counts_modes_and_defaults() {
        let cm = json!({"data": {"a": "1", "b": "2"}, "binaryData": {"c": ""}});
        assert_eq!(cell(&def("v1", "ConfigMap"), "Data", &cm), json!(3));
        let pvc = json!({"spec": {"storageClassName": "local"},
            "status": {"accessModes": ["ReadWriteOnce", "ReadWriteMany"]}});
        let d = def("v1", "PersistentVolumeClaim");
        assert_eq!(cell(&d, "Access Modes", &pvc), "RWO,RWX");
        assert_eq!(cell(&d, "StorageClass", &pvc), "local");
        assert_eq!(cell(&d, "VolumeAttributesClass", &pvc), "<unset>");
        let pv = json!({"spec": {"claimRef": {"namespace": "ns", "name": "c"}}});
        assert_eq!(cell(&def("v1", "PersistentVolume"), "Claim", &pv), "ns/c");
        let sc = json!({"metadata": {"name": "local", "annotations":
            {"storageclass.kubernetes.io/is-default-class": "true"}}, "provisioner": "x"});
        let scd = def("storage.k8s.io/v1", "StorageClass");
        assert_eq!(name_cell(&scd, &sc), "local (default)");
        assert_eq!(cell(&scd, "ReclaimPolicy", &sc), "Delete");
        assert_eq!(cell(&scd, "VolumeBindingMode", &sc), "Immediate");
        assert_eq!(cell(&scd, "AllowVolumeExpansion", &sc), "false");
    }

    #[test]
    fn services_and_endpoints() {
        let svc = json!({"spec": {"type": "NodePort", "selector": {"b": "2", "a": "1"},
            "ports": [{"port": 80, "protocol": "TCP", "nodePort": 30080},
                      {"port": 53, "protocol": "UDP"}]}});
        let d = def("v1", "Service");
        assert_eq!(cell(&d, "Port(s)", &svc), "80:30080/TCP,53/UDP");
        assert_eq!(cell(&d, "Selector", &svc), "a=1,b=2");
        assert_eq!(cell(&d, "External-IP", &svc), "<none>");
        assert_eq!(cell(&d, "Port(s)", &json!({"spec": {}})), "<none>");
        let ep = json!({"subsets": [{"addresses": [{"ip": "10.244.0.2"}, {"ip": "10.244.1.2"}],
            "ports": [{"port": 80}, {"port": 22}]}]});
        assert_eq!(
            cell(&def("v1", "Endpoints"), "Endpoints", &ep),
            "10.244.0.2:80,10.244.0.2:22,10.244.1.2:80 + 1 more..."
        );
        let es = json!({"ports": [{"port": 80}], "endpoints": [{"addresses": ["10.244.0.2"]}]});
        let d = def("discovery.k8s.io/v1", "EndpointSlice");
        assert_eq!(cell(&d, "Ports", &es), "80");
        assert_eq!(cell(&d, "Endpoints", &es), "10.244.0.2");
        assert_eq!(cell(&d, "Endpoints", &json!({})), "<unset>");
    }

    #[test]
    fn nodes_events_owners() {
        let node = json!({"metadata": {"labels": {"node-role.kubernetes.io/control-plane": "",
            "kubernetes.io/hostname": "n"}},
            "spec": {"unschedulable": true},
            "status": {"conditions": [{"type": "Ready", "status": "True"}],
                "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]}});
        let d = def("v1", "Node");
        assert_eq!(cell(&d, "Status", &node), "Ready,SchedulingDisabled");
        assert_eq!(cell(&d, "Roles", &node), "control-plane");
        assert_eq!(cell(&d, "Internal-IP", &node), "10.0.0.1");
        assert_eq!(cell(&d, "External-IP", &node), "<none>");
        let ev = json!({"involvedObject": {"kind": "VirtualMachine", "name": "vm1"},
            "message": "hi", "count": 3, "source": {"component": "c", "host": "h"}});
        let e = def("v1", "Event");
        assert_eq!(cell(&e, "Object", &ev), "virtualmachine/vm1");
        assert_eq!(cell(&e, "Message", &ev), "hi");
        assert_eq!(cell(&e, "Source", &ev), "c, h");
        assert_eq!(cell(&e, "Count", &ev), json!(3));
        let v1 = json!({"regarding": {"kind": "Node", "name": "n"}, "note": "x"});
        let e1 = def("events.k8s.io/v1", "Event");
        assert_eq!(cell(&e1, "Object", &v1), "node/n");
        assert_eq!(cell(&e1, "Message", &v1), "x");
        let cr = json!({"metadata": {"ownerReferences": [{"apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachine", "name": "vm1", "controller": true}]}});
        assert_eq!(
            cell(&def("apps/v1", "ControllerRevision"), "Controller", &cr),
            "virtualmachine.kubevirt.io/vm1"
        );
    }
}
