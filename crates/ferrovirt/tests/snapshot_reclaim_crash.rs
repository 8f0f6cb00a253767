//! The crash an online merge's journal closes (docs/snapshots.md "Order and crashes"),
//! against the real binary, kubectl and a TCG guest: a node agent run with the test-only
//! failpoint `FERROVIRT_FAILPOINT=online-reclaim-after-merge:data` aborts (SIGABRT, no
//! clean-up) right after the launcher answered the active commit of the VM's data volume
//! into its raw bottom and before `chain.json` was rewritten. The record then still names
//! the stale qcow2 top, with the journal and the launcher's pivot marker beside it. The
//! agent is started again: its start pass asks the launcher which layers QEMU runs and
//! records them (the raw bottom alone), the guest ran on throughout, a later online snapshot
//! and its merge work, and every marker the guest wrote survives a stop and start of the VM.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest, serve_files};

const NODE: &str = "node1";
const BOOT: Duration = Duration::from_secs(120);
const STEP: Duration = Duration::from_secs(60);
const MARKERS: [(&str, u32); 3] = [
    ("CRASH-FIRST", 0),
    ("CRASH-SECOND", 2048),
    ("CRASH-THIRD", 4096),
];
const DISK: &str = "/dev/vdb";

fn vm_yaml(url: &str) -> String {
    format!(
        r#"
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: cr-root, namespace: default}}
spec:
  source: {{http: {{url: "{url}"}}}}
  storage: {{resources: {{requests: {{storage: 64Mi}}}}}}
---
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: cr-data, namespace: default}}
spec:
  source: {{blank: {{}}}}
  storage: {{resources: {{requests: {{storage: 16Mi}}}}}}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: crvm, namespace: default}}
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
        dataVolume: {{name: cr-root}}
      - name: data
        dataVolume: {{name: cr-data}}
"#
    )
}

fn snapshot_yaml(name: &str) -> String {
    format!(
        r#"
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineSnapshot
metadata: {{name: {name}, namespace: default}}
spec:
  source: {{apiGroup: kubevirt.io, kind: VirtualMachine, name: crvm}}
"#
    )
}

fn vmi_dir(c: &Cluster, uid: &str) -> PathBuf {
    c.extra_agent_dir(NODE).join("vmis").join(uid)
}

