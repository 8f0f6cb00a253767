//! kubectl's `-o jsonpath=TEMPLATE`: literal text with `{expr}` parts, where expr is a path
//! (`.metadata.name`, `.items[*].metadata.name`, `.spec.x[0]`, `['a.b']`,
//! `.status.conditions[?(@.type=="Ready")].status`), a quoted string (`{"\n"}`), or
//! `{range PATH}...{end}`. Several results print separated by spaces.

use serde_json::Value;

use crate::error::CliError;

#[derive(Debug, Clone, PartialEq)]
enum Part {
    Text(String),
    Path(Vec<Step>),
    Range(Vec<Step>, Vec<Part>),
}

#[derive(Debug, Clone, PartialEq)]
enum Step {
    Field(String),
    Index(i64),
    All,
    /// `[?(@.a.b=="v")]` (or `!=`).
    Filter(Vec<String>, String, bool),
}

fn bad(t: &str, why: &str) -> CliError {
    CliError::Usage(format!("error parsing jsonpath {t}: {why}"))
}

/// Parses a template.
fn parse(t: &str) -> Result<Vec<Part>, CliError> {
    let mut tokens = Vec::new();
    let mut rest = t;
    while !rest.is_empty() {
        match rest.find('{') {
            Some(0) => {
                let end = find_close(rest).ok_or_else(|| bad(t, "unclosed {"))?;
                tokens.push(Tok::Expr(rest[1..end].trim().to_string()));
                rest = &rest[end + 1..];
            }
            Some(i) => {
                tokens.push(Tok::Text(rest[..i].to_string()));
                rest = &rest[i..];
            }
            None => {
                tokens.push(Tok::Text(rest.to_string()));
                rest = "";
            }
        }
    }
    let mut it = tokens.into_iter();
    let (parts, ended) = build(&mut it, t)?;
    if ended {
        return Err(bad(t, "{end} without {range}"));
    }
    Ok(parts)
}

enum Tok {
    Text(String),
    Expr(String),
}

fn find_close(s: &str) -> Option<usize> {
    let mut in_str: Option<char> = None;
    let mut escaped = false;
    for (i, c) in s.char_indices().skip(1) {
        if let Some(q) = in_str {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                in_str = None;
            }
        } else if c == '"' || c == '\'' {
            in_str = Some(c);
        } else if c == '}' {
            return Some(i);
        }
    }
    None
}

fn build(it: &mut impl Iterator<Item = Tok>, t: &str) -> Result<(Vec<Part>, bool), CliError> {
    let mut parts = Vec::new();
    while let Some(tok) = it.next() {
        match tok {
            Tok::Text(s) => parts.push(Part::Text(s)),
            Tok::Expr(e) if e == "end" => return Ok((parts, true)),
            Tok::Expr(e) if e.starts_with("range ") => {
                let path = parse_path(e["range ".len()..].trim(), t)?;
                let (body, ended) = build(it, t)?;
                if !ended {
                    return Err(bad(t, "{range} without {end}"));
                }
                parts.push(Part::Range(path, body));
            }
            Tok::Expr(e) if e.starts_with('"') || e.starts_with('\'') => {
                let inner = &e[1..e.len().saturating_sub(1)];
                parts.push(Part::Text(unescape(inner)));
            }
            Tok::Expr(e) => parts.push(Part::Path(parse_path(&e, t)?)),
        }
    }
    Ok((parts, false))
}

fn unescape(s: &str) -> String {
    s.replace("\\n", "\n")
        .replace("\\t", "\t")
        .replace("\\\"", "\"")
}

