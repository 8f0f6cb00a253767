//! What the server keeps about each joined node's credentials, outside the API (no request
//! reads or writes these keys), and what follows from it (docs/nodes.md):
//!
//! - `/ferrovirt/node-passwords/<name>`: the SHA-256 of the node password ([`super::join`]);
//! - `/ferrovirt/node-certs/<name>`: the SHA-256 (of the DER) and expiry of each node
//!   certificate currently valid for that name, a JSON [`Record`]. A join under the name
//!   replaces the record with its one new certificate (the old ones stop authenticating).
//!
//! [`NodeCerts`] keeps every record in memory from one list and a watch, and answers the
//! per-request question "is this `system:node:<n>` client certificate still valid?" from it
//! (a SHA-256 of the presented DER and a hash-map look-up); a certificate the cache does not
//! hold is looked up in the store once more before it is refused (a join answered a moment
//! before the cache saw its record). [`forget_deleted_nodes`] watches Nodes and, when one is
//! deleted, deletes both records of its name, as k3s deletes its node-password Secret with the
//! Node: a new machine may then join under the name, and the deleted node's certificates are
//! refused (401). [`sweep_orphans`] (once at each start) removes the records of names that
//! have no Node and whose records did not change for [`ORPHAN_GRACE`]: Nodes deleted while no
//! server watched.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use ferrovirt_api::jointoken::{NODE_USER_PREFIX, hex};
use ferrovirt_store::{EventKind, ListOptions, Revision, Store, StoreError};

use crate::error::ApiError;

/// Store prefix of the certificate records.
pub const CERTS_PREFIX: &str = "/ferrovirt/node-certs/";
/// Store prefix of Nodes.
pub const NODES_PREFIX: &str = "/registry/core/nodes/";

/// Store prefix of the node-password records ([`super::join::password_key`]).
const PASSWORDS_PREFIX: &str = "/ferrovirt/node-passwords/";

/// How long [`sweep_orphans`] leaves a record without a Node unchanged before removing it:
/// a join writes its records a moment before the agent creates its Node.
pub const ORPHAN_GRACE: Duration = Duration::from_secs(60);

/// Where the certificates valid for `node` are recorded.
pub fn certs_key(node: &str) -> String {
    format!("{CERTS_PREFIX}{node}")
}

/// SHA-256 of a certificate's DER.
pub fn cert_hash(der: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, der);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// One valid certificate: its SHA-256 (hex) and when it expires (Unix seconds).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    pub sha256: String,
    pub not_after: i64,
}

/// The certificates valid for one node name.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Record {
    pub certificates: Vec<Entry>,
}

impl Record {
    /// The record after issuing `entry` at `now`: with `keep_old`, the unexpired entries stay
    /// beside it (a renewal); without, it replaces them all (a join). Pure.
    pub fn with(&self, entry: Entry, now: i64, keep_old: bool) -> Record {
        let mut certificates: Vec<Entry> = if keep_old {
            self.certificates
                .iter()
                .filter(|e| e.not_after > now && e.sha256 != entry.sha256)
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        certificates.push(entry);
        Record { certificates }
    }

    /// Whether the certificate hashing to `hash` is recorded (expiry is the TLS layer's to
    /// check). Pure.
    pub fn allows(&self, hash: &[u8; 32]) -> bool {
        let h = hex(hash);
        self.certificates.iter().any(|e| e.sha256 == h)
    }

    fn hashes(&self) -> Vec<[u8; 32]> {
        self.certificates
            .iter()
            .filter_map(|e| {
                let mut out = [0u8; 32];
                (e.sha256.len() == 64).then_some(())?;
                for (i, o) in out.iter_mut().enumerate() {
                    *o = u8::from_str_radix(e.sha256.get(2 * i..2 * i + 2)?, 16).ok()?;
                }
                Some(out)
            })
            .collect()
    }

    fn decode(value: &[u8]) -> Option<Record> {
        serde_json::from_slice(value).ok()
    }
}

/// The node name in a node certificate's user name (`system:node:<n>`).
pub fn node_of_user(user: &str) -> Option<&str> {
    user.strip_prefix(NODE_USER_PREFIX)
        .filter(|n| !n.is_empty())
}

/// The valid node certificates, by node name (see the module doc).
#[derive(Debug, Default)]
pub struct NodeCerts {
    valid: RwLock<HashMap<String, Vec<[u8; 32]>>>,
}

/// The 401 for a node certificate not (or no longer) valid.
pub fn revoked(node: &str, hash: &[u8; 32]) -> ApiError {
    ApiError::new(
        401,
        "Unauthorized",
        format!(
            "the client certificate of {NODE_USER_PREFIX}{node} (sha256:{}) is no longer valid: \
             its Node was deleted or the name joined again; join again with the join token",
            hex(hash)
        ),
    )
}

impl NodeCerts {
    fn cached(&self, node: &str, hash: &[u8; 32]) -> bool {
        self.valid
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(node)
            .is_some_and(|hs| hs.contains(hash))
    }

