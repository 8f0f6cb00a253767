//! TLS between the API server and the agent endpoint ([`crate::endpoint`]):
//!
//! - the agent's self-signed serving certificate, made once and kept in `DATA_DIR/endpoint-tls/`
//!   (key 0600), and its rustls server configuration;
//! - the certificate's SHA-256 fingerprint, which the agent publishes on its Node
//!   ([`crate::node::FINGERPRINT_ANNOTATION`]) with its authenticated API credentials;
//! - the API server side ([`crate::proxy`]): which transport a Node's endpoint URL and
//!   fingerprint call for ([`transport`], pure), and a rustls client that accepts exactly the
//!   pinned certificate ([`client_config`]), so no CA has to be distributed to agents;
//! - the live-migration stream between two agents ([`migration_server_config`],
//!   [`migration_client_config`]): mutual TLS with the same certificates, each side accepting
//!   only the other node's published fingerprint.

use std::io::Write;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use rcgen::{CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, KeyPair};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

use crate::error::AgentError;

/// Directory (under the agent's data dir) holding the endpoint's certificate and key.
pub const TLS_DIR: &str = "endpoint-tls";
const CERT_FILE: &str = "tls.crt";
const KEY_FILE: &str = "tls.key";

/// A SHA-256 certificate fingerprint.
pub type Fingerprint = [u8; 32];

/// The endpoint's serving certificate and key.
#[derive(Clone)]
pub struct AgentCert {
    pub cert: CertificateDer<'static>,
    key: Arc<PrivateKeyDer<'static>>,
}

impl std::fmt::Debug for AgentCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentCert")
            .field("sha256", &self.fingerprint_hex())
            .finish_non_exhaustive()
    }
}

impl AgentCert {
    /// A new self-signed certificate (ECDSA P-256) for `sans` (IP addresses or DNS names).
    pub fn generate(sans: &[String]) -> Result<AgentCert, AgentError> {
        let (cert_pem, key_pem) = generate_pem(sans)?;
        AgentCert::from_pem(&cert_pem, &key_pem)
    }

    fn from_pem(cert_pem: &str, key_pem: &str) -> Result<AgentCert, AgentError> {
        let cert = CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(|e| tls_err(format!("{CERT_FILE}: {e}")))?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|e| tls_err(format!("{KEY_FILE}: {e}")))?;
        Ok(AgentCert {
            cert,
            key: Arc::new(key),
        })
    }

    /// SHA-256 of the certificate's DER.
    pub fn fingerprint(&self) -> Fingerprint {
        fingerprint(&self.cert)
    }

    /// The fingerprint as published on the Node (lower-case hex).
    pub fn fingerprint_hex(&self) -> String {
        format_fingerprint(&self.fingerprint())
    }

    /// The rustls configuration serving this certificate (HTTP/1.1 only; ring provider).
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, AgentError> {
        self.server_config_with(None)
    }

    /// [`server_config`](Self::server_config) that, given the client CA (`client_ca_pem`, a
    /// joined node's), verifies a client certificate against it when one is presented (an
    /// invalid one fails the handshake; none is allowed: scrapers use bearer tokens) —
    /// [`crate::endpoint`] then requires the API server's for the server's token.
    pub fn server_config_with(
        &self,
        client_ca_pem: Option<&str>,
    ) -> Result<Arc<rustls::ServerConfig>, AgentError> {
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(tls_err)?;
        let builder = match client_ca_pem {
            Some(pem) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                    roots.add(c.map_err(tls_err)?).map_err(tls_err)?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider(),
                )
                .allow_unauthenticated()
                .build()
                .map_err(tls_err)?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut cfg = builder
            .with_single_cert(vec![self.cert.clone()], self.key.clone_key())
            .map_err(tls_err)?;
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(cfg))
    }
}

fn tls_err(e: impl std::fmt::Display) -> AgentError {
    AgentError::Tls(e.to_string())
}

pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn generate_pem(sans: &[String]) -> Result<(String, String), AgentError> {
    let key = KeyPair::generate().map_err(tls_err)?;
    let mut params = CertificateParams::new(sans.to_vec()).map_err(tls_err)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "ferrovirt-agent");
    params.distinguished_name = dn;
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.not_after = rcgen::date_time_ymd(2125, 1, 1);
    let cert = params.self_signed(&key).map_err(tls_err)?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn read_opt(path: &Path) -> Result<Option<String>, AgentError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(AgentError::io(path, e)),
    }
}

