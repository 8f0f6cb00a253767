//! The node's Service data plane: watch-fed caches of Services and EndpointSlices (two
//! reflectors: one list each at start, then watches), [`service_ports`] (pure) turning them
//! into the ports this node carries out, and [`run`] writing
//! [`ferrovirt_network::services::services_nft_script`] into the node namespace whenever the
//! rendered table changes (one `nft -f -` that replaces the table atomically). Only on the pod
//! network; on user networking there is nothing to program.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use ferrovirt_api::service::LABEL_SERVICE_NAME;
use ferrovirt_network::render::Action;
use ferrovirt_network::services::{Proto, ServicePort, services_nft_script};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::Api;
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::{WatchStreamExt, watcher};

use crate::network::AgentNet;

/// The ports of `services` with the ready endpoints their EndpointSlices list (by the
/// `kubernetes.io/service-name` label, in the Service's namespace), sorted.
pub fn service_ports(services: &[Arc<Service>], slices: &[Arc<EndpointSlice>]) -> Vec<ServicePort> {
    service_ports_with(services, slices, |s| !on_udn(s))
}

/// [`service_ports`] over the slices `keep` accepts (the pod network's, or one network's).
pub fn service_ports_with(
    services: &[Arc<Service>],
    slices: &[Arc<EndpointSlice>],
    keep: impl Fn(&EndpointSlice) -> bool,
) -> Vec<ServicePort> {
    let mut out = Vec::new();
    for svc in services {
        let (Some(ns), Some(name), Some(spec)) = (
            svc.metadata.namespace.as_deref(),
            svc.metadata.name.as_deref(),
            svc.spec.as_ref(),
        ) else {
            continue;
        };
        let cluster_ip = spec
            .cluster_ip
            .as_deref()
            .and_then(|ip| ip.parse::<Ipv4Addr>().ok());
        let mine: Vec<&EndpointSlice> = slices
            .iter()
            .map(|s| &**s)
            .filter(|s| {
                s.metadata.namespace.as_deref() == Some(ns)
                    && s.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(LABEL_SERVICE_NAME))
                        .map(String::as_str)
                        == Some(name)
                    && s.address_type == "IPv4"
                    && keep(s)
            })
            .collect();
        for p in spec.ports.iter().flatten() {
            let Some(proto) = Proto::parse(p.protocol.as_deref().unwrap_or("TCP")) else {
                continue;
            };
            let Ok(port) = u16::try_from(p.port) else {
                continue;
            };
            let pname = p.name.clone().unwrap_or_default();
            let mut endpoints = Vec::new();
            for s in &mine {
                // The slice's port of the same name (Kubernetes' rule) gives the target port.
                let Some(tp) = s
                    .ports
                    .iter()
                    .flatten()
                    .find(|sp| sp.name.clone().unwrap_or_default() == pname)
                    .and_then(|sp| sp.port)
                    .and_then(|n| u16::try_from(n).ok())
                else {
                    continue;
                };
                for e in &s.endpoints {
                    if e.conditions.as_ref().and_then(|c| c.ready) != Some(true) {
                        continue;
                    }
                    for a in &e.addresses {
                        if let Ok(ip) = a.parse::<Ipv4Addr>() {
                            endpoints.push((ip, tp));
                        }
                    }
                }
            }
            out.push(ServicePort {
                id: format!("{ns}/{name}:{port}"),
                cluster_ip,
                port,
                node_port: p
                    .node_port
                    .and_then(|n| u16::try_from(n).ok())
                    .filter(|n| *n > 0),
                proto,
                endpoints,
            });
        }
    }
    out.sort();
    out
}

/// Whether the slice lists addresses on a user-defined network (the endpoints controller's
/// `k8s.ovn.org/endpointslice-network`): those are carried out in the network's namespace
/// (`crate::udn_svc`), never by the pod network's table.
fn on_udn(s: &EndpointSlice) -> bool {
    s.metadata.annotations.as_ref().is_some_and(|a| {
        a.contains_key(ferrovirt_network::udn_svc::ENDPOINTSLICE_NETWORK_ANNOTATION)
    })
}

