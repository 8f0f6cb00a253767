//! Backups end to end (docs/backup.md), against the real binary, kubectl, a real S3-protocol
//! server (moto, `moto_server` from PyPI `moto[server]`, installed by scripts/install-deps.sh,
//! started here on loopback) and TCG guests. A VM with an imported root disk, a blank data disk
//! and a cloud-init Secret writes a marker on its data disk and is stopped; `ferrovirt backup
//! create --wait` backs it up to the bucket (status: both volumes with bytes read and
//! deduplicated); before that, a backup of the VM while it runs goes through an online snapshot
//! (kept afterwards as the VM's backup point, so the stopped VM's backups read only what changed
//! since: docs/backup.md "Incremental reads") and is the one restored below; a second backup
//! uploads nothing new; a Backup with another key fails with
//! the key check's message and leaves nothing listed; a BackupPlan every 6 s keeping the last 2
//! makes runs owned by it and prunes older ones from the target; the server killed in the middle
//! of a backup runs it again to the end after its restart (listed once, verified, kept by a
//! garbage collection); the BackupTarget reports reachable. A
//! SECOND server (own data dir) given only the bucket, its credentials and the key lists the
//! backups and restores the VM (`ferrovirt backup restore --start`): it boots there with the
//! marker on its data disk and its cloud-init Secret's user-data run. Finally one chunk is
//! altered in the bucket and `ferrovirt backup verify` (of every backup) names it.
//!
//! `backup_restore_object_on_a_second_server` restores with BackupRestore objects instead of
//! the CLI (a filesystem target; see its doc).

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest, serve_files};

const BIN: &str = env!("CARGO_BIN_EXE_ferrovirt");
const BOOT: Duration = Duration::from_secs(180);
const STEP: Duration = Duration::from_secs(120);
const MARKER: &str = "BACKUP-MARKER-1";
const KEY: &str = "a-backup-key-of-32-bytes-000001";

struct Moto(Child);
impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn moto_binary() -> String {
    if let Ok(p) = std::env::var("FERROVIRT_MOTO_SERVER") {
        return p;
    }
    let venv = "/opt/ferrovirt-moto/bin/moto_server";
    if std::path::Path::new(venv).exists() {
        return venv.into();
    }
    "moto_server".into()
}

/// moto on a free loopback port, with bucket `vms`.
fn start_moto() -> anyhow::Result<(Moto, u16)> {
    use std::io::{Read, Write};
    let port = ferrovirt_testkit::free_port()?;
    let child = Command::new(moto_binary())
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| anyhow::anyhow!("moto_server (scripts/install-deps.sh installs it): {e}"))?;
    let moto = Moto(child);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            let req = format!(
                "PUT /vms HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
            s.write_all(req.as_bytes())?;
            let mut resp = String::new();
            s.read_to_string(&mut resp)?;
            anyhow::ensure!(
                resp.starts_with("HTTP/1.1 200"),
                "creating the bucket: {resp}"
            );
            return Ok((moto, port));
        }
        anyhow::ensure!(Instant::now() < deadline, "moto did not start");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn fv(c: &Cluster, args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new(BIN)
        .arg("--kubeconfig")
        .arg(&c.kubeconfig)
        .args(args)
        .output()?)
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn fv_ok(c: &Cluster, args: &[&str]) -> anyhow::Result<String> {
    let o = fv(c, args)?;
    anyhow::ensure!(o.status.success(), "ferrovirt {args:?}: {}", text(&o));
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

/// The target, its credentials and the key Secret (`key`), as both servers get them.
fn target_yaml(port: u16, key: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Secret
metadata: {{name: s3-creds, namespace: default}}
stringData: {{accessKeyId: testing, secretAccessKey: testing}}
---
apiVersion: v1
kind: Secret
metadata: {{name: bk-key, namespace: default}}
stringData: {{key: "{key}"}}
---
apiVersion: backup.ferrovirt.io/v1alpha1
kind: BackupTarget
metadata: {{name: s3}}
spec:
  s3:
    endpoint: "http://127.0.0.1:{port}"
    bucket: vms
    prefix: e2e
    pathStyle: true
    credentialsSecretRef: {{name: s3-creds, namespace: default}}
"#
    )
}

