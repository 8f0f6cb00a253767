//! Issue #14 against the real kubectl: CustomResourceDefinitions (read-only, from the resource
//! table), `kubectl explain` descriptions, unknown kinds, Kubernetes' columns for built-in
//! kinds and kubevirt.io/v1alpha3 served beside v1.

mod common;

use std::path::Path;

use anyhow::{Result, bail};
use ferrovirt_apiserver::{EventRecord, Server, record_event};
use serde_json::{Value, json};

/// The header line and the row of `name` in a kubectl table, whitespace-normalized.
fn header_and_row(table: &str, name: &str) -> (String, String) {
    let norm = |l: &str| l.split_whitespace().collect::<Vec<_>>().join(" ");
    let header = table.lines().next().map(norm).unwrap_or_default();
    let row = table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .map(norm)
        .unwrap_or_else(|| panic!("no row {name} in:\n{table}"));
    (header, row)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crds_are_listed_and_read_only() -> Result<()> {
    let mut t = common::start().await?;
    let table = t.kubectl_ok(&["get", "crd"]).await?;
    let (header, row) = header_and_row(&table, "virtualmachines.kubevirt.io");
    assert_eq!(header, "NAME CREATED AT");
    assert!(row.ends_with('Z'), "{row}");
    for name in [
        "datavolumes.cdi.kubevirt.io",
        "virtualmachineclusterinstancetypes.instancetype.kubevirt.io",
        "virtualmachinesnapshots.snapshot.kubevirt.io",
        "migrationpolicies.migrations.kubevirt.io",
        "hyperconvergeds.hco.kubevirt.io",
    ] {
        assert!(table.contains(name), "{name} missing:\n{table}");
    }
    assert!(!table.contains("configmaps"), "{table}");

    let yaml = t
        .kubectl_ok(&["get", "crd", "virtualmachines.kubevirt.io", "-o", "yaml"])
        .await?;
    for want in [
        "kind: CustomResourceDefinition",
        "group: kubevirt.io",
        "scope: Namespaced",
        "- vm",
        "- all",
        "openAPIV3Schema:",
        "additionalPrinterColumns:",
        "jsonPath: .status.printableStatus",
        "type: Established",
        "type: NamesAccepted",
        "name: v1alpha3",
        "storage: true",
    ] {
        assert!(yaml.contains(want), "{want} missing:\n{yaml}");
    }
    let rs = t
        .kubectl_ok(&[
            "get",
            "crd",
            "virtualmachineinstancereplicasets.kubevirt.io",
            "-o",
            "jsonpath={.spec.versions[0].subresources.scale.specReplicasPath}",
        ])
        .await?;
    assert_eq!(rs, ".spec.replicas");

    let api = t.kubectl_ok(&["api-resources"]).await?;
    assert!(
        api.lines()
            .any(|l| l.starts_with("customresourcedefinitions ") && l.contains("crd,crds")),
        "{api}"
    );
    let groups = t.request("GET", "/apis", None).await?.json();
    assert!(
        groups["groups"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g["name"] == "apiextensions.k8s.io"),
        "{groups}"
    );

    // Read-only: every write is 405 with a Status.
    let base = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions";
    let item = format!("{base}/virtualmachines.kubevirt.io");
    let body = json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "foos.example.com"}});
    for (method, path, body) in [
        ("POST", base, Some(body.clone())),
        ("PUT", item.as_str(), Some(body.clone())),
        ("DELETE", item.as_str(), None),
        ("DELETE", base, None),
    ] {
        let r = t.request(method, path, body).await?;
        assert_eq!(r.status, 405, "{method} {path}: {}", r.text());
        assert_eq!(r.json()["kind"], "Status", "{}", r.text());
        assert_eq!(r.json()["reason"], "MethodNotAllowed", "{}", r.text());
    }
    let r = t
        .request_as(
            Some(&t.srv().token.clone()),
            "PATCH",
            &item,
            Some("application/merge-patch+json"),
            br#"{"metadata":{"labels":{"a":"b"}}}"#.to_vec(),
        )
        .await?;
    assert_eq!(r.status, 405, "{}", r.text());
    let del = t
        .kubectl(&["delete", "crd", "virtualmachines.kubevirt.io"])
        .await?;
    assert!(!del.status.success());

    // A watch sees them.
    let w = t
        .request("GET", &format!("{base}?watch=1&timeoutSeconds=1"), None)
        .await?;
    assert!(w.text().contains("\"ADDED\"") && w.text().contains("datavolumes.cdi.kubevirt.io"));

    // A restart keeps their identity (uid, creation time).
    let before = crd_identity(&t).await?;
    if let Some(s) = t.server.take() {
        s.shutdown().await;
    }
    t.server = Some(Server::start(common::options(t.dir.path())).await?);
    assert_eq!(crd_identity(&t).await?, before);
    t.shutdown().await;
    Ok(())
}

