//! DHCP on node interfaces and the node's resolver through NodeNetworkConfigurationPolicies
//! (docs/networking.md "Host network configuration (nmstate.io)"). An agent with `--nmstate`
//! runs in a network namespace of its own (testkit's cut-off node); a peer namespace (the
//! "physical network") runs busybox `udhcpd` on its end of the veth `eth1` (192.168.78.0/24,
//! router 192.168.78.1, DNS 192.168.78.54). A policy asks `ipv4: {enabled: true, dhcp: true}`
//! on eth1 and a `dns-resolver`: the node gets a leased address and the default route, pings
//! the peer, the NodeNetworkState shows `dhcp: true`, the address and the resolver (the
//! lease's server in `running`), and the resolver file (`--nmstate-resolv-conf`, here
//! `/etc/netns/<node ns>/resolv.conf`) holds the servers and search domains. Killed with its
//! client and restarted, the agent runs exactly one client again with the lease. The same
//! policy with `dhcp: false` releases the lease (address and route gone, no client); then a
//! linux-bridge with eth1 as port gets a lease (auto-gateway false: no default route) and
//! loses its client with `state: absent`. DHCP on
//! eth2, where no server answers, fails within the probe window naming the interface and
//! leaves nothing behind, its resolver write rolled back; so does a policy that cuts the
//! node off the API server. Admission refuses an `auto-route-table-id` other than 0 and a
//! search domain that is not a DNS name, naming the field.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferrovirt_testkit::cutoff::CutOffNode;
use ferrovirt_testkit::netns::{Netns, token, veth};
use ferrovirt_testkit::{Cluster, ClusterOptions};
use serde_json::Value;

const T: Duration = Duration::from_secs(40);
const PROBE_S: u64 = 8;

/// One ICMP echo to argv[1] (the machine has no `ping`): exit 0 when it is answered within 1 s.
const PING: &str = r#"
import os, select, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
def csum(b):
    n = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    n = (n >> 16) + (n & 0xFFFF)
    n += n >> 16
    return ~n & 0xFFFF
ident = os.getpid() & 0xFFFF
h = struct.pack("!BBHHH", 8, 0, 0, ident, 1)
s.sendto(struct.pack("!BBHHH", 8, 0, csum(h), ident, 1), (sys.argv[1], 0))
while select.select([s], [], [], 1)[0]:
    p, addr = s.recvfrom(200)
    if addr[0] == sys.argv[1] and p[20] == 0 and struct.unpack("!H", p[24:26])[0] == ident:
        sys.exit(0)
sys.exit(1)
"#;

/// Ends what the test started outside the cluster: the DHCP server, any client left in the
/// agent's data dir, and the per-namespace /etc dir.
struct Cleanup {
    udhcpd: Option<Child>,
    dhcp_dir: PathBuf,
    etc_dir: PathBuf,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(mut c) = self.udhcpd.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for e in std::fs::read_dir(&self.dhcp_dir)
            .into_iter()
            .flatten()
            .flatten()
        {
            if e.path().extension().is_some_and(|x| x == "pid")
                && let Ok(pid) = std::fs::read_to_string(e.path())
            {
                let _ = Command::new("kill").args(["-9", pid.trim()]).status();
            }
        }
        let _ = std::fs::remove_dir_all(&self.etc_dir);
    }
}

fn true_condition(obj: &Value) -> Option<(String, String, String)> {
    obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["status"] == "True")
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap_or("").to_string();
            (s("type"), s("reason"), s("message"))
        })
}

fn finished(c: &Cluster, name: &str, generation: i64) -> anyhow::Result<(String, String, String)> {
    c.wait_until(&format!("enactment {name} finished"), T, || {
        let out = c.kubectl(&["get", "nnce", name, "-o", "json"])?;
        if !out.status.success() {
            return Ok(None);
        }
        let e: Value = serde_json::from_slice(&out.stdout)?;
        if e["status"]["policyGeneration"].as_i64() != Some(generation) {
            return Ok(None);
        }
        Ok(true_condition(&e).filter(|(t, _, _)| t == "Available" || t == "Failing"))
    })
}

fn nns(c: &Cluster) -> anyhow::Result<Value> {
    Ok(c.get_json(&["nns", "nd-a"])?["status"]["currentState"].clone())
}

