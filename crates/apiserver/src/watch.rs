//! Watch: a stream of `{"type","object"}` JSON lines. Initial state as synthetic ADDED events
//! (no resourceVersion, "0", or `sendInitialEvents=true` followed by the
//! `k8s.io/initial-events-end` BOOKMARK), then store events filtered by label/field selectors
//! (objects leaving the selection become DELETED), periodic BOOKMARKs, `timeoutSeconds`, and an
//! ERROR 410 Expired event when the requested revision is compacted.

use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use ferrovirt_api::launcher_pod;
use ferrovirt_api::registry::ResourceDef;
use ferrovirt_store::{EventKind, StoreError, WatchEvent};
use futures::channel::mpsc;
use futures::{SinkExt, StreamExt};
use http::{HeaderValue, StatusCode};
use serde_json::{Value, json};

use crate::body::{Representation, representation};
use crate::error::ApiError;
use crate::handlers::{Ctx, from_storage};
use crate::objects::decode;
use crate::selectors::{FieldRequirement, FieldSelector, LabelSelector};
use crate::watch_decode::DecodeCache;
use crate::{resources, table};

/// Longest a watch stays open without `timeoutSeconds`.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1800);

/// Per-watch settings derived from the request.
struct Plan {
    def: ResourceDef,
    labels: LabelSelector,
    fields: FieldSelector,
    repr: Representation,
    bookmarks: bool,
    timeout: Duration,
    /// Launcher Pod views: the events are computed from VMI events.
    view: bool,
}

impl Plan {
    fn matches(&self, obj: &Value) -> bool {
        self.labels.matches_object(obj) && self.fields.matches(obj)
    }

    /// Renders an object for an event in the representation asked for.
    fn render(&self, obj: Value) -> Value {
        match self.repr {
            Representation::Object => obj,
            Representation::Metadata { beta } => table::partial(&obj, beta),
            Representation::Table { beta } => table::table(&table::TableRequest {
                def: &self.def,
                objects: std::slice::from_ref(&obj),
                list_meta: json!({}),
                include: table::IncludeObject::Metadata,
                beta,
            }),
        }
    }

    fn bookmark(&self, rev: i64, initial_end: bool) -> Value {
        let mut meta = json!({"resourceVersion": rev.to_string()});
        if initial_end {
            meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        json!({"kind": self.def.kind, "apiVersion": self.def.api_version(), "metadata": meta})
    }
}

fn line(type_: &str, object: Value) -> Bytes {
    let mut v = serde_json::to_vec(&json!({"type": type_, "object": object})).unwrap_or_default();
    v.push(b'\n');
    Bytes::from(v)
}

/// [`line`] around an object already serialised (the same bytes).
fn line_raw(type_: &str, object: &[u8]) -> Bytes {
    let mut v = Vec::with_capacity(object.len() + 32);
    v.extend_from_slice(b"{\"type\":");
    v.extend_from_slice(&serde_json::to_vec(type_).unwrap_or_default());
    v.extend_from_slice(b",\"object\":");
    v.extend_from_slice(object);
    v.extend_from_slice(b"}\n");
    Bytes::from(v)
}

/// What a watch sends for one event: its own object, or the copy every watch shares (cloned
/// or serialised only when sent, and serialised once for every watch that sends it as is).
enum Payload {
    Own(Value),
    Shared(std::sync::Arc<crate::watch_decode::DecodedEvent>),
}

impl Plan {
    /// The event's line in this watch's representation.
    fn line(&self, type_: &str, payload: Payload) -> Bytes {
        match payload {
            Payload::Shared(d) if matches!(self.repr, Representation::Object) => {
                line_raw(type_, &d.cur_json())
            }
            Payload::Shared(d) => line(type_, self.render(d.cur.clone())),
            Payload::Own(v) => line(type_, self.render(v)),
        }
    }
}

/// The watch event type for a store event, from whether the object matches this watch's
/// selectors now and whether it did before (`None`: no previous state known).
fn event_type(kind: EventKind, now: bool, before: Option<bool>) -> Option<&'static str> {
    match kind {
        EventKind::Created => now.then_some("ADDED"),
        EventKind::Deleted => (now || before == Some(true)).then_some("DELETED"),
        EventKind::Modified => match (before, now) {
            (Some(true), true) | (None, true) => Some("MODIFIED"),
            (Some(false), true) => Some("ADDED"),
            (Some(true), false) => Some("DELETED"),
            _ => None,
        },
    }
}

