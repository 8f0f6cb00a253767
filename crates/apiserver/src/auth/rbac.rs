//! The RBAC authorizer, pure: a [`Policy`] (roles and bindings resolved and indexed by
//! subject, ClusterRole aggregation applied) and [`authorize`], which decides one request's
//! [`Attributes`] for one [`UserInfo`] with Kubernetes' RBAC semantics (verbs, apiGroups,
//! resources with `res/sub` and `*/sub`, resourceNames, nonResourceURLs with a trailing `*`,
//! RoleBindings limited to their namespace).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, Subject,
};
use serde_json::Value;

/// The group whose members may do everything, as Kubernetes' privileged group.
pub const MASTERS: &str = "system:masters";

/// Who made a request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UserInfo {
    pub name: String,
    pub uid: String,
    pub groups: Vec<String>,
}

/// What a request asks to do (Kubernetes' authorizer attributes).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Attributes {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, `deletecollection`;
    /// for non-resource requests the lower-case HTTP method.
    pub verb: String,
    /// Whether this is a request for an API resource (else a non-resource path).
    pub resource_request: bool,
    pub api_group: String,
    pub resource: String,
    pub subresource: String,
    pub namespace: String,
    pub name: String,
    /// The URL path (non-resource requests).
    pub path: String,
}

/// The authorizer's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Allowed, with the grant that allowed it.
    Allow(String),
    /// Denied (no rule allows it).
    Deny,
}

impl Decision {
    pub fn allowed(&self) -> bool {
        matches!(self, Decision::Allow(_))
    }
}

/// One binding's rules, applying cluster-wide (`namespace` None) or in one namespace.
#[derive(Debug, Clone)]
struct Grant {
    namespace: Option<String>,
    rules: Arc<[PolicyRule]>,
    /// `RoleBinding "ns/x" of ClusterRole "y"`, for the reason.
    by: Arc<str>,
}

/// Roles and bindings resolved into grants, indexed by subject (`u:NAME`, `g:NAME`).
#[derive(Debug, Clone, Default)]
pub struct Policy {
    by_subject: HashMap<String, Vec<Grant>>,
    /// Every ClusterRole's rules, aggregation applied (for binding checks).
    cluster_rules: HashMap<String, Arc<[PolicyRule]>>,
    /// Every Role's rules by (namespace, name).
    role_rules: HashMap<(String, String), Arc<[PolicyRule]>>,
}

/// Whether a metav1 LabelSelector (JSON form) selects `labels`; an empty one selects all,
/// an unknown operator nothing.
fn selects(
    sel: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    labels: &BTreeMap<String, String>,
) -> bool {
    let by_labels = sel
        .match_labels
        .as_ref()
        .is_none_or(|m| m.iter().all(|(k, v)| labels.get(k) == Some(v)));
    by_labels
        && sel.match_expressions.iter().flatten().all(|req| {
            let values = req.values.as_deref().unwrap_or_default();
            let value = labels.get(&req.key);
            match req.operator.as_str() {
                "In" => value.is_some_and(|v| values.contains(v)),
                "NotIn" => value.is_none_or(|v| !values.contains(v)),
                "Exists" => value.is_some(),
                "DoesNotExist" => value.is_none(),
                _ => false,
            }
        })
}

/// The rules of every ClusterRole, aggregation applied: an aggregated role's rules are its
/// own plus the (aggregated) rules of every ClusterRole some selector of its
/// `aggregationRule` selects, to a fixed point, as the aggregation controller writes them
/// (`admin` ← `edit` ← `view` ← the roles labelled for each).
pub fn cluster_role_rules(roles: &[ClusterRole]) -> HashMap<String, Arc<[PolicyRule]>> {
    let names: Vec<String> = roles
        .iter()
        .map(|r| r.metadata.name.clone().unwrap_or_default())
        .collect();
    let mut rules: Vec<Vec<PolicyRule>> = roles
        .iter()
        .map(|r| r.rules.clone().unwrap_or_default())
        .collect();
    // Which roles each aggregated role selects.
    let selected: Vec<Vec<usize>> = roles
        .iter()
        .map(|role| {
            let Some(agg) = &role.aggregation_rule else {
                return Vec::new();
            };
            let selectors = agg.cluster_role_selectors.as_deref().unwrap_or_default();
            roles
                .iter()
                .enumerate()
                .filter(|(_, other)| other.metadata.name != role.metadata.name)
                .filter(|(_, other)| {
                    let labels = other.metadata.labels.clone().unwrap_or_default();
                    selectors.iter().any(|s| selects(s, &labels))
                })
                .map(|(j, _)| j)
                .collect()
        })
        .collect();
    // Each pass adds one level; the depth is bounded by the number of roles.
    for _ in 0..roles.len() {
        let mut changed = false;
        for (i, sel) in selected.iter().enumerate() {
            for &j in sel {
                let add: Vec<PolicyRule> = rules[j]
                    .iter()
                    .filter(|r| !rules[i].contains(r))
                    .cloned()
                    .collect();
                if !add.is_empty() {
                    rules[i].extend(add);
                    changed = true;
                }
            }
        }
        if !changed {
            break;
        }
    }
    names
        .into_iter()
        .zip(rules)
        .map(|(n, r)| (n, r.into()))
        .collect()
}

