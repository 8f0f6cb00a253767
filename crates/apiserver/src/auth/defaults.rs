//! The default ClusterRoles and ClusterRoleBindings written at server start: Kubernetes'
//! `cluster-admin`, `admin`, `edit`, `view` (aggregated from roles labelled
//! `rbac.authorization.k8s.io/aggregate-to-{admin,edit,view}`), `system:discovery`,
//! `system:basic-user`, `system:public-info-viewer` and their bindings to
//! `system:authenticated`, `system:kubelet-api-admin` (`nodes/proxy`, bound to nobody),
//! `system:monitoring` (bound to that group), `system:auth-delegator` (bound to nobody) and
//! ferrovirt's `ferrovirt:metrics-reader` (the server's and the agents' `/metrics`);
//! KubeVirt's `kubevirt.io:{admin,edit,view}` (aggregated into admin/edit/view as KubeVirt
//! labels them), `kubevirt.io:migrate` (not aggregated, as since
//! KubeVirt 1.5) and `kubevirt.io:default`; CDI's DataVolume rights in the same way.
//!
//! Reconciliation follows Kubernetes' `rbac.authorization.kubernetes.io/autoupdate`
//! annotation: a missing default is created; one annotated `"true"` (as created) gets the
//! default rules it lacks added and its aggregationRule and roleRef/subjects restored (rules
//! a user added stay); one a user annotated `"false"` is left alone.

use serde_json::{Value, json};

const AUTOUPDATE: &str = "rbac.authorization.kubernetes.io/autoupdate";
const AGG: &str = "rbac.authorization.k8s.io/aggregate-to-";

fn rule(verbs: &[&str], groups: &[&str], resources: &[&str]) -> Value {
    json!({"verbs": verbs, "apiGroups": groups, "resources": resources})
}

fn urls(verbs: &[&str], urls: &[&str]) -> Value {
    json!({"verbs": verbs, "nonResourceURLs": urls})
}

/// The ClusterRole that lets Prometheus scrape the API server and the agents.
pub const METRICS_READER: &str = "ferrovirt:metrics-reader";

const READ: &[&str] = &["get", "list", "watch"];
const WRITE: &[&str] = &["create", "delete", "deletecollection", "patch", "update"];
const ALL: &[&str] = &[
    "get",
    "list",
    "watch",
    "create",
    "delete",
    "deletecollection",
    "patch",
    "update",
];
/// KubeVirt's edit verbs: everything but deletecollection.
const EDIT: &[&str] = &[
    "get", "delete", "create", "update", "patch", "list", "watch",
];

fn cluster_role(name: &str, labels: Value, rules: Vec<Value>) -> Value {
    json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": labels,
                     "annotations": {AUTOUPDATE: "true"}},
        "rules": rules,
    })
}

fn aggregated(name: &str, labels: Value, selects: &str) -> Value {
    let mut r = cluster_role(name, labels, vec![]);
    r["aggregationRule"] =
        json!({"clusterRoleSelectors": [{"matchLabels": {format!("{AGG}{selects}"): "true"}}]});
    r
}

fn binding(name: &str, role: &str, groups: &[&str]) -> Value {
    let subjects: Vec<Value> = groups
        .iter()
        .map(|g| json!({"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": g}))
        .collect();
    json!({
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name, "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"},
                     "annotations": {AUTOUPDATE: "true"}},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": subjects,
    })
}

fn agg_to(which: &[&str]) -> Value {
    let mut m = serde_json::Map::new();
    m.insert("kubernetes.io/bootstrapping".into(), json!("rbac-defaults"));
    for w in which {
        m.insert(format!("{AGG}{w}"), json!("true"));
    }
    Value::Object(m)
}

const SUB: &str = "subresources.kubevirt.io";

