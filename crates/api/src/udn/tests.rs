//! Admission of UDN and CUDN: the published OVN-K rules, each refused naming the field.

use serde_json::{Value, json};

use super::admit;
use crate::admission::Operation;

fn udn(spec: Value) -> Value {
    json!({"apiVersion": "k8s.ovn.org/v1", "kind": "UserDefinedNetwork",
           "metadata": {"name": "n", "namespace": "a"}, "spec": spec})
}

fn cudn(network: Value) -> Value {
    json!({"apiVersion": "k8s.ovn.org/v1", "kind": "ClusterUserDefinedNetwork",
           "metadata": {"name": "c"},
           "spec": {"namespaceSelector": {"matchLabels": {"x": "y"}}, "network": network}})
}

fn fields(kind: &str, mut obj: Value) -> Vec<String> {
    admit(kind, Operation::Create, &mut obj, None)
        .into_iter()
        .map(|e| format!("{}: {}", e.field, e.message))
        .collect()
}

fn udn_errs(spec: Value) -> Vec<String> {
    fields("UserDefinedNetwork", udn(spec))
}

fn cudn_errs(net: Value) -> Vec<String> {
    fields("ClusterUserDefinedNetwork", cudn(net))
}

fn has(errs: &[String], field: &str) -> bool {
    errs.iter().any(|e| e.starts_with(&format!("{field}:")))
}

#[test]
fn a_primary_layer2_udn_is_valid() {
    let e = udn_errs(json!({"topology": "Layer2", "layer2": {
        "role": "Primary", "subnets": ["10.100.0.0/24"], "ipam": {"lifecycle": "Persistent"}}}));
    assert!(e.is_empty(), "{e:?}");
    let e = udn_errs(json!({"topology": "Layer3", "layer3": {
        "role": "Secondary", "subnets": [{"cidr": "10.200.0.0/16", "hostSubnet": 24}], "mtu": 1400}}));
    assert!(e.is_empty(), "{e:?}");
}

#[test]
fn topology_and_its_config_must_match() {
    let e = udn_errs(json!({"topology": "Layer2", "layer3": {"role": "Primary",
        "subnets": [{"cidr": "10.0.0.0/16"}]}}));
    assert!(has(&e, "spec.layer2") && has(&e, "spec.layer3"), "{e:?}");
    assert!(has(
        &udn_errs(json!({"layer2": {"role": "Primary"}})),
        "spec.topology"
    ));
    let e = udn_errs(json!({"topology": "Layer4"}));
    assert!(has(&e, "spec.topology"), "{e:?}");
}

#[test]
fn localnet_only_on_cudn_and_only_secondary() {
    let e = udn_errs(json!({"topology": "Localnet"}));
    assert!(has(&e, "spec.topology"), "{e:?}");
    let e = cudn_errs(json!({"topology": "Localnet", "localnet": {
        "role": "Primary", "physicalNetworkName": "physnet"}}));
    assert!(has(&e, "spec.network.localnet.role"), "{e:?}");
    let e = cudn_errs(json!({"topology": "Localnet", "localnet": {
        "role": "Secondary", "physicalNetworkName": "phys:net",
        "vlan": {"mode": "Access", "access": {"id": 5000}}}}));
    assert!(
        has(&e, "spec.network.localnet.physicalNetworkName"),
        "{e:?}"
    );
    assert!(has(&e, "spec.network.localnet.vlan.access.id"), "{e:?}");
    let e = cudn_errs(json!({"topology": "Localnet", "localnet": {
        "role": "Secondary", "physicalNetworkName": "physnet", "subnets": ["192.168.1.0/24"],
        "excludeSubnets": ["192.168.1.200/30"], "vlan": {"mode": "Access", "access": {"id": 10}}}}));
    assert!(e.is_empty(), "{e:?}");
}

