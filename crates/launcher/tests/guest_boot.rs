//! Boots the real test guest under TCG and checks what the guest itself reports: the boot marker
//! with the spec's SMBIOS identity, QMP run states through pause/resume/reset, the guest agent,
//! user-mode networking, soft reboot, ACPI shutdown, and booting from raw and qcow2 disks.

mod common;

use std::time::{Duration, Instant};

use common::*;
use ferrovirt_launcher::console::Pattern;
use ferrovirt_launcher::qmp::RunState;
use ferrovirt_launcher::spec::{
    Disk, DiskBus, DiskFormat, DiskSource, ForwardProtocol, HostForward, Nic, NicBackend, NicModel,
};
use ferrovirt_launcher::{ShutdownOutcome, ShutdownPolicy, VmState};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const EVENT_TIMEOUT: Duration = Duration::from_secs(15);
const EXEC_TIMEOUT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn kernel_boot_reports_identity_and_follows_pause_resume_and_reset() {
    let guest = TestGuest::locate();
    let dir = tempfile::tempdir().unwrap();
    let mut spec = kernel_boot_spec(&guest, "boot", dir.path());
    spec.sandbox = true;
    let uuid = spec.uuid.clone();
    let t = TestVm::start(spec, dir, true).await;

    let st = t.vm.status().await.unwrap();
    assert_eq!(st.status, RunState::Prelaunch);
    assert_eq!(VmState::from_status(&st), VmState::Starting);

    let (mut console, mut events) = t.console_and_run().await;
    wait_event(&mut events, "RESUME", EVENT_TIMEOUT).await;
    let (serial, seen_uuid) = wait_boot_marker(&mut console).await;
    assert_eq!(serial, "FV-boot");
    assert_eq!(seen_uuid.to_lowercase(), uuid);

    let st = t.vm.status().await.unwrap();
    assert!(st.running);
    assert_eq!(st.status, RunState::Running);
    // the raw JSON path
    let raw = t.vm.qmp().execute("query-uuid", None).await.unwrap();
    assert_eq!(raw["UUID"], uuid.as_str());

    // pause / unpause
    t.vm.pause().await.unwrap();
    wait_event(&mut events, "STOP", EVENT_TIMEOUT).await;
    let st = t.vm.status().await.unwrap();
    assert!(!st.running);
    assert_eq!(st.status, RunState::Paused);
    assert_eq!(VmState::from_status(&st), VmState::Paused);
    t.vm.unpause().await.unwrap();
    wait_event(&mut events, "RESUME", EVENT_TIMEOUT).await;
    assert_eq!(t.vm.status().await.unwrap().status, RunState::Running);

    // the guest runs on after the pause and sees the SMBIOS vendor
    wait_ready(&mut console).await;
    let out = console
        .exec("cat /sys/class/dmi/id/sys_vendor", EXEC_TIMEOUT)
        .await
        .unwrap();
    assert_eq!((out.exit_code, out.output.as_str()), (0, "ferrovirt"));

    // hard reset: the guest boots again
    t.vm.reset().await.unwrap();
    wait_event(&mut events, "RESET", EVENT_TIMEOUT).await;
    let (_, seen_uuid) = wait_boot_marker(&mut console).await;
    assert_eq!(seen_uuid.to_lowercase(), uuid);
}

#[tokio::test]
async fn guest_agent_answers_user_network_forwards_and_soft_reboot_restarts_the_guest() {
    let guest = TestGuest::locate();
    let dir = tempfile::tempdir().unwrap();
    let mut spec = kernel_boot_spec(&guest, "agent", dir.path());
    let http_port = free_port();
    spec.nics.push(Nic {
        id: "net0".into(),
        mac: Some("52:54:00:fe:00:01".into()),
        model: NicModel::VirtioNetPci,
        backend: NicBackend::User {
            forwards: vec![HostForward {
                protocol: ForwardProtocol::Tcp,
                host_addr: "127.0.0.1".into(),
                host_port: http_port,
                guest_port: 80,
            }],
        },
        boot_order: None,
    });
    spec.rng = true;
    let uuid = spec.uuid.clone();
    let t = TestVm::start(spec, dir, true).await;
    let (mut console, mut events) = t.console_and_run().await;
    wait_ready(&mut console).await;

    let mut qga = t.vm.guest_agent().await.unwrap();
    qga.ping().await.unwrap();
    let info = qga.info().await.unwrap();
    assert!(!info.version.is_empty());
    assert!(
        info.supported_commands
            .iter()
            .any(|c| c.name == "guest-get-osinfo" && c.enabled)
    );
    let os = qga.os_info().await.unwrap();
    assert_eq!(os.id.as_deref(), Some("ferrovirt-testguest"));
    let kver = std::fs::read_to_string(guest.path("kernel-version")).unwrap_or_default();
    if !kver.trim().is_empty() {
        assert_eq!(os.kernel_release.as_deref(), Some(kver.trim()));
    }
    assert_eq!(qga.host_name().await.unwrap(), "ferrovirt-guest");
    qga.users().await.unwrap();
    qga.fs_info().await.unwrap();
    let ifs = qga.network_interfaces().await.unwrap();
    let eth = ifs
        .iter()
        .find(|i| i.hardware_address.as_deref() == Some("52:54:00:fe:00:01"))
        .unwrap_or_else(|| panic!("no interface with our MAC in {ifs:?}"));
    assert!(!eth.name.is_empty());
    assert!(ifs.iter().any(|i| {
        i.ip_addresses
            .iter()
            .any(|a| a.ip_address == "127.0.0.1" && a.prefix == 8)
    }));

    drop(qga);

    // user-mode networking: the host forward reaches the guest's HTTP server
    let body = http_get_with_retry(http_port, "/cgi-bin/index.cgi", Duration::from_secs(60)).await;
    assert!(body.contains("hostname=ferrovirt-guest"), "{body}");

    // Soft reboot needs /sbin/shutdown in the guest (qemu-ga runs it); the busybox guest may
    // lack it, so provide a minimal one through the console first.
    let out = console
        .exec(
            "[ -x /sbin/shutdown ] || { printf '#!/bin/sh\\nexec reboot\\n' > /sbin/shutdown \
             && chmod +x /sbin/shutdown; }",
            EXEC_TIMEOUT,
        )
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0, "{}", out.output);
    t.vm.soft_reboot().await.unwrap();
    let reset = wait_event(&mut events, "RESET", Duration::from_secs(60)).await;
    assert_eq!(reset.guest_initiated(), Some(true));
    let (_, seen_uuid) = wait_boot_marker(&mut console).await;
    assert_eq!(seen_uuid.to_lowercase(), uuid);
}

