//! HyperConverged admission, pure: HCO's defaults filled in, only the one HyperConverged
//! (`kubevirt-hyperconverged` in `kubevirt-hyperconverged`, as HCO's webhook allows), and every
//! spec field ferrovirt does not carry out refused naming the field (honour or refuse; the
//! list is in docs/hyperconverged.md).

use serde_json::Value;

use super::desired::{
    EXTENSION_KUBEVIRT_GATES, HARDCODED_KUBEVIRT_GATES, HCO_NAME, HCO_TO_KUBEVIRT_GATES,
    PLATFORM_NAMESPACE, defaults, fill_defaults,
};
use crate::admission::{FieldError, Operation};
use crate::kubevirt::cpu_model;

/// HCO's feature gates (camelCase) that ferrovirt accepts only while off, with the reason.
const HCO_GATES_OFF_ONLY: &[&str] = &[
    "deployKubeSecondaryDNS",
    "downwardMetrics",
    "withHostPassthroughCPU",
    "persistentReservation",
    "autoResourceLimits",
    "alignCPUs",
    "decentralizedLiveMigration",
    "enableApplicationAwareQuota",
    "deployVmConsoleProxy",
    "deployTektonTaskResources",
    "enableManagedTenantQuota",
    "nonRoot",
    "sriovLiveMigration",
    "primaryUserDefinedNetworkBinding",
    "enableMultiArchBootImageImport",
    "declarativeHotplugVolumes",
    "videoConfig",
    "objectGraph",
];

/// HCO gates whose `true` ferrovirt satisfies: no common boot images are published, so there
/// is nothing to import; ferrovirt never configures mediated devices.
const HCO_GATES_ANY: &[&str] = &["enableCommonBootImageImport", "disableMDevConfiguration"];

/// Spec fields carried out (docs/hyperconverged.md lists what each does).
const HONOURED: &[&str] = &[
    "featureGates",
    "liveMigrationConfig",
    "evictionStrategy",
    "storageImport",
    "nodeFailure",
    "commonTemplatesNamespace",
    "infra",
    "workloads",
    "resourceRequirements",
    "higherWorkloadDensity",
    "commonInstancetypesDeployment",
    "defaultCPUModel",
    "obsoleteCPUs",
    "permittedHostDevices",
];

/// `storageImport` fields carried out.
const STORAGE_IMPORT: &[&str] = &[
    "insecureRegistries",
    "transferStallTimeoutSeconds",
    "transferTimeoutSeconds",
    "allowedImportCIDRs",
];

const EVICTION_STRATEGIES: &[&str] = &["None", "LiveMigrate", "LiveMigrateIfPossible", "External"];

/// Fill HCO's defaults into a HyperConverged being admitted.
pub fn default_object(obj: &mut Value) {
    fill_defaults(obj);
}

