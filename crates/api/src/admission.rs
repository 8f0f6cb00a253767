//! Admission: defaulting then validation of an object on create and update. Returns every
//! problem at once, each naming its field path, so the API server can answer 422 Invalid.
//!
//! Defaults are applied to the JSON object itself, so fields ferrovirt does not model survive
//! untouched; validation reads a typed view parsed from the same JSON.

mod core;
mod datavolume;
mod defaults;
pub(crate) mod meta;
mod others;
mod pool;
mod validate;

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::cdi::DataVolume;
use crate::kubevirt::misc::VirtualMachineInstanceReplicaSet;
use crate::kubevirt::pool::VirtualMachinePool;
use crate::kubevirt::vm::VirtualMachine;
use crate::kubevirt::vmi::VirtualMachineInstance;
use crate::registry::ResourceDef;

pub use defaults::{VmiDefaults, default_vmi_spec, firmware_uuid};
pub use meta::{is_dns1123_label, is_dns1123_subdomain};
pub use validate::{SpecChecks, instancetype_conflicts, validate_vmi_spec};

/// Whether the object is being created or updated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Create,
    Update,
}

/// One invalid field (becomes a metav1.StatusCause).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// "FieldValueInvalid", "FieldValueRequired", "FieldValueDuplicate", "FieldValueNotSupported",
    /// "FieldValueForbidden", "FieldValueTooLong" or "FieldValueTypeInvalid".
    pub reason: &'static str,
    /// Field path as Kubernetes prints it, e.g. `spec.template.spec.domain.devices.disks[0].name`.
    pub field: String,
    pub message: String,
}

