//! A block migration's NBD path QEMU to QEMU with QEMU's own TLS (`ferrovirt_launcher::blockmig`,
//! docs/migration.md "Node-local disks"): the target QEMU (`-incoming defer`) serves its empty
//! disk over NBD on a listening TCP socket handed over by fd, trusting exactly the source's
//! ephemeral certificate; the source QEMU's NBD client gets its connection by fd too. The
//! attack: a client presenting another certificate gets no export (its `blockdev-add` fails,
//! no mirror starts). Then the real pair: the mirror gets in sync and the target's file holds
//! the source disk's bytes.

mod common;

use std::io::{Read, Seek, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use ferrovirt_launcher::blockmig;
use ferrovirt_launcher::control::{BlockOp, MirrorDisk};
use ferrovirt_launcher::migtls::{Endpoint, EphemeralCert};
use ferrovirt_launcher::spec::Disk;

const DISK: &str = "disk-data";
const SIZE: u64 = 8 << 20;

fn data_disk(path: &Path) -> Disk {
    serde_json::from_value(serde_json::json!({
        "id": DISK, "path": path, "format": "raw", "bus": "virtio",
    }))
    .unwrap()
}

fn raw_file(path: &Path, marker: &[u8]) {
    let mut f = std::fs::File::create(path).unwrap();
    f.set_len(SIZE).unwrap();
    f.seek(std::io::SeekFrom::Start(SIZE / 2)).unwrap();
    f.write_all(marker).unwrap();
}

/// Serves `fd` once on a unix socket at `path` (the agent's side of the hand-over).
fn hand_over(path: PathBuf, fd: OwnedFd) -> std::thread::JoinHandle<()> {
    let _ = std::fs::remove_file(&path);
    let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        ferrovirt_launcher::migrate::send_fd(&s, fd.as_fd()).unwrap();
    })
}

/// A source's NBD mirror of the disk to `at`, presenting `ours` and trusting `target_cert`.
async fn mirror(
    src: &TestVm,
    at: std::net::SocketAddr,
    ours: &EphemeralCert,
    target_cert: &str,
) -> Result<serde_json::Value, String> {
    let sock = src.dir.path().join("nbd-out-0.sock");
    let conn = std::net::TcpStream::connect(at).unwrap();
    let t = hand_over(sock.clone(), OwnedFd::from(conn));
    let step = BlockOp::Mirror {
        disks: vec![MirrorDisk {
            disk: DISK.into(),
            socket: sock,
            top_only: false,
        }],
        peer_cert: Some(target_cert.to_string()),
    };
    let r = blockmig::run(&src.vm, step, Some(ours), &Default::default()).await;
    t.join().unwrap();
    r.map_err(|e| e.to_string())
}

#[tokio::test]
async fn the_nbd_export_takes_only_the_source_certificate() {
    let guest = TestGuest::locate();
    let (sdir, tdir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (sdisk, tdisk) = (sdir.path().join("disk.img"), tdir.path().join("disk.img"));
    raw_file(&sdisk, b"FERROVIRT-NBD-TLS");
    raw_file(&tdisk, b"");
    let mut spec = kernel_boot_spec(&guest, "nbdsrc", sdir.path());
    spec.disks.push(data_disk(&sdisk));
    let src = TestVm::start(spec, sdir, false).await;
    let mut spec = kernel_boot_spec(&guest, "nbdtgt", tdir.path());
    spec.disks.push(data_disk(&tdisk));
    spec.start_paused = false;
    spec.incoming = true;
    let tgt = TestVm::start(spec, tdir, false).await;

    let src_cert = EphemeralCert::generate(Endpoint::Client).unwrap();
    let tgt_cert = EphemeralCert::generate(Endpoint::Server).unwrap();
    let attacker = EphemeralCert::generate(Endpoint::Client).unwrap();

    // The target's export on a listening socket handed over by fd, trusting the source only.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = listener.local_addr().unwrap();
    let sock = tgt.dir.path().join("nbd-in.sock");
    let t = hand_over(sock.clone(), OwnedFd::from(listener));
    let export = BlockOp::Export {
        fd_socket: sock,
        disks: vec![DISK.into()],
        peer_cert: Some(src_cert.cert_pem.clone()),
    };
    blockmig::run(&tgt.vm, export, Some(&tgt_cert), &Default::default())
        .await
        .expect("the target exports its disk");
    t.join().unwrap();

    // Another certificate: the TLS handshake fails, no export, no mirror.
    let err = mirror(&src, at, &attacker, &tgt_cert.cert_pem)
        .await
        .expect_err("a client with another certificate got the export");
    eprintln!("the attacker's blockdev-add: {err}");
    let jobs = src
        .vm
        .qmp()
        .execute("query-block-jobs", None)
        .await
        .unwrap();
    assert_eq!(jobs, serde_json::json!([]), "no mirror runs");

    // The source's certificate: the mirror gets in sync.
    tokio::time::sleep(Duration::from_millis(200)).await;
    mirror(&src, at, &src_cert, &tgt_cert.cert_pem)
        .await
        .expect("the source mirrors to the target");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let jobs = src
            .vm
            .qmp()
            .execute("query-block-jobs", None)
            .await
            .unwrap();
        if blockmig::all_ready(&jobs, &[DISK.to_string()]).unwrap() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "mirror not in sync: {jobs}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Completed without a pivot (as at the switch-over): the copy is flushed.
    let mut events = src.vm.qmp().subscribe();
    src.vm
        .qmp()
        .execute(
            "block-job-cancel",
            Some(serde_json::json!({"device": blockmig::job_id(DISK)})),
        )
        .await
        .unwrap();
    let ev = wait_event(&mut events, "BLOCK_JOB_COMPLETED", Duration::from_secs(30)).await;
    assert!(ev.data.get("error").is_none(), "{:?}", ev.data);
    let mut got = vec![0u8; 17];
    let mut f = std::fs::File::open(&tdisk).unwrap();
    f.seek(std::io::SeekFrom::Start(SIZE / 2)).unwrap();
    f.read_exact(&mut got).unwrap();
    assert_eq!(
        &got, b"FERROVIRT-NBD-TLS",
        "the target's copy holds the source's bytes"
    );
}
