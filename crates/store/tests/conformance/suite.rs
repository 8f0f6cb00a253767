//! The conformance cases. Each is generic over [`Backend`] and assumes nothing about absolute
//! revision numbers (etcd starts at 1 before any write, SQLite at 0), only that each successful
//! write bumps the revision by exactly one and failed writes do not.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use ferrovirt_store::{
    EventKind, KeyValue, ListOptions, Revision, Store, StoreError, WatchEvent, WatchStream,
};
use futures::StreamExt;

use crate::Backend;

const EVENT_TIMEOUT: Duration = Duration::from_secs(15);

/// Performs writes and remembers the watch event each one should produce.
pub(crate) struct Recorder {
    store: Arc<dyn Store>,
    events: Vec<WatchEvent>,
}

impl Recorder {
    pub(crate) fn new(store: &Arc<dyn Store>) -> Self {
        Recorder {
            store: Arc::clone(store),
            events: Vec::new(),
        }
    }

    pub(crate) async fn create(&mut self, key: &str, value: &str) -> Result<KeyValue> {
        let kv = self.store.create(key, value.into()).await?;
        self.events.push(WatchEvent {
            kind: EventKind::Created,
            revision: kv.mod_revision,
            kv: kv.clone(),
            prev: None,
        });
        Ok(kv)
    }

    pub(crate) async fn update(&mut self, prev: &KeyValue, value: &str) -> Result<KeyValue> {
        let kv = self
            .store
            .update(&prev.key, value.into(), prev.mod_revision)
            .await?;
        self.events.push(WatchEvent {
            kind: EventKind::Modified,
            revision: kv.mod_revision,
            kv: kv.clone(),
            prev: Some(prev.clone()),
        });
        Ok(kv)
    }

    pub(crate) async fn delete(&mut self, prev: &KeyValue) -> Result<KeyValue> {
        let kv = self
            .store
            .delete(&prev.key, Some(prev.mod_revision))
            .await?;
        self.events.push(WatchEvent {
            kind: EventKind::Deleted,
            revision: kv.mod_revision,
            kv: kv.clone(),
            prev: Some(prev.clone()),
        });
        Ok(kv)
    }

    /// The recorded events under `prefix` with revision greater than `after`.
    pub(crate) fn expected(&self, prefix: &str, after: Revision) -> Vec<WatchEvent> {
        self.events
            .iter()
            .filter(|e| e.revision > after && e.kv.key.starts_with(prefix))
            .cloned()
            .collect()
    }
}

/// Reads exactly `n` events, failing on an error item, a stream end or a timeout.
pub(crate) async fn take_events(stream: &mut WatchStream, n: usize) -> Result<Vec<WatchEvent>> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        match tokio::time::timeout(EVENT_TIMEOUT, stream.next()).await {
            Err(_) => bail!("timed out after {} of {n} events: {out:#?}", out.len()),
            Ok(None) => bail!("stream ended after {} of {n} events", out.len()),
            Ok(Some(Err(e))) => bail!("watch error after {} of {n} events: {e}", out.len()),
            Ok(Some(Ok(ev))) => out.push(ev),
        }
    }
    Ok(out)
}

/// Checks that no further event arrives within a short grace period.
pub(crate) async fn assert_quiet(stream: &mut WatchStream) -> Result<()> {
    match tokio::time::timeout(Duration::from_millis(300), stream.next()).await {
        Err(_) => Ok(()),
        Ok(item) => bail!("unexpected extra watch item: {item:?}"),
    }
}

fn at(revision: Revision) -> ListOptions {
    ListOptions {
        revision: Some(revision),
        ..ListOptions::default()
    }
}

fn keys(items: &[KeyValue]) -> Vec<&str> {
    items.iter().map(|kv| kv.key.as_str()).collect()
}

