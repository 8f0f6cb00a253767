//! Pure decisions of the BackupPlan controller: which VMs a plan selects, the name and shape
//! of a run's Backup, which of the plan's Backups retention prunes, and the plan's last result.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::jiff::Timestamp;

use ferrovirt_api::backup::{
    Backup, BackupPlan, BackupPlanSpec, BackupSpec, GROUP, Retention, VERSION, phase,
};
use ferrovirt_api::backup_schedule::{Keep, gfs_keep};
use ferrovirt_api::kubevirt::preset::selector_matches;
use k8s_openapi::jiff::tz::TimeZone;

/// Label on a plan's Backups: the plan's name.
pub const PLAN_LABEL: &str = "backup.ferrovirt.io/plan";
/// Annotation on a plan's Backups: the scheduled time of the run (RFC 3339).
pub const SCHEDULED_ANNOTATION: &str = "backup.ferrovirt.io/scheduled-time";
/// Failed runs kept for inspection (older ones are deleted; they hold nothing on the target).
pub const FAILED_KEPT: usize = 3;

/// The VMs a plan selects among `vms` (name, labels): the named ones that exist plus those the
/// selector matches, sorted; the named ones that do not exist are returned second.
pub fn select_vms(
    spec: &BackupPlanSpec,
    vms: &[(String, BTreeMap<String, String>)],
) -> (Vec<String>, Vec<String>) {
    let mut out: Vec<String> = Vec::new();
    let mut missing = Vec::new();
    for n in spec.virtual_machines.iter().flatten() {
        if vms.iter().any(|(v, _)| v == n) {
            out.push(n.clone());
        } else {
            missing.push(n.clone());
        }
    }
    if let Some(sel) = &spec.selector {
        out.extend(
            vms.iter()
                .filter(|(_, l)| selector_matches(sel, l))
                .map(|(n, _)| n.clone()),
        );
    }
    out.sort();
    out.dedup();
    (out, missing)
}

/// The Backup of a run scheduled at `at`: `<plan>-<YYYYMMDDhhmmss>` (UTC), so a run is
/// created once whatever happens to the controller.
pub fn run_name(plan: &str, at: Timestamp) -> String {
    let stamp = at.strftime("%Y%m%d%H%M%S").to_string();
    let keep = 253 - stamp.len() - 1;
    let p: String = plan.chars().take(keep).collect();
    format!("{}-{stamp}", p.trim_end_matches(['-', '.']))
}

/// The run's Backup: owned by the plan (deleted with it), labelled with the plan's name and
/// annotated with the scheduled time.
pub fn run_backup(plan: &BackupPlan, at: Timestamp, vms: Vec<String>) -> Backup {
    let pname = plan.metadata.name.clone().unwrap_or_default();
    let spec = plan.spec.clone().unwrap_or_default();
    Backup {
        api_version: Some(format!("{GROUP}/{VERSION}")),
        kind: Some("Backup".into()),
        metadata: ObjectMeta {
            name: Some(run_name(&pname, at)),
            namespace: plan.metadata.namespace.clone(),
            labels: Some([(PLAN_LABEL.to_string(), pname.clone())].into()),
            annotations: Some([(SCHEDULED_ANNOTATION.to_string(), at.to_string())].into()),
            owner_references: Some(vec![OwnerReference {
                api_version: format!("{GROUP}/{VERSION}"),
                kind: "BackupPlan".into(),
                name: pname,
                uid: plan.metadata.uid.clone().unwrap_or_default(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            }]),
            ..Default::default()
        },
        spec: Some(BackupSpec {
            target: spec.target,
            virtual_machines: vms,
            encryption_key_secret_ref: spec.encryption_key_secret_ref,
            backup_name: None,
            consistency: spec.consistency,
        }),
        status: None,
    }
}

/// The GFS counts of a plan's retention (absent or non-positive counts are 0; no retention
/// keeps everything).
pub fn keep_of(r: Option<&Retention>) -> Keep {
    let n = |v: Option<i32>| v.and_then(|v| u32::try_from(v).ok()).unwrap_or(0);
    r.map(|r| Keep {
        last: n(r.keep_last),
        hourly: n(r.hourly),
        daily: n(r.daily),
        weekly: n(r.weekly),
        monthly: n(r.monthly),
        yearly: n(r.yearly),
    })
    .unwrap_or_default()
}

/// What the controller knows of one of the plan's Backups.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    pub name: String,
    /// The name on the target.
    pub backup_name: String,
    pub phase: String,
    /// The scheduled time (annotation), else the creation time.
    pub at: Timestamp,
    pub message: String,
}

impl Run {
    /// Whether the run finished.
    pub fn finished(&self) -> bool {
        self.phase == phase::SUCCEEDED || self.phase == phase::FAILED
    }
}

