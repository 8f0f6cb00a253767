//! The node authorizer (Kubernetes' Node authorizer and NodeRestriction admission in one):
//! what a node's own credential (`system:node:<name>` in `system:nodes`, from joining,
//! [`super::join`]) may do. A node may read what its agent needs, but write only its own
//! Node (and status) and Lease, the VMIs bound to it (`status.nodeName`, the
//! `kubevirt.io/nodeName` label, or the target of a migration to it) and their status, events,
//! and the PersistentVolumes of those VMIs' claims (a block migration moves them); it may read
//! a Secret, ConfigMap, PersistentVolumeClaim or PersistentVolume only when a VMI bound to it
//! references it, and may not list or watch those kinds. It may create a ServiceAccount token
//! (TokenRequest) only bound to a VMI bound to it whose serviceAccount volume names that
//! ServiceAccount (Kubernetes' rule for Pods). For host network configuration (`--nmstate`)
//! it may write its own nmstate.io objects: the NodeNetworkState named after it, the
//! NodeNetworkConfigurationEnactments `<node>.<policy>` labelled `nmstate.io/node: <node>`,
//! and the status (never the spec) of NodeNetworkConfigurationPolicies. Anything else falls
//! to RBAC, which grants nodes nothing by default: 403 with Kubernetes' message.
//!
//! [`needs`] says which stored facts a request's decision depends on, the middleware gathers
//! them ([`gather`]), and [`decide`] is the pure decision.

use serde_json::Value;

use super::rbac::{Attributes, UserInfo};
use crate::objects::decode;
use crate::server::Shared;
use ferrovirt_api::jointoken::{NODE_USER_PREFIX, NODES_GROUP};

/// The lease namespace of node heartbeats.
pub const LEASE_NAMESPACE: &str = "kube-node-lease";

/// The node a user is, when it is a node identity.
pub fn node_of(user: &UserInfo) -> Option<&str> {
    let name = user.name.strip_prefix(NODE_USER_PREFIX)?;
    (!name.is_empty() && user.groups.iter().any(|g| g == NODES_GROUP)).then_some(name)
}

/// The node authorizer's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    /// Refused; the reason is for the server log.
    Deny(String),
    /// Not a node-scoped question: RBAC decides.
    Rbac,
}

/// What a decision needs from the store besides the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Need {
    Nothing,
    /// The `metadata.name` of the request body (a create).
    BodyName,
    /// The stored VMI the request names.
    Vmi,
    /// The VMIs of the request's namespace (a Secret, ConfigMap or claim read).
    VmisOfNamespace,
    /// The stored PV the request names, then the VMIs of its claim's namespace.
    PvAndVmis,
    /// The TokenRequest body's `boundObjectRef`, and the stored VMI it names.
    TokenBinding,
    /// The body's name and labels (creating an enactment).
    BodyMeta,
    /// The stored NodeNetworkConfigurationEnactment the request names.
    Enactment,
}

/// The label naming an enactment's node.
pub const ENACTMENT_NODE_LABEL: &str = "nmstate.io/node";
const NMSTATE_GROUP: &str = "nmstate.io";

/// The facts [`decide`] reads.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    pub body_name: Option<String>,
    /// The stored object the request names (VMI or PV).
    pub target: Option<Value>,
    /// VMIs of the namespace in question.
    pub vmis: Vec<Value>,
    /// A TokenRequest's binding: the VMI name and uid its `boundObjectRef` gives.
    pub bound: Option<super::tokens::BoundRequest>,
    /// The request body's `metadata.labels[nmstate.io/node]` (creating an enactment).
    pub body_node_label: Option<String>,
}

fn is_read(verb: &str) -> bool {
    matches!(verb, "get" | "list" | "watch")
}

fn is_write(verb: &str) -> bool {
    matches!(verb, "update" | "patch")
}

