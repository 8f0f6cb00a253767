//! `kube::Resource` wrappers for the CDI kinds the storage controllers use (DataVolume,
//! DataSource, StorageProfile), so that `kube::Api` and `kube::runtime::Controller` work with the typed
//! structs of `ferrovirt_api::cdi`.

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use ferrovirt_api::cdi::{DataSource, DataVolume, StorageProfile};

/// `cdi.kubevirt.io/v1beta1`.
pub const CDI_API_VERSION: &str = "cdi.kubevirt.io/v1beta1";

macro_rules! cdi_kind {
    ($(#[$m:meta])* $wrapper:ident($inner:ty), $scope:ty, $kind:literal, $plural:literal) => {
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
                Cow::Borrowed("cdi.kubevirt.io")
            }
            fn version(_: &()) -> Cow<'_, str> {
                Cow::Borrowed("v1beta1")
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

cdi_kind!(
    /// A DataVolume usable with `kube::Api`.
    Dv(DataVolume), k8s_openapi::NamespaceResourceScope, "DataVolume", "datavolumes"
);
cdi_kind!(
    /// A DataSource usable with `kube::Api`.
    Ds(DataSource), k8s_openapi::NamespaceResourceScope, "DataSource", "datasources"
);
cdi_kind!(
    /// A StorageProfile usable with `kube::Api`.
    Profile(StorageProfile), k8s_openapi::ClusterResourceScope, "StorageProfile", "storageprofiles"
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
