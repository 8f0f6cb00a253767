//! The etcd store's shared watches (`EtcdStore`'s fan-out): the watchers of one prefix are
//! served by one etcd watch, counted by etcd itself (its `etcd_debugging_mvcc_watcher_total`
//! gauge), and every watcher still gets each event exactly once and in order, whether it
//! starts in the past, falls a whole ring behind, or falls behind a compaction.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferrovirt_store::{EtcdStore, FanoutOptions, Store, StoreError};
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::etcd::EtcdProcess;
use crate::suite::{Recorder, assert_quiet, take_events};

/// A fresh etcd and a store on it with these fan-out options.
async fn start(options: FanoutOptions) -> Result<(EtcdProcess, EtcdStore, Arc<dyn Store>)> {
    let mut process = EtcdProcess::new()?;
    let store = process.start().await?.with_fanout(options);
    let dyn_store: Arc<dyn Store> = Arc::new(store.clone());
    Ok((process, store, dyn_store))
}

/// The watchers etcd holds now, from its own metrics.
async fn etcd_watchers(process: &EtcdProcess) -> Result<u64> {
    let addr = process
        .endpoint()
        .strip_prefix("http://")
        .context("endpoint")?
        .to_owned();
    let mut conn = tokio::net::TcpStream::connect(&addr).await?;
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: etcd\r\n\r\n")
        .await?;
    let mut body = String::new();
    conn.read_to_string(&mut body).await?;
    let line = body
        .lines()
        .find(|l| l.starts_with("etcd_debugging_mvcc_watcher_total "))
        .context("etcd_debugging_mvcc_watcher_total in etcd's metrics")?;
    Ok(line.split_whitespace().nth(1).context("value")?.parse()?)
}

