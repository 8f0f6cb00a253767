//! What the garbage collector knows of every stored object, kept up to date from one watch of
//! the whole keyspace instead of read back from the store on every scan.
//!
//! A scan used to list and fully decode every stored object (with 10,000 VMIs and their Events,
//! some 40,000 `serde_json::Value` trees every 30 s): the biggest part of an idle server's CPU
//! and a burst of several hundred MiB. The collector needs only a few metadata fields of each
//! object, so [`Item`] keeps just those, parsed by [`summarize`] with a typed reader that skips
//! everything else; [`Index`] holds one per key, filled by a paged list once and then by the
//! store's watch events ([`Index::apply`], which ignores anything not newer than what it holds, so
//! a watch started before the list may replay what the list already showed). Anything the typed
//! reader cannot take falls back to the full decode, so an odd object is read as before.

use std::collections::HashMap;
use std::sync::Arc;

use ferrovirt_api::registry::ResourceDef;
use ferrovirt_store::{EventKind, KeyValue, Revision, WatchEvent};
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::Value;

use crate::error::ApiError;
use crate::objects::{decode, finalizers, is_deleting, meta_str};
use crate::timefmt;

/// The metadata of one stored object that the collector decides on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Item {
    pub def: Arc<ResourceDef>,
    pub uid: String,
    pub namespace: Option<String>,
    pub name: String,
    pub deleting: bool,
    pub finalizers: Vec<String>,
    /// The `uid` of each ownerReference that has one.
    pub owners: Vec<String>,
    /// Core Events only: the seconds of `creationTimestamp` and of the client's times
    /// (`lastTimestamp`, `eventTime`, `firstTimestamp`, `series.lastObservedTime`).
    pub event_times: Option<EventTimes>,
    /// The object's `mod_revision` (its resourceVersion).
    pub revision: Revision,
}

/// The times an Event's TTL is counted from (see `gc::event_last_seen`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct EventTimes {
    pub created: Option<i64>,
    pub client: Vec<i64>,
}

impl EventTimes {
    /// When the event was last written: the newest of its creation and the client's times
    /// that are not in the future.
    pub fn last_seen(&self, now: i64) -> Option<i64> {
        let client = self.client.iter().copied().filter(|t| *t <= now).max();
        self.created.into_iter().chain(client).max()
    }
}

impl Item {
    pub fn ns(&self) -> Option<&str> {
        self.namespace.as_deref().filter(|s| !s.is_empty())
    }

    pub fn has_finalizer(&self, name: &str) -> bool {
        self.finalizers.iter().any(|f| f == name)
    }
}

