//! The ServiceAccounts a token may still name, in memory: the uid of every ServiceAccount
//! that exists and is not being deleted, from one list and a watch of the store, so that a
//! request with a ServiceAccount token costs no store read (as Kubernetes' token
//! authenticator reads its ServiceAccounts from an informer). A token whose account is not in
//! the cache, or is there with another uid, is checked against the store as before (the
//! cache is never written from a request, only by the watch, in order); an account deleted
//! (or marked for deletion) stops authenticating its tokens once the watch delivers the
//! change (milliseconds), the informer's lag in Kubernetes.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use ferrovirt_store::{EventKind, ListOptions, Revision, Store, StoreError};
use serde_json::Value;

/// Store prefix of ServiceAccounts.
const PREFIX: &str = "/registry/core/serviceaccounts/";

/// ServiceAccount store key (`<ns>/<name>` under [`PREFIX`]) → uid of those not deleting.
#[derive(Debug, Default)]
pub struct ServiceAccounts {
    uids: RwLock<HashMap<String, String>>,
}

/// The uid a token may name for this stored ServiceAccount (pure): none once it is being
/// deleted.
fn live_uid(sa: &Value) -> Option<String> {
    if sa["metadata"]["deletionTimestamp"].is_string() {
        return None;
    }
    sa["metadata"]["uid"].as_str().map(String::from)
}

impl ServiceAccounts {
    /// Whether the cache shows the ServiceAccount at store key `key` with `uid`, not being
    /// deleted.
    pub fn known(&self, key: &str, uid: &str) -> bool {
        self.uids
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .is_some_and(|u| u == uid)
    }

    fn put(&self, key: &str, uid: Option<String>) {
        let mut m = self.uids.write().unwrap_or_else(|p| p.into_inner());
        match uid {
            Some(u) => {
                m.insert(key.to_string(), u);
            }
            None => {
                m.remove(key);
            }
        }
    }

    async fn load(&self, store: &dyn Store) -> Result<Revision, StoreError> {
        let list = store.list(PREFIX, ListOptions::default()).await?;
        let mut m = HashMap::new();
        for kv in &list.items {
            if let Some(uid) = crate::objects::decode(kv).ok().as_ref().and_then(live_uid) {
                m.insert(kv.key.clone(), uid);
            }
        }
        *self.uids.write().unwrap_or_else(|p| p.into_inner()) = m;
        Ok(list.revision)
    }

    /// Keeps the cache current until `shutdown` (a failed watch: list and watch again). Until
    /// the first list the cache is empty and every token is checked against the store.
    pub async fn run(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) {
        let (this, st) = (&*self, store.as_ref());
        let w = super::watchloop::Watched {
            store: st,
            prefix: PREFIX,
            what: "ServiceAccount cache",
        };
        super::watchloop::follow(
            w,
            shutdown,
            move || async move {
                let loaded = this.load(st).await;
                if loaded.is_err() {
                    // Entries may be stale while the store cannot be read: drop them all, so
                    // that every token is checked against the store meanwhile.
                    this.uids.write().unwrap_or_else(|p| p.into_inner()).clear();
                }
                loaded
            },
            move |batch: Vec<ferrovirt_store::WatchEvent>| async move {
                for ev in batch {
                    let uid = match ev.kind {
                        EventKind::Deleted => None,
                        _ => crate::objects::decode(&ev.kv)
                            .ok()
                            .as_ref()
                            .and_then(live_uid),
                    };
                    this.put(&ev.kv.key, uid);
                }
            },
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn a_deleting_account_names_no_uid() {
        assert_eq!(
            super::live_uid(&json!({"metadata": {"uid": "u1"}})),
            Some("u1".into())
        );
        assert_eq!(
            super::live_uid(
                &json!({"metadata": {"uid": "u1", "deletionTimestamp": "2026-01-01T00:00:00Z"}})
            ),
            None
        );
        assert_eq!(super::live_uid(&json!({"metadata": {}})), None);
    }

    #[test]
    fn known_only_with_the_same_uid() {
        let c = super::ServiceAccounts::default();
        c.put("/registry/core/serviceaccounts/a/robot", Some("u1".into()));
        assert!(c.known("/registry/core/serviceaccounts/a/robot", "u1"));
        assert!(!c.known("/registry/core/serviceaccounts/a/robot", "u2"));
        assert!(!c.known("/registry/core/serviceaccounts/b/robot", "u1"));
        c.put("/registry/core/serviceaccounts/a/robot", None);
        assert!(!c.known("/registry/core/serviceaccounts/a/robot", "u1"));
    }
}
