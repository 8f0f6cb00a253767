//! The node IPAM controller (Kubernetes' `--allocate-node-cidrs`): gives every Node without a
//! `spec.podCIDR` a subnet of the cluster CIDR, written with the Node's resourceVersion as a
//! precondition (a concurrent change makes the write fail and the next pass decide again).
//! The decision is `ferrovirt_network::node_cidrs::assign` (pure): stable, disjoint subnets,
//! and Nodes whose subnets overlap reported with a Warning Event (`CIDRNotAvailable`) instead of
//! being touched. Agents started with `--pod-cidr` record their own subnet; this controller
//! keeps it. Nodes come from the shared reflector cache ([`crate::runtime::stores`]): a pass
//! runs on every Node change (and every `resync`), never listing.

use std::collections::HashSet;
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
    loop {
        // The cache's own copies (no Node is cloned per pass: 100 nodes patching their
        // status every 10 s would otherwise copy every Node ten times a second).
        let nodes = stores.nodes.state();
        if let Err(e) = pass(&api, &nodes, &ipam, &recorder, &mut reported).await {
            tracing::warn!(error = %e, "node IPAM pass failed");
        }
        let _ = tokio::time::timeout(opts.resync, changes.wait_for(&[Kind::Node])).await;
    }
}

async fn pass(
    api: &Api<Node>,
    nodes: &[std::sync::Arc<Node>],
    ipam: &ferrovirt_network::Ipam,
    recorder: &EventRecorder,
    reported: &mut HashSet<(String, String)>,
) -> Result<(), ControllerError> {
    let current: Vec<(String, Option<String>)> = nodes
        .iter()
        .map(|n| {
            let cidr = n.spec.as_ref().and_then(|s| {
                s.pod_cidr
                    .clone()
                    .or_else(|| s.pod_cidrs.as_ref().and_then(|c| c.first().cloned()))
            });
            (n.metadata.name.clone().unwrap_or_default(), cidr)
        })
        .collect();
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
        if assign_one(api, n, &cidr.to_string()).await? {
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

/// Writes `cidr` into node `n` if it still has none: with the cached resourceVersion first, and
/// after a conflict (the agent wrote the Node meanwhile, or the cache lags) with the Node read
/// again, a few times, so one lost race never leaves a Node waiting for its next change.
/// Whether it was assigned.
async fn assign_one(api: &Api<Node>, n: &Node, cidr: &str) -> Result<bool, ControllerError> {
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
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                let Some(fresh) = api.get_opt(&name).await? else {
                    return Ok(false);
                };
                let has = fresh.spec.as_ref().is_some_and(|s| {
                    s.pod_cidr.is_some() || s.pod_cidrs.as_ref().is_some_and(|c| !c.is_empty())
                });
                if has {
                    // The agent recorded its own (`--pod-cidr`) meanwhile.
                    return Ok(false);
                }
                tracing::info!(node = %name, "node IPAM: conflict, retrying with the Node read again");
                rv = fresh.metadata.resource_version;
            }
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(false),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(false)
}