impl FieldError {
    /// `FieldValueInvalid`.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new("FieldValueInvalid", field, message)
    }
    /// `FieldValueRequired`.
    pub fn required(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new("FieldValueRequired", field, message)
    }
    /// `FieldValueDuplicate`.
    pub fn duplicate(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new("FieldValueDuplicate", field, message)
    }
    /// `FieldValueNotSupported`.
    pub fn not_supported(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new("FieldValueNotSupported", field, message)
    }
    /// `FieldValueForbidden`.
    pub fn forbidden(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new("FieldValueForbidden", field, message)
    }
    /// `FieldValueTypeInvalid`.
    pub fn type_invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new("FieldValueTypeInvalid", field, message)
    }
    fn new(reason: &'static str, field: impl Into<String>, message: impl Into<String>) -> Self {
        FieldError {
            reason,
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Admission failed: every field problem found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} invalid field(s)", .0.len())]
pub struct Invalid(pub Vec<FieldError>);

impl Invalid {
    /// `Ok(())` when `errors` is empty.
    pub fn check(errors: Vec<FieldError>) -> Result<(), Invalid> {
        if errors.is_empty() {
            Ok(())
        } else {
            Err(Invalid(errors))
        }
    }
}

/// Default and validate `obj` (a full object with apiVersion/kind/metadata) of resource `def`.
/// `old` is the stored object on update. Mutates `obj` in place with defaults.
///
/// Call it after the server has filled `metadata.name` from `generateName` and set
/// `metadata.namespace`: the firmware UUID default is derived from them.
pub fn admit(
    def: &ResourceDef,
    op: Operation,
    obj: &mut Value,
    old: Option<&Value>,
) -> Result<(), Invalid> {
    if !obj.is_object() {
        return Err(Invalid(vec![FieldError::type_invalid(
            "",
            "the object must be a JSON object",
        )]));
    }
    let mut errors = meta::validate_metadata(def, obj, op);
    match (def.group, def.kind) {
        ("kubevirt.io", "VirtualMachineInstance") => {
            admit_typed::<VirtualMachineInstance>(obj, &mut errors, |obj, errs| {
                defaults::default_vmi_object(obj);
                if let Some(vmi) = reparse::<VirtualMachineInstance>(obj, errs) {
                    match &vmi.spec {
                        Some(spec) => errs.extend(validate::validate_vmi_spec(
                            "spec",
                            spec,
                            SpecChecks::vmi(),
                        )),
                        None => errs.push(FieldError::required("spec", "spec is required")),
                    }
                }
            });
        }
        ("kubevirt.io", "VirtualMachine") => {
            admit_typed::<VirtualMachine>(obj, &mut errors, |obj, errs| {
                errs.extend(validate::vm_run_strategy_conflict(obj));
                defaults::default_vm_object(obj);
                if op == Operation::Update
                    && let Some(old) = old
                {
                    errs.extend(crate::kubevirt::snapshot::vm_update_during_snapshot(
                        obj, old,
                    ));
                }
                if reparse::<VirtualMachine>(obj, errs).is_some() {
                    let mut full = defaults::vm_for_validation(obj);
                    if let Some(vm) = reparse::<VirtualMachine>(&mut full, errs) {
                        errs.extend(validate::validate_vm(&vm));
                    }
                }
            });
        }
        ("kubevirt.io", "VirtualMachineInstanceReplicaSet") => {
            admit_typed::<VirtualMachineInstanceReplicaSet>(obj, &mut errors, |obj, errs| {
                defaults::default_template_at(obj, &["spec", "template", "spec"], false);
                if let Some(rs) = reparse::<VirtualMachineInstanceReplicaSet>(obj, errs)
                    && let Some(spec) = rs.spec.as_ref().and_then(|s| s.template.spec.as_ref())
                {
                    errs.extend(validate::validate_vmi_spec(
                        "spec.template.spec",
                        spec,
                        SpecChecks::template(),
                    ));
                }
            });
        }
        ("pool.kubevirt.io", "VirtualMachinePool") => {
            admit_typed::<VirtualMachinePool>(obj, &mut errors, |obj, errs| {
                pool::default_pool(obj);
                if let Some(p) = reparse::<VirtualMachinePool>(obj, errs) {
                    errs.extend(pool::validate_pool(obj, &p));
                }
            });
        }
        ("cdi.kubevirt.io", "DataVolume") => {
            admit_typed::<DataVolume>(obj, &mut errors, |obj, errs| {
                if let Some(dv) = reparse::<DataVolume>(obj, errs) {
                    match &dv.spec {
                        Some(spec) => errs.extend(datavolume::validate_dv_spec("spec", spec)),
                        None => errs.push(FieldError::required("spec", "spec is required")),
                    }
                }
            });
        }
        ("", "Service") => {
            admit_typed::<k8s_openapi::api::core::v1::Service>(obj, &mut errors, |obj, errs| {
                crate::service::default_service(obj, old);
                errs.extend(crate::service::validate_service(obj, op, old));
            });
        }
        ("discovery.k8s.io", "EndpointSlice") => {
            if let Err(e) = parse_typed::<k8s_openapi::api::discovery::v1::EndpointSlice>(obj) {
                errors.push(e);
            }
        }
        ("", "Endpoints") => {
            if let Err(e) = parse_typed::<k8s_openapi::api::core::v1::Endpoints>(obj) {
                errors.push(e);
            }
        }
        (crate::backup::GROUP, kind) => errors.extend(crate::backup::admit(kind, op, obj, old)),
        (crate::udn::GROUP, kind) => errors.extend(crate::udn::admit(kind, op, obj, old)),
        ("k8s.cni.cncf.io", "IPAMClaim") => {
            if let Some(c) = reparse::<crate::network::IPAMClaim>(obj, &mut errors) {
                errors.extend(crate::network::validate_ipamclaim(&c));
            }
        }
        (crate::nmstate::GROUP, kind) => errors.extend(crate::nmstate::admit(kind, op, obj, old)),
        ("snapshot.storage.k8s.io", _) => {
            errors.extend(crate::volumesnapshot::admit(def.kind, obj));
        }
        _ => {
            let before = errors.len();
            typecheck_only(def, obj, &mut errors);
            if errors.len() == before {
                core::default_core(def, obj);
                if def.kind == "HyperConverged" {
                    crate::hco::admission::default_object(obj);
                }
                errors.extend(others::validate(def, op, obj, old));
            }
        }
    }
    Invalid::check(errors)
}

/// Parse `obj` as `T`, reporting the first type error with its path. Numbers where a quantity
/// is expected are rewritten to strings first (Kubernetes accepts `memory: 1024`).
pub fn parse_typed<T: DeserializeOwned>(obj: &mut Value) -> Result<T, FieldError> {
    for _ in 0..64 {
        match serde_path_to_error::deserialize::<_, T>(&*obj) {
            Ok(v) => return Ok(v),
            Err(e) => {
                let path = render_path(e.path());
                let msg = e.inner().to_string();
                if msg.contains("expected Quantity")
                    && let Some(slot) = value_at_path(obj, e.path())
                    && slot.is_number()
                {
                    *slot = Value::String(slot.to_string());
                    continue;
                }
                return Err(FieldError::type_invalid(path, msg));
            }
        }
    }
    Err(FieldError::type_invalid("", "too many type errors"))
}

fn admit_typed<T: DeserializeOwned>(
    obj: &mut Value,
    errors: &mut Vec<FieldError>,
    then: impl FnOnce(&mut Value, &mut Vec<FieldError>),
) {
    match parse_typed::<T>(obj) {
        Ok(_) => then(obj, errors),
        Err(e) => errors.push(e),
    }
}

fn reparse<T: DeserializeOwned>(obj: &mut Value, errors: &mut Vec<FieldError>) -> Option<T> {
    match parse_typed::<T>(obj) {
        Ok(v) => Some(v),
        Err(e) => {
            errors.push(e);
            None
        }
    }
}

fn typecheck_only(def: &ResourceDef, obj: &mut Value, errors: &mut Vec<FieldError>) {
    use crate::kubevirt::{instancetype as it, misc, snapshot};
    use k8s_openapi::api::{apps, coordination, core, events, rbac, storage};
    let result = match (def.group, def.kind) {
        ("", "Namespace") => parse_typed::<core::v1::Namespace>(obj).map(drop),
        ("", "Node") => parse_typed::<core::v1::Node>(obj).map(drop),
        ("", "PersistentVolume") => parse_typed::<core::v1::PersistentVolume>(obj).map(drop),
        ("", "PersistentVolumeClaim") => {
            parse_typed::<core::v1::PersistentVolumeClaim>(obj).map(drop)
        }
        ("", "Secret") => parse_typed::<core::v1::Secret>(obj).map(drop),
        ("", "ConfigMap") => parse_typed::<core::v1::ConfigMap>(obj).map(drop),
        ("", "Event") => parse_typed::<core::v1::Event>(obj).map(drop),
        ("", "ServiceAccount") => parse_typed::<core::v1::ServiceAccount>(obj).map(drop),
        ("rbac.authorization.k8s.io", "Role") => parse_typed::<rbac::v1::Role>(obj).map(drop),
        ("rbac.authorization.k8s.io", "ClusterRole") => {
            parse_typed::<rbac::v1::ClusterRole>(obj).map(drop)
        }
        ("rbac.authorization.k8s.io", "RoleBinding") => {
            parse_typed::<rbac::v1::RoleBinding>(obj).map(drop)
        }
        ("rbac.authorization.k8s.io", "ClusterRoleBinding") => {
            parse_typed::<rbac::v1::ClusterRoleBinding>(obj).map(drop)
        }
        ("", "Pod") => parse_typed::<core::v1::Pod>(obj).map(drop),
        ("storage.k8s.io", "StorageClass") => {
            parse_typed::<storage::v1::StorageClass>(obj).map(drop)
        }
        ("coordination.k8s.io", "Lease") => parse_typed::<coordination::v1::Lease>(obj).map(drop),
        ("events.k8s.io", "Event") => parse_typed::<events::v1::Event>(obj).map(drop),
        ("apps", "ControllerRevision") => {
            parse_typed::<apps::v1::ControllerRevision>(obj).map(drop)
        }
        (_, "VirtualMachineInstanceMigration") => {
            parse_typed::<misc::VirtualMachineInstanceMigration>(obj).map(drop)
        }
        (_, "KubeVirt") => parse_typed::<misc::KubeVirt>(obj).map(drop),
        (_, "VirtualMachineInstancePreset") => {
            parse_typed::<crate::kubevirt::preset::VirtualMachineInstancePreset>(obj).map(drop)
        }
        (_, "UploadTokenRequest") => parse_typed::<crate::cdi::UploadTokenRequest>(obj).map(drop),
        (_, "MigrationPolicy") => parse_typed::<misc::MigrationPolicy>(obj).map(drop),
        (_, "VirtualMachineInstancetype") => {
            parse_typed::<it::VirtualMachineInstancetype>(obj).map(drop)
        }
        (_, "VirtualMachineClusterInstancetype") => {
            parse_typed::<it::VirtualMachineClusterInstancetype>(obj).map(drop)
        }
        (_, "VirtualMachinePreference") => {
            parse_typed::<it::VirtualMachinePreference>(obj).map(drop)
        }
        (_, "VirtualMachineClusterPreference") => {
            parse_typed::<it::VirtualMachineClusterPreference>(obj).map(drop)
        }
        (_, "VirtualMachineSnapshot") => {
            parse_typed::<snapshot::VirtualMachineSnapshot>(obj).map(drop)
        }
        (_, "VirtualMachineSnapshotContent") => {
            parse_typed::<snapshot::VirtualMachineSnapshotContent>(obj).map(drop)
        }
        (_, "VirtualMachineRestore") => {
            parse_typed::<snapshot::VirtualMachineRestore>(obj).map(drop)
        }
        (_, "VirtualMachineExport") => {
            parse_typed::<crate::kubevirt::export::VirtualMachineExport>(obj).map(drop)
        }
        (_, "VirtualMachineClone") => {
            parse_typed::<crate::kubevirt::clone::VirtualMachineClone>(obj).map(drop)
        }
        (_, "DataSource") => parse_typed::<crate::cdi::DataSource>(obj).map(drop),
        (_, "StorageProfile") => parse_typed::<crate::cdi::StorageProfile>(obj).map(drop),
        (_, "CDI") => parse_typed::<crate::cdi::Cdi>(obj).map(drop),
        (_, "NetworkAttachmentDefinition") => {
            parse_typed::<crate::network::NetworkAttachmentDefinition>(obj).map(drop)
        }
        (_, "HyperConverged") => parse_typed::<crate::hco::HyperConverged>(obj).map(drop),
        ("ssp.kubevirt.io", "SSP") => parse_typed::<crate::hco::operands::Ssp>(obj).map(drop),
        (_, "NetworkAddonsConfig") => {
            parse_typed::<crate::hco::operands::NetworkAddonsConfig>(obj).map(drop)
        }
        _ => Ok(()),
    };
    if let Err(e) = result {
        errors.push(e);
    }
}

/// Render a serde path the way Kubernetes prints field paths: `a.b[0].c`.
fn render_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for seg in path.iter() {
        match seg {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Segment::Unknown => {}
        }
    }
    out
}

fn value_at_path<'a>(
    obj: &'a mut Value,
    path: &serde_path_to_error::Path,
) -> Option<&'a mut Value> {
    use serde_path_to_error::Segment;
    let mut cur = obj;
    for seg in path.iter() {
        cur = match seg {
            Segment::Seq { index } => cur.get_mut(*index)?,
            Segment::Map { key } => cur.get_mut(key.as_str())?,
            Segment::Enum { .. } | Segment::Unknown => return None,
        };
    }
    Some(cur)
}
