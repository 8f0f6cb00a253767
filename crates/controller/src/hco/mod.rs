//! The HyperConverged reconcile (docs/hyperconverged.md): the one HyperConverged
//! (`kubevirt-hyperconverged/kubevirt-hyperconverged`) is made into the KubeVirt, CDI, SSP and
//! NetworkAddonsConfig objects it owns (`ferrovirt_api::hco::desired`, pure), a direct edit of
//! one of them is written back with an `Overwritten` Event on the HyperConverged, and its
//! status conditions report every component's health (`health`, `ferrovirt_api::hco::status`).
//! Woken by watches of the HyperConverged, the four owned kinds and the Nodes (a change of a
//! Node's readiness, not every heartbeat); no polling. `common` keeps the common
//! instancetypes and preferences deployed.

pub mod common;
pub mod health;

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::{Value, json};
use tokio::sync::Notify;

use ferrovirt_api::hco::desired::{
    self, HCO_API_VERSION, HCO_NAME, OwnedKind, PLATFORM_NAMESPACE, SpecAction, Written,
};
use ferrovirt_api::hco::status::{self, Observation};
use ferrovirt_api::kubevirt::misc::KubeVirtCondition;

use crate::error::ControllerError;
use crate::runtime::events::{EventRecorder, object_ref};
use crate::runtime::leader::LeaderElectionOptions;
use crate::runtime::stores::{Kind, Stores};

/// Component name on the HyperConverged's Events.
pub const COMPONENT: &str = "hyperconverged-cluster-operator";

fn hco_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("hco.kubevirt.io", "v1beta1", "HyperConverged"),
        "hyperconvergeds",
    )
}

fn owned_resource(kind: OwnedKind) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(kind.group(), kind.version(), kind.kind()),
        kind.plural(),
    )
}

/// A reflector store of every object of `ar`, and the future that keeps it and notifies
/// `wake` after each event.
fn dynamic_store(
    client: &kube::Client,
    ar: ApiResource,
    what: &'static str,
    wake: Arc<Notify>,
) -> (
    Store<DynamicObject>,
    impl std::future::Future<Output = ()> + Send + 'static,
) {
    use futures::StreamExt;
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
    let writer = reflector::store::Writer::<DynamicObject>::new(ar);
    let store = writer.as_reader();
    let pump = async move {
        let mut events = std::pin::pin!(
            reflector::reflector(writer, watcher(api, watcher::Config::default()))
                .default_backoff()
                .touched_objects()
        );
        while let Some(ev) = events.next().await {
            if let Err(e) = ev {
                tracing::debug!(error = %e, "{what} watch");
            }
            wake.notify_one();
        }
    };
    (store, pump)
}

fn find(store: &Store<DynamicObject>, ns: Option<&str>, name: &str) -> Option<Value> {
    store
        .state()
        .iter()
        .find(|o| o.metadata.name.as_deref() == Some(name) && o.metadata.namespace.as_deref() == ns)
        .and_then(|o| serde_json::to_value(&**o).ok())
}

/// The reconcile's memory: what it last wrote into each owned object's spec.
#[derive(Default)]
struct Memory {
    written: HashMap<OwnedKind, Written>,
}

/// Runs the HyperConverged reconcile until its watches end.
pub async fn run(
    client: kube::Client,
    stores: Stores,
    leader: LeaderElectionOptions,
) -> Result<(), ControllerError> {
    let wake = Arc::new(Notify::new());
    let (hcos, hco_pump) = dynamic_store(&client, hco_resource(), "hyperconverged", wake.clone());
    let mut owned = Vec::new();
    let mut pumps = Vec::new();
    for kind in OwnedKind::ALL {
        let (store, pump) =
            dynamic_store(&client, owned_resource(kind), kind.plural(), wake.clone());
        owned.push((kind, store));
        pumps.push(pump);
    }
    let nodes_wake = wake.clone();
    let mut changes = stores.changes();
    let node_cache = stores.nodes.clone();
    // Only a change of what the status reads of the Nodes (their readiness) runs the
    // reconcile: the agents' heartbeats rewrite every Node every few seconds and would
    // otherwise each cost a reconcile (and its Lease read).
    let follow_nodes = async move {
        let mut seen = None;
        while changes.wait_for(&[Kind::Node]).await.is_some() {
            changes.drain();
            let now = health::node_readiness(&node_cache.state());
            if seen.as_ref() != Some(&now) {
                seen = Some(now);
                nodes_wake.notify_one();
            }
        }
    };
    let recorder = EventRecorder::new(client.clone(), COMPONENT);
    let importer = health::importer_tool();
    let work = async {
        let _ = hcos.wait_until_ready().await;
        for (_, s) in &owned {
            let _ = s.wait_until_ready().await;
        }
        stores.ready().await;
        let mut memory = Memory::default();
        loop {
            if let Some(hco) = find(&hcos, Some(PLATFORM_NAMESPACE), HCO_NAME) {
                reconcile(
                    &client,
                    &recorder,
                    &hco,
                    &owned,
                    &stores,
                    &leader,
                    &importer,
                    &mut memory,
                )
                .await;
            }
            wake.notified().await;
        }
    };
    tokio::select! {
        _ = hco_pump => {}
        _ = futures::future::join_all(pumps) => {}
        _ = follow_nodes => {}
        () = work => {}
    }
    Err(ControllerError::TaskStopped {
        name: "hyperconverged",
        reason: "watch stream ended".into(),
    })
}

