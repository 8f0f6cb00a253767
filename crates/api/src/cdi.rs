//! cdi.kubevirt.io/v1beta1: DataVolume, DataSource, StorageProfile and the CDI config object.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    PersistentVolumeClaimSpec, TypedLocalObjectReference, TypedObjectReference,
    VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};
use serde_json::{Map, Value};

use crate::kubevirt::domain::Empty;
use crate::kubevirt::misc::NodePlacement;

resource! {
    /// A PVC populated from a source (import, upload, clone or blank).
    DataVolume, DataVolumeSpec, DataVolumeStatus
}

kstruct! {
    /// Source and storage of a DataVolume.
    pub struct DataVolumeSpec {
        pub source: Option<DataVolumeSource>,
        pub source_ref: Option<DataVolumeSourceRef>,
        pub pvc: Option<PersistentVolumeClaimSpec>,
        pub storage: Option<StorageSpec>,
        /// Priority class of the populating workload.
        pub priority_class_name: Option<String>,
        /// `kubevirt` (default) or `archive`.
        pub content_type: Option<String>,
        pub checkpoints: Option<Vec<DataVolumeCheckpoint>>,
        /// Whether the current checkpoint is the last one of a multi-stage import.
        pub final_checkpoint: Option<bool>,
        /// Allocate the whole volume up front instead of thinly.
        pub preallocation: Option<bool>,
    }
}

kstruct! {
    /// Where the data comes from; exactly one is set.
    pub struct DataVolumeSource {
        pub http: Option<HttpSource>,
        pub s3: Option<UrlSource>,
        pub gcs: Option<UrlSource>,
        pub registry: Option<RegistrySource>,
        pub pvc: Option<NamespacedName>,
        pub snapshot: Option<NamespacedName>,
        pub upload: Option<Empty>,
        pub blank: Option<Empty>,
        pub imageio: Option<ImageIoSource>,
        pub vddk: Option<VddkSource>,
    }
}

impl DataVolumeSource {
    /// The field names of the sources that are set.
    pub fn kinds(&self) -> Vec<&'static str> {
        [
            (self.http.is_some(), "http"),
            (self.s3.is_some(), "s3"),
            (self.gcs.is_some(), "gcs"),
            (self.registry.is_some(), "registry"),
            (self.pvc.is_some(), "pvc"),
            (self.snapshot.is_some(), "snapshot"),
            (self.upload.is_some(), "upload"),
            (self.blank.is_some(), "blank"),
            (self.imageio.is_some(), "imageio"),
            (self.vddk.is_some(), "vddk"),
        ]
        .into_iter()
        .filter(|(set, _)| *set)
        .map(|(_, k)| k)
        .collect()
    }
}

kstruct! {
    /// Import over HTTP(S).
    pub struct HttpSource {
        pub url: String,
        pub secret_ref: Option<String>,
        pub cert_config_map: Option<String>,
        pub extra_headers: Option<Vec<String>>,
        pub secret_extra_headers: Option<Vec<String>>,
        /// Expected digest of the downloaded file, `sha256:<hex>` (also sha1/sha384/sha512).
        pub checksum: Option<String>,
        /// Skip TLS verification of the endpoint.
        pub insecure_skip_verify: Option<bool>,
    }
}

kstruct! {
    /// Import from S3 or GCS.
    pub struct UrlSource {
        pub url: String,
        pub secret_ref: Option<String>,
        pub cert_config_map: Option<String>,
    }
}

kstruct! {
    /// Import from a container registry (`docker://...`).
    pub struct RegistrySource {
        pub url: Option<String>,
        pub image_stream: Option<String>,
        /// `pod` or `node`.
        pub pull_method: Option<String>,
        pub secret_ref: Option<String>,
        pub cert_config_map: Option<String>,
        /// Which platform of a multi-arch image to import.
        pub platform: Option<PlatformOptions>,
    }
}

kstruct! {
    /// Image platform selection.
    pub struct PlatformOptions {
        pub architecture: Option<String>,
    }
}

kstruct! {
    /// Import from oVirt imageio.
    pub struct ImageIoSource {
        pub url: String,
        pub disk_id: String,
        pub secret_ref: Option<String>,
        pub cert_config_map: Option<String>,
        pub insecure_skip_verify: Option<bool>,
    }
}

