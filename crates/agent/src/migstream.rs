//! Setting up the live-migration stream between two agents (docs/migration.md "The stream");
//! the agents are not in the stream's data path. The source agent connects to the target
//! agent's port; that first connection is the agents' authenticated channel (mutual TLS
//! pinned to both nodes' published fingerprints, plain only with `disableTLS`), accepted only
//! from the source node's address. On it the source sends [`Hello`] (its QEMU's ephemeral
//! certificate and the local port of the data connection it is about to open); the target
//! answers [`Reply`] with its QEMU's ephemeral certificate, accepts the data connection only
//! from exactly that address and port, hands it to its launcher, and answers a second
//! [`Reply`] once its QEMU waits on it. The source then hands its end to its launcher: from
//! there the two QEMUs talk directly, with QEMU's own TLS trusting exactly the exchanged
//! certificates. A second connection (not the authenticated one re-used after a TLS close)
//! keeps the proof simple: no byte of the data connection ever passed through a TLS
//! library's buffers. The messages and the peer checks are pure.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// The longest message line accepted on the channel (a certificate is about 600 bytes).
const MAX_LINE: u64 = 64 * 1024;

/// The source's first message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hello {
    /// The source QEMU's ephemeral certificate (PEM); `None`: `disableTLS`.
    #[serde(default)]
    pub cert: Option<String>,
    /// The local port of the source's data connection.
    pub data_port: u16,
    /// A post-copy recovery's new connection (docs/migration.md "Post-copy"): no
    /// certificate, the QEMUs keep the ones of the original stream.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recover: bool,
    /// A post-copy migration's question (with `recover`): what the target's QEMU reports
    /// of the incoming migration ([`Reply::status`]); no data connection follows.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub query: bool,
}

/// The target's answers: its QEMU's certificate (first), or an error that ends the setup.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Reply {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// With `error` on a recovery: recovery cannot succeed at all (the target's QEMU is
    /// gone), so the source stops trying.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unrecoverable: bool,
    /// On a recovery or a query: the target's QEMU's `query-migrate` status (`gone`: no
    /// launcher runs), so that the source can tell a target that holds the whole guest
    /// (`completed`) from one that lost it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
}

/// Whether the hello fits the migration's settings (both agents read them from the VMI):
/// with TLS the source must send a certificate, without it none.
pub fn check_hello(hello: &Hello, tls: bool) -> Result<(), String> {
    if hello.query && !hello.recover {
        return Err("a query is asked on a recovery's channel only".into());
    }
    if hello.recover {
        return match (hello.cert.is_some(), hello.data_port) {
            (true, _) => Err("a recovery carries no certificate".into()),
            (_, _) if hello.query => Ok(()),
            (_, 0) => Err("the source announced no data port".into()),
            _ => Ok(()),
        };
    }
    match (tls, hello.cert.is_some()) {
        (true, false) => Err("the source sent no certificate for an encrypted migration".into()),
        (false, true) => Err("the source asks for TLS but disableTLS is set here".into()),
        _ if hello.data_port == 0 => Err("the source announced no data port".into()),
        _ => Ok(()),
    }
}

/// Whether an accepted connection is the data connection the source announced.
pub fn is_data_peer(peer: SocketAddr, source: IpAddr, port: u16) -> bool {
    peer.ip() == source && peer.port() == port
}

/// A byte stream the channel runs over (TLS or plain TCP).
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// The agents' channel.
pub type Channel = BufReader<Box<dyn Io>>;

/// Sends one message line.
pub async fn send<T: Serialize>(ch: &mut Channel, msg: &T) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    line.push(b'\n');
    ch.write_all(&line).await?;
    ch.flush().await
}

/// Reads one message line (at most [`MAX_LINE`] bytes).
pub async fn recv<T: DeserializeOwned>(ch: &mut Channel) -> std::io::Result<T> {
    let mut line = String::new();
    let n = (&mut *ch).take(MAX_LINE).read_line(&mut line).await?;
    if n == 0 || !line.ends_with('\n') {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the peer agent closed the migration channel",
        ));
    }
    serde_json::from_str(&line).map_err(std::io::Error::other)
}

