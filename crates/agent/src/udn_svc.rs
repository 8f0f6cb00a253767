//! Services on Primary user-defined networks on this node (docs/networking.md "Services on
//! Primary user-defined networks"): the agent's shared Service and EndpointSlice caches
//! ([`crate::services::ServiceCaches`]) and a watch-fed cache of the user-defined networks'
//! NADs, [`network_ports`] (pure) choosing the ports
//! each network carries out (Services of the namespaces where it is primary, slices the
//! endpoints controller marked with its name), and [`run`] keeping the table
//! [`ferrovirt_network::udn_svc::nft_script`] in the namespace of every Primary network a VMI
//! of this node uses (after [`ferrovirt_network::udn_svc::link_steps`], once per namespace).
//! What is not carried out is said in the log: a namespace where the Service link cannot be
//! made (br_netfilter missing), node ports of such Services.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::time::Duration;

use ferrovirt_api::udn::NAD_LABEL;
use ferrovirt_network::render::Action;
use ferrovirt_network::services::ServicePort;
use ferrovirt_network::udn::UdnNetwork;
use ferrovirt_network::udn_svc::{
    ENDPOINTSLICE_NETWORK_ANNOTATION, PrimaryNet, ROUTE_TABLE, link_steps, nft_script,
    primary_networks_of, rule_args,
};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::{WatchStreamExt, watcher};

use crate::network::AgentNet;
use crate::services::{ServiceCaches, changed, service_ports_with};

/// How often the networks in use on this node are looked at again (a network made for a
/// VMI that just started gets its table within this time).
const PASS: Duration = Duration::from_secs(2);

/// The ports network `network` carries out: the Services of the namespaces where it is the
/// primary network (`primaries`, [`primary_networks_of`]) with the ready endpoints of the
/// slices marked with its name.
pub fn network_ports(
    network: &str,
    primaries: &BTreeMap<String, PrimaryNet>,
    services: &[Arc<Service>],
    slices: &[Arc<EndpointSlice>],
) -> Vec<ServicePort> {
    let namespaces: BTreeSet<&str> = primaries
        .iter()
        .filter(|(_, n)| n.name == network)
        .map(|(ns, _)| ns.as_str())
        .collect();
    let mine: Vec<Arc<Service>> = services
        .iter()
        .filter(|s| namespaces.contains(s.metadata.namespace.as_deref().unwrap_or("default")))
        .cloned()
        .collect();
    service_ports_with(&mine, slices, |s| {
        s.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ENDPOINTSLICE_NETWORK_ANNOTATION))
            .is_some_and(|n| n == network)
    })
}

fn nad_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("k8s.cni.cncf.io", "v1", "NetworkAttachmentDefinition"),
        "network-attachment-definitions",
    )
}

/// The namespaces' primary networks from the cached NADs.
fn primaries(nads: &Store<DynamicObject>) -> BTreeMap<String, PrimaryNet> {
    let state = nads.state();
    primary_networks_of(
        state
            .iter()
            .map(|n| (n.metadata.namespace.as_deref(), &n.data)),
    )
}

/// The namespace's identity (a network removed and made again is a new namespace).
fn netns_ino(netns: &str) -> Option<u64> {
    std::fs::metadata(ferrovirt_network::netns::path(netns))
        .ok()
        .map(|m| m.ino())
}

/// Makes the network's Service link (Layer2) and its fwmark rule when missing.
async fn ensure_link(net: &UdnNetwork) -> Result<(), ferrovirt_network::Error> {
    ferrovirt_network::apply::apply_all(&link_steps(net)).await?;
    if net.layer3 {
        return Ok(());
    }
    let ns = Some(net.netns.clone());
    let rules =
        ferrovirt_network::apply::query("ip", &ns, &["rule", "show", "pref", ROUTE_TABLE]).await?;
    if rules.trim().is_empty() {
        ferrovirt_network::apply::apply_one(&Action::Ip {
            netns: ns,
            args: rule_args(),
        })
        .await?;
    }
    Ok(())
}

/// Keeps the Service table of every Primary user-defined network in use on this node (pod
/// network nodes only; waits forever on user networking).
pub async fn run(net: &AgentNet, client: kube::Client, caches: ServiceCaches) {
    if net.node_network().is_none() {
        return std::future::pending().await;
    }
    let nad_w = reflector::store::Writer::<DynamicObject>::new(nad_resource());
    let nads = nad_w.as_reader();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
    let watch_nads = async move {
        let api: Api<DynamicObject> = Api::all_with(client, &nad_resource());
        let cfg = watcher::Config::default().labels(NAD_LABEL);
        let mut events = reflector(nad_w, watcher(api, cfg).default_backoff()).boxed();
        while let Some(ev) = events.next().await {
            match ev {
                Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
                Ok(_) => {
                    let _ = tx.try_send(());
                }
                Err(e) => tracing::warn!("udn services: NAD watch failed: {e}"),
            }
        }
    };
    let work = async move {
        let mut changes = caches.changes();
        caches.ready().await;
        // Per network namespace: (its inode, the script written).
        let mut written: BTreeMap<String, (u64, Option<String>)> = BTreeMap::new();
        let mut told: BTreeSet<String> = BTreeSet::new();
        loop {
            pass(
                net,
                &caches.svcs,
                &caches.slices,
                &nads,
                &mut written,
                &mut told,
            )
            .await;
            let _ = tokio::time::timeout(PASS, async {
                tokio::select! {
                    _ = rx.recv() => {}
                    () = changed(&mut changes) => {}
                }
            })
            .await;
            while rx.try_recv().is_ok() {}
            changes.mark_unchanged();
        }
    };
    tokio::join!(watch_nads, work);
}

