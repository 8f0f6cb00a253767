//! The node-storage routes against a real endpoint (TLS pinned to its certificate, bearer
//! token) driven by the controllers' client: the work itself (create, blank, clone, grow,
//! delete), and the attacks — a wrong token, volume names that try to leave the volume root,
//! clone sources that name arbitrary files, another node's certificate.

use std::collections::BTreeMap;
use std::path::Path;

use k8s_openapi::api::core::v1::Node;

use super::client::NodeStorage;
use super::{CreateVolume, NodeStoreError, Populate, Source};
use crate::endpoint::{Endpoint, serve};
use crate::launchers::LauncherConfig;
use crate::node::{ENDPOINT_ANNOTATION, FINGERPRINT_ANNOTATION};

async fn start(dir: &Path) -> Endpoint {
    let cert = crate::tls::load_or_create(dir, &[]).unwrap();
    let cfg = LauncherConfig {
        binary: "ferrovirt".into(),
        data_dir: dir.to_path_buf(),
        qemu_binary: "qemu-system-x86_64".into(),
    };
    serve(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1",
        "node1",
        cfg,
        Some("node-token".into()),
        &cert,
    )
    .await
    .unwrap()
}

fn node(url: &str, fingerprint: &str) -> Node {
    let mut n = Node::default();
    n.metadata.name = Some("node1".into());
    n.metadata.annotations = Some(BTreeMap::from([
        (ENDPOINT_ANNOTATION.to_string(), url.to_string()),
        (FINGERPRINT_ANNOTATION.to_string(), fingerprint.to_string()),
    ]));
    n
}

fn size_of(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

#[tokio::test]
async fn volumes_are_made_filled_grown_and_removed_inside_the_root_only() {
    let dir = tempfile::tempdir().unwrap();
    let ep = start(dir.path()).await;
    let s = NodeStorage::of(&node(&ep.url, &ep.fingerprint), "node-token").unwrap();
    let req = CreateVolume {
        bytes: 1 << 20,
        block: false,
    };
    let path = s.create("pvc-1", &req).await.unwrap();
    assert_eq!(Path::new(&path), dir.path().join("volumes").join("pvc-1"));
    let img = Path::new(&path).join("disk.img");
    assert_eq!(size_of(&img), 1 << 20);
    std::fs::write(&img, b"data").unwrap();
    // Blank resets it; a same-node clone copies it; the copy grows; both go.
    let blank = Populate {
        capacity: 1 << 20,
        source: Source::Blank,
    };
    let mut seen = Vec::new();
    s.populate("pvc-1", &blank, |p| seen.push(p)).await.unwrap();
    assert_eq!(seen.last(), Some(&100.0));
    assert_eq!(size_of(&img), 1 << 20);
    assert!(std::fs::read(&img).unwrap().iter().all(|b| *b == 0));
    s.create("pvc-2", &req).await.unwrap();
    let copy = Populate {
        capacity: 1 << 20,
        source: Source::Volume {
            name: "pvc-1".into(),
        },
    };
    s.populate("pvc-2", &copy, |_| {}).await.unwrap();
    s.resize("pvc-2", 2 << 20).await.unwrap();
    assert_eq!(size_of(&dir.path().join("volumes/pvc-2/disk.img")), 2 << 20);
    s.delete("pvc-1").await.unwrap();
    s.delete("pvc-1").await.unwrap();
    assert!(!Path::new(&path).exists());
    // A volume the node does not have: 404, not created on the way.
    let missing = s.resize("pvc-9", 1 << 20).await.unwrap_err();
    assert!(
        matches!(missing, NodeStoreError::Answer { status: 404, .. }),
        "{missing}"
    );
    assert!(!dir.path().join("volumes/pvc-9").exists());
    ep.task.abort();
}

#[tokio::test]
async fn attacks_on_the_node_storage_routes_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ep = start(dir.path()).await;
    let n = node(&ep.url, &ep.fingerprint);
    let req = CreateVolume {
        bytes: 1 << 20,
        block: false,
    };
    // Without the agents' token nothing is done.
    let thief = NodeStorage::of(&n, "guess").unwrap();
    let e = thief.create("pvc-1", &req).await.unwrap_err();
    assert!(
        matches!(&e, NodeStoreError::Answer { status: 401, .. }),
        "{e}"
    );
    assert!(!dir.path().join("volumes").join("pvc-1").exists());
    // Another certificate than the Node publishes: refused before anything is sent.
    let other = crate::tls::AgentCert::generate(&["127.0.0.1".into()]).unwrap();
    let spoofed = NodeStorage::of(&node(&ep.url, &other.fingerprint_hex()), "node-token").unwrap();
    let e = spoofed.create("pvc-1", &req).await.unwrap_err();
    assert!(e.to_string().contains("does not match"), "{e}");

    let s = NodeStorage::of(&n, "node-token").unwrap();
    // Names that try to leave the volume root (`..`, an encoded slash, upper case).
    for bad in ["..", "a%2F..%2F..%2Fescape", "UPPER", "%2E%2E"] {
        let e = s.create(bad, &req).await.unwrap_err();
        assert!(
            e.is_permanent() || matches!(e, NodeStoreError::Answer { status: 404, .. }),
            "{bad}: {e}"
        );
        let e = s.delete(bad).await.unwrap_err();
        assert!(
            matches!(
                e,
                NodeStoreError::Answer {
                    status: 400 | 404,
                    ..
                }
            ),
            "{bad}: {e}"
        );
    }
    assert!(!dir.path().join("escape").exists());
    assert!(
        dir.path().join(crate::tls::TLS_DIR).exists(),
        "the delete left the agent's files alone"
    );
    // Clone sources that name arbitrary files or other volumes' paths are refused.
    s.create("pvc-1", &req).await.unwrap();
    let secret = dir.path().join("secret.img");
    std::fs::write(&secret, b"private").unwrap();
    for source in [
        Source::SharedImage {
            path: "/etc/passwd".into(),
        },
        Source::SharedImage {
            path: secret.to_string_lossy().into_owned(),
        },
        Source::SharedImage {
            path: dir
                .path()
                .join("volumes/pvc-1/disk.img")
                .to_string_lossy()
                .into_owned(),
        },
        Source::Volume {
            name: "../secret.img".into(),
        },
        Source::Volume {
            name: "pvc-404".into(),
        },
    ] {
        let shown = format!("{source:?}");
        let r = s
            .populate(
                "pvc-1",
                &Populate {
                    capacity: 1 << 20,
                    source,
                },
                |_| {},
            )
            .await
            .unwrap_err();
        assert!(r.permanent, "{shown}: {r:?}");
    }
    let img = std::fs::read(dir.path().join("volumes/pvc-1/disk.img")).unwrap();
    assert!(img.iter().all(|b| *b == 0), "nothing was copied");
    ep.task.abort();
}

