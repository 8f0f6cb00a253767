//! Live migration QEMU to QEMU over passed connections with QEMU's own TLS from ephemeral
//! certificates (`ferrovirt_launcher::migrate`, `migtls`; docs/migration.md "The stream"),
//! against the real test guest under TCG. A loopback TCP connection's two ends are handed to
//! the two QEMUs (`getfd`, `migrate fd:` / `migrate-incoming fd:`; the target started with
//! `-incoming defer`); each side trusts exactly the other's fresh self-signed certificate.
//! The attacks: a target that expects another source certificate, and a source that expects
//! another target certificate — the migration fails and the source's guest runs on. Then the
//! real pair: the stream's connection is held by the QEMUs only, the migration completes
//! and the guest answers on the target's console. Post-copy over the same transport: a
//! migration throttled to 1 MiB/s with `postcopy-ram` on both QEMUs is switched with
//! `migrate-start-postcopy` while most of the memory is still on the source; it completes,
//! the target runs the guest, the source is left paused.

mod common;

use std::os::fd::AsFd;
use std::time::Duration;

use common::*;
use ferrovirt_launcher::migrate::{self, Outgoing};
use ferrovirt_launcher::migtls::{Endpoint, EphemeralCert};

const EXEC: Duration = Duration::from_secs(30);
const MIGRATE: Duration = Duration::from_secs(120);

/// A connected loopback TCP pair: (source end, target end).
fn tcp_pair() -> (std::net::TcpStream, std::net::TcpStream) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

/// The socket inodes among `pid`'s open files.
fn socket_inodes(pid: u32) -> Vec<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect()
}

/// The inode of the established loopback TCP socket whose local port is `port`.
fn tcp_inode(port: u16) -> Option<u64> {
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    table.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let local = u16::from_str_radix(f.get(1)?.rsplit(':').next()?, 16).ok()?;
        (local == port && f.get(3) == Some(&"01"))
            .then(|| f.get(9)?.parse().ok())
            .flatten()
    })
}

/// A target QEMU waiting for the stream (`-incoming defer`), same devices as the source.
async fn target(guest: &TestGuest) -> TestVm {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = kernel_boot_spec(guest, "migtls", dir.path());
    spec.start_paused = false;
    spec.incoming = true;
    TestVm::start(spec, dir, false).await
}

