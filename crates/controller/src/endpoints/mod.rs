//! The endpoints controller (Kubernetes' EndpointSlice and Endpoints controllers for Services
//! in front of VMs). [`desired`] (pure) turns a Service with a selector and the namespace's VMIs
//! into the one `discovery.k8s.io/v1` EndpointSlice and the legacy core/v1 Endpoints it should
//! have: the pod-network address of every VMI whose launcher Pod view
//! ([`ferrovirt_api::launcher_pod::pod_for`]: the VMI's labels plus `vm.kubevirt.io/name`,
//! `kubevirt.io=virt-launcher`, …) matches the selector; ready when the VMI is Running and
//! Ready, not ready (terminating) once it is being deleted, gone once it has stopped.
//! Named target ports resolve through the VMI's interface `ports`; a VMI without the name is
//! left out. [`run`](crate::endpoints::run) applies it, woken by Service and VMI watch events.

mod run;

pub use run::run;

use std::collections::BTreeMap;

use ferrovirt_api::launcher_pod;
use ferrovirt_api::service::{LABEL_MANAGED_BY, LABEL_SERVICE_NAME, MANAGED_BY};
use serde_json::{Value, json};

/// Component name (the EndpointSlice `managed-by` value and log target).
pub const COMPONENT: &str = "endpoints-controller";

/// What a Service's endpoint objects should be.
#[derive(Debug, Clone, PartialEq)]
pub struct Desired {
    /// The EndpointSlice (`<service>-<5 chars of its uid>`).
    pub slice: Value,
    /// The Endpoints (named as the Service).
    pub endpoints: Value,
}

fn s<'a>(v: &'a Value, ptr: &str) -> Option<&'a str> {
    v.pointer(ptr)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

/// The EndpointSlice name of a Service: its name and five characters of its uid.
pub fn slice_name(svc: &Value) -> String {
    let name = s(svc, "/metadata/name").unwrap_or_default();
    let uid: String = s(svc, "/metadata/uid")
        .unwrap_or_default()
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(5)
        .collect();
    format!("{name}-{uid}")
}

/// Whether `labels` match every `key: value` of `selector` (an empty selector matches
/// nothing: a Service without a selector keeps user-written endpoints).
pub fn selector_matches(selector: &serde_json::Map<String, Value>, labels: &Value) -> bool {
    !selector.is_empty()
        && selector
            .iter()
            .all(|(k, v)| labels.get(k).is_some_and(|l| l == v))
}

/// The port number a named target port has on `vmi` (its interfaces' `ports`).
fn named_port(vmi: &Value, name: &str, protocol: &str) -> Option<i64> {
    vmi.pointer("/spec/domain/devices/interfaces")
        .and_then(Value::as_array)?
        .iter()
        .flat_map(|i| i["ports"].as_array().into_iter().flatten())
        .find(|p| p["name"] == name && p["protocol"].as_str().unwrap_or("TCP") == protocol)
        .and_then(|p| p["port"].as_i64())
}

/// The slice ports of `svc` on `vmi`: (name, port, protocol) per Service port; None when a
/// named target port does not resolve.
fn ports_on(svc: &Value, vmi: &Value) -> Option<Vec<(String, i64, String)>> {
    let mut out = Vec::new();
    for p in svc
        .pointer("/spec/ports")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let name = p["name"].as_str().unwrap_or_default().to_string();
        let proto = p["protocol"].as_str().unwrap_or("TCP").to_string();
        let port = match &p["targetPort"] {
            Value::Number(n) => n.as_i64()?,
            Value::String(n) => named_port(vmi, n, &proto)?,
            _ => p["port"].as_i64()?,
        };
        out.push((name, port, proto));
    }
    Some(out)
}

/// One VMI's endpoint: (address, ready, terminating, node, pod name, pod uid).
struct Member {
    ip: String,
    ready: bool,
    serving: bool,
    terminating: bool,
    node: String,
    pod: String,
    pod_uid: String,
}

