//! `ferrovirt backup create|list|describe|verify|restore|gc` (docs/backup.md).
//!
//! `create` makes a Backup object and, with `--wait`, follows its progress. `list`,
//! `describe`, `verify` and `restore` read the repository on the target directly from this
//! process, with the BackupTarget (and its credentials Secret) and the key Secret read from the
//! cluster: a cluster that has only the target and the key can list and restore. `restore`
//! recreates each VM's Secrets/ConfigMaps (absent ones), one DataVolume per claim filled
//! through CDI's upload path (the bytes streamed from the repository, checked chunk by chunk),
//! then the VM (`--start` to run it).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use serde_json::{Value, json};

use ferrovirt_backup::repo::{Create, Repository};
use ferrovirt_backup::{Manifest, Target as RepoTarget};

use crate::error::CliError;
use crate::target::Target;

/// The subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum BackupCommand {
    /// Create a Backup of VMs of the namespace.
    Create {
        name: String,
        /// The BackupTarget.
        #[arg(long)]
        target: String,
        /// A VM of the namespace (repeatable).
        #[arg(long = "vm", required = true)]
        vms: Vec<String>,
        /// The Secret (key `key`) with the encryption key.
        #[arg(long)]
        key_secret: String,
        /// Wait for the backup to finish, with a progress bar.
        #[arg(long)]
        wait: bool,
    },
    /// List the backups on a target (its catalog).
    List(RepoArgs),
    /// Show a backup's VMs, disks and figures.
    Describe {
        backup: String,
        #[command(flatten)]
        repo: RepoArgs,
    },
    /// Re-read and re-hash every chunk of a backup (or of all); exit 1 naming bad chunks.
    Verify {
        backup: Option<String>,
        #[command(flatten)]
        repo: RepoArgs,
    },
    /// Delete chunks no backup in the catalog references (older than the grace period);
    /// waits for nothing: a running backup makes it stop ("deferred").
    Gc {
        #[command(flatten)]
        repo: RepoArgs,
        /// Keep unreferenced chunks younger than this (default 3600).
        #[arg(long, default_value_t = 3600)]
        grace_seconds: u64,
    },
    /// Restore a backup's VMs into the namespace.
    Restore {
        backup: String,
        #[command(flatten)]
        repo: RepoArgs,
        /// `namespace/name` of a VM in the backup (default: all).
        #[arg(long = "vm")]
        vms: Vec<String>,
        /// A new name for the VM (one --vm only); claims become `<new>-<claim>`.
        #[arg(long)]
        new_name: Option<String>,
        /// Start the VMs once restored.
        #[arg(long)]
        start: bool,
        /// Do not verify the server's certificate for the upload.
        #[arg(long)]
        insecure: bool,
    },
}

/// Which repository: a BackupTarget and the key Secret of the namespace.
#[derive(Debug, Clone, clap::Args)]
pub struct RepoArgs {
    #[arg(long)]
    pub target: String,
    #[arg(long)]
    pub key_secret: String,
}

fn usage(e: impl std::fmt::Display) -> CliError {
    CliError::Usage(e.to_string())
}

fn backup_resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: ferrovirt_api::backup::GROUP.into(),
        version: ferrovirt_api::backup::VERSION.into(),
        api_version: format!(
            "{}/{}",
            ferrovirt_api::backup::GROUP,
            ferrovirt_api::backup::VERSION
        ),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// Runs one subcommand.
