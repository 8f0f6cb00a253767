#!/usr/bin/env bash
# Installs the Debian packages ferrovirt needs to build, run and test, if they are missing.
# Idempotent: does nothing (and never calls apt) when everything is already present.
# Usage: scripts/install-deps.sh            # everything (build, run, test)
set -euo pipefail

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

# command-or-file -> package
declare -A NEED=(
  [qemu-system-x86_64]=qemu-system-x86
  [qemu-img]=qemu-utils
  [busybox]=busybox-static
  [syslinux]=syslinux
  [/usr/lib/syslinux/modules/bios/ldlinux.c32]=syslinux-common
  [mcopy]=mtools
  [mkfs.vfat]=dosfstools
  [cpio]=cpio
  [depmod]=kmod
  [qemu-ga]=qemu-guest-agent
  [protoc]=protobuf-compiler
  [/usr/include/google/protobuf/timestamp.proto]=libprotobuf-dev
  [etcd]=etcd-server
  [xz]=xz-utils
  [zstd]=zstd
  [genisoimage]=genisoimage
  [curl]=curl
  [cc]=gcc
  [pkg-config]=pkg-config
  [ip]=iproute2
  [kubectl]=kubernetes-client
  [flock]=util-linux
  [nft]=nftables
  [nsenter]=util-linux
  [losetup]=mount
  [blkdiscard]=util-linux
  [prlimit]=util-linux
  [docker-registry]=docker-registry
  [htpasswd]=apache2-utils
  [ssh]=openssh-client
  [ssh-keygen]=openssh-client
  [python3]=python3
  [prometheus]=prometheus
  # The web console (ui/): bundled by npm + esbuild at build time (crates/webui's build.rs),
  # tested in headless Chromium through chromedriver (crates/ferrovirt/tests/webui.rs).
  [node]=nodejs
  [npm]=npm
  [chromium]=chromium
  [chromedriver]=chromium-driver
  # ... and in headless Firefox through geckodriver (below: not packaged in Debian).
  [firefox-esr]=firefox-esr
)

# A real S3-protocol server for the backup tests (PyPI moto[server]; Debian's pip refuses
# system-wide installs, so it lives in its own virtual environment). Tests look for
# $FERROVIRT_MOTO_SERVER, then /opt/ferrovirt-moto/bin/moto_server, then moto_server on PATH.
MOTO_VENV=/opt/ferrovirt-moto
install_moto() {
  [ -x "$MOTO_VENV/bin/moto_server" ] && return 0
  if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
  fi
  echo "install-deps: installing moto[server] into $MOTO_VENV" >&2
  $SUDO python3 -m venv "$MOTO_VENV"
  $SUDO "$MOTO_VENV/bin/pip" install -q 'moto[server]>=5,<6' >&2
}

# geckodriver, Firefox's WebDriver server, is not packaged in Debian: it comes from crates.io
# (built from source, a few minutes on 2 cores) into cargo's bin directory, where the webui e2e
# test also looks for it. Skipped when one is on PATH or already there.
GECKODRIVER_VERSION=0.37.1
install_geckodriver() {
  command -v geckodriver >/dev/null 2>&1 && return 0
  [ -x "${CARGO_HOME:-$HOME/.cargo}/bin/geckodriver" ] && return 0
  if ! command -v cargo >/dev/null 2>&1; then
    echo "install-deps: cargo is missing, so geckodriver is not installed (the webui e2e's Firefox run needs it)" >&2
    return 0
  fi
  echo "install-deps: cargo install --locked geckodriver@$GECKODRIVER_VERSION" >&2
  cargo install --locked --quiet "geckodriver@$GECKODRIVER_VERSION" >&2
}

missing=()
for what in "${!NEED[@]}"; do
  if [[ "$what" == /* ]]; then
    [ -e "$what" ] || missing+=("${NEED[$what]}")
  else
    command -v "$what" >/dev/null 2>&1 || [ -x "/usr/sbin/$what" ] || [ -x "/sbin/$what" ] || missing+=("${NEED[$what]}")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  install_moto
  install_geckodriver
  exit 0
fi

echo "install-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
pkgs=()
qemu_pinned=0
for p in "${missing[@]}"; do
  case "$p" in
    qemu-system-x86|qemu-utils) qemu_pinned=1 ;;
    *) pkgs+=("$p") ;;
  esac
done
if [ "$qemu_pinned" = 1 ]; then
  # Some images ship a newer qemu-utils from backports that "Breaks" the distribution's
  # qemu-system-common; install the matching set at the distribution's candidate version.
  v=$(apt-cache policy qemu-system-x86 | awk '/Candidate:/ {print $2}')
  pkgs+=("qemu-system-x86=$v" "qemu-system-common=$v" "qemu-utils=$v" "qemu-block-extra=$v")
fi
$SUDO apt-get install -y -qq --no-install-recommends --allow-downgrades "${pkgs[@]}" >/dev/null
echo "install-deps: done" >&2
install_moto
install_geckodriver
