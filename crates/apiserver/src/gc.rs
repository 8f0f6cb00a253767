//! Background loops: the garbage collector (ownerReference cascading for Background,
//! Foreground and Orphan propagation, namespace termination, expiry of old events), revision
//! compaction, and creation of the system namespaces at start.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use ferrovirt_api::registry::ResourceDef;
use futures::{FutureExt, StreamExt};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::handlers::{DeleteOpts, WriteOpts, create, delete_one, from_storage, store_update};
use crate::objects::{decode, finalizers, is_deleting, meta_str, name_of, namespace_of};
use crate::server::Shared;
use crate::timefmt;

/// Namespaces that exist from the first start.
pub const SYSTEM_NAMESPACES: &[&str] =
    &["default", "kube-system", "kube-public", "kube-node-lease"];

/// Events older than this are deleted.
const EVENT_TTL_SECS: i64 = 3600;

pub(crate) async fn ensure_system_namespaces(sh: &Shared) -> Result<(), ApiError> {
    let Some(def) = sh.resources.lookup("", "v1", "namespaces").cloned() else {
        return Ok(());
    };
    for ns in SYSTEM_NAMESPACES {
        let obj = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
        match create(sh, &def, None, obj, WriteOpts::default()).await {
            Ok(_) => {}
            Err(e) if e.code == 409 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One stored object seen by a scan.
struct Item {
    def: ResourceDef,
    obj: Value,
}

impl Item {
    fn uid(&self) -> &str {
        meta_str(&self.obj, "uid").unwrap_or_default()
    }
    fn ns(&self) -> Option<&str> {
        namespace_of(&self.obj)
    }
    fn name(&self) -> &str {
        name_of(&self.obj)
    }
}

async fn load_all(sh: &Shared) -> Result<Vec<Item>, ApiError> {
    let mut out = Vec::new();
    for def in sh.resources.storage_defs() {
        let prefix = crate::resources::list_prefix(def, None);
        let res = sh
            .store
            .list(&prefix, Default::default())
            .await
            .map_err(ApiError::from_store)?;
        for kv in &res.items {
            out.push(Item {
                def: def.clone(),
                obj: from_storage(def, decode(kv)?),
            });
        }
    }
    Ok(out)
}

fn owner_uids(obj: &Value) -> Vec<String> {
    obj.pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|r| r.get("uid").and_then(Value::as_str).map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

async fn delete_quietly(sh: &Shared, it: &Item, propagation: &str) -> bool {
    let opts = DeleteOpts {
        propagation: Some(propagation.into()),
        ..Default::default()
    };
    match delete_one(sh, &it.def, it.ns(), it.name(), &opts).await {
        Ok(_) => true,
        Err(e) if e.code == 404 => false,
        Err(e) => {
            tracing::warn!(
                "gc: deleting {}/{}: {}",
                it.def.plural,
                it.name(),
                e.message
            );
            false
        }
    }
}

/// Rewrites an object with `edit` applied (retrying is left to the next scan).
async fn edit(sh: &Shared, it: &Item, f: impl FnOnce(&mut Value)) -> bool {
    let mut o = it.obj.clone();
    f(&mut o);
    let rev = meta_str(&o, "resourceVersion")
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    matches!(store_update(sh, &it.def, o, rev).await, Ok(Ok(_)))
}

fn remove_finalizer(o: &mut Value, name: &str) {
    let left: Vec<String> = finalizers(o).into_iter().filter(|f| f != name).collect();
    if let Some(m) = o.get_mut("metadata").and_then(Value::as_object_mut) {
        if left.is_empty() {
            m.remove("finalizers");
        } else {
            m.insert("finalizers".into(), json!(left));
        }
    }
}

/// One pass over everything; returns whether it changed anything.
async fn scan(sh: &Shared) -> Result<bool, ApiError> {
    let items = load_all(sh).await?;
    let by_uid: HashMap<&str, &Item> = items.iter().map(|i| (i.uid(), i)).collect();
    let mut progress = false;

    // Namespaces being terminated: delete their content, then release the namespace.
    for ns in items
        .iter()
        .filter(|i| i.def.kind == "Namespace" && i.def.group.is_empty() && is_deleting(&i.obj))
    {
        let content: Vec<&Item> = items
            .iter()
            .filter(|i| i.def.namespaced && i.ns() == Some(ns.name()))
            .collect();
        for c in &content {
            if !is_deleting(&c.obj) {
                progress |= delete_quietly(sh, c, "Background").await;
            }
        }
        if content.is_empty() {
            progress |= edit(sh, ns, |o| {
                if let Some(spec) = o.get_mut("spec").and_then(Value::as_object_mut) {
                    spec.insert("finalizers".into(), json!([]));
                }
            })
            .await;
        }
    }

    // Dependents whose owners are gone, being deleted in the foreground, or orphaning.
    let mut has_dependents: HashSet<String> = HashSet::new();
    for it in &items {
        let owners = owner_uids(&it.obj);
        if owners.is_empty() {
            continue;
        }
        for o in &owners {
            has_dependents.insert(o.clone());
        }
        let live: Vec<&&Item> = owners
            .iter()
            .filter_map(|u| by_uid.get(u.as_str()))
            .collect();
        if live.is_empty() {
            if !is_deleting(&it.obj) {
                progress |= delete_quietly(sh, it, "Background").await;
            }
            continue;
        }
        let orphaning: Vec<String> = live
            .iter()
            .filter(|o| is_deleting(&o.obj) && finalizers(&o.obj).iter().any(|f| f == "orphan"))
            .map(|o| o.uid().to_string())
            .collect();
        if !orphaning.is_empty() {
            progress |= edit(sh, it, |o| {
                if let Some(refs) = o
                    .pointer_mut("/metadata/ownerReferences")
                    .and_then(Value::as_array_mut)
                {
                    refs.retain(|r| {
                        !orphaning
                            .iter()
                            .any(|u| r.get("uid").and_then(Value::as_str) == Some(u))
                    });
                }
            })
            .await;
            continue;
        }
        let foreground = live.iter().any(|o| {
            is_deleting(&o.obj) && finalizers(&o.obj).iter().any(|f| f == "foregroundDeletion")
        });
        if foreground && !is_deleting(&it.obj) {
            progress |= delete_quietly(sh, it, "Foreground").await;
        }
    }

    // Owners whose Foreground/Orphan work is done.
    for it in items.iter().filter(|i| is_deleting(&i.obj)) {
        let fins = finalizers(&it.obj);
        let waiting = has_dependents.contains(it.uid());
        for f in ["orphan", "foregroundDeletion"] {
            if fins.iter().any(|x| x == f) && !waiting {
                progress |= edit(sh, it, |o| remove_finalizer(o, f)).await;
                break;
            }
        }
    }

    // Old events.
    let now = timefmt::now_secs();
    for it in items
        .iter()
        .filter(|i| i.def.kind == "Event" && i.def.group.is_empty())
    {
        if event_last_seen(&it.obj, now).is_some_and(|t| now - t > EVENT_TTL_SECS) {
            delete_quietly(sh, it, "Background").await;
        }
    }
    Ok(progress)
}

/// When an event was last written, for its TTL: the newest of the server's creationTimestamp
/// and the times the client wrote (lastTimestamp, eventTime, series.lastObservedTime), those
/// in the future ignored, so a client can neither expire an event at once by writing an old
/// time nor keep it forever by writing a future one.
fn event_last_seen(obj: &Value, now: i64) -> Option<i64> {
    let created = meta_str(obj, "creationTimestamp").and_then(timefmt::parse_rfc3339);
    let client = ["lastTimestamp", "eventTime", "firstTimestamp"]
        .iter()
        .filter_map(|f| obj.get(*f).and_then(Value::as_str))
        .chain(
            obj.pointer("/series/lastObservedTime")
                .and_then(Value::as_str),
        )
        .filter_map(timefmt::parse_rfc3339)
        .filter(|t| *t <= now)
        .max();
    created.into_iter().chain(client).max()
}

/// The garbage collector: rescans when prompted (in-process deletions, store events that
/// delete or mark deletion) and every `interval`.
pub(crate) async fn run(sh: Arc<Shared>, interval: Duration) {
    let mut shutdown = sh.shutdown.clone();
    let mut events = None;
    loop {
        if events.is_none()
            && let Ok(rev) = sh.store.current_revision().await
        {
            events = sh.store.watch("/registry/", rev).await.ok();
        }
        match scan(&sh).await {
            Ok(true) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            Ok(false) => {}
            Err(e) => tracing::warn!("gc scan failed: {}", e.message),
        }
        let store_prompt = async {
            match events.as_mut() {
                Some(s) => loop {
                    match s.next().await {
                        Some(Ok(ev)) => {
                            let deleting = ev.kind == ferrovirt_store::EventKind::Deleted
                                || String::from_utf8_lossy(&ev.kv.value)
                                    .contains("\"deletionTimestamp\"");
                            if deleting {
                                return true;
                            }
                        }
                        _ => return false,
                    }
                },
                None => std::future::pending().await,
            }
        };
        let reset = tokio::select! {
            _ = sh.gc_kick.notified() => false,
            alive = store_prompt => !alive,
            _ = tokio::time::sleep(interval) => false,
            _ = shutdown.changed() => return,
        };
        if reset {
            events = None;
        }
        // Coalesce bursts (a namespace deletion, a cascade) into one scan.
        tokio::time::sleep(Duration::from_millis(50)).await;
        if let Some(s) = events.as_mut() {
            while let Some(item) = s.next().now_or_never() {
                if !matches!(item, Some(Ok(_))) {
                    events = None;
                    break;
                }
            }
        }
    }
}

/// Compacts the store every `every`, keeping the last `keep` revisions.
pub(crate) async fn compact_loop(sh: Arc<Shared>, every: Duration, keep: i64) {
    let mut shutdown = sh.shutdown.clone();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shutdown.changed() => return,
        }
        let Ok(cur) = sh.store.current_revision().await else {
            continue;
        };
        let Ok(done) = sh.store.compacted_revision().await else {
            continue;
        };
        let target = cur - keep;
        if target > done
            && let Err(e) = sh.store.compact(target).await
        {
            tracing::warn!("compaction to {target} failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn event_age_counts_from_the_last_write() {
        let now = timefmt::parse_rfc3339("2026-12-02T10:00:00Z").unwrap();
        // An old client time does not expire a just-created event.
        let fresh = json!({"metadata": {"creationTimestamp": "2026-12-02T09:59:00Z"},
                           "eventTime": "2026-01-01T00:00:00.000000Z"});
        assert_eq!(event_last_seen(&fresh, now), Some(now - 60));
        // A recount (lastTimestamp moves on) keeps an old event alive.
        let recounted = json!({"metadata": {"creationTimestamp": "2026-12-02T07:00:00Z"},
                               "lastTimestamp": "2026-12-02T09:30:00Z"});
        assert_eq!(event_last_seen(&recounted, now), Some(now - 1800));
        // A time in the future is ignored.
        let future = json!({"metadata": {"creationTimestamp": "2026-12-02T07:00:00Z"},
                            "lastTimestamp": "2030-01-01T00:00:00Z"});
        assert_eq!(event_last_seen(&future, now), Some(now - 3 * 3600));
        let series = json!({"metadata": {"creationTimestamp": "2026-12-02T07:00:00Z"},
                            "series": {"count": 2, "lastObservedTime": "2026-12-02T09:00:00.000000Z"}});
        assert_eq!(event_last_seen(&series, now), Some(now - 3600));
    }
}
