//! VirtualMachineExport end to end (docs/export.md), against the real binary, kubectl, curl and
//! TCG guests: a VM boots from an imported `local` root claim and stops; an export of it
//! becomes Ready; `ferrovirt vmexport
//! download` fetches the disk raw and gzip, and both equal the volume's bytes (SHA-256 of the
//! file on the node); tokens are checked (none, wrong, another export's, another
//! namespace's); after a VirtualMachineSnapshot the live volume is a layer chain and its
//! export (flattened through qemu-nbd) still equals the bytes, as does the snapshot's own
//! export, which ends at its TTL; and the `all` manifests applied to a second server import
//! the disk from the first server's export URL (its CA, the token header Secret) and the VM
//! boots there. A second test exports a running VM: the export takes an online
//! VirtualMachineSnapshot of it (owned by the export, deleted with it) and serves the bytes of
//! that moment — a marker the guest wrote before is in the download, one written after is not.

use std::process::{Command, Output};
use std::time::Duration;

use anyhow::Context;
use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest, serve_files};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_ferrovirt");
const BOOT: Duration = Duration::from_secs(180);
const STEP: Duration = Duration::from_secs(90);

fn fv(c: &Cluster, args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new(BIN)
        .arg("--kubeconfig")
        .arg(&c.kubeconfig)
        .args(args)
        .output()?)
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn fv_ok(c: &Cluster, args: &[&str]) -> anyhow::Result<String> {
    let o = fv(c, args)?;
    anyhow::ensure!(o.status.success(), "ferrovirt {args:?}: {}", text(&o));
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

fn sha256_file(path: &std::path::Path) -> anyhow::Result<String> {
    let out = Command::new("sha256sum").arg(path).output()?;
    anyhow::ensure!(out.status.success(), "sha256sum {}", path.display());
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string())
}

fn sha256_gunzip(path: &std::path::Path) -> anyhow::Result<String> {
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("gzip -dc '{}' | sha256sum", path.display()))
        .output()?;
    anyhow::ensure!(out.status.success(), "gunzip {}", path.display());
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string())
}

/// `curl` GET of `url` with `token` (header) on cluster `c`'s CA; the HTTP status.
fn curl_status(c: &Cluster, url: &str, token: Option<&str>) -> anyhow::Result<u16> {
    let ca = c.data_dir.join("tls").join("ca.crt");
    let mut cmd = Command::new("curl");
    cmd.args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "--cacert"])
        .arg(&ca);
    if let Some(t) = token {
        cmd.arg("-H").arg(format!("x-kubevirt-export-token: {t}"));
    }
    let out = cmd.arg(url).output().context("running curl")?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .context("curl's status")
}

/// `curl` GET of `url` with `token`: the body.
fn curl_body(c: &Cluster, url: &str, token: &str) -> anyhow::Result<String> {
    let ca = c.data_dir.join("tls").join("ca.crt");
    let out = Command::new("curl")
        .args(["-s", "--cacert"])
        .arg(&ca)
        .arg("-H")
        .arg(format!("x-kubevirt-export-token: {token}"))
        .arg(url)
        .output()
        .context("running curl")?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn export(c: &Cluster, name: &str, ns: &str) -> anyhow::Result<Value> {
    c.get_json(&["vmexport", name, "-n", ns])
}

fn wait_phase(c: &Cluster, name: &str, ns: &str, phase: &str) -> anyhow::Result<Value> {
    c.wait_until(&format!("export {name} {phase}"), STEP, || {
        let v = export(c, name, ns)?;
        Ok((v["status"]["phase"] == phase).then_some(v))
    })
}

fn token_of(c: &Cluster, e: &Value, ns: &str) -> anyhow::Result<String> {
    let secret = e["status"]["tokenSecretRef"]
        .as_str()
        .context("tokenSecretRef")?;
    let out = c.kubectl_ok(&[
        "get",
        "secret",
        secret,
        "-n",
        ns,
        "-o",
        "jsonpath={.data.token}",
    ])?;
    let out = Command::new("base64")
        .arg("-d")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut ch| {
            use std::io::Write;
            ch.stdin.take().unwrap().write_all(out.as_bytes())?;
            ch.wait_with_output()
        })?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn raw_url(e: &Value, volume: &str) -> String {
    e["status"]["links"]["external"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == volume)
        .and_then(|v| v["formats"][0]["url"].as_str())
        .unwrap_or_default()
        .to_string()
}

const VM: &str = r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: expvm, namespace: default}
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
        dataVolume: {name: exp-root}
