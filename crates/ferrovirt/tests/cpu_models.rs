//! Named CPU models the KubeVirt way (docs/hyperconverged.md "CPU models"), one boot. The
//! node's agent asked its QEMU (TCG here) which models it runs and labelled the Node
//! `cpu-model.node.kubevirt.io/<Model>=true` (KubeVirt's default obsolete models left off);
//! HyperConverged `spec.defaultCPUModel: Westmere` reaches the KubeVirt CR, and a VM without a
//! model gets `Westmere` in its VMI at creation, boots with QEMU's `-cpu Westmere,enforce`, and
//! the guest's /proc/cpuinfo shows QEMU's name for that model. `obsoleteCPUs.cpuModels:
//! [Nehalem]` takes the Nehalem label off the Node without a restart, and a VMI asking for
//! Nehalem stays Pending, unschedulable, the condition and the Event naming the model; so does
//! a VMI asking for a model TCG cannot run (Haswell). Then the workloads placement
//! (`spec.workloads.nodePlacement`): a VMI waits, unschedulable naming it, until the node
//! carries the selected label; tolerations are refused naming the field.

use std::time::{Duration, Instant};

use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(180);
const NS: &str = "kubevirt-hyperconverged";
const KV: &str = "kubevirt-kubevirt-hyperconverged";
const MODEL_LABEL: &str = "cpu-model.node.kubevirt.io/";

const VM: &str = r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: westy, namespace: default}
spec:
  runStrategy: Always
  template:
    spec:
      domain:
        memory: {guest: 128Mi}
        devices:
          disks:
          - {name: root, disk: {bus: virtio}}
      volumes:
      - {name: root, persistentVolumeClaim: {claimName: westy-root}}
"#;

fn pinned_vmi(name: &str, model: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: {name}, namespace: default}}
spec:
  terminationGracePeriodSeconds: 0
  domain:
    cpu: {{model: {model}}}
    memory: {{guest: 128Mi}}
"#
    )
}

fn node_labels(c: &Cluster) -> anyhow::Result<serde_json::Map<String, Value>> {
    let n = c.get_json(&["node", "node1"])?;
    Ok(n["metadata"]["labels"]
        .as_object()
        .cloned()
        .unwrap_or_default())
}

