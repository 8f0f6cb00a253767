//! BackupPlan schedules and retention, pure (docs/backup.md, "Plans"):
//!
//! - [`Schedule`]: a cron expression (5 fields, or 6 with seconds first; parsed by the `croner`
//!   crate) evaluated in an IANA time zone (jiff, the system's tzdata), and [`due`]: whether a
//!   plan runs now given its last scheduled run, and when it runs next;
//! - [`gfs_keep`]: grandfather-father-son retention over backup timestamps — keep the newest
//!   `last`, and the newest backup of each of the newest `hourly` hours, `daily` days, `weekly`
//!   ISO weeks, `monthly` months and `yearly` years (calendar periods in the plan's zone). The
//!   rules are independent and their union is kept (a backup kept by one rule still counts for
//!   the others), so pruning after every run keeps exactly the set computed at the end.

use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use jiff::Timestamp;
use jiff::tz::TimeZone;

/// A parsed schedule: when a plan runs.
#[derive(Clone, Debug)]
pub struct Schedule {
    cron: Cron,
    tz: TimeZone,
}

/// Which field of a plan's schedule is wrong, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ScheduleError {
    pub field: &'static str,
    pub message: String,
}

impl Schedule {
    /// `expr` (5 cron fields, or 6 with seconds first) in time zone `tz` (IANA name; default
    /// UTC). Errors name `spec.schedule` or `spec.timeZone`.
    pub fn parse(expr: &str, tz: Option<&str>) -> Result<Self, ScheduleError> {
        let fields = expr.split_whitespace().count();
        if !(5..=6).contains(&fields) {
            return Err(ScheduleError {
                field: "spec.schedule",
                message: format!(
                    "{expr:?}: 5 cron fields (minute hour day-of-month month day-of-week), or 6 \
                     with seconds first, are required"
                ),
            });
        }
        let cron = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build()
            .parse(expr)
            .map_err(|e| ScheduleError {
                field: "spec.schedule",
                message: format!("{expr:?}: {e}"),
            })?;
        let tz = match tz.unwrap_or("UTC") {
            "" | "UTC" | "Etc/UTC" => TimeZone::UTC,
            name => TimeZone::get(name).map_err(|e| ScheduleError {
                field: "spec.timeZone",
                message: format!("{name:?} is not a known IANA time zone: {e}"),
            })?,
        };
        Ok(Self { cron, tz })
    }

    /// The schedule's time zone.
    pub fn time_zone(&self) -> &TimeZone {
        &self.tz
    }

    /// The first scheduled time strictly after `t` (None when the pattern never matches again).
    pub fn next_after(&self, t: Timestamp) -> Option<Timestamp> {
        let z = t.to_zoned(self.tz.clone());
        self.cron
            .find_next_occurrence(&z, false)
            .ok()
            .map(|z| z.timestamp())
    }

    /// The latest scheduled time at or before `t`.
    pub fn previous_at_or_before(&self, t: Timestamp) -> Option<Timestamp> {
        let z = t.to_zoned(self.tz.clone());
        self.cron
            .find_previous_occurrence(&z, true)
            .ok()
            .map(|z| z.timestamp())
    }
}

/// What a plan does now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Due {
    /// Run now, for this scheduled time (missed runs collapse into the latest one).
    pub run: Option<Timestamp>,
    /// The next scheduled time after now.
    pub next: Option<Timestamp>,
}

/// Whether a plan whose last scheduled run was `last` (None: never; times count from
/// `anchor`, the plan's creation) runs at `now`: a scheduled time in `(last, now]` runs once,
/// as the latest such time; earlier missed times are not made up.
pub fn due(s: &Schedule, last: Option<Timestamp>, anchor: Timestamp, now: Timestamp) -> Due {
    let from = last.unwrap_or(anchor);
    let run = match s.next_after(from) {
        Some(first) if first <= now => s.previous_at_or_before(now).filter(|p| *p > from),
        _ => None,
    };
    Due {
        run,
        next: s.next_after(now),
    }
}

/// Counts of a grandfather-father-son policy (0: the rule keeps nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Keep {
    pub last: u32,
    pub hourly: u32,
    pub daily: u32,
    pub weekly: u32,
    pub monthly: u32,
    pub yearly: u32,
}

impl Keep {
    /// No rule set: every backup is kept.
    pub fn keeps_all(&self) -> bool {
        *self == Keep::default()
    }
}

