//! The authorizer's view of RBAC objects: every Role, ClusterRole, RoleBinding and
//! ClusterRoleBinding kept in memory from one list followed by a watch of the store (no
//! store read per request), rebuilt into a [`Policy`] index after each change and swapped in
//! whole. A failed watch is answered by a new list and watch.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use ferrovirt_store::{EventKind, ListOptions, Revision, Store};
use serde_json::Value;

use super::rbac::Policy;

/// Store prefix of every RBAC kind.
pub const RBAC_PREFIX: &str = "/registry/rbac.authorization.k8s.io/";

/// The current policy, shared by every request.
#[derive(Debug, Default)]
pub struct PolicyCache {
    current: RwLock<Arc<Policy>>,
}

/// The RBAC objects by store key.
#[derive(Debug, Default)]
struct Objects(BTreeMap<String, Value>);

impl Objects {
    fn policy(&self) -> Policy {
        let of = |plural: &str| -> Vec<Value> {
            let prefix = format!("{RBAC_PREFIX}{plural}/");
            self.0
                .range(prefix.clone()..)
                .take_while(|(k, _)| k.starts_with(&prefix))
                .map(|(_, v)| v.clone())
                .collect()
        };
        Policy::from_json(
            &of("roles"),
            &of("clusterroles"),
            &of("rolebindings"),
            &of("clusterrolebindings"),
        )
    }

    fn put(&mut self, key: &str, value: &[u8]) {
        match serde_json::from_slice::<Value>(value) {
            Ok(v) => {
                self.0.insert(key.to_string(), v);
            }
            Err(e) => tracing::warn!("rbac cache: {key} does not decode: {e}"),
        }
    }
}

impl PolicyCache {
    /// The policy as of the last change seen.
    pub fn get(&self) -> Arc<Policy> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set(&self, p: Policy) {
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(p);
    }

    /// Lists every RBAC object and builds the policy; returns the objects and the revision to
    /// watch from.
    async fn load(
        &self,
        store: &dyn Store,
    ) -> Result<(Objects, Revision), ferrovirt_store::StoreError> {
        let list = store.list(RBAC_PREFIX, ListOptions::default()).await?;
        let mut objs = Objects::default();
        for kv in &list.items {
            objs.put(&kv.key, &kv.value);
        }
        self.set(objs.policy());
        Ok((objs, list.revision))
    }

    /// Loads the policy once (before the server answers requests).
    pub async fn prime(&self, store: &dyn Store) -> Result<Revision, ferrovirt_store::StoreError> {
        self.load(store).await.map(|(_, rev)| rev)
    }

    /// Keeps the policy current until `shutdown` (one rebuild per batch of events).
    pub async fn run(
        self: Arc<Self>,
        store: Arc<dyn Store>,
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) {
        let objs = std::sync::Mutex::new(Objects::default());
        let (this, st, objs) = (&*self, store.as_ref(), &objs);
        let w = super::watchloop::Watched {
            store: st,
            prefix: RBAC_PREFIX,
            what: "rbac cache",
        };
        super::watchloop::follow(
            w,
            shutdown,
            move || async move {
                let (loaded, rev) = this.load(st).await?;
                *objs.lock().unwrap_or_else(|p| p.into_inner()) = loaded;
                Ok(rev)
            },
            move |batch: Vec<ferrovirt_store::WatchEvent>| async move {
                let mut objs = objs.lock().unwrap_or_else(|p| p.into_inner());
                for ev in batch {
                    match ev.kind {
                        EventKind::Deleted => {
                            objs.0.remove(&ev.kv.key);
                        }
                        _ => objs.put(&ev.kv.key, &ev.kv.value),
                    }
                }
                this.set(objs.policy());
            },
        )
        .await
    }
}
