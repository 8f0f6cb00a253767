//! k8s.ovn.org/v1 user-defined networks, as OVN-Kubernetes publishes them: UserDefinedNetwork
//! (namespaced: Layer2 or Layer3, role Primary or Secondary) and ClusterUserDefinedNetwork
//! (cluster-scoped: a `namespaceSelector` and a network that may also be Localnet). Types,
//! resource-table entries with printer columns, OpenAPI schemas, the names the controller
//! writes (labels, finalizer, condition reasons) and admission ([`validate`]).

pub mod validate;

#[cfg(test)]
mod tests;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use serde_json::Value;

pub use validate::admit;

use crate::registry::{ALL_VERBS, PrinterColumn, ResourceDef};

/// The API group.
pub const GROUP: &str = "k8s.ovn.org";
/// The served (and stored) version.
pub const VERSION: &str = "v1";
/// Label on the NetworkAttachmentDefinitions made for a UDN or CUDN (value empty), as OVN-K.
pub const NAD_LABEL: &str = "k8s.ovn.org/user-defined-network";
/// Finalizer on a UDN/CUDN and on the NADs made for it while workloads may use them.
pub const FINALIZER: &str = "k8s.ovn.org/user-defined-network-protection";
/// Namespace label that asks for a Primary UDN (pods/VMIs there land on it, not the pod network).
pub const PRIMARY_NAMESPACE_LABEL: &str = "k8s.ovn.org/primary-user-defined-network";
/// The CNI type of the NADs OVN-K makes for user-defined networks.
pub const CNI_TYPE: &str = "ovn-k8s-cni-overlay";
/// VMI annotation (OVN-K's pod annotation name): the addresses each user-defined network with
/// IPAM assigned to the VMI, a JSON object keyed `<nad namespace>/<nad name>` whose values are
/// [`PodNetwork`]s. Written by the user-defined network controller, read by the node agent.
pub const POD_NETWORKS_ANNOTATION: &str = "k8s.ovn.org/pod-networks";
/// Node annotation (OVN-K's): each Layer3 network's host subnets on that node, a JSON object
/// network name (the NAD config's `name`) → list of CIDRs. Written by the user-defined network
/// controller.
pub const NODE_SUBNETS_ANNOTATION: &str = "k8s.ovn.org/node-subnets";

/// Annotation on a UDN/CUDN and on each NAD made for it: the network's VXLAN network identifier
/// (decimal, at least [`MIN_VNI`]), chosen once by the controller, unique among the networks.
pub const VNI_ANNOTATION: &str = "ferrovirt.io/udn-vni";
/// The lowest VNI a user-defined network gets (the pod network's overlay uses 4244).
pub const MIN_VNI: u32 = 10_000;
/// The highest VXLAN network identifier (24 bits).
pub const MAX_VNI: u32 = (1 << 24) - 1;

/// One network's entry in [`POD_NETWORKS_ANNOTATION`] (OVN-K's field names).
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct PodNetwork {
    /// The addresses with their prefix length, e.g. `10.100.0.5/24`.
    #[serde(default)]
    pub ip_addresses: Vec<String>,
    /// The network's gateways (Layer2 Primary: the subnet's first address), if any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gateway_ips: Vec<String>,
    /// `primary` or `secondary`.
    #[serde(default)]
    pub role: String,
}

/// The [`POD_NETWORKS_ANNOTATION`] of an object's annotations (empty when absent or not JSON).
pub fn pod_networks(
    annotations: Option<&std::collections::BTreeMap<String, String>>,
) -> std::collections::BTreeMap<String, PodNetwork> {
    annotations
        .and_then(|a| a.get(POD_NETWORKS_ANNOTATION))
        .and_then(|v| serde_json::from_str(v).ok())
        .unwrap_or_default()
}

