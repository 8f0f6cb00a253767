//! The async DHCP server task: one UDP socket on port 67 bound (SO_BINDTODEVICE) to one
//! interface inside a network namespace, answering one client per [`super::respond`]. It stops
//! when its [`DhcpServer`] handle is dropped.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::UdpSocket;
use tokio::task::JoinHandle;

use super::{Destination, LeaseConfig, decode, encode, respond};
use crate::error::{Error, Result};

/// Where and what to serve.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Named namespace holding `interface`; `None` for the caller's namespace.
    pub netns: Option<String>,
    /// The interface to serve on (a bridge the guest's tap is attached to).
    pub interface: String,
    pub lease: LeaseConfig,
    /// Server port (67); client port is `server_port + 1`. Other values are for tests.
    pub server_port: u16,
}

impl ServerOptions {
    pub fn new(netns: Option<String>, interface: impl Into<String>, lease: LeaseConfig) -> Self {
        ServerOptions {
            netns,
            interface: interface.into(),
            lease,
            server_port: 67,
        }
    }
}

/// A running DHCP server; dropping it stops the server.
#[derive(Debug)]
pub struct DhcpServer {
    task: JoinHandle<()>,
    interface: String,
}

fn open_socket(interface: &str, port: u16) -> std::io::Result<std::net::UdpSocket> {
    let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
    s.set_reuse_address(true)?;
    s.set_broadcast(true)?;
    s.bind_device(Some(interface.as_bytes()))?;
    s.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)).into())?;
    s.set_nonblocking(true)?;
    Ok(s.into())
}

impl DhcpServer {
    /// Binds the socket inside the namespace and starts serving on the current tokio runtime.
    pub async fn spawn(opts: ServerOptions) -> Result<DhcpServer> {
        let iface = opts.interface.clone();
        let port = opts.server_port;
        let std_sock =
            crate::netns::run_in(opts.netns.as_deref(), move || open_socket(&iface, port))?
                .map_err(|e| {
                    Error::io(
                        format!(
                            "binding DHCP socket on {} in netns {:?}",
                            opts.interface, opts.netns
                        ),
                        e,
                    )
                })?;
        let sock = UdpSocket::from_std(std_sock).map_err(|e| Error::io("registering socket", e))?;
        let lease = opts.lease.clone();
        let client_port = port.wrapping_add(1);
        let label = format!(
            "{}@{}",
            opts.interface,
            opts.netns.as_deref().unwrap_or("-")
        );
        let task = tokio::spawn(async move { serve(sock, lease, client_port, label).await });
        Ok(DhcpServer {
            task,
            interface: opts.interface,
        })
    }

    /// The interface served.
    pub fn interface(&self) -> &str {
        &self.interface
    }

    /// Whether the server task is still running.
    pub fn is_running(&self) -> bool {
        !self.task.is_finished()
    }
}

impl Drop for DhcpServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(sock: UdpSocket, lease: LeaseConfig, client_port: u16, label: String) {
    let mut buf = vec![0u8; 1500];
    loop {
        let (n, from) = match sock.recv_from(&mut buf).await {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!("dhcp {label}: receive failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        // The guest writes every byte decoded here: a parser bug must cost one packet, not the
        // server task (which a panic would end).
        let answer = std::panic::catch_unwind(|| answer(&lease, &buf[..n]));
        let (to, bytes) = match answer {
            Ok(Ok(Some((to, bytes, kinds)))) => {
                let to = match to {
                    Destination::Broadcast => SocketAddrV4::new(Ipv4Addr::BROADCAST, client_port),
                    Destination::Unicast(ip) => SocketAddrV4::new(ip, client_port),
                };
                tracing::debug!("dhcp {label}: {kinds} to {to}");
                (to, bytes)
            }
            Ok(Ok(None)) => continue,
            Ok(Err(e)) => {
                tracing::debug!("dhcp {label}: ignoring packet from {from}: {e}");
                continue;
            }
            Err(_) => {
                tracing::warn!("dhcp {label}: decoding a packet from {from} panicked; dropped");
                continue;
            }
        };
        if let Err(e) = sock.send_to(&bytes, to).await {
            tracing::warn!("dhcp {label}: sending to {to} failed: {e}");
        }
    }
}

/// Decodes one request and encodes the reply, if any: (destination, bytes, "REQ → REPLY").
fn answer(lease: &LeaseConfig, buf: &[u8]) -> Result<Option<(Destination, Vec<u8>, String)>> {
    let req = decode(buf)?;
    let Some(reply) = respond(lease, &req) else {
        return Ok(None);
    };
    let kinds = format!(
        "{:?} → {:?}",
        req.opts().msg_type(),
        reply.message.opts().msg_type()
    );
    Ok(Some((reply.to, encode(&reply.message)?, kinds)))
}
