//! export.kubevirt.io VirtualMachineExport (served as `v1`, the stored version, and `v1beta1`):
//! the types, the names of KubeVirt's formats, manifest types, phases and the token header,
//! the `ttlDuration` default, and admission (docs/export.md).

use k8s_openapi::api::core::v1::TypedLocalObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::vmi::Condition;

resource! {
    /// Exports a PVC, a VM's volumes or a VM snapshot's volumes over HTTPS for download.
    VirtualMachineExport, ExportSpec, ExportStatus
}

kstruct! {
    /// What to export and how long.
    pub struct ExportSpec {
        /// The exported object: `PersistentVolumeClaim` (core), `VirtualMachine`
        /// (kubevirt.io) or `VirtualMachineSnapshot` (snapshot.kubevirt.io) in the export's
        /// namespace.
        pub source: TypedLocalObjectReference,
        /// A Secret (key `token`) holding the token downloads must present; generated when
        /// absent.
        pub token_secret_ref: Option<String>,
        /// How long the export lives from its creation (a duration; default 2h).
        pub ttl_duration: Option<String>,
    }
}

kstruct! {
    /// The export's state and download links.
    pub struct ExportStatus {
        /// `Pending`, `Ready`, `Terminated` or `Skipped`.
        pub phase: Option<String>,
        pub links: Option<ExportLinks>,
        /// The Secret holding the token.
        pub token_secret_ref: Option<String>,
        /// When the export ends (creation + ttlDuration).
        pub ttl_expiration_time: Option<Time>,
        pub service_name: Option<String>,
        /// The source VM (for a VirtualMachine or VirtualMachineSnapshot source).
        pub virtual_machine_name: Option<String>,
        pub conditions: Option<Vec<Condition>>,
    }
}

kstruct! {
    /// Links for clients inside and outside the cluster.
    pub struct ExportLinks {
        pub internal: Option<ExportLink>,
        pub external: Option<ExportLink>,
    }
}

kstruct! {
    /// The volumes and manifests one kind of client downloads, and the CA to trust.
    pub struct ExportLink {
        /// PEM of the CA that signed the serving certificate.
        #[serde(default)]
        pub cert: String,
        pub volumes: Option<Vec<ExportVolume>>,
        pub manifests: Option<Vec<ExportManifest>>,
    }
}

kstruct! {
    /// One exported volume and its formats.
    pub struct ExportVolume {
        pub name: String,
        pub formats: Option<Vec<ExportVolumeFormat>>,
    }
}

kstruct! {
    /// One format of a volume and its URL.
    pub struct ExportVolumeFormat {
        /// `raw`, `gzip`, `dir` or `tar.gz`.
        pub format: String,
        pub url: String,
    }
}

kstruct! {
    /// A manifest endpoint.
    pub struct ExportManifest {
        /// `all` or `auth-header-secret`.
        #[serde(rename = "type")]
        pub type_: String,
        pub url: String,
    }
}

/// The API group.
pub const GROUP: &str = "export.kubevirt.io";
/// The header (and query parameter) carrying the export token.
pub const TOKEN_HEADER: &str = "x-kubevirt-export-token";
/// The key of the token in its Secret.
pub const TOKEN_KEY: &str = "token";
/// KubeVirt's default `ttlDuration`: two hours.
pub const DEFAULT_TTL: std::time::Duration = std::time::Duration::from_secs(2 * 3600);

/// Phases.
pub mod phase {
    pub const PENDING: &str = "Pending";
    pub const READY: &str = "Ready";
    pub const TERMINATED: &str = "Terminated";
    pub const SKIPPED: &str = "Skipped";
}

/// Volume formats.
pub mod format {
    /// The raw disk image.
    pub const RAW: &str = "raw";
    /// The raw disk image, gzip-compressed.
    pub const GZIP: &str = "gzip";
    pub const DIR: &str = "dir";
    pub const TAR_GZ: &str = "tar.gz";
}

/// Manifest types.
pub mod manifest {
    /// The VM and its DataVolumes (and the CA ConfigMap).
    pub const ALL: &str = "all";
    /// A Secret with the token as a CDI extra header.
    pub const AUTH_HEADER: &str = "auth-header-secret";
}

