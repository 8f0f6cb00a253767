//! JSONPath in kubectl's dialect, the one implementation behind the API server's printer columns
//! ([`JsonPath`]: `.a.b`, `{.a.b}`, `.a[0]`, `.a[-1]`, `.a[*].b`, `.a.*`, `.a['x.y']`, `.a\.b`,
//! filters `[?(@.type=='Ready')]` with `==`, `!=` or bare existence) and the CLI's
//! `-o jsonpath=TEMPLATE` ([`Template`]: literal text with `{expr}` parts, quoted strings such
//! as `{"\n"}`, and `{range PATH}...{end}`; several results print separated by spaces).
//!
//! Why our own and not a crate: kube-rs depends on `jsonpath-rust`, which implements RFC 9535
//! queries (`$`-rooted, RFC filter grammar) but not kubectl's template language: no literal text
//! between `{}` parts, no `{range}`/`{end}`, no `\.` escapes in names. The server and the CLI
//! each had a parser of their own; this module merges them (the server's quote-aware subscript
//! parsing and typed filter literals, the CLI's templates, bare first names and `@`) so that a
//! printer column and `kubectl -o jsonpath` read a path the same way. Pure: no I/O.
//! Unsupported syntax (slices, `<`/`>` filters, unions) is refused with an error naming it.

use serde_json::Value;

/// A template or path that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("error parsing jsonpath {template}: {reason}")]
pub struct JsonPathError {
    /// The text that was being parsed.
    pub template: String,
    /// What is wrong with it.
    pub reason: String,
}

fn bad(template: &str, reason: impl Into<String>) -> JsonPathError {
    JsonPathError {
        template: template.to_string(),
        reason: reason.into(),
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Step {
    Field(String),
    Index(i64),
    All,
    Filter {
        path: JsonPath,
        /// (negated, literal); None: existence test.
        cmp: Option<(bool, Value)>,
    },
}

/// A compiled path.
#[derive(Debug, Clone, PartialEq)]
pub struct JsonPath(Vec<Step>);

/// A string or JSON literal of a filter (`'x'`, `"x"`, `3`, `true`); anything else is a string.
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

fn parse_filter(inner: &str, src: &str) -> Result<Step, JsonPathError> {
    let inner = inner.trim();
    let (lhs, cmp) = if let Some((l, r)) = inner.split_once("!=") {
        (l, Some((true, parse_literal(r))))
    } else if let Some((l, r)) = inner.split_once("==") {
        (l, Some((false, parse_literal(r))))
    } else {
        (inner, None)
    };
    let lhs = lhs.trim();
    if lhs.contains(['<', '>', '&', '|', ' ']) {
        return Err(bad(src, "only ==, != and existence filters are supported"));
    }
    let rest = lhs
        .strip_prefix('@')
        .ok_or_else(|| bad(src, "a filter must start with @"))?;
    Ok(Step::Filter {
        path: JsonPath::parse_steps(rest, src)?,
        cmp,
    })
}

/// Reads a name from `s` up to the next unescaped `.` or `[`; `\x` stands for `x`. Returns the
/// name and the byte length consumed.
fn read_name(s: &str) -> (String, usize) {
    let mut name = String::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '.' | '[' => return (name, i),
            '\\' => match chars.next() {
                Some((_, n)) => name.push(n),
                None => name.push('\\'),
            },
            c => name.push(c),
        }
    }
    (name, s.len())
}

impl JsonPath {
    /// Parses a path, optionally wrapped in `{}` and starting with `$`.
    pub fn parse(src: &str) -> Result<Self, JsonPathError> {
        let mut s = src.trim();
        if let Some(inner) = s.strip_prefix('{').and_then(|r| r.strip_suffix('}')) {
            s = inner.trim();
        }
        Self::parse_steps(s.strip_prefix('$').unwrap_or(s), src)
    }

