//! Unit tests of the escalation checks.

use super::*;
use serde_json::json;

fn rule(v: Value) -> PolicyRule {
    serde_json::from_value(v).unwrap()
}

fn rules(v: Value) -> Vec<PolicyRule> {
    serde_json::from_value(v).unwrap()
}

fn user(name: &str, groups: &[&str]) -> UserInfo {
    UserInfo {
        name: name.into(),
        uid: String::new(),
        groups: groups.iter().map(|g| g.to_string()).collect(),
    }
}

#[test]
fn breakdown_is_one_verb_group_resource_name_each() {
    let r = rule(
        json!({"apiGroups": ["", "apps"], "resources": ["pods"], "verbs": ["get", "list"],
        "resourceNames": ["a", "b"]}),
    );
    assert_eq!(breakdown(&r).len(), 8);
    let r = rule(json!({"nonResourceURLs": ["/healthz", "/api/*"], "verbs": ["get"]}));
    let b = breakdown(&r);
    assert_eq!(b.len(), 2);
    assert_eq!(
        b[1].non_resource_urls.as_deref(),
        Some(&["/api/*".to_string()][..])
    );
}

#[test]
fn coverage_wildcards_names_subresources_urls() {
    let owner = rules(json!([
        {"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines"], "verbs": ["get", "list"]},
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"], "resourceNames": ["cm1"]},
        {"apiGroups": ["subresources.kubevirt.io"], "resources": ["*/console"], "verbs": ["get"]},
        {"apiGroups": ["apps"], "resources": ["*"], "verbs": ["*"]},
        {"nonResourceURLs": ["/logs/*", "/healthz"], "verbs": ["get"]},
    ]));
    let ok = |v: Value| covers(&owner, &rules(v)).is_empty();
    assert!(ok(
        json!([{"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines"], "verbs": ["get"]}])
    ));
    // A wildcard verb is held only by a wildcard verb.
    assert!(!ok(
        json!([{"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines"], "verbs": ["*"]}])
    ));
    assert!(!ok(
        json!([{"apiGroups": ["kubevirt.io"], "resources": ["*"], "verbs": ["get"]}])
    ));
    assert!(!ok(
        json!([{"apiGroups": ["*"], "resources": ["virtualmachines"], "verbs": ["get"]}])
    ));
    // The resource does not cover its subresources.
    assert!(!ok(
        json!([{"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines/status"], "verbs": ["get"]}])
    ));
    // `*/console` covers every resource's console.
    assert!(ok(
        json!([{"apiGroups": ["subresources.kubevirt.io"], "resources": ["virtualmachineinstances/console"], "verbs": ["get"]}])
    ));
    assert!(!ok(
        json!([{"apiGroups": ["subresources.kubevirt.io"], "resources": ["virtualmachineinstances/vnc"], "verbs": ["get"]}])
    ));
    // resourceNames: a named grant covers only those names, never all of them.
    assert!(ok(
        json!([{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"], "resourceNames": ["cm1"]}])
    ));
    assert!(!ok(
        json!([{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"], "resourceNames": ["cm2"]}])
    ));
    assert!(!ok(
        json!([{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}])
    ));
    // An unnamed grant covers any name.
    assert!(ok(
        json!([{"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines"], "verbs": ["list"], "resourceNames": ["x"]}])
    ));
    // `*` resources cover everything in their group, subresources included.
    assert!(ok(
        json!([{"apiGroups": ["apps"], "resources": ["deployments", "deployments/scale"], "verbs": ["*"]}])
    ));
    // Non-resource URLs: prefixes with a trailing `*`.
    assert!(ok(
        json!([{"nonResourceURLs": ["/logs/kube", "/healthz"], "verbs": ["get"]}])
    ));
    assert!(!ok(
        json!([{"nonResourceURLs": ["/logs*"], "verbs": ["get"]}])
    ));
    assert!(!ok(
        json!([{"nonResourceURLs": ["/healthz"], "verbs": ["post"]}])
    ));
    // A resource grant never covers a URL and vice versa.
    assert!(!ok(
        json!([{"nonResourceURLs": ["/apis/apps/x"], "verbs": ["get"]}])
    ));
}

#[test]
fn missing_rules_are_compacted_and_worded_as_kubernetes() {
    let owner = rules(json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]));
    let servant = rules(json!([
        {"apiGroups": [""], "resources": ["pods", "secrets"], "verbs": ["get", "list"]},
        {"nonResourceURLs": ["/metrics"], "verbs": ["get"]},
    ]));
    let missing = covers(&owner, &servant);
    assert_eq!(missing.len(), 4);
    let msg = Refusal::NotHeld(missing).message(&user("bob", &["dev", "system:authenticated"]));
    assert_eq!(
        msg,
        "user \"bob\" (groups=[\"dev\" \"system:authenticated\"]) is attempting to grant RBAC permissions not currently held:\n\
         {APIGroups:[\"\"], Resources:[\"pods\"], Verbs:[\"list\"]}\n\
         {APIGroups:[\"\"], Resources:[\"secrets\"], Verbs:[\"get\" \"list\"]}\n\
         {NonResourceURLs:[\"/metrics\"], Verbs:[\"get\"]}"
    );
}

fn policy(extra_rbs: Vec<Value>, extra_crs: Vec<Value>) -> Policy {
    let mut crs = vec![
        json!({"metadata": {"name": "cluster-admin"}, "rules": [
            {"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
            {"nonResourceURLs": ["*"], "verbs": ["*"]}]}),
        json!({"metadata": {"name": "editish"}, "rules": [
            {"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines"], "verbs": ["get", "list", "create", "update", "delete"]},
            {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["rolebindings", "roles"], "verbs": ["create", "update"]}]}),
        json!({"metadata": {"name": "vm-reader"}, "rules": [
            {"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines"], "verbs": ["get"]}]}),
        json!({"metadata": {"name": "admin", "labels": {}}, "aggregationRule": {"clusterRoleSelectors": [{"matchLabels": {"agg": "admin"}}]}}),
        json!({"metadata": {"name": "admin-part", "labels": {"agg": "admin"}}, "rules": [
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["*"]}]}),
    ];
    crs.extend(extra_crs);
    let mut rbs = vec![json!({"metadata": {"namespace": "a", "name": "bob-edit"},
        "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": "editish"},
        "subjects": [{"kind": "User", "name": "bob"}]})];
    rbs.extend(extra_rbs);
    let roles = vec![
        json!({"metadata": {"namespace": "a", "name": "star"}, "rules": [
        {"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]}),
    ];
    Policy::from_json(&roles, &crs, &rbs, &[])
}

fn binding(kind: &str, role: &str) -> Value {
    json!({"roleRef": {"apiGroup": RBAC_GROUP, "kind": kind, "name": role},
           "subjects": [{"kind": "User", "name": "bob"}]})
}

#[test]
fn bindings_need_the_rules_or_bind() {
    let bob = user("bob", &["system:authenticated"]);
    let p = policy(vec![], vec![]);
    let write = |p: &Policy, plural: &str, ns: &str, obj: Value| {
        check_write(p, &bob, plural, ns, "", &obj, None)
    };
    // Binding a role whose rules bob holds in a: fine.
    assert_eq!(
        write(&p, "rolebindings", "a", binding("ClusterRole", "vm-reader")),
        Ok(())
    );
    // … but not in b, where he holds nothing.
    assert!(matches!(
        write(&p, "rolebindings", "b", binding("ClusterRole", "vm-reader")),
        Err(Refusal::NotHeld(_))
    ));
    // admin (aggregated), cluster-admin and a namespace Role with `*`: refused.
    for (kind, role) in [
        ("ClusterRole", "admin"),
        ("ClusterRole", "cluster-admin"),
        ("Role", "star"),
    ] {
        let r = write(&p, "rolebindings", "a", binding(kind, role));
        assert!(matches!(r, Err(Refusal::NotHeld(_))), "{role}: {r:?}");
    }
    assert!(matches!(
        write(
            &p,
            "clusterrolebindings",
            "",
            binding("ClusterRole", "vm-reader")
        ),
        Err(Refusal::NotHeld(_))
    ));
    // A role that does not exist.
    assert_eq!(
        write(&p, "rolebindings", "a", binding("ClusterRole", "nope")),
        Err(Refusal::RoleNotFound {
            resource: "clusterroles",
            name: "nope".into()
        })
    );
    // `bind` on exactly that role, in that namespace: allowed; other roles still refused.
    let binder = json!({"metadata": {"name": "bind-admin"}, "rules": [
        {"apiGroups": [RBAC_GROUP], "resources": ["clusterroles"], "verbs": ["bind"], "resourceNames": ["admin"]}]});
    let rb = json!({"metadata": {"namespace": "a", "name": "bob-bind"},
        "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": "bind-admin"},
        "subjects": [{"kind": "User", "name": "bob"}]});
    let p = policy(vec![rb], vec![binder]);
    assert_eq!(
        write(&p, "rolebindings", "a", binding("ClusterRole", "admin")),
        Ok(())
    );
    assert!(
        write(
            &p,
            "rolebindings",
            "a",
            binding("ClusterRole", "cluster-admin")
        )
        .is_err()
    );
    assert!(write(&p, "rolebindings", "b", binding("ClusterRole", "admin")).is_err());
    // Masters may do anything.
    let root = user("root", &[MASTERS]);
    assert_eq!(
        check_write(
            &p,
            &root,
            "clusterrolebindings",
            "",
            "",
            &binding("ClusterRole", "cluster-admin"),
            None
        ),
        Ok(())
    );
}

#[test]
fn roles_need_the_rules_or_escalate() {
    let bob = user("bob", &["system:authenticated"]);
    let p = policy(vec![], vec![]);
    let role = |r: Value| json!({"rules": r});
    let star = role(json!([{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]));
    let vm_get = role(
        json!([{"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines"], "verbs": ["get"]}]),
    );
    assert!(matches!(
        check_write(&p, &bob, "roles", "a", "", &star, None),
        Err(Refusal::NotHeld(_))
    ));
    assert_eq!(
        check_write(&p, &bob, "roles", "a", "", &vm_get, None),
        Ok(())
    );
    assert!(check_write(&p, &bob, "roles", "b", "", &vm_get, None).is_err());
    assert!(check_write(&p, &bob, "clusterroles", "", "", &vm_get, None).is_err());
    // An update that only changes GC fields is not checked; one that changes rules is.
    let mut owned = star.clone();
    owned["metadata"] = json!({"name": "r", "ownerReferences": [{"name": "x"}]});
    let mut star = star;
    star["metadata"] = json!({"name": "r"});
    assert_eq!(
        check_write(&p, &bob, "roles", "a", "r", &owned, Some(&star)),
        Ok(())
    );
    assert!(check_write(&p, &bob, "roles", "a", "r", &star, Some(&vm_get)).is_err());
    // `escalate` on roles in a.
    let esc = json!({"metadata": {"name": "esc"}, "rules": [
        {"apiGroups": [RBAC_GROUP], "resources": ["roles"], "verbs": ["escalate"]}]});
    let rb = json!({"metadata": {"namespace": "a", "name": "bob-esc"},
        "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": "esc"},
        "subjects": [{"kind": "User", "name": "bob"}]});
    let p = policy(vec![rb], vec![esc]);
    assert_eq!(check_write(&p, &bob, "roles", "a", "", &star, None), Ok(()));
    assert!(check_write(&p, &bob, "roles", "b", "", &star, None).is_err());
}

#[test]
fn aggregation_needs_full_authority() {
    let carol = user("carol", &[]);
    let crb = json!({"metadata": {"name": "carol-reader"},
        "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": "vm-reader"},
        "subjects": [{"kind": "User", "name": "carol"}]});
    let crs = vec![json!({"metadata": {"name": "vm-reader"}, "rules": [
        {"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines"], "verbs": ["get"]}]})];
    let p = Policy::from_json(&[], &crs, &[], &[crb]);
    let agg = json!({"aggregationRule": {"clusterRoleSelectors": [{"matchLabels": {"x": "y"}}]}, "rules": []});
    assert_eq!(
        check_write(&p, &carol, "clusterroles", "", "", &agg, None),
        Err(Refusal::Aggregation)
    );
    let plain = json!({"rules": [{"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines"], "verbs": ["get"]}]});
    assert_eq!(
        check_write(&p, &carol, "clusterroles", "", "", &plain, None),
        Ok(())
    );
}
