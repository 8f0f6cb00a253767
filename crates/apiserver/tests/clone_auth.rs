//! Writes whose authority a tenant must not hold, against a real server. CDI's cross-namespace
//! clone authorization: a ServiceAccount of
//! namespace b that may create DataVolumes and VirtualMachines in b cannot clone a claim of
//! namespace a (a DataVolume with `source.pvc.namespace: a`, or a VM's `dataVolumeTemplates`
//! naming it): 403 naming the field and `datavolumes/source`; once a Role in a grants it
//! `create` on `datavolumes/source`, both are accepted. A same-namespace source needs nothing.
//! And a tenant's VMI (or VM template) cannot carry its own user-defined network addresses.

mod common;

use anyhow::{Context, Result};
use serde_json::{Value, json};

const ROLES: &str = r#"
apiVersion: v1
kind: ServiceAccount
metadata: {name: bob, namespace: b}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: writer, namespace: b}
rules:
- apiGroups: [cdi.kubevirt.io]
  resources: [datavolumes]
  verbs: [create, get, list]
- apiGroups: [kubevirt.io]
  resources: [virtualmachines]
  verbs: [create, get, list]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: bob-writer, namespace: b}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: writer}
subjects: [{kind: ServiceAccount, name: bob, namespace: b}]
"#;

const GRANT: &str = r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: clone-source, namespace: a}
rules:
- apiGroups: [cdi.kubevirt.io]
  resources: [datavolumes/source]
  verbs: [create]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: bob-clone-source, namespace: a}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: clone-source}
subjects: [{kind: ServiceAccount, name: bob, namespace: b}]
"#;

fn dv(name: &str, src_ns: Option<&str>) -> Value {
    let mut pvc = json!({"name": "golden"});
    if let Some(n) = src_ns {
        pvc["namespace"] = json!(n);
    }
    json!({"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
        "metadata": {"name": name, "namespace": "b"},
        "spec": {"source": {"pvc": pvc},
            "storage": {"resources": {"requests": {"storage": "64Mi"}}}}})
}

fn vm(name: &str) -> Value {
    json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": "b"},
        "spec": {"runStrategy": "Halted",
            "dataVolumeTemplates": [{"metadata": {"name": format!("{name}-root")},
                "spec": {"source": {"pvc": {"namespace": "a", "name": "golden"}},
                    "storage": {"resources": {"requests": {"storage": "64Mi"}}}}}],
            "template": {"spec": {"domain": {"devices": {},
                "resources": {"requests": {"memory": "128Mi"}}},
                "volumes": [{"name": "root", "dataVolume": {"name": format!("{name}-root")}}]}}}})
}

#[tokio::test]
async fn cloning_from_another_namespace_needs_datavolumes_source_there() -> Result<()> {
    common::require_kubectl();
    let t = common::start().await?;
    for ns in ["a", "b"] {
        t.kubectl_ok(&["create", "namespace", ns]).await?;
    }
    t.apply(ROLES).await?;
    let token = t
        .kubectl_ok(&["-n", "b", "create", "token", "bob", "--duration=1h"])
        .await?;
    let token = token.trim();
    let post = |path: &'static str, body: Value| {
        let token = token.to_string();
        let t = &t;
        async move {
            t.request_as(
                Some(&token),
                "POST",
                path,
                Some("application/json"),
                serde_json::to_vec(&body).context("json")?,
            )
            .await
        }
    };
    const DVS: &str = "/apis/cdi.kubevirt.io/v1beta1/namespaces/b/datavolumes";
    const VMS: &str = "/apis/kubevirt.io/v1/namespaces/b/virtualmachines";

    // A source in b itself needs nothing more.
    let r = post(DVS, dv("local", None)).await?;
    assert_eq!(r.status, 201, "{}", r.text());
    // From a: refused, naming the field and the permission.
    let r = post(DVS, dv("stolen", Some("a"))).await?;
    assert_eq!(r.status, 403, "{}", r.text());
    let m = r.json()["message"].as_str().unwrap_or("").to_string();
    assert!(
        m.contains("spec.source.pvc.namespace")
            && m.contains("datavolumes/source")
            && m.contains("system:serviceaccount:b:bob"),
        "{m}"
    );
    let r = post(VMS, vm("vm1")).await?;
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(
        r.text()
            .contains("spec.dataVolumeTemplates[0].spec.source.pvc.namespace"),
        "{}",
        r.text()
    );
    // The admin (system:masters) may.
    t.apply(&serde_json::to_string(&dv("by-admin", Some("a")))?)
        .await?;

    // Granted in a: both are accepted.
    t.apply(GRANT).await?;
    let mut ok = false;
    for _ in 0..50 {
        let r = post(DVS, dv("allowed", Some("a"))).await?;
        if r.status == 201 {
            ok = true;
            break;
        }
        assert_eq!(r.status, 403, "{}", r.text());
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(ok, "the grant in namespace a was not honoured");
    let r = post(VMS, vm("vm2")).await?;
    assert_eq!(r.status, 201, "{}", r.text());
    Ok(())
}