/// Which facts deciding `a` for a node needs. Pure.
pub fn needs(a: &Attributes) -> Need {
    if !a.resource_request {
        return Need::Nothing;
    }
    match (a.api_group.as_str(), a.resource.as_str(), a.verb.as_str()) {
        ("", "nodes" | "namespaces", "create") | ("coordination.k8s.io", "leases", "create") => {
            Need::BodyName
        }
        ("kubevirt.io", "virtualmachineinstances", v) if is_write(v) => Need::Vmi,
        ("", "secrets" | "configmaps" | "persistentvolumeclaims", "get") if !a.name.is_empty() => {
            Need::VmisOfNamespace
        }
        ("", "persistentvolumes", v) if (v == "get" || is_write(v)) && !a.name.is_empty() => {
            Need::PvAndVmis
        }
        ("", "serviceaccounts", "create") if a.subresource == "token" && !a.name.is_empty() => {
            Need::TokenBinding
        }
        (NMSTATE_GROUP, "nodenetworkstates", "create") => Need::BodyName,
        (NMSTATE_GROUP, "nodenetworkconfigurationenactments", "create") => Need::BodyMeta,
        (NMSTATE_GROUP, "nodenetworkconfigurationenactments", v)
            if (is_write(v) || v == "delete") && !a.name.is_empty() =>
        {
            Need::Enactment
        }
        _ => Need::Nothing,
    }
}

/// Whether `vmi` is bound to `node`: it runs there, or is migrating there.
pub fn bound_to(vmi: &Value, node: &str) -> bool {
    let s = |v: &Value| v.as_str() == Some(node);
    s(&vmi["status"]["nodeName"])
        || s(&vmi["metadata"]["labels"]["kubevirt.io/nodeName"])
        || s(&vmi["status"]["migrationState"]["targetNode"])
}

/// The kinds a VMI references by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefKind {
    Secret,
    ConfigMap,
    Claim,
    ServiceAccount,
}

/// The names of `kind` that `vmi` references (volumes, cloud-init and sysprep sources,
/// containerDisk pull secrets, access credentials). Pure.
pub fn references(vmi: &Value, kind: RefKind) -> Vec<String> {
    let mut out = Vec::new();
    let mut push = |v: &Value| {
        if let Some(s) = v.as_str().filter(|s| !s.is_empty()) {
            out.push(s.to_string());
        }
    };
    let spec = &vmi["spec"];
    for v in spec["volumes"].as_array().into_iter().flatten() {
        match kind {
            RefKind::Secret => {
                push(&v["secret"]["secretName"]);
                push(&v["containerDisk"]["imagePullSecret"]);
                push(&v["sysprep"]["secret"]["name"]);
                for ci in ["cloudInitNoCloud", "cloudInitConfigDrive"] {
                    push(&v[ci]["secretRef"]["name"]);
                    push(&v[ci]["networkDataSecretRef"]["name"]);
                }
            }
            RefKind::ConfigMap => {
                push(&v["configMap"]["name"]);
                push(&v["sysprep"]["configMap"]["name"]);
            }
            RefKind::Claim => {
                push(&v["persistentVolumeClaim"]["claimName"]);
                push(&v["dataVolume"]["name"]);
                push(&v["ephemeral"]["persistentVolumeClaim"]["claimName"]);
            }
            RefKind::ServiceAccount => push(&v["serviceAccount"]["serviceAccountName"]),
        }
    }
    if kind == RefKind::Secret {
        for c in spec["accessCredentials"].as_array().into_iter().flatten() {
            push(&c["sshPublicKey"]["source"]["secret"]["secretName"]);
            push(&c["userPassword"]["source"]["secret"]["secretName"]);
        }
    }
    out
}

fn referenced_by_node(vmis: &[Value], node: &str, kind: RefKind, name: &str) -> bool {
    vmis.iter()
        .filter(|v| bound_to(v, node))
        .any(|v| references(v, kind).iter().any(|r| r == name))
}

