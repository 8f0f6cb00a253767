//! Unit tests of the YAML module: round trips, multi-document streams, and the attacks the
//! budget must refuse (billion laughs, deep nesting).

use super::*;
use serde_json::{Value, json};

#[test]
fn round_trip_and_multi_document() {
    let v = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "a", "labels": {"x": "1"}},
        "data": {"k": "line1\nline2\n", "n": "007", "b": "true", "e": ""},
        "list": [{"name": "x", "v": 1}, {"name": "y"}], "empty": {}, "none": null});
    let y = to_string(&v).unwrap();
    assert!(y.contains("list:\n- name: x\n"), "{y}");
    let back: Value = from_str(&y).unwrap();
    assert_eq!(back, v);
    let docs: Vec<Value> = from_multiple("a: 1\n---\nb: 2\n---\n").unwrap();
    assert_eq!(docs[..2], [json!({"a": 1}), json!({"b": 2})]);
}

#[test]
fn anchors_within_budget_work() {
    let v: Value = from_str("base: &b {x: 1}\nother: *b\n").unwrap();
    assert_eq!(v["other"], json!({"x": 1}));
}

/// Nine levels of tenfold aliases: 10^9 leaves if expanded. It must fail fast, not eat memory.
#[test]
fn billion_laughs_is_refused() {
    let mut doc = String::from(
        "l0: &l0 [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n",
    );
    for i in 1..10 {
        let prev = format!("*l{}", i - 1);
        let items = [prev.as_str(); 10].join(",");
        doc.push_str(&format!("l{i}: &l{i} [{items}]\n"));
    }
    let t = std::time::Instant::now();
    let err = from_str::<Value>(&doc).unwrap_err();
    assert!(
        t.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        t.elapsed()
    );
    assert!(matches!(err, YamlError::Decode(_)), "{err}");
}

#[test]
fn deep_nesting_is_refused() {
    for (open, close) in [("[", "]"), ("{a: ", "}")] {
        let deep = format!("{}1{}", open.repeat(100_000), close.repeat(100_000));
        assert!(from_str::<Value>(&deep).is_err());
    }
    let block: String = (0..10_000)
        .map(|i| format!("{}a:\n", " ".repeat(i)))
        .collect();
    assert!(from_str::<Value>(&block).is_err());
    // Up to the cap is fine.
    let ok = format!(
        "{}1{}",
        "[".repeat(MAX_DEPTH - 1),
        "]".repeat(MAX_DEPTH - 1)
    );
    assert!(from_str::<Value>(&ok).is_ok());
    let over = format!(
        "{}1{}",
        "[".repeat(MAX_DEPTH + 1),
        "]".repeat(MAX_DEPTH + 1)
    );
    assert!(from_str::<Value>(&over).is_err());
}

/// Up to the cap decodes even when the caller's stack is small (a tokio worker has 2 MiB; this
/// thread has 512 KiB), because decoding runs on its own stack.
#[test]
fn max_depth_fits_any_caller_stack() {
    let ok = format!(
        "{}1{}",
        "[".repeat(MAX_DEPTH - 1),
        "]".repeat(MAX_DEPTH - 1)
    );
    let decoded = std::thread::Builder::new()
        .stack_size(512 * 1024)
        .spawn(move || from_str::<Value>(&ok).is_ok())
        .unwrap()
        .join()
        .unwrap();
    assert!(decoded);
}
