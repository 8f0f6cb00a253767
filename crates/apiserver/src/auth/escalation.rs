//! Privilege-escalation prevention for RBAC writes, as kube-apiserver's RBAC storage does it
//! (pure): a Role/ClusterRole may be created or updated only by a user who already holds
//! every rule in it (in that namespace, or cluster-wide for a ClusterRole) or who may
//! `escalate` roles/clusterroles; an aggregationRule needs full authority; a
//! RoleBinding/ClusterRoleBinding only by a user who holds every rule of the role it
//! references (in the binding's namespace) or who may `bind` that role (resourceNames
//! honoured). [`covers`] is Kubernetes' rule-coverage check (rules broken down into one verb
//! × group × resource × name each; wildcards, `*/subresource`, resourceNames and
//! nonResourceURL prefixes); refusals carry Kubernetes' message.

use k8s_openapi::api::rbac::v1::PolicyRule;
use serde_json::Value;

use super::rbac::{self, Attributes, MASTERS, Policy, UserInfo};

/// The RBAC API group.
pub const RBAC_GROUP: &str = "rbac.authorization.k8s.io";

/// Why an RBAC write is refused.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// The user does not hold these (atomic) rules.
    NotHeld(Vec<PolicyRule>),
    /// An aggregationRule without full authority.
    Aggregation,
    /// The binding's roleRef names no existing role.
    RoleNotFound {
        resource: &'static str,
        name: String,
    },
}

/// One rule per verb × group × resource × resourceName (or nonResourceURL × verb), as
/// Kubernetes' `BreakdownRule`.
pub fn breakdown(rule: &PolicyRule) -> Vec<PolicyRule> {
    let one = |s: &str| Some(vec![s.to_string()]);
    let mut out = Vec::new();
    let names = rule.resource_names.as_deref().unwrap_or_default();
    for group in rule.api_groups.iter().flatten() {
        for resource in rule.resources.iter().flatten() {
            for verb in &rule.verbs {
                let base = PolicyRule {
                    api_groups: one(group),
                    resources: one(resource),
                    verbs: vec![verb.clone()],
                    ..Default::default()
                };
                if names.is_empty() {
                    out.push(base);
                } else {
                    out.extend(names.iter().map(|n| PolicyRule {
                        resource_names: one(n),
                        ..base.clone()
                    }));
                }
            }
        }
    }
    for url in rule.non_resource_urls.iter().flatten() {
        for verb in &rule.verbs {
            out.push(PolicyRule {
                non_resource_urls: one(url),
                verbs: vec![verb.clone()],
                ..Default::default()
            });
        }
    }
    out
}

fn has(list: &[String], x: &str) -> bool {
    list.iter().any(|v| v == x)
}

fn has_all(list: &[String], want: &[String]) -> bool {
    want.iter().all(|w| has(list, w))
}

fn resources_cover(owner: &[String], servant: &[String]) -> bool {
    if has(owner, "*") {
        return true;
    }
    servant.iter().all(|r| {
        has(owner, r)
            || r.split_once('/')
                .is_some_and(|(_, sub)| has(owner, &format!("*/{sub}")))
    })
}

fn url_covers(owner: &str, sub: &str) -> bool {
    owner == sub || (owner.ends_with('*') && sub.starts_with(owner.trim_end_matches('*')))
}

/// Whether `owner` covers `sub` (Kubernetes' `ruleCovers`).
pub fn rule_covers(owner: &PolicyRule, sub: &PolicyRule) -> bool {
    let list = |v: &Option<Vec<String>>| v.clone().unwrap_or_default();
    let (o_groups, s_groups) = (list(&owner.api_groups), list(&sub.api_groups));
    let (o_names, s_names) = (list(&owner.resource_names), list(&sub.resource_names));
    let (o_urls, s_urls) = (list(&owner.non_resource_urls), list(&sub.non_resource_urls));
    let verbs = has(&owner.verbs, "*") || has_all(&owner.verbs, &sub.verbs);
    let groups = has(&o_groups, "*") || has_all(&o_groups, &s_groups);
    let resources = resources_cover(&list(&owner.resources), &list(&sub.resources));
    let urls = s_urls
        .iter()
        .all(|s| o_urls.iter().any(|o| url_covers(o, s)));
    let names = o_names.is_empty() || (!s_names.is_empty() && has_all(&o_names, &s_names));
    verbs && groups && resources && urls && names
}

