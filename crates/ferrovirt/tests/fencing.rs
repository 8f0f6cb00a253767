//! Node failure that is safe as well as fast (docs/fencing.md). Two nodes: the server's
//! embedded node1 and an agent process node2. A VM with runStrategy Always on a ReadWriteMany
//! claim runs on node2; node2's agent hangs (SIGSTOP) or dies (kill -9, not restarted) while
//! its launchers and QEMUs keep running, as they are designed to. The launcher fences itself:
//! the old QEMU is gone before any replacement VMI exists (checked every ~50 ms, without
//! relying on QEMU's image locking), and the VM runs on node1 within 20 s (8 s Leases, asked of
//! the HyperConverged; the default is 16 s). A VM on a
//! node-local claim on the hung node keeps running, turns Unknown and is never replaced; the
//! agent that comes back cleans up the fenced VM and never restarts it. A node cut off from
//! the API server (its agent in a network namespace of its own, the link set down) fences
//! the same way.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ferrovirt_testkit::cluster::{pids_matching, signal};
use ferrovirt_testkit::cutoff::CutOffNode;
use ferrovirt_testkit::{Cluster, ClusterOptions, TestGuest};
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use serde_json::Value;

const BOOT: Duration = Duration::from_secs(180);

/// The node Lease these tests ask for through the HyperConverged (`spec.nodeFailure`): 8 s,
/// half the default, so each failure is over sooner (the mechanism is the same at any
/// duration, docs/fencing.md); `FV_FENCING_LEASE_SECONDS` asks for another
/// (`bench/failover.sh --lease-seconds`).
fn lease_seconds() -> u32 {
    std::env::var("FV_FENCING_LEASE_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8)
}

/// The goal: node failure → the VM running on another node within the lease, the fence
/// margin (4 s) and 8 s for the rest (20 s with 8 s Leases).
fn recovery_goal() -> Duration {
    Duration::from_secs(u64::from(lease_seconds()) + 12)
}

fn two_nodes() -> anyhow::Result<Cluster> {
    Ok(two_nodes_with_cut_off(false)?.0)
}

/// Two nodes; `cut_off`: node2's agent runs in a namespace of its own that the test can cut
/// off from the API server.
fn two_nodes_with_cut_off(cut_off: bool) -> anyhow::Result<(Cluster, Option<CutOffNode>)> {
    TestGuest::get()?;
    let mut c = Cluster::start(&ClusterOptions::new(env!("CARGO_BIN_EXE_ferrovirt")))?;
    let lease = lease_seconds();
    c.patch_hco(&format!(
        r#"{{"spec":{{"nodeFailure":{{"leaseDurationSeconds":{lease}}}}}}}"#
    ))?;
    let cut = if cut_off {
        let n = CutOffNode::new(c.port)?;
        c.start_agent_in("node2", &n.prefix(), &[])?;
        Some(n)
    } else {
        c.start_agent("node2")?;
        None
    };
    c.wait_until("two Ready nodes", Duration::from_secs(60), || {
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
        Ok((ready == 2).then_some(()))
    })?;
    c.wait_until(
        "both nodes' Leases renewed for the asked duration",
        Duration::from_secs(30),
        || {
            let v = c.get_json(&["leases", "-n", "kube-node-lease"])?;
            let asked = v["items"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|l| l["spec"]["leaseDurationSeconds"] == lease)
                .count();
            Ok((asked == 2).then_some(()))
        },
    )?;
    // The VMs start on node2; node1 is opened for the replacements once they run.
    c.kubectl_ok(&["taint", "node", "node1", "hold=yes:NoSchedule"])?;
    Ok((c, cut))
}

/// A claim holding the test guest's disk; `shared`: ReadWriteMany (usable from any node).
fn claim(c: &Cluster, name: &str, shared: bool) -> anyhow::Result<PathBuf> {
    let dir = c.guest_disk_claim(name)?;
    if shared {
        let rwx = r#"{"spec":{"accessModes":["ReadWriteMany"]}}"#;
        c.kubectl_ok(&[
            "patch",
            "pv",
            &format!("pv-{name}"),
            "--type=merge",
            "-p",
            rwx,
        ])?;
        c.kubectl_ok(&["patch", "pvc", name, "--type=merge", "-p", rwx])
            .ok();
    }
    Ok(dir)
}

fn vm(name: &str, claim: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {name}, namespace: default}}
spec:
  runStrategy: Always
  template:
    spec:
      terminationGracePeriodSeconds: 10
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - name: root
            disk: {{bus: virtio}}
      volumes:
      - name: root
        persistentVolumeClaim: {{claimName: {claim}}}
