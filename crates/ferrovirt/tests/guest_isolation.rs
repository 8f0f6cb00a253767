//! Untrusted guests against the node (issue #13, "Guests and disk formats"), through the real
//! server, its embedded agent and the test guest under TCG:
//! - a guest writes a qcow2 header naming a host file into its raw data disk; after a restart
//!   (a new VMI) it reads back exactly its own bytes, QEMU's block nodes are `raw`, and QEMU
//!   holds no descriptor of the host file;
//! - hostDisk and hand-made PV host paths are refused, with the field and the path named, when
//!   the HostDisk gate is off, through a symlink, under /proc, as a device node, inside the
//!   data dir, or outside the allowed roots; nothing is created;
//! - two VMs' QEMUs run as two distinct non-root uids with their images owned by them (0600),
//!   inside cgroups with pids and CPU limits, and a guest flooding its console leaves
//!   serial.log within its bound.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use base64::Engine;
use ferrovirt_testkit::console::SerialConsole;
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(180);
const CMD: Duration = Duration::from_secs(60);

fn cluster(extra: &[&str]) -> anyhow::Result<Cluster> {
    TestGuest::get()?;
    let mut o = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
    o.extra_args = extra.iter().map(|s| s.to_string()).collect();
    Cluster::start(&o)
}

/// A hand-made PV + claim `name` whose volume dir holds a 1 MiB raw `disk.img`.
fn data_claim(c: &Cluster, name: &str) -> anyhow::Result<PathBuf> {
    let dir = c.dir.path().join("pvs").join(name);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("disk.img"), vec![0u8; 1 << 20])?;
    pv_and_claim(c, name, &dir)?;
    Ok(dir)
}

fn pv_and_claim(c: &Cluster, name: &str, path: &Path) -> anyhow::Result<()> {
    c.apply(&format!(
        r#"
apiVersion: v1
kind: PersistentVolume
metadata: {{name: pv-{name}}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  hostPath: {{path: {path}}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {name}, namespace: default}}
spec:
  accessModes: [ReadWriteOnce]
  resources: {{requests: {{storage: 1Gi}}}}
  volumeName: pv-{name}
"#,
        path = path.display()
    ))?;
    Ok(())
}

/// A VMI on the guest disk claim `root`, with extra `volumes` (YAML list items, already
/// indented) attached as virtio disks `disks`.
fn vmi(c: &Cluster, name: &str, root: &str, disks: &[&str], volumes: &str) -> anyhow::Result<()> {
    let disks: String = disks
        .iter()
        .map(|d| format!("      - name: {d}\n        disk: {{bus: virtio}}\n"))
        .collect();
    c.apply(&format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: {name}, namespace: default}}
spec:
  terminationGracePeriodSeconds: 5
  domain:
    memory: {{guest: 128Mi}}
    devices:
      disks:
      - name: root
        disk: {{bus: virtio}}
{disks}  volumes:
  - name: root
    persistentVolumeClaim: {{claimName: {root}}}
{volumes}"#
    ))?;
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

fn console(c: &Cluster, uid: &str) -> anyhow::Result<SerialConsole> {
    let sock = c.agent_dir().join("vmis").join(uid).join("serial.sock");
    let con = SerialConsole::connect(&sock, BOOT)?;
    // The shell answers once the guest is up.
    c.wait_until("a shell on the console", BOOT, || {
        Ok(con
            .exec("echo shell-ok", Duration::from_secs(5))
            .ok()
            .filter(|(o, _)| o.contains("shell-ok"))
            .map(|_| ()))
    })?;
    Ok(con)
}

fn exec(con: &SerialConsole, cmd: &str) -> anyhow::Result<String> {
    let (out, rc) = con.exec(cmd, CMD)?;
    anyhow::ensure!(rc == 0, "{cmd}: rc {rc}: {out}");
    Ok(out)
}

fn qemu_pid(c: &Cluster, name: &str) -> anyhow::Result<u32> {
    c.wait_until("the QEMU pid annotation", BOOT, || {
        let v = c.get_json(&["vmi", name])?;
        Ok(v["metadata"]["annotations"]["ferrovirt.io/qemu-pid"]
            .as_str()
            .and_then(|p| p.parse().ok()))
    })
}

