//! Validation of the smaller kinds: migrations, snapshots and restores (whose specs are
//! immutable), instancetypes, preferences, migration policies, network attachments and
//! StorageClasses (`provisioner` and `parameters` immutable, as in Kubernetes; a declared
//! shared mount must be a usable path: `crate::shared_mount`).

use serde_json::Value;

use super::validate::{DISK_BUSES, check_quantity};
use super::{FieldError, Operation};
use crate::kubevirt::instancetype::{InstancetypeSpec, PreferenceSpec};
use crate::quantity::MIN_GUEST_MEMORY;
use crate::registry::ResourceDef;

/// Kinds whose `spec` cannot change after creation.
fn spec_is_immutable(def: &ResourceDef) -> bool {
    matches!(
        def.kind,
        "VirtualMachineInstanceMigration"
            | "VirtualMachineSnapshot"
            | "VirtualMachineSnapshotContent"
            | "VirtualMachineRestore"
            | "VirtualMachineExport"
            | "VirtualMachineClone"
    )
}

fn str_at<'a>(obj: &'a Value, path: &[&str]) -> Option<&'a str> {
    path.iter()
        .try_fold(obj, |cur, k| cur.get(*k))
        .and_then(Value::as_str)
}

/// Validate a typed-checked object of one of the smaller kinds.
pub(super) fn validate(
    def: &ResourceDef,
    op: Operation,
    obj: &Value,
    old: Option<&Value>,
) -> Vec<FieldError> {
    let mut e = Vec::new();
    if op == Operation::Update
        && spec_is_immutable(def)
        && let Some(old) = old
        && old.get("spec") != obj.get("spec")
    {
        e.push(FieldError::forbidden(
            "spec",
            "spec is immutable after creation",
        ));
    }
    match def.kind {
        "HyperConverged" => {
            validate_node_failure(obj, &mut e);
            e.extend(crate::hco::admission::validate(obj, op));
        }
        "StorageClass" => validate_storage_class(op, obj, old, &mut e),
        "VirtualMachineInstanceMigration"
            if str_at(obj, &["spec", "vmiName"]).unwrap_or("").is_empty() =>
        {
            e.push(FieldError::required("spec.vmiName", "vmiName is required"));
        }
        "VirtualMachineSnapshot" => {
            check_vm_ref(obj, "source", &mut e);
            e.extend(crate::kubevirt::snapshot::validate(def.kind, obj));
        }
        "VirtualMachineExport" => e.extend(crate::kubevirt::export::validate(obj)),
        "VirtualMachineClone" => e.extend(crate::kubevirt::clone::validate(obj)),
        "VirtualMachineRestore" => {
            check_vm_ref(obj, "target", &mut e);
            e.extend(crate::kubevirt::snapshot::validate(def.kind, obj));
            if str_at(obj, &["spec", "virtualMachineSnapshotName"])
                .unwrap_or("")
                .is_empty()
            {
                e.push(FieldError::required(
                    "spec.virtualMachineSnapshotName",
                    "virtualMachineSnapshotName is required",
                ));
            }
        }
        "VirtualMachineInstancetype" | "VirtualMachineClusterInstancetype" => {
            if let Some(spec) = obj.get("spec")
                && let Ok(spec) = serde_json::from_value::<InstancetypeSpec>(spec.clone())
            {
                validate_instancetype(&spec, &mut e);
            } else {
                e.push(FieldError::required("spec", "spec is required"));
            }
        }
        "VirtualMachinePreference" | "VirtualMachineClusterPreference" => {
            if let Some(spec) = obj.get("spec")
                && let Ok(spec) = serde_json::from_value::<PreferenceSpec>(spec.clone())
            {
                validate_preference(&spec, &mut e);
            }
        }
        "MigrationPolicy" => {
            if let Some(q) = str_at(obj, &["spec", "bandwidthPerMigration"]) {
                check_quantity("spec.bandwidthPerMigration".into(), q, &mut e);
            }
        }
        "PersistentVolumeClaim" if def.group.is_empty() && op == Operation::Update => {
            if let Some(old) = old {
                e.extend(pvc_not_shrunk(obj, old));
            }
        }
        "UploadTokenRequest" if str_at(obj, &["spec", "pvcName"]).unwrap_or("").is_empty() => {
            e.push(FieldError::required("spec.pvcName", "pvcName is required"));
        }
        "NetworkAttachmentDefinition" => {
            if let Some(config) = str_at(obj, &["spec", "config"])
                && !config.is_empty()
                && serde_json::from_str::<serde_json::Map<String, Value>>(config).is_err()
            {
                e.push(FieldError::invalid(
                    "spec.config",
                    "config must be a JSON object (a CNI configuration)",
                ));
            }
        }
        _ => {}
    }
    e
}

