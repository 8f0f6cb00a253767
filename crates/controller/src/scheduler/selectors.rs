//! Label and node selector matching: `nodeSelector`, node affinity terms (`matchExpressions`
//! with In/NotIn/Exists/DoesNotExist/Gt/Lt, `matchFields` on `metadata.name`) and
//! metav1 `LabelSelector`s used by VMI (anti-)affinity terms.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

/// Labels of an object, empty when it has none.
pub fn labels_of(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> &BTreeMap<String, String> {
    static EMPTY: BTreeMap<String, String> = BTreeMap::new();
    meta.labels.as_ref().unwrap_or(&EMPTY)
}

/// Whether every `key: value` of a `nodeSelector` is among the node's labels.
pub fn matches_node_selector_map(selector: &BTreeMap<String, String>, node: &Node) -> bool {
    let labels = labels_of(&node.metadata);
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// Whether a required `NodeSelector` matches: its terms are ORed; an empty list matches nothing.
pub fn matches_node_selector(selector: &NodeSelector, node: &Node) -> bool {
    selector
        .node_selector_terms
        .iter()
        .any(|term| matches_node_selector_term(term, node))
}

/// Whether one term matches: its expressions and fields are ANDed; a term with neither
/// matches nothing (as in Kubernetes).
pub fn matches_node_selector_term(term: &NodeSelectorTerm, node: &Node) -> bool {
    let exprs = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if exprs.is_empty() && fields.is_empty() {
        return false;
    }
    let labels = labels_of(&node.metadata);
    exprs
        .iter()
        .all(|req| matches_requirement(req, labels.get(&req.key).map(String::as_str)))
        && fields.iter().all(|req| {
            let value = match req.key.as_str() {
                "metadata.name" => node.metadata.name.as_deref(),
                _ => return false,
            };
            matches!(req.operator.as_str(), "In" | "NotIn") && matches_requirement(req, value)
        })
}

/// Evaluate one node selector requirement against the value of its key (`None` = absent).
fn matches_requirement(req: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = req.values.as_deref().unwrap_or_default();
    match req.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|x| x == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), [bound]) = (value, values) else {
                return false;
            };
            let (Ok(v), Ok(bound)) = (v.parse::<i64>(), bound.parse::<i64>()) else {
                return false;
            };
            if req.operator == "Gt" {
                v > bound
            } else {
                v < bound
            }
        }
        _ => false,
    }
}

/// Whether a metav1 `LabelSelector` selects these labels. An empty selector selects
/// everything; unknown operators select nothing. (The api crate's matcher, shared with VMI
/// presets.)
pub fn matches_label_selector(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    ferrovirt_api::kubevirt::preset::selector_matches(selector, labels)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::testutil::node;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn req(key: &str, op: &str, values: &[&str]) -> NodeSelectorRequirement {
        NodeSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: Some(values.iter().map(|s| s.to_string()).collect()),
        }
    }

    fn term(exprs: Vec<NodeSelectorRequirement>) -> NodeSelectorTerm {
        NodeSelectorTerm {
            match_expressions: Some(exprs),
            match_fields: None,
        }
    }

    #[test]
    fn node_selector_map() {
        let n = node("n1").label("zone", "a").build();
        let sel: BTreeMap<_, _> = [("zone".to_string(), "a".to_string())].into();
        assert!(matches_node_selector_map(&sel, &n));
        let sel: BTreeMap<_, _> = [("zone".to_string(), "b".to_string())].into();
        assert!(!matches_node_selector_map(&sel, &n));
        assert!(matches_node_selector_map(&BTreeMap::new(), &n));
    }

    #[test]
    fn expression_operators() {
        let n = node("n1").label("zone", "a").label("gen", "5").build();
        let cases = [
            (req("zone", "In", &["a", "b"]), true),
            (req("zone", "In", &["b"]), false),
            (req("zone", "NotIn", &["b"]), true),
            (req("zone", "NotIn", &["a"]), false),
            (req("missing", "NotIn", &["a"]), true),
            (req("zone", "Exists", &[]), true),
            (req("missing", "Exists", &[]), false),
            (req("missing", "DoesNotExist", &[]), true),
            (req("zone", "DoesNotExist", &[]), false),
            (req("gen", "Gt", &["4"]), true),
            (req("gen", "Gt", &["5"]), false),
            (req("gen", "Lt", &["6"]), true),
            (req("gen", "Lt", &["5"]), false),
            (req("zone", "Gt", &["1"]), false),
            (req("zone", "Bogus", &["a"]), false),
        ];
        for (r, want) in cases {
            assert_eq!(
                matches_node_selector_term(&term(vec![r.clone()]), &n),
                want,
                "{r:?}"
            );
        }
    }

    #[test]
    fn terms_are_ored_and_expressions_anded() {
        let n = node("n1").label("zone", "a").label("disk", "ssd").build();
        let both = term(vec![req("zone", "In", &["a"]), req("disk", "In", &["hdd"])]);
        assert!(!matches_node_selector_term(&both, &n));
        let sel = NodeSelector {
            node_selector_terms: vec![both, term(vec![req("disk", "In", &["ssd"])])],
        };
        assert!(matches_node_selector(&sel, &n));
        let empty = NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm::default()],
        };
        assert!(!matches_node_selector(&empty, &n));
    }

    #[test]
    fn match_fields_on_name() {
        let n = node("n1").build();
        let t = |op: &str, v: &str| NodeSelectorTerm {
            match_expressions: None,
            match_fields: Some(vec![req("metadata.name", op, &[v])]),
        };
        assert!(matches_node_selector_term(&t("In", "n1"), &n));
        assert!(!matches_node_selector_term(&t("In", "n2"), &n));
        assert!(matches_node_selector_term(&t("NotIn", "n2"), &n));
        assert!(!matches_node_selector_term(&t("Exists", "n1"), &n));
    }

    #[test]
    fn label_selector() {
        let labels: BTreeMap<_, _> = [("app".to_string(), "db".to_string())].into();
        assert!(matches_label_selector(&LabelSelector::default(), &labels));
        let sel = LabelSelector {
            match_labels: Some([("app".to_string(), "db".to_string())].into()),
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "tier".into(),
                operator: "DoesNotExist".into(),
                values: None,
            }]),
        };
        assert!(matches_label_selector(&sel, &labels));
        let sel = LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "app".into(),
                operator: "NotIn".into(),
                values: Some(vec!["db".into()]),
            }]),
        };
        assert!(!matches_label_selector(&sel, &labels));
    }
}
