//! The Node `proxy` subresource through the real server binary and its embedded agent
//! (`GET /api/v1/nodes/{name}/proxy/{metrics|healthz}`, `crates/agent/src/proxy/node.rs`):
//! the admin gets the agent's Prometheus text (its content type) and `healthz`, also through
//! the real `kubectl get --raw`; every path outside the allow-list is refused 403 naming it,
//! each attack sent byte for byte (`..` segments, encoded slashes and dots, a query string, an
//! upgrade to the agent's console stream, a write) and none reaches the agent; a
//! ServiceAccount bound to `view` is refused 403 with Kubernetes' message and, once bound to
//! `system:kubelet-api-admin`, gets the metrics; an unknown node is 404, a node that is not
//! Ready or whose agent does not answer is 503 naming the node. One VM (the test guest under
//! TCG) runs so that the agent has series to serve.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use base64::Engine;
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const STEP: Duration = Duration::from_secs(30);
const BOOT: Duration = Duration::from_secs(120);
const VM: &str = r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: px, namespace: default}
spec:
  runStrategy: Always
  template:
    spec:
      terminationGracePeriodSeconds: 5
      domain:
        memory: {guest: 128Mi}
        devices:
          disks:
          - {name: root, disk: {bus: virtio}}
      volumes:
      - {name: root, persistentVolumeClaim: {claimName: px-root}}
"#;
const METRICS: &str = "/api/v1/nodes/node1/proxy/metrics";

/// The server's port and a TLS connector trusting the cluster CA.
struct Conn {
    port: u16,
    tls: tokio_rustls::TlsConnector,
}

/// One raw HTTP answer.
#[derive(Debug)]
struct Answer {
    code: u16,
    head: String,
    body: String,
}

impl Conn {
    fn new(c: &Cluster) -> anyhow::Result<Conn> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let kc = kube::config::Kubeconfig::read_from(&c.kubeconfig)?;
        let ca_b64 = kc
            .clusters
            .first()
            .and_then(|n| n.cluster.as_ref())
            .and_then(|c| c.certificate_authority_data.clone())
            .context("kubeconfig without certificate-authority-data")?;
        let ca_pem = base64::engine::general_purpose::STANDARD.decode(ca_b64.trim())?;
        let mut roots = rustls::RootCertStore::empty();
        use rustls::pki_types::pem::PemObject;
        for cert in rustls::pki_types::CertificateDer::pem_slice_iter(&ca_pem) {
            roots.add(cert?)?;
        }
        let cfg = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Conn {
            port: c.port,
            tls: tokio_rustls::TlsConnector::from(Arc::new(cfg)),
        })
    }

    /// Sends `target` exactly as given (no client-side path normalisation) with `token` and
    /// the extra header lines `extra`.
    async fn call(
        &self,
        method: &str,
        target: &str,
        token: &str,
        extra: &str,
    ) -> anyhow::Result<Answer> {
        let exchange = async {
            let tcp = tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await?;
            let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?;
            let mut s = self.tls.connect(name, tcp).await?;
            let req = format!(
                "{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n"
            );
            s.write_all(req.as_bytes()).await?;
            let mut raw = Vec::new();
            let _ = s.read_to_end(&mut raw).await;
            let text = String::from_utf8_lossy(&raw).into_owned();
            let (head, body) = text
                .split_once("\r\n\r\n")
                .with_context(|| format!("no HTTP response: {text:?}"))?;
            let code: u16 = head
                .split_whitespace()
                .nth(1)
                .context("no status code")?
                .parse()?;
            Ok::<_, anyhow::Error>(Answer {
                code,
                head: head.to_ascii_lowercase(),
                body: body.to_string(),
            })
        };
        tokio::time::timeout(STEP, exchange)
            .await
            .with_context(|| format!("{method} {target} timed out"))?
    }
}

