//! Runs real QEMU with the vCPUs stopped (`-S`, so no guest code and little CPU): every device
//! kind the command line builder emits must be accepted and visible over QMP; startup failures
//! must surface QEMU's stderr; the grace period must end in SIGKILL.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::*;
use ferrovirt_launcher::Error;
use ferrovirt_launcher::qmp::{QmpClient, RunState};
use ferrovirt_launcher::spec::{
    CacheMode, Disk, DiskBus, DiskFormat, DiskSource, ForwardProtocol, HostForward, KernelBoot,
    Nic, NicBackend, NicModel,
};
use ferrovirt_launcher::{ShutdownOutcome, ShutdownPolicy, StartOptions, Vm};
use tokio::io::AsyncReadExt;

fn disk(id: &str, path: std::path::PathBuf, format: DiskFormat, bus: DiskBus) -> Disk {
    Disk {
        id: id.into(),
        path,
        format,
        bus,
        readonly: true,
        cdrom: false,
        empty: false,
        boot_order: None,
        serial: None,
        cache: None,
        source: DiskSource::File,
        backing: Vec::new(),
    }
}

fn t_dir_file(dir: &std::path::Path, name: &str, size: u64) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::File::create(&path).unwrap().set_len(size).unwrap();
    path
}

/// The ids of the devices under `/machine/peripheral` (every `-device` given an id).
async fn peripheral_ids(qmp: &QmpClient) -> HashSet<String> {
    qmp.execute(
        "qom-list",
        Some(serde_json::json!({"path": "/machine/peripheral"})),
    )
    .await
    .unwrap()
    .as_array()
    .unwrap()
    .iter()
    .filter_map(|p| p["name"].as_str().map(str::to_string))
    .collect()
}

