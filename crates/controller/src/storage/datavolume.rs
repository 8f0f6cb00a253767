//! The pure part of the DataVolume controller: the PVC a DataVolume asks for (`pvc:` as
//! given, `storage:` completed from the class's StorageProfile), the DataVolumes a VM's
//! `dataVolumeTemplates` stand for, and the DataVolume status (phase, progress, Bound/Ready/
//! Running conditions) for a [`Stage`] of its population.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, PersistentVolumeClaimSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};

use ferrovirt_api::cdi::{
    CdiCondition, DataVolume, DataVolumeSpec, DataVolumeStatus, StorageProfileStatus, dv_phase,
};
use ferrovirt_api::kubevirt::vm::VirtualMachine;

use super::resources::CDI_API_VERSION;

/// Annotation on a DataVolume's PVC naming the DataVolume it is populated for.
pub const POPULATED_FOR: &str = "cdi.kubevirt.io/storage.populatedFor";
/// Annotation on a DataVolume with the expected checksum of an HTTP source
/// (`sha256:<hex>`), until `spec.source.http.checksum` is part of the API types.
pub const CHECKSUM_ANNOTATION: &str = "ferrovirt.io/checksum";

/// What a DataVolume is populated from (the sources ferrovirt implements).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceKind {
    Http,
    Blank,
    /// Filled through the upload endpoint ([`super::upload_api`]).
    Upload,
    /// An image from an OCI registry ([`super::registry_import`]).
    Registry,
    /// Clone of the PVC `namespace/name`.
    Pvc {
        namespace: String,
        name: String,
    },
}

/// Why a DataVolume with `contentType: archive` fails: CDI extracts a tar archive into a
/// Filesystem-mode claim, and every ferrovirt volume is a disk image (docs/storage.md), so the
/// import is refused instead of writing the archive's bytes as a disk.
pub const ARCHIVE_REFUSED: &str = "spec.contentType: \"archive\" (a tar archive extracted into a \
     filesystem volume) is not supported: every ferrovirt volume is a disk image; use \
     contentType \"kubevirt\" (the default) with a disk image source";

/// The source of `spec`, or why it is not supported.
pub fn source_kind(spec: &DataVolumeSpec, dv_namespace: &str) -> Result<SourceKind, String> {
    let Some(src) = &spec.source else {
        return Err(if spec.source_ref.is_some() {
            "sourceRef (DataSource) is not supported yet".into()
        } else {
            "spec.source is required".into()
        });
    };
    if spec.content_type.as_deref() == Some("archive") {
        return Err(ARCHIVE_REFUSED.into());
    }
    let kinds = src.kinds();
    if kinds.len() != 1 {
        return Err(format!(
            "exactly one source must be set, got {}",
            if kinds.is_empty() {
                "none".to_string()
            } else {
                kinds.join(", ")
            }
        ));
    }
    if src.http.is_some() {
        Ok(SourceKind::Http)
    } else if src.blank.is_some() {
        Ok(SourceKind::Blank)
    } else if src.upload.is_some() {
        Ok(SourceKind::Upload)
    } else if src.registry.is_some() {
        Ok(SourceKind::Registry)
    } else if let Some(p) = &src.pvc {
        Ok(SourceKind::Pvc {
            namespace: p.namespace.clone().unwrap_or_else(|| dv_namespace.into()),
            name: p.name.clone(),
        })
    } else {
        Err(format!("source {} is not supported yet", kinds[0]))
    }
}

