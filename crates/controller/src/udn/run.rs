//! The I/O of the user-defined network controller: watches of UDNs, CUDNs, Namespaces and
//! NADs (and the shared VMI cache) wake one pass, which runs [`super::decide`] for every
//! network and applies the plan: finalizers, NAD create/update/delete, the `NetworkCreated`
//! condition on the status subresource.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::sync::Notify;

use ferrovirt_api::network::{IPAMClaim, NetworkAttachmentDefinition};
use ferrovirt_api::udn::{self, ClusterUserDefinedNetwork, UserDefinedNetwork};

use super::ipam::{self, Action};
use super::{CreatedCondition, NadAction, Observed, Owner, decide, selects, vmi_uses};
use crate::error::ControllerError;
use crate::runtime::events::{EventRecorder, object_ref};
use crate::runtime::resources::resource_wrapper;
use crate::runtime::stores::{Changed, Kind, Stores};
use crate::runtime::watched::watched_store;

resource_wrapper!(
    /// A UserDefinedNetwork usable with `kube::Api`.
    Udn(UserDefinedNetwork), k8s_openapi::NamespaceResourceScope, udn::GROUP, udn::VERSION, "UserDefinedNetwork", "userdefinednetworks"
);
resource_wrapper!(
    /// A ClusterUserDefinedNetwork usable with `kube::Api`.
    Cudn(ClusterUserDefinedNetwork), k8s_openapi::ClusterResourceScope, udn::GROUP, udn::VERSION, "ClusterUserDefinedNetwork", "clusteruserdefinednetworks"
);
resource_wrapper!(
    /// An IPAMClaim usable with `kube::Api`.
    Claim(IPAMClaim), k8s_openapi::NamespaceResourceScope, "k8s.cni.cncf.io", "v1alpha1", "IPAMClaim", "ipamclaims"
);
resource_wrapper!(
    /// A NetworkAttachmentDefinition usable with `kube::Api`.
    Nad(NetworkAttachmentDefinition), k8s_openapi::NamespaceResourceScope, "k8s.cni.cncf.io", "v1", "NetworkAttachmentDefinition", "network-attachment-definitions"
);

const RESYNC: Duration = Duration::from_secs(30);

/// Which changes of the shared caches wake the loop (bits over [`Kind::Vmi`] and
/// [`Kind::Node`]): with no network nothing of a VMI is decided, and Node changes matter only
/// to Layer3 networks' host subnets. Network, namespace, NAD and claim changes always wake it.
struct Interest;

impl Interest {
    const VMIS: u8 = 1;
    const NODES: u8 = 2;
    const ALL: u8 = Self::VMIS | Self::NODES;

    /// `any`: a UDN or CUDN exists (its users, which hold its deletion, are VMIs);
    /// `networks`: those that allocate addresses.
    fn of(any: bool, networks: &[ipam::Network]) -> u8 {
        match (any, networks.iter().any(|n| n.layer3())) {
            (false, _) => 0,
            (true, false) => Self::VMIS,
            (true, true) => Self::ALL,
        }
    }

    fn wakes(interest: u8, c: &Changed) -> bool {
        (interest & Self::VMIS != 0 && c.contains(Kind::Vmi))
            || (interest & Self::NODES != 0 && c.contains(Kind::Node))
    }
}

