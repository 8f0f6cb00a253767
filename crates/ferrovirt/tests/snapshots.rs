//! VM snapshots and restores end to end (docs/snapshots.md), against the real binary, kubectl
//! and TCG guests: a VM with an imported root disk and a blank data disk (both `local`
//! claims on the embedded agent) writes a marker on its data disk, is stopped and
//! snapshotted (VirtualMachineSnapshot → one VolumeSnapshot per claim → a frozen layer and a
//! new qcow2 top in each volume directory), writes a second marker, and is restored into
//! itself (the first marker is back, the second gone) and into a new VM that boots beside it
//! with its own MAC and firmware UUID. A second test covers what fails and why: a snapshot
//! whose source never appears (failureDeadline), a VM edit during a snapshot, an online
//! snapshot of a volume no ferrovirt provisioner made. A third snapshots a running VM online
//! (the guest sees the freeze and the thaw) and restores it.
//! A fourth takes and restores VolumeSnapshots of bare claims of both built-in classes (and
//! a claim with snapshots refuses to grow, saying why).

use std::time::{Duration, Instant};

use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest, serve_files};

const BOOT: Duration = Duration::from_secs(120);
const STEP: Duration = Duration::from_secs(60);
const FIRST: &str = "SNAPSHOT-FIRST";
const SECOND: &str = "SNAPSHOT-SECOND";

fn vm_yaml(url: &str) -> String {
    format!(
        r#"
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: snap-root, namespace: default}}
spec:
  source: {{http: {{url: "{url}"}}}}
  storage: {{resources: {{requests: {{storage: 64Mi}}}}}}
---
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: snap-data, namespace: default}}
spec:
  source: {{blank: {{}}}}
  storage: {{resources: {{requests: {{storage: 16Mi}}}}}}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: snapvm, namespace: default}}
spec:
  runStrategy: Always
  template:
    spec:
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - name: root
            disk: {{bus: virtio}}
          - name: data
            disk: {{bus: virtio}}
          interfaces:
          - name: default
            masquerade: {{}}
      networks:
      - name: default
        pod: {{}}
      volumes:
      - name: root
        dataVolume: {{name: snap-root}}
      - name: data
        dataVolume: {{name: snap-data}}
"#
    )
}

