//! The `ferrovirt` command line (kubectl's and virtctl's verbs) against a real server: apply
//! create-then-update of a multi-document file, `get` output (table, -o name, jsonpath, -A, -l,
//! -w), `describe`, `create -f`, `edit`, `expand`, `create vm`, `wait`, `delete --wait`,
//! `api-resources`, kubectl's error messages and exit codes, `completion`; and with one booted
//! test guest, `vnc screenshot` (a valid PNG; also with a merged `$KUBECONFIG` list and a token
//! file, with an exec credential plugin, and refused with a wrong token) and `vnc --proxy-only`.

use std::io::{BufRead, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_ferrovirt");
const STEP: Duration = Duration::from_secs(60);
const BOOT: Duration = Duration::from_secs(240);

/// What one `ferrovirt` run left.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

/// Runs `ferrovirt ARGS` against the cluster with `stdin`, extra environment, and a time limit.
fn fv_with(
    c: &Cluster,
    args: &[&str],
    stdin: &str,
    env: &[(&str, &str)],
    limit: Duration,
) -> anyhow::Result<Run> {
    let mut child = Command::new(BIN)
        .arg("--kubeconfig")
        .arg(&c.kubeconfig)
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting ferrovirt")?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(stdin.as_bytes())?;
    let mut out = child.stdout.take().context("stdout")?;
    let mut err = child.stderr.take().context("stderr")?;
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("ferrovirt {} ran over {limit:?}", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok(Run {
        code: status.code().unwrap_or(-1),
        stdout: t_out.join().unwrap_or_default(),
        stderr: t_err.join().unwrap_or_default(),
    })
}

fn fv(c: &Cluster, args: &[&str]) -> anyhow::Result<Run> {
    fv_with(c, args, "", &[], STEP)
}

/// stdout of a run that must succeed.
fn fv_ok(c: &Cluster, args: &[&str]) -> anyhow::Result<String> {
    let r = fv(c, args)?;
    if r.code != 0 {
        bail!(
            "ferrovirt {} exited {}: {}{}",
            args.join(" "),
            r.code,
            r.stderr,
            r.stdout
        );
    }
    Ok(r.stdout)
}

fn apply_text(c: &Cluster, yaml: &str) -> anyhow::Result<Run> {
    fv_with(c, &["apply", "-f", "-"], yaml, &[], STEP)
}

/// A table with each AGE cell replaced by `<age>` and runs of spaces collapsed; also checks that
/// every row's cells start where the header's do (kubectl's alignment).
fn mask_table(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let header = lines.first().copied().unwrap_or_default();
    let starts: Vec<usize> = header
        .char_indices()
        .filter(|(i, ch)| *ch != ' ' && (*i == 0 || header.as_bytes()[i - 1] == b' '))
        .map(|(i, _)| i)
        .collect();
    let cols: Vec<&str> = header.split_whitespace().collect();
    let age = cols.iter().position(|c| *c == "AGE");
    let mut out = Vec::new();
    for (n, l) in lines.iter().enumerate() {
        let mut cells: Vec<String> = l.split_whitespace().map(String::from).collect();
        if n > 0 {
            // Cells start at the header's positions while there is no empty cell.
            for (i, s) in starts.iter().enumerate() {
                if i > 0 && cells.len() == starts.len() {
                    assert!(
                        l.as_bytes()[s - 1] == b' ' && l.as_bytes()[*s] != b' ',
                        "column {i} misaligned in:\n{text}"
                    );
                }
            }
            if let Some(a) = age
                && a < cells.len()
            {
                cells[a] = "<age>".into();
            }
        }
        out.push(cells.join(" "));
    }
    out.join("\n") + "\n"
}

fn cluster(with_agent: bool) -> anyhow::Result<Cluster> {
    let mut o = ClusterOptions::new(BIN);
    if !with_agent {
        o.node_name = None;
    }
    Cluster::start(&o)
}

const MANIFESTS: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: other}
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: cm1
  labels: {app: demo}
data: {greeting: hello}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: vm1
  labels: {app: demo, tier: web}
spec:
  runStrategy: Halted
  template:
    spec:
      domain:
        memory: {guest: 128Mi}
        devices: {}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: vm2, namespace: other}