fn vm_yaml(url: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Secret
metadata: {{name: bk-userdata, namespace: default}}
stringData:
  userdata: |
    #!/bin/sh
    echo CLOUDINIT-FROM-SECRET
---
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: bk-root, namespace: default}}
spec:
  source: {{http: {{url: "{url}"}}}}
  storage: {{resources: {{requests: {{storage: 64Mi}}}}}}
---
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: bk-data, namespace: default}}
spec:
  source: {{blank: {{}}}}
  storage: {{resources: {{requests: {{storage: 16Mi}}}}}}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: bkvm, namespace: default}}
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
      volumes:
      - name: root
        dataVolume: {{name: bk-root}}
      - name: data
        dataVolume: {{name: bk-data}}
      - name: ci
        cloudInitNoCloud: {{secretRef: {{name: bk-userdata}}}}
"#
    )
}

/// Boots VM `name`'s VMI to the guest's shell; its serial log so far and a console.
fn boot(c: &Cluster, name: &str) -> anyhow::Result<(String, SerialConsole)> {
    let uid = c.wait_booted(name, BOOT)?;
    let dir = c.agent_dir().join("vmis").join(&uid);
    let log = c.wait_until(&format!("{name}: guest shell ready"), BOOT, || {
        let log =
            String::from_utf8_lossy(&std::fs::read(dir.join("serial.log")).unwrap_or_default())
                .into_owned();
        Ok(log.contains("FERROVIRT-READY").then_some(log))
    })?;
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    Ok((log, console))
}

/// `ferrovirt backup create NAME --vm bkvm --wait` to the s3 target; the Backup once ended.
fn create_backup(c: &Cluster, name: &str) -> anyhow::Result<serde_json::Value> {
    let args = [
        "backup",
        "create",
        name,
        "--target",
        "s3",
        "--vm",
        "bkvm",
        "--key-secret",
        "bk-key",
        "--wait",
    ];
    let out = fv_ok(c, &args)?;
    assert!(out.contains("Succeeded"), "{out}");
    wait_backup(c, name)
}

/// Waits for Backup `name` to end; its object.
fn wait_backup(c: &Cluster, name: &str) -> anyhow::Result<serde_json::Value> {
    c.wait_until(&format!("backup {name} finished"), STEP, || {
        let v = c.get_json(&["backup.backup.ferrovirt.io", name, "-n", "default"])?;
        let p = v["status"]["phase"].as_str().unwrap_or("");
        Ok((p == "Succeeded" || p == "Failed").then_some(v))
    })
}

fn ready_message(v: &serde_json::Value) -> String {
    v["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Ready")
        .and_then(|c| c["message"].as_str())
        .unwrap_or("")
        .to_string()
}

