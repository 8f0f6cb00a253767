//! A small HTTP(S) downloader for the importer: GET with extra headers and basic auth,
//! following up to 5 redirects (credentials and secret headers to the original origin only,
//! never HTTPS to HTTP), streaming the body into a writer callback with progress, bounded in
//! size ([`TransferLimits`]: declared and counted bytes), stall time and overall time.
//! HTTPS uses rustls with the system's root certificates plus the PEM certificates of the
//! request (CDI's `certConfigMap`: every value of the ConfigMap is a PEM bundle of CAs).

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Uri};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::error::StorageError;

/// Basic-auth credentials (from the source's Secret: `accessKeyId`/`secretKey`).
#[derive(Clone, PartialEq, Eq)]
pub struct BasicAuth {
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for BasicAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BasicAuth")
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

/// Bounds of one transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferLimits {
    /// The most bytes accepted (declared in Content-Length or counted while streaming).
    pub max_bytes: u64,
    /// The longest the body may stall between two chunks (and the longest to wait for the
    /// response headers).
    pub stall_timeout: std::time::Duration,
    /// The longest the whole transfer may take.
    pub overall_timeout: std::time::Duration,
}

/// Default stall timeout of a transfer.
pub const DEFAULT_STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);
/// Default overall timeout of a transfer.
pub const DEFAULT_OVERALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(4 * 3600);
/// Redirects followed at most.
pub const MAX_REDIRECTS: usize = 5;

impl Default for TransferLimits {
    fn default() -> Self {
        TransferLimits {
            max_bytes: u64::MAX,
            stall_timeout: DEFAULT_STALL_TIMEOUT,
            overall_timeout: DEFAULT_OVERALL_TIMEOUT,
        }
    }
}

/// The most bytes a transfer (and a decompressed image) may hold for a claim of `capacity`
/// bytes: the claim plus a margin for image metadata (1/16 of it plus 64 MiB).
pub fn transfer_limit(capacity: u64) -> u64 {
    capacity
        .saturating_add(capacity / 16)
        .saturating_add(64 << 20)
}

/// `scheme://host:port` of `uri` (the port made explicit), for same-origin checks.
pub fn origin(uri: &Uri) -> String {
    let scheme = uri.scheme_str().unwrap_or("");
    let port = uri
        .port_u16()
        .unwrap_or(if scheme == "https" { 443 } else { 80 });
    format!(
        "{scheme}://{}:{port}",
        uri.host().unwrap_or("").to_ascii_lowercase()
    )
}

/// What to do about a redirect from `from` to `to` (pure): `Err` when it goes from HTTPS to
/// plain HTTP; `Ok(true)` when credentials may still be sent (same origin as `original`).
pub fn redirect_decision(original: &Uri, from: &Uri, to: &Uri) -> Result<bool, String> {
    if from.scheme_str() == Some("https") && to.scheme_str() != Some("https") {
        return Err(format!(
            "refusing a redirect from HTTPS to plain HTTP ({to})"
        ));
    }
    Ok(origin(original) == origin(to))
}

/// What to download.
#[derive(Debug, Clone, Default)]
pub struct DownloadRequest {
    pub url: String,
    /// `Name: value` header lines (CDI's `extraHeaders` / `secretExtraHeaders`).
    pub headers: Vec<String>,
    pub auth: Option<BasicAuth>,
    /// PEM bundles of extra CA certificates trusted besides the system roots.
    pub ca_pems: Vec<String>,
    /// Headers (`secretExtraHeaders`) sent only to the original origin, like `auth`.
    pub secret_headers: Vec<String>,
    /// Size and time bounds.
    pub limits: TransferLimits,
}

/// Split a `Name: value` header line.
pub fn parse_header(line: &str) -> Result<(http::HeaderName, http::HeaderValue), StorageError> {
    let (name, value) = line
        .split_once(':')
        .ok_or_else(|| StorageError::invalid("header", format!("{line:?} has no ':'")))?;
    let name = http::HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|e| StorageError::invalid("header", format!("{line:?}: {e}")))?;
    let value = http::HeaderValue::from_str(value.trim())
        .map_err(|e| StorageError::invalid("header", format!("{line:?}: {e}")))?;
    Ok((name, value))
}

pub(crate) trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// Parse PEM bundles into DER certificates; a bundle without any certificate is an error.
pub fn parse_ca_pems(
    pems: &[String],
) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, StorageError> {
    use rustls::pki_types::pem::PemObject;
    let mut out = Vec::new();
    for (i, pem) in pems.iter().enumerate() {
        let certs: Vec<_> = rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<Result<_, _>>()
            .map_err(|e| StorageError::invalid("CA certificate", format!("bundle {i}: {e}")))?;
        if certs.is_empty() {
            return Err(StorageError::invalid(
                "CA certificate",
                format!("bundle {i} holds no PEM CERTIFICATE block"),
            ));
        }
        out.extend(certs);
    }
    Ok(out)
}