    fn parse_steps(s: &str, src: &str) -> Result<Self, JsonPathError> {
        let mut steps = Vec::new();
        let mut i = 0;
        while i < s.len() {
            let rest = &s[i..];
            if let Some(r) = rest.strip_prefix('@') {
                i = s.len() - r.len();
            } else if let Some(r) = rest.strip_prefix('.') {
                let (name, used) = read_name(r);
                match name.as_str() {
                    "" => {}
                    "*" => steps.push(Step::All),
                    _ => steps.push(Step::Field(name)),
                }
                i += 1 + used;
            } else if rest.starts_with('[') {
                let close = find_close(rest).ok_or_else(|| bad(src, "unclosed ["))?;
                let inner = rest[1..close].trim();
                if inner == "*" {
                    steps.push(Step::All);
                } else if let Some(f) = inner.strip_prefix("?(").and_then(|r| r.strip_suffix(')')) {
                    steps.push(parse_filter(f, src)?);
                } else if let Ok(n) = inner.parse::<i64>() {
                    steps.push(Step::Index(n));
                } else if inner.len() >= 2
                    && (inner.starts_with('\'') && inner.ends_with('\'')
                        || inner.starts_with('"') && inner.ends_with('"'))
                {
                    steps.push(Step::Field(inner[1..inner.len() - 1].to_string()));
                } else {
                    return Err(bad(src, format!("unsupported subscript [{inner}]")));
                }
                i += close + 1;
            } else {
                // A bare first name (`metadata.name`).
                let (name, used) = read_name(rest);
                steps.push(Step::Field(name));
                i += used.max(1);
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
                                let x = path.eval(item).into_iter().next();
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

/// Index of the `]` closing the `[` at the start of `s`, skipping quoted text and nested
/// brackets.
fn find_close(s: &str) -> Option<usize> {
    let mut depth = 0;
    let mut quote: Option<char> = None;
    for (i, c) in s.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, '[') => depth += 1,
            (None, ']') => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

#[derive(Debug, Clone, PartialEq)]
enum Part {
    Text(String),
    Path(JsonPath),
    Range(JsonPath, Vec<Part>),
}

/// A compiled kubectl `-o jsonpath` template.
#[derive(Debug, Clone, PartialEq)]
pub struct Template(Vec<Part>);

enum Tok {
    Text(String),
    Expr(String),
}

/// Index of the `}` closing the `{` at the start of `s`, skipping quoted text.
fn find_brace(s: &str) -> Option<usize> {
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

fn unescape(s: &str) -> String {
    s.replace("\\n", "\n")
        .replace("\\t", "\t")
        .replace("\\\"", "\"")
}

fn build(it: &mut impl Iterator<Item = Tok>, t: &str) -> Result<(Vec<Part>, bool), JsonPathError> {
    let mut parts = Vec::new();
    while let Some(tok) = it.next() {
        match tok {
            Tok::Text(s) => parts.push(Part::Text(s)),
            Tok::Expr(e) if e == "end" => return Ok((parts, true)),
            Tok::Expr(e) if e.starts_with("range ") => {
                let path = JsonPath::parse_steps(strip_root(&e["range ".len()..]), t)?;
                let (body, ended) = build(it, t)?;
                if !ended {
                    return Err(bad(t, "{range} without {end}"));
                }
                parts.push(Part::Range(path, body));
            }
            Tok::Expr(e) if e.starts_with('"') || e.starts_with('\'') => {
                let q = &e[..1];
                let inner = e[1..].strip_suffix(q).unwrap_or(&e[1..]);
                parts.push(Part::Text(unescape(inner)));
            }
            Tok::Expr(e) => parts.push(Part::Path(JsonPath::parse_steps(strip_root(&e), t)?)),
        }
    }
    Ok((parts, false))
}

fn strip_root(e: &str) -> &str {
    let e = e.trim();
    e.strip_prefix('$').unwrap_or(e)
}

/// How kubectl prints a selected value: strings raw, null as nothing, the rest as JSON.
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
            Part::Path(path) => {
                let found: Vec<String> = path.eval(v).into_iter().map(scalar).collect();
                out.push_str(&found.join(" "));
            }
            Part::Range(path, body) => {
                for item in path.eval(v) {
                    render(body, item, out);
                }
            }
        }
    }
}

impl Template {
    /// Parses a template: text with `{expr}`, `{"text"}` and `{range PATH}...{end}` parts.
    pub fn parse(t: &str) -> Result<Self, JsonPathError> {
        let mut tokens = Vec::new();
        let mut rest = t;
        while !rest.is_empty() {
            match rest.find('{') {
                Some(0) => {
                    let end = find_brace(rest).ok_or_else(|| bad(t, "unclosed {"))?;
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
        let (parts, ended) = build(&mut tokens.into_iter(), t)?;
        if ended {
            return Err(bad(t, "{end} without {range}"));
        }
        Ok(Self(parts))
    }

    /// The template's output for `v`.
    pub fn render(&self, v: &Value) -> String {
        let mut out = String::new();
        render(&self.0, v, &mut out);
        out
    }
}

/// Parses `template` and renders it for `v`.
pub fn apply(template: &str, v: &Value) -> Result<String, JsonPathError> {
    Ok(Template::parse(template)?.render(v))
}

#[cfg(test)]
#[path = "jsonpath_tests.rs"]
mod tests;
