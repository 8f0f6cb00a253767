//! Bootstrap data: what servers sharing one etcd must hold alike, kept in the datastore
//! encrypted with a key derived from the join token's secret (k3s' "bootstrap data").
//!
//! The first server on an empty etcd makes its credentials in its data dir as a lone server
//! does and then [`publish`]es the files in [`SHARED_FILES`] under [`STORE_KEY`]: sealed with
//! AES-256-GCM under a key derived by PBKDF2-HMAC-SHA256 (random salt) from the token secret.
//! A further server is started with `--token-file` (the first server's `ferrovirt token`);
//! [`prepare`] reads the record, opens it with the token's secret (a wrong secret fails the
//! GCM tag: the server refuses to start), checks the CA it finds against the token's CA hash
//! (a token of another cluster is refused) and writes the files into its own data dir before
//! anything else reads them. Each server then signs its own serving certificate with the
//! shared CA key (its own listen address among the SANs, `crate::tls`).
//!
//! The record lives outside `/registry/`, so no API request can read or write it, and it is
//! written once (create-if-absent): a later rotation of a shared file (e.g. `ferrovirt secrets
//! rotate-key`) must be copied to the other servers by hand (docs/nodes.md).

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::path::Path;
use std::time::Duration;

use base64::Engine;
use ferrovirt_api::jointoken::JoinToken;
use ferrovirt_store::{Store, StoreError};
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};

use crate::error::ServerError;

/// The datastore key of the sealed bootstrap record.
pub const STORE_KEY: &str = "/bootstrap/ferrovirt";

/// The data-dir files every server of a cluster shares (relative paths): the serving CA and
/// its key, the client CA and its key, the ServiceAccount token signing key, the admin token,
/// the node join token, the Secrets-at-rest keyring and the CDI upload token key.
pub const SHARED_FILES: &[&str] = &[
    "tls/ca.crt",
    "tls/ca.key",
    "tls/client-ca.crt",
    "tls/client-ca.key",
    "tls/sa-token.key",
    "token",
    crate::auth::join::TOKEN_FILE,
    "encryption-keys",
    "upload-token.key",
];

const PBKDF2_ROUNDS: u32 = 100_000;
const AAD: &[u8] = b"ferrovirt-bootstrap-v1";

/// Why bootstrap data could not be opened.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BootstrapError {
    #[error("the bootstrap record is malformed: {0}")]
    Malformed(String),
    #[error(
        "the token's secret does not open the cluster's bootstrap data in the datastore \
         (wrong token: use the first server's `ferrovirt token`)"
    )]
    WrongSecret,
    #[error(
        "the token's CA hash does not match the cluster's CA in the datastore (a token of \
         another cluster?)"
    )]
    WrongCa,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Record {
    v: u32,
    salt: String,
    nonce: String,
    sealed: String,
}

fn key(secret: &str, salt: &[u8]) -> LessSafeKey {
    let mut k = [0u8; 32];
    ring::pbkdf2::derive(
        ring::pbkdf2::PBKDF2_HMAC_SHA256,
        NonZeroU32::new(PBKDF2_ROUNDS).expect("non-zero"),
        salt,
        secret.as_bytes(),
        &mut k,
    );
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &k).expect("a 32-byte key"))
}

fn random<const N: usize>() -> Result<[u8; N], ServerError> {
    let mut b = [0u8; N];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b)
        .map_err(|_| ServerError::Tls("no randomness for the bootstrap data".into()))?;
    Ok(b)
}

/// The shared files: relative path → contents.
pub type Files = BTreeMap<String, Vec<u8>>;

/// Seals `files` with a key derived from `secret`.
pub fn seal(secret: &str, files: &Files) -> Result<Vec<u8>, ServerError> {
    let salt = random::<16>()?;
    let nonce = random::<NONCE_LEN>()?;
    let b64 = base64::engine::general_purpose::STANDARD;
    let encoded: BTreeMap<&String, String> =
        files.iter().map(|(k, v)| (k, b64.encode(v))).collect();
    let mut data = serde_json::to_vec(&encoded).map_err(|e| ServerError::Config(e.to_string()))?;
    key(secret, &salt)
        .seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(AAD),
            &mut data,
        )
        .map_err(|_| ServerError::Tls("sealing the bootstrap data".into()))?;
    serde_json::to_vec(&Record {
        v: 1,
        salt: b64.encode(salt),
        nonce: b64.encode(nonce),
        sealed: b64.encode(data),
    })
    .map_err(|e| ServerError::Config(e.to_string()))
}

