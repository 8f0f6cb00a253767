//! The UDN/CUDN decisions: NADs made, corrected, kept while used, removed; conditions.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, Time};
use serde_json::{Value, json};

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_api::network::NetworkAttachmentDefinition;
use ferrovirt_api::udn::{self, UserDefinedNetworkSpec};

use super::{NadAction, Observed, Owner, decide, desired_nad, selects, vmi_uses};

fn spec(role: &str) -> UserDefinedNetworkSpec {
    serde_json::from_value(json!({"topology": "Layer2", "layer2": {
        "role": role, "subnets": ["10.100.0.0/24"], "ipam": {"lifecycle": "Persistent"}}}))
    .unwrap()
}

fn meta(finalizer: bool, deleting: bool) -> ObjectMeta {
    ObjectMeta {
        name: Some("net".into()),
        namespace: Some("a".into()),
        uid: Some("u1".into()),
        finalizers: finalizer.then(|| vec![udn::FINALIZER.to_string()]),
        deletion_timestamp: deleting.then(|| Time(k8s_openapi::jiff::Timestamp::now())),
        ..ObjectMeta::default()
    }
}

fn targets(ns: &[&str]) -> BTreeSet<String> {
    ns.iter().map(|s| s.to_string()).collect()
}

#[test]
fn a_new_udn_gets_its_finalizer_and_nad_with_ovnk_config() {
    let s = spec("Primary");
    let m = meta(false, false);
    let owner = Owner {
        kind: "UserDefinedNetwork",
        meta: &m,
        config: s.config(),
    };
    let plan = decide(&owner, &targets(&["a"]), &Observed::default());
    assert!(plan.add_finalizer);
    let [NadAction::Create(nad)] = plan.nads.as_slice() else {
        panic!("{plan:?}")
    };
    let md = &nad.metadata;
    assert_eq!(md.namespace.as_deref(), Some("a"));
    assert!(md.labels.as_ref().unwrap().contains_key(udn::NAD_LABEL));
    assert_eq!(
        md.finalizers.as_deref(),
        Some(&[udn::FINALIZER.to_string()][..])
    );
    let or = &md.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (or.kind.as_str(), or.uid.as_str()),
        ("UserDefinedNetwork", "u1")
    );
    let cfg: Value =
        serde_json::from_str(nad.spec.as_ref().unwrap().config.as_deref().unwrap()).unwrap();
    assert_eq!(cfg["type"], "ovn-k8s-cni-overlay");
    assert_eq!(cfg["topology"], "layer2");
    assert_eq!(cfg["role"], "primary");
    assert_eq!(cfg["subnets"], "10.100.0.0/24");
    assert_eq!(cfg["netAttachDefName"], "a/net");
    assert_eq!(cfg["name"], "a_net");
    assert_eq!(cfg["allowPersistentIPs"], true);
    let c = plan.condition.unwrap();
    assert!(c.status);
    assert_eq!(c.reason, "NetworkAttachmentDefinitionCreated");
}

#[test]
fn an_up_to_date_nad_is_left_alone_and_a_foreign_one_reported() {
    let s = spec("Secondary");
    let m = meta(true, false);
    let owner = Owner {
        kind: "UserDefinedNetwork",
        meta: &m,
        config: s.config(),
    };
    let mine = desired_nad(&owner, s.config().unwrap(), "a");
    let seen = Observed {
        nads: BTreeMap::from([("a".to_string(), &mine)]),
        users: BTreeMap::new(),
    };
    let plan = decide(&owner, &targets(&["a"]), &seen);
    assert!(plan.nads.is_empty() && !plan.add_finalizer, "{plan:?}");
    let foreign = NetworkAttachmentDefinition {
        metadata: ObjectMeta {
            name: Some("net".into()),
            namespace: Some("a".into()),
            ..ObjectMeta::default()
        },
        ..NetworkAttachmentDefinition::default()
    };
    let seen = Observed {
        nads: BTreeMap::from([("a".to_string(), &foreign)]),
        users: BTreeMap::new(),
    };
    let plan = decide(&owner, &targets(&["a"]), &seen);
    assert!(
        plan.nads.is_empty(),
        "a foreign NAD is never touched: {plan:?}"
    );
    let c = plan.condition.unwrap();
    assert!(
        !c.status && c.reason == "SyncError" && c.message.contains("foreign"),
        "{c:?}"
    );
}

