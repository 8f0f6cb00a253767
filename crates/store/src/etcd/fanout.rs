//! One etcd watch per watched prefix, shared by every watcher of that prefix in this process.
//!
//! Without it each watch of the store was its own etcd watch: etcd encoded and sent every event
//! once per watcher, and the server decoded it once per watcher. With 100 node agents watching
//! VMIs, a VMI write cost etcd 100 sends, and etcd's CPU bounded the whole control plane
//! (docs/scale.md, sixteenth pass). Now a hub holds the one etcd watch of a prefix (opened for
//! its first watcher, from that watcher's revision) and the last [`FanoutOptions::ring`]
//! events; each watcher reads the ring from its own position and is woken on every new event.
//!
//! Exactly-once and in order, as [`crate::Store::watch`] promises, in every case:
//! - a watcher joins a hub only when the ring holds every event after its revision (or the hub
//!   has not reached it yet: it then skips what it already has);
//! - a watcher that starts before the oldest event the hub still holds, or falls a whole ring
//!   behind, or whose hub's etcd watch failed, goes on with an etcd watch of its own from the
//!   last revision it yielded, so a compaction in between is reported as it would have been;
//! - a hub no one watches closes its etcd watch within [`FanoutOptions::idle_check`].
//!
//! Relies on one event per revision: every write of [`super::EtcdStore`] is one key.
//! Written here rather than taken from a crate: what is needed is a broadcast that replays from
//! a revision and hands a lagging reader over to a store watch, which is the store's own
//! semantics (tokio's broadcast neither replays nor tells a reader where it stopped).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;

use super::EtcdStore;
use crate::{Revision, StoreError, WatchEvent, WatchStream};

/// How the shared watches behave.
#[derive(Debug, Clone)]
pub struct FanoutOptions {
    /// Events a hub keeps: how far in the past a watcher may start, and how far behind it may
    /// fall, and still be served by the hub.
    pub ring: usize,
    /// How often a hub looks whether anyone still watches.
    pub idle_check: Duration,
}

impl Default for FanoutOptions {
    fn default() -> Self {
        Self {
            ring: 4096,
            idle_check: Duration::from_secs(30),
        }
    }
}

/// The hubs of one store (shared by its clones).
pub(super) struct Fanout {
    hubs: Mutex<HashMap<String, Arc<Hub>>>,
    options: FanoutOptions,
    /// etcd watches this process opened (hubs' and watchers' own).
    opened: AtomicU64,
}

struct Hub {
    ring: Mutex<Ring>,
    /// Bumped after every event (and dropped when the hub closes); watchers wait on it.
    wake: watch::Receiver<u64>,
}

