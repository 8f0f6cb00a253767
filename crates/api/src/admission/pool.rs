//! Admission of VirtualMachinePools: `replicas` defaults to 1; the selector and the VM
//! template are required and the selector must select the template's labels; the template is
//! validated as the VMs made from it will be (defaulted first, errors under
//! `spec.virtualMachineTemplate`). Strategies ferrovirt does not carry out are refused naming
//! the field (honour or refuse): `autohealing`, a proactive `updateStrategy`, scale-in
//! `selectors` and any `statePreservation` other than `Disabled`.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::FieldError;
use super::{defaults, validate};
use crate::kubevirt::pool::{VirtualMachinePool, VirtualMachinePoolSelectionPolicy};
use crate::kubevirt::preset::selector_matches;
use crate::kubevirt::vm::VirtualMachine;

/// Sort policies of a selection policy (all carried out by the pool controller).
pub const SORT_POLICIES: &[&str] = &[
    "AscendingOrder",
    "DescendingOrder",
    "Newest",
    "Oldest",
    "Random",
];

/// Defaults applied to the JSON object: `spec.replicas: 1`.
pub(super) fn default_pool(obj: &mut Value) {
    if let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut)
        && spec.get("replicas").is_none_or(Value::is_null)
    {
        spec.insert("replicas".into(), json!(1));
    }
}

fn unsupported(field: &str, what: &str) -> FieldError {
    FieldError::not_supported(field, format!("{what} is not supported by ferrovirt"))
}

fn check_state_preservation(field: &str, value: Option<&String>, e: &mut Vec<FieldError>) {
    match value.map(String::as_str) {
        None | Some("Disabled") => {}
        Some("Offline" | "Online") => e.push(unsupported(
            field,
            "preserving the state of VMs removed by scale-in",
        )),
        Some(other) => e.push(FieldError::not_supported(
            field,
            format!("unsupported value {other:?}: supported values: \"Disabled\", \"Offline\", \"Online\""),
        )),
    }
}

fn check_selection(
    field: &str,
    p: Option<&VirtualMachinePoolSelectionPolicy>,
    e: &mut Vec<FieldError>,
) {
    let Some(p) = p else { return };
    if let Some(s) = &p.sort_policy
        && !SORT_POLICIES.contains(&s.as_str())
    {
        e.push(FieldError::not_supported(
            format!("{field}.sortPolicy"),
            format!("unsupported value {s:?}: supported values: {SORT_POLICIES:?}"),
        ));
    }
    if p.selectors.is_some() {
        e.push(unsupported(
            &format!("{field}.selectors"),
            "selecting VMs by label or node",
        ));
    }
}

fn check_max_unavailable(v: &Value, e: &mut Vec<FieldError>) {
    let field = "spec.maxUnavailable";
    let ok = match v {
        Value::Number(n) => n.as_i64().is_some_and(|n| n >= 0),
        Value::String(s) => s
            .strip_suffix('%')
            .and_then(|p| p.parse::<u32>().ok())
            .is_some_and(|p| p <= 100),
        _ => false,
    };
    if !ok {
        e.push(FieldError::invalid(
            field,
            "must be a non-negative integer or a percentage between 0% and 100%",
        ));
    }
}

/// Validate a type-checked pool object (after [`default_pool`]).
pub(super) fn validate_pool(obj: &Value, pool: &VirtualMachinePool) -> Vec<FieldError> {
    let mut e = Vec::new();
    let Some(spec) = &pool.spec else {
        e.push(FieldError::required("spec", "spec is required"));
        return e;
    };
    if let Some(r) = spec.replicas
        && r < 0
    {
        e.push(FieldError::invalid(
            "spec.replicas",
            "must be greater than or equal to 0",
        ));
    }
    let Some(template) = &spec.virtual_machine_template else {
        e.push(FieldError::required(
            "spec.virtualMachineTemplate",
            "virtualMachineTemplate is required",
        ));
        return e;
    };
    let labels: BTreeMap<String, String> = template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    match &spec.selector {
        None => e.push(FieldError::required(
            "spec.selector",
            "selector is required",
        )),
        Some(sel) if !selector_matches(sel, &labels) => e.push(FieldError::invalid(
            "spec.selector",
            "selector does not match the labels of spec.virtualMachineTemplate.metadata",
        )),
        Some(_) => {}
    }
    if let Some(v) = obj.pointer("/spec/maxUnavailable") {
        check_max_unavailable(v, &mut e);
    }
    if spec.autohealing.is_some() {
        e.push(unsupported("spec.autohealing", "replacing failing VMs"));
    }
    if let Some(u) = &spec.update_strategy {
        let set = [
            u.unmanaged.is_some(),
            u.opportunistic.is_some(),
            u.proactive.is_some(),
        ];
        if set.iter().filter(|s| **s).count() > 1 {
            e.push(FieldError::invalid(
                "spec.updateStrategy",
                "only one of unmanaged, opportunistic and proactive may be set",
            ));
        }
        if u.proactive.is_some() {
            e.push(unsupported(
                "spec.updateStrategy.proactive",
                "restarting VMs to update them (use opportunistic)",
            ));
        }
    }
    if let Some(s) = &spec.scale_in_strategy {
        let set = [
            s.unmanaged.is_some(),
            s.opportunistic.is_some(),
            s.proactive.is_some(),
        ];
        if set.iter().filter(|s| **s).count() > 1 {
            e.push(FieldError::invalid(
                "spec.scaleInStrategy",
                "only one of unmanaged, opportunistic and proactive may be set",
            ));
        }
        if let Some(o) = &s.opportunistic {
            check_state_preservation(
                "spec.scaleInStrategy.opportunistic.statePreservation",
                o.state_preservation.as_ref(),
                &mut e,
            );
        }
        if let Some(p) = &s.proactive {
            check_state_preservation(
                "spec.scaleInStrategy.proactive.statePreservation",
                p.state_preservation.as_ref(),
                &mut e,
            );
            check_selection(
                "spec.scaleInStrategy.proactive.selectionPolicy",
                p.selection_policy.as_ref(),
                &mut e,
            );
        }
    }
    e.extend(validate_template(obj));
    e
}

