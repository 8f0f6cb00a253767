//! Reflector caches shared by the controllers: one list-then-watch per kind (kube-rs watcher
//! with its default backoff) for Nodes, node Leases (namespace `kube-node-lease`),
//! PersistentVolumes, PersistentVolumeClaims, StorageClasses and VMIs, plus the KubeVirt CRs'
//! settings ([`Stores::kubevirt`], [`super::kubevirt_config`]: from a watch of `kubevirts`; a
//! change rings [`Kind::KubeVirt`], and the settings are not part of readiness). Reconcilers read these
//! instead of listing on every pass; loops that are not kube-runtime controllers wait on
//! [`Stores::changes`] to run when one of their kinds changed ([`Changes::next_batch`] also
//! says which kinds a wake-up's batch touched, so a loop can skip its pass over every VMI when
//! only Nodes or Leases changed).
//!
//! ```no_run
//! # async fn demo(client: kube::Client) {
//! use ferrovirt_controller::runtime::stores::{Kind, Stores};
//! let (stores, task) = Stores::start(client);
//! tokio::spawn(task); // drives the watches
//! stores.ready().await;
//! let mut changes = stores.changes();
//! let nodes = stores.nodes.state(); // no API request
//! let _ = changes.wait_for(&[Kind::Node, Kind::Lease]).await;
//! # let _ = nodes; }
//! ```

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::Api;
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::{WatchStreamExt, watcher};

use ferrovirt_api::kubevirt::overcommit::Overcommit;

use super::changes::Announcer;
pub use super::changes::{Changed, Changes};
use super::kubevirt_config::{self, KubeVirtConfig};
use super::resources::Vmi;
use super::vmi_index::VmiIndex;
use crate::node_lifecycle::NODE_LEASE_NAMESPACE;

/// The kinds cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Node,
    Lease,
    PersistentVolume,
    PersistentVolumeClaim,
    StorageClass,
    Vmi,
    /// The KubeVirt CRs' settings ([`KubeVirtConfig`]) changed.
    KubeVirt,
}

/// The shared caches (cheap to clone: every clone reads the same stores).
#[derive(Clone)]
pub struct Stores {
    pub nodes: Store<Node>,
    /// Node Leases (`kube-node-lease`), by node name.
    pub leases: Store<Lease>,
    pub pvs: Store<PersistentVolume>,
    pub pvcs: Store<PersistentVolumeClaim>,
    pub classes: Store<StorageClass>,
    pub vmis: Store<Vmi>,
    /// Which cached VMIs wait for a node or are marked for evacuation ([`super::vmi_index`]),
    /// kept from the VMI cache's events; read with [`Stores::vmi_index`].
    vmi_index: Arc<std::sync::Mutex<VmiIndex>>,
    /// The KubeVirt CRs' settings (the defaults until the first CR is seen).
    pub kubevirt: tokio::sync::watch::Receiver<Arc<KubeVirtConfig>>,
    changed: Announcer,
    /// True once every cache holds its first complete list. kube-rs's
    /// `Store::wait_until_ready` wakes only one of several tasks waiting at once (its oneshot
    /// keeps the last waker), so one task waits there and everyone else waits here.
    ready: tokio::sync::watch::Receiver<bool>,
}

impl std::fmt::Debug for Stores {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stores").finish_non_exhaustive()
    }
}

/// Drives one reflector, announcing every event as `kind` after `on_event` saw it (the cache
/// has applied it by then).
async fn drive<K>(
    api: Api<K>,
    writer: reflector::store::Writer<K>,
    kind: Kind,
    changed: Announcer,
    mut on_event: impl FnMut(&watcher::Event<K>),
) where
    K: kube::Resource
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Default,
{
    let mut events = reflector(
        writer,
        watcher(api, watcher::Config::default()).default_backoff(),
    )
    .boxed();
    while let Some(ev) = events.next().await {
        if let Ok(e) = &ev {
            on_event(e);
        }
        match ev {
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
            Ok(_) => {
                changed.send(kind);
            }
            Err(e) => tracing::warn!(?kind, error = %e, "watch of the shared cache failed"),
        }
    }
}

