//! snapshot.storage.k8s.io/v1: VolumeSnapshot, VolumeSnapshotContent and VolumeSnapshotClass,
//! the Kubernetes CSI snapshot kinds (field names and meanings as the external-snapshotter's
//! published v1 API). ferrovirt's provisioners implement them (docs/snapshots.md); in a real
//! cluster they are CRDs, so they are served as such here too.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

/// The API group and version of these kinds.
pub const API_VERSION: &str = "snapshot.storage.k8s.io/v1";
/// The snapshot driver name of ferrovirt's provisioners (`driver` of classes and contents).
pub const DRIVER: &str = "ferrovirt.io/local";
/// The snapshot driver of the `shared` class.
pub const SHARED_DRIVER: &str = "ferrovirt.io/shared";

resource! {
    /// A user's request for a snapshot of a PersistentVolumeClaim (or the binding of a
    /// pre-existing VolumeSnapshotContent).
    VolumeSnapshot, VolumeSnapshotSpec, VolumeSnapshotStatus
}

kstruct! {
    /// What to snapshot and with which class.
    pub struct VolumeSnapshotSpec {
        /// Exactly one of `persistentVolumeClaimName` (take a new snapshot) or
        /// `volumeSnapshotContentName` (bind an existing one).
        #[serde(default)]
        pub source: VolumeSnapshotSource,
        /// The VolumeSnapshotClass; the default class of the driver when unset.
        pub volume_snapshot_class_name: Option<String>,
    }
}

kstruct! {
    /// The source of a VolumeSnapshot.
    pub struct VolumeSnapshotSource {
        /// A claim in the snapshot's namespace to snapshot.
        pub persistent_volume_claim_name: Option<String>,
        /// A pre-provisioned VolumeSnapshotContent to bind.
        pub volume_snapshot_content_name: Option<String>,
    }
}

kstruct! {
    /// Where a VolumeSnapshot stands.
    pub struct VolumeSnapshotStatus {
        /// The VolumeSnapshotContent bound to this snapshot.
        pub bound_volume_snapshot_content_name: Option<String>,
        /// When the storage cut the snapshot.
        pub creation_time: Option<Time>,
        /// Whether the snapshot can be used to restore a volume.
        pub ready_to_use: Option<bool>,
        /// The minimum size of a volume restored from it (a quantity).
        pub restore_size: Option<String>,
        /// The last error taking the snapshot.
        pub error: Option<VolumeSnapshotError>,
    }
}

kstruct! {
    /// An error of a snapshot operation.
    pub struct VolumeSnapshotError {
        pub time: Option<Time>,
        pub message: Option<String>,
    }
}

resource! {
    /// The snapshot as the storage holds it (cluster-scoped).
    VolumeSnapshotContent, VolumeSnapshotContentSpec, VolumeSnapshotContentStatus
}

kstruct! {
    /// A snapshot in the storage and the VolumeSnapshot bound to it.
    pub struct VolumeSnapshotContentSpec {
        /// The VolumeSnapshot this content is bound to.
        #[serde(default)]
        pub volume_snapshot_ref: ObjectReference,
        /// `Delete` (the storage snapshot goes with the content) or `Retain`.
        #[serde(default)]
        pub deletion_policy: String,
        /// The driver that made it.
        #[serde(default)]
        pub driver: String,
        /// The class it was made with.
        pub volume_snapshot_class_name: Option<String>,
        /// The volume it was taken of, or the existing snapshot it stands for.
        #[serde(default)]
        pub source: VolumeSnapshotContentSource,
        /// `Filesystem` or `Block`.
        pub source_volume_mode: Option<String>,
    }
}

kstruct! {
    /// Exactly one of `volumeHandle` (a dynamic snapshot of that volume) or `snapshotHandle`
    /// (a pre-existing snapshot).
    pub struct VolumeSnapshotContentSource {
        pub volume_handle: Option<String>,
        pub snapshot_handle: Option<String>,
    }
}

kstruct! {
    /// The storage's account of a snapshot.
    pub struct VolumeSnapshotContentStatus {
        /// The storage's handle of the snapshot (`<pv>/<frozen layer>` for ferrovirt's).
        pub snapshot_handle: Option<String>,
        /// When it was cut, in nanoseconds since the epoch.
        pub creation_time: Option<i64>,
        pub ready_to_use: Option<bool>,
        /// The minimum size of a restored volume in bytes.
        pub restore_size: Option<i64>,
        pub error: Option<VolumeSnapshotError>,
    }
}

kstruct! {
    /// A class of snapshots (cluster-scoped): the driver that takes them and what happens to
    /// the storage snapshot when its content is deleted.
    pub struct VolumeSnapshotClass {
        /// The versioned schema of this object (`snapshot.storage.k8s.io/v1`).
        pub api_version: Option<String>,
        /// The REST resource kind of this object, in CamelCase.
        pub kind: Option<String>,
        /// Standard object metadata.
        #[serde(default)]
        pub metadata: ObjectMeta,
        /// The snapshot driver (the provisioner of the classes it serves).
        #[serde(default)]
        pub driver: String,
        /// `Delete` or `Retain`.
        #[serde(default)]
        pub deletion_policy: String,
        /// Driver-specific parameters.
        pub parameters: Option<BTreeMap<String, String>>,
    }
}

/// The annotation that makes a VolumeSnapshotClass its driver's default.
pub const DEFAULT_CLASS_ANNOTATION: &str = "snapshot.storage.kubernetes.io/is-default-class";

