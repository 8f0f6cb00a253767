//! Leader election over a coordination.k8s.io/v1 Lease: an instance holds the Lease by
//! renewing `renewTime` every renew period; another takes over once `renewTime +
//! leaseDurationSeconds` has passed. Writes use optimistic concurrency (resourceVersion), so
//! two candidates never both win. The pure rule is [`may_acquire`].

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, PostParams};

use crate::error::ControllerError;

/// Where and how to elect.
#[derive(Debug, Clone)]
pub struct LeaderElectionOptions {
    /// This instance's identity (unique per process).
    pub identity: String,
    pub lease_namespace: String,
    pub lease_name: String,
    /// How long a holder's claim lasts without renewal.
    pub lease_duration: Duration,
    /// How often the holder renews (and candidates retry).
    pub renew_period: Duration,
}

impl Default for LeaderElectionOptions {
    fn default() -> Self {
        Self {
            identity: format!("ferrovirt-controller-{}", std::process::id()),
            lease_namespace: "kube-system".into(),
            lease_name: "ferrovirt-controllers".into(),
            lease_duration: Duration::from_secs(15),
            renew_period: Duration::from_secs(5),
        }
    }
}

/// Whether `identity` may take (or keep) the lease at `now`: it holds it already, nobody
/// does, or the holder's claim expired.
pub fn may_acquire(spec: Option<&LeaseSpec>, identity: &str, now: Timestamp) -> bool {
    let Some(spec) = spec else { return true };
    let holder = spec.holder_identity.as_deref().unwrap_or("");
    if holder.is_empty() || holder == identity {
        return true;
    }
    let Some(renew) = spec.renew_time.as_ref() else {
        return true;
    };
    let duration =
        SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(15).max(0)));
    renew
        .0
        .checked_add(duration)
        .is_ok_and(|expiry| now > expiry)
}

/// One candidate for one Lease.
#[derive(Debug, Clone)]
pub struct LeaderElector {
    api: Api<Lease>,
    opts: LeaderElectionOptions,
    /// The Lease as our last successful write left it, while we hold it: a renewal writes it
    /// back (its resourceVersion guards against anyone else's write) without reading first.
    held: std::sync::Arc<std::sync::Mutex<Option<Lease>>>,
}

impl LeaderElector {
    pub fn new(client: kube::Client, opts: LeaderElectionOptions) -> Self {
        Self {
            api: Api::namespaced(client, &opts.lease_namespace),
            opts,
            held: Default::default(),
        }
    }

    /// The options in use.
    pub fn options(&self) -> &LeaderElectionOptions {
        &self.opts
    }

    fn spec(&self, now: Timestamp, prev: Option<&LeaseSpec>) -> LeaseSpec {
        let ours =
            prev.and_then(|p| p.holder_identity.as_deref()) == Some(self.opts.identity.as_str());
        let transitions = prev.and_then(|p| p.lease_transitions).unwrap_or(0);
        LeaseSpec {
            holder_identity: Some(self.opts.identity.clone()),
            lease_duration_seconds: Some(
                i32::try_from(self.opts.lease_duration.as_secs()).unwrap_or(15),
            ),
            acquire_time: if ours {
                prev.and_then(|p| p.acquire_time.clone())
            } else {
                Some(MicroTime(now))
            },
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(if ours || prev.is_none() {
                transitions
            } else {
                transitions + 1
            }),
            ..Default::default()
        }
    }

    fn hold(&self, lease: Lease) {
        *self.held.lock().unwrap_or_else(|p| p.into_inner()) = Some(lease);
    }

    /// Try to acquire or renew the Lease once; `Ok(true)` when we hold it afterwards.
    pub async fn try_acquire_or_renew(&self) -> Result<bool, ControllerError> {
        let now = Timestamp::now();
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner()).take();
        let current = match held {
            Some(l) => Some(l),
            None => self.api.get_opt(&self.opts.lease_name).await?,
        };
        match current {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.opts.lease_name.clone()),
                        namespace: Some(self.opts.lease_namespace.clone()),
                        ..Default::default()
                    },
                    spec: Some(self.spec(now, None)),
                };
                match self.api.create(&PostParams::default(), &lease).await {
                    Ok(written) => {
                        self.hold(written);
                        Ok(true)
                    }
                    Err(kube::Error::Api(s)) if s.is_already_exists() || s.code == 409 => Ok(false),
                    Err(e) => Err(e.into()),
                }
            }
            Some(mut lease) => {
                if !may_acquire(lease.spec.as_ref(), &self.opts.identity, now) {
                    return Ok(false);
                }
                lease.spec = Some(self.spec(now, lease.spec.as_ref()));
                match self
                    .api
                    .replace(&self.opts.lease_name, &PostParams::default(), &lease)
                    .await
                {
                    Ok(written) => {
                        self.hold(written);
                        Ok(true)
                    }
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                    Err(e) => Err(e.into()),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(holder: &str, renew: i64, duration: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.into()),
            renew_time: Some(MicroTime(Timestamp::from_second(renew).unwrap())),
            lease_duration_seconds: Some(duration),
            ..Default::default()
        }
    }

    #[test]
    fn acquisition_rules() {
        let t = |s| Timestamp::from_second(s).unwrap();
        assert!(may_acquire(None, "me", t(0)));
        assert!(may_acquire(Some(&spec("me", 100, 15)), "me", t(101)));
        assert!(!may_acquire(Some(&spec("other", 100, 15)), "me", t(110)));
        assert!(may_acquire(Some(&spec("other", 100, 15)), "me", t(116)));
        assert!(may_acquire(Some(&spec("", 100, 15)), "me", t(101)));
    }
}
