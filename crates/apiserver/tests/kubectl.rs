//! The acceptance bar: the machine's real kubectl against a real server.

mod common;

use std::time::Duration;

use anyhow::Result;
use ferrovirt_apiserver::{EventRecord, record_event};
use serde_json::json;
use tokio::io::AsyncReadExt;

const VM: &str = r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: testvm
  labels:
    app: demo
spec:
  runStrategy: Halted
  template:
    metadata:
      labels:
        kubevirt.io/domain: testvm
    spec:
      domain:
        devices:
          disks:
          - name: containerdisk
            disk:
              bus: virtio
        resources:
          requests:
            memory: 128Mi
      volumes:
      - name: containerdisk
        containerDisk:
          image: quay.io/kubevirt/cirros-container-disk-demo
"#;

const CM: &str = r#"
apiVersion: v1
kind: ConfigMap
metadata:
  name: settings
  labels:
    tier: web
data:
  color: blue
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_resources_lists_kinds_with_short_names() -> Result<()> {
    let t = common::start().await?;
    let out = t.kubectl_ok(&["api-resources"]).await?;
    let vm_line = out
        .lines()
        .find(|l| l.starts_with("virtualmachines "))
        .unwrap_or_else(|| panic!("no virtualmachines in:\n{out}"));
    assert!(
        vm_line.contains("vm,vms") && vm_line.contains("kubevirt.io/v1"),
        "{vm_line}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("configmaps ") && l.contains(" cm ")),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("namespaces ") && l.contains("false")),
        "{out}"
    );
    let version = t.kubectl_ok(&["version", "-o", "json"]).await?;
    assert!(version.contains("serverVersion"), "{version}");
    t.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configmap_apply_get_patch_label_delete() -> Result<()> {
    let t = common::start().await?;
    assert!(t.apply(CM).await?.contains("configmap/settings created"));
    let changed = CM.replace("color: blue", "color: green");
    assert!(
        t.apply(&changed)
            .await?
            .contains("configmap/settings configured")
    );
    assert!(t.apply(&changed).await?.contains("unchanged"));

    let table = t.kubectl_ok(&["get", "cm"]).await?;
    assert!(
        table.contains("NAME") && table.contains("settings") && table.contains("AGE"),
        "{table}"
    );
    let yaml = t
        .kubectl_ok(&["get", "cm", "settings", "-o", "yaml"])
        .await?;
    assert!(
        yaml.contains("color: green") && yaml.contains("resourceVersion:"),
        "{yaml}"
    );
    let all = t.kubectl_ok(&["get", "configmaps", "-A"]).await?;
    assert!(
        all.contains("NAMESPACE") && all.contains("default"),
        "{all}"
    );
    let sel = t
        .kubectl_ok(&["get", "cm", "-l", "tier=web", "-o", "name"])
        .await?;
    assert_eq!(sel.trim(), "configmap/settings");
    let none = t
        .kubectl_ok(&["get", "cm", "-l", "tier in (db)", "-o", "name"])
        .await?;
    assert_eq!(none.trim(), "");

    t.kubectl_ok(&[
        "patch",
        "cm",
        "settings",
        "--type=merge",
        "-p",
        r#"{"data":{"size":"xl"}}"#,
    ])
    .await?;
    t.kubectl_ok(&[
        "patch",
        "cm",
        "settings",
        "--type=json",
        "-p",
        r#"[{"op":"replace","path":"/data/color","value":"red"}]"#,
    ])
    .await?;
    t.kubectl_ok(&[
        "patch",
        "cm",
        "settings",
        "-p",
        r#"{"data":{"shape":"round"}}"#,
    ])
    .await?;
    t.kubectl_ok(&["label", "cm", "settings", "owner=me"])
        .await?;
    let j: serde_json::Value = serde_json::from_str(
        &t.kubectl_ok(&["get", "cm", "settings", "-o", "json"])
            .await?,
    )?;
    assert_eq!(
        j["data"],
        json!({"color": "red", "size": "xl", "shape": "round"})
    );
    assert_eq!(j["metadata"]["labels"]["owner"], "me");

    let del = t.kubectl_ok(&["delete", "cm", "settings"]).await?;
    assert!(del.contains("deleted"), "{del}");
    let gone = t.kubectl(&["get", "cm", "settings"]).await?;
    assert!(!gone.status.success());
    assert!(String::from_utf8_lossy(&gone.stderr).contains("configmaps \"settings\" not found"));
    t.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn virtual_machine_apply_get_and_strict_validation() -> Result<()> {
    let t = common::start().await?;
    assert!(
        t.apply(VM)
            .await?
            .contains("virtualmachine.kubevirt.io/testvm created")
    );
    assert!(t.apply(VM).await?.contains("unchanged"));
    let changed = VM.replace("app: demo", "app: demo2");
    assert!(t.apply(&changed).await?.contains("configured"));
    let table = t.kubectl_ok(&["get", "vms"]).await?;
    assert!(table.contains("testvm") && table.contains("AGE"), "{table}");
    let wide = t
        .kubectl_ok(&["get", "vm", "testvm", "-o", "wide", "--show-labels"])
        .await?;
    assert!(wide.contains("app=demo2"), "{wide}");

    // An unknown field fails under kubectl's default strict validation, naming the field.
    let bad = VM
        .replace("  name: testvm\n", "  name: testvm2\n  bogusField: 1\n")
        .replace(
            "  runStrategy: Halted\n",
            "  runStrategy: Halted\n  bogusSpec: 1\n",
        );
    let out = t.kubectl_stdin(&["apply", "-f", "-"], Some(&bad)).await?;
    assert!(
        !out.status.success(),
        "strict validation accepted an unknown field"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown field \"spec.bogusSpec\"") && err.contains("metadata.bogusField"),
        "{err}"
    );
    let explain = t.kubectl_ok(&["explain", "vm.spec.runStrategy"]).await?;
    assert!(explain.contains("runStrategy"), "{explain}");
    // ...and is accepted (with a warning) when validation is relaxed.
    let out = t
        .kubectl_stdin(&["apply", "--validate=warn", "-f", "-"], Some(&bad))
        .await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let raw = t.kubectl_ok(&["get", "--raw", "/openapi/v2"]).await?;
    let doc: serde_json::Value = serde_json::from_str(&raw)?;
    assert_eq!(doc["swagger"], "2.0");
    assert!(
        doc["definitions"]["io.kubevirt.v1.VirtualMachine"]["x-kubernetes-group-version-kind"]
            .is_array()
    );
    t.shutdown().await;
    Ok(())
}

/// Runs `kubectl get cm <args> -w`, applies `change` once the first output arrived, and waits
/// (bounded) until `expect` shows up in the output.
async fn watch_until(
    t: &common::TestServer,
    extra: &[&str],
    change: &[&str],
    expect: &str,
) -> Result<String> {
    common::require_kubectl();
    let mut child = tokio::process::Command::new(common::KUBECTL)
        .arg("--kubeconfig")
        .arg(t.kubeconfig())
        .arg("--cache-dir")
        .arg(t.dir.path().join("watch-cache"))
        .args(["get", "cm", "-w", "--request-timeout=20s"])
        .args(extra)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut stdout = child.stdout.take().expect("stdout");
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut changed = false;
    while !seen.contains(expect) {
        let n = tokio::time::timeout_at(deadline, stdout.read(&mut buf)).await??;
        assert!(n > 0, "kubectl get -w ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        if !changed && seen.contains("settings") {
            t.kubectl_ok(change).await?;
            changed = true;
        }
    }
    child.kill().await?;
    Ok(seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_watch_sees_a_change() -> Result<()> {
    let t = common::start().await?;
    t.apply(CM).await?;
    // Server-side Table rows (the default output), labels from the row metadata.
    let seen = watch_until(
        &t,
        &["--show-labels"],
        &["label", "cm", "settings", "color=purple"],
        "color=purple",
    )
    .await?;
    assert!(seen.contains("NAME") && seen.contains("LABELS"), "{seen}");
    // Full objects (custom columns).
    watch_until(
        &t,
        &["-o", "custom-columns=NAME:.metadata.name,COLOR:.data.color"],
        &[
            "patch",
            "cm",
            "settings",
            "--type=merge",
            "-p",
            r#"{"data":{"color":"orange"}}"#,
        ],
        "orange",
    )
    .await?;
    t.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describe_shows_events() -> Result<()> {
    let t = common::start().await?;
    t.apply(VM).await?;
    let vm = t
        .request(
            "GET",
            "/apis/kubevirt.io/v1/namespaces/default/virtualmachines/testvm",
            None,
        )
        .await?
        .json();
    record_event(
        t.srv().store.as_ref(),
        &EventRecord {
            involved: vm.clone(),
            type_: "Normal".into(),
            reason: "SuccessfulCreate".into(),
            message: "Started the virtual machine by creating the new virtual machine instance"
                .into(),
            component: "virtualmachine-controller".into(),
        },
    )
    .await?;
    // events.k8s.io/v1 writes are visible as core/v1 events too.
    let ev = json!({
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": "testvm.manual", "namespace": "default"},
        "regarding": {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "name": "testvm",
                      "namespace": "default", "uid": vm["metadata"]["uid"]},
        "reason": "ManualNote", "note": "written through events.k8s.io", "type": "Warning",
        "reportingController": "test", "reportingInstance": "test-1", "action": "Note",
        "eventTime": "2026-01-01T00:00:00.000000Z"
    });
    let r = t
        .request(
            "POST",
            "/apis/events.k8s.io/v1/namespaces/default/events",
            Some(ev),
        )
        .await?;
    assert_eq!(r.status, 201, "{}", r.text());
    let out = t.kubectl_ok(&["describe", "vm", "testvm"]).await?;
    assert!(
        out.contains("SuccessfulCreate") && out.contains("ManualNote"),
        "{out}"
    );
    let evs = t.kubectl_ok(&["get", "events"]).await?;
    assert!(evs.contains("SuccessfulCreate"), "{evs}");
    t.shutdown().await;
    Ok(())
}

async fn set_ready(t: &common::TestServer) -> Result<()> {
    let patch = json!({"status": {"conditions": [{"type": "Ready", "status": "True"}], "printableStatus": "Running"}});
    let r = t
        .request_as(
            Some(&t.srv().token.clone()),
            "PATCH",
            "/apis/kubevirt.io/v1/namespaces/default/virtualmachines/testvm/status",
            Some("application/merge-patch+json"),
            serde_json::to_vec(&patch)?,
        )
        .await?;
    assert_eq!(r.status, 200, "{}", r.text());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_condition_later_and_already_true() -> Result<()> {
    let t = common::start().await?;
    t.apply(VM).await?;
    let waiter = {
        let args = [
            "wait",
            "vm/testvm",
            "--for=condition=Ready",
            "--timeout=40s",
        ];
        let fut = t.kubectl(&args);
        let setter = async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            set_ready(&t).await
        };
        let (out, set) = tokio::join!(fut, setter);
        set?;
        out?
    };
    assert!(
        waiter.status.success(),
        "{}",
        String::from_utf8_lossy(&waiter.stderr)
    );
    assert!(String::from_utf8_lossy(&waiter.stdout).contains("condition met"));
    let again = t
        .kubectl_ok(&[
            "wait",
            "vm/testvm",
            "--for=condition=Ready",
            "--timeout=10s",
        ])
        .await?;
    assert!(again.contains("condition met"), "{again}");
    let table = t.kubectl_ok(&["get", "vm", "testvm"]).await?;
    assert!(
        table.contains("Running") && table.contains("True"),
        "{table}"
    );
    t.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_side_apply_is_accepted() -> Result<()> {
    let t = common::start().await?;
    let out = t
        .kubectl_stdin(&["apply", "--server-side", "-f", "-"], Some(CM))
        .await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("serverside-applied"));
    let changed = CM.replace("color: blue", "color: teal");
    let out = t
        .kubectl_stdin(&["apply", "--server-side", "-f", "-"], Some(&changed))
        .await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = t
        .kubectl_ok(&["get", "cm", "settings", "-o", "jsonpath={.data.color}"])
        .await?;
    assert_eq!(got, "teal");
    t.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_creates_and_namespace_deletion() -> Result<()> {
    // kubectl ≥ 1.32 sends protobuf bodies from its typed `create` subcommands.
    let t = common::start().await?;
    assert!(
        t.kubectl_ok(&["create", "namespace", "proj"])
            .await?
            .contains("namespace/proj created")
    );
    t.kubectl_ok(&[
        "-n",
        "proj",
        "create",
        "configmap",
        "c",
        "--from-literal=a=b",
    ])
    .await?;
    t.kubectl_ok(&[
        "-n",
        "proj",
        "create",
        "secret",
        "generic",
        "s",
        "--from-literal=p=q",
    ])
    .await?;
    t.kubectl_ok(&["-n", "proj", "create", "serviceaccount", "robot"])
        .await?;
    let got = t
        .kubectl_ok(&[
            "-n",
            "proj",
            "get",
            "secret",
            "s",
            "-o",
            "jsonpath={.data.p}",
        ])
        .await?;
    assert_eq!(got, "cQ==");
    let got = t
        .kubectl_ok(&["-n", "proj", "get", "cm", "c", "-o", "jsonpath={.data.a}"])
        .await?;
    assert_eq!(got, "b");
    let out = t
        .kubectl_ok(&["delete", "namespace", "proj", "--timeout=30s"])
        .await?;
    assert!(out.contains("deleted"), "{out}");
    let gone = t.kubectl(&["get", "namespace", "proj"]).await?;
    assert!(!gone.status.success());
    let left = t
        .request("GET", "/api/v1/namespaces/proj/configmaps", None)
        .await?
        .json();
    assert_eq!(left["items"], json!([]));
    t.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bundled_kubectl_version_applies() -> Result<()> {
    // The versioned kubectl binaries installed beside /usr/bin/kubectl (1.27–1.33): older ones
    // need /openapi/v2 as protobuf, newer ones use /openapi/v3 and protobuf request bodies.
    common::require_kubectl();
    let dir = std::fs::canonicalize(common::KUBECTL)?
        .parent()
        .map(std::path::Path::to_path_buf)
        .expect("kubectl has a directory");
    let t = common::start().await?;
    for minor in 27..=33 {
        let bin = dir.join(format!("kubectl.1.{minor}"));
        assert!(bin.exists(), "{} is missing", bin.display());
        let cache = t.dir.path().join(format!("cache-{minor}"));
        let run = |args: Vec<String>, stdin: Option<String>| {
            let bin = bin.clone();
            let cache = cache.clone();
            let kc = t.kubeconfig();
            async move {
                let mut cmd = tokio::process::Command::new(&bin);
                cmd.arg("--kubeconfig")
                    .arg(kc)
                    .arg("--cache-dir")
                    .arg(cache)
                    .args(&args);
                cmd.stdin(std::process::Stdio::piped())
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped());
                let mut child = cmd.spawn()?;
                if let Some(s) = stdin {
                    use tokio::io::AsyncWriteExt;
                    let mut w = child.stdin.take().expect("stdin");
                    w.write_all(s.as_bytes()).await?;
                }
                drop(child.stdin.take());
                let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
                    .await??;
                anyhow::Ok(out)
            }
        };
        let name = format!("v{minor}");
        let manifest = CM.replace("name: settings", &format!("name: {name}"));
        for (body, expect) in [
            (manifest.clone(), "created"),
            (manifest.replace("blue", "red"), "configured"),
        ] {
            let out = run(vec!["apply".into(), "-f".into(), "-".into()], Some(body)).await?;
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && stdout.contains(expect),
                "kubectl 1.{minor} apply: {stdout}{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let bad = VM
            .replace("name: testvm", &format!("name: {name}"))
            .replace(
                "  runStrategy: Halted\n",
                "  runStrategy: Halted\n  bogusSpec: 1\n",
            );
        let out = run(vec!["apply".into(), "-f".into(), "-".into()], Some(bad)).await?;
        assert!(
            !out.status.success(),
            "kubectl 1.{minor} accepted an unknown field"
        );
        assert!(String::from_utf8_lossy(&out.stderr).contains("bogusSpec"));
        let out = run(
            vec![
                "get".into(),
                "cm".into(),
                name.clone(),
                "-o".into(),
                "jsonpath={.data.color}".into(),
            ],
            None,
        )
        .await?;
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "red",
            "kubectl 1.{minor}"
        );
    }
    t.shutdown().await;
    Ok(())
}
