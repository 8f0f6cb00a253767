//! A client of the OCI distribution API (pull only): `GET /v2/<name>/manifests/<reference>`
//! with the Accept header of every manifest kind [`super::manifest`] parses, the linux/amd64
//! image of an index, and `GET /v2/<name>/blobs/<digest>` streamed to a file with its size
//! bounded and its sha256 verified. Authentication: anonymous first; on a 401 the
//! `WWW-Authenticate` challenge decides: Basic credentials, or the Bearer token flow (a token
//! from the challenge's realm for its service and scope, fetched with the credentials when
//! there are some). Plain HTTP only for registries listed as insecure; HTTPS (rustls) with the
//! system roots plus an optional CA bundle otherwise. Redirects (blob storage elsewhere) are
//! followed without the registry's Authorization header. Requests go through the importer's
//! HTTP client ([`crate::http`]: reqwest), so every hop obeys the options' [`AddressPolicy`].

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use http::{HeaderMap, HeaderValue, StatusCode, Uri};
use reqwest::{Response, Url};

use super::auth::{self, Challenge};
use super::manifest::{self, Descriptor, ImageManifest, Manifest};
use super::reference::{self, ImageRef};
use crate::error::StorageError;
use crate::http::BasicAuth;
use crate::netpolicy::AddressPolicy;

const RESPONSE_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest a body may stall between two chunks.
const STALL_TIMEOUT: Duration = Duration::from_secs(120);
const MAX_REDIRECTS: usize = 5;
/// The largest token-endpoint or error body read.
const MAX_SMALL_BODY: usize = 1 << 20;

/// How to reach registries.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct ClientOptions {
    /// Registries (`host[:port]`, `*.domain`) spoken to over plain HTTP.
    pub insecure_registries: Vec<String>,
    /// PEM CA certificates trusted besides the system roots (CDI's `certConfigMap`).
    pub extra_ca_pem: Vec<u8>,
    /// Credentials (CDI's `secretRef` accessKeyId/secretKey, or an image pull secret).
    pub auth: Option<BasicAuth>,
    /// Which addresses the registry (and every redirect and token endpoint) may have.
    pub address_policy: AddressPolicy,
}

/// An image manifest and its digest (the platform manifest's, after an index).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedImage {
    pub digest: String,
    pub manifest: ImageManifest,
}

/// A client for one repository of one registry.
pub struct RegistryClient {
    image: ImageRef,
    base: String,
    insecure: bool,
    insecure_list: Vec<String>,
    http: reqwest::Client,
    policy: Arc<AddressPolicy>,
    auth: Option<BasicAuth>,
    /// The Authorization header value that worked last (Basic or Bearer).
    authorization: Mutex<Option<String>>,
}

impl std::fmt::Debug for RegistryClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryClient")
            .field("image", &self.image)
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

/// A rustls client configuration with the system roots and the PEM certificates of `extra`.
pub fn tls_config(extra: &[u8]) -> Result<rustls::ClientConfig, StorageError> {
    if extra.is_empty() {
        crate::http::tls_config(&[])
    } else {
        crate::http::tls_config(&[String::from_utf8_lossy(extra).into_owned()])
    }
}

/// Percent-encodes a query value: everything but RFC 3986's unreserved characters.
fn encode_query(s: &str) -> String {
    const UNRESERVED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    percent_encoding::utf8_percent_encode(s, UNRESERVED).to_string()
}

/// The short message of a registry error body (`{"errors":[{"code":…,"message":…}]}`).
fn error_detail(body: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    v["errors"]
        .as_array()
        .and_then(|e| e.first())
        .map(|e| {
            format!(
                "{}: {}",
                e["code"].as_str().unwrap_or(""),
                e["message"].as_str().unwrap_or("")
            )
        })
        .unwrap_or_default()
}

