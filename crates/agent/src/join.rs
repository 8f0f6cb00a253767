//! Joining a cluster with a join token (`ferrovirt agent --server URL --token-file F`,
//! docs/nodes.md). Before it sends anything, the agent opens a TLS connection to the server
//! that accepts any certificate, reads the chain the server presents, and looks for the
//! certificate whose SHA-256 is the token's CA hash; none: it refuses (the error names the
//! hash) without a single request. With that CA as its only trust root it then posts the
//! token's secret, its node name and a new ECDSA P-256 public key to the join endpoint and
//! gets a client certificate `CN=system:node:<name>, O=system:nodes`. The key, the certificate
//! and both CAs are kept 0600 in `DATA_DIR/node-credential/` and reused on restart (while the
//! token's CA hash still matches and the node name is the same), so a restarted agent does
//! not join again. A random node password, kept beside them, goes with every join: the server
//! records it on the first join under a name and refuses that name to anyone without it.
//! [`renew`] trades the current certificate for a new one (new key, same name) before it
//! expires; [`renewal_due`] decides when (less than a third of the lifetime left).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrovirt_api::jointoken::{
    JOIN_PATH, JoinRequest, JoinResponse, JoinToken, RENEW_PATH, RenewRequest, RenewResponse, hex,
};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

use crate::error::AgentError;

/// The credential directory under the agent's data dir.
pub const CREDENTIAL_DIR: &str = "node-credential";
/// The serving CA the token vouched for.
pub const CA_FILE: &str = "server-ca.crt";
/// The node's client certificate.
pub const CERT_FILE: &str = "node.crt";
/// The node's private key.
pub const KEY_FILE: &str = "node.key";
/// The client CA (signs the node's and the API server's client certificates).
pub const CLIENT_CA_FILE: &str = "client-ca.crt";
/// The token the API server presents to this node's endpoint.
pub const ENDPOINT_TOKEN_FILE: &str = "endpoint-token";
/// The node's password (sent with every join under its name).
pub const PASSWORD_FILE: &str = "node-password";
/// The node name the credential was issued for.
const NODE_FILE: &str = "node-name";

const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

/// A node's credential for the API server.
#[derive(Clone)]
pub struct NodeCredential {
    /// PEM of the server's serving CA (the only trust root for the API server).
    pub server_ca_pem: String,
    /// PEM of the node's client certificate.
    pub cert_pem: String,
    /// PEM of the node's private key.
    pub key_pem: String,
    /// PEM of the client CA.
    pub client_ca_pem: String,
    /// The bearer token the API server presents to this node's endpoint.
    pub endpoint_token: Option<String>,
    /// Where it is kept.
    pub dir: PathBuf,
}

impl std::fmt::Debug for NodeCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCredential")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

fn join_err(e: impl std::fmt::Display) -> AgentError {
    AgentError::Join(e.to_string())
}

/// SHA-256 of `der`.
pub fn sha256(der: &[u8]) -> [u8; 32] {
    crate::tls::fingerprint(der)
}

/// The certificate of `chain` whose SHA-256 is `hash`, or the refusal naming the hash. Pure.
pub fn pick_ca<'a>(
    chain: &'a [CertificateDer<'static>],
    hash: &[u8; 32],
    server: &str,
) -> Result<&'a CertificateDer<'static>, AgentError> {
    if let Some(c) = chain
        .iter()
        .find(|c| crate::tls::constant_time_eq(&sha256(c), hash))
    {
        return Ok(c);
    }
    let seen: Vec<String> = chain.iter().map(|c| hex(&sha256(c))).collect();
    Err(AgentError::Join(format!(
        "the server at {server} is not the one the join token names: no certificate it \
         presented has the token's CA hash sha256:{} (presented: {}); refusing to connect \
         (wrong token, or not the cluster's server)",
        hex(hash),
        if seen.is_empty() {
            "none".to_string()
        } else {
            seen.iter()
                .map(|h| format!("sha256:{h}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    )))
}

/// (host, port) of an `https://` URL.
pub fn host_port(url: &str) -> Result<(String, u16), AgentError> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| join_err(format!("--server {url}: {e}")))?;
    if uri.scheme_str() != Some("https") {
        return Err(join_err(format!("--server {url}: must be an https:// URL")));
    }
    let host = uri
        .host()
        .ok_or_else(|| join_err(format!("--server {url}: no host")))?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    Ok((host, uri.port_u16().unwrap_or(443)))
}

/// Accepts any server certificate (the chain is checked against the token's hash after the
/// handshake, before anything is sent); handshake signatures are still verified.
#[derive(Debug)]
struct AnyCert(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
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
            &self.0.signature_verification_algorithms,
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
            &self.0.signature_verification_algorithms,
        )
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

async fn tcp(host: &str, port: u16) -> Result<tokio::net::TcpStream, AgentError> {
    tokio::time::timeout(TIMEOUT, tokio::net::TcpStream::connect((host, port)))
        .await
        .map_err(|_| join_err(format!("connecting to {host}:{port}: timed out")))?
        .map_err(|e| join_err(format!("connecting to {host}:{port}: {e}")))
}

fn name(host: &str) -> Result<ServerName<'static>, AgentError> {
    ServerName::try_from(host.to_string()).map_err(|e| join_err(format!("host {host:?}: {e}")))
}

/// The certificates the server at `url` presents in its TLS handshake (nothing is sent
/// after the handshake).
pub async fn presented_chain(url: &str) -> Result<Vec<CertificateDer<'static>>, AgentError> {
    let (host, port) = host_port(url)?;
    let provider = crate::tls::provider();
    let cfg = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(join_err)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCert(provider)))
        .with_no_client_auth();
    let stream = tcp(&host, port).await?;
    let tls = tokio::time::timeout(
        TIMEOUT,
        tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(name(&host)?, stream),
    )
    .await
    .map_err(|_| join_err(format!("TLS handshake with {url}: timed out")))?
    .map_err(|e| join_err(format!("TLS handshake with {url}: {e}")))?;
    let chain = tls
        .get_ref()
        .1
        .peer_certificates()
        .map(|c| c.iter().map(|c| c.clone().into_owned()).collect())
        .unwrap_or_default();
    drop(tls);
    Ok(chain)
}

