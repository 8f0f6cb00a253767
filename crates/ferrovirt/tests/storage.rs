//! End-to-end storage through the real server: the built-in StorageClasses and profiles, PVC
//! provisioning and reclaim, and CDI DataVolumes importing the test guest's `disk.qcow2` over
//! HTTP from a server this test runs on 127.0.0.1 (with a sha256 checksum), blank volumes,
//! clones of a PVC, CDI's annotated claims (`cdi.kubevirt.io/storage.import.endpoint`, with the
//! status annotations clients wait on), and VirtualMachines booting from them (directly and
//! through `dataVolumeTemplates`), asserting on the guest's `FERROVIRT-BOOT` serial marker.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Context;
use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest, serve_files};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(180);
const IMPORT: Duration = Duration::from_secs(120);

fn cluster() -> anyhow::Result<Cluster> {
    TestGuest::get()?;
    Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))
}

fn sha256(path: &Path) -> anyhow::Result<String> {
    let out = Command::new("sha256sum").arg(path).output()?;
    anyhow::ensure!(out.status.success(), "sha256sum failed");
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .context("sha256sum output")?
        .to_string())
}

fn dv_manifest(name: &str, source: &str, storage: &str) -> String {
    dv_manifest_sum(name, source, storage, None)
}

/// A DataVolume; `checksum` goes into the `ferrovirt.io/checksum` annotation.
fn dv_manifest_sum(name: &str, source: &str, storage: &str, checksum: Option<&str>) -> String {
    let annotations = checksum
        .map(|c| format!(", annotations: {{ferrovirt.io/checksum: \"{c}\"}}"))
        .unwrap_or_default();
    format!(
        r#"
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: {name}, namespace: default{annotations}}}
spec:
  source:
{source}
  storage:
{storage}
"#
    )
}

fn http_source(url: &str) -> String {
    format!("    http:\n      url: {url}\n")
}

fn storage(class: Option<&str>, size: Option<&str>) -> String {
    let mut s = String::new();
    if let Some(c) = class {
        s.push_str(&format!("    storageClassName: {c}\n"));
    }
    match size {
        Some(sz) => s.push_str(&format!("    resources: {{requests: {{storage: {sz}}}}}\n")),
        None if s.is_empty() => s.push_str("    {}\n"),
        None => {}
    }
    s
}

fn dv(c: &Cluster, name: &str) -> anyhow::Result<Value> {
    c.get_json(&["datavolume", name, "-n", "default"])
}

fn wait_dv_phase(c: &Cluster, name: &str, phase: &str, timeout: Duration) -> anyhow::Result<Value> {
    c.wait_until(&format!("DataVolume {name} {phase}"), timeout, || {
        let v = dv(c, name)?;
        let p = v["status"]["phase"].as_str().unwrap_or_default();
        if phase != "Failed" && p == "Failed" {
            anyhow::bail!("DataVolume {name} failed: {}", v["status"]);
        }
        Ok((p == phase).then_some(v))
    })
}

fn condition<'a>(v: &'a Value, type_: &str) -> &'a Value {
    v["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or(&Value::Null)
}

fn vm_manifest(name: &str, volume: &str, templates: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {name}, namespace: default}}
spec:
  runStrategy: Always
{templates}
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
"#
    )
}

fn delete_vm(c: &Cluster, vm: &str) -> anyhow::Result<()> {
    c.kubectl_ok(&["delete", "vm", vm, "-n", "default", "--wait=false"])?;
    c.wait_gone("vmi", vm, BOOT)
}

fn pv_of(c: &Cluster, claim: &str) -> anyhow::Result<Value> {
    let pvc = c.get_json(&["pvc", claim, "-n", "default"])?;
    let pv = pvc["spec"]["volumeName"]
        .as_str()
        .context("claim has no volume")?;
    c.get_json(&["pv", pv])
}

