//! KubeVirt's common cluster instancetypes and preferences (the u1, o1, cx1, m1, n1 series and
//! the OS preferences), deployed and kept by the controllers while the KubeVirt CR's
//! `configuration.commonInstancetypesDeployment.enabled` is not `false` (HyperConverged
//! `spec.commonInstancetypesDeployment` maps to it), as virt-operator does. Pure: the bundle
//! ([`bundle`], from `assets/common-*.yaml`, written by `scripts/gen-corpus-common.py` from
//! KubeVirt's published tables) and the plan that brings the cluster to it ([`plan`]).
//!
//! An object of a bundle name that does not carry [`MANAGED_BY`] = [`MANAGER`] is someone
//! else's and is never touched; one that does is written back when its spec or labels were
//! edited, and deleted when the deployment is turned off.

use std::collections::BTreeMap;

use serde_json::{Value, json};

/// The label that marks a deployed object as ours.
pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// Its value (virt-operator deploys the common instancetypes in KubeVirt).
pub const MANAGER: &str = "virt-operator";
/// The API version of the bundle's objects.
pub const API_VERSION: &str = "instancetype.kubevirt.io/v1beta1";
/// Cluster instancetypes: kind and plural.
pub const INSTANCETYPE: (&str, &str) = (
    "VirtualMachineClusterInstancetype",
    "virtualmachineclusterinstancetypes",
);
/// Cluster preferences: kind and plural.
pub const PREFERENCE: (&str, &str) = (
    "VirtualMachineClusterPreference",
    "virtualmachineclusterpreferences",
);

const INSTANCETYPES_YAML: &str = include_str!("../../assets/common-instancetypes.yaml");
const PREFERENCES_YAML: &str = include_str!("../../assets/common-preferences.yaml");

/// Every object of the bundle, labelled as ours (parsed from the embedded YAML).
pub fn bundle() -> Vec<Value> {
    let mut out = Vec::new();
    for text in [INSTANCETYPES_YAML, PREFERENCES_YAML] {
        for doc in text.split("\n---") {
            let Ok(mut v) = crate::yaml::from_str::<Value>(doc) else {
                continue;
            };
            if !v.is_object() {
                continue;
            }
            let labels = &mut v["metadata"]["labels"];
            if !labels.is_object() {
                *labels = json!({});
            }
            labels[MANAGED_BY] = json!(MANAGER);
            out.push(v);
        }
    }
    out
}

/// Whether the common instancetypes are deployed for a KubeVirt CR `spec` (default: yes).
pub fn enabled(kubevirt_spec: Option<&Value>) -> bool {
    kubevirt_spec
        .and_then(|s| s.pointer("/configuration/commonInstancetypesDeployment/enabled"))
        .and_then(Value::as_bool)
        .unwrap_or(true)
}

/// One step towards the bundle.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Create this object.
    Create(Value),
    /// Replace the stored object with this one (its resourceVersion kept); `fields` were
    /// edited away from the bundle.
    Replace { obj: Value, fields: Vec<String> },
    /// Delete the object of this kind and name (the deployment was turned off).
    Delete { kind: String, name: String },
}