/// Writes a file with `mode`, atomically (temp file + rename).
pub(crate) fn write_file(path: &Path, contents: &str, mode: u32) -> Result<(), AgentError> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .map_err(|e| AgentError::io(&tmp, e))?;
    f.write_all(contents.as_bytes())
        .and_then(|_| f.sync_all())
        .map_err(|e| AgentError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| AgentError::io(path, e))
}

/// The endpoint's certificate from `data_dir`, made (and stored) on first use. `sans` only
/// matter when it is made: the API server pins the certificate, not its names.
pub fn load_or_create(data_dir: &Path, sans: &[String]) -> Result<AgentCert, AgentError> {
    let dir = data_dir.join(TLS_DIR);
    std::fs::create_dir_all(&dir).map_err(|e| AgentError::io(&dir, e))?;
    let (cert_p, key_p) = (dir.join(CERT_FILE), dir.join(KEY_FILE));
    if let (Some(c), Some(k)) = (read_opt(&cert_p)?, read_opt(&key_p)?) {
        match AgentCert::from_pem(&c, &k) {
            Ok(cert) => return Ok(cert),
            Err(e) => tracing::warn!("replacing the unreadable endpoint certificate: {e}"),
        }
    }
    let mut all = vec!["127.0.0.1".to_string(), "::1".into(), "localhost".into()];
    for s in sans {
        if !s.is_empty() && !all.contains(s) {
            all.push(s.clone());
        }
    }
    let (cert_pem, key_pem) = generate_pem(&all)?;
    write_file(&key_p, &key_pem, 0o600)?;
    write_file(&cert_p, &cert_pem, 0o644)?;
    let cert = AgentCert::from_pem(&cert_pem, &key_pem)?;
    tracing::info!(sha256 = %cert.fingerprint_hex(), "made the agent endpoint's certificate");
    Ok(cert)
}

/// SHA-256 of a certificate's DER.
pub fn fingerprint(der: &[u8]) -> Fingerprint {
    let d = ring::digest::digest(&ring::digest::SHA256, der);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Lower-case hex, no separators (as published on the Node).
pub fn format_fingerprint(fp: &Fingerprint) -> String {
    fp.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses a hex SHA-256 fingerprint (either case; `:` separators as printed by
/// `openssl x509 -fingerprint` are accepted).
pub fn parse_fingerprint(s: &str) -> Result<Fingerprint, String> {
    let hex: Vec<u8> = s.trim().bytes().filter(|b| *b != b':').collect();
    if hex.len() != 64 {
        return Err(format!(
            "a SHA-256 fingerprint has 64 hex digits, got {} in {s:?}",
            hex.len()
        ));
    }
    let digit = |b: u8| -> Result<u8, String> {
        (b as char)
            .to_digit(16)
            .map(|d| d as u8)
            .ok_or_else(|| format!("{:?} is not a hex digit in {s:?}", b as char))
    };
    let mut out = [0u8; 32];
    for (i, pair) in hex.chunks(2).enumerate() {
        out[i] = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Ok(out)
}

/// Compares in time independent of where the inputs differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    subtle::ConstantTimeEq::ct_eq(a, b).into()
}

/// How the API server reaches an agent endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentTarget {
    /// `host:port` to connect to (and to send as `Host`).
    pub authority: String,
    /// The host part (brackets of IPv6 literals removed).
    pub host: String,
    /// Present: TLS accepting exactly this certificate. Absent: plain HTTP (loopback only).
    pub pin: Option<Fingerprint>,
}

/// Why a Node's endpoint cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    #[error("agent endpoint {url:?} is not an http(s)://host:port URL")]
    BadUrl { url: String },
    #[error("agent endpoint {url:?} is https but the node publishes no certificate fingerprint")]
    NoFingerprint { url: String },
    #[error("the node's agent certificate fingerprint is invalid: {0}")]
    BadFingerprint(String),
    #[error("agent endpoint {url:?} is plain http with a certificate fingerprint; expected https")]
    PlainWithFingerprint { url: String },
    #[error(
        "refusing plain http to the non-loopback agent endpoint {url:?}: the agent must serve \
         https and publish its certificate fingerprint (upgrade the node's agent)"
    )]
    PlainNotLoopback { url: String },
}