/// Waits until etcd reports `want` watchers (its gauge follows a watch's start or end a
/// moment later).
async fn expect_etcd_watchers(process: &EtcdProcess, want: u64) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = etcd_watchers(process).await?;
        if got == want {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("etcd holds {got} watchers, expected {want}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_of_one_prefix_share_one_etcd_watch() -> Result<()> {
    let (process, store, s) = start(FanoutOptions::default()).await?;
    let mut rec = Recorder::new(&s);
    let before = s.current_revision().await?;
    rec.create("/s/before", "b").await?;
    let start = s.current_revision().await?;
    let mut watchers = Vec::new();
    for _ in 0..20 {
        watchers.push(s.watch("/s/", start).await?);
    }
    let mut other = s.watch("/t/", start).await?;
    assert_eq!(store.watches_opened(), 2);
    assert_eq!(store.shared_watches(), 2);
    expect_etcd_watchers(&process, 2).await?;

    let mut kv = rec.create("/s/k", "0").await?;
    rec.create("/t/k", "t").await?;
    for i in 1..30 {
        kv = rec.update(&kv, &i.to_string()).await?;
    }
    let expected = rec.expected("/s/", start);
    for w in &mut watchers {
        assert_eq!(take_events(w, expected.len()).await?, expected);
        assert_quiet(w).await?;
    }
    assert_eq!(
        take_events(&mut other, 1).await?,
        rec.expected("/t/", start)
    );

    // A watcher starting in the past that the hub still holds is served by it: the tail of
    // the history, then live events, and no new etcd watch.
    let mid = expected[20].revision;
    let mut late = s.watch("/s/", mid).await?;
    assert_eq!(take_events(&mut late, 9).await?, rec.expected("/s/", mid));
    rec.update(&kv, "live").await?;
    let live = rec.expected("/s/", s.current_revision().await? - 1);
    assert_eq!(take_events(&mut late, 1).await?, live);
    for w in &mut watchers {
        assert_eq!(take_events(w, 1).await?, live);
    }
    assert_eq!(store.watches_opened(), 2);
    expect_etcd_watchers(&process, 2).await?;

    // One from before the hub's start gets an etcd watch of its own, and every event.
    let mut old = s.watch("/s/", before).await?;
    let all = rec.expected("/s/", before);
    assert_eq!(all.len(), expected.len() + 2);
    assert_eq!(take_events(&mut old, all.len()).await?, all);
    assert_eq!(store.watches_opened(), 3);
    expect_etcd_watchers(&process, 3).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_a_whole_ring_behind_goes_on_alone_without_loss() -> Result<()> {
    let (process, store, s) = start(FanoutOptions {
        ring: 8,
        ..FanoutOptions::default()
    })
    .await?;
    let mut rec = Recorder::new(&s);
    let start = s.current_revision().await?;
    let mut keeping_up = s.watch("/lag/", start).await?;
    let mut idle = s.watch("/lag/", start).await?;
    let mut kv = rec.create("/lag/k", "0").await?;
    let mut seen = take_events(&mut keeping_up, 1).await?;
    for i in 1..40 {
        kv = rec.update(&kv, &i.to_string()).await?;
        seen.extend(take_events(&mut keeping_up, 1).await?);
    }
    let expected = rec.expected("/lag/", start);
    assert_eq!(seen, expected);
    assert_eq!(store.watches_opened(), 1, "the watcher that kept up stayed");

    // The idle one is 40 events behind a ring of 8: it reads them from its own etcd watch.
    assert_eq!(take_events(&mut idle, expected.len()).await?, expected);
    assert_quiet(&mut idle).await?;
    assert_eq!(store.watches_opened(), 2);
    expect_etcd_watchers(&process, 2).await?;
    rec.update(&kv, "after").await?;
    let live = rec.expected("/lag/", kv.mod_revision);
    assert_eq!(take_events(&mut idle, 1).await?, live);
    assert_eq!(take_events(&mut keeping_up, 1).await?, live);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_behind_a_ring_and_a_compaction_gets_compacted() -> Result<()> {
    let (_process, _store, s) = start(FanoutOptions {
        ring: 4,
        ..FanoutOptions::default()
    })
    .await?;
    let mut rec = Recorder::new(&s);
    let start = s.current_revision().await?;
    let mut keeping_up = s.watch("/c/", start).await?;
    let mut idle = s.watch("/c/", start).await?;
    let mut kv = rec.create("/c/k", "0").await?;
    for i in 1..10 {
        kv = rec.update(&kv, &i.to_string()).await?;
    }
    let expected = rec.expected("/c/", start);
    assert_eq!(take_events(&mut keeping_up, 10).await?, expected);
    s.compact(kv.mod_revision).await?;
    match tokio::time::timeout(Duration::from_secs(15), idle.next()).await? {
        Some(Err(StoreError::Compacted {
            requested,
            compacted,
        })) => {
            assert_eq!(requested, start);
            assert_eq!(compacted, kv.mod_revision);
        }
        other => bail!("expected Compacted, got {other:?}"),
    }
    assert!(
        idle.next().await.is_none(),
        "the stream ends after Compacted"
    );
    // The hub itself is past the compaction and keeps serving.
    rec.update(&kv, "after").await?;
    assert_eq!(
        take_events(&mut keeping_up, 1).await?,
        rec.expected("/c/", kv.mod_revision)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_no_one_watches_closes_its_etcd_watch() -> Result<()> {
    let (process, store, s) = start(FanoutOptions {
        idle_check: Duration::from_millis(200),
        ..FanoutOptions::default()
    })
    .await?;
    let mut rec = Recorder::new(&s);
    let start = s.current_revision().await?;
    let w1 = s.watch("/i/", start).await?;
    let w2 = s.watch("/i/", start).await?;
    expect_etcd_watchers(&process, 1).await?;
    drop(w1);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(store.shared_watches(), 1, "one watcher is left");
    drop(w2);
    expect_etcd_watchers(&process, 0).await?;
    assert_eq!(store.shared_watches(), 0);

    // A later watcher opens a new hub, and it works.
    let now = s.current_revision().await?;
    let mut w = s.watch("/i/", now).await?;
    rec.create("/i/k", "v").await?;
    assert_eq!(take_events(&mut w, 1).await?, rec.expected("/i/", now));
    assert_eq!(store.watches_opened(), 2);
    Ok(())
}
