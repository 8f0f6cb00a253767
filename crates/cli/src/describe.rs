//! `describe TYPE NAME`: kubectl's generic describe layout (Name, Namespace, Labels,
//! Annotations, API Version, Kind, then every field with camelCase keys spelled as words) and the
//! object's core/v1 Events (field selector on the involved object's name, namespace and uid).

use serde_json::Value;

use crate::error::CliError;
use crate::printer;
use crate::resources::split_type_name;
use crate::session::{Session, query_escape};

/// A line of describe output: cells separated like kubectl's tab writer (padding 2; a line
/// with a single cell ends an alignment block).
type Line = Vec<String>;

/// `creationTimestamp` → `Creation Timestamp`, `uid` → `UID`.
pub fn label_for(key: &str) -> String {
    let mut words: Vec<String> = Vec::new();
    let mut cur = String::new();
    let chars: Vec<char> = key.chars().collect();
    for (i, c) in chars.iter().enumerate() {
        let boundary = c.is_uppercase()
            && i > 0
            && (chars[i - 1].is_lowercase()
                || chars.get(i + 1).is_some_and(|n| n.is_lowercase())
                    && chars[i - 1].is_uppercase());
        if boundary && !cur.is_empty() {
            words.push(std::mem::take(&mut cur));
        }
        cur.push(*c);
    }
    if !cur.is_empty() {
        words.push(cur);
    }
    words
        .into_iter()
        .map(|w| {
            let lower = w.to_lowercase();
            if ["uid", "api", "ip", "url", "id", "cpu", "vnc", "dns", "tls"]
                .contains(&lower.as_str())
            {
                lower.to_uppercase()
            } else {
                let mut cs = w.chars();
                match cs.next() {
                    Some(f) => f.to_uppercase().collect::<String>() + cs.as_str(),
                    None => String::new(),
                }
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "<nil>".into(),
        other => other.to_string(),
    }
}

fn is_scalar(v: &Value) -> bool {
    !matches!(v, Value::Object(_) | Value::Array(_))
}

fn fields(map: &serde_json::Map<String, Value>, indent: usize, out: &mut Vec<Line>) {
    let pad = " ".repeat(indent);
    for (k, v) in map {
        let label = format!("{pad}{}:", label_for(k));
        value(label, v, indent, out);
    }
}

fn value(label: String, v: &Value, indent: usize, out: &mut Vec<Line>) {
    let pad = " ".repeat(indent);
    match v {
        Value::Object(m) if m.is_empty() => out.push(vec![label]),
        Value::Object(m) => {
            out.push(vec![label]);
            fields(m, indent + 2, out);
        }
        Value::Array(a) if a.is_empty() => out.push(vec![label]),
        Value::Array(a) => {
            out.push(vec![label]);
            for item in a {
                match item {
                    Value::Object(m) => fields(m, indent + 2, out),
                    other if is_scalar(other) => {
                        out.push(vec![format!("{pad}  {}", scalar(other))])
                    }
                    other => value(format!("{pad}  -"), other, indent + 2, out),
                }
            }
        }
        s => out.push(vec![label, scalar(s)]),
    }
}

fn string_map(m: &Value, sep: &str) -> Vec<String> {
    match m.as_object() {
        Some(m) if m.keys().any(|k| k != crate::apply::LAST_APPLIED) => m
            .iter()
            .filter(|(k, _)| *k != crate::apply::LAST_APPLIED)
            .map(|(k, v)| format!("{k}{sep}{}", v.as_str().unwrap_or_default()))
            .collect(),
        _ => vec!["<none>".into()],
    }
}

/// Aligns lines like kubectl's tab writer with padding 2.
fn render(lines: &[Line]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].len() < 2 {
            out.push_str(lines[i].first().map(String::as_str).unwrap_or_default());
            out.push('\n');
            i += 1;
            continue;
        }
        let start = i;
        while i < lines.len() && lines[i].len() >= 2 {
            i += 1;
        }
        let block = &lines[start..i];
        let ncols = block.iter().map(Vec::len).max().unwrap_or(0);
        let mut widths = vec![0usize; ncols];
        for l in block {
            for (j, c) in l.iter().enumerate().take(l.len() - 1) {
                widths[j] = widths[j].max(c.chars().count());
            }
        }
        for l in block {
            let mut s = String::new();
            for (j, c) in l.iter().enumerate() {
                s.push_str(c);
                if j + 1 < l.len() {
                    s.push_str(&" ".repeat(widths[j] + 2 - c.chars().count()));
                }
            }
            out.push_str(s.trim_end());
            out.push('\n');
        }
    }
    out
}

