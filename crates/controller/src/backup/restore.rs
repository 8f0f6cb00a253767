//! Pure decisions of the BackupRestore controller: where a backed-up VM goes (namespace,
//! name), which VMs of the manifest are restored, the DataVolume each disk is written into,
//! whether an object found under a name is this restore's own or a conflict, and the
//! phase steps. The I/O is in [`super::restore_loop`].

use std::collections::BTreeMap;

use serde_json::{Value, json};

use ferrovirt_api::backup::{BackupRestoreSpec, RESTORE_UID_LABEL, phase};
use ferrovirt_backup::restore::restored_vm;

/// The namespace a VM of source namespace `src` is restored into: the mapping's value, else
/// the restore's own namespace; a mapping to any other namespace is refused naming the field
/// (admission refuses it first; a restore never writes into another namespace).
pub fn target_namespace(
    src: &str,
    mapping: Option<&BTreeMap<String, String>>,
    own: &str,
) -> Result<String, String> {
    match mapping.and_then(|m| m.get(src)) {
        Some(to) if to != own => Err(format!(
            "spec.namespaceMapping.{src}: {to:?} is not this BackupRestore's namespace {own:?}"
        )),
        _ => Ok(own.to_string()),
    }
}

/// `namespace/name` of a VM document.
pub fn full_name(vm: &Value) -> String {
    format!(
        "{}/{}",
        vm["metadata"]["namespace"].as_str().unwrap_or(""),
        vm["metadata"]["name"].as_str().unwrap_or("")
    )
}

/// One VM to restore: the object to create and its disks.
#[derive(Debug, Clone, PartialEq)]
pub struct VmPlan {
    /// `namespace/name` in the backup.
    pub source: String,
    /// The VM to create (labelled with the restore's UID).
    pub vm: Value,
    /// (disk in the backup, DataVolume here).
    pub claims: Vec<(String, String)>,
    /// The source namespace (whose Secrets and ConfigMaps the VM references).
    pub source_namespace: String,
    /// Only `claims` are restored (`spec.virtualMachines[].volumes`): no VM, no Secrets or
    /// ConfigMaps.
    pub volumes_only: bool,
}

impl VmPlan {
    /// The name here.
    pub fn name(&self) -> &str {
        self.vm["metadata"]["name"].as_str().unwrap_or("")
    }
}

