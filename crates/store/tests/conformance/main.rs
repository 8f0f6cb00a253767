//! Store conformance suite: the same behavioural tests, written once in [`suite`], run against
//! every backend. [`sqlite`] opens databases in temp dirs; [`etcd`] starts a real etcd process
//! per test (from `/usr/bin/etcd`, or `$FERROVIRT_ETCD_BIN`) on loopback ports, and
//! [`etcd_fanout`] tests how its watchers share etcd watches; [`encrypted`]
//! runs cases through the encrypting wrapper on both.

mod encrypted;
mod etcd;
mod etcd_fanout;
mod sqlite;
mod suite;

use std::sync::Arc;

use async_trait::async_trait;
use ferrovirt_store::Store;

/// One backend under test.
#[async_trait]
pub trait Backend: Sized + Send + Sync + 'static {
    /// Starts a fresh, empty backend.
    async fn start() -> anyhow::Result<Self>;
    /// A handle to the store.
    fn store(&self) -> Arc<dyn Store>;
    /// Stops the backend as abruptly as the backend allows (drops the SQLite store; kills etcd
    /// with SIGKILL), starts it again on the same data and returns a new handle. `old` is the
    /// caller's last handle, dropped first.
    async fn restart(&mut self, old: Arc<dyn Store>) -> anyhow::Result<Arc<dyn Store>>;
}

/// Declares one `#[tokio::test]` per suite case for a backend type.
macro_rules! conformance_tests {
    ($backend:ty: $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() -> anyhow::Result<()> {
                crate::suite::$case::<$backend>().await
            }
        )*
    };
}

/// Every suite case, for both backends.
macro_rules! all_conformance_tests {
    ($backend:ty) => {
        $crate::conformance_tests!($backend:
            crud,
            conflicts,
            list_prefix_and_limit,
            large_list,
            pagination_at_fixed_revision,
            list_at_old_revision,
            watch_replay_then_live,
            watch_while_writing,
            watch_slow_consumer,
            compaction,
            concurrent_writers,
            restart_durability,
        );
    };
}
pub(crate) use {all_conformance_tests, conformance_tests};
