//! Access control end to end (issue #19's acceptance, subresource part) through the real server
//! binary, its controllers and embedded agent, the test guest under TCG and the real kubectl:
//! a ServiceAccount bound to `kubevirt.io:edit` in namespace a (token from `kubectl create
//! token`) creates a VM there and reads its serial console (a command's output from the
//! guest); opening a console in namespace b is 403; a `kubevirt.io:view` account cannot open
//! the console nor start/stop the VM (403 with Kubernetes' message) while the edit account
//! may stop it; `kubectl auth can-i` answers as the server does in each case.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use base64::Engine;
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use futures::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::client::TlsStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

const BOOT: Duration = Duration::from_secs(180);
const STEP: Duration = Duration::from_secs(30);
const SUB: &str = "/apis/subresources.kubevirt.io/v1/namespaces";

/// The server's port and a TLS connector trusting the cluster CA.
struct Conn {
    port: u16,
    tls: tokio_rustls::TlsConnector,
}

type Wss = tokio_tungstenite::WebSocketStream<TlsStream<tokio::net::TcpStream>>;

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

    async fn connect(&self) -> anyhow::Result<TlsStream<tokio::net::TcpStream>> {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await?;
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?;
        Ok(self.tls.connect(name, tcp).await?)
    }

    /// One HTTPS request with `token`; returns the status code and the body.
    async fn call(&self, method: &str, path: &str, token: &str) -> anyhow::Result<(u16, String)> {
        let exchange = async {
            let mut s = self.connect().await?;
            let req = format!(
                "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
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
            // Bodies here are small: a chunked one is one chunk; keep its JSON.
            let body = match (body.find('{'), body.rfind('}')) {
                (Some(a), Some(b)) if b >= a => body[a..=b].to_string(),
                _ => body.to_string(),
            };
            Ok::<_, anyhow::Error>((code, body))
        };
        tokio::time::timeout(STEP, exchange)
            .await
            .with_context(|| format!("{method} {path} timed out"))?
    }

    /// Opens a console websocket with `token`: the stream, or the refusal's status and body.
    async fn websocket(
        &self,
        path: &str,
        token: &str,
    ) -> anyhow::Result<Result<Wss, (u16, String)>> {
        let tls = self.connect().await?;
        let mut req = format!("wss://127.0.0.1:{}{path}", self.port).into_client_request()?;
        let h = req.headers_mut();
        h.insert("Authorization", format!("Bearer {token}").parse()?);
        h.insert("Sec-WebSocket-Protocol", "plain.kubevirt.io".parse()?);
        let res = tokio::time::timeout(STEP, tokio_tungstenite::client_async(req, tls))
            .await
            .context("websocket handshake timed out")?;
        match res {
            Ok((ws, _)) => Ok(Ok(ws)),
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
                let body = resp
                    .body()
                    .as_ref()
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .unwrap_or_default();
                Ok(Err((resp.status().as_u16(), body)))
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// Reads binary frames until a complete line contains `needle`; returns that line.
async fn wait_for(ws: &mut Wss, needle: &str, timeout: Duration) -> anyhow::Result<String> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut seen = Vec::new();
    loop {
        let text = String::from_utf8_lossy(&seen).into_owned();
        let complete = text.rfind('\n').map_or("", |i| &text[..i]);
        if let Some(line) = complete.lines().find(|l| l.contains(needle)) {
            return Ok(line.to_string());
        }
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Err(_) => bail!("timed out waiting for {needle:?}; got: {text}"),
            Ok(None) => bail!("websocket closed while waiting for {needle:?}; got: {text}"),
            Ok(Some(msg)) => {
                if let Message::Binary(b) = msg? {
                    seen.extend_from_slice(&b);
                }
            }
        }
    }
}

/// kubectl with another kubeconfig and its own cache dir.
fn kubectl_as(c: &Cluster, kc: &Path, args: &[&str]) -> anyhow::Result<std::process::Output> {
    let cache = c.dir.path().join(format!(
        "cache-{}",
        kc.file_name().and_then(|n| n.to_str()).unwrap_or("x")
    ));
    Ok(std::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kc)
        .arg("--cache-dir")
        .arg(cache)
        .args(args)
        .output()?)
}

