//! The one loop behind every in-memory view the server keeps of part of its store for
//! authentication and its bookkeeping (the RBAC policy, node certificate records, live
//! ServiceAccounts, forgetting deleted Nodes, default ServiceAccounts): start (typically list
//! and load), watch the prefix from the revision the start returns, hand each batch of events
//! that arrived together to the caller, list and watch again when the watch ends or fails,
//! retry a failed start after a second, and stop on shutdown. A batch holds every event that
//! was ready when the first arrived, so a view that rebuilds something costly (the RBAC
//! policy) rebuilds once per burst.

use std::time::Duration;

use ferrovirt_store::{Revision, Store, StoreError, WatchEvent, WatchStream};
use futures::{FutureExt, StreamExt};

/// How long a failed start waits before the next.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// What [`follow`] watches.
#[derive(Clone, Copy)]
pub struct Watched<'a> {
    pub store: &'a dyn Store,
    /// The key prefix watched.
    pub prefix: &'a str,
    /// Names the view in log lines.
    pub what: &'a str,
}

/// Runs `start` (it returns the revision to watch from), then gives `apply` the watch's
/// events in batches, until `shutdown` changes; see the module doc.
///
/// (Plain closures returning futures rather than async closures: the future of an async
/// closure cannot yet be required to be `Send`, which a spawned task needs.)
pub async fn follow<S, SF, A, AF>(
    w: Watched<'_>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
    mut start: S,
    mut apply: A,
) where
    S: FnMut() -> SF,
    SF: Future<Output = Result<Revision, StoreError>>,
    A: FnMut(Vec<WatchEvent>) -> AF,
    AF: Future<Output = ()>,
{
    loop {
        let started = async {
            let rev = start().await?;
            w.store.watch(w.prefix, rev).await
        };
        let mut events: WatchStream = match started.await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("{}: cannot read the store: {e}; retrying", w.what);
                tokio::select! {
                    _ = tokio::time::sleep(RETRY_AFTER) => continue,
                    _ = shutdown.changed() => return,
                }
            }
        };
        loop {
            let first = tokio::select! {
                ev = events.next() => ev,
                _ = shutdown.changed() => return,
            };
            let Some(Ok(first)) = first else { break };
            let (batch, ended) = drain_ready(first, &mut events);
            apply(batch).await;
            if ended {
                break;
            }
        }
        tracing::debug!("{}: watch ended; reloading", w.what);
    }
}

/// `first` and every event already waiting behind it; true when the stream ended or failed
/// meanwhile (the caller lists again after applying what arrived).
fn drain_ready(first: WatchEvent, events: &mut WatchStream) -> (Vec<WatchEvent>, bool) {
    let mut batch = vec![first];
    while let Some(more) = events.next().now_or_never() {
        match more {
            Some(Ok(ev)) => batch.push(ev),
            _ => return (batch, true),
        }
    }
    (batch, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    use ferrovirt_store::EventKind;

    /// A real store: the start lists, events arrive in batches, a shutdown ends the loop.
    #[tokio::test]
    async fn follows_a_prefix_from_the_start_revision_and_stops_on_shutdown() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = ferrovirt_store::open_endpoint("", dir.path())
            .await
            .unwrap();
        store.create("/p/before", b"0".to_vec()).await.unwrap();
        store.create("/q/other", b"0".to_vec()).await.unwrap();
        let (tx, rx) = tokio::sync::watch::channel(false);
        let seen: Arc<Mutex<Vec<(EventKind, String)>>> = Arc::default();
        let starts = Arc::new(Mutex::new(0));
        let task = {
            let (store, seen, starts) = (store.clone(), seen.clone(), starts.clone());
            tokio::spawn(async move {
                let w = Watched {
                    store: store.as_ref(),
                    prefix: "/p/",
                    what: "test view",
                };
                follow(
                    w,
                    rx,
                    || async {
                        *starts.lock().unwrap() += 1;
                        store.current_revision().await
                    },
                    |batch: Vec<WatchEvent>| async {
                        let mut s = seen.lock().unwrap();
                        s.extend(batch.into_iter().map(|e| (e.kind, e.kv.key)));
                    },
                )
                .await
            })
        };
        // Let the watch open, then write.
        for _ in 0..100 {
            if *starts.lock().unwrap() > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        store.create("/p/a", b"1".to_vec()).await.unwrap();
        store.create("/q/b", b"1".to_vec()).await.unwrap();
        store.delete("/p/before", None).await.unwrap();
        for _ in 0..200 {
            if seen.lock().unwrap().len() >= 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            *seen.lock().unwrap(),
            vec![
                (EventKind::Created, "/p/a".to_string()),
                (EventKind::Deleted, "/p/before".to_string())
            ]
        );
        tx.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("follow stops on shutdown")
            .unwrap();
        assert_eq!(*starts.lock().unwrap(), 1);
    }
}
