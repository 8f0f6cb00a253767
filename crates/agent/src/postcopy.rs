//! Post-copy live migration (docs/migration.md "Post-copy"), the pure decisions: what the
//! source's follow loop does when a limit is reached (cancel, or switch to post-copy when the
//! settings allow it, as KubeVirt does at the completion timeout), what it does once the
//! migration runs in post-copy (never cancel, never resume the source; a broken stream is
//! recovered over a new connection a bounded number of times, and only when that cannot
//! succeed is the guest lost and the VMI failed; a source that sent everything but never
//! completes asks the target how its side stands), what the target agent answers a recovery
//! request with, and the VMI status written for each.

use std::time::Duration;

use serde_json::{Value, json};

pub use ferrovirt_api::migration::MODE_POST_COPY;

/// VMI `status.reason` when the guest was lost by a post-copy migration that broke.
pub const REASON_LOST: &str = "MigrationFailedInPostCopy";

/// How many recoveries of a broken post-copy stream are tried before the guest is given up.
pub const MAX_RECOVERIES: u32 = 3;

/// How long QEMU may stay in `postcopy-recover` (a recovery's handshake) before the
/// recovery is taken as failed for good.
pub const RECOVER_LIMIT: Duration = Duration::from_secs(60);

/// How long the source's QEMU may report `postcopy-active` with nothing left to send (its
/// completion waits for the target's end of the return path, normally milliseconds) before
/// the target agent is asked how its side stands. QEMU 7.2 deadlocks there when the stream
/// breaks in that phase: the return path thread pauses for a recovery that the migration
/// thread, joining it, never starts; the status stays `postcopy-active` for ever.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(20);

/// How many times a target agent that does not answer is asked before the guest is given up.
pub const MAX_PROBES: u32 = 3;

/// How long a target whose incoming migration completed still answers the source's
/// queries and recoveries (far longer than [`DRAIN_LIMIT`] and the probes after it).
pub const COMPLETED_SERVE: Duration = Duration::from_secs(300);

/// The wait before recovery attempt `attempt` (1-based): 0.5 s, 1 s, 2 s, … capped at 8 s.
pub fn recovery_backoff(attempt: u32) -> Duration {
    Duration::from_millis(500u64 << attempt.saturating_sub(1).min(4))
}

/// Whether QEMU's `query-migrate` status is one of post-copy's (the guest runs on the target
/// and part of its memory is still on the source).
pub fn in_post_copy(qemu_status: &str) -> bool {
    qemu_status.starts_with("postcopy")
}

/// What the follow loop saw in one poll.
#[derive(Debug, Clone, Default)]
pub struct Poll<'a> {
    /// QEMU's `query-migrate` status.
    pub qemu_status: &'a str,
    /// The completion timeout's reason when it is exceeded (`completionTimeoutPerGiB`).
    pub completion_timeout: Option<String>,
    /// The progress timeout's reason when it is exceeded (`progressTimeout`).
    pub progress_timeout: Option<String>,
    /// The migration was cancelled (`abortRequested`).
    pub cancelled: bool,
    /// The settings allow post-copy (`allowPostCopy`).
    pub allow_post_copy: bool,
    /// Node-local disks are mirrored (block migration).
    pub block: bool,
    /// This loop asked QEMU to switch to post-copy, or saw it in post-copy.
    pub post_copy_requested: bool,
    /// Recoveries of the broken stream tried so far.
    pub recoveries: u32,
    /// Why a recovery cannot succeed, once known (the target's QEMU is gone, the target no
    /// longer serves the migration).
    pub unrecoverable: Option<String>,
    /// QEMU has been in `postcopy-recover` longer than [`RECOVER_LIMIT`].
    pub recover_stuck: bool,
    /// QEMU has reported `postcopy-active` with nothing left to send for longer than
    /// [`DRAIN_LIMIT`] (since the last answer of the target).
    pub drained_stuck: bool,
    /// Queries of the target that got no answer so far.
    pub probes: u32,
}

