//! Defaulting, as KubeVirt's mutating webhooks do it, applied to the JSON object so that
//! fields ferrovirt does not model are preserved.

use serde_json::{Map, Value, json};

/// Namespace for firmware UUIDs derived from `namespace/name` (UUID v5).
const FIRMWARE_UUID_NAMESPACE: uuid::Uuid = uuid::Uuid::from_bytes([
    0x6f, 0x1e, 0x8a, 0x52, 0x3c, 0x0b, 0x4d, 0x8e, 0x9a, 0x41, 0x2f, 0x7c, 0x55, 0x0e, 0x1d, 0x93,
]);

/// The stable firmware UUID of the VM or VMI `namespace/name`.
pub fn firmware_uuid(namespace: &str, name: &str) -> String {
    uuid::Uuid::new_v5(
        &FIRMWARE_UUID_NAMESPACE,
        format!("{namespace}/{name}").as_bytes(),
    )
    .to_string()
}

/// Which defaults [`default_vmi_spec`] applies.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VmiDefaults {
    /// `domain.machine.type: q35`.
    pub machine_type: bool,
    /// Disk target `disk: {}` when none given, bus `virtio` (cdrom `sata`, lun `scsi`).
    pub disk_bus: bool,
    /// Pod network with a masquerade interface named `default`.
    pub pod_network: bool,
    /// Memory guest/requests from each other, CPU topology ones.
    pub resources: bool,
    /// Set `domain.firmware.uuid` to this when unset.
    pub firmware_uuid: Option<String>,
    /// `terminationGracePeriodSeconds: 180` when unset.
    pub termination_grace_period: bool,
    /// A disk (`disk: {}`) for every volume that nothing else uses.
    pub disks_for_volumes: bool,
}

impl VmiDefaults {
    /// Everything on.
    pub fn all(firmware_uuid: Option<String>) -> Self {
        VmiDefaults {
            machine_type: true,
            disk_bus: true,
            pod_network: true,
            resources: true,
            firmware_uuid,
            termination_grace_period: true,
            disks_for_volumes: true,
        }
    }
}

/// KubeVirt's default grace period for VMIs.
pub const DEFAULT_TERMINATION_GRACE_PERIOD_SECONDS: i64 = 180;

/// Apply defaults to a VMI spec (`spec` of a VMI, or a VM's `spec.template.spec`). Values of
/// the wrong JSON type are left alone (validation reports them).
pub fn default_vmi_spec(spec: &mut Value, d: &VmiDefaults) {
    let Some(spec) = spec.as_object_mut() else {
        return;
    };
    if d.termination_grace_period && is_unset(spec.get("terminationGracePeriodSeconds")) {
        spec.insert(
            "terminationGracePeriodSeconds".into(),
            json!(DEFAULT_TERMINATION_GRACE_PERIOD_SECONDS),
        );
    }
    let Some(domain) = child(spec, "domain") else {
        return;
    };
    if d.machine_type
        && let Some(machine) = child(domain, "machine")
        && is_unset_str(machine.get("type"))
    {
        machine.insert("type".into(), json!("q35"));
    }
    if let Some(uuid) = &d.firmware_uuid
        && let Some(firmware) = child(domain, "firmware")
        && is_unset_str(firmware.get("uuid"))
    {
        firmware.insert("uuid".into(), json!(uuid));
    }
    if d.resources {
        default_memory(domain);
        default_cpu(domain);
    }
    if d.disks_for_volumes {
        default_disks_for_volumes(spec);
    }
    let Some(domain) = child(spec, "domain") else {
        return;
    };
    if d.disk_bus
        && let Some(devices) = child(domain, "devices")
        && let Some(Value::Array(disks)) = devices.get_mut("disks")
    {
        disks.iter_mut().for_each(default_disk);
    }
    if d.pod_network {
        default_pod_network(spec);
    }
}

