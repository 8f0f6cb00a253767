#!/usr/bin/env bash
# API server throughput and watch latency (crates/apiserver/examples/bench_api.rs): ConfigMap
# creates/s through the API vs the raw store's write rate with the same durability, for SQLite
# and etcd (started by the benchmark from /usr/bin/etcd on 127.0.0.1), and watch delivery
# latency p50/p99 with 100 watchers vs one watcher alone. Medians of 3 runs, one invocation.
# Usage: bench/api-throughput.sh [--backend sqlite|etcd|both] [--n 2000] [--concurrency 8]
#                                [--runs 3] [--watchers 100] [--events 200] [--gap-ms 5]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
scripts/install-deps.sh
cargo build --release -p ferrovirt-apiserver --example bench_api
exec cargo run --release -q -p ferrovirt-apiserver --example bench_api -- "$@"
