//! Start-path timing (issue #15, docs/scale.md "Start path"): named spans stamped on
//! CLOCK_BOOTTIME in microseconds since boot, so that the agent's and the launcher's records,
//! a benchmark's own clock (`time.clock_gettime(CLOCK_BOOTTIME)`) and the start times in
//! /proc/PID/stat all lie on one time line. The agent writes its record as
//! [`AGENT_FILE`] and the launcher its own as [`LAUNCHER_FILE`] in the VMI directory, and
//! both log a one-line summary at info. Recording costs one clock read per step.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The agent's record of a start, in the VMI directory.
pub const AGENT_FILE: &str = "agent-timing.json";
/// The launcher's record of a start, in the VMI directory.
pub const LAUNCHER_FILE: &str = "launcher-timing.json";

/// Microseconds since boot (CLOCK_BOOTTIME: counts suspend, like /proc/PID/stat start times).
pub fn boottime_us() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    u64::try_from(t.tv_sec).unwrap_or(0) * 1_000_000 + u64::try_from(t.tv_nsec).unwrap_or(0) / 1000
}

/// One step: when it began and when it ended (equal for an instant).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    pub name: String,
    pub start_us: u64,
    pub end_us: u64,
}

impl Span {
    pub fn micros(&self) -> u64 {
        self.end_us.saturating_sub(self.start_us)
    }
}

/// The spans of one start, in the order they ended. Steps that run concurrently overlap.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timeline {
    pub spans: Vec<Span>,
}

impl Timeline {
    /// Records the step `name` that began at `start_us` and ends now.
    pub fn span(&mut self, name: &str, start_us: u64) {
        self.push(name, start_us, boottime_us());
    }

    /// Records an instant (a step without duration) now.
    pub fn instant(&mut self, name: &str) {
        let now = boottime_us();
        self.push(name, now, now);
    }

    /// Records a step with both ends given.
    pub fn push(&mut self, name: &str, start_us: u64, end_us: u64) {
        self.spans.push(Span {
            name: name.to_string(),
            start_us,
            end_us,
        });
    }

    /// `name=1.23ms …` for every span, then the whole (first start to last end).
    pub fn summary(&self) -> String {
        let mut out: Vec<String> = self
            .spans
            .iter()
            .map(|s| format!("{}={:.2}ms", s.name, s.micros() as f64 / 1000.0))
            .collect();
        if let (Some(first), Some(last)) = (
            self.spans.iter().map(|s| s.start_us).min(),
            self.spans.iter().map(|s| s.end_us).max(),
        ) {
            out.push(format!(
                "total={:.2}ms",
                last.saturating_sub(first) as f64 / 1000.0
            ));
        }
        out.join(" ")
    }

    /// Writes the record as JSON (best effort is the caller's choice).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        std::fs::write(path, text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_lists_each_span_and_the_whole() {
        let mut t = Timeline::default();
        t.push("watch", 1_000, 1_000);
        t.push("volumes", 1_000, 3_500);
        t.push("network", 1_200, 5_000);
        assert_eq!(
            t.summary(),
            "watch=0.00ms volumes=2.50ms network=3.80ms total=4.00ms"
        );
        assert_eq!(Timeline::default().summary(), "");
    }

    #[test]
    fn boottime_moves_forward_and_round_trips() {
        let a = boottime_us();
        let mut t = Timeline::default();
        t.span("x", a);
        assert!(t.spans[0].end_us >= a && a > 0);
        let back: Timeline = serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
        assert_eq!(back, t);
    }
}
