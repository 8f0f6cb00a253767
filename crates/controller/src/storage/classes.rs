//! The built-in StorageClasses and their StorageProfiles. `local` (the default class:
//! node-local directories, ReadWriteOnce, WaitForFirstConsumer) and `shared` (a directory on
//! the server's machine, ReadWriteMany, Immediate) are created at startup when absent; every
//! StorageClass gets a StorageProfile of the same name whose status says which access and
//! volume modes the class supports and how it clones (`copy`). A class of the shared
//! provisioner with the `ferrovirt.io/shared-mount` parameter keeps its volumes on a shared
//! filesystem the administrator mounted on every node ([`shared_mount`],
//! `ferrovirt_storage::shared_mount`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};

use ferrovirt_api::cdi::{ClaimPropertySet, StorageProfile, StorageProfileStatus};

use super::resources::{CDI_API_VERSION, Profile};
use crate::error::ControllerError;

/// Name of the node-local class (the default).
pub const LOCAL: &str = "local";
/// Name of the shared-directory class.
pub const SHARED: &str = "shared";
/// Provisioner of [`LOCAL`].
pub const PROVISIONER_LOCAL: &str = "ferrovirt.io/local";
/// Provisioner of [`SHARED`].
pub const PROVISIONER_SHARED: &str = ferrovirt_api::shared_mount::PROVISIONER;
/// Marks the default StorageClass.
pub const DEFAULT_CLASS_ANNOTATION: &str = "storageclass.kubernetes.io/is-default-class";
/// `volumeBindingMode` that delays provisioning until a consumer is scheduled.
pub const WAIT_FOR_FIRST_CONSUMER: &str = "WaitForFirstConsumer";

/// Which built-in provisioner serves a class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    /// One directory per volume under the server's `DATA_DIR/volumes`; RWX.
    Shared,
    /// One directory per volume under a node's local root; RWO, pinned to the node.
    Local,
}

impl Builtin {
    /// The built-in provisioner of `provisioner`, if it is one.
    pub fn of(provisioner: &str) -> Option<Builtin> {
        match provisioner {
            PROVISIONER_SHARED => Some(Builtin::Shared),
            PROVISIONER_LOCAL => Some(Builtin::Local),
            _ => None,
        }
    }
}

/// The shared-filesystem mount a class declares: `None` for a class without
/// [`ferrovirt_api::shared_mount::MOUNT_PARAMETER`] (or not of the shared provisioner),
/// `Some(Err)` naming the parameter when its value is not a usable path.
pub fn shared_mount(class: &StorageClass) -> Option<Result<PathBuf, String>> {
    ferrovirt_api::shared_mount::declared(&class.provisioner, class.parameters.as_ref())
}

/// A declared shared mount: class name, class uid, mount path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeclaredMount {
    pub class: String,
    pub uid: String,
    pub mount: PathBuf,
}

/// Every valid shared mount the classes declare.
pub fn declared_mounts(classes: &[StorageClass]) -> Vec<DeclaredMount> {
    classes
        .iter()
        .filter_map(|c| {
            let mount = shared_mount(c)?.ok()?;
            Some(DeclaredMount {
                class: c.metadata.name.clone()?,
                uid: c.metadata.uid.clone().unwrap_or_default(),
                mount,
            })
        })
        .collect()
}

/// The two built-in classes.
pub fn builtin_classes() -> Vec<StorageClass> {
    let class = |name: &str, provisioner: &str, mode: &str, default: bool| StorageClass {
        metadata: ObjectMeta {
            name: Some(name.into()),
            annotations: default.then(|| {
                BTreeMap::from([(DEFAULT_CLASS_ANNOTATION.to_string(), "true".to_string())])
            }),
            ..Default::default()
        },
        provisioner: provisioner.into(),
        reclaim_policy: Some("Delete".into()),
        volume_binding_mode: Some(mode.into()),
        allow_volume_expansion: Some(true),
        ..Default::default()
    };
    vec![
        class(LOCAL, PROVISIONER_LOCAL, WAIT_FOR_FIRST_CONSUMER, true),
        class(SHARED, PROVISIONER_SHARED, "Immediate", false),
    ]
}

