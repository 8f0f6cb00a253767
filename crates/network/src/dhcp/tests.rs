//! Unit tests of the DHCP decision: requests built with dhcproto go through the wire encoding,
//! [`respond`], and back; every option of the OFFER/ACK is checked, 119 and 121 byte for byte
//! against the examples of RFC 3397 and RFC 3442.

use super::*;
use dhcproto::v4::Flags;

const MAC: MacAddr = MacAddr([0x02, 0, 0, 0, 0, 1]);

fn cfg() -> LeaseConfig {
    LeaseConfig {
        client_mac: MAC,
        address: Ipv4Addr::new(10, 0, 2, 2),
        subnet: "10.0.2.0/24".parse().unwrap(),
        router: Some(Ipv4Addr::new(10, 0, 2, 1)),
        dns: vec![Ipv4Addr::new(10, 96, 0, 10), Ipv4Addr::new(10, 96, 0, 11)],
        search: vec!["eng.apple.com".into(), "marketing.apple.com".into()],
        server_id: Ipv4Addr::new(10, 0, 2, 1),
        lease_secs: 86400,
        hostname: Some("vm1".into()),
        mtu: Some(1450),
        routes: Vec::new(),
    }
}

/// A client message built with dhcproto, sent through the wire encoding.
fn request(kind: MessageType, extra: Vec<DhcpOption>) -> Message {
    let mut m = Message::new_with_id(
        42,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        &MAC.0,
    );
    m.set_secs(3);
    m.opts_mut().insert(DhcpOption::MessageType(kind));
    for o in extra {
        m.opts_mut().insert(o);
    }
    m
}

/// Runs a request through encode → decode → respond → encode → decode.
fn over_the_wire(c: &LeaseConfig, req: &Message) -> Option<(Message, Destination, Vec<u8>)> {
    let req = decode(&encode(req).unwrap()).unwrap();
    let r = respond(c, &req)?;
    let bytes = encode(&r.message).unwrap();
    Some((decode(&bytes).unwrap(), r.to, bytes))
}

/// The raw value of option `code` in an encoded message (instances joined, RFC 3396).
fn raw_option(bytes: &[u8], code: u8) -> Option<Vec<u8>> {
    let mut i = 240;
    let mut found: Option<Vec<u8>> = None;
    while i < bytes.len() && bytes[i] != 255 {
        if bytes[i] == 0 {
            i += 1;
            continue;
        }
        let len = bytes[i + 1] as usize;
        if bytes[i] == code {
            found
                .get_or_insert_with(Vec::new)
                .extend_from_slice(&bytes[i + 2..i + 2 + len]);
        }
        i += 2 + len;
    }
    found
}

fn opt(m: &Message, code: OptionCode) -> &DhcpOption {
    m.opts()
        .get(code)
        .unwrap_or_else(|| panic!("{code:?} missing from {m:?}"))
}

/// Checks every option a lease carries; `with_lease` for OFFER/ACK, not INFORM.
fn assert_lease_options(m: &Message, bytes: &[u8], with_lease: bool) {
    let gw = Ipv4Addr::new(10, 0, 2, 1);
    assert_eq!(
        opt(m, OptionCode::SubnetMask),
        &DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0))
    );
    assert_eq!(opt(m, OptionCode::Router), &DhcpOption::Router(vec![gw]));
    assert_eq!(
        opt(m, OptionCode::DomainNameServer),
        &DhcpOption::DomainNameServer(vec![
            Ipv4Addr::new(10, 96, 0, 10),
            Ipv4Addr::new(10, 96, 0, 11)
        ])
    );
    assert_eq!(
        opt(m, OptionCode::Hostname),
        &DhcpOption::Hostname("vm1".into())
    );
    assert_eq!(
        opt(m, OptionCode::DomainName),
        &DhcpOption::DomainName("eng.apple.com".into())
    );
    assert_eq!(
        opt(m, OptionCode::InterfaceMtu),
        &DhcpOption::InterfaceMtu(1450)
    );
    assert_eq!(
        opt(m, OptionCode::ServerIdentifier),
        &DhcpOption::ServerIdentifier(gw)
    );
    // RFC 3442: the default route is prefix length 0, no destination octets, then the router.
    assert_eq!(raw_option(bytes, 121).unwrap(), [0, 10, 0, 2, 1]);
    assert_eq!(
        opt(m, OptionCode::ClasslessStaticRoute),
        &DhcpOption::ClasslessStaticRoute(vec![("0.0.0.0/0".parse().unwrap(), gw)])
    );
    // RFC 3397 section 3's example: "eng.apple.com" then "marketing.apple.com" with
    // "apple.com" compressed to a pointer at offset 4 of the option data.
    let mut rfc3397 = vec![3];
    rfc3397.extend(b"eng");
    rfc3397.push(5);
    rfc3397.extend(b"apple");
    rfc3397.push(3);
    rfc3397.extend(b"com");
    rfc3397.extend([0, 9]);
    rfc3397.extend(b"marketing");
    rfc3397.extend([0xc0, 0x04]);
    assert_eq!(raw_option(bytes, 119).unwrap(), rfc3397);
    match opt(m, OptionCode::DomainSearch) {
        DhcpOption::DomainSearch(names) => assert_eq!(
            names.iter().map(|n| n.to_ascii()).collect::<Vec<_>>(),
            ["eng.apple.com.", "marketing.apple.com."]
        ),
        other => panic!("{other:?}"),
    }
    let lease_opts = [
        (
            OptionCode::AddressLeaseTime,
            DhcpOption::AddressLeaseTime(86400),
        ),
        (OptionCode::Renewal, DhcpOption::Renewal(43200)),
        (OptionCode::Rebinding, DhcpOption::Rebinding(75600)),
    ];
    for (code, want) in lease_opts {
        if with_lease {
            assert_eq!(opt(m, code), &want);
        } else {
            assert!(m.opts().get(code).is_none(), "{code:?} in {m:?}");
        }
    }
    assert!(bytes.len() >= MIN_PACKET_SIZE);
}

