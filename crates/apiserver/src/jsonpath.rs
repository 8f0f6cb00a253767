//! The small JSONPath subset used by printer columns: `.a.b`, `{.a.b}`, `.a[0]`, `.a[*].b`,
//! `.a['x.y']`, and filters `[?(@.type=='Ready')]` (`==`, `!=`, or bare existence).

use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
enum Step {
    Field(String),
    Index(i64),
    All,
    Filter {
        path: Vec<String>,
        /// (negated, literal); None: existence test.
        cmp: Option<(bool, Value)>,
    },
}

/// A compiled path.
#[derive(Debug, Clone, PartialEq)]
pub struct JsonPath(Vec<Step>);

/// A path that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid JSONPath {0:?}")]
pub struct JsonPathError(pub String);

fn parse_literal(s: &str) -> Value {
    let s = s.trim();
    if let Some(inner) = s
        .strip_prefix('\'')
        .and_then(|r| r.strip_suffix('\''))
        .or_else(|| s.strip_prefix('"').and_then(|r| r.strip_suffix('"')))
    {
        return Value::String(inner.to_string());
    }
    serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.to_string()))
}

fn parse_filter(inner: &str, err: &JsonPathError) -> Result<Step, JsonPathError> {
    let inner = inner.trim();
    let (lhs, cmp) = if let Some((l, r)) = inner.split_once("!=") {
        (l, Some((true, parse_literal(r))))
    } else if let Some((l, r)) = inner.split_once("==") {
        (l, Some((false, parse_literal(r))))
    } else {
        (inner, None)
    };
    let lhs = lhs.trim();
    let rest = lhs.strip_prefix('@').ok_or_else(|| err.clone())?;
    let path = rest
        .split('.')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    Ok(Step::Filter { path, cmp })
}

impl JsonPath {
    pub fn parse(src: &str) -> Result<Self, JsonPathError> {
        let err = JsonPathError(src.to_string());
        let mut s = src.trim();
        if let Some(inner) = s.strip_prefix('{').and_then(|r| r.strip_suffix('}')) {
            s = inner.trim();
        }
        s = s.strip_prefix('$').unwrap_or(s);
        let mut steps = Vec::new();
        let b = s.as_bytes();
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'.' => {
                    let start = i + 1;
                    let mut j = start;
                    while j < b.len() && b[j] != b'.' && b[j] != b'[' {
                        if b[j] == b'\\' {
                            j += 1;
                        }
                        j += 1;
                    }
                    let j = j.min(b.len());
                    let name = s[start..j].replace("\\.", ".");
                    if !name.is_empty() {
                        steps.push(Step::Field(name));
                    }
                    i = j;
                }
                b'[' => {
                    let close = find_close(s, i).ok_or_else(|| err.clone())?;
                    let inner = s[i + 1..close].trim();
                    if inner == "*" {
                        steps.push(Step::All);
                    } else if let Some(f) =
                        inner.strip_prefix("?(").and_then(|r| r.strip_suffix(')'))
                    {
                        steps.push(parse_filter(f, &err)?);
                    } else if let Ok(n) = inner.parse::<i64>() {
                        steps.push(Step::Index(n));
                    } else if let Value::String(name) = parse_literal(inner) {
                        steps.push(Step::Field(name));
                    } else {
                        return Err(err);
                    }
                    i = close + 1;
                }
                _ => return Err(err),
            }
        }
        Ok(Self(steps))
    }

    /// All values the path selects.
    pub fn eval<'a>(&self, root: &'a Value) -> Vec<&'a Value> {
        let mut cur = vec![root];
        for step in &self.0 {
            let mut next = Vec::new();
            for v in cur {
                match step {
                    Step::Field(f) => next.extend(v.get(f.as_str())),
                    Step::Index(n) => {
                        if let Some(a) = v.as_array() {
                            let idx = if *n < 0 { a.len() as i64 + n } else { *n };
                            next.extend(usize::try_from(idx).ok().and_then(|i| a.get(i)));
                        }
                    }
                    Step::All => match v {
                        Value::Array(a) => next.extend(a.iter()),
                        Value::Object(m) => next.extend(m.values()),
                        _ => {}
                    },
                    Step::Filter { path, cmp } => {
                        if let Some(a) = v.as_array() {
                            next.extend(a.iter().filter(|item| {
                                let mut x = Some(*item);
                                for seg in path {
                                    x = x.and_then(|y| y.get(seg.as_str()));
                                }
                                match (cmp, x) {
                                    (None, x) => x.is_some(),
                                    (Some((neg, lit)), x) => (x == Some(lit)) != *neg,
                                }
                            }));
                        }
                    }
                }
            }
            cur = next;
        }
        cur
    }
}

/// Index of the `]` closing the `[` at `open`, skipping quoted text and nested brackets.
fn find_close(s: &str, open: usize) -> Option<usize> {
    let mut depth = 0;
    let mut quote: Option<char> = None;
    for (i, c) in s[open..].char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, '[') => depth += 1,
            (None, ']') => {
                depth -= 1;
                if depth == 0 {
                    return Some(open + i);
                }
            }
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn paths() {
        let obj = json!({
            "metadata": {"name": "vm1", "labels": {"a.b/c": "x"}},
            "status": {
                "conditions": [
                    {"type": "Paused", "status": "False"},
                    {"type": "Ready", "status": "True"}
                ],
                "ips": [{"ip": "10.0.0.1"}, {"ip": "10.0.0.2"}]
            }
        });
        let ev = |p: &str| {
            JsonPath::parse(p)
                .unwrap()
                .eval(&obj)
                .into_iter()
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(ev(".metadata.name"), vec![json!("vm1")]);
        assert_eq!(ev("{.metadata.name}"), vec![json!("vm1")]);
        assert_eq!(
            ev(".status.conditions[?(@.type=='Ready')].status"),
            vec![json!("True")]
        );
        assert_eq!(
            ev(".status.conditions[?(@.type!=\"Ready\")].type"),
            vec![json!("Paused")]
        );
        assert_eq!(
            ev(".status.ips[*].ip"),
            vec![json!("10.0.0.1"), json!("10.0.0.2")]
        );
        assert_eq!(ev(".status.ips[-1].ip"), vec![json!("10.0.0.2")]);
        assert_eq!(ev(".metadata.labels['a.b/c']"), vec![json!("x")]);
        assert_eq!(ev(".metadata.labels.a\\.b/c"), vec![json!("x")]);
        assert!(ev(".status.missing").is_empty());
        assert!(JsonPath::parse(".a[?(@.x=='y')").is_err());
    }
}
