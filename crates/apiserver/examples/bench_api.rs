//! API server benchmark: ConfigMap creates per second through the API (kube-rs over HTTPS)
//! against the raw create rate of the same store with the same durability (SQLite WAL with
//! `synchronous=FULL`; etcd with its default fsync per commit), and watch delivery latency
//! (create acknowledged -> ADDED event received) with many concurrent watchers against one
//! watcher alone.
//!
//! `cargo run --release -p ferrovirt-apiserver --example bench_api -- [--backend sqlite|etcd|both]
//! [--n 2000] [--concurrency 8] [--runs 3] [--watchers 100] [--events 200] [--gap-ms 5]`
//!
//! SQLite lives in temp dirs; etcd is started from `/usr/bin/etcd` (or `$FERROVIRT_ETCD_BIN`)
//! on free 127.0.0.1 ports with a temp data dir and killed at the end. Raw and API runs
//! alternate (raw, API, raw, API, ...) on fresh keys, and medians are printed.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferrovirt_apiserver::{Server, ServerOptions};
use ferrovirt_store::{EtcdStore, ListOptions, SqliteStore, Store};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{ListParams, PostParams, WatchEvent, WatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use serde_json::json;

const DEFAULT_ETCD: &str = "/usr/bin/etcd";
const NAMESPACE: &str = "default";
/// Filler in each ConfigMap's data, sized so that a stored object is about 500 bytes.
const FILLER_LEN: usize = 300;

#[derive(Debug, Clone)]
struct Args {
    backends: Vec<Backend>,
    n: usize,
    concurrency: usize,
    runs: usize,
    watchers: usize,
    events: usize,
    gap: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Sqlite,
    Etcd,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Etcd => "etcd",
        }
    }
}

const USAGE: &str = "usage: bench_api [--backend sqlite|etcd|both] [--n N] [--concurrency C] \
                     [--runs R] [--watchers W] [--events M] [--gap-ms MS]";

fn parse_args() -> Result<Args> {
    let mut args = Args {
        backends: vec![Backend::Sqlite, Backend::Etcd],
        n: 2000,
        concurrency: 8,
        runs: 3,
        watchers: 100,
        events: 200,
        gap: Duration::from_millis(5),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) => (f.to_owned(), Some(v.to_owned())),
            None => (arg.clone(), None),
        };
        if flag == "-h" || flag == "--help" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        const FLAGS: [&str; 7] = [
            "--backend",
            "--n",
            "--concurrency",
            "--runs",
            "--watchers",
            "--events",
            "--gap-ms",
        ];
        if !FLAGS.contains(&flag.as_str()) {
            bail!("unknown argument {arg:?}\n{USAGE}");
        }
        let value = match inline {
            Some(v) => v,
            None => it
                .next()
                .with_context(|| format!("{flag} needs a value\n{USAGE}"))?,
        };
        let number = || -> Result<usize> {
            let v: usize = value
                .parse()
                .with_context(|| format!("{flag}: {value:?} is not a number"))?;
            if v == 0 {
                bail!("{flag} must be at least 1");
            }
            Ok(v)
        };
        match flag.as_str() {
            "--backend" => {
                args.backends = match value.as_str() {
                    "sqlite" => vec![Backend::Sqlite],
                    "etcd" => vec![Backend::Etcd],
                    "both" => vec![Backend::Sqlite, Backend::Etcd],
                    other => bail!("--backend {other:?}: use sqlite, etcd or both"),
                }
            }
            "--n" => args.n = number()?,
            "--concurrency" => args.concurrency = number()?,
            "--runs" => args.runs = number()?,
            "--watchers" => args.watchers = number()?,
            "--events" => args.events = number()?,
            "--gap-ms" => {
                args.gap = Duration::from_millis(
                    value
                        .parse()
                        .with_context(|| format!("--gap-ms: {value:?} is not a number"))?,
                )
            }
            _ => unreachable!("checked against FLAGS above"),
        }
    }
    Ok(args)
}

/// The ConfigMap data used by both paths.
fn filler(i: usize) -> String {
    let mut s = format!("{i:08}-");
    while s.len() < FILLER_LEN {
        s.push_str("abcdefghijklmnopqrstuvwxyz0123456789");
    }
    s.truncate(FILLER_LEN);
    s
}

/// What the raw store path writes: a ConfigMap as the API server would store it.
fn raw_value(name: &str, i: usize) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": format!("00000000-0000-4000-8000-{i:012}"),
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "data": {"payload": filler(i)},
    }))
    .expect("serializing a JSON value")
}

