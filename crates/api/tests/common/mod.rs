//! Shared helpers for the integration tests: the corpus and typed round trips.
#![allow(dead_code)]

use std::path::PathBuf;

use ferrovirt_api::k8s_openapi;
use ferrovirt_api::registry::{self, ResourceDef};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Every corpus manifest as (file name, JSON).
pub fn corpus() -> Vec<(String, Value)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("corpus dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("read");
            let v: Value = ferrovirt_api::yaml::from_str(&text)
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p.file_name().unwrap().to_string_lossy().into_owned(), v)
        })
        .collect()
}

/// The served resource an object belongs to.
pub fn def_of(obj: &Value) -> ResourceDef {
    let av = obj["apiVersion"].as_str().expect("apiVersion");
    let kind = obj["kind"].as_str().expect("kind");
    registry::find_kind(av, kind).unwrap_or_else(|| panic!("no resource for {av} {kind}"))
}

fn rt<T: DeserializeOwned + Serialize>(v: &Value) -> Value {
    let typed: T = serde_json::from_value(v.clone()).expect("typed parse");
    serde_json::to_value(&typed).expect("serialize")
}

/// Parse into the kind's Rust type and serialize back.
pub fn typed_roundtrip(obj: &Value) -> Value {
    use ferrovirt_api::kubevirt::{instancetype as it, misc, snapshot, vm, vmi};
    use ferrovirt_api::{cdi, hco, network};
    match obj["kind"].as_str().unwrap_or("") {
        "VirtualMachine" => rt::<vm::VirtualMachine>(obj),
        "VirtualMachineInstance" => rt::<vmi::VirtualMachineInstance>(obj),
        "VirtualMachineInstanceMigration" => rt::<misc::VirtualMachineInstanceMigration>(obj),
        "VirtualMachineInstanceReplicaSet" => rt::<misc::VirtualMachineInstanceReplicaSet>(obj),
        "KubeVirt" => rt::<misc::KubeVirt>(obj),
        "VirtualMachinePool" => rt::<ferrovirt_api::kubevirt::pool::VirtualMachinePool>(obj),
        "VirtualMachineInstancePreset" => {
            rt::<ferrovirt_api::kubevirt::preset::VirtualMachineInstancePreset>(obj)
        }
        "UploadTokenRequest" => rt::<cdi::UploadTokenRequest>(obj),
        "MigrationPolicy" => rt::<misc::MigrationPolicy>(obj),
        "VirtualMachineClusterInstancetype" => rt::<it::VirtualMachineClusterInstancetype>(obj),
        "VirtualMachineInstancetype" => rt::<it::VirtualMachineInstancetype>(obj),
        "VirtualMachineClusterPreference" => rt::<it::VirtualMachineClusterPreference>(obj),
        "VirtualMachinePreference" => rt::<it::VirtualMachinePreference>(obj),
        "VirtualMachineSnapshot" => rt::<snapshot::VirtualMachineSnapshot>(obj),
        "VirtualMachineRestore" => rt::<snapshot::VirtualMachineRestore>(obj),
        "VirtualMachineClone" => rt::<ferrovirt_api::kubevirt::clone::VirtualMachineClone>(obj),
        "DataVolume" => rt::<cdi::DataVolume>(obj),
        "DataSource" => rt::<cdi::DataSource>(obj),
        "StorageProfile" => rt::<cdi::StorageProfile>(obj),
        "CDI" => rt::<cdi::Cdi>(obj),
        "NetworkAttachmentDefinition" => rt::<network::NetworkAttachmentDefinition>(obj),
        "HyperConverged" => rt::<hco::HyperConverged>(obj),
        "Secret" => rt::<k8s_openapi::api::core::v1::Secret>(obj),
        "PersistentVolumeClaim" => rt::<k8s_openapi::api::core::v1::PersistentVolumeClaim>(obj),
        "ConfigMap" => rt::<k8s_openapi::api::core::v1::ConfigMap>(obj),
        "StorageClass" => rt::<k8s_openapi::api::storage::v1::StorageClass>(obj),
        other => panic!("no typed round trip for {other}"),
    }
}

/// Drop `null` members (they mean "unset" and are not re-serialized).
pub fn strip_nulls(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), strip_nulls(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(strip_nulls).collect()),
        other => other.clone(),
    }
}

/// Every value in `orig` is present and equal in `new` (which may hold more: defaults).
/// Returns the first path that differs.
pub fn subset_diff(orig: &Value, new: &Value, path: &str) -> Option<String> {
    match (orig, new) {
        (Value::Object(a), Value::Object(b)) => a.iter().find_map(|(k, v)| match b.get(k) {
            Some(w) => subset_diff(v, w, &format!("{path}.{k}")),
            None if v.is_null() => None,
            None => Some(format!("{path}.{k} missing")),
        }),
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .find_map(|(i, (v, w))| subset_diff(v, w, &format!("{path}[{i}]"))),
        (a, b) if a == b => None,
        (a, b) => Some(format!("{path}: {a} != {b}")),
    }
}

/// A JSON value at a dotted path (`spec.template.spec`), if present.
pub fn at<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.')
        .try_fold(v, |cur, seg| match seg.parse::<usize>() {
            Ok(i) => cur.get(i),
            Err(_) => cur.get(seg),
        })
}
