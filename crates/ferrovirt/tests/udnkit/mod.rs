//! Helpers shared by the user-defined-network end-to-end tests (`udn_dataplane.rs`,
//! `udn_secondary.rs`, `udn_layer3.rs`): the two-node underlay (node A the server's embedded
//! agent in one network namespace, node B a `ferrovirt agent` in another, joined by a veth
//! `under0`; each test its own addresses so the binaries can run in parallel), a claim holding
//! the test guest's disk, the VM/VMI manifests, waiting for a VMI Running, attaching to its
//! guest's serial console (ready marker, leases), pings from a guest, the networks' namespaces
//! on a node, node B's agent killed with its VXLAN devices deleted, a live migration, and
//! deleting the VMs until their namespaces are gone. The scenarios and their assertions stay
//! in the tests.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};
use std::time::Duration;

use ferrovirt_testkit::netns::{Netns, NodePair, pod_network_args, wait_vmi_netns_gone};
use ferrovirt_testkit::{Cluster, ClusterOptions, SerialConsole, TestGuest};
use serde_json::Value;

pub const BOOT: Duration = Duration::from_secs(240);

/// The two nodes' underlay: node A at `a_ip`, node B at `b_ip` with pod CIDR `b_cidr`.
pub struct Underlay {
    /// The prefix of the nodes' network namespaces' names.
    pub prefix: &'static str,
    pub a_ip: &'static str,
    pub b_ip: &'static str,
    pub b_cidr: &'static str,
    /// Both agents run with `--uplink under0` (the underlay): the networks get their gateway
    /// and egress.
    pub uplink: bool,
}

impl Underlay {
    /// The test guest built, the nodes' network namespaces made and joined.
    pub fn nodes(&self) -> anyhow::Result<NodePair> {
        TestGuest::get()?;
        NodePair::new(self.prefix, self.a_ip, self.b_ip)
    }

    /// The cluster: the server's embedded agent `node-a` in `node_a`, the agent `node-b` in
    /// `node_b`, both nodes with a podCIDR.
    pub fn start(&self, node_a: &Netns, node_b: &Netns) -> anyhow::Result<Cluster> {
        let mut opts = ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt"));
        opts.node_name = Some("node-a".into());
        let mut a_args = pod_network_args(node_a, self.a_ip, None);
        if self.uplink {
            a_args.extend(["--uplink", "under0"]);
        }
        opts.extra_args = a_args.into_iter().map(String::from).collect();
        let mut c = Cluster::start(&opts)?;
        self.start_node_b(&mut c, node_b)?;
        c.wait_until("both nodes with a podCIDR", Duration::from_secs(60), || {
            let a = c.get_json(&["node", "node-a"])?;
            let b = c.get_json(&["node", "node-b"])?;
            Ok(
                (a["spec"]["podCIDR"].is_string() && b["spec"]["podCIDR"].is_string())
                    .then_some(()),
            )
        })?;
        Ok(c)
    }

    /// Starts (or restarts) node B's agent in `node_b`.
    pub fn start_node_b(&self, c: &mut Cluster, node_b: &Netns) -> anyhow::Result<()> {
        let mut args = pod_network_args(node_b, self.b_ip, Some(self.b_cidr));
        if self.uplink {
            args.extend(["--uplink", "under0"]);
        }
        args.extend(["--endpoint-listen", "0.0.0.0:0"]);
        c.start_agent_with("node-b", &args)
    }
}

/// The agent directory of `node` (`node-a`: the server's embedded agent; else `node-b`).
pub fn node_dir(c: &Cluster, node: &str) -> PathBuf {
    if node == "node-a" {
        c.agent_dir()
    } else {
        c.extra_agent_dir("node-b")
    }
}

/// A PV holding a copy of the test guest's disk and a claim `<vm>-root` in `ns` bound to it
/// (`shared`: ReadWriteMany, both nodes being one host: the VM is live-migratable).
pub fn disk_claim(c: &Cluster, ns: &str, vm: &str, shared: bool) -> anyhow::Result<()> {
    let mode = if shared {
        "ReadWriteMany"
    } else {
        "ReadWriteOnce"
    };
    let g = TestGuest::get()?;
    let dir = c.dir().join("pvs").join(format!("{ns}-{vm}"));
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(&g.disk_raw, dir.join("disk.img"))?;
    c.apply(&format!(
        r#"
apiVersion: v1
kind: PersistentVolume
metadata: {{name: pv-{ns}-{vm}}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [{mode}]
  persistentVolumeReclaimPolicy: Retain
  hostPath: {{path: {dir}}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {vm}-root, namespace: {ns}}}
spec:
  accessModes: [{mode}]
  resources: {{requests: {{storage: 1Gi}}}}
  volumeName: pv-{ns}-{vm}
"#,
        dir = dir.display()
    ))?;
    Ok(())
}

