//! Client certificates: the client CA in the data dir (`tls/client-ca.crt`,
//! `tls/client-ca.key`, 0600; created on first start, separate from the serving CA as k3s
//! keeps them), the rustls verifier that accepts
//! its certificates and clients without one (bearer tokens keep working), the identity in a
//! verified certificate (CN = user, O = groups, as Kubernetes reads them), and
//! [`client_kubeconfig`], which signs a new identity for `ferrovirt kubeconfig create`.

use std::path::Path;
use std::sync::Arc;

use base64::Engine;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

use super::rbac::UserInfo;
use crate::error::ServerError;
use crate::tls::{private_file, write_private};

const CA_CN: &str = "ferrovirt-client-ca";

fn tls_err(e: impl std::fmt::Display) -> ServerError {
    ServerError::Tls(e.to_string())
}

fn ca_params() -> Result<CertificateParams, ServerError> {
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(tls_err)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_CN);
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

/// The client CA: certificate PEM and key PEM.
#[derive(Debug, Clone)]
pub struct ClientCa {
    pub cert_pem: String,
    key_pem: String,
}

/// Loads `DATA_DIR/tls/client-ca.{crt,key}`, creating them when missing.
pub fn load_or_create(data_dir: &Path) -> Result<ClientCa, ServerError> {
    let dir = data_dir.join("tls");
    crate::tls::private_dir(&dir)?;
    let (crt, key) = (dir.join("client-ca.crt"), dir.join("client-ca.key"));
    private_file(&key)?;
    if let (Ok(cert_pem), Ok(key_pem)) =
        (std::fs::read_to_string(&crt), std::fs::read_to_string(&key))
    {
        return Ok(ClientCa { cert_pem, key_pem });
    }
    let kp = KeyPair::generate().map_err(tls_err)?;
    let cert = ca_params()?.self_signed(&kp).map_err(tls_err)?;
    let ca = ClientCa {
        cert_pem: cert.pem(),
        key_pem: kp.serialize_pem(),
    };
    write_private(&key, &ca.key_pem)?;
    write_private(&crt, &ca.cert_pem)?;
    Ok(ca)
}

/// Loads an existing client CA (the CLI: it never creates one).
pub fn load(data_dir: &Path) -> Result<ClientCa, ServerError> {
    let dir = data_dir.join("tls");
    let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| ServerError::io(p.display(), e));
    Ok(ClientCa {
        cert_pem: read(&dir.join("client-ca.crt"))?,
        key_pem: read(&dir.join("client-ca.key"))?,
    })
}

impl ClientCa {
    /// A new key and a certificate for `user` in `groups`, valid for `days`: (cert PEM, key PEM).
    pub fn issue(
        &self,
        user: &str,
        groups: &[String],
        days: u32,
    ) -> Result<(String, String), ServerError> {
        let key = KeyPair::generate().map_err(tls_err)?;
        let cert = self.issue_for(user, groups, days, &key)?;
        Ok((cert, key.serialize_pem()))
    }

    /// A certificate for `user` in `groups`, valid for `days`, of the public key `key` (a
    /// joining node keeps its private key): the certificate PEM.
    pub fn issue_for(
        &self,
        user: &str,
        groups: &[String],
        days: u32,
        key: &impl rcgen::PublicKeyData,
    ) -> Result<String, ServerError> {
        let lifetime = std::time::Duration::from_secs(u64::from(days) * 86_400);
        self.issue_for_lifetime(user, groups, lifetime, key)
    }

    /// [`issue_for`](Self::issue_for) valid for `lifetime` from now (and from a little before
    /// now, for clocks behind ours: a quarter of the lifetime, at most 5 minutes).
    pub fn issue_for_lifetime(
        &self,
        user: &str,
        groups: &[String],
        lifetime: std::time::Duration,
        key: &impl rcgen::PublicKeyData,
    ) -> Result<String, ServerError> {
        if user.is_empty() {
            return Err(ServerError::Config("a user name is required".into()));
        }
        if groups.len() > 2 {
            // rcgen keeps one value per attribute type: O and a second O spelled by its OID.
            return Err(ServerError::Config(format!(
                "at most 2 groups per client certificate (asked for {})",
                groups.len()
            )));
        }
        let ca_key = KeyPair::from_pem(&self.key_pem).map_err(tls_err)?;
        let issuer = Issuer::new(ca_params()?, ca_key);
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(tls_err)?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, user);
        let organization = [
            DnType::OrganizationName,
            DnType::CustomDnType(vec![2, 5, 4, 10]),
        ];
        for (g, ty) in groups.iter().zip(organization) {
            dn.push(ty, g.as_str());
        }
        params.distinguished_name = dn;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let now = time_now();
        params.not_before = now - (lifetime / 4).min(std::time::Duration::from_secs(300));
        params.not_after = now + lifetime;
        let cert = params.signed_by(key, &issuer).map_err(tls_err)?;
        Ok(cert.pem())
    }
}