struct Ring {
    /// The sequence number of `events[0]`, counted from the hub's first event.
    base: u64,
    events: VecDeque<Arc<WatchEvent>>,
    /// Every event with a revision above `floor` is in `events`.
    floor: Revision,
    /// False once the hub stopped: no one joins it, its watchers go on with their own watches.
    open: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks leaves no half-made change behind (every change is one
    // push or one flag), so a poisoned lock is still good to use.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Fanout {
    pub(super) fn new(options: FanoutOptions) -> Self {
        Self {
            hubs: Mutex::new(HashMap::new()),
            options,
            opened: AtomicU64::new(0),
        }
    }

    pub(super) fn count_opened(&self) {
        self.opened.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }

    pub(super) fn hubs(&self) -> usize {
        lock(&self.hubs).len()
    }

    /// A place in the open hub of `prefix` right after `after`, when the hub holds every
    /// event after it.
    fn join(&self, prefix: &str, after: Revision) -> Option<Cursor> {
        let hubs = lock(&self.hubs);
        let hub = hubs.get(prefix)?;
        let ring = lock(&hub.ring);
        if !ring.open || after < ring.floor {
            return None;
        }
        let skip = ring.events.partition_point(|e| e.revision <= after);
        Some(Cursor {
            hub: Arc::clone(hub),
            next: ring.base + skip as u64,
            wake: hub.wake.clone(),
        })
    }

    /// Makes `source` (an etcd watch of `prefix` after `after`) the hub of `prefix` and joins
    /// it; gives `source` back when another watcher made a hub first.
    fn start(
        self: &Arc<Self>,
        prefix: &str,
        after: Revision,
        source: WatchStream,
    ) -> Result<Cursor, WatchStream> {
        let mut hubs = lock(&self.hubs);
        if hubs.contains_key(prefix) {
            return Err(source);
        }
        let (tx, wake) = watch::channel(0);
        let hub = Arc::new(Hub {
            ring: Mutex::new(Ring {
                base: 0,
                events: VecDeque::new(),
                floor: after,
                open: true,
            }),
            wake: wake.clone(),
        });
        hubs.insert(prefix.to_owned(), Arc::clone(&hub));
        tokio::spawn(Arc::clone(self).run(prefix.to_owned(), Arc::clone(&hub), source, tx));
        Ok(Cursor { hub, next: 0, wake })
    }

    /// A hub's task: moves its etcd watch's events into the ring until the watch fails or no
    /// one watches any more.
    async fn run(
        self: Arc<Self>,
        prefix: String,
        hub: Arc<Hub>,
        mut source: WatchStream,
        tx: watch::Sender<u64>,
    ) {
        let mut idle = tokio::time::interval(self.options.idle_check);
        idle.tick().await;
        loop {
            tokio::select! {
                ev = source.next() => match ev {
                    Some(Ok(ev)) => {
                        let seq = {
                            let mut ring = lock(&hub.ring);
                            ring.events.push_back(Arc::new(ev));
                            while ring.events.len() > self.options.ring.max(1) {
                                if let Some(old) = ring.events.pop_front() {
                                    ring.floor = old.revision;
                                    ring.base += 1;
                                }
                            }
                            ring.base + ring.events.len() as u64
                        };
                        tx.send_replace(seq);
                    }
                    Some(Err(e)) => {
                        tracing::info!(prefix, "shared etcd watch ended ({e}); its watchers go on alone");
                        break;
                    }
                    None => break,
                },
                _ = idle.tick() => {
                    if self.close(&prefix, &hub, true) {
                        return;
                    }
                }
            }
        }
        self.close(&prefix, &hub, false);
        // Dropping `tx` wakes every watcher; each finds the hub closed.
    }

    /// Closes `hub` (only when no one but the map and its task holds it, if `only_unwatched`);
    /// whether it did.
    fn close(&self, prefix: &str, hub: &Arc<Hub>, only_unwatched: bool) -> bool {
        let mut hubs = lock(&self.hubs);
        // Watchers join under the map's lock, so the count cannot grow meanwhile.
        if only_unwatched && Arc::strong_count(hub) > 2 {
            return false;
        }
        if hubs.get(prefix).is_some_and(|h| Arc::ptr_eq(h, hub)) {
            hubs.remove(prefix);
        }
        lock(&hub.ring).open = false;
        true
    }
}

/// A watcher's place in a hub.
struct Cursor {
    hub: Arc<Hub>,
    /// The sequence number of the next event to read.
    next: u64,
    wake: watch::Receiver<u64>,
}

enum Step {
    Event(Arc<WatchEvent>),
    Wait,
    /// Lagged a whole ring behind, or the hub closed: go on with an own watch.
    Alone,
}

impl Cursor {
    fn step(&mut self) -> Step {
        self.wake.borrow_and_update();
        let ring = lock(&self.hub.ring);
        if self.next < ring.base {
            return Step::Alone;
        }
        match ring.events.get((self.next - ring.base) as usize) {
            Some(ev) => {
                self.next += 1;
                Step::Event(Arc::clone(ev))
            }
            None if ring.open => Step::Wait,
            None => Step::Alone,
        }
    }
}

enum Source {
    Hub(Cursor),
    Own(WatchStream),
    Done,
}

/// One watcher: reads its hub, or its own etcd watch once the hub cannot serve it.
struct Watcher {
    store: EtcdStore,
    prefix: String,
    /// The revision of the last event yielded (or the watch's start).
    last: Revision,
    source: Source,
}

impl Watcher {
    async fn next(&mut self) -> Option<Result<WatchEvent, StoreError>> {
        loop {
            let cursor = match &mut self.source {
                Source::Own(s) => return s.next().await,
                Source::Done => return None,
                Source::Hub(c) => c,
            };
            match cursor.step() {
                Step::Event(ev) if ev.revision > self.last => {
                    self.last = ev.revision;
                    return Some(Ok(WatchEvent::clone(&ev)));
                }
                Step::Event(_) => {}
                Step::Wait => {
                    // An error only says the hub's task ended; the next step sees it closed.
                    let _ = cursor.wake.changed().await;
                }
                Step::Alone => {
                    self.source = match self.store.watch_own(&self.prefix, self.last).await {
                        Ok(s) => Source::Own(s),
                        Err(e) => {
                            self.source = Source::Done;
                            return Some(Err(e));
                        }
                    };
                }
            }
        }
    }
}

/// A watch of `prefix` after `after` (already checked against the compacted revision): from
/// the prefix's hub when it can serve it, else as the new hub of `prefix`, else alone.
pub(super) async fn watch(
    store: &EtcdStore,
    prefix: &str,
    after: Revision,
) -> Result<WatchStream, StoreError> {
    let fanout = Arc::clone(&store.fanout);
    let cursor = match fanout.join(prefix, after) {
        Some(c) => c,
        None => {
            let source = store.open_watch(prefix, after).await?;
            match fanout.start(prefix, after, source) {
                Ok(c) => c,
                Err(own) => return Ok(own),
            }
        }
    };
    let watcher = Watcher {
        store: store.clone(),
        prefix: prefix.to_owned(),
        last: after,
        source: Source::Hub(cursor),
    };
    Ok(futures::stream::unfold(watcher, |mut w| async move {
        let item = w.next().await?;
        Some((item, w))
    })
    .boxed())
}
