//! Encryption at rest: [`EncryptingStore`] wraps any [`Store`] and encrypts the values of keys
//! under chosen prefixes (the API server picks Secrets) with AES-256-GCM, the way
//! kube-apiserver's `EncryptionConfiguration` `aesgcm` provider does.
//!
//! A stored value is `k8s:enc:aesgcm:v1:<key name>:` + a random 12-byte nonce + ciphertext
//! and tag; the store key is the additional authenticated data, so a ciphertext copied under
//! another key does not decrypt. Values without that prefix (written before encryption was on)
//! are read as plaintext and encrypted on their next write. Watch events, conflicts' current
//! values and deleted values come back decrypted.
//!
//! Keys live in a [`KeyFile`] (0600, one `NAME BASE64` line per key, the first one encrypts,
//! all decrypt). The store re-reads the file when it changes, so servers sharing one etcd (and
//! one copy of the file) follow a rotation. [`rotate`] adds a key, re-encrypts every value and
//! retires the old keys.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use base64::Engine;
use futures::StreamExt;
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};

use crate::{KeyValue, ListOptions, ListResult, Revision, Store, StoreError, WatchStream};

/// Every encrypted value starts with this, then `<key name>:`.
pub const PREFIX: &str = "k8s:enc:aesgcm:v1:";

fn err(msg: impl Into<String>) -> StoreError {
    StoreError::Backend(msg.into())
}

/// One named AES-256 key.
struct Key {
    name: String,
    raw: [u8; 32],
    aead: LessSafeKey,
}

impl Key {
    fn new(name: String, raw: [u8; 32]) -> Result<Key, StoreError> {
        let unbound = UnboundKey::new(&AES_256_GCM, &raw).map_err(|_| err("invalid AES key"))?;
        Ok(Key {
            name,
            raw,
            aead: LessSafeKey::new(unbound),
        })
    }

    fn generate() -> Result<Key, StoreError> {
        let rng = SystemRandom::new();
        let mut raw = [0u8; 32];
        let mut id = [0u8; 4];
        rng.fill(&mut raw)
            .and_then(|_| rng.fill(&mut id))
            .map_err(|_| err("no randomness for a new key"))?;
        let secs = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        let id: String = id.iter().map(|b| format!("{b:02x}")).collect();
        Key::new(format!("key{secs}-{id}"), raw)
    }
}

/// The keys, first one for writing.
pub struct Keyring {
    keys: Vec<Key>,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyring")
            .field("names", &self.names())
            .finish()
    }
}

impl Keyring {
    /// Parses a key file's text.
    pub fn parse(text: &str) -> Result<Keyring, StoreError> {
        let mut keys = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (name, b64) = line
                .split_once(char::is_whitespace)
                .ok_or_else(|| err(format!("key file line {}: expected NAME BASE64", i + 1)))?;
            if name.contains(':') {
                return Err(err(format!(
                    "key file line {}: a key name may not contain ':'",
                    i + 1
                )));
            }
            let raw = base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .ok()
                .and_then(|v| <[u8; 32]>::try_from(v).ok())
                .ok_or_else(|| {
                    err(format!(
                        "key file line {}: the key must be 32 bytes in base64",
                        i + 1
                    ))
                })?;
            keys.push(Key::new(name.to_string(), raw)?);
        }
        if keys.is_empty() {
            return Err(err("the key file holds no key"));
        }
        Ok(Keyring { keys })
    }

    fn render(&self) -> String {
        let mut s = String::from(
            "# ferrovirt encryption keys for Secrets at rest (AES-256-GCM): the first key encrypts,\n\
             # every key decrypts. Keep it 0600, and identical on every server sharing one etcd.\n",
        );
        for k in &self.keys {
            s.push_str(&format!(
                "{} {}\n",
                k.name,
                base64::engine::general_purpose::STANDARD.encode(k.raw)
            ));
        }
        s
    }

    /// Key names, the writing key first.
    pub fn names(&self) -> Vec<String> {
        self.keys.iter().map(|k| k.name.clone()).collect()
    }

    /// Encrypts `plain` stored under `key` with the first key.
    pub fn encrypt(&self, key: &str, plain: &[u8]) -> Result<Vec<u8>, StoreError> {
        let k = &self.keys[0];
        let mut nonce = [0u8; NONCE_LEN];
        SystemRandom::new()
            .fill(&mut nonce)
            .map_err(|_| err("no randomness for a nonce"))?;
        let mut sealed = plain.to_vec();
        k.aead
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(key.as_bytes()),
                &mut sealed,
            )
            .map_err(|_| err("encryption failed"))?;
        let mut out = format!("{PREFIX}{}:", k.name).into_bytes();
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        Ok(out)
    }

    /// The name of the key `value` is encrypted with (None: plaintext).
    pub fn key_name_of(value: &[u8]) -> Option<&str> {
        let rest = value.strip_prefix(PREFIX.as_bytes())?;
        let end = rest.iter().position(|b| *b == b':')?;
        std::str::from_utf8(&rest[..end]).ok()
    }

    /// Decrypts a value stored under `key`; plaintext values are returned unchanged.
    pub fn decrypt(&self, key: &str, value: &[u8]) -> Result<Vec<u8>, Undecryptable> {
        let Some(name) = Self::key_name_of(value) else {
            if value.starts_with(PREFIX.as_bytes()) {
                return Err(Undecryptable::Corrupt);
            }
            return Ok(value.to_vec());
        };
        let body = &value[PREFIX.len() + name.len() + 1..];
        let k = self
            .keys
            .iter()
            .find(|k| k.name == name)
            .ok_or_else(|| Undecryptable::UnknownKey(name.to_string()))?;
        if body.len() < NONCE_LEN {
            return Err(Undecryptable::Corrupt);
        }
        let (nonce, sealed) = body.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| Undecryptable::Corrupt)?;
        let mut buf = sealed.to_vec();
        let plain = k
            .aead
            .open_in_place(nonce, Aad::from(key.as_bytes()), &mut buf)
            .map_err(|_| Undecryptable::Corrupt)?;
        Ok(plain.to_vec())
    }
}

