//! Nodes that join with the join token (issue #19, "Nodes"; docs/nodes.md) through the real
//! server binary (no embedded agent), two `ferrovirt agent --server URL --token-file F`
//! processes, the test guest under TCG and the real kubectl: `ferrovirt token` prints the
//! token the server keeps; both agents join, keep their credential 0600, and a VM (a Secret
//! volume and cloud-init user data from a Secret, read by the agent as the node) boots on
//! one of them; acting as node j1 (its own client certificate), patching the VMI on j2, reading
//! a Secret no VMI of j1 references, reading j2's claim and patching j2's Node are 403 with
//! Kubernetes' message, while j1's own VMI and claim are open to it (`kubectl auth can-i`
//! agrees); an agent given a token
//! with a wrong CA hash exits non-zero naming the hash and the server never sees a request
//! from it; a wrong secret is refused (401) and a bad node name is refused naming the field;
//! the server reaches the joined agents' endpoints with a token derived for each node (never
//! its own API token); a second machine cannot join under a joined node's name (its node
//! password differs); a restarted agent reuses its credential. A VM on shared storage live
//! migrates, and one on a node-local disk block-migrates (the target moving the PV), between
//! two joined nodes, neither agent refused anything on the way. Deleting a Node forgets its
//! name (a new machine joins under it) and revokes its certificates (401, renewal included);
//! a joined agent's endpoint takes the server's token only with the server's client
//! certificate (mutual TLS); a joined node renews its short-lived certificate twice and its
//! Lease heartbeat goes on.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use anyhow::bail;
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(180);
const BIN: &str = env!("CARGO_BIN_EXE_ferrovirt");

/// A VM on `node` booting the test guest from claim `disk-<name>`, with a Secret volume
/// (`<name>-secret`) and cloud-init user data from a Secret (`<name>-userdata`): the node's
/// agent reads all three through the node authorizer.
fn vm(name: &str, node: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {name}, namespace: default}}
spec:
  runStrategy: Always
  template:
    spec:
      terminationGracePeriodSeconds: 5
      nodeSelector: {{kubernetes.io/hostname: {node}}}
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - name: root
            disk: {{bus: virtio}}
          - name: sec
            disk: {{bus: virtio}}
          - name: ci
            disk: {{bus: virtio}}
      volumes:
      - name: root
        persistentVolumeClaim: {{claimName: disk-{name}}}
      - name: sec
        secret: {{secretName: {name}-secret}}
      - name: ci
        cloudInitNoCloud: {{secretRef: {{name: {name}-userdata}}}}
"#
    )
}

/// kubectl as the node whose kubeconfig is `kc`.
fn kubectl_as(c: &Cluster, kc: &Path, args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kc)
        .arg("--cache-dir")
        .arg(c.dir().join("kubectl-cache-node"))
        .args(args)
        .output()?)
}