spec:
  runStrategy: Halted
  template:
    spec:
      domain:
        memory: {guest: 128Mi}
        devices: {}
"#;

#[test]
fn apply_get_describe_and_errors() -> anyhow::Result<()> {
    let c = cluster(false)?;
    // api-resources: short names from discovery.
    let res = fv_ok(&c, &["api-resources"])?;
    let line = |plural: &str| {
        res.lines()
            .find(|l| l.starts_with(&format!("{plural} ")))
            .unwrap_or_default()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(
        line("virtualmachines"),
        "virtualmachines vm,vms kubevirt.io/v1 true VirtualMachine"
    );
    assert_eq!(
        line("virtualmachineinstances"),
        "virtualmachineinstances vmi,vmis kubevirt.io/v1 true VirtualMachineInstance"
    );
    assert!(res.starts_with("NAME"), "{res}");

    // apply: create, then unchanged, then an update that also drops a label.
    let dir = c.dir.path().join("manifests");
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("all.yaml");
    std::fs::write(&file, MANIFESTS)?;
    let f = file.to_str().context("path")?;
    assert_eq!(
        fv_ok(&c, &["apply", "-f", f])?,
        "namespace/other created\nconfigmap/cm1 created\nvirtualmachine.kubevirt.io/vm1 created\nvirtualmachine.kubevirt.io/vm2 created\n"
    );
    assert_eq!(
        fv_ok(&c, &["apply", "-f", f])?,
        "namespace/other unchanged\nconfigmap/cm1 unchanged\nvirtualmachine.kubevirt.io/vm1 unchanged\nvirtualmachine.kubevirt.io/vm2 unchanged\n"
    );
    std::fs::write(
        &file,
        MANIFESTS
            .replace("greeting: hello", "greeting: bye")
            .replace("labels: {app: demo, tier: web}", "labels: {app: demo}"),
    )?;
    assert_eq!(
        fv_ok(&c, &["apply", "-f", dir.to_str().context("dir")?])?,
        "namespace/other unchanged\nconfigmap/cm1 configured\nvirtualmachine.kubevirt.io/vm1 configured\nvirtualmachine.kubevirt.io/vm2 unchanged\n"
    );
    assert_eq!(
        fv_ok(&c, &["get", "cm", "cm1", "-o", "jsonpath={.data.greeting}"])?,
        "bye"
    );
    assert_eq!(
        fv_ok(&c, &["get", "vm/vm1", "-o", "jsonpath={.metadata.labels}"])?,
        r#"{"app":"demo"}"#
    );

    // get: the server's columns, ages humanized, aligned like kubectl.
    c.wait_until("vm1 Stopped", STEP, || {
        Ok(fv_ok(&c, &["get", "vm"])?.contains("Stopped").then_some(()))
    })?;
    assert_eq!(
        mask_table(&fv_ok(&c, &["get", "vm"])?),
        "NAME AGE STATUS READY\nvm1 <age> Stopped False\n"
    );
    let all = fv_ok(&c, &["get", "virtualmachines.kubevirt.io", "-A"])?;
    assert_eq!(
        mask_table(&all),
        "NAMESPACE NAME AGE STATUS READY\ndefault vm1 <age> Stopped False\nother vm2 <age> Stopped False\n"
    );
    assert_eq!(
        mask_table(&fv_ok(&c, &["get", "vms", "-A", "-l", "app=demo"])?),
        "NAMESPACE NAME AGE STATUS READY\ndefault vm1 <age> Stopped False\n"
    );
    let none = fv(&c, &["get", "vm", "-l", "app=nope"])?;
    assert_eq!((none.code, none.stdout.as_str()), (0, ""));
    assert_eq!(none.stderr, "No resources found in default namespace.\n");
    assert_eq!(
        fv_ok(&c, &["get", "virtualmachine", "-o", "name"])?,
        "virtualmachine.kubevirt.io/vm1\n"
    );
    assert_eq!(
        fv_ok(
            &c,
            &[
                "get",
                "vm",
                "-A",
                "-o",
                r#"jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name}{"\n"}{end}"#
            ]
        )?,
        "default/vm1\nother/vm2\n"
    );
    assert_eq!(
        fv_ok(&c, &["get", "vm", "-n", "other", "-o", "name"])?,
        "virtualmachine.kubevirt.io/vm2\n"
    );
    let y: Value = parse_yaml(&fv_ok(&c, &["get", "vm", "vm1", "-o", "yaml"])?)?;
    assert_eq!(y["spec"]["runStrategy"], "Halted");
    let j: Value = serde_json::from_str(&fv_ok(&c, &["get", "vm", "-o", "json"])?)?;
    assert_eq!(j["kind"], "List");
    assert_eq!(j["items"][0]["metadata"]["name"], "vm1");

    // describe: kubectl's layout (ages, uids and timestamps left out of the comparison).
    let d = fv_ok(&c, &["describe", "vm", "vm1"])?;
    assert!(
        d.starts_with(
            "Name:         vm1\nNamespace:    default\nLabels:       app=demo\nAnnotations:  <none>\nAPI Version:  kubevirt.io/v1\nKind:         VirtualMachine\nMetadata:\n  Creation Timestamp:  "
        ),
        "{d}"
    );
    assert!(
        d.contains("\nSpec:\n  Run Strategy:  Halted\n  Template:\n"),
        "{d}"
    );
    // The VM controller's finalizer (a list) splits the metadata into two aligned groups.
    assert!(
        d.contains("\n  Finalizers:\n    kubevirt.io/virtualMachineControllerFinalize\n"),
        "{d}"
    );
    assert!(d.contains("\n  Generation:        "), "{d}");
    assert!(d.contains("\n  UID:               "), "{d}");
    assert!(d.contains("\nStatus:\n"), "{d}");
    assert!(d.contains("\n  Printable Status:  Stopped\n"), "{d}");
    assert!(d.ends_with("\nEvents:  <none>\n"), "{d}");

    // kubectl's errors and exit codes.
    let missing = fv(&c, &["get", "vm", "missing"])?;
    assert_eq!(missing.code, 1);
    assert_eq!(
        missing.stderr,
        "Error from server (NotFound): virtualmachines.kubevirt.io \"missing\" not found\n"
    );
    let unknown = fv(&c, &["get", "gizmos"])?;
    assert_eq!(unknown.code, 1);
    assert_eq!(
        unknown.stderr,
        "error: the server doesn't have a resource type \"gizmos\"\n"
    );
    let bad = apply_text(
        &c,
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata: {name: bad}\nspec:\n  runStrategy: Always\n  running: true\n  template:\n    spec:\n      domain:\n        devices:\n          disks: [{name: x, disk: {bus: virtio}}]\n",
    )?;
    assert_eq!(bad.code, 1, "{bad:?}");
    assert!(
        bad.stderr
            .starts_with("The VirtualMachine \"bad\" is invalid: \n* spec.running: "),
        "{}",
        bad.stderr
    );
    assert!(
        bad.stderr
            .contains("\n* spec.template.spec.domain.devices.disks[0].name: "),
        "{}",
        bad.stderr
    );

    // create -f, then again: AlreadyExists.
    let cm2 = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: cm2}\ndata: {a: b}\n";
    let made = fv_with(&c, &["create", "-f", "-"], cm2, &[], STEP)?;
    assert_eq!(
        (made.code, made.stdout.as_str()),
        (0, "configmap/cm2 created\n")
    );
    let again = fv_with(&c, &["create", "-f", "-"], cm2, &[], STEP)?;
    assert_eq!(again.code, 1);
    assert_eq!(
        again.stderr,
        "Error from server (AlreadyExists): configmaps \"cm2\" already exists\n"
    );

    // edit through $EDITOR.
    let edited = fv_with(
        &c,
        &["edit", "vm", "vm1"],
        "",
        &[("EDITOR", "sed -i s/Halted/Manual/")],
        STEP,
    )?;
    assert_eq!(
        edited.stdout, "virtualmachine.kubevirt.io/vm1 edited\n",
        "{edited:?}"
    );
    assert_eq!(
        fv_ok(
            &c,
            &["get", "vm", "vm1", "-o", "jsonpath={.spec.runStrategy}"]
        )?,
        "Manual"
    );
    let cancelled = fv_with(&c, &["edit", "vm/vm1"], "", &[("EDITOR", "true")], STEP)?;
    assert_eq!(cancelled.stdout, "Edit cancelled, no changes made.\n");

    // wait: for a condition, for a timeout, for deletion.
    assert_eq!(
        fv_ok(
            &c,
            &[
                "wait",
                "--for=condition=Ready=False",
                "vm/vm2",
                "-n",
                "other",
                "--timeout=30s"
            ]
        )?,
        "virtualmachine.kubevirt.io/vm2 condition met\n"
    );
    assert_eq!(
        fv_ok(
            &c,
            &[
                "wait",
                "--for=jsonpath={.metadata.namespace}=other",
                "vm/vm2",
                "-n",
                "other",
                "--timeout=30s"
            ]
        )?,
        "virtualmachine.kubevirt.io/vm2 condition met\n"
    );
    let before = cli_vm_requests(&c)?;
    let late = fv(
        &c,
        &[
            "wait",
            "--for=condition=Ready",
            "vm",
            "vm2",
            "-n",
            "other",
            "--timeout=1s",
        ],
    )?;
    // The wait watched the VM (kube-runtime's await_condition) instead of polling it.
    let after = cli_vm_requests(&c)?;
    let delta = |verb: &str| after.get(verb).unwrap_or(&0) - before.get(verb).unwrap_or(&0);
    assert_eq!(delta("GET"), 0, "wait polled: {before:?} → {after:?}");
    assert!(
        delta("WATCH") >= 1,
        "wait did not watch: {before:?} → {after:?}"
    );
    assert_eq!(late.code, 1);
    assert!(
        late.stderr
            .ends_with("error: timed out waiting for the condition on virtualmachines/vm2\n"),
        "{}",
        late.stderr
    );
    assert!(
        late.stderr
            .starts_with("waiting for virtualmachine.kubevirt.io/vm2: Ready=False\n"),
        "{}",
        late.stderr
    );

    // delete --wait: gone when it returns.
    assert_eq!(
        fv_ok(&c, &["delete", "cm", "cm1", "cm2", "--timeout=60s"])?,
        "configmap \"cm1\" deleted\nconfigmap \"cm2\" deleted\n"
    );
    let gone = fv(&c, &["get", "cm"])?;
    assert_eq!(gone.stderr, "No resources found in default namespace.\n");
    assert_eq!(
        fv_ok(&c, &["delete", "vm/vm1"])?,
        "virtualmachine.kubevirt.io \"vm1\" deleted\n"
    );
    assert_eq!(fv(&c, &["get", "vm", "vm1"])?.code, 1);
    assert_eq!(
        fv_ok(&c, &["wait", "--for=delete", "vm/vm1", "--timeout=5s"])?,
        "virtualmachine.kubevirt.io/vm1 condition met\n"
    );
    Ok(())
}

