//! Group commit for the SQLite backend: the one thread that owns the writer connection.
//!
//! Every write is queued to this thread. The thread takes everything queued at once (up to
//! [`MAX_BATCH`] writes) and applies it in ONE transaction with ONE fsync: each write runs in
//! its own `SAVEPOINT`, so a write that fails (a precondition conflict, a missing key, an SQL
//! error) is rolled back alone and the others in the batch still commit. After the commit has
//! reached the disk (`synchronous=FULL`) the thread publishes the batch's watch events in
//! revision order and only then answers each caller; if the commit fails, every write of the
//! batch is answered with that error. So the durability contract is the same as one transaction
//! per write (a write acknowledged is on disk) while a burst of N concurrent writes costs one
//! fsync instead of N. Batching needs no timer: while one batch is being synced, the next
//! writes queue up behind it and form the next batch.
//!
//! Revisions stay strictly increasing: the writes of a batch append in queue order inside one
//! transaction, and a rolled-back savepoint also rolls back its bump of the revision counter.
//!
//! Work that needs the connection to itself (compaction, tests) is queued as an
//! [`Job::Exclusive`]: it ends the batch being gathered and runs alone, between batches.
//!
//! The writer keeps the point cache ([`super::cache`]) true: it takes a batch's keys out before
//! the COMMIT and puts the committed values back after it, before the events are published and
//! the callers answered; an exclusive job empties it.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use super::cache::PointCache;
use super::hub::Hub;
use crate::{StoreError, WatchEvent};
use rusqlite::Connection;

/// Most writes applied in one transaction.
pub(super) const MAX_BATCH: usize = 256;

/// Answers a write's caller, given its batch's commit outcome.
pub(super) type Answer = Box<dyn FnOnce(Result<(), &StoreError>) + Send>;
/// A queued write: runs inside its savepoint and says what it did.
pub(super) type WriteFn = Box<dyn FnOnce(&Connection) -> Applied + Send>;

/// What a write tells the writer once it ran inside its savepoint: the event to publish (`None`
/// when the write failed and was rolled back) and how to answer its caller once the batch's
/// fate is known (`Ok` = committed and durable).
pub(super) struct Applied {
    pub event: Option<WatchEvent>,
    pub answer: Answer,
}

/// One queued unit of work.
pub(super) enum Job {
    /// A write, run inside its own savepoint within the batch transaction.
    Write(WriteFn),
    /// Runs alone with the connection (it manages its own transactions).
    Exclusive(Box<dyn FnOnce(&mut Connection) + Send>),
}

/// Counters of the writer thread.
#[derive(Debug, Default)]
pub(super) struct Stats {
    /// Jobs queued so far.
    pub queued: AtomicU64,
    /// Batch transactions committed.
    pub batches: AtomicU64,
    /// Writes answered after a committed batch (successful or not).
    pub writes: AtomicU64,
}

/// The writer thread and the queue into it.
pub(super) struct Writer {
    queue: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    pub stats: Arc<Stats>,
}

impl Writer {
    /// Starts the thread that owns `conn` and publishes committed events on `events`.
    pub fn start(
        conn: Connection,
        events: Arc<Hub>,
        cache: Arc<PointCache>,
    ) -> Result<Writer, StoreError> {
        let (queue, rx) = mpsc::channel();
        let stats = Arc::new(Stats::default());
        let thread_stats = Arc::clone(&stats);
        let thread = std::thread::Builder::new()
            .name("sqlite-writer".into())
            .spawn(move || run(conn, rx, &events, &cache, &thread_stats))
            .map_err(|e| StoreError::Backend(format!("sqlite: starting the writer thread: {e}")))?;
        Ok(Writer {
            queue: Some(queue),
            thread: Some(thread),
            stats,
        })
    }

