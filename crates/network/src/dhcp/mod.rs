//! A tiny DHCPv4 server for exactly one guest NIC. Packets are `dhcproto` [`Message`]s:
//! [`decode`] and [`encode`] move them on and off the wire, [`respond`] is the pure decision
//! (request → reply, with the options KubeVirt's server sends), and [`server`] runs it on a UDP
//! socket bound to one interface inside a network namespace.

pub mod server;
#[cfg(test)]
mod tests;

use std::net::Ipv4Addr;

pub use dhcproto;
use dhcproto::v4::OptionCode;
use dhcproto::v4::{DhcpOption, HType, MAGIC, MIN_PACKET_SIZE, Message, MessageType, Opcode};
use dhcproto::{Decodable, Decoder, Encodable, Name};
use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ipam::{Ipv4Cidr, MacAddr};

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
    /// Default gateway, if any: sent as router (3) and as the default classless route (121).
    pub router: Option<Ipv4Addr>,
    #[serde(default)]
    pub dns: Vec<Ipv4Addr>,
    /// DNS search domains (option 119); the first is also the domain name (option 15).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub search: Vec<String>,
    /// The server identifier: an address of the serving interface.
    pub server_id: Ipv4Addr,
    pub lease_secs: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u16>,
    /// Classless static routes (option 121) besides the default route via `router`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<StaticRoute>,
}

/// A classless static route (RFC 3442) of a lease: `destination` via `gateway`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StaticRoute {
    pub destination: Ipv4Cidr,
    pub gateway: Ipv4Addr,
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
    pub message: Message,
    pub to: Destination,
}

/// Decodes a DHCP message from the wire: a BOOTP header with the DHCP cookie, Ethernet
/// hardware addresses; dhcproto joins split options (RFC 3396).
pub fn decode(buf: &[u8]) -> Result<Message> {
    if buf.len() < 240 {
        return Err(Error::Malformed("shorter than a BOOTP header"));
    }
    if buf[236..240] != MAGIC {
        return Err(Error::Malformed("no DHCP magic cookie"));
    }
    let m = Message::decode(&mut Decoder::new(buf)).map_err(Error::Decode)?;
    if m.htype() != HType::Eth || m.hlen() != 6 {
        return Err(Error::Malformed("hardware type is not Ethernet"));
    }
    Ok(m)
}

/// Encodes a message, padded to BOOTP's 300-byte minimum (some clients insist).
pub fn encode(m: &Message) -> Result<Vec<u8>> {
    let mut out = m.to_vec().map_err(Error::Encode)?;
    if out.len() < MIN_PACKET_SIZE {
        out.resize(MIN_PACKET_SIZE, 0);
    }
    Ok(out)
}

/// Checks one DNS search domain (RFC 1123 host name syntax: labels of 1-63 letters, digits and
/// inner hyphens, 253 characters at most; one trailing dot allowed) and returns it as an
/// absolute DNS name for option 119.
pub fn search_domain(domain: &str) -> Result<Name> {
    let bare = domain.strip_suffix('.').unwrap_or(domain);
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if bare.is_empty() || bare.len() > 253 || !bare.split('.').all(label_ok) {
        return Err(Error::InvalidPlan(format!(
            "invalid DNS search domain {domain:?} (dot-separated labels of letters, digits and \
             inner hyphens, at most 63 characters each and 253 in all)"
        )));
    }
    Name::from_ascii(format!("{bare}."))
        .map_err(|e| Error::InvalidPlan(format!("invalid DNS search domain {domain:?}: {e}")))
}

/// Classless static routes (RFC 3442) for the lease: the lease's own `routes`, then the default
/// route via the router, preceded by an on-link host route to the router when it lies outside
/// the subnet (clients that get option 121 ignore option 3).
pub fn classless_routes(cfg: &LeaseConfig) -> Vec<(Ipv4Net, Ipv4Addr)> {
    let mut routes: Vec<(Ipv4Net, Ipv4Addr)> = cfg
        .routes
        .iter()
        .map(|r| {
            let d = r.destination;
            (host_net(d.network(), d.prefix()), r.gateway)
        })
        .collect();
    let Some(gw) = cfg.router else {
        return routes;
    };
    if !cfg.subnet.contains(gw) {
        routes.push((host_net(gw, 32), Ipv4Addr::UNSPECIFIED));
    }
    routes.push((host_net(Ipv4Addr::UNSPECIFIED, 0), gw));
    routes
}

fn host_net(addr: Ipv4Addr, prefix: u8) -> Ipv4Net {
    // Prefixes 0 to 32 are valid (an Ipv4Cidr's are).
    Ipv4Net::new(addr, prefix).unwrap_or_default()
}

