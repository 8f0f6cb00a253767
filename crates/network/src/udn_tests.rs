//! Unit tests of [`super`] (the Layer2 user-defined network decisions and steps).

use super::*;

const CONFIG: &str = r#"{"cniVersion":"1.0.0","type":"ovn-k8s-cni-overlay","name":"ua_net",
    "netAttachDefName":"ua/net","topology":"layer2","role":"primary",
    "subnets":"10.100.0.0/24","mtu":1400,"allowPersistentIPs":true}"#;

fn net(node_ns: Option<&str>) -> UdnNetwork {
    let c = parse_nad_config(CONFIG).unwrap();
    UdnNetwork::from_nad(&c, 10001, node_ns, Some(Ipv4Addr::new(192, 168, 1, 1))).unwrap()
}

#[test]
fn the_nad_config_decides_the_network() {
    let n = net(Some("nodea"));
    assert_eq!(n.name, "ua_net");
    assert_eq!(n.subnet.to_string(), "10.100.0.0/24");
    assert_eq!(n.mtu, 1400);
    assert!(
        n.netns.starts_with("fvn-") && n.netns.ends_with("-nodea"),
        "{n:?}"
    );
    // The same name on one node is the same namespace; another network is another one.
    assert_eq!(n.netns, net(Some("nodea")).netns);
    assert_ne!(netns_name("ua_net", None), netns_name("ub_net", None));
    assert_eq!(netns_name("ua_net", None).len(), 12);
    // Layer3, secondary, IPv6-only are refused naming the field.
    let l3 = CONFIG.replace("layer2", "layer3");
    let e = UdnNetwork::from_nad(&parse_nad_config(&l3).unwrap(), 10001, None, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("spec.config.topology") && e.contains("Layer3"),
        "{e}"
    );
    let sec = CONFIG.replace("\"primary\"", "\"secondary\"");
    let e = UdnNetwork::from_nad(&parse_nad_config(&sec).unwrap(), 10001, None, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("spec.config.role"), "{e}");
    let v6 = CONFIG.replace("10.100.0.0/24", "fd00::/64");
    let e = UdnNetwork::from_nad(&parse_nad_config(&v6).unwrap(), 10001, None, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("spec.config.subnets"), "{e}");
    // No MTU in the config: OVN-K's default.
    let c = parse_nad_config(&CONFIG.replace(",\"mtu\":1400", "")).unwrap();
    assert_eq!(
        UdnNetwork::from_nad(&c, 10001, None, None).unwrap().mtu,
        DEFAULT_MTU
    );
}

#[test]
fn a_secondary_layer2_network_joins_its_bridge() {
    let sec = CONFIG.replace("\"primary\"", "\"secondary\"");
    let c = parse_nad_config(&sec).unwrap();
    let n = UdnNetwork::from_secondary_nad(&c, 10002, None, Some("nodea"), None).unwrap();
    assert_eq!(
        (n.subnet.to_string(), n.vni),
        ("10.100.0.0/24".into(), 10002)
    );
    assert_eq!(
        n.netns,
        net(Some("nodea")).netns,
        "one namespace per network name"
    );
    assert!(n.gateway.is_none());
    // IPAM disabled: no subnet, still a network.
    let c = parse_nad_config(&sec.replace("\"subnets\":\"10.100.0.0/24\",", "")).unwrap();
    let n = UdnNetwork::from_secondary_nad(&c, 10002, None, None, None).unwrap();
    assert_eq!(n.subnet.to_string(), "0.0.0.0/0");
    // Primary, Layer3, IPv6-only with IPAM: refused naming the field.
    for (text, needle) in [
        (CONFIG.to_string(), "spec.config.role \"primary\""),
        (
            sec.replace("layer2", "layer3"),
            "k8s.ovn.org/node-subnets]: this node has no host subnet",
        ),
        (
            sec.replace("10.100.0.0/24", "fd00::/64"),
            "spec.config.subnets",
        ),
    ] {
        let e =
            UdnNetwork::from_secondary_nad(&parse_nad_config(&text).unwrap(), 1, None, None, None)
                .unwrap_err()
                .to_string();
        assert!(e.contains(needle), "{e}");
    }
    // The interface's plan: the veth's node end in the network's namespace, on its bridge.
    let node = NodeNetwork::new(
        Ipam::new("10.244.0.0/16".parse().unwrap(), 24).unwrap(),
        "10.244.1.0/24".parse().unwrap(),
    );
    let req = crate::SecondaryRequest {
        uid: "u1".into(),
        interface: "blue".into(),
        nad: "ua/blue".into(),
        config: crate::BridgeConfig {
            bridge: BRIDGE.into(),
            vlan: None,
            mtu: None,
        },
        index: 1,
        mac: "02:00:00:00:00:01".parse().unwrap(),
        queues: 1,
    };
    let mut plan = crate::SecondaryPlan::build(&node, &req).unwrap();
    let n = UdnNetwork::from_secondary_nad(
        &parse_nad_config(&sec).unwrap(),
        10002,
        None,
        Some("nodea"),
        None,
    )
    .unwrap();
    join_secondary(&mut plan, &n);
    assert_eq!(plan.node_netns.as_deref(), Some(n.netns.as_str()));
    assert_eq!((plan.bridge.as_str(), plan.mtu), (BRIDGE, 1400));
    assert_eq!(plan.udn.as_ref(), Some(&n));
    let acts = crate::secondary::secondary_actions(&plan);
    assert!(
        acts.iter().any(|a| format!("{a:?}").contains("master")
            && format!("{a:?}").contains(BRIDGE)
            && format!("{a:?}").contains(&n.netns)),
        "{acts:?}"
    );
}

