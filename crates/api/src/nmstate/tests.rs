//! Admission of the nmstate.io kinds and the maxUnavailable arithmetic.

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::{Value, json};

use super::{admit, enactment_name, max_unavailable};
use crate::admission::Operation;

fn errs(spec: Value) -> Vec<String> {
    let mut obj = json!({"apiVersion": "nmstate.io/v1", "kind": "NodeNetworkConfigurationPolicy",
        "metadata": {"name": "p"}, "spec": spec});
    admit(
        "NodeNetworkConfigurationPolicy",
        Operation::Create,
        &mut obj,
        None,
    )
    .into_iter()
    .map(|e| format!("{}: {}", e.field, e.message))
    .collect()
}

fn has(errs: &[String], field: &str) -> bool {
    errs.iter().any(|e| e.starts_with(&format!("{field}:")))
}

fn bridge_policy() -> Value {
    json!({"nodeSelector": {"kubernetes.io/hostname": "a"}, "maxUnavailable": "50%",
      "desiredState": {
        "interfaces": [{"name": "br-ext", "type": "linux-bridge", "state": "up",
          "bridge": {"options": {"stp": {"enabled": false}},
                     "port": [{"name": "eth1"}, {"name": "eth2",
                               "vlan": {"mode": "trunk", "trunk-tags": [{"id": 101}], "tag": 5}}]},
          "ipv4": {"enabled": true, "address": [{"ip": "192.0.2.1", "prefix-length": 24}]}},
          {"name": "eth1.100", "type": "vlan", "vlan": {"base-iface": "eth1", "id": 100}},
          {"name": "bond0", "type": "bond",
           "link-aggregation": {"mode": "active-backup", "port": ["eth3", "eth4"]},
           "ipv4": {"enabled": true, "dhcp": true}},
          {"name": "old0", "state": "absent"}],
        "routes": {"config": [{"destination": "198.51.100.0/24", "next-hop-address": "192.0.2.254",
                               "next-hop-interface": "br-ext"},
                              {"destination": "203.0.113.0/24", "state": "absent"}]},
        "dns-resolver": {"config": {"server": ["192.0.2.53"], "search": ["example.com"]}},
        "ovn": {"bridge-mappings": [{"localnet": "physnet", "bridge": "br-ext"},
                                    {"localnet": "gone", "state": "absent"}]}}})
}

#[test]
fn a_full_policy_is_valid() {
    assert_eq!(errs(bridge_policy()), Vec::<String>::new());
}

#[test]
fn unknown_fields_are_refused_naming_them() {
    let mut p = bridge_policy();
    p["desiredState"]["interfaces"][0]["bridge"]["options"]["mac-ageing-time"] = json!(300);
    let e = errs(p);
    assert!(
        e.iter().any(
            |e| e.starts_with("spec.desiredState.interfaces[0].bridge.options")
                && e.contains("mac-ageing-time")
        ),
        "{e:?}"
    );
    let e = errs(json!({"desiredState": {"interfaces": [], "ipv6-routes": {}}}));
    assert!(e.iter().any(|e| e.contains("ipv6-routes")), "{e:?}");
    let e = errs(
        json!({"desiredState": {"interfaces": [{"name": "x", "type": "ethernet",
        "ipv6": {"enabled": true}}]}}),
    );
    assert!(e.iter().any(|e| e.contains("ipv6")), "{e:?}");
    let e = errs(json!({"desiredState": {"interfaces": [{"name": "x", "type": "ovs-bridge"}]}}));
    assert!(has(&e, "spec.desiredState.interfaces[0].type"), "{e:?}");
}

#[test]
fn capture_template_and_missing_state_are_refused() {
    let e = errs(json!({"capture": {"a": "b"}, "desiredStateTemplate": {}}));
    assert!(has(&e, "spec.capture"), "{e:?}");
    assert!(has(&e, "spec.desiredStateTemplate"), "{e:?}");
    assert!(has(&e, "spec.desiredState"), "{e:?}");
}

