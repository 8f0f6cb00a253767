//! `get TYPE [NAME]` with kubectl's outputs: the server's Table (default and `-o wide`), `-o
//! yaml|json|name|jsonpath=…`, label selectors, `-A`, and `-w` (rows as objects change).

use std::io::Write;

use futures::{StreamExt, TryStreamExt};
use kube::api::{ListParams, WatchEvent, WatchParams};
use serde_json::{Value, json};

use crate::error::CliError;
use crate::printer::{self, TableOptions};
use crate::resources::{ResourceInfo, split_type_name};
use crate::session::{Session, TABLE_ACCEPT, object_json, query_escape, resource_path};

/// An `-o` format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    Table,
    Wide,
    Yaml,
    Json,
    Name,
    JsonPath(String),
}

impl Output {
    /// Parses `-o` (None: the table).
    pub fn parse(o: Option<&str>) -> Result<Output, CliError> {
        Ok(match o {
            None | Some("") => Output::Table,
            Some("wide") => Output::Wide,
            Some("yaml") => Output::Yaml,
            Some("json") => Output::Json,
            Some("name") => Output::Name,
            Some(s) if s.starts_with("jsonpath=") => {
                let t = &s["jsonpath=".len()..];
                let t = t
                    .strip_prefix('\'')
                    .and_then(|t| t.strip_suffix('\''))
                    .unwrap_or(t);
                Output::JsonPath(t.to_string())
            }
            Some(other) => {
                return Err(CliError::Usage(format!(
                    "unable to match a printer suitable for the output format \"{other}\", allowed formats are: json,jsonpath,name,wide,yaml"
                )));
            }
        })
    }
}

/// What `get` was asked.
#[derive(Debug, Clone)]
pub struct GetRequest {
    pub type_: String,
    pub name: Option<String>,
    pub output: Output,
    pub selector: Option<String>,
    pub all_namespaces: bool,
    pub watch: bool,
}

impl GetRequest {
    /// From `get TYPE [NAME]` / `get TYPE/NAME`.
    pub fn new(first: &str, second: Option<&str>, output: Output) -> GetRequest {
        let (type_, name) = split_type_name(first, second);
        GetRequest {
            type_,
            name,
            output,
            selector: None,
            all_namespaces: false,
            watch: false,
        }
    }
}

