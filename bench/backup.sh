#!/usr/bin/env bash
# Backup benchmark (issue #18): full backup throughput of a raw disk image to S3 (4 MiB chunks,
# keyed ids, zstd, AES-256-GCM, dedup lookups; crates/backup/examples/backup_bench.rs) against
# uploading the same file with a plain S3 client (boto3's upload_file, multipart) to the same
# server in the same run. The server is moto (loopback), the image incompressible random bytes
# read from the page cache. Medians of --runs; ratio = ours / baseline (goal >= 0.8). After each
# full run, an incremental backup of the image with 5 % of its chunks rewritten (only those read,
# the others from the full backup's index): its median time against the full one. Then the full
# backup is restored into a file (checked byte for byte) against downloading the plain upload into
# a file with boto3 (the faster of download_file and one streamed get_object; goal >= 0.8).
# Usage: bench/backup.sh [--mib 256] [--runs 3] [--release]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
MIB=256 RUNS=3 PROFILE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --mib) MIB=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --release) PROFILE=--release; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
MOTO=${FERROVIRT_MOTO_SERVER:-/opt/ferrovirt-moto/bin/moto_server}
PY=$(dirname "$MOTO")/python3
[ -x "$MOTO" ] || { echo "moto_server not found (scripts/install-deps.sh)" >&2; exit 1; }
WORK=$(mktemp -d /var/tmp/fv-backupbench-XXXXXX)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$MOTO" -H 127.0.0.1 -p "$PORT" >"$WORK/moto.log" 2>&1 &
MOTO_PID=$!
trap 'kill $MOTO_PID 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$PORT/" && break; sleep 0.2; done
curl -s -X PUT "http://127.0.0.1:$PORT/bench" >/dev/null
head -c "$((MIB << 20))" /dev/urandom >"$WORK/disk.img"
cat "$WORK/disk.img" >/dev/null
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2}
# shellcheck disable=SC2086
cargo build -q $PROFILE --example backup_bench -p ferrovirt-backup
BIN=target/$([ -n "$PROFILE" ] && echo release || echo debug)/examples/backup_bench
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
"$BIN" "http://127.0.0.1:$PORT" bench "$WORK/disk.img" "$RUNS" | tee "$WORK/ours.txt"
ours=$(grep '^run=' "$WORK/ours.txt" | sed -n 's/.*mib_s=\([0-9.]*\).*/\1/p' | median)
full_s=$(grep '^run=' "$WORK/ours.txt" | sed -n 's/.*seconds=\([0-9.]*\).*/\1/p' | median)
rest=$(grep '^restore' "$WORK/ours.txt" | sed -n 's/.*mib_s=\([0-9.]*\).*/\1/p' | median)
inc_s=$(grep '^incremental' "$WORK/ours.txt" | sed -n 's/.*seconds=\([0-9.]*\).*/\1/p' | median)
"$PY" - "$PORT" "$WORK/disk.img" "$RUNS" "$MIB" <<'PYEOF' | tee "$WORK/base.txt"
import sys, time, boto3
port, path, runs, mib = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                  aws_access_key_id="testing", aws_secret_access_key="testing")
for r in range(runs):
    t0 = time.monotonic()
    s3.upload_file(path, "bench", f"baseline/{r}/disk.img")
    secs = time.monotonic() - t0
    print(f"baseline run={r} seconds={secs:.3f} mib_s={mib / secs:.1f}")
    t0 = time.monotonic()
    s3.download_file("bench", f"baseline/{r}/disk.img", path + ".downloaded")
    secs = time.monotonic() - t0
    print(f"baseline-download run={r} seconds={secs:.3f} mib_s={mib / secs:.1f}")
    t0 = time.monotonic()
    body = s3.get_object(Bucket="bench", Key=f"baseline/{r}/disk.img")["Body"]
    with open(path + ".got", "wb") as f:
        for part in body.iter_chunks(4 << 20):
            f.write(part)
    secs = time.monotonic() - t0
    print(f"baseline-get run={r} seconds={secs:.3f} mib_s={mib / secs:.1f}")
PYEOF
cmp "$WORK/disk.img" "$WORK/disk.img.got"
cmp "$WORK/disk.img" "$WORK/disk.img.downloaded"
base=$(grep '^baseline run' "$WORK/base.txt" | sed -n 's/.*mib_s=\([0-9.]*\).*/\1/p' | median)
# The download baseline: the faster (median) of boto3's download_file and one streamed GET.
base_dl=$( (grep '^baseline-download' "$WORK/base.txt" | sed -n 's/.*mib_s=\([0-9.]*\).*/\1/p' | median
  grep '^baseline-get' "$WORK/base.txt" | sed -n 's/.*mib_s=\([0-9.]*\).*/\1/p' | median) | sort -n | tail -1)
awk -v o="$ours" -v b="$base" -v m="$MIB" 'BEGIN {
  printf "full backup %s MiB: ours %.1f MiB/s, plain S3 upload (boto3) %.1f MiB/s, ratio %.2f (goal >= 0.8)\n", m, o, b, o / b }'
awk -v f="$full_s" -v i="$inc_s" -v m="$MIB" 'BEGIN {
  printf "incremental backup (5%% of %s MiB rewritten, whole chunks: changed_pct above): %.3f s vs full %.3f s (%.1f%% of the full time)\n", m, i, f, 100 * i / f }'
awk -v o="$rest" -v b="$base_dl" -v m="$MIB" 'BEGIN {
  printf "restore of the full backup %s MiB into a file: ours %.1f MiB/s, plain S3 download (boto3, faster of download_file and a streamed GET) %.1f MiB/s, ratio %.2f (goal >= 0.8)\n", m, o, b, o / b }'
