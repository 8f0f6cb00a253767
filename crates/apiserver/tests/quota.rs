//! ResourceQuota against a real server in a temp dir with the real kubectl: a quota of two
//! VirtualMachines refuses the third with Kubernetes' message; `status.used`/`hard` are kept
//! (recounted after a delete, which frees the slot); racing creates for the last slot: exactly
//! one wins (compare-and-swap on the quota); claims are charged `requests.storage`; VMIs
//! `requests.memory` as their launcher Pods would be; a migration entering Scheduling is charged
//! its target (the VMI's launcher Pod again), refused with Kubernetes' message when it does not
//! fit, kept by the recount while it holds the target and given back when it ends.

mod common;

use std::time::Duration;

use anyhow::Result;
use serde_json::{Value, json};

fn vm(name: &str) -> Value {
    json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": "q"},
        "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"devices": {},
            "resources": {"requests": {"memory": "128Mi"}}}}}}})
}

const VMS: &str = "/apis/kubevirt.io/v1/namespaces/q/virtualmachines";

async fn used(t: &common::TestServer, name: &str) -> Result<Value> {
    let r = t
        .request(
            "GET",
            &format!("/api/v1/namespaces/q/resourcequotas/{name}"),
            None,
        )
        .await?;
    Ok(r.json()["status"]["used"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_refuse_over_the_limit_and_race_safely() -> Result<()> {
    common::require_kubectl();
    let t = common::start().await?;
    t.kubectl_ok(&["create", "namespace", "q"]).await?;
    t.kubectl_ok(&[
        "-n",
        "q",
        "create",
        "quota",
        "vms",
        "--hard=count/virtualmachines.kubevirt.io=2,requests.storage=3Gi,persistentvolumeclaims=5",
    ])
    .await?;
    // Scopes are not carried out: refused naming the field, never ignored.
    let out = t
        .kubectl(&[
            "-n",
            "q",
            "create",
            "quota",
            "scoped",
            "--hard=pods=1",
            "--scopes=BestEffort",
        ])
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("spec.scopes"),
        "{stderr}"
    );
    for n in ["vm1", "vm2"] {
        let r = t.request("POST", VMS, Some(vm(n))).await?;
        assert_eq!(r.status, 201, "{}", r.text());
    }
    let r = t.request("POST", VMS, Some(vm("vm3"))).await?;
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(
        r.json()["message"],
        "virtualmachines.kubevirt.io \"vm3\" is forbidden: exceeded quota: vms, requested: count/virtualmachines.kubevirt.io=1, used: count/virtualmachines.kubevirt.io=2, limited: count/virtualmachines.kubevirt.io=2"
    );
    // kubectl shows the same refusal.
    let out = t
        .kubectl_stdin(
            &["apply", "-f", "-"],
            Some(&serde_json::to_string(&vm("vm3"))?),
        )
        .await?;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("exceeded quota: vms"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let u = used(&t, "vms").await?;
    assert_eq!(u["count/virtualmachines.kubevirt.io"], "2", "{u}");

    // A delete frees the slot once the quota is recounted.
    t.kubectl_ok(&["-n", "q", "delete", "vm", "vm1", "--wait=false"])
        .await?;
    let mut freed = false;
    for _ in 0..100 {
        if used(&t, "vms").await?["count/virtualmachines.kubevirt.io"] == "1" {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(freed, "the quota was not recounted after a delete");

    // Racing creates for the one free slot: exactly one is admitted.
    let mut racers = Vec::new();
    for i in 0..6 {
        let t = &t;
        racers.push(async move { t.request("POST", VMS, Some(vm(&format!("race{i}")))).await });
    }
    let codes: Vec<u16> = futures::future::join_all(racers)
        .await
        .into_iter()
        .map(|r| r.map(|r| r.status))
        .collect::<Result<_>>()?;
    assert_eq!(codes.iter().filter(|c| **c == 201).count(), 1, "{codes:?}");
    assert_eq!(codes.iter().filter(|c| **c == 403).count(), 5, "{codes:?}");
    let list = t.request("GET", VMS, None).await?.json();
    assert_eq!(list["items"].as_array().map(Vec::len), Some(2), "{list}");

    // Claims: requests.storage.
    let pvc = |name: &str, size: &str| {
        json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": "q"},
            "spec": {"accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": size}}}})
    };
    let pvcs = "/api/v1/namespaces/q/persistentvolumeclaims";
    let r = t.request("POST", pvcs, Some(pvc("c1", "2Gi"))).await?;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = t.request("POST", pvcs, Some(pvc("c2", "2Gi"))).await?;
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(
        r.json()["message"],
        "persistentvolumeclaims \"c2\" is forbidden: exceeded quota: vms, requested: requests.storage=2Gi, used: requests.storage=2Gi, limited: requests.storage=3Gi"
    );
    let u = used(&t, "vms").await?;
    assert_eq!(u["requests.storage"], "2Gi", "{u}");
    assert_eq!(u["persistentvolumeclaims"], "1", "{u}");

    // VMIs: requests.memory as the launcher Pod's.
    t.kubectl_ok(&[
        "-n",
        "q",
        "create",
        "quota",
        "mem",
        "--hard=requests.memory=200Mi",
    ])
    .await?;
    let vmi = |name: &str| {
        json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": name, "namespace": "q"},
            "spec": {"domain": {"devices": {}, "memory": {"guest": "128Mi"}}}})
    };
    let vmis = "/apis/kubevirt.io/v1/namespaces/q/virtualmachineinstances";
    let r = t.request("POST", vmis, Some(vmi("i1"))).await?;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = t.request("POST", vmis, Some(vmi("i2"))).await?;
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(
        r.json()["message"],
        "virtualmachineinstances.kubevirt.io \"i2\" is forbidden: exceeded quota: mem, requested: requests.memory=128Mi, used: requests.memory=128Mi, limited: requests.memory=200Mi"
    );

    // Migrations: the target holds the VMI's requests a second time from Scheduling on.
    let vmims = "/apis/kubevirt.io/v1/namespaces/q/virtualmachineinstancemigrations";
    let mig = json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
        "metadata": {"name": "m1", "namespace": "q"}, "spec": {"vmiName": "i1"}});
    let r = t.request("POST", vmims, Some(mig)).await?;
    assert_eq!(r.status, 201, "{}", r.text());
    let phase = |p: &str| format!(r#"{{"status":{{"phase":"{p}"}}}}"#);
    let out = set_phase(&t, phase("Pending")).await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = set_phase(&t, phase("Scheduling")).await?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("virtualmachineinstancemigrations.kubevirt.io \"m1\" is forbidden: exceeded quota: mem, requested: requests.memory=128Mi, used: requests.memory=128Mi, limited: requests.memory=200Mi"),
        "{err}"
    );
    let m = t.request("GET", &format!("{vmims}/m1"), None).await?.json();
    assert_eq!(m["status"]["phase"], "Pending", "{m}");
    t.kubectl_ok(&[
        "-n",
        "q",
        "patch",
        "quota",
        "mem",
        "--type=merge",
        "-p",
        r#"{"spec":{"hard":{"requests.memory":"300Mi"}}}"#,
    ])
    .await?;
    let out = set_phase(&t, phase("Scheduling")).await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(used(&t, "mem").await?["requests.memory"], "256Mi");
    // The recount (every 5 s) keeps the target's charge while it is held.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(used(&t, "mem").await?["requests.memory"], "256Mi");
    let out = set_phase(&t, phase("Running")).await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(used(&t, "mem").await?["requests.memory"], "256Mi");
    // Ended: given back at once.
    let out = set_phase(&t, phase("Succeeded")).await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(used(&t, "mem").await?["requests.memory"], "128Mi");
    // A cancel (the migration deleted while it holds its target) gives it back at once too.
    let out = set_phase(&t, phase("Scheduling")).await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(used(&t, "mem").await?["requests.memory"], "256Mi");
    let r = t.request("DELETE", &format!("{vmims}/m1"), None).await?;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(used(&t, "mem").await?["requests.memory"], "128Mi");
    t.shutdown().await;
    Ok(())
}

async fn set_phase(t: &common::TestServer, patch: String) -> Result<std::process::Output> {
    t.kubectl(&[
        "-n",
        "q",
        "patch",
        "vmim",
        "m1",
        "--subresource=status",
        "--type=merge",
        "-p",
        &patch,
    ])
    .await
}