/// A claim's storage request may grow (expansion) but never shrink.
fn pvc_not_shrunk(obj: &Value, old: &Value) -> Option<FieldError> {
    let at = |v: &Value| {
        v.pointer("/spec/resources/requests/storage")
            .and_then(|q| match q {
                Value::String(s) => crate::quantity::parse(s).ok(),
                Value::Number(n) => n.as_f64(),
                _ => None,
            })
    };
    let (new, old) = (at(obj)?, at(old)?);
    (new < old).then(|| {
        FieldError::forbidden(
            "spec.resources.requests.storage",
            "field can not be less than previous value",
        )
    })
}

fn check_vm_ref(obj: &Value, field: &str, e: &mut Vec<FieldError>) {
    let kind = str_at(obj, &["spec", field, "kind"]).unwrap_or("");
    if kind != "VirtualMachine" {
        e.push(FieldError::not_supported(
            format!("spec.{field}.kind"),
            format!("Unsupported value: \"{kind}\": supported values: \"VirtualMachine\""),
        ));
    }
    if let Some(group) = str_at(obj, &["spec", field, "apiGroup"])
        && group != "kubevirt.io"
    {
        e.push(FieldError::not_supported(
            format!("spec.{field}.apiGroup"),
            format!("Unsupported value: \"{group}\": supported values: \"kubevirt.io\""),
        ));
    }
    if str_at(obj, &["spec", field, "name"])
        .unwrap_or("")
        .is_empty()
    {
        e.push(FieldError::required(
            format!("spec.{field}.name"),
            "name is required",
        ));
    }
}

/// `spec.nodeFailure` (docs/fencing.md): timings that cannot be carried out safely are
/// refused naming the field.
fn validate_node_failure(obj: &Value, e: &mut Vec<FieldError>) {
    let Some(cfg) = obj.pointer("/spec/nodeFailure") else {
        return;
    };
    let Ok(cfg) = serde_json::from_value::<crate::hco::NodeFailureConfig>(cfg.clone()) else {
        return; // the type check reported it
    };
    let d = crate::fencing::FenceTiming::default();
    let t = crate::fencing::FenceTiming {
        lease_duration_seconds: cfg
            .lease_duration_seconds
            .unwrap_or(d.lease_duration_seconds),
        fence_margin_seconds: cfg.fence_margin_seconds.unwrap_or(d.fence_margin_seconds),
    };
    if let Err(err) = t.validate() {
        e.push(FieldError::invalid(
            format!("spec.nodeFailure.{}", err.field),
            err.message,
        ));
    }
}

fn validate_instancetype(spec: &InstancetypeSpec, e: &mut Vec<FieldError>) {
    if spec.cpu.guest == 0 {
        e.push(FieldError::invalid(
            "spec.cpu.guest",
            "must be greater than 0",
        ));
    }
    if let Some(v) = check_quantity("spec.memory.guest".into(), &spec.memory.guest.0, e)
        && v < MIN_GUEST_MEMORY
    {
        e.push(FieldError::invalid(
            "spec.memory.guest",
            "must be greater than or equal to 1Mi",
        ));
    }
    if let Some(p) = spec.memory.overcommit_percent
        && !(0..=100).contains(&p)
    {
        e.push(FieldError::invalid(
            "spec.memory.overcommitPercent",
            "must be between 0 and 100",
        ));
    }
}

fn validate_preference(spec: &PreferenceSpec, e: &mut Vec<FieldError>) {
    let Some(d) = &spec.devices else {
        return;
    };
    for (field, bus) in [
        ("preferredDiskBus", &d.preferred_disk_bus),
        ("preferredCdromBus", &d.preferred_cdrom_bus),
        ("preferredLunBus", &d.preferred_lun_bus),
    ] {
        if let Some(bus) = bus
            && !DISK_BUSES.contains(&bus.as_str())
        {
            e.push(FieldError::not_supported(
                format!("spec.devices.{field}"),
                format!(
                    "Unsupported value: \"{bus}\": supported values: \"virtio\", \"sata\", \
                     \"scsi\", \"usb\""
                ),
            ));
        }
    }
}

/// StorageClass: `provisioner` and `parameters` cannot change (Kubernetes' rule; here it also
/// keeps a shared mount from moving under its volumes), and a declared shared mount must be a
/// usable path.
fn validate_storage_class(
    op: Operation,
    obj: &Value,
    old: Option<&Value>,
    e: &mut Vec<FieldError>,
) {
    if op == Operation::Update
        && let Some(old) = old
    {
        for field in ["provisioner", "parameters"] {
            if old.get(field) != obj.get(field) {
                e.push(FieldError::forbidden(
                    field,
                    format!("updates to {field} are forbidden."),
                ));
            }
        }
    }
    let provisioner = str_at(obj, &["provisioner"]).unwrap_or("");
    let parameters = obj
        .get("parameters")
        .and_then(|p| serde_json::from_value(p.clone()).ok());
    if let Some(Err(msg)) = crate::shared_mount::declared(provisioner, parameters.as_ref()) {
        e.push(FieldError::invalid(
            format!("parameters[{}]", crate::shared_mount::MOUNT_PARAMETER),
            msg,
        ));
    }
}
