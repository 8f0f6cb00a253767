//! The HTTP(S) downloader of the importer, on reqwest (HTTP/1, rustls with the ring
//! provider, no proxy, no automatic redirects or decompression): GET with extra headers and
//! basic auth, following up to 5 redirects itself (credentials and secret headers to the
//! original origin only, never HTTPS to HTTP), streaming the body into a writer callback with
//! progress, bounded in size ([`TransferLimits`]: declared and counted bytes), stall time and
//! overall time. Every hop obeys the request's [`AddressPolicy`]: IP-literal hosts are
//! checked before connecting, names through the client's filtering DNS resolver, and the
//! connected peer after it answers. HTTPS trusts the system's root certificates plus the PEM
//! certificates of the request (CDI's `certConfigMap`) and skips verification only when the
//! request says so (`insecureSkipVerify`, logged). [`client`], [`get`] and [`next_chunk`] are
//! shared with the registry client.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use reqwest::Url;

use crate::error::StorageError;
use crate::netpolicy::{self, AddressPolicy, FilteringResolver, Refusal};
pub use crate::tls::{parse_ca_pems, tls_config};

/// Basic-auth credentials (from the source's Secret: `accessKeyId`/`secretKey`).
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
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

/// `scheme://host:port` of `url` (the port made explicit), for same-origin checks.
pub fn origin(url: &Url) -> String {
    format!(
        "{}://{}:{}",
        url.scheme(),
        url.host_str().unwrap_or("").to_ascii_lowercase(),
        url.port_or_known_default().unwrap_or(0)
    )
}

/// What to do about a redirect from `from` to `to` (pure): `Err` when it goes from HTTPS to
/// plain HTTP; `Ok(true)` when credentials may still be sent (same origin as `original`).
pub fn redirect_decision(original: &Url, from: &Url, to: &Url) -> Result<bool, String> {
    if from.scheme() == "https" && to.scheme() != "https" {
        return Err(format!(
            "refusing a redirect from HTTPS to plain HTTP ({to})"
        ));
    }
    Ok(origin(original) == origin(to))
}

/// What to download.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
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
    /// Accept any server certificate (the source's `insecureSkipVerify`).
    pub insecure_skip_verify: bool,
    /// Which addresses every hop may connect to.
    pub address_policy: AddressPolicy,
}

/// Split a `Name: value` header line.
pub fn parse_header(line: &str) -> Result<(HeaderName, HeaderValue), StorageError> {
    let (name, value) = line
        .split_once(':')
        .ok_or_else(|| StorageError::invalid("header", format!("{line:?} has no ':'")))?;
    let name = HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|e| StorageError::invalid("header", format!("{line:?}: {e}")))?;
    let value = HeaderValue::from_str(value.trim())
        .map_err(|e| StorageError::invalid("header", format!("{line:?}: {e}")))?;
    Ok((name, value))
}

/// Parse an `http`/`https` URL with a host.
pub fn parse_url(url: &str) -> Result<Url, StorageError> {
    let u = Url::parse(url).map_err(|e| StorageError::invalid("URL", format!("{url}: {e}")))?;
    check_scheme(&u)?;
    Ok(u)
}

fn check_scheme(u: &Url) -> Result<(), StorageError> {
    if !matches!(u.scheme(), "http" | "https") {
        return Err(StorageError::invalid(
            "URL",
            format!("{u}: unsupported scheme {:?}", u.scheme()),
        ));
    }
    if u.host_str().is_none_or(str::is_empty) {
        return Err(StorageError::invalid("URL", format!("{u} has no host")));
    }
    Ok(())
}

/// How long a TCP connect may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// An HTTP/1 client with `tls`, no proxy, no automatic redirects, and DNS answers filtered
/// by `policy`.
pub(crate) fn client(
    tls: rustls::ClientConfig,
    policy: &Arc<AddressPolicy>,
    user_agent: &str,
) -> Result<reqwest::Client, StorageError> {
    reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(CONNECT_TIMEOUT)
        .dns_resolver(Arc::new(FilteringResolver::new(policy.clone())))
        .http1_only()
        .user_agent(user_agent)
        .build()
        .map_err(|e| StorageError::invalid("HTTP client", error_chain(&e)))
}

