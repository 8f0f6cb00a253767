//! Network namespaces for network end-to-end tests: throwaway named namespaces (a "node", an
//! "outside" peer) deleted on drop, veth pairs between them, and small queries (`ip netns
//! list`, links of a namespace) to assert that nothing was left behind. Needs root.

use std::process::{Command, Output};

use anyhow::{Context, bail};

/// Runs a command and returns stdout; fails with its stderr.
pub fn sh(argv: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(argv[0])
        .args(&argv[1..])
        .output()
        .with_context(|| format!("running {argv:?}"))?;
    if !out.status.success() {
        bail!(
            "{argv:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A named network namespace (under /run/netns), deleted on drop.
#[derive(Debug)]
pub struct Netns(pub String);

impl Netns {
    /// Creates `name` (replacing a leftover of that name) with `lo` up.
    pub fn new(name: &str) -> anyhow::Result<Netns> {
        if std::path::Path::new("/run/netns").join(name).exists() {
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
        sh(&["ip", "netns", "add", name]).context("ip netns add (root needed)")?;
        let ns = Netns(name.to_string());
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Only deletes `name` on drop (e.g. a VMI namespace the test expects to vanish).
    pub fn guard(name: &str) -> Netns {
        Netns(name.to_string())
    }

    pub fn name(&self) -> &str {
        &self.0
    }

    /// `ip -n NAME ARGS…`.
    pub fn ip(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut argv = vec!["ip", "-n", &self.0];
        argv.extend_from_slice(args);
        sh(&argv)
    }

    /// `bridge -n NAME ARGS…`.
    pub fn bridge(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut argv = vec!["bridge", "-n", &self.0];
        argv.extend_from_slice(args);
        sh(&argv)
    }

    /// Runs a program inside the namespace (`ip netns exec`), whatever its exit status.
    pub fn exec(&self, args: &[&str]) -> anyhow::Result<Output> {
        Ok(Command::new("ip")
            .args(["netns", "exec", &self.0])
            .args(args)
            .output()?)
    }

    /// Names of the links in the namespace.
    pub fn links(&self) -> anyhow::Result<Vec<String>> {
        Ok(link_names(&self.ip(&["-o", "link", "show"])?))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if std::path::Path::new("/run/netns").join(&self.0).exists() {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }
}

/// Link names from `ip -o link show` output.
pub fn link_names(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_string())
        .collect()
}

/// A veth pair `a` (in namespace `ns_a`, address `addr_a`) ↔ `b` (in `ns_b`, `addr_b`), both
/// up; an address of `None` leaves that end without one.
pub fn veth(
    (ns_a, a, addr_a): (&Netns, &str, Option<&str>),
    (ns_b, b, addr_b): (&Netns, &str, Option<&str>),
) -> anyhow::Result<()> {
    sh(&[
        "ip", "link", "add", a, "netns", &ns_a.0, "type", "veth", "peer", "name", b, "netns",
        &ns_b.0,
    ])?;
    for (ns, name, addr) in [(ns_a, a, addr_a), (ns_b, b, addr_b)] {
        if let Some(addr) = addr {
            ns.ip(&["addr", "add", addr, "dev", name])?;
        }
        ns.ip(&["link", "set", name, "up"])?;
    }
    Ok(())
}

/// `ip netns list` (names only).
pub fn netns_list() -> Vec<String> {
    Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| l.split_whitespace().next().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// Waits up to `timeout` until no network namespace names one of the VMI `uids` (the pod
/// network's per-VMI namespaces, removed when their VMIs go).
pub fn wait_vmi_netns_gone(
    c: &crate::Cluster,
    uids: &[String],
    timeout: std::time::Duration,
) -> anyhow::Result<()> {
    c.wait_until("the VMI network namespaces removed", timeout, || {
        let list = netns_list();
        let left = uids
            .iter()
            .any(|u| list.iter().any(|n| n.contains(u.as_str())));
        Ok((!left).then_some(()))
    })
}

/// A short token for names that must not clash between concurrent test runs.
pub fn token() -> String {
    format!("{:05}", std::process::id() % 100_000)
}

/// Two "node" namespaces joined by a veth `under0` (A at `a_ip`/24, B at `b_ip`/24): the
/// machines of a two-node pod-network test (the server's embedded agent in A, a second agent
/// in B; see [`pod_network_args`]). Destructure it to keep the namespaces.
#[derive(Debug)]
pub struct NodePair {
    pub a: Netns,
    pub b: Netns,
}

impl NodePair {
    /// Namespaces `<prefix>a-<token>` and `<prefix>b-<token>`, joined.
    pub fn new(prefix: &str, a_ip: &str, b_ip: &str) -> anyhow::Result<NodePair> {
        let t = token();
        let a = Netns::new(&format!("{prefix}a-{t}"))?;
        let b = Netns::new(&format!("{prefix}b-{t}"))?;
        veth(
            (&a, "under0", Some(&format!("{a_ip}/24"))),
            (&b, "under0", Some(&format!("{b_ip}/24"))),
        )?;
        Ok(NodePair { a, b })
    }

    /// A two-node pod-network cluster over the pair: the server (node `node-a`, its embedded
    /// agent) in A at `ips[0]`, an agent `node-b` in B at `ips[1]` with pod subnet `b_cidr`,
    /// listening on every address (the URL on its Node names `--address`, 127.0.0.1).
    pub fn start_cluster(
        &self,
        bin: &str,
        ips: [&str; 2],
        b_cidr: &str,
    ) -> anyhow::Result<crate::Cluster> {
        let mut opts = crate::ClusterOptions::new(bin);
        opts.node_name = Some("node-a".into());
        opts.extra_args = pod_network_args(&self.a, ips[0], None)
            .into_iter()
            .map(String::from)
            .collect();
        let mut c = crate::Cluster::start(&opts)?;
        let mut b_args = pod_network_args(&self.b, ips[1], Some(b_cidr));
        b_args.extend(["--endpoint-listen", "0.0.0.0:0"]);
        c.start_agent_with("node-b", &b_args)?;
        Ok(c)
    }
}

/// The server or agent arguments of a pod-network node living in `netns` with address `ip`
/// (and its pod subnet, when the test chooses it).
pub fn pod_network_args<'a>(
    netns: &'a Netns,
    ip: &'a str,
    pod_cidr: Option<&'a str>,
) -> Vec<&'a str> {
    let mut args = vec![
        "--pod-network",
        "--node-netns",
        netns.name(),
        "--node-ip",
        ip,
    ];
    if let Some(cidr) = pod_cidr {
        args.extend(["--pod-cidr", cidr]);
    }
    args
}
