//! Crash-loop back-off: how failures of a VM's VMIs are counted in `status.startFailure` and
//! how long the next start waits (10 s, 20 s, 40 s, … capped at 5 min; reset once a VMI has
//! run for the reset period). Failures caused by the infrastructure (node unresponsive,
//! eviction) are not counted, so such VMs are recreated elsewhere at once.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use ferrovirt_api::kubevirt::vm::StartFailure;
use ferrovirt_api::kubevirt::vmi::{VirtualMachineInstance, VmiPhase};

/// VMI `status.reason` values that are the infrastructure's fault, not the guest's
/// (`Fenced`: the launcher killed QEMU when its node lost its lease, docs/fencing.md).
pub const INFRASTRUCTURE_REASONS: &[&str] = &[
    "NodeUnresponsive",
    "Fenced",
    "Evicted",
    "TaintManagerEviction",
];

/// Back-off tunables.
#[derive(Debug, Clone)]
pub struct BackoffOptions {
    /// Delay after the first failure.
    pub initial: Duration,
    /// Upper bound of the delay.
    pub max: Duration,
    /// A VMI that ran at least this long clears the failure history.
    pub reset_after: Duration,
}

impl Default for BackoffOptions {
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(300),
            reset_after: Duration::from_secs(300),
        }
    }
}

/// The delay before the next start after `failures` consecutive failures (≥ 1).
pub fn delay(failures: i32, opts: &BackoffOptions) -> Duration {
    let exp = u32::try_from(failures.saturating_sub(1).clamp(0, 30)).unwrap_or(0);
    opts.initial
        .saturating_mul(2u32.saturating_pow(exp))
        .min(opts.max)
}

/// When the VMI entered `phase`, from its phase transition timestamps.
pub fn phase_time(vmi: &VirtualMachineInstance, phase: VmiPhase) -> Option<Timestamp> {
    vmi.status
        .as_ref()?
        .phase_transition_timestamps
        .as_ref()?
        .iter()
        .rev()
        .find(|t| t.phase == Some(phase))
        .and_then(|t| t.phase_transition_timestamp.as_ref())
        .map(|t| t.0)
}

/// How long the VMI ran: from entering Running until it finished (or `now`). Zero if never.
pub fn run_duration(vmi: &VirtualMachineInstance, now: Timestamp) -> Duration {
    let Some(start) = phase_time(vmi, VmiPhase::Running) else {
        return Duration::ZERO;
    };
    let end = [VmiPhase::Failed, VmiPhase::Succeeded]
        .into_iter()
        .filter_map(|p| phase_time(vmi, p))
        .find(|t| *t >= start)
        .unwrap_or(now);
    Duration::try_from(end.duration_since(start)).unwrap_or(Duration::ZERO)
}

/// Result of looking at the VMI for the crash loop.
#[derive(Debug, Clone, PartialEq)]
pub struct Tracked {
    /// The `status.startFailure` to write.
    pub start_failure: Option<StartFailure>,
    /// Set when this call counted a new failure: (count, delay).
    pub new_failure: Option<(i32, Duration)>,
}

/// Update the failure history from the VMI: a newly Failed VMI (not yet counted, not an
/// infrastructure failure) adds one failure unless it ran for the reset period; a VMI running
/// for the reset period clears the history.
pub fn track(
    prev: Option<&StartFailure>,
    vmi: Option<&VirtualMachineInstance>,
    now: Timestamp,
    opts: &BackoffOptions,
) -> Tracked {
    let unchanged = Tracked {
        start_failure: prev.cloned(),
        new_failure: None,
    };
    let Some(vmi) = vmi else { return unchanged };
    let status = vmi.status.as_ref();
    let phase = status.and_then(|s| s.phase);
    let long_run = run_duration(vmi, now) >= opts.reset_after;
    match phase {
        Some(VmiPhase::Running) if long_run => Tracked {
            start_failure: None,
            new_failure: None,
        },
        Some(VmiPhase::Failed) => {
            let uid = vmi.metadata.uid.clone();
            if uid.is_some() && prev.and_then(|p| p.last_failed_vmi_uid.as_ref()) == uid.as_ref() {
                return unchanged;
            }
            let infra = status
                .and_then(|s| s.reason.as_deref())
                .is_some_and(|r| INFRASTRUCTURE_REASONS.contains(&r));
            if infra || long_run || vmi.metadata.deletion_timestamp.is_some() {
                return Tracked {
                    start_failure: None,
                    new_failure: None,
                };
            }
            let count = prev
                .and_then(|p| p.consecutive_fail_count)
                .unwrap_or(0)
                .max(0)
                + 1;
            let wait = delay(count, opts);
            let retry = now
                .checked_add(SignedDuration::try_from(wait).unwrap_or(SignedDuration::ZERO))
                .unwrap_or(now);
            Tracked {
                start_failure: Some(StartFailure {
                    retry_after_timestamp: Some(Time(retry)),
                    consecutive_fail_count: Some(count),
                    last_failed_vmi_uid: uid,
                }),
                new_failure: Some((count, wait)),
            }
        }
        _ => unchanged,
    }
}

