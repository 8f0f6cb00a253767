//! Building the VirtualMachineInstance a VirtualMachine runs: the (instancetype-expanded)
//! template spec, the template's labels and annotations, name and namespace of the VM, a
//! controller ownerReference to it, the `kubevirt.io/vm` label, the VM generation annotation
//! and a stable firmware UUID.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use ferrovirt_api::kubevirt::instancetype::{InstancetypeSpec, PreferenceSpec};
use ferrovirt_api::kubevirt::vm::VirtualMachine;
use ferrovirt_api::kubevirt::vmi::{VirtualMachineInstance, VirtualMachineInstanceSpec};

/// API version of KubeVirt's kinds.
pub const KUBEVIRT_API_VERSION: &str = "kubevirt.io/v1";
/// Label naming the VM a VMI belongs to.
pub const LABEL_VM: &str = "kubevirt.io/vm";
/// Label naming the node a VMI is bound to (set by the scheduler).
pub const LABEL_NODE_NAME: &str = "kubevirt.io/nodeName";
/// Annotation on a VMI: the VM `metadata.generation` it was created from.
pub const ANNOTATION_VM_GENERATION: &str = "kubevirt.io/vm-generation";

/// The spec a VM's VMI runs with: its template expanded with the instancetype and preference
/// it refers to (already fetched by the caller), or an error message for the Failure condition.
pub fn expanded_spec(
    vm: &VirtualMachine,
    instancetype: Option<&InstancetypeSpec>,
    preference: Option<&PreferenceSpec>,
) -> Result<VirtualMachineInstanceSpec, String> {
    let template = vm
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.clone())
        .unwrap_or_default();
    if instancetype.is_none() && preference.is_none() {
        return Ok(template);
    }
    ferrovirt_api::expand::expand(&template, instancetype, preference).map_err(|e| e.to_string())
}

/// The controller ownerReference a VMI (or any child) carries to its VM.
pub fn owner_reference(vm: &VirtualMachine) -> OwnerReference {
    OwnerReference {
        api_version: KUBEVIRT_API_VERSION.into(),
        kind: "VirtualMachine".into(),
        name: vm.metadata.name.clone().unwrap_or_default(),
        uid: vm.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// The VMI to create for `vm` with the given (expanded) spec.
pub fn build_vmi(
    vm: &VirtualMachine,
    mut spec: VirtualMachineInstanceSpec,
) -> VirtualMachineInstance {
    let name = vm.metadata.name.clone().unwrap_or_default();
    let namespace = vm
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let template_meta = vm.spec.as_ref().and_then(|s| s.template.metadata.as_ref());
    let mut labels: BTreeMap<String, String> = template_meta
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    labels
        .entry(LABEL_VM.into())
        .or_insert_with(|| name.clone());
    let mut annotations: BTreeMap<String, String> = template_meta
        .and_then(|m| m.annotations.clone())
        .unwrap_or_default();
    if let Some(generation) = vm.metadata.generation {
        annotations.insert(ANNOTATION_VM_GENERATION.into(), generation.to_string());
    }
    let firmware = spec.domain.firmware.get_or_insert_default();
    if firmware.uuid.as_deref().is_none_or(str::is_empty) {
        firmware.uuid = Some(ferrovirt_api::admission::firmware_uuid(&namespace, &name));
    }
    VirtualMachineInstance {
        api_version: Some(KUBEVIRT_API_VERSION.into()),
        kind: Some("VirtualMachineInstance".into()),
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(namespace),
            labels: Some(labels),
            annotations: Some(annotations),
            owner_references: Some(vec![owner_reference(vm)]),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::testutil::vm;

    #[test]
    fn vmi_from_vm() {
        let v = vm("web")
            .template_label("app", "web")
            .template_annotation("note", "x")
            .generation(3)
            .build();
        let vmi = build_vmi(&v, expanded_spec(&v, None, None).unwrap());
        assert_eq!(vmi.metadata.name.as_deref(), Some("web"));
        assert_eq!(vmi.metadata.namespace.as_deref(), Some("default"));
        let labels = vmi.metadata.labels.as_ref().unwrap();
        assert_eq!(labels["app"], "web");
        assert_eq!(labels[LABEL_VM], "web");
        let ann = vmi.metadata.annotations.as_ref().unwrap();
        assert_eq!(ann["note"], "x");
        assert_eq!(ann[ANNOTATION_VM_GENERATION], "3");
        let owner = &vmi.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(owner.kind, "VirtualMachine");
        assert_eq!(owner.uid, "uid-web");
        assert_eq!(owner.controller, Some(true));
        assert_eq!(owner.block_owner_deletion, Some(true));
        let uuid = vmi.spec.unwrap().domain.firmware.unwrap().uuid.unwrap();
        assert_eq!(
            uuid,
            ferrovirt_api::admission::firmware_uuid("default", "web")
        );
    }
}
