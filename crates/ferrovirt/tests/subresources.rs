//! End-to-end tests of KubeVirt's virt-api subresources (`subresources.kubevirt.io/v1`) through
//! the real server binary and its embedded node agent, with the test guest under TCG: the serial
//! console and VNC as websockets (subprotocol `plain.kubevirt.io`, binary frames), pause /
//! unpause / soft reboot, the guest-agent views, the VM start/stop/restart verbs, discovery, and
//! the 401 / 404 / 409 answers, and the agent endpoint's HTTPS with its certificate pinned on the
//! Node. Clients authenticate with the kubeconfig's token and trust its CA.

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

const BOOT: Duration = Duration::from_secs(150);
const STEP: Duration = Duration::from_secs(30);
const SUB: &str = "/apis/subresources.kubevirt.io/v1/namespaces/default";

/// What a client needs to talk to the cluster: port, bearer token, TLS trusting the CA.
struct Creds {
    port: u16,
    token: String,
    tls: tokio_rustls::TlsConnector,
}

impl Creds {
    fn from_kubeconfig(c: &Cluster) -> anyhow::Result<Creds> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let kc = kube::config::Kubeconfig::read_from(&c.kubeconfig)?;
        let ca_b64 = kc
            .clusters
            .first()
            .and_then(|n| n.cluster.as_ref())
            .and_then(|c| c.certificate_authority_data.clone())
            .context("kubeconfig without certificate-authority-data")?;
        let ca_pem = base64::engine::general_purpose::STANDARD.decode(ca_b64.trim())?;
        // The token is a secret string: its serialized form is the plain value.
        let users = serde_json::to_value(&kc.auth_infos)?;
        let token = users[0]["user"]["token"]
            .as_str()
            .context("kubeconfig without a token")?
            .to_string();
        let mut roots = rustls::RootCertStore::empty();
        use rustls::pki_types::pem::PemObject;
        for cert in rustls::pki_types::CertificateDer::pem_slice_iter(&ca_pem) {
            roots.add(cert?)?;
        }
        let cfg = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Creds {
            port: c.port,
            token,
            tls: tokio_rustls::TlsConnector::from(Arc::new(cfg)),
        })
    }

    async fn connect(&self) -> anyhow::Result<TlsStream<tokio::net::TcpStream>> {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await?;
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?;
        Ok(self.tls.connect(name, tcp).await?)
    }

    /// One HTTPS request; returns the status code and the body.
    async fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: &str,
    ) -> anyhow::Result<(u16, String)> {
        let exchange = async {
            let mut s = self.connect().await?;
            let auth = token
                .map(|t| format!("Authorization: Bearer {t}\r\n"))
                .unwrap_or_default();
            let req = format!(
                "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            s.write_all(req.as_bytes()).await?;
            let mut raw = Vec::new();
            // The server may end the TLS session without close_notify: keep what arrived.
            let _ = s.read_to_end(&mut raw).await;
            parse_response(&raw)
        };
        tokio::time::timeout(STEP, exchange)
            .await
            .with_context(|| format!("{method} {path} timed out"))?
    }

    async fn put(&self, path: &str) -> anyhow::Result<(u16, String)> {
        self.call("PUT", path, Some(&self.token), "").await
    }

    async fn get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        self.call("GET", path, Some(&self.token), "").await
    }

    /// Opens a websocket offering KubeVirt's subprotocol.
    async fn websocket(&self, path: &str) -> anyhow::Result<Ws> {
        let tls = self.connect().await?;
        let mut req = format!("wss://127.0.0.1:{}{path}", self.port).into_client_request()?;
        let h = req.headers_mut();
        h.insert("Authorization", format!("Bearer {}", self.token).parse()?);
        h.insert("Sec-WebSocket-Protocol", "plain.kubevirt.io".parse()?);
        let (ws, resp) = tokio::time::timeout(STEP, tokio_tungstenite::client_async(req, tls))
            .await
            .context("websocket handshake timed out")??;
        let proto = resp
            .headers()
            .get("sec-websocket-protocol")
            .and_then(|v| v.to_str().ok());
        assert_eq!(proto, Some("plain.kubevirt.io"));
        Ok(Ws {
            ws,
            seen: Vec::new(),
        })
    }
}

fn parse_response(raw: &[u8]) -> anyhow::Result<(u16, String)> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("no HTTP response: {text:?}"))?;
    let code: u16 = head
        .split_whitespace()
        .nth(1)
        .context("no status code")?
        .parse()?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 || after.len() < n {
                break;
            }
            out.push_str(&after[..n]);
            rest = after[n..].trim_start_matches("\r\n");
        }
        out
    } else {
        body.to_string()
    };
    Ok((code, body))
}