/// What the follow loop does about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Keep following.
    Continue,
    /// `migrate_cancel` with this reason: the source runs on.
    Cancel(String),
    /// `migrate-start-postcopy`: the guest runs on the target from here on.
    StartPostCopy,
    /// In post-copy a cancel cannot be honoured (the source no longer has the whole guest):
    /// keep following and say so once.
    RefuseCancel,
    /// The stream broke after the switch (QEMU `postcopy-paused`): set up a new connection
    /// and recover (target `migrate-recover`, source `migrate` with `resume`); this is
    /// attempt `attempt` of [`MAX_RECOVERIES`].
    Recover { attempt: u32 },
    /// Everything was sent in post-copy but QEMU does not complete ([`DRAIN_LIMIT`]): ask
    /// the target agent what its QEMU reports ([`probed`] says what the answer means); this
    /// is query `attempt` of [`MAX_PROBES`] unanswered ones.
    ProbeTarget { attempt: u32 },
    /// The stream broke after the switch and cannot be recovered: neither QEMU holds the
    /// whole guest, it is lost; the VMI fails and both QEMUs are stopped.
    Lost(String),
}

/// The follow loop's decision (KubeVirt's order: once in post-copy nothing is aborted; a
/// cancel and the progress timeout abort; the completion timeout switches to post-copy when
/// allowed, else aborts).
pub fn decide(p: &Poll<'_>) -> Action {
    let lost = |why: String| Action::Lost(lost_reason(p.qemu_status, &why));
    // QEMU itself failed the migration after the switch: nothing left to recover.
    if p.post_copy_requested && matches!(p.qemu_status, "failed" | "cancelled") {
        return lost(String::new());
    }
    let paused = p.qemu_status == "postcopy-paused";
    let stuck = p.qemu_status == "postcopy-recover" && p.recover_stuck;
    if paused || stuck {
        if let Some(why) = &p.unrecoverable {
            return lost(format!("; it cannot be recovered: {why}"));
        }
        if stuck {
            return lost(format!(
                "; its recovery did not finish within {} s",
                RECOVER_LIMIT.as_secs()
            ));
        }
        if p.recoveries >= MAX_RECOVERIES {
            return lost(format!("; {} recovery attempts failed", p.recoveries));
        }
        return Action::Recover {
            attempt: p.recoveries + 1,
        };
    }
    if p.qemu_status == "postcopy-active" && p.drained_stuck {
        if p.probes >= MAX_PROBES {
            return lost(format!(
                "; the source sent all memory but never completed, and the target agent did \
                 not answer {} queries",
                p.probes
            ));
        }
        return Action::ProbeTarget {
            attempt: p.probes + 1,
        };
    }
    if in_post_copy(p.qemu_status) || p.post_copy_requested {
        return if p.cancelled {
            Action::RefuseCancel
        } else {
            Action::Continue
        };
    }
    if p.cancelled {
        return Action::Cancel("the migration was cancelled".into());
    }
    if let Some(why) = &p.progress_timeout {
        return Action::Cancel(why.clone());
    }
    match &p.completion_timeout {
        None => Action::Continue,
        Some(_) if p.allow_post_copy && !p.block => Action::StartPostCopy,
        Some(why) if p.allow_post_copy => Action::Cancel(format!(
            "{why}; allowPostCopy: post-copy is not carried out for a block migration \
             (node-local disks), so it was cancelled"
        )),
        Some(why) => Action::Cancel(why.clone()),
    }
}

/// Why a guest was lost in post-copy: the source's QEMU status and the detail `why`.
pub fn lost_reason(qemu_status: &str, why: &str) -> String {
    format!(
        "the migration stream broke in post-copy (QEMU: {qemu_status}){why}: the guest ran on \
         the target with part of its memory still on the source, so it is lost; the VMI \
         failed (allowPostCopy accepts this risk)"
    )
}

/// What the target's QEMU status, as its agent answered a query or a recovery, means for
/// the source of a post-copy migration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probed {
    /// The target received everything: the guest is whole there; switch over (the source's
    /// QEMU, stopped since the switch to post-copy, is let go whatever it reports).
    Completed,
    /// The target still receives (or recovers): keep following.
    Wait,
    /// The target lacks part of the memory and the source cannot send it any more.
    Lost(String),
}

/// The meaning of the target's answer `status` (its QEMU's `query-migrate` status, `gone`
/// when no launcher runs), asked while the source's QEMU is `source` (`postcopy-active`
/// with nothing left to send, or `postcopy-paused`).
pub fn probed(status: &str, source: &str) -> Probed {
    match status {
        "completed" => Probed::Completed,
        "postcopy-active" | "postcopy-recover" | "active" | "setup" => Probed::Wait,
        // The source is paused too: the ordinary recovery handles it.
        "postcopy-paused" if source == "postcopy-paused" => Probed::Wait,
        "postcopy-paused" => Probed::Lost(
            "the target's QEMU is paused (postcopy-paused) without part of the memory, and the \
             source's QEMU, which had sent everything when its stream broke, cannot resume (QEMU \
             does not recover a stream broken while it completes)"
                .into(),
        ),
        "gone" => Probed::Lost("the target's QEMU is gone".into()),
        s => Probed::Lost(format!("the target's QEMU reports {s}")),
    }
}

