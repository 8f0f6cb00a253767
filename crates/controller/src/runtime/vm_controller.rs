//! The VirtualMachine controller loop: watches VirtualMachines and the VMIs they own (their
//! metadata only: owner references are all the mapping needs), gathers
//! what [`crate::vm::decide`] needs (the VMI, volume readiness, the instancetype-expanded
//! template), applies the decided action, writes `status` through the `/status` subresource
//! (optimistic concurrency: a conflict just requeues), keeps the VM's finalizer until its VMI
//! is gone ([`crate::vm::finalize`]) and records Events.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::jiff::Timestamp;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams, Preconditions,
};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;

use ferrovirt_api::kubevirt::instancetype::{InstancetypeSpec, PreferenceSpec};
use ferrovirt_api::kubevirt::vm::{VirtualMachine, vm_condition};
use ferrovirt_api::kubevirt::vmi::{VirtualMachineInstance, VirtualMachineInstanceSpec};

use super::events::{EventRecorder, object_ref};
use super::resources::{Vm, Vmi};
use crate::conditions;
use crate::error::ControllerError;
use crate::vm::decide::{VmAction, VmInput, VmOptions, VolumeReadiness, decide};
use crate::vm::finalize::{FinalizerStep, apply_step, finalizer_step};
use crate::vm::template::{KUBEVIRT_API_VERSION, expanded_spec};

/// Component name on Events.
pub const COMPONENT: &str = "virtualmachine-controller";

struct Ctx {
    client: kube::Client,
    opts: VmOptions,
    recorder: EventRecorder,
}

/// Run the VM controller until the watch ends or the future is dropped.
pub async fn run(client: kube::Client, opts: VmOptions) -> Result<(), ControllerError> {
    let vms: Api<Vm> = Api::all(client.clone());
    // Only the VMIs' owner references are needed to map a VMI change to its VM: a
    // metadata-only watch (`as=PartialObjectMetadata`), so no VMI write is sent whole and
    // decoded whole here (the reconcile reads the VMI it needs).
    let vmis: Api<PartialObjectMeta<Vmi>> = Api::all(client.clone());
    let ctx = Arc::new(Ctx {
        recorder: EventRecorder::new(client.clone(), COMPONENT),
        client,
        opts,
    });
    crate::runtime::drive(
        Controller::new(vms, watcher::Config::default())
            .owns(vmis, watcher::Config::default())
            .run(
                crate::runtime::metrics::timed("VM", reconcile),
                error_policy,
                ctx,
            ),
        COMPONENT,
        "VM",
    )
    .await
}

fn error_policy(_vm: Arc<Vm>, _err: &ControllerError, _ctx: Arc<Ctx>) -> Action {
    Action::requeue(Duration::from_secs(2))
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

fn controlled_by_other(vmi: &VirtualMachineInstance, vm: &VirtualMachine) -> bool {
    vmi.metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && Some(&o.uid) != vm.metadata.uid.as_ref())
}

