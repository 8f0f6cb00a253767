//! Pruning and garbage collection, safe against a backup running at the same time
//! (docs/backup.md, "Prune and garbage collection").
//!
//! - [`Repository::delete_backup`]: the catalog entry first (the backup stops being listed),
//!   then its manifest and indexes. Chunks stay until a collection.
//! - Locks: a writer puts `locks/<backup>` when it begins and refreshes it every
//!   [`HEARTBEAT`]; a collection puts `locks/gc`. Each writes its own lock, then looks for the
//!   other's (on a store with read-after-write consistency, as S3 and a filesystem are): a
//!   collection that finds a fresh writer lock stops without deleting anything ("deferred"); a
//!   writer that finds a fresh `locks/gc` waits for it to go before it reads anything. So a
//!   chunk a running backup found by HEAD and counted as deduplicated is never collected under
//!   it. A lock older than the TTL is stale (its process died) and ignored, then removed.
//! - Grace: an unreferenced chunk is deleted only if it is older than the grace period (by the
//!   store's last-modified time), which covers a writer whose lock went stale while it lived.
//! - Generation: a collection that deleted anything writes `gc/last`; a writer that finds it
//!   newer than its own start re-checks every chunk it uses before its catalog entry, and fails
//!   naming a missing one rather than commit a backup with a hole.
//! - The reference set is every index of every backup in the catalog; a manifest or index that
//!   cannot be read stops the collection (an unknown reference set deletes nothing).

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectMeta, ObjectStoreExt, PutPayload};
use serde::Serialize;

use crate::BackupError;
use crate::format::{Index, Manifest, paths};
use crate::repo::Repository;

/// How often a running writer refreshes its lock.
pub const HEARTBEAT: Duration = Duration::from_secs(60);
/// A lock not refreshed for this long belongs to a dead process.
pub const LOCK_TTL: Duration = Duration::from_secs(10 * 60);
/// Default age below which an unreferenced chunk is kept.
pub const GRACE: Duration = Duration::from_secs(60 * 60);
/// The collection's lock name and its generation marker, below the prefix.
pub const GC_LOCK: &str = "locks/gc";
pub const GC_LAST: &str = "gc/last";

/// A writer's lock name.
pub fn writer_lock(backup: &str) -> String {
    format!("locks/{backup}")
}

/// Knobs of a collection.
#[derive(Clone, Copy, Debug)]
pub struct GcOptions {
    pub grace: Duration,
    pub lock_ttl: Duration,
}

impl Default for GcOptions {
    fn default() -> Self {
        Self {
            grace: GRACE,
            lock_ttl: LOCK_TTL,
        }
    }
}

/// What a collection did.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GcReport {
    /// Set when a running backup (named) made the collection stop before deleting anything.
    pub deferred: Option<String>,
    pub backups: u64,
    pub chunks_referenced: u64,
    pub chunks_deleted: u64,
    pub bytes_deleted: u64,
    /// Unreferenced chunks younger than the grace period, kept.
    pub chunks_kept_young: u64,
    /// Objects of interrupted backups (not in the catalog) deleted.
    pub orphans_deleted: u64,
    /// Stale locks removed.
    pub stale_locks: Vec<String>,
}

/// Whether an object last modified at `m` is younger than `age` at `now`.
pub fn younger_than(m: SystemTime, age: Duration, now: SystemTime) -> bool {
    now.duration_since(m).map(|d| d < age).unwrap_or(true)
}

fn modified(m: &ObjectMeta) -> SystemTime {
    SystemTime::from(m.last_modified)
}

