//! ferrovirt-network: the pod network of a node (see docs/networking.md).
//!
//! - [`mode`]: the node's network mode (`auto`, `pod`, `user`) and the decision for `auto` (pure).
//! - [`ipam`]: CIDRs, node subnets, stable VMI addresses and MACs (pure).
//! - [`plan`]: what to create for the node and for one VMI interface (pure).
//! - [`render`]: plans → idempotent iproute2 / nft actions (pure).
//! - [`node_cidrs`]: node subnet allocation (`spec.podCIDR`) and overlap checks (pure).
//! - [`overlay`]: the VXLAN overlay between nodes: peers from Node objects, sync steps (pure).
//! - [`routes`]: `/32` routes that follow a live-migrated VMI to its node (pure).
//! - [`services`]: the Service data plane's nft table (ClusterIP/NodePort DNAT) (pure).
//! - [`udn`]: Primary Layer2 user-defined networks: per-network namespace, bridge and VXLAN,
//!   head-end replication, a VMI's plan on the network; Secondary Layer2 ones as Multus
//!   interfaces (pure).
//! - [`udn_l3`]: Primary Layer3 user-defined networks: host subnets from the Node annotation,
//!   peers, routed steps, route sync through the overlay's (pure).
//! - [`secondary`]: Multus bridge networks: CNI config parsing, per-interface plans (pure).
//! - [`localnet`]: OVN-Kubernetes localnet NADs resolved through bridge mappings (pure).
//! - [`dhcp`]: DHCPv4 packets, the reply decision, and an async per-VMI server.
//! - [`apply`], [`netns`]: running the actions as root; entering namespaces.
//! - [`pod`]: the API the agent calls (`setup_node`, `setup`, `teardown`, overlay and
//!   secondary networks).

pub mod apply;
pub mod dhcp;
pub mod error;
pub mod ipam;
pub mod localnet;
pub mod mode;
pub mod netns;
pub mod node_cidrs;
pub mod overlay;
pub mod plan;
pub mod pod;
pub mod render;
pub mod routes;
pub mod secondary;
pub mod services;
pub mod udn;
pub mod udn_l3;
pub mod udn_svc;

pub use error::{Error, Result};
pub use ipam::{Ipam, Ipv4Cidr, MacAddr};
pub use mode::{ModeDecision, NetworkMode, RequestedMode};
pub use overlay::{NodeInfo, Overlay, Peer};
pub use plan::{Binding, NodeNetwork, PodPlan, PodRequest, Port, PortProtocol};
pub use pod::{Attached, setup, setup_node, teardown, teardown_node};
pub use secondary::{BridgeConfig, SecondaryPlan, SecondaryRequest};
