//! The export controller: for each VirtualMachineExport, the token Secret (generated, owned
//! by the export, when `spec.tokenSecretRef` is absent), the source read
//! ([`super::resolve`]), the status written from [`super::plan::step`], and the export
//! deleted once its TTL has passed (its Secret goes with it).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use serde_json::json;

use ferrovirt_api::kubevirt::export::TOKEN_KEY;

use super::plan::{self, Endpoint, SourceState};
use super::resources::{VERSION, VmExport};
use crate::error::ControllerError;

struct Ctx {
    client: kube::Client,
    endpoint: Endpoint,
}

/// Run the export controller until its watch ends or the future is dropped.
pub async fn run(client: kube::Client, endpoint: Endpoint) -> Result<(), ControllerError> {
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        endpoint,
    });
    crate::runtime::drive(
        Controller::new(
            Api::<VmExport>::all(client.clone()),
            watcher::Config::default(),
        )
        .run(reconcile, error_policy, ctx),
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
            owner_references: Some(vec![OwnerReference {
                api_version: format!("{}/{VERSION}", ferrovirt_api::kubevirt::export::GROUP),
                kind: "VirtualMachineExport".into(),
                name: e.metadata.name.clone().unwrap_or_default(),
                uid: e.metadata.uid.clone().unwrap_or_default(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            }]),
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
    let Some(spec) = e.spec.clone() else {
        return Ok(Action::await_change());
    };
    let state = match ensure_token(&ctx, &obj).await? {
        Some(why) => SourceState::NotFound(why),
        None => {
            super::resolve::resolve(&ctx.client, &ns, &spec)
                .await?
                .state
        }
    };
    let d = plan::step(e, &state, &ctx.endpoint, Timestamp::now());
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
