//! **Benchmark harness only** (issue #15, `bench/scale`): simulated node agents and the scale
//! benchmark driver. Nothing here runs QEMU and nothing here is used by the end-to-end tests of
//! behaviour, which always run the real agent and real guests; this crate exists so that one
//! process can stand in for 100 nodes the way KubeVirt's kwok-based density runs do.
//!
//! A simulated node ([`sim`]) does what the real agent does against the API server: registers
//! its Node (the agent's own [`ferrovirt_agent::node::node_object`]), renews its Lease every few
//! seconds with one PUT, patches its Node status every 10 s, watches only the VMIs bound to it
//! through the agent's field selector ([`ferrovirt_agent::runtime::vmi_selector`]) with a kube-rs
//! reflector, and runs every bound VMI through the agent's pure decision
//! ([`ferrovirt_agent::decide::decide`]) with a pretend launcher in place of a real one: the
//! finalizer, the `Started` and phase Events, the Running status with its conditions and the pid
//! annotations are the requests the real agent makes for a VMI that starts.
//!
//! [`bench`] drives a server through the figures the issue asks for ([`backlog`]: the
//! scheduler's own rate with work queued); [`stats`] and
//! [`procstat`] are the pure parts (percentiles, /proc parsing) with unit tests; [`requests`]
//! (API requests by component, verb and resource per VMI) is testkit's, shared with the
//! request-count test.

pub mod backlog;
pub mod bench;
pub mod procstat;
pub use ferrovirt_testkit::requests;
pub mod sim;
pub mod stats;
