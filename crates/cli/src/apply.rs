//! `apply -f`, `create -f` and `edit`: manifests from files, directories or stdin; apply creates
//! what is missing and merge-patches what exists, remembering what it applied in kubectl's
//! `last-applied-configuration` annotation so fields dropped from the file are removed.

use std::path::{Path, PathBuf};

use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{Map, Value};

use crate::error::CliError;
use crate::printer;
use crate::resources::{ResourceInfo, split_type_name};
use crate::session::{Session, object_json};

/// kubectl's annotation holding the last applied manifest.
pub const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Files named by `-f`: `-` (stdin), a file, or a directory's `.yaml`/`.yml`/`.json` files in
/// name order.
pub fn manifest_files(arg: &Path) -> Result<Vec<PathBuf>, CliError> {
    if arg == Path::new("-") || arg.is_file() {
        return Ok(vec![arg.to_path_buf()]);
    }
    let rd = std::fs::read_dir(arg).map_err(|e| {
        CliError::Usage(format!(
            "the path \"{}\" does not exist: {e}",
            arg.display()
        ))
    })?;
    let mut files: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| ["yaml", "yml", "json"].contains(&e))
        })
        .collect();
    files.sort();
    Ok(files)
}

/// All documents of `-f ARG`.
pub fn read_manifests(arg: &Path) -> Result<Vec<Value>, CliError> {
    let mut docs = Vec::new();
    for f in manifest_files(arg)? {
        let text = if f == Path::new("-") {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
                .map_err(|e| CliError::io("reading stdin", e))?;
            s
        } else {
            std::fs::read_to_string(&f)
                .map_err(|e| CliError::io(format!("reading {}", f.display()), e))?
        };
        docs.extend(printer::parse_documents(&text)?);
    }
    Ok(docs)
}

/// A merge patch turning `old` (what was applied last) into `new`: every field of `new`, and
/// `null` for fields `old` had that `new` dropped.
pub fn merge_patch(old: &Value, new: &Value) -> Value {
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => {
            let mut out = Map::new();
            for (k, nv) in n {
                let ov = o.get(k).unwrap_or(&Value::Null);
                out.insert(k.clone(), merge_patch(ov, nv));
            }
            for k in o.keys() {
                if !n.contains_key(k) {
                    out.insert(k.clone(), Value::Null);
                }
            }
            Value::Object(out)
        }
        (_, n) => n.clone(),
    }
}

/// Whether every field of `want` has the same value in `have` (maps compared recursively).
pub fn contains(have: &Value, want: &Value) -> bool {
    match (have, want) {
        (Value::Object(h), Value::Object(w)) => w
            .iter()
            .all(|(k, wv)| h.get(k).is_some_and(|hv| contains(hv, wv))),
        (h, w) => h == w,
    }
}

/// The manifest without kubectl's annotation (and without an annotation map left empty).
pub fn without_last_applied(doc: &Value) -> Value {
    let mut clean = doc.clone();
    if let Some(meta) = clean.get_mut("metadata").and_then(Value::as_object_mut)
        && let Some(a) = meta.get_mut("annotations").and_then(Value::as_object_mut)
    {
        a.remove(LAST_APPLIED);
        if a.is_empty() {
            meta.remove("annotations");
        }
    }
    clean
}

/// The manifest with its last-applied annotation (the manifest itself, compact JSON).
pub fn with_last_applied(doc: &Value) -> Value {
    let clean = without_last_applied(doc);
    let text = serde_json::to_string(&clean).unwrap_or_default() + "\n";
    let mut out = clean;
    if !out["metadata"].is_object() {
        out["metadata"] = Value::Object(Map::new());
    }
    if !out["metadata"]["annotations"].is_object() {
        out["metadata"]["annotations"] = Value::Object(Map::new());
    }
    out["metadata"]["annotations"][LAST_APPLIED] = Value::String(text);
    out
}