/// Whether `host` (a URL's host, IPv6 brackets removed) is a loopback address.
pub fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The transport for a Node's endpoint `url` and its published `fingerprint` (absent for
/// agents that predate TLS): https needs a fingerprint, which is pinned; plain http is only
/// accepted without fingerprint and to a loopback address.
pub fn transport(url: &str, fingerprint: Option<&str>) -> Result<AgentTarget, TransportError> {
    let bad = || TransportError::BadUrl { url: url.into() };
    let (tls, rest) = if let Some(r) = url.strip_prefix("https://") {
        (true, r)
    } else if let Some(r) = url.strip_prefix("http://") {
        (false, r)
    } else {
        return Err(bad());
    };
    let authority = rest.trim_end_matches('/');
    if authority.is_empty() || authority.contains(['/', '@', '?', '#']) {
        return Err(bad());
    }
    let (host, port) = authority.rsplit_once(':').ok_or_else(bad)?;
    port.parse::<u16>().map_err(|_| bad())?;
    let host = match host.strip_prefix('[') {
        Some(h) => h.strip_suffix(']').ok_or_else(bad)?,
        None if host.contains(':') => return Err(bad()),
        None => host,
    };
    if host.is_empty() {
        return Err(bad());
    }
    let fingerprint = fingerprint.map(str::trim).filter(|f| !f.is_empty());
    let pin = match (tls, fingerprint) {
        (true, Some(f)) => Some(parse_fingerprint(f).map_err(TransportError::BadFingerprint)?),
        (true, None) => return Err(TransportError::NoFingerprint { url: url.into() }),
        (false, Some(_)) => return Err(TransportError::PlainWithFingerprint { url: url.into() }),
        (false, None) if is_loopback(host) => None,
        (false, None) => return Err(TransportError::PlainNotLoopback { url: url.into() }),
    };
    Ok(AgentTarget {
        authority: authority.to_string(),
        host: host.to_string(),
        pin,
    })
}

/// Accepts exactly the certificate whose SHA-256 is pinned (names, issuer and validity are not
/// consulted: the pin comes from the Node the agent wrote with its own credentials); the
/// handshake signatures are still verified against that certificate.
#[derive(Debug)]
pub struct PinnedCert {
    pin: Fingerprint,
    provider: Arc<CryptoProvider>,
}

impl PinnedCert {
    /// Ok when `end_entity` is the pinned certificate.
    fn check(&self, end_entity: &CertificateDer<'_>) -> Result<(), rustls::Error> {
        if constant_time_eq(&fingerprint(end_entity), &self.pin) {
            Ok(())
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            ))
        }
    }
}

impl ServerCertVerifier for PinnedCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.check(end_entity)?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Whether the DER certificate `der` names the API server: `CN=system:ferrovirt-server` and
/// `O=system:ferrovirt-servers` (the caller has verified it against the client CA). Pure.
pub fn is_server_certificate(der: &[u8]) -> bool {
    use ferrovirt_api::jointoken::{SERVER_GROUP, SERVER_USER};
    use x509_parser::prelude::{FromDer, X509Certificate};
    let Ok((_, cert)) = X509Certificate::from_der(der) else {
        return false;
    };
    let subject = cert.subject();
    let cn = subject
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok());
    cn == Some(SERVER_USER)
        && subject
            .iter_organization()
            .any(|o| o.as_str().ok() == Some(SERVER_GROUP))
}

/// The bearer token the API server presents to node `node`'s endpoint: HMAC-SHA256 of the
/// node name keyed with the server's API token (hex). The server never sends its API token
/// itself to an agent, so an agent (or whoever holds a node) learns only the token for its
/// own endpoint, which opens nothing else: not the API server, not another node's endpoint.
pub fn endpoint_token(api_token: &str, node: &str) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, api_token.as_bytes());
    let tag = ring::hmac::sign(&key, format!("ferrovirt-agent-endpoint/{node}").as_bytes());
    format_fingerprint(&tag.as_ref().try_into().unwrap_or([0; 32]))
}

/// The API server's own client certificate and key, presented by every pinned connection this
/// process makes to an agent endpoint ([`set_server_identity`]; only the server sets it).
static SERVER_IDENTITY: std::sync::OnceLock<(
    Vec<CertificateDer<'static>>,
    Arc<PrivateKeyDer<'static>>,
)> = std::sync::OnceLock::new();

/// Makes this process present `cert_pem`/`key_pem` (the API server's client certificate,
/// `CN=system:ferrovirt-server`) as its client certificate on the pinned connections to agent
/// endpoints. Set once; later calls are ignored.
pub fn set_server_identity(cert_pem: &str, key_pem: &str) -> Result<(), AgentError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(tls_err)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(tls_err)?;
    let _ = SERVER_IDENTITY.set((chain, Arc::new(key)));
    Ok(())
}