/// A console or VNC websocket with everything it received so far.
struct Ws {
    ws: tokio_tungstenite::WebSocketStream<TlsStream<tokio::net::TcpStream>>,
    seen: Vec<u8>,
}

impl Ws {
    async fn send(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        self.ws.send(Message::Binary(bytes.to_vec().into())).await?;
        Ok(())
    }

    /// Reads binary frames until a complete received line contains `needle`; returns that line
    /// and forgets everything received so far.
    async fn wait_for(&mut self, needle: &str, timeout: Duration) -> anyhow::Result<String> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let text = String::from_utf8_lossy(&self.seen).into_owned();
            // Complete lines only: a frame may end in the middle of one.
            let complete = text.rfind('\n').map_or("", |i| &text[..i]);
            if let Some(line) = complete.lines().find(|l| l.contains(needle)) {
                self.seen.clear();
                return Ok(line.to_string());
            }
            match tokio::time::timeout_at(deadline, self.ws.next()).await {
                Err(_) => bail!(
                    "timed out waiting for {needle:?}; got: {}",
                    text.chars()
                        .rev()
                        .take(2000)
                        .collect::<String>()
                        .chars()
                        .rev()
                        .collect::<String>()
                ),
                Ok(None) => bail!("websocket closed while waiting for {needle:?}; got: {text}"),
                Ok(Some(msg)) => match msg? {
                    Message::Binary(b) => self.seen.extend_from_slice(&b),
                    Message::Text(t) => bail!("text frame from the server: {t}"),
                    Message::Close(c) => {
                        bail!("closed ({c:?}) waiting for {needle:?}; got: {text}")
                    }
                    _ => {}
                },
            }
        }
    }

    /// Reads until at least `n` bytes arrived; returns them.
    async fn read_bytes(&mut self, n: usize, timeout: Duration) -> anyhow::Result<Vec<u8>> {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.seen.len() < n {
            match tokio::time::timeout_at(deadline, self.ws.next()).await {
                Err(_) => bail!("timed out after {} of {n} bytes", self.seen.len()),
                Ok(None) => bail!("websocket closed"),
                Ok(Some(msg)) => {
                    if let Message::Binary(b) = msg? {
                        self.seen.extend_from_slice(&b);
                    }
                }
            }
        }
        Ok(self.seen.clone())
    }
}

fn rt() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

fn cluster() -> anyhow::Result<Cluster> {
    Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))
}

/// A PV (hostPath directory holding a copy of the guest disk), a PVC bound to it, and a VMI
/// on it with a NoCloud volume, bound by hand to the embedded agent's node.
fn create_vmi(c: &Cluster, name: &str, uuid: &str) -> anyhow::Result<()> {
    let g = TestGuest::get()?;
    let dir = c.dir.path().join("pvs").join(name);
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(&g.disk_raw, dir.join("disk.img"))?;
    c.apply(&format!(
        r#"
apiVersion: v1
kind: PersistentVolume
metadata:
  name: pv-{name}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteOnce]
  hostPath: {{path: {dir}}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: {name}
  namespace: default
spec:
  accessModes: [ReadWriteOnce]
  resources: {{requests: {{storage: 1Gi}}}}
  volumeName: pv-{name}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: {name}
  namespace: default
spec:
  terminationGracePeriodSeconds: 5
  domain:
    firmware:
      uuid: {uuid}
      serial: serial-{name}
    memory: {{guest: 128Mi}}
    devices:
      disks:
      - name: root
        disk: {{bus: virtio}}
      - name: cloudinit
        disk: {{bus: virtio}}
  volumes:
  - name: root
    persistentVolumeClaim: {{claimName: {name}}}
  - name: cloudinit
    cloudInitNoCloud:
      userData: |
        #!/bin/sh
        echo configured
"#,
        dir = dir.display()
    ))?;
    c.kubectl_ok(&[
        "patch",
        "vmi",
        name,
        "--type=merge",
        "-p",
        r#"{"status":{"phase":"Scheduled","nodeName":"node1"}}"#,
    ])?;
    Ok(())
}

