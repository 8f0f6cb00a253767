#!/usr/bin/env python3
"""Live migration through ferrovirt vs a raw QEMU-to-QEMU migration of the same guest.

Usage: bench/migration.py [--runs N] [--binary target/debug/ferrovirt] [--memory-mib 128] [--local]
                          [--no-tls] [--bare]

ferrovirt: a server (node1) and an agent (node2) on 127.0.0.1, one VM on a ReadWriteMany claim
holding the test guest's disk (target/test-guest), migrated back and forth N times with
VirtualMachineInstanceMigrations. For each run: QEMU's `total-time` and `downtime` (from the
source's final `query-migrate`, which the agent puts into its `Migrated` Event) and the
VMIM's create -> Succeeded wall time.
Raw: two QEMUs started by hand with ferrovirt's exact QEMU command line (the VMI's
`qemu-argv.json`, its sockets moved to a directory of the bench, its disk replaced by a copy,
no -runas), the target with `-incoming defer`, the two ends of a loopback TCP connection
passed to them (`getfd`, `migrate-incoming fd:` and `migrate fd:`, as ferrovirt does),
`query-migrate` polled every 50 ms until completed; twice per run: plain, and with QEMU's TLS
set up as ferrovirt does (a fresh self-signed P-256 leaf per side, made with openssl, each
side's `ca-cert.pem` the other's certificate, the server's `dh-params.pem` RFC 7919's
ffdhe2048, `tls-creds-x509` with `sanity-check=off`,
`tls-hostname` on the source). --bare: also a minimal QEMU (no serial, guest agent, VNC,
balloon ...), plain, to separate the device set's cost from ferrovirt's.
Prints medians and the ratios of ferrovirt against raw plain and raw TLS (goal: total <= 1.1x
raw, downtime <= raw + 50 ms).
--local: the VM's disk is a node-local (`local` class) volume of 1 GiB, block-migrated; ours is
the source agent's span from the mirrors' start to QEMU's `completed` (its Migrated Event; the
VMIM's create -> Succeeded wall time is printed beside it) and QEMU's downtime, raw is two
plain QEMUs doing the same by hand: an NBD export on the target, `blockdev-mirror` to it,
`pause-before-switchover`, the mirror completed, `migrate-continue` (wall time from the
mirror's start to `completed`, QEMU's downtime). The raw TLS run puts the NBD mirror under
QEMU's TLS too, as ferrovirt does (both from the same ephemeral certificates, made before the
timed span as ferrovirt's are; before 2026-12-05 only its memory stream was encrypted and
the certificates were made inside the span).
Both run on 2 cores shared with the rest of the machine: compare within one run only.
FV_BENCH_KEEP_LOGS=DIR keeps the server's and the agent's logs (set RUST_LOG=info for the
agents' per-step timings); FV_BENCH_TIMELINE=1 prints each raw run's steps (stderr).
The VMIM's phase is read through one `kubectl proxy` every 50 ms (until 2026-12-05 a kubectl
process every 50 ms: about a core taken from ferrovirt's QEMUs, none from the raw ones').
"""
import argparse, json, os, re, shutil, socket, statistics, subprocess, sys, tempfile, time
import urllib.error, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUEST = os.path.join(ROOT, "target", "test-guest")
TIMELINE = os.environ.get("FV_BENCH_TIMELINE")  # print the raw runs' step times (stderr)
# How often the raw runs ask QEMU (mirror ready, pre-switchover, completed): ferrovirt's agent
# looks when QEMU reports an event, so the raw side is not left 50 ms polls behind.
RAW_POLL = 0.01


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


def wait(what, timeout, check, every=0.2):
    deadline = time.time() + timeout
    while True:
        v = check()
        if v:
            return v
        if time.time() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(every)


def proxied_phase(port, name):
    """The phase of VMIM `name` in `default` read through `kubectl proxy` on `port` ("" while
    it has none or does not exist); None while the proxy does not answer."""
    url = (f"http://127.0.0.1:{port}/apis/kubevirt.io/v1/namespaces/default/"
           f"virtualmachineinstancemigrations/{name}")
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return (json.load(r).get("status") or {}).get("phase") or ""
    except urllib.error.HTTPError:
        return ""
    except OSError:
        return None


