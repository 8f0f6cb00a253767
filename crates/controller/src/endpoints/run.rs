//! The endpoints controller's loop: a reflector of Services (its own watch) and the shared VMI
//! cache ([`crate::runtime::stores`]); every change of either recomputes [`super::desired`]
//! for every Service and writes the EndpointSlice and Endpoints whose content differs from what
//! this loop last wrote (a GET, then a replace or create). Nothing is listed after the
//! reflector's first list; the objects go with their Service (owner references).

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Endpoints, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, PostParams};
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::Value;

use super::{Desired, desired};
use crate::error::ControllerError;
use crate::runtime::stores::{Kind, Stores};

/// Runs until its watches end.
pub async fn run(client: kube::Client, stores: Stores) -> Result<(), ControllerError> {
    let (services, writer) = reflector::store::<Service>();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
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
    let work = async move {
        stores.ready().await;
        let _ = services.wait_until_ready().await;
        let mut changes = stores.changes();
        let mut written: HashMap<String, Desired> = HashMap::new();
        loop {
            pass(&client, &stores, &services, &mut written).await;
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
    written: &mut HashMap<String, Desired>,
) {
    let vmis: Vec<Value> = stores
        .vmis
        .state()
        .iter()
        .filter_map(|v| serde_json::to_value(&**v).ok())
        .collect();
    let mut seen = Vec::new();
    for svc in services.state() {
        let Ok(sv) = serde_json::to_value(&*svc) else {
            continue;
        };
        let Some(want) = desired(&sv, &vmis) else {
            continue;
        };
        let uid = sv["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        seen.push(uid.clone());
        if written.get(&uid) == Some(&want) {
            continue;
        }
        let ns = sv["metadata"]["namespace"].as_str().unwrap_or("default");
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
                && cur_v["metadata"]["labels"] == obj["metadata"]["labels"];
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