fn is_core_event(def: &ResourceDef) -> bool {
    def.kind == "Event" && def.group.is_empty()
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct RawOwner {
    uid: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct RawMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    creation_timestamp: Option<String>,
    deletion_timestamp: Option<IgnoredAny>,
    finalizers: Option<Vec<String>>,
    owner_references: Option<Vec<RawOwner>>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct RawObject {
    metadata: RawMeta,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct RawSeries {
    #[serde(rename = "lastObservedTime")]
    last_observed_time: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct RawEvent {
    metadata: RawMeta,
    last_timestamp: Option<String>,
    event_time: Option<String>,
    first_timestamp: Option<String>,
    series: Option<RawSeries>,
}

fn secs(t: &Option<String>) -> Option<i64> {
    t.as_deref().and_then(timefmt::parse_rfc3339)
}

fn from_meta(def: &Arc<ResourceDef>, m: RawMeta, revision: Revision) -> Item {
    Item {
        def: def.clone(),
        uid: m.uid.unwrap_or_default(),
        namespace: m.namespace,
        name: m.name.unwrap_or_default(),
        deleting: m.deletion_timestamp.is_some(),
        finalizers: m.finalizers.unwrap_or_default(),
        owners: m
            .owner_references
            .unwrap_or_default()
            .into_iter()
            .filter_map(|o| o.uid)
            .collect(),
        event_times: None,
        revision,
    }
}

/// The TTL times of a decoded Event.
pub(crate) fn event_times(obj: &Value) -> EventTimes {
    EventTimes {
        created: meta_str(obj, "creationTimestamp").and_then(timefmt::parse_rfc3339),
        client: ["lastTimestamp", "eventTime", "firstTimestamp"]
            .iter()
            .filter_map(|f| obj.get(*f).and_then(Value::as_str))
            .chain(
                obj.pointer("/series/lastObservedTime")
                    .and_then(Value::as_str),
            )
            .filter_map(timefmt::parse_rfc3339)
            .collect(),
    }
}

/// The same summary from a fully decoded object (the fallback, and the reference the typed
/// reader is tested against).
fn from_value(def: &Arc<ResourceDef>, obj: &Value, revision: Revision) -> Item {
    let owners = obj
        .pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|r| r.get("uid").and_then(Value::as_str).map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let event_times = is_core_event(def).then(|| event_times(obj));
    Item {
        def: def.clone(),
        uid: meta_str(obj, "uid").unwrap_or_default().to_string(),
        namespace: meta_str(obj, "namespace").map(str::to_string),
        name: meta_str(obj, "name").unwrap_or_default().to_string(),
        deleting: is_deleting(obj),
        finalizers: finalizers(obj),
        owners,
        event_times,
        revision,
    }
}

/// The summary of one stored object of kind `def`: read with a typed reader that skips every
/// field the collector does not use, or, for anything that reader refuses (a field of an
/// unexpected type), from the full decode as before. An object that does not decode at all is an
/// error.
pub(crate) fn summarize(def: &Arc<ResourceDef>, kv: &KeyValue) -> Result<Item, ApiError> {
    let rev = kv.mod_revision;
    if is_core_event(def) {
        if let Ok(e) = serde_json::from_slice::<RawEvent>(&kv.value) {
            let created = secs(&e.metadata.creation_timestamp);
            let client = [&e.last_timestamp, &e.event_time, &e.first_timestamp]
                .into_iter()
                .chain(e.series.as_ref().map(|s| &s.last_observed_time))
                .filter_map(secs)
                .collect();
            let mut item = from_meta(def, e.metadata, rev);
            item.event_times = Some(EventTimes { created, client });
            return Ok(item);
        }
    } else if let Ok(o) = serde_json::from_slice::<RawObject>(&kv.value) {
        return Ok(from_meta(def, o.metadata, rev));
    }
    Ok(from_value(def, &decode(kv)?, rev))
}

/// The kinds by key prefix (`/registry/<group>/<plural>/`).
#[derive(Debug, Clone)]
pub(crate) struct Kinds(Vec<(String, Arc<ResourceDef>)>);

impl Kinds {
    pub fn new(defs: &[&ResourceDef]) -> Kinds {
        Kinds(
            defs.iter()
                .map(|d| {
                    (
                        crate::resources::list_prefix(d, None),
                        Arc::new((*d).clone()),
                    )
                })
                .collect(),
        )
    }

    /// Each kind with its key prefix.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Arc<ResourceDef>)> {
        self.0.iter().map(|(p, d)| (p.as_str(), d))
    }

    /// The kind a key belongs to (the longest prefix that matches).
    pub fn of(&self, key: &str) -> Option<&Arc<ResourceDef>> {
        self.0
            .iter()
            .filter(|(p, _)| key.starts_with(p.as_str()))
            .max_by_key(|(p, _)| p.len())
            .map(|(_, d)| d)
    }
}

/// Every stored object of the collected kinds, by key.
#[derive(Debug, Default)]
pub(crate) struct Index {
    items: HashMap<String, Item>,
}

impl Index {
    /// Records an object read by a list (kept only if newer than what is held).
    pub fn insert(&mut self, key: &str, item: Item) {
        match self.items.get_mut(key) {
            Some(held) if held.revision >= item.revision => {}
            Some(held) => *held = item,
            None => {
                self.items.insert(key.to_string(), item);
            }
        }
    }

    /// Applies one watch event: a write newer than what is held replaces it, a deletion newer
    /// than it removes it, anything else (replayed from before a list) is ignored. Keys of
    /// kinds not collected are ignored; an object that does not decode is dropped from the
    /// index (as a scan used to fail on it, the next full reload reports it).
    pub fn apply(&mut self, kinds: &Kinds, ev: &WatchEvent) {
        let Some(def) = kinds.of(&ev.kv.key) else {
            return;
        };
        match ev.kind {
            EventKind::Deleted => {
                if self
                    .items
                    .get(&ev.kv.key)
                    .is_some_and(|held| held.revision < ev.revision)
                {
                    self.items.remove(&ev.kv.key);
                }
            }
            EventKind::Created | EventKind::Modified => match summarize(def, &ev.kv) {
                Ok(item) => self.insert(&ev.kv.key, item),
                Err(e) => {
                    tracing::warn!("gc: {}", e.message);
                    self.items.remove(&ev.kv.key);
                }
            },
        }
    }

    /// Every object held, in no particular order.
    pub fn items(&self) -> impl Iterator<Item = &Item> {
        self.items.values()
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.items.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn def(kind: &str) -> Arc<ResourceDef> {
        let defs = ferrovirt_api::registry::resources();
        Arc::new(
            defs.into_iter()
                .find(|d| d.kind == kind && (kind != "Event" || d.group.is_empty()))
                .expect("kind"),
        )
    }

    fn kv(key: &str, obj: &Value, rev: Revision) -> KeyValue {
        KeyValue {
            key: key.into(),
            value: serde_json::to_vec(obj).unwrap(),
            create_revision: 1,
            mod_revision: rev,
        }
    }

    #[test]
    fn typed_reader_agrees_with_the_full_decode() {
        let cm = def("ConfigMap");
        let ev = def("Event");
        let objects = [
            (
                &cm,
                json!({"metadata": {"name": "a", "namespace": "ns", "uid": "u1",
                    "deletionTimestamp": "2026-01-01T00:00:00Z", "finalizers": ["orphan", "x"],
                    "ownerReferences": [{"uid": "o1", "name": "p"}, {"name": "no-uid"}]},
                    "data": {"k": "v", "big": [1, 2, {"nested": null}]}}),
            ),
            (
                &cm,
                json!({"metadata": {"name": "b", "deletionTimestamp": null}}),
            ),
            (&cm, json!({})),
            (
                &ev,
                json!({"metadata": {"name": "e", "namespace": "ns", "uid": "u2",
                    "creationTimestamp": "2026-01-01T00:00:00Z"},
                    "lastTimestamp": "2026-01-01T00:10:00Z", "eventTime": null,
                    "series": {"lastObservedTime": "2026-01-01T00:20:00Z", "count": 2}}),
            ),
            // Odd types: the typed reader refuses, the fallback reads them as before.
            (
                &cm,
                json!({"metadata": {"name": "c", "finalizers": ["f", 3], "uid": 7,
                    "ownerReferences": [{"uid": 5}, {"uid": "o2"}]}}),
            ),
            (
                &ev,
                json!({"metadata": {"name": "f", "creationTimestamp": "bad"},
                    "firstTimestamp": 12, "lastTimestamp": "2026-01-01T00:00:01Z"}),
            ),
        ];
        for (d, o) in objects {
            let kv = kv("/registry/x", &o, 9);
            let full = from_value(d, &decode(&kv).unwrap(), 9);
            assert_eq!(summarize(d, &kv).unwrap(), full, "{o}");
        }
        let e = summarize(
            &ev,
            &kv(
                "/k",
                &json!({"metadata": {"creationTimestamp": "2026-01-01T00:00:00Z"},
                "lastTimestamp": "2026-01-01T00:10:00Z"}),
                3,
            ),
        )
        .unwrap();
        let times = e.event_times.unwrap();
        assert_eq!(times.last_seen(i64::MAX), times.client.first().copied());
        // A client time in the future is ignored.
        assert_eq!(times.last_seen(times.created.unwrap()), times.created);
        assert!(
            summarize(
                &cm,
                &KeyValue {
                    value: b"{oops".to_vec(),
                    ..kv("/k", &json!({}), 1)
                }
            )
            .is_err()
        );
    }

    fn event(kind: EventKind, key: &str, name: &str, rev: Revision) -> WatchEvent {
        WatchEvent {
            kind,
            revision: rev,
            kv: kv(key, &json!({"metadata": {"name": name}}), rev),
            prev: None,
        }
    }

    #[test]
    fn events_newer_than_the_index_apply_older_ones_do_not() {
        let cms = def("ConfigMap");
        let kinds = Kinds::new(&[&cms]);
        let prefix = crate::resources::list_prefix(&cms, None);
        let key = format!("{prefix}ns/a");
        let mut idx = Index::default();
        // Listed at revision 10.
        idx.insert(
            &key,
            summarize(&cms, &kv(&key, &json!({"metadata": {"name": "a"}}), 10)).unwrap(),
        );
        // Replayed from before the list: ignored, including a deletion that came before.
        idx.apply(&kinds, &event(EventKind::Modified, &key, "old", 8));
        idx.apply(&kinds, &event(EventKind::Deleted, &key, "a", 9));
        assert_eq!(idx.items().next().unwrap().name, "a");
        // Newer: applied.
        idx.apply(&kinds, &event(EventKind::Modified, &key, "new", 11));
        assert_eq!(idx.items().next().unwrap().name, "new");
        idx.apply(&kinds, &event(EventKind::Deleted, &key, "new", 12));
        assert_eq!(idx.len(), 0);
        // Created after the list, deleted again: gone.
        idx.apply(
            &kinds,
            &event(EventKind::Created, &format!("{prefix}ns/b"), "b", 13),
        );
        assert_eq!(idx.len(), 1);
        idx.apply(
            &kinds,
            &event(EventKind::Deleted, &format!("{prefix}ns/b"), "b", 14),
        );
        assert_eq!(idx.len(), 0);
        // Keys of kinds not collected are ignored.
        idx.apply(
            &kinds,
            &event(EventKind::Created, "/registry/other/x/ns/c", "c", 15),
        );
        assert_eq!(idx.len(), 0);
        // A write that no longer decodes drops the object.
        idx.apply(&kinds, &event(EventKind::Created, &key, "a", 16));
        let mut bad = event(EventKind::Modified, &key, "a", 17);
        bad.kv.value = b"{oops".to_vec();
        idx.apply(&kinds, &bad);
        assert_eq!(idx.len(), 0);
    }

    #[test]
    fn kinds_take_the_longest_prefix() {
        let vmis = def("VirtualMachineInstance");
        let vms = def("VirtualMachine");
        let kinds = Kinds::new(&[&vms, &vmis]);
        let k = format!("{}ns/x", crate::resources::list_prefix(&vmis, None));
        assert_eq!(kinds.of(&k).unwrap().kind, "VirtualMachineInstance");
        assert!(kinds.of("/registry/none/x").is_none());
    }
}