/// Requests on virtualmachines by verb from clients other than kubectl and ferrovirt's own
/// components (i.e. the `ferrovirt` CLI), from the server's `/metrics`.
fn cli_vm_requests(c: &Cluster) -> anyhow::Result<std::collections::BTreeMap<String, u64>> {
    let text = c.kubectl_ok(&["get", "--raw", "/metrics"])?;
    let mut out = std::collections::BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{verb=\"") else {
            continue;
        };
        let Some((verb, rest)) = rest.split_once('"') else {
            continue;
        };
        if !rest.contains("resource=\"virtualmachines.kubevirt.io\"")
            || rest.contains("user_agent=\"kubectl")
            || rest.contains("user_agent=\"ferrovirt-")
        {
            continue;
        }
        let n: u64 = line.rsplit(' ').next().unwrap_or("0").parse().unwrap_or(0);
        *out.entry(verb.to_string()).or_default() += n;
    }
    Ok(out)
}

/// Runs `ferrovirt ARGS` with `KUBECONFIG` (no `--kubeconfig`).
fn fv_kubeconfig(kubeconfig: &str, args: &[&str]) -> anyhow::Result<std::process::Output> {
    Ok(Command::new(BIN)
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()?)
}

/// `vnc screenshot` (a websocket through the API server) with credentials in forms other than
/// an inline token.
fn credential_forms_reach_the_console_stream(c: &Cluster, vm: &str) -> anyhow::Result<()> {
    let kc = parse_yaml(&std::fs::read_to_string(&c.kubeconfig)?)?;
    let server = kc["clusters"][0]["cluster"]["server"]
        .as_str()
        .context("server")?;
    let ca = kc["clusters"][0]["cluster"]["certificate-authority-data"]
        .as_str()
        .context("ca")?;
    let token = kc["users"][0]["user"]["token"].as_str().context("token")?;
    let dir = c.dir.path();
    // File 1: cluster and context only; file 2: the user, whose token is in a file.
    let clusters = dir.join("kc-clusters.yaml");
    std::fs::write(
        &clusters,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fv\n  cluster:\n    server: {server}\n    \
             certificate-authority-data: {ca}\ncontexts:\n- name: fv\n  context: {{cluster: fv, user: \
             split, namespace: default}}\ncurrent-context: fv\n"
        ),
    )?;
    let token_file = dir.join("token-file");
    std::fs::write(&token_file, token)?;
    let users = dir.join("kc-users.yaml");
    std::fs::write(
        &users,
        format!(
            "apiVersion: v1\nkind: Config\nusers:\n- name: split\n  user:\n    tokenFile: {}\n",
            token_file.display()
        ),
    )?;
    // An exec plugin printing an ExecCredential.
    let plugin = dir.join("cred-plugin.sh");
    std::fs::write(
        &plugin,
        format!(
            "#!/bin/sh\necho '{{\"apiVersion\":\"client.authentication.k8s.io/v1\",\
             \"kind\":\"ExecCredential\",\"status\":{{\"token\":\"{token}\"}}}}'\n"
        ),
    )?;
    std::fs::set_permissions(&plugin, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    let exec = dir.join("kc-exec.yaml");
    std::fs::write(
        &exec,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fv\n  cluster:\n    server: {server}\n    \
             certificate-authority-data: {ca}\ncontexts:\n- name: fv\n  context: {{cluster: fv, user: \
             plugin}}\ncurrent-context: fv\nusers:\n- name: plugin\n  user:\n    exec:\n      \
             apiVersion: client.authentication.k8s.io/v1\n      command: {}\n      \
             interactiveMode: Never\n",
            plugin.display()
        ),
    )?;
    let wrong = dir.join("kc-wrong.yaml");
    std::fs::write(
        &wrong,
        std::fs::read_to_string(&c.kubeconfig)?.replace(token, "not-the-token"),
    )?;
    let merged = format!("{}:{}", clusters.display(), users.display());
    for (what, kubeconfig) in [
        ("merged list with a token file", merged.as_str()),
        ("exec plugin", exec.to_str().context("path")?),
    ] {
        let png = dir.join("cred.png");
        let _ = std::fs::remove_file(&png);
        let out = fv_kubeconfig(
            kubeconfig,
            &["vnc", "screenshot", vm, "-f", png.to_str().context("path")?],
        )?;
        assert!(
            out.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (w, h) = png_size(&std::fs::read(&png)?)?;
        assert!(w > 0 && h > 0, "{what}: {w}x{h}");
    }
    let out = fv_kubeconfig(
        wrong.to_str().context("path")?,
        &["vnc", "screenshot", vm, "-f", "/dev/null"],
    )?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.to_lowercase().contains("unauthorized"),
        "{err}"
    );
    Ok(())
}