/// The default class: the one annotated `is-default-class: "true"` (the newest-named wins
/// ties, by name order).
pub fn default_class(classes: &[StorageClass]) -> Option<&StorageClass> {
    classes
        .iter()
        .filter(|c| {
            c.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(DEFAULT_CLASS_ANNOTATION))
                .is_some_and(|v| v == "true")
        })
        .max_by(|a, b| a.metadata.name.cmp(&b.metadata.name))
}

/// Whether a class delays binding until a consumer is scheduled.
pub fn waits_for_consumer(class: &StorageClass) -> bool {
    class.volume_binding_mode.as_deref() == Some(WAIT_FOR_FIRST_CONSUMER)
}

/// The StorageProfile status of a class (user overrides from `spec` win). `block` says
/// whether the node can make loop devices: then the built-in classes also offer
/// `volumeMode: Block` (after Filesystem, which stays the default for DataVolumes).
pub fn profile_status(
    class: &StorageClass,
    spec: Option<&ferrovirt_api::cdi::StorageProfileSpec>,
    block: bool,
) -> StorageProfileStatus {
    let sets = |access: &str| {
        let mut v = vec![ClaimPropertySet {
            access_modes: Some(vec![access.into()]),
            volume_mode: Some("Filesystem".into()),
        }];
        if block {
            v.push(ClaimPropertySet {
                access_modes: Some(vec![access.into()]),
                volume_mode: Some("Block".into()),
            });
        }
        v
    };
    let modes: Option<Vec<ClaimPropertySet>> = match Builtin::of(&class.provisioner) {
        Some(Builtin::Shared) => Some(sets("ReadWriteMany")),
        Some(Builtin::Local) => Some(sets("ReadWriteOnce")),
        None => None,
    };
    StorageProfileStatus {
        storage_class: class.metadata.name.clone(),
        provisioner: Some(class.provisioner.clone()),
        clone_strategy: spec
            .and_then(|s| s.clone_strategy.clone())
            .or_else(|| Some("copy".into())),
        claim_property_sets: spec
            .and_then(|s| s.claim_property_sets.clone())
            .filter(|s| !s.is_empty())
            .or(modes),
        data_import_cron_source_format: spec
            .and_then(|s| s.data_import_cron_source_format.clone())
            .or_else(|| Some("pvc".into())),
        // The VolumeSnapshotClass of the class's driver (docs/snapshots.md).
        snapshot_class: spec.and_then(|s| s.snapshot_class.clone()).or_else(|| {
            match Builtin::of(&class.provisioner) {
                Some(Builtin::Local) => Some(crate::snapshot::volume::LOCAL_CLASS.into()),
                Some(Builtin::Shared) => Some(crate::snapshot::volume::SHARED_CLASS.into()),
                None => None,
            }
        }),
    }
}

