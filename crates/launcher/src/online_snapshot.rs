//! Online snapshots of a running VM's disks (docs/snapshots.md, "Online snapshots").
//!
//! The agent prepares one empty qcow2 overlay per disk over the disk's current top layer; the
//! launcher then:
//!
//! 1. opens each overlay itself (QEMU runs under its own uid and cannot open files in the 0700
//!    volume directories) and hands the descriptor to QEMU (`add-fd`), adds the overlay as a
//!    block node over `/dev/fdset/N` with `backing: null` (`blockdev-add`), so QEMU never opens
//!    the backing file named in the image header;
//! 2. freezes the guest's filesystems through the guest agent (`guest-fsfreeze-freeze`) unless
//!    the VM is paused or no guest agent answers (then the snapshot is crash-consistent, as
//!    KubeVirt's);
//! 3. switches every disk to its overlay at once: one QMP `transaction` of `blockdev-snapshot`s;
//! 4. thaws (`guest-fsfreeze-thaw`, retried until the guest says it is thawed).
//!
//! The freeze is the launcher's own and is bounded: when the switch has not finished within
//! the request's deadline after the freeze began, the guest is thawed at the deadline and the
//! result carries the `QuiesceTimeout` indication. The thaw happens on every path — a failed
//! switch, a failed freeze, a freeze that timed out — and does not depend on the caller: the
//! request runs to its end in the launcher's main loop even when the agent (or the controller
//! behind it) goes away meanwhile. On failure every added node and descriptor set is removed
//! again and the disks are as before.
//!
//! The QMP arguments, node names and indications are pure functions, unit-tested below.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::cmdline::disk_node_name;
use crate::error::{Error, Result};
use crate::lifecycle::Vm;

/// KubeVirt's snapshot indications.
pub const ONLINE: &str = "Online";
pub const GUEST_AGENT: &str = "GuestAgent";
pub const NO_GUEST_AGENT: &str = "NoGuestAgent";
pub const QUIESCE_TIMEOUT: &str = "QuiesceTimeout";
pub const PAUSED: &str = "Paused";

/// One disk's new top layer, prepared by the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OverlayDisk {
    /// The launch-spec disk id.
    pub disk: String,
    /// The empty qcow2 overlay (an existing regular file).
    pub overlay: PathBuf,
}

/// The reply to an online snapshot: how the guest was quiesced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OnlineSnapshotDone {
    /// KubeVirt's indications (`Online`, `GuestAgent` | `NoGuestAgent` | `Paused`,
    /// `QuiesceTimeout`).
    pub indications: Vec<String>,
}

/// The guest's state when an online snapshot is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotGuest {
    /// Running: the snapshot freezes it through the guest agent (when one answers).
    Running,
    /// Paused: nothing runs in it, nothing to freeze.
    Paused,
    /// Running, its filesystems already frozen by a held freeze (`crate::freeze`): the
    /// snapshot neither freezes nor thaws.
    HeldFrozen,
}

/// How the guest was quiesced for the switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quiesce {
    /// The VM was paused: nothing runs in it, nothing to freeze.
    Paused,
    /// No guest agent answered: crash-consistent.
    NoGuestAgent,
    /// Frozen and thawed after the switch.
    Frozen,
    /// Frozen, but the switch (or the freeze itself) outlasted the deadline: thawed at the
    /// deadline.
    TimedOut,
}

/// The indications for a snapshot quiesced as `q`.
pub fn indications(q: Quiesce) -> Vec<String> {
    let mut v = vec![ONLINE.to_string()];
    match q {
        Quiesce::Paused => v.push(PAUSED.into()),
        Quiesce::NoGuestAgent => v.push(NO_GUEST_AGENT.into()),
        Quiesce::Frozen => v.push(GUEST_AGENT.into()),
        Quiesce::TimedOut => {
            v.push(GUEST_AGENT.into());
            v.push(QUIESCE_TIMEOUT.into());
        }
    }
    v
}

/// The block nodes of one overlay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverlayNodes {
    pub disk: String,
    pub file: String,
    pub fmt: String,
}

/// The node names of disk `disk`'s overlay number `seq` (unique for the launcher's life).
pub fn overlay_nodes(disk: &str, seq: u32) -> OverlayNodes {
    OverlayNodes {
        disk: disk.to_string(),
        file: format!("file-{disk}-s{seq}"),
        fmt: format!("fmt-{disk}-s{seq}"),
    }
}

/// The two `blockdev-add` arguments of an overlay opened from descriptor set `fdset`: the
/// protocol node, then the qcow2 node with no backing (`blockdev-snapshot` attaches it).
pub fn overlay_blockdevs(nodes: &OverlayNodes, fdset: u64) -> [Value; 2] {
    [
        json!({
            "driver": "file",
            "filename": format!("/dev/fdset/{fdset}"),
            "node-name": nodes.file,
        }),
        json!({
            "driver": "qcow2",
            "file": nodes.file,
            "node-name": nodes.fmt,
            "backing": Value::Null,
        }),
    ]
}

