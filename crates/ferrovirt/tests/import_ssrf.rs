//! End-to-end: the import address policy (server-side request forgery) through the real
//! server's DataVolume controller. The cluster runs WITHOUT the test kit's loopback
//! allowance: only `--import-allowed-cidrs 127.0.0.2/32`. Every server here is one this test
//! starts on loopback. A DataVolume importing from 127.0.0.1 (by address or as `localhost`)
//! fails with a message naming the host and the address class, the server records no
//! request, and nothing is left behind; an allowed origin (127.0.0.2) that redirects to
//! 127.0.0.1 is refused on the hop; a registry source on 127.0.0.1 is refused the same way;
//! and the allowed origin itself imports.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context;
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use serde_json::Value;

const IMPORT: Duration = Duration::from_secs(120);

/// A server on `ip` answering every request with `answer(path)` (status line and extra
/// header lines, body); counts the requests it read.
fn serve(
    ip: &str,
    answer: impl Fn(&str) -> (String, Vec<u8>) + Send + Sync + 'static,
) -> anyhow::Result<(String, Arc<AtomicUsize>)> {
    let l = TcpListener::bind((ip, 0))?;
    let base = format!("{ip}:{}", l.local_addr()?.port());
    let seen = Arc::new(AtomicUsize::new(0));
    let s2 = seen.clone();
    let answer = Arc::new(answer);
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let (seen, answer) = (s2.clone(), answer.clone());
            std::thread::spawn(move || {
                let mut r = BufReader::new(s.try_clone().expect("clone"));
                let mut first = String::new();
                let _ = r.read_line(&mut first);
                let mut line = String::new();
                while r.read_line(&mut line).unwrap_or(0) > 2 {
                    line.clear();
                }
                seen.fetch_add(1, Ordering::SeqCst);
                let path = first.split_whitespace().nth(1).unwrap_or("/").to_string();
                let (head, body) = answer(&path);
                let mut s = s;
                let _ = write!(
                    s,
                    "HTTP/1.1 {head}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = s.write_all(&body);
            });
        }
    });
    Ok((base, seen))
}

fn dv_yaml(name: &str, source: &str) -> String {
    format!(
        "apiVersion: cdi.kubevirt.io/v1beta1\nkind: DataVolume\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  source:\n    {source}\n  storage:\n    storageClassName: shared\n    resources: {{requests: {{storage: 64Mi}}}}\n---\n"
    )
}

fn message(v: &Value) -> String {
    v["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Running"))
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_string()
}

fn wait_phase(c: &Cluster, name: &str, phase: &str) -> anyhow::Result<Value> {
    c.wait_until(&format!("DataVolume {name} {phase}"), IMPORT, || {
        let v = c.get_json(&["datavolume", name, "-n", "default"])?;
        let p = v["status"]["phase"].as_str().unwrap_or_default();
        if (p == "Succeeded" || p == "Failed") && phase != p {
            anyhow::bail!("DataVolume {name} is {p}: {}", v["status"]);
        }
        Ok((p == phase).then_some(v))
    })
}

fn volume_dir(c: &Cluster, claim: &str) -> anyhow::Result<PathBuf> {
    let pvc = c.get_json(&["pvc", claim, "-n", "default"])?;
    let pv = c.get_json(&[
        "pv",
        pvc["spec"]["volumeName"].as_str().context("volumeName")?,
    ])?;
    Ok(PathBuf::from(
        pv["spec"]["hostPath"]["path"]
            .as_str()
            .context("hostPath")?,
    ))
}

