//! End-to-end OCI registry support through the real server, against Debian's
//! `docker-registry` on 127.0.0.1 (`ferrovirt_testkit::Registry`, images pushed with its own
//! pusher): a DataVolume with a `registry` source imports the test guest's qcow2 from a
//! containerDisk image and a VM boots from it; a VMI with a `containerDisk` volume boots from
//! the node's image cache through an ephemeral overlay that goes with the VMI while the cache
//! stays; wrong registry credentials and a disk with a backing file fail with clear messages; a
//! private containerDisk cached for one namespace is not served to another without credentials.
//! The registries are plain HTTP, listed as insecure in the HyperConverged object.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ferrovirt_testkit::{Cluster, ClusterOptions, Registry, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(180);
const IMPORT: Duration = Duration::from_secs(120);

fn cluster() -> anyhow::Result<Cluster> {
    TestGuest::get()?;
    Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))
}

/// The HyperConverged object listing `registries` as insecure (plain HTTP).
fn insecure(c: &Cluster, registries: &[&str]) -> anyhow::Result<()> {
    let list = registries
        .iter()
        .map(|r| format!("\"{r}\""))
        .collect::<Vec<_>>()
        .join(", ");
    c.apply(&format!(
        r#"
apiVersion: v1
kind: Namespace
metadata: {{name: kubevirt-hyperconverged}}
---
apiVersion: hco.kubevirt.io/v1beta1
kind: HyperConverged
metadata: {{name: kubevirt-hyperconverged, namespace: kubevirt-hyperconverged}}
spec:
  storageImport:
    insecureRegistries: [{list}]
"#
    ))?;
    Ok(())
}

fn registry_dv(name: &str, url: &str, secret: Option<&str>, size: &str) -> String {
    let secret = secret
        .map(|s| format!("\n      secretRef: {s}"))
        .unwrap_or_default();
    format!(
        r#"
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: {name}, namespace: default}}
spec:
  source:
    registry:
      url: "{url}"{secret}
  storage:
    storageClassName: shared
    resources: {{requests: {{storage: {size}}}}}
"#
    )
}

fn wait_dv_phase(c: &Cluster, name: &str, phase: &str) -> anyhow::Result<Value> {
    c.wait_until(&format!("DataVolume {name} {phase}"), IMPORT, || {
        let v = c.get_json(&["datavolume", name, "-n", "default"])?;
        let p = v["status"]["phase"].as_str().unwrap_or_default();
        if phase != "Failed" && p == "Failed" {
            anyhow::bail!("DataVolume {name} failed: {}", v["status"]);
        }
        Ok((p == phase).then_some(v))
    })
}

fn condition_message(v: &Value, type_: &str) -> String {
    v["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_string()
}

fn vmi_manifest(name: &str, volume: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: {name}, namespace: default}}
spec:
  domain:
    memory: {{guest: 128Mi}}
    devices:
      disks:
      - name: root
        disk: {{bus: virtio}}
  volumes:
  - name: root
{volume}
"#
    )
}

/// The cached disks of the embedded agent (`containerdisks/sha256/<hex>/disk`).
fn cached_disks(c: &Cluster) -> Vec<PathBuf> {
    let root = c.agent_dir().join("containerdisks").join("sha256");
    std::fs::read_dir(root)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path().join("disk"))
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default()
}

/// A qcow2 whose backing file is a host file.
fn qcow2_with_backing(dir: &Path) -> anyhow::Result<PathBuf> {
    let p = dir.join("evil.qcow2");
    let st = std::process::Command::new("qemu-img")
        .args([
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "raw",
            "-b",
            "/etc/hostname",
        ])
        .arg(&p)
        .arg("16M")
        .status()?;
    anyhow::ensure!(st.success(), "qemu-img create failed");
    Ok(p)
}

#[test]
fn registry_datavolume_and_container_disk_boot() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let reg = Registry::start()?;
    let t = Instant::now();
    let digest = reg.push_disk("fv/guest", "v1", &guest.disk_qcow2, "guest.qcow2", true)?;
    eprintln!("pushed the guest image ({digest}) in {:?}", t.elapsed());
    let c = cluster()?;
    insecure(&c, &[&reg.addr])?;

    // (1) A DataVolume imports the image's /disk/ file; a VM boots from the volume.
    let t = Instant::now();
    c.apply(&registry_dv(
        "from-registry",
        &format!("docker://{}/fv/guest:v1", reg.addr),
        None,
        "64Mi",
    ))?;
    let v = wait_dv_phase(&c, "from-registry", "Succeeded")?;
    eprintln!("registry import took {:?}", t.elapsed());
    assert_eq!(v["status"]["progress"], "100.0%", "{v}");
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: dv-vm, namespace: default}
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
        dataVolume: {name: from-registry}
