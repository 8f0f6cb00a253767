//! Background loops: the garbage collector (ownerReference cascading for Background,
//! Foreground and Orphan propagation, namespace termination, expiry of old events), revision
//! compaction, and creation of the system namespaces at start.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::gc_index;
use crate::handlers::{DeleteOpts, WriteOpts, create, delete_one, load, store_update};
use crate::objects::finalizers;
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

/// A scan's view of the stored objects: [`gc_index::Item`]s from the index the collector keeps.
type Item = gc_index::Item;

/// Objects listed per page when the index is (re)built.
const LOAD_PAGE: usize = 500;
/// The index is rebuilt from a full list at least this often (a safety net: it is kept up to
/// date from the watch in between).
const RELOAD_EVERY: Duration = Duration::from_secs(600);

/// Lists every collected kind, in pages, into a fresh index.
async fn load_all(sh: &Shared, kinds: &gc_index::Kinds) -> Result<gc_index::Index, ApiError> {
    let mut index = gc_index::Index::default();
    for (prefix, def) in kinds.iter() {
        let mut opts = ferrovirt_store::ListOptions {
            limit: Some(LOAD_PAGE),
            ..Default::default()
        };
        loop {
            let res = sh
                .store
                .list(prefix, opts.clone())
                .await
                .map_err(ApiError::from_store)?;
            for kv in &res.items {
                index.insert(&kv.key, gc_index::summarize(def, kv)?);
            }
            match res.items.last() {
                Some(last) if res.more => {
                    opts.start_after = Some(last.key.clone());
                    opts.revision = Some(res.revision);
                }
                _ => break,
            }
        }
    }
    Ok(index)
}

async fn delete_quietly(sh: &Shared, it: &Item, propagation: &str) -> bool {
    let opts = DeleteOpts {
        propagation: Some(propagation.into()),
        ..Default::default()
    };
    match delete_one(sh, &it.def, it.ns(), &it.name, &opts).await {
        Ok(_) => true,
        Err(e) if e.code == 404 => false,
        Err(e) => {
            tracing::warn!("gc: deleting {}/{}: {}", it.def.plural, it.name, e.message);
            false
        }
    }
}

