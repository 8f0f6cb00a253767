//! Unit tests of the node authorizer's decisions.

use serde_json::json;

use super::*;

fn at(verb: &str, group: &str, resource: &str, ns: &str, name: &str) -> Attributes {
    Attributes {
        verb: verb.into(),
        resource_request: true,
        api_group: group.into(),
        resource: resource.into(),
        namespace: ns.into(),
        name: name.into(),
        ..Default::default()
    }
}

fn sub(mut a: Attributes, s: &str) -> Attributes {
    a.subresource = s.into();
    a
}

fn vmi(node: &str) -> Value {
    json!({
        "metadata": {"name": "vm", "namespace": "a"},
        "spec": {
            "volumes": [
                {"name": "d", "persistentVolumeClaim": {"claimName": "disk"}},
                {"name": "dv", "dataVolume": {"name": "dv1"}},
                {"name": "s", "secret": {"secretName": "mysecret"}},
                {"name": "c", "configMap": {"name": "mycm"}},
                {"name": "ci", "cloudInitNoCloud": {"secretRef": {"name": "userdata"}}},
                {"name": "cd", "containerDisk": {"image": "x", "imagePullSecret": "pull"}},
            ],
            "accessCredentials": [
                {"sshPublicKey": {"source": {"secret": {"secretName": "keys"}}}}
            ],
        },
        "status": {"nodeName": node},
    })
}

fn facts_vmis(v: Vec<Value>) -> Facts {
    Facts {
        vmis: v,
        ..Default::default()
    }
}

#[test]
fn node_identity() {
    let u = |name: &str, g: &[&str]| UserInfo {
        name: name.into(),
        uid: String::new(),
        groups: g.iter().map(|s| s.to_string()).collect(),
    };
    assert_eq!(node_of(&u("system:node:n1", &[NODES_GROUP])), Some("n1"));
    // The name alone is not enough; nor the group alone.
    assert_eq!(node_of(&u("system:node:n1", &["dev"])), None);
    assert_eq!(node_of(&u("alice", &[NODES_GROUP])), None);
    assert_eq!(node_of(&u("system:node:", &[NODES_GROUP])), None);
}

#[test]
fn own_node_and_lease_only() {
    let f = Facts::default();
    let d = |a: &Attributes, f: &Facts| decide("n1", a, f);
    assert_eq!(d(&at("get", "", "nodes", "", "n2"), &f), Verdict::Allow);
    assert_eq!(d(&at("list", "", "nodes", "", ""), &f), Verdict::Allow);
    assert_eq!(d(&at("patch", "", "nodes", "", "n1"), &f), Verdict::Allow);
    assert_eq!(
        d(&sub(at("patch", "", "nodes", "", "n1"), "status"), &f),
        Verdict::Allow
    );
    assert!(matches!(
        d(&at("patch", "", "nodes", "", "n2"), &f),
        Verdict::Deny(_)
    ));
    assert!(matches!(
        d(&sub(at("patch", "", "nodes", "", "n2"), "status"), &f),
        Verdict::Deny(_)
    ));
    assert!(matches!(
        d(&at("delete", "", "nodes", "", "n1"), &f),
        Verdict::Deny(_)
    ));
    // The node proxy would reach another agent with the server's credential.
    assert!(matches!(
        d(&sub(at("get", "", "nodes", "", "n2"), "proxy"), &f),
        Verdict::Deny(_)
    ));
    let named = |n: &str| Facts {
        body_name: Some(n.into()),
        ..Default::default()
    };
    assert_eq!(
        d(&at("create", "", "nodes", "", ""), &named("n1")),
        Verdict::Allow
    );
    assert!(matches!(
        d(&at("create", "", "nodes", "", ""), &named("n2")),
        Verdict::Deny(_)
    ));
    let lease =
        |verb: &str, ns: &str, name: &str| at(verb, "coordination.k8s.io", "leases", ns, name);
    assert_eq!(
        d(&lease("update", LEASE_NAMESPACE, "n1"), &f),
        Verdict::Allow
    );
    assert!(matches!(
        d(&lease("update", LEASE_NAMESPACE, "n2"), &f),
        Verdict::Deny(_)
    ));
    // The controllers' leader lease.
    assert!(matches!(
        d(&lease("update", "kube-system", "n1"), &f),
        Verdict::Deny(_)
    ));
    assert_eq!(
        d(&lease("create", LEASE_NAMESPACE, ""), &named("n1")),
        Verdict::Allow
    );
    assert!(matches!(
        d(&lease("create", LEASE_NAMESPACE, ""), &named("n2")),
        Verdict::Deny(_)
    ));
    assert_eq!(
        d(
            &at("create", "", "namespaces", "", ""),
            &named(LEASE_NAMESPACE)
        ),
        Verdict::Allow
    );
    assert!(matches!(
        d(&at("create", "", "namespaces", "", ""), &named("evil")),
        Verdict::Deny(_)
    ));
}

