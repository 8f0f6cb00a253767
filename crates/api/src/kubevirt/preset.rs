//! VirtualMachineInstancePreset (kubevirt.io/v1, deprecated in KubeVirt but served): domain
//! settings merged into every new VMI whose labels the preset's selector matches, as KubeVirt's
//! mutating webhook did. [`apply_presets`] is the pure merge the API server runs on VMI
//! creation, before defaulting:
//!
//! - a VMI annotated `virtualmachineinstancepresets.admission.kubevirt.io/exclude: "true"` is
//!   left alone;
//! - presets are applied in name order; two matching presets that set the same field to
//!   different values refuse the VMI, naming the field and both presets;
//! - a field the VMI already sets differently keeps the VMI's value and produces a warning
//!   ("Unable to apply VirtualMachineInstancePreset …"), as KubeVirt's Conflict event says;
//! - each preset that contributed (or matched without conflict) is recorded as the annotation
//!   `virtualmachineinstancepreset.kubevirt.io/<name>: kubevirt.io/v1`, and any matching preset
//!   adds `presets.virtualmachineinstances.kubevirt.io/presets-applied: kubevirt.io/v1`.
//!
//! Objects merge key by key, lists of named items (disks, interfaces, …) by `name`; any other
//! value is a leaf. Quantities compare by value (`1Gi` equals `1024Mi`).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde_json::{Map, Value};

use super::domain::DomainSpec;
use crate::admission::FieldError;

/// Annotation prefix recording one applied preset.
pub const PRESET_ANNOTATION_PREFIX: &str = "virtualmachineinstancepreset.kubevirt.io/";
/// Annotation set once presets were considered for a VMI.
pub const PRESETS_APPLIED: &str = "presets.virtualmachineinstances.kubevirt.io/presets-applied";
/// Annotation that opts a VMI out of presets (`"true"`).
pub const EXCLUDE_ANNOTATION: &str = "virtualmachineinstancepresets.admission.kubevirt.io/exclude";
/// The value of the applied-preset annotations.
pub const PRESET_API_VERSION: &str = "kubevirt.io/v1";

resource! {
    /// Domain settings for the VMIs its selector matches.
    VirtualMachineInstancePreset, PresetSpec
}

kstruct! {
    /// Which VMIs and what to merge into their domain.
    pub struct PresetSpec {
        /// Absent: every VMI in the namespace.
        pub selector: Option<LabelSelector>,
        pub domain: Option<DomainSpec>,
    }
}

/// What applying presets did to a VMI.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PresetOutcome {
    /// Names of the presets recorded as applied.
    pub applied: Vec<String>,
    /// One message per preset field the VMI overrode.
    pub warnings: Vec<String>,
}

/// Whether a metav1 `LabelSelector` selects `labels` (an empty selector selects everything,
/// an unknown operator nothing).
pub fn selector_matches(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let by_labels = selector
        .match_labels
        .as_ref()
        .is_none_or(|m| m.iter().all(|(k, v)| labels.get(k) == Some(v)));
    by_labels
        && selector
            .match_expressions
            .as_deref()
            .unwrap_or_default()
            .iter()
            .all(|req| {
                let values = req.values.as_deref().unwrap_or_default();
                let value = labels.get(&req.key);
                match req.operator.as_str() {
                    "In" => value.is_some_and(|v| values.contains(v)),
                    "NotIn" => value.is_none_or(|v| !values.contains(v)),
                    "Exists" => value.is_some(),
                    "DoesNotExist" => value.is_none(),
                    _ => false,
                }
            })
}

fn labels_of(obj: &Value) -> BTreeMap<String, String> {
    obj.pointer("/metadata/labels")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

fn name_of(obj: &Value) -> &str {
    obj.pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default()
}

/// The presets (JSON objects, as stored) that select `vmi`, in name order.
pub fn matching_presets<'a>(vmi: &Value, presets: &'a [Value]) -> Vec<&'a Value> {
    let labels = labels_of(vmi);
    let mut out: Vec<&Value> = presets
        .iter()
        .filter(|p| match p.pointer("/spec/selector") {
            None | Some(Value::Null) => true,
            Some(sel) => serde_json::from_value::<LabelSelector>(sel.clone())
                .is_ok_and(|s| selector_matches(&s, &labels)),
        })
        .collect();
    out.sort_by(|a, b| name_of(a).cmp(name_of(b)));
    out
}

