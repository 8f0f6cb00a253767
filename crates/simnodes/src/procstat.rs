//! CPU time and memory of a process from /proc (Linux), for the server's and etcd's figures.
//! The parsing is pure and unit-tested.

use std::time::Duration;

/// What /proc says about one process at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sample {
    /// User + system CPU time consumed so far.
    pub cpu: Duration,
    /// Resident set size now, in KiB.
    pub rss_kib: u64,
    /// Peak resident set size (VmHWM), in KiB.
    pub hwm_kib: u64,
}

/// User + system clock ticks from the text of `/proc/PID/stat` (fields 14 and 15; the command
/// name in parentheses may contain spaces, so fields are counted after the last `)`).
pub fn parse_stat_ticks(stat: &str) -> Option<u64> {
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After ")" come field 3 (state) onwards: utime is field 14, i.e. index 11 here.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// `(VmRSS, VmHWM)` in KiB from the text of `/proc/PID/status`.
pub fn parse_status_kib(status: &str) -> (u64, u64) {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`, 100 on every Linux we run on).
const TICKS_PER_SECOND: u64 = 100;

/// Reads one [`Sample`] of `pid`; `None` when the process is gone.
pub fn sample(pid: u32) -> Option<Sample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let ticks = parse_stat_ticks(&stat)?;
    let (rss_kib, hwm_kib) = parse_status_kib(&status);
    Some(Sample {
        cpu: Duration::from_millis(ticks * 1000 / TICKS_PER_SECOND),
        rss_kib,
        hwm_kib,
    })
}

/// CPU used between two samples as a fraction of one core over `wall`.
pub fn cpu_share(before: &Sample, after: &Sample, wall: Duration) -> f64 {
    let used = after.cpu.saturating_sub(before.cpu).as_secs_f64();
    let w = wall.as_secs_f64();
    if w <= 0.0 { 0.0 } else { used / w }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_after_a_command_with_spaces() {
        let stat =
            "1234 (tokio (rt) x) S 1 1234 1234 0 -1 4194560 1000 0 0 0 250 75 0 0 20 0 9 0 100 1 2";
        assert_eq!(parse_stat_ticks(stat), Some(325));
        assert_eq!(parse_stat_ticks("garbage"), None);
    }

    #[test]
    fn status_memory_fields() {
        let status = "Name:\tferrovirt\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n";
        assert_eq!(parse_status_kib(status), (102_400, 204_800));
        assert_eq!(parse_status_kib(""), (0, 0));
    }

    #[test]
    fn own_process_is_readable() {
        let s = sample(std::process::id()).expect("own /proc entry");
        assert!(s.rss_kib > 0 && s.hwm_kib >= s.rss_kib);
    }

    #[test]
    fn cpu_share_of_one_core() {
        let a = Sample {
            cpu: Duration::from_millis(1000),
            ..Default::default()
        };
        let b = Sample {
            cpu: Duration::from_millis(1500),
            ..Default::default()
        };
        assert!((cpu_share(&a, &b, Duration::from_secs(10)) - 0.05).abs() < 1e-9);
        assert_eq!(cpu_share(&a, &b, Duration::ZERO), 0.0);
    }
}
