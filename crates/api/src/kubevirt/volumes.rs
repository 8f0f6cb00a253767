//! `spec.volumes` and `spec.networks` of a VMI: where disks get their data and NICs their
//! network.

use k8s_openapi::api::core::v1::LocalObjectReference;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::domain::Empty;

kstruct! {
    /// A named volume; exactly one source is set.
    pub struct Volume {
        pub name: String,
        pub container_disk: Option<ContainerDiskSource>,
        pub ephemeral: Option<EphemeralVolumeSource>,
        pub persistent_volume_claim: Option<PvcVolumeSource>,
        pub data_volume: Option<DataVolumeSource>,
        pub cloud_init_no_cloud: Option<CloudInitSource>,
        pub cloud_init_config_drive: Option<CloudInitSource>,
        pub empty_disk: Option<EmptyDiskSource>,
        pub host_disk: Option<HostDiskSource>,
        pub config_map: Option<ConfigMapVolumeSource>,
        pub secret: Option<SecretVolumeSource>,
        pub service_account: Option<ServiceAccountVolumeSource>,
        pub sysprep: Option<SysprepSource>,
        #[serde(rename = "downwardAPI")]
        pub downward_api: Option<DownwardApiVolumeSource>,
        pub downward_metrics: Option<Empty>,
        pub memory_dump: Option<PvcVolumeSource>,
        /// A path of the virt-launcher container shared with the guest (virtiofs).
        pub container_path: Option<ContainerPathSource>,
    }
}

kstruct! {
    /// A container path exposed to the guest.
    pub struct ContainerPathSource {
        pub path: String,
        pub read_only: Option<bool>,
    }
}

impl Volume {
    /// The source type's field name (`containerDisk`, `dataVolume`, ...), if any is set.
    pub fn source_kind(&self) -> Option<&'static str> {
        let kinds: [(bool, &'static str); 16] = [
            (self.container_disk.is_some(), "containerDisk"),
            (self.ephemeral.is_some(), "ephemeral"),
            (
                self.persistent_volume_claim.is_some(),
                "persistentVolumeClaim",
            ),
            (self.data_volume.is_some(), "dataVolume"),
            (self.cloud_init_no_cloud.is_some(), "cloudInitNoCloud"),
            (
                self.cloud_init_config_drive.is_some(),
                "cloudInitConfigDrive",
            ),
            (self.empty_disk.is_some(), "emptyDisk"),
            (self.host_disk.is_some(), "hostDisk"),
            (self.config_map.is_some(), "configMap"),
            (self.secret.is_some(), "secret"),
            (self.service_account.is_some(), "serviceAccount"),
            (self.sysprep.is_some(), "sysprep"),
            (self.downward_api.is_some(), "downwardAPI"),
            (self.downward_metrics.is_some(), "downwardMetrics"),
            (self.memory_dump.is_some(), "memoryDump"),
            (self.container_path.is_some(), "containerPath"),
        ];
        kinds.iter().find(|(set, _)| *set).map(|(_, k)| *k)
    }

