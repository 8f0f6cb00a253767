//! The pure parts: parsing `ip -j` output, planning, and the rollback from a checkpoint.

use ferrovirt_api::nmstate::state::DesiredState;
use serde_json::json;

use super::current::{Current, Link, RouteEntry, parse_links, parse_routes};
use super::plan::{DhcpOpts, dhcp_changes, plan, restore_state};

fn link(name: &str, kind: &str, up: bool, addrs: &[(&str, i64)]) -> Link {
    Link {
        name: name.into(),
        kind: kind.into(),
        up,
        addrs: addrs.iter().map(|(a, p)| (a.to_string(), *p)).collect(),
        ..Default::default()
    }
}

fn node() -> Current {
    Current {
        links: vec![
            link("lo", "loopback", true, &[("127.0.0.1", 8)]),
            link("uplink0", "veth", true, &[("10.253.1.2", 30)]),
            link("eth1", "veth", true, &[]),
        ],
        routes: vec![RouteEntry {
            dst: "10.253.1.0/30".into(),
            gateway: None,
            dev: Some("uplink0".into()),
        }],
    }
}

fn desired(v: serde_json::Value) -> DesiredState {
    serde_json::from_value(v).unwrap()
}

fn lines(steps: &[super::plan::Step]) -> Vec<String> {
    steps.iter().map(|s| s.line()).collect()
}

fn bridge() -> DesiredState {
    desired(
        json!({"interfaces": [{"name": "br-ext", "type": "linux-bridge", "state": "up",
        "bridge": {"options": {"stp": {"enabled": false}}, "port": [{"name": "eth1"}]},
        "ipv4": {"enabled": true, "address": [{"ip": "192.0.2.1", "prefix-length": 24}]}}],
        "routes": {"config": [{"destination": "198.51.100.0/24", "next-hop-address": "192.0.2.254",
                               "next-hop-interface": "br-ext"}]}}),
    )
}

/// What the kernel looks like after the bridge plan ran.
fn after_bridge() -> Current {
    let mut c = node();
    c.links
        .iter_mut()
        .find(|l| l.name == "eth1")
        .unwrap()
        .master = Some("br-ext".into());
    let mut br = link("br-ext", "linux-bridge", true, &[("192.0.2.1", 24)]);
    br.stp = Some(false);
    c.links.push(br);
    c.routes.push(RouteEntry {
        dst: "198.51.100.0/24".into(),
        gateway: Some("192.0.2.254".into()),
        dev: Some("br-ext".into()),
    });
    c
}

#[test]
fn a_bridge_with_a_port_address_and_route() {
    let s = plan(&node(), &bridge()).unwrap();
    assert_eq!(
        lines(&s),
        [
            "ip link add br-ext type bridge stp_state 0",
            "ip link set eth1 master br-ext",
            "ip link set eth1 up",
            "ip addr add 192.0.2.1/24 dev br-ext",
            "ip link set br-ext up",
            "ip route replace 198.51.100.0/24 via 192.0.2.254 dev br-ext",
        ]
    );
    // Applying again changes nothing.
    assert_eq!(plan(&after_bridge(), &bridge()).unwrap(), vec![]);
}

#[test]
fn rollback_of_a_new_bridge_deletes_it_and_its_route() {
    let back = restore_state(&node(), &bridge());
    let s = lines(&plan(&after_bridge(), &back).unwrap());
    assert!(s.contains(&"ip route del 198.51.100.0/24 via 192.0.2.254 dev br-ext".to_string()));
    assert_eq!(s.last().unwrap(), "ip link del br-ext");
    // The port is released by the deletion; its addresses (none) stay.
    assert!(!s.iter().any(|l| l.contains("eth1") && l.contains("addr")));
}

