//! Storage controllers (see `docs/storage.md`): the built-in StorageClasses and their
//! StorageProfiles ([`classes`]), the PVC binder/provisioner ([`pvc`] decides,
//! [`pvc_loop`] applies, and reclaims released volumes), and the CDI DataVolume controller
//! ([`datavolume`] decides, [`dv_loop`] creates the claim and runs imports, clones and blank
//! volumes in tasks, prepared by `dv_work`; `upload` sources wait in `UploadReady` for [`upload_api`], CDI's
//! UploadTokenRequest and upload proxy served by the API server, tokens in [`upload_token`]),
//! DataSources ([`datasource`]: Ready condition, `sourceRef` resolution), Block-mode volumes
//! on loop devices ([`block`]), PVC expansion ([`expansion`]) and the pvc-/pv-protection
//! finalizers that keep storage in use from going ([`protection`]). Volume data lives in
//! directories built by `ferrovirt_storage`: `shared` volumes on the server's machine, written
//! here; node-local (`local`-class) volumes on their node, where the node's agent creates,
//! populates, grows and deletes them on the controllers' request ([`nodes`]).

pub mod block;
pub mod classes;
pub mod datasource;
pub mod datavolume;
pub mod dv_loop;
mod dv_work;
pub mod expansion;
pub mod nodes;
pub mod protection;
pub mod pvc;
pub mod pvc_import;
pub mod pvc_loop;
pub mod registry_import;
pub mod resources;
pub mod upload_api;
pub mod upload_token;

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::ControllerError;

/// Environment variable naming the storage data directory when [`StorageOptions::data_dir`]
/// is unset.
pub const DATA_DIR_ENV: &str = "FERROVIRT_STORAGE_DIR";

/// Tunables of the storage controllers.
#[derive(Debug, Clone)]
pub struct StorageOptions {
    /// The server's data directory: `shared` volumes go to `<data_dir>/volumes`, import
    /// scratch space to `<data_dir>/import-scratch` (`local` volumes live on their nodes, in
    /// each agent's data dir). When unset: `$FERROVIRT_STORAGE_DIR`, else the
    /// `--data-dir` argument of this process, else `/var/lib/ferrovirt`.
    pub data_dir: Option<PathBuf>,
    /// Report DataVolumes of WaitForFirstConsumer classes as `WaitForFirstConsumer` until a
    /// VMI using them is scheduled. Off (the default): the DataVolume controller picks a
    /// Ready node itself and imports at once (CDI's behaviour without the
    /// `HonorWaitForFirstConsumer` feature gate).
    pub honor_wait_for_first_consumer: bool,
    /// Failed transfers (network, I/O) are retried this many times; checksum mismatches and
    /// refused images fail at once.
    pub max_retries: u32,
    /// First retry delay (doubled per attempt, at most five minutes).
    pub retry_backoff: Duration,
    /// Reclaiming released volumes follows PV and PVC watch events; this is how often it also
    /// runs without one, from the caches (no API request unless something is to be done:
    /// Block volumes re-attached, StorageProfiles refreshed every tenth time).
    pub resync: Duration,
    /// Address ranges imports may reach although the address policy refuses their class
    /// (`--import-allowed-cidrs`; HyperConverged `spec.storageImport.allowedImportCIDRs` adds
    /// more).
    pub import_allowed_cidrs: Vec<ferrovirt_storage::netpolicy::Cidr>,
    /// The bearer token the node agents' endpoints accept: the controllers call it to have
    /// node-local volumes created, populated, grown and deleted on their node. `None`: such
    /// requests fail with a clear message.
    pub agent_token: Option<String>,
}

impl Default for StorageOptions {
    fn default() -> Self {
        Self {
            data_dir: None,
            honor_wait_for_first_consumer: false,
            max_retries: 3,
            retry_backoff: Duration::from_secs(2),
            resync: Duration::from_secs(3),
            import_allowed_cidrs: Vec::new(),
            agent_token: None,
        }
    }
}

/// Where volumes and scratch space live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dirs {
    /// Root of `shared` volumes.
    pub shared: PathBuf,
    /// Import scratch space; one subdirectory per transfer.
    pub scratch: PathBuf,
    /// Volume roots of the shared-filesystem classes (`<mount>/volumes`), see
    /// [`Dirs::with_classes`].
    pub mounts: Vec<PathBuf>,
}

impl Dirs {
    /// The layout under `data_dir`.
    pub fn under(data_dir: &Path) -> Self {
        Dirs {
            shared: data_dir.join("volumes"),
            scratch: data_dir.join("import-scratch"),
            mounts: Vec::new(),
        }
    }

    /// These roots plus the volume roots of the shared mounts `classes` declare.
    pub fn with_classes(&self, classes: &[k8s_openapi::api::storage::v1::StorageClass]) -> Dirs {
        let mut d = self.clone();
        d.mounts = classes::declared_mounts(classes)
            .into_iter()
            .map(|m| ferrovirt_storage::shared_mount::volume_root(&m.mount))
            .collect();
        d
    }

