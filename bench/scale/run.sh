#!/usr/bin/env bash
# Scale benchmark (issue #15): N VMIs over M simulated nodes against a release-build
# `ferrovirt server --disable-agent`, on SQLite and on etcd (Debian's etcd on 127.0.0.1).
# The nodes are `ferrovirt-simnodes` (crates/simnodes), a BENCHMARK HARNESS that runs no QEMU:
# each simulated node registers its Node, renews its Lease, watches its own VMIs with the
# agent's field selector and reports them Running through the agent's own decision code.
# Prints, per backend: time to create and bind all, scheduler VMIs/s, server RSS and CPU,
# watch delivery p50/p99 with every node watching, list latency of all VMIs whole and in pages
# beside the raw store's list of the same keys (ratio), idle server (and etcd) CPU.
# Usage: bench/scale/run.sh [--vmis 10000] [--nodes 100] [--backend sqlite|etcd|both]
#                           [--concurrency 32] [--idle 30] [--probes 1000] [--backlog 2000] [--smoke]
#                           [--binary target/release/ferrovirt] [--no-build] [--lease-seconds 16]
# FV_SCALE_KEEP_LOGS=DIR keeps the server's log (server-BACKEND.log) and SQLite database in DIR.
# FV_SCALE_PERF=DIR records a flat perf profile of the server for the whole run in DIR
# (FV_SCALE_PERF_ARGS replaces its `-F 499`, and the idle one's `-F 999`, e.g. "-F 99 --call-graph dwarf,16384").
# FV_SCALE_PERF_IDLE=DIR records one of the idle window only (perf-idle-BACKEND.data).
# FV_SCALE_SERVER_LOG=filter sets the server's RUST_LOG (default warn).
# FV_SCALE_SIM=PATH runs another harness binary (e.g. target/debug/ferrovirt-simnodes).
# FV_SCALE_SIM_ARGS="..." passes more arguments to it (e.g. --synchronized-heartbeats).
# --smoke: 200 VMIs over 10 nodes, 5 s idle, 100 probes, a backlog of 100 (a quick check that it all works).
# --backlog N: VMIs queued behind cordoned nodes, then drained: the scheduler's own rate (0 skips).
# --lease-seconds N: the simulated nodes' Lease duration (renewed every N/4 s, as the agent renews
#   the duration a HyperConverged's spec.nodeFailure.leaseDurationSeconds sets; default 16).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"

HARNESS_RC=0
LEASE_ARGS=()
VMIS=10000 NODES=100 BACKEND=both CONC=32 IDLE=30 PROBES=1000 BACKLOG=2000 BUILD=1 BIN=""
while [ $# -gt 0 ]; do
  case "$1" in
    --vmis) VMIS=$2; shift 2 ;;
    --nodes) NODES=$2; shift 2 ;;
    --backend) BACKEND=$2; shift 2 ;;
    --concurrency) CONC=$2; shift 2 ;;
    --idle) IDLE=$2; shift 2 ;;
    --probes) PROBES=$2; shift 2 ;;
    --backlog) BACKLOG=$2; shift 2 ;;
    --lease-seconds) LEASE_ARGS=(--lease-seconds "$2"); shift 2 ;;
    --no-build) BUILD=0; shift ;;
    --binary) BIN=$2; shift 2 ;;
    --smoke) VMIS=200 NODES=10 IDLE=5 PROBES=100 BACKLOG=100; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ "$BUILD" = 1 ]; then
  cargo build --release -q -p ferrovirt -p ferrovirt-simnodes
fi
BIN=${BIN:-$ROOT/target/release/ferrovirt}
SIM=${FV_SCALE_SIM:-$ROOT/target/release/ferrovirt-simnodes}
ETCD_BIN=${FERROVIRT_ETCD_BIN:-/usr/bin/etcd}

