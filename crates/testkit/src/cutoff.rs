//! A node that can be cut off from the API server: a network namespace of its own joined to
//! the host by a veth pair the test makes, where an agent started inside (`ip netns exec`)
//! reaches the server's loopback port through two small TCP relays (one in the namespace on
//! its loopback, one in the test process on the host end of the veth). Setting the veth down
//! ([`CutOffNode::cut`]) silences the agent's connections without closing them, as a pulled
//! cable would. Needs root; talks only to loopback and the addresses it created.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};

use anyhow::Context;

use crate::netns::{Netns, sh, token};

/// The relay inside the namespace: 127.0.0.1:PORT → HOST:PORT (Python's standard library).
const NS_RELAY: &str = r#"
import socket, sys, threading
port, dst = int(sys.argv[1]), sys.argv[2]
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port))
s.listen(64)
def pipe(a, b):
    try:
        while True:
            d = a.recv(65536)
            if not d:
                break
            b.sendall(d)
    except OSError:
        pass
    finally:
        try:
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass
print("ready", flush=True)
while True:
    c, _ = s.accept()
    try:
        u = socket.create_connection((dst, port), timeout=5)
        u.settimeout(None)
    except OSError:
        c.close()
        continue
    threading.Thread(target=pipe, args=(c, u), daemon=True).start()
    threading.Thread(target=pipe, args=(u, c), daemon=True).start()
"#;

/// A namespace for one node with a relayed path to the API server.
#[derive(Debug)]
pub struct CutOffNode {
    relay: Child,
    host_ip: String,
    host_if: String,
    ns_if: String,
    // Dropped last: deleting the namespace removes both veth ends.
    ns: Netns,
}

fn pipe(mut a: TcpStream, mut b: TcpStream) {
    let mut buf = vec![0u8; 65536];
    loop {
        match a.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if b.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = b.shutdown(Shutdown::Write);
}

impl CutOffNode {
    /// Makes the namespace and the relays for the API server on `127.0.0.1:api_port`.
    pub fn new(api_port: u16) -> anyhow::Result<CutOffNode> {
        Self::with_index(api_port, None)
    }

    /// Like [`new`](Self::new); several of one test process differ by `index` (0..=9) in
    /// their names and /30 subnets.
    pub fn with_index(api_port: u16, index: Option<u8>) -> anyhow::Result<CutOffNode> {
        let t = token();
        let (sfx, i) = match index {
            Some(i) => (i.to_string(), u32::from(i.min(9)) + 1),
            None => (String::new(), 0),
        };
        let ns = Netns::new(&format!("fv-cut-{t}{sfx}"))?;
        let (host_if, ns_if) = (format!("fvch{t}{sfx}"), format!("fvcn{t}{sfx}"));
        let octet = std::process::id() % 200 + 20;
        let (host_ip, ns_ip) = (
            format!("10.253.{octet}.{}", 4 * i + 1),
            format!("10.253.{octet}.{}", 4 * i + 2),
        );
        let _ = Command::new("ip").args(["link", "del", &host_if]).status();
        sh(&[
            "ip",
            "link",
            "add",
            &host_if,
            "type",
            "veth",
            "peer",
            "name",
            &ns_if,
            "netns",
            ns.name(),
        ])?;
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("{host_ip}/30"),
            "dev",
            &host_if,
        ])?;
        sh(&["ip", "link", "set", &host_if, "up"])?;
        ns.ip(&["addr", "add", &format!("{ns_ip}/30"), "dev", &ns_if])?;
        ns.ip(&["link", "set", &ns_if, "up"])?;
        // Host end: HOST_IP:PORT → 127.0.0.1:PORT. The thread ends with the veth.
        let listener = TcpListener::bind((host_ip.as_str(), api_port))
            .with_context(|| format!("binding {host_ip}:{api_port}"))?;
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(down) = conn else { break };
                let Ok(up) = TcpStream::connect(("127.0.0.1", api_port)) else {
                    continue;
                };
                let (d2, u2) = match (down.try_clone(), up.try_clone()) {
                    (Ok(d), Ok(u)) => (d, u),
                    _ => continue,
                };
                std::thread::spawn(move || pipe(down, up));
                std::thread::spawn(move || pipe(u2, d2));
            }
        });
        let mut relay = Command::new("ip")
            .args(["netns", "exec", ns.name(), "python3", "-c", NS_RELAY])
            .arg(api_port.to_string())
            .arg(&host_ip)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the namespace's relay (python3)")?;
        let mut ready = [0u8; 5];
        relay
            .stdout
            .as_mut()
            .context("relay stdout")?
            .read_exact(&mut ready)
            .context("the namespace's relay did not start")?;
        Ok(CutOffNode {
            relay,
            host_ip,
            host_if,
            ns_if,
            ns,
        })
    }

    /// The command prefix that runs a program inside the namespace.
    pub fn prefix(&self) -> Vec<String> {
        vec![
            "ip".into(),
            "netns".into(),
            "exec".into(),
            self.ns.name().to_string(),
        ]
    }

    /// The node's namespace.
    pub fn netns(&self) -> &Netns {
        &self.ns
    }

    /// The host end's address: where the node's API traffic goes.
    pub fn host_ip(&self) -> &str {
        &self.host_ip
    }

    /// The node's end of the veth that carries its API traffic (its "uplink").
    pub fn uplink(&self) -> &str {
        &self.ns_if
    }

    /// Cuts the node off: its end of the veth goes down, nothing passes any more.
    pub fn cut(&self) -> anyhow::Result<()> {
        self.ns.ip(&["link", "set", &self.ns_if, "down"])?;
        Ok(())
    }
}

impl Drop for CutOffNode {
    fn drop(&mut self) {
        let _ = self.relay.kill();
        let _ = self.relay.wait();
        // Both ends go with it (the namespace may outlive its name while processes in it
        // are being killed).
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .status();
    }
}
