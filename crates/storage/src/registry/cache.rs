//! A node's cache of containerDisk images: each pulled disk is stored once, by the digest of
//! its image manifest (`<root>/sha256/<hex>/disk`, read-only, with `info.json`), and image
//! references point at digests (`<root>/refs/<encoded reference>`). Pulls of one reference
//! are serialised, so VMIs starting together share one pull; a finished pull appears
//! atomically (staged in `<root>/tmp/`, then renamed). Every disk passes the importer's checks
//! ([`crate::importer::inspect`]: known format, no backing file, not corrupt) before it is
//! cached.
//! [`pull_policy`] is Kubernetes' `imagePullPolicy` (pure).
//!
//! **Who may use a cached image.** Each cached disk records who was seen to have access to it
//! (`pulledBy`: [`access_fingerprint`]s — `anonymous`, or a SHA-256 of the registry and the
//! credentials that resolved it). A use with credentials not recorded (another namespace's
//! VMI without the pull secret, or with other credentials) never takes the cached copy on
//! trust: under `IfNotPresent` the registry is asked with the VMI's own credentials first (a
//! refusal fails the pull; the same digest adds the fingerprint and downloads nothing), and
//! under `Never` it is refused — what Kubernetes' "ensure secret pulled images" does for
//! private images on a shared node. An image pulled anonymously is public to every use.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::client::{ClientOptions, RegistryClient};
use super::reference::{self, ImageRef};
use crate::error::StorageError;

/// Kubernetes' `imagePullPolicy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullPolicy {
    /// Ask the registry every time (the digest decides whether anything is downloaded).
    Always,
    /// Use the cached image of this reference when there is one.
    IfNotPresent,
    /// Never pull: the image must be cached already.
    Never,
}

/// The policy for `image`: as given, else `Always` for `:latest` (or untagged) images and
/// `IfNotPresent` otherwise, as Kubernetes defaults it.
pub fn pull_policy(given: Option<&str>, image: &ImageRef) -> Result<PullPolicy, StorageError> {
    match given.map(str::trim).filter(|s| !s.is_empty()) {
        Some("Always") => Ok(PullPolicy::Always),
        Some("IfNotPresent") => Ok(PullPolicy::IfNotPresent),
        Some("Never") => Ok(PullPolicy::Never),
        Some(other) => Err(StorageError::invalid(
            "imagePullPolicy",
            format!("{other:?} is not one of Always, IfNotPresent, Never"),
        )),
        None if image.is_latest() => Ok(PullPolicy::Always),
        None => Ok(PullPolicy::IfNotPresent),
    }
}

/// What is recorded about a cached disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CachedInfo {
    /// The image it was pulled as.
    pub image: String,
    /// The manifest digest.
    pub digest: String,
    /// The file name under `/disk/` in the image.
    pub file_name: String,
    /// `qcow2` or `raw` (as `qemu-img info` detected it).
    pub format: String,
    pub virtual_size: u64,
    /// The [`access_fingerprint`]s seen to have access (a record from before this field:
    /// empty, so the first use verifies).
    #[serde(default)]
    pub pulled_by: BTreeSet<String>,
}

/// The fingerprint of anonymous access.
pub const ANONYMOUS: &str = "anonymous";

/// Who asks for an image (pure): [`ANONYMOUS`] without credentials, else the SHA-256 of the
/// registry, user and password (never the secret itself).
pub fn access_fingerprint(registry: &str, auth: Option<&crate::http::BasicAuth>) -> String {
    let Some(a) = auth else {
        return ANONYMOUS.to_string();
    };
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    for part in [registry, &a.user, &a.password] {
        ctx.update(part.as_bytes());
        ctx.update(&[0]);
    }
    let d = ctx.finish();
    let hex: String = d.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// Whether a cached disk may be used by `who` without asking the registry (pure).
pub fn may_use(info: &CachedInfo, who: &str) -> bool {
    info.pulled_by.contains(ANONYMOUS) || info.pulled_by.contains(who)
}

/// A disk in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedDisk {
    /// The read-only disk file (the backing file of VMI overlays).
    pub path: PathBuf,
    pub info: CachedInfo,
    /// Whether this call downloaded it.
    pub pulled: bool,
}