"#
    )
}

/// Waits until VMI `name` runs on node2; returns its uid.
fn running_on_node2(c: &Cluster, name: &str) -> anyhow::Result<String> {
    c.wait_until(&format!("{name} Running on node2"), BOOT, || {
        let v = c.get_json(&["vmi", name])?;
        Ok(
            (v["status"]["phase"] == "Running" && v["status"]["nodeName"] == "node2").then(|| {
                v["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            }),
        )
    })
}

/// The pid of the QEMU of VMI `uid` on node2.
fn qemu_pid(c: &Cluster, uid: &str) -> Option<u32> {
    let needle = c
        .extra_agent_dir("node2")
        .join("vmis")
        .join(uid)
        .display()
        .to_string();
    pids_matching(&needle).into_iter().find(|p| {
        std::fs::read(format!("/proc/{p}/cmdline"))
            .map(|c| String::from_utf8_lossy(&c).starts_with("qemu-system"))
            .unwrap_or(false)
    })
}

/// Whether `pid` is a live (not zombie) process.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next().map(|st| st != "Z"))
        })
        .unwrap_or(false)
}

/// A kube-rs client for fast polling of VMIs.
struct Poller {
    rt: tokio::runtime::Runtime,
    vmis: Api<DynamicObject>,
}

impl Poller {
    fn new(c: &Cluster) -> anyhow::Result<Poller> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let kc = kube::config::Kubeconfig::read_from(&c.kubeconfig)?;
        let vmis = rt.block_on(async {
            let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
            let client = kube::Client::try_from(cfg)?;
            let ar = ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstance"),
                "virtualmachineinstances",
            );
            anyhow::Ok(Api::<DynamicObject>::namespaced_with(
                client, "default", &ar,
            ))
        })?;
        Ok(Poller { rt, vmis })
    }

    fn vmi(&self, name: &str) -> anyhow::Result<Value> {
        let v = self.rt.block_on(self.vmis.get_opt(name))?;
        Ok(v.map(|v| serde_json::to_value(v).unwrap_or(Value::Null))
            .unwrap_or(Value::Null))
    }
}

/// What happened after the failure, measured from it.
#[derive(Debug)]
struct Recovery {
    /// The old QEMU was seen gone.
    fenced: Duration,
    /// A replacement VMI (new uid) was first seen.
    replaced: Duration,
    /// The replacement was Running on another node.
    running: Duration,
    node: String,
}

