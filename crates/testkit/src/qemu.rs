//! Boots QEMU directly for tests: a [`QemuVm`] owns one QEMU process (killed on drop), its
//! temporary directory with the serial/QMP/guest-agent sockets, and a connected serial console.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::{QmpClient, SerialConsole, TestGuest};

/// The accelerator QEMU runs with (the launcher's type and detection: KVM only when /dev/kvm
/// opens and the CPU reports vmx or svm).
pub use ferrovirt_launcher::spec::Accel;

fn accel_args(accel: Accel) -> [&'static str; 4] {
    match accel {
        Accel::Kvm => ["-accel", "kvm", "-cpu", "host"],
        Accel::Tcg => ["-accel", "tcg", "-cpu", "max"],
    }
}

/// What the VM boots from.
#[derive(Debug, Clone)]
pub enum BootSource {
    /// A bootable disk image (virtio-blk), e.g. the guest's disk.raw / disk.qcow2.
    Disk { path: PathBuf, format: String },
    /// Direct kernel boot.
    Kernel {
        kernel: PathBuf,
        initrd: PathBuf,
        cmdline: String,
    },
}

impl BootSource {
    /// The test guest's raw disk.
    pub fn guest_disk(g: &TestGuest) -> BootSource {
        BootSource::Disk {
            path: g.disk_raw.clone(),
            format: "raw".into(),
        }
    }
    /// The test guest's kernel/initrd pair.
    pub fn guest_kernel(g: &TestGuest) -> BootSource {
        BootSource::Kernel {
            kernel: g.kernel.clone(),
            initrd: g.initrd.clone(),
            cmdline: g.cmdline.clone(),
        }
    }
}

/// How to start a [`QemuVm`].
#[derive(Debug, Clone)]
pub struct QemuVmOptions {
    pub boot: BootSource,
    pub memory_mib: u32,
    /// SMBIOS system UUID (also `-uuid`).
    pub uuid: Option<String>,
    /// SMBIOS system serial.
    pub serial: Option<String>,
    /// Forward 127.0.0.1:<free port> to the guest's port 80 through user-mode networking.
    pub http_forward: bool,
    /// Add a virtio-serial guest-agent channel.
    pub guest_agent: bool,
    /// Accelerator; `None` detects.
    pub accel: Option<Accel>,
    pub extra_args: Vec<String>,
}

impl QemuVmOptions {
    pub fn new(boot: BootSource) -> QemuVmOptions {
        QemuVmOptions {
            boot,
            memory_mib: 256,
            uuid: None,
            serial: None,
            http_forward: false,
            guest_agent: false,
            accel: None,
            extra_args: Vec::new(),
        }
    }
}

/// One running QEMU process.
pub struct QemuVm {
    child: Child,
    dir: tempfile::TempDir,
    /// The serial console (connected before the guest starts, so no output is lost).
    pub console: SerialConsole,
    /// Host port forwarded to guest port 80, when requested.
    pub http_port: Option<u16>,
}

impl std::fmt::Debug for QemuVm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QemuVm")
            .field("pid", &self.child.id())
            .finish_non_exhaustive()
    }
}