kstruct! {
    /// Import from VMware VDDK.
    pub struct VddkSource {
        pub url: Option<String>,
        pub uuid: Option<String>,
        pub backing_file: Option<String>,
        pub thumbprint: Option<String>,
        pub secret_ref: Option<String>,
        #[serde(rename = "initImageURL")]
        pub init_image_url: Option<String>,
        /// ConfigMap with extra VDDK arguments.
        pub extra_args: Option<String>,
    }
}

kstruct! {
    /// A namespaced object by name (clone source PVC or snapshot).
    pub struct NamespacedName {
        pub namespace: Option<String>,
        pub name: String,
    }
}

kstruct! {
    /// A DataSource reference.
    pub struct DataVolumeSourceRef {
        pub kind: String,
        pub namespace: Option<String>,
        pub name: String,
    }
}

kstruct! {
    /// Like a PVC spec, with size and access modes optional (filled from the StorageProfile).
    pub struct StorageSpec {
        pub access_modes: Option<Vec<String>>,
        pub selector: Option<LabelSelector>,
        pub resources: Option<VolumeResourceRequirements>,
        pub volume_name: Option<String>,
        pub storage_class_name: Option<String>,
        pub volume_mode: Option<String>,
        pub data_source: Option<TypedLocalObjectReference>,
        pub data_source_ref: Option<TypedObjectReference>,
    }
}

kstruct! {
    /// A warm-migration checkpoint.
    pub struct DataVolumeCheckpoint {
        pub previous: String,
        pub current: String,
    }
}

kstruct! {
    /// Observed state of a DataVolume.
    pub struct DataVolumeStatus {
        pub claim_name: Option<String>,
        /// `Pending`, `PVCBound`, `ImportScheduled`, `ImportInProgress`, `CloneScheduled`,
        /// `CloneInProgress`, `UploadScheduled`, `UploadReady`, `WaitForFirstConsumer`,
        /// `PendingPopulation`, `Succeeded`, `Failed`, `Paused`, `Unknown`.
        pub phase: Option<String>,
        /// e.g. `45.3%` or `N/A`.
        pub progress: Option<String>,
        pub restart_count: Option<i32>,
        pub conditions: Option<Vec<CdiCondition>>,
    }
}

/// DataVolume phases.
pub mod dv_phase {
    pub const PENDING: &str = "Pending";
    pub const PVC_BOUND: &str = "PVCBound";
    pub const IMPORT_SCHEDULED: &str = "ImportScheduled";
    pub const IMPORT_IN_PROGRESS: &str = "ImportInProgress";
    pub const CLONE_SCHEDULED: &str = "CloneScheduled";
    pub const CLONE_IN_PROGRESS: &str = "CloneInProgress";
    pub const UPLOAD_SCHEDULED: &str = "UploadScheduled";
    pub const UPLOAD_READY: &str = "UploadReady";
    pub const WAIT_FOR_FIRST_CONSUMER: &str = "WaitForFirstConsumer";
    pub const PENDING_POPULATION: &str = "PendingPopulation";
    pub const SUCCEEDED: &str = "Succeeded";
    pub const FAILED: &str = "Failed";
    pub const PAUSED: &str = "Paused";
    pub const UNKNOWN: &str = "Unknown";
}

kstruct! {
    /// A CDI condition (Bound, Ready, Running for DataVolumes; Ready for DataSources).
    pub struct CdiCondition {
        #[serde(rename = "type")]
        pub type_: String,
        pub status: String,
        pub last_transition_time: Option<Time>,
        pub last_heartbeat_time: Option<Time>,
        pub reason: Option<String>,
        pub message: Option<String>,
    }
}

resource! {
    /// A named pointer to a bootable volume (e.g. the latest imported OS image).
    DataSource, DataSourceSpec, DataSourceStatus
}

kstruct! {
    /// What the DataSource points at.
    pub struct DataSourceSpec {
        #[serde(default)]
        pub source: DataSourceSource,
    }
}

kstruct! {
    /// A PVC, a VolumeSnapshot or another DataSource.
    pub struct DataSourceSource {
        pub pvc: Option<NamespacedName>,
        pub snapshot: Option<NamespacedName>,
        pub data_source: Option<NamespacedName>,
    }
}

