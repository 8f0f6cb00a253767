//! A guest on the pod network (`--network-mode pod` with the test's own `--node-netns` and an
//! uplink to an "outside" namespace) attacks its node (issue #13), once with the masquerade
//! and once with the bridge binding. The test opens listeners where a node keeps its
//! services: in the node namespace dual-stack on all addresses at the API server's and the
//! agent endpoint's ports (a server bound to `::` on the node), on 127.0.0.1 (a
//! loopback-published service), on the uplink address and on the node bridge's gateway
//! address, plus a UDP socket; in the VMI's own namespace (10.0.2.1 and the VMI address, or
//! the bridge binding's DHCP address 169.254.75.10) a dual-stack listener, a loopback one and
//! a UDP socket; beyond the uplink a "metadata service" on 169.254.169.254:80. From the serial
//! console the guest (given an IPv6 link-local address) connects to each through every node
//! address (fv-br0's gateway, the uplink address, the namespace's own, 10.0.2.3,
//! 169.254.169.254, the IPv6 link-local addresses of `k6t-eth0` and, on the bridge binding,
//! of `fv-br0`) and sends UDP: every attempt fails in the guest and no listener sees a
//! connection or a datagram. Positive control: the guest's HTTP to a server in the outside
//! namespace works (through the NAT, the server sees the uplink address). Without the `ip6`
//! input filters and the link-local forward drop the metadata service and the IPv6
//! listeners were reachable. Compare `user_net_isolation.rs` for user networking.

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferrovirt_network::netns::run_in;
use ferrovirt_testkit::netns::{Netns, token, veth};
use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest};

const BOOT: Duration = Duration::from_secs(180);
const UPLINK_ADDR: &str = "198.18.0.1";
const OUTSIDE_ADDR: &str = "198.18.0.2";
const METADATA_ADDR: &str = "169.254.169.254";

/// The attacking VMI, with the masquerade or the bridge binding.
fn vmi(name: &str, binding: &str) -> String {
    format!(
        r##"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: {name}, namespace: default}}
spec:
  domain:
    memory: {{guest: 128Mi}}
    devices:
      disks:
      - {{name: root, disk: {{bus: virtio}}}}
      interfaces:
      - {{name: default, {binding}: {{}}}}
  networks:
  - {{name: default, pod: {{}}}}
  volumes:
  - {{name: root, persistentVolumeClaim: {{claimName: {name}-root}}}}
"##
    )
}

/// The two tests boot one guest each; one at a time keeps nc's timeouts honest under TCG.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Sockets that must never see a connection or a datagram, by what they stand for.
#[derive(Default)]
struct Traps {
    tcp: Vec<(String, TcpListener)>,
    udp: Vec<(String, UdpSocket)>,
}

impl Traps {
    /// A TCP listener on `addr` inside namespace `ns`; returns its port.
    fn tcp(&mut self, what: &str, ns: &str, addr: SocketAddr) -> anyhow::Result<u16> {
        let l = run_in(Some(ns), move || TcpListener::bind(addr))??;
        l.set_nonblocking(true)?;
        let port = l.local_addr()?.port();
        self.tcp.push((format!("{what} ({ns} {addr})"), l));
        Ok(port)
    }

    /// A UDP socket on `addr` inside namespace `ns`; returns its port.
    fn udp(&mut self, what: &str, ns: &str, addr: SocketAddr) -> anyhow::Result<u16> {
        let s = run_in(Some(ns), move || UdpSocket::bind(addr))??;
        s.set_nonblocking(true)?;
        let port = s.local_addr()?.port();
        self.udp.push((format!("{what} ({ns} {addr})"), s));
        Ok(port)
    }

    /// Fails naming every socket that saw a connection or a datagram.
    fn assert_untouched(&self) -> anyhow::Result<()> {
        let mut hits = Vec::new();
        for (what, l) in &self.tcp {
            match l.accept() {
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Ok((_, peer)) => hits.push(format!("{what}: connection from {peer}")),
                Err(e) => return Err(e.into()),
            }
        }
        let mut buf = [0u8; 256];
        for (what, s) in &self.udp {
            match s.recv_from(&mut buf) {
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Ok((n, peer)) => hits.push(format!("{what}: {n} bytes from {peer}")),
                Err(e) => return Err(e.into()),
            }
        }
        assert!(hits.is_empty(), "the guest reached the node: {hits:#?}");
        Ok(())
    }
}