/// The export's `ttlDuration` (default 2h).
pub fn ttl(spec: &ExportSpec) -> Result<std::time::Duration, String> {
    match spec.ttl_duration.as_deref() {
        None => Ok(DEFAULT_TTL),
        Some(s) => super::snapshot::parse_go_duration(s),
    }
}

/// Admission of a VirtualMachineExport: a known source kind with its group, a name, a
/// parseable non-zero `ttlDuration`, a valid token Secret name.
pub fn validate(obj: &serde_json::Value) -> Vec<crate::admission::FieldError> {
    use crate::admission::FieldError;
    let mut errs = Vec::new();
    let spec = &obj["spec"];
    let src = &spec["source"];
    let kind = src["kind"].as_str().unwrap_or("");
    let group = src["apiGroup"].as_str();
    let expected = match kind {
        "PersistentVolumeClaim" => Some(""),
        "VirtualMachine" => Some("kubevirt.io"),
        "VirtualMachineSnapshot" => Some("snapshot.kubevirt.io"),
        _ => None,
    };
    match expected {
        None => errs.push(FieldError::not_supported(
            "spec.source.kind",
            format!(
                "{kind:?}: supported values: \"PersistentVolumeClaim\", \"VirtualMachine\", \"VirtualMachineSnapshot\""
            ),
        )),
        Some(g) if group.is_some_and(|group| group != g) => errs.push(FieldError::invalid(
            "spec.source.apiGroup",
            format!("{:?}: a {kind} source needs apiGroup {g:?}", group.unwrap_or_default()),
        )),
        Some(_) => {}
    }
    if src["name"].as_str().unwrap_or("").is_empty() {
        errs.push(FieldError::required("spec.source.name", "name is required"));
    }
    if let Some(d) = spec["ttlDuration"].as_str() {
        match super::snapshot::parse_go_duration(d) {
            Err(e) => errs.push(FieldError::invalid("spec.ttlDuration", e)),
            Ok(d) if d.is_zero() => errs.push(FieldError::invalid(
                "spec.ttlDuration",
                "must be longer than zero",
            )),
            Ok(_) => {}
        }
    }
    if let Some(s) = spec["tokenSecretRef"].as_str()
        && (s.is_empty()
            || s.len() > 253
            || !s
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.'))
    {
        errs.push(FieldError::invalid(
            "spec.tokenSecretRef",
            format!("{s:?} is not a Secret name"),
        ));
    }
    errs
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(v: serde_json::Value) -> Vec<String> {
        validate(&v).into_iter().map(|e| e.field).collect()
    }

    #[test]
    fn admission_names_the_bad_field() {
        let ok = json!({"spec": {"source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "vm"}}});
        assert!(fields(ok).is_empty());
        let pvc = json!({"spec": {"source": {"kind": "PersistentVolumeClaim", "name": "p"}, "ttlDuration": "10m"}});
        assert!(fields(pvc).is_empty());
        let kind = json!({"spec": {"source": {"kind": "Pod", "name": "p"}}});
        assert_eq!(fields(kind), ["spec.source.kind"]);
        let group = json!({"spec": {"source": {"apiGroup": "x.io", "kind": "VirtualMachine", "name": "p"}}});
        assert_eq!(fields(group), ["spec.source.apiGroup"]);
        let ttl = json!({"spec": {"source": {"kind": "PersistentVolumeClaim", "name": "p"}, "ttlDuration": "soon"}});
        assert_eq!(fields(ttl), ["spec.ttlDuration"]);
        let zero = json!({"spec": {"source": {"kind": "PersistentVolumeClaim", "name": "p"}, "ttlDuration": "0s"}});
        assert_eq!(fields(zero), ["spec.ttlDuration"]);
        let secret = json!({"spec": {"source": {"kind": "PersistentVolumeClaim", "name": "p"}, "tokenSecretRef": "../x"}});
        assert_eq!(fields(secret), ["spec.tokenSecretRef"]);
        let noname = json!({"spec": {"source": {"kind": "PersistentVolumeClaim"}}});
        assert_eq!(fields(noname), ["spec.source.name"]);
    }

    #[test]
    fn ttl_defaults_to_two_hours() {
        assert_eq!(ttl(&ExportSpec::default()).unwrap(), DEFAULT_TTL);
        let s = ExportSpec {
            ttl_duration: Some("90s".into()),
            ..Default::default()
        };
        assert_eq!(ttl(&s).unwrap().as_secs(), 90);
    }
}
