//! The VirtualMachinePool controller loop: watches pools and the VMs they own, lists the
//! pool's VMs (label `kubevirt.io/vmpool`, controlled by the pool), applies
//! [`crate::pool::decide`] (create, delete with a uid precondition, replace out-of-date VMs)
//! and writes `status` through the `/status` subresource. Deleting a pool deletes its VMs
//! through ownerReference garbage collection.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;

use ferrovirt_api::kubevirt::pool::POOL_LABEL;

use super::events::{EventRecorder, object_ref};
use super::resources::{Pool, Vm};
use crate::error::ControllerError;
use crate::pool::{controlled_by, decide, with_failure};

/// Component name on Events.
pub const COMPONENT: &str = "virtualmachinepool-controller";

struct Ctx {
    client: kube::Client,
    recorder: EventRecorder,
}

/// Run the pool controller until the watch ends or the future is dropped.
pub async fn run(client: kube::Client) -> Result<(), ControllerError> {
    let pools: Api<Pool> = Api::all(client.clone());
    let vms: Api<Vm> = Api::all(client.clone());
    let ctx = Arc::new(Ctx {
        recorder: EventRecorder::new(client.clone(), COMPONENT),
        client,
    });
    crate::runtime::drive(
        Controller::new(pools, watcher::Config::default())
            .owns(vms, watcher::Config::default())
            .run(
                crate::runtime::metrics::timed("VirtualMachinePool", reconcile),
                error_policy,
                ctx,
            ),
        COMPONENT,
        "VirtualMachinePool",
    )
    .await
}

fn error_policy(_p: Arc<Pool>, _err: &ControllerError, _ctx: Arc<Ctx>) -> Action {
    Action::requeue(Duration::from_secs(2))
}

fn gone_or_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404 || s.code == 409)
}

async fn reconcile(pool: Arc<Pool>, ctx: Arc<Ctx>) -> Result<Action, ControllerError> {
    let pool = &pool.0;
    if pool.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let ns = pool
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let name = pool
        .metadata
        .name
        .clone()
        .ok_or(ControllerError::MissingField {
            kind: "VirtualMachinePool",
            field: "metadata.name",
        })?;
    let vms_api: Api<Vm> = Api::namespaced(ctx.client.clone(), &ns);
    let listed = vms_api
        .list(&ListParams::default().labels(&format!("{POOL_LABEL}={name}")))
        .await?;
    let vms: Vec<_> = listed
        .items
        .into_iter()
        .map(|v| v.0)
        .filter(|v| controlled_by(v, pool))
        .collect();
    let now = Time(Timestamp::now());
    let d = decide(pool, &vms, &now);
    let reference = object_ref(
        "pool.kubevirt.io/v1beta1",
        "VirtualMachinePool",
        &pool.metadata,
    );
    let mut failure: Option<String> = None;
    for vm in &d.create {
        let vm: Vm = serde_json::from_value(vm.clone())?;
        let vm_name = vm.0.metadata.name.clone().unwrap_or_default();
        match vms_api.create(&PostParams::default(), &vm).await {
            Ok(_) => {
                ctx.recorder
                    .record(
                        &reference,
                        false,
                        "SuccessfulCreate",
                        &format!("Created VirtualMachine {vm_name}"),
                    )
                    .await
            }
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => {
                let msg = format!("creating VirtualMachine {vm_name}: {e}");
                ctx.recorder
                    .record(&reference, true, "FailedCreate", &msg)
                    .await;
                failure = Some(msg);
            }
        }
    }
    for (vm_name, uid) in &d.delete {
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(uid.clone()),
                resource_version: None,
            }),
            ..Default::default()
        };
        match vms_api.delete(vm_name, &dp).await {
            Ok(_) => {
                ctx.recorder
                    .record(
                        &reference,
                        false,
                        "SuccessfulDelete",
                        &format!("Deleted VirtualMachine {vm_name}"),
                    )
                    .await
            }
            Err(e) if gone_or_conflict(&e) => {}
            Err(e) => failure = Some(format!("deleting VirtualMachine {vm_name}: {e}")),
        }
    }
    for vm in &d.update {
        let mut vm: Vm = serde_json::from_value(vm.clone())?;
        let vm_name = vm.0.metadata.name.clone().unwrap_or_default();
        // Keep what the VM controller owns: its finalizer and status.
        if let Some(cur) = vms
            .iter()
            .find(|v| v.metadata.name.as_ref() == Some(&vm_name))
        {
            vm.0.metadata.finalizers = cur.metadata.finalizers.clone();
            vm.0.status = cur.status.clone();
        }
        match vms_api.replace(&vm_name, &PostParams::default(), &vm).await {
            Ok(_) => {}
            Err(e) if gone_or_conflict(&e) => {}
            Err(e) => failure = Some(format!("updating VirtualMachine {vm_name}: {e}")),
        }
    }
    let status = with_failure(d.status, failure.as_deref(), &now);
    if pool.status.as_ref() != Some(&status) {
        let pools: Api<Pool> = Api::namespaced(ctx.client.clone(), &ns);
        let mut obj = Pool(pool.clone());
        obj.0.status = Some(status);
        match pools
            .replace_status(&name, &PostParams::default(), &obj)
            .await
        {
            Ok(_) => {}
            Err(e) if gone_or_conflict(&e) => {
                return Ok(Action::requeue(Duration::from_millis(200)));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(if failure.is_some() {
        Action::requeue(Duration::from_secs(5))
    } else {
        Action::requeue(Duration::from_secs(300))
    })
}
