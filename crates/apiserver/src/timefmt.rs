//! RFC 3339 timestamps (metav1.Time / MicroTime), parsed and formatted by `jiff` (the time crate
//! k8s-openapi uses), and Kubernetes-style human ages ("5m", "2d3h").

use jiff::Timestamp;

/// Seconds since the Unix epoch.
pub fn now_secs() -> i64 {
    Timestamp::now().as_second()
}

/// `metav1.Time` for now, e.g. `2026-11-30T08:08:42Z`.
pub fn now_rfc3339() -> String {
    format_rfc3339(now_secs())
}

/// Formats seconds since the epoch as `YYYY-MM-DDTHH:MM:SSZ` (out-of-range values clamp to
/// the epoch).
pub fn format_rfc3339(secs: i64) -> String {
    Timestamp::from_second(secs)
        .unwrap_or(Timestamp::UNIX_EPOCH)
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// Parses an RFC 3339 timestamp (fractional seconds and offsets allowed) to epoch seconds;
/// impossible dates and times (Feb 31, hour 99) are `None`.
pub fn parse_rfc3339(s: &str) -> Option<i64> {
    s.parse::<Timestamp>().ok().map(|t| t.as_second())
}

/// Kubernetes' `HumanDuration`: the AGE column format.
pub fn human_duration(secs: i64) -> String {
    if secs < -1 {
        return "<invalid>".into();
    }
    if secs < 0 {
        return "0s".into();
    }
    if secs < 120 {
        return format!("{secs}s");
    }
    let minutes = secs / 60;
    if minutes < 10 {
        let s = secs % 60;
        return if s == 0 {
            format!("{minutes}m")
        } else {
            format!("{minutes}m{s}s")
        };
    }
    if minutes < 180 {
        return format!("{minutes}m");
    }
    let hours = minutes / 60;
    if hours < 8 {
        let m = minutes % 60;
        return if m == 0 {
            format!("{hours}h")
        } else {
            format!("{hours}h{m}m")
        };
    }
    if hours < 48 {
        return format!("{hours}h");
    }
    let days = hours / 24;
    if hours < 24 * 8 {
        let h = hours % 24;
        return if h == 0 {
            format!("{days}d")
        } else {
            format!("{days}d{h}h")
        };
    }
    if hours < 24 * 365 * 2 {
        return format!("{days}d");
    }
    let years = days / 365;
    if hours < 24 * 365 * 8 {
        let dy = days % 365;
        return if dy == 0 {
            format!("{years}y")
        } else {
            format!("{years}y{dy}d")
        };
    }
    format!("{years}y")
}

/// The age of a timestamp as `kubectl get` prints it; `<unknown>` when unparsable.
pub fn age_of(ts: &str) -> String {
    match parse_rfc3339(ts) {
        Some(t) => human_duration(now_secs() - t),
        None => "<unknown>".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip() {
        for s in [0, 1_700_000_000, 951_782_400, 4_102_444_799] {
            assert_eq!(parse_rfc3339(&format_rfc3339(s)), Some(s));
        }
        assert_eq!(format_rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(parse_rfc3339("1970-01-01T01:00:00+01:00"), Some(0));
        assert_eq!(parse_rfc3339("1970-01-01T00:00:01.5Z"), Some(1));
        assert_eq!(parse_rfc3339("garbage"), None);
        assert_eq!(parse_rfc3339("2026-02-31T00:00:00Z"), None);
        assert_eq!(parse_rfc3339("2026-01-01T99:00:00Z"), None);
        assert_eq!(parse_rfc3339("2026-01-01T00:00:00"), None);
    }

    #[test]
    fn ages() {
        assert_eq!(human_duration(5), "5s");
        assert_eq!(human_duration(150), "2m30s");
        assert_eq!(human_duration(600), "10m");
        assert_eq!(human_duration(3 * 3600 + 60), "3h1m");
        assert_eq!(human_duration(50 * 3600), "2d2h");
        assert_eq!(human_duration(20 * 86400), "20d");
    }
}
