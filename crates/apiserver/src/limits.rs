//! Limits on what a request may store: the largest object (1.5 MiB, etcd's default request
//! limit), the most JSON-patch operations (10 000, as Kubernetes), and `metadata` checks that run
//! before anything uses the values: `generateName`, label keys and values, annotation keys and
//! their total size (256 KiB). All pure; the handlers call them on create, update and after
//! every patch.

use serde_json::Value;

/// The largest stored object, in bytes of its JSON form (etcd's default `--max-request-bytes`).
pub const MAX_OBJECT_BYTES: usize = 1536 * 1024;
/// The most operations one JSON patch may carry (Kubernetes' limit).
pub const MAX_JSON_PATCH_OPS: usize = 10_000;
/// The largest total size of an object's annotations (keys plus values), as Kubernetes.
pub const MAX_ANNOTATIONS_BYTES: usize = 256 * 1024;
/// How much of `generateName` is kept before the random suffix (Kubernetes: 63 - 5).
pub const MAX_GENERATE_NAME_PREFIX: usize = 58;

/// One metadata problem: (reason, field path, message), as [`crate::ApiError::invalid`] takes.
pub type Cause = (String, String, String);

fn invalid(field: String, msg: String) -> Cause {
    ("FieldValueInvalid".into(), field, msg)
}

/// A qualified-name part: `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`, at most 63 bytes.
fn is_qualified_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

fn is_dns1123_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(crate::objects::is_label)
}

/// Why `key` is not a qualified name (`[prefix/]name`), or None when it is.
pub fn qualified_name_problem(key: &str) -> Option<String> {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix
        && !is_dns1123_subdomain(p)
    {
        return Some(
            "prefix part must be a lowercase RFC 1123 subdomain (at most 253 characters of [a-z0-9-.], each label starting and ending alphanumeric)".into(),
        );
    }
    if !is_qualified_part(name) {
        return Some(
            "name part must consist of at most 63 alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character".into(),
        );
    }
    None
}

/// Why `v` is not a valid label value, or None when it is.
pub fn label_value_problem(v: &str) -> Option<String> {
    if v.is_empty() || is_qualified_part(v) {
        None
    } else {
        Some("a valid label value must be an empty string or consist of at most 63 alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character".into())
    }
}

/// A short, char-boundary-safe rendering of a user value for an error message.
pub fn shown(s: &str) -> String {
    const MAX: usize = 80;
    if s.len() <= MAX {
        return format!("{s:?}");
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}…", &s[..end])
}

fn string_map<'a>(
    meta: &'a Value,
    field: &str,
    causes: &mut Vec<Cause>,
) -> Vec<(&'a str, Option<&'a str>)> {
    match meta.get(field) {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| {
                let s = v.as_str();
                if s.is_none() && !v.is_null() {
                    causes.push((
                        "FieldValueTypeInvalid".into(),
                        format!("metadata.{field}[{}]", shown(k)),
                        "Invalid value: must be a string".into(),
                    ));
                }
                (k.as_str(), s)
            })
            .collect(),
        Some(_) => {
            causes.push((
                "FieldValueTypeInvalid".into(),
                format!("metadata.{field}"),
                "Invalid value: must be a map of strings".into(),
            ));
            Vec::new()
        }
    }
}

/// Checks `generateName`, labels and annotations of `obj`; every problem with its field path.
pub fn metadata_problems(obj: &Value) -> Vec<Cause> {
    let mut causes = Vec::new();
    let Some(meta) = obj.get("metadata") else {
        return causes;
    };
    match meta.get("generateName") {
        None | Some(Value::Null) => {}
        Some(Value::String(g)) => {
            // Kubernetes validates the generated name; the prefix itself must at least consist
            // of characters a name may hold (checked here, before it is cut and suffixed).
            if !g
                .bytes()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'-' | b'.'))
            {
                causes.push(invalid(
                    "metadata.generateName".into(),
                    format!(
                        "Invalid value: {}: a generateName prefix may consist only of lower case alphanumeric characters, '-' or '.'",
                        shown(g)
                    ),
                ));
            }
        }
        Some(_) => causes.push((
            "FieldValueTypeInvalid".into(),
            "metadata.generateName".into(),
            "Invalid value: must be a string".into(),
        )),
    }
    for (k, v) in string_map(meta, "labels", &mut causes) {
        if let Some(why) = qualified_name_problem(k) {
            causes.push(invalid(
                "metadata.labels".into(),
                format!("Invalid value: {}: {why}", shown(k)),
            ));
        }
        if let Some(why) = v.and_then(label_value_problem) {
            causes.push(invalid(
                format!("metadata.labels[{}]", shown(k)),
                format!("Invalid value: {}: {why}", shown(v.unwrap_or_default())),
            ));
        }
    }
    let mut total = 0usize;
    for (k, v) in string_map(meta, "annotations", &mut causes) {
        if let Some(why) = qualified_name_problem(&k.to_ascii_lowercase()) {
            causes.push(invalid(
                "metadata.annotations".into(),
                format!("Invalid value: {}: {why}", shown(k)),
            ));
        }
        total += k.len() + v.map_or(0, str::len);
    }
    if total > MAX_ANNOTATIONS_BYTES {
        causes.push((
            "FieldValueTooLong".into(),
            "metadata.annotations".into(),
            format!("Too long: may not be more than {MAX_ANNOTATIONS_BYTES} bytes (got {total})"),
        ));
    }
    causes
}

