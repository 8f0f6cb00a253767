//! A TCP connection to a guest survives its live migration (docs/migration.md "The pod
//! address moves with the VMI"). Two nodes on the pod network with the VXLAN overlay, each
//! played by a network namespace the test creates (an underlay veth between them): the
//! server's embedded node1 and an agent process node2. A VMI with a masquerade interface on a
//! ReadWriteMany claim boots on node1 and runs an echo service (busybox `nc -e cat`); a client
//! in node1's namespace opens one TCP connection to the VMI's address and sends a line; the
//! VMI is migrated to node2; the same connection then carries another line both ways. The
//! VMI's address (from node1's subnet) and MAC stay, node1 routes the address as a /32
//! through the overlay to node2, node2 publishes it on its Node, and the guest did not reboot.
//! A ping from node1 every 20 ms runs throughout: the longest silence is printed (the gap
//! between the guest's pause on node1 and the routes reaching node2).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use ferrovirt_testkit::console::SerialConsole;
use ferrovirt_testkit::netns::{Netns, NodePair, pod_network_args};
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(180);
const MIGRATE: Duration = Duration::from_secs(90);
const A_IP: &str = "192.168.254.1";
const B_IP: &str = "192.168.254.2";
const A_CIDR: &str = "10.244.200.0/24";
const B_CIDR: &str = "10.244.201.0/24";
const PORT: u16 = 7000;

const VMI: &str = r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: tcp, namespace: default}
spec:
  terminationGracePeriodSeconds: 5
  domain:
    memory: {guest: 128Mi}
    devices:
      disks:
      - {name: root, disk: {bus: virtio}}
      interfaces:
      - {name: default, masquerade: {}}
  networks:
  - {name: default, pod: {}}
  volumes:
  - {name: root, persistentVolumeClaim: {claimName: tcp-root}}
"#;

const MIGRATION: &str = r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstanceMigration
metadata: {name: tcp-mig, namespace: default}
spec: {vmiName: tcp}
"#;

/// The client: one TCP connection, opened (retried until the guest listens) and then used
/// for every line read on stdin; prints `GOT <reply>` per line, `CLOSED` if the peer closes.
const CLIENT: &str = r#"
import socket, sys, time
deadline = time.time() + 60
while True:
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
        break
    except OSError:
        if time.time() > deadline:
            raise
        time.sleep(0.2)
s.settimeout(60)
print("CONNECTED %s:%d" % s.getsockname(), flush=True)
for line in sys.stdin:
    s.sendall(line.encode())
    got = b""
    while not got.endswith(b"\n"):
        c = s.recv(100)
        if not c:
            print("CLOSED", flush=True)
            sys.exit(1)
        got += c
    print("GOT " + got.decode().strip(), flush=True)
"#;

/// An ICMP echo every 20 ms to argv[1] until stdin closes; then prints the longest interval
/// between two consecutive replies (ms) and the number of replies.
const PINGER: &str = r#"
import os, select, socket, struct, sys, threading, time
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
def csum(b):
    n = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    n = (n >> 16) + (n & 0xFFFF)
    n += n >> 16
    return ~n & 0xFFFF
ident, seq, replies, nxt = os.getpid() & 0xFFFF, 0, [], time.time()
while not stop.is_set():
    now = time.time()
    if now >= nxt:
        seq += 1
        h = struct.pack("!BBHHH", 8, 0, 0, ident, seq & 0xFFFF)
        s.sendto(struct.pack("!BBHHH", 8, 0, csum(h), ident, seq & 0xFFFF), (sys.argv[1], 0))
        nxt = now + 0.02
    r, _, _ = select.select([s], [], [], max(0, nxt - time.time()))
    if r:
        p = s.recv(200)
        if p[20] == 0 and struct.unpack("!H", p[24:26])[0] == ident:
            replies.append(time.time())
gap = max((b - a for a, b in zip(replies, replies[1:])), default=0)
print("%.0f %d" % (gap * 1000, len(replies)), flush=True)
"#;

struct Client {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Client {
    fn start(ns: &Netns, ip: &str) -> anyhow::Result<Client> {
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                ns.name(),
                "python3",
                "-u",
                "-c",
                CLIENT,
                ip,
            ])
            .arg(PORT.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        Ok(Client {
            child,
            stdin,
            stdout,
        })
    }

    /// The next line the client prints (it bounds every wait itself: 60 s).
    fn line(&mut self) -> anyhow::Result<String> {
        let mut l = String::new();
        self.stdout.read_line(&mut l)?;
        Ok(l.trim().to_string())
    }

