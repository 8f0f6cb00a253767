//! End-to-end VirtualMachinePool, VirtualMachineInstancePreset and UploadTokenRequest through
//! the real server with kubectl: a pool of 2 running VMs booted from a containerDisk (the test
//! guest pushed to Debian's `docker-registry` on loopback) scales to 3 and back to 1 with
//! `kubectl scale` (the `/scale` subresource), keeps `<pool>-<index>` names, re-creates a
//! deleted VM, and takes its VMs with it when deleted (ownerReference GC). A preset's memory
//! and CPU land in a new VMI that its selector matches (and two disagreeing presets refuse a
//! VMI naming the field); an UploadTokenRequest is a discovered kind that `kubectl create -f`
//! answers with `status.token`.

use std::time::Duration;

use ferrovirt_testkit::{Cluster, ClusterOptions, Registry, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(240);

fn cluster() -> anyhow::Result<Cluster> {
    TestGuest::get()?;
    Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))
}

/// The HyperConverged object listing `registry` as insecure (plain HTTP).
fn insecure(c: &Cluster, registry: &str) -> anyhow::Result<()> {
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
    insecureRegistries: ["{registry}"]
"#
    ))?;
    Ok(())
}

fn pool_manifest(image: &str, replicas: u32) -> String {
    format!(
        r#"
apiVersion: pool.kubevirt.io/v1beta1
kind: VirtualMachinePool
metadata: {{name: web, namespace: default}}
spec:
  replicas: {replicas}
  selector: {{matchLabels: {{app: web}}}}
  virtualMachineTemplate:
    metadata:
      labels: {{app: web}}
    spec:
      runStrategy: Always
      template:
        metadata:
          labels: {{app: web}}
        spec:
          terminationGracePeriodSeconds: 5
          domain:
            memory: {{guest: 96Mi}}
            # Three VMIs fit a 2-core node only with a small CPU request.
            resources: {{requests: {{cpu: 100m}}}}
            devices:
              disks:
              - name: root
                disk: {{bus: virtio}}
          volumes:
          - name: root
            containerDisk: {{image: "{image}", imagePullPolicy: IfNotPresent}}
"#
    )
}

