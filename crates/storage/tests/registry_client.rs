//! The registry client against a real registry (Debian's `docker-registry`, started by
//! `ferrovirt_testkit::Registry`): anonymous and htpasswd-protected pulls, images behind an
//! OCI index, digest verification, the DataVolume import (validation + conversion to raw)
//! and the node cache with its pull policies.

use ferrovirt_storage::StorageError;
use ferrovirt_storage::http::BasicAuth;
use ferrovirt_storage::netpolicy::{self, AddressClass, AddressPolicy};
use ferrovirt_storage::registry::cache::{ImageCache, PullPolicy};
use ferrovirt_storage::registry::{self, ClientOptions, RegistryImportRequest, reference};
use ferrovirt_testkit::Registry;
use ferrovirt_testkit::registry::disk_layer;

fn qcow2(dir: &std::path::Path, backing: Option<&str>) -> std::path::PathBuf {
    let p = dir.join(if backing.is_some() {
        "b.qcow2"
    } else {
        "a.qcow2"
    });
    let mut cmd = std::process::Command::new("qemu-img");
    cmd.args(["create", "-q", "-f", "qcow2"]);
    if let Some(b) = backing {
        cmd.args(["-F", "raw", "-b", b]);
    }
    cmd.arg(&p).arg("8M");
    assert!(cmd.status().unwrap().success());
    p
}

/// Options that allow loopback registries (the tests' registries run on 127.0.0.1).
fn base() -> ClientOptions {
    ClientOptions {
        address_policy: AddressPolicy::allowing(
            netpolicy::parse_list("127.0.0.0/8,::1/128").unwrap(),
        ),
        ..Default::default()
    }
}

fn opts(r: &Registry) -> ClientOptions {
    ClientOptions {
        insecure_registries: vec![r.addr.clone()],
        ..base()
    }
}

#[tokio::test]
async fn the_default_policy_refuses_a_loopback_registry() {
    let r = Registry::start().unwrap();
    let image = reference::parse("url", &format!("docker://{}/fv/disk:v1", r.addr)).unwrap();
    let client = registry::RegistryClient::new(
        &image,
        &ClientOptions {
            insecure_registries: vec![r.addr.clone()],
            ..Default::default()
        },
    )
    .unwrap();
    match client.resolve().await.unwrap_err() {
        StorageError::AddressRefused { refusal, .. } => {
            assert_eq!(refusal.class, AddressClass::Loopback);
        }
        e => panic!("{e}"),
    }
}

#[tokio::test]
async fn imports_and_caches_from_a_real_registry() {
    let r = Registry::start().unwrap();
    let d = tempfile::tempdir().unwrap();
    let disk = qcow2(d.path(), None);
    r.push_disk("fv/disk", "v1", &disk, "my.qcow2", true)
        .unwrap();
    let image = reference::parse("url", &format!("docker://{}/fv/disk:v1", r.addr)).unwrap();

    // Import into a raw volume of 16 MiB.
    let target = d.path().join("disk.img");
    let mut seen = Vec::new();
    let req = RegistryImportRequest {
        image: image.clone(),
        client: opts(&r),
        scratch_dir: d.path().join("scratch"),
        target: target.clone(),
        capacity: 16 << 20,
    };
    let info = registry::import(&req, |p| seen.push(p)).await.unwrap();
    assert_eq!(
        (info.format.as_str(), info.virtual_size),
        ("qcow2", 8 << 20)
    );
    assert_eq!(std::fs::metadata(&target).unwrap().len(), 16 << 20);
    assert_eq!(seen.last(), Some(&100.0));
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "{seen:?}");
    assert!(!req.scratch_dir.exists());

    // Too small a claim, and not listed as insecure (HTTPS to a plain HTTP registry).
    let small = RegistryImportRequest {
        capacity: 4 << 20,
        ..req.clone()
    };
    let e = registry::import(&small, |_| {}).await.unwrap_err();
    assert!(matches!(e, StorageError::Refused(_)), "{e}");
    let https = RegistryImportRequest {
        client: base(),
        ..req.clone()
    };
    let e = registry::import(&https, |_| {}).await.unwrap_err();
    assert!(e.to_string().contains("TLS"), "{e}");

    // The node cache: pulled once, then found by reference and digest.
    let cache = ImageCache::new(d.path().join("cache"), 1 << 30);
    let c1 = cache
        .ensure(&image, PullPolicy::IfNotPresent, &opts(&r))
        .await
        .unwrap();
    assert!(c1.pulled);
    assert_eq!(c1.info.file_name, "my.qcow2");
    assert_eq!(c1.info.format, "qcow2");
    let c2 = cache
        .ensure(&image, PullPolicy::Always, &opts(&r))
        .await
        .unwrap();
    assert!(!c2.pulled);
    assert_eq!(c1.path, c2.path);
    let c3 = cache
        .ensure(&image, PullPolicy::Never, &base())
        .await
        .unwrap();
    assert_eq!(c3.path, c1.path);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&c1.path).unwrap().permissions().mode();
    assert_eq!(mode & 0o222, 0, "cached disk is read-only");

    // A disk with a backing file is refused, by the import and by the cache.
    let bad = qcow2(d.path(), Some("/etc/hostname"));
    r.push_disk("fv/bad", "v1", &bad, "b.qcow2", false).unwrap();
    let bad_ref = reference::parse("url", &format!("{}/fv/bad:v1", r.addr)).unwrap();
    let e = cache
        .ensure(&bad_ref, PullPolicy::IfNotPresent, &opts(&r))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("backing file"), "{e}");

    // Two files under /disk/ are refused; a missing tag is an HTTP error naming it.
    let layers = vec![
        disk_layer("a.img", b"a", true).unwrap(),
        disk_layer("b.img", b"b", false).unwrap(),
    ];
    r.push_image("fv/two", "v1", &layers, false).unwrap();
    let two = reference::parse("url", &format!("{}/fv/two:v1", r.addr)).unwrap();
    let e = cache
        .ensure(&two, PullPolicy::IfNotPresent, &opts(&r))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("more than one file"), "{e}");
    let missing = reference::parse("url", &format!("{}/fv/none:v1", r.addr)).unwrap();
    let e = cache
        .ensure(&missing, PullPolicy::IfNotPresent, &opts(&r))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("MANIFEST_UNKNOWN"), "{e}");
}