/// For each of `times` (any order), whether the policy keeps it. Period buckets are calendar
/// hours, days, ISO weeks, months and years in `tz`; in each rule the newest backup of each of
/// the newest N buckets is kept. Ties in time keep the earlier index.
pub fn gfs_keep(times: &[Timestamp], keep: &Keep, tz: &TimeZone) -> Vec<bool> {
    if keep.keeps_all() {
        return vec![true; times.len()];
    }
    let mut order: Vec<usize> = (0..times.len()).collect();
    order.sort_by(|&a, &b| times[b].cmp(&times[a]).then(a.cmp(&b)));
    let mut kept = vec![false; times.len()];
    for &i in order.iter().take(keep.last as usize) {
        kept[i] = true;
    }
    type Bucket = fn(&jiff::Zoned) -> (i32, i32, i32, i32);
    let rules: [(u32, Bucket); 5] = [
        (keep.hourly, |z| {
            (
                i32::from(z.year()),
                i32::from(z.month()),
                i32::from(z.day()),
                i32::from(z.hour()),
            )
        }),
        (keep.daily, |z| {
            (
                i32::from(z.year()),
                i32::from(z.month()),
                i32::from(z.day()),
                0,
            )
        }),
        (keep.weekly, |z| {
            let w = z.date().iso_week_date();
            (i32::from(w.year()), i32::from(w.week()), 0, 0)
        }),
        (keep.monthly, |z| {
            (i32::from(z.year()), i32::from(z.month()), 0, 0)
        }),
        (keep.yearly, |z| (i32::from(z.year()), 0, 0, 0)),
    ];
    for (n, bucket) in rules {
        let mut last = None;
        let mut count = 0;
        for &i in &order {
            if count == n {
                break;
            }
            let b = bucket(&times[i].to_zoned(tz.clone()));
            if last != Some(b) {
                kept[i] = true;
                count += 1;
                last = Some(b);
            }
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn schedules_parse_and_name_the_field() {
        assert!(Schedule::parse("*/5 * * * *", None).is_ok());
        assert!(Schedule::parse("*/10 * * * * *", Some("Europe/Berlin")).is_ok());
        let e = Schedule::parse("* * *", None).unwrap_err();
        assert_eq!(e.field, "spec.schedule");
        let e = Schedule::parse("61 * * * *", None).unwrap_err();
        assert_eq!(e.field, "spec.schedule");
        let e = Schedule::parse("0 * * * *", Some("Mars/Olympus")).unwrap_err();
        assert_eq!(e.field, "spec.timeZone");
        assert!(e.message.contains("Mars/Olympus"), "{e}");
    }

    #[test]
    fn next_runs_in_the_time_zone() {
        // 02:30 every day in Berlin: 01:30 UTC in winter, 00:30 UTC in summer
        let s = Schedule::parse("30 2 * * *", Some("Europe/Berlin")).unwrap();
        assert_eq!(
            s.next_after(ts("2026-01-10T12:00:00Z")),
            Some(ts("2026-01-11T01:30:00Z"))
        );
        assert_eq!(
            s.next_after(ts("2026-07-10T12:00:00Z")),
            Some(ts("2026-07-11T00:30:00Z"))
        );
        // seconds form
        let s = Schedule::parse("*/20 * * * * *", None).unwrap();
        assert_eq!(
            s.next_after(ts("2026-01-01T00:00:05Z")),
            Some(ts("2026-01-01T00:00:20Z"))
        );
    }

    #[test]
    fn due_runs_once_for_missed_times_and_not_before() {
        let s = Schedule::parse("0 * * * *", None).unwrap();
        let created = ts("2026-01-01T00:10:00Z");
        // before the first time: nothing, next at 01:00
        let d = due(&s, None, created, ts("2026-01-01T00:59:59Z"));
        assert_eq!(d.run, None);
        assert_eq!(d.next, Some(ts("2026-01-01T01:00:00Z")));
        // on time
        let d = due(&s, None, created, ts("2026-01-01T01:00:00Z"));
        assert_eq!(d.run, Some(ts("2026-01-01T01:00:00Z")));
        // already ran for 01:00
        let d = due(
            &s,
            Some(ts("2026-01-01T01:00:00Z")),
            created,
            ts("2026-01-01T01:30:00Z"),
        );
        assert_eq!(d.run, None);
        // down for three hours: one run, for the latest time
        let d = due(
            &s,
            Some(ts("2026-01-01T01:00:00Z")),
            created,
            ts("2026-01-01T04:20:00Z"),
        );
        assert_eq!(d.run, Some(ts("2026-01-01T04:00:00Z")));
        assert_eq!(d.next, Some(ts("2026-01-01T05:00:00Z")));
    }

    fn hourly_span(end: Timestamp, hours: i64) -> Vec<Timestamp> {
        (0..hours)
            .rev()
            .map(|h| end - jiff::SignedDuration::from_hours(h))
            .collect()
    }

    fn kept_set(times: &[Timestamp], keep: &Keep) -> BTreeSet<Timestamp> {
        gfs_keep(times, keep, &TimeZone::UTC)
            .into_iter()
            .zip(times)
            .filter(|(k, _)| *k)
            .map(|(_, t)| *t)
            .collect()
    }

    const POLICY: Keep = Keep {
        last: 3,
        hourly: 24,
        daily: 7,
        weekly: 4,
        monthly: 6,
        yearly: 2,
    };

    #[test]
    fn retention_keeps_exactly_the_gfs_set() {
        // a backup every hour for 500 days, ending Sunday 2026-03-15 10:00 UTC
        let end = ts("2026-03-15T10:00:00Z");
        let times = hourly_span(end, 500 * 24);
        let kept = kept_set(&times, &POLICY);
        let mut want: BTreeSet<Timestamp> = BTreeSet::new();
        // last 3 and hourly 24: the newest 24 hours
        want.extend(hourly_span(end, 24));
        // daily 7: today's newest, then 23:00 of the six days before
        for d in ["14", "13", "12", "11", "10", "09"] {
            want.insert(ts(&format!("2026-03-{d}T23:00:00Z")));
        }
        // weekly 4 (ISO weeks, Monday first): this week's newest, then three Sundays 23:00
        for d in ["2026-03-08", "2026-03-01", "2026-02-22"] {
            want.insert(ts(&format!("{d}T23:00:00Z")));
        }
        // monthly 6: this month's newest, then the last hour of five months before
        for d in [
            "2026-02-28",
            "2026-01-31",
            "2025-12-31",
            "2025-11-30",
            "2025-10-31",
        ] {
            want.insert(ts(&format!("{d}T23:00:00Z")));
        }
        // yearly 2: this year's newest, 2025's last (already in)
        assert_eq!(kept, want);
        // 03-14 23:00 is among the newest 24 hours
        assert_eq!(kept.len(), 24 + 5 + 3 + 5);
    }

    #[test]
    fn pruning_after_every_run_keeps_the_same_set_as_computing_at_the_end() {
        // the controller prunes after each run; over a simulated span of 400 days of hourly
        // runs the survivors must be exactly the policy's set over all runs
        let end = ts("2026-03-15T10:00:00Z");
        let all = hourly_span(end, 400 * 24);
        let mut alive: Vec<Timestamp> = Vec::new();
        for t in &all {
            alive.push(*t);
            let keep = gfs_keep(&alive, &POLICY, &TimeZone::UTC);
            alive = alive
                .into_iter()
                .zip(keep)
                .filter(|(_, k)| *k)
                .map(|(t, _)| t)
                .collect();
            assert!(alive.len() <= 24 + 7 + 4 + 6 + 2 + 3);
        }
        let alive: BTreeSet<Timestamp> = alive.into_iter().collect();
        assert_eq!(alive, kept_set(&all, &POLICY));
    }

    #[test]
    fn retention_edge_cases() {
        let t = [
            ts("2026-01-01T00:00:00Z"),
            ts("2026-01-01T00:30:00Z"),
            ts("2026-01-02T00:00:00Z"),
        ];
        // no rule: everything kept
        assert_eq!(gfs_keep(&t, &Keep::default(), &TimeZone::UTC), [true; 3]);
        // keepLast only, input unordered
        let u = [t[1], t[2], t[0]];
        let k = Keep {
            last: 1,
            ..Default::default()
        };
        assert_eq!(gfs_keep(&u, &k, &TimeZone::UTC), [false, true, false]);
        // daily in a zone: 03:00Z and 06:00Z on Jan 1 are one UTC day but two days in New
        // York (Dec 31 22:00 and Jan 1 01:00)
        let ny = TimeZone::get("America/New_York").unwrap();
        let z = [ts("2026-01-01T03:00:00Z"), ts("2026-01-01T06:00:00Z")];
        let k = Keep {
            daily: 5,
            ..Default::default()
        };
        assert_eq!(gfs_keep(&z, &k, &ny), [true, true]);
        assert_eq!(gfs_keep(&z, &k, &TimeZone::UTC), [false, true]);
        let k = Keep {
            daily: 1,
            ..Default::default()
        };
        assert_eq!(gfs_keep(&t, &k, &TimeZone::UTC), [false, false, true]);
    }
}
