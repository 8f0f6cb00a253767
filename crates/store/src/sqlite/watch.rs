//! Watch streams of the SQLite backend: replay from the log table, then the live broadcast.
//!
//! A stream is subscribed to the broadcast before it first reads the table, so every event is
//! in the table, in the broadcast, or in both; `last` (the highest revision already handled)
//! drops the overlap. The stream starts in catch-up mode and reads the table in batches until
//! a batch comes back short; then it follows the broadcast. When it falls so far behind that the
//! broadcast dropped events for it (`Lagged`), it goes back to catch-up mode from `last`. If
//! the events it needs were compacted meanwhile, it yields `Compacted` and ends.

use std::collections::VecDeque;
use std::sync::Arc;

use futures::StreamExt;
use tokio::sync::broadcast::{self, error::RecvError};

use super::{SqliteStore, log};
use crate::{Revision, StoreError, WatchEvent, WatchStream};

/// Rows read from the log table per catch-up query.
const REPLAY_BATCH: usize = 512;

struct State {
    store: SqliteStore,
    rx: broadcast::Receiver<Arc<WatchEvent>>,
    prefix: String,
    /// Every matching event with a revision up to here has been yielded or queued.
    last: Revision,
    queued: VecDeque<WatchEvent>,
    catching_up: bool,
    done: bool,
}

pub(super) fn stream(
    store: SqliteStore,
    rx: broadcast::Receiver<Arc<WatchEvent>>,
    prefix: String,
    after: Revision,
) -> WatchStream {
    let state = State {
        store,
        rx,
        prefix,
        last: after,
        queued: VecDeque::new(),
        catching_up: true,
        done: false,
    };
    futures::stream::unfold(state, |mut st| async move {
        let item = st.next().await?;
        Some((item, st))
    })
    .boxed()
}

impl State {
    async fn next(&mut self) -> Option<Result<WatchEvent, StoreError>> {
        loop {
            if self.done {
                return None;
            }
            if let Some(event) = self.queued.pop_front() {
                return Some(Ok(event));
            }
            if self.catching_up {
                if let Err(e) = self.replay_batch().await {
                    self.done = true;
                    return Some(Err(e));
                }
                continue;
            }
            match self.rx.recv().await {
                Ok(event) => {
                    if event.revision <= self.last {
                        continue;
                    }
                    self.last = event.revision;
                    if event.kv.key.starts_with(&self.prefix) {
                        return Some(Ok(WatchEvent::clone(&event)));
                    }
                }
                Err(RecvError::Lagged(_)) => self.catching_up = true,
                // The sender lives as long as the store, which this stream holds.
                Err(RecvError::Closed) => return None,
            }
        }
    }

    /// Queues the next batch of events from the table; leaves catch-up mode on a short batch.
    async fn replay_batch(&mut self) -> Result<(), StoreError> {
        let prefix = self.prefix.clone();
        let after = self.last;
        let batch = self
            .store
            .read(move |c| log::events_after(c, &prefix, after, REPLAY_BATCH))
            .await?;
        if batch.len() < REPLAY_BATCH {
            self.catching_up = false;
        }
        if let Some(last) = batch.last() {
            self.last = last.revision;
        }
        self.queued.extend(batch);
        Ok(())
    }
}
