#!/usr/bin/env python3
"""VMI create -> Running through ferrovirt vs the same QEMU started by hand, and memory per VM
outside QEMU (launcher RSS plus the agent's share of the server process).

Usage: bench/vmi-start.py [--runs N] [--start-path-runs N] [--binary target/release/ferrovirt]
                          [--network-mode auto|user] [--disk ephemeral|pvc|none]
Prints medians of both start times and their ratio, then MiB per VM outside QEMU.

First, the start path (issue #15, goal <= 50 ms median): API create -> QEMU exec for VMIs that
go through the scheduler (no status in the request), one at a time. The create is stamped with
CLOCK_BOOTTIME just before the POST is sent; QEMU's exec with its process start time from
/proc/PID/stat (field 22, boot-relative clock ticks: 10 ms resolution), found through the
VMI's `ferrovirt.io/qemu-pid` annotation. Each VMI is deleted (and its QEMU gone) before the next.
Then the per-step table: the scheduler's "bound" log line (pass start, bind written) and the
agent's and launcher's timing records (`agent-timing.json`, `launcher-timing.json` in the VMI
directory), all on CLOCK_BOOTTIME, as medians over the runs: each step's own duration and
when it ended, counted from the POST. `--network-mode` is the server's (`auto`: the pod network
when run as root); `--disk`: the root disk as an ephemeral overlay on a hostPath PV (a
`qemu-img create` per start), the PV's raw disk itself (`pvc`), or no disk at all (`none`).
Everything runs on 127.0.0.1; the guest is the project's test guest (target/test-guest).
Both series start their VMs one after another with the earlier ones still running; ferrovirt's
VMs are stopped before the baseline starts. Needs `cargo build --release -p ferrovirt` first.
"""
import argparse, base64, json, os, shutil, signal, socket, ssl, statistics, subprocess, sys
import re, tempfile, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p


