//! apiextensions.k8s.io/v1 CustomResourceDefinitions for every kind outside Kubernetes'
//! built-in groups, generated from the resource table (names, scope, versions with
//! served/storage, OpenAPI schema, status/scale subresources, printer columns) and written into
//! the store at start so that get, list and watch work as for any kind. The kind is read-only:
//! create, update, patch and delete are refused (405).

use std::collections::BTreeMap;

use ferrovirt_api::registry::{self, ResourceDef};
use ferrovirt_store::StoreError;
use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::objects::{decode, encode, meta_mut};
use crate::resources::object_key;
use crate::server::Shared;
use crate::timefmt;

/// The CRD name of a resource: `plural.group`.
pub fn crd_name(def: &ResourceDef) -> String {
    format!("{}.{}", def.plural, def.group)
}

/// A kind's schema as a CRD carries it: no group-version-kind tag, `metadata` left to the
/// server (`{type: object}`, as a CRD's structural schema must have it).
fn crd_schema(def: &ResourceDef) -> Value {
    let mut s = registry::openapi_schema(def);
    if let Some(m) = s.as_object_mut() {
        m.remove("x-kubernetes-group-version-kind");
        if let Some(Value::Object(props)) = m.get_mut("properties")
            && props.contains_key("metadata")
        {
            props.insert("metadata".into(), json!({"type": "object"}));
        }
    }
    s
}

fn printer_columns(def: &ResourceDef) -> Vec<Value> {
    registry::table_columns(def)
        .iter()
        .map(|c| {
            let mut col = json!({"name": c.name, "type": c.type_, "jsonPath": c.json_path});
            if !c.description.is_empty() {
                col["description"] = json!(c.description);
            }
            if c.priority != 0 {
                col["priority"] = json!(c.priority);
            }
            col
        })
        .collect()
}

fn version_entry(def: &ResourceDef, storage: bool) -> Value {
    let mut v = json!({
        "name": def.version,
        "served": true,
        "storage": storage,
        "schema": {"openAPIV3Schema": crd_schema(def)},
    });
    let mut subs = Map::new();
    if def.has_status {
        subs.insert("status".into(), json!({}));
    }
    if let Some(scale) = registry::scale_subresource(def) {
        subs.insert(
            "scale".into(),
            json!({
                "specReplicasPath": scale.spec_replicas_path,
                "statusReplicasPath": scale.status_replicas_path,
                "labelSelectorPath": scale.label_selector_path,
            }),
        );
    }
    if !subs.is_empty() {
        v["subresources"] = Value::Object(subs);
    }
    let cols = printer_columns(def);
    if !cols.is_empty() {
        v["additionalPrinterColumns"] = json!(cols);
    }
    if let Some(w) = registry::deprecation_warning(def) {
        v["deprecated"] = json!(true);
        v["deprecationWarning"] = json!(w);
    }
    v
}

fn names(def: &ResourceDef) -> Value {
    let mut n = json!({
        "plural": def.plural,
        "singular": def.singular,
        "kind": def.kind,
        "listKind": def.list_kind,
    });
    if !def.short_names.is_empty() {
        n["shortNames"] = json!(def.short_names);
    }
    if !def.categories.is_empty() {
        n["categories"] = json!(def.categories);
    }
    n
}

/// One CRD from the versions of one resource (the first is the storage version). Condition
/// times are `since` (the CRD's creation).
fn definition(versions: &[&ResourceDef], since: &str) -> Value {
    let first = versions[0];
    let stored = registry::storage_version(first);
    let cond = |type_: &str, reason: &str, message: &str| {
        json!({
            "type": type_,
            "status": "True",
            "lastTransitionTime": since,
            "reason": reason,
            "message": message,
        })
    };
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": crd_name(first)},
        "spec": {
            "group": first.group,
            "names": names(first),
            "scope": if first.namespaced { "Namespaced" } else { "Cluster" },
            "versions": versions
                .iter()
                .map(|d| version_entry(d, d.version == stored))
                .collect::<Vec<_>>(),
            "conversion": {"strategy": "None"},
        },
        "status": {
            "conditions": [
                cond("NamesAccepted", "NoConflicts", "no conflicts found"),
                cond("Established", "InitialNamesAccepted", "the initial names have been accepted"),
            ],
            "acceptedNames": names(first),
            "storedVersions": [stored],
        },
    })
}

/// Every CRD the table implies: one per (group, plural) outside the built-in groups, its
/// versions in table order, sorted by name.
pub fn definitions(defs: &[ResourceDef], since: &str) -> Vec<Value> {
    let mut by_resource: BTreeMap<String, Vec<&ResourceDef>> = BTreeMap::new();
    for d in defs.iter().filter(|d| !registry::is_builtin_group(d.group)) {
        by_resource.entry(crd_name(d)).or_default().push(d);
    }
    by_resource
        .values()
        .map(|versions| definition(versions, since))
        .collect()
}

