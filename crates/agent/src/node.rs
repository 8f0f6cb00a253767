//! The agent's Node: host facts (CPUs, memory, CPU model and flags, KVM usability) gathered from
//! /proc, the pure construction of the Node object and its coordination.k8s.io Lease, and the
//! Node status report (the decision [`status_report`], pure; [`report_status`], the GET and the
//! write, [`report_status_of`], the write alone for a Node already read, and
//! [`report_status_cached`], from [`watch_own`]'s cache, which the agent and the simulated
//! nodes of the scale benchmark both make).

use std::collections::BTreeMap;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{
    Node, NodeAddress, NodeCondition, NodeSpec, NodeStatus, NodeSystemInfo,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;

use ferrovirt_launcher::spec::Accel;

/// Label naming the accelerator QEMU uses on this node.
pub const ACCEL_LABEL: &str = "ferrovirt.io/accel";
/// Annotation with the agent's endpoint URL (`https://host:port`, see [`crate::endpoint`]).
pub const ENDPOINT_ANNOTATION: &str = "ferrovirt.io/agent-endpoint";
/// Annotation with the SHA-256 (hex) of the endpoint's certificate, which the API server pins
/// ([`crate::tls`]). Written with the agent's own API credentials, like the URL.
pub const FINGERPRINT_ANNOTATION: &str = "ferrovirt.io/agent-endpoint-sha256";
/// Namespace of node heartbeat leases, as in Kubernetes.
pub const LEASE_NAMESPACE: &str = "kube-node-lease";
/// The KVM device resource KubeVirt advertises.
pub const KVM_RESOURCE: &str = "devices.kubevirt.io/kvm";

/// What the agent knows about its host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFacts {
    pub hostname: String,
    pub cpus: u32,
    pub memory_bytes: u64,
    pub cpu_model: String,
    pub cpu_flags: Vec<String>,
    pub accel: Accel,
    pub kernel_version: String,
    pub os_image: String,
    pub address: String,
}

impl HostFacts {
    /// Reads the facts from /proc and /etc.
    pub fn gather(accel: Accel, address: &str) -> HostFacts {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let os_release = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
        let (cpus, cpu_model, cpu_flags) = parse_cpuinfo(&cpuinfo);
        HostFacts {
            hostname: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| "localhost".into()),
            cpus: cpus.max(1),
            memory_bytes: parse_meminfo_total(&meminfo),
            cpu_model,
            cpu_flags,
            accel,
            kernel_version: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
            os_image: os_release
                .lines()
                .find_map(|l| l.strip_prefix("PRETTY_NAME="))
                .map(|s| s.trim_matches('"').to_string())
                .unwrap_or_else(|| "Linux".into()),
            address: address.to_string(),
        }
    }
}

/// (processor count, model name, flags) from /proc/cpuinfo.
pub fn parse_cpuinfo(text: &str) -> (u32, String, Vec<String>) {
    let mut count = 0;
    let mut model = String::new();
    let mut flags = Vec::new();
    for line in text.lines() {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        match k.trim() {
            "processor" => count += 1,
            "model name" if model.is_empty() => model = v.trim().to_string(),
            "flags" if flags.is_empty() => {
                flags = v.split_whitespace().map(str::to_string).collect();
            }
            _ => {}
        }
    }
    (count, model, flags)
}