/// A rustls client configuration trusting the system roots and the PEM bundles `ca_pems`.
pub fn tls_config(ca_pems: &[String]) -> Result<Arc<rustls::ClientConfig>, StorageError> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for cert in native.certs {
        let _ = roots.add(cert);
    }
    for cert in parse_ca_pems(ca_pems)? {
        roots
            .add(cert)
            .map_err(|e| StorageError::invalid("CA certificate", e.to_string()))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| StorageError::invalid("TLS configuration", e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(cfg))
}

async fn connect(uri: &Uri, url: &str, ca_pems: &[String]) -> Result<Box<dyn Io>, StorageError> {
    let tls = if uri.scheme_str() == Some("https") {
        Some(tls_config(ca_pems)?)
    } else {
        None
    };
    connect_with(uri, url, tls, "").await
}

/// How long a TCP connect may take.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Connects to the host of `uri` (`url` is its text, for messages): plain TCP for `http`, TLS
/// with `tls` for `https` (`None` there is an error). `tls_hint` is appended to TLS failures.
pub(crate) async fn connect_with(
    uri: &Uri,
    url: &str,
    tls: Option<Arc<rustls::ClientConfig>>,
    tls_hint: &str,
) -> Result<Box<dyn Io>, StorageError> {
    let herr = |m: String| StorageError::Http {
        url: url.to_string(),
        message: m,
    };
    let https = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        other => {
            return Err(StorageError::invalid(
                "URL",
                format!("{url}: unsupported scheme {other:?}"),
            ));
        }
    };
    let host = uri
        .host()
        .ok_or_else(|| StorageError::invalid("URL", format!("{url} has no host")))?;
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((bare, port)))
        .await
        .map_err(|_| herr(format!("connecting to {host}:{port} timed out")))?
        .map_err(|e| herr(format!("connecting to {host}:{port}: {e}")))?;
    if !https {
        return Ok(Box::new(tcp));
    }
    let tls = tls.ok_or_else(|| StorageError::invalid("URL", format!("{url}: no TLS settings")))?;
    let name = rustls::pki_types::ServerName::try_from(bare.to_string())
        .map_err(|e| StorageError::invalid("URL", format!("{url}: {e}")))?;
    let stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .map_err(|e| StorageError::Tls {
            url: url.to_string(),
            message: format!("{e}{tls_hint}"),
        })?;
    Ok(Box::new(stream))
}

/// GET `req.url` and pass the body to `sink` chunk by chunk; `progress(received, total)` is
/// called after each chunk (`total` from Content-Length when known). Returns the byte count.
/// Basic auth and the secret headers go to the original origin only; a redirect from HTTPS
/// to HTTP is refused, as are more than [`MAX_REDIRECTS`] redirects, a body larger than
/// `req.limits.max_bytes` (declared or counted), a stall longer than the stall timeout and a
/// transfer longer than the overall timeout.
pub async fn download(
    req: &DownloadRequest,
    sink: impl FnMut(&[u8]) -> Result<(), StorageError>,
    progress: impl FnMut(u64, Option<u64>),
) -> Result<u64, StorageError> {
    let overall = req.limits.overall_timeout;
    tokio::time::timeout(overall, download_in(req, sink, progress))
        .await
        .map_err(|_| StorageError::Http {
            url: req.url.clone(),
            message: format!(
                "the transfer did not finish within the overall timeout of {} s",
                overall.as_secs()
            ),
        })?
}