/// The claim spec of a DataVolume. `pvc:` is taken as given; `storage:` gets its class (or
/// `default_class`), access modes and volume mode from `profile` when unset, and its size
/// from `source_size` (a clone source) when unset. ferrovirt volumes are raw files of exactly
/// the claim's size, so no filesystem overhead is added.
pub fn claim_spec(
    spec: &DataVolumeSpec,
    profile: Option<&StorageProfileStatus>,
    default_class: Option<&str>,
    source_size: Option<&Quantity>,
) -> Result<PersistentVolumeClaimSpec, String> {
    if let Some(pvc) = &spec.pvc {
        if spec.storage.is_some() {
            return Err("only one of spec.pvc and spec.storage may be set".into());
        }
        return Ok(pvc.clone());
    }
    let Some(st) = &spec.storage else {
        return Err("one of spec.pvc or spec.storage is required".into());
    };
    let class = st
        .storage_class_name
        .clone()
        .or_else(|| default_class.map(Into::into))
        .ok_or("spec.storage has no storageClassName and there is no default StorageClass")?;
    let first_set = profile
        .and_then(|p| p.claim_property_sets.as_ref())
        .and_then(|s| s.first());
    let access_modes = st
        .access_modes
        .clone()
        .filter(|m| !m.is_empty())
        .or_else(|| first_set.and_then(|s| s.access_modes.clone()))
        .ok_or_else(|| {
            format!("spec.storage.accessModes is unset and StorageProfile {class} has no claimPropertySets")
        })?;
    let volume_mode = st
        .volume_mode
        .clone()
        .or_else(|| first_set.and_then(|s| s.volume_mode.clone()))
        .unwrap_or_else(|| "Filesystem".into());
    let mut resources = st.resources.clone().unwrap_or_default();
    let requests = resources.requests.get_or_insert_with(BTreeMap::new);
    if !requests.contains_key("storage") {
        let size = source_size.ok_or("spec.storage.resources.requests.storage is required")?;
        requests.insert("storage".into(), size.clone());
    }
    Ok(PersistentVolumeClaimSpec {
        access_modes: Some(access_modes),
        resources: Some(resources),
        storage_class_name: Some(class),
        volume_mode: Some(volume_mode),
        volume_name: st.volume_name.clone(),
        selector: st.selector.clone(),
        data_source: st.data_source.clone(),
        data_source_ref: st.data_source_ref.clone(),
        ..Default::default()
    })
}

/// The PVC of a DataVolume: same name and namespace, controlled by the DataVolume. A
/// `volume.kubernetes.io/selected-node` annotation on the DataVolume is passed on, so a
/// node-local volume can be placed on a chosen node.
pub fn claim_for(dv: &DataVolume, spec: PersistentVolumeClaimSpec) -> PersistentVolumeClaim {
    let name = dv.metadata.name.clone().unwrap_or_default();
    let mut labels = dv.metadata.labels.clone().unwrap_or_default();
    labels.insert("app".into(), "containerized-data-importer".into());
    let mut annotations = BTreeMap::from([(POPULATED_FOR.to_string(), name.clone())]);
    if let Some(node) = dv
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(super::pvc::SELECTED_NODE))
    {
        annotations.insert(super::pvc::SELECTED_NODE.to_string(), node.clone());
    }
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: dv.metadata.namespace.clone(),
            labels: Some(labels),
            annotations: Some(annotations),
            owner_references: Some(vec![OwnerReference {
                api_version: CDI_API_VERSION.into(),
                kind: "DataVolume".into(),
                name,
                uid: dv.metadata.uid.clone().unwrap_or_default(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            }]),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    }
}

/// The DataVolumes a VM's `dataVolumeTemplates` stand for, owned by the VM.
pub fn from_templates(vm: &VirtualMachine) -> Vec<DataVolume> {
    let ns = vm.metadata.namespace.clone();
    let owner = OwnerReference {
        api_version: "kubevirt.io/v1".into(),
        kind: "VirtualMachine".into(),
        name: vm.metadata.name.clone().unwrap_or_default(),
        uid: vm.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    };
    vm.spec
        .as_ref()
        .and_then(|s| s.data_volume_templates.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|t| {
            let meta = t.metadata.clone().unwrap_or_default();
            meta.name.as_ref()?;
            Some(DataVolume {
                api_version: Some(CDI_API_VERSION.into()),
                kind: Some("DataVolume".into()),
                metadata: ObjectMeta {
                    name: meta.name,
                    namespace: ns.clone(),
                    labels: meta.labels,
                    annotations: meta.annotations,
                    owner_references: Some(vec![owner.clone()]),
                    ..Default::default()
                },
                spec: Some(t.spec.clone()),
                status: None,
            })
        })
        .collect()
}

/// How far a DataVolume's population is.
#[derive(Debug, Clone, PartialEq)]
pub enum Stage {
    /// The claim is being created or is not bound yet (`message` says why).
    ClaimPending { message: String },
    /// The claim's class binds only once a consumer is scheduled.
    WaitForFirstConsumer,
    /// The claim is bound; the population starts now or after a retry backoff.
    Scheduled { clone: bool },
    /// The claim is bound and waits for an upload (`upload` source).
    UploadReady,
    /// Population running at `progress` percent (if known).
    InProgress { clone: bool, progress: Option<f64> },
    /// Population finished.
    Succeeded,
    /// Population failed for good.
    Failed { reason: String, message: String },
}

/// `45.00%` style progress.
pub fn format_progress(p: f64) -> String {
    format!("{:.2}%", p.clamp(0.0, 100.0))
}

