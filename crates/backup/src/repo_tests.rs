//! Repository tests on the filesystem store: round trip, dedup, wrong key, corruption,
//! interrupted backups.

use super::*;
use crate::target::Target;

const KEY: &[u8] = b"a test key of at least 16 bytes";

/// A disk image: 2 chunks of pseudo-random bytes, 1 chunk of zeros, a short random tail.
fn image(seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v: Vec<u8> = (0..2 * CHUNK_SIZE + 1000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    v.splice(
        2 * CHUNK_SIZE..2 * CHUNK_SIZE,
        std::iter::repeat_n(0u8, CHUNK_SIZE),
    );
    v
}

fn target(dir: &tempfile::TempDir) -> Target {
    Target::Filesystem {
        path: dir.path().to_path_buf(),
        prefix: "cluster-a".into(),
    }
}

async fn backup(repo: &Repository, name: &str, disks: &[(&str, &[u8])]) -> CatalogEntry {
    let mut w = repo.begin(name).await.unwrap();
    for (d, data) in disks {
        w.write_disk(d, *data, &|_| {}).await.unwrap();
    }
    let vm = serde_json::json!({"kind": "VirtualMachine", "metadata": {"namespace": "ns", "name": "vm1"}});
    w.commit("2026-12-02T15:00:00Z", vec![vm], vec![])
        .await
        .unwrap()
}

fn chunk_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let root = dir.join("cluster-a/chunks");
    for sub in std::fs::read_dir(root).unwrap() {
        for f in std::fs::read_dir(sub.unwrap().path()).unwrap() {
            out.push(f.unwrap().path());
        }
    }
    out.sort();
    out
}

#[tokio::test]
async fn round_trip_with_zero_chunks_and_stats() {
    let dir = tempfile::tempdir().unwrap();
    let repo = Repository::open(&target(&dir), KEY, Create::IfMissing)
        .await
        .unwrap();
    let img = image(7);
    let e = backup(&repo, "b1", &[("rootdisk", &img)]).await;
    assert_eq!(e.vms, vec!["ns/vm1".to_string()]);
    assert_eq!(e.size, img.len() as u64);
    assert_eq!(e.stats.bytes_read, img.len() as u64);
    assert_eq!(e.stats.bytes_zero, CHUNK_SIZE as u64);
    assert_eq!(e.stats.bytes_new, img.len() as u64 - CHUNK_SIZE as u64);
    assert_eq!(e.stats.chunks_new, 3);
    assert_eq!(chunk_files(dir.path()).len(), 3, "zero chunk not stored");

    // a fresh open (as another cluster would) lists and restores it
    let repo2 = Repository::open(&target(&dir), KEY, Create::Never)
        .await
        .unwrap();
    let list = repo2.list().await.unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(
        repo2.manifest("b1").await.unwrap().vms[0]["metadata"]["name"],
        "vm1"
    );
    let mut out = Vec::new();
    let n = repo2
        .restore_disk("b1", "rootdisk", &mut out, &|_| {})
        .await
        .unwrap();
    assert_eq!(n, img.len() as u64);
    assert!(out == img, "restored bytes differ");

    let report = repo2.verify(None, &|_, _| {}).await.unwrap();
    assert_eq!(report.chunks_checked, 3);
    assert!(report.problems.is_empty(), "{:?}", report.problems);

    // the bucket holds no plaintext: a chunk file does not contain a run of the image
    for f in chunk_files(dir.path()) {
        let bytes = std::fs::read(f).unwrap();
        assert!(!bytes.windows(64).any(|w| w == &img[4096..4160]));
    }
}

