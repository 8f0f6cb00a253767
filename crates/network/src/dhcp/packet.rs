//! DHCPv4 packets (RFC 2131/2132), pure: decode a BOOTP message with its options, encode one,
//! and the typed options this server understands (message type, subnet mask, router, DNS,
//! lease time, renewal times, hostname, MTU, server identifier, requested address).

use std::net::Ipv4Addr;

use crate::error::{Error, Result};
use crate::ipam::MacAddr;

/// The DHCP magic cookie after the fixed BOOTP header.
pub const MAGIC_COOKIE: [u8; 4] = [99, 130, 83, 99];
/// Size of the fixed BOOTP header (without the cookie).
const HEADER_LEN: usize = 236;
/// BOOTP's minimum message size; replies are padded to it (some clients insist).
const MIN_LEN: usize = 300;
/// The "broadcast" bit of the flags field.
pub const FLAG_BROADCAST: u16 = 0x8000;

pub const OP_REQUEST: u8 = 1;
pub const OP_REPLY: u8 = 2;

mod code {
    pub const PAD: u8 = 0;
    pub const SUBNET_MASK: u8 = 1;
    pub const ROUTER: u8 = 3;
    pub const DNS: u8 = 6;
    pub const HOSTNAME: u8 = 12;
    pub const MTU: u8 = 26;
    pub const REQUESTED_IP: u8 = 50;
    pub const LEASE_TIME: u8 = 51;
    pub const MESSAGE_TYPE: u8 = 53;
    pub const SERVER_ID: u8 = 54;
    pub const PARAMS: u8 = 55;
    pub const RENEWAL: u8 = 58;
    pub const REBINDING: u8 = 59;
    pub const END: u8 = 255;
}

/// DHCP message types (option 53).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageType {
    Discover,
    Offer,
    Request,
    Decline,
    Ack,
    Nak,
    Release,
    Inform,
}

impl MessageType {
    fn code(self) -> u8 {
        match self {
            MessageType::Discover => 1,
            MessageType::Offer => 2,
            MessageType::Request => 3,
            MessageType::Decline => 4,
            MessageType::Ack => 5,
            MessageType::Nak => 6,
            MessageType::Release => 7,
            MessageType::Inform => 8,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            1 => MessageType::Discover,
            2 => MessageType::Offer,
            3 => MessageType::Request,
            4 => MessageType::Decline,
            5 => MessageType::Ack,
            6 => MessageType::Nak,
            7 => MessageType::Release,
            8 => MessageType::Inform,
            _ => return None,
        })
    }
}

/// One DHCP option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DhcpOption {
    MessageType(MessageType),
    SubnetMask(Ipv4Addr),
    Router(Vec<Ipv4Addr>),
    Dns(Vec<Ipv4Addr>),
    Hostname(String),
    Mtu(u16),
    RequestedIp(Ipv4Addr),
    LeaseTime(u32),
    ServerId(Ipv4Addr),
    ParameterRequestList(Vec<u8>),
    RenewalTime(u32),
    RebindingTime(u32),
    /// Any option this module does not interpret: (code, raw value).
    Other(u8, Vec<u8>),
}

/// A decoded DHCP message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet {
    pub op: u8,
    pub xid: u32,
    pub secs: u16,
    pub flags: u16,
    pub ciaddr: Ipv4Addr,
    pub yiaddr: Ipv4Addr,
    pub siaddr: Ipv4Addr,
    pub giaddr: Ipv4Addr,
    /// Client hardware address (Ethernet only: htype 1, hlen 6).
    pub chaddr: MacAddr,
    pub options: Vec<DhcpOption>,
}

fn addrs(v: &[u8]) -> Result<Vec<Ipv4Addr>> {
    if v.is_empty() || !v.len().is_multiple_of(4) {
        return Err(Error::Malformed(
            "address list length is not a multiple of 4",
        ));
    }
    Ok(v.chunks(4)
        .map(|c| Ipv4Addr::new(c[0], c[1], c[2], c[3]))
        .collect())
}

fn one_addr(v: &[u8]) -> Result<Ipv4Addr> {
    match addrs(v)?.as_slice() {
        [a] => Ok(*a),
        _ => Err(Error::Malformed("expected exactly one address")),
    }
}

fn u32_of(v: &[u8]) -> Result<u32> {
    let b: [u8; 4] = v
        .try_into()
        .map_err(|_| Error::Malformed("expected 4 bytes"))?;
    Ok(u32::from_be_bytes(b))
}

