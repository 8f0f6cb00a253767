//! Encryption at rest under the conformance suite: [`Encrypted<B>`] wraps either backend in an
//! [`EncryptingStore`] that encrypts every key, so the same cases prove that reads, lists,
//! conflicts and watch events come back decrypted. Also: the raw bytes in the backend never hold
//! the plaintext, and a key rotation re-encrypts everything and retires the old key.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ferrovirt_store::encrypt::{self, EncryptingStore, KeyFile, Keyring};
use ferrovirt_store::{ListOptions, Store};

use crate::Backend;

pub struct Encrypted<B: Backend> {
    backend: B,
    keys: tempfile::TempDir,
    store: Option<Arc<dyn Store>>,
}

impl<B: Backend> Encrypted<B> {
    fn key_file(&self) -> std::path::PathBuf {
        self.keys.path().join("encryption-keys")
    }

    fn wrap(&self, raw: Arc<dyn Store>) -> anyhow::Result<Arc<dyn Store>> {
        Ok(Arc::new(EncryptingStore::new(
            raw,
            self.key_file(),
            &["/"],
        )?))
    }
}

#[async_trait]
impl<B: Backend> Backend for Encrypted<B> {
    async fn start() -> anyhow::Result<Self> {
        let backend = B::start().await?;
        let keys = tempfile::tempdir()?;
        let mut me = Encrypted {
            store: None,
            backend,
            keys,
        };
        me.store = Some(me.wrap(me.backend.store())?);
        Ok(me)
    }

    fn store(&self) -> Arc<dyn Store> {
        Arc::clone(self.store.as_ref().expect("started"))
    }

    async fn restart(&mut self, old: Arc<dyn Store>) -> anyhow::Result<Arc<dyn Store>> {
        drop(old);
        // Every handle on the raw store goes before the backend reopens it.
        self.store = None;
        let raw = self.backend.restart(self.backend.store()).await?;
        self.store = Some(self.wrap(raw)?);
        Ok(self.store())
    }
}

/// Writes a secret through the encrypting store and checks what the raw backend holds; then
/// rotates the key and checks the values read back, the old key is gone and nothing is left
/// under it.
pub async fn raw_bytes_and_rotation<B: Backend>() -> anyhow::Result<()> {
    let b = Encrypted::<B>::start().await?;
    let raw = b.backend.store();
    let enc = b.store();
    let secret = b"s3cr3t-value-that-must-not-leak";
    let mut keys = Vec::new();
    for i in 0..7 {
        let key = format!("/registry/core/secrets/default/s{i}");
        enc.create(&key, secret.to_vec()).await?;
        keys.push(key);
    }
    // A value written before encryption was on still reads, and is encrypted by the rotation.
    raw.create("/registry/core/secrets/default/old", secret.to_vec())
        .await?;
    let before = KeyFile::new(b.key_file()).load()?.names();
    for key in &keys {
        let v = raw.get(key).await?.expect("raw value").value;
        assert!(v.starts_with(encrypt::PREFIX.as_bytes()), "{key} encrypted");
        assert!(!v.windows(secret.len()).any(|w| w == secret), "{key} leaks");
        assert_eq!(enc.get(key).await?.expect("value").value, secret);
    }
    assert_eq!(
        enc.get("/registry/core/secrets/default/old")
            .await?
            .expect("plaintext value")
            .value,
        secret
    );

    let done = encrypt::rotate(
        raw.clone(),
        b.key_file(),
        &["/registry/core/secrets/"],
        Duration::from_millis(50),
    )
    .await?;
    assert_eq!(done.retired, before);
    assert_eq!(done.rewritten, 8);
    let after = KeyFile::new(b.key_file()).load()?.names();
    assert_eq!(after, vec![done.new_key.clone()]);
    let all = raw
        .list("/registry/core/secrets/", ListOptions::default())
        .await?;
    assert_eq!(all.items.len(), 8);
    for kv in &all.items {
        assert_eq!(Keyring::key_name_of(&kv.value), Some(done.new_key.as_str()));
        assert!(!kv.value.windows(secret.len()).any(|w| w == secret));
    }
    // The running store follows the new key file.
    for key in &keys {
        assert_eq!(enc.get(key).await?.expect("value").value, secret);
    }
    let listed = enc
        .list("/registry/core/secrets/", ListOptions::default())
        .await?;
    assert!(listed.items.iter().all(|kv| kv.value == secret));
    Ok(())
}

/// Conformance cases run encrypted (a subset: each backend already runs the full suite).
macro_rules! encrypted_tests {
    ($backend:ty) => {
        $crate::conformance_tests!(crate::encrypted::Encrypted<$backend>:
            crud,
            conflicts,
            list_prefix_and_limit,
            watch_replay_then_live,
            restart_durability,
        );

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn raw_bytes_and_rotation() -> anyhow::Result<()> {
            crate::encrypted::raw_bytes_and_rotation::<$backend>().await
        }
    };
}
pub(crate) use encrypted_tests;

mod sqlite_tests {
    crate::encrypted::encrypted_tests!(crate::sqlite::Sqlite);
}

mod etcd_tests {
    crate::encrypted::encrypted_tests!(crate::etcd::Etcd);
}
