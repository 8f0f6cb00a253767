//! Unit tests of the RBAC authorizer.

use super::*;
use serde_json::json;

fn user(name: &str, groups: &[&str]) -> UserInfo {
    UserInfo {
        name: name.into(),
        uid: String::new(),
        groups: groups.iter().map(|g| g.to_string()).collect(),
    }
}

fn res(verb: &str, group: &str, resource: &str, sub: &str, ns: &str, name: &str) -> Attributes {
    Attributes {
        verb: verb.into(),
        resource_request: true,
        api_group: group.into(),
        resource: resource.into(),
        subresource: sub.into(),
        namespace: ns.into(),
        name: name.into(),
        path: String::new(),
    }
}

fn rb(ns: &str, name: &str, kind: &str, role: &str, subjects: Value) -> Value {
    json!({"metadata": {"namespace": ns, "name": name},
           "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": role},
           "subjects": subjects})
}

fn crb(name: &str, role: &str, subjects: Value) -> Value {
    json!({"metadata": {"name": name},
           "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
           "subjects": subjects})
}

fn cluster_roles() -> Vec<Value> {
    vec![
        json!({"metadata": {"name": "vm-edit", "labels": {"agg/edit": "true"}},
               "rules": [
                 {"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines"], "verbs": ["get", "list", "create"]},
                 {"apiGroups": ["subresources.kubevirt.io"], "resources": ["virtualmachines/start"], "verbs": ["update"]}]}),
        json!({"metadata": {"name": "cm-view", "labels": {"agg/edit": "true"}},
               "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}]}),
        json!({"metadata": {"name": "other", "labels": {"agg/edit": "false"}},
               "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]}),
        json!({"metadata": {"name": "edit"},
               "aggregationRule": {"clusterRoleSelectors": [{"matchLabels": {"agg/edit": "true"}}]},
               "rules": []}),
        json!({"metadata": {"name": "star"},
               "rules": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
                         {"nonResourceURLs": ["/metrics", "/debug/*"], "verbs": ["get"]}]}),
        json!({"metadata": {"name": "consoles"},
               "rules": [{"apiGroups": ["subresources.kubevirt.io"], "resources": ["*/console"], "verbs": ["get"]}]}),
        json!({"metadata": {"name": "one-secret"},
               "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["s1"], "verbs": ["get", "list"]}]}),
    ]
}

fn policy(bindings: Vec<Value>, cluster_bindings: Vec<Value>) -> Policy {
    let roles = vec![json!({"metadata": {"namespace": "a", "name": "r"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]})];
    Policy::from_json(&roles, &cluster_roles(), &bindings, &cluster_bindings)
}

#[test]
fn aggregation_collects_selected_roles() {
    let p = policy(
        vec![rb(
            "a",
            "b",
            "ClusterRole",
            "edit",
            json!([{"kind": "User", "name": "alice"}]),
        )],
        vec![],
    );
    let alice = user("alice", &[]);
    for a in [
        res("create", "kubevirt.io", "virtualmachines", "", "a", ""),
        res("get", "", "configmaps", "", "a", "c"),
        res(
            "update",
            "subresources.kubevirt.io",
            "virtualmachines",
            "start",
            "a",
            "vm",
        ),
    ] {
        assert!(authorize(&p, &alice, &a).allowed(), "{a:?}");
    }
    // "other" is labelled false: not aggregated.
    assert_eq!(
        authorize(&p, &alice, &res("get", "", "secrets", "", "a", "s")),
        Decision::Deny
    );
    let rules = cluster_role_rules(&decode_all(&cluster_roles()));
    assert_eq!(rules["edit"].len(), 3);
}

#[test]
fn role_binding_is_limited_to_its_namespace() {
    let p = policy(
        vec![
            rb(
                "a",
                "b",
                "ClusterRole",
                "vm-edit",
                json!([{"kind": "ServiceAccount", "name": "sa"}]),
            ),
            rb(
                "a",
                "c",
                "Role",
                "r",
                json!([{"kind": "User", "name": "bob"}]),
            ),
            // A Role of another namespace is not found from namespace b.
            rb(
                "b",
                "d",
                "Role",
                "r",
                json!([{"kind": "User", "name": "bob"}]),
            ),
        ],
        vec![],
    );
    let sa = user("system:serviceaccount:a:sa", &["system:serviceaccounts"]);
    assert!(
        authorize(
            &p,
            &sa,
            &res("list", "kubevirt.io", "virtualmachines", "", "a", "")
        )
        .allowed()
    );
    assert!(
        !authorize(
            &p,
            &sa,
            &res("list", "kubevirt.io", "virtualmachines", "", "b", "")
        )
        .allowed()
    );
    // A namespaced grant never covers the cluster scope (all namespaces).
    assert!(
        !authorize(
            &p,
            &sa,
            &res("list", "kubevirt.io", "virtualmachines", "", "", "")
        )
        .allowed()
    );
    let bob = user("bob", &[]);
    assert!(authorize(&p, &bob, &res("list", "", "pods", "", "a", "")).allowed());
    assert!(!authorize(&p, &bob, &res("list", "", "pods", "", "b", "")).allowed());
    // A ServiceAccount subject of another namespace is another user.
    let other = user("system:serviceaccount:b:sa", &[]);
    assert!(
        !authorize(
            &p,
            &other,
            &res("list", "kubevirt.io", "virtualmachines", "", "a", "")
        )
        .allowed()
    );
}

#[test]
fn cluster_binding_covers_every_namespace_and_groups_match() {
    let p = policy(
        vec![],
        vec![crb("x", "star", json!([{"kind": "Group", "name": "ops"}]))],
    );
    let carol = user("carol", &["ops"]);
    assert!(
        authorize(
            &p,
            &carol,
            &res("delete", "kubevirt.io", "virtualmachines", "", "z", "vm")
        )
        .allowed()
    );
    assert!(authorize(&p, &carol, &res("list", "", "nodes", "", "", "")).allowed());
    assert!(
        !authorize(
            &p,
            &user("carol", &[]),
            &res("list", "", "nodes", "", "", "")
        )
        .allowed()
    );
    let nr = |path: &str| Attributes {
        verb: "get".into(),
        path: path.into(),
        ..Default::default()
    };
    assert!(authorize(&p, &carol, &nr("/metrics")).allowed());
    assert!(authorize(&p, &carol, &nr("/debug/pprof")).allowed());
    assert!(!authorize(&p, &carol, &nr("/metricsx")).allowed());
}

#[test]
fn subresources_need_their_own_rule() {
    let p = policy(
        vec![
            rb(
                "a",
                "b",
                "ClusterRole",
                "vm-edit",
                json!([{"kind": "User", "name": "u"}]),
            ),
            rb(
                "a",
                "c",
                "ClusterRole",
                "consoles",
                json!([{"kind": "User", "name": "u"}]),
            ),
        ],
        vec![],
    );
    let u = user("u", &[]);
    // virtualmachines does not cover virtualmachines/stop.
    assert!(
        !authorize(
            &p,
            &u,
            &res(
                "update",
                "subresources.kubevirt.io",
                "virtualmachines",
                "stop",
                "a",
                "vm"
            )
        )
        .allowed()
    );
    assert!(
        !authorize(
            &p,
            &u,
            &res(
                "update",
                "kubevirt.io",
                "virtualmachines",
                "status",
                "a",
                "vm"
            )
        )
        .allowed()
    );
    // */console covers every resource's console.
    assert!(
        authorize(
            &p,
            &u,
            &res(
                "get",
                "subresources.kubevirt.io",
                "virtualmachineinstances",
                "console",
                "a",
                "vm"
            )
        )
        .allowed()
    );
    assert!(
        !authorize(
            &p,
            &u,
            &res(
                "get",
                "subresources.kubevirt.io",
                "virtualmachineinstances",
                "vnc",
                "a",
                "vm"
            )
        )
        .allowed()
    );
}

#[test]
fn resource_names_restrict_to_named_requests() {
    let p = policy(
        vec![rb(
            "a",
            "b",
            "ClusterRole",
            "one-secret",
            json!([{"kind": "User", "name": "u"}]),
        )],
        vec![],
    );
    let u = user("u", &[]);
    assert!(authorize(&p, &u, &res("get", "", "secrets", "", "a", "s1")).allowed());
    assert!(!authorize(&p, &u, &res("get", "", "secrets", "", "a", "s2")).allowed());
    // A list has no name: resourceNames never match it.
    assert!(!authorize(&p, &u, &res("list", "", "secrets", "", "a", "")).allowed());
}

#[test]
fn masters_and_missing_roles() {
    let p = policy(
        vec![rb(
            "a",
            "b",
            "ClusterRole",
            "gone",
            json!([{"kind": "User", "name": "u"}]),
        )],
        vec![],
    );
    assert!(
        !authorize(
            &p,
            &user("u", &[]),
            &res("get", "", "secrets", "", "a", "s")
        )
        .allowed()
    );
    assert!(
        authorize(
            &p,
            &user("root", &[MASTERS]),
            &res("get", "", "secrets", "", "a", "s")
        )
        .allowed()
    );
}

#[test]
fn kubernetes_forbidden_messages() {
    let u = user("system:serviceaccount:a:sa", &[]);
    assert_eq!(
        forbidden_message(
            &u,
            &res("list", "kubevirt.io", "virtualmachines", "", "b", "")
        ),
        "User \"system:serviceaccount:a:sa\" cannot list resource \"virtualmachines\" in API group \"kubevirt.io\" in the namespace \"b\""
    );
    assert_eq!(
        forbidden_message(
            &u,
            &res(
                "update",
                "subresources.kubevirt.io",
                "virtualmachines",
                "start",
                "",
                "vm"
            )
        ),
        "User \"system:serviceaccount:a:sa\" cannot update resource \"virtualmachines/start\" in API group \"subresources.kubevirt.io\" at the cluster scope"
    );
}
