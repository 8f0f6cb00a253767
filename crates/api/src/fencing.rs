//! Node-failure fencing, the shared vocabulary (docs/fencing.md): which VMIs may be restarted
//! on another node (and therefore fence themselves when their node loses its Lease), the
//! annotation a node agent writes on a VMI before it starts its launcher, and the timing
//! (lease duration, fence margin) with its validation. Pure; used by the agent (to decide
//! and announce), the controllers (to decide when a replacement is safe) and admission (to
//! refuse unsafe HyperConverged timings).

use crate::kubevirt::vm::RunStrategy;
use crate::kubevirt::vmi::VirtualMachineInstance;

/// VMI annotation written by the node agent before it starts the VMI's launcher:
/// [`FENCING_ENABLED`] when the launcher kills QEMU once it cannot confirm its node's Lease,
/// [`FENCING_DISABLED`] when the VM keeps running whatever happens to the agent. The node
/// lifecycle controller replaces a VMI of a failed node only when it says `enabled` (or when
/// no launcher was ever started for it).
pub const FENCING_ANNOTATION: &str = "ferrovirt.io/fencing";
/// [`FENCING_ANNOTATION`]'s value for a self-fencing launcher.
pub const FENCING_ENABLED: &str = "enabled";
/// [`FENCING_ANNOTATION`]'s value for a launcher that never fences.
pub const FENCING_DISABLED: &str = "disabled";

/// Default node Lease duration in seconds: the launchers' fence deadline after the Lease's
/// `renewTime` (agents renew every quarter of it: [`DEFAULT_RENEW_SECONDS`]). Twice the
/// first default (8 s): a VM on a failed node runs elsewhere about 20 s after the node's last
/// renewal instead of 12 s, a renewal may stall for 16 s before a false fence, and 100 nodes
/// write 25 renewals a second instead of 50 (docs/fencing.md "Limits", docs/scale.md). The
/// kubelet's node Lease is 40 s; `spec.nodeFailure.leaseDurationSeconds` of the
/// HyperConverged sets it from 4 s up.
pub const DEFAULT_LEASE_DURATION_SECONDS: u32 = 16;
/// Interval of the agents' Lease renewals at the default lease duration (a quarter of it,
/// [`FenceTiming::renew_interval_millis`]).
pub const DEFAULT_RENEW_SECONDS: u32 = 4;
/// Default margin the control plane waits after the fence deadline before it replaces a VMI
/// (clock skew between nodes, the launchers' check interval, the kill).
pub const DEFAULT_FENCE_MARGIN_SECONDS: u32 = 4;
/// Smallest lease duration accepted: two renewals must fit inside it.
pub const MIN_LEASE_DURATION_SECONDS: u32 = 4;
/// Smallest fence margin accepted: the launchers check once a second at most 0.5 s late,
/// the kill takes a moment, and nodes' clocks may differ by up to a second.
pub const MIN_FENCE_MARGIN_SECONDS: u32 = 2;
/// Largest value of either timing (an hour).
pub const MAX_TIMING_SECONDS: u32 = 3600;

/// The timing of node failure handling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FenceTiming {
    /// The node Lease's `leaseDurationSeconds`; launchers fence at `renewTime` plus this.
    pub lease_duration_seconds: u32,
    /// Extra time the control plane waits after the fence deadline.
    pub fence_margin_seconds: u32,
}

impl Default for FenceTiming {
    fn default() -> Self {
        FenceTiming {
            lease_duration_seconds: DEFAULT_LEASE_DURATION_SECONDS,
            fence_margin_seconds: DEFAULT_FENCE_MARGIN_SECONDS,
        }
    }
}

/// Why a timing is unsafe: the field (relative to the timing object) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimingError {
    pub field: &'static str,
    pub message: String,
}