"#;

#[test]
fn export_downloads_equal_the_volume_and_boot_on_a_second_server() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let a = Cluster::start(&ClusterOptions::new(BIN))?;
    let url = serve_files(vec![("disk.qcow2".into(), guest.disk_qcow2.clone())])? + "/disk.qcow2";
    a.apply(&format!(
        r#"
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: exp-root, namespace: default}}
spec:
  source: {{http: {{url: "{url}"}}}}
  storage: {{resources: {{requests: {{storage: 64Mi}}}}}}
"#
    ))?;
    a.apply(VM)?;
    a.wait_booted("expvm", BOOT)?;

    // Discovery serves v1 and v1beta1.
    for v in ["v1", "v1beta1"] {
        let d = a.kubectl_ok(&["get", "--raw", &format!("/apis/export.kubevirt.io/{v}")])?;
        assert!(d.contains("virtualmachineexports"), "{d}");
    }

    // Stopped: an export of the VM is Ready, with raw and gzip links for the claim (a running
    // VM's export goes through a snapshot: the second test).
    a.halt_vm("expvm", STEP)?;
    fv_ok(&a, &["vmexport", "create", "ex1", "--vm", "expvm"])?;
    let e = wait_phase(&a, "ex1", "default", "Ready")?;
    assert_eq!(e["status"]["tokenSecretRef"], "export-token-ex1", "{e}");
    let token = token_of(&a, &e, "default")?;
    assert_eq!(token.len(), 64, "{token:?}");
    let base = format!(
        "https://127.0.0.1:{}/api/export.kubevirt.io/v1beta1/namespaces/default/virtualmachineexports/ex1",
        a.port
    );
    let direct_url = format!("{base}/volumes/exp-root/disk.img");
    assert_eq!(raw_url(&e, "exp-root"), direct_url, "{e}");
    assert_eq!(e["status"]["virtualMachineName"], "expvm", "{e}");
    let cert = e["status"]["links"]["external"]["cert"]
        .as_str()
        .unwrap_or("");
    assert!(cert.contains("BEGIN CERTIFICATE"), "{e}");
    assert!(e["status"]["ttlExpirationTime"].is_string(), "{e}");
    // Our volumes are disk images: dir and tar.gz are refused with the reason.
    for f in ["disk.tar.gz", "dir", "dir/etc/passwd"] {
        let url = format!("{base}/volumes/exp-root/{f}");
        assert_eq!(curl_status(&a, &url, Some(&token))?, 404, "{f}");
        assert!(curl_body(&a, &url, &token)?.contains("disk image"), "{f}");
    }
    // The token is checked before anything is said about the format.
    assert_eq!(
        curl_status(&a, &format!("{base}/volumes/exp-root/dir/x"), None)?,
        401
    );

    // The volume's bytes, read directly on the node.
    let pv = a.kubectl_ok(&[
        "get",
        "pvc",
        "exp-root",
        "-n",
        "default",
        "-o",
        "jsonpath={.spec.volumeName}",
    ])?;
    let vol_dir = a.agent_dir().join("volumes").join(pv.trim());
    let want = sha256_file(&vol_dir.join("disk.img"))?;

    // Raw and gzip downloads through the CLI equal it.
    let out_dir = a.dir.path().join("downloads");
    std::fs::create_dir_all(&out_dir)?;
    let raw = out_dir.join("disk.img");
    let o = fv(
        &a,
        &[
            "vmexport",
            "download",
            "ex1",
            "--volume",
            "exp-root",
            "--format",
            "raw",
            "--output",
            raw.to_str().unwrap(),
            "--keep-vme",
        ],
    )?;
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(sha256_file(&raw)?, want);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains(&want),
        "{}",
        text(&o)
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("100.00%"),
        "{}",
        text(&o)
    );
    let gz = out_dir.join("disk.img.gz");
    fv_ok(
        &a,
        &[
            "vmexport",
            "download",
            "ex1",
            "--format",
            "gzip",
            "--output",
            gz.to_str().unwrap(),
            "--keep-vme",
        ],
    )?;
    assert_eq!(sha256_gunzip(&gz)?, want);
    assert!(std::fs::metadata(&gz)?.len() < std::fs::metadata(&raw)?.len());

    // Tokens: none, wrong, or another export's are refused; a query token works.
    assert_eq!(curl_status(&a, &direct_url, None)?, 401);
    assert_eq!(curl_status(&a, &direct_url, Some("wrong"))?, 401);
    let mut wrong = token.clone();
    wrong.replace_range(63..64, if token.ends_with('0') { "1" } else { "0" });
    assert_eq!(curl_status(&a, &direct_url, Some(&wrong))?, 401);
    assert_eq!(
        curl_status(
            &a,
            &format!("{direct_url}?x-kubevirt-export-token={token}"),
            None
        )?,
        200
    );
    assert_eq!(
        curl_status(&a, &format!("{base}/volumes/nope/disk.img"), Some(&token))?,
        404
    );
    // The export token opens the export routes only, never the API beside them.
    let api = format!(
        "https://127.0.0.1:{}/api/v1/namespaces/default/secrets",
        a.port
    );
    assert_eq!(curl_status(&a, &api, Some(&token))?, 401);
    assert_eq!(
        curl_status(&a, &format!("{base}/volumes"), Some(&token))?,
        401
    );
    // Another namespace: its export cannot name our claim, and our token opens nothing there.
    a.kubectl_ok(&["create", "namespace", "other"])?;
    a.apply(
        r#"
apiVersion: export.kubevirt.io/v1
kind: VirtualMachineExport
metadata: {name: steal, namespace: other}
spec:
  source: {apiGroup: "", kind: PersistentVolumeClaim, name: exp-root}
"#,
    )?;
    let steal = wait_phase(&a, "steal", "other", "Pending")?;
    assert!(steal["status"]["links"].is_null(), "{steal}");
    let other_url = direct_url.replace("/namespaces/default/", "/namespaces/other/");
    assert_eq!(
        curl_status(&a, &other_url.replace("/ex1/", "/steal/"), Some(&token))?,
        401
    );
    assert_eq!(curl_status(&a, &other_url, Some(&token))?, 404);
    let steal_token = token_of(&a, &steal, "other")?;
    assert_eq!(curl_status(&a, &direct_url, Some(&steal_token))?, 401);

    // The manifests: a CA ConfigMap, the DataVolume importing the export, the cleaned VM.
    let manifests = out_dir.join("manifests.yaml");
    fv_ok(
        &a,
        &[
            "vmexport",
            "download",
            "ex1",
            "--manifest",
            "--include-secret",
            "--output",
            manifests.to_str().unwrap(),
            "--keep-vme",
        ],
    )?;
    let m = std::fs::read_to_string(&manifests)?;
    for want in [
        "kind: ConfigMap",
        "kind: DataVolume",
        "kind: VirtualMachine",
        "kind: Secret",
        "disk.img.gz",
        "certConfigMap: export-ca-cm-ex1",
        "header-secret-ex1",
    ] {
        assert!(m.contains(want), "{want} missing in\n{m}");
    }
    assert!(
        !m.contains("resourceVersion") && !m.contains("\n  uid:") && !m.contains("status:"),
        "{m}"
    );

    // A snapshot turns the live volume into a chain: the VM's export reads it flattened
    // (qemu-nbd) and the snapshot's export reads the frozen layer; both equal the bytes.
    a.apply(
        r#"
apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineSnapshot
metadata: {name: snap1, namespace: default}
spec:
  source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: expvm}
