//! `ferrovirt port-forward` and `ferrovirt ssh` against a real server and a booted test guest
//! (QEMU user-mode networking, so the guest has no address the host could route to): a local
//! port reaches the guest's HTTP server through the `portforward` websocket, two connections at
//! once, `--stdio` carries one connection, `ssh` logs in to the guest's dropbear with a key
//! written by cloud-init user-data, and errors name what is missing.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest, http_get};

const BIN: &str = env!("CARGO_BIN_EXE_ferrovirt");
const BOOT: Duration = Duration::from_secs(240);

fn ferrovirt(c: &Cluster) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.arg("--kubeconfig")
        .arg(&c.kubeconfig)
        .env("RUST_LOG", "warn");
    cmd
}

/// A running `port-forward` and the local port of its first listener.
struct Forward {
    child: Child,
    port: u16,
    /// Kept open: the child's later writes must not fail.
    _stdout: BufReader<std::process::ChildStdout>,
}

impl Drop for Forward {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn forward(c: &Cluster, target: &str, spec: &str) -> anyhow::Result<Forward> {
    let mut child = ferrovirt(c)
        .args(["port-forward", target, spec])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let mut line = String::new();
    let mut stdout = BufReader::new(child.stdout.take().context("stdout")?);
    stdout.read_line(&mut line)?;
    // "Forwarding from 127.0.0.1:PORT -> REMOTE"
    let port = line
        .strip_prefix("Forwarding from 127.0.0.1:")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("unexpected first line {line:?}"))?;
    Ok(Forward {
        child,
        port,
        _stdout: stdout,
    })
}

/// Runs `ferrovirt ARGS` with stdin kept open until stdout ends; (exit code, stdout, stderr).
fn run_piped(c: &Cluster, args: &[&str], input: &[u8]) -> anyhow::Result<(i32, String, String)> {
    let mut child = ferrovirt(c)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stdin = child.stdin.take().context("stdin")?;
    stdin.write_all(input)?;
    let mut err = child.stderr.take().context("stderr")?;
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut out = String::new();
    child
        .stdout
        .take()
        .context("stdout")?
        .read_to_string(&mut out)?;
    drop(stdin);
    let deadline = Instant::now() + Duration::from_secs(30);
    let code = loop {
        if let Some(s) = child.try_wait()? {
            break s.code().unwrap_or(-1);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("ferrovirt {} did not exit", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok((code, out, t_err.join().unwrap_or_default()))
}

#[test]
fn port_forward_and_ssh_reach_a_guest_without_a_route() -> anyhow::Result<()> {
    TestGuest::get()?;
    let c = Cluster::start(&ClusterOptions::new(BIN))?;
    c.guest_disk_claim("pf-root")?;
    let key = c.dir.path().join("id");
    let st = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&key)
        .status()?;
    anyhow::ensure!(st.success(), "ssh-keygen failed");
    let public = std::fs::read_to_string(key.with_extension("pub"))?;
    let vm = format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: pf, namespace: default}}
spec:
  runStrategy: Always
  template:
    spec:
      terminationGracePeriodSeconds: 5
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - {{name: root, disk: {{bus: virtio}}}}
          - {{name: cloudinit, disk: {{bus: virtio}}}}
      volumes:
      - {{name: root, persistentVolumeClaim: {{claimName: pf-root}}}}
      - name: cloudinit
        cloudInitNoCloud:
          userData: |
            #!/bin/sh
            mkdir -p /root/.ssh
            echo "{}" > /root/.ssh/authorized_keys
            chmod 600 /root/.ssh/authorized_keys
"#,
        public.trim()
    );
    c.apply(&vm)?;
    c.wait_until("VMI pf running", BOOT, || {
        let v = c.get_json(&["vmi", "pf"]).ok();
        Ok(v.filter(|v| v["status"]["phase"] == "Running").map(drop))
    })?;

    // A local port: the guest's HTTP server answers with its hostname (the VMI name), also for
    // two connections at once.
    let fwd = forward(&c, "vm/pf", ":80")?;
    let page = c.wait_until("the guest's HTTP page through port-forward", BOOT, || {
        Ok(http_get(fwd.port, "/", Duration::from_secs(10))
            .ok()
            .filter(|b| b.contains("pf")))
    })?;
    assert!(page.contains("pf"), "{page}");
    let a = std::thread::spawn({
        let port = fwd.port;
        move || http_get(port, "/", Duration::from_secs(30))
    });
    let b = http_get(fwd.port, "/", Duration::from_secs(30))?;
    assert!(b.contains("pf") && a.join().unwrap()?.contains("pf"));
    drop(fwd);

    // --stdio: one connection over stdin/stdout (the VMI form and an explicit namespace).
    let (code, out, err) = run_piped(
        &c,
        &["port-forward", "--stdio", "vmi/pf.default", "80"],
        b"GET / HTTP/1.0\r\n\r\n",
    )?;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("HTTP/1.") && out.contains("pf"), "{out}");

    // ssh through the API server with the key cloud-init installed.
    let ssh = ferrovirt(&c)
        .args(["ssh", "root@vm/pf", "-i"])
        .arg(&key)
        .args([
            "-t",
            "-o StrictHostKeyChecking=no",
            "-t",
            "-o UserKnownHostsFile=/dev/null",
            "-t",
            "-o BatchMode=yes",
            "-c",
            "echo ssh-ok from $(hostname) as $(id -un)",
        ])
        .stdin(Stdio::null())
        .output()?;
    let out = String::from_utf8_lossy(&ssh.stdout);
    assert!(
        ssh.status.success() && out.contains("ssh-ok from pf as root"),
        "ssh: {:?}\n{out}\n{}",
        ssh.status,
        String::from_utf8_lossy(&ssh.stderr)
    );
    // The ssh exit code is passed on.
    let ssh = ferrovirt(&c)
        .args(["ssh", "root@vm/pf", "-i"])
        .arg(&key)
        .args([
            "-t",
            "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes",
            "-c",
            "exit 7",
        ])
        .stdin(Stdio::null())
        .output()?;
    assert_eq!(ssh.status.code(), Some(7), "{ssh:?}");

    // Errors: a missing VMI, a bad port, an unsupported protocol.
    let (code, _, err) = run_piped(&c, &["port-forward", "--stdio", "vmi/nope", "80"], b"")?;
    assert_eq!(code, 1);
    assert!(
        err.contains("virtualmachineinstances.kubevirt.io \"nope\" not found"),
        "{err}"
    );
    let (code, _, err) = run_piped(&c, &["port-forward", "vm/pf", "0"], b"")?;
    assert_eq!(code, 1);
    assert!(err.contains("1-65535"), "{err}");
    let (code, _, err) = run_piped(&c, &["port-forward", "vm/pf", "53/udp"], b"")?;
    assert_eq!(code, 1);
    assert!(err.contains("udp"), "{err}");
    Ok(())
}
