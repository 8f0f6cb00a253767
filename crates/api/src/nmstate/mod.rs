//! nmstate.io host network configuration, as kubernetes-nmstate publishes it:
//! NodeNetworkConfigurationPolicy (`nncp`, v1, cluster-scoped: `nodeSelector`, `desiredState`,
//! `maxUnavailable`), NodeNetworkConfigurationEnactment (`nnce`, v1beta1, one per node and
//! policy, named `<node>.<policy>`) and NodeNetworkState (`nns`, v1beta1, one per node, named
//! after it). Types, resource-table entries with the published printer columns, condition types
//! and reasons, the typed subset of nmstate's desired state ferrovirt carries out ([`state`])
//! and admission ([`validate`]).

pub mod state;
pub mod validate;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::Value;

pub use validate::admit;

use crate::registry::{ALL_VERBS, PrinterColumn, ResourceDef};

/// The API group.
pub const GROUP: &str = "nmstate.io";
/// The version NodeNetworkConfigurationPolicy is served in.
pub const POLICY_VERSION: &str = "v1";
/// The version NodeNetworkConfigurationEnactment and NodeNetworkState are served in.
pub const STATE_VERSION: &str = "v1beta1";
/// Label on an enactment naming its policy.
pub const ENACTMENT_POLICY_LABEL: &str = "nmstate.io/policy";
/// Label on an enactment naming its node.
pub const ENACTMENT_NODE_LABEL: &str = "nmstate.io/node";
/// maxUnavailable when the policy does not say (nmstate's default).
pub const DEFAULT_MAX_UNAVAILABLE: &str = "50%";

/// Condition types.
pub mod condition {
    pub const AVAILABLE: &str = "Available";
    pub const DEGRADED: &str = "Degraded";
    pub const PROGRESSING: &str = "Progressing";
    pub const FAILING: &str = "Failing";
    pub const PENDING: &str = "Pending";
    pub const ABORTED: &str = "Aborted";
}

/// Condition reasons.
pub mod reason {
    pub const SUCCESSFULLY_CONFIGURED: &str = "SuccessfullyConfigured";
    pub const FAILED_TO_CONFIGURE: &str = "FailedToConfigure";
    pub const CONFIGURATION_PROGRESSING: &str = "ConfigurationProgressing";
    pub const MAX_UNAVAILABLE_LIMIT_REACHED: &str = "MaxUnavailableLimitReached";
    pub const CONFIGURATION_ABORTED: &str = "ConfigurationAborted";
    pub const NO_MATCHING_NODE: &str = "NoMatchingNode";
}

/// The enactment of `policy` on `node`: `<node>.<policy>`, as nmstate names it.
pub fn enactment_name(node: &str, policy: &str) -> String {
    format!("{node}.{policy}")
}

kstruct! {
    /// A condition as nmstate writes them (with `lastHeartbeatTime`, no `observedGeneration`).
    pub struct NmstateCondition {
        /// Available, Degraded, Progressing (policy); Available, Failing, Progressing,
        /// Pending, Aborted (enactment).
        #[serde(rename = "type")]
        pub type_: String,
        /// "True", "False" or "Unknown".
        pub status: String,
        /// One of [`reason`].
        pub reason: Option<String>,
        /// What happened, for people.
        pub message: Option<String>,
        /// When the condition was last written.
        pub last_heartbeat_time: Option<String>,
        /// When the status last changed.
        pub last_transition_time: Option<String>,
    }
}

resource! {
    /// Desired host network configuration for the nodes a selector picks (nmstate.io/v1).
    NodeNetworkConfigurationPolicy, NodeNetworkConfigurationPolicySpec, NodeNetworkConfigurationPolicyStatus
}

kstruct! {
    /// What a policy asks for.
    pub struct NodeNetworkConfigurationPolicySpec {
        /// Labels a Node must carry for the policy to apply to it (all nodes when empty).
        pub node_selector: Option<BTreeMap<String, String>>,
        /// nmstate's capture expressions: refused (not carried out).
        pub capture: Option<Value>,
        /// The desired network state (the subset in [`state::DesiredState`]).
        pub desired_state: Option<Value>,
        /// Templated desired state: refused (not carried out).
        pub desired_state_template: Option<Value>,
        /// How many matching nodes may apply the policy at once: a number or a percentage
        /// (default 50%).
        pub max_unavailable: Option<IntOrString>,
    }
}

kstruct! {
    /// The policy's aggregate over its enactments.
    pub struct NodeNetworkConfigurationPolicyStatus {
        /// Available, Degraded, Progressing.
        pub conditions: Option<Vec<NmstateCondition>>,
        /// Nodes currently applying the policy.
        pub unavailable_node_count: Option<i64>,
        /// When `unavailableNodeCount` was last written.
        pub last_unavailable_node_count_update: Option<String>,
    }
}

kstruct! {
    /// The execution of one policy on one node (nmstate.io/v1beta1), written by the node's agent.
    pub struct NodeNetworkConfigurationEnactment {
        /// `nmstate.io/v1beta1`.
        pub api_version: Option<String>,
        /// `NodeNetworkConfigurationEnactment`.
        pub kind: Option<String>,
        /// Name `<node>.<policy>`, labels [`ENACTMENT_NODE_LABEL`] and [`ENACTMENT_POLICY_LABEL`].
        #[serde(default)]
        pub metadata: ObjectMeta,
        /// The enactment's state.
        pub status: Option<NodeNetworkConfigurationEnactmentStatus>,
    }
}