/// Why a VolumeSnapshot's spec cannot be carried out (the field path and the reason), checked
/// at admission.
pub fn validate_snapshot(spec: &VolumeSnapshotSpec) -> Result<(), (String, String)> {
    let s = &spec.source;
    match (
        s.persistent_volume_claim_name.as_deref(),
        s.volume_snapshot_content_name.as_deref(),
    ) {
        (Some(_), Some(_)) | (None, None) => Err((
            "spec.source".into(),
            "exactly one of persistentVolumeClaimName and volumeSnapshotContentName is required"
                .into(),
        )),
        (Some(""), _) => Err((
            "spec.source.persistentVolumeClaimName".into(),
            "must not be empty".into(),
        )),
        (_, Some("")) => Err((
            "spec.source.volumeSnapshotContentName".into(),
            "must not be empty".into(),
        )),
        _ => Ok(()),
    }
}

/// Whether a deletion policy is one of the two the API knows.
pub fn valid_deletion_policy(p: &str) -> bool {
    matches!(p, "Delete" | "Retain")
}

/// Admission of the three kinds (`kind`): typed parse, then the checks above, each failure
/// naming its field.
pub fn admit(kind: &str, obj: &mut serde_json::Value) -> Vec<crate::admission::FieldError> {
    use crate::admission::{FieldError, parse_typed};
    let mut errors = Vec::new();
    let policy = |p: &str, field: &str, errors: &mut Vec<FieldError>| {
        if !valid_deletion_policy(p) {
            errors.push(FieldError::not_supported(
                field,
                format!("{p:?}: supported values: \"Delete\", \"Retain\""),
            ));
        }
    };
    match kind {
        "VolumeSnapshot" => match parse_typed::<VolumeSnapshot>(obj) {
            Ok(vs) => match vs.spec {
                None => errors.push(FieldError::required("spec", "spec is required")),
                Some(spec) => {
                    if let Err((field, msg)) = validate_snapshot(&spec) {
                        errors.push(FieldError::required(field, msg));
                    }
                }
            },
            Err(e) => errors.push(e),
        },
        "VolumeSnapshotContent" => match parse_typed::<VolumeSnapshotContent>(obj) {
            Ok(c) => match c.spec {
                None => errors.push(FieldError::required("spec", "spec is required")),
                Some(spec) => {
                    policy(&spec.deletion_policy, "spec.deletionPolicy", &mut errors);
                    if spec.driver.is_empty() {
                        errors.push(FieldError::required("spec.driver", "driver is required"));
                    }
                    let s = &spec.source;
                    if s.volume_handle.is_some() == s.snapshot_handle.is_some() {
                        errors.push(FieldError::required(
                            "spec.source",
                            "exactly one of volumeHandle and snapshotHandle is required",
                        ));
                    }
                }
            },
            Err(e) => errors.push(e),
        },
        "VolumeSnapshotClass" => match parse_typed::<VolumeSnapshotClass>(obj) {
            Ok(c) => {
                policy(&c.deletion_policy, "deletionPolicy", &mut errors);
                if c.driver.is_empty() {
                    errors.push(FieldError::required("driver", "driver is required"));
                }
            }
            Err(e) => errors.push(e),
        },
        _ => {}
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_names_exactly_one_source() {
        let mut spec = VolumeSnapshotSpec::default();
        assert_eq!(validate_snapshot(&spec).unwrap_err().0, "spec.source");
        spec.source.persistent_volume_claim_name = Some("disk".into());
        assert!(validate_snapshot(&spec).is_ok());
        spec.source.volume_snapshot_content_name = Some("c".into());
        assert!(validate_snapshot(&spec).is_err());
        spec.source.persistent_volume_claim_name = None;
        assert!(validate_snapshot(&spec).is_ok());
        spec.source.volume_snapshot_content_name = Some(String::new());
        assert_eq!(
            validate_snapshot(&spec).unwrap_err().0,
            "spec.source.volumeSnapshotContentName"
        );
        assert!(valid_deletion_policy("Retain") && !valid_deletion_policy("Keep"));
    }

    #[test]
    fn admission_names_the_field() {
        let mut obj = serde_json::json!({"apiVersion": API_VERSION, "kind": "VolumeSnapshotClass",
            "metadata": {"name": "c"}, "driver": DRIVER, "deletionPolicy": "Keep"});
        let e = admit("VolumeSnapshotClass", &mut obj);
        assert_eq!(e[0].field, "deletionPolicy");
        let mut obj = serde_json::json!({"apiVersion": API_VERSION, "kind": "VolumeSnapshot",
            "metadata": {"name": "s"}, "spec": {"source": {}}});
        assert_eq!(admit("VolumeSnapshot", &mut obj)[0].field, "spec.source");
        let mut obj = serde_json::json!({"apiVersion": API_VERSION, "kind": "VolumeSnapshot",
            "metadata": {"name": "s"}, "spec": {"source": {"persistentVolumeClaimName": 3}}});
        assert_eq!(
            admit("VolumeSnapshot", &mut obj)[0].field,
            "spec.source.persistentVolumeClaimName"
        );
    }

    #[test]
    fn content_round_trips_with_published_field_names() {
        let json = serde_json::json!({
            "apiVersion": API_VERSION, "kind": "VolumeSnapshotContent",
            "metadata": {"name": "snapcontent-1"},
            "spec": {"deletionPolicy": "Delete", "driver": DRIVER,
                     "source": {"volumeHandle": "pvc-1"},
                     "volumeSnapshotRef": {"name": "s", "namespace": "default"}},
            "status": {"readyToUse": true, "restoreSize": 1024, "snapshotHandle": "pvc-1/disk.img",
                       "creationTime": 1700000000000000000i64}
        });
        let c: VolumeSnapshotContent = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(serde_json::to_value(&c).unwrap(), json);
    }
}
