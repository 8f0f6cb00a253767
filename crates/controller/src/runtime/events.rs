//! Emitting Events about objects (VMs, VMIs, Nodes) through kube-rs's `Recorder`
//! (events.k8s.io/v1, repeated events folded into a series; the API server serves them as core/v1
//! Events too). Failures to record an Event are logged and otherwise ignored.

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

/// The longest Event note the Events API accepts (1 kB).
const MAX_NOTE_BYTES: usize = 1024;

/// Records Events as one component.
#[derive(Clone)]
pub struct EventRecorder {
    recorder: Recorder,
    component: String,
}

impl std::fmt::Debug for EventRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventRecorder")
            .field("component", &self.component)
            .finish()
    }
}

/// `s` cut to at most `max` bytes on a character boundary.
fn truncated(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// An ObjectReference for an Event's `involvedObject`.
pub fn object_ref(api_version: &str, kind: &str, meta: &ObjectMeta) -> ObjectReference {
    ObjectReference {
        api_version: Some(api_version.into()),
        kind: Some(kind.into()),
        name: meta.name.clone(),
        namespace: meta.namespace.clone(),
        uid: meta.uid.clone(),
        resource_version: meta.resource_version.clone(),
        field_path: None,
    }
}

impl EventRecorder {
    /// A recorder reporting as `component` (e.g. `virtualmachine-controller`).
    pub fn new(client: kube::Client, component: &str) -> Self {
        let reporter = Reporter {
            controller: component.into(),
            instance: None,
        };
        Self {
            recorder: Recorder::new(client, reporter),
            component: component.into(),
        }
    }

    /// Record one Event (type `Warning` when `warning`, else `Normal`); the reason is also the
    /// action.
    pub async fn record(
        &self,
        object: &ObjectReference,
        warning: bool,
        reason: &str,
        message: &str,
    ) {
        let ev = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: truncated(reason, 128).into(),
            note: Some(truncated(message, MAX_NOTE_BYTES).into()),
            action: truncated(reason, 128).into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, object).await {
            tracing::warn!(%reason, error = %e, "recording event failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_are_cut_on_a_character_boundary() {
        assert_eq!(truncated("abc", 2), "ab");
        assert_eq!(truncated("aé", 2), "a");
        assert_eq!(truncated("short", 1024), "short");
    }
}