/// A test guest `ns/name` (128 MiB, its claim `<name>-root`, an empty cloud-init): the pod
/// network with `pod_binding`, and `multus` (a network of the namespace) as the second
/// interface with bridge binding.
pub struct Machine<'a> {
    pub ns: &'a str,
    pub name: &'a str,
    /// The nodeSelector entry (`key: value`).
    pub selector: &'a str,
    /// `bridge` or `masquerade`.
    pub pod_binding: &'a str,
    pub multus: Option<&'a str>,
}

impl Machine<'_> {
    /// The VMI's spec, each line indented by `indent`.
    fn spec(&self, indent: usize) -> String {
        let Machine {
            name,
            selector,
            pod_binding,
            ..
        } = self;
        let mut lines = vec![
            format!("nodeSelector: {{{selector}}}"),
            "domain:".into(),
            "  memory: {guest: 128Mi}".into(),
            "  devices:".into(),
            "    disks:".into(),
            "    - {name: root, disk: {bus: virtio}}".into(),
            "    - {name: ci, disk: {bus: virtio}}".into(),
            "    interfaces:".into(),
            format!("    - {{name: default, {pod_binding}: {{}}}}"),
        ];
        if let Some(m) = self.multus {
            lines.push(format!("    - {{name: {m}, bridge: {{}}}}"));
        }
        lines.extend(["networks:".into(), "- {name: default, pod: {}}".into()]);
        if let Some(m) = self.multus {
            lines.push(format!("- {{name: {m}, multus: {{networkName: {m}}}}}"));
        }
        lines.extend([
            "volumes:".into(),
            format!("- {{name: root, persistentVolumeClaim: {{claimName: {name}-root}}}}"),
            r##"- {name: ci, cloudInitNoCloud: {userData: "#!/bin/sh\ntrue\n"}}"##.into(),
        ]);
        let pad = " ".repeat(indent);
        lines.iter().map(|l| format!("{pad}{l}\n")).collect()
    }

    /// A VirtualMachineInstance.
    pub fn vmi_yaml(&self) -> String {
        let (ns, name) = (self.ns, self.name);
        format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\n\
             metadata: {{name: {name}, namespace: {ns}}}\nspec:\n{}",
            self.spec(2)
        )
    }

    /// A VirtualMachine with runStrategy Always.
    pub fn vm_yaml(&self) -> String {
        let (ns, name) = (self.ns, self.name);
        format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachine\n\
             metadata: {{name: {name}, namespace: {ns}}}\nspec:\n  runStrategy: Always\n  \
             template:\n    spec:\n{}",
            self.spec(6)
        )
    }
}

fn wait_vmi(c: &Cluster, ns: &str, name: &str, with_address: bool) -> anyhow::Result<Value> {
    let what = if with_address {
        format!("VMI {ns}/{name} Running with an address")
    } else {
        format!("VMI {ns}/{name} Running")
    };
    c.wait_until(&what, BOOT, || {
        let out = c.kubectl(&["get", "vmi", name, "-n", ns, "-o", "json"])?;
        if !out.status.success() {
            return Ok(None);
        }
        let v: Value = serde_json::from_slice(&out.stdout)?;
        if v["status"]["phase"] == "Failed" {
            anyhow::bail!("VMI {ns}/{name} failed: {}", v["status"]["conditions"]);
        }
        let ok = v["status"]["phase"] == "Running"
            && (!with_address || v["status"]["interfaces"][0]["ipAddress"].is_string());
        Ok(ok.then_some(v))
    })
}

/// The VMI `ns/name` Running with an address in status; returns it.
pub fn wait_running(c: &Cluster, ns: &str, name: &str) -> anyhow::Result<Value> {
    wait_vmi(c, ns, name, true)
}