/// The VMs of the manifest to restore (all, or those `spec.virtualMachines` names, each
/// with its `newName`), moved into `own` namespace, relabelled; MAC addresses and firmware
/// UUID rewritten when asked (`macs`/`uuids` give fresh ones). An error names the field:
/// a VM not in the backup, two VMs restored under one name.
pub fn plan_vms(
    manifest_vms: &[Value],
    backup: &str,
    spec: &BackupRestoreSpec,
    own: &str,
    uid: &str,
    macs: &mut dyn FnMut() -> String,
    uuids: &mut dyn FnMut() -> String,
) -> Result<Vec<VmPlan>, String> {
    type Chosen<'a> = (&'a Value, Option<String>, Option<(usize, Vec<String>)>);
    let chosen: Vec<Chosen> = match &spec.virtual_machines {
        None => manifest_vms.iter().map(|v| (v, None, None)).collect(),
        Some(list) if list.is_empty() => manifest_vms.iter().map(|v| (v, None, None)).collect(),
        Some(list) => {
            let mut out = Vec::new();
            for (i, want) in list.iter().enumerate() {
                let vm = manifest_vms
                    .iter()
                    .find(|v| full_name(v) == want.name)
                    .ok_or_else(|| {
                        format!(
                            "spec.virtualMachines[{i}].name: VM {} is not in backup {backup} \
                             (it has {})",
                            want.name,
                            manifest_vms
                                .iter()
                                .map(full_name)
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    })?;
                let vols = want.volumes.clone().map(|v| (i, v));
                out.push((vm, want.new_name.clone(), vols));
            }
            out
        }
    };
    if chosen.is_empty() {
        return Err(format!("backup {backup} holds no VM"));
    }
    let mut plans: Vec<VmPlan> = Vec::new();
    for (vm, new_name, volumes) in chosen {
        let src_ns = vm["metadata"]["namespace"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let ns = target_namespace(&src_ns, spec.namespace_mapping.as_ref(), own)?;
        let (mut doc, mut claims) = restored_vm(vm, &ns, new_name.as_deref(), spec.start);
        if let Some((i, wanted)) = &volumes {
            claims = chosen_claims(vm, &claims, *i, wanted)?;
        }
        let uuid = spec.new_firmware_uuid.then(&mut *uuids);
        let macs: Option<&mut dyn FnMut() -> String> = if spec.new_mac_addresses {
            Some(&mut *macs)
        } else {
            None
        };
        ferrovirt_backup::restore::rewrite_identity(&mut doc, macs, uuid);
        label(&mut doc, uid);
        if let Some(a) = doc["metadata"].as_object_mut() {
            let ann = a.entry("annotations").or_insert_with(|| json!({}));
            if let Some(ann) = ann.as_object_mut() {
                ann.insert(
                    "backup.ferrovirt.io/restored-from".into(),
                    json!(format!("{backup}/{}", full_name(vm))),
                );
            }
        }
        let plan = VmPlan {
            source: full_name(vm),
            vm: doc,
            claims,
            source_namespace: src_ns,
            volumes_only: volumes.is_some(),
        };
        if let Some(other) = plans.iter().find(|p| p.name() == plan.name()) {
            return Err(format!(
                "spec.virtualMachines: {} and {} would both be restored as {}: give one a newName",
                other.source,
                plan.source,
                plan.name()
            ));
        }
        let dvs: Vec<&String> = plans
            .iter()
            .flat_map(|p| p.claims.iter().map(|c| &c.1))
            .collect();
        if let Some((_, dv)) = plan.claims.iter().find(|(_, dv)| dvs.contains(&dv)) {
            return Err(format!(
                "spec.virtualMachines: two VMs would restore a claim as {dv}: give one a newName"
            ));
        }
        plans.push(plan);
    }
    Ok(plans)
}

/// The claims named by `spec.virtualMachines[i].volumes` among a VM's `claims` (disk in the
/// backup `<vm>.<claim>`, DataVolume here), in the order asked; an unknown name is refused
/// naming the field and the claims the VM has (pure).
pub fn chosen_claims(
    vm: &Value,
    claims: &[(String, String)],
    i: usize,
    wanted: &[String],
) -> Result<Vec<(String, String)>, String> {
    let src = vm["metadata"]["name"].as_str().unwrap_or("");
    wanted
        .iter()
        .enumerate()
        .map(|(j, w)| {
            let disk = format!("{src}.{w}");
            claims
                .iter()
                .find(|(d, _)| *d == disk)
                .cloned()
                .ok_or_else(|| {
                    let has: Vec<&str> = claims
                        .iter()
                        .filter_map(|(d, _)| d.strip_prefix(&format!("{src}.")))
                        .collect();
                    format!(
                        "spec.virtualMachines[{i}].volumes[{j}]: VM {} has no claim {w} in the \
                         backup (it has {})",
                        full_name(vm),
                        has.join(", ")
                    )
                })
        })
        .collect()
}

/// Adds the restore's UID label to a document's metadata.
pub fn label(doc: &mut Value, uid: &str) {
    if !doc["metadata"]["labels"].is_object() {
        doc["metadata"]["labels"] = json!({});
    }
    doc["metadata"]["labels"][RESTORE_UID_LABEL] = json!(uid);
}

/// What an object found under a name the restore wants is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// Nothing there: create it.
    Absent,
    /// Created by this restore (an earlier attempt): use it.
    Ours,
    /// Someone else's: the restore fails naming it, never overwrites.
    Conflict,
}