/// Posts `req` to the join endpoint, trusting only `ca`.
async fn post_join(
    url: &str,
    ca: &CertificateDer<'static>,
    req: &JoinRequest,
    user_agent: &str,
) -> Result<JoinResponse, AgentError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).map_err(join_err)?;
    let cfg = rustls::ClientConfig::builder_with_provider(crate::tls::provider())
        .with_safe_default_protocol_versions()
        .map_err(join_err)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let body = serde_json::to_vec(req).map_err(join_err)?;
    let bytes = post(url, cfg, JOIN_PATH, body, user_agent, "join").await?;
    serde_json::from_slice(&bytes).map_err(|e| join_err(format!("decoding the join answer: {e}")))
}

/// Posts the JSON `body` to `path` over TLS configured by `cfg`: the answer's body, or the
/// refusal with the server's message (`what`: "join", "renew").
async fn post(
    url: &str,
    mut cfg: rustls::ClientConfig,
    path: &str,
    body: Vec<u8>,
    user_agent: &str,
    what: &str,
) -> Result<Bytes, AgentError> {
    let (host, port) = host_port(url)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    let stream = tcp(&host, port).await?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(name(&host)?, stream)
        .await
        .map_err(|e| {
            join_err(format!(
                "TLS with {url} (verified against the token's CA): {e}"
            ))
        })?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(join_err)?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let authority = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let request = http::Request::builder()
        .method(http::Method::POST)
        .uri(path)
        .header(http::header::HOST, authority)
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(http::header::USER_AGENT, user_agent)
        .body(Full::new(Bytes::from(body)))
        .map_err(join_err)?;
    let resp = tokio::time::timeout(TIMEOUT, send.send_request(request))
        .await
        .map_err(|_| join_err(format!("the {what} request timed out")))?
        .map_err(join_err)?;
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(join_err)?
        .to_bytes();
    if !status.is_success() {
        let msg = serde_json::from_slice::<serde_json::Value>(&bytes)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
        return Err(join_err(format!(
            "the server refused to {what}: {status}: {msg}"
        )));
    }
    Ok(bytes)
}

/// Whether a certificate valid from `not_before` to `not_after` (Unix seconds) is due for
/// renewal at `now`: less than a third of its lifetime is left. Pure.
pub fn renewal_due(not_before: i64, not_after: i64, now: i64) -> bool {
    now >= renewal_at(not_before, not_after)
}

/// When a certificate valid from `not_before` to `not_after` falls due for renewal. Pure.
pub fn renewal_at(not_before: i64, not_after: i64) -> i64 {
    not_after - (not_after - not_before).max(0) / 3
}