#[test]
fn rollback_puts_back_a_removed_address() {
    let cut = desired(
        json!({"interfaces": [{"name": "uplink0", "type": "ethernet",
        "state": "up", "ipv4": {"enabled": false}}]}),
    );
    assert_eq!(
        lines(&plan(&node(), &cut).unwrap()),
        ["ip addr del 10.253.1.2/30 dev uplink0"]
    );
    let mut after = node();
    after.links[1].addrs.clear();
    let back = restore_state(&node(), &cut);
    assert_eq!(
        lines(&plan(&after, &back).unwrap()),
        ["ip addr add 10.253.1.2/30 dev uplink0"]
    );
}

#[test]
fn absent_interfaces_and_routes() {
    let gone = desired(json!({"interfaces": [{"name": "br-ext", "state": "absent"},
        {"name": "eth1", "state": "absent"}, {"name": "nothere", "state": "absent"}],
        "routes": {"config": [{"destination": "198.51.100.0/24", "state": "absent"}]}}));
    assert_eq!(
        lines(&plan(&after_bridge(), &gone).unwrap()),
        [
            "ip link set eth1 down",
            "ip route del 198.51.100.0/24",
            "ip link del br-ext",
        ]
    );
}

#[test]
fn what_the_node_cannot_do_fails_naming_the_field() {
    let e = plan(
        &node(),
        &desired(json!({"interfaces": [{"name": "eth9", "type": "ethernet"}]})),
    )
    .unwrap_err();
    assert!(
        e.starts_with("spec.desiredState.interfaces[0].name:"),
        "{e}"
    );
    let e = plan(
        &node(),
        &desired(json!({"interfaces": [{"name": "eth1", "type": "linux-bridge"}]})),
    )
    .unwrap_err();
    assert!(e.contains("exists on this node as veth"), "{e}");
    let e = plan(
        &node(),
        &desired(json!({"interfaces": [{"name": "br", "type": "linux-bridge",
            "bridge": {"port": [{"name": "eth7"}]}}]})),
    )
    .unwrap_err();
    assert!(
        e.starts_with("spec.desiredState.interfaces[0].bridge.port[0]:"),
        "{e}"
    );
    // DHCP and the resolver are carried out by the client and the resolver file, not by
    // steps: a DHCP interface's addresses are left to its client.
    let mut n = node();
    n.links[2].addrs.push(("192.168.78.20".into(), 24));
    let steps = plan(
        &n,
        &desired(json!({"interfaces": [{"name": "eth1", "type": "ethernet",
            "ipv4": {"enabled": true, "dhcp": true}}],
            "dns-resolver": {"config": {"server": ["192.0.2.53"]}}})),
    )
    .unwrap();
    assert!(steps.is_empty(), "{:?}", lines(&steps));
}

#[test]
fn dhcp_changes_start_and_stop_clients() {
    let d = desired(json!({"interfaces": [
        {"name": "eth1", "type": "ethernet", "ipv4": {"enabled": true, "dhcp": true}},
        {"name": "eth2", "type": "ethernet", "ipv4": {"enabled": true, "dhcp": true,
            "auto-gateway": false, "auto-dns": false}},
        {"name": "eth3", "type": "ethernet", "ipv4": {"enabled": true, "dhcp": true,
            "auto-routes": false}},
        {"name": "eth4", "type": "ethernet", "ipv4": {"enabled": true, "dhcp": false}},
        {"name": "eth5", "type": "ethernet", "ipv4": {"enabled": false}},
        {"name": "eth6", "state": "absent"},
        {"name": "eth7", "type": "ethernet", "ipv4": {"enabled": true,
            "address": [{"ip": "192.0.2.1", "prefix-length": 24}]}},
        {"name": "eth8", "type": "ethernet"}]}));
    let on = |gateway, dns| Some(DhcpOpts { gateway, dns });
    assert_eq!(
        dhcp_changes(&d),
        vec![
            ("eth1".to_string(), on(true, true)),
            ("eth2".to_string(), on(false, false)),
            ("eth3".to_string(), on(false, true)),
            ("eth4".to_string(), None),
            ("eth5".to_string(), None),
            ("eth6".to_string(), None),
            ("eth7".to_string(), None),
        ]
    );
}