impl RegistryClient {
    /// A client for `image`'s repository.
    pub fn new(image: &ImageRef, opts: &ClientOptions) -> Result<Self, StorageError> {
        let insecure = reference::is_insecure(&image.registry, &opts.insecure_registries);
        let scheme = if insecure { "http" } else { "https" };
        let policy = Arc::new(opts.address_policy.clone());
        let http = crate::http::client(
            tls_config(&opts.extra_ca_pem)?,
            &policy,
            "ferrovirt-registry-client",
        )?;
        Ok(RegistryClient {
            base: format!("{scheme}://{}", image.api_host()),
            image: image.clone(),
            insecure,
            insecure_list: opts.insecure_registries.clone(),
            http,
            policy,
            auth: opts.auth.clone(),
            authorization: Mutex::new(None),
        })
    }

    /// Whether this client speaks plain HTTP.
    pub fn insecure(&self) -> bool {
        self.insecure
    }

    fn http_err(&self, url: &str, m: impl Into<String>) -> StorageError {
        StorageError::Http {
            url: url.to_string(),
            message: m.into(),
        }
    }

    /// One GET.
    async fn send(
        &self,
        url: &str,
        accept: Option<&str>,
        authorization: Option<&str>,
    ) -> Result<Response, StorageError> {
        let u = crate::http::parse_url(url)?;
        let mut h = HeaderMap::new();
        let value = |v: &str| {
            HeaderValue::from_str(v).map_err(|e| StorageError::invalid("header", e.to_string()))
        };
        if let Some(a) = accept {
            h.insert(http::header::ACCEPT, value(a)?);
        }
        if let Some(a) = authorization {
            h.insert(http::header::AUTHORIZATION, value(a)?);
        }
        crate::http::get(
            &self.http,
            &self.policy,
            &u,
            h,
            RESPONSE_TIMEOUT,
            " (list the registry as insecure to use plain HTTP, or give its CA in certConfigMap)",
        )
        .await
    }

    /// Reads a whole (small) body, at most `max` bytes.
    async fn read_body(
        &self,
        url: &str,
        mut resp: Response,
        max: usize,
    ) -> Result<Vec<u8>, StorageError> {
        let u = crate::http::parse_url(url)?;
        let mut out = Vec::new();
        while let Some(d) =
            crate::http::next_chunk(&mut resp, &u, STALL_TIMEOUT, out.len() as u64).await?
        {
            if out.len() + d.len() > max {
                return Err(StorageError::Refused(format!(
                    "{url}: the response is larger than {max} bytes"
                )));
            }
            out.extend_from_slice(&d);
        }
        Ok(out)
    }

