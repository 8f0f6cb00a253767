#!/usr/bin/env bash
# Export benchmark (issue #17): download throughput of a VirtualMachineExport through the API
# server (curl over HTTPS, export token; the bytes streamed from the node agent of the `local`
# volume) vs reading the volume's file directly, raw and gzip. Baselines measured in the same
# run: `cat FILE > /dev/null` and `sha256sum FILE` (what a downloader checking the disk does)
# for raw, `gzip -1 -c FILE > /dev/null` for gzip (the export compresses at gzip's fast level),
# and the same file served over one HTTPS connection by `openssl s_server -WWW` to the same
# curl (what any TLS download of the file costs here: the floor of an HTTPS export).
# Cold cache too: `cat` and the export after the file's pages were dropped from the page cache
# (posix_fadvise DONTNEED on that one file, nothing else is evicted), so both read the disk.
# The TLS cipher that curl negotiates with the server is printed (AES-GCM expected: the CPU
# has AES-NI). Goal: ratio (our throughput / baseline) >= 0.8. Use a release binary (--bin) for figures
# that mean something: a debug build runs TLS, HTTP and deflate unoptimized.
# The volume is --size-mib MiB, its first half random bytes, the rest zeros (sparse); the
# file is in the page cache for every run (warmed first), so both sides read memory.
# Usage: bench/export.sh [--size-mib 512] [--runs 5] [--bin target/debug/ferrovirt]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
SIZE=512 RUNS=5 BIN=$ROOT/target/debug/ferrovirt DIR=/var/tmp
while [ $# -gt 0 ]; do
  case "$1" in
    --size-mib) SIZE=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --bin) BIN=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -x "$BIN" ] || { echo "no $BIN: cargo build -p ferrovirt" >&2; exit 2; }
WORK=$(mktemp -d "$DIR/fv-exportbench-XXXXXX")
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$BIN" server --data-dir "$WORK/data" --listen "127.0.0.1:$PORT" --node-name bench \
  --network-mode user >"$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -rf "$WORK"' EXIT
KC="$WORK/data/kubeconfig.yaml"
k() { kubectl --kubeconfig "$KC" --cache-dir "$WORK/kcache" "$@"; }
for _ in $(seq 300); do
  [ -f "$KC" ] && k get --raw /readyz >/dev/null 2>&1 && break
  sleep 0.2
done
k apply -f - >/dev/null <<YAML
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {name: bench, namespace: default}
spec:
  source: {blank: {}}
  storage: {resources: {requests: {storage: ${SIZE}Mi}}}
YAML
for _ in $(seq 300); do
  [ "$(k get dv bench -n default -o jsonpath='{.status.phase}' 2>/dev/null)" = Succeeded ] && break
  sleep 0.2
done
PV=$(k get pvc bench -n default -o jsonpath='{.spec.volumeName}')
IMG="$WORK/data/agent/volumes/$PV/disk.img"
dd if=/dev/urandom of="$IMG" bs=1M count=$((SIZE / 2)) conv=notrunc status=none
k apply -f - >/dev/null <<YAML
apiVersion: export.kubevirt.io/v1beta1
kind: VirtualMachineExport
metadata: {name: bench, namespace: default}
spec:
  source: {apiGroup: "", kind: PersistentVolumeClaim, name: bench}
YAML
for _ in $(seq 300); do
  [ "$(k get vmexport bench -n default -o jsonpath='{.status.phase}' 2>/dev/null)" = Ready ] && break
  sleep 0.2
done
TOKEN=$(k get secret export-token-bench -n default -o jsonpath='{.data.token}' | base64 -d)
URL=$(k get vmexport bench -n default -o jsonpath='{.status.links.external.volumes[0].formats[0].url}')
CA="$WORK/data/tls/ca.crt"
want=$(sha256sum <"$IMG" | cut -d' ' -f1)
got=$(curl -sf --cacert "$CA" -H "x-kubevirt-export-token: $TOKEN" "$URL" | sha256sum | cut -d' ' -f1)
[ "$want" = "$got" ] || { echo "export bytes differ from the volume" >&2; exit 1; }
gz=$(curl -sf --cacert "$CA" -H "x-kubevirt-export-token: $TOKEN" "$URL.gz" | gzip -dc | sha256sum | cut -d' ' -f1)
[ "$want" = "$gz" ] || { echo "gzip export bytes differ from the volume" >&2; exit 1; }

