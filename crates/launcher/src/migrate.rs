//! Live migration in the launcher (docs/migration.md): the QMP sequences of the source
//! (`migrate` on the TCP connection the agent hands over, with QEMU's own TLS from ephemeral
//! certificates, the bandwidth cap, auto-converge, and `pause-before-switchover` for a block
//! migration) and of the target (QEMU started with `-incoming defer`: `migrate-incoming` on
//! the connection its agent accepted), and the hand-over of those connections from the agent
//! (SCM_RIGHTS over a unix socket in the VMI directory); post-copy when allowed (the
//! `postcopy-ram` capability on both QEMUs before the stream starts, `migrate-start-postcopy`
//! on the source when its agent asks). The QEMUs talk to each other
//! directly: no agent copies the stream (the launcher relays only a post-copy recovery's
//! stream on the target, see [`recover_from`]). The argument builders are pure and unit-tested.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::lifecycle::Vm;
use crate::migtls::{self, Endpoint, EphemeralCert};

/// The name QEMU knows the migration connection by (`getfd`).
pub const MIGRATION_FD: &str = "migration";
/// The URI of the passed connection.
pub const MIGRATION_URI: &str = "fd:migration";
/// How long the launcher waits for the agent to hand the connection over.
const HAND_OVER: Duration = Duration::from_secs(10);

/// Whether a QMP event is the `MIGRATION` event of a completed migration.
pub fn migration_completed(ev: &crate::qmp::QmpEvent) -> bool {
    ev.event == "MIGRATION" && ev.data.get("status").and_then(|s| s.as_str()) == Some("completed")
}

/// How the source migrates.
#[derive(Debug, Clone, Default)]
pub struct Outgoing {
    /// The target's ephemeral certificate (PEM): QEMU's TLS trusting exactly it. `None`:
    /// plain (`disableTLS`).
    pub peer_cert: Option<String>,
    pub max_bandwidth: Option<u64>,
    pub auto_converge: bool,
    /// A block migration: pause before the switch-over so the mirrors complete first.
    pub block: bool,
    /// Post-copy allowed: `postcopy-ram` (QEMU opens the return path it needs itself).
    pub post_copy: bool,
}

/// How the target receives.
#[derive(Debug, Clone, Default)]
pub struct Incoming {
    /// The source's ephemeral certificate (PEM); `None`: plain (`disableTLS`).
    pub peer_cert: Option<String>,
    /// Post-copy allowed: `postcopy-ram` before `migrate-incoming`.
    pub post_copy: bool,
}

/// `migrate-set-capabilities` of the source.
pub fn capabilities(o: &Outgoing) -> Value {
    json!({"capabilities": [
        {"capability": "events", "state": true},
        {"capability": "auto-converge", "state": o.auto_converge},
        {"capability": "pause-before-switchover", "state": o.block},
        {"capability": "postcopy-ram", "state": o.post_copy},
    ]})
}

/// `migrate-set-capabilities` of the target (only when post-copy is allowed).
pub fn incoming_capabilities() -> Value {
    json!({"capabilities": [{"capability": "postcopy-ram", "state": true}]})
}

/// The target's error when QEMU refuses `postcopy-ram`, naming the field and, for the
/// refusal QEMU 7.2 gives a QEMU that dropped root without userfaultfd, the node setting.
pub fn post_copy_refused(qemu: &str) -> String {
    format!(
        "allowPostCopy: the target's QEMU refuses post-copy ({qemu}); QEMU needs userfaultfd, \
         which a QEMU running as an unprivileged user gets only with the node's sysctl \
         vm.unprivileged_userfaultfd=1"
    )
}

/// `migrate-set-parameters` of the source: TLS (or explicitly none) and the bandwidth cap.
pub fn source_parameters(o: &Outgoing) -> Value {
    let mut p = migtls::tls_parameters(o.peer_cert.is_some(), Endpoint::Client);
    if let Some(bw) = o.max_bandwidth {
        p["max-bandwidth"] = json!(bw);
    }
    p
}

/// Receives the one file descriptor the agent sends on the unix socket at `path`.
pub fn receive_fd(path: &Path) -> Result<OwnedFd> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, recvmsg};
    let io =
        |e: std::io::Error| Error::io(format!("receiving the connection on {}", path.display()), e);
    let conn = std::os::unix::net::UnixStream::connect(path).map_err(io)?;
    conn.set_read_timeout(Some(HAND_OVER)).map_err(io)?;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    recvmsg(
        &conn,
        &mut [IoSliceMut::new(&mut byte)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )
    .map_err(|e| io(e.into()))?;
    let mut fds: Vec<OwnedFd> = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(got) = m {
            fds.extend(got);
        }
    }
    match fds.len() {
        1 => Ok(fds.remove(0)),
        n => Err(Error::Migration(format!(
            "the agent handed over {n} file descriptors on {}, expected one",
            path.display()
        ))),
    }
}

