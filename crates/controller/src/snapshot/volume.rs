//! VolumeSnapshots of claims, the Kubernetes way, implemented by ferrovirt's provisioners:
//! [`decide`] (pure) turns a VolumeSnapshot, its VolumeSnapshotContent and the claim's volume
//! into the next thing to do; [`take`] freezes the volume's top layer where its bytes are (the
//! node's agent for `local` volumes, the server for `shared` ones: constant time, see
//! `ferrovirt_storage::snapshot`); [`populate_claim`] fills a newly provisioned claim whose
//! `dataSource`/`dataSourceRef` is a VolumeSnapshot from the snapshot's layers.
//!
//! Contents are named `snapcontent-<snapshot uid>`, carry `spec.source.volumeHandle` (the PV),
//! `status.snapshotHandle` `<pv>/<frozen layer>`, and are owned by their VolumeSnapshot when
//! the deletion policy is `Delete` (so garbage collection removes them with it). Restoring
//! across nodes is refused: a `local` snapshot is restored on its volume's node.

use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use ferrovirt_api::volumesnapshot::{
    API_VERSION, DRIVER, SHARED_DRIVER, VolumeSnapshot, VolumeSnapshotClass, VolumeSnapshotContent,
    VolumeSnapshotContentSource, VolumeSnapshotContentSpec, VolumeSnapshotStatus,
};

use crate::storage::classes::{PROVISIONER_LOCAL, PROVISIONER_SHARED};
use crate::storage::nodes::{Placement, placement};
use crate::storage::pvc::PROVISIONED_BY;

/// The VolumeSnapshotClasses the controllers create (one per built-in driver, the `local` one
/// the default), named in the StorageProfiles' `snapshotClass`.
pub const LOCAL_CLASS: &str = "ferrovirt-local";
pub const SHARED_CLASS: &str = "ferrovirt-shared";

/// The content name of a dynamically taken snapshot.
pub fn content_name(vs: &VolumeSnapshot) -> String {
    format!(
        "snapcontent-{}",
        vs.metadata.uid.as_deref().unwrap_or("unknown")
    )
}

/// What to do next for a VolumeSnapshot.
#[derive(Debug, Clone, PartialEq)]
pub enum VsDecision {
    /// Ready (or being deleted): nothing.
    Nothing,
    /// Cannot go on now; the error to show (retried).
    Error(String),
    /// Create the (not yet taken) content.
    CreateContent(Box<VolumeSnapshotContent>),
    /// Take the snapshot of the volume at `placement`, then record it in content `content`.
    Take { content: String, at: Placement },
    /// The content is ready: copy its facts into the snapshot's status.
    Bind(Box<VolumeSnapshotStatus>),
}

/// What a VolumeSnapshot sees.
pub struct VsInput<'a> {
    pub vs: &'a VolumeSnapshot,
    /// The content named by the snapshot (bound, pre-provisioned or [`content_name`]).
    pub content: Option<&'a VolumeSnapshotContent>,
    pub pvc: Option<&'a PersistentVolumeClaim>,
    pub pv: Option<&'a PersistentVolume>,
    /// The claim is in use by a VMI that has not finished: its QEMU writes the top layer.
    pub in_use_by: Option<String>,
    /// The VolumeSnapshotClasses.
    pub classes: &'a [VolumeSnapshotClass],
}

/// The class a snapshot of `driver` uses: the one named, else the driver's default (or only)
/// class; `Err` says why none fits.
pub fn class_for<'a>(
    named: Option<&str>,
    driver: &str,
    classes: &'a [VolumeSnapshotClass],
) -> Result<Option<&'a VolumeSnapshotClass>, String> {
    if let Some(n) = named {
        let c = classes
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(n))
            .ok_or_else(|| format!("VolumeSnapshotClass {n} does not exist"))?;
        if c.driver != driver {
            return Err(format!(
                "VolumeSnapshotClass {n} is of driver {}, the volume's is {driver}",
                c.driver
            ));
        }
        return Ok(Some(c));
    }
    let of_driver: Vec<&VolumeSnapshotClass> =
        classes.iter().filter(|c| c.driver == driver).collect();
    let default = of_driver.iter().find(|c| {
        c.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ferrovirt_api::volumesnapshot::DEFAULT_CLASS_ANNOTATION))
            .is_some_and(|v| v == "true")
    });
    Ok(default.copied().or(of_driver.first().copied()))
}

pub(crate) fn driver_of(pv: &PersistentVolume) -> Option<&'static str> {
    let by = pv.metadata.annotations.as_ref()?.get(PROVISIONED_BY)?;
    if by == PROVISIONER_LOCAL {
        Some(DRIVER)
    } else if by == PROVISIONER_SHARED {
        Some(SHARED_DRIVER)
    } else {
        None
    }
}

fn content_ready(c: &VolumeSnapshotContent) -> bool {
    c.status
        .as_ref()
        .and_then(|s| s.ready_to_use)
        .unwrap_or(false)
}

/// The snapshot's status from its ready content.
pub fn bound_status(content: &VolumeSnapshotContent) -> VolumeSnapshotStatus {
    let st = content.status.clone().unwrap_or_default();
    VolumeSnapshotStatus {
        bound_volume_snapshot_content_name: content.metadata.name.clone(),
        creation_time: st.creation_time.and_then(|ns| {
            k8s_openapi::jiff::Timestamp::from_nanosecond(ns as i128)
                .ok()
                .map(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time)
        }),
        ready_to_use: Some(true),
        restore_size: st.restore_size.map(|b| b.to_string()),
        error: None,
    }
}

