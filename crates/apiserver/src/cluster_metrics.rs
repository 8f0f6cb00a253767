//! Cluster-level series of the API server's `/metrics`, computed from the store at each scrape
//! (the ones KubeVirt's virt-controller and CDI serve; docs/metrics.md): VMIs by phase and node
//! (`kubevirt_vmi_phase_count`), VMs by namespace (`kubevirt_number_of_vms`), migrations by
//! phase (and unset), their outcomes and end times, how long after its creation each reached each phase, DataVolumes pending and importing, StorageProfiles. [`render`]
//! is pure over the decoded objects; [`gather`] reads them (one list per kind per scrape).

use std::collections::BTreeMap;

use ferrovirt_store::ListOptions;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use serde_json::Value;

use crate::objects::decode;
use crate::resources;
use crate::server::Shared;

/// The objects the series are computed from.
#[derive(Debug, Default)]
pub(crate) struct Objects {
    pub vmis: Vec<Value>,
    pub vms: Vec<Value>,
    pub migrations: Vec<Value>,
    pub data_volumes: Vec<Value>,
    pub profiles: Vec<Value>,
    pub classes: Vec<Value>,
}

/// Reads every object of the kinds [`render`] needs (a kind the server lacks or cannot read
/// gives none).
pub(crate) async fn gather(sh: &Shared) -> Objects {
    async fn all(sh: &Shared, group: &str, version: &str, plural: &str) -> Vec<Value> {
        let Some(def) = sh.resources.lookup(group, version, plural).cloned() else {
            return Vec::new();
        };
        match sh
            .store
            .list(&resources::list_prefix(&def, None), ListOptions::default())
            .await
        {
            Ok(list) => list.items.iter().filter_map(|kv| decode(kv).ok()).collect(),
            Err(_) => Vec::new(),
        }
    }
    Objects {
        vmis: all(sh, "kubevirt.io", "v1", "virtualmachineinstances").await,
        vms: all(sh, "kubevirt.io", "v1", "virtualmachines").await,
        migrations: all(sh, "kubevirt.io", "v1", "virtualmachineinstancemigrations").await,
        data_volumes: all(sh, "cdi.kubevirt.io", "v1beta1", "datavolumes").await,
        profiles: all(sh, "cdi.kubevirt.io", "v1beta1", "storageprofiles").await,
        classes: all(sh, "storage.k8s.io", "v1", "storageclasses").await,
    }
}