    fn put(&self, node: &str, rec: Option<&Record>) {
        let mut m = self.valid.write().unwrap_or_else(|p| p.into_inner());
        match rec {
            Some(r) => {
                m.insert(node.to_string(), r.hashes());
            }
            None => {
                m.remove(node);
            }
        }
    }

    /// Whether `der`, a verified client certificate of `node`, is still valid: from the cache,
    /// else from the store (never written into the cache here: the watch does that, in order).
    pub async fn check(&self, store: &dyn Store, node: &str, der: &[u8]) -> Result<(), ApiError> {
        let hash = cert_hash(der);
        if self.cached(node, &hash) {
            return Ok(());
        }
        let kv = store
            .get(&certs_key(node))
            .await
            .map_err(ApiError::from_store)?;
        match kv.and_then(|kv| Record::decode(&kv.value)) {
            Some(r) if r.allows(&hash) => Ok(()),
            _ => Err(revoked(node, &hash)),
        }
    }

    /// Records the certificate `der` (expiring at `not_after`) as valid for `node`; with
    /// `keep_old` the other unexpired ones stay valid, else they stop being valid.
    pub async fn record(
        &self,
        store: &dyn Store,
        node: &str,
        der: &[u8],
        not_after: i64,
        keep_old: bool,
    ) -> Result<(), ApiError> {
        let key = certs_key(node);
        let entry = Entry {
            sha256: hex(&cert_hash(der)),
            not_after,
        };
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        for _ in 0..5 {
            let cur = store.get(&key).await.map_err(ApiError::from_store)?;
            let old = cur
                .as_ref()
                .and_then(|kv| Record::decode(&kv.value))
                .unwrap_or_default();
            let rec = old.with(entry.clone(), now, keep_old);
            let value = serde_json::to_vec(&rec).map_err(|e| ApiError::internal(e.to_string()))?;
            let res = match &cur {
                Some(kv) => store.update(&key, value, kv.mod_revision).await,
                None => store.create(&key, value).await,
            };
            match res {
                Ok(_) => {
                    self.put(node, Some(&rec));
                    return Ok(());
                }
                Err(StoreError::Conflict { .. } | StoreError::AlreadyExists(_)) => continue,
                Err(e) => return Err(ApiError::from_store(e)),
            }
        }
        Err(ApiError::new(
            409,
            "Conflict",
            format!("recording the certificate of node {node:?}: too many concurrent writes"),
        ))
    }

    async fn load(&self, store: &dyn Store) -> Result<Revision, StoreError> {
        let list = store.list(CERTS_PREFIX, ListOptions::default()).await?;
        let mut m = HashMap::new();
        for kv in &list.items {
            if let (Some(node), Some(r)) =
                (kv.key.strip_prefix(CERTS_PREFIX), Record::decode(&kv.value))
            {
                m.insert(node.to_string(), r.hashes());
            }
        }
        *self.valid.write().unwrap_or_else(|p| p.into_inner()) = m;
        Ok(list.revision)
    }

    /// Loads every record once (before the server answers requests).
    pub async fn prime(&self, store: &dyn Store) -> Result<(), StoreError> {
        self.load(store).await.map(|_| ())
    }

