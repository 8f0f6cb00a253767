//! A reflector store of one kind plus the future that keeps it and calls back on every change
//! (the pattern of the loops that wake on a watch besides the shared caches: evacuation,
//! migration, storage protection).

use std::future::Future;

use futures::StreamExt;
use kube::Resource;
use kube::api::Api;
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use serde::de::DeserializeOwned;

/// A store of every `K` that `api` lists, and the future that fills it from a watch and calls
/// `on_change` after each event (an error is logged with `what`, then also counted as a
/// change: the watch restarts with backoff and relists). The future ends with the watch.
pub fn watched_store<K>(
    api: Api<K>,
    what: &'static str,
    mut on_change: impl FnMut() + Send,
) -> (Store<K>, impl Future<Output = ()> + Send)
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
{
    let (store, writer) = reflector::store::<K>();
    let stream = reflector(
        writer,
        watcher(api, watcher::Config::default()).default_backoff(),
    )
    .touched_objects();
    let pump = async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            if let Err(e) = item {
                tracing::warn!(error = %e, "{what} watch error");
            }
            on_change();
        }
    };
    (store, pump)
}