/// The TLS settings of a request: any certificate when `insecure` (logged), else the system
/// roots plus `ca_pems`.
pub(crate) fn tls_for(
    url: &str,
    ca_pems: &[String],
    insecure: bool,
) -> Result<rustls::ClientConfig, StorageError> {
    if insecure {
        tracing::warn!(
            url,
            "insecureSkipVerify is set: the server's TLS certificate is not verified"
        );
        crate::tls::insecure_tls_config()
    } else {
        tls_config(ca_pems)
    }
}

/// The cause of `e` (an `io::Error`'s own `source` skips the error it wraps).
fn cause<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> Option<&'a (dyn std::error::Error + 'static)> {
    match e
        .downcast_ref::<std::io::Error>()
        .and_then(|io| io.get_ref())
    {
        Some(inner) => Some(inner),
        None => e.source(),
    }
}

/// `e` and its causes, `: `-separated.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = cause(e);
    while let Some(c) = cur {
        let m = c.to_string();
        if !out.contains(&m) {
            out.push_str(": ");
            out.push_str(&m);
        }
        cur = cause(c);
    }
    out
}

/// The first cause of `e` of type `T`.
fn find_cause<'a, T: std::error::Error + 'static>(
    e: &'a (dyn std::error::Error + 'static),
) -> Option<&'a T> {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if let Some(t) = c.downcast_ref::<T>() {
            return Some(t);
        }
        cur = cause(c);
    }
    None
}

fn send_error(url: &Url, e: &reqwest::Error, tls_hint: &str) -> StorageError {
    if let Some(r) = find_cause::<Refusal>(e) {
        return StorageError::AddressRefused {
            url: url.to_string(),
            refusal: r.clone(),
        };
    }
    if let Some(t) = find_cause::<rustls::Error>(e) {
        return StorageError::Tls {
            url: url.to_string(),
            message: format!("{t}{tls_hint}"),
        };
    }
    StorageError::Http {
        url: url.to_string(),
        message: error_chain(e),
    }
}

/// One GET of `url` with `headers` on `client` (made with `policy`): an IP-literal host is
/// checked before connecting (the resolver sees names only) and the connected peer once the
/// response headers are in. Waits at most `response_timeout` for them; `tls_hint` is
/// appended to TLS failures.
pub(crate) async fn get(
    client: &reqwest::Client,
    policy: &AddressPolicy,
    url: &Url,
    headers: HeaderMap,
    response_timeout: Duration,
    tls_hint: &str,
) -> Result<reqwest::Response, StorageError> {
    check_scheme(url)?;
    let host = url.host_str().unwrap_or("").to_string();
    let literal = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
        .ok();
    let refused = |refusal: Refusal| StorageError::AddressRefused {
        url: url.to_string(),
        refusal,
    };
    if let Some(r) = literal.and_then(|a| netpolicy::refusal(policy, &host, a)) {
        return Err(refused(r));
    }
    let resp = tokio::time::timeout(
        response_timeout,
        client.get(url.clone()).headers(headers).send(),
    )
    .await
    .map_err(|_| StorageError::Http {
        url: url.to_string(),
        message: format!(
            "no response within {} s",
            response_timeout.as_secs_f64().round()
        ),
    })?
    .map_err(|e| send_error(url, &e, tls_hint))?;
    match resp.remote_addr() {
        Some(peer) => {
            if let Some(r) = netpolicy::refusal(policy, &host, peer.ip()) {
                return Err(refused(r));
            }
        }
        None if !policy.unrestricted => {
            return Err(StorageError::Http {
                url: url.to_string(),
                message: "the connected peer's address is unknown".into(),
            });
        }
        None => {}
    }
    Ok(resp)
}

/// The next chunk of `resp`'s body (`None` at its end), waiting at most `stall` for it;
/// `received` (bytes so far) goes into the stall message.
pub(crate) async fn next_chunk(
    resp: &mut reqwest::Response,
    url: &Url,
    stall: Duration,
    received: u64,
) -> Result<Option<Bytes>, StorageError> {
    tokio::time::timeout(stall, resp.chunk())
        .await
        .map_err(|_| StorageError::Http {
            url: url.to_string(),
            message: format!(
                "the transfer stalled for more than {} s after {received} bytes",
                stall.as_secs()
            ),
        })?
        .map_err(|e| StorageError::Http {
            url: url.to_string(),
            message: error_chain(&e),
        })
}