/// A claim annotated for CDI's import from `url` (`source` empty: http).
fn annotated_claim(name: &str, url: &str, source: &str, checksum: &str) -> String {
    let source = if source.is_empty() {
        String::new()
    } else {
        format!("\n    cdi.kubevirt.io/storage.import.source: {source}")
    };
    format!(
        r#"
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: {name}
  namespace: default
  annotations:
    cdi.kubevirt.io/storage.import.endpoint: "{url}"{source}
    ferrovirt.io/checksum: "{checksum}"
spec:
  storageClassName: shared
  accessModes: [ReadWriteMany]
  resources: {{requests: {{storage: 64Mi}}}}
"#
    )
}

fn wait_pod_phase(c: &Cluster, claim: &str, phase: &str) -> anyhow::Result<Value> {
    c.wait_until(
        &format!("claim {claim} storage.pod.phase {phase}"),
        IMPORT,
        || {
            let v = c.get_json(&["pvc", claim, "-n", "default"])?;
            let p = v["metadata"]["annotations"]["cdi.kubevirt.io/storage.pod.phase"].as_str();
            Ok((p == Some(phase)).then_some(v))
        },
    )
}

#[test]
fn imported_cloned_and_templated_datavolumes_boot() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let c = cluster()?;
    // The template's import is zstd-compressed (decoded in process by the importer).
    let zst = c.dir.path().join("disk.qcow2.zst");
    let packed = std::process::Command::new("zstd")
        .args(["-q", "-f"])
        .arg(&guest.disk_qcow2)
        .arg("-o")
        .arg(&zst)
        .status()?;
    anyhow::ensure!(packed.success(), "zstd failed");
    let base = serve_files(vec![
        ("disk.qcow2".into(), guest.disk_qcow2.clone()),
        ("disk.qcow2.zst".into(), zst),
    ])?;
    let url = format!("{base}/disk.qcow2");
    let sum = format!("sha256:{}", sha256(&guest.disk_qcow2)?);

    // Import with a checksum into the shared class.
    c.apply(&dv_manifest_sum(
        "imported",
        &http_source(&url),
        &storage(Some("shared"), Some("64Mi")),
        Some(&sum),
    ))?;
    let v = wait_dv_phase(&c, "imported", "Succeeded", IMPORT)?;
    assert_eq!(v["status"]["progress"], "100.0%", "{v}");
    assert_eq!(condition(&v, "Ready")["status"], "True", "{v}");
    assert_eq!(condition(&v, "Bound")["status"], "True", "{v}");
    let pv = pv_of(&c, "imported")?;
    let dir = PathBuf::from(
        pv["spec"]["hostPath"]["path"]
            .as_str()
            .context("hostPath")?,
    );
    assert!(
        dir.starts_with(c.data_dir.join("volumes")),
        "{}",
        dir.display()
    );
    assert_eq!(std::fs::metadata(dir.join("disk.img"))?.len(), 64 << 20);
    assert_eq!(pv["spec"]["accessModes"][0], "ReadWriteMany");

    // Its claim reports as CDI's importer does.
    let claim = c.get_json(&["pvc", "imported", "-n", "default"])?;
    let ann = &claim["metadata"]["annotations"];
    assert_eq!(
        ann["cdi.kubevirt.io/storage.pod.phase"], "Succeeded",
        "{claim}"
    );
    assert_eq!(
        ann["cdi.kubevirt.io/storage.condition.running.reason"], "Completed",
        "{claim}"
    );

    c.apply(&vm_manifest("from-import", "imported", ""))?;
    c.wait_booted("from-import", BOOT)?;
    delete_vm(&c, "from-import")?;

    // CDI's annotated claims (no DataVolume), as kcli makes them: imported into, with
    // the status annotations it waits on; a VM boots from one. One asking for a source we
    // do not have fails, naming the annotation.
    c.apply(&annotated_claim("annotated", &url, "", &sum))?;
    c.apply(&annotated_claim(
        "annotated-s3",
        "s3://bucket/disk",
        "s3",
        &sum,
    ))?;
    let claim = wait_pod_phase(&c, "annotated", "Succeeded")?;
    let ann = &claim["metadata"]["annotations"];
    assert_eq!(
        ann["cdi.kubevirt.io/storage.condition.running.reason"], "Completed",
        "{claim}"
    );
    assert_eq!(
        ann["cdi.kubevirt.io/storage.condition.running"], "false",
        "{claim}"
    );
    let bad = wait_pod_phase(&c, "annotated-s3", "Failed")?;
    let message =
        bad["metadata"]["annotations"]["cdi.kubevirt.io/storage.condition.running.message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
    assert!(
        message.starts_with("annotation cdi.kubevirt.io/storage.import.source"),
        "{bad}"
    );
    let events = c.kubectl_ok(&[
        "get",
        "events",
        "-n",
        "default",
        "--field-selector",
        "involvedObject.name=annotated-s3",
    ])?;
    assert!(events.contains("ErrInvalidSource"), "{events}");
    c.apply(&vm_manifest("from-annotated", "annotated", "").replace(
        "dataVolume: {name: annotated}",
        "persistentVolumeClaim: {claimName: annotated}",
    ))?;
    c.wait_booted("from-annotated", BOOT)?;
    delete_vm(&c, "from-annotated")?;

    // Clone the imported volume (size taken from the source).
    c.apply(&dv_manifest(
        "cloned",
        "    pvc: {namespace: default, name: imported}\n",
        &storage(Some("shared"), None),
    ))?;
    let v = wait_dv_phase(&c, "cloned", "Succeeded", IMPORT)?;
    assert_eq!(v["status"]["progress"], "100.0%", "{v}");
    c.apply(&vm_manifest("from-clone", "cloned", ""))?;
    c.wait_booted("from-clone", BOOT)?;
    delete_vm(&c, "from-clone")?;

    // dataVolumeTemplates: the VM creates (and owns) its DataVolume in the default class,
    // importing the zstd-compressed image.
    let templates = format!(
        "  dataVolumeTemplates:\n  - metadata: {{name: templated-root}}\n    spec:\n      source:\n        http: {{url: \"{url}.zst\"}}\n      storage:\n        resources: {{requests: {{storage: 64Mi}}}}\n"
    );
    c.apply(&vm_manifest("templated", "templated-root", &templates))?;
    c.wait_booted("templated", BOOT)?;
    let v = dv(&c, "templated-root")?;
    assert_eq!(v["status"]["phase"], "Succeeded", "{v}");
    assert_eq!(
        v["metadata"]["ownerReferences"][0]["kind"], "VirtualMachine",
        "{v}"
    );
    let pv = pv_of(&c, "templated-root")?;
    assert_eq!(pv["spec"]["storageClassName"], "local", "{pv}");
    assert!(pv["spec"]["local"]["path"].is_string(), "{pv}");
    let term = &pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0];
    assert_eq!(term["matchExpressions"][0]["values"][0], "node1", "{pv}");
    Ok(())
}

