//! In steady state node agents and controllers only watch: a cluster with two agents (the
//! server's embedded node1 and a `ferrovirt agent` process, node2) and two running VMs is left
//! alone, and the API server's request counters (`/metrics`, by verb, resource and user agent)
//! show over a quiet window (`FERROVIRT_QUIET_SECS`, default 10 s) no LIST from an agent or the
//! controllers. The requests per second of each component are printed
//! (`FERROVIRT_STEADY_BINARY` measures another `ferrovirt` build the same way). Starting a
//! VM lists nothing either: a third VM with an explicit MAC address (duplicate-MAC check)
//! started on node1 afterwards adds no LIST request of node1's agent (the HyperConverged
//! feature gates and the cluster's VMIs come from watch-fed caches).
//!
//! It also counts what starting those three VMs cost the controllers (issue #15: the minimum
//! KubeVirt's design needs): per VMI at most one VMI PATCH (the scheduler's bind: node, phase
//! and condition in one write), and in the quiet window no controller write of a VMI, Node or
//! Event and no read of a Node or Lease. The controllers' requests per VMI are printed by verb
//! and resource.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ferrovirt_testkit::requests::{Counts, between, parse};
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};

const BOOT: Duration = Duration::from_secs(240);

/// The counters (`kubectl get --raw /metrics` is no resource request: it counts nothing),
/// retried on a transient kubectl failure.
fn metrics(c: &Cluster) -> anyhow::Result<Counts> {
    c.wait_until("/metrics", Duration::from_secs(20), || {
        Ok(Some(parse(&c.kubectl_ok(&["get", "--raw", "/metrics"])?)))
    })
}

/// A VM booting the test guest on `node`; `mac` gives its pod interface that MAC address.
fn vm(c: &Cluster, name: &str, node: &str, mac: Option<&str>) -> anyhow::Result<String> {
    c.guest_disk_claim(&format!("{name}-root"))?;
    let (interfaces, networks) = match mac {
        Some(m) => (
            format!(
                "\n          interfaces: [{{name: default, masquerade: {{}}, macAddress: \"{m}\"}}]"
            ),
            "\n      networks: [{name: default, pod: {}}]".to_string(),
        ),
        None => (String::new(), String::new()),
    };
    Ok(format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {name}, namespace: default}}
spec:
  runStrategy: Always
  template:
    metadata:
      labels: {{app: {name}}}
    spec:
      terminationGracePeriodSeconds: 10
      nodeSelector: {{kubernetes.io/hostname: {node}}}
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - name: root
            disk: {{bus: virtio}}{interfaces}{networks}
      volumes:
      - name: root
        persistentVolumeClaim: {{claimName: {name}-root}}
"#
    ))
}

/// The controllers' requests of `counts` by (verb, resource).
fn controllers(counts: &Counts) -> BTreeMap<(String, String), u64> {
    let mut out = BTreeMap::new();
    for ((agent, verb, resource), n) in counts {
        if agent == CONTROLLER {
            *out.entry((verb.clone(), resource.clone())).or_default() += n;
        }
    }
    out
}

const CONTROLLER: &str = "ferrovirt-controller";
const VMIS: &str = "virtualmachineinstances.kubevirt.io";

fn is_ours(agent: &str) -> bool {
    agent.starts_with("ferrovirt-agent/") || agent == "ferrovirt-controller"
}

