//! clone.kubevirt.io/v1beta1: VirtualMachineClone — a new VM made from a VM or from a
//! VirtualMachineSnapshot (docs/snapshots.md, "Clone"), and its admission.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::TypedLocalObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::vmi::Condition;
use crate::admission::FieldError;

resource! {
    /// A request to copy a VM (or a snapshot of one) into a new VM.
    VirtualMachineClone, CloneSpec, CloneStatus
}

kstruct! {
    /// What to clone and how the copy differs.
    pub struct CloneSpec {
        /// The VirtualMachine (kubevirt.io) or VirtualMachineSnapshot (snapshot.kubevirt.io)
        /// to copy.
        pub source: TypedLocalObjectReference,
        /// The new VirtualMachine; a name is generated when it is left out.
        pub target: Option<TypedLocalObjectReference>,
        /// Which of the source's annotations the target gets (`*` all, `!key` none of these,
        /// a trailing `*` a prefix); all when empty.
        pub annotation_filters: Option<Vec<String>>,
        /// Which of the source's labels the target gets (as `annotationFilters`).
        pub label_filters: Option<Vec<String>>,
        /// Filters for the VM template's labels and annotations.
        pub template: Option<CloneTemplateFilters>,
        /// New MAC addresses by interface name; interfaces not named get a new one generated.
        pub new_mac_addresses: Option<BTreeMap<String, String>>,
        /// The target's SMBIOS serial; generated when left out.
        #[serde(rename = "newSMBiosSerial")]
        pub new_sm_bios_serial: Option<String>,
        /// JSON patch operations (one JSON object each) applied to the target VM.
        pub patches: Option<Vec<String>>,
        /// How the target's volumes are named: `RandomizeNames` (default) or
        /// `PrefixTargetName`.
        pub volume_name_policy: Option<String>,
    }
}

kstruct! {
    /// Label and annotation filters of the VM template.
    pub struct CloneTemplateFilters {
        pub annotation_filters: Option<Vec<String>>,
        pub label_filters: Option<Vec<String>>,
    }
}

kstruct! {
    /// Progress of a clone.
    pub struct CloneStatus {
        /// The intermediate snapshot (of a VM source).
        pub snapshot_name: Option<String>,
        /// The intermediate restore.
        pub restore_name: Option<String>,
        /// The new VM.
        pub target_name: Option<String>,
        pub creation_timestamp: Option<Time>,
        /// `SnapshotInProgress`, `CreatingTargetVM`, `RestoreInProgress`, `Succeeded`,
        /// `Failed`, `Unknown`.
        pub phase: Option<String>,
        /// `Ready`, `Progressing`.
        pub conditions: Option<Vec<Condition>>,
    }
}

/// Whether `key` passes `filters` (KubeVirt's rules): no filters keep everything; otherwise the
/// last filter that matches decides, `!` negating; `*` matches all, `prefix*` a prefix.
pub fn filter_keeps(filters: &[String], key: &str) -> bool {
    if filters.is_empty() {
        return true;
    }
    let mut keep = false;
    for f in filters {
        let (neg, pat) = match f.strip_prefix('!') {
            Some(p) => (true, p),
            None => (false, f.as_str()),
        };
        let hit = match pat.strip_suffix('*') {
            Some(prefix) => key.starts_with(prefix),
            None => key == pat,
        };
        if hit {
            keep = !neg;
        }
    }
    keep
}

/// A MAC address in colon form (`-` separators, as Go's `net.ParseMAC` accepts, become `:`),
/// or `None` when it is not one.
pub fn normalize_mac(m: &str) -> Option<String> {
    let colon = m.replace('-', ":").to_ascii_lowercase();
    valid_mac(&colon).then_some(colon)
}

