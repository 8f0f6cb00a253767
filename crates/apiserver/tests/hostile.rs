//! Hostile requests and local readers (issue #13), each performed against a real server: the
//! refusal names the field or path, and nothing is stored, read or left behind.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CMS: &str = "/api/v1/namespaces/default/configmaps";
const SECRETS: &str = "/api/v1/namespaces/default/secrets";

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .permissions()
        .mode()
        & 0o777
}

/// Whether any of `files` contains `needle`.
fn any_file_contains(files: &[std::path::PathBuf], needle: &[u8]) -> bool {
    files.iter().any(|f| {
        std::fs::read(f)
            .map(|b| b.windows(needle.len()).any(|w| w == needle))
            .unwrap_or(false)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_encrypted_at_rest_and_files_are_private() -> Result<()> {
    let ts = common::start().await?;
    let plain = "correct-horse-battery-staple-4f1c";
    let b64 = "Y29ycmVjdC1ob3JzZS1iYXR0ZXJ5LXN0YXBsZS00ZjFj";
    let r = ts
        .request(
            "POST",
            SECRETS,
            Some(json!({"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "db"}, "data": {"db-password-9e2b": b64}})),
        )
        .await?;
    assert_eq!(r.status, 201, "{}", r.text());
    // A ConfigMap is not encrypted (only Secrets are).
    let r = ts
        .request(
            "POST",
            CMS,
            Some(json!({"metadata": {"name": "plain"}, "data": {"k": "visible-marker-77"}})),
        )
        .await?;
    assert_eq!(r.status, 201);
    let dir = ts.dir.path().to_path_buf();
    let db_files: Vec<_> = ["state.db", "state.db-wal"]
        .iter()
        .map(|f| dir.join(f))
        .collect();
    assert!(
        !any_file_contains(&db_files, b64.as_bytes()),
        "base64 value in state.db"
    );
    assert!(!any_file_contains(&db_files, plain.as_bytes()));
    assert!(
        !any_file_contains(&db_files, b"db-password-9e2b"),
        "Secret keys are encrypted too (the key name is unique: CRD schemas mention passwords)"
    );
    assert!(any_file_contains(&db_files, b"k8s:enc:aesgcm:v1:"));
    assert!(any_file_contains(&db_files, b"visible-marker-77"));

    // Only the owner can read anything: a local user sees nothing.
    assert_eq!(mode(&dir), 0o700, "data dir");
    for f in [
        "state.db",
        "state.db-wal",
        "state.db-shm",
        "token",
        "kubeconfig.yaml",
        "encryption-keys",
        "tls/serving.key",
    ] {
        assert_eq!(mode(&dir.join(f)), 0o600, "{f}");
    }
    assert_eq!(mode(&dir.join("tls")), 0o700);

    // Rotate the key with the server stopped (SQLite: one process at a time), then read back.
    let srv = ts.server.as_ref().context("server")?;
    let old_keys = std::fs::read_to_string(dir.join("encryption-keys"))?;
    let _ = srv;
    let mut ts = ts;
    if let Some(s) = ts.server.take() {
        s.shutdown().await;
    }
    let store = ferrovirt_store::open_endpoint("", &dir).await?;
    let done = ferrovirt_store::encrypt::rotate(
        store,
        ferrovirt_apiserver::encryption_key_file(&dir),
        ferrovirt_apiserver::ENCRYPTED_PREFIXES,
        Duration::ZERO,
    )
    .await?;
    assert_eq!(done.rewritten, 1);
    let new_keys = std::fs::read_to_string(dir.join("encryption-keys"))?;
    for old in &done.retired {
        assert!(old_keys.contains(old.as_str()) && !new_keys.contains(old.as_str()));
    }
    assert_eq!(mode(&dir.join("encryption-keys")), 0o600);
    ts.server = Some(ferrovirt_apiserver::Server::start(common::options(&dir)).await?);
    let r = ts.request("GET", &format!("{SECRETS}/db"), None).await?;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["data"]["db-password-9e2b"], b64);
    ts.shutdown().await;
    Ok(())
}

/// A configmap to patch; returns its resourceVersion.
async fn make_cm(ts: &common::TestServer, name: &str) -> Result<String> {
    let r = ts
        .request(
            "POST",
            CMS,
            Some(json!({"metadata": {"name": name}, "data": {"k": "v"}})),
        )
        .await?;
    assert_eq!(r.status, 201, "{}", r.text());
    Ok(r.json()["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default()
        .to_string())
}

async fn patch(
    ts: &common::TestServer,
    name: &str,
    media: &str,
    body: &Value,
) -> Result<common::Resp> {
    let token = ts.srv().token.clone();
    ts.request_as(
        Some(&token),
        "PATCH",
        &format!("{CMS}/{name}"),
        Some(media),
        serde_json::to_vec(body)?,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patches_cannot_grow_an_object_past_the_limit() -> Result<()> {
    let ts = common::start().await?;
    let rv = make_cm(&ts, "target").await?;
    // ~57 KB of JSON patch whose `copy` operations double the object every step.
    let mut ops = vec![json!({"op": "add", "path": "/data/seed", "value": "x".repeat(56 * 1024)})];
    ops.push(json!({"op": "add", "path": "/metadata/annotations", "value": {}}));
    for i in 0..30 {
        ops.push(
            json!({"op": "copy", "from": "/data", "path": format!("/metadata/annotations/c{i}")}),
        );
        ops.push(
            json!({"op": "copy", "from": "/metadata/annotations", "path": format!("/data/d{i}")}),
        );
    }
    let body = Value::Array(ops);
    assert!(serde_json::to_vec(&body)?.len() < 60 * 1024);
    let r = patch(&ts, "target", "application/json-patch+json", &body).await?;
    assert_eq!(r.status, 413, "{}", r.text());
    let msg = r.json()["message"].as_str().unwrap_or_default().to_string();
    assert!(
        msg.contains("operation") && msg.contains("1572864"),
        "{msg}"
    );
    assert_eq!(r.json()["kind"], "Status");

    // Too many operations.
    let many = Value::Array(vec![
        json!({"op": "test", "path": "/data/k", "value": "v"});
        10_001
    ]);
    let r = patch(&ts, "target", "application/json-patch+json", &many).await?;
    assert_eq!(r.status, 413, "{}", r.text());
    assert!(r.text().contains("10000"), "{}", r.text());

    // A merge patch (and a strategic one) that makes the object too large.
    let big = json!({"data": {"big": "y".repeat(1600 * 1024)}});
    for media in [
        "application/merge-patch+json",
        "application/strategic-merge-patch+json",
    ] {
        let r = patch(&ts, "target", media, &big).await?;
        assert_eq!(r.status, 413, "{media}: {}", r.text());
    }
    // Create too large: refused as well.
    let r = ts
        .request(
            "POST",
            CMS,
            Some(json!({"metadata": {"name": "huge"}, "data": {"big": "z".repeat(1600 * 1024)}})),
        )
        .await?;
    assert_eq!(r.status, 413, "{}", r.text());

    // Nothing changed, nothing left behind.
    let r = ts.request("GET", &format!("{CMS}/target"), None).await?;
    assert_eq!(r.json()["metadata"]["resourceVersion"], rv.as_str());
    assert_eq!(r.json()["data"], json!({"k": "v"}));
    let r = ts.request("GET", &format!("{CMS}/huge"), None).await?;
    assert_eq!(r.status, 404);
    ts.shutdown().await;
    Ok(())
}

fn causes(r: &common::Resp) -> Vec<String> {
    r.json()["details"]["causes"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|c| c["field"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_labels_and_annotations_are_validated_before_use() -> Result<()> {
    let ts = common::start().await?;
    // A multibyte character across every byte position around the generateName cut (58) and
    // at byte 248 (the panic seen before).
    for at in [56, 57, 58, 59, 247, 248, 249] {
        let g = format!("{}é{}", "a".repeat(at), "b".repeat(10));
        let r = ts
            .request(
                "POST",
                CMS,
                Some(json!({"metadata": {"generateName": g}, "data": {}})),
            )
            .await?;
        assert_eq!(r.status, 422, "at {at}: {}", r.text());
        assert_eq!(causes(&r), vec!["metadata.generateName".to_string()]);
    }
    // A long valid prefix is cut on a boundary, as Kubernetes does (58 + 5).
    let r = ts
        .request(
            "POST",
            CMS,
            Some(json!({"metadata": {"generateName": "p".repeat(300)}, "data": {}})),
        )
        .await?;
    assert_eq!(r.status, 201, "{}", r.text());
    let name = r.json()["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(name.len(), 63);
    // Names with multibyte characters at the length limits.
    for n in [
        format!("{}é", "a".repeat(252)),
        "é".repeat(200),
        "a\u{0}b".into(),
    ] {
        let r = ts
            .request(
                "POST",
                CMS,
                Some(json!({"metadata": {"name": n}, "data": {}})),
            )
            .await?;
        assert_eq!(r.status, 422, "{}", r.text());
        assert!(
            causes(&r).contains(&"metadata.name".to_string()),
            "{}",
            r.text()
        );
    }
    // Labels and annotations.
    let bad = [
        (json!({"labels": {"ké": "v"}}), "metadata.labels"),
        (json!({"labels": {"k": "välue"}}), "metadata.labels[\"k\"]"),
        (
            json!({"labels": {"k": "v".repeat(64)}}),
            "metadata.labels[\"k\"]",
        ),
        (json!({"labels": {"k": 5}}), "metadata.labels[\"k\"]"),
        (json!({"annotations": {"a b": "x"}}), "metadata.annotations"),
        (
            json!({"annotations": {"big": "x".repeat(257 * 1024)}}),
            "metadata.annotations",
        ),
    ];
    for (meta, field) in bad {
        let mut m = meta.clone();
        m["name"] = json!("labelled");
        let r = ts
            .request("POST", CMS, Some(json!({"metadata": m, "data": {}})))
            .await?;
        assert_eq!(r.status, 422, "{meta}: {}", r.text());
        assert!(
            causes(&r).contains(&field.to_string()),
            "{meta}: {}",
            r.text()
        );
    }
    // The same checks after a patch.
    make_cm(&ts, "patched").await?;
    let r = patch(
        &ts,
        "patched",
        "application/merge-patch+json",
        &json!({"metadata": {"labels": {"bad/é": "x"}}}),
    )
    .await?;
    assert_eq!(r.status, 422, "{}", r.text());
    let r = ts.request("GET", &format!("{CMS}/labelled"), None).await?;
    assert_eq!(r.status, 404, "nothing stored");
    let r = ts.request("GET", "/version", None).await?;
    assert_eq!(r.status, 200);
    ts.shutdown().await;
    Ok(())
}

fn tight_limits(o: &mut ferrovirt_apiserver::ServerOptions) {
    o.connection_limits = ferrovirt_serve::Limits {
        handshake_timeout: Duration::from_secs(3),
        header_read_timeout: Duration::from_secs(2),
        ..Default::default()
    };
    o.body_timeout = Duration::from_secs(2);
}

/// Reads until EOF or error; true when the peer closed within `within`.
async fn closed_within<S: tokio::io::AsyncRead + Unpin>(s: &mut S, within: Duration) -> bool {
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_tls_connections_do_not_starve_the_api() -> Result<()> {
    let nofile = ferrovirt_serve::raise_nofile_limit().unwrap_or(0);
    let n = 1200.min(nofile.saturating_sub(600) as usize / 2);
    assert!(
        n >= 1000,
        "the test needs RLIMIT_NOFILE ≥ 2600 (have {nofile})"
    );
    let ts = common::start_with(tight_limits).await?;
    let addr = ts.srv().addr;
    // Connections that never send a ClientHello.
    let mut idle = Vec::new();
    for _ in 0..n {
        idle.push(tokio::net::TcpStream::connect(addr).await?);
    }
    // The API still answers, at once, over HTTP and to kubectl.
    let t = Instant::now();
    let r = ts.request("GET", "/version", None).await?;
    assert_eq!(r.status, 200);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let out = ts
        .kubectl_ok(&["get", "configmaps", "-A", "-o", "name"])
        .await?;
    let _ = out;
    // After the handshake timeout every half-open connection has been closed by the server.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut open = 0;
    for s in &mut idle {
        if !closed_within(s, Duration::from_millis(5)).await {
            open += 1;
        }
    }
    assert_eq!(open, 0, "{open} of {n} half-open connections still open");
    ts.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_headers_and_trickled_bodies_are_cut_but_watches_live_on() -> Result<()> {
    let ts = common::start_with(tight_limits).await?;
    let token = ts.srv().token.clone();
    // Headers trickled one line a second: cut at the 2 s header-read timeout.
    let mut s = ts.tls().await?;
    let t = Instant::now();
    s.write_all(b"GET /version HTTP/1.1\r\nHost: localhost\r\n")
        .await?;
    let trickle = async {
        for i in 0..10 {
            tokio::time::sleep(Duration::from_millis(700)).await;
            if s.write_all(format!("X-Slow-{i}: a\r\n").as_bytes())
                .await
                .is_err()
            {
                break;
            }
        }
        s
    };
    let mut s = trickle.await;
    assert!(closed_within(&mut s, Duration::from_secs(1)).await);
    assert!(t.elapsed() < Duration::from_secs(6), "{:?}", t.elapsed());

    // A body trickled after complete headers: 408 at the body timeout, nothing created.
    let mut s = ts.tls().await?;
    let head = format!(
        "POST {CMS} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"metadata\":"
    );
    s.write_all(head.as_bytes()).await?;
    let mut resp = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        let mut buf = [0u8; 4096];
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 {
                break;
            }
            resp.extend_from_slice(&buf[..n]);
            if resp.windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
    })
    .await;
    let text = String::from_utf8_lossy(&resp);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");

    // A watch streams far longer than the header timeout.
    let mut w = ts.tls().await?;
    w.write_all(
        format!("GET {CMS}?watch=true HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\n\r\n")
            .as_bytes(),
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    make_cm(&ts, "late").await?;
    let mut got = Vec::new();
    let found = tokio::time::timeout(Duration::from_secs(5), async {
        let mut buf = [0u8; 8192];
        loop {
            let n = w.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                return false;
            }
            got.extend_from_slice(&buf[..n]);
            if String::from_utf8_lossy(&got).contains("\"late\"") {
                return true;
            }
        }
    })
    .await
    .unwrap_or(false);
    assert!(
        found,
        "watch did not deliver: {}",
        String::from_utf8_lossy(&got)
    );
    ts.shutdown().await;
    Ok(())
}
