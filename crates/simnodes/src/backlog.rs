//! The scheduler-alone phase of the scale benchmark (benchmark harness only, see the crate
//! doc). In the main phase the bind rate can be no higher than the create rate, so it says more
//! about the whole write path than about the scheduler. Here a backlog of VMIs is created while
//! every simulated node is cordoned (each waits, unschedulable), then every node is uncordoned
//! at once: binds per second from the uncordon to the last bind are the scheduler's own rate
//! with work queued, as Kubernetes' scheduler_perf measures pods scheduled per second. The
//! simulated nodes start the bound VMIs meanwhile, as in the main phase.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;

use crate::bench::{vmi_manifest, vmi_resource};
use crate::sim::SimError;

/// The label of the backlog's VMIs (besides the benchmark's own).
pub const BACKLOG_LABEL: &str = "bench.ferrovirt.io/backlog";

/// What the phase measured.
#[derive(Debug, Clone)]
pub struct Backlog {
    pub count: usize,
    /// From the uncordon (every node patched) to the last bind seen.
    pub uncordon_to_last_bind: Duration,
    /// How long the uncordon patches themselves took.
    pub uncordon: Duration,
}

impl Backlog {
    /// Binds per second from the start of the uncordon to the last bind.
    pub fn rate(&self) -> f64 {
        crate::stats::rate(self.count, self.uncordon_to_last_bind)
    }
}

/// The `i`-th backlog VMI: the benchmark's manifest with [`BACKLOG_LABEL`].
pub fn backlog_manifest(i: usize, namespace: &str) -> serde_json::Value {
    let mut v = vmi_manifest(i, namespace);
    v["metadata"]["labels"][BACKLOG_LABEL] = json!("true");
    v
}

async fn set_unschedulable(nodes: &Api<Node>, names: &[String], on: bool) -> Result<(), SimError> {
    let patch = json!({"spec": {"unschedulable": on}});
    futures::stream::iter(names.iter())
        .map(|n| {
            let patch = &patch;
            async move {
                nodes
                    .patch(n, &PatchParams::default(), &Patch::Merge(patch))
                    .await
                    .map(drop)
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Cordons `node_names`, waits `settle` for the controllers' Node cache to show the cordons
/// (a VMI created before the scheduler saw its node cordoned is bound at once, and the phase
/// fails), creates `count` VMIs (indices from `first`), waits `settle` for the scheduler to
/// find them unplaceable, uncordons every node and waits for every bind.
pub async fn run(
    driver: &kube::Client,
    namespace: &str,
    node_names: &[String],
    count: usize,
    first: usize,
    concurrency: usize,
    settle: Duration,
) -> Result<Backlog, SimError> {
    let nodes: Api<Node> = Api::all(driver.clone());
    let api: Api<DynamicObject> = Api::namespaced_with(driver.clone(), namespace, &vmi_resource());
    set_unschedulable(&nodes, node_names, true).await?;
    tokio::time::sleep(settle).await;
    let bound: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let observer = {
        let bound = bound.clone();
        let cfg = watcher::Config::default().labels(&format!("{BACKLOG_LABEL}=true"));
        let w = watcher(api.clone(), cfg)
            .default_backoff()
            .touched_objects();
        tokio::spawn(async move {
            let mut w = w.boxed();
            while let Some(ev) = w.next().await {
                let Ok(obj) = ev else { continue };
                let is_bound = obj
                    .data
                    .get("status")
                    .and_then(|s| s.get("nodeName"))
                    .is_some_and(|n| n.is_string());
                if is_bound {
                    let mut b = bound.lock().unwrap_or_else(|p| p.into_inner());
                    b.entry(obj.metadata.name.clone().unwrap_or_default())
                        .or_insert_with(Instant::now);
                }
            }
        })
    };
    futures::stream::iter(first..first + count)
        .map(|i| {
            let api = api.clone();
            async move {
                let obj: DynamicObject = serde_json::from_value(backlog_manifest(i, namespace))
                    .map_err(|e| SimError::Other(e.to_string()))?;
                api.create(&PostParams::default(), &obj).await?;
                Ok::<_, SimError>(())
            }
        })
        .buffer_unordered(concurrency.max(1))
        .try_collect::<Vec<()>>()
        .await?;
    tokio::time::sleep(settle).await;
    let early = bound.lock().unwrap_or_else(|p| p.into_inner()).len();
    if early > 0 {
        observer.abort();
        return Err(SimError::Other(format!(
            "{early} backlog VMIs were bound while every node was cordoned"
        )));
    }
    let t0 = Instant::now();
    set_unschedulable(&nodes, node_names, false).await?;
    let uncordon = t0.elapsed();
    let deadline = Instant::now() + Duration::from_secs(120 + count as u64 / 5);
    let last = loop {
        let (n, last) = {
            let b = bound.lock().unwrap_or_else(|p| p.into_inner());
            (b.len(), b.values().max().copied())
        };
        if n >= count {
            break last.unwrap_or(t0);
        }
        if Instant::now() > deadline {
            observer.abort();
            return Err(SimError::Other(format!(
                "only {n} of {count} backlog VMIs bound {:?} after the uncordon",
                t0.elapsed()
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    observer.abort();
    Ok(Backlog {
        count,
        uncordon_to_last_bind: last.saturating_duration_since(t0),
        uncordon,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backlog_vmis_carry_both_labels() {
        let v = backlog_manifest(12, "default");
        assert_eq!(v["metadata"]["labels"][BACKLOG_LABEL], "true");
        assert_eq!(v["metadata"]["labels"][crate::bench::BENCH_LABEL], "true");
        assert_eq!(v["metadata"]["name"], "scale-00012");
    }

    #[test]
    fn rate_is_binds_per_second_of_the_drain() {
        let b = Backlog {
            count: 1000,
            uncordon_to_last_bind: Duration::from_millis(2500),
            uncordon: Duration::from_millis(100),
        };
        assert!((b.rate() - 400.0).abs() < 1e-9);
    }
}
