//! A block migration survives a restart of its *source* agent (docs/migration.md "Agent
//! restarts"). The VM's disk is a node-local (`local` class) claim on node2, an agent process
//! of its own (node1 is the server's embedded agent, which cannot be restarted alone). A
//! migration to node1, slowed by a MigrationPolicy, copies the disk (QEMU's NBD mirrors, QEMU
//! to QEMU), then sends the memory; node2's agent is killed with SIGKILL while the memory
//! flows and started again. The mirrors' connections and the stream are QEMU's own, so the
//! restarted agent follows the migration again: it completes the mirrors at the switch-over,
//! the VMI names node1, the PV follows, node2's copy is deleted and the guest kept running
//! (its uptime grew, no reboot). The target-restart case is in `migration.rs`.

use std::time::{Duration, Instant};

mod migkit;
use migkit::*;

#[test]
fn a_source_agent_restarted_mid_block_migration_follows_it_to_the_end() -> anyhow::Result<()> {
    let mut c = two_nodes()?;
    let src_vol = local_claim(&c, "local-disk", "node2")?;
    c.apply(&vm("mig", "local-disk"))?;
    let (uid, node) = running(&c, "mig")?;
    assert_eq!(node, "node2", "the VM runs where its volume is");
    let src = node_dir(&c, "node2").join("vmis").join(&uid);
    let dst = node_dir(&c, "node1").join("vmis").join(&uid);
    guest_ready(&c, &src)?;
    let before = uptime(&src)?;
    slow_policy(&c)?;
    c.apply(&migration("mig-local", "mig"))?;
    sending(&c, "mig-local")?;
    // The mirrors in sync: the memory flows (4 MiB/s) from here on.
    c.wait_until("the disk mirrors in sync", MIGRATE, || {
        let m = c.get_json(&["vmim", "mig-local"])?;
        anyhow::ensure!(m["status"]["phase"] == "Running", "{}", m["status"]);
        Ok(c.agent_log("node2")
            .contains("disk mirrors in sync")
            .then_some(()))
    })?;
    std::thread::sleep(Duration::from_secs(1));
    let src_qemu = qemu_in(&src).expect("the source QEMU");
    let pid = c.agent_pid("node2").expect("the node2 agent");
    ferrovirt_testkit::cluster::signal(pid, "KILL");
    let killed = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        qemu_in(&src),
        Some(src_qemu),
        "the source QEMU survives its agent"
    );
    let m = c.get_json(&["vmim", "mig-local"])?;
    assert_eq!(m["status"]["phase"], "Running", "{}", m["status"]);
    c.start_agent("node2")?;
    let m = finished(&c, "mig-local", Duration::from_secs(240))?;
    eprintln!(
        "agent restart to Succeeded: {:?}; {}",
        killed.elapsed(),
        m["status"]["migrationState"]
    );
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    let v = c.get_json(&["vmi", "mig"])?;
    assert_eq!(v["status"]["migrationMethod"], "BlockMigration");
    assert_eq!(v["status"]["nodeName"], "node1");
    assert_eq!(v["metadata"]["uid"], uid.as_str());
    let dst_vol = node_dir(&c, "node1").join("volumes").join("pv-local-disk");
    c.wait_until("the PV on node1", Duration::from_secs(60), || {
        let pv = c.get_json(&["pv", "pv-local-disk"])?;
        Ok((pv["spec"]["local"]["path"] == dst_vol.display().to_string()).then_some(()))
    })?;
    c.wait_until("node2's copy deleted", Duration::from_secs(60), || {
        Ok((!src_vol.exists()).then_some(()))
    })?;
    c.wait_until("the source QEMU gone", Duration::from_secs(20), || {
        Ok(qemu_in(&src).is_none().then_some(()))
    })?;
    let after = uptime(&dst)?;
    assert!(after > before, "no reboot: uptime {before} s → {after} s");
    let log = c.agent_log("node2");
    assert!(
        log.contains("resuming a migration after a restart"),
        "the restarted agent picked the migration up:\n{log}"
    );
    assert!(
        !log.contains("disk mirrors are cancelled"),
        "the mirrors were not cancelled:\n{log}"
    );
    Ok(())
}
