//! ferrovirt's node agent (KubeVirt's virt-handler): registers its Node, watches the
//! VirtualMachineInstances bound to it, prepares their volumes, runs one detached launcher per
//! VMI and reports status.
//!
//! - [`mapping`]: the pure VMI spec → `LaunchSpec` translation.
//! - [`volumes`]: the pure volume plan (what to create for each VMI volume) and its execution.
//! - [`containerdisk`]: containerDisk images pulled into the node cache (overlays per VMI).
//! - [`decide`]: the pure per-VMI decision (start, stop, status to write, cleanup).
//! - [`network`]: pod network, overlay and secondary networks of the node and its VMIs.
//! - [`node`]: host facts and the Node / Lease objects.
//! - [`cpu_models`]: the named CPU models this node's QEMU runs (probed over QMP) and what a
//!   VMI's CPU model becomes on the QEMU command line.
//! - [`launchers`]: starting, finding and talking to launcher processes.
//! - [`runtime`]: the kube-rs loop that applies all of it against the API server.
//! - [`services`]: the node's Service data plane (ClusterIP/NodePort nft table from watches).
//! - [`cloudinit`]: NoCloud / ConfigDrive / ConfigMap / Secret data volumes as ISO images.
//! - [`endpoint`]: the agent's HTTP endpoint (VMI actions, guest info, console/VNC streams).
//! - [`tls`]: the endpoint's pinned self-signed certificate (server and API server sides).
//! - [`proxy`]: the API server side of KubeVirt's `subresources.kubevirt.io` API.
//! - [`nodestore`]: node-local volumes created, populated, grown and deleted on the node for
//!   the controllers (server routes and the controllers' client).
//! - [`blockmig`]: node-local disks in a block migration (what can be copied, the target's
//!   fresh copies, the PV's move).
//! - [`nmstate`]: NodeNetworkConfigurationPolicies applied to the node with a checkpoint and
//!   rollback, enactments, the NodeNetworkState (opt-in: `--nmstate`).
//! - [`udn`]: VMIs in namespaces that ask for a Primary user-defined network (refused).
//! - [`hostdev`]: permitted host devices found, counted on the Node, assigned to VMIs, and
//!   their device nodes granted to the VM's uid.
//! - [`resize`]: online growth of running VMIs' claim disks after their volumes grew.

pub mod blockmig;
pub mod chaincopy;
pub mod cloudinit;
pub mod containerdisk;
pub mod cpu_models;
pub mod decide;
pub mod delegated;
pub mod early_launcher;
pub mod endpoint;
pub mod error;
pub mod fencing;
pub mod hostdev;
pub mod hostpath;
pub mod isolation;
pub mod join;
pub mod launchers;
pub mod mapping;
pub mod metrics;
pub mod migration;
pub mod migresume;
pub mod migstream;
pub mod nbdpeer;
pub mod network;
pub mod nmstate;
pub mod node;
pub mod nodestore;
pub mod platform;
pub mod pod_routes;
pub mod portforward;
pub mod postcopy;
pub mod proxy;
pub mod resize;
pub mod runtime;
pub mod serverlb;
pub mod services;
pub mod tls;
pub mod udn;
pub mod udn_net;
pub mod udn_svc;
pub mod volumes;

pub use error::AgentError;