/// `prefix` cut to [`MAX_GENERATE_NAME_PREFIX`] bytes on a character boundary.
pub fn generate_name_base(prefix: &str) -> &str {
    if prefix.len() <= MAX_GENERATE_NAME_PREFIX {
        return prefix;
    }
    let mut end = MAX_GENERATE_NAME_PREFIX;
    while !prefix.is_char_boundary(end) {
        end -= 1;
    }
    &prefix[..end]
}

/// The stored size of `obj` when it exceeds [`MAX_OBJECT_BYTES`].
pub fn oversized(obj: &Value) -> Option<usize> {
    let n = json_len(obj);
    (n > MAX_OBJECT_BYTES).then_some(n)
}

/// The length of `v` serialized as compact JSON, without allocating the text.
pub fn json_len(v: &Value) -> usize {
    struct Counter(usize);
    impl std::io::Write for Counter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Counter(0);
    let _ = serde_json::to_writer(&mut c, v);
    c.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn label_keys_and_values() {
        assert_eq!(qualified_name_problem("app"), None);
        assert_eq!(qualified_name_problem("kubevirt.io/domain"), None);
        assert!(qualified_name_problem("Bad Key").is_some());
        assert!(qualified_name_problem("UPPER.io/x").is_some());
        assert!(qualified_name_problem("a/b/c").is_some());
        assert!(qualified_name_problem(&"a".repeat(64)).is_some());
        assert_eq!(label_value_problem(""), None);
        assert!(label_value_problem("é").is_some());
        assert!(label_value_problem(&"v".repeat(64)).is_some());
    }

    #[test]
    fn metadata_checks_name_the_field() {
        let obj = json!({"metadata": {
            "generateName": "vm-é",
            "labels": {"ok": "yes", "bad key": "x", "k": "ünïcode", "n": 5},
            "annotations": {"a": "x".repeat(MAX_ANNOTATIONS_BYTES)}
        }});
        let fields: Vec<String> = metadata_problems(&obj).into_iter().map(|c| c.1).collect();
        assert!(fields.contains(&"metadata.generateName".to_string()));
        assert!(fields.contains(&"metadata.labels".to_string()));
        assert!(fields.contains(&"metadata.labels[\"k\"]".to_string()));
        assert!(fields.contains(&"metadata.labels[\"n\"]".to_string()));
        assert!(fields.contains(&"metadata.annotations".to_string()));
        assert!(metadata_problems(&json!({"metadata": {"labels": {"a": "b"}}})).is_empty());
        assert!(!metadata_problems(&json!({"metadata": {"labels": [1]}})).is_empty());
    }

    #[test]
    fn generate_name_cut_on_a_char_boundary() {
        // A two-byte character straddling every position around the cut.
        for pad in 50..62 {
            let p = format!("{}é{}", "a".repeat(pad), "b".repeat(300));
            let base = generate_name_base(&p);
            assert!(base.len() <= MAX_GENERATE_NAME_PREFIX && p.starts_with(base));
        }
        assert_eq!(generate_name_base("vm-"), "vm-");
        assert!(shown(&"é".repeat(100)).ends_with('…'));
    }

    #[test]
    fn sizes() {
        let v = json!({"a": [1, "x"], "b": null});
        assert_eq!(json_len(&v), serde_json::to_vec(&v).unwrap().len());
        assert!(oversized(&v).is_none());
        assert!(oversized(&json!({"a": "x".repeat(MAX_OBJECT_BYTES)})).is_some());
    }
}
