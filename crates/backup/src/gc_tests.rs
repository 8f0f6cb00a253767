//! Prune and garbage-collection tests on the filesystem store, the races with a concurrent
//! backup among them.

use super::*;
use crate::repo::Create;
use crate::target::Target;

const KEY: &[u8] = b"a test key of at least 16 bytes";
const NOW: GcOptions = GcOptions {
    grace: Duration::ZERO,
    lock_ttl: LOCK_TTL,
};

/// Three chunks of pseudo-random bytes.
fn image(seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..3 * crate::format::CHUNK_SIZE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

async fn repo(dir: &tempfile::TempDir) -> Repository {
    let t = Target::Filesystem {
        path: dir.path().to_path_buf(),
        prefix: "r".into(),
    };
    Repository::open(&t, KEY, Create::IfMissing).await.unwrap()
}

async fn backup(repo: &Repository, name: &str, img: &[u8]) {
    let mut w = repo.begin(name).await.unwrap();
    w.write_disk("root", img, &|_| {}).await.unwrap();
    w.commit("2026-12-02T15:00:00Z", vec![], vec![])
        .await
        .unwrap();
}

fn count_chunks(dir: &tempfile::TempDir) -> usize {
    let root = dir.path().join("r/chunks");
    std::fs::read_dir(root)
        .map(|d| {
            d.map(|s| std::fs::read_dir(s.unwrap().path()).unwrap().count())
                .sum()
        })
        .unwrap_or(0)
}

async fn verify_ok(repo: &Repository) {
    let rep = repo.verify(None, &|_, _| {}).await.unwrap();
    assert!(rep.problems.is_empty(), "{:?}", rep.problems);
}

#[tokio::test]
async fn prune_then_collect_after_the_grace_period_only() {
    let dir = tempfile::tempdir().unwrap();
    let r = repo(&dir).await;
    backup(&r, "a", &image(1)).await;
    backup(&r, "b", &image(2)).await;
    assert_eq!(count_chunks(&dir), 6);
    r.delete_backup("a").await.unwrap();
    let names: Vec<String> = r
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["b"]);
    assert!(!dir.path().join("r/backups/a").join("manifest").exists());
    // a's chunks are young: kept
    let rep = r.gc(GcOptions::default()).await.unwrap();
    assert_eq!((rep.chunks_deleted, rep.chunks_kept_young), (0, 3));
    assert_eq!(rep.chunks_referenced, 3);
    // no grace: collected; b intact
    let rep = r.gc(NOW).await.unwrap();
    assert_eq!(rep.deferred, None);
    assert_eq!(rep.chunks_deleted, 3);
    assert_eq!(count_chunks(&dir), 3);
    verify_ok(&r).await;
    assert!(!dir.path().join("r/locks/gc").exists());
}

#[tokio::test]
async fn gc_defers_while_a_backup_runs_and_keeps_what_it_deduplicated() {
    let dir = tempfile::tempdir().unwrap();
    let r = repo(&dir).await;
    let img = image(3);
    backup(&r, "old", &img).await;
    r.delete_backup("old").await.unwrap();
    // a backup starts and deduplicates against the now unreferenced chunks
    let mut w = r.begin("new").await.unwrap();
    let d = w.write_disk("root", &img[..], &|_| {}).await.unwrap();
    assert_eq!(d.stats.chunks_deduplicated, 3);
    // a collection at this moment must not delete them
    let rep = r.gc(NOW).await.unwrap();
    assert_eq!(rep.deferred.as_deref(), Some("new"));
    assert_eq!(rep.chunks_deleted, 0);
    assert_eq!(count_chunks(&dir), 3);
    w.commit("t", vec![], vec![]).await.unwrap();
    // after the commit the collection runs and keeps every referenced chunk
    let rep = r.gc(NOW).await.unwrap();
    assert_eq!((rep.deferred, rep.chunks_deleted), (None, 0));
    verify_ok(&r).await;
}

#[tokio::test]
async fn a_backup_waits_for_a_running_collection() {
    let dir = tempfile::tempdir().unwrap();
    let r = repo(&dir).await;
    // a collection holds its lock (it listed the locks before this writer began)
    r.put_lock(GC_LOCK).await.unwrap();
    let err = r
        .begin_waiting("w", Duration::from_millis(700))
        .await
        .unwrap_err();
    assert!(matches!(err, BackupError::GcRunning), "{err}");
    // the refused writer left no lock behind
    assert!(!dir.path().join("r/locks/w").exists());
    // the collection ends while the writer waits: the writer goes on
    let r2 = r.clone();
    let ends = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(600)).await;
        r2.drop_lock(GC_LOCK).await.unwrap();
    });
    let mut w = r.begin_waiting("w", Duration::from_secs(30)).await.unwrap();
    ends.await.unwrap();
    w.write_disk("root", &image(4)[..], &|_| {}).await.unwrap();
    w.commit("t", vec![], vec![]).await.unwrap();
    assert!(!dir.path().join("r/locks/w").exists());
    verify_ok(&r).await;
}

#[tokio::test]
async fn an_interrupted_backup_is_cleaned_up_and_its_stale_lock_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let r = repo(&dir).await;
    backup(&r, "kept", &image(5)).await;
    {
        let mut w = r.begin("dead").await.unwrap();
        w.write_disk("root", &image(6)[..], &|_| {}).await.unwrap();
        // the process died here: lock, index and chunks left, no catalog entry
    }
    // fresh lock: deferred
    assert_eq!(r.gc(NOW).await.unwrap().deferred.as_deref(), Some("dead"));
    // once the lock is stale, the collection removes it, the orphan index and the chunks
    let stale = GcOptions {
        grace: Duration::ZERO,
        lock_ttl: Duration::ZERO,
    };
    let rep = r.gc(stale).await.unwrap();
    assert_eq!(rep.deferred, None);
    assert_eq!(rep.stale_locks, ["locks/dead"]);
    assert_eq!(rep.chunks_deleted, 3);
    assert_eq!(rep.orphans_deleted, 1);
    assert!(
        !dir.path()
            .join("r/backups/dead")
            .join("disks/root.index")
            .exists()
    );
    assert_eq!(count_chunks(&dir), 3);
    verify_ok(&r).await;
}

#[tokio::test]
async fn a_writer_whose_lock_went_stale_fails_rather_than_commit_a_hole() {
    let dir = tempfile::tempdir().unwrap();
    let r = repo(&dir).await;
    let img = image(7);
    backup(&r, "old", &img).await;
    r.delete_backup("old").await.unwrap();
    let mut w = r.begin("slow").await.unwrap();
    w.write_disk("root", &img[..], &|_| {}).await.unwrap();
    // the writer stalled past the TTL: a collection takes its lock for stale and deletes
    let rep = r
        .gc(GcOptions {
            grace: Duration::ZERO,
            lock_ttl: Duration::ZERO,
        })
        .await
        .unwrap();
    assert_eq!(rep.chunks_deleted, 3);
    let err = w.commit("t", vec![], vec![]).await.unwrap_err();
    assert!(matches!(err, BackupError::ChunkCollected { .. }), "{err}");
    assert!(r.list().await.unwrap().is_empty());
    // the next run uploads the chunks again and succeeds
    backup(&r, "slow", &img).await;
    verify_ok(&r).await;
}

#[test]
fn ages() {
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
    let old = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
    assert!(!younger_than(old, Duration::from_secs(60), now));
    assert!(younger_than(old, Duration::from_secs(1000), now));
    // a time in the future (clock skew) counts as young
    assert!(younger_than(
        now + Duration::from_secs(5),
        Duration::ZERO,
        now
    ));
}
