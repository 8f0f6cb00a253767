//! `port-forward TYPE/NAME[.NAMESPACE] [LOCAL:]REMOTE…` (virtctl's form): local TCP ports
//! whose connections each open a `portforward` websocket to the VM's guest port, or with
//! `--stdio` one connection on stdin/stdout (what `ssh` uses as its ProxyCommand; the end of
//! stdin does not end the connection, the remote side's close does).

use std::net::IpAddr;

use crate::error::CliError;
use crate::target::Target;
use crate::wsio::bridge;

/// What a port forward points at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardTarget {
    /// `virtualmachines` or `virtualmachineinstances`.
    pub plural: &'static str,
    pub name: String,
    /// From a `.NAMESPACE` suffix; `None`: the session's namespace.
    pub namespace: Option<String>,
}

impl ForwardTarget {
    /// Parses `vm/NAME`, `vmi/NAME` (also the long names), with an optional `.NAMESPACE`
    /// suffix as virtctl reads it (so a name itself cannot contain a dot here).
    pub fn parse(s: &str) -> Result<ForwardTarget, CliError> {
        let usage = || {
            CliError::Usage(format!(
                "invalid target {s:?}: expected vm/NAME[.NAMESPACE] or vmi/NAME[.NAMESPACE]"
            ))
        };
        let (kind, rest) = s.split_once('/').ok_or_else(usage)?;
        let plural = match kind {
            "vm" | "vms" | "virtualmachine" | "virtualmachines" => "virtualmachines",
            "vmi" | "vmis" | "virtualmachineinstance" | "virtualmachineinstances" => {
                "virtualmachineinstances"
            }
            _ => return Err(usage()),
        };
        let (name, namespace) = match rest.split_once('.') {
            Some((n, ns)) => (n, Some(ns.to_string())),
            None => (rest, None),
        };
        if name.is_empty() || namespace.as_deref() == Some("") {
            return Err(usage());
        }
        Ok(ForwardTarget {
            plural,
            name: name.to_string(),
            namespace,
        })
    }

    /// The namespace to use, given the session's.
    pub fn namespace_or<'a>(&'a self, default: &'a str) -> &'a str {
        self.namespace.as_deref().unwrap_or(default)
    }
}

/// One forwarded port: local → remote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortPair {
    /// 0: any free port.
    pub local: u16,
    pub remote: u16,
}

/// Parses `PORT`, `LOCAL:REMOTE` or `:REMOTE` (any free local port), with an optional
/// `/tcp` suffix.
pub fn parse_port(spec: &str) -> Result<PortPair, CliError> {
    let bad = |why: &str| CliError::Usage(format!("invalid port {spec:?}: {why}"));
    let spec_ports = match spec.rsplit_once('/') {
        Some((p, proto)) if proto.eq_ignore_ascii_case("tcp") => p,
        Some((_, proto)) => return Err(bad(&format!("protocol {proto} is not supported"))),
        None => spec,
    };
    let num = |s: &str| -> Result<u16, CliError> {
        s.parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| bad("ports are 1-65535"))
    };
    match spec_ports.split_once(':') {
        Some(("", r)) => Ok(PortPair {
            local: 0,
            remote: num(r)?,
        }),
        Some((l, r)) => Ok(PortPair {
            local: num(l)?,
            remote: num(r)?,
        }),
        None => {
            let p = num(spec_ports)?;
            Ok(PortPair {
                local: p,
                remote: p,
            })
        }
    }
}

/// The websocket path of a port forward.
pub fn path(t: &ForwardTarget, namespace: &str, port: u16) -> String {
    format!(
        "/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/{}/{}/portforward/{port}",
        t.plural, t.name
    )
}