/// Serialized objects as `-o yaml|json|name|jsonpath` print them (`list`: several objects, a
/// kubectl List).
pub fn format_objects(
    r: &ResourceInfo,
    objects: &[Value],
    list: bool,
    output: &Output,
) -> Result<String, CliError> {
    let doc = if list {
        json!({"apiVersion": "v1", "items": objects, "kind": "List", "metadata": {"resourceVersion": ""}})
    } else {
        objects.first().cloned().unwrap_or_default()
    };
    match output {
        Output::Json => Ok(serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n"),
        Output::Yaml => printer::to_yaml(&doc),
        Output::Name => Ok(objects
            .iter()
            .map(|o| printer::name_line(&r.kind_group(), o) + "\n")
            .collect()),
        Output::JsonPath(t) => {
            ferrovirt_api::jsonpath::apply(t, &doc).map_err(|e| CliError::Usage(e.to_string()))
        }
        Output::Table | Output::Wide => Err(CliError::Usage("not an object format".into())),
    }
}

/// kubectl's message for an empty listing.
pub fn no_resources(r: &ResourceInfo, namespace: &str, all: bool) -> String {
    if r.namespaced && !all {
        format!("No resources found in {namespace} namespace.")
    } else {
        "No resources found".into()
    }
}

fn table_query(selector: Option<&str>) -> String {
    match selector {
        Some(s) => format!("?labelSelector={}", query_escape(s)),
        None => String::new(),
    }
}

/// Runs `get`, writing to `out` (and the "No resources found" note to stderr).
pub async fn run(s: &Session, req: &GetRequest, out: &mut dyn Write) -> Result<(), CliError> {
    let r = s.resolve(&req.type_)?;
    let ns = if req.all_namespaces {
        None
    } else {
        Some(s.namespace.as_str())
    };
    let write = |out: &mut dyn Write, text: &str| {
        out.write_all(text.as_bytes())
            .and_then(|_| out.flush())
            .map_err(|e| CliError::io("writing output", e))
    };
    let opts = TableOptions {
        wide: req.output == Output::Wide,
        namespace_column: req.all_namespaces && r.namespaced,
        no_headers: false,
    };
    match &req.output {
        Output::Table | Output::Wide => {
            let path =
                resource_path(&r, ns, req.name.as_deref()) + &table_query(req.selector.as_deref());
            let table = s.get_json(&path, TABLE_ACCEPT).await?;
            if table["rows"].as_array().is_none_or(|a| a.is_empty()) && req.name.is_none() {
                if !req.watch {
                    eprintln!("{}", no_resources(&r, &s.namespace, req.all_namespaces));
                }
            } else {
                write(out, &printer::render_table(&table, opts))?;
            }
            if req.watch {
                let rv = table["metadata"]["resourceVersion"]
                    .as_str()
                    .unwrap_or("0")
                    .to_string();
                watch_rows(s, &r, req, ns, (&rv, &table), opts, out).await?;
            }
        }
        output => {
            let (objects, list) = match &req.name {
                Some(n) => (vec![s.get_object(&r, ns, n).await?], false),
                None => {
                    let api = if req.all_namespaces {
                        s.api_all(&r)
                    } else {
                        s.api(&r, ns)
                    };
                    let mut lp = ListParams::default();
                    if let Some(sel) = &req.selector {
                        lp = lp.labels(sel);
                    }
                    let l = api.list(&lp).await?;
                    let objs: Vec<Value> =
                        l.items.into_iter().map(|o| object_json(&r, o)).collect();
                    if objs.is_empty() && *output != Output::Json && *output != Output::Yaml {
                        eprintln!("{}", no_resources(&r, &s.namespace, req.all_namespaces));
                    }
                    (objs, true)
                }
            };
            write(out, &format_objects(&r, &objects, list, output)?)?;
        }
    }
    Ok(())
}

async fn watch_rows(
    s: &Session,
    r: &ResourceInfo,
    req: &GetRequest,
    ns: Option<&str>,
    (rv, listed): (&str, &Value),
    mut opts: TableOptions,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    opts.no_headers = true;
    // The last row printed per object, so a deletion prints the object's last state.
    let mut last: std::collections::HashMap<String, String> = Default::default();
    for row in listed["rows"].as_array().into_iter().flatten() {
        let m = &row["object"]["metadata"];
        let key = format!(
            "{}/{}",
            m["namespace"].as_str().unwrap_or_default(),
            m["name"].as_str().unwrap_or_default()
        );
        let mut one = listed.clone();
        one["rows"] = json!([row]);
        last.insert(key, printer::render_table(&one, opts));
    }
    let api = if req.all_namespaces {
        s.api_all(r)
    } else {
        s.api(r, ns)
    };
    let mut wp = WatchParams::default();
    if let Some(sel) = &req.selector {
        wp = wp.labels(sel);
    }
    if let Some(n) = &req.name {
        wp = wp.fields(&format!("metadata.name={n}"));
    }
    let mut stream = api.watch(&wp, rv).await?.boxed();
    while let Some(ev) = stream.try_next().await? {
        let (obj, deleted) = match ev {
            WatchEvent::Added(o) | WatchEvent::Modified(o) => (o, false),
            WatchEvent::Deleted(o) => (o, true),
            WatchEvent::Bookmark(_) => continue,
            WatchEvent::Error(e) => return Err(CliError::server(e.code, e.reason, e.message)),
        };
        let name = obj.metadata.name.clone().unwrap_or_default();
        let ons = obj.metadata.namespace.clone();
        let key = format!("{}/{name}", ons.clone().unwrap_or_default());
        let text = if deleted {
            last.remove(&key).unwrap_or_default()
        } else {
            let path = resource_path(r, ons.as_deref(), Some(&name));
            match s.get_json(&path, TABLE_ACCEPT).await {
                Ok(t) => printer::render_table(&t, opts),
                Err(e) if e.is_not_found() => continue,
                Err(e) => return Err(e),
            }
        };
        last.insert(key, text.clone());
        out.write_all(text.as_bytes())
            .and_then(|_| out.flush())
            .map_err(|e| CliError::io("writing output", e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm() -> ResourceInfo {
        ResourceInfo {
            group: "kubevirt.io".into(),
            version: "v1".into(),
            kind: "VirtualMachine".into(),
            plural: "virtualmachines".into(),
            singular: "virtualmachine".into(),
            short_names: vec![],
            namespaced: true,
            verbs: vec![],
        }
    }

    #[test]
    fn output_flags() {
        assert_eq!(Output::parse(None).unwrap(), Output::Table);
        assert_eq!(Output::parse(Some("wide")).unwrap(), Output::Wide);
        assert_eq!(
            Output::parse(Some("jsonpath='{.a}'")).unwrap(),
            Output::JsonPath("{.a}".into())
        );
        assert!(Output::parse(Some("xml")).is_err());
        let g = GetRequest::new("vm/a", None, Output::Name);
        assert_eq!((g.type_.as_str(), g.name.as_deref()), ("vm", Some("a")));
    }

    #[test]
    fn object_formats() {
        let objs = vec![
            json!({"metadata": {"name": "a"}}),
            json!({"metadata": {"name": "b"}}),
        ];
        assert_eq!(
            format_objects(&vm(), &objs, true, &Output::Name).unwrap(),
            "virtualmachine.kubevirt.io/a\nvirtualmachine.kubevirt.io/b\n"
        );
        assert_eq!(
            format_objects(
                &vm(),
                &objs,
                true,
                &Output::JsonPath("{.items[*].metadata.name}".into())
            )
            .unwrap(),
            "a b"
        );
        let j = format_objects(&vm(), &objs[..1], false, &Output::Json).unwrap();
        assert_eq!(serde_json::from_str::<Value>(&j).unwrap(), objs[0]);
        let y = format_objects(&vm(), &objs, true, &Output::Yaml).unwrap();
        assert!(y.contains("kind: List"), "{y}");
        assert_eq!(
            no_resources(&vm(), "default", false),
            "No resources found in default namespace."
        );
        assert_eq!(table_query(Some("app=a")), "?labelSelector=app%3Da");
    }
}