    async fn fetch_token(
        &self,
        realm: &str,
        service: Option<&str>,
        scope: &str,
    ) -> Result<String, StorageError> {
        let realm_uri: Uri = realm
            .parse()
            .map_err(|e| StorageError::invalid("token realm", format!("{realm}: {e}")))?;
        let realm_host = realm_uri.authority().map(|a| a.as_str()).unwrap_or("");
        if realm_uri.scheme_str() == Some("http")
            && !reference::is_insecure(realm_host, &self.insecure_list)
        {
            return Err(StorageError::invalid(
                "token realm",
                format!("{realm} is plain HTTP and {realm_host} is not an insecure registry"),
            ));
        }
        let mut url = realm.to_string();
        url.push(if realm.contains('?') { '&' } else { '?' });
        if let Some(s) = service {
            url.push_str(&format!("service={}&", encode_query(s)));
        }
        url.push_str(&format!("scope={}", encode_query(scope)));
        let basic = self.auth.as_ref().map(basic_header);
        let resp = self.send(&url, None, basic.as_deref()).await?;
        let status = resp.status();
        let body = self.read_body(&url, resp, MAX_SMALL_BODY).await?;
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            return Err(self.unauthorized(status));
        }
        if !status.is_success() {
            return Err(self.http_err(&url, format!("token endpoint answered {status}")));
        }
        auth::parse_token(&body)
    }

    fn unauthorized(&self, status: StatusCode) -> StorageError {
        let what = format!(
            "{} for repository {} ({status})",
            self.image.registry, self.image.repository
        );
        match &self.auth {
            Some(a) => StorageError::invalid(
                "registry credentials",
                format!("authentication as {:?} failed at {what}", a.user),
            ),
            None => StorageError::invalid(
                "registry credentials",
                format!("{what}: the registry requires credentials and none were given"),
            ),
        }
    }

    /// GET `path` (below the registry's base URL), authenticating on a 401 and following
    /// redirects. Returns a successful response.
    async fn get(&self, path: &str, accept: Option<&str>) -> Result<Response, StorageError> {
        let mut url = format!("{}{path}", self.base);
        let mut retried_auth = false;
        let mut same_origin = true;
        for _ in 0..=MAX_REDIRECTS {
            let authz = if same_origin {
                self.authorization.lock().expect("lock").clone()
            } else {
                None
            };
            let resp = self.send(&url, accept, authz.as_deref()).await?;
            let status = resp.status();
            if status == StatusCode::UNAUTHORIZED && same_origin {
                if retried_auth {
                    return Err(self.unauthorized(status));
                }
                retried_auth = true;
                let challenge = resp
                    .headers()
                    .get(http::header::WWW_AUTHENTICATE)
                    .and_then(|h| h.to_str().ok())
                    .and_then(auth::parse_challenge);
                let header = match challenge {
                    Some(Challenge::Basic) => match &self.auth {
                        Some(a) => basic_header(a),
                        None => return Err(self.unauthorized(status)),
                    },
                    Some(Challenge::Bearer {
                        realm,
                        service,
                        scope,
                    }) => {
                        let scope =
                            scope.unwrap_or_else(|| auth::pull_scope(&self.image.repository));
                        let token = self.fetch_token(&realm, service.as_deref(), &scope).await?;
                        format!("Bearer {token}")
                    }
                    None => return Err(self.unauthorized(status)),
                };
                *self.authorization.lock().expect("lock") = Some(header);
                continue;
            }
            if status.is_redirection() {
                let base: Url = crate::http::parse_url(&url)?;
                let next = crate::http::redirect_target(&base, &resp)?;
                same_origin =
                    same_origin && crate::http::origin(&next) == crate::http::origin(&base);
                if next.scheme() == "http" && !self.insecure {
                    return Err(self.http_err(
                        &url,
                        format!("refusing a redirect from HTTPS to plain HTTP ({next})"),
                    ));
                }
                url = next.to_string();
                continue;
            }
            if !status.is_success() {
                let body = self
                    .read_body(&url, resp, MAX_SMALL_BODY)
                    .await
                    .unwrap_or_default();
                let detail = error_detail(&body);
                if status == StatusCode::FORBIDDEN {
                    return Err(self.unauthorized(status));
                }
                return Err(self.http_err(
                    &url,
                    if detail.is_empty() {
                        format!("registry answered {status}")
                    } else {
                        format!("registry answered {status} ({detail})")
                    },
                ));
            }
            return Ok(resp);
        }
        Err(self.http_err(&url, "too many redirects"))
    }

    /// GET a manifest by tag or digest; returns the digest of its bytes (verified against the
    /// reference when that is a digest), its Content-Type and its bytes.
    async fn manifest_bytes(
        &self,
        reference: &str,
    ) -> Result<(String, String, Vec<u8>), StorageError> {
        let path = format!("/v2/{}/manifests/{reference}", self.image.repository);
        let resp = self.get(&path, Some(&manifest::accept_header())).await?;
        let ct = resp
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let header_digest = resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .map(String::from);
        let url = format!("{}{path}", self.base);
        let body = self
            .read_body(&url, resp, manifest::MAX_MANIFEST_BYTES)
            .await?;
        let digest = manifest::sha256_digest(&body);
        let expected = if reference::valid_digest(reference) {
            Some(reference.to_string())
        } else {
            header_digest.filter(|d| d.starts_with("sha256:"))
        };
        if let Some(e) = expected
            && e != digest
        {
            return Err(StorageError::ChecksumMismatch {
                expected: e,
                actual: digest,
            });
        }
        Ok((digest, ct, body))
    }

    /// Resolves the image to its linux/amd64 image manifest.
    pub async fn resolve(&self) -> Result<ResolvedImage, StorageError> {
        let mut reference = self.image.reference().to_string();
        for _depth in 0..2 {
            let (digest, ct, body) = self.manifest_bytes(&reference).await?;
            match manifest::parse(&ct, &body)? {
                Manifest::Image(manifest) => return Ok(ResolvedImage { digest, manifest }),
                Manifest::Index(entries) => {
                    reference = manifest::pick_platform(&entries, "linux", "amd64")?
                        .digest
                        .clone();
                }
            }
        }
        Err(StorageError::Refused(
            "an image index points at another index".into(),
        ))
    }

    /// Downloads the blob `desc` into `dst`, refusing more than `max` bytes and verifying its
    /// size and sha256; `progress(received)` after each chunk.
    pub async fn fetch_blob(
        &self,
        desc: &Descriptor,
        dst: &Path,
        max: u64,
        mut progress: impl FnMut(u64) + Send,
    ) -> Result<(), StorageError> {
        if !reference::valid_digest(&desc.digest) {
            return Err(StorageError::invalid(
                "blob digest",
                format!("{:?} is not sha256:<64 hex digits>", desc.digest),
            ));
        }
        if desc.size > max {
            return Err(StorageError::Refused(format!(
                "blob {} is {} bytes, more than the {max} bytes allowed",
                desc.digest, desc.size
            )));
        }
        let path = format!("/v2/{}/blobs/{}", self.image.repository, desc.digest);
        let url = crate::http::parse_url(&format!("{}{path}", self.base))?;
        let mut resp = self.get(&path, None).await?;
        let mut file = std::fs::File::create(dst).map_err(|e| StorageError::io(dst, e))?;
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        let mut received = 0u64;
        while let Some(d) =
            crate::http::next_chunk(&mut resp, &url, STALL_TIMEOUT, received).await?
        {
            received += d.len() as u64;
            if received > desc.size {
                return Err(StorageError::Refused(format!(
                    "blob {} is larger than its declared {} bytes",
                    desc.digest, desc.size
                )));
            }
            ctx.update(&d);
            file.write_all(&d).map_err(|e| StorageError::io(dst, e))?;
            progress(received);
        }
        file.flush().map_err(|e| StorageError::io(dst, e))?;
        if received != desc.size {
            return Err(self.http_err(
                url.as_str(),
                format!("received {received} of {} bytes", desc.size),
            ));
        }
        let actual = format!("sha256:{}", manifest::hex(ctx.finish().as_ref()));
        if actual != desc.digest {
            return Err(StorageError::ChecksumMismatch {
                expected: desc.digest.clone(),
                actual,
            });
        }
        Ok(())
    }
}