/// A rustls client configuration that accepts only the certificate with fingerprint `pin`
/// (and presents the server's client certificate, when this process has one).
pub fn client_config(pin: Fingerprint) -> Result<Arc<rustls::ClientConfig>, AgentError> {
    let provider = provider();
    let verifier = Arc::new(PinnedCert {
        pin,
        provider: provider.clone(),
    });
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(tls_err)?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let mut cfg = match SERVER_IDENTITY.get() {
        Some((chain, key)) => builder
            .with_client_auth_cert(chain.clone(), key.clone_key())
            .map_err(tls_err)?,
        None => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The TLS server name for `host` (an IP address or a DNS name; the pin does not depend on it).
pub fn server_name(host: &str) -> Result<ServerName<'static>, AgentError> {
    ServerName::try_from(host.to_string()).map_err(|e| tls_err(format!("host {host:?}: {e}")))
}

/// Whether an I/O error of a TLS handshake is the pinned-certificate check failing.
pub fn is_pin_mismatch(e: &std::io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|r| {
            matches!(
                r,
                rustls::Error::InvalidCertificate(
                    rustls::CertificateError::ApplicationVerificationFailure
                )
            )
        })
}

/// Opens a TLS connection over `tcp` accepting only the pinned certificate.
pub async fn connect(
    tcp: tokio::net::TcpStream,
    host: &str,
    pin: Fingerprint,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let cfg = client_config(pin).map_err(std::io::Error::other)?;
    let name = server_name(host).map_err(std::io::Error::other)?;
    tokio_rustls::TlsConnector::from(cfg)
        .connect(name, tcp)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_with(cn: &str, o: Option<&str>) -> Vec<u8> {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, cn);
        if let Some(o) = o {
            dn.push(DnType::OrganizationName, o);
        }
        params.distinguished_name = dn;
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn only_the_server_subject_is_the_server_certificate() {
        use ferrovirt_api::jointoken::{NODES_GROUP, SERVER_GROUP, SERVER_USER};
        assert!(is_server_certificate(&cert_with(
            SERVER_USER,
            Some(SERVER_GROUP)
        )));
        assert!(!is_server_certificate(&cert_with(SERVER_USER, None)));
        assert!(!is_server_certificate(&cert_with(
            SERVER_USER,
            Some("system:masters")
        )));
        assert!(!is_server_certificate(&cert_with(
            "system:node:n1",
            Some(NODES_GROUP)
        )));
        assert!(!is_server_certificate(b"not a certificate"));
    }

    #[test]
    fn fingerprints_round_trip() {
        let fp: Fingerprint = std::array::from_fn(|i| i as u8 * 7);
        let hex = format_fingerprint(&fp);
        assert_eq!(hex.len(), 64);
        assert_eq!(&hex[..6], "00070e");
        assert_eq!(parse_fingerprint(&hex), Ok(fp));
        assert_eq!(parse_fingerprint(&hex.to_uppercase()), Ok(fp));
        let colons: Vec<String> = fp.iter().map(|b| format!("{b:02X}")).collect();
        assert_eq!(parse_fingerprint(&colons.join(":")), Ok(fp));
        assert!(
            parse_fingerprint("abc")
                .unwrap_err()
                .contains("64 hex digits")
        );
        let bad = format!("zz{}", &hex[2..]);
        assert!(
            parse_fingerprint(&bad)
                .unwrap_err()
                .contains("not a hex digit")
        );
        // SHA-256 of the empty input.
        assert_eq!(
            format_fingerprint(&fingerprint(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert!(constant_time_eq(b"ab", b"ab"));
        assert!(!constant_time_eq(b"ab", b"ac"));
        assert!(!constant_time_eq(b"ab", b"a"));
    }

    #[test]
    fn transport_for_url_and_fingerprint() {
        let fp = format_fingerprint(&[0xab; 32]);
        let t = transport("https://10.0.0.5:4000/", Some(&fp)).unwrap();
        assert_eq!(t.authority, "10.0.0.5:4000");
        assert_eq!(t.host, "10.0.0.5");
        assert_eq!(t.pin, Some([0xab; 32]));
        let t = transport("https://[fd00::1]:4000", Some(&fp)).unwrap();
        assert_eq!(
            (t.authority.as_str(), t.host.as_str()),
            ("[fd00::1]:4000", "fd00::1")
        );
        // Old agents: plain http, loopback only.
        let t = transport("http://127.0.0.1:4000", None).unwrap();
        assert_eq!(t.pin, None);
        assert!(
            transport("http://[::1]:4000", Some(""))
                .unwrap()
                .pin
                .is_none()
        );
        assert!(transport("http://localhost:4000", None).is_ok());
        assert_eq!(
            transport("http://10.0.0.5:4000", None),
            Err(TransportError::PlainNotLoopback {
                url: "http://10.0.0.5:4000".into()
            })
        );
        assert!(matches!(
            transport("http://127.0.0.1:4000", Some(&fp)),
            Err(TransportError::PlainWithFingerprint { .. })
        ));
        assert!(matches!(
            transport("https://10.0.0.5:4000", None),
            Err(TransportError::NoFingerprint { .. })
        ));
        assert!(matches!(
            transport("https://10.0.0.5:4000", Some("nope")),
            Err(TransportError::BadFingerprint(_))
        ));
        for bad in [
            "ftp://10.0.0.5:1",
            "https://10.0.0.5",
            "https://10.0.0.5:x",
            "https://:1",
            "https://u@h:1",
            "https://h:1/path",
            "https://fd00::1:4000",
            "10.0.0.5:4000",
        ] {
            assert!(
                matches!(
                    transport(bad, Some(&fp)),
                    Err(TransportError::BadUrl { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn certificate_is_made_once_and_kept_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let a = load_or_create(dir.path(), &["10.1.2.3".into()]).unwrap();
        let b = load_or_create(dir.path(), &[]).unwrap();
        assert_eq!(a.fingerprint(), b.fingerprint());
        assert_eq!(a.fingerprint_hex().len(), 64);
        let key = dir.path().join(TLS_DIR).join(KEY_FILE);
        let mode = std::fs::metadata(key).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        a.server_config().unwrap();
        let other = AgentCert::generate(&["127.0.0.1".into()]).unwrap();
        assert_ne!(other.fingerprint(), a.fingerprint());
    }

    /// A handshake against a served certificate: the pinned one passes, any other is refused
    /// as a pin mismatch.
    #[tokio::test]
    async fn only_the_pinned_certificate_is_accepted() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let cert = AgentCert::generate(&["127.0.0.1".into()]).unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(cert.server_config().unwrap());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    if let Ok(mut s) = acceptor.accept(tcp).await {
                        let _ = s.write_all(b"hi").await;
                        let _ = s.shutdown().await;
                    }
                });
            }
        });
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut s = connect(tcp, "127.0.0.1", cert.fingerprint()).await.unwrap();
        let mut buf = [0u8; 2];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"hi");
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let err = connect(tcp, "127.0.0.1", [0u8; 32]).await.unwrap_err();
        assert!(is_pin_mismatch(&err), "{err}");
    }
}

/// Accepts exactly the client certificate whose SHA-256 is pinned (the migration source
/// node's published fingerprint); handshake signatures are verified against it.
#[derive(Debug)]
struct PinnedClient(PinnedCert);

impl rustls::server::danger::ClientCertVerifier for PinnedClient {
    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        self.0.check(end_entity)?;
        Ok(rustls::server::danger::ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// The migration target's TLS: serves `cert`, requires the client certificate pinned by
/// `source` (the source node's published fingerprint).
pub fn migration_server_config(
    cert: &AgentCert,
    source: Fingerprint,
) -> Result<Arc<rustls::ServerConfig>, AgentError> {
    let provider = provider();
    let verifier = Arc::new(PinnedClient(PinnedCert {
        pin: source,
        provider: provider.clone(),
    }));
    let cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(tls_err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![cert.cert.clone()], cert.key.clone_key())
        .map_err(tls_err)?;
    Ok(Arc::new(cfg))
}

/// The migration source's TLS: accepts only the server certificate pinned by `target` (the
/// target node's published fingerprint) and presents `cert` as its client certificate.
pub fn migration_client_config(
    cert: &AgentCert,
    target: Fingerprint,
) -> Result<Arc<rustls::ClientConfig>, AgentError> {
    let provider = provider();
    let verifier = Arc::new(PinnedCert {
        pin: target,
        provider: provider.clone(),
    });
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(tls_err)?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(vec![cert.cert.clone()], cert.key.clone_key())
        .map_err(tls_err)?;
    Ok(Arc::new(cfg))
}