/// MemTotal from /proc/meminfo, in bytes.
pub fn parse_meminfo_total(text: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// A label-safe form of a CPU model name ("Intel(R) Xeon(R) ..." → "Intel-R-Xeon-R-...").
pub fn label_value(s: &str) -> String {
    let mut out: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect();
    while out.contains("--") {
        out = out.replace("--", "-");
    }
    out.trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .chars()
        .take(63)
        .collect::<String>()
        .trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_string()
}

/// Flags worth a `cpu-feature.node.kubevirt.io/<flag>=true` label.
const FEATURE_FLAGS: &[&str] = &[
    "aes",
    "avx",
    "avx2",
    "avx512f",
    "sse4_1",
    "sse4_2",
    "ssse3",
    "vmx",
    "svm",
    "x2apic",
    "rdrand",
    "pdpe1gb",
    "hypervisor",
];

/// Memory the agent keeps back from the VMs (host OS, agent, launchers).
pub const SYSTEM_RESERVED_BYTES: u64 = 512 * 1024 * 1024;

/// The Node object this agent registers (labels, capacity/allocatable, conditions, addresses,
/// and the endpoint's URL and certificate `fingerprint` as annotations).
pub fn node_object(
    name: &str,
    facts: &HostFacts,
    endpoint: &str,
    fingerprint: &str,
    now: Timestamp,
) -> Node {
    let mut labels = BTreeMap::new();
    labels.insert("kubernetes.io/hostname".to_string(), name.to_string());
    labels.insert("kubernetes.io/os".to_string(), "linux".to_string());
    labels.insert("kubernetes.io/arch".to_string(), "amd64".to_string());
    labels.insert("kubevirt.io/schedulable".to_string(), "true".to_string());
    labels.insert(ACCEL_LABEL.to_string(), facts.accel.to_string());
    if !facts.cpu_model.is_empty() {
        labels.insert(
            "host-model-cpu.node.kubevirt.io/".to_string() + &label_value(&facts.cpu_model),
            "true".to_string(),
        );
    }
    for f in FEATURE_FLAGS {
        if facts.cpu_flags.iter().any(|x| x == f) {
            labels.insert(
                format!("cpu-feature.node.kubevirt.io/{f}"),
                "true".to_string(),
            );
        }
    }
    let mut annotations = BTreeMap::new();
    annotations.insert(ENDPOINT_ANNOTATION.to_string(), endpoint.to_string());
    annotations.insert(FINGERPRINT_ANNOTATION.to_string(), fingerprint.to_string());

    let mut capacity = BTreeMap::new();
    capacity.insert("cpu".to_string(), Quantity(facts.cpus.to_string()));
    capacity.insert(
        "memory".to_string(),
        Quantity(format!("{}Ki", facts.memory_bytes / 1024)),
    );
    capacity.insert("pods".to_string(), Quantity("110".into()));
    let kvm = if facts.accel == Accel::Kvm { "1k" } else { "0" };
    capacity.insert(KVM_RESOURCE.to_string(), Quantity(kvm.into()));
    let mut allocatable = capacity.clone();
    allocatable.insert(
        "memory".to_string(),
        Quantity(format!(
            "{}Ki",
            facts.memory_bytes.saturating_sub(SYSTEM_RESERVED_BYTES) / 1024
        )),
    );

    Node {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: Some(labels),
            annotations: Some(annotations),
            ..Default::default()
        },
        spec: Some(NodeSpec::default()),
        status: Some(NodeStatus {
            capacity: Some(capacity),
            allocatable: Some(allocatable),
            conditions: Some(vec![ready_condition(now)]),
            addresses: Some(vec![
                NodeAddress {
                    type_: "InternalIP".into(),
                    address: facts.address.clone(),
                },
                NodeAddress {
                    type_: "Hostname".into(),
                    address: facts.hostname.clone(),
                },
            ]),
            node_info: Some(NodeSystemInfo {
                architecture: "amd64".into(),
                kernel_version: facts.kernel_version.clone(),
                os_image: facts.os_image.clone(),
                operating_system: "linux".into(),
                kubelet_version: format!("ferrovirt-{}", env!("CARGO_PKG_VERSION")),
                container_runtime_version: format!("qemu ({})", facts.accel),
                ..Default::default()
            }),
            ..Default::default()
        }),
    }
}

/// The agent's Ready condition as it reports it at `now`.
pub fn ready_condition(now: Timestamp) -> NodeCondition {
    NodeCondition {
        type_: "Ready".into(),
        status: "True".into(),
        reason: Some("AgentReady".into()),
        message: Some("ferrovirt agent is posting ready status".into()),
        last_heartbeat_time: Some(Time(now)),
        last_transition_time: Some(Time(now)),
    }
}

/// How often the agent reports its Node's conditions when none of them changed: Kubernetes'
/// `nodeStatusReportFrequency` default (5 minutes). Liveness is the Lease's business (renewed
/// every few seconds); a Node status write wakes every Node watcher (the scheduler, the node
/// lifecycle, evacuation, every agent's and controller's Node cache), so an unchanged status
/// is not rewritten every few seconds just to move `lastHeartbeatTime`.
pub const STATUS_REPORT_EVERY: std::time::Duration = std::time::Duration::from_secs(300);

