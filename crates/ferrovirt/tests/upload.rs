//! End-to-end uploads through the real server: `ferrovirt image-upload dv` of the test
//! guest's `disk.qcow2` (DataVolume with an `upload` source → UploadReady → UploadTokenRequest
//! → `POST /v1beta1/upload` → Succeeded) and a VirtualMachine booting from it (the guest's
//! `FERROVIRT-BOOT` serial marker); a gzip-compressed upload; a forged or missing upload token
//! answers 401; an upload whose client dies half-way leaves the DataVolume ready for another
//! try; an image larger than the claim fails the DataVolume.

use std::process::{Command, Output};
use std::time::Duration;

use anyhow::Context;
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_ferrovirt");
const BOOT: Duration = Duration::from_secs(180);

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

fn condition<'a>(v: &'a Value, type_: &str) -> &'a Value {
    v["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or(&Value::Null)
}

/// `curl` POST of `body` to the upload path with the admin token and `upload_token`;
/// returns the HTTP status code.
fn post_upload(c: &Cluster, upload_token: Option<&str>, body: &[u8]) -> anyhow::Result<u16> {
    let admin = std::fs::read_to_string(c.data_dir.join("token"))?;
    let file = c.dir.path().join("curl-body");
    std::fs::write(&file, body)?;
    let mut cmd = Command::new("curl");
    cmd.args(["-sk", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST"])
        .arg("-H")
        .arg(format!("Authorization: Bearer {}", admin.trim()))
        .arg("--data-binary")
        .arg(format!("@{}", file.display()));
    if let Some(t) = upload_token {
        cmd.arg("-H").arg(format!("X-Upload-Token: {t}"));
    }
    cmd.arg(format!("https://127.0.0.1:{}/v1beta1/upload", c.port));
    let out = cmd.output().context("running curl")?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .with_context(|| text(&out))
}

/// An UploadTokenRequest through `kubectl create --raw`; returns `status.token`.
fn token_for(c: &Cluster, pvc: &str) -> anyhow::Result<String> {
    let req = c.dir.path().join("token-request.json");
    std::fs::write(
        &req,
        serde_json::json!({
            "apiVersion": "upload.cdi.kubevirt.io/v1beta1",
            "kind": "UploadTokenRequest",
            "metadata": {"name": pvc, "namespace": "default"},
            "spec": {"pvcName": pvc},
        })
        .to_string(),
    )?;
    let out = c.kubectl_ok(&[
        "create",
        "--raw",
        "/apis/upload.cdi.kubevirt.io/v1beta1/namespaces/default/uploadtokenrequests",
        "-f",
        req.to_str().context("path")?,
    ])?;
    let v: Value = serde_json::from_str(&out)?;
    assert_eq!(v["kind"], "UploadTokenRequest", "{v}");
    Ok(v["status"]["token"].as_str().context("token")?.to_string())
}

#[test]
fn image_upload_boots_and_bad_uploads_are_refused() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let c = Cluster::start(&ClusterOptions::new(BIN))?;
    let image = guest.disk_qcow2.to_str().context("path")?.to_string();

    // Discovery lists the upload group.
    let groups = c.kubectl_ok(&["get", "--raw", "/apis/upload.cdi.kubevirt.io/v1beta1"])?;
    assert!(groups.contains("uploadtokenrequests"), "{groups}");

    // Upload the guest disk into a new DataVolume (default class `local`).
    let out = fv(
        &c,
        &[
            "image-upload",
            "dv",
            "uploaded",
            "--size",
            "64Mi",
            "--image-path",
            &image,
            "--access-mode",
            "ReadWriteOnce",
            "--insecure",
        ],
    )?;
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("completed successfully"), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("100.00%"), "{}", text(&out));
    let v = c.get_json(&["datavolume", "uploaded", "-n", "default"])?;
    assert_eq!(v["status"]["phase"], "Succeeded", "{v}");
    assert_eq!(v["status"]["progress"], "100.0%", "{v}");
    assert_eq!(v["spec"]["source"]["upload"], serde_json::json!({}), "{v}");
    assert_eq!(condition(&v, "Ready")["status"], "True", "{v}");
    assert_eq!(condition(&v, "Bound")["status"], "True", "{v}");

    // A gzip-compressed image is decompressed on the server (shared class, plain lines).
    let gz = c.dir.path().join("disk.qcow2.gz");
    let packed = Command::new("gzip")
        .arg("-c")
        .arg(&guest.disk_qcow2)
        .output()?;
    assert!(packed.status.success());
    std::fs::write(&gz, &packed.stdout)?;
    let out = fv(
        &c,
        &[
            "image-upload",
            "dv",
            "packed",
            "--size",
            "32Mi",
            "--storage-class",
            "shared",
            "--image-path",
            gz.to_str().context("path")?,
        ],
    )?;
    assert!(out.status.success(), "{}", text(&out));
    let v = c.get_json(&["datavolume", "packed", "-n", "default"])?;
    assert_eq!(v["status"]["phase"], "Succeeded", "{v}");

    // A DataVolume that already succeeded takes no second upload.
    let token = token_for(&c, "uploaded")?;
    assert_eq!(post_upload(&c, Some(&token), b"x")?, 409);

    // A second upload DataVolume, created with kubectl, reaches UploadReady.
    c.apply(
        r#"
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {name: waiting, namespace: default}
spec:
  source: {upload: {}}
  storage:
    storageClassName: shared
    resources: {requests: {storage: 8Mi}}
"#,
    )?;
    let v = c.wait_until("DataVolume waiting UploadReady", BOOT, || {
        let v = c.get_json(&["datavolume", "waiting", "-n", "default"])?;
        Ok((v["status"]["phase"] == "UploadReady").then_some(v))
    })?;
    assert_eq!(condition(&v, "Bound")["status"], "True", "{v}");
    assert_eq!(condition(&v, "Ready")["status"], "False", "{v}");

    // Forged, foreign, or missing upload tokens: 401, and the DataVolume stays ready.
    let good = token_for(&c, "waiting")?;
    let (payload, mac) = good.split_once('.').context("token shape")?;
    let mut flipped: Vec<char> = mac.chars().collect();
    flipped[0] = if flipped[0] == 'A' { 'B' } else { 'A' };
    let forged = format!("{payload}.{}", flipped.into_iter().collect::<String>());
    assert_eq!(post_upload(&c, Some(&forged), b"data")?, 401);
    assert_eq!(post_upload(&c, Some("not-a-token"), b"data")?, 401);
    assert_eq!(post_upload(&c, None, b"data")?, 401);
    let v = c.get_json(&["datavolume", "waiting", "-n", "default"])?;
    assert_eq!(v["status"]["phase"], "UploadReady", "{v}");

    // An upload whose client dies half-way (1 MiB of a declared 6 MB) leaves the DataVolume
    // UploadReady for another try.
    let part = c.dir.path().join("part");
    std::fs::write(&part, vec![0x5a; 1 << 20])?;
    let admin = std::fs::read_to_string(c.data_dir.join("token"))?;
    let mut curl = Command::new("curl")
        .args(["-sk", "-o", "/dev/null", "-X", "POST"])
        .arg("-H")
        .arg(format!("Authorization: Bearer {}", admin.trim()))
        .arg("-H")
        .arg(format!("X-Upload-Token: {good}"))
        .args(["-H", "Content-Length: 6000000", "--data-binary"])
        .arg(format!("@{}", part.display()))
        .arg(format!("https://127.0.0.1:{}/v1beta1/upload", c.port))
        .spawn()?;
    // The server is receiving: the DataVolume shows the share of the declared length so far.
    let seen = c.wait_until("upload progress", Duration::from_secs(30), || {
        let v = c.get_json(&["datavolume", "waiting", "-n", "default"])?;
        let p = v["status"]["progress"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let pct: f64 = p.trim_end_matches('%').parse().unwrap_or(0.0);
        Ok((pct > 0.0).then_some(p))
    });
    let _ = curl.kill();
    let _ = curl.wait();
    std::thread::sleep(Duration::from_secs(1));
    // (The transfer is the first half of the progress scale, conversion the second.)
    let seen = seen?;
    assert!(seen.starts_with("8.7"), "half of 1 MiB of 6 MB: {seen}");
    let v = c.get_json(&["datavolume", "waiting", "-n", "default"])?;
    assert_eq!(v["status"]["phase"], "UploadReady", "{v}");

    // An image whose virtual size (26 MiB) exceeds the claim (8 Mi): Failed with the reason.
    let out = fv(
        &c,
        &["image-upload", "dv", "waiting", "--image-path", &image],
    )?;
    assert!(!out.status.success(), "{}", text(&out));
    let v = c.get_json(&["datavolume", "waiting", "-n", "default"])?;
    assert_eq!(v["status"]["phase"], "Failed", "{v}");
    let msg = condition(&v, "Running")["message"]
        .as_str()
        .unwrap_or_default();
    assert!(msg.contains("larger"), "{v}");

    // A VM on the uploaded DataVolume boots.
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: from-upload, namespace: default}
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
        dataVolume: {name: uploaded}
"#,
    )?;
    c.wait_booted("from-upload", BOOT)?;
    c.kubectl_ok(&["delete", "vm", "from-upload", "--wait=false"])?;
    Ok(())
}

