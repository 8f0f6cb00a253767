//! A backup's `Group` freeze end to end (docs/backup.md "Consistency"), against the real
//! binary, kubectl and two TCG guests running QEMU's guest agent, to a filesystem target.
//!
//! The guests' fsfreeze hook prints `FERROVIRT-FSFREEZE freeze|thaw <unix time>` with each
//! guest's clock; the test measures each guest's clock offset against the host over the serial
//! console, so the windows compare on one time line.
//!
//! 1. The VMI `freeze` subresource (`kubectl replace --raw`, KubeVirt's body) holds a guest
//!    frozen: `status.fsFreezeStatus: frozen`; `unfreeze` thaws; a freeze with a 3 s
//!    `unfreezeTimeout` is thawed by the launcher on its own.
//! 2. A BackupPlan of the namespace (both VMs) with `consistency: {freeze: Group}`: in its run
//!    both guests' freeze windows overlap (each was frozen before either was thawed); the
//!    run's status names both VMs and the time held. A `PerVM` Backup for contrast: the
//!    windows do not overlap.
//!    The plan's `preFreezeCommand` ran in each guest before its freeze, `postThawCommand`
//!    after its thaw (both print on the console); a Backup whose pre command exits 3 fails
//!    naming the VM, the code and its stderr, and its post command runs only in the VM whose
//!    pre command was started. The agent's exec route refuses (401) requests without the
//!    server's credential and the guest runs nothing.
//! 3. With the guest agent of one VM stopped, a `Group` backup fails naming that VM and the
//!    other guest is left thawed.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest, serve_files};

const BIN: &str = env!("CARGO_BIN_EXE_ferrovirt");
const BOOT: Duration = Duration::from_secs(180);
const STEP: Duration = Duration::from_secs(240);
const KEY: &str = "a-backup-key-of-32-bytes-000001";
const VMS: [&str; 2] = ["gf1", "gf2"];

fn setup_yaml(store: &std::path::Path, url: &str) -> String {
    let mut y = format!(
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
        store.display()
    );
    for vm in VMS {
        y.push_str(&format!(
            r#"---
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: {vm}-root, namespace: default}}
spec:
  source: {{http: {{url: "{url}"}}}}
  storage: {{resources: {{requests: {{storage: 64Mi}}}}}}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {vm}, namespace: default}}
spec:
  runStrategy: Always
  template:
    spec:
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - {{name: root, disk: {{bus: virtio}}}}
      volumes:
      - {{name: root, dataVolume: {{name: {vm}-root}}}}
"#
        ));
    }
    y
}

fn host_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// A running guest: its directory and console.
struct Guest {
    name: &'static str,
    dir: std::path::PathBuf,
    console: SerialConsole,
    /// Guest clock minus host clock, seconds.
    offset: f64,
}

impl Guest {
    fn log(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(self.dir.join("serial.log")).unwrap_or_default())
            .into_owned()
    }

    /// The host times of the hook's `event` lines so far.
    fn events(&self, event: &str) -> Vec<f64> {
        let pat = format!("FERROVIRT-FSFREEZE {event} ");
        self.log()
            .lines()
            .filter_map(|l| l.split(&pat).nth(1))
            .filter_map(|t| t.trim().parse::<f64>().ok())
            .map(|t| t - self.offset)
            .collect()
    }

    /// Measures the guest clock's offset (median of 5 round trips over the console).
    fn measure_offset(&mut self) -> anyhow::Result<()> {
        let mut offs = Vec::new();
        for _ in 0..5 {
            let before = host_now();
            let (out, rc) = self.console.exec(
                "adjtimex | awk '/tv_sec/ {s = $2} /tv_usec/ {u = $2} END {printf \"%d.%06d\\n\", s, u}'",
                Duration::from_secs(20),
            )?;
            let after = host_now();
            anyhow::ensure!(rc == 0, "adjtimex in {}: {out}", self.name);
            let g: f64 = out.trim().parse()?;
            offs.push(g - (before + after) / 2.0);
        }
        offs.sort_by(f64::total_cmp);
        self.offset = offs[2];
        eprintln!("{}: guest clock offset {:+.3} s", self.name, self.offset);
        Ok(())
    }
}

fn boot(c: &Cluster, name: &'static str) -> anyhow::Result<Guest> {
    let uid = c.wait_booted(name, BOOT)?;
    let dir = c.agent_dir().join("vmis").join(&uid);
    c.wait_until(&format!("{name} ready"), BOOT, || {
        Ok(
            String::from_utf8_lossy(&std::fs::read(dir.join("serial.log")).unwrap_or_default())
                .contains("FERROVIRT-READY")
                .then_some(()),
        )
    })?;
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    Ok(Guest {
        name,
        dir,
        console,
        offset: 0.0,
    })
}

