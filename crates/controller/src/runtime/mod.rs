//! The controllers wired to an API server with kube-rs: the VM controller, the pool
//! controller, the scheduler loop, the migration loop, the node lifecycle loop and the
//! HyperConverged reconcile (`crate::hco`), run only while this instance holds the leader Lease.
//!
//! ```no_run
//! # async fn start(client: kube::Client) -> Result<(), ferrovirt_controller::ControllerError> {
//! let opts = ferrovirt_controller::ControllerOptions::default();
//! ferrovirt_controller::run(client, opts).await // until dropped or a controller fails
//! # }
//! ```

pub mod changes;
pub mod evacuation_loop;
pub mod events;
pub mod kubevirt_config;
pub mod leader;
pub mod metrics;
pub mod migration_loop;
pub mod node_loop;
pub mod pool_controller;
pub mod resources;
pub mod scheduler_loop;
pub mod stores;
pub mod vm_controller;
pub mod vmi_index;
pub mod watched;

use std::time::{Duration, Instant};

use tokio::task::JoinSet;

use crate::error::ControllerError;
use crate::node_lifecycle::NodeLifecycleOptions;
use crate::storage::StorageOptions;
use crate::vm::decide::VmOptions;
use leader::{LeaderElectionOptions, LeaderElector};
use scheduler_loop::SchedulerLoopOptions;

/// Everything the controllers can be tuned with.
#[derive(Debug, Clone, Default)]
pub struct ControllerOptions {
    pub leader_election: LeaderElectionOptions,
    pub vm: VmOptions,
    pub scheduler: SchedulerLoopOptions,
    pub node_lifecycle: NodeLifecycleOptions,
    /// Node subnets (`spec.podCIDR`) from the cluster CIDR (`crate::node_ipam`).
    pub node_ipam: crate::node_ipam::NodeIpamOptions,
    /// StorageClasses, PVC binding/provisioning and DataVolumes (`crate::storage`).
    pub storage: StorageOptions,
    /// Where VirtualMachineExport links point (the API server's URL and CA); None: the export
    /// controller does not run.
    pub export: Option<crate::export::plan::Endpoint>,
}