/// The index key of a binding subject; None for a subject kind RBAC does not know.
/// A ServiceAccount subject is the user `system:serviceaccount:NS:NAME` (its namespace
/// defaulting to the binding's).
fn subject_key(s: &Subject, binding_ns: Option<&str>) -> Option<String> {
    match s.kind.as_str() {
        "User" => Some(format!("u:{}", s.name)),
        "Group" => Some(format!("g:{}", s.name)),
        "ServiceAccount" => {
            let ns = s.namespace.as_deref().or(binding_ns)?;
            Some(format!("u:system:serviceaccount:{ns}:{}", s.name))
        }
        _ => None,
    }
}

/// Decodes each JSON object as `T`, skipping (and logging) those that do not decode.
pub fn decode_all<T: serde::de::DeserializeOwned>(objs: &[Value]) -> Vec<T> {
    objs.iter()
        .filter_map(|o| match serde_json::from_value(o.clone()) {
            Ok(v) => Some(v),
            Err(e) => {
                tracing::warn!("rbac: skipping an object that does not decode: {e}");
                None
            }
        })
        .collect()
}

impl Policy {
    /// Builds the index. A binding whose role does not exist grants nothing (Kubernetes
    /// does the same); a RoleBinding may name a Role of its namespace or a ClusterRole.
    pub fn build(
        roles: &[Role],
        cluster_roles: &[ClusterRole],
        bindings: &[RoleBinding],
        cluster_bindings: &[ClusterRoleBinding],
    ) -> Policy {
        let cluster_rules = cluster_role_rules(cluster_roles);
        let role_rules: HashMap<(String, String), Arc<[PolicyRule]>> = roles
            .iter()
            .map(|r| {
                (
                    (
                        r.metadata.namespace.clone().unwrap_or_default(),
                        r.metadata.name.clone().unwrap_or_default(),
                    ),
                    r.rules.clone().unwrap_or_default().into(),
                )
            })
            .collect();
        let mut by_subject: HashMap<String, Vec<Grant>> = HashMap::new();
        let mut add = |subjects: &[Subject], ns: Option<&str>, grant: Grant| {
            for s in subjects {
                if let Some(k) = subject_key(s, ns) {
                    by_subject.entry(k).or_default().push(grant.clone());
                }
            }
        };
        for b in cluster_bindings {
            if b.role_ref.kind != "ClusterRole" {
                continue;
            }
            let Some(rules) = cluster_rules.get(&b.role_ref.name) else {
                continue;
            };
            let by = format!(
                "ClusterRoleBinding {:?} of ClusterRole {:?}",
                b.metadata.name.as_deref().unwrap_or_default(),
                b.role_ref.name
            );
            let grant = Grant {
                namespace: None,
                rules: rules.clone(),
                by: by.into(),
            };
            add(b.subjects.as_deref().unwrap_or_default(), None, grant);
        }
        for b in bindings {
            let ns = b.metadata.namespace.clone().unwrap_or_default();
            let rules = match b.role_ref.kind.as_str() {
                "ClusterRole" => cluster_rules.get(&b.role_ref.name),
                "Role" => role_rules.get(&(ns.clone(), b.role_ref.name.clone())),
                _ => None,
            };
            let Some(rules) = rules else { continue };
            let by = format!(
                "RoleBinding \"{ns}/{}\" of {} {:?}",
                b.metadata.name.as_deref().unwrap_or_default(),
                b.role_ref.kind,
                b.role_ref.name
            );
            let grant = Grant {
                namespace: Some(ns.clone()),
                rules: rules.clone(),
                by: by.into(),
            };
            add(b.subjects.as_deref().unwrap_or_default(), Some(&ns), grant);
        }
        Policy {
            by_subject,
            cluster_rules,
            role_rules,
        }
    }