fn refused(c: &Cluster, kc: &Path, args: &[&str], want: &str) -> anyhow::Result<()> {
    let out = kubectl_as(c, kc, args)?;
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() || !err.contains(want) {
        bail!(
            "kubectl {args:?} as the node: want a refusal containing {want:?}, got {}: {err}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        );
    }
    Ok(())
}

fn allowed(c: &Cluster, kc: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = kubectl_as(c, kc, args)?;
    if !out.status.success() {
        bail!(
            "kubectl {args:?} as the node failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn write_token(c: &Cluster, name: &str, token: &str) -> anyhow::Result<PathBuf> {
    let p = c.dir().join(name);
    std::fs::write(&p, format!("{token}\n"))?;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600))?;
    Ok(p)
}

fn ready_nodes(c: &Cluster) -> anyhow::Result<Vec<String>> {
    let v = c.get_json(&["nodes"])?;
    Ok(v["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| {
            n["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        })
        .filter_map(|n| n["metadata"]["name"].as_str().map(String::from))
        .collect())
}

fn vmi_on(c: &Cluster, name: &str) -> anyhow::Result<Option<(String, String)>> {
    let out = c.kubectl(&["get", "vmi", name, "-o", "json"])?;
    if !out.status.success() {
        return Ok(None);
    }
    let v: Value = serde_json::from_slice(&out.stdout)?;
    if v["status"]["phase"] == "Failed" {
        bail!("VMI {name} failed: {}", v["status"]);
    }
    Ok((v["status"]["phase"] == "Running").then(|| {
        (
            v["status"]["nodeName"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            v["metadata"]["uid"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        )
    }))
}

#[test]
fn joined_nodes_run_vms_and_reach_only_their_own_objects() -> anyhow::Result<()> {
    TestGuest::get()?;
    let mut opts = ClusterOptions::new(BIN);
    opts.node_name = None;
    let mut c = Cluster::start(&opts)?;

    // `ferrovirt token` prints what the server keeps in DATA_DIR/node-token (0600).
    let out = Command::new(BIN)
        .args(["token", "--data-dir"])
        .arg(&c.data_dir)
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let token = String::from_utf8(out.stdout)?.trim().to_string();
    assert_eq!(token, c.join_token()?);
    assert!(token.starts_with("K10") && token.contains("::"), "{token}");
    let mode = |p: &Path| std::fs::metadata(p).map(|m| m.permissions().mode() & 0o777);
    assert_eq!(mode(&c.data_dir.join("node-token"))?, 0o600);
    assert!(c.server_log().contains("node join token"));
    let token_file = write_token(&c, "token", &token)?;

    // Two nodes join.
    let t0 = Instant::now();
    c.start_joined_agent("j1", &token_file)?;
    c.start_joined_agent("j2", &token_file)?;
    c.wait_until("j1 and j2 Ready", Duration::from_secs(90), || {
        let mut r = ready_nodes(&c)?;
        r.sort();
        Ok((r == ["j1", "j2"]).then_some(()))
    })?;
    eprintln!("two nodes joined and Ready in {:?}", t0.elapsed());
    for node in ["j1", "j2"] {
        let dir = c.extra_agent_dir(node).join("node-credential");
        assert_eq!(mode(&dir.join("node.key"))?, 0o600, "{node}");
        assert_eq!(mode(&dir.join("node.crt"))?, 0o600, "{node}");
        assert!(c.agent_log(node).contains("joined: node credential stored"));
    }
    assert!(
        c.server_log()
            .contains("issued a client certificate for system:node:j1")
    );

    // A VM boots on each joined node (the agents start them with their own credentials).
    for (name, node) in [("a", "j1"), ("b", "j2")] {
        c.guest_disk_claim(&format!("disk-{name}"))?;
        for s in ["secret", "userdata"] {
            c.kubectl_ok(&[
                "create",
                "secret",
                "generic",
                &format!("{name}-{s}"),
                "--from-literal=userdata=#cloud-config",
            ])?;
        }
        c.apply(&vm(name, node))?;
    }
    let t1 = Instant::now();
    let (node, uid) = c.wait_until("VMI a Running", BOOT, || vmi_on(&c, "a"))?;
    assert_eq!(node, "j1");
    let log = c
        .extra_agent_dir("j1")
        .join("vmis")
        .join(&uid)
        .join("serial.log");
    c.wait_until("FERROVIRT-BOOT on j1", BOOT, || {
        let text = std::fs::read(&log).unwrap_or_default();
        Ok(String::from_utf8_lossy(&text)
            .contains("FERROVIRT-BOOT")
            .then_some(()))
    })?;
    eprintln!("VM a booted on joined node j1 in {:?}", t1.elapsed());
    c.wait_until("VMI b bound to j2", BOOT, || {
        let v = c.get_json(&["vmi", "b"]);
        Ok(v.ok()
            .and_then(|v| (v["status"]["nodeName"] == "j2").then_some(())))
    })?;

    // Acting as node j1.
    let kc = c.node_credential_kubeconfig("j1")?;
    c.kubectl_ok(&[
        "create",
        "secret",
        "generic",
        "not-mine",
        "--from-literal=k=v",
    ])?;
    let who = allowed(&c, &kc, &["auth", "whoami", "-o", "json"])?;
    assert!(
        who.contains("system:node:j1") && who.contains("system:nodes"),
        "{who}"
    );
    refused(
        &c,
        &kc,
        &[
            "patch",
            "vmi",
            "b",
            "--type",
            "merge",
            "-p",
            r#"{"metadata":{"labels":{"x":"y"}}}"#,
        ],
        r#"virtualmachineinstances.kubevirt.io "b" is forbidden: User "system:node:j1" cannot patch resource "virtualmachineinstances""#,
    )?;
    refused(
        &c,
        &kc,
        &["get", "secret", "not-mine"],
        r#"secrets "not-mine" is forbidden: User "system:node:j1" cannot get resource "secrets" in API group "" in the namespace "default""#,
    )?;
    refused(&c, &kc, &["get", "secrets"], "forbidden")?;
    refused(&c, &kc, &["get", "pvc", "disk-b"], "forbidden")?;
    refused(
        &c,
        &kc,
        &["label", "node", "j2", "stolen=yes"],
        r#"nodes "j2" is forbidden: User "system:node:j1""#,
    )?;
    refused(&c, &kc, &["delete", "vm", "b"], "forbidden")?;
    // What is j1's is open to it; j1's Secrets are closed to j2.
    allowed(&c, &kc, &["get", "pvc", "disk-a"])?;
    allowed(&c, &kc, &["get", "secret", "a-secret"])?;
    allowed(&c, &kc, &["get", "secret", "a-userdata"])?;
    refused(&c, &kc, &["get", "secret", "b-secret"], "forbidden")?;
    let kc2 = c.node_credential_kubeconfig("j2")?;
    refused(&c, &kc2, &["get", "secret", "a-userdata"], "forbidden")?;
    allowed(&c, &kc2, &["get", "secret", "b-userdata"])?;
    allowed(
        &c,
        &kc,
        &[
            "patch",
            "vmi",
            "a",
            "--type",
            "merge",
            "-p",
            r#"{"metadata":{"labels":{"x":"y"}}}"#,
        ],
    )?;
    allowed(&c, &kc, &["get", "nodes"])?;
    // `kubectl auth can-i` answers as the node authorizer decides.
    for (args, want) in [
        (&["get", "secret/not-mine"][..], "no"),
        (&["get", "pvc/disk-a"][..], "yes"),
        (&["patch", "vmi/a"][..], "yes"),
        (&["patch", "vmi/b"][..], "no"),
        (&["patch", "node/j2"][..], "no"),
    ] {
        let mut a = vec!["auth", "can-i"];
        a.extend_from_slice(args);
        let out = kubectl_as(&c, &kc, &a)?;
        let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert_eq!(
            said,
            want,
            "can-i {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The node proxy would call another agent with the server's credential.
    refused(
        &c,
        &kc,
        &["get", "--raw", "/api/v1/nodes/j2/proxy/healthz"],
        "forbidden",
    )?;
    // The server reaches a joined node's endpoint with the token derived for that node.
    for node in ["j1", "j2"] {
        let health = c.kubectl_ok(&[
            "get",
            "--raw",
            &format!("/api/v1/nodes/{node}/proxy/healthz"),
        ])?;
        assert_eq!(health.trim(), "ok", "{node}");
    }
    let endpoint_token = std::fs::read_to_string(
        c.extra_agent_dir("j1")
            .join("node-credential/endpoint-token"),
    )?;
    assert_ne!(endpoint_token.trim(), c.join_token()?);
    let admin_token = std::fs::read_to_string(c.data_dir.join("token"))?;
    assert!(!endpoint_token.contains(admin_token.trim()));

    // A token with a wrong CA hash: the agent refuses before it sends anything.
    let (_, secret) = token.split_once("::").unwrap();
    let good_hash = &token[3..67];
    let bad_hash: String = good_hash
        .chars()
        .map(|ch| if ch == '0' { '1' } else { '0' })
        .collect();
    let bad_file = write_token(&c, "bad-token", &format!("K10{bad_hash}::{secret}"))?;
    c.start_joined_agent("bad", &bad_file)?;
    let status = c.wait_agent_exit("bad", Duration::from_secs(30))?;
    let bad_log = c.agent_log("bad");
    match status {
        Some(s) if !s.success() => {}
        other => bail!("the agent with a wrong CA hash did not fail: {other:?}\n{bad_log}"),
    }
    assert!(
        bad_log.contains(&format!("CA hash sha256:{bad_hash}")),
        "{bad_log}"
    );
    let metrics = c.kubectl_ok(&["get", "--raw", "/metrics"])?;
    assert!(
        !metrics.contains("ferrovirt-agent/bad"),
        "the server counted requests from the refused agent"
    );
    let server_log = c.server_log();
    assert!(!server_log.contains("system:node:bad"), "{server_log}");
    assert!(!server_log.contains("join refused"), "{server_log}");

    // A wrong secret is 401; a node name that is not DNS-1123 is refused naming the field.
    let wrong = write_token(
        &c,
        "wrong-secret",
        &format!("K10{good_hash}::{}", "f".repeat(64)),
    )?;
    c.start_joined_agent("wrongsecret", &wrong)?;
    let status = c.wait_agent_exit("wrongsecret", Duration::from_secs(30))?;
    assert!(status.is_some_and(|s| !s.success()));
    let log = c.agent_log("wrongsecret");
    assert!(log.contains("401"), "{log}");
    c.start_joined_agent("Bad_Name", &token_file)?;
    let status = c.wait_agent_exit("Bad_Name", Duration::from_secs(30))?;
    assert!(status.is_some_and(|s| !s.success()));
    let log = c.agent_log("Bad_Name");
    assert!(log.contains("422") && log.contains("nodeName"), "{log}");
    // Another machine with the token cannot take over a joined node's name.
    let impostor = c.dir().join("impostor");
    c.start_joined_agent_in("j1", &token_file, &impostor)?;
    let status = c.wait_agent_exit("j1", Duration::from_secs(30))?;
    assert!(status.is_some_and(|s| !s.success()));
    let log = std::fs::read_to_string(c.dir().join("agent-j1-impostor.log"))?;
    assert!(
        log.contains("403") && log.contains("already joined"),
        "{log}"
    );
    assert!(!impostor.join("node-credential/node.crt").exists());
    let nodes = ready_nodes(&c)?;
    assert_eq!(nodes.len(), 2, "{nodes:?}");

    // A restarted agent reuses its credential (no second join).
    c.kill_agent("j2")?;
    c.start_joined_agent("j2", &token_file)?;
    c.wait_until("j2 reuses its credential", Duration::from_secs(30), || {
        Ok(c.agent_log("j2")
            .contains("reusing the node credential")
            .then_some(()))
    })?;
    assert_eq!(
        c.server_log()
            .matches("issued a client certificate for system:node:j2")
            .count(),
        1
    );
    Ok(())
}

/// Two joined nodes and a VM on shared (RWX) storage, once the guest is ready: (cluster, VMI
/// uid, the node it runs on).
fn joined_pair_with_shared_vm() -> anyhow::Result<(Cluster, String, String)> {
    TestGuest::get()?;
    let mut opts = ClusterOptions::new(BIN);
    opts.node_name = None;
    let mut c = Cluster::start(&opts)?;
    let token_file = write_token(&c, "token", &c.join_token()?)?;
    c.start_joined_agent("j1", &token_file)?;
    c.start_joined_agent("j2", &token_file)?;
    c.wait_until("j1 and j2 Ready", Duration::from_secs(90), || {
        Ok((ready_nodes(&c)?.len() == 2).then_some(()))
    })?;
    c.shared_guest_disk_claim("shared")?;
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: mig, namespace: default}
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
        persistentVolumeClaim: {claimName: shared}
"#,
    )?;
    let (node, uid) = c.wait_until("VMI mig Running", BOOT, || vmi_on(&c, "mig"))?;
    let log = c
        .extra_agent_dir(&node)
        .join("vmis")
        .join(&uid)
        .join("serial.log");
    c.wait_until("the guest ready", BOOT, || {
        let text = std::fs::read(&log).unwrap_or_default();
        Ok(String::from_utf8_lossy(&text)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    c.wait_until("LiveMigratable=True", Duration::from_secs(30), || {
        let v = c.get_json(&["vmi", "mig"])?;
        Ok(v["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "LiveMigratable" && c["status"] == "True")
            .then_some(()))
    })?;
    Ok((c, uid, node))
}

#[test]
fn a_vm_live_migrates_between_joined_nodes() -> anyhow::Result<()> {
    let (c, uid, from) = joined_pair_with_shared_vm()?;
    let to = if from == "j1" { "j2" } else { "j1" };
    // The target writes the VMI it receives (bound to it by status.migrationState.targetNode)
    // and the source hands it over, each with its own credential.
    let t0 = Instant::now();
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstanceMigration
metadata: {name: mig-1, namespace: default}
spec: {vmiName: mig}
"#,
    )?;
    let m = c.wait_until("migration mig-1 finished", Duration::from_secs(120), || {
        let v = c.get_json(&["vmim", "mig-1"])?;
        let phase = v["status"]["phase"].as_str().unwrap_or_default();
        Ok(matches!(phase, "Succeeded" | "Failed").then_some(v))
    })?;
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    eprintln!(
        "live migration {from} → {to} between joined nodes: {:?}",
        t0.elapsed()
    );
    let v = c.get_json(&["vmi", "mig"])?;
    assert_eq!(v["status"]["nodeName"], to);
    assert_eq!(v["metadata"]["uid"], uid.as_str());
    assert_eq!(v["status"]["phase"], "Running");
    for node in [from.as_str(), to] {
        let log = c.agent_log(node);
        assert!(
            !log.to_lowercase().contains("forbidden"),
            "{node} was refused something:\n{log}"
        );
    }
    Ok(())
}

#[test]
fn a_vm_block_migrates_between_joined_nodes_and_the_target_moves_its_pv() -> anyhow::Result<()> {
    let g = TestGuest::get()?;
    let mut opts = ClusterOptions::new(BIN);
    opts.node_name = None;
    let mut c = Cluster::start(&opts)?;
    let token_file = write_token(&c, "token", &c.join_token()?)?;
    c.start_joined_agent("j1", &token_file)?;
    c.start_joined_agent("j2", &token_file)?;
    c.wait_until("j1 and j2 Ready", Duration::from_secs(90), || {
        Ok((ready_nodes(&c)?.len() == 2).then_some(()))
    })?;
    // A node-local volume on j1 holding the test guest (1 GiB, sparse).
    let src = c.extra_agent_dir("j1").join("volumes").join("pv-local");
    std::fs::create_dir_all(&src)?;
    std::fs::copy(&g.disk_raw, src.join("disk.img"))?;
    std::fs::OpenOptions::new()
        .write(true)
        .open(src.join("disk.img"))?
        .set_len(1 << 30)?;
    c.apply(&format!(
        r#"
apiVersion: v1
kind: PersistentVolume
metadata:
  name: pv-local
  annotations: {{pv.kubernetes.io/provisioned-by: ferrovirt.io/local}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: local
  local: {{path: {dir}}}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions:
        - {{key: kubernetes.io/hostname, operator: In, values: [j1]}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: local, namespace: default}}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: local
  resources: {{requests: {{storage: 1Gi}}}}
  volumeName: pv-local
---
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: blk, namespace: default}}
spec:
  runStrategy: Always
  template:
    spec:
      terminationGracePeriodSeconds: 5
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - name: root
            disk: {{bus: virtio}}
      volumes:
      - name: root
        persistentVolumeClaim: {{claimName: local}}
"#,
        dir = src.display()
    ))?;
    let (node, uid) = c.wait_until("VMI blk Running", BOOT, || vmi_on(&c, "blk"))?;
    assert_eq!(node, "j1");
    let log = c
        .extra_agent_dir("j1")
        .join("vmis")
        .join(&uid)
        .join("serial.log");
    c.wait_until("the guest ready", BOOT, || {
        let text = std::fs::read(&log).unwrap_or_default();
        Ok(String::from_utf8_lossy(&text)
            .contains("FERROVIRT-READY")
            .then_some(()))
    })?;
    c.wait_until("LiveMigratable=True", Duration::from_secs(30), || {
        let v = c.get_json(&["vmi", "blk"])?;
        Ok(v["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "LiveMigratable" && c["status"] == "True")
            .then_some(()))
    })?;
    let t0 = Instant::now();
    c.apply(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstanceMigration
metadata: {name: blk-1, namespace: default}
spec: {vmiName: blk}
"#,
    )?;
    let m = c.wait_until("migration blk-1 finished", Duration::from_secs(300), || {
        let v = c.get_json(&["vmim", "blk-1"])?;
        let phase = v["status"]["phase"].as_str().unwrap_or_default();
        Ok(matches!(phase, "Succeeded" | "Failed").then_some(v))
    })?;
    assert_eq!(m["status"]["phase"], "Succeeded", "{}", m["status"]);
    eprintln!(
        "block migration j1 → j2 between joined nodes: {:?}",
        t0.elapsed()
    );
    let v = c.get_json(&["vmi", "blk"])?;
    assert_eq!(v["status"]["migrationMethod"], "BlockMigration");
    assert_eq!(v["status"]["nodeName"], "j2");
    // j2 patched the PV onto itself (PV writes are allowed for claims of VMIs bound to it).
    let dst = c.extra_agent_dir("j2").join("volumes").join("pv-local");
    c.wait_until("the PV on j2", Duration::from_secs(60), || {
        let pv = c.get_json(&["pv", "pv-local"])?;
        Ok((pv["spec"]["local"]["path"] == dst.display().to_string()).then_some(()))
    })?;
    for node in ["j1", "j2"] {
        let log = c.agent_log(node);
        assert!(
            !log.to_lowercase().contains("forbidden"),
            "{node} was refused something:\n{log}"
        );
    }
    Ok(())
}

/// Deleting a Node forgets its name: its password record goes (a new machine with another
/// password may join under the name: 403 before the delete, 201 after) and its certificates
/// stop authenticating (401 naming the certificate), also after the new machine joined.
#[test]
fn a_deleted_node_is_forgotten_and_its_certificate_revoked() -> anyhow::Result<()> {
    let mut opts = ClusterOptions::new(BIN);
    opts.node_name = None;
    let mut c = Cluster::start(&opts)?;
    let token_file = write_token(&c, "token", &c.join_token()?)?;
    c.start_joined_agent("n1", &token_file)?;
    c.wait_until("n1 Ready", Duration::from_secs(90), || {
        Ok((ready_nodes(&c)? == ["n1"]).then_some(()))
    })?;
    let old = c.node_credential_kubeconfig("n1")?;
    allowed(&c, &old, &["get", "node", "n1"])?;

    // Another machine (another node password) cannot take the name while the Node exists.
    let second = c.dir().join("second");
    c.start_joined_agent_in("n1", &token_file, &second)?;
    let status = c.wait_agent_exit("n1", Duration::from_secs(30))?;
    assert!(status.is_some_and(|s| !s.success()));
    let log = std::fs::read_to_string(c.dir().join("agent-n1-second.log"))?;
    assert!(
        log.contains("403") && log.contains("already joined"),
        "{log}"
    );

    // The first machine goes away and its Node is deleted.
    c.kill_agent("n1")?;
    c.kubectl_ok(&["delete", "node", "n1"])?;
    let t0 = Instant::now();
    c.wait_until("n1's certificate refused", Duration::from_secs(10), || {
        let out = kubectl_as(&c, &old, &["get", "node", "n1"])?;
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        Ok((!out.status.success() && err.contains("no longer valid")).then_some(err))
    })?;
    eprintln!(
        "the deleted node's certificate refused after {:?}",
        t0.elapsed()
    );
    // Nor can it renew itself back (the renewal endpoint checks the same record).
    let cred = c.extra_agent_dir("n1").join("node-credential");
    let out = Command::new("curl")
        .args(["-sS", "-o", "-", "-w", "\n%{http_code}", "--cacert"])
        .arg(cred.join("server-ca.crt"))
        .arg("--cert")
        .arg(cred.join("node.crt"))
        .arg("--key")
        .arg(cred.join("node.key"))
        .args(["-H", "Content-Type: application/json", "--data"])
        .arg(r#"{"publicKey":"BAAA"}"#)
        .arg(format!(
            "https://127.0.0.1:{}/v1-ferrovirt/node-renew",
            c.port
        ))
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.ends_with("401") && text.contains("no longer valid"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        c.server_log()
            .contains("Node deleted: removed /ferrovirt/node-passwords/n1")
    );

    // Now the second machine joins under the name (201) and its Node becomes Ready.
    let t1 = Instant::now();
    c.start_joined_agent_in("n1", &token_file, &second)?;
    c.wait_until("the second n1 Ready", Duration::from_secs(90), || {
        Ok((ready_nodes(&c)? == ["n1"]).then_some(()))
    })?;
    eprintln!("the second machine joined as n1 in {:?}", t1.elapsed());
    let log = std::fs::read_to_string(c.dir().join("agent-n1-second.log"))?;
    assert!(log.contains("joined: node credential stored"), "{log}");
    assert!(second.join("node-credential/node.crt").exists());
    // The first machine's certificate stays refused, with a clear message.
    let out = kubectl_as(&c, &old, &["get", "node", "n1"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("system:node:n1") && err.contains("no longer valid"),
        "{err}"
    );

    // Mutual TLS on the joined agent's endpoint: the server (its client certificate
    // CN=system:ferrovirt-server and the derived token) gets in ...
    let health = c.kubectl_ok(&["get", "--raw", "/api/v1/nodes/n1/proxy/healthz"])?;
    assert_eq!(health.trim(), "ok");
    // ... while whoever holds the endpoint token without that certificate does not: none, or
    // the node's own certificate (signed by the same client CA).
    let node = c.get_json(&["node", "n1"])?;
    let url = node["metadata"]["annotations"]["ferrovirt.io/agent-endpoint"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(url.starts_with("https://"), "{node}");
    let cred = second.join("node-credential");
    let token = std::fs::read_to_string(cred.join("endpoint-token"))?;
    let auth = format!("Authorization: Bearer {}", token.trim());
    let no_cert: Vec<std::ffi::OsString> = vec![];
    let node_cert: Vec<std::ffi::OsString> = vec![
        "--cert".into(),
        cred.join("node.crt").into(),
        "--key".into(),
        cred.join("node.key").into(),
    ];
    for (what, cert) in [
        ("no certificate", &no_cert),
        ("n1's certificate", &node_cert),
    ] {
        let out = Command::new("curl")
            .args(["-sS", "-k", "-o", "-", "-w", "\n%{http_code}", "-H", &auth])
            .args(cert)
            .arg(format!("{url}/healthz"))
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.ends_with("401") && text.contains("system:ferrovirt-server"),
            "{what}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // A certificate with the server's subject from another CA fails the TLS handshake.
    let (fake_crt, fake_key) = (c.dir().join("fake.crt"), c.dir().join("fake.key"));
    let made = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
        ])
        .args(["-nodes", "-days", "1", "-subj"])
        .arg("/O=system:ferrovirt-servers/CN=system:ferrovirt-server")
        .arg("-keyout")
        .arg(&fake_key)
        .arg("-out")
        .arg(&fake_crt)
        .output()?;
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let out = Command::new("curl")
        .args([
            "-sS",
            "-k",
            "-o",
            "-",
            "-w",
            "\n%{http_code}",
            "-H",
            &auth,
            "--cert",
        ])
        .arg(&fake_crt)
        .arg("--key")
        .arg(&fake_key)
        .arg(format!("{url}/healthz"))
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && text.trim().ends_with("000") && err.contains("alert"),
        "a certificate of another CA: {text}{err}"
    );
    Ok(())
}

/// A joined node renews its certificate before it expires (the server issues 24 s
/// certificates here, `--node-cert-lifetime-seconds`) and keeps working across renewals: its
/// Lease heartbeat continues after the first certificate expired, the certificate it holds is
/// a new one each time for the same identity, and the one it renewed away from stays valid
/// until it expires.
#[test]
fn a_joined_node_renews_its_certificate_and_keeps_working() -> anyhow::Result<()> {
    let mut opts = ClusterOptions::new(BIN);
    opts.node_name = None;
    opts.extra_args = vec!["--node-cert-lifetime-seconds".into(), "24".into()];
    let mut c = Cluster::start(&opts)?;
    let token_file = write_token(&c, "token", &c.join_token()?)?;
    let t0 = Instant::now();
    c.start_joined_agent("r1", &token_file)?;
    c.wait_until("r1 Ready", Duration::from_secs(60), || {
        Ok((ready_nodes(&c)? == ["r1"]).then_some(()))
    })?;
    let cred = c.extra_agent_dir("r1").join("node-credential");
    let first = std::fs::read_to_string(cred.join("node.crt"))?;
    // A copy of the first credential, to act with it after the agent renewed.
    let keep = c.dir().join("first-credential");
    std::fs::create_dir_all(&keep)?;
    for f in ["node.crt", "node.key", "server-ca.crt"] {
        std::fs::copy(cred.join(f), keep.join(f))?;
    }
    let first_kc = c.dir().join("kubeconfig-first.yaml");
    std::fs::write(
        &first_kc,
        std::fs::read_to_string(c.node_credential_kubeconfig("r1")?)?
            .replace(&cred.display().to_string(), &keep.display().to_string()),
    )?;
    allowed(&c, &first_kc, &["get", "node", "r1"])?;

    let renewals = |c: &Cluster| {
        c.agent_log("r1")
            .matches("renewed the node certificate")
            .count()
    };
    c.wait_until("the first renewal", Duration::from_secs(40), || {
        Ok((renewals(&c) >= 1).then_some(()))
    })?;
    eprintln!("first renewal {:?} after the agent started", t0.elapsed());
    let second = std::fs::read_to_string(cred.join("node.crt"))?;
    assert_ne!(first, second);
    // Same identity; the certificate renewed away from still works until it expires.
    let kc = c.node_credential_kubeconfig("r1")?;
    let who = allowed(&c, &kc, &["auth", "whoami", "-o", "json"])?;
    assert!(
        who.contains("system:node:r1") && who.contains("system:nodes"),
        "{who}"
    );
    allowed(&c, &first_kc, &["get", "node", "r1"])?;
    // The renewed certificate renews again (the first one expires meanwhile).
    c.wait_until("the second renewal", Duration::from_secs(40), || {
        Ok((renewals(&c) >= 2).then_some(()))
    })?;
    eprintln!("second renewal {:?} after the agent started", t0.elapsed());
    assert!(
        c.server_log()
            .matches("node certificate renewed for system:node:r1")
            .count()
            >= 2
    );
    // The heartbeat continues with the renewed certificates.
    let renew_time = |c: &Cluster| -> anyhow::Result<String> {
        let l = c.get_json(&["lease", "r1", "-n", "kube-node-lease"])?;
        Ok(l["spec"]["renewTime"]
            .as_str()
            .unwrap_or_default()
            .to_string())
    };
    let before = renew_time(&c)?;
    c.wait_until("the Lease renewed again", Duration::from_secs(30), || {
        Ok((renew_time(&c)? != before).then_some(()))
    })?;
    assert_eq!(ready_nodes(&c)?, ["r1"]);
    let log = c.agent_log("r1");
    assert!(!log.contains("lease renewal failed"), "{log}");
    assert!(
        !log.contains("renewing the node certificate failed"),
        "{log}"
    );
    Ok(())
}
