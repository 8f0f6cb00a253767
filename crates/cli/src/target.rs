//! Which server the CLI talks to and with which credentials: `--kubeconfig`, else `$KUBECONFIG`,
//! else the local server's (`./.ferrovirt/server/kubeconfig.yaml` from the quick start, then
//! `/var/lib/ferrovirt/kubeconfig.yaml`), else `~/.kube/config`. Gives a kube-rs client for
//! plain requests and opens websockets (TLS trusting the kubeconfig's CA, bearer token).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine;
use http::Uri;
use tokio_rustls::client::TlsStream;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use crate::error::CliError;

/// KubeVirt's websocket subprotocol for console and VNC streams.
pub const WS_PROTOCOL: &str = "plain.kubevirt.io";

/// Candidate kubeconfig paths, in order.
pub fn kubeconfig_candidates(
    explicit: Option<&Path>,
    env: Option<&str>,
    home: Option<&str>,
) -> Vec<PathBuf> {
    if let Some(p) = explicit {
        return vec![p.to_path_buf()];
    }
    if let Some(e) = env.filter(|e| !e.is_empty()) {
        return e.split(':').map(PathBuf::from).collect();
    }
    let mut v = vec![
        PathBuf::from(".ferrovirt/server/kubeconfig.yaml"),
        PathBuf::from("/var/lib/ferrovirt/kubeconfig.yaml"),
    ];
    if let Some(h) = home {
        v.push(Path::new(h).join(".kube/config"));
    }
    v
}

/// A resolved server: URL pieces, CA and token.
#[derive(Clone)]
pub struct Target {
    pub kubeconfig: PathBuf,
    pub server: Uri,
    pub namespace: String,
    token: String,
    ca_pem: Vec<u8>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("kubeconfig", &self.kubeconfig)
            .field("server", &self.server)
            .finish_non_exhaustive()
    }
}

