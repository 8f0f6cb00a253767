//! The served-resource table and the generated OpenAPI schemas.

use std::collections::HashSet;

use ferrovirt_api::registry::{find, find_kind, openapi_schema, resources, table_columns};
use serde_json::Value;

#[test]
fn every_kind_is_listed_once() {
    let all = resources();
    let mut seen = HashSet::new();
    for d in &all {
        assert!(
            seen.insert((d.group, d.version, d.plural)),
            "{} twice",
            d.plural
        );
        assert_eq!(d.list_kind, format!("{}List", d.kind));
        assert_eq!(d.plural, d.plural.to_lowercase());
    }
    assert!(all.len() >= 32, "{}", all.len());
}

#[test]
fn short_names_are_unique() {
    let mut seen = HashSet::new();
    let mut resources_seen = HashSet::new();
    for d in resources() {
        // A resource served in several versions has the same names in each.
        if !resources_seen.insert((d.group, d.plural)) {
            continue;
        }
        for s in d.short_names {
            assert!(seen.insert(*s), "short name {s} twice");
        }
    }
}

#[test]
fn kubevirt_names_match_the_published_crds() {
    let vm = find("kubevirt.io", "virtualmachines").expect("vm");
    assert_eq!(vm.short_names, &["vm", "vms"]);
    assert_eq!(vm.categories, &["all"]);
    assert!(vm.namespaced && vm.has_status);
    let cols: Vec<_> = table_columns(&vm).iter().map(|c| c.name).collect();
    assert_eq!(cols, ["Age", "Status", "Ready"]);
    assert_eq!(vm.printer_columns[0].json_path, ".status.printableStatus");

    let vmi = find("kubevirt.io", "virtualmachineinstances").expect("vmi");
    let cols: Vec<_> = table_columns(&vmi).iter().map(|c| c.name).collect();
    assert_eq!(
        cols,
        [
            "Age",
            "Phase",
            "IP",
            "NodeName",
            "Ready",
            "Live-Migratable",
            "Paused"
        ]
    );
    assert_eq!(vmi.printer_columns[4].priority, 1);

    let dv = find("cdi.kubevirt.io", "datavolumes").expect("dv");
    assert_eq!(dv.short_names, &["dv", "dvs"]);
    let cols: Vec<_> = table_columns(&dv).iter().map(|c| c.name).collect();
    assert_eq!(cols, ["Phase", "Progress", "Restarts", "Age"]);

    let cit = find(
        "instancetype.kubevirt.io",
        "virtualmachineclusterinstancetypes",
    )
    .unwrap();
    assert!(!cit.namespaced);
    assert_eq!(
        cit.short_names,
        &[
            "vmclusterinstancetype",
            "vmclusterinstancetypes",
            "vmcf",
            "vmcfs"
        ]
    );
    let nad = find("k8s.cni.cncf.io", "network-attachment-definitions").unwrap();
    assert!(nad.short_names.contains(&"net-attach-def"));
    assert!(find_kind("v1", "Pod").is_some_and(|p| !p.verbs.contains(&"create")));
    assert_eq!(find_kind("v1", "Namespace").unwrap().short_names, &["ns"]);
}

fn check_structural(v: &Value, path: &str) {
    let Some(m) = v.as_object() else { return };
    assert!(!m.contains_key("$ref"), "$ref at {path}");
    assert!(
        !(m.contains_key("properties")
            && matches!(m.get("additionalProperties"), Some(Value::Bool(true)))),
        "properties with additionalProperties at {path}"
    );
    for (k, child) in m {
        match child {
            Value::Object(_) => check_structural(child, &format!("{path}.{k}")),
            Value::Array(items) => items
                .iter()
                .for_each(|i| check_structural(i, &format!("{path}.{k}[]"))),
            _ => {}
        }
    }
}