async fn reconcile(vm: Arc<Vm>, ctx: Arc<Ctx>) -> Result<Action, ControllerError> {
    let vm = &vm.0;
    let ns = vm
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let name = vm
        .metadata
        .name
        .clone()
        .ok_or(ControllerError::MissingField {
            kind: "VirtualMachine",
            field: "metadata.name",
        })?;
    let vmis: Api<Vmi> = Api::namespaced(ctx.client.clone(), &ns);
    let vmi = vmis.get_opt(&name).await?.map(|v| v.0);
    let own_vmi = vmi.as_ref().is_some_and(|v| !controlled_by_other(v, vm));
    let step = finalizer_step(vm, own_vmi);
    if step != FinalizerStep::Keep {
        // The resourceVersion makes this a compare-and-swap of the whole list.
        let patch = serde_json::json!({"metadata": {
            "finalizers": apply_step(vm, step),
            "resourceVersion": vm.metadata.resource_version,
        }});
        let vms: Api<Vm> = Api::namespaced(ctx.client.clone(), &ns);
        match vms
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_not_found() => return Ok(Action::await_change()),
            Err(e) if is_conflict(&e) => return Ok(Action::requeue(Duration::from_millis(200))),
            Err(e) => return Err(e.into()),
        }
        if step == FinalizerStep::Remove {
            return Ok(Action::await_change());
        }
    }
    if let Some(v) = &vmi
        && controlled_by_other(v, vm)
    {
        tracing::warn!(vm = %name, "a VMI with this name belongs to another owner");
        return Ok(Action::requeue(Duration::from_secs(30)));
    }
    crate::storage::dv_loop::ensure_template_data_volumes(&ctx.client, vm).await?;
    let volumes = observe_volumes(&ctx.client, &ns, vm).await?;
    let spec = expand(&ctx.client, &ns, vm).await;
    let now = Timestamp::now();
    let decision = decide(
        &VmInput {
            vm,
            vmi: vmi.as_ref(),
            volumes: &volumes,
            spec: &spec,
            now,
        },
        &ctx.opts,
    );
    let mut status = decision.status.clone();
    let mut events = decision.events.clone();
    let applied = apply(&vmis, &name, &decision.action).await;
    if let Err(e) = &applied {
        let (failed_status, event) =
            decision.action_failed(vm.status.as_ref(), &e.to_string(), now);
        status = failed_status;
        events.retain(|ev| ev.warning);
        events.push(event);
    }
    // Do not repeat an unchanged failure as an Event on every retry.
    let prev_failure = vm
        .status
        .as_ref()
        .and_then(|s| conditions::find(s.conditions.as_deref(), vm_condition::FAILURE))
        .and_then(|c| c.message.clone());
    events.retain(|ev| {
        !(ev.warning
            && prev_failure
                .as_deref()
                .is_some_and(|m| ev.message.contains(m)))
    });

    let mut requeue = match &decision.action {
        VmAction::Wait { requeue_after } => Action::requeue(*requeue_after),
        _ => Action::requeue(Duration::from_secs(300)),
    };
    if vm.status.as_ref() != Some(&status) {
        let vms: Api<Vm> = Api::namespaced(ctx.client.clone(), &ns);
        let mut obj = Vm(vm.clone());
        obj.0.status = Some(status);
        match vms
            .replace_status(&name, &PostParams::default(), &obj)
            .await
        {
            Ok(_) => {}
            Err(e) if is_conflict(&e) => requeue = Action::requeue(Duration::from_millis(200)),
            Err(kube::Error::Api(s)) if s.is_not_found() => return Ok(Action::await_change()),
            Err(e) => return Err(e.into()),
        }
    }
    let reference = object_ref(KUBEVIRT_API_VERSION, "VirtualMachine", &vm.metadata);
    for ev in &events {
        ctx.recorder
            .record(&reference, ev.warning, &ev.reason, &ev.message)
            .await;
    }
    applied?;
    Ok(requeue)
}

/// Apply the action to the VMI `name` (always named like its VM).
async fn apply(vmis: &Api<Vmi>, name: &str, action: &VmAction) -> Result<(), kube::Error> {
    match action {
        VmAction::CreateVmi(vmi) => match vmis
            .create(&PostParams::default(), &Vmi((**vmi).clone()))
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.is_already_exists() => Ok(()),
            Err(e) => Err(e),
        },
        VmAction::DeleteVmi {
            uid,
            grace_period_seconds,
        } => {
            let dp = DeleteParams {
                grace_period_seconds: grace_period_seconds.and_then(|g| u32::try_from(g).ok()),
                preconditions: uid.as_ref().map(|u| Preconditions {
                    uid: Some(u.clone()),
                    resource_version: None,
                }),
                ..Default::default()
            };
            match vmis.delete(name, &dp).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
                Err(e) => Err(e),
            }
        }
        VmAction::Wait { .. } | VmAction::Nothing => Ok(()),
    }
}

/// The DataVolume resource (cdi.kubevirt.io/v1beta1).
fn datavolume_resource() -> ApiResource {
    ApiResource {
        group: "cdi.kubevirt.io".into(),
        version: "v1beta1".into(),
        api_version: "cdi.kubevirt.io/v1beta1".into(),
        kind: "DataVolume".into(),
        plural: "datavolumes".into(),
    }
}

fn instancetype_resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: "instancetype.kubevirt.io".into(),
        version: "v1beta1".into(),
        api_version: "instancetype.kubevirt.io/v1beta1".into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// Aggregate the readiness of the template's PVC and DataVolume volumes; errors win over
