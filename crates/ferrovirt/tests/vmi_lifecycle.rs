//! End-to-end VMI lifecycle through the real server binary and its embedded node agent, with the
//! test guest under TCG: a VMI on a PersistentVolume boots with the spec's SMBIOS UUID and runs
//! its cloud-init user-data; deleting it powers the guest off through ACPI; a guest that ignores
//! ACPI is killed after its grace period; a guest that powers itself off ends Succeeded; VMs keep
//! running (same QEMU pids) across a kill -9 of the server+agent and are re-adopted after it;
//! a VMI with a missing claim fails with the field named.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ferrovirt_testkit::cluster::pids_matching;
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(150);

fn cluster() -> anyhow::Result<Cluster> {
    TestGuest::get()?;
    Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))
}

struct VmiOpts<'a> {
    name: &'a str,
    uuid: &'a str,
    claim: &'a str,
    user_data: &'a str,
    grace: u32,
}

fn create_vmi(c: &Cluster, o: &VmiOpts) -> anyhow::Result<()> {
    let user_data: String = o
        .user_data
        .lines()
        .map(|l| format!("        {l}\n"))
        .collect();
    c.apply(&format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: {name}
  namespace: default
spec:
  terminationGracePeriodSeconds: {grace}
  domain:
    firmware:
      uuid: {uuid}
      serial: serial-{name}
    memory: {{guest: 128Mi}}
    devices:
      disks:
      - name: root
        disk: {{bus: virtio}}
      - name: cloudinit
        disk: {{bus: virtio}}
  volumes:
  - name: root
    persistentVolumeClaim: {{claimName: {claim}}}
  - name: cloudinit
    cloudInitNoCloud:
      userData: |
{user_data}"#,
        name = o.name,
        uuid = o.uuid,
        claim = o.claim,
        grace = o.grace,
    ))?;
    bind(c, o.name)
}

/// Binds a VMI to the embedded agent's node (what the scheduler does).
fn bind(c: &Cluster, name: &str) -> anyhow::Result<()> {
    c.kubectl_ok(&[
        "patch",
        "vmi",
        name,
        "--type=merge",
        "-p",
        r#"{"status":{"phase":"Scheduled","nodeName":"node1"}}"#,
    ])?;
    Ok(())
}

fn vmi(c: &Cluster, name: &str) -> anyhow::Result<Value> {
    c.get_json(&["vmi", name])
}

fn wait_phase(c: &Cluster, name: &str, phase: &str, timeout: Duration) -> anyhow::Result<Value> {
    c.wait_until(&format!("VMI {name} phase {phase}"), timeout, || {
        let v = vmi(c, name)?;
        Ok((v["status"]["phase"] == phase).then_some(v))
    })
}

fn serial_log(c: &Cluster, uid: &str) -> PathBuf {
    c.agent_dir().join("vmis").join(uid).join("serial.log")
}

fn wait_serial(c: &Cluster, log: &Path, needle: &str, timeout: Duration) -> anyhow::Result<String> {
    c.wait_until(&format!("{needle:?} in {}", log.display()), timeout, || {
        let text = String::from_utf8_lossy(&std::fs::read(log).unwrap_or_default()).into_owned();
        Ok(text
            .lines()
            .find(|l| l.contains(needle))
            .map(str::to_string))
    })
}

fn qemu_pids(uuid: &str) -> Vec<u32> {
    pids_matching(uuid)
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).starts_with("qemu-system"))
                .unwrap_or(false)
        })
        .collect()
}

