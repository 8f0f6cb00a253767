//! The node IPAM controller (Kubernetes' `--allocate-node-cidrs`): gives every Node without a
//! `spec.podCIDR` a subnet of the cluster CIDR, written with the Node's resourceVersion as a
//! precondition (a concurrent change makes the write fail and the next pass decide again).
//! The decision is `ferrovirt_network::node_cidrs::assign` (pure): stable, disjoint subnets,
//! and Nodes whose subnets overlap reported with a Warning Event (`CIDRNotAvailable`) instead of
//! being touched. Agents started with `--pod-cidr` record their own subnet; this controller
//! keeps it. Nodes come from the shared reflector cache ([`crate::runtime::stores`]): a pass
//! runs on every Node change (and every `resync`), never listing. A subnet written is
//! remembered until the cache shows it (a Node's `podCIDR` is never changed once set), so a
//! cache that lags its own writes does not make this controller write again (a refused PATCH
//! and a GET per Node per pass).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::error::ControllerError;
use crate::runtime::events::{EventRecorder, object_ref};
use crate::runtime::stores::{Kind, Stores};

/// Component name on Events.
pub const COMPONENT: &str = "node-ipam-controller";

/// How node subnets are cut.
#[derive(Debug, Clone)]
pub struct NodeIpamOptions {
    /// Allocate node subnets at all.
    pub enabled: bool,
    /// The cluster ("pod network") CIDR.
    pub cluster_cidr: String,
    /// Prefix length of a node subnet.
    pub node_prefix: u8,
    /// Pass interval besides Node watch events.
    pub resync: Duration,
}

impl Default for NodeIpamOptions {
    fn default() -> Self {
        NodeIpamOptions {
            enabled: true,
            cluster_cidr: ferrovirt_network::ipam::DEFAULT_CLUSTER_CIDR.into(),
            node_prefix: ferrovirt_network::ipam::DEFAULT_NODE_PREFIX,
            resync: Duration::from_secs(30),
        }
    }
}

/// Runs the controller until the future is dropped. A bad cluster CIDR stops it with an error
/// naming the setting.
pub async fn run(
    client: kube::Client,
    opts: NodeIpamOptions,
    stores: Stores,
) -> Result<(), ControllerError> {
    if !opts.enabled {
        return std::future::pending().await;
    }
    let ipam = opts
        .cluster_cidr
        .parse()
        .and_then(|c| ferrovirt_network::Ipam::new(c, opts.node_prefix))
        .map_err(|e| ControllerError::TaskStopped {
            name: "node-ipam",
            reason: format!("cluster CIDR {:?}: {e}", opts.cluster_cidr),
        })?;
    let recorder = EventRecorder::new(client.clone(), COMPONENT);
    let api: Api<Node> = Api::all(client);
    let mut changes = stores.changes();
    stores.ready().await;
    let mut reported = HashSet::new();
    let mut written = Written::new();
    loop {
        // The cache's own copies (no Node is cloned per pass: 100 nodes patching their
        // status every 10 s would otherwise copy every Node ten times a second).
        let nodes = stores.nodes.state();
        if let Err(e) = pass(&api, &nodes, &ipam, &recorder, &mut reported, &mut written).await {
            tracing::warn!(error = %e, "node IPAM pass failed");
        }
        let _ = tokio::time::timeout(opts.resync, changes.wait_for(&[Kind::Node])).await;
    }
}

/// Subnets written (or found written) that the cache may not show yet: node name → (uid,
/// subnet).
type Written = HashMap<String, (Option<String>, String)>;

/// A Node's subnet as the object says.
fn node_cidr(n: &Node) -> Option<String> {
    n.spec.as_ref().and_then(|s| {
        s.pod_cidr
            .clone()
            .or_else(|| s.pod_cidrs.as_ref().and_then(|c| c.first().cloned()))
    })
}

/// Every cached Node with its subnet (pure): the cached one, else one `written` for that
/// same Node (uid) that the cache does not show yet. `written` keeps only those: a subnet
/// the cache shows, or of a Node gone or replaced, is forgotten.
fn current_cidrs(
    nodes: &[std::sync::Arc<Node>],
    written: &mut Written,
) -> Vec<(String, Option<String>)> {
    let mut still = Written::new();
    let current = nodes
        .iter()
        .map(|n| {
            let name = n.metadata.name.clone().unwrap_or_default();
            let cidr = node_cidr(n).or_else(|| {
                let (uid, cidr) = written.remove(&name)?;
                (uid == n.metadata.uid).then(|| {
                    still.insert(name.clone(), (uid, cidr.clone()));
                    cidr
                })
            });
            (name, cidr)
        })
        .collect();
    *written = still;
    current
}

