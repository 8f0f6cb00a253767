//! Live-migration vocabulary shared by the controllers and the agents (docs/migration.md):
//! whether a VMI can be live-migrated (the `LiveMigratable` condition, KubeVirt's reasons),
//! the finished states of a VMI's `status.migrationState`, and the event reasons.

use crate::kubevirt::vmi::{MigrationState, VirtualMachineInstance};

/// KubeVirt's `LiveMigratable=False` reasons.
pub mod reason {
    /// A disk cannot be reached from another node (a ReadWriteOnce claim, an unshared hostDisk).
    pub const DISKS_NOT_LIVE_MIGRATABLE: &str = "DisksNotLiveMigratable";
    /// A bridge binding on the pod network (the guest holds the pod's address).
    pub const INTERFACE_NOT_LIVE_MIGRATABLE: &str = "InterfaceNotLiveMigratable";
    /// A passed-through host device or GPU.
    pub const HOST_DEVICE_NOT_LIVE_MIGRATABLE: &str = "HostDeviceNotLiveMigratable";
}

/// Why a VMI cannot be live-migrated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotMigratable {
    /// One of [`reason`].
    pub reason: &'static str,
    /// Says which disk, interface or device, in KubeVirt's words.
    pub message: String,
}

impl std::fmt::Display for NotMigratable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.reason, self.message)
    }
}

/// How a live-migratable VMI moves (`status.migrationMethod`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Method {
    /// Every disk is shared (or read-only and regenerated on the target): memory only.
    Live,
    /// These volumes are node-local and writable: the target prepares an empty copy of the
    /// same size and the source mirrors them over NBD before the memory
    /// ([`METHOD_BLOCK`], docs/migration.md "Node-local disks").
    Block(Vec<BlockVolume>),
}

impl Method {
    /// The `status.migrationMethod` value.
    pub fn as_str(&self) -> &'static str {
        match self {
            Method::Live => METHOD_LIVE,
            Method::Block(_) => METHOD_BLOCK,
        }
    }
}

/// A volume copied by a block migration.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BlockVolume {
    /// The volume's name in the VMI spec (the disk's id in QEMU).
    pub volume: String,
    /// The claim, for a node-local claim (`None`: an emptyDisk, recreated on the target).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
}

/// Whether `vmi` can be live-migrated, and how. `access_modes(claim)` gives a claim's access
/// modes (`None`: unknown, treated as node-local); `block_ok(claim)` says whether a claim that
/// is not shared can be copied by a block migration (`Err(why)`: it cannot, e.g. a
/// hand-made PV or a volume with snapshots).
pub fn live_migratable(
    vmi: &VirtualMachineInstance,
    access_modes: impl Fn(&str) -> Option<Vec<String>>,
    block_ok: impl Fn(&str) -> Result<(), String>,
) -> Result<Method, NotMigratable> {
    let Some(spec) = vmi.spec.as_ref() else {
        return Ok(Method::Live);
    };
    let mut block = Vec::new();
    for v in spec.volumes.iter().flatten() {
        // containerDisk and ephemeral overlays: a writable qcow2 over a base (the image
        // cached on the node, a claim). The target prepares the same as at a start (the
        // image pulled into its cache, a fresh overlay) and the source mirrors what its
        // guest sees into that overlay in full, so the copy does not depend on the target's
        // base being byte-identical (only its size is checked, as for every copied disk).
        if v.container_disk.is_some() {
            block.push(BlockVolume {
                volume: v.name.clone(),
                claim: None,
            });
            continue;
        }
        if let Some(eph) = &v.ephemeral {
            // The base claim is opened read-only on the target too: it must be shared.
            let claim = eph
                .persistent_volume_claim
                .as_ref()
                .map(|p| p.claim_name.as_str())
                .unwrap_or_default();
            if !access_modes(claim).is_some_and(|m| crate::fencing::is_shared_access(&m)) {
                return Err(NotMigratable {
                    reason: reason::DISKS_NOT_LIVE_MIGRATABLE,
                    message: format!(
                        "cannot migrate VMI: volume {} (ephemeral) has its base on PVC {claim}, \
                         which is not shared (ReadWriteMany): the target cannot open it",
                        v.name
                    ),
                });
            }
            block.push(BlockVolume {
                volume: v.name.clone(),
                claim: None,
            });
            continue;
        }
        if v.empty_disk.is_some() {
            block.push(BlockVolume {
                volume: v.name.clone(),
                claim: None,
            });
            continue;
        }
        let claim = v
            .persistent_volume_claim
            .as_ref()
            .map(|p| (p.claim_name.as_str(), p.read_only == Some(true)))
            .or_else(|| v.data_volume.as_ref().map(|d| (d.name.as_str(), false)));
        if let Some((claim, read_only)) = claim
            && !access_modes(claim).is_some_and(|m| crate::fencing::is_shared_access(&m))
        {
            if read_only {
                return Err(NotMigratable {
                    reason: reason::DISKS_NOT_LIVE_MIGRATABLE,
                    message: format!(
                        "cannot migrate VMI: PVC {claim} is read-only and not shared: it                          cannot be copied to another node"
                    ),
                });
            }
            if let Err(why) = block_ok(claim) {
                return Err(NotMigratable {
                    reason: reason::DISKS_NOT_LIVE_MIGRATABLE,
                    message: format!(
                        "cannot migrate VMI: PVC {claim} is not shared (ReadWriteMany) and                          cannot be block-migrated: {why}"
                    ),
                });
            }
            block.push(BlockVolume {
                volume: v.name.clone(),
                claim: Some(claim.to_string()),
            });
        }
        if let Some(h) = &v.host_disk
            && h.shared != Some(true)
        {
            return Err(NotMigratable {
                reason: reason::DISKS_NOT_LIVE_MIGRATABLE,
                message: format!(
                    "cannot migrate VMI: hostDisk of volume {} is not shared",
                    v.name
                ),
            });
        }
    }
    let pod_networks: Vec<&str> = spec
        .networks
        .iter()
        .flatten()
        .filter(|n| n.pod.is_some())
        .map(|n| n.name.as_str())
        .collect();
    let devices = &spec.domain.devices;
    for i in devices.interfaces.iter().flatten() {
        if i.bridge.is_some() && pod_networks.contains(&i.name.as_str()) {
            return Err(NotMigratable {
                reason: reason::INTERFACE_NOT_LIVE_MIGRATABLE,
                message: format!(
                    "cannot migrate VMI which does not use masquerade, bridge with \
                     kubevirt.io/allow-pod-bridge-network-live-migration VM annotation or a \
                     migratable plugin to connect to the pod network (interface {})",
                    i.name
                ),
            });
        }
        if i.sriov.is_some() {
            return Err(NotMigratable {
                reason: reason::INTERFACE_NOT_LIVE_MIGRATABLE,
                message: format!("cannot migrate VMI with an SR-IOV interface ({})", i.name),
            });
        }
    }
    let gpus = devices.gpus.as_ref().map_or(0, Vec::len);
    let host_devices = devices.host_devices.as_ref().map_or(0, Vec::len);
    if gpus + host_devices > 0 {
        return Err(NotMigratable {
            reason: reason::HOST_DEVICE_NOT_LIVE_MIGRATABLE,
            message: "cannot migrate VMI with host devices or GPUs".into(),
        });
    }
    Ok(if block.is_empty() {
        Method::Live
    } else {
        Method::Block(block)
    })
}