fn config_map(name: &str, i: usize) -> ConfigMap {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name},
        "data": {"payload": filler(i)},
    }))
    .expect("a ConfigMap")
}

/// Runs `n` jobs (`job(i)` for i in 0..n) on `concurrency` tasks; returns jobs per second.
async fn rate<F, Fut>(n: usize, concurrency: usize, job: F) -> Result<f64>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<()>> + Send,
{
    let job = Arc::new(job);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (job, next) = (job.clone(), next.clone());
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return Ok::<(), anyhow::Error>(());
                }
                job(i).await?;
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

async fn raw_creates(store: Arc<dyn Store>, tag: String, n: usize, c: usize) -> Result<f64> {
    rate(n, c, move |i| {
        let store = store.clone();
        let name = format!("raw-{tag}-{i}");
        async move {
            let key = format!("/registry/core/configmaps/{NAMESPACE}/{name}");
            store.create(&key, raw_value(&name, i)).await?;
            Ok(())
        }
    })
    .await
}

async fn api_creates(api: Api<ConfigMap>, tag: String, n: usize, c: usize) -> Result<f64> {
    rate(n, c, move |i| {
        let api = api.clone();
        let name = format!("api-{tag}-{i}");
        async move {
            api.create(&PostParams::default(), &config_map(&name, i))
                .await
                .with_context(|| format!("creating ConfigMap {name}"))?;
            Ok(())
        }
    })
    .await
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        (s[m - 1] + s[m]) / 2.0
    }
}

/// Nearest-rank percentile of sorted samples.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn fmt_runs(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.0}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What [`watch_latency`] measured; every list is sorted, in milliseconds.
struct WatchRun {
    /// Receive time minus create-ack time, one sample per watcher and event.
    latency: Vec<f64>,
    /// Create round trips (request start to acknowledgement).
    round_trip: Vec<f64>,
    /// Events some watcher never received.
    missing: usize,
}

/// Opens `watchers` watches, then creates `events` ConfigMaps one at a time, `gap` apart.
async fn watch_latency(
    api: &Api<ConfigMap>,
    tag: &str,
    watchers: usize,
    events: usize,
    gap: Duration,
) -> Result<WatchRun> {
    let list = api.list_metadata(&ListParams::default().limit(1)).await?;
    let rv = list
        .metadata
        .resource_version
        .context("list without resourceVersion")?;
    let prefix = format!("watch-{tag}-");
    // Open every watch (the server answers once its store watch exists) before creating.
    let opened = futures::future::try_join_all((0..watchers).map(|_| {
        let wp = WatchParams::default().timeout(290);
        let (api, rv) = (api.clone(), rv.clone());
        async move { api.watch(&wp, &rv).await }
    }))
    .await
    .context("opening watches")?;
    let origin = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for stream in opened {
        let prefix = prefix.clone();
        tasks.spawn(async move {
            let mut stream = std::pin::pin!(stream);
            let mut seen: Vec<Option<f64>> = vec![None; events];
            let mut got = 0;
            while got < events {
                let Some(ev) = stream.next().await else { break };
                let at = origin.elapsed().as_secs_f64();
                if let Ok(WatchEvent::Added(cm)) = ev {
                    let idx = cm
                        .metadata
                        .name
                        .as_deref()
                        .and_then(|n| n.strip_prefix(prefix.as_str()))
                        .and_then(|n| n.parse::<usize>().ok());
                    if let Some(slot) = idx.and_then(|i| seen.get_mut(i))
                        && slot.is_none()
                    {
                        *slot = Some(at);
                        got += 1;
                    }
                }
            }
            seen
        });
    }
    tokio::time::sleep(Duration::from_millis(200)).await;

    let (mut acks, mut round_trip) = (Vec::with_capacity(events), Vec::with_capacity(events));
    for i in 0..events {
        let name = format!("{prefix}{i}");
        let sent = origin.elapsed().as_secs_f64();
        api.create(&PostParams::default(), &config_map(&name, i))
            .await
            .with_context(|| format!("creating ConfigMap {name}"))?;
        let ack = origin.elapsed().as_secs_f64();
        acks.push(ack);
        round_trip.push((ack - sent) * 1000.0);
        tokio::time::sleep(gap).await;
    }

    let mut samples = Vec::with_capacity(watchers * events);
    let mut missing = 0;
    let collect = async {
        while let Some(r) = tasks.join_next().await {
            for (i, at) in r?.into_iter().enumerate() {
                match at {
                    Some(t) => samples.push((t - acks[i]) * 1000.0),
                    None => missing += 1,
                }
            }
        }
        Ok::<(), anyhow::Error>(())
    };
    if tokio::time::timeout(Duration::from_secs(60), collect)
        .await
        .is_err()
    {
        bail!("watchers did not receive every event within 60 s");
    }
    samples.sort_by(f64::total_cmp);
    round_trip.sort_by(f64::total_cmp);
    Ok(WatchRun {
        latency: samples,
        round_trip,
        missing,
    })
}