fn condition(v: &Value, type_: &str) -> Option<String> {
    v["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .and_then(|c| c["status"].as_str().map(String::from))
}

fn wait_condition(
    c: &Cluster,
    name: &str,
    type_: &str,
    status: &str,
    timeout: Duration,
) -> anyhow::Result<Value> {
    c.wait_until(&format!("{name} {type_}={status}"), timeout, || {
        let v = c.get_json(&["vmi", name])?;
        let s = condition(&v, type_).unwrap_or_else(|| "False".into());
        Ok((s == status).then_some(v))
    })
}

/// Waits until the launcher reports QEMU's run state as `phase` (it follows QMP's STOP and
/// RESUME events, which may trail the command's answer a little).
async fn wait_launcher_phase(c: &Cluster, uid: &str, phase: &str) -> anyhow::Result<()> {
    let dir = c.agent_dir().join("vmis").join(uid);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut l =
            ferrovirt_launcher::control::LauncherClient::connect(&dir, Duration::from_secs(5))
                .await?;
        let now = format!("{:?}", l.status().await?.phase);
        if now == phase {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("launcher phase is {now}, not {phase}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn status_of(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or(Value::Null)
}

#[test]
fn console_vnc_pause_and_guest_info_through_the_api() -> anyhow::Result<()> {
    TestGuest::get()?;
    let c = cluster()?;
    let rt = rt()?;
    let creds = Creds::from_kubeconfig(&c)?;
    let uuid = "6b1e9b57-2a4e-4b7c-9e0b-00000000cafe";
    create_vmi(&c, "sub1", uuid)?;
    let v = wait_condition(&c, "sub1", "Ready", "True", BOOT)?;
    let uid = v["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    // The guest agent connects once the guest is up; guest-agent views need it.
    wait_condition(&c, "sub1", "AgentConnected", "True", BOOT)?;
    let vmi_path = format!("{SUB}/virtualmachineinstances/sub1");

    rt.block_on(async {
        // Guest agent views.
        let (code, body) = creds.get(&format!("{vmi_path}/guestosinfo")).await?;
        assert_eq!(code, 200, "{body}");
        let info: Value = serde_json::from_str(&body)?;
        assert_eq!(info["os"]["id"], "ferrovirt-testguest", "{info}");
        assert_eq!(info["hostname"], "sub1", "{info}");
        let (code, body) = creds.get(&format!("{vmi_path}/userlist")).await?;
        assert_eq!(code, 200, "{body}");
        assert!(
            serde_json::from_str::<Value>(&body)?["items"].is_array(),
            "{body}"
        );
        let (code, body) = creds.get(&format!("{vmi_path}/filesystemlist")).await?;
        assert_eq!(code, 200, "{body}");
        assert!(
            serde_json::from_str::<Value>(&body)?["items"].is_array(),
            "{body}"
        );

        // The serial console: a shell answers, and a soft reboot shows the boot line again.
        let mut con = creds.websocket(&format!("{vmi_path}/console")).await?;
        con.send(b"\n").await?;
        con.send(b"echo UUID''-IS=$(cat /sys/class/dmi/id/product_uuid)\n")
            .await?;
        let line = con.wait_for("UUID-IS=", STEP).await?;
        assert!(line.to_lowercase().contains(uuid), "{line}");
        let (code, body) = creds.put(&format!("{vmi_path}/softreboot")).await?;
        assert_eq!(code, 200, "{body}");
        let boot = con.wait_for("FERROVIRT-BOOT", BOOT).await?;
        assert!(boot.contains(&format!("uuid={uuid}")), "{boot}");
        assert!(boot.contains("serial=serial-sub1"), "{boot}");
        con.wait_for("FERROVIRT-READY", BOOT).await?;
        drop(con);

        // VNC: the RFB greeting.
        let mut vnc = creds.websocket(&format!("{vmi_path}/vnc")).await?;
        let banner = vnc.read_bytes(12, STEP).await?;
        assert_eq!(&banner[..12], b"RFB 003.008\n");
        drop(vnc);

        // Pause and unpause, with 409 for repeats.
        let (code, body) = creds.put(&format!("{vmi_path}/pause")).await?;
        assert_eq!(code, 200, "{body}");
        wait_launcher_phase(&c, &uid, "Paused").await?;
        let (code, body) = creds.put(&format!("{vmi_path}/pause")).await?;
        assert_eq!(code, 409, "{body}");
        let st = status_of(&body);
        assert_eq!(st["kind"], "Status");
        assert_eq!(st["reason"], "Conflict");
        assert_eq!(st["message"], "VMI is already paused");
        anyhow::Ok(())
    })?;
    let v = wait_condition(&c, "sub1", "Paused", "True", STEP)?;
    assert_eq!(condition(&v, "Ready").as_deref(), Some("False"));
    rt.block_on(async {
        let (code, body) = creds.put(&format!("{vmi_path}/unpause")).await?;
        assert_eq!(code, 200, "{body}");
        wait_launcher_phase(&c, &uid, "Running").await?;
        let (code, body) = creds.put(&format!("{vmi_path}/unpause")).await?;
        assert_eq!(code, 409, "{body}");
        assert_eq!(status_of(&body)["message"], "VMI is not paused");
        anyhow::Ok(())
    })?;
    wait_condition(&c, "sub1", "Ready", "True", STEP)?;
    wait_condition(&c, "sub1", "Paused", "False", STEP)?;
    c.kubectl_ok(&["delete", "vmi", "sub1", "--wait=false"])?;
    Ok(())
}

/// The agent's Node publishes an `https://` endpoint and the SHA-256 of the certificate that
/// endpoint actually serves.
async fn agent_endpoint_is_pinned_https(creds: &Creds) -> anyhow::Result<()> {
    use ferrovirt_agent::node::{ENDPOINT_ANNOTATION, FINGERPRINT_ANNOTATION};
    use ferrovirt_agent::tls;
    let (code, body) = creds.get("/api/v1/nodes").await?;
    assert_eq!(code, 200, "{body}");
    let nodes: Value = serde_json::from_str(&body)?;
    let annotations = &nodes["items"][0]["metadata"]["annotations"];
    let url = annotations[ENDPOINT_ANNOTATION]
        .as_str()
        .context("no endpoint annotation")?;
    let published = annotations[FINGERPRINT_ANNOTATION]
        .as_str()
        .context("no fingerprint annotation")?;
    assert!(url.starts_with("https://"), "{url}");
    assert_eq!(published.len(), 64, "{published}");
    let target = tls::transport(url, Some(published))?;
    let pin = target.pin.context("no pin")?;
    // The pinned handshake succeeds, and the served certificate hashes to the annotation.
    let tcp = tokio::net::TcpStream::connect(&target.authority).await?;
    let conn = tls::connect(tcp, &target.host, pin).await?;
    let served = conn
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .context("no peer certificate")?;
    assert_eq!(
        tls::format_fingerprint(&tls::fingerprint(served)),
        published
    );
    // Any other pin is refused.
    let tcp = tokio::net::TcpStream::connect(&target.authority).await?;
    let mut other = pin;
    other[0] ^= 1;
    let err = tls::connect(tcp, &target.host, other)
        .await
        .err()
        .context("a wrong pin was accepted")?;
    assert!(tls::is_pin_mismatch(&err), "{err}");
    Ok(())
}

#[test]
fn errors_auth_and_discovery() -> anyhow::Result<()> {
    let c = cluster()?;
    let rt = rt()?;
    let creds = Creds::from_kubeconfig(&c)?;
    rt.block_on(async {
        let (code, body) = creds
            .put(&format!("{SUB}/virtualmachineinstances/nope/pause"))
            .await?;
        assert_eq!(code, 404, "{body}");
        let st = status_of(&body);
        assert_eq!(st["kind"], "Status");
        assert_eq!(st["reason"], "NotFound");
        let (code, _) = creds
            .get(&format!("{SUB}/virtualmachineinstances/nope/guestosinfo"))
            .await?;
        assert_eq!(code, 404);
        let (code, _) = creds
            .put(&format!("{SUB}/virtualmachines/nope/start"))
            .await?;
        assert_eq!(code, 404);
        // No token, or a wrong one: 401.
        let path = format!("{SUB}/virtualmachineinstances/nope/pause");
        let (code, _) = creds.call("PUT", &path, None, "").await?;
        assert_eq!(code, 401);
        let (code, _) = creds.call("PUT", &path, Some("wrong"), "").await?;
        assert_eq!(code, 401);
        // The wrong method, an unknown subresource.
        let (code, _) = creds
            .get(&format!("{SUB}/virtualmachineinstances/nope/pause"))
            .await?;
        assert_eq!(code, 405);
        let (code, _) = creds
            .get(&format!("{SUB}/virtualmachineinstances/nope/explode"))
            .await?;
        assert_eq!(code, 404);
        // Discovery: the group is listed in /apis and lists its subresources.
        let (code, body) = creds.get("/apis").await?;
        assert_eq!(code, 200, "{body}");
        assert!(body.contains("\"subresources.kubevirt.io\""), "{body}");
        let (code, body) = creds.get("/apis/subresources.kubevirt.io/v1").await?;
        assert_eq!(code, 200, "{body}");
        let list: Value = serde_json::from_str(&body)?;
        assert_eq!(list["kind"], "APIResourceList");
        let names: Vec<&str> = list["resources"]
            .as_array()
            .context("resources")?
            .iter()
            .filter_map(|r| r["name"].as_str())
            .collect();
        for n in [
            "virtualmachineinstances/console",
            "virtualmachineinstances/vnc",
            "virtualmachineinstances/pause",
            "virtualmachineinstances/guestosinfo",
            "virtualmachines/start",
            "virtualmachines/restart",
        ] {
            assert!(names.contains(&n), "{n} missing from {names:?}");
        }
        agent_endpoint_is_pinned_https(&creds).await?;
        anyhow::Ok(())
    })?;
    // A VMI that is not running: pause and console answer 409.
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: idle, namespace: default}
spec:
  nodeSelector: {ferrovirt.io/no-such-node: "true"}
  domain:
    memory: {guest: 64Mi}
    devices: {}
"#,
    )?;
    rt.block_on(async {
        let (code, body) = creds
            .put(&format!("{SUB}/virtualmachineinstances/idle/pause"))
            .await?;
        assert_eq!(code, 409, "{body}");
        assert_eq!(status_of(&body)["message"], "VMI is not running");
        anyhow::Ok(())
    })?;
    Ok(())
}

#[test]
fn vm_start_stop_restart_write_run_strategy_and_requests() -> anyhow::Result<()> {
    let c = cluster()?;
    let rt = rt()?;
    let creds = Creds::from_kubeconfig(&c)?;
    // Volume-less VMs: whatever a VM controller does with them stays cheap.
    let vm = |name: &str, strategy: &str| {
        format!(
            r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {name}, namespace: default}}
spec:
  runStrategy: {strategy}
  template:
    spec:
      domain:
        memory: {{guest: 64Mi}}
        devices: {{}}
"#
        )
    };
    c.apply(&vm("halted", "Halted"))?;
    c.apply(&vm("manual", "Manual"))?;
    let strategy = |name: &str| -> anyhow::Result<String> {
        Ok(c.get_json(&["vm", name])?["spec"]["runStrategy"]
            .as_str()
            .unwrap_or_default()
            .to_string())
    };
    let vms = format!("{SUB}/virtualmachines");
    rt.block_on(async {
        // Halted: restart is refused, start flips to Always.
        let (code, body) = creds.put(&format!("{vms}/halted/restart")).await?;
        assert_eq!(code, 409, "{body}");
        let (code, body) = creds.put(&format!("{vms}/halted/start")).await?;
        assert_eq!(code, 202, "{body}");
        anyhow::Ok(())
    })?;
    assert_eq!(strategy("halted")?, "Always");
    rt.block_on(async {
        // Always: a second start is a conflict; stop flips back to Halted.
        let (code, body) = creds.put(&format!("{vms}/halted/start")).await?;
        assert_eq!(code, 409, "{body}");
        assert_eq!(status_of(&body)["reason"], "Conflict");
        let (code, body) = creds
            .call(
                "PUT",
                &format!("{vms}/halted/stop"),
                Some(&creds.token),
                r#"{"gracePeriod": 0}"#,
            )
            .await?;
        assert_eq!(code, 202, "{body}");
        // Manual without a VMI: stop is a conflict, start writes a Start request.
        let (code, body) = creds.put(&format!("{vms}/manual/stop")).await?;
        assert_eq!(code, 409, "{body}");
        assert_eq!(status_of(&body)["message"], "VM is not running");
        let (code, body) = creds.put(&format!("{vms}/manual/start")).await?;
        assert_eq!(code, 202, "{body}");
        anyhow::Ok(())
    })?;
    assert_eq!(strategy("halted")?, "Halted");
    // The Start request is in the VM's status until a VM controller acts on it (then a VMI
    // exists): either shows that the request was written.
    c.wait_until("manual VM start requested", STEP, || {
        let v = c.get_json(&["vm", "manual"])?;
        let requested = v["status"]["stateChangeRequests"]
            .as_array()
            .is_some_and(|r| r.iter().any(|r| r["action"] == "Start"));
        let created = c.kubectl(&["get", "vmi", "manual"])?.status.success();
        Ok((requested || created).then_some(()))
    })?;
    c.kubectl_ok(&["delete", "vm", "halted", "manual", "--wait=false"])?;
    Ok(())
}
