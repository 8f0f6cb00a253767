//! Online VirtualMachineSnapshots (a running VM; docs/snapshots.md "Online snapshots"), the
//! pure parts: what [`super::vm_snapshot::step`] asks for ([`OnlineTake`]: every not yet
//! snapshotted claim of the VM at once, through the VMI's node agent, which has the VMI's
//! launcher switch QEMU to new layers under a guest-agent freeze), and how the result becomes
//! Kubernetes objects: per volume a VolumeSnapshot bound to a pre-provisioned
//! VolumeSnapshotContent whose `snapshotHandle` is the frozen layer (the VolumeSnapshot
//! controller then binds them as any pre-provisioned snapshot), and the snapshot's
//! `indications`/`sourceIndications`.

use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use ferrovirt_api::kubevirt::snapshot::{SourceIndication, VirtualMachineSnapshotContent};
use ferrovirt_api::volumesnapshot::{
    API_VERSION, SHARED_DRIVER, VolumeSnapshot, VolumeSnapshotContent, VolumeSnapshotContentSource,
    VolumeSnapshotContentSpec, VolumeSnapshotSource, VolumeSnapshotSpec,
};

use super::volume::{LOCAL_CLASS, SHARED_CLASS};

/// The longest freeze asked for (the agent caps it too).
pub const MAX_FREEZE: Duration = Duration::from_secs(60);

/// The running VMI of the snapshotted VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveVmi {
    pub uid: String,
    /// `status.nodeName`; `None` while it is not placed yet.
    pub node: Option<String>,
}

/// One claim of an online snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OnlineVolume {
    /// The VM's volume name.
    pub volume: String,
    pub claim: String,
    /// The VolumeSnapshot to create for it.
    pub volume_snapshot: String,
}

/// An online snapshot to take now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OnlineTake {
    pub node: String,
    pub vmi_uid: String,
    pub volumes: Vec<OnlineVolume>,
    /// How long the guest may stay frozen.
    pub freeze_timeout: Duration,
}

/// The freeze bound: [`MAX_FREEZE`], or what is left of the failure deadline when less (at
/// least one second).
pub fn freeze_timeout(left: Option<Duration>) -> Duration {
    left.map_or(MAX_FREEZE, |l| l.min(MAX_FREEZE))
        .max(Duration::from_secs(1))
}

/// A message for each of KubeVirt's indications.
pub fn source_indications(indications: &[String]) -> Vec<SourceIndication> {
    indications
        .iter()
        .map(|i| SourceIndication {
            indication: i.clone(),
            message: Some(
                match i.as_str() {
                    "Online" => "the snapshot was taken while the VM was running",
                    "GuestAgent" => "the guest agent froze the guest's filesystems for the snapshot",
                    "NoGuestAgent" => {
                        "no guest agent answered: the filesystems were not frozen (crash-consistent)"
                    }
                    "QuiesceTimeout" => {
                        "the freeze outlasted its deadline: the filesystems were thawed before the snapshot was complete"
                    }
                    "Paused" => "the VM was paused when the snapshot was taken",
                    other => other,
                }
                .to_string(),
            ),
        })
        .collect()
}

/// The VolumeSnapshot of one online volume: bound to the pre-provisioned content
/// [`content_name`], owned by the VirtualMachineSnapshotContent like an offline one.
pub fn volume_snapshot(
    content: &VirtualMachineSnapshotContent,
    v: &OnlineVolume,
    driver: &str,
) -> VolumeSnapshot {
    VolumeSnapshot {
        api_version: Some(API_VERSION.into()),
        kind: Some("VolumeSnapshot".into()),
        metadata: ObjectMeta {
            name: Some(v.volume_snapshot.clone()),
            namespace: content.metadata.namespace.clone(),
            owner_references: Some(vec![OwnerReference {
                api_version: "snapshot.kubevirt.io/v1beta1".into(),
                kind: "VirtualMachineSnapshotContent".into(),
                name: content.metadata.name.clone().unwrap_or_default(),
                uid: content.metadata.uid.clone().unwrap_or_default(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            }]),
            ..Default::default()
        },
        spec: Some(VolumeSnapshotSpec {
            source: VolumeSnapshotSource {
                persistent_volume_claim_name: None,
                volume_snapshot_content_name: Some(content_name(
                    content.metadata.namespace.as_deref().unwrap_or_default(),
                    &v.volume_snapshot,
                )),
            },
            volume_snapshot_class_name: Some(class_of(driver).into()),
        }),
        status: None,
    }
}

/// The pre-provisioned content of VolumeSnapshot `vs` (of the namespace's snapshot named
/// `vs`): `snapcontent-` and 40 hex digits of a SHA-256 of the namespace and name — contents
/// are cluster-scoped names of at most 63 characters, longer than the VolumeSnapshot's own
/// name allows.
pub fn content_name(namespace: &str, vs: &str) -> String {
    let d = ring::digest::digest(
        &ring::digest::SHA256,
        format!("{namespace}/{vs}").as_bytes(),
    );
    let hex: String = d.as_ref()[..20]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("snapcontent-{hex}")
}

fn class_of(driver: &str) -> &'static str {
    if driver == SHARED_DRIVER {
        SHARED_CLASS
    } else {
        LOCAL_CLASS
    }
}