/// Every problem of a (defaulted) HyperConverged being admitted.
pub fn validate(obj: &Value, op: Operation) -> Vec<FieldError> {
    let mut e = Vec::new();
    if op == Operation::Create {
        let name = obj.pointer("/metadata/name").and_then(Value::as_str);
        let ns = obj.pointer("/metadata/namespace").and_then(Value::as_str);
        if ns != Some(PLATFORM_NAMESPACE) {
            e.push(FieldError::invalid(
                "metadata.namespace",
                format!("the HyperConverged lives in the {PLATFORM_NAMESPACE} namespace"),
            ));
        }
        if name != Some(HCO_NAME) {
            e.push(FieldError::invalid(
                "metadata.name",
                format!("the one HyperConverged is named {HCO_NAME}"),
            ));
        }
    }
    let Some(spec) = obj.get("spec").and_then(Value::as_object) else {
        return e;
    };
    let defaults = defaults();
    for (k, v) in spec {
        let field = format!("spec.{k}");
        if v.is_null() {
            continue;
        }
        if let Some(d) = defaults.get(k)
            && !HONOURED.contains(&k.as_str())
        {
            if v != d {
                e.push(FieldError::not_supported(
                    field,
                    format!("ferrovirt carries out only HCO's default here ({d})"),
                ));
            }
            continue;
        }
        match k.as_str() {
            "featureGates" => check_gates(v, &mut e),
            "evictionStrategy" => {
                if !v.as_str().is_some_and(|s| EVICTION_STRATEGIES.contains(&s)) {
                    e.push(FieldError::not_supported(
                        field,
                        format!("supported values: {}", EVICTION_STRATEGIES.join(", ")),
                    ));
                }
            }
            "storageImport" => {
                for key in v.as_object().into_iter().flat_map(|m| m.keys()) {
                    if !STORAGE_IMPORT.contains(&key.as_str()) {
                        e.push(FieldError::not_supported(
                            format!("spec.storageImport.{key}"),
                            "not carried out by ferrovirt",
                        ));
                    }
                }
            }
            "resourceRequirements" => check_sub(v, &field, &[("vmiCPUAllocationRatio", 1)], &mut e),
            "higherWorkloadDensity" => {
                check_sub(v, &field, &[("memoryOvercommitPercentage", 10)], &mut e)
            }
            "commonInstancetypesDeployment" => match v.as_object() {
                Some(m) => {
                    for (key, x) in m {
                        let f = format!("{field}.{key}");
                        match key.as_str() {
                            "enabled" if x.is_boolean() || x.is_null() => {}
                            "enabled" => e.push(FieldError::type_invalid(f, "must be a boolean")),
                            _ => {
                                e.push(FieldError::not_supported(f, "not carried out by ferrovirt"))
                            }
                        }
                    }
                }
                None => e.push(FieldError::type_invalid(field, "must be an object")),
            },
            "defaultCPUModel" => match v.as_str() {
                Some(m) if cpu_model::valid_name(m) => {}
                Some(_) => e.push(FieldError::invalid(field, CPU_MODEL_NAME)),
                None => e.push(FieldError::type_invalid(field, "must be a string")),
            },
            "obsoleteCPUs" => check_obsolete_cpus(v, &field, &mut e),
            "permittedHostDevices" => {
                crate::kubevirt::host_devices::validate_hco(v, &field, &mut e)
            }
            "workloads" => check_workloads_placement(v, &field, &mut e),
            "infra" => {
                let placement = v.get("nodePlacement").filter(|p| !p.is_null());
                let empty = placement.is_none_or(|p| p.as_object().is_some_and(|m| m.is_empty()));
                if !empty {
                    e.push(FieldError::not_supported(
                        format!("{field}.nodePlacement"),
                        "ferrovirt's components run where the administrator starts them; \
                         node placement is not carried out",
                    ));
                }
            }
            k if HONOURED.contains(&k) => {}
            _ => e.push(FieldError::not_supported(
                field,
                "not carried out by ferrovirt (docs/hyperconverged.md lists what is)",
            )),
        }
    }
    e
}

/// `workloads.nodePlacement`: `nodeSelector` (a string map) and `affinity.nodeAffinity`
/// (its required terms are honoured by the scheduler: VMs run only on the nodes they select;
/// preferred terms would only say where the handler prefers to run, which changes nothing)
/// pass; `tolerations` and pod (anti-)affinity are refused: ferrovirt's agents run where the
/// administrator starts them.
fn check_workloads_placement(v: &Value, field: &str, e: &mut Vec<FieldError>) {
    let Some(p) = v.get("nodePlacement").filter(|p| !p.is_null()) else {
        return;
    };
    let field = format!("{field}.nodePlacement");
    let Some(m) = p.as_object() else {
        e.push(FieldError::type_invalid(field, "must be an object"));
        return;
    };
    for (k, x) in m {
        let f = format!("{field}.{k}");
        match k.as_str() {
            "nodeSelector" => {
                let strings = x
                    .as_object()
                    .is_some_and(|m| m.values().all(Value::is_string));
                if !strings && !x.is_null() {
                    e.push(FieldError::type_invalid(f, "must be a map of strings"));
                }
            }
            "affinity" => {
                for (a, _) in x.as_object().into_iter().flatten() {
                    if a != "nodeAffinity" {
                        e.push(FieldError::not_supported(
                            format!("{f}.{a}"),
                            "only nodeAffinity places VMs (ferrovirt's agents run where the \
                             administrator starts them)",
                        ));
                    }
                }
            }
            _ => e.push(FieldError::not_supported(
                f,
                "ferrovirt's agents run where the administrator starts them; only nodeSelector \
                 and affinity.nodeAffinity (which nodes run VMs) are carried out",
            )),
        }
    }
}

