//! A ferrovirt cluster for end-to-end tests: the real `ferrovirt server` binary (API server and
//! embedded node agent) in a temporary directory on a free loopback port, extra agents with
//! their own data dirs, and helpers to drive the machine's real `kubectl` against it. Dropping
//! the cluster kills every process (server, agents, launchers, QEMU) whose command line names
//! its directory. Unless a test chooses otherwise, imports may reach loopback (the tests'
//! file servers and registries listen there).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// How to start a [`Cluster`].
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Path of the `ferrovirt` binary (`env!("CARGO_BIN_EXE_ferrovirt")` in its tests).
    pub binary: PathBuf,
    /// Node name of the server's embedded agent; `None` runs the server without an agent.
    pub node_name: Option<String>,
    /// Extra `ferrovirt server` arguments.
    pub extra_args: Vec<String>,
    /// Join the cluster of the server with this data dir (both on one etcd): its `node-token`
    /// is passed with `--token-file`, and the new server loads the cluster's CA, keys and
    /// tokens from the datastore (docs/nodes.md "Highly available servers").
    pub seed_from: Option<PathBuf>,
}

impl ClusterOptions {
    pub fn new(binary: impl Into<PathBuf>) -> Self {
        ClusterOptions {
            binary: binary.into(),
            node_name: Some("node1".into()),
            extra_args: Vec::new(),
            seed_from: None,
        }
    }
}

/// A running test cluster.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub data_dir: PathBuf,
    pub kubeconfig: PathBuf,
    pub port: u16,
    pub(crate) binary: PathBuf,
    server_cmd: Vec<String>,
    server: Child,
    pub(crate) agents: Vec<(String, Child)>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("dir", &self.dir.path())
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

/// Tests that do not choose a network mode get `--network-mode user` (restricted QEMU user
/// networking): the binary's default, `auto`, picks the pod network when run as root, which
/// would put every test cluster's node bridge into the host's namespace. Network tests choose
/// `auto` or `pod` with their own node namespace (`--node-netns`).
pub(crate) fn default_network_mode<S: AsRef<str>>(args: &[S]) -> Vec<&'static str> {
    let chosen = args.iter().any(|a| {
        let a = a.as_ref();
        a == "--pod-network" || a.starts_with("--network-mode")
    });
    if chosen {
        Vec::new()
    } else {
        vec!["--network-mode", "user"]
    }
}

/// Tests that do not choose import address ranges get `--import-allowed-cidrs
/// 127.0.0.0/8,::1/128`: their file servers and registries listen on loopback, which the
/// import address policy refuses by default. The SSRF tests choose their own ranges.
fn default_import_ranges<S: AsRef<str>>(args: &[S]) -> Vec<&'static str> {
    let chosen = args
        .iter()
        .any(|a| a.as_ref().starts_with("--import-allowed-cidrs"));
    if chosen {
        Vec::new()
    } else {
        vec!["--import-allowed-cidrs", "127.0.0.0/8,::1/128"]
    }
}

pub(crate) fn spawn_logged(cmd: &mut Command, log: &Path) -> anyhow::Result<Child> {
    let f = std::fs::File::create(log)?;
    Ok(cmd
        .stdin(Stdio::null())
        .stdout(f.try_clone()?)
        .stderr(f)
        .spawn()?)
}

impl Cluster {
    /// Starts the server and waits until it answers with its kubeconfig.
    pub fn start(opts: &ClusterOptions) -> anyhow::Result<Cluster> {
        let dir = tempfile::Builder::new().prefix("fv-cluster-").tempdir()?;
        let data_dir = dir.path().join("data");
        let token_file = dir.path().join("join-token");
        if let Some(seed) = &opts.seed_from {
            std::fs::copy(seed.join("node-token"), &token_file)?;
        }
        let port = crate::free_port()?;
        let mut cmd = Command::new(&opts.binary);
        cmd.arg("server")
            .arg("--data-dir")
            .arg(&data_dir)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            // Hand-made PersistentVolumes (guest_disk_claim) live in the cluster's directory.
            .arg("--host-disk-root")
            .arg(dir.path());
        match &opts.node_name {
            Some(n) => {
                cmd.args(["--node-name", n]);
            }
            None => {
                cmd.arg("--disable-agent");
            }
        }
        if opts.seed_from.is_some() {
            cmd.arg("--token-file").arg(&token_file);
        }
        cmd.args(&opts.extra_args);
        cmd.args(default_network_mode(&opts.extra_args));
        cmd.args(default_import_ranges(&opts.extra_args));
        cmd.env("RUST_LOG", "info");
        let server_cmd: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let server = spawn_logged(&mut cmd, &dir.path().join("server.log"))
            .context("starting ferrovirt server")?;
        let mut c = Cluster {
            kubeconfig: data_dir.join("kubeconfig.yaml"),
            data_dir,
            port,
            binary: opts.binary.clone(),
            server_cmd,
            server,
            agents: Vec::new(),
            dir,
        };
        c.wait_ready()?;
        Ok(c)
    }

    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let c = self;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(s) = c.server.try_wait()? {
                bail!("ferrovirt server exited ({s}):\n{}", c.server_log());
            }
            if c.kubeconfig.exists() && c.kubectl(&["get", "--raw", "/readyz"])?.status.success() {
                break;
            }
            if Instant::now() > deadline {
                bail!("server not ready after 60 s:\n{}", c.server_log());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(())
    }