/// The one `transaction` switching each `(current top, overlay)` pair at once.
pub fn transaction(pairs: &[(String, String)]) -> Value {
    let actions: Vec<Value> = pairs
        .iter()
        .map(|(node, overlay)| {
            json!({"type": "blockdev-snapshot", "data": {"node": node, "overlay": overlay}})
        })
        .collect();
    json!({ "actions": actions })
}

/// The launcher's memory of each disk's current top node: `fmt-<disk>` at start, the overlay's
/// format node after each online snapshot.
#[derive(Debug, Default)]
pub struct Tops {
    nodes: BTreeMap<String, String>,
    seq: u32,
    /// Format node → its protocol node, where it is not the `file-…` twin of the format
    /// node's name (a node reopened writable by `crate::online_reclaim`).
    pub(crate) files: BTreeMap<String, String>,
}

impl Tops {
    /// The node disk `disk` writes now.
    pub fn top(&self, disk: &str) -> String {
        self.nodes
            .get(disk)
            .cloned()
            .unwrap_or_else(|| disk_node_name(disk))
    }

    /// Records that disk `disk` now writes `node` (an active commit pivoted to it).
    pub(crate) fn set_top(&mut self, disk: &str, node: &str) {
        self.nodes.insert(disk.to_string(), node.to_string());
    }

    /// The protocol node under format node `fmt`.
    pub(crate) fn file_of(&self, fmt: &str) -> String {
        self.files
            .get(fmt)
            .cloned()
            .unwrap_or_else(|| format!("file-{}", fmt.strip_prefix("fmt-").unwrap_or(fmt)))
    }

    pub(crate) fn next_seq(&mut self) -> u32 {
        self.seq += 1;
        self.seq
    }
}

/// Checks a request against the VM's disks: each a writable, non-empty disk of the spec,
/// named once.
pub fn check_disks(spec: &crate::spec::LaunchSpec, disks: &[OverlayDisk]) -> Result<()> {
    if disks.is_empty() {
        return Err(Error::InvalidSpec("an online snapshot needs a disk".into()));
    }
    let mut seen = std::collections::BTreeSet::new();
    for d in disks {
        let Some(disk) = spec.disks.iter().find(|x| x.id == d.disk) else {
            return Err(Error::InvalidSpec(format!("the VM has no disk {}", d.disk)));
        };
        if disk.is_readonly() || disk.empty {
            return Err(Error::InvalidSpec(format!(
                "disk {} is read-only or empty: it cannot be snapshotted online",
                d.disk
            )));
        }
        if !seen.insert(&d.disk) {
            return Err(Error::InvalidSpec(format!("disk {} named twice", d.disk)));
        }
    }
    Ok(())
}

/// Opens an overlay for QEMU: read-write, no symlink followed, a regular file.
pub(crate) fn open_overlay(path: &std::path::Path) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let ctx = || format!("opening overlay {}", path.display());
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path)
        .map_err(|e| Error::io(ctx(), e))?;
    let meta = f.metadata().map_err(|e| Error::io(ctx(), e))?;
    if !meta.is_file() {
        return Err(Error::InvalidSpec(format!(
            "overlay {} is not a regular file",
            path.display()
        )));
    }
    Ok(f)
}