#[tokio::test]
async fn basic_auth_registry() {
    let r = Registry::start_with_auth("alice", "s3cret").unwrap();
    let d = tempfile::tempdir().unwrap();
    let disk = qcow2(d.path(), None);
    r.push_disk("fv/private", "v1", &disk, "p.qcow2", false)
        .unwrap();
    let image = reference::parse("url", &format!("{}/fv/private:v1", r.addr)).unwrap();
    let cache = ImageCache::new(d.path().join("cache"), 1 << 30);
    let with = |user: &str, password: &str| ClientOptions {
        insecure_registries: vec![r.addr.clone()],
        auth: Some(BasicAuth {
            user: user.into(),
            password: password.into(),
        }),
        ..base()
    };
    let e = cache
        .ensure(&image, PullPolicy::Always, &opts(&r))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("requires credentials"), "{e}");
    let e = cache
        .ensure(&image, PullPolicy::Always, &with("alice", "wrong"))
        .await
        .unwrap_err();
    assert!(matches!(e, StorageError::Invalid { .. }), "{e}");
    assert!(
        e.to_string().contains("authentication as \"alice\" failed"),
        "{e}"
    );
    let c = cache
        .ensure(&image, PullPolicy::Always, &with("alice", "s3cret"))
        .await
        .unwrap();
    assert!(c.pulled);
}