def pids_under(path):
    """Pids of processes whose command line names `path` (this run's directory)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                if path.encode() in open(f"/proc/{d}/cmdline", "rb").read():
                    out.append(int(d))
            except OSError:
                pass
    return out


class Qmp:
    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX)
        wait("QMP " + path, 30, lambda: self._try(path))
        self.f = self.s.makefile("rw")
        self.f.readline()
        self.cmd("qmp_capabilities")

    def _try(self, path):
        try:
            self.s.connect(path)
            return True
        except OSError:
            return False

    def cmd(self, _command, _fd=None, **args):
        line = json.dumps({"execute": _command, "arguments": args}) + "\n"
        if _fd is None:
            self.f.write(line); self.f.flush()
        else:  # the descriptor rides on the command (SCM_RIGHTS), as `getfd` wants
            socket.send_fds(self.s, [line.encode()], [_fd])
        while True:
            m = json.loads(self.f.readline())
            if "return" in m or "error" in m:
                return m


def replay(argv, vmi_dir, raw_dir, disk, raw_disk):
    """ferrovirt's QEMU command line (`qemu-argv.json`) for a raw QEMU: the same devices,
    machine and options, with the VMI directory's sockets and files in `raw_dir`, `disk`
    replaced by `raw_disk`, and no -runas or -incoming (the caller adds its own). Returns
    (argv, QMP socket path)."""
    if argv[0].startswith("-"):  # the arguments only (the launcher runs the agent's binary)
        argv = ["qemu-system-x86_64"] + argv
    out, skip, qmp = [], False, None
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a in ("-runas", "-incoming"):
            skip = True
            continue
        a = a.replace(disk, raw_disk).replace(vmi_dir, raw_dir)
        if argv[i - 1] == "-chardev" and a.startswith("socket,id=qmp,"):
            qmp = re.search(r"path=((?:[^,]|,,)*)", a).group(1).replace(",,", ",")
        out.append(a)
    if qmp is None:
        sys.exit("no QMP chardev in the replayed command line")
    return out, qmp


def find_argv(tmp):
    """The running VMI's recorded QEMU command line and directory, on either node."""
    for root, _, files in os.walk(tmp):
        if "qemu-argv.json" in files and os.path.basename(os.path.dirname(root)) == "vmis":
            return json.load(open(os.path.join(root, "qemu-argv.json"))), root
    return None


def ephemeral_cert(d, name):
    """A fresh P-256 key and self-signed leaf for `name` in `d` (cert.pem, key.pem)."""
    os.makedirs(d, exist_ok=True)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{d}/key.pem",
                    "-out", f"{d}/cert.pem", "-days", "1", "-subj", f"/CN={name}",
                    "-addext", f"subjectAltName=DNS:{name}",
                    "-addext", "basicConstraints=critical,CA:FALSE",
                    "-addext", "keyUsage=critical,digitalSignature",
                    "-addext", "extendedKeyUsage=serverAuth,clientAuth"],
                   check=True, capture_output=True)
    return open(f"{d}/cert.pem").read(), open(f"{d}/key.pem").read()


def raw_tls_files(tmp):
    """The ephemeral certificates of both raw QEMUs and the target's DH parameters, made
    before the timed span (ferrovirt's launchers make theirs before the copy starts)."""
    host = "migration-target.ferrovirt.invalid"
    sc, sk = ephemeral_cert(os.path.join(tmp, "tls-src-gen"), "migration-source.ferrovirt.invalid")
    tc, tk = ephemeral_cert(os.path.join(tmp, "tls-dst-gen"), host)
    dh = os.path.join(tmp, "dh-params.pem")
    if not os.path.exists(dh):
        # As ferrovirt does (migtls::FFDHE2048_PEM): without it QEMU generates DH
        # parameters at object-add, 0.6-1.5 s.
        subprocess.run(["openssl", "genpkey", "-genparam", "-algorithm", "DH", "-pkeyopt",
                        "group:ffdhe2048", "-out", dh], check=True, capture_output=True)
    return host, (sc, sk), (tc, tk), open(dh).read()


