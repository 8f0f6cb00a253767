//! The storage layer under the API server: a small, kine-shaped key/value interface with
//! revisions, and its backends (embedded SQLite by default, etcd v3 for multi-server setups).
//!
//! Keys are UTF-8 strings such as `/registry/kubevirt.io/virtualmachines/default/vm1`; values are
//! opaque bytes (the API server stores JSON). Every successful write bumps one global,
//! monotonically increasing revision; each key remembers the revision that created it and the one
//! that last modified it (etcd's `create_revision` / `mod_revision`). Kubernetes'
//! `resourceVersion` is the `mod_revision` of an object, and a list's `resourceVersion` is the
//! revision it was read at.

use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use futures::stream::BoxStream;

pub mod encrypt;
pub mod endpoint;
pub mod etcd;
pub mod sqlite;

pub use encrypt::EncryptingStore;
pub use endpoint::{Datastore, DatastoreTls};
pub use etcd::{EtcdStore, FanoutOptions};
pub use sqlite::SqliteStore;

/// A global store revision. Revisions start at 1; 0 means "none yet".
pub type Revision = i64;

/// One stored key with its value and revisions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: Vec<u8>,
    /// Revision of the write that created this key (stays the same across updates).
    pub create_revision: Revision,
    /// Revision of the last write to this key.
    pub mod_revision: Revision,
}

/// Options for [`Store::list`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListOptions {
    /// Return only keys strictly greater than this one (the continue token's position).
    pub start_after: Option<String>,
    /// Return at most this many items (`None` or `Some(0)`: no limit).
    pub limit: Option<usize>,
    /// Read the keyspace as it was at this revision (for consistent pagination).
    /// `None` reads at the current revision. Older than the compacted revision: [`StoreError::Compacted`];
    /// newer than the current revision: [`StoreError::Backend`].
    pub revision: Option<Revision>,
}

/// The result of a [`Store::list`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListResult {
    /// Matching keys in ascending key order.
    pub items: Vec<KeyValue>,
    /// The revision the list was read at.
    pub revision: Revision,
    /// True when more keys match after the last returned item.
    pub more: bool,
}

/// What happened to a key in a [`WatchEvent`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Created,
    Modified,
    Deleted,
}

/// One change delivered by [`Store::watch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    pub kind: EventKind,
    /// The revision of the write that caused this event.
    pub revision: Revision,
    /// The key's new state; for `Deleted`, the last state before deletion (with
    /// `mod_revision` set to the deletion's revision).
    pub kv: KeyValue,
    /// The previous state for `Modified` and `Deleted` events, when known.
    pub prev: Option<KeyValue>,
}

/// A stream of watch events in revision order. An `Err(Compacted)` item ends the stream when the
/// watcher fell behind a compaction.
pub type WatchStream = BoxStream<'static, Result<WatchEvent, StoreError>>;

/// Errors from every backend.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("key {0} already exists")]
    AlreadyExists(String),
    #[error("key {0} not found")]
    NotFound(String),
    /// The expected revision did not match; `current` is the key's current state (None: deleted).
    #[error("conflict on key {key}: expected revision {expected}")]
    Conflict {
        key: String,
        expected: Revision,
        current: Option<Box<KeyValue>>,
    },
    /// The requested revision was compacted away.
    #[error("revision {requested} is compacted (oldest available is {compacted})")]
    Compacted {
        requested: Revision,
        compacted: Revision,
    },
    #[error("backend error: {0}")]
    Backend(String),
}

/// The store interface. All methods are atomic; writes return only after they are durable.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Current value of `key`.
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError>;
    /// Keys starting with `prefix`, in key order.
    async fn list(&self, prefix: &str, opts: ListOptions) -> Result<ListResult, StoreError>;
    /// Create `key`; fails with `AlreadyExists` when it exists.
    async fn create(&self, key: &str, value: Vec<u8>) -> Result<KeyValue, StoreError>;
    /// Replace `key` only when its `mod_revision` equals `expected`. A missing (or deleted) key
    /// is `NotFound`; a different `mod_revision` is `Conflict` carrying the current state.
    async fn update(
        &self,
        key: &str,
        value: Vec<u8>,
        expected: Revision,
    ) -> Result<KeyValue, StoreError>;
    /// Delete `key` (only when its `mod_revision` equals `expected`, if given); returns the
    /// deleted state with `mod_revision` set to the deletion's revision. A missing key is
    /// `NotFound`; a different `mod_revision` is `Conflict` carrying the current state.
    async fn delete(&self, key: &str, expected: Option<Revision>) -> Result<KeyValue, StoreError>;
    /// Changes to keys under `prefix` with revision strictly greater than `after`: first the
    /// history from the log, then live events, each exactly once and in revision order.
    /// `after` = 0 means the whole history. Fails with `Compacted` when `after` is older than
    /// [`Store::compacted_revision`] (`requested` is then `after`); a watcher that falls behind
    /// a later compaction gets one `Err(Compacted)` item and the stream ends.
    async fn watch(&self, prefix: &str, after: Revision) -> Result<WatchStream, StoreError>;
    /// Forget history older than `revision`: afterwards reads at `revision` or later still work,
    /// older ones fail with `Compacted`. Compacting at or below the current mark is a no-op; a
    /// revision above the current one is an error. Does not bump the revision.
    async fn compact(&self, revision: Revision) -> Result<(), StoreError>;
    /// The latest revision.
    async fn current_revision(&self) -> Result<Revision, StoreError>;
    /// The oldest revision still readable (0 when nothing was compacted).
    async fn compacted_revision(&self) -> Result<Revision, StoreError>;
}

/// Opens the store named by a `--datastore-endpoint` value.
///
/// - empty, `sqlite://` or `sqlite:` : the embedded SQLite store at `DATA_DIR/state.db`;
/// - `sqlite://PATH` : the SQLite store at `PATH` (a `?query` suffix is ignored);
/// - `http://host:port[,http://host:port…]` or `https://…` : etcd v3 at those endpoints
///   (https needs [`open_endpoint_tls`] with at least a CA file).
pub async fn open_endpoint(endpoint: &str, data_dir: &Path) -> Result<Arc<dyn Store>, StoreError> {
    open_endpoint_tls(endpoint, &DatastoreTls::default(), data_dir).await
}

/// [`open_endpoint`] with the datastore TLS flags ([`endpoint::Datastore::parse`] lists what
/// is refused).
pub async fn open_endpoint_tls(
    endpoint: &str,
    tls: &DatastoreTls,
    data_dir: &Path,
) -> Result<Arc<dyn Store>, StoreError> {
    match Datastore::parse(endpoint, tls, data_dir)? {
        Datastore::Sqlite(path) => Ok(Arc::new(SqliteStore::open(path).await?)),
        Datastore::Etcd { endpoints, tls } => {
            let tls = match tls {
                Some(t) => Datastore::read_tls(&t)?,
                None => None,
            };
            Ok(Arc::new(EtcdStore::connect_tls(&endpoints, "", tls).await?))
        }
    }
}

/// The smallest byte string greater than every string starting with `prefix` (etcd's
/// `range_end` for a prefix); `None` when no such bound exists (empty or all-0xff prefix).
pub(crate) fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn prefix_end_increments_the_last_byte() {
        assert_eq!(prefix_end(b"/a/"), Some(b"/a0".to_vec()));
        assert_eq!(prefix_end(b"a\xff"), Some(b"b".to_vec()));
        assert_eq!(prefix_end(b""), None);
        assert_eq!(prefix_end(b"\xff\xff"), None);
    }
}
