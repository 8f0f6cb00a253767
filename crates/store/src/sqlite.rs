//! The embedded SQLite backend ([`SqliteStore`]): one database file in WAL mode with
//! `synchronous=FULL`, so a write is acknowledged only after its commit reached the disk.
//!
//! Writes are queued to one writer thread that owns the writer connection (SQLite allows one
//! writer at a time anyway) and commits them in groups: all writes queued while the previous
//! group was being synced go into one transaction with one fsync, each in its own savepoint,
//! and each caller is answered only after that commit ([`writer`]). After each commit the
//! writer publishes the group's events in revision order on in-process broadcast channels, one
//! per resource, so that a write wakes only the watch streams of its resource ([`hub`]).
//! Reads run on tokio's blocking pool over a small pool of separate connections, each read in
//! its own transaction so that it sees one consistent snapshot; a point read of a key read
//! lately is answered from the point cache the writer keeps true ([`cache`]). An advisory lock
//! on `PATH.lock` keeps a second process from opening the same database (its watchers would
//! miss our events). The schema and queries live in [`log`]; watch streams in [`watch`].

mod cache;
mod hub;
mod log;
#[cfg(test)]
mod tests;
mod watch;
mod writer;

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rusqlite::{Connection, OpenFlags, TransactionBehavior};

use crate::{
    EventKind, KeyValue, ListOptions, ListResult, Revision, Store, StoreError, WatchEvent,
    WatchStream,
};

/// Live events buffered per watcher before it has to catch up from the log table.
const BROADCAST_CAPACITY: usize = 4096;
/// Idle reader connections kept open.
const MAX_IDLE_READERS: usize = 8;
/// Rows deleted per compaction transaction (keeps the writer lock short).
const COMPACT_CHUNK: i64 = 5000;
/// How long SQLite waits on a lock held by another connection before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `open` waits for the previous owner of the lock file to let go.
const LOCK_WAIT: Duration = Duration::from_secs(3);

/// The SQLite store. Cheap to clone; clones share one database. The database (and its lock)
/// stays open until the last clone and the last watch stream from it are dropped.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

struct Inner {
    path: PathBuf,
    // Readers are declared (so dropped) before the writer: the last connection to close
    // checkpoints the WAL into the database, which read-only connections cannot do.
    readers: Mutex<Vec<Connection>>,
    writer: writer::Writer,
    events: Arc<hub::Hub>,
    /// The latest values of hot keys, kept by the writer ([`cache`]).
    cache: Arc<cache::PointCache>,
    /// Held for the store's lifetime: the advisory lock against other processes.
    _lock: File,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave a half-done transaction behind (it rolls back
    // on drop), so a poisoned mutex is still safe to use.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn writer_gone() -> StoreError {
    StoreError::Backend("sqlite: the writer thread failed".into())
}

/// The commit error of a batch, for each of its callers.
fn copy_error(e: &StoreError) -> StoreError {
    StoreError::Backend(format!("sqlite: commit failed: {e}"))
}

fn join_error(e: tokio::task::JoinError) -> StoreError {
    StoreError::Backend(format!("sqlite worker failed: {e}"))
}

/// Creates the database file 0600 when missing and makes it, its WAL, shared-memory and lock
/// files 0600 when they exist (SQLite creates `-wal` and `-shm` with the database's mode).
fn make_private(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(path)?;
    for suffix in ["", "-wal", "-shm", ".lock"] {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        match std::fs::set_permissions(&name, std::fs::Permissions::from_mode(0o600)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

impl SqliteStore {
    /// Opens (creating when missing) the database at `path`, and its parent directory.
    pub async fn open(path: impl AsRef<Path>) -> Result<SqliteStore, StoreError> {
        Self::open_with_capacity(path.as_ref(), BROADCAST_CAPACITY).await
    }

    async fn open_with_capacity(path: &Path, capacity: usize) -> Result<SqliteStore, StoreError> {
        let path = path.to_path_buf();
        tokio::task::spawn_blocking(move || Self::open_blocking(path, capacity))
            .await
            .map_err(join_error)?
    }

    fn open_blocking(path: PathBuf, capacity: usize) -> Result<SqliteStore, StoreError> {
        let io_err = |what: &str, e: std::io::Error| {
            StoreError::Backend(format!("sqlite: {what} {}: {e}", path.display()))
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| io_err("creating the directory of", e))?;
        }
        let lock_path = {
            let mut name = path.as_os_str().to_owned();
            name.push(".lock");
            PathBuf::from(name)
        };
        let lock_file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&lock_path)
            .map_err(|e| io_err("opening the lock file of", e))?;
        let deadline = Instant::now() + LOCK_WAIT;
        loop {
            match lock_file.try_lock() {
                Ok(()) => break,
                Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(StoreError::Backend(format!(
                        "sqlite: {} is in use by another store (lock {} is held)",
                        path.display(),
                        lock_path.display()
                    )));
                }
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(io_err("locking", e));
                }
            }
        }

        make_private(&path).map_err(|e| io_err("restricting", e))?;
        let writer = Connection::open(&path)?;
        writer.busy_timeout(BUSY_TIMEOUT)?;
        log::configure(&writer)?;
        let mode: String = writer.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::Backend(format!(
                "sqlite: could not switch {} to WAL mode (got {mode})",
                path.display()
            )));
        }
        writer.pragma_update(None, "synchronous", "FULL")?;
        log::init_schema(&writer)?;
        let events = Arc::new(hub::Hub::new(capacity));
        let cache = Arc::new(cache::PointCache::new());
        let writer = writer::Writer::start(writer, Arc::clone(&events), Arc::clone(&cache))?;
        Ok(SqliteStore {
            inner: Arc::new(Inner {
                path,
                readers: Mutex::new(Vec::new()),
                writer,
                events,
                cache,
                _lock: lock_file,
            }),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Runs `f` inside the next group-commit transaction (in its own savepoint: an error rolls
    /// back only `f`'s changes); answers once that transaction is committed, and the event `f`
    /// returned is published in revision order.
    async fn write<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<(T, WatchEvent), StoreError> + Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job = writer::Job::Write(Box::new(move |conn: &Connection| match f(conn) {
            Ok((out, event)) => writer::Applied {
                event: Some(event),
                answer: Box::new(move |committed: Result<(), &StoreError>| {
                    let _ = tx.send(committed.map(|()| out).map_err(copy_error));
                }),
            },
            Err(e) => writer::Applied {
                event: None,
                answer: Box::new(move |committed: Result<(), &StoreError>| {
                    let _ = tx.send(Err(committed.err().map_or(e, copy_error)));
                }),
            },
        }));
        if !self.inner.writer.send(job) {
            return Err(writer_gone());
        }
        rx.await.map_err(|_| writer_gone())?
    }

    /// Runs `f` on the writer connection alone, between group commits.
    async fn exclusive<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job = writer::Job::Exclusive(Box::new(move |conn: &mut Connection| {
            let _ = tx.send(f(conn));
        }));
        if !self.inner.writer.send(job) {
            return Err(writer_gone());
        }
        rx.await.map_err(|_| writer_gone())?
    }

    /// Runs `f` in one read transaction on a pooled reader connection.
    async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || inner.read_blocking(f))
            .await
            .map_err(join_error)?
    }
}