pub async fn crud<B: Backend>() -> Result<()> {
    let backend = B::start().await?;
    let s = backend.store();
    let start = s.current_revision().await?;
    assert_eq!(s.get("/r/a").await?, None);

    let a = s.create("/r/a", b"one".to_vec()).await?;
    assert_eq!(a.key, "/r/a");
    assert_eq!(a.value, b"one");
    assert_eq!(a.mod_revision, start + 1);
    assert_eq!(a.create_revision, a.mod_revision);
    assert_eq!(s.current_revision().await?, start + 1);
    assert_eq!(s.get("/r/a").await?, Some(a.clone()));

    let a2 = s.update("/r/a", b"two".to_vec(), a.mod_revision).await?;
    assert_eq!(a2.value, b"two");
    assert_eq!(a2.create_revision, a.create_revision);
    assert_eq!(a2.mod_revision, start + 2);
    assert_eq!(s.get("/r/a").await?, Some(a2.clone()));

    let gone = s.delete("/r/a", Some(a2.mod_revision)).await?;
    assert_eq!(gone.value, b"two", "delete returns the last value");
    assert_eq!(gone.create_revision, a.create_revision);
    assert_eq!(
        gone.mod_revision,
        start + 3,
        "delete returns the deletion's revision"
    );
    assert_eq!(s.get("/r/a").await?, None);
    assert_eq!(s.current_revision().await?, start + 3);

    // Recreate after delete: a new life with a new create_revision; unconditional delete.
    let again = s.create("/r/a", b"three".to_vec()).await?;
    assert_eq!(again.create_revision, start + 4);
    let gone = s.delete("/r/a", None).await?;
    assert_eq!(gone.value, b"three");
    assert_eq!(s.get("/r/a").await?, None);

    // Empty values and unusual (but valid UTF-8) keys round-trip.
    let e = s.create("/r/empty", Vec::new()).await?;
    assert_eq!(s.get("/r/empty").await?, Some(e));
    let odd = s.create("/r/ü n%i\u{1F600}", b"x".to_vec()).await?;
    assert_eq!(s.get("/r/ü n%i\u{1F600}").await?, Some(odd));
    assert_eq!(s.compacted_revision().await?, 0);
    Ok(())
}

pub async fn conflicts<B: Backend>() -> Result<()> {
    let backend = B::start().await?;
    let s = backend.store();
    let a = s.create("/c/a", b"1".to_vec()).await?;
    let a2 = s.update("/c/a", b"2".to_vec(), a.mod_revision).await?;
    let rev = s.current_revision().await?;

    match s.create("/c/a", b"x".to_vec()).await {
        Err(StoreError::AlreadyExists(key)) => assert_eq!(key, "/c/a"),
        other => bail!("create of an existing key: {other:?}"),
    }
    match s.update("/c/a", b"x".to_vec(), a.mod_revision).await {
        Err(StoreError::Conflict {
            key,
            expected,
            current,
        }) => {
            assert_eq!(key, "/c/a");
            assert_eq!(expected, a.mod_revision);
            assert_eq!(
                current.as_deref(),
                Some(&a2),
                "conflict carries the current value"
            );
        }
        other => bail!("stale update: {other:?}"),
    }
    match s.delete("/c/a", Some(a.mod_revision)).await {
        Err(StoreError::Conflict { current, .. }) => assert_eq!(current.as_deref(), Some(&a2)),
        other => bail!("stale delete: {other:?}"),
    }
    match s.update("/c/missing", b"x".to_vec(), 1).await {
        Err(StoreError::NotFound(key)) => assert_eq!(key, "/c/missing"),
        other => bail!("update of a missing key: {other:?}"),
    }
    match s.update("/c/missing", b"x".to_vec(), 0).await {
        Err(StoreError::NotFound(_)) => {}
        other => bail!("update of a missing key at revision 0: {other:?}"),
    }
    match s.delete("/c/missing", None).await {
        Err(StoreError::NotFound(_)) => {}
        other => bail!("delete of a missing key: {other:?}"),
    }
    assert_eq!(
        s.current_revision().await?,
        rev,
        "failed writes do not bump the revision"
    );
    assert_eq!(s.get("/c/a").await?, Some(a2.clone()));

    // A deleted key: updates and deletes report NotFound, create works again.
    s.delete("/c/a", Some(a2.mod_revision)).await?;
    match s.update("/c/a", b"x".to_vec(), a2.mod_revision).await {
        Err(StoreError::NotFound(_)) => {}
        other => bail!("update of a deleted key: {other:?}"),
    }
    s.create("/c/a", b"new".to_vec()).await?;
    Ok(())
}