fn parse_yaml(text: &str) -> anyhow::Result<Value> {
    let docs = ferrovirt_cli::printer::parse_documents(text)?;
    docs.into_iter().next().context("no YAML document")
}

#[test]
fn create_vm_expand_completion_and_watch() -> anyhow::Result<()> {
    // Offline verbs first: no server needed.
    let c = cluster(false)?;
    let made = fv_ok(
        &c,
        &[
            "create",
            "vm",
            "--name",
            "made",
            "--instancetype",
            "small",
            "--preference",
            "virtualmachinepreference/pref",
            "--volume-containerdisk",
            "src:quay.io/x/y:1",
            "--volume-datasource",
            "src:images/fedora,size:2Gi",
            "--cloud-init-user-data",
            "I2Nsb3VkLWNvbmZpZw==",
            "--run-strategy",
            "Manual",
        ],
    )?;
    let vm = parse_yaml(&made)?;
    assert_eq!(vm["kind"], "VirtualMachine");
    assert_eq!(vm["metadata"]["name"], "made");
    assert_eq!(vm["spec"]["runStrategy"], "Manual");
    assert_eq!(vm["spec"]["instancetype"]["name"], "small");
    assert_eq!(vm["spec"]["preference"]["kind"], "VirtualMachinePreference");
    let vols = vm["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .context("volumes")?;
    assert_eq!(vols.len(), 3, "{made}");
    assert_eq!(
        vm["spec"]["dataVolumeTemplates"][0]["spec"]["sourceRef"]["name"],
        "fedora"
    );
    let bash = fv_ok(&c, &["completion", "bash"])?;
    assert!(bash.len() > 1000 && bash.contains("ferrovirt"), "{bash}");

    // A generated manifest the server accepts; expand inlines its instancetype.
    let plain = fv_ok(
        &c,
        &[
            "create",
            "vm",
            "--name",
            "gen",
            "--instancetype",
            "small",
            "--run-strategy",
            "Halted",
        ],
    )?;
    let it = "apiVersion: instancetype.kubevirt.io/v1beta1\nkind: VirtualMachineClusterInstancetype\nmetadata: {name: small}\nspec:\n  cpu: {guest: 2}\n  memory: {guest: 256Mi}\n---\n";
    let r = apply_text(&c, &format!("{it}{plain}"))?;
    assert_eq!(
        r.stdout,
        "virtualmachineclusterinstancetype.instancetype.kubevirt.io/small created\nvirtualmachine.kubevirt.io/gen created\n",
        "{r:?}"
    );
    let ex = parse_yaml(&fv_ok(&c, &["expand", "--vm", "gen"])?)?;
    assert!(ex["spec"].get("instancetype").is_none(), "{ex}");
    assert_eq!(
        ex["spec"]["template"]["spec"]["domain"]["memory"]["guest"],
        "256Mi"
    );
    assert_eq!(
        ex["spec"]["template"]["spec"]["domain"]["cpu"]["sockets"],
        2
    );
    let exj: Value = serde_json::from_str(&fv_ok(&c, &["expand", "--vm", "gen", "-o", "json"])?)?;
    assert_eq!(exj["metadata"]["name"], "gen");

    // get -w: the listing, then a row per change.
    let mut child = Command::new(BIN)
        .arg("--kubeconfig")
        .arg(&c.kubeconfig)
        .args(["get", "vm", "-w"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let out = child.stdout.take().context("stdout")?;
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    let deadline = Instant::now() + STEP;
    let mut labelled = false;
    while lines.len() < 3 && Instant::now() < deadline {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(500)) {
            lines.push(l);
        }
        if lines.len() >= 2 && !labelled {
            let r = fv_with(
                &c,
                &["apply", "-f", "-"],
                &plain.replace("name: gen", "name: gen\n  labels:\n    watched: \"yes\""),
                &[],
                STEP,
            )?;
            assert_eq!(r.code, 0, "{r:?}");
            labelled = true;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(lines.len() >= 3, "{lines:?}");
    assert!(lines[0].starts_with("NAME"), "{lines:?}");
    assert!(lines[1].starts_with("gen "), "{lines:?}");
    assert!(lines[2].starts_with("gen "), "{lines:?}");
    Ok(())
}

/// The PNG's IHDR width and height.
fn png_size(bytes: &[u8]) -> anyhow::Result<(u32, u32)> {
    if bytes.len() < 24 || &bytes[..8] != b"\x89PNG\r\n\x1a\n" || &bytes[12..16] != b"IHDR" {
        bail!("not a PNG ({} bytes)", bytes.len());
    }
    let w = u32::from_be_bytes(bytes[16..20].try_into()?);
    let h = u32::from_be_bytes(bytes[20..24].try_into()?);
    Ok((w, h))
}

#[test]
fn vnc_screenshot_and_proxy_of_a_running_guest() -> anyhow::Result<()> {
    TestGuest::get()?;
    let c = cluster(true)?;
    c.guest_disk_claim("g1-root")?;
    let vm = r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: g1, namespace: default}
spec:
  runStrategy: Always
  template:
    spec:
      terminationGracePeriodSeconds: 10
      domain:
        memory: {guest: 128Mi}
        devices:
          disks:
          - name: root
            disk: {bus: virtio}
      volumes:
      - name: root
        persistentVolumeClaim: {claimName: g1-root}
"#;
    let r = apply_text(&c, vm)?;
    assert_eq!(r.stdout, "virtualmachine.kubevirt.io/g1 created\n", "{r:?}");
    // The VMI appears a moment later; wait tolerates its absence until the timeout.
    let ready = fv_with(
        &c,
        &["wait", "--for=condition=Ready", "vmi/g1", "--timeout=240s"],
        "",
        &[],
        BOOT + STEP,
    )?;
    assert_eq!(
        ready.stdout,
        "virtualmachineinstance.kubevirt.io/g1 condition met\n",
        "{ready:?}\n{}",
        c.server_log()
    );
    let table = mask_table(&fv_ok(&c, &["get", "vmi", "g1"])?);
    assert!(
        table.starts_with("NAME AGE PHASE IP NODENAME READY\ng1 <age> Running "),
        "{table}"
    );
    assert!(table.trim_end().ends_with("node1 True"), "{table}");
    let wide = fv_ok(&c, &["get", "vmi", "g1", "-o", "wide"])?;
    let header: Vec<&str> = wide
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NAME",
            "AGE",
            "PHASE",
            "IP",
            "NODENAME",
            "READY",
            "LIVE-MIGRATABLE",
            "PAUSED"
        ],
        "{wide}"
    );

    // Screenshot: a PNG with a non-empty size.
    let png = c.dir.path().join("g1.png");
    let shot = fv(
        &c,
        &[
            "vnc",
            "screenshot",
            "g1",
            "-f",
            png.to_str().context("path")?,
        ],
    )?;
    assert_eq!(shot.code, 0, "{shot:?}");
    let (w, h) = png_size(&std::fs::read(&png)?)?;
    assert!(w > 0 && h > 0, "{w}x{h}");

    // The streaming verbs authenticate as kubectl does: a merged $KUBECONFIG list whose user
    // reads a token file, an exec credential plugin, and a wrong token refused.
    credential_forms_reach_the_console_stream(&c, "g1")?;

    // --proxy-only: a local port speaking RFB.
    let mut proxy = Command::new(BIN)
        .arg("--kubeconfig")
        .arg(&c.kubeconfig)
        .args(["vnc", "g1", "--proxy-only"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut first = String::new();
    std::io::BufReader::new(proxy.stdout.take().context("stdout")?).read_line(&mut first)?;
    let banner = (|| -> anyhow::Result<Vec<u8>> {
        let port = serde_json::from_str::<Value>(&first)?["port"]
            .as_u64()
            .context("port")?;
        let mut s = std::net::TcpStream::connect(("127.0.0.1", u16::try_from(port)?))?;
        s.set_read_timeout(Some(STEP))?;
        let mut b = [0u8; 12];
        s.read_exact(&mut b)?;
        Ok(b.to_vec())
    })();
    let _ = proxy.kill();
    let _ = proxy.wait();
    assert_eq!(banner?, b"RFB 003.008\n", "{first}");

    // describe shows the controller's events; delete --wait returns once the VM is gone.
    let d = c.wait_until("events in describe", STEP, || {
        let d = fv_ok(&c, &["describe", "vm", "g1"])?;
        Ok(d.contains("virtualmachine-controller").then_some(d))
    })?;
    assert!(d.contains("\nEvents:\n  Type    Reason"), "{d}");
    assert_eq!(
        fv_ok(&c, &["delete", "vm", "g1", "--timeout=120s"])?,
        "virtualmachine.kubevirt.io \"g1\" deleted\n"
    );
    assert_eq!(fv(&c, &["get", "vm", "g1"])?.code, 1);
    Ok(())
}