/// The claim (namespace, name) a stored PV is bound to.
pub fn pv_claim(pv: &Value) -> Option<(&str, &str)> {
    let r = &pv["spec"]["claimRef"];
    Some((r["namespace"].as_str()?, r["name"].as_str()?))
}

/// Decides `a` for node `node` with `facts` ([`needs`] says which). Pure.
pub fn decide(node: &str, a: &Attributes, facts: &Facts) -> Verdict {
    if !a.resource_request {
        return Verdict::Rbac;
    }
    let verb = a.verb.as_str();
    let deny = |why: &str| Verdict::Deny(format!("node {node:?}: {why}"));
    let own_name = a.name == node;
    match (a.api_group.as_str(), a.resource.as_str()) {
        ("", "nodes") => match verb {
            _ if !a.subresource.is_empty() && a.subresource != "status" => {
                deny("only its own Node's status subresource")
            }
            "get" | "list" | "watch" if a.subresource.is_empty() => Verdict::Allow,
            "get" | "update" | "patch" if own_name => Verdict::Allow,
            "create" if facts.body_name.as_deref() == Some(node) => Verdict::Allow,
            _ => deny("may change only its own Node"),
        },
        ("coordination.k8s.io", "leases") => match verb {
            _ if is_read(verb) => Verdict::Allow,
            "update" | "patch" if a.namespace == LEASE_NAMESPACE && own_name => Verdict::Allow,
            "create"
                if a.namespace == LEASE_NAMESPACE && facts.body_name.as_deref() == Some(node) =>
            {
                Verdict::Allow
            }
            _ => deny("may change only its own Lease"),
        },
        ("", "namespaces") => match verb {
            _ if is_read(verb) => Verdict::Allow,
            "create" if facts.body_name.as_deref() == Some(LEASE_NAMESPACE) => Verdict::Allow,
            _ => deny("may create only the kube-node-lease namespace"),
        },
        ("kubevirt.io", "virtualmachineinstances") => match verb {
            _ if is_read(verb) && a.subresource.is_empty() => Verdict::Allow,
            _ if is_write(verb) => match &facts.target {
                Some(vmi) if bound_to(vmi, node) => Verdict::Allow,
                Some(_) => deny("the VMI is not bound to this node"),
                None => deny("no such VMI"),
            },
            _ => deny("may only read VMIs and write those bound to it"),
        },
        ("", kind @ ("secrets" | "configmaps" | "persistentvolumeclaims")) => {
            let rk = match kind {
                "secrets" => RefKind::Secret,
                "configmaps" => RefKind::ConfigMap,
                _ => RefKind::Claim,
            };
            if verb == "get"
                && a.subresource.is_empty()
                && !a.name.is_empty()
                && referenced_by_node(&facts.vmis, node, rk, &a.name)
            {
                Verdict::Allow
            } else {
                deny("no VMI bound to this node references it")
            }
        }
        ("", "persistentvolumes") => {
            let ok = (verb == "get" || is_write(verb))
                && a.subresource.is_empty()
                && facts
                    .target
                    .as_ref()
                    .and_then(pv_claim)
                    .is_some_and(|(_, claim)| {
                        referenced_by_node(&facts.vmis, node, RefKind::Claim, claim)
                    });
            if ok {
                Verdict::Allow
            } else {
                deny("the PV's claim is not referenced by a VMI bound to this node")
            }
        }
        ("", "events") | ("events.k8s.io", "events") => match verb {
            "create" | "update" | "patch" | "get" | "list" | "watch" => Verdict::Allow,
            _ => deny("may not delete events"),
        },
        ("authentication.k8s.io", "tokenreviews")
        | ("authorization.k8s.io", "subjectaccessreviews")
            if verb == "create" =>
        {
            // Delegated authentication of the agent's scrape endpoints.
            Verdict::Allow
        }
        // A token for a serviceAccount volume of a VMI bound here, bound to that VMI.
        ("", "serviceaccounts") if a.subresource == "token" && verb == "create" => {
            let Some((vmi_name, want_uid)) = &facts.bound else {
                return deny("a node's token must be bound to a VMI bound to it");
            };
            match &facts.target {
                Some(vmi)
                    if vmi["metadata"]["name"].as_str() == Some(vmi_name.as_str())
                        && want_uid
                            .as_deref()
                            .is_none_or(|u| vmi["metadata"]["uid"].as_str() == Some(u))
                        && bound_to(vmi, node)
                        && references(vmi, RefKind::ServiceAccount).contains(&a.name) =>
                {
                    Verdict::Allow
                }
                Some(vmi) if bound_to(vmi, node) => {
                    deny("no serviceAccount volume of the VMI names this ServiceAccount")
                }
                Some(_) => deny("the VMI the token is bound to is not bound to this node"),
                None => deny("the VMI the token is bound to does not exist"),
            }
        }
        // No node reads another identity's credentials.
        ("", "serviceaccounts") if !a.subresource.is_empty() => Verdict::Rbac,
        (NMSTATE_GROUP, "nodenetworkstates") => match verb {
            _ if is_read(verb) && a.subresource.is_empty() => Verdict::Allow,
            "create" if a.subresource.is_empty() && facts.body_name.as_deref() == Some(node) => {
                Verdict::Allow
            }
            "update" | "patch" | "delete"
                if own_name && (a.subresource.is_empty() || a.subresource == "status") =>
            {
                Verdict::Allow
            }
            _ => deny("may change only its own NodeNetworkState"),
        },
        (NMSTATE_GROUP, "nodenetworkconfigurationenactments") => {
            let prefix = format!("{node}.");
            match verb {
                _ if is_read(verb) && a.subresource.is_empty() => Verdict::Allow,
                "create"
                    if a.subresource.is_empty()
                        && facts
                            .body_name
                            .as_deref()
                            .is_some_and(|n| n.starts_with(&prefix) && n.len() > prefix.len())
                        && facts.body_node_label.as_deref() == Some(node) =>
                {
                    Verdict::Allow
                }
                // Status writes keep the stored metadata (the label), so only those.
                "update" | "patch"
                    if a.subresource == "status" && own_enactment(node, a, facts) =>
                {
                    Verdict::Allow
                }
                "delete" if a.subresource.is_empty() && own_enactment(node, a, facts) => {
                    Verdict::Allow
                }
                _ => deny(
                    "may create, delete and write the status of only its own enactments (<node>.<policy>, labelled nmstate.io/node)",
                ),
            }
        }
        (NMSTATE_GROUP, "nodenetworkconfigurationpolicies") => match verb {
            _ if is_read(verb) && a.subresource.is_empty() => Verdict::Allow,
            // maxUnavailable's compare-and-swap on status.unavailableNodeCount, conditions.
            "update" | "patch" if a.subresource == "status" => Verdict::Allow,
            _ => deny("may write only the status of NodeNetworkConfigurationPolicies"),
        },
        _ if is_read(verb) && a.subresource.is_empty() => Verdict::Allow,
        _ => Verdict::Rbac,
    }
}