    /// Whether `path` lies strictly inside the shared volume root or a declared mount's
    /// (never remove anything else; node-local volumes are removed by their node's agent).
    pub fn owns(&self, path: &Path) -> bool {
        let inside = |root: &Path| path.starts_with(root) && path != root;
        let plain = path.components().all(|c| {
            matches!(
                c,
                std::path::Component::Normal(_) | std::path::Component::RootDir
            )
        });
        plain && (inside(&self.shared) || self.mounts.iter().any(|m| inside(m)))
    }
}

/// The data directory: the option, else `env`, else `--data-dir` in `args`, else
/// `/var/lib/ferrovirt`.
pub fn resolve_data_dir(opt: Option<&Path>, env: Option<String>, args: &[String]) -> PathBuf {
    if let Some(p) = opt {
        return p.to_path_buf();
    }
    if let Some(e) = env.filter(|e| !e.is_empty()) {
        return e.into();
    }
    for (i, a) in args.iter().enumerate() {
        if let Some(v) = a.strip_prefix("--data-dir=") {
            return v.into();
        }
        if a == "--data-dir"
            && let Some(v) = args.get(i + 1)
        {
            return v.into();
        }
    }
    PathBuf::from("/var/lib/ferrovirt")
}

/// Run the storage controllers until one fails or the future is dropped.
pub async fn run(
    client: kube::Client,
    opts: StorageOptions,
    stores: crate::runtime::stores::Stores,
) -> Result<(), ControllerError> {
    let args: Vec<String> = std::env::args().collect();
    let data_dir = resolve_data_dir(
        opts.data_dir.as_deref(),
        std::env::var(DATA_DIR_ENV).ok(),
        &args,
    );
    let dirs = Dirs::under(&data_dir);
    tracing::info!(shared = %dirs.shared.display(), "storage controllers starting");
    loop {
        match classes::ensure(&client).await {
            Ok(()) => break,
            Err(e) => {
                tracing::warn!(error = %e, "creating the built-in StorageClasses failed");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
    // One task each (a JoinSet: dropping this future aborts them), so that a loop woken by
    // a change does not poll the others; the first to fail ends them all.
    let mut loops = tokio::task::JoinSet::new();
    loops.spawn(pvc_loop::run(
        client.clone(),
        dirs.clone(),
        opts.agent_token.clone(),
        stores.clone(),
    ));
    loops.spawn(pvc_loop::reclaim_loop(
        client.clone(),
        dirs.clone(),
        opts.agent_token.clone(),
        opts.resync,
        stores.clone(),
    ));
    loops.spawn(dv_loop::run(
        client.clone(),
        dirs,
        opts.clone(),
        stores.clone(),
    ));
    loops.spawn(datasource::run(client.clone()));
    loops.spawn(protection::run(client.clone(), stores));
    while let Some(done) = loops.join_next().await {
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(e) => {
                return Err(ControllerError::TaskStopped {
                    name: "storage",
                    reason: e.to_string(),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_dir_resolution() {
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            resolve_data_dir(Some(Path::new("/o")), Some("/e".into()), &[]),
            PathBuf::from("/o")
        );
        assert_eq!(
            resolve_data_dir(None, Some("/e".into()), &[]),
            PathBuf::from("/e")
        );
        assert_eq!(
            resolve_data_dir(None, None, &args(&["fv", "server", "--data-dir", "/d"])),
            PathBuf::from("/d")
        );
        assert_eq!(
            resolve_data_dir(None, None, &args(&["fv", "--data-dir=/x"])),
            PathBuf::from("/x")
        );
        assert_eq!(
            resolve_data_dir(None, None, &args(&["fv"])),
            PathBuf::from("/var/lib/ferrovirt")
        );
    }

    #[test]
    fn only_paths_inside_roots_are_owned() {
        let d = Dirs::under(Path::new("/data"));
        assert!(d.owns(Path::new("/data/volumes/pvc-1")));
        assert!(!d.owns(Path::new("/data/local-volumes/n1/pvc-1")));
        assert!(!d.owns(Path::new("/data/agent/volumes/pvc-1")));
        assert!(!d.owns(Path::new("/data/volumes")));
        assert!(!d.owns(Path::new("/data/volumes/../token")));
        assert!(!d.owns(Path::new("/etc")));
        assert!(!d.owns(Path::new("/mnt/vmstore/volumes/pvc-1")));
        let class: k8s_openapi::api::storage::v1::StorageClass =
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "vmstore"}, "provisioner": classes::PROVISIONER_SHARED,
                "parameters": {ferrovirt_api::shared_mount::MOUNT_PARAMETER: "/mnt/vmstore"}
            }))
            .unwrap();
        let d = d.with_classes(&[class]);
        assert!(d.owns(Path::new("/mnt/vmstore/volumes/pvc-1")));
        assert!(!d.owns(Path::new("/mnt/vmstore/volumes")));
        assert!(!d.owns(Path::new("/mnt/vmstore/.ferrovirt-class-vmstore")));
    }
}
