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

/// Whether `vmi` can be live-migrated; `access_modes(claim)` gives a claim's access modes
/// (`None`: unknown, treated as node-local). Node-local disks and node-local writable copies
/// (containerDisk, ephemeral, emptyDisk) are not migrated yet.
pub fn live_migratable(
    vmi: &VirtualMachineInstance,
    access_modes: impl Fn(&str) -> Option<Vec<String>>,
) -> Result<(), NotMigratable> {
    let Some(spec) = vmi.spec.as_ref() else {
        return Ok(());
    };
    for v in spec.volumes.iter().flatten() {
        // A writable copy kept on the node (containerDisk and ephemeral overlays, emptyDisk)
        // would need a block migration, which is not done yet: the target would start from
        // a fresh copy and the guest would see its disk change under it.
        let local_copy = if v.container_disk.is_some() {
            Some("containerDisk")
        } else if v.ephemeral.is_some() {
            Some("ephemeral")
        } else if v.empty_disk.is_some() {
            Some("emptyDisk")
        } else {
            None
        };
        if let Some(kind) = local_copy {
            return Err(NotMigratable {
                reason: reason::DISKS_NOT_LIVE_MIGRATABLE,
                message: format!(
                    "cannot migrate VMI: volume {} ({kind}) is a writable copy on the node and \
                     block migration is not supported yet",
                    v.name
                ),
            });
        }
        let claim = v
            .persistent_volume_claim
            .as_ref()
            .map(|p| p.claim_name.as_str())
            .or_else(|| v.data_volume.as_ref().map(|d| d.name.as_str()));
        if let Some(claim) = claim
            && !access_modes(claim).is_some_and(|m| crate::fencing::is_shared_access(&m))
        {
            return Err(NotMigratable {
                reason: reason::DISKS_NOT_LIVE_MIGRATABLE,
                message: format!(
                    "cannot migrate VMI: PVC {claim} is not shared, live migration requires \
                     that all PVCs must be shared (using ReadWriteMany access mode)"
                ),
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
    Ok(())
}

/// Whether a migration state is finished (completed or failed).
pub fn finished(state: &MigrationState) -> bool {
    state.completed == Some(true) || state.failed == Some(true)
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

/// `status.migrationMethod` when every disk is shared (node-local disks would need a block
/// migration, not done yet).
pub const METHOD_LIVE: &str = "LiveMigration";
/// `migrationState.mode`: pre-copy (post-copy is not offered yet).
pub const MODE_PRE_COPY: &str = "PreCopy";

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

    #[test]
    fn shared_claims_and_cloud_init_migrate_node_local_copies_do_not() {
        let v = vmi(json!({"domain": {}, "volumes": [
            {"name": "r", "persistentVolumeClaim": {"claimName": "c"}},
            {"name": "d", "dataVolume": {"name": "dv"}},
            {"name": "ci", "cloudInitNoCloud": {"userData": "#!/bin/sh"}}]}));
        assert_eq!(live_migratable(&v, rwx), Ok(()));
        for local in [
            json!({"name": "cd", "containerDisk": {"image": "x"}}),
            json!({"name": "e", "emptyDisk": {"capacity": "1Gi"}}),
            json!({"name": "eph", "ephemeral": {"persistentVolumeClaim": {"claimName": "c"}}}),
        ] {
            let v = vmi(json!({"domain": {}, "volumes": [local]}));
            let e = live_migratable(&v, rwx).unwrap_err();
            assert_eq!(e.reason, reason::DISKS_NOT_LIVE_MIGRATABLE);
            assert!(e.message.contains("block migration"), "{e}");
        }
    }

    #[test]
    fn node_local_claims_are_refused_naming_the_claim() {
        let v = vmi(json!({"domain": {}, "volumes": [
            {"name": "r", "persistentVolumeClaim": {"claimName": "local-disk"}}]}));
        let e = live_migratable(&v, rwo).unwrap_err();
        assert_eq!(e.reason, reason::DISKS_NOT_LIVE_MIGRATABLE);
        assert!(e.message.contains("local-disk"), "{e}");
        // An unknown claim counts as node-local.
        assert!(live_migratable(&v, |_| None).is_err());
        let h = vmi(json!({"domain": {}, "volumes": [
            {"name": "h", "hostDisk": {"path": "/x", "type": "Disk"}}]}));
        assert_eq!(
            live_migratable(&h, rwx).unwrap_err().reason,
            reason::DISKS_NOT_LIVE_MIGRATABLE
        );
    }

    #[test]
    fn pod_bridge_and_host_devices_are_refused() {
        let bridge = vmi(json!({"domain": {"devices": {"interfaces": [
            {"name": "default", "bridge": {}}]}},
            "networks": [{"name": "default", "pod": {}}]}));
        assert_eq!(
            live_migratable(&bridge, rwx).unwrap_err().reason,
            reason::INTERFACE_NOT_LIVE_MIGRATABLE
        );
        let masq = vmi(json!({"domain": {"devices": {"interfaces": [
            {"name": "default", "masquerade": {}}]}},
            "networks": [{"name": "default", "pod": {}}]}));
        assert_eq!(live_migratable(&masq, rwx), Ok(()));
        let gpu = vmi(json!({"domain": {"devices": {"gpus": [
            {"name": "g", "deviceName": "nvidia.com/x"}]}}}));
        assert_eq!(
            live_migratable(&gpu, rwx).unwrap_err().reason,
            reason::HOST_DEVICE_NOT_LIVE_MIGRATABLE
        );
    }
}
