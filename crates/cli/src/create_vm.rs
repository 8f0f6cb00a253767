//! virtctl's `create vm`: a VirtualMachine manifest from flags (a pure function), printed as
//! YAML for `apply -f -`. Volume flags take virtctl's `key:value,key:value` form.

use serde_json::{Map, Value, json};

use crate::error::CliError;

/// The flags of `create vm`.
#[derive(Debug, Clone, Default)]
pub struct VmOptions {
    pub name: Option<String>,
    /// `NAME` or `KIND/NAME` (`virtualmachineinstancetype/small`).
    pub instancetype: Option<String>,
    pub preference: Option<String>,
    /// `src:IMAGE[,name:N]`, repeatable.
    pub containerdisks: Vec<String>,
    /// `src:[NAMESPACE/]NAME[,name:N][,size:Q]`, repeatable.
    pub datasources: Vec<String>,
    /// Base64-encoded cloud-init user data.
    pub cloud_init_user_data: Option<String>,
    pub run_strategy: Option<String>,
}

/// Parses `key:value,key:value` (the value may hold `:`, as image references do).
pub fn parse_params(s: &str) -> Result<Map<String, Value>, CliError> {
    let mut m = Map::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        let (k, v) = part.split_once(':').ok_or_else(|| {
            CliError::Usage(format!("params need the form key:value, got \"{part}\""))
        })?;
        m.insert(k.to_string(), Value::String(v.to_string()));
    }
    Ok(m)
}

fn matcher(s: &str, cluster_kind: &str, namespaced_kind: &str) -> Value {
    match s.split_once('/') {
        Some((k, n)) => {
            let kind = if k.to_lowercase().starts_with("virtualmachinecluster") {
                cluster_kind
            } else {
                namespaced_kind
            };
            json!({"name": n, "kind": kind})
        }
        None => json!({"name": s}),
    }
}

fn param<'a>(m: &'a Map<String, Value>, k: &str) -> Option<&'a str> {
    m.get(k).and_then(Value::as_str)
}

/// A pseudo-random suffix for a generated VM name.
fn random_suffix() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() ^ d.as_secs() as u32)
        .unwrap_or(0)
        ^ std::process::id().rotate_left(16);
    let alphabet = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|i| alphabet[((t >> (i * 5)) as usize) % alphabet.len()] as char)
        .collect()
}

