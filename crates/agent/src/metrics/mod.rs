//! VMI metrics served by each node agent at `/metrics` on its endpoint (docs/metrics.md):
//! KubeVirt's `kubevirt_vmi_*` names and labels, rendered in the Prometheus text format by
//! the `prometheus-client` crate. What one VMI contributes is a [`VmiSample`]; [`render`]
//! turns the samples of a scrape into text (pure); [`collect`] gathers them from the
//! launchers and `/proc`, bounded per launcher; [`parse`] holds the parsers; [`migration`]
//! the series of an outgoing live migration.

#[cfg(test)]
mod bench;
pub mod collect;
pub mod migration;
pub mod parse;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

pub use parse::{DriveStats, GuestMemory, InterfaceStats};

/// The `Content-Type` of [`render`]'s output.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// What KubeVirt writes for an info label it does not know.
pub const NONE: &str = "<none>";

/// The extra labels of `kubevirt_vmi_info`, in order, and the VMI annotations they are read
/// from (first present wins), as KubeVirt reads them: the template's `vm.kubevirt.io/*`
/// annotations and the instancetype/preference names.
pub const INFO_LABELS: [(&str, &[&str]); 5] = [
    ("os", &["vm.kubevirt.io/os"]),
    ("workload", &["vm.kubevirt.io/workload"]),
    ("flavor", &["vm.kubevirt.io/flavor"]),
    (
        "instance_type",
        &[
            "kubevirt.io/instancetype-name",
            "kubevirt.io/cluster-instancetype-name",
        ],
    ),
    (
        "preference",
        &[
            "kubevirt.io/preference-name",
            "kubevirt.io/cluster-preference-name",
        ],
    ),
];

/// The `kubevirt_vmi_info` labels known from a VMI's annotations (absent ones are left out
/// and rendered `<none>`).
pub fn info_labels(
    annotations: &std::collections::BTreeMap<String, String>,
) -> std::collections::BTreeMap<String, String> {
    INFO_LABELS
        .iter()
        .filter_map(|(label, keys)| {
            let v = keys
                .iter()
                .find_map(|k| annotations.get(*k).filter(|v| !v.is_empty()))?;
            Some((label.to_string(), v.clone()))
        })
        .collect()
}

/// QEMU's own process: CPU time, resident memory, per-vCPU thread time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProcessSample {
    /// User plus system seconds of the whole QEMU process (all threads).
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    /// (vCPU index, seconds) of the vCPU threads.
    pub vcpu_seconds: Vec<(u32, f64)>,
}

/// One VMI's contribution to a scrape.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VmiSample {
    pub name: String,
    pub namespace: String,
    /// KubeVirt's VMI phase, lower case (`running`, `scheduled`, `succeeded`).
    pub phase: String,
    /// `kubevirt_vmi_info` labels known for this VMI ([`info_labels`]).
    pub info: std::collections::BTreeMap<String, String>,
    /// Guest memory size.
    pub domain_bytes: Option<u64>,
    /// Absent when QEMU's pid is unknown or its `/proc` entry is gone.
    pub process: Option<ProcessSample>,
    /// Absent drives when the launcher did not answer the stats request.
    pub drives: Vec<DriveStats>,
    /// The tap-backed interfaces (none on QEMU user networking).
    pub interfaces: Vec<InterfaceStats>,
    /// The guest's memory from its balloon driver (absent without one, or before it reports).
    pub guest_memory: Option<GuestMemory>,
    /// The outgoing migration under way (source node only), from QMP `query-migrate`.
    pub migration: Option<migration::MigrationSample>,
    /// What a block migration's disk mirrors copy per second (source node, while they run).
    pub disk_transfer_rate: Option<f64>,
}

/// KubeVirt's VMI phase (lower case, as in `kubevirt_vmi_info`) for a launcher's run phase:
/// a paused or shutting-down VMI is still Running, one whose QEMU has not started yet is
/// Scheduled.
pub fn phase_label(phase: ferrovirt_launcher::control::RunPhase) -> &'static str {
    use ferrovirt_launcher::control::RunPhase::*;
    match phase {
        Starting => "scheduled",
        Running | Paused | ShuttingDown => "running",
        Exited => "succeeded",
    }
}