fn lease_options(cfg: &LeaseConfig, with_lease: bool) -> Vec<DhcpOption> {
    let mut o = vec![
        DhcpOption::ServerIdentifier(cfg.server_id),
        DhcpOption::SubnetMask(cfg.subnet.netmask()),
    ];
    if let Some(r) = cfg.router {
        o.push(DhcpOption::Router(vec![r]));
    }
    let routes = classless_routes(cfg);
    if !routes.is_empty() {
        o.push(DhcpOption::ClasslessStaticRoute(routes));
    }
    if !cfg.dns.is_empty() {
        o.push(DhcpOption::DomainNameServer(cfg.dns.clone()));
    }
    // Plans validate search domains; one that slipped through is left out, not sent broken.
    let search: Vec<Name> = cfg
        .search
        .iter()
        .filter_map(|d| search_domain(d).ok())
        .collect();
    if let Some(first) = cfg.search.first().filter(|_| !search.is_empty()) {
        o.push(DhcpOption::DomainName(
            first.strip_suffix('.').unwrap_or(first).to_string(),
        ));
        o.push(DhcpOption::DomainSearch(search));
    }
    if with_lease {
        o.push(DhcpOption::AddressLeaseTime(cfg.lease_secs));
        o.push(DhcpOption::Renewal(cfg.lease_secs / 2));
        o.push(DhcpOption::Rebinding(cfg.lease_secs / 8 * 7));
    }
    if let Some(h) = &cfg.hostname {
        o.push(DhcpOption::Hostname(h.clone()));
    }
    if let Some(m) = cfg.mtu {
        o.push(DhcpOption::InterfaceMtu(m));
    }
    o
}

fn reply(req: &Message, kind: MessageType, yiaddr: Ipv4Addr, opts: Vec<DhcpOption>) -> Message {
    let ciaddr = if kind == MessageType::Nak {
        Ipv4Addr::UNSPECIFIED
    } else {
        req.ciaddr()
    };
    let mut m = Message::new_with_id(
        req.xid(),
        ciaddr,
        yiaddr,
        Ipv4Addr::UNSPECIFIED,
        req.giaddr(),
        req.chaddr(),
    );
    m.set_opcode(Opcode::BootReply).set_flags(req.flags());
    m.opts_mut().insert(DhcpOption::MessageType(kind));
    for o in opts {
        m.opts_mut().insert(o);
    }
    m
}

/// The server identifier (option 54) of a message, if present.
pub fn server_id(m: &Message) -> Option<Ipv4Addr> {
    match m.opts().get(OptionCode::ServerIdentifier)? {
        DhcpOption::ServerIdentifier(a) => Some(*a),
        _ => None,
    }
}

/// The requested address (option 50) of a message, if present.
pub fn requested_ip(m: &Message) -> Option<Ipv4Addr> {
    match m.opts().get(OptionCode::RequestedIpAddress)? {
        DhcpOption::RequestedIpAddress(a) => Some(*a),
        _ => None,
    }
}

/// Decides the answer to one request: OFFER to a DISCOVER, ACK to a REQUEST for the lease's
/// address, NAK to a REQUEST for any other address, ACK without lease to an INFORM; nothing for
/// other clients, other servers' REQUESTs, relayed messages, RELEASE and DECLINE.
pub fn respond(cfg: &LeaseConfig, req: &Message) -> Option<Reply> {
    if req.opcode() != Opcode::BootRequest
        || req.chaddr() != cfg.client_mac.0
        || !req.giaddr().is_unspecified()
    {
        return None;
    }
    let broadcast_or_ciaddr = if req.ciaddr().is_unspecified() || req.flags().broadcast() {
        Destination::Broadcast
    } else {
        Destination::Unicast(req.ciaddr())
    };
    match req.opts().msg_type()? {
        MessageType::Discover => Some(Reply {
            message: reply(
                req,
                MessageType::Offer,
                cfg.address,
                lease_options(cfg, true),
            ),
            to: Destination::Broadcast,
        }),
        MessageType::Request => {
            if server_id(req).is_some_and(|s| s != cfg.server_id) {
                return None; // the client chose another server
            }
            let wanted = requested_ip(req).unwrap_or(req.ciaddr());
            if wanted == cfg.address {
                Some(Reply {
                    message: reply(req, MessageType::Ack, cfg.address, lease_options(cfg, true)),
                    to: broadcast_or_ciaddr,
                })
            } else {
                Some(Reply {
                    message: reply(
                        req,
                        MessageType::Nak,
                        Ipv4Addr::UNSPECIFIED,
                        vec![DhcpOption::ServerIdentifier(cfg.server_id)],
                    ),
                    to: Destination::Broadcast,
                })
            }
        }
        MessageType::Inform => Some(Reply {
            message: reply(
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
