//! Live migration end to end (docs/migration.md). Two nodes: the server's embedded node1 and an
//! agent process node2, each with its own data dir. A VM on a ReadWriteMany claim boots on one
//! node; a VirtualMachineInstanceMigration applied with kubectl moves it to the other while
//! the guest keeps running (its uptime keeps growing, read on the serial console before and
//! after), then `ferrovirt migrate` brings it back. A VM on a node-local (`local` class) claim
//! is block-migrated: its disk is mirrored to a fresh copy on the other node, the guest reads
//! what it wrote there, the PV follows and the source's copy is deleted (post-copy:
//! `migration_postcopy.rs`). While the VM
//! moves, a probe asks both launchers every few ms whether their QEMU runs the guest: never
//! both at once (one writer per disk). A migration slowed by a MigrationPolicy is cancelled
//! mid-way, then one has its target launcher and QEMU killed mid-way: the source runs on.
//! While the slowed migration runs, its TCP connection between the nodes is held by the two
//! QEMUs and by no other process: the agents are not in the stream's path. The source agent,
//! then the target agent, is killed mid-way through a slowed migration and started again:
//! the migration still succeeds (the restarted source picks it up from its QEMU). Mid-way
//! through the latter, the source node's `/metrics` has the migration's progress series, and
//! after it the server's has `kubevirt_vmi_migration_succeeded` (docs/metrics.md).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ferrovirt_testkit::console::SerialConsole;
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use serde_json::Value;

mod migkit;
use migkit::*;