/// Maps one store event to a watch event for this watcher, if it should see it. The object is
/// matched against the copy every watch shares ([`DecodeCache`]) and cloned only when sent,
/// where the stored form is already the served one (the same apiVersion, not events.k8s.io);
/// otherwise it is decoded and converted here.
fn translate(
    plan: &Plan,
    ev: &WatchEvent,
    cache: &DecodeCache,
) -> Result<Vec<(&'static str, Payload)>, ApiError> {
    if plan.view {
        return Ok(translate_view(plan, ev)?
            .into_iter()
            .map(|(t, v)| (t, Payload::Own(v)))
            .collect());
    }
    let want = plan.def.api_version();
    let served_as_stored = |v: &Value| v.get("apiVersion").and_then(Value::as_str) == Some(&want);
    if !resources::is_events_v1(&plan.def)
        && let Some(d) = cache.get(ev)
        && served_as_stored(&d.cur)
        && d.prev.as_ref().is_none_or(served_as_stored)
    {
        let before = d.prev.as_ref().map(|p| plan.matches(p));
        return Ok(event_type(ev.kind, plan.matches(&d.cur), before)
            .map(|t| (t, Payload::Shared(d.clone())))
            .into_iter()
            .collect());
    }
    let cur = from_storage(&plan.def, decode(&ev.kv)?);
    let prev = ev
        .prev
        .as_ref()
        .map(|p| decode(p).map(|o| from_storage(&plan.def, o)))
        .transpose()?;
    let before = prev.as_ref().map(|p| plan.matches(p));
    Ok(event_type(ev.kind, plan.matches(&cur), before)
        .map(|t| (t, Payload::Own(cur)))
        .into_iter()
        .collect())
}

/// The launcher Pod view events for one VMI store event, after this watch's selectors.
fn translate_view(plan: &Plan, ev: &WatchEvent) -> Result<Vec<(&'static str, Value)>, ApiError> {
    let cur = decode(&ev.kv)?;
    let prev = ev.prev.as_ref().map(decode).transpose()?;
    let changes = match ev.kind {
        // The deleted state carries the deletion's revision.
        EventKind::Deleted => launcher_pod::view_changes(Some(&cur), None),
        _ => launcher_pod::view_changes(prev.as_ref(), Some(&cur)),
    };
    let prev_pods = prev
        .as_ref()
        .map(launcher_pod::pods_for)
        .unwrap_or_default();
    let mut out = Vec::new();
    for (t, pod) in changes {
        let name = pod.pointer("/metadata/name");
        let prev_pod = prev_pods
            .iter()
            .find(|p| p.pointer("/metadata/name") == name);
        let kind = match t {
            "ADDED" if ev.kind == EventKind::Modified && ev.prev.is_none() => EventKind::Modified,
            "ADDED" => EventKind::Created,
            "DELETED" => EventKind::Deleted,
            _ => EventKind::Modified,
        };
        let before = match kind {
            EventKind::Modified => prev_pod.map(|p| plan.matches(p)),
            EventKind::Deleted => Some(plan.matches(&pod)),
            EventKind::Created => None,
        };
        let now = kind != EventKind::Deleted && plan.matches(&pod);
        if let Some(t) = event_type(kind, now, before) {
            out.push((t, pod));
        }
    }
    Ok(out)
}

