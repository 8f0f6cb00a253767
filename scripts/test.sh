#!/usr/bin/env bash
# Installs what is missing and runs ferrovirt's whole test suite: formatting, clippy, then unit,
# integration and end-to-end tests (real QEMU guests under TCG, real etcd, real kubectl).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/install-deps.sh
if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo is missing: install a Rust toolchain (rustup, Rust >= 1.95) first" >&2
  exit 1
fi
./scripts/build-test-guest.sh

# CI builds once on a clean clone: incremental caches would only take disk (tens of GiB over
# the suite's 100-odd test binaries; a CI run on a nearly full disk failed to link, bus error).
if [ "${CI:-}" = true ]; then
  export CARGO_INCREMENTAL=0
fi
echo "== disk: $(df -h --output=avail . | tail -1 | tr -d ' ') free where the build runs"

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo test (scripts/run-tests.py: the binaries of \`cargo test --workspace\`, two at a time)"
python3 scripts/run-tests.py
echo "== cargo test --doc"
cargo test --workspace --locked --doc