class Api:
    def __init__(self, data_dir, port):
        self.base = f"https://127.0.0.1:{port}"
        self.token = open(os.path.join(data_dir, "token")).read().strip()
        self.ctx = ssl.create_default_context(cafile=os.path.join(data_dir, "tls", "ca.crt"))
        self.ctx.check_hostname = False

    def req(self, method, path, body=None, ctype="application/json"):
        data = json.dumps(body).encode() if body is not None else None
        r = urllib.request.Request(self.base + path, data=data, method=method)
        r.add_header("Authorization", "Bearer " + self.token)
        if data is not None:
            r.add_header("Content-Type", ctype)
        try:
            with urllib.request.urlopen(r, context=self.ctx, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")


def rss_kib(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(root):
    """PIDs of every process below `root`, from /proc (children before grandchildren)."""
    kids = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid):
    """Whether `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_pids(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def stop_everything(srv, data):
    """SIGKILLs the server, its launchers (own process groups, which survive the server) and
    their QEMUs, each by PID: nothing outside this benchmark's process trees is touched."""
    pids = descendants(srv.pid)
    vmis = os.path.join(data, "agent", "vmis")
    for uid in os.listdir(vmis) if os.path.isdir(vmis) else []:
        try:
            with open(os.path.join(vmis, uid, "launcher.pid")) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue
        pids += [pid] + descendants(pid)
    srv.send_signal(signal.SIGKILL); srv.wait()
    kill_pids(pids)


CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_start_boottime(pid):
    """Seconds since boot at which `pid` started (its fork; exec follows within the same
    process), from /proc/PID/stat field 22."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[19]) / CLK_TCK


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def bound_line(log_path, name):
    """(pass_us, bound_us) from the scheduler's "bound" log line of default/NAME."""
    with open(log_path, errors="replace") as f:
        for line in f:
            line = ANSI.sub("", line)
            if " bound " in line + " " and f"vmi=default/{name} " in line:
                m = re.search(r"pass_us=(\d+) bound_us=(\d+)", line)
                if m:
                    return int(m.group(1)), int(m.group(2))
    return None


def read_timing(vdir, name, deadline):
    path = os.path.join(vdir, name)
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                return json.load(f)["spans"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.01)
    return []


def step_rows(t0_us, ack_us, bound, agent, launcher, qemu_us):
    """One run's steps in order: (name, duration ms, end ms after the POST)."""
    ms = lambda us: us / 1000.0
    rows = [("API create acknowledged", ms(ack_us - t0_us), ms(ack_us - t0_us))]
    if bound:
        rows.append(("scheduler pass starts", ms(bound[0] - ack_us), ms(bound[0] - t0_us)))
        rows.append(("scheduler decides + bind written", ms(bound[1] - bound[0]), ms(bound[1] - t0_us)))
    for prefix, spans in (("agent", agent), ("launcher", launcher)):
        for s in spans:
            rows.append((f"{prefix}: {s['name']}", ms(s["end_us"] - s["start_us"]),
                         ms(s["end_us"] - t0_us)))
    if agent:
        first = agent[0]["end_us"]
        if bound:
            rows.insert(3, ("bind -> agent's watch delivers", ms(first - bound[1]), ms(first - t0_us)))
    if agent and launcher:
        gap = launcher[0]["start_us"] - agent[-1]["end_us"]
        rows.append(("(launcher exec -> its main, in the gap)", ms(gap), ms(launcher[0]["start_us"] - t0_us)))
    rows.append(("QEMU process start (/proc, 10 ms ticks)", 0.0, ms(qemu_us - t0_us)))
    return rows


def print_step_table(all_rows):
    names = []
    for rows in all_rows:
        for n, _, _ in rows:
            if n not in names:
                names.append(n)
    ends = {n: [] for n in names}
    durs = {n: [] for n in names}
    for rows in all_rows:
        for n, d, e in rows:
            durs[n].append(d); ends[n].append(e)
    order = sorted(names, key=lambda n: statistics.median(ends[n]))
    print(f"{'step':48} {'own ms':>8} {'ends at ms':>11}   (medians over {len(all_rows)} runs)")
    for n in order:
        print(f"{n:48} {statistics.median(durs[n]):8.2f} {statistics.median(ends[n]):11.2f}")


def vmi_spec(name, disk):
    spec = {"terminationGracePeriodSeconds": 0, "domain": {"memory": {"guest": "128Mi"},
                                                          "devices": {"disks": []}}, "volumes": []}
    if disk != "none":
        spec["domain"]["devices"]["disks"].append({"name": "root", "disk": {"bus": "virtio"}})
        vol = ({"ephemeral": {"persistentVolumeClaim": {"claimName": "root"}}}
               if disk == "ephemeral" else {"persistentVolumeClaim": {"claimName": "rootrw"}})
        spec["volumes"].append({"name": "root", **vol})
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": name}, "spec": spec}


def start_path(api, base, runs, data, log_path, disk):
    """API create -> QEMU exec, through the scheduler, one VMI at a time. Returns the totals
    and each run's step rows."""
    out, all_rows = [], []
    for i in range(runs):
        vmi = vmi_spec(f"sp{i}", disk)
        t0 = time.clock_gettime(time.CLOCK_BOOTTIME)
        code, obj = api.req("POST", base, vmi)
        ack = time.clock_gettime(time.CLOCK_BOOTTIME)
        assert code == 201, obj
        pid = None
        while pid is None:
            code, obj = api.req("GET", f"{base}/sp{i}")
            pid = obj.get("metadata", {}).get("annotations", {}).get("ferrovirt.io/qemu-pid")
            if time.clock_gettime(time.CLOCK_BOOTTIME) - t0 > 60:
                raise SystemExit(f"no QEMU pid after 60 s: {json.dumps(obj.get('status'))[:600]}")
            if pid is None:
                time.sleep(0.02)
        qemu = proc_start_boottime(int(pid))
        out.append(qemu - t0)
        vdir = os.path.join(data, "agent", "vmis", obj["metadata"]["uid"])
        deadline = time.monotonic() + 5
        agent = read_timing(vdir, "agent-timing.json", deadline)
        launcher = read_timing(vdir, "launcher-timing.json", deadline)
        us = lambda t: int(t * 1e6)
        all_rows.append(step_rows(us(t0), us(ack), bound_line(log_path, f"sp{i}"), agent,
                                  launcher, us(qemu)))
        api.req("DELETE", f"{base}/sp{i}")
        deadline = time.monotonic() + 60
        while api.req("GET", f"{base}/sp{i}")[0] != 404 and time.monotonic() < deadline:
            time.sleep(0.1)
    return out, all_rows


def qmp_wait_running(path, deadline):
    while time.monotonic() < deadline:
        try:
            s = socket.socket(socket.AF_UNIX); s.connect(path); break
        except OSError:
            time.sleep(0.002)
    f = s.makefile("rw")
    f.readline()
    f.write('{"execute":"qmp_capabilities"}\n'); f.flush(); f.readline()
    while time.monotonic() < deadline:
        f.write('{"execute":"query-status"}\n'); f.flush()
        while True:
            msg = json.loads(f.readline())
            if "return" in msg:
                break
        if msg["return"].get("running"):
            return
        time.sleep(0.002)
    raise SystemExit("QEMU did not run")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--start-path-runs", type=int, default=7)
    ap.add_argument("--binary", default=os.path.join(ROOT, "target/release/ferrovirt"))
    ap.add_argument("--network-mode", default="auto", choices=["auto", "user"])
    ap.add_argument("--disk", default="ephemeral", choices=["ephemeral", "pvc", "none"])
    a = ap.parse_args()
    guest = os.path.join(ROOT, "target/test-guest")
    subprocess.run([os.path.join(ROOT, "scripts/build-test-guest.sh")], check=True)
    tmp = tempfile.mkdtemp(prefix="fv-bench-")
    data = os.path.join(tmp, "data"); port = free_port()
    log = open(os.path.join(tmp, "server.log"), "w")
    srv = subprocess.Popen([a.binary, "server", "--data-dir", data, "--listen", f"127.0.0.1:{port}",
                            "--node-name", "bench", "--network-mode", a.network_mode,
                            # The guest disk is a hostPath PV under tmp: foreign host paths
                            # are refused unless they lie under --host-disk-root.
                            "--host-disk-root", tmp], stdout=log, stderr=log)
    try:
        for _ in range(300):
            if os.path.exists(os.path.join(data, "token")):
                try:
                    api = Api(data, port)
                    if api.req("GET", "/api/v1/nodes/bench")[0] == 200:
                        break
                except OSError:
                    pass
            time.sleep(0.1)
        else:
            raise SystemExit("server did not come up")
        pvdir = os.path.join(tmp, "pv"); os.makedirs(pvdir)
        shutil.copy(os.path.join(guest, "disk.qcow2"), os.path.join(pvdir, "disk.img"))
        api.req("POST", "/api/v1/persistentvolumes", {"apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": "pv"}, "spec": {"capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"], "hostPath": {"path": pvdir}}})
        api.req("POST", "/api/v1/namespaces/default/persistentvolumeclaims", {"apiVersion": "v1",
            "kind": "PersistentVolumeClaim", "metadata": {"name": "root"}, "spec": {
            "accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}},
            "volumeName": "pv"}})
        # A writable raw disk for `--disk pvc` (used in place: no overlay).
        rwdir = os.path.join(tmp, "pvrw"); os.makedirs(rwdir)
        shutil.copy(os.path.join(guest, "disk.raw"), os.path.join(rwdir, "disk.img"))
        api.req("POST", "/api/v1/persistentvolumes", {"apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": "pvrw"}, "spec": {"capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"], "hostPath": {"path": rwdir}}})
        api.req("POST", "/api/v1/namespaces/default/persistentvolumeclaims", {"apiVersion": "v1",
            "kind": "PersistentVolumeClaim", "metadata": {"name": "rootrw"}, "spec": {
            "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
            "volumeName": "pvrw"}})
        base = "/apis/kubevirt.io/v1/namespaces/default/virtualmachineinstances"
        if a.start_path_runs > 0:
            sp, rows = start_path(api, base, a.start_path_runs, data,
                                  os.path.join(tmp, "server.log"), a.disk)
            print(f"start path (network {a.network_mode}, disk {a.disk}; load average "
                  f"{os.getloadavg()[0]:.2f}), API create -> QEMU exec: median "
                  f"{statistics.median(sp)*1000:.0f} ms over {len(sp)} runs "
                  f"[{', '.join(f'{t*1000:.0f}' for t in sp)}] (goal <= 50 ms; "
                  f"10 ms resolution)", flush=True)
            exact = [e for r in rows for n, _, e in r if n == "launcher: qemu_spawn"]
            if exact:
                print(f"  QEMU exec as the launcher saw it (its spawn returned; microsecond clock): "
                      f"median {statistics.median(exact):.1f} ms "
                      f"[{', '.join(f'{t:.0f}' for t in exact)}]")
            print_step_table(rows)
            if a.runs == 0:
                return
        idle_kib = rss_kib(srv.pid)
        fv_times, argvs, uids = [], [], []
        for i in range(a.runs):
            vmi = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                   "metadata": {"name": f"b{i}"},
                   "spec": {"domain": {"memory": {"guest": "128Mi"}, "devices": {
                       "disks": [{"name": "root", "disk": {"bus": "virtio"}}]}},
                       "volumes": [{"name": "root", "ephemeral": {"persistentVolumeClaim": {"claimName": "root"}}}]},
                   "status": {"phase": "Scheduled", "nodeName": "bench"}}
            t0 = time.monotonic()
            code, obj = api.req("POST", base, vmi)
            assert code == 201, obj
            while True:
                code, obj = api.req("GET", f"{base}/b{i}")
                if obj.get("status", {}).get("phase") == "Running":
                    break
                if time.monotonic() - t0 > 120:
                    raise SystemExit("VMI not Running after 120 s")
                time.sleep(0.02)
            fv_times.append(time.monotonic() - t0)
            uid = obj["metadata"]["uid"]; uids.append(uid)
            vdir = os.path.join(data, "agent", "vmis", uid)
            for _ in range(100):
                if os.path.exists(os.path.join(vdir, "qemu-argv.json")):
                    break
                time.sleep(0.05)
            argvs.append((vdir, json.load(open(os.path.join(vdir, "qemu-argv.json")))))
        time.sleep(3)
        launcher_kib = []
        for uid in uids:
            pid = int(open(os.path.join(data, "agent", "vmis", uid, "launcher.pid")).read())
            launcher_kib.append(rss_kib(pid))
        busy_kib = rss_kib(srv.pid)
        # Stop ferrovirt's VMs (and wait for their launchers and QEMUs to go) so that their
        # guests do not compete with the baseline for the CPUs.
        vm_pids = []
        for uid in uids:
            pid = int(open(os.path.join(data, "agent", "vmis", uid, "launcher.pid")).read())
            vm_pids += [pid] + descendants(pid)
        for i in range(a.runs):
            api.req("DELETE", f"{base}/b{i}")
        deadline = time.monotonic() + 60
        while any(alive(p) for p in vm_pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        kill_pids([p for p in vm_pids if alive(p)])
        # Baseline: the same QEMU command lines by hand, to QMP "running". Like the VMIs above,
        # each starts while the earlier ones still run; all are killed at the end.
        raw_times, raw_procs, raw_netns = [], [], []
        try:
            for i, (old, argv) in enumerate(argvs):
                rdir = os.path.join(tmp, f"raw{i}"); os.makedirs(rdir)
                args = [x.replace(old, rdir) for x in argv]
                qmp = os.path.join(rdir, "qmp.sock")
                subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b",
                                os.path.join(pvdir, "disk.img"),
                                os.path.join(rdir, "ephemeral-root.qcow2")], check=True)
                # On the pod network QEMU opens a tap by name inside the VMI's namespace,
                # gone with the VMI: the by-hand run gets a namespace of its own with taps of
                # the same names (made before the clock starts).
                prefix = []
                taps = [m for x in args for m in re.findall(r"tap,id=[^,]*,ifname=([^,]+)", x)]
                if taps:
                    ns = f"fvraw-{os.getpid()}-{i}"
                    subprocess.run(["ip", "netns", "add", ns], check=True)
                    raw_netns.append(ns)
                    for t in taps:
                        subprocess.run(["ip", "-n", ns, "tuntap", "add", "dev", t, "mode", "tap"],
                                       check=True)
                    prefix = ["nsenter", f"--net=/run/netns/{ns}", "--"]
                t0 = time.monotonic()
                raw_procs.append(subprocess.Popen(prefix + ["qemu-system-x86_64"] + [x for x in args if x],
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                qmp_wait_running(qmp, time.monotonic() + 60)
                raw_times.append(time.monotonic() - t0)
        finally:
            for p in raw_procs:
                p.kill(); p.wait()
            for ns in raw_netns:
                subprocess.run(["ip", "netns", "del", ns])
        fv, raw = statistics.median(fv_times), statistics.median(raw_times)
        ms = lambda ts: ", ".join(f"{t*1000:.0f}" for t in ts)
        print(f"VMI create->Running (ferrovirt): median {fv*1000:.0f} ms over {len(fv_times)} runs "
              f"[{ms(fv_times)}]")
        print(f"same QEMU by hand -> running:    median {raw*1000:.0f} ms over {len(raw_times)} runs "
              f"[{ms(raw_times)}]")
        print(f"ratio ferrovirt/raw: {fv/raw:.2f}")
        per_vm_launcher = statistics.median(launcher_kib) / 1024
        agent_share = max(0, busy_kib - idle_kib) / 1024 / max(1, len(uids))
        print(f"memory per VM outside QEMU: launcher RSS median {per_vm_launcher:.1f} MiB + agent/server share "
              f"{agent_share:.1f} MiB = {per_vm_launcher + agent_share:.1f} MiB "
              f"(KubeVirt's fixed per-VM overhead: 240 MiB)")
    finally:
        stop_everything(srv, data)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