fn key(v: &Value) -> (String, String) {
    let s = |p: &str| {
        v.pointer(p)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    (s("/kind"), s("/metadata/name"))
}

fn ours(v: &Value) -> bool {
    v.pointer("/metadata/labels")
        .and_then(|l| l.get(MANAGED_BY))
        .and_then(Value::as_str)
        == Some(MANAGER)
}

/// What brings `actual` (the stored cluster instancetypes and preferences) to `desired` (the
/// bundle) when `enabled`, or removes what we deployed when not.
pub fn plan(desired: &[Value], actual: &[Value], enabled: bool) -> Vec<Step> {
    let stored: BTreeMap<(String, String), &Value> = actual.iter().map(|a| (key(a), a)).collect();
    let mut out = Vec::new();
    for d in desired {
        let k = key(d);
        let current = stored.get(&k);
        if !enabled {
            if current.is_some_and(|a| ours(a)) {
                out.push(Step::Delete {
                    kind: k.0,
                    name: k.1,
                });
            }
            continue;
        }
        let Some(a) = current else {
            out.push(Step::Create(d.clone()));
            continue;
        };
        if !ours(a) {
            continue;
        }
        let mut fields = Vec::new();
        if a.get("spec") != d.get("spec") {
            fields.push("spec".to_string());
        }
        let want = d.pointer("/metadata/labels").and_then(Value::as_object);
        let have = a.pointer("/metadata/labels").and_then(Value::as_object);
        for (l, v) in want.into_iter().flatten() {
            if have.and_then(|h| h.get(l)) != Some(v) {
                fields.push(format!("metadata.labels.{l}"));
            }
        }
        if fields.is_empty() {
            continue;
        }
        let mut obj = (*a).clone();
        obj["spec"] = d["spec"].clone();
        if let Some(w) = want {
            let labels = &mut obj["metadata"]["labels"];
            for (l, v) in w {
                labels[l] = v.clone();
            }
        }
        if let Some(m) = obj.as_object_mut() {
            m.remove("status");
        }
        out.push(Step::Replace { obj, fields });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named<'a>(all: &'a [Value], name: &str) -> &'a Value {
        all.iter()
            .find(|v| v.pointer("/metadata/name").and_then(Value::as_str) == Some(name))
            .unwrap_or_else(|| panic!("{name} missing"))
    }

    #[test]
    fn the_bundle_holds_the_series_and_the_os_preferences() {
        let all = bundle();
        let kinds = |k: &str| all.iter().filter(|v| v["kind"] == k).count();
        assert_eq!(
            kinds(INSTANCETYPE.0),
            35,
            "u1, o1 × 9 sizes; cx1, n1 × 6; m1 × 5"
        );
        assert!(kinds(PREFERENCE.0) >= 30);
        let small = named(&all, "u1.small");
        assert_eq!(small["apiVersion"], API_VERSION);
        assert_eq!(small["spec"]["cpu"]["guest"], 1);
        assert_eq!(small["spec"]["memory"]["guest"], "2Gi");
        assert_eq!(small["metadata"]["labels"][MANAGED_BY], MANAGER);
        assert_eq!(
            named(&all, "o1.medium")["spec"]["memory"]["overcommitPercent"],
            50
        );
        for p in [
            "fedora",
            "alpine",
            "centos.stream9",
            "rhel.9",
            "windows.2k22",
        ] {
            assert_eq!(named(&all, p)["kind"], PREFERENCE.0, "{p}");
        }
    }

    #[test]
    fn deployment_is_on_unless_turned_off() {
        assert!(enabled(None));
        assert!(enabled(Some(&json!({"configuration": {}}))));
        let off = json!({"configuration": {"commonInstancetypesDeployment": {"enabled": false}}});
        assert!(!enabled(Some(&off)));
    }

    #[test]
    fn the_plan_creates_reverts_edits_leaves_foreign_objects_and_removes_when_off() {
        let desired = bundle();
        // Nothing stored: everything is created.
        let steps = plan(&desired, &[], true);
        assert_eq!(steps.len(), desired.len());
        assert!(steps.iter().all(|s| matches!(s, Step::Create(_))));
        // All stored as sent, plus status and a resourceVersion: nothing to do.
        let mut stored: Vec<Value> = desired
            .iter()
            .map(|d| {
                let mut a = d.clone();
                a["metadata"]["resourceVersion"] = json!("7");
                a
            })
            .collect();
        assert_eq!(plan(&desired, &stored, true), vec![]);
        // An edited spec is written back, keeping the resourceVersion.
        let i = stored
            .iter()
            .position(|a| a["metadata"]["name"] == "u1.small")
            .unwrap();
        stored[i]["spec"]["cpu"]["guest"] = json!(64);
        match plan(&desired, &stored, true).as_slice() {
            [Step::Replace { obj, fields }] => {
                assert_eq!(fields, &vec!["spec".to_string()]);
                assert_eq!(obj["spec"]["cpu"]["guest"], 1);
                assert_eq!(obj["metadata"]["resourceVersion"], "7");
            }
            other => panic!("{other:?}"),
        }
        // A same-named object without our label belongs to someone else: left alone.
        stored[i]["metadata"]["labels"] = json!({});
        assert_eq!(plan(&desired, &stored, true), vec![]);
        // Turned off: ours are deleted, the foreign one stays.
        let steps = plan(&desired, &stored, false);
        assert_eq!(steps.len(), desired.len() - 1);
        assert!(!steps.contains(&Step::Delete {
            kind: INSTANCETYPE.0.into(),
            name: "u1.small".into()
        }));
    }
}
