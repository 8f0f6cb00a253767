//! VMI-to-VMI affinity and anti-affinity (`spec.affinity.podAffinity` /
//! `podAntiAffinity`), evaluated among VMIs by their labels and the node label named by each
//! term's `topologyKey` (e.g. `kubernetes.io/hostname`, `topology.kubernetes.io/zone`).

use k8s_openapi::api::core::v1::{Node, PodAffinityTerm};

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;

use super::selectors::{labels_of, matches_label_selector};

/// Filter reason when a required affinity term is unmet.
pub const REASON_AFFINITY: &str = "node(s) didn't match pod affinity rules";
/// Filter reason when a required anti-affinity term of the incoming VMI is violated.
pub const REASON_ANTI_AFFINITY: &str = "node(s) didn't match pod anti-affinity rules";
/// Filter reason when an already placed VMI's anti-affinity would be violated.
pub const REASON_EXISTING_ANTI_AFFINITY: &str =
    "node(s) didn't satisfy existing pods anti-affinity rules";

/// A VMI bound to a node.
#[derive(Debug, Clone, Copy)]
pub struct Placed<'a> {
    pub vmi: &'a VirtualMachineInstance,
    pub node: &'a Node,
}

fn affinity(vmi: &VirtualMachineInstance) -> Option<&k8s_openapi::api::core::v1::Affinity> {
    vmi.spec.as_ref().and_then(|s| s.affinity.as_ref())
}

fn required_affinity(vmi: &VirtualMachineInstance) -> &[PodAffinityTerm] {
    affinity(vmi)
        .and_then(|a| a.pod_affinity.as_ref())
        .and_then(|p| {
            p.required_during_scheduling_ignored_during_execution
                .as_deref()
        })
        .unwrap_or_default()
}

fn required_anti_affinity(vmi: &VirtualMachineInstance) -> &[PodAffinityTerm] {
    affinity(vmi)
        .and_then(|a| a.pod_anti_affinity.as_ref())
        .and_then(|p| {
            p.required_during_scheduling_ignored_during_execution
                .as_deref()
        })
        .unwrap_or_default()
}

/// Whether `term` (declared by a VMI in `owner_ns`) selects `other`: namespaces from the term,
/// else the owner's namespace (an empty `namespaceSelector` means all namespaces), and the
/// label selector (absent selects nothing).
pub fn term_selects(
    term: &PodAffinityTerm,
    owner_ns: &str,
    other: &VirtualMachineInstance,
) -> bool {
    let other_ns = other.metadata.namespace.as_deref().unwrap_or("default");
    let ns_ok = match (term.namespaces.as_deref(), term.namespace_selector.as_ref()) {
        (Some(list), _) if !list.is_empty() => list.iter().any(|n| n == other_ns),
        (_, Some(sel))
            if sel.match_labels.as_ref().is_none_or(|m| m.is_empty())
                && sel.match_expressions.as_ref().is_none_or(|e| e.is_empty()) =>
        {
            true
        }
        _ => owner_ns == other_ns,
    };
    ns_ok
        && term
            .label_selector
            .as_ref()
            .is_some_and(|sel| matches_label_selector(sel, labels_of(&other.metadata)))
}

/// Whether two nodes share the topology domain named by `key` (both carry the label with the
/// same value).
pub fn same_domain(a: &Node, b: &Node, key: &str) -> bool {
    let va = labels_of(&a.metadata).get(key);
    va.is_some() && va == labels_of(&b.metadata).get(key)
}

fn ns(vmi: &VirtualMachineInstance) -> &str {
    vmi.metadata.namespace.as_deref().unwrap_or("default")
}

