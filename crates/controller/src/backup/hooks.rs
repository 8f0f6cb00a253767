//! A backup's guest commands (docs/backup.md "Consistency"): `preFreezeCommand` in every
//! running VM of the backup before the first snapshot, `postThawCommand` after the last, each
//! run through the VM's node agent (`POST /vmis/<uid>/exec`, the controllers' agent token;
//! no subresource exposes it) and the guest agent's `guest-exec`. A non-zero exit, a timeout
//! or a VM whose guest agent does not answer fails the backup with the VM named and the
//! command's standard error (its tail). [`outcome`] is the pure part.

use std::time::Duration;

use base64::Engine;
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use serde_json::json;

use ferrovirt_agent::nodestore::client::{NodeStorage, json_body};
use ferrovirt_launcher::guestexec::ExecDone;

/// A running VMI a command runs in.
#[derive(Debug, Clone)]
pub(super) struct Running {
    pub vm: String,
    pub uid: String,
    pub node: String,
}

/// How much of a failed command's standard error the reason keeps.
const STDERR_TAIL: usize = 400;

/// `Ok` for a zero exit, else the reason naming `what`, the VM and the output's tail (pure).
pub fn outcome(what: &str, ns: &str, vm: &str, done: &ExecDone) -> Result<(), String> {
    if done.exit_code == 0 {
        return Ok(());
    }
    let engine = base64::engine::general_purpose::STANDARD;
    let decode =
        |d: &str| String::from_utf8_lossy(&engine.decode(d).unwrap_or_default()).into_owned();
    let err = decode(&done.err_data);
    let out = if err.trim().is_empty() {
        decode(&done.out_data)
    } else {
        err
    };
    let out = out.trim();
    let tail: String = {
        let start = out.len().saturating_sub(STDERR_TAIL);
        let start = (start..=out.len())
            .find(|i| out.is_char_boundary(*i))
            .unwrap_or(0);
        out[start..].to_string()
    };
    Err(format!(
        "{what} in VirtualMachine {ns}/{vm} exited with {}: {tail}",
        done.exit_code
    ))
}

/// Where and how a backup's commands run.
pub(super) struct Guests<'a> {
    pub client: &'a kube::Client,
    /// The controllers' agent token.
    pub token: Option<&'a str>,
    pub ns: &'a str,
    pub running: &'a [Running],
    /// Each command's limit.
    pub timeout: Duration,
}

/// The VMs a `postThawCommand` runs in (pure): those the `preFreezeCommand` was started in —
/// the first `pre_reached` of `running`, the one whose command failed included (it may have
/// done part of its work) — or all of them when there was no pre command.
pub(super) fn post_targets(running: &[Running], pre_reached: Option<usize>) -> &[Running] {
    match pre_reached {
        Some(n) => &running[..n.min(running.len())],
        None => running,
    }
}

impl Guests<'_> {
    /// Runs `command` (`what`: its field's name) in each VMI, one after the other; the first
    /// failure ends it. Also says in how many VMIs the command was started.
    pub(super) async fn run_all(
        &self,
        command: &[String],
        what: &str,
    ) -> (usize, Result<(), String>) {
        self.run_in(self.running, command, what).await
    }

    /// [`Self::run_all`] over `vms` only.
    pub(super) async fn run_in(
        &self,
        vms: &[Running],
        command: &[String],
        what: &str,
    ) -> (usize, Result<(), String>) {
        for (i, r) in vms.iter().enumerate() {
            if let Err(e) = self.run_one(r, command, what).await {
                return (i + 1, Err(e));
            }
        }
        (vms.len(), Ok(()))
    }

    /// Runs one command through the VMI's node agent. The Node is read for each command (at
    /// most two per VM and backup): its published agent endpoint is then never stale, e.g.
    /// after an agent restart between the pre and the post command.
    async fn run_one(&self, r: &Running, command: &[String], what: &str) -> Result<(), String> {
        let ns = self.ns;
        let fail = |e: String| format!("{what} in VirtualMachine {ns}/{}: {e}", r.vm);
        let token = self
            .token
            .ok_or_else(|| fail("the server has no agent token to reach the node".into()))?;
        let node = Api::<Node>::all(self.client.clone())
            .get_opt(&r.node)
            .await
            .map_err(|e| fail(e.to_string()))?
            .ok_or_else(|| fail(format!("node {} does not exist", r.node)))?;
        let agent = NodeStorage::of(&node, token).map_err(|e| fail(e.to_string()))?;
        let body = json!({"command": command, "timeoutSeconds": self.timeout.as_secs().max(1)});
        let resp = agent
            .send(
                http::Method::POST,
                &format!("/vmis/{}/exec", r.uid),
                json_body(serde_json::to_vec(&body).unwrap_or_default()),
                "application/json",
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
        let bytes = http_body_util::Limited::new(resp.into_body(), 1 << 20)
            .collect()
            .await
            .map_err(|e| fail(format!("reading the agent's answer: {e}")))?
            .to_bytes();
        let done: ExecDone =
            serde_json::from_slice(&bytes).map_err(|e| fail(format!("the agent's answer: {e}")))?;
        tracing::info!(namespace = %ns, vm = %r.vm, exit = done.exit_code, "{what} ran");
        outcome(what, ns, &r.vm, &done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn post_thaw_runs_only_where_pre_freeze_was_started() {
        let vms: Vec<Running> = ["a", "b", "c"]
            .iter()
            .map(|v| Running {
                vm: v.to_string(),
                uid: format!("u-{v}"),
                node: "n".into(),
            })
            .collect();
        let names = |r: &[Running]| r.iter().map(|r| r.vm.clone()).collect::<Vec<_>>();
        assert_eq!(names(post_targets(&vms, None)), ["a", "b", "c"]);
        assert_eq!(names(post_targets(&vms, Some(3))), ["a", "b", "c"]);
        // b's pre command failed: a and b get the post command, c never saw a pre.
        assert_eq!(names(post_targets(&vms, Some(2))), ["a", "b"]);
        assert!(post_targets(&vms, Some(0)).is_empty());
    }

    #[test]
    fn a_failed_command_names_the_vm_and_its_output() {
        let ok = ExecDone {
            exit_code: 0,
            out_data: String::new(),
            err_data: String::new(),
        };
        assert_eq!(outcome("preFreezeCommand", "ns", "vm1", &ok), Ok(()));
        let e = base64::engine::general_purpose::STANDARD;
        let bad = ExecDone {
            exit_code: 3,
            out_data: e.encode("ignored"),
            err_data: e.encode("database busy\n"),
        };
        assert_eq!(
            outcome("preFreezeCommand", "ns", "vm1", &bad).unwrap_err(),
            "preFreezeCommand in VirtualMachine ns/vm1 exited with 3: database busy"
        );
        let quiet = ExecDone {
            exit_code: 1,
            out_data: e.encode("x".repeat(1000)),
            err_data: String::new(),
        };
        let msg = outcome("postThawCommand", "ns", "vm2", &quiet).unwrap_err();
        assert!(msg.ends_with(&"x".repeat(STDERR_TAIL)), "{msg}");
        assert!(!msg.contains(&"x".repeat(STDERR_TAIL + 1)), "{msg}");
    }
}