/// Whether the enactment the request names is `node`'s: named `<node>.…` and labelled
/// `nmstate.io/node: <node>` as stored.
fn own_enactment(node: &str, a: &Attributes, facts: &Facts) -> bool {
    let named = a
        .name
        .strip_prefix(node)
        .and_then(|r| r.strip_prefix('.'))
        .is_some_and(|p| !p.is_empty());
    let labelled = facts
        .target
        .as_ref()
        .and_then(|t| t["metadata"]["labels"][ENACTMENT_NODE_LABEL].as_str())
        == Some(node);
    named && labelled
}

/// The `metadata.name` of a JSON request body.
pub fn body_name(body: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(body).ok()?;
    v["metadata"]["name"].as_str().map(str::to_string)
}

async fn stored(sh: &Shared, group: &str, plural: &str, ns: &str, name: &str) -> Option<Value> {
    let def = sh
        .resources
        .all()
        .iter()
        .find(|d| d.group == group && d.plural == plural)?;
    let key = crate::resources::object_key(def, Some(ns), name);
    let kv = sh.store.get(&key).await.ok()??;
    decode(&kv).ok()
}

async fn vmis_in(sh: &Shared, ns: &str) -> Vec<Value> {
    let Some(def) = sh
        .resources
        .all()
        .iter()
        .find(|d| d.group == "kubevirt.io" && d.plural == "virtualmachineinstances")
    else {
        return Vec::new();
    };
    let prefix = crate::resources::list_prefix(def, Some(ns));
    match sh.store.list(&prefix, Default::default()).await {
        Ok(r) => r.items.iter().filter_map(|kv| decode(kv).ok()).collect(),
        Err(e) => {
            tracing::warn!("node authorizer: listing VMIs in {ns}: {e}");
            Vec::new()
        }
    }
}

