//! Launcher Pod views over kube-rs (no QEMU: the VMIs' status is written by the test, as the
//! scheduler and agents would): a VMI given a node appears as a Pod in a watch; a VMI moved
//! to another node by a migration is the old Pod DELETED and a new one ADDED; an eviction of a
//! LiveMigrate VMI's Pod answers 429 and marks the VMI for evacuation; one of a VMI with
//! evictionStrategy None deletes the VMI and its Pod goes away.

mod common;

use std::time::Duration;

use anyhow::{Context, Result};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{
    ApiResource, DynamicObject, EvictParams, GroupVersionKind, ListParams, Patch, PatchParams,
    PostParams, WatchEvent, WatchParams,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use serde_json::json;

async fn client(t: &common::TestServer) -> Result<Client> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kc = Kubeconfig::read_from(t.kubeconfig())?;
    let cfg = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(cfg)?)
}

fn vmis(client: &Client) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstance"),
        "virtualmachineinstances",
    );
    Api::namespaced_with(client.clone(), "default", &ar)
}

async fn create_vmi(api: &Api<DynamicObject>, name: &str, strategy: &str) -> Result<()> {
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"evictionStrategy": strategy, "domain": {"devices": {}, "memory": {"guest": "64Mi"}}},
    }))?;
    api.create(&PostParams::default(), &obj).await?;
    Ok(())
}

async fn set_status(api: &Api<DynamicObject>, name: &str, status: serde_json::Value) -> Result<()> {
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(&json!({ "status": status })),
    )
    .await?;
    Ok(())
}

/// The next watch event: (type, pod name, node).
async fn next<S>(stream: &mut S) -> Result<(String, String, String)>
where
    S: futures::Stream<Item = kube::Result<WatchEvent<Pod>>> + Unpin,
{
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let ev = stream.try_next().await?.context("watch ended")?;
            let (t, p) = match ev {
                WatchEvent::Added(p) => ("ADDED", p),
                WatchEvent::Modified(p) => ("MODIFIED", p),
                WatchEvent::Deleted(p) => ("DELETED", p),
                WatchEvent::Bookmark(_) => continue,
                WatchEvent::Error(e) => anyhow::bail!("watch error {e:?}"),
            };
            let node = p
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default();
            return Ok((t.to_string(), p.metadata.name.unwrap_or_default(), node));
        }
    })
    .await
    .context("timed out waiting for a Pod event")?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launcher_pods_follow_their_vmis_and_accept_evictions() -> Result<()> {
    let t = common::start().await?;
    let client = client(&t).await?;
    let vmi_api = vmis(&client);
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let rv = pods
        .list(&ListParams::default())
        .await?
        .metadata
        .resource_version
        .unwrap_or_default();
    let mut watch = pods
        .watch(
            &WatchParams::default().labels("kubevirt.io=virt-launcher"),
            &rv,
        )
        .await?
        .boxed();

    create_vmi(&vmi_api, "mover", "LiveMigrate").await?;
    assert!(
        pods.list(&ListParams::default()).await?.items.is_empty(),
        "no node, no Pod"
    );
    set_status(
        &vmi_api,
        "mover",
        json!({"nodeName": "n1", "phase": "Running"}),
    )
    .await?;
    let (t1, first, node) = next(&mut watch).await?;
    assert_eq!((t1.as_str(), node.as_str()), ("ADDED", "n1"));
    assert!(first.starts_with("virt-launcher-mover-"), "{first}");
    let got = pods.get(&first).await?;
    assert_eq!(got.status.and_then(|s| s.phase).as_deref(), Some("Running"));
    let on_n1 = pods
        .list(&ListParams::default().fields("spec.nodeName=n1"))
        .await?;
    assert_eq!(on_n1.items.len(), 1);

    // An eviction of a LiveMigrate VMI's Pod: 429, the VMI marked with its node.
    // (Raw HTTP: kube-rs's client retries 429 answers by itself.)
    let path = format!("/api/v1/namespaces/default/pods/{first}/eviction");
    let body = json!({"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": first}});
    let resp = t.request("POST", &path, Some(body.clone())).await?;
    assert_eq!(resp.status, 429, "{}", resp.text());
    assert_eq!(resp.json()["reason"], "TooManyRequests");
    assert!(
        resp.text().contains("Eviction triggered evacuation"),
        "{}",
        resp.text()
    );
    let again = t.request("POST", &path, Some(body)).await?;
    assert_eq!(again.status, 429);
    assert!(again.text().contains("in progress"), "{}", again.text());
    let v = vmi_api.get("mover").await?;
    assert_eq!(v.data["status"]["evacuationNodeName"], "n1");
    let (t, name, _) = next(&mut watch).await?;
    assert_eq!((t.as_str(), name.as_str()), ("MODIFIED", first.as_str()));

    // The migration moves it: the old Pod goes, a new one comes.
    set_status(
        &vmi_api,
        "mover",
        json!({"nodeName": "n2", "migrationState": {
            "migrationUid": "m1", "sourceNode": "n1", "targetNode": "n2", "completed": true}}),
    )
    .await?;
    let (t, name, _) = next(&mut watch).await?;
    assert_eq!((t.as_str(), name.as_str()), ("DELETED", first.as_str()));
    let (t, second, node) = next(&mut watch).await?;
    assert_eq!((t.as_str(), node.as_str()), ("ADDED", "n2"));
    assert_ne!(second, first);
    let gone = pods.get(&first).await.expect_err("the old Pod is gone");
    assert!(
        matches!(gone, kube::Error::Api(ref s) if s.code == 404),
        "{gone:?}"
    );
    // Evicting the old Pod now: 404, which ends kubectl drain's retries.
    let gone = pods
        .evict(&first, &EvictParams::default())
        .await
        .expect_err("404");
    assert!(
        matches!(gone, kube::Error::Api(ref s) if s.code == 404),
        "{gone:?}"
    );

    // evictionStrategy None: evicted, the VMI deleted, its Pod gone.
    create_vmi(&vmi_api, "plain", "None").await?;
    set_status(
        &vmi_api,
        "plain",
        json!({"nodeName": "n1", "phase": "Running"}),
    )
    .await?;
    let (_, plain, _) = next(&mut watch).await?;
    pods.evict(&plain, &EvictParams::default()).await?;
    let (t, name, _) = next(&mut watch).await?;
    assert_eq!((t.as_str(), name.as_str()), ("DELETED", plain.as_str()));
    assert!(
        vmi_api.get_opt("plain").await?.is_none(),
        "the VMI was stopped"
    );

    // A launcher Pod cannot be deleted.
    let err = pods
        .delete(&second, &Default::default())
        .await
        .expect_err("refused");
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 405 && s.message.contains("evict")),
        "{err:?}"
    );
    Ok(())
}