pub async fn run(target: &Target, cmd: BackupCommand) -> Result<(), CliError> {
    match cmd {
        BackupCommand::Create {
            name,
            target: t,
            vms,
            key_secret,
            wait,
        } => create(target, &name, &t, &vms, &key_secret, wait).await,
        BackupCommand::List(r) => {
            let repo = open(target, &r).await?;
            let list = repo.list().await.map_err(usage)?;
            println!("{}", list_table(&list));
            Ok(())
        }
        BackupCommand::Describe { backup, repo: r } => {
            let repo = open(target, &r).await?;
            let m = repo.manifest(&backup).await.map_err(usage)?;
            println!("{}", describe_text(&m));
            Ok(())
        }
        BackupCommand::Gc {
            repo: r,
            grace_seconds,
        } => {
            let repo = open(target, &r).await?;
            let report = repo
                .gc(ferrovirt_backup::GcOptions {
                    grace: Duration::from_secs(grace_seconds),
                    ..Default::default()
                })
                .await
                .map_err(usage)?;
            if let Some(b) = &report.deferred {
                println!("deferred: backup {b} is running; nothing deleted");
            } else {
                println!(
                    "{} backup(s), {} chunks referenced, {} deleted ({} bytes), {} young kept, \
                     {} orphaned objects deleted",
                    report.backups,
                    report.chunks_referenced,
                    report.chunks_deleted,
                    report.bytes_deleted,
                    report.chunks_kept_young,
                    report.orphans_deleted
                );
            }
            Ok(())
        }
        BackupCommand::Verify { backup, repo: r } => {
            let repo = open(target, &r).await?;
            let mut bar: Option<crate::progress::ByteProgress> = None;
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(u64, u64)>();
            let progress = move |done: u64, total: u64| {
                let _ = tx.send((done, total));
            };
            let verify = repo.verify(backup.as_deref(), &progress);
            tokio::pin!(verify);
            let report = loop {
                tokio::select! {
                    r = &mut verify => break r.map_err(usage)?,
                    Some((done, total)) = rx.recv() => {
                        bar.get_or_insert_with(|| crate::progress::ByteProgress::new(total))
                            .update(done);
                    }
                }
            };
            if let Some(b) = bar.as_mut() {
                b.finish();
            }
            println!(
                "verified {} backup(s): {} chunks, {} bytes",
                report.backups.len(),
                report.chunks_checked,
                report.bytes_checked
            );
            if report.problems.is_empty() {
                println!("OK");
                return Ok(());
            }
            for p in &report.problems {
                println!(
                    "BAD {} (backup {}, disk {}): {}",
                    p.object,
                    p.backup,
                    p.disk.as_deref().unwrap_or("-"),
                    p.reason
                );
            }
            Err(CliError::Usage(format!(
                "{} damaged object(s) in the repository",
                report.problems.len()
            )))
        }
        BackupCommand::Restore {
            backup,
            repo: r,
            vms,
            new_name,
            start,
            insecure,
        } => {
            let repo = open(target, &r).await?;
            let o = RestoreOptions {
                backup,
                vms,
                new_name,
                start,
                insecure,
            };
            restore(target, &repo, &o).await
        }
    }
}

async fn create(
    target: &Target,
    name: &str,
    t: &str,
    vms: &[String],
    key_secret: &str,
    wait: bool,
) -> Result<(), CliError> {
    let client = target.client().await?;
    let ns = &target.namespace;
    let api: Api<DynamicObject> =
        Api::namespaced_with(client, ns, &backup_resource("Backup", "backups"));
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "backup.ferrovirt.io/v1alpha1",
        "kind": "Backup",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"target": t, "virtualMachines": vms, "encryptionKeySecretRef": key_secret},
    }))
    .map_err(usage)?;
    api.create(&PostParams::default(), &obj)
        .await
        .map_err(CliError::from_kube)?;
    println!("backup.backup.ferrovirt.io/{name} created");
    if !wait {
        return Ok(());
    }
    let mut bar = crate::progress::ByteProgress::new(100);
    loop {
        let b = api.get(name).await.map_err(CliError::from_kube)?;
        let st = b.data.get("status").cloned().unwrap_or(Value::Null);
        let pct = st["progress"]
            .as_str()
            .and_then(|p| p.trim_end_matches('%').parse::<u64>().ok())
            .unwrap_or(0);
        match st["phase"].as_str() {
            Some("Succeeded") => {
                bar.update(100);
                bar.finish();
                println!(
                    "Succeeded: {} bytes read, {} new, {} deduplicated",
                    st["bytesRead"], st["bytesNew"], st["bytesDeduplicated"]
                );
                return Ok(());
            }
            Some("Failed") => {
                bar.finish();
                return Err(CliError::Usage(format!(
                    "backup {name} failed: {}",
                    condition_message(&st)
                )));
            }
            _ => bar.update(pct),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn condition_message(status: &Value) -> String {
    status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Ready")
        .and_then(|c| c["message"].as_str())
        .unwrap_or("")
        .to_string()
}

async fn read_secret(
    client: &kube::Client,
    ns: &str,
    name: &str,
) -> Result<BTreeMap<String, Vec<u8>>, CliError> {
    let s = Api::<Secret>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .map_err(CliError::from_kube)?;
    Ok(s.data
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.0))
        .collect())
}