/// Boots the VM's VMI to the guest's shell; the VMI uid and a console on it.
fn boot(c: &Cluster) -> anyhow::Result<(String, SerialConsole)> {
    // `wait_booted` looks in the embedded agent's directory; this node's agent is apart.
    let uid = c.wait_until("VMI crvm Running", BOOT, || {
        let out = c.kubectl(&["get", "vmi", "crvm", "-n", "default", "-o", "json"])?;
        if !out.status.success() {
            return Ok(None);
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        anyhow::ensure!(v["status"]["phase"] != "Failed", "{}", v["status"]);
        Ok((v["status"]["phase"] == "Running").then(|| {
            v["metadata"]["uid"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        }))
    })?;
    let dir = vmi_dir(c, &uid);
    c.wait_until("guest shell ready", BOOT, || {
        let log = std::fs::read(dir.join("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    Ok((uid, console))
}

fn write_marker(console: &SerialConsole, i: usize) -> anyhow::Result<()> {
    let (marker, sector) = MARKERS[i];
    let (out, rc) = console.exec(
        &format!("echo {marker} | dd of={DISK} bs=512 seek={sector} conv=fsync && sync"),
        Duration::from_secs(30),
    )?;
    anyhow::ensure!(rc == 0, "writing {marker}: {out}");
    Ok(())
}

/// Markers `0..n` read back from the data disk, past the guest's page cache.
fn check_markers(console: &SerialConsole, n: usize) -> anyhow::Result<()> {
    console.exec(
        "sync; echo 3 >/proc/sys/vm/drop_caches",
        Duration::from_secs(30),
    )?;
    for (marker, sector) in &MARKERS[..n] {
        let (out, _) = console.exec(
            &format!(
                "dd if={DISK} bs=512 skip={sector} count=1 2>/dev/null | head -c {}; echo",
                marker.len()
            ),
            Duration::from_secs(30),
        )?;
        let got = out.replace('\0', "");
        anyhow::ensure!(
            got.trim() == *marker,
            "sector {sector}: {got:?}, want {marker}"
        );
    }
    Ok(())
}

fn volume_dir(c: &Cluster, claim: &str) -> anyhow::Result<PathBuf> {
    let pvc = c.get_json(&["pvc", claim, "-n", "default"])?;
    let pv = c.get_json(&["pv", pvc["spec"]["volumeName"].as_str().unwrap_or_default()])?;
    let path = pv["spec"]["local"]["path"]
        .as_str()
        .or(pv["spec"]["hostPath"]["path"].as_str())
        .unwrap_or_default();
    Ok(path.into())
}

fn chain(dir: &Path) -> anyhow::Result<serde_json::Value> {
    Ok(serde_json::from_slice(&std::fs::read(
        dir.join("chain.json"),
    )?)?)
}

fn layer_files(dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut v: Vec<String> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".qcow2") || n.ends_with(".pivoted"))
        .collect();
    v.sort();
    Ok(v)
}

fn plain(dir: &Path) -> anyhow::Result<bool> {
    let ch = chain(dir)?;
    Ok(ch["layers"].as_array().map(Vec::len) == Some(1)
        && ch.get("released").is_none()
        && ch.get("journal").is_none()
        && layer_files(dir)?.is_empty())
}

fn wait_ready(c: &Cluster, name: &str) -> anyhow::Result<()> {
    c.wait_until(&format!("snapshot {name} ready"), STEP, || {
        let v = c.get_json(&["vmsnapshot", name, "-n", "default"])?;
        anyhow::ensure!(v["status"]["phase"] != "Failed", "{v}");
        Ok((v["status"]["readyToUse"] == true).then_some(()))
    })
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .is_some_and(|r| !r.trim_start().starts_with('Z'))
    })
}

#[test]
fn an_agent_killed_after_the_pivot_records_the_chain_qemu_runs() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let mut opts = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
    opts.node_name = None;
    let mut c = Cluster::start(&opts)?;
    c.start_agent_env(
        NODE,
        &[("FERROVIRT_FAILPOINT", "online-reclaim-after-merge:data")],
    )?;
    let url = serve_files(vec![("disk.qcow2".into(), guest.disk_qcow2.clone())])? + "/disk.qcow2";
    c.apply(&vm_yaml(&url))?;
    let (uid, console) = boot(&c)?;
    let qemu_pid: u32 = std::fs::read_to_string(vmi_dir(&c, &uid).join("qemu.pid"))?
        .trim()
        .parse()?;
    write_marker(&console, 0)?;
    c.apply(&snapshot_yaml("cr1"))?;
    wait_ready(&c, "cr1")?;
    let data = volume_dir(&c, "cr-data")?;
    let root = volume_dir(&c, "cr-root")?;
    assert_eq!(layer_files(&data)?, ["layer-000001.qcow2"]);
    write_marker(&console, 1)?;

    // The merge of the data volume: the launcher's active commit pivots, the agent aborts
    // before the rename.
    let agent = c.agent_pid(NODE).expect("the node agent");
    c.kubectl_ok(&[
        "delete",
        "vmsnapshot",
        "cr1",
        "-n",
        "default",
        "--wait=false",
    ])?;
    c.wait_until("the agent aborted at the failpoint", STEP, || {
        Ok((!alive(agent)).then_some(()))
    })?;
    let log = c.agent_log(NODE);
    assert!(
        log.contains("failpoint online-reclaim-after-merge at volume data"),
        "{log}"
    );
    // The crash window: the record names the stale top, with the journal and the marker.
    let ch = chain(&data)?;
    assert_eq!(ch["layers"].as_array().map(Vec::len), Some(2), "{ch}");
    assert_eq!(ch["journal"]["commit"], true, "{ch}");
    assert_eq!(ch["journal"]["layers"][0]["file"], "disk.img", "{ch}");
    let files = layer_files(&data)?;
    assert!(
        files.iter().any(|f| f.ends_with(".pivoted")),
        "the launcher's pivot marker: {files:?}"
    );
    assert!(alive(qemu_pid), "the VM runs on without its agent");
    let launcher_log = std::fs::read_to_string(vmi_dir(&c, &uid).join("launcher.log"))?;
    let resumed = launcher_log
        .lines()
        .find(|l| l.contains("the guest resumed after a layer merge's pivot"));
    assert!(resumed.is_some(), "{launcher_log}");
    eprintln!("{}", resumed.unwrap_or_default());
    // The guest writes the raw bottom now.
    write_marker(&console, 2)?;

    c.start_agent(NODE)?;
    // Recorded first, the merged-away files and the marker deleted after.
    c.wait_until("the data volume's journal resolved", STEP, || {
        Ok(
            (chain(&data)?.get("journal").is_none() && layer_files(&data)?.is_empty())
                .then_some(()),
        )
    })?;
    let ch = chain(&data)?;
    assert_eq!(
        ch["layers"],
        serde_json::json!([{"file": "disk.img", "format": "raw"}]),
        "the chain QEMU runs: {ch}"
    );
    assert!(plain(&data)?, "{ch} {:?}", layer_files(&data)?);
    let said = c.wait_until("the agent's log of the resolution", STEP, || {
        let log = c.agent_log(NODE);
        Ok(log
            .lines()
            .find(|l| l.contains("an online merge's journal resolved"))
            .map(String::from))
    });
    let said = said.map_err(|e| anyhow::anyhow!("{e}\n{}", c.agent_log(NODE)))?;
    assert!(said.contains("merged") && said.contains("true"), "{said}");
    // Decided from the launcher's answer, not from the files.
    let log = c.agent_log(NODE);
    assert!(
        log.lines()
            .any(|l| l.contains("the launcher says which layers QEMU runs")
                && l.contains(r#"["disk.img"]"#)),
        "{log}"
    );
    // The root volume, whose merge the crash interrupted or that waited, is merged too.
    c.wait_until("the root volume plain", Duration::from_secs(90), || {
        Ok(plain(&root)?.then_some(()))
    })?;
    let vmi = c.get_json(&["vmi", "crvm", "-n", "default"])?;
    assert_eq!(vmi["metadata"]["uid"], uid.as_str(), "the VMI was replaced");
    assert!(alive(qemu_pid), "the same QEMU runs");
    check_markers(&console, 3)?;

    // A later online snapshot and its merge work on the resolved record.
    c.apply(&snapshot_yaml("cr2"))?;
    wait_ready(&c, "cr2")?;
    assert_eq!(chain(&data)?["layers"].as_array().map(Vec::len), Some(2));
    c.kubectl_ok(&["delete", "vmsnapshot", "cr2", "-n", "default"])?;
    c.wait_until("both volumes plain again", STEP, || {
        Ok((plain(&data)? && plain(&root)?).then_some(()))
    })?;
    check_markers(&console, 3)?;
    drop(console);

    c.halt_vm("crvm", STEP)?;
    c.set_run_strategy("crvm", "Always")?;
    let (uid2, console) = boot(&c)?;
    assert_ne!(uid2, uid);
    check_markers(&console, 3)?;
    Ok(())
}