/// The condition a UDN/CUDN reports its NADs on.
pub const CONDITION_NETWORK_CREATED: &str = "NetworkCreated";
/// Reasons of [`CONDITION_NETWORK_CREATED`].
pub mod reason {
    pub const NAD_CREATED: &str = "NetworkAttachmentDefinitionCreated";
    pub const NAD_SYNC_ERROR: &str = "SyncError";
    pub const NAD_DELETED: &str = "NetworkAttachmentDefinitionDeleted";
    pub const NAD_SYNC_ERROR_CUDN: &str = "NetworkAttachmentDefinitionSyncError";
}

kenum! {
    /// The shape of the network.
    pub enum Topology { Layer2, Layer3, Localnet }
}

kenum! {
    /// Whether the network replaces the pod network (Primary) or is an extra one (Secondary).
    pub enum Role { Primary, Secondary }
}

kenum! {
    /// Whether OVN-K assigns addresses from the subnets.
    pub enum IpamMode { Enabled, Disabled }
}

kenum! {
    /// How long an assigned address lives: `Persistent` keeps it in an IPAMClaim.
    pub enum IpamLifecycle { Persistent }
}

kenum! {
    /// VLAN mode of a Localnet network.
    pub enum VlanMode { Access }
}

resource! {
    /// A namespace's own network (k8s.ovn.org/v1 UserDefinedNetwork).
    UserDefinedNetwork, UserDefinedNetworkSpec, NetworkStatus
}

resource! {
    /// A network shared by the namespaces a selector picks (k8s.ovn.org/v1).
    ClusterUserDefinedNetwork, ClusterUserDefinedNetworkSpec, NetworkStatus
}

kstruct! {
    /// The network of a UserDefinedNetwork: topology and the matching configuration.
    pub struct UserDefinedNetworkSpec {
        /// Layer2 (one switch shared by all nodes) or Layer3 (a segment per node, routed).
        pub topology: Option<Topology>,
        /// Required when topology is Layer2, forbidden otherwise.
        pub layer2: Option<Layer2Config>,
        /// Required when topology is Layer3, forbidden otherwise.
        pub layer3: Option<Layer3Config>,
    }
}

kstruct! {
    /// A ClusterUserDefinedNetwork: which namespaces, and the network.
    pub struct ClusterUserDefinedNetworkSpec {
        /// The namespaces the network is made available in.
        pub namespace_selector: Option<LabelSelector>,
        /// The network (immutable).
        pub network: Option<NetworkSpec>,
    }
}

kstruct! {
    /// The network of a ClusterUserDefinedNetwork.
    pub struct NetworkSpec {
        /// Layer2, Layer3 or Localnet.
        pub topology: Option<Topology>,
        /// Required when topology is Layer2, forbidden otherwise.
        pub layer2: Option<Layer2Config>,
        /// Required when topology is Layer3, forbidden otherwise.
        pub layer3: Option<Layer3Config>,
        /// Required when topology is Localnet, forbidden otherwise.
        pub localnet: Option<LocalnetConfig>,
    }
}

kstruct! {
    /// A Layer2 network: one logical switch across all nodes.
    pub struct Layer2Config {
        /// Primary or Secondary (required).
        pub role: Option<Role>,
        /// MTU (576..65536; at least 1280 with an IPv6 subnet).
        pub mtu: Option<i64>,
        /// One subnet, or one per IP family; required unless `ipam.mode` is Disabled.
        pub subnets: Option<Vec<String>>,
        /// Join subnets (Primary only).
        pub join_subnets: Option<Vec<String>>,
        /// IPAM configuration.
        pub ipam: Option<IpamConfig>,
    }
}

kstruct! {
    /// A Layer3 network: a subnet per node, routed between them.
    pub struct Layer3Config {
        /// Primary or Secondary (required).
        pub role: Option<Role>,
        /// MTU (576..65536; at least 1280 with an IPv6 subnet).
        pub mtu: Option<i64>,
        /// The cluster subnets, split into one per node (required).
        pub subnets: Option<Vec<Layer3Subnet>>,
        /// Join subnets (Primary only).
        pub join_subnets: Option<Vec<String>>,
    }
}