/// The repository of `--target` with the key of `--key-secret`.
async fn open(target: &Target, r: &RepoArgs) -> Result<Repository, CliError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = target.client().await?;
    let api: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &backup_resource("BackupTarget", "backuptargets"),
    );
    let t = api.get(&r.target).await.map_err(CliError::from_kube)?;
    let spec: ferrovirt_api::backup::BackupTargetSpec =
        serde_json::from_value(t.data.get("spec").cloned().unwrap_or(Value::Null))
            .map_err(|e| usage(format!("BackupTarget {}: {e}", r.target)))?;
    let creds = match &spec.s3 {
        Some(s3) => Some(
            read_secret(
                &client,
                &s3.credentials_secret_ref.namespace,
                &s3.credentials_secret_ref.name,
            )
            .await?,
        ),
        None => None,
    };
    let rt: RepoTarget =
        ferrovirt_backup::target::from_spec(&spec, creds.as_ref()).map_err(usage)?;
    let key = read_secret(&client, &target.namespace, &r.key_secret)
        .await?
        .remove(ferrovirt_api::backup::ENCRYPTION_KEY)
        .ok_or_else(|| usage(format!("Secret {} has no key \"key\"", r.key_secret)))?;
    Repository::open(&rt, &key, Create::Never)
        .await
        .map_err(|e| usage(format!("target {}: {e}", r.target)))
}

/// The `list` table (pure).
pub fn list_table(list: &[ferrovirt_backup::CatalogEntry]) -> String {
    let mut out = format!(
        "{:<32} {:<22} {:<30} {:>12} {:>12} {:>12}",
        "NAME", "CREATED", "VMS", "SIZE", "NEW", "DEDUP"
    );
    for e in list {
        out.push_str(&format!(
            "\n{:<32} {:<22} {:<30} {:>12} {:>12} {:>12}",
            e.name,
            e.created_at.get(..19).unwrap_or(&e.created_at),
            e.vms.join(","),
            crate::progress::human(e.size),
            crate::progress::human(e.stats.bytes_new),
            crate::progress::human(e.stats.bytes_deduplicated),
        ));
    }
    out
}

/// The `describe` text (pure).
pub fn describe_text(m: &Manifest) -> String {
    let mut out = format!(
        "Name:      {}\nCreated:   {}\nDuration:  {:.1}s\nRead:      {}\nNew:       {}\nDedup:     {}\nZero:      {}\nVMs:",
        m.name,
        m.created_at,
        m.duration_seconds,
        m.stats.bytes_read,
        m.stats.bytes_new,
        m.stats.bytes_deduplicated,
        m.stats.bytes_zero
    );
    for vm in &m.vms {
        out.push_str(&format!(
            "\n  {}/{}",
            vm["metadata"]["namespace"].as_str().unwrap_or(""),
            vm["metadata"]["name"].as_str().unwrap_or("")
        ));
    }
    out.push_str("\nDisks:");
    for d in &m.disks {
        out.push_str(&format!(
            "\n  {:<40} size {:>12}  new {:>12}  dedup {:>12}",
            d.name, d.size, d.stats.bytes_new, d.stats.bytes_deduplicated
        ));
    }
    out.push_str("\nObjects:");
    for o in &m.objects {
        out.push_str(&format!(
            "\n  {} {}",
            o["kind"].as_str().unwrap_or("?"),
            o["metadata"]["name"].as_str().unwrap_or("")
        ));
    }
    out
}

#[path = "backup_restore.rs"]
mod restore_impl;
pub use restore_impl::{RestoreOptions, restore, restored_vm};