fn parse_path(p: &str, t: &str) -> Result<Vec<Step>, CliError> {
    let p = p.strip_prefix('$').unwrap_or(p);
    let mut steps = Vec::new();
    let b = p.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'@' => i += 1,
            b'.' => {
                let start = i + 1;
                let mut j = start;
                let mut name = Vec::new();
                while j < b.len() && b[j] != b'.' && b[j] != b'[' {
                    if b[j] == b'\\' && j + 1 < b.len() {
                        j += 1;
                    }
                    name.push(b[j]);
                    j += 1;
                }
                let name = String::from_utf8_lossy(&name).into_owned();
                if !name.is_empty() {
                    steps.push(if name == "*" {
                        Step::All
                    } else {
                        Step::Field(name)
                    });
                }
                i = j;
            }
            b'[' => {
                let end = p[i..]
                    .find(']')
                    .map(|e| e + i)
                    .ok_or_else(|| bad(t, "unclosed ["))?;
                let inner = p[i + 1..end].trim();
                // A filter may hold `]` inside quotes; find the closing `)]`.
                if inner.starts_with("?(") {
                    let close = p[i..]
                        .find(")]")
                        .map(|e| e + i)
                        .ok_or_else(|| bad(t, "unclosed filter"))?;
                    let f = &p[i + 3..close];
                    let (lhs, rhs, eq) = if let Some((l, r)) = f.split_once("!=") {
                        (l, r, false)
                    } else if let Some((l, r)) = f.split_once("==") {
                        (l, r, true)
                    } else {
                        return Err(bad(t, "only == and != filters are supported"));
                    };
                    let path: Vec<String> = lhs
                        .trim()
                        .trim_start_matches('@')
                        .split('.')
                        .filter(|s| !s.is_empty())
                        .map(String::from)
                        .collect();
                    let rhs = rhs
                        .trim()
                        .trim_matches(|c| c == '"' || c == '\'')
                        .to_string();
                    steps.push(Step::Filter(path, rhs, eq));
                    i = close + 2;
                    continue;
                }
                if inner == "*" {
                    steps.push(Step::All);
                } else if let Ok(n) = inner.parse::<i64>() {
                    steps.push(Step::Index(n));
                } else {
                    steps.push(Step::Field(
                        inner.trim_matches(|c| c == '\'' || c == '"').to_string(),
                    ));
                }
                i = end + 1;
            }
            _ => {
                // A bare first name (`metadata.name`).
                let j = p[i..].find(['.', '[']).map(|e| e + i).unwrap_or(p.len());
                steps.push(Step::Field(p[i..j].to_string()));
                i = j;
            }
        }
    }
    Ok(steps)
}

fn eval<'a>(steps: &[Step], root: &'a Value) -> Vec<&'a Value> {
    let mut cur = vec![root];
    for s in steps {
        let mut next = Vec::new();
        for v in cur {
            match s {
                Step::Field(f) => {
                    if let Some(x) = v.get(f.as_str()) {
                        next.push(x);
                    }
                }
                Step::Index(n) => {
                    if let Some(a) = v.as_array() {
                        let idx = if *n < 0 { a.len() as i64 + n } else { *n };
                        if let Some(x) = usize::try_from(idx).ok().and_then(|i| a.get(i)) {
                            next.push(x);
                        }
                    }
                }
                Step::All => match v {
                    Value::Array(a) => next.extend(a.iter()),
                    Value::Object(m) => next.extend(m.values()),
                    _ => {}
                },
                Step::Filter(path, want, eq) => {
                    for x in v.as_array().into_iter().flatten() {
                        let mut f = Some(x);
                        for k in path {
                            f = f.and_then(|f| f.get(k.as_str()));
                        }
                        let got = f.map(scalar).unwrap_or_default();
                        if (got == *want) == *eq {
                            next.push(x);
                        }
                    }
                }
            }
        }
        cur = next;
    }
    cur
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn render(parts: &[Part], v: &Value, out: &mut String) {
    for p in parts {
        match p {
            Part::Text(s) => out.push_str(s),
            Part::Path(steps) => {
                let found: Vec<String> = eval(steps, v).into_iter().map(scalar).collect();
                out.push_str(&found.join(" "));
            }
            Part::Range(steps, body) => {
                for item in eval(steps, v) {
                    render(body, item, out);
                }
            }
        }
    }
}

/// Applies a jsonpath template to a value.
pub fn apply(template: &str, v: &Value) -> Result<String, CliError> {
    let parts = parse(template)?;
    let mut out = String::new();
    render(&parts, v, &mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn paths_ranges_filters() {
        let list = json!({"items": [
            {"metadata": {"name": "a", "labels": {"k8s.io/x": "1"}}, "status": {"conditions": [
                {"type": "Ready", "status": "True"}, {"type": "Paused", "status": "False"}]}},
            {"metadata": {"name": "b"}, "spec": {"n": 3}},
        ]});
        assert_eq!(apply("{.items[*].metadata.name}", &list).unwrap(), "a b");
        assert_eq!(apply("{.items[0].metadata.name}", &list).unwrap(), "a");
        assert_eq!(apply("{.items[-1].spec.n}", &list).unwrap(), "3");
        assert_eq!(
            apply("{range .items[*]}{.metadata.name}{\"\\n\"}{end}", &list).unwrap(),
            "a\nb\n"
        );
        assert_eq!(
            apply(
                "{.items[0].status.conditions[?(@.type==\"Ready\")].status}",
                &list
            )
            .unwrap(),
            "True"
        );
        assert_eq!(
            apply("{.items[0].metadata.labels['k8s.io/x']}", &list).unwrap(),
            "1"
        );
        assert_eq!(
            apply("name={.items[1].metadata.name}!", &list).unwrap(),
            "name=b!"
        );
        assert_eq!(apply("{.nothing}", &list).unwrap(), "");
        assert_eq!(apply("{.ünï}", &json!({"ünï": "ok"})).unwrap(), "ok");
        assert_eq!(apply("{.a\\.b}", &json!({"a.b": 1})).unwrap(), "1");
        assert!(apply("{.items", &list).is_err());
        assert!(apply("{end}", &list).is_err());
    }
}
