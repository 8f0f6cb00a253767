//! CDI's older interface, the annotated PersistentVolumeClaim: a claim carrying
//! `cdi.kubevirt.io/storage.import.endpoint` (with `…import.source`, `…import.secretName`,
//! `…import.certConfigMap`, `…storage.contentType`) is imported into, without a DataVolume,
//! and every claim that ferrovirt populates (annotated or a DataVolume's) reports as CDI does
//! on the claim itself: `cdi.kubevirt.io/storage.pod.phase`, `…storage.pod.restarts` and
//! `…storage.condition.running[.reason|.message]`, which clients such as kcli wait on.
//!
//! [`requested_spec`] (what an annotated claim asks for) and [`annotations_for`] (what a
//! population stage reports) decide; [`reconcile`] carries the import out with the
//! DataVolume loop's own population machinery ([`super::dv_loop::populate`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, ObjectMeta, Patch, PatchParams};
use kube::runtime::controller::Action;
use serde_json::json;

use ferrovirt_api::cdi::{
    DataVolume, DataVolumeSource, DataVolumeSpec, HttpSource, RegistrySource,
};
use ferrovirt_api::kubevirt::domain::Empty;

use super::datavolume::{self as dvd, Stage};
use super::dv_loop::{Ctx, Outcome, Subject, populate, unbound_stage};
use crate::error::ControllerError;
use crate::runtime::events::object_ref;

/// The source URL (http(s):// or docker://).
pub const ENDPOINT: &str = "cdi.kubevirt.io/storage.import.endpoint";
/// `http` (the default), `registry` or `none` (a blank image).
pub const SOURCE: &str = "cdi.kubevirt.io/storage.import.source";
/// A Secret with `accessKeyId`/`secretKey` for the source.
pub const SECRET: &str = "cdi.kubevirt.io/storage.import.secretName";
/// A ConfigMap of CA bundles the source's certificate is checked against.
pub const CERT_CONFIG_MAP: &str = "cdi.kubevirt.io/storage.import.certConfigMap";
/// `kubevirt` (a disk image, the default) or `archive`.
pub const CONTENT_TYPE: &str = "cdi.kubevirt.io/storage.contentType";
/// CDI's upload into an annotated claim (virtctl `image-upload --pvc`): refused here.
pub const UPLOAD_TARGET: &str = "cdi.kubevirt.io/storage.upload.target";
/// The phase of the (in CDI: importer pod's) population: Pending, Running, Succeeded, Failed.
pub const POD_PHASE: &str = "cdi.kubevirt.io/storage.pod.phase";
/// Whether the population's worker is ready (`true` while it runs).
pub const POD_READY: &str = "cdi.kubevirt.io/storage.pod.ready";
/// How many times the population was retried.
pub const POD_RESTARTS: &str = "cdi.kubevirt.io/storage.pod.restarts";
/// `true` while the population runs.
pub const RUNNING: &str = "cdi.kubevirt.io/storage.condition.running";
/// Why it runs or not (`Completed` once done, `Error` when failed).
pub const RUNNING_REASON: &str = "cdi.kubevirt.io/storage.condition.running.reason";
/// The running condition's message.
pub const RUNNING_MESSAGE: &str = "cdi.kubevirt.io/storage.condition.running.message";

fn annotation<'a>(pvc: &'a PersistentVolumeClaim, key: &str) -> Option<&'a str> {
    pvc.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// Whether a DataVolume owns the claim (it is then populated by the DataVolume loop).
pub fn owned_by_data_volume(pvc: &PersistentVolumeClaim) -> bool {
    pvc.metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.kind == "DataVolume")
}

