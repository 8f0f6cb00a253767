//! Tests of what only the SQLite backend has: its pragmas, the file lock, a watcher that lags
//! behind the broadcast, compaction removing rows, and durability across a killed process.
//! The behaviour shared with etcd is tested by the conformance suite in `tests/conformance`.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;

use rusqlite::Connection;

use super::SqliteStore;
use super::writer::Job;
use crate::{EventKind, Store, StoreError};

/// Set in the environment of the child process of `survives_a_killed_writer`.
const CRASH_CHILD_DB: &str = "FERROVIRT_STORE_CRASH_CHILD_DB";

#[tokio::test]
async fn database_is_wal_with_full_sync() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("s.db")).await?;
    let (mode, sync) = on_writer(&store, |conn| {
        let mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
        let sync: i64 = conn.query_row("PRAGMA synchronous", [], |r| r.get(0))?;
        Ok((mode, sync))
    })
    .await?;
    assert_eq!(mode, "wal");
    assert_eq!(sync, 2, "synchronous=FULL");
    Ok(())
}

#[tokio::test]
async fn database_wal_shm_and_lock_are_owner_only() -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("state.db");
    // A database left world-readable by an older version is tightened too.
    std::fs::write(&db, b"")?;
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o644))?;
    let store = SqliteStore::open(&db).await?;
    store.create("/k", b"v".to_vec()).await?;
    for name in ["state.db", "state.db-wal", "state.db-shm", "state.db.lock"] {
        let mode = std::fs::metadata(dir.path().join(name))?
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{name}");
    }
    Ok(())
}

#[tokio::test]
async fn second_open_of_one_file_is_refused() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("s.db");
    let first = SqliteStore::open(&path).await?;
    match SqliteStore::open(&path).await {
        Err(StoreError::Backend(msg)) => assert!(msg.contains("in use"), "{msg}"),
        other => anyhow::bail!("second open: {other:?}"),
    }
    drop(first);
    SqliteStore::open(&path).await?;
    Ok(())
}

#[tokio::test]
async fn lagging_watcher_catches_up_from_the_log() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open_with_capacity(&dir.path().join("s.db"), 4).await?;
    let mut w = store.watch("/k", 0).await?;
    let mut kv = store.create("/k", b"0".to_vec()).await?;
    for i in 1..50 {
        kv = store
            .update("/k", i.to_string().into_bytes(), kv.mod_revision)
            .await?;
    }
    // Read a few, fall behind again, read the rest.
    for rev in 1..=3 {
        let ev = w.next().await.expect("event")?;
        assert_eq!(ev.revision, rev);
    }
    for i in 50..80 {
        kv = store
            .update("/k", i.to_string().into_bytes(), kv.mod_revision)
            .await?;
    }
    for rev in 4..=80 {
        let ev = tokio::time::timeout(Duration::from_secs(5), w.next())
            .await?
            .expect("event")?;
        assert_eq!(ev.revision, rev);
        assert_eq!(ev.kv.value, (rev - 1).to_string().into_bytes());
        let kind = if rev == 1 {
            EventKind::Created
        } else {
            EventKind::Modified
        };
        assert_eq!(ev.kind, kind);
    }
    assert!(
        tokio::time::timeout(Duration::from_millis(200), w.next())
            .await
            .is_err()
    );
    Ok(())
}

#[tokio::test]
async fn lagging_watcher_behind_a_compaction_gets_compacted() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open_with_capacity(&dir.path().join("s.db"), 2).await?;
    let mut w = store.watch("/k", 0).await?;
    let mut kv = store.create("/k", b"0".to_vec()).await?;
    let first = w.next().await.expect("event")?;
    assert_eq!(first.revision, 1);
    for i in 1..10 {
        kv = store
            .update("/k", i.to_string().into_bytes(), kv.mod_revision)
            .await?;
    }
    store.compact(kv.mod_revision).await?;
    match w.next().await {
        Some(Err(StoreError::Compacted {
            requested: 1,
            compacted: 10,
        })) => {}
        other => anyhow::bail!("expected Compacted, got {other:?}"),
    }
    assert!(w.next().await.is_none(), "the stream ends after Compacted");
    Ok(())
}

