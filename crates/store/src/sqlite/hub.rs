//! Live-event routing of the SQLite backend: one broadcast channel per resource, so that a
//! write wakes only the watch streams that can want it.
//!
//! With a single channel, every committed write woke every watch stream of the process to have
//! it compare the key with its prefix and go back to sleep: at 100 nodes, each Lease renewal
//! woke the hundred node agents' VMI watches and every controller watch. Here an event goes to
//! the channel of its key's [`route`] (the first three path segments,
//! `/registry/<group>/<resource>/`), and a stream whose prefix names a resource subscribes to
//! that channel only. Prefixes shorter than a route (tests, tools watching everything) use the
//! channel that carries every event. Each channel delivers in commit order, so every stream
//! still sees its events in revision order; a stream that lags on its channel catches up from
//! the log table as before ([`super::watch`]).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use tokio::sync::broadcast;

use crate::WatchEvent;

/// Path segments in a route: `/registry/<group>/<resource>/`.
const ROUTE_SLASHES: usize = 4;

/// The route of a key or prefix: everything up to and including its fourth `/`; `None` when it
/// has fewer. A key starting with a prefix that has a route has the same route.
pub(super) fn route(key: &str) -> Option<&str> {
    key.match_indices('/')
        .nth(ROUTE_SLASHES - 1)
        .map(|(i, _)| &key[..=i])
}

/// The channels.
pub(super) struct Hub {
    capacity: usize,
    /// Every event, for streams whose prefix has no route.
    all: broadcast::Sender<Arc<WatchEvent>>,
    routes: RwLock<HashMap<String, broadcast::Sender<Arc<WatchEvent>>>>,
}

impl Hub {
    /// Channels of `capacity` events each (a stream further behind catches up from the log).
    pub fn new(capacity: usize) -> Hub {
        Hub {
            capacity,
            all: broadcast::channel(capacity).0,
            routes: RwLock::new(HashMap::new()),
        }
    }

    /// Publishes a committed event to the streams that may want it.
    pub fn publish(&self, event: WatchEvent) {
        let event = Arc::new(event);
        if let Some(r) = route(&event.kv.key) {
            let routes = self.routes.read().unwrap_or_else(|p| p.into_inner());
            if let Some(tx) = routes.get(r) {
                // No receivers is fine: nobody is watching.
                let _ = tx.send(Arc::clone(&event));
            }
        }
        if self.all.receiver_count() > 0 {
            let _ = self.all.send(event);
        }
    }

    /// A receiver of every event whose key may start with `prefix`.
    pub fn subscribe(&self, prefix: &str) -> broadcast::Receiver<Arc<WatchEvent>> {
        match route(prefix) {
            None => self.all.subscribe(),
            Some(r) => {
                if let Some(tx) = self.routes.read().unwrap_or_else(|p| p.into_inner()).get(r) {
                    return tx.subscribe();
                }
                self.routes
                    .write()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(r.to_owned())
                    .or_insert_with(|| broadcast::channel(self.capacity).0)
                    .subscribe()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Hub, route};
    use crate::{EventKind, KeyValue, WatchEvent};

    #[test]
    fn routes_are_the_first_three_segments() {
        let vmis = "/registry/kubevirt.io/virtualmachineinstances/";
        assert_eq!(route(vmis), Some(vmis));
        assert_eq!(route(&format!("{vmis}default/a")), Some(vmis));
        assert_eq!(route(&format!("{vmis}default/")), Some(vmis));
        assert_eq!(route("/registry/kubevirt.io/virtualmachineinstances"), None);
        assert_eq!(route("/registry/"), None);
        assert_eq!(route("/k"), None);
        assert_eq!(route(""), None);
    }

    fn event(key: &str, revision: i64) -> WatchEvent {
        WatchEvent {
            kind: EventKind::Created,
            revision,
            kv: KeyValue {
                key: key.into(),
                value: Vec::new(),
                create_revision: revision,
                mod_revision: revision,
            },
            prev: None,
        }
    }

    #[test]
    fn a_stream_gets_its_resource_and_the_catch_all_gets_everything() {
        let hub = Hub::new(16);
        let mut vmis = hub.subscribe("/registry/kubevirt.io/virtualmachineinstances/default/");
        let mut leases = hub.subscribe("/registry/coordination.k8s.io/leases/");
        let mut all = hub.subscribe("/registry/");
        hub.publish(event(
            "/registry/coordination.k8s.io/leases/kube-node-lease/n1",
            1,
        ));
        hub.publish(event(
            "/registry/kubevirt.io/virtualmachineinstances/default/a",
            2,
        ));
        hub.publish(event(
            "/registry/kubevirt.io/virtualmachineinstances/other/b",
            3,
        ));
        let revs = |rx: &mut tokio::sync::broadcast::Receiver<_>| {
            std::iter::from_fn(|| rx.try_recv().ok())
                .map(|e: std::sync::Arc<WatchEvent>| e.revision)
                .collect::<Vec<_>>()
        };
        // The VMI stream is not woken by the Lease; it filters other namespaces itself.
        assert_eq!(revs(&mut vmis), [2, 3]);
        assert_eq!(revs(&mut leases), [1]);
        assert_eq!(revs(&mut all), [1, 2, 3]);
    }
}
