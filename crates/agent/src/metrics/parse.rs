//! Pure parsers for the numbers behind the VMI metrics: a process's or thread's
//! `/proc/<pid>/stat` line (CPU time, resident pages), QEMU's vCPU thread names
//! (`CPU <n>/TCG`, `CPU <n>/KVM`, set by `-name …,debug-threads=on`) and QMP
//! `query-blockstats` replies turned into per-drive counters, and `/proc/<pid>/net/dev`
//! lines (the tap devices of QEMU's network namespace) turned into per-interface counters.

use serde_json::Value;

/// The fields of a `/proc/<pid>/stat` (or `/proc/<pid>/task/<tid>/stat`) line we use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// User-mode CPU time, in clock ticks.
    pub utime_ticks: u64,
    /// Kernel-mode CPU time, in clock ticks.
    pub stime_ticks: u64,
    /// Resident set size, in pages.
    pub rss_pages: u64,
}

impl ProcStat {
    /// User plus system CPU time in seconds, with `ticks_per_second` clock ticks a second.
    pub fn cpu_seconds(&self, ticks_per_second: u64) -> f64 {
        let ticks = self.utime_ticks.saturating_add(self.stime_ticks);
        ticks as f64 / ticks_per_second.max(1) as f64
    }
}

/// Parses a `stat` line. The command name (field 2) is in parentheses and may itself contain
/// spaces and parentheses, so the fields are counted after its last `)`.
pub fn parse_proc_stat(line: &str) -> Option<ProcStat> {
    let rest = &line[line.rfind(')')? + 1..];
    // After the name: state(3) ppid(4) … utime(14) stime(15) … rss(24): index = field - 3.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(ProcStat {
        utime_ticks: field(14)?,
        stime_ticks: field(15)?,
        rss_pages: field(24)?,
    })
}

/// The vCPU index of a QEMU thread named `comm` (`CPU 3/TCG` → 3), if it is a vCPU thread.
pub fn vcpu_id(comm: &str) -> Option<u32> {
    let rest = comm.trim().strip_prefix("CPU ")?;
    let (id, accel) = rest.split_once('/')?;
    if accel.is_empty() {
        return None;
    }
    id.parse().ok()
}

/// One drive's I/O counters (QMP `BlockDeviceStats`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriveStats {
    /// The VMI's disk name (from the QEMU device id `disk-<name>` that `mapping::disk_id`
    /// made; characters other than ASCII letters and digits come back as `-`).
    pub drive: String,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub read_ops: u64,
    pub write_ops: u64,
    pub flush_ops: u64,
    pub read_time_ns: u64,
    pub write_time_ns: u64,
    pub flush_time_ns: u64,
}

/// The drive a `query-blockstats` entry belongs to: its `qdev` (a device id, or a QOM path
/// `/machine/peripheral/<id>/…` for virtio-blk), else its legacy `device` name. Entries with
/// neither (internal nodes) have no drive.
pub fn drive_name(entry: &Value) -> Option<String> {
    let qdev = entry.get("qdev").and_then(Value::as_str).unwrap_or("");
    if let Some(path) = qdev.strip_prefix("/machine/peripheral/") {
        let id = path.split('/').next().unwrap_or("");
        if !id.is_empty() {
            return Some(id.to_string());
        }
    } else if !qdev.is_empty() && !qdev.starts_with('/') {
        return Some(qdev.to_string());
    }
    let device = entry.get("device").and_then(Value::as_str).unwrap_or("");
    (!device.is_empty()).then(|| device.to_string())
}

/// Per-drive counters from a `query-blockstats` reply (an array); entries without a drive
/// name or without `stats` are skipped, missing counters count as 0. Sorted by drive.
pub fn parse_blockstats(reply: &Value) -> Vec<DriveStats> {
    let mut out: Vec<DriveStats> = reply
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter_map(|e| {
            let id = drive_name(e)?;
            let drive = id.strip_prefix("disk-").unwrap_or(&id).to_string();
            let s = e.get("stats")?;
            let n = |k: &str| s.get(k).and_then(Value::as_u64).unwrap_or(0);
            Some(DriveStats {
                drive,
                read_bytes: n("rd_bytes"),
                write_bytes: n("wr_bytes"),
                read_ops: n("rd_operations"),
                write_ops: n("wr_operations"),
                flush_ops: n("flush_operations"),
                read_time_ns: n("rd_total_time_ns"),
                write_time_ns: n("wr_total_time_ns"),
                flush_time_ns: n("flush_total_time_ns"),
            })
        })
        .collect();
    out.sort_by(|a, b| a.drive.cmp(&b.drive));
    out.dedup_by(|a, b| a.drive == b.drive);
    out
}

/// One network device's counters from `/proc/<pid>/net/dev`, as the host sees them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetDevStats {
    pub rx_bytes: u64,
    pub rx_packets: u64,
    pub rx_errors: u64,
    pub rx_dropped: u64,
    pub tx_bytes: u64,
    pub tx_packets: u64,
    pub tx_errors: u64,
    pub tx_dropped: u64,
}

