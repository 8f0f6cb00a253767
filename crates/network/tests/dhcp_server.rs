//! The DHCP server on real sockets: a server bound to one end of a veth pair in one namespace,
//! a client sending dhcproto-built messages on the other end in another namespace. Runs as
//! root.

mod common;

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::time::Duration;

use common::{TempNetns, ip};
use ferrovirt_network::MacAddr;
use ferrovirt_network::dhcp::dhcproto::v4::{DhcpOption, Message, MessageType, OptionCode};
use ferrovirt_network::dhcp::{DhcpServer, LeaseConfig, ServerOptions, decode, encode};
use socket2::{Domain, Protocol, Socket, Type};

const GUEST: MacAddr = MacAddr([0x02, 0xaa, 0, 0, 0, 1]);
// Unprivileged-range ports keep this test clear of any real DHCP traffic.
const SERVER_PORT: u16 = 6767;

fn request(kind: MessageType, mac: MacAddr, extra: Vec<DhcpOption>) -> Message {
    let any = Ipv4Addr::UNSPECIFIED;
    let mut m = Message::new_with_id(0x1234_5678, any, any, any, any, &mac.0);
    m.opts_mut().insert(DhcpOption::MessageType(kind));
    for o in extra {
        m.opts_mut().insert(o);
    }
    m
}

fn client_socket(ns: &str) -> anyhow::Result<UdpSocket> {
    let sock = ferrovirt_network::netns::run_in(Some(ns), || -> std::io::Result<UdpSocket> {
        let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
        s.set_broadcast(true)?;
        s.bind_device(Some(b"c0"))?;
        s.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, SERVER_PORT + 1)).into())?;
        Ok(s.into())
    })??;
    sock.set_read_timeout(Some(Duration::from_millis(1500)))?;
    Ok(sock)
}

fn exchange(sock: &UdpSocket, p: &Message) -> anyhow::Result<Option<Message>> {
    sock.send_to(&encode(p)?, (Ipv4Addr::BROADCAST, SERVER_PORT))?;
    let mut buf = [0u8; 1500];
    match sock.recv_from(&mut buf) {
        Ok((n, _)) => Ok(Some(decode(&buf[..n])?)),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dhcp_server_answers_its_client_over_a_veth() -> anyhow::Result<()> {
    ferrovirt_network::apply::preflight().await?;
    let server_ns = TempNetns::new("dhcps")?;
    let client_ns = TempNetns::new("dhcpc")?;
    let (s, c) = (server_ns.0.as_str(), client_ns.0.as_str());
    ip(&[
        "-n", s, "link", "add", "s0", "type", "veth", "peer", "name", "c0", "netns", c,
    ])?;
    ip(&["-n", s, "addr", "add", "10.0.2.1/24", "dev", "s0"])?;
    ip(&["-n", c, "addr", "add", "10.0.2.50/24", "dev", "c0"])?;
    ip(&["-n", s, "link", "set", "s0", "up"])?;
    ip(&["-n", c, "link", "set", "c0", "up"])?;

    let lease = LeaseConfig {
        client_mac: GUEST,
        address: Ipv4Addr::new(10, 0, 2, 2),
        subnet: "10.0.2.0/24".parse()?,
        router: Some(Ipv4Addr::new(10, 0, 2, 1)),
        dns: vec![Ipv4Addr::new(10, 0, 2, 3)],
        search: vec!["default.svc.cluster.local".into()],
        server_id: Ipv4Addr::new(10, 0, 2, 1),
        lease_secs: 3600,
        hostname: Some("vm1".into()),
        mtu: Some(1400),
        routes: Vec::new(),
    };
    let mut opts = ServerOptions::new(Some(s.to_string()), "s0", lease);
    opts.server_port = SERVER_PORT;
    let server = DhcpServer::spawn(opts).await?;
    assert!(server.is_running());
    let sock = client_socket(c)?;

    let offer = exchange(&sock, &request(MessageType::Discover, GUEST, vec![]))?.expect("an OFFER");
    assert_eq!(offer.opts().msg_type(), Some(MessageType::Offer));
    assert_eq!(offer.xid(), 0x1234_5678);
    assert_eq!(offer.yiaddr(), Ipv4Addr::new(10, 0, 2, 2));
    let gw = Ipv4Addr::new(10, 0, 2, 1);
    for o in [
        DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)),
        DhcpOption::Router(vec![gw]),
        DhcpOption::ClasslessStaticRoute(vec![("0.0.0.0/0".parse()?, gw)]),
        DhcpOption::DomainNameServer(vec![Ipv4Addr::new(10, 0, 2, 3)]),
        DhcpOption::DomainName("default.svc.cluster.local".into()),
        DhcpOption::AddressLeaseTime(3600),
        DhcpOption::Hostname("vm1".into()),
        DhcpOption::InterfaceMtu(1400),
        DhcpOption::ServerIdentifier(gw),
    ] {
        let code = OptionCode::from(&o);
        assert_eq!(offer.opts().get(code), Some(&o), "OFFER: {offer:?}");
    }
    assert!(offer.opts().get(OptionCode::DomainSearch).is_some());

    let ack = exchange(
        &sock,
        &request(
            MessageType::Request,
            GUEST,
            vec![
                DhcpOption::RequestedIpAddress(Ipv4Addr::new(10, 0, 2, 2)),
                DhcpOption::ServerIdentifier(Ipv4Addr::new(10, 0, 2, 1)),
            ],
        ),
    )?
    .expect("an ACK");
    assert_eq!(ack.opts().msg_type(), Some(MessageType::Ack));

    let nak = exchange(
        &sock,
        &request(
            MessageType::Request,
            GUEST,
            vec![DhcpOption::RequestedIpAddress(Ipv4Addr::new(10, 0, 2, 77))],
        ),
    )?
    .expect("a NAK");
    assert_eq!(nak.opts().msg_type(), Some(MessageType::Nak));

    // Another guest's DISCOVER gets no answer.
    let other = MacAddr([0x02, 0xbb, 0, 0, 0, 2]);
    assert!(exchange(&sock, &request(MessageType::Discover, other, vec![]))?.is_none());

    // Dropping the handle stops the server.
    drop(server);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(exchange(&sock, &request(MessageType::Discover, GUEST, vec![]))?.is_none());
    Ok(())
}
