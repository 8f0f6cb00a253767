//! Host network configuration through NodeNetworkConfigurationPolicies (docs/networking.md
//! "Host network configuration (nmstate.io)"). Two agents with `--nmstate` run in network
//! namespaces of their own (testkit's cut-off nodes: the API server is reached over a veth,
//! `fvcn…`, through relays); the server's embedded agent stays without `--nmstate` and is
//! never touched. A policy selecting node nn-a makes a linux-bridge `br-ext` with the veth
//! `eth1` (its peer in a "physical network" namespace) as port and 192.0.2.1/24 on it: the
//! peer pings the address, nn-a's NodeNetworkState lists br-ext with its port, nn-b has no
//! bridge and no enactment; `kubectl get nncp,nnce,nns` prints the columns; the same policy
//! with `state: absent` removes the bridge. A policy that removes the address of nn-a's
//! uplink cuts it off the API server: the agent rolls it back after its probe timeout (5 s
//! here), the enactment is Failing/FailedToConfigure naming the rollback, the address is
//! back and the NodeNetworkState shows it. A policy over both nodes with maxUnavailable 1
//! that cuts each off by /32 routes to the server's addresses is applied one node at a time
//! (the other Pending/MaxUnavailableLimitReached, never both Progressing) and rolled back on
//! both; the policy is Degraded "2/2 nodes failed to configure". Admission refuses a field ferrovirt does not
//! carry out, naming it. A bond policy on nn-b is made where the kernel has bonding, else its
//! enactment fails naming the command and the kernel's answer; relabelled so that the
//! policy no longer selects it, nn-b loses that enactment.

use std::time::{Duration, Instant};

use ferrovirt_testkit::cutoff::CutOffNode;
use ferrovirt_testkit::netns::{Netns, token, veth};
use ferrovirt_testkit::{Cluster, ClusterOptions};
use serde_json::Value;

const T: Duration = Duration::from_secs(40);

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

/// The enactment's True condition once it belongs to `generation` and is final.
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

fn nns_iface(c: &Cluster, node: &str, iface: &str) -> anyhow::Result<Option<Value>> {
    let v = c.get_json(&["nns", node])?;
    Ok(v["status"]["currentState"]["interfaces"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|i| i["name"] == iface)
        .cloned())
}

fn policy(name: &str, node: &str, body: &str) -> String {
    format!(
        "apiVersion: nmstate.io/v1\nkind: NodeNetworkConfigurationPolicy\nmetadata: {{name: {name}}}\n\
         spec:\n  nodeSelector: {{nncp-test: {node}}}\n  desiredState:\n{body}"
    )
}

const BRIDGE: &str = "    interfaces:
    - name: br-ext
      type: linux-bridge
      state: up
      bridge:
        options: {stp: {enabled: false}}
        port: [{name: eth1}]
      ipv4: {enabled: true, address: [{ip: 192.0.2.1, prefix-length: 24}]}
    ovn:
      bridge-mappings: [{localnet: physnet, bridge: br-ext}]
";