/// Retries `f` until it returns Some (RBAC changes reach the server's cache by a watch).
async fn until<T, F, Fut>(what: &str, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + STEP;
    loop {
        if let Some(v) = f().await? {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[test]
fn node_proxy_forwards_metrics_only_and_is_authorised() -> anyhow::Result<()> {
    let started = Instant::now();
    TestGuest::get()?;
    let c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    let admin = std::fs::read_to_string(c.data_dir.join("token"))?
        .trim()
        .to_string();
    // The embedded agent has registered node1 with its endpoint.
    c.wait_until("node1 with an agent endpoint", STEP, || {
        let n = c.get_json(&["node", "node1"])?;
        Ok(
            n["metadata"]["annotations"]["ferrovirt.io/agent-endpoint-sha256"]
                .as_str()
                .map(|_| ()),
        )
    })?;
    // A running VM, so that the agent has series to serve.
    c.guest_disk_claim("px-root")?;
    c.apply(VM)?;
    c.wait_until("the VMI px Running", BOOT, || {
        let vmi = c.get_json(&["vmi", "px"]).ok();
        Ok(vmi
            .filter(|v| v["status"]["phase"] == "Running")
            .map(|_| ()))
    })?;
    let conn = Conn::new(&c)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let r = rt.block_on(run(&c, &conn, &admin));
    if r.is_err() {
        eprintln!("server log:\n{}", c.server_log());
    }
    r?;
    eprintln!("node proxy test took {:?}", started.elapsed());
    Ok(())
}

async fn run(c: &Cluster, conn: &Conn, admin: &str) -> anyhow::Result<()> {
    // The allowed paths: the agent's answer, its content type.
    let series =
        r#"kubevirt_vmi_cpu_usage_seconds_total{name="px",namespace="default",node="node1"}"#;
    let a = until("px's series through the proxy", || async {
        let a = conn.call("GET", METRICS, admin, "").await?;
        assert_eq!(a.code, 200, "{a:?}");
        Ok(a.body.contains(series).then_some(a))
    })
    .await?;
    assert!(
        a.head
            .contains("content-type: text/plain; version=0.0.4; charset=utf-8"),
        "{a:?}"
    );
    let h = conn
        .call("GET", "/api/v1/nodes/node1/proxy/healthz", admin, "")
        .await?;
    assert_eq!((h.code, h.body.trim()), (200, "ok"), "{h:?}");
    let raw = c.kubectl_ok(&["get", "--raw", METRICS])?;
    assert!(raw.contains(series), "{raw}");

    // The attacks: each refused 403 naming what was asked, never forwarded.
    let uid = "00000000-0000-0000-0000-000000000000";
    let attacks: Vec<(String, &str, &str)> = vec![
        (
            format!("/api/v1/nodes/node1/proxy/vmis/{uid}/console"),
            "",
            "vmis/",
        ),
        (
            format!("/api/v1/nodes/node1/proxy/metrics/../vmis/{uid}/vnc"),
            "",
            "metrics/../vmis/",
        ),
        (
            format!("/api/v1/nodes/node1/proxy/../proxy/vmis/{uid}/vnc"),
            "",
            "../proxy/vmis/",
        ),
        (
            format!("/api/v1/nodes/node1/proxy/..%2Fvmis%2F{uid}%2Fconsole"),
            "",
            "..%2Fvmis%2F",
        ),
        (
            "/api/v1/nodes/node1/proxy/metrics%2F..%2Fstorage%2Fvolumes".into(),
            "",
            "metrics%2F..%2Fstorage",
        ),
        (
            "/api/v1/nodes/node1/proxy/%6detrics".into(),
            "",
            "%6detrics",
        ),
        (
            "/api/v1/nodes/node1/proxy/metrics?path=/vmis/x/console".into(),
            "",
            "path=/vmis/x/console",
        ),
        (
            "/api/v1/nodes/node1/proxy/storage/volumes".into(),
            "",
            "storage/volumes",
        ),
        ("/api/v1/nodes/node1/proxy/".into(), "", "\\\"\\\""),
        (
            format!("/api/v1/nodes/node1/proxy/vmis/{uid}/console"),
            "Connection: Upgrade\r\nUpgrade: ferrovirt-stream\r\n",
            "vmis/",
        ),
    ];
    for (target, extra, named) in &attacks {
        let a = conn.call("GET", target, admin, extra).await?;
        assert_eq!(a.code, 403, "{target}: {a:?}");
        assert!(a.body.contains("\"kind\":\"Status\""), "{target}: {a:?}");
        assert!(
            a.body.contains("\"reason\":\"Forbidden\""),
            "{target}: {a:?}"
        );
        assert!(a.body.contains(named), "{target} must be named: {a:?}");
        assert!(a.body.contains("only metrics, healthz"), "{target}: {a:?}");
    }
    let post = conn.call("POST", METRICS, admin, "").await?;
    assert_eq!(post.code, 405, "{post:?}");

    // A ServiceAccount with `view` everywhere may not; with system:kubelet-api-admin it may.
    c.kubectl_ok(&["create", "serviceaccount", "robot", "-n", "default"])?;
    c.kubectl_ok(&[
        "create",
        "clusterrolebinding",
        "robot-view",
        "--clusterrole=view",
        "--serviceaccount=default:robot",
    ])?;
    let robot = c.kubectl_ok(&["create", "token", "robot", "-n", "default"])?;
    let robot = robot.trim();
    let refused = conn.call("GET", METRICS, robot, "").await?;
    assert_eq!(refused.code, 403, "{refused:?}");
    assert!(
        refused.body.contains(
            "nodes \\\"node1\\\" is forbidden: User \\\"system:serviceaccount:default:robot\\\" cannot get resource \\\"nodes/proxy\\\""
        ),
        "{refused:?}"
    );
    c.kubectl_ok(&[
        "create",
        "clusterrolebinding",
        "robot-kubelet",
        "--clusterrole=system:kubelet-api-admin",
        "--serviceaccount=default:robot",
    ])?;
    until(
        "the kubelet-api-admin binding to allow the proxy",
        || async {
            let a = conn.call("GET", METRICS, robot, "").await?;
            Ok((a.code == 200 && a.body.contains(series)).then_some(()))
        },
    )
    .await?;

    // An unknown node.
    let ghost = conn
        .call("GET", "/api/v1/nodes/ghost/proxy/metrics", admin, "")
        .await?;
    assert_eq!(ghost.code, 404, "{ghost:?}");
    assert!(
        ghost.body.contains("nodes \\\"ghost\\\" not found"),
        "{ghost:?}"
    );

    // A node that is not Ready, then one whose agent does not answer (a closed loopback port).
    let port = ferrovirt_testkit::free_port()?;
    c.apply(&format!(
        r#"apiVersion: v1
kind: Node
metadata:
  name: deadnode
  annotations:
    ferrovirt.io/agent-endpoint: https://127.0.0.1:{port}
    ferrovirt.io/agent-endpoint-sha256: "{}"
"#,
        "ab".repeat(32)
    ))?;
    let dead = "/api/v1/nodes/deadnode/proxy/metrics";
    let ready = |status: &str| {
        c.kubectl_ok(&[
            "patch",
            "node",
            "deadnode",
            "--subresource=status",
            "--type=merge",
            "-p",
            &format!(
                r#"{{"status":{{"conditions":[{{"type":"Ready","status":"{status}","reason":"Test"}}]}}}}"#
            ),
        ])
    };
    ready("False")?;
    let a = conn.call("GET", dead, admin, "").await?;
    assert_eq!(a.code, 503, "{a:?}");
    assert!(
        a.body.contains("node deadnode is not ready (Ready=False)"),
        "{a:?}"
    );
    ready("True")?;
    let a = conn.call("GET", dead, admin, "").await?;
    assert_eq!(a.code, 503, "{a:?}");
    assert!(
        a.body.contains(&format!(
            "node deadnode: agent at https://127.0.0.1:{port} unreachable"
        )),
        "{a:?}"
    );
    Ok(())
}