fn set_condition(conds: &mut Vec<CdiCondition>, mut new: CdiCondition, now: &Time) {
    new.last_heartbeat_time = Some(now.clone());
    match conds.iter_mut().find(|c| c.type_ == new.type_) {
        Some(old) => {
            new.last_transition_time = if old.status == new.status {
                old.last_transition_time.clone().or(Some(now.clone()))
            } else {
                Some(now.clone())
            };
            *old = new;
        }
        None => {
            new.last_transition_time = Some(now.clone());
            conds.push(new);
        }
    }
}

fn cond(type_: &str, status: bool, reason: &str, message: &str) -> CdiCondition {
    CdiCondition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        reason: (!reason.is_empty()).then(|| reason.into()),
        message: (!message.is_empty()).then(|| message.into()),
        ..Default::default()
    }
}

/// The status for `stage`, keeping transition times and the restart count of `prev`.
pub fn status_for(
    prev: Option<&DataVolumeStatus>,
    claim: &str,
    stage: &Stage,
    restarts: i32,
    now: &Time,
) -> DataVolumeStatus {
    let bound_msg = format!("PVC {claim} Bound");
    let (phase, progress, bound, ready, running) = match stage {
        Stage::ClaimPending { message } => (
            dv_phase::PENDING,
            "N/A".to_string(),
            cond("Bound", false, "Pending", message),
            cond("Ready", false, "", ""),
            cond("Running", false, "", ""),
        ),
        Stage::WaitForFirstConsumer => (
            dv_phase::WAIT_FOR_FIRST_CONSUMER,
            "N/A".to_string(),
            cond(
                "Bound",
                false,
                "WaitForFirstConsumer",
                &format!("PVC {claim} waits for its first consumer to be scheduled"),
            ),
            cond("Ready", false, "", ""),
            cond("Running", false, "", ""),
        ),
        Stage::Scheduled { clone } => (
            if *clone {
                dv_phase::CLONE_SCHEDULED
            } else {
                dv_phase::IMPORT_SCHEDULED
            },
            "N/A".to_string(),
            cond("Bound", true, "Bound", &bound_msg),
            cond("Ready", false, "", ""),
            cond("Running", false, "Pending", ""),
        ),
        Stage::UploadReady => (
            dv_phase::UPLOAD_READY,
            prev.and_then(|p| p.progress.clone())
                .unwrap_or_else(|| "N/A".into()),
            cond("Bound", true, "Bound", &bound_msg),
            cond("Ready", false, "", ""),
            cond("Running", true, "Pod is running", ""),
        ),
        Stage::InProgress { clone, progress } => (
            if *clone {
                dv_phase::CLONE_IN_PROGRESS
            } else {
                dv_phase::IMPORT_IN_PROGRESS
            },
            progress.map_or_else(|| "N/A".to_string(), format_progress),
            cond("Bound", true, "Bound", &bound_msg),
            cond("Ready", false, "TransferRunning", ""),
            cond("Running", true, "Pod is running", ""),
        ),
        Stage::Succeeded => (
            dv_phase::SUCCEEDED,
            "100.0%".to_string(),
            cond("Bound", true, "Bound", &bound_msg),
            cond("Ready", true, "", ""),
            cond("Running", false, "Completed", ""),
        ),
        Stage::Failed { reason, message } => (
            dv_phase::FAILED,
            prev.and_then(|p| p.progress.clone())
                .unwrap_or_else(|| "N/A".into()),
            cond("Bound", true, "Bound", &bound_msg),
            cond("Ready", false, reason, message),
            cond("Running", false, reason, message),
        ),
    };
    let mut conditions = prev.and_then(|p| p.conditions.clone()).unwrap_or_default();
    for c in [bound, ready, running] {
        set_condition(&mut conditions, c, now);
    }
    DataVolumeStatus {
        claim_name: Some(claim.into()),
        phase: Some(phase.into()),
        progress: Some(progress),
        restart_count: Some(restarts),
        conditions: Some(conditions),
    }
}

/// Whether two statuses differ in more than heartbeat times.
pub fn status_changed(old: Option<&DataVolumeStatus>, new: &DataVolumeStatus) -> bool {
    let strip = |s: &DataVolumeStatus| {
        let mut s = s.clone();
        for c in s.conditions.iter_mut().flatten() {
            c.last_heartbeat_time = None;
        }
        s
    };
    old.map(strip) != Some(strip(new))
}

/// The delay before retry number `attempt` (1-based): `base` doubled per attempt, at most
/// five minutes.
pub fn retry_delay(base: std::time::Duration, attempt: u32) -> std::time::Duration {
    base.saturating_mul(1 << attempt.saturating_sub(1).min(10))
        .min(std::time::Duration::from_secs(300))
}

#[cfg(test)]
#[path = "datavolume_tests.rs"]
mod tests;
