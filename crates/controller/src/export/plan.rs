//! The pure decision of the export controller: an export's status from its source's state,
//! the time and where the API server is — phase, conditions, links, TTL expiry — whether the
//! export is over (deleted at expiry, as KubeVirt does), and the online VirtualMachineSnapshot
//! a running VM's export goes through ([`export_snapshot`]).

use std::time::Duration;

use k8s_openapi::api::core::v1::TypedLocalObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use ferrovirt_api::kubevirt::export::{
    self as ex, ExportLink, ExportLinks, ExportManifest, ExportStatus, ExportVolume,
    ExportVolumeFormat, VirtualMachineExport, format, manifest, phase,
};
use ferrovirt_api::kubevirt::snapshot::{SnapshotSpec, VirtualMachineSnapshot};

use crate::conditions;

/// What the export's source looks like now ([`super::resolve`] reads it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceState {
    /// The source object (or a claim it needs) does not exist.
    NotFound(String),
    /// A VM using the volumes runs: its disks are being written (never read torn).
    InUse(String),
    /// The exported VM runs and its export has no snapshot yet: the controller takes the
    /// online snapshot [`snapshot_name`] of VM `vm`.
    NeedsSnapshot { vm: String },
    /// The export's online snapshot is being taken.
    SnapshotInProgress(String),
    /// The export's online snapshot failed (the reason): nothing is served.
    SnapshotFailed(String),
    /// Claims unbound, snapshot not ready yet.
    NotReady(String),
    /// Nothing to export (a VM without claim volumes): `Skipped`.
    Nothing(String),
    /// Ready to serve these volumes (by claim name).
    Ready {
        vm_name: Option<String>,
        volumes: Vec<String>,
        /// The export's own online snapshot the volumes are read from (a running VM).
        via_snapshot: Option<String>,
    },
}

/// Where and how the export is reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// `https://host:port` of the API server.
    pub base_url: String,
    /// PEM of the CA that signed its certificate.
    pub ca_pem: String,
}

/// The step's result.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub status: ExportStatus,
    /// The TTL passed: the export is over and is deleted.
    pub expired: bool,
    /// When to look again (TTL expiry, or a pending source).
    pub requeue: Option<Duration>,
    /// The online snapshot to create (a running VM's export).
    pub create_snapshot: Option<Box<VirtualMachineSnapshot>>,
    /// An Event to record on the export (`warning`, reason, message): said once, when the
    /// Ready condition's reason changes to it.
    pub event: Option<(bool, &'static str, String)>,
}

/// Ready condition reasons of the snapshot path.
pub const REASON_SNAPSHOT_IN_PROGRESS: &str = "SnapshotInProgress";
pub const REASON_SNAPSHOT_FAILED: &str = "SnapshotFailed";

/// The online VirtualMachineSnapshot a running VM's export `export` goes through.
pub fn snapshot_name(export: &str) -> String {
    format!("vmexport-{export}")
}

