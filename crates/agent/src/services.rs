//! The node's Service data plane: watch-fed caches of Services and EndpointSlices (two
//! reflectors: one list each at start, then watches), [`service_ports`] (pure) turning them
//! into the ports this node carries out, and [`run`] writing
//! [`ferrovirt_network::services::services_nft_script`] into the node namespace whenever the
//! rendered table changes (one `nft -f -` that replaces the table atomically). Only on the pod
//! network; on user networking there is nothing to program.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// The node's Service and EndpointSlice caches: one watch of each for the whole agent, read
/// by the pod network's table ([`run`]) and the user-defined networks' tables
/// ([`crate::udn_svc::run`]).
///
/// Readiness is kept here, not through `Store::wait_until_ready`: kube-runtime's store wakes
/// only the last of several tasks waiting on it (its one-shot keeps one waker), and two loops
/// wait on these stores.
#[derive(Clone)]
pub struct ServiceCaches {
    pub svcs: Store<Service>,
    pub slices: Store<EndpointSlice>,
    /// Bumped at every change of either cache, their first lists included.
    changed: tokio::sync::watch::Receiver<u64>,
    /// Each cache holds its first list.
    listed: [Arc<AtomicBool>; 2],
}

impl ServiceCaches {
    /// The caches and the future that keeps them (the two watches, with backoff; it never
    /// ends while the API server answers).
    pub fn new(client: &kube::Client) -> (ServiceCaches, futures::future::BoxFuture<'static, ()>) {
        let (svcs, svc_w) = reflector::store::<Service>();
        let (slices, slice_w) = reflector::store::<EndpointSlice>();
        let (tx, changed) = tokio::sync::watch::channel(0u64);
        let tx = Arc::new(tx);
        let listed = [
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        ];
        let (t1, t2) = (tx.clone(), tx);
        let (l1, l2) = (listed[0].clone(), listed[1].clone());
        let (c1, c2) = (client.clone(), client.clone());
        let watches = async move {
            tokio::join!(
                drive(Api::<Service>::all(c1), svc_w, move |first| {
                    if first {
                        l1.store(true, Ordering::Release);
                    }
                    t1.send_modify(|v| *v += 1)
                }),
                drive(Api::<EndpointSlice>::all(c2), slice_w, move |first| {
                    if first {
                        l2.store(true, Ordering::Release);
                    }
                    t2.send_modify(|v| *v += 1)
                }),
            );
        };
        let caches = ServiceCaches {
            svcs,
            slices,
            changed,
            listed,
        };
        (caches, Box::pin(watches))
    }

    /// A receiver that sees the changes made after this call.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        let mut r = self.changed.clone();
        r.mark_unchanged();
        r
    }

    /// Waits until both caches hold their first list.
    pub async fn ready(&self) {
        let mut changes = self.changed.clone();
        while !self.listed.iter().all(|l| l.load(Ordering::Acquire)) {
            changed(&mut changes).await;
        }
    }
}

/// Waits for the next change of `changes` (forever once its sender is gone).
pub(crate) async fn changed(changes: &mut tokio::sync::watch::Receiver<u64>) {
    if changes.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Keeps the node's Service table equal to the Services and EndpointSlices (pod network
/// only; never returns there, and waits forever on user networking).
pub async fn run(net: &AgentNet, caches: ServiceCaches) {
    let Some(node) = net.node_network().cloned() else {
        return std::future::pending().await;
    };
    let table = format!("{}-svc", node.nft_table);
    let mut changes = caches.changes();
    caches.ready().await;
    let mut last: Option<String> = None;
    loop {
        let script = render(&node, &table, &caches.svcs, &caches.slices);
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
        let _ = tokio::time::timeout(wait, changed(&mut changes)).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        changes.mark_unchanged();
    }
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

/// Keeps `writer`'s store from a watch of `api`; `on_change(first list done)` after each
/// change, the first list's end included.
async fn drive<K>(api: Api<K>, writer: reflector::store::Writer<K>, on_change: impl Fn(bool))
where
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
            Ok(watcher::Event::InitDone) => on_change(true),
            Ok(_) => on_change(false),
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