/// The conditions to write on the Node, given those it shows (`current`) and those the agent
/// reports now (`desired`, as [`ready_condition`] builds them), or `None` when nothing is due
/// (pure). Due when a condition's type set, status, reason or message differs (another
/// writer, such as the node lifecycle marking Ready Unknown after a missed Lease, counts), or
/// when Ready's `lastHeartbeatTime` on the Node is [`STATUS_REPORT_EVERY`] old. A condition
/// whose status did not change keeps its `lastTransitionTime`.
pub fn status_report(
    current: &[NodeCondition],
    mut desired: Vec<NodeCondition>,
    now: Timestamp,
) -> Option<Vec<NodeCondition>> {
    let mut changed = current.len() != desired.len();
    for d in &mut desired {
        d.last_heartbeat_time = Some(Time(now));
        let Some(c) = current.iter().find(|c| c.type_ == d.type_) else {
            changed = true;
            d.last_transition_time = Some(Time(now));
            continue;
        };
        if c.status == d.status {
            d.last_transition_time = c.last_transition_time.clone();
        } else {
            d.last_transition_time = Some(Time(now));
        }
        changed |= c.status != d.status || c.reason != d.reason || c.message != d.message;
    }
    let reported = current
        .iter()
        .find(|c| c.type_ == "Ready")
        .and_then(|c| c.last_heartbeat_time.as_ref())
        .map(|t| t.0);
    let due = reported
        .is_none_or(|t| now.duration_since(t).as_secs_f64() >= STATUS_REPORT_EVERY.as_secs_f64());
    (changed || due).then_some(desired)
}

/// Reads Node `name`'s conditions and writes `desired` (built at `now`) when
/// [`status_report`] says it is due: one GET, and a status merge patch only then. A Node that
/// is not there is left alone.
pub async fn report_status(
    nodes: &kube::Api<Node>,
    name: &str,
    desired: Vec<NodeCondition>,
    now: Timestamp,
) -> Result<(), kube::Error> {
    match nodes.get_opt(name).await? {
        Some(node) => report_status_of(nodes, &node, desired, now).await,
        None => Ok(()),
    }
}

/// [`report_status`] for a Node already read (from [`watch_own`]'s cache): no GET, a status
/// merge patch only when [`status_report`] says it is due.
pub async fn report_status_of(
    nodes: &kube::Api<Node>,
    node: &Node,
    desired: Vec<NodeCondition>,
    now: Timestamp,
) -> Result<(), kube::Error> {
    let Some(name) = node.metadata.name.as_deref() else {
        return Ok(());
    };
    let current = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    let Some(conditions) = status_report(current, desired, now) else {
        return Ok(());
    };
    let st = serde_json::json!({"status": {"conditions": conditions}});
    nodes
        .patch_status(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&st),
        )
        .await?;
    Ok(())
}

/// The field selector of a watch of Node `name` alone.
pub fn own_node_selector(name: &str) -> String {
    format!("metadata.name={name}")
}

/// A cache of Node `name` alone, kept by a watch with [`own_node_selector`] (kube-rs's
/// reflector, with its default backoff), and the future that keeps it (runs until dropped).
/// The status report reads the Node from it: no GET every look, and another writer's change
/// (the node lifecycle's Ready=Unknown) is in the cache as soon as it is made.
pub fn watch_own(
    nodes: kube::Api<Node>,
    name: &str,
) -> (
    kube::runtime::reflector::Store<Node>,
    impl std::future::Future<Output = ()> + Send + 'static,
) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, reflector, watcher};
    let (store, writer) = reflector::store();
    let cfg = watcher::Config::default().fields(&own_node_selector(name));
    let keep = async move {
        let mut events = std::pin::pin!(reflector(writer, watcher(nodes, cfg)).default_backoff());
        while let Some(ev) = events.next().await {
            if let Err(e) = ev {
                tracing::debug!("watching the node's own Node: {e}");
            }
        }
    };
    (store, keep)
}

/// [`report_status_of`] for Node `name` as [`watch_own`]'s cache `own` holds it, or
/// [`report_status`] (a GET) while the cache has no such Node (before its first list).
pub async fn report_status_cached(
    nodes: &kube::Api<Node>,
    own: &kube::runtime::reflector::Store<Node>,
    name: &str,
    desired: Vec<NodeCondition>,
    now: Timestamp,
) -> Result<(), kube::Error> {
    match own.get(&kube::runtime::reflector::ObjectRef::new(name)) {
        Some(node) => report_status_of(nodes, &node, desired, now).await,
        None => report_status(nodes, name, desired, now).await,
    }
}

