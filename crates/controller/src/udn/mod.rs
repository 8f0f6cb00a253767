//! The user-defined network controller (OVN-Kubernetes' UDN/CUDN controller, k8s.ovn.org/v1):
//! for each UserDefinedNetwork its NetworkAttachmentDefinition in its namespace, for each
//! ClusterUserDefinedNetwork one in every namespace its selector picks (following namespace
//! label changes), each with OVN-K's label, finalizer, owner reference and CNI config; the
//! `NetworkCreated` condition; deletion held back while a VMI uses the network. The decisions
//! here are pure ([`decide`]); [`run`] applies them.

pub mod ipam;
pub mod run;
#[cfg(test)]
mod tests;

pub use run::run;

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde_json::{Value, json};

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_api::network::{NetworkAttachmentDefinition, NetworkAttachmentDefinitionSpec};
use ferrovirt_api::udn::{self, NetworkConfig, Role, reason};

/// Component name on Events.
pub const COMPONENT: &str = "user-defined-network-controller";

/// The network object a NAD is made for, whichever kind.
#[derive(Debug, Clone, Copy)]
pub struct Owner<'a> {
    /// `UserDefinedNetwork` or `ClusterUserDefinedNetwork`.
    pub kind: &'static str,
    pub meta: &'a ObjectMeta,
    /// None when topology and its configuration do not match (admission refuses that).
    pub config: Option<NetworkConfig<'a>>,
}

impl Owner<'_> {
    fn is_cluster(&self) -> bool {
        self.kind == "ClusterUserDefinedNetwork"
    }
    fn name(&self) -> &str {
        self.meta.name.as_deref().unwrap_or_default()
    }
    fn deleting(&self) -> bool {
        self.meta.deletion_timestamp.is_some()
    }
    fn has_finalizer(&self) -> bool {
        self.meta
            .finalizers
            .iter()
            .flatten()
            .any(|f| f == udn::FINALIZER)
    }
    /// The VNI the controller gave the network ([`udn::VNI_ANNOTATION`]), once it has one.
    pub fn vni(&self) -> Option<u32> {
        self.meta
            .annotations
            .as_ref()?
            .get(udn::VNI_ANNOTATION)?
            .parse()
            .ok()
    }
    /// Whether the network needs a VNI (every topology but Localnet, which uses a host bridge).
    pub fn needs_vni(&self) -> bool {
        self.config
            .is_some_and(|c| !matches!(c, NetworkConfig::Localnet(_)))
    }
    /// The network name in the NAD config: `<namespace>_<name>` for a UDN,
    /// `cluster_udn_<name>` for a CUDN.
    pub fn network_name(&self) -> String {
        if self.is_cluster() {
            format!("cluster_udn_{}", self.name())
        } else {
            format!(
                "{}_{}",
                self.meta.namespace.as_deref().unwrap_or_default(),
                self.name()
            )
        }
    }
    fn owner_reference(&self) -> OwnerReference {
        OwnerReference {
            api_version: format!("{}/{}", udn::GROUP, udn::VERSION),
            kind: self.kind.into(),
            name: self.name().into(),
            uid: self.meta.uid.clone().unwrap_or_default(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }
    }
    fn owns(&self, nad: &NetworkAttachmentDefinition) -> bool {
        let uid = self.meta.uid.as_deref();
        nad.metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.kind == self.kind && Some(o.uid.as_str()) == uid)
    }
}

/// The CNI configuration (JSON) of the NAD `nad_ns/nad_name` for a network, as OVN-K writes it.
pub fn nad_config(network_name: &str, nad_ns: &str, nad_name: &str, cfg: NetworkConfig) -> String {
    let mut c = json!({
        "cniVersion": "1.0.0",
        "type": udn::CNI_TYPE,
        "name": network_name,
        "netAttachDefName": format!("{nad_ns}/{nad_name}"),
        "topology": cfg.topology_name(),
        "role": match cfg.role() {
            Some(Role::Primary) => "primary",
            _ => "secondary",
        },
    });
    let subnets = cfg.subnets();
    if !subnets.is_empty() {
        c["subnets"] = subnets.join(",").into();
    }
    if let Some(mtu) = cfg.mtu() {
        c["mtu"] = mtu.into();
    }
    if cfg.persistent_ips() {
        c["allowPersistentIPs"] = true.into();
    }
    match cfg {
        NetworkConfig::Layer2(l2) => {
            if let Some(j) = &l2.join_subnets {
                c["joinSubnet"] = j.join(",").into();
            }
        }
        NetworkConfig::Layer3(l3) => {
            if let Some(j) = &l3.join_subnets {
                c["joinSubnet"] = j.join(",").into();
            }
        }
        NetworkConfig::Localnet(ln) => {
            if let Some(p) = &ln.physical_network_name {
                c["physicalNetworkName"] = p.as_str().into();
            }
            if let Some(x) = &ln.exclude_subnets {
                c["excludeSubnets"] = x.join(",").into();
            }
            if let Some(id) = ln.vlan.as_ref().and_then(|v| v.access.as_ref()?.id) {
                c["vlanID"] = id.into();
            }
        }
    }
    c.to_string()
}

