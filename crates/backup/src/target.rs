//! Where a repository lives: an S3 bucket (any S3-protocol server: endpoint, bucket, prefix,
//! region, credentials, path-style, CA bundle) or a filesystem directory (e.g. an NFS mount),
//! both through the maintained `object_store` crate.

use std::sync::Arc;

use object_store::ObjectStore;
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::{Certificate, ClientOptions};

use std::collections::BTreeMap;

use ferrovirt_api::backup::{ACCESS_KEY_ID, BackupTargetSpec, SECRET_ACCESS_KEY, SESSION_TOKEN};

use crate::BackupError;

/// S3 settings (BackupTarget `spec.s3`, credentials already read from their Secret).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct S3Target {
    /// `http(s)://host:port`; empty for AWS itself.
    pub endpoint: String,
    pub bucket: String,
    pub region: String,
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
    /// Path-style URLs (`endpoint/bucket/key`), as most non-AWS servers want.
    pub path_style: bool,
    /// PEM bundle of the CAs to trust for `https` endpoints (added to the system roots).
    pub ca_bundle: Option<String>,
}

/// A repository's location.
#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    S3 {
        s3: S3Target,
        prefix: String,
    },
    Filesystem {
        path: std::path::PathBuf,
        prefix: String,
    },
}

impl Target {
    /// The object-name prefix inside the bucket or directory.
    pub fn prefix(&self) -> &str {
        match self {
            Target::S3 { prefix, .. } | Target::Filesystem { prefix, .. } => prefix,
        }
    }
}

/// A prefix: `/`-separated segments of `[A-Za-z0-9._-]`, none `.` or `..`.
pub fn check_prefix(prefix: &str) -> Result<(), BackupError> {
    let p = prefix.trim_matches('/');
    if p.is_empty() {
        return Ok(());
    }
    let ok = p.split('/').all(|seg| {
        !seg.is_empty()
            && seg != "."
            && seg != ".."
            && seg
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    });
    if ok {
        Ok(())
    } else {
        Err(BackupError::InvalidName {
            what: "prefix",
            name: prefix.to_string(),
        })
    }
}

/// The repository target of a BackupTarget; `creds` is the data of its credentials Secret
/// (S3 only). An error names the missing or bad field.
pub fn from_spec(
    spec: &BackupTargetSpec,
    creds: Option<&BTreeMap<String, Vec<u8>>>,
) -> Result<Target, String> {
    if let Some(fs) = &spec.filesystem {
        return Ok(Target::Filesystem {
            path: fs.path.clone().into(),
            prefix: fs.prefix.clone().unwrap_or_default(),
        });
    }
    let Some(s3) = &spec.s3 else {
        return Err("spec: neither s3 nor filesystem is set".into());
    };
    let get = |k: &str| -> Option<String> {
        creds
            .and_then(|c| c.get(k))
            .map(|b| String::from_utf8_lossy(b).trim().to_string())
    };
    let need = |k: &str| {
        get(k).filter(|v| !v.is_empty()).ok_or_else(|| {
            format!(
                "credentials Secret {}/{} has no key {k:?}",
                s3.credentials_secret_ref.namespace, s3.credentials_secret_ref.name
            )
        })
    };
    Ok(Target::S3 {
        s3: S3Target {
            endpoint: s3.endpoint.clone().unwrap_or_default(),
            bucket: s3.bucket.clone(),
            region: s3.region.clone().unwrap_or_default(),
            access_key_id: need(ACCESS_KEY_ID)?,
            secret_access_key: need(SECRET_ACCESS_KEY)?,
            session_token: get(SESSION_TOKEN).filter(|t| !t.is_empty()),
            path_style: s3.path_style,
            ca_bundle: s3.ca_bundle.clone(),
        },
        prefix: s3.prefix.clone().unwrap_or_default(),
    })
}

/// Builds the object store of a target. A filesystem target's directory must exist (a missing
/// NFS mount must not be silently replaced by a local directory).
pub fn open_store(target: &Target) -> Result<Arc<dyn ObjectStore>, BackupError> {
    check_prefix(target.prefix())?;
    match target {
        Target::Filesystem { path, .. } => {
            if !path.is_dir() {
                return Err(BackupError::Target(format!(
                    "filesystem target {} is not a directory",
                    path.display()
                )));
            }
            let fs = LocalFileSystem::new_with_prefix(path)
                .map_err(|e| BackupError::Target(e.to_string()))?;
            Ok(Arc::new(fs))
        }
        Target::S3 { s3, .. } => {
            if s3.bucket.is_empty() {
                return Err(BackupError::Target("s3 bucket is empty".into()));
            }
            let mut client = ClientOptions::new()
                .with_allow_http(s3.endpoint.starts_with("http://"))
                .with_timeout(std::time::Duration::from_secs(300));
            if let Some(pem) = &s3.ca_bundle {
                let certs = Certificate::from_pem_bundle(pem.as_bytes())
                    .map_err(|e| BackupError::Target(format!("s3 CA bundle: {e}")))?;
                for c in certs {
                    client = client.with_root_certificate(c);
                }
            }
            let mut b = AmazonS3Builder::new()
                .with_bucket_name(&s3.bucket)
                .with_region(if s3.region.is_empty() {
                    "us-east-1"
                } else {
                    &s3.region
                })
                .with_access_key_id(&s3.access_key_id)
                .with_secret_access_key(&s3.secret_access_key)
                .with_virtual_hosted_style_request(!s3.path_style)
                .with_client_options(client);
            if !s3.endpoint.is_empty() {
                b = b.with_endpoint(&s3.endpoint);
            }
            if let Some(t) = &s3.session_token {
                b = b.with_token(t);
            }
            Ok(Arc::new(
                b.build().map_err(|e| BackupError::Target(e.to_string()))?,
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes() {
        assert!(check_prefix("").is_ok());
        assert!(check_prefix("cluster-a/vms").is_ok());
        for bad in ["../x", "a/../b", "a//b", "a b", "a/./b"] {
            assert!(check_prefix(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn missing_directory_is_refused() {
        let t = Target::Filesystem {
            path: "/nonexistent/ferrovirt-backup".into(),
            prefix: String::new(),
        };
        let err = open_store(&t).unwrap_err().to_string();
        assert!(err.contains("not a directory"), "{err}");
    }
}
