//! The HyperConverged drives the platform (docs/hyperconverged.md). One cluster, two nodes
//! (the server's embedded node1 and an agent process node2): the server made the one
//! HyperConverged with HCO's defaults and the reconcile made the four objects it owns
//! (`kubectl get kubevirt,cdi,ssp,networkaddonsconfig -A` lists them); an edit of the
//! HyperConverged's liveMigrationConfig reaches the KubeVirt CR and one of its
//! storageImport.insecureRegistries reaches the CDI; a direct edit of the KubeVirt CR is
//! written back with an `Overwritten` Event; a field ferrovirt does not carry out is refused
//! naming it; killing node2's agent turns the HyperConverged Degraded naming node2, and
//! restarting it brings it back to Available.

use std::time::{Duration, Instant};

use ferrovirt_testkit::{Cluster, ClusterOptions};
use serde_json::Value;

const NS: &str = "kubevirt-hyperconverged";
const HCO: &str = "kubevirt-hyperconverged";
const KV: &str = "kubevirt-kubevirt-hyperconverged";
const CDI: &str = "cdi-kubevirt-hyperconverged";

fn hco(c: &Cluster) -> anyhow::Result<Value> {
    c.get_json(&["hyperconverged", HCO, "-n", NS])
}

fn condition(hco: &Value, type_: &str) -> Option<(String, String, String)> {
    hco["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap_or("").to_string();
            (s("status"), s("reason"), s("message"))
        })
}

