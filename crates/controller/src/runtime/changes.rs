//! Change announcements of the shared caches ([`super::stores`]): which kinds changed since a
//! subscriber last looked, as a set of kinds per subscriber, and a wake-up only for the
//! subscribers waiting for the kind that changed.
//!
//! A broadcast channel of kinds woke every subscriber on every change, a dozen controller loops
//! on each of the fifty Lease renewals a second of a hundred idle nodes, when only the node
//! lifecycle waits for Leases. Here a subscriber says what it waits for when it waits; an
//! announcement marks the kind pending at every subscriber and wakes those waiting for it.
//! Changes coalesce (the caches already hold the newest state when a change is announced, so a
//! loop woken once reads everything that happened), and nothing is ever lost to a full queue.
//! Hand-written: tokio's `broadcast` and `watch` channels wake every receiver, and no
//! maintained crate offers wake-ups filtered by a receiver's interest.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::Notify;

use super::stores::Kind;

/// The kinds a batch of changes touched ([`Changes::next_batch`]), or every kind
/// ([`Changed::everything`]: a resync, where a change of any kind may have been missed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Changed {
    seen: u8,
    all: bool,
}

impl Changed {
    /// A batch that counts as a change of every kind (a resync, a missed change).
    pub fn everything() -> Changed {
        Changed { seen: 0, all: true }
    }

    fn bit(kind: Kind) -> u8 {
        1 << (kind as u8)
    }

    fn mask(kinds: &[Kind]) -> u8 {
        kinds.iter().fold(0, |m, k| m | Self::bit(*k))
    }

    /// Whether objects of `kind` may have changed in this batch.
    pub fn contains(&self, kind: Kind) -> bool {
        self.all || self.seen & Self::bit(kind) != 0
    }

    /// A batch that touched `kinds`.
    pub fn of(kinds: &[Kind]) -> Changed {
        Changed {
            seen: Self::mask(kinds),
            all: false,
        }
    }

    /// Whether the batch touched nothing.
    pub fn is_empty(&self) -> bool {
        !self.all && self.seen == 0
    }

    /// Both batches together.
    pub fn merge(&mut self, other: Changed) {
        self.seen |= other.seen;
        self.all |= other.all;
    }
}

/// One subscriber's state: the kinds changed since it last took them, and those it waits for.
#[derive(Default)]
struct Sub {
    pending: AtomicU8,
    interest: AtomicU8,
    notify: Notify,
}

/// The subscribers, and whether every sender is gone.
#[derive(Default)]
struct Hub {
    subs: Mutex<Vec<Weak<Sub>>>,
    senders: AtomicUsize,
    closed: AtomicBool,
}

impl Hub {
    fn subs(&self) -> std::sync::MutexGuard<'_, Vec<Weak<Sub>>> {
        self.subs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The sending side (cheap to clone): [`Announcer::send`] announces a change. Once every clone
/// is dropped, the subscriptions end ([`Changes::wait_for`] and the others say `None`).
pub struct Announcer(Arc<Hub>);

impl Announcer {
    /// A new hub with no subscribers.
    pub fn new() -> Announcer {
        let hub = Hub {
            senders: AtomicUsize::new(1),
            ..Hub::default()
        };
        Announcer(Arc::new(hub))
    }

    /// Announces that an object of `kind` was added, changed or deleted (the cache holds it
    /// already): marks it at every subscriber, wakes those waiting for it.
    pub fn send(&self, kind: Kind) {
        let bit = Changed::bit(kind);
        self.0.subs().retain(|w| {
            let Some(s) = w.upgrade() else { return false };
            s.pending.fetch_or(bit, Ordering::SeqCst);
            if s.interest.load(Ordering::SeqCst) & bit != 0 {
                s.notify.notify_one();
            }
            true
        });
    }

    /// A subscription to the changes announced from now on.
    pub fn subscribe(&self) -> Changes {
        let sub = Arc::new(Sub::default());
        self.0.subs().push(Arc::downgrade(&sub));
        Changes {
            sub,
            hub: self.0.clone(),
        }
    }
}

impl Default for Announcer {
    fn default() -> Self {
        Announcer::new()
    }
}

impl Clone for Announcer {
    fn clone(&self) -> Self {
        self.0.senders.fetch_add(1, Ordering::SeqCst);
        Announcer(self.0.clone())
    }
}

impl Drop for Announcer {
    fn drop(&mut self) {
        if self.0.senders.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.closed.store(true, Ordering::SeqCst);
            for s in self.0.subs().iter().filter_map(Weak::upgrade) {
                s.notify.notify_one();
            }
        }
    }
}