/// The VirtualMachine manifest.
pub fn vm_manifest(o: &VmOptions) -> Result<Value, CliError> {
    let name = o
        .name
        .clone()
        .unwrap_or_else(|| format!("vm-{}", random_suffix()));
    let mut disks: Vec<Value> = Vec::new();
    let mut volumes: Vec<Value> = Vec::new();
    let mut dv_templates: Vec<Value> = Vec::new();
    for (i, cd) in o.containerdisks.iter().enumerate() {
        let p = parse_params(cd)?;
        let image = param(&p, "src")
            .ok_or_else(|| CliError::Usage("--volume-containerdisk needs src:IMAGE".into()))?;
        let vol = param(&p, "name")
            .map(String::from)
            .unwrap_or_else(|| format!("{name}-containerdisk-{i}"));
        volumes.push(json!({"name": vol, "containerDisk": {"image": image}}));
        disks.push(json!({"name": vol}));
    }
    for (i, ds) in o.datasources.iter().enumerate() {
        let p = parse_params(ds)?;
        let src = param(&p, "src").ok_or_else(|| {
            CliError::Usage("--volume-datasource needs src:[NAMESPACE/]NAME".into())
        })?;
        let vol = param(&p, "name")
            .map(String::from)
            .unwrap_or_else(|| format!("{name}-ds-{i}"));
        let mut source_ref = json!({"kind": "DataSource"});
        match src.split_once('/') {
            Some((ns, n)) => {
                source_ref["namespace"] = json!(ns);
                source_ref["name"] = json!(n);
            }
            None => source_ref["name"] = json!(src),
        }
        let mut spec = json!({"sourceRef": source_ref});
        if let Some(size) = param(&p, "size") {
            spec["storage"] = json!({"resources": {"requests": {"storage": size}}});
        } else {
            spec["storage"] = json!({});
        }
        dv_templates.push(json!({"metadata": {"name": vol}, "spec": spec}));
        volumes.push(json!({"name": vol, "dataVolume": {"name": vol}}));
        disks.push(json!({"name": vol}));
    }
    if let Some(ud) = &o.cloud_init_user_data {
        volumes.push(json!({"name": "cloudinitdisk", "cloudInitNoCloud": {"userDataBase64": ud}}));
        disks.push(json!({"name": "cloudinitdisk"}));
    }
    let mut domain = json!({"devices": {}});
    if !disks.is_empty() {
        domain["devices"]["disks"] = Value::Array(disks);
    }
    if o.instancetype.is_none() {
        domain["memory"] = json!({"guest": "512Mi"});
    }
    let mut tspec = json!({"domain": domain});
    if !volumes.is_empty() {
        tspec["volumes"] = Value::Array(volumes);
    }
    let mut spec = Map::new();
    if !dv_templates.is_empty() {
        spec.insert("dataVolumeTemplates".into(), Value::Array(dv_templates));
    }
    if let Some(it) = &o.instancetype {
        spec.insert(
            "instancetype".into(),
            matcher(
                it,
                "VirtualMachineClusterInstancetype",
                "VirtualMachineInstancetype",
            ),
        );
    }
    if let Some(p) = &o.preference {
        spec.insert(
            "preference".into(),
            matcher(
                p,
                "VirtualMachineClusterPreference",
                "VirtualMachinePreference",
            ),
        );
    }
    let strategy = o.run_strategy.clone().unwrap_or_else(|| "Always".into());
    const STRATEGIES: [&str; 6] = [
        "Always",
        "Halted",
        "Manual",
        "RerunOnFailure",
        "Once",
        "WaitAsReceiver",
    ];
    if !STRATEGIES.contains(&strategy.as_str()) {
        return Err(CliError::Usage(format!(
            "invalid run strategy \"{strategy}\", supported values are: {}",
            STRATEGIES.join(", ")
        )));
    }
    spec.insert("runStrategy".into(), json!(strategy));
    spec.insert("template".into(), json!({"spec": tspec}));
    Ok(json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name},
        "spec": spec,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params() {
        let p = parse_params("src:quay.io/c/img:latest,name:root").unwrap();
        assert_eq!(param(&p, "src"), Some("quay.io/c/img:latest"));
        assert_eq!(param(&p, "name"), Some("root"));
        assert!(parse_params("nocolon").is_err());
    }

    #[test]
    fn manifest_from_flags() {
        let o = VmOptions {
            name: Some("v".into()),
            instancetype: Some("u1.small".into()),
            preference: Some("virtualmachinepreference/fedora".into()),
            containerdisks: vec!["src:img:1".into()],
            datasources: vec!["src:os/fedora,size:5Gi".into()],
            cloud_init_user_data: Some("I2Nsb3VkLWNvbmZpZw==".into()),
            run_strategy: Some("Halted".into()),
        };
        let vm = vm_manifest(&o).unwrap();
        assert_eq!(vm["metadata"]["name"], "v");
        assert_eq!(vm["spec"]["runStrategy"], "Halted");
        assert_eq!(vm["spec"]["instancetype"], json!({"name": "u1.small"}));
        assert_eq!(vm["spec"]["preference"]["kind"], "VirtualMachinePreference");
        let t = &vm["spec"]["template"]["spec"];
        assert_eq!(t["volumes"][0]["containerDisk"]["image"], "img:1");
        assert_eq!(t["volumes"][1]["dataVolume"]["name"], "v-ds-0");
        assert_eq!(
            t["volumes"][2]["cloudInitNoCloud"]["userDataBase64"],
            "I2Nsb3VkLWNvbmZpZw=="
        );
        assert_eq!(t["domain"]["devices"]["disks"].as_array().unwrap().len(), 3);
        assert!(t["domain"].get("memory").is_none());
        let dv = &vm["spec"]["dataVolumeTemplates"][0];
        assert_eq!(
            dv["spec"]["sourceRef"],
            json!({"kind": "DataSource", "namespace": "os", "name": "fedora"})
        );
        assert_eq!(
            dv["spec"]["storage"]["resources"]["requests"]["storage"],
            "5Gi"
        );
    }

    #[test]
    fn defaults() {
        let vm = vm_manifest(&VmOptions::default()).unwrap();
        assert!(vm["metadata"]["name"].as_str().unwrap().starts_with("vm-"));
        assert_eq!(vm["spec"]["runStrategy"], "Always");
        assert_eq!(
            vm["spec"]["template"]["spec"]["domain"]["memory"]["guest"],
            "512Mi"
        );
        let bad = VmOptions {
            run_strategy: Some("Sometimes".into()),
            ..Default::default()
        };
        assert!(vm_manifest(&bad).is_err());
    }
}