/// Boots VM `name`'s VMI to the guest's shell; the VMI uid and a console on it.
fn boot(c: &Cluster, name: &str) -> anyhow::Result<(String, SerialConsole)> {
    let uid = c.wait_booted(name, BOOT)?;
    let dir = c.agent_dir().join("vmis").join(&uid);
    c.wait_until(&format!("{name}: guest shell ready"), BOOT, || {
        let log = std::fs::read(dir.join("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    Ok((uid, console))
}

fn stop(c: &Cluster, vm: &str) -> anyhow::Result<()> {
    c.halt_vm(vm, STEP)
}

/// The firmware UUID the guest printed at boot (`FERROVIRT-BOOT serial=… uuid=…`).
fn boot_uuid(c: &Cluster, uid: &str) -> String {
    let log =
        std::fs::read(c.agent_dir().join("vmis").join(uid).join("serial.log")).unwrap_or_default();
    let log = String::from_utf8_lossy(&log);
    log.lines()
        .find(|l| l.contains("FERROVIRT-BOOT"))
        .and_then(|l| l.split("uuid=").nth(1))
        .map(|s| s.split_whitespace().next().unwrap_or("").to_string())
        .unwrap_or_default()
}

fn vmi_mac(c: &Cluster, name: &str) -> anyhow::Result<String> {
    let v = c.get_json(&["vmi", name, "-n", "default"])?;
    Ok(v["status"]["interfaces"][0]["mac"]
        .as_str()
        .unwrap_or_default()
        .to_string())
}

#[test]
fn offline_snapshot_restores_into_the_vm_and_into_a_new_one() -> anyhow::Result<()> {
    let started = Instant::now();
    let guest = TestGuest::get()?;
    let c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    let url = serve_files(vec![("disk.qcow2".into(), guest.disk_qcow2.clone())])? + "/disk.qcow2";
    c.apply(&vm_yaml(&url))?;
    let (_, console) = boot(&c, "snapvm")?;
    console.write_marker("/dev/vdb", FIRST, 0)?;
    drop(console);
    stop(&c, "snapvm")?;

    // The snapshot of the stopped VM.
    let t = Instant::now();
    c.apply(
        r#"
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineSnapshot
metadata: {name: snap1, namespace: default}
spec:
  source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: snapvm}
"#,
    )?;
    let snap = c.wait_done("vmsnapshot", "snap1", "readyToUse", STEP)?;
    eprintln!("snapshot ready after {:?}", t.elapsed());
    assert_eq!(snap["status"]["phase"], "Succeeded", "{snap}");
    assert_eq!(
        snap["status"]["snapshotVolumes"]["includedVolumes"],
        serde_json::json!(["root", "data"]),
        "{snap}"
    );
    assert_eq!(
        snap["status"]["indications"],
        serde_json::json!([]),
        "{snap}"
    );
    let content_name = snap["status"]["virtualMachineSnapshotContentName"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let content = c.get_json(&["vmsnapshotcontent", &content_name, "-n", "default"])?;
    assert_eq!(content["status"]["readyToUse"], true, "{content}");
    assert_eq!(
        content["spec"]["source"]["virtualMachine"]["metadata"]["name"],
        "snapvm"
    );
    // The Kubernetes side: ready VolumeSnapshots bound to contents with our handles, and the
    // volume directory now a chain (frozen disk.img under a new qcow2 top).
    let vss = c.get_json(&["volumesnapshot", "-n", "default"])?;
    let items = vss["items"].as_array().cloned().unwrap_or_default();
    assert_eq!(items.len(), 2, "{vss}");
    for vs in &items {
        assert_eq!(vs["status"]["readyToUse"], true, "{vs}");
        let bound = vs["status"]["boundVolumeSnapshotContentName"]
            .as_str()
            .unwrap();
        let vsc = c.get_json(&["volumesnapshotcontent", bound])?;
        let handle = vsc["status"]["snapshotHandle"].as_str().unwrap_or_default();
        let (pv, layer) = handle.split_once('/').unwrap();
        assert_eq!(layer, "disk.img", "{vsc}");
        let dir = c.agent_dir().join("volumes").join(pv);
        assert!(dir.join("chain.json").exists(), "{}", dir.display());
        assert!(dir.join("layer-000001.qcow2").exists());
    }
    let table = c.kubectl_ok(&["get", "volumesnapshot", "-n", "default"])?;
    assert!(
        table.contains("READYTOUSE") && table.contains("SOURCEPVC"),
        "{table}"
    );

    // A second marker after the snapshot.
    c.set_run_strategy("snapvm", "Always")?;
    let (_, console) = boot(&c, "snapvm")?;
    assert_eq!(console.read_marker("/dev/vdb", 0, FIRST.len())?, FIRST);
    console.write_marker("/dev/vdb", SECOND, 2048)?;
    assert_eq!(console.read_marker("/dev/vdb", 2048, SECOND.len())?, SECOND);
    drop(console);
    stop(&c, "snapvm")?;

    // Restore into the same VM: the first marker is there, the second is not.
    let t = Instant::now();
    c.apply(
        r#"
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineRestore
metadata: {name: restore-same, namespace: default}
spec:
  target: {apiGroup: kubevirt.io, kind: VirtualMachine, name: snapvm}
  virtualMachineSnapshotName: snap1
"#,
    )?;
    let r = c.wait_done("vmrestore", "restore-same", "complete", STEP)?;
    eprintln!("restore complete after {:?}", t.elapsed());
    let restores = r["status"]["restores"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(restores.len(), 2, "{r}");
    for v in &restores {
        let claim = v["persistentVolumeClaim"].as_str().unwrap();
        assert!(claim.starts_with("restore-"), "{r}");
        let pvc = c.get_json(&["pvc", claim, "-n", "default"])?;
        assert_eq!(pvc["status"]["phase"], "Bound", "{pvc}");
    }
    let vm = c.get_json(&["vm", "snapvm", "-n", "default"])?;
    assert!(vm["status"]["restoreInProgress"].is_null(), "{vm}");
    c.set_run_strategy("snapvm", "Always")?;
    let (uid1, console) = boot(&c, "snapvm")?;
    assert_eq!(console.read_marker("/dev/vdb", 0, FIRST.len())?, FIRST);
    let second = console.read_marker("/dev/vdb", 2048, SECOND.len())?;
    assert!(
        second.is_empty(),
        "the second marker survived the restore: {second:?}"
    );

    // Restore into a new VM: it boots beside the original with its own MAC and UUID.
    c.apply(
        r#"
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineRestore
metadata: {name: restore-new, namespace: default}
spec:
  target: {apiGroup: kubevirt.io, kind: VirtualMachine, name: snapvm-copy}
  virtualMachineSnapshotName: snap1
"#,
    )?;
    c.wait_done("vmrestore", "restore-new", "complete", STEP)?;
    c.set_run_strategy("snapvm-copy", "Always")?;
    let (uid2, copy_console) = boot(&c, "snapvm-copy")?;
    assert_eq!(copy_console.read_marker("/dev/vdb", 0, FIRST.len())?, FIRST);
    let (mac1, mac2) = (vmi_mac(&c, "snapvm")?, vmi_mac(&c, "snapvm-copy")?);
    assert!(!mac1.is_empty() && mac1 != mac2, "{mac1} vs {mac2}");
    let (u1, u2) = (boot_uuid(&c, &uid1), boot_uuid(&c, &uid2));
    assert!(!u1.is_empty() && u1 != u2, "{u1} vs {u2}");
    drop(console);
    eprintln!("test took {:?}", started.elapsed());
    Ok(())
}

#[test]
fn refused_and_failed_snapshots_say_why() -> anyhow::Result<()> {
    TestGuest::get()?;
    let c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    // A source that never appears: Failed at the deadline, with the reason.
    c.apply(
        r#"
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineSnapshot
metadata: {name: never, namespace: default}
spec:
  source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: nosuchvm}
  failureDeadline: 3s
"#,
    )?;
    let failed = c.wait_until("snapshot never Failed", STEP, || {
        let v = c.get_json(&["vmsnapshot", "never", "-n", "default"])?;
        Ok((v["status"]["phase"] == "Failed").then_some(v))
    })?;
    let msg = failed["status"]["error"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(
        msg.contains("failureDeadline") && msg.contains("nosuchvm does not exist"),
        "{failed}"
    );
    // Bad fields are refused naming them.
    let bad = c.apply(
        r#"
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineSnapshot
metadata: {name: bad, namespace: default}
spec:
  source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: x}
  failureDeadline: soon
"#,
    );
    let err = format!("{:?}", bad.expect_err("a bad failureDeadline is refused"));
    assert!(err.contains("spec.failureDeadline"), "{err}");

    // A snapshot deleted while in progress (waiting for a claim that never appears) does not
    // leave its VM held stopped.
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: holder, namespace: default}
spec:
  runStrategy: Halted
  template:
    spec:
      domain:
        memory: {guest: 128Mi}
        devices: {disks: [{name: root, disk: {bus: virtio}}]}
      volumes:
      - name: root
        persistentVolumeClaim: {claimName: missing-claim}
---
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineSnapshot
metadata: {name: held, namespace: default}
spec:
  source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: holder}
"#,
    )?;
    c.wait_until("holder marked", STEP, || {
        let vm = c.get_json(&["vm", "holder", "-n", "default"])?;
        Ok((vm["status"]["snapshotInProgress"] == "held").then_some(()))
    })?;
    let snap = c.get_json(&["vmsnapshot", "held", "-n", "default"])?;
    assert_eq!(snap["status"]["phase"], "InProgress", "{snap}");
    c.kubectl_ok(&["delete", "vmsnapshot", "held", "-n", "default"])?;
    c.wait_until("holder unmarked", STEP, || {
        let vm = c.get_json(&["vm", "holder", "-n", "default"])?;
        Ok(vm["status"]["snapshotInProgress"].is_null().then_some(()))
    })?;

    // While a snapshot runs the VM's spec is frozen (KubeVirt's rule): a start is refused.
    c.apply(
        r#"
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineSnapshot
metadata: {name: held2, namespace: default}
spec:
  source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: holder}
"#,
    )?;
    c.wait_until("holder marked by held2", STEP, || {
        let vm = c.get_json(&["vm", "holder", "-n", "default"])?;
        Ok((vm["status"]["snapshotInProgress"] == "held2").then_some(()))
    })?;
    let out = c.kubectl(&[
        "patch",
        "vm",
        "holder",
        "-n",
        "default",
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"runStrategy":"Always"}}"#,
    ])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a start during a snapshot was accepted"
    );
    assert!(
        err.contains("Cannot update VM spec until snapshot") && err.contains("held2"),
        "{err}"
    );
    c.kubectl_ok(&["delete", "vmsnapshot", "held2", "-n", "default"])?;

    // A running VM on a volume no ferrovirt provisioner made cannot be snapshotted online:
    // Failed at its deadline with the reason.
    c.guest_disk_claim("runner-root")?;
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: runner, namespace: default}
spec:
  runStrategy: Always
  template:
    spec:
      domain:
        memory: {guest: 128Mi}
        devices: {disks: [{name: root, disk: {bus: virtio}}]}
      volumes:
      - name: root
        persistentVolumeClaim: {claimName: runner-root}
