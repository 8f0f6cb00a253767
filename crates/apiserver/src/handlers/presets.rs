//! VirtualMachineInstancePresets at VMI creation (KubeVirt's mutating webhook): the presets of
//! the VMI's namespace are read from the store and merged by the pure
//! [`ferrovirt_api::kubevirt::preset::apply_presets`] before defaulting. Presets that disagree
//! refuse the VMI (422 naming the field); fields the VMI overrides come back as warnings.

use ferrovirt_api::kubevirt::preset::apply_presets;
use ferrovirt_api::registry::ResourceDef;
use ferrovirt_store::ListOptions;
use serde_json::Value;

use crate::error::ApiError;
use crate::objects::{decode, name_of};
use crate::resources;
use crate::server::Shared;

/// Whether `def` is the kind presets apply to.
pub(crate) fn applies_to(def: &ResourceDef) -> bool {
    def.group == "kubevirt.io" && def.kind == "VirtualMachineInstance"
}

/// Merges the matching presets of namespace `ns` into the VMI `obj`; returns the warnings.
pub(crate) async fn apply(
    sh: &Shared,
    def: &ResourceDef,
    ns: &str,
    obj: &mut Value,
) -> Result<Vec<String>, ApiError> {
    let Some(pdef) = sh
        .resources
        .lookup("kubevirt.io", "v1", "virtualmachineinstancepresets")
    else {
        return Ok(Vec::new());
    };
    let listed = sh
        .store
        .list(
            &resources::list_prefix(pdef, Some(ns)),
            ListOptions::default(),
        )
        .await
        .map_err(ApiError::from_store)?;
    if listed.items.is_empty() {
        return Ok(Vec::new());
    }
    let presets = listed
        .items
        .iter()
        .map(decode)
        .collect::<Result<Vec<_>, _>>()?;
    match apply_presets(obj, &presets) {
        Ok(outcome) => Ok(outcome.warnings),
        Err(errors) => Err(ApiError::invalid(
            def,
            name_of(obj),
            errors
                .into_iter()
                .map(|e| (e.reason.to_string(), e.field, e.message))
                .collect(),
        )),
    }
}
