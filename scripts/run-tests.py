#!/usr/bin/env python3
"""Builds the workspace's test binaries once and runs them, JOBS binaries at a time.

`cargo test` runs one test binary after another. Most of ferrovirt's end-to-end binaries hold a
single test that spends its time waiting on a guest under TCG, so one binary at a time leaves
the second core idle for most of the suite. This runner (the job of cargo-nextest, which is not
packaged for Debian and would cost CI a from-source build) starts the binaries in a pool of
JOBS workers, longest first, each with `--test-threads=1` when JOBS > 1 so that at most JOBS
tests run at once (what a two-test binary does under plain `cargo test` on two cores). Each
binary's output is printed whole when it ends, in cargo's format (`Running ...` then the
harness' own lines, `test result:` included), and a binary that outlives --timeout is killed
with its process group and counted as failed.

Usage: scripts/run-tests.py [--jobs N] [--timeout SECONDS] [-- CARGO_TEST_ARGS...]
Exit status: 0 when every binary passed, 101 otherwise (as `cargo test --no-fail-fast`).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

# Seconds each binary took in a clean-clone CI run (two test threads, one binary at a time):
# the order to start them in, longest first. A binary missing here counts as `DEFAULT_E2E` when
# it lives under crates/ferrovirt/tests and `DEFAULT_OTHER` otherwise.
HINTS = {
    "snapshots": 123, "storage": 119, "vm_lifecycle": 107, "backup": 130, "export": 82,
    "backup_incremental": 85, "backup_group_freeze": 75, "ha_servers": 60, "nncp": 50, "nncp_dhcp": 55,
    "migration": 190, "webui": 110, "vmi_lifecycle": 57, "pod_net_isolation": 53, "fencing": 48,
    "guest_isolation": 46, "node_storage": 44, "registry": 40, "hostile_images": 40,
    "multi_node": 39, "vm_pool": 37, "subresources": 35, "fuzz": 33, "guest_boot": 33,
    "network_overlay": 32, "udn_dataplane": 125, "steady_state_requests": 30, "drain": 30, "fuzz_requests": 27,
    "migration_containerdisk": 26, "services": 25, "migration_network": 24, "kubectl": 22,
    "online_resize": 22, "upload": 21, "pod_network": 21, "user_net_isolation": 20,
    "network_secondary": 20, "cli": 18, "online_snapshot": 17, "migration_tls": 31,
    "block_migration_tls": 2,
    "access_control": 17, "node_credentials": 70, "sa_token_volume": 35, "migration_quota": 40,
    "crd": 16, "shared_mount": 15, "hostile": 15, "conformance": 15, "metrics": 14,
    "empty_cdrom": 14, "port_forward": 13, "hyperconverged": 35, "node_proxy": 17,
    "cpu_models": 30, "localnet": 35, "udn_secondary": 120, "udn_layer3": 50, "udn_services": 60,
    "migration_postcopy": 250, "snapshot_reclaim_online": 45, "online_reclaim": 11,
    "migration_block_restart": 45, "migration_chain": 80,
}
DEFAULT_E2E = 30
DEFAULT_OTHER = 5


def build(cargo_args):
    """Builds the test binaries; returns [(name, source, executable, package_dir)]."""
    cmd = ["cargo", "test", "--workspace", "--locked", "--no-run",
           "--message-format=json-render-diagnostics", *cargo_args]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.exit(proc.returncode)
    out = []
    for line in proc.stdout.splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("reason") != "compiler-artifact" or not m.get("executable"):
            continue
        if not m.get("profile", {}).get("test"):
            continue
        t = m["target"]
        pkg_dir = os.path.dirname(m["manifest_path"])
        src = os.path.relpath(t["src_path"], pkg_dir)
        out.append((t["name"], src, m["executable"], pkg_dir, m["package_id"]))
    return out


def estimate(name, src, pkg_dir):
    if name in HINTS:
        return HINTS[name]
    if src.startswith("tests") and pkg_dir.endswith(os.path.join("crates", "ferrovirt")):
        return DEFAULT_E2E
    return DEFAULT_OTHER


def package_env(pkg_dir, package_id):
    """What cargo sets at run time for a test binary (see cargo's environment-variables doc)."""
    env = dict(os.environ)
    env["CARGO_MANIFEST_DIR"] = pkg_dir
    env.setdefault("CARGO", "cargo")
    # package_id: "path+file:///dir#name@version" or "path+file:///dir#version"
    frag = package_id.rsplit("#", 1)[-1]
    name = frag.split("@")[0] if "@" in frag else os.path.basename(pkg_dir)
    env["CARGO_PKG_NAME"] = name
    return env


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("FERROVIRT_TEST_JOBS", "2")))
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("cargo_args", nargs="*")
    args = ap.parse_args()

    bins = build(args.cargo_args)
    bins.sort(key=lambda b: -estimate(b[0], b[1], b[3]))
    threads = ["--test-threads=1"] if args.jobs > 1 else []
    print(f"== running {len(bins)} test binaries, {args.jobs} at a time", flush=True)

    lock = threading.Lock()
    queue = list(bins)
    results = []  # (name, src, rc, seconds)
    started = time.monotonic()

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                name, src, exe, pkg_dir, pkg_id = queue.pop(0)
            t0 = time.monotonic()
            proc = subprocess.Popen(
                [exe, *threads], cwd=pkg_dir, env=package_env(pkg_dir, pkg_id),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                out, _ = proc.communicate(timeout=args.timeout)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                out += f"\n!! killed after {args.timeout} s\n".encode()
                rc = -9
            # Whatever the binary left behind in its group (servers, agents, QEMU) goes too.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            secs = time.monotonic() - t0
            rel = os.path.relpath(exe)
            with lock:
                sys.stdout.write(f"     Running {src} ({rel}) [{secs:.1f} s]\n")
                sys.stdout.write(out.decode(errors="replace"))
                sys.stdout.flush()
                results.append((name, src, rc, secs))

    workers = [threading.Thread(target=worker) for _ in range(max(1, args.jobs))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()

    failed = [r for r in results if r[2] != 0]
    wall = time.monotonic() - started
    busy = sum(r[3] for r in results)
    print(f"== {len(results)} test binaries in {wall:.0f} s (sum of binaries {busy:.0f} s)")
    for name, src, rc, secs in sorted(results, key=lambda r: -r[3])[:10]:
        print(f"   {secs:7.1f} s  {name} ({src})")
    if failed:
        print("== FAILED:", ", ".join(f"{n} ({s}, rc {rc})" for n, s, rc, _ in failed))
        sys.exit(101)


if __name__ == "__main__":
    main()