#[test]
fn deletion_waits_while_a_vmi_uses_the_network() {
    let s = spec("Primary");
    let m = meta(true, true);
    let owner = Owner {
        kind: "UserDefinedNetwork",
        meta: &m,
        config: s.config(),
    };
    let mine = desired_nad(&owner, s.config().unwrap(), "a");
    let mut seen = Observed {
        nads: BTreeMap::from([("a".to_string(), &mine)]),
        users: BTreeMap::from([("a".to_string(), vec!["a/vm1".to_string()])]),
    };
    let plan = decide(&owner, &BTreeSet::new(), &seen);
    assert!(plan.nads.is_empty() && !plan.remove_finalizer, "{plan:?}");
    let c = plan.condition.unwrap();
    assert!(
        !c.status && c.message.contains("in use") && c.message.contains("a/vm1"),
        "{c:?}"
    );
    seen.users.clear();
    let plan = decide(&owner, &BTreeSet::new(), &seen);
    assert_eq!(
        plan.nads,
        vec![NadAction::Delete {
            namespace: "a".into(),
            name: "net".into()
        }]
    );
    assert!(plan.remove_finalizer);
}

#[test]
fn a_cudn_follows_its_namespaces() {
    let spec: udn::NetworkSpec = serde_json::from_value(json!({"topology": "Layer2",
        "layer2": {"role": "Secondary", "subnets": ["10.9.0.0/24"]}}))
    .unwrap();
    let mut m = meta(true, false);
    m.namespace = None;
    let owner = Owner {
        kind: "ClusterUserDefinedNetwork",
        meta: &m,
        config: spec.config(),
    };
    let in_b = desired_nad(&owner, spec.config().unwrap(), "b");
    let cfg: Value =
        serde_json::from_str(in_b.spec.as_ref().unwrap().config.as_deref().unwrap()).unwrap();
    assert_eq!(cfg["name"], "cluster_udn_net");
    let seen = Observed {
        nads: BTreeMap::from([("b".to_string(), &in_b)]),
        users: BTreeMap::new(),
    };
    // Namespace b lost its label, c gained it.
    let plan = decide(&owner, &targets(&["a", "c"]), &seen);
    let created: Vec<_> = plan
        .nads
        .iter()
        .filter_map(|a| match a {
            NadAction::Create(n) => n.metadata.namespace.clone(),
            _ => None,
        })
        .collect();
    assert_eq!(created, ["a", "c"]);
    assert!(plan.nads.contains(&NadAction::Delete {
        namespace: "b".into(),
        name: "net".into()
    }));
    let c = plan.condition.unwrap();
    assert_eq!(
        c.message,
        "NetworkAttachmentDefinition has been created in following namespaces: [a, c]"
    );
}

#[test]
fn who_uses_a_network() {
    let vmi = |v: Value| -> VirtualMachineInstance { serde_json::from_value(v).unwrap() };
    let default_pod = vmi(json!({"metadata": {"name": "x", "namespace": "a"}, "spec": {}}));
    assert!(vmi_uses(&default_pod, "a", "net", Some(udn::Role::Primary)));
    assert!(!vmi_uses(
        &default_pod,
        "b",
        "net",
        Some(udn::Role::Primary)
    ));
    assert!(!vmi_uses(
        &default_pod,
        "a",
        "net",
        Some(udn::Role::Secondary)
    ));
    let multus = vmi(
        json!({"metadata": {"name": "x", "namespace": "a"}, "spec": {
        "networks": [{"name": "s", "multus": {"networkName": "a/net"}}]}}),
    );
    assert!(vmi_uses(&multus, "a", "net", Some(udn::Role::Secondary)));
    assert!(!vmi_uses(&multus, "a", "net", Some(udn::Role::Primary)));
}

#[test]
fn namespace_selectors() {
    let sel: LabelSelector = serde_json::from_value(json!({"matchLabels": {"t": "x"},
        "matchExpressions": [{"key": "env", "operator": "NotIn", "values": ["prod"]}]}))
    .unwrap();
    let l = |p: &[(&str, &str)]| -> BTreeMap<String, String> {
        p.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    assert!(selects(&sel, &l(&[("t", "x")])));
    assert!(!selects(&sel, &l(&[("t", "x"), ("env", "prod")])));
    assert!(!selects(&sel, &l(&[])));
}