"#,
    )?;
    a.wait_until("snapshot ready", STEP, || {
        let v = a.get_json(&["vmsnapshot", "snap1", "-n", "default"])?;
        Ok((v["status"]["readyToUse"] == true).then_some(()))
    })?;
    assert!(vol_dir.join("chain.json").exists());
    let flat = out_dir.join("flat.img");
    fv_ok(
        &a,
        &[
            "vmexport",
            "download",
            "ex1",
            "--format",
            "raw",
            "--output",
            flat.to_str().unwrap(),
            "--keep-vme",
        ],
    )?;
    assert_eq!(sha256_file(&flat)?, want, "the chain read flattened");
    let snap_raw = out_dir.join("snap.img");
    fv_ok(
        &a,
        &[
            "vmexport",
            "download",
            "exsnap",
            "--snapshot",
            "snap1",
            "--ttl",
            "60s",
            "--format",
            "raw",
            "--output",
            snap_raw.to_str().unwrap(),
            "--keep-vme",
        ],
    )?;
    assert_eq!(sha256_file(&snap_raw)?, want, "the snapshot's bytes");
    // Its token and URL, read now: its TTL may end while the second server works.
    let e = export(&a, "exsnap", "default")?;
    let snap_token = token_of(&a, &e, "default")?;
    let snap_url = raw_url(&e, "exp-root");

    // The second server: the manifests applied there import the disk from this server's
    // export (its CA, the token header) and the VM boots.
    let b = Cluster::start(&ClusterOptions::new(BIN))?;
    b.kubectl_ok(&["apply", "-n", "default", "-f", manifests.to_str().unwrap()])?;
    b.wait_until(
        "DataVolume exp-root imported on the second server",
        STEP,
        || {
            let v = b.get_json(&["datavolume", "exp-root", "-n", "default"])?;
            anyhow::ensure!(v["status"]["phase"] != "Failed", "{v}");
            Ok((v["status"]["phase"] == "Succeeded").then_some(()))
        },
    )?;
    let pv_b = b.kubectl_ok(&[
        "get",
        "pvc",
        "exp-root",
        "-n",
        "default",
        "-o",
        "jsonpath={.spec.volumeName}",
    ])?;
    let imported = sha256_file(
        &b.agent_dir()
            .join("volumes")
            .join(pv_b.trim())
            .join("disk.img"),
    )?;
    assert_eq!(imported, want, "the second server's volume");
    b.set_run_strategy("expvm", "Always")?;
    b.wait_booted("expvm", BOOT)?;

    // The snapshot export's TTL ends it: deleted, its URL no longer served.
    a.wait_gone("vmexport", "exsnap", STEP)?;
    let code = curl_status(&a, &snap_url, Some(&snap_token))?;
    assert!(code == 404 || code == 410, "{code}");

    // delete removes an export (and its generated token Secret with it).
    fv_ok(&a, &["vmexport", "delete", "ex1"])?;
    a.wait_gone("vmexport", "ex1", STEP)?;
    a.wait_gone("secret", "export-token-ex1", STEP)?;
    Ok(())
}