/// A list larger than gRPC's default 4 MiB message limit (10,000 VMIs are ~14 MiB): whole.
pub async fn large_list<B: Backend>() -> Result<()> {
    let backend = B::start().await?;
    let s = backend.store();
    let value = vec![b'x'; 1 << 20];
    for i in 0..6 {
        s.create(&format!("/big/{i}"), value.clone()).await?;
    }
    let all = s.list("/big/", ListOptions::default()).await?;
    assert_eq!(all.items.len(), 6);
    assert!(all.items.iter().all(|kv| kv.value.len() == 1 << 20));
    assert!(!all.more);
    Ok(())
}

pub async fn list_prefix_and_limit<B: Backend>() -> Result<()> {
    let backend = B::start().await?;
    let s = backend.store();
    for key in ["/l/b", "/l/a", "/l/c/x", "/l0", "/l", "/k/z", "/m"] {
        s.create(key, key.as_bytes().to_vec()).await?;
    }
    let rev = s.current_revision().await?;
    let all = s.list("/l/", ListOptions::default()).await?;
    assert_eq!(keys(&all.items), ["/l/a", "/l/b", "/l/c/x"]);
    assert_eq!(all.revision, rev);
    assert!(!all.more);
    assert_eq!(all.items[0].value, b"/l/a");

    let unlimited = s
        .list(
            "/l/",
            ListOptions {
                limit: Some(0),
                ..ListOptions::default()
            },
        )
        .await?;
    assert_eq!(unlimited.items.len(), 3);

    let first = s
        .list(
            "/l/",
            ListOptions {
                limit: Some(2),
                ..ListOptions::default()
            },
        )
        .await?;
    assert_eq!(keys(&first.items), ["/l/a", "/l/b"]);
    assert!(first.more);
    let exact = s
        .list(
            "/l/",
            ListOptions {
                limit: Some(3),
                ..ListOptions::default()
            },
        )
        .await?;
    assert!(!exact.more, "no more when the limit equals the count");

    let rest = s
        .list(
            "/l/",
            ListOptions {
                start_after: Some("/l/b".into()),
                limit: Some(2),
                revision: Some(first.revision),
            },
        )
        .await?;
    assert_eq!(keys(&rest.items), ["/l/c/x"]);
    assert!(!rest.more);

    let everything = s.list("", ListOptions::default()).await?;
    assert_eq!(
        keys(&everything.items),
        ["/k/z", "/l", "/l/a", "/l/b", "/l/c/x", "/l0", "/m"]
    );
    let none = s.list("/nothing/", ListOptions::default()).await?;
    assert!(none.items.is_empty() && !none.more);
    assert_eq!(none.revision, rev);
    Ok(())
}

pub async fn pagination_at_fixed_revision<B: Backend>() -> Result<()> {
    let backend = B::start().await?;
    let s = backend.store();
    let mut original = BTreeMap::new();
    for i in 0..25 {
        let key = format!("/p/{i:03}");
        let kv = s.create(&key, format!("v{i}").into_bytes()).await?;
        original.insert(key, kv);
    }
    s.create("/p0", b"outside".to_vec()).await?;

    let mut seen: Vec<KeyValue> = Vec::new();
    let mut opts = ListOptions {
        limit: Some(7),
        ..ListOptions::default()
    };
    let mut pages = 0;
    let mut writes = 0;
    loop {
        let page = s.list("/p/", opts.clone()).await?;
        pages += 1;
        let revision = *opts.revision.get_or_insert(page.revision);
        assert_eq!(
            page.revision, revision,
            "every page is read at the first page's revision"
        );
        seen.extend(page.items.iter().cloned());
        if !page.more {
            break;
        }
        opts.start_after = page.items.last().map(|kv| kv.key.clone());
        // Writes continue between pages: updates, deletes and creates inside the prefix.
        let victim = &original[&format!("/p/{:03}", 20 - writes)];
        s.update(&victim.key, b"changed".to_vec(), victim.mod_revision)
            .await?;
        let doomed = &original[&format!("/p/{:03}", 24 - writes)];
        s.delete(&doomed.key, None).await?;
        s.create(&format!("/p/{:03}a", 10 + writes), b"new".to_vec())
            .await?;
        writes += 1;
    }
    assert_eq!(pages, 4);
    let expected: Vec<KeyValue> = original.into_values().collect();
    assert_eq!(
        seen, expected,
        "the pages add up to the keyspace at the first revision"
    );

    // The live list does see the writes.
    let now = s.list("/p/", ListOptions::default()).await?;
    assert_eq!(now.items.len(), 25);
    assert!(now.items.iter().any(|kv| kv.value == b"changed"));
    Ok(())
}