/// What the target agent does with a recovery request, from its QEMU's `query-migrate`
/// status (`None`: no launcher or no answer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetRecovery {
    /// Paused: accept the new connection and `migrate-recover` on it.
    Recover,
    /// Not paused yet (it has not noticed the break) or a recovery still settling: ask again.
    Wait,
    /// Recovery cannot succeed: the source gives the guest up.
    Refuse(String),
}

/// What the target agent knows of its QEMU's incoming migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetView<'a> {
    /// No launcher runs.
    Gone,
    /// The launcher runs but did not answer (its QEMU may be busy or blocked on a page).
    NoAnswer,
    /// QEMU's `query-migrate` status (`none` when it reports none).
    Status(&'a str),
}

/// How long a target launcher that does not answer is asked before the recovery goes on
/// regardless: QEMU's main loop may be blocked on a guest page that only the recovery
/// brings, so `query-migrate` cannot answer, while `migrate-recover` runs out of band (and
/// QEMU refuses it unless it is paused, so trying is safe).
pub const NO_ANSWER_GRACE: Duration = Duration::from_secs(3);

/// The target's decision on a recovery request, `waited` into it.
pub fn target_recovery(view: TargetView<'_>, waited: Duration) -> TargetRecovery {
    match view {
        TargetView::Status("postcopy-paused") => TargetRecovery::Recover,
        TargetView::NoAnswer if waited >= NO_ANSWER_GRACE => TargetRecovery::Recover,
        TargetView::Status("postcopy-active" | "postcopy-recover" | "active")
        | TargetView::NoAnswer => TargetRecovery::Wait,
        TargetView::Status(s) => TargetRecovery::Refuse(format!("the target's QEMU reports {s}")),
        TargetView::Gone => TargetRecovery::Refuse("the target's QEMU is gone".into()),
    }
}

/// Whether the target stops serving recoveries and queries: its incoming migration ended
/// (a completed one after [`COMPLETED_SERVE`], `completed_for` since it was first seen
/// completed: the source may still ask), or its launcher is gone (a launcher that does not
/// answer is asked again).
pub fn target_serving_ends(view: TargetView<'_>, completed_for: Duration) -> bool {
    match view {
        TargetView::Gone => true,
        TargetView::NoAnswer => false,
        TargetView::Status("completed") => completed_for > COMPLETED_SERVE,
        TargetView::Status(s) => !matches!(
            s,
            "none"
                | "setup"
                | "active"
                | "postcopy-active"
                | "postcopy-paused"
                | "postcopy-recover"
        ),
    }
}

/// The VMI status patch recording the switch to post-copy.
pub fn mode_patch() -> Value {
    json!({"migrationState": {"mode": MODE_POST_COPY}})
}