impl FenceTiming {
    /// Refuses timings that cannot be carried out safely: a lease too short to be renewed
    /// twice, a margin too small to cover the launchers' check interval and clock skew, or
    /// values beyond an hour.
    pub fn validate(&self) -> Result<(), TimingError> {
        let lease = self.lease_duration_seconds;
        if !(MIN_LEASE_DURATION_SECONDS..=MAX_TIMING_SECONDS).contains(&lease) {
            return Err(TimingError {
                field: "leaseDurationSeconds",
                message: format!(
                    "must be between {MIN_LEASE_DURATION_SECONDS} and {MAX_TIMING_SECONDS} \
                     (agents renew every quarter of it, and a renewal must take under a second)"
                ),
            });
        }
        let margin = self.fence_margin_seconds;
        if !(MIN_FENCE_MARGIN_SECONDS..=MAX_TIMING_SECONDS).contains(&margin) {
            return Err(TimingError {
                field: "fenceMarginSeconds",
                message: format!(
                    "must be between {MIN_FENCE_MARGIN_SECONDS} and {MAX_TIMING_SECONDS} \
                     (it covers clock skew between nodes and the launchers' check interval)"
                ),
            });
        }
        Ok(())
    }

    /// How often an agent renews its Lease for this lease duration: every quarter of it, the
    /// kubelet's fraction for its node Lease (its 40 s lease is renewed every 10 s), so that
    /// three renewals in a row may fail before the lease runs out. A longer lease costs the
    /// control plane fewer writes: one per node per quarter lease (docs/scale.md).
    pub fn renew_interval_millis(&self) -> u64 {
        u64::from(self.lease_duration_seconds) * 1000 / 4
    }
}

/// Access modes that let a volume attach on any node.
pub fn is_shared_access(access_modes: &[String]) -> bool {
    access_modes.iter().any(|m| m == "ReadWriteMany")
}

/// Whether the VMI could run on another node as far as its disks go: every PVC/DataVolume
/// (incl. ephemeral overlays and memory dumps) must be ReadWriteMany, and hostDisks must be
/// `shared`. `access_modes(claim)` gives a claim's access modes (`None`: unknown, treated as
/// node-local).
pub fn can_run_elsewhere(
    vmi: &VirtualMachineInstance,
    access_modes: impl Fn(&str) -> Option<Vec<String>>,
) -> bool {
    let volumes = vmi
        .spec
        .as_ref()
        .and_then(|s| s.volumes.as_deref())
        .unwrap_or_default();
    volumes.iter().all(|v| {
        let claim = v
            .persistent_volume_claim
            .as_ref()
            .map(|p| p.claim_name.as_str())
            .or_else(|| v.data_volume.as_ref().map(|d| d.name.as_str()))
            .or_else(|| {
                v.ephemeral
                    .as_ref()
                    .and_then(|e| e.persistent_volume_claim.as_ref())
                    .map(|c| c.claim_name.as_str())
            })
            .or_else(|| v.memory_dump.as_ref().map(|p| p.claim_name.as_str()));
        if let Some(claim) = claim {
            return access_modes(claim).is_some_and(|m| is_shared_access(&m));
        }
        v.host_disk.as_ref().is_none_or(|h| h.shared == Some(true))
    })
}

/// Whether a VM with this run strategy is started again when its VMI fails.
pub fn restarts_on_failure(run_strategy: Option<RunStrategy>) -> bool {
    matches!(
        run_strategy,
        Some(RunStrategy::Always | RunStrategy::RerunOnFailure)
    )
}

/// Whether the VMI's launcher fences itself: its VM restarts it on failure (`run_strategy`
/// of the owning VM; `None` for a VMI without one) and every disk is usable from another
/// node. Everything else keeps running while its agent is away (as in KubeVirt).
pub fn fenceable(
    vmi: &VirtualMachineInstance,
    run_strategy: Option<RunStrategy>,
    access_modes: impl Fn(&str) -> Option<Vec<String>>,
) -> bool {
    restarts_on_failure(run_strategy) && can_run_elsewhere(vmi, access_modes)
}