/// Why a value does not decrypt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Undecryptable {
    /// Encrypted with a key the key file does not hold.
    UnknownKey(String),
    /// Tampered with, or not encrypted for this store key.
    Corrupt,
}

/// A key file on disk (0600).
#[derive(Debug, Clone)]
pub struct KeyFile {
    pub path: PathBuf,
}

impl KeyFile {
    pub fn new(path: impl Into<PathBuf>) -> KeyFile {
        KeyFile { path: path.into() }
    }

    /// Reads the keyring.
    pub fn load(&self) -> Result<Keyring, StoreError> {
        let text = std::fs::read_to_string(&self.path)
            .map_err(|e| err(format!("reading key file {}: {e}", self.path.display())))?;
        Keyring::parse(&text).map_err(|e| err(format!("{}: {e}", self.path.display())))
    }

    /// Reads the keyring, first creating the file with one new key when it is missing.
    pub fn load_or_create(&self) -> Result<Keyring, StoreError> {
        if !self.path.exists() {
            self.write(&Keyring {
                keys: vec![Key::generate()?],
            })?;
            tracing::info!(path = %self.path.display(), "created the Secret encryption key file");
        }
        self.load()
    }

    /// Writes `ring` atomically (a fresh 0600 file renamed over the old one).
    fn write(&self, ring: &Keyring) -> Result<(), StoreError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let io = |e: std::io::Error| err(format!("writing key file {}: {e}", self.path.display()));
        let tmp = self.path.with_extension("tmp");
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io)?;
        f.write_all(ring.render().as_bytes())
            .and_then(|_| f.sync_all())
            .map_err(io)?;
        std::fs::rename(&tmp, &self.path).map_err(io)
    }

    fn stamp(&self) -> Option<(SystemTime, u64)> {
        let m = std::fs::metadata(&self.path).ok()?;
        Some((m.modified().ok()?, m.len()))
    }
}

/// The keyring as last read, and the file's stamp then.
struct Cached {
    ring: Arc<Keyring>,
    stamp: Option<(SystemTime, u64)>,
}

/// A [`Store`] that encrypts values under `prefixes` (see the module doc).
pub struct EncryptingStore {
    inner: Arc<dyn Store>,
    prefixes: Vec<String>,
    file: KeyFile,
    cached: RwLock<Cached>,
}

impl std::fmt::Debug for EncryptingStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncryptingStore")
            .field("prefixes", &self.prefixes)
            .field("key_file", &self.file.path)
            .finish_non_exhaustive()
    }
}

impl EncryptingStore {
    /// Wraps `inner`; the key file is created when missing.
    pub fn new(
        inner: Arc<dyn Store>,
        key_file: impl AsRef<Path>,
        prefixes: &[&str],
    ) -> Result<EncryptingStore, StoreError> {
        let file = KeyFile::new(key_file.as_ref());
        let ring = Arc::new(file.load_or_create()?);
        let stamp = file.stamp();
        Ok(EncryptingStore {
            inner,
            prefixes: prefixes.iter().map(|p| p.to_string()).collect(),
            file,
            cached: RwLock::new(Cached { ring, stamp }),
        })
    }

    fn covers(&self, key: &str) -> bool {
        self.prefixes.iter().any(|p| key.starts_with(p.as_str()))
    }

