//! permittedHostDevices honoured (docs/hyperconverged.md "Host devices"), on one real cluster
//! (server, embedded agent, kubectl), without a restart: HyperConverged
//! `spec.permittedHostDevices` with a PCI selector (and a disabled entry) reaches the KubeVirt
//! CR in KubeVirt's names; the node's agent, following that CR, advertises the resource in
//! its Node's capacity and allocatable with the count of functions of that id (one the host
//! really has, read from /sys) bound to `vfio-pci` — 0 on the test machines, which have no
//! IOMMU, so no VM here can really receive one; a VMI asking for the resource stays Pending, unschedulable, the
//! condition and a FailedScheduling Event saying `Insufficient <resource>` and naming the
//! field; a VM asking for a device the list does not permit is not started, KubeVirt's
//! message naming the field; shapes HCO does not accept are refused naming the field, as is a
//! vGPU display; dropping the list from the HyperConverged takes it out of the KubeVirt CR,
//! leaves the resource at 0 on the Node, and the once refused VMI is now merely short of its
//! device.

use std::time::{Duration, Instant};

use ferrovirt_testkit::{Cluster, ClusterOptions};
use serde_json::Value;

const NS: &str = "kubevirt-hyperconverged";
const KV: &str = "kubevirt-kubevirt-hyperconverged";
const RES: &str = "example.org/host-pci";

fn vmi(name: &str, devices: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: {name}, namespace: default}}
spec:
  terminationGracePeriodSeconds: 0
  domain:
    memory: {{guest: 64Mi}}
    devices: {devices}
"#
    )
}

const VM: &str = r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: wants-other, namespace: default}
spec:
  runStrategy: Always
  template:
    spec:
      terminationGracePeriodSeconds: 0
      domain:
        memory: {guest: 64Mi}
        devices:
          hostDevices:
          - {name: nic, deviceName: example.org/other}
"#;

/// The PodScheduled=False message of VMI `name` once it contains `needle` (phase Pending),
/// after a FailedScheduling Event said the same.
fn wait_unschedulable(c: &Cluster, name: &str, needle: &str) -> anyhow::Result<String> {
    let msg = c.wait_until(
        &format!("{name} unschedulable naming {needle}"),
        Duration::from_secs(40),
        || {
            let v = c.get_json(&["vmi", name, "-n", "default"])?;
            let cond = v["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == "PodScheduled" && c["reason"] == "Unschedulable")
                .and_then(|c| c["message"].as_str())
                .map(str::to_string);
            Ok(cond.filter(|m| m.contains(needle) && v["status"]["phase"] == "Pending"))
        },
    )?;
    c.wait_until(
        &format!("a FailedScheduling event of {name}"),
        Duration::from_secs(20),
        || {
            let evs = c.get_json(&[
                "events",
                "-n",
                "default",
                "--field-selector",
                &format!("involvedObject.name={name}"),
            ])?;
            Ok(evs["items"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|e| {
                    e["reason"] == "FailedScheduling"
                        && e["message"].as_str().is_some_and(|m| m.contains(needle))
                })
                .then_some(()))
        },
    )?;
    Ok(msg)
}

/// A PCI function this host really has (`vendor:device`, upper case as HCO's examples write
/// it) and how many functions of that id are bound to vfio-pci in an IOMMU group — what the
/// agent must count; virtio-net's id when /sys lists none.
fn host_pci_id() -> (String, usize) {
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).ok();
    let hex = |s: String| s.trim().trim_start_matches("0x").to_ascii_uppercase();
    let fns: Vec<(String, bool)> = std::fs::read_dir("/sys/bus/pci/devices")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let p = e.path();
            let id = format!(
                "{}:{}",
                hex(read(p.join("vendor"))?),
                hex(read(p.join("device"))?)
            );
            let vfio = std::fs::read_link(p.join("driver")).is_ok_and(|l| l.ends_with("vfio-pci"))
                && p.join("iommu_group").exists();
            Some((id, vfio))
        })
        .collect();
    match fns.first() {
        Some((id, _)) => {
            let n = fns.iter().filter(|(i, v)| i == id && *v).count();
            (id.clone(), n)
        }
        None => ("1AF4:1000".into(), 0),
    }
}

fn node_resource(c: &Cluster, field: &str) -> anyhow::Result<Option<String>> {
    let n = c.get_json(&["node", "node1"])?;
    Ok(n["status"][field][RES].as_str().map(str::to_string))
}

