//! The node's shared filesystems (docs/storage.md, "Shared filesystems across machines"):
//! a reflector cache of the StorageClasses (one list at start, then a watch) and a loop that
//! checks, on every class change and every [`super::AgentOptions::renew_interval`], the mount
//! of each class declaring `ferrovirt.io/shared-mount` (its marker, see
//! `ferrovirt_storage::shared_mount`). What it finds is written to the Node only when it
//! changes: the [`names::CONDITION`] condition (kept in [`super::Agent`] so that the
//! heartbeat's status patch carries it too) and the [`names::MOUNTED_ANNOTATION`]
//! the scheduler reads.

use std::sync::Arc;
use std::time::Duration;

use ferrovirt_api::shared_mount as names;
use ferrovirt_storage::shared_mount::{self, MountState};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, NodeCondition};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, watcher};
use kube::runtime::{WatchStreamExt, reflector as reflect};
use serde_json::json;

use super::{Agent, kube_err, node, now_ts};
use crate::error::AgentError;

/// The declared mounts of `classes` as this node sees them (`check` reads the marker), in
/// class-name order; a class whose parameter is not a usable path is reported missing with
/// the reason.
pub fn states(
    classes: &[Arc<StorageClass>],
    check: impl Fn(&str, &str, &std::path::Path) -> MountState,
) -> Vec<MountState> {
    let mut out: Vec<MountState> = classes
        .iter()
        .filter_map(|c| {
            let name = c.metadata.name.clone()?;
            let declared = names::declared(&c.provisioner, c.parameters.as_ref())?;
            Some(match declared {
                Ok(mount) => check(&name, c.metadata.uid.as_deref().unwrap_or(""), &mount),
                Err(e) => MountState {
                    class: name,
                    mount: Default::default(),
                    problem: Some(e),
                },
            })
        })
        .collect();
    out.sort_by(|a, b| a.class.cmp(&b.class));
    out
}

/// The Node condition for `states`; the transition time of `previous` is kept while the
/// status stays the same.
pub fn condition(
    states: &[MountState],
    previous: Option<&NodeCondition>,
    now: Timestamp,
) -> NodeCondition {
    let (status, reason, message) = shared_mount::condition(states);
    let transition = previous
        .filter(|p| p.status == status)
        .and_then(|p| p.last_transition_time.clone())
        .unwrap_or(Time(now));
    NodeCondition {
        type_: names::CONDITION.into(),
        status: status.into(),
        reason: Some(reason.into()),
        message: Some(message),
        last_heartbeat_time: Some(Time(now)),
        last_transition_time: Some(transition),
    }
}

/// Keeps the StorageClass cache and the Node's shared-mount report up to date.
pub(super) async fn run(agent: Arc<Agent>) {
    let (store, writer) = reflector::store::<StorageClass>();
    let (changed_tx, mut changed) = tokio::sync::mpsc::unbounded_channel::<()>();
    let api: Api<StorageClass> = Api::all(agent.client.clone());
    let watch = async move {
        let mut events = reflect(writer, watcher(api, watcher::Config::default()))
            .default_backoff()
            .boxed();
        while let Some(ev) = events.next().await {
            match ev {
                Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => continue,
                Ok(_) => {
                    if changed_tx.send(()).is_err() {
                        return;
                    }
                }
                Err(e) => tracing::warn!("watching StorageClasses: {e}"),
            }
        }
    };
    tokio::select! {
        _ = watch => {}
        _ = report_loop(&agent, &store, &mut changed) => {}
    }
}