#[tokio::test]
async fn compaction_removes_superseded_rows_and_tombstones() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("s.db")).await?;
    let mut a = store.create("/a", b"0".to_vec()).await?;
    for i in 1..20 {
        a = store
            .update("/a", i.to_string().into_bytes(), a.mod_revision)
            .await?;
    }
    store.create("/b", b"b".to_vec()).await?;
    store.delete("/b", None).await?;
    let c = store.create("/c", b"c".to_vec()).await?;
    let rows = |store: &SqliteStore| {
        let store = store.clone();
        async move {
            on_writer(&store, |conn| {
                Ok(conn.query_row("SELECT COUNT(*) FROM kv_log", [], |r| r.get::<_, i64>(0))?)
            })
            .await
        }
    };
    assert_eq!(rows(&store).await?, 23);
    store.compact(c.mod_revision).await?;
    // Left: the last row of /a (below the mark) and /c (at the mark).
    assert_eq!(rows(&store).await?, 2);
    assert_eq!(store.get("/a").await?, Some(a));
    assert_eq!(store.current_revision().await?, 23);
    // The revision survives the loss of its newest row, and the marker survives a reopen.
    store.delete("/c", None).await?;
    store.compact(24).await?;
    assert_eq!(rows(&store).await?, 1);
    drop(store);
    let store = SqliteStore::open(dir.path().join("s.db")).await?;
    assert_eq!(store.current_revision().await?, 24);
    assert_eq!(store.compacted_revision().await?, 24);
    assert_eq!(store.create("/d", Vec::new()).await?.mod_revision, 25);
    Ok(())
}

/// Runs in a child process of `survives_a_killed_writer`: 8 concurrent writers (so that their
/// writes share group commits) write until killed, printing one line per acknowledged write.
#[tokio::test]
#[ignore = "helper process for survives_a_killed_writer"]
async fn crash_child() -> anyhow::Result<()> {
    let Some(path) = std::env::var_os(CRASH_CHILD_DB) else {
        return Ok(());
    };
    let store = SqliteStore::open(path).await?;
    let mut tasks = Vec::new();
    for t in 0..8 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..100_000 {
                let kv = store
                    .create(&format!("/crash/{t}-{i:06}"), vec![7; 100])
                    .await?;
                println!("ACK {} {}", kv.key, kv.mod_revision);
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

#[tokio::test]
async fn survives_a_killed_writer() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("crash.db");
    let mut child = Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "sqlite::tests::crash_child",
            "--ignored",
            "--nocapture",
        ])
        .env(CRASH_CHILD_DB, &path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().expect("piped stdout");
    let acked = tokio::task::spawn_blocking(move || {
        let mut acked = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            if let Some(rest) = line.strip_prefix("ACK ") {
                let (key, rev) = rest.split_once(' ').expect("ACK key rev");
                acked.push((key.to_owned(), rev.parse::<i64>()?));
                if acked.len() == 150 {
                    break;
                }
            }
        }
        anyhow::Ok(acked)
    })
    .await??;
    child.kill()?; // SIGKILL, in the middle of the write stream
    child.wait()?;
    assert_eq!(acked.len(), 150, "the child acknowledged writes");

    let store = SqliteStore::open(&path).await?;
    for (key, rev) in &acked {
        let kv = store.get(key).await?;
        assert_eq!(kv.map(|kv| kv.mod_revision), Some(*rev), "{key} survived");
    }
    assert!(store.current_revision().await? >= 150);
    Ok(())
}

/// Runs `f` on the writer thread's connection, between group commits.
async fn on_writer<T: Send + 'static>(
    store: &SqliteStore,
    f: impl FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    store.exclusive(f).await
}

