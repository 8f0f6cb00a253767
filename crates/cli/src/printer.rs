//! kubectl's output formats as pure functions: aligned columns (kubectl's tab writer: 3 spaces
//! of padding), ages (`5s`, `3m2s`, `4h`, `2d`), the server's meta.k8s.io Table rendered as
//! `kubectl get` prints it, `-o name`, and YAML/JSON documents.

use serde_json::Value;

use crate::error::CliError;

/// Aligns rows like kubectl's tab writer: each column as wide as its widest cell plus three
/// spaces (at least 6), the last column unpadded.
pub fn columns(rows: &[Vec<String>]) -> String {
    let n = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut widths = vec![0usize; n];
    for row in rows {
        for (i, c) in row.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (i, c) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(c);
            } else {
                let w = (widths[i] + 3).max(6);
                line.push_str(c);
                line.push_str(&" ".repeat(w - c.chars().count()));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// kubectl's human duration (`HumanDuration`): `5s`, `119s`, `3m2s`, `12m`, `4h5m`, `9h`,
/// `2d3h`, `40d`, `2y10d`.
pub fn human_duration(secs: i64) -> String {
    if secs < -1 {
        return "<invalid>".into();
    }
    let s = secs.max(0);
    if s < 120 {
        return format!("{s}s");
    }
    let m = s / 60;
    if m < 10 {
        return if s % 60 == 0 {
            format!("{m}m")
        } else {
            format!("{m}m{}s", s % 60)
        };
    }
    if m < 180 {
        return format!("{m}m");
    }
    let h = m / 60;
    if h < 8 {
        return if m % 60 == 0 {
            format!("{h}h")
        } else {
            format!("{h}h{}m", m % 60)
        };
    }
    if h < 48 {
        return format!("{h}h");
    }
    let d = h / 24;
    if h < 24 * 8 {
        return if h % 24 == 0 {
            format!("{d}d")
        } else {
            format!("{d}d{}h", h % 24)
        };
    }
    if h < 24 * 365 * 2 {
        return format!("{d}d");
    }
    let y = d / 365;
    if h < 24 * 365 * 8 {
        return if d % 365 == 0 {
            format!("{y}y")
        } else {
            format!("{y}y{}d", d % 365)
        };
    }
    format!("{y}y")
}

/// Seconds since an RFC 3339 timestamp.
pub fn seconds_since(timestamp: &str) -> Option<i64> {
    let t: k8s_openapi::jiff::Timestamp = timestamp.parse().ok()?;
    Some(k8s_openapi::jiff::Timestamp::now().as_second() - t.as_second())
}

/// The age of an RFC 3339 timestamp, humanized; `<unknown>` when unparsable.
pub fn age(timestamp: &str) -> String {
    seconds_since(timestamp)
        .map(human_duration)
        .unwrap_or_else(|| "<unknown>".into())
}

/// How to print a server Table.
#[derive(Debug, Clone, Copy, Default)]
pub struct TableOptions {
    /// `-o wide`: also the columns with priority > 0.
    pub wide: bool,
    /// `-A`: a NAMESPACE column first (from each row's object metadata).
    pub namespace_column: bool,
    /// Leave out the header (watch updates after the first listing).
    pub no_headers: bool,
}

fn cell_text(v: &Value, type_: &str) -> String {
    match v {
        Value::Null => "<none>".into(),
        Value::String(s) if type_ == "date" && s.contains('T') && seconds_since(s).is_some() => {
            age(s)
        }
        Value::String(s) if s.is_empty() => String::new(),
        Value::String(s) => s.clone(),
        Value::Array(a) if a.is_empty() => "<none>".into(),
        other => other.to_string(),
    }
}

/// Rows of a meta.k8s.io Table as printed by `kubectl get` (header uppercased; `None` when the
/// table has no rows, so the caller can say `No resources found`).
pub fn table_rows(table: &Value, opts: TableOptions) -> Vec<Vec<String>> {
    let defs: Vec<&Value> = table["columnDefinitions"]
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    let shown: Vec<usize> = defs
        .iter()
        .enumerate()
        .filter(|(_, d)| opts.wide || d["priority"].as_i64().unwrap_or(0) == 0)
        .map(|(i, _)| i)
        .collect();
    let mut rows = Vec::new();
    if !opts.no_headers {
        let mut h: Vec<String> = Vec::new();
        if opts.namespace_column {
            h.push("NAMESPACE".into());
        }
        h.extend(
            shown
                .iter()
                .map(|i| defs[*i]["name"].as_str().unwrap_or_default().to_uppercase()),
        );
        rows.push(h);
    }
    for row in table["rows"].as_array().into_iter().flatten() {
        let cells = row["cells"].as_array().cloned().unwrap_or_default();
        let mut r = Vec::new();
        if opts.namespace_column {
            r.push(
                row["object"]["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            );
        }
        for i in &shown {
            let type_ = defs[*i]["type"].as_str().unwrap_or_default();
            r.push(cell_text(cells.get(*i).unwrap_or(&Value::Null), type_));
        }
        rows.push(r);
    }
    rows
}

/// `kubectl get` text of a Table.
pub fn render_table(table: &Value, opts: TableOptions) -> String {
    columns(&table_rows(table, opts))
}

/// `-o name`: `virtualmachine.kubevirt.io/x`.
pub fn name_line(kind_group: &str, obj: &Value) -> String {
    format!(
        "{kind_group}/{}",
        obj["metadata"]["name"].as_str().unwrap_or_default()
    )
}

/// A YAML document of `v`.
pub fn to_yaml(v: &Value) -> Result<String, CliError> {
    ferrovirt_api::yaml::to_string(v).map_err(|e| CliError::Usage(format!("writing YAML: {e}")))
}

/// Parses a file's content: one JSON document, or YAML with `---` separated documents; a
/// `kind: List` contributes its items. Empty documents are skipped.
pub fn parse_documents(text: &str) -> Result<Vec<Value>, CliError> {
    let docs: Vec<Value> = if text.trim_start().starts_with('{') {
        vec![
            serde_json::from_str(text)
                .map_err(|e| CliError::Usage(format!("parsing JSON: {e}")))?,
        ]
    } else {
        ferrovirt_api::yaml::from_multiple::<Value>(text)
            .map_err(|e| CliError::Usage(format!("parsing YAML: {e}")))?
    };
    let mut out = Vec::new();
    for d in docs {
        if d.is_null() || d.as_object().is_some_and(|m| m.is_empty()) {
            continue;
        }
        let is_list =
            d["items"].is_array() && d["kind"].as_str().is_some_and(|k| k.ends_with("List"));
        if is_list {
            out.extend(d["items"].as_array().cloned().unwrap_or_default());
        } else {
            out.push(d);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ages_like_kubectl() {
        assert_eq!(human_duration(5), "5s");
        assert_eq!(human_duration(119), "119s");
        assert_eq!(human_duration(182), "3m2s");
        assert_eq!(human_duration(600), "10m");
        assert_eq!(human_duration(4 * 3600), "4h");
        assert_eq!(human_duration(4 * 3600 + 300), "4h5m");
        assert_eq!(human_duration(20 * 3600), "20h");
        assert_eq!(human_duration(2 * 86400), "2d");
        assert_eq!(human_duration(2 * 86400 + 3 * 3600), "2d3h");
        assert_eq!(human_duration(40 * 86400), "40d");
        assert_eq!(human_duration(-5), "<invalid>");
        assert_eq!(age("not a time"), "<unknown>");
        let t = k8s_openapi::jiff::Timestamp::now().as_second() - 200;
        let ts = k8s_openapi::jiff::Timestamp::from_second(t)
            .unwrap()
            .to_string();
        assert!(["3m20s", "3m21s"].contains(&age(&ts).as_str()), "{ts}");
        assert!(cell_text(&Value::String(ts), "date").starts_with("3m2"));
        assert_eq!(cell_text(&Value::String("5s".into()), "date"), "5s");
        assert_eq!(cell_text(&Value::Null, "string"), "<none>");
    }

    #[test]
    fn columns_pad_three() {
        let out = columns(&[
            vec!["NAME".into(), "AGE".into()],
            vec!["a-long-name".into(), "5s".into()],
        ]);
        assert_eq!(out, "NAME          AGE\na-long-name   5s\n");
        assert_eq!(columns(&[vec!["A".into(), "B".into()]]), "A     B\n");
    }

    #[test]
    fn table_like_kubectl_get() {
        let t = json!({
            "columnDefinitions": [
                {"name": "Name", "type": "string", "priority": 0},
                {"name": "Age", "type": "date", "priority": 0},
                {"name": "Status", "type": "string", "priority": 0},
                {"name": "Node", "type": "string", "priority": 1},
            ],
            "rows": [
                {"cells": ["vm1", "5s", "Running", null], "object": {"metadata": {"namespace": "ns"}}},
            ]
        });
        assert_eq!(
            render_table(&t, TableOptions::default()),
            "NAME   AGE   STATUS\nvm1    5s    Running\n"
        );
        let wide = render_table(
            &t,
            TableOptions {
                wide: true,
                namespace_column: true,
                no_headers: false,
            },
        );
        assert_eq!(
            wide,
            "NAMESPACE   NAME   AGE   STATUS    NODE\nns          vm1    5s    Running   <none>\n"
        );
    }

    #[test]
    fn documents_and_names() {
        let docs =
            parse_documents("a: 1\n---\n---\nkind: List\nitems: [{b: 2}, {c: 3}]\n").unwrap();
        assert_eq!(
            docs,
            vec![json!({"a": 1}), json!({"b": 2}), json!({"c": 3})]
        );
        let docs = parse_documents("{\"kind\": \"X\"}").unwrap();
        assert_eq!(docs[0]["kind"], "X");
        assert!(parse_documents("a: [").is_err());
        let obj = json!({"metadata": {"name": "x"}});
        assert_eq!(
            name_line("virtualmachine.kubevirt.io", &obj),
            "virtualmachine.kubevirt.io/x"
        );
        let y = to_yaml(&json!({"a": {"b": [1, "two"]}})).unwrap();
        let back: Value = ferrovirt_api::yaml::from_str(&y).unwrap();
        assert_eq!(back, json!({"a": {"b": [1, "two"]}}));
    }
}