/// Rewrites an object with `edit` applied, read again from the store and written with the
/// resourceVersion the scan saw as precondition (a conflict is left to the next scan).
async fn edit(sh: &Shared, it: &Item, f: impl FnOnce(&mut Value)) -> bool {
    let Ok(Some((mut o, rev))) = load(sh, &it.def, it.ns(), &it.name).await else {
        return false;
    };
    if rev != it.revision {
        return false;
    }
    f(&mut o);
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
async fn scan(sh: &Shared, index: &gc_index::Index) -> Result<bool, ApiError> {
    let items: Vec<&Item> = index.items().collect();
    let by_uid: HashMap<&str, &Item> = items.iter().map(|i| (i.uid.as_str(), *i)).collect();
    let mut progress = false;

    // Namespaces being terminated: delete their content, then release the namespace.
    for ns in items
        .iter()
        .filter(|i| i.def.kind == "Namespace" && i.def.group.is_empty() && i.deleting)
    {
        let content: Vec<&Item> = items
            .iter()
            .copied()
            .filter(|i| i.def.namespaced && i.ns() == Some(ns.name.as_str()))
            .collect();
        for c in &content {
            if !c.deleting {
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
    for it in items.iter().copied() {
        let owners = &it.owners;
        if owners.is_empty() {
            continue;
        }
        for o in owners {
            has_dependents.insert(o.clone());
        }
        let live: Vec<&&Item> = owners
            .iter()
            .filter_map(|u| by_uid.get(u.as_str()))
            .collect();
        if live.is_empty() {
            if !it.deleting {
                progress |= delete_quietly(sh, it, "Background").await;
            }
            continue;
        }
        let orphaning: Vec<String> = live
            .iter()
            .filter(|o| o.deleting && o.has_finalizer("orphan"))
            .map(|o| o.uid.clone())
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
        let foreground = live
            .iter()
            .any(|o| o.deleting && o.has_finalizer("foregroundDeletion"));
        if foreground && !it.deleting {
            progress |= delete_quietly(sh, it, "Foreground").await;
        }
    }

    // Owners whose Foreground/Orphan work is done.
    for it in items.iter().copied().filter(|i| i.deleting) {
        let waiting = has_dependents.contains(&it.uid);
        for f in ["orphan", "foregroundDeletion"] {
            if it.has_finalizer(f) && !waiting {
                progress |= edit(sh, it, |o| remove_finalizer(o, f)).await;
                break;
            }
        }
    }

    // Old events.
    let now = timefmt::now_secs();
    for it in items.iter().copied() {
        let last_seen = it.event_times.as_ref().and_then(|t| t.last_seen(now));
        if last_seen.is_some_and(|t| now - t > EVENT_TTL_SECS) {
            delete_quietly(sh, it, "Background").await;
        }
    }
    Ok(progress)
}

/// When an event was last written, for its TTL: the newest of the server's creationTimestamp
/// and the times the client wrote (lastTimestamp, eventTime, series.lastObservedTime), those
/// in the future ignored, so a client can neither expire an event at once by writing an old
/// time nor keep it forever by writing a future one.
#[cfg(test)]
fn event_last_seen(obj: &Value, now: i64) -> Option<i64> {
    gc_index::event_times(obj).last_seen(now)
}

/// The garbage collector: rescans when prompted (in-process deletions, store events that
/// delete or mark deletion) and every `interval`. The scan reads the collector's index
/// ([`gc_index`]): built from a paged list after the watch of every key is opened, then kept
/// up to date from that watch; rebuilt when the watch fails or ends and every [`RELOAD_EVERY`].
pub(crate) async fn run(sh: Arc<Shared>, interval: Duration) {
    let mut shutdown = sh.shutdown.clone();
    let kinds = gc_index::Kinds::new(&sh.resources.storage_defs());
    let mut events = None;
    let mut index: Option<(gc_index::Index, Instant)> = None;
    loop {
        if events.is_none() {
            index = None;
            if let Ok(rev) = sh.store.current_revision().await {
                events = sh.store.watch("/registry/", rev).await.ok();
            }
            if events.is_none() {
                tracing::warn!("gc: cannot watch the store; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    _ = shutdown.changed() => return,
                }
            }
        }
        if index
            .as_ref()
            .is_none_or(|(_, at)| at.elapsed() >= RELOAD_EVERY)
        {
            index = None;
            match load_all(&sh, &kinds).await {
                Ok(i) => index = Some((i, Instant::now())),
                Err(e) => tracing::warn!("gc: reading the store failed: {}", e.message),
            }
        }
        // Whatever the watch already delivered (the scan's own writes among it).
        if let (Some(s), Some((idx, _))) = (events.as_mut(), index.as_mut()) {
            while let Some(item) = s.next().now_or_never() {
                match item {
                    Some(Ok(ev)) => idx.apply(&kinds, &ev),
                    _ => {
                        events = None;
                        break;
                    }
                }
            }
        }
        if events.is_none() {
            // The watch ended: rebuild from a new one (the index may have missed events).
            continue;
        }
        if let Some((idx, _)) = index.as_ref() {
            match scan(&sh, idx).await {
                Ok(true) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                Ok(false) => {}
                Err(e) => tracing::warn!("gc scan failed: {}", e.message),
            }
        }
        let store_prompt = async {
            match (events.as_mut(), index.as_mut()) {
                (Some(s), Some((idx, _))) => loop {
                    match s.next().await {
                        Some(Ok(ev)) => {
                            idx.apply(&kinds, &ev);
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
                _ => std::future::pending().await,
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
            continue;
        }
        // Coalesce bursts (a namespace deletion, a cascade) into one scan; what arrived
        // meanwhile is applied at the top of the loop.
        tokio::time::sleep(Duration::from_millis(50)).await;
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
