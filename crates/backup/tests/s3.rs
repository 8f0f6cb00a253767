//! The repository on a real S3-protocol server: moto (`moto_server`, PyPI `moto[server]`,
//! installed by scripts/install-deps.sh) started on loopback by the test. A backup written
//! through one repository handle is listed, restored and verified through another (as a
//! second cluster with the same bucket and key would); a wrong key is refused; a chunk altered
//! in the bucket is named by verify.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use ferrovirt_backup::repo::Create;
use ferrovirt_backup::{BackupError, Repository, S3Target, Target};
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

struct Moto(Child);
impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn moto_binary() -> String {
    if let Ok(p) = std::env::var("FERROVIRT_MOTO_SERVER") {
        return p;
    }
    let venv = "/opt/ferrovirt-moto/bin/moto_server";
    if std::path::Path::new(venv).exists() {
        return venv.into();
    }
    "moto_server".into()
}

async fn start_moto() -> (Moto, u16) {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let child = Command::new(moto_binary())
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("moto_server (scripts/install-deps.sh installs it)");
    let moto = Moto(child);
    // wait (generously) until it answers
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "moto did not start");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    (moto, port)
}

async fn create_bucket(port: u16, bucket: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let req = format!(
        "PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).await.unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
}

fn target(port: u16) -> Target {
    Target::S3 {
        s3: S3Target {
            endpoint: format!("http://127.0.0.1:{port}"),
            bucket: "backups".into(),
            region: "us-east-1".into(),
            access_key_id: "testing".into(),
            secret_access_key: "testing".into(),
            session_token: None,
            path_style: true,
            ca_bundle: None,
        },
        prefix: "site-a".into(),
    }
}

fn image() -> Vec<u8> {
    let mut x: u64 = 0x9e3779b97f4a7c15;
    let mut v: Vec<u8> = (0..(9 << 20))
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    v[(4 << 20)..(8 << 20)].fill(0);
    v
}

#[tokio::test]
async fn backup_restore_verify_on_s3() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (_moto, port) = start_moto().await;
    create_bucket(port, "backups").await;
    let key = b"0123456789abcdef-s3-test-key";
    let img = image();

    let repo = Repository::open(&target(port), key, Create::IfMissing)
        .await
        .unwrap();
    let mut w = repo.begin("default-b1").await.unwrap();
    let d = w.write_disk("rootdisk", &img[..], &|_| {}).await.unwrap();
    assert_eq!(d.stats.bytes_read, img.len() as u64);
    assert_eq!(d.stats.bytes_zero, 4 << 20);
    w.commit("2026-12-02T15:00:00Z", vec![], vec![])
        .await
        .unwrap();

    // another handle, as a second cluster with only the bucket and the key
    let other = Repository::open(&target(port), key, Create::Never)
        .await
        .unwrap();
    let list = other.list().await.unwrap();
    assert_eq!(
        list.iter().map(|e| e.name.as_str()).collect::<Vec<_>>(),
        ["default-b1"]
    );
    let mut out = Vec::new();
    other
        .restore_disk("default-b1", "rootdisk", &mut out, &|_| {})
        .await
        .unwrap();
    assert!(out == img, "restored bytes differ");

    // the same image again: nothing new uploaded
    let mut w = other.begin("default-b2").await.unwrap();
    let d = w.write_disk("rootdisk", &img[..], &|_| {}).await.unwrap();
    assert_eq!(d.stats.bytes_new, 0);
    w.commit("2026-12-02T15:01:00Z", vec![], vec![])
        .await
        .unwrap();

    // a wrong key is refused before anything is read
    let err = Repository::open(
        &target(port),
        b"not the right key at all",
        Create::IfMissing,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, BackupError::WrongKey), "{err}");

    // alter one chunk in the bucket: verify names it
    let (store, prefix): (&Arc<dyn ObjectStore>, &str) = other.store();
    let chunk_prefix = object_store::path::Path::from(format!("{prefix}/chunks"));
    let mut chunks: Vec<_> = {
        use futures::TryStreamExt;
        store.list(Some(&chunk_prefix)).try_collect().await.unwrap()
    };
    chunks.sort_by(|a, b| a.location.cmp(&b.location));
    assert_eq!(chunks.len(), 2);
    let victim = chunks[0].location.clone();
    let mut bytes = store
        .get(&victim)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    store.put(&victim, PutPayload::from(bytes)).await.unwrap();
    let report = other.verify(None, &|_, _| {}).await.unwrap();
    assert_eq!(report.backups.len(), 2);
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(
        victim.as_ref().ends_with(&report.problems[0].object),
        "{:?}",
        report.problems
    );
    assert_eq!(report.problems[0].disk.as_deref(), Some("rootdisk"));
}
