//! The scale benchmark driver (benchmark harness only, see the crate doc): starts N simulated
//! nodes against a running server, creates M VMIs with bounded concurrency and measures what
//! issue #15 asks for — time to create and bind all, the scheduler's bind rate, the server's RSS
//! and CPU, watch delivery latency with every simulated node watching, list latency of all VMIs
//! with and without `limit`/`continue` (beside the raw store's list in the same run), and the
//! idle control plane's CPU. `bench/scale/run.sh` starts the server (and etcd) and runs this.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;

use crate::procstat::{self, Sample};
use crate::requests;
use crate::sim::{
    PROBE_ANNOTATION, ProbeTimes, Probes, SimError, SimNode, SimNodeOptions, heartbeat_phase,
};
use crate::stats::{self, line, ms};

/// The label every benchmark VMI carries.
pub const BENCH_LABEL: &str = "bench.ferrovirt.io/scale";
/// How long after all VMIs are Running the create phase's request count is taken.
const SETTLE: Duration = Duration::from_secs(3);
/// Watch-delivery probe writes in flight at once.
const PROBES_IN_FLIGHT: usize = 16;
/// The slowest probes printed with their timelines.
const SLOWEST_PROBES: usize = 10;
/// The store key prefix of VMIs (see the apiserver's `resources` module).
pub const VMI_PREFIX: &str = "/registry/kubevirt.io/virtualmachineinstances/";

/// Where the raw-store baseline lists from.
#[derive(Debug, Clone)]
pub enum RawStore {
    /// The server's SQLite file: copied with `VACUUM INTO` (the server holds its lock), then
    /// listed through [`ferrovirt_store::SqliteStore`].
    Sqlite(PathBuf),
    /// The etcd the server uses, listed through [`ferrovirt_store::EtcdStore`].
    Etcd(String),
}

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub kubeconfig: PathBuf,
    pub nodes: usize,
    pub vmis: usize,
    /// Creates in flight at once.
    pub concurrency: usize,
    /// Watch-delivery probes (annotation writes) and how many per second.
    pub probes: usize,
    pub probe_rate: f64,
    /// Seconds of idle measurement.
    pub idle: Duration,
    /// The server process (and etcd's, when it is the store) for CPU and memory.
    pub server_pid: u32,
    pub store_pid: Option<u32>,
    pub raw: RawStore,
    pub list_runs: usize,
    pub page: usize,
    pub namespace: String,
    /// Label for the report (`sqlite`, `etcd`).
    pub backend: String,
    /// VMIs of the scheduler-alone phase ([`crate::backlog`]); 0 skips it.
    pub backlog: usize,
    /// Every node renews at the same moment (the harness before the ninth pass) instead of
    /// spread over the renewal interval ([`heartbeat_phase`]).
    pub synchronized_heartbeats: bool,
    /// The nodes' Lease duration (`None`: the agent's default), renewed every quarter of it.
    pub lease_seconds: Option<u32>,
}

async fn client(kubeconfig: &PathBuf, user_agent: &str) -> Result<kube::Client, SimError> {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig)
        .map_err(|e| SimError::Other(format!("reading {}: {e}", kubeconfig.display())))?;
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .map_err(|e| SimError::Other(format!("kubeconfig: {e}")))?;
    let ua = http::HeaderValue::from_str(user_agent)
        .map_err(|e| SimError::Other(format!("user agent: {e}")))?;
    cfg.headers.push((http::header::USER_AGENT, ua));
    // Lists of 10k VMIs take a while on a loaded 2-core machine.
    cfg.read_timeout = Some(Duration::from_secs(300));
    Ok(kube::Client::try_from(cfg)?)
}

pub fn vmi_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstance"),
        "virtualmachineinstances",
    )
}

/// The name of the `i`-th benchmark VMI.
pub fn vmi_name(i: usize) -> String {
    format!("scale-{i:05}")
}