async fn crd_identity(t: &common::TestServer) -> Result<String> {
    t.kubectl_ok(&[
        "get",
        "crd",
        "virtualmachines.kubevirt.io",
        "-o",
        "jsonpath={.metadata.uid} {.metadata.creationTimestamp} {.metadata.resourceVersion}",
    ])
    .await
}

/// kubectl binaries to run `explain` with: the default one and the oldest and newest bundled.
fn kubectls() -> Vec<String> {
    let mut out = vec![common::KUBECTL.to_string()];
    for v in ["1.27", "1.33"] {
        let p = format!("/usr/lib/google-cloud-sdk/bin/kubectl.{v}");
        if Path::new(&p).exists() {
            out.push(p);
        }
    }
    out
}

async fn run_kubectl(bin: &str, t: &common::TestServer, args: &[&str]) -> Result<String> {
    let cache = tempfile::tempdir()?;
    let out = tokio::process::Command::new(bin)
        .arg("--kubeconfig")
        .arg(t.kubeconfig())
        .arg("--cache-dir")
        .arg(cache.path())
        .args(args)
        .kill_on_drop(true)
        .output()
        .await?;
    if !out.status.success() {
        bail!("{bin} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_prints_field_descriptions() -> Result<()> {
    let t = common::start().await?;
    for bin in kubectls() {
        let top = run_kubectl(&bin, &t, &["explain", "vm"]).await?;
        for want in [
            "VirtualMachine",
            "A virtual machine",
            "desired state",
            "observed state",
        ] {
            assert!(top.contains(want), "{bin}: {want} missing:\n{top}");
        }
        let devices = run_kubectl(
            &bin,
            &t,
            &["explain", "vm.spec.template.spec.domain.devices"],
        )
        .await?;
        for want in [
            "disks",
            "The guest's disks",
            "interfaces",
            "network interfaces",
            "autoattachSerialConsole",
        ] {
            assert!(devices.contains(want), "{bin}: {want} missing:\n{devices}");
        }
        assert!(!devices.contains("<no description>"), "{bin}:\n{devices}");
        let strategy = run_kubectl(&bin, &t, &["explain", "vm.spec.runStrategy"]).await?;
        assert!(strategy.contains("RerunOnFailure"), "{bin}:\n{strategy}");
        let disks = run_kubectl(
            &bin,
            &t,
            &["explain", "vmi.spec.domain.devices.disks.bootOrder"],
        )
        .await?;
        assert!(disks.contains("boot order"), "{bin}:\n{disks}");
    }
    t.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_kinds_have_no_matches() -> Result<()> {
    let t = common::start().await?;
    let out = t
        .kubectl_stdin(
            &["apply", "-f", "-"],
            Some("apiVersion: bar/v1\nkind: Foo\nmetadata:\n  name: x\n"),
        )
        .await?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(r#"no matches for kind "Foo" in version "bar/v1""#),
        "{err}"
    );
    assert!(!err.contains("failed to list CRDs"), "{err}");
    // The oldest and newest bundled kubectl say the same.
    let file = t.dir.path().join("foo.yaml");
    std::fs::write(
        &file,
        "apiVersion: bar/v1\nkind: Foo\nmetadata:\n  name: x\n",
    )?;
    let file = file.to_string_lossy().into_owned();
    for bin in kubectls() {
        let err = run_kubectl(&bin, &t, &["apply", "-f", &file])
            .await
            .expect_err("an unknown kind cannot apply")
            .to_string();
        assert!(
            err.contains(r#"no matches for kind "Foo" in version "bar/v1""#)
                && !err.contains("failed to list CRDs"),
            "{bin}: {err}"
        );
    }
    // A known group with an unknown kind, and a known kind in an unserved version.
    for (av, kind) in [
        ("kubevirt.io/v1", "Nope"),
        ("kubevirt.io/v9", "VirtualMachine"),
    ] {
        let out = t
            .kubectl_stdin(
                &["apply", "-f", "-"],
                Some(&format!(
                    "apiVersion: {av}\nkind: {kind}\nmetadata:\n  name: x\n"
                )),
            )
            .await?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!(
                r#"no matches for kind "{kind}" in version "{av}""#
            )),
            "{err}"
        );
    }
    t.shutdown().await;
    Ok(())
}

const CORE: &str = r#"
apiVersion: v1
kind: ConfigMap
metadata: {name: two}
data: {a: "1", b: "2"}
---
apiVersion: v1
kind: Secret
metadata: {name: s1}
type: Opaque
stringData: {k: v}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: sa1}
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: fast
  annotations: {storageclass.kubernetes.io/is-default-class: "true"}
provisioner: ferrovirt.io/local
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: c1}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: fast
  resources: {requests: {storage: 1Gi}}
