//! `ferrovirt backup restore`: the VMs of a backup recreated in the current namespace.
//! The plan of each VM ([`restored_vm`], shared with the BackupRestore controller) is pure;
//! the I/O creates the referenced Secrets and
//! ConfigMaps (absent ones only), a DataVolume with an `upload` source per claim filled
//! through CDI's upload path from the repository, then the VM.

use std::time::Duration;

use kube::api::{Api, DynamicObject, PostParams};
use serde_json::{Value, json};

use ferrovirt_backup::Repository;
pub use ferrovirt_backup::restore::restored_vm;

use crate::error::CliError;
use crate::target::Target;

/// What to restore.
#[derive(Debug, Clone)]
pub struct RestoreOptions {
    pub backup: String,
    /// `namespace/name` (empty: all).
    pub vms: Vec<String>,
    pub new_name: Option<String>,
    pub start: bool,
    pub insecure: bool,
}

fn dyn_api(
    client: &kube::Client,
    ns: &str,
    group: &str,
    version: &str,
    kind: &str,
    plural: &str,
) -> Api<DynamicObject> {
    let ar = kube::api::ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: if group.is_empty() {
            version.into()
        } else {
            format!("{group}/{version}")
        },
        kind: kind.into(),
        plural: plural.into(),
    };
    Api::namespaced_with(client.clone(), ns, &ar)
}

async fn create_if_absent(
    api: &Api<DynamicObject>,
    mut obj: Value,
    ns: &str,
) -> Result<bool, CliError> {
    obj["metadata"]["namespace"] = json!(ns);
    let name = obj["metadata"]["name"].as_str().unwrap_or("").to_string();
    if api
        .get_opt(&name)
        .await
        .map_err(CliError::from_kube)?
        .is_some()
    {
        return Ok(false);
    }
    let o: DynamicObject =
        serde_json::from_value(obj).map_err(|e| CliError::Usage(e.to_string()))?;
    api.create(&PostParams::default(), &o)
        .await
        .map_err(CliError::from_kube)?;
    Ok(true)
}

/// Restores the backup's VMs (or those named) into the current namespace.
pub async fn restore(
    target: &Target,
    repo: &Repository,
    o: &RestoreOptions,
) -> Result<(), CliError> {
    let m = repo
        .manifest(&o.backup)
        .await
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let ns = target.namespace.clone();
    let client = target.client().await?;
    let full = |v: &Value| {
        format!(
            "{}/{}",
            v["metadata"]["namespace"].as_str().unwrap_or(""),
            v["metadata"]["name"].as_str().unwrap_or("")
        )
    };
    let chosen: Vec<&Value> = m
        .vms
        .iter()
        .filter(|v| o.vms.is_empty() || o.vms.contains(&full(v)))
        .collect();
    if chosen.is_empty() {
        return Err(CliError::Usage(format!(
            "no VM of backup {} matches {:?}",
            o.backup, o.vms
        )));
    }
    if o.new_name.is_some() && chosen.len() != 1 {
        return Err(CliError::Usage("--new-name needs exactly one VM".into()));
    }
    let secrets = dyn_api(&client, &ns, "", "v1", "Secret", "secrets");
    let cms = dyn_api(&client, &ns, "", "v1", "ConfigMap", "configmaps");
    let vms = dyn_api(
        &client,
        &ns,
        "kubevirt.io",
        "v1",
        "VirtualMachine",
        "virtualmachines",
    );
    for vm in chosen {
        let (new_vm, claims) = restored_vm(vm, &ns, o.new_name.as_deref(), o.start);
        let refs_ns = vm["metadata"]["namespace"].as_str().unwrap_or("");
        for obj in &m.objects {
            let kind = obj["kind"].as_str().unwrap_or("");
            let same_ns = obj["metadata"]["namespace"].as_str().unwrap_or(refs_ns) == refs_ns;
            let api = match kind {
                "Secret" => &secrets,
                "ConfigMap" => &cms,
                _ => continue,
            };
            if same_ns && create_if_absent(api, obj.clone(), &ns).await? {
                eprintln!(
                    "{kind} {ns}/{} created",
                    obj["metadata"]["name"].as_str().unwrap_or("")
                );
            }
        }
        for (disk, dv) in &claims {
            restore_claim(target, repo, &o.backup, disk, dv, &m, o.insecure).await?;
        }
        let name = new_vm["metadata"]["name"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let obj: DynamicObject =
            serde_json::from_value(new_vm).map_err(|e| CliError::Usage(e.to_string()))?;
        vms.create(&PostParams::default(), &obj)
            .await
            .map_err(CliError::from_kube)?;
        println!(
            "virtualmachine.kubevirt.io/{name} restored from {}",
            o.backup
        );
    }
    Ok(())
}

/// One claim: a DataVolume with an `upload` source of the disk's size (rounded up to MiB),
/// filled from the repository through the upload path.
async fn restore_claim(
    target: &Target,
    repo: &Repository,
    backup: &str,
    disk: &str,
    dv: &str,
    m: &ferrovirt_backup::Manifest,
    insecure: bool,
) -> Result<(), CliError> {
    let entry = m
        .disks
        .iter()
        .find(|d| d.name == disk)
        .ok_or_else(|| CliError::Usage(format!("disk {disk} is not in backup {backup}")))?;
    let mib = entry.size.div_ceil(1 << 20).max(1);
    let o = crate::upload::UploadOptions {
        name: dv.to_string(),
        size: Some(format!("{mib}Mi")),
        image_path: std::path::PathBuf::new(),
        storage_class: None,
        access_mode: None,
        insecure,
        wait: Duration::from_secs(300),
    };
    let dvs = dyn_api(
        &target.client().await?,
        &target.namespace,
        "cdi.kubevirt.io",
        "v1beta1",
        "DataVolume",
        "datavolumes",
    );
    if dvs
        .get_opt(dv)
        .await
        .map_err(CliError::from_kube)?
        .is_some()
    {
        return Err(CliError::Usage(format!(
            "DataVolume {}/{dv} already exists: restore under another name (--new-name) or \
             into another namespace (-n)",
            target.namespace
        )));
    }
    let (reader, mut writer) = tokio::io::duplex(8 << 20);
    let (repo2, backup2, disk2) = (repo.clone(), backup.to_string(), disk.to_string());
    let feeder = tokio::spawn(async move {
        repo2
            .restore_disk(&backup2, &disk2, &mut writer, &|_| {})
            .await
    });
    eprintln!("Restoring disk {disk} into DataVolume {dv}");
    let sent = crate::upload::run_stream(target, &o, reader, entry.size).await;
    let fed = feeder
        .await
        .map_err(|e| CliError::Transport(e.to_string()))?;
    // A repository error (a damaged chunk) is the cause when both fail.
    fed.map_err(|e| CliError::Usage(format!("restoring disk {disk}: {e}")))?;
    sent
}