/// Merge the matching `presets` into `vmi` (a full VMI object). `Err` names every field two
/// presets disagree on; the VMI is then unchanged.
pub fn apply_presets(vmi: &mut Value, presets: &[Value]) -> Result<PresetOutcome, Vec<FieldError>> {
    let excluded = vmi
        .pointer(&format!(
            "/metadata/annotations/{}",
            EXCLUDE_ANNOTATION.replace('/', "~1")
        ))
        .and_then(Value::as_str)
        == Some("true");
    if excluded {
        return Ok(PresetOutcome::default());
    }
    let matching = matching_presets(vmi, presets);
    if matching.is_empty() {
        return Ok(PresetOutcome::default());
    }
    let empty = Value::Object(Map::new());
    let domain_of = |p: &Value| p.pointer("/spec/domain").cloned().unwrap_or(empty.clone());
    // Presets must agree with each other.
    let mut errors = Vec::new();
    for (i, a) in matching.iter().enumerate() {
        for b in &matching[i + 1..] {
            let mut diffs = Vec::new();
            differences(&domain_of(a), &domain_of(b), "spec.domain", &mut diffs);
            errors.extend(diffs.into_iter().map(|(field, x, y)| {
                let msg = format!(
                    "VirtualMachineInstancePresets {:?} ({x}) and {:?} ({y}) conflict",
                    name_of(a),
                    name_of(b)
                );
                FieldError::invalid(field, msg)
            }));
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    let mut outcome = PresetOutcome::default();
    let Some(spec) = vmi
        .as_object_mut()
        .map(|m| m.entry("spec").or_insert_with(|| Value::Object(Map::new())))
    else {
        return Ok(outcome);
    };
    if !spec.is_object() {
        return Ok(outcome);
    }
    let domain = spec
        .as_object_mut()
        .map(|m| {
            m.entry("domain")
                .or_insert_with(|| Value::Object(Map::new()))
        })
        .expect("spec is an object");
    for p in &matching {
        let mut conflicts = Vec::new();
        let changed = merge(domain, &domain_of(p), "spec.domain", &mut conflicts);
        let name = name_of(p).to_string();
        for (field, vmi_value, preset_value) in &conflicts {
            outcome.warnings.push(format!(
                "Unable to apply VirtualMachineInstancePreset {name:?}: {field}: {vmi_value} != {preset_value} (the VMI's value is kept)"
            ));
        }
        if changed || conflicts.is_empty() {
            outcome.applied.push(name);
        }
    }
    let annotations = vmi
        .as_object_mut()
        .and_then(|m| {
            m.entry("metadata")
                .or_insert_with(|| Value::Object(Map::new()))
                .as_object_mut()
        })
        .and_then(|m| {
            m.entry("annotations")
                .or_insert_with(|| Value::Object(Map::new()))
                .as_object_mut()
        });
    if let Some(a) = annotations {
        a.insert(PRESETS_APPLIED.into(), PRESET_API_VERSION.into());
        for name in &outcome.applied {
            a.insert(
                format!("{PRESET_ANNOTATION_PREFIX}{name}"),
                PRESET_API_VERSION.into(),
            );
        }
    }
    Ok(outcome)
}

/// Whether a list holds named objects (merged by `name`).
fn named_list(items: &[Value]) -> bool {
    !items.is_empty()
        && items
            .iter()
            .all(|i| i.get("name").and_then(Value::as_str).is_some())
}

fn named<'a>(items: &'a [Value], name: &str) -> Option<(usize, &'a Value)> {
    items
        .iter()
        .enumerate()
        .find(|(_, i)| i.get("name").and_then(Value::as_str) == Some(name))
}

/// Two leaves are the same setting (quantities compare by value).
fn same_leaf(a: &Value, b: &Value) -> bool {
    if a == b {
        return true;
    }
    let as_text = |v: &Value| match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    };
    match (as_text(a), as_text(b)) {
        (Some(x), Some(y)) => match (crate::quantity::parse(&x), crate::quantity::parse(&y)) {
            (Ok(x), Ok(y)) => x == y,
            _ => false,
        },
        _ => false,
    }
}

