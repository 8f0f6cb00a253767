//! `kube::Resource` wrappers for the CDI kinds the storage controllers use (DataVolume,
//! DataSource, StorageProfile), so that `kube::Api` and `kube::runtime::Controller` work with the typed
//! structs of `ferrovirt_api::cdi`.

use crate::runtime::resources::resource_wrapper;
use ferrovirt_api::cdi::{DataSource, DataVolume, StorageProfile};

/// `cdi.kubevirt.io/v1beta1`.
pub const CDI_API_VERSION: &str = "cdi.kubevirt.io/v1beta1";

resource_wrapper!(
    /// A DataVolume usable with `kube::Api`.
    Dv(DataVolume), k8s_openapi::NamespaceResourceScope, "cdi.kubevirt.io", "v1beta1", "DataVolume", "datavolumes"
);
resource_wrapper!(
    /// A DataSource usable with `kube::Api`.
    Ds(DataSource), k8s_openapi::NamespaceResourceScope, "cdi.kubevirt.io", "v1beta1", "DataSource", "datasources"
);
resource_wrapper!(
    /// A StorageProfile usable with `kube::Api`.
    Profile(StorageProfile), k8s_openapi::ClusterResourceScope, "cdi.kubevirt.io", "v1beta1", "StorageProfile", "storageprofiles"
);

#[cfg(test)]
mod tests {
    use super::*;
    use kube::Resource;

    #[test]
    fn urls() {
        assert_eq!(
            Dv::url_path(&(), Some("ns")),
            "/apis/cdi.kubevirt.io/v1beta1/namespaces/ns/datavolumes"
        );
        assert_eq!(
            Profile::url_path(&(), None),
            "/apis/cdi.kubevirt.io/v1beta1/storageprofiles"
        );
    }
}