#[test]
fn permitted_host_devices_reach_the_node_the_scheduler_and_admission() -> anyhow::Result<()> {
    let started = Instant::now();
    let c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    // The server made the HyperConverged and its KubeVirt CR.
    c.wait_until("the owned KubeVirt CR", Duration::from_secs(30), || {
        Ok(c.get_json(&["kubevirt", KV, "-n", NS]).ok())
    })?;
    assert_eq!(
        node_resource(&c, "capacity")?,
        None,
        "nothing permitted yet"
    );

    // Shapes HCO does not take are refused naming the field.
    let err = c.hco_patch_refused(
        r#"{"spec":{"permittedHostDevices":{"pciHostDevices":[{"pciDeviceSelector":"1af4","resourceName":"virtio"}]}}}"#,
    )?;
    for f in [
        "spec.permittedHostDevices.pciHostDevices[0].pciDeviceSelector",
        "spec.permittedHostDevices.pciHostDevices[0].resourceName",
    ] {
        assert!(err.contains(f), "{f} not named: {err}");
    }

    // Permit a PCI function this host has (bound to its own driver, not vfio-pci, on the test
    // machines), and a disabled entry HCO leaves out.
    let (id, vfio_bound) = host_pci_id();
    println!("permitting {id}, {vfio_bound} function(s) of it bound to vfio-pci");
    c.patch_hco(&format!(
        r#"{{"spec":{{"permittedHostDevices":{{"pciHostDevices":[
            {{"pciDeviceSelector":"{id}","resourceName":"{RES}"}},
            {{"pciDeviceSelector":"10DE:1EB8","resourceName":"nvidia.com/T4","disabled":true}}]}}}}}}"#
    ))?;
    let t = Instant::now();
    let kv = c.wait_until(
        "the list in the KubeVirt CR",
        Duration::from_secs(20),
        || {
            let kv = c.get_json(&["kubevirt", KV, "-n", NS])?;
            let p = kv["spec"]["configuration"]["permittedHostDevices"].clone();
            Ok((!p.is_null()).then_some(p))
        },
    )?;
    assert_eq!(
        kv,
        serde_json::json!({"pciHostDevices": [{"pciVendorSelector": id, "resourceName": RES}]})
    );
    let kv_at = t.elapsed();
    // The agent follows the CR: the resource shows, with what /sys has bound to vfio-pci.
    let count = c.wait_until("the resource on the Node", Duration::from_secs(20), || {
        node_resource(&c, "allocatable")
    })?;
    let node_at = t.elapsed();
    assert_eq!(
        count,
        vfio_bound.to_string(),
        "what /sys has bound to vfio-pci"
    );
    assert_eq!(node_resource(&c, "capacity")?, Some(vfio_bound.to_string()));
    anyhow::ensure!(
        vfio_bound == 0,
        "this test expects a host without vfio-pci functions (the VMI below must stay short)"
    );

    // A VMI asking for one waits, short of the device, naming the field.
    c.apply(&vmi(
        "wants-nic",
        &format!("{{hostDevices: [{{name: nic, deviceName: {RES}}}]}}"),
    ))?;
    let msg = wait_unschedulable(&c, "wants-nic", &format!("Insufficient {RES}"))?;
    assert!(
        msg.contains("spec.domain.devices.hostDevices[0].deviceName"),
        "{msg}"
    );
    println!("wants-nic: {msg}");

    // A device the list does not permit: KubeVirt's message, naming the field.
    c.apply(VM)?;
    let msg = wait_unschedulable(
        &c,
        "wants-other",
        "HostDevice example.org/other is not permitted in permittedHostDevices configuration",
    )?;
    assert!(
        msg.contains("spec.domain.devices.hostDevices[0].deviceName"),
        "{msg}"
    );
    println!("wants-other: {msg}");

    // A vGPU display is not carried out: refused at creation, naming the field.
    let err = c
        .apply(&vmi(
            "vgpu",
            &format!(
                "{{gpus: [{{name: g, deviceName: {RES}, virtualGPUOptions: {{display: {{enabled: true}}}}}}]}}"
            ),
        ))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("spec.domain.devices.gpus[0].virtualGPUOptions.display"),
        "{err}"
    );

    // Dropping the list: out of the KubeVirt CR, the resource stays at 0 on the Node, and
    // without a list every device name is allowed (the VM's VMI is now only short of it).
    c.patch_hco(r#"{"spec":{"permittedHostDevices":null}}"#)?;
    c.wait_until(
        "the list gone from the KubeVirt CR",
        Duration::from_secs(20),
        || {
            let kv = c.get_json(&["kubevirt", KV, "-n", NS])?;
            Ok(kv["spec"]["configuration"]["permittedHostDevices"]
                .is_null()
                .then_some(()))
        },
    )?;
    wait_unschedulable(&c, "wants-other", "Insufficient example.org/other")?;
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(node_resource(&c, "allocatable")?.as_deref(), Some("0"));
    let v: Value = c.get_json(&["vmi", "wants-nic", "-n", "default"])?;
    assert_eq!(v["status"]["phase"], "Pending");
    println!(
        "host devices: KubeVirt CR after {kv_at:?}, Node after {node_at:?}, whole test {:?}",
        started.elapsed()
    );
    Ok(())
}