/// The inter-VMI affinity filter for placing `vmi` on `node`, given every placed VMI.
pub fn filter(
    vmi: &VirtualMachineInstance,
    node: &Node,
    placed: &[Placed<'_>],
) -> Result<(), String> {
    filter_with(vmi, node, placed, placed)
}

/// Whether `vmi` declares required anti-affinity: only such placed VMIs can keep others off a
/// node, so the scheduler hands [`filter_with`] just those.
pub fn has_required_anti_affinity(vmi: &VirtualMachineInstance) -> bool {
    !required_anti_affinity(vmi).is_empty()
}

/// [`filter`] with the placed VMIs that declare required anti-affinity given apart
/// (`holders`, any superset of them among `placed`): a VMI without affinity terms of its own is
/// then checked against those few instead of every placed VMI on every node.
pub fn filter_with(
    vmi: &VirtualMachineInstance,
    node: &Node,
    placed: &[Placed<'_>],
    holders: &[Placed<'_>],
) -> Result<(), String> {
    // Existing VMIs' required anti-affinity towards the incoming VMI.
    for p in holders {
        for term in required_anti_affinity(p.vmi) {
            if term_selects(term, ns(p.vmi), vmi) && same_domain(p.node, node, &term.topology_key) {
                return Err(REASON_EXISTING_ANTI_AFFINITY.to_string());
            }
        }
    }
    let own_ns = ns(vmi);
    let required = required_affinity(vmi);
    if !required.is_empty() {
        let all_met = required.iter().all(|term| {
            placed.iter().any(|p| {
                term_selects(term, own_ns, p.vmi) && same_domain(p.node, node, &term.topology_key)
            })
        });
        // The first VMI of a group that selects itself may go anywhere (Kubernetes' rule).
        let none_anywhere = !placed
            .iter()
            .any(|p| required.iter().any(|t| term_selects(t, own_ns, p.vmi)));
        let self_match = required.iter().all(|t| term_selects(t, own_ns, vmi));
        if !(all_met || (none_anywhere && self_match)) {
            return Err(REASON_AFFINITY.to_string());
        }
    }
    for term in required_anti_affinity(vmi) {
        if placed.iter().any(|p| {
            term_selects(term, own_ns, p.vmi) && same_domain(p.node, node, &term.topology_key)
        }) {
            return Err(REASON_ANTI_AFFINITY.to_string());
        }
    }
    Ok(())
}

/// Raw preferred (anti-)affinity score of `node`: + weight per matching placed VMI in the
/// same domain for each preferred affinity term, − weight for anti-affinity terms.
pub fn preferred_score(vmi: &VirtualMachineInstance, node: &Node, placed: &[Placed<'_>]) -> i64 {
    let Some(aff) = affinity(vmi) else { return 0 };
    let own_ns = ns(vmi);
    let count = |term: &PodAffinityTerm| {
        placed
            .iter()
            .filter(|p| {
                term_selects(term, own_ns, p.vmi) && same_domain(p.node, node, &term.topology_key)
            })
            .count() as i64
    };
    let plus: i64 = aff
        .pod_affinity
        .as_ref()
        .and_then(|p| {
            p.preferred_during_scheduling_ignored_during_execution
                .as_deref()
        })
        .unwrap_or_default()
        .iter()
        .map(|w| i64::from(w.weight) * count(&w.pod_affinity_term))
        .sum();
    let minus: i64 = aff
        .pod_anti_affinity
        .as_ref()
        .and_then(|p| {
            p.preferred_during_scheduling_ignored_during_execution
                .as_deref()
        })
        .unwrap_or_default()
        .iter()
        .map(|w| i64::from(w.weight) * count(&w.pod_affinity_term))
        .sum();
    plus - minus
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::testutil::{HOSTNAME, node, vmi};

    #[test]
    fn anti_affinity_by_hostname() {
        let n1 = node("n1").build();
        let n2 = node("n2").build();
        let db1 = vmi("db1").label("app", "db").build();
        let db2 = vmi("db2")
            .label("app", "db")
            .anti_affinity("app", "db", HOSTNAME)
            .build();
        let placed = [Placed {
            vmi: &db1,
            node: &n1,
        }];
        assert_eq!(
            filter(&db2, &n1, &placed),
            Err(REASON_ANTI_AFFINITY.to_string())
        );
        assert_eq!(filter(&db2, &n2, &placed), Ok(()));
    }

    #[test]
    fn existing_anti_affinity_is_symmetric() {
        let n1 = node("n1").build();
        let n2 = node("n2").build();
        let guard = vmi("guard").anti_affinity("app", "web", HOSTNAME).build();
        let web = vmi("web").label("app", "web").build();
        let placed = [Placed {
            vmi: &guard,
            node: &n1,
        }];
        assert_eq!(
            filter(&web, &n1, &placed),
            Err(REASON_EXISTING_ANTI_AFFINITY.to_string())
        );
        assert_eq!(filter(&web, &n2, &placed), Ok(()));
    }

    #[test]
    fn affinity_requires_a_peer_in_the_zone() {
        let n1 = node("n1").label("zone", "a").build();
        let n2 = node("n2").label("zone", "b").build();
        let n3 = node("n3").label("zone", "a").build();
        let cache = vmi("cache").label("app", "cache").build();
        let web = vmi("web").affinity("app", "cache", "zone").build();
        let placed = [Placed {
            vmi: &cache,
            node: &n1,
        }];
        assert_eq!(filter(&web, &n3, &placed), Ok(()));
        assert_eq!(filter(&web, &n2, &placed), Err(REASON_AFFINITY.to_string()));
        // Nobody matches yet and the VMI does not select itself: unschedulable everywhere.
        assert_eq!(filter(&web, &n1, &[]), Err(REASON_AFFINITY.to_string()));
        // A VMI that selects itself may start the group.
        let first = vmi("first")
            .label("app", "cache")
            .affinity("app", "cache", "zone")
            .build();
        assert_eq!(filter(&first, &n2, &[]), Ok(()));
    }

    #[test]
    fn namespaces_scope_terms() {
        let n1 = node("n1").build();
        let other = vmi("db").namespace("other").label("app", "db").build();
        let me = vmi("me").anti_affinity("app", "db", HOSTNAME).build();
        assert_eq!(
            filter(
                &me,
                &n1,
                &[Placed {
                    vmi: &other,
                    node: &n1
                }]
            ),
            Ok(())
        );
    }

    #[test]
    fn preferred_terms_score() {
        let n1 = node("n1").build();
        let n2 = node("n2").build();
        let db = vmi("db").label("app", "db").build();
        let placed = [Placed {
            vmi: &db,
            node: &n1,
        }];
        let near = vmi("x")
            .preferred_affinity("app", "db", HOSTNAME, 10)
            .build();
        assert_eq!(preferred_score(&near, &n1, &placed), 10);
        assert_eq!(preferred_score(&near, &n2, &placed), 0);
        let far = vmi("y")
            .preferred_anti_affinity("app", "db", HOSTNAME, 7)
            .build();
        assert_eq!(preferred_score(&far, &n1, &placed), -7);
    }
}