/// The QEMU argv (without the binary) for `opts`, with sockets under `dir`.
pub fn qemu_args(opts: &QemuVmOptions, dir: &Path, http_port: Option<u16>) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let mut push = |items: &[&str]| a.extend(items.iter().map(|s| s.to_string()));
    push(&["-machine", "q35", "-nodefaults", "-no-user-config"]);
    push(&accel_args(
        opts.accel.unwrap_or_else(ferrovirt_launcher::detect_accel),
    ));
    push(&["-m", &opts.memory_mib.to_string(), "-display", "none"]);
    let serial = dir.join("serial.sock");
    // wait=on: QEMU waits for the test to connect before the guest runs, so nothing is lost.
    push(&[
        "-chardev",
        &format!("socket,id=ser0,path={},server=on,wait=on", serial.display()),
        "-serial",
        "chardev:ser0",
    ]);
    push(&[
        "-qmp",
        &format!("unix:{},server=on,wait=off", dir.join("qmp.sock").display()),
    ]);
    let mut smbios = String::from("type=1,manufacturer=ferrovirt,product=testkit");
    if let Some(u) = &opts.uuid {
        smbios.push_str(&format!(",uuid={u}"));
        push(&["-uuid", u]);
    }
    if let Some(s) = &opts.serial {
        smbios.push_str(&format!(",serial={s}"));
    }
    push(&["-smbios", &smbios]);
    match &opts.boot {
        BootSource::Disk { path, format } => push(&[
            "-blockdev",
            &format!(
                "driver=file,filename={},node-name=disk0-file,read-only=on",
                path.display()
            ),
            "-blockdev",
            &format!("driver={format},file=disk0-file,node-name=disk0,read-only=on"),
            "-device",
            "virtio-blk-pci,drive=disk0,bootindex=1",
        ]),
        BootSource::Kernel {
            kernel,
            initrd,
            cmdline,
        } => push(&[
            "-kernel",
            &kernel.display().to_string(),
            "-initrd",
            &initrd.display().to_string(),
            "-append",
            cmdline,
        ]),
    }
    if let Some(p) = http_port {
        push(&[
            "-netdev",
            &format!("user,id=net0,hostfwd=tcp:127.0.0.1:{p}-:80"),
            "-device",
            "virtio-net-pci,netdev=net0",
        ]);
    }
    if opts.guest_agent {
        push(&[
            "-chardev",
            &format!(
                "socket,id=qga0,path={},server=on,wait=off",
                dir.join("qga.sock").display()
            ),
            "-device",
            "virtio-serial-pci,id=vser0",
            "-device",
            "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0",
        ]);
    }
    a.extend(opts.extra_args.iter().cloned());
    a
}

impl QemuVm {
    /// Starts QEMU and connects the serial console.
    pub fn start(opts: &QemuVmOptions) -> anyhow::Result<QemuVm> {
        let dir = tempfile::Builder::new().prefix("fv-qemu-").tempdir()?;
        let http_port = if opts.http_forward {
            Some(crate::free_port()?)
        } else {
            None
        };
        let args = qemu_args(opts, dir.path(), http_port);
        let log = std::fs::File::create(dir.path().join("qemu.log"))?;
        let child = Command::new("qemu-system-x86_64")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting qemu-system-x86_64")?;
        let mut vm = QemuVm {
            child,
            console: SerialConsole::connect(
                &dir.path().join("serial.sock"),
                Duration::from_secs(20),
            )?,
            dir,
            http_port,
        };
        if let Ok(Some(status)) = vm.child.try_wait() {
            anyhow::bail!("qemu exited at once ({status}): {}", vm.qemu_log());
        }
        Ok(vm)
    }

    /// QEMU's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The directory holding this VM's sockets and QEMU's log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// What QEMU itself wrote to stdout/stderr.
    pub fn qemu_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("qemu.log")).unwrap_or_default()
    }

    /// A new QMP session.
    pub fn qmp(&self) -> anyhow::Result<QmpClient> {
        QmpClient::connect(&self.dir.path().join("qmp.sock"), Duration::from_secs(10))
    }

    /// Path of the guest-agent socket (when `guest_agent` was set).
    pub fn qga_socket(&self) -> PathBuf {
        self.dir.path().join("qga.sock")
    }

    /// Waits until QEMU exits; `None` if it is still running after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait()? {
                return Ok(Some(s));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for QemuVm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_for_kernel_boot_with_http() {
        let mut o = QemuVmOptions::new(BootSource::Kernel {
            kernel: "/k".into(),
            initrd: "/i".into(),
            cmdline: "console=ttyS0".into(),
        });
        o.accel = Some(Accel::Tcg);
        o.uuid = Some("u-1".into());
        o.serial = Some("s-1".into());
        let a = qemu_args(&o, Path::new("/d"), Some(8080)).join(" ");
        assert!(a.contains("-accel tcg -cpu max"));
        assert!(a.contains("-kernel /k -initrd /i -append console=ttyS0"));
        assert!(a.contains("type=1,manufacturer=ferrovirt,product=testkit,uuid=u-1,serial=s-1"));
        assert!(a.contains("hostfwd=tcp:127.0.0.1:8080-:80"));
        assert!(a.contains("path=/d/serial.sock,server=on,wait=on"));
    }
}