    /// Keeps the cache current until `shutdown` (a failed watch: list and watch again).
    pub async fn run(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) {
        let (this, st) = (&*self, store.as_ref());
        let w = super::watchloop::Watched {
            store: st,
            prefix: CERTS_PREFIX,
            what: "node certificate cache",
        };
        super::watchloop::follow(
            w,
            shutdown,
            move || async move { this.load(st).await },
            move |batch: Vec<ferrovirt_store::WatchEvent>| async move {
                for ev in batch {
                    let Some(node) = ev.kv.key.strip_prefix(CERTS_PREFIX) else {
                        continue;
                    };
                    match ev.kind {
                        EventKind::Deleted => this.put(node, None),
                        _ => this.put(node, Record::decode(&ev.kv.value).as_ref()),
                    }
                }
            },
        )
        .await
    }
}

/// Deletes the password and certificate records of every Node deleted from now on, until
/// `shutdown` (a failed watch is opened again from the current revision).
pub async fn forget_deleted_nodes(
    store: Arc<dyn Store>,
    shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let st = store.as_ref();
    let w = super::watchloop::Watched {
        store: st,
        prefix: NODES_PREFIX,
        what: "node records",
    };
    super::watchloop::follow(
        w,
        shutdown,
        move || async move { st.current_revision().await },
        move |batch: Vec<ferrovirt_store::WatchEvent>| async move {
            for ev in batch {
                if ev.kind != EventKind::Deleted {
                    continue;
                }
                if let Some(node) = ev.kv.key.strip_prefix(NODES_PREFIX) {
                    forget(st, node).await;
                }
            }
        },
    )
    .await
}

/// The names that have records but no Node, with their records' latest revision (pure).
pub fn orphans(
    records: &BTreeMap<String, Revision>,
    nodes: &BTreeSet<String>,
) -> BTreeMap<String, Revision> {
    records
        .iter()
        .filter(|(n, _)| !nodes.contains(*n))
        .map(|(n, r)| (n.clone(), *r))
        .collect()
}

/// Every name with a password or certificate record → the newer record's `mod_revision`.
async fn record_revisions(store: &dyn Store) -> Result<BTreeMap<String, Revision>, StoreError> {
    let mut m: BTreeMap<String, Revision> = BTreeMap::new();
    for prefix in [PASSWORDS_PREFIX, CERTS_PREFIX] {
        for kv in store.list(prefix, ListOptions::default()).await?.items {
            if let Some(name) = kv.key.strip_prefix(prefix) {
                let r = m.entry(name.to_string()).or_default();
                *r = (*r).max(kv.mod_revision);
            }
        }
    }
    Ok(m)
}

async fn node_names(store: &dyn Store) -> Result<BTreeSet<String>, StoreError> {
    Ok(store
        .list(NODES_PREFIX, ListOptions::default())
        .await?
        .items
        .into_iter()
        .filter_map(|kv| kv.key.strip_prefix(NODES_PREFIX).map(String::from))
        .collect())
}

/// Deletes the records of every name that has no Node, seen unchanged across `grace` (a
/// record written meanwhile — a join whose Node is about to be created — is kept, as is any
/// name whose Node appeared): the Nodes deleted while no server watched, which
/// [`forget_deleted_nodes`] cannot see. Returns the names forgotten.
pub async fn sweep_orphans(store: &dyn Store, grace: Duration) -> Result<Vec<String>, StoreError> {
    let candidates = orphans(&record_revisions(store).await?, &node_names(store).await?);
    if candidates.is_empty() {
        return Ok(Vec::new());
    }
    tokio::time::sleep(grace).await;
    let now = record_revisions(store).await?;
    let still = orphans(&now, &node_names(store).await?);
    let mut gone = Vec::new();
    for (name, rev) in candidates {
        if still.get(&name) == Some(&rev) {
            tracing::info!(node = %name, "no Node of this name: forgetting its node records");
            forget(store, &name).await;
            gone.push(name);
        }
    }
    Ok(gone)
}

/// Deletes both records of `node` (absent ones are fine).
pub async fn forget(store: &dyn Store, node: &str) {
    for key in [super::join::password_key(node), certs_key(node)] {
        match store.delete(&key, None).await {
            Ok(_) => tracing::info!(%node, "Node deleted: removed {key}"),
            Err(StoreError::NotFound(_)) => {}
            Err(e) => tracing::warn!(%node, "Node deleted, but removing {key} failed: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(h: u8, not_after: i64) -> Entry {
        Entry {
            sha256: hex(&[h; 32]),
            not_after,
        }
    }

    #[test]
    fn a_join_replaces_and_a_renewal_keeps_the_unexpired() {
        let r = Record::default().with(e(1, 100), 0, false);
        assert!(r.allows(&[1; 32]) && !r.allows(&[2; 32]));
        let renewed = r.with(e(2, 200), 50, true);
        assert!(renewed.allows(&[1; 32]) && renewed.allows(&[2; 32]));
        // Expired entries are dropped at the next write.
        let later = renewed.with(e(3, 300), 150, true);
        assert!(!later.allows(&[1; 32]) && later.allows(&[2; 32]) && later.allows(&[3; 32]));
        // A join drops everything else.
        let joined = later.with(e(4, 400), 150, false);
        assert_eq!(joined.certificates, vec![e(4, 400)]);
        assert_eq!(joined.hashes(), vec![[4; 32]]);
        assert_eq!(certs_key("n1"), "/ferrovirt/node-certs/n1");
        assert_eq!(node_of_user("system:node:n1"), Some("n1"));
        assert_eq!(node_of_user("system:node:"), None);
        assert_eq!(node_of_user("alice"), None);
    }

    /// The per-request cost of the check on a cache hit: SHA-256 of a node certificate's DER
    /// and the look-up (docs/nodes.md reports the number).
    #[tokio::test]
    async fn cached_check_cost() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = ferrovirt_store::open_endpoint("", dir.path())
            .await
            .unwrap();
        let ca = super::super::certs::load_or_create(dir.path()).unwrap();
        let (pem, _) = ca.issue("system:node:n1", &[], 1).unwrap();
        let der = crate::tls::pem_blocks(&pem, "CERTIFICATE").remove(0);
        let certs = NodeCerts::default();
        let err = certs.check(store.as_ref(), "n1", &der).await.unwrap_err();
        assert_eq!(err.code, 401);
        assert!(err.message.contains("no longer valid"), "{}", err.message);
        certs
            .record(store.as_ref(), "n1", &der, i64::MAX, false)
            .await
            .unwrap();
        certs.check(store.as_ref(), "n1", &der).await.unwrap();
        // Another node's name with this certificate is refused.
        assert!(certs.check(store.as_ref(), "n2", &der).await.is_err());
        let n = 20_000;
        let t = std::time::Instant::now();
        for _ in 0..n {
            certs.check(store.as_ref(), "n1", &der).await.unwrap();
        }
        let per = t.elapsed() / n;
        eprintln!(
            "node certificate check (cache hit, {} byte DER): {per:?} per request",
            der.len()
        );
        assert!(per < std::time::Duration::from_millis(1), "{per:?}");
        // Forgetting the node removes the record; the store look-up then refuses.
        forget(store.as_ref(), "n1").await;
        certs.put("n1", None);
        assert!(certs.check(store.as_ref(), "n1", &der).await.is_err());
    }

    /// Records of a name without a Node go after the grace; a Node's stay, and so does a
    /// record written during the grace (a join in progress).
    #[tokio::test]
    async fn orphaned_records_are_swept_after_the_grace() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = ferrovirt_store::open_endpoint("", dir.path())
            .await
            .unwrap();
        store
            .create(&format!("{NODES_PREFIX}n1"), b"{}".to_vec())
            .await
            .unwrap();
        for n in ["n1", "n2", "n3"] {
            store
                .create(&super::super::join::password_key(n), b"x".to_vec())
                .await
                .unwrap();
            store.create(&certs_key(n), b"{}".to_vec()).await.unwrap();
        }
        let sweep = {
            let store = store.clone();
            tokio::spawn(
                async move { sweep_orphans(store.as_ref(), Duration::from_millis(400)).await },
            )
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        let n3 = store.get(&certs_key("n3")).await.unwrap().unwrap();
        store
            .update(&certs_key("n3"), b"{ }".to_vec(), n3.mod_revision)
            .await
            .unwrap();
        let gone = sweep.await.unwrap().unwrap();
        assert_eq!(gone, ["n2"]);
        for (n, kept) in [("n1", true), ("n2", false), ("n3", true)] {
            let p = store
                .get(&super::super::join::password_key(n))
                .await
                .unwrap();
            let c = store.get(&certs_key(n)).await.unwrap();
            assert_eq!((p.is_some(), c.is_some()), (kept, kept), "{n}");
        }
        let nodes: BTreeSet<String> = ["a".to_string()].into();
        let recs: BTreeMap<String, Revision> = [("a".to_string(), 1), ("b".to_string(), 2)].into();
        assert_eq!(orphans(&recs, &nodes), [("b".to_string(), 2)].into());
    }
}
