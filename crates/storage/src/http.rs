//! A small HTTP(S) downloader for the importer: GET with extra headers and basic auth,
//! following up to 5 redirects, streaming the body into a writer callback with progress.
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

/// What to download.
#[derive(Debug, Clone, Default)]
pub struct DownloadRequest {
    pub url: String,
    /// `Name: value` header lines (CDI's `extraHeaders` / `secretExtraHeaders`).
    pub headers: Vec<String>,
    pub auth: Option<BasicAuth>,
    /// PEM bundles of extra CA certificates trusted besides the system roots.
    pub ca_pems: Vec<String>,
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
pub async fn download(
    req: &DownloadRequest,
    mut sink: impl FnMut(&[u8]) -> Result<(), StorageError>,
    mut progress: impl FnMut(u64, Option<u64>),
) -> Result<u64, StorageError> {
    let mut url = req.url.clone();
    let mut headers = Vec::new();
    for h in &req.headers {
        headers.push(parse_header(h)?);
    }
    for _redirect in 0..=5 {
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
        if let Some(a) = &req.auth {
            use base64::Engine;
            let token = base64::engine::general_purpose::STANDARD
                .encode(format!("{}:{}", a.user, a.password));
            builder = builder.header(http::header::AUTHORIZATION, format!("Basic {token}"));
        }
        for (n, v) in &headers {
            builder = builder.header(n, v);
        }
        let request = builder
            .body(Empty::<Bytes>::new())
            .map_err(|e| herr(e.to_string()))?;
        let resp = sender
            .send_request(request)
            .await
            .map_err(|e| herr(e.to_string()))?;
        let status = resp.status();
        if status.is_redirection() {
            let loc = resp
                .headers()
                .get(http::header::LOCATION)
                .and_then(|l| l.to_str().ok())
                .ok_or_else(|| herr(format!("{status} without a Location")))?;
            url = resolve(&uri, loc);
            conn_task.abort();
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
        let mut body = resp.into_body();
        let mut received = 0u64;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| herr(e.to_string()))?;
            if let Some(data) = frame.data_ref() {
                sink(data)?;
                received += data.len() as u64;
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
        message: "too many redirects".into(),
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
    fn auth_debug_hides_password() {
        let a = BasicAuth {
            user: "u".into(),
            password: "secret".into(),
        };
        assert!(!format!("{a:?}").contains("secret"));
    }
}