#[test]
fn bad_exports_are_refused_naming_the_field() -> anyhow::Result<()> {
    TestGuest::get()?;
    let c = Cluster::start(&ClusterOptions::new(BIN))?;
    for (spec, field) in [
        ("{source: {kind: Pod, name: p}}", "spec.source.kind"),
        (
            "{source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: v}, ttlDuration: soon}",
            "spec.ttlDuration",
        ),
        (
            "{source: {apiGroup: example.com, kind: VirtualMachine, name: v}}",
            "spec.source.apiGroup",
        ),
    ] {
        let file = c.dir.path().join("bad.yaml");
        std::fs::write(
            &file,
            format!(
                "apiVersion: export.kubevirt.io/v1beta1\nkind: VirtualMachineExport\nmetadata: {{name: bad, namespace: default}}\nspec: {spec}\n"
            ),
        )?;
        let out = c.kubectl(&["apply", "-f", file.to_str().unwrap()])?;
        assert!(!out.status.success(), "{spec} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(field), "{spec}: {err}");
    }
    // A missing named token Secret keeps the export Pending with the reason.
    c.apply(
        r#"
apiVersion: export.kubevirt.io/v1beta1
kind: VirtualMachineExport
metadata: {name: notoken, namespace: default}
spec:
  source: {apiGroup: "", kind: PersistentVolumeClaim, name: nothing}
  tokenSecretRef: missing-secret
"#,
    )?;
    let e = c.wait_until("notoken Pending", STEP, || {
        let v = c.get_json(&["vmexport", "notoken", "-n", "default"])?;
        Ok((v["status"]["phase"] == "Pending").then_some(v))
    })?;
    assert!(e.to_string().contains("missing-secret"), "{e}");
    // A DataVolume of files (`contentType: archive`, which a PVC export would offer as `dir`
    // and `tar.gz`) is not imported as a disk image: it fails naming the field, and no claim
    // is made for it.
    c.apply(
        r#"
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {name: files, namespace: default}
spec:
  contentType: archive
  source: {http: {url: "http://127.0.0.1:9/files.tar"}}
  storage: {resources: {requests: {storage: 8Mi}}}
"#,
    )?;
    let dv = c.wait_until("the archive DataVolume Failed", STEP, || {
        let v = c.get_json(&["dv", "files", "-n", "default"])?;
        Ok((v["status"]["phase"] == "Failed").then_some(v))
    })?;
    let ready = dv["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Ready")
        .cloned()
        .unwrap_or_default();
    assert!(
        ready["message"]
            .as_str()
            .unwrap_or_default()
            .starts_with("spec.contentType"),
        "{dv}"
    );
    assert!(
        !c.kubectl(&["get", "pvc", "files", "-n", "default"])?
            .status
            .success(),
        "a claim was made for the archive DataVolume"
    );
    Ok(())
}

const RUNNING_VM: &str = r#"
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {name: run-data, namespace: default}
spec:
  source: {blank: {}}
  storage: {resources: {requests: {storage: 16Mi}}}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: runvm, namespace: default}
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
          - name: data
            disk: {bus: virtio}
      volumes:
      - name: root
        dataVolume: {name: run-root}
      - name: data
        dataVolume: {name: run-data}
