//! End-to-end: hostile and broken images offered to the importer over HTTP(S) by servers
//! this test runs on 127.0.0.1, through the real server's DataVolume controller. Every
//! DataVolume must end `Failed` with a clear condition message and leave nothing behind:
//! the volume's `disk.img` is still the blank, fully sparse file of the claim's size (all
//! zeros, no allocated blocks), no `disk.img.importing` temporary exists and the import's
//! scratch directory is gone. The second test covers `certConfigMap`: an HTTPS server whose
//! certificate comes from a CA made here is refused with a TLS error until the DataVolume
//! names a ConfigMap holding that CA, and accepted without it under `insecureSkipVerify`.
//! No guest boots, so both tests are quick.

use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest, serve_files};
use serde_json::Value;

const IMPORT: Duration = Duration::from_secs(120);

fn cluster() -> anyhow::Result<Cluster> {
    Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))
}

/// A CA and a serving certificate for 127.0.0.1 signed by it: (CA PEM, cert PEM, key PEM).
fn make_pki() -> anyhow::Result<(String, String, String)> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name
        .push(DnType::CommonName, "hostile-images test CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate()?;
    let mut leaf = CertificateParams::new(vec!["127.0.0.1".to_string()])?;
    leaf.distinguished_name
        .push(DnType::CommonName, "image server");
    let cert = leaf.signed_by(&key, &issuer)?;
    Ok((ca_cert.pem(), cert.pem(), key.serialize_pem()))
}

/// An HTTPS file server on 127.0.0.1 presenting `cert_pem`; returns its base URL.
fn serve_https(
    files: Vec<(String, PathBuf)>,
    cert_pem: &str,
    key_pem: &str,
) -> anyhow::Result<String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_slice_iter(cert_pem.as_bytes()).collect::<Result<_, _>>()?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = Arc::new(
        rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(certs, key)?,
    );
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    std::thread::spawn(move || {
        for tcp in listener.incoming().flatten() {
            let files = files.clone();
            let config = config.clone();
            std::thread::spawn(move || {
                let Ok(conn) = rustls::ServerConnection::new(config) else {
                    return;
                };
                ferrovirt_testkit::fileserver::answer(rustls::StreamOwned::new(conn, tcp), &files);
            });
        }
    });
    Ok(format!("https://{addr}"))
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let out = cmd.output().with_context(|| format!("{cmd:?}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn qemu_img(args: &[&str]) -> anyhow::Result<()> {
    run(Command::new("qemu-img").args(args))
}

fn sha256(path: &Path) -> anyhow::Result<String> {
    let out = Command::new("sha256sum").arg(path).output()?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .context("sha256sum output")?
        .to_string())
}

fn dv_yaml(name: &str, http: &str, size: &str) -> String {
    format!(
        "apiVersion: cdi.kubevirt.io/v1beta1\nkind: DataVolume\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  source:\n    http: {http}\n  storage:\n    storageClassName: shared\n    resources: {{requests: {{storage: {size}}}}}\n---\n"
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
        if p == "Succeeded" && phase != p {
            anyhow::bail!("DataVolume {name} succeeded: {}", v["status"]);
        }
        Ok((p == phase).then_some(v))
    })
}

/// The volume directory of a DataVolume's claim.
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

/// "Nothing left behind": `disk.img` is the claim's size, all zeros and without allocated
/// blocks; no temporary conversion output; no scratch directory of the import.
fn assert_left_blank(c: &Cluster, dv: &Value, size: u64) -> anyhow::Result<()> {
    let name = dv["metadata"]["name"].as_str().unwrap_or_default();
    let dir = volume_dir(c, name)?;
    let img = dir.join("disk.img");
    let meta = std::fs::metadata(&img)?;
    assert_eq!(meta.len(), size, "{name}: disk.img size");
    assert_eq!(meta.blocks(), 0, "{name}: disk.img has allocated blocks");
    assert!(
        std::fs::read(&img)?.iter().all(|b| *b == 0),
        "{name}: disk.img holds data"
    );
    assert!(
        !dir.join("disk.img.importing").exists(),
        "{name}: temp file left"
    );
    let uid = dv["metadata"]["uid"].as_str().unwrap_or_default();
    let scratch = c.data_dir.join("import-scratch").join(uid);
    assert!(
        !scratch.exists(),
        "{name}: scratch {} left",
        scratch.display()
    );
    Ok(())
}

