//! The per-VMI live migration series (`kubevirt_vmi_migration_*`, docs/metrics.md) that the
//! source node's agent exports while QEMU sends a VMI: [`from_query_migrate`] turns one QMP
//! `query-migrate` answer into a [`MigrationSample`] (pure), [`Families`] registers and fills
//! the series.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::Value;

use super::{Labels, family};

/// QEMU's page size when `query-migrate` does not give one (before QEMU 2.10).
const DEFAULT_PAGE_SIZE: u64 = 4096;

/// A migration in progress, in KubeVirt's units.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MigrationSample {
    /// Bytes sent so far (RAM, plus QEMU's own block migration when used).
    pub processed_bytes: u64,
    /// Bytes still to send.
    pub remaining_bytes: u64,
    /// Bytes involved in the migration (the guest's RAM, plus disks in QEMU's block migration).
    pub total_bytes: u64,
    /// How fast the guest dirties its memory, bytes per second (absent before QEMU measured it).
    pub dirty_memory_rate_bytes: Option<f64>,
    /// How fast the memory goes over the wire, bytes per second.
    pub memory_transfer_rate_bytes: Option<f64>,
    /// When the migration started, Unix seconds.
    pub start_time_seconds: Option<f64>,
}

/// The `query-migrate` states of a migration under way (sending, or about to switch over).
pub fn in_progress(status: &str) -> bool {
    matches!(
        status,
        "setup"
            | "active"
            | "pre-switchover"
            | "device"
            | "wait-unplug"
            | "postcopy-active"
            | "postcopy-paused"
            | "postcopy-recover"
    )
}

/// The sample of a `query-migrate` answer read at `now` (Unix seconds); `None` when no
/// migration is under way (no migration, or one that completed, failed or was cancelled)
/// or when the answer has no `ram` figures (the receiving QEMU's view of an incoming
/// migration, and the sender during `setup`): only the source exports the series. The start is `now` less QEMU's `total-time` (milliseconds since the migration started).
pub fn from_query_migrate(v: &Value, now: f64) -> Option<MigrationSample> {
    if !in_progress(v["status"].as_str()?) || !v["ram"].is_object() {
        return None;
    }
    let ram = &v["ram"];
    let disk = &v["disk"];
    let both = |key: &str| ram[key].as_u64().unwrap_or(0) + disk[key].as_u64().unwrap_or(0);
    let page_size = ram["page-size"].as_u64().unwrap_or(DEFAULT_PAGE_SIZE);
    Some(MigrationSample {
        processed_bytes: both("transferred"),
        remaining_bytes: both("remaining"),
        total_bytes: both("total"),
        dirty_memory_rate_bytes: ram["dirty-pages-rate"]
            .as_u64()
            .map(|pages| (pages * page_size) as f64),
        // QEMU's `mbps` is 10^6 bits per second.
        memory_transfer_rate_bytes: ram["mbps"].as_f64().map(|mbps| mbps * 1e6 / 8.0),
        start_time_seconds: v["total-time"]
            .as_u64()
            .map(|ms| ((now - ms as f64 / 1000.0) * 1000.0).round() / 1000.0),
    })
}

/// A block migration's disk copy rate, bytes per second: what the launcher adds to its
/// migration status answer while the mirrors run (measured over its last 2 s of mirror
/// progress), with or without a memory migration under way.
pub fn disk_transfer_rate(v: &Value) -> Option<f64> {
    v[ferrovirt_launcher::blockmig::DISK_RATE_KEY].as_f64()
}

type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// The migration series of one scrape.
pub struct Families {
    processed: Family<Labels, Gauge>,
    remaining: Family<Labels, Gauge>,
    total: Family<Labels, Gauge>,
    total_counter: Family<Labels, Counter>,
    dirty_rate: Family<Labels, FloatGauge>,
    transfer_rate: Family<Labels, FloatGauge>,
    start_time: Family<Labels, FloatGauge>,
    disk_rate: Family<Labels, FloatGauge>,
}

