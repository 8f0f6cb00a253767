//! The manifests of an export (pure): what recreates the exported VM or volumes on another
//! cluster, as KubeVirt's `all` and `auth-header-secret` manifests do:
//!
//! - a ConfigMap `export-ca-cm-<export>` with the CA of the export's certificate (`ca.pem`);
//! - one DataVolume per exported volume, named as the claim, importing the volume's `gzip`
//!   URL (`certConfigMap` that ConfigMap, `secretExtraHeaders` the header Secret) at the
//!   claim's size, access modes and volume mode;
//! - the VM, cleaned of its status and server-set metadata (uid, resourceVersion,
//!   generation, creationTimestamp, managedFields, owners, finalizers, namespace,
//!   last-applied), its claim volumes turned into `dataVolume` volumes of those DataVolumes
//!   and the DataVolume templates of exported volumes dropped (the DataVolumes replace them);
//! - `auth-header-secret`: the Secret `header-secret-<export>` whose value is the token
//!   header line (`x-kubevirt-export-token: <token>`), which the DataVolumes name.

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use serde_json::{Value, json};

use ferrovirt_api::kubevirt::export::{ExportLink, TOKEN_HEADER, format};

/// The CA ConfigMap's name.
pub fn ca_config_map(export: &str) -> String {
    format!("export-ca-cm-{export}")
}

/// The header Secret's name.
pub fn header_secret_name(export: &str) -> String {
    format!("header-secret-{export}")
}

/// The `auth-header-secret` manifest.
pub fn header_secret(export: &str, token: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": header_secret_name(export)},
        "type": "Opaque",
        "stringData": {"token": format!("{TOKEN_HEADER}: {token}")},
    })
}

/// The `all` manifests of export `export` with links `link`, volumes (claim name and claim)
/// and the VM (if the source is or captured one).
pub fn all(
    export: &str,
    link: &ExportLink,
    volumes: &[(String, PersistentVolumeClaim)],
    vm: Option<&Value>,
) -> Vec<Value> {
    let mut out = vec![json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": ca_config_map(export)},
        "data": {"ca.pem": link.cert},
    })];
    for (name, claim) in volumes {
        let url = link
            .volumes
            .iter()
            .flatten()
            .find(|v| &v.name == name)
            .and_then(|v| {
                v.formats
                    .iter()
                    .flatten()
                    .find(|f| f.format == format::GZIP)
            })
            .map(|f| f.url.clone())
            .unwrap_or_default();
        let spec = claim.spec.clone().unwrap_or_default();
        let mut storage = json!({});
        if let Some(size) = spec
            .resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .and_then(|r| r.get("storage"))
        {
            storage["resources"] = json!({"requests": {"storage": size}});
        }
        if let Some(m) = &spec.access_modes {
            storage["accessModes"] = json!(m);
        }
        if let Some(m) = &spec.volume_mode {
            storage["volumeMode"] = json!(m);
        }
        out.push(json!({
            "apiVersion": "cdi.kubevirt.io/v1beta1",
            "kind": "DataVolume",
            "metadata": {"name": name},
            "spec": {
                "source": {"http": {
                    "url": url,
                    "certConfigMap": ca_config_map(export),
                    "secretExtraHeaders": [header_secret_name(export)],
                }},
                "storage": storage,
            },
        }));
    }
    if let Some(vm) = vm {
        let names: Vec<&str> = volumes.iter().map(|(n, _)| n.as_str()).collect();
        out.push(clean_vm(vm, &names));
    }
    out
}