"#,
    )?;
    c.wait_until("VMI runner Running", BOOT, || {
        let v = c.get_json(&["vmi", "runner", "-n", "default"]);
        Ok(v.ok().filter(|v| v["status"]["phase"] == "Running"))
    })?;
    c.apply(
        r#"
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineSnapshot
metadata: {name: online, namespace: default}
spec:
  source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: runner}
  failureDeadline: 8s
"#,
    )?;
    let v = c.wait_until("snapshot online Failed", STEP, || {
        let v = c.get_json(&["vmsnapshot", "online", "-n", "default"])?;
        Ok((v["status"]["phase"] == "Failed").then_some(v))
    })?;
    let msg = v["status"]["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("failureDeadline") && msg.contains("not made by a ferrovirt provisioner"),
        "{v}"
    );
    let vm = c.get_json(&["vm", "runner", "-n", "default"])?;
    assert!(vm["status"]["snapshotInProgress"].is_null(), "{vm}");
    Ok(())
}

/// The online path end to end: a running VM with a guest agent is snapshotted while it runs
/// (the guest's qemu-ga fsfreeze hook prints the freeze and the thaw on the console), goes on
/// writing to its disk, and a restore into the same VM brings back the bytes of the moment of
/// the snapshot.
#[test]
fn online_snapshot_freezes_the_guest_and_restores_into_the_vm() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    let url = serve_files(vec![("disk.qcow2".into(), guest.disk_qcow2.clone())])? + "/disk.qcow2";
    c.apply(&vm_yaml(&url))?;
    let (uid, console) = boot(&c, "snapvm")?;
    console.write_marker("/dev/vdb", FIRST, 0)?;
    c.wait_until("guest agent connected", BOOT, || {
        let v = c.get_json(&["vmi", "snapvm", "-n", "default"])?;
        let connected = v["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "AgentConnected" && c["status"] == "True");
        Ok(connected.then_some(()))
    })?;

    let t = Instant::now();
    c.apply(
        r#"
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineSnapshot
metadata: {name: online1, namespace: default}
spec:
  source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: snapvm}
"#,
    )?;
    let snap = c.wait_done("vmsnapshot", "online1", "readyToUse", STEP)?;
    eprintln!("online snapshot ready after {:?}", t.elapsed());
    assert_eq!(snap["status"]["phase"], "Succeeded", "{snap}");
    assert_eq!(
        snap["status"]["indications"],
        serde_json::json!(["Online", "GuestAgent"]),
        "{snap}"
    );
    assert_eq!(
        snap["status"]["sourceIndications"][1]["indication"], "GuestAgent",
        "{snap}"
    );
    // The guest saw the freeze, then the thaw.
    let dir = c.agent_dir().join("vmis").join(&uid);
    let log = c.wait_until("the guest printed the thaw", STEP, || {
        let log = String::from_utf8_lossy(&std::fs::read(dir.join("serial.log"))?).into_owned();
        Ok(log.contains("FERROVIRT-FSFREEZE thaw").then_some(log))
    })?;
    let frozen = log
        .find("FERROVIRT-FSFREEZE freeze")
        .expect("freeze printed");
    let thawed = log.find("FERROVIRT-FSFREEZE thaw").expect("thaw printed");
    assert!(frozen < thawed, "thaw before freeze:\n{log}");
    // Each volume is now a chain whose frozen layer the VolumeSnapshotContent names; the VM
    // writes the new top.
    let vss = c.get_json(&["volumesnapshot", "-n", "default"])?;
    let items = vss["items"].as_array().cloned().unwrap_or_default();
    assert_eq!(items.len(), 2, "{vss}");
    for vs in &items {
        assert_eq!(vs["status"]["readyToUse"], true, "{vs}");
        let bound = vs["status"]["boundVolumeSnapshotContentName"]
            .as_str()
            .unwrap_or_default();
        let vsc = c.get_json(&["volumesnapshotcontent", bound])?;
        let handle = vsc["status"]["snapshotHandle"].as_str().unwrap_or_default();
        let (pv, layer) = handle.split_once('/').unwrap_or_default();
        assert_eq!(layer, "disk.img", "{vsc}");
        let chain =
            std::fs::read_to_string(c.agent_dir().join("volumes").join(pv).join("chain.json"))?;
        assert!(chain.contains("layer-000001.qcow2"), "{chain}");
    }
    let vm = c.get_json(&["vm", "snapvm", "-n", "default"])?;
    assert!(vm["status"]["snapshotInProgress"].is_null(), "{vm}");

    // The guest goes on: the first marker reads back through the new top, a second lands on it.
    assert_eq!(console.read_marker("/dev/vdb", 0, FIRST.len())?, FIRST);
    console.write_marker("/dev/vdb", SECOND, 2048)?;
    assert_eq!(console.read_marker("/dev/vdb", 2048, SECOND.len())?, SECOND);
    drop(console);

    // Restore into the same VM while it runs: `targetReadinessPolicy: StopTarget` stops it
    // first; the captured spec (runStrategy Always) starts it again afterwards. The first
    // marker is there, the second is not.
    c.apply(
        r#"
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineRestore
metadata: {name: restore-online, namespace: default}
spec:
  target: {apiGroup: kubevirt.io, kind: VirtualMachine, name: snapvm}
  virtualMachineSnapshotName: online1
  targetReadinessPolicy: StopTarget
"#,
    )?;
    c.wait_done("vmrestore", "restore-online", "complete", STEP)?;
    let vm = c.get_json(&["vm", "snapvm", "-n", "default"])?;
    assert_eq!(vm["spec"]["runStrategy"], "Always", "{vm}");
    c.wait_until("a new VMI after the restore", BOOT, || {
        let out = c.kubectl(&["get", "vmi", "snapvm", "-n", "default", "-o", "json"])?;
        if !out.status.success() {
            return Ok(None);
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        Ok((v["metadata"]["uid"] != uid.as_str()).then_some(()))
    })?;
    let (uid2, console) = boot(&c, "snapvm")?;
    assert_ne!(uid2, uid, "the VM was not stopped for the restore");
    assert_eq!(console.read_marker("/dev/vdb", 0, FIRST.len())?, FIRST);
    let second = console.read_marker("/dev/vdb", 2048, SECOND.len())?;
    assert!(
        second.is_empty(),
        "the second marker survived the restore: {second:?}"
    );
    Ok(())
}

