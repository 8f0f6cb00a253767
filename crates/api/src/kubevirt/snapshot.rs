//! snapshot.kubevirt.io/v1beta1: VirtualMachineSnapshot, VirtualMachineSnapshotContent and
//! VirtualMachineRestore.

use k8s_openapi::api::core::v1::{PersistentVolumeClaimSpec, TypedLocalObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use super::vm::{VirtualMachineSpec, VirtualMachineStatus};
use super::vmi::Condition;

resource! {
    /// A point-in-time snapshot of a VM.
    VirtualMachineSnapshot, SnapshotSpec, SnapshotStatus
}

kstruct! {
    /// What to snapshot.
    pub struct SnapshotSpec {
        pub source: TypedLocalObjectReference,
        /// `Delete` or `Retain`.
        pub deletion_policy: Option<String>,
        /// How long the snapshot may take before it fails (a duration).
        pub failure_deadline: Option<String>,
    }
}

kstruct! {
    /// Progress of a snapshot.
    pub struct SnapshotStatus {
        #[serde(rename = "sourceUID")]
        pub source_uid: Option<String>,
        pub virtual_machine_snapshot_content_name: Option<String>,
        pub creation_time: Option<Time>,
        /// `InProgress`, `Succeeded`, `Failed`, `Unknown`.
        pub phase: Option<String>,
        pub ready_to_use: Option<bool>,
        pub error: Option<SnapshotError>,
        pub conditions: Option<Vec<Condition>>,
        /// `Online`, `GuestAgent`/`NoGuestAgent`, `Paused`, `QuiesceTimeout` (deprecated list; see
        /// `sourceIndications`).
        pub indications: Option<Vec<String>>,
        /// The indications with what each one means.
        pub source_indications: Option<Vec<SourceIndication>>,
        /// Which volumes of the VM the snapshot holds and which it left out.
        pub snapshot_volumes: Option<SnapshotVolumesLists>,
    }
}

kstruct! {
    /// One indication about how the snapshot was taken.
    pub struct SourceIndication {
        pub indication: String,
        pub message: Option<String>,
    }
}

kstruct! {
    /// The VM's volumes in and out of a snapshot.
    pub struct SnapshotVolumesLists {
        pub included_volumes: Option<Vec<String>>,
        pub excluded_volumes: Option<Vec<String>>,
    }
}

kstruct! {
    /// The last error of a snapshot or restore.
    pub struct SnapshotError {
        pub time: Option<Time>,
        pub message: Option<String>,
    }
}

resource! {
    /// The captured VM and volume snapshots behind a VirtualMachineSnapshot.
    VirtualMachineSnapshotContent, SnapshotContentSpec, SnapshotContentStatus
}

kstruct! {
    /// The captured content.
    pub struct SnapshotContentSpec {
        /// The snapshot this content belongs to.
        pub virtual_machine_snapshot_name: Option<String>,
        #[serde(default)]
        pub source: SnapshotContentSource,
        pub volume_backups: Option<Vec<VolumeBackup>>,
    }
}

kstruct! {
    /// The VM as it was.
    pub struct SnapshotContentSource {
        pub virtual_machine: Option<CapturedVirtualMachine>,
    }
}

kstruct! {
    /// A VM copy inside snapshot content.
    pub struct CapturedVirtualMachine {
        pub api_version: Option<String>,
        pub kind: Option<String>,
        pub metadata: Option<ObjectMeta>,
        pub spec: Option<VirtualMachineSpec>,
        pub status: Option<VirtualMachineStatus>,
    }
}

kstruct! {
    /// One volume's snapshot.
    pub struct VolumeBackup {
        pub volume_name: String,
        pub persistent_volume_claim: CapturedClaim,
        pub volume_snapshot_name: Option<String>,
    }
}

kstruct! {
    /// A PVC as captured.
    pub struct CapturedClaim {
        pub metadata: Option<ObjectMeta>,
        pub spec: Option<PersistentVolumeClaimSpec>,
    }
}

kstruct! {
    /// Readiness of the content.
    pub struct SnapshotContentStatus {
        pub creation_time: Option<Time>,
        pub ready_to_use: Option<bool>,
        pub error: Option<SnapshotError>,
        pub volume_snapshot_status: Option<Vec<VolumeSnapshotState>>,
    }
}

kstruct! {
    /// Readiness of one volume snapshot.
    pub struct VolumeSnapshotState {
        pub volume_snapshot_name: String,
        pub creation_time: Option<Time>,
        pub ready_to_use: Option<bool>,
        pub error: Option<SnapshotError>,
    }
}

resource! {
    /// Restore a VM from a snapshot.
    VirtualMachineRestore, RestoreSpec, RestoreStatus
}

kstruct! {
    /// Which snapshot into which target.
    pub struct RestoreSpec {
        pub target: TypedLocalObjectReference,
        /// The snapshot to restore from.
        pub virtual_machine_snapshot_name: String,
        /// JSON patches applied to the restored VM.
        pub patches: Option<Vec<String>>,
        /// When to restore into a running target: `StopTarget`, `WaitGracePeriod`, `WaitEventually`, `FailImmediate`.
        pub target_readiness_policy: Option<String>,
        /// How restored volumes are named: `RandomizeNames`, `InPlace` or `PrefixTargetName`.
        pub volume_restore_policy: Option<String>,
        /// Who owns the restored volumes: `Vm` or `None`.
        pub volume_ownership_policy: Option<String>,
        pub volume_restore_overrides: Option<Vec<VolumeRestoreOverride>>,
    }
}

kstruct! {
    /// Name, labels and annotations of one restored volume.
    pub struct VolumeRestoreOverride {
        pub volume_name: Option<String>,
        pub restore_name: Option<String>,
        pub labels: Option<std::collections::BTreeMap<String, String>>,
        pub annotations: Option<std::collections::BTreeMap<String, String>>,
    }
}

kstruct! {
    /// Progress of a restore.
    pub struct RestoreStatus {
        pub restores: Option<Vec<VolumeRestore>>,
        pub restore_time: Option<Time>,
        pub deleted_data_volumes: Option<Vec<String>>,
        pub complete: Option<bool>,
        pub conditions: Option<Vec<Condition>>,
    }
}

kstruct! {
    /// One restored volume.
    pub struct VolumeRestore {
        pub volume_name: String,
        pub persistent_volume_claim: String,
        pub volume_snapshot_name: String,
        pub data_volume_name: Option<String>,
    }
}

/// The default `failureDeadline` of a VirtualMachineSnapshot (KubeVirt's: 5 minutes).
pub const DEFAULT_FAILURE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(300);

/// Parse a Go duration (`5m`, `1h30m`, `90s`, `1.5s`, `250ms`, `0s`), as KubeVirt's
/// `metav1.Duration` fields are written.
pub fn parse_go_duration(s: &str) -> Result<std::time::Duration, String> {
    let bad = || format!("{s:?} is not a duration (e.g. \"5m\", \"1h30m\", \"90s\")");
    if s == "0" {
        return Ok(std::time::Duration::ZERO);
    }
    let mut rest = s;
    let mut total = 0f64;
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        if num_len == 0 {
            return Err(bad());
        }
        let n: f64 = rest[..num_len].parse().map_err(|_| bad())?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return Err(bad()),
        };
        total += n * scale;
        rest = &rest[unit_len..];
    }
    if !total.is_finite() || total > 1e12 {
        return Err(bad());
    }
    Ok(std::time::Duration::from_secs_f64(total))
}