/// The VMI status patch of a guest lost in post-copy: the migration failed and the VMI with
/// it (never a state in which a QEMU could run the guest again on either node).
pub fn lost_patch(reason: &str, now: &str) -> Value {
    json!({
        "phase": "Failed",
        "reason": REASON_LOST,
        "migrationState": {"failed": true, "failureReason": reason, "endTimestamp": now},
        "conditions": [{
            "type": "Ready", "status": "False", "reason": REASON_LOST, "message": reason,
            "lastTransitionTime": now, "lastProbeTime": null,
        }],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn poll(status: &str) -> Poll<'_> {
        Poll {
            qemu_status: status,
            ..Poll::default()
        }
    }

    #[test]
    fn the_completion_timeout_switches_to_post_copy_only_when_allowed() {
        let hit = Some("the migration did not complete within 150 s".to_string());
        let mut p = Poll {
            completion_timeout: hit.clone(),
            ..poll("active")
        };
        assert_eq!(
            decide(&p),
            Action::Cancel(hit.clone().unwrap()),
            "not allowed: cancelled, the source runs on"
        );
        p.allow_post_copy = true;
        assert_eq!(decide(&p), Action::StartPostCopy);
        // Asked once: the next polls (QEMU may still say active) only follow.
        p.post_copy_requested = true;
        assert_eq!(decide(&p), Action::Continue);
        // A block migration does not switch: cancelled, naming the field.
        p.post_copy_requested = false;
        p.block = true;
        match decide(&p) {
            Action::Cancel(why) => assert!(why.contains("allowPostCopy"), "{why}"),
            a => panic!("{a:?}"),
        }
        // Within the time nothing happens.
        assert_eq!(
            decide(&Poll {
                allow_post_copy: true,
                ..poll("active")
            }),
            Action::Continue
        );
    }

    #[test]
    fn a_cancel_or_no_progress_aborts_pre_copy_even_when_post_copy_is_allowed() {
        let p = Poll {
            cancelled: true,
            allow_post_copy: true,
            completion_timeout: Some("late".into()),
            ..poll("active")
        };
        assert_eq!(
            decide(&p),
            Action::Cancel("the migration was cancelled".into())
        );
        let p = Poll {
            progress_timeout: Some("no progress".into()),
            allow_post_copy: true,
            completion_timeout: Some("late".into()),
            ..poll("active")
        };
        assert_eq!(decide(&p), Action::Cancel("no progress".into()));
    }

    #[test]
    fn in_post_copy_nothing_is_cancelled_and_a_failed_qemu_loses_the_guest() {
        for s in ["postcopy-active", "completed"] {
            let mut p = Poll {
                completion_timeout: Some("late".into()),
                progress_timeout: Some("stalled".into()),
                allow_post_copy: true,
                post_copy_requested: true,
                ..poll(s)
            };
            assert_eq!(decide(&p), Action::Continue, "{s}");
            p.cancelled = true;
            assert_eq!(decide(&p), Action::RefuseCancel, "{s}");
        }
        // QEMU says post-copy even if this loop did not ask (a restarted agent).
        let p = Poll {
            cancelled: true,
            ..poll("postcopy-active")
        };
        assert_eq!(decide(&p), Action::RefuseCancel);
        // A recovery under way is followed (a cancel still refused).
        assert_eq!(decide(&poll("postcopy-recover")), Action::Continue);
        // A failure once the switch was asked for: never resumed on the source either.
        for s in ["failed", "cancelled"] {
            let p = Poll {
                post_copy_requested: true,
                ..poll(s)
            };
            match decide(&p) {
                Action::Lost(why) => assert!(why.contains("lost") && why.contains(s), "{why}"),
                a => panic!("{s}: {a:?}"),
            }
        }
        assert!(in_post_copy("postcopy-active") && !in_post_copy("active"));
    }

    #[test]
    fn a_broken_post_copy_stream_is_recovered_a_bounded_number_of_times() {
        let mut p = Poll {
            post_copy_requested: true,
            ..poll("postcopy-paused")
        };
        for n in 0..MAX_RECOVERIES {
            p.recoveries = n;
            assert_eq!(decide(&p), Action::Recover { attempt: n + 1 });
            // A cancel does not stop a recovery: the source cannot take the guest back.
            let c = Poll {
                cancelled: true,
                ..p.clone()
            };
            assert_eq!(decide(&c), Action::Recover { attempt: n + 1 });
        }
        // A restarted agent (nothing asked, nothing counted) recovers too.
        assert_eq!(
            decide(&poll("postcopy-paused")),
            Action::Recover { attempt: 1 }
        );
        p.recoveries = MAX_RECOVERIES;
        match decide(&p) {
            Action::Lost(why) => {
                assert!(why.contains("3 recovery attempts failed"), "{why}");
                assert!(
                    why.contains("lost") && why.contains("postcopy-paused"),
                    "{why}"
                );
            }
            a => panic!("{a:?}"),
        }
        // The target said recovery cannot succeed: lost at once, whatever is left.
        p.recoveries = 1;
        p.unrecoverable = Some("the target's QEMU is gone".into());
        match decide(&p) {
            Action::Lost(why) => assert!(why.contains("the target's QEMU is gone"), "{why}"),
            a => panic!("{a:?}"),
        }
        // A recovery handshake that never ends.
        let s = Poll {
            recover_stuck: true,
            ..poll("postcopy-recover")
        };
        match decide(&s) {
            Action::Lost(why) => assert!(why.contains("did not finish"), "{why}"),
            a => panic!("{a:?}"),
        }
        assert_eq!(recovery_backoff(1), Duration::from_millis(500));
        assert_eq!(recovery_backoff(2), Duration::from_secs(1));
        assert_eq!(recovery_backoff(3), Duration::from_secs(2));
        assert_eq!(recovery_backoff(40), Duration::from_secs(8));
    }

    #[test]
    fn the_target_recovers_only_a_paused_qemu() {
        use TargetView::*;
        let now = Duration::ZERO;
        let later = NO_ANSWER_GRACE;
        assert_eq!(
            target_recovery(Status("postcopy-paused"), now),
            TargetRecovery::Recover
        );
        for s in ["postcopy-active", "postcopy-recover", "active"] {
            for w in [now, later] {
                assert_eq!(target_recovery(Status(s), w), TargetRecovery::Wait, "{s}");
            }
        }
        // A launcher that does not answer: asked again, then recovered regardless (its
        // QEMU's main loop may wait on a page; QEMU refuses migrate-recover unless paused).
        assert_eq!(target_recovery(NoAnswer, now), TargetRecovery::Wait);
        assert_eq!(target_recovery(NoAnswer, later), TargetRecovery::Recover);
        match target_recovery(Gone, now) {
            TargetRecovery::Refuse(why) => assert!(why.contains("gone"), "{why}"),
            r => panic!("{r:?}"),
        }
        match target_recovery(Status("failed"), now) {
            TargetRecovery::Refuse(why) => assert!(why.contains("failed"), "{why}"),
            r => panic!("{r:?}"),
        }
        for s in [
            "none",
            "active",
            "postcopy-active",
            "postcopy-paused",
            "postcopy-recover",
        ] {
            assert!(!target_serving_ends(Status(s), Duration::ZERO), "{s}");
        }
        assert!(
            !target_serving_ends(NoAnswer, Duration::ZERO),
            "asked again"
        );
        // A completed target still answers the source for a while.
        assert!(!target_serving_ends(Status("completed"), Duration::ZERO));
        assert!(!target_serving_ends(Status("completed"), COMPLETED_SERVE));
        let past = COMPLETED_SERVE + Duration::from_secs(1);
        for v in [
            Status("completed"),
            Status("failed"),
            Status("cancelled"),
            Gone,
        ] {
            assert!(target_serving_ends(v, past), "{v:?}");
        }
        assert!(target_serving_ends(Status("failed"), Duration::ZERO));
    }

    #[test]
    fn a_source_that_sent_everything_but_never_completes_asks_the_target() {
        let mut p = Poll {
            post_copy_requested: true,
            ..poll("postcopy-active")
        };
        assert_eq!(decide(&p), Action::Continue, "not drained for long: follow");
        p.drained_stuck = true;
        assert_eq!(decide(&p), Action::ProbeTarget { attempt: 1 });
        p.probes = 2;
        assert_eq!(decide(&p), Action::ProbeTarget { attempt: 3 });
        p.probes = MAX_PROBES;
        match decide(&p) {
            Action::Lost(why) => assert!(why.contains("did not answer 3 queries"), "{why}"),
            a => panic!("{a:?}"),
        }
        // A paused source is recovered as before, drained or not.
        p.qemu_status = "postcopy-paused";
        p.probes = 0;
        assert_eq!(decide(&p), Action::Recover { attempt: 1 });
        // A cancel while stuck: the target is asked all the same.
        p.qemu_status = "postcopy-active";
        p.cancelled = true;
        assert_eq!(decide(&p), Action::ProbeTarget { attempt: 1 });
    }

    #[test]
    fn the_targets_answer_decides_between_switch_over_waiting_and_loss() {
        for source in ["postcopy-active", "postcopy-paused"] {
            assert_eq!(probed("completed", source), Probed::Completed, "{source}");
            for s in ["postcopy-active", "postcopy-recover", "active"] {
                assert_eq!(probed(s, source), Probed::Wait, "{s} {source}");
            }
            for s in ["failed", "cancelled", "none", "gone"] {
                assert!(matches!(probed(s, source), Probed::Lost(_)), "{s} {source}");
            }
        }
        // A paused target: recovered while the source is paused too, lost when the source
        // (deadlocked in its completion) cannot resume.
        assert_eq!(probed("postcopy-paused", "postcopy-paused"), Probed::Wait);
        match probed("postcopy-paused", "postcopy-active") {
            Probed::Lost(why) => assert!(why.contains("cannot resume"), "{why}"),
            p => panic!("{p:?}"),
        }
    }

    #[test]
    fn the_patches() {
        assert_eq!(mode_patch()["migrationState"]["mode"], "PostCopy");
        let l = lost_patch("broke", "T");
        assert_eq!(l["phase"], "Failed");
        assert_eq!(l["reason"], REASON_LOST);
        assert_eq!(l["migrationState"]["failed"], true);
        assert_eq!(l["migrationState"]["failureReason"], "broke");
        assert_eq!(l["conditions"][0]["status"], "False");
    }
}
