//! Unit tests of the JSONPath module: the printer-column paths the API server used and the
//! kubectl templates the CLI used (the union of both former test sets), plus the merged cases.

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
    assert_eq!(ev("$.metadata.name"), vec![json!("vm1")]);
    assert_eq!(ev("metadata.name"), vec![json!("vm1")]);
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
    assert_eq!(ev(".metadata.labels.*"), vec![json!("x")]);
    assert!(ev(".status.missing").is_empty());
    assert!(JsonPath::parse(".a[?(@.x=='y')").is_err());
}

#[test]
fn filters() {
    let obj = json!({"ports": [
        {"name": "http", "port": 80, "meta": {"k.x": "a"}},
        {"name": "ssh", "port": 22},
        {"port": 9}
    ]});
    let names = |p: &str| {
        JsonPath::parse(p)
            .unwrap()
            .eval(&obj)
            .into_iter()
            .cloned()
            .collect::<Vec<_>>()
    };
    // Typed literals: a number matches a number, not its quoted spelling.
    assert_eq!(names(".ports[?(@.port==22)].name"), vec![json!("ssh")]);
    assert!(names(".ports[?(@.port=='22')].name").is_empty());
    // Existence.
    assert_eq!(names(".ports[?(@.name)].port"), vec![json!(80), json!(22)]);
    // A filter's own path may use subscripts.
    assert_eq!(names(".ports[?(@.meta['k.x']=='a')].port"), vec![json!(80)]);
    // Unsupported comparisons and subscripts are refused, not misread.
    for p in [
        ".ports[?(@.port>22)]",
        ".ports[?(@.port<22)]",
        ".ports[?(.port==1)]",
        ".ports[0:2]",
        ".ports[name]",
    ] {
        let e = JsonPath::parse(p).unwrap_err();
        assert_eq!(e.template, p, "{e}");
    }
}

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
    assert_eq!(
        apply("{.m}", &json!({"m": {"k": [1]}})).unwrap(),
        "{\"k\":[1]}"
    );
    assert_eq!(apply("{'x'}{\"ü\"}", &list).unwrap(), "xü");
    assert!(apply("{.items", &list).is_err());
    assert!(apply("{end}", &list).is_err());
    assert!(apply("{range .items[*]}x", &list).is_err());
}

#[test]
fn odd_input_does_not_panic() {
    // Escapes and quotes before multi-byte characters, unbalanced brackets and quotes.
    for t in [
        "{.\\ü}",
        "{.a\\}",
        "{\"ü}",
        "{'}",
        "{[}",
        "{.a[']']}",
        "{.a[\"ü\"]}",
        "{..}",
        "{@}",
        "{[?(@)]}",
        "{[?()]}",
        "ü{",
        "}{",
    ] {
        let _ = apply(t, &json!({"ü": 1, "a": {"]": 2, "ü": 3}}));
        let _ = JsonPath::parse(t);
    }
    assert_eq!(apply("{.\\ü}", &json!({"ü": 1})).unwrap(), "1");
    assert_eq!(apply("{.a[']']}", &json!({"a": {"]": 2}})).unwrap(), "2");
}