async fn report_loop(
    agent: &Agent,
    store: &Store<StorageClass>,
    changed: &mut tokio::sync::mpsc::UnboundedReceiver<()>,
) {
    if store.wait_until_ready().await.is_err() {
        return;
    }
    let mut last_annotation: Option<String> = None;
    let period = agent.opts.renew_interval.max(Duration::from_secs(1));
    loop {
        let classes = store.state();
        let found = tokio::task::spawn_blocking(move || states(&classes, shared_mount::check))
            .await
            .unwrap_or_default();
        let annotation = shared_mount::mounted_list(&found);
        let previous = agent.shared_mounts.lock().await.clone();
        let cond = condition(&found, previous.as_ref(), now_ts());
        let same_status = previous.as_ref().is_some_and(|p| {
            p.status == cond.status && p.reason == cond.reason && p.message == cond.message
        });
        if !same_status || last_annotation.as_deref() != Some(annotation.as_str()) {
            for s in &found {
                match &s.problem {
                    None => {
                        tracing::info!(class = %s.class, mount = %s.mount.display(), "shared mount present")
                    }
                    Some(why) => tracing::warn!(class = %s.class, "shared mount missing: {why}"),
                }
            }
            *agent.shared_mounts.lock().await = Some(cond.clone());
            match write(agent, &annotation).await {
                Ok(()) => last_annotation = Some(annotation),
                Err(e) => tracing::warn!("reporting shared mounts: {e}"),
            }
        }
        tokio::select! {
            _ = changed.recv() => {
                while changed.try_recv().is_ok() {}
            }
            _ = tokio::time::sleep(period) => {}
        }
    }
}

/// Writes the annotation and the node's conditions (Ready and the shared-mount one).
async fn write(agent: &Agent, annotation: &str) -> Result<(), AgentError> {
    let nodes: Api<Node> = Api::all(agent.client.clone());
    let name = &agent.opts.node_name;
    let meta = json!({"metadata": {"annotations": {names::MOUNTED_ANNOTATION: annotation}}});
    nodes
        .patch(name, &PatchParams::default(), &Patch::Merge(&meta))
        .await
        .map_err(kube_err)?;
    // Through the status report, so a condition whose status did not change keeps its
    // lastTransitionTime (and an unchanged set is not written again).
    node::report_status(&nodes, name, agent.node_conditions().await, now_ts())
        .await
        .map_err(kube_err)?;
    Ok(())
}

impl Agent {
    /// The conditions the agent reports on its Node: Ready, and the shared-mount one once
    /// known.
    pub(super) async fn node_conditions(&self) -> Vec<NodeCondition> {
        let mut v = vec![node::ready_condition(now_ts())];
        if let Some(c) = self.shared_mounts.lock().await.clone() {
            v.push(c);
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn class(name: &str, mount: Option<&str>) -> Arc<StorageClass> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": name, "uid": format!("uid-{name}")},
                "provisioner": names::PROVISIONER,
                "parameters": mount.map(|m| json!({names::MOUNT_PARAMETER: m})),
            }))
            .unwrap(),
        )
    }

    #[test]
    fn declared_classes_are_checked_and_reported() {
        let classes = [
            class("zeta", Some("/mnt/z")),
            class("shared", None),
            class("alpha", Some("/mnt/a")),
            class("bad", Some("relative")),
        ];
        let found = states(&classes, |c, uid, m| {
            let read = |_: &std::path::Path| {
                if m == std::path::Path::new("/mnt/a") {
                    Ok(format!("{uid}\n"))
                } else {
                    Err(std::io::Error::from(std::io::ErrorKind::NotFound))
                }
            };
            shared_mount::check_with(c, uid, m, read)
        });
        let names: Vec<&str> = found.iter().map(|s| s.class.as_str()).collect();
        assert_eq!(names, ["alpha", "bad", "zeta"]);
        assert_eq!(shared_mount::mounted_list(&found), "alpha");
        let t0 = Timestamp::from_second(1_700_000_000).unwrap();
        let t1 = Timestamp::from_second(1_700_000_100).unwrap();
        let c0 = condition(&found, None, t0);
        assert_eq!(c0.status, "False");
        let msg = c0.message.clone().unwrap();
        assert!(
            msg.contains("StorageClass \"zeta\": /mnt/z is not mounted"),
            "{msg}"
        );
        assert!(msg.contains("ferrovirt.io/shared-mount"), "{msg}");
        // Same status: the transition time stays; a new status moves it.
        assert_eq!(
            condition(&found, Some(&c0), t1).last_transition_time,
            Some(Time(t0))
        );
        let ok = condition(&found[..1], Some(&c0), t1);
        assert_eq!(ok.status, "True");
        assert_eq!(ok.last_transition_time, Some(Time(t1)));
    }
}