fn time_now() -> time::OffsetDateTime {
    time::OffsetDateTime::now_utc()
}

/// The rustls server configuration with client certificates of the client CA optional.
pub fn server_config(
    pki: &crate::tls::Pki,
    ca: &ClientCa,
) -> Result<Arc<rustls::ServerConfig>, ServerError> {
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for der in crate::tls::pem_blocks(&ca.cert_pem, "CERTIFICATE") {
        roots.add(CertificateDer::from(der)).map_err(tls_err)?;
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .allow_unauthenticated()
    .build()
    .map_err(tls_err)?;
    // The serving CA follows the leaf: a joining agent checks its hash against the join
    // token's before it sends anything ([`super::join`]).
    let certs: Vec<CertificateDer<'static>> = crate::tls::pem_blocks(&pki.cert_pem, "CERTIFICATE")
        .into_iter()
        .chain(crate::tls::pem_blocks(&pki.ca_pem, "CERTIFICATE"))
        .map(CertificateDer::from)
        .collect();
    let key = crate::tls::pem_blocks(&pki.key_pem, "PRIVATE KEY")
        .into_iter()
        .next()
        .ok_or_else(|| tls_err("serving.key holds no PKCS#8 private key"))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(tls_err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key)))
        .map_err(tls_err)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The identity in a client certificate the TLS layer verified: CN = user, each O a group.
pub fn identity(der: &[u8]) -> Option<UserInfo> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der).ok()?;
    let subject = cert.subject();
    let name = subject
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())?
        .to_string();
    if name.is_empty() {
        return None;
    }
    let groups = subject
        .iter_organization()
        .filter_map(|o| o.as_str().ok().map(str::to_string))
        .collect();
    Some(UserInfo {
        name,
        uid: String::new(),
        groups,
    })
}

/// The validity of the first certificate in `pem`: (notBefore, notAfter) in Unix seconds.
pub fn validity(pem: &str) -> Option<(i64, i64)> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let der = crate::tls::pem_blocks(pem, "CERTIFICATE")
        .into_iter()
        .next()?;
    let (_, cert) = X509Certificate::from_der(&der).ok()?;
    let v = cert.validity();
    Some((v.not_before.timestamp(), v.not_after.timestamp()))
}

/// A kubeconfig for a new client-certificate identity, for `server_url` trusting the serving
/// CA `ca_pem`. Reads the client CA key: whoever runs it needs read access to `DATA_DIR/tls`.
pub fn client_kubeconfig(
    data_dir: &Path,
    user: &str,
    groups: &[String],
    days: u32,
) -> Result<String, ServerError> {
    let ca = load(data_dir)?;
    let (cert, key) = ca.issue(user, groups, days)?;
    let serving_ca_p = data_dir.join("tls/ca.crt");
    let serving_ca = std::fs::read_to_string(&serving_ca_p)
        .map_err(|e| ServerError::io(serving_ca_p.display(), e))?;
    let admin_p = data_dir.join("kubeconfig.yaml");
    let admin =
        std::fs::read_to_string(&admin_p).map_err(|e| ServerError::io(admin_p.display(), e))?;
    let server = admin
        .lines()
        .find_map(|l| l.trim().strip_prefix("server: "))
        .ok_or_else(|| ServerError::Config(format!("no server URL in {}", admin_p.display())))?;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
    Ok(format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: ferrovirt\n  cluster:\n    server: {server}\n    certificate-authority-data: {}\ncontexts:\n- name: {user}@ferrovirt\n  context:\n    cluster: ferrovirt\n    user: {user:?}\n    namespace: default\ncurrent-context: {user}@ferrovirt\nusers:\n- name: {user:?}\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\n",
        b64(&serving_ca),
        b64(&cert),
        b64(&key),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_certificates_carry_the_identity() {
        let dir = tempfile::tempdir().unwrap();
        let ca = load_or_create(dir.path()).unwrap();
        let again = load_or_create(dir.path()).unwrap();
        assert_eq!(ca.cert_pem, again.cert_pem);
        let (cert, _key) = ca.issue("alice", &["dev".into(), "ops".into()], 1).unwrap();
        assert!(
            ca.issue("bob", &["a".into(), "b".into(), "c".into()], 1)
                .is_err()
        );
        let der = crate::tls::pem_blocks(&cert, "CERTIFICATE").remove(0);
        let id = identity(&der).unwrap();
        assert_eq!(id.name, "alice");
        assert_eq!(id.groups, vec!["dev".to_string(), "ops".to_string()]);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("tls/client-ca.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
