//! Keeps KubeVirt's common cluster instancetypes and preferences deployed
//! (`ferrovirt_api::hco::common`: the bundle and the pure plan): created at the leader's start,
//! an edited one written back with a Warning `Overwritten` Event on it, all of ours deleted
//! when the KubeVirt CR's `commonInstancetypesDeployment.enabled` turns false. Woken by watches
//! of the two cluster kinds and by a change of the KubeVirt CRs' settings; no polling.

use std::sync::Arc;

use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, PostParams};
use kube::runtime::reflector::Store;
use serde_json::Value;
use tokio::sync::Notify;

use ferrovirt_api::hco::common::{self, INSTANCETYPE, PREFERENCE, Step};
use k8s_openapi::api::core::v1::ObjectReference;

use crate::error::ControllerError;
use crate::runtime::events::EventRecorder;
use crate::runtime::stores::{Kind, Stores};

/// Component name on the Events (virt-operator deploys these in KubeVirt).
pub const COMPONENT: &str = "virt-operator";

fn resource(kind: (&str, &str)) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("instancetype.kubevirt.io", "v1beta1", kind.0),
        kind.1,
    )
}

fn kind_of(name: &str) -> (&'static str, &'static str) {
    if name == PREFERENCE.0 {
        PREFERENCE
    } else {
        INSTANCETYPE
    }
}

/// Runs until a watch ends.
pub async fn run(client: kube::Client, stores: Stores) -> Result<(), ControllerError> {
    let wake = Arc::new(Notify::new());
    let (types, types_pump) = super::dynamic_store(
        &client,
        resource(INSTANCETYPE),
        "cluster instancetypes",
        wake.clone(),
    );
    let (prefs, prefs_pump) = super::dynamic_store(
        &client,
        resource(PREFERENCE),
        "cluster preferences",
        wake.clone(),
    );
    let mut changes = stores.changes();
    let w = wake.clone();
    let follow = async move {
        while changes.wait_for(&[Kind::KubeVirt]).await.is_some() {
            w.notify_one();
        }
    };
    let recorder = EventRecorder::new(client.clone(), COMPONENT);
    let desired = common::bundle();
    let work = async {
        let _ = types.wait_until_ready().await;
        let _ = prefs.wait_until_ready().await;
        stores.ready().await;
        loop {
            let enabled = stores.kubevirt().common_instancetypes;
            let actual = stored(&[&types, &prefs]);
            for step in common::plan(&desired, &actual, enabled) {
                if let Err(e) = apply(&client, &recorder, &step).await {
                    tracing::warn!(error = %e, ?step, "common instancetypes");
                }
            }
            wake.notified().await;
        }
    };
    tokio::select! {
        _ = types_pump => {}
        _ = prefs_pump => {}
        _ = follow => {}
        () = work => {}
    }
    Err(ControllerError::TaskStopped {
        name: "common-instancetypes",
        reason: "watch stream ended".into(),
    })
}

fn stored(stores: &[&Store<DynamicObject>]) -> Vec<Value> {
    stores
        .iter()
        .flat_map(|s| s.state())
        .filter_map(|o| serde_json::to_value(&*o).ok())
        .collect()
}

async fn apply(
    client: &kube::Client,
    recorder: &EventRecorder,
    step: &Step,
) -> Result<(), ControllerError> {
    match step {
        Step::Create(obj) => {
            let kind = kind_of(obj["kind"].as_str().unwrap_or_default());
            let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource(kind));
            let o: DynamicObject = serde_json::from_value(obj.clone())?;
            match api.create(&PostParams::default(), &o).await {
                // Created meanwhile (its watch event is on the way).
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
                Err(e) => Err(e.into()),
                Ok(_) => Ok(()),
            }
        }
        Step::Replace { obj, fields } => {
            let kind = kind_of(obj["kind"].as_str().unwrap_or_default());
            let name = obj["metadata"]["name"].as_str().unwrap_or_default();
            let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource(kind));
            let o: DynamicObject = serde_json::from_value(obj.clone())?;
            match api.replace(name, &PostParams::default(), &o).await {
                // Changed again meanwhile: the next pass looks at it.
                Err(kube::Error::Api(s)) if s.code == 409 => return Ok(()),
                Err(e) => return Err(e.into()),
                Ok(_) => {}
            }
            let msg = format!(
                "a direct edit of {} of {} {name} was reverted: it is one of the common \
                 instancetypes and preferences, kept as published (turn them off with the \
                 HyperConverged's commonInstancetypesDeployment.enabled: false)",
                fields.join(", "),
                kind.0
            );
            tracing::warn!("{msg}");
            let target = ObjectReference {
                api_version: Some(common::API_VERSION.into()),
                kind: Some(kind.0.into()),
                name: Some(name.into()),
                uid: obj
                    .pointer("/metadata/uid")
                    .and_then(Value::as_str)
                    .map(str::to_string),
                ..ObjectReference::default()
            };
            recorder.record(&target, true, "Overwritten", &msg).await;
            Ok(())
        }
        Step::Delete { kind, name } => {
            let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource(kind_of(kind)));
            match api.delete(name, &DeleteParams::default()).await {
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                Err(e) => Err(e.into()),
                Ok(_) => Ok(()),
            }
        }
    }
}