/// The counters of device `ifname` in a `/proc/net/dev` text (two header lines, then
/// `name: rx bytes packets errs drop fifo frame compressed multicast tx bytes packets errs
/// drop …`).
pub fn parse_net_dev(text: &str, ifname: &str) -> Option<NetDevStats> {
    text.lines().find_map(|line| {
        let (name, rest) = line.split_once(':')?;
        if name.trim() != ifname {
            return None;
        }
        let f: Vec<u64> = rest
            .split_whitespace()
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        (f.len() >= 12).then(|| NetDevStats {
            rx_bytes: f[0],
            rx_packets: f[1],
            rx_errors: f[2],
            rx_dropped: f[3],
            tx_bytes: f[8],
            tx_packets: f[9],
            tx_errors: f[10],
            tx_dropped: f[11],
        })
    })
}

/// One guest interface's counters from the guest's point of view: what the host's tap
/// device transmits the guest receives, and the other way round (as libvirt reports them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InterfaceStats {
    /// The VMI's interface name (`spec.domain.devices.interfaces[].name`).
    pub interface: String,
    pub receive_bytes: u64,
    pub receive_packets: u64,
    pub receive_errors: u64,
    pub receive_dropped: u64,
    pub transmit_bytes: u64,
    pub transmit_packets: u64,
    pub transmit_errors: u64,
    pub transmit_dropped: u64,
}

impl InterfaceStats {
    /// The guest's view of a tap device's host-side counters.
    pub fn from_tap(interface: &str, tap: &NetDevStats) -> InterfaceStats {
        InterfaceStats {
            interface: interface.to_string(),
            receive_bytes: tap.tx_bytes,
            receive_packets: tap.tx_packets,
            receive_errors: tap.tx_errors,
            receive_dropped: tap.tx_dropped,
            transmit_bytes: tap.rx_bytes,
            transmit_packets: tap.rx_packets,
            transmit_errors: tap.rx_errors,
            transmit_dropped: tap.rx_dropped,
        }
    }
}

/// The interface name of NIC `nic_id` (`net<i>` → `interfaces[i]`), else the NIC id.
pub fn interface_name(nic_id: &str, interfaces: &[String]) -> String {
    nic_id
        .strip_prefix("net")
        .and_then(|i| i.parse::<usize>().ok())
        .and_then(|i| interfaces.get(i))
        .cloned()
        .unwrap_or_else(|| nic_id.to_string())
}

/// The guest's memory as its virtio balloon driver reports it (QOM `guest-stats`, in bytes;
/// QEMU writes -1 for a statistic the guest does not give, left out here), and the balloon's
/// size (`query-balloon` `actual`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GuestMemory {
    /// `stat-total-memory`: memory the guest sees.
    pub total: Option<u64>,
    /// `stat-available-memory`: what the guest can use without swapping (MemAvailable).
    pub available: Option<u64>,
    /// `stat-free-memory`: left completely unused (MemFree).
    pub free: Option<u64>,
    /// `stat-disk-caches`.
    pub cached: Option<u64>,
    pub swap_in: Option<u64>,
    pub swap_out: Option<u64>,
    pub major_faults: Option<u64>,
    pub minor_faults: Option<u64>,
    /// The balloon's current size.
    pub balloon_actual: Option<u64>,
}