/// The `failureDeadline` of a snapshot spec (default 5m; `0s` means none).
pub fn failure_deadline(spec: &SnapshotSpec) -> Result<std::time::Duration, String> {
    match spec.failure_deadline.as_deref() {
        None => Ok(DEFAULT_FAILURE_DEADLINE),
        Some(s) => parse_go_duration(s),
    }
}

/// KubeVirt's rule for a VirtualMachine update while a snapshot of it runs: its spec may not
/// change (so neither a stop, a start nor an edit) until the snapshot named in the stored
/// object's `status.snapshotInProgress` completes.
pub fn vm_update_during_snapshot(
    obj: &serde_json::Value,
    old: &serde_json::Value,
) -> Option<crate::admission::FieldError> {
    let snapshot = old["status"]["snapshotInProgress"].as_str()?;
    (obj.get("spec") != old.get("spec")).then(|| {
        crate::admission::FieldError::forbidden(
            "spec",
            format!("Cannot update VM spec until snapshot {snapshot:?} completes"),
        )
    })
}

/// Admission of the snapshot.kubevirt.io kinds a user writes, beyond the source/target reference
/// (`admission::others`): what the controllers cannot carry out is refused naming the field.
pub fn validate(kind: &str, obj: &serde_json::Value) -> Vec<crate::admission::FieldError> {
    use crate::admission::FieldError;
    let mut errs = Vec::new();
    let spec = &obj["spec"];
    match kind {
        "VirtualMachineSnapshot" => {
            if let Some(p) = spec["deletionPolicy"].as_str()
                && !matches!(p, "Delete" | "Retain")
            {
                errs.push(FieldError::not_supported(
                    "spec.deletionPolicy",
                    format!("{p:?}: supported values: \"Delete\", \"Retain\""),
                ));
            }
            if let Some(d) = spec["failureDeadline"].as_str()
                && let Err(e) = parse_go_duration(d)
            {
                errs.push(FieldError::invalid("spec.failureDeadline", e));
            }
        }
        "VirtualMachineRestore" => {
            let one_of = |field: &str, allowed: &[&str], errs: &mut Vec<FieldError>| {
                let v = &spec[field];
                if let Some(p) = v.as_str()
                    && !allowed.contains(&p)
                {
                    errs.push(FieldError::not_supported(
                        format!("spec.{field}"),
                        format!("{p:?}: supported values: {allowed:?}"),
                    ));
                }
            };
            one_of(
                "volumeRestorePolicy",
                &["RandomizeNames", "InPlace", "PrefixTargetName"],
                &mut errs,
            );
            one_of("volumeOwnershipPolicy", &["Vm", "None"], &mut errs);
            one_of(
                "targetReadinessPolicy",
                &[
                    "WaitGracePeriod",
                    "WaitEventually",
                    "FailImmediate",
                    "StopTarget",
                ],
                &mut errs,
            );
            for (i, p) in spec["patches"].as_array().into_iter().flatten().enumerate() {
                let ok = p
                    .as_str()
                    .and_then(|s| serde_json::from_str::<json_patch::PatchOperation>(s).ok())
                    .is_some();
                if !ok {
                    errs.push(FieldError::invalid(
                        format!("spec.patches[{i}]"),
                        "not a JSON patch operation",
                    ));
                }
            }
        }
        _ => {}
    }
    errs
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_vm_spec_is_frozen_while_its_snapshot_runs() {
        let old = serde_json::json!({"spec": {"runStrategy": "Always"},
            "status": {"snapshotInProgress": "snap1"}});
        let stop = serde_json::json!({"spec": {"runStrategy": "Halted"}});
        let e = vm_update_during_snapshot(&stop, &old).unwrap();
        assert_eq!(e.field, "spec");
        assert!(e.message.contains("snap1"), "{}", e.message);
        // Same spec (a status or metadata write): allowed.
        let same = serde_json::json!({"spec": {"runStrategy": "Always"}, "metadata": {"labels": {"a": "b"}}});
        assert!(vm_update_during_snapshot(&same, &old).is_none());
        // No snapshot in progress: allowed.
        let idle = serde_json::json!({"spec": {"runStrategy": "Always"}});
        assert!(vm_update_during_snapshot(&stop, &idle).is_none());
    }

    use super::*;

    #[test]
    fn go_durations() {
        let d = |s| parse_go_duration(s).unwrap().as_secs_f64();
        assert_eq!(d("5m"), 300.0);
        assert_eq!(d("1h30m"), 5400.0);
        assert_eq!(d("1.5s"), 1.5);
        assert_eq!(d("250ms"), 0.25);
        assert_eq!(d("0s"), 0.0);
        for bad in ["", "5", "m", "5x", "-1s", "1e9h9"] {
            assert!(parse_go_duration(bad).is_err(), "{bad}");
        }
        assert_eq!(
            failure_deadline(&SnapshotSpec::default()).unwrap(),
            DEFAULT_FAILURE_DEADLINE
        );
    }

    #[test]
    fn admission_refuses_what_is_not_carried_out() {
        let snap = serde_json::json!({"spec": {"source": {"kind": "Pod", "name": "x"},
            "failureDeadline": "soon", "deletionPolicy": "Keep"}});
        let fields: Vec<_> = validate("VirtualMachineSnapshot", &snap)
            .into_iter()
            .map(|e| e.field)
            .collect();
        assert_eq!(fields, ["spec.deletionPolicy", "spec.failureDeadline"]);
        let ok = serde_json::json!({"spec": {"source": {"apiGroup": "kubevirt.io",
            "kind": "VirtualMachine", "name": "vm"}}});
        assert!(validate("VirtualMachineSnapshot", &ok).is_empty());
        let restore = serde_json::json!({"spec": {"target": {"kind": "VirtualMachine",
            "name": "vm"}, "virtualMachineSnapshotName": "s",
            "targetReadinessPolicy": "StopWhenever", "patches": ["{}"]}});
        let fields: Vec<_> = validate("VirtualMachineRestore", &restore)
            .into_iter()
            .map(|e| e.field)
            .collect();
        assert_eq!(fields, ["spec.targetReadinessPolicy", "spec.patches[0]"]);
        let patched = serde_json::json!({"spec": {"target": {"kind": "VirtualMachine",
            "name": "vm"}, "virtualMachineSnapshotName": "s",
            "patches": ["{\"op\": \"remove\", \"path\": \"/metadata/labels/a\"}"]}});
        assert!(validate("VirtualMachineRestore", &patched).is_empty());
        let stop = serde_json::json!({"spec": {"target": {"kind": "VirtualMachine",
            "name": "vm"}, "virtualMachineSnapshotName": "s",
            "targetReadinessPolicy": "StopTarget"}});
        assert!(validate("VirtualMachineRestore", &stop).is_empty());
    }
}