/// A subscription to cache changes ([`Announcer::subscribe`]). Cancel-safe: a wait dropped
/// midway loses nothing, the changes stay pending.
pub struct Changes {
    sub: Arc<Sub>,
    hub: Arc<Hub>,
}

impl Changes {
    fn closed(&self) -> bool {
        self.hub.closed.load(Ordering::SeqCst)
    }

    /// Waits until one of the kinds in `mask` is pending, then takes every pending change and
    /// returns those in `mask`; `None` once the senders are gone and nothing is pending.
    async fn wait_mask(&mut self, mask: u8) -> Option<u8> {
        // Interest first, then a look: a change announced in between is either seen here or
        // wakes the notify (which keeps a permit when nobody waits yet).
        self.sub.interest.store(mask, Ordering::SeqCst);
        loop {
            if self.sub.pending.load(Ordering::SeqCst) & mask != 0 {
                return Some(self.sub.pending.swap(0, Ordering::SeqCst) & mask);
            }
            if self.closed() {
                return None;
            }
            self.sub.notify.notified().await;
        }
    }

    /// Waits until an object of one of `kinds` was added, changed or deleted since the last
    /// wait or take, then takes every pending change and says which kind ended the wait (the
    /// first of `kinds` that changed, in the order given). `None` once the caches are gone.
    pub async fn wait_for(&mut self, kinds: &[Kind]) -> Option<Kind> {
        let got = self.wait_mask(Changed::mask(kinds)).await?;
        kinds.iter().copied().find(|k| got & Changed::bit(*k) != 0)
    }

    /// Waits until an object of one of `kinds` changed, then takes every pending change (one
    /// pass covers them all) and says which of `kinds` the batch touched. `None` once the
    /// caches are gone.
    pub async fn next_batch(&mut self, kinds: &[Kind]) -> Option<Changed> {
        let seen = self.wait_mask(Changed::mask(kinds)).await?;
        Some(Changed { seen, all: false })
    }

    /// Takes every pending change without waiting and says which of `kinds` changed (empty
    /// when none); `None` once the caches are gone and nothing was pending.
    pub fn take_queued(&mut self, kinds: &[Kind]) -> Option<Changed> {
        let seen = self.sub.pending.swap(0, Ordering::SeqCst) & Changed::mask(kinds);
        if seen == 0 && self.closed() {
            return None;
        }
        Some(Changed { seen, all: false })
    }