#[test]
fn hostile_images_fail_cleanly() -> anyhow::Result<()> {
    let c = cluster()?;
    let images = c.dir.path().join("images");
    std::fs::create_dir_all(&images)?;
    let p = |n: &str| images.join(n);
    let s = |p: &Path| p.display().to_string();

    // A qcow2 whose backing file is a host file.
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-F",
        "raw",
        "-b",
        "/etc/passwd",
        &s(&p("backing.qcow2")),
        "16M",
    ])?;
    // A qcow2 with an external data file: the "secret" stands for any host file.
    std::fs::write(p("secret.raw"), vec![0x42u8; 1 << 20])?;
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        &format!("data_file={},data_file_raw=on", s(&p("secret.raw"))),
        &s(&p("datafile.qcow2")),
        "1M",
    ])?;
    // Larger than its 16Mi claim.
    qemu_img(&["create", "-q", "-f", "qcow2", &s(&p("huge.qcow2")), "1G"])?;
    // A good qcow2 with data, then a truncated copy of it.
    std::fs::write(p("data.raw"), vec![0x5au8; 4 << 20])?;
    qemu_img(&[
        "convert",
        "-q",
        "-f",
        "raw",
        "-O",
        "qcow2",
        &s(&p("data.raw")),
        &s(&p("good.qcow2")),
    ])?;
    let good = std::fs::read(p("good.qcow2"))?;
    std::fs::write(p("truncated.qcow2"), &good[..good.len() / 3])?;
    // Random bytes behind a qcow2 magic.
    let mut junk = b"QFI\xfb".to_vec();
    junk.extend((0..200_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8));
    std::fs::write(p("junk.qcow2"), junk)?;

    let files: Vec<(String, PathBuf)> = [
        "backing.qcow2",
        "datafile.qcow2",
        "huge.qcow2",
        "truncated.qcow2",
        "junk.qcow2",
        "good.qcow2",
    ]
    .iter()
    .map(|n| (n.to_string(), p(n)))
    .collect();
    let base = serve_files(files)?;
    let url = |n: &str| format!("{{url: \"{base}/{n}\"}}");
    let wrong = format!("sha256:{}", "0".repeat(64));
    assert_ne!(sha256(&p("good.qcow2"))?, "0".repeat(64));
    let mut yaml = String::new();
    yaml.push_str(&dv_yaml("h-backing", &url("backing.qcow2"), "16Mi"));
    yaml.push_str(&dv_yaml("h-datafile", &url("datafile.qcow2"), "16Mi"));
    yaml.push_str(&dv_yaml("h-huge", &url("huge.qcow2"), "16Mi"));
    yaml.push_str(&dv_yaml("h-truncated", &url("truncated.qcow2"), "16Mi"));
    yaml.push_str(&dv_yaml("h-junk", &url("junk.qcow2"), "16Mi"));
    yaml.push_str(&dv_yaml(
        "h-checksum",
        &format!("{{url: \"{base}/good.qcow2\", checksum: \"{wrong}\"}}"),
        "16Mi",
    ));
    let started = std::time::Instant::now();
    c.apply(&yaml)?;
    let expect = [
        ("h-backing", "backing file (/etc/passwd)"),
        ("h-datafile", "external data file"),
        ("h-huge", "larger than"),
        ("h-truncated", "corrupt"),
        ("h-junk", "not a valid disk image"),
        ("h-checksum", "checksum mismatch"),
    ];
    for (name, text) in expect {
        let v = wait_phase(&c, name, "Failed")?;
        let m = message(&v);
        assert!(m.contains(text), "{name}: {m:?} lacks {text:?}");
        assert_eq!(v["status"]["restartCount"], 1, "{name}: retried: {v}");
        assert_left_blank(&c, &v, 16 << 20)?;
    }
    eprintln!(
        "six hostile images failed cleanly in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

#[test]
fn https_import_trusts_the_cert_config_map() -> anyhow::Result<()> {
    let guest = TestGuest::get()?;
    let (ca, cert, key) = make_pki()?;
    let files = vec![("disk.qcow2".to_string(), guest.disk_qcow2.clone())];
    let base = serve_https(files, &cert, &key)?;
    let c = cluster()?;

    // Without the CA: a permanent TLS failure naming the cause.
    c.apply(&dv_yaml(
        "tls-untrusted",
        &format!("{{url: \"{base}/disk.qcow2\"}}"),
        "64Mi",
    ))?;
    let v = wait_phase(&c, "tls-untrusted", "Failed")?;
    let m = message(&v);
    assert!(m.contains("TLS") && m.contains("UnknownIssuer"), "{m}");

    // insecureSkipVerify: the same server without the CA, its certificate not verified.
    c.apply(&dv_yaml(
        "tls-skip-verify",
        &format!("{{url: \"{base}/disk.qcow2\", insecureSkipVerify: true}}"),
        "64Mi",
    ))?;
    wait_phase(&c, "tls-skip-verify", "Succeeded")?;

    // With the CA in a ConfigMap (any key; CDI's convention is ca.pem).
    let indented: String = ca.lines().map(|l| format!("    {l}\n")).collect();
    c.apply(&format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: image-ca, namespace: default}}\ndata:\n  ca.pem: |\n{indented}---\n{}",
        dv_yaml(
            "tls-trusted",
            &format!("{{url: \"{base}/disk.qcow2\", certConfigMap: image-ca}}"),
            "64Mi",
        )
    ))?;
    let v = wait_phase(&c, "tls-trusted", "Succeeded")?;
    assert_eq!(v["status"]["progress"], "100.0%", "{v}");
    let img = volume_dir(&c, "tls-trusted")?.join("disk.img");
    let out = Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "qcow2"])
        .arg(&img)
        .arg(&guest.disk_qcow2)
        .output()?;
    assert!(
        out.status.success(),
        "imported image differs: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(())
}