/// Run the controllers until the returned future is dropped (cancellation) or one of them
/// fails. While another instance holds the leader Lease this only waits for it; when this
/// instance loses the Lease the controllers stop and it becomes a candidate again.
pub async fn run(client: kube::Client, opts: ControllerOptions) -> Result<(), ControllerError> {
    let elector = LeaderElector::new(client.clone(), opts.leader_election.clone());
    let le = &opts.leader_election;
    loop {
        // Candidate: retry until we hold the lease.
        loop {
            match elector.try_acquire_or_renew().await {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "leader election attempt failed"),
            }
            tokio::time::sleep(le.renew_period).await;
        }
        tracing::info!(identity = %le.identity, "became leader; starting controllers");
        let mut tasks: JoinSet<(&'static str, Result<(), ControllerError>)> = JoinSet::new();
        // The shared reflector caches the loops below read instead of listing.
        let (stores, caches) = stores::Stores::start(client.clone());
        tasks.spawn(async move {
            caches.await;
            ("caches", Ok(()))
        });
        tasks.spawn({
            let (c, o) = (client.clone(), opts.vm.clone());
            async move { ("vm", vm_controller::run(c, o).await) }
        });
        tasks.spawn({
            let c = client.clone();
            async move { ("vmpool", pool_controller::run(c).await) }
        });
        tasks.spawn({
            let (c, o, s) = (client.clone(), opts.scheduler.clone(), stores.clone());
            async move { ("scheduler", scheduler_loop::run(c, o, s).await) }
        });
        tasks.spawn({
            let (c, o, s) = (client.clone(), opts.node_lifecycle.clone(), stores.clone());
            async move { ("node-lifecycle", node_loop::run(c, o, s).await) }
        });
        tasks.spawn({
            let (c, o, s) = (
                client.clone(),
                opts.scheduler.scheduler.clone(),
                stores.clone(),
            );
            async move { ("migration", migration_loop::run(c, o, s).await) }
        });
        tasks.spawn({
            let (c, s) = (client.clone(), stores.clone());
            async move { ("evacuation", evacuation_loop::run(c, s).await) }
        });
        tasks.spawn({
            let (c, o, s) = (client.clone(), opts.node_ipam.clone(), stores.clone());
            async move { ("node-ipam", crate::node_ipam::run(c, o, s).await) }
        });
        tasks.spawn({
            let (c, o, s) = (client.clone(), opts.storage.clone(), stores.clone());
            async move { ("storage", crate::storage::run(c, o, s).await) }
        });
        tasks.spawn({
            let (c, s, t) = (
                client.clone(),
                stores.clone(),
                opts.storage.agent_token.clone(),
            );
            async move { ("snapshot", crate::snapshot::run(c, s, t).await) }
        });
        tasks.spawn({
            let (c, t) = (client.clone(), opts.storage.agent_token.clone());
            async move { ("backup", crate::backup::run(c, t).await) }
        });
        tasks.spawn({
            let (c, s) = (client.clone(), stores.clone());
            async move { ("endpoints", crate::endpoints::run(c, s).await) }
        });
        tasks.spawn({
            let (c, s) = (client.clone(), stores.clone());
            async move { ("user-defined-network", crate::udn::run(c, s).await) }
        });
        tasks.spawn({
            let (c, s, l) = (client.clone(), stores.clone(), opts.leader_election.clone());
            async move { ("hyperconverged", crate::hco::run(c, s, l).await) }
        });
        tasks.spawn({
            let (c, s) = (client.clone(), stores.clone());
            async move { ("common-instancetypes", crate::hco::common::run(c, s).await) }
        });
        if let Some(ep) = opts.export.clone() {
            let c = client.clone();
            tasks.spawn(async move { ("export", crate::export::run(c, ep).await) });
        }
        // Step down before others may take over: renewals failing for 2/3 of the duration.
        let deadline = le.lease_duration.mul_f64(2.0 / 3.0).max(le.renew_period);
        let mut last_renew = Instant::now();
        let outcome: Option<ControllerError> = loop {
            tokio::select! {
                _ = tokio::time::sleep(le.renew_period) => {
                    match elector.try_acquire_or_renew().await {
                        Ok(true) => last_renew = Instant::now(),
                        Ok(false) => {
                            tracing::warn!("lost the leader lease; stopping controllers");
                            break None;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "renewing the leader lease failed");
                            if last_renew.elapsed() >= deadline {
                                break None;
                            }
                        }
                    }
                }
                Some(done) = tasks.join_next() => {
                    let (name, reason) = match done {
                        Ok((name, Err(e))) => (name, e.to_string()),
                        Ok((name, Ok(()))) => (name, "returned".to_string()),
                        Err(e) => ("controller", e.to_string()),
                    };
                    break Some(ControllerError::TaskStopped { name, reason });
                }
            }
        };
        tasks.shutdown().await;
        if let Some(err) = outcome {
            return Err(err);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Drives a kube-runtime controller's result stream until it ends, logging failed reconciles
/// (an object gone in the meantime is not a failure) under `what`. A controller only ends when
/// its watch does, which its caller treats as an error of `component`.
pub(crate) async fn drive<K, E>(
    results: impl futures::Stream<
        Item = Result<
            (
                kube::runtime::reflector::ObjectRef<K>,
                kube::runtime::controller::Action,
            ),
            kube::runtime::controller::Error<E, kube::runtime::watcher::Error>,
        >,
    >,
    component: &'static str,
    what: &'static str,
) -> Result<(), crate::ControllerError>
where
    K: kube::Resource,
    E: std::error::Error + 'static,
{
    use futures::StreamExt;
    results
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => tracing::debug!(name = %obj.name, "{what} reconciled"),
                Err(kube::runtime::controller::Error::ObjectNotFound(_)) => {}
                Err(e) => {
                    metrics::retried(what);
                    tracing::warn!(error = %e, "{what} reconcile failed")
                }
            }
        })
        .await;
    Err(crate::ControllerError::TaskStopped {
        name: component,
        reason: "watch stream ended".into(),
    })
}