/// As KubeVirt's mutating webhook does: a volume that no disk, filesystem or ACPI table uses
/// gets a disk of its name (`disk: {}`; the bus is defaulted like any other disk's).
/// Memory-dump and container-path volumes never become disks.
fn default_disks_for_volumes(spec: &mut Map<String, Value>) {
    let names = |v: Option<&Value>| -> Vec<String> {
        v.and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|d| d.get("name").and_then(Value::as_str).map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let domain = spec.get("domain");
    let devices = domain.and_then(|d| d.get("devices"));
    let mut used = names(devices.and_then(|d| d.get("disks")));
    used.extend(names(devices.and_then(|d| d.get("filesystems"))));
    if let Some(acpi) = domain
        .and_then(|d| d.get("firmware"))
        .and_then(|f| f.get("acpi"))
        .and_then(Value::as_object)
    {
        used.extend(acpi.values().filter_map(Value::as_str).map(str::to_string));
    }
    let missing: Vec<String> = spec
        .get("volumes")
        .and_then(Value::as_array)
        .map(|vols| {
            vols.iter()
                .filter(|v| v.get("memoryDump").is_none() && v.get("containerPath").is_none())
                .filter_map(|v| v.get("name").and_then(Value::as_str))
                .filter(|n| !n.is_empty() && !used.iter().any(|u| u == n))
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    if missing.is_empty() {
        return;
    }
    let Some(devices) = child(spec, "domain").and_then(|d| child(d, "devices")) else {
        return;
    };
    let slot = devices.entry("disks").or_insert_with(|| json!([]));
    if slot.is_null() {
        *slot = json!([]);
    }
    if let Value::Array(disks) = slot {
        for n in missing {
            disks.push(json!({"name": n, "disk": {}}));
        }
    }
}

fn is_unset(v: Option<&Value>) -> bool {
    matches!(v, None | Some(Value::Null))
}

fn is_unset_str(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s.is_empty(),
        _ => false,
    }
}

/// The object at `key`, created (or replacing `null`) when absent; `None` if another type.
fn child<'a>(m: &'a mut Map<String, Value>, key: &str) -> Option<&'a mut Map<String, Value>> {
    let slot = m.entry(key).or_insert_with(|| Value::Object(Map::new()));
    if slot.is_null() {
        *slot = Value::Object(Map::new());
    }
    slot.as_object_mut()
}

fn default_memory(domain: &mut Map<String, Value>) {
    // Only touch existing sections: a VMI without any memory size is reported by validation.
    let limit = domain
        .get("resources")
        .and_then(|r| r.get("limits"))
        .and_then(|l| l.get("memory"))
        .cloned();
    let mut request = domain
        .get("resources")
        .and_then(|r| r.get("requests"))
        .and_then(|l| l.get("memory"))
        .cloned();
    let guest = domain.get("memory").and_then(|m| m.get("guest")).cloned();
    if is_unset(request.as_ref())
        && let Some(limit) = limit.filter(|v| !v.is_null())
        && let Some(requests) = child(domain, "resources").and_then(|r| child(r, "requests"))
    {
        requests.insert("memory".into(), limit.clone());
        request = Some(limit);
    }
    match (
        request.filter(|v| !v.is_null()),
        guest.filter(|v| !v.is_null()),
    ) {
        (Some(req), None) => {
            if let Some(memory) = child(domain, "memory") {
                memory.insert("guest".into(), req);
            }
        }
        (None, Some(guest)) => {
            if let Some(requests) = child(domain, "resources").and_then(|r| child(r, "requests")) {
                requests.insert("memory".into(), guest);
            }
        }
        _ => {}
    }
}

fn default_cpu(domain: &mut Map<String, Value>) {
    let Some(Value::Object(cpu)) = domain.get_mut("cpu") else {
        return;
    };
    let keys = ["cores", "sockets", "threads"];
    if keys.iter().any(|k| !is_unset(cpu.get(*k))) {
        for k in keys {
            if is_unset(cpu.get(k)) {
                cpu.insert(k.into(), json!(1));
            }
        }
    }
}

fn default_disk(disk: &mut Value) {
    let Some(disk) = disk.as_object_mut() else {
        return;
    };
    let targets = [("disk", "virtio"), ("cdrom", "sata"), ("lun", "scsi")];
    if targets.iter().all(|(k, _)| is_unset(disk.get(*k))) {
        disk.insert("disk".into(), Value::Object(Map::new()));
    }
    for (k, bus) in targets {
        if let Some(Value::Object(target)) = disk.get_mut(k)
            && is_unset_str(target.get("bus"))
        {
            target.insert("bus".into(), json!(bus));
        }
    }
}

