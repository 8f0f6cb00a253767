//! `ferrovirt-simnodes`: **benchmark harness only** (see the crate doc). Runs simulated node
//! agents (no QEMU) against a running `ferrovirt server --disable-agent` and drives the scale
//! benchmark of `bench/scale/run.sh`. Never used by the end-to-end tests of behaviour.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use ferrovirt_simnodes::bench::{self, BenchOptions, RawStore};

#[derive(Debug, Parser)]
#[command(
    name = "ferrovirt-simnodes",
    about = "Scale benchmark harness: simulated nodes (no QEMU)"
)]
struct Args {
    /// The server's kubeconfig.
    #[arg(long)]
    kubeconfig: PathBuf,
    /// Simulated nodes.
    #[arg(long, default_value_t = 100)]
    nodes: usize,
    /// VMIs to create.
    #[arg(long, default_value_t = 10_000)]
    vmis: usize,
    /// Creates in flight at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Watch-delivery probes and their rate per second.
    #[arg(long, default_value_t = 1000)]
    probes: usize,
    #[arg(long, default_value_t = 100.0)]
    probe_rate: f64,
    /// Seconds of idle CPU measurement.
    #[arg(long, default_value_t = 30)]
    idle_secs: u64,
    /// The server's pid (CPU, RSS from /proc).
    #[arg(long)]
    server_pid: u32,
    /// etcd's pid when etcd is the store.
    #[arg(long)]
    store_pid: Option<u32>,
    /// Raw-store baseline: the server's SQLite file...
    #[arg(long, conflicts_with = "etcd")]
    sqlite: Option<PathBuf>,
    /// ...or its etcd endpoint.
    #[arg(long)]
    etcd: Option<String>,
    #[arg(long, default_value_t = 5)]
    list_runs: usize,
    #[arg(long, default_value_t = 500)]
    page: usize,
    #[arg(long, default_value = "default")]
    namespace: String,
    /// VMIs queued behind cordoned nodes for the scheduler-alone phase (0: skip it).
    #[arg(long, default_value_t = 2000)]
    backlog: usize,
    /// Every simulated node renews its Lease at the same moment (the harness before the ninth
    /// pass of docs/scale.md) instead of spread over the renewal interval.
    #[arg(long)]
    synchronized_heartbeats: bool,
    /// The simulated nodes' Lease duration in seconds, renewed every quarter of it as the agent
    /// does (default: the agent's, 16 s; what `spec.nodeFailure.leaseDurationSeconds` sets).
    #[arg(long)]
    lease_seconds: Option<u32>,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let a = Args::parse();
    let (raw, backend) = match (a.sqlite, a.etcd) {
        (Some(db), None) => (RawStore::Sqlite(db), "sqlite"),
        (None, Some(e)) => (RawStore::Etcd(e), "etcd"),
        _ => anyhow::bail!("give the raw store: --sqlite PATH or --etcd URL"),
    };
    let opts = BenchOptions {
        kubeconfig: a.kubeconfig,
        nodes: a.nodes,
        vmis: a.vmis,
        concurrency: a.concurrency,
        probes: a.probes,
        probe_rate: a.probe_rate,
        idle: Duration::from_secs(a.idle_secs),
        server_pid: a.server_pid,
        store_pid: a.store_pid,
        raw,
        list_runs: a.list_runs,
        page: a.page,
        namespace: a.namespace,
        backend: backend.into(),
        backlog: a.backlog,
        synchronized_heartbeats: a.synchronized_heartbeats,
        lease_seconds: a.lease_seconds,
    };
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?
        .block_on(bench::run(opts))
        .context("scale benchmark")
}