/// Runs the controller until one of its watches ends.
pub async fn run(client: kube::Client, stores: Stores) -> Result<(), ControllerError> {
    let wake = Arc::new(Notify::new());
    let notify = |w: &Arc<Notify>| {
        let w = w.clone();
        move || w.notify_one()
    };
    let (udns, p1) = watched_store(Api::<Udn>::all(client.clone()), "udn", notify(&wake));
    let (cudns, p2) = watched_store(Api::<Cudn>::all(client.clone()), "cudn", notify(&wake));
    let (nss, p3) = watched_store(
        Api::<Namespace>::all(client.clone()),
        "udn: namespace",
        notify(&wake),
    );
    let (nads, p4) = watched_store(Api::<Nad>::all(client.clone()), "udn: nad", notify(&wake));
    let (claims, p5) = watched_store(
        Api::<Claim>::all(client.clone()),
        "udn: ipamclaim",
        notify(&wake),
    );
    let recorder = EventRecorder::new(client.clone(), super::COMPONENT);
    let mut recent: Recent = BTreeMap::new();
    let mut recent_nodes: BTreeMap<String, (Option<String>, ipam::NodeSubnets)> = BTreeMap::new();
    let mut changes = stores.changes();
    let w = wake.clone();
    // Which cached kinds wake a pass (`Interest`), decided by the last pass: VMI changes
    // matter only while a network exists, Node changes only while a Layer3 one does.
    let interest = Arc::new(AtomicU8::new(Interest::ALL));
    let heed = interest.clone();
    let follow = async move {
        while let Some(c) = changes.next_batch(&[Kind::Vmi, Kind::Node]).await {
            if Interest::wakes(heed.load(Ordering::Relaxed), &c) {
                w.notify_one();
            }
        }
    };
    let work = async {
        let _ = udns.wait_until_ready().await;
        let _ = cudns.wait_until_ready().await;
        let _ = nss.wait_until_ready().await;
        let _ = nads.wait_until_ready().await;
        let _ = claims.wait_until_ready().await;
        stores.ready().await;
        loop {
            let vmis = stores.vmis.state();
            let vmis: Vec<_> = vmis.iter().map(|v| &v.0).collect();
            let all_nads = nads.state();
            let namespaces = nss.state();
            let (udn_list, cudn_list) = (udns.state(), cudns.state());
            let mut vnis: BTreeSet<u32> = udn_list
                .iter()
                .map(|u| &u.0.metadata)
                .chain(cudn_list.iter().map(|c| &c.0.metadata))
                .filter_map(|m| {
                    m.annotations
                        .as_ref()?
                        .get(udn::VNI_ANNOTATION)?
                        .parse()
                        .ok()
                })
                .collect();
            let mut networks = Vec::new();
            // Every network that exists, by its NAD network name (Layer3 node subnets of
            // networks not in here are dropped).
            let mut known = BTreeSet::new();
            for u in &udn_list {
                let ns = u.0.metadata.namespace.clone().unwrap_or_default();
                let owner = Owner {
                    kind: "UserDefinedNetwork",
                    meta: &u.0.metadata,
                    config: u.0.spec.as_ref().and_then(|s| s.config()),
                };
                known.insert(owner.network_name());
                let targets = BTreeSet::from([ns]);
                if !ensure_vni(&client, &owner, &mut vnis).await {
                    continue;
                }
                networks.extend(ipam_network(&owner, &targets));
                let old = conditions(u.0.status.as_ref());
                if let Err(e) = reconcile(&client, &owner, &targets, &all_nads, &vmis, old).await {
                    tracing::warn!(error = %e, name = ?u.0.metadata.name, "UserDefinedNetwork reconcile failed");
                }
            }
            for c in &cudn_list {
                let owner = Owner {
                    kind: "ClusterUserDefinedNetwork",
                    meta: &c.0.metadata,
                    config: c.0.spec.as_ref().and_then(|s| s.network.as_ref()?.config()),
                };
                let sel =
                    c.0.spec
                        .as_ref()
                        .and_then(|s| s.namespace_selector.as_ref());
                let targets: BTreeSet<String> = namespaces
                    .iter()
                    .filter(|n| n.metadata.deletion_timestamp.is_none())
                    .filter(|n| {
                        sel.is_some_and(|s| {
                            selects(s, n.metadata.labels.as_ref().unwrap_or(&BTreeMap::new()))
                        })
                    })
                    .filter_map(|n| n.metadata.name.clone())
                    .collect();
                known.insert(owner.network_name());
                if !ensure_vni(&client, &owner, &mut vnis).await {
                    continue;
                }
                networks.extend(ipam_network(&owner, &targets));
                let old = conditions(c.0.status.as_ref());
                if let Err(e) = reconcile(&client, &owner, &targets, &all_nads, &vmis, old).await {
                    tracing::warn!(error = %e, name = ?c.0.metadata.name, "ClusterUserDefinedNetwork reconcile failed");
                }
            }
            let primary: BTreeSet<String> = namespaces
                .iter()
                .filter(|n| {
                    n.metadata
                        .labels
                        .as_ref()
                        .is_some_and(|l| l.contains_key(udn::PRIMARY_NAMESPACE_LABEL))
                })
                .filter_map(|n| n.metadata.name.clone())
                .collect();
            let claim_list = claims.state();
            let claim_refs: Vec<&IPAMClaim> = claim_list.iter().map(|c| &c.0).collect();
            prune_recent(&mut recent, &vmis);
            interest.store(
                Interest::of(!udn_list.is_empty() || !cudn_list.is_empty(), &networks),
                Ordering::Relaxed,
            );
            let node_subnets =
                layer3_node_subnets(&client, &stores, &networks, &known, &mut recent_nodes).await;
            let actions = ipam::decide(ipam::Inputs {
                networks: &networks,
                primary_namespaces: &primary,
                vmis: &vmis,
                claims: &claim_refs,
                recent: &recent,
                node_subnets: &node_subnets,
            });
            for a in actions {
                if let Err(e) = apply_ipam(&client, &recorder, &mut recent, a).await {
                    tracing::warn!(error = %e, "user-defined network address allocation failed");
                }
            }
            let _ = tokio::time::timeout(RESYNC, wake.notified()).await;
        }
    };
    tokio::select! {
        _ = p1 => {}
        _ = p2 => {}
        _ = p3 => {}
        _ = p4 => {}
        _ = p5 => {}
        _ = follow => {}
        _ = work => {}
    }
    Err(ControllerError::TaskStopped {
        name: "user-defined-network",
        reason: "a watch ended".into(),
    })
}

