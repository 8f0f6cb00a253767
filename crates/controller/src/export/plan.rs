//! The pure decision of the export controller: an export's status from its source's state,
//! the time and where the API server is — phase, conditions, links, TTL expiry — and
//! whether the export is over (deleted at expiry, as KubeVirt does).

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use ferrovirt_api::kubevirt::export::{
    self as ex, ExportLink, ExportLinks, ExportManifest, ExportStatus, ExportVolume,
    ExportVolumeFormat, VirtualMachineExport, format, manifest, phase,
};

use crate::conditions;

/// What the export's source looks like now ([`super::resolve`] reads it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceState {
    /// The source object (or a claim it needs) does not exist.
    NotFound(String),
    /// A VM using the volumes runs: its disks are being written (never read torn).
    InUse(String),
    /// Claims unbound, snapshot not ready yet.
    NotReady(String),
    /// Nothing to export (a VM without claim volumes): `Skipped`.
    Nothing(String),
    /// Ready to serve these volumes (by claim name).
    Ready {
        vm_name: Option<String>,
        volumes: Vec<String>,
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
        };
    }
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
        SourceState::NotReady(m) => {
            set("Ready", false, "NotReady", m);
            set("PVCReady", false, "pvcPending", m);
            pending(&mut status);
        }
        SourceState::Nothing(m) => {
            set("Ready", false, "NoVolumes", m);
            status.phase = Some(phase::SKIPPED.into());
        }
        SourceState::Ready { vm_name, volumes } => {
            set(
                "Ready",
                true,
                "ExportReady",
                "the volumes can be downloaded",
            );
            set("PVCReady", true, "pvcBound", "the volumes are bound");
            status.phase = Some(phase::READY.into());
            status.links = Some(links(ep, ns, name, volumes));
            status.virtual_machine_name = vm_name.clone().or(status.virtual_machine_name);
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
}
