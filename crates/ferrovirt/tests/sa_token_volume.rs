//! serviceAccount volumes get a real token (issue #19; docs/access-control.md "ServiceAccount
//! tokens in VMs") through the real server binary, two joined `ferrovirt agent` processes (each
//! acting as its own node identity), the test guest under TCG and the real kubectl: VM a on j1
//! has a serviceAccount volume naming `robot`; its agent asks the TokenRequest API for a token
//! bound to the VMI; the guest mounts the disk (label `sadata`) and prints `namespace`, the
//! first line of `ca.crt` and the token on its console; `kubectl auth whoami` with that token
//! says `system:serviceaccount:default:robot`. VMI b on j2 names a ServiceAccount that does not
//! exist and fails naming `spec.volumes[1].serviceAccount.serviceAccountName`. Acting as node
//! j1, a token for b's ServiceAccount (bound to b, on j2), for an unreferenced ServiceAccount
//! bound to its own VMI, and an unbound token are 403; a token bound to a Pod is 422 naming
//! the field. Once VM a is deleted, the guest's token is 401.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use anyhow::bail;
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use serde_json::{Value, json};

const BOOT: Duration = Duration::from_secs(180);
const BIN: &str = env!("CARGO_BIN_EXE_ferrovirt");

/// The guest's user data: mount the serviceAccount disk and print its files.
const USER_DATA: &str = "#!/bin/sh\\nd=$(findfs LABEL=sadata)\\nmkdir -p /mnt/sa\\nmount -t iso9660 -o ro $d /mnt/sa\\necho SA-NAMESPACE $(cat /mnt/sa/namespace)\\necho SA-CA $(head -1 /mnt/sa/ca.crt)\\necho SA-TOKEN $(cat /mnt/sa/token) END\\n";

fn vm(name: &str, node: &str, sa: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {name}, namespace: default}}
spec:
  runStrategy: Always
  template:
    spec:
      terminationGracePeriodSeconds: 5
      nodeSelector: {{kubernetes.io/hostname: {node}}}
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - name: root
            disk: {{bus: virtio}}
          - name: sa
            disk: {{bus: virtio}}
          - name: ci
            disk: {{bus: virtio}}
      volumes:
      - name: root
        persistentVolumeClaim: {{claimName: disk-{name}}}
      - name: sa
        serviceAccount: {{serviceAccountName: {sa}}}
      - name: ci
        cloudInitNoCloud: {{userData: "{USER_DATA}"}}
"#
    )
}

/// A bare VMI (a VM would replace it once it failed) on `node` naming ServiceAccount `sa`.
fn vmi(name: &str, node: &str, sa: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: {name}, namespace: default}}
spec:
  terminationGracePeriodSeconds: 5
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  domain:
    memory: {{guest: 128Mi}}
    devices:
      disks:
      - name: root
        disk: {{bus: virtio}}
      - name: sa
        disk: {{bus: virtio}}
  volumes:
  - name: root
    persistentVolumeClaim: {{claimName: disk-{name}}}
  - name: sa
    serviceAccount: {{serviceAccountName: {sa}}}
"#
    )
}

fn kubectl_as(c: &Cluster, kc: &Path, args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kc)
        .arg("--cache-dir")
        .arg(c.dir().join("kubectl-cache-node"))
        .args(args)
        .output()?)
}

/// `POST …/serviceaccounts/SA/token` as the node whose kubeconfig is `kc`, bound to `bound`.
fn token_request_as(
    c: &Cluster,
    kc: &Path,
    sa: &str,
    bound: Option<Value>,
) -> anyhow::Result<Output> {
    let body = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"boundObjectRef": bound}});
    let f = c.dir().join(format!("tr-{sa}.json"));
    std::fs::write(&f, body.to_string())?;
    kubectl_as(
        c,
        kc,
        &[
            "create",
            "--raw",
            &format!("/api/v1/namespaces/default/serviceaccounts/{sa}/token"),
            "-f",
            &f.to_string_lossy(),
        ],
    )
}

fn vmi_ref(v: &Value) -> Value {
    json!({"kind": "VirtualMachineInstance", "apiVersion": "kubevirt.io/v1",
        "name": v["metadata"]["name"], "uid": v["metadata"]["uid"]})
}