def raw_tls(tmp, q, d, files):
    """QEMU's TLS on both raw QEMUs as ferrovirt sets it up (docs/migration.md)."""
    host, (sc, sk), (tc, tk), dh = files
    for qmp, side, ours, key, peer in ((q, "client", sc, sk, tc), (d, "server", tc, tk, sc)):
        creds = os.path.join(tmp, f"tls-{side}")
        shutil.rmtree(creds, ignore_errors=True)
        os.makedirs(creds)
        for n, text in (("ca-cert.pem", peer), (f"{side}-cert.pem", ours), (f"{side}-key.pem", key)):
            open(os.path.join(creds, n), "w").write(text)
        if side == "server":
            open(os.path.join(creds, "dh-params.pem"), "w").write(dh)
        qmp.cmd("object-del", id="mig-tls")
        r = qmp.cmd("object-add", **{"qom-type": "tls-creds-x509", "id": "mig-tls",
                                    "endpoint": side, "dir": creds, "verify-peer": True,
                                    "sanity-check": False})
        if "error" in r:
            sys.exit(f"raw TLS credentials: {r}")
        shutil.rmtree(creds)
    q.cmd("migrate-set-parameters", **{"tls-creds": "mig-tls", "tls-hostname": host})
    d.cmd("migrate-set-parameters", **{"tls-creds": "mig-tls"})
    return host