impl Inner {
    /// Reads `key` (inside a read transaction) and offers it to the point cache with the
    /// revision of the transaction's snapshot.
    fn get_and_fill(&self, conn: &Connection, key: &str) -> Result<Option<KeyValue>, StoreError> {
        let kv = log::get(conn, key)?;
        if let Some(kv) = &kv {
            self.cache.fill(kv, log::current_revision(conn)?);
        }
        Ok(kv)
    }

    fn read_blocking<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let pooled = lock(&self.readers).pop();
        let conn = match pooled {
            Some(conn) => conn,
            None => {
                let conn = Connection::open_with_flags(
                    &self.path,
                    OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
                )?;
                conn.busy_timeout(BUSY_TIMEOUT)?;
                log::configure(&conn)?;
                conn
            }
        };
        self.read_on(conn, f)
    }

    /// Runs `f` in one read transaction on `conn`, then pools `conn` again.
    fn read_on<T>(
        &self,
        conn: Connection,
        f: impl FnOnce(&Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        // BEGIN and COMMIT through the statement cache (a `Transaction` parses them anew
        // each time: a few percent of the server's CPU at 40 requests a second).
        let result = writer::exec_cached(&conn, "BEGIN").and_then(|()| f(&conn));
        // A connection left inside a transaction is never pooled again.
        let ended = if conn.is_autocommit() {
            true
        } else {
            let end = if result.is_ok() { "COMMIT" } else { "ROLLBACK" };
            writer::exec_cached(&conn, end).is_ok() && conn.is_autocommit()
        };
        if ended {
            let mut idle = lock(&self.readers);
            if idle.len() < MAX_IDLE_READERS {
                idle.push(conn);
            }
        }
        result
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        // A point read on a pooled connection (pages cached, WAL readers never wait for the
        // writer) takes microseconds: it runs right here. Handing it to the blocking pool
        // cost two thread wake-ups per read, more than the read (a Lease renewal reads once,
        // a Node GET once: docs/scale.md, eleventh pass). Without an idle connection
        // (opening one does file I/O) it goes to the pool. A hot key is answered from the
        // point cache without a read at all ([`cache`]).
        if let Some(kv) = self.inner.cache.get(key) {
            return Ok(Some(kv));
        }
        let pooled = lock(&self.inner.readers).pop();
        if let Some(conn) = pooled {
            return self
                .inner
                .read_on(conn, |c| self.inner.get_and_fill(c, key));
        }
        let key = key.to_owned();
        let inner = Arc::clone(&self.inner);
        self.read(move |c| inner.get_and_fill(c, &key)).await
    }

    async fn list(&self, prefix: &str, opts: ListOptions) -> Result<ListResult, StoreError> {
        let prefix = prefix.to_owned();
        self.read(move |c| log::list(c, &prefix, &opts)).await
    }

    async fn create(&self, key: &str, value: Vec<u8>) -> Result<KeyValue, StoreError> {
        let key = key.to_owned();
        self.write(move |c| {
            let prev = log::latest(c, &key)?;
            if prev.as_ref().is_some_and(|p| !p.deleted) {
                return Err(StoreError::AlreadyExists(key));
            }
            let prev_revision = prev.map_or(0, |p| p.id);
            let rev = log::append(c, &key, &value, None, prev_revision, false)?;
            let kv = KeyValue {
                key,
                value,
                create_revision: rev,
                mod_revision: rev,
            };
            let event = WatchEvent {
                kind: EventKind::Created,
                revision: rev,
                kv: kv.clone(),
                prev: None,
            };
            Ok((kv, event))
        })
        .await
    }

    async fn update(
        &self,
        key: &str,
        value: Vec<u8>,
        expected: Revision,
    ) -> Result<KeyValue, StoreError> {
        let key = key.to_owned();
        self.write(move |c| {
            let current = match log::latest(c, &key)? {
                Some(row) if !row.deleted => row,
                _ => return Err(StoreError::NotFound(key)),
            };
            if current.id != expected {
                let current = KeyValue {
                    key: key.clone(),
                    value: current.value,
                    create_revision: current.create_revision,
                    mod_revision: current.id,
                };
                return Err(StoreError::Conflict {
                    key,
                    expected,
                    current: Some(Box::new(current)),
                });
            }
            let create_revision = current.create_revision;
            let rev = log::append(c, &key, &value, Some(create_revision), current.id, false)?;
            let prev = KeyValue {
                key: key.clone(),
                value: current.value,
                create_revision,
                mod_revision: current.id,
            };
            let kv = KeyValue {
                key,
                value,
                create_revision,
                mod_revision: rev,
            };
            let event = WatchEvent {
                kind: EventKind::Modified,
                revision: rev,
                kv: kv.clone(),
                prev: Some(prev),
            };
            Ok((kv, event))
        })
        .await
    }

    async fn delete(&self, key: &str, expected: Option<Revision>) -> Result<KeyValue, StoreError> {
        let key = key.to_owned();
        self.write(move |c| {
            let current = match log::latest(c, &key)? {
                Some(row) if !row.deleted => row,
                _ => return Err(StoreError::NotFound(key)),
            };
            let prev = KeyValue {
                key: key.clone(),
                value: current.value,
                create_revision: current.create_revision,
                mod_revision: current.id,
            };
            if let Some(expected) = expected.filter(|e| *e != current.id) {
                return Err(StoreError::Conflict {
                    key,
                    expected,
                    current: Some(Box::new(prev)),
                });
            }
            let rev = log::append(
                c,
                &key,
                &prev.value,
                Some(prev.create_revision),
                prev.mod_revision,
                true,
            )?;
            let kv = KeyValue {
                mod_revision: rev,
                ..prev.clone()
            };
            let event = WatchEvent {
                kind: EventKind::Deleted,
                revision: rev,
                kv: kv.clone(),
                prev: Some(prev),
            };
            Ok((kv, event))
        })
        .await
    }

    async fn watch(&self, prefix: &str, after: Revision) -> Result<WatchStream, StoreError> {
        let after = after.max(0);
        // Subscribe before looking at the log: every event committed from here on is in `rx`,
        // everything before is in the table, and the stream drops the overlap by revision.
        let rx = self.inner.events.subscribe(prefix);
        let compacted = self.compacted_revision().await?;
        if after < compacted {
            return Err(StoreError::Compacted {
                requested: after,
                compacted,
            });
        }
        Ok(watch::stream(self.clone(), rx, prefix.to_owned(), after))
    }

    async fn compact(&self, revision: Revision) -> Result<(), StoreError> {
        // First move the marker, so that no reader relies on rows about to go.
        let start = self
            .exclusive(move |conn| {
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let old = log::set_compact_marker(&tx, revision)?;
                let first = log::first_id(&tx)?;
                tx.commit()?;
                Ok(match (old, first) {
                    (Some(_), Some(first)) => Some(first),
                    _ => None,
                })
            })
            .await?;
        let Some(mut lo) = start else {
            return Ok(());
        };
        // Then delete in chunks, each its own job, so that writes go on in between.
        while lo <= revision {
            let hi = (lo + COMPACT_CHUNK).min(revision + 1);
            self.exclusive(move |conn| {
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                log::compact_range(&tx, revision, lo, hi)?;
                tx.commit()?;
                Ok(())
            })
            .await?;
            lo = hi;
        }
        Ok(())
    }

    async fn current_revision(&self) -> Result<Revision, StoreError> {
        self.read(log::current_revision).await
    }

    async fn compacted_revision(&self) -> Result<Revision, StoreError> {
        self.read(log::compacted_revision).await
    }
}
