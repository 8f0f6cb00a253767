#!/usr/bin/env bash
# /metrics benchmark (issue #20; goal: under 50 ms with 100 VMIs on a node): the agent's
# scrape path (crates/agent/src/metrics: every launcher asked for its handshake, `stats` and
# `query-migrate`,
# QEMU's /proc read, the text rendered by prometheus-client) timed over --rounds scrapes with
# --vmis VMI directories, each served by a stand-in launcher that answers the control
# protocol as a real one does (a canned query-blockstats reply of two drives; no QEMU: 100
# real guests do not fit this machine), beside a baseline of reading /proc/<pid>/stat once
# per VMI. Medians, and the size of the text. It runs the ignored test
# `metrics::bench::metrics_scrape_benchmark` of ferrovirt-agent in the given cargo profile
# (the default debug profile is what the test suite builds; `--release` for release numbers).
# Usage: bench/metrics.sh [--vmis 100] [--rounds 21] [--release]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
VMIS=100 ROUNDS=21 PROFILE=()
while [ $# -gt 0 ]; do
  case "$1" in
    --vmis) VMIS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --release) PROFILE=(--release); shift ;;
    *) echo "usage: $0 [--vmis N] [--rounds M] [--release]" >&2; exit 2 ;;
  esac
done
FERROVIRT_METRICS_VMIS=$VMIS FERROVIRT_METRICS_ROUNDS=$ROUNDS \
  cargo test -q "${PROFILE[@]}" -p ferrovirt-agent --lib -- --ignored --exact \
  metrics::bench::metrics_scrape_benchmark --nocapture 2>&1 | grep '^metrics bench:'