/// The node's heartbeat Lease (namespace `kube-node-lease`, named after the node).
pub fn lease_object(node: &str, duration_seconds: i32, now: Timestamp) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(node.to_string()),
            namespace: Some(LEASE_NAMESPACE.to_string()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node.to_string()),
            lease_duration_seconds: Some(duration_seconds),
            renew_time: Some(MicroTime(now)),
            ..Default::default()
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> HostFacts {
        HostFacts {
            hostname: "h1".into(),
            cpus: 2,
            memory_bytes: 4 << 30,
            cpu_model: "Intel(R) Xeon(R) CPU @ 2.20GHz".into(),
            cpu_flags: vec!["sse4_2".into(), "avx2".into(), "hypervisor".into()],
            accel: Accel::Tcg,
            kernel_version: "6.1".into(),
            os_image: "Debian".into(),
            address: "127.0.0.1".into(),
        }
    }

    #[test]
    fn node_status_is_reported_on_change_or_every_five_minutes() {
        let t0: Timestamp = "2026-12-05T10:00:00Z".parse().unwrap();
        let at = |secs: i64| t0 + jiff::SignedDuration::from_secs(secs);
        // Nothing on the Node yet: reported.
        let first = status_report(&[], vec![ready_condition(t0)], t0).unwrap();
        assert_eq!(first[0].last_transition_time, Some(Time(t0)));
        // Unchanged 10 s later: nothing to write.
        assert_eq!(
            status_report(&first, vec![ready_condition(at(10))], at(10)),
            None
        );
        // Unchanged for five minutes: reported, the heartbeat moves, the transition does not.
        let again = status_report(&first, vec![ready_condition(at(300))], at(300)).unwrap();
        assert_eq!(again[0].last_heartbeat_time, Some(Time(at(300))));
        assert_eq!(again[0].last_transition_time, Some(Time(t0)));
        // Another writer marked it Unknown (a missed Lease): reported at once, a transition.
        let mut unknown = first.clone();
        unknown[0].status = "Unknown".into();
        unknown[0].reason = Some("NodeStatusUnknown".into());
        let back = status_report(&unknown, vec![ready_condition(at(20))], at(20)).unwrap();
        assert_eq!(back[0].status, "True");
        assert_eq!(back[0].last_transition_time, Some(Time(at(20))));
        // A new condition (or one fewer) is a change.
        let mut two = vec![ready_condition(at(30))];
        two.push(NodeCondition {
            type_: "SharedMountsReady".into(),
            status: "False".into(),
            ..Default::default()
        });
        assert!(status_report(&first, two.clone(), at(30)).is_some());
        let both = status_report(&first, two, at(30)).unwrap();
        assert!(status_report(&both, vec![ready_condition(at(40))], at(40)).is_some());
        // A changed message alone is reported, keeping the transition time.
        let mut msg = vec![ready_condition(at(50))];
        msg[0].message = Some("other".into());
        let m = status_report(&first, msg, at(50)).unwrap();
        assert_eq!(m[0].last_transition_time, Some(Time(t0)));
    }

    #[test]
    fn cpuinfo_and_meminfo() {
        let (n, model, flags) = parse_cpuinfo(
            "processor\t: 0\nmodel name\t: Foo CPU\nflags\t\t: fpu sse\nprocessor\t: 1\nmodel name\t: Foo CPU\n",
        );
        assert_eq!((n, model.as_str()), (2, "Foo CPU"));
        assert_eq!(flags, vec!["fpu", "sse"]);
        assert_eq!(
            parse_meminfo_total("MemTotal:       1024 kB\nMemFree: 1 kB\n"),
            1 << 20
        );
    }

    #[test]
    fn label_values_are_valid() {
        assert_eq!(
            label_value("Intel(R) Xeon(R) CPU @ 2.20GHz"),
            "Intel-R-Xeon-R-CPU-2.20GHz"
        );
        assert!(label_value(&"x".repeat(100)).len() <= 63);
    }

    #[test]
    fn node_has_labels_capacity_and_ready() {
        let now = Timestamp::from_second(1_700_000_000).unwrap();
        let n = node_object("node-a", &facts(), "https://127.0.0.1:1", "ab12", now);
        let annotations = n.metadata.annotations.as_ref().unwrap();
        assert_eq!(annotations[ENDPOINT_ANNOTATION], "https://127.0.0.1:1");
        assert_eq!(annotations[FINGERPRINT_ANNOTATION], "ab12");
        let labels = n.metadata.labels.as_ref().unwrap();
        assert_eq!(labels["kubernetes.io/hostname"], "node-a");
        assert_eq!(labels["kubevirt.io/schedulable"], "true");
        assert_eq!(labels[ACCEL_LABEL], "tcg");
        assert_eq!(labels["cpu-feature.node.kubevirt.io/avx2"], "true");
        let st = n.status.unwrap();
        assert_eq!(st.capacity.as_ref().unwrap()["cpu"].0, "2");
        assert_eq!(st.capacity.as_ref().unwrap()[KVM_RESOURCE].0, "0");
        assert_eq!(
            st.allocatable.as_ref().unwrap()["memory"].0,
            format!("{}Ki", ((4u64 << 30) - SYSTEM_RESERVED_BYTES) / 1024)
        );
        assert_eq!(st.conditions.unwrap()[0].status, "True");
        let l = lease_object("node-a", 15, now);
        assert_eq!(l.spec.unwrap().lease_duration_seconds, Some(15));
    }
}