fn name_of(doc: &Value) -> Result<String, CliError> {
    doc["metadata"]["name"]
        .as_str()
        .filter(|n| !n.is_empty())
        .map(String::from)
        .ok_or_else(|| CliError::Usage("resource name may not be empty".into()))
}

fn resolve_doc<'a>(s: &'a Session, doc: &Value) -> Result<&'a ResourceInfo, CliError> {
    s.catalog.by_kind(
        doc["apiVersion"].as_str().unwrap_or_default(),
        doc["kind"].as_str().unwrap_or_default(),
    )
}

fn namespace_of(s: &Session, r: &ResourceInfo, doc: &Value) -> Option<String> {
    r.namespaced.then(|| {
        doc["metadata"]["namespace"]
            .as_str()
            .unwrap_or(&s.namespace)
            .to_string()
    })
}

/// Applies one document; returns kubectl's line (`kind.group/name created|configured|unchanged`).
pub async fn apply_one(s: &Session, doc: &Value) -> Result<String, CliError> {
    let r = resolve_doc(s, doc)?;
    let name = name_of(doc)?;
    let ns = namespace_of(s, r, doc);
    let api = s.api(r, ns.as_deref());
    let desired = with_last_applied(doc);
    let prefix = format!("{}/{name}", r.kind_group());
    match api.get(&name).await.map_err(CliError::from_kube) {
        Err(e) if e.is_not_found() => {
            let obj: kube::api::DynamicObject = serde_json::from_value(desired)
                .map_err(|e| CliError::Usage(format!("decoding {name}: {e}")))?;
            api.create(&PostParams::default(), &obj).await?;
            Ok(format!("{prefix} created"))
        }
        Err(e) => Err(e),
        Ok(live) => {
            let live = object_json(r, live);
            let old: Value = live["metadata"]["annotations"][LAST_APPLIED]
                .as_str()
                .and_then(|t| serde_json::from_str(t).ok())
                .unwrap_or(Value::Null);
            let clean = without_last_applied(doc);
            if old == clean && contains(&live, &clean) {
                return Ok(format!("{prefix} unchanged"));
            }
            let patch = merge_patch(&old, &desired);
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            Ok(format!("{prefix} configured"))
        }
    }
}

/// Creates one document; returns `kind.group/name created`.
pub async fn create_one(s: &Session, doc: &Value) -> Result<String, CliError> {
    let r = resolve_doc(s, doc)?;
    let ns = namespace_of(s, r, doc);
    let obj: kube::api::DynamicObject = serde_json::from_value(doc.clone())
        .map_err(|e| CliError::Usage(format!("decoding the manifest: {e}")))?;
    let made = s
        .api(r, ns.as_deref())
        .create(&PostParams::default(), &obj)
        .await?;
    Ok(format!(
        "{}/{} created",
        r.kind_group(),
        made.metadata.name.unwrap_or_default()
    ))
}

/// `apply -f` / `create -f`: every document in order, printing each result or error as it
/// comes; fails with [`CliError::Reported`] when any failed.
pub async fn run_files(s: &Session, file: &Path, create: bool) -> Result<(), CliError> {
    let docs = read_manifests(file)?;
    if docs.is_empty() {
        return Err(CliError::Usage("no objects passed to apply".into()));
    }
    let mut failed = false;
    for d in &docs {
        let res = if create {
            create_one(s, d).await
        } else {
            apply_one(s, d).await
        };
        match res {
            Ok(line) => println!("{line}"),
            Err(e) => {
                failed = true;
                eprintln!("{e}");
            }
        }
    }
    if failed {
        Err(CliError::Reported)
    } else {
        Ok(())
    }
}

/// The object as the editor shows it (status and managed fields kept, as kubectl does).
pub fn edit_text(obj: &Value) -> Result<String, CliError> {
    let header = "# Please edit the object below. Lines beginning with a '#' will be ignored,\n\
                  # and an empty file will abort the edit.\n";
    Ok(format!("{header}{}", printer::to_yaml(obj)?))
}

