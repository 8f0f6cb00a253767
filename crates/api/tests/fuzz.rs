//! Property test: arbitrary mutations (delete, replace, retype JSON nodes) of valid manifests
//! never make admission panic; it answers Ok or Invalid, and unknown_fields never panics.

mod common;

use common::{corpus, def_of};
use ferrovirt_api::admission::{Operation, admit};
use ferrovirt_api::registry::unknown_fields;
use proptest::prelude::*;
use serde_json::{Value, json};

/// Paths (as index lists into objects/arrays) of every node.
fn nodes(v: &Value, path: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
    out.push(path.clone());
    match v {
        Value::Object(m) => {
            for (i, (_, c)) in m.iter().enumerate() {
                path.push(i);
                nodes(c, path, out);
                path.pop();
            }
        }
        Value::Array(a) => {
            for (i, c) in a.iter().enumerate() {
                path.push(i);
                nodes(c, path, out);
                path.pop();
            }
        }
        _ => {}
    }
}

fn node_mut<'a>(v: &'a mut Value, path: &[usize]) -> Option<&'a mut Value> {
    let mut cur = v;
    for &i in path {
        cur = match cur {
            Value::Object(m) => m.values_mut().nth(i)?,
            Value::Array(a) => a.get_mut(i)?,
            _ => return None,
        };
    }
    Some(cur)
}

#[derive(Debug, Clone)]
enum Mutation {
    Delete,
    Replace(Value),
    Retype,
    AddKey(String, Value),
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-1e12f64..1e12).prop_map(|f| json!(f)),
        "[a-zA-Z0-9 ._:/-]{0,12}".prop_map(Value::from),
        Just(json!("")),
        Just(json!("1Gi")),
        Just(json!({})),
        Just(json!([])),
        Just(json!([{}])),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        Just(Mutation::Delete),
        leaf().prop_map(Mutation::Replace),
        Just(Mutation::Retype),
        ("[a-z]{1,8}", leaf()).prop_map(|(k, v)| Mutation::AddKey(k, v)),
    ]
}

fn apply(doc: &mut Value, at: usize, m: &Mutation) {
    let mut all = Vec::new();
    nodes(doc, &mut Vec::new(), &mut all);
    let path = all[at % all.len()].clone();
    match m {
        Mutation::Delete => {
            if let Some((last, parent)) = path.split_last()
                && let Some(p) = node_mut(doc, parent)
            {
                match p {
                    Value::Object(map) => {
                        if let Some(k) = map.keys().nth(*last).cloned() {
                            map.remove(&k);
                        }
                    }
                    Value::Array(a) if *last < a.len() => {
                        a.remove(*last);
                    }
                    _ => {}
                }
            }
        }
        Mutation::Replace(v) => {
            if let Some(n) = node_mut(doc, &path) {
                *n = v.clone();
            }
        }
        Mutation::Retype => {
            if let Some(n) = node_mut(doc, &path) {
                *n = match n.take() {
                    Value::String(s) => json!([s]),
                    Value::Number(x) => json!(x.to_string()),
                    Value::Bool(b) => json!(if b { 1 } else { 0 }),
                    Value::Array(a) => json!({"items": a}),
                    Value::Object(o) => Value::Array(o.into_iter().map(|(_, v)| v).collect()),
                    Value::Null => json!({}),
                };
            }
        }
        Mutation::AddKey(k, v) => {
            if let Some(Value::Object(map)) = node_mut(doc, &path) {
                map.insert(k.clone(), v.clone());
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 768, .. ProptestConfig::default() })]

    #[test]
    fn admission_never_panics(
        doc in 0usize..64,
        muts in prop::collection::vec((any::<usize>(), mutation()), 1..6),
        update in any::<bool>(),
    ) {
        let docs = corpus();
        let (_, original) = &docs[doc % docs.len()];
        let def = def_of(original);
        let mut obj = original.clone();
        for (at, m) in &muts {
            apply(&mut obj, *at, m);
        }
        let _ = unknown_fields(&def, &obj);
        let op = if update { Operation::Update } else { Operation::Create };
        let mut admitted = obj.clone();
        match admit(&def, op, &mut admitted, Some(original)) {
            Ok(()) => {
                // Admitted objects are stable under a second admission.
                let mut again = admitted.clone();
                prop_assert!(admit(&def, op, &mut again, Some(original)).is_ok());
                prop_assert_eq!(again, admitted);
            }
            Err(invalid) => prop_assert!(!invalid.0.is_empty()),
        }
    }
}
