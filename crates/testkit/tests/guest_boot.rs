//! End-to-end tests of the test guest itself with plain QEMU (TCG where KVM is unusable):
//! disk boot with the SMBIOS UUID in the boot marker and HTTP through a user-mode port forward,
//! direct kernel boot with a shell command, ACPI power-off over QMP, the guest agent, and
//! NoCloud user-data.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::Duration;

use ferrovirt_testkit::guest::{READY_MARKER, parse_boot_marker};
use ferrovirt_testkit::{BootSource, QemuVm, QemuVmOptions, TestGuest};

const BOOT_TIMEOUT: Duration = Duration::from_secs(120);

#[test]
fn disk_boot_prints_uuid_and_serves_http() -> anyhow::Result<()> {
    let g = TestGuest::get()?;
    let mut o = QemuVmOptions::new(BootSource::guest_disk(&g));
    o.uuid = Some("0b9a3c1e-5d4f-4e2a-9c77-1f2e3d4c5b6a".into());
    o.serial = Some("fv-serial-42".into());
    o.http_forward = true;
    let vm = QemuVm::start(&o)?;
    let line = vm.console.wait_for("FERROVIRT-BOOT", BOOT_TIMEOUT)?;
    let (serial, uuid) = parse_boot_marker(&line).expect("marker");
    assert_eq!(uuid.to_lowercase(), "0b9a3c1e-5d4f-4e2a-9c77-1f2e3d4c5b6a");
    assert_eq!(serial, "fv-serial-42");
    vm.console.wait_for(READY_MARKER, BOOT_TIMEOUT)?;
    let body = ferrovirt_testkit::http_get(vm.http_port.expect("port"), "/", BOOT_TIMEOUT)?;
    assert!(body.contains("hostname=ferrovirt-guest"), "body: {body}");
    assert!(body.contains("uptime="), "body: {body}");
    Ok(())
}

#[test]
fn kernel_boot_reaches_a_shell() -> anyhow::Result<()> {
    let g = TestGuest::get()?;
    let vm = QemuVm::start(&QemuVmOptions::new(BootSource::guest_kernel(&g)))?;
    vm.console.wait_for("FERROVIRT-BOOT", BOOT_TIMEOUT)?;
    vm.console.wait_for(READY_MARKER, BOOT_TIMEOUT)?;
    let kver = std::fs::read_to_string(g.dir.join("kernel-version"))?;
    let (out, rc) = vm.console.exec("uname -r", Duration::from_secs(30))?;
    assert_eq!(rc, 0);
    assert_eq!(out.trim(), kver.trim());
    let (out, rc) = vm
        .console
        .exec("cat /nonexistent", Duration::from_secs(30))?;
    assert_ne!(rc, 0, "{out}");
    Ok(())
}

#[test]
fn system_powerdown_over_qmp_stops_qemu_within_30s() -> anyhow::Result<()> {
    let g = TestGuest::get()?;
    let mut vm = QemuVm::start(&QemuVmOptions::new(BootSource::Disk {
        path: g.disk_qcow2.clone(),
        format: "qcow2".into(),
    }))?;
    vm.console.wait_for(READY_MARKER, BOOT_TIMEOUT)?;
    let mut qmp = vm.qmp()?;
    let status = qmp.execute("query-status", serde_json::json!({}))?;
    assert_eq!(status["status"], "running");
    let t0 = std::time::Instant::now();
    qmp.execute("system_powerdown", serde_json::json!({}))?;
    let exit = vm.wait_exit(Duration::from_secs(30))?;
    let exit = exit.unwrap_or_else(|| panic!("QEMU still running 30 s after system_powerdown"));
    assert!(exit.success(), "QEMU exit: {exit}");
    vm.console
        .wait_for("FERROVIRT-POWERBUTTON", Duration::from_secs(1))?;
    eprintln!("powerdown → QEMU exit: {:?}", t0.elapsed());
    Ok(())
}

#[test]
fn guest_agent_answers() -> anyhow::Result<()> {
    let g = TestGuest::get()?;
    let mut o = QemuVmOptions::new(BootSource::guest_kernel(&g));
    o.guest_agent = true;
    let vm = QemuVm::start(&o)?;
    vm.console.wait_for("FERROVIRT-QGA started", BOOT_TIMEOUT)?;
    let s = UnixStream::connect(vm.qga_socket())?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut w = s.try_clone()?;
    let mut r = BufReader::new(s);
    // guest-sync makes sure no stale reply is in flight.
    w.write_all(b"{\"execute\":\"guest-sync\",\"arguments\":{\"id\":4242}}\n")?;
    let mut line = String::new();
    r.read_line(&mut line)?;
    assert!(line.contains("4242"), "{line}");
    w.write_all(b"{\"execute\":\"guest-get-osinfo\"}\n")?;
    line.clear();
    r.read_line(&mut line)?;
    let v: serde_json::Value = serde_json::from_str(&line)?;
    assert_eq!(v["return"]["id"], "ferrovirt-testguest", "{line}");
    Ok(())
}

#[test]
fn nocloud_user_data_runs() -> anyhow::Result<()> {
    let g = TestGuest::get()?;
    let dir = tempfile::tempdir()?;
    let img = dir.path().join("cidata.img");
    std::fs::write(
        dir.path().join("meta-data"),
        "instance-id: i-1\nlocal-hostname: vm-from-nocloud\n",
    )?;
    std::fs::write(
        dir.path().join("user-data"),
        "#!/bin/sh\necho \"user-data ran on $(hostname)\" > /run/marker\ncat /run/marker\n",
    )?;
    run(Command::new("truncate").args(["-s", "2M"]).arg(&img))?;
    run(Command::new("mkfs.vfat").args(["-n", "CIDATA"]).arg(&img))?;
    run(Command::new("mcopy")
        .arg("-i")
        .arg(&img)
        .arg(dir.path().join("meta-data"))
        .arg(dir.path().join("user-data"))
        .arg("::/"))?;
    let mut o = QemuVmOptions::new(BootSource::guest_kernel(&g));
    o.extra_args = vec![
        "-drive".into(),
        format!("file={},format=raw,if=virtio,readonly=on", img.display()),
    ];
    let vm = QemuVm::start(&o)?;
    vm.console
        .wait_for("user-data ran on vm-from-nocloud", BOOT_TIMEOUT)?;
    vm.console
        .wait_for("FERROVIRT-USERDATA rc=0", BOOT_TIMEOUT)?;
    vm.console
        .wait_for("FERROVIRT-READY hostname=vm-from-nocloud", BOOT_TIMEOUT)?;
    Ok(())
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let out = cmd.output()?;
    anyhow::ensure!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