#[test]
fn ipam_rules() {
    let e = udn_errs(json!({"topology": "Layer2", "layer2": {"role": "Primary",
        "ipam": {"mode": "Disabled"}}}));
    assert!(has(&e, "spec.layer2.ipam.mode"), "{e:?}");
    let e = udn_errs(json!({"topology": "Layer2", "layer2": {"role": "Secondary",
        "subnets": ["10.0.0.0/24"], "ipam": {"mode": "Disabled", "lifecycle": "Persistent"}}}));
    assert!(has(&e, "spec.layer2.subnets"), "{e:?}");
    assert!(has(&e, "spec.layer2.ipam.lifecycle"), "{e:?}");
    let e = udn_errs(json!({"topology": "Layer2", "layer2": {"role": "Secondary"}}));
    assert!(has(&e, "spec.layer2.subnets"), "{e:?}");
    let e = udn_errs(json!({"topology": "Layer2", "layer2": {"role": "Secondary",
        "ipam": {"mode": "Disabled"}}}));
    assert!(e.is_empty(), "{e:?}");
    let e = udn_errs(json!({"topology": "Layer2", "layer2": {"role": "Secondary",
        "subnets": ["10.0.0.0/24"], "ipam": {}}}));
    assert!(has(&e, "spec.layer2.ipam"), "{e:?}");
}

#[test]
fn subnets_mtu_and_join_subnets() {
    let e = udn_errs(json!({"topology": "Layer2", "layer2": {"role": "Secondary",
        "subnets": ["10.0.0.0/33", "fd00::/64", "fd01::/64"], "joinSubnets": ["100.65.0.0/16"],
        "mtu": 100}}));
    assert!(has(&e, "spec.layer2.subnets"), "{e:?}");
    assert!(has(&e, "spec.layer2.subnets[0]"), "{e:?}");
    assert!(has(&e, "spec.layer2.joinSubnets"), "{e:?}");
    assert!(has(&e, "spec.layer2.mtu"), "{e:?}");
    let e = udn_errs(json!({"topology": "Layer2", "layer2": {"role": "Primary",
        "subnets": ["fd00::/64"], "mtu": 1000}}));
    assert!(has(&e, "spec.layer2.mtu"), "{e:?}");
    let e = udn_errs(json!({"topology": "Layer3", "layer3": {"role": "Primary",
        "subnets": [{"cidr": "10.0.0.0/16", "hostSubnet": 8}, {"cidr": "10.1.0.0/16", "hostSubnet": 32}]}}));
    assert!(has(&e, "spec.layer3.subnets[0].hostSubnet"), "{e:?}");
    assert!(has(&e, "spec.layer3.subnets[1].hostSubnet"), "{e:?}");
    assert!(has(&e, "spec.layer3.subnets"), "{e:?}");
}

#[test]
fn the_network_is_immutable_but_a_cudn_selector_is_not() {
    let old = udn(
        json!({"topology": "Layer2", "layer2": {"role": "Primary", "subnets": ["10.0.0.0/24"]}}),
    );
    let mut new = udn(
        json!({"topology": "Layer2", "layer2": {"role": "Primary", "subnets": ["10.0.1.0/24"]}}),
    );
    let e = admit(
        "UserDefinedNetwork",
        Operation::Update,
        &mut new,
        Some(&old),
    );
    assert!(
        e.iter()
            .any(|e| e.field == "spec" && e.message.contains("immutable")),
        "{e:?}"
    );
    let net =
        json!({"topology": "Layer2", "layer2": {"role": "Secondary", "subnets": ["10.0.0.0/24"]}});
    let old = cudn(net.clone());
    let mut new = cudn(net);
    new["spec"]["namespaceSelector"] = json!({"matchLabels": {"other": "x"}});
    assert!(
        admit(
            "ClusterUserDefinedNetwork",
            Operation::Update,
            &mut new,
            Some(&old)
        )
        .is_empty()
    );
    new["spec"]["network"]["layer2"]["mtu"] = json!(1300);
    let e = admit(
        "ClusterUserDefinedNetwork",
        Operation::Update,
        &mut new,
        Some(&old),
    );
    assert!(e.iter().any(|e| e.field == "spec.network"), "{e:?}");
}

#[test]
fn cudn_needs_a_selector_and_a_network() {
    let mut obj = json!({"apiVersion": "k8s.ovn.org/v1", "kind": "ClusterUserDefinedNetwork",
        "metadata": {"name": "c"}, "spec": {}});
    let e: Vec<String> = admit(
        "ClusterUserDefinedNetwork",
        Operation::Create,
        &mut obj,
        None,
    )
    .into_iter()
    .map(|e| e.field)
    .collect();
    assert_eq!(e, ["spec.namespaceSelector", "spec.network"]);
}