/// The VM without server-set state, its exported claims as `dataVolume` volumes.
pub fn clean_vm(vm: &Value, exported: &[&str]) -> Value {
    let mut vm = vm.clone();
    vm["apiVersion"] = json!("kubevirt.io/v1");
    vm["kind"] = json!("VirtualMachine");
    if let Some(o) = vm.as_object_mut() {
        o.remove("status");
    }
    if let Some(m) = vm.get_mut("metadata").and_then(Value::as_object_mut) {
        for k in [
            "uid",
            "resourceVersion",
            "generation",
            "creationTimestamp",
            "managedFields",
            "ownerReferences",
            "finalizers",
            "namespace",
            "selfLink",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ] {
            m.remove(k);
        }
        if let Some(a) = m.get_mut("annotations").and_then(Value::as_object_mut) {
            a.remove("kubectl.kubernetes.io/last-applied-configuration");
            a.retain(|k, _| !k.starts_with("restore.kubevirt.io/"));
        }
        if m.get("annotations")
            .and_then(Value::as_object)
            .is_some_and(|a| a.is_empty())
        {
            m.remove("annotations");
        }
    }
    if let Some(vols) = vm
        .pointer_mut("/spec/template/spec/volumes")
        .and_then(Value::as_array_mut)
    {
        for v in vols {
            let claim = v
                .pointer("/persistentVolumeClaim/claimName")
                .and_then(Value::as_str)
                .map(str::to_string);
            if let Some(c) = claim.filter(|c| exported.contains(&c.as_str()))
                && let Some(o) = v.as_object_mut()
            {
                o.remove("persistentVolumeClaim");
                o.insert("dataVolume".into(), json!({"name": c}));
            }
        }
    }
    if let Some(spec) = vm.get_mut("spec").and_then(Value::as_object_mut) {
        if let Some(t) = spec
            .get_mut("dataVolumeTemplates")
            .and_then(Value::as_array_mut)
        {
            t.retain(|d| {
                !d.pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .is_some_and(|n| exported.contains(&n))
            });
        }
        if spec
            .get("dataVolumeTemplates")
            .and_then(Value::as_array)
            .is_some_and(Vec::is_empty)
        {
            spec.remove("dataVolumeTemplates");
        }
    }
    vm
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrovirt_api::kubevirt::export::{ExportVolume, ExportVolumeFormat};

    #[test]
    fn the_vm_and_a_datavolume_per_volume_import_from_the_export() {
        let link = ExportLink {
            cert: "CA".into(),
            volumes: Some(vec![ExportVolume {
                name: "root".into(),
                formats: Some(vec![ExportVolumeFormat {
                    format: "gzip".into(),
                    url: "https://h/x/volumes/root/disk.img.gz".into(),
                }]),
            }]),
            manifests: None,
        };
        let claim: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": "root"},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "local",
                     "resources": {"requests": {"storage": "64Mi"}}}
        }))
        .unwrap();
        let vm = json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "vm", "namespace": "a", "uid": "u", "resourceVersion": "9",
                         "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}", "keep": "1"}},
            "spec": {"runStrategy": "Always",
                     "dataVolumeTemplates": [{"metadata": {"name": "root"}, "spec": {}}],
                     "template": {"spec": {"volumes": [
                         {"name": "disk", "persistentVolumeClaim": {"claimName": "root"}},
                         {"name": "ci", "cloudInitNoCloud": {"userData": "x"}}]}}},
            "status": {"ready": true}
        });
        let m = all("ex", &link, &[("root".into(), claim)], Some(&vm));
        assert_eq!(m.len(), 3);
        assert_eq!(m[0]["kind"], "ConfigMap");
        assert_eq!(m[0]["data"]["ca.pem"], "CA");
        let dv = &m[1];
        assert_eq!(dv["kind"], "DataVolume");
        assert_eq!(dv["metadata"]["name"], "root");
        let http = &dv["spec"]["source"]["http"];
        assert_eq!(http["url"], "https://h/x/volumes/root/disk.img.gz");
        assert_eq!(http["certConfigMap"], "export-ca-cm-ex");
        assert_eq!(http["secretExtraHeaders"][0], "header-secret-ex");
        assert_eq!(
            dv["spec"]["storage"]["resources"]["requests"]["storage"],
            "64Mi"
        );
        assert!(dv["spec"]["storage"].get("storageClassName").is_none());
        let vm = &m[2];
        assert!(vm.get("status").is_none());
        for k in ["uid", "resourceVersion", "namespace"] {
            assert!(vm["metadata"].get(k).is_none(), "{k}");
        }
        assert_eq!(vm["metadata"]["annotations"], json!({"keep": "1"}));
        assert!(vm["spec"].get("dataVolumeTemplates").is_none());
        let vols = &vm["spec"]["template"]["spec"]["volumes"];
        assert_eq!(
            vols[0],
            json!({"name": "disk", "dataVolume": {"name": "root"}})
        );
        assert_eq!(vols[1]["cloudInitNoCloud"]["userData"], "x");
    }

    #[test]
    fn the_header_secret_carries_the_token_header() {
        let s = header_secret("ex", "t0k");
        assert_eq!(s["metadata"]["name"], "header-secret-ex");
        assert_eq!(s["stringData"]["token"], "x-kubevirt-export-token: t0k");
    }
}