#[test]
fn vmis_bound_to_the_node() {
    let vmi_at = |verb: &str| at(verb, "kubevirt.io", "virtualmachineinstances", "a", "vm");
    let target = |v: Value| Facts {
        target: Some(v),
        ..Default::default()
    };
    assert_eq!(
        decide("n1", &vmi_at("list"), &Facts::default()),
        Verdict::Allow
    );
    assert_eq!(
        decide("n1", &vmi_at("patch"), &target(vmi("n1"))),
        Verdict::Allow
    );
    assert_eq!(
        decide("n1", &sub(vmi_at("patch"), "status"), &target(vmi("n1"))),
        Verdict::Allow
    );
    assert!(matches!(
        decide("n1", &vmi_at("patch"), &target(vmi("n2"))),
        Verdict::Deny(_)
    ));
    assert!(matches!(
        decide("n1", &vmi_at("update"), &Facts::default()),
        Verdict::Deny(_)
    ));
    assert!(matches!(
        decide("n1", &vmi_at("delete"), &target(vmi("n1"))),
        Verdict::Deny(_)
    ));
    assert!(matches!(
        decide("n1", &vmi_at("create"), &Facts::default()),
        Verdict::Deny(_)
    ));
    // A migration's target node writes the VMI's status too.
    let mut migrating = vmi("n2");
    migrating["status"]["migrationState"] = json!({"sourceNode": "n2", "targetNode": "n1"});
    assert_eq!(
        decide("n1", &vmi_at("patch"), &target(migrating)),
        Verdict::Allow
    );
    let mut labelled = vmi("");
    labelled["metadata"]["labels"] = json!({"kubevirt.io/nodeName": "n1"});
    assert_eq!(
        decide("n1", &vmi_at("patch"), &target(labelled)),
        Verdict::Allow
    );
    // Console and VNC are the API server's to open.
    assert_eq!(
        decide(
            "n1",
            &sub(
                at(
                    "get",
                    "subresources.kubevirt.io",
                    "virtualmachineinstances",
                    "a",
                    "vm"
                ),
                "console"
            ),
            &Facts::default()
        ),
        Verdict::Rbac
    );
}

#[test]
fn references_of_a_vmi() {
    let v = vmi("n1");
    assert_eq!(
        references(&v, RefKind::Secret),
        vec!["mysecret", "userdata", "pull", "keys"]
    );
    assert_eq!(references(&v, RefKind::ConfigMap), vec!["mycm"]);
    assert_eq!(references(&v, RefKind::Claim), vec!["disk", "dv1"]);
}