/// Whether a migration state is finished (completed or failed).
pub fn finished(state: &MigrationState) -> bool {
    state.completed == Some(true) || state.failed == Some(true)
}

/// The value marking, in `targetDirectMigrationNodePorts`, the port on which the target
/// agent receives the node-local volumes' snapshot chains before its QEMU starts.
pub const CHAIN_PORT_MARK: i32 = 49154;

/// Whether the target only waits for the snapshot chains so far (its address is set, but
/// no port of the migration stream yet): it is still preparing, not ready.
pub fn chains_only(state: &MigrationState) -> bool {
    state
        .target_direct_migration_node_ports
        .as_ref()
        .is_some_and(|p| !p.is_empty() && p.values().all(|v| *v == CHAIN_PORT_MARK))
}

/// The migration state of `vmi` for the migration with uid `migration_uid`, if it is its
/// latest.
pub fn state_of<'a>(
    vmi: &'a VirtualMachineInstance,
    migration_uid: &str,
) -> Option<&'a MigrationState> {
    vmi.status
        .as_ref()
        .and_then(|s| s.migration_state.as_ref())
        .filter(|m| m.migration_uid.as_deref() == Some(migration_uid))
}

/// `status.migrationMethod` when every disk is shared.
pub const METHOD_LIVE: &str = "LiveMigration";
/// `status.migrationMethod` when node-local disks are copied too (a block mirror over NBD).
pub const METHOD_BLOCK: &str = "BlockMigration";
/// `migrationState.mode`: pre-copy (until the migration switches to post-copy).
pub const MODE_PRE_COPY: &str = "PreCopy";
/// `migrationState.mode` once an `allowPostCopy` migration switched to post-copy
/// (docs/migration.md "Post-copy").
pub const MODE_POST_COPY: &str = "PostCopy";

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vmi(spec: serde_json::Value) -> VirtualMachineInstance {
        serde_json::from_value(json!({"metadata": {"name": "a"}, "spec": spec})).unwrap()
    }

    fn rwx(_: &str) -> Option<Vec<String>> {
        Some(vec!["ReadWriteMany".into()])
    }

    fn rwo(_: &str) -> Option<Vec<String>> {
        Some(vec!["ReadWriteOnce".into()])
    }

    fn block_ok(_: &str) -> Result<(), String> {
        Ok(())
    }

    #[test]
    fn a_target_waiting_for_the_chains_only_is_not_ready() {
        let st = |ports: serde_json::Value| -> MigrationState {
            serde_json::from_value(json!({"targetNodeAddress": "10.0.0.2",
                "targetDirectMigrationNodePorts": ports}))
            .unwrap()
        };
        assert!(chains_only(&st(json!({"5555": CHAIN_PORT_MARK}))));
        assert!(!chains_only(&st(
            json!({"5555": CHAIN_PORT_MARK, "4444": 0})
        )));
        assert!(!chains_only(&st(json!({"4444": 0}))));
        assert!(!chains_only(&st(json!({}))));
        assert!(!chains_only(&st(json!(null))));
    }

    #[test]
    fn shared_claims_and_cloud_init_migrate_live_overlays_are_copied() {
        let v = vmi(json!({"domain": {}, "volumes": [
            {"name": "r", "persistentVolumeClaim": {"claimName": "c"}},
            {"name": "d", "dataVolume": {"name": "dv"}},
            {"name": "ci", "cloudInitNoCloud": {"userData": "#!/bin/sh"}}]}));
        assert_eq!(live_migratable(&v, rwx, block_ok), Ok(Method::Live));
        // containerDisk and ephemeral overlays (on a shared base) are block-migrated: the
        // target makes a fresh overlay on its own base, the source mirrors into it.
        for (name, local) in [
            ("cd", json!({"name": "cd", "containerDisk": {"image": "x"}})),
            (
                "eph",
                json!({"name": "eph", "ephemeral": {"persistentVolumeClaim": {"claimName": "c"}}}),
            ),
        ] {
            let v = vmi(json!({"domain": {}, "volumes": [local,
                {"name": "ci", "cloudInitNoCloud": {"userData": "#!/bin/sh"}}]}));
            assert_eq!(
                live_migratable(&v, rwx, block_ok),
                Ok(Method::Block(vec![BlockVolume {
                    volume: name.into(),
                    claim: None
                }]))
            );
        }
        // An ephemeral overlay whose base claim is node-local: the target cannot open it.
        let v = vmi(json!({"domain": {}, "volumes": [
            {"name": "eph", "ephemeral": {"persistentVolumeClaim": {"claimName": "c"}}}]}));
        let e = live_migratable(&v, rwo, block_ok).unwrap_err();
        assert_eq!(e.reason, reason::DISKS_NOT_LIVE_MIGRATABLE);
        assert!(
            e.message.contains("eph") && e.message.contains("PVC c"),
            "{e}"
        );
    }

    #[test]
    fn node_local_claims_and_empty_disks_are_block_migrated() {
        let v = vmi(json!({"domain": {}, "volumes": [
            {"name": "r", "persistentVolumeClaim": {"claimName": "local-disk"}},
            {"name": "e", "emptyDisk": {"capacity": "1Gi"}},
            {"name": "ci", "cloudInitNoCloud": {"userData": "#!/bin/sh"}}]}));
        let m = live_migratable(&v, rwo, block_ok).unwrap();
        assert_eq!(m.as_str(), METHOD_BLOCK);
        assert_eq!(
            m,
            Method::Block(vec![
                BlockVolume {
                    volume: "r".into(),
                    claim: Some("local-disk".into())
                },
                BlockVolume {
                    volume: "e".into(),
                    claim: None
                },
            ])
        );
        // A claim that cannot be copied (a hand-made PV, snapshots) is refused with why.
        let e = live_migratable(&v, rwo, |_| Err("it has snapshots".into())).unwrap_err();
        assert_eq!(e.reason, reason::DISKS_NOT_LIVE_MIGRATABLE);
        assert!(
            e.message.contains("local-disk") && e.message.contains("it has snapshots"),
            "{e}"
        );
        // An unknown claim counts as node-local.
        assert!(matches!(
            live_migratable(&v, |_| None, block_ok),
            Ok(Method::Block(_))
        ));
        let ro = vmi(json!({"domain": {}, "volumes": [
            {"name": "r", "persistentVolumeClaim": {"claimName": "c", "readOnly": true}}]}));
        assert!(live_migratable(&ro, rwo, block_ok).is_err());
        let h = vmi(json!({"domain": {}, "volumes": [
            {"name": "h", "hostDisk": {"path": "/x", "type": "Disk"}}]}));
        assert_eq!(
            live_migratable(&h, rwx, block_ok).unwrap_err().reason,
            reason::DISKS_NOT_LIVE_MIGRATABLE
        );
    }

    #[test]
    fn pod_bridge_and_host_devices_are_refused() {
        let bridge = vmi(json!({"domain": {"devices": {"interfaces": [
            {"name": "default", "bridge": {}}]}},
            "networks": [{"name": "default", "pod": {}}]}));
        assert_eq!(
            live_migratable(&bridge, rwx, block_ok).unwrap_err().reason,
            reason::INTERFACE_NOT_LIVE_MIGRATABLE
        );
        let masq = vmi(json!({"domain": {"devices": {"interfaces": [
            {"name": "default", "masquerade": {}}]}},
            "networks": [{"name": "default", "pod": {}}]}));
        assert_eq!(live_migratable(&masq, rwx, block_ok), Ok(Method::Live));
        let gpu = vmi(json!({"domain": {"devices": {"gpus": [
            {"name": "g", "deviceName": "nvidia.com/x"}]}}}));
        assert_eq!(
            live_migratable(&gpu, rwx, block_ok).unwrap_err().reason,
            reason::HOST_DEVICE_NOT_LIVE_MIGRATABLE
        );
    }
}