#[test]
fn interface_rules() {
    let e = errs(json!({"desiredState": {"interfaces": [
        {"name": "a-name-far-too-long", "type": "linux-bridge"},
        {"name": "v", "type": "vlan"},
        {"name": "w", "type": "vlan", "vlan": {"base-iface": "eth0", "id": 4095}},
        {"name": "b", "type": "bond", "link-aggregation": {"mode": "fast"}},
        {"name": "e", "type": "ethernet", "bridge": {}},
        {"name": "n"},
        {"name": "x", "state": "absent", "ipv4": {"enabled": false}},
        {"name": "v", "type": "ethernet"},
        {"name": "br", "type": "linux-bridge", "bridge": {"port": [
            {"name": "p1", "vlan": {"mode": "access"}},
            {"name": "p2", "vlan": {"mode": "trunk"}},
            {"name": "p1"}]}},
        {"name": "i", "type": "ethernet", "ipv4": {"enabled": true, "dhcp": true,
            "address": [{"ip": "2001:db8::1", "prefix-length": 33}]}}]}}));
    for f in [
        "spec.desiredState.interfaces[0].name",
        "spec.desiredState.interfaces[1].vlan",
        "spec.desiredState.interfaces[2].vlan.id",
        "spec.desiredState.interfaces[3].link-aggregation.mode",
        "spec.desiredState.interfaces[4].bridge",
        "spec.desiredState.interfaces[5].type",
        "spec.desiredState.interfaces[6].ipv4",
        "spec.desiredState.interfaces[7].name",
        "spec.desiredState.interfaces[8].bridge.port[0].vlan.tag",
        "spec.desiredState.interfaces[8].bridge.port[1].vlan.trunk-tags",
        "spec.desiredState.interfaces[8].bridge.port[2].name",
        "spec.desiredState.interfaces[9].ipv4.address",
        "spec.desiredState.interfaces[9].ipv4.address[0].ip",
        "spec.desiredState.interfaces[9].ipv4.address[0].prefix-length",
    ] {
        assert!(has(&e, f), "{f} missing in {e:?}");
    }
}

#[test]
fn dhcp_auto_fields() {
    let ok = errs(json!({"desiredState": {"interfaces": [
        {"name": "e", "type": "ethernet", "ipv4": {"enabled": true, "dhcp": true,
            "auto-dns": true, "auto-gateway": false, "auto-routes": true,
            "auto-route-table-id": 0}}]}}));
    assert!(ok.is_empty(), "{ok:?}");
    let e = errs(json!({"desiredState": {"interfaces": [
        {"name": "e", "type": "ethernet", "ipv4": {"enabled": true, "auto-dns": true}},
        {"name": "f", "type": "ethernet", "ipv4": {"enabled": true, "dhcp": true,
            "auto-route-table-id": 100}}]}}));
    for f in [
        "spec.desiredState.interfaces[0].ipv4.auto-dns",
        "spec.desiredState.interfaces[1].ipv4.auto-route-table-id",
    ] {
        assert!(has(&e, f), "{f} missing in {e:?}");
    }
    assert_eq!(e.len(), 2, "{e:?}");
}

#[test]
fn routes_dns_and_mappings_rules() {
    let e = errs(json!({"desiredState": {
        "routes": {"config": [{"destination": "2001:db8::/64", "next-hop-interface": "x"},
                              {"destination": "10.0.0.0/8", "next-hop-address": "gw"},
                              {"destination": "10.1.0.0/16"}]},
        "dns-resolver": {"config": {"server": ["dns"], "search": ["-bad"]}},
        "ovn": {"bridge-mappings": [{"localnet": "a:b", "bridge": "br"}, {"localnet": "n"}]}}}));
    for f in [
        "spec.desiredState.routes.config[0].destination",
        "spec.desiredState.routes.config[1].next-hop-address",
        "spec.desiredState.routes.config[2].next-hop-interface",
        "spec.desiredState.dns-resolver.config.server[0]",
        "spec.desiredState.dns-resolver.config.search[0]",
        "spec.desiredState.ovn.bridge-mappings[0].localnet",
        "spec.desiredState.ovn.bridge-mappings[1].bridge",
    ] {
        assert!(has(&e, f), "{f} missing in {e:?}");
    }
}

#[test]
fn max_unavailable_values() {
    assert_eq!(max_unavailable(None, 2), Ok(1));
    assert_eq!(max_unavailable(None, 3), Ok(2));
    assert_eq!(max_unavailable(None, 0), Ok(1));
    assert_eq!(max_unavailable(Some(&IntOrString::Int(3)), 2), Ok(3));
    assert_eq!(
        max_unavailable(Some(&IntOrString::String("10%".into())), 5),
        Ok(1)
    );
    assert_eq!(
        max_unavailable(Some(&IntOrString::String("100%".into())), 5),
        Ok(5)
    );
    assert!(max_unavailable(Some(&IntOrString::Int(0)), 5).is_err());
    assert!(max_unavailable(Some(&IntOrString::String("150%".into())), 5).is_err());
    assert!(max_unavailable(Some(&IntOrString::String("x".into())), 5).is_err());
    let e = errs(json!({"maxUnavailable": "0%", "desiredState": {}}));
    assert!(has(&e, "spec.maxUnavailable"), "{e:?}");
}

#[test]
fn enactment_names() {
    assert_eq!(enactment_name("node-a", "br-ext"), "node-a.br-ext");
}