/// Target: the authenticated channel, the first connection from `source` on `listener`
/// that completes the handshake (with `tls`: the source node's pinned client certificate).
/// Connections from other addresses, and failed handshakes, are closed and waited past.
pub async fn accept_channel(
    listener: &TcpListener,
    source: IpAddr,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> std::io::Result<Channel> {
    loop {
        let (tcp, peer) = listener.accept().await?;
        if !crate::migration::accept_peer(peer.ip(), source) {
            tracing::warn!(%peer, "migration: refused a connection not from the source node");
            continue;
        }
        let _ = tcp.set_nodelay(true);
        let io: Box<dyn Io> = match &tls {
            None => Box::new(tcp),
            Some(cfg) => match tokio_rustls::TlsAcceptor::from(cfg.clone())
                .accept(tcp)
                .await
            {
                Ok(s) => Box::new(s),
                Err(e) => {
                    tracing::warn!(%peer, "migration: TLS handshake with the source: {e}");
                    continue;
                }
            },
        };
        return Ok(BufReader::new(io));
    }
}

/// Target: the data connection, the first from exactly `source`:`port` (made
/// `TCP_NODELAY`); any other is closed.
pub async fn accept_data(
    listener: &TcpListener,
    source: IpAddr,
    port: u16,
) -> std::io::Result<TcpStream> {
    loop {
        let (tcp, peer) = listener.accept().await?;
        if is_data_peer(peer, source, port) {
            // The target QEMU's small writes (its TLS handshake, post-copy page requests on
            // the return path) go out at once, as the source's side does.
            let _ = tcp.set_nodelay(true);
            return Ok(tcp);
        }
        tracing::warn!(%peer, "migration: refused a data connection not announced by the source");
    }
}

/// Source: the authenticated channel to `target`, made from the node's namespace `netns`
/// (with `tls`: the target node's pinned certificate, ours as the client's). Also returns
/// the local address (the data connection leaves from the same one).
pub async fn connect_channel(
    netns: Option<String>,
    target: SocketAddr,
    tls: Option<Arc<rustls::ClientConfig>>,
) -> std::io::Result<(Channel, SocketAddr)> {
    let tcp = crate::migration::connect_in(netns, target).await?;
    let local = tcp.local_addr()?;
    let _ = tcp.set_nodelay(true);
    let io: Box<dyn Io> = match tls {
        None => Box::new(tcp),
        Some(cfg) => {
            let name = rustls::pki_types::ServerName::IpAddress(target.ip().into());
            Box::new(
                tokio_rustls::TlsConnector::from(cfg)
                    .connect(name, tcp)
                    .await?,
            )
        }
    };
    Ok((BufReader::new(io), local))
}

/// Source: the data connection's socket, bound to `local` (port chosen by the kernel) in
/// the node's namespace; its port is announced before it connects.
pub async fn data_socket(netns: Option<String>, local: IpAddr) -> std::io::Result<TcpSocket> {
    crate::migration::in_netns(netns, move || {
        let s = if local.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        s.bind(SocketAddr::new(local, 0))?;
        Ok(s)
    })
    .await
}

/// Hands `conn` to the launcher: serves it once (SCM_RIGHTS) on a unix socket at `path`
/// (in the VMI directory, root's alone), which the launcher connects to. The task ends after
/// the hand-over, closing the agent's copy; dropping its handle before aborts it.
pub fn hand_over(
    path: &Path,
    conn: OwnedFd,
) -> std::io::Result<tokio::task::JoinHandle<std::io::Result<()>>> {
    let _ = std::fs::remove_file(path);
    let listener = tokio::net::UnixListener::bind(path)?;
    Ok(tokio::spawn(async move {
        let (s, _) = listener.accept().await?;
        let s = s.into_std()?;
        s.set_nonblocking(false)?;
        tokio::task::spawn_blocking(move || ferrovirt_launcher::migrate::send_fd(&s, conn.as_fd()))
            .await
            .map_err(std::io::Error::other)?
    }))
}

/// A TCP stream as the descriptor a launcher gets.
pub fn into_fd(s: TcpStream) -> std::io::Result<OwnedFd> {
    Ok(OwnedFd::from(s.into_std()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hello_must_match_the_settings() {
        let h = |cert: Option<&str>, port| Hello {
            cert: cert.map(String::from),
            data_port: port,
            recover: false,
            query: false,
        };
        // A recovery: the QEMUs keep their certificates, none is sent.
        let r = |cert: Option<&str>, port| Hello {
            recover: true,
            ..h(cert, port)
        };
        assert_eq!(check_hello(&r(None, 5), true), Ok(()));
        assert!(check_hello(&r(Some("C"), 5), true).is_err());
        assert!(check_hello(&r(None, 0), true).is_err());
        // A query needs no data port, and only comes as a recovery.
        let q = Hello {
            query: true,
            ..r(None, 0)
        };
        assert_eq!(check_hello(&q, true), Ok(()));
        assert!(
            check_hello(
                &Hello {
                    recover: false,
                    ..q.clone()
                },
                true
            )
            .is_err()
        );
        assert!(
            check_hello(
                &Hello {
                    cert: Some("C".into()),
                    ..q
                },
                true
            )
            .is_err()
        );
        assert_eq!(
            serde_json::to_string(&r(None, 7)).unwrap(),
            r#"{"cert":null,"dataPort":7,"recover":true}"#
        );
        assert_eq!(check_hello(&h(Some("C"), 5), true), Ok(()));
        assert_eq!(check_hello(&h(None, 5), false), Ok(()));
        assert!(
            check_hello(&h(None, 5), true)
                .unwrap_err()
                .contains("no certificate")
        );
        assert!(
            check_hello(&h(Some("C"), 5), false)
                .unwrap_err()
                .contains("disableTLS")
        );
        assert!(check_hello(&h(Some("C"), 0), true).is_err());
        let wire = serde_json::to_string(&h(Some("C"), 7)).unwrap();
        assert_eq!(wire, r#"{"cert":"C","dataPort":7}"#);
        assert_eq!(serde_json::to_string(&Reply::default()).unwrap(), "{}");
    }

    #[test]
    fn only_the_announced_port_is_the_data_connection() {
        let src: IpAddr = "10.0.0.1".parse().unwrap();
        assert!(is_data_peer("10.0.0.1:4000".parse().unwrap(), src, 4000));
        assert!(!is_data_peer("10.0.0.1:4001".parse().unwrap(), src, 4000));
        assert!(!is_data_peer("10.0.0.2:4000".parse().unwrap(), src, 4000));
    }

    /// The whole setup over loopback with the agents' pinned mutual TLS: the certificates
    /// cross, a connection from another port is not taken for the data connection, and the
    /// data connection carries bytes directly (no agent copies them).
    #[tokio::test]
    async fn the_channel_exchanges_certificates_and_pins_the_data_connection() {
        let target = crate::tls::AgentCert::generate(&["127.0.0.1".into()]).unwrap();
        let source = crate::tls::AgentCert::generate(&["127.0.0.1".into()]).unwrap();
        let server = crate::tls::migration_server_config(&target, source.fingerprint()).unwrap();
        let client = crate::tls::migration_client_config(&source, target.fingerprint()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let src_ip: IpAddr = "127.0.0.1".parse().unwrap();
        let tgt = tokio::spawn(async move {
            let mut ch = accept_channel(&listener, src_ip, Some(server))
                .await
                .unwrap();
            let hello: Hello = recv(&mut ch).await.unwrap();
            check_hello(&hello, true).unwrap();
            send(
                &mut ch,
                &Reply {
                    cert: Some("TARGET".into()),
                    ..Reply::default()
                },
            )
            .await
            .unwrap();
            let data = accept_data(&listener, src_ip, hello.data_port)
                .await
                .unwrap();
            send(&mut ch, &Reply::default()).await.unwrap();
            (hello, data)
        });
        let (mut ch, local) = connect_channel(None, addr, Some(client)).await.unwrap();
        let sock = data_socket(None, local.ip()).await.unwrap();
        let port = sock.local_addr().unwrap().port();
        send(
            &mut ch,
            &Hello {
                cert: Some("SOURCE".into()),
                data_port: port,
                recover: false,
                query: false,
            },
        )
        .await
        .unwrap();
        let answer: Reply = recv(&mut ch).await.unwrap();
        assert_eq!(answer.cert.as_deref(), Some("TARGET"));
        // Someone else on the source's address connects first: not the data connection.
        let mut intruder = TcpStream::connect(addr).await.unwrap();
        let mut data = sock.connect(addr).await.unwrap();
        let ready: Reply = recv(&mut ch).await.unwrap();
        assert_eq!(ready.error, None);
        let (hello, mut theirs) = tgt.await.unwrap();
        assert_eq!(hello.cert.as_deref(), Some("SOURCE"));
        assert!(theirs.nodelay().unwrap(), "the target's end is TCP_NODELAY");
        let mut buf = [0u8; 1];
        assert_eq!(intruder.read(&mut buf).await.unwrap_or(0), 0, "closed");
        data.write_all(b"QEVM").await.unwrap();
        let mut got = [0u8; 4];
        theirs.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"QEVM");
    }

    #[tokio::test]
    async fn a_descriptor_is_handed_over_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fd.sock");
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let task = hand_over(&path, OwnedFd::from(b)).unwrap();
        let p = path.clone();
        let got = tokio::task::spawn_blocking(move || ferrovirt_launcher::migrate::receive_fd(&p))
            .await
            .unwrap()
            .unwrap();
        task.await.unwrap().unwrap();
        use std::io::{Read, Write};
        let mut got = std::os::unix::net::UnixStream::from(got);
        let mut a = a;
        a.write_all(b"x").unwrap();
        let mut buf = [0u8; 1];
        got.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"x");
    }
}