pub async fn list_at_old_revision<B: Backend>() -> Result<()> {
    let backend = B::start().await?;
    let s = backend.store();
    let a = s.create("/o/a", b"a1".to_vec()).await?;
    let b = s.create("/o/b", b"b1".to_vec()).await?;
    let rev1 = s.current_revision().await?;
    let a2 = s.update("/o/a", b"a2".to_vec(), a.mod_revision).await?;
    s.delete("/o/b", None).await?;
    let c = s.create("/o/c", b"c1".to_vec()).await?;
    let b2 = s.create("/o/b", b"b2".to_vec()).await?;

    let old = s.list("/o/", at(rev1)).await?;
    assert_eq!(old.items, vec![a.clone(), b.clone()]);
    assert_eq!(old.revision, rev1);
    let before_b = s.list("/o/", at(b.mod_revision - 1)).await?;
    assert_eq!(before_b.items, vec![a]);
    let now = s.list("/o/", ListOptions::default()).await?;
    assert_eq!(now.items, vec![a2, b2, c]);

    let future = s.current_revision().await? + 10;
    match s.list("/o/", at(future)).await {
        Err(StoreError::Backend(_)) => {}
        other => bail!("list at a future revision: {other:?}"),
    }
    Ok(())
}

pub async fn watch_replay_then_live<B: Backend>() -> Result<()> {
    let backend = B::start().await?;
    let s = backend.store();
    let mut rec = Recorder::new(&s);
    let start = s.current_revision().await?;
    let a = rec.create("/w/a", "a1").await?;
    let b = rec.create("/w/b", "b1").await?;
    rec.create("/x/outside", "x").await?;
    let a2 = rec.update(&a, "a2").await?;
    let from = s.current_revision().await?;
    rec.delete(&b).await?;
    let a3 = rec.update(&a2, "a3").await?;

    // From the very beginning, and from the middle of history.
    let mut full = s.watch("/w/", start).await?;
    let mut mid = s.watch("/w/", from).await?;
    let mut everything = s.watch("", start).await?;
    let replay_full = rec.expected("/w/", start);
    assert_eq!(
        take_events(&mut full, replay_full.len()).await?,
        replay_full
    );
    let replay_mid = rec.expected("/w/", from);
    assert_eq!(replay_mid.len(), 2);
    assert_eq!(take_events(&mut mid, 2).await?, replay_mid);

    // Live events follow the replay, without gap or duplicate.
    rec.delete(&a3).await?;
    let c = rec.create("/w/c", "c1").await?;
    rec.create("/x/outside2", "x").await?;
    rec.update(&c, "c2").await?;
    let live = rec.expected("/w/", s.current_revision().await? - 4);
    assert_eq!(live.len(), 3);
    assert_eq!(take_events(&mut full, 3).await?, live);
    assert_eq!(take_events(&mut mid, 3).await?, live);
    let all = rec.expected("", start);
    assert_eq!(take_events(&mut everything, all.len()).await?, all);
    assert_quiet(&mut full).await?;
    assert_quiet(&mut mid).await?;

    // A watch from "now" sees only later writes.
    let mut fresh = s.watch("/w/", s.current_revision().await?).await?;
    assert_quiet(&mut fresh).await?;
    rec.create("/w/d", "d").await?;
    let last = rec.events.last().cloned().context("recorded")?;
    assert_eq!(take_events(&mut fresh, 1).await?, vec![last]);
    Ok(())
}

