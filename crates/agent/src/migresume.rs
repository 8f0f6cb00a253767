//! A migration this node was sending when its agent restarted (docs/migration.md "Agent
//! restarts"): the pure decision of what the restarted source agent does, from what the VMI
//! says and what its launcher's QEMU says (`query-migrate`). The stream is QEMU's own and
//! survives the restart; the agent picks up following it exactly as the original path does,
//! and where nothing can be known it fails safe (the migration failed, the target abandons
//! its launcher: never a guest running on a node the VMI does not name). And, on the target
//! of a block migration, whether the copies still have to be taken over once the guest runs
//! there ([`target_finish_pending`]).

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use serde_json::Value;

/// What the source's launcher told about the migration.
#[derive(Debug, Clone, Copy)]
pub enum LauncherView<'a> {
    /// The launcher answered `query-migrate` with this.
    Answered(&'a Value),
    /// No launcher (none running, or it exited): its QEMU is gone.
    Gone,
    /// A launcher runs but did not answer (busy, timed out): ask again later.
    NoAnswer,
}

/// What the restarted source agent does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// Not an unfinished migration this node sends, or already driven by this agent.
    Nothing,
    /// QEMU is still sending: follow it as the original path does.
    Follow,
    /// QEMU completed it: the switch-over write, then `MigratedAway`.
    SwitchOver,
    /// It failed (or never started, or cannot be known): record the failure with this
    /// reason; the source keeps running if its QEMU does.
    Fail(String),
    /// Ask the launcher again at the next reconcile.
    Retry,
    /// The stream broke in post-copy: the guest is lost, the VMI fails
    /// ([`crate::postcopy::Action::Lost`]).
    Lost(String),
}

/// Whether `vmi` is a migration this node (`node`) started sending and that is not finished,
/// and this agent (`driving`: it already follows it) is not following it.
pub fn resumable(vmi: &VirtualMachineInstance, node: &str, driving: bool) -> bool {
    let Some(status) = vmi.status.as_ref() else {
        return false;
    };
    let Some(st) = status.migration_state.as_ref() else {
        return false;
    };
    !driving
        && status.node_name.as_deref() == Some(node)
        && st.source_node.as_deref() == Some(node)
        && st.start_timestamp.is_some()
        && !ferrovirt_api::migration::finished(st)
}

/// The decision for `vmi` (read fresh from the API) on `node`; `block`: node-local disks are
/// mirrored (QEMU to QEMU: their NBD connections survive this agent, as the stream does).
pub fn resume_step(
    vmi: &VirtualMachineInstance,
    node: &str,
    driving: bool,
    block: bool,
    launcher: LauncherView<'_>,
) -> Resume {
    if !resumable(vmi, node, driving) {
        return Resume::Nothing;
    }
    let v = match launcher {
        LauncherView::NoAnswer => return Resume::Retry,
        LauncherView::Gone => {
            return Resume::Fail(
                "the source agent restarted during the migration and the source launcher is \
                 gone: whether the target received the VM cannot be known, so the migration \
                 is failed (the target abandons its launcher)"
                    .into(),
            );
        }
        LauncherView::Answered(v) => v,
    };
    let status = v["status"].as_str().unwrap_or("none");
    let post_copy = vmi
        .status
        .as_ref()
        .and_then(|s| s.migration_state.as_ref())
        .and_then(|m| m.mode.as_deref())
        == Some(crate::postcopy::MODE_POST_COPY);
    match status {
        "completed" => Resume::SwitchOver,
        "failed" | "cancelled" if !post_copy => Resume::Fail(format!(
            "QEMU: migration {status}: {}",
            v["error-desc"].as_str().unwrap_or("no reason given")
        )),
        // The agent went away after writing startTimestamp and before QEMU started sending:
        // with node-local disks, while their mirrors copied (the memory stream, set up after
        // the copy, does not exist yet). Failing cancels the mirrors; the source keeps its
        // disks.
        "none" if block => Resume::Fail(
            "the source agent restarted while the disks were being copied, before the memory \
             was sent: the disk mirrors are cancelled"
                .into(),
        ),
        "none" => Resume::Fail(
            "the source agent restarted before the migration stream started; nothing was sent"
                .into(),
        ),
        // Already stopping: following it sees it end.
        "cancelling" => Resume::Follow,
        // Post-copy: the guest runs on the target, so QEMU is followed to completion, never
        // cancelled, and the source is never resumed (`cont`); a stream broken after the
        // switch (QEMU's post-copy pause) is recovered by the follow loop; a failure once the
        // VMI says post-copy lost the guest.
        s if crate::postcopy::in_post_copy(s) || post_copy => {
            match crate::postcopy::decide(&crate::postcopy::Poll {
                qemu_status: s,
                post_copy_requested: post_copy,
                ..Default::default()
            }) {
                crate::postcopy::Action::Lost(why) => Resume::Lost(why),
                _ => Resume::Follow,
            }
        }
        // Sending the memory, with or without disk mirrors: the mirrors' NBD connections and
        // the stream are QEMU's own, so a block migration is followed like any other (its
        // mirrors completed at the pre-switchover pause).
        _ => Resume::Follow,
    }
}