#[test]
fn classes_claims_failures_blank_and_reclaim() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let c = cluster()?;
    // The template's import is zstd-compressed (decoded in process by the importer).
    let zst = c.dir.path().join("disk.qcow2.zst");
    let packed = std::process::Command::new("zstd")
        .args(["-q", "-f"])
        .arg(&guest.disk_qcow2)
        .arg("-o")
        .arg(&zst)
        .status()?;
    anyhow::ensure!(packed.success(), "zstd failed");
    let base = serve_files(vec![
        ("disk.qcow2".into(), guest.disk_qcow2.clone()),
        ("disk.qcow2.zst".into(), zst),
    ])?;
    let url = format!("{base}/disk.qcow2");

    // Built-in classes and their profiles.
    let sc = c.wait_until("StorageClass local", Duration::from_secs(30), || {
        Ok(c.get_json(&["storageclass", "local"]).ok())
    })?;
    assert_eq!(
        sc["metadata"]["annotations"]["storageclass.kubernetes.io/is-default-class"],
        "true"
    );
    assert_eq!(sc["volumeBindingMode"], "WaitForFirstConsumer");
    let shared = c.get_json(&["storageclass", "shared"])?;
    assert_eq!(shared["volumeBindingMode"], "Immediate");
    let profile = c.wait_until("StorageProfile shared", Duration::from_secs(30), || {
        let p = c.get_json(&["storageprofile", "shared"])?;
        Ok(p["status"]["claimPropertySets"].is_array().then_some(p))
    })?;
    assert_eq!(
        profile["status"]["claimPropertySets"][0]["accessModes"][0],
        "ReadWriteMany"
    );

    // A bad checksum fails the DataVolume with the reason in its conditions.
    let bad = format!("sha256:{}", "0".repeat(64));
    c.apply(&dv_manifest_sum(
        "bad-sum",
        &http_source(&url),
        &storage(Some("shared"), Some("64Mi")),
        Some(&bad),
    ))?;
    let v = wait_dv_phase(&c, "bad-sum", "Failed", IMPORT)?;
    let msg = condition(&v, "Running")["message"]
        .as_str()
        .unwrap_or_default();
    assert!(msg.contains("checksum mismatch"), "{v}");

    // An image larger than its claim is refused.
    c.apply(&dv_manifest(
        "too-small",
        &http_source(&url),
        &storage(Some("shared"), Some("16Mi")),
    ))?;
    let v = wait_dv_phase(&c, "too-small", "Failed", IMPORT)?;
    let msg = condition(&v, "Running")["message"]
        .as_str()
        .unwrap_or_default();
    assert!(msg.contains("larger"), "{v}");

    // Blank: an empty volume of the claim's size.
    c.apply(&dv_manifest(
        "blank",
        "    blank: {}\n",
        &storage(Some("shared"), Some("32Mi")),
    ))?;
    let v = wait_dv_phase(&c, "blank", "Succeeded", IMPORT)?;
    assert_eq!(v["status"]["progress"], "100.0%");
    let pv = pv_of(&c, "blank")?;
    let pv_name = pv["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let dir = PathBuf::from(
        pv["spec"]["hostPath"]["path"]
            .as_str()
            .context("hostPath")?,
    );
    assert_eq!(std::fs::metadata(dir.join("disk.img"))?.len(), 32 << 20);

    // Deleting the DataVolume removes its claim (owner), then the volume and its data.
    c.kubectl_ok(&[
        "delete",
        "datavolume",
        "blank",
        "-n",
        "default",
        "--wait=false",
    ])?;
    c.wait_until("blank volume reclaimed", Duration::from_secs(60), || {
        let gone = !c.kubectl(&["get", "pv", &pv_name])?.status.success();
        Ok((gone && !dir.exists()).then_some(()))
    })?;

    // Plain claims: shared binds at once, local waits for a consumer.
    c.apply(
        r#"
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: plain-shared, namespace: default}
spec:
  storageClassName: shared
  accessModes: [ReadWriteMany]
  resources: {requests: {storage: 8Mi}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: plain-local, namespace: default}