fn valid_mac(m: &str) -> bool {
    let parts: Vec<&str> = m.split(':').collect();
    parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Admission of a VirtualMachineClone: the source and target kinds, the volume name policy,
/// MAC addresses and patches — each refusal names its field.
pub fn validate(obj: &serde_json::Value) -> Vec<FieldError> {
    let mut e = Vec::new();
    let spec = &obj["spec"];
    let src_kind = spec["source"]["kind"].as_str().unwrap_or("");
    let src_group = spec["source"]["apiGroup"].as_str();
    match (src_kind, src_group) {
        ("VirtualMachine", None | Some("kubevirt.io"))
        | ("VirtualMachineSnapshot", None | Some("snapshot.kubevirt.io")) => {}
        _ => e.push(FieldError::not_supported(
            "spec.source",
            format!(
                "{src_kind:?} of group {:?}: supported: VirtualMachine (kubevirt.io), VirtualMachineSnapshot (snapshot.kubevirt.io)",
                src_group.unwrap_or("")
            ),
        )),
    }
    if spec["source"]["name"].as_str().unwrap_or("").is_empty() {
        e.push(FieldError::required("spec.source.name", "name is required"));
    }
    if spec.get("target").is_some_and(|t| !t.is_null()) {
        let kind = spec["target"]["kind"].as_str().unwrap_or("");
        if kind != "VirtualMachine" {
            e.push(FieldError::not_supported(
                "spec.target.kind",
                format!("{kind:?}: supported values: \"VirtualMachine\""),
            ));
        }
        if let Some(g) = spec["target"]["apiGroup"].as_str()
            && g != "kubevirt.io"
        {
            e.push(FieldError::not_supported(
                "spec.target.apiGroup",
                format!("{g:?}: supported values: \"kubevirt.io\""),
            ));
        }
    }
    if let Some(p) = spec["volumeNamePolicy"].as_str()
        && !matches!(p, "RandomizeNames" | "PrefixTargetName")
    {
        e.push(FieldError::not_supported(
            "spec.volumeNamePolicy",
            format!("{p:?}: supported values: \"RandomizeNames\", \"PrefixTargetName\""),
        ));
    }
    if let Some(m) = spec["newMacAddresses"].as_object() {
        for (iface, mac) in m {
            if mac.as_str().and_then(normalize_mac).is_none() {
                e.push(FieldError::invalid(
                    format!("spec.newMacAddresses.{iface}"),
                    format!("{mac} is not a MAC address"),
                ));
            }
        }
    }
    for (i, p) in spec["patches"].as_array().into_iter().flatten().enumerate() {
        let ok = p
            .as_str()
            .and_then(|s| serde_json::from_str::<json_patch::PatchOperation>(s).ok())
            .is_some();
        if !ok {
            e.push(FieldError::invalid(
                format!("spec.patches[{i}]"),
                "not a JSON patch operation",
            ));
        }
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn f(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn filters_follow_kubevirt() {
        assert!(filter_keeps(&[], "a"));
        assert!(filter_keeps(&f(&["*"]), "a"));
        assert!(!filter_keeps(&f(&["*", "!a"]), "a"));
        assert!(filter_keeps(&f(&["*", "!a"]), "b"));
        assert!(filter_keeps(&f(&["app.io/*"]), "app.io/x"));
        assert!(!filter_keeps(&f(&["app.io/*"]), "other"));
        assert!(!filter_keeps(&f(&["*", "!app.io/*"]), "app.io/x"));
    }

    #[test]
    fn admission_names_the_field() {
        let ok = json!({"spec": {"source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "a"},
            "target": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "b"},
            "newMacAddresses": {"default": "02:00:00:00:00:01"},
            "patches": ["{\"op\": \"add\", \"path\": \"/metadata/labels/x\", \"value\": \"y\"}"]}});
        assert_eq!(validate(&ok), vec![]);
        assert_eq!(
            normalize_mac("00-11-22-AA-BB-CC").as_deref(),
            Some("00:11:22:aa:bb:cc")
        );
        let snap = json!({"spec": {"source": {"apiGroup": "snapshot.kubevirt.io", "kind": "VirtualMachineSnapshot", "name": "s"}}});
        assert_eq!(validate(&snap), vec![]);
        let bad = json!({"spec": {"source": {"kind": "Pod", "name": ""},
            "target": {"kind": "Pod"}, "volumeNamePolicy": "Keep",
            "newMacAddresses": {"default": "nope"}, "patches": ["{]"]}});
        let fields: Vec<String> = validate(&bad).into_iter().map(|e| e.field).collect();
        assert_eq!(
            fields,
            [
                "spec.source",
                "spec.source.name",
                "spec.target.kind",
                "spec.volumeNamePolicy",
                "spec.newMacAddresses.default",
                "spec.patches[0]"
            ]
        );
    }
}