/// Target of a block migration: whether this node (`node`) must still take its copies over
/// (unmark them, move the PVs, stop the NBD server once the guest runs here) — after an agent
/// restart nothing else remembers it. `launcher`: this node has the VMI's launcher directory;
/// `marked`: copies marked for the VMI are in this node's volume root; `busy`: this agent
/// already does it (or is still preparing the target). Not for a failed migration (the
/// copies are abandoned) or a deleted VMI.
pub fn target_finish_pending(
    vmi: &VirtualMachineInstance,
    node: &str,
    launcher: bool,
    marked: bool,
    busy: bool,
) -> bool {
    let Some(st) = vmi.status.as_ref().and_then(|s| s.migration_state.as_ref()) else {
        return false;
    };
    launcher
        && marked
        && !busy
        && st.target_node.as_deref() == Some(node)
        && st.failed != Some(true)
        && vmi.metadata.deletion_timestamp.is_none()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vmi(bound: &str, st: Value) -> VirtualMachineInstance {
        serde_json::from_value(json!({"metadata": {"name": "v", "uid": "u"},
            "status": {"phase": "Running", "nodeName": bound, "migrationState": st}}))
        .unwrap()
    }

    fn started() -> Value {
        json!({"migrationUid": "m", "sourceNode": "n1", "targetNode": "n2",
               "startTimestamp": "2026-01-01T00:00:00Z"})
    }

    fn with(mut st: Value, k: &str, v: Value) -> Value {
        st[k] = v;
        st
    }

    const STATES: [&str; 9] = [
        "none",
        "setup",
        "active",
        "pre-switchover",
        "device",
        "cancelling",
        "cancelled",
        "failed",
        "completed",
    ];

    #[test]
    fn every_qemu_state_on_an_unfinished_started_migration() {
        let v = vmi("n1", started());
        for block in [false, true] {
            for s in STATES {
                let q = json!({"status": s, "error-desc": "boom"});
                let got = resume_step(&v, "n1", false, block, LauncherView::Answered(&q));
                let want = match (s, block) {
                    ("completed", _) => Resume::SwitchOver,
                    ("failed", _) => Resume::Fail("QEMU: migration failed: boom".into()),
                    ("cancelled", _) => Resume::Fail("QEMU: migration cancelled: boom".into()),
                    ("none", false) => Resume::Fail(
                        "the source agent restarted before the migration stream started; \
                         nothing was sent"
                            .into(),
                    ),
                    ("none", true) => Resume::Fail(
                        "the source agent restarted while the disks were being copied, before \
                         the memory was sent: the disk mirrors are cancelled"
                            .into(),
                    ),
                    _ => Resume::Follow,
                };
                assert_eq!(got, want, "{s} block={block}");
            }
        }
    }

    #[test]
    fn a_gone_launcher_fails_safe_and_a_silent_one_is_asked_again() {
        let v = vmi("n1", started());
        match resume_step(&v, "n1", false, false, LauncherView::Gone) {
            Resume::Fail(why) => assert!(why.contains("cannot be known"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            resume_step(&v, "n1", false, false, LauncherView::NoAnswer),
            Resume::Retry
        );
    }

    #[test]
    fn nothing_unless_the_vmi_says_this_node_sends_an_unfinished_started_migration() {
        let q = json!({"status": "completed"});
        let cases = [
            // Not started yet: the original path (source_step) starts it.
            vmi("n1", with(started(), "startTimestamp", Value::Null)),
            // Finished either way.
            vmi("n1", with(started(), "completed", json!(true))),
            vmi("n1", with(started(), "failed", json!(true))),
            // The VMI already names the target (switched over).
            vmi("n2", started()),
            // Another node sends it.
            vmi("n1", with(started(), "sourceNode", json!("n3"))),
        ];
        for v in &cases {
            for view in [
                LauncherView::Answered(&q),
                LauncherView::Gone,
                LauncherView::NoAnswer,
            ] {
                assert_eq!(resume_step(v, "n1", false, false, view), Resume::Nothing);
            }
        }
        // No migration state at all.
        let plain: VirtualMachineInstance = serde_json::from_value(
            json!({"metadata": {"name": "v"}, "status": {"nodeName": "n1"}}),
        )
        .unwrap();
        assert!(!resumable(&plain, "n1", false));
        // This agent follows it already.
        let v = vmi("n1", started());
        assert_eq!(
            resume_step(&v, "n1", true, false, LauncherView::Answered(&q)),
            Resume::Nothing
        );
        assert!(resumable(&v, "n1", false));
        assert!(!resumable(&v, "n2", false));
    }

    /// In post-copy the guest runs on the target: a restarted source follows QEMU to the end,
    /// never cancels it (not even a block migration's) and never resumes the source; a broken
    /// post-copy stream is followed to its recovery; a failed QEMU loses the guest.
    #[test]
    fn a_restarted_source_in_post_copy_follows_it_and_never_resumes_the_source() {
        for mode in [None, Some("PostCopy")] {
            let st = match mode {
                Some(m) => with(started(), "mode", json!(m)),
                None => started(),
            };
            let v = vmi("n1", st);
            for block in [false, true] {
                let q = json!({"status": "postcopy-active"});
                assert_eq!(
                    resume_step(&v, "n1", false, block, LauncherView::Answered(&q)),
                    Resume::Follow,
                    "{mode:?} block={block}"
                );
                let q = json!({"status": "completed"});
                assert_eq!(
                    resume_step(&v, "n1", false, block, LauncherView::Answered(&q)),
                    Resume::SwitchOver
                );
                // A broken stream (or a recovery under way) is followed: the follow loop
                // recovers it (`postcopy::Action::Recover`), the same code as before the
                // restart.
                for s in ["postcopy-paused", "postcopy-recover"] {
                    let q = json!({"status": s});
                    assert_eq!(
                        resume_step(&v, "n1", false, block, LauncherView::Answered(&q)),
                        Resume::Follow,
                        "{s}"
                    );
                }
            }
        }
        // QEMU failed after the VMI recorded the switch: lost, not "the source runs on".
        let v = vmi("n1", with(started(), "mode", json!("PostCopy")));
        for s in ["failed", "cancelled"] {
            let q = json!({"status": s, "error-desc": "boom"});
            assert!(matches!(
                resume_step(&v, "n1", false, false, LauncherView::Answered(&q)),
                Resume::Lost(_)
            ));
        }
    }

    /// A restarted target agent ([`crate::migration::target_step`]): its launcher is there
    /// and no preparation runs in this process. It keeps a launcher still receiving, never
    /// touches one whose guest runs after the switch-over (the VMI names this node: the
    /// ordinary reconcile owns it), and stops one whose migration failed.
    #[test]
    fn a_restarted_target_keeps_a_receiving_or_running_launcher_and_stops_a_failed_one() {
        use crate::migration::{TargetStep, target_step};
        let ready = with(started(), "targetNodeAddress", json!("10.0.0.2"));
        // Still receiving, or completed in QEMU but not switched over yet (the source
        // agent away): the VMI says the same, the launcher is kept.
        assert_eq!(
            target_step(&vmi("n1", ready.clone()), "n2", true, false),
            TargetStep::Nothing
        );
        // Switched over: the guest runs here.
        let done = with(ready.clone(), "completed", json!(true));
        assert_eq!(
            target_step(&vmi("n2", done), "n2", true, false),
            TargetStep::Nothing
        );
        // Failed (also: failed safe by a restarted source): stopped and removed.
        let failed = with(ready, "failed", json!(true));
        assert_eq!(
            target_step(&vmi("n1", failed), "n2", true, false),
            TargetStep::Abandon
        );
    }

    #[test]
    fn a_restarted_target_takes_its_copies_over_once() {
        let vmi = |state: Value, bound: &str| -> VirtualMachineInstance {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "v", "namespace": "d", "uid": "u"},
                "spec": {"domain": {"devices": {}}},
                "status": {"nodeName": bound, "migrationState": state}
            }))
            .unwrap()
        };
        let receiving = vmi(
            serde_json::json!({"sourceNode": "n1", "targetNode": "n2"}),
            "n1",
        );
        let switched = vmi(
            serde_json::json!({"sourceNode": "n1", "targetNode": "n2", "completed": true}),
            "n2",
        );
        let failed = vmi(
            serde_json::json!({"sourceNode": "n1", "targetNode": "n2", "failed": true}),
            "n1",
        );
        // Still receiving, or switched over (the restart came after the switch): take over.
        assert!(target_finish_pending(&receiving, "n2", true, true, false));
        assert!(target_finish_pending(&switched, "n2", true, true, false));
        // Once: not while this agent does it, not when the copies are already unmarked.
        assert!(!target_finish_pending(&switched, "n2", true, true, true));
        assert!(!target_finish_pending(&switched, "n2", true, false, false));
        // Not on another node, not without the launcher, not for a failed migration.
        assert!(!target_finish_pending(&switched, "n3", true, true, false));
        assert!(!target_finish_pending(&receiving, "n2", false, true, false));
        assert!(!target_finish_pending(&failed, "n2", true, true, false));
        let mut deleted = switched.clone();
        deleted.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-01-01T00:00:00Z".parse().unwrap(),
            ));
        assert!(!target_finish_pending(&deleted, "n2", true, true, false));
        let bare = vmi(Value::Null, "n2");
        assert!(!target_finish_pending(&bare, "n2", true, true, false));
    }
}
