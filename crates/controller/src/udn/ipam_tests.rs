use serde_json::json;

use super::*;

fn net(name: &str, ns: &[&str], role: Role, subnet: &str, persistent: bool) -> Network {
    Network {
        network: format!("{}_{name}", ns[0]),
        nad_name: name.into(),
        namespaces: ns.iter().map(|s| s.to_string()).collect(),
        role,
        subnets: vec![subnet.parse().unwrap()],
        exclude: Vec::new(),
        gateway: true,
        persistent,
        host_prefixes: Vec::new(),
    }
}

fn vmi(ns: &str, name: &str, extra: serde_json::Value) -> VirtualMachineInstance {
    let mut v = json!({"metadata": {"name": name, "namespace": ns, "uid": format!("uid-{name}"),
        "resourceVersion": "7"},
        "spec": {"domain": {"devices": {}}}});
    merge(&mut v, extra);
    serde_json::from_value(v).unwrap()
}

fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
    match (a, b) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

fn owned_by_vm(vm: &str) -> serde_json::Value {
    json!({"metadata": {"ownerReferences": [{"apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine", "name": vm, "uid": format!("vm-{vm}")}]}})
}

fn run(
    networks: &[Network],
    primary: &[&str],
    vmis: &[VirtualMachineInstance],
    claims: &[IPAMClaim],
) -> Vec<Action> {
    let primary: BTreeSet<String> = primary.iter().map(|s| s.to_string()).collect();
    let vmis: Vec<&VirtualMachineInstance> = vmis.iter().collect();
    let claims: Vec<&IPAMClaim> = claims.iter().collect();
    decide(Inputs {
        networks,
        primary_namespaces: &primary,
        vmis: &vmis,
        claims: &claims,
        recent: &BTreeMap::new(),
        node_subnets: &BTreeMap::new(),
    })
}

fn annotated(actions: &[Action], name: &str, key: &str) -> Option<PodNetwork> {
    actions.iter().find_map(|a| match a {
        Action::Annotate { name: n, value, .. } if n == name => value.get(key).cloned(),
        _ => None,
    })
}

