//! Named CPU models the KubeVirt way (docs/hyperconverged.md "CPU models"), pure: the Node
//! labels KubeVirt's node-labeller writes (`cpu-model.node.kubevirt.io/<Model>`,
//! `cpu-model-migration.node.kubevirt.io/<Model>`, `host-model-cpu.node.kubevirt.io/<Model>`),
//! the KubeVirt CR's `spec.configuration.cpuModel` (the cluster default, applied to a VMI
//! without `spec.domain.cpu.model` at creation, as KubeVirt's VMI mutating webhook does) and
//! `spec.configuration.obsoleteCPUModels` (models no node offers), and which VMI models need a
//! node label at all (every model but `host-model` and `host-passthrough`).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::vmi::VirtualMachineInstance;

/// KubeVirt's label of a node that can run the named CPU model (`…/<Model>=true`).
pub const CPU_MODEL_LABEL: &str = "cpu-model.node.kubevirt.io/";
/// KubeVirt's label of a model a `host-model` guest of this node can migrate to.
pub const CPU_MODEL_MIGRATION_LABEL: &str = "cpu-model-migration.node.kubevirt.io/";
/// KubeVirt's label naming a node's own CPU model (what `host-model` becomes there).
pub const HOST_MODEL_LABEL: &str = "host-model-cpu.node.kubevirt.io/";
/// The guest gets the host's CPU model with its features (KubeVirt's default).
pub const HOST_MODEL: &str = "host-model";
/// The guest gets the host CPU as it is.
pub const HOST_PASSTHROUGH: &str = "host-passthrough";

/// The CPU models KubeVirt treats as obsolete when its CR names none (KubeVirt's
/// `DefaultObsoleteCPUModels`; HCO always adds the same list).
pub const DEFAULT_OBSOLETE_CPU_MODELS: &[&str] = &[
    "486",
    "pentium",
    "pentium2",
    "pentium3",
    "pentiumpro",
    "coreduo",
    "n270",
    "core2duo",
    "Conroe",
    "athlon",
    "phenom",
    "qemu64",
    "qemu32",
    "kvm64",
    "kvm32",
];

/// Whether `model` names a CPU model a node must offer by label (not `host-model` or
/// `host-passthrough`, not empty).
pub fn is_named(model: &str) -> bool {
    !model.is_empty() && model != HOST_MODEL && model != HOST_PASSTHROUGH
}

/// The VMI's `spec.domain.cpu.model`, when set and not empty.
pub fn vmi_model(vmi: &VirtualMachineInstance) -> Option<&str> {
    vmi.spec
        .as_ref()
        .and_then(|s| s.domain.cpu.as_ref())
        .and_then(|c| c.model.as_deref())
        .filter(|m| !m.is_empty())
}

/// Whether `model` can be a label name's last segment and a QEMU `-cpu` name: 1–63
/// characters, alphanumerics, `-`, `_`, `.`, beginning and ending alphanumeric.
pub fn valid_name(model: &str) -> bool {
    let b = model.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// The cluster's default CPU model: `spec.configuration.cpuModel` of the first of `crs`
/// (whole KubeVirt objects, the HyperConverged's own first) that sets one.
pub fn default_model<'a>(crs: impl IntoIterator<Item = &'a Value>) -> Option<String> {
    crs.into_iter().find_map(|cr| {
        cr.pointer("/spec/configuration/cpuModel")
            .and_then(Value::as_str)
            .filter(|m| !m.is_empty())
            .map(str::to_string)
    })
}

/// The obsolete CPU models: `spec.configuration.obsoleteCPUModels` (model → true) of the first
/// of `crs` that has the map; KubeVirt's [`DEFAULT_OBSOLETE_CPU_MODELS`] when none has it.
pub fn obsolete_models<'a>(crs: impl IntoIterator<Item = &'a Value>) -> BTreeSet<String> {
    crs.into_iter()
        .find_map(|cr| {
            cr.pointer("/spec/configuration/obsoleteCPUModels")
                .and_then(Value::as_object)
        })
        .map(|m| {
            m.iter()
                .filter(|(_, on)| on.as_bool() == Some(true))
                .map(|(k, _)| k.clone())
                .collect()
        })
        .unwrap_or_else(|| {
            DEFAULT_OBSOLETE_CPU_MODELS
                .iter()
                .map(|m| m.to_string())
                .collect()
        })
}

/// Gives a VMI (JSON, at creation) without `spec.domain.cpu.model` the cluster's `default`
/// model; returns whether it changed anything. Without a default the model stays unset.
pub fn apply_default_model(vmi: &mut Value, default: Option<&str>) -> bool {
    let Some(default) = default.filter(|d| !d.is_empty()) else {
        return false;
    };
    let Some(domain) = vmi
        .pointer_mut("/spec/domain")
        .and_then(Value::as_object_mut)
    else {
        return false;
    };
    let cpu = domain
        .entry("cpu")
        .or_insert_with(|| Value::Object(Default::default()));
    if cpu.is_null() {
        *cpu = Value::Object(Default::default());
    }
    let Some(cpu) = cpu.as_object_mut() else {
        return false;
    };
    let set = cpu
        .get("model")
        .and_then(Value::as_str)
        .is_some_and(|m| !m.is_empty());
    if set {
        return false;
    }
    cpu.insert("model".into(), Value::String(default.to_string()));
    true
}