/// Serves a watch request on a collection (or one object, when `name` is set).
pub(crate) async fn serve(ctx: Ctx, name: Option<String>) -> Result<Response, ApiError> {
    let (labels, mut fields) = crate::handlers::selectors_of(&ctx)?;
    if let Some(n) = &name {
        fields.0.push(FieldRequirement {
            path: "metadata.name".into(),
            value: n.clone(),
            negate: false,
        });
    }
    let timeout = ctx
        .q
        .int("timeoutSeconds")?
        .filter(|t| *t > 0)
        .map(|t| Duration::from_secs(t as u64))
        .unwrap_or(DEFAULT_TIMEOUT);
    let send_initial = match ctx.q.get("sendInitialEvents") {
        Some("true") => Some(true),
        Some("false") => Some(false),
        _ => None,
    };
    let rv = ctx.q.get("resourceVersion").filter(|r| *r != "0");
    let start_rev: Option<i64> = rv
        .map(|r| {
            r.parse::<i64>()
                .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {r:?}")))
        })
        .transpose()?;
    // Initial events: requested explicitly, or implied by an empty / "0" resourceVersion.
    let initial = send_initial.unwrap_or(start_rev.is_none());
    let plan = Plan {
        def: ctx.def.clone(),
        labels,
        fields,
        repr: representation(&ctx.headers),
        bookmarks: ctx.q.flag("allowWatchBookmarks"),
        timeout,
        view: crate::handlers::is_pod(&ctx.def),
    };
    let store = ctx.sh.store.clone();
    let prefix = match (&name, ctx.ns()) {
        // Views: every VMI of the namespace (the name is matched on the computed Pod).
        _ if plan.view => resources::list_prefix(&crate::handlers::vmi_def(&ctx.sh)?, ctx.ns()),
        (Some(n), ns) if !plan.def.namespaced || ns.is_some() => {
            resources::object_key(&plan.def, ns, n)
        }
        _ => resources::list_prefix(&plan.def, ctx.ns()),
    };
    let (mut tx, rx) = mpsc::channel::<Bytes>(64);

    // Initial state.
    let mut from = match start_rev {
        Some(r) if !initial => r,
        _ => store
            .current_revision()
            .await
            .map_err(ApiError::from_store)?,
    };
    let mut pre: Vec<Bytes> = Vec::new();
    if initial {
        let listed = store
            .list(
                &prefix,
                ferrovirt_store::ListOptions {
                    revision: Some(from),
                    ..Default::default()
                },
            )
            .await
            .map_err(ApiError::from_store)?;
        from = listed.revision;
        for kv in &listed.items {
            let objs = if plan.view {
                launcher_pod::pods_for(&decode(kv)?)
            } else {
                vec![from_storage(&plan.def, decode(kv)?)]
            };
            for obj in objs {
                if plan.matches(&obj) {
                    pre.push(line("ADDED", plan.render(obj)));
                }
            }
        }
        if send_initial == Some(true) {
            pre.push(line("BOOKMARK", plan.bookmark(from, true)));
        }
    }
    let compacted = store
        .compacted_revision()
        .await
        .map_err(ApiError::from_store)?;
    let stream = if from + 1 < compacted {
        Err(StoreError::Compacted {
            requested: from,
            compacted,
        })
    } else {
        store.watch(&prefix, from).await
    };
    let mut shutdown = ctx.sh.shutdown.clone();
    let shared = ctx.sh.clone();
    let bookmark_every = ctx.sh.bookmark_interval;
    tokio::spawn(async move {
        for b in pre {
            if tx.send(b).await.is_err() {
                return;
            }
        }
        let mut events = match stream {
            Ok(s) => s,
            Err(e) => {
                let err = ApiError::from_store(e);
                let _ = tx.send(line("ERROR", err.status())).await;
                return;
            }
        };
        let deadline = tokio::time::sleep(plan.timeout);
        tokio::pin!(deadline);
        let mut bookmark = tokio::time::interval(bookmark_every);
        bookmark.tick().await;
        let mut liveness = tokio::time::interval(Duration::from_secs(5));
        let mut last = from;
        loop {
            tokio::select! {
                ev = events.next() => {
                    let out = match ev {
                        None => break,
                        Some(Ok(ev)) => {
                            last = last.max(ev.revision);
                            match translate(&plan, &ev, &shared.decoded) {
                                Ok(evs) if evs.is_empty() => continue,
                                Ok(evs) => {
                                    let mut out = Vec::new();
                                    for (t, payload) in evs {
                                        out.extend_from_slice(&plan.line(t, payload));
                                    }
                                    Bytes::from(out)
                                }
                                Err(e) => line("ERROR", e.status()),
                            }
                        }
                        Some(Err(e)) => {
                            let _ = tx.send(line("ERROR", ApiError::from_store(e).status())).await;
                            break;
                        }
                    };
                    if tx.send(out).await.is_err() {
                        break;
                    }
                }
                _ = bookmark.tick(), if plan.bookmarks => {
                    if tx.send(line("BOOKMARK", plan.bookmark(last, false))).await.is_err() {
                        break;
                    }
                }
                _ = liveness.tick() => {
                    if tx.is_closed() {
                        break;
                    }
                }
                _ = &mut deadline => break,
                _ = shutdown.changed() => break,
            }
        }
    });
    let mut resp = Response::new(Body::from_stream(rx.map(Ok::<_, std::convert::Infallible>)));
    *resp.status_mut() = StatusCode::OK;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp.headers_mut().insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, private"),
    );
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_serialised_object_makes_the_same_line() {
        let obj = json!({"kind": "X", "metadata": {"name": "a\"b", "resourceVersion": "7"},
            "spec": {"list": [1, 2.5, null, "é"]}});
        for t in ["ADDED", "MODIFIED", "DELETED"] {
            assert_eq!(
                line_raw(t, &serde_json::to_vec(&obj).unwrap()),
                line(t, obj.clone())
            );
        }
    }
}