/// Takes the online snapshot (see the module doc) of a guest in state `guest`.
pub async fn take(
    vm: &Vm,
    tops: &mut Tops,
    disks: &[OverlayDisk],
    freeze_timeout: Duration,
    guest: SnapshotGuest,
) -> Result<OnlineSnapshotDone> {
    check_disks(vm.spec(), disks)?;
    let seq = tops.next_seq();
    let mut added: Vec<(OverlayNodes, Option<u64>, bool)> = Vec::new();
    if let Err(e) = add_overlays(vm, disks, seq, &mut added).await {
        remove_overlays(vm, &added).await;
        return Err(e);
    }
    let pairs: Vec<(String, String)> = added
        .iter()
        .map(|(n, _, _)| (tops.top(&n.disk), n.fmt.clone()))
        .collect();

    let started = tokio::time::Instant::now();
    let deadline = started + freeze_timeout;
    let mut quiesce = match guest {
        SnapshotGuest::Paused => Quiesce::Paused,
        // Frozen by whoever holds the freeze, who also thaws.
        SnapshotGuest::HeldFrozen => Quiesce::Frozen,
        SnapshotGuest::Running => match freeze(vm, freeze_timeout).await {
            Ok(q) => q,
            Err(e) => {
                thaw(vm).await;
                remove_overlays(vm, &added).await;
                return Err(e);
            }
        },
    };
    let frozen = matches!(quiesce, Quiesce::Frozen) && guest == SnapshotGuest::Running;
    if quiesce == Quiesce::TimedOut {
        // The freeze itself outlasted the deadline: thaw before the switch.
        thaw(vm).await;
    }
    let switch = vm.qmp().execute_with_timeout(
        "transaction",
        Some(transaction(&pairs)),
        Duration::from_secs(60),
    );
    tokio::pin!(switch);
    let outcome = if frozen {
        tokio::select! {
            r = &mut switch => {
                thaw(vm).await;
                r
            }
            _ = tokio::time::sleep_until(deadline) => {
                tracing::warn!("online snapshot: the freeze reached its deadline; thawing");
                thaw(vm).await;
                quiesce = Quiesce::TimedOut;
                switch.await
            }
        }
    } else {
        switch.await
    };
    match outcome {
        Ok(_) => {
            for (n, _, _) in &added {
                tops.nodes.insert(n.disk.clone(), n.fmt.clone());
            }
            tracing::info!(
                disks = disks.len(),
                ms = started.elapsed().as_millis() as u64,
                ?quiesce,
                "online snapshot taken"
            );
            Ok(OnlineSnapshotDone {
                indications: indications(quiesce),
            })
        }
        Err(e) => {
            remove_overlays(vm, &added).await;
            Err(e)
        }
    }
}

/// Opens and adds every overlay; `added` records what exists so far (nodes, descriptor set,
/// whether the format node was added) for the cleanup.
async fn add_overlays(
    vm: &Vm,
    disks: &[OverlayDisk],
    seq: u32,
    added: &mut Vec<(OverlayNodes, Option<u64>, bool)>,
) -> Result<()> {
    use std::os::fd::AsFd;
    for d in disks {
        let nodes = overlay_nodes(&d.disk, seq);
        let file = open_overlay(&d.overlay)?;
        let r = vm
            .qmp()
            .execute_with_fd("add-fd", Some(json!({})), file.as_fd())
            .await?;
        drop(file);
        let fdset = r
            .get("fdset-id")
            .and_then(Value::as_u64)
            .ok_or_else(|| Error::Protocol(format!("add-fd answered without an fdset-id: {r}")))?;
        added.push((nodes.clone(), Some(fdset), false));
        let [file_node, fmt_node] = overlay_blockdevs(&nodes, fdset);
        vm.qmp().execute("blockdev-add", Some(file_node)).await?;
        vm.qmp().execute("blockdev-add", Some(fmt_node)).await?;
        if let Some(last) = added.last_mut() {
            last.2 = true;
        }
    }
    Ok(())
}

/// Removes what [`add_overlays`] added (best effort, logged).
async fn remove_overlays(vm: &Vm, added: &[(OverlayNodes, Option<u64>, bool)]) {
    for (nodes, fdset, fmt_added) in added.iter().rev() {
        let mut names = Vec::new();
        if *fmt_added {
            names.push(&nodes.fmt);
        }
        names.push(&nodes.file);
        for name in names {
            if let Err(e) = vm
                .qmp()
                .execute("blockdev-del", Some(json!({"node-name": name})))
                .await
            {
                tracing::debug!(node = %name, "blockdev-del: {e}");
            }
        }
        if let Some(id) = fdset
            && let Err(e) = vm
                .qmp()
                .execute("remove-fd", Some(json!({"fdset-id": id})))
                .await
        {
            tracing::debug!(fdset = id, "remove-fd: {e}");
        }
    }
}

/// Freezes the guest's filesystems: `NoGuestAgent` when none answers, `TimedOut` when the
/// freeze did not answer within `deadline`; an error the guest agent returned is an error.
async fn freeze(vm: &Vm, deadline: Duration) -> Result<Quiesce> {
    let mut qga = match vm.guest_agent().await {
        Ok(g) => g,
        Err(e) => {
            tracing::info!("online snapshot without a guest agent: {e}");
            return Ok(Quiesce::NoGuestAgent);
        }
    };
    if let Err(e) = qga.ping().await {
        tracing::info!("online snapshot: the guest agent does not answer: {e}");
        return Ok(Quiesce::NoGuestAgent);
    }
    match qga
        .execute_with_timeout("guest-fsfreeze-freeze", None, deadline)
        .await
    {
        Ok(n) => {
            tracing::info!(filesystems = %n, "guest filesystems frozen");
            Ok(Quiesce::Frozen)
        }
        Err(Error::Timeout { .. }) => Ok(Quiesce::TimedOut),
        Err(e) => Err(Error::Protocol(format!(
            "freezing the guest's filesystems failed: {e}"
        ))),
    }
}

