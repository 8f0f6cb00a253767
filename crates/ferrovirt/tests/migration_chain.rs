//! A block migration carries a node-local volume's snapshot chain (docs/migration.md
//! "Node-local disks with snapshots"). The VM's disk is a `local` claim on node2; the guest
//! writes marker A, an online VirtualMachineSnapshot freezes the volume's top (a layer chain:
//! `disk.img` frozen, `layer-000001.qcow2` the new top), the guest writes marker B, and the VM
//! migrates to node1: the source agent sends the frozen layer over the agents' authenticated
//! channel before the target's QEMU starts, the target checks size and SHA-256 and rebuilds
//! the chain, QEMU mirrors only the top. The migration succeeds, the guest keeps running
//! (uptime grew) and reads A and B on node1, whose volume directory holds the same chain
//! (byte-identical frozen layer, the same `chain.json`); node2's copy is gone. Then the VM is
//! stopped and restored from the snapshot, which works on node1 now: it boots reading A and
//! not B. The time the layer copy took is printed. Last, a VirtualMachineSnapshot asked while
//! a (slowed) migration back to node2 carries the chain is refused, says why, and is taken on
//! node2 once the migration succeeded.

use std::time::{Duration, Instant};

use ferrovirt_testkit::console::SerialConsole;

mod migkit;
use migkit::*;

const STEP: Duration = Duration::from_secs(120);
/// Sectors of the guest's disk past its filesystem (the disk is grown to 1 GiB).
const SECTOR_A: u32 = 1_900_000;
const SECTOR_B: u32 = 1_900_100;
const A: &str = "MARKER-A-BEFORE-SNAPSHOT";
const B: &str = "MARKER-B-AFTER-SNAPSHOT";

fn console_of(dir: &std::path::Path) -> anyhow::Result<SerialConsole> {
    SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))
}