/// The owner reference that ties an object to export `e` (deleted with it).
pub fn owner(e: &VirtualMachineExport) -> OwnerReference {
    OwnerReference {
        api_version: format!("{}/{}", ex::GROUP, super::resources::VERSION),
        kind: "VirtualMachineExport".into(),
        name: e.metadata.name.clone().unwrap_or_default(),
        uid: e.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// Whether `meta` is owned by export `e` (same uid).
pub fn owned_by(meta: &ObjectMeta, e: &VirtualMachineExport) -> bool {
    let uid = e.metadata.uid.as_deref().unwrap_or_default();
    !uid.is_empty()
        && meta
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.kind == "VirtualMachineExport" && o.uid == uid)
}

/// The online snapshot of running VM `vm` that export `e` serves: named
/// [`snapshot_name`], owned by the export (garbage-collected with it), `deletionPolicy:
/// Delete` (its content and volume snapshots go with it).
pub fn export_snapshot(e: &VirtualMachineExport, vm: &str) -> VirtualMachineSnapshot {
    let name = e.metadata.name.clone().unwrap_or_default();
    owned_vm_snapshot(
        ObjectMeta {
            name: Some(snapshot_name(&name)),
            namespace: e.metadata.namespace.clone(),
            owner_references: Some(vec![owner(e)]),
            labels: Some([("export.kubevirt.io/export".to_string(), name)].into()),
            ..Default::default()
        },
        vm,
    )
}

/// A VirtualMachineSnapshot of VM `vm` with `metadata` (its owner and labels), `deletionPolicy:
/// Delete`: what an export or a backup of a running VM takes and reads.
pub fn owned_vm_snapshot(metadata: ObjectMeta, vm: &str) -> VirtualMachineSnapshot {
    VirtualMachineSnapshot {
        api_version: Some("snapshot.kubevirt.io/v1beta1".into()),
        kind: Some("VirtualMachineSnapshot".into()),
        metadata,
        spec: Some(SnapshotSpec {
            source: TypedLocalObjectReference {
                api_group: Some("kubevirt.io".into()),
                kind: "VirtualMachine".into(),
                name: vm.to_string(),
            },
            deletion_policy: Some("Delete".into()),
            failure_deadline: None,
        }),
        status: None,
    }
}

/// How often a pending export looks at its source again.
pub const PENDING_RECHECK: Duration = Duration::from_secs(3);

/// The token Secret's name: `spec.tokenSecretRef`, else `export-token-<name>` (generated).
pub fn token_secret_name(export: &VirtualMachineExport) -> String {
    export
        .spec
        .as_ref()
        .and_then(|s| s.token_secret_ref.clone())
        .unwrap_or_else(|| {
            format!(
                "export-token-{}",
                export.metadata.name.as_deref().unwrap_or("")
            )
        })
}

/// When the export ends: creation + `ttlDuration` (default 2h); `None` without a creation
/// time or with an unparsable TTL (refused at admission).
pub fn expiry(export: &VirtualMachineExport) -> Option<Timestamp> {
    let created = export.metadata.creation_timestamp.as_ref()?.0;
    let ttl = ex::ttl(export.spec.as_ref()?).ok()?;
    created
        .checked_add(SignedDuration::try_from(ttl).ok()?)
        .ok()
}

/// The path of export `ns/name` on the API server, below which volumes and manifests are.
pub fn export_path(ns: &str, name: &str) -> String {
    format!(
        "/api/{}/{}/namespaces/{ns}/virtualmachineexports/{name}",
        ex::GROUP,
        super::resources::VERSION
    )
}

/// The links of a ready export of `volumes` (claim names).
pub fn links(ep: &Endpoint, ns: &str, name: &str, volumes: &[String]) -> ExportLinks {
    let base = format!(
        "{}{}",
        ep.base_url.trim_end_matches('/'),
        export_path(ns, name)
    );
    let link = |scope: &str| ExportLink {
        cert: ep.ca_pem.clone(),
        volumes: Some(
            volumes
                .iter()
                .map(|v| ExportVolume {
                    name: v.clone(),
                    formats: Some(vec![
                        ExportVolumeFormat {
                            format: format::RAW.into(),
                            url: format!("{base}/volumes/{v}/disk.img"),
                        },
                        ExportVolumeFormat {
                            format: format::GZIP.into(),
                            url: format!("{base}/volumes/{v}/disk.img.gz"),
                        },
                    ]),
                })
                .collect(),
        ),
        manifests: Some(vec![
            ExportManifest {
                type_: manifest::ALL.into(),
                url: format!("{base}/{scope}/manifests/all"),
            },
            ExportManifest {
                type_: manifest::AUTH_HEADER.into(),
                url: format!("{base}/{scope}/manifests/secret"),
            },
        ]),
    };
    ExportLinks {
        internal: Some(link("internal")),
        external: Some(link("external")),
    }
}

/// The export's status now.
pub fn step(
    export: &VirtualMachineExport,
    source: &SourceState,
    ep: &Endpoint,
    now: Timestamp,
) -> Decision {
    let old = export.status.clone().unwrap_or_default();
    let ns = export.metadata.namespace.as_deref().unwrap_or("");
    let name = export.metadata.name.as_deref().unwrap_or("");
    let now_t = Time(now);
    let mut conds = old.conditions.clone().unwrap_or_default();
    let until = expiry(export);
    let mut status = ExportStatus {
        token_secret_ref: Some(token_secret_name(export)),
        ttl_expiration_time: until.map(Time),
        virtual_machine_name: old.virtual_machine_name.clone(),
        conditions: None,
        ..Default::default()
    };
    let mut set = |t: &str, ok: bool, reason: &str, msg: &str| {
        conditions::set(
            &mut conds,
            conditions::condition(t, ok, Some(reason), Some(msg)),
            &now_t,
        );
    };
    if until.is_some_and(|u| now >= u) {
        set(
            "Ready",
            false,
            "TTLExpired",
            "the export's ttlDuration has passed",
        );
        status.phase = Some(phase::TERMINATED.into());
        status.conditions = Some(conds);
        return Decision {
            status,
            expired: true,
            requeue: None,
            create_snapshot: None,
            event: None,
        };
    }
    let old_reason = conditions::find(old.conditions.as_deref(), "Ready")
        .and_then(|c| c.reason.clone())
        .unwrap_or_default();
    let mut create_snapshot = None;
    let mut event = None;
    let pending = |status: &mut ExportStatus| status.phase = Some(phase::PENDING.into());
    match source {
        SourceState::NotFound(m) => {
            set("Ready", false, "SourceNotFound", m);
            set("PVCReady", false, "pvcNotFound", m);
            pending(&mut status);
        }
        SourceState::InUse(m) => {
            set("Ready", false, "inUse", m);
            set("PVCReady", true, "pvcBound", "the volumes are bound");
            pending(&mut status);
        }
        SourceState::NeedsSnapshot { vm } => {
            let snap = snapshot_name(name);
            let m = format!(
                "VirtualMachine {vm} is running: its disks are exported through the online \
                 VirtualMachineSnapshot {snap} (never read while written)"
            );
            set("Ready", false, REASON_SNAPSHOT_IN_PROGRESS, &m);
            set("PVCReady", true, "pvcBound", "the volumes are bound");
            pending(&mut status);
            create_snapshot = Some(Box::new(export_snapshot(export, vm)));
            event = Some((false, "SnapshotCreated", m));
        }
        SourceState::SnapshotInProgress(m) => {
            set("Ready", false, REASON_SNAPSHOT_IN_PROGRESS, m);
            set("PVCReady", true, "pvcBound", "the volumes are bound");
            pending(&mut status);
        }
        SourceState::SnapshotFailed(m) => {
            set("Ready", false, REASON_SNAPSHOT_FAILED, m);
            set("PVCReady", true, "pvcBound", "the volumes are bound");
            pending(&mut status);
            if old_reason != REASON_SNAPSHOT_FAILED {
                event = Some((true, REASON_SNAPSHOT_FAILED, m.clone()));
            }
        }
        SourceState::NotReady(m) => {
            set("Ready", false, "NotReady", m);
            set("PVCReady", false, "pvcPending", m);
            pending(&mut status);
        }
        SourceState::Nothing(m) => {
            set("Ready", false, "NoVolumes", m);
            status.phase = Some(phase::SKIPPED.into());
        }
        SourceState::Ready {
            vm_name,
            volumes,
            via_snapshot,
        } => {
            let m = match via_snapshot {
                Some(snap) => format!(
                    "the volumes can be downloaded: read from the online \
                     VirtualMachineSnapshot {snap} of the running VM"
                ),
                None => "the volumes can be downloaded".to_string(),
            };
            set("Ready", true, "ExportReady", &m);
            set("PVCReady", true, "pvcBound", "the volumes are bound");
            status.phase = Some(phase::READY.into());
            status.links = Some(links(ep, ns, name, volumes));
            status.virtual_machine_name = vm_name.clone().or(status.virtual_machine_name);
            if via_snapshot.is_some() && old_reason != "ExportReady" {
                event = Some((false, "ExportReady", m));
            }
        }
    }
    status.conditions = Some(conds);
    let to_expiry = until.map(|u| {
        let left = u.duration_since(now).as_secs_f64().max(0.0);
        Duration::from_secs_f64(left) + Duration::from_millis(100)
    });
    let requeue = match status.phase.as_deref() {
        Some(phase::PENDING) => Some(to_expiry.map_or(PENDING_RECHECK, |t| t.min(PENDING_RECHECK))),
        // A ready export re-checks its source now and then (a VM started meanwhile).
        _ => Some(to_expiry.map_or(Duration::from_secs(30), |t| t.min(Duration::from_secs(30)))),
    };
    Decision {
        status,
        expired: false,
        requeue,
        create_snapshot,
        event,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn export(ttl: Option<&str>) -> VirtualMachineExport {
        serde_json::from_value(json!({
            "metadata": {"name": "ex", "namespace": "ns", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "vm"},
                     "ttlDuration": ttl}
        }))
        .unwrap()
    }

    fn ep() -> Endpoint {
        Endpoint {
            base_url: "https://127.0.0.1:6443".into(),
            ca_pem: "PEM".into(),
        }
    }

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn a_ready_source_gets_raw_and_gzip_links_and_manifests() {
        let src = SourceState::Ready {
            vm_name: Some("vm".into()),
            volumes: vec!["root".into()],
            via_snapshot: None,
        };
        let d = step(&export(None), &src, &ep(), at("2026-01-01T00:00:05Z"));
        assert!(!d.expired);
        let s = &d.status;
        assert_eq!(s.phase.as_deref(), Some("Ready"));
        assert_eq!(s.token_secret_ref.as_deref(), Some("export-token-ex"));
        assert_eq!(s.virtual_machine_name.as_deref(), Some("vm"));
        assert_eq!(
            s.ttl_expiration_time.as_ref().unwrap().0,
            at("2026-01-01T02:00:00Z")
        );
        let ext = s.links.as_ref().unwrap().external.as_ref().unwrap();
        assert_eq!(ext.cert, "PEM");
        let v = &ext.volumes.as_ref().unwrap()[0];
        assert_eq!(v.name, "root");
        let f = v.formats.as_ref().unwrap();
        assert_eq!(f[0].format, "raw");
        assert_eq!(
            f[0].url,
            "https://127.0.0.1:6443/api/export.kubevirt.io/v1beta1/namespaces/ns/virtualmachineexports/ex/volumes/root/disk.img"
        );
        assert_eq!(f[1].format, "gzip");
        assert!(f[1].url.ends_with("/volumes/root/disk.img.gz"));
        let m = ext.manifests.as_ref().unwrap();
        assert_eq!(m[0].type_, "all");
        assert!(m[0].url.ends_with("/ex/external/manifests/all"));
        assert_eq!(m[1].type_, "auth-header-secret");
        assert!(m[1].url.ends_with("/ex/external/manifests/secret"));
        let int = s.links.as_ref().unwrap().internal.as_ref().unwrap();
        assert!(
            int.manifests.as_ref().unwrap()[0]
                .url
                .ends_with("/internal/manifests/all")
        );
        assert!(conditions::is_true(s.conditions.as_deref(), "Ready"));
    }

    #[test]
    fn a_running_vm_keeps_the_export_pending_without_links() {
        let src = SourceState::InUse("VirtualMachine vm is running".into());
        let d = step(&export(None), &src, &ep(), at("2026-01-01T00:00:05Z"));
        assert_eq!(d.status.phase.as_deref(), Some("Pending"));
        assert!(d.status.links.is_none());
        let c = conditions::find(d.status.conditions.as_deref(), "Ready").unwrap();
        assert_eq!(c.status, "False");
        assert_eq!(c.reason.as_deref(), Some("inUse"));
        assert_eq!(d.requeue, Some(PENDING_RECHECK));
    }

    #[test]
    fn ttl_expiry_terminates_and_deletes() {
        let src = SourceState::Ready {
            vm_name: None,
            volumes: vec!["root".into()],
            via_snapshot: None,
        };
        let e = export(Some("1m"));
        let d = step(&e, &src, &ep(), at("2026-01-01T00:00:30Z"));
        assert_eq!(d.status.phase.as_deref(), Some("Ready"));
        let r = d.requeue.unwrap();
        assert!(
            r > Duration::from_secs(29) && r <= Duration::from_secs(31),
            "{r:?}"
        );
        let d = step(&e, &src, &ep(), at("2026-01-01T00:01:00Z"));
        assert!(d.expired);
        assert_eq!(d.status.phase.as_deref(), Some("Terminated"));
        assert!(d.status.links.is_none());
    }

    #[test]
    fn missing_and_empty_sources() {
        let d = step(
            &export(None),
            &SourceState::NotFound("VirtualMachine vm not found".into()),
            &ep(),
            at("2026-01-01T00:00:05Z"),
        );
        assert_eq!(d.status.phase.as_deref(), Some("Pending"));
        let d = step(
            &export(None),
            &SourceState::Nothing("no volumes".into()),
            &ep(),
            at("2026-01-01T00:00:05Z"),
        );
        assert_eq!(d.status.phase.as_deref(), Some("Skipped"));
    }

    #[test]
    fn a_named_token_secret_is_used() {
        let mut e = export(None);
        e.spec.as_mut().unwrap().token_secret_ref = Some("mine".into());
        assert_eq!(token_secret_name(&e), "mine");
    }

    fn ready_reason(d: &Decision) -> (String, String) {
        let c = conditions::find(d.status.conditions.as_deref(), "Ready").unwrap();
        (
            c.reason.clone().unwrap_or_default(),
            c.message.clone().unwrap_or_default(),
        )
    }

    #[test]
    fn a_running_vm_is_exported_through_an_owned_online_snapshot() {
        let mut e = export(None);
        e.metadata.uid = Some("uid-ex".into());
        let now = at("2026-01-01T00:00:05Z");
        let d = step(
            &e,
            &SourceState::NeedsSnapshot { vm: "vm".into() },
            &ep(),
            now,
        );
        assert_eq!(d.status.phase.as_deref(), Some("Pending"));
        assert!(d.status.links.is_none());
        let (reason, msg) = ready_reason(&d);
        assert_eq!(reason, REASON_SNAPSHOT_IN_PROGRESS);
        assert!(msg.contains("vmexport-ex"), "{msg}");
        let snap = d.create_snapshot.as_deref().expect("a snapshot to take");
        assert_eq!(snap.metadata.name.as_deref(), Some("vmexport-ex"));
        assert_eq!(snap.metadata.namespace.as_deref(), Some("ns"));
        assert!(owned_by(&snap.metadata, &e));
        let spec = snap.spec.as_ref().unwrap();
        assert_eq!(spec.source.kind, "VirtualMachine");
        assert_eq!(spec.source.name, "vm");
        assert_eq!(spec.deletion_policy.as_deref(), Some("Delete"));
        assert_eq!(d.event.as_ref().map(|e| e.1), Some("SnapshotCreated"));
        assert_eq!(d.requeue, Some(PENDING_RECHECK));

        // Taken: Ready, the message names the snapshot, an Event says so once.
        e.status = Some(d.status);
        let src = SourceState::Ready {
            vm_name: Some("vm".into()),
            volumes: vec!["root".into()],
            via_snapshot: Some("vmexport-ex".into()),
        };
        let d = step(&e, &src, &ep(), now);
        assert_eq!(d.status.phase.as_deref(), Some("Ready"));
        assert!(d.create_snapshot.is_none());
        let (reason, msg) = ready_reason(&d);
        assert_eq!(reason, "ExportReady");
        assert!(msg.contains("VirtualMachineSnapshot vmexport-ex"), "{msg}");
        assert_eq!(d.event.as_ref().map(|e| e.1), Some("ExportReady"));
        e.status = Some(d.status);
        assert!(step(&e, &src, &ep(), now).event.is_none());
    }

    #[test]
    fn a_failed_snapshot_fails_the_export_with_the_reason_once() {
        let mut e = export(None);
        let src = SourceState::SnapshotFailed(
            "the online VirtualMachineSnapshot vmexport-ex failed: boom".into(),
        );
        let d = step(&e, &src, &ep(), at("2026-01-01T00:00:05Z"));
        assert_eq!(d.status.phase.as_deref(), Some("Pending"));
        assert!(d.status.links.is_none());
        assert!(d.create_snapshot.is_none());
        let (reason, msg) = ready_reason(&d);
        assert_eq!(reason, REASON_SNAPSHOT_FAILED);
        assert!(msg.contains("boom"), "{msg}");
        let ev = d.event.clone().expect("a warning");
        assert!(ev.0 && ev.2.contains("boom"), "{ev:?}");
        e.status = Some(d.status);
        assert!(
            step(&e, &src, &ep(), at("2026-01-01T00:00:08Z"))
                .event
                .is_none()
        );
    }

    #[test]
    fn only_the_exports_own_objects_are_owned() {
        let mut e = export(None);
        e.metadata.uid = Some("u1".into());
        let mut other = e.clone();
        other.metadata.uid = Some("u2".into());
        let snap = export_snapshot(&e, "vm");
        assert!(owned_by(&snap.metadata, &e));
        assert!(!owned_by(&snap.metadata, &other));
        assert!(!owned_by(&ObjectMeta::default(), &e));
    }
}