/// The template checked as a VirtualMachine made from it (defaulted first).
fn validate_template(obj: &Value) -> Vec<FieldError> {
    let Some(t) = obj.pointer("/spec/virtualMachineTemplate") else {
        return Vec::new();
    };
    let name = obj
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("pool");
    let mut vm = json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": format!("{name}-0"), "namespace": obj.pointer("/metadata/namespace")},
        "spec": t.get("spec").cloned().unwrap_or_else(|| json!({})),
    });
    let prefix = |mut f: FieldError| {
        f.field = format!("spec.virtualMachineTemplate.{}", f.field);
        f
    };
    let mut e: Vec<FieldError> = validate::vm_run_strategy_conflict(&vm)
        .into_iter()
        .map(prefix)
        .collect();
    defaults::default_vm_object(&mut vm);
    let mut vm = defaults::vm_for_validation(&vm);
    match super::parse_typed::<VirtualMachine>(&mut vm) {
        Ok(vm) => e.extend(validate::validate_vm(&vm).into_iter().map(prefix)),
        Err(err) => e.push(prefix(err)),
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::{Operation, admit};
    use crate::registry::find;

    fn pool(extra: Value) -> Value {
        let mut p = json!({
            "apiVersion": "pool.kubevirt.io/v1beta1", "kind": "VirtualMachinePool",
            "metadata": {"name": "p", "namespace": "default"},
            "spec": {
                "selector": {"matchLabels": {"app": "p"}},
                "virtualMachineTemplate": {
                    "metadata": {"labels": {"app": "p"}},
                    "spec": {"runStrategy": "Always", "template": {
                        "metadata": {"labels": {"app": "p"}},
                        "spec": {"domain": {"memory": {"guest": "128Mi"}, "devices": {}}}}}}}});
        if let (Some(spec), Some(extra)) = (p["spec"].as_object_mut(), extra.as_object()) {
            for (k, v) in extra {
                spec.insert(k.clone(), v.clone());
            }
        }
        p
    }

    fn fields(obj: &mut Value) -> Vec<String> {
        let def = find("pool.kubevirt.io", "virtualmachinepools").unwrap();
        match admit(&def, Operation::Create, obj, None) {
            Ok(()) => Vec::new(),
            Err(inv) => inv.0.into_iter().map(|f| f.field).collect(),
        }
    }

    #[test]
    fn a_plain_pool_is_admitted_with_one_replica() {
        let mut p = pool(json!({}));
        assert_eq!(fields(&mut p), Vec::<String>::new());
        assert_eq!(p["spec"]["replicas"], 1);
        assert!(
            p["spec"]["virtualMachineTemplate"]["spec"]["template"]["spec"]["domain"]
                .get("machine")
                .is_none(),
            "the stored template is not defaulted"
        );
    }

    #[test]
    fn refusals_name_their_fields() {
        let mut p = pool(json!({"replicas": -1, "selector": {"matchLabels": {"app": "other"}}}));
        assert_eq!(fields(&mut p), vec!["spec.replicas", "spec.selector"]);
        let mut p = pool(
            json!({"autohealing": {}, "updateStrategy": {"proactive": {}},
            "maxUnavailable": "120%",
            "scaleInStrategy": {"proactive": {"statePreservation": "Online",
                "selectionPolicy": {"sortPolicy": "Biggest", "selectors": {}}}}}),
        );
        assert_eq!(
            fields(&mut p),
            vec![
                "spec.maxUnavailable",
                "spec.autohealing",
                "spec.updateStrategy.proactive",
                "spec.scaleInStrategy.proactive.statePreservation",
                "spec.scaleInStrategy.proactive.selectionPolicy.sortPolicy",
                "spec.scaleInStrategy.proactive.selectionPolicy.selectors",
            ]
        );
        let mut p = pool(json!({}));
        p["spec"]["virtualMachineTemplate"]["spec"]["running"] = json!(true);
        assert_eq!(
            fields(&mut p),
            vec!["spec.virtualMachineTemplate.spec.running"]
        );
        let mut p = pool(json!({}));
        p["spec"]
            .as_object_mut()
            .unwrap()
            .remove("virtualMachineTemplate");
        assert_eq!(fields(&mut p), vec!["spec.virtualMachineTemplate"]);
    }

    #[test]
    fn supported_strategies_pass() {
        let mut p = pool(
            json!({"maxUnavailable": 1, "updateStrategy": {"opportunistic": {}},
            "nameGeneration": {"appendIndexToConfigMapRefs": true, "appendIndexToSecretRefs": false},
            "scaleInStrategy": {"proactive": {"statePreservation": "Disabled",
                "selectionPolicy": {"sortPolicy": "Oldest"}}}}),
        );
        assert_eq!(fields(&mut p), Vec::<String>::new());
    }
}