    /// Queues `job`; false when the writer thread is gone.
    pub fn send(&self, job: Job) -> bool {
        let sent = self.queue.as_ref().is_some_and(|q| q.send(job).is_ok());
        if sent {
            self.stats.queued.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }
}

impl Drop for Writer {
    /// Closes the queue and waits for the thread to finish what was queued and close the
    /// connection, so that the database is closed when the store is.
    fn drop(&mut self) {
        self.queue.take();
        if let Some(thread) = self.thread.take()
            && thread.thread().id() != std::thread::current().id()
        {
            let _ = thread.join();
        }
    }
}

fn run(
    mut conn: Connection,
    rx: mpsc::Receiver<Job>,
    events: &Hub,
    cache: &PointCache,
    stats: &Stats,
) {
    let mut next: Option<Job> = None;
    loop {
        let first = match next.take() {
            Some(job) => job,
            None => match rx.recv() {
                Ok(job) => job,
                Err(mpsc::RecvError) => return,
            },
        };
        let first = match first {
            Job::Exclusive(f) => {
                cache.invalidate(None);
                // A panic only loses this job; the thread keeps serving the others.
                let _ = catch_unwind(AssertUnwindSafe(|| f(&mut conn)));
                // Fills stay closed when the revision cannot be read.
                if let Ok(rev) = super::log::current_revision(&conn) {
                    cache.invalidate(Some(rev));
                }
                continue;
            }
            Job::Write(w) => w,
        };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(Job::Write(w)) => batch.push(w),
                Ok(exclusive) => {
                    next = Some(exclusive);
                    break;
                }
                Err(_) => break,
            }
        }
        commit_batch(&conn, batch, events, cache, stats);
    }
}

/// Runs one parameterless statement through the connection's statement cache (parsed once,
/// not per write: `execute_batch` parses every time).
pub(super) fn exec_cached(conn: &Connection, sql: &str) -> Result<(), StoreError> {
    conn.prepare_cached(sql)?.execute([])?;
    Ok(())
}

/// Applies `batch` in one transaction, one savepoint per write; publishes the events and
/// answers every caller after the commit.
fn commit_batch(
    conn: &Connection,
    batch: Vec<WriteFn>,
    events: &Hub,
    cache: &PointCache,
    stats: &Stats,
) {
    let mut applied: Vec<Applied> = Vec::with_capacity(batch.len());
    let mut taken = None;
    let outcome = (|| -> Result<(), StoreError> {
        exec_cached(conn, "BEGIN IMMEDIATE")?;
        let mut batch = batch.into_iter();
        for write in batch.by_ref() {
            exec_cached(conn, "SAVEPOINT w")?;
            match catch_unwind(AssertUnwindSafe(|| write(conn))) {
                Ok(a) => {
                    if a.event.is_some() {
                        exec_cached(conn, "RELEASE w")?;
                    } else {
                        conn.execute_batch("ROLLBACK TO w; RELEASE w")?;
                    }
                    applied.push(a);
                }
                // The caller's answer went with the panic (its receiver sees the sender drop).
                Err(_) => conn.execute_batch("ROLLBACK TO w; RELEASE w")?,
            }
            if conn.is_autocommit() {
                // SQLite rolled the whole transaction back on its own (e.g. disk full).
                return Err(StoreError::Backend(
                    "sqlite: the batch transaction was rolled back".into(),
                ));
            }
        }
        taken = Some(cache.before_commit(applied.iter().filter_map(|a| a.event.as_ref())));
        exec_cached(conn, "COMMIT")?;
        Ok(())
    })();
    if let Some(taken) = taken {
        let written = || applied.iter().filter_map(|a| a.event.as_ref());
        let last = written().map(|ev| ev.revision).max().unwrap_or(0);
        cache.after_commit(written(), taken, outcome.is_ok(), last);
    }
    match outcome {
        Ok(()) => {
            let answers: Vec<_> = applied
                .into_iter()
                .map(|a| {
                    if let Some(event) = a.event {
                        events.publish(event);
                    }
                    a.answer
                })
                .collect();
            stats.batches.fetch_add(1, Ordering::Relaxed);
            stats
                .writes
                .fetch_add(answers.len() as u64, Ordering::Relaxed);
            for answer in answers {
                answer(Ok(()));
            }
        }
        Err(e) => {
            if !conn.is_autocommit() {
                let _ = conn.execute_batch("ROLLBACK");
            }
            tracing::warn!(error = %e, writes = applied.len(), "sqlite: batch commit failed");
            // Writes not yet applied when the batch failed are dropped with `batch`: their
            // callers see the writer hang up, which reads as a backend error.
            for a in applied {
                (a.answer)(Err(&e));
            }
        }
    }
}