async fn pass(
    api: &Api<Node>,
    nodes: &[std::sync::Arc<Node>],
    ipam: &ferrovirt_network::Ipam,
    recorder: &EventRecorder,
    reported: &mut HashSet<(String, String)>,
    written: &mut Written,
) -> Result<(), ControllerError> {
    let current = current_cidrs(nodes, written);
    let decision = match ferrovirt_network::node_cidrs::assign(ipam, &current) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!("node IPAM: {e}");
            return Ok(());
        }
    };
    for (name, reason) in decision.conflicts {
        if reported.insert((name.clone(), reason.clone())) {
            tracing::warn!(node = %name, "node IPAM: {reason}");
            if let Some(n) = nodes
                .iter()
                .find(|n| n.metadata.name.as_deref() == Some(&name))
            {
                let r = object_ref("v1", "Node", &n.metadata);
                recorder.record(&r, true, "CIDRNotAvailable", &reason).await;
            }
        }
    }
    for (name, cidr) in decision.assign {
        let Some(n) = nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(&name))
        else {
            continue;
        };
        let outcome = assign_one(api, n, &cidr.to_string()).await?;
        if let Some(now) = outcome.cidr {
            written.insert(name.clone(), (n.metadata.uid.clone(), now));
        }
        if outcome.wrote {
            tracing::info!(node = %name, %cidr, "assigned node pod CIDR");
            let r = object_ref("v1", "Node", &n.metadata);
            recorder
                .record(
                    &r,
                    false,
                    "CIDRAssignmentSucceeded",
                    &format!("Node {name} got pod CIDR {cidr}"),
                )
                .await;
        }
    }
    Ok(())
}

/// What [`assign_one`] did: whether it wrote the subnet, and the Node's subnet as the API
/// has it now (ours, or one found set already), `None` when unknown or the Node is gone.
#[derive(Debug)]
struct Assigned {
    wrote: bool,
    cidr: Option<String>,
}

/// Writes `cidr` into the Node guarded by its resourceVersion; on a conflict reads the Node
/// again: a subnet set meanwhile is kept (and reported), otherwise it retries a few times.
async fn assign_one(api: &Api<Node>, n: &Node, cidr: &str) -> Result<Assigned, ControllerError> {
    let name = n.metadata.name.clone().unwrap_or_default();
    let mut rv = n.metadata.resource_version.clone();
    for _ in 0..5 {
        let patch = json!({
            "metadata": {"resourceVersion": rv},
            "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
        });
        match api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                return Ok(Assigned {
                    wrote: true,
                    cidr: Some(cidr.to_string()),
                });
            }
            Err(kube::Error::Api(s)) if s.code == 409 => {
                let Some(fresh) = api.get_opt(&name).await? else {
                    return Ok(Assigned {
                        wrote: false,
                        cidr: None,
                    });
                };
                if let Some(has) = node_cidr(&fresh) {
                    // Set meanwhile (by its agent's `--pod-cidr`, or by us before the cache
                    // showed it): kept.
                    return Ok(Assigned {
                        wrote: false,
                        cidr: Some(has),
                    });
                }
                tracing::info!(node = %name, "node IPAM: conflict, retrying with the Node read again");
                rv = fresh.metadata.resource_version;
            }
            Err(kube::Error::Api(s)) if s.code == 404 => {
                return Ok(Assigned {
                    wrote: false,
                    cidr: None,
                });
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Assigned {
        wrote: false,
        cidr: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, uid: &str, cidr: Option<&str>) -> std::sync::Arc<Node> {
        std::sync::Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": name, "uid": uid},
                "spec": {"podCIDR": cidr},
            }))
            .unwrap(),
        )
    }

    #[test]
    fn a_written_subnet_counts_until_the_cache_shows_it() {
        let mut written = Written::new();
        written.insert("a".into(), (Some("ua".into()), "10.244.1.0/24".into()));
        written.insert("b".into(), (Some("ub".into()), "10.244.2.0/24".into()));
        written.insert("gone".into(), (Some("ug".into()), "10.244.3.0/24".into()));
        written.insert("c".into(), (Some("old".into()), "10.244.4.0/24".into()));
        // a: the cache lags our write; b: the cache shows it; c: replaced by a new Node of
        // that name; gone: deleted.
        let nodes = [
            node("a", "ua", None),
            node("b", "ub", Some("10.244.2.0/24")),
            node("c", "new", None),
        ];
        let current = current_cidrs(&nodes, &mut written);
        assert_eq!(
            current,
            vec![
                ("a".into(), Some("10.244.1.0/24".into())),
                ("b".into(), Some("10.244.2.0/24".into())),
                ("c".into(), None),
            ]
        );
        // Only the subnet the cache does not show yet is still remembered.
        assert_eq!(written.len(), 1);
        assert!(written.contains_key("a"));
        // Once the cache shows it, it is forgotten.
        let nodes = [node("a", "ua", Some("10.244.1.0/24"))];
        let _ = current_cidrs(&nodes, &mut written);
        assert!(written.is_empty());
    }
}
