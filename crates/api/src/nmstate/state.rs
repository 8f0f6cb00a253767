//! The part of nmstate's desired state ferrovirt carries out, typed with nmstate's
//! kebab-case field names. Every struct denies unknown fields, so a field ferrovirt does not
//! carry out is refused naming it, never dropped.

use serde::{Deserialize, Serialize};

/// `spec.desiredState` of a policy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct DesiredState {
    /// Interfaces to create, change or remove.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<Interface>,
    /// Static routes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routes: Option<Routes>,
    /// The node's resolver.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dns_resolver: Option<DnsResolver>,
    /// OVN bridge mappings (physical network name → host bridge), for Localnet networks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ovn: Option<Ovn>,
}

/// One interface.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Interface {
    /// The kernel name (at most 15 characters).
    #[serde(default)]
    pub name: String,
    /// linux-bridge, vlan, bond or ethernet (an existing NIC).
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub type_: Option<InterfaceType>,
    /// up (default), down or absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<InterfaceState>,
    /// linux-bridge options and ports.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bridge: Option<Bridge>,
    /// The VLAN of a vlan interface.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vlan: Option<Vlan>,
    /// The bond's mode and ports.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub link_aggregation: Option<LinkAggregation>,
    /// IPv4 configuration.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ipv4: Option<Ipv4>,
}

/// Interface types.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum InterfaceType {
    LinuxBridge,
    Vlan,
    Bond,
    Ethernet,
}

impl InterfaceType {
    /// nmstate's name for the type.
    pub fn as_str(self) -> &'static str {
        match self {
            InterfaceType::LinuxBridge => "linux-bridge",
            InterfaceType::Vlan => "vlan",
            InterfaceType::Bond => "bond",
            InterfaceType::Ethernet => "ethernet",
        }
    }
}

/// Interface states.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum InterfaceState {
    Up,
    Down,
    Absent,
}

/// A linux-bridge.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Bridge {
    /// Bridge options (STP).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub options: Option<BridgeOptions>,
    /// The bridge's ports (the complete list: other ports are released).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<Vec<BridgePort>>,
}

/// Bridge options.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct BridgeOptions {
    /// Spanning tree.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stp: Option<Stp>,
}

/// Spanning tree.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Stp {
    /// STP on or off (nmstate's default for a new bridge: on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
}

/// A bridge port.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct BridgePort {
    /// The port interface.
    #[serde(default)]
    pub name: String,
    /// The port's VLAN (needs VLAN filtering in the node's kernel).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vlan: Option<PortVlan>,
}

/// VLAN configuration of a bridge port.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct PortVlan {
    /// access or trunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<PortVlanMode>,
    /// The access VLAN, or the trunk's native VLAN.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<i64>,
    /// The VLANs a trunk carries.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trunk_tags: Option<Vec<TrunkTag>>,
}

/// Port VLAN modes.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum PortVlanMode {
    Access,
    Trunk,
}

/// One VLAN of a trunk.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct TrunkTag {
    /// The VLAN id.
    pub id: i64,
}

/// A vlan interface.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Vlan {
    /// The interface the VLAN rides on.
    #[serde(default)]
    pub base_iface: String,
    /// The VLAN id (1..4094).
    #[serde(default)]
    pub id: i64,
}

/// A bond.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct LinkAggregation {
    /// Bonding mode (balance-rr, active-backup, balance-xor, broadcast, 802.3ad, balance-tlb,
    /// balance-alb).
    #[serde(default)]
    pub mode: String,
    /// The bond's ports.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<Vec<String>>,
}

/// The bonding modes the kernel knows.
pub const BOND_MODES: &[&str] = &[
    "balance-rr",
    "active-backup",
    "balance-xor",
    "broadcast",
    "802.3ad",
    "balance-tlb",
    "balance-alb",
];

/// IPv4 configuration of an interface.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Ipv4 {
    /// IPv4 on (addresses kept as listed) or off (all removed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// DHCP instead of static addresses.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dhcp: Option<bool>,
    /// Static addresses (the complete list).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub address: Option<Vec<Address>>,
    /// With dhcp: record the lease's DNS servers (default true; reported in
    /// `dns-resolver.running`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto_dns: Option<bool>,
    /// With dhcp: install the lease's router as the default route (default true).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto_gateway: Option<bool>,
    /// With dhcp: install the routes the lease brings (default true; false also keeps the
    /// default route out).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto_routes: Option<bool>,
    /// With dhcp: the routing table of the lease's routes (only 0, the main table, is
    /// carried out).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto_route_table_id: Option<i64>,
}

/// An address with its prefix length.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Address {
    /// The address.
    #[serde(default)]
    pub ip: String,
    /// The prefix length (0..32).
    #[serde(default)]
    pub prefix_length: i64,
}

/// Static routes.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Routes {
    /// Routes to add (or remove with `state: absent`).
    #[serde(default)]
    pub config: Vec<Route>,
}

/// One route.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Route {
    /// Destination CIDR.
    #[serde(default)]
    pub destination: String,
    /// Gateway.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_hop_address: Option<String>,
    /// Outgoing interface.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_hop_interface: Option<String>,
    /// `absent` removes the route.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<AbsentState>,
}

/// The only state a route may ask for.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum AbsentState {
    Absent,
}

/// The node's resolver.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct DnsResolver {
    /// The configuration.
    #[serde(default)]
    pub config: DnsConfig,
}

/// Resolver configuration.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct DnsConfig {
    /// Name servers.
    #[serde(default)]
    pub server: Vec<String>,
    /// Search domains.
    #[serde(default)]
    pub search: Vec<String>,
}

/// OVN settings.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Ovn {
    /// Physical network name → bridge.
    #[serde(default)]
    pub bridge_mappings: Vec<BridgeMapping>,
}

/// One bridge mapping.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct BridgeMapping {
    /// The physical network name a Localnet network names.
    #[serde(default)]
    pub localnet: String,
    /// The host bridge.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bridge: Option<String>,
    /// present (default) or absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<MappingState>,
}

/// Bridge mapping states.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum MappingState {
    Present,
    Absent,
}

impl Interface {
    /// The state asked for (`up` when not given).
    pub fn state(&self) -> InterfaceState {
        self.state.unwrap_or(InterfaceState::Up)
    }
}