def raw_run(tmp, memory_mib, local=False, recorded=None, tls=False):
    """One raw QEMU-to-QEMU migration; (total ms, downtime ms). `local`: each QEMU has its
    own disk, mirrored over NBD before the memory; total is the wall time of both.
    `recorded`: (argv, VMI directory, disk path) of ferrovirt's QEMU, replayed on both
    sides; else a bare QEMU with the same disk and memory. `tls`: QEMU's TLS with ephemeral
    certificates on the stream."""
    disk = os.path.join(tmp, "raw-disk.img")
    if not os.path.exists(disk):
        shutil.copy(os.path.join(GUEST, "disk.raw"), disk)
        if local:
            os.truncate(disk, 1 << 30)
    copy = os.path.join(tmp, "raw-copy.img")
    if local:
        if os.path.exists(copy):
            os.unlink(copy)
        open(copy, "wb").close()
        os.truncate(copy, 1 << 30)
    base = ["qemu-system-x86_64", "-accel", "tcg,tb-size=64", "-cpu", "max", "-machine", "q35",
            "-m", f"{memory_mib}M", "-nodefaults", "-display", "none", "-serial", "null",
            "-blockdev", f"driver=file,filename={disk},node-name=f,cache.direct=off",
            "-blockdev", "driver=raw,file=f,node-name=d",
            "-device", "virtio-blk-pci,drive=d", "-netdev", "user,id=n,restrict=on",
            "-device", "virtio-net-pci,netdev=n"]
    src_qmp, dst_qmp = os.path.join(tmp, "src.qmp"), os.path.join(tmp, "dst.qmp")
    for p in (src_qmp, dst_qmp):
        if os.path.exists(p):
            os.unlink(p)
    if recorded:
        argv, vmi_dir, their_disk = recorded
        dirs = []
        for side in ("src", "dst"):
            d = os.path.join(tmp, "raw-" + side)
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
            dirs.append(d)
        src_argv, src_qmp = replay(argv, vmi_dir, dirs[0], their_disk, disk)
        dst_argv, dst_qmp = replay(argv, vmi_dir, dirs[1], their_disk, copy if local else disk)
        src = subprocess.Popen(src_argv, stderr=subprocess.DEVNULL)
        dst = subprocess.Popen(dst_argv + ["-incoming", "defer"], stderr=subprocess.DEVNULL)
    else:
        src = subprocess.Popen(base + ["-qmp", f"unix:{src_qmp},server=on,wait=off"])
        dst_base = [x.replace(disk, copy) if local else x for x in base]
        dst = subprocess.Popen(dst_base + ["-qmp", f"unix:{dst_qmp},server=on,wait=off",
                                           "-incoming", "defer"])
    try:
        q = Qmp(src_qmp)
        d = Qmp(dst_qmp)
        time.sleep(8)  # the guest boots (as far as ferrovirt's VM has when it migrates)
        files = raw_tls_files(tmp) if tls else None
        t0 = time.time()
        marks = []  # (step, ms since t0): the raw side's timeline, printed with --timeline
        mark = lambda step: marks.append((step, round((time.time() - t0) * 1000)))
        # With TLS, as ferrovirt: the disks' NBD mirror and the memory stream both under
        # QEMU's TLS from the same ephemeral certificates (set up inside the timed span, as
        # ferrovirt's launchers do within the migration).
        host = raw_tls(tmp, q, d, files) if tls else None
        nbd_tls = {"tls-creds": "mig-tls"} if tls else {}
        if local:
            nbd = os.path.join(tmp, "nbd.sock")
            if os.path.exists(nbd):
                os.unlink(nbd)
            mark("creds")
            d.cmd("nbd-server-start", addr={"type": "unix", "data": {"path": nbd}}, **nbd_tls)
            node = "d"
            if recorded:  # the format node over ferrovirt's disk file
                devs = [json.loads(a) for p_, a in zip(src_argv, src_argv[1:])
                        if p_ == "-blockdev" and a.startswith("{")]
                files = [b["node-name"] for b in devs if b.get("filename") == disk]
                node = next(b["node-name"] for b in devs if b.get("file") in files)
            d.cmd("block-export-add", type="nbd", id="e", **{"node-name": node}, name="d",
                  writable=True)
            if tls:
                nbd_tls["tls-hostname"] = host
            q.cmd("blockdev-add", driver="nbd", **{"node-name": "t"},
                  server={"type": "unix", "path": nbd}, export="d", **nbd_tls)
            mark("export, client")
            r = q.cmd("blockdev-mirror", **{"job-id": "m"}, device=node, target="t",
                      sync="full")
            if "error" in r:
                sys.exit(f"raw mirror: {r}")
            mark("mirror started")
            wait("raw mirror", 600, lambda: any(j.get("ready") for j in q.cmd(
                "query-block-jobs")["return"]), every=RAW_POLL)
            mark("mirror ready")
            q.cmd("migrate-set-capabilities", capabilities=[
                {"capability": "pause-before-switchover", "state": True}])
        # The two ends of one TCP connection, handed to the QEMUs as ferrovirt's agents do.
        lst = socket.socket(); lst.bind(("127.0.0.1", 0)); lst.listen(1)
        out_end = socket.create_connection(lst.getsockname()); in_end, _ = lst.accept()
        lst.close()
        d.cmd("getfd", _fd=in_end.fileno(), fdname="migration")
        r = d.cmd("migrate-incoming", uri="fd:migration")
        if "error" in r:
            sys.exit(f"raw migrate-incoming: {r}")
        q.cmd("getfd", _fd=out_end.fileno(), fdname="migration")
        in_end.close(); out_end.close()
        q.cmd("migrate", uri="fd:migration")
        mark("migrate")
        if local:
            wait("pre-switchover", 120, lambda: q.cmd("query-migrate")["return"].get(
                "status") == "pre-switchover", every=RAW_POLL)
            mark("pre-switchover")
            q.cmd("block-job-cancel", device="m")
            wait("the mirror done", 120, lambda: not q.cmd("query-block-jobs")["return"],
                 every=0.01)
            q.cmd("blockdev-del", **{"node-name": "t"})
            q.cmd("migrate-continue", state="pre-switchover")
            mark("mirror done, continue")
        info = wait("raw migration", 120,
                    lambda: (lambda r: r if r.get("status") in ("completed", "failed") else None)(
                        q.cmd("query-migrate")["return"]), every=RAW_POLL)
        if info["status"] != "completed":
            sys.exit(f"raw migration failed: {info}")
        mark("completed")
        if TIMELINE:
            print(f"raw {'TLS' if tls else 'plain'} timeline (ms): {marks}", file=sys.stderr)
        if local:
            return round((time.time() - t0) * 1000), info["downtime"]
        return info["total-time"], info["downtime"]
    finally:
        for p in (src, dst):
            p.kill(); p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "debug", "ferrovirt"))
    ap.add_argument("--memory-mib", type=int, default=128)
    ap.add_argument("--local", action="store_true",
                    help="a node-local disk, block-migrated (vs a raw NBD mirror + migrate)")
    ap.add_argument("--no-tls", action="store_true",
                    help="the HyperConverged's liveMigrationConfig.disableTLS: true (the KubeVirt CR's configuration.migrations.disableTLS)")
    ap.add_argument("--bare", action="store_true",
                    help="also a raw migration of a minimal QEMU (plain)")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="fv-bench-migration-")
    procs = []
    try:
        data = os.path.join(tmp, "data")
        port = free_port()
        log = open(os.path.join(tmp, "server.log"), "w")
        procs.append(subprocess.Popen(
            [a.binary, "server", "--data-dir", data, "--listen", f"127.0.0.1:{port}",
             "--node-name", "node1", "--network-mode", "user", "--host-disk-root", tmp],
            stdout=log, stderr=log))
        kubeconfig = os.path.join(data, "kubeconfig.yaml")

        def kubectl(*args, check=True):
            r = subprocess.run(["kubectl", "--kubeconfig", kubeconfig, *args],
                               capture_output=True, text=True)
            if check and r.returncode != 0:
                sys.exit(f"kubectl {args}: {r.stderr}")
            return r.stdout

        wait("the server", 60, lambda: os.path.exists(kubeconfig) and subprocess.run(
            ["kubectl", "--kubeconfig", kubeconfig, "get", "--raw", "/readyz"],
            capture_output=True).returncode == 0)
        alog = open(os.path.join(tmp, "agent.log"), "w")
        procs.append(subprocess.Popen(
            [a.binary, "agent", "--kubeconfig", kubeconfig, "--node-name", "node2", "--data-dir",
             os.path.join(tmp, "agent-node2"), "--host-disk-root", tmp, "--network-mode", "user"],
            stdout=alog, stderr=alog))
        wait("two nodes", 60, lambda: kubectl("get", "nodes").count(" Ready") == 2)
        if a.local:
            # A `local` volume on node1 as its provisioner leaves it (1 GiB, thin).
            pv = os.path.join(data, "agent", "volumes", "pv-bench")
            os.makedirs(pv)
            shutil.copy(os.path.join(GUEST, "disk.raw"), os.path.join(pv, "disk.img"))
            os.truncate(os.path.join(pv, "disk.img"), 1 << 30)
            volume = f"""
apiVersion: v1
kind: PersistentVolume
metadata:
  name: pv-bench
  annotations: {{pv.kubernetes.io/provisioned-by: ferrovirt.io/local}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteOnce]
  storageClassName: local
  local: {{path: {pv}}}
  nodeAffinity: {{required: {{nodeSelectorTerms: [{{matchExpressions: [
    {{key: kubernetes.io/hostname, operator: In, values: [node1]}}]}}]}}}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: bench, namespace: default}}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: local
  resources: {{requests: {{storage: 1Gi}}}}
  volumeName: pv-bench
---"""
        else:
            pv = os.path.join(tmp, "pv")
            os.makedirs(pv)
            shutil.copy(os.path.join(GUEST, "disk.raw"), os.path.join(pv, "disk.img"))
            volume = f"""
apiVersion: v1
kind: PersistentVolume
metadata: {{name: pv-bench}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteMany]
  hostPath: {{path: {pv}}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: bench, namespace: default}}
spec:
  accessModes: [ReadWriteMany]
  resources: {{requests: {{storage: 1Gi}}}}
  volumeName: pv-bench
---"""
        manifest = volume + f"""
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: bench, namespace: default}}
spec:
  runStrategy: Always
  template:
    spec:
      domain:
        memory: {{guest: {a.memory_mib}Mi}}
        devices:
          disks: [{{name: root, disk: {{bus: virtio}}}}]
      volumes: [{{name: root, persistentVolumeClaim: {{claimName: bench}}}}]
"""
        if a.no_tls:
            # Through the HyperConverged, which owns the KubeVirt CR every component reads
            # (a KubeVirt CR of our own would come second to it).
            kubectl("patch", "hyperconverged", "kubevirt-hyperconverged", "-n",
                    "kubevirt-hyperconverged", "--type=merge", "-p",
                    '{"spec":{"liveMigrationConfig":{"disableTLS":true}}}')
            wait("disableTLS in the KubeVirt CR", 30, lambda: "true" in kubectl(
                "get", "kubevirt", "kubevirt-kubevirt-hyperconverged", "-n",
                "kubevirt-hyperconverged", "-o",
                "jsonpath={.spec.configuration.migrations.disableTLS}", check=False))
        subprocess.run(["kubectl", "--kubeconfig", kubeconfig, "apply", "-f", "-"],
                       input=manifest, text=True, check=True, capture_output=True)
        wait("the VM running", 120, lambda: "Running" in kubectl(
            "get", "vmi", "bench", "-o", "jsonpath={.status.phase}", check=False))
        time.sleep(8)  # the guest boots
        found_argv = find_argv(tmp)
        if not found_argv:
            sys.exit("the VMI's qemu-argv.json was not found")
        recorded = (found_argv[0], found_argv[1], os.path.join(pv, "disk.img"))
        proxy_port = free_port()
        procs.append(subprocess.Popen(
            ["kubectl", "--kubeconfig", kubeconfig, "proxy", "--port", str(proxy_port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait("kubectl proxy", 30, lambda: proxied_phase(proxy_port, "none") is not None)
        ours, wall, seen, raw, raw_t, bare = [], [], set(), [], [], []
        for i in range(a.runs):
            name = f"bench-{i}"
            t0 = time.time()
            subprocess.run(["kubectl", "--kubeconfig", kubeconfig, "apply", "-f", "-"], input=(
                "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\n"
                f"metadata: {{name: {name}, namespace: default}}\nspec: {{vmiName: bench}}\n"),
                text=True, check=True, capture_output=True)
            # Read through the one `kubectl proxy` (a kubectl process every 50 ms would take
            # a core from the QEMUs this run times; the raw runs have no such neighbour).
            phase = wait(f"migration {name}", 120, lambda: (lambda p: p if p in (
                "Succeeded", "Failed") else None)(proxied_phase(proxy_port, name)), 0.05)
            wall.append((time.time() - t0) * 1000)
            if phase != "Succeeded":
                sys.exit(f"{name} failed: {kubectl('get', 'vmim', name, '-o', 'json')}")
            # The agent's Event of this move: the one not seen before.
            evs = json.loads(kubectl("get", "events", "-o", "json"))["items"]
            new = [e for e in evs if e["metadata"]["uid"] not in seen]
            seen.update(e["metadata"]["uid"] for e in evs)
            found = [m for e in new for m in re.findall(
                r"Migrated to \S+ \(total (\d+) ms, downtime (\d+) ms\)"
                r"(?:; \d+ disk\(s\) mirrored, disks and memory (\d+) ms)?", e.get("message", ""))]
            if len(found) != 1:
                sys.exit(f"expected one Migrated event, found {found}")
            total, down, both = found[0]
            # Block migration: QEMU's total covers the memory only; the agent measures the
            # mirror's start to the migration's completion, as the raw side does.
            ours.append((int(both), int(down)) if a.local else (int(total), int(down)))
            # Interleaved, so that the three see the same load on this shared machine (the
            # raw guests boot for 8 s, time enough for the target to report Running).
            raw.append(raw_run(tmp, a.memory_mib, a.local, recorded))
            raw_t.append(raw_run(tmp, a.memory_mib, a.local, recorded, tls=True))
            if a.bare:
                bare.append(raw_run(tmp, a.memory_mib, a.local))
    finally:
        for p in procs:
            p.terminate()
        time.sleep(2)
        # The launchers and QEMUs are detached from the server: every process started from
        # this run's directory, by pid.
        for pid in pids_under(tmp):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        keep = os.environ.get("FV_BENCH_KEEP_LOGS")
        if keep:
            os.makedirs(keep, exist_ok=True)
            for f in ("server.log", "agent.log"):
                if os.path.exists(os.path.join(tmp, f)):
                    shutil.copy(os.path.join(tmp, f), keep)
        shutil.rmtree(tmp, ignore_errors=True)
    med = lambda xs: statistics.median(xs)
    o_total, o_down = med([t for t, _ in ours]), med([d for _, d in ours])
    print(f"runs: {a.runs}, guest memory {a.memory_mib} MiB, TCG, "
          f"ferrovirt's stream {'plain (disableTLS)' if a.no_tls else 'QEMU TLS'}"
          + (", node-local 1 GiB disk block-migrated (totals: mirror start -> completed)"
             if a.local else ""))
    print(f"ferrovirt    : total {o_total} ms, downtime {o_down} ms "
          f"(VMIM create -> Succeeded {med(wall):.0f} ms)")
    sides = [("raw plain", raw), ("raw QEMU TLS", raw_t)] + ([("bare plain", bare)] if bare else [])
    for label, xs in sides:
        t, d = med([t for t, _ in xs]), med([d for _, d in xs])
        print(f"{label:13}: total {t} ms, downtime {d} ms; ferrovirt/{label}: total "
              f"{o_total / t:.2f}x (goal <= 1.1x), downtime {o_down - d:+} ms (goal <= +50 ms)")
    print(f"all ferrovirt (total, downtime): {ours}")
    for label, xs in sides:
        print(f"all {label} (total, downtime): {xs}")


if __name__ == "__main__":
    main()