fn is_empty_list(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::Array(a)) => a.is_empty(),
        _ => false,
    }
}

fn default_pod_network(spec: &mut Map<String, Value>) {
    if !is_empty_list(spec.get("networks")) {
        return;
    }
    let Some(devices) = child(spec, "domain").and_then(|d| child(d, "devices")) else {
        return;
    };
    if devices.get("autoattachPodInterface") == Some(&Value::Bool(false))
        || !is_empty_list(devices.get("interfaces"))
    {
        return;
    }
    devices.insert(
        "interfaces".into(),
        json!([{"name": "default", "masquerade": {}}]),
    );
    spec.insert("networks".into(), json!([{"name": "default", "pod": {}}]));
}

fn meta_str<'a>(obj: &'a Value, key: &str) -> &'a str {
    obj.get("metadata")
        .and_then(|m| m.get(key))
        .and_then(Value::as_str)
        .unwrap_or("")
}

fn uuid_for(obj: &Value) -> Option<String> {
    let name = meta_str(obj, "name");
    (!name.is_empty()).then(|| firmware_uuid(meta_str(obj, "namespace"), name))
}

/// Defaults of a whole VirtualMachineInstance object.
pub(super) fn default_vmi_object(obj: &mut Value) {
    let d = VmiDefaults::all(uuid_for(obj));
    if let Some(spec) = obj.get_mut("spec") {
        default_vmi_spec(spec, &d);
    }
}

/// Defaults of the VMI template at `path` (e.g. a replica set's `spec.template.spec`).
pub(super) fn default_template_at(obj: &mut Value, path: &[&str], with_uuid: bool) {
    let uuid = if with_uuid { uuid_for(obj) } else { None };
    let d = VmiDefaults {
        termination_grace_period: false,
        ..VmiDefaults::all(uuid)
    };
    let mut cur = obj;
    for p in path {
        match cur.get_mut(*p) {
            Some(next) => cur = next,
            None => return,
        }
    }
    default_vmi_spec(cur, &d);
}

/// Defaults KubeVirt's VirtualMachine mutating webhook writes into the stored VM: the machine
/// type (unless a preference decides it) and the firmware UUID. Everything else (memory guest
/// size, CPU topology, the pod network interface, disk buses, disks for volumes) is a VMI
/// default: the VMI the VM controller creates gets it at its own admission, so a later change
/// of e.g. `resources.requests.memory` reaches the next VMI. `running` is kept as written (it is
/// deprecated but served).
pub(super) fn default_vm_object(obj: &mut Value) {
    let uuid = uuid_for(obj);
    let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut) else {
        return;
    };
    let has_preference = !is_unset(spec.get("preference"));
    let d = VmiDefaults {
        machine_type: !has_preference,
        disk_bus: false,
        pod_network: false,
        resources: false,
        firmware_uuid: uuid,
        termination_grace_period: false,
        disks_for_volumes: false,
    };
    if let Some(template_spec) = spec.get_mut("template").and_then(|t| t.get_mut("spec")) {
        default_vmi_spec(template_spec, &d);
    }
}

/// The VM as validation sees it: a copy whose template has every VMI default the VMI created
/// from it would get (except those an instancetype or preference decides), so a template that
/// could only yield an invalid VMI is refused at the VM's admission, as before the stored VM
/// stopped carrying those defaults.
pub(super) fn vm_for_validation(obj: &Value) -> Value {
    let mut obj = obj.clone();
    let uuid = uuid_for(&obj);
    let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut) else {
        return obj;
    };
    let has_instancetype = !is_unset(spec.get("instancetype"));
    let has_preference = !is_unset(spec.get("preference"));
    let d = VmiDefaults {
        machine_type: !has_preference,
        disk_bus: !has_preference,
        pod_network: !has_preference,
        resources: !has_instancetype,
        firmware_uuid: uuid,
        termination_grace_period: false,
        disks_for_volumes: true,
    };
    if let Some(template_spec) = spec.get_mut("template").and_then(|t| t.get_mut("spec")) {
        default_vmi_spec(template_spec, &d);
    }
    obj
}
