//! kube-rs (what the controllers and agents use) against a real server: typed and dynamic
//! CRUD, patch flavours including server-side apply, status, watchers (plain, streaming list,
//! metadata).

mod common;

use std::time::Duration;

use anyhow::{Context, Result};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PartialObjectMeta,
    Patch, PatchParams, PostParams,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Config};
use serde_json::json;

async fn client(t: &common::TestServer) -> Result<Client> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kc = Kubeconfig::read_from(t.kubeconfig())?;
    let cfg = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(cfg)?)
}

fn cm(name: &str) -> ConfigMap {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "labels": {"app": "kube-rs"}},
        "data": {"k": "v"}
    }))
    .expect("configmap")
}

/// Waits (bounded) for the next watcher object named `name`.
async fn next_named<S>(stream: &mut S, name: &str) -> Result<()>
where
    S: futures::Stream<Item = Result<String, watcher::Error>> + Unpin,
{
    tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(n) = stream.try_next().await? {
            if n == name {
                return Ok(());
            }
        }
        anyhow::bail!("watch ended before {name} appeared")
    })
    .await
    .context("timed out waiting for a watch event")?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_crud_and_watchers() -> Result<()> {
    let t = common::start().await?;
    let client = client(&t).await?;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");

    let mut plain = watcher(cms.clone(), watcher::Config::default())
        .applied_objects()
        .map_ok(|o: ConfigMap| o.metadata.name.unwrap_or_default())
        .boxed();
    let mut streaming = watcher(cms.clone(), watcher::Config::default().streaming_lists())
        .applied_objects()
        .map_ok(|o: ConfigMap| o.metadata.name.unwrap_or_default())
        .boxed();
    let metas: Api<PartialObjectMeta<ConfigMap>> = Api::namespaced(client.clone(), "default");
    let mut meta = watcher(metas, watcher::Config::default().labels("app=kube-rs"))
        .applied_objects()
        .map_ok(|o| o.metadata.name.unwrap_or_default())
        .boxed();

    let created = cms.create(&PostParams::default(), &cm("one")).await?;
    assert!(created.metadata.uid.is_some());
    next_named(&mut plain, "one").await?;
    next_named(&mut streaming, "one").await?;
    next_named(&mut meta, "one").await?;

    let got = cms.get("one").await?;
    assert_eq!(
        got.data
            .clone()
            .unwrap_or_default()
            .get("k")
            .map(String::as_str),
        Some("v")
    );
    let list = cms
        .list(&ListParams::default().labels("app=kube-rs"))
        .await?;
    assert_eq!(list.items.len(), 1);

    cms.patch(
        "one",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"m": "1"}})),
    )
    .await?;
    cms.patch(
        "one",
        &PatchParams::default(),
        &Patch::Strategic(json!({"data": {"s": "2"}})),
    )
    .await?;
    let ssa = PatchParams::apply("kube-rs-test").force();
    cms.patch(
        "two",
        &ssa,
        &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "two"}, "data": {"a": "1"}})),
    )
    .await?;
    next_named(&mut plain, "two").await?;
    let data = cms.get("one").await?.data.unwrap_or_default();
    assert_eq!(
        (data.get("m"), data.get("s")),
        (Some(&"1".to_string()), Some(&"2".to_string()))
    );

    // Optimistic concurrency surfaces as a 409 kube::Error::Api.
    let mut stale = got.clone();
    stale.data = Some([("x".to_string(), "y".to_string())].into());
    match cms.replace("one", &PostParams::default(), &stale).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 409),
        other => panic!("expected a conflict, got {other:?}"),
    }

    cms.delete("one", &DeleteParams::default()).await?;
    assert!(cms.get_opt("one").await?.is_none());
    t.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_custom_resource_with_status() -> Result<()> {
    let t = common::start().await?;
    let client = client(&t).await?;
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "kubevirt.io",
        "v1",
        "VirtualMachine",
    ));
    let vms: Api<DynamicObject> = Api::namespaced_with(client, "default", &ar);
    let vm: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "dyn"},
        "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"devices": {}, "resources": {"requests": {"memory": "128Mi"}}}}}}
    }))?;
    vms.create(&PostParams::default(), &vm).await?;
    let patched = vms
        .patch_status(
            "dyn",
            &PatchParams::apply("kube-rs-test").force(),
            &Patch::Apply(json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
                "status": {"printableStatus": "Stopped", "conditions": [{"type": "Ready", "status": "False"}]}})),
        )
        .await?;
    assert_eq!(patched.data["status"]["printableStatus"], "Stopped");
    let st = vms.get_status("dyn").await?;
    assert_eq!(st.data["status"]["conditions"][0]["type"], "Ready");
    let all = vms
        .list(&ListParams::default().fields("metadata.name=dyn"))
        .await?;
    assert_eq!(all.items.len(), 1);
    t.shutdown().await;
    Ok(())
}

/// A uid in a patch or update body is a precondition, as in Kubernetes: a writer holding a
/// stale copy (e.g. a node agent that was stopped while its VMI was deleted and recreated
/// under the same name) cannot write into the new object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uid_in_the_body_is_a_precondition() -> Result<()> {
    let t = common::start().await?;
    let client = client(&t).await?;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let old = cms.create(&PostParams::default(), &cm("same-name")).await?;
    let old_uid = old.metadata.uid.clone().context("uid")?;
    cms.delete("same-name", &DeleteParams::default()).await?;
    let new = cms.create(&PostParams::default(), &cm("same-name")).await?;
    let new_uid = new.metadata.uid.clone().context("uid")?;
    assert_ne!(old_uid, new_uid);
    let stale = json!({"metadata": {"uid": old_uid}, "data": {"k": "stale"}});
    let err = cms
        .patch("same-name", &PatchParams::default(), &Patch::Merge(&stale))
        .await
        .expect_err("a patch for the old object");
    match err {
        kube::Error::Api(s) => {
            assert_eq!(s.code, 409, "{s:?}");
            assert!(s.message.contains("Precondition failed: UID"), "{s:?}");
        }
        e => panic!("{e}"),
    }
    let mut replace = old.clone();
    replace.metadata.resource_version = None;
    assert!(
        cms.replace("same-name", &PostParams::default(), &replace)
            .await
            .is_err(),
        "an update for the old object"
    );
    assert_eq!(cms.get("same-name").await?.data.unwrap()["k"], "v");
    // The right uid (or none) writes.
    let fresh = json!({"metadata": {"uid": new_uid}, "data": {"k": "fresh"}});
    cms.patch("same-name", &PatchParams::default(), &Patch::Merge(&fresh))
        .await?;
    assert_eq!(cms.get("same-name").await?.data.unwrap()["k"], "fresh");
    Ok(())
}