#[tokio::test]
async fn identical_images_are_stored_once() {
    let dir = tempfile::tempdir().unwrap();
    let repo = Repository::open(&target(&dir), KEY, Create::IfMissing)
        .await
        .unwrap();
    let img = image(11);
    let first = backup(&repo, "vm-a", &[("disk", &img)]).await;
    let stored_one = repo.stored_bytes().await.unwrap();
    let second = backup(&repo, "vm-b", &[("disk", &img), ("clone", &img)]).await;
    assert_eq!(second.stats.bytes_new, 0);
    assert_eq!(second.stats.chunks_new, 0);
    assert_eq!(second.stats.bytes_deduplicated, 2 * first.stats.bytes_new);
    let stored_two = repo.stored_bytes().await.unwrap();
    assert!(
        stored_two as f64 <= 1.1 * stored_one as f64,
        "{stored_two} > 1.1 × {stored_one}"
    );
    assert_eq!(chunk_files(dir.path()).len(), 3);
}

#[tokio::test]
async fn wrong_key_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let repo = Repository::open(&target(&dir), KEY, Create::IfMissing)
        .await
        .unwrap();
    backup(&repo, "b1", &[("d", &image(3))]).await;
    let err = Repository::open(
        &target(&dir),
        b"another key of 16+ bytes",
        Create::IfMissing,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, BackupError::WrongKey), "{err}");
    assert!(err.to_string().contains("wrong encryption key"));
    let err = Repository::open(&target(&dir), b"short", Create::Never)
        .await
        .unwrap_err();
    assert!(matches!(err, BackupError::KeyTooShort { .. }), "{err}");
    // an empty target is not a repository unless asked to create one
    let empty = tempfile::tempdir().unwrap();
    let err = Repository::open(&target(&empty), KEY, Create::Never)
        .await
        .unwrap_err();
    assert!(matches!(err, BackupError::NotInitialized), "{err}");
}

#[tokio::test]
async fn corrupted_and_missing_chunks_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let repo = Repository::open(&target(&dir), KEY, Create::IfMissing)
        .await
        .unwrap();
    backup(&repo, "b1", &[("rootdisk", &image(5))]).await;
    let files = chunk_files(dir.path());
    // flip one byte in the middle of the first chunk, delete the second
    let mut bytes = std::fs::read(&files[0]).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&files[0], &bytes).unwrap();
    std::fs::remove_file(&files[1]).unwrap();
    let id = |p: &std::path::Path| p.file_name().unwrap().to_str().unwrap().to_string();

    let report = repo.verify(Some("b1"), &|_, _| {}).await.unwrap();
    assert_eq!(report.chunks_checked, 3);
    assert_eq!(report.problems.len(), 2, "{:?}", report.problems);
    let corrupt = report
        .problems
        .iter()
        .find(|p| p.object.ends_with(&id(&files[0])))
        .unwrap();
    assert!(
        corrupt.reason.contains("authentication failed"),
        "{corrupt:?}"
    );
    assert_eq!(corrupt.disk.as_deref(), Some("rootdisk"));
    assert_eq!(corrupt.backup, "b1");
    let missing = report
        .problems
        .iter()
        .find(|p| p.object.ends_with(&id(&files[1])))
        .unwrap();
    assert_eq!(missing.reason, "missing");

    // a restore stops at the first bad chunk and names it
    let mut out = Vec::new();
    let err = repo
        .restore_disk("b1", "rootdisk", &mut out, &|_| {})
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains(&id(&files[0])) || err.to_string().contains(&id(&files[1])),
        "{err}"
    );
}

#[tokio::test]
async fn interrupted_backup_leaves_nothing_listed() {
    let dir = tempfile::tempdir().unwrap();
    let repo = Repository::open(&target(&dir), KEY, Create::IfMissing)
        .await
        .unwrap();
    let img = image(9);
    {
        let mut w = repo.begin("nightly").await.unwrap();
        w.write_disk("rootdisk", &img[..], &|_| {}).await.unwrap();
        // dropped before commit: the process died here
    }
    assert!(repo.list().await.unwrap().is_empty());
    assert!(matches!(
        repo.manifest("nightly").await,
        Err(BackupError::BackupNotFound(_))
    ));
    // the next run under the same name succeeds and reuses the chunks already uploaded
    let e = backup(&repo, "nightly", &[("rootdisk", &img)]).await;
    assert_eq!(e.stats.chunks_new, 0);
    assert_eq!(repo.list().await.unwrap().len(), 1);
    // a completed name is not written twice
    assert!(matches!(
        repo.begin("nightly").await,
        Err(BackupError::AlreadyExists(_))
    ));
    // bad names never reach the store
    assert!(matches!(
        repo.begin("../x").await,
        Err(BackupError::InvalidName { .. })
    ));
}