# The TLS baseline: the same file over HTTPS from openssl's own server, fetched by curl.
openssl req -x509 -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -days 1 \
  -keyout "$WORK/tls.key" -out "$WORK/tls.crt" >/dev/null 2>&1
mkdir -p "$WORK/www" && ln -s "$IMG" "$WORK/www/disk.img"
TLSPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
(cd "$WORK/www" && exec openssl s_server -quiet -WWW -accept "127.0.0.1:$TLSPORT" \
  -cert "$WORK/tls.crt" -key "$WORK/tls.key") >/dev/null 2>&1 &
SSERVER=$!
trap 'kill $SERVER $SSERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq 50); do
  curl -sfk -o /dev/null -r 0-0 "https://127.0.0.1:$TLSPORT/disk.img" && break
  sleep 0.1
done
tls=$(curl -sfk "https://127.0.0.1:$TLSPORT/disk.img" | sha256sum | cut -d' ' -f1)
[ "$want" = "$tls" ] || { echo "the TLS baseline's bytes differ from the volume" >&2; exit 1; }

secs() { local t0 t1; t0=$(date +%s.%N); "$@"; t1=$(date +%s.%N); echo "$t1 - $t0" | bc -l; }
base_raw() { cat "$IMG" >/dev/null; }
base_sha() { sha256sum "$IMG" >/dev/null; }
base_gz() { gzip -1 -c "$IMG" >/dev/null; }
evict() { sync "$IMG"; python3 -c 'import os,sys; fd=os.open(sys.argv[1], os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)' "$IMG"; }
base_cold() { evict; cat "$IMG" >/dev/null; }
ours_cold() { evict; curl -sf --cacert "$CA" -H "x-kubevirt-export-token: $TOKEN" -o /dev/null "$URL"; }
base_tls() { curl -sfk -o /dev/null "https://127.0.0.1:$TLSPORT/disk.img"; }
ours_raw() { curl -sf --cacert "$CA" -H "x-kubevirt-export-token: $TOKEN" -o /dev/null "$URL"; }
# Diagnostic: the node agent's export route alone (one TLS hop, the agents' token).
AGENT=$(k get node bench -o jsonpath='{.metadata.annotations.ferrovirt\.io/agent-endpoint}')
ADMIN=$(cat "$WORK/data/token")
agent_raw() { curl -sfk -H "Authorization: Bearer $ADMIN" -o /dev/null "$AGENT/storage/volumes/$PV/export"; }
ours_gz() { curl -sf --cacert "$CA" -H "x-kubevirt-export-token: $TOKEN" -o /dev/null "$URL.gz"; }
median() { sort -g | awk '{a[NR]=$1} END {if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
declare -A T
ALL="base_raw base_sha base_tls ours_raw agent_raw base_gz ours_gz base_cold ours_cold"
for f in $ALL; do T[$f]=""; done
echo "TLS: export $(curl -sv --cacert "$CA" -H "x-kubevirt-export-token: $TOKEN" -o /dev/null -r 0-0 "$URL" 2>&1 | grep -o 'SSL connection using .*' | head -1)"
echo "TLS: openssl s_server $(curl -svk -o /dev/null -r 0-0 "https://127.0.0.1:$TLSPORT/disk.img" 2>&1 | grep -o 'SSL connection using .*' | head -1)"
cat "$IMG" >/dev/null
for _ in $(seq "$RUNS"); do
  for f in $ALL; do
    T[$f]+="$(secs $f)"$'\n'
  done
done
echo "volume ${SIZE} MiB (half random, half zeros), ${RUNS} runs, medians:"
for pair in "raw cat:base_raw" "raw sha256sum:base_sha" "raw https-file:base_tls" "gz gzip-1:base_gz" "cold cat-cold:base_cold"; do
  fmt=${pair%% *}; rest=${pair#* }; name=${rest%%:*}; base=${rest#*:}
  b=$(printf '%s' "${T[$base]}" | median)
  o=$(printf '%s' "${T[ours_$fmt]}" | median)
  awk -v s="$SIZE" -v b="$b" -v o="$o" -v f="$fmt" -v n="$name" 'BEGIN {
    printf "%-4s baseline %-10s %7.1f MiB/s (%.3f s)  export %7.1f MiB/s (%.3f s)  ratio %.2f (goal >= 0.8)\n",
      f, n, s / b, b, s / o, o, b / o }'
done
a=$(printf '%s' "${T[agent_raw]}" | median)
awk -v s="$SIZE" -v a="$a" 'BEGIN { printf "(diagnostic: the node agent route alone %.1f MiB/s, %.3f s)\n", s / a, a }'