#[tokio::test]
async fn real_qemu_accepts_every_device_kind_and_reports_them_over_qmp() {
    let guest = TestGuest::locate();
    let dir = tempfile::tempdir().unwrap();
    let mut spec = kernel_boot_spec(&guest, "devices", dir.path());
    spec.kernel_boot = None;
    spec.sandbox = true;
    spec.rng = true;
    spec.balloon = true;
    spec.cpu.sockets = 1;
    spec.cpu.cores = 2;
    spec.smbios.product = Some("ferrovirt-test".into());
    spec.smbios.family = Some("tests".into());
    spec.sockets.vnc = Some(dir.path().join("vnc.sock"));

    let mut root = disk(
        "root",
        guest.path("disk.qcow2"),
        DiskFormat::Qcow2,
        DiskBus::Virtio,
    );
    root.boot_order = Some(1);
    root.serial = Some("root,serial".into());
    root.cache = Some(CacheMode::Writeback);
    // SATA disks cannot be read-only: give this one a blank image of its own
    let blank = t_dir_file(dir.path(), "blank.raw", 1 << 20);
    let mut sata = disk("sata0", blank, DiskFormat::Raw, DiskBus::Sata);
    sata.readonly = false;
    let mut cd = disk(
        "cd0",
        guest.path("disk.raw"),
        DiskFormat::Raw,
        DiskBus::Scsi,
    );
    cd.cdrom = true;
    cd.readonly = false; // a CD-ROM is read-only anyway
    let mut sata_cd = disk(
        "cd1",
        guest.path("disk.raw"),
        DiskFormat::Raw,
        DiskBus::Sata,
    );
    sata_cd.cdrom = true;
    let scsi = disk(
        "scsi1",
        guest.path("disk.raw"),
        DiskFormat::Raw,
        DiskBus::Scsi,
    );
    let usb = disk(
        "usb0",
        guest.path("disk.qcow2"),
        DiskFormat::Qcow2,
        DiskBus::Usb,
    );
    // Empty CD-ROM drives (no medium: a volume can be inserted later).
    let mut empty_cds = Vec::new();
    for (id, bus) in [("cd2", DiskBus::Scsi), ("cd3", DiskBus::Sata)] {
        let mut d = disk(id, "".into(), DiskFormat::Raw, bus);
        d.cdrom = true;
        d.empty = true;
        empty_cds.push(d);
    }
    spec.disks = vec![root, sata, cd, sata_cd, scsi, usb];
    spec.disks.extend(empty_cds);

    let fwd_port = free_port();
    spec.nics = vec![
        Nic {
            id: "net0".into(),
            mac: Some("52:54:00:aa:bb:01".into()),
            model: NicModel::VirtioNetPci,
            backend: NicBackend::User {
                forwards: vec![HostForward {
                    protocol: ForwardProtocol::Tcp,
                    host_addr: "127.0.0.1".into(),
                    host_port: fwd_port,
                    guest_port: 22,
                }],
            },
            boot_order: Some(2),
        },
        Nic {
            id: "net1".into(),
            mac: Some("52:54:00:aa:bb:02".into()),
            model: NicModel::E1000e,
            backend: NicBackend::None,
            boot_order: None,
        },
    ];
    let uuid = spec.uuid.clone();
    let mut t = TestVm::start(spec, dir, false).await;
    let qmp = t.vm.qmp();

    let st = qmp.query_status().await.unwrap();
    assert_eq!(st.status, RunState::Prelaunch);
    assert!(!st.running);
    assert_eq!(
        qmp.execute("query-uuid", None).await.unwrap()["UUID"],
        uuid.as_str()
    );
    assert_eq!(
        qmp.execute("query-name", None).await.unwrap()["name"],
        "devices"
    );
    let cpus = qmp.execute("query-cpus-fast", None).await.unwrap();
    assert_eq!(cpus.as_array().unwrap().len(), 2);

    // every device we asked for exists under its id
    let names = peripheral_ids(qmp).await;
    for id in [
        "root",
        "sata0",
        "cd0",
        "cd1",
        "scsi1",
        "usb0",
        "scsi0",
        "usb",
        "net0",
        "net1",
        "balloon0",
        "video0",
        "virtio-serial0",
    ] {
        assert!(names.contains(id), "device {id} missing from {names:?}");
    }
    // the MAC made it to the NIC
    let mac = qmp
        .execute(
            "qom-get",
            Some(serde_json::json!({"path": "/machine/peripheral/net1", "property": "mac"})),
        )
        .await
        .unwrap();
    assert_eq!(mac, "52:54:00:aa:bb:02");

    // block nodes: both layers per disk, read-only as requested
    let nodes = qmp.execute("query-named-block-nodes", None).await.unwrap();
    let nodes = nodes.as_array().unwrap();
    for id in ["root", "sata0", "cd0", "cd1", "scsi1", "usb0"] {
        for layer in ["file", "fmt"] {
            let name = format!("{layer}-{id}");
            let node = nodes
                .iter()
                .find(|n| n["node-name"] == name.as_str())
                .unwrap_or_else(|| panic!("node {name} missing"));
            assert_eq!(node["ro"], id != "sata0", "{name}");
        }
    }

    // the empty CD-ROMs: removable drives without a medium, no block nodes
    assert!(
        !nodes.iter().any(|n| n["node-name"]
            .as_str()
            .is_some_and(|n| n.ends_with("-cd2") || n.ends_with("-cd3"))),
        "{nodes:?}"
    );
    let blocks = qmp.execute("query-block", None).await.unwrap();
    for id in ["cd2", "cd3"] {
        let b = blocks
            .as_array()
            .unwrap()
            .iter()
            .find(|b| {
                b["qdev"]
                    .as_str()
                    .is_some_and(|q| q == id || q.contains(&format!("/{id}/")))
            })
            .unwrap_or_else(|| panic!("{id} not in query-block: {blocks}"));
        assert_eq!(b["removable"], true, "{b}");
        assert!(b.get("inserted").is_none(), "{id} has no medium: {b}");
    }

    // VNC on its unix socket speaks RFB
    let mut vnc = tokio::net::UnixStream::connect(t.dir.path().join("vnc.sock"))
        .await
        .unwrap();
    let mut banner = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(10), vnc.read_exact(&mut banner))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&banner[..4], b"RFB ");

    // the user-mode host forward listens on loopback
    tokio::net::TcpStream::connect(("127.0.0.1", fwd_port))
        .await
        .unwrap();

    // QMP errors come back as typed errors
    match qmp.execute("no-such-command", None).await {
        Err(Error::Command { class, .. }) => assert_eq!(class, "CommandNotFound"),
        other => panic!("expected a command error, got {other:?}"),
    }

    qmp.quit().await.unwrap();
    let status = t.vm.wait_exit(Duration::from_secs(20)).await.unwrap();
    assert!(status.success(), "{status}");
}