fn addr_at(buf: &[u8], at: usize) -> Ipv4Addr {
    Ipv4Addr::new(buf[at], buf[at + 1], buf[at + 2], buf[at + 3])
}

impl DhcpOption {
    fn decode(code: u8, v: &[u8]) -> Result<DhcpOption> {
        Ok(match code {
            code::MESSAGE_TYPE => match v {
                [t] => DhcpOption::MessageType(
                    MessageType::from_code(*t).ok_or(Error::Malformed("unknown message type"))?,
                ),
                _ => return Err(Error::Malformed("message type must be one byte")),
            },
            code::SUBNET_MASK => DhcpOption::SubnetMask(one_addr(v)?),
            code::ROUTER => DhcpOption::Router(addrs(v)?),
            code::DNS => DhcpOption::Dns(addrs(v)?),
            code::HOSTNAME => DhcpOption::Hostname(String::from_utf8_lossy(v).into_owned()),
            code::MTU => {
                let b: [u8; 2] = v
                    .try_into()
                    .map_err(|_| Error::Malformed("MTU is 2 bytes"))?;
                DhcpOption::Mtu(u16::from_be_bytes(b))
            }
            code::REQUESTED_IP => DhcpOption::RequestedIp(one_addr(v)?),
            code::LEASE_TIME => DhcpOption::LeaseTime(u32_of(v)?),
            code::SERVER_ID => DhcpOption::ServerId(one_addr(v)?),
            code::PARAMS => DhcpOption::ParameterRequestList(v.to_vec()),
            code::RENEWAL => DhcpOption::RenewalTime(u32_of(v)?),
            code::REBINDING => DhcpOption::RebindingTime(u32_of(v)?),
            other => DhcpOption::Other(other, v.to_vec()),
        })
    }

    fn encode(&self, out: &mut Vec<u8>) {
        let ips = |v: &[Ipv4Addr]| v.iter().flat_map(|a| a.octets()).collect::<Vec<u8>>();
        let (c, v): (u8, Vec<u8>) = match self {
            DhcpOption::MessageType(t) => (code::MESSAGE_TYPE, vec![t.code()]),
            DhcpOption::SubnetMask(a) => (code::SUBNET_MASK, a.octets().to_vec()),
            DhcpOption::Router(v) => (code::ROUTER, ips(v)),
            DhcpOption::Dns(v) => (code::DNS, ips(v)),
            DhcpOption::Hostname(h) => (code::HOSTNAME, h.as_bytes().to_vec()),
            DhcpOption::Mtu(m) => (code::MTU, m.to_be_bytes().to_vec()),
            DhcpOption::RequestedIp(a) => (code::REQUESTED_IP, a.octets().to_vec()),
            DhcpOption::LeaseTime(t) => (code::LEASE_TIME, t.to_be_bytes().to_vec()),
            DhcpOption::ServerId(a) => (code::SERVER_ID, a.octets().to_vec()),
            DhcpOption::ParameterRequestList(p) => (code::PARAMS, p.clone()),
            DhcpOption::RenewalTime(t) => (code::RENEWAL, t.to_be_bytes().to_vec()),
            DhcpOption::RebindingTime(t) => (code::REBINDING, t.to_be_bytes().to_vec()),
            DhcpOption::Other(c, v) => (*c, v.clone()),
        };
        // Options longer than 255 bytes are split into several instances (RFC 3396).
        if v.is_empty() {
            out.extend([c, 0]);
        }
        for chunk in v.chunks(255) {
            out.push(c);
            out.push(chunk.len() as u8);
            out.extend_from_slice(chunk);
        }
    }
}