#[test]
fn vmi_boots_from_a_pv_runs_cloud_init_and_powers_off_on_delete() -> anyhow::Result<()> {
    let c = cluster()?;
    c.guest_disk_claim("root1")?;
    let uuid = "6b1e9b57-2a4e-4b7c-9e0b-000000000001";
    create_vmi(
        &c,
        &VmiOpts {
            name: "vm1",
            uuid,
            claim: "root1",
            user_data: "#!/bin/sh\necho \"cloud-init wrote $(hostname)\" > /run/ci\ncat /run/ci",
            grace: 60,
        },
    )?;
    let v = wait_phase(&c, "vm1", "Running", BOOT)?;
    let uid = v["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let log = serial_log(&c, &uid);
    let marker = wait_serial(&c, &log, "FERROVIRT-BOOT", BOOT)?;
    assert!(marker.contains(&format!("uuid={uuid}")), "{marker}");
    assert!(marker.contains("serial=serial-vm1"), "{marker}");
    wait_serial(&c, &log, "cloud-init wrote vm1", BOOT)?;
    wait_serial(&c, &log, "FERROVIRT-READY hostname=vm1", BOOT)?;
    let ready = c.wait_until("Ready=True", BOOT, || {
        let v = vmi(&c, "vm1")?;
        let ok = v["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True");
        Ok(ok.then_some(()))
    });
    ready?;
    assert_eq!(qemu_pids(uuid).len(), 1, "one QEMU for the VMI");
    // The agent reports the QEMU pid, the guest OS (guest agent) and the interface's address.
    let v = c.wait_until("guestOSInfo and interface IP in status", BOOT, || {
        let v = vmi(&c, "vm1")?;
        let ok = v["status"]["guestOSInfo"]["id"] == "ferrovirt-testguest"
            && v["status"]["interfaces"][0]["ipAddress"].is_string();
        Ok(ok.then_some(v))
    })?;
    assert_eq!(v["status"]["interfaces"][0]["name"], "default");
    let pid: u32 = v["metadata"]["annotations"]["ferrovirt.io/qemu-pid"]
        .as_str()
        .unwrap_or_default()
        .parse()?;
    assert_eq!(qemu_pids(uuid), vec![pid]);
    // QEMU runs unprivileged, in the VM's memory cgroup.
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let uid_line = status
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .unwrap_or_default();
    assert!(
        uid_line.split_whitespace().nth(1) != Some("0"),
        "QEMU runs as root: {uid_line}"
    );
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    assert!(cgroups.contains(&format!("ferrovirt/{uid}")), "{cgroups}");

    // Delete: the agent presses the ACPI power button; the guest powers off well within 60 s.
    let t0 = Instant::now();
    c.kubectl_ok(&["delete", "vmi", "vm1", "--timeout=90s"])?;
    let took = t0.elapsed();
    assert!(
        qemu_pids(uuid).is_empty(),
        "QEMU still running after delete"
    );
    let text = String::from_utf8_lossy(&std::fs::read(&log).unwrap_or_default()).into_owned();
    assert!(!log.exists() || text.contains("FERROVIRT-POWERBUTTON"));
    assert!(took < Duration::from_secs(60), "delete took {took:?}");
    let events = c.kubectl_ok(&["get", "events", "-o", "json"])?;
    assert!(events.contains("ShuttingDown"), "{events}");
    eprintln!("VMI delete with ACPI power-off took {took:?}");
    Ok(())
}

#[test]
fn guest_that_ignores_acpi_is_killed_after_its_grace_period() -> anyhow::Result<()> {
    let c = cluster()?;
    c.guest_disk_claim("root2")?;
    let uuid = "6b1e9b57-2a4e-4b7c-9e0b-000000000002";
    create_vmi(
        &c,
        &VmiOpts {
            name: "stubborn",
            uuid,
            claim: "root2",
            user_data: "#!/bin/sh\nkillall acpid\necho acpid-stopped",
            grace: 5,
        },
    )?;
    let v = wait_phase(&c, "stubborn", "Running", BOOT)?;
    let uid = v["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    wait_serial(&c, &serial_log(&c, &uid), "acpid-stopped", BOOT)?;
    let t0 = Instant::now();
    c.kubectl_ok(&["delete", "vmi", "stubborn", "--timeout=90s"])?;
    let took = t0.elapsed();
    assert!(qemu_pids(uuid).is_empty(), "QEMU still running");
    assert!(
        took >= Duration::from_secs(5),
        "QEMU went away before the grace period ({took:?})"
    );
    assert!(took < Duration::from_secs(40), "took {took:?}");
    Ok(())
}

#[test]
fn guest_poweroff_ends_succeeded_and_missing_claim_fails() -> anyhow::Result<()> {
    let c = cluster()?;
    c.guest_disk_claim("root3")?;
    create_vmi(
        &c,
        &VmiOpts {
            name: "short",
            uuid: "6b1e9b57-2a4e-4b7c-9e0b-000000000003",
            claim: "root3",
            user_data: "#!/bin/sh\n(sleep 2; poweroff) &",
            grace: 30,
        },
    )?;
    let v = wait_phase(&c, "short", "Succeeded", BOOT)?;
    assert_eq!(v["status"]["reason"], "GuestShutdown", "{v}");

    create_vmi(
        &c,
        &VmiOpts {
            name: "noclaim",
            uuid: "6b1e9b57-2a4e-4b7c-9e0b-000000000004",
            claim: "does-not-exist",
            user_data: "#!/bin/sh\n",
            grace: 30,
        },
    )?;
    let v = wait_phase(&c, "noclaim", "Failed", Duration::from_secs(60))?;
    let msg = v["status"]["conditions"][0]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(
        msg.contains("spec.volumes[0].persistentVolumeClaim.claimName"),
        "{v}"
    );
    // A failed VMI can be deleted at once (nothing runs).
    c.kubectl_ok(&["delete", "vmi", "noclaim", "--timeout=30s"])?;
    Ok(())
}

#[test]
fn vms_survive_a_killed_agent_and_are_adopted_again() -> anyhow::Result<()> {
    let mut c = cluster()?;
    let uuids = [
        "6b1e9b57-2a4e-4b7c-9e0b-000000000005",
        "6b1e9b57-2a4e-4b7c-9e0b-000000000006",
    ];
    for (i, uuid) in uuids.iter().enumerate() {
        let claim = format!("root-k{i}");
        c.guest_disk_claim(&claim)?;
        create_vmi(
            &c,
            &VmiOpts {
                name: &format!("keep{i}"),
                uuid,
                claim: &claim,
                user_data: "#!/bin/sh\n",
                grace: 30,
            },
        )?;
    }
    for i in 0..2 {
        wait_phase(&c, &format!("keep{i}"), "Running", BOOT)?;
    }
    let before: Vec<Vec<u32>> = uuids.iter().map(|u| qemu_pids(u)).collect();
    assert!(before.iter().all(|p| p.len() == 1), "{before:?}");

    // kill -9 of the server process, which embeds the agent.
    c.kill_server()?;
    std::thread::sleep(Duration::from_secs(2));
    let during: Vec<Vec<u32>> = uuids.iter().map(|u| qemu_pids(u)).collect();
    assert_eq!(before, during, "QEMU pids changed while the agent was down");

    c.restart_server()?;
    for i in 0..2 {
        let name = format!("keep{i}");
        // Still Running, and the agent reports it again (a fresh heartbeat of conditions).
        wait_phase(&c, &name, "Running", Duration::from_secs(30))?;
    }
    let after: Vec<Vec<u32>> = uuids.iter().map(|u| qemu_pids(u)).collect();
    assert_eq!(before, after, "QEMU pids changed across the agent restart");
    // The console of a re-adopted VM still works (through the API and the CLI, in a pipe).
    c.wait_until(
        "the uuid through the console after the restart",
        BOOT,
        || {
            let out = console_exec(&c, "keep1", "cat /sys/class/dmi/id/product_uuid")?;
            Ok(out.contains(uuids[1]).then_some(()))
        },
    )?;
    // The re-adopted VMs are still controlled: deleting one powers it off.
    c.kubectl_ok(&["delete", "vmi", "keep0", "--timeout=90s"])?;
    assert!(qemu_pids(uuids[0]).is_empty());
    assert_eq!(qemu_pids(uuids[1]), before[1]);
    Ok(())
}

/// Runs `cmd` in the VMI's guest shell with `ferrovirt console` in a pipe; returns its output.
fn console_exec(c: &Cluster, name: &str, cmd: &str) -> anyhow::Result<String> {
    use std::io::Write;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ferrovirt"))
        .arg("--kubeconfig")
        .arg(&c.kubeconfig)
        .args(["console", name, "--quiet-seconds", "3"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .ok_or_else(|| anyhow::anyhow!("stdin"))?
        .write_all(format!("\n{cmd}\n").as_bytes())?;
    let out = child.wait_with_output()?;
    anyhow::ensure!(
        out.status.success(),
        "ferrovirt console failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
