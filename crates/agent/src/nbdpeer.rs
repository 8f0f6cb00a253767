//! The target's NBD listening socket of a block migration (docs/migration.md "Node-local
//! disks"): bound on the node address by the agent and handed to QEMU's NBD server, so no
//! agent copies the disks' bytes. QEMU accepts on it by itself, so "only the source node may
//! connect" is enforced by the kernel: a classic BPF socket filter on the listening socket
//! drops every packet whose IP source is not the source node's address (the SYN of anyone
//! else never gets an answer; accepted connections inherit the filter). QEMU's TLS (the
//! source's ephemeral certificate the only one trusted) then authenticates the client.
//! The filter program is pure and unit-tested; a loopback test checks the kernel honours it.
//! The listener is `TCP_NODELAY`, which the accepted connections inherit.

use std::net::{IpAddr, SocketAddr};

use socket2::{Domain, Protocol, SockFilter, Socket, Type};

// Classic BPF opcodes (linux/filter.h).
const LD_B_ABS: u16 = 0x30; // BPF_LD | BPF_B | BPF_ABS
const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
const RSH_K: u16 = 0x74; // BPF_ALU | BPF_RSH | BPF_K
const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const RET_K: u16 = 0x06; // BPF_RET | BPF_K
/// `SKF_NET_OFF`: offsets from the network (IP) header, whatever the socket sees.
const NET: u32 = (-0x100000i32) as u32;
const DROP: u32 = 0;
const ACCEPT: u32 = u32::MAX;

/// One instruction as `(code, jt, jf, k)`.
pub type Insn = (u16, u8, u8, u32);

/// The filter program accepting only packets whose IP source address is `source` (the
/// other IP version too is dropped).
pub fn source_filter(source: IpAddr) -> Vec<Insn> {
    let mut p = vec![(LD_B_ABS, 0, 0, NET), (RSH_K, 0, 0, 4)];
    match source {
        IpAddr::V4(a) => {
            p.extend([
                (JEQ_K, 0, 2, 4),
                (LD_W_ABS, 0, 0, NET + 12),
                (JEQ_K, 1, 0, u32::from(a)),
            ]);
        }
        IpAddr::V6(a) => {
            let o = a.octets();
            let w = |i: usize| u32::from_be_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            p.extend([
                (JEQ_K, 0, 8, 6),
                (LD_W_ABS, 0, 0, NET + 8),
                (JEQ_K, 0, 6, w(0)),
                (LD_W_ABS, 0, 0, NET + 12),
                (JEQ_K, 0, 4, w(4)),
                (LD_W_ABS, 0, 0, NET + 16),
                (JEQ_K, 0, 2, w(8)),
                (LD_W_ABS, 0, 0, NET + 20),
                (JEQ_K, 1, 0, w(12)),
            ]);
        }
    }
    p.extend([(RET_K, 0, 0, DROP), (RET_K, 0, 0, ACCEPT)]);
    p
}

/// A listening TCP socket on `ip` (port chosen by the kernel) that takes connections from
/// `source` only (blocking mode: it is QEMU's to accept on). Make it in the node's network
/// namespace ([`crate::migration::in_netns`]).
pub fn listen_for(ip: IpAddr, source: IpAddr) -> std::io::Result<std::net::TcpListener> {
    let s = Socket::new(
        Domain::for_address(SocketAddr::new(ip, 0)),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    let prog: Vec<SockFilter> = source_filter(source)
        .into_iter()
        .map(|(c, jt, jf, k)| SockFilter::new(c, jt, jf, k))
        .collect();
    s.attach_filter(&prog)?;
    // Inherited by the connections QEMU accepts (Linux copies it from the listener): the
    // NBD TLS handshake's small writes go out at once, not after the client's delayed ACK
    // (Nagle held them: `blockdev-add` of the source's client took 135 ms, 7 ms with it).
    s.set_tcp_nodelay(true)?;
    s.bind(&SocketAddr::new(ip, 0).into())?;
    s.listen(16)?;
    Ok(s.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Interprets the subset of classic BPF the filter uses over an IP packet.
    fn run(p: &[Insn], pkt: &[u8]) -> u32 {
        let (mut a, mut pc) = (0u32, 0usize);
        loop {
            let (code, jt, jf, k) = p[pc];
            pc += 1;
            match code {
                LD_B_ABS => a = u32::from(pkt[(k - NET) as usize]),
                LD_W_ABS => {
                    let i = (k - NET) as usize;
                    a = u32::from_be_bytes([pkt[i], pkt[i + 1], pkt[i + 2], pkt[i + 3]]);
                }
                RSH_K => a >>= k,
                JEQ_K => pc += usize::from(if a == k { jt } else { jf }),
                RET_K => return k,
                _ => panic!("unexpected opcode {code:#x}"),
            }
        }
    }

    fn v4(src: [u8; 4]) -> Vec<u8> {
        let mut h = vec![0x45u8; 20];
        h[12..16].copy_from_slice(&src);
        h
    }

    fn v6(src: std::net::Ipv6Addr) -> Vec<u8> {
        let mut h = vec![0x60u8; 40];
        h[8..24].copy_from_slice(&src.octets());
        h
    }

    #[test]
    fn only_the_source_address_passes() {
        let p = source_filter("10.0.0.2".parse().unwrap());
        assert_eq!(run(&p, &v4([10, 0, 0, 2])), ACCEPT);
        assert_eq!(run(&p, &v4([10, 0, 0, 3])), DROP);
        assert_eq!(run(&p, &v6("::ffff:10.0.0.2".parse().unwrap())), DROP);
        let src: std::net::Ipv6Addr = "fd00::1:2".parse().unwrap();
        let p = source_filter(IpAddr::V6(src));
        assert_eq!(run(&p, &v6(src)), ACCEPT);
        for other in ["fd00::1:3", "fd01::1:2", "fe00::1:2", "fd00:0:0:1::1:2"] {
            assert_eq!(run(&p, &v6(other.parse().unwrap())), DROP, "{other}");
        }
        assert_eq!(run(&p, &v4([10, 0, 0, 2])), DROP);
    }

    fn connect_from(from: &str, to: SocketAddr) -> std::io::Result<std::net::TcpStream> {
        let s = Socket::new(Domain::IPV4, Type::STREAM, None)?;
        s.bind(&SocketAddr::new(from.parse().unwrap(), 0).into())?;
        s.connect_timeout(&to.into(), Duration::from_millis(1500))?;
        Ok(s.into())
    }

    /// The attack: a connection from another address never reaches the listener (the
    /// kernel drops its SYN); the source's does, and its bytes arrive.
    #[test]
    fn the_kernel_refuses_every_address_but_the_source() {
        use std::io::{Read, Write};
        let l = listen_for("127.0.0.1".parse().unwrap(), "127.0.0.2".parse().unwrap()).unwrap();
        let at = l.local_addr().unwrap();
        let err = connect_from("127.0.0.3", at).expect_err("another address got through");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
        assert!(
            connect_from("127.0.0.1", at).is_err(),
            "not even the node itself"
        );
        let mut c = connect_from("127.0.0.2", at).expect("the source connects");
        let (mut s, peer) = l.accept().unwrap();
        assert_eq!(peer.ip().to_string(), "127.0.0.2");
        assert!(
            s.nodelay().unwrap(),
            "the accepted connection sends without Nagle's delay"
        );
        c.write_all(b"NBD").unwrap();
        let mut got = [0u8; 3];
        s.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"NBD");
        l.set_nonblocking(true).unwrap();
        assert!(l.accept().is_err(), "the refused ones are not queued");
    }
}