#[test]
fn vlans_bonds_and_port_vlans() {
    let d = desired(json!({"interfaces": [
        {"name": "eth1.100", "type": "vlan", "vlan": {"base-iface": "bond0", "id": 100}},
        {"name": "bond0", "type": "bond", "link-aggregation": {"mode": "active-backup",
            "port": ["eth1"]}},
        {"name": "br1", "type": "linux-bridge", "bridge": {"port": [
            {"name": "eth1.100", "vlan": {"mode": "access", "tag": 20}}]}}]}));
    let s = lines(&plan(&node(), &d).unwrap());
    let pos = |l: &str| {
        s.iter()
            .position(|x| x == l)
            .unwrap_or_else(|| panic!("{l} in {s:?}"))
    };
    assert!(
        pos("ip link add bond0 type bond mode active-backup")
            < pos("ip link add link bond0 name eth1.100 type vlan id 100")
    );
    assert!(pos("ip link set eth1 down") < pos("ip link set eth1 master bond0"));
    assert!(
        pos("ip link set br1 type bridge vlan_filtering 1")
            < pos("bridge vlan add dev eth1.100 vid 20 pvid untagged")
    );
    assert!(s.contains(&"ip link add br1 type bridge stp_state 1".to_string()));
}

#[test]
fn parses_ip_json() {
    let links = parse_links(
        r#"[{"ifindex":1,"ifname":"lo","flags":["LOOPBACK","UP"],"mtu":65536,"link_type":"loopback","address":"00:00:00:00:00:00","addr_info":[{"family":"inet","local":"127.0.0.1","prefixlen":8}]},
            {"ifindex":3,"ifname":"br-ext","flags":["BROADCAST","UP"],"mtu":1500,"link_type":"ether","address":"02:00:00:00:00:01","linkinfo":{"info_kind":"bridge","info_data":{"stp_state":0}},"addr_info":[{"family":"inet","local":"192.0.2.1","prefixlen":24},{"family":"inet6","local":"fe80::1","prefixlen":64}]},
            {"ifindex":4,"ifname":"eth1","link":"x","master":"br-ext","flags":["UP"],"mtu":1500,"link_type":"ether","address":"02:00:00:00:00:02","linkinfo":{"info_kind":"veth","info_slave_kind":"bridge"},"addr_info":[]},
            {"ifindex":5,"ifname":"v100","link":"eth1","flags":[],"mtu":1500,"link_type":"ether","address":"02:00:00:00:00:03","linkinfo":{"info_kind":"vlan","info_data":{"protocol":"802.1Q","id":100}},"addr_info":[]}]"#,
    )
    .unwrap();
    let c = Current {
        links,
        routes: parse_routes(
            r#"[{"dst":"default","gateway":"192.0.2.254","dev":"br-ext"},{"dst":"192.0.2.0/24","dev":"br-ext","protocol":"kernel","scope":"link","prefsrc":"192.0.2.1"}]"#,
        )
        .unwrap(),
    };
    assert_eq!(c.link("br-ext").unwrap().kind, "linux-bridge");
    assert_eq!(c.link("br-ext").unwrap().stp, Some(false));
    assert_eq!(
        c.link("br-ext").unwrap().addrs,
        [("192.0.2.1".to_string(), 24)]
    );
    assert_eq!(c.link("eth1").unwrap().master.as_deref(), Some("br-ext"));
    assert_eq!(
        c.link("v100").unwrap().vlan,
        Some(("eth1".to_string(), 100))
    );
    assert!(!c.link("v100").unwrap().up);
    assert_eq!(c.routes[0].dst, "0.0.0.0/0");
    let v = c.to_nmstate();
    assert_eq!(v["interfaces"][1]["bridge"]["port"][0]["name"], "eth1");
    assert_eq!(
        v["interfaces"][1]["ipv4"]["address"][0]["prefix-length"],
        24
    );
    assert_eq!(v["interfaces"][2]["controller"], "br-ext");
    assert_eq!(v["routes"]["running"][0]["next-hop-address"], "192.0.2.254");
}