/// The NAD a network wants in `namespace` (named after the network object).
pub fn desired_nad(
    owner: &Owner,
    cfg: NetworkConfig,
    namespace: &str,
) -> NetworkAttachmentDefinition {
    let name = owner.name().to_string();
    NetworkAttachmentDefinition {
        api_version: Some("k8s.cni.cncf.io/v1".into()),
        kind: Some("NetworkAttachmentDefinition".into()),
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([(
                udn::NAD_LABEL.to_string(),
                String::new(),
            )])),
            annotations: owner
                .vni()
                .map(|v| BTreeMap::from([(udn::VNI_ANNOTATION.to_string(), v.to_string())])),
            finalizers: Some(vec![udn::FINALIZER.into()]),
            owner_references: Some(vec![owner.owner_reference()]),
            ..ObjectMeta::default()
        },
        spec: Some(NetworkAttachmentDefinitionSpec {
            config: Some(nad_config(&owner.network_name(), namespace, &name, cfg)),
        }),
    }
}

/// Whether a VMI uses the NAD `ns/name` of a network with `role`: a Primary network is used by
/// every VMI of its namespace on the pod network (stated, or by default with no networks), a
/// Secondary one by a VMI naming it as a Multus network.
pub fn vmi_uses(vmi: &VirtualMachineInstance, ns: &str, name: &str, role: Option<Role>) -> bool {
    if vmi.metadata.namespace.as_deref() != Some(ns) {
        return false;
    }
    let nets = vmi.spec.as_ref().and_then(|s| s.networks.as_ref());
    if role == Some(Role::Primary) {
        return nets.is_none_or(|n| n.iter().any(|n| n.pod.is_some()));
    }
    let qualified = format!("{ns}/{name}");
    nets.into_iter()
        .flatten()
        .filter_map(|n| n.multus.as_ref())
        .any(|m| m.network_name == name || m.network_name == qualified)
}

/// What to do with one NAD.
#[derive(Debug, Clone, PartialEq)]
pub enum NadAction {
    Create(NetworkAttachmentDefinition),
    /// Write the desired labels, finalizer, owner and config over the existing NAD.
    Update(NetworkAttachmentDefinition),
    /// Drop the NAD's finalizer and delete it.
    Delete {
        namespace: String,
        name: String,
    },
}

/// The `NetworkCreated` condition to report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreatedCondition {
    pub status: bool,
    pub reason: &'static str,
    pub message: String,
}

/// One reconcile's decision for a UDN or CUDN.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub add_finalizer: bool,
    pub remove_finalizer: bool,
    pub nads: Vec<NadAction>,
    /// None while the object is being removed with nothing to report.
    pub condition: Option<CreatedCondition>,
}

/// What the controller sees of one network's NADs.
#[derive(Debug, Default)]
pub struct Observed<'a> {
    /// Existing NADs named after the network, by namespace.
    pub nads: BTreeMap<String, &'a NetworkAttachmentDefinition>,
    /// The VMIs using the network's NAD, by namespace (`ns/name`).
    pub users: BTreeMap<String, Vec<String>>,
}