kstruct! {
    /// Readiness of a DataSource.
    pub struct DataSourceStatus {
        pub source: Option<DataSourceSource>,
        pub conditions: Option<Vec<CdiCondition>>,
    }
}

resource! {
    /// How CDI provisions volumes of one StorageClass.
    StorageProfile, StorageProfileSpec, StorageProfileStatus
}

kstruct! {
    /// User overrides for a StorageClass.
    pub struct StorageProfileSpec {
        /// `copy`, `snapshot` or `csi-clone`.
        pub clone_strategy: Option<String>,
        pub claim_property_sets: Option<Vec<ClaimPropertySet>>,
        /// Format DataImportCrons keep sources in: `pvc` or `snapshot`.
        pub data_import_cron_source_format: Option<String>,
        /// The VolumeSnapshotClass used for snapshots of this class.
        pub snapshot_class: Option<String>,
    }
}

kstruct! {
    /// An access-mode/volume-mode combination the class supports.
    pub struct ClaimPropertySet {
        pub access_modes: Option<Vec<String>>,
        pub volume_mode: Option<String>,
    }
}

kstruct! {
    /// Effective settings of a StorageProfile.
    pub struct StorageProfileStatus {
        pub storage_class: Option<String>,
        pub provisioner: Option<String>,
        pub clone_strategy: Option<String>,
        pub claim_property_sets: Option<Vec<ClaimPropertySet>>,
        pub data_import_cron_source_format: Option<String>,
        pub snapshot_class: Option<String>,
    }
}

resource! {
    /// CDI installation and configuration.
    Cdi, CdiSpec, CdiStatus
}

kstruct! {
    /// CDI install options.
    pub struct CdiSpec {
        /// Pull policy of the CDI component images.
        pub image_pull_policy: Option<String>,
        /// Whether removing CDI waits for its workloads to go (`BlockUninstallIfWorkloadsExist`).
        pub uninstall_strategy: Option<String>,
        pub infra: Option<NodePlacement>,
        pub workload: Option<NodePlacement>,
        pub config: Option<CdiConfig>,
        /// Priority class of the CDI components.
        pub priority_class: Option<String>,
        /// Clone strategy used for every clone, overriding the storage profiles (`copy`, `snapshot`, `csi-clone`).
        pub clone_strategy_override: Option<String>,
    }
}

kstruct! {
    /// CDI configuration; unmodelled fields are kept as given.
    pub struct CdiConfig {
        pub upload_proxy_url_override: Option<String>,
        pub scratch_space_storage_class: Option<String>,
        pub feature_gates: Option<Vec<String>>,
        pub filesystem_overhead: Option<FilesystemOverhead>,
        pub pod_resource_requirements: Option<k8s_openapi::api::core::v1::ResourceRequirements>,
        /// Registries imported from over plain HTTP.
        pub insecure_registries: Option<Vec<String>>,
        #[serde(flatten)]
        pub other: Map<String, Value>,
    }
}

kstruct! {
    /// Filesystem overhead fractions (strings like `"0.055"`).
    pub struct FilesystemOverhead {
        pub global: Option<String>,
        pub storage_class: Option<BTreeMap<String, String>>,
    }
}

kstruct! {
    /// CDI install progress.
    pub struct CdiStatus {
        pub phase: Option<String>,
        pub conditions: Option<Vec<CdiCondition>>,
        pub operator_version: Option<String>,
        pub target_version: Option<String>,
        pub observed_version: Option<String>,
    }
}

resource! {
    /// upload.cdi.kubevirt.io/v1beta1: a request for a short-lived token that authorizes one
    /// upload into a claim (create-only; the answer carries `status.token`).
    UploadTokenRequest, UploadTokenRequestSpec, UploadTokenRequestStatus
}

kstruct! {
    /// Which claim the token is for.
    pub struct UploadTokenRequestSpec {
        /// The claim (and DataVolume) the upload goes into.
        pub pvc_name: Option<String>,
    }
}

kstruct! {
    /// The issued token.
    pub struct UploadTokenRequestStatus {
        pub token: Option<String>,
    }
}