/// Opens a record made by [`seal`] with `token`'s secret and checks the CA inside against the
/// token's CA hash.
pub fn open(token: &JoinToken, record: &[u8]) -> Result<Files, BootstrapError> {
    let malformed = |e: &dyn std::fmt::Display| BootstrapError::Malformed(e.to_string());
    let r: Record = serde_json::from_slice(record).map_err(|e| malformed(&e))?;
    if r.v != 1 {
        return Err(BootstrapError::Malformed(format!("version {}", r.v)));
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let salt = b64.decode(&r.salt).map_err(|e| malformed(&e))?;
    let nonce: [u8; NONCE_LEN] = b64
        .decode(&r.nonce)
        .map_err(|e| malformed(&e))?
        .try_into()
        .map_err(|_| BootstrapError::Malformed("nonce length".into()))?;
    let mut data = b64.decode(&r.sealed).map_err(|e| malformed(&e))?;
    let plain = key(&token.secret, &salt)
        .open_in_place(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(AAD),
            &mut data,
        )
        .map_err(|_| BootstrapError::WrongSecret)?;
    let encoded: BTreeMap<String, String> =
        serde_json::from_slice(plain).map_err(|e| malformed(&e))?;
    let mut files = Files::new();
    for (k, v) in encoded {
        files.insert(k, b64.decode(v).map_err(|e| malformed(&e))?);
    }
    let ca = files
        .get("tls/ca.crt")
        .ok_or_else(|| BootstrapError::Malformed("no tls/ca.crt".into()))?;
    let hash =
        crate::auth::join::ca_hash(&String::from_utf8_lossy(ca)).map_err(|e| malformed(&e))?;
    if hash != token.ca_hash {
        return Err(BootstrapError::WrongCa);
    }
    if let Some(bad) = files.keys().find(|k| !SHARED_FILES.contains(&k.as_str())) {
        return Err(BootstrapError::Malformed(format!(
            "unexpected file {bad:?}"
        )));
    }
    Ok(files)
}

fn store_err(e: StoreError) -> ServerError {
    ServerError::Config(format!("bootstrap data in the datastore: {e}"))
}

/// The token that opens this cluster's bootstrap data: `--token-file`'s, else the data dir's
/// own `node-token` (a server restarting).
fn local_token(data_dir: &Path) -> Result<Option<JoinToken>, ServerError> {
    let p = data_dir.join(crate::auth::join::TOKEN_FILE);
    match std::fs::read_to_string(&p) {
        Ok(t) => JoinToken::parse(&t)
            .map(Some)
            .map_err(|e| ServerError::Config(format!("{}: {e}", p.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ServerError::io(p.display(), e)),
    }
}

/// What [`prepare`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prepared {
    /// The datastore held the cluster's record: the shared files now come from it.
    Joined,
    /// No record yet: this is the first server; call [`publish`] once its files exist.
    First,
}

/// Before a server on a shared datastore reads its credentials: loads the cluster's shared
/// files from the datastore into `data_dir` (`token`: from `--token-file`). With a token and
/// no record yet it waits up to `wait` for the first server to publish one.
pub async fn prepare(
    store: &dyn Store,
    data_dir: &Path,
    token: Option<&JoinToken>,
    wait: Duration,
) -> Result<Prepared, ServerError> {
    let deadline = tokio::time::Instant::now() + wait;
    let record = loop {
        match store.get(STORE_KEY).await.map_err(store_err)? {
            Some(kv) => break kv.value,
            None if token.is_none() => return Ok(Prepared::First),
            None if tokio::time::Instant::now() >= deadline => {
                return Err(ServerError::Config(format!(
                    "--token-file given, but the datastore holds no cluster bootstrap data after \
                     {wait:?}: start the first server (without --token-file) first"
                )));
            }
            None => {
                tracing::info!("waiting for the first server's bootstrap data in the datastore");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    let token = match token {
        Some(t) => t.clone(),
        None => local_token(data_dir)?.ok_or_else(|| {
            ServerError::Config(
                "the datastore already holds a cluster's bootstrap data: join it with \
                 --token-file (the first server's `ferrovirt token`)"
                    .into(),
            )
        })?,
    };
    let files = open(&token, &record).map_err(|e| ServerError::Config(e.to_string()))?;
    crate::tls::private_dir(&data_dir.join("tls"))?;
    for (rel, bytes) in &files {
        let p = data_dir.join(rel);
        if std::fs::read(&p).ok().as_ref() != Some(bytes) {
            crate::tls::write_private(&p, bytes)?;
        }
    }
    tracing::info!(
        files = files.len(),
        "shared credentials loaded from the datastore"
    );
    Ok(Prepared::Joined)
}

/// After the first server made its credentials: seals the shared files under the node-token's
/// secret and stores them (create-if-absent; another first server's record wins only if it
/// names the same CA, else this server refuses to go on).
pub async fn publish(store: &dyn Store, data_dir: &Path) -> Result<(), ServerError> {
    let token = local_token(data_dir)?
        .ok_or_else(|| ServerError::Config("no node-token to seal bootstrap data with".into()))?;
    let mut files = Files::new();
    for rel in SHARED_FILES {
        let p = data_dir.join(rel);
        match std::fs::read(&p) {
            Ok(t) => {
                files.insert(rel.to_string(), t);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(ServerError::io(p.display(), e)),
        }
    }
    if !files.contains_key("tls/ca.key") {
        return Err(ServerError::Config(format!(
            "{} has no tls/ca.key (made by an older version, which did not keep the serving CA \
             key): servers cannot share it; start from a new data dir",
            data_dir.display()
        )));
    }
    let sealed = seal(&token.secret, &files)?;
    match store.create(STORE_KEY, sealed).await {
        Ok(_) => {
            tracing::info!("bootstrap data stored for further servers");
            Ok(())
        }
        Err(StoreError::AlreadyExists(_)) => {
            let kv = store
                .get(STORE_KEY)
                .await
                .map_err(store_err)?
                .ok_or_else(|| ServerError::Config("bootstrap record vanished".into()))?;
            open(&token, &kv.value)
                .map(|_| ())
                .map_err(|e| ServerError::Config(format!("another server's bootstrap data: {e}")))
        }
        Err(e) => Err(store_err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seal_open_and_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let pki = crate::tls::load_or_create(dir.path(), &[]).unwrap();
        let token = crate::auth::join::load_or_create(dir.path(), &pki.ca_pem).unwrap();
        let mut files = Files::new();
        files.insert("tls/ca.crt".to_string(), pki.ca_pem.clone().into_bytes());
        files.insert("token".to_string(), b"admin".to_vec());
        // A binary file (the upload token key is one).
        files.insert("upload-token.key".to_string(), vec![0xff, 0, 0x80]);
        let sealed = seal(&token.secret, &files).unwrap();
        assert!(!String::from_utf8_lossy(&sealed).contains("admin"));
        assert!(!String::from_utf8_lossy(&sealed).contains("YWRtaW4"));
        assert_eq!(open(&token, &sealed).unwrap(), files);
        // Another secret: the tag does not verify.
        let mut wrong = token.clone();
        wrong.secret = "x".repeat(32);
        assert_eq!(open(&wrong, &sealed), Err(BootstrapError::WrongSecret));
        // The right secret but another cluster's CA hash.
        let mut other_ca = token.clone();
        other_ca.ca_hash[0] ^= 1;
        assert_eq!(open(&other_ca, &sealed), Err(BootstrapError::WrongCa));
        // A flipped byte of the sealed data.
        let mut r: serde_json::Value = serde_json::from_slice(&sealed).unwrap();
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut ct = b64.decode(r["sealed"].as_str().unwrap()).unwrap();
        ct[0] ^= 1;
        r["sealed"] = b64.encode(ct).into();
        let tampered = serde_json::to_vec(&r).unwrap();
        assert_eq!(open(&token, &tampered), Err(BootstrapError::WrongSecret));
        assert!(matches!(
            open(&token, b"{}"),
            Err(BootstrapError::Malformed(_))
        ));
    }

    #[tokio::test]
    async fn publish_then_prepare_copies_the_shared_files() {
        let store: std::sync::Arc<dyn Store> = {
            let d = tempfile::tempdir().unwrap();
            let s = ferrovirt_store::open_endpoint("", d.path()).await.unwrap();
            std::mem::forget(d);
            s
        };
        let first = tempfile::tempdir().unwrap();
        assert_eq!(
            prepare(store.as_ref(), first.path(), None, Duration::ZERO)
                .await
                .unwrap(),
            Prepared::First
        );
        let pki = crate::tls::load_or_create(first.path(), &[]).unwrap();
        crate::auth::certs::load_or_create(first.path()).unwrap();
        let token = crate::auth::join::load_or_create(first.path(), &pki.ca_pem).unwrap();
        std::fs::write(first.path().join("upload-token.key"), [0xffu8, 0, 0x80]).unwrap();
        publish(store.as_ref(), first.path()).await.unwrap();
        // Publishing again (a restart) is fine.
        publish(store.as_ref(), first.path()).await.unwrap();

        let second = tempfile::tempdir().unwrap();
        let mut wrong = token.clone();
        wrong.secret = "y".repeat(40);
        let e = prepare(store.as_ref(), second.path(), Some(&wrong), Duration::ZERO)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("wrong token"), "{e}");
        assert!(!second.path().join("tls/ca.key").exists());
        // Without any token, a server on a datastore with a record is told to join.
        let e = prepare(store.as_ref(), second.path(), None, Duration::ZERO)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("--token-file"), "{e}");
        assert_eq!(
            prepare(store.as_ref(), second.path(), Some(&token), Duration::ZERO)
                .await
                .unwrap(),
            Prepared::Joined
        );
        for f in [
            "tls/ca.crt",
            "tls/ca.key",
            "tls/client-ca.key",
            "token",
            "node-token",
        ] {
            assert_eq!(
                std::fs::read_to_string(first.path().join(f)).unwrap(),
                std::fs::read_to_string(second.path().join(f)).unwrap(),
                "{f}"
            );
        }
        assert_eq!(
            std::fs::read(second.path().join("upload-token.key")).unwrap(),
            [0xffu8, 0, 0x80]
        );
        // The joined server signs its own serving certificate with the shared CA.
        let p2 = crate::tls::load_or_create(second.path(), &["10.9.9.9".into()]).unwrap();
        assert_eq!(p2.ca_pem, pki.ca_pem);
        assert_ne!(p2.cert_pem, pki.cert_pem);
        let wrong_dir = tempfile::tempdir().unwrap();
        let e = prepare(
            store.as_ref(),
            wrong_dir.path(),
            Some(&wrong),
            Duration::ZERO,
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(e.contains("wrong token"), "{e}");
    }
}
