//! Test harness: a real server in a temp dir (SQLite store, 127.0.0.1:0), the machine's real
//! `kubectl` with a fresh cache dir, and a small raw HTTPS client.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use base64::Engine;
use bytes::Bytes;
use ferrovirt_apiserver::{Server, ServerOptions};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;

pub const KUBECTL: &str = "/usr/bin/kubectl";

pub struct TestServer {
    pub server: Option<Server>,
    pub dir: tempfile::TempDir,
    cache: tempfile::TempDir,
}

pub fn options(dir: &Path) -> ServerOptions {
    ServerOptions {
        data_dir: dir.to_path_buf(),
        listen: "127.0.0.1:0".parse().expect("addr"),
        gc_interval: Duration::from_secs(2),
        bookmark_interval: Duration::from_secs(1),
        ..Default::default()
    }
}

pub async fn start() -> Result<TestServer> {
    start_with(|_| {}).await
}

/// A server whose options `tune` adjusts first (limits, timeouts).
pub async fn start_with(tune: impl FnOnce(&mut ServerOptions)) -> Result<TestServer> {
    let dir = tempfile::tempdir()?;
    let mut opts = options(dir.path());
    tune(&mut opts);
    let server = Server::start(opts).await?;
    Ok(TestServer {
        server: Some(server),
        dir,
        cache: tempfile::tempdir()?,
    })
}

/// Fails the test when kubectl is missing: these tests must never skip silently.
pub fn require_kubectl() {
    assert!(
        Path::new(KUBECTL).exists(),
        "{KUBECTL} is required by the apiserver tests (install kubectl)"
    );
}

pub struct Resp {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

impl TestServer {
    pub fn srv(&self) -> &Server {
        self.server.as_ref().expect("running")
    }

    pub fn kubeconfig(&self) -> PathBuf {
        self.srv().kubeconfig_path.clone()
    }

    /// Runs kubectl with this server's kubeconfig and a private cache dir.
    pub async fn kubectl(&self, args: &[&str]) -> Result<Output> {
        self.kubectl_stdin(args, None).await
    }

    pub async fn kubectl_stdin(&self, args: &[&str], stdin: Option<&str>) -> Result<Output> {
        require_kubectl();
        let mut cmd = tokio::process::Command::new(KUBECTL);
        cmd.arg("--kubeconfig")
            .arg(self.kubeconfig())
            .arg("--cache-dir")
            .arg(self.cache.path())
            .args(args)
            .stdin(if stdin.is_some() {
                std::process::Stdio::piped()
            } else {
                std::process::Stdio::null()
            })
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().context("spawning kubectl")?;
        if let Some(input) = stdin {
            use tokio::io::AsyncWriteExt;
            let mut w = child.stdin.take().context("stdin")?;
            w.write_all(input.as_bytes()).await?;
            drop(w);
        }
        let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
            .await
            .context("kubectl timed out")??;
        Ok(out)
    }

    /// Runs kubectl and returns stdout; fails with stderr on a non-zero exit.
    pub async fn kubectl_ok(&self, args: &[&str]) -> Result<String> {
        let out = self.kubectl(args).await?;
        if !out.status.success() {
            bail!(
                "kubectl {:?} failed: {}\n{}",
                args,
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&out.stdout)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    pub async fn apply(&self, manifest: &str) -> Result<String> {
        let out = self
            .kubectl_stdin(&["apply", "-f", "-"], Some(manifest))
            .await?;
        if !out.status.success() {
            bail!(
                "kubectl apply failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// A raw HTTPS request with the admin token (or `token`).
    pub async fn request_as(
        &self,
        token: Option<&str>,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: Vec<u8>,
    ) -> Result<Resp> {
        self.raw(token, method, path, content_type, None, body)
            .await
    }

    /// GET with an Accept header.
    pub async fn request_accept(&self, path: &str, accept: &str) -> Result<Resp> {
        let token = self.srv().token.clone();
        self.raw(Some(&token), "GET", path, None, Some(accept), Vec::new())
            .await
    }

    /// A TLS connection to the server that trusts its CA (raw bytes from here on).
    pub async fn tls(&self) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        let srv = self.srv();
        let mut roots = rustls::RootCertStore::empty();
        let b64: String = srv
            .ca_pem
            .lines()
            .filter(|l| !l.starts_with("-----"))
            .collect();
        let der = base64::engine::general_purpose::STANDARD.decode(b64)?;
        roots.add(rustls::pki_types::CertificateDer::from(der))?;
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(srv.addr).await?;
        Ok(tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(rustls::pki_types::ServerName::try_from("localhost")?, tcp)
            .await?)
    }

    async fn raw(
        &self,
        token: Option<&str>,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        accept: Option<&str>,
        body: Vec<u8>,
    ) -> Result<Resp> {
        let srv = self.srv();
        let mut roots = rustls::RootCertStore::empty();
        let pem = &srv.ca_pem;
        let b64: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        let der = base64::engine::general_purpose::STANDARD.decode(b64)?;
        roots.add(rustls::pki_types::CertificateDer::from(der))?;
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(srv.addr).await?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(rustls::pki_types::ServerName::try_from("localhost")?, tcp)
            .await?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
        tokio::spawn(conn);
        let mut req = http::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "localhost");
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        if let Some(a) = accept {
            req = req.header("accept", a);
        }
        let resp = send
            .send_request(req.body(Full::new(Bytes::from(body)))?)
            .await?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = tokio::time::timeout(Duration::from_secs(30), resp.into_body().collect())
            .await
            .context("body timed out")??
            .to_bytes();
        Ok(Resp {
            status,
            headers,
            body,
        })
    }

    pub async fn request(&self, method: &str, path: &str, body: Option<Value>) -> Result<Resp> {
        let token = self.srv().token.clone();
        let (ct, bytes) = match body {
            Some(v) => (Some("application/json"), serde_json::to_vec(&v)?),
            None => (None, Vec::new()),
        };
        self.request_as(Some(&token), method, path, ct, bytes).await
    }

    pub async fn shutdown(mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown().await;
        }
    }
}
