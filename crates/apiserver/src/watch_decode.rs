//! Store events decoded once for every watch. Each write reaches every watch on its kind (with
//! one watch per node agent, a hundred or more for VMIs), and every watch used to parse the
//! object and its previous state itself only to find, in all but one, that its selector does
//! not match. [`DecodeCache`] keeps the last [`CAPACITY`] decoded events, keyed by revision and
//! key, so that the first watch to see an event parses it and the others match against that
//! shared copy; only a watch that sends the event clones it. Written here rather than taken from
//! a crate: it is a bounded map in front of [`crate::objects::decode`], nothing more.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use ferrovirt_store::{Revision, WatchEvent};
use serde_json::Value;

/// Decoded events kept (watches see an event within moments of each other).
pub(crate) const CAPACITY: usize = 512;

/// One store event, decoded (with `resourceVersion` set, as [`crate::objects::decode`] does).
#[derive(Debug)]
pub(crate) struct DecodedEvent {
    pub cur: Value,
    pub prev: Option<Value>,
    /// `cur` serialised, made by the first watch that sends it and reused by the others.
    json: std::sync::OnceLock<bytes::Bytes>,
}

impl DecodedEvent {
    /// `cur` as JSON bytes, serialised once for every watch that sends this event.
    pub(crate) fn cur_json(&self) -> bytes::Bytes {
        self.json
            .get_or_init(|| bytes::Bytes::from(serde_json::to_vec(&self.cur).unwrap_or_default()))
            .clone()
    }
}

#[derive(Debug, Default)]
struct Inner {
    map: HashMap<(Revision, String), Arc<DecodedEvent>>,
    order: VecDeque<(Revision, String)>,
}

/// The shared, bounded cache of decoded events.
#[derive(Debug, Default)]
pub(crate) struct DecodeCache {
    inner: Mutex<Inner>,
}

impl DecodeCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The decoded form of `ev`, parsed now unless another watch already did; `None` when the
    /// stored bytes do not decode (the caller reports that error its own way).
    pub(crate) fn get(&self, ev: &WatchEvent) -> Option<Arc<DecodedEvent>> {
        let k = (ev.revision, ev.kv.key.clone());
        if let Some(d) = self.lock().map.get(&k) {
            return Some(d.clone());
        }
        let cur = crate::objects::decode(&ev.kv).ok()?;
        let prev = match &ev.prev {
            Some(p) => Some(crate::objects::decode(p).ok()?),
            None => None,
        };
        let d = Arc::new(DecodedEvent {
            cur,
            prev,
            json: Default::default(),
        });
        let mut inner = self.lock();
        if let Some(existing) = inner.map.get(&k) {
            return Some(existing.clone());
        }
        inner.map.insert(k.clone(), d.clone());
        inner.order.push_back(k);
        while inner.order.len() > CAPACITY {
            if let Some(old) = inner.order.pop_front() {
                inner.map.remove(&old);
            }
        }
        Some(d)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrovirt_store::{EventKind, KeyValue};

    fn ev(rev: Revision, key: &str, body: &str) -> WatchEvent {
        WatchEvent {
            kind: EventKind::Modified,
            revision: rev,
            kv: KeyValue {
                key: key.into(),
                value: body.as_bytes().to_vec(),
                create_revision: 1,
                mod_revision: rev,
            },
            prev: Some(KeyValue {
                key: key.into(),
                value: br#"{"metadata":{"name":"a"},"v":0}"#.to_vec(),
                create_revision: 1,
                mod_revision: 1,
            }),
        }
    }

    #[test]
    fn decodes_once_and_shares() {
        let c = DecodeCache::default();
        let e = ev(5, "/k/a", r#"{"metadata":{"name":"a"},"v":1}"#);
        let a = c.get(&e).unwrap();
        let b = c.get(&e).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(a.cur["v"], 1);
        assert_eq!(a.cur["metadata"]["resourceVersion"], "5");
        assert_eq!(a.prev.as_ref().unwrap()["v"], 0);
        // Another key at another revision is another entry.
        let other = c
            .get(&ev(6, "/k/b", r#"{"metadata":{"name":"b"}}"#))
            .unwrap();
        assert!(!Arc::ptr_eq(&a, &other));
    }

    #[test]
    fn corrupt_bytes_are_not_cached() {
        let c = DecodeCache::default();
        assert!(c.get(&ev(5, "/k/a", "{not json")).is_none());
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn bounded() {
        let c = DecodeCache::default();
        for i in 0..(CAPACITY as i64 + 10) {
            c.get(&ev(i + 2, "/k/a", r#"{"metadata":{"name":"a"}}"#))
                .unwrap();
        }
        assert_eq!(c.len(), CAPACITY);
    }
}