/// The atomic rules of `servant` that no rule of `owner` covers (empty: covered).
pub fn covers(owner: &[PolicyRule], servant: &[PolicyRule]) -> Vec<PolicyRule> {
    servant
        .iter()
        .flat_map(breakdown)
        .filter(|s| !owner.iter().any(|o| rule_covers(o, s)))
        .collect()
}

/// Kubernetes' `CompactRules`: rules of one group, one resource and at most one name are
/// merged into one rule with all their verbs.
pub fn compact(rules: &[PolicyRule]) -> Vec<PolicyRule> {
    let mut out: Vec<PolicyRule> = Vec::new();
    // (group, resource, name) → the merged rule, in first-seen order.
    type Simple = (String, String, Option<String>);
    let mut simple: Vec<(Simple, PolicyRule)> = Vec::new();
    for r in rules {
        let groups = r.api_groups.as_deref().unwrap_or_default();
        let resources = r.resources.as_deref().unwrap_or_default();
        let names = r.resource_names.as_deref().unwrap_or_default();
        let is_simple = names.len() <= 1
            && r.non_resource_urls
                .as_deref()
                .unwrap_or_default()
                .is_empty()
            && groups.len() == 1
            && resources.len() == 1;
        if !is_simple {
            out.push(r.clone());
            continue;
        }
        let key = (
            groups[0].clone(),
            resources[0].clone(),
            names.first().cloned(),
        );
        match simple.iter_mut().find(|(k, _)| *k == key) {
            Some((_, existing)) => existing.verbs.extend(r.verbs.iter().cloned()),
            None => simple.push((key, r.clone())),
        }
    }
    out.extend(simple.into_iter().map(|(_, r)| r));
    out
}

/// Go's `%q` of a string slice: `["a" "b"]`.
fn go_quoted(list: &[String]) -> String {
    let items: Vec<String> = list.iter().map(|s| format!("{s:?}")).collect();
    format!("[{}]", items.join(" "))
}

/// Kubernetes' `CompactString` of a rule: `{APIGroups:["kubevirt.io"], Resources:["vms"],
/// Verbs:["get" "list"]}`.
pub fn compact_string(r: &PolicyRule) -> String {
    let mut parts = Vec::new();
    for (label, v) in [
        ("APIGroups", r.api_groups.as_deref()),
        ("Resources", r.resources.as_deref()),
        ("NonResourceURLs", r.non_resource_urls.as_deref()),
        ("ResourceNames", r.resource_names.as_deref()),
        ("Verbs", Some(r.verbs.as_slice())),
    ] {
        if let Some(v) = v.filter(|v| !v.is_empty()) {
            parts.push(format!("{label}:{}", go_quoted(v)));
        }
    }
    format!("{{{}}}", parts.join(", "))
}

impl Refusal {
    /// The message after `<resource> "<name>" is forbidden: `, as Kubernetes words it.
    pub fn message(&self, user: &UserInfo) -> String {
        match self {
            Refusal::NotHeld(missing) => {
                let mut lines: Vec<String> = compact(missing).iter().map(compact_string).collect();
                lines.sort();
                lines.dedup();
                format!(
                    "user {:?} (groups={}) is attempting to grant RBAC permissions not currently held:\n{}",
                    user.name,
                    go_quoted(&user.groups),
                    lines.join("\n")
                )
            }
            Refusal::Aggregation => {
                "must have cluster-admin privileges to use the aggregationRule".into()
            }
            Refusal::RoleNotFound { resource, name } => {
                format!("{resource}.{RBAC_GROUP} {name:?} not found")
            }
        }
    }
}

/// The rules that give full authority (`*` on everything, every non-resource URL).
fn full_authority() -> Vec<PolicyRule> {
    let all = || Some(vec!["*".to_string()]);
    vec![
        PolicyRule {
            api_groups: all(),
            resources: all(),
            verbs: vec!["*".into()],
            ..Default::default()
        },
        PolicyRule {
            non_resource_urls: all(),
            verbs: vec!["*".into()],
            ..Default::default()
        },
    ]
}

fn may(policy: &Policy, user: &UserInfo, verb: &str, resource: &str, ns: &str, name: &str) -> bool {
    let a = Attributes {
        verb: verb.into(),
        resource_request: true,
        api_group: RBAC_GROUP.into(),
        resource: resource.into(),
        namespace: ns.into(),
        name: name.into(),
        ..Default::default()
    };
    rbac::authorize(policy, user, &a).allowed()
}