    /// The keyring, re-read when the file changed since the last read (`force`: always).
    fn ring(&self, force: bool) -> Result<Arc<Keyring>, StoreError> {
        let stamp = self.file.stamp();
        {
            let c = self.cached.read().unwrap_or_else(|p| p.into_inner());
            if !force && c.stamp == stamp {
                return Ok(c.ring.clone());
            }
        }
        let ring = Arc::new(self.file.load()?);
        let mut c = self.cached.write().unwrap_or_else(|p| p.into_inner());
        *c = Cached {
            ring: ring.clone(),
            stamp,
        };
        Ok(ring)
    }

    fn seal(&self, key: &str, value: Vec<u8>) -> Result<Vec<u8>, StoreError> {
        if !self.covers(key) {
            return Ok(value);
        }
        self.ring(false)?.encrypt(key, &value)
    }

    fn open(&self, mut kv: KeyValue) -> Result<KeyValue, StoreError> {
        if !self.covers(&kv.key) {
            return Ok(kv);
        }
        let res = match self.ring(false)?.decrypt(&kv.key, &kv.value) {
            Err(Undecryptable::UnknownKey(_)) => self.ring(true)?.decrypt(&kv.key, &kv.value),
            other => other,
        };
        kv.value = res.map_err(|e| match e {
            Undecryptable::UnknownKey(name) => err(format!(
                "{} is encrypted with key {name:?}, which {} does not hold (servers sharing a store need the same key file)",
                kv.key,
                self.file.path.display()
            )),
            Undecryptable::Corrupt => err(format!(
                "{} does not decrypt: it was altered or belongs to another key",
                kv.key
            )),
        })?;
        Ok(kv)
    }

    fn open_err(&self, e: StoreError) -> StoreError {
        match e {
            StoreError::Conflict {
                key,
                expected,
                current,
            } => {
                let current = current.and_then(|kv| self.open(*kv).ok().map(Box::new));
                StoreError::Conflict {
                    key,
                    expected,
                    current,
                }
            }
            e => e,
        }
    }
}

#[async_trait]
impl Store for EncryptingStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        self.inner
            .get(key)
            .await?
            .map(|kv| self.open(kv))
            .transpose()
    }

    async fn list(&self, prefix: &str, opts: ListOptions) -> Result<ListResult, StoreError> {
        let mut res = self.inner.list(prefix, opts).await?;
        res.items = res
            .items
            .into_iter()
            .map(|kv| self.open(kv))
            .collect::<Result<_, _>>()?;
        Ok(res)
    }

    async fn create(&self, key: &str, value: Vec<u8>) -> Result<KeyValue, StoreError> {
        let mut kv = self
            .inner
            .create(key, self.seal(key, value.clone())?)
            .await?;
        kv.value = value;
        Ok(kv)
    }

    async fn update(
        &self,
        key: &str,
        value: Vec<u8>,
        expected: Revision,
    ) -> Result<KeyValue, StoreError> {
        let sealed = self.seal(key, value.clone())?;
        let mut kv = self
            .inner
            .update(key, sealed, expected)
            .await
            .map_err(|e| self.open_err(e))?;
        kv.value = value;
        Ok(kv)
    }

    async fn delete(&self, key: &str, expected: Option<Revision>) -> Result<KeyValue, StoreError> {
        let kv = self
            .inner
            .delete(key, expected)
            .await
            .map_err(|e| self.open_err(e))?;
        self.open(kv)
    }

    async fn watch(&self, prefix: &str, after: Revision) -> Result<WatchStream, StoreError> {
        let stream = self.inner.watch(prefix, after).await?;
        let me = EncryptingStore {
            inner: self.inner.clone(),
            prefixes: self.prefixes.clone(),
            file: self.file.clone(),
            cached: RwLock::new(Cached {
                ring: self.ring(false)?,
                stamp: self.file.stamp(),
            }),
        };
        Ok(stream
            .map(move |ev| {
                let mut ev = ev?;
                ev.kv = me.open(ev.kv)?;
                ev.prev = ev.prev.map(|p| me.open(p)).transpose()?;
                Ok(ev)
            })
            .boxed())
    }

    async fn compact(&self, revision: Revision) -> Result<(), StoreError> {
        self.inner.compact(revision).await
    }

    async fn current_revision(&self) -> Result<Revision, StoreError> {
        self.inner.current_revision().await
    }

    async fn compacted_revision(&self) -> Result<Revision, StoreError> {
        self.inner.compacted_revision().await
    }
}

/// What [`rotate`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rotation {
    /// The key that now encrypts.
    pub new_key: String,
    /// The keys removed from the file.
    pub retired: Vec<String>,
    /// How many values were rewritten under the new key.
    pub rewritten: usize,
}