#[test]
fn offers_the_lease_with_every_option_to_a_discover() {
    let (p, to, bytes) = over_the_wire(&cfg(), &request(MessageType::Discover, vec![])).unwrap();
    assert_eq!(to, Destination::Broadcast);
    assert_eq!(p.opcode(), Opcode::BootReply);
    assert_eq!(p.xid(), 42);
    assert_eq!(p.chaddr(), MAC.0);
    assert_eq!(p.yiaddr(), Ipv4Addr::new(10, 0, 2, 2));
    assert_eq!(p.opts().msg_type(), Some(MessageType::Offer));
    assert_lease_options(&p, &bytes, true);
}

#[test]
fn acks_a_request_for_the_lease_and_naks_others() {
    let c = cfg();
    let ok = request(
        MessageType::Request,
        vec![
            DhcpOption::RequestedIpAddress(c.address),
            DhcpOption::ServerIdentifier(c.server_id),
        ],
    );
    let (p, to, bytes) = over_the_wire(&c, &ok).unwrap();
    assert_eq!(p.opts().msg_type(), Some(MessageType::Ack));
    assert_eq!(p.yiaddr(), c.address);
    assert_eq!(to, Destination::Broadcast);
    assert_lease_options(&p, &bytes, true);

    let wrong = request(
        MessageType::Request,
        vec![DhcpOption::RequestedIpAddress(Ipv4Addr::new(
            192, 168, 1, 9,
        ))],
    );
    let (p, to, _) = over_the_wire(&c, &wrong).unwrap();
    assert_eq!(p.opts().msg_type(), Some(MessageType::Nak));
    assert_eq!(p.yiaddr(), Ipv4Addr::UNSPECIFIED);
    assert_eq!(to, Destination::Broadcast);
    assert_eq!(p.opts().len(), 2, "a NAK carries only type and server id");
    assert_eq!(server_id(&p), Some(c.server_id));
}

#[test]
fn renewals_are_answered_by_unicast_and_broadcast_flag_is_kept() {
    let c = cfg();
    let mut renew = request(MessageType::Request, vec![]);
    renew.set_ciaddr(c.address);
    let (p, to, _) = over_the_wire(&c, &renew).unwrap();
    assert_eq!(p.opts().msg_type(), Some(MessageType::Ack));
    assert_eq!(to, Destination::Unicast(c.address));
    assert_eq!(p.ciaddr(), c.address);

    renew.set_flags(Flags::default().set_broadcast());
    let (p, to, _) = over_the_wire(&c, &renew).unwrap();
    assert_eq!(to, Destination::Broadcast);
    assert!(p.flags().broadcast());
}

#[test]
fn informs_get_configuration_without_a_lease() {
    let c = cfg();
    let mut inform = request(MessageType::Inform, vec![]);
    inform.set_ciaddr(c.address);
    let (p, _, bytes) = over_the_wire(&c, &inform).unwrap();
    assert_eq!(p.opts().msg_type(), Some(MessageType::Ack));
    assert_eq!(p.yiaddr(), Ipv4Addr::UNSPECIFIED);
    assert_lease_options(&p, &bytes, false);
}