#[test]
fn backup_to_s3_and_restore_on_a_second_server() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let (_moto, port) = start_moto()?;
    let mut a = Cluster::start(&ClusterOptions::new(BIN))?;
    let url = serve_files(vec![("disk.qcow2".into(), guest.disk_qcow2.clone())])? + "/disk.qcow2";
    a.apply(&target_yaml(port, KEY))?;
    a.apply(&vm_yaml(&url))?;
    let (log, console) = boot(&a, "bkvm")?;
    assert!(
        log.contains("CLOUDINIT-FROM-SECRET"),
        "user-data did not run:\n{log}"
    );
    let (out, rc) = console.exec(
        &format!("echo {MARKER} | dd of=/dev/vdb bs=512 seek=0 conv=fsync && sync"),
        Duration::from_secs(30),
    )?;
    anyhow::ensure!(rc == 0, "writing the marker: {out}");
    drop(console);

    // The running VM: read through an online snapshot the backup takes and keeps as the VM's
    // backup point.
    let b0 = create_backup(&a, "b0")?;
    assert_eq!(b0["status"]["phase"], "Succeeded", "{b0}");
    assert!(b0["status"]["bytesNew"].as_i64().unwrap_or(0) > 0, "{b0}");
    assert_eq!(
        b0["status"]["volumes"].as_array().map(Vec::len),
        Some(2),
        "{b0}"
    );
    let points = a.get_json(&["virtualmachinesnapshot", "-n", "default"])?;
    let names: Vec<&str> = points["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["metadata"]["labels"]["backup.ferrovirt.io/base"] == "true")
        .filter_map(|s| s["metadata"]["name"].as_str())
        .collect();
    assert_eq!(names, ["backup-b0-bkvm"], "{points}");
    let vmi = a.get_json(&["vmi", "bkvm", "-n", "default"])?;
    assert_eq!(vmi["status"]["phase"], "Running", "{vmi}");
    a.halt_vm("bkvm", STEP)?;

    // The first backup: both claims read and written, figures in the status.
    let b1 = create_backup(&a, "b1")?;
    assert_eq!(b1["status"]["phase"], "Succeeded", "{b1}");
    assert_eq!(b1["status"]["backupName"], "default-b1", "{b1}");
    let vols = b1["status"]["volumes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut names: Vec<&str> = vols.iter().filter_map(|v| v["name"].as_str()).collect();
    names.sort();
    assert_eq!(names, ["bk-data", "bk-root"], "{b1}");
    let read: i64 = vols.iter().filter_map(|v| v["bytesRead"].as_i64()).sum();
    let reused: i64 = vols.iter().filter_map(|v| v["bytesReused"].as_i64()).sum();
    let size: i64 = vols.iter().filter_map(|v| v["sizeBytes"].as_i64()).sum();
    assert_eq!(read + reused, size, "{b1}");
    assert!(size >= 80 << 20, "{b1}");
    // b0 read these very bytes while the VM ran and kept its point: the stopped VM's b1 reads
    // only what changed since and takes the rest from b0's indexes.
    assert!(reused > 0, "{b1}");
    for v in &vols {
        assert_eq!(v["incremental"], true, "{b1}");
        assert_eq!(v["baseBackup"], "default-b0", "{b1}");
    }

    // The same VM again: nothing new is uploaded.
    fv_ok(
        &a,
        &[
            "backup",
            "create",
            "b2",
            "--target",
            "s3",
            "--vm",
            "bkvm",
            "--key-secret",
            "bk-key",
        ],
    )?;
    let b2 = wait_backup(&a, "b2")?;
    assert_eq!(b2["status"]["phase"], "Succeeded", "{b2}");
    assert_eq!(b2["status"]["bytesNew"], 0, "{b2}");
    let reused: i64 = b2["status"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["bytesReused"].as_i64())
        .sum();
    assert!(reused > 0, "{b2}");

    // Another key: refused by the key check, nothing listed.
    a.apply(
        r#"
apiVersion: v1
kind: Secret
metadata: {name: other-key, namespace: default}
stringData: {key: "not-the-repository-key-0000000"}
---
apiVersion: backup.ferrovirt.io/v1alpha1
kind: Backup
metadata: {name: b3, namespace: default}
spec: {target: s3, virtualMachines: [bkvm], encryptionKeySecretRef: other-key}
"#,
    )?;
    let b3 = wait_backup(&a, "b3")?;
    assert_eq!(b3["status"]["phase"], "Failed", "{b3}");
    assert!(ready_message(&b3).contains("wrong encryption key"), "{b3}");

    // A BackupPlan every 6 s keeping the last 2: runs are Backups owned by the plan, named
    // by their scheduled time; older ones are pruned from the target and the cluster.
    a.apply(
        r#"
apiVersion: backup.ferrovirt.io/v1alpha1
kind: BackupPlan
metadata: {name: often, namespace: default}
spec:
  schedule: "*/6 * * * * *"
  target: s3
  virtualMachines: [bkvm]
  encryptionKeySecretRef: bk-key
  retention: {keepLast: 2}
"#,
    )?;
    let plan = a.wait_until("plan pruned a run", Duration::from_secs(150), || {
        let v = a.get_json(&["backupplan", "often", "-n", "default"])?;
        let pruned = v["status"]["pruned"].as_i64().unwrap_or(0);
        Ok((pruned >= 1 && v["status"]["lastResult"] == "Succeeded").then_some(v))
    })?;
    a.kubectl_ok(&[
        "patch",
        "backupplan",
        "often",
        "-n",
        "default",
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"paused":true}}"#,
    ])?;
    let runs = a.wait_until("the plan's runs settle", STEP, || {
        let list = a.get_json(&[
            "backup.backup.ferrovirt.io",
            "-n",
            "default",
            "-l",
            "backup.ferrovirt.io/plan=often",
        ])?;
        let items = list["items"].as_array().cloned().unwrap_or_default();
        let done = items
            .iter()
            .all(|b| b["status"]["phase"] == "Succeeded" || b["status"]["phase"] == "Failed");
        Ok((done && items.len() <= 3).then_some(items))
    })?;
    for b in &runs {
        let name = b["metadata"]["name"].as_str().unwrap_or("");
        assert!(name.starts_with("often-2"), "{b}");
        assert_eq!(
            b["metadata"]["ownerReferences"][0]["kind"], "BackupPlan",
            "{b}"
        );
    }
    let listed = fv_ok(
        &a,
        &["backup", "list", "--target", "s3", "--key-secret", "bk-key"],
    )?;
    let on_target: Vec<&str> = listed
        .lines()
        .filter(|l| l.contains("default-often-"))
        .collect();
    // Kept: the last 2 Succeeded; a run may have started after the pause took effect.
    assert!(
        (2..=3).contains(&on_target.len()),
        "plan {plan}\nruns {runs:?}\ntarget:\n{listed}"
    );
    let last = plan["status"]["lastBackup"].as_str().unwrap_or("");
    assert!(
        listed.contains(&format!("default-{last}")),
        "{plan}\n{listed}"
    );

    killed_mid_backup(&mut a)?;

    // The target checker reports the bucket.
    a.wait_until("BackupTarget s3 reachable", STEP, || {
        let t = a.get_json(&["backuptarget", "s3"])?;
        Ok(
            (t["status"]["reachable"] == true && t["status"]["bytesStored"].as_i64() > Some(0))
                .then_some(()),
        )
    })?;

    // A second server with only the bucket, its credentials and the key.
    let b = Cluster::start(&ClusterOptions::new(BIN))?;
    b.apply(&target_yaml(port, KEY))?;
    let list = fv_ok(
        &b,
        &["backup", "list", "--target", "s3", "--key-secret", "bk-key"],
    )?;
    assert!(
        list.contains("default-b0") && list.contains("default-b1") && list.contains("default-b2"),
        "{list}"
    );
    assert!(!list.contains("default-b3"), "{list}");
    let o = fv(
        &b,
        &[
            "backup",
            "restore",
            "default-b0",
            "--target",
            "s3",
            "--key-secret",
            "bk-key",
            "--start",
        ],
    )?;
    assert!(o.status.success(), "restore: {}", text(&o));
    let (log, console) = boot(&b, "bkvm")?;
    assert!(
        log.contains("CLOUDINIT-FROM-SECRET"),
        "restored user-data did not run:\n{log}"
    );
    let (out, _) = console.exec(
        &format!(
            "dd if=/dev/vdb bs=512 count=1 2>/dev/null | head -c {}; echo",
            MARKER.len()
        ),
        Duration::from_secs(30),
    )?;
    assert_eq!(
        out.replace('\0', "").trim(),
        MARKER,
        "the data disk on the second server"
    );
    drop(console);

    // One chunk altered in the bucket (every chunk left is referenced: the gc above ran
    // with no grace): verify of every backup names it and fails.
    let rt = tokio::runtime::Runtime::new()?;
    let victim = rt.block_on(alter_one_chunk(port))?;
    let o = fv(
        &b,
        &[
            "backup",
            "verify",
            "--target",
            "s3",
            "--key-secret",
            "bk-key",
        ],
    )?;
    assert!(
        !o.status.success(),
        "verify passed a damaged chunk: {}",
        text(&o)
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("BAD ")
                && victim.ends_with(l[4..].split(' ').next().unwrap_or("?"))),
        "verify did not name {victim}: {}",
        text(&o)
    );
    Ok(())
}

