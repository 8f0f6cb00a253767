//! `ferrovirt demo up|console|down|status`: boots the test guest as a daemonized QEMU with its
//! serial console on a unix socket (and a log file), attaches to it, and shuts it down over QMP.
//! Interim wiring for the quick start until the server path (VirtualMachine → launcher) exists.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use ferrovirt_launcher::spec::Accel;
use ferrovirt_testkit::QmpClient;

#[derive(Debug, Subcommand)]
pub enum DemoCommand {
    /// Start the demo VM and wait until the guest is ready.
    Up(UpArgs),
    /// Attach this terminal (or pipe) to the demo VM's serial console; Ctrl+D leaves.
    Console(StateArgs),
    /// Power the demo VM off through ACPI (then kill it after 30 s).
    Down(StateArgs),
    /// Print whether the demo VM runs.
    Status(StateArgs),
}

#[derive(Debug, Args)]
pub struct StateArgs {
    /// Directory for the demo VM's sockets, logs and pid file.
    #[arg(long, default_value = ".ferrovirt/demo")]
    state_dir: PathBuf,
}

#[derive(Debug, Args)]
pub struct UpArgs {
    #[command(flatten)]
    state: StateArgs,
    /// Directory with the test guest (built by scripts/build-test-guest.sh).
    #[arg(long, default_value = "target/test-guest")]
    guest_dir: PathBuf,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 256)]
    memory: u32,
}

pub fn run(cmd: DemoCommand) -> anyhow::Result<()> {
    match cmd {
        DemoCommand::Up(a) => up(&a),
        DemoCommand::Console(s) => console(&s.state_dir),
        DemoCommand::Down(s) => down(&s.state_dir),
        DemoCommand::Status(s) => {
            match running_pid(&s.state_dir) {
                Some(pid) => println!("demo VM running (QEMU pid {pid})"),
                None => println!("demo VM not running"),
            }
            Ok(())
        }
    }
}

fn running_pid(dir: &Path) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(dir.join("qemu.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Path::new(&format!("/proc/{pid}")).exists().then_some(pid)
}

fn up(a: &UpArgs) -> anyhow::Result<()> {
    let dir = &a.state.state_dir;
    if let Some(pid) = running_pid(dir) {
        println!("demo VM already running (QEMU pid {pid})");
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    let dir = dir.canonicalize()?;
    let guest = a.guest_dir.canonicalize().with_context(|| {
        format!(
            "test guest not found in {} (run scripts/build-test-guest.sh)",
            a.guest_dir.display()
        )
    })?;
    let disk = dir.join("disk.qcow2");
    for f in ["serial.sock", "qmp.sock", "serial.log", "qemu.pid"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    // A fresh copy-on-write overlay over the guest's disk, so the image stays pristine.
    let _ = std::fs::remove_file(&disk);
    let out = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(guest.join("disk.qcow2"))
        .arg(&disk)
        .output()
        .context("running qemu-img")?;
    if !out.status.success() {
        bail!("qemu-img create: {}", String::from_utf8_lossy(&out.stderr));
    }
    let accel = ferrovirt_launcher::detect_accel();
    let (accel_arg, cpu) = match accel {
        Accel::Kvm => ("kvm", "host"),
        Accel::Tcg => ("tcg", "max"),
    };
    let uuid = "5f3c9a1e-0d1b-4c6e-8a2f-000000000001";
    let status = Command::new("qemu-system-x86_64")
        .args([
            "-name",
            "demo",
            "-machine",
            "q35",
            "-nodefaults",
            "-no-user-config",
        ])
        .args([
            "-accel",
            accel_arg,
            "-cpu",
            cpu,
            "-m",
            &a.memory.to_string(),
        ])
        .args(["-display", "none", "-daemonize"])
        .arg("-pidfile")
        .arg(dir.join("qemu.pid"))
        .arg("-chardev")
        .arg(format!(
            "socket,id=ser0,path={},server=on,wait=off,logfile={}",
            dir.join("serial.sock").display(),
            dir.join("serial.log").display()
        ))
        .args(["-serial", "chardev:ser0"])
        .arg("-qmp")
        .arg(format!(
            "unix:{},server=on,wait=off",
            dir.join("qmp.sock").display()
        ))
        .args(["-uuid", uuid, "-smbios"])
        .arg(format!(
            "type=1,manufacturer=ferrovirt,uuid={uuid},serial=demo"
        ))
        .arg("-drive")
        .arg(format!("file={},format=qcow2,if=virtio", disk.display()))
        .args([
            "-netdev",
            "user,id=net0",
            "-device",
            "virtio-net-pci,netdev=net0",
        ])
        .status()
        .context("starting qemu-system-x86_64")?;
    if !status.success() {
        bail!("qemu-system-x86_64 failed: {status}");
    }
    let pid = running_pid(&dir).unwrap_or(0);
    println!("demo VM started (QEMU pid {pid}, accel {accel:?}); waiting for the guest…");
    let t0 = Instant::now();
    let log = dir.join("serial.log");
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| l.contains("FERROVIRT-READY")) {
            let boot = text
                .lines()
                .find(|l| l.contains("FERROVIRT-BOOT"))
                .unwrap_or("");
            println!(
                "guest ready after {:.1} s: {boot}",
                t0.elapsed().as_secs_f64()
            );
            println!("{line}");
            return Ok(());
        }
        if running_pid(&dir).is_none() {
            bail!("QEMU exited before the guest was ready; serial log:\n{text}");
        }
        if t0.elapsed() > Duration::from_secs(180) {
            bail!("guest not ready after 180 s; serial log:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn console(dir: &Path) -> anyhow::Result<()> {
    let sock = UnixStream::connect(dir.join("serial.sock"))
        .with_context(|| format!("connecting to the demo console in {}", dir.display()))?;
    eprintln!("connected to the serial console; Ctrl+D (end of input) leaves");
    let mut reader = sock.try_clone()?;
    let printer = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        let mut out = std::io::stdout();
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 || out.write_all(&buf[..n]).and_then(|_| out.flush()).is_err() {
                break;
            }
        }
    });
    let mut w = sock;
    w.write_all(b"\n")?;
    std::io::copy(&mut std::io::stdin().lock(), &mut w)?;
    // Give the guest a moment to answer the last command before leaving.
    std::thread::sleep(Duration::from_millis(1500));
    w.shutdown(std::net::Shutdown::Both)?;
    let _ = printer.join();
    Ok(())
}

fn down(dir: &Path) -> anyhow::Result<()> {
    let Some(pid) = running_pid(dir) else {
        println!("demo VM not running");
        return Ok(());
    };
    let mut qmp = QmpClient::connect(&dir.join("qmp.sock"), Duration::from_secs(5))?;
    qmp.execute("system_powerdown", serde_json::json!({}))?;
    let t0 = Instant::now();
    while running_pid(dir).is_some() {
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = qmp.execute("quit", serde_json::json!({}));
            println!("guest ignored ACPI power-off for 30 s; QEMU told to quit");
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    println!(
        "demo VM (QEMU pid {pid}) powered off in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
