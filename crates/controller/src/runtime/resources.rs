//! `kube::Resource` wrappers for ferrovirt's KubeVirt kinds, so that `kube::Api`, watchers
//! and reflectors can be used with the typed structs of `ferrovirt_api` (which do not depend
//! on kube themselves).

use ferrovirt_api::kubevirt::misc::VirtualMachineInstanceMigration;
use ferrovirt_api::kubevirt::pool::VirtualMachinePool;
use ferrovirt_api::kubevirt::vm::VirtualMachine;
use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;

/// Declares `$wrapper($inner)`, a `kube::Resource` of the given scope, group, version, kind and
/// plural whose metadata is the inner struct's. The one definition behind every wrapper of the
/// controller crate (snapshot, storage, backup kinds use it too).
macro_rules! resource_wrapper {
    ($(#[$m:meta])* $wrapper:ident($inner:ty), $scope:ty, $group:expr, $version:expr, $kind:literal, $plural:literal) => {
        $(#[$m])*
        #[derive(Clone, Debug, PartialEq, ::serde::Serialize, ::serde::Deserialize)]
        #[serde(transparent)]
        pub struct $wrapper(pub $inner);

        impl ::kube::Resource for $wrapper {
            type DynamicType = ();
            type Scope = $scope;

            fn kind(_: &()) -> ::std::borrow::Cow<'_, str> {
                ::std::borrow::Cow::Borrowed($kind)
            }
            fn group(_: &()) -> ::std::borrow::Cow<'_, str> {
                ::std::borrow::Cow::Borrowed($group)
            }
            fn version(_: &()) -> ::std::borrow::Cow<'_, str> {
                ::std::borrow::Cow::Borrowed($version)
            }
            fn plural(_: &()) -> ::std::borrow::Cow<'_, str> {
                ::std::borrow::Cow::Borrowed($plural)
            }
            fn meta(&self) -> &::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &self.0.metadata
            }
            fn meta_mut(&mut self) -> &mut ::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &mut self.0.metadata
            }
        }
    };
}
pub(crate) use resource_wrapper;

/// A namespaced KubeVirt kind, also dereferencing to its inner struct.
macro_rules! kube_kind {
    ($(#[$m:meta])* $wrapper:ident($inner:ty), $group:literal, $version:literal, $kind:literal, $plural:literal) => {
        resource_wrapper!(
            $(#[$m])* $wrapper($inner), k8s_openapi::NamespaceResourceScope, $group, $version, $kind, $plural
        );

        impl std::ops::Deref for $wrapper {
            type Target = $inner;
            fn deref(&self) -> &$inner {
                &self.0
            }
        }
    };
}

kube_kind!(
    /// A VirtualMachine usable with `kube::Api`.
    Vm(VirtualMachine), "kubevirt.io", "v1", "VirtualMachine", "virtualmachines"
);
kube_kind!(
    /// A VirtualMachineInstance usable with `kube::Api`.
    Vmi(VirtualMachineInstance), "kubevirt.io", "v1", "VirtualMachineInstance", "virtualmachineinstances"
);
kube_kind!(
    /// A VirtualMachineInstanceMigration usable with `kube::Api`.
    Vmim(VirtualMachineInstanceMigration), "kubevirt.io", "v1", "VirtualMachineInstanceMigration", "virtualmachineinstancemigrations"
);
kube_kind!(
    /// A VirtualMachinePool usable with `kube::Api`.
    Pool(VirtualMachinePool), "pool.kubevirt.io", "v1beta1", "VirtualMachinePool", "virtualmachinepools"
);

#[cfg(test)]
mod tests {
    use super::*;
    use kube::Resource;

    #[test]
    fn urls() {
        assert_eq!(
            Vm::url_path(&(), Some("ns")),
            "/apis/kubevirt.io/v1/namespaces/ns/virtualmachines"
        );
        assert_eq!(Vmi::api_version(&()), "kubevirt.io/v1");
        let v: Vmi = serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "a"}, "spec": {"domain": {"devices": {}}}
        }))
        .unwrap();
        assert_eq!(v.meta().name.as_deref(), Some("a"));
    }
}
