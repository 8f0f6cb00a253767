//! The export controller: for each VirtualMachineExport, the token Secret (generated, owned
//! by the export, when `spec.tokenSecretRef` is absent), the source read
//! ([`super::resolve`]), the status written from [`super::plan::step`], the online
//! VirtualMachineSnapshot a running VM's export goes through (owned by the export) and the
//! Events about it, and the export deleted once its TTL has passed (its Secret and snapshot
//! go with it).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use serde_json::json;

use ferrovirt_api::kubevirt::export::TOKEN_KEY;

use super::plan::{self, Endpoint, SourceState};
use super::resources::{VERSION, VmExport};
use crate::error::ControllerError;
use crate::runtime::events::{EventRecorder, object_ref};
use crate::snapshot::resources::VmSnapshot;

struct Ctx {
    client: kube::Client,
    endpoint: Endpoint,
    events: EventRecorder,
}

/// Run the export controller until its watch ends or the future is dropped.
pub async fn run(client: kube::Client, endpoint: Endpoint) -> Result<(), ControllerError> {
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        endpoint,
        events: EventRecorder::new(client.clone(), super::COMPONENT),
    });
    crate::runtime::drive(
        Controller::new(
            Api::<VmExport>::all(client.clone()),
            watcher::Config::default(),
        )
        .run(
            crate::runtime::metrics::timed("VirtualMachineExport", reconcile),
            error_policy,
            ctx,
        ),
        super::COMPONENT,
        "VirtualMachineExport",
    )
    .await
}

fn error_policy(_o: Arc<VmExport>, err: &ControllerError, _ctx: Arc<Ctx>) -> Action {
    tracing::debug!(error = %err, "export reconcile failed");
    Action::requeue(Duration::from_secs(2))
}

/// A new random export token (256 bits, hex).
pub fn new_token() -> Result<String, ControllerError> {
    let mut b = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b)
        .map_err(|_| ControllerError::Randomness)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Makes sure the token Secret exists: a named one must (else why not), a generated one is
/// created, owned by the export.
async fn ensure_token(ctx: &Ctx, export: &VmExport) -> Result<Option<String>, ControllerError> {
    let e = &export.0;
    let ns = e.metadata.namespace.clone().unwrap_or_default();
    let name = plan::token_secret_name(e);
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    if api.get_opt(&name).await?.is_some() {
        return Ok(None);
    }
    if e.spec
        .as_ref()
        .and_then(|s| s.token_secret_ref.as_ref())
        .is_some()
    {
        return Ok(Some(format!(
            "token Secret {name} (spec.tokenSecretRef) not found"
        )));
    }
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(ns),
            owner_references: Some(vec![plan::owner(e)]),
            ..Default::default()
        },
        data: Some([(TOKEN_KEY.to_string(), ByteString(new_token()?.into_bytes()))].into()),
        type_: Some("Opaque".into()),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => Ok(None),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
        Err(e) => Err(e.into()),
    }
}

async fn reconcile(obj: Arc<VmExport>, ctx: Arc<Ctx>) -> Result<Action, ControllerError> {
    let e = &obj.0;
    if e.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let ns = e.metadata.namespace.clone().unwrap_or_default();
    let name = e.metadata.name.clone().unwrap_or_default();
    if e.spec.is_none() {
        return Ok(Action::await_change());
    }
    let state = match ensure_token(&ctx, &obj).await? {
        Some(why) => SourceState::NotFound(why),
        None => super::resolve::resolve(&ctx.client, e).await?.state,
    };
    let d = plan::step(e, &state, &ctx.endpoint, Timestamp::now());
    if let Some(snap) = &d.create_snapshot {
        let snaps: Api<VmSnapshot> = Api::namespaced(ctx.client.clone(), &ns);
        match snaps
            .create(&PostParams::default(), &VmSnapshot((**snap).clone()))
            .await
        {
            Ok(_) => {
                tracing::info!(namespace = %ns, export = %name, "online snapshot created for the export of a running VM");
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(err) => return Err(err.into()),
        }
    }
    if let Some((warning, reason, message)) = &d.event {
        let r = object_ref(
            &format!("{}/{VERSION}", ferrovirt_api::kubevirt::export::GROUP),
            "VirtualMachineExport",
            &e.metadata,
        );
        ctx.events.record(&r, *warning, reason, message).await;
    }
    let api: Api<VmExport> = Api::namespaced(ctx.client.clone(), &ns);
    if e.status.as_ref() != Some(&d.status) {
        let mut status = serde_json::to_value(&d.status)?;
        // Fields the new status lacks are removed (links of an export no longer ready).
        for k in ["links", "virtualMachineName", "serviceName"] {
            if status.get(k).is_none() {
                status[k] = serde_json::Value::Null;
            }
        }
        match api
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": status})),
            )
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Action::await_change()),
            Err(e) => return Err(e.into()),
        }
    }
    if d.expired {
        tracing::info!(namespace = %ns, export = %name, "export TTL passed: deleting it");
        match api.delete(&name, &DeleteParams::background()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
        return Ok(Action::await_change());
    }
    Ok(d.requeue.map_or_else(Action::await_change, Action::requeue))
}