    /// The rules a binding's `roleRef` grants: a ClusterRole's (aggregated) rules, or the
    /// rules of the Role of that name in `namespace`; None when no such role exists.
    pub fn role_ref_rules(
        &self,
        kind: &str,
        name: &str,
        namespace: &str,
    ) -> Option<Arc<[PolicyRule]>> {
        match kind {
            "ClusterRole" => self.cluster_rules.get(name).cloned(),
            "Role" => self
                .role_rules
                .get(&(namespace.to_string(), name.to_string()))
                .cloned(),
            _ => None,
        }
    }

    /// Builds the index from JSON objects (as stored).
    pub fn from_json(
        roles: &[Value],
        cluster_roles: &[Value],
        bindings: &[Value],
        cluster_bindings: &[Value],
    ) -> Policy {
        Policy::build(
            &decode_all(roles),
            &decode_all(cluster_roles),
            &decode_all(bindings),
            &decode_all(cluster_bindings),
        )
    }

    /// Every rule that applies to `user` in `namespace` ("" = cluster scope only), for
    /// SelfSubjectRulesReview-like listings and tests.
    pub fn rules_for(&self, user: &UserInfo, namespace: &str) -> Vec<PolicyRule> {
        self.grants(user)
            .filter(|g| g.namespace.as_deref().is_none_or(|n| n == namespace))
            .flat_map(|g| g.rules.iter().cloned())
            .collect()
    }

    fn grants<'a>(&'a self, user: &'a UserInfo) -> impl Iterator<Item = &'a Grant> + 'a {
        std::iter::once(format!("u:{}", user.name))
            .chain(user.groups.iter().map(|g| format!("g:{g}")))
            .filter_map(|k| self.by_subject.get(&k))
            .flatten()
    }
}

fn has(list: &[String], want: &str) -> bool {
    list.iter().any(|x| x == "*" || x == want)
}

/// Whether one rule allows `a`.
pub fn rule_allows(rule: &PolicyRule, a: &Attributes) -> bool {
    if !has(&rule.verbs, &a.verb) {
        return false;
    }
    if !a.resource_request {
        return rule.non_resource_urls.iter().flatten().any(|u| {
            u == "*" || *u == a.path || u.strip_suffix('*').is_some_and(|p| a.path.starts_with(p))
        });
    }
    if !has(rule.api_groups.as_deref().unwrap_or_default(), &a.api_group) {
        return false;
    }
    let resources = rule.resources.as_deref().unwrap_or_default();
    let resource_ok = if a.subresource.is_empty() {
        has(resources, &a.resource)
    } else {
        let combined = format!("{}/{}", a.resource, a.subresource);
        let any_sub = format!("*/{}", a.subresource);
        resources
            .iter()
            .any(|r| r == "*" || *r == combined || *r == any_sub)
    };
    if !resource_ok {
        return false;
    }
    match rule.resource_names.as_deref() {
        None | Some([]) => true,
        Some(names) => !a.name.is_empty() && names.contains(&a.name),
    }
}

/// Decides `a` for `user`: members of [`MASTERS`] may do everything; otherwise some rule of
/// a ClusterRoleBinding, or of a RoleBinding in the request's namespace, must allow it.
pub fn authorize(policy: &Policy, user: &UserInfo, a: &Attributes) -> Decision {
    if user.groups.iter().any(|g| g == MASTERS) {
        return Decision::Allow(format!("group {MASTERS:?}"));
    }
    for g in policy.grants(user) {
        if let Some(ns) = &g.namespace
            && (!a.resource_request || *ns != a.namespace)
        {
            continue;
        }
        if g.rules.iter().any(|r| rule_allows(r, a)) {
            return Decision::Allow(format!("RBAC: allowed by {}", g.by));
        }
    }
    Decision::Deny
}

/// Kubernetes' message for a denied request (without the `<resource> is forbidden: ` head):
/// `User "u" cannot list resource "virtualmachines" in API group "kubevirt.io" in the
/// namespace "b"`.
pub fn forbidden_message(user: &UserInfo, a: &Attributes) -> String {
    if !a.resource_request {
        return format!("User {:?} cannot {} path {:?}", user.name, a.verb, a.path);
    }
    let mut resource = a.resource.clone();
    if !a.subresource.is_empty() {
        resource = format!("{resource}/{}", a.subresource);
    }
    if a.namespace.is_empty() {
        format!(
            "User {:?} cannot {} resource {resource:?} in API group {:?} at the cluster scope",
            user.name, a.verb, a.api_group
        )
    } else {
        format!(
            "User {:?} cannot {} resource {resource:?} in API group {:?} in the namespace {:?}",
            user.name, a.verb, a.api_group, a.namespace
        )
    }
}

#[cfg(test)]
#[path = "rbac_tests.rs"]
mod tests;