type Labels = Vec<(&'static str, String)>;

fn text(v: &Value, ptr: &str) -> String {
    v.pointer(ptr)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

fn or_none(s: String) -> String {
    if s.is_empty() { "<none>".into() } else { s }
}

fn annotation(v: &Value, key: &str) -> String {
    or_none(
        v.pointer("/metadata/annotations")
            .and_then(|a| a.get(key))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
    )
}

fn gauge_family(reg: &mut Registry, name: &str, help: &str) -> Family<Labels, Gauge> {
    let f = Family::<Labels, Gauge>::default();
    reg.register(name, help, f.clone());
    f
}

fn gauge(reg: &mut Registry, name: &str, help: &str) -> Gauge {
    let g = Gauge::default();
    reg.register(name, help, g.clone());
    g
}

/// KubeVirt's buckets of the phase transition histograms, in seconds (0.5 s … 1 h).
const PHASE_TRANSITION_BUCKETS: [f64; 18] = [
    0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0,
    1200.0, 1800.0, 3600.0,
];

fn phase_transition_histogram() -> Histogram {
    Histogram::new(PHASE_TRANSITION_BUCKETS)
}

/// A migration's (phase, seconds from its creation to its entering that phase) for each
/// entry of `status.phaseTransitionTimestamps`; a clock skew that puts an entry before the
/// creation counts 0, as KubeVirt floors it. Entries without a phase or a readable time
/// are left out.
pub(crate) fn migration_phase_transitions(vmim: &Value) -> Vec<(String, f64)> {
    let parse = |v: Option<&Value>| v?.as_str()?.parse::<jiff::Timestamp>().ok();
    let Some(created) = parse(vmim.pointer("/metadata/creationTimestamp")) else {
        return Vec::new();
    };
    vmim.pointer("/status/phaseTransitionTimestamps")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|t| {
            let phase = t.get("phase")?.as_str()?.to_string();
            let at = parse(t.get("phaseTransitionTimestamp"))?;
            let secs = at.duration_since(created).as_secs_f64().max(0.0);
            Some((phase, secs))
        })
        .collect()
}

/// When a finished migration ended, Unix seconds: its `status.migrationState.endTimestamp`,
/// else the time it entered Succeeded or Failed (`None` while it runs, or without a readable
/// time).
pub(crate) fn migration_end_time(vmim: &Value) -> Option<f64> {
    let parse = |v: Option<&Value>| v?.as_str()?.parse::<jiff::Timestamp>().ok();
    let phase = vmim.pointer("/status/phase").and_then(Value::as_str)?;
    if phase != "Succeeded" && phase != "Failed" {
        return None;
    }
    let at = parse(vmim.pointer("/status/migrationState/endTimestamp")).or_else(|| {
        vmim.pointer("/status/phaseTransitionTimestamps")?
            .as_array()?
            .iter()
            .filter(|t| t.get("phase").and_then(Value::as_str) == Some(phase))
            .filter_map(|t| parse(t.get("phaseTransitionTimestamp")))
            .max()
    })?;
    Some(at.as_millisecond() as f64 / 1000.0)
}

/// The series of `o` in Prometheus text format.
pub(crate) fn render(o: &Objects) -> String {
    let mut reg = Registry::default();
    let phase_count = gauge_family(
        &mut reg,
        "kubevirt_vmi_phase_count",
        "Sum of VMIs per phase and node.",
    );
    for vmi in &o.vmis {
        let labels: Labels = vec![
            ("node", text(vmi, "/status/nodeName")),
            ("phase", or_none(text(vmi, "/status/phase").to_lowercase())),
            ("os", annotation(vmi, "vm.kubevirt.io/os")),
            ("workload", annotation(vmi, "vm.kubevirt.io/workload")),
            ("flavor", annotation(vmi, "vm.kubevirt.io/flavor")),
            ("instance_type", {
                let a = annotation(vmi, "kubevirt.io/instancetype-name");
                if a == "<none>" {
                    annotation(vmi, "kubevirt.io/cluster-instancetype-name")
                } else {
                    a
                }
            }),
            ("preference", {
                let a = annotation(vmi, "kubevirt.io/preference-name");
                if a == "<none>" {
                    annotation(vmi, "kubevirt.io/cluster-preference-name")
                } else {
                    a
                }
            }),
        ];
        phase_count.get_or_create(&labels).inc();
    }
    let vms = gauge_family(
        &mut reg,
        "kubevirt_number_of_vms",
        "The number of VMs in the cluster by namespace.",
    );
    for vm in &o.vms {
        vms.get_or_create(&vec![("namespace", text(vm, "/metadata/namespace"))])
            .inc();
    }
    let unset = gauge(
        &mut reg,
        "kubevirt_vmi_migrations_in_unset_phase",
        "Number of current unset phase migrations.",
    );
    let pending = gauge(
        &mut reg,
        "kubevirt_vmi_migrations_in_pending_phase",
        "Number of current pending migrations.",
    );
    let scheduling = gauge(
        &mut reg,
        "kubevirt_vmi_migrations_in_scheduling_phase",
        "Number of current scheduling migrations.",
    );
    let running = gauge(
        &mut reg,
        "kubevirt_vmi_migrations_in_running_phase",
        "Number of current running migrations.",
    );
    let succeeded = gauge_family(
        &mut reg,
        "kubevirt_vmi_migration_succeeded",
        "Indicates if the VMI migration succeeded.",
    );
    let failed = gauge_family(
        &mut reg,
        "kubevirt_vmi_migration_failed",
        "Indicates if the VMI migration failed.",
    );
    let end_time: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>> = Family::default();
    reg.register(
        "kubevirt_vmi_migration_end_time_seconds",
        "The time at which the migration ended.",
        end_time.clone(),
    );
    let transitions: Family<Labels, Histogram, fn() -> Histogram> =
        Family::new_with_constructor(phase_transition_histogram);
    reg.register(
        "kubevirt_vmi_migration_phase_transition_time_from_creation_seconds",
        "Histogram of VM migration phase transitions duration from creation time in seconds.",
        transitions.clone(),
    );
    for m in &o.migrations {
        for (phase, secs) in migration_phase_transitions(m) {
            transitions
                .get_or_create(&vec![("phase", phase)])
                .observe(secs);
        }
        let labels = || -> Labels {
            vec![
                ("vmi", text(m, "/spec/vmiName")),
                ("namespace", text(m, "/metadata/namespace")),
                ("vmim", text(m, "/metadata/name")),
            ]
        };
        if let Some(t) = migration_end_time(m) {
            end_time.get_or_create(&labels()).set(t);
        }
        match text(m, "/status/phase").as_str() {
            "" => unset.inc(),
            "Pending" => pending.inc(),
            "Scheduling" | "Scheduled" | "PreparingTarget" | "TargetReady" => scheduling.inc(),
            "Running" => running.inc(),
            "Succeeded" => succeeded.get_or_create(&labels()).set(1),
            "Failed" => failed.get_or_create(&labels()).set(1),
            _ => 0,
        };
    }
    let dv_pending = gauge(
        &mut reg,
        "kubevirt_cdi_datavolume_pending",
        "Number of DataVolumes pending (phase Pending).",
    );
    let progress = gauge_family(
        &mut reg,
        "kubevirt_cdi_import_progress_total",
        "The import progress in percentage.",
    );
    for dv in &o.data_volumes {
        let phase = text(dv, "/status/phase");
        if phase.is_empty() || phase == "Pending" {
            dv_pending.inc();
        }
        let pct = text(dv, "/status/progress");
        let pct = pct.trim_end_matches('%').parse::<f64>().ok();
        if let (Some(p), false) = (
            pct,
            dv.pointer("/spec/source/http").is_none()
                && dv.pointer("/spec/source/registry").is_none()
                && dv.pointer("/spec/source/upload").is_none(),
        ) {
            progress
                .get_or_create(&vec![("ownerUID", text(dv, "/metadata/uid"))])
                .set(p.floor() as i64);
        }
    }
    let profile_info = gauge_family(
        &mut reg,
        "kubevirt_cdi_storageprofile_info",
        "StorageProfiles info labels: storageclass, provisioner, complete indicates if all \
         storage profiles recommended PVC settings are complete, default indicates if it's the \
         Kubernetes default storage class, virtdefault indicates if it's the default virtualization \
         storage class, rwx indicates if the storage class supports ReadWriteMany, smartclone \
         indicates if it supports snapshot or CSI based clone, degraded indicates it is not \
         optimal for virtualization.",
    );
    let classes: BTreeMap<String, &Value> = o
        .classes
        .iter()
        .map(|c| (text(c, "/metadata/name"), c))
        .collect();
    for p in &o.profiles {
        let name = text(p, "/metadata/name");
        let class = classes.get(&name);
        let class_annotation = |key: &str| {
            class
                .and_then(|c| c.pointer("/metadata/annotations"))
                .and_then(|a| a.get(key))
                .and_then(Value::as_str)
                == Some("true")
        };
        let sets = p
            .pointer("/status/claimPropertySets")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let complete = !sets.is_empty();
        let rwx = sets.iter().any(|s| {
            s["accessModes"]
                .as_array()
                .is_some_and(|m| m.iter().any(|x| x == "ReadWriteMany"))
        });
        let smartclone = matches!(
            text(p, "/status/cloneStrategy").as_str(),
            "snapshot" | "csi-clone"
        );
        let b = |x: bool| x.to_string();
        profile_info
            .get_or_create(&vec![
                ("storageclass", name.clone()),
                ("provisioner", text(p, "/status/provisioner")),
                ("complete", b(complete)),
                (
                    "default",
                    b(class_annotation(
                        "storageclass.kubernetes.io/is-default-class",
                    )),
                ),
                (
                    "virtdefault",
                    b(class_annotation(
                        "storageclass.kubevirt.io/is-default-virt-class",
                    )),
                ),
                ("rwx", b(rwx)),
                ("smartclone", b(smartclone)),
                ("degraded", b(!complete)),
            ])
            .set(1);
    }
    let mut out = String::new();
    if encode(&mut out, &reg).is_err() {
        return String::new();
    }
    // The registry's `# EOF` closes the whole scrape, not this part of it.
    out.trim_end().trim_end_matches("# EOF").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn line<'a>(text: &'a str, start: &str) -> Vec<&'a str> {
        text.lines().filter(|l| l.starts_with(start)).collect()
    }

    #[test]
    fn series_from_the_objects() {
        let o = Objects {
            vmis: vec![
                json!({"metadata": {"annotations": {"kubevirt.io/cluster-instancetype-name": "u1.nano"}},
                       "status": {"phase": "Running", "nodeName": "node1"}}),
                json!({"metadata": {}, "status": {"phase": "Running", "nodeName": "node1"}}),
                json!({"metadata": {}, "status": {"phase": "Scheduling"}}),
            ],
            vms: vec![
                json!({"metadata": {"namespace": "default"}}),
                json!({"metadata": {"namespace": "default"}}),
            ],
            migrations: vec![
                json!({"metadata": {"name": "m1", "namespace": "default"}, "spec": {"vmiName": "a"},
                       "status": {"phase": "Succeeded",
                                  "migrationState": {"endTimestamp": "2026-01-01T00:00:45.25Z"}}}),
                json!({"metadata": {"name": "m0", "namespace": "default"}, "spec": {"vmiName": "a"},
                       "status": {"phase": "Pending"}}),
                json!({"metadata": {"name": "m2", "namespace": "default"}, "spec": {"vmiName": "a"},
                       "status": {"phase": "PreparingTarget"}}),
                json!({"metadata": {"name": "m3", "namespace": "default"}, "spec": {"vmiName": "b"}}),
            ],
            data_volumes: vec![
                json!({"metadata": {"uid": "u-1"}, "spec": {"source": {"http": {"url": "x"}}},
                       "status": {"phase": "ImportInProgress", "progress": "42.5%"}}),
                json!({"metadata": {"uid": "u-2"}, "spec": {"source": {"blank": {}}},
                       "status": {"phase": "Pending"}}),
            ],
            profiles: vec![json!({"metadata": {"name": "shared"},
                "status": {"provisioner": "ferrovirt.io/shared", "cloneStrategy": "copy",
                           "claimPropertySets": [{"accessModes": ["ReadWriteMany"], "volumeMode": "Filesystem"}]}})],
            classes: vec![json!({"metadata": {"name": "shared",
                "annotations": {"storageclass.kubevirt.io/is-default-virt-class": "true"}}})],
        };
        let t = render(&o);
        assert!(t.contains("kubevirt_vmi_phase_count{node=\"node1\",phase=\"running\",os=\"<none>\",workload=\"<none>\",flavor=\"<none>\",instance_type=\"u1.nano\",preference=\"<none>\"} 1"), "{t}");
        assert!(t.contains("kubevirt_vmi_phase_count{node=\"node1\",phase=\"running\",os=\"<none>\",workload=\"<none>\",flavor=\"<none>\",instance_type=\"<none>\",preference=\"<none>\"} 1"), "{t}");
        assert!(t.contains("phase=\"scheduling\""), "{t}");
        assert_eq!(
            line(&t, "kubevirt_number_of_vms{"),
            vec!["kubevirt_number_of_vms{namespace=\"default\"} 2"]
        );
        assert_eq!(
            line(&t, "kubevirt_vmi_migrations_in_pending_phase "),
            vec!["kubevirt_vmi_migrations_in_pending_phase 1"]
        );
        assert_eq!(
            line(&t, "kubevirt_vmi_migrations_in_unset_phase "),
            vec!["kubevirt_vmi_migrations_in_unset_phase 1"]
        );
        assert_eq!(
            line(&t, "kubevirt_vmi_migration_end_time_seconds{"),
            vec![
                "kubevirt_vmi_migration_end_time_seconds{vmi=\"a\",namespace=\"default\",vmim=\"m1\"} 1767225645.25"
            ]
        );
        assert_eq!(
            line(&t, "kubevirt_vmi_migrations_in_scheduling_phase "),
            vec!["kubevirt_vmi_migrations_in_scheduling_phase 1"]
        );
        assert_eq!(
            line(&t, "kubevirt_vmi_migrations_in_running_phase "),
            vec!["kubevirt_vmi_migrations_in_running_phase 0"]
        );
        assert_eq!(
            line(&t, "kubevirt_vmi_migration_succeeded{"),
            vec!["kubevirt_vmi_migration_succeeded{vmi=\"a\",namespace=\"default\",vmim=\"m1\"} 1"]
        );
        assert_eq!(
            line(&t, "kubevirt_cdi_datavolume_pending "),
            vec!["kubevirt_cdi_datavolume_pending 1"]
        );
        assert_eq!(
            line(&t, "kubevirt_cdi_import_progress_total{"),
            vec!["kubevirt_cdi_import_progress_total{ownerUID=\"u-1\"} 42"]
        );
        assert!(t.contains("kubevirt_cdi_storageprofile_info{storageclass=\"shared\",provisioner=\"ferrovirt.io/shared\",complete=\"true\",default=\"false\",virtdefault=\"true\",rwx=\"true\",smartclone=\"false\",degraded=\"false\"} 1"), "{t}");
        assert!(!t.contains("# EOF"), "{t}");
    }

    #[test]
    fn migration_phase_transitions_from_creation() {
        let m = json!({"metadata": {"name": "m1", "creationTimestamp": "2026-01-01T00:00:10Z"},
            "status": {"phase": "Succeeded", "phaseTransitionTimestamps": [
                {"phase": "Pending", "phaseTransitionTimestamp": "2026-01-01T00:00:09Z"},
                {"phase": "Scheduling", "phaseTransitionTimestamp": "2026-01-01T00:00:10.5Z"},
                {"phase": "Running", "phaseTransitionTimestamp": "2026-01-01T00:00:13Z"},
                {"phase": "Succeeded", "phaseTransitionTimestamp": "2026-01-01T00:00:45Z"},
                {"phaseTransitionTimestamp": "2026-01-01T00:00:46Z"},
                {"phase": "Failed", "phaseTransitionTimestamp": "garbage"}]}});
        assert_eq!(
            migration_phase_transitions(&m),
            vec![
                ("Pending".to_string(), 0.0),
                ("Scheduling".to_string(), 0.5),
                ("Running".to_string(), 3.0),
                ("Succeeded".to_string(), 35.0),
            ]
        );
        assert!(migration_phase_transitions(&json!({"status": m["status"]})).is_empty());
        // No endTimestamp: the time it entered its final phase.
        assert_eq!(migration_end_time(&m), Some(1767225645.0));
        let running = json!({"status": {"phase": "Running",
            "migrationState": {"endTimestamp": "2026-01-01T00:00:45Z"}}});
        assert_eq!(migration_end_time(&running), None);
        let t = render(&Objects {
            migrations: vec![m],
            ..Default::default()
        });
        let name = "kubevirt_vmi_migration_phase_transition_time_from_creation_seconds";
        let value = |series: &str, labels: &[&str]| -> Vec<String> {
            t.lines()
                .filter(|l| l.starts_with(&format!("{name}{series}{{")))
                .filter(|l| labels.iter().all(|want| l.contains(want)))
                .filter_map(|l| l.rsplit(' ').next().map(str::to_string))
                .collect()
        };
        let succeeded = r#"phase="Succeeded""#;
        assert_eq!(value("_bucket", &[succeeded, r#"le="40.0""#]), ["1"], "{t}");
        assert_eq!(value("_bucket", &[succeeded, r#"le="30.0""#]), ["0"], "{t}");
        assert_eq!(value("_sum", &[r#"phase="Running""#]), ["3.0"], "{t}");
        assert_eq!(value("_count", &[r#"phase="Pending""#]), ["1"], "{t}");
        assert!(t.contains(&format!("# TYPE {name} histogram")), "{t}");
    }
}