/// One request as a scripted server saw it: path and lower-cased header lines.
type Seen = Arc<std::sync::Mutex<Vec<(String, Vec<String>)>>>;

/// A loopback HTTP server answering each request with `answer(path, stream)`; records every
/// request's path and headers.
fn scripted(
    answer: impl Fn(&str, &mut std::net::TcpStream) + Send + Sync + 'static,
) -> anyhow::Result<(String, Seen)> {
    use std::io::{BufRead, BufReader};
    let l = TcpListener::bind("127.0.0.1:0")?;
    let base = format!("http://{}", l.local_addr()?);
    let seen: Seen = Arc::default();
    let s2 = seen.clone();
    let answer = Arc::new(answer);
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let (seen, answer) = (s2.clone(), answer.clone());
            std::thread::spawn(move || {
                let mut r = BufReader::new(s.try_clone().expect("clone"));
                let mut first = String::new();
                let _ = r.read_line(&mut first);
                let path = first.split_whitespace().nth(1).unwrap_or("/").to_string();
                let mut headers = Vec::new();
                loop {
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap_or(0) <= 2 {
                        break;
                    }
                    headers.push(line.trim().to_ascii_lowercase());
                }
                seen.lock().expect("lock").push((path.clone(), headers));
                let mut s = s;
                answer(&path, &mut s);
            });
        }
    });
    Ok((base, seen))
}

fn respond(s: &mut std::net::TcpStream, head: &str, body: &[u8]) {
    use std::io::Write;
    let _ = write!(s, "HTTP/1.1 {head}\r\nConnection: close\r\n\r\n");
    let _ = s.write_all(body);
}

/// The 135-byte kind of VMDK descriptor seen in the wild: one FLAT extent naming a host file.
fn flat_descriptor(target: &Path) -> String {
    format!(
        "# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\n\
         createType=\"monolithicFlat\"\nRW 8 FLAT \"{}\" 0\n",
        target.display()
    )
}

