//! `kube::Resource` wrappers for ferrovirt's KubeVirt kinds, so that `kube::Api`, watchers
//! and reflectors can be used with the typed structs of `ferrovirt_api` (which do not depend
//! on kube themselves).

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use ferrovirt_api::kubevirt::misc::VirtualMachineInstanceMigration;
use ferrovirt_api::kubevirt::pool::VirtualMachinePool;
use ferrovirt_api::kubevirt::vm::VirtualMachine;
use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;

macro_rules! kube_kind {
    ($(#[$m:meta])* $wrapper:ident($inner:ty), $group:literal, $version:literal, $kind:literal, $plural:literal) => {
        $(#[$m])*
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $wrapper(pub $inner);

        impl kube::Resource for $wrapper {
            type DynamicType = ();
            type Scope = k8s_openapi::NamespaceResourceScope;

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