/// An HTTP server on `addr` in `ns` answering `peer=<client address>`.
fn peer_server(ns: &str, addr: SocketAddr) -> anyhow::Result<Arc<Mutex<Vec<SocketAddr>>>> {
    let listener = run_in(Some(ns), move || TcpListener::bind(addr))??;
    let clients: Arc<Mutex<Vec<SocketAddr>>> = Arc::default();
    let seen = clients.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { continue };
            let Ok(peer) = s.peer_addr() else { continue };
            seen.lock().map(|mut v| v.push(peer)).ok();
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let mut req = Vec::new();
            let mut buf = [0u8; 1024];
            while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => req.extend_from_slice(&buf[..n]),
                }
            }
            let body = format!("peer={}\n", peer.ip());
            let _ = write!(
                s,
                "HTTP/1.0 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    Ok(clients)
}

fn sa(addr: &str, port: u16) -> SocketAddr {
    SocketAddr::new(addr.parse().expect("address"), port)
}

/// The IPv6 link-local address of `dev` in namespace `ns`, if it has one.
fn link_local(ns: &Netns, dev: &str) -> Option<String> {
    let out = ns
        .ip(&["-o", "-6", "addr", "show", "dev", dev, "scope", "link"])
        .ok()?;
    out.split_whitespace()
        .skip_while(|w| *w != "inet6")
        .nth(1)
        .and_then(|a| a.split('/').next())
        .map(String::from)
}

#[test]
fn masquerade_guest_reaches_no_node_address() -> anyhow::Result<()> {
    attack_the_node(false)
}

/// The bridge binding puts the guest on the node bridge's own segment: the node's input filter
/// (IPv4 and IPv6, fv-br0's link-local address included) is all that stands between them.
#[test]
fn bridge_guest_reaches_no_node_address() -> anyhow::Result<()> {
    attack_the_node(true)
}