/// Failed with a message naming `host` and the loopback class; the volume still blank and
/// no scratch directory left.
fn assert_refused(c: &Cluster, name: &str, host: &str) -> anyhow::Result<()> {
    let v = wait_phase(c, name, "Failed")?;
    let m = message(&v);
    assert!(
        m.contains(&format!("host {host}")) && m.contains("a loopback address"),
        "{name}: {m}"
    );
    assert!(m.contains("allowedImportCIDRs"), "{name}: {m}");
    let img = volume_dir(c, name)?.join("disk.img");
    let meta = std::fs::metadata(&img)?;
    assert_eq!(meta.blocks(), 0, "{name}: disk.img has data");
    let uid = v["metadata"]["uid"].as_str().unwrap_or_default();
    let scratch = c.data_dir.join("import-scratch").join(uid);
    assert!(!scratch.exists(), "{name}: scratch left");
    Ok(())
}

#[test]
fn imports_cannot_reach_loopback_unless_allowed() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let disk = std::fs::read(&guest.disk_qcow2)?;
    // The "internal" service: 127.0.0.1, not allowed.
    let (inner, inner_seen) = serve("127.0.0.1", |_| ("200 OK".into(), b"internal".to_vec()))?;
    // The allowed origin: serves the disk, and redirects /hop to the internal service.
    let target = format!("http://{inner}/latest/meta-data");
    let (outer, outer_seen) = serve("127.0.0.2", move |path| {
        if path == "/hop" {
            (format!("302 Found\r\nLocation: {target}"), Vec::new())
        } else {
            ("200 OK".into(), disk.clone())
        }
    })?;
    let mut opts = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
    opts.extra_args = vec!["--import-allowed-cidrs".into(), "127.0.0.2/32".into()];
    let c = Cluster::start(&opts)?;
    let inner_port = inner.rsplit(':').next().unwrap_or_default().to_string();

    c.apply(&format!(
        "{}{}{}{}",
        dv_yaml(
            "direct",
            &format!("http: {{url: \"http://{inner}/disk.img\"}}")
        ),
        dv_yaml(
            "by-name",
            &format!("http: {{url: \"http://localhost:{inner_port}/disk.img\"}}")
        ),
        dv_yaml("hop", &format!("http: {{url: \"http://{outer}/hop\"}}")),
        dv_yaml(
            "registry",
            &format!("registry: {{url: \"docker://{inner}/fv/disk:v1\"}}")
        ),
    ))?;
    assert_refused(&c, "direct", "127.0.0.1")?;
    assert_refused(&c, "by-name", "localhost")?;
    assert_refused(&c, "hop", "127.0.0.1")?;
    assert_refused(&c, "registry", "127.0.0.1")?;
    // The same through CDI's annotated claim (no DataVolume): refused, naming the host.
    c.apply(&format!(
        r#"
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: annotated
  namespace: default
  annotations: {{cdi.kubevirt.io/storage.import.endpoint: "http://{inner}/disk.img"}}
spec:
  storageClassName: shared
  accessModes: [ReadWriteMany]
  resources: {{requests: {{storage: 16Mi}}}}
"#
    ))?;
    let claim = c.wait_until("annotated claim Failed", IMPORT, || {
        let v = c.get_json(&["pvc", "annotated", "-n", "default"])?;
        let phase = v["metadata"]["annotations"]["cdi.kubevirt.io/storage.pod.phase"].clone();
        Ok((phase == "Failed").then_some(v))
    })?;
    let m = claim["metadata"]["annotations"]["cdi.kubevirt.io/storage.condition.running.message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(m.contains("127.0.0.1") && m.contains("loopback"), "{claim}");
    assert_eq!(
        inner_seen.load(Ordering::SeqCst),
        0,
        "the internal service was reached"
    );
    assert_eq!(
        outer_seen.load(Ordering::SeqCst),
        1,
        "the hop's first request"
    );

    // The allowed origin imports.
    c.apply(&dv_yaml(
        "allowed",
        &format!("http: {{url: \"http://{outer}/disk.qcow2\"}}"),
    ))?;
    let v = wait_phase(&c, "allowed", "Succeeded")?;
    assert_eq!(v["status"]["progress"], "100.0%", "{v}");
    Ok(())
}
