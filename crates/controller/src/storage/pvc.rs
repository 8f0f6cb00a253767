//! The pure part of the PersistentVolumeClaim controller: [`decide`] what to do with a claim
//! (bind it to the PV it names or that matches it, provision a PV for it in a built-in class,
//! or wait for its first consumer), [`build_pv`] the PersistentVolume of a provisioned
//! volume, and [`reclaim`] what to do with a PV whose claim is gone.
//!
//! WaitForFirstConsumer: a claim of such a class is provisioned once it carries the
//! `volume.kubernetes.io/selected-node` annotation. The PVC controller sets it from the node
//! of the first scheduled VMI that uses the claim; the DataVolume controller sets it itself
//! (see `docs/storage.md`).

use std::collections::BTreeMap;
use std::path::Path;

use k8s_openapi::api::core::v1::{
    HostPathVolumeSource, LocalVolumeSource, NodeSelector, NodeSelectorRequirement,
    NodeSelectorTerm, ObjectReference, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeSpec, VolumeNodeAffinity,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::classes::{self, Builtin};

/// The node a WaitForFirstConsumer claim is provisioned for.
pub const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
/// Which provisioner created a PV.
pub const PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";
/// Set on a claim once it is bound.
pub const BIND_COMPLETED: &str = "pv.kubernetes.io/bind-completed";
/// Label of the node a local PV lives on (used in its nodeAffinity).
pub const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";

/// What to do with a claim.
#[derive(Debug, Clone, PartialEq)]
pub enum PvcDecision {
    /// Bound already, or not ours to handle.
    Nothing,
    /// Bind the claim and the PV `pv` to each other.
    Bind { pv: String },
    /// Provision a volume for the claim, then bind it.
    Provision(Box<ProvisionPlan>),
    /// The class binds at first consumer and none is scheduled yet.
    WaitForFirstConsumer,
    /// Cannot bind now; `message` says why.
    Pending { reason: String, message: String },
}

/// A volume to provision.
#[derive(Debug, Clone, PartialEq)]
pub struct ProvisionPlan {
    /// `pvc-<claim uid>`.
    pub pv_name: String,
    pub builtin: Builtin,
    pub class: String,
    /// The node of a local volume.
    pub node: Option<String>,
    /// The shared filesystem of a class that declares one: the volume goes to
    /// `<mount>/volumes/<pv>`, after the mount's marker is written.
    pub shared_mount: Option<classes::DeclaredMount>,
    pub size: Quantity,
    pub bytes: u64,
    pub access_modes: Vec<String>,
    pub volume_mode: String,
    pub reclaim_policy: String,
}

/// Bytes of a quantity like `1Gi`.
pub fn quantity_bytes(q: &Quantity) -> Result<u64, String> {
    let v = ferrovirt_api::quantity::bytes(&q.0).map_err(|e| format!("{}: {e}", q.0))?;
    if !(1..=1u64 << 50).contains(&v) {
        return Err(format!("{} is out of range", q.0));
    }
    Ok(v)
}

fn requested(pvc: &PersistentVolumeClaim) -> Option<&Quantity> {
    pvc.spec
        .as_ref()?
        .resources
        .as_ref()?
        .requests
        .as_ref()?
        .get("storage")
}

fn is_bound(pvc: &PersistentVolumeClaim) -> bool {
    pvc.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
}

/// Whether `pv.spec.claimRef` names this claim (by uid when both have one).
pub fn claimed_by(pv: &PersistentVolume, pvc: &PersistentVolumeClaim) -> bool {
    let Some(r) = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref()) else {
        return false;
    };
    let same_name = r.name == pvc.metadata.name
        && r.namespace.as_deref().unwrap_or("default")
            == pvc.metadata.namespace.as_deref().unwrap_or("default");
    same_name
        && match (&r.uid, &pvc.metadata.uid) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        }
}

fn pv_capacity(pv: &PersistentVolume) -> Option<u64> {
    pv.spec
        .as_ref()?
        .capacity
        .as_ref()?
        .get("storage")
        .and_then(|q| quantity_bytes(q).ok())
}

/// The class a claim asks for: its `storageClassName`, or the default class when unset.
pub fn claim_class<'a>(
    pvc: &'a PersistentVolumeClaim,
    classes: &'a [StorageClass],
) -> Option<&'a str> {
    match pvc
        .spec
        .as_ref()
        .and_then(|s| s.storage_class_name.as_deref())
    {
        Some(c) => Some(c),
        None => classes::default_class(classes).and_then(|c| c.metadata.name.as_deref()),
    }
}