    /// How many sources are set (valid volumes have exactly one).
    pub fn source_count(&self) -> usize {
        [
            self.container_disk.is_some(),
            self.ephemeral.is_some(),
            self.persistent_volume_claim.is_some(),
            self.data_volume.is_some(),
            self.cloud_init_no_cloud.is_some(),
            self.cloud_init_config_drive.is_some(),
            self.empty_disk.is_some(),
            self.host_disk.is_some(),
            self.config_map.is_some(),
            self.secret.is_some(),
            self.service_account.is_some(),
            self.sysprep.is_some(),
            self.downward_api.is_some(),
            self.downward_metrics.is_some(),
            self.memory_dump.is_some(),
            self.container_path.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count()
    }
}

kstruct! {
    /// A disk image shipped in a container image (ephemeral).
    pub struct ContainerDiskSource {
        pub image: String,
        pub image_pull_secret: Option<String>,
        pub path: Option<String>,
        pub image_pull_policy: Option<String>,
    }
}

kstruct! {
    /// A copy-on-write overlay over a read-only PVC.
    pub struct EphemeralVolumeSource {
        pub persistent_volume_claim: Option<ClaimRef>,
    }
}

kstruct! {
    /// A PVC by name.
    pub struct ClaimRef {
        pub claim_name: String,
        pub read_only: Option<bool>,
    }
}

kstruct! {
    /// A PVC-backed volume.
    pub struct PvcVolumeSource {
        pub claim_name: String,
        pub read_only: Option<bool>,
        pub hotpluggable: Option<bool>,
    }
}

kstruct! {
    /// A DataVolume-backed volume.
    pub struct DataVolumeSource {
        pub name: String,
        pub hotpluggable: Option<bool>,
    }
}

kstruct! {
    /// cloud-init user and network data (NoCloud or ConfigDrive).
    pub struct CloudInitSource {
        pub secret_ref: Option<LocalObjectReference>,
        pub user_data_base64: Option<String>,
        pub user_data: Option<String>,
        pub network_data_secret_ref: Option<LocalObjectReference>,
        pub network_data_base64: Option<String>,
        pub network_data: Option<String>,
    }
}

kstruct! {
    /// A sparse scratch disk created on start and lost on stop.
    pub struct EmptyDiskSource {
        pub capacity: Quantity,
    }
}

kstruct! {
    /// A disk image file on the node.
    pub struct HostDiskSource {
        pub path: String,
        /// `Disk` or `DiskOrCreate`.
        #[serde(rename = "type")]
        pub type_: String,
        pub capacity: Option<Quantity>,
        pub shared: Option<bool>,
    }
}

kstruct! {
    /// A ConfigMap exposed as a disk.
    pub struct ConfigMapVolumeSource {
        pub name: Option<String>,
        pub optional: Option<bool>,
        pub volume_label: Option<String>,
    }
}

kstruct! {
    /// A Secret exposed as a disk.
    pub struct SecretVolumeSource {
        pub secret_name: Option<String>,
        pub optional: Option<bool>,
        pub volume_label: Option<String>,
    }
}

kstruct! {
    /// A ServiceAccount token exposed as a disk.
    pub struct ServiceAccountVolumeSource {
        pub service_account_name: Option<String>,
    }
}

kstruct! {
    /// A Windows sysprep answer file from a Secret or ConfigMap.
    pub struct SysprepSource {
        pub secret: Option<LocalObjectReference>,
        pub config_map: Option<LocalObjectReference>,
    }
}

kstruct! {
    /// Downward API fields exposed as a disk.
    pub struct DownwardApiVolumeSource {
        pub fields: Option<Vec<k8s_openapi::api::core::v1::DownwardAPIVolumeFile>>,
        pub volume_label: Option<String>,
    }
}

kstruct! {
    /// A network the VMI connects to; exactly one of `pod` or `multus`.
    pub struct Network {
        pub name: String,
        pub pod: Option<PodNetwork>,
        pub multus: Option<MultusNetwork>,
        /// A network device from a DRA resource claim.
        pub resource_claim: Option<ClaimRequest>,
    }
}

kstruct! {
    /// A request of a pod resource claim (DRA).
    pub struct ClaimRequest {
        pub claim_name: String,
        pub request_name: Option<String>,
    }
}

kstruct! {
    /// The default pod network.
    pub struct PodNetwork {
        #[serde(rename = "vmNetworkCIDR")]
        pub vm_network_cidr: Option<String>,
        #[serde(rename = "vmIPv6NetworkCIDR")]
        pub vm_ipv6_network_cidr: Option<String>,
    }
}

kstruct! {
    /// A secondary network from a NetworkAttachmentDefinition (`[namespace/]name`).
    pub struct MultusNetwork {
        pub network_name: String,
        pub default: Option<bool>,
    }
}