#[test]
fn node_network_configuration_policies() -> anyhow::Result<()> {
    let started = Instant::now();
    let mut c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    let node_a = CutOffNode::with_index(c.port, Some(0))?;
    let node_b = CutOffNode::with_index(c.port, Some(1))?;
    let phys = Netns::new(&format!("fv-phys-{}", token()))?;
    veth(
        (node_a.netns(), "eth1", None),
        (&phys, "phy0", Some("192.0.2.10/24")),
    )?;
    let args = ["--nmstate", "--nmstate-probe-timeout", "5"];
    c.start_agent_in("nn-a", &node_a.prefix(), &args)?;
    c.start_agent_in("nn-b", &node_b.prefix(), &args)?;
    for n in ["nn-a", "nn-b"] {
        c.wait_until(&format!("{n}'s NodeNetworkState"), T, || {
            Ok(nns_iface(&c, n, "lo").ok().flatten())
        })?;
        c.kubectl_ok(&["label", "node", n, &format!("nncp-test={n}")])?;
    }
    let ready = started.elapsed();

    // Admission: a field ferrovirt does not carry out is refused, naming it.
    let bad = policy(
        "bad",
        "nn-a",
        "    interfaces:\n    - {name: br-ext, type: linux-bridge, lldp: {enabled: true}}\n",
    );
    let err = format!(
        "{:#}",
        c.apply(&bad).expect_err("an unknown field was accepted")
    );
    assert!(
        err.contains("spec.desiredState.interfaces[0]") && err.contains("lldp"),
        "{err}"
    );

    // A bridge on nn-a only.
    let t0 = Instant::now();
    c.apply(&policy("br-ext", "nn-a", BRIDGE))?;
    let (ty, reason, msg) = finished(&c, "nn-a.br-ext", 1)?;
    assert_eq!(
        (ty.as_str(), reason.as_str()),
        ("Available", "SuccessfullyConfigured"),
        "{msg}"
    );
    let applied = t0.elapsed();
    let p = c.wait_until("the policy Available", T, || {
        let p = c.get_json(&["nncp", "br-ext"])?;
        Ok(true_condition(&p).filter(|(t, _, _)| t == "Available"))
    })?;
    assert_eq!(p.2, "1/1 nodes successfully configured");
    let pinged = c.wait_until("the peer pings the bridge address", T, || {
        let out = phys.exec(&["python3", "-c", PING, "192.0.2.1"])?;
        Ok(out.status.success().then_some(()))
    });
    pinged?;
    let br = c.wait_until("br-ext in nn-a's NodeNetworkState", T, || {
        nns_iface(&c, "nn-a", "br-ext")
    })?;
    assert_eq!(br["type"], "linux-bridge");
    assert_eq!(br["bridge"]["port"][0]["name"], "eth1");
    assert_eq!(br["ipv4"]["address"][0]["ip"], "192.0.2.1");
    let nns = c.get_json(&["nns", "nn-a"])?;
    assert_eq!(
        nns["status"]["currentState"]["ovn"]["bridge-mappings"][0]["bridge"],
        "br-ext"
    );
    assert!(nns["status"]["lastSuccessfulUpdateTime"].is_string());
    // nn-b is untouched.
    assert!(nns_iface(&c, "nn-b", "br-ext")?.is_none());
    assert!(!node_b.netns().links()?.contains(&"br-ext".to_string()));
    assert!(!c.kubectl(&["get", "nnce", "nn-b.br-ext"])?.status.success());

    let table = c.kubectl_ok(&["get", "nncp,nnce,nns"])?;
    for want in [
        "STATUS",
        "REASON",
        "STATUS AGE",
        "SuccessfullyConfigured",
        "nn-a.br-ext",
        "nn-b",
    ] {
        assert!(table.contains(want), "{want} missing in:\n{table}");
    }
    println!("{table}");

    // The same policy with state absent removes the bridge.
    let absent = "    interfaces:\n    - {name: br-ext, state: absent}\n    ovn:\n      bridge-mappings: [{localnet: physnet, state: absent}]\n";
    c.apply(&policy("br-ext", "nn-a", absent))?;
    let (ty, _, msg) = finished(&c, "nn-a.br-ext", 2)?;
    assert_eq!(ty, "Available", "{msg}");
    assert!(!node_a.netns().links()?.contains(&"br-ext".to_string()));
    c.wait_until("br-ext gone from the NodeNetworkState", T, || {
        Ok(nns_iface(&c, "nn-a", "br-ext")?.is_none().then_some(()))
    })?;

    // A bond on nn-b: made where the kernel has bonding, else the enactment fails naming
    // the command and the kernel's answer, and what ran before it is rolled back.
    let has_bond = phys.ip(&["link", "add", "tbond0", "type", "bond"]).is_ok();
    let _ = phys.ip(&["link", "del", "tbond0"]);
    c.apply(&policy(
        "bond",
        "nn-b",
        "    interfaces:\n    - {name: bond0, type: bond, state: up, link-aggregation: {mode: active-backup, port: []}}\n",
    ))?;
    let (ty, reason, msg) = finished(&c, "nn-b.bond", 1)?;
    if has_bond {
        assert_eq!(ty, "Available", "{msg}");
        let b = c.wait_until("bond0 in nn-b's NodeNetworkState", T, || {
            nns_iface(&c, "nn-b", "bond0")
        })?;
        assert_eq!(b["link-aggregation"]["mode"], "active-backup");
    } else {
        println!("this kernel has no bonding: the bond enactment must fail with the reason");
        assert_eq!(
            (ty.as_str(), reason.as_str()),
            ("Failing", "FailedToConfigure"),
            "{msg}"
        );
        assert!(
            msg.contains("ip link add bond0 type bond mode active-backup")
                && msg.contains("rolled back"),
            "{msg}"
        );
        assert!(!node_b.netns().links()?.contains(&"bond0".to_string()));
    }

    // A node no longer selected loses its enactment.
    c.kubectl_ok(&["label", "node", "nn-b", "nncp-test=none", "--overwrite"])?;
    c.wait_until("nn-b.bond deleted once nn-b is not selected", T, || {
        let out = c.kubectl(&["get", "nnce", "nn-b.bond"])?;
        Ok((!out.status.success()).then_some(()))
    })?;

    // A policy that cuts nn-a off the API server is rolled back.
    let uplink = node_a.uplink().to_string();
    let before = node_a
        .netns()
        .ip(&["-4", "-o", "addr", "show", "dev", &uplink])?;
    assert!(before.contains("10.253."), "{before}");
    let t1 = Instant::now();
    let cut = format!(
        "    interfaces:\n    - {{name: {uplink}, type: ethernet, state: up, ipv4: {{enabled: false}}}}\n"
    );
    c.apply(&policy("cut", "nn-a", &cut))?;
    let (ty, reason, msg) = finished(&c, "nn-a.cut", 1)?;
    let rolled_back = t1.elapsed();
    assert_eq!(
        (ty.as_str(), reason.as_str()),
        ("Failing", "FailedToConfigure"),
        "{msg}"
    );
    assert!(
        msg.contains("could not reach the API server") && msg.contains("rolled back"),
        "{msg}"
    );
    let after = node_a
        .netns()
        .ip(&["-4", "-o", "addr", "show", "dev", &uplink])?;
    assert_eq!(before, after);
    let up = nns_iface(&c, "nn-a", &uplink)?.expect("uplink in the NodeNetworkState");
    assert!(
        up["ipv4"]["address"][0]["ip"]
            .as_str()
            .is_some_and(|a| a.starts_with("10.253."))
    );
    let p = c.wait_until("the cut policy Degraded", T, || {
        let p = c.get_json(&["nncp", "cut"])?;
        Ok(true_condition(&p).filter(|(t, _, _)| t == "Degraded"))
    })?;
    assert_eq!(p.2, "1/1 nodes failed to configure");

    // maxUnavailable 1 over both nodes, each cut off by /32 routes to the server's addresses
    // through a bridge without ports: one node at a time applies (the other is Pending), both
    // roll back.
    for n in ["nn-a", "nn-b"] {
        c.kubectl_ok(&["label", "node", n, "nncp-both=yes"])?;
    }
    let t2 = Instant::now();
    c.apply(&format!(
        "apiVersion: nmstate.io/v1\nkind: NodeNetworkConfigurationPolicy\nmetadata: {{name: cut-both}}\n\
         spec:\n  nodeSelector: {{nncp-both: \"yes\"}}\n  maxUnavailable: 1\n  desiredState:\n\
         \x20   interfaces:\n\
         \x20   - {{name: br-cut, type: linux-bridge, state: up, bridge: {{options: {{stp: {{enabled: false}}}}, port: []}},\n\
         \x20      ipv4: {{enabled: true, address: [{{ip: 198.18.0.1, prefix-length: 24}}]}}}}\n\
         \x20   routes:\n      config:\n\
         \x20     - {{destination: {}/32, next-hop-address: 198.18.0.254, next-hop-interface: br-cut}}\n\
         \x20     - {{destination: {}/32, next-hop-address: 198.18.0.254, next-hop-interface: br-cut}}\n",
        node_a.host_ip(),
        node_b.host_ip()
    ))?;
    let (mut pending_seen, mut overlap) = (false, false);
    let finals = c.wait_until(
        "both cut-both enactments finished",
        Duration::from_secs(60),
        || {
            let v = c.get_json(&["nnce", "-l", "nmstate.io/policy=cut-both"])?;
            let items = v["items"].as_array().cloned().unwrap_or_default();
            let conds: Vec<_> = items.iter().filter_map(true_condition).collect();
            pending_seen |= conds
                .iter()
                .any(|(t, r, _)| t == "Pending" && r == "MaxUnavailableLimitReached");
            overlap |= conds.iter().filter(|(t, _, _)| t == "Progressing").count() > 1;
            let done = conds
                .iter()
                .filter(|(t, _, _)| t == "Available" || t == "Failing")
                .count();
            std::thread::sleep(Duration::from_millis(200));
            Ok((done == 2).then_some(conds))
        },
    )?;
    let both = t2.elapsed();
    assert!(pending_seen, "no enactment waited for maxUnavailable");
    assert!(
        !overlap,
        "both nodes applied at once despite maxUnavailable 1"
    );
    for (t, r, m) in &finals {
        assert_eq!(
            (t.as_str(), r.as_str()),
            ("Failing", "FailedToConfigure"),
            "{m}"
        );
        assert!(
            m.contains("could not reach the API server") && m.contains("rolled back"),
            "{m}"
        );
    }
    let p = c.wait_until("cut-both Degraded", T, || {
        let p = c.get_json(&["nncp", "cut-both"])?;
        Ok(true_condition(&p)
            .filter(|(t, _, _)| t == "Degraded")
            .map(|d| (d, p["status"]["unavailableNodeCount"].as_i64())))
    })?;
    assert_eq!(p.0.2, "2/2 nodes failed to configure");
    assert_eq!(p.1.unwrap_or(0), 0);
    for n in [&node_a, &node_b] {
        assert!(!n.netns().links()?.contains(&"br-cut".to_string()));
        let routes = n.netns().ip(&["-4", "route", "show"])?;
        assert!(!routes.contains("198.18.0.254"), "{routes}");
    }
    println!(
        "nncp: nodes ready {:.1}s, bridge applied {:.1}s, cut-off rolled back and reported {:.1}s, \
         two nodes one at a time {:.1}s, total {:.1}s",
        ready.as_secs_f64(),
        applied.as_secs_f64(),
        rolled_back.as_secs_f64(),
        both.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
