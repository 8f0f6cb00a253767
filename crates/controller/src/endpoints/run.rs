//! The endpoints controller's loop: reflectors of Services and of the user-defined networks'
//! NADs (its own watches) and the shared VMI cache ([`crate::runtime::stores`]); every change
//! recomputes [`super::desired`] (marked with the namespace's primary network,
//! [`super::mark_network`])
//! for every Service and writes the EndpointSlice and Endpoints whose content differs from what
//! this loop last wrote (a GET, then a replace or create). Nothing is listed after the
//! reflector's first list; the objects go with their Service (owner references).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Endpoints, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::Value;

use super::{Desired, desired, mark_network, node_port_refusal};
use crate::error::ControllerError;
use crate::runtime::events::{EventRecorder, object_ref};
use crate::runtime::stores::{Kind, Stores};

/// Runs until its watches end.
pub async fn run(client: kube::Client, stores: Stores) -> Result<(), ControllerError> {
    let (services, writer) = reflector::store::<Service>();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
    let nad_tx = tx.clone();
    let svc_api = Api::<Service>::all(client.clone());
    let watch = async move {
        let mut events = reflector(
            writer,
            watcher(svc_api, watcher::Config::default()).default_backoff(),
        )
        .boxed();
        while let Some(ev) = events.next().await {
            match ev {
                Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
                Ok(_) => {
                    let _ = tx.try_send(());
                }
                Err(e) => tracing::warn!(error = %e, "{}: Service watch failed", super::COMPONENT),
            }
        }
    };
    // The user-defined networks' NADs: which namespaces' Services are on a Primary UDN.
    let nad_w = reflector::store::Writer::<DynamicObject>::new(nad_resource());
    let nads = nad_w.as_reader();
    let nad_api: Api<DynamicObject> = Api::all_with(client.clone(), &nad_resource());
    let watch_nads = async move {
        let cfg = watcher::Config::default().labels(ferrovirt_api::udn::NAD_LABEL);
        let mut events = reflector(nad_w, watcher(nad_api, cfg).default_backoff()).boxed();
        while let Some(ev) = events.next().await {
            match ev {
                Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
                Ok(_) => {
                    let _ = nad_tx.try_send(());
                }
                Err(e) => tracing::warn!(error = %e, "{}: NAD watch failed", super::COMPONENT),
            }
        }
    };
    let work = async move {
        stores.ready().await;
        let _ = services.wait_until_ready().await;
        // The NADs are not waited for (a Service is never held back by them): their first
        // list ends with an event that wakes a pass.
        let mut changes = stores.changes();
        let mut written: HashMap<String, Desired> = HashMap::new();
        // Services told (a Warning Event) that their node ports are not carried out.
        let recorder = EventRecorder::new(client.clone(), super::COMPONENT);
        let mut told: HashSet<String> = HashSet::new();
        loop {
            pass(
                &client,
                &stores,
                &services,
                &nads,
                &mut written,
                (&recorder, &mut told),
            )
            .await;
            tokio::select! {
                r = changes.wait_for(&[Kind::Vmi]) => if r.is_none() { break },
                r = rx.recv() => if r.is_none() { break },
            }
            // Let a burst of events settle into one pass.
            tokio::time::sleep(Duration::from_millis(100)).await;
            changes.drain();
            while rx.try_recv().is_ok() {}
        }
    };
    tokio::select! {
        () = watch => {}
        () = watch_nads => {}
        () = work => {}
    }
    Err(ControllerError::TaskStopped {
        name: super::COMPONENT,
        reason: "watch stream ended".into(),
    })
}