#[tokio::test]
async fn acpi_powerdown_makes_qemu_exit_within_30s() {
    let guest = TestGuest::locate();
    let dir = tempfile::tempdir().unwrap();
    let spec = kernel_boot_spec(&guest, "powerdown", dir.path());
    let mut t = TestVm::start(spec, dir, true).await;
    let (mut console, mut events) = t.console_and_run().await;
    wait_ready(&mut console).await;

    let started = Instant::now();
    let policy = ShutdownPolicy {
        grace: Duration::from_secs(30),
        resend_interval: Some(Duration::from_secs(5)),
        kill_timeout: Duration::from_secs(10),
    };
    let outcome = t.vm.shutdown(&policy).await.unwrap();
    let took = started.elapsed();
    assert_eq!(outcome, ShutdownOutcome::Graceful);
    assert!(took < Duration::from_secs(30), "took {took:?}");

    wait_event(&mut events, "POWERDOWN", EVENT_TIMEOUT).await;
    let sd = wait_event(&mut events, "SHUTDOWN", EVENT_TIMEOUT).await;
    assert_eq!(sd.guest_initiated(), Some(true));
    let status = t.vm.try_exit_status().unwrap().expect("QEMU has exited");
    assert!(status.success(), "{status}");
    console
        .wait_for(
            &Pattern::substring("FERROVIRT-POWERBUTTON"),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn boots_from_qcow2_virtio_disk_through_bios() {
    boot_from_disk("qcow2", "disk.qcow2", DiskFormat::Qcow2, DiskBus::Virtio).await;
}

#[tokio::test]
async fn boots_from_raw_sata_disk_through_bios() {
    boot_from_disk("rawsata", "disk.raw", DiskFormat::Raw, DiskBus::Sata).await;
}

async fn boot_from_disk(name: &str, file: &str, format: DiskFormat, bus: DiskBus) {
    let guest = TestGuest::locate();
    let dir = tempfile::tempdir().unwrap();
    let mut spec = kernel_boot_spec(&guest, name, dir.path());
    spec.kernel_boot = None;
    spec.sockets.guest_agent = None;
    // Several tests share the image: use it read-only, or a private copy where the bus
    // cannot be read-only (SATA).
    let readonly = bus != DiskBus::Sata;
    let path = if readonly {
        guest.path(file)
    } else {
        let copy = dir.path().join(file);
        std::fs::copy(guest.path(file), &copy).unwrap();
        copy
    };
    spec.disks.push(Disk {
        id: "root".into(),
        path,
        format,
        bus,
        readonly,
        cdrom: false,
        empty: false,
        boot_order: Some(1),
        serial: Some("rootdisk".into()),
        cache: None,
        source: DiskSource::File,
        backing: Vec::new(),
    });
    let uuid = spec.uuid.clone();
    let t = TestVm::start(spec, dir, true).await;
    let (mut console, _events) = t.console_and_run().await;
    let (serial, seen_uuid) = wait_boot_marker(&mut console).await;
    assert_eq!(serial, format!("FV-{name}"));
    assert_eq!(seen_uuid.to_lowercase(), uuid);
    assert_eq!(t.vm.status().await.unwrap().status, RunState::Running);
}

async fn http_get_with_retry(port: u16, path: &str, wait: Duration) -> String {
    let deadline = Instant::now() + wait;
    let mut last = String::new();
    while Instant::now() < deadline {
        match http_get(port, path).await {
            Ok(body) if body.starts_with("HTTP/1.") && body.contains(" 200 ") => return body,
            Ok(other) => last = other,
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("no HTTP answer from the guest through port {port}: {last}");
}

async fn http_get(port: u16, path: &str) -> std::io::Result<String> {
    tokio::time::timeout(Duration::from_secs(10), async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: guest\r\n\r\n").as_bytes())
            .await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    })
    .await
    .unwrap_or_else(|_| Err(std::io::Error::other("timed out")))
}