fn refused(out: &Output, want: &str) -> anyhow::Result<()> {
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() || !err.contains(want) {
        bail!(
            "want a refusal containing {want:?}, got {}: {err}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        );
    }
    Ok(())
}

fn whoami(c: &Cluster, token: &str) -> anyhow::Result<Output> {
    Ok(Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(&c.kubeconfig)
        .args(["--token", token, "auth", "whoami", "-o", "json"])
        .output()?)
}

#[test]
fn a_vms_service_account_disk_holds_a_token_bound_to_the_vmi() -> anyhow::Result<()> {
    TestGuest::get()?;
    let mut opts = ClusterOptions::new(BIN);
    opts.node_name = None;
    let mut c = Cluster::start(&opts)?;
    let token_file = c.dir().join("token");
    std::fs::write(&token_file, format!("{}\n", c.join_token()?))?;
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600))?;
    c.start_joined_agent("j1", &token_file)?;
    c.start_joined_agent("j2", &token_file)?;
    c.wait_until("j1 and j2 Ready", Duration::from_secs(90), || {
        let v = c.get_json(&["nodes"])?;
        let ready = v["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|n| {
                n["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            })
            .count();
        Ok((ready == 2).then_some(()))
    })?;

    c.kubectl_ok(&["create", "serviceaccount", "robot"])?;
    c.guest_disk_claim("disk-a")?;
    c.guest_disk_claim("disk-b")?;
    let t0 = Instant::now();
    c.apply(&vm("a", "j1", "robot"))?;
    c.apply(&vmi("b", "j2", "spy"))?;

    // b names a ServiceAccount that does not exist: it fails, naming the field.
    let field = "spec.volumes[1].serviceAccount.serviceAccountName";
    let failed = c
        .wait_until("VMI b fails", BOOT, || {
            let v = c.get_json(&["vmi", "b"]);
            Ok(v.ok().filter(|v| v["status"]["phase"] == "Failed"))
        })
        .map_err(|e| {
            anyhow::anyhow!(
                "{e}\nVMI b: {:?}\nj2: {}",
                c.get_json(&["vmi", "b"]).map(|v| v["status"].clone()),
                c.agent_log("j2")
            )
        })?;
    assert!(
        failed["status"].to_string().contains(field),
        "{}\n{}",
        failed["status"],
        c.agent_log("j2")
    );
    assert_eq!(failed["status"]["nodeName"], "j2", "{}", failed["status"]);
    assert!(
        failed["status"]
            .to_string()
            .contains(r#"\"spy\" not found"#),
        "{}",
        failed["status"]
    );

    // a boots on j1; the guest prints its serviceAccount disk.
    let uid = c.wait_until("VMI a Running", BOOT, || {
        let v = c.get_json(&["vmi", "a"]);
        Ok(v.ok().and_then(|v| {
            (v["status"]["phase"] == "Running").then(|| {
                v["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            })
        }))
    })?;
    let log = c
        .extra_agent_dir("j1")
        .join("vmis")
        .join(&uid)
        .join("serial.log");
    let text = c.wait_until("the guest prints its token", BOOT, || {
        let text =
            String::from_utf8_lossy(&std::fs::read(&log).unwrap_or_default()).replace('\r', "");
        Ok(text
            .lines()
            .any(|l| l.starts_with("SA-TOKEN ") && l.ends_with(" END"))
            .then_some(text))
    })?;
    eprintln!("VM a booted and printed its token in {:?}", t0.elapsed());
    let line = |p: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(p))
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(line("SA-NAMESPACE "), "default", "{text}");
    assert_eq!(line("SA-CA "), "-----BEGIN CERTIFICATE-----", "{text}");
    let token = line("SA-TOKEN ").trim_end_matches(" END").to_string();
    assert!(token.split('.').count() == 3, "{token:?}");

    // The guest's token is the ServiceAccount's.
    let out = whoami(&c, &token)?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let who: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(
        who["status"]["userInfo"]["username"],
        "system:serviceaccount:default:robot"
    );

    // Acting as node j1.
    let kc = c.node_credential_kubeconfig("j1")?;
    let a = c.get_json(&["vmi", "a"])?;
    c.kubectl_ok(&["create", "serviceaccount", "spy"])?;
    // b's ServiceAccount, bound to b (on j2): not j1's to ask.
    refused(
        &token_request_as(&c, &kc, "spy", Some(vmi_ref(&failed)))?,
        "Forbidden",
    )?;
    // b's ServiceAccount, bound to its own VMI a, which does not reference it.
    refused(
        &token_request_as(&c, &kc, "spy", Some(vmi_ref(&a)))?,
        "Forbidden",
    )?;
    // An unreferenced ServiceAccount; an unbound token.
    refused(
        &token_request_as(&c, &kc, "default", Some(vmi_ref(&a)))?,
        "Forbidden",
    )?;
    refused(&token_request_as(&c, &kc, "robot", None)?, "Forbidden")?;
    // What its agent did: a's ServiceAccount bound to a.
    let ok = token_request_as(&c, &kc, "robot", Some(vmi_ref(&a)))?;
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    // Another kind of binding is refused naming the field (admin).
    let pod = json!({"kind": "Pod", "apiVersion": "v1", "name": "p"});
    refused(
        &token_request_as(&c, &c.kubeconfig.clone(), "robot", Some(pod))?,
        "spec.boundObjectRef.kind",
    )?;

    // The token dies with its VMI.
    c.kubectl_ok(&["delete", "vm", "a", "--wait=false"])?;
    let t1 = Instant::now();
    c.wait_until("the guest's token refused", Duration::from_secs(60), || {
        let out = whoami(&c, &token)?;
        Ok((!out.status.success()).then_some(out))
    })
    .and_then(|out| refused(&out, "Unauthorized"))?;
    eprintln!("token refused {:?} after the VM's delete", t1.elapsed());
    Ok(())
}