/// The directory of claim `claim`'s volume (`local.path` or `hostPath.path` of its PV).
fn volume_dir(c: &Cluster, claim: &str) -> anyhow::Result<std::path::PathBuf> {
    let pvc = c.get_json(&["pvc", claim, "-n", "default"])?;
    let pv = c.get_json(&["pv", pvc["spec"]["volumeName"].as_str().unwrap_or_default()])?;
    let path = pv["spec"]["local"]["path"]
        .as_str()
        .or(pv["spec"]["hostPath"]["path"].as_str())
        .unwrap_or_default();
    Ok(path.into())
}

fn write_at(path: &std::path::Path, data: &[u8]) -> anyhow::Result<()> {
    use std::os::unix::fs::FileExt;
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)?
        .write_all_at(data, 0)?;
    Ok(())
}

fn read_at(path: &std::path::Path, len: usize) -> anyhow::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0; len];
    std::fs::File::open(path)?.read_exact_at(&mut buf, 0)?;
    Ok(buf)
}

/// Asks for claim `claim` (in `default`) to hold `size`.
fn resize(c: &Cluster, claim: &str, size: &str) -> anyhow::Result<()> {
    let patch = format!(r#"{{"spec":{{"resources":{{"requests":{{"storage":"{size}"}}}}}}}}"#);
    c.kubectl_ok(&[
        "patch", "pvc", claim, "-n", "default", "--type", "merge", "-p", &patch,
    ])?;
    Ok(())
}

/// The Kubernetes way, without a VM: a VolumeSnapshot of a claim of each built-in class, then
/// a claim with `dataSourceRef` naming it holds the bytes of the snapshot, not the later ones.
#[test]
fn volume_snapshots_restore_claims_the_kubernetes_way() -> anyhow::Result<()> {
    let c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    for class in ["local", "shared"] {
        let node = if class == "local" {
            "annotations: {volume.kubernetes.io/selected-node: node1}"
        } else {
            "annotations: {}"
        };
        c.apply(&format!(
            r#"
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: src-{class}, namespace: default, {node}}}
spec:
  storageClassName: {class}
  accessModes: [{mode}]
  resources: {{requests: {{storage: 8Mi}}}}
"#,
            mode = if class == "local" {
                "ReadWriteOnce"
            } else {
                "ReadWriteMany"
            }
        ))?;
        c.wait_until(&format!("src-{class} Bound"), STEP, || {
            let v = c.get_json(&["pvc", &format!("src-{class}"), "-n", "default"])?;
            Ok((v["status"]["phase"] == "Bound").then_some(()))
        })?;
        let img = volume_dir(&c, &format!("src-{class}"))?.join("disk.img");
        write_at(&img, FIRST.as_bytes())?;
        c.apply(&format!(
            r#"
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {{name: vs-{class}, namespace: default}}
spec:
  source: {{persistentVolumeClaimName: src-{class}}}
"#
        ))?;
        let vs = c.wait_until(&format!("vs-{class} ready"), STEP, || {
            let v = c.get_json(&["volumesnapshot", &format!("vs-{class}"), "-n", "default"])?;
            Ok((v["status"]["readyToUse"] == true).then_some(v))
        })?;
        assert_eq!(vs["status"]["restoreSize"], "8388608", "{vs}");
        let content = vs["status"]["boundVolumeSnapshotContentName"]
            .as_str()
            .unwrap();
        let vsc = c.get_json(&["volumesnapshotcontent", content])?;
        assert_eq!(
            vsc["spec"]["volumeSnapshotClassName"],
            format!("ferrovirt-{class}"),
            "{vsc}"
        );
        // Later writes go to the new top layer (written here with qemu-io, as QEMU would);
        // the frozen disk.img keeps the snapshot.
        let dir = volume_dir(&c, &format!("src-{class}"))?;
        let top = dir.join("layer-000001.qcow2");
        assert!(top.exists(), "{}", top.display());
        let out = std::process::Command::new("qemu-io")
            .args(["-f", "qcow2", "-c", "write -P 66 0 4096"])
            .arg(&top)
            .output()?;
        anyhow::ensure!(out.status.success(), "qemu-io: {out:?}");
        assert_eq!(read_at(&img, FIRST.len())?, FIRST.as_bytes());
        c.apply(&format!(
            r#"
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: copy-{class}, namespace: default, {node}}}
spec:
  storageClassName: {class}
  accessModes: [{mode}]
  resources: {{requests: {{storage: 8Mi}}}}
  dataSourceRef: {{apiGroup: snapshot.storage.k8s.io, kind: VolumeSnapshot, name: vs-{class}}}
"#,
            mode = if class == "local" {
                "ReadWriteOnce"
            } else {
                "ReadWriteMany"
            }
        ))?;
        c.wait_until(&format!("copy-{class} Bound"), STEP, || {
            let v = c.get_json(&["pvc", &format!("copy-{class}"), "-n", "default"])?;
            Ok((v["status"]["phase"] == "Bound").then_some(()))
        })?;
        let copy = volume_dir(&c, &format!("copy-{class}"))?.join("disk.img");
        assert_eq!(read_at(&copy, FIRST.len())?, FIRST.as_bytes());
        assert_eq!(std::fs::metadata(&copy)?.len(), 8 << 20);
    }
    // A claim whose volume has snapshots does not grow (neither class), and says why; its
    // frozen bottom image keeps the snapshot's size.
    for class in ["local", "shared"] {
        let claim = format!("src-{class}");
        let before = c.get_json(&["pvc", &claim, "-n", "default"])?["status"]["capacity"].clone();
        resize(&c, &claim, "16Mi")?;
        c.wait_until(&format!("{claim}: VolumeResizeFailed"), STEP, || {
            let ev = c.get_json(&[
                "events",
                "-n",
                "default",
                "--field-selector",
                &format!("involvedObject.name={claim}"),
            ])?;
            let said = ev["items"].as_array().into_iter().flatten().any(|e| {
                e["reason"] == "VolumeResizeFailed"
                    && e["message"]
                        .as_str()
                        .unwrap_or("")
                        .contains("has snapshots")
            });
            Ok(said.then_some(()))
        })?;
        let pvc = c.get_json(&["pvc", &claim, "-n", "default"])?;
        assert_eq!(pvc["status"]["capacity"], before, "{pvc}");
        let img = volume_dir(&c, &claim)?.join("disk.img");
        assert_eq!(std::fs::metadata(&img)?.len(), 8 << 20, "{class}");
    }
    // Deleting the snapshots reclaims their layers: the later writes are committed into the
    // raw image, the layer files go, and the claim can grow again.
    for class in ["local", "shared"] {
        let claim = format!("src-{class}");
        let vs = c.get_json(&["volumesnapshot", &format!("vs-{class}"), "-n", "default"])?;
        let content = vs["status"]["boundVolumeSnapshotContentName"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let vsc = c.get_json(&["volumesnapshotcontent", &content])?;
        assert!(
            vsc["metadata"]["finalizers"]
                .to_string()
                .contains("snapshot.ferrovirt.io/layer-reclaim"),
            "{vsc}"
        );
        c.kubectl_ok(&[
            "delete",
            "volumesnapshot",
            &format!("vs-{class}"),
            "-n",
            "default",
        ])?;
        let dir = volume_dir(&c, &claim)?;
        c.wait_until(&format!("{claim}: layers reclaimed"), STEP, || {
            let gone = c
                .kubectl(&["get", "volumesnapshotcontent", &content])?
                .status
                .code()
                != Some(0);
            Ok((gone && !dir.join("layer-000001.qcow2").exists()).then_some(()))
        })?;
        let chain = std::fs::read_to_string(dir.join("chain.json")).unwrap_or_default();
        assert!(!chain.contains("qcow2"), "{class}: {chain}");
        let img = dir.join("disk.img");
        assert_eq!(
            read_at(&img, 4)?,
            [66; 4],
            "{class}: the later write is kept"
        );
        resize(&c, &claim, "24Mi")?;
        c.wait_until(&format!("{claim} grown"), STEP, || {
            Ok((std::fs::metadata(&img)?.len() == 24 << 20).then_some(()))
        })?;
    }
    // A snapshot of a claim that does not exist says so.
    c.apply(
        r#"
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {name: vs-none, namespace: default}
spec:
  source: {persistentVolumeClaimName: nosuchclaim}
"#,
    )?;
    c.wait_until("vs-none error", STEP, || {
        let v = c.get_json(&["volumesnapshot", "vs-none", "-n", "default"])?;
        Ok(v["status"]["error"]["message"]
            .as_str()
            .filter(|m| m.contains("nosuchclaim does not exist"))
            .map(drop))
    })?;
    Ok(())
}

