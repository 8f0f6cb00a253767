//! Node-local storage done by the node's agent (docs/storage.md): two agents, each in its own
//! mount namespace with a private tmpfs over its data dir that the server cannot see, and a
//! server without an agent of its own. DataVolumes import the test guest's `disk.qcow2` over
//! HTTP (from a file server on 127.0.0.1) into `local`-class claims on each node, and from an
//! OCI registry on 127.0.0.1 into one on node-b; a wrong checksum and a qcow2 with a backing
//! file fail there with their reasons; the import
//! address policy holds on the node (127.0.0.2 is refused: only 127.0.0.1/32 is allowed); an
//! upload (`ferrovirt image-upload`) is streamed to the node and converted there; a blank
//! volume is made and grown, and a same-node clone copied, on the nodes; a cross-node clone
//! is refused with its reason; VMs boot from the imported volumes (the guest's
//! `FERROVIRT-BOOT` serial marker, read inside the node's namespace); the server's filesystem
//! holds no trace of the volumes; and deleting the DataVolumes deletes the volumes inside the
//! nodes.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use ferrovirt_testkit::mountns::MountNsAgent;
use ferrovirt_testkit::{Cluster, ClusterOptions, Registry, TestGuest, serve_files};
use serde_json::Value;

const IMPORT: Duration = Duration::from_secs(90);
const BOOT: Duration = Duration::from_secs(120);

fn dv(name: &str, node: &str, source: &str, size: &str) -> String {
    format!(
        "apiVersion: cdi.kubevirt.io/v1beta1\nkind: DataVolume\nmetadata:\n  name: {name}\n  namespace: default\n  annotations: {{volume.kubernetes.io/selected-node: {node}}}\nspec:\n  source:\n{source}  storage:\n    resources: {{requests: {{storage: {size}}}}}\n---\n"
    )
}

fn vm(name: &str, volume: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {name}, namespace: default}}
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
      volumes:
      - name: root
        dataVolume: {{name: {volume}}}
---
"#
    )
}

fn wait_phase(c: &Cluster, name: &str, phase: &str) -> anyhow::Result<Value> {
    c.wait_until(&format!("DataVolume {name} {phase}"), IMPORT, || {
        let v = c.get_json(&["dv", name, "-n", "default"])?;
        let now = v["status"]["phase"].as_str().unwrap_or_default();
        if now == phase {
            return Ok(Some(v));
        }
        anyhow::ensure!(now != "Failed", "DataVolume {name} failed: {}", v["status"]);
        Ok(None)
    })
}

/// The PV name and the volume directory of claim `claim`.
fn volume_of(c: &Cluster, claim: &str) -> anyhow::Result<(String, PathBuf, Value)> {
    let pvc = c.get_json(&["pvc", claim, "-n", "default"])?;
    let name = pvc["spec"]["volumeName"]
        .as_str()
        .context("claim has no volume")?
        .to_string();
    let pv = c.get_json(&["pv", &name])?;
    let path = pv["spec"]["local"]["path"]
        .as_str()
        .context("no local path")?;
    Ok((name, PathBuf::from(path), pv))
}

/// Every path under `root` whose name is `name` (the server's view).
fn find_named(root: &Path, name: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if e.file_name().to_string_lossy() == name {
                found.push(p.clone());
            }
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(p);
            }
        }
    }
    found
}