"#;

const BEFORE: &str = "EXPORT-BEFORE";
const AFTER: &str = "EXPORT-AFTER";

/// Writes `marker` at `sector` of the guest's data disk (`/dev/vdb`), flushed to the host.
fn write_marker(console: &SerialConsole, marker: &str, sector: u64) -> anyhow::Result<()> {
    let (out, rc) = console.exec(
        &format!("echo {marker} | dd of=/dev/vdb bs=512 seek={sector} conv=fsync && sync"),
        Duration::from_secs(30),
    )?;
    anyhow::ensure!(rc == 0, "writing {marker}: {out}");
    Ok(())
}

/// `len` bytes at `sector` of a downloaded image.
fn image_bytes(path: &std::path::Path, sector: u64, len: usize) -> anyhow::Result<String> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; len];
    std::fs::File::open(path)?.read_exact_at(&mut buf, sector * 512)?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

#[test]
fn exporting_a_running_vm_goes_through_an_online_snapshot() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let c = Cluster::start(&ClusterOptions::new(BIN))?;
    let url = serve_files(vec![("disk.qcow2".into(), guest.disk_qcow2.clone())])? + "/disk.qcow2";
    c.apply(&format!(
        r#"
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {{name: run-root, namespace: default}}
spec:
  source: {{http: {{url: "{url}"}}}}
  storage: {{resources: {{requests: {{storage: 64Mi}}}}}}
"#
    ))?;
    c.apply(RUNNING_VM)?;
    let uid = c.wait_booted("runvm", BOOT)?;
    let dir = c.agent_dir().join("vmis").join(&uid);
    c.wait_until("runvm: guest shell ready", BOOT, || {
        let log = std::fs::read(dir.join("serial.log")).unwrap_or_default();
        Ok(String::from_utf8_lossy(&log)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
    write_marker(&console, BEFORE, 0)?;

    // The CLI creates the export of the running VM, waits for it and downloads the data disk.
    let out_dir = c.dir.path().join("downloads");
    std::fs::create_dir_all(&out_dir)?;
    let first = out_dir.join("data1.img");
    let o = fv(
        &c,
        &[
            "vmexport",
            "download",
            "exrun",
            "--vm",
            "runvm",
            "--volume",
            "run-data",
            "--format",
            "raw",
            "--output",
            first.to_str().unwrap(),
            "--keep-vme",
            "--wait",
            "4m",
        ],
    )?;
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(image_bytes(&first, 0, BEFORE.len())?, BEFORE);
    assert_eq!(std::fs::metadata(&first)?.len(), 16 << 20);

    // It went through the export's own online snapshot, and said so; the VM never stopped.
    let e = export(&c, "exrun", "default")?;
    assert_eq!(e["status"]["phase"], "Ready", "{e}");
    let ready = e["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Ready")
        .cloned()
        .unwrap_or_default();
    assert!(
        ready["message"]
            .as_str()
            .unwrap_or_default()
            .contains("VirtualMachineSnapshot vmexport-exrun"),
        "{e}"
    );
    let snap = c.get_json(&["vmsnapshot", "vmexport-exrun", "-n", "default"])?;
    assert_eq!(snap["status"]["readyToUse"], true, "{snap}");
    assert_eq!(snap["status"]["indications"][0], "Online", "{snap}");
    assert_eq!(
        snap["metadata"]["ownerReferences"][0]["kind"], "VirtualMachineExport",
        "{snap}"
    );
    assert_eq!(
        snap["metadata"]["ownerReferences"][0]["name"], "exrun",
        "{snap}"
    );
    let vmi = c.get_json(&["vmi", "runvm", "-n", "default"])?;
    assert_eq!(vmi["metadata"]["uid"], uid.as_str(), "{vmi}");
    c.wait_until("the export's SnapshotCreated event", STEP, || {
        let ev = c.kubectl_ok(&["get", "events", "-n", "default"])?;
        Ok(ev.contains("SnapshotCreated").then_some(()))
    })?;

    // The guest writes on; the export still serves the bytes of the snapshot's moment.
    write_marker(&console, AFTER, 2048)?;
    let (seen, _) = console.exec(
        &format!(
            "dd if=/dev/vdb bs=512 skip=2048 count=1 2>/dev/null | head -c {}; echo",
            AFTER.len()
        ),
        Duration::from_secs(30),
    )?;
    assert!(seen.contains(AFTER), "the guest reads {seen:?}");
    drop(console);
    let second = out_dir.join("data2.img");
    fv_ok(
        &c,
        &[
            "vmexport",
            "download",
            "exrun",
            "--volume",
            "run-data",
            "--format",
            "raw",
            "--output",
            second.to_str().unwrap(),
            "--keep-vme",
        ],
    )?;
    assert_eq!(sha256_file(&second)?, sha256_file(&first)?);
    assert_ne!(image_bytes(&second, 2048, AFTER.len())?, AFTER);

    // The manifests carry the VM as captured.
    let manifests = out_dir.join("manifests.yaml");
    fv_ok(
        &c,
        &[
            "vmexport",
            "download",
            "exrun",
            "--manifest",
            "--output",
            manifests.to_str().unwrap(),
            "--keep-vme",
        ],
    )?;
    let m = std::fs::read_to_string(&manifests)?;
    for want in [
        "kind: VirtualMachine",
        "name: runvm",
        "name: run-data",
        "name: run-root",
    ] {
        assert!(m.contains(want), "{want} missing in\n{m}");
    }

    // Deleting the export deletes its snapshot.
    fv_ok(&c, &["vmexport", "delete", "exrun"])?;
    c.wait_gone("vmexport", "exrun", STEP)?;
    c.wait_gone("vmsnapshot", "vmexport-exrun", STEP)?;
    Ok(())
}
