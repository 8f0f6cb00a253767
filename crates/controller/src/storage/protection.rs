//! Storage-in-use protection, as Kubernetes' pvc-protection and pv-protection controllers do
//! it: every PersistentVolumeClaim carries the `kubernetes.io/pvc-protection` finalizer and
//! every PersistentVolume `kubernetes.io/pv-protection`. A deleted claim stays Terminating (its
//! finalizer kept) while something uses it: a VMI that has not finished (its QEMU may still
//! run, e.g. during the guest's grace period), or a DataVolume that populates it or clones from
//! it. A deleted volume stays while it is still Bound. Only then do the finalizers go, and with
//! them the objects; the reclaim loop deletes a volume's data only once its claim is gone.
//!
//! [`claims_in_use`], [`decide_pvc`] and [`decide_pv`] decide (pure); [`run`] follows the shared
//! caches (claims, volumes, VMIs) and a DataVolume watch, and patches the finalizers.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use tokio::sync::Notify;

use ferrovirt_api::cdi::DataVolume;
use ferrovirt_api::kubevirt::export::{VirtualMachineExport, phase as export_phase};
use ferrovirt_api::kubevirt::vmi::{VirtualMachineInstance, VmiPhase};

use super::resources::Dv;
use crate::error::ControllerError;
use crate::export::resources::VmExport;
use crate::runtime::stores::{Kind, Stores};
use crate::runtime::watched::watched_store;

/// Kubernetes' finalizer on claims in use.
pub const PVC_PROTECTION: &str = "kubernetes.io/pvc-protection";
/// Kubernetes' finalizer on volumes bound to a claim.
pub const PV_PROTECTION: &str = "kubernetes.io/pv-protection";

/// What to do with one object's protection finalizer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Nothing,
    /// A live object without the finalizer gets it.
    Add,
    /// A deleted object nothing uses any more loses it (and goes).
    Remove,
    /// A deleted object still in use keeps it; the text says by what.
    Keep(String),
}

/// The claims something uses, by (namespace, claim), with the first user found (e.g.
/// `VirtualMachineInstance "vm1"`).
#[derive(Debug, Default)]
pub struct InUse(HashMap<(String, String), String>);

impl InUse {
    /// What uses the claim `ns/name`, if anything.
    pub fn user(&self, ns: &str, name: &str) -> Option<&str> {
        self.0
            .get(&(ns.to_string(), name.to_string()))
            .map(String::as_str)
    }

    fn add(&mut self, ns: &str, claim: String, user: impl FnOnce() -> String) {
        self.0.entry((ns.to_string(), claim)).or_insert_with(user);
    }

    /// Adds the claims that Ready VirtualMachineExports serve (pure): an export's download
    /// links read them until it is deleted or its TTL ends, as KubeVirt's export server pod
    /// holds them mounted.
    pub fn with_exports<'a>(
        mut self,
        exports: impl IntoIterator<Item = &'a VirtualMachineExport>,
    ) -> Self {
        for e in exports {
            let status = e.status.as_ref();
            if e.metadata.deletion_timestamp.is_some()
                || status.and_then(|s| s.phase.as_deref()) != Some(export_phase::READY)
            {
                continue;
            }
            let ns = e.metadata.namespace.as_deref().unwrap_or("default");
            let name = e.metadata.name.as_deref().unwrap_or("");
            let links = status.and_then(|s| s.links.as_ref());
            let served = links
                .into_iter()
                .flat_map(|l| [l.internal.as_ref(), l.external.as_ref()])
                .flatten()
                .flat_map(|l| l.volumes.iter().flatten());
            for v in served {
                self.add(ns, v.name.clone(), || {
                    format!("VirtualMachineExport {name:?}")
                });
            }
        }
        self
    }
}

/// Whether a VMI may still have a process using its volumes: every VMI that has not
/// reached Succeeded or Failed (a Pending one is about to open them; a deleted one runs until
/// its grace period is over and the node reports it finished).
fn vmi_may_use_volumes(vmi: &VirtualMachineInstance) -> bool {
    !matches!(
        vmi.status.as_ref().and_then(|s| s.phase.as_ref()),
        Some(VmiPhase::Succeeded | VmiPhase::Failed)
    )
}