/// An incremental write reads only the changed chunks, takes the others from the previous
/// index, and restores to the new bytes without the previous backup being needed for more
/// than its chunks; a stream that does not hold exactly the named chunks is refused.
#[tokio::test]
async fn an_incremental_write_reads_only_changed_chunks_and_restores_the_new_disk() {
    let dir = tempfile::tempdir().unwrap();
    let repo = Repository::open(&target(&dir), KEY, Create::IfMissing)
        .await
        .unwrap();
    let old = image(7);
    backup(&repo, "b1", &[("data", &old)]).await;
    let base = repo.index("b1", "data").await.unwrap();
    // Chunk 1 rewritten, chunk 3 (the short tail) too.
    let mut new = old.clone();
    new[CHUNK_SIZE + 5..CHUNK_SIZE + 4005].fill(0xAB);
    let tail = new.len() - 10;
    new[tail..].fill(0xCD);
    let changed_bytes = [&new[CHUNK_SIZE..2 * CHUNK_SIZE], &new[3 * CHUNK_SIZE..]].concat();
    let mut w = repo.begin("b2").await.unwrap();
    let e = w
        .write_disk_changed(
            "data",
            &base,
            new.len() as u64,
            &[1, 3],
            &changed_bytes[..],
            &|_| {},
        )
        .await
        .unwrap();
    assert_eq!(e.stats.bytes_read, changed_bytes.len() as u64);
    assert_eq!(e.stats.bytes_new, changed_bytes.len() as u64);
    // Chunk 0 (random) and chunk 2 (zeros) taken over unread; the zeros count as zeros too.
    assert_eq!(e.stats.bytes_reused, 2 * CHUNK_SIZE as u64);
    assert_eq!(e.stats.chunks_reused, 2);
    assert_eq!(e.stats.bytes_zero, CHUNK_SIZE as u64);
    assert_eq!(e.stats.bytes_read + e.stats.bytes_reused, new.len() as u64);
    w.commit("2026-12-02T16:00:00Z", vec![], vec![])
        .await
        .unwrap();
    let mut out = Vec::new();
    repo.restore_disk("b2", "data", &mut out, &|_| {})
        .await
        .unwrap();
    assert!(out == new, "the incremental backup restores the new bytes");
    // The old backup still restores the old bytes.
    let mut out = Vec::new();
    repo.restore_disk("b1", "data", &mut out, &|_| {})
        .await
        .unwrap();
    assert!(out == old);
    // A chunk of the base deleted from the target is found before it would be taken over.
    assert_eq!(repo.first_missing_chunk(&base).await.unwrap(), None);
    let victim = base.chunks[0].id.clone().unwrap();
    let (store, _) = repo.store();
    store
        .delete(&repo.path_of(&paths::chunk(&victim)))
        .await
        .unwrap();
    assert_eq!(repo.first_missing_chunk(&base).await.unwrap(), Some(victim));
    // Too few or too many bytes for the named chunks, or another size: refused.
    let mut w = repo.begin("b3").await.unwrap();
    let short = &changed_bytes[..100];
    assert!(
        w.write_disk_changed("data", &base, new.len() as u64, &[1, 3], short, &|_| {})
            .await
            .is_err()
    );
    let long = [&changed_bytes[..], b"x"].concat();
    assert!(
        w.write_disk_changed("d2", &base, new.len() as u64, &[1, 3], &long[..], &|_| {})
            .await
            .is_err()
    );
    let err = w
        .write_disk_changed("d3", &base, new.len() as u64 + 1, &[], &[][..], &|_| {})
        .await
        .unwrap_err();
    assert!(err.to_string().contains("size changed"), "{err}");
}