/// KubeVirt's VMI subresources read with `get` (console, VNC, guest info, …).
const VMI_GET: &[&str] = &[
    "virtualmachineinstances/console",
    "virtualmachineinstances/vnc",
    "virtualmachineinstances/vnc/screenshot",
    "virtualmachineinstances/portforward",
    "virtualmachineinstances/guestosinfo",
    "virtualmachineinstances/filesystemlist",
    "virtualmachineinstances/userlist",
    "virtualmachineinstances/sev/fetchcertchain",
    "virtualmachineinstances/sev/querylaunchmeasurement",
    "virtualmachineinstances/usbredir",
];
/// KubeVirt's VMI subresources changed with `update` (pause, reset, …).
const VMI_UPDATE: &[&str] = &[
    "virtualmachineinstances/pause",
    "virtualmachineinstances/unpause",
    "virtualmachineinstances/addvolume",
    "virtualmachineinstances/removevolume",
    "virtualmachineinstances/freeze",
    "virtualmachineinstances/unfreeze",
    "virtualmachineinstances/softreboot",
    "virtualmachineinstances/reset",
    "virtualmachineinstances/sev/setupsession",
    "virtualmachineinstances/sev/injectlaunchsecret",
];
const VM_UPDATE: &[&str] = &[
    "virtualmachines/start",
    "virtualmachines/stop",
    "virtualmachines/restart",
    "virtualmachines/addvolume",
    "virtualmachines/removevolume",
    "virtualmachines/memorydump",
];
const VIRT_KINDS: &[&str] = &[
    "virtualmachines",
    "virtualmachineinstances",
    "virtualmachineinstancepresets",
    "virtualmachineinstancereplicasets",
];
const INSTANCETYPES: &[&str] = &[
    "virtualmachineinstancetypes",
    "virtualmachineclusterinstancetypes",
    "virtualmachinepreferences",
    "virtualmachineclusterpreferences",
];

/// KubeVirt's rules for admin (`all` verbs) or edit (`EDIT` verbs).
fn kubevirt_write_rules(verbs: &[&str]) -> Vec<Value> {
    vec![
        rule(&["get"], &[SUB], VMI_GET),
        rule(&["update"], &[SUB], VMI_UPDATE),
        rule(
            &["get"],
            &[SUB],
            &["virtualmachines/expand-spec", "virtualmachines/portforward"],
        ),
        rule(&["update"], &[SUB], VM_UPDATE),
        rule(&["update"], &[SUB], &["expand-vm-spec"]),
        rule(verbs, &["kubevirt.io"], VIRT_KINDS),
        rule(
            READ,
            &["kubevirt.io"],
            &["virtualmachineinstancemigrations"],
        ),
        rule(
            verbs,
            &["snapshot.kubevirt.io"],
            &[
                "virtualmachinesnapshots",
                "virtualmachinesnapshotcontents",
                "virtualmachinerestores",
            ],
        ),
        rule(verbs, &["export.kubevirt.io"], &["virtualmachineexports"]),
        rule(verbs, &["clone.kubevirt.io"], &["virtualmachineclones"]),
        rule(verbs, &["instancetype.kubevirt.io"], INSTANCETYPES),
        rule(verbs, &["pool.kubevirt.io"], &["virtualmachinepools"]),
        rule(&["get", "list"], &["kubevirt.io"], &["kubevirts"]),
        rule(READ, &["migrations.kubevirt.io"], &["migrationpolicies"]),
    ]
}

fn kubevirt_roles() -> Vec<Value> {
    let kv = |extra: &str| {
        let mut l = serde_json::Map::new();
        l.insert("kubevirt.io".into(), json!(""));
        if !extra.is_empty() {
            l.insert(format!("{AGG}{extra}"), json!("true"));
        }
        Value::Object(l)
    };
    vec![
        cluster_role(
            "kubevirt.io:default",
            kv(""),
            vec![
                rule(&["get", "list"], &["kubevirt.io"], &["kubevirts"]),
                rule(&["get", "list"], &[SUB], &["version", "guestfs"]),
            ],
        ),
        cluster_role("kubevirt.io:admin", kv("admin"), kubevirt_write_rules(ALL)),
        cluster_role("kubevirt.io:edit", kv("edit"), kubevirt_write_rules(EDIT)),
        cluster_role(
            "kubevirt.io:view",
            kv("view"),
            vec![
                rule(&["get", "list"], &["kubevirt.io"], &["kubevirts"]),
                rule(
                    &["get"],
                    &[SUB],
                    &[
                        "virtualmachines/expand-spec",
                        "virtualmachineinstances/guestosinfo",
                        "virtualmachineinstances/filesystemlist",
                        "virtualmachineinstances/userlist",
                        "virtualmachineinstances/sev/fetchcertchain",
                        "virtualmachineinstances/sev/querylaunchmeasurement",
                    ],
                ),
                rule(&["update"], &[SUB], &["expand-vm-spec"]),
                rule(
                    READ,
                    &["kubevirt.io"],
                    &[
                        "virtualmachines",
                        "virtualmachineinstances",
                        "virtualmachineinstancepresets",
                        "virtualmachineinstancereplicasets",
                        "virtualmachineinstancemigrations",
                    ],
                ),
                rule(
                    READ,
                    &["snapshot.kubevirt.io"],
                    &[
                        "virtualmachinesnapshots",
                        "virtualmachinesnapshotcontents",
                        "virtualmachinerestores",
                    ],
                ),
                rule(READ, &["export.kubevirt.io"], &["virtualmachineexports"]),
                rule(READ, &["clone.kubevirt.io"], &["virtualmachineclones"]),
                rule(READ, &["instancetype.kubevirt.io"], INSTANCETYPES),
                rule(READ, &["pool.kubevirt.io"], &["virtualmachinepools"]),
                rule(READ, &["migrations.kubevirt.io"], &["migrationpolicies"]),
            ],
        ),
        cluster_role(
            "kubevirt.io:migrate",
            kv(""),
            vec![
                rule(&["update"], &[SUB], &["virtualmachines/migrate"]),
                rule(ALL, &["kubevirt.io"], &["virtualmachineinstancemigrations"]),
            ],
        ),
        // CDI's DataVolume rights, aggregated the same way.
        cluster_role(
            "cdi.kubevirt.io:edit",
            kv("edit"),
            vec![
                rule(
                    ALL,
                    &["cdi.kubevirt.io"],
                    &["datavolumes", "datasources", "dataimportcrons"],
                ),
                rule(&["create"], &["cdi.kubevirt.io"], &["datavolumes/source"]),
                rule(
                    &["create"],
                    &["upload.cdi.kubevirt.io"],
                    &["uploadtokenrequests"],
                ),
            ],
        ),
        cluster_role(
            "cdi.kubevirt.io:view",
            kv("view"),
            vec![
                rule(
                    READ,
                    &["cdi.kubevirt.io"],
                    &[
                        "datavolumes",
                        "datasources",
                        "dataimportcrons",
                        "storageprofiles",
                        "cdis",
                        "cdiconfigs",
                    ],
                ),
                rule(&["create"], &["cdi.kubevirt.io"], &["datavolumes/source"]),
            ],
        ),
    ]
}

