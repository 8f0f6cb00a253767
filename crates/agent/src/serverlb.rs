//! The agent's loopback load balancer over several API servers (`ferrovirt agent --server
//! URL1,URL2,URL3`), as k3s' agents have one: a TCP listener on `127.0.0.1:PORT` that the
//! agent's kube-rs client, its join request and its certificate renewals all talk to, passing
//! each connection (TLS and all) through to one server.
//!
//! Why a TCP balancer and not per-request failover in the client: every user of the server URL
//! (kube-rs with its pooled connections and watches, the join handshake that reads the served
//! CA chain, renewals, hyper clients) gets failover without knowing about it, and TLS stays
//! end to end (the balancer never sees a key; the servers' certificates carry 127.0.0.1,
//! which the client checks). A server that dies closes its connections; kube-rs' watchers
//! (every agent watch runs with `default_backoff`) re-list and re-watch, and the new
//! connection goes to the next server.
//!
//! Choice ([`order`]): the server in use first while it is healthy, then the other healthy ones
//! in the order given, then the unhealthy ones (one may have come back before the probe saw
//! it). A failed connect marks a server unhealthy and tries the next; a probe every
//! [`PROBE_INTERVAL`] re-checks every server with a TCP connect. The balancer keeps to the
//! server it uses (no switching back when the first returns), so a flapping server does not
//! move every connection.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

use crate::error::AgentError;

/// How often every server is probed.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(5);
/// How long one connect to a server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// One server of `--server`: its URL and `host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub url: String,
    pub authority: String,
}

/// Parses `--server`: one `https://host:port` URL or a comma list of them (a port is
/// required: the servers listen where they were told).
pub fn parse_servers(s: &str) -> Result<Vec<Upstream>, AgentError> {
    let bad = |m: String| AgentError::Config(format!("--server: {m}"));
    let mut out: Vec<Upstream> = Vec::new();
    for url in s.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let rest = url
            .strip_prefix("https://")
            .ok_or_else(|| bad(format!("{url:?} is not an https:// URL")))?;
        let authority = rest.trim_end_matches('/');
        if authority.is_empty() || authority.contains('/') {
            return Err(bad(format!("{url:?}: give https://HOST:PORT (no path)")));
        }
        let port = authority
            .rsplit_once(':')
            .and_then(|(h, p)| (!h.is_empty() && !h.ends_with(':')).then_some(p))
            .ok_or_else(|| bad(format!("{url:?}: a port is required")))?;
        port.parse::<u16>()
            .map_err(|_| bad(format!("{url:?}: invalid port {port:?}")))?;
        if out.iter().any(|u| u.authority == authority) {
            return Err(bad(format!("{url:?} is given twice")));
        }
        out.push(Upstream {
            url: url.trim_end_matches('/').to_string(),
            authority: authority.to_string(),
        });
    }
    if out.is_empty() {
        return Err(bad("no server URL given".into()));
    }
    Ok(out)
}

/// The order in which to try the servers: `current` first when healthy, then the other
/// healthy ones in list order, then the unhealthy ones in list order.
pub fn order(healthy: &[bool], current: usize) -> Vec<usize> {
    let n = healthy.len();
    let mut out = Vec::with_capacity(n);
    if current < n && healthy[current] {
        out.push(current);
    }
    out.extend((0..n).filter(|&i| i != current && healthy[i]));
    out.extend((0..n).filter(|&i| !healthy[i]));
    out
}

struct State {
    upstreams: Vec<Upstream>,
    healthy: Vec<AtomicBool>,
    current: AtomicUsize,
}

impl State {
    fn snapshot(&self) -> Vec<bool> {
        self.healthy
            .iter()
            .map(|h| h.load(Ordering::Relaxed))
            .collect()
    }

    async fn connect(&self) -> Option<(usize, TcpStream)> {
        for i in order(&self.snapshot(), self.current.load(Ordering::Relaxed)) {
            let up = &self.upstreams[i];
            match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&up.authority)).await {
                Ok(Ok(s)) => {
                    self.healthy[i].store(true, Ordering::Relaxed);
                    let before = self.current.swap(i, Ordering::Relaxed);
                    if before != i {
                        tracing::warn!(
                            from = %self.upstreams[before].url,
                            to = %up.url,
                            "API server failover"
                        );
                    }
                    return Some((i, s));
                }
                Ok(Err(e)) => {
                    tracing::warn!(server = %up.url, "API server unreachable: {e}");
                    self.healthy[i].store(false, Ordering::Relaxed);
                }
                Err(_) => {
                    tracing::warn!(server = %up.url, "API server connect timed out");
                    self.healthy[i].store(false, Ordering::Relaxed);
                }
            }
        }
        None
    }
}

