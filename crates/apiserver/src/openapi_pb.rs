//! `/openapi/v2` in its protobuf form (`application/com.github.proto-openapi.spec.v2@v1.0+protobuf`,
//! the gnostic `openapi.v2.Document` message), which kubectl ≤ 1.28 requires for `apply`.
//! Encodes the JSON Swagger document: info, the PATCH operations (with their
//! `x-kubernetes-group-version-kind` and query parameters) and all definitions. Field numbers
//! follow the published OpenAPIv2.proto; JSON-Schema keywords without a v2 field are dropped.

use serde_json::{Map, Value};

/// The protobuf media type kubectl asks for.
pub const MEDIA_TYPE: &str = "application/com.github.proto-openapi.spec.v2@v1.0+protobuf";
/// The Content-Type of the answer (Go's MIME parser rejects the `@` form).
pub const RESPONSE_TYPE: &str = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf";

#[derive(Default)]
struct Msg(Vec<u8>);

impl Msg {
    fn varint(&mut self, mut v: u64) {
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                self.0.push(b);
                return;
            }
            self.0.push(b | 0x80);
        }
    }

    fn key(&mut self, num: u32, wire: u8) {
        self.varint(u64::from(num) << 3 | u64::from(wire));
    }

    fn bytes(&mut self, num: u32, b: &[u8]) {
        self.key(num, 2);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
    }

    fn string(&mut self, num: u32, s: &str) {
        if !s.is_empty() {
            self.bytes(num, s.as_bytes());
        }
    }

    fn msg(&mut self, num: u32, m: Msg) {
        self.bytes(num, &m.0);
    }

    fn bool(&mut self, num: u32, b: bool) {
        if b {
            self.key(num, 0);
            self.varint(1);
        }
    }

    fn int(&mut self, num: u32, v: i64) {
        if v != 0 {
            self.key(num, 0);
            self.varint(v as u64);
        }
    }

    fn double(&mut self, num: u32, v: f64) {
        self.key(num, 1);
        self.0.extend_from_slice(&v.to_le_bytes());
    }
}

/// `Any{yaml = 2}` holding JSON text (JSON is YAML).
fn any(v: &Value) -> Msg {
    let mut m = Msg::default();
    m.string(2, &v.to_string());
    m
}

/// `NamedAny{name = 1, value = 2}`.
fn named_any(name: &str, v: &Value) -> Msg {
    let mut m = Msg::default();
    m.string(1, name);
    m.msg(2, any(v));
    m
}

fn named_schema(name: &str, s: &Value) -> Msg {
    let mut m = Msg::default();
    m.string(1, name);
    m.msg(2, schema(s));
    m
}

fn str_of<'a>(s: &'a Map<String, Value>, k: &str) -> &'a str {
    s.get(k).and_then(Value::as_str).unwrap_or_default()
}

/// `Schema`.
fn schema(v: &Value) -> Msg {
    let mut m = Msg::default();
    let Some(s) = v.as_object() else { return m };
    m.string(1, str_of(s, "$ref"));
    m.string(2, str_of(s, "format"));
    m.string(3, str_of(s, "title"));
    m.string(4, str_of(s, "description"));
    if let Some(d) = s.get("default") {
        m.msg(5, any(d));
    }
    for (k, num) in [("multipleOf", 6), ("maximum", 7), ("minimum", 9)] {
        if let Some(x) = s.get(k).and_then(Value::as_f64) {
            m.double(num, x);
        }
    }
    for (k, num) in [
        ("exclusiveMaximum", 8),
        ("exclusiveMinimum", 10),
        ("uniqueItems", 16),
        ("readOnly", 27),
    ] {
        m.bool(num, s.get(k).and_then(Value::as_bool).unwrap_or(false));
    }
    for (k, num) in [
        ("maxLength", 11),
        ("minLength", 12),
        ("maxItems", 14),
        ("minItems", 15),
        ("maxProperties", 17),
        ("minProperties", 18),
    ] {
        m.int(num, s.get(k).and_then(Value::as_i64).unwrap_or(0));
    }
    m.string(13, str_of(s, "pattern"));
    for r in s
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        m.string(19, r.as_str().unwrap_or_default());
    }
    for e in s
        .get("enum")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        m.msg(20, any(e));
    }
    match s.get("additionalProperties") {
        Some(Value::Bool(b)) => {
            let mut a = Msg::default();
            a.key(2, 0);
            a.varint(u64::from(*b));
            m.msg(21, a);
        }
        Some(o @ Value::Object(_)) => {
            let mut a = Msg::default();
            a.msg(1, schema(o));
            m.msg(21, a);
        }
        _ => {}
    }
    let types: Vec<&str> = match s.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .filter(|t| *t != "null")
            .collect(),
        _ => Vec::new(),
    };
    if !types.is_empty() {
        let mut t = Msg::default();
        for ty in types {
            t.string(1, ty);
        }
        m.msg(22, t);
    }
    match s.get("items") {
        Some(o @ Value::Object(_)) => {
            let mut i = Msg::default();
            i.msg(1, schema(o));
            m.msg(23, i);
        }
        Some(Value::Array(a)) => {
            let mut i = Msg::default();
            for o in a {
                i.msg(1, schema(o));
            }
            m.msg(23, i);
        }
        _ => {}
    }
    for a in s
        .get("allOf")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        m.msg(24, schema(a));
    }
    if let Some(props) = s.get("properties").and_then(Value::as_object) {
        let mut p = Msg::default();
        for (name, ps) in props {
            p.msg(1, named_schema(name, ps));
        }
        m.msg(25, p);
    }
    if let Some(e) = s.get("example") {
        m.msg(30, any(e));
    }
    for (k, x) in s.iter().filter(|(k, _)| k.starts_with("x-")) {
        m.msg(31, named_any(k, x));
    }
    m
}