/// Rotates the keys of `key_file` over the raw store `inner` (not an [`EncryptingStore`]):
/// puts a new key first, waits `settle` (running servers pick up the new file on their next
/// read or write; the wait covers writes already under way), re-encrypts every value under
/// `prefixes` (plaintext ones too) with compare-and-swap updates, checks that none is left under
/// an old key, and only then removes the old keys from the file.
pub async fn rotate(
    inner: Arc<dyn Store>,
    key_file: impl AsRef<Path>,
    prefixes: &[&str],
    settle: Duration,
) -> Result<Rotation, StoreError> {
    let file = KeyFile::new(key_file.as_ref());
    let old = file.load_or_create()?;
    let retired = old.names();
    let new = Key::generate()?;
    let new_key = new.name.clone();
    let mut keys = vec![new];
    keys.extend(old.keys);
    let ring = Keyring { keys };
    file.write(&ring)?;
    tokio::time::sleep(settle).await;
    let mut rewritten = 0;
    for pass in 0..3 {
        let mut left = 0;
        for prefix in prefixes {
            let mut start_after = None;
            loop {
                let page = inner
                    .list(
                        prefix,
                        ListOptions {
                            start_after: start_after.clone(),
                            limit: Some(500),
                            revision: None,
                        },
                    )
                    .await?;
                for kv in &page.items {
                    if Keyring::key_name_of(&kv.value) == Some(new_key.as_str()) {
                        continue;
                    }
                    left += 1;
                    rewritten += reencrypt(&*inner, &ring, kv.clone(), &new_key).await?;
                }
                start_after = page.items.last().map(|kv| kv.key.clone());
                if !page.more || start_after.is_none() {
                    break;
                }
            }
        }
        if left == 0 {
            break;
        }
        if pass == 2 {
            return Err(err(format!(
                "{left} value(s) were still written with an old key after three passes; the old keys stay in {} (run the rotation again)",
                file.path.display()
            )));
        }
    }
    let only_new = Keyring {
        keys: ring.keys.into_iter().take(1).collect(),
    };
    file.write(&only_new)?;
    Ok(Rotation {
        new_key,
        retired,
        rewritten,
    })
}

/// Rewrites one value under the new key, retrying on conflicts; returns 1 when it wrote.
async fn reencrypt(
    inner: &dyn Store,
    ring: &Keyring,
    mut kv: KeyValue,
    new_key: &str,
) -> Result<usize, StoreError> {
    for _ in 0..10 {
        if Keyring::key_name_of(&kv.value) == Some(new_key) {
            return Ok(0);
        }
        let plain = ring.decrypt(&kv.key, &kv.value).map_err(|e| {
            err(format!(
                "{} does not decrypt with the key file ({e:?}); rotation stopped, no key retired",
                kv.key
            ))
        })?;
        let sealed = ring.encrypt(&kv.key, &plain)?;
        match inner.update(&kv.key, sealed, kv.mod_revision).await {
            Ok(_) => return Ok(1),
            Err(StoreError::NotFound(_)) => return Ok(0),
            Err(StoreError::Conflict {
                current: Some(cur), ..
            }) => kv = *cur,
            Err(StoreError::Conflict { current: None, .. }) => return Ok(0),
            Err(e) => return Err(e),
        }
    }
    Err(err(format!("{} kept changing during the rotation", kv.key)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_bound_to_the_store_key() {
        let ring = Keyring {
            keys: vec![Key::generate().unwrap()],
        };
        let sealed = ring
            .encrypt("/registry/core/secrets/a/b", b"hunter2")
            .unwrap();
        assert!(sealed.starts_with(PREFIX.as_bytes()));
        assert!(!sealed.windows(7).any(|w| w == b"hunter2"));
        assert_eq!(
            ring.decrypt("/registry/core/secrets/a/b", &sealed).unwrap(),
            b"hunter2"
        );
        // Moved under another key: refused.
        assert_eq!(
            ring.decrypt("/registry/core/secrets/a/c", &sealed),
            Err(Undecryptable::Corrupt)
        );
        // Plaintext from before encryption: read as is.
        assert_eq!(ring.decrypt("/k", b"{}").unwrap(), b"{}");
        // A key the ring does not hold.
        let other = Keyring {
            keys: vec![Key::generate().unwrap()],
        };
        assert!(matches!(
            other.decrypt("/registry/core/secrets/a/b", &sealed),
            Err(Undecryptable::UnknownKey(_))
        ));
        // Truncated: no panic.
        for cut in [PREFIX.len() + 3, PREFIX.len() + 30, sealed.len() - 1] {
            assert!(
                ring.decrypt("/registry/core/secrets/a/b", &sealed[..cut])
                    .is_err()
            );
        }
    }

    #[test]
    fn key_file_round_trip_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let f = KeyFile::new(dir.path().join("keys"));
        let ring = f.load_or_create().unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&f.path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(f.load().unwrap().names(), ring.names());
        assert!(Keyring::parse("# nothing\n").is_err());
        assert!(Keyring::parse("a:b AAAA\n").is_err());
        assert!(Keyring::parse("a AAAA\n").is_err());
    }
}