impl Families {
    /// Registers the series in `reg` (each appears once it has a sample).
    pub fn register(reg: &mut Registry) -> Families {
        Families {
            processed: family(
                reg,
                "kubevirt_vmi_migration_data_processed_bytes",
                "The total guest OS data processed and migrated to the new VM",
            ),
            remaining: family(
                reg,
                "kubevirt_vmi_migration_data_remaining_bytes",
                "The remaining guest OS data to be migrated to the new VM",
            ),
            // KubeVirt's older name, kept as KubeVirt keeps it; a counter's name must end in
            // `_total`, so it is written as a gauge.
            total: family(
                reg,
                "kubevirt_vmi_migration_data_total_bytes",
                "The total guest OS data to be migrated to the new VM",
            ),
            // KubeVirt's newer name (the encoder appends `_total`).
            total_counter: family(
                reg,
                "kubevirt_vmi_migration_data_bytes",
                "The total guest OS data to be migrated to the new VM",
            ),
            dirty_rate: family(
                reg,
                "kubevirt_vmi_migration_dirty_memory_rate_bytes",
                "The rate of memory being dirty in the guest OS",
            ),
            transfer_rate: family(
                reg,
                "kubevirt_vmi_migration_memory_transfer_rate_bytes",
                "The rate at which the memory is being transferred",
            ),
            start_time: family(
                reg,
                "kubevirt_vmi_migration_start_time_seconds",
                "The time at which the migration started",
            ),
            disk_rate: family(
                reg,
                "kubevirt_vmi_migration_disk_transfer_rate_bytes",
                "The rate at which the disk is being transferred",
            ),
        }
    }

    /// Adds one VMI's disk copy rate under `labels`.
    pub fn add_disk_rate(&self, labels: &Labels, rate: f64) {
        self.disk_rate.get_or_create(labels).set(rate);
    }