#[test]
fn hyperconverged_owns_configures_and_reports_the_platform() -> anyhow::Result<()> {
    let started = Instant::now();
    let mut c = Cluster::with_nodes(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")), 2)?;
    // Shorter node leases (the shortest allowed) so a dead agent shows sooner.
    c.patch_hco(r#"{"spec":{"nodeFailure":{"leaseDurationSeconds":4,"fenceMarginSeconds":2}}}"#)?;

    // The four owned objects, with HCO's names, labels and owner references.
    let owned = c.wait_until("the four owned objects", Duration::from_secs(30), || {
        let v = c.get_json(&["kubevirt,cdi,ssp,networkaddonsconfig", "-A"])?;
        let items = v["items"].as_array().cloned().unwrap_or_default();
        Ok((items.len() == 4).then_some(items))
    })?;
    let names: Vec<(&str, &str)> = owned
        .iter()
        .map(|o| {
            (
                o["kind"].as_str().unwrap_or(""),
                o["metadata"]["name"].as_str().unwrap_or(""),
            )
        })
        .collect();
    for want in [
        ("KubeVirt", KV),
        ("CDI", CDI),
        ("SSP", "ssp-kubevirt-hyperconverged"),
        ("NetworkAddonsConfig", "cluster"),
    ] {
        assert!(names.contains(&want), "{want:?} missing from {names:?}");
    }
    let kv = c.get_json(&["kubevirt", KV, "-n", NS])?;
    assert_eq!(
        kv["metadata"]["labels"]["app.kubernetes.io/managed-by"],
        "hco-operator"
    );
    assert_eq!(
        kv["metadata"]["ownerReferences"][0]["kind"],
        "HyperConverged"
    );
    assert_eq!(kv["metadata"]["ownerReferences"][0]["controller"], true);
    assert_eq!(
        kv["spec"]["configuration"]["migrations"]["parallelMigrationsPerCluster"], 5,
        "HCO's default"
    );
    let table = c.kubectl_ok(&["get", "kubevirt,cdi,ssp,networkaddonsconfig", "-A"])?;
    for name in [KV, CDI, "ssp-kubevirt-hyperconverged", "cluster"] {
        assert!(table.contains(name), "{name} not listed:\n{table}");
    }
    c.wait_until("HyperConverged Available", Duration::from_secs(30), || {
        let h = hco(&c)?;
        Ok(matches!(condition(&h, "Available"), Some((s, _, _)) if s == "True").then_some(()))
    })?;
    let h = hco(&c)?;
    for t in ["Progressing", "Degraded"] {
        assert_eq!(
            condition(&h, t).map(|c| c.0).as_deref(),
            Some("False"),
            "{t}"
        );
    }
    for t in ["ReconcileComplete", "Upgradeable"] {
        assert_eq!(
            condition(&h, t),
            Some((
                "True".into(),
                "ReconcileCompleted".into(),
                "Reconcile completed successfully".into()
            )),
            "{t}"
        );
    }

    // liveMigrationConfig reaches the KubeVirt CR.
    let t = Instant::now();
    c.patch_hco(r#"{"spec":{"liveMigrationConfig":{"parallelMigrationsPerCluster":3,"bandwidthPerMigration":"64Mi"}}}"#,
    )?;
    c.wait_until(
        "migrations in the KubeVirt CR",
        Duration::from_secs(20),
        || {
            let kv = c.get_json(&["kubevirt", KV, "-n", NS])?;
            let m = &kv["spec"]["configuration"]["migrations"];
            Ok(
                (m["parallelMigrationsPerCluster"] == 3 && m["bandwidthPerMigration"] == "64Mi")
                    .then_some(()),
            )
        },
    )?;
    println!(
        "liveMigrationConfig reached the KubeVirt CR in {:?}",
        t.elapsed()
    );

    // storageImport.insecureRegistries reaches the CDI.
    let t = Instant::now();
    c.patch_hco(r#"{"spec":{"storageImport":{"insecureRegistries":["registry.test:5000"]}}}"#)?;
    c.wait_until(
        "insecureRegistries in the CDI",
        Duration::from_secs(20),
        || {
            let cdi = c.get_json(&["cdi", CDI])?;
            Ok((cdi["spec"]["config"]["insecureRegistries"]
                == serde_json::json!(["registry.test:5000"]))
            .then_some(()))
        },
    )?;
    println!("insecureRegistries reached the CDI in {:?}", t.elapsed());

    // A direct edit of the KubeVirt CR is reverted, with an Event saying so.
    let t = Instant::now();
    c.kubectl_ok(&[
        "patch",
        "kubevirt",
        KV,
        "-n",
        NS,
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"configuration":{"migrations":{"parallelMigrationsPerCluster":9}}}}"#,
    ])?;
    c.wait_until("the edit reverted", Duration::from_secs(20), || {
        let kv = c.get_json(&["kubevirt", KV, "-n", NS])?;
        Ok(
            (kv["spec"]["configuration"]["migrations"]["parallelMigrationsPerCluster"] == 3)
                .then_some(()),
        )
    })?;
    println!("the direct edit was reverted in {:?}", t.elapsed());
    let event = c.wait_until("the Overwritten event", Duration::from_secs(20), || {
        let evs = c.get_json(&[
            "events",
            "-n",
            NS,
            "--field-selector",
            &format!("involvedObject.name={HCO}"),
        ])?;
        Ok(evs["items"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["reason"] == "Overwritten")
            .cloned())
    })?;
    assert_eq!(event["type"], "Warning");
    let msg = event["message"].as_str().unwrap_or("");
    assert!(
        msg.contains(KV)
            && msg.contains("spec.configuration.migrations.parallelMigrationsPerCluster"),
        "{msg}"
    );

    // A field ferrovirt does not carry out is refused, naming it.
    let err = c.hco_patch_refused(r#"{"spec":{"defaultRuntimeClass":"kata"}}"#)?;
    assert!(err.contains("spec.defaultRuntimeClass"), "{err}");

    overcommit_reaches_the_scheduler_and_admission(&c)?;

    // node2's agent dies: Degraded names node2; back to Available when it returns.
    let t = Instant::now();
    c.kill_agent("node2")?;
    let (reason, message) =
        c.wait_until("Degraded naming node2", Duration::from_secs(40), || {
            let h = hco(&c)?;
            Ok(match condition(&h, "Degraded") {
                Some((s, r, m)) if s == "True" && m.contains("node2") => Some((r, m)),
                _ => None,
            })
        })?;
    println!(
        "Degraded {:?} after the kill: {reason}: {message}",
        t.elapsed()
    );
    assert_eq!(reason, "KubeVirtDegraded");
    assert!(message.contains("virt-handler on node node2"), "{message}");
    assert!(!message.contains("node1"), "{message}");
    let t = Instant::now();
    c.start_agent("node2")?;
    c.wait_until("Available again", Duration::from_secs(40), || {
        let h = hco(&c)?;
        let avail = matches!(condition(&h, "Available"), Some((s, _, _)) if s == "True");
        let degraded = matches!(condition(&h, "Degraded"), Some((s, _, _)) if s == "False");
        Ok((avail && degraded).then_some(()))
    })?;
    println!("Available again {:?} after the restart", t.elapsed());
    println!("whole test: {:?}", started.elapsed());
    Ok(())
}

/// `higherWorkloadDensity.memoryOvercommitPercentage` gives a VMI that sets only its guest
/// memory the overcommitted request; `resourceRequirements.vmiCPUAllocationRatio` decides how
/// much CPU a VMI without a request asks per vCPU: at HCO's default 10 a VMI of 20 vCPUs per
/// node CPU (2 CPUs per node CPU) fits nowhere, at 40 (half a CPU per node CPU) it is placed.
/// The VMI starts paused, so QEMU never runs its vCPUs.
fn overcommit_reaches_the_scheduler_and_admission(c: &Cluster) -> anyhow::Result<()> {
    let t = Instant::now();
    c.patch_hco(r#"{"spec":{"higherWorkloadDensity":{"memoryOvercommitPercentage":200}}}"#)?;
    c.wait_until(
        "memoryOvercommit in the KubeVirt CR",
        Duration::from_secs(20),
        || {
            let kv = c.get_json(&["kubevirt", KV, "-n", NS])?;
            let dev = &kv["spec"]["configuration"]["developerConfiguration"];
            Ok((dev["memoryOvercommit"] == 200 && dev["cpuAllocationRatio"] == 10).then_some(()))
        },
    )?;
    let node = c.get_json(&["node", "node1"])?;
    let cpus: u64 = node["status"]["allocatable"]["cpu"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("node1 allocatable cpu: {}", node["status"]))?;
    let vcpus = 20 * cpus;
    c.apply(&format!(
        r#"apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: overcommit
  namespace: default
spec:
  startStrategy: Paused
  nodeSelector:
    kubernetes.io/hostname: node1
  domain:
    cpu:
      cores: {vcpus}
    memory:
      guest: 256Mi
    devices: {{}}
"#
    ))?;
    let vmi = c.get_json(&["vmi", "overcommit", "-n", "default"])?;
    assert_eq!(
        vmi["spec"]["domain"]["resources"]["requests"]["memory"], "128Mi",
        "256Mi of guest memory at 200 % overcommit"
    );
    assert_eq!(vmi["spec"]["domain"]["memory"]["guest"], "256Mi");
    let msg = c.wait_until("the VMI unschedulable", Duration::from_secs(20), || {
        let v = c.get_json(&["vmi", "overcommit", "-n", "default"])?;
        Ok(v["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "PodScheduled" && c["reason"] == "Unschedulable")
            .and_then(|c| c["message"].as_str().map(String::from)))
    })?;
    assert!(msg.contains("Insufficient cpu"), "{msg}");
    c.patch_hco(r#"{"spec":{"resourceRequirements":{"vmiCPUAllocationRatio":40}}}"#)?;
    let placed = c.wait_until("the VMI placed", Duration::from_secs(30), || {
        let v = c.get_json(&["vmi", "overcommit", "-n", "default"])?;
        Ok(v["status"]["nodeName"].as_str().map(String::from))
    })?;
    assert_eq!(placed, "node1");
    println!(
        "overcommit: {vcpus} vCPUs on {cpus} CPUs placed at ratio 40 ({:?})",
        t.elapsed()
    );
    c.kubectl_ok(&[
        "delete",
        "vmi",
        "overcommit",
        "-n",
        "default",
        "--wait=false",
    ])?;
    Ok(())
}

/// `kubectl get pods -n kubevirt-hyperconverged` shows the platform's components.
#[test]
fn the_platform_namespace_shows_the_components_as_pods() -> anyhow::Result<()> {
    let c = Cluster::with_nodes(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")), 2)?;
    let table = c.wait_until("the virt-controller Pod", Duration::from_secs(30), || {
        let t = c.kubectl_ok(&["get", "pods", "-n", NS])?;
        Ok(t.contains("virt-controller-").then_some(t))
    })?;
    println!("{table}");
    for name in ["virt-api-0", "virt-handler-node1", "virt-handler-node2"] {
        let row = table
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} missing:\n{table}"));
        assert!(row.contains("Running"), "{row}");
    }
    let pod = c.get_json(&["pod", "virt-handler-node2", "-n", NS])?;
    assert_eq!(pod["metadata"]["labels"]["kubevirt.io/nodeName"], "node2");
    // Not selected by `spec.nodeName` (what kubectl drain evicts).
    let on_node2 = c.get_json(&["pods", "-A", "--field-selector", "spec.nodeName=node2"])?;
    assert_eq!(on_node2["items"].as_array().map(Vec::len), Some(0));
    assert!(
        !c.kubectl(&["delete", "pod", "virt-api-0", "-n", NS])?
            .status
            .success()
    );
    Ok(())
}

/// KubeVirt's common cluster instancetypes and preferences are deployed and kept
/// (`hco::common`): `kubectl get virtualmachineclusterinstancetype u1.small` finds it, a direct
/// edit is written back with an `Overwritten` Event, a VM of `u1.nano` with the `alpine`
/// preference boots; `commonInstancetypesDeployment.enabled: false` in the HyperConverged removes
/// ours and leaves a same-kind object someone else made.
#[test]
fn common_instancetypes_are_deployed_kept_and_boot_a_vm() -> anyhow::Result<()> {
    let started = Instant::now();
    let c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    let small = c.wait_until("u1.small", Duration::from_secs(30), || {
        let out = c.kubectl(&[
            "get",
            "virtualmachineclusterinstancetype",
            "u1.small",
            "-o",
            "json",
        ])?;
        Ok(out
            .status
            .success()
            .then(|| serde_json::from_slice::<Value>(&out.stdout))
            .transpose()?)
    })?;
    println!("u1.small deployed {:?} after the start", started.elapsed());
    assert_eq!(small["spec"]["cpu"]["guest"], 1);
    assert_eq!(small["spec"]["memory"]["guest"], "2Gi");
    assert_eq!(
        small["metadata"]["labels"]["app.kubernetes.io/managed-by"],
        "virt-operator"
    );
    let count = |kind: &str| -> anyhow::Result<usize> {
        let l = c.get_json(&[kind, "-l", "app.kubernetes.io/managed-by=virt-operator"])?;
        Ok(l["items"].as_array().map_or(0, Vec::len))
    };
    c.wait_until(
        "every instancetype and preference",
        Duration::from_secs(30),
        || {
            Ok((count("virtualmachineclusterinstancetypes")? == 35
                && count("virtualmachineclusterpreferences")? >= 30)
                .then_some(()))
        },
    )?;

    // A direct edit is written back.
    c.kubectl_ok(&[
        "patch",
        "virtualmachineclusterinstancetype",
        "u1.small",
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"cpu":{"guest":64}}}"#,
    ])?;
    let t = Instant::now();
    c.wait_until("u1.small written back", Duration::from_secs(20), || {
        let v = c.get_json(&["virtualmachineclusterinstancetype", "u1.small"])?;
        Ok((v["spec"]["cpu"]["guest"] == 1).then_some(()))
    })?;
    println!("edit reverted in {:?}", t.elapsed());
    c.wait_until("the Overwritten Event", Duration::from_secs(20), || {
        let ev = c.kubectl_ok(&[
            "get",
            "events",
            "-A",
            "--field-selector",
            "reason=Overwritten",
        ])?;
        Ok(ev.contains("u1.small").then_some(()))
    })?;

    // A VM of a common instancetype and preference boots.
    c.guest_disk_claim("common-root")?;
    c.apply(
        r#"apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: common, namespace: default}
spec:
  runStrategy: Always
  instancetype: {name: u1.nano}
  preference: {name: alpine}
  template:
    spec:
      terminationGracePeriodSeconds: 5
      domain:
        devices:
          disks: [{name: root, disk: {}}]
      volumes:
      - name: root
        persistentVolumeClaim: {claimName: common-root}
"#,
    )?;
    let t = Instant::now();
    c.wait_booted("common", Duration::from_secs(180))?;
    println!("u1.nano + alpine VM booted in {:?}", t.elapsed());
    let vmi = c.get_json(&["vmi", "common", "-n", "default"])?;
    assert_eq!(vmi["spec"]["domain"]["memory"]["guest"], "512Mi");
    assert_eq!(
        vmi["spec"]["domain"]["devices"]["disks"][0]["disk"]["bus"],
        "virtio"
    );

    // Turned off: ours go, someone else's stays.
    c.apply(
        r#"apiVersion: instancetype.kubevirt.io/v1beta1
kind: VirtualMachineClusterInstancetype
metadata: {name: mine.small}
spec:
  cpu: {guest: 1}
  memory: {guest: 256Mi}
"#,
    )?;
    c.patch_hco(r#"{"spec":{"commonInstancetypesDeployment":{"enabled":false}}}"#)?;
    c.wait_until("ours removed", Duration::from_secs(30), || {
        Ok((count("virtualmachineclusterinstancetypes")? == 0
            && count("virtualmachineclusterpreferences")? == 0)
            .then_some(()))
    })?;
    c.get_json(&["virtualmachineclusterinstancetype", "mine.small"])?;
    let refused =
        c.hco_patch_refused(r#"{"spec":{"commonInstancetypesDeployment":{"enabled":"yes"}}}"#)?;
    assert!(
        refused.contains("spec.commonInstancetypesDeployment.enabled"),
        "{refused}"
    );
    println!("whole test: {:?}", started.elapsed());
    Ok(())
}