kstruct! {
    /// State of one policy on one node.
    pub struct NodeNetworkConfigurationEnactmentStatus {
        /// The desired state rendered for the node (the policy's, as applied).
        pub desired_state: Option<Value>,
        /// The policy generation the conditions belong to.
        pub policy_generation: Option<i64>,
        /// Available, Failing, Progressing, Pending, Aborted.
        pub conditions: Option<Vec<NmstateCondition>>,
    }
}

kstruct! {
    /// The current network state of one node (nmstate.io/v1beta1), named after the node.
    pub struct NodeNetworkState {
        /// `nmstate.io/v1beta1`.
        pub api_version: Option<String>,
        /// `NodeNetworkState`.
        pub kind: Option<String>,
        /// Named after the node; owned by the Node.
        #[serde(default)]
        pub metadata: ObjectMeta,
        /// The node's state.
        pub status: Option<NodeNetworkStateStatus>,
    }
}

kstruct! {
    /// What the node's agent last read.
    pub struct NodeNetworkStateStatus {
        /// Interfaces, routes, dns-resolver, ovn bridge-mappings (nmstate's shape).
        pub current_state: Option<Value>,
        /// When the agent last read the state successfully.
        pub last_successful_update_time: Option<String>,
        /// Available / Failing.
        pub conditions: Option<Vec<NmstateCondition>>,
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

#[allow(clippy::too_many_arguments)]
fn def(
    version: &'static str,
    kind: &'static str,
    list_kind: &'static str,
    plural: &'static str,
    singular: &'static str,
    short_names: &'static [&'static str],
    printer_columns: Vec<PrinterColumn>,
) -> ResourceDef {
    ResourceDef {
        group: GROUP,
        version,
        kind,
        list_kind,
        plural,
        singular,
        namespaced: false,
        short_names,
        categories: &[],
        has_status: true,
        verbs: ALL_VERBS,
        printer_columns,
    }
}

const TRUE_TYPE: &str = ".status.conditions[?(@.status==\"True\")].type";
const TRUE_REASON: &str = ".status.conditions[?(@.status==\"True\")].reason";
const TRUE_SINCE: &str = ".status.conditions[?(@.status==\"True\")].lastTransitionTime";

/// The group's entries of the resource table (kubernetes-nmstate's printer columns; the
/// table adds Age to every kind, so NodeNetworkState lists no column of its own).
pub fn resources() -> Vec<ResourceDef> {
    vec![
        def(
            POLICY_VERSION,
            "NodeNetworkConfigurationPolicy",
            "NodeNetworkConfigurationPolicyList",
            "nodenetworkconfigurationpolicies",
            "nodenetworkconfigurationpolicy",
            &["nncp"],
            vec![
                col("Status", "string", TRUE_TYPE),
                col("Reason", "string", TRUE_REASON),
            ],
        ),
        def(
            STATE_VERSION,
            "NodeNetworkConfigurationEnactment",
            "NodeNetworkConfigurationEnactmentList",
            "nodenetworkconfigurationenactments",
            "nodenetworkconfigurationenactment",
            &["nnce"],
            vec![
                col("Status", "string", TRUE_TYPE),
                col("Status Age", "date", TRUE_SINCE),
                col("Reason", "string", TRUE_REASON),
            ],
        ),
        def(
            STATE_VERSION,
            "NodeNetworkState",
            "NodeNetworkStateList",
            "nodenetworkstates",
            "nodenetworkstate",
            &["nns"],
            Vec::new(),
        ),
    ]
}

/// The OpenAPI schema of one of the group's kinds.
pub fn schema(kind: &str) -> Option<Value> {
    use crate::schema::schema_of;
    Some(match kind {
        "NodeNetworkConfigurationPolicy" => schema_of::<NodeNetworkConfigurationPolicy>(),
        "NodeNetworkConfigurationEnactment" => schema_of::<NodeNetworkConfigurationEnactment>(),
        "NodeNetworkState" => schema_of::<NodeNetworkState>(),
        _ => return None,
    })
}

/// The number of nodes that may apply a policy at once among `matching` nodes: an integer as
/// is, a percentage rounded up (nmstate's rounding), never less than 1.
pub fn max_unavailable(value: Option<&IntOrString>, matching: usize) -> Result<usize, String> {
    let n = match value {
        None => percent_of("50%", matching)?,
        Some(IntOrString::Int(i)) if *i >= 1 => *i as usize,
        Some(IntOrString::Int(i)) => return Err(format!("{i} must be at least 1")),
        Some(IntOrString::String(s)) => percent_of(s, matching)?,
    };
    Ok(n.max(1))
}

fn percent_of(s: &str, matching: usize) -> Result<usize, String> {
    let p: usize = s
        .strip_suffix('%')
        .and_then(|d| d.parse().ok())
        .filter(|p| (1..=100).contains(p))
        .ok_or_else(|| format!("{s:?} must be an integer or a percentage 1%..100%"))?;
    Ok((matching * p).div_ceil(100))
}
