//! The launcher's answer to the agent's `stats` request (the agent's `/metrics`): QMP
//! `query-blockstats` raw, and, when the VM has its virtio balloon, the guest's memory
//! statistics as the balloon driver reports them (QOM `guest-stats` of `balloon0`, polled by
//! QEMU every [`POLL_SECONDS`] from the first request on) and the balloon's size
//! (`query-balloon`). A guest without the driver, or one that has not reported yet, leaves the
//! memory part out; only the block statistics are required.

use std::time::Duration;

use serde_json::{Value, json};

use crate::error::Result;
use crate::lifecycle::Vm;

/// How often QEMU asks the guest's balloon driver for its statistics.
pub const POLL_SECONDS: u64 = 5;
/// The balloon device's QOM path (`-device virtio-balloon-pci,id=balloon0`).
pub const BALLOON_PATH: &str = "/machine/peripheral/balloon0";

/// `{"blockstats": …, "guestStats": {"stats": {…}, "last-update": …}?, "balloon": {"actual":
/// bytes}?}`. `polling`: whether the balloon's polling was switched on already.
pub async fn gather(vm: &Vm, timeout: Duration, polling: &mut bool) -> Result<Value> {
    let blockstats = vm
        .qmp()
        .execute_with_timeout("query-blockstats", None, timeout)
        .await?;
    let mut out = json!({ "blockstats": blockstats });
    if !vm.spec().balloon {
        return Ok(out);
    }
    if !*polling {
        let args = json!({"path": BALLOON_PATH, "property": "guest-stats-polling-interval",
            "value": POLL_SECONDS});
        match vm
            .qmp()
            .execute_with_timeout("qom-set", Some(args), timeout)
            .await
        {
            Ok(_) => *polling = true,
            Err(e) => tracing::debug!("balloon statistics polling: {e}"),
        }
    }
    // QEMU answers an error until the guest's driver has reported once.
    let args = json!({"path": BALLOON_PATH, "property": "guest-stats"});
    if let Ok(g) = vm
        .qmp()
        .execute_with_timeout("qom-get", Some(args), timeout)
        .await
    {
        out["guestStats"] = g;
    }
    if let Ok(b) = vm
        .qmp()
        .execute_with_timeout("query-balloon", None, timeout)
        .await
    {
        out["balloon"] = b;
    }
    Ok(out)
}
