//! `expose vm|vmi NAME --port P` (virtctl's `expose`): a core/v1 Service selecting the VM's
//! template labels (a VMI's own labels), or `vm.kubevirt.io/name: NAME` (the launcher Pod
//! label) when there are none, with `--target-port` (number or name, default the port) and
//! `--type ClusterIP|NodePort`. [`service_object`] is the pure part.

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::{Value, json};

use crate::error::CliError;
use crate::target::Target;

/// What `expose` was asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExposeOpts {
    /// Service name (default: the VM's).
    pub name: Option<String>,
    pub port: u16,
    /// A port number or name (default: `port`).
    pub target_port: Option<String>,
    /// `ClusterIP` (default) or `NodePort`.
    pub type_: Option<String>,
}

/// The Service exposing `obj` (a VirtualMachine when `is_vm`, else a VMI) (pure).
pub fn service_object(is_vm: bool, obj: &Value, opts: &ExposeOpts) -> Result<Value, CliError> {
    let name = obj["metadata"]["name"].as_str().unwrap_or_default();
    let ns = obj["metadata"]["namespace"].as_str().unwrap_or("default");
    let labels = if is_vm {
        obj.pointer("/spec/template/metadata/labels")
    } else {
        obj.pointer("/metadata/labels")
    };
    let selector = match labels.and_then(Value::as_object).filter(|m| !m.is_empty()) {
        Some(m) => Value::Object(m.clone()),
        None => json!({"vm.kubevirt.io/name": name}),
    };
    let ty = opts.type_.as_deref().unwrap_or("ClusterIP");
    if !matches!(ty, "ClusterIP" | "NodePort") {
        return Err(CliError::Usage(format!(
            "--type {ty:?}: supported values: ClusterIP, NodePort"
        )));
    }
    let target = match &opts.target_port {
        None => json!(opts.port),
        Some(t) => match t.parse::<u16>() {
            Ok(n) => json!(n),
            Err(_) => json!(t),
        },
    };
    Ok(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": opts.name.as_deref().unwrap_or(name), "namespace": ns},
        "spec": {"type": ty, "selector": selector,
            "ports": [{"port": opts.port, "protocol": "TCP", "targetPort": target}]},
    }))
}

/// Creates the Service; returns what to print.
pub async fn expose(
    target: &Target,
    is_vm: bool,
    name: &str,
    opts: &ExposeOpts,
) -> Result<String, CliError> {
    let client = target.client().await?;
    let (kind, plural) = if is_vm {
        ("VirtualMachine", "virtualmachines")
    } else {
        ("VirtualMachineInstance", "virtualmachineinstances")
    };
    let res = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", kind),
        plural,
    );
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &target.namespace, &res);
    let obj = api.get(name).await.map_err(CliError::from_kube)?;
    let v = serde_json::to_value(&obj).map_err(|e| CliError::Usage(e.to_string()))?;
    let svc: k8s_openapi::api::core::v1::Service =
        serde_json::from_value(service_object(is_vm, &v, opts)?)
            .map_err(|e| CliError::Usage(e.to_string()))?;
    let svcs: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(client, &target.namespace);
    svcs.create(&PostParams::default(), &svc)
        .await
        .map_err(CliError::from_kube)?;
    Ok("Service successfully exposed".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> ExposeOpts {
        ExposeOpts {
            name: None,
            port: 22,
            target_port: None,
            type_: None,
        }
    }

    #[test]
    fn selects_template_labels_or_the_launcher_label() {
        let vm = json!({"metadata": {"name": "vm1", "namespace": "ns"},
            "spec": {"template": {"metadata": {"labels": {"kubevirt.io/domain": "vm1"}}}}});
        let s = service_object(true, &vm, &opts()).unwrap();
        assert_eq!(s["spec"]["selector"], json!({"kubevirt.io/domain": "vm1"}));
        assert_eq!(s["metadata"]["name"], "vm1");
        assert_eq!(s["spec"]["ports"][0]["targetPort"], 22);
        let bare = json!({"metadata": {"name": "vmi1"}});
        let o = ExposeOpts {
            name: Some("ssh".into()),
            target_port: Some("ssh".into()),
            type_: Some("NodePort".into()),
            ..opts()
        };
        let s = service_object(false, &bare, &o).unwrap();
        assert_eq!(
            s["spec"]["selector"],
            json!({"vm.kubevirt.io/name": "vmi1"})
        );
        assert_eq!(s["spec"]["type"], "NodePort");
        assert_eq!(s["spec"]["ports"][0]["targetPort"], "ssh");
        let bad = ExposeOpts {
            type_: Some("LoadBalancer".into()),
            ..opts()
        };
        assert!(service_object(false, &bare, &bad).is_err());
    }
}