/// Whether `existing` (its labels) was made by the restore with UID `uid`.
pub fn found(existing: Option<&Value>, uid: &str) -> Found {
    match existing {
        None => Found::Absent,
        Some(o) if o["metadata"]["labels"][RESTORE_UID_LABEL].as_str() == Some(uid) => Found::Ours,
        Some(_) => Found::Conflict,
    }
}

/// What to do with a Secret or ConfigMap the backup holds, given the object of that name here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectAction {
    Create,
    /// The same contents are here already (another restore of the same backup made it, or
    /// the original is still there): the VM uses it.
    Reuse,
    /// Different contents under the name: the restore fails naming it.
    Conflict,
}

/// Create the backed-up `wanted` object, reuse an identical one, or refuse a different one.
pub fn object_action(existing: Option<&Value>, wanted: &Value) -> ObjectAction {
    match existing {
        None => ObjectAction::Create,
        Some(e) => {
            let same = ["data", "binaryData", "type"].iter().all(|k| {
                e.get(*k).unwrap_or(&Value::Null) == wanted.get(*k).unwrap_or(&Value::Null)
            });
            if same {
                ObjectAction::Reuse
            } else {
                ObjectAction::Conflict
            }
        }
    }
}

/// The Secret or ConfigMap to create from its backed-up form: in `ns`, labelled.
pub fn object_to_create(obj: &Value, ns: &str, uid: &str) -> Value {
    let mut o = obj.clone();
    o["metadata"]["namespace"] = json!(ns);
    label(&mut o, uid);
    o
}

/// The DataVolume disk `disk` of `size` bytes is written into: an `upload` source (filled
/// by the restore, never by an upload), the size rounded up to MiB, access modes, volume mode
/// and storage class of the backed-up claim `claim` when it is in the backup (the class only
/// when `classes` has it here, else the default class), labelled with the restore's UID.
pub fn data_volume(
    name: &str,
    ns: &str,
    size: u64,
    claim: Option<&Value>,
    classes: &[String],
    uid: &str,
) -> Value {
    let mib = size.div_ceil(1 << 20).max(1);
    let mut storage = json!({"resources": {"requests": {"storage": format!("{mib}Mi")}}});
    if let Some(c) = claim {
        let spec = &c["spec"];
        if let Some(m) = spec.get("accessModes").filter(|m| m.is_array()) {
            storage["accessModes"] = m.clone();
        }
        if let Some(m) = spec["volumeMode"].as_str() {
            storage["volumeMode"] = json!(m);
        }
        if let Some(class) = spec["storageClassName"].as_str()
            && classes.iter().any(|c| c == class)
        {
            storage["storageClassName"] = json!(class);
        }
    }
    let mut dv = json!({
        "apiVersion": "cdi.kubevirt.io/v1beta1",
        "kind": "DataVolume",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"source": {"upload": {}}, "storage": storage},
    });
    label(&mut dv, uid);
    dv
}

/// The backed-up claim of a VM's disk `<vm>.<claim>` in source namespace `src_ns`.
pub fn backed_up_claim<'a>(
    objects: &'a [Value],
    src_ns: &str,
    disk: &str,
    vm: &str,
) -> Option<&'a Value> {
    let claim = disk.strip_prefix(&format!("{vm}."))?;
    objects.iter().find(|o| {
        o["kind"] == "PersistentVolumeClaim"
            && o["metadata"]["name"].as_str() == Some(claim)
            && o["metadata"]["namespace"].as_str().unwrap_or(src_ns) == src_ns
    })
}

/// What the controller does with a BackupRestore in `phase`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Succeeded or Failed: nothing.
    Done,
    /// Pending (new) or Running with no task in this process (the server restarted): run it
    /// from the start; what an earlier attempt created carries the restore's UID and is
    /// used, not refused.
    Run,
}

/// The step for a phase.
pub fn step(phase: Option<&str>) -> Step {
    match phase {
        Some(phase::SUCCEEDED) | Some(phase::FAILED) => Step::Done,
        _ => Step::Run,
    }
}

#[cfg(test)]
#[path = "restore_tests.rs"]
mod tests;