fn held(policy: &Policy, user: &UserInfo, ns: &str, rules: &[PolicyRule]) -> Result<(), Refusal> {
    let missing = covers(&policy.rules_for(user, ns), rules);
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Refusal::NotHeld(missing))
    }
}

/// Whether `user` may write a Role (`ns` set) or ClusterRole (`ns` empty) with these rules:
/// `url_name` is the name in the request URL (empty for a create), as Kubernetes asks the
/// authorizer about `escalate`.
pub fn check_role(
    policy: &Policy,
    user: &UserInfo,
    ns: &str,
    url_name: &str,
    rules: &[PolicyRule],
    aggregation: bool,
) -> Result<(), Refusal> {
    let resource = if ns.is_empty() {
        "clusterroles"
    } else {
        "roles"
    };
    if user.groups.iter().any(|g| g == MASTERS)
        || may(policy, user, "escalate", resource, ns, url_name)
    {
        return Ok(());
    }
    held(policy, user, ns, rules)?;
    if aggregation && !covers(&policy.rules_for(user, ""), &full_authority()).is_empty() {
        return Err(Refusal::Aggregation);
    }
    Ok(())
}

/// Whether `user` may write a RoleBinding in `ns` (or a ClusterRoleBinding, `ns` empty)
/// whose roleRef is `kind`/`name`: `bind` on that role, or holding all its rules.
pub fn check_binding(
    policy: &Policy,
    user: &UserInfo,
    ns: &str,
    kind: &str,
    name: &str,
) -> Result<(), Refusal> {
    if user.groups.iter().any(|g| g == MASTERS) {
        return Ok(());
    }
    let resource = match kind {
        "ClusterRole" => "clusterroles",
        "Role" => "roles",
        // Validation refuses other kinds; nothing to hold.
        _ => return Ok(()),
    };
    if may(policy, user, "bind", resource, ns, name) {
        return Ok(());
    }
    let rules = policy
        .role_ref_rules(kind, name, ns)
        .ok_or_else(|| Refusal::RoleNotFound {
            resource,
            name: name.to_string(),
        })?;
    held(policy, user, ns, &rules)
}

/// Whether `new` differs from `old` only in the fields garbage collection writes
/// (ownerReferences, finalizers) and server-set metadata; such writes are not checked, as
/// in Kubernetes.
pub fn only_gc_fields_changed(old: &Value, new: &Value) -> bool {
    let strip = |v: &Value| {
        let mut v = v.clone();
        if let Some(m) = v.get_mut("metadata").and_then(Value::as_object_mut) {
            for f in [
                "ownerReferences",
                "finalizers",
                "resourceVersion",
                "generation",
                "managedFields",
            ] {
                m.remove(f);
            }
        }
        v
    };
    strip(old) == strip(new)
}

/// Decides an RBAC write of `obj` (the object as it would be stored) to `plural` in `ns`
/// by `user`; `old` is the stored object for an update. Writes of other kinds pass.
pub fn check_write(
    policy: &Policy,
    user: &UserInfo,
    plural: &str,
    ns: &str,
    url_name: &str,
    obj: &Value,
    old: Option<&Value>,
) -> Result<(), Refusal> {
    if old.is_some_and(|o| only_gc_fields_changed(o, obj)) {
        return Ok(());
    }
    let rules = || -> Vec<PolicyRule> {
        obj.get("rules")
            .cloned()
            .and_then(|r| serde_json::from_value(r).ok())
            .unwrap_or_default()
    };
    let role_ref = |f: &str| {
        obj.pointer(&format!("/roleRef/{f}"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    match plural {
        "roles" => check_role(policy, user, ns, url_name, &rules(), false),
        "clusterroles" => {
            let aggregation = obj.get("aggregationRule").is_some_and(|a| !a.is_null());
            check_role(policy, user, "", url_name, &rules(), aggregation)
        }
        "rolebindings" => check_binding(policy, user, ns, &role_ref("kind"), &role_ref("name")),
        "clusterrolebindings" => {
            check_binding(policy, user, "", &role_ref("kind"), &role_ref("name"))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
#[path = "escalation_tests.rs"]
mod tests;
