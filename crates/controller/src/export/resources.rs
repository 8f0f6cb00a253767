//! `kube::Resource` wrapper for VirtualMachineExport (export.kubevirt.io/v1beta1 on the wire;
//! v1 is served too).

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use ferrovirt_api::kubevirt::export::VirtualMachineExport;

/// The version the controllers and the CLI speak.
pub const VERSION: &str = "v1beta1";

/// A VirtualMachineExport usable with `kube::Api`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct VmExport(pub VirtualMachineExport);

impl kube::Resource for VmExport {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("VirtualMachineExport")
    }
    fn group(_: &()) -> Cow<'_, str> {
        Cow::Borrowed(ferrovirt_api::kubevirt::export::GROUP)
    }
    fn version(_: &()) -> Cow<'_, str> {
        Cow::Borrowed(VERSION)
    }
    fn plural(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("virtualmachineexports")
    }
    fn meta(&self) -> &ObjectMeta {
        &self.0.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.0.metadata
    }
}
