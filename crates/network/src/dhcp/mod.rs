//! A tiny DHCPv4 server for exactly one guest NIC: [`packet`] encodes and decodes messages,
//! [`respond`] is the pure decision (request → reply), and [`server`] runs it on a UDP socket
//! bound to one interface inside a network namespace.

pub mod packet;
pub mod server;

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use crate::ipam::{Ipv4Cidr, MacAddr};
use packet::{DhcpOption, FLAG_BROADCAST, MessageType, OP_REPLY, OP_REQUEST, Packet};

pub use server::{DhcpServer, ServerOptions};

/// The single lease this server hands out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseConfig {
    /// Only this client (the guest NIC's MAC) gets answers; others are ignored, so several
    /// servers on one L2 segment never answer each other's guests.
    pub client_mac: MacAddr,
    /// The address handed out.
    pub address: Ipv4Addr,
    /// The subnet the address belongs to (gives the netmask).
    pub subnet: Ipv4Cidr,
    /// Default gateway, if any.
    pub router: Option<Ipv4Addr>,
    #[serde(default)]
    pub dns: Vec<Ipv4Addr>,
    /// The server identifier: an address of the serving interface.
    pub server_id: Ipv4Addr,
    pub lease_secs: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u16>,
}

/// Where a reply goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destination {
    /// 255.255.255.255:68 (the client has no address yet).
    Broadcast,
    /// The client's current address (renewals).
    Unicast(Ipv4Addr),
}

/// The reply to send, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub packet: Packet,
    pub to: Destination,
}

fn lease_options(cfg: &LeaseConfig, with_lease: bool) -> Vec<DhcpOption> {
    let mut o = vec![
        DhcpOption::ServerId(cfg.server_id),
        DhcpOption::SubnetMask(cfg.subnet.netmask()),
    ];
    if let Some(r) = cfg.router {
        o.push(DhcpOption::Router(vec![r]));
    }
    if !cfg.dns.is_empty() {
        o.push(DhcpOption::Dns(cfg.dns.clone()));
    }
    if with_lease {
        o.push(DhcpOption::LeaseTime(cfg.lease_secs));
        o.push(DhcpOption::RenewalTime(cfg.lease_secs / 2));
        o.push(DhcpOption::RebindingTime(cfg.lease_secs / 8 * 7));
    }
    if let Some(h) = &cfg.hostname {
        o.push(DhcpOption::Hostname(h.clone()));
    }
    if let Some(m) = cfg.mtu {
        o.push(DhcpOption::Mtu(m));
    }
    o
}

fn reply(req: &Packet, kind: MessageType, yiaddr: Ipv4Addr, mut opts: Vec<DhcpOption>) -> Packet {
    opts.insert(0, DhcpOption::MessageType(kind));
    Packet {
        op: OP_REPLY,
        xid: req.xid,
        secs: 0,
        flags: req.flags,
        ciaddr: if kind == MessageType::Nak {
            Ipv4Addr::UNSPECIFIED
        } else {
            req.ciaddr
        },
        yiaddr,
        siaddr: Ipv4Addr::UNSPECIFIED,
        giaddr: req.giaddr,
        chaddr: req.chaddr,
        options: opts,
    }
}