/// Holds the writer thread until the returned sender is dropped, so that writes queue up.
fn hold_writer(store: &SqliteStore) -> std::sync::mpsc::Sender<()> {
    let (release, held) = std::sync::mpsc::channel::<()>();
    let job = Job::Exclusive(Box::new(move |_| {
        let _ = held.recv();
    }));
    assert!(store.inner.writer.send(job), "writer thread is running");
    release
}

fn queued(store: &SqliteStore) -> u64 {
    store.inner.writer.stats.queued.load(Ordering::Relaxed)
}

fn batches(store: &SqliteStore) -> u64 {
    store.inner.writer.stats.batches.load(Ordering::Relaxed)
}

/// Spawns `write` and returns once it has queued its job, so that jobs queue in call order.
async fn queue<T: Send + 'static>(
    store: &SqliteStore,
    write: impl Future<Output = T> + Send + 'static,
) -> tokio::task::JoinHandle<T> {
    let before = queued(store);
    let task = tokio::spawn(write);
    while queued(store) == before {
        tokio::task::yield_now().await;
    }
    task
}

#[tokio::test]
async fn concurrent_writes_share_one_commit() -> anyhow::Result<()> {
    const WRITES: usize = 40;
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("s.db")).await?;
    let mut w = store.watch("/g/", 0).await?;
    let release = hold_writer(&store);
    let before = batches(&store);
    let mut tasks = Vec::new();
    for i in 0..WRITES {
        let s = store.clone();
        tasks.push(
            queue(&store, async move {
                s.create(&format!("/g/{i:02}"), vec![1]).await
            })
            .await,
        );
    }
    drop(release);
    let mut revisions = Vec::new();
    for t in tasks {
        revisions.push(t.await??.mod_revision);
    }
    assert_eq!(
        batches(&store) - before,
        1,
        "{WRITES} queued writes, one commit"
    );
    // Queue order is revision order, with no gaps.
    assert_eq!(revisions, (1..=WRITES as i64).collect::<Vec<_>>());
    for (i, want) in revisions.iter().enumerate() {
        let ev = w.next().await.expect("event")?;
        assert_eq!(ev.revision, *want);
        assert_eq!(ev.kv.key, format!("/g/{i:02}"));
    }
    // Every acknowledged write of the batch is on disk in a fresh process' view.
    drop(w);
    drop(store);
    let store = SqliteStore::open(dir.path().join("s.db")).await?;
    let listed = store.list("/g/", Default::default()).await?;
    assert_eq!(listed.items.len(), WRITES);
    Ok(())
}