kstruct! {
    /// A Layer3 subnet and the size of each node's share.
    pub struct Layer3Subnet {
        /// The subnet (CIDR).
        pub cidr: Option<String>,
        /// Prefix length of a node's subnet (longer than the CIDR's).
        pub host_subnet: Option<i64>,
    }
}

kstruct! {
    /// A Localnet network: a physical network reached through a node bridge mapping.
    pub struct LocalnetConfig {
        /// Only Secondary.
        pub role: Option<Role>,
        /// The bridge mapping's network name (1..253 characters, no `,` or `:`).
        pub physical_network_name: Option<String>,
        /// Subnets to assign from (optional).
        pub subnets: Option<Vec<String>>,
        /// Ranges inside `subnets` never assigned.
        pub exclude_subnets: Option<Vec<String>>,
        /// IPAM configuration.
        pub ipam: Option<IpamConfig>,
        /// MTU (576..65536; at least 1280 with an IPv6 subnet).
        pub mtu: Option<i64>,
        /// VLAN configuration.
        pub vlan: Option<VlanConfig>,
    }
}

kstruct! {
    /// IPAM of a network (at least one property).
    pub struct IpamConfig {
        /// Enabled (default) or Disabled (Secondary only).
        pub mode: Option<IpamMode>,
        /// Persistent: addresses kept in IPAMClaims (only with mode Enabled).
        pub lifecycle: Option<IpamLifecycle>,
    }
}

kstruct! {
    /// VLAN configuration of a Localnet network.
    pub struct VlanConfig {
        /// Access.
        pub mode: Option<VlanMode>,
        /// The access VLAN (required with mode Access).
        pub access: Option<AccessVlanConfig>,
    }
}

kstruct! {
    /// An access VLAN.
    pub struct AccessVlanConfig {
        /// The VLAN id, 1..4094.
        pub id: Option<i64>,
    }
}

kstruct! {
    /// Observed state of a UDN or CUDN.
    pub struct NetworkStatus {
        /// NetworkCreated (and others) as metav1 Conditions.
        pub conditions: Option<Vec<Condition>>,
    }
}

/// One network's configuration, whichever kind it came from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum NetworkConfig<'a> {
    Layer2(&'a Layer2Config),
    Layer3(&'a Layer3Config),
    Localnet(&'a LocalnetConfig),
}

impl UserDefinedNetworkSpec {
    /// The configuration that matches the topology, if both are there.
    pub fn config(&self) -> Option<NetworkConfig<'_>> {
        match self.topology? {
            Topology::Layer2 => self.layer2.as_ref().map(NetworkConfig::Layer2),
            Topology::Layer3 => self.layer3.as_ref().map(NetworkConfig::Layer3),
            Topology::Localnet => None,
        }
    }
}

impl NetworkSpec {
    /// The configuration that matches the topology, if both are there.
    pub fn config(&self) -> Option<NetworkConfig<'_>> {
        match self.topology? {
            Topology::Layer2 => self.layer2.as_ref().map(NetworkConfig::Layer2),
            Topology::Layer3 => self.layer3.as_ref().map(NetworkConfig::Layer3),
            Topology::Localnet => self.localnet.as_ref().map(NetworkConfig::Localnet),
        }
    }
}