/// Decides the answer to one request: OFFER to a DISCOVER, ACK to a REQUEST for the lease's
/// address, NAK to a REQUEST for any other address, ACK without lease to an INFORM; nothing for
/// other clients, other servers' REQUESTs, relayed messages, RELEASE and DECLINE.
pub fn respond(cfg: &LeaseConfig, req: &Packet) -> Option<Reply> {
    if req.op != OP_REQUEST || req.chaddr != cfg.client_mac || !req.giaddr.is_unspecified() {
        return None;
    }
    let broadcast_or_ciaddr = if req.ciaddr.is_unspecified() || req.flags & FLAG_BROADCAST != 0 {
        Destination::Broadcast
    } else {
        Destination::Unicast(req.ciaddr)
    };
    match req.message_type()? {
        MessageType::Discover => Some(Reply {
            packet: reply(
                req,
                MessageType::Offer,
                cfg.address,
                lease_options(cfg, true),
            ),
            to: Destination::Broadcast,
        }),
        MessageType::Request => {
            if req.server_id().is_some_and(|s| s != cfg.server_id) {
                return None; // the client chose another server
            }
            let wanted = req.requested_ip().unwrap_or(req.ciaddr);
            if wanted == cfg.address {
                Some(Reply {
                    packet: reply(req, MessageType::Ack, cfg.address, lease_options(cfg, true)),
                    to: broadcast_or_ciaddr,
                })
            } else {
                Some(Reply {
                    packet: reply(
                        req,
                        MessageType::Nak,
                        Ipv4Addr::UNSPECIFIED,
                        vec![DhcpOption::ServerId(cfg.server_id)],
                    ),
                    to: Destination::Broadcast,
                })
            }
        }
        MessageType::Inform => Some(Reply {
            packet: reply(
                req,
                MessageType::Ack,
                Ipv4Addr::UNSPECIFIED,
                lease_options(cfg, false),
            ),
            to: broadcast_or_ciaddr,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: MacAddr = MacAddr([0x02, 0, 0, 0, 0, 1]);

    fn cfg() -> LeaseConfig {
        LeaseConfig {
            client_mac: MAC,
            address: Ipv4Addr::new(10, 0, 2, 2),
            subnet: "10.0.2.0/24".parse().unwrap(),
            router: Some(Ipv4Addr::new(10, 0, 2, 1)),
            dns: vec![Ipv4Addr::new(10, 96, 0, 10)],
            server_id: Ipv4Addr::new(10, 0, 2, 1),
            lease_secs: 86400,
            hostname: Some("vm1".into()),
            mtu: Some(1500),
        }
    }

    fn request(kind: MessageType, extra: Vec<DhcpOption>) -> Packet {
        let mut options = vec![DhcpOption::MessageType(kind)];
        options.extend(extra);
        Packet {
            op: OP_REQUEST,
            xid: 42,
            secs: 3,
            flags: 0,
            ciaddr: Ipv4Addr::UNSPECIFIED,
            yiaddr: Ipv4Addr::UNSPECIFIED,
            siaddr: Ipv4Addr::UNSPECIFIED,
            giaddr: Ipv4Addr::UNSPECIFIED,
            chaddr: MAC,
            options,
        }
    }

    #[test]
    fn offers_the_lease_to_a_discover() {
        let r = respond(&cfg(), &request(MessageType::Discover, vec![])).unwrap();
        assert_eq!(r.to, Destination::Broadcast);
        let p = r.packet;
        assert_eq!(p.op, OP_REPLY);
        assert_eq!(p.xid, 42);
        assert_eq!(p.yiaddr, Ipv4Addr::new(10, 0, 2, 2));
        assert_eq!(p.message_type(), Some(MessageType::Offer));
        for o in [
            DhcpOption::ServerId(Ipv4Addr::new(10, 0, 2, 1)),
            DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)),
            DhcpOption::Router(vec![Ipv4Addr::new(10, 0, 2, 1)]),
            DhcpOption::Dns(vec![Ipv4Addr::new(10, 96, 0, 10)]),
            DhcpOption::LeaseTime(86400),
            DhcpOption::Hostname("vm1".into()),
            DhcpOption::Mtu(1500),
        ] {
            assert!(p.options.contains(&o), "missing {o:?}");
        }
        // It survives the wire.
        assert_eq!(Packet::decode(&p.encode()).unwrap(), p);
    }

    #[test]
    fn acks_a_request_for_the_lease_and_naks_others() {
        let c = cfg();
        let ok = request(
            MessageType::Request,
            vec![
                DhcpOption::RequestedIp(c.address),
                DhcpOption::ServerId(c.server_id),
            ],
        );
        let r = respond(&c, &ok).unwrap();
        assert_eq!(r.packet.message_type(), Some(MessageType::Ack));
        assert_eq!(r.packet.yiaddr, c.address);
        assert_eq!(r.to, Destination::Broadcast);

        let wrong = request(
            MessageType::Request,
            vec![DhcpOption::RequestedIp(Ipv4Addr::new(192, 168, 1, 9))],
        );
        let r = respond(&c, &wrong).unwrap();
        assert_eq!(r.packet.message_type(), Some(MessageType::Nak));
        assert_eq!(r.packet.yiaddr, Ipv4Addr::UNSPECIFIED);
        assert_eq!(r.to, Destination::Broadcast);
    }

    #[test]
    fn renewals_are_answered_by_unicast() {
        let c = cfg();
        let mut renew = request(MessageType::Request, vec![]);
        renew.ciaddr = c.address;
        let r = respond(&c, &renew).unwrap();
        assert_eq!(r.packet.message_type(), Some(MessageType::Ack));
        assert_eq!(r.to, Destination::Unicast(c.address));
        assert_eq!(r.packet.ciaddr, c.address);
    }

    #[test]
    fn informs_get_configuration_without_a_lease() {
        let c = cfg();
        let mut inform = request(MessageType::Inform, vec![]);
        inform.ciaddr = c.address;
        let r = respond(&c, &inform).unwrap();
        assert_eq!(r.packet.message_type(), Some(MessageType::Ack));
        assert_eq!(r.packet.yiaddr, Ipv4Addr::UNSPECIFIED);
        assert!(
            !r.packet
                .options
                .iter()
                .any(|o| matches!(o, DhcpOption::LeaseTime(_)))
        );
    }

    #[test]
    fn ignores_other_clients_servers_and_message_kinds() {
        let c = cfg();
        let mut other = request(MessageType::Discover, vec![]);
        other.chaddr = MacAddr([0x02, 9, 9, 9, 9, 9]);
        assert!(respond(&c, &other).is_none());
        let elsewhere = request(
            MessageType::Request,
            vec![DhcpOption::ServerId(Ipv4Addr::new(10, 0, 2, 99))],
        );
        assert!(respond(&c, &elsewhere).is_none());
        assert!(respond(&c, &request(MessageType::Release, vec![])).is_none());
        assert!(respond(&c, &request(MessageType::Decline, vec![])).is_none());
        let mut reply = request(MessageType::Discover, vec![]);
        reply.op = OP_REPLY;
        assert!(respond(&c, &reply).is_none());
        let mut relayed = request(MessageType::Discover, vec![]);
        relayed.giaddr = Ipv4Addr::new(10, 1, 1, 1);
        assert!(respond(&c, &relayed).is_none());
        let mut no_type = request(MessageType::Discover, vec![]);
        no_type.options.clear();
        assert!(respond(&c, &no_type).is_none());
    }
}
