//! The controllers' side of node-local storage: [`NodeStorage`] reaches the agent of one node
//! at the endpoint its Node publishes (TLS pinned to the published certificate fingerprint,
//! or plain HTTP to a loopback agent that publishes none, as [`crate::tls::transport`]
//! decides) with the agents' bearer token, and calls the routes of [`super::server`].

use std::time::Duration;

use axum::body::Bytes;
use http::{Method, Request, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Node;
use serde::Serialize;

use super::{CreateVolume, CreatedVolume, JobLine, NodeStoreError, Populate, ResizeVolume};
use crate::node::{ENDPOINT_ANNOTATION, FINGERPRINT_ANNOTATION};
use crate::tls::{self, AgentTarget};

/// How long connecting (TCP and TLS) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a volume request (create, delete, resize) may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a population may go without a line (the agent repeats its progress every 5 s).
const STALL_TIMEOUT: Duration = Duration::from_secs(60);
/// The most bytes of a non-streamed answer.
const MAX_ANSWER: usize = 1 << 20;

/// The request body type (JSON, or an upload stream).
pub type ReqBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// A population that did not succeed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PopulateFailure {
    /// Retrying cannot help (checksum mismatch, refused image or address, bad request).
    pub permanent: bool,
    pub message: String,
}

impl From<NodeStoreError> for PopulateFailure {
    fn from(e: NodeStoreError) -> Self {
        PopulateFailure {
            permanent: e.is_permanent(),
            message: e.to_string(),
        }
    }
}

/// The storage of one node, reached through its agent.
#[derive(Debug, Clone)]
pub struct NodeStorage {
    node: String,
    target: AgentTarget,
    token: String,
}