#[test]
fn node_agents_import_boot_and_delete_their_own_volumes() -> anyhow::Result<()> {
    let start = Instant::now();
    let guest = TestGuest::get()?;
    let mut opts = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
    opts.node_name = None;
    opts.extra_args = vec!["--import-allowed-cidrs".into(), "127.0.0.1/32".into()];
    let mut c = Cluster::start(&opts)?;
    let a = c.start_agent_in_mount_ns("node-a")?;
    let b = c.start_agent_in_mount_ns("node-b")?;
    for n in [&a, &b] {
        c.wait_until(
            &format!("node {} Ready", n.node),
            Duration::from_secs(60),
            || {
                let v = c.get_json(&["node", &n.node])?;
                let ready = v["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True");
                Ok(ready.then_some(()))
            },
        )?;
    }
    // A qcow2 whose backing file is a host file: refused on the node like anywhere.
    let evil = c.dir.path().join("evil.qcow2");
    let made = std::process::Command::new("qemu-img")
        .args([
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "raw",
            "-b",
            "/etc/passwd",
        ])
        .arg(&evil)
        .arg("16M")
        .status()?;
    anyhow::ensure!(made.success(), "qemu-img create failed");
    let base = serve_files(vec![
        ("disk.qcow2".into(), guest.disk_qcow2.clone()),
        ("evil.qcow2".into(), evil),
    ])?;
    let reg = Registry::start()?;
    reg.push_disk("fv/guest", "v1", &guest.disk_qcow2, "disk.qcow2", false)?;
    c.apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata: {{name: kubevirt-hyperconverged}}\n---\n\
         apiVersion: hco.kubevirt.io/v1beta1\nkind: HyperConverged\n\
         metadata: {{name: kubevirt-hyperconverged, namespace: kubevirt-hyperconverged}}\n\
         spec:\n  storageImport:\n    insecureRegistries: [\"{}\"]\n",
        reg.addr
    ))?;
    let http = format!("    http: {{url: \"{base}/disk.qcow2\"}}\n");
    let sum_of = |p: &Path| -> anyhow::Result<String> {
        let out = std::process::Command::new("sha256sum").arg(p).output()?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .unwrap_or("")
            .to_string())
    };
    let good = sum_of(&guest.disk_qcow2)?;
    let checked = |sum: &str| {
        format!("    http: {{url: \"{base}/disk.qcow2\", checksum: \"sha256:{sum}\"}}\n")
    };
    let mut manifests = dv("root-a", "node-a", &checked(&good), "64Mi");
    manifests.push_str(&dv("badsum-a", "node-a", &checked(&"0".repeat(64)), "64Mi"));
    let evil_src = format!("    http: {{url: \"{base}/evil.qcow2\"}}\n");
    manifests.push_str(&dv("evil-b", "node-b", &evil_src, "64Mi"));
    manifests.push_str(&dv("root-b", "node-b", &http, "64Mi"));
    manifests.push_str(&dv("blank-a", "node-a", "    blank: {}\n", "16Mi"));
    let registry = format!(
        "    registry: {{url: \"docker://{}/fv/guest:v1\"}}\n",
        reg.addr
    );
    manifests.push_str(&dv("reg-b", "node-b", &registry, "64Mi"));
    let port = base.rsplit(':').next().unwrap_or_default();
    let hostile = format!("    http: {{url: \"http://127.0.0.2:{port}/disk.qcow2\"}}\n");
    manifests.push_str(&dv("ssrf-b", "node-b", &hostile, "64Mi"));
    c.apply(&manifests)?;
    let agents = [(&a, "root-a"), (&b, "root-b")];
    for (agent, name) in agents {
        let v = wait_phase(&c, name, "Succeeded")?;
        assert_eq!(v["status"]["progress"], "100.0%", "{v}");
        let (_, dir, pv) = volume_of(&c, name)?;
        let term = &pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0];
        assert_eq!(
            term["matchExpressions"][0]["values"][0],
            agent.node.as_str(),
            "{pv}"
        );
        assert!(dir.starts_with(&agent.data_dir), "{}", dir.display());
        // Inside the node: a raw disk of the claim's size. Outside: nothing.
        let out = agent.exec(&["stat", "-c", "%s", &dir.join("disk.img").to_string_lossy()])?;
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            (64u64 << 20).to_string()
        );
        assert!(!dir.exists(), "{} is visible to the server", dir.display());
    }
    wait_phase(&c, "blank-a", "Succeeded")?;
    let (_, blank_dir, _) = volume_of(&c, "blank-a")?;
    assert!(a.exists(&blank_dir.join("disk.img"))?);
    let refused = c.wait_until("ssrf-b refused", IMPORT, || {
        let v = c.get_json(&["dv", "ssrf-b", "-n", "default"])?;
        Ok((v["status"]["phase"] == "Failed").then_some(v))
    })?;
    assert!(refused.to_string().contains("loopback"), "{refused}");
    for (name, reason) in [
        ("badsum-a", "checksum mismatch"),
        ("evil-b", "backing file"),
    ] {
        let failed = c.wait_until(&format!("{name} failed"), IMPORT, || {
            let v = c.get_json(&["dv", name, "-n", "default"])?;
            Ok((v["status"]["phase"] == "Failed").then_some(v))
        })?;
        assert!(failed.to_string().contains(reason), "{failed}");
    }

    // The node's agent grows its volume.
    c.kubectl_ok(&[
        "patch",
        "pvc",
        "blank-a",
        "-n",
        "default",
        "--type=merge",
        "-p",
        r#"{"spec":{"resources":{"requests":{"storage":"32Mi"}}}}"#,
    ])?;
    let img = blank_dir.join("disk.img");
    c.wait_until("blank-a grown on node-a", IMPORT, || {
        let out = a.exec(&["stat", "-c", "%s", &img.to_string_lossy()])?;
        let size = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let v = c.get_json(&["pvc", "blank-a", "-n", "default"])?;
        Ok(
            (size == (32u64 << 20).to_string() && v["status"]["capacity"]["storage"] == "32Mi")
                .then_some(()),
        )
    })?;

    // An upload is streamed to the node (the DataVolume controller places it on node-a,
    // the first Ready node) and converted there: the same bytes as the import.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrovirt"))
        .arg("--kubeconfig")
        .arg(&c.kubeconfig)
        .args([
            "image-upload",
            "dv",
            "up-a",
            "--size",
            "64Mi",
            "--insecure",
            "--image-path",
        ])
        .arg(&guest.disk_qcow2)
        .output()?;
    assert!(out.status.success(), "{out:?}");
    let v = wait_phase(&c, "up-a", "Succeeded")?;
    assert_eq!(v["status"]["progress"], "100.0%", "{v}");

    // Same-node clone (by node-b's agent); a cross-node clone is refused with the reason.
    let clone_src = "    pvc: {namespace: default, name: root-b}\n";
    let mut clones = dv("copy-b", "node-b", clone_src, "64Mi");
    clones.push_str(&dv("copy-a", "node-a", clone_src, "64Mi"));
    c.apply(&clones)?;
    wait_phase(&c, "copy-b", "Succeeded")?;
    let (_, copy_dir, _) = volume_of(&c, "copy-b")?;
    let sum = |agent: &MountNsAgent, dir: &Path| -> anyhow::Result<String> {
        let out = agent.exec(&["sha256sum", &dir.join("disk.img").to_string_lossy()])?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .unwrap_or("")
            .to_string())
    };
    let (_, root_b_dir, _) = volume_of(&c, "root-b")?;
    assert_eq!(sum(&b, &copy_dir)?, sum(&b, &root_b_dir)?);
    // The registry import made the same disk on node-b.
    wait_phase(&c, "reg-b", "Succeeded")?;
    let (_, reg_dir, _) = volume_of(&c, "reg-b")?;
    assert!(reg_dir.starts_with(&b.data_dir) && !reg_dir.exists());
    assert_eq!(sum(&b, &reg_dir)?, sum(&b, &root_b_dir)?);
    let (_, up_dir, _) = volume_of(&c, "up-a")?;
    let (_, root_a_dir, _) = volume_of(&c, "root-a")?;
    assert!(up_dir.starts_with(&a.data_dir), "{}", up_dir.display());
    let up_sum = sum(&a, &up_dir)?;
    assert!(!up_sum.is_empty());
    assert_eq!(up_sum, sum(&a, &root_a_dir)?);
    let refused = c.wait_until("copy-a refused", IMPORT, || {
        let v = c.get_json(&["dv", "copy-a", "-n", "default"])?;
        Ok((v["status"]["phase"] == "Failed").then_some(v))
    })?;
    assert!(
        refused
            .to_string()
            .contains("cloning across nodes is not supported"),
        "{refused}"
    );

    // VMs boot from the imported volumes on their nodes.
    c.apply(&format!("{}{}", vm("vm-a", "root-a"), vm("vm-b", "root-b")))?;
    for (agent, name) in [(&a, "vm-a"), (&b, "vm-b")] {
        let uid = c.wait_until(&format!("VMI {name} Running"), BOOT, || {
            let v = c.get_json(&["vmi", name, "-n", "default"]);
            let Ok(v) = v else { return Ok(None) };
            anyhow::ensure!(
                v["status"]["phase"] != "Failed",
                "VMI {name} failed: {}",
                v["status"]
            );
            Ok((v["status"]["phase"] == "Running").then(|| {
                assert_eq!(v["status"]["nodeName"], agent.node.as_str(), "{v}");
                v["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            }))
        })?;
        agent.wait_boot_marker(&c, &uid, BOOT)?;
    }

    // The server's filesystem has no trace of the node-local volumes.
    let mut names = Vec::new();
    for claim in ["root-a", "root-b", "blank-a", "copy-b", "up-a", "reg-b"] {
        let (pv, dir, _) = volume_of(&c, claim)?;
        assert!(
            find_named(c.dir.path(), &pv).is_empty(),
            "{pv} found on the server"
        );
        names.push((claim, pv, dir));
    }
    assert!(!c.data_dir.join("local-volumes").exists());

    // Deleting the VMs and DataVolumes deletes the volumes inside the nodes.
    c.kubectl_ok(&[
        "delete",
        "vm",
        "vm-a",
        "vm-b",
        "-n",
        "default",
        "--wait=false",
    ])?;
    c.wait_gone("vmi", "vm-a", BOOT)?;
    c.wait_gone("vmi", "vm-b", BOOT)?;
    c.kubectl_ok(&[
        "delete",
        "dv",
        "root-a",
        "root-b",
        "blank-a",
        "copy-b",
        "copy-a",
        "up-a",
        "ssrf-b",
        "reg-b",
        "badsum-a",
        "evil-b",
        "-n",
        "default",
        "--wait=false",
    ])?;
    for (claim, pv, dir) in &names {
        let agent = if dir.starts_with(&a.data_dir) { &a } else { &b };
        c.wait_until(
            &format!("volume of {claim} deleted on {}", agent.node),
            IMPORT,
            || {
                let gone = !agent.exists(dir)?;
                let pv_gone = !c.kubectl(&["get", "pv", pv])?.status.success();
                Ok((gone && pv_gone).then_some(()))
            },
        )?;
    }
    eprintln!(
        "node storage test took {:.1}s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
