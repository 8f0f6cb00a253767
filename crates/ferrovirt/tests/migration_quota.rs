//! ResourceQuota for live migrations (issue #19, "Tenancy"; docs/access-control.md
//! "ResourceQuota", docs/migration.md) through the real server, its controllers, two agents, the
//! test guest under TCG and the real kubectl: a namespace quota allowing one VM's memory plus a
//! bit holds the VM; its migration (whose target would hold the VM's requests a second time)
//! stays Pending with KubeVirt's `migrationRejectedByResourceQuota` condition (True, Kubernetes'
//! `exceeded quota:` message) and the VM does not move; once the quota is raised the controller's
//! next try proceeds, the condition goes, the migration Succeeds, the guest keeps running (its
//! uptime goes on) on the other node, and the target's charge is given back.

mod migkit;

use std::time::{Duration, Instant};

use migkit::*;
use serde_json::Value;

fn quota_condition(m: &Value) -> Option<Value> {
    m["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "migrationRejectedByResourceQuota")
        .cloned()
}

#[test]
fn a_migration_waits_for_quota_then_proceeds() -> anyhow::Result<()> {
    let c = two_nodes()?;
    claim(&c, "mig-disk", true)?;
    // One 128Mi VM and a bit: the target's second 128Mi does not fit.
    c.kubectl_ok(&["create", "quota", "q", "--hard=requests.memory=200Mi"])?;
    c.apply(&vm("mig", "mig-disk"))?;
    let (uid, first) = running(&c, "mig")?;
    let first = first.as_str();
    let src_dir = node_dir(&c, first).join("vmis").join(&uid);
    guest_ready(&c, &src_dir)?;
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

    c.apply(&migration("mig-1", "mig"))?;
    let t0 = Instant::now();
    let cond = c.wait_until("the quota condition", Duration::from_secs(30), || {
        let m = c.get_json(&["vmim", "mig-1"])?;
        Ok(quota_condition(&m))
    })?;
    eprintln!("quota condition after {:?}: {cond}", t0.elapsed());
    assert_eq!(cond["status"], "True");
    assert_eq!(cond["reason"], "ExceededQuota");
    let msg = cond["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains(
            "exceeded quota: q, requested: requests.memory=128Mi, used: requests.memory=128Mi, limited: requests.memory=200Mi"
        ),
        "{msg}"
    );
    // It stays Pending (tried again every second) and the VM does not move.
    std::thread::sleep(Duration::from_secs(3));
    let m = c.get_json(&["vmim", "mig-1"])?;
    assert_eq!(m["status"]["phase"], "Pending", "{}", m["status"]);
    let v = c.get_json(&["vmi", "mig"])?;
    assert_eq!(v["status"]["nodeName"], first);
    assert!(v["status"]["migrationState"].is_null(), "{}", v["status"]);
    let q = c.get_json(&["quota", "q"])?;
    assert_eq!(
        q["status"]["used"]["requests.memory"], "128Mi",
        "{}",
        q["status"]
    );

    // Room for the target: the migration proceeds and the condition goes.
    c.kubectl_ok(&[
        "patch",
        "quota",
        "q",
        "--type=merge",
        "-p",
        r#"{"spec":{"hard":{"requests.memory":"300Mi"}}}"#,
    ])?;
    let t1 = Instant::now();
    let m = finished(&c, "mig-1", MIGRATE)?;
    eprintln!("migrated {:?} after the quota was raised", t1.elapsed());
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    assert!(quota_condition(&m).is_none(), "{}", m["status"]);
    let second = other(first);
    check_moved(&c, &uid, first, second, before)?;
    // The target's charge is given back: one VM's memory again.
    c.wait_until(
        "the target's charge given back",
        Duration::from_secs(15),
        || {
            let q = c.get_json(&["quota", "q"])?;
            Ok((q["status"]["used"]["requests.memory"] == "128Mi").then_some(()))
        },
    )?;
    Ok(())
}
