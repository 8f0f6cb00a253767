//! Watch-fed caches of what a VMI start reads besides the VMI and its references: the
//! HyperConverged objects (node failure timing), the KubeVirt objects (the `HostDisk` feature
//! gate, the obsolete CPU models) and the CDI objects (insecure registries for containerDisk pulls), watched from the
//! agent's start, and every VMI of the cluster (the
//! duplicate-MAC check), watched from the first start of a VMI with an explicit MAC address
//! (most nodes never need it, and each agent holding every VMI costs memory). Either way a
//! start lists nothing: the watches list once when they begin, then follow events.
//!
//! Readiness is a `watch` channel set by the task that drives each reflector when its first
//! list is complete, so any number of starts can wait for it at once.

use std::sync::Arc;
use std::time::Duration;

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use futures::StreamExt;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::watcher::{self, watcher};
use serde_json::Value;
use tokio::sync::{OnceCell, watch};

use crate::error::AgentError;

/// How long a start waits for a cache's first list.
const READY_WAIT: Duration = Duration::from_secs(10);

/// Called with a cache's objects (as JSON) after each change its watch reports.
pub(super) type OnChange = Box<dyn Fn(&[Value]) + Send + Sync>;

/// One reflector cache of a resource, kept by a task of its own.
struct Cache {
    store: Store<DynamicObject>,
    ready: watch::Receiver<bool>,
}

impl Cache {
    fn spawn(client: Client, resource: ApiResource, on_change: Option<OnChange>) -> Cache {
        let writer = reflector::store::Writer::<DynamicObject>::new(resource.clone());
        let store = writer.as_reader();
        let reader = store.clone();
        let (set_ready, ready) = watch::channel(false);
        let api: Api<DynamicObject> = Api::all_with(client, &resource);
        tokio::spawn(async move {
            let mut events = reflector(writer, watcher(api, watcher::Config::default()))
                .default_backoff()
                .boxed();
            while let Some(ev) = events.next().await {
                match ev {
                    // The store changes at the end of a (re)list and with each later event.
                    Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
                    Ok(ev) => {
                        if matches!(ev, watcher::Event::InitDone) {
                            let _ = set_ready.send(true);
                        }
                        if let Some(f) = &on_change {
                            f(&values_of(&reader));
                        }
                    }
                    Err(e) => tracing::warn!("watching {}: {e}", resource.plural),
                }
            }
        });
        Cache { store, ready }
    }

    /// Whether the first list completed within `wait`.
    async fn wait_ready(&self, wait: Duration) -> bool {
        let mut rx = self.ready.clone();
        tokio::time::timeout(wait, rx.wait_for(|r| *r))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    fn values(&self) -> Vec<Value> {
        values_of(&self.store)
    }
}

fn values_of(store: &Store<DynamicObject>) -> Vec<Value> {
    store
        .state()
        .iter()
        .filter_map(|o| serde_json::to_value(&**o).ok())
        .collect()
}

fn resource(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

/// The agent's caches of configuration objects and (on demand) of every VMI.
pub(super) struct Caches {
    client: Client,
    /// Followed only for its `on_change` (the node failure timing); never read here.
    _hco: Cache,
    kubevirt: Cache,
    cdi: Cache,
    all_vmis: OnceCell<Arc<Cache>>,
}

impl Caches {
    /// Starts the HyperConverged, KubeVirt and CDI watches; `on_hco_change` sees the
    /// HyperConverged objects after each change, `on_kubevirt_change` the KubeVirt ones.
    pub(super) fn start(
        client: &Client,
        on_hco_change: OnChange,
        on_kubevirt_change: OnChange,
    ) -> Caches {
        Caches {
            client: client.clone(),
            _hco: Cache::spawn(
                client.clone(),
                resource(
                    "hco.kubevirt.io",
                    "v1beta1",
                    "HyperConverged",
                    "hyperconvergeds",
                ),
                Some(on_hco_change),
            ),
            kubevirt: Cache::spawn(
                client.clone(),
                resource("kubevirt.io", "v1", "KubeVirt", "kubevirts"),
                Some(on_kubevirt_change),
            ),
            cdi: Cache::spawn(
                client.clone(),
                resource("cdi.kubevirt.io", "v1beta1", "CDI", "cdis"),
                None,
            ),
            all_vmis: OnceCell::new(),
        }
    }

    /// The KubeVirt and CDI objects (as JSON). A cache whose first list has not
    /// completed within [`READY_WAIT`] counts as empty, as a failed read always did.
    pub(super) async fn kubevirt_and_cdi(&self) -> (Vec<Value>, Vec<Value>) {
        for (c, what) in [(&self.kubevirt, "kubevirts"), (&self.cdi, "cdis")] {
            if !c.wait_ready(READY_WAIT).await {
                tracing::warn!("the {what} cache is not filled yet: using what it holds");
            }
        }
        (self.kubevirt.values(), self.cdi.values())
    }

    /// Every VMI of the cluster, from a watch started on the first call.
    pub(super) async fn all_vmis(&self) -> Result<Vec<VirtualMachineInstance>, AgentError> {
        let cache = self
            .all_vmis
            .get_or_init(|| async {
                Arc::new(Cache::spawn(
                    self.client.clone(),
                    resource(
                        "kubevirt.io",
                        "v1",
                        "VirtualMachineInstance",
                        "virtualmachineinstances",
                    ),
                    None,
                ))
            })
            .await;
        if !cache.wait_ready(READY_WAIT).await {
            return Err(AgentError::Reference(
                "the cluster's VMIs (for the duplicate-MAC check) are not known yet".into(),
            ));
        }
        Ok(cache
            .values()
            .into_iter()
            .filter_map(|v| serde_json::from_value(v).ok())
            .collect())
    }
}