impl NodeStorage {
    /// The storage of `node` (from its published endpoint annotations), called with `token`.
    pub fn of(node: &Node, token: &str) -> Result<Self, NodeStoreError> {
        let name = node.metadata.name.clone().unwrap_or_default();
        let annotation = |key: &str| {
            node.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(key))
                .filter(|v| !v.is_empty())
                .cloned()
        };
        let no = |message: String| NodeStoreError::NoEndpoint {
            node: name.clone(),
            message,
        };
        let url = annotation(ENDPOINT_ANNOTATION)
            .ok_or_else(|| no("publishes no agent endpoint (is its agent running?)".into()))?;
        let target = tls::transport(&url, annotation(FINGERPRINT_ANNOTATION).as_deref())
            .map_err(|e| no(e.to_string()))?;
        Ok(NodeStorage {
            token: tls::endpoint_token(token, &name),
            node: name,
            target,
        })
    }

    /// The node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    fn unreachable(&self, message: impl Into<String>) -> NodeStoreError {
        NodeStoreError::Unreachable {
            node: self.node.clone(),
            message: message.into(),
        }
    }

    async fn connect(
        &self,
    ) -> Result<hyper::client::conn::http1::SendRequest<ReqBody>, NodeStoreError> {
        let t = &self.target;
        let connect = async {
            let tcp = tokio::net::TcpStream::connect(&t.authority)
                .await
                .map_err(|e| self.unreachable(e.to_string()))?;
            let _ = tcp.set_nodelay(true);
            match t.pin {
                None => handshake(tcp)
                    .await
                    .map_err(|e| self.unreachable(e.to_string())),
                Some(pin) => {
                    let s = tls::connect(tcp, &t.host, pin).await.map_err(|e| {
                        if tls::is_pin_mismatch(&e) {
                            self.unreachable(format!(
                                "its certificate does not match the Node's {FINGERPRINT_ANNOTATION}"
                            ))
                        } else {
                            self.unreachable(format!("TLS: {e}"))
                        }
                    })?;
                    handshake(s)
                        .await
                        .map_err(|e| self.unreachable(e.to_string()))
                }
            }
        };
        tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| self.unreachable("connecting timed out"))?
    }

    /// Sends one request; the answer when it is a success, else the agent's error.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        body: ReqBody,
        content_type: &str,
    ) -> Result<hyper::Response<Incoming>, NodeStoreError> {
        let mut send = self.connect().await?;
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, &self.target.authority)
            .header(header::AUTHORIZATION, format!("Bearer {}", self.token))
            .header(header::CONTENT_TYPE, content_type)
            .body(body)
            .map_err(|e| self.unreachable(e.to_string()))?;
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| self.unreachable(format!("request failed: {e}")))?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status().as_u16();
        let body = Limited::new(resp.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let message = match status {
            401 => "the agent refused the controllers' credentials".to_string(),
            _ => crate::endpoint::error_message(&body),
        };
        Err(NodeStoreError::Answer {
            node: self.node.clone(),
            status,
            message,
        })
    }

    async fn call<T: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: Option<&T>,
    ) -> Result<Bytes, NodeStoreError> {
        let bytes = match body {
            Some(b) => serde_json::to_vec(b).map_err(|e| self.unreachable(e.to_string()))?,
            None => Vec::new(),
        };
        let exchange = async {
            let resp = self
                .send(method, path, json_body(bytes), "application/json")
                .await?;
            Limited::new(resp.into_body(), MAX_ANSWER)
                .collect()
                .await
                .map(|b| b.to_bytes())
                .map_err(|e| self.unreachable(format!("reading the answer: {e}")))
        };
        tokio::time::timeout(REQUEST_TIMEOUT, exchange)
            .await
            .map_err(|_| self.unreachable("the agent did not answer in time"))?
    }

    /// Creates (or keeps) volume `name`; returns its directory on the node.
    pub async fn create(&self, name: &str, req: &CreateVolume) -> Result<String, NodeStoreError> {
        let body = self
            .call(Method::PUT, &volume_path(name, ""), Some(req))
            .await?;
        let made: CreatedVolume = serde_json::from_slice(&body)
            .map_err(|e| self.unreachable(format!("bad answer: {e}")))?;
        Ok(made.path)
    }

    /// Deletes volume `name` and its data (a missing one is not an error).
    pub async fn delete(&self, name: &str) -> Result<(), NodeStoreError> {
        self.call::<()>(Method::DELETE, &volume_path(name, ""), None)
            .await
            .map(drop)
    }

    /// Grows volume `name` to `bytes`.
    pub async fn resize(&self, name: &str, bytes: u64) -> Result<(), NodeStoreError> {
        let req = ResizeVolume { bytes };
        self.call(Method::POST, &volume_path(name, "/resize"), Some(&req))
            .await
            .map(drop)
    }

    /// Takes a snapshot of volume `name` (docs/snapshots.md); returns its handle.
    pub async fn snapshot(&self, name: &str) -> Result<super::TakenSnapshot, NodeStoreError> {
        let body = self
            .call::<()>(Method::POST, &volume_path(name, "/snapshots"), None)
            .await?;
        serde_json::from_slice(&body).map_err(|e| self.unreachable(format!("bad answer: {e}")))
    }

    /// Takes an online snapshot of volumes of the running VMI `uid` (docs/snapshots.md).
    pub async fn online_snapshot(
        &self,
        uid: &str,
        req: &super::online::OnlineSnapshot,
    ) -> Result<super::online::TakenOnline, NodeStoreError> {
        let body = self
            .call(
                Method::POST,
                &format!("/storage/vmis/{uid}/snapshot"),
                Some(req),
            )
            .await?;
        serde_json::from_slice(&body).map_err(|e| self.unreachable(format!("bad answer: {e}")))
    }

    /// Merges the released snapshot layers of volume `volume` of the running VMI `uid` in
    /// its QEMU (docs/snapshots.md "Reclaiming layers while the VM runs").
    pub async fn reclaim_online(
        &self,
        uid: &str,
        volume: &str,
    ) -> Result<ferrovirt_storage::snapshot::OnlineReport, NodeStoreError> {
        let req = super::online_reclaim::ReclaimOnline {
            volume: volume.to_string(),
        };
        let body = self
            .call(
                Method::POST,
                &format!("/storage/vmis/{uid}/reclaim"),
                Some(&req),
            )
            .await?;
        serde_json::from_slice(&body).map_err(|e| self.unreachable(format!("bad answer: {e}")))
    }

    /// Points volume `name` back at its snapshot `handle`.
    pub async fn revert(&self, name: &str, handle: &str) -> Result<(), NodeStoreError> {
        let req = super::RevertVolume {
            handle: handle.to_string(),
        };
        self.call(Method::POST, &volume_path(name, "/revert"), Some(&req))
            .await
            .map(drop)
    }

    /// Records the deleted snapshots `release` of volume `name` and, with `merge` (no VM uses
    /// the volume), drops every released layer.
    pub async fn reclaim(
        &self,
        name: &str,
        release: Vec<String>,
        merge: bool,
    ) -> Result<ferrovirt_storage::snapshot::reclaim::ReclaimReport, NodeStoreError> {
        let req = super::ReclaimVolume { release, merge };
        let body = self
            .call(Method::POST, &volume_path(name, "/reclaim"), Some(&req))
            .await?;
        serde_json::from_slice(&body).map_err(|e| self.unreachable(format!("bad answer: {e}")))
    }

    /// Opens the raw bytes of volume `name` (its snapshot `handle` when given) for export:
    /// the answer's body is the stream, its `Content-Length` the size.
    pub async fn read_export(
        &self,
        name: &str,
        handle: Option<&str>,
    ) -> Result<hyper::Response<Incoming>, NodeStoreError> {
        self.read_export_since(name, handle, None).await
    }

    /// [`NodeStorage::read_export`]; with `since` (an earlier snapshot's layer) only the
    /// chunks changed since, framed as `ferrovirt_storage::export::changed::frame` makes them.
    pub async fn read_export_since(
        &self,
        name: &str,
        handle: Option<&str>,
        since: Option<&str>,
    ) -> Result<hyper::Response<Incoming>, NodeStoreError> {
        // Layer names are plain file names (the agent checks them against the chain).
        let layer = |h: &str| {
            h.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        };
        let mut params = Vec::new();
        for (key, value) in [("handle", handle), ("since", since)] {
            match value {
                Some(h) if layer(h) => params.push(format!("{key}={h}")),
                Some(h) => {
                    return Err(NodeStoreError::Answer {
                        node: self.node.clone(),
                        status: 400,
                        message: format!("{h:?} is not a snapshot handle"),
                    });
                }
                None => {}
            }
        }
        let query = if params.is_empty() {
            String::new()
        } else {
            format!("?{}", params.join("&"))
        };
        let path = volume_path(name, &format!("/export{query}"));
        tokio::time::timeout(
            REQUEST_TIMEOUT,
            self.send(
                Method::GET,
                &path,
                json_body(Vec::new()),
                "application/json",
            ),
        )
        .await
        .map_err(|_| self.unreachable("the agent did not answer in time"))?
    }

    /// Populates volume `name`, calling `progress` with the agent's reports, until the agent
    /// says it is done or failed. Dropping the future stops the job on the node.
    pub async fn populate(
        &self,
        name: &str,
        req: &Populate,
        progress: impl FnMut(f64) + Send,
    ) -> Result<(), PopulateFailure> {
        let bytes = serde_json::to_vec(req).map_err(|e| PopulateFailure {
            permanent: true,
            message: e.to_string(),
        })?;
        let resp = self
            .send(
                Method::POST,
                &volume_path(name, "/populate"),
                json_body(bytes),
                "application/json",
            )
            .await?;
        self.read_job(resp, progress).await?
    }

    /// Streams an uploaded image (`body`, at most `limit` bytes) to volume `name` of
    /// `capacity` bytes, where the agent validates and converts it like an import; calls
    /// `progress` with the conversion's progress (50–100). The outer error is the exchange
    /// failing (the agent unreachable, or refusing the body: 409 interrupted, 413 too
    /// large), the inner one the image failing on the node.
    pub async fn upload(
        &self,
        name: &str,
        capacity: u64,
        limit: u64,
        body: ReqBody,
        progress: impl FnMut(f64) + Send,
    ) -> Result<Result<(), PopulateFailure>, NodeStoreError> {
        let path = volume_path(name, &format!("/upload?capacity={capacity}&limit={limit}"));
        let resp = self
            .send(Method::POST, &path, body, "application/octet-stream")
            .await?;
        self.read_job(resp, progress).await
    }

    /// Reads a job's [`JobLine`]s until its result (outer error: the exchange broke).
    async fn read_job(
        &self,
        resp: hyper::Response<Incoming>,
        mut progress: impl FnMut(f64) + Send,
    ) -> Result<Result<(), PopulateFailure>, NodeStoreError> {
        let mut body = resp.into_body();
        let mut buf: Vec<u8> = Vec::new();
        loop {
            let frame = tokio::time::timeout(STALL_TIMEOUT, body.frame())
                .await
                .map_err(|_| self.unreachable("the population stalled"))?;
            let Some(frame) = frame else {
                return Err(self.unreachable("the agent ended the population without a result"));
            };
            let frame = frame.map_err(|e| self.unreachable(e.to_string()))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            buf.extend_from_slice(&data);
            if buf.len() > MAX_ANSWER {
                return Err(self.unreachable("the agent sent an overlong line"));
            }
            while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                match serde_json::from_slice::<JobLine>(&line) {
                    Ok(JobLine::Progress { percent }) => progress(percent),
                    Ok(JobLine::Done) => return Ok(Ok(())),
                    Ok(JobLine::Failed { message, permanent }) => {
                        return Ok(Err(PopulateFailure { permanent, message }));
                    }
                    Err(e) => {
                        return Err(self.unreachable(format!("bad line from the agent: {e}")));
                    }
                }
            }
        }
    }
}

/// `/storage/volumes/{name}{suffix}` (PV names need no escaping; others are refused by the
/// agent).
pub fn volume_path(name: &str, suffix: &str) -> String {
    format!("/storage/volumes/{name}{suffix}")
}

/// A streamed request body (an upload).
pub fn stream_body<S>(stream: S) -> ReqBody
where
    S: futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
{
    let frames = futures::StreamExt::map(stream, |r| r.map(hyper::body::Frame::data));
    BodyExt::boxed_unsync(http_body_util::StreamBody::new(frames))
}

/// A JSON request body.
pub fn json_body(bytes: Vec<u8>) -> ReqBody {
    Full::new(Bytes::from(bytes))
        .map_err(|never| match never {})
        .boxed_unsync()
}

async fn handshake<I>(
    io: I,
) -> Result<hyper::client::conn::http1::SendRequest<ReqBody>, hyper::Error>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!("node storage connection: {e}");
        }
    });
    Ok(send)
}
