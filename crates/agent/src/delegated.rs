//! Delegated authentication and authorization of the agent's scrape endpoints (`GET /metrics`,
//! `GET /healthz`), as a kubelet's webhook mode does, so that Prometheus scrapes with a
//! ServiceAccount token of its own (bound to `ferrovirt:metrics-reader`) instead of the admin
//! token. A bearer token that is not the agent's own is sent to the API server in a
//! TokenReview; the identity it names is then checked with a SubjectAccessReview for `get` on
//! this Node's `nodes/metrics` (`nodes/proxy` for `/healthz`, as the kubelet maps its paths).
//! Every other route of the endpoint stays the API server's alone (the agent's token).
//!
//! Answers are cached under the token's SHA-256 (the token itself is never kept), with the
//! kubelet's default lifetimes: an allowed answer 5 min, a refusal 30 s, at most
//! [`CACHE_ENTRIES`] answers (expired ones are dropped first, then all). A review the API
//! server could not answer is not cached.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Api;
use kube::api::PostParams;

/// How many answers the cache keeps.
pub const CACHE_ENTRIES: usize = 4096;
/// How long an allowed answer is reused (the kubelet's `cacheAuthorizedTTL`).
pub const ALLOWED_TTL: Duration = Duration::from_secs(300);
/// How long a refusal is reused (the kubelet's `cacheUnauthorizedTTL`).
pub const REFUSED_TTL: Duration = Duration::from_secs(30);

/// The `nodes` subresource a scrape of `path` needs; None for a path that is never
/// delegated (the API server's own routes).
pub fn scrape_subresource(path: &str) -> Option<&'static str> {
    match path {
        "/metrics" => Some("metrics"),
        "/healthz" => Some("proxy"),
        _ => None,
    }
}

/// What the API server said of a token and a scrape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Allowed,
    /// The token names nobody (401).
    Unauthenticated,
    /// The token's user may not (403, with the kubelet's message).
    Forbidden(String),
}

impl Decision {
    /// How long this answer may be reused.
    pub fn ttl(&self) -> Duration {
        match self {
            Decision::Allowed => ALLOWED_TTL,
            _ => REFUSED_TTL,
        }
    }
}

/// The kubelet's 403 message for `user` asking `get` on `nodes/<subresource>`.
pub fn forbidden_message(user: &str, subresource: &str) -> String {
    format!("Forbidden (user={user}, verb=get, resource=nodes, subresource={subresource})")
}