    /// Takes every pending change without waiting; false once the caches are gone.
    pub fn drain(&mut self) -> bool {
        self.sub.pending.swap(0, Ordering::SeqCst);
        !self.closed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn still_waiting<T>(f: impl std::future::Future<Output = T>) -> bool {
        tokio::time::timeout(Duration::from_millis(20), f)
            .await
            .is_err()
    }

    #[tokio::test]
    async fn changes_wait_for_the_kinds_asked_and_close() {
        let tx = Announcer::new();
        let mut changes = tx.subscribe();
        tx.send(Kind::Vmi);
        tx.send(Kind::Lease);
        assert_eq!(
            changes.wait_for(&[Kind::Node, Kind::Lease]).await,
            Some(Kind::Lease)
        );
        // Taken with the Lease: the VMI change is not pending any more.
        assert!(still_waiting(changes.wait_for(&[Kind::Vmi])).await);
        // Several kinds pending: the first of those asked for, in the order given.
        tx.send(Kind::PersistentVolume);
        tx.send(Kind::StorageClass);
        assert_eq!(
            changes
                .wait_for(&[Kind::StorageClass, Kind::PersistentVolume])
                .await,
            Some(Kind::StorageClass)
        );
        // Drain takes whatever is pending without waiting.
        tx.send(Kind::Vmi);
        tx.send(Kind::Node);
        assert!(changes.drain());
        assert!(
            still_waiting(changes.wait_for(&[Kind::Vmi, Kind::Node])).await,
            "nothing left after drain"
        );
        // A clone keeps the subscription open; the last sender gone ends it.
        let tx2 = tx.clone();
        drop(tx);
        assert!(changes.drain());
        drop(tx2);
        assert!(!changes.drain());
        assert_eq!(changes.wait_for(&[Kind::Node]).await, None);
    }

    #[tokio::test]
    async fn a_waiter_is_woken_by_its_kinds_only() {
        let tx = Announcer::new();
        let mut changes = tx.subscribe();
        let waiter = tokio::spawn(async move {
            let got = changes.wait_for(&[Kind::Node]).await;
            (got, changes)
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        for _ in 0..100 {
            tx.send(Kind::Lease);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "Leases do not end a wait for Nodes");
        tx.send(Kind::Node);
        let (got, mut changes) = waiter.await.unwrap();
        assert_eq!(got, Some(Kind::Node));
        // A dropped wait loses nothing: the change stays pending for the next one.
        assert!(still_waiting(changes.wait_for(&[Kind::Vmi])).await);
        tx.send(Kind::Vmi);
        assert!(still_waiting(changes.wait_for(&[Kind::Node])).await);
        assert_eq!(changes.wait_for(&[Kind::Vmi]).await, Some(Kind::Vmi));
        // A subscriber dropped is forgotten by the next announcement.
        drop(changes);
        tx.send(Kind::Vmi);
        assert!(tx.0.subs().is_empty());
    }

    #[tokio::test]
    async fn queued_changes_are_taken_without_waiting() {
        let tx = Announcer::new();
        let mut changes = tx.subscribe();
        // Nothing pending: an empty batch at once.
        assert!(changes.take_queued(&[Kind::Node]).unwrap().is_empty());
        tx.send(Kind::Lease);
        tx.send(Kind::Node);
        let c = changes.take_queued(&[Kind::Node, Kind::Vmi]).unwrap();
        assert!(c.contains(Kind::Node) && !c.contains(Kind::Lease) && !c.contains(Kind::Vmi));
        // Taken: not seen again.
        assert!(changes.take_queued(&[Kind::Node]).unwrap().is_empty());
        // Merged batches; everything.
        let mut m = Changed::of(&[Kind::Vmi]);
        m.merge(c);
        assert!(m.contains(Kind::Vmi) && m.contains(Kind::Node) && !m.is_empty());
        assert!(Changed::everything().contains(Kind::StorageClass));
        // However many changes, nothing is lost to a full queue.
        for _ in 0..10_000 {
            tx.send(Kind::Lease);
        }
        tx.send(Kind::Node);
        assert!(
            changes
                .take_queued(&[Kind::Node])
                .unwrap()
                .contains(Kind::Node)
        );
        tx.send(Kind::Node);
        drop(tx);
        // What was pending is still taken; then the end.
        assert!(!changes.take_queued(&[Kind::Node]).unwrap().is_empty());
        assert!(changes.take_queued(&[Kind::Node]).is_none());
    }

    #[tokio::test]
    async fn a_batch_says_which_of_the_kinds_asked_it_touched() {
        let tx = Announcer::new();
        let mut changes = tx.subscribe();
        // A Lease alone does not end the wait for Nodes; the Node does; the batch names the
        // kinds asked for only.
        tx.send(Kind::Lease);
        assert!(still_waiting(changes.next_batch(&[Kind::Node])).await);
        tx.send(Kind::Node);
        tx.send(Kind::Vmi);
        let c = changes.next_batch(&[Kind::Node, Kind::Vmi]).await.unwrap();
        assert!(c.contains(Kind::Node) && c.contains(Kind::Vmi));
        assert!(!c.contains(Kind::Lease) && !c.contains(Kind::PersistentVolume));
        // Nothing pending: the next batch waits.
        assert!(still_waiting(changes.next_batch(&[Kind::Node, Kind::Vmi])).await);
        // Node changes only: no VMI in the batch.
        tx.send(Kind::Node);
        let c = changes.next_batch(&[Kind::Node, Kind::Vmi]).await.unwrap();
        assert!(c.contains(Kind::Node) && !c.contains(Kind::Vmi));
        drop(tx);
        assert_eq!(changes.next_batch(&[Kind::Node]).await, None);
    }
}
