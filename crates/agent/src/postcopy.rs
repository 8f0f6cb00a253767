//! Post-copy live migration (docs/migration.md "Post-copy"), the pure decisions: what the
//! source's follow loop does when a limit is reached (cancel, or switch to post-copy when the
//! settings allow it, as KubeVirt does at the completion timeout), what it does once the
//! migration runs in post-copy (never cancel, never resume the source; a broken stream is
//! recovered over a new connection a bounded number of times, and only when that cannot
//! succeed is the guest lost and the VMI failed), what the target agent answers a recovery
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
    /// The stream broke after the switch and cannot be recovered: neither QEMU holds the
    /// whole guest, it is lost; the VMI fails and both QEMUs are stopped.
    Lost(String),
}

/// The follow loop's decision (KubeVirt's order: once in post-copy nothing is aborted; a
/// cancel and the progress timeout abort; the completion timeout switches to post-copy when
/// allowed, else aborts).
pub fn decide(p: &Poll<'_>) -> Action {
    let lost = |why: String| {
        Action::Lost(format!(
            "the migration stream broke in post-copy (QEMU: {}){why}: the guest ran on the \
             target with part of its memory still on the source, so it is lost; the VMI failed \
             (allowPostCopy accepts this risk)",
            p.qemu_status
        ))
    };
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

/// The target's decision on a recovery request.
pub fn target_recovery(view: TargetView<'_>) -> TargetRecovery {
    match view {
        TargetView::Status("postcopy-paused") => TargetRecovery::Recover,
        TargetView::Status("postcopy-active" | "postcopy-recover" | "active")
        | TargetView::NoAnswer => TargetRecovery::Wait,
        TargetView::Status(s) => TargetRecovery::Refuse(format!("the target's QEMU reports {s}")),
        TargetView::Gone => TargetRecovery::Refuse("the target's QEMU is gone".into()),
    }
}

/// Whether the target stops serving recoveries: its incoming migration ended, or its
/// launcher is gone (a launcher that does not answer is asked again).
pub fn target_serving_ends(view: TargetView<'_>) -> bool {
    match view {
        TargetView::Gone => true,
        TargetView::NoAnswer => false,
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
        assert_eq!(
            target_recovery(Status("postcopy-paused")),
            TargetRecovery::Recover
        );
        for s in ["postcopy-active", "postcopy-recover", "active"] {
            assert_eq!(target_recovery(Status(s)), TargetRecovery::Wait, "{s}");
        }
        assert_eq!(target_recovery(NoAnswer), TargetRecovery::Wait);
        match target_recovery(Gone) {
            TargetRecovery::Refuse(why) => assert!(why.contains("gone"), "{why}"),
            r => panic!("{r:?}"),
        }
        match target_recovery(Status("failed")) {
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
            assert!(!target_serving_ends(Status(s)), "{s}");
        }
        assert!(!target_serving_ends(NoAnswer), "asked again");
        for v in [
            Status("completed"),
            Status("failed"),
            Status("cancelled"),
            Gone,
        ] {
            assert!(target_serving_ends(v), "{v:?}");
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