/// What a CPU model name must look like (it becomes a Node label name and a QEMU `-cpu`).
const CPU_MODEL_NAME: &str = "a CPU model name is 1-63 letters, digits, '-', '_' or '.', \
     beginning and ending with a letter or digit";

/// `obsoleteCPUs`: `cpuModels` (honoured: no node offers them) and `minCPUModel` (refused:
/// ferrovirt's node labelling has no minimal model).
fn check_obsolete_cpus(v: &Value, field: &str, e: &mut Vec<FieldError>) {
    let Some(m) = v.as_object() else {
        e.push(FieldError::type_invalid(field, "must be an object"));
        return;
    };
    for (k, x) in m {
        let f = format!("{field}.{k}");
        if x.is_null() {
            continue;
        }
        match k.as_str() {
            "cpuModels" => match x.as_array() {
                Some(models) => {
                    for (i, model) in models.iter().enumerate() {
                        if !model.as_str().is_some_and(cpu_model::valid_name) {
                            e.push(FieldError::invalid(format!("{f}[{i}]"), CPU_MODEL_NAME));
                        }
                    }
                }
                None => e.push(FieldError::type_invalid(f, "must be a list of CPU models")),
            },
            "minCPUModel" if x.as_str() == Some("") => {}
            _ => e.push(FieldError::not_supported(f, "not carried out by ferrovirt")),
        }
    }
}

/// An object of integer settings, each with its minimum (HCO's CRD bounds); any other key set
/// is refused (not carried out).
fn check_sub(v: &Value, field: &str, known: &[(&str, u64)], e: &mut Vec<FieldError>) {
    let Some(m) = v.as_object() else {
        e.push(FieldError::type_invalid(field, "must be an object"));
        return;
    };
    for (k, x) in m {
        let f = format!("{field}.{k}");
        match known.iter().find(|(name, _)| name == k) {
            Some((_, min)) => {
                if x.is_null() {
                    continue;
                }
                match x.as_u64() {
                    Some(n) if n >= *min && n <= u64::from(u32::MAX) => {}
                    Some(_) => e.push(FieldError::invalid(
                        f,
                        format!("must be greater than or equal to {min}"),
                    )),
                    None => e.push(FieldError::type_invalid(f, "must be an integer")),
                }
            }
            None => {
                let empty = x.is_null() || x.as_object().is_some_and(|o| o.is_empty());
                if !empty {
                    e.push(FieldError::not_supported(f, "not carried out by ferrovirt"));
                }
            }
        }
    }
}