#[tokio::test]
async fn grace_period_expiry_kills_a_guest_that_ignores_the_power_button() {
    let guest = TestGuest::locate();
    let dir = tempfile::tempdir().unwrap();
    // Never resumed: the vCPUs stay stopped and nobody handles the power button.
    let spec = kernel_boot_spec(&guest, "stubborn", dir.path());
    let mut t = TestVm::start(spec, dir, false).await;
    let started = Instant::now();
    let policy = ShutdownPolicy {
        grace: Duration::from_secs(2),
        resend_interval: Some(Duration::from_millis(500)),
        kill_timeout: Duration::from_secs(10),
    };
    let outcome = t.vm.shutdown(&policy).await.unwrap();
    let took = started.elapsed();
    assert_eq!(outcome, ShutdownOutcome::Killed);
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(12),
        "{took:?}"
    );
    use std::os::unix::process::ExitStatusExt;
    let status = t.vm.try_exit_status().unwrap().expect("QEMU was reaped");
    assert_eq!(status.signal(), Some(9));
    // shutting down an exited VM is a no-op
    assert_eq!(
        t.vm.shutdown(&policy).await.unwrap(),
        ShutdownOutcome::AlreadyExited
    );
}

#[tokio::test]
async fn qemu_startup_failure_surfaces_its_stderr() {
    let guest = TestGuest::locate();
    let dir = tempfile::tempdir().unwrap();
    let mut spec = kernel_boot_spec(&guest, "broken", dir.path());
    let missing = dir.path().join("no-such-kernel");
    spec.kernel_boot = Some(KernelBoot {
        kernel: missing.clone(),
        initrd: None,
        cmdline: None,
    });
    let err = Vm::start(spec, &StartOptions::default()).await.unwrap_err();
    match err {
        Error::QemuExited { stderr, .. } => {
            assert!(stderr.contains("no-such-kernel"), "{stderr}")
        }
        other => panic!("expected QemuExited, got {other}"),
    }
}

#[tokio::test]
async fn invalid_spec_is_rejected_before_qemu_starts() {
    let guest = TestGuest::locate();
    let dir = tempfile::tempdir().unwrap();
    let mut spec = kernel_boot_spec(&guest, "invalid", dir.path());
    spec.uuid = "nope".into();
    let err = Vm::start(spec, &StartOptions::default()).await.unwrap_err();
    assert!(matches!(err, Error::InvalidSpec(_)), "{err}");
}

/// Every platform option (machine properties, RTC base, CPU flags, watchdog, pvpanic, tablets,
/// sound, chassis, -no-reboot) is accepted by real QEMU, and the devices exist under their ids.
#[tokio::test]
async fn real_qemu_accepts_every_platform_option() {
    use ferrovirt_launcher::platform::{Chassis, Platform, SoundModel, TabletBus, WatchdogAction};
    let guest = TestGuest::locate();
    let dir = tempfile::tempdir().unwrap();
    let mut spec = kernel_boot_spec(&guest, "platform", dir.path());
    spec.kernel_boot = None;
    spec.sandbox = true;
    spec.platform = Platform {
        no_reboot: true,
        acpi: Some(true),
        smm: Some(false),
        hpet: Some(false),
        rtc_base: Some("2001-09-09T02:46:40".into()),
        rtc_catchup: true,
        rtc_track_guest: true,
        kvm_hidden: true,
        pv_unhalt_off: true,
        // `max` under TCG has SSE4.2; turning a flag off always works.
        cpu_flags: vec!["+sse4.2".into(), "-avx512f".into()],
        cpu_enforce: false,
        watchdog: Some(WatchdogAction::Poweroff),
        pvpanic: true,
        tablets: vec![TabletBus::Usb, TabletBus::Virtio],
        chassis: Some(Chassis {
            manufacturer: Some("Acme, Inc".into()),
            asset: Some("A-1".into()),
            ..Chassis::default()
        }),
        sound: Some(SoundModel::Ich9),
    };
    let mut t = TestVm::start(spec, dir, false).await;
    let qmp = t.vm.qmp();
    let names = peripheral_ids(qmp).await;
    for id in ["watchdog0", "panic0", "tablet0", "tablet1", "sound0", "usb"] {
        assert!(names.contains(id), "device {id} missing from {names:?}");
    }
    let hpet = qmp
        .execute(
            "qom-get",
            Some(serde_json::json!({"path": "/machine", "property": "hpet"})),
        )
        .await
        .unwrap();
    assert_eq!(hpet, false);
    qmp.quit().await.unwrap();
    let status = t.vm.wait_exit(Duration::from_secs(20)).await.unwrap();
    assert!(status.success(), "{status}");
}