#[test]
fn secrets_only_when_a_bound_vmi_references_them() {
    let mine = facts_vmis(vec![vmi("n1")]);
    let theirs = facts_vmis(vec![vmi("n2")]);
    for (res, name) in [
        ("secrets", "mysecret"),
        ("secrets", "userdata"),
        ("configmaps", "mycm"),
        ("persistentvolumeclaims", "dv1"),
    ] {
        assert_eq!(
            decide("n1", &at("get", "", res, "a", name), &mine),
            Verdict::Allow,
            "{res}"
        );
        assert!(
            matches!(
                decide("n1", &at("get", "", res, "a", name), &theirs),
                Verdict::Deny(_)
            ),
            "{res} of another node's VMI"
        );
        assert!(
            matches!(
                decide("n1", &at("get", "", res, "a", "other"), &mine),
                Verdict::Deny(_)
            ),
            "{res} nobody references"
        );
        for verb in ["list", "watch", "update", "patch", "delete", "create"] {
            assert!(
                matches!(
                    decide("n1", &at(verb, "", res, "a", name), &mine),
                    Verdict::Deny(_)
                ),
                "{verb} {res}"
            );
        }
    }
    assert_eq!(
        needs(&at("get", "", "secrets", "a", "x")),
        Need::VmisOfNamespace
    );
    assert_eq!(needs(&at("list", "", "secrets", "a", "")), Need::Nothing);
}

#[test]
fn pvs_of_bound_claims() {
    let pv = json!({"spec": {"claimRef": {"namespace": "a", "name": "disk"}}});
    let f = Facts {
        target: Some(pv.clone()),
        vmis: vec![vmi("n1")],
        ..Default::default()
    };
    let pv_at = |verb: &str| at(verb, "", "persistentvolumes", "", "pv-1");
    assert_eq!(decide("n1", &pv_at("get"), &f), Verdict::Allow);
    assert_eq!(decide("n1", &pv_at("patch"), &f), Verdict::Allow);
    assert!(matches!(
        decide("n1", &pv_at("delete"), &f),
        Verdict::Deny(_)
    ));
    assert!(matches!(
        decide("n1", &at("list", "", "persistentvolumes", "", ""), &f),
        Verdict::Deny(_)
    ));
    let other = Facts {
        target: Some(pv),
        vmis: vec![vmi("n2")],
        ..Default::default()
    };
    assert!(matches!(
        decide("n1", &pv_at("get"), &other),
        Verdict::Deny(_)
    ));
    assert!(matches!(
        decide("n1", &pv_at("get"), &Facts::default()),
        Verdict::Deny(_)
    ));
}

