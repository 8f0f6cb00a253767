//! The `/scale` subresource (autoscaling/v1 Scale for VirtualMachinePools) and
//! VirtualMachineInstancePresets applied at VMI creation, over raw HTTPS.

mod common;

use anyhow::Result;
use serde_json::{Value, json};

const POOLS: &str = "/apis/pool.kubevirt.io/v1beta1/namespaces/default/virtualmachinepools";
const PRESETS: &str = "/apis/kubevirt.io/v1/namespaces/default/virtualmachineinstancepresets";
const VMIS: &str = "/apis/kubevirt.io/v1/namespaces/default/virtualmachineinstances";

fn pool() -> Value {
    json!({"apiVersion": "pool.kubevirt.io/v1beta1", "kind": "VirtualMachinePool",
        "metadata": {"name": "p"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "p"}},
            "virtualMachineTemplate": {"metadata": {"labels": {"app": "p"}},
                "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {
                    "memory": {"guest": "128Mi"}, "devices": {}}}}}}}})
}

async fn send(
    t: &common::TestServer,
    method: &str,
    path: &str,
    ct: &str,
    body: Value,
) -> Result<common::Resp> {
    let token = t.srv().token.clone();
    t.request_as(
        Some(&token),
        method,
        path,
        Some(ct),
        serde_json::to_vec(&body)?,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_reads_and_writes_the_pool_replicas() -> Result<()> {
    let t = common::start().await?;
    let r = t.request("POST", POOLS, Some(pool())).await?;
    assert_eq!(r.status, 201, "{}", r.text());
    let scale = format!("{POOLS}/p/scale");
    let r = t.request("GET", &scale, None).await?;
    assert_eq!(r.status, 200, "{}", r.text());
    let s = r.json();
    assert_eq!(s["kind"], "Scale");
    assert_eq!(s["apiVersion"], "autoscaling/v1");
    assert_eq!(s["spec"]["replicas"], 2);

    // What `kubectl scale` sends.
    let merge = "application/merge-patch+json";
    let r = send(&t, "PATCH", &scale, merge, json!({"spec": {"replicas": 5}})).await?;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["spec"]["replicas"], 5);
    let p = t.request("GET", &format!("{POOLS}/p"), None).await?.json();
    assert_eq!(p["spec"]["replicas"], 5);
    assert_eq!(p["metadata"]["generation"], 2, "a spec change bumps it");

    let ops = json!([{"op": "replace", "path": "/spec/replicas", "value": 1}]);
    let r = send(&t, "PATCH", &scale, "application/json-patch+json", ops).await?;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["spec"]["replicas"], 1);

    // PUT with a stale resourceVersion: 409; a negative count: 422 naming spec.replicas.
    let mut s = t.request("GET", &scale, None).await?.json();
    s["spec"]["replicas"] = json!(3);
    let mut stale = s.clone();
    stale["metadata"]["resourceVersion"] = json!("1");
    let r = send(&t, "PUT", &scale, "application/json", stale).await?;
    assert_eq!(r.status, 409, "{}", r.text());
    let r = send(&t, "PUT", &scale, "application/json", s).await?;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["spec"]["replicas"], 3);
    let r = send(
        &t,
        "PATCH",
        &scale,
        merge,
        json!({"spec": {"replicas": -4}}),
    )
    .await?;
    assert_eq!(r.status, 422, "{}", r.text());
    assert_eq!(r.json()["details"]["causes"][0]["field"], "spec.replicas");

    // Kinds without a scale subresource have no such path; nor do missing pools.
    let r = t
        .request("GET", "/api/v1/namespaces/default/configmaps/x/scale", None)
        .await?;
    assert_eq!(r.status, 404);
    let r = t
        .request("GET", &format!("{POOLS}/missing/scale"), None)
        .await?;
    assert_eq!(r.status, 404);

    let d = t
        .request("GET", "/apis/pool.kubevirt.io/v1beta1", None)
        .await?
        .json();
    let names: Vec<&str> = d["resources"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["name"].as_str())
        .collect();
    assert!(names.contains(&"virtualmachinepools/scale"), "{names:?}");
    t.shutdown().await;
    Ok(())
}

fn preset(name: &str, cores: u32) -> Value {
    json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstancePreset",
        "metadata": {"name": name},
        "spec": {"selector": {"matchLabels": {"size": "small"}},
            "domain": {"cpu": {"cores": cores}, "resources": {"requests": {"memory": "64Mi"}}}}})
}

fn vmi(name: &str, domain: Value) -> Value {
    json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "labels": {"size": "small"}},
        "spec": {"domain": domain}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presets_are_merged_into_new_vmis() -> Result<()> {
    let t = common::start().await?;
    let r = t.request("POST", PRESETS, Some(preset("small", 2))).await?;
    assert_eq!(r.status, 201, "{}", r.text());

    let r = t
        .request("POST", VMIS, Some(vmi("a", json!({"devices": {}}))))
        .await?;
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    assert_eq!(v["spec"]["domain"]["cpu"]["cores"], 2);
    assert_eq!(
        v["spec"]["domain"]["resources"]["requests"]["memory"],
        "64Mi"
    );
    assert_eq!(
        v["metadata"]["annotations"]["virtualmachineinstancepreset.kubevirt.io/small"],
        "kubevirt.io/v1"
    );

    // The VMI's own value wins, with a warning.
    let own = json!({"devices": {}, "cpu": {"cores": 1}});
    let r = t.request("POST", VMIS, Some(vmi("b", own))).await?;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["spec"]["domain"]["cpu"]["cores"], 1);
    let warning = r
        .headers
        .get("warning")
        .and_then(|w| w.to_str().ok())
        .unwrap_or_default()
        .to_string();
    assert!(warning.contains("spec.domain.cpu.cores"), "{warning:?}");

    // An excluded VMI is untouched.
    let mut excluded = vmi("c", json!({"devices": {}, "memory": {"guest": "64Mi"}}));
    excluded["metadata"]["annotations"] =
        json!({"virtualmachineinstancepresets.admission.kubevirt.io/exclude": "true"});
    let r = t.request("POST", VMIS, Some(excluded)).await?;
    assert_eq!(r.status, 201, "{}", r.text());
    assert!(
        r.json()["spec"]["domain"].get("cpu").is_none(),
        "{}",
        r.text()
    );

    // Two presets that disagree refuse the VMI naming the field.
    let r = t.request("POST", PRESETS, Some(preset("tiny", 4))).await?;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = t
        .request("POST", VMIS, Some(vmi("d", json!({"devices": {}}))))
        .await?;
    assert_eq!(r.status, 422, "{}", r.text());
    assert_eq!(
        r.json()["details"]["causes"][0]["field"],
        "spec.domain.cpu.cores"
    );
    t.shutdown().await;
    Ok(())
}