fn iface(state: &Value, name: &str) -> Value {
    state["interfaces"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|i| i["name"] == name)
        .cloned()
        .unwrap_or(Value::Null)
}

fn policy(name: &str, body: &str) -> String {
    format!(
        "apiVersion: nmstate.io/v1\nkind: NodeNetworkConfigurationPolicy\nmetadata: {{name: {name}}}\n\
         spec:\n  nodeSelector: {{nncp-dhcp: nd-a}}\n  desiredState:\n{body}"
    )
}

/// The udhcpc processes whose command line names `needle` (the agent's data dir) and `iface`.
fn clients(needle: &str, iface: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmd
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.iter().any(|a| a.ends_with("udhcpc"))
            && args.iter().any(|a| a.contains(needle))
            && args.windows(2).any(|w| w[0] == "-i" && w[1] == iface)
        {
            out.push(pid);
        }
    }
    out
}

fn addrs(ns: &Netns, dev: &str) -> anyhow::Result<String> {
    ns.ip(&["-4", "-o", "addr", "show", "dev", dev])
}

#[test]
fn dhcp_and_resolver_on_node_interfaces() -> anyhow::Result<()> {
    let started = Instant::now();
    let mut c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    let node = CutOffNode::new(c.port)?;
    let ns = node.netns().name().to_string();
    let phys = Netns::new(&format!("fv-dhp-{}", token()))?;
    veth(
        (node.netns(), "eth1", None),
        (&phys, "phy0", Some("192.168.78.1/24")),
    )?;
    // eth2: a link where no DHCP server answers.
    veth((node.netns(), "eth2", None), (&phys, "phy1", None))?;
    let etc_dir = Path::new("/etc/netns").join(&ns);
    let resolv = etc_dir.join("resolv.conf");
    let agent_dir = c.extra_agent_dir("nd-a");
    let mut cleanup = Cleanup {
        udhcpd: None,
        dhcp_dir: agent_dir.join("nmstate-dhcp"),
        etc_dir: etc_dir.clone(),
    };
    let conf = c.dir.path().join("udhcpd.conf");
    std::fs::write(
        &conf,
        format!(
            "start 192.168.78.100\nend 192.168.78.150\ninterface phy0\nlease_file {}\n\
             pidfile {}\noption subnet 255.255.255.0\noption router 192.168.78.1\n\
             option dns 192.168.78.54\noption lease 60\n",
            c.dir.path().join("udhcpd.leases").display(),
            c.dir.path().join("udhcpd.pid").display()
        ),
    )?;
    std::fs::write(c.dir.path().join("udhcpd.leases"), "")?;
    cleanup.udhcpd = Some(
        Command::new("ip")
            .args(["netns", "exec", phys.name(), "busybox", "udhcpd", "-f"])
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let probe = PROBE_S.to_string();
    let resolv_s = resolv.display().to_string();
    let args = [
        "--nmstate",
        "--nmstate-probe-timeout",
        probe.as_str(),
        "--nmstate-resolv-conf",
        resolv_s.as_str(),
    ];
    c.start_agent_in("nd-a", &node.prefix(), &args)?;
    c.wait_until("nd-a's NodeNetworkState", T, || {
        Ok(nns(&c).ok().filter(|s| !iface(s, "eth1").is_null()))
    })?;
    c.kubectl_ok(&["label", "node", "nd-a", "nncp-dhcp=nd-a"])?;

    // Admission.
    for (body, field) in [
        (
            "    interfaces:\n    - {name: eth1, type: ethernet, ipv4: {enabled: true, dhcp: true, auto-route-table-id: 7}}\n",
            "spec.desiredState.interfaces[0].ipv4.auto-route-table-id",
        ),
        (
            "    dns-resolver: {config: {server: [192.0.2.53], search: [-bad.example]}}\n",
            "spec.desiredState.dns-resolver.config.search[0]",
        ),
        (
            "    dns-resolver: {config: {server: [dns.example]}}\n",
            "spec.desiredState.dns-resolver.config.server[0]",
        ),
    ] {
        let err = format!(
            "{:#}",
            c.apply(&policy("bad", body))
                .expect_err("a bad policy was accepted")
        );
        assert!(err.contains(field), "{field}: {err}");
    }

    // DHCP on eth1 and the resolver.
    let dhcp_on = "    interfaces:\n    - {name: eth1, type: ethernet, state: up, ipv4: {enabled: true, dhcp: true}}\n\
                   \x20   dns-resolver: {config: {server: [192.168.78.53, 2001:db8::53], search: [lab.example, example.test]}}\n";
    let t0 = Instant::now();
    c.apply(&policy("dhcp", dhcp_on))?;
    let (ty, reason, msg) = finished(&c, "nd-a.dhcp", 1)?;
    assert_eq!(
        (ty.as_str(), reason.as_str()),
        ("Available", "SuccessfullyConfigured"),
        "{msg}"
    );
    let leased = t0.elapsed();
    let a = addrs(node.netns(), "eth1")?;
    assert!(a.contains("inet 192.168.78.1"), "{a}");
    let ip = a
        .split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .unwrap_or("")
        .split('/')
        .next()
        .unwrap_or("")
        .to_string();
    let last: u8 = ip.rsplit('.').next().unwrap_or("0").parse()?;
    assert!((100..=150).contains(&last), "{ip} not from the pool");
    let routes = node.netns().ip(&["-4", "route", "show", "default"])?;
    assert!(routes.contains("via 192.168.78.1 dev eth1"), "{routes}");
    c.wait_until("the node pings the peer", T, || {
        let out = node
            .netns()
            .exec(&["python3", "-c", PING, "192.168.78.1"])?;
        Ok(out.status.success().then_some(()))
    })?;
    let text = std::fs::read_to_string(&resolv)?;
    assert!(
        text.contains("nameserver 192.168.78.53\nnameserver 2001:db8::53\n")
            && text.contains("search lab.example example.test\n"),
        "{text}"
    );
    let state = c.wait_until("the lease in the NodeNetworkState", T, || {
        let s = nns(&c)?;
        let e = iface(&s, "eth1");
        Ok(
            (e["ipv4"]["dhcp"] == true && e["ipv4"]["address"][0]["ip"] == ip.as_str())
                .then_some(s),
        )
    })?;
    let dns = &state["dns-resolver"];
    assert_eq!(
        dns["config"]["server"],
        serde_json::json!(["192.168.78.53", "2001:db8::53"])
    );
    assert_eq!(
        dns["running"]["server"],
        serde_json::json!(["192.168.78.53", "2001:db8::53", "192.168.78.54"])
    );
    assert_eq!(dns["config"]["search"][1], "example.test");
    let needle = agent_dir.display().to_string();
    assert_eq!(clients(&needle, "eth1").len(), 1);

    // The agent dies with its client and comes back: one client again, with the lease.
    c.kill_agent("nd-a")?;
    std::thread::sleep(Duration::from_millis(300));
    assert!(clients(&needle, "eth1").is_empty());
    let t1 = Instant::now();
    c.start_agent_in("nd-a", &node.prefix(), &args)?;
    c.wait_until("the DHCP client restarted with a lease", T, || {
        let lease =
            std::fs::read_to_string(cleanup.dhcp_dir.join("eth1.lease")).unwrap_or_default();
        let pids = clients(&needle, "eth1");
        Ok((pids.len() == 1 && lease.contains(&format!("pid {}\n", pids[0]))).then_some(()))
    })?;
    let restarted = t1.elapsed();
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        clients(&needle, "eth1").len(),
        1,
        "two clients after a restart"
    );
    assert!(addrs(node.netns(), "eth1")?.contains("inet 192.168.78.1"));

    // dhcp: false releases the lease.
    c.apply(&policy(
        "dhcp",
        "    interfaces:\n    - {name: eth1, type: ethernet, state: up, ipv4: {enabled: true, dhcp: false}}\n",
    ))?;
    let (ty, _, msg) = finished(&c, "nd-a.dhcp", 2)?;
    assert_eq!(ty, "Available", "{msg}");
    let a = addrs(node.netns(), "eth1")?;
    assert!(!a.contains("inet "), "{a}");
    let routes = node.netns().ip(&["-4", "route", "show", "default"])?;
    assert!(routes.trim().is_empty(), "{routes}");
    assert!(clients(&needle, "eth1").is_empty());
    c.wait_until("eth1 without DHCP in the NodeNetworkState", T, || {
        let e = iface(&nns(&c)?, "eth1");
        Ok(
            (e["ipv4"]["dhcp"].is_null() && e["ipv4"]["address"] == serde_json::json!([]))
                .then_some(()),
        )
    })?;
    let before = std::fs::read_to_string(&resolv)?;

    // DHCP on a linux-bridge with eth1 as port; `state: absent` stops its client.
    let t3 = Instant::now();
    c.apply(&policy(
        "dhcp",
        "    interfaces:\n    - {name: br-dh, type: linux-bridge, state: up, bridge: {options: {stp: {enabled: false}}, port: [{name: eth1}]},\n\
         \x20      ipv4: {enabled: true, dhcp: true, auto-gateway: false}}\n",
    ))?;
    let (ty, _, msg) = finished(&c, "nd-a.dhcp", 3)?;
    assert_eq!(ty, "Available", "{msg}");
    let bridged = t3.elapsed();
    let a = addrs(node.netns(), "br-dh")?;
    assert!(a.contains("inet 192.168.78.1"), "{a}");
    let routes = node.netns().ip(&["-4", "route", "show", "default"])?;
    assert!(routes.trim().is_empty(), "auto-gateway false: {routes}");
    assert_eq!(clients(&needle, "br-dh").len(), 1);
    c.apply(&policy(
        "dhcp",
        "    interfaces:\n    - {name: br-dh, state: absent}\n",
    ))?;
    let (ty, _, msg) = finished(&c, "nd-a.dhcp", 4)?;
    assert_eq!(ty, "Available", "{msg}");
    assert!(!node.netns().links()?.contains(&"br-dh".to_string()));
    assert!(clients(&needle, "br-dh").is_empty());
    assert!(!cleanup.dhcp_dir.join("br-dh.want").exists());

    // No server on eth2: the enactment fails within the probe window, naming it, and the
    // resolver write is rolled back.
    let t2 = Instant::now();
    c.apply(&policy(
        "silent",
        "    interfaces:\n    - {name: eth2, type: ethernet, state: up, ipv4: {enabled: true, dhcp: true}}\n\
         \x20   dns-resolver: {config: {server: [198.51.100.53], search: [silent.example]}}\n",
    ))?;
    let (ty, reason, msg) = finished(&c, "nd-a.silent", 1)?;
    let failed = t2.elapsed();
    assert_eq!(
        (ty.as_str(), reason.as_str()),
        ("Failing", "FailedToConfigure"),
        "{msg}"
    );
    assert!(
        msg.contains("interfaces[0].ipv4.dhcp")
            && msg.contains("eth2")
            && msg.contains("rolled back"),
        "{msg}"
    );
    assert!(failed < Duration::from_secs(PROBE_S * 2 + 10), "{failed:?}");
    assert!(clients(&needle, "eth2").is_empty());
    assert!(!cleanup.dhcp_dir.join("eth2.want").exists());
    assert!(!addrs(node.netns(), "eth2")?.contains("inet "));
    assert_eq!(std::fs::read_to_string(&resolv)?, before);

    // A policy that cuts the node off: its resolver write is rolled back too.
    let uplink = node.uplink().to_string();
    c.apply(&policy(
        "cut",
        &format!(
            "    interfaces:\n    - {{name: {uplink}, type: ethernet, state: up, ipv4: {{enabled: false}}}}\n\
             \x20   dns-resolver: {{config: {{server: [198.51.100.54]}}}}\n"
        ),
    ))?;
    let (ty, _, msg) = finished(&c, "nd-a.cut", 1)?;
    assert_eq!(ty, "Failing", "{msg}");
    assert!(
        msg.contains("could not reach the API server") && msg.contains("rolled back"),
        "{msg}"
    );
    assert_eq!(std::fs::read_to_string(&resolv)?, before);

    println!(
        "nncp_dhcp: leased and applied {:.1}s, agent restarted to one client with a lease {:.1}s, \
         bridge leased {:.1}s, no server failed and rolled back {:.1}s, total {:.1}s",
        leased.as_secs_f64(),
        restarted.as_secs_f64(),
        bridged.as_secs_f64(),
        failed.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    drop(c);
    drop(cleanup);
    assert!(!etc_dir.exists());
    Ok(())
}
