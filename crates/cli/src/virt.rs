//! virtctl's VM verbs on KubeVirt's subresources (`/apis/subresources.kubevirt.io/v1/...`):
//! start, stop, restart, pause, unpause, soft-reboot, guestosinfo, userlist, fslist. The paths
//! and messages are pure functions; [`call`] sends the request.

use crate::error::CliError;
use crate::target::Target;

/// A VM verb.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Start,
    Stop,
    Restart,
    Pause,
    Unpause,
    SoftReboot,
    GuestOsInfo,
    UserList,
    FsList,
}

impl Verb {
    /// (resource plural, subresource, HTTP method).
    pub fn route(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Verb::Start => ("virtualmachines", "start", "PUT"),
            Verb::Stop => ("virtualmachines", "stop", "PUT"),
            Verb::Restart => ("virtualmachines", "restart", "PUT"),
            Verb::Pause => ("virtualmachineinstances", "pause", "PUT"),
            Verb::Unpause => ("virtualmachineinstances", "unpause", "PUT"),
            Verb::SoftReboot => ("virtualmachineinstances", "softreboot", "PUT"),
            Verb::GuestOsInfo => ("virtualmachineinstances", "guestosinfo", "GET"),
            Verb::UserList => ("virtualmachineinstances", "userlist", "GET"),
            Verb::FsList => ("virtualmachineinstances", "filesystemlist", "GET"),
        }
    }

    /// What virtctl prints after a state change (None: the verb prints the server's answer).
    pub fn done_message(self, name: &str) -> Option<String> {
        let (kind, what) = match self {
            Verb::Start => ("VM", "start"),
            Verb::Stop => ("VM", "stop"),
            Verb::Restart => ("VM", "restart"),
            Verb::Pause => ("VMI", "pause"),
            Verb::Unpause => ("VMI", "unpause"),
            Verb::SoftReboot => ("VMI", "soft reboot"),
            _ => return None,
        };
        Some(format!("{kind} {name} was scheduled to {what}"))
    }
}

/// The URL path of `verb` on `name` in `namespace`.
pub fn path(verb: Verb, namespace: &str, name: &str) -> String {
    let (plural, sub, _) = verb.route();
    format!("/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/{plural}/{name}/{sub}")
}

/// Sends `verb` and returns what to print.
pub async fn call(
    target: &Target,
    verb: Verb,
    name: &str,
    grace_period: Option<i64>,
) -> Result<String, CliError> {
    let client = target.client().await?;
    let (_, _, method) = verb.route();
    let body = match (verb, grace_period) {
        (Verb::Stop, Some(g)) => serde_json::json!({ "gracePeriod": g }).to_string(),
        (Verb::Stop | Verb::Start | Verb::Restart, _) => "{}".to_string(),
        _ => String::new(),
    };
    let req = http::Request::builder()
        .method(method)
        .uri(path(verb, &target.namespace, name))
        .header("Content-Type", "application/json")
        .body(body.into_bytes())
        .map_err(|e| CliError::Transport(e.to_string()))?;
    match client.request_text(req).await {
        Ok(text) => Ok(match verb.done_message(name) {
            Some(m) => m,
            None => serde_json::from_str::<serde_json::Value>(&text)
                .and_then(|v| serde_json::to_string_pretty(&v))
                .unwrap_or(text),
        }),
        Err(e) => Err(CliError::from_kube(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_messages() {
        assert_eq!(
            path(Verb::Start, "ns", "vm1"),
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachines/vm1/start"
        );
        assert_eq!(
            path(Verb::FsList, "default", "a"),
            "/apis/subresources.kubevirt.io/v1/namespaces/default/virtualmachineinstances/a/filesystemlist"
        );
        assert_eq!(
            Verb::Pause.done_message("a").as_deref(),
            Some("VMI a was scheduled to pause")
        );
        assert!(Verb::GuestOsInfo.done_message("a").is_none());
    }
}