/// Decide one UDN or CUDN: `targets` are the namespaces it should have a NAD in (a UDN's own
/// namespace; a CUDN's selected namespaces), none while it is being deleted.
pub fn decide(owner: &Owner, targets: &BTreeSet<String>, seen: &Observed) -> Plan {
    let mut plan = Plan {
        add_finalizer: false,
        remove_finalizer: false,
        nads: Vec::new(),
        condition: None,
    };
    let deleting = owner.deleting();
    if !deleting && !owner.has_finalizer() {
        plan.add_finalizer = true;
    }
    let mut errors = Vec::new();
    let mut created = Vec::new();
    // Create or correct the NAD in each target namespace.
    if !deleting {
        let Some(cfg) = owner.config else {
            plan.condition = Some(CreatedCondition {
                status: false,
                reason: sync_error(owner),
                message: "the topology and its configuration do not match".into(),
            });
            return plan;
        };
        for ns in targets {
            let want = desired_nad(owner, cfg, ns);
            match seen.nads.get(ns) {
                None => plan.nads.push(NadAction::Create(want)),
                Some(have) if !owner.owns(have) => errors.push(format!(
                    "foreign NetworkAttachmentDefinition with the desired name already exist [{ns}/{}]",
                    owner.name()
                )),
                Some(have) => {
                    if !nad_matches(have, &want) {
                        plan.nads.push(NadAction::Update(want));
                    }
                }
            }
            if !errors.iter().any(|e| e.contains(&format!("[{ns}/"))) {
                created.push(ns.clone());
            }
        }
    }
    // Remove owned NADs no longer wanted, unless a VMI uses them.
    let mut kept = false;
    for (ns, nad) in &seen.nads {
        if targets.contains(ns) && !deleting || !owner.owns(nad) {
            continue;
        }
        match seen.users.get(ns).filter(|u| !u.is_empty()) {
            Some(users) => {
                kept = true;
                errors.push(format!(
                    "failed to delete NetworkAttachmentDefinition [{ns}/{}]: network in use by the following VMIs: [{}]",
                    owner.name(),
                    users.join(", ")
                ));
            }
            None => plan.nads.push(NadAction::Delete {
                namespace: ns.clone(),
                name: owner.name().into(),
            }),
        }
    }
    if deleting && !kept && owner.has_finalizer() {
        plan.remove_finalizer = true;
    }
    plan.condition = if !errors.is_empty() {
        Some(CreatedCondition {
            status: false,
            reason: sync_error(owner),
            message: errors.join("; "),
        })
    } else if deleting {
        None
    } else if owner.is_cluster() {
        Some(CreatedCondition {
            status: true,
            reason: reason::NAD_CREATED,
            message: format!(
                "NetworkAttachmentDefinition has been created in following namespaces: [{}]",
                created.join(", ")
            ),
        })
    } else {
        Some(CreatedCondition {
            status: true,
            reason: reason::NAD_CREATED,
            message: "NetworkAttachmentDefinition has been created".into(),
        })
    };
    plan
}

fn sync_error(owner: &Owner) -> &'static str {
    if owner.is_cluster() {
        reason::NAD_SYNC_ERROR_CUDN
    } else {
        reason::NAD_SYNC_ERROR
    }
}

/// Whether an existing NAD already has what the desired one sets.
fn nad_matches(have: &NetworkAttachmentDefinition, want: &NetworkAttachmentDefinition) -> bool {
    let has_label = have
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(udn::NAD_LABEL));
    let has_finalizer = have
        .metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == udn::FINALIZER);
    let config = |n: &NetworkAttachmentDefinition| {
        n.spec
            .as_ref()
            .and_then(|s| s.config.as_deref())
            .and_then(|c| serde_json::from_str::<Value>(c).ok())
    };
    let vni = |n: &NetworkAttachmentDefinition| {
        n.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(udn::VNI_ANNOTATION).cloned())
    };
    has_label && has_finalizer && config(have) == config(want) && vni(have) == vni(want)
}

/// Whether a namespace's labels match a label selector (matchLabels and matchExpressions).
pub fn selects(
    sel: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    labels: &BTreeMap<String, String>,
) -> bool {
    let labels_ok = sel
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let exprs_ok = sel.match_expressions.iter().flatten().all(|e| {
        let vals = e.values.as_deref().unwrap_or_default();
        let have = labels.get(&e.key);
        match e.operator.as_str() {
            "In" => have.is_some_and(|h| vals.contains(h)),
            "NotIn" => have.is_none_or(|h| !vals.contains(h)),
            "Exists" => have.is_some(),
            "DoesNotExist" => have.is_none(),
            _ => false,
        }
    });
    labels_ok && exprs_ok
}