/// `edit TYPE NAME`: opens `$EDITOR` (else `vi`) on the YAML and replaces the object with the
/// result.
pub async fn edit(s: &Session, first: &str, second: Option<&str>) -> Result<String, CliError> {
    let (t, name) = split_type_name(first, second);
    let name = name.ok_or_else(|| CliError::Usage("edit needs a NAME".into()))?;
    let r = s.resolve(&t)?;
    let obj = s.get_object(&r, None, &name).await?;
    let dir = tempfile::tempdir().map_err(|e| CliError::io("creating a temporary dir", e))?;
    let file = dir.path().join(format!("{}-edit.yaml", r.singular));
    let before = edit_text(&obj)?;
    std::fs::write(&file, &before).map_err(|e| CliError::io("writing the edit file", e))?;
    let editor = std::env::var("KUBE_EDITOR")
        .or_else(|_| std::env::var("EDITOR"))
        .unwrap_or_else(|_| "vi".into());
    let status = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{editor} \"$1\""))
        .arg("sh")
        .arg(&file)
        .status()
        .await
        .map_err(|e| CliError::io(format!("running {editor}"), e))?;
    if !status.success() {
        return Err(CliError::Usage(format!(
            "the editor {editor} exited with {status}"
        )));
    }
    let after =
        std::fs::read_to_string(&file).map_err(|e| CliError::io("reading the edit file", e))?;
    let stripped: String = after
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    if after == before {
        return Ok("Edit cancelled, no changes made.".into());
    }
    if stripped.trim().is_empty() {
        return Ok("Edit cancelled, saved file was empty.".into());
    }
    let edited: Value = ferrovirt_api::yaml::from_str(&stripped)
        .map_err(|e| CliError::Usage(format!("the edited file is not valid YAML: {e}")))?;
    let ns = obj["metadata"]["namespace"].as_str().map(String::from);
    let dobj: kube::api::DynamicObject = serde_json::from_value(edited)
        .map_err(|e| CliError::Usage(format!("decoding the edited object: {e}")))?;
    s.api(&r, ns.as_deref())
        .replace(&name, &PostParams::default(), &dobj)
        .await?;
    Ok(format!("{}/{name} edited", r.kind_group()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_drops_removed_fields() {
        let old = json!({"metadata": {"labels": {"a": "1", "b": "2"}}, "spec": {"x": 1}});
        let new = json!({"metadata": {"labels": {"a": "3"}}, "spec": {"x": 1, "y": [1]}});
        assert_eq!(
            merge_patch(&old, &new),
            json!({"metadata": {"labels": {"a": "3", "b": null}}, "spec": {"x": 1, "y": [1]}})
        );
        assert_eq!(merge_patch(&Value::Null, &new), new);
    }

    #[test]
    fn containment_and_annotation() {
        let live = json!({"metadata": {"name": "a", "uid": "u"}, "spec": {"x": 1, "y": 2}});
        assert!(contains(&live, &json!({"spec": {"x": 1}})));
        assert!(!contains(&live, &json!({"spec": {"x": 2}})));
        let doc = json!({"kind": "K", "metadata": {"name": "a"}});
        let d = with_last_applied(&doc);
        let la: Value =
            serde_json::from_str(d["metadata"]["annotations"][LAST_APPLIED].as_str().unwrap())
                .unwrap();
        assert_eq!(la, doc);
        // Applying the annotated doc again stores the same clean manifest.
        let again = with_last_applied(&d);
        assert_eq!(again, d);
    }

    #[test]
    fn directories_list_manifests_in_order() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["b.yaml", "a.json", "c.txt"] {
            std::fs::write(dir.path().join(f), "{}").unwrap();
        }
        let files = manifest_files(dir.path()).unwrap();
        let names: Vec<_> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_str().unwrap())
            .collect();
        assert_eq!(names, ["a.json", "b.yaml"]);
        assert!(manifest_files(Path::new("/nonexistent/x")).is_err());
        assert!(edit_text(&json!({"a": 1})).unwrap().contains("a: 1"));
    }
}
