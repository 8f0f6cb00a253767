//! The source agent's writes for post-copy (docs/migration.md "Post-copy"; the decisions are
//! [`crate::postcopy`]'s): `migrationState.mode: PostCopy` and an Event once the migration has
//! switched, and the end of a guest lost by a post-copy migration that broke (the VMI failed,
//! the source QEMU stopped; the target agent abandons its launcher on the failed state).

use std::time::Duration;

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_launcher::control::Request;

use super::{Agent, now_string};
use crate::launchers;
use crate::postcopy;

impl Agent {
    /// Records that the migration of `vmi` runs in post-copy: the guest runs on
    /// `target_node` now.
    pub(super) async fn record_post_copy(&self, vmi: &VirtualMachineInstance, target_node: &str) {
        if let Err(e) = self.patch_status(vmi, postcopy::mode_patch()).await {
            tracing::warn!("recording the post-copy mode: {e}");
        }
        self.event(
            vmi,
            "Normal",
            "MigrationPostCopy",
            &format!(
                "The migration did not complete within its completion timeout and switched to \
                 post-copy: the guest runs on {target_node}, its remaining memory follows on \
                 demand from {}; it can no longer return here",
                self.opts.node_name
            ),
        )
        .await;
    }

    /// A post-copy migration broke: the guest is lost. The VMI fails (with the migration),
    /// and the source QEMU, paused since the switch, is stopped; the target agent stops its
    /// half of the guest when it sees the failed migration. Never a QEMU resumed on either
    /// side.
    pub(super) async fn lose_guest(&self, vmi: &VirtualMachineInstance, reason: &str) {
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        tracing::error!(uid = %uid, "{reason}");
        self.event(vmi, "Warning", "FailedMigration", reason).await;
        let patch = postcopy::lost_patch(reason, &now_string());
        let mut tries = 0u32;
        while let Err(e) = self.patch_status(vmi, patch.clone()).await {
            tries += 1;
            tracing::warn!("recording the guest lost in post-copy ({e}); retrying");
            if tries >= 20 {
                break;
            }
            tokio::time::sleep(crate::migration::switch_over_backoff(tries)).await;
        }
        let _ = launchers::request(
            &self.cfg,
            &uid,
            &Request::Shutdown { grace_seconds: 0 },
            Duration::from_secs(30),
        )
        .await;
    }
}
