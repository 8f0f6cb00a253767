#!/usr/bin/env bash
# Builds ferrovirt's web console into ui/dist/ (index.html, app.js, app.css, licences):
# installs the locked npm packages (package-lock.json) when node_modules is missing or older than
# the lockfile, then bundles src/ with esbuild. Every asset is self-hosted; nothing is fetched at
# run time. crates/webui's build.rs runs this when dist/ is missing or stale and embeds the result.
set -euo pipefail
cd "$(dirname "$0")"

for tool in node npm; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "ui/build.sh: '$tool' is missing: install Node.js and npm (scripts/install-deps.sh installs Debian's nodejs and npm)" >&2
    exit 127
  fi
done

if [ ! -f node_modules/.package-lock.json ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  echo "ui/build.sh: npm ci (packages from package-lock.json)" >&2
  npm ci --no-audit --no-fund --loglevel=error >&2
fi

# One build at a time (cargo build and clippy may run the crate's build script together).
if command -v flock >/dev/null 2>&1; then
  exec 9>.build.lock
  flock 9
fi
out="dist.tmp.$$"
rm -rf "$out"
mkdir "$out"
trap 'rm -rf "$out"' EXIT
./node_modules/.bin/esbuild src/main.js \
  --bundle --format=esm --target=es2022 --minify \
  --legal-comments=external --log-level=warning \
  --outfile="$out/app.js"
cp src/index.html "$out/index.html"
rm -rf dist
mv "$out" dist
trap - EXIT
echo "ui/build.sh: wrote $(pwd)/dist" >&2