/// The DataVolume spec an annotated claim stands for (pure): `None` when the claim asks for
/// no import (or a DataVolume owns it), `Err` naming the annotation when it asks for one that
/// cannot be carried out.
pub fn requested_spec(pvc: &PersistentVolumeClaim) -> Option<Result<DataVolumeSpec, String>> {
    if owned_by_data_volume(pvc) {
        return None;
    }
    let endpoint = annotation(pvc, ENDPOINT).map(str::trim);
    let source = annotation(pvc, SOURCE).map(str::trim);
    if annotation(pvc, UPLOAD_TARGET).is_some() {
        return Some(Err(format!(
            "annotation {UPLOAD_TARGET}: uploads into an annotated claim are not supported; \
             upload into a DataVolume with `source: {{upload: {{}}}}` instead"
        )));
    }
    if endpoint.is_none() && source.is_none() {
        return None;
    }
    Some(spec_of(
        endpoint,
        source,
        annotation(pvc, SECRET),
        annotation(pvc, CERT_CONFIG_MAP),
        annotation(pvc, CONTENT_TYPE),
    ))
}

fn spec_of(
    endpoint: Option<&str>,
    source: Option<&str>,
    secret: Option<&str>,
    cert_config_map: Option<&str>,
    content_type: Option<&str>,
) -> Result<DataVolumeSpec, String> {
    match content_type.map(str::trim) {
        None | Some("") | Some("kubevirt") => {}
        Some("archive") => {
            return Err(format!(
                "annotation {CONTENT_TYPE}: \"archive\" (a tar archive unpacked onto a \
                 filesystem) is not supported; only \"kubevirt\" disk images are"
            ));
        }
        Some(other) => {
            return Err(format!(
                "annotation {CONTENT_TYPE}: unknown content type {other:?} (kubevirt or archive)"
            ));
        }
    }
    let secret = secret.map(str::to_string).filter(|s| !s.is_empty());
    let cert_config_map = cert_config_map
        .map(str::to_string)
        .filter(|s| !s.is_empty());
    let endpoint = endpoint.filter(|e| !e.is_empty());
    let need_endpoint = |kind: &str| {
        endpoint.map(str::to_string).ok_or_else(|| {
            format!("annotation {ENDPOINT} is required for the {kind} source ({SOURCE})")
        })
    };
    let src = match source.unwrap_or("http") {
        "http" | "" => DataVolumeSource {
            http: Some(HttpSource {
                url: need_endpoint("http")?,
                secret_ref: secret,
                cert_config_map,
                ..Default::default()
            }),
            ..Default::default()
        },
        "registry" => DataVolumeSource {
            registry: Some(RegistrySource {
                url: Some(need_endpoint("registry")?),
                secret_ref: secret,
                cert_config_map,
                ..Default::default()
            }),
            ..Default::default()
        },
        "none" => DataVolumeSource {
            blank: Some(Empty::default()),
            ..Default::default()
        },
        other => {
            return Err(format!(
                "annotation {SOURCE}: source {other:?} is not supported (http, registry or none)"
            ));
        }
    };
    Ok(DataVolumeSpec {
        source: Some(src),
        content_type: Some("kubevirt".into()),
        ..Default::default()
    })
}

/// What the claim of a population at `stage` reports (pure), as CDI's importer and cloner
/// report on their claims.
pub fn annotations_for(stage: &Stage, restarts: i32, clone: bool) -> BTreeMap<String, String> {
    let (phase, running, reason, message) = match stage {
        Stage::ClaimPending { message } => ("Pending", false, "Pending", message.clone()),
        Stage::WaitForFirstConsumer => (
            "Pending",
            false,
            "WaitForFirstConsumer",
            "waiting for the first consumer to be scheduled".into(),
        ),
        Stage::Scheduled { .. } => ("Pending", false, "Pending", String::new()),
        Stage::UploadReady => ("Running", true, "Pod is running", String::new()),
        Stage::InProgress { .. } => ("Running", true, "Pod is running", String::new()),
        Stage::Succeeded => (
            "Succeeded",
            false,
            "Completed",
            if clone {
                "Clone Complete".into()
            } else {
                "Import Complete".into()
            },
        ),
        Stage::Failed { reason, message } => (
            "Failed",
            false,
            if reason.is_empty() {
                "Error"
            } else {
                reason.as_str()
            },
            message.clone(),
        ),
    };
    BTreeMap::from([
        (POD_PHASE.to_string(), phase.to_string()),
        (POD_READY.to_string(), running.to_string()),
        (POD_RESTARTS.to_string(), restarts.to_string()),
        (RUNNING.to_string(), running.to_string()),
        (RUNNING_REASON.to_string(), reason.to_string()),
        (RUNNING_MESSAGE.to_string(), message),
    ])
}

