//! Credentials in the data dir: a self-signed CA, a serving certificate signed by it (SANs
//! 127.0.0.1, ::1, localhost, the host name and any extras), the admin bearer token and
//! `kubeconfig.yaml`. Created on first start, reused afterwards; also the rustls server config.

use std::io::Write;
use std::path::{Path, PathBuf};

use base64::Engine;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

use crate::error::ServerError;

/// The server's credentials.
#[derive(Debug, Clone)]
pub struct Pki {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
    pub token: String,
}

fn tls_err(e: impl std::fmt::Display) -> ServerError {
    ServerError::Tls(e.to_string())
}

fn read_opt(path: &Path) -> Result<Option<String>, ServerError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ServerError::io(path.display(), e)),
    }
}

/// Creates `dir` (and its parents) when missing and makes it private to its owner (0700),
/// tightening an existing directory that was more open.
pub fn private_dir(dir: &Path) -> Result<(), ServerError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| ServerError::io(dir.display(), e))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| ServerError::io(dir.display(), e))
}

/// Makes an existing file readable by its owner only (0600); a missing file is fine.
pub fn private_file(path: &Path) -> Result<(), ServerError> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(ServerError::io(path.display(), e))
        }
        _ => Ok(()),
    }
}

/// Writes a file readable by its owner only: a fresh 0600 temporary file renamed over `path`,
/// so the secret is never readable by others, not even for a moment, and never half-written.
pub(crate) fn write_private(path: &Path, contents: &str) -> Result<(), ServerError> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    // A leftover temporary file could have any mode: start from a new one.
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| ServerError::io(tmp.display(), e))?;
    f.write_all(contents.as_bytes())
        .and_then(|_| f.sync_all())
        .map_err(|e| ServerError::io(tmp.display(), e))?;
    std::fs::rename(&tmp, path).map_err(|e| ServerError::io(path.display(), e))
}

fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

fn new_token() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

fn generate(sans: Vec<String>) -> Result<(String, String, String), ServerError> {
    let ca_key = KeyPair::generate().map_err(tls_err)?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(tls_err)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "ferrovirt-ca");
    ca.distinguished_name = dn;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca.not_after = rcgen::date_time_ymd(2125, 1, 1);
    let ca_cert = ca.self_signed(&ca_key).map_err(tls_err)?;
    let issuer = Issuer::new(ca, ca_key);

    let key = KeyPair::generate().map_err(tls_err)?;
    let mut params = CertificateParams::new(sans).map_err(tls_err)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "ferrovirt-apiserver");
    params.distinguished_name = dn;
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.not_after = rcgen::date_time_ymd(2125, 1, 1);
    let cert = params.signed_by(&key, &issuer).map_err(tls_err)?;
    Ok((ca_cert.pem(), cert.pem(), key.serialize_pem()))
}

/// Loads the credentials from `data_dir`, creating what is missing.
pub fn load_or_create(data_dir: &Path, extra_sans: &[String]) -> Result<Pki, ServerError> {
    let dir = data_dir.join("tls");
    private_dir(&dir)?;
    let (ca_p, cert_p, key_p) = (
        dir.join("ca.crt"),
        dir.join("serving.crt"),
        dir.join("serving.key"),
    );
    let token_p = data_dir.join("token");
    // Files from older versions may have been written with a wider mode.
    for p in [&ca_p, &cert_p, &key_p, &token_p] {
        private_file(p)?;
    }
    let token = match read_opt(&token_p)?.map(|t| t.trim().to_string()) {
        Some(t) if !t.is_empty() => t,
        _ => {
            let t = new_token();
            write_private(&token_p, &t)?;
            t
        }
    };
    if let (Some(ca_pem), Some(cert_pem), Some(key_pem)) =
        (read_opt(&ca_p)?, read_opt(&cert_p)?, read_opt(&key_p)?)
    {
        return Ok(Pki {
            ca_pem,
            cert_pem,
            key_pem,
            token,
        });
    }
    let mut sans = vec!["127.0.0.1".to_string(), "::1".into(), "localhost".into()];
    sans.extend(hostname());
    for s in extra_sans {
        if !sans.contains(s) {
            sans.push(s.clone());
        }
    }
    let (ca_pem, cert_pem, key_pem) = generate(sans)?;
    write_private(&key_p, &key_pem)?;
    write_private(&cert_p, &cert_pem)?;
    write_private(&ca_p, &ca_pem)?;
    Ok(Pki {
        ca_pem,
        cert_pem,
        key_pem,
        token,
    })
}

/// The DER payloads of every PEM block labelled `label`.
pub(crate) fn pem_blocks(pem: &str, label: &str) -> Vec<Vec<u8>> {
    let (begin, end) = (
        format!("-----BEGIN {label}-----"),
        format!("-----END {label}-----"),
    );
    let mut out = Vec::new();
    let mut rest = pem;
    while let Some(start) = rest.find(&begin) {
        let after = &rest[start + begin.len()..];
        let Some(stop) = after.find(&end) else { break };
        let b64: String = after[..stop]
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        if let Ok(der) = base64::engine::general_purpose::STANDARD.decode(b64) {
            out.push(der);
        }
        rest = &after[stop + end.len()..];
    }
    out
}

/// Writes `DATA_DIR/kubeconfig.yaml` for `server_url` (e.g. `https://127.0.0.1:6443`).
pub fn write_kubeconfig(
    data_dir: &Path,
    server_url: &str,
    pki: &Pki,
) -> Result<PathBuf, ServerError> {
    let ca = base64::engine::general_purpose::STANDARD.encode(pki.ca_pem.as_bytes());
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: ferrovirt\n  cluster:\n    server: {server_url}\n    certificate-authority-data: {ca}\ncontexts:\n- name: ferrovirt\n  context:\n    cluster: ferrovirt\n    user: admin\n    namespace: default\ncurrent-context: ferrovirt\nusers:\n- name: admin\n  user:\n    token: {}\n",
        pki.token
    );
    let path = data_dir.join("kubeconfig.yaml");
    write_private(&path, &text)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_then_reuse() {
        let dir = tempfile::tempdir().unwrap();
        let a = load_or_create(dir.path(), &["example.test".into()]).unwrap();
        let b = load_or_create(dir.path(), &[]).unwrap();
        assert_eq!((a.token.clone(), a.ca_pem.clone()), (b.token, b.ca_pem));
        assert_eq!(pem_blocks(&a.cert_pem, "CERTIFICATE").len(), 1);
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir.path().join("tls")), 0o700);
        assert_eq!(mode(&dir.path().join("tls/serving.key")), 0o600);
        assert_eq!(mode(&dir.path().join("token")), 0o600);
        let p = write_kubeconfig(dir.path(), "https://127.0.0.1:1", &a).unwrap();
        assert!(std::fs::read_to_string(p).unwrap().contains(&a.token));
    }
}