/// Listens on `address` for each pair and forwards every connection until interrupted. The
/// "Forwarding from …" lines are printed once all listeners are up.
pub async fn run(
    target: &Target,
    fwd: &ForwardTarget,
    ports: &[PortPair],
    address: IpAddr,
) -> Result<(), CliError> {
    if ports.is_empty() {
        return Err(CliError::Usage(
            "port-forward needs at least one port".into(),
        ));
    }
    let ns = fwd.namespace_or(&target.namespace).to_string();
    let mut tasks = tokio::task::JoinSet::new();
    for p in ports {
        let listener = tokio::net::TcpListener::bind((address, p.local))
            .await
            .map_err(|e| CliError::io(format!("listening on {address}:{}", p.local), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| CliError::io("local address", e))?;
        println!("Forwarding from {local} -> {}", p.remote);
        let path = path(fwd, &ns, p.remote);
        let target = target.clone();
        tasks.spawn(async move {
            loop {
                let (conn, peer) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => return Err(CliError::io("accepting a connection", e)),
                };
                let target = target.clone();
                let path = path.clone();
                tokio::spawn(async move {
                    let r = match target.websocket(&path).await {
                        Ok(ws) => bridge(ws, conn).await,
                        Err(e) => Err(e),
                    };
                    if let Err(e) = r {
                        eprintln!("connection from {peer}: {e}");
                    }
                });
            }
        });
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
    match tasks.join_next().await {
        Some(Ok(r)) => r,
        Some(Err(e)) => Err(CliError::Transport(e.to_string())),
        None => Ok(()),
    }
}

/// One connection to `port` carried over stdin and stdout.
pub async fn stdio(target: &Target, fwd: &ForwardTarget, port: u16) -> Result<(), CliError> {
    let ns = fwd.namespace_or(&target.namespace).to_string();
    let ws = target.websocket(&path(fwd, &ns, port)).await?;
    let mut rx = crate::wsio::stdin_chunks(64 * 1024);
    let (local, far) = tokio::io::duplex(64 * 1024);
    let (mut local_r, mut local_w) = tokio::io::split(local);
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        while let Some(chunk) = rx.recv().await {
            if local_w.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = local_w.shutdown().await;
    });
    let out = tokio::spawn(async move {
        let mut stdout = tokio::io::stdout();
        let _ = tokio::io::copy(&mut local_r, &mut stdout).await;
        use tokio::io::AsyncWriteExt;
        let _ = stdout.flush().await;
    });
    let r = crate::wsio::bridge_with(ws, far, crate::wsio::OnLocalEof::Drain).await;
    let _ = out.await;
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::{SinkExt, StreamExt};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_tungstenite::tungstenite::Message;

    #[test]
    fn targets() {
        let t = ForwardTarget::parse("vm/web").unwrap();
        assert_eq!((t.plural, t.name.as_str()), ("virtualmachines", "web"));
        assert_eq!(t.namespace_or("default"), "default");
        let t = ForwardTarget::parse("vmi/web.prod").unwrap();
        assert_eq!(t.plural, "virtualmachineinstances");
        assert_eq!(t.namespace.as_deref(), Some("prod"));
        assert_eq!(
            path(&t, "prod", 80),
            "/apis/subresources.kubevirt.io/v1/namespaces/prod/virtualmachineinstances/web/portforward/80"
        );
        for bad in ["web", "pod/web", "vm/", "vm/web."] {
            assert!(ForwardTarget::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ports() {
        let pp = |l, r| PortPair {
            local: l,
            remote: r,
        };
        assert_eq!(parse_port("80").unwrap(), pp(80, 80));
        assert_eq!(parse_port("8080:80").unwrap(), pp(8080, 80));
        assert_eq!(parse_port(":22").unwrap(), pp(0, 22));
        assert_eq!(parse_port("8080:80/tcp").unwrap(), pp(8080, 80));
        assert!(
            parse_port("53/udp")
                .unwrap_err()
                .to_string()
                .contains("udp")
        );
        assert!(parse_port("0").is_err());
        assert!(parse_port("a:80").is_err());
        assert!(parse_port("70000").is_err());
    }

    #[tokio::test]
    async fn bridge_copies_both_ways() {
        // A websocket pair over an in-memory pipe, bridged to a second pipe.
        let (client_io, server_io) = tokio::io::duplex(4096);
        let server = tokio::spawn(async move {
            let mut ws = tokio_tungstenite::accept_async(server_io).await.unwrap();
            ws.send(Message::Binary(bytes::Bytes::from_static(b"hello")))
                .await
                .unwrap();
            let got = ws.next().await.unwrap().unwrap();
            assert_eq!(got.into_data().as_ref(), b"world");
        });
        let (ws, _) = tokio_tungstenite::client_async("ws://x/", client_io)
            .await
            .unwrap();
        let (mut local, far) = tokio::io::duplex(4096);
        let b = tokio::spawn(bridge(ws, far));
        let mut buf = [0u8; 5];
        local.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"hello");
        local.write_all(b"world").await.unwrap();
        server.await.unwrap();
        drop(local);
        let _ = b.await;
    }
}