/// The guest memory in the launcher's `stats` reply (`guestStats`, `balloon`); None when
/// neither says anything (no balloon, or a guest that has not reported).
pub fn parse_guest_memory(reply: &Value) -> Option<GuestMemory> {
    let stats = &reply["guestStats"]["stats"];
    let stat = |k: &str| {
        stats
            .get(k)
            .and_then(Value::as_i64)
            .and_then(|v| u64::try_from(v).ok())
    };
    let m = GuestMemory {
        total: stat("stat-total-memory"),
        available: stat("stat-available-memory"),
        free: stat("stat-free-memory"),
        cached: stat("stat-disk-caches"),
        swap_in: stat("stat-swap-in"),
        swap_out: stat("stat-swap-out"),
        major_faults: stat("stat-major-faults"),
        minor_faults: stat("stat-minor-faults"),
        balloon_actual: reply["balloon"]["actual"].as_u64(),
    };
    (m != GuestMemory::default()).then_some(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn proc_stat_fields_are_counted_after_the_name() {
        // A real line's shape, with a name that contains spaces and a parenthesis.
        let line = "4242 (CPU 0/TCG) x) R 1 4242 4242 0 -1 4194560 1000 0 0 0 \
                    250 50 0 0 20 0 6 0 12345 2000000000 51200 18446744073709551615 \
                    1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0";
        let s = parse_proc_stat(line).unwrap();
        assert_eq!(s.utime_ticks, 250);
        assert_eq!(s.stime_ticks, 50);
        assert_eq!(s.rss_pages, 51200);
        assert_eq!(s.cpu_seconds(100), 3.0);
        assert_eq!(s.cpu_seconds(0), 300.0);
        assert_eq!(parse_proc_stat("12 (short) R 1 2"), None);
        assert_eq!(parse_proc_stat("garbage"), None);
    }

    #[test]
    fn tap_counters_are_the_guests_view() {
        let text = "Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:       0       0    0    0    0     0          0         0        0       0    0    0    0     0       0          0
fv-tap0:    1000      10    1    2    0     0          0         0     5000      50    3    4    0     0       0          0
";
        let tap = parse_net_dev(text, "fv-tap0").unwrap();
        assert_eq!(tap.rx_bytes, 1000);
        assert_eq!(tap.tx_dropped, 4);
        assert_eq!(parse_net_dev(text, "fv-tap"), None);
        assert_eq!(parse_net_dev("x: 1 2 3", "x"), None);
        let i = InterfaceStats::from_tap("default", &tap);
        assert_eq!(i.interface, "default");
        assert_eq!((i.receive_bytes, i.receive_packets), (5000, 50));
        assert_eq!((i.receive_errors, i.receive_dropped), (3, 4));
        assert_eq!((i.transmit_bytes, i.transmit_packets), (1000, 10));
        assert_eq!((i.transmit_errors, i.transmit_dropped), (1, 2));
        let names = vec!["default".to_string(), "blue".to_string()];
        assert_eq!(interface_name("net1", &names), "blue");
        assert_eq!(interface_name("net7", &names), "net7");
        assert_eq!(interface_name("other", &names), "other");
    }

    #[test]
    fn vcpu_threads_are_recognised() {
        assert_eq!(vcpu_id("CPU 0/TCG"), Some(0));
        assert_eq!(vcpu_id("CPU 12/KVM\n"), Some(12));
        assert_eq!(vcpu_id("qemu-system-x86"), None);
        assert_eq!(vcpu_id("CPU x/KVM"), None);
        assert_eq!(vcpu_id("CPU 1/"), None);
        assert_eq!(vcpu_id("IO mon_iothread"), None);
    }

    #[test]
    fn blockstats_become_per_drive_counters() {
        let reply = json!([
            {"device": "", "qdev": "/machine/peripheral/disk-rootdisk/virtio-backend",
             "node-name": "fmt-rootdisk",
             "stats": {"rd_bytes": 1048576, "wr_bytes": 4096, "rd_operations": 300,
                       "wr_operations": 2, "flush_operations": 1,
                       "rd_total_time_ns": 5000, "wr_total_time_ns": 700,
                       "flush_total_time_ns": 90}},
            {"device": "", "qdev": "disk-data", "stats": {"rd_bytes": 7}},
            {"device": "ide0-cd0", "stats": {}},
            {"device": "", "qdev": "", "stats": {"rd_bytes": 1}},
            {"device": "", "qdev": "/machine/unattached/device[3]", "stats": {}},
            {"device": "", "qdev": "nostats"}
        ]);
        let d = parse_blockstats(&reply);
        let names: Vec<&str> = d.iter().map(|d| d.drive.as_str()).collect();
        assert_eq!(names, ["data", "ide0-cd0", "rootdisk"]);
        let root = &d[2];
        assert_eq!(root.read_bytes, 1048576);
        assert_eq!(root.write_bytes, 4096);
        assert_eq!(root.read_ops, 300);
        assert_eq!(root.write_ops, 2);
        assert_eq!(root.flush_ops, 1);
        assert_eq!(root.read_time_ns, 5000);
        assert_eq!(root.write_time_ns, 700);
        assert_eq!(root.flush_time_ns, 90);
        assert_eq!(d[0].read_bytes, 7);
        assert_eq!(d[0].write_bytes, 0);
        assert!(parse_blockstats(&json!({"not": "an array"})).is_empty());
    }

    #[test]
    fn guest_memory_from_the_balloon() {
        let reply = serde_json::json!({
            "blockstats": [],
            "guestStats": {"last-update": 1700000000, "stats": {
                "stat-total-memory": 127_000_000, "stat-available-memory": 90_000_000,
                "stat-free-memory": 80_000_000, "stat-disk-caches": 5_000_000,
                "stat-swap-in": 0, "stat-swap-out": 0, "stat-major-faults": 12,
                "stat-minor-faults": 3400, "stat-htlb-pgalloc": -1}},
            "balloon": {"actual": 134_217_728u64}});
        let m = parse_guest_memory(&reply).unwrap();
        assert_eq!(m.total, Some(127_000_000));
        assert_eq!(m.available, Some(90_000_000));
        assert_eq!(m.free, Some(80_000_000));
        assert_eq!(m.minor_faults, Some(3400));
        assert_eq!(m.balloon_actual, Some(134_217_728));
        // A statistic the guest does not give (-1) is left out, not reported as huge.
        let mut r = reply.clone();
        r["guestStats"]["stats"]["stat-disk-caches"] = serde_json::json!(-1);
        assert_eq!(parse_guest_memory(&r).unwrap().cached, None);
        // No balloon, or a guest that never reported: nothing.
        assert_eq!(
            parse_guest_memory(&serde_json::json!({"blockstats": []})),
            None
        );
    }
}