/// Every attack on the importer's transfer and image rules, each refused with a message
/// naming what was wrong and nothing read or left behind: a VMDK descriptor naming the
/// server's token file, a gzip bomb (scratch space stays bounded), oversized bodies with and
/// without Content-Length, a stalled server, a redirect loop, and a redirect to another
/// origin that must not carry Basic auth or secretExtraHeaders; and a pvc clone of a disk
/// whose first sector is such a descriptor stays a byte copy.
#[test]
fn hostile_sources_are_refused() -> anyhow::Result<()> {
    use base64::Engine;
    let c = cluster()?;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let token = c.data_dir.join("token");
    let token_text = std::fs::read_to_string(&token)?;
    let desc = flat_descriptor(&token);
    let images = c.dir.path().join("images");
    std::fs::create_dir_all(&images)?;
    // 512 MiB of zeros in about half a MiB of gzip.
    run(Command::new("sh").arg("-c").arg(format!(
        "head -c 512M /dev/zero | gzip -1 > {}",
        images.join("bomb.gz").display()
    )))?;
    let bomb = std::fs::read(images.join("bomb.gz"))?;
    let bomb_len = bomb.len() as u64;
    let good = vec![0x5au8; 1 << 20];
    let (other, other_seen) = {
        let good = good.clone();
        scripted(move |_, s| {
            respond(
                s,
                &format!("200 OK\r\nContent-Length: {}", good.len()),
                &good,
            )
        })?
    };
    let desc2 = desc.clone();
    let other2 = other.clone();
    let (base, seen) = scripted(move |path, s| match path {
        "/flat.vmdk" => respond(
            s,
            &format!("200 OK\r\nContent-Length: {}", desc2.len()),
            desc2.as_bytes(),
        ),
        "/bomb.gz" => respond(
            s,
            &format!("200 OK\r\nContent-Length: {}", bomb.len()),
            &bomb,
        ),
        "/declared-big" => respond(s, "200 OK\r\nContent-Length: 209715200", b""),
        "/undeclared-big" => {
            use std::io::Write;
            let _ = write!(s, "HTTP/1.0 200 OK\r\nConnection: close\r\n\r\n");
            let chunk = vec![7u8; 1 << 20];
            for _ in 0..200 {
                if s.write_all(&chunk).is_err() {
                    break;
                }
            }
        }
        "/stall" => {
            respond(s, "200 OK\r\nContent-Length: 1048576", &[1u8; 1000]);
            std::thread::sleep(Duration::from_secs(60));
        }
        "/loop" => respond(s, "302 Found\r\nLocation: /loop\r\nContent-Length: 0", b""),
        "/elsewhere" => respond(
            s,
            &format!("302 Found\r\nLocation: {other2}/disk.img\r\nContent-Length: 0"),
            b"",
        ),
        _ => respond(s, "404 Not Found\r\nContent-Length: 0", b""),
    })?;
    c.apply(&format!(
        r#"
apiVersion: v1
kind: Namespace
metadata: {{name: kubevirt-hyperconverged}}
---
apiVersion: hco.kubevirt.io/v1beta1
kind: HyperConverged
metadata: {{name: kubevirt-hyperconverged, namespace: kubevirt-hyperconverged}}
spec:
  storageImport:
    transferStallTimeoutSeconds: 2
---
apiVersion: v1
kind: Secret
metadata: {{name: creds, namespace: default}}
data: {{accessKeyId: "{}", secretKey: "{}"}}
---
apiVersion: v1
kind: Secret
metadata: {{name: hdrs, namespace: default}}
data: {{h: "{}"}}
"#,
        b64("user"),
        b64("hunter2"),
        b64("X-Secret: s3cr3t")
    ))?;
    let url = |p: &str| format!("{{url: \"{base}{p}\"}}");
    let mut yaml = String::new();
    yaml.push_str(&dv_yaml("s-flat", &url("/flat.vmdk"), "16Mi"));
    yaml.push_str(&dv_yaml("s-bomb", &url("/bomb.gz"), "16Mi"));
    yaml.push_str(&dv_yaml("s-declared", &url("/declared-big"), "16Mi"));
    yaml.push_str(&dv_yaml("s-undeclared", &url("/undeclared-big"), "16Mi"));
    yaml.push_str(&dv_yaml("s-stall", &url("/stall"), "16Mi"));
    yaml.push_str(&dv_yaml("s-loop", &url("/loop"), "16Mi"));
    yaml.push_str(&dv_yaml(
        "s-elsewhere",
        &format!("{{url: \"{base}/elsewhere\", secretRef: creds, secretExtraHeaders: [hdrs]}}"),
        "16Mi",
    ));
    yaml.push_str(&dv_yaml("s-blank", "null\n    blank: {}", "16Mi"));
    // Scratch space is watched while the bomb is refused.
    let scratch = c.data_dir.join("import-scratch");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let peak = {
        let (scratch, stop) = (scratch.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut peak = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // Each import has its own `import-scratch/<dv uid>/`; the limit is per import
                // (the oversized downloads fill theirs at the same time as the bomb).
                let dirs = std::fs::read_dir(&scratch).into_iter().flatten().flatten();
                for d in dirs {
                    let out = Command::new("du").arg("-sb").arg(d.path()).output();
                    if let Ok(o) = out {
                        let n = String::from_utf8_lossy(&o.stdout)
                            .split_whitespace()
                            .next()
                            .and_then(|n| n.parse::<u64>().ok())
                            .unwrap_or(0);
                        peak = peak.max(n);
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            peak
        })
    };
    c.apply(&yaml)?;
    let expect = [
        ("s-flat", "VMDK descriptor"),
        ("s-bomb", "decompresses to more than"),
        ("s-declared", "Content-Length 209715200"),
        ("s-undeclared", "the body is more than"),
        ("s-stall", "stalled for more than 2 s"),
        ("s-loop", "more than 5 redirects"),
    ];
    let limit = (16u64 << 20) + (1 << 20) + (64 << 20);
    for (name, text) in expect {
        let v = wait_phase(&c, name, "Failed")?;
        let m = message(&v);
        assert!(m.contains(text), "{name}: {m:?} lacks {text:?}");
        assert_left_blank(&c, &v, 16 << 20)?;
        eprintln!("{name}: {m}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak = peak.join().expect("du thread");
    assert!(
        peak <= limit + bomb_len * 4 + (8 << 20),
        "one import's scratch grew to {peak} bytes"
    );
    eprintln!("peak scratch while refusing the bomb: {peak} bytes (limit {limit})");

    // The redirect to another origin succeeds, without the credentials there.
    wait_phase(&c, "s-elsewhere", "Succeeded")?;
    let first = seen.lock().expect("lock").clone();
    let (_, h) = first
        .iter()
        .find(|(p, _)| p == "/elsewhere")
        .context("origin request")?;
    assert!(
        h.iter().any(|l| l.starts_with("authorization: basic")),
        "{h:?}"
    );
    assert!(h.iter().any(|l| l == "x-secret: s3cr3t"), "{h:?}");
    for (p, h) in other_seen.lock().expect("lock").iter() {
        assert!(
            !h.iter()
                .any(|l| l.starts_with("authorization") || l.starts_with("x-secret")),
            "{p}: credentials sent to another origin: {h:?}"
        );
    }
    let img = volume_dir(&c, "s-elsewhere")?.join("disk.img");
    assert!(std::fs::read(&img)?[..1 << 20] == good[..]);

    // A guest disk whose first sector is a FLAT descriptor, cloned: a byte copy.
    wait_phase(&c, "s-blank", "Succeeded")?;
    let src = volume_dir(&c, "s-blank")?.join("disk.img");
    {
        use std::io::{Seek, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&src)?;
        f.seek(std::io::SeekFrom::Start(0))?;
        f.write_all(desc.as_bytes())?;
    }
    c.apply(
        "apiVersion: cdi.kubevirt.io/v1beta1\nkind: DataVolume\nmetadata: {name: s-clone, namespace: default}\nspec:\n  source:\n    pvc: {name: s-blank, namespace: default}\n  storage:\n    storageClassName: shared\n    resources: {requests: {storage: 16Mi}}\n",
    )?;
    wait_phase(&c, "s-clone", "Succeeded")?;
    let copy = std::fs::read(volume_dir(&c, "s-clone")?.join("disk.img"))?;
    assert!(copy == std::fs::read(&src)?, "the clone is not a byte copy");
    let needle = token_text.trim().as_bytes();
    assert!(
        !copy.windows(needle.len()).any(|w| w == needle),
        "the token file's content is in the clone"
    );
    Ok(())
}