pub async fn watch_while_writing<B: Backend>() -> Result<()> {
    let backend = B::start().await?;
    let s = backend.store();
    let start = s.current_revision().await?;
    const WRITES: usize = 120;
    let writer = {
        let s = Arc::clone(&s);
        tokio::spawn(async move {
            let mut rec = Recorder::new(&s);
            let mut kv = rec.create("/ww/k", "0").await?;
            for i in 1..WRITES {
                kv = rec.update(&kv, &i.to_string()).await?;
            }
            anyhow::Ok(rec.events)
        })
    };
    // Watches opened at staggered moments while the writer runs, each from the start.
    let mut watches = Vec::new();
    for _ in 0..4 {
        watches.push(s.watch("/ww/", start).await?);
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    let expected = writer.await??;
    for w in &mut watches {
        let got = take_events(w, WRITES).await?;
        let revisions: Vec<Revision> = got.iter().map(|e| e.revision).collect();
        assert!(revisions.windows(2).all(|p| p[0] < p[1]), "in order");
        assert_eq!(got, expected);
        assert_quiet(w).await?;
    }
    Ok(())
}

pub async fn watch_slow_consumer<B: Backend>() -> Result<()> {
    let backend = B::start().await?;
    let s = backend.store();
    let mut rec = Recorder::new(&s);
    let mut w = s.watch("/slow/", s.current_revision().await?).await?;
    let mut kv = rec.create("/slow/k", "0").await?;
    for i in 1..300 {
        kv = rec.update(&kv, &i.to_string()).await?;
    }
    let expected = rec.expected("/slow/", 0);
    assert_eq!(take_events(&mut w, expected.len()).await?, expected);
    assert_quiet(&mut w).await
}

/// Expects `Compacted` from `watch`, either at once or as the stream's first item.
async fn expect_watch_compacted(
    s: &Arc<dyn Store>,
    after: Revision,
    compacted: Revision,
) -> Result<()> {
    let err = match s.watch("/z/", after).await {
        Err(e) => e,
        Ok(mut stream) => match tokio::time::timeout(EVENT_TIMEOUT, stream.next()).await {
            Ok(Some(Err(e))) => {
                let tail = tokio::time::timeout(EVENT_TIMEOUT, stream.next()).await;
                assert!(matches!(tail, Ok(None)), "the stream ends after Compacted");
                e
            }
            other => bail!("watch after {after} should fail as compacted, got {other:?}"),
        },
    };
    match err {
        StoreError::Compacted {
            requested,
            compacted: c,
        } => {
            assert_eq!(c, compacted);
            assert_eq!(requested, after);
        }
        other => bail!("watch after {after}: expected Compacted, got {other:?}"),
    }
    Ok(())
}

pub async fn compaction<B: Backend>() -> Result<()> {
    let backend = B::start().await?;
    let s = backend.store();
    let mut rec = Recorder::new(&s);
    let a = rec.create("/z/a", "a1").await?;
    let b = rec.create("/z/b", "b1").await?;
    let c = rec.create("/z/c", "c1").await?;
    let a2 = rec.update(&a, "a2").await?;
    rec.delete(&b).await?;
    let old = s.current_revision().await?;
    let c2 = rec.update(&c, "c2").await?;
    let a3 = rec.update(&a2, "a3").await?;
    rec.delete(&c2).await?;
    let d = rec.create("/z/d", "d1").await?;
    let compact_at = a3.mod_revision;
    let before = s.list("/z/", at(compact_at)).await?;
    let now_before = s.list("/z/", ListOptions::default()).await?;

    s.compact(compact_at).await?;
    assert_eq!(s.compacted_revision().await?, compact_at);
    match s.list("/z/", at(old)).await {
        Err(StoreError::Compacted {
            requested,
            compacted,
        }) => {
            assert_eq!(requested, old);
            assert_eq!(compacted, compact_at);
        }
        other => bail!("list at a compacted revision: {other:?}"),
    }
    match s.list("/z/", at(compact_at - 1)).await {
        Err(StoreError::Compacted { .. }) => {}
        other => bail!("list just below the compacted revision: {other:?}"),
    }
    // The compacted revision itself and everything later stay readable.
    assert_eq!(s.list("/z/", at(compact_at)).await?, before);
    let now = s.list("/z/", ListOptions::default()).await?;
    assert_eq!(now, now_before);
    assert_eq!(keys(&now.items), ["/z/a", "/z/d"]);
    assert_eq!(s.get("/z/a").await?, Some(a3.clone()));
    assert_eq!(s.get("/z/d").await?, Some(d));

    // Watches: events after the compacted revision are still there (with their previous
    // state); watching from anything older is Compacted.
    expect_watch_compacted(&s, old, compact_at).await?;
    expect_watch_compacted(&s, compact_at - 1, compact_at).await?;
    expect_watch_compacted(&s, 0, compact_at).await?;
    let mut w = s.watch("/z/", compact_at).await?;
    let expected = rec.expected("/z/", compact_at);
    assert_eq!(expected.len(), 2);
    assert_eq!(take_events(&mut w, expected.len()).await?, expected);
    assert_quiet(&mut w).await?;

    // Writes keep working; compacting again at or below the mark is a no-op; the future is not.
    let a4 = rec.update(&a3, "a4").await?;
    s.compact(compact_at).await?;
    s.compact(compact_at - 1).await?;
    assert_eq!(s.compacted_revision().await?, compact_at);
    assert!(s.compact(a4.mod_revision + 5).await.is_err());
    s.compact(a4.mod_revision).await?;
    assert_eq!(s.compacted_revision().await?, a4.mod_revision);
    assert_eq!(s.get("/z/a").await?, Some(a4));
    Ok(())
}

pub async fn concurrent_writers<B: Backend>() -> Result<()> {
    const TASKS: usize = 8;
    const INCREMENTS: usize = 25;
    let backend = B::start().await?;
    let s = backend.store();
    s.create("/counter", b"0".to_vec()).await?;
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let s = Arc::clone(&s);
        tasks.push(tokio::spawn(async move {
            let mut conflicts = 0usize;
            for _ in 0..INCREMENTS {
                loop {
                    let cur = s.get("/counter").await?.context("counter vanished")?;
                    let n: usize = std::str::from_utf8(&cur.value)?.parse()?;
                    match s
                        .update(
                            "/counter",
                            (n + 1).to_string().into_bytes(),
                            cur.mod_revision,
                        )
                        .await
                    {
                        Ok(_) => break,
                        Err(StoreError::Conflict { .. }) => conflicts += 1,
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            anyhow::Ok(conflicts)
        }));
    }
    let mut conflicts = 0;
    for t in tasks {
        conflicts += t.await??;
    }
    let kv = s.get("/counter").await?.context("counter")?;
    assert_eq!(kv.value, (TASKS * INCREMENTS).to_string().into_bytes());
    eprintln!(
        "{} increments, {conflicts} conflicts retried",
        TASKS * INCREMENTS
    );
    Ok(())
}

pub async fn restart_durability<B: Backend>() -> Result<()> {
    let mut backend = B::start().await?;
    let s = backend.store();
    // Acknowledged writes from concurrent tasks, then some updates and deletes.
    let mut tasks = Vec::new();
    for t in 0..4 {
        let s = Arc::clone(&s);
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for i in 0..15 {
                out.push(s.create(&format!("/d/{t}-{i:02}"), vec![t; i]).await?);
            }
            anyhow::Ok(out)
        }));
    }
    let mut expected = BTreeMap::new();
    for t in tasks {
        for kv in t.await?? {
            expected.insert(kv.key.clone(), kv);
        }
    }
    for i in 0..5 {
        let kv = expected[&format!("/d/0-{i:02}")].clone();
        let kv = s
            .update(&kv.key, b"updated".to_vec(), kv.mod_revision)
            .await?;
        expected.insert(kv.key.clone(), kv);
        let gone = s.delete(&format!("/d/1-{i:02}"), None).await?;
        expected.remove(&gone.key);
    }
    let revision = s.current_revision().await?;
    let listed_before = s.list("/d/", ListOptions::default()).await?;

    let s = backend.restart(s).await?;
    assert_eq!(s.current_revision().await?, revision);
    let listed = s.list("/d/", ListOptions::default()).await?;
    assert_eq!(listed, listed_before);
    let want: Vec<KeyValue> = expected.into_values().collect();
    assert_eq!(
        listed.items, want,
        "every acknowledged write survived the restart"
    );
    // History survives too, and revisions carry on from where they were.
    let mut w = s.watch("/d/", revision - 10).await?;
    assert_eq!(take_events(&mut w, 10).await?.len(), 10);
    let kv = s.create("/d/after", b"x".to_vec()).await?;
    assert_eq!(kv.mod_revision, revision + 1);
    assert_eq!(take_events(&mut w, 1).await?[0].kv, kv);
    Ok(())
}
