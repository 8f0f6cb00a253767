//! virtctl's `expand`: a VirtualMachine with its instancetype and preference inlined into the
//! template (via `ferrovirt_api::expand::expand`) and the references removed.

use std::path::Path;

use ferrovirt_api::kubevirt::instancetype::{InstancetypeSpec, PreferenceSpec};
use ferrovirt_api::kubevirt::vmi::VirtualMachineInstanceSpec;
use serde_json::Value;

use crate::error::{Cause, CliError};
use crate::session::Session;

fn decode<T: serde::de::DeserializeOwned>(v: &Value, what: &str) -> Result<T, CliError> {
    serde_json::from_value(v.clone()).map_err(|e| CliError::Usage(format!("decoding {what}: {e}")))
}

/// The expanded VM (pure): `instancetype` and `preference` are the referenced objects.
pub fn expand_vm(
    vm: &Value,
    instancetype: Option<&Value>,
    preference: Option<&Value>,
) -> Result<Value, CliError> {
    let template: VirtualMachineInstanceSpec = decode(
        vm["spec"]["template"].get("spec").unwrap_or(&Value::Null),
        "spec.template.spec",
    )?;
    let it: Option<InstancetypeSpec> = instancetype
        .map(|o| decode(&o["spec"], "the instancetype"))
        .transpose()?;
    let pref: Option<PreferenceSpec> = preference
        .map(|o| decode(&o["spec"], "the preference"))
        .transpose()?;
    let spec =
        ferrovirt_api::expand::expand(&template, it.as_ref(), pref.as_ref()).map_err(|inv| {
            CliError::Server(Box::new(crate::error::ServerError {
                code: 422,
                reason: "Invalid".into(),
                message: String::new(),
                kind: "VirtualMachine".into(),
                name: vm["metadata"]["name"].as_str().unwrap_or_default().into(),
                causes: inv
                    .0
                    .into_iter()
                    .map(|e| Cause {
                        field: e.field,
                        message: e.message,
                    })
                    .collect(),
            }))
        })?;
    let mut out = vm.clone();
    out["spec"]["template"]["spec"] = serde_json::to_value(spec).unwrap_or_default();
    if let Some(s) = out["spec"].as_object_mut() {
        s.remove("instancetype");
        s.remove("preference");
    }
    if let Some(s) = out.as_object_mut() {
        s.remove("status");
    }
    Ok(out)
}

/// (apiVersion, kind) of a matcher's target; cluster-wide kinds by default.
pub fn matcher_kind(m: &Value, preference: bool) -> String {
    m["kind"]
        .as_str()
        .filter(|k| !k.is_empty())
        .map(String::from)
        .unwrap_or_else(|| {
            if preference {
                "VirtualMachineClusterPreference".into()
            } else {
                "VirtualMachineClusterInstancetype".into()
            }
        })
}

async fn referenced(s: &Session, vm: &Value, key: &str) -> Result<Option<Value>, CliError> {
    let m = &vm["spec"][key];
    let Some(name) = m["name"].as_str() else {
        return Ok(None);
    };
    let kind = matcher_kind(m, key == "preference");
    let r = s
        .catalog
        .by_kind("instancetype.kubevirt.io/v1beta1", &kind)?
        .clone();
    let ns = vm["metadata"]["namespace"].as_str();
    Ok(Some(s.get_object(&r, ns, name).await?))
}

/// `expand --vm NAME` or `expand -f FILE`: the expanded VM.
pub async fn run(
    s: &Session,
    vm_name: Option<&str>,
    file: Option<&Path>,
) -> Result<Value, CliError> {
    let vm = match (vm_name, file) {
        (Some(n), None) => {
            let r = s.resolve("virtualmachines.kubevirt.io")?;
            s.get_object(&r, None, n).await?
        }
        (None, Some(f)) => crate::apply::read_manifests(f)?
            .into_iter()
            .next()
            .ok_or_else(|| CliError::Usage("no VirtualMachine in the file".into()))?,
        _ => {
            return Err(CliError::Usage(
                "expand needs either --vm NAME or -f FILE".into(),
            ));
        }
    };
    let it = referenced(s, &vm, "instancetype").await?;
    let pref = referenced(s, &vm, "preference").await?;
    expand_vm(&vm, it.as_ref(), pref.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn inlines_instancetype() {
        let vm = json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "v"},
            "spec": {"instancetype": {"name": "small"}, "runStrategy": "Halted",
                     "template": {"spec": {"domain": {"devices": {}}}}}});
        let it = json!({"spec": {"cpu": {"guest": 2}, "memory": {"guest": "256Mi"}}});
        let out = expand_vm(&vm, Some(&it), None).unwrap();
        assert!(out["spec"].get("instancetype").is_none());
        let d = &out["spec"]["template"]["spec"]["domain"];
        assert_eq!(d["memory"]["guest"], "256Mi", "{out}");
        assert_eq!(out["spec"]["runStrategy"], "Halted");
        assert_eq!(
            matcher_kind(&json!({}), true),
            "VirtualMachineClusterPreference"
        );
        assert_eq!(
            matcher_kind(&json!({"kind": "VirtualMachineInstancetype"}), false),
            "VirtualMachineInstancetype"
        );
    }

    #[test]
    fn conflicts_name_the_field() {
        let vm = json!({"metadata": {"name": "v"}, "spec": {"instancetype": {"name": "small"},
            "template": {"spec": {"domain": {"devices": {}, "memory": {"guest": "1Gi"}}}}}});
        let it = json!({"spec": {"cpu": {"guest": 2}, "memory": {"guest": "256Mi"}}});
        let e = expand_vm(&vm, Some(&it), None).unwrap_err().to_string();
        assert!(e.contains("spec.template.spec.domain.memory"), "{e}");
    }
}