/// A tenant cannot pick its VMI's user-defined network address: the `k8s.ovn.org/pod-networks`
/// annotation on a VMI, or in a VM's template, is the platform's (403 naming the field); the
/// admin (the server's controllers) may write it.
#[tokio::test]
async fn tenants_cannot_write_udn_addresses() -> Result<()> {
    common::require_kubectl();
    let t = common::start().await?;
    t.kubectl_ok(&["create", "namespace", "b"]).await?;
    t.apply(ROLES).await?;
    t.apply(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {name: vmis, namespace: b}\nrules:\n- apiGroups: [kubevirt.io]\n  resources: [virtualmachineinstances]\n  verbs: [create, get, list, patch, update]\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {name: bob-vmis, namespace: b}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: vmis}\nsubjects: [{kind: ServiceAccount, name: bob, namespace: b}]\n",
    )
    .await?;
    let token = t
        .kubectl_ok(&["-n", "b", "create", "token", "bob", "--duration=1h"])
        .await?;
    let token = token.trim().to_string();
    let taken = r#"{"b/shared":{"ip_addresses":["10.200.0.5/24"],"role":"secondary"}}"#;
    let vmi = |name: &str, ann: bool| {
        let mut v = json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": name, "namespace": "b"},
            "spec": {"domain": {"devices": {}, "resources": {"requests": {"memory": "64Mi"}}}}});
        if ann {
            v["metadata"]["annotations"] = json!({"k8s.ovn.org/pod-networks": taken});
        }
        v
    };
    let send = |method: &'static str, path: String, ct: &'static str, body: Value| {
        let (t, token) = (&t, token.clone());
        async move {
            t.request_as(
                Some(&token),
                method,
                &path,
                Some(ct),
                serde_json::to_vec(&body)?,
            )
            .await
        }
    };
    const VMIS: &str = "/apis/kubevirt.io/v1/namespaces/b/virtualmachineinstances";
    let r = send("POST", VMIS.into(), "application/json", vmi("grab", true)).await?;
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(
        r.text()
            .contains("metadata.annotations[k8s.ovn.org/pod-networks]"),
        "{}",
        r.text()
    );
    let mut vm = vm("vm-grab");
    vm["spec"]["dataVolumeTemplates"] = json!([]);
    vm["spec"]["template"]["metadata"] =
        json!({"annotations": {"k8s.ovn.org/pod-networks": taken}});
    let r = send(
        "POST",
        "/apis/kubevirt.io/v1/namespaces/b/virtualmachines".into(),
        "application/json",
        vm,
    )
    .await?;
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(
        r.text()
            .contains("spec.template.metadata.annotations[k8s.ovn.org/pod-networks]"),
        "{}",
        r.text()
    );
    // A VMI without it is fine; patching it in later is refused too.
    let r = send("POST", VMIS.into(), "application/json", vmi("plain", false)).await?;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = send(
        "PATCH",
        format!("{VMIS}/plain"),
        "application/merge-patch+json",
        json!({"metadata": {"annotations": {"k8s.ovn.org/pod-networks": taken}}}),
    )
    .await?;
    assert_eq!(r.status, 403, "{}", r.text());
    // The admin (system:masters, as the server's controllers) may.
    t.apply(&serde_json::to_string(&vmi("by-admin", true))?)
        .await?;
    Ok(())
}