/// The cache under one directory.
#[derive(Debug)]
pub struct ImageCache {
    root: PathBuf,
    /// Bound on each layer and on the disk file.
    max_bytes: u64,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// The file name of a reference in `refs/` (reversible, no `/`).
pub fn ref_file_name(image: &ImageRef) -> String {
    // Lower-case letters, digits and `.-_` stay; everything else, upper-case letters
    // included (case-insensitive filesystems), is escaped.
    const KEPT: &percent_encoding::AsciiSet = &{
        let mut set = percent_encoding::NON_ALPHANUMERIC
            .remove(b'.')
            .remove(b'-')
            .remove(b'_');
        let mut c = b'A';
        while c <= b'Z' {
            set = set.add(c);
            c += 1;
        }
        set
    };
    percent_encoding::utf8_percent_encode(&image.to_string(), KEPT).to_string()
}

fn write_atomic(path: &Path, data: &[u8]) -> Result<(), StorageError> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, data).map_err(|e| StorageError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| StorageError::io(path, e))
}

impl ImageCache {
    /// A cache in `root` (created on first use); layers and disks larger than `max_bytes`
    /// are refused.
    pub fn new(root: impl Into<PathBuf>, max_bytes: u64) -> Self {
        ImageCache {
            root: root.into(),
            max_bytes,
            locks: Mutex::new(HashMap::new()),
        }
    }