/// Renews the node certificate of `cred` at the server `url`: a new key, posted with the
/// current certificate as the client certificate; the new key and certificate are kept in
/// place of the old ones. Returns the renewed credential.
pub async fn renew(
    url: &str,
    cred: &NodeCredential,
    user_agent: &str,
) -> Result<NodeCredential, AgentError> {
    let ca = CertificateDer::from_pem_slice(cred.server_ca_pem.as_bytes()).map_err(join_err)?;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca).map_err(join_err)?;
    let chain = CertificateDer::pem_slice_iter(cred.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(join_err)?;
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(cred.key_pem.as_bytes())
        .map_err(join_err)?;
    let cfg = rustls::ClientConfig::builder_with_provider(crate::tls::provider())
        .with_safe_default_protocol_versions()
        .map_err(join_err)?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(join_err)?;
    let new_key = rcgen::KeyPair::generate().map_err(join_err)?;
    use base64::Engine;
    let req = RenewRequest {
        public_key: base64::engine::general_purpose::STANDARD.encode(new_key.public_key_raw()),
    };
    let body = serde_json::to_vec(&req).map_err(join_err)?;
    let bytes = post(url, cfg, RENEW_PATH, body, user_agent, "renew").await?;
    let resp: RenewResponse = serde_json::from_slice(&bytes)
        .map_err(|e| join_err(format!("decoding the renewal answer: {e}")))?;
    let renewed = NodeCredential {
        cert_pem: resp.certificate,
        key_pem: new_key.serialize_pem(),
        ..cred.clone()
    };
    // The key first: a crash between the two leaves the old certificate with a key it does
    // not match, which the next start notices (the TLS identity does not load) and joins
    // again with the kept node password.
    crate::tls::write_file(&renewed.dir.join(KEY_FILE), &renewed.key_pem, 0o600)?;
    crate::tls::write_file(&renewed.dir.join(CERT_FILE), &renewed.cert_pem, 0o600)?;
    tracing::info!(dir = %renewed.dir.display(), "renewed the node certificate");
    Ok(renewed)
}

fn read(dir: &Path, file: &str) -> Option<String> {
    std::fs::read_to_string(dir.join(file)).ok()
}

/// The kept credential, when it is for `node` and its CA has the token's hash.
pub fn load(data_dir: &Path, node: &str, token: &JoinToken) -> Option<NodeCredential> {
    let dir = data_dir.join(CREDENTIAL_DIR);
    let cred = NodeCredential {
        server_ca_pem: read(&dir, CA_FILE)?,
        cert_pem: read(&dir, CERT_FILE)?,
        key_pem: read(&dir, KEY_FILE)?,
        client_ca_pem: read(&dir, CLIENT_CA_FILE)?,
        endpoint_token: read(&dir, ENDPOINT_TOKEN_FILE).map(|t| t.trim().to_string()),
        dir: dir.clone(),
    };
    if read(&dir, NODE_FILE)?.trim() != node {
        return None;
    }
    let ca = CertificateDer::from_pem_slice(cred.server_ca_pem.as_bytes()).ok()?;
    crate::tls::constant_time_eq(&sha256(&ca), &token.ca_hash).then_some(cred)
}

fn private_dir(dir: &Path) -> Result<(), AgentError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| AgentError::io(dir, e))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| AgentError::io(dir, e))
}

/// The node's password: the kept one, else a new random one, kept (0600) before it is sent.
fn node_password(dir: &Path) -> Result<String, AgentError> {
    if let Some(p) = read(dir, PASSWORD_FILE).map(|p| p.trim().to_string())
        && ferrovirt_api::jointoken::valid_secret(&p)
    {
        return Ok(p);
    }
    private_dir(dir)?;
    let mut b = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b)
        .map_err(|_| join_err("the system RNG failed"))?;
    let p = hex(&b);
    crate::tls::write_file(&dir.join(PASSWORD_FILE), &p, 0o600)?;
    Ok(p)
}

fn store(cred: &NodeCredential, node: &str) -> Result<(), AgentError> {
    private_dir(&cred.dir)?;
    for (file, text) in [
        (KEY_FILE, &cred.key_pem),
        (CERT_FILE, &cred.cert_pem),
        (CA_FILE, &cred.server_ca_pem),
        (CLIENT_CA_FILE, &cred.client_ca_pem),
        (NODE_FILE, &node.to_string()),
    ] {
        crate::tls::write_file(&cred.dir.join(file), text, 0o600)?;
    }
    if let Some(t) = &cred.endpoint_token {
        crate::tls::write_file(&cred.dir.join(ENDPOINT_TOKEN_FILE), t, 0o600)?;
    }
    Ok(())
}

/// What joining needs.
#[derive(Debug, Clone)]
pub struct JoinOptions {
    /// `https://HOST:PORT` of the API server.
    pub server: String,
    pub token: JoinToken,
    pub node_name: String,
    /// The agent's data dir (the credential is kept under it).
    pub data_dir: PathBuf,
    /// The agent's user agent.
    pub user_agent: String,
}

