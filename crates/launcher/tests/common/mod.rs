//! Shared fixtures for the integration tests: the test guest, specs that boot it under TCG, and a
//! VM wrapper that kills QEMU on drop and prints its logs when a test fails.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ferrovirt_launcher::console::{Pattern, SerialConsole};
use ferrovirt_launcher::process::QemuOptions;
use ferrovirt_launcher::qga::QgaOptions;
use ferrovirt_launcher::qmp::{QmpEvent, QmpOptions};
use ferrovirt_launcher::spec::{Accel, CpuModel, KernelBoot, LaunchSpec};
use ferrovirt_launcher::{StartOptions, Vm};
use tokio::sync::{Semaphore, SemaphorePermit, broadcast};

/// Upper bound for one guest boot to its marker under TCG on a busy 2-core machine.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(90);

/// The test guest built by `scripts/build-test-guest.sh`.
pub struct TestGuest {
    pub dir: PathBuf,
}

impl TestGuest {
    /// Finds the guest: `$FERROVIRT_TEST_GUEST_DIR`, else `<repo>/target/test-guest`. Panics (the
    /// test fails, it is not skipped) when the guest has not been built.
    pub fn locate() -> TestGuest {
        let dir = std::env::var_os("FERROVIRT_TEST_GUEST_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/test-guest")
            });
        for f in ["vmlinuz", "initrd.img", "disk.raw", "disk.qcow2"] {
            assert!(
                dir.join(f).is_file(),
                "test guest file {} is missing: run scripts/build-test-guest.sh \
                 (or point FERROVIRT_TEST_GUEST_DIR at a built guest)",
                dir.join(f).display()
            );
        }
        TestGuest { dir }
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// The kernel command line the guest was built for.
    pub fn cmdline(&self) -> String {
        std::fs::read_to_string(self.dir.join("cmdline"))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "console=ttyS0 quiet panic=-1".to_string())
    }
}

/// A fresh random-looking UUID (tests need distinct ones, not cryptographic ones).
pub fn new_uuid() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let a = nanos ^ (u64::from(std::process::id()) << 32);
    let b = N
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ nanos.rotate_left(17);
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        b >> 52,
        b & 0xffff_ffff_ffff
    )
}

/// A spec that boots the test guest's kernel directly, with console, serial log and guest
/// agent sockets in `dir`, started paused so the console is attached before the guest prints.
pub fn kernel_boot_spec(guest: &TestGuest, name: &str, dir: &Path) -> LaunchSpec {
    let mut spec = LaunchSpec::new(name, new_uuid(), 256, dir.join("qmp.sock"));
    spec.smbios.serial = Some(format!("FV-{name}"));
    spec.kernel_boot = Some(KernelBoot {
        kernel: guest.path("vmlinuz"),
        initrd: Some(guest.path("initrd.img")),
        cmdline: Some(guest.cmdline()),
    });
    spec.sockets.serial = Some(dir.join("serial.sock"));
    spec.sockets.serial_log = Some(dir.join("serial.log"));
    spec.sockets.guest_agent = Some(dir.join("qga.sock"));
    spec.accel = Accel::Tcg;
    spec.cpu.model = CpuModel::Max;
    spec.tcg_tb_size_mib = Some(64);
    spec.start_paused = true;
    spec
}

/// At most this many guests run at once across the tests of one binary (TCG is CPU-heavy).
const MAX_RUNNING_GUESTS: usize = 2;

static SLOTS: Semaphore = Semaphore::const_new(MAX_RUNNING_GUESTS);

/// A started VM with its temp dir; QEMU is killed on drop, and its logs are printed when the
/// test is failing.
pub struct TestVm {
    pub vm: Vm,
    pub dir: tempfile::TempDir,
    _slot: Option<SemaphorePermit<'static>>,
}

impl TestVm {
    /// Starts `spec` (whose sockets live in `dir`). `heavy` VMs (that will run guest code) wait
    /// for a guest slot first.
    pub async fn start(spec: LaunchSpec, dir: tempfile::TempDir, heavy: bool) -> TestVm {
        let slot = if heavy {
            Some(SLOTS.acquire().await.expect("semaphore is never closed"))
        } else {
            None
        };
        let opts = StartOptions {
            qemu: QemuOptions {
                log_path: Some(dir.path().join("qemu.log")),
                ..QemuOptions::default()
            },
            qmp: QmpOptions {
                connect_timeout: Duration::from_secs(30),
                ..QmpOptions::default()
            },
            qga: QgaOptions {
                sync_timeout: Duration::from_secs(20),
                command_timeout: Duration::from_secs(20),
                ..QgaOptions::default()
            },
        };
        let vm = match Vm::start(spec, &opts).await {
            Ok(vm) => vm,
            Err(e) => {
                let log = std::fs::read_to_string(dir.path().join("qemu.log")).unwrap_or_default();
                panic!("starting QEMU failed: {e}\nQEMU log:\n{log}");
            }
        };
        TestVm {
            vm,
            dir,
            _slot: slot,
        }
    }

    /// Attaches the console, subscribes to events and lets the paused guest run.
    pub async fn console_and_run(&self) -> (SerialConsole, broadcast::Receiver<QmpEvent>) {
        let console = self.vm.console(Duration::from_secs(10)).await.unwrap();
        let events = self.vm.qmp().subscribe();
        self.vm.unpause().await.unwrap();
        (console, events)
    }
}

impl Drop for TestVm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for f in ["qemu.log", "serial.log"] {
                let text = std::fs::read_to_string(self.dir.path().join(f)).unwrap_or_default();
                let start = text.len().saturating_sub(4000);
                let start = (start..text.len())
                    .find(|&i| text.is_char_boundary(i))
                    .unwrap_or(text.len());
                eprintln!("---- {f} (tail) ----\n{}", &text[start..]);
            }
        }
    }
}

/// Waits for the boot marker and returns its (serial, uuid).
pub async fn wait_boot_marker(console: &mut SerialConsole) -> (String, String) {
    let marker = Pattern::regex(r"FERROVIRT-BOOT serial=(\S*) uuid=(\S*)").unwrap();
    let m = console.wait_for(&marker, BOOT_TIMEOUT).await.unwrap();
    (
        m.captures[0].clone().unwrap_or_default(),
        m.captures[1].clone().unwrap_or_default(),
    )
}

/// Waits until the guest says it is fully up (agent, acpid, network started).
pub async fn wait_ready(console: &mut SerialConsole) {
    console
        .wait_for(&Pattern::substring("FERROVIRT-READY"), BOOT_TIMEOUT)
        .await
        .unwrap();
}

/// Receives events until one named `name` arrives (or the timeout passes).
pub async fn wait_event(
    events: &mut broadcast::Receiver<QmpEvent>,
    name: &str,
    wait: Duration,
) -> QmpEvent {
    tokio::time::timeout(wait, async {
        loop {
            match events.recv().await {
                Ok(ev) if ev.event == name => return ev,
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => {
                    panic!("QMP closed while waiting for {name}")
                }
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no {name} event within {wait:?}"))
}

/// A loopback TCP port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