/// VM `bigvm` (halted) with a 384 MiB shared volume `big` filled with random bytes; the
/// SHA-256 of the volume's image.
fn fill_big_vm(a: &Cluster) -> anyhow::Result<String> {
    a.apply(
        r#"
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {name: big, namespace: default}
spec:
  source: {blank: {}}
  storage: {storageClassName: shared, resources: {requests: {storage: 384Mi}}}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: bigvm, namespace: default}
spec:
  runStrategy: Halted
  template:
    spec:
      domain:
        memory: {guest: 128Mi}
        devices:
          disks:
          - {name: big, disk: {bus: virtio}}
      volumes:
      - {name: big, dataVolume: {name: big}}
"#,
    )?;
    a.wait_until("DataVolume big Succeeded", STEP, || {
        let v = a.get_json(&["dv", "big", "-n", "default"])?;
        Ok((v["status"]["phase"] == "Succeeded").then_some(()))
    })?;
    let image = volume_image(a, "big")?;
    let filled = Command::new("dd")
        .args([
            "if=/dev/urandom",
            &format!("of={image}"),
            "bs=4M",
            "count=96",
            "conv=notrunc,fsync",
            "status=none",
        ])
        .status()?;
    anyhow::ensure!(filled.success(), "filling {image}");
    sha256(&image, 384 << 20)
}