/// The annotations of `desired` that `current` lacks or holds with another value.
pub fn changed(
    current: Option<&BTreeMap<String, String>>,
    desired: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    desired
        .iter()
        .filter(|(k, v)| current.and_then(|c| c.get(*k)) != Some(*v))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Writes the changed status annotations onto the claim; false when the claim is gone.
pub(super) async fn report(
    client: &kube::Client,
    ns: &str,
    name: &str,
    changes: &BTreeMap<String, String>,
) -> Result<bool, ControllerError> {
    if changes.is_empty() {
        return Ok(true);
    }
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let patch = json!({"metadata": {"annotations": changes}});
    match api
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Reconciles one claim: an annotated claim that no DataVolume owns is imported into.
pub(super) async fn reconcile(
    pvc: Arc<PersistentVolumeClaim>,
    ctx: Arc<Ctx>,
) -> Result<Action, ControllerError> {
    let uid = pvc.metadata.uid.clone().unwrap_or_default();
    if pvc.metadata.deletion_timestamp.is_some() {
        ctx.forget(&uid);
        return Ok(Action::await_change());
    }
    let Some(request) = requested_spec(&pvc) else {
        return Ok(Action::await_change());
    };
    let phase = annotation(&pvc, POD_PHASE);
    if phase == Some("Succeeded") || (phase == Some("Failed") && !ctx.has_job(&uid)) {
        return Ok(Action::await_change());
    }
    let name = pvc.metadata.name.clone().unwrap_or_default();
    let ns = pvc
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let restarts = annotation(&pvc, POD_RESTARTS)
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    // The claim stands in for the DataVolume CDI would make of it: same name, namespace
    // and uid (the job's key), its annotations (e.g. `ferrovirt.io/checksum`).
    let dv = DataVolume {
        api_version: Some(super::resources::CDI_API_VERSION.into()),
        kind: Some("DataVolume".into()),
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(ns.clone()),
            uid: Some(uid.clone()),
            annotations: pvc.metadata.annotations.clone(),
            ..Default::default()
        },
        spec: request.as_ref().ok().cloned(),
        status: None,
    };
    let subject = Subject {
        dv: &dv,
        reference: object_ref("v1", "PersistentVolumeClaim", &pvc.metadata),
    };
    let invalid = |message: String| {
        let stage = Stage::Failed {
            reason: "InvalidSource".into(),
            message,
        };
        Outcome::new(stage, restarts, Duration::from_secs(300))
    };
    let out = match request.and_then(|spec| dvd::source_kind(&spec, &ns)) {
        Err(message) => {
            subject
                .event_once(&ctx, true, "ErrInvalidSource", &message)
                .await;
            invalid(message)
        }
        Ok(source) => {
            let bound = pvc.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
            if bound {
                populate(&ctx, &subject, &pvc, &source, restarts).await?
            } else {
                let stage = unbound_stage(&ctx, &pvc).await?;
                Outcome::new(stage, restarts, Duration::from_secs(1))
            }
        }
    };
    let desired = annotations_for(&out.stage, out.restarts, false);
    let changes = changed(pvc.metadata.annotations.as_ref(), &desired);
    if !report(&ctx.client, &ns, &name, &changes).await? {
        ctx.drop_job(&uid);
        return Ok(Action::await_change());
    }
    Ok(out.requeue)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pvc(annotations: serde_json::Value, owner: Option<&str>) -> PersistentVolumeClaim {
        let owners =
            owner.map(|k| json!([{"apiVersion": "x/v1", "kind": k, "name": "o", "uid": "u"}]));
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns", "annotations": annotations,
                         "ownerReferences": owners},
        }))
        .unwrap()
    }

    #[test]
    fn annotated_claims_ask_for_imports() {
        let http = requested_spec(&pvc(
            json!({ENDPOINT: "https://h/disk.qcow2", SECRET: "s", CERT_CONFIG_MAP: "ca"}),
            None,
        ))
        .unwrap()
        .unwrap();
        let h = http.source.unwrap().http.unwrap();
        assert_eq!(h.url, "https://h/disk.qcow2");
        assert_eq!(h.secret_ref.as_deref(), Some("s"));
        assert_eq!(h.cert_config_map.as_deref(), Some("ca"));

        let reg = requested_spec(&pvc(
            json!({ENDPOINT: "docker://r/img:1", SOURCE: "registry"}),
            None,
        ))
        .unwrap()
        .unwrap();
        assert_eq!(
            reg.source.unwrap().registry.unwrap().url.as_deref(),
            Some("docker://r/img:1")
        );
        let blank = requested_spec(&pvc(json!({SOURCE: "none"}), None))
            .unwrap()
            .unwrap();
        assert!(blank.source.unwrap().blank.is_some());
    }

    #[test]
    fn other_claims_are_left_alone_and_bad_ones_are_refused_by_name() {
        assert!(requested_spec(&pvc(json!({}), None)).is_none());
        assert!(requested_spec(&pvc(json!({"other": "x"}), None)).is_none());
        // A DataVolume's claim is the DataVolume loop's.
        assert!(
            requested_spec(&pvc(json!({ENDPOINT: "http://h/d"}), Some("DataVolume"))).is_none()
        );
        let err = |a| requested_spec(&pvc(a, None)).unwrap().unwrap_err();
        assert!(
            err(json!({SOURCE: "s3", ENDPOINT: "s3://b/k"}))
                .starts_with(&format!("annotation {SOURCE}"))
        );
        assert!(err(json!({SOURCE: "registry"})).starts_with(&format!("annotation {ENDPOINT}")));
        assert!(
            err(json!({ENDPOINT: "http://h/d", CONTENT_TYPE: "archive"}))
                .starts_with(&format!("annotation {CONTENT_TYPE}"))
        );
        assert!(err(json!({ENDPOINT: ""})).contains(ENDPOINT));
        assert!(
            err(json!({UPLOAD_TARGET: ""})).starts_with(&format!("annotation {UPLOAD_TARGET}"))
        );
    }

    #[test]
    fn stages_report_as_cdi_does() {
        let done = annotations_for(&Stage::Succeeded, 1, false);
        assert_eq!(done[POD_PHASE], "Succeeded");
        assert_eq!(done[RUNNING], "false");
        assert_eq!(done[RUNNING_REASON], "Completed");
        assert_eq!(done[RUNNING_MESSAGE], "Import Complete");
        assert_eq!(done[POD_RESTARTS], "1");
        assert_eq!(
            annotations_for(&Stage::Succeeded, 0, true)[RUNNING_MESSAGE],
            "Clone Complete"
        );
        let run = annotations_for(
            &Stage::InProgress {
                clone: false,
                progress: Some(3.0),
            },
            0,
            false,
        );
        assert_eq!(
            (run[POD_PHASE].as_str(), run[RUNNING].as_str()),
            ("Running", "true")
        );
        let failed = annotations_for(
            &Stage::Failed {
                reason: "Error".into(),
                message: "checksum mismatch".into(),
            },
            2,
            false,
        );
        assert_eq!(failed[POD_PHASE], "Failed");
        assert_eq!(failed[RUNNING_MESSAGE], "checksum mismatch");
        let pending = annotations_for(&Stage::Scheduled { clone: false }, 0, false);
        assert_eq!(pending[POD_PHASE], "Pending");
    }

    #[test]
    fn only_changed_annotations_are_written() {
        let desired = annotations_for(&Stage::Succeeded, 0, false);
        assert_eq!(changed(None, &desired), desired);
        assert!(changed(Some(&desired), &desired).is_empty());
        let mut current = desired.clone();
        current.insert(POD_PHASE.into(), "Running".into());
        current.insert("unrelated".into(), "x".into());
        assert_eq!(
            changed(Some(&current), &desired),
            BTreeMap::from([(POD_PHASE.to_string(), "Succeeded".to_string())])
        );
    }
}