#[test]
fn optional_options_are_left_out_when_not_configured() {
    let mut c = cfg();
    c.router = None;
    c.dns.clear();
    c.search.clear();
    c.hostname = None;
    c.mtu = None;
    let (p, _, _) = over_the_wire(&c, &request(MessageType::Discover, vec![])).unwrap();
    for code in [
        OptionCode::Router,
        OptionCode::ClasslessStaticRoute,
        OptionCode::DomainNameServer,
        OptionCode::DomainName,
        OptionCode::DomainSearch,
        OptionCode::Hostname,
        OptionCode::InterfaceMtu,
    ] {
        assert!(p.opts().get(code).is_none(), "{code:?} in {p:?}");
    }
}

#[test]
fn classless_routes_follow_rfc_3442() {
    // A router outside the subnet gets an on-link host route first.
    let mut c = cfg();
    c.router = Some(Ipv4Addr::new(169, 254, 1, 1));
    let (_, _, bytes) = over_the_wire(&c, &request(MessageType::Discover, vec![])).unwrap();
    assert_eq!(
        raw_option(&bytes, 121).unwrap(),
        [32, 169, 254, 1, 1, 0, 0, 0, 0, 0, 169, 254, 1, 1]
    );
    // RFC 3442's destination encodings, through dhcproto: 10.17.0.0/16 → 16.10.17,
    // 10.27.129.0/24 → 24.10.27.129, 10.229.0.128/25 → 25.10.229.0.128.
    let gw = Ipv4Addr::new(10, 0, 0, 1);
    let mut m = request(MessageType::Discover, vec![]);
    m.opts_mut().insert(DhcpOption::ClasslessStaticRoute(vec![
        ("10.17.0.0/16".parse().unwrap(), gw),
        ("10.27.129.0/24".parse().unwrap(), gw),
        ("10.229.0.128/25".parse().unwrap(), gw),
    ]));
    assert_eq!(
        raw_option(&encode(&m).unwrap(), 121).unwrap(),
        [
            16, 10, 17, 10, 0, 0, 1, 24, 10, 27, 129, 10, 0, 0, 1, 25, 10, 229, 0, 128, 10, 0, 0, 1
        ]
    );
}

#[test]
fn search_domains_are_checked() {
    assert_eq!(
        search_domain("cluster.local.").unwrap().to_ascii(),
        "cluster.local."
    );
    for bad in [
        "",
        ".",
        "a..b",
        "-a.com",
        "a-.com",
        "a b",
        "ünï.com",
        "a_b.com",
    ] {
        assert!(search_domain(bad).is_err(), "{bad:?} accepted");
    }
    assert!(search_domain(&"a".repeat(64)).is_err());
}

#[test]
fn ignores_other_clients_servers_and_message_kinds() {
    let c = cfg();
    let mut other = request(MessageType::Discover, vec![]);
    other.set_chaddr(&[0x02, 9, 9, 9, 9, 9]);
    assert!(respond(&c, &other).is_none());
    let elsewhere = request(
        MessageType::Request,
        vec![DhcpOption::ServerIdentifier(Ipv4Addr::new(10, 0, 2, 99))],
    );
    assert!(respond(&c, &elsewhere).is_none());
    assert!(respond(&c, &request(MessageType::Release, vec![])).is_none());
    assert!(respond(&c, &request(MessageType::Decline, vec![])).is_none());
    let mut reply = request(MessageType::Discover, vec![]);
    reply.set_opcode(Opcode::BootReply);
    assert!(respond(&c, &reply).is_none());
    let mut relayed = request(MessageType::Discover, vec![]);
    relayed.set_giaddr(Ipv4Addr::new(10, 1, 1, 1));
    assert!(respond(&c, &relayed).is_none());
    let mut no_type = request(MessageType::Discover, vec![]);
    no_type.opts_mut().clear();
    assert!(respond(&c, &no_type).is_none());
}

/// A DISCOVER laid out byte by byte the way busybox udhcpc sends one.
fn udhcpc_discover() -> Vec<u8> {
    let mut b = vec![0u8; 236];
    b[0] = 1; // BOOTREQUEST
    b[1] = 1;
    b[2] = 6;
    b[4..8].copy_from_slice(&0xdead_beefu32.to_be_bytes());
    b[28..34].copy_from_slice(&MAC.0);
    b.extend_from_slice(&MAGIC);
    b.extend_from_slice(&[53, 1, 1]); // DISCOVER
    b.extend_from_slice(&[61, 7, 1, 0x02, 0, 0, 0, 0, 1]); // client id
    b.extend_from_slice(&[57, 2, 0x02, 0x40]); // max message size 576
    b.extend_from_slice(&[55, 9, 1, 3, 6, 12, 15, 26, 28, 119, 121]); // parameter request list
    b.extend_from_slice(&[60, 12]);
    b.extend_from_slice(b"udhcp 1.35.0");
    b.push(255);
    b.resize(300, 0);
    b
}