#[test]
fn live_migrates_a_vm_on_shared_storage_and_back() -> anyhow::Result<()> {
    let c = two_nodes()?;
    let disk = claim(&c, "mig-disk", true)?;
    c.apply(&vm("mig", "mig-disk"))?;
    let (uid, first) = running(&c, "mig")?;
    let first = first.as_str();
    let src_dir = node_dir(&c, first).join("vmis").join(&uid);
    c.wait_until("the guest ready", BOOT, || {
        let log = std::fs::read(src_dir.join("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    c.wait_until("LiveMigratable=True", Duration::from_secs(20), || {
        let v = c.get_json(&["vmi", "mig"])?;
        Ok(v["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "LiveMigratable" && c["status"] == "True")
            .then_some(()))
    })?;
    let before = uptime(&src_dir)?;

    // kubectl apply of a VirtualMachineInstanceMigration, while a probe asks both launchers
    // what their QEMU does: never both running.
    let dst_dir = node_dir(&c, other(first)).join("vmis").join(&uid);
    let probe = Probe::start(src_dir.clone(), dst_dir);
    let t0 = Instant::now();
    c.apply(&migration("mig-1", "mig"))?;
    let m = finished(&c, "mig-1", MIGRATE)?;
    let took = t0.elapsed();
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    let phases: Vec<&str> = m["status"]["phaseTransitionTimestamps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["phase"].as_str())
        .collect();
    for p in [
        "Pending",
        "Scheduling",
        "Scheduled",
        "TargetReady",
        "Running",
        "Succeeded",
    ] {
        assert!(phases.contains(&p), "phase {p} recorded: {phases:?}");
    }
    let second = other(first);
    let mid = check_moved(&c, &uid, first, second, before)?;
    // The probe runs until the target is reported Running (check_moved waits for it): the
    // migration may be recorded Succeeded before the probe's next look at the target.
    let seen = probe.stop();
    eprintln!("probe: {seen:?}");
    assert!(
        seen.overlaps == 0,
        "two running QEMUs on one disk seen {} times",
        seen.overlaps
    );
    assert!(
        seen.source_running > 0 && seen.target_running > 0,
        "the probe saw both sides run: {seen:?}"
    );
    // The shared disk's storage lease went with the VM.
    let lease: Value = serde_json::from_slice(&std::fs::read(disk.join(".ferrovirt-lease"))?)?;
    c.wait_until(
        "the storage lease held by the target",
        Duration::from_secs(10),
        || {
            let l: Value = serde_json::from_slice(&std::fs::read(disk.join(".ferrovirt-lease"))?)?;
            Ok((l["node"] == second).then_some(()))
        },
    )
    .map_err(|e| anyhow::anyhow!("{e}; lease was {lease}"))?;
    // Events explain it.
    let events = c.kubectl_ok(&["get", "events", "-n", "default"])?;
    assert!(events.contains("Migrated"), "{events}");
    for l in events.lines().filter(|l| l.contains("downtime")) {
        eprintln!("{l}");
    }
    eprintln!("migration {first} → {second}: {took:?} (uptime {before:.1} s → {mid:.1} s)");

    // `ferrovirt migrate` brings it back.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrovirt"))
        .args(["migrate", "mig", "--kubeconfig"])
        .arg(&c.kubeconfig)
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("was scheduled to migrate"));
    let name = c.wait_until("the CLI's migration", Duration::from_secs(10), || {
        let v = c.get_json(&["vmim"])?;
        Ok(v["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["metadata"]["name"].as_str())
            .find(|n| n.starts_with("kubevirt-migrate-vm-"))
            .map(String::from))
    })?;
    let m = finished(&c, &name, MIGRATE)?;
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    check_moved(&c, &uid, second, first, mid)?;
    let table = c.kubectl_ok(&["get", "vmim"])?;
    assert!(
        table.contains("Succeeded") && table.contains("mig"),
        "{table}"
    );
    c.kubectl_ok(&["delete", "vm", "mig", "--timeout=120s"])?;
    Ok(())
}

/// A `local` class volume on `node` as its agent's provisioner leaves it (`volumes/<pv>/`
/// in the agent's data dir, the PV's `local.path` and node affinity, the provisioner's
/// annotation) holding a copy of the test guest's disk grown to 1 GiB, and a claim bound to
/// it. Returns the volume directory.
/// The marker the guest writes at 900 MiB into its disk, past the boot image.
const MARKER: &str = "FERROVIRT-BLOCK-MIGRATED-DATA";

#[test]
fn a_vm_on_a_node_local_disk_is_block_migrated_with_its_disk() -> anyhow::Result<()> {
    let c = two_nodes()?;
    let src_vol = local_claim(&c, "local-disk", "node1")?;
    c.apply(&vm("mig", "local-disk"))?;
    let (uid, node) = running(&c, "mig")?;
    assert_eq!(node, "node1", "the VM runs where its volume is");
    let src = node_dir(&c, &node).join("vmis").join(&uid);
    c.wait_until("the guest ready", BOOT, || {
        let log = std::fs::read(src.join("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    c.wait_until("LiveMigratable=True", Duration::from_secs(20), || {
        let v = c.get_json(&["vmi", "mig"])?;
        Ok(v["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "LiveMigratable" && c["status"] == "True")
            .then_some(()))
    })?;
    // The guest writes a marker onto its disk and flushes it.
    let console = SerialConsole::connect(&src.join("serial.sock"), Duration::from_secs(10))?;
    let (out, rc) = console.exec(
        &format!("echo {MARKER} | dd of=/dev/vda bs=1M seek=900 conv=fsync 2>&1; sync"),
        Duration::from_secs(30),
    )?;
    assert_eq!(rc, 0, "{out}");
    let before = uptime_on(&console)?;
    drop(console);

    let t0 = Instant::now();
    c.apply(&migration("mig-local", "mig"))?;
    let m = finished(&c, "mig-local", Duration::from_secs(300))?;
    eprintln!("block migration took {:?}", t0.elapsed());
    // Both sides' step timings (docs/migration.md "where the window goes").
    let logs = format!("{}\n{}", c.server_log(), c.agent_log("node2"));
    for l in logs.lines().filter(|l| {
        l.contains("block migration:")
            || l.contains("disk mirrors in sync")
            || l.contains("migration setup:")
    }) {
        eprintln!("{l}");
    }
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    let v = c.get_json(&["vmi", "mig"])?;
    assert_eq!(v["status"]["migrationMethod"], "BlockMigration");
    assert_eq!(v["status"]["nodeName"], "node2");
    assert_eq!(v["metadata"]["uid"], uid.as_str());
    let dst = node_dir(&c, "node2").join("vmis").join(&uid);
    c.wait_until("the source QEMU gone", Duration::from_secs(20), || {
        Ok(qemu_in(&src).is_none().then_some(()))
    })?;
    // The guest did not reboot, and reads its marker back from the disk on node2 (its page
    // cache dropped first, so the read goes to the copied disk).
    let console = SerialConsole::connect(&dst.join("serial.sock"), Duration::from_secs(10))?;
    let after = uptime_on(&console)?;
    assert!(after > before, "no reboot: uptime {before} s → {after} s");
    let (out, rc) = console.exec(
        "echo 3 > /proc/sys/vm/drop_caches; dd if=/dev/vda bs=1M skip=900 count=1 2>/dev/null | head -c 64",
        Duration::from_secs(30),
    )?;
    assert_eq!(rc, 0, "{out}");
    assert!(
        out.contains(MARKER),
        "the guest reads its data on node2: {out:?}"
    );
    // The copy on node2 holds it; the PV names it and node2; node1's copy is gone.
    let dst_vol = node_dir(&c, "node2").join("volumes").join("pv-local-disk");
    let img = std::fs::read(dst_vol.join("disk.img"))?;
    let at = 900 << 20;
    assert_eq!(
        &img[at..at + MARKER.len()],
        MARKER.as_bytes(),
        "the marker in node2's copy"
    );
    drop(img);
    let pv = c.wait_until("the PV on node2", Duration::from_secs(30), || {
        let pv = c.get_json(&["pv", "pv-local-disk"])?;
        Ok((pv["spec"]["local"]["path"] == dst_vol.display().to_string()).then_some(pv))
    })?;
    assert_eq!(
        pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
            [0],
        "node2"
    );
    c.wait_until("node1's copy deleted", Duration::from_secs(60), || {
        Ok((!src_vol.exists()).then_some(()))
    })?;
    assert!(!dst_vol.join(".ferrovirt-migrating-in").exists());

    // Back to node1 with `disableTLS` (KubeVirt's field, set through the HyperConverged): the
    // disk's NBD copy and the memory stream are plain, and the guest still reads its marker from the copy.
    c.patch_hco(r#"{"spec":{"liveMigrationConfig":{"disableTLS":true}}}"#)?;
    c.wait_until(
        "disableTLS in the KubeVirt CR",
        Duration::from_secs(30),
        || {
            let kv = c.get_json(&[
                "kubevirt",
                "kubevirt-kubevirt-hyperconverged",
                "-n",
                "kubevirt-hyperconverged",
            ])?;
            Ok((kv["spec"]["configuration"]["migrations"]["disableTLS"] == true).then_some(()))
        },
    )?;
    // The migration controller reads the same CR from its own watch: a moment for it.
    std::thread::sleep(Duration::from_secs(1));
    c.apply(&migration("mig-plain", "mig"))?;
    let m = finished(&c, "mig-plain", Duration::from_secs(300))?;
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    let v = c.get_json(&["vmi", "mig"])?;
    let st = &v["status"]["migrationState"];
    assert_eq!(v["status"]["nodeName"], "node1", "{st}");
    assert_eq!(st["migrationConfiguration"]["disableTLS"], true, "{st}");
    let logs = c.agent_log("node2");
    assert!(
        logs.lines().any(|l| l.contains("Migrated to node1")),
        "node1 got the VM back"
    );
    let console = SerialConsole::connect(&src.join("serial.sock"), Duration::from_secs(10))?;
    let back = uptime_on(&console)?;
    assert!(back > after, "no reboot: uptime {after} s → {back} s");
    let (out, rc) = console.exec(
        "echo 3 > /proc/sys/vm/drop_caches; dd if=/dev/vda bs=1M skip=900 count=1 2>/dev/null | head -c 64",
        Duration::from_secs(30),
    )?;
    assert_eq!(rc, 0, "{out}");
    assert!(out.contains(MARKER), "the plain copy on node1: {out:?}");
    Ok(())
}

#[test]
fn a_vm_on_a_hand_made_node_local_disk_is_not_live_migratable_and_its_migration_fails_at_once()
-> anyhow::Result<()> {
    let c = two_nodes()?;
    claim(&c, "local-disk", false)?;
    c.apply(&vm("mig", "local-disk"))?;
    let (uid, node) = running(&c, "mig")?;
    let cond = c.wait_until("LiveMigratable=False", Duration::from_secs(20), || {
        let v = c.get_json(&["vmi", "mig"])?;
        Ok(v["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "LiveMigratable" && c["status"] == "False")
            .cloned())
    })?;
    assert_eq!(cond["reason"], "DisksNotLiveMigratable", "{cond}");
    // A hostPath PV of its own (not a `local` volume made by ferrovirt) cannot be copied.
    let message = cond["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("local-disk") && message.contains("cannot be block-migrated"),
        "{message}"
    );
    let t0 = Instant::now();
    c.apply(&migration("mig-local", "mig"))?;
    let m = finished(&c, "mig-local", Duration::from_secs(15))?;
    assert_eq!(m["status"]["phase"], "Failed");
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "fails fast: {:?}",
        t0.elapsed()
    );
    let msg = m["status"]["conditions"][0]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(msg.contains("DisksNotLiveMigratable"), "{msg}");
    // Nothing moved, nothing started elsewhere.
    let v = c.get_json(&["vmi", "mig"])?;
    assert_eq!(v["status"]["nodeName"], node.as_str());
    assert_eq!(v["metadata"]["uid"], uid.as_str());
    assert!(!node_dir(&c, other(&node)).join("vmis").join(&uid).exists());
    let events = c.kubectl_ok(&["get", "events", "-n", "default"])?;
    assert!(events.contains("FailedMigration"), "{events}");
    Ok(())
}

/// The pid in `dir`'s `launcher.pid`.
fn launcher_pid(dir: &std::path::Path) -> Option<u32> {
    std::fs::read_to_string(dir.join("launcher.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The socket inodes among `pid`'s open files.
fn socket_inodes(pid: u32) -> Vec<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect()
}

/// The established TCP sockets in `pid`'s network namespace: (local port, remote port, inode).
fn established(pid: u32) -> Vec<(u16, u16, u64)> {
    let port = |a: &str| u16::from_str_radix(a.rsplit(':').next()?, 16).ok();
    ["tcp", "tcp6"]
        .iter()
        .filter_map(|t| std::fs::read_to_string(format!("/proc/{pid}/net/{t}")).ok())
        .flat_map(|table| {
            table
                .lines()
                .skip(1)
                .filter_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    (f.get(3) == Some(&"01")).then_some(())?;
                    Some((port(f.get(1)?)?, port(f.get(2)?)?, f.get(9)?.parse().ok()?))
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The processes holding socket `inode`.
fn holders(inode: u64) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| socket_inodes(*p).contains(&inode))
        .collect()
}

/// The migration stream's connection (to the target's `port`, from the `st` of a running
/// migration) is held by the source QEMU and the target QEMU, and by no other process.
fn stream_held_by_the_qemus_only(src_qemu: u32, dst: &std::path::Path, st: &Value) {
    port_held_by_the_qemus_only(src_qemu, dst, st, 0)
}

/// [`stream_held_by_the_qemus_only`] for the target port marked `mark` in
/// `targetDirectMigrationNodePorts` (0: the stream; 49153: a block migration's NBD socket).
fn port_held_by_the_qemus_only(src_qemu: u32, dst: &std::path::Path, st: &Value, mark: i64) {
    let port: u16 = st["targetDirectMigrationNodePorts"]
        .as_object()
        .and_then(|m| m.iter().find(|(_, v)| **v == mark))
        .and_then(|(p, _)| p.parse().ok())
        .expect("the stream's port");
    let held = |pid: u32, want: &dyn Fn(&(u16, u16, u64)) -> bool| -> Option<u64> {
        let mine = socket_inodes(pid);
        established(pid)
            .into_iter()
            .find(|c| want(c) && mine.contains(&c.2))
            .map(|c| c.2)
    };
    let check = || -> Result<(), String> {
        let dst_qemu = qemu_in(dst).ok_or("no target QEMU")?;
        let out = held(src_qemu, &|c| c.1 == port).ok_or("the source QEMU holds no stream")?;
        let inn = held(dst_qemu, &|c| c.0 == port).ok_or("the target QEMU holds no stream")?;
        let (ho, hi) = (holders(out), holders(inn));
        if ho != vec![src_qemu] || hi != vec![dst_qemu] {
            return Err(format!(
                "the stream's ends are held by {ho:?} and {hi:?}, not only the QEMUs \
                 {src_qemu} and {dst_qemu}"
            ));
        }
        Ok(())
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match check() {
            Ok(()) => return,
            Err(e) if Instant::now() > deadline => panic!("{e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

#[test]
fn a_cancelled_migration_and_a_killed_target_leave_the_source_running() -> anyhow::Result<()> {
    let c = two_nodes()?;
    claim(&c, "mig-disk", true)?;
    // A policy for these VMIs caps the bandwidth: the migration takes long enough to interrupt.
    c.apply(
        r#"
apiVersion: migrations.kubevirt.io/v1alpha1
kind: MigrationPolicy
metadata: {name: slow}
spec:
  bandwidthPerMigration: 1Mi
  selectors:
    virtualMachineInstanceSelector: {speed: slow}
"#,
    )?;
    c.apply(&vm("mig", "mig-disk"))?;
    let (uid, node) = running(&c, "mig")?;
    let src = node_dir(&c, &node).join("vmis").join(&uid);
    let dst = node_dir(&c, other(&node)).join("vmis").join(&uid);
    c.wait_until("the guest ready", BOOT, || {
        let log = std::fs::read(src.join("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    let qemu = qemu_in(&src).expect("the source QEMU");
    // One console connection for the whole test (the source QEMU never changes).
    let console = SerialConsole::connect(&src.join("serial.sock"), Duration::from_secs(10))?;
    let mut up = uptime_on(&console)?;

    // Cancel mid-way with `ferrovirt migrate-cancel`.
    c.apply(&migration("mig-cancel", "mig"))?;
    let st = sending(&c, "mig-cancel")?;
    assert_eq!(st["migrationPolicyName"], "slow", "{st}");
    assert_eq!(
        st["migrationConfiguration"]["bandwidthPerMigration"], "1Mi",
        "{st}"
    );
    std::thread::sleep(Duration::from_secs(1));
    // QEMU to QEMU: the agents only set the stream up.
    stream_held_by_the_qemus_only(qemu, &dst, &st);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrovirt"))
        .args(["migrate-cancel", "mig", "--kubeconfig"])
        .arg(&c.kubeconfig)
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let st = c.wait_until("the migration aborted", MIGRATE, || {
        let st = c.get_json(&["vmi", "mig"])?["status"]["migrationState"].clone();
        Ok((st["failed"] == true).then_some(st))
    })?;
    assert_eq!(st["abortRequested"], true, "{st}");
    assert_eq!(st["abortStatus"], "Succeeded", "{st}");
    assert_ne!(st["completed"], true);
    up = still_on_source(&c, &node, qemu, &console, &src, &dst, up)?;

    // Kill the target's launcher and QEMU mid-way.
    c.apply(&migration("mig-kill", "mig"))?;
    sending(&c, "mig-kill")?;
    let target_qemu = qemu_in(&dst).expect("the target QEMU");
    let target_launcher = launcher_pid(&dst).expect("the target launcher");
    ferrovirt_testkit::cluster::signal(target_launcher, "KILL");
    ferrovirt_testkit::cluster::signal(target_qemu, "KILL");
    let m = finished(&c, "mig-kill", MIGRATE)?;
    assert_eq!(m["status"]["phase"], "Failed", "{}", m["status"]);
    let reason = m["status"]["migrationState"]["failureReason"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(!reason.is_empty(), "a reason: {}", m["status"]);
    eprintln!("killed target: {reason}");
    still_on_source(&c, &node, qemu, &console, &src, &dst, up)?;
    Ok(())
}

/// After an interrupted migration: the VMI on `node`, Running, the same QEMU, the target's
/// launcher directory gone, the guest's uptime past `before`; returns the new uptime.
fn still_on_source(
    c: &Cluster,
    node: &str,
    qemu: u32,
    console: &SerialConsole,
    src: &std::path::Path,
    dst: &std::path::Path,
    before: f64,
) -> anyhow::Result<f64> {
    let v = c.get_json(&["vmi", "mig"])?;
    assert_eq!(v["status"]["nodeName"], node);
    assert_eq!(qemu_in(src), Some(qemu), "the same source QEMU runs on");
    c.wait_until("the target cleaned up", Duration::from_secs(30), || {
        Ok((!dst.exists() && qemu_in(dst).is_none()).then_some(()))
    })?;
    c.wait_until("the VMI Running", Duration::from_secs(10), || {
        let v = c.get_json(&["vmi", "mig"])?;
        Ok((v["status"]["phase"] == "Running"
            && v["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True"))
        .then_some(()))
    })?;
    let after = uptime_on(console)?;
    assert!(after > before, "the guest ran on: {before} s → {after} s");
    Ok(after)
}

/// What [`Probe`] saw.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    source_running: usize,
    target_running: usize,
    /// Samples with the target's guest running and, read after it, the source's too.
    overlaps: usize,
}

/// Asks both launchers of a migrating VMI (target first, then source) every few ms whether
/// their QEMU runs the guest.
struct Probe {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Seen>,
}

impl Probe {
    fn start(src: PathBuf, dst: PathBuf) -> Probe {
        use ferrovirt_launcher::control::{LauncherClient, RunPhase};
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            let running = |dir: &PathBuf| {
                rt.block_on(async {
                    match LauncherClient::connect(dir, Duration::from_millis(500)).await {
                        Ok(mut c) => c.status().await.is_ok_and(|s| s.phase == RunPhase::Running),
                        Err(_) => false,
                    }
                })
            };
            let mut seen = Seen::default();
            while !flag.load(std::sync::atomic::Ordering::SeqCst) {
                let target = running(&dst);
                let source = running(&src);
                seen.target_running += usize::from(target);
                seen.source_running += usize::from(source);
                seen.overlaps += usize::from(target && source);
                std::thread::sleep(Duration::from_millis(5));
            }
            seen
        });
        Probe { stop, thread }
    }

    fn stop(self) -> Seen {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.thread.join().expect("probe thread")
    }
}

/// A launcher killed on its own (SIGKILL, no exit report) must not leave its QEMU running
/// unsupervised and unfenced on the VM's disks: the agent kills it when it sees the launcher
/// gone, before anything else starts for the VM.
#[test]
fn a_killed_launcher_does_not_leave_its_qemu_running() -> anyhow::Result<()> {
    TestGuest::get()?;
    let c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    claim(&c, "orphan-disk", true)?;
    c.apply(&vm("mig", "orphan-disk"))?;
    let (uid, node) = running(&c, "mig")?;
    let dir = node_dir(&c, &node).join("vmis").join(&uid);
    let qemu = c.wait_until("the QEMU", Duration::from_secs(20), || Ok(qemu_in(&dir)))?;
    let launcher = launcher_pid(&dir).expect("the launcher");
    ferrovirt_testkit::cluster::signal(launcher, "KILL");
    c.wait_until("the orphaned QEMU killed", Duration::from_secs(60), || {
        Ok((!std::path::Path::new(&format!("/proc/{qemu}")).exists()
            || qemu_in(&dir) != Some(qemu))
        .then_some(()))
    })?;
    Ok(())
}

/// A migration in flight ([`throttled_migration_in_flight`]): the VMI uid, the source and
/// target VMI dirs, the guest's uptime before it, the source QEMU.
struct InFlight {
    uid: String,
    src: PathBuf,
    dst: PathBuf,
    before: f64,
    qemu: u32,
}

/// A throttled migration (the 4 MiB/s policy `slow`) `mig-restart` of VM `mig` from `from` to
/// the other node, in flight: the VM started on `from`, its guest ready, the stream held by
/// the two QEMUs alone.
fn throttled_migration_in_flight(c: &Cluster, from: &str) -> anyhow::Result<InFlight> {
    let to = other(from);
    claim(c, "mig-disk", true)?;
    c.kubectl_ok(&["cordon", to])?;
    c.apply(&vm("mig", "mig-disk"))?;
    let (uid, node) = running(c, "mig")?;
    assert_eq!(node, from);
    c.kubectl_ok(&["uncordon", to])?;
    let src = node_dir(c, from).join("vmis").join(&uid);
    let dst = node_dir(c, to).join("vmis").join(&uid);
    c.wait_until("the guest ready", BOOT, || {
        let log = std::fs::read(src.join("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    let before = uptime(&src)?;
    slow_policy(c)?;
    c.apply(&migration("mig-restart", "mig"))?;
    let st = sending(c, "mig-restart")?;
    assert_eq!(st["migrationPolicyName"], "slow", "{st}");
    // QEMU sends (Running is written before the stream's setup): the connection is the QEMUs'.
    let qemu = qemu_in(&src).expect("the source QEMU");
    stream_held_by_the_qemus_only(qemu, &dst, &st);
    Ok(InFlight {
        uid,
        src,
        dst,
        before,
        qemu,
    })
}

/// The source agent (a process of its own, node2) is killed mid-way through a slowed
/// migration and started again: the stream is QEMU's own and goes on; the restarted agent
/// asks its launcher's QEMU (`query-migrate`), follows it again and switches over. The
/// migration ends Succeeded, the VMI names node1, the guest kept its uptime, one QEMU runs.
#[test]
fn a_source_agent_restarted_mid_migration_picks_it_up_and_switches_over() -> anyhow::Result<()> {
    let mut c = two_nodes()?;
    // The VM starts on node2 (node1, the embedded agent, cannot be restarted alone).
    let InFlight {
        uid,
        src,
        before,
        qemu,
        ..
    } = throttled_migration_in_flight(&c, "node2")?;
    std::thread::sleep(Duration::from_secs(1));
    // The agent alone: its launchers and QEMUs are processes of their own.
    let pid = c.agent_pid("node2").expect("the node2 agent");
    ferrovirt_testkit::cluster::signal(pid, "KILL");
    let killed = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        qemu_in(&src),
        Some(qemu),
        "the source QEMU survives its agent"
    );
    let m = c.get_json(&["vmim", "mig-restart"])?;
    assert_eq!(m["status"]["phase"], "Running", "{}", m["status"]);
    c.start_agent("node2")?;
    let m = finished(&c, "mig-restart", Duration::from_secs(240))?;
    eprintln!(
        "agent restart to Succeeded: {:?}; {}",
        killed.elapsed(),
        m["status"]["migrationState"]
    );
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    check_moved(&c, &uid, "node2", "node1", before)?;
    // check_moved: no QEMU left on node2 (the one that sent, `qemu`), one on node1.
    assert!(qemu_in(&src).is_none(), "the source QEMU {qemu} is gone");
    let log = c.agent_log("node2");
    assert!(
        log.contains("resuming a migration after a restart"),
        "the restarted agent picked the migration up:\n{log}"
    );
    let events = c.kubectl(&["get", "events", "-o", "json"])?;
    assert!(
        String::from_utf8_lossy(&events.stdout).contains("MigrationResumed"),
        "a MigrationResumed Event"
    );
    Ok(())
}

/// The target agent (node2) is killed mid-way and started again: the target QEMU receives on,
/// the source switches over, and the restarted agent keeps the launcher (no orphan: its watch
/// of incoming migrations lists before anything is collected) and reports the VMI Running.
/// Before the kill, the source's progress series are scraped through the Node proxy; after
/// it, the server's migration series.
#[test]
fn a_target_agent_restarted_mid_migration_keeps_the_incoming_vm() -> anyhow::Result<()> {
    let mut c = two_nodes()?;
    let InFlight {
        uid, dst, before, ..
    } = throttled_migration_in_flight(&c, "node1")?;
    let target_qemu = qemu_in(&dst).expect("the target QEMU");
    // The source agent's progress series, read as Prometheus does (through the Node proxy).
    let scraped = Instant::now();
    let (processed, remaining) = c.wait_until("migration progress series", MIGRATE, || {
        let text = c.kubectl_ok(&["get", "--raw", "/api/v1/nodes/node1/proxy/metrics"])?;
        let processed = sample(&text, "kubevirt_vmi_migration_data_processed_bytes", "mig");
        let remaining = sample(&text, "kubevirt_vmi_migration_data_remaining_bytes", "mig");
        Ok(match (processed, remaining) {
            (Some(p), Some(r)) if p > 0.0 => Some((p, r)),
            _ => None,
        })
    })?;
    eprintln!(
        "progress series after {:?}: processed {processed}, remaining {remaining}",
        scraped.elapsed()
    );
    assert!(remaining > 0.0, "mid-way, memory is left to send");
    let pid = c.agent_pid("node2").expect("the node2 agent");
    ferrovirt_testkit::cluster::signal(pid, "KILL");
    std::thread::sleep(Duration::from_secs(2));
    c.start_agent("node2")?;
    let m = finished(&c, "mig-restart", Duration::from_secs(240))?;
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    // The server's control-plane series: this migration succeeded, none is running.
    let text = c.kubectl_ok(&["get", "--raw", "/metrics"])?;
    let succeeded = text.lines().any(|l| {
        l.starts_with("kubevirt_vmi_migration_succeeded{")
            && l.contains(r#"vmim="mig-restart""#)
            && l.ends_with(" 1")
    });
    assert!(
        succeeded,
        "kubevirt_vmi_migration_succeeded for mig-restart:\n{text}"
    );
    assert_eq!(
        sample(&text, "kubevirt_vmi_migrations_in_running_phase", ""),
        Some(0.0),
        "{text}"
    );
    // Its way to Succeeded is in the phase transition histogram.
    let to_succeeded = text.lines().find(|l| {
        l.starts_with("kubevirt_vmi_migration_phase_transition_time_from_creation_seconds_count{")
            && l.contains(r#"phase="Succeeded""#)
    });
    let count: f64 = to_succeeded
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0);
    assert!(count >= 1.0, "{text}");
    // When it ended: the time it entered Succeeded, within this test's run.
    let ended: f64 = text
        .lines()
        .find(|l| {
            l.starts_with("kubevirt_vmi_migration_end_time_seconds{")
                && l.contains(r#"vmim="mig-restart""#)
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs_f64();
    assert!(
        ended > now - 300.0 && ended <= now + 1.0,
        "{ended} vs {now}:\n{text}"
    );
    // The sender is gone: node1 exports no progress series for the VMI any more.
    let node1 = c.kubectl_ok(&["get", "--raw", "/api/v1/nodes/node1/proxy/metrics"])?;
    assert!(
        !node1.contains("kubevirt_vmi_migration_data_processed_bytes"),
        "{node1}"
    );
    check_moved(&c, &uid, "node1", "node2", before)?;
    assert_eq!(
        qemu_in(&dst),
        Some(target_qemu),
        "the QEMU that received the VM runs it"
    );
    Ok(())
}

/// The target agent (node2) of a block migration is killed mid-way (the disks mirrored, the
/// memory throttled to 4 MiB/s) and started again: the NBD connections and the stream are
/// the QEMUs' own and go on, the source switches over, and the restarted agent takes the
/// copies over (`migresume::target_finish_pending`): the PV names node2 and its path, the
/// copy is unmarked, the source copy deleted, the guest kept its uptime.
#[test]
fn a_target_agent_restarted_mid_block_migration_takes_the_copies_over() -> anyhow::Result<()> {
    let mut c = two_nodes()?;
    let src_vol = local_claim(&c, "local-disk", "node1")?;
    c.apply(&vm("mig", "local-disk"))?;
    let (uid, node) = running(&c, "mig")?;
    assert_eq!(node, "node1", "the VM runs where its volume is");
    let src = node_dir(&c, "node1").join("vmis").join(&uid);
    let dst = node_dir(&c, "node2").join("vmis").join(&uid);
    c.wait_until("the guest ready", BOOT, || {
        let log = std::fs::read(src.join("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    let before = uptime(&src)?;
    slow_policy(&c)?;
    c.apply(&migration("mig-local", "mig"))?;
    let st = sending(&c, "mig-local")?;
    // The mirrors in sync, the memory flowing (node1's agent is the server's own); the
    // disk's NBD connection and the stream are held by the two QEMUs and nobody else.
    c.wait_until("the disk mirrors in sync", MIGRATE, || {
        let m = c.get_json(&["vmim", "mig-local"])?;
        anyhow::ensure!(m["status"]["phase"] == "Running", "{}", m["status"]);
        Ok(c.server_log()
            .contains("disk mirrors in sync")
            .then_some(()))
    })?;
    // The source's disk copy rate: the mirrors keep running until the switch-over, and two
    // scrapes within 2 s give the launcher a rate to report.
    let rate = c.wait_until(
        "the disk transfer rate series",
        Duration::from_secs(20),
        || {
            let text = c.kubectl_ok(&["get", "--raw", "/api/v1/nodes/node1/proxy/metrics"])?;
            std::thread::sleep(Duration::from_millis(150));
            Ok(sample(
                &text,
                "kubevirt_vmi_migration_disk_transfer_rate_bytes",
                "mig",
            ))
        },
    )?;
    assert!(rate >= 0.0, "{rate}");
    let src_qemu = qemu_in(&src).expect("the source QEMU");
    port_held_by_the_qemus_only(src_qemu, &dst, &st, 49153);
    stream_held_by_the_qemus_only(src_qemu, &dst, &st);
    // The stream's setup ends with the target's answer after `migrate-incoming`.
    std::thread::sleep(Duration::from_secs(1));
    let target_qemu = qemu_in(&dst).expect("the target QEMU");
    let pid = c.agent_pid("node2").expect("the node2 agent");
    ferrovirt_testkit::cluster::signal(pid, "KILL");
    std::thread::sleep(Duration::from_secs(2));
    c.start_agent("node2")?;
    let m = finished(&c, "mig-local", Duration::from_secs(240))?;
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    let v = c.get_json(&["vmi", "mig"])?;
    assert_eq!(v["status"]["migrationMethod"], "BlockMigration");
    assert_eq!(v["status"]["nodeName"], "node2");
    assert_eq!(v["metadata"]["uid"], uid.as_str());
    assert_eq!(
        qemu_in(&dst),
        Some(target_qemu),
        "the QEMU that received the VM runs it"
    );
    let dst_vol = node_dir(&c, "node2").join("volumes").join("pv-local-disk");
    let pv = c.wait_until("the PV on node2", Duration::from_secs(60), || {
        let pv = c.get_json(&["pv", "pv-local-disk"])?;
        Ok((pv["spec"]["local"]["path"] == dst_vol.display().to_string()).then_some(pv))
    })?;
    assert_eq!(
        pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
            [0],
        "node2"
    );
    assert!(
        !dst_vol.join(".ferrovirt-migrating-in").exists(),
        "unmarked"
    );
    c.wait_until("node1's copy deleted", Duration::from_secs(60), || {
        Ok((!src_vol.exists()).then_some(()))
    })?;
    c.wait_until("the source QEMU gone", Duration::from_secs(20), || {
        Ok(qemu_in(&src).is_none().then_some(()))
    })?;
    let after = uptime(&dst)?;
    assert!(after > before, "no reboot: uptime {before} s → {after} s");
    let log = c.agent_log("node2");
    assert!(
        log.contains("taking over the block migration's copies"),
        "the restarted agent took the copies over:\n{log}"
    );
    Ok(())
}

/// The value of series `name` whose `name` label is `vmi` (any series of that name when `vmi`
/// is empty) in a Prometheus text scrape.
fn sample(text: &str, name: &str, vmi: &str) -> Option<f64> {
    let label = format!(r#"name="{vmi}""#);
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .find(|l| vmi.is_empty() || l.contains(&label))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}