/// What a VMI's [`FENCING_ANNOTATION`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmiFencing {
    /// Its launcher fences itself.
    Enabled,
    /// Its launcher never fences.
    Disabled,
    /// No annotation: no launcher was started for it by a fencing-aware agent.
    Unannounced,
}

/// Reads a VMI's [`FENCING_ANNOTATION`].
pub fn vmi_fencing(vmi: &VirtualMachineInstance) -> VmiFencing {
    match vmi
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(FENCING_ANNOTATION))
        .map(String::as_str)
    {
        Some(FENCING_ENABLED) => VmiFencing::Enabled,
        Some(_) => VmiFencing::Disabled,
        None => VmiFencing::Unannounced,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(v: serde_json::Value) -> VirtualMachineInstance {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn fenceable_needs_a_restarting_vm_and_movable_disks() {
        let shared = vmi(
            serde_json::json!({"metadata": {"name": "a"}, "spec": {"domain": {},
            "volumes": [{"name": "r", "persistentVolumeClaim": {"claimName": "c"}}]}}),
        );
        let rwx = |_: &str| Some(vec!["ReadWriteMany".to_string()]);
        let rwo = |_: &str| Some(vec!["ReadWriteOnce".to_string()]);
        assert!(fenceable(&shared, Some(RunStrategy::Always), rwx));
        assert!(fenceable(&shared, Some(RunStrategy::RerunOnFailure), rwx));
        for s in [
            RunStrategy::Manual,
            RunStrategy::Halted,
            RunStrategy::Once,
            RunStrategy::WaitAsReceiver,
        ] {
            assert!(!fenceable(&shared, Some(s), rwx), "{s:?}");
        }
        assert!(!fenceable(&shared, None, rwx), "a VMI without a VM");
        assert!(!fenceable(&shared, Some(RunStrategy::Always), rwo));
        let host = vmi(
            serde_json::json!({"metadata": {"name": "h"}, "spec": {"domain": {},
            "volumes": [{"name": "r", "hostDisk": {"path": "/x", "type": "Disk"}}]}}),
        );
        assert!(!fenceable(&host, Some(RunStrategy::Always), rwx));
    }

    #[test]
    fn annotation_reading() {
        let mut v = vmi(serde_json::json!({"metadata": {"name": "a"}}));
        assert_eq!(vmi_fencing(&v), VmiFencing::Unannounced);
        for (value, want) in [
            (FENCING_ENABLED, VmiFencing::Enabled),
            (FENCING_DISABLED, VmiFencing::Disabled),
            ("bogus", VmiFencing::Disabled),
        ] {
            v.metadata
                .annotations
                .get_or_insert_default()
                .insert(FENCING_ANNOTATION.into(), value.into());
            assert_eq!(vmi_fencing(&v), want);
        }
    }

    #[test]
    fn timing_validation() {
        assert_eq!(FenceTiming::default().validate(), Ok(()));
        let t = |l, m| FenceTiming {
            lease_duration_seconds: l,
            fence_margin_seconds: m,
        };
        assert_eq!(
            t(3, 4).validate().unwrap_err().field,
            "leaseDurationSeconds"
        );
        assert_eq!(
            t(4000, 4).validate().unwrap_err().field,
            "leaseDurationSeconds"
        );
        assert_eq!(t(8, 1).validate().unwrap_err().field, "fenceMarginSeconds");
        assert_eq!(t(8, 0).validate().unwrap_err().field, "fenceMarginSeconds");
        assert!(t(4, 2).validate().is_ok());
        assert_eq!(t(8, 4).renew_interval_millis(), 2000);
        assert_eq!(t(4, 4).renew_interval_millis(), 1000);
        assert_eq!(t(40, 4).renew_interval_millis(), 10_000);
        assert_eq!(
            DEFAULT_RENEW_SECONDS * 1000,
            FenceTiming::default().renew_interval_millis() as u32
        );
    }
}
