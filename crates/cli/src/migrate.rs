//! `migrate VM` and `migrate-cancel VM` (virtctl's verbs): a VirtualMachineInstanceMigration
//! for the VM's VMI is created (generated name `kubevirt-migrate-vm-…`, as virtctl's), and
//! cancelling deletes the VMI's unfinished migrations (the controllers abort a running one;
//! the VM runs on where it was).

use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PostParams,
};
use serde_json::{Value, json};

use crate::error::CliError;
use crate::target::Target;

fn vmim_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstanceMigration"),
        "virtualmachineinstancemigrations",
    )
}

/// The migration object `migrate NAME` creates (pure).
pub fn migration_object(namespace: &str, vmi: &str) -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstanceMigration",
        "metadata": {"generateName": "kubevirt-migrate-vm-", "namespace": namespace},
        "spec": {"vmiName": vmi},
    })
}

/// Whether a migration object (JSON) is for `vmi` and not finished (pure).
pub fn is_active_for(m: &Value, vmi: &str) -> bool {
    m["spec"]["vmiName"] == vmi
        && !matches!(m["status"]["phase"].as_str(), Some("Succeeded" | "Failed"))
}

/// Creates the migration; returns what to print.
pub async fn migrate(target: &Target, name: &str) -> Result<String, CliError> {
    let client = target.client().await?;
    let api: Api<DynamicObject> = Api::namespaced_with(client, &target.namespace, &vmim_resource());
    let obj: DynamicObject = serde_json::from_value(migration_object(&target.namespace, name))
        .map_err(|e| CliError::Usage(e.to_string()))?;
    api.create(&PostParams::default(), &obj)
        .await
        .map_err(CliError::from_kube)?;
    Ok(format!("VM {name} was scheduled to migrate"))
}

/// Deletes the VMI's unfinished migrations; returns what to print.
pub async fn cancel(target: &Target, name: &str) -> Result<String, CliError> {
    let client = target.client().await?;
    let api: Api<DynamicObject> = Api::namespaced_with(client, &target.namespace, &vmim_resource());
    let list = api
        .list(&ListParams::default())
        .await
        .map_err(CliError::from_kube)?;
    let mut cancelled = 0;
    for m in list.items {
        let v = serde_json::to_value(&m).unwrap_or(Value::Null);
        if is_active_for(&v, name)
            && let Some(n) = &m.metadata.name
        {
            api.delete(n, &DeleteParams::default())
                .await
                .map_err(CliError::from_kube)?;
            cancelled += 1;
        }
    }
    if cancelled == 0 {
        return Err(CliError::Usage(format!(
            "found no migration to cancel for {name}"
        )));
    }
    Ok(format!("VM {name} was scheduled to migrate-cancel"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_object_and_the_active_filter() {
        let m = migration_object("ns", "vm1");
        assert_eq!(m["spec"]["vmiName"], "vm1");
        assert_eq!(m["metadata"]["generateName"], "kubevirt-migrate-vm-");
        assert!(is_active_for(&m, "vm1"));
        assert!(!is_active_for(&m, "vm2"));
        let mut done = m.clone();
        done["status"] = json!({"phase": "Succeeded"});
        assert!(!is_active_for(&done, "vm1"));
    }
}