/// The SMBIOS serial the guest printed at boot.
fn boot_serial(c: &Cluster, uid: &str) -> String {
    let log =
        std::fs::read(c.agent_dir().join("vmis").join(uid).join("serial.log")).unwrap_or_default();
    let log = String::from_utf8_lossy(&log);
    log.lines()
        .find(|l| l.contains("FERROVIRT-BOOT"))
        .and_then(|l| l.split("serial=").nth(1))
        .map(|s| s.split_whitespace().next().unwrap_or("").to_string())
        .unwrap_or_default()
}

/// VirtualMachineClone of a running VM: snapshot (online) → new VM → restore, the intermediate
/// objects deleted; the clone boots beside its source with the MAC it was given and a new SMBIOS
/// serial, read from inside both guests, and the filtered label left behind. Then a clone
/// from a VirtualMachineSnapshot of the source boots beside it with a new MAC and the serial
/// it was given.
#[test]
fn a_clone_boots_beside_its_source_with_its_own_mac_and_serial() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    let url = serve_files(vec![("disk.qcow2".into(), guest.disk_qcow2.clone())])? + "/disk.qcow2";
    c.apply(&format!(
        r#"
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: src-root, namespace: default}}
spec:
  source: {{http: {{url: "{url}"}}}}
  storage: {{resources: {{requests: {{storage: 64Mi}}}}}}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: srcvm
  namespace: default
  labels: {{app: demo, secret/x: "y"}}
