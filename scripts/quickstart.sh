#!/usr/bin/env bash
# ferrovirt quick start: installs what is missing, builds in release mode, builds the tiny test
# guest from Debian packages, and boots it as a demo VM, then says how to reach and stop it.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install-deps.sh
if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo is missing: install a Rust toolchain (rustup, Rust >= 1.95) first" >&2
  exit 1
fi
echo "== building ferrovirt (release)"
cargo build --release --locked -p ferrovirt
echo "== building the test guest"
./scripts/build-test-guest.sh
FV=./target/release/ferrovirt
echo "== booting the demo VM"
$FV demo up
cat <<TXT

The demo VM is running.
  console:  $FV demo console          (type commands; Ctrl+D leaves)
            echo 'uname -a' | $FV demo console
  status:   $FV demo status
  stop:     $FV demo down             (ACPI power-off)
TXT