spec:
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 8Mi}}
"#,
    )?;
    c.wait_until("plain-shared Bound", Duration::from_secs(30), || {
        let p = c.get_json(&["pvc", "plain-shared", "-n", "default"])?;
        Ok((p["status"]["phase"] == "Bound").then_some(()))
    })?;
    let pv = pv_of(&c, "plain-shared")?;
    assert_eq!(pv["status"]["phase"], "Bound");
    assert_eq!(pv["spec"]["claimRef"]["name"], "plain-shared");
    c.wait_until("plain-local Pending", Duration::from_secs(30), || {
        let p = c.get_json(&["pvc", "plain-local", "-n", "default"])?;
        Ok((p["status"]["phase"] == "Pending").then_some(()))
    })?;
    std::thread::sleep(Duration::from_secs(2));
    let p = c.get_json(&["pvc", "plain-local", "-n", "default"])?;
    assert!(p["spec"]["volumeName"].is_null(), "{p}");

    // Its first consumer's node binds it: a VMI scheduled to node1 using the claim.
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: consumer, namespace: default}
spec:
  domain:
    memory: {guest: 64Mi}
    devices:
      disks:
      - name: data
        disk: {bus: virtio}
  volumes:
  - name: data
    persistentVolumeClaim: {claimName: plain-local}