/// waiting.
async fn observe_volumes(
    client: &kube::Client,
    ns: &str,
    vm: &VirtualMachine,
) -> Result<VolumeReadiness, ControllerError> {
    let spec = vm.spec.as_ref();
    let volumes = spec
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.volumes.clone())
        .unwrap_or_default();
    let templates: Vec<String> = spec
        .and_then(|s| s.data_volume_templates.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|t| t.metadata.as_ref().and_then(|m| m.name.clone()))
        .collect();
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let dvs: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &datavolume_resource());
    let mut found = Vec::new();
    for v in &volumes {
        if let Some(p) = &v.persistent_volume_claim
            && pvcs.get_opt(&p.claim_name).await?.is_none()
        {
            found.push(VolumeReadiness::PvcNotFound(format!(
                "PVC {ns}/{} does not exist",
                p.claim_name
            )));
        }
        if let Some(d) = &v.data_volume {
            let dv = match dvs.get_opt(&d.name).await {
                Ok(dv) => dv,
                Err(kube::Error::Api(s)) if s.code == 404 => None,
                Err(e) => return Err(e.into()),
            };
            match dv {
                Some(dv) => {
                    let phase = dv
                        .data
                        .pointer("/status/phase")
                        .and_then(|p| p.as_str())
                        .unwrap_or("");
                    match phase {
                        "Succeeded" | "WaitForFirstConsumer" | "PendingPopulation" => {}
                        "Failed" => found.push(VolumeReadiness::DataVolumeError(format!(
                            "DataVolume {} failed",
                            d.name
                        ))),
                        _ => found.push(VolumeReadiness::Provisioning(format!(
                            "DataVolume {} is {}",
                            d.name,
                            if phase.is_empty() { "pending" } else { phase }
                        ))),
                    }
                }
                None if templates.contains(&d.name) => found.push(VolumeReadiness::Provisioning(
                    format!("DataVolume {} is being created", d.name),
                )),
                None if pvcs.get_opt(&d.name).await?.is_some() => {}
                None => found.push(VolumeReadiness::PvcNotFound(format!(
                    "DataVolume {ns}/{} does not exist",
                    d.name
                ))),
            }
        }
    }
    let rank = |r: &VolumeReadiness| match r {
        VolumeReadiness::DataVolumeError(_) => 0,
        VolumeReadiness::PvcNotFound(_) => 1,
        VolumeReadiness::WaitingForBinding(_) => 2,
        VolumeReadiness::Provisioning(_) => 3,
        VolumeReadiness::Ready => 4,
    };
    Ok(found.into_iter().min_by_key(rank).unwrap_or_default())
}

/// Fetch a (Cluster)Instancetype or (Cluster)Preference `spec`.
async fn fetch_spec<T: serde::de::DeserializeOwned>(
    client: &kube::Client,
    ns: &str,
    name: &str,
    namespaced: (&str, &str),
    cluster: (&str, &str),
    kind: Option<&str>,
) -> Result<(T, serde_json::Value), String> {
    let namespaced_kind = kind.is_some_and(|k| k.eq_ignore_ascii_case(namespaced.0));
    let (api, kind) = if namespaced_kind {
        let r = instancetype_resource(namespaced.0, namespaced.1);
        (
            Api::<DynamicObject>::namespaced_with(client.clone(), ns, &r),
            namespaced.0,
        )
    } else {
        let r = instancetype_resource(cluster.0, cluster.1);
        (
            Api::<DynamicObject>::all_with(client.clone(), &r),
            cluster.0,
        )
    };
    let obj = api
        .get_opt(name)
        .await
        .map_err(|e| format!("fetching {kind} {name}: {e}"))?
        .ok_or_else(|| format!("{kind} {name} not found"))?;
    let spec = serde_json::from_value(obj.data.get("spec").cloned().unwrap_or_default())
        .map_err(|e| format!("{kind} {name} has an invalid spec: {e}"))?;
    Ok((spec, serde_json::to_value(&obj).unwrap_or_default()))
}

/// The ControllerRevision resource (apps/v1) that pins an instancetype or preference.
fn revision_resource() -> ApiResource {
    ApiResource {
        group: "apps".into(),
        version: "v1".into(),
        api_version: "apps/v1".into(),
        kind: "ControllerRevision".into(),
        plural: "controllerrevisions".into(),
    }
}

/// The name of the revision pinning `object` (an instancetype or preference) for `vm`.
pub fn revision_name(vm: &str, object: &serde_json::Value) -> String {
    let kind = object["kind"].as_str().unwrap_or("object").to_lowercase();
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    let generation = object["metadata"]["generation"].as_i64().unwrap_or(1);
    let mut n = format!("{vm}-{kind}-{name}-{generation}");
    n.truncate(253);
    n
}

