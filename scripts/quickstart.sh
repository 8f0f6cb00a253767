#!/usr/bin/env bash
# ferrovirt quick start: installs what is missing, builds in release mode, builds the tiny test
# guest from Debian packages, starts `ferrovirt server` (API server, controllers and a node agent)
# with the embedded SQLite store in .ferrovirt/server, creates the demo VirtualMachine from
# examples/demo-vm.yaml, waits until it runs, and prints how to reach it and stop everything.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
STATE="$ROOT/.ferrovirt"
DATA="$STATE/server"
LISTEN=${FERROVIRT_LISTEN:-127.0.0.1:6443}

./scripts/install-deps.sh
if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo is missing: install a Rust toolchain (rustup, Rust >= 1.95) first" >&2
  exit 1
fi
echo "== building ferrovirt (release)"
cargo build --release --locked -p ferrovirt
echo "== building the test guest"
./scripts/build-test-guest.sh
FV="$ROOT/target/release/ferrovirt"
KC="$DATA/kubeconfig.yaml"
fv() { "$FV" --kubeconfig "$KC" "$@"; }

mkdir -p "$STATE"
if [ -f "$STATE/server.pid" ] && kill -0 "$(cat "$STATE/server.pid")" 2>/dev/null; then
  echo "== ferrovirt server already running (pid $(cat "$STATE/server.pid"))"
else
  echo "== starting ferrovirt server on $LISTEN (data in $DATA, log in $STATE/server.log)"
  nohup "$FV" server --data-dir "$DATA" --listen "$LISTEN" >"$STATE/server.log" 2>&1 &
  echo $! >"$STATE/server.pid"
  for _ in $(seq 1 150); do
    if [ -f "$KC" ] && fv get namespace default >/dev/null 2>&1; then break; fi
    if ! kill -0 "$(cat "$STATE/server.pid")" 2>/dev/null; then
      echo "the server exited; its log:" >&2; tail -20 "$STATE/server.log" >&2; exit 1
    fi
    sleep 0.2
  done
fi

VOL="$STATE/volumes/demo-root"
if [ ! -f "$VOL/disk.img" ]; then
  mkdir -p "$VOL"
  qemu-img convert -f qcow2 -O raw target/test-guest/disk.qcow2 "$VOL/disk.img"
fi
KEY="$STATE/demo-ssh-key"
[ -f "$KEY" ] || ssh-keygen -q -t ed25519 -N '' -C ferrovirt-demo -f "$KEY"
echo "== creating the demo VirtualMachine"
sed -e "s|@VOLUME_DIR@|$VOL|" -e "s|@SSH_PUBLIC_KEY@|$(cat "$KEY.pub")|" examples/demo-vm.yaml | fv apply -f -
echo "== waiting for it to run"
fv wait vm/demo --for=condition=Ready --timeout=300s
fv get vm demo
fv get vmi demo
cat <<TXT

The demo VM runs. Try (kubectl works too: export KUBECONFIG=$KC):
  $FV --kubeconfig $KC get vmi -o wide
  $FV --kubeconfig $KC console demo           (serial console; Ctrl+] leaves)
  $FV --kubeconfig $KC describe vm demo
  $FV --kubeconfig $KC port-forward vm/demo 8080:80   (then: curl http://127.0.0.1:8080/)
  $FV --kubeconfig $KC ssh root@vm/demo -i $KEY
  tail -f $DATA/agent/vmis/*/serial.log      (what the guest printed)
Stop everything (the guest powers off by ACPI; VMs outlive a server that is killed first):
  $FV --kubeconfig $KC delete vm demo
  $FV --kubeconfig $KC wait vmi/demo --for=delete --timeout=120s
  kill \$(cat $STATE/server.pid)
TXT
