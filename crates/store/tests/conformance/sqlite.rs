//! The SQLite backend under the conformance suite: one database file per test in a temp dir.

use std::sync::Arc;

use async_trait::async_trait;
use ferrovirt_store::{SqliteStore, Store};

use crate::Backend;

pub struct Sqlite {
    dir: tempfile::TempDir,
    store: Arc<dyn Store>,
}

impl Sqlite {
    fn path(&self) -> std::path::PathBuf {
        self.dir.path().join("db").join("state.db")
    }
}

#[async_trait]
impl Backend for Sqlite {
    async fn start() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let store = SqliteStore::open(dir.path().join("db").join("state.db")).await?;
        Ok(Sqlite {
            dir,
            store: Arc::new(store),
        })
    }

    fn store(&self) -> Arc<dyn Store> {
        Arc::clone(&self.store)
    }

    async fn restart(&mut self, old: Arc<dyn Store>) -> anyhow::Result<Arc<dyn Store>> {
        drop(old);
        // Replace our own handle with a throwaway store first, so that the database is closed
        // (and its lock released) before it is opened again.
        let scratch = SqliteStore::open(self.dir.path().join("scratch.db")).await?;
        self.store = Arc::new(scratch);
        self.store = Arc::new(SqliteStore::open(self.path()).await?);
        Ok(self.store())
    }
}

mod tests {
    use ferrovirt_store::{ListOptions, StoreError, open_endpoint};

    crate::all_conformance_tests!(super::Sqlite);

    #[tokio::test]
    async fn open_endpoint_opens_sqlite() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        // Empty: DATA_DIR/state.db.
        let store = open_endpoint("", dir.path()).await?;
        store.create("/a", b"1".to_vec()).await?;
        drop(store);
        assert!(dir.path().join("state.db").is_file());
        let store = open_endpoint("sqlite://", dir.path()).await?;
        assert_eq!(store.list("", ListOptions::default()).await?.items.len(), 1);
        drop(store);
        // An explicit path (query parameters are ignored).
        let path = dir.path().join("other").join("x.db");
        let endpoint = format!("sqlite://{}?_journal=WAL", path.display());
        let store = open_endpoint(&endpoint, dir.path()).await?;
        store.create("/b", Vec::new()).await?;
        assert!(path.is_file());
        match open_endpoint("mysql://x", dir.path()).await {
            Err(StoreError::Backend(msg)) => assert!(msg.contains("unsupported"), "{msg}"),
            other => anyhow::bail!("unsupported endpoint: {:?}", other.map(|_| ())),
        }
        Ok(())
    }
}