/// Sends `fd` on `stream` (the agent's side of [`receive_fd`]).
pub fn send_fd(stream: &std::os::unix::net::UnixStream, fd: BorrowedFd<'_>) -> std::io::Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
    let fds = [fd];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    control.push(SendAncillaryMessage::ScmRights(&fds));
    sendmsg(
        stream,
        &[IoSlice::new(b"F")],
        &mut control,
        SendFlags::empty(),
    )?;
    Ok(())
}

/// Gives QEMU this migration's TLS credentials: our ephemeral pair and the peer's
/// certificate, in a directory only QEMU's uid can read, removed once QEMU has read it
/// (`object-add` loads the files). An older credentials object (an earlier attempt) is
/// replaced.
async fn install_creds(vm: &Vm, ours: &EphemeralCert, peer_cert: &str) -> Result<()> {
    install_creds_as(vm, migtls::CREDS_ID, ours, peer_cert).await
}

/// [`install_creds`] under the object id `id` (the NBD side of a block migration has its
/// own object from the same pair).
pub(crate) async fn install_creds_as(
    vm: &Vm,
    id: &str,
    ours: &EphemeralCert,
    peer_cert: &str,
) -> Result<()> {
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    let owner = migtls::runas_owner(vm.spec().run_as.as_deref(), &passwd)?;
    let files = migtls::creds_files(ours, peer_cert);
    let dir = migtls::write_creds_dir(&migtls::creds_base(), &files, owner)?;
    let _ = vm
        .qmp()
        .execute("object-del", Some(json!({"id": id})))
        .await;
    vm.qmp()
        .execute(
            "object-add",
            Some(migtls::creds_object(id, ours.endpoint, &dir.path)),
        )
        .await?;
    drop(dir);
    Ok(())
}

pub(crate) fn needs_cert(
    cert: Option<&EphemeralCert>,
    endpoint: Endpoint,
) -> Result<&EphemeralCert> {
    cert.filter(|c| c.endpoint == endpoint).ok_or_else(|| {
        Error::Migration(
            "no ephemeral migration certificate for this side: ask for one (migrationCert) first"
                .into(),
        )
    })
}

/// Source: starts sending the VM on `conn` (a connected TCP socket to the target node).
/// `cert`: this side's ephemeral certificate, required with `o.peer_cert`. Returns once
/// QEMU accepted `migrate`; QEMU holds its own copy of `conn`.
pub async fn start_outgoing(
    vm: &Vm,
    conn: BorrowedFd<'_>,
    cert: Option<&EphemeralCert>,
    o: &Outgoing,
) -> Result<()> {
    vm.qmp()
        .execute("migrate-set-capabilities", Some(capabilities(o)))
        .await?;
    if let Some(peer) = &o.peer_cert {
        install_creds(vm, needs_cert(cert, Endpoint::Client)?, peer).await?;
    }
    vm.qmp()
        .execute("migrate-set-parameters", Some(source_parameters(o)))
        .await?;
    vm.qmp()
        .execute_with_fd("getfd", Some(json!({"fdname": MIGRATION_FD})), conn)
        .await?;
    vm.qmp()
        .execute("migrate", Some(json!({"uri": MIGRATION_URI})))
        .await?;
    Ok(())
}

/// Target (QEMU waiting with `-incoming defer`): receives the VM on `conn` (the source
/// node's accepted TCP connection); with `peer_cert`, QEMU's TLS requires exactly the
/// source's ephemeral certificate.
pub async fn start_incoming(
    vm: &Vm,
    conn: BorrowedFd<'_>,
    cert: Option<&EphemeralCert>,
    incoming: &Incoming,
) -> Result<()> {
    let peer_cert = incoming.peer_cert.as_deref();
    if incoming.post_copy {
        vm.qmp()
            .execute("migrate-set-capabilities", Some(incoming_capabilities()))
            .await
            .map_err(|e| Error::Migration(post_copy_refused(&e.to_string())))?;
    }
    if let Some(peer) = peer_cert {
        install_creds(vm, needs_cert(cert, Endpoint::Server)?, peer).await?;
    }
    vm.qmp()
        .execute(
            "migrate-set-parameters",
            Some(migtls::tls_parameters(
                peer_cert.is_some(),
                Endpoint::Server,
            )),
        )
        .await?;
    vm.qmp()
        .execute_with_fd("getfd", Some(json!({"fdname": MIGRATION_FD})), conn)
        .await?;
    vm.qmp()
        .execute("migrate-incoming", Some(json!({"uri": MIGRATION_URI})))
        .await?;
    Ok(())
}

