//! DataSources (cdi.kubevirt.io/v1beta1): named pointers to golden-image PVCs. [`ready`]
//! (pure) decides a DataSource's `Ready` condition from the PVC it names (CDI's reasons:
//! `Ready`, `NotFound`, or the phase of the DataVolume still populating the PVC); [`run`]
//! keeps every DataSource's status current; [`resolve_source_ref`] (pure) and
//! [`resolve_spec`] turn a DataVolume's `sourceRef: {kind: DataSource}` into a PVC clone
//! source, so the DataVolume controller clones the golden image.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use serde_json::json;

use ferrovirt_api::cdi::{
    CdiCondition, DataSource, DataSourceStatus, DataVolumeSource, DataVolumeSpec, NamespacedName,
    dv_phase,
};

use super::datavolume::POPULATED_FOR;
use super::resources::{Ds, Dv};
use crate::error::ControllerError;

/// Component name in logs.
pub const COMPONENT: &str = "datasource-controller";

/// The PVC a DataSource points at (`namespace`, `name`); the namespace defaults to the
/// DataSource's own.
pub fn pvc_source(ds: &DataSource) -> Result<(String, String), String> {
    let ns = ds
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let src = ds.spec.as_ref().map(|s| &s.source);
    match src.and_then(|s| s.pvc.as_ref()) {
        Some(p) if !p.name.is_empty() => Ok((p.namespace.clone().unwrap_or(ns), p.name.clone())),
        Some(_) => Err("spec.source.pvc.name is required".into()),
        None if src.is_some_and(|s| s.snapshot.is_some() || s.data_source.is_some()) => Err(
            "only spec.source.pvc is supported (snapshot and dataSource sources are not)".into(),
        ),
        None => Err("spec.source.pvc is required".into()),
    }
}

fn condition(status: bool, reason: &str, message: &str) -> CdiCondition {
    CdiCondition {
        type_: "Ready".into(),
        status: if status { "True" } else { "False" }.into(),
        reason: Some(reason.into()),
        message: (!message.is_empty()).then(|| message.into()),
        ..Default::default()
    }
}

/// The `Ready` condition of `ds`: `pvc` is the claim it names (if it exists) and
/// `populating_phase` the phase of the DataVolume that populates that claim (if any).
pub fn ready(
    ds: &DataSource,
    pvc: Option<&PersistentVolumeClaim>,
    populating_phase: Option<&str>,
) -> CdiCondition {
    let (ns, name) = match pvc_source(ds) {
        Ok(s) => s,
        Err(m) => return condition(false, "NoSource", &m),
    };
    let Some(pvc) = pvc else {
        return condition(
            false,
            "NotFound",
            &format!("PersistentVolumeClaim {ns}/{name} not found"),
        );
    };
    if pvc.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Bound") {
        return condition(
            false,
            "Pending",
            &format!("PersistentVolumeClaim {ns}/{name} is not bound yet"),
        );
    }
    match populating_phase {
        Some(dv_phase::SUCCEEDED) | None => condition(true, "Ready", ""),
        Some(phase) => condition(
            false,
            phase,
            &format!("DataVolume {ns}/{name} populating the claim is {phase}"),
        ),
    }
}

/// The DataSource status for `cond`, keeping the transition time when the status did not
/// change.
pub fn status_for(ds: &DataSource, cond: CdiCondition, now: &Time) -> DataSourceStatus {
    let prev = ds
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"));
    let mut cond = cond;
    cond.last_heartbeat_time = Some(now.clone());
    cond.last_transition_time = match prev {
        Some(p) if p.status == cond.status => p.last_transition_time.clone(),
        _ => Some(now.clone()),
    }
    .or(Some(now.clone()));
    DataSourceStatus {
        source: ds.spec.as_ref().map(|s| s.source.clone()),
        conditions: Some(vec![cond]),
    }
}

/// Whether the status differs in more than heartbeat times.
fn changed(old: Option<&DataSourceStatus>, new: &DataSourceStatus) -> bool {
    let strip = |s: &DataSourceStatus| {
        let mut s = s.clone();
        for c in s.conditions.iter_mut().flatten() {
            c.last_heartbeat_time = None;
        }
        s
    };
    old.map(strip) != Some(strip(new))
}