/// A running balancer; stops when dropped.
#[derive(Debug)]
pub struct ServerBalancer {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
    probe: tokio::task::JoinHandle<()>,
}

impl Drop for ServerBalancer {
    fn drop(&mut self) {
        self.task.abort();
        self.probe.abort();
    }
}

impl ServerBalancer {
    /// Listens on `127.0.0.1:0` and passes connections to `upstreams`.
    pub async fn start(upstreams: Vec<Upstream>) -> Result<ServerBalancer, AgentError> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| AgentError::Config(format!("binding the server balancer: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| AgentError::Config(format!("server balancer address: {e}")))?;
        let state = Arc::new(State {
            healthy: upstreams.iter().map(|_| AtomicBool::new(true)).collect(),
            upstreams,
            current: AtomicUsize::new(0),
        });
        let probe_state = state.clone();
        let probe = tokio::spawn(async move {
            loop {
                tokio::time::sleep(PROBE_INTERVAL).await;
                for (i, up) in probe_state.upstreams.iter().enumerate() {
                    let ok = matches!(
                        tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&up.authority))
                            .await,
                        Ok(Ok(_))
                    );
                    probe_state.healthy[i].store(ok, Ordering::Relaxed);
                }
            }
        });
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let state = state.clone();
                tokio::spawn(async move {
                    let Some((_, mut server)) = state.connect().await else {
                        tracing::warn!("no API server reachable");
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                });
            }
        });
        Ok(ServerBalancer { addr, task, probe })
    }

    /// The URL the agent's clients use: `https://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn servers_parse_and_refusals() {
        let s = parse_servers("https://a:1, https://10.0.0.2:6443/,https://[::1]:7").unwrap();
        let auth: Vec<_> = s.iter().map(|u| u.authority.as_str()).collect();
        assert_eq!(auth, ["a:1", "10.0.0.2:6443", "[::1]:7"]);
        assert_eq!(s[1].url, "https://10.0.0.2:6443");
        for (bad, why) in [
            ("", "no server"),
            ("http://a:1", "not an https"),
            ("https://a", "port is required"),
            ("https://a:x", "invalid port"),
            ("https://a:1/api", "no path"),
            ("https://a:1,https://a:1", "twice"),
        ] {
            let e = parse_servers(bad).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("--server"), "{bad}: {e}");
        }
    }

    #[test]
    fn choice_keeps_the_current_then_healthy_then_the_rest() {
        assert_eq!(order(&[true, true, true], 0), [0, 1, 2]);
        assert_eq!(order(&[true, true, true], 2), [2, 0, 1]);
        assert_eq!(order(&[false, true, true], 0), [1, 2, 0]);
        assert_eq!(order(&[true, false, true], 1), [0, 2, 1]);
        assert_eq!(order(&[false, false, true], 2), [2, 0, 1]);
        assert_eq!(order(&[false, false], 1), [0, 1]);
    }

    async fn listener() -> (TcpListener, String) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap().to_string();
        (l, a)
    }

    /// Real sockets: the first server dies (its listener closes), the next connection goes to
    /// the second.
    #[tokio::test]
    async fn fails_over_on_connect_error() {
        let (l1, a1) = listener().await;
        let (l2, a2) = listener().await;
        let serve = |l: TcpListener, tag: u8| {
            tokio::spawn(async move {
                while let Ok((mut s, _)) = l.accept().await {
                    let _ = s.write_all(&[tag]).await;
                }
            })
        };
        let t1 = serve(l1, 1);
        let _t2 = serve(l2, 2);
        let lb =
            ServerBalancer::start(parse_servers(&format!("https://{a1},https://{a2}")).unwrap())
                .await
                .unwrap();
        let addr = lb.url().trim_start_matches("https://").to_string();
        let first_byte = || async {
            let mut c = TcpStream::connect(&addr).await.unwrap();
            let mut b = [0u8; 1];
            c.read_exact(&mut b).await.unwrap();
            b[0]
        };
        assert_eq!(first_byte().await, 1);
        t1.abort();
        let _ = t1.await;
        assert_eq!(first_byte().await, 2);
        // It stays with the second server.
        assert_eq!(first_byte().await, 2);
    }
}