/// Waits until VMI `name` is Pending with PodScheduled=False Unschedulable naming `needle`,
/// and a FailedScheduling Event says the same; returns the condition's message.
fn wait_unschedulable(c: &Cluster, name: &str, needle: &str) -> anyhow::Result<String> {
    let msg = c.wait_until(
        &format!("{name} unschedulable naming {needle}"),
        Duration::from_secs(30),
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

#[test]
fn named_cpu_models_label_default_boot_and_obsolete() -> anyhow::Result<()> {
    let started = Instant::now();
    TestGuest::get()?;
    let c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;

    // The node labels: what TCG runs, without KubeVirt's default obsolete models.
    let labels = c.wait_until("the CPU-model labels", Duration::from_secs(30), || {
        let l = node_labels(&c)?;
        Ok(l.contains_key(&format!("{MODEL_LABEL}Westmere"))
            .then_some(l))
    })?;
    let models: Vec<&str> = labels
        .keys()
        .filter_map(|k| k.strip_prefix(MODEL_LABEL))
        .collect();
    println!("node1 offers CPU models {models:?}");
    for m in ["Westmere", "Nehalem", "Penryn"] {
        assert_eq!(labels[&format!("{MODEL_LABEL}{m}")], "true", "{m}");
        assert_eq!(
            labels[&format!("cpu-model-migration.node.kubevirt.io/{m}")],
            "true"
        );
    }
    for m in ["qemu64", "486", "Conroe", "Haswell", "max", "Westmere-v1"] {
        assert!(!models.contains(&m), "{m} labelled: {models:?}");
    }

    // HyperConverged spec.defaultCPUModel reaches the KubeVirt CR.
    c.patch_hco(r#"{"spec":{"defaultCPUModel":"Westmere"}}"#)?;
    c.wait_until(
        "cpuModel in the KubeVirt CR",
        Duration::from_secs(20),
        || {
            let kv = c.get_json(&["kubevirt", KV, "-n", NS])?;
            Ok((kv["spec"]["configuration"]["cpuModel"] == "Westmere").then_some(()))
        },
    )?;

    // A VM without a model: its VMI gets the default, boots with it, the guest sees it.
    c.guest_disk_claim("westy-root")?;
    c.apply(VM)?;
    let vmi = c.wait_until("the VMI", Duration::from_secs(30), || {
        let out = c.kubectl(&["get", "vmi", "westy", "-n", "default", "-o", "json"])?;
        Ok(out
            .status
            .success()
            .then(|| serde_json::from_slice::<Value>(&out.stdout))
            .transpose()?)
    })?;
    assert_eq!(vmi["spec"]["domain"]["cpu"]["model"], "Westmere");
    let vm = c.get_json(&["vm", "westy", "-n", "default"])?;
    assert!(
        vm["spec"]["template"]["spec"]["domain"]["cpu"]["model"].is_null(),
        "the VM itself is left as written"
    );
    let uid = c.wait_booted("westy", BOOT)?;
    let dir = c.agent_dir().join("vmis").join(&uid);
    let spec: Value = serde_json::from_slice(&std::fs::read(dir.join("spec.json"))?)?;
    assert_eq!(spec["cpu"]["model"], "Westmere", "{}", spec["cpu"]);
    let qemu = ferrovirt_testkit::cluster::pids_matching(&uid)
        .into_iter()
        .map(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default())
        .map(|raw| {
            raw.split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
        })
        .find(|argv| argv.first().is_some_and(|a| a.contains("qemu-system")))
        .ok_or_else(|| anyhow::anyhow!("no QEMU process for {uid}"))?;
    let i = qemu.iter().position(|a| a == "-cpu").expect("-cpu");
    assert_eq!(qemu[i + 1], "Westmere,enforce");
    c.wait_until("the guest ready", BOOT, || {
        let log =
            String::from_utf8_lossy(&std::fs::read(dir.join("serial.log")).unwrap_or_default())
                .into_owned();
        Ok(log.contains("FERROVIRT-READY").then_some(()))
    })?;
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    let (cpuinfo, rc) = console.exec(
        "grep -m1 'model name' /proc/cpuinfo",
        Duration::from_secs(20),
    )?;
    assert_eq!(rc, 0, "{cpuinfo}");
    assert!(
        cpuinfo.contains("Westmere E56xx/L56xx/X56xx (Nehalem-C)"),
        "the guest's CPU: {cpuinfo}"
    );
    println!("guest: {}", cpuinfo.trim());
    drop(console);
    println!("booted and checked at {:?}", started.elapsed());

    // An obsolete model: off the Node's labels (no restart), a VMI asking for it unschedulable.
    let t = Instant::now();
    c.patch_hco(r#"{"spec":{"obsoleteCPUs":{"cpuModels":["Nehalem"]}}}"#)?;
    c.wait_until("Nehalem label removed", Duration::from_secs(30), || {
        let l = node_labels(&c)?;
        Ok((!l.contains_key(&format!("{MODEL_LABEL}Nehalem"))
            && l.contains_key(&format!("{MODEL_LABEL}Westmere")))
        .then_some(()))
    })?;
    println!(
        "obsoleteCPUs reached the Node's labels in {:?}",
        t.elapsed()
    );
    let kv = c.get_json(&["kubevirt", KV, "-n", NS])?;
    assert_eq!(
        kv["spec"]["configuration"]["obsoleteCPUModels"]["Nehalem"],
        true
    );
    c.apply(&pinned_vmi("old-cpu", "Nehalem"))?;
    let msg = wait_unschedulable(&c, "old-cpu", "CPU model Nehalem is obsolete")?;
    assert!(msg.contains("spec.domain.cpu.model"), "{msg}");
    println!("old-cpu: {msg}");

    // A model TCG cannot run is on no node's labels.
    c.apply(&pinned_vmi("new-cpu", "Haswell"))?;
    let msg = wait_unschedulable(
        &c,
        "new-cpu",
        "no CPU model Haswell (label cpu-model.node.kubevirt.io/Haswell)",
    )?;
    println!("new-cpu: {msg}");

    c.kubectl_ok(&["delete", "vmi", "old-cpu", "new-cpu", "-n", "default"])?;
    c.halt_vm("westy", Duration::from_secs(120))?;
    workloads_placement_keeps_vms_to_its_nodes(&c)?;
    println!("whole test: {:?}", started.elapsed());
    Ok(())
}

/// HyperConverged `spec.workloads.nodePlacement` (KubeVirt's: where virt-handler runs, so where
/// VMs can run): a VMI waits, unschedulable naming it, until the node carries the selected
/// label, then is placed there; tolerations are refused naming the field.
fn workloads_placement_keeps_vms_to_its_nodes(c: &Cluster) -> anyhow::Result<()> {
    let t = Instant::now();
    c.patch_hco(
        r#"{"spec":{"workloads":{"nodePlacement":{"nodeSelector":{"example.com/vms":"yes"}}}}}"#,
    )?;
    c.wait_until(
        "the placement in the KubeVirt CR",
        Duration::from_secs(20),
        || {
            let kv = c.get_json(&["kubevirt", KV, "-n", NS])?;
            Ok(
                (kv["spec"]["workloads"]["nodePlacement"]["nodeSelector"]["example.com/vms"]
                    == "yes")
                    .then_some(()),
            )
        },
    )?;
    c.apply(&pinned_vmi("placed", "Westmere"))?;
    let msg = wait_unschedulable(c, "placed", "didn't match the workloads placement")?;
    println!("placed: {msg}");
    c.kubectl_ok(&["label", "node", "node1", "example.com/vms=yes"])?;
    c.wait_until("placed bound to node1", Duration::from_secs(30), || {
        let v = c.get_json(&["vmi", "placed", "-n", "default"])?;
        Ok((v["status"]["nodeName"] == "node1").then_some(()))
    })?;
    let err = c.hco_patch_refused(
        r#"{"spec":{"workloads":{"nodePlacement":{"tolerations":[{"operator":"Exists"}]}}}}"#,
    )?;
    assert!(
        err.contains("spec.workloads.nodePlacement.tolerations"),
        "{err}"
    );
    println!("placement checked at {:?}", t.elapsed());
    c.kubectl_ok(&["delete", "vmi", "placed", "-n", "default", "--wait=false"])?;
    Ok(())
}