/// The probe seen in the wild: a 135-byte VMDK descriptor whose FLAT extent names the server's
/// admin token file. The upload is refused as a VMDK descriptor; the volume stays blank (the
/// token never reaches it) and no scratch space is left.
#[test]
fn vmdk_descriptor_upload_is_refused() -> anyhow::Result<()> {
    let c = Cluster::start(&ClusterOptions::new(BIN))?;
    let token_file = c.data_dir.join("token");
    let token = std::fs::read_to_string(&token_file)?;
    let desc = c.dir.path().join("flat.vmdk");
    std::fs::write(
        &desc,
        format!(
            "# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\n\
             createType=\"monolithicFlat\"\nRW 8 FLAT \"{}\" 0\n",
            token_file.display()
        ),
    )?;
    let out = fv(
        &c,
        &[
            "image-upload",
            "dv",
            "flat",
            "--size",
            "8Mi",
            "--storage-class",
            "shared",
            "--image-path",
            desc.to_str().context("path")?,
        ],
    )?;
    assert!(!out.status.success(), "{}", text(&out));
    let v = c.get_json(&["datavolume", "flat", "-n", "default"])?;
    assert_eq!(v["status"]["phase"], "Failed", "{v}");
    let msg = condition(&v, "Running")["message"]
        .as_str()
        .unwrap_or_default();
    assert!(msg.contains("VMDK descriptor"), "{v}");
    let pvc = c.get_json(&["pvc", "flat", "-n", "default"])?;
    let pv = c.get_json(&["pv", pvc["spec"]["volumeName"].as_str().context("pv")?])?;
    let dir = pv["spec"]["hostPath"]["path"].as_str().context("path")?;
    let disk = std::fs::read(std::path::Path::new(dir).join("disk.img"))?;
    assert!(disk.iter().all(|b| *b == 0), "the volume holds data");
    let needle = token.trim().as_bytes();
    assert!(!disk.windows(needle.len()).any(|w| w == needle));
    let uid = v["metadata"]["uid"].as_str().unwrap_or_default();
    let scratch = c
        .data_dir
        .join("import-scratch")
        .join(format!("upload-{uid}"));
    assert!(!scratch.exists(), "scratch {} left", scratch.display());
    Ok(())
}
