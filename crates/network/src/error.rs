//! The crate's error type.

use std::net::Ipv4Addr;

/// Everything that can go wrong while planning or applying pod networking.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A CIDR or address string could not be parsed.
    #[error("invalid CIDR {input:?}: {reason}")]
    InvalidCidr { input: String, reason: String },
    /// Two address ranges that must be disjoint overlap.
    #[error("{first_name} {first} overlaps {second_name} {second}")]
    Overlap {
        first_name: String,
        first: String,
        second_name: String,
        second: String,
    },
    /// The cluster CIDR has no room for the requested node subnet.
    #[error("node subnet index {index} does not fit: {cluster} has {count} /{prefix} subnets")]
    NodeSubnetOutOfRange {
        index: u32,
        cluster: String,
        count: u64,
        prefix: u8,
    },
    /// Every host address of a subnet is taken.
    #[error("subnet {0} has no free address")]
    SubnetFull(String),
    /// A plan option is inconsistent.
    #[error("invalid plan: {0}")]
    InvalidPlan(String),
    /// A DHCP packet could not be decoded.
    #[error("malformed DHCP packet: {0}")]
    Malformed(&'static str),
    /// dhcproto could not decode a DHCP packet.
    #[error("malformed DHCP packet: {0}")]
    Decode(#[source] dhcproto::error::DecodeError),
    /// dhcproto could not encode a reply (e.g. an option value too large).
    #[error("cannot encode DHCP reply: {0}")]
    Encode(#[source] dhcproto::error::EncodeError),
    /// The address handed out is not inside the subnet it claims.
    #[error("address {addr} is not in {subnet}")]
    NotInSubnet { addr: Ipv4Addr, subnet: String },
    /// A NetworkAttachmentDefinition's CNI configuration cannot be used.
    #[error("{0}")]
    InvalidNetworkConfig(String),
    /// A secondary network names a host bridge the node does not have.
    #[error("network {interface:?}: bridge {bridge:?} does not exist on this node{}", netns.as_ref().map(|n| format!(" (namespace {n})")).unwrap_or_default())]
    MissingBridge {
        interface: String,
        bridge: String,
        netns: Option<String>,
    },
    /// A secondary network asks for a VLAN on a bridge (or kernel) without VLAN filtering.
    #[error(
        "network {interface:?}: VLAN {vlan} needs VLAN filtering on bridge {bridge:?}, which this node cannot enable ({reason})"
    )]
    VlanUnsupported {
        interface: String,
        vlan: u16,
        bridge: String,
        reason: String,
    },
    /// Two nodes' pod subnets overlap.
    #[error("pod CIDR {cidr} of node {node} overlaps {other_cidr} of node {other}")]
    NodeCidrOverlap {
        node: String,
        cidr: String,
        other: String,
        other_cidr: String,
    },
    /// A required tool or privilege is missing.
    #[error("pod networking cannot run here: {0}")]
    Preflight(String),
    /// An external command (ip, nft, sysctl) failed.
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        command: String,
        status: String,
        stderr: String,
    },
    /// An I/O error with context.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