fn basic_header(a: &BasicAuth) -> String {
    let token =
        base64::engine::general_purpose::STANDARD.encode(format!("{}:{}", a.user, a.password));
    format!("Basic {token}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_queries_and_errors() {
        assert_eq!(
            encode_query("repository:a/b:pull"),
            "repository%3Aa%2Fb%3Apull"
        );
        assert_eq!(
            error_detail(
                br#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}"#
            ),
            "MANIFEST_UNKNOWN: manifest unknown"
        );
        assert_eq!(error_detail(b"<html>"), "");
    }

    #[test]
    fn insecure_registries_use_http() {
        let img = reference::parse("image", "127.0.0.1:5000/a/b:c").unwrap();
        let c = RegistryClient::new(
            &img,
            &ClientOptions {
                insecure_registries: vec!["127.0.0.1:5000".into()],
                ..Default::default()
            },
        )
        .unwrap();
        assert!(c.insecure());
        assert_eq!(c.base, "http://127.0.0.1:5000");
        let c = RegistryClient::new(&img, &ClientOptions::default()).unwrap();
        assert_eq!(c.base, "https://127.0.0.1:5000");
        let bad = ClientOptions {
            extra_ca_pem: b"not a certificate".to_vec(),
            ..Default::default()
        };
        assert!(RegistryClient::new(&img, &bad).is_err());
    }
}