fn delete_vmi(c: &Cluster, name: &str) -> anyhow::Result<()> {
    c.kubectl_ok(&["delete", "vmi", name, "--timeout=120s"])?;
    c.wait_gone("vmi", name, Duration::from_secs(120))
}

/// The message of the VMI's failed start, once it has one.
fn refusal(c: &Cluster, name: &str) -> anyhow::Result<String> {
    c.wait_until(
        &format!("VMI {name} refused"),
        Duration::from_secs(60),
        || {
            let v: Value = c.get_json(&["vmi", name])?;
            Ok((v["status"]["phase"] == "Failed").then(|| {
                v["status"]["conditions"][0]["message"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            }))
        },
    )
}

#[test]
fn a_qcow2_header_written_by_the_guest_is_never_followed() -> anyhow::Result<()> {
    let c = cluster(&[])?;
    c.guest_disk_claim("root1")?;
    let data = data_claim(&c, "data1")?;
    // The bait: a host file the crafted header names as its backing file.
    let secret = c.dir.path().join("host-secret.txt");
    std::fs::write(&secret, "HOST-SECRET-BYTES\n".repeat(64))?;
    let hdr = c.dir.path().join("crafted.qcow2");
    let out = std::process::Command::new("qemu-img")
        .args([
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=512",
            "-F",
            "raw",
            "-b",
        ])
        .arg(&secret)
        .arg(&hdr)
        .arg("1M")
        .output()?;
    anyhow::ensure!(out.status.success(), "qemu-img: {out:?}");
    let crafted = std::fs::read(&hdr)?;
    let volumes = "  - name: data\n    persistentVolumeClaim: {claimName: data1}\n";
    vmi(&c, "fmt1", "root1", &["data"], volumes)?;
    let uid = c.wait_booted("fmt1", BOOT)?;
    let con = console(&c, &uid)?;
    // The guest writes the header into the start of its own raw data disk.
    let b64 = base64::engine::general_purpose::STANDARD.encode(&crafted);
    exec(&con, "rm -f /tmp/h.b64")?;
    for chunk in b64.as_bytes().chunks(600) {
        exec(
            &con,
            &format!("echo {} >> /tmp/h.b64", std::str::from_utf8(chunk)?),
        )?;
    }
    exec(
        &con,
        "base64 -d /tmp/h.b64 > /tmp/h && dd if=/tmp/h of=/dev/vdb conv=notrunc,fsync 2>/dev/null && sync",
    )?;
    drop(con);
    delete_vmi(&c, "fmt1")?;
    let on_disk = std::fs::read(data.join("disk.img"))?;
    assert_eq!(
        &on_disk[..crafted.len()],
        &crafted[..],
        "the guest's write reached the disk"
    );

    // A new VMI on the same disks: QEMU opens the data disk as raw, not as the qcow2 its
    // bytes describe.
    vmi(&c, "fmt1", "root1", &["data"], volumes)?;
    let uid = c.wait_booted("fmt1", BOOT)?;
    let con = console(&c, &uid)?;
    let n = crafted.len();
    let sum = exec(&con, &format!("head -c {n} /dev/vdb | md5sum"))?;
    let want = md5_hex(&hdr)?;
    assert!(sum.contains(&want), "guest read {sum:?}, wrote md5 {want}");
    let size = exec(&con, "blockdev --getsize64 /dev/vdb")?;
    assert!(size.contains(&(1u64 << 20).to_string()), "{size}");
    // QEMU's block nodes: each disk raw, no node for the host file.
    let argv: Vec<String> = serde_json::from_slice(&std::fs::read(
        c.agent_dir().join("vmis").join(&uid).join("qemu-argv.json"),
    )?)?;
    let nodes: Vec<Value> = argv
        .windows(2)
        .filter(|w| w[0] == "-blockdev")
        .map(|w| serde_json::from_str(&w[1]))
        .collect::<Result<_, _>>()?;
    let secret_s = secret.display().to_string();
    for n in &nodes {
        assert!(!n.to_string().contains(&secret_s), "{n}");
        if n["node-name"]
            .as_str()
            .is_some_and(|s| s.starts_with("fmt-"))
        {
            assert_eq!(n["driver"], "raw", "{n}");
        }
    }
    // Nothing read: QEMU holds no descriptor of the host file.
    let pid = qemu_pid(&c, "fmt1")?;
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let target = std::fs::read_link(fd?.path()).unwrap_or_default();
        assert_ne!(target, secret, "QEMU opened the host file");
    }
    Ok(())
}