/// The answers by (SHA-256 of the token, subresource).
#[derive(Debug, Default)]
pub struct Cache {
    entries: HashMap<([u8; 32], &'static str), (Decision, Instant)>,
}

impl Cache {
    /// The cached answer, unless it has expired at `now`.
    pub fn get(&self, key: &([u8; 32], &'static str), now: Instant) -> Option<Decision> {
        self.entries
            .get(key)
            .filter(|(d, at)| now.duration_since(*at) < d.ttl())
            .map(|(d, _)| d.clone())
    }

    /// Keeps `d` from `now`; a full cache drops its expired answers first, then all of them.
    pub fn put(&mut self, key: ([u8; 32], &'static str), d: Decision, now: Instant) {
        if self.entries.len() >= CACHE_ENTRIES && !self.entries.contains_key(&key) {
            self.entries
                .retain(|_, (d, at)| now.duration_since(*at) < d.ttl());
            if self.entries.len() >= CACHE_ENTRIES {
                self.entries.clear();
            }
        }
        self.entries.insert(key, (d, now));
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The cache key of `token` for `subresource`.
pub fn key(token: &str, subresource: &'static str) -> ([u8; 32], &'static str) {
    let digest = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    let mut k = [0u8; 32];
    k.copy_from_slice(digest.as_ref());
    (k, subresource)
}

/// Reviews scrape tokens with the API server for node `node`.
pub struct DelegatedAuth {
    client: kube::Client,
    node: String,
    cache: Mutex<Cache>,
}

impl std::fmt::Debug for DelegatedAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DelegatedAuth")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl DelegatedAuth {
    pub fn new(client: kube::Client, node: &str) -> DelegatedAuth {
        DelegatedAuth {
            client,
            node: node.to_string(),
            cache: Mutex::new(Cache::default()),
        }
    }

    /// May the holder of `token` `get` this node's `subresource`? Err: the API server did not
    /// answer (nothing cached).
    pub async fn check(&self, token: &str, subresource: &'static str) -> Result<Decision, String> {
        let k = key(token, subresource);
        let cached = self
            .cache
            .lock()
            .ok()
            .and_then(|c| c.get(&k, Instant::now()));
        if let Some(d) = cached {
            return Ok(d);
        }
        let d = self.review(token, subresource).await?;
        if let Ok(mut c) = self.cache.lock() {
            c.put(k, d.clone(), Instant::now());
        }
        Ok(d)
    }

    async fn review(&self, token: &str, subresource: &str) -> Result<Decision, String> {
        let tr = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: None,
            },
            ..Default::default()
        };
        let tr = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &tr)
            .await
            .map_err(|e| format!("TokenReview: {e}"))?;
        let status = tr.status.unwrap_or_default();
        let Some(user) = status.user.filter(|_| status.authenticated == Some(true)) else {
            return Ok(Decision::Unauthenticated);
        };
        let name = user.username.clone().unwrap_or_default();
        let sar = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username,
                uid: user.uid,
                groups: user.groups,
                extra: user.extra,
                resource_attributes: Some(ResourceAttributes {
                    verb: Some("get".into()),
                    group: Some(String::new()),
                    version: Some("v1".into()),
                    resource: Some("nodes".into()),
                    subresource: Some(subresource.to_string()),
                    name: Some(self.node.clone()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let sar = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&PostParams::default(), &sar)
            .await
            .map_err(|e| format!("SubjectAccessReview: {e}"))?;
        Ok(match sar.status.map(|s| s.allowed) {
            Some(true) => Decision::Allowed,
            _ => Decision::Forbidden(forbidden_message(&name, subresource)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_scrape_paths_are_delegated() {
        assert_eq!(scrape_subresource("/metrics"), Some("metrics"));
        assert_eq!(scrape_subresource("/healthz"), Some("proxy"));
        for p in [
            "/vmis/x/console",
            "/storage/volumes/a",
            "/metrics/",
            "/",
            "",
        ] {
            assert_eq!(scrape_subresource(p), None, "{p}");
        }
    }

    #[test]
    fn answers_expire_refusals_sooner() {
        let mut c = Cache::default();
        let t0 = Instant::now();
        let (a, f) = (key("good", "metrics"), key("bad", "metrics"));
        c.put(a, Decision::Allowed, t0);
        c.put(f, Decision::Forbidden("no".into()), t0);
        let later = t0 + REFUSED_TTL + Duration::from_secs(1);
        assert_eq!(c.get(&a, later), Some(Decision::Allowed));
        assert_eq!(c.get(&f, later), None);
        assert_eq!(c.get(&a, t0 + ALLOWED_TTL), None);
        // One token's answer for metrics is not its answer for another subresource.
        assert_eq!(c.get(&key("good", "proxy"), t0), None);
    }

    #[test]
    fn a_full_cache_stays_bounded() {
        let mut c = Cache::default();
        let t0 = Instant::now();
        for i in 0..CACHE_ENTRIES {
            c.put(
                key(&format!("t{i}"), "metrics"),
                Decision::Unauthenticated,
                t0,
            );
        }
        assert_eq!(c.len(), CACHE_ENTRIES);
        // Expired ones go first.
        let later = t0 + REFUSED_TTL + Duration::from_secs(1);
        c.put(key("new", "metrics"), Decision::Allowed, later);
        assert_eq!(c.len(), 1);
        // Unexpired ones are all dropped when nothing has expired.
        for i in 0..CACHE_ENTRIES {
            c.put(
                key(&format!("u{i}"), "metrics"),
                Decision::Unauthenticated,
                later,
            );
        }
        assert!(c.len() <= CACHE_ENTRIES);
        assert!(!c.is_empty());
    }

    #[test]
    fn the_token_is_not_kept_and_messages_match_the_kubelet() {
        let (k, _) = key("secret-token", "metrics");
        assert!(!k.windows(6).any(|w| w == b"secret"));
        assert_eq!(
            forbidden_message("system:serviceaccount:default:p", "metrics"),
            "Forbidden (user=system:serviceaccount:default:p, verb=get, resource=nodes, \
             subresource=metrics)"
        );
    }
}