/// The VMI `ns/name` Running (address or not); returns it.
pub fn wait_phase_running(c: &Cluster, ns: &str, name: &str) -> anyhow::Result<Value> {
    wait_vmi(c, ns, name, false)
}

/// The VMI's `k8s.ovn.org/pod-networks` annotation (the controller's addresses per network).
pub fn pod_networks(v: &Value) -> anyhow::Result<Value> {
    Ok(serde_json::from_str(
        v["metadata"]["annotations"]["k8s.ovn.org/pod-networks"]
            .as_str()
            .unwrap_or("{}"),
    )?)
}

/// The VMI's LiveMigratable condition (null when it has none).
pub fn live_migratable(v: &Value) -> Value {
    v["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "LiveMigratable").cloned())
        .unwrap_or_default()
}

fn serial(dir: &Path) -> String {
    let log = std::fs::read(dir.join("serial.log")).unwrap_or_default();
    String::from_utf8_lossy(&log).into_owned()
}

/// The guest's `FERROVIRT-DHCP <iface>` line on its serial console (VMI directory `dir`).
pub fn lease_line(
    c: &Cluster,
    dir: &Path,
    iface: &str,
    timeout: Duration,
) -> anyhow::Result<String> {
    let marker = format!("FERROVIRT-DHCP {iface}");
    c.wait_until(&format!("{iface}'s lease on the console"), timeout, || {
        Ok(serial(dir)
            .lines()
            .find(|l| l.contains(&marker))
            .map(String::from))
    })
}

/// A running test guest, attached to its serial console.
pub struct Guest {
    pub uid: String,
    /// The address the test knows it by (the test says which network's).
    pub ip: String,
    pub console: SerialConsole,
    /// The VMI's directory on its node.
    pub dir: PathBuf,
}

/// What [`Guest::attach`] waits for.
pub struct Attach<'a> {
    /// The address the test knows the guest by.
    pub ip: String,
    /// The agent directory of the VMI's node.
    pub node_dir: &'a Path,
    /// When set, eth0's lease line must contain it (`ip=… router=…`).
    pub eth0_lease: Option<String>,
}

impl Guest {
    /// The guest of VMI `v` once it printed its ready marker (and, with `eth0_lease`, eth0's
    /// lease as expected); attached to its serial console.
    pub fn attach(c: &Cluster, v: &Value, a: Attach<'_>) -> anyhow::Result<Guest> {
        let uid = v["metadata"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let dir = a.node_dir.join("vmis").join(&uid);
        let log = c.wait_until("guest ready", BOOT, || {
            let log = serial(&dir);
            Ok(log.contains("FERROVIRT-READY").then_some(log))
        })?;
        if let Some(want) = a.eth0_lease {
            let lease = lease_line(c, &dir, "eth0", Duration::from_secs(60))
                .map_err(|e| anyhow::anyhow!("{e}: {log}"))?;
            assert!(lease.contains(&want), "{lease}");
        }
        let console = SerialConsole::connect(&dir.join("serial.sock"), Duration::from_secs(10))?;
        Ok(Guest {
            uid,
            ip: a.ip,
            console,
            dir,
        })
    }

    /// Asks for eth1's lease (the test guest leases eth0 only), then runs
    /// `ip -4 -o addr show eth1` and `then` (a shell command list, may be empty); asserts
    /// success; the output.
    pub fn lease_eth1(&self, name: &str, then: &str) -> anyhow::Result<String> {
        let (out, rc) = self.console.exec(
            &format!(
                "udhcpc -i eth1 -s /etc/udhcpc.script -q -n -t 10 -T 1 >/dev/null 2>&1; \
                 ip -4 -o addr show eth1{then}"
            ),
            Duration::from_secs(60),
        )?;
        assert_eq!(rc, 0, "{name}: {out}");
        Ok(out)
    }
}

/// `ping` from a guest: Ok(true) when answered within the retries.
pub fn pings(g: &Guest, addr: &str, tries: u32) -> anyhow::Result<(bool, String)> {
    let mut last = String::new();
    for _ in 0..tries {
        let (out, rc) = g
            .console
            .exec(&format!("ping -c 3 -W 2 {addr}"), Duration::from_secs(20))?;
        if rc == 0 {
            return Ok((true, out));
        }
        last = out;
    }
    Ok((false, last))
}

/// The addresses among `addrs` that answered `count` pings from `g` (at least once, 2 s wait).
pub fn reached(g: &Guest, addrs: &[&str], count: u32) -> anyhow::Result<Vec<String>> {
    let list = addrs.join(" ");
    let (out, _) = g.console.exec(
        &format!(
            "for a in {list}; do ping -c {count} -W 2 $a >/dev/null 2>&1 && echo REACHED''-$a; done; true"
        ),
        Duration::from_secs(30),
    )?;
    Ok(out
        .lines()
        .filter_map(|l| l.trim().strip_prefix("REACHED-").map(String::from))
        .collect())
}

/// Pings `addrs` from `g` until each answered once, `tries` rounds at most; the ones that
/// never did.
pub fn reach_all(g: &Guest, addrs: &[&str], tries: u32) -> anyhow::Result<Vec<String>> {
    let mut missing: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
    for _ in 0..tries {
        let list: Vec<&str> = missing.iter().map(String::as_str).collect();
        let got = reached(g, &list, 2)?;
        missing.retain(|a| !got.contains(a));
        if missing.is_empty() {
            break;
        }
    }
    Ok(missing)
}

/// The user-defined networks' namespaces (`fvn-…`) on `node`.
pub fn udn_namespaces(node: &Netns) -> anyhow::Result<Vec<String>> {
    let out = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()?;
    let suffix = format!("-{}", node.name());
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("fvn-") && n.ends_with(&suffix))
        .map(String::from)
        .collect())
}

