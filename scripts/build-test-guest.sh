#!/usr/bin/env bash
# Builds ferrovirt's tiny test guest from Debian packages only (no downloaded images):
#   - kernel from linux-image-cloud-amd64 (apt-get download + dpkg-deb -x)
#   - initramfs: busybox-static, the kernel modules it needs (+ modules.dep from depmod),
#     qemu-guest-agent and dropbear with their libraries, and the init scripts written below
#   - disk.raw: a bootable FAT "superfloppy" (mkfs.vfat + mcopy, boot sector by syslinux),
#     disk.qcow2: the same disk as qcow2, vmlinuz + initrd.img for direct kernel boot.
# Output goes to $FERROVIRT_TEST_GUEST_DIR (default: <repo>/target/test-guest). The build is
# cached: it reruns only when this script changes (its hash is kept in the output's STAMP file).
#
# What the guest does at boot (see the init scripts below):
#   prints "FERROVIRT-BOOT serial=<smbios serial> uuid=<smbios uuid>" on the console, mounts
#   proc/sys/dev, loads virtio/vfat/iso9660/ACPI modules, brings eth0 up with udhcpc, takes its
#   hostname from NoCloud (label cidata) or ConfigDrive (label config-2) meta-data, runs user-data
#   when it is a shell script, serves HTTP on port 80 (hostname and uptime) and SSH on port 22
#   (dropbear; root with /root/.ssh/authorized_keys), starts the QEMU guest
#   agent when its virtio-serial port exists (its fsfreeze hook prints "FERROVIRT-FSFREEZE
#   freeze|thaw <unix time>" on the console), gives a shell on ttyS0 and powers off on the ACPI
#   power button. It prints "FERROVIRT-READY" once all of that is up.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${FERROVIRT_TEST_GUEST_DIR:-$ROOT/target/test-guest}
SELF="$ROOT/scripts/build-test-guest.sh"
STAMP_WANT=$(sha256sum "$SELF" | cut -d' ' -f1)

if [ -f "$OUT/STAMP" ] && [ "$(cat "$OUT/STAMP")" = "$STAMP_WANT" ] && [ "${1:-}" != "--force" ]; then
  exit 0
fi

for tool in dpkg-deb mkfs.vfat mcopy syslinux cpio depmod qemu-img gzip qemu-ga; do
  command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || [ -x "/sbin/$tool" ] || {
    echo "build-test-guest: missing $tool; run scripts/install-deps.sh first" >&2
    exit 1
  }
done

mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9
# Another process may have finished the build while we waited for the lock.
if [ -f "$OUT/STAMP" ] && [ "$(cat "$OUT/STAMP")" = "$STAMP_WANT" ] && [ "${1:-}" != "--force" ]; then
  exit 0
fi
rm -f "$OUT/STAMP"
echo "build-test-guest: building into $OUT" >&2

WORK="$OUT/work"
DEBS="$OUT/debs"
rm -rf "$WORK"
mkdir -p "$WORK" "$DEBS"

# ---------------------------------------------------------------------------------------------
# 1. Debian packages: the cloud kernel and busybox-static.
download() { # package -> path of its .deb in $DEBS
  local pkg=$1 deb
  deb=$(ls "$DEBS"/"${pkg}"_*.deb 2>/dev/null | head -1 || true)
  if [ -z "$deb" ]; then
    (cd "$DEBS" && { apt-get download "$pkg" >/dev/null 2>&1 || { apt-get update -qq && apt-get download "$pkg" >/dev/null; }; })
    deb=$(ls "$DEBS"/"${pkg}"_*.deb | head -1)
  fi
  echo "$deb"
}
kpkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
if [ -z "$kpkg" ]; then
  apt-get update -qq
  kpkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
fi
KDEB=$(download "$kpkg")
BBDEB=$(download busybox-static)
mkdir -p "$WORK/kernel" "$WORK/busybox"
dpkg-deb -x "$KDEB" "$WORK/kernel"
dpkg-deb -x "$BBDEB" "$WORK/busybox"
KVER=$(ls "$WORK/kernel/lib/modules" | head -1)
cp "$WORK/kernel/boot/vmlinuz-$KVER" "$WORK/vmlinuz"

# ---------------------------------------------------------------------------------------------
# 2. The initramfs tree.
R="$WORK/root"
mkdir -p "$R"/{bin,sbin,etc,proc,sys,dev,tmp,run,var/run,var/log,mnt,root,www/cgi-bin,lib/modules,usr/bin,usr/sbin,etc/acpi/PWRF}
cp "$WORK/busybox/bin/busybox" "$R/bin/busybox"
for applet in $("$R/bin/busybox" --list); do
  [ -e "$R/bin/$applet" ] || ln -s busybox "$R/bin/$applet"