/// `m` locked (a panic elsewhere while it was held leaves the index usable: every update is
/// one set operation).
fn lock(m: &std::sync::Mutex<VmiIndex>) -> std::sync::MutexGuard<'_, VmiIndex> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Stores {
    /// The caches and the future that keeps them (runs until dropped).
    pub fn start(
        client: kube::Client,
    ) -> (
        Stores,
        impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let (nodes, nodes_w) = reflector::store::<Node>();
        let (leases, leases_w) = reflector::store::<Lease>();
        let (pvs, pvs_w) = reflector::store::<PersistentVolume>();
        let (pvcs, pvcs_w) = reflector::store::<PersistentVolumeClaim>();
        let (classes, classes_w) = reflector::store::<StorageClass>();
        let (vmis, vmis_w) = reflector::store::<Vmi>();
        let changed = Announcer::new();
        let (ready_tx, ready) = tokio::sync::watch::channel(false);
        let (kubevirt_tx, kubevirt) = tokio::sync::watch::channel(Arc::default());
        let vmi_index = Arc::new(std::sync::Mutex::new(VmiIndex::default()));
        let index_w = vmi_index.clone();
        let stores = Stores {
            nodes,
            leases,
            pvs,
            pvcs,
            classes,
            vmis,
            vmi_index,
            kubevirt,
            changed: changed.clone(),
            ready,
        };
        let waiter = stores.clone();
        let c = client;
        let task = async move {
            let announce = async move {
                // The one waiter on each cache's readiness.
                let _ = waiter.nodes.wait_until_ready().await;
                let _ = waiter.leases.wait_until_ready().await;
                let _ = waiter.pvs.wait_until_ready().await;
                let _ = waiter.pvcs.wait_until_ready().await;
                let _ = waiter.classes.wait_until_ready().await;
                let _ = waiter.vmis.wait_until_ready().await;
                let _ = ready_tx.send(true);
                // Keep the sender, so waiters never see a closed channel.
                std::future::pending::<()>().await;
            };
            // One task per watch (a JoinSet: dropping this future aborts them): a joined
            // future would poll every watch's stream stack whenever any one of them is woken,
            // i.e. all of them on every Lease renewal.
            let mut watches = tokio::task::JoinSet::new();
            watches.spawn(announce);
            watches.spawn(drive(
                Api::<Node>::all(c.clone()),
                nodes_w,
                Kind::Node,
                changed.clone(),
                |_| {},
            ));
            watches.spawn(drive(
                Api::<Lease>::namespaced(c.clone(), NODE_LEASE_NAMESPACE),
                leases_w,
                Kind::Lease,
                changed.clone(),
                |_| {},
            ));
            watches.spawn(drive(
                Api::<PersistentVolume>::all(c.clone()),
                pvs_w,
                Kind::PersistentVolume,
                changed.clone(),
                |_| {},
            ));
            watches.spawn(drive(
                Api::<PersistentVolumeClaim>::all(c.clone()),
                pvcs_w,
                Kind::PersistentVolumeClaim,
                changed.clone(),
                |_| {},
            ));
            watches.spawn(drive(
                Api::<StorageClass>::all(c.clone()),
                classes_w,
                Kind::StorageClass,
                changed.clone(),
                |_| {},
            ));
            watches.spawn(drive(
                Api::<Vmi>::all(c.clone()),
                vmis_w,
                Kind::Vmi,
                changed.clone(),
                move |e| lock(&index_w).apply(e),
            ));
            watches.spawn(kubevirt_config::follow(
                c.clone(),
                kubevirt_tx,
                changed.clone(),
            ));
            while watches.join_next().await.is_some() {}
        };
        (stores, task)
    }

    /// The index of waiting and evacuating VMIs as of the cache's last event (held locked:
    /// keep the guard for no longer than a look).
    pub fn vmi_index(&self) -> std::sync::MutexGuard<'_, VmiIndex> {
        lock(&self.vmi_index)
    }

    /// The KubeVirt CRs' overcommit settings now.
    pub fn overcommit(&self) -> Overcommit {
        self.kubevirt.borrow().overcommit
    }

    /// The KubeVirt CRs' obsolete CPU models now.
    pub fn obsolete_cpu_models(&self) -> std::collections::BTreeSet<String> {
        self.kubevirt.borrow().obsolete_cpu_models.clone()
    }

    /// The KubeVirt CRs' settings now.
    pub fn kubevirt(&self) -> Arc<KubeVirtConfig> {
        self.kubevirt.borrow().clone()
    }

    /// Subscribes to changes (from now on).
    pub fn changes(&self) -> Changes {
        self.changed.subscribe()
    }

    /// Waits until every cache holds its first complete list.
    pub async fn ready(&self) {
        let mut ready = self.ready.clone();
        let _ = ready.wait_for(|r| *r).await;
    }

    /// Whether every cache holds its first complete list (never waits).
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// The cached claim `ns/name`.
    pub fn pvc(&self, ns: &str, name: &str) -> Option<Arc<PersistentVolumeClaim>> {
        self.pvcs.get(&reflector::ObjectRef::new(name).within(ns))
    }

    /// Every cached PersistentVolume (cloned out of the cache).
    pub fn pv_list(&self) -> Vec<PersistentVolume> {
        self.pvs.state().iter().map(|p| (**p).clone()).collect()
    }

    /// Every cached StorageClass (cloned out of the cache).
    pub fn class_list(&self) -> Vec<StorageClass> {
        self.classes.state().iter().map(|c| (**c).clone()).collect()
    }

    /// Every cached Node (cloned out of the cache).
    pub fn node_list(&self) -> Vec<Node> {
        self.nodes.state().iter().map(|n| (**n).clone()).collect()
    }
}