    /// Starts the server again (after [`kill_server`](Self::kill_server)) with the same
    /// arguments and data dir, and waits until it is ready.
    pub fn restart_server(&mut self) -> anyhow::Result<()> {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let mut cmd = Command::new(&self.binary);
        cmd.args(&self.server_cmd).env("RUST_LOG", "info");
        let log = self.dir.path().join("server.log");
        let f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&log)?;
        self.server = cmd
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .spawn()?;
        self.wait_ready()
    }

    /// What the server printed.
    pub fn server_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// A server with its embedded agent (node1) plus agents node2..node`n`, once all `n`
    /// Nodes are Ready.
    pub fn with_nodes(opts: &ClusterOptions, n: usize) -> anyhow::Result<Cluster> {
        let mut c = Cluster::start(opts)?;
        for i in 2..=n {
            c.start_agent(&format!("node{i}"))?;
        }
        c.wait_until(&format!("{n} Ready nodes"), Duration::from_secs(60), || {
            let v = c.get_json(&["nodes"])?;
            let ready = v["items"]
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
                .count();
            Ok((ready == n).then_some(()))
        })?;
        Ok(c)
    }

    /// Starts another node agent named `node` with its own data dir.
    pub fn start_agent(&mut self, node: &str) -> anyhow::Result<()> {
        self.start_agent_with(node, &[])
    }

    /// What the extra agent `node` printed.
    pub fn agent_log(&self, node: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("agent-{node}.log")))
            .unwrap_or_default()
    }

    /// Starts another node agent named `node` with its own data dir and `extra` arguments.
    pub fn start_agent_with(&mut self, node: &str, extra: &[&str]) -> anyhow::Result<()> {
        self.start_agent_in(node, &[], extra)
    }

    /// Like [`start_agent_with`](Self::start_agent_with), run through a command `prefix`
    /// (e.g. `ip netns exec NS`, which execs, so the agent keeps the child's pid).
    pub fn start_agent_in(
        &mut self,
        node: &str,
        prefix: &[String],
        extra: &[&str],
    ) -> anyhow::Result<()> {
        self.spawn_agent(node, prefix, extra, &[])
    }

    /// Starts another node agent named `node` with `env` added to its environment (a
    /// test-only failpoint, `FERROVIRT_FAILPOINT`).
    pub fn start_agent_env(&mut self, node: &str, env: &[(&str, &str)]) -> anyhow::Result<()> {
        self.spawn_agent(node, &[], &[], env)
    }

    /// The server's node join token (`DATA_DIR/node-token`).
    pub fn join_token(&self) -> anyhow::Result<String> {
        let p = self.data_dir.join("node-token");
        Ok(std::fs::read_to_string(&p)
            .with_context(|| format!("reading {}", p.display()))?
            .trim()
            .to_string())
    }

    /// Starts another node agent named `node` that joins with the join token in
    /// `token_file` (`ferrovirt agent --server URL --token-file F`) instead of the admin
    /// kubeconfig; it keeps its credential in its data dir
    /// ([`node_credential_kubeconfig`](Self::node_credential_kubeconfig)).
    pub fn start_joined_agent(&mut self, node: &str, token_file: &Path) -> anyhow::Result<()> {
        let server = format!("https://127.0.0.1:{}", self.port);
        let join = [
            "--server",
            &server,
            "--token-file",
            &token_file.to_string_lossy(),
        ]
        .map(String::from);
        self.spawn_agent_as(node, &[], &[], &[], Some(&join), None)
    }

    /// Like [`start_joined_agent`](Self::start_joined_agent) with `extra` arguments.
    pub fn start_joined_agent_with(
        &mut self,
        node: &str,
        token_file: &Path,
        extra: &[&str],
    ) -> anyhow::Result<()> {
        let server = format!("https://127.0.0.1:{}", self.port);
        let token_file = token_file.to_string_lossy().into_owned();
        let join = ["--server", &server, "--token-file", &token_file].map(String::from);
        self.spawn_agent_as(node, &[], extra, &[], Some(&join), None)
    }

    /// Like [`start_joined_agent`](Self::start_joined_agent) with `--server` given as
    /// `servers` (a comma list of several servers' URLs: the agent fails over between them).
    pub fn start_joined_agent_servers(
        &mut self,
        node: &str,
        token_file: &Path,
        servers: &str,
    ) -> anyhow::Result<()> {
        let token_file = token_file.to_string_lossy().into_owned();
        let join = ["--server", servers, "--token-file", &token_file].map(String::from);
        self.spawn_agent_as(node, &[], &[], &[], Some(&join), None)
    }

    /// Like [`start_joined_agent`](Self::start_joined_agent) with the data dir `data` (another
    /// machine claiming a name already joined); its log is `agent-<node>-<dir name>.log`.
    pub fn start_joined_agent_in(
        &mut self,
        node: &str,
        token_file: &Path,
        data: &Path,
    ) -> anyhow::Result<()> {
        let server = format!("https://127.0.0.1:{}", self.port);
        let token_file = token_file.to_string_lossy().into_owned();
        let join = ["--server", &server, "--token-file", &token_file].map(String::from);
        self.spawn_agent_as(node, &[], &[], &[], Some(&join), Some(data))
    }

    /// A kubeconfig file for the credential the joined agent `node` keeps (its client
    /// certificate `system:node:<node>`), to act as that node in a test.
    pub fn node_credential_kubeconfig(&self, node: &str) -> anyhow::Result<PathBuf> {
        let cred = self.extra_agent_dir(node).join("node-credential");
        for f in ["server-ca.crt", "node.crt", "node.key"] {
            anyhow::ensure!(cred.join(f).exists(), "{} has no {f}", cred.display());
        }
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:{}\n    certificate-authority: {}\nusers:\n- name: node\n  user:\n    client-certificate: {}\n    client-key: {}\ncontexts:\n- name: c\n  context: {{cluster: c, user: node, namespace: default}}\ncurrent-context: c\n",
            self.port,
            cred.join("server-ca.crt").display(),
            cred.join("node.crt").display(),
            cred.join("node.key").display(),
        );
        let path = self.dir.path().join(format!("kubeconfig-{node}.yaml"));
        std::fs::write(&path, text)?;
        Ok(path)
    }

    /// Waits up to `timeout` for the extra agent `node` to exit; its exit status (None: still
    /// running).
    pub fn wait_agent_exit(
        &mut self,
        node: &str,
        timeout: Duration,
    ) -> anyhow::Result<Option<std::process::ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((_, child)) = self.agents.iter_mut().rev().find(|(n, _)| n == node)
                && let Some(s) = child.try_wait()?
            {
                return Ok(Some(s));
            }
            if Instant::now() > deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn spawn_agent(
        &mut self,
        node: &str,
        prefix: &[String],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<()> {
        self.spawn_agent_as(node, prefix, extra, env, None, None)
    }

    /// Starts agent `node`: with the admin kubeconfig, or with `join` arguments.
    fn spawn_agent_as(
        &mut self,
        node: &str,
        prefix: &[String],
        extra: &[&str],
        env: &[(&str, &str)],
        join: Option<&[String]>,
        data: Option<&Path>,
    ) -> anyhow::Result<()> {
        let (data, log) = match data {
            Some(d) => (
                d.to_path_buf(),
                format!(
                    "agent-{node}-{}.log",
                    d.file_name().unwrap_or_default().to_string_lossy()
                ),
            ),
            None => (
                self.dir.path().join(format!("agent-{node}")),
                format!("agent-{node}.log"),
            ),
        };
        let mut cmd = match prefix.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(&self.binary);
                c
            }
            None => Command::new(&self.binary),
        };
        cmd.arg("agent");
        match join {
            Some(args) => {
                cmd.args(args).env_remove("KUBECONFIG");
            }
            None => {
                cmd.arg("--kubeconfig").arg(&self.kubeconfig);
            }
        }
        cmd.args(["--node-name", node])
            .arg("--data-dir")
            .arg(&data)
            .arg("--host-disk-root")
            .arg(self.dir.path())
            .args(extra)
            .args(default_network_mode(extra))
            .envs(env.iter().copied())
            .env("RUST_LOG", "info");
        let child = spawn_logged(&mut cmd, &self.dir.path().join(log))?;
        self.agents.push((node.to_string(), child));
        Ok(())
    }

    /// The process id of the extra agent `node` (to stop, continue or kill the agent alone;
    /// its launchers and QEMUs are processes of their own).
    pub fn agent_pid(&self, node: &str) -> Option<u32> {
        self.agents
            .iter()
            .rev()
            .find(|(n, _)| n == node)
            .map(|(_, c)| c.id())
    }

    /// The data dir of the extra agent `node` (VMI directories under `vmis/<uid>`).
    pub fn extra_agent_dir(&self, node: &str) -> PathBuf {
        self.dir.path().join(format!("agent-{node}"))
    }

    /// kill -9 of the extra agent `node` and of every launcher and QEMU it started (a node
    /// dying). Returns the pids killed.
    pub fn kill_agent(&mut self, node: &str) -> anyhow::Result<Vec<u32>> {
        let mut killed = Vec::new();
        for (name, child) in &mut self.agents {
            if name == node {
                killed.push(child.id());
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        let needle = self.extra_agent_dir(node).display().to_string();
        for pid in pids_matching(&needle) {
            signal(pid, "KILL");
            killed.push(pid);
        }
        Ok(killed)
    }

    /// The embedded agent's data dir (VMI directories under `vmis/<uid>`).
    pub fn agent_dir(&self) -> PathBuf {
        self.data_dir.join("agent")
    }

    /// Runs kubectl against the cluster (fresh cache dir inside the cluster's directory).
    pub fn kubectl(&self, args: &[&str]) -> anyhow::Result<Output> {
        let out = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(self.dir.path().join("kubectl-cache"))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .context("running kubectl (is it installed?)")?;
        Ok(out)
    }

    /// Runs kubectl and returns stdout; fails with stderr when it exits non-zero.
    pub fn kubectl_ok(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = self.kubectl(args)?;
        if !out.status.success() {
            bail!(
                "kubectl {} failed: {}{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&out.stdout)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// A merge patch of the HyperConverged object (`kubevirt-hyperconverged` in its
    /// namespace); fails when kubectl does.
    pub fn patch_hco(&self, patch: &str) -> anyhow::Result<String> {
        self.kubectl_ok(&Self::hco_patch_args(patch))
    }

    /// The same patch, expected to be refused: kubectl's stderr (an error if it passed).
    pub fn hco_patch_refused(&self, patch: &str) -> anyhow::Result<String> {
        let out = self.kubectl(&Self::hco_patch_args(patch))?;
        if out.status.success() {
            bail!("the HyperConverged patch {patch} was not refused");
        }
        Ok(String::from_utf8_lossy(&out.stderr).into_owned())
    }

    fn hco_patch_args(patch: &str) -> [&str; 9] {
        [
            "patch",
            "hyperconverged",
            "kubevirt-hyperconverged",
            "-n",
            "kubevirt-hyperconverged",
            "--type",
            "merge",
            "-p",
            patch,
        ]
    }

    /// `kubectl apply -f -` with `yaml` on stdin.
    pub fn apply(&self, yaml: &str) -> anyhow::Result<String> {
        use std::io::Write;
        let mut child = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(self.dir.path().join("kubectl-cache"))
            .args(["apply", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        child
            .stdin
            .take()
            .context("stdin")?
            .write_all(yaml.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "kubectl apply failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The object as JSON (`kubectl get -o json`).
    pub fn get_json(&self, args: &[&str]) -> anyhow::Result<serde_json::Value> {
        let mut a = vec!["get"];
        a.extend_from_slice(args);
        a.extend_from_slice(&["-o", "json"]);
        Ok(serde_json::from_str(&self.kubectl_ok(&a)?)?)
    }

    /// Polls `check` every 250 ms until it returns `Some`, or fails after `timeout` with `what`.
    pub fn wait_until<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut() -> anyhow::Result<Option<T>>,
    ) -> anyhow::Result<T> {
        let deadline = Instant::now() + timeout;
        let mut last = String::new();
        loop {
            match check() {
                Ok(Some(v)) => return Ok(v),
                Ok(None) => {}
                Err(e) => last = format!("{e:#}"),
            }
            if Instant::now() > deadline {
                bail!(
                    "timed out after {timeout:?} waiting for {what} (last error: {last})\n--- server log tail ---\n{}",
                    tail(&self.server_log(), 40)
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Waits until `kind/name` (namespace `default`) reports `status.<field>` true (e.g. a
    /// snapshot's `readyToUse`, a restore's `complete`) and returns it; a `Failed` phase or a
    /// `Failure` condition ends the wait at once with the object.
    pub fn wait_done(
        &self,
        kind: &str,
        name: &str,
        field: &str,
        timeout: Duration,
    ) -> anyhow::Result<serde_json::Value> {
        let v = self.wait_until(&format!("{kind} {name} {field}"), timeout, || {
            let v = self.get_json(&[kind, name, "-n", "default"])?;
            let failed = v["status"]["phase"] == "Failed"
                || v["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Failure" && c["status"] == "True");
            Ok((failed || v["status"][field] == true).then_some((failed, v)))
        })?;
        match v {
            (true, v) => bail!("{kind} {name} failed: {v}"),
            (false, v) => Ok(v),
        }
    }

    /// Waits until VMI `name` (namespace `default`) runs on the embedded agent and its guest
    /// printed the boot marker on its serial console; returns the VMI's uid. A Failed VMI ends
    /// the wait with its status.
    pub fn wait_booted(&self, name: &str, timeout: Duration) -> anyhow::Result<String> {
        let uid = self.wait_until(&format!("VMI {name} Running"), timeout, || {
            let out = self.kubectl(&["get", "vmi", name, "-n", "default", "-o", "json"])?;
            if !out.status.success() {
                return Ok(None);
            }
            let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
            if v["status"]["phase"] == "Failed" {
                bail!("VMI {name} failed: {}", v["status"]);
            }
            Ok((v["status"]["phase"] == "Running").then(|| {
                v["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            }))
        })?;
        let log = self.agent_dir().join("vmis").join(&uid).join("serial.log");
        self.wait_until(
            &format!("FERROVIRT-BOOT in {}", log.display()),
            timeout,
            || {
                let text = std::fs::read(&log).unwrap_or_default();
                Ok(String::from_utf8_lossy(&text)
                    .contains("FERROVIRT-BOOT")
                    .then_some(()))
            },
        )?;
        Ok(uid)
    }

    /// Sets the `spec.runStrategy` of VirtualMachine `vm` in `default`.
    pub fn set_run_strategy(&self, vm: &str, strategy: &str) -> anyhow::Result<()> {
        let patch = format!(r#"{{"spec":{{"runStrategy":"{strategy}"}}}}"#);
        self.kubectl_ok(&[
            "patch", "vm", vm, "-n", "default", "--type", "merge", "-p", &patch,
        ])?;
        Ok(())
    }

    /// Halts VirtualMachine `vm` in `default` and waits until its VMI is gone.
    pub fn halt_vm(&self, vm: &str, timeout: Duration) -> anyhow::Result<()> {
        self.set_run_strategy(vm, "Halted")?;
        self.wait_gone("vmi", vm, timeout)
    }

    /// `GET /` on `port` of VMI `ns/name` through `ferrovirt port-forward --stdio` (the API's
    /// portforward subresource); the answer as text.
    pub fn port_forward_get(&self, ns: &str, name: &str, port: u16) -> anyhow::Result<String> {
        use std::io::Write;
        let mut child = std::process::Command::new(&self.binary)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args([
                "port-forward",
                "--stdio",
                &format!("vmi/{name}.{ns}"),
                &port.to_string(),
            ])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        if let Some(mut i) = child.stdin.take() {
            i.write_all(b"GET / HTTP/1.0\r\n\r\n")?;
        }
        let out = child.wait_with_output()?;
        anyhow::ensure!(
            out.status.success(),
            "port-forward to {ns}/{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Waits until `kubectl get KIND NAME -n default` finds nothing.
    pub fn wait_gone(&self, kind: &str, name: &str, timeout: Duration) -> anyhow::Result<()> {
        self.wait_gone_in("default", kind, name, timeout)
    }

    /// Waits until `kubectl get KIND NAME -n NS` finds nothing.
    pub fn wait_gone_in(
        &self,
        ns: &str,
        kind: &str,
        name: &str,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        self.wait_until(&format!("{kind} {ns}/{name} gone"), timeout, || {
            let out = self.kubectl(&["get", kind, name, "-n", ns])?;
            Ok((!out.status.success()).then_some(()))
        })
    }

    /// A PersistentVolume `pv-<claim>` (hostPath directory holding a copy of the test guest's
    /// raw disk as `disk.img`) and a PersistentVolumeClaim `<claim>` in `default` bound to it.
    /// Returns the volume directory.
    pub fn guest_disk_claim(&self, claim: &str) -> anyhow::Result<PathBuf> {
        let g = crate::TestGuest::get()?;
        let dir = self.dir.path().join("pvs").join(claim);
        std::fs::create_dir_all(&dir)?;
        std::fs::copy(&g.disk_raw, dir.join("disk.img"))?;
        self.apply(&format!(
            r#"
apiVersion: v1
kind: PersistentVolume
metadata: {{name: pv-{claim}}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  hostPath: {{path: {dir}}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {claim}, namespace: default}}
spec:
  accessModes: [ReadWriteOnce]
  resources: {{requests: {{storage: 1Gi}}}}
  volumeName: pv-{claim}
"#,
            dir = dir.display()
        ))?;
        Ok(dir)
    }

    /// Like [`guest_disk_claim`](Self::guest_disk_claim), with the PV and the claim
    /// ReadWriteMany (shared storage: the VM on it is live-migratable).
    pub fn shared_guest_disk_claim(&self, claim: &str) -> anyhow::Result<PathBuf> {
        let dir = self.guest_disk_claim(claim)?;
        let rwx = r#"{"spec":{"accessModes":["ReadWriteMany"]}}"#;
        let pv = format!("pv-{claim}");
        self.kubectl_ok(&["patch", "pv", &pv, "--type=merge", "-p", rwx])?;
        self.kubectl_ok(&["patch", "pvc", claim, "--type=merge", "-p", rwx])
            .ok();
        Ok(dir)
    }

    /// The cluster's own temporary directory (for files a test hands to kubectl).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The agent data dir of `node` (node1: the embedded agent's).
    pub fn node_dir(&self, node: &str) -> PathBuf {
        if node == "node1" {
            self.agent_dir()
        } else {
            self.extra_agent_dir(node)
        }
    }

    /// The uptime (seconds) of the guest of the VMI with `uid` on `node`, read on its serial
    /// console.
    pub fn guest_uptime(&self, node: &str, uid: &str) -> anyhow::Result<f64> {
        let sock = self
            .node_dir(node)
            .join("vmis")
            .join(uid)
            .join("serial.sock");
        let console = crate::console::SerialConsole::connect(&sock, Duration::from_secs(10))?;
        let (out, rc) = console.exec("cat /proc/uptime", Duration::from_secs(20))?;
        anyhow::ensure!(rc == 0, "cat /proc/uptime: {out}");
        out.lines()
            .filter_map(|l| l.split_whitespace().next()?.parse::<f64>().ok())
            .next_back()
            .ok_or_else(|| anyhow::anyhow!("no uptime in {out:?}"))
    }

    /// The server process's id.
    pub fn server_pid(&self) -> u32 {
        self.server.id()
    }

    /// Kills the server process with SIGKILL (agents and launchers keep running).
    pub fn kill_server(&mut self) -> anyhow::Result<()> {
        self.server.kill()?;
        self.server.wait()?;
        Ok(())
    }
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Pids of processes whose command line contains `needle`.
pub fn pids_matching(needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    let me = std::process::id();
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline"))
            && String::from_utf8_lossy(&cmd).contains(needle)
        {
            out.push(pid);
        }
    }
    out
}

/// Sends `signal` (e.g. "KILL") to `pid` with kill(1).
pub fn signal(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status();
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        for (_, a) in &mut self.agents {
            let _ = a.kill();
            let _ = a.wait();
        }
        // Launchers and QEMU processes are detached: find them by their directory.
        let needle = self.dir.path().display().to_string();
        for _ in 0..3 {
            let pids = pids_matching(&needle);
            if pids.is_empty() {
                break;
            }
            for p in pids {
                signal(p, "KILL");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}