    /// Adds one VMI's migration under `labels` (name, namespace, node).
    pub fn add(&self, labels: &Labels, m: &MigrationSample) {
        self.processed
            .get_or_create(labels)
            .set(super::clamp(m.processed_bytes));
        self.remaining
            .get_or_create(labels)
            .set(super::clamp(m.remaining_bytes));
        self.total
            .get_or_create(labels)
            .set(super::clamp(m.total_bytes));
        self.total_counter
            .get_or_create(labels)
            .inc_by(m.total_bytes);
        if let Some(r) = m.dirty_memory_rate_bytes {
            self.dirty_rate.get_or_create(labels).set(r);
        }
        if let Some(r) = m.memory_transfer_rate_bytes {
            self.transfer_rate.get_or_create(labels).set(r);
        }
        if let Some(t) = m.start_time_seconds {
            self.start_time.get_or_create(labels).set(t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A `query-migrate` answer of QEMU 7.2 sending a 128 MiB guest at 4 MiB/s.
    fn active() -> Value {
        json!({
            "status": "active",
            "total-time": 2500,
            "expected-downtime": 300,
            "setup-time": 4,
            "ram": {
                "transferred": 10_485_760u64,
                "remaining": 123_731_968u64,
                "total": 134_742_016u64,
                "duplicate": 3000,
                "normal": 2500,
                "normal-bytes": 10_240_000u64,
                "dirty-pages-rate": 25,
                "mbps": 33.554432,
                "dirty-sync-count": 1,
                "page-size": 4096,
                "pages-per-second": 1024
            }
        })
    }

    #[test]
    fn an_active_migration_gives_kubevirts_figures() {
        let m = from_query_migrate(&active(), 1_700_000_010.0).expect("in progress");
        assert_eq!(m.processed_bytes, 10_485_760);
        assert_eq!(m.remaining_bytes, 123_731_968);
        assert_eq!(m.total_bytes, 134_742_016);
        assert_eq!(m.dirty_memory_rate_bytes, Some(25.0 * 4096.0));
        let rate = m.memory_transfer_rate_bytes.expect("mbps given");
        assert!((rate - 4_194_304.0).abs() < 1e-3, "{rate}");
        assert_eq!(m.start_time_seconds, Some(1_700_000_007.5));
    }

    #[test]
    fn renders_the_series_with_the_vmi_labels() {
        let m = from_query_migrate(&active(), 1_700_000_010.0);
        let v = super::super::VmiSample {
            name: "vm1".into(),
            namespace: "default".into(),
            phase: "running".into(),
            migration: m,
            ..Default::default()
        };
        let text = super::super::render("node1", &[v]);
        let base = r#"{name="vm1",namespace="default",node="node1"}"#;
        for want in [
            format!("kubevirt_vmi_migration_data_processed_bytes{base} 10485760"),
            format!("kubevirt_vmi_migration_data_remaining_bytes{base} 123731968"),
            format!("kubevirt_vmi_migration_data_total_bytes{base} 134742016"),
            format!("kubevirt_vmi_migration_data_bytes_total{base} 134742016"),
            format!("kubevirt_vmi_migration_dirty_memory_rate_bytes{base} 102400.0"),
            format!("kubevirt_vmi_migration_start_time_seconds{base} 1700000007.5"),
        ] {
            assert!(text.lines().any(|l| l == want), "missing {want} in\n{text}");
        }
        assert!(
            text.contains("kubevirt_vmi_migration_memory_transfer_rate_bytes{"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE kubevirt_vmi_migration_data_bytes_total counter"),
            "{text}"
        );
        // Without a migration: no migration series.
        let text = super::super::render(
            "node1",
            &[super::super::VmiSample {
                name: "vm1".into(),
                ..Default::default()
            }],
        );
        assert!(!text.contains("kubevirt_vmi_migration_data"), "{text}");
    }

    #[test]
    fn the_disk_copy_rate_is_rendered_while_the_mirrors_run() {
        // The mirrors copy before the memory migration starts: QEMU says `none`.
        let status = json!({"status": "none", "ferrovirtDiskTransferRate": 52_428_800.0});
        assert_eq!(from_query_migrate(&status, 1.0), None);
        let v = super::super::VmiSample {
            name: "vm1".into(),
            namespace: "default".into(),
            disk_transfer_rate: disk_transfer_rate(&status),
            ..Default::default()
        };
        let text = super::super::render("node1", &[v]);
        let want = r#"kubevirt_vmi_migration_disk_transfer_rate_bytes{name="vm1",namespace="default",node="node1"} 52428800.0"#;
        assert!(text.lines().any(|l| l == want), "missing {want} in\n{text}");
        assert!(!text.contains("kubevirt_vmi_migration_data"), "{text}");
        assert_eq!(disk_transfer_rate(&active()), None);
    }

    #[test]
    fn block_migration_bytes_are_added_and_page_size_defaults() {
        let mut v = active();
        v["disk"] = json!({"transferred": 5, "remaining": 7, "total": 12});
        v["ram"].as_object_mut().unwrap().remove("page-size");
        v["ram"].as_object_mut().unwrap().remove("mbps");
        v.as_object_mut().unwrap().remove("total-time");
        let m = from_query_migrate(&v, 0.0).unwrap();
        assert_eq!(m.processed_bytes, 10_485_765);
        assert_eq!(m.remaining_bytes, 123_731_975);
        assert_eq!(m.total_bytes, 134_742_028);
        assert_eq!(m.dirty_memory_rate_bytes, Some(25.0 * 4096.0));
        assert_eq!(m.memory_transfer_rate_bytes, None);
        assert_eq!(m.start_time_seconds, None);
    }

    #[test]
    fn no_series_without_a_migration_under_way() {
        for v in [
            json!({}),
            json!({"status": "none"}),
            json!({"status": "completed", "total-time": 700, "ram": {"total": 1}}),
            json!({"status": "failed", "error-desc": "x"}),
            json!({"status": "cancelled"}),
            // The receiving QEMU: a state, no figures.
            json!({"status": "active"}),
        ] {
            assert_eq!(from_query_migrate(&v, 1.0), None, "{v}");
        }
        for s in ["setup", "pre-switchover", "device", "postcopy-active"] {
            assert!(
                from_query_migrate(&json!({"status": s, "ram": {}}), 1.0).is_some(),
                "{s}"
            );
        }
    }
}