/// The target of a redirect answer `resp` to `url` (a Location resolved against `url`).
pub(crate) fn redirect_target(url: &Url, resp: &reqwest::Response) -> Result<Url, StorageError> {
    let herr = |m: String| StorageError::Http {
        url: url.to_string(),
        message: m,
    };
    let status = resp.status();
    let loc = resp
        .headers()
        .get(http::header::LOCATION)
        .and_then(|l| l.to_str().ok())
        .ok_or_else(|| herr(format!("{status} without a Location")))?;
    let next = url
        .join(loc)
        .map_err(|e| herr(format!("redirect to {loc:?}: {e}")))?;
    check_scheme(&next)?;
    Ok(next)
}

/// GET `req.url` and pass the body to `sink` chunk by chunk; `progress(received, total)` is
/// called after each chunk (`total` from Content-Length when known). Returns the byte count.
/// Basic auth and the secret headers go to the original origin only; a redirect from HTTPS
/// to HTTP is refused, as are more than [`MAX_REDIRECTS`] redirects, an address the
/// request's policy refuses (on any hop), a body larger than `req.limits.max_bytes`
/// (declared or counted), a stall longer than the stall timeout and a transfer longer than
/// the overall timeout.
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
    let headers = req
        .headers
        .iter()
        .map(|h| parse_header(h))
        .collect::<Result<Vec<_>, _>>()?;
    let secret_headers = req
        .secret_headers
        .iter()
        .map(|h| parse_header(h))
        .collect::<Result<Vec<_>, _>>()?;
    let original = parse_url(&req.url)?;
    let policy = Arc::new(req.address_policy.clone());
    let tls = tls_for(&req.url, &req.ca_pems, req.insecure_skip_verify)?;
    let client = client(tls, &policy, "ferrovirt-importer")?;
    let mut url = original.clone();
    let mut credentials = true;
    for _redirect in 0..=MAX_REDIRECTS {
        let herr = |m: String| StorageError::Http {
            url: url.to_string(),
            message: m,
        };
        let mut h = HeaderMap::new();
        if credentials {
            if let Some(a) = &req.auth {
                use base64::Engine;
                let token = base64::engine::general_purpose::STANDARD
                    .encode(format!("{}:{}", a.user, a.password));
                let v = HeaderValue::from_str(&format!("Basic {token}"))
                    .map_err(|e| StorageError::invalid("credentials", e.to_string()))?;
                h.append(http::header::AUTHORIZATION, v);
            }
            for (n, v) in &secret_headers {
                h.append(n, v.clone());
            }
        }
        for (n, v) in &headers {
            h.append(n, v.clone());
        }
        let mut resp = get(&client, &policy, &url, h, stall, "").await?;
        let status = resp.status();
        if status.is_redirection() {
            let next = redirect_target(&url, &resp)?;
            let same = redirect_decision(&original, &url, &next).map_err(herr)?;
            credentials = credentials && same;
            url = next;
            continue;
        }
        if !status.is_success() {
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
            return Err(StorageError::Refused(format!(
                "{url}: Content-Length {t} is more than the {max} bytes a claim of this size \
                 accepts"
            )));
        }
        let mut received = 0u64;
        while let Some(data) = next_chunk(&mut resp, &url, stall, received).await? {
            received += data.len() as u64;
            if received > max {
                return Err(StorageError::Refused(format!(
                    "{url}: the body is more than the {max} bytes a claim of this size accepts"
                )));
            }
            sink(&data)?;
            progress(received, total);
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
    fn urls_parse() {
        assert!(parse_url("http://h:8/a/b.img").is_ok());
        assert!(parse_url("file:///etc/passwd").is_err());
        assert!(parse_url("ftp://h/x").is_err());
        assert!(parse_url("not a url").is_err());
        let base = parse_url("http://h:8/a/b.img").unwrap();
        assert_eq!(base.join("/c.img").unwrap().as_str(), "http://h:8/c.img");
        assert_eq!(base.join("c.img").unwrap().as_str(), "http://h:8/a/c.img");
        assert_eq!(base.join("https://x/y").unwrap().as_str(), "https://x/y");
    }

    #[test]
    fn redirect_rules() {
        let u = |s: &str| Url::parse(s).unwrap();
        let o = u("https://a:443/x");
        assert_eq!(redirect_decision(&o, &o, &u("https://a/y")), Ok(true));
        assert_eq!(redirect_decision(&o, &o, &u("https://b/y")), Ok(false));
        assert!(redirect_decision(&o, &o, &u("http://a/y")).is_err());
        let h = u("http://a:80/x");
        assert_eq!(redirect_decision(&h, &h, &u("http://A/y")), Ok(true));
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
