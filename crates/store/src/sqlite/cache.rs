//! The point cache of the SQLite backend: the latest committed value of the keys that were
//! read by `get` lately, so that a point read of a hot key (a node's Lease, read before each
//! renewal; a Node) costs a map lookup instead of a read transaction. In WAL mode each read
//! transaction that follows a commit re-reads its pages (the reader's page cache is dropped when
//! the database changed), which made the read before every Lease renewal 5–7 % of the idle
//! server's CPU (docs/scale.md, thirteenth pass).
//!
//! Correctness rests on the writer thread being the only writer:
//! - before it commits a batch, the writer takes the batch's keys out of the cache and closes it
//!   to fills; after the commit it puts the committed values back for the keys that were cached
//!   and reopens fills, but only for reads whose snapshot is at or after the batch's last
//!   revision ([`PointCache::after_commit`]). So a cached value is always the key's latest
//!   committed value, and a read that raced a commit (its snapshot older than the commit) never
//!   fills the cache with what it read.
//! - a miss is read from SQLite in one read transaction together with the snapshot's revision,
//!   and offered to the cache with that revision ([`PointCache::fill`]).
//! - work that bypasses the write path (compaction, tests' raw SQL) empties the cache and
//!   closes fills until it is done ([`PointCache::invalidate`]).
//!
//! A key's value is answered from the cache only while it is there; absent keys are never
//! cached (a `get` of a missing key always reads SQLite). The cache is bounded by entries and
//! bytes: a fill that does not fit is not taken.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::{EventKind, KeyValue, Revision, WatchEvent};

/// Most keys cached.
pub(super) const MAX_ENTRIES: usize = 4096;
/// Most bytes of values cached.
pub(super) const MAX_BYTES: usize = 32 << 20;

/// See the module doc.
#[derive(Debug)]
pub(super) struct PointCache {
    state: Mutex<State>,
    max_entries: usize,
    max_bytes: usize,
    /// Reads answered from the cache.
    pub hits: std::sync::atomic::AtomicU64,
}

#[derive(Debug, Default)]
struct State {
    map: HashMap<String, KeyValue>,
    bytes: usize,
    /// A commit (or exclusive job) is under way: no fills.
    closed: bool,
    /// Fills are taken only from read snapshots at or after this revision.
    fills_from: Revision,
}

impl State {
    fn remove(&mut self, key: &str) -> bool {
        match self.map.remove(key) {
            Some(kv) => {
                self.bytes -= kv.value.len();
                true
            }
            None => false,
        }
    }

    fn insert(&mut self, kv: KeyValue) {
        self.remove(&kv.key);
        self.bytes += kv.value.len();
        self.map.insert(kv.key.clone(), kv);
    }
}

/// Which of a batch's keys were cached when its commit began ([`PointCache::before_commit`]).
#[derive(Debug, Default)]
pub(super) struct Taken {
    cached: Vec<bool>,
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl PointCache {
    pub fn new() -> PointCache {
        PointCache::with_limits(MAX_ENTRIES, MAX_BYTES)
    }

    pub fn with_limits(max_entries: usize, max_bytes: usize) -> PointCache {
        PointCache {
            state: Mutex::new(State::default()),
            max_entries,
            max_bytes,
            hits: Default::default(),
        }
    }

    /// The cached latest value of `key`, if it is cached.
    pub fn get(&self, key: &str) -> Option<KeyValue> {
        let kv = lock(&self.state).map.get(key).cloned();
        if kv.is_some() {
            self.hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        kv
    }

    /// Offers `kv`, read in a read transaction whose snapshot's revision was `snapshot`.
    /// Taken only when no commit is under way, none has committed after the snapshot, and it
    /// fits.
    pub fn fill(&self, kv: &KeyValue, snapshot: Revision) {
        let mut s = lock(&self.state);
        if s.closed || snapshot < s.fills_from || s.map.contains_key(&kv.key) {
            return;
        }
        if s.map.len() >= self.max_entries || s.bytes + kv.value.len() > self.max_bytes {
            return;
        }
        s.insert(kv.clone());
    }

    /// Before a batch's COMMIT: takes the keys of `events` out of the cache and closes it to
    /// fills; says which were cached.
    pub fn before_commit<'a>(&self, events: impl Iterator<Item = &'a WatchEvent>) -> Taken {
        let mut s = lock(&self.state);
        s.closed = true;
        let mut taken = std::collections::HashSet::new();
        let cached = events
            .map(|ev| {
                // A key written twice in the batch: the second write inherits the first's.
                let key = ev.kv.key.as_str();
                if s.remove(key) {
                    taken.insert(key);
                }
                taken.contains(key)
            })
            .collect();
        Taken { cached }
    }

    /// After the COMMIT of the batch whose events `before_commit` was given: when it
    /// `committed`, puts the new values of the keys that were cached back (a deleted key stays
    /// out); reopens fills from the batch's last revision `last` on.
    pub fn after_commit<'a>(
        &self,
        events: impl Iterator<Item = &'a WatchEvent>,
        taken: Taken,
        committed: bool,
        last: Revision,
    ) {
        let mut s = lock(&self.state);
        if committed {
            for (ev, cached) in events.zip(taken.cached) {
                // Later events of the same key come later: the last one stays.
                if cached && ev.kind != EventKind::Deleted {
                    s.insert(ev.kv.clone());
                } else {
                    s.remove(&ev.kv.key);
                }
            }
        }
        s.fills_from = s.fills_from.max(last);
        s.closed = false;
    }