/// Node B's agent killed; then each of its networks' namespaces loses its VXLAN device
/// `udn-vx0`. Returns those namespaces.
pub fn kill_node_b_and_its_vxlans(c: &Cluster, node_b: &Netns) -> anyhow::Result<Vec<String>> {
    let pid = c.agent_pid("node-b").expect("node-b's agent");
    ferrovirt_testkit::cluster::signal(pid, "KILL");
    std::thread::sleep(Duration::from_millis(500));
    let nets = udn_namespaces(node_b)?;
    for n in &nets {
        ferrovirt_testkit::netns::sh(&["ip", "-n", n, "link", "del", "udn-vx0"])?;
    }
    Ok(nets)
}

/// A VirtualMachineInstanceMigration `<vmi>-mig` of `ns/vmi`; it once Succeeded or Failed.
pub fn migrate(c: &Cluster, ns: &str, vmi: &str) -> anyhow::Result<Value> {
    c.apply(&format!(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\n\
         metadata: {{name: {vmi}-mig, namespace: {ns}}}\nspec: {{vmiName: {vmi}}}\n"
    ))?;
    c.wait_until(
        &format!("{vmi}'s migration finished"),
        Duration::from_secs(180),
        || {
            let v = c.get_json(&["vmim", &format!("{vmi}-mig"), "-n", ns])?;
            let phase = v["status"]["phase"].as_str().unwrap_or_default();
            Ok(matches!(phase, "Succeeded" | "Failed").then_some(v))
        },
    )
}

/// The VMI `ns/vmi` Running on `node`; returns it.
pub fn running_on(c: &Cluster, ns: &str, vmi: &str, node: &str) -> anyhow::Result<Value> {
    c.wait_until(
        &format!("{vmi} Running on {node}"),
        Duration::from_secs(60),
        || {
            let v = c.get_json(&["vmi", vmi, "-n", ns])?;
            Ok((v["status"]["phase"] == "Running" && v["status"]["nodeName"] == node).then_some(v))
        },
    )
}

/// Deletes `kind` (`vm` or `vmi`) of each `(namespace, name, _)` in `vms`; waits until the
/// VMIs' namespaces (`uids`) are gone and, on each of `nodes`, the networks' namespaces.
pub fn delete_all(
    c: &Cluster,
    kind: &str,
    vms: &[(&str, &str, &str)],
    uids: &[String],
    nodes: &[&Netns],
) -> anyhow::Result<()> {
    for (ns, name, _) in vms {
        c.kubectl_ok(&["delete", kind, name, "-n", ns, "--wait=false"])?;
    }
    wait_vmi_netns_gone(c, uids, Duration::from_secs(120))?;
    for node in nodes {
        c.wait_until(
            "the networks' namespaces removed",
            Duration::from_secs(60),
            || Ok(udn_namespaces(node)?.is_empty().then_some(())),
        )?;
    }
    Ok(())
}