/// Polls every ~50 ms after a failure of node2 at `t0` until VMI `name` (old `uid`, QEMU
/// `pid`) has a Running replacement on another node. Fails if a replacement VMI exists while
/// the old QEMU still runs (the VMI is read first, then the process: a replacement seen
/// before a live QEMU proves they overlapped).
fn watch_recovery(
    c: &Cluster,
    p: &Poller,
    name: &str,
    uid: &str,
    pid: u32,
    t0: Instant,
) -> anyhow::Result<Recovery> {
    let mut fenced = None;
    let mut replaced = None;
    loop {
        let v = p.vmi(name)?;
        let qemu_alive = alive(pid);
        let now = t0.elapsed();
        if !qemu_alive && fenced.is_none() {
            fenced = Some(now);
        }
        let new_uid = v["metadata"]["uid"].as_str().filter(|u| *u != uid);
        if new_uid.is_some() {
            assert!(
                !qemu_alive,
                "a replacement VMI exists after {now:?} while the old QEMU {pid} still runs: {v}"
            );
            replaced.get_or_insert(now);
            let node = v["status"]["nodeName"].as_str().unwrap_or_default();
            if v["status"]["phase"] == "Running" && node != "node2" {
                return Ok(Recovery {
                    fenced: fenced.unwrap_or(now),
                    replaced: replaced.unwrap_or(now),
                    running: now,
                    node: node.to_string(),
                });
            }
        }
        anyhow::ensure!(
            now < Duration::from_secs(90),
            "no replacement Running after 90 s; last: {v}\n{}",
            c.server_log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The guest's boot on the replacement (reported apart from the recovery): time from the
/// replacement Running until its serial log shows the boot marker.
fn boot_after(c: &Cluster, p: &Poller, name: &str) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let uid = p.vmi(name)?["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let log = c.agent_dir().join("vmis").join(uid).join("serial.log");
    c.wait_until("the replacement's guest booted", BOOT, || {
        let text = std::fs::read(&log).unwrap_or_default();
        Ok(String::from_utf8_lossy(&text)
            .contains("FERROVIRT-BOOT")
            .then_some(()))
    })?;
    Ok(t.elapsed())
}

fn report(mode: &str, r: &Recovery, boot: Duration) {
    eprintln!(
        "FENCING {mode}: old QEMU gone after {:.2}s, replacement VMI after {:.2}s, Running on {} \
         after {:.2}s (goal {}s); guest boot {:.2}s more",
        r.fenced.as_secs_f64(),
        r.replaced.as_secs_f64(),
        r.node,
        r.running.as_secs_f64(),
        recovery_goal().as_secs(),
        boot.as_secs_f64()
    );
}

/// How the old VMI's launcher ended (its `exit.json`).
fn exit_reason(c: &Cluster, uid: &str) -> Option<Value> {
    let p = c
        .extra_agent_dir("node2")
        .join("vmis")
        .join(uid)
        .join("exit.json");
    serde_json::from_slice(&std::fs::read(p).ok()?).ok()
}

#[test]
fn hung_agent_fences_movable_vms_keeps_local_ones_and_cleans_up_when_back() -> anyhow::Result<()> {
    let c = two_nodes()?;
    claim(&c, "mover", true)?;
    claim(&c, "local", false)?;
    c.apply(&vm("mover", "mover"))?;
    c.apply(&vm("local", "local"))?;
    let uid = running_on_node2(&c, "mover")?;
    let local_uid = running_on_node2(&c, "local")?;
    let pid = qemu_pid(&c, &uid).expect("the mover's QEMU");
    let local_pid = qemu_pid(&c, &local_uid).expect("the local VM's QEMU");
    let v = c.get_json(&["vmi", "mover"])?;
    assert_eq!(
        v["metadata"]["annotations"]["ferrovirt.io/fencing"],
        "enabled"
    );
    let v = c.get_json(&["vmi", "local"])?;
    assert_eq!(
        v["metadata"]["annotations"]["ferrovirt.io/fencing"],
        "disabled"
    );
    c.kubectl_ok(&["taint", "node", "node1", "hold-"])?;
    let poller = Poller::new(&c)?;

    // node2's agent hangs; its launchers and QEMUs keep running.
    let agent = c.agent_pid("node2").expect("node2's agent");
    signal(agent, "STOP");
    let t0 = Instant::now();
    let r = watch_recovery(&c, &poller, "mover", &uid, pid, t0);
    if r.is_err() {
        signal(agent, "CONT");
    }
    let r = r?;
    let boot = boot_after(&c, &poller, "mover")?;
    report("agent SIGSTOP", &r, boot);
    assert!(r.running < recovery_goal(), "recovery took {:?}", r.running);
    let exit = exit_reason(&c, &uid).expect("the fenced launcher's exit report");
    assert_eq!(exit["reason"], "Fenced", "{exit}");
    // The Fenced event on the old VMI says when and why.
    let events = c.get_json(&[
        "events",
        "--field-selector",
        &format!("involvedObject.uid={uid}"),
    ])?;
    let fenced_event = events["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["reason"] == "Fenced")
        .map(|e| e["message"].as_str().unwrap_or_default().to_string())
        .unwrap_or_default();
    assert!(fenced_event.contains("stopped QEMU by"), "{events}");
    // The node itself: NodeUnresponsive, with its timeline.
    let node_events = c.get_json(&[
        "events",
        "-A",
        "--field-selector",
        "involvedObject.name=node2",
    ])?;
    assert!(
        node_events["items"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|e| e["reason"] == "NodeUnresponsive"
                && e["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("self-fencing"))),
        "{node_events}"
    );
    // The VM says why it replaced the VMI.
    let vm_events = c.get_json(&[
        "events",
        "--field-selector",
        "involvedObject.kind=VirtualMachine,involvedObject.name=mover",
    ])?;
    assert!(
        vm_events["items"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|e| e["message"]
                .as_str()
                .is_some_and(|m| m.contains("reason: NodeUnresponsive"))),
        "{vm_events}"
    );

    // The node-local VM on the hung node: still running, Unknown, never replaced.
    let unknown = c.wait_until("the local VMI Unknown", Duration::from_secs(30), || {
        let v = c.get_json(&["vmi", "local"])?;
        assert_eq!(
            v["metadata"]["uid"],
            local_uid.as_str(),
            "local VMI replaced"
        );
        Ok((v["status"]["phase"] == "Unknown").then_some(v))
    })?;
    assert_eq!(unknown["status"]["reason"], "NodeUnresponsive");
    assert!(alive(local_pid), "the node-local VM was stopped");

    // The agent comes back: the fenced VM is cleaned up and never restarted; the local VM is
    // Running again, the same process.
    signal(agent, "CONT");
    let old_dir = c.extra_agent_dir("node2").join("vmis").join(&uid);
    c.wait_until(
        "the fenced VMI's directory cleaned up",
        Duration::from_secs(30),
        || {
            assert_eq!(qemu_pid(&c, &uid), None, "the fenced VM was restarted");
            Ok((!old_dir.exists()).then_some(()))
        },
    )?;
    c.wait_until(
        "the local VMI Running again",
        Duration::from_secs(30),
        || {
            let v = c.get_json(&["vmi", "local"])?;
            Ok((v["status"]["phase"] == "Running").then_some(()))
        },
    )?;
    assert_eq!(qemu_pid(&c, &local_uid), Some(local_pid));
    let v = c.get_json(&["vmi", "mover"])?;
    assert_eq!(v["status"]["nodeName"], r.node.as_str());
    assert_ne!(v["metadata"]["uid"], uid.as_str());
    assert_eq!(v["status"]["phase"], "Running");
    assert_eq!(qemu_pid(&c, &uid), None);
    Ok(())
}

#[test]
fn dead_agent_fences_its_vms_before_they_are_replaced() -> anyhow::Result<()> {
    let c = two_nodes()?;
    let volume = claim(&c, "mover", true)?;
    c.apply(&vm("mover", "mover"))?;
    let uid = running_on_node2(&c, "mover")?;
    let pid = qemu_pid(&c, &uid).expect("the mover's QEMU");
    // The shared disk's storage lease names its holder.
    let lease = || -> Value {
        serde_json::from_slice(&std::fs::read(volume.join(".ferrovirt-lease")).unwrap_or_default())
            .unwrap_or(Value::Null)
    };
    assert_eq!(lease()["node"], "node2");
    assert_eq!(lease()["vmiUid"], uid.as_str());
    c.kubectl_ok(&["taint", "node", "node1", "hold-"])?;
    let poller = Poller::new(&c)?;
    // kill -9 of the agent alone, never restarted: the launcher and QEMU keep running.
    let agent = c.agent_pid("node2").expect("node2's agent");
    signal(agent, "KILL");
    let t0 = Instant::now();
    let r = watch_recovery(&c, &poller, "mover", &uid, pid, t0)?;
    let boot = boot_after(&c, &poller, "mover")?;
    report("agent kill -9", &r, boot);
    // The replacement holds the storage lease now.
    assert_eq!(lease()["node"], r.node.as_str());
    assert_ne!(lease()["vmiUid"], uid.as_str());
    assert!(r.running < recovery_goal(), "recovery took {:?}", r.running);
    let exit = exit_reason(&c, &uid).expect("the fenced launcher's exit report");
    assert_eq!(exit["reason"], "Fenced", "{exit}");
    Ok(())
}

#[test]
fn node_cut_off_from_the_api_server_fences_its_vms_before_they_are_replaced() -> anyhow::Result<()>
{
    let (c, cut) = two_nodes_with_cut_off(true)?;
    let cut = cut.expect("a cut-off node");
    claim(&c, "mover", true)?;
    c.apply(&vm("mover", "mover"))?;
    let uid = running_on_node2(&c, "mover")?;
    let pid = qemu_pid(&c, &uid).expect("the mover's QEMU");
    c.kubectl_ok(&["taint", "node", "node1", "hold-"])?;
    let poller = Poller::new(&c)?;
    // The link drops: agent, launcher and QEMU keep running, the API server is out of reach.
    cut.cut()?;
    let t0 = Instant::now();
    let r = watch_recovery(&c, &poller, "mover", &uid, pid, t0)?;
    let boot = boot_after(&c, &poller, "mover")?;
    report("node cut off", &r, boot);
    assert!(r.running < recovery_goal(), "recovery took {:?}", r.running);
    let exit = exit_reason(&c, &uid).expect("the fenced launcher's exit report");
    assert_eq!(exit["reason"], "Fenced", "{exit}");
    // The agent is alive and still cut off: it renews nothing, and restarts nothing.
    let agent = c.agent_pid("node2").expect("node2's agent");
    assert!(alive(agent), "the cut-off agent died");
    assert_eq!(qemu_pid(&c, &uid), None);
    Ok(())
}