#[test]
fn vni_annotation() {
    assert_eq!(parse_vni(None).unwrap(), None);
    assert_eq!(parse_vni(Some("10005")).unwrap(), Some(10005));
    for bad in ["4244", "x", "16777216"] {
        let e = parse_vni(Some(bad)).unwrap_err().to_string();
        assert!(e.contains(VNI_ANNOTATION), "{e}");
    }
}

#[test]
fn own_namespaces_are_told_from_other_nodes_and_other_kinds() {
    let mine = netns_name("ua_net", Some("nodea"));
    assert!(is_own_netns(&mine, Some("nodea")));
    assert!(!is_own_netns(&mine, Some("nodeb")));
    assert!(!is_own_netns(&mine, None));
    assert!(is_own_netns(&netns_name("x", None), None));
    assert!(!is_own_netns("fv-1234", None));
    assert!(!is_own_netns("fvn-xyz", None));
}

#[test]
fn network_steps_make_the_vxlan_from_the_node_namespace() {
    let n = net(Some("nodea"));
    let s = network_steps(&n);
    let vx = s.vxlan.expect("a VXLAN step").command_line();
    assert_eq!(
        vx,
        format!(
            "ip -n nodea link add udn-vx0 netns {} mtu 1400 type vxlan id 10001 local 192.168.1.1 dstport 4789",
            n.netns
        )
    );
    assert_eq!(s.before[0], Action::AddNetns(n.netns.clone()));
    let after: Vec<String> = s.after.iter().map(|a| a.command_line()).collect();
    assert_eq!(
        after,
        [
            format!(
                "ip -n {} link set udn-vx0 master udn-br0 mtu 1400 up",
                n.netns
            ),
            format!("ip -n {} link set udn-br0 mtu 1400 up", n.netns),
        ]
    );
    // Without an underlay address: a bridge only.
    let mut local_only = n.clone();
    local_only.local = None;
    let s = network_steps(&local_only);
    assert!(s.vxlan.is_none() && s.after.len() == 1);
    assert_eq!(
        network_teardown(&n.netns),
        vec![
            Action::DelLink {
                netns: Some(n.netns.clone()),
                name: VXLAN.into()
            },
            Action::DelNetns(n.netns.clone())
        ]
    );
}

