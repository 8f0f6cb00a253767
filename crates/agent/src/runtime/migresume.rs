//! A restarted source agent picks up the migration it was sending (docs/migration.md "Agent
//! restarts"; the decision is [`crate::migresume`]'s): the VMI read fresh, the launcher's QEMU
//! asked (`query-migrate`), then the original path's following, switch-over or failure.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_launcher::control::Request;

use super::migration::FollowOut;
use super::{Agent, ns_name};
use crate::decide::Observed;
use crate::launchers;
use crate::migration as mig;
use crate::migresume::{self as resume, LauncherView, Resume};

impl Agent {
    /// Picks up the unfinished migration of `cached` (a VMI this node was sending when the
    /// agent restarted); the VMI is in `busy` until this returns.
    pub(super) async fn resume_out(self: Arc<Self>, cached: VirtualMachineInstance) {
        let uid = cached.metadata.uid.clone().unwrap_or_default();
        self.resume_once(&cached).await;
        self.busy.lock().await.remove(&uid);
    }

    async fn resume_once(&self, cached: &VirtualMachineInstance) {
        // Decide on the VMI as it is now, not on a cached copy that may predate the end of
        // the migration this agent itself just recorded.
        let (ns, name) = ns_name(cached);
        let vmi: VirtualMachineInstance = match self.vmi_api(&ns).get_opt(&name).await {
            Ok(Some(o)) => match serde_json::to_value(o).and_then(serde_json::from_value) {
                Ok(v) => v,
                Err(_) => return,
            },
            _ => return,
        };
        if vmi.metadata.uid != cached.metadata.uid {
            return;
        }
        let uid = vmi.metadata.uid.clone().unwrap_or_default();
        let block = mig::read_block_volumes(&self.cfg.vmi_dir(&uid));
        let answer = self.launcher_migration(&uid).await;
        let view = match &answer {
            Some(Ok(v)) => LauncherView::Answered(v),
            Some(Err(())) => LauncherView::NoAnswer,
            None => LauncherView::Gone,
        };
        let step = resume::resume_step(&vmi, &self.opts.node_name, false, !block.is_empty(), view);
        let st = vmi
            .status
            .as_ref()
            .and_then(|s| s.migration_state.clone())
            .unwrap_or_default();
        let target_node = st.target_node.clone().unwrap_or_default();
        let migration_uid = st.migration_uid.clone().unwrap_or_default();
        let qemu = match &answer {
            Some(Ok(v)) => v["status"].as_str().unwrap_or("none").to_string(),
            _ => "unknown".into(),
        };
        tracing::info!(uid = %uid, ?step, qemu, "resuming a migration after a restart");
        match step {
            Resume::Nothing | Resume::Retry => return,
            Resume::Fail(reason) => {
                self.fail_out(&vmi, &reason).await;
                return;
            }
            Resume::Lost(reason) => {
                self.lose_guest(&vmi, &reason).await;
                return;
            }
            Resume::Follow | Resume::SwitchOver => {}
        }
        self.event(
            &vmi,
            "Normal",
            "MigrationResumed",
            &format!(
                "The agent on {} restarted during the migration to {target_node}; QEMU reports \
                 it {qemu}: following it again",
                self.opts.node_name
            ),
        )
        .await;
        let outcome = self
            .follow_out(FollowOut {
                vmi: &vmi,
                target_node: &target_node,
                migration_uid: &migration_uid,
                block: &block,
                copy_started: Instant::now(),
                abort: None,
            })
            .await;
        if let Err(reason) = outcome {
            self.fail_out(&vmi, &reason).await;
        }
    }

    /// The launcher's `query-migrate`: `None` when no launcher runs (asked twice, a second
    /// apart), `Some(Err(()))` when one runs but did not answer.
    async fn launcher_migration(&self, uid: &str) -> Option<Result<serde_json::Value, ()>> {
        for attempt in 0..2 {
            if let Observed::Running(_) = launchers::observe(&self.cfg, uid).await {
                return Some(
                    launchers::request(
                        &self.cfg,
                        uid,
                        &Request::MigrationStatus,
                        Duration::from_secs(10),
                    )
                    .await
                    .map_err(|e| tracing::warn!(uid, "asking the launcher's migration: {e}")),
                );
            }
            if attempt == 0 {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
        None
    }
}