#[tokio::test]
async fn a_failed_write_in_a_batch_fails_alone() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("s.db")).await?;
    let a = store.create("/a", b"0".to_vec()).await?;
    let mut w = store.watch("/", a.mod_revision).await?;
    let release = hold_writer(&store);
    let before = batches(&store);
    let s = store.clone();
    let update_a = queue(
        &store,
        async move { s.update("/a", b"1".to_vec(), 1).await },
    )
    .await;
    // Same precondition: the first update of the batch moved /a on, so this one conflicts.
    let s = store.clone();
    let stale_a = queue(
        &store,
        async move { s.update("/a", b"2".to_vec(), 1).await },
    )
    .await;
    let s = store.clone();
    let create_b = queue(&store, async move { s.create("/b", b"b".to_vec()).await }).await;
    let s = store.clone();
    let create_b_again = queue(&store, async move { s.create("/b", b"x".to_vec()).await }).await;
    let s = store.clone();
    let delete_missing = queue(&store, async move { s.delete("/missing", None).await }).await;
    let s = store.clone();
    let update_b = queue(
        &store,
        async move { s.update("/b", b"b2".to_vec(), 3).await },
    )
    .await;
    drop(release);

    assert_eq!(update_a.await??.mod_revision, 2);
    match stale_a.await? {
        Err(StoreError::Conflict {
            expected: 1,
            current: Some(current),
            ..
        }) => assert_eq!((current.mod_revision, current.value), (2, b"1".to_vec())),
        other => anyhow::bail!("stale update: {other:?}"),
    }
    assert_eq!(create_b.await??.mod_revision, 3);
    assert!(matches!(
        create_b_again.await?,
        Err(StoreError::AlreadyExists(_))
    ));
    assert!(matches!(
        delete_missing.await?,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(update_b.await??.mod_revision, 4);
    assert_eq!(batches(&store) - before, 1, "one commit for the six writes");

    // The failed writes left no row and no revision behind; the others are all there.
    assert_eq!(store.current_revision().await?, 4);
    assert_eq!(
        store.get("/a").await?.map(|kv| kv.value),
        Some(b"1".to_vec())
    );
    assert_eq!(
        store.get("/b").await?.map(|kv| kv.value),
        Some(b"b2".to_vec())
    );
    let mut seen = Vec::new();
    for _ in 0..3 {
        let ev = w.next().await.expect("event")?;
        seen.push((ev.revision, ev.kind, ev.kv.key));
    }
    assert_eq!(
        seen,
        [
            (2, EventKind::Modified, "/a".to_owned()),
            (3, EventKind::Created, "/b".to_owned()),
            (4, EventKind::Modified, "/b".to_owned()),
        ]
    );
    Ok(())
}

#[tokio::test]
async fn routed_watches_see_their_resource_in_order_and_catch_up() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // A small channel, so that the routed watcher also lags and catches up from the log.
    let store = SqliteStore::open_with_capacity(&dir.path().join("s.db"), 4).await?;
    let mut vmis = store.watch("/registry/g/vmis/ns/", 0).await?;
    let mut all = store.watch("/registry/", 0).await?;
    let mut want = Vec::new();
    for i in 0..20 {
        store
            .create(&format!("/registry/g/leases/ns/l{i}"), vec![])
            .await?;
        let kv = store
            .create(&format!("/registry/g/vmis/ns/v{i}"), vec![])
            .await?;
        store
            .create(&format!("/registry/g/vmis/other/v{i}"), vec![])
            .await?;
        want.push((kv.mod_revision, kv.key));
    }
    let mut got = Vec::new();
    while got.len() < want.len() {
        let ev = tokio::time::timeout(Duration::from_secs(5), vmis.next())
            .await?
            .expect("event")?;
        got.push((ev.revision, ev.kv.key));
    }
    assert_eq!(got, want);
    for rev in 1..=60 {
        let ev = tokio::time::timeout(Duration::from_secs(5), all.next())
            .await?
            .expect("event")?;
        assert_eq!(ev.revision, rev);
    }
    Ok(())
}

#[test]
fn list_range_starts_after_the_continue_key_and_ends_at_the_prefix_end() {
    use super::log::list_range;
    // Whole prefix.
    assert_eq!(
        list_range(b"/r/a/", None),
        (b"/r/a/".to_vec(), Some(b"/r/a0".to_vec()))
    );
    // A page after `/r/a/x`: the smallest key greater than it, same end.
    assert_eq!(
        list_range(b"/r/a/", Some(b"/r/a/x")),
        (b"/r/a/x\0".to_vec(), Some(b"/r/a0".to_vec()))
    );
    // A continue key before the prefix does not widen the range.
    assert_eq!(
        list_range(b"/r/b/", Some(b"/r/a/z")),
        (b"/r/b/".to_vec(), Some(b"/r/b0".to_vec()))
    );
    // No end for the empty prefix.
    assert_eq!(list_range(b"", None), (Vec::new(), None));
}

