#!/usr/bin/env bash
# HTTP import of a 1 GiB disk image through a ferrovirt DataVolume vs. the same work done by
# hand (curl to a file, then `qemu-img convert -O raw`, which is what the importer does).
# The image is a qcow2 of 1 GiB virtual size filled with random data (`--fill half`: random
# data in every other MiB only, about 512 MiB, which makes the control plane's fixed cost count
# twice as much), served by `python3 -m http.server` on 127.0.0.1. The DataVolume side is timed from the POST of the DataVolume until a GET shows
# `status.phase: Succeeded` (shared class, so no node selection is involved), both with curl
# against the API: kubectl's own start-up (80-180 ms per call) would dominate otherwise.
# A blank 1 GiB DataVolume is timed the same way to show the control plane's fixed cost.
# Prints both medians and their ratio.
# Usage: bench/import.sh [--runs 3] [--fill full|half] [--binary target/release/ferrovirt] [--debug]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

RUNS=3
FILL=full
BINARY=""
PROFILE=release
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) RUNS=$2; shift 2 ;;
    --fill) FILL=$2; shift 2 ;;
    --binary) BINARY=$2; shift 2 ;;
    --debug) PROFILE=debug; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -z "$BINARY" ]; then
  if [ "$PROFILE" = release ]; then
    cargo build --release -q -p ferrovirt
  else
    cargo build -q -p ferrovirt
  fi
  BINARY="$ROOT/target/$PROFILE/ferrovirt"
fi
for tool in qemu-img curl python3 kubectl; do
  command -v "$tool" >/dev/null || { echo "$tool is required (scripts/install-deps.sh)" >&2; exit 1; }
done

WORK=$(mktemp -d /var/tmp/fv-import-bench.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

echo "# making the 1 GiB test image in $WORK"
mkdir -p "$WORK/www" "$WORK/manual"
python3 - "$WORK/image.raw" "$FILL" <<'EOF'
import os, sys
mib = 1 << 20
step = 2 if sys.argv[2] == "half" else 1
with open(sys.argv[1], "wb") as f:
    for i in range(1024):
        if i % step == 0:
            f.seek(i * mib)
            f.write(os.urandom(mib))
    f.truncate(1024 * mib)
EOF
qemu-img convert -f raw -O qcow2 "$WORK/image.raw" "$WORK/www/image.qcow2"
rm -f "$WORK/image.raw"
echo "# image: $(du -h "$WORK/www/image.qcow2" | cut -f1) qcow2, virtual size 1 GiB"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
HTTP_PORT=$(free_port)
python3 -m http.server "$HTTP_PORT" --bind 127.0.0.1 --directory "$WORK/www" >/dev/null 2>&1 &
PIDS+=($!)
URL="http://127.0.0.1:$HTTP_PORT/image.qcow2"
for _ in $(seq 50); do curl -sf -o /dev/null -r 0-0 "$URL" && break; sleep 0.1; done

now() { date +%s.%N; }
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

echo "# starting $BINARY server"
API_PORT=$(free_port)
DATA="$WORK/data"
# The image server listens on loopback, which imports may not reach unless allowed.
"$BINARY" server --data-dir "$DATA" --listen "127.0.0.1:$API_PORT" --disable-agent \
  --import-allowed-cidrs 127.0.0.1/32 >"$WORK/server.log" 2>&1 &
PIDS+=($!)
KC="$DATA/kubeconfig.yaml"
for _ in $(seq 300); do
  [ -f "$KC" ] && kubectl --kubeconfig "$KC" get --raw /readyz >/dev/null 2>&1 && break
  sleep 0.2
done
k() { kubectl --kubeconfig "$KC" "$@"; }
for _ in $(seq 100); do k get storageclass shared >/dev/null 2>&1 && break; sleep 0.2; done
TOKEN=$(cat "$DATA/token")
DVS="https://127.0.0.1:$API_PORT/apis/cdi.kubevirt.io/v1beta1/namespaces/default/datavolumes"
api() { curl -sf --cacert "$DATA/tls/ca.crt" -H "Authorization: Bearer $TOKEN" "$@"; }

# time_dv NAME SOURCE_JSON: seconds from the POST until a GET shows phase Succeeded.
time_dv() {
  local name=$1 source=$2 t0 t1 body
  sync
  t0=$(now)
  api -H 'Content-Type: application/json' -X POST "$DVS" -d "{
    \"apiVersion\": \"cdi.kubevirt.io/v1beta1\", \"kind\": \"DataVolume\",
    \"metadata\": {\"name\": \"$name\", \"namespace\": \"default\"},
    \"spec\": {\"source\": $source, \"storage\": {\"storageClassName\": \"shared\",
              \"resources\": {\"requests\": {\"storage\": \"1Gi\"}}}}}" >/dev/null
  while :; do
    body=$(api "$DVS/$name" || true)
    case "$body" in
      *'"phase":"Succeeded"'*) break ;;
      *'"phase":"Failed"'*) echo "$body" >&2; exit 1 ;;
    esac
    sleep 0.01
  done
  t1=$(now)
  awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.3f\n", b - a}'
  api -X DELETE "$DVS/$name" >/dev/null
  # Let the reclaim loop remove the volume before the next run.
  for _ in $(seq 100); do [ -z "$(ls -A "$DATA/volumes" 2>/dev/null)" ] && break; sleep 0.2; done
}

# time_manual: seconds for curl to a file + qemu-img convert to raw (what the importer does).
time_manual() {
  local t0 t1
  sync
  t0=$(now)
  curl -sf -o "$WORK/manual/download" "$URL"
  qemu-img convert -f qcow2 -O raw "$WORK/manual/download" "$WORK/manual/disk.img"
  t1=$(now)
  rm -f "$WORK/manual/download" "$WORK/manual/disk.img"
  awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.3f\n", b - a}'
}

# The two are interleaved run by run, so both see the same background load.
echo "# runs: manual (curl + qemu-img convert) | ferrovirt DataVolume | blank DataVolume"
MANUAL=()
FERRO=()
BLANK=()
for r in $(seq "$RUNS"); do
  MANUAL+=("$(time_manual)")
  FERRO+=("$(time_dv "bench-$r" "{\"http\": {\"url\": \"$URL\"}}")")
  BLANK+=("$(time_dv "blank-$r" '{"blank": {}}')")
  echo "  run $r: ${MANUAL[-1]} s | ${FERRO[-1]} s | ${BLANK[-1]} s"
done

M=$(printf '%s\n' "${MANUAL[@]}" | median)
F=$(printf '%s\n' "${FERRO[@]}" | median)
B=$(printf '%s\n' "${BLANK[@]}" | median)
RATIO=$(awk -v f="$F" -v m="$M" 'BEGIN {printf "%.3f", f / m}')
echo
echo "manual (curl + qemu-img convert) median: $M s"
echo "ferrovirt DataVolume import median:      $F s"
echo "ferrovirt blank DataVolume median:       $B s (control-plane fixed cost)"
echo "ratio ferrovirt/manual: $RATIO (target <= 1.10)"