/// Names of the pool's VMs that are not being deleted, sorted.
fn pool_vms(c: &Cluster) -> anyhow::Result<Vec<String>> {
    let v = c.get_json(&["vm", "-n", "default", "-l", "kubevirt.io/vmpool=web"])?;
    let mut names: Vec<String> = v["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|i| i["metadata"].get("deletionTimestamp").is_none())
        .filter_map(|i| i["metadata"]["name"].as_str().map(str::to_string))
        .collect();
    names.sort();
    Ok(names)
}

fn vmi_phase(c: &Cluster, name: &str) -> anyhow::Result<String> {
    let out = c.kubectl(&["get", "vmi", name, "-n", "default", "-o", "json"])?;
    if !out.status.success() {
        return Ok(String::new());
    }
    let v: Value = serde_json::from_slice(&out.stdout)?;
    Ok(v["status"]["phase"]
        .as_str()
        .unwrap_or_default()
        .to_string())
}

fn wait_vms(c: &Cluster, want: &[&str], running: bool) -> anyhow::Result<()> {
    c.wait_until(&format!("pool VMs {want:?}"), BOOT, || {
        let names = pool_vms(c)?;
        if names != want {
            return Ok(None);
        }
        for n in want {
            if running && vmi_phase(c, n)? != "Running" {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .map_err(|e| {
        let state = c
            .kubectl(&["get", "vm,vmi", "-n", "default", "-o", "yaml"])
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        e.context(format!("VMs and VMIs now:\n{state}"))
    })
}

#[test]
fn pool_scales_with_kubectl_recreates_deleted_vms_and_cascades() -> anyhow::Result<()> {
    let c = cluster()?;
    let guest = TestGuest::get()?;
    let reg = Registry::start()?;
    reg.push_disk("fv/guest", "v1", &guest.disk_qcow2, "guest.qcow2", false)?;
    insecure(&c, &reg.addr)?;
    let image = format!("{}/fv/guest:v1", reg.addr);
    c.apply(&pool_manifest(&image, 2))?;
    let t = std::time::Instant::now();
    wait_vms(&c, &["web-0", "web-1"], true)?;
    eprintln!("2 pool VMIs running after {:?}", t.elapsed());

    let vm = c.get_json(&["vm", "web-0", "-n", "default"])?;
    let owner = &vm["metadata"]["ownerReferences"][0];
    assert_eq!(owner["kind"], "VirtualMachinePool", "{vm}");
    assert_eq!(owner["controller"], true, "{vm}");
    assert_eq!(vm["metadata"]["labels"]["app"], "web", "{vm}");

    let table = c.wait_until("kubectl get vmpool: 2 2 2", BOOT, || {
        let t = c.kubectl_ok(&["get", "vmpool", "web", "-n", "default"])?;
        let header: Vec<&str> = t
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .collect();
        let row: Vec<&str> = t
            .lines()
            .nth(1)
            .unwrap_or_default()
            .split_whitespace()
            .collect();
        assert_eq!(
            header,
            ["NAME", "DESIRED", "CURRENT", "READY", "AGE"],
            "{t}"
        );
        Ok((row.get(1..4) == Some(&["2", "2", "2"][..])).then_some(t))
    })?;
    eprintln!("{table}");

    let raw = c.kubectl_ok(&[
        "get",
        "--raw",
        "/apis/pool.kubevirt.io/v1beta1/namespaces/default/virtualmachinepools/web/scale",
    ])?;
    let scale: Value = serde_json::from_str(&raw)?;
    assert_eq!(scale["kind"], "Scale", "{scale}");
    assert_eq!(scale["spec"]["replicas"], 2, "{scale}");
    assert_eq!(scale["status"]["selector"], "app=web", "{scale}");

    c.kubectl_ok(&["scale", "vmpool", "web", "-n", "default", "--replicas=3"])?;
    wait_vms(&c, &["web-0", "web-1", "web-2"], true)?;
    c.kubectl_ok(&["scale", "vmpool", "web", "-n", "default", "--replicas=1"])?;
    wait_vms(&c, &["web-0"], false)?;
    for gone in ["web-1", "web-2"] {
        c.wait_gone("vmi", gone, BOOT)?;
    }

    // A deleted VM is replaced: web-0 still holds its name while it stops, so the new one is
    // the lowest free index.
    c.kubectl_ok(&["delete", "vm", "web-0", "-n", "default", "--wait=false"])?;
    wait_vms(&c, &["web-1"], true)?;
    c.wait_gone("vm", "web-0", BOOT)?;
    let pool = c.get_json(&["vmpool", "web", "-n", "default"])?;
    assert_eq!(pool["spec"]["replicas"], 1, "{pool}");

    // Bad scale requests are refused naming the field.
    let out = c.kubectl(&["scale", "vmpool", "web", "-n", "default", "--replicas=-1"])?;
    assert!(!out.status.success());

    c.kubectl_ok(&["delete", "vmpool", "web", "-n", "default"])?;
    c.wait_until("the pool's VMs are collected", BOOT, || {
        Ok(pool_vms(&c)?.is_empty().then_some(()))
    })?;
    c.wait_gone("vm", "web-1", BOOT)?;
    Ok(())
}

#[test]
fn presets_land_in_new_vmis_and_upload_token_requests_are_a_served_kind() -> anyhow::Result<()> {
    let c = cluster()?;
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstancePreset
metadata: {name: small, namespace: default}
spec:
  selector: {matchLabels: {kubevirt.io/size: small}}
  domain:
    cpu: {cores: 2}
    resources: {requests: {memory: 96Mi}}
"#,
    )?;
    c.guest_disk_claim("preset-root")?;
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: sized
  namespace: default
  labels: {kubevirt.io/size: small}
spec:
  domain:
    devices:
      disks:
      - name: root
        disk: {bus: virtio}
  volumes:
  - name: root
    persistentVolumeClaim: {claimName: preset-root}
"#,
    )?;
    let vmi = c.get_json(&["vmi", "sized", "-n", "default"])?;
    assert_eq!(vmi["spec"]["domain"]["cpu"]["cores"], 2, "{vmi}");
    assert_eq!(
        vmi["spec"]["domain"]["resources"]["requests"]["memory"], "96Mi",
        "{vmi}"
    );
    assert_eq!(
        vmi["metadata"]["annotations"]["virtualmachineinstancepreset.kubevirt.io/small"],
        "kubevirt.io/v1",
        "{vmi}"
    );
    let booted = c.wait_booted("sized", BOOT)?;
    eprintln!("preset VMI booted: {booted}");
    let spec = std::fs::read_to_string(
        c.agent_dir()
            .join("vmis")
            .join(vmi["metadata"]["uid"].as_str().unwrap_or_default())
            .join("spec.json"),
    )?;
    assert!(
        spec.contains("\"cores\":2") || spec.contains("\"cores\": 2"),
        "{spec}"
    );

    // Two presets that disagree refuse the VMI, naming the field.
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstancePreset
metadata: {name: big, namespace: default}
spec:
  selector: {matchLabels: {kubevirt.io/size: small}}
  domain:
    cpu: {cores: 4}
"#,
    )?;
    let err = c
        .apply(
            r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: clash
  namespace: default
  labels: {kubevirt.io/size: small}
spec:
  domain: {devices: {}}
"#,
        )
        .expect_err("a VMI matched by two disagreeing presets was created");
    assert!(
        format!("{err:#}").contains("spec.domain.cpu.cores"),
        "{err:#}"
    );

    // UploadTokenRequest: discovered, created with kubectl, answered with a token.
    let resources = c.kubectl_ok(&["api-resources", "--api-group=upload.cdi.kubevirt.io"])?;
    assert!(resources.contains("uploadtokenrequests"), "{resources}");
    let dir = std::env::temp_dir().join(format!("fv-vm-pool-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let utr = dir.join("utr.yaml");
    std::fs::write(
        &utr,
        "apiVersion: upload.cdi.kubevirt.io/v1beta1\nkind: UploadTokenRequest\nmetadata: {name: t, namespace: default}\nspec: {pvcName: preset-root}\n",
    )?;
    // kubectl's client-side validation of a kind without PATCH lists apiextensions CRDs to
    // decide how to validate; until the API server serves that list, skip it.
    let token = c.kubectl_ok(&[
        "create",
        "--validate=false",
        "-f",
        utr.to_str().unwrap_or_default(),
        "-o",
        "jsonpath={.status.token}",
    ])?;
    let _ = std::fs::remove_dir_all(&dir);
    assert!(token.trim().len() > 20, "token {token:?}");
    Ok(())
}