#[test]
fn answers_a_udhcpc_discover_within_its_max_message_size() {
    let req = decode(&udhcpc_discover()).unwrap();
    assert_eq!(req.xid(), 0xdead_beef);
    assert_eq!(req.opts().msg_type(), Some(MessageType::Discover));
    let r = respond(&cfg(), &req).unwrap();
    let bytes = encode(&r.message).unwrap();
    assert!(bytes.len() <= 576, "{} bytes", bytes.len());
    assert_eq!(decode(&bytes).unwrap().xid(), 0xdead_beef);
}

#[test]
fn rejects_malformed_packets() {
    assert!(decode(&[0u8; 100]).is_err());
    let mut b = udhcpc_discover();
    b[236] = 0;
    assert!(decode(&b).unwrap_err().to_string().contains("cookie"));
    // dhcproto stops reading options at the first one that does not decode (here a router
    // option running past the end): without its message type the server ignores the packet.
    let mut b = udhcpc_discover();
    b.truncate(240);
    b.extend_from_slice(&[3, 9, 1, 2]);
    let m = decode(&b).unwrap();
    assert!(m.opts().is_empty());
    assert!(respond(&cfg(), &m).is_none());
    let mut b = udhcpc_discover();
    b[1] = 6; // token ring
    assert!(decode(&b).is_err());
}

/// The guest controls every byte the server decodes: truncations, single-byte corruptions
/// and a self-referencing search-list pointer must give an error or a message, never a panic
/// (a panic would end the VMI's DHCP server task).
#[test]
fn hostile_bytes_never_panic() {
    let mut req = request(
        MessageType::Request,
        vec![
            DhcpOption::RequestedIpAddress(Ipv4Addr::new(10, 0, 2, 2)),
            DhcpOption::Hostname("guest".into()),
        ],
    );
    for o in lease_options(&cfg(), true) {
        req.opts_mut().insert(o);
    }
    let good = encode(&req).unwrap();
    let c = cfg();
    let mut tried = 0;
    for len in 0..good.len() {
        if let Ok(m) = decode(&good[..len]) {
            let _ = respond(&c, &m);
        }
        tried += 1;
    }
    for at in 240..good.len().min(400) {
        for v in [0u8, 1, 4, 31, 32, 33, 63, 64, 0xc0, 0xff] {
            let mut b = good.clone();
            b[at] = v;
            if let Ok(m) = decode(&b) {
                let _ = respond(&c, &m);
            }
            tried += 1;
        }
    }
    let mut b = good[..240].to_vec();
    b.extend_from_slice(&[53, 1, 3, 119, 2, 0xc0, 0x00, 121, 5, 33, 1, 2, 3, 4, 255]);
    if let Ok(m) = decode(&b) {
        let _ = respond(&c, &m);
    }
    assert!(tried > 1000);
}

#[test]
fn static_routes_go_out_as_option_121_with_or_without_a_router() {
    // A Secondary Layer3 interface: no router, the network's subnet via the node's gateway.
    let mut c = cfg();
    c.router = None;
    c.routes = vec![StaticRoute {
        destination: "10.210.0.0/16".parse().unwrap(),
        gateway: Ipv4Addr::new(10, 0, 2, 1),
    }];
    let (m, _, bytes) = over_the_wire(&c, &request(MessageType::Discover, vec![])).unwrap();
    assert_eq!(raw_option(&bytes, 121).unwrap(), [16, 10, 210, 10, 0, 2, 1]);
    assert!(m.opts().get(OptionCode::Router).is_none());
    // With a router: the lease's routes first, then the default route.
    c.router = Some(Ipv4Addr::new(10, 0, 2, 1));
    let (_, _, bytes) = over_the_wire(&c, &request(MessageType::Discover, vec![])).unwrap();
    assert_eq!(
        raw_option(&bytes, 121).unwrap(),
        [16, 10, 210, 10, 0, 2, 1, 0, 10, 0, 2, 1]
    );
    // Kept in the plan's JSON only when there are some.
    let text = serde_json::to_string(&cfg()).unwrap();
    assert!(!text.contains("routes"), "{text}");
    let back: LeaseConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
    assert_eq!(back, c);
}
