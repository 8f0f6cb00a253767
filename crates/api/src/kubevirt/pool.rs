//! VirtualMachinePool (pool.kubevirt.io/v1beta1): a set of VirtualMachines stamped from one
//! template, named `<pool>-<index>`, scaled through `spec.replicas` (and the `/scale`
//! subresource).

use k8s_openapi::api::core::v1::NodeSelectorRequirement;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::vm::VirtualMachineSpec;
use super::vmi::Condition;

/// The pool API group.
pub const POOL_GROUP: &str = "pool.kubevirt.io";
/// Its served version.
pub const POOL_VERSION: &str = "v1beta1";
/// The label every VM (and VMI template) of a pool carries, naming the pool.
pub const POOL_LABEL: &str = "kubevirt.io/vmpool";

resource! {
    /// A pool of identical VirtualMachines.
    VirtualMachinePool, VirtualMachinePoolSpec, VirtualMachinePoolStatus
}

kstruct! {
    /// How many VMs, from which template, and how the pool changes them.
    pub struct VirtualMachinePoolSpec {
        /// Desired VMs; defaults to 1.
        pub replicas: Option<i32>,
        /// Must select the template's labels.
        pub selector: Option<LabelSelector>,
        pub virtual_machine_template: Option<VirtualMachineTemplateSpec>,
        /// A paused pool is not reconciled (VMs are neither created nor deleted).
        pub paused: Option<bool>,
        pub name_generation: Option<VirtualMachinePoolNameGeneration>,
        /// VMs that may be unavailable at once during an automated update.
        pub max_unavailable: Option<IntOrString>,
        pub scale_in_strategy: Option<VirtualMachinePoolScaleInStrategy>,
        pub update_strategy: Option<VirtualMachinePoolUpdateStrategy>,
        pub autohealing: Option<VirtualMachinePoolAutohealingStrategy>,
    }
}

kstruct! {
    /// The VM each replica is made from.
    pub struct VirtualMachineTemplateSpec {
        pub metadata: Option<ObjectMeta>,
        pub spec: Option<VirtualMachineSpec>,
    }
}

kstruct! {
    /// Per-replica names for referenced ConfigMaps and Secrets (`<name>-<index>`).
    pub struct VirtualMachinePoolNameGeneration {
        pub append_index_to_config_map_refs: Option<bool>,
        pub append_index_to_secret_refs: Option<bool>,
    }
}

kstruct! {
    /// How the pool scales in.
    pub struct VirtualMachinePoolScaleInStrategy {
        pub unmanaged: Option<super::misc::FreeForm>,
        pub opportunistic: Option<VirtualMachinePoolOpportunisticScaleInStrategy>,
        pub proactive: Option<VirtualMachinePoolProactiveScaleInStrategy>,
    }
}

kstruct! {
    /// Scale in only as VMs go away by other means.
    pub struct VirtualMachinePoolOpportunisticScaleInStrategy {
        /// `Disabled`, `Offline` or `Online`.
        pub state_preservation: Option<String>,
    }
}

kstruct! {
    /// Scale in by deleting VMs.
    pub struct VirtualMachinePoolProactiveScaleInStrategy {
        pub selection_policy: Option<VirtualMachinePoolSelectionPolicy>,
        /// `Disabled`, `Offline` or `Online`.
        pub state_preservation: Option<String>,
    }
}

kstruct! {
    /// Which VMs go first.
    pub struct VirtualMachinePoolSelectionPolicy {
        /// `AscendingOrder`, `DescendingOrder`, `Newest`, `Oldest` or `Random`.
        pub sort_policy: Option<String>,
        pub selectors: Option<VirtualMachinePoolSelectors>,
    }
}

kstruct! {
    /// VMs preferred by a selection policy.
    pub struct VirtualMachinePoolSelectors {
        pub label_selector: Option<LabelSelector>,
        pub node_selector_requirement_matcher: Option<Vec<NodeSelectorRequirement>>,
    }
}

kstruct! {
    /// How template changes reach the VMs.
    pub struct VirtualMachinePoolUpdateStrategy {
        pub unmanaged: Option<super::misc::FreeForm>,
        pub opportunistic: Option<super::misc::FreeForm>,
        pub proactive: Option<VirtualMachinePoolProactiveUpdateStrategy>,
    }
}

kstruct! {
    /// Update by restarting VMs.
    pub struct VirtualMachinePoolProactiveUpdateStrategy {
        pub selection_policy: Option<VirtualMachinePoolSelectionPolicy>,
    }
}

kstruct! {
    /// When a failing VM is replaced.
    pub struct VirtualMachinePoolAutohealingStrategy {
        pub start_up_failure_threshold: Option<u32>,
        pub min_failing_to_start_duration: Option<String>,
    }
}

kstruct! {
    /// Observed replicas.
    pub struct VirtualMachinePoolStatus {
        pub replicas: Option<i32>,
        pub ready_replicas: Option<i32>,
        pub conditions: Option<Vec<Condition>>,
        /// The selector in its string form, for the `/scale` subresource.
        pub label_selector: Option<String>,
    }
}