---
apiVersion: v1
kind: PersistentVolume
metadata: {name: pv1}
spec:
  capacity: {storage: 1Gi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: fast
  claimRef: {namespace: default, name: c1}
  hostPath: {path: /tmp/pv1}
---
apiVersion: coordination.k8s.io/v1
kind: Lease
metadata: {name: l1}
spec: {holderIdentity: me}
---
apiVersion: v1
kind: Node
metadata:
  name: n1
  labels: {node-role.kubernetes.io/control-plane: ""}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builtin_kinds_print_kubernetes_columns() -> Result<()> {
    let t = common::start().await?;
    t.apply(CORE).await?;
    t.kubectl_ok(&[
        "patch",
        "node",
        "n1",
        "--subresource=status",
        "--type=merge",
        "-p",
        r#"{"status":{"conditions":[{"type":"Ready","status":"True"}],"nodeInfo":{"kubeletVersion":"v1.33.0"}}}"#,
    ])
    .await?;
    record_event(
        t.srv().store.as_ref(),
        &EventRecord {
            involved: json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "two", "namespace": "default"}}),
            type_: "Normal".into(),
            reason: "Tested".into(),
            message: "hello columns".into(),
            component: "test".into(),
        },
    )
    .await?;
    let cases: &[(&[&str], &str, &str, &str)] = &[
        (&["get", "cm"], "two", "NAME DATA AGE", "two 2 "),
        (
            &["get", "secret"],
            "s1",
            "NAME TYPE DATA AGE",
            "s1 Opaque 1 ",
        ),
        (&["get", "sa"], "sa1", "NAME SECRETS AGE", "sa1 0 "),
        (
            &["get", "sc"],
            "fast",
            "NAME PROVISIONER RECLAIMPOLICY VOLUMEBINDINGMODE ALLOWVOLUMEEXPANSION AGE",
            "fast (default) ferrovirt.io/local Delete Immediate false ",
        ),
        (
            &["get", "pvc"],
            "c1",
            "NAME STATUS VOLUME CAPACITY ACCESS MODES STORAGECLASS VOLUMEATTRIBUTESCLASS AGE",
            "c1 ",
        ),
        (
            &["get", "pv"],
            "pv1",
            "NAME CAPACITY ACCESS MODES RECLAIM POLICY STATUS CLAIM STORAGECLASS VOLUMEATTRIBUTESCLASS REASON AGE",
            "pv1 1Gi RWO Retain ",
        ),
        (&["get", "lease"], "l1", "NAME HOLDER AGE", "l1 me "),
        (&["get", "ns"], "default", "NAME STATUS AGE", "default "),
        (
            &["get", "nodes"],
            "n1",
            "NAME STATUS ROLES AGE VERSION",
            "n1 Ready control-plane ",
        ),
    ];
    for (args, name, want_header, row_prefix) in cases {
        let out = t.kubectl_ok(args).await?;
        let (header, row) = header_and_row(&out, name);
        assert_eq!(&header, want_header, "{args:?}:\n{out}");
        assert!(row.starts_with(row_prefix), "{args:?}: {row}");
    }
    let pv = t.kubectl_ok(&["get", "pv", "pv1"]).await?;
    assert!(pv.contains("default/c1") && pv.contains("<unset>"), "{pv}");
    let wide = t.kubectl_ok(&["get", "pvc", "-o", "wide"]).await?;
    assert!(
        wide.lines().next().unwrap_or("").contains("VOLUMEMODE"),
        "{wide}"
    );
    let node = t.kubectl_ok(&["get", "nodes", "n1"]).await?;
    assert!(node.contains("v1.33.0"), "{node}");

    let events = t.kubectl_ok(&["get", "events"]).await?;
    let header = events.lines().next().unwrap_or_default();
    assert_eq!(
        header.split_whitespace().collect::<Vec<_>>().join(" "),
        "LAST SEEN TYPE REASON OBJECT MESSAGE",
        "{events}"
    );
    assert!(
        events.contains("configmap/two") && events.contains("hello columns"),
        "{events}"
    );
    let wide = t.kubectl_ok(&["get", "events", "-o", "wide"]).await?;
    assert!(
        wide.lines().next().unwrap_or("").contains("COUNT"),
        "{wide}"
    );
    let v1 = t.kubectl_ok(&["get", "events.events.k8s.io"]).await?;
    assert!(v1.contains("configmap/two"), "{v1}");
    t.shutdown().await;
    Ok(())
}

