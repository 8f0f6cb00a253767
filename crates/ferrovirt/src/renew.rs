//! A joined agent's node certificate renewal (docs/nodes.md "Renewal"): the agent's API client
//! is a [`kube::Client`] over a [`Swappable`] service that forwards every request to the
//! current inner client, built from the current certificate; [`keep_renewed`] renews the
//! certificate (`ferrovirt_agent::join::renew`) when less than a third of its lifetime is left
//! and swaps a client with the new one in, so the agent's loops, watches and heartbeats keep
//! one client across renewals. Requests already on a connection made with the old certificate
//! finish on it; new connections present the new one.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use ferrovirt_agent::join::{NodeCredential, renewal_at, renewal_due};

/// The shared slot holding the current inner client.
pub type Slot = Arc<RwLock<kube::Client>>;

/// A service that sends each request with the client in its slot at that moment.
#[derive(Clone)]
pub struct Swappable(pub Slot);

type Req = http::Request<kube::client::Body>;
type Resp = http::Response<kube::client::Body>;

impl tower_service::Service<Req> for Swappable {
    type Response = Resp;
    type Error = kube::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Resp, kube::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let client = self.0.read().unwrap_or_else(|p| p.into_inner()).clone();
        Box::pin(async move { client.send(req).await })
    }
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or_default()
}

/// The certificate's validity (notBefore, notAfter), Unix seconds.
fn validity(cred: &NodeCredential) -> anyhow::Result<(i64, i64)> {
    ferrovirt_apiserver::auth::certs::validity(&cred.cert_pem).ok_or_else(|| {
        anyhow::anyhow!(
            "{}: the node certificate does not parse",
            cred.dir.display()
        )
    })
}

/// At the agent's start: renews the credential first when it is due (a failure is logged and
/// the current certificate used while it lasts).
pub async fn renew_if_due(server: &str, cred: NodeCredential, user_agent: &str) -> NodeCredential {
    match validity(&cred) {
        Ok((nb, na)) if renewal_due(nb, na, now()) => {
            match ferrovirt_agent::join::renew(server, &cred, user_agent).await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!("renewing the node certificate at start failed: {e}");
                    cred
                }
            }
        }
        Ok(_) => cred,
        Err(e) => {
            tracing::warn!("{e}");
            cred
        }
    }
}

/// How long to wait before trying again after a failed renewal, with `left` seconds of
/// validity left: a tenth of it, 1 s to 60 s. Pure.
pub fn retry_after(left: i64) -> Duration {
    Duration::from_secs((left / 10).clamp(1, 60) as u64)
}

/// Renews `cred` whenever it falls due and puts a client with the new certificate into `slot`
/// (`build` makes it), forever.
pub async fn keep_renewed<F, Fut>(
    server: String,
    mut cred: NodeCredential,
    slot: Slot,
    user_agent: String,
    build: F,
) where
    F: Fn(NodeCredential) -> Fut,
    Fut: Future<Output = anyhow::Result<kube::Client>>,
{
    loop {
        let (nb, na) = match validity(&cred) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!("{e}; not renewing it");
                return;
            }
        };
        let wait = renewal_at(nb, na) - now();
        if wait > 0 {
            // Wake at least hourly (a clock step must not push the renewal past expiry).
            tokio::time::sleep(Duration::from_secs(wait.min(3600) as u64)).await;
            continue;
        }
        let renewed = match ferrovirt_agent::join::renew(&server, &cred, &user_agent).await {
            Ok(c) => c,
            Err(e) => {
                let left = na - now();
                tracing::warn!("renewing the node certificate failed ({left} s left): {e}");
                tokio::time::sleep(retry_after(left)).await;
                continue;
            }
        };
        match build(renewed.clone()).await {
            Ok(client) => {
                *slot.write().unwrap_or_else(|p| p.into_inner()) = client;
                cred = renewed;
            }
            Err(e) => {
                tracing::warn!("a client with the renewed node certificate: {e:#}");
                tokio::time::sleep(retry_after(na - now())).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_come_sooner_as_expiry_nears() {
        assert_eq!(retry_after(3600), Duration::from_secs(60));
        assert_eq!(retry_after(100), Duration::from_secs(10));
        assert_eq!(retry_after(5), Duration::from_secs(1));
        assert_eq!(retry_after(-5), Duration::from_secs(1));
    }
}