/// Keeps the node's Service table equal to the Services and EndpointSlices (pod network
/// only; never returns there, and waits forever on user networking).
pub async fn run(net: &AgentNet, client: kube::Client) {
    let Some(node) = net.node_network().cloned() else {
        return std::future::pending().await;
    };
    let table = format!("{}-svc", node.nft_table);
    let (svcs, svc_w) = reflector::store::<Service>();
    let (slices, slice_w) = reflector::store::<EndpointSlice>();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
    let watch_svcs = drive(Api::<Service>::all(client.clone()), svc_w, tx.clone());
    let watch_slices = drive(Api::<EndpointSlice>::all(client), slice_w, tx);
    let work = async move {
        let _ = svcs.wait_until_ready().await;
        let _ = slices.wait_until_ready().await;
        let mut last: Option<String> = None;
        loop {
            let script = render(&node, &table, &svcs, &slices);
            if last.as_ref() != Some(&script) {
                let action = Action::Nft {
                    netns: node.netns.clone(),
                    script: script.clone(),
                };
                match ferrovirt_network::apply::apply_one(&action).await {
                    Ok(()) => {
                        tracing::info!(table = %table, "services: node table written");
                        last = Some(script);
                    }
                    Err(e) => tracing::warn!("services: writing the node table failed: {e}"),
                }
            }
            // A change, or a retry after a failed write.
            let wait = if last.is_some() {
                Duration::from_secs(3600)
            } else {
                Duration::from_secs(2)
            };
            if let Ok(None) = tokio::time::timeout(wait, rx.recv()).await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            while rx.try_recv().is_ok() {}
        }
    };
    tokio::join!(watch_svcs, watch_slices, work);
}

fn render(
    node: &ferrovirt_network::NodeNetwork,
    table: &str,
    svcs: &Store<Service>,
    slices: &Store<EndpointSlice>,
) -> String {
    let ports = service_ports(&svcs.state(), &slices.state());
    services_nft_script(table, node.ipam.cluster, &ports)
}

pub(crate) async fn drive<K>(
    api: Api<K>,
    writer: reflector::store::Writer<K>,
    tx: tokio::sync::mpsc::Sender<()>,
) where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let mut events = reflector(
        writer,
        watcher(api, watcher::Config::default()).default_backoff(),
    )
    .boxed();
    while let Some(ev) = events.next().await {
        match ev {
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
            Ok(_) => {
                let _ = tx.try_send(());
            }
            Err(e) => tracing::warn!("services: watch failed: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(v: serde_json::Value) -> Arc<Service> {
        Arc::new(serde_json::from_value(v).unwrap())
    }
    fn slice(v: serde_json::Value) -> Arc<EndpointSlice> {
        Arc::new(serde_json::from_value(v).unwrap())
    }

    #[test]
    fn ready_endpoints_of_the_named_slice_only() {
        let services = [svc(serde_json::json!({
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {"clusterIP": "10.96.0.10", "type": "NodePort",
                "ports": [{"port": 80, "protocol": "TCP", "targetPort": "http", "nodePort": 30080}]}}))];
        let slices = [
            slice(serde_json::json!({
                "metadata": {"name": "web-abcde", "namespace": "ns",
                    "labels": {"kubernetes.io/service-name": "web"}},
                "addressType": "IPv4",
                "endpoints": [
                    {"addresses": ["10.244.0.2"], "conditions": {"ready": true}},
                    {"addresses": ["10.244.1.2"], "conditions": {"ready": false}}],
                "ports": [{"name": "", "port": 8080, "protocol": "TCP"}]})),
            slice(serde_json::json!({
                "metadata": {"name": "other", "namespace": "elsewhere",
                    "labels": {"kubernetes.io/service-name": "web"}},
                "addressType": "IPv4",
                "endpoints": [{"addresses": ["10.244.9.9"], "conditions": {"ready": true}}],
                "ports": [{"name": "", "port": 1}]})),
        ];
        let ports = service_ports(&services, &slices);
        assert_eq!(ports.len(), 1);
        // A slice on a user-defined network is never the pod network's.
        let mut udn = (*slices[0]).clone();
        udn.metadata.annotations = Some(
            [(
                ferrovirt_network::udn_svc::ENDPOINTSLICE_NETWORK_ANNOTATION.to_string(),
                "ns_net".to_string(),
            )]
            .into(),
        );
        let p = service_ports(&services, &[Arc::new(udn)]);
        assert!(p[0].endpoints.is_empty(), "{p:?}");
        assert_eq!(ports[0].cluster_ip, Some(Ipv4Addr::new(10, 96, 0, 10)));
        assert_eq!(ports[0].node_port, Some(30080));
        assert_eq!(
            ports[0].endpoints,
            vec![(Ipv4Addr::new(10, 244, 0, 2), 8080)]
        );
    }
}