/// A minimal registry with the Bearer token flow (docker-registry's token auth needs a
/// JWT-issuing server): manifests and blobs need `Bearer good-token`, which the realm hands
/// out for alice's basic credentials and the pull scope; blobs redirect to a second server
/// that refuses requests carrying the registry's Authorization header.
fn token_registry(manifest: Vec<u8>, layer: Vec<u8>, layer_digest: String) -> String {
    use std::io::{BufRead, BufReader, Write};
    use std::net::TcpListener;
    let storage = TcpListener::bind("127.0.0.1:0").unwrap();
    let storage_addr = storage.local_addr().unwrap();
    let registry = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = registry.local_addr().unwrap();
    fn read_request(s: &std::net::TcpStream) -> (String, Vec<String>) {
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut first = String::new();
        r.read_line(&mut first).unwrap();
        let mut headers = Vec::new();
        loop {
            let mut l = String::new();
            if r.read_line(&mut l).unwrap_or(0) <= 2 {
                break;
            }
            headers.push(l.trim().to_string());
        }
        (
            first.split_whitespace().nth(1).unwrap_or("").to_string(),
            headers,
        )
    }
    fn answer(mut s: std::net::TcpStream, status: &str, extra: &str, body: &[u8]) {
        let _ = write!(
            s,
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n",
            body.len()
        );
        let _ = s.write_all(body);
    }
    let blob = layer.clone();
    std::thread::spawn(move || {
        for s in storage.incoming().flatten() {
            let (_, headers) = read_request(&s);
            if headers
                .iter()
                .any(|h| h.to_ascii_lowercase().starts_with("authorization"))
            {
                answer(
                    s,
                    "400 Bad Request",
                    "",
                    b"credentials leaked to blob storage",
                );
            } else {
                answer(s, "200 OK", "", &blob);
            }
        }
    });
    std::thread::spawn(move || {
        let basic = format!(
            "Basic {}",
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, "alice:pw")
        );
        for s in registry.incoming().flatten() {
            let (path, headers) = read_request(&s);
            let has = |v: &str| {
                headers.iter().any(|h| {
                    h.split_once(':').is_some_and(|(n, x)| {
                        n.eq_ignore_ascii_case("authorization") && x.trim() == v
                    })
                })
            };
            if path.starts_with("/token?") {
                let scope_ok = path.contains("service=test-registry")
                    && path.contains("scope=repository%3Afv%2Fimg%3Apull");
                if has(&basic) && scope_ok {
                    answer(s, "200 OK", "", br#"{"token":"good-token"}"#);
                } else {
                    answer(s, "401 Unauthorized", "", b"{}");
                }
                continue;
            }
            if !has("Bearer good-token") {
                let challenge = format!(
                    "WWW-Authenticate: Bearer realm=\"http://{addr}/token\",service=\"test-registry\",scope=\"repository:fv/img:pull\"\r\n"
                );
                answer(s, "401 Unauthorized", &challenge, b"{}");
            } else if path == "/v2/fv/img/manifests/v1" {
                let ct = "Content-Type: application/vnd.oci.image.manifest.v1+json\r\n";
                answer(s, "200 OK", ct, &manifest);
            } else if path == format!("/v2/fv/img/blobs/{layer_digest}") {
                let loc = format!("Location: http://{storage_addr}/blob\r\n");
                answer(s, "307 Temporary Redirect", &loc, b"");
            } else {
                answer(s, "404 Not Found", "", b"{}");
            }
        }
    });
    addr.to_string()
}

#[tokio::test]
async fn bearer_token_flow_and_redirected_blobs() {
    use ferrovirt_testkit::registry::sha256_digest;
    let d = tempfile::tempdir().unwrap();
    let disk = std::fs::read(qcow2(d.path(), None)).unwrap();
    let layer = disk_layer("t.qcow2", &disk, true).unwrap();
    let layer_digest = sha256_digest(&layer);
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": sha256_digest(b"{}"), "size": 2},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": layer_digest, "size": layer.len()}],
    }))
    .unwrap();
    let addr = token_registry(manifest, layer, layer_digest);
    let image = reference::parse("image", &format!("{addr}/fv/img:v1")).unwrap();
    let opts = |password: &str| ClientOptions {
        insecure_registries: vec![addr.clone()],
        auth: Some(BasicAuth {
            user: "alice".into(),
            password: password.into(),
        }),
        ..base()
    };
    let cache = ImageCache::new(d.path().join("cache"), 1 << 30);
    let e = cache
        .ensure(&image, PullPolicy::Always, &opts("nope"))
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("authentication as \"alice\" failed"),
        "{e}"
    );
    let c = cache
        .ensure(&image, PullPolicy::Always, &opts("pw"))
        .await
        .unwrap();
    assert!(c.pulled);
    assert_eq!(c.info.file_name, "t.qcow2");
}

#[tokio::test]
async fn https_registry_with_a_custom_ca() {
    let plain = Registry::start().unwrap();
    let d = tempfile::tempdir().unwrap();
    plain
        .push_disk("fv/tls", "v1", &qcow2(d.path(), None), "t.qcow2", false)
        .unwrap();
    let (tls, ca) = plain.serve_tls().unwrap();
    let image = reference::parse("image", &format!("{}/fv/tls:v1", tls.addr)).unwrap();
    let cache = ImageCache::new(d.path().join("cache"), 1 << 30);
    // Not listed as insecure: HTTPS, and the system roots do not know the CA.
    let e = cache
        .ensure(&image, PullPolicy::Always, &base())
        .await
        .unwrap_err();
    assert!(matches!(e, StorageError::Tls { .. }), "{e}");
    let with_ca = ClientOptions {
        extra_ca_pem: ca.into_bytes(),
        ..base()
    };
    let c = cache
        .ensure(&image, PullPolicy::Always, &with_ca)
        .await
        .unwrap();
    assert!(c.pulled);
    drop(tls);
}