impl Repository {
    fn rel<'a>(&self, p: &'a Path) -> &'a str {
        let s = p.as_ref();
        let pre = self.prefix_str();
        if pre.is_empty() {
            s
        } else {
            s.strip_prefix(pre)
                .and_then(|r| r.strip_prefix('/'))
                .unwrap_or(s)
        }
    }

    async fn list_under(&self, dir: &str) -> Result<Vec<ObjectMeta>, BackupError> {
        let base = self.path_of(dir);
        Ok(self.store_ref().list(Some(&base)).try_collect().await?)
    }

    async fn delete_quiet(&self, name: &str) -> Result<(), BackupError> {
        match self.store_ref().delete(&self.path_of(name)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Puts (or refreshes) the lock `name`.
    pub(crate) async fn put_lock(&self, name: &str) -> Result<(), BackupError> {
        let body = serde_json::to_vec(&serde_json::json!({
            "lock": name,
            "at": jiff::Timestamp::now().to_string(),
        }))?;
        self.store_ref()
            .put(&self.path_of(name), PutPayload::from(body))
            .await?;
        Ok(())
    }

    /// Removes the lock `name` (absent is fine).
    pub(crate) async fn drop_lock(&self, name: &str) -> Result<(), BackupError> {
        self.delete_quiet(name).await
    }

    /// The last-modified time of object `name`, None when absent.
    pub(crate) async fn modified_at(&self, name: &str) -> Result<Option<SystemTime>, BackupError> {
        match self.store_ref().head(&self.path_of(name)).await {
            Ok(m) => Ok(Some(modified(&m))),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Waits (polling every `poll`, at most `wait`) while a fresh collection lock exists.
    pub(crate) async fn wait_for_gc(&self, wait: Duration) -> Result<(), BackupError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            match self.modified_at(GC_LOCK).await? {
                Some(m) if younger_than(m, LOCK_TTL, SystemTime::now()) => {}
                _ => return Ok(()),
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(BackupError::GcRunning);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Whether chunk `id` exists.
    pub(crate) async fn has_chunk(&self, id: &str) -> Result<bool, BackupError> {
        Ok(self.modified_at(&paths::chunk(id)).await?.is_some())
    }

    /// Removes backup `name`: the catalog entry first, then its manifest and indexes. Its
    /// chunks are left to [`Repository::gc`].
    pub async fn delete_backup(&self, name: &str) -> Result<(), BackupError> {
        crate::format::check_backup_name(name)?;
        self.delete_quiet(&paths::catalog(name)).await?;
        for m in self.list_under(&format!("backups/{name}")).await? {
            let rel = self.rel(&m.location).to_string();
            self.delete_quiet(&rel).await?;
        }
        Ok(())
    }

    /// The ids referenced by every backup in the catalog; fails if any manifest or index
    /// cannot be read.
    async fn referenced(&self) -> Result<(u64, HashSet<String>), BackupError> {
        let mut ids = HashSet::new();
        let entries = self.list().await?;
        for e in &entries {
            let m: Manifest = self.read_record(&paths::manifest(&e.name)).await?;
            for d in &m.disks {
                let name = paths::index(&e.name, &d.name);
                let ix: Index = self.read_record(&name).await?;
                crate::format::check_index(&ix, &name)?;
                ids.extend(ix.chunks.into_iter().filter_map(|c| c.id));
            }
        }
        Ok((entries.len() as u64, ids))
    }

    /// Collects unreferenced chunks and the objects of interrupted backups (see the module
    /// doc for why this is safe against a concurrent backup).
    pub async fn gc(&self, opts: GcOptions) -> Result<GcReport, BackupError> {
        let started = SystemTime::now();
        self.put_lock(GC_LOCK).await?;
        let r = self.gc_locked(opts, started).await;
        let dropped = self.drop_lock(GC_LOCK).await;
        let r = r?;
        dropped?;
        Ok(r)
    }

    async fn gc_locked(
        &self,
        opts: GcOptions,
        started: SystemTime,
    ) -> Result<GcReport, BackupError> {
        let mut report = GcReport::default();
        let mut stale = Vec::new();
        for m in self.list_under("locks").await? {
            let name = self.rel(&m.location).to_string();
            if name == GC_LOCK {
                continue;
            }
            if younger_than(modified(&m), opts.lock_ttl, started) {
                report.deferred = Some(name.trim_start_matches("locks/").to_string());
                return Ok(report);
            }
            stale.push(name);
        }
        let (backups, referenced) = self.referenced().await?;
        report.backups = backups;
        report.chunks_referenced = referenced.len() as u64;
        let catalog: HashSet<String> = self.list().await?.into_iter().map(|e| e.name).collect();
        let mut deleted_any = false;
        for m in self.list_under(paths::CHUNKS).await? {
            let Some(id) = m.location.filename() else {
                continue;
            };
            if referenced.contains(id) {
                continue;
            }
            if younger_than(modified(&m), opts.grace, started) {
                report.chunks_kept_young += 1;
                continue;
            }
            let rel = self.rel(&m.location).to_string();
            self.delete_quiet(&rel).await?;
            report.chunks_deleted += 1;
            report.bytes_deleted += m.size;
            deleted_any = true;
        }
        for m in self.list_under("backups").await? {
            let rel = self.rel(&m.location).to_string();
            let backup = rel.split('/').nth(1).unwrap_or("");
            if catalog.contains(backup) || younger_than(modified(&m), opts.grace, started) {
                continue;
            }
            self.delete_quiet(&rel).await?;
            report.orphans_deleted += 1;
        }
        for name in stale {
            self.delete_quiet(&name).await?;
            report.stale_locks.push(name);
        }
        if deleted_any {
            self.put_lock(GC_LAST).await?;
        }
        Ok(report)
    }
}

#[cfg(test)]
#[path = "gc_tests.rs"]
mod tests;
