//! A backup's `Group` freeze (docs/backup.md, "Consistency"): every running VM of the backup
//! frozen through its guest agent (the VMI's `freeze` subresource, with the group's timeout as
//! `unfreezeTimeout`, so each launcher thaws on its own if this controller goes away) before
//! any online snapshot is taken, and all thawed (`unfreeze`) once every snapshot was taken:
//! one point in time across the VMs. A VM that cannot be frozen (no guest agent answering, a
//! failed freeze) fails the backup, and the VMs frozen before it are thawed at once; a group
//! whose snapshots were not all taken within the timeout fails too (its guests may have been
//! thawed between two snapshots). [`outlasted`] is the pure part.

use std::time::{Duration, Instant};

use kube::api::Api;
use serde_json::{Value, json};

use ferrovirt_api::kubevirt::vmi::VmiPhase;

use super::hooks::Running;
use crate::runtime::resources::Vmi;

/// The margin kept below the launchers' own thaw: a group whose snapshots ended later than
/// `hold - MARGIN` after the first freeze may have been thawed by a launcher first.
const MARGIN: Duration = Duration::from_secs(2);

/// The VMs a group freeze holds.
#[derive(Debug)]
pub(super) struct Held {
    pub vms: Vec<String>,
    /// When the first freeze was asked (wall clock, RFC 3339) and answered (monotonic).
    started: String,
    frozen_at: Instant,
    hold: Duration,
}

/// Whether snapshots that took `took` (from the first freeze) may have outlived a hold of
/// `hold` (pure).
pub fn outlasted(took: Duration, hold: Duration) -> bool {
    took + MARGIN > hold
}

fn subresource(ns: &str, vm: &str, sub: &str) -> String {
    format!("/apis/subresources.kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances/{vm}/{sub}")
}

async fn put(client: &kube::Client, path: &str, body: Value) -> Result<(), String> {
    let req = http::Request::put(path)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(serde_json::to_vec(&body).unwrap_or_default())
        .map_err(|e| e.to_string())?;
    match client.request_text(req).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) => Err(s.message),
        Err(e) => Err(e.to_string()),
    }
}

/// The running VMIs (phase Running, with a node) among `vms`, in that order: the guests that
/// can be frozen or run a command. A backup reads every *live* VM (not finished) through an
/// online snapshot (`loops::collect`), a wider set.
pub(super) async fn running(
    client: &kube::Client,
    ns: &str,
    vms: &[String],
) -> Result<Vec<Running>, String> {
    let vmis: Api<Vmi> = Api::namespaced(client.clone(), ns);
    let mut out = Vec::new();
    for vm in vms {
        let Some(vmi) = vmis.get_opt(vm).await.map_err(|e| e.to_string())? else {
            continue;
        };
        let st = vmi.0.status.unwrap_or_default();
        if st.phase == Some(VmiPhase::Running)
            && let Some(node) = st.node_name
        {
            out.push(Running {
                vm: vm.clone(),
                uid: vmi.0.metadata.uid.unwrap_or_default(),
                node,
            });
        }
    }
    Ok(out)
}

/// Freezes every VM of `running`, holding each for at most `hold`. On a failure the VMs
/// frozen so far are thawed and the error names the VM.
pub(super) async fn freeze_all(
    client: &kube::Client,
    ns: &str,
    running: &[Running],
    hold: Duration,
) -> Result<Held, String> {
    let started = k8s_openapi::jiff::Timestamp::now().to_string();
    let body = json!({"unfreezeTimeout": format!("{}s", hold.as_secs().max(1))});
    let mut held = Held {
        vms: Vec::new(),
        started,
        frozen_at: Instant::now(),
        hold,
    };
    for r in running {
        let vm = &r.vm;
        if let Err(e) = put(client, &subresource(ns, vm, "freeze"), body.clone()).await {
            thaw_all(client, ns, held).await;
            return Err(format!(
                "group freeze: VirtualMachine {ns}/{vm} could not be frozen: {e}"
            ));
        }
        if held.vms.is_empty() {
            held.frozen_at = Instant::now();
        }
        held.vms.push(vm.clone());
    }
    tracing::info!(namespace = %ns, vms = ?held.vms, "group freeze: all frozen");
    Ok(held)
}

/// What a group freeze did, for the Backup's status.
#[derive(Debug)]
pub(super) struct Thawed {
    pub status: Value,
    /// The snapshots may have been taken after a launcher's own thaw.
    pub outlasted: bool,
    pub held: Duration,
}

/// Thaws every VM of `held` (a thaw that fails is logged: its launcher thaws at the
/// deadline on its own).
pub(super) async fn thaw_all(client: &kube::Client, ns: &str, held: Held) -> Thawed {
    let took = held.frozen_at.elapsed();
    for vm in &held.vms {
        if let Err(e) = put(client, &subresource(ns, vm, "unfreeze"), json!({})).await {
            tracing::warn!(namespace = %ns, %vm, "group freeze: unfreeze failed: {e}");
        }
    }
    Thawed {
        status: json!({
            "virtualMachines": held.vms,
            "startTime": held.started,
            "endTime": k8s_openapi::jiff::Timestamp::now().to_string(),
            "heldSeconds": (took.as_secs_f64() * 1000.0).round() / 1000.0,
        }),
        outlasted: outlasted(took, held.hold),
        held: took,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_outlasts_its_hold_with_a_margin() {
        let s = Duration::from_secs;
        assert!(!outlasted(s(10), s(60)));
        assert!(outlasted(s(59), s(60)));
        assert!(outlasted(s(61), s(60)));
    }

    #[test]
    fn subresource_paths() {
        assert_eq!(
            subresource("ns", "vm1", "freeze"),
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachineinstances/vm1/freeze"
        );
    }
}