/// `kubectl auth can-i …` as that identity → yes/no.
fn can_i(c: &Cluster, kc: &Path, args: &[&str]) -> anyhow::Result<bool> {
    let mut all = vec!["auth", "can-i"];
    all.extend_from_slice(args);
    let out = kubectl_as(c, kc, &all)?;
    match String::from_utf8_lossy(&out.stdout).trim() {
        "yes" => Ok(true),
        "no" => Ok(false),
        other => bail!(
            "can-i {args:?}: {other:?} {}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// The admin kubeconfig with `token` instead of the admin token.
fn token_kubeconfig(c: &Cluster, name: &str, token: &str) -> anyhow::Result<PathBuf> {
    let admin = std::fs::read_to_string(&c.kubeconfig)?;
    let line = admin
        .lines()
        .find(|l| l.trim_start().starts_with("token: "))
        .context("admin kubeconfig has a token")?;
    let p = c.dir.path().join(name);
    std::fs::write(&p, admin.replace(line, &format!("    token: {token}")))?;
    Ok(p)
}

/// A PV holding a copy of the guest disk and a claim on it in namespace `ns`.
fn guest_claim(c: &Cluster, ns: &str, claim: &str) -> anyhow::Result<()> {
    let g = TestGuest::get()?;
    let dir = c.dir.path().join("pvs").join(claim);
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(&g.disk_raw, dir.join("disk.img"))?;
    c.apply(&format!(
        r#"
apiVersion: v1
kind: PersistentVolume
metadata: {{name: pv-{claim}}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteOnce]
  hostPath: {{path: {dir}}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {claim}, namespace: {ns}}}
spec:
  accessModes: [ReadWriteOnce]
  resources: {{requests: {{storage: 1Gi}}}}
  volumeName: pv-{claim}
"#,
        dir = dir.display()
    ))?;
    Ok(())
}

const VM: &str = r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: rvm, namespace: a}
spec:
  runStrategy: Always
  template:
    spec:
      terminationGracePeriodSeconds: 5
      domain:
        memory: {guest: 128Mi}
        devices:
          disks:
          - name: root
            disk: {bus: virtio}
      volumes:
      - name: root
        persistentVolumeClaim: {claimName: rvm-root}
"#;

fn eventually(what: &str, mut f: impl FnMut() -> anyhow::Result<bool>) -> anyhow::Result<()> {
    for _ in 0..100 {
        if f()? {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("timed out waiting for {what}")
}

#[test]
fn service_account_consoles_its_own_vm_only() -> anyhow::Result<()> {
    TestGuest::get()?;
    let started = std::time::Instant::now();
    let c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    for ns in ["a", "b"] {
        c.kubectl_ok(&["create", "namespace", ns])?;
    }
    for sa in ["robot", "viewer"] {
        c.kubectl_ok(&["-n", "a", "create", "serviceaccount", sa])?;
    }
    for (b, role, sa) in [
        ("robot-edit", "kubevirt.io:edit", "a:robot"),
        ("viewer-view", "kubevirt.io:view", "a:viewer"),
    ] {
        c.kubectl_ok(&[
            "-n",
            "a",
            "create",
            "rolebinding",
            b,
            &format!("--clusterrole={role}"),
            &format!("--serviceaccount={sa}"),
        ])?;
    }
    guest_claim(&c, "a", "rvm-root")?;
    let robot_token = c.kubectl_ok(&["-n", "a", "create", "token", "robot"])?;
    let robot_token = robot_token.trim().to_string();
    let viewer_token = c.kubectl_ok(&["-n", "a", "create", "token", "viewer"])?;
    let viewer_token = viewer_token.trim().to_string();
    let robot = token_kubeconfig(&c, "robot.yaml", &robot_token)?;
    let viewer = token_kubeconfig(&c, "viewer.yaml", &viewer_token)?;
    eventually("the robot's binding", || {
        can_i(
            &c,
            &robot,
            &["create", "virtualmachines.kubevirt.io", "-n", "a"],
        )
    })?;

    // The robot creates its VM in a.
    let vm_file = c.dir.path().join("vm.yaml");
    std::fs::write(&vm_file, VM)?;
    let out = kubectl_as(&c, &robot, &["apply", "-f", &vm_file.display().to_string()])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    c.wait_until("rvm Ready", BOOT, || {
        let v = c
            .get_json(&["-n", "a", "vmi", "rvm"])
            .unwrap_or(Value::Null);
        let ready = v["status"]["conditions"].as_array().is_some_and(|cs| {
            cs.iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        });
        Ok(ready.then_some(()))
    })?;
    let ready_at = started.elapsed();
    let uuid = c.get_json(&["-n", "a", "vmi", "rvm"])?["spec"]["domain"]["firmware"]["uuid"]
        .as_str()
        .context("the VMI has a firmware uuid")?
        .to_lowercase();

    // can-i as kubectl asks it (the group's discovery lists only subresources).
    let console = |ns: &str| -> Vec<String> {
        [
            "get",
            "virtualmachineinstances.subresources.kubevirt.io",
            "--subresource=console",
            "-n",
            ns,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let start_in_a = [
        "update",
        "virtualmachines.subresources.kubevirt.io",
        "--subresource=start",
        "-n",
        "a",
    ];
    let ask = |kc: &Path, args: &[String]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        can_i(&c, kc, &args)
    };
    assert!(ask(&robot, &console("a"))?);
    assert!(!ask(&robot, &console("b"))?);
    assert!(!ask(&viewer, &console("a"))?);
    assert!(can_i(&c, &robot, &start_in_a)?);
    assert!(!can_i(&c, &viewer, &start_in_a)?);
    assert!(!can_i(
        &c,
        &robot,
        &["list", "virtualmachines.kubevirt.io", "-n", "b"]
    )?);

    let conn = Conn::new(&c)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        // The robot reads its VM's serial console: a command's output from the guest.
        let path_a = format!("{SUB}/a/virtualmachineinstances/rvm/console");
        let mut ws = conn
            .websocket(&path_a, &robot_token)
            .await?
            .map_err(|(code, body)| anyhow::anyhow!("console refused: {code} {body}"))?;
        // The shell may still be starting (and eat the first characters): ask again.
        let mut line = String::new();
        for attempt in 0..4 {
            ws.send(Message::Binary(b"\n".to_vec().into())).await?;
            tokio::time::sleep(Duration::from_millis(500)).await;
            ws.send(Message::Binary(
                b"echo GUEST''-SAYS=$(cat /sys/class/dmi/id/product_uuid)-$((6*7))\n"
                    .to_vec()
                    .into(),
            ))
            .await?;
            match wait_for(&mut ws, "GUEST-SAYS=", Duration::from_secs(10)).await {
                Ok(l) => {
                    line = l;
                    break;
                }
                Err(e) if attempt == 3 => return Err(e),
                Err(_) => {}
            }
        }
        assert!(
            line.to_lowercase().contains(&format!("guest-says={uuid}-42")),
            "{line}"
        );
        drop(ws);

        // A console in b: 403 with Kubernetes' message (the VM need not exist there: the
        // authorizer answers first).
        let path_b = format!("{SUB}/b/virtualmachineinstances/rvm/console");
        let Err((code, body)) = conn.websocket(&path_b, &robot_token).await? else {
            bail!("the robot opened a console in b");
        };
        assert_eq!(code, 403, "{body}");
        let msg: Value = serde_json::from_str(&body)?;
        assert_eq!(
            msg["message"],
            "virtualmachineinstances.subresources.kubevirt.io \"rvm\" is forbidden: User \"system:serviceaccount:a:robot\" cannot get resource \"virtualmachineinstances/console\" in API group \"subresources.kubevirt.io\" in the namespace \"b\"",
            "{body}"
        );
        // The viewer may not open it either.
        let Err((code, _)) = conn.websocket(&path_a, &viewer_token).await? else {
            bail!("kubevirt.io:view opened a console");
        };
        assert_eq!(code, 403);

        // kubevirt.io:view cannot start (or stop) the VM; kubevirt.io:edit can stop it.
        let vm_path = format!("{SUB}/a/virtualmachines/rvm");
        for verb in ["start", "stop"] {
            let (code, body) = conn
                .call("PUT", &format!("{vm_path}/{verb}"), &viewer_token)
                .await?;
            assert_eq!(code, 403, "{body}");
            let msg: Value = serde_json::from_str(&body)?;
            assert_eq!(
                msg["message"],
                format!(
                    "virtualmachines.subresources.kubevirt.io \"rvm\" is forbidden: User \"system:serviceaccount:a:viewer\" cannot update resource \"virtualmachines/{verb}\" in API group \"subresources.kubevirt.io\" in the namespace \"a\""
                )
            );
        }
        let (code, body) = conn
            .call("PUT", &format!("{vm_path}/stop"), &robot_token)
            .await?;
        // KubeVirt answers the VM verbs 202 Accepted.
        assert_eq!(code, 202, "{body}");
        Ok::<(), anyhow::Error>(())
    })?;
    c.wait_until("rvm stopped", BOOT, || {
        let out = c.kubectl(&["-n", "a", "get", "vmi", "rvm"])?;
        Ok((!out.status.success()).then_some(()))
    })?;
    eprintln!(
        "access_control: VM Ready after {:.1} s, test done after {:.1} s",
        ready_at.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