fn sha256(path: &std::path::Path) -> String {
    let out = std::process::Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn a_block_migration_carries_the_snapshot_chain_and_the_snapshot_restores_on_the_target()
-> anyhow::Result<()> {
    let c = two_nodes()?;
    let src_vol = local_claim(&c, "local-disk", "node2")?;
    c.apply(&vm("mig", "local-disk"))?;
    let (uid, node) = running(&c, "mig")?;
    assert_eq!(node, "node2", "the VM runs where its volume is");
    let src = node_dir(&c, "node2").join("vmis").join(&uid);
    let dst = node_dir(&c, "node1").join("vmis").join(&uid);
    guest_ready(&c, &src)?;
    let console = console_of(&src)?;
    console.write_marker("/dev/vda", A, SECTOR_A)?;

    // An online snapshot: the volume becomes a chain.
    c.apply(
        r#"
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineSnapshot
metadata: {name: before-b, namespace: default}
spec:
  source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: mig}
"#,
    )?;
    let snap = c.wait_done("vmsnapshot", "before-b", "readyToUse", STEP)?;
    assert_eq!(snap["status"]["phase"], "Succeeded", "{snap}");
    let chain_src = std::fs::read_to_string(src_vol.join("chain.json"))?;
    assert!(chain_src.contains("layer-000001.qcow2"), "{chain_src}");
    let frozen_sum = sha256(&src_vol.join("disk.img"));
    console.write_marker("/dev/vda", B, SECTOR_B)?;
    assert_eq!(console.read_marker("/dev/vda", SECTOR_A, A.len())?, A);
    // One console connection per guest: the serial socket serves one client at a time.
    let before = uptime_on(&console)?;
    drop(console);

    // Still live-migratable: the chain is carried.
    let v = c.get_json(&["vmi", "mig"])?;
    let cond = v["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "LiveMigratable")
        .cloned()
        .unwrap_or_default();
    assert_eq!(cond["status"], "True", "{cond}");

    let t = Instant::now();
    c.apply(&migration("mig-chain", "mig"))?;
    let m = finished(&c, "mig-chain", Duration::from_secs(300))?;
    let took = t.elapsed();
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    let v = c.get_json(&["vmi", "mig"])?;
    assert_eq!(v["status"]["migrationMethod"], "BlockMigration");
    assert_eq!(v["status"]["nodeName"], "node1");
    assert_eq!(v["metadata"]["uid"], uid.as_str());

    // The figures: the layer copy (the target's event) and the whole migration.
    let events = c.get_json(&["events", "-n", "default"])?;
    let msg = |reason: &str| {
        events["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["reason"] == reason)
            .filter_map(|e| e["message"].as_str().map(String::from))
            .next_back()
            .unwrap_or_default()
    };
    let carried = msg("SnapshotChainsCarried");
    assert!(carried.contains("1 snapshot layer(s)"), "{carried}");
    let sent = c
        .agent_log("node2")
        .lines()
        .rfind(|l| l.contains("snapshot chains of"))
        .unwrap_or_default()
        .to_string();
    eprintln!(
        "FIGURES migration to Succeeded in {took:?}; target: {carried}; source: {sent}; {}",
        msg("Migrated")
    );

    // The target holds the same chain: the frozen layer byte-identical, the same record.
    let dst_vol = node_dir(&c, "node1").join("volumes").join("pv-local-disk");
    c.wait_until("the PV on node1", Duration::from_secs(60), || {
        let pv = c.get_json(&["pv", "pv-local-disk"])?;
        Ok((pv["spec"]["local"]["path"] == dst_vol.display().to_string()).then_some(()))
    })?;
    assert_eq!(
        std::fs::read_to_string(dst_vol.join("chain.json"))?,
        chain_src
    );
    assert_eq!(sha256(&dst_vol.join("disk.img")), frozen_sum);
    assert!(dst_vol.join("layer-000001.qcow2").exists());
    c.wait_until("node2's copy deleted", Duration::from_secs(60), || {
        Ok((!src_vol.exists()).then_some(()))
    })?;
    c.wait_until("the source QEMU gone", Duration::from_secs(20), || {
        Ok(qemu_in(&src).is_none().then_some(()))
    })?;
    let console = console_of(&dst)?;
    let after = uptime_on(&console)?;
    assert!(after > before, "no reboot: uptime {before} s → {after} s");
    assert_eq!(console.read_marker("/dev/vda", SECTOR_A, A.len())?, A);
    assert_eq!(console.read_marker("/dev/vda", SECTOR_B, B.len())?, B);
    drop(console);

    // The snapshot restores on node1, where its layer is now.
    c.halt_vm("mig", STEP)?;
    c.apply(
        r#"
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineRestore
metadata: {name: restore-after-move, namespace: default}
spec:
  target: {apiGroup: kubevirt.io, kind: VirtualMachine, name: mig}
  virtualMachineSnapshotName: before-b
"#,
    )?;
    c.wait_done("vmrestore", "restore-after-move", "complete", STEP)?;
    c.set_run_strategy("mig", "Always")?;
    let (uid2, node2) = running(&c, "mig")?;
    assert_ne!(uid2, uid);
    assert_eq!(node2, "node1", "the VM starts where its volume is now");
    let dir2 = node_dir(&c, "node1").join("vmis").join(&uid2);
    guest_ready(&c, &dir2)?;
    let console = console_of(&dir2)?;
    assert_eq!(console.read_marker("/dev/vda", SECTOR_A, A.len())?, A);
    let b = console.read_marker("/dev/vda", SECTOR_B, B.len())?;
    assert!(b.is_empty(), "marker B survived the restore: {b:?}");
    drop(console);

    // A snapshot asked while a migration carries the chain is refused (409 from the agent,
    // the VirtualMachineSnapshot says why and retries) and taken once the VM runs on the
    // other node; the migration is not disturbed.
    slow_policy(&c)?;
    c.apply(&migration("mig-back", "mig"))?;
    sending(&c, "mig-back")?;
    c.apply(
        r#"
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineSnapshot
metadata: {name: during, namespace: default}
spec:
  source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: mig}
"#,
    )?;
    let refused = c.wait_until("the snapshot refused while carried", STEP, || {
        let s = c.get_json(&["vmsnapshot", "during", "-n", "default"])?;
        let m = s["status"]["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        Ok(m.contains("being migrated").then_some(m))
    })?;
    eprintln!("refused during the migration: {refused}");
    let m = finished(&c, "mig-back", Duration::from_secs(300))?;
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    let snap = c.wait_done("vmsnapshot", "during", "readyToUse", STEP)?;
    assert_eq!(snap["status"]["phase"], "Succeeded", "{snap}");
    let v = c.get_json(&["vmi", "mig"])?;
    assert_eq!(v["status"]["nodeName"], "node2");
    // The VM's claim (the restore gave it a new one, restored on node1) is on node2 now,
    // with the layer that snapshot froze.
    let vm = c.get_json(&["vm", "mig", "-n", "default"])?;
    let vol = &vm["spec"]["template"]["spec"]["volumes"][0];
    let claim = vol["persistentVolumeClaim"]["claimName"]
        .as_str()
        .or(vol["dataVolume"]["name"].as_str())
        .unwrap_or_default()
        .to_string();
    let pv = c.get_json(&["pvc", &claim, "-n", "default"])?["spec"]["volumeName"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let node2_dir = node_dir(&c, "node2");
    let path = c.wait_until("the PV on node2", Duration::from_secs(60), || {
        let p = c.get_json(&["pv", &pv])?["spec"]["local"]["path"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        Ok(std::path::Path::new(&p)
            .starts_with(&node2_dir)
            .then_some(p))
    })?;
    eprintln!("the claim's volume after the second migration: PV {pv} at {path}");
    let chain = std::fs::read_to_string(std::path::Path::new(&path).join("chain.json"))?;
    let layers = serde_json::from_str::<serde_json::Value>(&chain)?["layers"]
        .as_array()
        .map_or(0, Vec::len);
    assert!(
        layers >= 2,
        "the snapshot taken on node2 froze a layer: {chain}"
    );
    Ok(())
}