/// The pre-provisioned content holding the frozen layer `<pv>/<layer>` of VolumeSnapshot `vs`
/// (created after it, owned by it: deleted with it).
pub fn volume_snapshot_content(
    vs: &VolumeSnapshot,
    driver: &str,
    handle: &str,
) -> VolumeSnapshotContent {
    let vs_name = vs.metadata.name.clone().unwrap_or_default();
    let name = vs
        .spec
        .as_ref()
        .and_then(|s| s.source.volume_snapshot_content_name.clone())
        .unwrap_or_else(|| {
            content_name(
                vs.metadata.namespace.as_deref().unwrap_or_default(),
                &vs_name,
            )
        });
    VolumeSnapshotContent {
        api_version: Some(API_VERSION.into()),
        kind: Some("VolumeSnapshotContent".into()),
        metadata: ObjectMeta {
            name: Some(name),
            owner_references: Some(vec![OwnerReference {
                api_version: API_VERSION.into(),
                kind: "VolumeSnapshot".into(),
                name: vs_name.clone(),
                uid: vs.metadata.uid.clone().unwrap_or_default(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            }]),
            ..Default::default()
        },
        spec: Some(VolumeSnapshotContentSpec {
            volume_snapshot_ref: ObjectReference {
                api_version: Some(API_VERSION.into()),
                kind: Some("VolumeSnapshot".into()),
                name: Some(vs_name),
                namespace: vs.metadata.namespace.clone(),
                uid: vs.metadata.uid.clone(),
                ..Default::default()
            },
            deletion_policy: "Delete".into(),
            driver: driver.into(),
            volume_snapshot_class_name: Some(class_of(driver).into()),
            source: VolumeSnapshotContentSource {
                volume_handle: None,
                snapshot_handle: Some(handle.to_string()),
            },
            source_volume_mode: Some("Filesystem".into()),
        }),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrovirt_api::volumesnapshot::DRIVER;
    use serde_json::json;

    #[test]
    fn the_freeze_is_bounded_by_the_deadline_left() {
        assert_eq!(freeze_timeout(None), MAX_FREEZE);
        assert_eq!(
            freeze_timeout(Some(Duration::from_secs(10))),
            Duration::from_secs(10)
        );
        assert_eq!(freeze_timeout(Some(Duration::from_secs(600))), MAX_FREEZE);
        assert_eq!(freeze_timeout(Some(Duration::ZERO)), Duration::from_secs(1));
    }

    #[test]
    fn online_volumes_become_pre_provisioned_snapshots() {
        let content: VirtualMachineSnapshotContent = serde_json::from_value(json!({
            "metadata": {"name": "vmsnapshot-content-u1", "namespace": "ns", "uid": "cu"},
        }))
        .unwrap();
        let v = OnlineVolume {
            volume: "data".into(),
            claim: "c".into(),
            volume_snapshot: "vmsnapshot-u1-volume-data".into(),
        };
        let mut vs = volume_snapshot(&content, &v, DRIVER);
        let spec = vs.spec.clone().unwrap();
        assert_eq!(spec.source.persistent_volume_claim_name, None);
        let cname = spec.source.volume_snapshot_content_name.clone().unwrap();
        assert_eq!(cname, content_name("ns", "vmsnapshot-u1-volume-data"));
        assert!(
            cname.starts_with("snapcontent-") && cname.len() <= 63,
            "{cname}"
        );
        assert_ne!(cname, content_name("other", "vmsnapshot-u1-volume-data"));
        assert_eq!(
            spec.volume_snapshot_class_name.as_deref(),
            Some(LOCAL_CLASS)
        );
        assert_eq!(vs.metadata.owner_references.as_ref().unwrap()[0].uid, "cu");
        vs.metadata.uid = Some("vsu".into());
        let c = volume_snapshot_content(&vs, SHARED_DRIVER, "pv1/layer-000001.qcow2");
        let cs = c.spec.unwrap();
        assert_eq!(
            cs.source.snapshot_handle.as_deref(),
            Some("pv1/layer-000001.qcow2")
        );
        assert!(cs.source.volume_handle.is_none());
        assert_eq!(cs.volume_snapshot_class_name.as_deref(), Some(SHARED_CLASS));
        assert_eq!(cs.volume_snapshot_ref.uid.as_deref(), Some("vsu"));
        assert_eq!(
            c.metadata.owner_references.unwrap()[0].name,
            "vmsnapshot-u1-volume-data"
        );
        assert_eq!(c.metadata.name.as_deref(), Some(cname.as_str()));
    }

    #[test]
    fn every_indication_has_a_message() {
        let s = source_indications(&["Online".into(), "NoGuestAgent".into()]);
        assert_eq!(s[1].indication, "NoGuestAgent");
        assert!(
            s[1].message
                .as_deref()
                .unwrap()
                .contains("crash-consistent")
        );
    }
}