#[test]
fn leases_and_their_report() {
    use super::dhcp::{Lease, annotate, parse_lease};
    let l = parse_lease(
        "pid 42\naddr 192.168.78.20/24\nrouter 192.168.78.1\ndns 192.168.78.53 192.0.2.53\nlease 60\n",
    )
    .unwrap();
    assert_eq!(
        l,
        Lease {
            pid: 42,
            addr: "192.168.78.20/24".into(),
            router: Some("192.168.78.1".into()),
            dns: vec!["192.168.78.53".into(), "192.0.2.53".into()],
            lease_s: Some(60),
        }
    );
    let l = parse_lease("pid 42\naddr 10.0.0.2/8\nrouter \ndns \nlease \n").unwrap();
    assert_eq!((l.router, l.dns, l.lease_s), (None, vec![], None));
    assert!(parse_lease("pid 42\n").is_none());

    let mut state = node().to_nmstate();
    let wanted = [(
        "eth1".to_string(),
        DhcpOpts {
            gateway: false,
            dns: true,
        },
    )]
    .into_iter()
    .collect();
    annotate(&mut state, &wanted);
    let eth1 = &state["interfaces"][2];
    assert_eq!(eth1["name"], "eth1");
    assert_eq!(eth1["ipv4"]["dhcp"], true);
    assert_eq!(eth1["ipv4"]["auto-gateway"], false);
    assert_eq!(eth1["ipv4"]["auto-dns"], true);
    assert!(state["interfaces"][1]["ipv4"]["dhcp"].is_null());
}

#[test]
fn resolver_file() {
    use super::resolver::{parse, path, render, report};
    use ferrovirt_api::nmstate::state::DnsConfig;
    let flag = std::path::Path::new("/etc/resolv.conf");
    assert_eq!(
        path(&Some("node-a".into()), flag),
        std::path::PathBuf::from("/etc/netns/node-a/resolv.conf")
    );
    assert_eq!(path(&None, flag), flag);
    let cfg = DnsConfig {
        server: vec!["192.0.2.53".into(), "2001:db8::53".into()],
        search: vec!["example.com".into(), "lab.example.com".into()],
    };
    let text = render(&cfg);
    assert!(text.contains("nameserver 192.0.2.53\nnameserver 2001:db8::53\n"));
    assert!(text.contains("search example.com lab.example.com\n"));
    assert_eq!(parse(&text), cfg);
    assert_eq!(
        parse("# x\noptions ndots:5\ndomain a.example\nnameserver 1.1.1.1\n"),
        DnsConfig {
            server: vec!["1.1.1.1".into()],
            search: vec!["a.example".into()],
        }
    );
    let r = report(&cfg, &["192.168.78.53".into(), "192.0.2.53".into()]);
    assert_eq!(r["config"]["server"], json!(["192.0.2.53", "2001:db8::53"]));
    assert_eq!(
        r["running"]["server"],
        json!(["192.0.2.53", "2001:db8::53", "192.168.78.53"])
    );
    assert_eq!(r["running"]["search"][1], "lab.example.com");

    // A write is checkpointed: the previous content (or its absence) comes back.
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("ns").join("resolv.conf");
    let cp = super::resolver::write(&f, &cfg).unwrap();
    assert_eq!(parse(&std::fs::read_to_string(&f).unwrap()), cfg);
    cp.restore().unwrap();
    assert!(!f.exists() && !f.parent().unwrap().exists());
    std::fs::create_dir_all(f.parent().unwrap()).unwrap();
    std::fs::write(&f, "nameserver 10.0.0.1\n").unwrap();
    let cp = super::resolver::write(&f, &cfg).unwrap();
    cp.restore().unwrap();
    assert_eq!(
        std::fs::read_to_string(&f).unwrap(),
        "nameserver 10.0.0.1\n"
    );
}