fn conditions(status: Option<&udn::NetworkStatus>) -> &[Condition] {
    status
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default()
}

async fn reconcile(
    client: &kube::Client,
    owner: &Owner<'_>,
    targets: &BTreeSet<String>,
    all_nads: &[Arc<Nad>],
    vmis: &[&ferrovirt_api::kubevirt::vmi::VirtualMachineInstance],
    old_conditions: &[Condition],
) -> Result<(), ControllerError> {
    let name = owner.meta.name.clone().unwrap_or_default();
    let role = owner.config.and_then(|c| c.role());
    let mut seen = Observed::default();
    for n in all_nads {
        if n.0.metadata.name.as_deref() == Some(name.as_str())
            && let Some(ns) = n.0.metadata.namespace.as_deref()
            && (owner.kind == "ClusterUserDefinedNetwork"
                || owner.meta.namespace.as_deref() == Some(ns))
        {
            seen.nads.insert(ns.to_string(), &n.0);
            let users: Vec<String> = vmis
                .iter()
                .filter(|v| vmi_uses(v, ns, &name, role))
                .map(|v| format!("{ns}/{}", v.metadata.name.as_deref().unwrap_or_default()))
                .collect();
            seen.users.insert(ns.to_string(), users);
        }
    }
    let plan = decide(owner, targets, &seen);
    let pp = PatchParams::default();
    if plan.add_finalizer {
        let mut f = owner.meta.finalizers.clone().unwrap_or_default();
        f.push(udn::FINALIZER.into());
        patch_meta(client, owner, json!({"metadata": {"finalizers": f}})).await?;
    }
    for action in &plan.nads {
        match action {
            NadAction::Create(nad) => {
                let ns = nad.metadata.namespace.as_deref().unwrap_or_default();
                Api::<Nad>::namespaced(client.clone(), ns)
                    .create(&PostParams::default(), &Nad(nad.clone()))
                    .await?;
            }
            NadAction::Update(nad) => {
                let ns = nad.metadata.namespace.as_deref().unwrap_or_default();
                let n = nad.metadata.name.as_deref().unwrap_or_default();
                let mut finalizers = seen
                    .nads
                    .get(ns)
                    .and_then(|h| h.metadata.finalizers.clone())
                    .unwrap_or_default();
                if !finalizers.iter().any(|f| f == udn::FINALIZER) {
                    finalizers.push(udn::FINALIZER.into());
                }
                let body = json!({
                    "metadata": {"labels": nad.metadata.labels, "finalizers": finalizers,
                        "annotations": nad.metadata.annotations},
                    "spec": nad.spec,
                });
                Api::<Nad>::namespaced(client.clone(), ns)
                    .patch(n, &pp, &Patch::Merge(body))
                    .await?;
            }
            NadAction::Delete { namespace, name } => {
                let api = Api::<Nad>::namespaced(client.clone(), namespace);
                let rest: Vec<String> = seen
                    .nads
                    .get(namespace)
                    .and_then(|h| h.metadata.finalizers.clone())
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|f| f != udn::FINALIZER)
                    .collect();
                api.patch(
                    name,
                    &pp,
                    &Patch::Merge(json!({"metadata": {"finalizers": rest}})),
                )
                .await?;
                match api.delete(name, &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
    if let Some(cond) = &plan.condition {
        write_condition(client, owner, old_conditions, cond).await?;
    }
    if plan.remove_finalizer {
        let f: Vec<String> = owner
            .meta
            .finalizers
            .iter()
            .flatten()
            .filter(|f| *f != udn::FINALIZER)
            .cloned()
            .collect();
        patch_meta(client, owner, json!({"metadata": {"finalizers": f}})).await?;
    }
    Ok(())
}

async fn patch_meta(
    client: &kube::Client,
    owner: &Owner<'_>,
    body: serde_json::Value,
) -> Result<(), ControllerError> {
    let name = owner.meta.name.as_deref().unwrap_or_default();
    let pp = PatchParams::default();
    match owner.meta.namespace.as_deref() {
        Some(ns) if owner.kind == "UserDefinedNetwork" => {
            Api::<Udn>::namespaced(client.clone(), ns)
                .patch(name, &pp, &Patch::Merge(body))
                .await?;
        }
        _ => {
            Api::<Cudn>::all(client.clone())
                .patch(name, &pp, &Patch::Merge(body))
                .await?;
        }
    }
    Ok(())
}

/// The owner's status conditions with `NetworkCreated` set (the transition time kept when the
/// status did not change); None when nothing would change.
pub fn with_condition(
    meta: &ObjectMeta,
    old: &[Condition],
    cond: &CreatedCondition,
    now: Time,
) -> Option<Vec<Condition>> {
    let status = if cond.status { "True" } else { "False" };
    let prev = old
        .iter()
        .find(|c| c.type_ == udn::CONDITION_NETWORK_CREATED);
    if prev.is_some_and(|p| {
        p.status == status
            && p.reason == cond.reason
            && p.message == cond.message
            && p.observed_generation == meta.generation
    }) {
        return None;
    }
    let new = Condition {
        type_: udn::CONDITION_NETWORK_CREATED.into(),
        status: status.into(),
        reason: cond.reason.into(),
        message: cond.message.clone(),
        observed_generation: meta.generation,
        last_transition_time: match prev {
            Some(p) if p.status == status => p.last_transition_time.clone(),
            _ => now,
        },
    };
    let mut out: Vec<Condition> = old
        .iter()
        .filter(|c| c.type_ != udn::CONDITION_NETWORK_CREATED)
        .cloned()
        .collect();
    out.push(new);
    Some(out)
}

/// Writes `NetworkCreated` when it differs from the cached conditions `old` (no read: the
/// watch keeps the cache, and this controller is the conditions' only writer).
async fn write_condition(
    client: &kube::Client,
    owner: &Owner<'_>,
    old: &[Condition],
    cond: &CreatedCondition,
) -> Result<(), ControllerError> {
    let name = owner.meta.name.as_deref().unwrap_or_default();
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let Some(c) = with_condition(owner.meta, old, cond, now) else {
        return Ok(());
    };
    let pp = PatchParams::default();
    let body = Patch::Merge(json!({"status": {"conditions": c}}));
    match owner.meta.namespace.as_deref() {
        Some(ns) if owner.kind == "UserDefinedNetwork" => {
            Api::<Udn>::namespaced(client.clone(), ns)
                .patch_status(name, &pp, &body)
                .await?;
        }
        _ => {
            Api::<Cudn>::all(client.clone())
                .patch_status(name, &pp, &body)
                .await?;
        }
    }
    Ok(())
}

/// Allocations written to VMIs by this controller, by (VMI uid, annotation key), kept until the
/// VMI cache shows them (or the VMI is gone).
type Recent = BTreeMap<(String, String), ferrovirt_api::udn::PodNetwork>;

fn prune_recent(
    recent: &mut Recent,
    vmis: &[&ferrovirt_api::kubevirt::vmi::VirtualMachineInstance],
) {
    recent.retain(|(uid, key), _| {
        vmis.iter()
            .find(|v| v.metadata.uid.as_deref() == Some(uid.as_str()))
            .is_some_and(|v| !udn::pod_networks(v.metadata.annotations.as_ref()).contains_key(key))
    });
}

/// The allocator's view of a network reconciled this pass (None without IPAM).
fn ipam_network(owner: &Owner<'_>, targets: &BTreeSet<String>) -> Option<ipam::Network> {
    if owner.deleting() {
        return None;
    }
    ipam::Network::from_config(
        owner.network_name(),
        owner.meta.name.clone().unwrap_or_default(),
        targets.clone(),
        owner.config?,
    )
}

/// Gives a network that needs one its VNI (compare-and-swap on the network object, so two
/// leaders never hand out one VNI twice); false when it had none yet (reconciled once the
/// watch shows the write).
async fn ensure_vni(client: &kube::Client, owner: &Owner<'_>, used: &mut BTreeSet<u32>) -> bool {
    if !owner.needs_vni() || owner.vni().is_some() || owner.deleting() {
        return true;
    }
    let vni = ipam::pick_vni(&owner.network_name(), used);
    used.insert(vni);
    let body = json!({"metadata": {"resourceVersion": owner.meta.resource_version,
        "annotations": {udn::VNI_ANNOTATION: vni.to_string()}}});
    if let Err(e) = patch_meta(client, owner, body).await {
        tracing::warn!(error = %e, name = ?owner.meta.name, "writing the network's VNI failed");
    }
    false
}

async fn apply_ipam(
    client: &kube::Client,
    recorder: &EventRecorder,
    recent: &mut Recent,
    action: Action,
) -> Result<(), ControllerError> {
    let pp = PatchParams::default();
    match action {
        Action::CreateClaim {
            namespace,
            name,
            vm_name,
            vm_uid,
            network,
            interface,
            ips,
        } => {
            let api = Api::<Claim>::namespaced(client.clone(), &namespace);
            let claim = IPAMClaim {
                api_version: Some(ferrovirt_api::network::IPAMCLAIM_API_VERSION.into()),
                kind: Some("IPAMClaim".into()),
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(namespace.clone()),
                    owner_references: Some(vec![
                        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                            api_version: "kubevirt.io/v1".into(),
                            kind: "VirtualMachine".into(),
                            name: vm_name,
                            uid: vm_uid,
                            controller: Some(false),
                            block_owner_deletion: Some(true),
                        },
                    ]),
                    ..ObjectMeta::default()
                },
                spec: Some(ferrovirt_api::network::IPAMClaimSpec {
                    network: Some(network),
                    interface: Some(interface),
                }),
                status: None,
            };
            match api.create(&PostParams::default(), &Claim(claim)).await {
                Ok(_) => {}
                // Made by an earlier pass the cache does not show yet: decided again next pass.
                Err(kube::Error::Api(s)) if s.code == 409 => return Ok(()),
                Err(e) => return Err(e.into()),
            }
            api.patch_status(&name, &pp, &Patch::Merge(json!({"status": {"ips": ips}})))
                .await?;
        }
        Action::ClaimStatus {
            namespace,
            name,
            ips,
        } => {
            Api::<Claim>::namespaced(client.clone(), &namespace)
                .patch_status(&name, &pp, &Patch::Merge(json!({"status": {"ips": ips}})))
                .await?;
        }
        Action::Annotate {
            namespace,
            name,
            uid,
            resource_version,
            value,
            added,
        } => {
            let text = serde_json::to_string(&value)?;
            let body = json!({"metadata": {"resourceVersion": resource_version,
                "annotations": {udn::POD_NETWORKS_ANNOTATION: text}}});
            let api = Api::<crate::runtime::resources::Vmi>::namespaced(client.clone(), &namespace);
            match api.patch(&name, &pp, &Patch::Merge(body)).await {
                Ok(_) => {
                    for k in added {
                        if let Some(pn) = value.get(&k) {
                            recent.insert((uid.clone(), k), pn.clone());
                        }
                    }
                }
                Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
        }
        Action::Failed {
            namespace,
            name,
            message,
        } => {
            let meta = ObjectMeta {
                name: Some(name),
                namespace: Some(namespace),
                ..ObjectMeta::default()
            };
            let r = object_ref("kubevirt.io/v1", "VirtualMachineInstance", &meta);
            recorder
                .record(&r, true, "IPAllocationFailed", &message)
                .await;
        }
    }
    Ok(())
}

/// Every node's Layer3 host subnets after this pass: the cached annotations (or this loop's
/// own writes the cache does not show yet, by the resourceVersion they were written over),
/// with [`ipam::node_subnets`]' changes written (compare-and-swap on the Node).
async fn layer3_node_subnets(
    client: &kube::Client,
    stores: &Stores,
    networks: &[ipam::Network],
    known: &BTreeSet<String>,
    recent: &mut BTreeMap<String, (Option<String>, ipam::NodeSubnets)>,
) -> BTreeMap<String, ipam::NodeSubnets> {
    let nodes = stores.nodes.state();
    let mut current = BTreeMap::new();
    let mut versions = BTreeMap::new();
    for n in &nodes {
        let Some(name) = n.metadata.name.clone() else {
            continue;
        };
        let rv = n.metadata.resource_version.clone();
        let cached: ipam::NodeSubnets = n
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(udn::NODE_SUBNETS_ANNOTATION))
            .and_then(|v| serde_json::from_str(v).ok())
            .unwrap_or_default();
        // Our own write wins while the cache still shows the version it was made over.
        let value = match recent.get(&name) {
            Some((written_over, mine)) if *written_over == rv => mine.clone(),
            _ => {
                recent.remove(&name);
                cached
            }
        };
        versions.insert(name.clone(), rv);
        current.insert(name, value);
    }
    recent.retain(|n, _| current.contains_key(n));
    if !networks.iter().any(|n| n.layer3()) && current.values().all(|m| m.is_empty()) {
        return current;
    }
    let changes = ipam::node_subnets(networks, known, &current);
    for (node, value) in changes {
        let rv = versions.get(&node).cloned().flatten();
        let text = serde_json::to_string(&value).unwrap_or_default();
        let body = json!({"metadata": {"resourceVersion": rv,
            "annotations": {udn::NODE_SUBNETS_ANNOTATION: text}}});
        match Api::<k8s_openapi::api::core::v1::Node>::all(client.clone())
            .patch(&node, &PatchParams::default(), &Patch::Merge(body))
            .await
        {
            Ok(_) => {
                recent.insert(node.clone(), (rv, value.clone()));
                current.insert(node, value);
            }
            Err(e) => {
                tracing::warn!(%node, error = %e, "writing the node's Layer3 host subnets failed")
            }
        }
    }
    current
}

#[cfg(test)]
mod interest_tests {
    use super::*;

    fn net(layer3: bool) -> ipam::Network {
        ipam::Network {
            network: "ua_net".into(),
            nad_name: "net".into(),
            namespaces: BTreeSet::from(["ua".to_string()]),
            role: ferrovirt_api::udn::Role::Primary,
            subnets: vec!["10.100.0.0/16".parse().unwrap()],
            exclude: Vec::new(),
            gateway: true,
            persistent: false,
            host_prefixes: if layer3 { vec![24] } else { Vec::new() },
        }
    }

    #[test]
    fn vmis_wake_only_while_a_network_exists_nodes_only_for_layer3() {
        assert_eq!(Interest::of(false, &[]), 0);
        assert_eq!(
            Interest::of(true, &[]),
            Interest::VMIS,
            "a network without IPAM"
        );
        assert_eq!(Interest::of(true, &[net(false)]), Interest::VMIS);
        assert_eq!(Interest::of(true, &[net(false), net(true)]), Interest::ALL);
        assert!(!Interest::wakes(0, &Changed::everything()));
        assert!(Interest::wakes(Interest::VMIS, &Changed::everything()));
        assert!(!Interest::wakes(Interest::ALL, &Changed::default()));
    }
}