    /// Around work that changes the database outside the write path: empties the cache and
    /// closes fills (`done` false), then reopens them from revision `from` on (`done` true).
    pub fn invalidate(&self, done: Option<Revision>) {
        let mut s = lock(&self.state);
        s.map.clear();
        s.bytes = 0;
        match done {
            None => s.closed = true,
            Some(from) => {
                s.fills_from = s.fills_from.max(from);
                s.closed = false;
            }
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        lock(&self.state).map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: &str, value: &str, rev: Revision) -> KeyValue {
        KeyValue {
            key: key.into(),
            value: value.as_bytes().to_vec(),
            create_revision: 1,
            mod_revision: rev,
        }
    }

    fn modified(key: &str, value: &str, rev: Revision) -> WatchEvent {
        WatchEvent {
            kind: EventKind::Modified,
            revision: rev,
            kv: kv(key, value, rev),
            prev: None,
        }
    }

    #[test]
    fn a_fill_older_than_the_last_commit_is_not_taken() {
        let c = PointCache::new();
        let evs = [modified("/b", "x", 5)];
        let t = c.before_commit(evs.iter());
        c.after_commit(evs.iter(), t, true, 5);
        // Read at snapshot 4 (before the commit of 5): it may be stale, not taken.
        c.fill(&kv("/a", "old", 3), 4);
        assert!(c.get("/a").is_none());
        c.fill(&kv("/a", "new", 3), 5);
        assert_eq!(c.get("/a").unwrap().value, b"new");
    }

    #[test]
    fn no_fill_while_a_commit_is_under_way() {
        let c = PointCache::new();
        let evs = [modified("/a", "x", 7)];
        let t = c.before_commit(evs.iter());
        c.fill(&kv("/a", "y", 6), 6);
        assert!(c.get("/a").is_none());
        c.after_commit(evs.iter(), t, true, 7);
        // "/a" was not cached when the commit began: it stays out until read again.
        assert!(c.get("/a").is_none());
    }

    #[test]
    fn a_commit_replaces_a_cached_value_and_a_delete_removes_it() {
        let c = PointCache::new();
        c.fill(&kv("/a", "1", 2), 2);
        let evs = [modified("/a", "2", 3), modified("/a", "3", 4)];
        let t = c.before_commit(evs.iter());
        assert!(c.get("/a").is_none(), "out of the cache while committing");
        c.after_commit(evs.iter(), t, true, 4);
        let got = c.get("/a").unwrap();
        assert_eq!((got.value.as_slice(), got.mod_revision), (&b"3"[..], 4));
        let mut del = modified("/a", "3", 5);
        del.kind = EventKind::Deleted;
        let t = c.before_commit(std::iter::once(&del));
        c.after_commit(std::iter::once(&del), t, true, 5);
        assert!(c.get("/a").is_none());
    }

    #[test]
    fn a_failed_commit_leaves_its_keys_out() {
        let c = PointCache::new();
        c.fill(&kv("/a", "1", 2), 2);
        let evs = [modified("/a", "2", 3)];
        let t = c.before_commit(evs.iter());
        c.after_commit(evs.iter(), t, false, 3);
        assert!(c.get("/a").is_none());
        c.fill(&kv("/a", "1", 2), 3);
        assert_eq!(c.get("/a").unwrap().value, b"1");
    }

    #[test]
    fn fills_stop_at_the_limits() {
        let c = PointCache::with_limits(2, 10);
        c.fill(&kv("/a", "1234", 1), 1);
        c.fill(&kv("/b", "1234", 1), 1);
        c.fill(&kv("/c", "1", 1), 1);
        assert_eq!(c.len(), 2);
        let c = PointCache::with_limits(10, 6);
        c.fill(&kv("/a", "1234", 1), 1);
        c.fill(&kv("/b", "1234", 1), 1);
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn invalidation_empties_and_closes_until_done() {
        let c = PointCache::new();
        c.fill(&kv("/a", "1", 2), 2);
        c.invalidate(None);
        assert!(c.get("/a").is_none());
        c.fill(&kv("/a", "1", 2), 9);
        assert!(c.get("/a").is_none());
        c.invalidate(Some(9));
        c.fill(&kv("/a", "1", 2), 8);
        assert!(c.get("/a").is_none());
        c.fill(&kv("/a", "1", 2), 9);
        assert!(c.get("/a").is_some());
    }
}