const VM_V1ALPHA3: &str = r#"
apiVersion: kubevirt.io/v1alpha3
kind: VirtualMachine
metadata:
  name: oldvm
spec:
  runStrategy: Halted
  template:
    spec:
      domain:
        devices: {}
        resources:
          requests:
            memory: 64Mi
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1alpha3_is_served_and_stored_as_v1() -> Result<()> {
    let t = common::start().await?;
    let group = t.request("GET", "/apis/kubevirt.io", None).await?.json();
    let versions: Vec<&str> = group["versions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["version"].as_str().unwrap())
        .collect();
    assert_eq!(versions, ["v1", "v1alpha3"]);
    assert_eq!(group["preferredVersion"]["version"], "v1");

    let out = t
        .kubectl_stdin(&["apply", "-f", "-"], Some(VM_V1ALPHA3))
        .await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("virtualmachine.kubevirt.io/oldvm created")
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("deprecated"),
        "no deprecation warning: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let old = t
        .kubectl_ok(&[
            "get",
            "virtualmachines.v1alpha3.kubevirt.io",
            "oldvm",
            "-o",
            "jsonpath={.apiVersion}",
        ])
        .await?;
    assert_eq!(old, "kubevirt.io/v1alpha3");
    let new = t
        .kubectl_ok(&["get", "vm", "oldvm", "-o", "jsonpath={.apiVersion}"])
        .await?;
    assert_eq!(new, "kubevirt.io/v1");
    let stored = t
        .srv()
        .store
        .get("/registry/kubevirt.io/virtualmachines/default/oldvm")
        .await?
        .expect("stored");
    let stored: Value = serde_json::from_slice(&stored.value)?;
    assert_eq!(stored["apiVersion"], "kubevirt.io/v1");

    let again = t
        .kubectl_stdin(&["apply", "-f", "-"], Some(VM_V1ALPHA3))
        .await?;
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("unchanged"),
        "{}{}",
        String::from_utf8_lossy(&again.stdout),
        String::from_utf8_lossy(&again.stderr)
    );
    let list = t
        .request(
            "GET",
            "/apis/kubevirt.io/v1alpha3/namespaces/default/virtualmachines",
            None,
        )
        .await?
        .json();
    assert_eq!(list["apiVersion"], "kubevirt.io/v1alpha3");
    assert_eq!(list["items"][0]["apiVersion"], "kubevirt.io/v1alpha3");
    let w = t
        .request(
            "GET",
            "/apis/kubevirt.io/v1alpha3/namespaces/default/virtualmachines?watch=1&timeoutSeconds=1",
            None,
        )
        .await?;
    assert!(
        w.text().contains(r#""apiVersion":"kubevirt.io/v1alpha3""#),
        "{}",
        w.text()
    );
    // The `all` category names each resource once although two versions serve it.
    let all = t.kubectl_ok(&["get", "all", "-o", "name"]).await?;
    assert_eq!(
        all.lines()
            .filter(|l| *l == "virtualmachine.kubevirt.io/oldvm")
            .count(),
        1,
        "{all}"
    );
    t.kubectl_ok(&["delete", "virtualmachines.v1alpha3.kubevirt.io", "oldvm"])
        .await?;
    t.shutdown().await;
    Ok(())
}