#[test]
fn a_gateway_is_anycast_with_its_own_transit_link() {
    assert_eq!(
        transit(0),
        (
            Ipv4Addr::new(169, 254, 128, 1),
            Ipv4Addr::new(169, 254, 128, 2)
        )
    );
    assert_eq!(transit(300).1, Ipv4Addr::new(169, 254, 132, 178));
    for i in [0, 1, 300, 8191] {
        assert_eq!(transit_index(transit(i).1), Some(i));
        assert_eq!(transit_index(transit(i).0), None);
    }
    assert_eq!(transit_index(Ipv4Addr::new(10, 0, 0, 2)), None);
    assert_eq!(pick_transit(&BTreeSet::from([0, 1, 3])).unwrap(), 2);
    let j = r#"[{"ifname":"udn-gw","addr_info":[{"family":"inet","local":"169.254.128.6","prefixlen":30}]}]"#;
    assert_eq!(parse_transit(j), Some(1));
    assert_eq!(parse_transit("[]"), None);

    let mut n = net(Some("nodea"));
    let cluster: Ipv4Cidr = "10.244.0.0/16".parse().unwrap();
    assert!(gateway_steps(&n, 0, cluster).is_empty());
    n.gateway = Some(UdnGateway {
        address: Ipv4Addr::new(10, 100, 0, 1),
        uplink: Some("under0".into()),
    });
    let steps: Vec<String> = gateway_steps(&n, 1, cluster)
        .iter()
        .map(|a| a.command_line())
        .collect();
    let ns = &n.netns;
    let hv = node_gw_veth(&n);
    assert!(hv.starts_with("fvg") && hv.len() == 11, "{hv}");
    for want in [
        format!("ip -n {ns} addr replace 10.100.0.1/24 dev udn-br0"),
        format!("ip -n {ns} link set udn-br0 address {}", gateway_mac(&n)),
        format!("ip -n nodea addr replace 169.254.128.5/30 dev {hv}"),
        format!("ip -n {ns} addr replace 169.254.128.6/30 dev udn-gw"),
        format!("ip -n {ns} route replace default via 169.254.128.5 dev udn-gw"),
    ] {
        assert!(steps.contains(&want), "{want} not in {steps:#?}");
    }
    // The same gateway MAC on every node, another per network.
    assert_eq!(gateway_mac(&n), gateway_mac(&net(Some("nodeb"))));
    let mut other = n.clone();
    other.name = "ub_net".into();
    assert_ne!(gateway_mac(&n), gateway_mac(&other));
    // The gateway's frames never leave through the VXLAN device; guests reach nothing
    // of the node but answers; the pod network and link-local are never forwarded to.
    let netside = network_gateway_script(&n);
    assert!(
        netside.contains(&format!(
            "oifname \"udn-vx0\" ether saddr {} counter drop",
            gateway_mac(&n)
        )),
        "{netside}"
    );
    assert!(
        netside.contains("oifname \"udn-gw\" masquerade"),
        "{netside}"
    );
    assert!(
        netside.contains("iifname \"udn-gw\" counter drop"),
        "{netside}"
    );
    let nodeside = node_gateway_script(cluster, "under0");
    assert!(
        nodeside.contains("iifname \"fvg*\" counter drop"),
        "{nodeside}"
    );
    assert!(
        nodeside
            .contains("iifname \"fvg*\" ip daddr { 10.244.0.0/16, 169.254.0.0/16 } counter drop"),
        "{nodeside}"
    );
    assert!(
        nodeside.contains("ip saddr 169.254.128.0/17 oifname \"under0\" masquerade"),
        "{nodeside}"
    );
}