/// Writes the CRDs into the store: creates missing ones, rewrites those whose spec or status
/// changed (keeping uid and creation time), leaves the rest alone.
pub(crate) async fn sync(sh: &Shared) -> Result<(), ApiError> {
    let Some(crd_def) = sh
        .resources
        .lookup("apiextensions.k8s.io", "v1", "customresourcedefinitions")
        .cloned()
    else {
        return Ok(());
    };
    let now = timefmt::now_rfc3339();
    for fresh in definitions(sh.resources.all(), &now) {
        let name = fresh["metadata"]["name"].as_str().unwrap_or_default();
        let key = object_key(&crd_def, None, name);
        match sh.store.get(&key).await.map_err(ApiError::from_store)? {
            None => {
                let mut obj = fresh.clone();
                let m = meta_mut(&mut obj);
                m.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
                m.insert("creationTimestamp".into(), json!(now));
                m.insert("generation".into(), json!(1));
                match sh.store.create(&key, encode(&obj)).await {
                    Ok(_) | Err(StoreError::AlreadyExists(_)) => {}
                    Err(e) => return Err(ApiError::from_store(e)),
                }
            }
            Some(kv) => {
                let old = decode(&kv)?;
                let since = old
                    .pointer("/metadata/creationTimestamp")
                    .and_then(Value::as_str)
                    .unwrap_or(&now)
                    .to_string();
                let versions: Vec<&ResourceDef> = sh
                    .resources
                    .all()
                    .iter()
                    .filter(|d| crd_name(d) == name)
                    .collect();
                let want = definition(&versions, &since);
                if old.get("spec") == want.get("spec") && old.get("status") == want.get("status") {
                    continue;
                }
                let mut obj = old.clone();
                obj["spec"] = want["spec"].clone();
                obj["status"] = want["status"].clone();
                let generation = old
                    .pointer("/metadata/generation")
                    .and_then(Value::as_i64)
                    .unwrap_or(1);
                meta_mut(&mut obj).insert("generation".into(), json!(generation + 1));
                match sh.store.update(&key, encode(&obj), kv.mod_revision).await {
                    Ok(_) | Err(StoreError::Conflict { .. }) => {}
                    Err(e) => return Err(ApiError::from_store(e)),
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crds() -> Vec<Value> {
        definitions(&registry::resources(), "2025-01-01T00:00:00Z")
    }

    fn find<'a>(all: &'a [Value], name: &str) -> &'a Value {
        all.iter()
            .find(|c| c["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no CRD {name}"))
    }

    #[test]
    fn one_crd_per_resource_outside_builtin_groups() {
        let all = crds();
        assert!(all.iter().all(|c| {
            let g = c["spec"]["group"].as_str().unwrap();
            !registry::is_builtin_group(g)
        }));
        for name in [
            "virtualmachines.kubevirt.io",
            "datavolumes.cdi.kubevirt.io",
            "virtualmachineinstancetypes.instancetype.kubevirt.io",
            "virtualmachinesnapshots.snapshot.kubevirt.io",
            "migrationpolicies.migrations.kubevirt.io",
            "hyperconvergeds.hco.kubevirt.io",
            "network-attachment-definitions.k8s.cni.cncf.io",
        ] {
            find(&all, name);
        }
        assert!(
            !all.iter()
                .any(|c| c["spec"]["group"] == "apiextensions.k8s.io")
        );
        let mut names: Vec<&str> = all
            .iter()
            .map(|c| c["metadata"]["name"].as_str().unwrap())
            .collect();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n);
    }

    #[test]
    fn virtual_machines() {
        let all = crds();
        let vm = find(&all, "virtualmachines.kubevirt.io");
        let spec = &vm["spec"];
        assert_eq!(spec["scope"], "Namespaced");
        assert_eq!(spec["names"]["shortNames"], json!(["vm", "vms"]));
        assert_eq!(spec["names"]["categories"], json!(["all"]));
        assert_eq!(spec["names"]["listKind"], "VirtualMachineList");
        let versions = spec["versions"].as_array().unwrap();
        assert_eq!(versions[0]["name"], "v1");
        assert_eq!(versions[0]["storage"], true);
        assert_eq!(versions[1]["name"], "v1alpha3");
        assert_eq!(versions[1]["storage"], false);
        assert_eq!(versions[1]["served"], true);
        assert_eq!(versions[1]["deprecated"], true);
        assert_eq!(versions[0]["subresources"], json!({"status": {}}));
        let schema = &versions[0]["schema"]["openAPIV3Schema"];
        assert_eq!(schema["properties"]["metadata"], json!({"type": "object"}));
        assert!(schema["properties"]["spec"]["properties"]["runStrategy"].is_object());
        assert!(schema.get("x-kubernetes-group-version-kind").is_none());
        let cols: Vec<&str> = versions[0]["additionalPrinterColumns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(cols, ["Age", "Status", "Ready"]);
        let conds = vm["status"]["conditions"].as_array().unwrap();
        for t in ["Established", "NamesAccepted"] {
            assert!(
                conds
                    .iter()
                    .any(|c| c["type"] == t && c["status"] == "True")
            );
        }
        assert_eq!(vm["status"]["storedVersions"], json!(["v1"]));
    }

    #[test]
    fn scale_and_cluster_scope() {
        let all = crds();
        let rs = find(&all, "virtualmachineinstancereplicasets.kubevirt.io");
        let subs = &rs["spec"]["versions"][0]["subresources"];
        assert_eq!(subs["scale"]["specReplicasPath"], ".spec.replicas");
        assert!(subs["status"].is_object());
        let cit = find(
            &all,
            "virtualmachineclusterinstancetypes.instancetype.kubevirt.io",
        );
        assert_eq!(cit["spec"]["scope"], "Cluster");
        assert_eq!(cit["spec"]["versions"].as_array().unwrap().len(), 1);
        // The VMI CRD has no status subresource (status is written on the object).
        let vmi = find(&all, "virtualmachineinstances.kubevirt.io");
        assert!(vmi["spec"]["versions"][0].get("subresources").is_none());
    }
}