#[test]
fn schemas_are_inlined_objects() {
    for d in resources() {
        let s = openapi_schema(&d);
        assert_eq!(s["type"], "object", "{}", d.kind);
        for p in ["apiVersion", "kind", "metadata"] {
            assert!(s["properties"].get(p).is_some(), "{} lacks {p}", d.kind);
        }
        check_structural(&s, d.kind);
    }
    let vm = openapi_schema(&find("kubevirt.io", "virtualmachines").unwrap());
    let strategies = &vm["properties"]["spec"]["properties"]["runStrategy"]["enum"];
    assert_eq!(
        strategies,
        &serde_json::json!([
            "Always",
            "Halted",
            "Manual",
            "RerunOnFailure",
            "Once",
            "WaitAsReceiver"
        ])
    );
    let disk = &vm["properties"]["spec"]["properties"]["template"]["properties"]["spec"]["properties"]
        ["domain"]["properties"]["devices"]["properties"]["disks"]["items"];
    assert!(disk["properties"]["bootOrder"].is_object());
}

#[test]
fn kubevirt_v1alpha3_twins_are_stored_as_v1() {
    use ferrovirt_api::registry::{deprecation_warning, storage_version};
    let all = resources();
    let v1: Vec<_> = all
        .iter()
        .filter(|d| d.group == "kubevirt.io" && d.version == "v1")
        .collect();
    assert!(v1.len() >= 5);
    for d in v1 {
        let old = find_kind("kubevirt.io/v1alpha3", d.kind)
            .unwrap_or_else(|| panic!("{} not in v1alpha3", d.kind));
        assert_eq!((old.plural, old.namespaced), (d.plural, d.namespaced));
        assert_eq!(storage_version(&old), "v1");
        assert!(deprecation_warning(&old).is_some() && deprecation_warning(d).is_none());
    }
    // The preferred (first) version of the group stays v1.
    let first = all.iter().find(|d| d.group == "kubevirt.io").unwrap();
    assert_eq!(first.version, "v1");
}

/// The fields `kubectl explain` walks to the devices all carry descriptions.
#[test]
fn explain_path_has_descriptions() {
    let vm = openapi_schema(&find("kubevirt.io", "virtualmachines").unwrap());
    let mut node = &vm;
    for field in ["spec", "template", "spec", "domain", "devices"] {
        for p in node["properties"].as_object().unwrap().keys() {
            assert!(
                node["properties"][p]["description"].is_string(),
                "{p} (next to {field}) has no description"
            );
        }
        node = &node["properties"][field];
    }
    for (name, prop) in node["properties"].as_object().unwrap() {
        assert!(prop["description"].is_string(), "devices.{name}");
    }
    let disk = &node["properties"]["disks"]["items"]["properties"];
    for name in ["name", "disk", "cdrom", "bootOrder"] {
        assert!(disk[name]["description"].is_string(), "disks[].{name}");
    }
}

/// `kubectl explain KIND` has something to say about every kind's top-level fields and about
/// the fields of its spec.
#[test]
fn top_level_fields_have_descriptions() {
    let mut missing = Vec::new();
    for d in resources() {
        let s = openapi_schema(&d);
        if s["description"].as_str().is_none_or(str::is_empty) {
            missing.push(d.kind.to_string());
        }
        for (name, prop) in s["properties"].as_object().into_iter().flatten() {
            if prop["description"].as_str().is_none_or(str::is_empty) {
                missing.push(format!("{}.{name}", d.kind));
            }
        }
        if ferrovirt_api::registry::is_builtin_group(d.group) {
            continue;
        }
        for (name, prop) in s["properties"]["spec"]["properties"]
            .as_object()
            .into_iter()
            .flatten()
        {
            if prop["description"].as_str().is_none_or(str::is_empty) {
                missing.push(format!("{}.spec.{name}", d.kind));
            }
        }
    }
    missing.sort();
    missing.dedup();
    assert!(
        missing.is_empty(),
        "{} without descriptions: {missing:?}",
        missing.len()
    );
}