/// A DataVolume spec with its `sourceRef` replaced by the PVC clone source the DataSource
/// `ds` names; `Err` says why it cannot be resolved yet (the DataVolume waits).
pub fn resolve_source_ref(
    spec: &DataVolumeSpec,
    dv_namespace: &str,
    ds: Option<&DataSource>,
) -> Result<DataVolumeSpec, String> {
    let Some(r) = &spec.source_ref else {
        return Ok(spec.clone());
    };
    let ds_ns = r.namespace.clone().unwrap_or_else(|| dv_namespace.into());
    if r.kind != "DataSource" {
        return Err(format!(
            "spec.sourceRef.kind {:?} is not supported (DataSource)",
            r.kind
        ));
    }
    let Some(ds) = ds else {
        return Err(format!("DataSource {ds_ns}/{} not found", r.name));
    };
    let (ns, name) = pvc_source(ds).map_err(|m| format!("DataSource {ds_ns}/{}: {m}", r.name))?;
    let mut out = spec.clone();
    out.source_ref = None;
    out.source = Some(DataVolumeSource {
        pvc: Some(NamespacedName {
            namespace: Some(ns),
            name,
        }),
        ..Default::default()
    });
    Ok(out)
}

/// Resolve a DataVolume's `sourceRef` against the API: `Ok(Err(message))` while the
/// DataSource or its PVC does not exist.
pub async fn resolve_spec(
    client: &kube::Client,
    dv_namespace: &str,
    spec: &DataVolumeSpec,
) -> Result<Result<DataVolumeSpec, String>, ControllerError> {
    let Some(r) = &spec.source_ref else {
        return Ok(Ok(spec.clone()));
    };
    let ds_ns = r.namespace.clone().unwrap_or_else(|| dv_namespace.into());
    let ds = Api::<Ds>::namespaced(client.clone(), &ds_ns)
        .get_opt(&r.name)
        .await?
        .map(|d| d.0);
    let resolved = match resolve_source_ref(spec, dv_namespace, ds.as_ref()) {
        Ok(s) => s,
        Err(m) => return Ok(Err(m)),
    };
    if let Some(p) = resolved.source.as_ref().and_then(|s| s.pvc.as_ref()) {
        let ns = p.namespace.clone().unwrap_or_else(|| dv_namespace.into());
        let exists = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns)
            .get_opt(&p.name)
            .await?
            .is_some();
        if !exists {
            return Ok(Err(format!(
                "DataSource {ds_ns}/{} points at PersistentVolumeClaim {ns}/{} which does not exist",
                r.name, p.name
            )));
        }
    }
    Ok(Ok(resolved))
}

/// Run the DataSource controller until its watch ends or the future is dropped. Every
/// DataSource is re-evaluated every few seconds (its PVC and DataVolume change on their own).
pub async fn run(client: kube::Client) -> Result<(), ControllerError> {
    let api: Api<Ds> = Api::all(client.clone());
    crate::runtime::drive(
        Controller::new(api, watcher::Config::default()).run(
            crate::runtime::metrics::timed("DataSource", reconcile),
            |_, _, _| Action::requeue(Duration::from_secs(3)),
            Arc::new(client),
        ),
        COMPONENT,
        "DataSource",
    )
    .await
}

