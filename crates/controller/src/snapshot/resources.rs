//! `kube::Resource` wrappers for the snapshot kinds (snapshot.kubevirt.io/v1beta1 and
//! snapshot.storage.k8s.io/v1), namespaced or cluster-scoped as published.

use crate::runtime::resources::resource_wrapper;
use ferrovirt_api::kubevirt::clone::VirtualMachineClone;
use ferrovirt_api::kubevirt::snapshot::{
    VirtualMachineRestore, VirtualMachineSnapshot, VirtualMachineSnapshotContent,
};
use ferrovirt_api::volumesnapshot::{VolumeSnapshot, VolumeSnapshotClass, VolumeSnapshotContent};

type Namespaced = k8s_openapi::NamespaceResourceScope;
type Cluster = k8s_openapi::ClusterResourceScope;

resource_wrapper!(
    /// A VirtualMachineSnapshot usable with `kube::Api`.
    VmSnapshot(VirtualMachineSnapshot), Namespaced, "snapshot.kubevirt.io", "v1beta1",
    "VirtualMachineSnapshot", "virtualmachinesnapshots"
);
resource_wrapper!(
    /// A VirtualMachineSnapshotContent usable with `kube::Api`.
    VmSnapshotContent(VirtualMachineSnapshotContent), Namespaced, "snapshot.kubevirt.io",
    "v1beta1", "VirtualMachineSnapshotContent", "virtualmachinesnapshotcontents"
);
resource_wrapper!(
    /// A VirtualMachineRestore usable with `kube::Api`.
    VmRestore(VirtualMachineRestore), Namespaced, "snapshot.kubevirt.io", "v1beta1",
    "VirtualMachineRestore", "virtualmachinerestores"
);
resource_wrapper!(
    /// A VirtualMachineClone usable with `kube::Api`.
    VmClone(VirtualMachineClone), Namespaced, "clone.kubevirt.io", "v1beta1",
    "VirtualMachineClone", "virtualmachineclones"
);
resource_wrapper!(
    /// A VolumeSnapshot usable with `kube::Api`.
    VolSnap(VolumeSnapshot), Namespaced, "snapshot.storage.k8s.io", "v1", "VolumeSnapshot",
    "volumesnapshots"
);
resource_wrapper!(
    /// A VolumeSnapshotContent (cluster-scoped) usable with `kube::Api`.
    VolSnapContent(VolumeSnapshotContent), Cluster, "snapshot.storage.k8s.io", "v1",
    "VolumeSnapshotContent", "volumesnapshotcontents"
);
resource_wrapper!(
    /// A VolumeSnapshotClass (cluster-scoped) usable with `kube::Api`.
    VolSnapClass(VolumeSnapshotClass), Cluster, "snapshot.storage.k8s.io", "v1",
    "VolumeSnapshotClass", "volumesnapshotclasses"
);

#[cfg(test)]
mod tests {
    use super::*;
    use kube::Resource;

    #[test]
    fn urls() {
        assert_eq!(
            VmSnapshot::url_path(&(), Some("ns")),
            "/apis/snapshot.kubevirt.io/v1beta1/namespaces/ns/virtualmachinesnapshots"
        );
        assert_eq!(
            VolSnapContent::url_path(&(), None),
            "/apis/snapshot.storage.k8s.io/v1/volumesnapshotcontents"
        );
    }
}