#[test]
fn the_rest() {
    let f = Facts::default();
    assert_eq!(
        decide("n1", &at("create", "", "events", "a", ""), &f),
        Verdict::Allow
    );
    assert_eq!(
        decide(
            "n1",
            &at("create", "authentication.k8s.io", "tokenreviews", "", ""),
            &f
        ),
        Verdict::Allow
    );
    assert_eq!(
        decide("n1", &at("watch", "", "services", "", ""), &f),
        Verdict::Allow
    );
    assert_eq!(
        decide(
            "n1",
            &at("get", "kubevirt.io", "virtualmachines", "a", "vm"),
            &f
        ),
        Verdict::Allow
    );
    // Writes of other kinds, and credentials, are RBAC's (nothing for nodes by default).
    assert_eq!(
        decide(
            "n1",
            &at("create", "kubevirt.io", "virtualmachines", "a", ""),
            &f
        ),
        Verdict::Rbac
    );
    assert_eq!(
        decide(
            "n1",
            &at("delete", "kubevirt.io", "virtualmachines", "a", "vm"),
            &f
        ),
        Verdict::Rbac
    );
    // A token not bound to a VMI of its own (below) is refused.
    assert_ne!(
        decide(
            "n1",
            &sub(at("create", "", "serviceaccounts", "a", "default"), "token"),
            &f
        ),
        Verdict::Allow
    );
    assert_eq!(
        decide(
            "n1",
            &at(
                "create",
                "rbac.authorization.k8s.io",
                "clusterrolebindings",
                "",
                ""
            ),
            &f
        ),
        Verdict::Rbac
    );
    let nonres = Attributes {
        verb: "get".into(),
        path: "/version".into(),
        ..Default::default()
    };
    assert_eq!(decide("n1", &nonres, &f), Verdict::Rbac);
    assert_eq!(
        body_name(br#"{"metadata":{"name":"n1"}}"#).as_deref(),
        Some("n1")
    );
    assert_eq!(body_name(b"not json"), None);
}

#[test]
fn tokens_only_for_service_account_volumes_of_own_vmis() {
    let mut mine = vmi("n1");
    mine["metadata"]["uid"] = json!("u1");
    mine["spec"]["volumes"] = json!([
        {"name": "sa", "serviceAccount": {"serviceAccountName": "robot"}}
    ]);
    let mut theirs = mine.clone();
    theirs["metadata"]["name"] = json!("other");
    theirs["metadata"]["uid"] = json!("u2");
    theirs["status"]["nodeName"] = json!("n2");
    theirs["spec"]["volumes"][0]["serviceAccount"]["serviceAccountName"] = json!("spy");
    let tok = |sa: &str| sub(at("create", "", "serviceaccounts", "a", sa), "token");
    let facts = |target: &Value, name: &str, uid: Option<&str>| Facts {
        target: Some(target.clone()),
        bound: Some((name.into(), uid.map(str::to_string))),
        ..Default::default()
    };
    assert_eq!(needs(&tok("robot")), Need::TokenBinding);
    // Its own VMI's serviceAccount volume, bound to that VMI.
    assert_eq!(
        decide("n1", &tok("robot"), &facts(&mine, "vm", Some("u1"))),
        Verdict::Allow
    );
    assert_eq!(
        decide("n1", &tok("robot"), &facts(&mine, "vm", None)),
        Verdict::Allow
    );
    let denied = |v: Verdict| matches!(v, Verdict::Deny(_));
    // A ServiceAccount used only by another node's VMI, bound to that VMI or to its own.
    assert!(denied(decide(
        "n1",
        &tok("spy"),
        &facts(&theirs, "other", Some("u2"))
    )));
    assert!(denied(decide(
        "n1",
        &tok("spy"),
        &facts(&mine, "vm", Some("u1"))
    )));
    // An unreferenced ServiceAccount (the namespace's default) bound to its own VMI.
    assert!(denied(decide(
        "n1",
        &tok("default"),
        &facts(&mine, "vm", Some("u1"))
    )));
    // Another uid (a recreated VMI), no binding, a VMI that does not exist.
    assert!(denied(decide(
        "n1",
        &tok("robot"),
        &facts(&mine, "vm", Some("u9"))
    )));
    assert!(denied(decide("n1", &tok("robot"), &Facts::default())));
    let gone = Facts {
        bound: Some(("vm".into(), None)),
        ..Default::default()
    };
    assert!(denied(decide("n1", &tok("robot"), &gone)));
    // The migration target's node may ask too.
    let mut migrating = mine.clone();
    migrating["status"]["migrationState"]["targetNode"] = json!("n3");
    assert_eq!(
        decide("n3", &tok("robot"), &facts(&migrating, "vm", Some("u1"))),
        Verdict::Allow
    );
    // Other ServiceAccount subresources stay RBAC's.
    assert_eq!(
        decide(
            "n1",
            &sub(at("get", "", "serviceaccounts", "a", "robot"), "x"),
            &Facts::default()
        ),
        Verdict::Rbac
    );
}

#[test]
fn own_nmstate_objects_only() {
    const G: &str = "nmstate.io";
    let d = |a: &Attributes, f: &Facts| decide("n1", a, f);
    let denied = |v: Verdict| matches!(v, Verdict::Deny(_));
    let none = Facts::default();
    let named = |n: &str| Facts {
        body_name: Some(n.into()),
        ..Default::default()
    };
    // NodeNetworkState: its own only.
    let nns = |verb: &str, name: &str| at(verb, G, "nodenetworkstates", "", name);
    assert_eq!(d(&nns("list", ""), &none), Verdict::Allow);
    assert_eq!(d(&nns("get", "n2"), &none), Verdict::Allow);
    assert_eq!(d(&nns("create", ""), &named("n1")), Verdict::Allow);
    assert!(denied(d(&nns("create", ""), &named("n2"))));
    assert_eq!(
        d(&sub(nns("update", "n1"), "status"), &none),
        Verdict::Allow
    );
    assert!(denied(d(&sub(nns("update", "n2"), "status"), &none)));
    assert!(denied(d(&nns("patch", "n2"), &none)));
    assert!(denied(d(&nns("delete", "n2"), &none)));
    assert!(denied(d(&nns("deletecollection", ""), &none)));
    assert_eq!(needs(&nns("create", "")), Need::BodyName);

    // Enactments: `<node>.<policy>` labelled with the node.
    let nnce = |verb: &str, name: &str| at(verb, G, "nodenetworkconfigurationenactments", "", name);
    let body = |name: &str, label: &str| Facts {
        body_name: Some(name.into()),
        body_node_label: Some(label.into()),
        ..Default::default()
    };
    let stored = |label: &str| Facts {
        target: Some(json!({"metadata": {"labels": {"nmstate.io/node": label}}})),
        ..Default::default()
    };
    assert_eq!(needs(&nnce("create", "")), Need::BodyMeta);
    assert_eq!(
        needs(&sub(nnce("update", "n1.p"), "status")),
        Need::Enactment
    );
    assert_eq!(needs(&nnce("delete", "n1.p")), Need::Enactment);
    assert_eq!(d(&nnce("list", ""), &none), Verdict::Allow);
    assert_eq!(d(&nnce("create", ""), &body("n1.p", "n1")), Verdict::Allow);
    // Another node's name, its label, or a bare prefix.
    assert!(denied(d(&nnce("create", ""), &body("n2.p", "n1"))));
    assert!(denied(d(&nnce("create", ""), &body("n1.p", "n2"))));
    assert!(denied(d(&nnce("create", ""), &body("n1.", "n1"))));
    assert!(denied(d(&nnce("create", ""), &named("n1.p"))));
    let st = |verb: &str, name: &str| sub(nnce(verb, name), "status");
    assert_eq!(d(&st("update", "n1.p"), &stored("n1")), Verdict::Allow);
    assert_eq!(d(&st("patch", "n1.p"), &stored("n1")), Verdict::Allow);
    assert!(denied(d(&st("update", "n2.p"), &stored("n2"))));
    // Named like n1's but labelled for another node (node names may hold dots): not n1's.
    assert!(denied(d(&st("update", "n1.p"), &stored("n2"))));
    assert!(denied(d(&st("update", "n1.p"), &none)));
    assert_eq!(d(&nnce("delete", "n1.p"), &stored("n1")), Verdict::Allow);
    assert!(denied(d(&nnce("delete", "n2.p"), &stored("n2"))));
    // The main resource (labels, owner) is never written by a node.
    assert!(denied(d(&nnce("update", "n1.p"), &stored("n1"))));
    assert!(denied(d(&nnce("patch", "n1.p"), &stored("n1"))));
    assert!(denied(d(&nnce("deletecollection", ""), &none)));

    // Policies: read, and write the status (not the spec).
    let nncp = |verb: &str, name: &str| at(verb, G, "nodenetworkconfigurationpolicies", "", name);
    assert_eq!(d(&nncp("list", ""), &none), Verdict::Allow);
    assert_eq!(d(&nncp("watch", ""), &none), Verdict::Allow);
    assert_eq!(
        d(&sub(nncp("update", "p"), "status"), &none),
        Verdict::Allow
    );
    assert_eq!(d(&sub(nncp("patch", "p"), "status"), &none), Verdict::Allow);
    for verb in ["create", "update", "patch", "delete", "deletecollection"] {
        assert!(denied(d(&nncp(verb, "p"), &named("p"))), "{verb}");
    }
}
