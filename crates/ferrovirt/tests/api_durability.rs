//! The API server's durability and multi-server consistency, through the real binary: a kill -9
//! in the middle of a burst of creates loses no acknowledged write (SQLite and etcd), and two
//! servers on one etcd serve the same objects and each other's changes through watches; bound
//! claims stay bound while a restarted server's controllers fill their caches.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferrovirt_testkit::{Cluster, ClusterOptions, Etcd};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams, ObjectMeta, PostParams, WatchEvent, WatchParams};

fn api_only(extra: &[&str]) -> ClusterOptions {
    let mut o = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
    o.node_name = None;
    o.extra_args = extra.iter().map(|s| s.to_string()).collect();
    o.extra_args.push("--disable-controllers".into());
    o
}

async fn client(c: &Cluster) -> anyhow::Result<kube::Client> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kc = kube::config::Kubeconfig::read_from(&c.kubeconfig)?;
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    Ok(kube::Client::try_from(cfg)?)
}

fn cm(name: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        data: Some([("k".to_string(), name.to_string())].into()),
        ..Default::default()
    }
}

/// Creates ConfigMaps as fast as possible from 4 tasks, kills the server with SIGKILL while
/// they run, restarts it, and checks every acknowledged create is there.
fn burst_then_kill(opts: ClusterOptions) -> anyhow::Result<()> {
    let mut c = Cluster::start(&opts)?;
    let rt = tokio::runtime::Runtime::new()?;
    let acked: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    rt.block_on(async {
        let client = client(&c).await?;
        let mut tasks = Vec::new();
        for t in 0..4 {
            let api: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
            let acked = acked.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0.. {
                    let name = format!("burst-{t}-{i}");
                    match api.create(&PostParams::default(), &cm(&name)).await {
                        Ok(_) => {
                            acked.lock().map(|mut a| a.insert(name)).ok();
                        }
                        Err(_) => break,
                    }
                }
            }));
        }
        // Let the burst run, then kill the server under it.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        c.kill_server()?;
        for t in tasks {
            let _ = t.await;
        }
        anyhow::Ok(())
    })?;
    let acked = acked.lock().map(|a| a.clone()).unwrap_or_default();
    assert!(
        acked.len() > 20,
        "too few writes in the burst: {}",
        acked.len()
    );
    c.restart_server()?;
    let stored: BTreeSet<String> = rt.block_on(async {
        let api: Api<ConfigMap> = Api::namespaced(client(&c).await?, "default");
        let list = api.list(&ListParams::default()).await?;
        anyhow::Ok(
            list.items
                .into_iter()
                .filter_map(|m| m.metadata.name)
                .collect(),
        )
    })?;
    let lost: Vec<&String> = acked.difference(&stored).collect();
    assert!(
        lost.is_empty(),
        "{} acknowledged writes lost: {lost:?}",
        lost.len()
    );
    eprintln!(
        "{} acknowledged creates, all present after kill -9",
        acked.len()
    );
    Ok(())
}

#[test]
fn kill_9_during_a_write_burst_loses_no_acknowledged_write_sqlite() -> anyhow::Result<()> {
    burst_then_kill(api_only(&[]))
}

#[test]
fn kill_9_during_a_write_burst_loses_no_acknowledged_write_etcd() -> anyhow::Result<()> {
    let etcd = Etcd::start()?;
    burst_then_kill(api_only(&["--datastore-endpoint", &etcd.endpoint()]))
}

