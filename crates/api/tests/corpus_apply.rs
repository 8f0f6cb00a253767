//! The large corpus: multi-document manifests under `tests/corpus/valid/` written from KubeVirt's
//! and CDI's published docs and examples (each file names its source) must pass the API server's
//! strict field validation and admission, and keep every field they set (in the stored JSON and
//! through the typed view the controllers read). Documents under `tests/corpus/invalid/` carry an
//! `# expect: <field path>` comment and must be refused with an error naming that path.

mod common;

use std::path::PathBuf;

use common::{def_of, strip_nulls, subset_diff, typed_roundtrip};
use ferrovirt_api::admission::{Operation, admit};
use ferrovirt_api::registry::unknown_fields;
use serde_json::Value;

const META: &[&str] = &[
    "name",
    "generateName",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
];

struct Doc {
    file: String,
    index: usize,
    expect: Option<String>,
    obj: Value,
}

fn docs(sub: &str) -> Vec<Doc> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/corpus")
        .join(sub);
    // The common instancetypes and preferences the controllers deploy are valid manifests too.
    let assets = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets");
    let dirs = if sub == "valid" {
        vec![dir, assets]
    } else {
        vec![dir]
    };
    let mut files: Vec<_> = dirs
        .iter()
        .flat_map(|d| std::fs::read_dir(d).expect("corpus dir"))
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for p in files {
        let text = std::fs::read_to_string(&p).expect("read");
        let file = p.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            text.lines().any(|l| l.starts_with("# source:")),
            "{file}: every corpus file names its source"
        );
        for (index, chunk) in text.split("\n---").enumerate() {
            let expect = chunk
                .lines()
                .find_map(|l| l.trim().strip_prefix("# expect:"))
                .map(|s| s.trim().to_string());
            let v: Value = ferrovirt_api::yaml::from_str(chunk)
                .unwrap_or_else(|e| panic!("{file}#{index}: {e}"));
            if v.is_null() {
                continue;
            }
            out.push(Doc {
                file: file.clone(),
                index,
                expect,
                obj: v,
            });
        }
    }
    out
}

/// Strict field validation as the API server does it: schema paths plus ObjectMeta's fields.
fn strict_unknown(obj: &Value) -> Vec<String> {
    let mut out: Vec<String> = unknown_fields(&def_of(obj), obj)
        .into_iter()
        .map(|f| f.trim_start_matches('.').to_string())
        .collect();
    if let Some(m) = obj.get("metadata").and_then(Value::as_object) {
        for k in m.keys().filter(|k| !META.contains(&k.as_str())) {
            out.push(format!("metadata.{k}"));
        }
    }
    out
}

/// Why a valid document fails, if it does.
fn apply_problem(obj: &Value) -> Option<String> {
    let unknown = strict_unknown(obj);
    if !unknown.is_empty() {
        return Some(format!("unknown fields {unknown:?}"));
    }
    let mut admitted = obj.clone();
    if let Err(e) = admit(&def_of(obj), Operation::Create, &mut admitted, None) {
        return Some(format!("refused: {:?}", e.0));
    }
    if let Some(d) = subset_diff(obj, &admitted, "") {
        return Some(format!("admission lost or changed {d}"));
    }
    let typed = typed_roundtrip(&admitted);
    if let Some(d) = subset_diff(&strip_nulls(&admitted), &typed, "") {
        return Some(format!("typed view lost {d}"));
    }
    let mut again = admitted.clone();
    if let Err(e) = admit(&def_of(obj), Operation::Update, &mut again, Some(&admitted)) {
        return Some(format!("re-apply refused: {:?}", e.0));
    }
    if again != admitted {
        return Some("defaulting is not idempotent".into());
    }
    None
}

/// Why an invalid document is not refused as expected, if it is not.
fn refusal_problem(obj: &Value, expect: &str) -> Option<String> {
    let unknown = strict_unknown(obj);
    if !unknown.is_empty() {
        return if unknown.iter().any(|f| f.contains(expect)) {
            None
        } else {
            Some(format!("refused for {unknown:?}, expected {expect}"))
        };
    }
    let mut admitted = obj.clone();
    match admit(&def_of(obj), Operation::Create, &mut admitted, None) {
        Ok(()) => Some("accepted".into()),
        Err(e) if e.0.iter().any(|f| f.field.contains(expect)) => None,
        Err(e) => Some(format!("refused with {:?}, expected {expect}", e.0)),
    }
}

#[test]
fn every_valid_manifest_applies_and_keeps_its_fields() {
    let all = docs("valid");
    let failures: Vec<String> = all
        .iter()
        .filter_map(|d| apply_problem(&d.obj).map(|p| format!("{}#{}: {p}", d.file, d.index)))
        .collect();
    eprintln!(
        "valid corpus: {}/{} applied",
        all.len() - failures.len(),
        all.len()
    );
    assert!(all.len() >= 150, "corpus has {} valid documents", all.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_invalid_manifest_is_refused_with_its_field_path() {
    let all = docs("invalid");
    let failures: Vec<String> = all
        .iter()
        .filter_map(|d| {
            let expect = d
                .expect
                .as_deref()
                .unwrap_or_else(|| panic!("{}#{}: no # expect:", d.file, d.index));
            refusal_problem(&d.obj, expect).map(|p| format!("{}#{}: {p}", d.file, d.index))
        })
        .collect();
    eprintln!(
        "invalid corpus: {}/{} refused",
        all.len() - failures.len(),
        all.len()
    );
    assert!(
        all.len() >= 30,
        "corpus has {} invalid documents",
        all.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