/// Reads the facts `need` names (a store failure leaves them empty: the request is refused).
pub(crate) async fn gather(sh: &Shared, a: &Attributes, need: &Need, body: Option<&[u8]>) -> Facts {
    let mut f = Facts::default();
    match need {
        Need::Nothing => {}
        Need::BodyName => f.body_name = body.and_then(body_name),
        Need::BodyMeta => {
            let v: Option<Value> = body.and_then(|b| serde_json::from_slice(b).ok());
            if let Some(v) = v {
                f.body_name = v["metadata"]["name"].as_str().map(str::to_string);
                f.body_node_label = v["metadata"]["labels"][ENACTMENT_NODE_LABEL]
                    .as_str()
                    .map(str::to_string);
            }
        }
        Need::Enactment => {
            f.target = stored(
                sh,
                NMSTATE_GROUP,
                "nodenetworkconfigurationenactments",
                "",
                &a.name,
            )
            .await;
        }
        Need::Vmi => {
            f.target = stored(
                sh,
                "kubevirt.io",
                "virtualmachineinstances",
                &a.namespace,
                &a.name,
            )
            .await;
        }
        Need::VmisOfNamespace => f.vmis = vmis_in(sh, &a.namespace).await,
        Need::TokenBinding => {
            let spec = body
                .and_then(|b| serde_json::from_slice::<Value>(b).ok())
                .map(|v| v["spec"].clone())
                .unwrap_or(Value::Null);
            f.bound = super::tokens::bound_ref(&spec).ok().flatten();
            if let Some((name, _)) = &f.bound {
                f.target = stored(
                    sh,
                    "kubevirt.io",
                    "virtualmachineinstances",
                    &a.namespace,
                    name,
                )
                .await;
            }
        }
        Need::PvAndVmis => {
            f.target = stored(sh, "", "persistentvolumes", "", &a.name).await;
            if let Some((ns, _)) = f.target.as_ref().and_then(pv_claim) {
                let ns = ns.to_string();
                f.vmis = vmis_in(sh, &ns).await;
            }
        }
    }
    f
}

/// The verdict on a review's attributes for `node` (SubjectAccessReview, `kubectl auth
/// can-i`): as for a request, a create judged by the name the review gives.
pub(crate) async fn review(sh: &Shared, node: &str, a: &Attributes) -> Verdict {
    let need = needs(a);
    let mut facts = gather(sh, a, &need, None).await;
    if matches!(need, Need::BodyName | Need::BodyMeta) && !a.name.is_empty() {
        facts.body_name = Some(a.name.clone());
        if need == Need::BodyMeta {
            // An enactment the node would create under that name carries its own label.
            facts.body_node_label = Some(node.to_string());
        }
    }
    decide(node, a, &facts)
}

#[cfg(test)]
#[path = "node_tests.rs"]
mod tests;