/// Every list is an index range search bounded on both sides: a prefix's list reads its own
/// keys, not every key that sorts after it (docs/scale.md, eighth pass).
#[tokio::test]
async fn a_prefix_list_searches_only_its_key_range() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(&dir.path().join("s.db")).await?;
    // Keys before, inside and after the listed prefix, several revisions each.
    for round in 0..3 {
        for p in ["/r/a/", "/r/b/", "/r/c/"] {
            for i in 0..20 {
                let k = format!("{p}{i:03}");
                match store.get(&k).await? {
                    None => store.create(&k, b"{}".to_vec()).await.map(drop)?,
                    Some(kv) => store
                        .update(
                            &k,
                            format!("{{\"r\":{round}}}").into_bytes(),
                            kv.mod_revision,
                        )
                        .await
                        .map(drop)?,
                }
            }
        }
    }
    let listed = store
        .list(
            "/r/b/",
            crate::ListOptions {
                limit: Some(5),
                start_after: Some("/r/b/004".into()),
                revision: None,
            },
        )
        .await?;
    let keys: Vec<_> = listed.items.iter().map(|kv| kv.key.as_str()).collect();
    assert_eq!(
        keys,
        ["/r/b/005", "/r/b/006", "/r/b/007", "/r/b/008", "/r/b/009"]
    );
    assert!(listed.more);
    let all = store.list("/r/b/", Default::default()).await?;
    assert_eq!(all.items.len(), 20);
    assert!(all.items.iter().all(|kv| kv.value == b"{\"r\":2}"));
    // The plan: an index search bounded on both sides.
    let conn = Connection::open(dir.path().join("s.db"))?;
    let plan: Vec<String> = conn
        .prepare(&format!("EXPLAIN QUERY PLAN {}", super::log::LIST_BOUNDED))?
        .query_map(
            rusqlite::params![b"/r/b/".to_vec(), b"/r/b0".to_vec(), 1_000_000i64, -1i64],
            |r| r.get::<_, String>(3),
        )?
        .collect::<Result<_, _>>()?;
    assert!(
        plan.iter().any(|d| d.contains("(name>? AND name<?)")),
        "{plan:?}"
    );
    Ok(())
}

