//! End-to-end VirtualMachine lifecycle through the real server (controllers, scheduler, embedded
//! agent) with the test guest under TCG: `kubectl apply` of a VM with runStrategy Always gives a
//! Running VMI and `kubectl get vm` prints Running/True; a guest that powers itself off is
//! started again (new VMI uid) under Always and left Stopped under RerunOnFailure; switching to
//! Halted stops the VM and removes its VMI. `kubectl delete vm --wait` returns only once QEMU is
//! gone (the VM's `kubevirt.io/virtualMachineControllerFinalize` finalizer), and
//! `--cascade=orphan` leaves the VMI.

use std::time::Duration;

use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(180);

fn cluster() -> anyhow::Result<Cluster> {
    TestGuest::get()?;
    Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))
}

fn vm_manifest(c: &Cluster, name: &str, strategy: &str, user_data: &str) -> anyhow::Result<String> {
    c.guest_disk_claim(&format!("{name}-root"))?;
    let user_data: String = user_data
        .lines()
        .map(|l| format!("                {l}\n"))
        .collect();
    Ok(format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: {name}
  namespace: default
spec:
  runStrategy: {strategy}
  template:
    metadata:
      labels: {{app: {name}}}
    spec:
      terminationGracePeriodSeconds: 30
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - name: root
            disk: {{bus: virtio}}
          - name: cloudinit
            disk: {{bus: virtio}}
      volumes:
      - name: root
        persistentVolumeClaim: {{claimName: {name}-root}}
      - name: cloudinit
        cloudInitNoCloud:
          userData: |
{user_data}"#
    ))
}