#[test]
fn two_servers_on_one_etcd_serve_consistent_reads_and_watches() -> anyhow::Result<()> {
    let etcd = Etcd::start()?;
    let a = Cluster::start(&api_only(&["--datastore-endpoint", &etcd.endpoint()]))?;
    let mut ob = api_only(&["--datastore-endpoint", &etcd.endpoint()]);
    ob.seed_from = Some(a.data_dir.clone());
    let b = Cluster::start(&ob)?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let api_a: Api<ConfigMap> = Api::namespaced(client(&a).await?, "default");
        let api_b: Api<ConfigMap> = Api::namespaced(client(&b).await?, "default");
        let start_rv = api_b
            .list(&ListParams::default())
            .await?
            .metadata
            .resource_version
            .unwrap_or_default();
        let mut watch = api_b
            .watch(&WatchParams::default().timeout(60), &start_rv)
            .await?
            .boxed();
        let mut written = Vec::new();
        for i in 0..20 {
            let created = api_a
                .create(&PostParams::default(), &cm(&format!("shared-{i}")))
                .await?;
            written.push((
                created.metadata.name.unwrap_or_default(),
                created.metadata.resource_version.unwrap_or_default(),
            ));
        }
        // B's watch sees A's writes, in order, with A's resourceVersions.
        let mut seen = Vec::new();
        while seen.len() < written.len() {
            let ev = tokio::time::timeout(Duration::from_secs(20), watch.next())
                .await
                .map_err(|_| anyhow::anyhow!("B's watch saw only {} of 20 events", seen.len()))?
                .ok_or_else(|| anyhow::anyhow!("watch ended"))??;
            if let WatchEvent::Added(o) = ev {
                seen.push((
                    o.metadata.name.unwrap_or_default(),
                    o.metadata.resource_version.unwrap_or_default(),
                ));
            }
        }
        assert_eq!(seen, written);
        // B reads what A wrote; a stale update through B conflicts.
        let got = api_b.get("shared-7").await?;
        assert_eq!(
            got.metadata.resource_version.as_deref(),
            Some(written[7].1.as_str())
        );
        let mut stale = got.clone();
        let mut fresh = got.clone();
        fresh.data = Some([("k".to_string(), "fresh".to_string())].into());
        api_a
            .replace("shared-7", &PostParams::default(), &fresh)
            .await?;
        stale.data = Some([("k".to_string(), "stale".to_string())].into());
        match api_b
            .replace("shared-7", &PostParams::default(), &stale)
            .await
        {
            Err(kube::Error::Api(s)) => assert_eq!(s.code, 409),
            other => anyhow::bail!("expected 409, got {other:?}"),
        }
        anyhow::Ok(())
    })?;
    Ok(())
}

/// The controllers' view survives a restart: claims bound before a kill -9 are never written
/// back to Pending while the restarted controllers' caches fill (the PVC controller decided on
/// a volume cache that did not hold their volumes yet, and a backup resumed after the restart
/// failed with "claim ... is not bound", in CI). The race needs the claims' list to arrive
/// before the volumes' after the restart: this fails when a regression meets it, not every run.
#[test]
fn bound_claims_stay_bound_across_a_server_restart() -> anyhow::Result<()> {
    use k8s_openapi::api::core::v1::PersistentVolumeClaim;
    const CLAIMS: usize = 40;
    let mut opts = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
    opts.node_name = None;
    let mut c = Cluster::start(&opts)?;
    let rt = tokio::runtime::Runtime::new()?;
    let phase = |p: &PersistentVolumeClaim| {
        p.status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default()
    };
    let rv = rt.block_on(async {
        let api: Api<PersistentVolumeClaim> = Api::namespaced(client(&c).await?, "default");
        for i in 0..CLAIMS {
            let pvc: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
                "metadata": {"name": format!("claim-{i}")},
                "spec": {
                    "storageClassName": "shared",
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "1Mi"}}
                }
            }))?;
            api.create(&PostParams::default(), &pvc).await?;
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let list = api.list(&ListParams::default()).await?;
            let bound = list.items.iter().filter(|p| phase(p) == "Bound").count();
            if bound == CLAIMS {
                return anyhow::Ok(list.metadata.resource_version.unwrap_or_default());
            }
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "{bound} of {CLAIMS} claims bound"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })?;
    c.kill_server()?;
    c.restart_server()?;
    let changed = rt.block_on(async {
        let api: Api<PersistentVolumeClaim> = Api::namespaced(client(&c).await?, "default");
        // Every change since the restart, for as long as the controllers take to go over
        // every claim once (they do at start).
        let wp = WatchParams::default().timeout(10);
        let mut events = api.watch(&wp, &rv).await?.boxed();
        let mut changed = Vec::new();
        while let Some(ev) = events.next().await {
            if let WatchEvent::Modified(p) = ev? {
                changed.push((p.metadata.name.clone().unwrap_or_default(), phase(&p)));
            }
        }
        anyhow::Ok(changed)
    })?;
    let unbound: Vec<_> = changed.iter().filter(|(_, p)| p != "Bound").collect();
    assert!(
        unbound.is_empty(),
        "claims left Bound after the restart: {unbound:?}"
    );
    eprintln!(
        "{} claim changes after the restart, all Bound",
        changed.len()
    );
    Ok(())
}