"#,
    )?;
    let t = Instant::now();
    c.wait_booted("dv-vm", BOOT)?;
    eprintln!("VM on the imported volume booted in {:?}", t.elapsed());
    c.kubectl_ok(&["delete", "vm", "dv-vm", "-n", "default", "--wait=false"])?;
    c.wait_gone("vmi", "dv-vm", BOOT)?;

    // (2) A containerDisk VMI: pulled into the node cache, booted from an overlay.
    let t = Instant::now();
    c.apply(&vmi_manifest(
        "cd-vmi",
        &format!(
            "    containerDisk: {{image: \"{}/fv/guest:v1\", imagePullPolicy: IfNotPresent}}",
            reg.addr
        ),
    ))?;
    let uid = c.wait_booted("cd-vmi", BOOT)?;
    eprintln!("containerDisk VMI booted in {:?}", t.elapsed());
    let overlay = c
        .agent_dir()
        .join("vmis")
        .join(&uid)
        .join("containerdisk-root.qcow2");
    assert!(overlay.is_file(), "{} missing", overlay.display());
    let cached = cached_disks(&c);
    assert_eq!(cached.len(), 1, "{cached:?}");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&cached[0])?.permissions().mode() & 0o222,
        0,
        "the cached base is read-only"
    );
    let info = std::process::Command::new("qemu-img")
        .args(["info", "--output=json", "-U"])
        .arg(&overlay)
        .output()?;
    let info: Value = serde_json::from_slice(&info.stdout)?;
    assert_eq!(
        info["full-backing-filename"].as_str().map(PathBuf::from),
        Some(cached[0].clone()),
        "{info}"
    );
    c.kubectl_ok(&["delete", "vmi", "cd-vmi", "-n", "default", "--wait=false"])?;
    c.wait_gone("vmi", "cd-vmi", BOOT)?;
    c.wait_until("overlay removed", Duration::from_secs(30), || {
        Ok((!overlay.exists()).then_some(()))
    })?;
    assert_eq!(cached_disks(&c), cached, "the cache stays");
    Ok(())
}

