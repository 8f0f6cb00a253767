//! Percentiles and rates for the benchmark report (pure).

use std::time::Duration;

/// The `p`-th percentile (0..=100) of `values` by the nearest-rank method; `None` when empty.
pub fn percentile(values: &[Duration], p: f64) -> Option<Duration> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort();
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    Some(v[rank.clamp(1, v.len()) - 1])
}

/// The median (50th percentile by nearest rank).
pub fn median(values: &[Duration]) -> Option<Duration> {
    percentile(values, 50.0)
}

/// Events per second: `count` over `span` (0 when the span is empty).
pub fn rate(count: usize, span: Duration) -> f64 {
    let s = span.as_secs_f64();
    if s <= 0.0 { 0.0 } else { count as f64 / s }
}

/// Milliseconds with one decimal, for the report.
pub fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// One line of the report: the figure, its value, the goal and whether the goal is met
/// (`None`: no goal).
pub fn line(figure: &str, value: &str, goal: &str, met: Option<bool>) -> String {
    let mark = match met {
        Some(true) => "ok",
        Some(false) => "MISSED",
        None => "",
    };
    format!("{figure:<48} {value:>22}   {goal:<22} {mark}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms_list(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&m| Duration::from_millis(m)).collect()
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v = ms_list(&[5, 1, 4, 2, 3, 10, 9, 8, 7, 6]);
        assert_eq!(percentile(&v, 50.0), Some(Duration::from_millis(5)));
        assert_eq!(percentile(&v, 99.0), Some(Duration::from_millis(10)));
        assert_eq!(percentile(&v, 90.0), Some(Duration::from_millis(9)));
        assert_eq!(percentile(&v, 0.0), Some(Duration::from_millis(1)));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(median(&ms_list(&[7])), Some(Duration::from_millis(7)));
    }

    #[test]
    fn rates() {
        assert_eq!(rate(500, Duration::from_secs(2)), 250.0);
        assert_eq!(rate(5, Duration::ZERO), 0.0);
    }

    #[test]
    fn report_lines_mark_missed_goals() {
        assert!(line("x", "1", "< 2", Some(true)).ends_with("ok"));
        assert!(line("x", "3", "< 2", Some(false)).ends_with("MISSED"));
        assert!(!line("x", "3", "", None).contains("MISSED"));
    }
}