/// Fields both `a` and `b` set to different values: (path, a's value, b's value).
fn differences(a: &Value, b: &Value, path: &str, out: &mut Vec<(String, String, String)>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for (k, va) in x {
                if let Some(vb) = y.get(k) {
                    differences(va, vb, &format!("{path}.{k}"), out);
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if named_list(x) && named_list(y) => {
            for (i, item) in x.iter().enumerate() {
                let name = item["name"].as_str().unwrap_or_default();
                if let Some((_, other)) = named(y, name) {
                    differences(item, other, &format!("{path}[{i}]"), out);
                }
            }
        }
        _ if same_leaf(a, b) => {}
        _ => out.push((path.to_string(), a.to_string(), b.to_string())),
    }
}

/// Adds what `src` sets and `dst` lacks; fields set in both to different values are kept
/// from `dst` and listed in `conflicts`. Returns whether `dst` changed.
fn merge(
    dst: &mut Value,
    src: &Value,
    path: &str,
    conflicts: &mut Vec<(String, String, String)>,
) -> bool {
    match (&mut *dst, src) {
        (Value::Object(d), Value::Object(s)) => {
            let mut changed = false;
            for (k, sv) in s {
                match d.get_mut(k) {
                    Some(dv) => changed |= merge(dv, sv, &format!("{path}.{k}"), conflicts),
                    None => {
                        d.insert(k.clone(), sv.clone());
                        changed = true;
                    }
                }
            }
            changed
        }
        (Value::Array(d), Value::Array(s)) if named_list(s) && (d.is_empty() || named_list(d)) => {
            let mut changed = false;
            for item in s {
                let name = item["name"].as_str().unwrap_or_default().to_string();
                let found = named(d, &name).map(|(i, _)| i);
                match found {
                    Some(i) => {
                        changed |= merge(&mut d[i], item, &format!("{path}[{i}]"), conflicts);
                    }
                    None => {
                        d.push(item.clone());
                        changed = true;
                    }
                }
            }
            changed
        }
        (d, s) if same_leaf(d, s) => false,
        (d, s) => {
            conflicts.push((path.to_string(), d.to_string(), s.to_string()));
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn preset(name: &str, selector: Value, domain: Value) -> Value {
        json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstancePreset",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"selector": selector, "domain": domain}})
    }

    fn vmi(labels: Value, domain: Value) -> Value {
        json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "v", "namespace": "default", "labels": labels},
            "spec": {"domain": domain}})
    }

    fn ann<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
        v["metadata"]["annotations"][key].as_str()
    }

    #[test]
    fn matching_preset_fills_unset_fields_and_annotates() {
        let p = preset(
            "small",
            json!({"matchLabels": {"kubevirt.io/size": "small"}}),
            json!({"resources": {"requests": {"memory": "64M"}}, "cpu": {"cores": 2}}),
        );
        let mut v = vmi(
            json!({"kubevirt.io/size": "small"}),
            json!({"devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]}}),
        );
        let out = apply_presets(&mut v, &[p]).unwrap();
        assert_eq!(out.applied, vec!["small".to_string()]);
        assert!(out.warnings.is_empty());
        assert_eq!(
            v["spec"]["domain"]["resources"]["requests"]["memory"],
            "64M"
        );
        assert_eq!(v["spec"]["domain"]["cpu"]["cores"], 2);
        assert_eq!(v["spec"]["domain"]["devices"]["disks"][0]["name"], "root");
        assert_eq!(
            ann(&v, "virtualmachineinstancepreset.kubevirt.io/small"),
            Some("kubevirt.io/v1")
        );
        assert_eq!(ann(&v, PRESETS_APPLIED), Some("kubevirt.io/v1"));
    }

    #[test]
    fn non_matching_and_excluded_vmis_are_untouched() {
        let p = preset(
            "p",
            json!({"matchExpressions": [{"key": "os", "operator": "In", "values": ["win10"]}]}),
            json!({"cpu": {"cores": 4}}),
        );
        let mut v = vmi(json!({"os": "linux"}), json!({}));
        let before = v.clone();
        assert_eq!(
            apply_presets(&mut v, std::slice::from_ref(&p)).unwrap(),
            PresetOutcome::default()
        );
        assert_eq!(v, before);
        let mut v = vmi(json!({"os": "win10"}), json!({}));
        v["metadata"]["annotations"] = json!({EXCLUDE_ANNOTATION: "true"});
        let before = v.clone();
        apply_presets(&mut v, &[p]).unwrap();
        assert_eq!(v, before);
    }

    #[test]
    fn a_preset_without_selector_matches_every_vmi() {
        let p = json!({"metadata": {"name": "all"}, "spec": {"domain": {"cpu": {"sockets": 1}}}});
        let mut v = vmi(json!({}), json!({}));
        assert_eq!(apply_presets(&mut v, &[p]).unwrap().applied, vec!["all"]);
        assert_eq!(v["spec"]["domain"]["cpu"]["sockets"], 1);
    }

    #[test]
    fn the_vmi_wins_a_conflict_with_a_warning_and_no_annotation() {
        let p = preset(
            "example-preset",
            json!({"matchLabels": {"flavor": "x"}}),
            json!({"cpu": {"cores": 4}}),
        );
        let mut v = vmi(json!({"flavor": "x"}), json!({"cpu": {"cores": 6}}));
        let out = apply_presets(&mut v, &[p]).unwrap();
        assert_eq!(v["spec"]["domain"]["cpu"]["cores"], 6);
        assert!(out.applied.is_empty());
        assert_eq!(out.warnings.len(), 1);
        assert!(
            out.warnings[0].contains("spec.domain.cpu.cores: 6 != 4"),
            "{}",
            out.warnings[0]
        );
        assert_eq!(
            ann(
                &v,
                "virtualmachineinstancepreset.kubevirt.io/example-preset"
            ),
            None
        );
    }

    #[test]
    fn presets_that_disagree_refuse_the_vmi_naming_the_field() {
        let sel = json!({"matchLabels": {"a": "b"}});
        let p1 = preset("one", sel.clone(), json!({"cpu": {"cores": 2}}));
        let p2 = preset("two", sel, json!({"cpu": {"cores": 4}}));
        let mut v = vmi(json!({"a": "b"}), json!({}));
        let before = v.clone();
        let errs = apply_presets(&mut v, &[p2, p1]).unwrap_err();
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].field, "spec.domain.cpu.cores");
        assert!(
            errs[0].message.contains("\"one\"") && errs[0].message.contains("\"two\""),
            "{}",
            errs[0].message
        );
        assert_eq!(v, before);
    }

    #[test]
    fn equal_settings_and_equal_quantities_do_not_conflict() {
        let sel = json!({"matchLabels": {"a": "b"}});
        let p1 = preset("one", sel.clone(), json!({"memory": {"guest": "1Gi"}}));
        let p2 = preset("two", sel, json!({"memory": {"guest": "1024Mi"}}));
        let mut v = vmi(json!({"a": "b"}), json!({}));
        let out = apply_presets(&mut v, &[p1, p2]).unwrap();
        assert_eq!(out.applied, vec!["one", "two"]);
        assert_eq!(v["spec"]["domain"]["memory"]["guest"], "1Gi");
    }

    #[test]
    fn named_lists_merge_by_name() {
        let p = preset(
            "disks",
            json!({}),
            json!({"devices": {"disks": [
                {"name": "root", "disk": {"bus": "virtio"}},
                {"name": "data", "disk": {"bus": "virtio"}}]}}),
        );
        let mut v = vmi(
            json!({}),
            json!({"devices": {"disks": [{"name": "root", "disk": {"bus": "sata"}}]}}),
        );
        let out = apply_presets(&mut v, &[p]).unwrap();
        let disks = v["spec"]["domain"]["devices"]["disks"].as_array().unwrap();
        assert_eq!(disks.len(), 2);
        assert_eq!(disks[0]["disk"]["bus"], "sata");
        assert_eq!(disks[1]["name"], "data");
        assert_eq!(out.applied, vec!["disks"]);
        assert!(out.warnings[0].contains("spec.domain.devices.disks[0].disk.bus"));
    }
}