/// A statement taken from the cache again is not compiled again: rusqlite clears a statement's
/// bindings when it goes back to its cache, and SQLite recompiled (`sqlite3Reprepare`) every
/// `latest`, list and watch-read statement when that happened (a parse and a plan per store
/// read and write, 4 % of the idle server's CPU), until the connections were given the query
/// planner stability guarantee ([`super::log::configure`]).
#[test]
fn cached_statements_are_not_recompiled_on_reuse() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let conn = Connection::open(dir.path().join("r.db"))?;
    super::log::configure(&conn)?;
    super::log::init_schema(&conn)?;
    for i in 0..20 {
        super::log::append(&conn, &format!("/k/{i}"), b"v", None, 0, false)?;
    }
    for i in 0..10 {
        super::log::latest(&conn, &format!("/k/{i}"))?;
        super::log::list(&conn, "/k/", &crate::ListOptions::default())?;
        super::log::events_after(&conn, "/k/", i, 5)?;
    }
    for sql in [
        super::log::LATEST,
        super::log::LIST_BOUNDED,
        super::log::EVENTS_AFTER,
    ] {
        let stmt = conn.prepare_cached(sql)?;
        assert_eq!(stmt.get_status(rusqlite::StatementStatus::Run), 10, "{sql}");
        assert_eq!(
            stmt.get_status(rusqlite::StatementStatus::RePrepare),
            0,
            "{sql}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn point_reads_see_every_acknowledged_write() -> anyhow::Result<()> {
    use std::collections::HashMap;
    use std::sync::Arc;
    use std::sync::atomic::AtomicI64;
    const KEYS: usize = 3;
    const WRITES_PER_TASK: usize = 300;
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("s.db")).await?;
    let keys: Vec<String> = (0..KEYS).map(|i| format!("/hot/{i}")).collect();
    // The revision of each key's latest acknowledged write, and every value written by revision.
    let floors: Arc<Vec<AtomicI64>> = Arc::new((0..KEYS).map(|_| AtomicI64::new(0)).collect());
    let written = Arc::new(std::sync::Mutex::new(HashMap::<i64, Vec<u8>>::new()));
    for (i, k) in keys.iter().enumerate() {
        let kv = store.create(k, b"0".to_vec()).await?;
        floors[i].store(kv.mod_revision, Ordering::SeqCst);
        written.lock().unwrap().insert(kv.mod_revision, kv.value);
    }
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..4 {
        let (s, keys, floors, written) =
            (store.clone(), keys.clone(), floors.clone(), written.clone());
        tasks.spawn(async move {
            for n in 0..WRITES_PER_TASK {
                let i = (w + n) % KEYS;
                let value = format!("w{w}-{n}").into_bytes();
                loop {
                    let cur = s.get(&keys[i]).await?.expect("never deleted");
                    match s.update(&keys[i], value.clone(), cur.mod_revision).await {
                        Ok(kv) => {
                            written.lock().unwrap().insert(kv.mod_revision, value);
                            floors[i].fetch_max(kv.mod_revision, Ordering::SeqCst);
                            break;
                        }
                        Err(StoreError::Conflict { .. }) => continue,
                        Err(e) => return Err(anyhow::Error::from(e)),
                    }
                }
                if n % 20 == 19 {
                    // Exclusive work (compaction) in between empties the cache.
                    let rev = s.current_revision().await?;
                    s.compact(rev - 1).await?;
                }
            }
            Ok(Vec::new())
        });
    }
    for r in 0..4 {
        let (s, keys, floors) = (store.clone(), keys.clone(), floors.clone());
        tasks.spawn(async move {
            let mut seen = Vec::new();
            for n in 0..3000 {
                let i = (r + n) % KEYS;
                let floor = floors[i].load(Ordering::SeqCst);
                let kv = s.get(&keys[i]).await?.expect("never deleted");
                assert!(
                    kv.mod_revision >= floor,
                    "{}: read revision {} after revision {floor} was acknowledged",
                    keys[i],
                    kv.mod_revision
                );
                seen.push((kv.mod_revision, kv.value));
                if n % 7 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            Ok(seen)
        });
    }
    let mut seen = Vec::new();
    while let Some(r) = tasks.join_next().await {
        seen.extend(r??);
    }
    let written = std::mem::take(&mut *written.lock().unwrap());
    for (rev, value) in &seen {
        assert_eq!(
            written.get(rev),
            Some(value),
            "value read at revision {rev}"
        );
    }
    let hits = store.inner.cache.hits.load(Ordering::Relaxed);
    assert!(hits > 0, "some reads were answered from the cache");
    for k in &keys {
        store.get(k).await?;
    }
    assert_eq!(store.inner.cache.len(), KEYS, "the hot keys are cached");
    Ok(())
}

#[tokio::test]
async fn a_cached_key_deleted_or_rewritten_outside_the_write_path_is_read_again()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("s.db")).await?;
    store.create("/a", b"1".to_vec()).await?;
    assert_eq!(store.get("/a").await?.unwrap().value, b"1");
    assert_eq!(store.inner.cache.len(), 1, "filled by the read");
    let del = store.delete("/a", None).await?;
    assert!(store.get("/a").await?.is_none(), "deleted");
    let again = store.create("/a", b"2".to_vec()).await?;
    assert!(again.mod_revision > del.mod_revision);
    assert_eq!(store.get("/a").await?.unwrap().value, b"2");
    assert_eq!(
        store.get("/a").await?.unwrap().mod_revision,
        again.mod_revision
    );
    // A row appended by raw SQL on the writer's connection (as compaction or a repair would
    // change the table) is seen by the next read.
    let raw = on_writer(&store, |conn| {
        let rev = super::log::append(conn, "/a", b"3", Some(1), 0, false)?;
        Ok(rev)
    })
    .await?;
    let kv = store.get("/a").await?.unwrap();
    assert_eq!((kv.value.as_slice(), kv.mod_revision), (&b"3"[..], raw));
    Ok(())
}
