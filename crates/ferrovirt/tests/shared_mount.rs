//! A StorageClass declaring a shared filesystem (`ferrovirt.io/shared-mount`, docs/storage.md)
//! on two nodes of which only one has it mounted: node1 (the server's embedded agent) sees the
//! directory, node2 (a `ferrovirt agent` in its own mount namespace with an empty tmpfs over
//! the path, as on a machine where the NFS mount is missing) does not. node2's Node condition
//! `SharedStorageMounted` says False naming the class and path, node1's says True; a VM whose
//! disk is a claim of that class runs on node1 and boots from the shared filesystem; a VMI
//! that may only use node2 stays unschedulable with a reason naming the claim and the class.

use std::time::Duration;

use ferrovirt_testkit::mountns::hide_path_wrapper;
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(180);

fn condition(c: &Cluster, node: &str) -> anyhow::Result<Option<Value>> {
    let n = c.get_json(&["node", node])?;
    Ok(n["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "SharedStorageMounted")
        .cloned())
}

#[test]
fn a_node_without_the_shared_mount_reports_it_and_gets_no_vm_on_that_class() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let mut c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    let mount = c.dir.path().join("vmstore");
    std::fs::create_dir_all(&mount)?;
    c.start_agent_in("node2", &hide_path_wrapper(&mount), &[])?;
    c.apply(&format!(
        r#"
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {{name: vmstore}}
provisioner: ferrovirt.io/shared
parameters: {{ferrovirt.io/shared-mount: {mount}}}
reclaimPolicy: Delete
volumeBindingMode: Immediate
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: vmdisk, namespace: default}}
spec:
  storageClassName: vmstore
  accessModes: [ReadWriteMany]
  resources: {{requests: {{storage: 256Mi}}}}
"#,
        mount = mount.display()
    ))?;

    // Each node reports what it sees.
    let missing = c.wait_until("node2 reports the mount missing", BOOT, || {
        Ok(condition(&c, "node2")?.filter(|c| c["status"] == "False"))
    })?;
    assert_eq!(missing["reason"], "MountMissing", "{missing}");
    let msg = missing["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("StorageClass \"vmstore\"") && msg.contains(&mount.display().to_string()),
        "{msg}"
    );
    let present = c.wait_until("node1 reports the mount present", BOOT, || {
        Ok(condition(&c, "node1")?.filter(|c| c["status"] == "True"))
    })?;
    assert_eq!(present["reason"], "AllMounted", "{present}");
    let annotations = |node: &str| -> anyhow::Result<Value> {
        Ok(c.get_json(&["node", node])?["metadata"]["annotations"].clone())
    };
    assert_eq!(
        annotations("node1")?["storage.ferrovirt.io/shared-mounts"],
        "vmstore"
    );
    assert_eq!(
        annotations("node2")?["storage.ferrovirt.io/shared-mounts"],
        ""
    );

    // The volume lives on the shared filesystem; put the test guest's disk into it.
    let pv = c.wait_until("vmdisk bound", BOOT, || {
        let v = c.get_json(&["pvc", "vmdisk"])?;
        Ok((v["status"]["phase"] == "Bound")
            .then(|| v["spec"]["volumeName"].as_str().map(String::from))
            .flatten())
    })?;
    let dir = mount.join("volumes").join(&pv);
    assert!(dir.join("disk.img").is_file(), "{}", dir.display());
    assert!(mount.join(".ferrovirt-class-vmstore").is_file());
    std::fs::copy(&guest.disk_raw, dir.join("disk.img"))?;

    // A VM on that class: node2 cannot take it, node1 runs it.
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: onshared, namespace: default}
spec:
  runStrategy: Always
  template:
    spec:
      terminationGracePeriodSeconds: 5
      domain:
        memory: {guest: 128Mi}
        devices:
          disks:
          - name: root
            disk: {bus: virtio}
      volumes:
      - name: root
        persistentVolumeClaim: {claimName: vmdisk}
"#,
    )?;
    c.wait_booted("onshared", BOOT)?;
    let vmi = c.get_json(&["vmi", "onshared"])?;
    assert_eq!(vmi["status"]["nodeName"], "node1");

    // Only node2 allowed: unschedulable, and the reason names the claim and the class.
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: onlynode2, namespace: default}
spec:
  nodeSelector: {kubernetes.io/hostname: node2}
  domain:
    memory: {guest: 128Mi}
    devices:
      disks:
      - name: root
        disk: {bus: virtio}
  volumes:
  - name: root
    persistentVolumeClaim: {claimName: vmdisk}
"#,
    )?;
    let cond = c.wait_until("onlynode2 unschedulable", Duration::from_secs(60), || {
        let v = c.get_json(&["vmi", "onlynode2"])?;
        Ok(v["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "PodScheduled" && c["status"] == "False")
            .cloned())
    })?;
    let msg = cond["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains(
            "1 node(s) did not have the shared filesystem of StorageClass \"vmstore\" \
             (claim \"vmdisk\") mounted"
        ),
        "{msg}"
    );
    assert_eq!(
        c.get_json(&["vmi", "onlynode2"])?["status"]["nodeName"],
        Value::Null
    );
    Ok(())
}