/// A running etcd; killed (and its data dir removed) on drop.
struct Etcd {
    child: Child,
    endpoint: String,
    dir: tempfile::TempDir,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Etcd {
    /// `$FERROVIRT_ETCD_BIN` or `/usr/bin/etcd`; an error when it is missing.
    fn binary() -> Result<PathBuf> {
        let bin = std::env::var_os("FERROVIRT_ETCD_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_ETCD));
        if !bin.is_file() {
            bail!(
                "etcd not found at {}: the etcd benchmark needs a real etcd (Debian package \
                 etcd-server, installed by scripts/install-deps.sh; or set FERROVIRT_ETCD_BIN), \
                 or run with --backend sqlite",
                bin.display()
            );
        }
        Ok(bin)
    }

    async fn start() -> Result<Etcd> {
        let bin = Self::binary()?;
        let dir = tempfile::Builder::new().prefix("bench-etcd-").tempdir()?;
        let (client, peer) = (free_port()?, free_port()?);
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log = std::fs::File::create(dir.path().join("etcd.log"))?;
        let child = Command::new(&bin)
            .arg("--name=bench")
            .arg(format!("--data-dir={}", dir.path().join("data").display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=bench={peer_url}"))
            .arg("--initial-cluster-state=new")
            .arg("--log-level=warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut etcd = Etcd {
            child,
            endpoint: client_url,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = etcd.child.try_wait()? {
                let log =
                    std::fs::read_to_string(etcd.dir.path().join("etcd.log")).unwrap_or_default();
                bail!("etcd exited early ({status}):\n{log}");
            }
            if etcd.connect("/probe").await.is_ok() {
                return Ok(etcd);
            }
            if Instant::now() > deadline {
                bail!("etcd at {} did not answer within 30 s", etcd.endpoint);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn connect(&self, prefix: &str) -> Result<EtcdStore> {
        let store = tokio::time::timeout(
            Duration::from_secs(3),
            EtcdStore::connect(std::slice::from_ref(&self.endpoint), prefix),
        )
        .await
        .context("etcd connect timed out")??;
        Ok(store)
    }
}

async fn kube_api(server: &Server) -> Result<Api<ConfigMap>> {
    let kc = Kubeconfig::read_from(&server.kubeconfig_path)?;
    let cfg = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Api::namespaced(Client::try_from(cfg)?, NAMESPACE))
}

async fn bench_backend(backend: Backend, args: &Args) -> Result<()> {
    let name = backend.name();
    let started = Instant::now();
    let tmp = tempfile::Builder::new().prefix("bench-api-").tempdir()?;
    let mut etcd = None;
    let (raw, api_store): (Arc<dyn Store>, Option<Arc<dyn Store>>) = match backend {
        Backend::Sqlite => (
            Arc::new(SqliteStore::open(tmp.path().join("raw/state.db")).await?),
            None,
        ),
        Backend::Etcd => {
            let e = Etcd::start().await?;
            let raw = Arc::new(e.connect("/bench-raw").await?);
            let api = Arc::new(e.connect("/bench-api").await?);
            etcd = Some(e);
            (raw, Some(api))
        }
    };
    let server = Server::start(ServerOptions {
        data_dir: tmp.path().join("server"),
        listen: "127.0.0.1:0".parse()?,
        store: api_store,
        ..Default::default()
    })
    .await?;
    let result = async {
        let api = kube_api(&server).await?;
        let (n, c) = (args.n, args.concurrency);
        // Warm-up: open the client's connections, fill caches.
        raw_creates(raw.clone(), "warm".into(), 4 * c, c).await?;
        api_creates(api.clone(), "warm".into(), 4 * c, c).await?;
        let (mut raw_rates, mut api_rates) = (Vec::new(), Vec::new());
        for run in 0..args.runs {
            raw_rates.push(raw_creates(raw.clone(), run.to_string(), n, c).await?);
            api_rates.push(api_creates(api.clone(), run.to_string(), n, c).await?);
        }
        let raw_size = raw_value("raw-0-0", 0).len();
        let stored = server
            .store
            .get(&format!("/registry/core/configmaps/{NAMESPACE}/api-0-0"))
            .await?
            .map(|kv| kv.value.len())
            .unwrap_or(0);
        let (a, r) = (median(&api_rates), median(&raw_rates));
        // Each API run follows its raw run, so the per-pair ratios see the same neighbours.
        let paired: Vec<f64> = api_rates
            .iter()
            .zip(&raw_rates)
            .map(|(x, y)| x / y)
            .collect();
        println!(
            "{name}: API {a:.0} creates/s, raw store {r:.0} writes/s, ratio X/Y = {:.2}",
            a / r
        );
        println!(
            "{name}: (N={n}, C={c}, medians of {runs}; API runs [{}], raw runs [{}], paired \
             ratios [{}], median {:.2}; value {raw_size} B raw, {stored} B as stored by the API)",
            fmt_runs(&api_rates),
            fmt_runs(&raw_rates),
            paired
                .iter()
                .map(|x| format!("{x:.2}"))
                .collect::<Vec<_>>()
                .join(", "),
            median(&paired),
            runs = args.runs,
        );

        let alone = watch_latency(&api, "alone", 1, args.events, args.gap).await?;
        let many = watch_latency(&api, "many", args.watchers, args.events, args.gap).await?;
        if alone.latency.is_empty() || many.latency.is_empty() {
            bail!("no watch events were received");
        }
        let (l, b) = (&many.latency, &alone.latency);
        let (p50, p99) = (percentile(l, 50.0), percentile(l, 99.0));
        let (b50, b99) = (percentile(b, 50.0), percentile(b, 99.0));
        // A ratio of values at or below zero (event before the ack) means nothing.
        let ratio = |x: f64, base: f64| {
            if x > 0.0 && base > 0.0 {
                format!("{:.2}", x / base)
            } else {
                "n/a (a value <= 0)".to_owned()
            }
        };
        let missing = many.missing + alone.missing;
        println!(
            "{name}: watch latency (create ack -> ADDED received), {w} watchers x {m} events: \
             p50 {p50:.2} ms, p99 {p99:.2} ms; 1 watcher alone: p50 {b50:.2} ms, p99 {b99:.2} ms; \
             ratio {w}/1: p50 {}, p99 {}; difference: p50 {:+.2} ms, p99 {:+.2} ms",
            ratio(p50, b50),
            ratio(p99, b99),
            p50 - b50,
            p99 - b99,
            w = args.watchers,
            m = args.events,
        );
        println!(
            "{name}: ({} samples, min {:.2} ms, max {:.2} ms; create round trip p50 {:.2} ms \
             with {w} watchers, {:.2} ms alone{})",
            l.len(),
            l[0],
            l[l.len() - 1],
            percentile(&many.round_trip, 50.0),
            percentile(&alone.round_trip, 50.0),
            if missing > 0 {
                format!("; {missing} events never arrived")
            } else {
                String::new()
            },
            w = args.watchers,
        );
        let total = raw
            .list("/registry/", ListOptions::default())
            .await
            .map(|l| l.items.len())
            .unwrap_or(0);
        println!(
            "{name}: done in {:.1} s ({total} raw keys written)",
            started.elapsed().as_secs_f64()
        );
        Ok::<(), anyhow::Error>(())
    }
    .await;
    server.shutdown().await;
    drop(raw);
    drop(etcd);
    result
}

async fn run(args: Args) -> Result<()> {
    println!(
        "bench_api: backends {:?}, N={} creates at concurrency {}, {} runs; {} watchers x {} \
         events, {} ms apart",
        args.backends.iter().map(|b| b.name()).collect::<Vec<_>>(),
        args.n,
        args.concurrency,
        args.runs,
        args.watchers,
        args.events,
        args.gap.as_millis()
    );
    if args.backends.contains(&Backend::Etcd) {
        Etcd::binary()?;
    }
    let started = Instant::now();
    for backend in &args.backends {
        bench_backend(*backend, &args)
            .await
            .with_context(|| format!("{} benchmark", backend.name()))?;
    }
    println!("total {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let result = match parse_args() {
        // On Ctrl-C the benchmark future is dropped, which kills etcd and removes temp dirs.
        Ok(args) => tokio::select! {
            r = run(args) => r,
            _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
        },
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench_api: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
