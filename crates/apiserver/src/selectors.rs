//! Label selectors (equality- and set-based, as in `kubectl get -l`) and field selectors
//! (`metadata.name=x,involvedObject.uid=…`), parsed from query strings and matched against
//! JSON objects.

use serde_json::{Map, Value};

/// A selector that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unable to parse requirement: {0}")]
pub struct SelectorError(pub String);

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
    Gt(String, i64),
    Lt(String, i64),
}

/// A parsed label selector: all requirements must hold. Empty matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(pub Vec<Requirement>);

/// Splits on commas that are not inside parentheses.
fn split_top(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 317
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn valid_value(v: &str) -> bool {
    v.len() <= 63
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn checked_key(k: &str, term: &str) -> Result<String, SelectorError> {
    let k = k.trim();
    if valid_key(k) {
        Ok(k.to_string())
    } else {
        Err(SelectorError(format!("invalid label key in {term:?}")))
    }
}

fn checked_value(v: &str, term: &str) -> Result<String, SelectorError> {
    let v = v.trim();
    if valid_value(v) {
        Ok(v.to_string())
    } else {
        Err(SelectorError(format!("invalid label value in {term:?}")))
    }
}

impl LabelSelector {
    /// Parses `a=b,c!=d,e in (x,y),f notin (z),g,!h,n>5`.
    pub fn parse(s: &str) -> Result<Self, SelectorError> {
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(Self(reqs));
        }
        for raw in split_top(s) {
            let term = raw.trim();
            if term.is_empty() {
                return Err(SelectorError(format!("empty requirement in {s:?}")));
            }
            reqs.push(Self::parse_term(term)?);
        }
        Ok(Self(reqs))
    }

    fn parse_term(term: &str) -> Result<Requirement, SelectorError> {
        if let Some(rest) = term.strip_prefix('!') {
            return Ok(Requirement::NotExists(checked_key(rest, term)?));
        }
        if let Some(open) = term.find('(') {
            let close = term
                .rfind(')')
                .filter(|&c| c > open && term[c + 1..].trim().is_empty())
                .ok_or_else(|| SelectorError(format!("missing ')' in {term:?}")))?;
            let head = term[..open].trim_end();
            let (key, op) = head
                .rsplit_once(char::is_whitespace)
                .ok_or_else(|| SelectorError(format!("missing operator in {term:?}")))?;
            let values = term[open + 1..close]
                .split(',')
                .map(|v| checked_value(v, term))
                .collect::<Result<Vec<_>, _>>()?;
            let key = checked_key(key, term)?;
            return match op.trim() {
                "in" => Ok(Requirement::In(key, values)),
                "notin" => Ok(Requirement::NotIn(key, values)),
                other => Err(SelectorError(format!("unknown operator {other:?}"))),
            };
        }
        for (op, len) in [("!=", 2), ("==", 2), ("=", 1), (">", 1), ("<", 1)] {
            if let Some(i) = term.find(op) {
                let key = checked_key(&term[..i], term)?;
                let value = &term[i + len..];
                return match op {
                    "!=" => Ok(Requirement::NotEq(key, checked_value(value, term)?)),
                    "==" | "=" => Ok(Requirement::Eq(key, checked_value(value, term)?)),
                    _ => {
                        let n = value
                            .trim()
                            .parse()
                            .map_err(|_| SelectorError(format!("{term:?}: not an integer")))?;
                        Ok(if op == ">" {
                            Requirement::Gt(key, n)
                        } else {
                            Requirement::Lt(key, n)
                        })
                    }
                };
            }
        }
        Ok(Requirement::Exists(checked_key(term, term)?))
    }

    /// Whether every requirement holds for `labels` (a JSON object of strings, or absent).
    pub fn matches(&self, labels: Option<&Map<String, Value>>) -> bool {
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Requirement::Eq(k, v) => get(k) == Some(v.as_str()),
            Requirement::NotEq(k, v) => get(k) != Some(v.as_str()),
            Requirement::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            Requirement::NotIn(k, vs) => get(k).is_none_or(|x| vs.iter().all(|v| v != x)),
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
            Requirement::Gt(k, n) => get(k)
                .and_then(|x| x.parse::<i64>().ok())
                .is_some_and(|x| x > *n),
            Requirement::Lt(k, n) => get(k)
                .and_then(|x| x.parse::<i64>().ok())
                .is_some_and(|x| x < *n),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the object's `metadata.labels` match.
    pub fn matches_object(&self, obj: &Value) -> bool {
        self.is_empty() || self.matches(obj.pointer("/metadata/labels").and_then(Value::as_object))
    }
}

/// One field-selector term: `path=value` or `path!=value`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldRequirement {
    pub path: String,
    pub value: String,
    pub negate: bool,
}

/// A parsed field selector; all terms must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(pub Vec<FieldRequirement>);

/// Splits a field selector on unescaped commas and unescapes `\,`, `\=`, `\\`.
fn split_escaped(s: &str, sep: char) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            if let (Some(n), Some(o)) = (chars.next(), out.last_mut()) {
                o.push(n);
            }
        } else if c == sep {
            out.push(String::new());
        } else if let Some(o) = out.last_mut() {
            o.push(c);
        }
    }
    out
}

