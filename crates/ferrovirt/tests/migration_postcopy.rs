//! Post-copy live migration end to end (docs/migration.md "Post-copy"). Two nodes as in
//! `migration.rs`; a MigrationPolicy for the VM throttles the stream to 1 MiB/s, gives it a
//! completion timeout of a few seconds (`completionTimeoutPerGiB`) and allows post-copy. On a
//! node whose QEMUs may not use userfaultfd (`vm.unprivileged_userfaultfd=0`, the default
//! here) the migration fails with a reason naming `allowPostCopy` and the sysctl, and the
//! source runs on. With the sysctl at 1 (as OpenShift sets it; the test sets it for its
//! duration and restores it), pre-copy cannot finish in time, the source switches to
//! post-copy instead of cancelling: the migration ends Succeeded, `migrationState.mode` is
//! `PostCopy` (with a `MigrationPostCopy` Event), the VMI names the target, the guest's uptime
//! kept growing and one QEMU runs it.

use std::time::{Duration, Instant};

use ferrovirt_testkit::console::SerialConsole;

mod migkit;
use migkit::*;

const SYSCTL: &str = "/proc/sys/vm/unprivileged_userfaultfd";

/// Sets the userfaultfd sysctl for the test and puts the old value back when dropped.
struct Userfaultfd(String);

impl Userfaultfd {
    fn set(value: &str) -> anyhow::Result<Self> {
        let old = std::fs::read_to_string(SYSCTL)?.trim().to_string();
        std::fs::write(SYSCTL, value)?;
        Ok(Self(old))
    }
}

impl Drop for Userfaultfd {
    fn drop(&mut self) {
        let _ = std::fs::write(SYSCTL, &self.0);
    }
}

#[test]
fn a_migration_past_its_completion_timeout_switches_to_post_copy_and_succeeds() -> anyhow::Result<()>
{
    let c = two_nodes()?;
    claim(&c, "mig-disk", true)?;
    c.apply(
        r#"
apiVersion: migrations.kubevirt.io/v1alpha1
kind: MigrationPolicy
metadata: {name: postcopy}
spec:
  allowPostCopy: true
  bandwidthPerMigration: 1Mi
  completionTimeoutPerGiB: 4
  selectors:
    virtualMachineInstanceSelector: {speed: slow}
"#,
    )?;
    c.apply(&vm("mig", "mig-disk"))?;
    let (uid, node) = running(&c, "mig")?;
    let to = other(&node);
    let src = node_dir(&c, &node).join("vmis").join(&uid);
    let dst = node_dir(&c, to).join("vmis").join(&uid);
    c.wait_until("the guest ready", BOOT, || {
        let log = std::fs::read(src.join("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    let qemu = qemu_in(&src).expect("the source QEMU");
    let console = SerialConsole::connect(&src.join("serial.sock"), Duration::from_secs(10))?;

    // Without userfaultfd for the target's unprivileged QEMU: refused naming the field and
    // the node setting, the source runs on.
    {
        let _off = Userfaultfd::set("0")?;
        c.apply(&migration("mig-no-uffd", "mig"))?;
        let m = finished(&c, "mig-no-uffd", MIGRATE)?;
        assert_eq!(m["status"]["phase"], "Failed", "{}", m["status"]);
        let reason = m["status"]["migrationState"]["failureReason"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        eprintln!("without userfaultfd: {reason}");
        assert!(
            reason.contains("allowPostCopy") && reason.contains("vm.unprivileged_userfaultfd"),
            "{reason}"
        );
        let v = c.get_json(&["vmi", "mig"])?;
        assert_eq!(v["status"]["nodeName"], node.as_str());
        c.wait_until("the target abandoned", Duration::from_secs(30), || {
            Ok((!dst.exists()).then_some(()))
        })?;
        assert_eq!(qemu_in(&src), Some(qemu), "the source QEMU runs on");
    }

    let _on = Userfaultfd::set("1")?;
    let before = uptime_on(&console)?;
    drop(console);
    let started = Instant::now();
    c.apply(&migration("mig-pc", "mig"))?;
    let st = sending(&c, "mig-pc")?;
    assert_eq!(st["migrationPolicyName"], "postcopy", "{st}");
    assert_eq!(st["migrationConfiguration"]["allowPostCopy"], true, "{st}");
    let m = finished(&c, "mig-pc", Duration::from_secs(180))?;
    let took = started.elapsed();
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    let v = c.get_json(&["vmi", "mig"])?;
    let st = &v["status"]["migrationState"];
    eprintln!("post-copy migration: VMIM create → Succeeded {took:?}; {st}");
    assert_eq!(st["mode"], "PostCopy", "{st}");
    assert_eq!(
        m["status"]["migrationState"]["mode"], "PostCopy",
        "the VMIM too: {}",
        m["status"]
    );
    // 1 MiB/s for a 128 MiB guest: pre-copy alone would need far longer than this.
    assert!(
        took < Duration::from_secs(60),
        "switched, not waited out: {took:?}"
    );
    let after = check_moved(&c, &uid, &node, to, before)?;
    eprintln!("uptime {before:.1} s → {after:.1} s");
    assert!(qemu_in(&src).is_none(), "one QEMU: the source's is gone");
    let events = c.kubectl(&["get", "events", "-o", "json"])?;
    let events = String::from_utf8_lossy(&events.stdout);
    assert!(
        events.contains("MigrationPostCopy"),
        "a MigrationPostCopy Event"
    );
    Ok(())
}
