//! Disk images from OCI registries, as KubeVirt containerDisks lay them out: the one file
//! under `/disk/` of a container image (qcow2 or raw, any name).
//!
//! - [`reference`]: image references and the insecure-registry list (pure);
//! - [`manifest`]: OCI / Docker manifests and indexes, platform choice, digests (pure);
//! - [`auth`]: `WWW-Authenticate` challenges, tokens, `.dockerconfigjson` credentials (pure);
//! - [`client`]: the distribution API client (manifests, blobs with verified digests,
//!   Basic and Bearer authentication, HTTP only for insecure registries, rustls otherwise);
//! - [`extract`]: `/disk/*` out of untrusted tar layers, bounded;
//! - [`cache`]: the node's content-addressed cache of pulled disks (containerDisk volumes).
//!
//! [`pull_disk`] downloads the layers of a resolved image and extracts its disk;
//! [`import`] is the DataVolume `registry` source: pull, then the importer's checks
//! ([`importer::inspect`]: no backing file, not corrupt, not larger than the claim) and
//! conversion to raw.

pub mod auth;
pub mod cache;
pub mod client;
pub mod extract;
pub mod manifest;
pub mod reference;

use std::path::{Path, PathBuf};

pub use client::{ClientOptions, RegistryClient, ResolvedImage};
pub use reference::ImageRef;

use crate::error::StorageError;
use crate::importer::{self, DOWNLOAD_SHARE};
use crate::qemu_img::ImageInfo;

/// Downloads every layer of `image` into `scratch` (each verified, at most `max_bytes`),
/// applies them in order and returns the name and staged path of the file under `/disk/`.
/// `progress(percent)` covers the download (0–100 of the layers' total size).
pub async fn pull_disk(
    client: &RegistryClient,
    image: &ResolvedImage,
    scratch: &Path,
    max_bytes: u64,
    mut progress: impl FnMut(f64) + Send,
) -> Result<(String, PathBuf), StorageError> {
    let layers = manifest::disk_layers(&image.manifest, max_bytes)?.to_vec();
    let total: u64 = layers.iter().map(|l| l.size).sum::<u64>().max(1);
    let mut files = extract::DiskFiles::new(&scratch.join("disk"))?;
    let mut done = 0u64;
    for (i, layer) in layers.iter().enumerate() {
        let blob = scratch.join(format!("layer-{i}"));
        client
            .fetch_blob(layer, &blob, max_bytes, |n| {
                progress(((done + n) as f64 / total as f64 * 100.0).min(100.0))
            })
            .await?;
        done += layer.size;
        let mut staged = files;
        files = tokio::task::spawn_blocking(move || {
            let r = staged.apply_layer(&blob, max_bytes);
            let _ = std::fs::remove_file(&blob);
            r.map(|()| staged)
        })
        .await
        .map_err(|e| StorageError::Tool {
            tool: "layer extraction".into(),
            message: e.to_string(),
        })??;
    }
    progress(100.0);
    files.into_disk()
}

/// A DataVolume `registry` import.
#[derive(Debug, Clone)]
pub struct RegistryImportRequest {
    pub image: ImageRef,
    pub client: ClientOptions,
    /// A private directory for layers and the extracted disk (removed after).
    pub scratch_dir: PathBuf,
    /// The volume's image file (`<volume>/disk.img`).
    pub target: PathBuf,
    /// The claim's size in bytes.
    pub capacity: u64,
}

/// The bound on layers and the extracted disk for a claim of `capacity` bytes (a qcow2 file
/// may be somewhat larger than its virtual size; a raw one is at most the claim).
pub fn import_limit(capacity: u64) -> u64 {
    capacity.saturating_mul(2).saturating_add(64 << 20)
}

/// Pulls `req.image`, validates its disk like any import (no backing file, format known,
/// virtual size within the claim) and converts it to raw into `req.target`. Progress: the
/// download is 0–50 %, the conversion 50–100 %.
pub async fn import(
    req: &RegistryImportRequest,
    mut progress: impl FnMut(f64) + Send,
) -> Result<ImageInfo, StorageError> {
    let scratch = &req.scratch_dir;
    let _ = std::fs::remove_dir_all(scratch);
    std::fs::create_dir_all(scratch).map_err(|e| StorageError::io(scratch, e))?;
    let result = async {
        let client = RegistryClient::new(&req.image, &req.client)?;
        let resolved = client.resolve().await?;
        let (_, disk) = pull_disk(
            &client,
            &resolved,
            scratch,
            import_limit(req.capacity),
            |p| progress(p * DOWNLOAD_SHARE / 100.0),
        )
        .await?;
        progress(DOWNLOAD_SHARE);
        let info = importer::inspect(&disk, req.capacity).await?;
        importer::write_raw(&disk, &info.format, &req.target, req.capacity, |p| {
            progress(importer::convert_progress(p))
        })
        .await?;
        Ok(info)
    }
    .await;
    let _ = std::fs::remove_dir_all(scratch);
    result
}