impl FieldSelector {
    /// Parses `metadata.name=x,status.phase!=Running`.
    pub fn parse(s: &str) -> Result<Self, SelectorError> {
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(Self(reqs));
        }
        for term in split_escaped(s, ',') {
            let (path, value, negate) = if let Some((p, v)) = term.split_once("!=") {
                (p, v, true)
            } else if let Some((p, v)) = term.split_once("==") {
                (p, v, false)
            } else if let Some((p, v)) = term.split_once('=') {
                (p, v, false)
            } else {
                return Err(SelectorError(format!(
                    "invalid field selector term {term:?}"
                )));
            };
            let path = path.trim();
            if path.is_empty() {
                return Err(SelectorError(format!(
                    "invalid field selector term {term:?}"
                )));
            }
            reqs.push(FieldRequirement {
                path: path.to_string(),
                value: value.trim().to_string(),
                negate,
            });
        }
        Ok(Self(reqs))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The value of a `metadata.name=` term, if any (lets watches and lists narrow the key).
    pub fn exact_name(&self) -> Option<&str> {
        self.0
            .iter()
            .find(|r| r.path == "metadata.name" && !r.negate)
            .map(|r| r.value.as_str())
    }

    /// Whether every term holds: the dotted path is looked up in the object; a missing field
    /// compares as the empty string, numbers and booleans as their JSON text.
    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|r| {
            let mut cur = Some(obj);
            for seg in r.path.split('.') {
                cur = cur.and_then(|v| v.get(seg));
            }
            let actual = match cur {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
            };
            (actual == r.value) != r.negate
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn labels(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn parse_label_selectors() {
        let s = LabelSelector::parse(
            "app=web, tier!=db,env in (prod, staging),x notin (a),k,!gone,n>3",
        )
        .unwrap();
        assert_eq!(s.0.len(), 7);
        assert_eq!(
            s.0[2],
            Requirement::In("env".into(), vec!["prod".into(), "staging".into()])
        );
        assert_eq!(s.0[5], Requirement::NotExists("gone".into()));
        let l = labels(json!({"app":"web","tier":"fe","env":"prod","k":"","n":"4"}));
        assert!(s.matches(Some(&l)));
        let l2 = labels(json!({"app":"web","tier":"fe","env":"dev","k":"","n":"4"}));
        assert!(!s.matches(Some(&l2)));
        assert!(LabelSelector::parse("").unwrap().matches(None));
        assert!(
            LabelSelector::parse("a==b")
                .unwrap()
                .matches(Some(&labels(json!({"a":"b"}))))
        );
        assert!(LabelSelector::parse("a in (b").is_err());
        assert!(LabelSelector::parse("a=b,,c").is_err());
        assert!(LabelSelector::parse("a=b c").is_err());
        assert!(LabelSelector::parse("x notin (a)").unwrap().matches(None));
        assert!(LabelSelector::parse("kubevirt.io/domain=vm1").is_ok());
    }

    #[test]
    fn field_selectors() {
        let obj = json!({"metadata":{"name":"a","namespace":"ns"},"involvedObject":{"kind":"Pod","uid":"u1"},"count":3});
        assert!(
            FieldSelector::parse("metadata.name=a,metadata.namespace=ns")
                .unwrap()
                .matches(&obj)
        );
        assert!(
            FieldSelector::parse("involvedObject.kind==Pod,involvedObject.uid=u1")
                .unwrap()
                .matches(&obj)
        );
        assert!(
            !FieldSelector::parse("metadata.name!=a")
                .unwrap()
                .matches(&obj)
        );
        assert!(
            FieldSelector::parse("spec.nodeName=")
                .unwrap()
                .matches(&obj)
        );
        assert!(FieldSelector::parse("count=3").unwrap().matches(&obj));
        assert!(FieldSelector::parse("nonsense").is_err());
        assert_eq!(
            FieldSelector::parse("metadata.name=a\\,b").unwrap().0[0].value,
            "a,b"
        );
        assert_eq!(
            FieldSelector::parse("metadata.name=a")
                .unwrap()
                .exact_name(),
            Some("a")
        );
    }
}