#[test]
fn agents_and_controllers_make_no_list_requests_in_steady_state() -> anyhow::Result<()> {
    TestGuest::get()?;
    let binary = std::env::var("FERROVIRT_STEADY_BINARY")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_ferrovirt").to_string());
    let mut c = Cluster::start(&ClusterOptions::new(binary))?;
    c.start_agent("node2")?;
    let start0 = metrics(&c)?;
    c.apply(&vm(&c, "quiet-a", "node1", Some("02:00:00:00:00:0a"))?)?;
    c.apply(&vm(&c, "quiet-b", "node2", None)?)?;
    let running = |name: &str| {
        c.wait_until(&format!("VMI {name} Running"), BOOT, || {
            let v = c.get_json(&["vmi", name])?;
            Ok((v["status"]["phase"] == "Running").then_some(()))
        })
    };
    for name in ["quiet-a", "quiet-b"] {
        running(name)?;
    }
    // Let start-up work settle (conditions, events).
    std::thread::sleep(Duration::from_secs(10));
    let secs: u64 = std::env::var("FERROVIRT_QUIET_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let before = metrics(&c)?;
    let started_two = between(&start0, &before);
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(secs));
    let after = metrics(&c)?;
    let window = t0.elapsed().as_secs_f64();

    let mut per_agent: BTreeMap<String, u64> = BTreeMap::new();
    let mut lists = Vec::new();
    for (key, n) in &after {
        let d = n - before.get(key).copied().unwrap_or(0);
        if d == 0 {
            continue;
        }
        let (agent, verb, resource) = key;
        *per_agent.entry(agent.clone()).or_default() += d;
        eprintln!("  {agent:28} {verb:8} {resource:48} {d}");
        if verb == "LIST" && is_ours(agent) {
            lists.push(format!("{agent} listed {resource} {d}×"));
        }
    }
    for (agent, n) in &per_agent {
        eprintln!(
            "{agent}: {n} requests in {window:.1} s = {:.2}/s",
            *n as f64 / window
        );
    }
    let ours: u64 = per_agent
        .iter()
        .filter(|(a, _)| is_ours(a))
        .map(|(_, n)| n)
        .sum();
    eprintln!(
        "agents + controllers: {:.2} requests/s in steady state",
        ours as f64 / window
    );
    // The counters do see the components (they watched at start-up).
    for agent in [
        "ferrovirt-agent/node1",
        "ferrovirt-agent/node2",
        "ferrovirt-controller",
    ] {
        assert!(
            after.keys().any(|(a, v, _)| v == "WATCH" && a == agent),
            "no watch counted for {agent}"
        );
    }
    assert!(lists.is_empty(), "LIST requests in steady state: {lists:?}");
    // The controllers in steady state write no VMI, Node or Event and read no Node or Lease
    // (their leader Lease renewals are UPDATEs without a read). What a VMI's own status write
    // wakes (the VM controller's reconcile of its VM) may still read and write the VM.
    let forbidden = |verb: &str, resource: &str| match resource {
        VMIS | "nodes" | "events" | "events.events.k8s.io" => verb != "GET" || resource == "nodes",
        "leases.coordination.k8s.io" => verb == "GET",
        _ => false,
    };
    let quiet: Vec<String> = controllers(&between(&before, &after))
        .into_iter()
        .filter(|((verb, resource), _)| forbidden(verb, resource))
        .map(|((verb, resource), n)| format!("{verb} {resource} {n}×"))
        .collect();
    assert!(
        quiet.is_empty(),
        "controller requests in steady state: {quiet:?}"
    );

    // A VM start (explicit MAC: the duplicate-MAC check) lists nothing on its node's agent.
    let start_vm = vm(&c, "start-c", "node1", Some("02:00:00:00:00:0c"))?;
    let before = metrics(&c)?;
    c.apply(&start_vm)?;
    running("start-c")?;
    // The writes that follow Running (conditions, Events) land too.
    std::thread::sleep(Duration::from_secs(5));
    let after = metrics(&c)?;
    let started_lists: Vec<String> = after
        .iter()
        .filter(|((agent, verb, _), _)| verb == "LIST" && agent == "ferrovirt-agent/node1")
        .filter_map(|(key, n)| {
            let d = n - before.get(key).copied().unwrap_or(0);
            (d > 0).then(|| format!("{} {d}×", key.2))
        })
        .collect();
    assert!(
        started_lists.is_empty(),
        "node1's agent listed while starting a VMI: {started_lists:?}"
    );

    // What starting the three VMs cost the controllers, per VMI.
    let mut started = controllers(&started_two);
    for (k, n) in controllers(&between(&before, &after)) {
        *started.entry(k).or_default() += n;
    }
    let per_vmi = |verb: &str, resource: &str| {
        started
            .get(&(verb.to_string(), resource.to_string()))
            .copied()
            .unwrap_or(0) as f64
            / 3.0
    };
    eprintln!("controller requests per VMI, three VMs started:");
    for ((verb, resource), n) in &started {
        eprintln!("  {verb:8} {resource:48} {:.2}", *n as f64 / 3.0);
    }
    // One bind per VMI: node, phase and condition in one PATCH, never repeated because the
    // controllers' cache lags their own write (a refused PATCH and a GET per VMI).
    assert!(
        per_vmi("PATCH", VMIS) <= 1.0,
        "controller VMI PATCHes per VMI: {:.2}",
        per_vmi("PATCH", VMIS)
    );
    Ok(())
}