WORK=$(mktemp -d /var/tmp/fv-scale-bench.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

echo "# $(date -u +%FT%TZ) on $(nproc) cores, load average: $(cut -d' ' -f1-3 /proc/loadavg)"

# run_one BACKEND: start etcd (if asked) and the server, run the harness, stop them.
run_one() {
  local backend=$1 data="$WORK/$1" port endpoint="" store_args=() store_pid_args=()
  mkdir -p "$data"
  if [ "$backend" = etcd ]; then
    [ -x "$ETCD_BIN" ] || { echo "etcd not found at $ETCD_BIN (scripts/install-deps.sh)" >&2; exit 1; }
    local cport pport
    cport=$(free_port); pport=$(free_port)
    "$ETCD_BIN" --name bench --data-dir "$data/etcd" \
      --listen-client-urls "http://127.0.0.1:$cport" --advertise-client-urls "http://127.0.0.1:$cport" \
      --listen-peer-urls "http://127.0.0.1:$pport" --initial-advertise-peer-urls "http://127.0.0.1:$pport" \
      --initial-cluster "bench=http://127.0.0.1:$pport" --quota-backend-bytes 8589934592 \
      >"$data/etcd.log" 2>&1 &
    local etcd_pid=$!
    PIDS+=("$etcd_pid")
    endpoint="http://127.0.0.1:$cport"
    for _ in $(seq 100); do curl -sf "$endpoint/health" | grep -q true && break; sleep 0.1; done
    store_args=(--etcd "$endpoint")
    store_pid_args=(--store-pid "$etcd_pid")
  else
    store_args=(--sqlite "$data/server/state.db")
  fi
  port=$(free_port)
  local server_args=(server --data-dir "$data/server" --listen "127.0.0.1:$port" --disable-agent)
  [ -n "$endpoint" ] && server_args+=(--datastore-endpoint "$endpoint")
  RUST_LOG=${FV_SCALE_SERVER_LOG:-warn} "$BIN" "${server_args[@]}" >"$data/server.log" 2>&1 &
  local server_pid=$!
  PIDS+=("$server_pid")
  local kc="$data/server/kubeconfig.yaml"
  for _ in $(seq 300); do
    [ -f "$kc" ] && kubectl --kubeconfig "$kc" get --raw /readyz >/dev/null 2>&1 && break
    sleep 0.2
  done
  local perf_pid=""
  if [ -n "${FV_SCALE_PERF:-}" ]; then
    mkdir -p "$FV_SCALE_PERF"
    perf record -q ${FV_SCALE_PERF_ARGS:--F 499} -p "$server_pid" -o "$FV_SCALE_PERF/perf-$backend.data" >/dev/null 2>&1 &
    perf_pid=$!
  fi
  local idle_perf=""
  if [ -n "${FV_SCALE_PERF_IDLE:-}" ]; then
    mkdir -p "$FV_SCALE_PERF_IDLE"; idle_perf="$FV_SCALE_PERF_IDLE/perf-idle-$backend.data"
  fi
  FV_SCALE_PERF_IDLE_FILE="$idle_perf" "$SIM" --kubeconfig "$kc" --nodes "$NODES" --vmis "$VMIS" --concurrency "$CONC" \
    --idle-secs "$IDLE" --probes "$PROBES" --backlog "$BACKLOG" --server-pid "$server_pid" \
    "${store_args[@]}" "${store_pid_args[@]}" "${LEASE_ARGS[@]}" ${FV_SCALE_SIM_ARGS:-} || HARNESS_RC=$?
  if [ -n "$perf_pid" ]; then kill -INT "$perf_pid" 2>/dev/null || true; wait "$perf_pid" 2>/dev/null || true; fi
  echo "# API requests by verb/resource (from /metrics, top 12):"
  kubectl --kubeconfig "$kc" get --raw /metrics 2>/dev/null \
    | awk '/^apiserver_request_total/ {print $NF, $1}' | sort -rn | head -12 | sed 's/^/#   /' || true
  kill "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  if [ -n "${FV_SCALE_KEEP_LOGS:-}" ]; then
    mkdir -p "$FV_SCALE_KEEP_LOGS" && cp "$data/server.log" "$FV_SCALE_KEEP_LOGS/server-$backend.log"
    if [ "$backend" = sqlite ]; then cp "$data"/server/state.db* "$FV_SCALE_KEEP_LOGS/" 2>/dev/null || true; fi
  fi
  if [ "$backend" = etcd ]; then kill "$etcd_pid" 2>/dev/null || true; wait "$etcd_pid" 2>/dev/null || true; fi
}

case "$BACKEND" in
  sqlite|etcd) run_one "$BACKEND" ;;
  both) run_one sqlite; run_one etcd ;;
  *) echo "--backend sqlite|etcd|both" >&2; exit 2 ;;
esac
exit "$HARNESS_RC"