/// Starts a migration from `src` to `tgt` over a fresh connection: the target's QEMU trusts
/// `tgt_trusts`, the source's `src_trusts`; returns the source's final `query-migrate`.
async fn migrate_with(
    src: &TestVm,
    tgt: &TestVm,
    certs: (&EphemeralCert, &EphemeralCert),
    trusts: (&str, &str),
    check_held: bool,
) -> serde_json::Value {
    let (a, b) = tcp_pair();
    let a_port = a.local_addr().unwrap().port();
    let b_port = b.local_addr().unwrap().port();
    let incoming = migrate::Incoming {
        peer_cert: Some(trusts.1.to_string()),
        post_copy: false,
    };
    migrate::start_incoming(&tgt.vm, b.as_fd(), Some(certs.1), &incoming)
        .await
        .unwrap();
    drop(b);
    let o = Outgoing {
        peer_cert: Some(trusts.0.to_string()),
        // Slow enough to look at the connection while it carries the stream.
        max_bandwidth: Some(32 << 20),
        ..Outgoing::default()
    };
    migrate::start_outgoing(&src.vm, a.as_fd(), Some(certs.0), &o)
        .await
        .unwrap();
    drop(a);
    if check_held {
        // Our copies are closed: the connection's two sockets are the QEMUs' own.
        let (sp, tp) = (src.vm.pid().unwrap(), tgt.vm.pid().unwrap());
        let ai = tcp_inode(a_port).expect("the source end is established");
        let bi = tcp_inode(b_port).expect("the target end is established");
        assert!(
            socket_inodes(sp).contains(&ai),
            "the source QEMU holds its end"
        );
        assert!(
            socket_inodes(tp).contains(&bi),
            "the target QEMU holds its end"
        );
        let me = socket_inodes(std::process::id());
        assert!(!me.contains(&ai) && !me.contains(&bi), "nobody else does");
    }
    let deadline = tokio::time::Instant::now() + MIGRATE;
    let mut final_tries = 0;
    loop {
        let v = src.vm.qmp().execute("query-migrate", None).await.unwrap();
        match v["status"].as_str() {
            // QEMU fills the figures in a moment after the state.
            Some("completed") if v["total-time"].as_u64().unwrap_or(0) == 0 && final_tries < 20 => {
                final_tries += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Some("completed") | Some("failed") | Some("cancelled") => return v,
            _ if tokio::time::Instant::now() > deadline => panic!("migration stuck: {v}"),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

async fn guest_answers(console: &mut ferrovirt_launcher::console::SerialConsole, word: &str) {
    let out = console
        .exec(&format!("echo {word}-$((40+2))"), EXEC)
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");
    assert!(out.output.contains(&format!("{word}-42")), "{out:?}");
}

#[tokio::test]
async fn two_qemus_migrate_over_passed_fds_with_tls_from_ephemeral_certs() {
    let guest = TestGuest::locate();
    let dir = tempfile::tempdir().unwrap();
    let spec = kernel_boot_spec(&guest, "migtls", dir.path());
    let src = TestVm::start(spec, dir, true).await;
    let (mut console, _events) = src.console_and_run().await;
    wait_ready(&mut console).await;
    let src_cert = EphemeralCert::generate(Endpoint::Client).unwrap();
    let attacker = EphemeralCert::generate(Endpoint::Client).unwrap();

    // The target expects another source's certificate: it refuses the stream.
    let tgt_cert = EphemeralCert::generate(Endpoint::Server).unwrap();
    let tgt = target(&guest).await;
    let v = migrate_with(
        &src,
        &tgt,
        (&src_cert, &tgt_cert),
        (&tgt_cert.cert_pem, &attacker.cert_pem),
        false,
    )
    .await;
    assert_eq!(v["status"], "failed", "{v}");
    eprintln!("a target expecting another source: {}", v["error-desc"]);
    assert_eq!(
        src.vm.status().await.unwrap().status,
        ferrovirt_launcher::qmp::RunState::Running
    );
    guest_answers(&mut console, "STILL-HERE").await;
    drop(tgt);

    // The source expects another target's certificate: it sends nothing.
    let tgt_cert = EphemeralCert::generate(Endpoint::Server).unwrap();
    let impostor = EphemeralCert::generate(Endpoint::Server).unwrap();
    let tgt = target(&guest).await;
    let v = migrate_with(
        &src,
        &tgt,
        (&src_cert, &tgt_cert),
        (&impostor.cert_pem, &src_cert.cert_pem),
        false,
    )
    .await;
    assert_eq!(v["status"], "failed", "{v}");
    eprintln!("a source expecting another target: {}", v["error-desc"]);
    assert_eq!(
        src.vm.status().await.unwrap().status,
        ferrovirt_launcher::qmp::RunState::Running
    );
    guest_answers(&mut console, "STILL-HERE-2").await;
    drop(tgt);

    // The real pair: the VM moves, its guest runs on the target.
    let tgt_cert = EphemeralCert::generate(Endpoint::Server).unwrap();
    let tgt = target(&guest).await;
    let v = migrate_with(
        &src,
        &tgt,
        (&src_cert, &tgt_cert),
        (&tgt_cert.cert_pem, &src_cert.cert_pem),
        true,
    )
    .await;
    assert_eq!(v["status"], "completed", "{v}");
    eprintln!(
        "migrated with QEMU TLS: total {} ms, downtime {} ms",
        v["total-time"], v["downtime"]
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tgt.vm.status().await.unwrap().status != ferrovirt_launcher::qmp::RunState::Running {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the target never ran"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(console);
    let mut on_target = tgt.vm.console(Duration::from_secs(10)).await.unwrap();
    guest_answers(&mut on_target, "MOVED").await;
}

#[tokio::test]
async fn a_throttled_migration_switched_to_post_copy_completes_over_tls() {
    let guest = TestGuest::locate();
    let dir = tempfile::tempdir().unwrap();
    let spec = kernel_boot_spec(&guest, "postcopy", dir.path());
    let src = TestVm::start(spec, dir, true).await;
    let (mut console, _events) = src.console_and_run().await;
    wait_ready(&mut console).await;
    let src_cert = EphemeralCert::generate(Endpoint::Client).unwrap();
    let tgt_cert = EphemeralCert::generate(Endpoint::Server).unwrap();
    let tgt = target(&guest).await;
    let (a, b) = tcp_pair();
    let incoming = migrate::Incoming {
        peer_cert: Some(src_cert.cert_pem.clone()),
        post_copy: true,
    };
    migrate::start_incoming(&tgt.vm, b.as_fd(), Some(&tgt_cert), &incoming)
        .await
        .unwrap();
    drop(b);
    let o = Outgoing {
        peer_cert: Some(tgt_cert.cert_pem.clone()),
        // Far too slow for pre-copy to finish: the switch comes with most pages unsent.
        max_bandwidth: Some(1 << 20),
        post_copy: true,
        ..Outgoing::default()
    };
    migrate::start_outgoing(&src.vm, a.as_fd(), Some(&src_cert), &o)
        .await
        .unwrap();
    drop(a);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = src.vm.qmp().execute("query-migrate", None).await.unwrap();
    assert_eq!(before["status"], "active", "{before}");
    let remaining = before["ram"]["remaining"].as_u64().unwrap();
    assert!(remaining > 32 << 20, "pre-copy nearly done: {before}");
    migrate::start_post_copy(&src.vm).await.unwrap();
    let deadline = tokio::time::Instant::now() + MIGRATE;
    let v = loop {
        let v = src.vm.qmp().execute("query-migrate", None).await.unwrap();
        match v["status"].as_str() {
            Some("completed") | Some("failed") | Some("cancelled") => break v,
            _ if tokio::time::Instant::now() > deadline => panic!("migration stuck: {v}"),
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(v["status"], "completed", "{v}");
    eprintln!(
        "post-copy over QEMU TLS: {} MiB left at the switch, total {} ms, downtime {} ms, \
         post-copy {} bytes, {} page requests",
        remaining >> 20,
        v["total-time"],
        v["downtime"],
        v["ram"]["postcopy-bytes"],
        v["ram"]["postcopy-requests"]
    );
    assert!(v["ram"]["postcopy-bytes"].as_u64().unwrap() > 0, "{v}");
    assert_ne!(
        src.vm.status().await.unwrap().status,
        ferrovirt_launcher::qmp::RunState::Running,
        "the source never runs the guest again"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tgt.vm.status().await.unwrap().status != ferrovirt_launcher::qmp::RunState::Running {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the target never ran"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(console);
    let mut on_target = tgt.vm.console(Duration::from_secs(10)).await.unwrap();
    guest_answers(&mut on_target, "POSTCOPY").await;
}
