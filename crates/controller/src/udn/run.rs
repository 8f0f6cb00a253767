//! The I/O of the user-defined network controller: watches of UDNs, CUDNs, Namespaces and
//! NADs (and the shared VMI cache) wake one pass, which runs [`super::decide`] for every
//! network and applies the plan: finalizers, NAD create/update/delete, the `NetworkCreated`
//! condition on the status subresource.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::sync::Notify;

use ferrovirt_api::network::NetworkAttachmentDefinition;
use ferrovirt_api::udn::{self, ClusterUserDefinedNetwork, UserDefinedNetwork};

use super::{CreatedCondition, NadAction, Observed, Owner, decide, selects, vmi_uses};
use crate::error::ControllerError;
use crate::runtime::resources::resource_wrapper;
use crate::runtime::stores::{Kind, Stores};
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
    /// A NetworkAttachmentDefinition usable with `kube::Api`.
    Nad(NetworkAttachmentDefinition), k8s_openapi::NamespaceResourceScope, "k8s.cni.cncf.io", "v1", "NetworkAttachmentDefinition", "network-attachment-definitions"
);

const RESYNC: Duration = Duration::from_secs(30);

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
    let mut changes = stores.changes();
    let w = wake.clone();
    let follow = async move {
        while changes.next_batch(&[Kind::Vmi]).await.is_some() {
            w.notify_one();
        }
    };
    let work = async {
        let _ = udns.wait_until_ready().await;
        let _ = cudns.wait_until_ready().await;
        let _ = nss.wait_until_ready().await;
        let _ = nads.wait_until_ready().await;
        stores.ready().await;
        loop {
            let vmis = stores.vmis.state();
            let vmis: Vec<_> = vmis.iter().map(|v| &v.0).collect();
            let all_nads = nads.state();
            let namespaces = nss.state();
            for u in udns.state() {
                let ns = u.0.metadata.namespace.clone().unwrap_or_default();
                let owner = Owner {
                    kind: "UserDefinedNetwork",
                    meta: &u.0.metadata,
                    config: u.0.spec.as_ref().and_then(|s| s.config()),
                };
                let targets = BTreeSet::from([ns]);
                let old = conditions(u.0.status.as_ref());
                if let Err(e) = reconcile(&client, &owner, &targets, &all_nads, &vmis, old).await {
                    tracing::warn!(error = %e, name = ?u.0.metadata.name, "UserDefinedNetwork reconcile failed");
                }
            }
            for c in cudns.state() {
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
                let old = conditions(c.0.status.as_ref());
                if let Err(e) = reconcile(&client, &owner, &targets, &all_nads, &vmis, old).await {
                    tracing::warn!(error = %e, name = ?c.0.metadata.name, "ClusterUserDefinedNetwork reconcile failed");
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
                    "metadata": {"labels": nad.metadata.labels, "finalizers": finalizers},
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