/// How long until the back-off allows a start (`None` when it already does).
pub fn remaining(start_failure: Option<&StartFailure>, now: Timestamp) -> Option<Duration> {
    let retry = start_failure?.retry_after_timestamp.as_ref()?.0;
    (retry > now).then(|| Duration::try_from(retry.duration_since(now)).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::testutil::{vm, vmi_of};

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    #[test]
    fn exponential_with_cap() {
        let o = BackoffOptions::default();
        let secs: Vec<u64> = (1..=7).map(|n| delay(n, &o).as_secs()).collect();
        assert_eq!(secs, vec![10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(delay(1000, &o).as_secs(), 300);
    }

    #[test]
    fn counts_each_failed_vmi_once() {
        let o = BackoffOptions::default();
        let v = vm("a").build();
        let failed = vmi_of(&v, "u1", VmiPhase::Failed)
            .transition(VmiPhase::Running, 100)
            .transition(VmiPhase::Failed, 110)
            .build();
        let t = track(None, Some(&failed), ts(120), &o);
        let sf = t.start_failure.clone().unwrap();
        assert_eq!(sf.consecutive_fail_count, Some(1));
        assert_eq!(sf.retry_after_timestamp.unwrap().0, ts(130));
        assert_eq!(t.new_failure, Some((1, Duration::from_secs(10))));
        // Seen again: unchanged.
        let again = track(t.start_failure.as_ref(), Some(&failed), ts(125), &o);
        assert_eq!(again.start_failure, t.start_failure);
        assert_eq!(again.new_failure, None);
        // The next VMI fails too: 20 s.
        let failed2 = vmi_of(&v, "u2", VmiPhase::Failed).build();
        let t2 = track(t.start_failure.as_ref(), Some(&failed2), ts(200), &o);
        assert_eq!(t2.new_failure, Some((2, Duration::from_secs(20))));
        assert_eq!(
            remaining(t2.start_failure.as_ref(), ts(210)),
            Some(Duration::from_secs(10))
        );
        assert_eq!(remaining(t2.start_failure.as_ref(), ts(221)), None);
    }

    #[test]
    fn long_runs_and_infrastructure_failures_reset() {
        let o = BackoffOptions::default();
        let v = vm("a").build();
        let prev = StartFailure {
            consecutive_fail_count: Some(4),
            ..Default::default()
        };
        let running = vmi_of(&v, "u1", VmiPhase::Running)
            .transition(VmiPhase::Running, 0)
            .build();
        assert_eq!(
            track(Some(&prev), Some(&running), ts(100), &o).start_failure,
            Some(prev.clone())
        );
        assert_eq!(
            track(Some(&prev), Some(&running), ts(300), &o).start_failure,
            None
        );
        let node_died = vmi_of(&v, "u2", VmiPhase::Failed)
            .reason("NodeUnresponsive")
            .build();
        assert_eq!(
            track(Some(&prev), Some(&node_died), ts(5), &o).start_failure,
            None
        );
        let ran_long = vmi_of(&v, "u3", VmiPhase::Failed)
            .transition(VmiPhase::Running, 0)
            .transition(VmiPhase::Failed, 400)
            .build();
        assert_eq!(
            track(Some(&prev), Some(&ran_long), ts(401), &o).start_failure,
            None
        );
    }
}