done

# Kernel modules with their dependencies.
MODULES="virtio_pci virtio_blk virtio_net virtio_console virtio_rng virtio_scsi virtio_balloon
  sd_mod sr_mod ahci vfat nls_cp437 nls_iso8859_1 nls_ascii iso9660 button evdev af_packet"
KMODS="$WORK/kernel/lib/modules/$KVER"
depmod -b "$WORK/kernel" "$KVER"
: >"$WORK/modlist"
for m in $MODULES; do
  modprobe -d "$WORK/kernel" -S "$KVER" --show-depends "$m" 2>/dev/null |
    awk '$1 == "insmod" {print $2}' >>"$WORK/modlist" || true
done
mkdir -p "$R/lib/modules/$KVER"
sort -u "$WORK/modlist" | while read -r ko; do
  rel=${ko#"$WORK/kernel/lib/modules/$KVER/"}
  mkdir -p "$R/lib/modules/$KVER/$(dirname "$rel")"
  cp "$ko" "$R/lib/modules/$KVER/$rel"
done
cp "$KMODS"/modules.order "$KMODS"/modules.builtin* "$R/lib/modules/$KVER/" 2>/dev/null || true
depmod -b "$R" "$KVER"
echo "$MODULES" | tr -s ' \n' '\n\n' | sed '/^$/d' >"$R/etc/modules"

# The QEMU guest agent and the shared libraries it links.
QGA=$(command -v qemu-ga || echo /usr/sbin/qemu-ga)
cp "$QGA" "$R/usr/bin/qemu-ga"
ldd "$QGA" | awk '/=>/ {print $3} /^\s*\/lib/ {print $1}' | while read -r lib; do
  [ -n "$lib" ] && [ -e "$lib" ] || continue
  mkdir -p "$R$(dirname "$lib")"
  cp -L "$lib" "$R$lib"
done
mkdir -p "$R/lib64"
cp -L /lib64/ld-linux-x86-64.so.2 "$R/lib64/"

# An SSH server (dropbear, from its Debian packages; its two libraries are not on the host, so
# they come from their packages too). Keys are made on first use (-R); root logs in with the
# keys in /root/.ssh/authorized_keys (written by user-data in tests).
DB="$WORK/dropbear"
mkdir -p "$DB"
for pkg in dropbear-bin libtomcrypt1 libtommath1; do dpkg-deb -x "$(download "$pkg")" "$DB"; done
cp "$DB/usr/sbin/dropbear" "$R/usr/sbin/dropbear"
LD_LIBRARY_PATH="$DB/usr/lib/x86_64-linux-gnu" ldd "$DB/usr/sbin/dropbear" |
  awk '/=>/ {print $3}' | while read -r lib; do
  [ -n "$lib" ] && [ -e "$lib" ] || continue
  dest=${lib#"$DB"}
  mkdir -p "$R$(dirname "$dest")"
  cp -L "$lib" "$R$dest"
done
mkdir -p "$R/etc/dropbear" "$R/root/.ssh"
chmod 700 "$R/root/.ssh"
echo /bin/sh >"$R/etc/shells"

cat >"$R/etc/os-release" <<'EOF'
NAME="ferrovirt test guest"
ID=ferrovirt-testguest
VERSION_ID="1"
PRETTY_NAME="ferrovirt test guest 1"
EOF
echo "root:x:0:0:root:/root:/bin/sh" >"$R/etc/passwd"
echo "root:x:0:" >"$R/etc/group"
echo "ferrovirt-guest" >"$R/etc/hostname"

# qemu-ga runs /sbin/shutdown for guest-shutdown (soft reboot, power off).
cat >"$R/sbin/shutdown" <<'EOF'
#!/bin/sh
# Minimal shutdown(8) for qemu-ga: -r reboots, -H halts, anything else powers off.
case " $* " in
  *" -r "*) exec reboot ;;
  *" -H "*) exec halt ;;
  *) exec poweroff ;;
esac
EOF
chmod +x "$R/sbin/shutdown"

# qemu-ga's fsfreeze hook: runs before a guest-fsfreeze-freeze and after the thaw; it prints
# the event and the guest's clock (Unix seconds with microseconds, from adjtimex: busybox date
# has no sub-second format) on the console so tests see that and when the guest was quiesced
# (online snapshots, group freezes). Tests can make a freeze slow (/run/fsfreeze-slow holds
# seconds) or fail (/run/fsfreeze-fail).
mkdir -p "$R/etc/qemu-ga"
cat >"$R/etc/qemu-ga/fsfreeze-hook" <<'EOF'
#!/bin/sh
t=$(adjtimex | awk '/tv_sec/ {s = $2} /tv_usec/ {u = $2} END {printf "%d.%06d", s, u}')
echo "FERROVIRT-FSFREEZE $1 $t" >/dev/console
if [ "$1" = freeze ]; then
  [ -e /run/fsfreeze-slow ] && sleep "$(cat /run/fsfreeze-slow)"
  [ -e /run/fsfreeze-fail ] && exit 1