"#,
    )?;
    c.wait_until("plain-local Bound", Duration::from_secs(60), || {
        let p = c.get_json(&["pvc", "plain-local", "-n", "default"])?;
        Ok((p["status"]["phase"] == "Bound").then_some(()))
    })?;
    let p = c.get_json(&["pvc", "plain-local", "-n", "default"])?;
    assert_eq!(
        p["metadata"]["annotations"]["volume.kubernetes.io/selected-node"],
        "node1"
    );
    let pv = pv_of(&c, "plain-local")?;
    let term = &pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0];
    assert_eq!(term["matchExpressions"][0]["values"][0], "node1", "{pv}");
    c.kubectl_ok(&["delete", "vmi", "consumer", "-n", "default", "--wait=false"])?;

    // Transfer errors are retried with backoff, then fail with the server's answer.
    c.apply(&dv_manifest(
        "missing",
        &http_source(&format!("{base}/nope.img")),
        &storage(Some("shared"), Some("16Mi")),
    ))?;
    let v = wait_dv_phase(&c, "missing", "Failed", IMPORT)?;
    assert_eq!(v["status"]["restartCount"], 4, "{v}");
    let msg = condition(&v, "Running")["message"]
        .as_str()
        .unwrap_or_default();
    assert!(msg.contains("404"), "{v}");
    Ok(())
}

/// Loop devices backed by `file` (`losetup -j`).
fn loop_devices(file: &Path) -> anyhow::Result<Vec<String>> {
    let out = Command::new("losetup").arg("-j").arg(file).output()?;
    anyhow::ensure!(out.status.success(), "losetup -j failed");
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once(':').map(|(d, _)| d.to_string()))
        .collect())
}

fn volume_dir_of(pv: &Value) -> anyhow::Result<PathBuf> {
    pv["spec"]["hostPath"]["path"]
        .as_str()
        .or_else(|| pv["spec"]["local"]["path"].as_str())
        .map(PathBuf::from)
        .context("PV has no path")
}

fn claim_capacity(c: &Cluster, claim: &str) -> anyhow::Result<String> {
    let p = c.get_json(&["pvc", claim, "-n", "default"])?;
    Ok(p["status"]["capacity"]["storage"]
        .as_str()
        .unwrap_or_default()
        .to_string())
}

