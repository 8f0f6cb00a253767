#!/usr/bin/env bash
# RBAC benchmark (issue #19): the API's create rate for a ServiceAccount authorized by RBAC,
# with 50 bindings present (25 RoleBindings and 24 ClusterRoleBindings of other subjects, and
# the RoleBinding of `edit` that lets the account create), against the admin identity in the
# same run, on one `ferrovirt server --disable-agent` (SQLite) on loopback. Each run creates
# N ConfigMaps with C keep-alive HTTPS connections (Python's http.client, one per thread);
# the identities alternate run by run. Prints each run and the medians' ratio (goal >= 0.9).
# Usage: bench/rbac.sh [--n 1000] [--concurrency 8] [--runs 3] [--binary target/release/ferrovirt]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
N=1000 CONC=8 RUNS=3 BIN=""
while [ $# -gt 0 ]; do
  case "$1" in
    --n) N=$2; shift 2 ;;
    --concurrency) CONC=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --binary) BIN=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -z "$BIN" ]; then
  cargo build --release -q --locked -p ferrovirt --bin ferrovirt
  BIN=$ROOT/target/release/ferrovirt
fi
WORK=$(mktemp -d /var/tmp/fv-rbac-bench.XXXXXX)
SERVER_PID=""
trap '[ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null; wait 2>/dev/null; rm -rf "$WORK"' EXIT
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
RUST_LOG=warn "$BIN" server --data-dir "$WORK/server" --listen "127.0.0.1:$PORT" --disable-agent \
  >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
KC="$WORK/server/kubeconfig.yaml"
for _ in $(seq 300); do
  [ -f "$KC" ] && kubectl --kubeconfig "$KC" get --raw /readyz >/dev/null 2>&1 && break
  sleep 0.2
done
k() { kubectl --kubeconfig "$KC" "$@"; }
k create namespace bench >/dev/null
k create serviceaccount writer -n bench >/dev/null
{
  for i in $(seq 1 25); do
    printf 'apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {name: other-%s, namespace: bench}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: view}\nsubjects: [{kind: User, apiGroup: rbac.authorization.k8s.io, name: user-%s}]\n---\n' "$i" "$i"
  done
  for i in $(seq 1 24); do
    printf 'apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {name: bench-other-%s}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: view}\nsubjects: [{kind: Group, apiGroup: rbac.authorization.k8s.io, name: group-%s}]\n---\n' "$i" "$i"
  done
  printf 'apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {name: writer-edit, namespace: bench}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: edit}\nsubjects: [{kind: ServiceAccount, name: writer, namespace: bench}]\n'
} | k apply -f - >/dev/null
SA_TOKEN=$(k create token writer -n bench --duration 1h)
ADMIN_TOKEN=$(k config view --raw -o jsonpath='{.users[0].user.token}')
k config view --raw -o jsonpath='{.clusters[0].cluster.certificate-authority-data}' | base64 -d >"$WORK/ca.crt"
[ -n "$ADMIN_TOKEN" ] || { echo "the admin kubeconfig has no bearer token" >&2; exit 1; }
# The account really is refused what its binding does not give (a check that RBAC is on).
code=$(curl -s -o /dev/null -w '%{http_code}' --cacert "$WORK/ca.crt" -H "Authorization: Bearer $SA_TOKEN" \
  "https://127.0.0.1:$PORT/api/v1/namespaces/default/configmaps")
[ "$code" = 403 ] || { echo "expected 403 for the account outside its namespace, got $code" >&2; exit 1; }
echo "# $(date -u +%FT%TZ) on $(nproc) cores, load average: $(cut -d' ' -f1-3 /proc/loadavg); binary $BIN"
echo "# bindings: $(k get rolebindings -A --no-headers | wc -l) RoleBindings, $(k get clusterrolebindings --no-headers | wc -l) ClusterRoleBindings"
python3 - "$PORT" "$WORK/ca.crt" "$ADMIN_TOKEN" "$SA_TOKEN" "$N" "$CONC" "$RUNS" <<'PYEOF'
import http.client, json, ssl, statistics, sys, threading, time
port, ca, admin, sa, n, conc, runs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
ctx = ssl.create_default_context(cafile=ca)
ctx.check_hostname = False

def run(token, tag):
    lock = threading.Lock()
    next_i = [0]
    errors = []
    def worker():
        conn = http.client.HTTPSConnection("127.0.0.1", int(port), context=ctx)
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= n:
                break
            body = json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                               "metadata": {"name": f"{tag}-{i}"}, "data": {"k": "v"}})
            conn.request("POST", "/api/v1/namespaces/bench/configmaps", body,
                         {"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            if r.status != 201:
                errors.append(r.status)
        conn.close()
    threads = [threading.Thread(target=worker) for _ in range(conc)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.monotonic() - t0
    if errors:
        sys.exit(f"{tag}: {len(errors)} creates failed, e.g. HTTP {errors[0]}")
    return n / secs

rates = {"admin": [], "rbac": []}
for r in range(runs):
    for who, token in (("admin", admin), ("rbac", sa)) if r % 2 == 0 else (("rbac", sa), ("admin", admin)):
        rate = run(token, f"{who}-{r}")
        rates[who].append(rate)
        print(f"run={r} identity={who} creates_per_s={rate:.1f}")
a, b = statistics.median(rates["admin"]), statistics.median(rates["rbac"])
print(f"ConfigMap creates/s, {n} per run, {conc} connections: admin {a:.1f}, ServiceAccount through RBAC "
      f"(50 bindings) {b:.1f}, ratio {b / a:.2f} (goal >= 0.9)")
PYEOF