/// Every default ClusterRole and ClusterRoleBinding.
pub fn objects() -> Vec<Value> {
    let boot = || json!({"kubernetes.io/bootstrapping": "rbac-defaults"});
    let core_ns_read = &[
        "configmaps",
        "events",
        "persistentvolumeclaims",
        "persistentvolumeclaims/status",
        "pods",
        "pods/log",
        "pods/status",
        "serviceaccounts",
    ];
    let mut out = vec![
        cluster_role(
            "cluster-admin",
            boot(),
            vec![rule(&["*"], &["*"], &["*"]), urls(&["*"], &["*"])],
        ),
        {
            let mut r = aggregated("admin", boot(), "admin");
            r["metadata"]["labels"] = boot();
            r
        },
        aggregated("edit", agg_to(&["admin"]), "edit"),
        aggregated("view", agg_to(&["edit"]), "view"),
        cluster_role(
            "system:aggregate-to-admin",
            agg_to(&["admin"]),
            vec![
                rule(
                    ALL,
                    &["rbac.authorization.k8s.io"],
                    &["roles", "rolebindings"],
                ),
                rule(
                    &["create"],
                    &["authorization.k8s.io"],
                    &["localsubjectaccessreviews"],
                ),
            ],
        ),
        cluster_role(
            "system:aggregate-to-edit",
            agg_to(&["edit"]),
            vec![
                rule(
                    WRITE,
                    &[""],
                    &[
                        "configmaps",
                        "persistentvolumeclaims",
                        "secrets",
                        "serviceaccounts",
                    ],
                ),
                rule(READ, &[""], &["secrets"]),
                rule(&["create"], &[""], &["serviceaccounts/token"]),
                rule(&["create"], &["policy"], &["pods/eviction"]),
                rule(&["impersonate"], &[""], &["serviceaccounts"]),
            ],
        ),
        cluster_role(
            "system:aggregate-to-view",
            agg_to(&["view"]),
            vec![
                rule(READ, &[""], core_ns_read),
                rule(READ, &[""], &["namespaces", "namespaces/status"]),
                rule(READ, &["events.k8s.io"], &["events"]),
            ],
        ),
        cluster_role(
            "system:discovery",
            boot(),
            vec![urls(
                &["get"],
                &[
                    "/api",
                    "/api/*",
                    "/apis",
                    "/apis/*",
                    "/healthz",
                    "/livez",
                    "/openapi",
                    "/openapi/*",
                    "/readyz",
                    "/version",
                    "/version/",
                ],
            )],
        ),
        cluster_role(
            "system:basic-user",
            boot(),
            vec![
                rule(
                    &["create"],
                    &["authorization.k8s.io"],
                    &["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
                ),
                rule(
                    &["create"],
                    &["authentication.k8s.io"],
                    &["selfsubjectreviews"],
                ),
            ],
        ),
        cluster_role(
            "system:public-info-viewer",
            boot(),
            vec![urls(
                &["get"],
                &["/healthz", "/livez", "/readyz", "/version", "/version/"],
            )],
        ),
        // Kubernetes' role for full access to the nodes' APIs (the `nodes/proxy` subresource:
        // ferrovirt forwards only the agents' metrics and healthz); bound to nobody by default.
        cluster_role(
            "system:kubelet-api-admin",
            boot(),
            vec![
                rule(READ, &[""], &["nodes"]),
                rule(&["proxy"], &[""], &["nodes"]),
                rule(
                    &["*"],
                    &[""],
                    &[
                        "nodes/proxy",
                        "nodes/metrics",
                        "nodes/spec",
                        "nodes/stats",
                        "nodes/log",
                    ],
                ),
            ],
        ),
        // Kubernetes' role for the API server's metrics and health endpoints, bound to the
        // group `system:monitoring`.
        cluster_role(
            "system:monitoring",
            boot(),
            vec![urls(
                &["get"],
                &[
                    "/healthz",
                    "/healthz/*",
                    "/livez",
                    "/livez/*",
                    "/metrics",
                    "/metrics/slis",
                    "/readyz",
                    "/readyz/*",
                ],
            )],
        ),
        // Kubernetes' role for delegated authentication and authorization (TokenReview,
        // SubjectAccessReview); bound to nobody.
        cluster_role(
            "system:auth-delegator",
            boot(),
            vec![
                rule(&["create"], &["authentication.k8s.io"], &["tokenreviews"]),
                rule(
                    &["create"],
                    &["authorization.k8s.io"],
                    &["subjectaccessreviews"],
                ),
            ],
        ),
        // ferrovirt's role for Prometheus: the API server's `/metrics`, every agent's
        // `/metrics` (`nodes/metrics`, which the agent checks through a TokenReview and a
        // SubjectAccessReview, as a kubelet does) and the Nodes to find the agents; bound to
        // nobody.
        cluster_role(
            METRICS_READER,
            boot(),
            vec![
                urls(&["get"], &["/metrics"]),
                rule(&["get"], &[""], &["nodes/metrics"]),
                rule(READ, &[""], &["nodes"]),
            ],
        ),
        binding("cluster-admin", "cluster-admin", &["system:masters"]),
        binding(
            "system:monitoring",
            "system:monitoring",
            &["system:monitoring"],
        ),
        binding(
            "system:discovery",
            "system:discovery",
            &["system:authenticated"],
        ),
        binding(
            "system:basic-user",
            "system:basic-user",
            &["system:authenticated"],
        ),
        binding(
            "system:public-info-viewer",
            "system:public-info-viewer",
            &["system:authenticated", "system:unauthenticated"],
        ),
        binding(
            "kubevirt.io:default",
            "kubevirt.io:default",
            &["system:authenticated"],
        ),
    ];
    out.extend(kubevirt_roles());
    out
}

/// What to write for a default given what is stored: None to leave it as it is.
pub fn reconcile(default: &Value, stored: Option<&Value>) -> Option<Value> {
    let Some(stored) = stored else {
        return Some(default.clone());
    };
    if stored["metadata"]["annotations"][AUTOUPDATE] == "false" {
        return None;
    }
    let mut want = stored.clone();
    match default["kind"].as_str() {
        Some("ClusterRole") => {
            let mut rules: Vec<Value> = stored["rules"].as_array().cloned().unwrap_or_default();
            for r in default["rules"].as_array().into_iter().flatten() {
                if !rules.contains(r) {
                    rules.push(r.clone());
                }
            }
            want["rules"] = Value::Array(rules);
            if let Some(agg) = default.get("aggregationRule") {
                want["aggregationRule"] = agg.clone();
            }
            for (k, v) in default["metadata"]["labels"]
                .as_object()
                .into_iter()
                .flatten()
            {
                want["metadata"]["labels"][k] = v.clone();
            }
        }
        _ => {
            want["roleRef"] = default["roleRef"].clone();
            let mut subjects: Vec<Value> =
                stored["subjects"].as_array().cloned().unwrap_or_default();
            for s in default["subjects"].as_array().into_iter().flatten() {
                if !subjects.contains(s) {
                    subjects.push(s.clone());
                }
            }
            want["subjects"] = Value::Array(subjects);
        }
    }
    (want != *stored).then_some(want)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::rbac::{Attributes, Policy, UserInfo, authorize};

    fn split(objs: &[Value]) -> (Vec<Value>, Vec<Value>) {
        objs.iter()
            .cloned()
            .partition(|o| o["kind"] == "ClusterRole")
    }

    fn can(role: &str, verb: &str, group: &str, resource: &str, sub: &str) -> bool {
        let (roles, mut bindings) = split(&objects());
        bindings.push(json!({"metadata": {"name": "t"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "User", "name": "u"}]}));
        let p = Policy::from_json(&[], &roles, &[], &bindings);
        let u = UserInfo {
            name: "u".into(),
            groups: vec!["system:authenticated".into()],
            ..Default::default()
        };
        authorize(
            &p,
            &u,
            &Attributes {
                verb: verb.into(),
                resource_request: true,
                api_group: group.into(),
                resource: resource.into(),
                subresource: sub.into(),
                namespace: "n".into(),
                name: "x".into(),
                path: String::new(),
            },
        )
        .allowed()
    }

    #[test]
    fn kubevirt_roles_aggregate_into_kubernetes_roles() {
        assert!(can("edit", "create", "kubevirt.io", "virtualmachines", ""));
        assert!(can("edit", "update", SUB, "virtualmachines", "start"));
        assert!(can(
            "edit",
            "get",
            SUB,
            "virtualmachineinstances",
            "console"
        ));
        // edit aggregates into admin, view into edit.
        assert!(can("admin", "get", "", "configmaps", ""));
        assert!(can(
            "admin",
            "deletecollection",
            "kubevirt.io",
            "virtualmachines",
            ""
        ));
        assert!(can("view", "list", "kubevirt.io", "virtualmachines", ""));
        assert!(!can("view", "update", SUB, "virtualmachines", "start"));
        assert!(!can("view", "get", "", "secrets", ""));
        assert!(!can(
            "kubevirt.io:view",
            "update",
            SUB,
            "virtualmachines",
            "start"
        ));
        assert!(!can("kubevirt.io:edit", "get", "", "secrets", ""));
        // Migrations: only kubevirt.io:migrate, not admin (KubeVirt ≥ 1.5).
        assert!(!can(
            "admin",
            "create",
            "kubevirt.io",
            "virtualmachineinstancemigrations",
            ""
        ));
        assert!(can(
            "kubevirt.io:migrate",
            "create",
            "kubevirt.io",
            "virtualmachineinstancemigrations",
            ""
        ));
        assert!(can("cluster-admin", "delete", "", "nodes", ""));
        // The Node proxy: cluster-admin and system:kubelet-api-admin, not admin/edit/view.
        assert!(can("cluster-admin", "get", "", "nodes", "proxy"));
        assert!(can("system:kubelet-api-admin", "get", "", "nodes", "proxy"));
        for role in ["admin", "edit", "view", "kubevirt.io:admin"] {
            assert!(!can(role, "get", "", "nodes", "proxy"), "{role}");
        }
        // The metrics reader: the agents' metrics, not their proxy; the delegator reviews.
        assert!(can(METRICS_READER, "get", "", "nodes", "metrics"));
        assert!(can(METRICS_READER, "list", "", "nodes", ""));
        assert!(!can(METRICS_READER, "get", "", "nodes", "proxy"));
        assert!(!can(METRICS_READER, "get", "", "secrets", ""));
        assert!(can(
            "system:auth-delegator",
            "create",
            "authentication.k8s.io",
            "tokenreviews",
            ""
        ));
    }

    #[test]
    fn autoupdate_annotation() {
        let d = objects()
            .into_iter()
            .find(|o| o["metadata"]["name"] == "view")
            .unwrap();
        assert_eq!(reconcile(&d, None), Some(d.clone()));
        assert_eq!(reconcile(&d, Some(&d)), None);
        // A user's extra rule stays; a lost aggregationRule comes back.
        let mut changed = d.clone();
        changed["rules"] = json!([{"verbs": ["get"], "apiGroups": [""], "resources": ["nodes"]}]);
        changed.as_object_mut().unwrap().remove("aggregationRule");
        let fixed = reconcile(&d, Some(&changed)).unwrap();
        assert_eq!(fixed["rules"].as_array().unwrap().len(), 1);
        assert_eq!(fixed["aggregationRule"], d["aggregationRule"]);
        // Opted out: left alone.
        changed["metadata"]["annotations"][AUTOUPDATE] = json!("false");
        assert_eq!(reconcile(&d, Some(&changed)), None);
    }
}