/// How long the launcher keeps trying to thaw.
const THAW_FOR: Duration = Duration::from_secs(30);

/// Thaws the guest's filesystems, retrying until the guest agent confirms (or [`THAW_FOR`]
/// passed: the failure is logged).
pub(crate) async fn thaw(vm: &Vm) {
    let until = tokio::time::Instant::now() + THAW_FOR;
    loop {
        let done = async {
            let mut qga = vm.guest_agent().await?;
            qga.execute_with_timeout("guest-fsfreeze-thaw", None, Duration::from_secs(5))
                .await?;
            Ok::<_, Error>(())
        }
        .await;
        match done {
            Ok(()) => return,
            Err(e) => {
                // A thaw of a guest that is not frozen is an error too: ask.
                let status = async {
                    let mut qga = vm.guest_agent().await?;
                    qga.execute_with_timeout("guest-fsfreeze-status", None, Duration::from_secs(2))
                        .await
                }
                .await;
                if status.as_ref().ok().and_then(Value::as_str) == Some("thawed") {
                    return;
                }
                if tokio::time::Instant::now() >= until {
                    tracing::error!("could not thaw the guest's filesystems: {e}");
                    return;
                }
                tracing::warn!("thawing the guest's filesystems: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indications_follow_kubevirt() {
        assert_eq!(indications(Quiesce::Frozen), vec!["Online", "GuestAgent"]);
        assert_eq!(
            indications(Quiesce::NoGuestAgent),
            vec!["Online", "NoGuestAgent"]
        );
        assert_eq!(indications(Quiesce::Paused), vec!["Online", "Paused"]);
        assert_eq!(
            indications(Quiesce::TimedOut),
            vec!["Online", "GuestAgent", "QuiesceTimeout"]
        );
    }

    #[test]
    fn overlays_are_added_without_a_backing_and_switched_in_one_transaction() {
        let n = overlay_nodes("disk-data", 3);
        assert_eq!(n.file, "file-disk-data-s3");
        assert_eq!(n.fmt, "fmt-disk-data-s3");
        let [file, fmt] = overlay_blockdevs(&n, 7);
        assert_eq!(file["filename"], "/dev/fdset/7");
        assert_eq!(fmt["file"], "file-disk-data-s3");
        assert!(fmt["backing"].is_null(), "{fmt}");
        let t = transaction(&[
            ("fmt-disk-root".into(), "fmt-disk-root-s1".into()),
            ("fmt-disk-data".into(), "fmt-disk-data-s1".into()),
        ]);
        assert_eq!(t["actions"].as_array().unwrap().len(), 2);
        assert_eq!(t["actions"][1]["type"], "blockdev-snapshot");
        assert_eq!(t["actions"][1]["data"]["node"], "fmt-disk-data");
        assert_eq!(t["actions"][1]["data"]["overlay"], "fmt-disk-data-s1");
    }

    #[test]
    fn tops_start_at_the_disk_node_and_follow_the_overlays() {
        let mut t = Tops::default();
        assert_eq!(t.top("disk-a"), "fmt-disk-a");
        let s = t.next_seq();
        t.nodes
            .insert("disk-a".into(), overlay_nodes("disk-a", s).fmt);
        assert_eq!(t.top("disk-a"), "fmt-disk-a-s1");
        assert_eq!(t.top("disk-b"), "fmt-disk-b");
        assert_eq!(t.next_seq(), 2);
    }

    #[test]
    fn only_writable_disks_of_the_vm_named_once() {
        let spec: crate::spec::LaunchSpec = serde_json::from_value(json!({
            "name": "x", "uuid": "u", "memoryMib": 64,
            "disks": [
                {"id": "disk-a", "path": "/v/a/disk.img"},
                {"id": "disk-ro", "path": "/v/b/disk.img", "readonly": true},
            ],
            "sockets": {"qmp": "/q"},
        }))
        .unwrap();
        let d = |id: &str| OverlayDisk {
            disk: id.into(),
            overlay: "/v/a/layer-000001.qcow2".into(),
        };
        assert!(check_disks(&spec, &[d("disk-a")]).is_ok());
        assert!(check_disks(&spec, &[]).is_err());
        assert!(check_disks(&spec, &[d("disk-zz")]).is_err());
        assert!(check_disks(&spec, &[d("disk-ro")]).is_err());
        assert!(check_disks(&spec, &[d("disk-a"), d("disk-a")]).is_err());
    }

    #[test]
    fn an_overlay_that_is_a_symlink_or_not_a_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::write(&real, b"x").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(open_overlay(&real).is_ok());
        assert!(open_overlay(&link).is_err());
        assert!(open_overlay(dir.path()).is_err());
    }
}