#[test]
fn registry_credentials_and_refused_images() -> anyhow::Result<()> {
    let private = Registry::start_with_auth("fv", "right-password")?;
    let public = Registry::start()?;
    let c = cluster()?;
    let dir = c.dir.path();
    // A small qcow2 (no need for the guest here) and one with a backing file.
    let small = dir.join("small.qcow2");
    let st = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&small)
        .arg("8M")
        .status()?;
    anyhow::ensure!(st.success());
    private.push_disk("fv/small", "v1", &small, "small.qcow2", false)?;
    public.push_disk(
        "fv/evil",
        "v1",
        &qcow2_with_backing(dir)?,
        "evil.qcow2",
        false,
    )?;
    insecure(&c, &[&private.addr, &public.addr])?;
    c.apply(
        r#"
apiVersion: v1
kind: Secret
metadata: {name: wrong-creds, namespace: default}
stringData: {accessKeyId: fv, secretKey: wrong-password}
---
apiVersion: v1
kind: Secret
metadata: {name: right-creds, namespace: default}
stringData: {accessKeyId: fv, secretKey: right-password}
"#,
    )?;

    // (3) Wrong credentials fail the DataVolume at once, saying so; right ones import.
    let url = format!("docker://{}/fv/small:v1", private.addr);
    c.apply(&registry_dv(
        "wrong-creds",
        &url,
        Some("wrong-creds"),
        "16Mi",
    ))?;
    c.apply(&registry_dv(
        "right-creds",
        &url,
        Some("right-creds"),
        "16Mi",
    ))?;
    let v = wait_dv_phase(&c, "wrong-creds", "Failed")?;
    let msg = condition_message(&v, "Running");
    assert!(
        msg.contains("authentication as \"fv\" failed") && msg.contains("fv/small"),
        "{v}"
    );
    assert_eq!(v["status"]["restartCount"], 1, "not retried: {v}");
    wait_dv_phase(&c, "right-creds", "Succeeded")?;

    // (3b) A private containerDisk pulled with one namespace's pull secret is not served from
    // the node's cache to another namespace without credentials (nor under Never); with
    // credentials of its own the registry is asked and the cached copy used.
    c.kubectl_ok(&["create", "namespace", "other"])?;
    for ns in ["default", "other"] {
        c.kubectl_ok(&[
            "-n",
            ns,
            "create",
            "secret",
            "docker-registry",
            "pull",
            &format!("--docker-server={}", private.addr),
            "--docker-username=fv",
            "--docker-password=right-password",
        ])?;
    }
    let image = format!("{}/fv/small:v1", private.addr);
    let private_vmi = |name: &str, ns: &str, extra: &str| {
        vmi_manifest(
            name,
            &format!("    containerDisk: {{image: \"{image}\", imagePullPolicy: {extra}}}"),
        )
        .replace("namespace: default", &format!("namespace: {ns}"))
    };
    let phase_of = |name: &str, ns: &str| {
        c.wait_until(&format!("VMI {ns}/{name} Running or Failed"), BOOT, || {
            let v = c.get_json(&["vmi", name, "-n", ns])?;
            let p = v["status"]["phase"].as_str().unwrap_or("").to_string();
            Ok(matches!(p.as_str(), "Running" | "Failed").then_some(v))
        })
    };
    c.apply(&private_vmi(
        "priv-a",
        "default",
        "IfNotPresent, imagePullSecret: pull",
    ))?;
    let v = phase_of("priv-a", "default")?;
    assert_eq!(v["status"]["phase"], "Running", "{v}");
    let cached = cached_disks(&c);
    c.apply(&private_vmi("priv-b", "other", "IfNotPresent"))?;
    let v = phase_of("priv-b", "other")?;
    assert_eq!(
        v["status"]["phase"], "Failed",
        "served from the cache without credentials: {v}"
    );
    assert_eq!(v["status"]["reason"], "ErrImagePull", "{v}");
    c.apply(&private_vmi("priv-c", "other", "Never"))?;
    let v = phase_of("priv-c", "other")?;
    assert_eq!(v["status"]["phase"], "Failed", "{v}");
    assert!(
        condition_message(&v, "Ready").contains("pulled with other credentials"),
        "{v}"
    );
    c.apply(&private_vmi(
        "priv-d",
        "other",
        "IfNotPresent, imagePullSecret: pull",
    ))?;
    let v = phase_of("priv-d", "other")?;
    assert_eq!(v["status"]["phase"], "Running", "{v}");
    assert_eq!(cached_disks(&c), cached, "verified, not pulled again");

    // (4) A disk with a backing file is refused, as a DataVolume and as a containerDisk.
    let evil = format!("{}/fv/evil:v1", public.addr);
    c.apply(&registry_dv(
        "evil",
        &format!("docker://{evil}"),
        None,
        "64Mi",
    ))?;
    let v = wait_dv_phase(&c, "evil", "Failed")?;
    assert!(
        condition_message(&v, "Running").contains("backing file"),
        "{v}"
    );

    c.apply(&vmi_manifest(
        "evil-vmi",
        &format!("    containerDisk: {{image: \"{evil}\"}}"),
    ))?;
    c.apply(&vmi_manifest(
        "missing-vmi",
        &format!(
            "    containerDisk: {{image: \"{}/fv/missing:v1\"}}",
            public.addr
        ),
    ))?;
    for (name, needle) in [
        ("evil-vmi", "backing file"),
        ("missing-vmi", "MANIFEST_UNKNOWN"),
    ] {
        let v = c.wait_until(&format!("VMI {name} Failed"), BOOT, || {
            let v = c.get_json(&["vmi", name, "-n", "default"])?;
            Ok((v["status"]["phase"] == "Failed").then_some(v))
        })?;
        assert_eq!(v["status"]["reason"], "ErrImagePull", "{v}");
        let msg = condition_message(&v, "Ready");
        assert!(msg.contains(&public.addr) && msg.contains(needle), "{v}");
        let events = c.kubectl_ok(&[
            "get",
            "events",
            "-n",
            "default",
            "--field-selector",
            &format!("involvedObject.name={name},reason=ErrImagePull"),
            "-o",
            "json",
        ])?;
        let events: Value = serde_json::from_str(&events)?;
        assert!(
            events["items"].as_array().is_some_and(|i| !i.is_empty()),
            "no ErrImagePull event for {name}: {events}"
        );
    }
    // Only the private image of (3b) is cached: the refused ones are not.
    assert_eq!(cached_disks(&c), cached, "refused images are not cached");
    Ok(())
}