/// Whether a DataVolume's phase means a transfer into its claim (or out of its clone source)
/// is scheduled or running: the `…Scheduled` and `…InProgress` phases, `UploadReady` (the
/// upload server holds the claim open) and `Paused` (a multi-stage import between
/// checkpoints). A DataVolume being deleted no longer counts: its transfer is cancelled.
pub fn dv_is_transferring(dv: &DataVolume) -> bool {
    if dv.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let phase = dv
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("");
    phase.ends_with("InProgress")
        || phase.ends_with("Scheduled")
        || phase == "UploadReady"
        || phase == "Paused"
}

/// The claims in use by the given VMIs and DataVolumes (pure).
pub fn claims_in_use<'a>(
    vmis: impl IntoIterator<Item = &'a VirtualMachineInstance>,
    dvs: impl IntoIterator<Item = &'a DataVolume>,
) -> InUse {
    let mut used = InUse::default();
    for vmi in vmis {
        if !vmi_may_use_volumes(vmi) {
            continue;
        }
        let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
        let name = vmi.metadata.name.as_deref().unwrap_or("");
        for claim in super::pvc_loop::claims_of(vmi) {
            used.add(ns, claim, || format!("VirtualMachineInstance {name:?}"));
        }
    }
    for dv in dvs {
        if !dv_is_transferring(dv) {
            continue;
        }
        let ns = dv.metadata.namespace.as_deref().unwrap_or("default");
        let name = dv.metadata.name.clone().unwrap_or_default();
        let target = dv
            .status
            .as_ref()
            .and_then(|s| s.claim_name.clone())
            .unwrap_or_else(|| name.clone());
        used.add(ns, target, || format!("DataVolume {name:?}"));
        if let Some(src) = dv
            .spec
            .as_ref()
            .and_then(|s| s.source.as_ref())
            .and_then(|s| s.pvc.as_ref())
        {
            let src_ns = src.namespace.as_deref().unwrap_or(ns);
            used.add(src_ns, src.name.clone(), || {
                format!("DataVolume {ns}/{name} (clone source)")
            });
        }
    }
    used
}

fn has(finalizers: Option<&Vec<String>>, f: &str) -> bool {
    finalizers.is_some_and(|l| l.iter().any(|x| x == f))
}

/// The pvc-protection step for one claim (pure).
pub fn decide_pvc(pvc: &PersistentVolumeClaim, in_use: &InUse) -> Step {
    let m = &pvc.metadata;
    let held = has(m.finalizers.as_ref(), PVC_PROTECTION);
    if m.deletion_timestamp.is_none() {
        return if held { Step::Nothing } else { Step::Add };
    }
    if !held {
        return Step::Nothing;
    }
    let ns = m.namespace.as_deref().unwrap_or("default");
    match in_use.user(ns, m.name.as_deref().unwrap_or("")) {
        Some(user) => Step::Keep(user.to_string()),
        None => Step::Remove,
    }
}

/// The pv-protection step for one volume (pure): a deleted volume keeps its finalizer while
/// its phase is Bound.
pub fn decide_pv(pv: &PersistentVolume) -> Step {
    let m = &pv.metadata;
    let held = has(m.finalizers.as_ref(), PV_PROTECTION);
    if m.deletion_timestamp.is_none() {
        return if held { Step::Nothing } else { Step::Add };
    }
    if !held {
        return Step::Nothing;
    }
    match pv.status.as_ref().and_then(|s| s.phase.as_deref()) {
        Some("Bound") => Step::Keep("bound to its claim".into()),
        _ => Step::Remove,
    }
}

/// The finalizer list after `step` (None: no change to write).
fn finalizers_after(current: Option<&Vec<String>>, f: &str, step: &Step) -> Option<Vec<String>> {
    let mut list = current.cloned().unwrap_or_default();
    match step {
        Step::Add => list.push(f.to_string()),
        Step::Remove => list.retain(|x| x != f),
        Step::Nothing | Step::Keep(_) => return None,
    }
    Some(list)
}

