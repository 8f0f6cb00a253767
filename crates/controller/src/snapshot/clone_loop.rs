//! The VirtualMachineClone controller: reads what [`super::clone::step`] needs (the clone, its
//! source VM, the snapshot it uses and its content, its restore, whether the target exists),
//! applies the step's creations and deletions and writes the status.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;

use super::clone::{self, CloneInput};
use super::resources::{VmClone, VmRestore, VmSnapshot, VmSnapshotContent};
use super::vm_snapshot;
use crate::error::ControllerError;
use crate::runtime::resources::Vm;

struct Ctx {
    client: kube::Client,
}

/// Runs the clone controller until its watch ends.
pub async fn run(client: kube::Client) -> Result<(), ControllerError> {
    let ctx = Arc::new(Ctx {
        client: client.clone(),
    });
    crate::runtime::drive(
        Controller::new(Api::<VmClone>::all(client), watcher::Config::default()).run(
            crate::runtime::metrics::timed("VirtualMachineClone", reconcile),
            |_o, err, _ctx| {
                tracing::debug!(error = %err, "clone reconcile failed");
                Action::requeue(Duration::from_secs(2))
            },
            ctx,
        ),
        super::loops::COMPONENT,
        "VirtualMachineClone",
    )
    .await
}

async fn create<K>(api: &Api<K>, obj: K) -> Result<(), ControllerError>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.create(&PostParams::default(), &obj).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_already_exists() => Ok(()),
        Err(e) => Err(e.into()),
    }
}

async fn delete<K>(api: &Api<K>, name: &str) -> Result<(), ControllerError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
        Err(e) => Err(e.into()),
    }
}

async fn reconcile(obj: Arc<VmClone>, ctx: Arc<Ctx>) -> Result<Action, ControllerError> {
    let c = &obj.0;
    if c.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let ns = c
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let name = c.metadata.name.clone().unwrap_or_default();
    let vms: Api<Vm> = Api::namespaced(ctx.client.clone(), &ns);
    let snaps: Api<VmSnapshot> = Api::namespaced(ctx.client.clone(), &ns);
    let restores: Api<VmRestore> = Api::namespaced(ctx.client.clone(), &ns);
    let source_name = c
        .spec
        .as_ref()
        .map(|s| s.source.name.clone())
        .unwrap_or_default();
    let source_vm = if clone::from_snapshot(c) || source_name.is_empty() {
        None
    } else {
        vms.get_opt(&source_name).await?.map(|v| v.0)
    };
    let snapshot = snaps.get_opt(&clone::used_snapshot(c)).await?.map(|s| s.0);
    let content = match &snapshot {
        Some(s) => Api::<VmSnapshotContent>::namespaced(ctx.client.clone(), &ns)
            .get_opt(&vm_snapshot::content_name(s))
            .await?
            .map(|c| c.0),
        None => None,
    };
    let restore = restores
        .get_opt(&clone::restore_name(c))
        .await?
        .map(|r| r.0);
    let target_exists = vms.get_opt(&clone::target_name(c)).await?.is_some();
    let step = clone::step(&CloneInput {
        clone: c,
        source_vm: source_vm.as_ref(),
        snapshot: snapshot.as_ref(),
        content: content.as_ref(),
        restore: restore.as_ref(),
        target_exists,
        now: Timestamp::now(),
    });
    if let Some(s) = step.create_snapshot {
        create(&snaps, VmSnapshot(*s)).await?;
    }
    if let Some(r) = step.create_restore {
        create(&restores, VmRestore(*r)).await?;
    }
    if c.status.as_ref() != Some(&step.status) {
        let api: Api<VmClone> = Api::namespaced(ctx.client.clone(), &ns);
        let mut o = VmClone(c.clone());
        o.0.status = Some(step.status);
        match api.replace_status(&name, &PostParams::default(), &o).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {
                return Ok(Action::requeue(Duration::from_millis(100)));
            }
            Err(e) => return Err(e.into()),
        }
    }
    // Deleted only once the clone's final status is written.
    if let Some(r) = &step.delete_restore {
        delete(&restores, r).await?;
    }
    if let Some(s) = &step.delete_snapshot {
        delete(&snaps, s).await?;
    }
    Ok(step
        .requeue
        .map(Action::requeue)
        .unwrap_or_else(Action::await_change))
}