/// The endpoint objects of `svc` given the VMIs of its namespace (as JSON); None for a
/// Service without a selector.
pub fn desired(svc: &Value, vmis: &[Value]) -> Option<Desired> {
    let selector = svc.pointer("/spec/selector").and_then(Value::as_object)?;
    if selector.is_empty() {
        return None;
    }
    let ns = s(svc, "/metadata/namespace").unwrap_or("default");
    let publish_not_ready = svc.pointer("/spec/publishNotReadyAddresses") == Some(&json!(true));
    let mut members: BTreeMap<String, Member> = BTreeMap::new();
    let mut ports: Option<Vec<(String, i64, String)>> = None;
    for vmi in vmis {
        if s(vmi, "/metadata/namespace").unwrap_or("default") != ns {
            continue;
        }
        let Some(pod) = launcher_pod::pod_for(vmi) else {
            continue;
        };
        if !selector_matches(selector, &pod["metadata"]["labels"]) {
            continue;
        }
        let Some(ip) =
            s(&pod, "/status/podIP").filter(|ip| ip.parse::<std::net::Ipv4Addr>().is_ok())
        else {
            continue;
        };
        let Some(mine) = ports_on(svc, vmi) else {
            continue;
        };
        match &ports {
            None => ports = Some(mine),
            Some(p) if *p != mine => continue,
            Some(_) => {}
        }
        let terminating = pod.pointer("/metadata/deletionTimestamp").is_some();
        let running = s(&pod, "/status/phase") == Some("Running");
        let serving =
            running && pod["status"]["containerStatuses"][0]["ready"] == true || publish_not_ready;
        let ready = serving && !terminating;
        members.insert(
            s(&pod, "/metadata/name").unwrap_or_default().to_string(),
            Member {
                ip: ip.to_string(),
                ready,
                serving,
                terminating,
                node: s(&pod, "/spec/nodeName").unwrap_or_default().to_string(),
                pod: s(&pod, "/metadata/name").unwrap_or_default().to_string(),
                pod_uid: s(&pod, "/metadata/uid").unwrap_or_default().to_string(),
            },
        );
    }
    let ports = ports.unwrap_or_else(|| {
        svc.pointer("/spec/ports")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|p| {
                Some((
                    p["name"].as_str().unwrap_or_default().to_string(),
                    p["targetPort"].as_i64().or_else(|| p["port"].as_i64())?,
                    p["protocol"].as_str().unwrap_or("TCP").to_string(),
                ))
            })
            .collect()
    });
    let svc_name = s(svc, "/metadata/name").unwrap_or_default();
    let owner = json!([{
        "apiVersion": "v1", "kind": "Service", "name": svc_name,
        "uid": s(svc, "/metadata/uid").unwrap_or_default(),
        "controller": true, "blockOwnerDeletion": true,
    }]);
    let mut labels = svc
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let target =
        |m: &Member| json!({"kind": "Pod", "namespace": ns, "name": m.pod, "uid": m.pod_uid});
    let endpoints_subset_ports: Vec<Value> = ports
        .iter()
        .map(|(n, p, proto)| {
            let mut v = json!({"port": p, "protocol": proto});
            if !n.is_empty() {
                v["name"] = json!(n);
            }
            v
        })
        .collect();
    let (ready, not_ready): (Vec<&Member>, Vec<&Member>) = members.values().partition(|m| m.ready);
    let addr = |m: &&Member| json!({"ip": m.ip, "nodeName": m.node, "targetRef": target(m)});
    let mut subset = json!({"ports": endpoints_subset_ports});
    if !ready.is_empty() {
        subset["addresses"] = json!(ready.iter().map(addr).collect::<Vec<_>>());
    }
    if !not_ready.is_empty() {
        subset["notReadyAddresses"] = json!(not_ready.iter().map(addr).collect::<Vec<_>>());
    }
    let endpoints = json!({
        "apiVersion": "v1", "kind": "Endpoints",
        "metadata": {"name": svc_name, "namespace": ns, "labels": labels.clone(),
            "ownerReferences": owner.clone()},
        "subsets": if members.is_empty() { json!([]) } else { json!([subset]) },
    });
    labels.insert(LABEL_SERVICE_NAME.into(), json!(svc_name));
    labels.insert(LABEL_MANAGED_BY.into(), json!(MANAGED_BY));
    let slice = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": slice_name(svc), "namespace": ns, "labels": labels,
            "ownerReferences": owner},
        "addressType": "IPv4",
        "endpoints": members.values().map(|m| json!({
            "addresses": [m.ip],
            "conditions": {"ready": m.ready, "serving": m.serving, "terminating": m.terminating},
            "nodeName": m.node,
            "targetRef": target(m),
        })).collect::<Vec<_>>(),
        "ports": ports.iter().map(|(n, p, proto)| json!({"name": n, "port": p, "protocol": proto})).collect::<Vec<_>>(),
    });
    Some(Desired { slice, endpoints })
}

