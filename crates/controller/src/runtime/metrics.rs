//! The controllers' own metrics, in KubeVirt's names (virt-controller exports client-go's
//! workqueue metrics as `kubevirt_workqueue_*`), rendered as Prometheus text by [`render`] and
//! served on the API server's `/metrics` when the controllers run in its process (the binary
//! passes [`render`] as the server's extra metrics):
//! - `kubevirt_workqueue_work_duration_seconds{name}`: how long each reconcile took (a
//!   histogram, client-go's buckets), through [`timed`], which wraps a kube-runtime reconciler;
//! - `kubevirt_workqueue_adds_total{name}`: reconciles started;
//! - `kubevirt_workqueue_retries_total{name}`: reconciles that failed and were requeued;
//! - `kubevirt_workqueue_unfinished_work_seconds{name}` and
//!   `kubevirt_workqueue_longest_running_processor_seconds{name}`: the age of the reconciles
//!   running now (their sum, the oldest);
//! - `kubevirt_workqueue_depth{name}`: the objects waiting, for the loops that own their queue
//!   (the scheduler's pending VMIs). kube-runtime's controllers keep their queue private, so it
//!   is not reported for them.
//!
//! One process-wide registry: the controllers of a process are one virt-controller.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Instant;

use futures::FutureExt;
use futures::future::BoxFuture;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// client-go's workqueue buckets: 10^-8 s … 10 s, ten per decade step.
const BUCKETS: [f64; 10] = [1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.1, 1.0, 10.0];

type Labels = Vec<(&'static str, &'static str)>;

fn new_histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

struct Metrics {
    registry: Registry,
    work: Family<Labels, Histogram, fn() -> Histogram>,
    adds: Family<Labels, Counter>,
    retries: Family<Labels, Counter>,
    depth: Family<Labels, Gauge>,
    unfinished: Family<Labels, Gauge<f64, AtomicU64>>,
    longest: Family<Labels, Gauge<f64, AtomicU64>>,
    /// The reconciles running now: (name, id) → start.
    running: Mutex<BTreeMap<(&'static str, i64), Instant>>,
    next_id: AtomicI64,
    /// Every controller name seen.
    names: Mutex<BTreeSet<&'static str>>,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    let mut registry = Registry::default();
    let work = Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(
        new_histogram as fn() -> Histogram,
    );
    let adds = Family::<Labels, Counter>::default();
    let retries = Family::<Labels, Counter>::default();
    let depth = Family::<Labels, Gauge>::default();
    let unfinished = Family::<Labels, Gauge<f64, AtomicU64>>::default();
    let longest = Family::<Labels, Gauge<f64, AtomicU64>>::default();
    registry.register(
        "kubevirt_workqueue_work_duration_seconds",
        "How long in seconds processing an item from workqueue takes",
        work.clone(),
    );
    registry.register(
        "kubevirt_workqueue_adds",
        "Total number of adds handled by workqueue",
        adds.clone(),
    );
    registry.register(
        "kubevirt_workqueue_retries",
        "Total number of retries handled by workqueue",
        retries.clone(),
    );
    registry.register(
        "kubevirt_workqueue_depth",
        "Current depth of workqueue",
        depth.clone(),
    );
    registry.register(
        "kubevirt_workqueue_unfinished_work_seconds",
        "How many seconds of work has done that is in progress",
        unfinished.clone(),
    );
    registry.register(
        "kubevirt_workqueue_longest_running_processor_seconds",
        "How many seconds has the longest running processor for workqueue been running",
        longest.clone(),
    );
    Metrics {
        registry,
        work,
        adds,
        retries,
        depth,
        unfinished,
        longest,
        running: Mutex::default(),
        next_id: AtomicI64::new(0),
        names: Mutex::default(),
    }
});

fn labels(name: &'static str) -> Labels {
    vec![("name", name)]
}

/// Wraps a kube-runtime reconciler so that each reconcile of controller `name` is counted and
/// timed.
pub fn timed<K, C, T, E, F, Fut>(
    name: &'static str,
    reconcile: F,
) -> impl FnMut(Arc<K>, Arc<C>) -> BoxFuture<'static, Result<T, E>>
where
    F: Fn(Arc<K>, Arc<C>) -> Fut,
    Fut: std::future::Future<Output = Result<T, E>> + Send + 'static,
{
    move |obj, ctx| {
        let fut = reconcile(obj, ctx);
        let m = &*METRICS;
        m.adds.get_or_create(&labels(name)).inc();
        let id = m.next_id.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        if let Ok(mut r) = m.running.lock() {
            r.insert((name, id), started);
        }
        if let Ok(mut n) = m.names.lock() {
            n.insert(name);
        }
        async move {
            // Recorded on every path, a cancelled reconcile included.
            let _done = Done { name, id, started };
            fut.await
        }
        .boxed()
    }
}

