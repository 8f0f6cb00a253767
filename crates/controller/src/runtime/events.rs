//! Emitting core/v1 Events about objects (VMs, VMIs, Nodes). Failures to record an Event are
//! logged and otherwise ignored.

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};

/// Records Events as one component.
#[derive(Clone)]
pub struct EventRecorder {
    client: kube::Client,
    component: String,
}

impl std::fmt::Debug for EventRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventRecorder")
            .field("component", &self.component)
            .finish()
    }
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
        Self {
            client,
            component: component.into(),
        }
    }

    /// Record one Event (type `Warning` when `warning`, else `Normal`).
    pub async fn record(
        &self,
        object: &ObjectReference,
        warning: bool,
        reason: &str,
        message: &str,
    ) {
        let now = Timestamp::now();
        let namespace = object.namespace.clone().unwrap_or_else(|| "default".into());
        let name = format!(
            "{}.{:x}",
            object.name.as_deref().unwrap_or("object"),
            now.as_nanosecond()
        );
        let event = Event {
            metadata: ObjectMeta {
                name: Some(name),
                namespace: Some(namespace.clone()),
                ..Default::default()
            },
            involved_object: object.clone(),
            reason: Some(reason.into()),
            message: Some(message.into()),
            type_: Some(if warning { "Warning" } else { "Normal" }.into()),
            count: Some(1),
            first_timestamp: Some(Time(now)),
            last_timestamp: Some(Time(now)),
            event_time: Some(MicroTime(now)),
            action: Some(reason.into()),
            reporting_component: Some(self.component.clone()),
            reporting_instance: Some(self.component.clone()),
            source: Some(EventSource {
                component: Some(self.component.clone()),
                host: None,
            }),
            related: None,
            series: None,
        };
        let api: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        if let Err(e) = api.create(&PostParams::default(), &event).await {
            tracing::warn!(%reason, error = %e, "recording event failed");
        }
    }
}
