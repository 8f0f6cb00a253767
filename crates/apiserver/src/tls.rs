//! Credentials in the data dir: a self-signed CA (its key kept in `tls/ca.key`), a serving
//! certificate signed by it (SANs 127.0.0.1, ::1, localhost, the host name and any extras,
//! such as the listen address), the admin bearer token and `kubeconfig.yaml`. Created on first
//! start, reused afterwards (the serving certificate re-signed when its SANs or CA change);
//! also the rustls server config.

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
pub(crate) fn write_private(path: &Path, contents: impl AsRef<[u8]>) -> Result<(), ServerError> {
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
    f.write_all(contents.as_ref())
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

fn ca_params() -> Result<CertificateParams, ServerError> {
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
    Ok(ca)
}

/// A new serving CA: (certificate PEM, key PEM).
fn generate_ca() -> Result<(String, String), ServerError> {
    let ca_key = KeyPair::generate().map_err(tls_err)?;
    let ca_cert = ca_params()?.self_signed(&ca_key).map_err(tls_err)?;
    Ok((ca_cert.pem(), ca_key.serialize_pem()))
}

/// A serving certificate for `sans` signed by the CA key `ca_key_pem`: (cert PEM, key PEM).
fn sign_serving(sans: Vec<String>, ca_key_pem: &str) -> Result<(String, String), ServerError> {
    let issuer = Issuer::new(
        ca_params()?,
        KeyPair::from_pem(ca_key_pem).map_err(tls_err)?,
    );
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
    Ok((cert.pem(), key.serialize_pem()))
}

/// What the serving certificate was made for (`tls/serving.for`): its SANs and its CA, so
/// that a new listen address or a CA loaded from the cluster's bootstrap data re-signs it.
fn serving_stamp(sans: &[String], ca_pem: &str) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, ca_pem.as_bytes());
    let hex: String = d.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("ca {hex}\nsans {}\n", sans.join(","))
}

/// Loads the credentials from `data_dir`, creating what is missing. The serving CA's key is
/// kept (`tls/ca.key`) so that servers sharing the CA sign their own serving certificates:
/// the certificate is re-signed whenever its SANs (127.0.0.1, ::1, localhost, the host name
/// and `extra_sans`, e.g. the listen address) or the CA change. A data dir from before the
/// key was kept goes on with its certificate as it is.
pub fn load_or_create(data_dir: &Path, extra_sans: &[String]) -> Result<Pki, ServerError> {
    let dir = data_dir.join("tls");
    private_dir(&dir)?;
    let (ca_p, ca_key_p, cert_p, key_p, stamp_p) = (
        dir.join("ca.crt"),
        dir.join("ca.key"),
        dir.join("serving.crt"),
        dir.join("serving.key"),
        dir.join("serving.for"),
    );
    let token_p = data_dir.join("token");
    // Files from older versions may have been written with a wider mode.
    for p in [&ca_p, &ca_key_p, &cert_p, &key_p, &token_p] {
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
    let mut sans = vec!["127.0.0.1".to_string(), "::1".into(), "localhost".into()];
    sans.extend(hostname());
    for s in extra_sans {
        if !sans.contains(s) {
            sans.push(s.clone());
        }
    }
    let (ca, ca_key, cert, key) = (
        read_opt(&ca_p)?,
        read_opt(&ca_key_p)?,
        read_opt(&cert_p)?,
        read_opt(&key_p)?,
    );
    let (ca_pem, ca_key_pem) = match (ca, ca_key, cert, key) {
        (Some(ca_pem), None, Some(cert_pem), Some(key_pem)) => {
            // An older data dir: the CA key was not kept.
            return Ok(Pki {
                ca_pem,
                cert_pem,
                key_pem,
                token,
            });
        }
        (Some(ca_pem), Some(ca_key_pem), cert, key) => {
            let stamp = serving_stamp(&sans, &ca_pem);
            if let (Some(cert_pem), Some(key_pem)) = (cert, key)
                && read_opt(&stamp_p)?.as_deref() == Some(stamp.as_str())
            {
                return Ok(Pki {
                    ca_pem,
                    cert_pem,
                    key_pem,
                    token,
                });
            }
            (ca_pem, ca_key_pem)
        }
        _ => {
            let (ca_pem, ca_key_pem) = generate_ca()?;
            write_private(&ca_key_p, &ca_key_pem)?;
            write_private(&ca_p, &ca_pem)?;
            (ca_pem, ca_key_pem)
        }
    };
    let (cert_pem, key_pem) = sign_serving(sans.clone(), &ca_key_pem)?;
    write_private(&key_p, &key_pem)?;
    write_private(&cert_p, &cert_pem)?;
    write_private(&stamp_p, serving_stamp(&sans, &ca_pem))?;
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

    #[test]
    fn serving_certificate_follows_its_sans_and_the_ca() {
        let dir = tempfile::tempdir().unwrap();
        let a = load_or_create(dir.path(), &["10.0.0.1".into()]).unwrap();
        assert!(dir.path().join("tls/ca.key").exists(), "the CA key is kept");
        // Same SANs: the same certificate.
        let b = load_or_create(dir.path(), &["10.0.0.1".into()]).unwrap();
        assert_eq!(a.cert_pem, b.cert_pem);
        // Another listen address: re-signed by the same CA.
        let c = load_or_create(dir.path(), &["10.0.0.2".into()]).unwrap();
        assert_ne!(c.cert_pem, a.cert_pem);
        assert_eq!(c.ca_pem, a.ca_pem);
        let stamp = std::fs::read_to_string(dir.path().join("tls/serving.for")).unwrap();
        assert!(
            stamp.contains("127.0.0.1") && stamp.contains("10.0.0.2"),
            "{stamp}"
        );
        // A CA replaced (bootstrap data of the cluster): re-signed by the new one.
        let other = tempfile::tempdir().unwrap();
        let o = load_or_create(other.path(), &[]).unwrap();
        for f in ["tls/ca.crt", "tls/ca.key"] {
            std::fs::copy(other.path().join(f), dir.path().join(f)).unwrap();
        }
        let d = load_or_create(dir.path(), &["10.0.0.2".into()]).unwrap();
        assert_eq!(d.ca_pem, o.ca_pem);
        assert_ne!(d.cert_pem, c.cert_pem);
        // An older data dir without the CA key keeps its certificate as it is.
        std::fs::remove_file(dir.path().join("tls/ca.key")).unwrap();
        let e = load_or_create(dir.path(), &["10.0.0.3".into()]).unwrap();
        assert_eq!(e.cert_pem, d.cert_pem);
    }
}