struct Done {
    name: &'static str,
    id: i64,
    started: Instant,
}

impl Drop for Done {
    fn drop(&mut self) {
        let m = &*METRICS;
        m.work
            .get_or_create(&labels(self.name))
            .observe(self.started.elapsed().as_secs_f64());
        if let Ok(mut r) = m.running.lock() {
            r.remove(&(self.name, self.id));
        }
    }
}

/// Counts a failed reconcile of controller `name` (kube-runtime requeues it).
pub fn retried(name: &'static str) {
    METRICS.retries.get_or_create(&labels(name)).inc();
}

/// Sets the number of objects waiting in the queue of loop `name`.
pub fn set_depth(name: &'static str, depth: usize) {
    METRICS
        .depth
        .get_or_create(&labels(name))
        .set(i64::try_from(depth).unwrap_or(i64::MAX));
}

/// (sum, oldest) of the ages, per name, of the reconciles running at `now`.
fn ages(
    running: &BTreeMap<(&'static str, i64), Instant>,
    now: Instant,
) -> BTreeMap<&'static str, (f64, f64)> {
    let mut out: BTreeMap<&'static str, (f64, f64)> = BTreeMap::new();
    for ((name, _), started) in running {
        let age = now.duration_since(*started).as_secs_f64();
        let e = out.entry(name).or_default();
        e.0 += age;
        e.1 = e.1.max(age);
    }
    out
}

/// The controllers' metrics as Prometheus text (without the `# EOF` line, so that it can
/// follow another exposition).
pub fn render() -> String {
    let m = &*METRICS;
    let now = Instant::now();
    let running = m.running.lock().map(|r| ages(&r, now)).unwrap_or_default();
    // Names seen before that run nothing now go back to 0.
    let known: Vec<&'static str> = m
        .names
        .lock()
        .map(|n| n.iter().copied().collect())
        .unwrap_or_default();
    for name in known {
        let (sum, oldest) = running.get(name).copied().unwrap_or_default();
        m.unfinished.get_or_create(&labels(name)).set(sum);
        m.longest.get_or_create(&labels(name)).set(oldest);
    }
    let mut out = String::new();
    if encode(&mut out, &m.registry).is_err() {
        return String::new();
    }
    out.strip_suffix("# EOF\n").unwrap_or(&out).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn ages_sum_and_oldest_per_name() {
        let now = Instant::now();
        let mut r = BTreeMap::new();
        r.insert(("a", 1), now - Duration::from_secs(3));
        r.insert(("a", 2), now - Duration::from_secs(1));
        r.insert(("b", 3), now);
        let a = ages(&r, now);
        assert!((a["a"].0 - 4.0).abs() < 0.01 && (a["a"].1 - 3.0).abs() < 0.01);
        assert!(a["b"].1 < 0.01);
    }

    #[tokio::test]
    async fn reconciles_are_counted_timed_and_rendered() {
        let mut r = timed("unit-test", |n: Arc<u32>, _c: Arc<()>| async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            if *n == 0 { Err("no") } else { Ok(*n) }
        });
        assert_eq!(r(Arc::new(2), Arc::new(())).await, Ok(2));
        assert!(r(Arc::new(0), Arc::new(())).await.is_err());
        retried("unit-test");
        set_depth("unit-test", 7);
        let text = render();
        assert!(
            text.contains(r#"kubevirt_workqueue_adds_total{name="unit-test"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"kubevirt_workqueue_retries_total{name="unit-test"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"kubevirt_workqueue_depth{name="unit-test"} 7"#),
            "{text}"
        );
        assert!(
            text.contains(r#"kubevirt_workqueue_work_duration_seconds_count{name="unit-test"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"kubevirt_workqueue_unfinished_work_seconds{name="unit-test"} 0"#),
            "{text}"
        );
        assert!(!text.contains("# EOF"), "{text}");
    }
}