fi
exit 0
EOF
chmod +x "$R/etc/qemu-ga/fsfreeze-hook"

cat >"$R/etc/inittab" <<'EOF'
::sysinit:/etc/rc.boot
ttyS0::respawn:-/bin/sh
::ctrlaltdel:/bin/poweroff
::shutdown:/etc/rc.shutdown
EOF

cat >"$R/init" <<'EOF'
#!/bin/sh
# PID 1: mount the basics, then hand over to busybox init (inittab runs /etc/rc.boot).
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /run
exec /bin/init
EOF
chmod +x "$R/init"

cat >"$R/etc/rc.boot" <<'EOF'
#!/bin/sh
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
say() { echo "$@" >/dev/console; }
serial=$(cat /sys/class/dmi/id/product_serial 2>/dev/null)
uuid=$(cat /sys/class/dmi/id/product_uuid 2>/dev/null)
say "FERROVIRT-BOOT serial=$serial uuid=$uuid"
for m in $(cat /etc/modules); do modprobe "$m" 2>/dev/null; done
hostname -F /etc/hostname

# Power button -> clean poweroff (busybox acpid only acts when run in the foreground).
setsid acpid -f -c /etc/acpi </dev/null >/dev/null 2>&1 &

# Name virtio-serial ports as udev would (/dev/virtio-ports/NAME), start the guest agent.
mkdir -p /dev/virtio-ports
for p in /sys/class/virtio-ports/*; do
  [ -e "$p/name" ] || continue
  ln -sf "../$(basename "$p")" "/dev/virtio-ports/$(cat "$p/name")"
done
if [ -e /dev/virtio-ports/org.qemu.guest_agent.0 ]; then
  qemu-ga -d -m virtio-serial -p /dev/virtio-ports/org.qemu.guest_agent.0 -f /run/qemu-ga.pid \
    --fsfreeze-hook=/etc/qemu-ga/fsfreeze-hook
  say "FERROVIRT-QGA started"
fi

# Network: DHCP on eth0 (in the background so boot goes on without a DHCP server).
ip link set lo up
if [ -e /sys/class/net/eth0 ]; then
  ip link set eth0 up
  udhcpc -i eth0 -s /etc/udhcpc.script -b -t 10 -T 1 -q >/dev/null 2>&1 &
fi

# NoCloud (label cidata) or ConfigDrive (label config-2) data source. Wait for the virtio
# devices to be bound first (no udev here), then look the labels up with findfs.
i=0
while [ $i -lt 30 ]; do
  pending=0
  for d in /sys/bus/virtio/devices/*; do [ -e "$d/driver" ] || pending=1; done
  [ $pending = 0 ] && break
  sleep 0.1; i=$((i + 1))
done
ds=""
dsdev=""
for try in 1 2 3 4 5; do
  for label in cidata CIDATA config-2 CONFIG-2; do
    dsdev=$(findfs "LABEL=$label" 2>/dev/null) || dsdev=""
    [ -n "$dsdev" ] || continue
    case "$label" in cidata|CIDATA) ds=nocloud ;; *) ds=configdrive ;; esac
    break 2
  done
  sleep 0.2
done
if [ -n "$ds" ]; then
  mkdir -p /mnt/ds
  mount -o ro "$dsdev" /mnt/ds 2>/dev/null || mount -t iso9660 -o ro "$dsdev" /mnt/ds 2>/dev/null ||
    mount -t vfat -o ro "$dsdev" /mnt/ds 2>/dev/null || { say "FERROVIRT-DATASOURCE-ERROR cannot mount $dsdev"; ds=""; }
fi
userdata=""
if [ "$ds" = nocloud ]; then
  h=$(sed -n 's/^\(local-hostname\|hostname\):[[:space:]]*//p' /mnt/ds/meta-data 2>/dev/null | head -1 | tr -d "\"'\r")
  [ -n "$h" ] && hostname "$h"
  userdata=/mnt/ds/user-data
elif [ "$ds" = configdrive ]; then
  h=$(sed -n 's/.*"hostname"[[:space:]]*:[[:space:]]*"\([^"]*\)".*/\1/p' /mnt/ds/openstack/latest/meta_data.json 2>/dev/null | head -1)
  [ -n "$h" ] && hostname "$h"
  userdata=/mnt/ds/openstack/latest/user_data