/// Create the built-in classes when absent, and a StorageProfile for every class.
pub async fn ensure(client: &kube::Client) -> Result<(), ControllerError> {
    let classes: Api<StorageClass> = Api::all(client.clone());
    for c in builtin_classes() {
        let name = c.metadata.name.clone().unwrap_or_default();
        if classes.get_opt(&name).await?.is_none() {
            match classes.create(&PostParams::default(), &c).await {
                Ok(_) => tracing::info!(class = %name, "created StorageClass"),
                Err(kube::Error::Api(s)) if s.is_already_exists() => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    let all = classes.list(&Default::default()).await?.items;
    ensure_profiles(client, &all).await
}

/// [`ensure`] on the classes of a cache (no list): built-in classes missing from it are
/// created, every class gets its StorageProfile.
pub async fn ensure_with(
    client: &kube::Client,
    cached: &[StorageClass],
) -> Result<(), ControllerError> {
    let classes: Api<StorageClass> = Api::all(client.clone());
    for c in builtin_classes() {
        if cached.iter().any(|k| k.metadata.name == c.metadata.name) {
            continue;
        }
        match classes.create(&PostParams::default(), &c).await {
            Ok(_) => tracing::info!(class = ?c.metadata.name, "created StorageClass"),
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => return Err(e.into()),
        }
    }
    ensure_profiles(client, cached).await
}

/// A StorageProfile for every class in `all`, its status up to date.
async fn ensure_profiles(
    client: &kube::Client,
    all: &[StorageClass],
) -> Result<(), ControllerError> {
    let profiles: Api<Profile> = Api::all(client.clone());
    for class in all {
        let Some(name) = class.metadata.name.clone() else {
            continue;
        };
        let existing = profiles.get_opt(&name).await?;
        let spec = existing.as_ref().and_then(|p| p.0.spec.clone());
        let status = profile_status(
            class,
            spec.as_ref(),
            ferrovirt_storage::block::loop_devices_available(),
        );
        match existing {
            None => {
                let p = Profile(StorageProfile {
                    api_version: Some(CDI_API_VERSION.into()),
                    kind: Some("StorageProfile".into()),
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        ..Default::default()
                    },
                    spec: Some(Default::default()),
                    status: None,
                });
                match profiles.create(&PostParams::default(), &p).await {
                    Ok(_) | Err(kube::Error::Api(_)) => {}
                    Err(e) => return Err(e.into()),
                }
                patch_profile_status(&profiles, &name, &status).await?;
            }
            Some(p) if p.0.status.as_ref() != Some(&status) => {
                patch_profile_status(&profiles, &name, &status).await?;
            }
            Some(_) => {}
        }
    }
    Ok(())
}

async fn patch_profile_status(
    profiles: &Api<Profile>,
    name: &str,
    status: &StorageProfileStatus,
) -> Result<(), ControllerError> {
    let patch = serde_json::json!({ "status": status });
    match profiles
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_and_default() {
        let cs = builtin_classes();
        assert_eq!(
            default_class(&cs).unwrap().metadata.name.as_deref(),
            Some(LOCAL)
        );
        assert!(waits_for_consumer(&cs[0]));
        assert!(!waits_for_consumer(&cs[1]));
        assert_eq!(Builtin::of(&cs[1].provisioner), Some(Builtin::Shared));
        assert_eq!(Builtin::of("kubernetes.io/no-provisioner"), None);
    }

    #[test]
    fn shared_mounts_come_from_the_parameter() {
        let class = |provisioner: &str, mount: Option<&str>| -> StorageClass {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "vmstore", "uid": "u1"},
                "provisioner": provisioner,
                "parameters": mount.map(|m| {
                    serde_json::json!({ferrovirt_api::shared_mount::MOUNT_PARAMETER: m})
                }),
            }))
            .unwrap()
        };
        let good = class(PROVISIONER_SHARED, Some("/mnt/vmstore"));
        assert_eq!(shared_mount(&good), Some(Ok(PathBuf::from("/mnt/vmstore"))));
        assert_eq!(shared_mount(&class(PROVISIONER_SHARED, None)), None);
        assert_eq!(shared_mount(&builtin_classes()[1]), None);
        assert_eq!(shared_mount(&class(PROVISIONER_LOCAL, Some("/m"))), None);
        let bad = class(PROVISIONER_SHARED, Some("relative"));
        assert!(
            shared_mount(&bad)
                .unwrap()
                .unwrap_err()
                .contains("ferrovirt.io/shared-mount")
        );
        let declared = declared_mounts(&[good, bad, builtin_classes()[1].clone()]);
        assert_eq!(
            declared,
            [DeclaredMount {
                class: "vmstore".into(),
                uid: "u1".into(),
                mount: "/mnt/vmstore".into()
            }]
        );
    }

    #[test]
    fn profiles_follow_class_with_overrides() {
        let cs = builtin_classes();
        let s = profile_status(&cs[1], None, false);
        assert_eq!(s.claim_property_sets.as_ref().unwrap().len(), 1);
        let with_block = profile_status(&cs[1], None, true);
        let sets = with_block.claim_property_sets.unwrap();
        assert_eq!(sets[0].volume_mode.as_deref(), Some("Filesystem"));
        assert_eq!(sets[1].volume_mode.as_deref(), Some("Block"));
        assert_eq!(cs[0].allow_volume_expansion, Some(true));
        let set = &s.claim_property_sets.as_ref().unwrap()[0];
        assert_eq!(
            set.access_modes.as_deref(),
            Some(&["ReadWriteMany".to_string()][..])
        );
        assert_eq!(s.clone_strategy.as_deref(), Some("copy"));
        let spec = ferrovirt_api::cdi::StorageProfileSpec {
            claim_property_sets: Some(vec![ClaimPropertySet {
                access_modes: Some(vec!["ReadWriteOnce".into()]),
                volume_mode: Some("Block".into()),
            }]),
            ..Default::default()
        };
        let s = profile_status(&cs[1], Some(&spec), true);
        assert_eq!(
            s.claim_property_sets.unwrap()[0].volume_mode.as_deref(),
            Some("Block")
        );
    }
}