/// An Available PV that satisfies the claim statically (class, size, access modes), smallest
/// first.
fn static_match<'a>(
    pvc: &PersistentVolumeClaim,
    class: Option<&str>,
    need: u64,
    pvs: &'a [PersistentVolume],
) -> Option<&'a PersistentVolume> {
    let modes = pvc
        .spec
        .as_ref()
        .and_then(|s| s.access_modes.clone())
        .unwrap_or_default();
    pvs.iter()
        .filter(|pv| {
            let spec = pv.spec.clone().unwrap_or_default();
            spec.claim_ref.is_none()
                && pv.metadata.deletion_timestamp.is_none()
                && spec.storage_class_name.as_deref().unwrap_or("") == class.unwrap_or("")
                && pv_capacity(pv).is_some_and(|c| c >= need)
                && modes
                    .iter()
                    .all(|m| spec.access_modes.iter().flatten().any(|pm| pm == m))
        })
        .min_by_key(|pv| pv_capacity(pv))
}

/// Decide what to do with `pvc` given all PVs and StorageClasses.
pub fn decide(
    pvc: &PersistentVolumeClaim,
    pvs: &[PersistentVolume],
    classes: &[StorageClass],
) -> PvcDecision {
    if pvc.metadata.deletion_timestamp.is_some() {
        return PvcDecision::Nothing;
    }
    let spec = pvc.spec.clone().unwrap_or_default();
    let pending = |reason: &str, message: String| PvcDecision::Pending {
        reason: reason.into(),
        message,
    };
    if let Some(name) = &spec.volume_name {
        let Some(pv) = pvs.iter().find(|p| p.metadata.name.as_ref() == Some(name)) else {
            return pending("VolumeNotFound", format!("volume {name} does not exist"));
        };
        let pv_bound = pv.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
        let claim_ref = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref());
        if claim_ref.is_some() && !claimed_by(pv, pvc) {
            return pending(
                "VolumeMismatch",
                format!("volume {name} is bound to another claim"),
            );
        }
        if is_bound(pvc) && pv_bound && claim_ref.is_some() {
            return PvcDecision::Nothing;
        }
        return PvcDecision::Bind { pv: name.clone() };
    }
    if let Some(pv) = pvs.iter().find(|pv| claimed_by(pv, pvc)) {
        return PvcDecision::Bind {
            pv: pv.metadata.name.clone().unwrap_or_default(),
        };
    }
    let Some(size) = requested(pvc) else {
        return pending(
            "ProvisioningFailed",
            "spec.resources.requests.storage is required".into(),
        );
    };
    let bytes = match quantity_bytes(size) {
        Ok(b) => b,
        Err(e) => return pending("ProvisioningFailed", e),
    };
    let class_name = claim_class(pvc, classes);
    if let Some(pv) = static_match(pvc, class_name, bytes, pvs) {
        return PvcDecision::Bind {
            pv: pv.metadata.name.clone().unwrap_or_default(),
        };
    }
    let Some(class_name) = class_name.filter(|c| !c.is_empty()) else {
        return pending(
            "FailedBinding",
            "no persistent volumes available for this claim and no storage class is set".into(),
        );
    };
    let Some(class) = classes
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some(class_name))
    else {
        return pending(
            "ProvisioningFailed",
            format!("storageclass.storage.k8s.io \"{class_name}\" not found"),
        );
    };
    let Some(builtin) = Builtin::of(&class.provisioner) else {
        return pending(
            "ExternalProvisioning",
            format!(
                "waiting for a volume to be created by the external provisioner {}",
                class.provisioner
            ),
        );
    };
    let node = pvc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(SELECTED_NODE))
        .cloned();
    if builtin == Builtin::Local && node.is_none() {
        return if classes::waits_for_consumer(class) {
            PvcDecision::WaitForFirstConsumer
        } else {
            pending(
                "ProvisioningFailed",
                "a local volume needs a node: set the volume.kubernetes.io/selected-node annotation".into(),
            )
        };
    }
    if builtin == Builtin::Shared && classes::waits_for_consumer(class) && node.is_none() {
        return PvcDecision::WaitForFirstConsumer;
    }
    let shared_mount = match classes::shared_mount(class) {
        None => None,
        Some(Err(e)) => {
            return pending(
                "ProvisioningFailed",
                format!("StorageClass {class_name:?}: {e}"),
            );
        }
        Some(Ok(mount)) => Some(classes::DeclaredMount {
            class: class_name.into(),
            uid: class.metadata.uid.clone().unwrap_or_default(),
            mount,
        }),
    };
    PvcDecision::Provision(Box::new(ProvisionPlan {
        pv_name: format!("pvc-{}", pvc.metadata.uid.as_deref().unwrap_or("unknown")),
        builtin,
        class: class_name.into(),
        node: if builtin == Builtin::Local {
            node
        } else {
            None
        },
        shared_mount,
        size: size.clone(),
        bytes,
        access_modes: spec
            .access_modes
            .clone()
            .filter(|m| !m.is_empty())
            .unwrap_or_else(|| vec!["ReadWriteOnce".into()]),
        volume_mode: spec
            .volume_mode
            .clone()
            .unwrap_or_else(|| "Filesystem".into()),
        reclaim_policy: class
            .reclaim_policy
            .clone()
            .unwrap_or_else(|| "Delete".into()),
    }))
}