fn check_gates(gates: &Value, e: &mut Vec<FieldError>) {
    let Some(gates) = gates.as_object() else {
        e.push(FieldError::type_invalid(
            "spec.featureGates",
            "featureGates is a map of gate names to booleans",
        ));
        return;
    };
    for (name, on) in gates {
        let field = format!("spec.featureGates.{name}");
        let Some(on) = on.as_bool() else {
            e.push(FieldError::type_invalid(
                field,
                "a feature gate is true or false",
            ));
            continue;
        };
        let n = name.as_str();
        let ok = if HCO_GATES_ANY.contains(&n) || EXTENSION_KUBEVIRT_GATES.contains(&n) {
            true
        } else if HARDCODED_KUBEVIRT_GATES.contains(&n) {
            // Always on, as HCO has them.
            on
        } else if HCO_GATES_OFF_ONLY.contains(&n)
            || HCO_TO_KUBEVIRT_GATES.iter().any(|(h, _)| *h == n)
        {
            !on
        } else {
            e.push(FieldError::not_supported(
                field,
                "unknown feature gate (HCO's gates are camelCase; ferrovirt also accepts the \
                 KubeVirt gate HostDisk)",
            ));
            continue;
        };
        if !ok {
            e.push(FieldError::not_supported(
                field,
                if on {
                    "this feature is not carried out by ferrovirt"
                } else {
                    "this feature is always on"
                },
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn admitted(spec: Value) -> Vec<String> {
        let mut obj = json!({
            "metadata": {"name": HCO_NAME, "namespace": PLATFORM_NAMESPACE},
            "spec": spec,
        });
        default_object(&mut obj);
        let mut fields: Vec<String> = validate(&obj, Operation::Create)
            .into_iter()
            .map(|f| f.field)
            .collect();
        fields.sort();
        fields
    }

    #[test]
    fn defaults_and_honoured_fields_pass() {
        assert!(admitted(json!({})).is_empty());
        assert!(
            admitted(json!({
                "featureGates": {"HostDisk": true, "enableCommonBootImageImport": false},
                "liveMigrationConfig": {"parallelMigrationsPerCluster": 2, "bandwidthPerMigration": "64Mi"},
                "storageImport": {"insecureRegistries": ["r:5000"]},
                "evictionStrategy": "LiveMigrate",
                "infra": {},
                "nodeFailure": {"leaseDurationSeconds": 10},
                "resourceRequirements": {"vmiCPUAllocationRatio": 4},
                "higherWorkloadDensity": {"memoryOvercommitPercentage": 150},
                "commonInstancetypesDeployment": {"enabled": false},
                "defaultCPUModel": "Westmere",
                "obsoleteCPUs": {"cpuModels": ["Nehalem", "Opteron_G1"]},
                "workloads": {"nodePlacement": {"nodeSelector": {"role": "vms"},
                    "affinity": {"nodeAffinity": {}}}},
                "permittedHostDevices": {"pciHostDevices": [{"pciDeviceSelector": "10DE:1EB8",
                    "resourceName": "nvidia.com/TU104GL_Tesla_T4"}]},
            }))
            .is_empty()
        );
        for model in ["host-model", "host-passthrough"] {
            assert!(admitted(json!({"defaultCPUModel": model})).is_empty());
        }
    }

    #[test]
    fn refuses_what_is_not_carried_out() {
        assert_eq!(
            admitted(json!({
                "featureGates": {"downwardMetrics": true, "Snapshot": false, "Bogus": true},
                "higherWorkloadDensity": {"memoryOvercommitPercentage": 5},
                "resourceRequirements": {"vmiCPUAllocationRatio": 4,
                    "storageWorkloads": {"limits": {"cpu": "1"}}},
                "defaultCPUModel": "Has,well",
                "obsoleteCPUs": {"cpuModels": ["ok", 7], "minCPUModel": "Penryn"},
                "workloads": {"nodePlacement": {"nodeSelector": {"a": "b"},
                    "tolerations": [{"operator": "Exists"}]}},
                "storageImport": {"insecureRegistries": [], "other": 1},
                "evictionStrategy": "Sometimes",
                "commonInstancetypesDeployment": {"enabled": "no", "source": "x"},
                "permittedHostDevices": {"pciHostDevices": [{"pciDeviceSelector": "10de",
                    "resourceName": "nvidia.com/T4"}]},
            })),
            vec![
                "spec.commonInstancetypesDeployment.enabled",
                "spec.commonInstancetypesDeployment.source",
                "spec.defaultCPUModel",
                "spec.evictionStrategy",
                "spec.featureGates.Bogus",
                "spec.featureGates.Snapshot",
                "spec.featureGates.downwardMetrics",
                "spec.higherWorkloadDensity.memoryOvercommitPercentage",
                "spec.obsoleteCPUs.cpuModels[1]",
                "spec.obsoleteCPUs.minCPUModel",
                "spec.permittedHostDevices.pciHostDevices[0].pciDeviceSelector",
                "spec.resourceRequirements.storageWorkloads",
                "spec.storageImport.other",
                "spec.workloads.nodePlacement.tolerations",
            ]
        );
    }

    #[test]
    fn only_the_one_hyperconverged() {
        let obj = json!({"metadata": {"name": "other", "namespace": "default"}, "spec": {}});
        let fields: Vec<String> = validate(&obj, Operation::Create)
            .into_iter()
            .map(|f| f.field)
            .collect();
        assert_eq!(fields, vec!["metadata.namespace", "metadata.name"]);
    }
}