/// `ParametersItem{parameter: Parameter{non_body_parameter: NonBodyParameter{…}}}`.
fn parameter(p: &Value) -> Msg {
    let mut sub = Msg::default();
    sub.bool(1, p["required"].as_bool().unwrap_or(false));
    sub.string(2, p["in"].as_str().unwrap_or_default());
    sub.string(4, p["name"].as_str().unwrap_or_default());
    let mut non_body = Msg::default();
    match p["in"].as_str() {
        Some("path") => {
            sub.string(5, p["type"].as_str().unwrap_or("string"));
            non_body.msg(4, sub);
        }
        _ => {
            sub.string(6, p["type"].as_str().unwrap_or("string"));
            non_body.msg(3, sub);
        }
    }
    let mut param = Msg::default();
    param.msg(2, non_body);
    let mut item = Msg::default();
    item.msg(1, param);
    item
}

/// `Operation` (id, non-body parameters, vendor extensions).
fn operation(op: &Value) -> Msg {
    let mut m = Msg::default();
    m.string(5, op["operationId"].as_str().unwrap_or_default());
    for p in op["parameters"].as_array().into_iter().flatten() {
        if p["in"] != "body" {
            m.msg(8, parameter(p));
        }
    }
    if let Some(o) = op.as_object() {
        for (k, x) in o.iter().filter(|(k, _)| k.starts_with("x-")) {
            m.msg(13, named_any(k, x));
        }
    }
    m
}

/// Encodes the JSON Swagger document.
pub fn encode(doc: &Value) -> Vec<u8> {
    let mut d = Msg::default();
    d.string(1, doc["swagger"].as_str().unwrap_or("2.0"));
    let mut info = Msg::default();
    info.string(1, doc["info"]["title"].as_str().unwrap_or_default());
    info.string(2, doc["info"]["version"].as_str().unwrap_or_default());
    d.msg(2, info);
    let mut paths = Msg::default();
    for (path, item) in doc["paths"].as_object().into_iter().flatten() {
        let mut pi = Msg::default();
        for (verb, num) in [
            ("get", 2),
            ("put", 3),
            ("post", 4),
            ("delete", 5),
            ("patch", 8),
        ] {
            if let Some(op) = item.get(verb) {
                pi.msg(num, operation(op));
            }
        }
        let mut named = Msg::default();
        named.string(1, path);
        named.msg(2, pi);
        paths.msg(2, named);
    }
    d.msg(8, paths);
    let mut defs = Msg::default();
    for (name, s) in doc["definitions"].as_object().into_iter().flatten() {
        defs.msg(1, named_schema(name, s));
    }
    d.msg(9, defs);
    d.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn encodes_known_bytes() {
        let doc = json!({"swagger": "2.0", "info": {"title": "t", "version": "v"}, "paths": {}, "definitions": {
            "a": {"type": "object", "properties": {"n": {"type": "integer", "format": "int32"}}, "x-k": [1]}
        }});
        let b = encode(&doc);
        // swagger = "2.0"
        assert_eq!(&b[..5], &[0x0a, 3, b'2', b'.', b'0']);
        // info{title "t", version "v"}
        assert_eq!(&b[5..13], &[0x12, 6, 0x0a, 1, b't', 0x12, 1, b'v']);
        let text = String::from_utf8_lossy(&b);
        assert!(text.contains("int32") && text.contains("x-k") && text.contains("[1]"));
        // Schema.type is field 22 (a TypeItem): key 22<<3|2 = 0xb2 0x01.
        assert!(b.windows(2).any(|w| w == [0xb2, 0x01]));
    }
}