/// A merge patch setting the finalizers, guarded by the resourceVersion they were read at (a
/// concurrent change of the list makes it a conflict, retried on the next pass).
fn finalizer_patch(resource_version: Option<&str>, list: &[String]) -> serde_json::Value {
    json!({"metadata": {"resourceVersion": resource_version, "finalizers": list}})
}

/// How long a failed patch waits before the next pass, without a change to wake it.
const RETRY: Duration = Duration::from_secs(2);

/// Runs the protection loop until its watches end.
pub async fn run(client: kube::Client, stores: Stores) -> Result<(), ControllerError> {
    let wake = Arc::new(Notify::new());
    let w = wake.clone();
    let (dvs, pump) = watched_store(
        Api::<Dv>::all(client.clone()),
        "storage protection: DataVolume",
        move || w.notify_one(),
    );
    let w = wake.clone();
    let (exports, export_pump) = watched_store(
        Api::<VmExport>::all(client.clone()),
        "storage protection: VirtualMachineExport",
        move || w.notify_one(),
    );
    let w = wake.clone();
    let mut changes = stores.changes();
    let follow = async move {
        let kinds = [
            Kind::PersistentVolumeClaim,
            Kind::PersistentVolume,
            Kind::Vmi,
        ];
        while changes.wait_for(&kinds).await.is_some() {
            w.notify_one();
        }
    };
    let work = async {
        let _ = dvs.wait_until_ready().await;
        let _ = exports.wait_until_ready().await;
        stores.ready().await;
        loop {
            let all_ok = pass(&client, &stores, &dvs.state(), &exports.state()).await;
            if all_ok {
                wake.notified().await;
            } else {
                let _ = tokio::time::timeout(RETRY, wake.notified()).await;
            }
        }
    };
    tokio::select! {
        _ = pump => Err(ControllerError::TaskStopped { name: "storage-protection", reason: "DataVolume watch ended".into() }),
        _ = export_pump => Err(ControllerError::TaskStopped { name: "storage-protection", reason: "VirtualMachineExport watch ended".into() }),
        _ = follow => Err(ControllerError::TaskStopped { name: "storage-protection", reason: "caches ended".into() }),
        _ = work => Ok(()),
    }
}

/// One pass over every claim and volume in the caches; false when a patch failed.
async fn pass(
    client: &kube::Client,
    stores: &Stores,
    dvs: &[Arc<Dv>],
    exports: &[Arc<VmExport>],
) -> bool {
    let pvcs = stores.pvcs.state();
    // The VMIs are walked only while some claim is being deleted: a wake-up for a VMI status
    // change costs a look at the claims, not at every VMI.
    let deleting = pvcs.iter().any(|p| {
        p.metadata.deletion_timestamp.is_some()
            && has(p.metadata.finalizers.as_ref(), PVC_PROTECTION)
    });
    let in_use = if deleting {
        let vmis = stores.vmis.state();
        claims_in_use(vmis.iter().map(|v| &v.0), dvs.iter().map(|d| &d.0))
            .with_exports(exports.iter().map(|e| &e.0))
    } else {
        InUse::default()
    };
    let mut ok = true;
    for pvc in pvcs {
        let step = decide_pvc(&pvc, &in_use);
        let Some(list) = finalizers_after(pvc.metadata.finalizers.as_ref(), PVC_PROTECTION, &step)
        else {
            continue;
        };
        let ns = pvc.metadata.namespace.as_deref().unwrap_or("default");
        let name = pvc.metadata.name.as_deref().unwrap_or("");
        let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
        let patch = finalizer_patch(pvc.metadata.resource_version.as_deref(), &list);
        ok &= apply(&api, name, &patch).await;
    }
    for pv in stores.pvs.state() {
        let step = decide_pv(&pv);
        let Some(list) = finalizers_after(pv.metadata.finalizers.as_ref(), PV_PROTECTION, &step)
        else {
            continue;
        };
        let name = pv.metadata.name.as_deref().unwrap_or("");
        let api: Api<PersistentVolume> = Api::all(client.clone());
        let patch = finalizer_patch(pv.metadata.resource_version.as_deref(), &list);
        ok &= apply(&api, name, &patch).await;
    }
    ok
}

