//! `kube::Resource` wrappers for the snapshot kinds (snapshot.kubevirt.io/v1beta1 and
//! snapshot.storage.k8s.io/v1), namespaced or cluster-scoped as published.

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use ferrovirt_api::kubevirt::clone::VirtualMachineClone;
use ferrovirt_api::kubevirt::snapshot::{
    VirtualMachineRestore, VirtualMachineSnapshot, VirtualMachineSnapshotContent,
};
use ferrovirt_api::volumesnapshot::{VolumeSnapshot, VolumeSnapshotClass, VolumeSnapshotContent};

macro_rules! snap_kind {
    ($(#[$m:meta])* $wrapper:ident($inner:ty), $scope:ty, $group:literal, $version:literal, $kind:literal, $plural:literal) => {
        $(#[$m])*
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $wrapper(pub $inner);

        impl kube::Resource for $wrapper {
            type DynamicType = ();
            type Scope = $scope;

            fn kind(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($kind)
            }
            fn group(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($group)
            }
            fn version(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($version)
            }
            fn plural(_: &()) -> Cow<'_, str> {
                Cow::Borrowed($plural)
            }
            fn meta(&self) -> &ObjectMeta {
                &self.0.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.0.metadata
            }
        }
    };
}

type Namespaced = k8s_openapi::NamespaceResourceScope;
type Cluster = k8s_openapi::ClusterResourceScope;

snap_kind!(
    /// A VirtualMachineSnapshot usable with `kube::Api`.
    VmSnapshot(VirtualMachineSnapshot), Namespaced, "snapshot.kubevirt.io", "v1beta1",
    "VirtualMachineSnapshot", "virtualmachinesnapshots"
);
snap_kind!(
    /// A VirtualMachineSnapshotContent usable with `kube::Api`.
    VmSnapshotContent(VirtualMachineSnapshotContent), Namespaced, "snapshot.kubevirt.io",
    "v1beta1", "VirtualMachineSnapshotContent", "virtualmachinesnapshotcontents"
);
snap_kind!(
    /// A VirtualMachineRestore usable with `kube::Api`.
    VmRestore(VirtualMachineRestore), Namespaced, "snapshot.kubevirt.io", "v1beta1",
    "VirtualMachineRestore", "virtualmachinerestores"
);
snap_kind!(
    /// A VirtualMachineClone usable with `kube::Api`.
    VmClone(VirtualMachineClone), Namespaced, "clone.kubevirt.io", "v1beta1",
    "VirtualMachineClone", "virtualmachineclones"
);
snap_kind!(
    /// A VolumeSnapshot usable with `kube::Api`.
    VolSnap(VolumeSnapshot), Namespaced, "snapshot.storage.k8s.io", "v1", "VolumeSnapshot",
    "volumesnapshots"
);
snap_kind!(
    /// A VolumeSnapshotContent (cluster-scoped) usable with `kube::Api`.
    VolSnapContent(VolumeSnapshotContent), Cluster, "snapshot.storage.k8s.io", "v1",
    "VolumeSnapshotContent", "volumesnapshotcontents"
);
snap_kind!(
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