fn attack_the_node(bridge: bool) -> anyhow::Result<()> {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    TestGuest::get()?;
    let (tok, name, binding) = if bridge {
        (format!("{}b", token()), "intruder-b", "bridge")
    } else {
        (format!("{}m", token()), "intruder-m", "masquerade")
    };
    let node = Netns::new(&format!("fvni-{tok}"))?;
    let outside = Netns::new(&format!("fvno-{tok}"))?;
    let uplink = format!("fvup{tok}");
    veth(
        (&node, &uplink, Some(&format!("{UPLINK_ADDR}/24"))),
        (
            &outside,
            &format!("fvout{tok}"),
            Some(&format!("{OUTSIDE_ADDR}/24")),
        ),
    )?;
    // A cloud-style metadata service beyond the node's uplink.
    outside.ip(&["addr", "add", &format!("{METADATA_ADDR}/32"), "dev", "lo"])?;
    node.ip(&["route", "add", METADATA_ADDR, "via", OUTSIDE_ADDR])?;

    let mut opts = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
    opts.extra_args = vec![
        "--network-mode".into(),
        "pod".into(),
        "--pod-cidr".into(),
        "10.244.0.0/24".into(),
        "--node-netns".into(),
        node.name().to_string(),
        "--uplink".into(),
        uplink.clone(),
    ];
    let c = Cluster::start(&opts)?;
    let n = c.wait_until("the Node labelled pod", Duration::from_secs(60), || {
        let n = c.get_json(&["node", "node1"])?;
        Ok((n["metadata"]["labels"]["ferrovirt.io/network-mode"] == "pod").then_some(n))
    })?;
    let endpoint = n["metadata"]["annotations"]["ferrovirt.io/agent-endpoint"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let endpoint_port: u16 = endpoint
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .unwrap_or_else(|| panic!("agent endpoint URL {endpoint}"));

    c.guest_disk_claim(&format!("{name}-root"))?;
    c.apply(&vmi(name, binding))?;
    let v = c.wait_until("VMI Running with its pod address", BOOT, || {
        let v = c.get_json(&["vmi", name])?;
        let ok = v["status"]["phase"] == "Running"
            && v["status"]["interfaces"][0]["ipAddress"]
                .as_str()
                .is_some_and(|a| a.starts_with("10.244.0."));
        Ok(ok.then_some(v))
    })?;
    let vmi_addr = v["status"]["interfaces"][0]["ipAddress"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let uid = v["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let vmi_ns = Netns::guard(&format!("fv-{uid}"));
    let dir = c.agent_dir().join("vmis").join(&uid);
    c.wait_until("guest ready with a DHCP lease", BOOT, || {
        let log =
            String::from_utf8_lossy(&std::fs::read(dir.join("serial.log")).unwrap_or_default())
                .into_owned();
        Ok((log.contains("FERROVIRT-READY") && log.contains("FERROVIRT-DHCP")).then_some(()))
    })?;
    let gateway = "10.244.0.1";

    // The node's services.
    let mut traps = Traps::default();
    let node_ns = node.name().to_string();
    let api = traps.tcp("API server port, all addresses", &node_ns, sa("::", c.port))?;
    let agent = traps.tcp(
        "agent endpoint port, all addresses",
        &node_ns,
        sa("::", endpoint_port),
    )?;
    let lo = traps.tcp("loopback service", &node_ns, sa("127.0.0.1", 0))?;
    let up = traps.tcp("uplink-address service", &node_ns, sa(UPLINK_ADDR, 0))?;
    let br = traps.tcp("gateway-address service", &node_ns, sa(gateway, 0))?;
    let node_udp = traps.udp("UDP, all addresses", &node_ns, sa("0.0.0.0", 0))?;
    // The VMI namespace's own (10.0.2.1, the VMI address, IPv6 link-local).
    let vns = vmi_ns.name().to_string();
    let vany = traps.tcp("VMI namespace, all addresses", &vns, sa("::", 0))?;
    let vlo = traps.tcp("VMI namespace, loopback", &vns, sa("127.0.0.1", 0))?;
    let vudp = traps.udp("VMI namespace, UDP", &vns, sa("0.0.0.0", 0))?;
    // Beyond the uplink.
    let metadata = traps.tcp("metadata service", outside.name(), sa(METADATA_ADDR, 80))?;
    let peers = peer_server(outside.name(), sa(OUTSIDE_ADDR, 8080))?;

    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    let mut targets: Vec<(String, String)> = Vec::new();
    let ports = [
        ("API server port", api),
        ("agent endpoint port", agent),
        ("loopback service's port", lo),
        ("uplink service's port", up),
        ("gateway service's port", br),
        ("VMI namespace port", vany),
        ("VMI namespace loopback port", vlo),
    ];
    // The namespace's own address: masquerade 10.0.2.1 and the VMI address; bridge binding
    // the DHCP server's link-local 169.254.75.10 (the VMI address is the guest's own).
    let own: Vec<&str> = if bridge {
        vec!["169.254.75.10"]
    } else {
        vec!["10.0.2.1", vmi_addr.as_str()]
    };
    let addrs: Vec<&str> = [gateway, UPLINK_ADDR]
        .into_iter()
        .chain(own.clone())
        .collect();
    for addr in &addrs {
        for (what, port) in ports {
            targets.push((format!("{addr} {what}"), format!("{addr} {port}")));
        }
    }
    if !bridge {
        // Nothing holds 10.0.2.3 on the pod network (no DNS forwarder as in user networking).
        targets.push(("10.0.2.3 DNS port".into(), "10.0.2.3 53".into()));
        targets.push(("10.0.2.3 API server port".into(), format!("10.0.2.3 {api}")));
    }
    targets.push((
        "the metadata service".into(),
        format!("{METADATA_ADDR} {metadata}"),
    ));
    let mut link_locals = vec![(
        "the VMI namespace bridge's IPv6 link-local address",
        link_local(&vmi_ns, "k6t-eth0"),
        vany,
    )];
    if bridge {
        link_locals.push((
            "the node bridge's IPv6 link-local address",
            link_local(&node, "fv-br0"),
            api,
        ));
    }
    for (what, ll, port) in link_locals {
        match ll {
            Some(ll) => targets.push((what.into(), format!("{ll}%eth0 {port}"))),
            None => eprintln!("{what}: none, nothing to try"),
        }
    }
    // The test guest brings eth0 up without an IPv6 address: give it a link-local one (as
    // most guests have) so that the IPv6 attempts are real (DAD takes a moment).
    let (out, rc) = console.exec(
        "echo 0 > /proc/sys/net/ipv6/conf/eth0/disable_ipv6; \
         ip -6 addr add fe80::99/64 dev eth0 && sleep 3 && ip -6 addr show dev eth0",
        Duration::from_secs(20),
    )?;
    assert!(rc == 0 && out.contains("fe80::99/64"), "guest IPv6: {out}");
    // All attempts at once (each dropped one waits out nc's 3 s timeout); one result line each.
    // (A shell function keeps the line well under the tty's 4 KiB line limit.)
    console.exec(
        "t() { (echo hello | timeout 10 nc -w 3 $2 $3 >/dev/null 2>&1; echo FVR-$1 rc=$?) & }",
        Duration::from_secs(20),
    )?;
    let script: String = targets
        .iter()
        .enumerate()
        .map(|(i, (_, t))| format!("t {i} {t}; "))
        .collect();
    let (out, _) = console.exec(&format!("{script}wait"), Duration::from_secs(60))?;
    let mut reached = Vec::new();
    for (i, (what, target)) in targets.iter().enumerate() {
        let tag = format!("FVR-{i} rc=");
        let rc: i32 = out
            .lines()
            .find_map(|l| l.find(&tag).map(|p| l[p + tag.len()..].trim().to_string()))
            .and_then(|r| r.parse().ok())
            .unwrap_or_else(|| panic!("no result for {what} ({target}): {out}"));
        // 1: nc could not connect (refused, unreachable or timed out); 0 or 143 (killed by
        // `timeout` while connected): the guest reached it.
        if rc == 1 {
            eprintln!("guest → {target} ({what}): failed (rc {rc})");
        } else {
            reached.push(format!("{what} ({target}): rc {rc}"));
        }
    }
    assert!(reached.is_empty(), "reachable from the guest: {reached:#?}");
    let mut udp_targets = vec![
        format!("{gateway} {node_udp}"),
        format!("{UPLINK_ADDR} {node_udp}"),
    ];
    udp_targets.extend(own.iter().map(|a| format!("{a} {vudp}")));
    for target in &udp_targets {
        console.exec(
            &format!("echo hello | nc -u -w 1 {target}"),
            Duration::from_secs(20),
        )?;
    }
    std::thread::sleep(Duration::from_millis(500));
    traps.assert_untouched()?;

    // Positive control: forwarded traffic to the outside still works, through both NATs.
    let (out, rc) = console.exec(
        &format!("wget -qO- http://{OUTSIDE_ADDR}:8080/"),
        Duration::from_secs(30),
    )?;
    assert_eq!(rc, 0, "the guest reaches the outside: {out}");
    assert!(out.contains(&format!("peer={UPLINK_ADDR}")), "{out}");
    let seen = peers.lock().map(|v| v.clone()).unwrap_or_default();
    let uplink_ip: Ipv4Addr = UPLINK_ADDR.parse()?;
    assert!(
        !seen.is_empty() && seen.iter().all(|p| p.ip() == uplink_ip),
        "the outside sees only the uplink address: {seen:?}"
    );
    eprintln!(
        "{binding}: {} TCP + {} UDP attempts failed; the outside saw {seen:?}",
        targets.len(),
        udp_targets.len()
    );
    drop(console);
    c.kubectl_ok(&["delete", "vmi", name, "--timeout=120s"])?;
    Ok(())
}