    fn round_trip(&mut self, text: &str) -> anyhow::Result<String> {
        writeln!(self.stdin, "{text}")?;
        self.stdin.flush()?;
        self.line()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The guest's uptime in seconds, read on `console` (a launcher's serial socket serves one
/// client at a time: one connection per launcher).
fn uptime(console: &SerialConsole) -> anyhow::Result<f64> {
    let (out, rc) = console.exec("cat /proc/uptime", Duration::from_secs(20))?;
    anyhow::ensure!(rc == 0, "cat /proc/uptime: {out}");
    out.lines()
        .filter_map(|l| l.split_whitespace().next()?.parse::<f64>().ok())
        .next_back()
        .ok_or_else(|| anyhow::anyhow!("no uptime in {out:?}"))
}

#[test]
fn a_tcp_connection_to_the_guest_survives_its_live_migration() -> anyhow::Result<()> {
    let started = Instant::now();
    TestGuest::get()?;
    let NodePair {
        a: node_a,
        b: node_b,
    } = NodePair::new("fvm", A_IP, B_IP)?;
    let mut opts = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
    opts.node_name = Some("node1".into());
    opts.extra_args = pod_network_args(&node_a, A_IP, Some(A_CIDR))
        .into_iter()
        .map(String::from)
        .collect();
    let mut c = Cluster::start(&opts)?;
    // The VMI first, while node1 is the only node (a nodeSelector would bind the migration
    // too): it starts there.
    c.guest_disk_claim("tcp-root")?;
    let rwx = r#"{"spec":{"accessModes":["ReadWriteMany"]}}"#;
    c.kubectl_ok(&["patch", "pv", "pv-tcp-root", "--type=merge", "-p", rwx])?;
    c.kubectl_ok(&["patch", "pvc", "tcp-root", "--type=merge", "-p", rwx])
        .ok();
    c.apply(VMI)?;
    c.wait_until("the VMI scheduled to node1", BOOT, || {
        let v = c.get_json(&["vmi", "tcp"])?;
        Ok((v["status"]["nodeName"] == "node1").then_some(()))
    })?;
    c.start_agent_with("node2", &pod_network_args(&node_b, B_IP, Some(B_CIDR)))?;
    // Both overlays route to the other node's subnet.
    c.wait_until("the overlay routes", Duration::from_secs(60), || {
        let a = node_a
            .ip(&["route", "show", "dev", "fv-vx0"])
            .unwrap_or_default();
        let b = node_b
            .ip(&["route", "show", "dev", "fv-vx0"])
            .unwrap_or_default();
        Ok((a.contains(B_CIDR) && b.contains(A_CIDR)).then_some(()))
    })?;

    let v = c.wait_until("the VMI Running with an address", BOOT, || {
        let v = c.get_json(&["vmi", "tcp"])?;
        if v["status"]["phase"] == "Failed" {
            anyhow::bail!("the VMI failed: {}", v["status"]);
        }
        let ok = v["status"]["phase"] == "Running"
            && v["status"]["interfaces"][0]["ipAddress"].is_string();
        Ok(ok.then_some(v))
    })?;
    let uid = v["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let ip = v["status"]["interfaces"][0]["ipAddress"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let mac = v["status"]["interfaces"][0]["mac"].clone();
    assert_eq!(v["status"]["nodeName"], "node1");
    assert!(ip.starts_with("10.244.200."), "{ip} not in {A_CIDR}");
    // node2's namespace for the VMI has another name (both nodes share /run/netns).
    let _guards = [
        Netns::guard(&format!("fv-{uid}")),
        Netns::guard(&format!("fv-{uid}-{}", node_b.name())),
    ];
    let src = c.agent_dir().join("vmis").join(&uid);
    let dst = c.extra_agent_dir("node2").join("vmis").join(&uid);
    c.wait_until("the guest ready", BOOT, || {
        let log = std::fs::read(src.join("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    c.wait_until("LiveMigratable=True", Duration::from_secs(30), || {
        let v = c.get_json(&["vmi", "tcp"])?;
        Ok(v["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "LiveMigratable" && c["status"] == "True")
            .then_some(()))
    })?;

    // The echo service in the guest, one connection to it from node1's namespace.
    let console = SerialConsole::connect(&src.join("serial.sock"), Duration::from_secs(10))?;
    let (out, rc) = console.exec(
        &format!("nc -l -p {PORT} -e cat </dev/null >/dev/null 2>&1 &"),
        Duration::from_secs(20),
    )?;
    assert_eq!(rc, 0, "{out}");
    let before = uptime(&console)?;
    drop(console);
    let mut client = Client::start(&node_a, &ip)?;
    let hello = client.line()?;
    assert!(hello.starts_with("CONNECTED "), "{hello}");
    assert_eq!(
        client.round_trip("before-migration")?,
        "GOT before-migration"
    );

    // A ping every 20 ms from node1 while the VMI moves.
    let mut ping = Command::new("ip")
        .args([
            "netns",
            "exec",
            node_a.name(),
            "python3",
            "-u",
            "-c",
            PINGER,
            &ip,
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;

    c.apply(MIGRATION)?;
    let m = c.wait_until("the migration finished", MIGRATE, || {
        let v = c.get_json(&["vmim", "tcp-mig"])?;
        let phase = v["status"]["phase"].as_str().unwrap_or_default();
        Ok(matches!(phase, "Succeeded" | "Failed").then_some(v))
    })?;
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);

    // The same connection carries another line both ways.
    let t0 = Instant::now();
    assert_eq!(client.round_trip("after-migration")?, "GOT after-migration");
    let echo_after = t0.elapsed();

    // The VMI runs on node2 with the same address and MAC; no reboot.
    let v = c.wait_until("the VMI Running on node2", Duration::from_secs(30), || {
        let v = c.get_json(&["vmi", "tcp"])?;
        Ok((v["status"]["phase"] == "Running" && v["status"]["nodeName"] == "node2").then_some(v))
    })?;
    assert_eq!(v["metadata"]["uid"], uid.as_str());
    assert_eq!(v["status"]["interfaces"][0]["ipAddress"], ip.as_str());
    assert_eq!(v["status"]["interfaces"][0]["mac"], mac);
    let console = SerialConsole::connect(&dst.join("serial.sock"), Duration::from_secs(10))?;
    let after = uptime(&console)?;
    assert!(
        after > before,
        "the guest did not reboot: uptime {before} s before, {after} s after"
    );
    // How the address is reached now: node2 publishes it, node1 routes it through the
    // overlay to node2's .0, node2 to its bridge.
    let b_gw = B_CIDR.replace(".0/24", ".0");
    let routes = c.wait_until("the /32 routes", Duration::from_secs(30), || {
        let n2 = c.get_json(&["node", "node2"])?;
        let claim = n2["metadata"]["annotations"]["ferrovirt.io/pod-routes"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let a = node_a.ip(&["route", "show", &ip])?;
        let b = node_b.ip(&["route", "show", &ip])?;
        Ok(
            (claim.contains(&ip) && a.contains("fv-vx0") && b.contains("fv-br0"))
                .then_some((claim, a, b)),
        )
    })?;
    assert!(
        routes.1.contains(&format!("via {b_gw} dev fv-vx0")),
        "{routes:?}"
    );
    // One more line, after the routes are confirmed.
    assert_eq!(client.round_trip("still-open")?, "GOT still-open");

    drop(ping.stdin.take());
    let out = ping.wait_with_output()?;
    let out = String::from_utf8_lossy(&out.stdout);
    let (gap, replies) = out.trim().split_once(' ').unwrap_or(("?", "?"));
    eprintln!(
        "pings answered: {replies}; longest silence across the migration: {gap} ms; \
         echo after the migration took {echo_after:?}; whole test {:?}",
        started.elapsed()
    );
    for l in c
        .kubectl_ok(&["get", "events", "-n", "default"])?
        .lines()
        .filter(|l| l.contains("downtime"))
    {
        eprintln!("{l}");
    }
    // When each side moved the routes (for the figures in docs/migration.md).
    for (who, log) in [("node1", c.server_log()), ("node2", c.agent_log("node2"))] {
        for l in log.lines().filter(|l| {
            l.contains("pod routes") || l.contains("Migrated to") || l.contains("target ready")
        }) {
            eprintln!("{who}: {l}");
        }
    }
    drop(client);
    c.kubectl_ok(&["delete", "vmi", "tcp", "--timeout=120s"])?;
    // The claim goes with the VMI.
    c.wait_until("node2's claim withdrawn", Duration::from_secs(60), || {
        let n2: Value = c.get_json(&["node", "node2"])?;
        let a = node_a.ip(&["route", "show", &ip])?;
        Ok(
            (n2["metadata"]["annotations"]["ferrovirt.io/pod-routes"].is_null()
                && !a.contains("fv-vx0"))
            .then_some(()),
        )
    })?;
    Ok(())
}