spec:
  runStrategy: Always
  template:
    spec:
      domain:
        memory: {{guest: 128Mi}}
        firmware: {{serial: SOURCE-SERIAL}}
        devices:
          disks: [{{name: root, disk: {{bus: virtio}}}}]
          interfaces: [{{name: default, masquerade: {{}}, macAddress: "02:00:00:00:00:01"}}]
      networks: [{{name: default, pod: {{}}}}]
      volumes:
      - name: root
        dataVolume: {{name: src-root}}
"#
    ))?;
    let (src_uid, src_console) = boot(&c, "srcvm")?;
    c.apply(
        r#"
apiVersion: clone.kubevirt.io/v1beta1
kind: VirtualMachineClone
metadata: {name: clone1, namespace: default}
spec:
  source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: srcvm}
  target: {apiGroup: kubevirt.io, kind: VirtualMachine, name: srcvm-clone}
  labelFilters: ["*", "!secret/*"]
  newMacAddresses: {default: "02:00:00:00:00:42"}
"#,
    )?;
    let cl = c.wait_until("clone1 Succeeded", STEP, || {
        let v = c.get_json(&["vmclone", "clone1", "-n", "default"])?;
        anyhow::ensure!(v["status"]["phase"] != "Failed", "clone failed: {v}");
        Ok((v["status"]["phase"] == "Succeeded").then_some(v))
    })?;
    let ready = cl["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Ready" && c["status"] == "True");
    assert!(ready, "{cl}");
    let clone_uid = cl["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let table = c.kubectl_ok(&["get", "vmclone", "-n", "default"])?;
    assert!(
        table.contains("PHASE")
            && table.contains("SOURCEVIRTUALMACHINE")
            && table.contains("Succeeded"),
        "{table}"
    );
    // The intermediate snapshot and restore are gone.
    c.wait_until("intermediate objects deleted", STEP, || {
        let s = c.kubectl(&[
            "get",
            "vmsnapshot",
            &format!("tmp-snapshot-{clone_uid}"),
            "-n",
            "default",
        ])?;
        let r = c.kubectl(&[
            "get",
            "vmrestore",
            &format!("tmp-restore-{clone_uid}"),
            "-n",
            "default",
        ])?;
        Ok((!s.status.success() && !r.status.success()).then_some(()))
    })?;
    let vm = c.get_json(&["vm", "srcvm-clone", "-n", "default"])?;
    assert_eq!(vm["metadata"]["labels"]["app"], "demo", "{vm}");
    assert!(vm["metadata"]["labels"]["secret/x"].is_null(), "{vm}");

    // Both run at once; each guest reports its own MAC and serial.
    let (clone_vmi_uid, clone_console) = boot(&c, "srcvm-clone")?;
    let mac = |console: &SerialConsole| -> anyhow::Result<String> {
        let (out, _) = console.exec("cat /sys/class/net/eth0/address", Duration::from_secs(30))?;
        Ok(out.trim().to_string())
    };
    assert_eq!(mac(&src_console)?, "02:00:00:00:00:01");
    assert_eq!(mac(&clone_console)?, "02:00:00:00:00:42");
    assert_eq!(boot_serial(&c, &src_uid), "SOURCE-SERIAL");
    assert_eq!(
        boot_serial(&c, &clone_vmi_uid),
        clone_uid,
        "a generated serial"
    );
    let src = c.get_json(&["vmi", "srcvm", "-n", "default"])?;
    assert_eq!(src["status"]["phase"], "Running", "{src}");

    // A clone from a VirtualMachineSnapshot (taken online of the running source): the
    // snapshot is used as it is and kept; the clone boots beside the source with a generated
    // MAC (none given) and the SMBIOS serial it was given. The first clone goes, to spare
    // the two shared cores a third guest.
    drop(clone_console);
    c.kubectl_ok(&[
        "delete",
        "vm",
        "srcvm-clone",
        "-n",
        "default",
        "--wait=false",
    ])?;
    c.apply(
        r#"
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineSnapshot
metadata: {name: srcsnap, namespace: default}
spec:
  source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: srcvm}
"#,
    )?;
    c.wait_done("vmsnapshot", "srcsnap", "readyToUse", STEP)?;
    c.apply(
        r#"
apiVersion: clone.kubevirt.io/v1beta1
kind: VirtualMachineClone
metadata: {name: clone2, namespace: default}
spec:
  source: {apiGroup: snapshot.kubevirt.io, kind: VirtualMachineSnapshot, name: srcsnap}
  target: {apiGroup: kubevirt.io, kind: VirtualMachine, name: snap-clone}
  newSMBiosSerial: SNAP-CLONE-SERIAL
"#,
    )?;
    let cl2 = c.wait_until("clone2 Succeeded", STEP, || {
        let v = c.get_json(&["vmclone", "clone2", "-n", "default"])?;
        anyhow::ensure!(v["status"]["phase"] != "Failed", "clone failed: {v}");
        Ok((v["status"]["phase"] == "Succeeded").then_some(v))
    })?;
    let snap = c.get_json(&["vmsnapshot", "srcsnap", "-n", "default"])?;
    assert_eq!(
        snap["status"]["readyToUse"], true,
        "the source snapshot is kept: {cl2}"
    );
    let (snap_clone_uid, snap_clone_console) = boot(&c, "snap-clone")?;
    let clone_mac = mac(&snap_clone_console)?;
    assert_eq!(clone_mac.len(), 17, "{clone_mac}");
    assert_ne!(
        clone_mac, "02:00:00:00:00:01",
        "the clone kept the source's MAC"
    );
    assert_eq!(mac(&src_console)?, "02:00:00:00:00:01");
    assert_eq!(boot_serial(&c, &snap_clone_uid), "SNAP-CLONE-SERIAL");
    let src = c.get_json(&["vmi", "srcvm", "-n", "default"])?;
    assert_eq!(src["status"]["phase"], "Running", "{src}");
    Ok(())
}