async fn pass(
    net: &AgentNet,
    svcs: &Store<Service>,
    slices: &Store<EndpointSlice>,
    nads: &Store<DynamicObject>,
    written: &mut BTreeMap<String, (u64, Option<String>)>,
    told: &mut BTreeSet<String>,
) {
    let primaries = primaries(nads);
    let in_use = net.udns_in_use(None);
    written.retain(|ns, _| in_use.contains_key(ns));
    let (services, slices) = (svcs.state(), slices.state());
    for (netns, udn) in &in_use {
        let Some(p) = primaries.values().find(|p| p.name == udn.name) else {
            continue; // a Secondary network: no Services
        };
        let Some(ino) = netns_ino(netns) else {
            continue;
        };
        let ports = network_ports(&udn.name, &primaries, &services, &slices);
        if written.get(netns).map(|w| w.0) != Some(ino) {
            // No Service on this network yet: neither the Service link nor br_netfilter
            // (its bridged traffic is not conntracked for nothing).
            if ports.is_empty() {
                continue;
            }
            written.remove(netns);
            if let Err(e) = ensure_link(udn).await {
                if told.insert(format!("link {netns} {ino}")) {
                    tracing::warn!(network = %udn.name, netns = %netns,
                        "Services on this user-defined network are not carried out on this node \
                         (br_netfilter needed: bridge-nf-call-iptables in the network's namespace): {e}");
                }
                continue;
            }
            written.insert(netns.clone(), (ino, None));
        }
        for port in ports.iter().filter(|p| p.node_port.is_some()) {
            if told.insert(format!("nodeport {}", port.id)) {
                tracing::warn!(service = %port.id, network = %udn.name,
                    "nodePort not carried out for Services on a user-defined network (ClusterIP only)");
            }
        }
        let cidr = p.cidr.unwrap_or(udn.subnet);
        let script = nft_script(udn, cidr, &ports);
        let entry = written.entry(netns.clone()).or_insert((ino, None));
        if entry.1.as_ref() == Some(&script) {
            continue;
        }
        let action = Action::Nft {
            netns: Some(netns.clone()),
            script: script.clone(),
        };
        match ferrovirt_network::apply::apply_one(&action).await {
            Ok(()) => {
                tracing::info!(network = %udn.name, netns = %netns, ports = ports.len(),
                    "udn services: network table written");
                entry.1 = Some(script);
            }
            Err(e) => {
                tracing::warn!(network = %udn.name, "udn services: writing the table failed: {e}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(ns: &str) -> Arc<Service> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "web", "namespace": ns},
                "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80, "protocol": "TCP"}]}}))
            .unwrap(),
        )
    }

    fn slice(ns: &str, network: Option<&str>, ip: &str) -> Arc<EndpointSlice> {
        let mut v = serde_json::json!({
            "metadata": {"name": "web-abcde", "namespace": ns,
                "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ip], "conditions": {"ready": true}}],
            "ports": [{"name": "", "port": 8080, "protocol": "TCP"}]});
        if let Some(n) = network {
            v["metadata"]["annotations"] = serde_json::json!({ENDPOINTSLICE_NETWORK_ANNOTATION: n});
        }
        Arc::new(serde_json::from_value(v).unwrap())
    }

    #[test]
    fn a_network_carries_only_its_namespaces_marked_slices() {
        let prim = ferrovirt_network::udn_svc::primary_networks(&[
            (
                "ua".into(),
                r#"{"name":"ua_net","topology":"layer2","role":"primary","subnets":"10.100.0.0/24"}"#.into(),
            ),
            (
                "ub".into(),
                r#"{"name":"ub_net","topology":"layer2","role":"primary","subnets":"10.100.0.0/24"}"#.into(),
            ),
        ]);
        let services = [svc("ua"), svc("ub"), svc("default")];
        let slices = [
            slice("ua", Some("ua_net"), "10.100.0.7"),
            slice("ub", Some("ub_net"), "10.100.0.8"),
            slice("default", None, "10.244.0.2"),
        ];
        let p = network_ports("ua_net", &prim, &services, &slices);
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(p[0].id, "ua/web:80");
        assert_eq!(p[0].endpoints, vec![("10.100.0.7".parse().unwrap(), 8080)]);
        // A slice in ub claiming ua's network does not bring ub's Service into ua's table,
        // and ua's own Service ignores a slice marked with another network.
        let forged = [slice("ub", Some("ua_net"), "10.100.0.9")];
        let p = network_ports("ua_net", &prim, &services, &forged);
        assert!(p.iter().all(|p| p.endpoints.is_empty()), "{p:?}");
        let p = network_ports("ub_net", &prim, &services, &slices);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].id, "ub/web:80");
        // The pod network's table skips the marked slices.
        let pod = crate::services::service_ports(&services, &slices);
        let with_eps: Vec<&str> = pod
            .iter()
            .filter(|p| !p.endpoints.is_empty())
            .map(|p| p.id.as_str())
            .collect();
        assert_eq!(with_eps, vec!["default/web:80"]);
    }
}