/// Decide the next step of a VolumeSnapshot.
pub fn decide(input: &VsInput<'_>) -> VsDecision {
    let vs = input.vs;
    if vs.metadata.deletion_timestamp.is_some() {
        return VsDecision::Nothing;
    }
    let spec = vs.spec.clone().unwrap_or_default();
    if let Some(c) = input.content
        && content_ready(c)
    {
        let want = bound_status(c);
        let have = vs.status.clone().unwrap_or_default();
        return if have.ready_to_use == Some(true)
            && have.bound_volume_snapshot_content_name == want.bound_volume_snapshot_content_name
        {
            VsDecision::Nothing
        } else {
            VsDecision::Bind(Box::new(want))
        };
    }
    if let Some(pre) = spec.source.volume_snapshot_content_name.as_deref() {
        return match input.content {
            None => VsDecision::Error(format!("VolumeSnapshotContent {pre} does not exist")),
            Some(_) => VsDecision::Error(format!("VolumeSnapshotContent {pre} is not ready")),
        };
    }
    let claim = spec
        .source
        .persistent_volume_claim_name
        .clone()
        .unwrap_or_default();
    let Some(pvc) = input.pvc else {
        return VsDecision::Error(format!("PersistentVolumeClaim {claim} does not exist"));
    };
    let bound = pvc.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
    let (true, Some(pv)) = (bound, input.pv) else {
        return VsDecision::Error(format!("PersistentVolumeClaim {claim} is not bound yet"));
    };
    let Some(driver) = driver_of(pv) else {
        return VsDecision::Error(format!(
            "the volume of claim {claim} was not made by a ferrovirt provisioner; it cannot be snapshotted"
        ));
    };
    if pvc.spec.as_ref().and_then(|s| s.volume_mode.as_deref()) == Some("Block") {
        return VsDecision::Error(format!(
            "claim {claim} is a Block-mode volume: snapshots of Block volumes are not supported"
        ));
    }
    let at = placement(pv);
    if at == Placement::Unknown {
        return VsDecision::Error(format!("the volume of claim {claim} has no known location"));
    }
    let class = match class_for(
        spec.volume_snapshot_class_name.as_deref(),
        driver,
        input.classes,
    ) {
        Ok(c) => c,
        Err(e) => return VsDecision::Error(e),
    };
    let Some(content) = input.content else {
        // The class's deletion policy (Delete when there is no class).
        let policy = class
            .map(|c| c.deletion_policy.clone())
            .unwrap_or_else(|| "Delete".into());
        let delete = policy != "Retain";
        return VsDecision::CreateContent(Box::new(VolumeSnapshotContent {
            api_version: Some(API_VERSION.into()),
            kind: Some("VolumeSnapshotContent".into()),
            metadata: ObjectMeta {
                name: Some(content_name(vs)),
                owner_references: delete.then(|| {
                    vec![OwnerReference {
                        api_version: API_VERSION.into(),
                        kind: "VolumeSnapshot".into(),
                        name: vs.metadata.name.clone().unwrap_or_default(),
                        uid: vs.metadata.uid.clone().unwrap_or_default(),
                        controller: Some(true),
                        block_owner_deletion: Some(true),
                    }]
                }),
                ..Default::default()
            },
            spec: Some(VolumeSnapshotContentSpec {
                volume_snapshot_ref: ObjectReference {
                    api_version: Some(API_VERSION.into()),
                    kind: Some("VolumeSnapshot".into()),
                    name: vs.metadata.name.clone(),
                    namespace: vs.metadata.namespace.clone(),
                    uid: vs.metadata.uid.clone(),
                    ..Default::default()
                },
                deletion_policy: policy,
                driver: driver.into(),
                volume_snapshot_class_name: class.and_then(|c| c.metadata.name.clone()),
                source: VolumeSnapshotContentSource {
                    volume_handle: pv.metadata.name.clone(),
                    snapshot_handle: None,
                },
                source_volume_mode: Some("Filesystem".into()),
            }),
            status: None,
        }));
    };
    if let Some(vmi) = &input.in_use_by {
        return VsDecision::Error(format!(
            "claim {claim} is in use by the running VMI {vmi}: online volume snapshots are not supported yet"
        ));
    }
    VsDecision::Take {
        content: content.metadata.name.clone().unwrap_or_default(),
        at,
    }
}

/// The VolumeSnapshot a claim is to be restored from (`dataSourceRef`, else `dataSource`, of
/// kind VolumeSnapshot in group snapshot.storage.k8s.io).
pub fn snapshot_source(pvc: &PersistentVolumeClaim) -> Option<String> {
    let spec = pvc.spec.as_ref()?;
    let is_vs = |group: Option<&str>, kind: &str| {
        kind == "VolumeSnapshot" && group == Some("snapshot.storage.k8s.io")
    };
    if let Some(r) = &spec.data_source_ref
        && is_vs(r.api_group.as_deref(), &r.kind)
    {
        return Some(r.name.clone());
    }
    spec.data_source
        .as_ref()
        .filter(|r| is_vs(r.api_group.as_deref(), &r.kind))
        .map(|r| r.name.clone())
}

/// Split a content's `snapshotHandle` `<pv>/<layer>`.
pub fn split_handle(handle: &str) -> Option<(&str, &str)> {
    let (pv, layer) = handle.split_once('/')?;
    (!pv.is_empty() && !layer.is_empty() && !layer.contains('/')).then_some((pv, layer))
}

#[cfg(test)]
#[path = "volume_tests.rs"]
mod tests;