    /// The cache directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn digest_dir(&self, digest: &str) -> Option<PathBuf> {
        let hex = digest.strip_prefix("sha256:")?;
        reference::valid_digest(digest).then(|| self.root.join("sha256").join(hex))
    }

    /// The cached disk of `digest`, if complete.
    pub fn by_digest(&self, digest: &str) -> Option<CachedDisk> {
        let dir = self.digest_dir(digest)?;
        let info: CachedInfo =
            serde_json::from_slice(&std::fs::read(dir.join("info.json")).ok()?).ok()?;
        let path = dir.join("disk");
        path.is_file().then_some(CachedDisk {
            path,
            info,
            pulled: false,
        })
    }

    /// The cached disk `image` was last resolved to, if any.
    pub fn lookup(&self, image: &ImageRef) -> Option<CachedDisk> {
        if let Some(d) = &image.digest {
            return self.by_digest(d);
        }
        let f = self.root.join("refs").join(ref_file_name(image));
        let digest = std::fs::read_to_string(f).ok()?;
        self.by_digest(digest.trim())
    }

    fn remember(&self, image: &ImageRef, digest: &str) -> Result<(), StorageError> {
        let refs = self.root.join("refs");
        std::fs::create_dir_all(&refs).map_err(|e| StorageError::io(&refs, e))?;
        write_atomic(&refs.join(ref_file_name(image)), digest.as_bytes())
    }

    fn lock_for(&self, image: &ImageRef) -> Arc<tokio::sync::Mutex<()>> {
        self.locks
            .lock()
            .expect("lock")
            .entry(image.to_string())
            .or_default()
            .clone()
    }

    /// The disk of `image` under `policy`: from the cache, or pulled (and validated) into it.
    pub async fn ensure(
        &self,
        image: &ImageRef,
        policy: PullPolicy,
        opts: &ClientOptions,
    ) -> Result<CachedDisk, StorageError> {
        let lock = self.lock_for(image);
        let _guard = lock.lock().await;
        let who = access_fingerprint(&image.registry, opts.auth.as_ref());
        if policy != PullPolicy::Always
            && let Some(c) = self.lookup(image)
        {
            if may_use(&c.info, &who) {
                return Ok(c);
            }
            if policy == PullPolicy::Never {
                return Err(StorageError::Refused(format!(
                    "image {image} is on this node, but was pulled with other credentials than \
                     this VMI's: imagePullPolicy Never cannot check its access to it (use \
                     IfNotPresent or Always)"
                )));
            }
            // Not taken on trust: the registry decides below, with this VMI's credentials.
        }
        if policy == PullPolicy::Never {
            return Err(StorageError::Refused(format!(
                "image {image} is not present on this node and imagePullPolicy is Never"
            )));
        }
        let client = RegistryClient::new(image, opts)?;
        let resolved = client.resolve().await?;
        if let Some(mut c) = self.by_digest(&resolved.digest) {
            self.remember(image, &resolved.digest)?;
            if c.info.pulled_by.insert(who) {
                self.record_info(&resolved.digest, &c.info)?;
            }
            return Ok(c);
        }
        let final_dir = self
            .digest_dir(&resolved.digest)
            .ok_or_else(|| StorageError::invalid("manifest digest", resolved.digest.clone()))?;
        let tmp_root = self.root.join("tmp");
        std::fs::create_dir_all(&tmp_root).map_err(|e| StorageError::io(&tmp_root, e))?;
        // Unique per pull: two references of one digest may be pulled at the same time.
        static PULLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let staging = tmp_root.join(format!(
            "{}-{}-{}",
            resolved.digest.trim_start_matches("sha256:"),
            std::process::id(),
            PULLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging).map_err(|e| StorageError::io(&staging, e))?;
        let result = self
            .pull_into(&client, image, &resolved, &staging, &final_dir, &who)
            .await;
        let _ = std::fs::remove_dir_all(&staging);
        result?;
        self.remember(image, &resolved.digest)?;
        let mut c = self.by_digest(&resolved.digest).ok_or_else(|| {
            StorageError::io(&final_dir, std::io::Error::other("cached disk vanished"))
        })?;
        c.pulled = true;
        Ok(c)
    }

    async fn pull_into(
        &self,
        client: &RegistryClient,
        image: &ImageRef,
        resolved: &super::ResolvedImage,
        staging: &Path,
        final_dir: &Path,
        who: &str,
    ) -> Result<(), StorageError> {
        let (file_name, disk) =
            super::pull_disk(client, resolved, staging, self.max_bytes, |_| {}).await?;
        let info = crate::importer::inspect(&disk, u64::MAX).await?;
        let out = staging.join("out");
        std::fs::create_dir_all(&out).map_err(|e| StorageError::io(&out, e))?;
        let cached = out.join("disk");
        std::fs::rename(&disk, &cached).map_err(|e| StorageError::io(&cached, e))?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&cached, std::fs::Permissions::from_mode(0o444))
                .map_err(|e| StorageError::io(&cached, e))?;
        }
        let record = CachedInfo {
            image: image.to_string(),
            digest: resolved.digest.clone(),
            file_name,
            format: info.format.clone(),
            virtual_size: info.virtual_size,
            pulled_by: [who.to_string()].into(),
        };
        let json = serde_json::to_vec_pretty(&record).expect("serialisable");
        std::fs::write(out.join("info.json"), json)
            .map_err(|e| StorageError::io(out.join("info.json"), e))?;
        if let Some(parent) = final_dir.parent() {
            std::fs::create_dir_all(parent).map_err(|e| StorageError::io(parent, e))?;
        }
        match std::fs::rename(&out, final_dir) {
            Ok(()) => Ok(()),
            // Another pull of the same digest (under another reference) won the race: this
            // pull's access is recorded beside it.
            Err(_) if final_dir.join("info.json").is_file() => {
                match self.by_digest(&resolved.digest) {
                    Some(mut c) => {
                        if c.info.pulled_by.insert(who.to_string()) {
                            self.record_info(&resolved.digest, &c.info)?;
                        }
                        Ok(())
                    }
                    None => Ok(()),
                }
            }
            Err(e) => Err(StorageError::io(final_dir, e)),
        }
    }

    /// Rewrites the `info.json` of a cached digest (its access record grew).
    fn record_info(&self, digest: &str, info: &CachedInfo) -> Result<(), StorageError> {
        let dir = self
            .digest_dir(digest)
            .ok_or_else(|| StorageError::invalid("manifest digest", digest.to_string()))?;
        let json = serde_json::to_vec_pretty(info).expect("serialisable");
        write_atomic(&dir.join("info.json"), &json)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn img(s: &str) -> ImageRef {
        reference::parse("image", s).unwrap()
    }

    #[test]
    fn pull_policy_defaults_like_kubernetes() {
        assert_eq!(
            pull_policy(None, &img("r:5000/a")).unwrap(),
            PullPolicy::Always
        );
        assert_eq!(
            pull_policy(None, &img("r:5000/a:latest")).unwrap(),
            PullPolicy::Always
        );
        assert_eq!(
            pull_policy(None, &img("r:5000/a:v1")).unwrap(),
            PullPolicy::IfNotPresent
        );
        assert_eq!(
            pull_policy(Some("Never"), &img("r:5000/a")).unwrap(),
            PullPolicy::Never
        );
        let e = pull_policy(Some("Sometimes"), &img("r/a")).unwrap_err();
        assert!(e.to_string().contains("imagePullPolicy"), "{e}");
    }

    #[test]
    fn lookups_follow_refs_to_complete_digest_dirs() {
        let d = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(d.path(), 1 << 30);
        let image = img("127.0.0.1:5000/fv/guest:v1");
        assert_eq!(ref_file_name(&image), "127.0.0.1%3A5000%2Ffv%2Fguest%3Av1");
        // Upper case is escaped too: tags differing in case never share a file.
        assert_eq!(
            ref_file_name(&img("127.0.0.1:5000/fv/guest:V1")),
            "127.0.0.1%3A5000%2Ffv%2Fguest%3A%561"
        );
        assert!(cache.lookup(&image).is_none());
        let digest = format!("sha256:{}", "ab".repeat(32));
        cache.remember(&image, &digest).unwrap();
        assert!(cache.lookup(&image).is_none(), "no disk yet");
        let dir = cache.digest_dir(&digest).unwrap();
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("disk"), b"x").unwrap();
        let info = CachedInfo {
            image: image.to_string(),
            digest: digest.clone(),
            file_name: "d.qcow2".into(),
            format: "qcow2".into(),
            virtual_size: 1,
            pulled_by: [ANONYMOUS.to_string()].into(),
        };
        std::fs::write(dir.join("info.json"), serde_json::to_vec(&info).unwrap()).unwrap();
        let c = cache.lookup(&image).unwrap();
        assert_eq!(c.info, info);
        assert_eq!(c.path, dir.join("disk"));
        assert!(cache.by_digest("sha256:../../etc").is_none());
    }

    #[tokio::test]
    async fn never_policy_needs_a_cached_image() {
        let d = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(d.path(), 1 << 30);
        let e = cache
            .ensure(
                &img("127.0.0.1:1/a:v1"),
                PullPolicy::Never,
                &ClientOptions::default(),
            )
            .await
            .unwrap_err();
        assert!(e.to_string().contains("imagePullPolicy is Never"), "{e}");
    }

    #[test]
    fn access_fingerprints_and_who_may_use_a_cached_disk() {
        use crate::http::BasicAuth;
        let a = |u: &str, p: &str| BasicAuth {
            user: u.into(),
            password: p.into(),
        };
        let fv = access_fingerprint("r:5000", Some(&a("fv", "pw")));
        assert!(fv.starts_with("sha256:") && !fv.contains("pw"), "{fv}");
        assert_eq!(fv, access_fingerprint("r:5000", Some(&a("fv", "pw"))));
        assert_ne!(fv, access_fingerprint("r:5000", Some(&a("fv", "other"))));
        assert_ne!(fv, access_fingerprint("r:5001", Some(&a("fv", "pw"))));
        assert_eq!(access_fingerprint("r:5000", None), ANONYMOUS);
        let mut info = CachedInfo {
            image: "r:5000/a:v1".into(),
            digest: format!("sha256:{}", "ab".repeat(32)),
            file_name: "d".into(),
            format: "raw".into(),
            virtual_size: 1,
            pulled_by: [fv.clone()].into(),
        };
        assert!(may_use(&info, &fv));
        assert!(!may_use(&info, ANONYMOUS));
        assert!(!may_use(
            &info,
            &access_fingerprint("r:5000", Some(&a("x", "y")))
        ));
        info.pulled_by.insert(ANONYMOUS.into());
        assert!(may_use(
            &info,
            &access_fingerprint("r:5000", Some(&a("x", "y")))
        ));
        // A record from before the field: nobody is trusted until verified.
        let old: CachedInfo = serde_json::from_value(serde_json::json!({"image": "i",
            "digest": "d", "fileName": "f", "format": "raw", "virtualSize": 1}))
        .unwrap();
        assert!(!may_use(&old, ANONYMOUS));
    }
}