#[test]
fn flood_entries_follow_the_peers() {
    let n = net(None);
    let fdb = r#"[{"mac":"00:00:00:00:00:00","dst":"192.168.1.2","flags":["self"]},
        {"mac":"00:00:00:00:00:00","dst":"192.168.1.3"},
        {"mac":"5a:11:22:33:44:55","dst":"192.168.1.2"},
        {"mac":"33:33:00:00:00:01","flags":["self"]}]"#;
    let observed = parse_flood_entries(fdb).unwrap();
    assert_eq!(
        observed,
        BTreeSet::from([Ipv4Addr::new(192, 168, 1, 2), Ipv4Addr::new(192, 168, 1, 3)])
    );
    let peers = BTreeSet::from([
        Ipv4Addr::new(192, 168, 1, 1), // this node: never a flood target
        Ipv4Addr::new(192, 168, 1, 2),
        Ipv4Addr::new(192, 168, 1, 4),
    ]);
    let steps: Vec<String> = fdb_sync_actions(&n, &observed, &peers)
        .iter()
        .map(|a| a.command_line())
        .collect();
    assert_eq!(
        steps,
        [
            format!(
                "bridge -n {} fdb append 00:00:00:00:00:00 dev udn-vx0 dst 192.168.1.4",
                n.netns
            ),
            format!(
                "bridge -n {} fdb del 00:00:00:00:00:00 dev udn-vx0 dst 192.168.1.3",
                n.netns
            ),
        ]
    );
    // In sync: nothing to do.
    let synced = BTreeSet::from([Ipv4Addr::new(192, 168, 1, 2), Ipv4Addr::new(192, 168, 1, 4)]);
    assert!(fdb_sync_actions(&n, &synced, &peers).is_empty());
    assert!(parse_flood_entries("").unwrap().is_empty());
}

#[test]
fn the_pod_networks_annotation_gives_the_address() {
    let subnet: Ipv4Cidr = "10.100.0.0/24".parse().unwrap();
    let ann = r#"{"ua/net":{"ip_addresses":["10.100.0.5/24"],"gateway_ips":["10.100.0.1"],"role":"primary"}}"#;
    let a = parse_pod_networks(Some(ann), "ua/net", subnet)
        .unwrap()
        .unwrap();
    assert_eq!(a.address, Ipv4Addr::new(10, 100, 0, 5));
    assert_eq!(a.prefix, 24);
    assert_eq!(a.gateway, Some(Ipv4Addr::new(10, 100, 0, 1)));
    // Not there yet: wait.
    assert_eq!(parse_pod_networks(None, "ua/net", subnet).unwrap(), None);
    assert_eq!(
        parse_pod_networks(Some(ann), "ub/net", subnet).unwrap(),
        None
    );
    // Outside the subnet, malformed: errors naming the annotation.
    let far = ann.replace("10.100.0.5/24", "10.200.0.5/24");
    let e = parse_pod_networks(Some(&far), "ua/net", subnet)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(POD_NETWORKS_ANNOTATION) && e.contains("10.200.0.5"),
        "{e}"
    );
    let e = parse_pod_networks(Some("{"), "ua/net", subnet)
        .unwrap_err()
        .to_string();
    assert!(e.contains(POD_NETWORKS_ANNOTATION), "{e}");
}

#[test]
fn a_vmi_joins_the_network_bridge_with_its_annotated_address() {
    let n = net(Some("nodea"));
    let ipam = Ipam::default();
    let node = NodeNetwork::new(ipam, ipam.node_subnet(1).unwrap());
    let v = UdnVmi {
        uid: "uid-1",
        namespace: "ua",
        name: "a1",
        interface: "default",
        mac: None,
        queues: 1,
        node: &node,
    };
    let addr = UdnAddress {
        address: Ipv4Addr::new(10, 100, 0, 5),
        prefix: 24,
        gateway: Some(Ipv4Addr::new(10, 100, 0, 1)),
    };
    let p = vmi_plan(&n, &v, addr).unwrap();
    assert_eq!(p.netns, "fv-uid-1");
    assert_eq!(p.address, addr.address);
    assert_eq!(p.binding, Binding::Bridge);
    assert_eq!(p.node.netns.as_deref(), Some(n.netns.as_str()));
    assert_eq!(p.node.bridge, BRIDGE);
    assert_eq!(p.lease.address, addr.address);
    assert_eq!(p.lease.subnet, n.subnet);
    assert_eq!(p.lease.router, None);
    // With a gateway on this node: offered as the router.
    let mut gw = n.clone();
    gw.gateway = Some(UdnGateway {
        address: Ipv4Addr::new(10, 100, 0, 1),
        uplink: Some("up0".into()),
    });
    let pg = vmi_plan(&gw, &v, addr).unwrap();
    assert_eq!(pg.lease.router, Some(Ipv4Addr::new(10, 100, 0, 1)));
    assert!(p.lease.dns.is_empty());
    assert_eq!(p.lease.mtu, Some(1400));
    assert_eq!(p.udn.as_ref(), Some(&n));
    assert!(!p.away);
    // The node side of the veth is a port of the network's bridge in its namespace.
    let steps: Vec<String> = crate::render::pod_actions(&p)
        .iter()
        .map(|a| a.command_line())
        .collect();
    assert!(
        steps.iter().any(|s| s
            == &format!(
                "ip -n {} link set {} master udn-br0 mtu 1400 up",
                n.netns, p.host_veth
            )),
        "{steps:#?}"
    );
}