/// The `i`-th benchmark VMI: 64 MiB, 100 millicores, no disks (the simulated nodes start
/// nothing), grace period 0.
pub fn vmi_manifest(i: usize, namespace: &str) -> serde_json::Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": vmi_name(i), "namespace": namespace, "labels": {BENCH_LABEL: "true"}},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "domain": {
                "devices": {},
                "resources": {"requests": {"memory": "64Mi", "cpu": "100m"}},
            },
        },
    })
}

/// The simulated node names.
pub fn node_names(count: usize) -> Vec<String> {
    (0..count).map(|i| format!("sim-{i:03}")).collect()
}

/// When each VMI was seen bound and Running by the benchmark's own watch.
#[derive(Debug, Default)]
struct Seen {
    bound: HashMap<String, Instant>,
    running: HashMap<String, Instant>,
}

/// Runs everything and prints the report.
pub async fn run(opts: BenchOptions) -> Result<(), SimError> {
    println!(
        "# scale benchmark ({}): {} VMIs over {} simulated nodes, {} creates in flight",
        opts.backend, opts.vmis, opts.nodes, opts.concurrency
    );
    let probes = Arc::new(Probes::default());
    // 1. The simulated nodes: register, heartbeat, watch.
    let names = node_names(opts.nodes);
    let mut sims = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let c = client(&opts.kubeconfig, &format!("ferrovirt-simnodes/{name}")).await?;
        let mut node_opts = SimNodeOptions::new(name.clone());
        if let Some(secs) = opts.lease_seconds {
            node_opts = node_opts.with_lease_seconds(secs)?;
        }
        if !opts.synchronized_heartbeats {
            node_opts.phase = heartbeat_phase(i, names.len(), node_opts.renew_interval);
        }
        sims.push(SimNode::new(c, node_opts, probes.clone()));
    }
    let t = Instant::now();
    futures::stream::iter(sims.iter().cloned())
        .map(|s| async move { s.register().await })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel(opts.nodes.max(1));
    for s in &sims {
        tokio::spawn(s.clone().heartbeat());
        tokio::spawn(s.clone().watch(ready_tx.clone()));
    }
    for _ in 0..opts.nodes {
        ready_rx.recv().await;
    }
    println!(
        "# {} nodes registered and watching in {}",
        opts.nodes,
        ms(t.elapsed())
    );
    // Let the leases land and the controllers see the nodes.
    tokio::time::sleep(Duration::from_secs(3)).await;

    // 2. Our own watch of every benchmark VMI: when it was bound and when Running.
    let driver = client(&opts.kubeconfig, "ferrovirt-simnodes/driver").await?;
    let api: Api<DynamicObject> =
        Api::namespaced_with(driver.clone(), &opts.namespace, &vmi_resource());
    let seen = Arc::new(Mutex::new(Seen::default()));
    let observer = {
        let seen = seen.clone();
        let cfg = watcher::Config::default().labels(&format!("{BENCH_LABEL}=true"));
        let w = watcher(api.clone(), cfg)
            .default_backoff()
            .touched_objects();
        tokio::spawn(async move {
            let mut w = w.boxed();
            while let Some(ev) = w.next().await {
                let Ok(obj) = ev else { continue };
                let now = Instant::now();
                let name = obj.metadata.name.clone().unwrap_or_default();
                let status = obj.data.get("status");
                let mut s = seen.lock().unwrap_or_else(|p| p.into_inner());
                if status
                    .and_then(|s| s.get("nodeName"))
                    .is_some_and(|n| n.is_string())
                {
                    s.bound.entry(name.clone()).or_insert(now);
                }
                if status.and_then(|s| s.get("phase")).and_then(|p| p.as_str()) == Some("Running") {
                    s.running.entry(name).or_insert(now);
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;

    // 3. Create every VMI, bounded concurrency.
    let requests_before = metrics_text(&driver).await;
    let before = sample(opts.server_pid)?;
    let store_before = opts.store_pid.and_then(procstat::sample);
    let start = Instant::now();
    let acks: Vec<(usize, Instant)> = futures::stream::iter(0..opts.vmis)
        .map(|i| {
            let api = api.clone();
            let ns = opts.namespace.clone();
            async move {
                let obj: DynamicObject = serde_json::from_value(vmi_manifest(i, &ns))
                    .map_err(|e| SimError::Other(e.to_string()))?;
                api.create(&PostParams::default(), &obj).await?;
                Ok::<_, SimError>((i, Instant::now()))
            }
        })
        .buffer_unordered(opts.concurrency.max(1))
        .try_collect()
        .await?;
    let created = start.elapsed();
    println!("# {} VMIs created in {}", opts.vmis, ms(created));
    let deadline = Instant::now() + Duration::from_secs(120 + opts.vmis as u64 / 5);
    loop {
        let (b, r) = {
            let s = seen.lock().unwrap_or_else(|p| p.into_inner());
            (s.bound.len(), s.running.len())
        };
        if r >= opts.vmis {
            break;
        }
        if Instant::now() > deadline {
            return Err(SimError::Other(format!(
                "only {b} bound and {r} Running of {} VMIs after {:?}",
                opts.vmis,
                start.elapsed()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let busy_wall = start.elapsed();
    let after = sample(opts.server_pid)?;
    let store_after = opts.store_pid.and_then(procstat::sample);
    // The requests of the create → Running phase, with a few seconds for the writes that
    // follow Running (conditions, Events) to land.
    tokio::time::sleep(SETTLE).await;
    let requests_busy = requests::between(
        &requests::parse(&requests_before.unwrap_or_default()),
        &requests::parse(&metrics_text(&driver).await.unwrap_or_default()),
    );
    let (bound, running) = {
        let s = seen.lock().unwrap_or_else(|p| p.into_inner());
        (s.bound.clone(), s.running.clone())
    };
    let ack_at: HashMap<String, Instant> = acks.iter().map(|(i, at)| (vmi_name(*i), *at)).collect();
    let last_bind = bound.values().max().copied().unwrap_or(start);
    let first_bind = bound.values().min().copied().unwrap_or(start);
    let last_running = running.values().max().copied().unwrap_or(start);
    let bind_lag: Vec<Duration> = bound
        .iter()
        .filter_map(|(n, at)| ack_at.get(n).map(|a| at.saturating_duration_since(*a)))
        .collect();
    let create_rate = stats::rate(opts.vmis, created);
    let sched_rate = stats::rate(opts.vmis, last_bind.saturating_duration_since(first_bind));

    // 4. Watch delivery: annotation writes seen by the node that runs the VMI, all nodes watching.
    // Each write is its own task (at most PROBES_IN_FLIGHT at once), so that its stamp is taken
    // as it is sent and its response is read as it arrives, whatever the other writes do.
    let probe_requests_before = metrics_text(&driver).await;
    let probe_start = Instant::now();
    let probe_wall_start = k8s_openapi::jiff::Timestamp::now();
    let probe_epoch_start = probes.epoch.elapsed();
    // Printed now (stdout is line-buffered), so that a profiler can be started on this line.
    println!(
        "# probing began {probe_wall_start:.3} (server logs and traces are on the same clock)"
    );
    let step = (opts.vmis / opts.probes.max(1)).max(1);
    let gap = Duration::from_secs_f64(1.0 / opts.probe_rate.max(0.1));
    let mut tick = tokio::time::interval(gap);
    let slots = Arc::new(tokio::sync::Semaphore::new(PROBES_IN_FLIGHT));
    let mut writers = tokio::task::JoinSet::new();
    for k in 0..opts.probes.min(opts.vmis) {
        tick.tick().await;
        let Ok(slot) = slots.clone().acquire_owned().await else {
            break;
        };
        let api = api.clone();
        let probes = probes.clone();
        writers.spawn(async move {
            let _slot = slot;
            let value = probes.stamp();
            let patch = json!({"metadata": {"annotations": {PROBE_ANNOTATION: &value}}});
            match api
                .patch(
                    &vmi_name(k * step),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await
            {
                Ok(_) => probes.ack(&value),
                Err(e) => tracing::warn!("probe write: {e}"),
            }
        });
    }
    while writers.join_next().await.is_some() {}
    let want = opts.probes.min(opts.vmis);
    let wait_until = Instant::now() + Duration::from_secs(10);
    while probes.latencies().len() < want && Instant::now() < wait_until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lats = probes.latencies();
    let probe_wall = probe_start.elapsed();
    let probe_requests = requests::between(
        &requests::parse(&probe_requests_before.unwrap_or_default()),
        &requests::parse(&metrics_text(&driver).await.unwrap_or_default()),
    );
    let timelines = probes.timelines();

    // 5. List latency: the API (whole, and in pages) beside the raw store.
    let path = format!(
        "/apis/kubevirt.io/v1/namespaces/{}/virtualmachineinstances",
        opts.namespace
    );
    let mut whole = Vec::new();
    let mut paged = Vec::new();
    let mut bytes = 0;
    for _ in 0..opts.list_runs {
        match api_list(&driver, &path, None).await {
            Ok((d, b)) => {
                whole.push(d);
                bytes = b;
            }
            Err(e) => println!("# API list (whole) failed: {e}"),
        }
        match api_list(&driver, &path, Some(opts.page)).await {
            Ok((d, _)) => paged.push(d),
            Err(e) => println!("# API list (pages) failed: {e}"),
        }
    }
    let (raw_whole, raw_paged, raw_count) = match raw_lists(&opts).await {
        Ok(r) => r,
        Err(e) => {
            println!("# raw store list failed: {e}");
            (Vec::new(), Vec::new(), opts.vmis)
        }
    };

    // 6. Idle: everything Running, every node heartbeating and watching. The API requests
    // served meanwhile (from /metrics) give the CPU per request; FV_SCALE_PERF_IDLE_FILE
    // records a perf profile of the server for this window only.
    let idle_text0 = metrics_text(&driver).await;
    let req0 = idle_text0.as_deref().map(parse_request_total);
    let perf = idle_profile(opts.server_pid, opts.idle);
    let idle0 = sample(opts.server_pid)?;
    let idle_store0 = opts.store_pid.and_then(procstat::sample);
    let t_idle = Instant::now();
    tokio::time::sleep(opts.idle).await;
    let idle_wall = t_idle.elapsed();
    let idle1 = sample(opts.server_pid)?;
    let idle_store1 = opts.store_pid.and_then(procstat::sample);
    let idle_text1 = metrics_text(&driver).await;
    let req1 = idle_text1.as_deref().map(parse_request_total);
    if let Some(mut p) = perf {
        let _ = p.wait();
    }
    observer.abort();

    // 7. The scheduler alone: a backlog queued behind cordoned nodes, then drained.
    let backlog = if opts.backlog > 0 {
        match crate::backlog::run(
            &driver,
            &opts.namespace,
            &names,
            opts.backlog,
            opts.vmis,
            opts.concurrency,
            Duration::from_secs(3),
        )
        .await
        {
            Ok(b) => Some(b),
            Err(e) => {
                println!("# scheduler backlog phase failed: {e}");
                None
            }
        }
    } else {
        None
    };

    // The report.
    let rss_mib = |kib: u64| kib as f64 / 1024.0;
    let ms_of = |d: Option<Duration>| d.map(ms).unwrap_or_else(|| "-".into());
    let p99 = stats::percentile(&lats, 99.0);
    let acks: Vec<Duration> = timelines.iter().filter_map(|t| t.ack_latency()).collect();
    let after_acks: Vec<Duration> = timelines.iter().filter_map(|t| t.after_ack()).collect();
    let pair_of = |v: &[Duration]| {
        format!(
            "{} / {}",
            ms_of(stats::median(v)),
            ms_of(stats::percentile(v, 99.0))
        )
    };
    let idle_cpu = procstat::cpu_share(&idle0, &idle1, idle_wall) * 100.0;
    let busy_cpu = procstat::cpu_share(&before, &after, busy_wall);
    println!();
    println!(
        "## {} — {} VMIs / {} simulated nodes",
        opts.backend, opts.vmis, opts.nodes
    );
    let out = [
        line(
            "time to create all",
            &format!("{:.2} s ({create_rate:.0}/s)", created.as_secs_f64()),
            "",
            None,
        ),
        line(
            "time to create and bind all",
            &format!(
                "{:.2} s",
                last_bind.saturating_duration_since(start).as_secs_f64()
            ),
            "",
            None,
        ),
        line(
            "time until all Running",
            &format!(
                "{:.2} s",
                last_running.saturating_duration_since(start).as_secs_f64()
            ),
            "",
            None,
        ),
        line(
            "bind rate while creating (first to last bind)",
            &format!("{sched_rate:.0}/s"),
            "",
            None,
        ),
        line(
            "bind lag after create ack p50 / p99",
            &format!(
                "{} / {}",
                ms_of(stats::median(&bind_lag)),
                ms_of(stats::percentile(&bind_lag, 99.0))
            ),
            "",
            None,
        ),
        line(
            "server CPU while creating (cores, avg)",
            &format!("{busy_cpu:.2}"),
            "",
            None,
        ),
        line(
            "server RSS now / peak",
            &format!(
                "{:.0} / {:.0} MiB",
                rss_mib(idle1.rss_kib),
                rss_mib(idle1.hwm_kib)
            ),
            "< 1024 MiB",
            Some(idle1.hwm_kib < 1024 * 1024),
        ),
        line(
            &format!("watch delivery p50 ({} of {want} probes seen)", lats.len()),
            &ms_of(stats::median(&lats)),
            "",
            None,
        ),
        line(
            &format!("watch delivery p99 ({} nodes watching)", opts.nodes),
            &ms_of(p99),
            "< 100 ms",
            Some(p99.is_some_and(|p| p < Duration::from_millis(100)) && lats.len() == want),
        ),
        line(
            "  sent → write acknowledged, p50 / p99",
            &pair_of(&acks),
            "",
            None,
        ),
        line(
            "  acknowledged → delivered, p50 / p99",
            &pair_of(&after_acks),
            "",
            None,
        ),
        line(
            &format!(
                "list {} VMIs, whole ({:.1} MiB), median",
                raw_count,
                bytes as f64 / 1048576.0
            ),
            &ms_of(stats::median(&whole)),
            "",
            None,
        ),
        line(
            "  raw store list, same keys, median",
            &ms_of(stats::median(&raw_whole)),
            "",
            None,
        ),
        line(
            "  ratio API / raw",
            &ratio(stats::median(&whole), stats::median(&raw_whole)),
            "",
            None,
        ),
        line(
            &format!("list {} VMIs in pages of {}, median", raw_count, opts.page),
            &ms_of(stats::median(&paged)),
            "",
            None,
        ),
        line(
            "  raw store, same pages, median",
            &ms_of(stats::median(&raw_paged)),
            "",
            None,
        ),
        line(
            "  ratio API / raw",
            &ratio(stats::median(&paged), stats::median(&raw_paged)),
            "",
            None,
        ),
        line(
            &format!("idle server CPU over {:.0} s", idle_wall.as_secs_f64()),
            &format!("{idle_cpu:.2} % of a core"),
            "< 5 %",
            Some(idle_cpu < 5.0),
        ),
    ];
    for l in out {
        println!("{l}");
    }
    if let Some(b) = &backlog {
        let rate = b.rate();
        println!(
            "{}",
            line(
                &format!(
                    "scheduler VMIs/s ({} queued, uncordon to last bind)",
                    b.count
                ),
                &format!(
                    "{rate:.0}/s ({:.2} s, uncordon {})",
                    b.uncordon_to_last_bind.as_secs_f64(),
                    ms(b.uncordon)
                ),
                ">= 500/s",
                Some(rate >= 500.0),
            )
        );
    }
    {
        let o = SimNodeOptions::new("");
        println!(
            "{}",
            line(
                "  each node's heartbeat (the agent's defaults)",
                &format!(
                    "Lease ({} s) renewed every {:.1} s, Node looked at every {} s",
                    o.lease_duration.as_secs(),
                    o.renew_interval.as_secs_f64(),
                    o.node_status_interval.as_secs()
                ),
                "",
                None
            )
        );
    }
    if let (Some(a), Some(b)) = (req0, req1) {
        // The two /metrics reads themselves are not counted (they are not resource requests).
        let n = b.saturating_sub(a);
        let cpu = idle1.cpu.saturating_sub(idle0.cpu);
        println!(
            "{}",
            line(
                "  idle API requests / s, server CPU per request",
                &format!(
                    "{:.1}/s, {}",
                    n as f64 / idle_wall.as_secs_f64(),
                    cpu_per_request(cpu, n)
                ),
                "",
                None
            )
        );
    }
    if let (Some(a), Some(b), Some(c), Some(d)) =
        (store_before, store_after, idle_store0, idle_store1)
    {
        println!(
            "{}",
            line(
                "etcd CPU while creating (cores, avg)",
                &format!("{:.2}", procstat::cpu_share(&a, &b, busy_wall)),
                "",
                None
            )
        );
        println!(
            "{}",
            line(
                "idle etcd CPU",
                &format!(
                    "{:.2} % of a core",
                    procstat::cpu_share(&c, &d, idle_wall) * 100.0
                ),
                "",
                None
            )
        );
        println!(
            "{}",
            line(
                "etcd RSS now / peak",
                &format!("{:.0} / {:.0} MiB", rss_mib(d.rss_kib), rss_mib(d.hwm_kib)),
                "",
                None
            )
        );
    }
    println!(
        "# probes written over {}; lists: {} runs each",
        ms(probe_wall),
        opts.list_runs
    );
    println!(
        "# slowest {SLOWEST_PROBES} probes (ms after the first probe was sent): sent, acknowledged, delivered"
    );
    for t in slowest(&timelines, SLOWEST_PROBES) {
        let at = |d: Option<Duration>| {
            d.map(|d| {
                format!(
                    "{:.1}",
                    (d.saturating_sub(probe_epoch_start)).as_secs_f64() * 1e3
                )
            })
            .unwrap_or_else(|| "-".into())
        };
        println!(
            "#   {:>9} {:>9} {:>9}",
            at(Some(t.sent)),
            at(t.acked),
            at(t.delivered)
        );
    }
    println!("# API requests while probing: count, per probe");
    for row in requests::table(&probe_requests, want) {
        println!("#   {row}");
    }
    println!(
        "# API requests from the first create until all Running (+{} s), by component, verb and resource: count, per VMI",
        SETTLE.as_secs()
    );
    for row in requests::table(&requests_busy, opts.vmis) {
        println!("#   {row}");
    }
    if let (Some(a), Some(b)) = (idle_text0, idle_text1) {
        println!(
            "# API requests in the idle window ({:.0} s): count, per VMI",
            idle_wall.as_secs_f64()
        );
        let idle = requests::between(&requests::parse(&a), &requests::parse(&b));
        for row in requests::table(&idle, opts.vmis) {
            println!("#   {row}");
        }
    }
    Ok(())
}

/// The `n` probes that took longest from sent to delivered (not delivered counts as longest),
/// slowest first.
pub fn slowest(timelines: &[ProbeTimes], n: usize) -> Vec<ProbeTimes> {
    let mut v = timelines.to_vec();
    v.sort_by_key(|t| {
        std::cmp::Reverse(
            t.delivered
                .map(|d| d.saturating_sub(t.sent))
                .unwrap_or(Duration::MAX),
        )
    });
    v.truncate(n);
    v
}

/// The sum of `apiserver_request_total` in a `/metrics` text.
pub fn parse_request_total(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<u64>().ok())
        .sum()
}

/// CPU per request as text (`-` with no requests).
pub fn cpu_per_request(cpu: Duration, requests: u64) -> String {
    if requests == 0 {
        return "-".into();
    }
    format!("{:.2} ms", cpu.as_secs_f64() * 1000.0 / requests as f64)
}

/// The server's `/metrics` text: every API request it has counted so far (`None`: unreadable).
async fn metrics_text(client: &kube::Client) -> Option<String> {
    let req = http::Request::get("/metrics").body(Vec::new()).ok()?;
    client.request_text(req).await.ok()
}

/// `perf record` of the server for the idle window, when `FV_SCALE_PERF_IDLE_FILE` names the file
/// (`bench/scale/run.sh` sets it from `FV_SCALE_PERF_IDLE=DIR`).
fn idle_profile(pid: u32, window: Duration) -> Option<std::process::Child> {
    let out = std::env::var_os("FV_SCALE_PERF_IDLE_FILE").filter(|v| !v.is_empty())?;
    let (pid, secs) = (pid.to_string(), window.as_secs().to_string());
    // FV_SCALE_PERF_ARGS (e.g. "-F 99 --call-graph dwarf,16384") replaces `-F 999`.
    let args = std::env::var("FV_SCALE_PERF_ARGS").unwrap_or_else(|_| "-F 999".into());
    let child = std::process::Command::new("perf")
        .args(["record", "-q"])
        .args(args.split_whitespace())
        .args(["-p", pid.as_str(), "-o"])
        .arg(&out)
        .args(["--", "sleep", secs.as_str()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
    match child {
        Ok(c) => Some(c),
        Err(e) => {
            println!("# perf for the idle window did not start: {e}");
            None
        }
    }
}

fn ratio(a: Option<Duration>, b: Option<Duration>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if !b.is_zero() => format!("{:.1}x", a.as_secs_f64() / b.as_secs_f64()),
        _ => "-".into(),
    }
}

fn sample(pid: u32) -> Result<Sample, SimError> {
    procstat::sample(pid).ok_or_else(|| SimError::Other(format!("process {pid} is gone")))
}

/// One list through the API, as raw bytes (the client does not decode the items): the wall
/// time of every page together and the bytes of the last page.
async fn api_list(
    client: &kube::Client,
    path: &str,
    page: Option<usize>,
) -> Result<(Duration, usize), SimError> {
    let mut total = Duration::ZERO;
    let mut cont: Option<String> = None;
    loop {
        let mut uri = path.to_string();
        if let Some(limit) = page {
            uri.push_str(&format!("?limit={limit}"));
            if let Some(c) = &cont {
                uri.push_str(&format!("&continue={c}"));
            }
        }
        let req = http::Request::get(&uri)
            .body(Vec::new())
            .map_err(|e| SimError::Other(e.to_string()))?;
        let t = Instant::now();
        let body = client.request_text(req).await?;
        total += t.elapsed();
        if !body.contains("\"items\":[") {
            return Err(SimError::Other(format!(
                "not a list: {}",
                body.chars().take(300).collect::<String>()
            )));
        }
        cont = continue_token(&body);
        if page.is_none() || cont.is_none() {
            return Ok((total, body.len()));
        }
    }
}

/// The `metadata.continue` of a list body (empty or absent: none).
pub fn continue_token(body: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Meta {
        #[serde(rename = "continue")]
        cont: Option<String>,
    }
    #[derive(serde::Deserialize)]
    struct List {
        metadata: Meta,
    }
    serde_json::from_str::<List>(body)
        .ok()
        .and_then(|l| l.metadata.cont)
        .filter(|c| !c.is_empty())
}

/// The raw store's list of the same keys: whole and in pages, `list_runs` times each.
async fn raw_lists(opts: &BenchOptions) -> Result<(Vec<Duration>, Vec<Duration>, usize), SimError> {
    use ferrovirt_store::{ListOptions, Store};
    let _copy_dir;
    let store: Arc<dyn Store> = match &opts.raw {
        RawStore::Sqlite(db) => {
            let dir = tempfile::tempdir().map_err(|e| SimError::Other(e.to_string()))?;
            let copy = dir.path().join("copy.db");
            {
                let conn = rusqlite::Connection::open_with_flags(
                    db,
                    rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
                )?;
                conn.execute("VACUUM INTO ?1", [copy.to_string_lossy().as_ref()])?;
            }
            _copy_dir = dir;
            Arc::new(ferrovirt_store::SqliteStore::open(&copy).await?)
        }
        RawStore::Etcd(endpoint) => {
            Arc::new(ferrovirt_store::EtcdStore::connect(std::slice::from_ref(endpoint), "").await?)
        }
    };
    let prefix = format!("{VMI_PREFIX}{}/", opts.namespace);
    let (mut whole, mut paged) = (Vec::new(), Vec::new());
    let mut count = 0;
    for _ in 0..opts.list_runs {
        let t = Instant::now();
        let all = store.list(&prefix, ListOptions::default()).await?;
        whole.push(t.elapsed());
        count = all.items.len();
        let t = Instant::now();
        let mut after: Option<String> = None;
        let mut revision = None;
        loop {
            let page = store
                .list(
                    &prefix,
                    ListOptions {
                        start_after: after.clone(),
                        limit: Some(opts.page),
                        revision,
                    },
                )
                .await?;
            revision = Some(page.revision);
            after = page.items.last().map(|kv| kv.key.clone());
            if !page.more {
                break;
            }
        }
        paged.push(t.elapsed());
    }
    Ok((whole, paged, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifests_are_valid_vmis() {
        let v = vmi_manifest(7, "default");
        assert_eq!(v["metadata"]["name"], "scale-00007");
        let vmi: ferrovirt_api::kubevirt::vmi::VirtualMachineInstance =
            serde_json::from_value(v).unwrap();
        assert_eq!(vmi.metadata.labels.unwrap()[BENCH_LABEL], "true");
        assert_eq!(node_names(3), vec!["sim-000", "sim-001", "sim-002"]);
    }

    #[test]
    fn request_totals_and_cpu_per_request() {
        let text = "# HELP apiserver_request_total x\n# TYPE apiserver_request_total counter\n\
            apiserver_request_total{verb=\"UPDATE\",resource=\"leases.coordination.k8s.io\",user_agent=\"a b\"} 30\n\
            apiserver_request_total{verb=\"PATCH\",resource=\"nodes\",user_agent=\"c\"} 12\n\
            other_metric 99\n";
        assert_eq!(parse_request_total(text), 42);
        assert_eq!(parse_request_total(""), 0);
        assert_eq!(cpu_per_request(Duration::from_millis(300), 100), "3.00 ms");
        assert_eq!(cpu_per_request(Duration::from_millis(300), 0), "-");
    }

    #[test]
    fn slowest_probes_first_undelivered_before_all() {
        let ms = Duration::from_millis;
        let t = |sent, acked: Option<u64>, delivered: Option<u64>| ProbeTimes {
            sent: ms(sent),
            acked: acked.map(ms),
            delivered: delivered.map(ms),
        };
        let all = [
            t(0, Some(5), Some(10)),
            t(10, Some(100), Some(130)),
            t(20, Some(22), None),
            t(30, Some(35), Some(60)),
        ];
        assert_eq!(slowest(&all, 3), [all[2], all[1], all[3]]);
        assert_eq!(all[1].ack_latency(), Some(ms(90)));
        assert_eq!(all[1].after_ack(), Some(ms(30)));
        assert_eq!(all[2].after_ack(), None);
        // Delivered before the response was read: nothing after the acknowledgement.
        assert_eq!(t(0, Some(9), Some(7)).after_ack(), Some(ms(0)));
    }

    #[test]
    fn continue_tokens() {
        let body = r#"{"kind":"List","metadata":{"resourceVersion":"5","continue":"abc"},"items":[{"a":1}]}"#;
        assert_eq!(continue_token(body).as_deref(), Some("abc"));
        assert_eq!(
            continue_token(r#"{"metadata":{"continue":""},"items":[]}"#),
            None
        );
        assert_eq!(continue_token(r#"{"metadata":{},"items":[]}"#), None);
        assert_eq!(continue_token("not json"), None);
    }
}