/// The describe text of an object and its events (core/v1 Event objects).
pub fn describe_text(obj: &Value, events: &[Value]) -> String {
    let meta = &obj["metadata"];
    let mut lines: Vec<Line> = Vec::new();
    lines.push(vec!["Name:".into(), scalar(&meta["name"])]);
    if let Some(ns) = meta["namespace"].as_str() {
        lines.push(vec!["Namespace:".into(), ns.into()]);
    }
    for (title, m, sep) in [
        ("Labels:", &meta["labels"], "="),
        ("Annotations:", &meta["annotations"], ": "),
    ] {
        for (i, l) in string_map(m, sep).into_iter().enumerate() {
            lines.push(vec![if i == 0 { title.into() } else { String::new() }, l]);
        }
    }
    lines.push(vec!["API Version:".into(), scalar(&obj["apiVersion"])]);
    lines.push(vec!["Kind:".into(), scalar(&obj["kind"])]);
    if let Some(m) = meta.as_object() {
        let rest: serde_json::Map<String, Value> = m
            .iter()
            .filter(|(k, _)| {
                ![
                    "name",
                    "namespace",
                    "labels",
                    "annotations",
                    "managedFields",
                ]
                .contains(&k.as_str())
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        value("Metadata:".into(), &Value::Object(rest), 0, &mut lines);
    }
    if let Some(m) = obj.as_object() {
        for (k, v) in m {
            if ["apiVersion", "kind", "metadata"].contains(&k.as_str()) {
                continue;
            }
            value(format!("{}:", label_for(k)), v, 0, &mut lines);
        }
    }
    let mut text = render(&lines);
    text.push_str(&events_text(events));
    text
}

fn event_time(e: &Value) -> String {
    ["lastTimestamp", "eventTime", "firstTimestamp"]
        .iter()
        .filter_map(|k| e[*k].as_str())
        .find(|s| !s.is_empty())
        .or_else(|| e["metadata"]["creationTimestamp"].as_str())
        .unwrap_or_default()
        .to_string()
}

/// The `Events:` section.
pub fn events_text(events: &[Value]) -> String {
    if events.is_empty() {
        return "Events:  <none>\n".into();
    }
    let mut sorted: Vec<&Value> = events.iter().collect();
    sorted.sort_by_key(|e| event_time(e));
    let mut lines: Vec<Line> = vec![
        vec!["Events:".into()],
        ["  Type", "Reason", "Age", "From", "Message"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        ["  ----", "------", "----", "----", "-------"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
    ];
    for e in sorted {
        let mut age = printer::age(&event_time(e));
        let count = e["count"].as_i64().unwrap_or(1);
        if count > 1
            && let Some(first) = e["firstTimestamp"].as_str()
        {
            age = format!("{age} (x{count} over {})", printer::age(first));
        }
        let from = e["source"]["component"]
            .as_str()
            .filter(|s| !s.is_empty())
            .or_else(|| e["reportingComponent"].as_str())
            .unwrap_or_default();
        lines.push(vec![
            format!("  {}", e["type"].as_str().unwrap_or_default()),
            e["reason"].as_str().unwrap_or_default().into(),
            age,
            from.into(),
            e["message"].as_str().unwrap_or_default().trim().into(),
        ]);
    }
    render(&lines)
}

/// The events query for an object: in its namespace, or across all namespaces for a
/// cluster-scoped object.
pub fn events_path(namespace: Option<&str>, name: &str, uid: &str) -> String {
    match namespace {
        Some(ns) => {
            let sel = format!(
                "involvedObject.name={name},involvedObject.namespace={ns},involvedObject.uid={uid}"
            );
            format!(
                "/api/v1/namespaces/{ns}/events?fieldSelector={}",
                query_escape(&sel)
            )
        }
        None => {
            let sel = format!("involvedObject.name={name},involvedObject.uid={uid}");
            format!("/api/v1/events?fieldSelector={}", query_escape(&sel))
        }
    }
}

async fn describe_one(s: &Session, obj: &Value) -> String {
    let meta = &obj["metadata"];
    let name = meta["name"].as_str().unwrap_or_default();
    let uid = meta["uid"].as_str().unwrap_or_default();
    let path = events_path(meta["namespace"].as_str(), name, uid);
    let events = match s.get_json(&path, "application/json").await {
        Ok(l) => l["items"].as_array().cloned().unwrap_or_default(),
        Err(_) => Vec::new(),
    };
    describe_text(obj, &events)
}

/// Runs `describe TYPE NAME` (or `TYPE/NAME`); without a name, every object of the type in the
/// namespace, separated by blank lines.
pub async fn run(s: &Session, first: &str, second: Option<&str>) -> Result<String, CliError> {
    let (t, name) = split_type_name(first, second);
    let r = s.resolve(&t)?;
    let objects = match name {
        Some(n) => vec![s.get_object(&r, None, &n).await?],
        None => s
            .api(&r, None)
            .list(&Default::default())
            .await?
            .items
            .into_iter()
            .map(|o| crate::session::object_json(&r, o))
            .collect(),
    };
    if objects.is_empty() {
        eprintln!("{}", crate::get::no_resources(&r, &s.namespace, false));
    }
    let mut texts = Vec::new();
    for o in &objects {
        texts.push(describe_one(s, o).await);
    }
    Ok(texts.join("\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn labels_from_keys() {
        assert_eq!(label_for("creationTimestamp"), "Creation Timestamp");
        assert_eq!(label_for("uid"), "UID");
        assert_eq!(label_for("runStrategy"), "Run Strategy");
        assert_eq!(label_for("apiVersion"), "API Version");
        assert_eq!(
            label_for("persistentVolumeClaim"),
            "Persistent Volume Claim"
        );
        assert_eq!(label_for("nodeIP"), "Node IP");
    }

    #[test]
    fn layout_like_kubectl() {
        let obj = json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "vm1", "namespace": "default", "labels": {"app": "a"}, "uid": "u1"},
            "spec": {"runStrategy": "Always", "template": {"spec": {"volumes": [
                {"name": "root", "persistentVolumeClaim": {"claimName": "c"}}]}}},
        });
        let text = describe_text(&obj, &[]);
        let want = "\
Name:         vm1
Namespace:    default
Labels:       app=a
Annotations:  <none>
API Version:  kubevirt.io/v1
Kind:         VirtualMachine
Metadata:
  UID:  u1
Spec:
  Run Strategy:  Always
  Template:
    Spec:
      Volumes:
        Name:  root
        Persistent Volume Claim:
          Claim Name:  c
Events:  <none>
";
        assert_eq!(text, want);
    }

    #[test]
    fn events_table() {
        let e = json!({"type": "Normal", "reason": "SuccessfulCreate", "message": "made it",
            "source": {"component": "virtualmachine-controller"}, "lastTimestamp": "bad"});
        let t = events_text(&[e]);
        assert_eq!(
            t,
            "Events:\n  Type    Reason            Age        From                       Message\n  ----    ------            ----       ----                       -------\n  Normal  SuccessfulCreate  <unknown>  virtualmachine-controller  made it\n"
        );
        assert!(events_path(Some("ns"), "a", "u").contains("involvedObject.uid%3Du"));
        assert_eq!(
            events_path(None, "n1", "u"),
            "/api/v1/events?fieldSelector=involvedObject.name%3Dn1%2CinvolvedObject.uid%3Du"
        );
    }
}
