//! A guest on the explicit user-networking fallback (`--network-mode user`, QEMU
//! `-netdev user,restrict=on`) reaches no host address (issue #13): from inside the guest the
//! test connects to 10.0.2.2 (slirp's alias for the host's loopback) on a loopback listener
//! the test opened, on the API server's port and on the agent endpoint's port, to every
//! non-loopback address of the host on a listener bound to all addresses, and sends UDP to
//! a loopback UDP socket. Every attempt fails in the guest and none of the test's sockets
//! sees a connection or a datagram. DHCP inside the guest still works (the lease is
//! 10.0.2.15); port-forward through hostfwd is covered by port_forward.rs.

use std::io::ErrorKind;
use std::net::{TcpListener, UdpSocket};
use std::time::Duration;

use ferrovirt_testkit::netns::sh;
use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest};

const BOOT: Duration = Duration::from_secs(180);

const VMI: &str = r##"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: jail, namespace: default}
spec:
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
  - {name: root, persistentVolumeClaim: {claimName: jail-root}}
"##;

/// The host's IPv4 addresses other than loopback (`ip -o -4 addr`).
fn host_addresses() -> anyhow::Result<Vec<String>> {
    let out = sh(&["ip", "-o", "-4", "addr", "show"])?;
    Ok(out
        .lines()
        .filter_map(|l| l.split_whitespace().nth(3))
        .filter_map(|a| a.split('/').next())
        .filter(|a| !a.starts_with("127."))
        .map(String::from)
        .collect())
}

#[test]
fn user_networking_guest_reaches_no_host_address() -> anyhow::Result<()> {
    TestGuest::get()?;
    let mut opts = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
    opts.extra_args = vec!["--network-mode".into(), "user".into()];
    let c = Cluster::start(&opts)?;
    let node = c.wait_until("the Node labelled", Duration::from_secs(60), || {
        let n = c.get_json(&["node", "node1"])?;
        Ok(n["metadata"]["labels"]["ferrovirt.io/network-mode"]
            .is_string()
            .then_some(n))
    })?;
    assert_eq!(
        node["metadata"]["labels"]["ferrovirt.io/network-mode"],
        "user"
    );
    assert!(
        c.server_log().contains("--network-mode user"),
        "the server logs the mode"
    );
    let endpoint = node["metadata"]["annotations"]["ferrovirt.io/agent-endpoint"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let endpoint_port: u16 = endpoint
        .rsplit(':')
        .next()
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .unwrap_or_else(|| panic!("agent endpoint URL {endpoint}"));

    // The test's own sockets: any connection or datagram on them is a failure.
    let loopback = TcpListener::bind("127.0.0.1:0")?;
    let any = TcpListener::bind("0.0.0.0:0")?;
    let udp = UdpSocket::bind("127.0.0.1:0")?;
    for l in [&loopback, &any] {
        l.set_nonblocking(true)?;
    }
    udp.set_nonblocking(true)?;
    let (lo_port, any_port, udp_port) = (
        loopback.local_addr()?.port(),
        any.local_addr()?.port(),
        udp.local_addr()?.port(),
    );

    c.guest_disk_claim("jail-root")?;
    c.apply(VMI)?;
    let v = c.wait_until("VMI Running", BOOT, || {
        let v = c.get_json(&["vmi", "jail"])?;
        Ok((v["status"]["phase"] == "Running").then_some(v))
    })?;
    let uid = v["metadata"]["uid"].as_str().unwrap_or_default();
    let dir = c.agent_dir().join("vmis").join(uid);
    let serial = c.wait_until("guest ready with a DHCP lease", BOOT, || {
        let log =
            String::from_utf8_lossy(&std::fs::read(dir.join("serial.log")).unwrap_or_default())
                .into_owned();
        Ok((log.contains("FERROVIRT-READY") && log.contains("FERROVIRT-DHCP")).then_some(log))
    })?;
    let lease = serial
        .lines()
        .find(|l| l.contains("FERROVIRT-DHCP"))
        .unwrap_or_default();
    assert!(
        lease.contains("ip=10.0.2.15/24"),
        "DHCP still works: {lease}"
    );
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;

    let mut targets = vec![
        (
            "10.0.2.2 → a loopback listener",
            format!("10.0.2.2 {lo_port}"),
        ),
        ("10.0.2.2 → the API server", format!("10.0.2.2 {}", c.port)),
        (
            "10.0.2.2 → the agent endpoint",
            format!("10.0.2.2 {endpoint_port}"),
        ),
        (
            "10.0.2.2 → a listener on all addresses",
            format!("10.0.2.2 {any_port}"),
        ),
    ];
    let addrs = host_addresses()?;
    for a in &addrs {
        targets.push(("a host address", format!("{a} {any_port}")));
        targets.push((
            "a host address → the API server port",
            format!("{a} {}", c.port),
        ));
    }
    for (what, target) in &targets {
        let (out, rc) = console.exec(
            &format!("echo hello | nc -w 3 {target}"),
            Duration::from_secs(20),
        )?;
        assert_ne!(rc, 0, "{what} ({target}) reachable from the guest: {out}");
        eprintln!(
            "guest → {target} ({what}): refused (rc {rc}) {}",
            out.trim()
        );
    }
    // UDP (slirp forwards it to the host unless restricted; its DNS at 10.0.2.3 takes the
    // same path and is dropped the same way).
    console.exec(
        &format!("echo hello | nc -u -w 1 10.0.2.2 {udp_port}"),
        Duration::from_secs(20),
    )?;
    std::thread::sleep(Duration::from_millis(500));

    for (name, l) in [("loopback", &loopback), ("all-addresses", &any)] {
        match l.accept() {
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Ok((_, peer)) => panic!("the {name} listener got a connection from {peer}"),
            Err(e) => return Err(e.into()),
        }
    }
    let mut buf = [0u8; 64];
    match udp.recv_from(&mut buf) {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        Ok((n, peer)) => panic!("the UDP socket got {n} bytes from {peer}"),
        Err(e) => return Err(e.into()),
    }
    eprintln!(
        "{} attempts refused; host addresses tried: {addrs:?}",
        targets.len() + 1
    );
    drop(console);
    c.kubectl_ok(&["delete", "vmi", "jail", "--timeout=120s"])?;
    Ok(())
}
