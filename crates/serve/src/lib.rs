//! The TLS accept loop shared by the API server and the agent endpoint: HTTP/1.1 (with
//! upgrades) over rustls, with the limits that keep one client from taking the listener away
//! from everyone else.
//!
//! - **Connections:** at most [`Limits::max_connections`] at once (and never more than the
//!   process's file-descriptor limit allows, which [`raise_nofile_limit`] lifts to its hard
//!   maximum); a connection above the cap is closed at once.
//! - **Unfinished connections:** a connection is *pending* from `accept` until the head of its
//!   first request has been read (TLS handshake and headers). At most [`Limits::max_pending`]
//!   are pending; when a new one arrives beyond that, the oldest pending one is closed. So
//!   half-open or slowloris connections can hold only that many slots, and a real client's
//!   handshake, which takes milliseconds, still gets through.
//! - **Timeouts:** the TLS handshake ([`Limits::handshake_timeout`]) and reading each request's
//!   head ([`Limits::header_read_timeout`], which in hyper also bounds how long a keep-alive
//!   connection may sit idle before its next request). Responses are never timed out: watches,
//!   console and port-forward streams (upgraded connections) last as long as they need.
//!   Request bodies are bounded by whoever reads them (the API server's body reader).
//! - **Unread bodies:** what the application left of a request body is read before its answer,
//!   within bounds, so that the client can finish sending it ([`drain`]).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::{AbortHandle, JoinSet};
use tower_service::Service;

pub mod drain;

/// The DER certificate a client presented and the TLS configuration's verifier accepted; a
/// request extension on every request of that connection.
#[derive(Debug, Clone)]
pub struct PeerCertificate(pub Arc<[u8]>);

/// The accept loop's limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Open connections at most (also capped by the file-descriptor limit). Default 4096.
    pub max_connections: usize,
    /// Connections that have not yet sent their first request head. Default 256.
    pub max_pending: usize,
    /// Time to complete the TLS handshake. Default 10 s.
    pub handshake_timeout: Duration,
    /// Time to send a request's head, and the longest a keep-alive connection stays idle
    /// between requests. Default 30 s.
    pub header_read_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            max_pending: 256,
            handshake_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(30),
        }
    }
}

/// File descriptors kept free for everything that is not a client connection.
const FD_RESERVE: u64 = 512;

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (as Go's runtime does) and returns the
/// soft limit now in force (None when it cannot be read).
pub fn raise_nofile_limit() -> Option<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).ok()?;
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        return Some(hard);
    }
    Some(soft)
}

/// The connection cap actually used: `configured`, but leaving [`FD_RESERVE`] descriptors of
/// `nofile` free (and at least 16 connections).
pub fn effective_max_connections(configured: usize, nofile: Option<u64>) -> usize {
    match nofile {
        Some(n) => configured.min(n.saturating_sub(FD_RESERVE).max(16) as usize),
        None => configured,
    }
}

/// Connections still in their handshake or first request head, oldest first.
#[derive(Default)]
struct Pending {
    next: u64,
    conns: BTreeMap<u64, AbortHandle>,
}

fn lock(m: &Mutex<Pending>) -> std::sync::MutexGuard<'_, Pending> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Serves `app` over TLS on `listener` within `limits` until `shutdown` completes; then open
/// connections are closed. `name` labels log lines.
pub async fn serve(
    name: &'static str,
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let max_conns = effective_max_connections(limits.max_connections, raise_nofile_limit());
    let permits = Arc::new(Semaphore::new(max_conns));
    let pending = Arc::new(Mutex::new(Pending::default()));
    let mut conns = JoinSet::new();
    let mut refused: u64 = 0;
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = &mut shutdown => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        let (tcp, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                // Out of descriptors, most likely: back off instead of spinning.
                tracing::warn!("{name}: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            refused += 1;
            if refused.is_power_of_two() {
                tracing::warn!(
                    "{name}: {max_conns} connections open; closed {refused} new connection(s) so far"
                );
            }
            continue; // dropping `tcp` closes it
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let app = app.clone();
        let pending_c = pending.clone();
        let mut p = lock(&pending);
        // Make room: the oldest unfinished connection goes.
        while p.conns.len() >= limits.max_pending.max(1) {
            if let Some((_, oldest)) = p.conns.pop_first() {
                oldest.abort();
            }
        }
        let id = p.next;
        p.next += 1;
        // Spawned with the registry locked, so the task cannot remove itself before it is in.
        let handle = conns.spawn(async move {
            let _permit = permit;
            connection(name, tcp, peer, acceptor, app, limits, &pending_c, id).await;
            lock(&pending_c).conns.remove(&id);
        });
        p.conns.insert(id, handle);
    }
    conns.shutdown().await;
}

#[allow(clippy::too_many_arguments)]
async fn connection(
    name: &'static str,
    tcp: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    acceptor: tokio_rustls::TlsAcceptor,
    app: Router,
    limits: Limits,
    pending: &Arc<Mutex<Pending>>,
    id: u64,
) {
    let tls = match tokio::time::timeout(limits.handshake_timeout, acceptor.accept(tcp)).await {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            tracing::debug!(%peer, "{name}: TLS handshake failed: {e}");
            return;
        }
        Err(_) => {
            tracing::debug!(%peer, "{name}: TLS handshake timed out");
            return;
        }
    };
    // The client certificate the TLS layer verified, if any, for the application to read.
    let peer_cert = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| PeerCertificate(Arc::from(c.as_ref())));
    let started = Arc::new(AtomicBool::new(false));
    let pending = pending.clone();
    let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        if !started.swap(true, Ordering::Relaxed) {
            lock(&pending).conns.remove(&id);
        }
        let mut app = app.clone();
        // A client waiting for `100 Continue` has sent no body: nothing to drain.
        let expects = req.headers().contains_key(hyper::header::EXPECT);
        let (parts, body) = req.into_parts();
        let (body, leftover) = drain::track(body);
        let mut req = hyper::Request::from_parts(parts, axum::body::Body::new(body));
        if let Some(pc) = &peer_cert {
            req.extensions_mut().insert(pc.clone());
        }
        async move {
            let resp = match app.call(req).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            if !expects {
                let d = leftover
                    .drain(drain::MAX_DRAIN_BYTES, drain::DRAIN_TIMEOUT)
                    .await;
                if d != drain::Drained::Done {
                    tracing::debug!(%peer, "{name}: unread request body: {d:?}");
                }
            }
            Ok::<_, Infallible>(resp)
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .serve_connection(TokioIo::new(tls), svc)
        .with_upgrades();
    if let Err(e) = conn.await {
        tracing::debug!(%peer, "{name}: connection ended: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_cap_leaves_descriptors_free() {
        assert_eq!(effective_max_connections(4096, None), 4096);
        assert_eq!(effective_max_connections(4096, Some(1024)), 512);
        assert_eq!(effective_max_connections(4096, Some(100)), 16);
        assert_eq!(effective_max_connections(100, Some(1 << 20)), 100);
    }

    #[test]
    fn raising_the_limit_never_lowers_it() {
        use nix::sys::resource::{Resource, getrlimit};
        let (before, _) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        assert!(raise_nofile_limit().unwrap() >= before);
    }
}