fn vmi_state(c: &Cluster, name: &str) -> anyhow::Result<Option<(String, String)>> {
    let out = c.kubectl(&["get", "vmi", name, "-o", "json"])?;
    if !out.status.success() {
        return Ok(None);
    }
    let v: Value = serde_json::from_slice(&out.stdout)?;
    Ok(Some((
        v["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        v["status"]["phase"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    )))
}

fn wait_running(c: &Cluster, name: &str) -> anyhow::Result<String> {
    c.wait_until(&format!("VMI {name} Running"), BOOT, || {
        Ok(vmi_state(c, name)?
            .filter(|(_, p)| p == "Running")
            .map(|(uid, _)| uid))
    })
}

fn printable_status(c: &Cluster, name: &str) -> anyhow::Result<String> {
    let v = c.get_json(&["vm", name])?;
    Ok(v["status"]["printableStatus"]
        .as_str()
        .unwrap_or_default()
        .to_string())
}

#[test]
fn always_vm_runs_restarts_after_guest_poweroff_and_stops_when_halted() -> anyhow::Result<()> {
    let c = cluster()?;
    c.apply(&vm_manifest(&c, "web", "Always", "#!/bin/sh\necho up")?)?;
    let uid1 = wait_running(&c, "web")?;
    let table = c.kubectl_ok(&["get", "vm", "web"])?;
    let row = table.lines().nth(1).unwrap_or_default().to_string();
    assert!(table.starts_with("NAME"), "{table}");
    c.wait_until("kubectl get vm: Running True", BOOT, || {
        let t = c.kubectl_ok(&["get", "vm", "web"])?;
        let row = t.lines().nth(1).unwrap_or_default().to_string();
        let cols: Vec<&str> = row.split_whitespace().collect();
        Ok((cols.get(2) == Some(&"Running") && cols.get(3) == Some(&"True")).then_some(()))
    })
    .map_err(|e| e.context(format!("first row was {row:?}")))?;

    // Power off from inside the guest, through its serial console.
    let dir = c.agent_dir().join("vmis").join(&uid1).join("serial.sock");
    c.wait_until("guest ready", BOOT, || {
        let log = std::fs::read(dir.with_file_name("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    let console = ferrovirt_testkit::SerialConsole::connect(&dir, Duration::from_secs(10))?;
    console.send_line("poweroff")?;
    let uid2 = c.wait_until("a new VMI after the guest powered off", BOOT, || {
        Ok(vmi_state(&c, "web")?
            .and_then(|(uid, phase)| (uid != uid1 && phase == "Running").then_some(uid)))
    })?;
    assert_ne!(uid1, uid2);

    // Halted: the VMI goes away and the VM prints Stopped.
    c.kubectl_ok(&[
        "patch",
        "vm",
        "web",
        "--type=merge",
        "-p",
        r#"{"spec":{"runStrategy":"Halted"}}"#,
    ])?;
    c.wait_until("VMI gone after Halted", BOOT, || {
        Ok(vmi_state(&c, "web")?.is_none().then_some(()))
    })?;
    c.wait_until("printableStatus Stopped", Duration::from_secs(30), || {
        Ok((printable_status(&c, "web")? == "Stopped").then_some(()))
    })?;

    // The virtctl verbs through the CLI: start, restart (a new VMI uid), stop.
    let fv = |args: &[&str]| -> anyhow::Result<String> {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrovirt"))
            .arg("--kubeconfig")
            .arg(&c.kubeconfig)
            .args(args)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "ferrovirt {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    assert_eq!(
        fv(&["start", "web"])?.trim(),
        "VM web was scheduled to start"
    );
    let uid3 = wait_running(&c, "web")?;
    fv(&["restart", "web"])?;
    let uid4 = c.wait_until("a new VMI after restart", BOOT, || {
        Ok(vmi_state(&c, "web")?
            .and_then(|(uid, phase)| (uid != uid3 && phase == "Running").then_some(uid)))
    })?;
    assert_ne!(uid3, uid4);
    fv(&["stop", "web"])?;
    c.wait_until("VMI gone after stop", BOOT, || {
        Ok(vmi_state(&c, "web")?.is_none().then_some(()))
    })?;

    // Deleting the VM removes it and its VMI (owner references, the agent's finalizer).
    fv(&["start", "web"])?;
    wait_running(&c, "web")?;
    c.kubectl_ok(&["delete", "vm", "web", "--timeout=120s"])?;
    c.wait_until("VMI gone after the VM was deleted", BOOT, || {
        Ok(vmi_state(&c, "web")?.is_none().then_some(()))
    })?;
    Ok(())
}

#[test]
fn rerun_on_failure_vm_stays_stopped_after_a_clean_guest_poweroff() -> anyhow::Result<()> {
    let c = cluster()?;
    c.apply(&vm_manifest(
        &c,
        "batch",
        "RerunOnFailure",
        "#!/bin/sh\n(sleep 1; poweroff) &",
    )?)?;
    let uid = c.wait_until("VMI Succeeded", BOOT, || {
        Ok(vmi_state(&c, "batch")?.and_then(|(uid, phase)| (phase == "Succeeded").then_some(uid)))
    })?;
    // Not restarted: the same (Succeeded) VMI stays, and the VM is not running.
    std::thread::sleep(Duration::from_secs(8));
    let (uid_now, phase) = vmi_state(&c, "batch")?.unwrap_or_default();
    assert_eq!(
        (uid_now.as_str(), phase.as_str()),
        (uid.as_str(), "Succeeded")
    );
    let st = printable_status(&c, "batch")?;
    assert!(st == "Stopped" || st == "Succeeded", "printableStatus {st}");
    Ok(())
}

#[test]
fn instancetype_is_pinned_in_a_controller_revision_across_restarts() -> anyhow::Result<()> {
    let c = cluster()?;
    c.guest_disk_claim("sized-root")?;
    c.apply(
        r#"
apiVersion: instancetype.kubevirt.io/v1beta1
kind: VirtualMachineClusterInstancetype
metadata: {name: tiny}
spec:
  cpu: {guest: 1}
  memory: {guest: 128Mi}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: sized, namespace: default}
spec:
  runStrategy: Always
  instancetype: {name: tiny}
  template:
    spec:
      domain:
        devices:
          disks:
          - name: root
            disk: {bus: virtio}
      volumes:
      - name: root
        persistentVolumeClaim: {claimName: sized-root}
"#,
    )?;
    let uid1 = wait_running(&c, "sized")?;
    let vmi = c.get_json(&["vmi", "sized"])?;
    assert_eq!(vmi["spec"]["domain"]["memory"]["guest"], "128Mi", "{vmi}");
    let vm = c.get_json(&["vm", "sized"])?;
    let rev = vm["spec"]["instancetype"]["revisionName"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(!rev.is_empty(), "no revisionName recorded: {vm}");
    let cr = c.get_json(&["controllerrevision", &rev])?;
    assert_eq!(cr["data"]["spec"]["memory"]["guest"], "128Mi");
    // Growing the instancetype does not change the VM: a restart keeps the pinned sizing.
    c.kubectl_ok(&[
        "patch",
        "virtualmachineclusterinstancetype",
        "tiny",
        "--type=merge",
        "-p",
        r#"{"spec":{"memory":{"guest":"256Mi"}}}"#,
    ])?;
    c.kubectl_ok(&["delete", "vmi", "sized", "--timeout=120s"])?;
    let uid2 = c.wait_until("the VMI recreated", BOOT, || {
        Ok(vmi_state(&c, "sized")?
            .and_then(|(uid, phase)| (uid != uid1 && phase == "Running").then_some(uid)))
    })?;
    assert_ne!(uid1, uid2);
    let vmi = c.get_json(&["vmi", "sized"])?;
    assert_eq!(vmi["spec"]["domain"]["memory"]["guest"], "128Mi", "{vmi}");
    Ok(())
}

/// The `-m` size QEMU of the VMI `uid` was started with.
fn qemu_memory_arg(c: &Cluster, uid: &str) -> anyhow::Result<String> {
    let argv: Vec<String> = serde_json::from_slice(&std::fs::read(
        c.agent_dir().join("vmis").join(uid).join("qemu-argv.json"),
    )?)?;
    argv.windows(2)
        .find(|w| w[0] == "-m")
        .map(|w| w[1].clone())
        .ok_or_else(|| anyhow::anyhow!("no -m in {argv:?}"))
}

#[test]
fn memory_request_change_reaches_the_next_vmi() -> anyhow::Result<()> {
    let c = cluster()?;
    c.guest_disk_claim("grow-root")?;
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: grow, namespace: default}
spec:
  runStrategy: Always
  template:
    spec:
      terminationGracePeriodSeconds: 5
      domain:
        resources: {requests: {memory: 128Mi}}
        devices:
          disks:
          - name: root
            disk: {bus: virtio}
      volumes:
      - name: root
        persistentVolumeClaim: {claimName: grow-root}
"#,
    )?;
    // The stored VM is as written: VMI defaults (guest memory, CPU topology, the pod network
    // interface) belong to the VMI, as in KubeVirt.
    let vm = c.get_json(&["vm", "grow"])?;
    let domain = &vm["spec"]["template"]["spec"]["domain"];
    assert!(domain.get("memory").is_none(), "{vm}");
    assert!(domain.get("cpu").is_none(), "{vm}");
    assert!(domain["devices"].get("interfaces").is_none(), "{vm}");
    assert!(
        domain["firmware"]["uuid"].is_string(),
        "firmware UUID kept: {vm}"
    );
    let uid1 = wait_running(&c, "grow")?;
    let vmi = c.get_json(&["vmi", "grow"])?;
    assert_eq!(vmi["spec"]["domain"]["memory"]["guest"], "128Mi", "{vmi}");
    assert!(
        qemu_memory_arg(&c, &uid1)?.starts_with("128"),
        "{}",
        qemu_memory_arg(&c, &uid1)?
    );

    c.kubectl_ok(&[
        "patch",
        "vm",
        "grow",
        "--type=merge",
        "-p",
        r#"{"spec":{"template":{"spec":{"domain":{"resources":{"requests":{"memory":"160Mi"}}}}}}}"#,
    ])?;
    c.kubectl_ok(&["delete", "vmi", "grow", "--timeout=120s"])?;
    let uid2 = c.wait_until("the VMI recreated", BOOT, || {
        Ok(vmi_state(&c, "grow")?
            .and_then(|(uid, phase)| (uid != uid1 && phase == "Running").then_some(uid)))
    })?;
    let vmi = c.get_json(&["vmi", "grow"])?;
    assert_eq!(vmi["spec"]["domain"]["memory"]["guest"], "160Mi", "{vmi}");
    let m = qemu_memory_arg(&c, &uid2)?;
    assert!(m.starts_with("160"), "QEMU -m {m}");
    let vm = c.get_json(&["vm", "grow"])?;
    assert!(
        vm["spec"]["template"]["spec"]["domain"]
            .get("memory")
            .is_none(),
        "{vm}"
    );
    Ok(())
}

/// Whether `pid` is a live QEMU process (a reaped or zombie one has no cmdline).
fn qemu_alive(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| String::from_utf8_lossy(&c).starts_with("qemu-system"))
        .unwrap_or(false)
}

#[test]
fn delete_vm_wait_returns_only_after_qemu_is_gone() -> anyhow::Result<()> {
    let c = cluster()?;
    c.apply(&vm_manifest(&c, "del", "Always", "#!/bin/sh\necho up")?)?;
    wait_running(&c, "del")?;
    let pid: u32 = c.wait_until("QEMU pid annotation", BOOT, || {
        let v = c.get_json(&["vmi", "del"])?;
        Ok(v["metadata"]["annotations"]["ferrovirt.io/qemu-pid"]
            .as_str()
            .and_then(|p| p.parse().ok()))
    })?;
    assert!(qemu_alive(pid), "QEMU {pid} not running before the delete");
    let fins = c.get_json(&["vm", "del"])?["metadata"]["finalizers"].clone();
    assert!(
        fins.as_array().is_some_and(|f| f
            .iter()
            .any(|x| x == "kubevirt.io/virtualMachineControllerFinalize")),
        "VM finalizers: {fins}"
    );
    let t0 = std::time::Instant::now();
    c.kubectl_ok(&["delete", "vm", "del", "--wait", "--timeout=150s"])?;
    let took = t0.elapsed();
    assert!(
        !qemu_alive(pid),
        "kubectl delete vm --wait returned while QEMU {pid} still runs"
    );
    assert!(vmi_state(&c, "del")?.is_none(), "VMI left after the VM");
    eprintln!("kubectl delete vm --wait took {took:?}");
    Ok(())
}

#[test]
fn delete_vm_with_orphan_cascade_leaves_its_vmi() -> anyhow::Result<()> {
    let c = cluster()?;
    // A VMI that never schedules (no node has this label): no guest needed.
    let manifest = vm_manifest(&c, "orph", "Always", "#!/bin/sh\necho up")?.replace(
        "      terminationGracePeriodSeconds: 30\n",
        "      terminationGracePeriodSeconds: 30\n      nodeSelector: {ferrovirt.test/none: \"x\"}\n",
    );
    c.apply(&manifest)?;
    c.wait_until("VMI created", BOOT, || {
        Ok(vmi_state(&c, "orph")?.map(|_| ()))
    })?;
    c.kubectl_ok(&[
        "delete",
        "vm",
        "orph",
        "--cascade=orphan",
        "--wait",
        "--timeout=60s",
    ])?;
    std::thread::sleep(Duration::from_secs(3));
    let v = c.get_json(&["vmi", "orph"])?;
    assert!(
        v["metadata"]["deletionTimestamp"].is_null(),
        "orphaned VMI is being deleted: {v}"
    );
    c.kubectl_ok(&["delete", "vmi", "orph", "--timeout=60s"])?;
    Ok(())
}

#[test]
fn unhonourable_launch_security_gives_an_unschedulable_vmi_naming_the_field() -> anyhow::Result<()>
{
    let c = cluster()?;
    // The test node offers no AMD SEV: the VMI must not run without it.
    let manifest = vm_manifest(&c, "sev", "Always", "#!/bin/sh\necho up")?.replace(
        "      domain:\n",
        "      domain:\n        launchSecurity: {sev: {}}\n",
    );
    c.apply(&manifest)?;
    let cond = c.wait_until("PodScheduled=False Unschedulable", BOOT, || {
        let out = c.kubectl(&["get", "vmi", "sev", "-o", "json"])?;
        if !out.status.success() {
            return Ok(None);
        }
        let v: Value = serde_json::from_slice(&out.stdout)?;
        Ok(v["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "PodScheduled" && c["status"] == "False")
            .cloned())
    })?;
    assert_eq!(cond["reason"], "Unschedulable", "{cond}");
    let msg = cond["message"].as_str().unwrap_or_default();
    assert!(msg.contains("spec.domain.launchSecurity"), "{msg}");
    let vmi = c.get_json(&["vmi", "sev"])?;
    assert!(vmi["status"]["nodeName"].is_null(), "{vmi}");
    assert_eq!(
        vmi["spec"]["domain"]["launchSecurity"]["sev"],
        serde_json::json!({})
    );
    let ev = c.wait_until("a FailedScheduling event", BOOT, || {
        let ev = c.get_json(&["events", "--field-selector", "involvedObject.name=sev"])?;
        Ok(ev["items"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["reason"] == "FailedScheduling")
            .and_then(|e| e["message"].as_str().map(String::from)))
    })?;
    assert!(ev.contains("spec.domain.launchSecurity"), "{ev}");
    c.wait_until("printableStatus ErrorUnschedulable", BOOT, || {
        Ok((printable_status(&c, "sev")? == "ErrorUnschedulable").then_some(()))
    })?;
    Ok(())
}