/// The `disk.img` of claim `pvc`'s (hostPath) volume.
fn volume_image(c: &Cluster, pvc: &str) -> anyhow::Result<String> {
    let claim = c.get_json(&["pvc", pvc, "-n", "default"])?;
    let pv = c.get_json(&["pv", claim["spec"]["volumeName"].as_str().unwrap_or("")])?;
    let dir = pv["spec"]["hostPath"]["path"].as_str().unwrap_or("");
    anyhow::ensure!(!dir.is_empty(), "claim {pvc} has no hostPath volume: {pv}");
    Ok(format!("{dir}/disk.img"))
}

/// SHA-256 of the first `len` bytes of `path`.
fn sha256(path: &str, len: u64) -> anyhow::Result<String> {
    let out = Command::new("sh")
        .args(["-c", &format!("head -c {len} '{path}' | sha256sum")])
        .output()?;
    anyhow::ensure!(out.status.success(), "sha256sum {path}: {}", text(&out));
    Ok(String::from_utf8_lossy(&out.stdout)
        .split(' ')
        .next()
        .unwrap_or("")
        .to_string())
}

/// The server killed in the middle of a backup (a 384 MiB volume of random bytes, read
/// for several seconds): restarted, it runs the Backup again to the end; the target lists it
/// once, `verify` re-reads every chunk, and a garbage collection keeps every referenced one.
fn killed_mid_backup(a: &mut Cluster) -> anyhow::Result<()> {
    fill_big_vm(a)?;
    a.apply(
        r#"
apiVersion: backup.ferrovirt.io/v1alpha1
kind: Backup
metadata: {name: bkill, namespace: default}
spec: {target: s3, virtualMachines: [bigvm], encryptionKeySecretRef: bk-key}
"#,
    )?;
    a.wait_until("backup bkill running", STEP, || {
        let v = a.get_json(&["backup.backup.ferrovirt.io", "bkill", "-n", "default"])?;
        Ok((v["status"]["phase"] == "Running").then_some(()))
    })?;
    std::thread::sleep(Duration::from_millis(1500));
    let v = a.get_json(&["backup.backup.ferrovirt.io", "bkill", "-n", "default"])?;
    anyhow::ensure!(
        v["status"]["phase"] == "Running",
        "the backup ended before the kill (make the volume larger): {v}"
    );
    a.kill_server()?;
    a.restart_server()?;
    let v = wait_backup(a, "bkill")?;
    assert_eq!(v["status"]["phase"], "Succeeded", "{v}");
    let listed = fv_ok(
        a,
        &["backup", "list", "--target", "s3", "--key-secret", "bk-key"],
    )?;
    assert_eq!(
        listed
            .lines()
            .filter(|l| l.contains("default-bkill"))
            .count(),
        1,
        "{listed}"
    );
    let verify = [
        "backup",
        "verify",
        "default-bkill",
        "--target",
        "s3",
        "--key-secret",
        "bk-key",
    ];
    fv_ok(a, &verify)?;
    fv_ok(
        a,
        &[
            "backup",
            "gc",
            "--target",
            "s3",
            "--key-secret",
            "bk-key",
            "--grace-seconds",
            "0",
        ],
    )?;
    fv_ok(a, &verify)?;
    Ok(())
}

/// Flips one byte of the first chunk object in the bucket; its name.
async fn alter_one_chunk(port: u16) -> anyhow::Result<String> {
    use futures::TryStreamExt;
    use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
    let _ = rustls::crypto::ring::default_provider().install_default();
    let target = ferrovirt_backup::Target::S3 {
        s3: ferrovirt_backup::S3Target {
            endpoint: format!("http://127.0.0.1:{port}"),
            bucket: "vms".into(),
            access_key_id: "testing".into(),
            secret_access_key: "testing".into(),
            path_style: true,
            ..Default::default()
        },
        prefix: "e2e".into(),
    };
    let store = ferrovirt_backup::target::open_store(&target)?;
    let prefix = object_store::path::Path::from("e2e/chunks");
    let mut chunks: Vec<_> = store.list(Some(&prefix)).try_collect().await?;
    chunks.sort_by(|a, b| a.location.cmp(&b.location));
    let victim = chunks
        .first()
        .ok_or_else(|| anyhow::anyhow!("no chunk in the bucket"))?
        .location
        .clone();
    let mut bytes = store.get(&victim).await?.bytes().await?.to_vec();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    store.put(&victim, PutPayload::from(bytes)).await?;
    Ok(victim.to_string())
}