fn md5_hex(path: &Path) -> anyhow::Result<String> {
    let out = std::process::Command::new("md5sum").arg(path).output()?;
    let text = String::from_utf8(out.stdout)?;
    Ok(text
        .split_whitespace()
        .next()
        .context("md5sum output")?
        .to_string())
}

#[test]
fn host_paths_outside_the_rules_are_refused_by_name() -> anyhow::Result<()> {
    let c = cluster(&[])?;
    let root = c.dir.path();
    let host_disk = |name: &str, path: &Path, kind: &str| -> anyhow::Result<()> {
        let volumes = format!(
            "  - name: hd\n    hostDisk: {{path: {}, type: {kind}, capacity: 1Mi}}\n",
            path.display()
        );
        vmi(&c, name, "nothing", &["hd"], &volumes)
    };
    // Gate off: refused, and DiskOrCreate made nothing.
    let fresh = root.join("made-by-guest.img");
    host_disk("gate", &fresh, "DiskOrCreate")?;
    let m = refusal(&c, "gate")?;
    assert!(
        m.contains("spec.volumes[1].hostDisk.path") && m.contains("HostDisk"),
        "{m}"
    );
    assert!(!fresh.exists(), "a refused DiskOrCreate created its file");

    c.apply(
        r#"
apiVersion: v1
kind: Namespace
metadata: {name: kubevirt-hyperconverged}
---
apiVersion: hco.kubevirt.io/v1beta1
kind: HyperConverged
metadata: {name: kubevirt-hyperconverged, namespace: kubevirt-hyperconverged}
spec:
  featureGates: {HostDisk: true}
"#,
    )?;
    // Gate on: each forbidden path is refused with the field and the path named.
    std::fs::write(root.join("real.img"), vec![0u8; 4096])?;
    std::os::unix::fs::symlink("/etc/shadow", root.join("link.img"))?;
    std::fs::create_dir(root.join("linkdir-target"))?;
    std::fs::write(root.join("linkdir-target/x.img"), b"x")?;
    std::os::unix::fs::symlink(root.join("linkdir-target"), root.join("linkdir"))?;
    let dev = root.join("dev-null");
    let st = std::process::Command::new("mknod")
        .arg(&dev)
        .args(["c", "1", "3"])
        .status()?;
    anyhow::ensure!(st.success(), "mknod");
    let data_dir_file = c.data_dir.join("token");
    let cases: Vec<(&str, PathBuf, &str, &str)> = vec![
        ("link", root.join("link.img"), "Disk", "symbolic link"),
        (
            "linkdir",
            root.join("linkdir/x.img"),
            "Disk",
            "symbolic link",
        ),
        ("proc", "/proc/self/root/etc/shadow".into(), "Disk", "/proc"),
        ("device", dev.clone(), "Disk", "device nodes"),
        ("datadir", data_dir_file.clone(), "Disk", "data directory"),
        (
            "outside",
            "/etc/ferrovirt-probe.img".into(),
            "DiskOrCreate",
            "allowed root",
        ),
    ];
    for (name, path, kind, _) in &cases {
        host_disk(name, path, kind)?;
    }
    for (name, path, _, why) in &cases {
        let m = refusal(&c, name)?;
        assert!(
            m.contains("spec.volumes[1].hostDisk.path")
                && m.contains(&path.display().to_string())
                && m.contains(why),
            "{name}: {m}"
        );
    }
    assert!(!Path::new("/etc/ferrovirt-probe.img").exists());
    // A hand-made PV pointing into ferrovirt's data dir is refused the same way.
    pv_and_claim(&c, "sneaky", &c.data_dir)?;
    vmi(&c, "pv", "sneaky", &[], "")?;
    let m = refusal(&c, "pv")?;
    assert!(
        m.contains("spec.volumes[0].persistentVolumeClaim.claimName")
            && m.contains(&c.data_dir.display().to_string())
            && m.contains("data directory"),
        "{m}"
    );
    // Nothing was started or left behind: no VMI directory at all.
    let vmis = c.agent_dir().join("vmis");
    let left: Vec<_> = std::fs::read_dir(&vmis)?.collect::<Result<_, _>>()?;
    assert!(left.is_empty(), "left behind: {left:?}");
    Ok(())
}