#[test]
fn datasource_clones_and_block_volumes_boot() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let c = cluster()?;
    // The template's import is zstd-compressed (decoded in process by the importer).
    let zst = c.dir.path().join("disk.qcow2.zst");
    let packed = std::process::Command::new("zstd")
        .args(["-q", "-f"])
        .arg(&guest.disk_qcow2)
        .arg("-o")
        .arg(&zst)
        .status()?;
    anyhow::ensure!(packed.success(), "zstd failed");
    let base = serve_files(vec![
        ("disk.qcow2".into(), guest.disk_qcow2.clone()),
        ("disk.qcow2.zst".into(), zst),
    ])?;
    let url = format!("{base}/disk.qcow2");

    // A DataVolume whose DataSource does not exist yet waits with a clear condition.
    c.apply(
        r#"
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {name: from-ds, namespace: default}
spec:
  sourceRef: {kind: DataSource, name: golden}
  storage: {storageClassName: shared}
"#,
    )?;
    c.wait_until("from-ds waits for its DataSource", IMPORT, || {
        let v = dv(&c, "from-ds")?;
        let m = condition(&v, "Bound")["message"]
            .as_str()
            .unwrap_or_default();
        Ok(
            (v["status"]["phase"] == "Pending"
                && m.contains("DataSource default/golden not found"))
            .then_some(()),
        )
    })?;

    // The DataSource exists before its PVC: Ready=False, NotFound.
    c.apply(
        r#"
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataSource
metadata: {name: golden, namespace: default}
spec:
  source:
    pvc: {name: golden-disk, namespace: default}
"#,
    )?;
    c.wait_until("DataSource NotFound", IMPORT, || {
        let d = c.get_json(&["datasource", "golden", "-n", "default"])?;
        let r = condition(&d, "Ready");
        Ok((r["status"] == "False" && r["reason"] == "NotFound").then_some(()))
    })?;

    // The golden image is imported; the DataSource becomes Ready and the clone proceeds.
    c.apply(&dv_manifest(
        "golden-disk",
        &http_source(&url),
        &storage(Some("shared"), Some("64Mi")),
    ))?;
    wait_dv_phase(&c, "golden-disk", "Succeeded", IMPORT)?;
    c.wait_until("DataSource Ready", IMPORT, || {
        let d = c.get_json(&["datasource", "golden", "-n", "default"])?;
        let r = condition(&d, "Ready");
        Ok((r["status"] == "True" && r["reason"] == "Ready").then_some(()))
    })?;
    let v = wait_dv_phase(&c, "from-ds", "Succeeded", IMPORT)?;
    assert_eq!(v["status"]["progress"], "100.0%", "{v}");
    assert_eq!(
        c.get_json(&["pvc", "from-ds", "-n", "default"])?["spec"]["resources"]["requests"]["storage"],
        "64Mi"
    );

    // A VM whose dataVolumeTemplate clones the DataSource into a Block volume boots from the
    // loop device.
    let templates = "  dataVolumeTemplates:\n  - metadata: {name: block-root}\n    spec:\n      sourceRef: {kind: DataSource, name: golden}\n      storage:\n        volumeMode: Block\n        resources: {requests: {storage: 64Mi}}\n";
    c.apply(&vm_manifest("block-vm", "block-root", templates))?;
    let uid = c.wait_booted("block-vm", BOOT)?;
    let pv = pv_of(&c, "block-root")?;
    assert_eq!(pv["spec"]["volumeMode"], "Block", "{pv}");
    let img = volume_dir_of(&pv)?.join("disk.img");
    let devs = loop_devices(&img)?;
    assert_eq!(devs.len(), 1, "{devs:?}");
    let spec = std::fs::read_to_string(c.agent_dir().join("vmis").join(&uid).join("spec.json"))?;
    assert!(
        spec.contains(&devs[0]),
        "launch spec does not use {}: {spec}",
        devs[0]
    );

    // Deleting the VM deletes its DataVolume, claim and volume, and detaches the device.
    delete_vm(&c, "block-vm")?;
    c.wait_until("block volume reclaimed", Duration::from_secs(90), || {
        let gone = !img.exists();
        let attached = loop_devices(&img).map(|d| !d.is_empty()).unwrap_or(false);
        let listed = String::from_utf8_lossy(&Command::new("losetup").arg("-a").output()?.stdout)
            .contains(&img.display().to_string());
        Ok((gone && !attached && !listed).then_some(()))
    })?;
    Ok(())
}