#[test]
fn primary_vmis_get_distinct_addresses_never_the_gateway_and_same_subnets_coexist() {
    let nets = [
        net("net", &["ua"], Role::Primary, "10.100.0.0/29", false),
        net("net", &["ub"], Role::Primary, "10.100.0.0/29", false),
    ];
    let vmis: Vec<_> = (0..5)
        .map(|i| vmi("ua", &format!("a{i}"), json!({})))
        .chain([vmi("ub", "b0", json!({}))])
        .collect();
    let acts = run(&nets, &["ua", "ub"], &vmis, &[]);
    let mut seen = BTreeSet::new();
    for i in 0..5 {
        let pn = annotated(&acts, &format!("a{i}"), "ua/net").expect("annotated");
        assert_eq!(pn.role, "primary");
        assert_eq!(pn.gateway_ips, vec!["10.100.0.1".to_string()]);
        let ip = pn.ip_addresses[0].clone();
        assert!(ip.ends_with("/29") && ip != "10.100.0.1/29", "{ip}");
        assert!(seen.insert(ip));
    }
    // ub's network is another network: its own range, may repeat ua's addresses.
    assert!(annotated(&acts, "b0", "ub/net").is_some());
    // A /29 has 6 hosts, one the gateway: a sixth VMI in ua gets none and is told why.
    let mut more = vmis.clone();
    more.push(vmi("ua", "a5", json!({})));
    let acts = run(&nets, &["ua", "ub"], &more, &[]);
    let failed: Vec<_> = acts
        .iter()
        .filter_map(|a| match a {
            Action::Failed { name, message, .. } => Some((name.clone(), message.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(failed.len(), 1, "{acts:?}");
    assert!(
        failed[0]
            .1
            .contains("no free address left in 10.100.0.0/29")
    );
}

#[test]
fn unlabelled_namespaces_finished_vmis_and_masqueraded_multus_only_vmis_get_nothing() {
    let nets = [net("net", &["ua"], Role::Primary, "10.100.0.0/24", false)];
    let only_multus = vmi(
        "ua",
        "m",
        json!({"spec": {"networks": [{"name": "x", "multus": {"networkName": "other"}}]}}),
    );
    let done = vmi("ua", "d", json!({"status": {"phase": "Succeeded"}}));
    assert!(run(&nets, &[], &[vmi("ua", "a", json!({}))], &[]).is_empty());
    assert!(run(&nets, &["ua"], &[only_multus, done], &[]).is_empty());
}

#[test]
fn an_existing_annotation_is_kept_and_its_address_is_not_given_again() {
    let nets = [net("net", &["ua"], Role::Primary, "10.100.0.0/30", false)];
    // /30: hosts .1 (gateway) and .2: the one address is taken by `a`.
    let a = vmi(
        "ua",
        "a",
        json!({"metadata": {"annotations": {udn::POD_NETWORKS_ANNOTATION:
            r#"{"ua/net":{"ip_addresses":["10.100.0.2/30"],"role":"primary"}}"#}}}),
    );
    let acts = run(&nets, &["ua"], &[a.clone(), vmi("ua", "b", json!({}))], &[]);
    assert!(annotated(&acts, "a", "ua/net").is_none(), "{acts:?}");
    assert!(matches!(&acts[..], [Action::Failed { name, .. }] if name == "b"));
}

#[test]
fn a_persistent_network_claims_for_vms_and_a_new_vmi_of_the_vm_gets_the_claimed_address() {
    let nets = [net("net", &["ua"], Role::Primary, "10.100.0.0/24", true)];
    let first = vmi("ua", "vm1", owned_by_vm("vm1"));
    let acts = run(&nets, &["ua"], std::slice::from_ref(&first), &[]);
    let Some(Action::CreateClaim {
        name,
        vm_name,
        network,
        interface,
        ips,
        ..
    }) = acts.first()
    else {
        panic!("{acts:?}")
    };
    assert_eq!(
        (name.as_str(), vm_name.as_str(), network.as_str()),
        ("vm1.default", "vm1", "ua_net")
    );
    assert_eq!(interface, "default");
    assert_eq!(
        annotated(&acts, "vm1", "ua/net").unwrap().ip_addresses,
        *ips
    );
    // The claim, with an address this hash would not pick: the restarted VM's VMI gets it.
    let claim: IPAMClaim = serde_json::from_value(json!({"metadata": {"name": "vm1.default",
        "namespace": "ua"}, "spec": {"network": "ua_net", "interface": "default"},
        "status": {"ips": ["10.100.0.200/24"]}}))
    .unwrap();
    let mut again = vmi("ua", "vm1", owned_by_vm("vm1"));
    again.metadata.uid = Some("uid-new".into());
    let acts = run(&nets, &["ua"], &[again], std::slice::from_ref(&claim));
    assert_eq!(acts.len(), 1, "{acts:?}");
    assert_eq!(
        annotated(&acts, "vm1", "ua/net").unwrap().ip_addresses,
        vec!["10.100.0.200/24".to_string()]
    );
    // The claimed address is in use for everyone else.
    let other = vmi("ua", "x", json!({}));
    let n = &nets[0];
    let used = BTreeSet::from(["10.100.0.200".parse().unwrap()]);
    let picked = allocate(n, "ua/x", &used).unwrap();
    assert_ne!(picked[0], "10.100.0.200/24");
    let acts = run(&nets, &["ua"], &[other], &[claim]);
    assert_ne!(
        annotated(&acts, "x", "ua/net").unwrap().ip_addresses[0],
        "10.100.0.200/24"
    );
    // A bare VMI (no VM) on a persistent network gets an address but no claim.
    let acts = run(&nets, &["ua"], &[vmi("ua", "bare", json!({}))], &[]);
    assert!(matches!(&acts[..], [Action::Annotate { .. }]), "{acts:?}");
}

#[test]
fn a_claim_without_addresses_gets_them_and_a_claim_for_another_network_is_an_error() {
    let nets = [net("net", &["ua"], Role::Primary, "10.100.0.0/24", true)];
    let empty: IPAMClaim = serde_json::from_value(json!({"metadata": {"name": "vm1.default",
        "namespace": "ua"}, "spec": {"network": "ua_net", "interface": "default"}}))
    .unwrap();
    let acts = run(
        &nets,
        &["ua"],
        &[vmi("ua", "vm1", owned_by_vm("vm1"))],
        &[empty],
    );
    assert!(matches!(&acts[0], Action::ClaimStatus { name, ips, .. }
        if name == "vm1.default" && ips.len() == 1));
    let foreign: IPAMClaim = serde_json::from_value(json!({"metadata": {"name": "vm1.default",
        "namespace": "ua"}, "spec": {"network": "ua_other", "interface": "default"},
        "status": {"ips": ["10.100.0.9/24"]}}))
    .unwrap();
    let acts = run(
        &nets,
        &["ua"],
        &[vmi("ua", "vm1", owned_by_vm("vm1"))],
        &[foreign],
    );
    assert!(matches!(&acts[..], [Action::Failed { message, .. }]
        if message.contains("is for network \"ua_other\", not ua_net")));
}

#[test]
fn secondary_networks_named_by_multus_are_allocated_with_localnet_exclusions() {
    let mut ln = net(
        "phys",
        &["ln", "lm"],
        Role::Secondary,
        "192.168.77.0/29",
        false,
    );
    ln.network = "cluster_udn_phys".into();
    ln.gateway = false;
    ln.exclude = vec!["192.168.77.0/30".parse().unwrap()];
    let v = vmi(
        "ln",
        "v",
        json!({"spec": {"networks": [{"name": "p", "multus": {"networkName": "phys"}},
            {"name": "q", "multus": {"networkName": "lm/phys"}}]}}),
    );
    let acts = run(std::slice::from_ref(&ln), &[], &[v], &[]);
    let a = annotated(&acts, "v", "ln/phys").expect("own namespace");
    let b = annotated(&acts, "v", "lm/phys").expect("qualified name");
    assert_eq!(a.role, "secondary");
    assert!(a.gateway_ips.is_empty());
    // Hosts .1-.6 less the excluded .1-.3: .4, .5, .6; two distinct ones.
    for x in [&a, &b] {
        let ip = &x.ip_addresses[0];
        assert!(
            ["192.168.77.4/29", "192.168.77.5/29", "192.168.77.6/29"].contains(&ip.as_str()),
            "{ip}"
        );
    }
    assert_ne!(a.ip_addresses, b.ip_addresses);
}

#[test]
fn recent_allocations_are_reused_not_repeated() {
    let nets = [net("net", &["ua"], Role::Primary, "10.100.0.0/24", false)];
    let pn = PodNetwork {
        ip_addresses: vec!["10.100.0.77/24".into()],
        gateway_ips: vec!["10.100.0.1".into()],
        role: "primary".into(),
    };
    let recent = BTreeMap::from([(("uid-a".to_string(), "ua/net".to_string()), pn.clone())]);
    let primary = BTreeSet::from(["ua".to_string()]);
    let (a, b) = (vmi("ua", "a", json!({})), vmi("ua", "b", json!({})));
    let vmis = [&a, &b];
    let acts = decide(Inputs {
        networks: &nets,
        primary_namespaces: &primary,
        vmis: &vmis,
        claims: &[],
        recent: &recent,
        node_subnets: &BTreeMap::new(),
    });
    assert_eq!(annotated(&acts, "a", "ua/net"), Some(pn));
    assert_ne!(
        annotated(&acts, "b", "ua/net").unwrap().ip_addresses[0],
        "10.100.0.77/24"
    );
}

#[test]
fn ipv6_subnets_and_vnis() {
    let n = net("net", &["ua"], Role::Primary, "fd00:10::/64", false);
    let a = allocate(&n, "ua/a", &BTreeSet::new()).unwrap();
    assert!(
        a[0].starts_with("fd00:10::") && a[0].ends_with("/64"),
        "{a:?}"
    );
    assert_eq!(n.gateways(), vec!["fd00:10::1".to_string()]);
    let v = pick_vni("ua_net", &BTreeSet::new());
    assert!((MIN_VNI..=MAX_VNI).contains(&v));
    assert_ne!(pick_vni("ua_net", &BTreeSet::from([v])), v);
    assert_eq!(pick_vni("ua_net", &BTreeSet::new()), v, "stable");
}

fn l3(ns: &str, cidr: &str, host: u8) -> Network {
    let mut n = net("l3", &[ns], Role::Primary, cidr, false);
    n.host_prefixes = vec![host];
    n
}

#[test]
fn layer3_nodes_get_distinct_host_subnets_kept_across_passes() {
    let n = l3("ua", "10.150.0.0/22", 24);
    let known = BTreeSet::from(["ua_l3".to_string(), "gone".to_string()]);
    let empty: BTreeMap<String, NodeSubnets> = ["n1", "n2", "n3", "n4"]
        .iter()
        .map(|n| (n.to_string(), NodeSubnets::new()))
        .collect();
    let first = node_subnets(std::slice::from_ref(&n), &known, &empty);
    assert_eq!(first.len(), 4);
    let all: BTreeSet<&String> = first.values().map(|m| &m["ua_l3"][0]).collect();
    assert_eq!(all.len(), 4, "{first:?}");
    for s in &all {
        let h: IpNet = s.parse().unwrap();
        assert_eq!(h.prefix_len(), 24);
        assert!("10.150.0.0/22".parse::<IpNet>().unwrap().contains(&h));
    }
    // Settled: nothing changes; a fifth node finds the /22 full.
    assert!(node_subnets(std::slice::from_ref(&n), &known, &first).is_empty());
    let mut more = first.clone();
    more.insert("n5".into(), NodeSubnets::new());
    assert!(node_subnets(std::slice::from_ref(&n), &known, &more).is_empty());
    // A duplicate (two nodes claiming one subnet) is resolved in name order: the later node
    // gets a free one. An unknown network's entry is dropped.
    let mut dup = first.clone();
    let n1 = dup["n1"]["ua_l3"].clone();
    dup.get_mut("n2")
        .unwrap()
        .insert("ua_l3".into(), n1.clone());
    dup.get_mut("n3")
        .unwrap()
        .insert("old_net".into(), vec!["10.9.0.0/24".into()]);
    let fixed = node_subnets(std::slice::from_ref(&n), &known, &dup);
    assert_ne!(fixed["n2"]["ua_l3"], n1);
    assert!(!fixed["n3"].contains_key("old_net"));
    assert!(!fixed.contains_key("n1"));
}

#[test]
fn a_layer3_vmi_is_addressed_from_its_nodes_subnet_once_bound() {
    let n = l3("ua", "10.150.0.0/16", 24);
    let subnets = BTreeMap::from([(
        "n1".to_string(),
        NodeSubnets::from([("ua_l3".to_string(), vec!["10.150.7.0/24".to_string()])]),
    )]);
    let primary = BTreeSet::from(["ua".to_string()]);
    let unbound = vmi("ua", "u", json!({}));
    let bound = vmi("ua", "b", json!({"status": {"nodeName": "n1"}}));
    let on_n2 = vmi("ua", "c", json!({"status": {"nodeName": "n2"}}));
    let vmis = [&unbound, &bound, &on_n2];
    let acts = decide(Inputs {
        networks: std::slice::from_ref(&n),
        primary_namespaces: &primary,
        vmis: &vmis,
        claims: &[],
        recent: &BTreeMap::new(),
        node_subnets: &subnets,
    });
    assert_eq!(acts.len(), 1, "{acts:?}");
    let pn = annotated(&acts, "b", "ua/l3").unwrap();
    assert!(pn.ip_addresses[0].starts_with("10.150.7."), "{pn:?}");
    assert!(pn.ip_addresses[0].ends_with("/24"));
    assert_ne!(pn.ip_addresses[0], "10.150.7.1/24");
    assert_eq!(pn.gateway_ips, vec!["10.150.7.1".to_string()]);
}