impl Packet {
    /// Decodes a message; repeated instances of one option are concatenated (RFC 3396).
    pub fn decode(buf: &[u8]) -> Result<Packet> {
        if buf.len() < HEADER_LEN + 4 {
            return Err(Error::Malformed("shorter than a BOOTP header"));
        }
        if buf[HEADER_LEN..HEADER_LEN + 4] != MAGIC_COOKIE {
            return Err(Error::Malformed("no DHCP magic cookie"));
        }
        if buf[1] != 1 || buf[2] != 6 {
            return Err(Error::Malformed("hardware type is not Ethernet"));
        }
        let mut raw: Vec<(u8, Vec<u8>)> = Vec::new();
        let mut i = HEADER_LEN + 4;
        while i < buf.len() {
            let c = buf[i];
            if c == code::END {
                break;
            }
            if c == code::PAD {
                i += 1;
                continue;
            }
            let len = *buf.get(i + 1).ok_or(Error::Malformed("truncated option"))? as usize;
            let v = buf
                .get(i + 2..i + 2 + len)
                .ok_or(Error::Malformed("option runs past the end"))?;
            match raw.iter_mut().find(|(rc, _)| *rc == c) {
                Some((_, acc)) => acc.extend_from_slice(v),
                None => raw.push((c, v.to_vec())),
            }
            i += 2 + len;
        }
        let options = raw
            .iter()
            .map(|(c, v)| DhcpOption::decode(*c, v))
            .collect::<Result<Vec<_>>>()?;
        let mut mac = [0u8; 6];
        mac.copy_from_slice(&buf[28..34]);
        Ok(Packet {
            op: buf[0],
            xid: u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]),
            secs: u16::from_be_bytes([buf[8], buf[9]]),
            flags: u16::from_be_bytes([buf[10], buf[11]]),
            ciaddr: addr_at(buf, 12),
            yiaddr: addr_at(buf, 16),
            siaddr: addr_at(buf, 20),
            giaddr: addr_at(buf, 24),
            chaddr: MacAddr(mac),
            options,
        })
    }

    /// Encodes the message, padded to BOOTP's 300-byte minimum.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; HEADER_LEN];
        out[0] = self.op;
        out[1] = 1; // Ethernet
        out[2] = 6;
        out[4..8].copy_from_slice(&self.xid.to_be_bytes());
        out[8..10].copy_from_slice(&self.secs.to_be_bytes());
        out[10..12].copy_from_slice(&self.flags.to_be_bytes());
        out[12..16].copy_from_slice(&self.ciaddr.octets());
        out[16..20].copy_from_slice(&self.yiaddr.octets());
        out[20..24].copy_from_slice(&self.siaddr.octets());
        out[24..28].copy_from_slice(&self.giaddr.octets());
        out[28..34].copy_from_slice(&self.chaddr.0);
        out.extend_from_slice(&MAGIC_COOKIE);
        for o in &self.options {
            o.encode(&mut out);
        }
        out.push(code::END);
        if out.len() < MIN_LEN {
            out.resize(MIN_LEN, 0);
        }
        out
    }

    /// The message type (option 53), if present.
    pub fn message_type(&self) -> Option<MessageType> {
        self.options.iter().find_map(|o| match o {
            DhcpOption::MessageType(t) => Some(*t),
            _ => None,
        })
    }

    /// The requested address (option 50), if present.
    pub fn requested_ip(&self) -> Option<Ipv4Addr> {
        self.options.iter().find_map(|o| match o {
            DhcpOption::RequestedIp(a) => Some(*a),
            _ => None,
        })
    }

    /// The server identifier (option 54), if present.
    pub fn server_id(&self) -> Option<Ipv4Addr> {
        self.options.iter().find_map(|o| match o {
            DhcpOption::ServerId(a) => Some(*a),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: MacAddr = MacAddr([0x02, 0x11, 0x22, 0x33, 0x44, 0x55]);

    /// A DISCOVER laid out byte by byte the way busybox udhcpc sends one.
    fn udhcpc_discover() -> Vec<u8> {
        let mut b = vec![0u8; 236];
        b[0] = 1; // BOOTREQUEST
        b[1] = 1;
        b[2] = 6;
        b[4..8].copy_from_slice(&0xdead_beefu32.to_be_bytes());
        b[28..34].copy_from_slice(&MAC.0);
        b.extend_from_slice(&MAGIC_COOKIE);
        b.extend_from_slice(&[53, 1, 1]); // DISCOVER
        b.extend_from_slice(&[61, 7, 1, 0x02, 0x11, 0x22, 0x33, 0x44, 0x55]); // client id
        b.extend_from_slice(&[57, 2, 0x02, 0x40]); // max message size 576
        b.extend_from_slice(&[55, 7, 1, 3, 6, 12, 15, 28, 42]); // parameter request list
        b.extend_from_slice(&[60, 12]);
        b.extend_from_slice(b"udhcp 1.35.0");
        b.push(255);
        b.resize(300, 0);
        b
    }

    #[test]
    fn decodes_a_udhcpc_discover() {
        let p = Packet::decode(&udhcpc_discover()).unwrap();
        assert_eq!(p.op, OP_REQUEST);
        assert_eq!(p.xid, 0xdead_beef);
        assert_eq!(p.chaddr, MAC);
        assert_eq!(p.ciaddr, Ipv4Addr::UNSPECIFIED);
        assert_eq!(p.message_type(), Some(MessageType::Discover));
        assert!(p.options.contains(&DhcpOption::ParameterRequestList(vec![
            1, 3, 6, 12, 15, 28, 42
        ])));
        assert!(
            p.options
                .contains(&DhcpOption::Other(60, b"udhcp 1.35.0".to_vec()))
        );
        assert_eq!(p.requested_ip(), None);
    }

    #[test]
    fn decodes_a_request_with_server_id_and_requested_ip() {
        let mut b = udhcpc_discover();
        b.truncate(240);
        b.extend_from_slice(&[53, 1, 3, 50, 4, 10, 0, 2, 2, 54, 4, 10, 0, 2, 1, 255]);
        let p = Packet::decode(&b).unwrap();
        assert_eq!(p.message_type(), Some(MessageType::Request));
        assert_eq!(p.requested_ip(), Some(Ipv4Addr::new(10, 0, 2, 2)));
        assert_eq!(p.server_id(), Some(Ipv4Addr::new(10, 0, 2, 1)));
    }

    #[test]
    fn encodes_an_offer_that_decodes_back() {
        let p = Packet {
            op: OP_REPLY,
            xid: 7,
            secs: 0,
            flags: FLAG_BROADCAST,
            ciaddr: Ipv4Addr::UNSPECIFIED,
            yiaddr: Ipv4Addr::new(10, 0, 2, 2),
            siaddr: Ipv4Addr::new(10, 0, 2, 1),
            giaddr: Ipv4Addr::UNSPECIFIED,
            chaddr: MAC,
            options: vec![
                DhcpOption::MessageType(MessageType::Offer),
                DhcpOption::ServerId(Ipv4Addr::new(10, 0, 2, 1)),
                DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)),
                DhcpOption::Router(vec![Ipv4Addr::new(10, 0, 2, 1)]),
                DhcpOption::Dns(vec![
                    Ipv4Addr::new(10, 96, 0, 10),
                    Ipv4Addr::new(1, 1, 1, 1),
                ]),
                DhcpOption::LeaseTime(86400),
                DhcpOption::RenewalTime(43200),
                DhcpOption::RebindingTime(75600),
                DhcpOption::Hostname("vm1".into()),
                DhcpOption::Mtu(1450),
            ],
        };
        let bytes = p.encode();
        assert_eq!(bytes.len(), 300);
        assert_eq!(bytes[0], 2);
        assert_eq!(&bytes[16..20], &[10, 0, 2, 2]);
        assert_eq!(&bytes[236..240], &MAGIC_COOKIE);
        assert_eq!(&bytes[240..243], &[53, 1, 2]);
        assert_eq!(Packet::decode(&bytes).unwrap(), p);
    }

    #[test]
    fn long_options_are_split_and_joined() {
        let long = "h".repeat(300);
        let p = Packet {
            op: OP_REPLY,
            xid: 1,
            secs: 0,
            flags: 0,
            ciaddr: Ipv4Addr::UNSPECIFIED,
            yiaddr: Ipv4Addr::UNSPECIFIED,
            siaddr: Ipv4Addr::UNSPECIFIED,
            giaddr: Ipv4Addr::UNSPECIFIED,
            chaddr: MAC,
            options: vec![DhcpOption::Hostname(long.clone())],
        };
        let back = Packet::decode(&p.encode()).unwrap();
        assert_eq!(back.options, vec![DhcpOption::Hostname(long)]);
    }

    #[test]
    fn rejects_malformed_packets() {
        assert!(Packet::decode(&[0u8; 100]).is_err());
        let mut b = udhcpc_discover();
        b[236] = 0; // cookie
        assert!(
            Packet::decode(&b)
                .unwrap_err()
                .to_string()
                .contains("cookie")
        );
        let mut b = udhcpc_discover();
        b.truncate(240);
        b.extend_from_slice(&[3, 9, 1, 2]); // router option running past the end
        assert!(Packet::decode(&b).is_err());
        let mut b = udhcpc_discover();
        b.truncate(240);
        b.extend_from_slice(&[3, 3, 1, 2, 3, 255]); // router length not a multiple of 4
        assert!(Packet::decode(&b).is_err());
        let mut b = udhcpc_discover();
        b[1] = 6; // token ring
        assert!(Packet::decode(&b).is_err());
    }
}