const L3_SECONDARY: &str = r#"{"cniVersion":"1.0.0","type":"ovn-k8s-cni-overlay","name":"sa_sec",
    "netAttachDefName":"sa/sec","topology":"layer3","role":"secondary",
    "subnets":"10.210.0.0/16/24","mtu":1400}"#;

fn l3_secondary(ns: &str, host: &str, node: &str) -> UdnNetwork {
    let c = parse_nad_config(&L3_SECONDARY.replace("sa_sec", &format!("{ns}_sec"))).unwrap();
    UdnNetwork::from_secondary_nad(
        &c,
        10003,
        Some(host.parse().unwrap()),
        Some(node),
        Some(Ipv4Addr::new(192, 168, 1, 1)),
    )
    .unwrap()
}

#[test]
fn a_secondary_layer3_network_is_its_node_host_subnet_routed() {
    let n = l3_secondary("sa", "10.210.7.0/24", "nodea");
    assert!(n.layer3 && n.gateway.is_none(), "{n:?}");
    assert_eq!(n.subnet.to_string(), "10.210.7.0/24");
    assert_eq!(
        n.network_cidr.map(|c| c.to_string()).as_deref(),
        Some("10.210.0.0/16")
    );
    // Routed like a Primary Layer3 network: the node's gateway on the bridge, the VXLAN
    // device no bridge port, the rest of the network's subnet unreachable here.
    let steps = network_steps(&n);
    let after: Vec<String> = steps.after.iter().map(|a| a.command_line()).collect();
    let ns = &n.netns;
    for want in [
        format!("ip -n {ns} addr replace 10.210.7.1/24 dev udn-br0"),
        format!("ip -n {ns} route replace unreachable 10.210.0.0/16"),
    ] {
        assert!(after.contains(&want), "{want} not in {after:#?}");
    }
    assert!(!after.iter().any(|a| a.contains("master")), "{after:#?}");
    // Two namespaces' networks of one subnet: two names, two namespaces (and the controller
    // gives each its VNI): nothing routes between them.
    let other = l3_secondary("sb", "10.210.7.0/24", "nodea");
    assert_ne!(n.netns, other.netns);
    // A host subnet outside the network, or none, is refused naming the annotation.
    let c = parse_nad_config(L3_SECONDARY).unwrap();
    for host in [Some("10.9.0.0/24"), Some("10.210.0.0/15"), None] {
        let e = UdnNetwork::from_secondary_nad(&c, 1, host.map(|h| h.parse().unwrap()), None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("k8s.ovn.org/node-subnets"), "{e}");
    }
    // The NAD's subnets without a hostSubnet part, and IPv6-only ones.
    assert_eq!(
        crate::udn_l3::network_cidr(&["fd00::/48/64".into(), "10.1.0.0/16".into()])
            .unwrap()
            .to_string(),
        "10.1.0.0/16"
    );
    let e = crate::udn_l3::network_cidr(&["fd00::/48/64".into()]).unwrap_err();
    assert!(e.to_string().contains("spec.config.subnets"), "{e}");
}