fn exec_attacks(c: &Cluster, g: &Guest) -> anyhow::Result<()> {
    let uid = g
        .dir
        .file_name()
        .and_then(|u| u.to_str())
        .unwrap_or_default();
    let nodes = c.get_json(&["nodes"])?;
    let url = nodes["items"][0]["metadata"]["annotations"]["ferrovirt.io/agent-endpoint"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    anyhow::ensure!(url.starts_with("https://"), "no agent endpoint: {nodes}");
    let sa = c.kubectl_ok(&["create", "token", "default", "-n", "default"])?;
    let body = r#"{"command":["/bin/sh","-c","echo FERROVIRT-EXEC-ATTACK >/dev/console"],"timeoutSeconds":5}"#;
    for (what, auth) in [
        ("no token", None),
        ("a made-up token", Some("not-the-token".to_string())),
        ("a ServiceAccount token", Some(sa.trim().to_string())),
    ] {
        let mut cmd = std::process::Command::new("curl");
        cmd.args(["-sS", "-k", "-o", "-", "-w", "\n%{http_code}", "-X", "POST"])
            .args(["-H", "Content-Type: application/json", "--data", body]);
        if let Some(t) = auth {
            cmd.args(["-H", &format!("Authorization: Bearer {t}")]);
        }
        let out = cmd.arg(format!("{url}/vmis/{uid}/exec")).output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        anyhow::ensure!(text.ends_with("401"), "{what}: {text}");
    }
    let file = c.dir().join("exec-body.json");
    std::fs::write(&file, body)?;
    let out = c.kubectl(&[
        "create",
        "--raw",
        &format!(
            "/apis/subresources.kubevirt.io/v1/namespaces/default/virtualmachineinstances/{}/exec",
            g.name
        ),
        "-f",
        file.to_str().unwrap_or_default(),
    ])?;
    let err = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(
        !out.status.success() && err.contains("NotFound"),
        "the API's answer to an exec subresource: {err}"
    );
    std::thread::sleep(Duration::from_secs(2));
    anyhow::ensure!(
        !g.log().contains("FERROVIRT-EXEC-ATTACK"),
        "a refused exec ran in the guest"
    );
    Ok(())
}

fn agent_connected(c: &Cluster, vm: &str) -> anyhow::Result<bool> {
    let v = c.get_json(&["vmi", vm, "-n", "default"])?;
    Ok(v["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "AgentConnected" && c["status"] == "True"))
}

fn subresource(
    c: &Cluster,
    vm: &str,
    sub: &str,
    body: &str,
) -> anyhow::Result<std::process::Output> {
    let f = c.dir().join(format!("{sub}-{vm}.json"));
    std::fs::write(&f, body)?;
    let path = format!(
        "/apis/subresources.kubevirt.io/v1/namespaces/default/virtualmachineinstances/{vm}/{sub}"
    );
    c.kubectl(&["replace", "--raw", &path, "-f", &f.display().to_string()])
}

fn freeze_status(c: &Cluster, vm: &str) -> anyhow::Result<serde_json::Value> {
    Ok(c.get_json(&["vmi", vm, "-n", "default"])?["status"]["fsFreezeStatus"].clone())
}

/// Creates Backup `name` of both VMs with `consistency` and waits for it to end.
fn backup(c: &Cluster, name: &str, consistency: &str) -> anyhow::Result<serde_json::Value> {
    c.apply(&format!(
        "apiVersion: backup.ferrovirt.io/v1alpha1\nkind: Backup\n\
         metadata: {{name: {name}, namespace: default}}\n\
         spec: {{target: fs, virtualMachines: [gf1, gf2], encryptionKeySecretRef: bk-key, \
         consistency: {consistency}}}\n"
    ))?;
    c.wait_until(&format!("backup {name} finished"), STEP, || {
        let v = c.get_json(&["backup.backup.ferrovirt.io", name, "-n", "default"])?;
        let p = v["status"]["phase"].as_str().unwrap_or("");
        Ok((p == "Succeeded" || p == "Failed").then_some(v))
    })
}

/// Each guest's (freeze, thaw) host times of its last window that began after `since`.
fn windows(guests: &[Guest], since: f64) -> anyhow::Result<Vec<(f64, f64)>> {
    guests
        .iter()
        .map(|g| {
            let f = g.events("freeze").into_iter().rfind(|t| *t >= since);
            let t = g.events("thaw").into_iter().rfind(|t| *t >= since);
            match (f, t) {
                (Some(f), Some(t)) if t >= f => Ok((f, t)),
                _ => anyhow::bail!(
                    "{}: no freeze/thaw window after {since}: {}",
                    g.name,
                    g.log()
                ),
            }
        })
        .collect()
}

#[test]
fn a_group_freeze_holds_both_guests_in_one_window() -> anyhow::Result<()> {
    let t0 = Instant::now();
    let guest = TestGuest::get()?;
    let store = tempfile::Builder::new().prefix("fv-bkgf-").tempdir()?;
    let c = Cluster::start(&ClusterOptions::new(BIN))?;
    let url = serve_files(vec![("disk.qcow2".into(), guest.disk_qcow2.clone())])? + "/disk.qcow2";
    c.apply(&setup_yaml(store.path(), &url))?;
    let mut guests = Vec::new();
    for vm in VMS {
        guests.push(boot(&c, vm)?);
    }
    for vm in VMS {
        c.wait_until(&format!("{vm} guest agent connected"), BOOT, || {
            Ok(agent_connected(&c, vm)?.then_some(()))
        })?;
    }
    for g in &mut guests {
        g.measure_offset()?;
    }
    eprintln!("[{:?}] both VMs run with their guest agents", t0.elapsed());

    // 1. The freeze subresource.
    let out = subresource(&c, "gf1", "freeze", r#"{"unfreezeTimeout":"5m"}"#)?;
    anyhow::ensure!(
        out.status.success(),
        "freeze: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    c.wait_until("fsFreezeStatus frozen", STEP, || {
        Ok((freeze_status(&c, "gf1")? == "frozen").then_some(()))
    })?;
    assert!(guests[0].log().contains("FERROVIRT-FSFREEZE freeze"));
    let out = subresource(&c, "gf1", "unfreeze", "{}")?;
    anyhow::ensure!(
        out.status.success(),
        "unfreeze: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    c.wait_until("fsFreezeStatus gone", STEP, || {
        Ok(freeze_status(&c, "gf1")?.is_null().then_some(()))
    })?;
    let bad = subresource(&c, "gf1", "freeze", r#"{"unfreezeTimeout":"0s"}"#)?;
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("unfreezeTimeout"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    let thaws = guests[1].events("thaw").len();
    let asked = Instant::now();
    let out = subresource(&c, "gf2", "freeze", r#"{"unfreezeTimeout":"3s"}"#)?;
    anyhow::ensure!(
        out.status.success(),
        "freeze: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    c.wait_until("the launcher's own thaw", STEP, || {
        Ok((guests[1].events("thaw").len() > thaws).then_some(()))
    })?;
    let auto = asked.elapsed();
    eprintln!(
        "[{:?}] a 3 s unfreezeTimeout thawed after {auto:?}",
        t0.elapsed()
    );
    assert!(auto >= Duration::from_secs(3), "{auto:?}");

    // 2. A plan of the whole namespace (selector {}) with a Group freeze: its run freezes both
    //    guests in one window.
    let since = host_now();
    c.apply(
        r#"
apiVersion: backup.ferrovirt.io/v1alpha1
kind: BackupPlan
metadata: {name: grouped, namespace: default}
spec:
  schedule: "*/10 * * * * *"
  target: fs
  selector: {}
  encryptionKeySecretRef: bk-key
  consistency:
    freeze: Group
    freezeTimeout: 60s
    preFreezeCommand: [/bin/sh, -c, "echo FERROVIRT-PRE-HOOK >/dev/console"]
    postThawCommand: [/bin/sh, -c, "echo FERROVIRT-POST-HOOK >/dev/console"]
    commandTimeout: 20s
"#,
    )?;
    let run = c.wait_until("the plan's first run", STEP, || {
        let v = c.get_json(&["backupplan", "grouped", "-n", "default"])?;
        let done = matches!(
            v["status"]["lastResult"].as_str(),
            Some("Succeeded" | "Failed")
        );
        Ok(done.then(|| v["status"]["lastBackup"].as_str().unwrap_or("").to_string()))
    })?;
    c.kubectl_ok(&[
        "patch",
        "backupplan",
        "grouped",
        "-n",
        "default",
        "--type=merge",
        "-p",
        r#"{"spec":{"paused":true}}"#,
    ])?;
    let b = c.get_json(&["backup.backup.ferrovirt.io", &run, "-n", "default"])?;
    assert_eq!(b["status"]["phase"], "Succeeded", "{b}");
    assert_eq!(b["spec"]["consistency"]["freeze"], "Group", "{b}");
    let f = &b["status"]["freeze"];
    assert_eq!(
        f["virtualMachines"],
        serde_json::json!(["gf1", "gf2"]),
        "{b}"
    );
    assert!(f["heldSeconds"].as_f64().is_some_and(|s| s > 0.0), "{b}");
    let w = windows(&guests, since - 1.0)?;
    let last_freeze = w.iter().map(|w| w.0).fold(f64::MIN, f64::max);
    let first_thaw = w.iter().map(|w| w.1).fold(f64::MAX, f64::min);
    eprintln!(
        "group: windows {w:?}; both frozen for {:.3} s (held {} s by the controller)",
        first_thaw - last_freeze,
        f["heldSeconds"]
    );
    assert!(
        last_freeze < first_thaw,
        "every guest must be frozen before any is thawed: {w:?}"
    );

    // Each guest ran the pre command before its freeze and the post command after its thaw.
    for g in &guests {
        let log = g.log();
        let pre = log.find("FERROVIRT-PRE-HOOK").expect("the pre command ran");
        let f = pre
            + log[pre..]
                .find("FERROVIRT-FSFREEZE freeze")
                .expect("a freeze after the pre command");
        let t = f + log[f..].find("FERROVIRT-FSFREEZE thaw").expect("a thaw");
        assert!(
            log[t..].contains("FERROVIRT-POST-HOOK"),
            "{}: the post command after the thaw: {log}",
            g.name
        );
    }

    // The same backup per VM: one guest is thawed before the other is frozen.
    let since = host_now();
    let b = backup(&c, "pervm", "{freeze: PerVM}")?;
    assert_eq!(b["status"]["phase"], "Succeeded", "{b}");
    assert!(b["status"]["freeze"].is_null(), "{b}");
    let w = windows(&guests, since - 1.0)?;
    eprintln!("per VM: windows {w:?}");
    assert!(
        w[0].1 < w[1].0 || w[1].1 < w[0].0,
        "per-VM freezes do not overlap: {w:?}"
    );

    // A failing pre command fails the backup, naming the VM, its exit code and its stderr;
    // the post command runs where the pre command was started (gf1), not in gf2, which the
    // failure kept from running its pre command.
    let b = backup(
        &c,
        "prefails",
        "{preFreezeCommand: [/bin/sh, -c, 'echo database busy >&2; exit 3'], \
         postThawCommand: [/bin/sh, -c, 'echo FERROVIRT-POST-AFTER-FAIL >/dev/console']}",
    )?;
    assert_eq!(b["status"]["phase"], "Failed", "{b}");
    assert!(
        b.to_string().contains(
            "preFreezeCommand in VirtualMachine default/gf1 exited with 3: database busy"
        ),
        "{b}"
    );
    assert!(guests[0].log().contains("FERROVIRT-POST-AFTER-FAIL"));
    assert!(!guests[1].log().contains("FERROVIRT-POST-AFTER-FAIL"));

    // The agent's exec route runs commands in guests for the controllers only: without the
    // server's credential (none, a made-up token, a ServiceAccount's token) it answers 401 and
    // the guest runs nothing; the API serves no exec subresource.
    exec_attacks(&c, &guests[0])?;

    // 3. No guest agent in gf2: the group backup fails naming it, gf1 is left thawed.
    let (out, _) = guests[1].console.exec(
        "kill $(cat /run/qemu-ga.pid); echo killed",
        Duration::from_secs(20),
    )?;
    assert!(out.contains("killed"), "{out}");
    c.wait_until("gf2 guest agent gone", STEP, || {
        Ok((!agent_connected(&c, "gf2")?).then_some(()))
    })?;
    let b = backup(&c, "noagent", "{freeze: Group}")?;
    assert_eq!(b["status"]["phase"], "Failed", "{b}");
    let why = b.to_string();
    assert!(
        why.contains("gf2") && why.contains("guest agent is not connected"),
        "{b}"
    );
    assert!(freeze_status(&c, "gf1")?.is_null());
    let froze = guests[0].events("freeze").len();
    let thawed = guests[0].events("thaw").len();
    assert_eq!(froze, thawed, "gf1 is thawed again: {}", guests[0].log());
    eprintln!("[{:?}] done", t0.elapsed());
    Ok(())
}