impl Target {
    /// Loads the first existing kubeconfig of [`kubeconfig_candidates`].
    pub fn load(explicit: Option<&Path>, namespace: Option<&str>) -> Result<Target, CliError> {
        let env = std::env::var("KUBECONFIG").ok();
        let home = std::env::var("HOME").ok();
        let candidates = kubeconfig_candidates(explicit, env.as_deref(), home.as_deref());
        let path = candidates
            .iter()
            .find(|p| p.is_file())
            .cloned()
            .ok_or_else(|| {
                CliError::Config(format!(
                    "no kubeconfig found (tried {}); pass --kubeconfig",
                    candidates
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
        let kc = kube::config::Kubeconfig::read_from(&path)
            .map_err(|e| CliError::Config(format!("{}: {e}", path.display())))?;
        let ctx_name = kc.current_context.clone().unwrap_or_default();
        let ctx = kc
            .contexts
            .iter()
            .find(|c| c.name == ctx_name)
            .or_else(|| kc.contexts.first())
            .and_then(|c| c.context.clone());
        let cluster_name = ctx.as_ref().map(|c| c.cluster.clone()).unwrap_or_default();
        let user_name = ctx
            .as_ref()
            .and_then(|c| c.user.clone())
            .unwrap_or_default();
        let cluster = kc
            .clusters
            .iter()
            .find(|c| c.name == cluster_name)
            .or_else(|| kc.clusters.first())
            .and_then(|c| c.cluster.clone())
            .ok_or_else(|| CliError::Config(format!("{}: no cluster", path.display())))?;
        let server: Uri = cluster
            .server
            .clone()
            .unwrap_or_default()
            .parse()
            .map_err(|e| CliError::Config(format!("{}: bad server URL: {e}", path.display())))?;
        let ca_pem = match &cluster.certificate_authority_data {
            Some(b64) => base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .map_err(|e| CliError::Config(format!("certificate-authority-data: {e}")))?,
            None => match &cluster.certificate_authority {
                Some(f) => std::fs::read(f).map_err(|e| CliError::Io {
                    context: format!("reading {f}"),
                    source: e,
                })?,
                None => Vec::new(),
            },
        };
        // The token is a secret string whose serialized form is the plain value.
        let users = serde_json::to_value(&kc.auth_infos).unwrap_or_default();
        let token = users
            .as_array()
            .into_iter()
            .flatten()
            .find(|u| u["name"] == user_name.as_str())
            .or_else(|| users.get(0))
            .and_then(|u| u["user"]["token"].as_str())
            .unwrap_or_default()
            .to_string();
        let namespace = namespace
            .map(String::from)
            .or_else(|| ctx.and_then(|c| c.namespace))
            .unwrap_or_else(|| "default".into());
        Ok(Target {
            kubeconfig: path,
            server,
            namespace,
            token,
            ca_pem,
        })
    }

    /// A kube-rs client for this target.
    pub async fn client(&self) -> Result<kube::Client, CliError> {
        let kc = kube::config::Kubeconfig::read_from(&self.kubeconfig)
            .map_err(|e| CliError::Config(e.to_string()))?;
        let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .map_err(|e| CliError::Config(e.to_string()))?;
        kube::Client::try_from(cfg).map_err(|e| CliError::Config(e.to_string()))
    }

    fn tls(&self) -> Result<tokio_rustls::TlsConnector, CliError> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut roots = rustls::RootCertStore::empty();
        use rustls::pki_types::pem::PemObject;
        for cert in rustls::pki_types::CertificateDer::pem_slice_iter(&self.ca_pem) {
            let cert = cert.map_err(|e| CliError::Config(format!("CA certificate: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| CliError::Config(format!("CA certificate: {e}")))?;
        }
        let cfg = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(tokio_rustls::TlsConnector::from(Arc::new(cfg)))
    }

    /// The bearer token.
    pub(crate) fn token(&self) -> &str {
        &self.token
    }

    /// A TLS connection to the server: trusting the kubeconfig's CA, or any certificate when
    /// `insecure`. Returns the stream and the host name used.
    pub(crate) async fn connect_tls(
        &self,
        insecure: bool,
    ) -> Result<(TlsStream<tokio::net::TcpStream>, String, u16), CliError> {
        let host = self.server.host().unwrap_or("127.0.0.1").to_string();
        let port = self.server.port_u16().unwrap_or(443);
        let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|e| CliError::Transport(format!("connecting to {host}:{port}: {e}")))?;
        let name = rustls::pki_types::ServerName::try_from(host.clone())
            .map_err(|e| CliError::Config(format!("server name {host}: {e}")))?;
        let connector = if insecure {
            crate::upload::insecure_connector()
        } else {
            self.tls()?
        };
        let tls = connector
            .connect(name, tcp)
            .await
            .map_err(|e| CliError::Transport(format!("TLS to {host}:{port}: {e}")))?;
        Ok((tls, host, port))
    }

    /// Opens a websocket to `path` (KubeVirt's `plain.kubevirt.io` subprotocol).
    pub async fn websocket(
        &self,
        path: &str,
    ) -> Result<WebSocketStream<TlsStream<tokio::net::TcpStream>>, CliError> {
        let (tls, host, port) = self.connect_tls(false).await?;
        let mut req = format!("wss://{host}:{port}{path}")
            .into_client_request()
            .map_err(|e| CliError::Transport(e.to_string()))?;
        let h = req.headers_mut();
        let auth = format!("Bearer {}", self.token)
            .parse()
            .map_err(|_| CliError::Config("the token is not a valid header value".into()))?;
        h.insert("Authorization", auth);
        h.insert(
            "Sec-WebSocket-Protocol",
            http::HeaderValue::from_static(WS_PROTOCOL),
        );
        match tokio_tungstenite::client_async(req, tls).await {
            Ok((ws, _)) => Ok(ws),
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
                let body = resp
                    .body()
                    .as_ref()
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .unwrap_or_default();
                Err(CliError::from_response(resp.status().as_u16(), &body))
            }
            Err(e) => Err(CliError::Transport(format!("websocket {path}: {e}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubeconfig_search_order() {
        assert_eq!(
            kubeconfig_candidates(Some(Path::new("/x")), Some("/y"), None),
            vec![PathBuf::from("/x")]
        );
        assert_eq!(
            kubeconfig_candidates(None, Some("/a:/b"), None),
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        let v = kubeconfig_candidates(None, None, Some("/home/u"));
        assert_eq!(v[0], PathBuf::from(".ferrovirt/server/kubeconfig.yaml"));
        assert_eq!(v.last(), Some(&PathBuf::from("/home/u/.kube/config")));
    }
}