impl NetworkConfig<'_> {
    /// The topology's name as OVN-K writes it in a NAD (`layer2`, `layer3`, `localnet`).
    pub fn topology_name(&self) -> &'static str {
        match self {
            NetworkConfig::Layer2(_) => "layer2",
            NetworkConfig::Layer3(_) => "layer3",
            NetworkConfig::Localnet(_) => "localnet",
        }
    }
    pub fn role(&self) -> Option<Role> {
        match self {
            NetworkConfig::Layer2(c) => c.role,
            NetworkConfig::Layer3(c) => c.role,
            NetworkConfig::Localnet(c) => c.role,
        }
    }
    pub fn mtu(&self) -> Option<i64> {
        match self {
            NetworkConfig::Layer2(c) => c.mtu,
            NetworkConfig::Layer3(c) => c.mtu,
            NetworkConfig::Localnet(c) => c.mtu,
        }
    }
    /// The subnets as CIDR strings (Layer3: the cluster CIDRs with `/hostSubnet` appended as
    /// OVN-K writes them: `10.0.0.0/16/24`).
    pub fn subnets(&self) -> Vec<String> {
        match self {
            NetworkConfig::Layer2(c) => c.subnets.clone().unwrap_or_default(),
            NetworkConfig::Localnet(c) => c.subnets.clone().unwrap_or_default(),
            NetworkConfig::Layer3(c) => c
                .subnets
                .iter()
                .flatten()
                .filter_map(|s| {
                    let cidr = s.cidr.as_deref()?;
                    Some(match s.host_subnet {
                        Some(h) => format!("{cidr}/{h}"),
                        None => cidr.to_string(),
                    })
                })
                .collect(),
        }
    }
    pub fn ipam(&self) -> Option<&IpamConfig> {
        match self {
            NetworkConfig::Layer2(c) => c.ipam.as_ref(),
            NetworkConfig::Layer3(_) => None,
            NetworkConfig::Localnet(c) => c.ipam.as_ref(),
        }
    }
    /// Whether addresses are kept in IPAMClaims (`ipam.lifecycle: Persistent`).
    pub fn persistent_ips(&self) -> bool {
        self.ipam()
            .is_some_and(|i| i.lifecycle == Some(IpamLifecycle::Persistent))
    }
}

fn col(name: &'static str, type_: &'static str, json_path: &'static str) -> PrinterColumn {
    PrinterColumn {
        name,
        type_,
        json_path,
        description: "",
        priority: 0,
    }
}

fn def(
    kind: &'static str,
    list_kind: &'static str,
    plural: &'static str,
    singular: &'static str,
    namespaced: bool,
    short_names: &'static [&'static str],
    printer_columns: Vec<PrinterColumn>,
) -> ResourceDef {
    ResourceDef {
        group: GROUP,
        version: VERSION,
        kind,
        list_kind,
        plural,
        singular,
        namespaced,
        short_names,
        categories: &[],
        has_status: true,
        verbs: ALL_VERBS,
        printer_columns,
    }
}

const CREATED_STATUS: &str = ".status.conditions[?(@.type=='NetworkCreated')].status";
const CREATED_REASON: &str = ".status.conditions[?(@.type=='NetworkCreated')].reason";

/// The group's entries of the resource table.
pub fn resources() -> Vec<ResourceDef> {
    vec![
        def(
            "UserDefinedNetwork",
            "UserDefinedNetworkList",
            "userdefinednetworks",
            "userdefinednetwork",
            true,
            &["udn"],
            vec![
                col("Topology", "string", ".spec.topology"),
                col("Created", "string", CREATED_STATUS),
                col("Reason", "string", CREATED_REASON),
            ],
        ),
        def(
            "ClusterUserDefinedNetwork",
            "ClusterUserDefinedNetworkList",
            "clusteruserdefinednetworks",
            "clusteruserdefinednetwork",
            false,
            &["cudn"],
            vec![
                col("Topology", "string", ".spec.network.topology"),
                col("Created", "string", CREATED_STATUS),
                col("Reason", "string", CREATED_REASON),
            ],
        ),
    ]
}

/// The OpenAPI schema of one of the group's kinds.
pub fn schema(kind: &str) -> Option<Value> {
    use crate::schema::schema_of;
    Some(match kind {
        "UserDefinedNetwork" => schema_of::<UserDefinedNetwork>(),
        "ClusterUserDefinedNetwork" => schema_of::<ClusterUserDefinedNetwork>(),
        _ => return None,
    })
}