/// Applies one finalizer patch; an object gone meanwhile is fine, a conflict (the cache lagged)
/// is retried by the next pass.
async fn apply<K>(api: &Api<K>, name: &str, patch: &serde_json::Value) -> bool
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
    {
        Ok(_) => true,
        Err(kube::Error::Api(s)) if s.code == 404 => true,
        Err(e) => {
            tracing::debug!(%name, error = %e, "protection finalizer patch failed; retrying");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pvc(name: &str, deleting: bool, fins: &[&str]) -> PersistentVolumeClaim {
        serde_json::from_value(json!({"metadata": {
            "name": name, "namespace": "ns",
            "deletionTimestamp": deleting.then_some("2026-12-03T00:00:00Z"),
            "finalizers": fins,
        }}))
        .unwrap()
    }

    fn vmi(name: &str, claim: &str, phase: &str) -> VirtualMachineInstance {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"domain": {"devices": {}}, "volumes": [
                {"name": "d", "persistentVolumeClaim": {"claimName": claim}}]},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    fn dv(name: &str, phase: &str, clone_from: Option<(&str, &str)>) -> DataVolume {
        let source = match clone_from {
            Some((ns, n)) => json!({"pvc": {"namespace": ns, "name": n}}),
            None => json!({"blank": {}}),
        };
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"source": source},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    #[test]
    fn ready_exports_hold_the_claims_they_serve() {
        let export = |phase: &str, deleting: bool| -> VirtualMachineExport {
            serde_json::from_value(json!({
                "metadata": {"name": "ex", "namespace": "ns",
                             "deletionTimestamp": deleting.then_some("2026-12-03T00:00:00Z")},
                "spec": {"source": {"kind": "VirtualMachine", "name": "vm"}},
                "status": {"phase": phase, "links": {"internal": {"cert": "",
                    "volumes": [{"name": "disk"}]}}},
            }))
            .unwrap()
        };
        let deleted = pvc("disk", true, &[PVC_PROTECTION]);
        let ready = export("Ready", false);
        let used = claims_in_use([], []).with_exports([&ready]);
        assert_eq!(
            decide_pvc(&deleted, &used),
            Step::Keep("VirtualMachineExport \"ex\"".into())
        );
        for e in [
            export("Pending", false),
            export("Terminated", false),
            export("Ready", true),
        ] {
            let used = claims_in_use([], []).with_exports([&e]);
            assert_eq!(decide_pvc(&deleted, &used), Step::Remove);
        }
    }

    #[test]
    fn live_claims_get_the_finalizer_once() {
        let none = InUse::default();
        assert_eq!(decide_pvc(&pvc("a", false, &[]), &none), Step::Add);
        assert_eq!(
            decide_pvc(&pvc("a", false, &[PVC_PROTECTION]), &none),
            Step::Nothing
        );
        // A deleted claim that never had it is left to go.
        assert_eq!(decide_pvc(&pvc("a", true, &[]), &none), Step::Nothing);
    }

    #[test]
    fn a_deleted_claim_stays_while_an_unfinished_vmi_uses_it() {
        let deleted = pvc("disk", true, &[PVC_PROTECTION, "other/keep"]);
        for phase in ["", "Pending", "Scheduled", "Running", "Unknown"] {
            let used = claims_in_use([&vmi("vm1", "disk", phase)], []);
            assert_eq!(
                decide_pvc(&deleted, &used),
                Step::Keep("VirtualMachineInstance \"vm1\"".into()),
                "{phase}"
            );
        }
        for phase in ["Succeeded", "Failed"] {
            let used = claims_in_use([&vmi("vm1", "disk", phase)], []);
            assert_eq!(decide_pvc(&deleted, &used), Step::Remove, "{phase}");
        }
        // Another claim, or the same name in another namespace, does not hold it.
        let used = claims_in_use([&vmi("vm1", "other", "Running")], []);
        assert_eq!(decide_pvc(&deleted, &used), Step::Remove);
        let mut elsewhere = vmi("vm1", "disk", "Running");
        elsewhere.metadata.namespace = Some("ns2".into());
        assert_eq!(
            decide_pvc(&deleted, &claims_in_use([&elsewhere], [])),
            Step::Remove
        );
        // Removing keeps the other finalizers.
        assert_eq!(
            finalizers_after(
                deleted.metadata.finalizers.as_ref(),
                PVC_PROTECTION,
                &Step::Remove
            ),
            Some(vec!["other/keep".to_string()])
        );
    }

    #[test]
    fn transfers_hold_their_claim_and_their_clone_source() {
        let deleted_target = pvc("target", true, &[PVC_PROTECTION]);
        let deleted_source = pvc("golden", true, &[PVC_PROTECTION]);
        for phase in [
            "ImportScheduled",
            "ImportInProgress",
            "CloneInProgress",
            "UploadReady",
            "Paused",
        ] {
            let used = claims_in_use([], [&dv("target", phase, Some(("ns", "golden")))]);
            assert!(
                matches!(decide_pvc(&deleted_target, &used), Step::Keep(_)),
                "{phase}"
            );
            assert!(
                matches!(decide_pvc(&deleted_source, &used), Step::Keep(_)),
                "{phase}"
            );
        }
        for phase in ["Succeeded", "Failed", "Pending", "WaitForFirstConsumer"] {
            let used = claims_in_use([], [&dv("target", phase, Some(("ns", "golden")))]);
            assert_eq!(decide_pvc(&deleted_target, &used), Step::Remove, "{phase}");
            assert_eq!(decide_pvc(&deleted_source, &used), Step::Remove, "{phase}");
        }
        // A DataVolume being deleted cancels its transfer: it holds nothing.
        let mut going = dv("target", "ImportInProgress", None);
        going.metadata.deletion_timestamp = deleted_target.metadata.deletion_timestamp.clone();
        assert_eq!(
            decide_pvc(&deleted_target, &claims_in_use([], [&going])),
            Step::Remove
        );
        // A clone source in another namespace is held there, not here.
        let used = claims_in_use([], [&dv("t", "CloneInProgress", Some(("src", "golden")))]);
        assert!(used.user("src", "golden").is_some());
        assert_eq!(decide_pvc(&deleted_source, &used), Step::Remove);
    }

    #[test]
    fn volumes_stay_while_bound() {
        let pv = |deleting: bool, fins: &[&str], phase: &str| -> PersistentVolume {
            serde_json::from_value(json!({
                "metadata": {"name": "pv1",
                    "deletionTimestamp": deleting.then_some("2026-12-03T00:00:00Z"),
                    "finalizers": fins},
                "status": {"phase": phase},
            }))
            .unwrap()
        };
        assert_eq!(decide_pv(&pv(false, &[], "Available")), Step::Add);
        assert_eq!(
            decide_pv(&pv(false, &[PV_PROTECTION], "Bound")),
            Step::Nothing
        );
        assert!(matches!(
            decide_pv(&pv(true, &[PV_PROTECTION], "Bound")),
            Step::Keep(_)
        ));
        for phase in ["Released", "Available", "Failed"] {
            assert_eq!(decide_pv(&pv(true, &[PV_PROTECTION], phase)), Step::Remove);
        }
    }

    #[test]
    fn patches_carry_the_resource_version_they_were_decided_on() {
        let p = finalizer_patch(Some("42"), &[PVC_PROTECTION.to_string()]);
        assert_eq!(p["metadata"]["resourceVersion"], "42");
        assert_eq!(p["metadata"]["finalizers"][0], PVC_PROTECTION);
    }
}
