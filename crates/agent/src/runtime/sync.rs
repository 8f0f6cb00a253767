//! The agent's view of its VMIs: a reflector cache of a watch on the VMIs bound to this node
//! (`status.nodeName=<node>`) and the sync loop that reconciles them from that cache — one VMI
//! per watch event, every cached VMI on a wake-up or the periodic resync (which only looks at
//! the local launchers). Nothing here lists VMIs after the watch's first list.

use std::collections::HashSet;
use std::sync::Arc;

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use kube::api::{Api, DynamicObject};
use kube::runtime::reflector::{self, ObjectRef, Store, reflector};
use kube::runtime::watcher::{self, watcher};

use super::{Agent, vmi_resource};

/// Why the sync loop runs a pass.
pub(super) enum Trigger {
    /// A watch event for this VMI (added, changed or deleted), and when the watch delivered it
    /// (CLOCK_BOOTTIME µs, [`ferrovirt_launcher::timing`]).
    Vmi(Box<ObjectRef<DynamicObject>>, u64),
    /// Every VMI bound here, from the cache: the periodic requeue, a relist, a launcher that
    /// came up.
    All,
}

/// Reconciles the VMIs bound to this node from the reflector cache (never an API list): one
/// VMI per watch event, every cached VMI on [`Agent::wake`] and every
/// [`super::AgentOptions::resync_interval`] (which only looks at the local launchers; API writes
/// happen only when [`crate::decide::decide`] finds something to change).
pub(super) async fn sync_loop(
    agent: Arc<Agent>,
    vmis: Store<DynamicObject>,
    mut events: tokio::sync::mpsc::UnboundedReceiver<Trigger>,
) {
    // Nothing runs before the first complete list: an empty cache would make every local
    // launcher look orphaned.
    if vmis.wait_until_ready().await.is_err() {
        return; // the watch task is gone: the agent stops
    }
    let mut resync = tokio::time::interval(agent.opts.resync_interval);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let mut dirty: Vec<(ObjectRef<DynamicObject>, u64)> = Vec::new();
        let mut all = false;
        tokio::select! {
            ev = events.recv() => match ev {
                Some(Trigger::Vmi(r, seen)) => dirty.push((*r, seen)),
                Some(Trigger::All) => all = true,
                None => return,
            },
            _ = agent.wake.notified() => all = true,
            _ = resync.tick() => all = true,
        }
        // Coalesce whatever else is queued.
        while let Ok(ev) = events.try_recv() {
            match ev {
                Trigger::Vmi(r, seen) => dirty.push((*r, seen)),
                Trigger::All => all = true,
            }
        }
        agent.launchers.lock().await.reap();
        if all {
            let cached = vmis.state();
            let mut known = HashSet::new();
            let mut bound = HashSet::new();
            for obj in &cached {
                if let Some(uid) = &obj.metadata.uid {
                    known.insert(uid.clone());
                    if obj.data["status"]["nodeName"] == agent.opts.node_name.as_str() {
                        bound.insert(uid.clone());
                    }
                }
            }
            *agent.bound_uids.lock().unwrap_or_else(|p| p.into_inner()) = bound;
            let now = ferrovirt_launcher::timing::boottime_us();
            for obj in cached {
                agent.reconcile_cached(&obj, now).await;
            }
            agent.collect_orphans(&known).await;
            agent.forget_moved(&known);
        } else {
            // Per VMI, once, with its earliest event's time.
            dirty.sort_by(|(a, ta), (b, tb)| {
                (&a.namespace, &a.name, ta).cmp(&(&b.namespace, &b.name, tb))
            });
            dirty.dedup_by(|(a, _), (b, _)| a == b);
            let mut gone = false;
            for (r, seen) in dirty {
                match vmis.get(&r) {
                    Some(obj) => agent.reconcile_cached(&obj, seen).await,
                    None => gone = true,
                }
            }
            if gone {
                // A deleted VMI: stop and remove what is left of it.
                let known = vmis
                    .state()
                    .iter()
                    .filter_map(|o| o.metadata.uid.clone())
                    .collect();
                agent.collect_orphans(&known).await;
                agent.forget_moved(&known);
            }
        }
    }
}

impl Agent {
    /// Reconciles one cached VMI, if it is (still) bound to this node; `seen_us`: when its
    /// watch event arrived (the start path's first agent step).
    async fn reconcile_cached(self: &Arc<Self>, obj: &DynamicObject, seen_us: u64) {
        let Ok(vmi) =
            serde_json::to_value(obj).and_then(serde_json::from_value::<VirtualMachineInstance>)
        else {
            return;
        };
        let bound_here = vmi.status.as_ref().and_then(|s| s.node_name.as_deref())
            == Some(self.opts.node_name.as_str());
        if bound_here {
            if let Some(uid) = &vmi.metadata.uid {
                self.bound_uids
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(uid.clone());
            }
            self.reconcile(vmi, seen_us).await;
        }
    }
}

/// The field selector of this node's VMIs: a VMI not yet bound here is not its business; the
/// scheduler's bind (`status.nodeName`) brings it into the watch as ADDED, and one moved away
/// or deleted leaves it as DELETED.
pub fn vmi_selector(node: &str) -> String {
    format!("status.nodeName={node}")
}

/// Keeps the reflector cache of this node's VMIs (list once, then watch, with kube-rs' default
/// backoff on errors) and turns its events into [`Trigger`]s.
pub(super) async fn watch_vmis(
    agent: Arc<Agent>,
    writer: reflector::store::Writer<DynamicObject>,
    triggers: tokio::sync::mpsc::UnboundedSender<Trigger>,
) {
    use futures::StreamExt;
    use kube::runtime::WatchStreamExt;
    let api: Api<DynamicObject> = Api::all_with(agent.client.clone(), &vmi_resource());
    let cfg = watcher::Config::default().fields(&vmi_selector(&agent.opts.node_name));
    let resource = vmi_resource();
    let mut events = reflector(writer, watcher(api, cfg).default_backoff()).boxed();
    while let Some(ev) = events.next().await {
        let trigger = match ev {
            Ok(watcher::Event::Apply(obj) | watcher::Event::Delete(obj)) => Trigger::Vmi(
                Box::new(ObjectRef::from_obj_with(&obj, resource.clone())),
                ferrovirt_launcher::timing::boottime_us(),
            ),
            Ok(watcher::Event::InitDone) => Trigger::All,
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => continue,
            Err(e) => {
                tracing::warn!("watching VMIs: {e}");
                continue;
            }
        };
        if triggers.send(trigger).is_err() {
            return;
        }
    }
}
