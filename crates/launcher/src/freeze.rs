//! A guest filesystem freeze held on request: KubeVirt's `freeze` and `unfreeze`
//! subresources of a VirtualMachineInstance (used, among others, by a backup that freezes
//! several VMs in one window, docs/backup.md "Consistency"). [`hold`] freezes through the
//! guest agent (`guest-fsfreeze-freeze`, bounded by [`FREEZE_WITHIN`]); the launcher thaws at
//! the hold's deadline (`unfreezeTimeout`) on its own, so a caller that goes away never leaves
//! the guest frozen; [`release`] thaws on request. While a hold lasts, an online snapshot
//! switches the disks without a freeze and thaw of its own ([`snapshot_guest`]): the caller
//! that froze the guest thaws it.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::lifecycle::Vm;
use crate::online_snapshot::SnapshotGuest;

/// How long the guest agent may take to freeze the filesystems.
pub const FREEZE_WITHIN: Duration = Duration::from_secs(30);

/// The longest hold a request may ask for.
pub const MAX_HOLD: Duration = Duration::from_secs(24 * 3600);

/// How an online snapshot treats the guest (pure): a paused VM needs no freeze, a held
/// freeze is the requester's, otherwise the snapshot freezes for itself.
pub fn snapshot_guest(paused: bool, held: bool) -> SnapshotGuest {
    match (paused, held) {
        (true, _) => SnapshotGuest::Paused,
        (false, true) => SnapshotGuest::HeldFrozen,
        (false, false) => SnapshotGuest::Running,
    }
}

/// Freezes the guest's filesystems for a hold. Fails (and leaves the guest thawed) when no
/// guest agent answers or the freeze fails or outlasts [`FREEZE_WITHIN`].
pub async fn hold(vm: &Vm) -> Result<u64> {
    let frozen = async {
        let mut qga = vm.guest_agent().await?;
        qga.ping().await?;
        qga.execute_with_timeout("guest-fsfreeze-freeze", None, FREEZE_WITHIN)
            .await
    }
    .await;
    match frozen {
        Ok(n) => {
            tracing::info!(filesystems = %n, "guest filesystems frozen on request");
            Ok(n.as_u64().unwrap_or_default())
        }
        Err(e) => {
            release(vm).await;
            Err(Error::Protocol(format!(
                "freezing the guest's filesystems failed: {e}"
            )))
        }
    }
}

/// Thaws the guest's filesystems (retried until the guest agent confirms).
pub async fn release(vm: &Vm) {
    crate::online_snapshot::thaw(vm).await;
    tracing::info!("guest filesystems thawed");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_freeze_is_the_snapshots_unless_paused() {
        assert_eq!(snapshot_guest(true, true), SnapshotGuest::Paused);
        assert_eq!(snapshot_guest(true, false), SnapshotGuest::Paused);
        assert_eq!(snapshot_guest(false, true), SnapshotGuest::HeldFrozen);
        assert_eq!(snapshot_guest(false, false), SnapshotGuest::Running);
    }
}