/// Reads the spec pinned in ControllerRevision `revision` (its `data` is the whole object).
async fn pinned_spec<T: serde::de::DeserializeOwned>(
    client: &kube::Client,
    ns: &str,
    revision: &str,
) -> Result<T, String> {
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &revision_resource());
    let rev = api
        .get_opt(revision)
        .await
        .map_err(|e| format!("fetching ControllerRevision {revision}: {e}"))?
        .ok_or_else(|| format!("ControllerRevision {revision} not found"))?;
    serde_json::from_value(rev.data["data"]["spec"].clone())
        .map_err(|e| format!("ControllerRevision {revision} holds an invalid spec: {e}"))
}

/// Pins `object` for `vm` in a ControllerRevision owned by the VM and records its name in the
/// VM's `spec.<field>.revisionName`, so restarts keep the sizing the VM started with.
async fn pin_revision(
    client: &kube::Client,
    ns: &str,
    vm: &VirtualMachine,
    field: &str,
    object: serde_json::Value,
) -> Result<(), String> {
    let vm_name = vm.metadata.name.clone().unwrap_or_default();
    let name = revision_name(&vm_name, &object);
    let api = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &revision_resource());
    let rev: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "ControllerRevision",
        "metadata": {
            "name": name,
            "namespace": ns,
            "ownerReferences": [{
                "apiVersion": KUBEVIRT_API_VERSION,
                "kind": "VirtualMachine",
                "name": vm_name,
                "uid": vm.metadata.uid.clone().unwrap_or_default(),
                "controller": true,
                "blockOwnerDeletion": true,
            }],
        },
        "data": object,
        "revision": 1,
    }))
    .map_err(|e| e.to_string())?;
    match api.create(&PostParams::default(), &rev).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.is_already_exists() => {}
        Err(e) => return Err(format!("creating ControllerRevision {name}: {e}")),
    }
    let vms: Api<crate::runtime::resources::Vm> = Api::namespaced(client.clone(), ns);
    let patch = serde_json::json!({"spec": {field: {"revisionName": name}}});
    vms.patch(
        &vm_name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&patch),
    )
    .await
    .map_err(|e| format!("recording the revision of {field}: {e}"))?;
    Ok(())
}

/// The template expanded with the VM's instancetype and preference, or why not.
async fn expand(
    client: &kube::Client,
    ns: &str,
    vm: &VirtualMachine,
) -> Result<VirtualMachineInstanceSpec, String> {
    let spec = vm.spec.as_ref();
    let it = match spec
        .and_then(|s| s.instancetype.as_ref())
        .and_then(|m| m.name.as_ref().map(|n| (n, m)))
    {
        Some((name, m)) => Some(match &m.revision_name {
            Some(rev) => pinned_spec::<InstancetypeSpec>(client, ns, rev).await?,
            None => {
                let (spec, object) = fetch_spec::<InstancetypeSpec>(
                    client,
                    ns,
                    name,
                    ("VirtualMachineInstancetype", "virtualmachineinstancetypes"),
                    (
                        "VirtualMachineClusterInstancetype",
                        "virtualmachineclusterinstancetypes",
                    ),
                    m.kind.as_deref(),
                )
                .await?;
                pin_revision(client, ns, vm, "instancetype", object).await?;
                spec
            }
        }),
        None => None,
    };
    let pref = match spec
        .and_then(|s| s.preference.as_ref())
        .and_then(|m| m.name.as_ref().map(|n| (n, m)))
    {
        Some((name, m)) => Some(match &m.revision_name {
            Some(rev) => pinned_spec::<PreferenceSpec>(client, ns, rev).await?,
            None => {
                let (spec, object) = fetch_spec::<PreferenceSpec>(
                    client,
                    ns,
                    name,
                    ("VirtualMachinePreference", "virtualmachinepreferences"),
                    (
                        "VirtualMachineClusterPreference",
                        "virtualmachineclusterpreferences",
                    ),
                    m.kind.as_deref(),
                )
                .await?;
                pin_revision(client, ns, vm, "preference", object).await?;
                spec
            }
        }),
        None => None,
    };
    expanded_spec(vm, it.as_ref(), pref.as_ref())
}