async fn download_in(
    req: &DownloadRequest,
    mut sink: impl FnMut(&[u8]) -> Result<(), StorageError>,
    mut progress: impl FnMut(u64, Option<u64>),
) -> Result<u64, StorageError> {
    let stall = req.limits.stall_timeout;
    let max = req.limits.max_bytes;
    let mut url = req.url.clone();
    let mut headers = Vec::new();
    for h in &req.headers {
        headers.push(parse_header(h)?);
    }
    let mut secret_headers = Vec::new();
    for h in &req.secret_headers {
        secret_headers.push(parse_header(h)?);
    }
    let original: Uri = url
        .parse()
        .map_err(|e| StorageError::invalid("URL", format!("{url}: {e}")))?;
    let mut credentials = true;
    for _redirect in 0..=MAX_REDIRECTS {
        let uri: Uri = url
            .parse()
            .map_err(|e| StorageError::invalid("URL", format!("{url}: {e}")))?;
        let herr = |m: String| StorageError::Http {
            url: url.clone(),
            message: m,
        };
        let io = connect(&uri, &url, &req.ca_pems).await?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .map_err(|e| herr(e.to_string()))?;
        let conn_task = tokio::spawn(conn);
        let authority = uri.authority().map(|a| a.as_str()).unwrap_or("");
        let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
        let mut builder = Request::get(path)
            .header(http::header::HOST, authority)
            .header(http::header::USER_AGENT, "ferrovirt-importer");
        if credentials {
            if let Some(a) = &req.auth {
                use base64::Engine;
                let token = base64::engine::general_purpose::STANDARD
                    .encode(format!("{}:{}", a.user, a.password));
                builder = builder.header(http::header::AUTHORIZATION, format!("Basic {token}"));
            }
            for (n, v) in &secret_headers {
                builder = builder.header(n, v);
            }
        }
        for (n, v) in &headers {
            builder = builder.header(n, v);
        }
        let request = builder
            .body(Empty::<Bytes>::new())
            .map_err(|e| herr(e.to_string()))?;
        let resp = tokio::time::timeout(stall, sender.send_request(request))
            .await
            .map_err(|_| {
                herr(format!(
                    "no response within the stall timeout of {} s",
                    stall.as_secs()
                ))
            })?
            .map_err(|e| herr(e.to_string()))?;
        let status = resp.status();
        if status.is_redirection() {
            conn_task.abort();
            let loc = resp
                .headers()
                .get(http::header::LOCATION)
                .and_then(|l| l.to_str().ok())
                .ok_or_else(|| herr(format!("{status} without a Location")))?;
            let next = resolve(&uri, loc);
            let next_uri: Uri = next
                .parse()
                .map_err(|e| herr(format!("redirect to {next:?}: {e}")))?;
            let same = redirect_decision(&original, &uri, &next_uri).map_err(herr)?;
            credentials = credentials && same;
            url = next;
            continue;
        }
        if !status.is_success() {
            conn_task.abort();
            return Err(herr(format!("server answered {status}")));
        }
        let total = resp
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if let Some(t) = total
            && t > max
        {
            conn_task.abort();
            return Err(StorageError::Refused(format!(
                "{url}: Content-Length {t} is more than the {max} bytes a claim of this size \
                 accepts"
            )));
        }
        let mut body = resp.into_body();
        let mut received = 0u64;
        loop {
            let frame = tokio::time::timeout(stall, body.frame())
                .await
                .map_err(|_| {
                    herr(format!(
                        "the transfer stalled for more than {} s after {received} bytes",
                        stall.as_secs()
                    ))
                })?;
            let Some(frame) = frame else { break };
            let frame = frame.map_err(|e| herr(e.to_string()))?;
            if let Some(data) = frame.data_ref() {
                received += data.len() as u64;
                if received > max {
                    conn_task.abort();
                    return Err(StorageError::Refused(format!(
                        "{url}: the body is more than the {max} bytes a claim of this size \
                         accepts"
                    )));
                }
                sink(data)?;
                progress(received, total);
            }
        }
        if let Some(t) = total
            && t != received
        {
            return Err(herr(format!("received {received} of {t} bytes")));
        }
        return Ok(received);
    }
    Err(StorageError::Http {
        url: req.url.clone(),
        message: format!("more than {MAX_REDIRECTS} redirects"),
    })
}

/// Resolve a Location header against the request URI (absolute URLs and absolute paths).
pub fn resolve(base: &Uri, location: &str) -> String {
    if location.contains("://") {
        return location.to_string();
    }
    let scheme = base.scheme_str().unwrap_or("http");
    let authority = base.authority().map(|a| a.as_str()).unwrap_or("");
    if location.starts_with('/') {
        format!("{scheme}://{authority}{location}")
    } else {
        let path = base.path();
        let dir = &path[..path.rfind('/').map(|i| i + 1).unwrap_or(0)];
        format!("{scheme}://{authority}{dir}{location}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_parse() {
        let (n, v) = parse_header("X-Token: abc def").unwrap();
        assert_eq!((n.as_str(), v.to_str().unwrap()), ("x-token", "abc def"));
        assert!(parse_header("nocolon").is_err());
        assert!(parse_header("bad name: x").is_err());
    }

    #[test]
    fn redirects_resolve() {
        let base: Uri = "http://h:8/a/b.img".parse().unwrap();
        assert_eq!(resolve(&base, "/c.img"), "http://h:8/c.img");
        assert_eq!(resolve(&base, "c.img"), "http://h:8/a/c.img");
        assert_eq!(resolve(&base, "https://x/y"), "https://x/y");
    }

    #[test]
    fn redirect_rules() {
        let u = |s: &str| s.parse::<Uri>().unwrap();
        let o = u("https://a:443/x");
        assert_eq!(redirect_decision(&o, &o, &u("https://a/y")), Ok(true));
        assert_eq!(redirect_decision(&o, &o, &u("https://b/y")), Ok(false));
        assert!(redirect_decision(&o, &o, &u("http://a/y")).is_err());
        let h = u("http://a:80/x");
        assert_eq!(redirect_decision(&h, &h, &u("http://a:81/y")), Ok(false));
        assert_eq!(transfer_limit(16 << 20), (17 << 20) + (64 << 20));
        assert_eq!(transfer_limit(u64::MAX), u64::MAX);
    }

    #[test]
    fn auth_debug_hides_password() {
        let a = BasicAuth {
            user: "u".into(),
            password: "secret".into(),
        };
        assert!(!format!("{a:?}").contains("secret"));
    }
}