/// The runs retention removes: succeeded runs outside the GFS set (in the plan's zone), and
/// failed runs beyond the newest [`FAILED_KEPT`]. Running runs are never pruned.
pub fn to_prune(runs: &[Run], keep: &Keep, tz: &TimeZone) -> Vec<Run> {
    let ok: Vec<&Run> = runs
        .iter()
        .filter(|r| r.phase == phase::SUCCEEDED)
        .collect();
    let times: Vec<Timestamp> = ok.iter().map(|r| r.at).collect();
    let kept = gfs_keep(&times, keep, tz);
    let mut out: Vec<Run> = ok
        .into_iter()
        .zip(kept)
        .filter(|(_, k)| !k)
        .map(|(r, _)| r.clone())
        .collect();
    let mut failed: Vec<&Run> = runs.iter().filter(|r| r.phase == phase::FAILED).collect();
    failed.sort_by_key(|r| std::cmp::Reverse(r.at));
    out.extend(failed.into_iter().skip(FAILED_KEPT).cloned());
    out
}

/// The newest finished run, whose phase is the plan's last result.
pub fn last_finished(runs: &[Run]) -> Option<&Run> {
    runs.iter().filter(|r| r.finished()).max_by_key(|r| r.at)
}

/// Whether a run has not finished (a new run is skipped while one is in progress).
pub fn in_progress(runs: &[Run]) -> Option<&Run> {
    runs.iter().find(|r| !r.finished())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn selection_by_name_and_label() {
        let vms = vec![
            ("a".to_string(), [("tier".into(), "db".into())].into()),
            ("b".to_string(), BTreeMap::new()),
            ("c".to_string(), [("tier".into(), "web".into())].into()),
        ];
        let mut spec = BackupPlanSpec {
            virtual_machines: Some(vec!["b".into(), "gone".into()]),
            ..Default::default()
        };
        assert_eq!(
            select_vms(&spec, &vms),
            (vec!["b".to_string()], vec!["gone".to_string()])
        );
        spec.selector = Some(LabelSelector {
            match_labels: Some([("tier".into(), "db".into())].into()),
            ..Default::default()
        });
        assert_eq!(select_vms(&spec, &vms).0, ["a", "b"]);
        // {} selects the whole namespace
        spec.selector = Some(LabelSelector::default());
        spec.virtual_machines = None;
        assert_eq!(select_vms(&spec, &vms).0, ["a", "b", "c"]);
    }

    #[test]
    fn run_backups_are_named_by_schedule_and_owned() {
        let at = ts("2026-12-02T21:05:30Z");
        assert_eq!(run_name("nightly", at), "nightly-20261202210530");
        assert!(run_name(&"p".repeat(300), at).len() <= 253);
        let plan = BackupPlan {
            api_version: None,
            kind: None,
            metadata: ObjectMeta {
                name: Some("nightly".into()),
                namespace: Some("ns".into()),
                uid: Some("u1".into()),
                ..Default::default()
            },
            spec: Some(BackupPlanSpec {
                target: "t".into(),
                encryption_key_secret_ref: "k".into(),
                ..Default::default()
            }),
            status: None,
        };
        let b = run_backup(&plan, at, vec!["vm1".into()]);
        let o = &b.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!((o.kind.as_str(), o.uid.as_str()), ("BackupPlan", "u1"));
        assert_eq!(b.metadata.labels.unwrap()[PLAN_LABEL], "nightly");
        assert_eq!(
            b.metadata.annotations.unwrap()[SCHEDULED_ANNOTATION],
            "2026-12-02T21:05:30Z"
        );
        let s = b.spec.unwrap();
        assert_eq!((s.target.as_str(), s.virtual_machines.len()), ("t", 1));
    }

    fn run(name: &str, phase: &str, at: &str) -> Run {
        Run {
            name: name.into(),
            backup_name: format!("ns-{name}"),
            phase: phase.into(),
            at: ts(at),
            message: String::new(),
        }
    }

    #[test]
    fn pruning_keeps_the_gfs_set_and_a_few_failures() {
        let runs = vec![
            run("r1", phase::SUCCEEDED, "2026-01-01T00:00:00Z"),
            run("r2", phase::FAILED, "2026-01-01T01:00:00Z"),
            run("r3", phase::SUCCEEDED, "2026-01-01T02:00:00Z"),
            run("r4", phase::SUCCEEDED, "2026-01-01T03:00:00Z"),
            run("r5", phase::RUNNING, "2026-01-01T04:00:00Z"),
            run("f1", phase::FAILED, "2025-12-01T00:00:00Z"),
            run("f2", phase::FAILED, "2025-12-02T00:00:00Z"),
            run("f3", phase::FAILED, "2025-12-03T00:00:00Z"),
        ];
        let keep = keep_of(Some(&Retention {
            keep_last: Some(2),
            ..Default::default()
        }));
        let names: Vec<String> = to_prune(&runs, &keep, &TimeZone::UTC)
            .into_iter()
            .map(|r| r.name)
            .collect();
        assert_eq!(names, ["r1", "f1"]);
        // no retention: only surplus failures go
        let names: Vec<String> = to_prune(&runs, &keep_of(None), &TimeZone::UTC)
            .into_iter()
            .map(|r| r.name)
            .collect();
        assert_eq!(names, ["f1"]);
        assert_eq!(last_finished(&runs).unwrap().name, "r4");
        assert_eq!(in_progress(&runs).unwrap().name, "r5");
        // negative counts are no rule
        let k = keep_of(Some(&Retention {
            daily: Some(-3),
            ..Default::default()
        }));
        assert!(k.keeps_all());
    }
}