#[allow(clippy::too_many_arguments)]
async fn reconcile(
    client: &kube::Client,
    recorder: &EventRecorder,
    hco: &Value,
    owned: &[(OwnedKind, Store<DynamicObject>)],
    stores: &Stores,
    leader: &LeaderElectionOptions,
    importer: &Result<String, String>,
    memory: &mut Memory,
) {
    let meta: kube::api::ObjectMeta =
        serde_json::from_value(hco.get("metadata").cloned().unwrap_or_default())
            .unwrap_or_default();
    let hco_ref = object_ref(HCO_API_VERSION, "HyperConverged", &meta);
    let mut obs = Observation::default();
    let mut related = Vec::new();
    for (kind, store) in owned {
        let desired = desired::desired_object(*kind, hco);
        let ns = kind.namespaced().then_some(PLATFORM_NAMESPACE);
        let actual = find(store, ns, kind.name());
        match apply_one(client, *kind, &desired, actual.as_ref(), memory).await {
            Ok(Applied::Kept(obj)) => related.push(reference(*kind, &obj)),
            Ok(Applied::Created(obj)) => {
                obs.initializing = true;
                recorder
                    .record(
                        &hco_ref,
                        false,
                        "Created",
                        &format!("Created {} {}", kind.kind(), kind.name()),
                    )
                    .await;
                related.push(reference(*kind, &obj));
            }
            Ok(Applied::Written {
                obj,
                overwritten,
                fields,
            }) => {
                let (reason, what) = if overwritten {
                    ("Overwritten", "Overwritten")
                } else {
                    ("Updated", "Updated")
                };
                let mut msg = format!("{what} {} {}", kind.kind(), kind.name());
                if overwritten {
                    msg.push_str(&format!(
                        ": a direct edit of {} was reverted to the HyperConverged's configuration",
                        fields.join(", ")
                    ));
                    tracing::warn!("{msg}");
                }
                recorder.record(&hco_ref, overwritten, reason, &msg).await;
                related.push(reference(*kind, &obj));
            }
            Err(e) => {
                tracing::warn!(error = %e, kind = kind.kind(), "reconciling the HyperConverged");
                obs.reconcile_error
                    .get_or_insert_with(|| format!("{} {}: {e}", kind.kind(), kind.name()));
            }
        }
    }
    obs.components = health::gather(client, leader, &stores.node_list(), importer).await;
    if let Err(e) = write_status(client, hco, &obs, related).await {
        tracing::debug!(error = %e, "writing the HyperConverged status");
    }
}

fn reference(kind: OwnedKind, obj: &Value) -> Value {
    let mut r = json!({
        "apiVersion": kind.api_version(),
        "kind": kind.kind(),
        "name": kind.name(),
    });
    if kind.namespaced() {
        r["namespace"] = json!(PLATFORM_NAMESPACE);
    }
    if let Some(uid) = obj.pointer("/metadata/uid") {
        r["uid"] = uid.clone();
    }
    r
}

enum Applied {
    Kept(Value),
    Created(Value),
    Written {
        obj: Value,
        overwritten: bool,
        fields: Vec<String>,
    },
}

fn api_for(client: &kube::Client, kind: OwnedKind) -> Api<DynamicObject> {
    let ar = owned_resource(kind);
    if kind.namespaced() {
        Api::namespaced_with(client.clone(), PLATFORM_NAMESPACE, &ar)
    } else {
        Api::all_with(client.clone(), &ar)
    }
}