#[test]
fn claims_expand_and_never_shrink() -> anyhow::Result<()> {
    let c = cluster()?;
    c.apply(
        r#"
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: grow-fs, namespace: default}
spec:
  storageClassName: shared
  accessModes: [ReadWriteMany]
  resources: {requests: {storage: 8Mi}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: grow-block, namespace: default}
spec:
  storageClassName: shared
  volumeMode: Block
  accessModes: [ReadWriteMany]
  resources: {requests: {storage: 8Mi}}
"#,
    )?;
    for claim in ["grow-fs", "grow-block"] {
        c.wait_until(&format!("{claim} Bound"), Duration::from_secs(30), || {
            Ok((claim_capacity(&c, claim)? == "8Mi").then_some(()))
        })?;
    }
    let sc = c.get_json(&["storageclass", "shared"])?;
    assert_eq!(sc["allowVolumeExpansion"], true);
    let profile = c.get_json(&["storageprofile", "shared"])?;
    let modes: Vec<&str> = profile["status"]["claimPropertySets"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["volumeMode"].as_str())
        .collect();
    assert_eq!(modes, ["Filesystem", "Block"], "{profile}");
    let fs_img = volume_dir_of(&pv_of(&c, "grow-fs")?)?.join("disk.img");
    let block_pv = pv_of(&c, "grow-block")?;
    assert_eq!(block_pv["spec"]["volumeMode"], "Block");
    let block_img = volume_dir_of(&block_pv)?.join("disk.img");
    let dev = loop_devices(&block_img)?
        .into_iter()
        .next()
        .context("no loop device for the Block claim")?;
    let dev_size = |dev: &str| -> anyhow::Result<u64> {
        let name = Path::new(dev).file_name().context("device name")?;
        let sectors =
            std::fs::read_to_string(Path::new("/sys/class/block").join(name).join("size"))?;
        Ok(sectors.trim().parse::<u64>()? * 512)
    };
    assert_eq!(dev_size(&dev)?, 8 << 20);

    for claim in ["grow-fs", "grow-block"] {
        c.kubectl_ok(&[
            "patch",
            "pvc",
            claim,
            "-n",
            "default",
            "--type",
            "merge",
            "-p",
            r#"{"spec":{"resources":{"requests":{"storage":"24Mi"}}}}"#,
        ])?;
    }
    for claim in ["grow-fs", "grow-block"] {
        c.wait_until(
            &format!("{claim} expanded"),
            Duration::from_secs(30),
            || Ok((claim_capacity(&c, claim)? == "24Mi").then_some(())),
        )?;
        assert_eq!(pv_of(&c, claim)?["spec"]["capacity"]["storage"], "24Mi");
    }
    assert_eq!(std::fs::metadata(&fs_img)?.len(), 24 << 20);
    assert_eq!(std::fs::metadata(&block_img)?.len(), 24 << 20);
    assert_eq!(
        dev_size(&dev)?,
        24 << 20,
        "loop device capacity not refreshed"
    );

    // A loop device that went away (a reboot) is attached again by the controller.
    let out = Command::new("losetup").arg("-d").arg(&dev).output()?;
    anyhow::ensure!(out.status.success(), "losetup -d {dev} failed");
    let again = c.wait_until("Block volume re-attached", Duration::from_secs(30), || {
        Ok(loop_devices(&block_img)?.into_iter().next())
    })?;
    assert_eq!(dev_size(&again)?, 24 << 20);

    // Shrinking is refused by admission, naming the field.
    let out = c.kubectl(&[
        "patch",
        "pvc",
        "grow-fs",
        "-n",
        "default",
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"resources":{"requests":{"storage":"4Mi"}}}}"#,
    ])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "shrink accepted");
    assert!(
        err.contains("spec.resources.requests.storage") && err.contains("less than"),
        "{err}"
    );

    // Deleting the Block claim detaches its loop device.
    c.kubectl_ok(&[
        "delete",
        "pvc",
        "grow-block",
        "-n",
        "default",
        "--wait=false",
    ])?;
    c.wait_until("grow-block detached", Duration::from_secs(60), || {
        let listed = String::from_utf8_lossy(&Command::new("losetup").arg("-a").output()?.stdout)
            .contains(&block_img.display().to_string());
        Ok((!listed && !block_img.exists()).then_some(()))
    })?;
    Ok(())
}