async fn reconcile(ds: Arc<Ds>, client: Arc<kube::Client>) -> Result<Action, ControllerError> {
    let ds = &ds.0;
    if ds.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let ns = ds
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let name = ds.metadata.name.clone().unwrap_or_default();
    let (pvc, phase) = match pvc_source(ds) {
        Ok((pns, pname)) => {
            let pvc = Api::<PersistentVolumeClaim>::namespaced((*client).clone(), &pns)
                .get_opt(&pname)
                .await?;
            let dv_name = pvc
                .as_ref()
                .and_then(|c| c.metadata.annotations.as_ref())
                .and_then(|a| a.get(POPULATED_FOR))
                .cloned();
            let phase = match dv_name {
                Some(d) => Api::<Dv>::namespaced((*client).clone(), &pns)
                    .get_opt(&d)
                    .await?
                    .map(|d| {
                        d.0.status
                            .and_then(|s| s.phase)
                            .unwrap_or_else(|| dv_phase::PENDING.into())
                    }),
                None => None,
            };
            (pvc, phase)
        }
        Err(_) => (None, None),
    };
    let cond = ready(ds, pvc.as_ref(), phase.as_deref());
    let status = status_for(ds, cond, &Time(Timestamp::now()));
    if changed(ds.status.as_ref(), &status) {
        let patch = json!({"status": status});
        match Api::<Ds>::namespaced((*client).clone(), &ns)
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_not_found() => return Ok(Action::await_change()),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Action::requeue(Duration::from_secs(3)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ds(source: serde_json::Value) -> DataSource {
        serde_json::from_value(json!({
            "metadata": {"name": "golden", "namespace": "images"},
            "spec": {"source": source}
        }))
        .unwrap()
    }

    fn pvc(phase: &str) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "disk", "namespace": "images"},
            "status": {"phase": phase}
        }))
        .unwrap()
    }

    #[test]
    fn ready_follows_the_pvc_and_its_datavolume() {
        let d = ds(json!({"pvc": {"name": "disk"}}));
        assert_eq!(pvc_source(&d).unwrap(), ("images".into(), "disk".into()));
        let c = ready(&d, None, None);
        assert_eq!(
            (c.status.as_str(), c.reason.as_deref()),
            ("False", Some("NotFound"))
        );
        assert!(c.message.unwrap().contains("images/disk"));
        let c = ready(&d, Some(&pvc("Pending")), None);
        assert_eq!(c.status, "False");
        let c = ready(&d, Some(&pvc("Bound")), Some("ImportInProgress"));
        assert_eq!(c.reason.as_deref(), Some("ImportInProgress"));
        let c = ready(&d, Some(&pvc("Bound")), Some("Succeeded"));
        assert_eq!(
            (c.status.as_str(), c.reason.as_deref()),
            ("True", Some("Ready"))
        );
        let c = ready(&d, Some(&pvc("Bound")), None);
        assert_eq!(c.status, "True");
        let none = ds(json!({}));
        assert_eq!(ready(&none, None, None).reason.as_deref(), Some("NoSource"));
        let snap = ds(json!({"snapshot": {"name": "s"}}));
        assert!(pvc_source(&snap).unwrap_err().contains("snapshot"));
    }

    #[test]
    fn status_keeps_transition_time() {
        let mut d = ds(json!({"pvc": {"name": "disk", "namespace": "other"}}));
        let t0 = Time(Timestamp::from_second(1000).unwrap());
        let t1 = Time(Timestamp::from_second(2000).unwrap());
        let s = status_for(&d, ready(&d, Some(&pvc("Bound")), None), &t0);
        assert_eq!(
            s.source.as_ref().unwrap().pvc.as_ref().unwrap().name,
            "disk"
        );
        d.status = Some(s.clone());
        let s2 = status_for(&d, ready(&d, Some(&pvc("Bound")), None), &t1);
        let c = &s2.conditions.as_ref().unwrap()[0];
        assert_eq!(c.last_transition_time, Some(t0.clone()));
        assert_eq!(c.last_heartbeat_time, Some(t1.clone()));
        assert!(!changed(Some(&s), &s2));
        let s3 = status_for(&d, ready(&d, None, None), &t1);
        assert!(changed(Some(&s), &s3));
        assert_eq!(s3.conditions.unwrap()[0].last_transition_time, Some(t1));
    }

    #[test]
    fn source_refs_resolve_to_pvc_clones() {
        let spec: DataVolumeSpec = serde_json::from_value(json!({
            "sourceRef": {"kind": "DataSource", "name": "golden", "namespace": "images"},
            "storage": {"resources": {"requests": {"storage": "1Gi"}}}
        }))
        .unwrap();
        let e = resolve_source_ref(&spec, "default", None).unwrap_err();
        assert_eq!(e, "DataSource images/golden not found");
        let d = ds(json!({"pvc": {"name": "disk"}}));
        let r = resolve_source_ref(&spec, "default", Some(&d)).unwrap();
        assert!(r.source_ref.is_none());
        let p = r.source.unwrap().pvc.unwrap();
        assert_eq!(
            (p.namespace.as_deref(), p.name.as_str()),
            (Some("images"), "disk")
        );
        let mut bad = spec.clone();
        bad.source_ref.as_mut().unwrap().kind = "PersistentVolumeClaim".into();
        assert!(resolve_source_ref(&bad, "default", Some(&d)).is_err());
        let plain = DataVolumeSpec::default();
        assert_eq!(resolve_source_ref(&plain, "default", None).unwrap(), plain);
    }
}