/// Creates, keeps or writes back one owned object.
async fn apply_one(
    client: &kube::Client,
    kind: OwnedKind,
    desired: &Value,
    actual: Option<&Value>,
    memory: &mut Memory,
) -> Result<Applied, ControllerError> {
    let api = api_for(client, kind);
    let Some(actual) = actual else {
        let obj: DynamicObject = serde_json::from_value(desired.clone())?;
        let created = match api.create(&PostParams::default(), &obj).await {
            Ok(c) => c,
            // Created meanwhile (its watch event is on the way): the next pass looks at it.
            Err(kube::Error::Api(s)) if s.code == 409 => return Ok(Applied::Kept(desired.clone())),
            Err(e) => return Err(e.into()),
        };
        let created = serde_json::to_value(&created)?;
        remember(memory, kind, desired, &created);
        mark_deployed(&api, kind).await;
        return Ok(Applied::Created(created));
    };
    let (overwritten, fields) =
        match desired::decide_spec(desired, actual, memory.written.get(&kind)) {
            SpecAction::Keep => {
                if actual.pointer("/status/phase").is_none() {
                    mark_deployed(&api, kind).await;
                }
                return Ok(Applied::Kept(actual.clone()));
            }
            SpecAction::Update(f) => (false, f),
            SpecAction::Overwrite(f) => (true, f),
        };
    let mut next = actual.clone();
    next["spec"] = desired["spec"].clone();
    if let Some(want) = desired
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
    {
        let labels = next["metadata"]
            .as_object_mut()
            .map(|m| m.entry("labels").or_insert_with(|| json!({})));
        if let Some(Value::Object(l)) = labels {
            for (k, v) in want {
                l.insert(k.clone(), v.clone());
            }
        }
    }
    if let Some(refs) = desired.pointer("/metadata/ownerReferences") {
        next["metadata"]["ownerReferences"] = refs.clone();
    }
    if let Some(m) = next.as_object_mut() {
        m.remove("status");
    }
    let obj: DynamicObject = serde_json::from_value(next)?;
    let written = api
        .replace(kind.name(), &PostParams::default(), &obj)
        .await?;
    let written = serde_json::to_value(&written)?;
    remember(memory, kind, desired, &written);
    Ok(Applied::Written {
        obj: written,
        overwritten,
        fields,
    })
}

fn remember(memory: &mut Memory, kind: OwnedKind, desired: &Value, stored: &Value) {
    memory.written.insert(
        kind,
        Written {
            sent: desired.get("spec").cloned().unwrap_or(Value::Null),
            stored: stored.get("spec").cloned().unwrap_or(Value::Null),
        },
    );
}

/// The owned object's `status.phase` as its operator reports a finished install.
async fn mark_deployed(api: &Api<DynamicObject>, kind: OwnedKind) {
    let patch = json!({"status": {"phase": "Deployed"}});
    if let Err(e) = api
        .patch_status(kind.name(), &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        tracing::debug!(error = %e, kind = kind.kind(), "marking deployed");
    }
}

/// Writes the HyperConverged's status when it changed.
async fn write_status(
    client: &kube::Client,
    hco: &Value,
    obs: &Observation,
    related: Vec<Value>,
) -> Result<(), ControllerError> {
    let old: Vec<KubeVirtCondition> = hco
        .pointer("/status/conditions")
        .cloned()
        .and_then(|c| serde_json::from_value(c).ok())
        .unwrap_or_default();
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let conditions = status::merge(&old, &status::conditions(obs), &now);
    let generation = hco.pointer("/metadata/generation").cloned();
    let status = json!({
        "conditions": conditions,
        "relatedObjects": related,
        "observedGeneration": generation,
        "versions": [{"name": "operator", "version": env!("CARGO_PKG_VERSION")}],
    });
    let same = |k: &str| hco.pointer(&format!("/status/{k}")) == status.get(k);
    if [
        "conditions",
        "relatedObjects",
        "observedGeneration",
        "versions",
    ]
    .iter()
    .all(|k| same(k))
    {
        return Ok(());
    }
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), PLATFORM_NAMESPACE, &hco_resource());
    api.patch_status(
        HCO_NAME,
        &PatchParams::default(),
        &Patch::Merge(&json!({ "status": status })),
    )
    .await?;
    Ok(())
}