/// Source: switches a running migration (started with [`Outgoing::post_copy`]) to
/// post-copy. The guest runs on the target from here on; the source never resumes it.
pub async fn start_post_copy(vm: &Vm) -> Result<()> {
    vm.qmp().execute("migrate-start-postcopy", None).await?;
    Ok(())
}

/// `migrate-recover` of the target (post-copy recovery): QEMU listens on the unix socket
/// `listen` (see [`recover_from`]).
pub fn recover_args(listen: &Path) -> Value {
    json!({"uri": format!("unix:{}", listen.display())})
}

/// The unix socket's name in its private directory.
const RECOVER_SOCKET: &str = "r.sock";
/// The relay's buffer per direction.
const RELAY_BUFFER: usize = 256 * 1024;
/// The out-of-band `migrate-recover`'s reply deadline.
const RECOVER_WAIT: Duration = Duration::from_secs(10);

/// `migrate` of the source resuming a paused post-copy on the new connection.
pub fn resume_args() -> Value {
    json!({"uri": MIGRATION_URI, "resume": true})
}

/// Receives the connection the agent hands over on `fd_socket` and gives it to QEMU
/// (`getfd`, under [`MIGRATION_FD`]).
async fn pass_connection(vm: &Vm, fd_socket: &Path) -> Result<()> {
    let path = fd_socket.to_path_buf();
    let conn = tokio::task::spawn_blocking(move || receive_fd(&path))
        .await
        .map_err(|e| Error::Migration(e.to_string()))??;
    vm.qmp()
        .execute_with_fd("getfd", Some(json!({"fdname": MIGRATION_FD})), conn.as_fd())
        .await?;
    Ok(())
}

/// Target, post-copy recovery (QEMU in `postcopy-paused`): the new connection handed over
/// on `fd_socket` becomes QEMU's stream. The TLS credentials and parameters of the original
/// stream are still loaded in QEMU and apply to it.
///
/// The one place where the launcher copies a migration stream. QEMU's main loop may be
/// blocked here (a device reading a guest page that is still on the source), and every
/// command that passes a descriptor (`getfd`) runs in that loop; only `migrate-recover`
/// may run out of band, in the monitor's thread, and QEMU then sets up the incoming
/// channel in that thread too. So QEMU is told (`exec-oob`) to listen on a unix socket in
/// a fresh directory only its uid and root may enter, the launcher connects to it and
/// relays between it and the agents' connection until either ends (the stream inside is
/// QEMU's TLS: the relay sees ciphertext). Without out-of-band support, in band.
pub async fn recover_from(vm: &Vm, fd_socket: &Path) -> Result<()> {
    let path = fd_socket.to_path_buf();
    let conn = tokio::task::spawn_blocking(move || receive_fd(&path))
        .await
        .map_err(|e| Error::Migration(e.to_string()))??;
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    let owner = migtls::runas_owner(vm.spec().run_as.as_deref(), &passwd)?;
    let dir = migtls::write_creds_dir(&migtls::creds_base(), &[], owner)?;
    let listen = dir.path.join(RECOVER_SOCKET);
    let qmp = vm.qmp();
    let args = Some(recover_args(&listen));
    match qmp.oob() {
        true => {
            qmp.execute_oob("migrate-recover", args, RECOVER_WAIT)
                .await?
        }
        false => qmp.execute("migrate-recover", args).await?,
    };
    let unix =
        crate::qmp::connect_unix_retry(&listen, RECOVER_WAIT, Duration::from_millis(20)).await?;
    drop(dir);
    let tcp = std::net::TcpStream::from(conn);
    let io = |e| Error::io("the recovered migration connection", e);
    tcp.set_nonblocking(true).map_err(io)?;
    let tcp = tokio::net::TcpStream::from_std(tcp).map_err(io)?;
    tokio::spawn(relay(unix, tcp));
    Ok(())
}