/// Marks the slice of a Service whose namespace's primary network is the user-defined network
/// `network` with OVN-Kubernetes' `k8s.ovn.org/endpointslice-network: <network>`: its
/// addresses (the VMIs' `status.interfaces[0].ipAddress`) are on that network, carried out in
/// the network's namespace on each node, never by the pod network's table.
pub fn mark_network(want: &mut Desired, network: Option<&str>) {
    if let Some(n) = network {
        want.slice["metadata"]["annotations"] = json!({
            ferrovirt_network::udn_svc::ENDPOINTSLICE_NETWORK_ANNOTATION: n
        });
    }
}

/// The Warning Event message for a NodePort Service whose endpoints are on the user-defined
/// network `network`: its node ports are not carried out there (ClusterIP only); None
/// otherwise.
pub fn node_port_refusal(svc: &Value, network: Option<&str>) -> Option<String> {
    let network = network?;
    let ports: Vec<String> = svc
        .pointer("/spec/ports")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|p| p["nodePort"].as_i64())
        .map(|n| n.to_string())
        .collect();
    (s(svc, "/spec/type") == Some("NodePort") || !ports.is_empty()).then(|| {
        format!(
            "spec.ports[].nodePort {}: node ports are not carried out for Services on the \
             user-defined network {network} (its ClusterIP is, from that network)",
            ports.join(",")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(name: &str, ip: &str, phase: &str, labels: Value) -> Value {
        json!({
            "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"), "labels": labels},
            "spec": {"domain": {"devices": {"interfaces": [{"name": "default", "masquerade": {},
                "ports": [{"name": "http", "port": 8080}]}]}}},
            "status": {"nodeName": "n1", "phase": phase,
                "conditions": [{"type": "Ready", "status": "True"}],
                "interfaces": [{"name": "default", "ipAddress": ip}]},
        })
    }

    fn svc(selector: Value, target: Value) -> Value {
        json!({"metadata": {"name": "web", "namespace": "ns", "uid": "abc-def-123"},
            "spec": {"selector": selector, "ports": [{"name": "h", "port": 80, "protocol": "TCP", "targetPort": target}]}})
    }

    #[test]
    fn running_matching_vmis_become_ready_endpoints() {
        let vmis = [
            vmi("a", "10.244.0.2", "Running", json!({"app": "web"})),
            vmi("b", "10.244.1.2", "Running", json!({"app": "web"})),
            vmi("c", "10.244.1.3", "Running", json!({"app": "db"})),
            vmi("d", "10.244.1.4", "Scheduled", json!({"app": "web"})),
        ];
        let d = desired(&svc(json!({"app": "web"}), json!(80)), &vmis).unwrap();
        assert_eq!(d.slice["metadata"]["name"], "web-abcde");
        assert_eq!(d.slice["metadata"]["labels"][LABEL_SERVICE_NAME], "web");
        let eps = d.slice["endpoints"].as_array().unwrap();
        // A VMI not Running yet is listed, not ready (as a Pending Pod with an address).
        assert_eq!(eps.len(), 3, "{eps:?}");
        assert_eq!(eps[2]["conditions"]["ready"], false);
        assert_eq!(eps[0]["addresses"], json!(["10.244.0.2"]));
        assert_eq!(eps[0]["conditions"]["ready"], true);
        assert_eq!(eps[0]["targetRef"]["kind"], "Pod");
        assert_eq!(
            d.slice["ports"],
            json!([{"name": "h", "port": 80, "protocol": "TCP"}])
        );
        assert_eq!(
            d.endpoints["subsets"][0]["addresses"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
    }

    #[test]
    fn slices_on_a_primary_udn_are_marked_with_the_network() {
        let vmis = [vmi("a", "10.100.0.7", "Running", json!({"app": "web"}))];
        let mut d = desired(&svc(json!({"app": "web"}), json!(80)), &vmis).unwrap();
        let plain = d.clone();
        mark_network(&mut d, None);
        assert_eq!(d, plain);
        mark_network(&mut d, Some("ns_net"));
        assert_eq!(
            d.slice["metadata"]["annotations"]["k8s.ovn.org/endpointslice-network"],
            "ns_net"
        );
        assert_eq!(d.slice["endpoints"][0]["addresses"], json!(["10.100.0.7"]));
        assert!(d.endpoints["metadata"].get("annotations").is_none());
    }

    #[test]
    fn node_ports_on_a_udn_are_refused_in_an_event() {
        let mut sv = svc(json!({"app": "web"}), json!(80));
        assert_eq!(node_port_refusal(&sv, Some("ns_net")), None);
        sv["spec"]["type"] = json!("NodePort");
        sv["spec"]["ports"][0]["nodePort"] = json!(30080);
        assert_eq!(node_port_refusal(&sv, None), None);
        let m = node_port_refusal(&sv, Some("ns_net")).unwrap();
        assert!(m.contains("30080") && m.contains("ns_net"), "{m}");
    }

    #[test]
    fn selects_by_the_launcher_pod_labels() {
        let vmis = [vmi("vm1", "10.244.0.2", "Running", json!({}))];
        let d = desired(
            &svc(json!({"vm.kubevirt.io/name": "vm1"}), json!(80)),
            &vmis,
        )
        .unwrap();
        assert_eq!(d.slice["endpoints"].as_array().unwrap().len(), 1);
        assert!(desired(&svc(json!({}), json!(80)), &vmis).is_none());
    }

    #[test]
    fn named_ports_resolve_through_the_interface_ports() {
        let vmis = [vmi("a", "10.244.0.2", "Running", json!({"app": "web"}))];
        let d = desired(&svc(json!({"app": "web"}), json!("http")), &vmis).unwrap();
        assert_eq!(d.slice["ports"][0]["port"], 8080);
        let d = desired(&svc(json!({"app": "web"}), json!("nope")), &vmis).unwrap();
        assert_eq!(d.slice["endpoints"], json!([]));
    }

    #[test]
    fn deleting_vmis_turn_not_ready_and_stopped_ones_go() {
        let mut going = vmi("a", "10.244.0.2", "Running", json!({"app": "web"}));
        going["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        let done = vmi("b", "10.244.0.3", "Succeeded", json!({"app": "web"}));
        let d = desired(&svc(json!({"app": "web"}), json!(80)), &[going, done]).unwrap();
        let eps = d.slice["endpoints"].as_array().unwrap();
        assert_eq!(eps.len(), 1);
        assert_eq!(
            eps[0]["conditions"],
            json!({"ready": false, "serving": true, "terminating": true})
        );
        assert!(d.endpoints["subsets"][0].get("addresses").is_none());
        assert_eq!(
            d.endpoints["subsets"][0]["notReadyAddresses"][0]["ip"],
            "10.244.0.2"
        );
    }
}