#[test]
fn a_secondary_layer3_lease_routes_the_network_via_the_node_gateway() {
    let n = l3_secondary("sa", "10.210.7.0/24", "nodea");
    let mac: MacAddr = "02:00:00:00:00:07".parse().unwrap();
    let mut lease = crate::localnet::lease(
        Ipv4Addr::new(10, 210, 7, 9),
        "10.210.7.0/24".parse().unwrap(),
        mac,
        1400,
        "s1",
    );
    crate::udn_l3::secondary_lease(&n, &mut lease).unwrap();
    assert_eq!(lease.router, None);
    assert_eq!(
        lease.routes,
        vec![crate::dhcp::StaticRoute {
            destination: "10.210.0.0/16".parse().unwrap(),
            gateway: Ipv4Addr::new(10, 210, 7, 1),
        }]
    );
    // On the wire: option 121 carries exactly that route (RFC 3442: 16.10.210 via
    // 10.210.7.1), no router (3), no default route.
    assert_eq!(
        crate::dhcp::classless_routes(&lease),
        vec![(
            "10.210.0.0/16".parse().unwrap(),
            Ipv4Addr::new(10, 210, 7, 1)
        )]
    );
    // An address outside the node's host subnet is refused naming the annotation; a Layer2
    // network's lease is left as it is.
    let mut far = lease.clone();
    far.address = Ipv4Addr::new(10, 210, 8, 9);
    let e = crate::udn_l3::secondary_lease(&n, &mut far)
        .unwrap_err()
        .to_string();
    assert!(e.contains(POD_NETWORKS_ANNOTATION), "{e}");
    let mut l2 = lease.clone();
    l2.routes.clear();
    crate::udn_l3::secondary_lease(&net(None), &mut l2).unwrap();
    assert!(l2.routes.is_empty());
}

#[test]
fn a_primary_layer3_gateway_is_egress_only() {
    let c = parse_nad_config(
        &L3_SECONDARY
            .replace("secondary", "primary")
            .replace("sa_sec", "ua_l3"),
    )
    .unwrap();
    let mut n = UdnNetwork::from_layer3_nad(
        &c,
        10004,
        "10.210.3.0/24".parse().unwrap(),
        Some("nodea"),
        Some(Ipv4Addr::new(192, 168, 1, 1)),
    )
    .unwrap();
    n.gateway = Some(UdnGateway {
        address: n.subnet.gateway(),
        uplink: Some("under0".into()),
    });
    let cluster: Ipv4Cidr = "10.244.0.0/16".parse().unwrap();
    let steps: Vec<String> = gateway_steps(&n, 2, cluster)
        .iter()
        .map(|a| a.command_line())
        .collect();
    let ns = &n.netns;
    let hv = node_gw_veth(&n);
    for want in [
        format!("ip -n nodea addr replace 169.254.128.9/30 dev {hv}"),
        format!("ip -n {ns} addr replace 169.254.128.10/30 dev udn-gw"),
        format!("ip -n {ns} route replace default via 169.254.128.9 dev udn-gw"),
    ] {
        assert!(steps.contains(&want), "{want} not in {steps:#?}");
    }
    // No anycast: each node's gateway is its host subnet's own (routed_steps), its MAC the
    // bridge's.
    assert!(
        !steps
            .iter()
            .any(|s| s.contains(" address ") || s.contains("dev udn-br0")),
        "{steps:#?}"
    );
    // The same protections as Layer2's: masquerade out, nothing in from the node's side;
    // no bridge table (the VXLAN device is no bridge port).
    let netside = network_gateway_script(&n);
    assert!(
        netside.contains("oifname \"udn-gw\" masquerade"),
        "{netside}"
    );
    assert!(
        netside.contains("iifname \"udn-gw\" counter drop"),
        "{netside}"
    );
    assert!(!netside.contains("table bridge"), "{netside}");
    // The network's own subnet never takes the default route.
    let routed: Vec<String> = crate::udn_l3::routed_steps(&n)
        .iter()
        .map(|a| a.command_line())
        .collect();
    assert!(
        routed.contains(&format!(
            "ip -n {ns} route replace unreachable 10.210.0.0/16"
        )),
        "{routed:#?}"
    );
}

#[test]
fn the_node_gateway_table_goes_with_the_last_egress() {
    assert_eq!(node_gateway_cleanup(Some("na"), true), None);
    assert_eq!(
        node_gateway_cleanup(Some("na"), false),
        Some(Action::DelNftTable {
            netns: Some("na".into()),
            family: "ip".into(),
            table: GW_TABLE.into(),
        })
    );
}