type Labels = Vec<(&'static str, String)>;
type FloatCounter = Counter<f64, std::sync::atomic::AtomicU64>;
/// A per-drive series: name (without `_total`), help, the counter it reads.
type DriveSeries = (&'static str, &'static str, fn(&DriveStats) -> u64);
/// What a guest memory series reads (None: the guest does not give it).
type GuestRead = fn(&GuestMemory) -> Option<u64>;
/// A per-interface series: name (without `_total`), help, the counter it reads.
type NetSeries = (&'static str, &'static str, fn(&InterfaceStats) -> u64);

const NET: [NetSeries; 8] = [
    (
        "kubevirt_vmi_network_receive_bytes",
        "Total network traffic received in bytes.",
        |i| i.receive_bytes,
    ),
    (
        "kubevirt_vmi_network_transmit_bytes",
        "Total network traffic transmitted in bytes.",
        |i| i.transmit_bytes,
    ),
    (
        "kubevirt_vmi_network_receive_packets",
        "Total network traffic received packets.",
        |i| i.receive_packets,
    ),
    (
        "kubevirt_vmi_network_transmit_packets",
        "Total network traffic transmitted packets.",
        |i| i.transmit_packets,
    ),
    (
        "kubevirt_vmi_network_receive_errors",
        "Total network received error packets.",
        |i| i.receive_errors,
    ),
    (
        "kubevirt_vmi_network_transmit_errors",
        "Total network transmitted error packets.",
        |i| i.transmit_errors,
    ),
    (
        "kubevirt_vmi_network_receive_packets_dropped",
        "The total number of rx packets dropped on vNIC interfaces.",
        |i| i.receive_dropped,
    ),
    (
        "kubevirt_vmi_network_transmit_packets_dropped",
        "The total number of tx packets dropped on vNIC interfaces.",
        |i| i.transmit_dropped,
    ),
];

/// A family registered under `name` (counters get `_total` appended by the encoder).
fn family<M: Default>(reg: &mut Registry, name: &str, help: &str) -> Family<Labels, M>
where
    Family<Labels, M>: prometheus_client::registry::Metric + Clone,
{
    let f = Family::<Labels, M>::default();
    reg.register(name, help, f.clone());
    f
}

/// The scrape's text: every series of `vmis` on node `node`.
pub fn render(node: &str, vmis: &[VmiSample]) -> String {
    let mut reg = Registry::default();
    let info = family::<Gauge>(
        &mut reg,
        "kubevirt_vmi_info",
        "Information about VirtualMachineInstances.",
    );
    let cpu = family::<FloatCounter>(
        &mut reg,
        "kubevirt_vmi_cpu_usage_seconds",
        "Total CPU time spent in all modes (sum of both vcpu and hypervisor usage).",
    );
    let vcpu = family::<FloatCounter>(
        &mut reg,
        "kubevirt_vmi_vcpu_seconds",
        "Total amount of time spent in each state by each vcpu.",
    );
    let rss = family::<Gauge>(
        &mut reg,
        "kubevirt_vmi_memory_resident_bytes",
        "Resident set size of the process running the domain.",
    );
    let domain = family::<Gauge>(
        &mut reg,
        "kubevirt_vmi_memory_domain_bytes",
        "The amount of memory in bytes allocated to the domain.",
    );
    let guest_gauges: Vec<(Family<Labels, Gauge>, GuestRead)> = [
        (
            "kubevirt_vmi_memory_available_bytes",
            "Amount of usable memory as seen by the domain.",
            (|m| m.total) as GuestRead,
        ),
        (
            "kubevirt_vmi_memory_usable_bytes",
            "The amount of memory which can be reclaimed by balloon without pushing the guest \
             system to swap, corresponds to 'Available' in /proc/meminfo.",
            |m| m.available,
        ),
        (
            "kubevirt_vmi_memory_unused_bytes",
            "The amount of memory left completely unused by the system.",
            |m| m.free,
        ),
        (
            "kubevirt_vmi_memory_cached_bytes",
            "The amount of memory that is being used to cache I/O and is available to be \
             reclaimed.",
            |m| m.cached,
        ),
        (
            "kubevirt_vmi_memory_swap_in_traffic_bytes",
            "The total amount of data read from swap space of the guest in bytes.",
            |m| m.swap_in,
        ),
        (
            "kubevirt_vmi_memory_swap_out_traffic_bytes",
            "The total amount of memory written out to swap space of the guest in bytes.",
            |m| m.swap_out,
        ),
        (
            "kubevirt_vmi_memory_actual_balloon_bytes",
            "Current balloon size in bytes.",
            |m| m.balloon_actual,
        ),
    ]
    .into_iter()
    .map(|(name, help, get)| (family::<Gauge>(&mut reg, name, help), get))
    .collect();
    let guest_counters: Vec<(Family<Labels, Counter>, GuestRead)> = [
        (
            "kubevirt_vmi_memory_pgmajfault",
            "The number of page faults when disk IO was required.",
            (|m| m.major_faults) as GuestRead,
        ),
        (
            "kubevirt_vmi_memory_pgminfault",
            "The number of other page faults, when disk IO was not required.",
            |m| m.minor_faults,
        ),
    ]
    .into_iter()
    .map(|(name, help, get)| (family::<Counter>(&mut reg, name, help), get))
    .collect();
    let counters: [DriveSeries; 5] = [
        (
            "kubevirt_vmi_storage_read_traffic_bytes",
            "Storage read traffic in bytes.",
            |d| d.read_bytes,
        ),
        (
            "kubevirt_vmi_storage_write_traffic_bytes",
            "Storage write traffic in bytes.",
            |d| d.write_bytes,
        ),
        (
            "kubevirt_vmi_storage_iops_read",
            "Storage read operations.",
            |d| d.read_ops,
        ),
        (
            "kubevirt_vmi_storage_iops_write",
            "Storage write operations.",
            |d| d.write_ops,
        ),
        (
            "kubevirt_vmi_storage_flush_requests",
            "Storage flush requests.",
            |d| d.flush_ops,
        ),
    ];
    let drive_counters: Vec<_> = counters
        .iter()
        .map(|(name, help, get)| (family::<Counter>(&mut reg, name, help), *get))
        .collect();
    let times: [DriveSeries; 3] = [
        (
            "kubevirt_vmi_storage_read_times_seconds",
            "Storage read operation time.",
            |d| d.read_time_ns,
        ),
        (
            "kubevirt_vmi_storage_write_times_seconds",
            "Storage write operation time.",
            |d| d.write_time_ns,
        ),
        (
            "kubevirt_vmi_storage_flush_times_seconds",
            "Total time spent on cache flushing.",
            |d| d.flush_time_ns,
        ),
    ];
    let net: Vec<_> = NET
        .iter()
        .map(|(name, help, get)| (family::<Counter>(&mut reg, name, help), *get))
        .collect();
    let drive_times: Vec<_> = times
        .iter()
        .map(|(name, help, get)| (family::<FloatCounter>(&mut reg, name, help), *get))
        .collect();

    let migrations = migration::Families::register(&mut reg);

    for v in vmis {
        let base: Labels = vec![
            ("name", v.name.clone()),
            ("namespace", v.namespace.clone()),
            ("node", node.to_string()),
        ];
        let with = |extra: &[(&'static str, String)]| -> Labels {
            let mut l = base.clone();
            l.extend_from_slice(extra);
            l
        };
        let mut info_set = vec![("phase", v.phase.clone())];
        for (label, _) in INFO_LABELS {
            let value = v.info.get(label).cloned();
            info_set.push((label, value.unwrap_or_else(|| NONE.into())));
        }
        info.get_or_create(&with(&info_set)).set(1);
        if let Some(bytes) = v.domain_bytes {
            domain.get_or_create(&base).set(clamp(bytes));
        }
        if let Some(p) = &v.process {
            cpu.get_or_create(&base).inc_by(p.cpu_seconds);
            rss.get_or_create(&base).set(clamp(p.resident_bytes));
            for (id, secs) in &p.vcpu_seconds {
                vcpu.get_or_create(&with(&[
                    ("id", id.to_string()),
                    ("state", "running".into()),
                ]))
                .inc_by(*secs);
            }
        }
        for d in &v.drives {
            let labels = with(&[("drive", d.drive.clone())]);
            for (fam, get) in &drive_counters {
                fam.get_or_create(&labels).inc_by(get(d));
            }
            for (fam, get) in &drive_times {
                fam.get_or_create(&labels).inc_by(get(d) as f64 / 1e9);
            }
        }
        if let Some(m) = &v.guest_memory {
            for (fam, get) in &guest_gauges {
                if let Some(x) = get(m) {
                    fam.get_or_create(&base).set(clamp(x));
                }
            }
            for (fam, get) in &guest_counters {
                if let Some(x) = get(m) {
                    fam.get_or_create(&base).inc_by(x);
                }
            }
        }
        for i in &v.interfaces {
            let labels = with(&[("interface", i.interface.clone())]);
            for (fam, get) in &net {
                fam.get_or_create(&labels).inc_by(get(i));
            }
        }
        if let Some(m) = &v.migration {
            migrations.add(&base, m);
        }
        if let Some(r) = v.disk_transfer_rate {
            migrations.add_disk_rate(&base, r);
        }
    }
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &reg);
    out
}

fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> VmiSample {
        VmiSample {
            name: "vm1".into(),
            namespace: "default".into(),
            phase: "running".into(),
            info: Default::default(),
            domain_bytes: Some(128 << 20),
            process: Some(ProcessSample {
                cpu_seconds: 2.5,
                resident_bytes: 200 << 20,
                vcpu_seconds: vec![(0, 1.25), (1, 0.5)],
            }),
            drives: vec![DriveStats {
                drive: "rootdisk".into(),
                read_bytes: 4096,
                write_bytes: 512,
                read_ops: 3,
                write_ops: 1,
                flush_ops: 1,
                read_time_ns: 1_500_000_000,
                write_time_ns: 0,
                flush_time_ns: 0,
            }],
            interfaces: vec![InterfaceStats {
                interface: "default".into(),
                receive_bytes: 900,
                transmit_packets: 7,
                ..Default::default()
            }],
            guest_memory: Some(GuestMemory {
                total: Some(120 << 20),
                available: Some(90 << 20),
                free: Some(80 << 20),
                minor_faults: Some(3400),
                cached: None,
                ..Default::default()
            }),
            migration: None,
            disk_transfer_rate: None,
        }
    }

    fn lines(text: &str) -> Vec<&str> {
        text.lines().filter(|l| !l.starts_with('#')).collect()
    }

    #[test]
    fn renders_kubevirt_names_and_labels() {
        let text = render("node1", &[sample()]);
        let base = r#"name="vm1",namespace="default",node="node1""#;
        for want in [
            format!(
                r#"kubevirt_vmi_info{{{base},phase="running",os="<none>",workload="<none>",flavor="<none>",instance_type="<none>",preference="<none>"}} 1"#
            ),
            format!("kubevirt_vmi_cpu_usage_seconds_total{{{base}}} 2.5"),
            format!(r#"kubevirt_vmi_vcpu_seconds_total{{{base},id="0",state="running"}} 1.25"#),
            format!(r#"kubevirt_vmi_vcpu_seconds_total{{{base},id="1",state="running"}} 0.5"#),
            format!("kubevirt_vmi_memory_resident_bytes{{{base}}} 209715200"),
            format!("kubevirt_vmi_memory_domain_bytes{{{base}}} 134217728"),
            format!(
                r#"kubevirt_vmi_storage_read_traffic_bytes_total{{{base},drive="rootdisk"}} 4096"#
            ),
            format!(
                r#"kubevirt_vmi_storage_write_traffic_bytes_total{{{base},drive="rootdisk"}} 512"#
            ),
            format!(r#"kubevirt_vmi_storage_iops_read_total{{{base},drive="rootdisk"}} 3"#),
            format!(r#"kubevirt_vmi_storage_iops_write_total{{{base},drive="rootdisk"}} 1"#),
            format!(r#"kubevirt_vmi_storage_flush_requests_total{{{base},drive="rootdisk"}} 1"#),
            format!(
                r#"kubevirt_vmi_storage_read_times_seconds_total{{{base},drive="rootdisk"}} 1.5"#
            ),
            format!(
                r#"kubevirt_vmi_network_receive_bytes_total{{{base},interface="default"}} 900"#
            ),
            format!(
                r#"kubevirt_vmi_network_transmit_packets_total{{{base},interface="default"}} 7"#
            ),
            format!(
                r#"kubevirt_vmi_network_receive_packets_dropped_total{{{base},interface="default"}} 0"#
            ),
            format!("kubevirt_vmi_memory_available_bytes{{{base}}} 125829120"),
            format!("kubevirt_vmi_memory_usable_bytes{{{base}}} 94371840"),
            format!("kubevirt_vmi_memory_unused_bytes{{{base}}} 83886080"),
            format!("kubevirt_vmi_memory_pgminfault_total{{{base}}} 3400"),
        ] {
            assert!(
                lines(&text).contains(&want.as_str()),
                "missing {want} in\n{text}"
            );
        }
        assert!(
            text.contains("# TYPE kubevirt_vmi_cpu_usage_seconds_total counter"),
            "{text}"
        );
        assert!(text.contains("# TYPE kubevirt_vmi_info gauge"), "{text}");
        // A statistic the guest does not give is no series.
        assert!(
            !text.contains(&format!("kubevirt_vmi_memory_cached_bytes{{{base}}}")),
            "{text}"
        );
    }

    #[test]
    fn a_vmi_without_launcher_data_has_only_its_info() {
        let v = VmiSample {
            process: None,
            drives: vec![],
            interfaces: vec![],
            domain_bytes: None,
            guest_memory: None,
            ..sample()
        };
        let text = render("n", &[v]);
        let series = lines(&text);
        assert_eq!(series.len(), 1, "{text}");
        assert!(series[0].starts_with("kubevirt_vmi_info{"), "{text}");
        assert!(lines(&render("n", &[])).is_empty());
    }

    #[test]
    fn info_labels_come_from_annotations() {
        let ann: std::collections::BTreeMap<String, String> = [
            ("vm.kubevirt.io/os", "fedora"),
            ("vm.kubevirt.io/workload", ""),
            ("kubevirt.io/cluster-instancetype-name", "u1.small"),
            ("kubevirt.io/preference-name", "fedora"),
            ("other", "x"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let l = info_labels(&ann);
        assert_eq!(l.len(), 3, "{l:?}");
        assert_eq!(l["os"], "fedora");
        assert_eq!(l["instance_type"], "u1.small");
        assert_eq!(l["preference"], "fedora");
        let v = VmiSample {
            info: l,
            ..sample()
        };
        let text = render("n", &[v]);
        assert!(
            text.contains(r#"phase="running",os="fedora",workload="<none>",flavor="<none>",instance_type="u1.small",preference="fedora"}"#),
            "{text}"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        let v = VmiSample {
            name: "a\"b\\c\nd".into(),
            ..sample()
        };
        let text = render("n", &[v]);
        assert!(text.contains(r#"name="a\"b\\c\nd""#), "{text}");
    }

    #[test]
    fn phases_follow_kubevirt() {
        use ferrovirt_launcher::control::RunPhase;
        assert_eq!(phase_label(RunPhase::Starting), "scheduled");
        assert_eq!(phase_label(RunPhase::Paused), "running");
        assert_eq!(phase_label(RunPhase::ShuttingDown), "running");
        assert_eq!(phase_label(RunPhase::Exited), "succeeded");
    }
}