fi
[ -n "$ds" ] && say "FERROVIRT-DATASOURCE $ds hostname=$(hostname)"
if [ -n "$userdata" ] && [ -f "$userdata" ] && head -c 2 "$userdata" | grep -q '^#!'; then
  cp "$userdata" /run/user-data
  chmod +x /run/user-data
  /run/user-data >/dev/console 2>&1
  say "FERROVIRT-USERDATA rc=$?"
fi

# HTTP on port 80: "/" answers hostname and uptime; SSH on port 22.
httpd -p 80 -h /www
dropbear -R -p 22 2>/dev/null && say "FERROVIRT-SSHD started"
say "FERROVIRT-READY hostname=$(hostname)"
EOF
chmod +x "$R/etc/rc.boot"

cat >"$R/etc/rc.shutdown" <<'EOF'
#!/bin/sh
echo "FERROVIRT-SHUTDOWN" >/dev/console
[ -f /run/qemu-ga.pid ] && kill "$(cat /run/qemu-ga.pid)" 2>/dev/null
sync
EOF
chmod +x "$R/etc/rc.shutdown"

cat >"$R/etc/acpi/PWRF/00000080" <<'EOF'
#!/bin/sh
echo "FERROVIRT-POWERBUTTON" >/dev/console
poweroff
EOF
chmod +x "$R/etc/acpi/PWRF/00000080"

cat >"$R/etc/udhcpc.script" <<'EOF'
#!/bin/sh
# udhcpc hook: apply the lease and report it on the console.
case "$1" in
  deconfig) ip addr flush dev "$interface"; ip link set "$interface" up ;;
  bound|renew)
    ip addr flush dev "$interface"
    ip addr add "$ip/${mask:-24}" dev "$interface"
    if [ -n "$router" ]; then
      for r in $router; do ip route add default via "$r" dev "$interface" && break; done
    fi
    # Classless static routes (option 121), exported by udhcpc as "net/len gw net/len gw ...".
    set -- $staticroutes
    while [ $# -ge 2 ]; do
      if [ "$2" = 0.0.0.0 ]; then
        ip route replace "$1" dev "$interface"
      else
        ip route replace "$1" via "$2" dev "$interface"
      fi
      shift 2
    done
    : >/etc/resolv.conf
    for d in $dns; do echo "nameserver $d" >>/etc/resolv.conf; done
    echo "FERROVIRT-DHCP $interface ip=$ip/${mask:-24} router=$router" >/dev/console
    ;;
esac
exit 0
EOF
chmod +x "$R/etc/udhcpc.script"

cat >"$R/www/cgi-bin/index.cgi" <<'EOF'
#!/bin/sh
printf 'Content-Type: text/plain\r\n\r\n'
echo "hostname=$(hostname)"
echo "uptime=$(cut -d' ' -f1 /proc/uptime)"
EOF
chmod +x "$R/www/cgi-bin/index.cgi"

(cd "$R" && find . -print0 | cpio --null -o -H newc --quiet | gzip -6) >"$WORK/initrd.img"

# ---------------------------------------------------------------------------------------------
# 3. The bootable FAT superfloppy, its qcow2 copy, and the kernel-boot pair.
CMDLINE="console=ttyS0 quiet panic=-1"
cat >"$WORK/syslinux.cfg" <<EOF
DEFAULT linux
PROMPT 0
TIMEOUT 0
LABEL linux
  KERNEL vmlinuz
  INITRD initrd.img
  APPEND $CMDLINE
EOF
size_kb=$(( ( $(stat -c %s "$WORK/vmlinuz") + $(stat -c %s "$WORK/initrd.img") ) / 1024 + 8192 ))
rm -f "$WORK/disk.raw"
truncate -s "$(( (size_kb / 1024 + 1) ))M" "$WORK/disk.raw"
mkfs.vfat -n FVGUEST "$WORK/disk.raw" >/dev/null
mcopy -i "$WORK/disk.raw" "$WORK/vmlinuz" "$WORK/initrd.img" "$WORK/syslinux.cfg" ::/
syslinux --install "$WORK/disk.raw"
qemu-img convert -f raw -O qcow2 "$WORK/disk.raw" "$WORK/disk.qcow2"

for f in vmlinuz initrd.img disk.raw disk.qcow2; do mv "$WORK/$f" "$OUT/$f"; done
echo "$CMDLINE" >"$OUT/cmdline"
echo "$KVER" >"$OUT/kernel-version"
rm -rf "$WORK"
echo "$STAMP_WANT" >"$OUT/STAMP"
echo "build-test-guest: done ($(du -sh "$OUT" | cut -f1)): $OUT" >&2
