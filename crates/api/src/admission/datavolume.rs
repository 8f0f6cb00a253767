//! Validation of DataVolume specs (standalone or as a VM's dataVolumeTemplates), as CDI's
//! webhook does it.

use super::FieldError;
use super::validate::check_quantity;
use crate::cdi::DataVolumeSpec;

/// Validate a DataVolume spec at path `p`.
pub(super) fn validate_dv_spec(p: &str, spec: &DataVolumeSpec) -> Vec<FieldError> {
    let mut e = Vec::new();
    let mut clone_source = false;
    match (&spec.source, &spec.source_ref) {
        (None, None) => e.push(FieldError::required(
            format!("{p}.source"),
            "Data volume should have either Source or SourceRef",
        )),
        (Some(_), Some(_)) => e.push(FieldError::invalid(
            format!("{p}.source"),
            "Data volume should have either Source or SourceRef, not both",
        )),
        (Some(src), None) => {
            let kinds = src.kinds();
            if kinds.len() != 1 {
                e.push(FieldError::invalid(
                    format!("{p}.source"),
                    format!(
                        "Data volume must have exactly one source type set, found {}",
                        kinds.len()
                    ),
                ));
            }
            clone_source = src.pvc.is_some() || src.snapshot.is_some();
            if let Some(http) = &src.http
                && !(http.url.starts_with("http://") || http.url.starts_with("https://"))
            {
                e.push(FieldError::invalid(
                    format!("{p}.source.http.url"),
                    format!("Invalid value: \"{}\": must be an http(s) URL", http.url),
                ));
            }
            if let Some(reg) = &src.registry {
                match (&reg.url, &reg.image_stream) {
                    (Some(u), None) => {
                        if !(u.starts_with("docker://") || u.starts_with("oci-archive://")) {
                            e.push(FieldError::invalid(
                                format!("{p}.source.registry.url"),
                                format!(
                                    "Invalid value: \"{u}\": must start with docker:// or \
                                     oci-archive://"
                                ),
                            ));
                        }
                    }
                    (None, Some(_)) => {}
                    _ => e.push(FieldError::invalid(
                        format!("{p}.source.registry"),
                        "exactly one of url or imageStream must be set",
                    )),
                }
            }
            for (k, src) in [("pvc", &src.pvc), ("snapshot", &src.snapshot)] {
                if let Some(s) = src
                    && s.name.is_empty()
                {
                    e.push(FieldError::required(
                        format!("{p}.source.{k}.name"),
                        "name is required",
                    ));
                }
            }
        }
        (None, Some(r)) => {
            clone_source = true;
            if r.kind != "DataSource" {
                e.push(FieldError::not_supported(
                    format!("{p}.sourceRef.kind"),
                    "Unsupported value: supported values: \"DataSource\"",
                ));
            }
            if r.name.is_empty() {
                e.push(FieldError::required(
                    format!("{p}.sourceRef.name"),
                    "name is required",
                ));
            }
        }
    }
    match (&spec.pvc, &spec.storage) {
        (None, None) => e.push(FieldError::required(
            p.to_string(),
            "Data volume should have either Storage or PVC",
        )),
        (Some(_), Some(_)) => e.push(FieldError::invalid(
            format!("{p}.storage"),
            "Data volume should have either Storage or PVC, not both",
        )),
        (Some(pvc), None) => {
            check_access_modes(
                &format!("{p}.pvc.accessModes"),
                pvc.access_modes.as_deref(),
                true,
                &mut e,
            );
            let size = pvc
                .resources
                .as_ref()
                .and_then(|r| r.requests.as_ref())
                .and_then(|r| r.get("storage"));
            match size {
                Some(q) => {
                    check_size(format!("{p}.pvc.resources.requests.storage"), &q.0, &mut e);
                }
                None if !clone_source => e.push(FieldError::required(
                    format!("{p}.pvc.resources.requests.storage"),
                    "PVC size is missing",
                )),
                None => {}
            }
        }
        (None, Some(st)) => {
            if let Some(q) = st
                .resources
                .as_ref()
                .and_then(|r| r.requests.as_ref())
                .and_then(|r| r.get("storage"))
            {
                check_size(
                    format!("{p}.storage.resources.requests.storage"),
                    &q.0,
                    &mut e,
                );
            }
            check_access_modes(
                &format!("{p}.storage.accessModes"),
                st.access_modes.as_deref(),
                false,
                &mut e,
            );
        }
    }
    if let Some(ct) = &spec.content_type
        && !["", "kubevirt", "archive"].contains(&ct.as_str())
    {
        e.push(FieldError::not_supported(
            format!("{p}.contentType"),
            format!("Unsupported value: \"{ct}\": supported values: \"kubevirt\", \"archive\""),
        ));
    }
    if spec.content_type.as_deref() == Some("archive")
        && spec.source.as_ref().is_some_and(|s| s.blank.is_some())
    {
        e.push(FieldError::invalid(
            format!("{p}.contentType"),
            "SourceType cannot be blank and the contentType be archive",
        ));
    }
    e
}

/// A requested size must parse and be greater than zero (CDI's message).
fn check_size(path: String, q: &str, e: &mut Vec<FieldError>) {
    if let Some(v) = check_quantity(path.clone(), q, e)
        && v <= 0.0
    {
        e.push(FieldError::invalid(
            path,
            "PVC size can't be equal or less than zero",
        ));
    }
}

/// CDI: a `pvc` needs exactly one access mode; `storage` may leave them to the
/// StorageProfile; every mode must be a known one.
fn check_access_modes(
    path: &str,
    modes: Option<&[String]>,
    required: bool,
    e: &mut Vec<FieldError>,
) {
    const MODES: [&str; 4] = [
        "ReadOnlyMany",
        "ReadWriteOnce",
        "ReadWriteMany",
        "ReadWriteOncePod",
    ];
    let modes = modes.unwrap_or_default();
    if modes.is_empty() {
        if required {
            e.push(FieldError::required(
                path,
                "Required value: at least 1 access mode is required",
            ));
        }
        return;
    }
    if required && modes.len() > 1 {
        e.push(FieldError::invalid(path, "PVC multiple accessModes"));
    }
    for m in modes {
        if !MODES.contains(&m.as_str()) {
            e.push(FieldError::not_supported(
                path,
                format!("Unsupported value: \"{m}\": supported values: \"ReadOnlyMany\", \"ReadWriteMany\", \"ReadWriteOnce\", \"ReadWriteOncePod\""),
            ));
        }
    }
}