/// The node's credential: the kept one when it still fits, else a new one from joining.
pub async fn join(opts: &JoinOptions) -> Result<NodeCredential, AgentError> {
    if let Some(c) = load(&opts.data_dir, &opts.node_name, &opts.token) {
        tracing::info!(dir = %c.dir.display(), "reusing the node credential");
        return Ok(c);
    }
    let chain = presented_chain(&opts.server).await?;
    let ca = pick_ca(&chain, &opts.token.ca_hash, &opts.server)?.clone();
    tracing::info!(
        ca_hash = %opts.token.ca_hash_hex(),
        "the server's CA matches the join token; joining"
    );
    let key = rcgen::KeyPair::generate().map_err(join_err)?;
    let node_password = node_password(&opts.data_dir.join(CREDENTIAL_DIR))?;
    use base64::Engine;
    let req = JoinRequest {
        node_password,
        secret: opts.token.secret.clone(),
        node_name: opts.node_name.clone(),
        public_key: base64::engine::general_purpose::STANDARD.encode(key.public_key_raw()),
    };
    let resp = post_join(&opts.server, &ca, &req, &opts.user_agent).await?;
    let server_ca_pem = pem("CERTIFICATE", &ca);
    let cred = NodeCredential {
        server_ca_pem,
        cert_pem: resp.certificate,
        key_pem: key.serialize_pem(),
        client_ca_pem: resp.client_ca,
        endpoint_token: resp.endpoint_token,
        dir: opts.data_dir.join(CREDENTIAL_DIR),
    };
    store(&cred, &opts.node_name)?;
    tracing::info!(dir = %cred.dir.display(), "joined: node credential stored");
    Ok(cred)
}

fn pem(label: &str, der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(chunk).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_falls_due_with_a_third_of_the_lifetime_left() {
        // 300 s lifetime: due from 200 s on.
        assert!(!renewal_due(1000, 1300, 1000));
        assert!(!renewal_due(1000, 1300, 1199));
        assert!(renewal_due(1000, 1300, 1200));
        assert!(renewal_due(1000, 1300, 1400));
        assert_eq!(renewal_at(0, 365 * 86_400), 365 * 86_400 * 2 / 3);
        // Reversed dates: due at the (past) end.
        assert_eq!(renewal_at(1300, 1000), 1000);
    }

    #[test]
    fn the_ca_with_the_token_hash_is_picked_else_refused_by_hash() {
        let a = CertificateDer::from(vec![1u8, 2, 3]);
        let b = CertificateDer::from(vec![4u8, 5, 6]);
        let chain = vec![a.clone(), b.clone()];
        assert_eq!(pick_ca(&chain, &sha256(&b), "https://x").unwrap(), &b);
        let wrong = [7u8; 32];
        let e = pick_ca(&chain, &wrong, "https://x")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("CA hash sha256:{}", hex(&wrong))),
            "{e}"
        );
        assert!(e.contains(&hex(&sha256(&a))), "{e}");
        assert!(
            pick_ca(&[], &wrong, "https://x")
                .unwrap_err()
                .to_string()
                .contains("none")
        );
    }

    #[test]
    fn server_urls() {
        assert_eq!(
            host_port("https://127.0.0.1:6443").unwrap(),
            ("127.0.0.1".into(), 6443)
        );
        assert_eq!(host_port("https://[::1]:1").unwrap(), ("::1".into(), 1));
        assert_eq!(
            host_port("https://example.test").unwrap(),
            ("example.test".into(), 443)
        );
        assert!(host_port("http://127.0.0.1:1").is_err());
        assert!(host_port("not a url").is_err());
    }

    #[test]
    fn kept_credential_is_private_and_bound_to_node_and_ca() {
        let dir = tempfile::tempdir().unwrap();
        let ca = CertificateDer::from(vec![9u8; 40]);
        let cred = NodeCredential {
            server_ca_pem: pem("CERTIFICATE", &ca),
            cert_pem: "cert".into(),
            key_pem: "key".into(),
            client_ca_pem: "cca".into(),
            endpoint_token: Some("et".into()),
            dir: dir.path().join(CREDENTIAL_DIR),
        };
        store(&cred, "n1").unwrap();
        let token = JoinToken {
            ca_hash: sha256(&ca),
            secret: "0123456789abcdef".into(),
        };
        let kept = load(dir.path(), "n1", &token).unwrap();
        assert_eq!(
            (kept.key_pem.as_str(), kept.endpoint_token.as_deref()),
            ("key", Some("et"))
        );
        assert!(load(dir.path(), "n2", &token).is_none());
        let other = JoinToken {
            ca_hash: [0; 32],
            ..token
        };
        assert!(load(dir.path(), "n1", &other).is_none());
        let pw = node_password(&cred.dir).unwrap();
        assert_eq!(pw.len(), 64);
        assert_eq!(node_password(&cred.dir).unwrap(), pw, "kept");
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: PathBuf| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(cred.dir.join(KEY_FILE)), 0o600);
        assert_eq!(mode(cred.dir.join(PASSWORD_FILE)), 0o600);
        assert_eq!(mode(cred.dir.clone()), 0o700);
    }
}