/// The claimRef of a PV bound to `pvc`.
pub fn claim_ref(pvc: &PersistentVolumeClaim) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("PersistentVolumeClaim".into()),
        name: pvc.metadata.name.clone(),
        namespace: pvc.metadata.namespace.clone(),
        uid: pvc.metadata.uid.clone(),
        resource_version: None,
        field_path: None,
    }
}

/// The PersistentVolume of a provisioned volume at `path`, pre-bound to `pvc`.
pub fn build_pv(
    plan: &ProvisionPlan,
    path: &Path,
    pvc: &PersistentVolumeClaim,
) -> PersistentVolume {
    let path = path.to_string_lossy().into_owned();
    let provisioner = match plan.builtin {
        Builtin::Shared => classes::PROVISIONER_SHARED,
        Builtin::Local => classes::PROVISIONER_LOCAL,
    };
    let (host_path, local, node_affinity) = match (&plan.builtin, &plan.node) {
        (Builtin::Local, Some(node)) => (
            None,
            Some(LocalVolumeSource {
                path,
                fs_type: None,
            }),
            Some(VolumeNodeAffinity {
                required: Some(NodeSelector {
                    node_selector_terms: vec![NodeSelectorTerm {
                        match_expressions: Some(vec![NodeSelectorRequirement {
                            key: HOSTNAME_LABEL.into(),
                            operator: "In".into(),
                            values: Some(vec![node.clone()]),
                        }]),
                        match_fields: None,
                    }],
                }),
            }),
        ),
        _ => (
            Some(HostPathVolumeSource {
                path,
                type_: Some("Directory".into()),
            }),
            None,
            None,
        ),
    };
    PersistentVolume {
        metadata: ObjectMeta {
            name: Some(plan.pv_name.clone()),
            annotations: Some(BTreeMap::from([(
                PROVISIONED_BY.to_string(),
                provisioner.to_string(),
            )])),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some(BTreeMap::from([("storage".to_string(), plan.size.clone())])),
            access_modes: Some(plan.access_modes.clone()),
            persistent_volume_reclaim_policy: Some(plan.reclaim_policy.clone()),
            storage_class_name: Some(plan.class.clone()),
            volume_mode: Some(plan.volume_mode.clone()),
            claim_ref: Some(claim_ref(pvc)),
            host_path,
            local,
            node_affinity,
            ..Default::default()
        }),
        status: None,
    }
}

/// What to do with a PV whose claim may be gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reclaim {
    Keep,
    /// Delete the PV; `remove_dir` is the directory to remove with it (volumes ferrovirt
    /// provisioned).
    Delete {
        remove_dir: Option<String>,
    },
    /// Retain: mark the PV Released.
    Release,
}

/// Reclaim decision for `pv`: `claim_uid` is the uid of the claim its claimRef names, `None`
/// when that claim does not exist.
pub fn reclaim(pv: &PersistentVolume, claim_uid: Option<&str>) -> Reclaim {
    let spec = pv.spec.clone().unwrap_or_default();
    let Some(r) = &spec.claim_ref else {
        return Reclaim::Keep;
    };
    let gone = match (claim_uid, r.uid.as_deref()) {
        // Pre-bound by a user to a claim that does not exist yet.
        (None, None) => false,
        (None, Some(_)) => true,
        (Some(actual), Some(want)) => actual != want,
        (Some(_), None) => false,
    };
    if !gone {
        return Reclaim::Keep;
    }
    let phase = pv.status.as_ref().and_then(|s| s.phase.as_deref());
    // A volume already deleted (its pv-protection finalizer holding it while Bound) is done
    // once Released; until then it is reclaimed like any other.
    if pv.metadata.deletion_timestamp.is_some() && phase == Some("Released") {
        return Reclaim::Keep;
    }
    match spec.persistent_volume_reclaim_policy.as_deref() {
        Some("Delete") => {
            let ours = pv
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(PROVISIONED_BY))
                .is_some_and(|p| Builtin::of(p).is_some());
            Reclaim::Delete {
                remove_dir: ours
                    .then(|| {
                        spec.host_path
                            .map(|h| h.path)
                            .or_else(|| spec.local.map(|l| l.path))
                    })
                    .flatten(),
            }
        }
        _ if phase == Some("Released") => Reclaim::Keep,
        _ => Reclaim::Release,
    }
}

#[cfg(test)]
#[path = "pvc_tests.rs"]
mod tests;