fn proc_uid(pid: u32) -> anyhow::Result<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .context("Uid line")?;
    Ok(line.split_whitespace().nth(2).context("euid")?.parse()?)
}

#[test]
fn each_qemu_has_its_own_uid_limits_and_a_bounded_serial_log() -> anyhow::Result<()> {
    let max = 64 * 1024u64;
    let c = cluster(&[
        "--serial-log-max-bytes",
        &max.to_string(),
        "--vm-pids-max",
        "700",
    ])?;
    c.guest_disk_claim("roota")?;
    c.guest_disk_claim("rootb")?;
    vmi(&c, "vma", "roota", &[], "")?;
    vmi(&c, "vmb", "rootb", &[], "")?;
    let uid_a = c.wait_booted("vma", BOOT)?;
    c.wait_booted("vmb", BOOT)?;
    let (pa, pb) = (qemu_pid(&c, "vma")?, qemu_pid(&c, "vmb")?);
    let (ua, ub) = (proc_uid(pa)?, proc_uid(pb)?);
    assert!(ua != 0 && ub != 0, "QEMU runs as root: {ua} {ub}");
    assert_ne!(ua, ub, "two VMs share a QEMU uid");
    // Each VM's disk belongs to its own QEMU uid, readable by no one else.
    for (claim, uid) in [("roota", ua), ("rootb", ub)] {
        let dir = c.dir.path().join("pvs").join(claim);
        let m = std::fs::metadata(dir.join("disk.img"))?;
        assert_eq!(m.uid(), uid, "{claim} owner");
        assert_eq!(m.permissions().mode() & 0o777, 0o600, "{claim} mode");
        let dm = std::fs::metadata(&dir)?;
        assert_eq!(dm.permissions().mode() & 0o777, 0o700, "{claim} dir mode");
        assert_eq!(dm.uid(), 0);
    }
    // cgroup limits, with QEMU inside.
    let cgroups = std::fs::read_to_string(format!("/proc/{pa}/cgroup"))?;
    let leaf = format!("ferrovirt/{uid_a}");
    let v1 = Path::new("/sys/fs/cgroup/pids").exists();
    if v1 {
        let pids = Path::new("/sys/fs/cgroup/pids").join(&leaf);
        assert_eq!(
            std::fs::read_to_string(pids.join("pids.max"))?.trim(),
            "700"
        );
        let cpu = Path::new("/sys/fs/cgroup/cpu").join(&leaf);
        assert_eq!(
            std::fs::read_to_string(cpu.join("cpu.cfs_quota_us"))?.trim(),
            "200000",
            "1 vCPU + 1"
        );
        for dir in [&pids, &cpu] {
            let procs = std::fs::read_to_string(dir.join("cgroup.procs"))?;
            assert!(procs.lines().any(|l| l == pa.to_string()), "{procs}");
        }
    } else {
        let dir = Path::new("/sys/fs/cgroup").join(&leaf);
        assert_eq!(std::fs::read_to_string(dir.join("pids.max"))?.trim(), "700");
        assert!(std::fs::read_to_string(dir.join("cpu.max"))?.starts_with("200000 "));
    }
    assert!(cgroups.matches(&leaf).count() >= 2, "{cgroups}");

    // A flood on the console: serial.log stays within its bound (rotated once or more).
    let con = console(&c, &uid_a)?;
    exec(&con, "head -c 600000 /dev/zero | tr '\\0' F; echo")?;
    let log = c.agent_dir().join("vmis").join(&uid_a).join("serial.log");
    let n = std::fs::metadata(&log)?.len();
    assert!(n <= max, "serial.log is {n} bytes, bound {max}");
    let old = std::fs::metadata(log.with_file_name("serial.log.1"))?.len();
    assert!(old <= max, "serial.log.1 is {old} bytes");
    eprintln!("serial.log {n} B, serial.log.1 {old} B after a 600 kB flood");

    // Deleting a VMI releases its uid.
    delete_vmi(&c, "vma")?;
    let claims = c.agent_dir().join("qemu-uids");
    assert!(
        !claims.join(ua.to_string()).exists(),
        "uid {ua} still claimed"
    );
    assert!(claims.join(ub.to_string()).exists());
    Ok(())
}