async fn pass(
    client: &kube::Client,
    stores: &Stores,
    services: &Store<Service>,
    nads: &Store<DynamicObject>,
    written: &mut HashMap<String, Desired>,
    (recorder, told): (&EventRecorder, &mut HashSet<String>),
) {
    let services = services.state();
    let nads = nads.state();
    let primaries = ferrovirt_network::udn_svc::primary_networks_of(
        nads.iter()
            .map(|n| (n.metadata.namespace.as_deref(), &n.data)),
    );
    // Only the VMIs of namespaces with a selecting Service are turned into JSON (with
    // 10,000 VMIs and no Service, a pass per VMI change used to serialise every VMI).
    let namespaces = selecting_namespaces(&services);
    let vmis: Vec<Value> = if namespaces.is_empty() {
        Vec::new()
    } else {
        stores
            .vmis
            .state_filter(|v| {
                namespaces.contains(v.0.metadata.namespace.as_deref().unwrap_or("default"))
            })
            .iter()
            .filter_map(|v| serde_json::to_value(&**v).ok())
            .collect()
    };
    let mut seen = Vec::new();
    for svc in services {
        let Ok(sv) = serde_json::to_value(&*svc) else {
            continue;
        };
        let Some(mut want) = desired(&sv, &vmis) else {
            continue;
        };
        let uid = sv["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let ns = sv["metadata"]["namespace"].as_str().unwrap_or("default");
        let network = primaries.get(ns).map(|p| p.name.as_str());
        mark_network(&mut want, network);
        if let Some(message) = node_port_refusal(&sv, network)
            && told.insert(uid.clone())
        {
            let meta: kube::api::ObjectMeta =
                serde_json::from_value(sv["metadata"].clone()).unwrap_or_default();
            let r = object_ref("v1", "Service", &meta);
            recorder
                .record(&r, true, "NodePortNotCarriedOut", &message)
                .await;
        }
        seen.push(uid.clone());
        if written.get(&uid) == Some(&want) {
            continue;
        }
        let a = apply::<EndpointSlice>(client, ns, &want.slice).await;
        let b = apply::<Endpoints>(client, ns, &want.endpoints).await;
        match (a, b) {
            (Ok(()), Ok(())) => {
                written.insert(uid, want);
            }
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(error = %e, service = ?sv["metadata"]["name"], "{}: writing endpoints failed", super::COMPONENT);
                written.remove(&uid);
            }
        }
    }
    written.retain(|uid, _| seen.contains(uid));
    told.retain(|uid| seen.contains(uid));
}

fn nad_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("k8s.cni.cncf.io", "v1", "NetworkAttachmentDefinition"),
        "network-attachment-definitions",
    )
}

/// The namespaces holding a Service with a non-empty selector: only their VMIs can be endpoints
/// (a Service without a selector gets no managed endpoints, see [`desired`]).
fn selecting_namespaces(services: &[std::sync::Arc<Service>]) -> HashSet<String> {
    services
        .iter()
        .filter(|s| {
            s.spec
                .as_ref()
                .and_then(|sp| sp.selector.as_ref())
                .is_some_and(|sel| !sel.is_empty())
        })
        .map(|s| {
            s.metadata
                .namespace
                .clone()
                .unwrap_or_else(|| "default".into())
        })
        .collect()
}

/// Creates `obj` or replaces the stored one when its content differs.
async fn apply<K>(client: &kube::Client, ns: &str, obj: &Value) -> Result<(), kube::Error>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + serde::Serialize,
{
    let api = Api::<K>::namespaced(client.clone(), ns);
    let name = obj["metadata"]["name"].as_str().unwrap_or_default();
    let new: K = serde_json::from_value(obj.clone()).map_err(kube::Error::SerdeError)?;
    match api.get_opt(name).await? {
        None => api.create(&PostParams::default(), &new).await.map(drop),
        Some(cur) => {
            let mut cur_v = serde_json::to_value(&cur).map_err(kube::Error::SerdeError)?;
            let same = ["subsets", "endpoints", "ports", "addressType"]
                .iter()
                .all(|k| {
                    cur_v.get(*k).unwrap_or(&Value::Null) == obj.get(*k).unwrap_or(&Value::Null)
                })
                && cur_v["metadata"]["labels"] == obj["metadata"]["labels"]
                && cur_v["metadata"]["annotations"] == obj["metadata"]["annotations"];
            if same {
                return Ok(());
            }
            let rv = cur_v["metadata"]["resourceVersion"].clone();
            let mut next = obj.clone();
            next["metadata"]["resourceVersion"] = rv;
            cur_v = next;
            let next: K = serde_json::from_value(cur_v).map_err(kube::Error::SerdeError)?;
            api.replace(name, &PostParams::default(), &next)
                .await
                .map(drop)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(ns: &str, selector: Option<&[(&str, &str)]>) -> std::sync::Arc<Service> {
        let mut v = serde_json::json!({"metadata": {"name": "s", "namespace": ns}, "spec": {}});
        if let Some(sel) = selector {
            let m: serde_json::Map<String, Value> = sel
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect();
            v["spec"]["selector"] = Value::Object(m);
        }
        std::sync::Arc::new(serde_json::from_value(v).unwrap())
    }

    #[test]
    fn only_namespaces_with_a_selecting_service_count() {
        let got = selecting_namespaces(&[
            svc("a", Some(&[("app", "x")])),
            svc("b", None),
            svc("c", Some(&[])),
            svc("a", Some(&[("app", "y")])),
        ]);
        assert_eq!(got, HashSet::from(["a".to_string()]));
        assert!(selecting_namespaces(&[]).is_empty());
    }
}
