//! Test lab for the end-to-end network tests: a throwaway "node" namespace with an uplink veth
//! to a throwaway "outside" namespace (all names carry a per-test random token, everything is
//! removed on drop), test guests booted with QEMU inside VMI namespaces, and small HTTP
//! helpers that run inside a namespace. Fails (never skips) when not root or tools are missing.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferrovirt_network::{Ipam, MacAddr, NodeNetwork, netns};
use ferrovirt_testkit::qemu::{Accel, BootSource, QemuVmOptions, qemu_args};
use ferrovirt_testkit::{SerialConsole, TestGuest};

/// Guests are expensive under TCG: one test with guests at a time (at most two guests).
pub static GUEST_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

pub const NODE_UPLINK_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
pub const PEER_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);

fn token() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in format!(
        "{}-{nanos}-{:?}",
        std::process::id(),
        std::thread::current().id()
    )
    .bytes()
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")[..6].to_string()
}

fn sh(argv: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .with_context(|| format!("running {argv:?}"))?;
    if !out.status.success() {
        bail!(
            "{argv:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A node namespace with an uplink to an outside namespace.
pub struct Lab {
    pub token: String,
    pub node_ns: String,
    pub out_ns: String,
    pub node: NodeNetwork,
}

impl Lab {
    /// Creates the namespaces and the node's pod network (subnet `node_index` of 10.244/16).
    pub async fn new(node_index: u32) -> anyhow::Result<Lab> {
        ferrovirt_network::apply::preflight()
            .await
            .context("the end-to-end network tests need root, `ip` and `nft`")?;
        let token = token();
        let lab = Lab {
            node_ns: format!("fvt{token}-node"),
            out_ns: format!("fvt{token}-out"),
            node: {
                let ipam = Ipam::default();
                let mut n = NodeNetwork::new(ipam, ipam.node_subnet(node_index)?);
                n.netns = Some(format!("fvt{token}-node"));
                n.uplink = Some("uplink0".into());
                n.nft_table = format!("ferrovirt-{token}");
                n.netns_prefix = format!("fvt{token}-vmi-");
                n
            },
            token,
        };
        // From here on, Drop cleans up whatever was made.
        let (node, out) = (lab.node_ns.as_str(), lab.out_ns.as_str());
        sh(&["ip", "netns", "add", node])?;
        sh(&["ip", "netns", "add", out])?;
        sh(&[
            "ip", "-n", node, "link", "add", "uplink0", "type", "veth", "peer", "name", "eth0",
            "netns", out,
        ])?;
        let node_addr = format!("{NODE_UPLINK_ADDR}/24");
        let peer_addr = format!("{PEER_ADDR}/24");
        for cmd in [
            vec!["ip", "-n", node, "link", "set", "lo", "up"],
            vec!["ip", "-n", out, "link", "set", "lo", "up"],
            vec![
                "ip", "-n", node, "addr", "add", &node_addr, "dev", "uplink0",
            ],
            vec!["ip", "-n", out, "addr", "add", &peer_addr, "dev", "eth0"],
            vec!["ip", "-n", node, "link", "set", "uplink0", "up"],
            vec!["ip", "-n", out, "link", "set", "eth0", "up"],
        ] {
            sh(&cmd)?;
        }
        ferrovirt_network::setup_node(&lab.node).await?;
        Ok(lab)
    }

    /// Every namespace of this lab that still exists.
    pub fn namespaces(&self) -> Vec<String> {
        let prefix = format!("fvt{}-", self.token);
        std::fs::read_dir(netns::NETNS_DIR)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter_map(|e| e.file_name().into_string().ok())
                    .filter(|n| n.starts_with(&prefix))
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in self.namespaces() {
            let _ = Command::new("ip").args(["netns", "del", &ns]).status();
        }
    }
}

/// A test guest booted by QEMU inside a VMI namespace, on a tap.
pub struct Guest {
    child: Child,
    _dir: tempfile::TempDir,
    pub console: SerialConsole,
}

impl Guest {
    pub fn boot(netns: &str, tap: &str, mac: MacAddr) -> anyhow::Result<Guest> {
        let g = TestGuest::get()?;
        let dir = tempfile::Builder::new().prefix("fv-net-").tempdir()?;
        let mut opts = QemuVmOptions::new(BootSource::guest_kernel(&g));
        opts.accel = Some(Accel::Tcg);
        opts.memory_mib = 192;
        opts.extra_args = vec![
            "-netdev".into(),
            format!("tap,id=n0,ifname={tap},script=no,downscript=no"),
            "-device".into(),
            format!("virtio-net-pci,netdev=n0,mac={mac}"),
        ];
        let args = qemu_args(&opts, dir.path(), None);
        let log = std::fs::File::create(dir.path().join("qemu.log"))?;
        // The way the agent starts launchers: only the network namespace changes.
        let prefix = netns::exec_prefix(netns);
        let child = Command::new(&prefix[0])
            .args(&prefix[1..])
            .arg("qemu-system-x86_64")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting QEMU in the VMI namespace")?;
        let console =
            SerialConsole::connect(&dir.path().join("serial.sock"), Duration::from_secs(20))
                .with_context(|| {
                    std::fs::read_to_string(dir.path().join("qemu.log")).unwrap_or_default()
                })?;
        Ok(Guest {
            child,
            _dir: dir,
            console,
        })
    }

    /// Boots the guest the way the agent's launcher would: the argv from
    /// `ferrovirt_launcher::qemu_command` for a spec with a `NicBackend::Tap`, QEMU's seccomp
    /// sandbox and `-runas` the unprivileged QEMU user (when it exists), started paused so no
    /// console output is lost, then resumed over QMP.
    pub fn boot_like_the_agent(attached: &ferrovirt_network::Attached) -> anyhow::Result<Guest> {
        use ferrovirt_launcher::spec::{KernelBoot, Nic, NicBackend, NicModel};
        let g = TestGuest::get()?;
        let dir = tempfile::Builder::new().prefix("fv-net-").tempdir()?;
        let mut spec = ferrovirt_launcher::LaunchSpec::new(
            "agent-path",
            "6b1e9b57-2a4e-4b7c-9e0b-00000000a9e7",
            192,
            dir.path().join("qmp.sock"),
        );
        spec.kernel_boot = Some(KernelBoot {
            kernel: g.kernel.clone(),
            initrd: Some(g.initrd.clone()),
            cmdline: Some(g.cmdline.clone()),
        });
        spec.nics.push(Nic {
            id: "net0".into(),
            mac: Some(attached.mac.to_string()),
            model: NicModel::VirtioNetPci,
            backend: NicBackend::Tap {
                ifname: attached.tap.clone(),
                queues: 1,
            },
            boot_order: None,
        });
        spec.sockets.serial = Some(dir.path().join("serial.sock"));
        spec.tcg_tb_size_mib = Some(64);
        spec.sandbox = true;
        spec.start_paused = true;
        if sh(&["id", "-u", "ferrovirt-qemu"]).is_ok() {
            spec.run_as = Some("ferrovirt-qemu".into());
        }
        spec.validate()?;
        let log = std::fs::File::create(dir.path().join("qemu.log"))?;
        let prefix = attached.exec_prefix();
        let child = Command::new(&prefix[0])
            .args(&prefix[1..])
            .arg("qemu-system-x86_64")
            .args(ferrovirt_launcher::qemu_command(&spec))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting QEMU in the VMI namespace")?;
        let qemu_log = dir.path().join("qemu.log");
        let console =
            SerialConsole::connect(&dir.path().join("serial.sock"), Duration::from_secs(20))
                .with_context(|| std::fs::read_to_string(&qemu_log).unwrap_or_default())?;
        let mut qmp = ferrovirt_testkit::QmpClient::connect(
            &dir.path().join("qmp.sock"),
            Duration::from_secs(20),
        )?;
        qmp.execute("cont", serde_json::json!({}))?;
        Ok(Guest {
            child,
            _dir: dir,
            console,
        })
    }

    /// Waits until the transcript holds a line containing `pattern` (order-independent).
    pub fn wait_line(&self, pattern: &str, timeout: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let t = self.console.transcript();
            if let Some(l) = t.lines().find(|l| l.contains(pattern)) {
                return Ok(l.to_string());
            }
            if Instant::now() > deadline {
                bail!("no line with {pattern:?} within {timeout:?}; transcript:\n{t}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Runs a shell command in the guest; fails on a non-zero exit status.
    pub fn exec_ok(&self, cmd: &str) -> anyhow::Result<String> {
        let (out, rc) = self.console.exec(cmd, Duration::from_secs(30))?;
        if rc != 0 {
            bail!("guest command {cmd:?} exited {rc}: {out}");
        }
        Ok(out)
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.0 GET from inside `ns`, retried until `timeout`; returns the body.
pub fn http_get_in(
    ns: &str,
    addr: Ipv4Addr,
    port: u16,
    timeout: Duration,
) -> anyhow::Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        let attempt = netns::run_in(Some(ns), move || -> anyhow::Result<String> {
            let mut s = TcpStream::connect_timeout(
                &SocketAddr::from((addr, port)),
                Duration::from_secs(3),
            )?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            s.write_all(b"GET / HTTP/1.0\r\nHost: guest\r\n\r\n")?;
            let mut resp = String::new();
            s.read_to_string(&mut resp)?;
            let (head, body) = resp
                .split_once("\r\n\r\n")
                .ok_or_else(|| anyhow::anyhow!("no HTTP response: {resp:?}"))?;
            if !head.contains(" 200") {
                bail!("HTTP error: {head}");
            }
            Ok(body.to_string())
        })?;
        match attempt {
            Ok(b) => return Ok(b),
            Err(e) if Instant::now() > deadline => {
                return Err(e.context(format!("GET http://{addr}:{port}/ from netns {ns}")));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(300)),
        }
    }
}

/// Whether a TCP connection from `ns` to addr:port is refused or times out.
pub fn tcp_connects_in(ns: &str, addr: Ipv4Addr, port: u16) -> anyhow::Result<bool> {
    Ok(netns::run_in(Some(ns), move || {
        TcpStream::connect_timeout(&SocketAddr::from((addr, port)), Duration::from_secs(2)).is_ok()
    })?)
}

/// An HTTP server in namespace `ns` answering `peer=<client address>`; records its clients.
pub struct PeerServer {
    pub port: u16,
    pub clients: Arc<Mutex<Vec<IpAddr>>>,
}

impl PeerServer {
    pub fn start(ns: &str, addr: Ipv4Addr, port: u16) -> anyhow::Result<PeerServer> {
        let listener = netns::run_in(Some(ns), move || TcpListener::bind((addr, port)))??;
        let clients: Arc<Mutex<Vec<IpAddr>>> = Arc::default();
        let seen = clients.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut s) = conn else { continue };
                let Ok(peer) = s.peer_addr() else { continue };
                seen.lock().unwrap().push(peer.ip());
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
                    "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        Ok(PeerServer { port, clients })
    }

    pub fn clients(&self) -> Vec<IpAddr> {
        self.clients.lock().unwrap().clone()
    }
}

/// `ip -n NS -br link` (for assertions and diagnostics).
pub fn links_in(ns: &str) -> String {
    sh(&["ip", "-n", ns, "-br", "link"]).unwrap_or_default()
}

/// `nft list ruleset` inside `ns`.
pub fn nft_ruleset_in(ns: &str) -> String {
    sh(&["ip", "netns", "exec", ns, "nft", "list", "ruleset"]).unwrap_or_default()
}

/// A uniquely named namespace, deleted on drop.
pub struct TempNetns(pub String);

impl TempNetns {
    pub fn new(role: &str) -> anyhow::Result<TempNetns> {
        let name = format!("fvt{}-{role}", token());
        sh(&["ip", "netns", "add", &name])?;
        Ok(TempNetns(name))
    }
}

impl Drop for TempNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// Runs `ip ARGS…` and fails with its stderr.
pub fn ip(args: &[&str]) -> anyhow::Result<String> {
    let mut v = vec!["ip"];
    v.extend_from_slice(args);
    sh(&v)
}