/// The export read route (VirtualMachineExport downloads) streams a volume's bytes and
/// nothing else: a wrong token, a name leaving the root, a handle the volume's chain does not
/// hold (a path, an encoded `..`, a made-up layer) are all refused.
#[tokio::test]
async fn the_export_route_reads_volumes_only() {
    use http_body_util::BodyExt;
    let dir = tempfile::tempdir().unwrap();
    let ep = start(dir.path()).await;
    let s = NodeStorage::of(&node(&ep.url, &ep.fingerprint), "node-token").unwrap();
    let req = CreateVolume {
        bytes: 1 << 20,
        block: false,
    };
    let path = s.create("pvc-1", &req).await.unwrap();
    let img = Path::new(&path).join("disk.img");
    let mut bytes = vec![0u8; 1 << 20];
    bytes[..4].copy_from_slice(b"DATA");
    std::fs::write(&img, &bytes).unwrap();
    std::fs::write(dir.path().join("secret"), b"SECRET").unwrap();

    let resp = s.read_export("pvc-1", None).await.unwrap();
    assert_eq!(resp.headers()["content-length"], "1048576");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], &bytes[..]);

    let wrong = NodeStorage::of(&node(&ep.url, &ep.fingerprint), "wrong").unwrap();
    let e = wrong.read_export("pvc-1", None).await.unwrap_err();
    assert!(
        matches!(e, NodeStoreError::Answer { status: 401, .. }),
        "{e}"
    );
    for name in ["..", "%2E%2E", "a%2F..%2F..%2Fsecret"] {
        let e = s.read_export(name, None).await.unwrap_err();
        assert!(
            matches!(
                e,
                NodeStoreError::Answer {
                    status: 400 | 404,
                    ..
                }
            ),
            "{name}: {e}"
        );
    }
    assert!(s.read_export("pvc-1", Some("../secret")).await.is_err());
    for q in [
        "handle=..%2F..%2Fsecret",
        "handle=%2Fetc%2Fpasswd",
        "handle=layer-000009.qcow2",
    ] {
        let e = s
            .send(
                http::Method::GET,
                &format!("/storage/volumes/pvc-1/export?{q}"),
                super::client::json_body(Vec::new()),
                "application/json",
            )
            .await
            .unwrap_err();
        assert!(
            matches!(e, NodeStoreError::Answer { status: 400, .. }),
            "{q}: {e}"
        );
    }
}