/// The CPU-model labels of a node whose QEMU runs `usable` models, as a merge patch of its
/// labels: `true` for each usable model that is not obsolete (`cpu-model.…` and
/// `cpu-model-migration.…`), `None` (remove) for each usable but obsolete one, as KubeVirt's
/// node-labeller leaves obsolete models off.
pub fn node_labels(
    usable: &BTreeSet<String>,
    obsolete: &BTreeSet<String>,
) -> BTreeMap<String, Option<String>> {
    let mut out = BTreeMap::new();
    for m in usable.iter().filter(|m| valid_name(m)) {
        let value = (!obsolete.contains(m)).then(|| "true".to_string());
        for prefix in [CPU_MODEL_LABEL, CPU_MODEL_MIGRATION_LABEL] {
            out.insert(format!("{prefix}{m}"), value.clone());
        }
    }
    out
}

/// Whether `labels` (a node's) offer `model` (`cpu-model.node.kubevirt.io/<model>=true`).
pub fn node_offers(labels: Option<&BTreeMap<String, String>>, model: &str) -> bool {
    labels
        .and_then(|l| l.get(&format!("{CPU_MODEL_LABEL}{model}")))
        .is_some_and(|v| v == "true")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn set(items: &[&str]) -> BTreeSet<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn named_models_and_names() {
        assert!(is_named("Westmere"));
        assert!(!is_named("host-model") && !is_named("host-passthrough") && !is_named(""));
        assert!(valid_name("Skylake-Client-noTSX-IBRS") && valid_name("486"));
        assert!(valid_name("Opteron_G1"));
        assert!(!valid_name("a,b") && !valid_name("-x") && !valid_name(&"x".repeat(64)));
    }

    #[test]
    fn default_and_obsolete_from_the_crs() {
        let owned = json!({"spec": {"configuration": {
            "cpuModel": "Westmere",
            "obsoleteCPUModels": {"486": true, "Nehalem": true, "Penryn": false}}}});
        let other = json!({"spec": {"configuration": {"cpuModel": "Penryn"}}});
        assert_eq!(default_model([&owned, &other]).as_deref(), Some("Westmere"));
        assert_eq!(default_model([&other, &owned]).as_deref(), Some("Penryn"));
        assert_eq!(default_model([&json!({"spec": {}})]), None);
        assert_eq!(obsolete_models([&other, &owned]), set(&["486", "Nehalem"]));
        let none = obsolete_models([&other]);
        assert!(none.contains("Conroe") && none.len() == DEFAULT_OBSOLETE_CPU_MODELS.len());
    }

    #[test]
    fn the_default_is_applied_only_to_a_vmi_without_a_model() {
        let mut v = json!({"spec": {"domain": {"devices": {}}}});
        assert!(apply_default_model(&mut v, Some("Westmere")));
        assert_eq!(v["spec"]["domain"]["cpu"]["model"], "Westmere");
        let mut v = json!({"spec": {"domain": {"cpu": {"cores": 2, "model": ""}}}});
        assert!(apply_default_model(&mut v, Some("host-passthrough")));
        assert_eq!(
            v["spec"]["domain"]["cpu"],
            json!({"cores": 2, "model": "host-passthrough"})
        );
        let mut v = json!({"spec": {"domain": {"cpu": {"model": "Nehalem"}}}});
        assert!(!apply_default_model(&mut v, Some("Westmere")));
        assert_eq!(v["spec"]["domain"]["cpu"]["model"], "Nehalem");
        let mut v = json!({"spec": {"domain": {"cpu": null}}});
        assert!(!apply_default_model(&mut v, None));
        assert!(v["spec"]["domain"]["cpu"].is_null());
    }

    #[test]
    fn labels_leave_obsolete_models_off() {
        let l = node_labels(&set(&["Westmere", "Nehalem", "a,b"]), &set(&["Nehalem"]));
        assert_eq!(
            l.get("cpu-model.node.kubevirt.io/Westmere"),
            Some(&Some("true".into()))
        );
        assert_eq!(
            l.get("cpu-model-migration.node.kubevirt.io/Westmere"),
            Some(&Some("true".into()))
        );
        assert_eq!(l.get("cpu-model.node.kubevirt.io/Nehalem"), Some(&None));
        assert_eq!(l.len(), 4, "{l:?}");
        let mut labels = BTreeMap::new();
        labels.insert(
            "cpu-model.node.kubevirt.io/Westmere".to_string(),
            "true".to_string(),
        );
        assert!(node_offers(Some(&labels), "Westmere"));
        assert!(!node_offers(Some(&labels), "Nehalem") && !node_offers(None, "Westmere"));
    }
}