/// Copies the recovered stream between QEMU's unix connection and the agents' TCP
/// connection, both ways, until either ends; a broken side breaks the other, so QEMU
/// pauses again and another recovery can follow.
async fn relay(mut unix: tokio::net::UnixStream, mut tcp: tokio::net::TcpStream) {
    match tokio::io::copy_bidirectional_with_sizes(&mut unix, &mut tcp, RELAY_BUFFER, RELAY_BUFFER)
        .await
    {
        Ok((to_source, to_qemu)) => tracing::info!(
            to_qemu,
            to_source,
            "post-copy recovery: the recovered stream ended"
        ),
        Err(e) => tracing::warn!("post-copy recovery: the recovered stream broke: {e}"),
    }
}

/// Source, post-copy recovery (QEMU in `postcopy-paused`, the target already recovering):
/// `migrate` with `resume: true` on the new connection handed over on `fd_socket`.
pub async fn resume_from(vm: &Vm, fd_socket: &Path) -> Result<()> {
    pass_connection(vm, fd_socket).await?;
    vm.qmp().execute("migrate", Some(resume_args())).await?;
    Ok(())
}

/// [`start_outgoing`] on the connection handed over on `fd_socket`.
pub async fn outgoing_from(
    vm: &Vm,
    fd_socket: &Path,
    cert: Option<&EphemeralCert>,
    o: &Outgoing,
) -> Result<()> {
    let path = fd_socket.to_path_buf();
    let conn = tokio::task::spawn_blocking(move || receive_fd(&path))
        .await
        .map_err(|e| Error::Migration(e.to_string()))??;
    start_outgoing(vm, conn.as_fd(), cert, o).await
}

/// [`start_incoming`] on the connection handed over on `fd_socket`.
pub async fn incoming_from(
    vm: &Vm,
    fd_socket: &Path,
    cert: Option<&EphemeralCert>,
    incoming: &Incoming,
) -> Result<()> {
    let path = fd_socket.to_path_buf();
    let conn = tokio::task::spawn_blocking(move || receive_fd(&path))
        .await
        .map_err(|e| Error::Migration(e.to_string()))??;
    start_incoming(vm, conn.as_fd(), cert, incoming).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_source_sets_tls_and_the_cap_before_migrating() {
        let o = Outgoing {
            peer_cert: Some("PEM".into()),
            max_bandwidth: Some(1 << 20),
            auto_converge: true,
            block: false,
            post_copy: true,
        };
        let p = source_parameters(&o);
        assert_eq!(p["tls-creds"], migtls::CREDS_ID);
        assert_eq!(p["tls-hostname"], migtls::TARGET_HOSTNAME);
        assert_eq!(p["max-bandwidth"], 1 << 20);
        let c = capabilities(&o);
        assert_eq!(
            c["capabilities"][1],
            json!({"capability": "auto-converge", "state": true})
        );
        assert_eq!(c["capabilities"][2]["state"], false);
        assert_eq!(
            c["capabilities"][3],
            json!({"capability": "postcopy-ram", "state": true})
        );
        assert_eq!(
            capabilities(&Outgoing::default())["capabilities"][3]["state"],
            false
        );
        assert!(post_copy_refused("Postcopy is not supported").starts_with("allowPostCopy:"));
        assert!(post_copy_refused("x").contains("vm.unprivileged_userfaultfd=1"));
        // disableTLS: plain, and an earlier attempt's credentials are not used.
        let plain = source_parameters(&Outgoing::default());
        assert_eq!(plain["tls-creds"], "");
        assert!(plain.get("max-bandwidth").is_none());
        assert!(needs_cert(None, Endpoint::Client).is_err());
        let server = EphemeralCert::generate(Endpoint::Server).unwrap();
        assert!(needs_cert(Some(&server), Endpoint::Client).is_err());
        assert!(needs_cert(Some(&server), Endpoint::Server).is_ok());
    }

    #[test]
    fn recovery_listens_on_its_socket_and_the_source_resumes_on_the_passed_connection() {
        assert_eq!(
            recover_args(Path::new("/run/d/r.sock")),
            json!({"uri": "unix:/run/d/r.sock"})
        );
        assert_eq!(
            resume_args(),
            json!({"uri": "fd:migration", "resume": true})
        );
        assert_eq!(MIGRATION_URI, format!("fd:{MIGRATION_FD}"));
    }

    #[test]
    fn a_descriptor_passes_over_the_unix_socket() {
        use std::io::{Read, Write};
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("fd.sock");
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let sender = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            send_fd(&s, b.as_fd()).unwrap();
        });
        let got = receive_fd(&sock).unwrap();
        sender.join().unwrap();
        let mut got = std::os::unix::net::UnixStream::from(got);
        a.write_all(b"hi").unwrap();
        let mut buf = [0u8; 2];
        got.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hi");
    }
}
