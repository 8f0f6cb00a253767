//! The CLI's HTTP transport for what kube-rs's `Client` cannot carry: websockets with KubeVirt's
//! `plain.kubevirt.io` subprotocol (console, VNC, port-forward; kube-rs's `connect` only speaks
//! the `channel.k8s.io` ones) and streamed request bodies (image upload; kube-rs's request
//! body is buffered). It is built from the same `kube::Config` as the client through kube-rs's
//! own layers (`ConfigExt`: base URI, authentication: tokens, token files, exec plugins with
//! refresh, extra/impersonation headers; rustls with the kubeconfig's CA and client
//! certificate), so every verb authenticates the way `kubectl` does.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Incoming;
use hyper::upgrade::Upgraded;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kube::client::ConfigExt;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;
use tower::util::BoxCloneSyncService;
use tower::{BoxError, ServiceBuilder, ServiceExt};

use crate::error::CliError;

/// KubeVirt's websocket subprotocol for console, VNC and port-forward streams.
pub const WS_PROTOCOL: &str = "plain.kubevirt.io";

/// A request body: empty, or streamed.
pub type RequestBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// A websocket upgraded from an API server connection.
pub type ApiWebSocket = WebSocketStream<TokioIo<Upgraded>>;

/// The most bytes read of an error answer.
const MAX_ERROR_BODY: usize = 1 << 20;

/// An authenticated HTTP/1 client for the API server of one `kube::Config`.
#[derive(Clone)]
pub struct Transport {
    svc: BoxCloneSyncService<Request<RequestBody>, Response<Incoming>, BoxError>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport").finish_non_exhaustive()
    }
}

fn config_err(e: impl std::fmt::Display) -> CliError {
    CliError::Config(e.to_string())
}

/// An empty request body.
pub fn empty_body() -> RequestBody {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

impl Transport {
    /// The transport of `config` (its CA, client certificate, credentials and headers).
    pub fn new(config: &kube::Config) -> Result<Transport, CliError> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let connector = config.rustls_https_connector().map_err(config_err)?;
        let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build::<_, RequestBody>(connector);
        let svc = ServiceBuilder::new()
            .layer(config.base_uri_layer())
            .option_layer(config.auth_layer().map_err(config_err)?)
            .layer(config.extra_headers_layer().map_err(config_err)?)
            .map_err(BoxError::from)
            .service(client);
        Ok(Transport {
            svc: BoxCloneSyncService::new(svc),
        })
    }

    /// Sends one request (`uri` is a path and query on the API server).
    pub async fn send(&self, req: Request<RequestBody>) -> Result<Response<Incoming>, CliError> {
        let what = format!("{} {}", req.method(), req.uri().path());
        self.svc
            .clone()
            .oneshot(req)
            .await
            .map_err(|e| CliError::Transport(format!("{what}: {}", error_chain(&*e))))
    }

    /// Opens a `plain.kubevirt.io` websocket to `path`.
    pub async fn websocket(&self, path: &str) -> Result<ApiWebSocket, CliError> {
        let key = tokio_tungstenite::tungstenite::handshake::client::generate_key();
        let req = Request::get(path)
            .header(header::CONNECTION, "Upgrade")
            .header(header::UPGRADE, "websocket")
            .header(header::SEC_WEBSOCKET_VERSION, "13")
            .header(header::SEC_WEBSOCKET_KEY, &key)
            .header(header::SEC_WEBSOCKET_PROTOCOL, WS_PROTOCOL)
            .body(empty_body())
            .map_err(|e| CliError::Transport(e.to_string()))?;
        let resp = self.send(req).await?;
        if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
            return Err(error_response(resp).await);
        }
        check_upgrade(&resp, &key)
            .map_err(|e| CliError::Transport(format!("websocket {path}: {e}")))?;
        let upgraded = hyper::upgrade::on(resp)
            .await
            .map_err(|e| CliError::Transport(format!("websocket {path}: {e}")))?;
        Ok(WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Client, None).await)
    }
}

/// The `CliError` of a non-success answer (a `metav1.Status` body when the server sent one).
pub async fn error_response(resp: Response<Incoming>) -> CliError {
    let code = resp.status().as_u16();
    let body = Limited::new(resp.into_body(), MAX_ERROR_BODY)
        .collect()
        .await
        .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
        .unwrap_or_default();
    CliError::from_response(code, &body)
}

/// Reads a whole (bounded) answer body.
pub async fn read_body(resp: Response<Incoming>, limit: usize) -> Result<Bytes, CliError> {
    Limited::new(resp.into_body(), limit)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .map_err(|e| CliError::Transport(format!("reading the answer: {e}")))
}

/// Checks a 101 answer against RFC 6455 and KubeVirt's subprotocol.
pub fn check_upgrade<B>(resp: &Response<B>, key: &str) -> Result<(), String> {
    let h = resp.headers();
    let is = |name: header::HeaderName, want: &str| {
        h.get(name)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.split(',').any(|p| p.trim().eq_ignore_ascii_case(want)))
    };
    if !is(header::UPGRADE, "websocket") {
        return Err("the answer does not upgrade to websocket".into());
    }
    let accept = h.get(header::SEC_WEBSOCKET_ACCEPT).map(|v| v.as_bytes());
    if accept != Some(derive_accept_key(key.as_bytes()).as_bytes()) {
        return Err("Sec-WebSocket-Accept does not match the key".into());
    }
    match h.get(header::SEC_WEBSOCKET_PROTOCOL) {
        Some(p) if p.as_bytes() != WS_PROTOCOL.as_bytes() => Err(format!(
            "the server chose subprotocol {:?}, not {WS_PROTOCOL}",
            String::from_utf8_lossy(p.as_bytes())
        )),
        _ => Ok(()),
    }
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upgrade_answers_are_checked() {
        let key = "dGhlIHNhbXBsZSBub25jZQ==";
        let ok = Response::builder()
            .status(101)
            .header("Upgrade", "websocket")
            .header("Sec-WebSocket-Accept", "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")
            .header("Sec-WebSocket-Protocol", WS_PROTOCOL)
            .body(())
            .unwrap();
        assert_eq!(check_upgrade(&ok, key), Ok(()));
        let wrong_key = Response::builder()
            .status(101)
            .header("Upgrade", "websocket")
            .header("Sec-WebSocket-Accept", "nope")
            .body(())
            .unwrap();
        assert!(check_upgrade(&wrong_key, key).is_err());
        let other_protocol = Response::builder()
            .status(101)
            .header("Upgrade", "WebSocket")
            .header("Sec-WebSocket-Accept", "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")
            .header("Sec-WebSocket-Protocol", "v4.channel.k8s.io")
            .body(())
            .unwrap();
        assert!(
            check_upgrade(&other_protocol, key)
                .unwrap_err()
                .contains("v4.channel")
        );
    }
}