/// Storage in use is protected (Kubernetes' pvc- and pv-protection finalizers): the claim of a
/// running VM, deleted, stays Terminating while the guest keeps reading its disk; stopping the
/// VM lets the claim go; its volume (Retain) is then Released and, deleted, goes as nothing
/// binds it any more.
#[test]
fn a_claim_in_use_stays_until_its_vm_stops() -> anyhow::Result<()> {
    let c = cluster()?;
    c.guest_disk_claim("held")?;
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: holder, namespace: default}
spec:
  runStrategy: Always
  template:
    spec:
      domain:
        memory: {guest: 128Mi}
        devices:
          disks:
          - name: root
            disk: {bus: virtio}
      volumes:
      - name: root
        persistentVolumeClaim: {claimName: held}
"#,
    )?;
    let uid = c.wait_booted("holder", BOOT)?;
    let fins = |v: &Value| v["metadata"]["finalizers"].to_string();
    let pvc = c.get_json(&["pvc", "held", "-n", "default"])?;
    assert!(fins(&pvc).contains("kubernetes.io/pvc-protection"), "{pvc}");
    let pv = c.get_json(&["pv", "pv-held"])?;
    assert!(fins(&pv).contains("kubernetes.io/pv-protection"), "{pv}");

    c.kubectl_ok(&["delete", "pvc", "held", "-n", "default", "--wait=false"])?;
    let dir = c.agent_dir().join("vmis").join(&uid);
    c.wait_until("guest shell ready", BOOT, || {
        let log = std::fs::read(dir.join("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    std::thread::sleep(Duration::from_secs(2));
    let pvc = c.get_json(&["pvc", "held", "-n", "default"])?;
    assert!(pvc["metadata"]["deletionTimestamp"].is_string(), "{pvc}");
    assert_eq!(pvc["status"]["phase"], "Bound", "{pvc}");
    // The guest still reads its disk, past anything it read while booting.
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    let (out, rc) = console.exec(
        "dd if=/dev/vda bs=4096 count=4 skip=3000 2>/dev/null | wc -c",
        Duration::from_secs(30),
    )?;
    assert_eq!(rc, 0, "{out}");
    assert!(out.lines().any(|l| l.trim() == "16384"), "{out}");
    let pvc = c.get_json(&["pvc", "held", "-n", "default"])?;
    assert!(fins(&pvc).contains("kubernetes.io/pvc-protection"), "{pvc}");
    // A new VMI on the Terminating claim is not scheduled; the reason names the claim.
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: latecomer, namespace: default}
spec:
  domain:
    memory: {guest: 128Mi}
    devices:
      disks:
      - {name: root, disk: {bus: virtio}}
  volumes:
  - name: root
    persistentVolumeClaim: {claimName: held}
"#,
    )?;
    let late = c.wait_until("latecomer unschedulable", Duration::from_secs(30), || {
        let v = c.get_json(&["vmi", "latecomer", "-n", "default"])?;
        let text = v["status"]["conditions"].to_string();
        Ok(text
            .contains("persistentvolumeclaim \\\"held\\\" is being deleted")
            .then_some(v))
    })?;
    assert!(late["status"]["nodeName"].is_null(), "{late}");
    c.kubectl_ok(&["delete", "vmi", "latecomer", "-n", "default"])?;

    // Stopped, the VM no longer uses it: the claim goes, the volume is Released.
    c.halt_vm("holder", BOOT)?;
    c.wait_gone("pvc", "held", Duration::from_secs(30))?;
    let pv = c.wait_until("volume released", Duration::from_secs(30), || {
        let pv = c.get_json(&["pv", "pv-held"])?;
        Ok((pv["status"]["phase"] == "Released").then_some(pv))
    })?;
    assert!(fins(&pv).contains("kubernetes.io/pv-protection"), "{pv}");
    c.kubectl_ok(&["delete", "pv", "pv-held", "--wait=false"])?;
    c.wait_gone("pv", "pv-held", Duration::from_secs(30))?;
    Ok(())
}