/// The in-cluster restore (a BackupRestore object): server A backs up a VM whose guest wrote a
/// marker to a filesystem target; server B, given only the target and the key (no Backup
/// object), restores it with `kubectl apply` of a BackupRestore → Succeeded, progress 100%,
/// the VM boots with the marker on its (shared-class) data disk, its cloud-init Secret, its
/// (node-local) root disk and its MAC. A second BackupRestore beside it under a new name with
/// `newMacAddresses` and `newFirmwareUUID` gets another MAC and UUID; one of the data volume
/// only (`volumes`) gives a DataVolume with the marker and no VM; one naming a missing
/// backup, one with a wrong key and one whose VM name is taken fail naming the cause; a
/// namespace mapping into another namespace is refused at admission. Last, server B is killed
/// while it restores a 384 MiB random volume: restarted, it runs the restore again to a
/// volume with the backed-up SHA-256.
#[test]
fn backup_restore_object_on_a_second_server() -> anyhow::Result<()> {
    let t0 = Instant::now();
    let guest = TestGuest::get()?;
    let store = tempfile::Builder::new().prefix("fv-bk-target-").tempdir()?;
    let target = format!(
        r#"
apiVersion: v1
kind: Secret
metadata: {{name: bk-key, namespace: default}}
stringData: {{key: "{KEY}"}}
---
apiVersion: backup.ferrovirt.io/v1alpha1
kind: BackupTarget
metadata: {{name: fs}}
spec: {{filesystem: {{path: "{}", prefix: e2e}}}}
"#,
        store.path().display()
    );
    let a = Cluster::start(&ClusterOptions::new(BIN))?;
    let url = serve_files(vec![("disk.qcow2".into(), guest.disk_qcow2.clone())])? + "/disk.qcow2";
    a.apply(&target)?;
    // The data disk on the shared class (written in-process by the restore), the root disk
    // node-local (written through the node agent).
    let vm = vm_yaml(&url)
        .replace(
            "source: {blank: {}}\n  storage: {resources",
            "source: {blank: {}}\n  storage: {storageClassName: shared, resources",
        )
        .replace(
            "          - name: data\n            disk: {bus: virtio}\n",
            "          - name: data\n            disk: {bus: virtio}\n          interfaces:\n          \
             - {name: default, masquerade: {}, macAddress: \"02:aa:bb:cc:dd:01\"}\n      \
             networks:\n      - {name: default, pod: {}}\n",
        );
    anyhow::ensure!(vm.contains("storageClassName: shared") && vm.contains("macAddress"));
    a.apply(&vm)?;
    let (_, console) = boot(&a, "bkvm")?;
    let (out, rc) = console.exec(
        &format!("echo {MARKER} | dd of=/dev/vdb bs=512 seek=0 conv=fsync && sync"),
        Duration::from_secs(30),
    )?;
    anyhow::ensure!(rc == 0, "writing the marker: {out}");
    drop(console);
    a.halt_vm("bkvm", STEP)?;
    a.apply(
        "apiVersion: backup.ferrovirt.io/v1alpha1\nkind: Backup\nmetadata: {name: b1, namespace: default}\n\
         spec: {target: fs, virtualMachines: [bkvm], encryptionKeySecretRef: bk-key}\n",
    )?;
    let b1 = wait_backup(&a, "b1")?;
    assert_eq!(b1["status"]["phase"], "Succeeded", "{b1}");
    // A VM with a 384 MiB random volume, for the restore killed half-way below.
    let big_sum = fill_big_vm(&a)?;
    a.apply(
        "apiVersion: backup.ferrovirt.io/v1alpha1\nkind: Backup\nmetadata: {name: b2, namespace: default}\n\
         spec: {target: fs, virtualMachines: [bigvm], encryptionKeySecretRef: bk-key}\n",
    )?;
    let b2 = wait_backup(&a, "b2")?;
    assert_eq!(b2["status"]["phase"], "Succeeded", "{b2}");
    drop(a);
    eprintln!("backed up after {:?}", t0.elapsed());

    let mut b = Cluster::start(&ClusterOptions::new(BIN))?;
    b.apply(&target)?;
    let restore = |name: &str, extra: &str| {
        b.apply(&format!(
            "apiVersion: backup.ferrovirt.io/v1alpha1\nkind: BackupRestore\n\
             metadata: {{name: {name}, namespace: default}}\n\
             spec: {{target: fs, encryptionKeySecretRef: bk-key, {extra}}}\n"
        ))
    };
    let wait = |name: &str| {
        b.wait_until(&format!("restore {name} finished"), STEP, || {
            let v = b.get_json(&["backuprestore", name, "-n", "default"])?;
            let p = v["status"]["phase"].as_str().unwrap_or("");
            Ok((p == "Succeeded" || p == "Failed").then_some(v))
        })
    };
    restore("r1", "backupName: default-b1, start: true")?;
    let r1 = wait("r1")?;
    assert_eq!(r1["status"]["phase"], "Succeeded", "{r1}");
    assert_eq!(r1["status"]["progress"], "100%", "{r1}");
    assert_eq!(
        r1["status"]["restoredVirtualMachines"],
        serde_json::json!(["default/bkvm"]),
        "{r1}"
    );
    assert_eq!(
        r1["status"]["restoredVolumes"].as_array().map(Vec::len),
        Some(2),
        "{r1}"
    );
    let table = b.kubectl_ok(&["get", "backuprestore", "r1", "-n", "default"])?;
    assert!(
        table.contains("BACKUP") && table.contains("default-b1") && table.contains("100%"),
        "{table}"
    );
    // Both write paths: the shared data disk in-process, the root disk through the agent.
    let class = |pvc: &str| -> anyhow::Result<String> {
        let v = b.get_json(&["pvc", pvc, "-n", "default"])?;
        Ok(v["spec"]["storageClassName"]
            .as_str()
            .unwrap_or("")
            .to_string())
    };
    assert_eq!(class("bk-data")?, "shared");
    assert_ne!(class("bk-root")?, "shared");
    let (log, console) = boot(&b, "bkvm")?;
    eprintln!("restored and booted after {:?}", t0.elapsed());
    assert!(
        log.contains("CLOUDINIT-FROM-SECRET"),
        "restored user-data did not run:\n{log}"
    );
    let (out, _) = console.exec(
        &format!(
            "dd if=/dev/vdb bs=512 count=1 2>/dev/null | head -c {}; echo",
            MARKER.len()
        ),
        Duration::from_secs(30),
    )?;
    assert_eq!(
        out.replace('\0', "").trim(),
        MARKER,
        "the restored data disk"
    );
    drop(console);
    let mac = |vm: &str| -> anyhow::Result<String> {
        let v = b.get_json(&["vm", vm, "-n", "default"])?;
        Ok(
            v["spec"]["template"]["spec"]["domain"]["devices"]["interfaces"][0]["macAddress"]
                .as_str()
                .unwrap_or("")
                .to_string(),
        )
    };
    assert_eq!(mac("bkvm")?, "02:aa:bb:cc:dd:01");

    // Beside it under a new name, with a new MAC and firmware UUID.
    restore(
        "r2",
        "backupName: default-b1, newMacAddresses: true, newFirmwareUUID: true, \
         virtualMachines: [{name: default/bkvm, newName: bkvm2}]",
    )?;
    let r2 = wait("r2")?;
    assert_eq!(r2["status"]["phase"], "Succeeded", "{r2}");
    let mac2 = mac("bkvm2")?;
    assert!(
        !mac2.is_empty() && mac2 != "02:aa:bb:cc:dd:01",
        "new MAC {mac2:?}"
    );
    let vm2 = b.get_json(&["vm", "bkvm2", "-n", "default"])?;
    assert_eq!(vm2["spec"]["runStrategy"], "Halted", "{vm2}");
    assert!(
        vm2["spec"]["template"]["spec"]["domain"]["firmware"]["uuid"].is_string(),
        "{vm2}"
    );
    let dv = b.get_json(&["dv", "bkvm2-bk-data", "-n", "default"])?;
    assert_eq!(dv["status"]["phase"], "Succeeded", "{dv}");

    // Only the data disk, under a new name: one DataVolume holding the marker, no VM.
    restore(
        "r7",
        "backupName: default-b1, \
         virtualMachines: [{name: default/bkvm, newName: only, volumes: [bk-data]}]",
    )?;
    let r7 = wait("r7")?;
    assert_eq!(r7["status"]["phase"], "Succeeded", "{r7}");
    let vols = r7["status"]["restoredVolumes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(vols.len(), 1, "{r7}");
    assert_eq!(vols[0]["name"], "only-bk-data", "{r7}");
    assert!(
        r7["status"]["restoredVirtualMachines"]
            .as_array()
            .is_none_or(Vec::is_empty),
        "{r7}"
    );
    assert!(
        !b.kubectl(&["get", "vm", "only", "-n", "default"])?
            .status
            .success()
    );
    let img = std::fs::read(volume_image(&b, "only-bk-data")?)?;
    assert_eq!(
        String::from_utf8_lossy(&img[..MARKER.len()]),
        MARKER,
        "the restored volume holds the marker"
    );
    restore(
        "r8",
        "backupName: default-b1, virtualMachines: [{name: default/bkvm, volumes: [nope]}]",
    )?;
    let r8 = wait("r8")?;
    assert_eq!(r8["status"]["phase"], "Failed", "{r8}");
    assert!(
        ready_message(&r8).contains("spec.virtualMachines[0].volumes[0]"),
        "{r8}"
    );

    // Failures name their cause.
    restore("r3", "backupName: nope")?;
    let r3 = wait("r3")?;
    assert_eq!(r3["status"]["phase"], "Failed", "{r3}");
    let m = ready_message(&r3);
    assert!(m.contains("nope") && m.contains("spec.backupName"), "{r3}");
    b.apply(
        "apiVersion: v1\nkind: Secret\nmetadata: {name: other-key, namespace: default}\n\
         stringData: {key: \"not-the-repository-key-0000000\"}\n",
    )?;
    b.apply(
        "apiVersion: backup.ferrovirt.io/v1alpha1\nkind: BackupRestore\n\
         metadata: {name: r4, namespace: default}\n\
         spec: {target: fs, encryptionKeySecretRef: other-key, backupName: default-b1}\n",
    )?;
    let r4 = wait("r4")?;
    assert_eq!(r4["status"]["phase"], "Failed", "{r4}");
    let m = ready_message(&r4);
    assert!(
        m.contains("wrong encryption key") && m.contains("spec.encryptionKeySecretRef"),
        "{r4}"
    );
    restore("r5", "backupName: default-b1")?;
    let r5 = wait("r5")?;
    assert_eq!(r5["status"]["phase"], "Failed", "{r5}");
    assert!(
        ready_message(&r5).contains("VirtualMachine default/bkvm already exists"),
        "{r5}"
    );
    let refused = restore(
        "r6",
        "backupName: default-b1, namespaceMapping: {default: elsewhere}",
    );
    let e = format!("{refused:?}");
    assert!(
        refused.is_err() && e.contains("spec.namespaceMapping.default"),
        "{e}"
    );

    // The server killed while a restore writes: restarted, it runs the restore again from the
    // start over its own DataVolume, to a volume identical to the backed-up one.
    restore("rk", "backupName: default-b2")?;
    b.wait_until("restore rk running", STEP, || {
        let v = b.get_json(&["backuprestore", "rk", "-n", "default"])?;
        Ok((v["status"]["phase"] == "Running").then_some(()))
    })?;
    std::thread::sleep(Duration::from_millis(1500));
    let v = b.get_json(&["backuprestore", "rk", "-n", "default"])?;
    anyhow::ensure!(
        v["status"]["phase"] == "Running",
        "the restore ended before the kill (make the volume larger): {v}"
    );
    b.kill_server()?;
    b.restart_server()?;
    let rk = b.wait_until("restore rk finished", STEP, || {
        let v = b.get_json(&["backuprestore", "rk", "-n", "default"])?;
        let p = v["status"]["phase"].as_str().unwrap_or("");
        Ok((p == "Succeeded" || p == "Failed").then_some(v))
    })?;
    assert_eq!(rk["status"]["phase"], "Succeeded", "{rk}");
    let events = b.get_json(&[
        "events",
        "-n",
        "default",
        "--field-selector",
        "involvedObject.name=rk",
    ])?;
    assert!(
        events["items"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|e| e["reason"] == "Started"
                && e["message"].as_str().unwrap_or("").contains("again")),
        "no rerun after the restart: {events}"
    );
    assert_eq!(
        sha256(&volume_image(&b, "big")?, 384 << 20)?,
        big_sum,
        "the restored volume differs from the backed-up one"
    );
    eprintln!("done after {:?}", t0.elapsed());
    Ok(())
}
