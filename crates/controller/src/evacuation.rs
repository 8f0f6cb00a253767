//! Evacuation, pure (docs/migration.md "Eviction and drain"): which VMIs must leave their node
//! and what to write for them. A VMI is marked for evacuation (`status.evacuationNodeName` =
//! its node) by an eviction of its launcher Pod (the API server, `kubectl drain`) or here, when
//! its node has the `kubevirt.io/drain` NoSchedule taint. A marked VMI whose effective
//! `evictionStrategy` migrates gets a VirtualMachineInstanceMigration (`kubevirt-evacuation-…`,
//! annotated with the node) when none of it is unfinished, within the parallel migration limits
//! (`parallelMigrationsPerCluster`, `parallelOutboundMigrationsPerNode`) and, after a failed
//! one, after a backoff. `External` VMIs are only marked (an external controller acts). The
//! mark is cleared once the VMI has left the node or ended.

use std::collections::HashMap;

use k8s_openapi::api::core::v1::Node;

use ferrovirt_api::eviction::{self, EVACUATION_ANNOTATION, Strategy};
use ferrovirt_api::kubevirt::misc::VirtualMachineInstanceMigration;
use ferrovirt_api::kubevirt::vmi::{VirtualMachineInstance, VmiPhase};

use crate::migration::{self as mig, not_migratable};

/// First wait after a failed evacuation migration; doubled per further failure.
pub const BACKOFF_BASE_SECS: i64 = 10;
/// Longest wait between evacuation migrations of one VMI.
pub const BACKOFF_MAX_SECS: i64 = 300;

/// Event reasons.
pub mod reasons {
    pub const DRAIN_TAINT: &str = "NodeDrainTaint";
    pub const MIGRATION_CREATED: &str = "EvacuationMigrationCreated";
    pub const EVACUATED: &str = "Evacuated";
}

/// One write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Set `status.evacuationNodeName` to `node`.
    Mark {
        namespace: String,
        name: String,
        node: String,
        message: String,
    },
    /// Clear `status.evacuationNodeName` (the VMI left `node` or ended).
    Clear {
        namespace: String,
        name: String,
        node: String,
    },
    /// Create an evacuation migration of the VMI away from `node`.
    Migrate {
        namespace: String,
        name: String,
        node: String,
    },
}

/// What the planner reads.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    pub vmis: &'a [VirtualMachineInstance],
    pub nodes: &'a [Node],
    pub migrations: &'a [VirtualMachineInstanceMigration],
    /// The cluster's `evictionStrategy`: (KubeVirt CR, HyperConverged).
    pub cluster_strategy: (Option<&'a str>, Option<&'a str>),
    pub per_cluster: u32,
    pub per_node: u32,
    /// Seconds since the epoch.
    pub now: i64,
    /// The drain taint's key (`nodeDrainTaintKey`, [`eviction::drain_taint_key`]).
    pub drain_key: &'a str,
}

/// Whether `node` has the drain taint `key` (effect NoSchedule).
pub fn has_drain_taint(node: &Node, key: &str) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == key && t.effect == "NoSchedule"))
}

/// Whether the plan has anything to look at (a marked VMI or a drain-tainted node), so the
/// cluster settings are read only then.
pub fn has_work<'a>(
    vmis: impl IntoIterator<Item = &'a VirtualMachineInstance>,
    nodes: impl IntoIterator<Item = &'a Node>,
    drain_key: &str,
) -> bool {
    nodes_have_work(nodes, drain_key) || vmis_have_work(vmis)
}

/// The Nodes' half of [`has_work`]: a node with the drain taint.
pub fn nodes_have_work<'a>(nodes: impl IntoIterator<Item = &'a Node>, drain_key: &str) -> bool {
    nodes.into_iter().any(|n| has_drain_taint(n, drain_key))
}

/// The VMIs' half of [`has_work`]: a VMI marked for evacuation. It changes only when a VMI
/// does, so the loop keeps the answer until then (a Node change need not look at every VMI).
pub fn vmis_have_work<'a>(vmis: impl IntoIterator<Item = &'a VirtualMachineInstance>) -> bool {
    vmis.into_iter().any(marked_for_evacuation)
}

/// Whether `vmi` is marked for evacuation (`status.evacuationNodeName`).
pub fn marked_for_evacuation(vmi: &VirtualMachineInstance) -> bool {
    vmi.status
        .as_ref()
        .is_some_and(|s| s.evacuation_node_name.is_some())
}

fn key(ns: &str, name: &str) -> String {
    format!("{ns}/{name}")
}

fn ns_of(v: &VirtualMachineInstance) -> &str {
    v.metadata.namespace.as_deref().unwrap_or("default")
}

/// The VMI a migration moves (`namespace/name`).
fn target_of(m: &VirtualMachineInstanceMigration) -> Option<String> {
    let ns = m.metadata.namespace.as_deref().unwrap_or("default");
    Some(key(ns, m.spec.as_ref()?.vmi_name.as_deref()?))
}

/// When the next evacuation migration of a VMI may be created, from its failed ones.
fn retry_at(failed: &[&VirtualMachineInstanceMigration]) -> Option<i64> {
    let last = failed
        .iter()
        .filter_map(|m| m.metadata.creation_timestamp.as_ref())
        .map(|t| t.0.as_second())
        .max()?;
    let n = failed.len().min(16) as u32;
    let wait = (BACKOFF_BASE_SECS << (n - 1)).min(BACKOFF_MAX_SECS);
    Some(last + wait)
}

/// The writes for one pass, in order.
pub fn plan(inp: &Inputs<'_>) -> Vec<Action> {
    let drained: Vec<&str> = inp
        .nodes
        .iter()
        .filter(|n| has_drain_taint(n, inp.drain_key))
        .filter_map(|n| n.metadata.name.as_deref())
        .collect();
    // Unfinished migrations per VMI and per source node; failed evacuations per VMI.
    let node_of: HashMap<String, &str> = inp
        .vmis
        .iter()
        .filter_map(|v| {
            let n = v.status.as_ref()?.node_name.as_deref()?;
            Some((key(ns_of(v), v.metadata.name.as_deref()?), n))
        })
        .collect();
    let mut unfinished: HashMap<String, usize> = HashMap::new();
    let mut from_node: HashMap<&str, usize> = HashMap::new();
    let mut failed: HashMap<String, Vec<&VirtualMachineInstanceMigration>> = HashMap::new();
    let mut in_cluster = 0usize;
    for m in inp.migrations {
        let Some(t) = target_of(m) else { continue };
        let phase = mig::current_phase(m);
        if !mig::is_final(phase) {
            in_cluster += 1;
            *unfinished.entry(t.clone()).or_default() += 1;
            if let Some(n) = node_of.get(&t) {
                *from_node.entry(n).or_default() += 1;
            }
        } else if phase == ferrovirt_api::kubevirt::misc::MigrationPhase::Failed
            && m.metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(EVACUATION_ANNOTATION))
        {
            failed.entry(t).or_default().push(m);
        }
    }
    let mut out = Vec::new();
    for v in inp.vmis {
        let (Some(name), Some(st)) = (v.metadata.name.as_deref(), v.status.as_ref()) else {
            continue;
        };
        let ns = ns_of(v);
        let node = st.node_name.as_deref();
        let marked = st.evacuation_node_name.as_deref();
        let ended = matches!(st.phase, Some(VmiPhase::Succeeded | VmiPhase::Failed))
            || v.metadata.deletion_timestamp.is_some();
        if let Some(m) = marked
            && (node != Some(m) || ended)
        {
            out.push(Action::Clear {
                namespace: ns.into(),
                name: name.into(),
                node: m.into(),
            });
            continue;
        }
        let Some(node) = node else { continue };
        if ended {
            continue;
        }
        let strategy = eviction::effective(
            v.spec.as_ref().and_then(|s| s.eviction_strategy.as_deref()),
            inp.cluster_strategy.0,
            inp.cluster_strategy.1,
        );
        let running = st.phase == Some(VmiPhase::Running);
        let migratable = running && not_migratable(v).is_none();
        let mut is_marked = marked == Some(node);
        if !is_marked && drained.contains(&node) {
            let mark = match strategy {
                Strategy::LiveMigrate | Strategy::LiveMigrateIfPossible => migratable,
                Strategy::External => true,
                Strategy::None => false,
            };
            if mark {
                out.push(Action::Mark {
                    namespace: ns.into(),
                    name: name.into(),
                    node: node.into(),
                    message: format!(
                        "Node {node} has the {} taint: the VMI is marked for evacuation (evictionStrategy {})",
                        inp.drain_key,
                        strategy.as_str()
                    ),
                });
                is_marked = true;
            }
        }
        if !is_marked || strategy == Strategy::External || !migratable {
            continue;
        }
        let k = key(ns, name);
        let busy = unfinished.get(&k).copied().unwrap_or(0) > 0
            || st
                .migration_state
                .as_ref()
                .is_some_and(|m| !ferrovirt_api::migration::finished(m));
        if busy {
            continue;
        }
        if failed
            .get(&k)
            .and_then(|f| retry_at(f))
            .is_some_and(|t| inp.now < t)
        {
            continue;
        }
        let on_node = from_node.get(node).copied().unwrap_or(0);
        if in_cluster >= inp.per_cluster as usize || on_node >= inp.per_node as usize {
            continue;
        }
        in_cluster += 1;
        *from_node.entry(node).or_default() += 1;
        out.push(Action::Migrate {
            namespace: ns.into(),
            name: name.into(),
            node: node.into(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vmi(
        name: &str,
        node: &str,
        strategy: Option<&str>,
        marked: Option<&str>,
    ) -> VirtualMachineInstance {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default", "uid": format!("u-{name}")},
            "spec": {"domain": {}, "evictionStrategy": strategy},
            "status": {"nodeName": node, "phase": "Running", "evacuationNodeName": marked},
        }))
        .unwrap()
    }

    fn node(name: &str, drain: bool) -> Node {
        let taints = if drain {
            json!([{"key": eviction::DRAIN_TAINT, "effect": "NoSchedule"}])
        } else {
            json!([])
        };
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"taints": taints}}))
            .unwrap()
    }

    fn vmim(vmi: &str, phase: &str, created: &str) -> VirtualMachineInstanceMigration {
        serde_json::from_value(json!({
            "metadata": {"name": format!("m-{vmi}"), "namespace": "default",
                "creationTimestamp": created,
                "annotations": {EVACUATION_ANNOTATION: "n1"}},
            "spec": {"vmiName": vmi},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    fn inputs<'a>(
        vmis: &'a [VirtualMachineInstance],
        nodes: &'a [Node],
        migrations: &'a [VirtualMachineInstanceMigration],
    ) -> Inputs<'a> {
        Inputs {
            vmis,
            nodes,
            migrations,
            cluster_strategy: (None, None),
            per_cluster: 5,
            per_node: 2,
            now: 1_800_000_000,
            drain_key: eviction::DRAIN_TAINT,
        }
    }

    fn names(actions: &[Action]) -> Vec<String> {
        actions
            .iter()
            .map(|a| match a {
                Action::Mark { name, .. } => format!("mark {name}"),
                Action::Clear { name, .. } => format!("clear {name}"),
                Action::Migrate { name, .. } => format!("migrate {name}"),
            })
            .collect()
    }

    #[test]
    fn a_marked_vmi_gets_one_migration() {
        let vmis = [vmi("a", "n1", Some("LiveMigrate"), Some("n1"))];
        let nodes = [node("n1", false), node("n2", false)];
        assert_eq!(names(&plan(&inputs(&vmis, &nodes, &[]))), ["migrate a"]);
        // One is unfinished: nothing more.
        let ms = [vmim("a", "Running", "2027-01-15T08:00:00Z")];
        assert!(plan(&inputs(&vmis, &nodes, &ms)).is_empty());
    }

    #[test]
    fn the_mark_is_cleared_once_the_vmi_left() {
        let vmis = [vmi("a", "n2", Some("LiveMigrate"), Some("n1"))];
        let nodes = [node("n1", true), node("n2", false)];
        assert_eq!(names(&plan(&inputs(&vmis, &nodes, &[]))), ["clear a"]);
    }

    #[test]
    fn the_drain_taint_marks_and_migrates_by_strategy() {
        let mut cannot = vmi("d", "n1", Some("LiveMigrate"), None);
        cannot.status.as_mut().unwrap().conditions = Some(vec![
            serde_json::from_value(json!({"type": "LiveMigratable", "status": "False", "reason": "DisksNotLiveMigratable"})).unwrap(),
        ]);
        let vmis = [
            vmi("a", "n1", Some("LiveMigrate"), None),
            vmi("b", "n1", Some("None"), None),
            vmi("c", "n1", Some("External"), None),
            cannot,
            vmi("e", "n2", Some("LiveMigrate"), None),
        ];
        let nodes = [node("n1", true), node("n2", false)];
        assert_eq!(
            names(&plan(&inputs(&vmis, &nodes, &[]))),
            ["mark a", "migrate a", "mark c"]
        );
    }

    #[test]
    fn the_cluster_default_applies_without_a_vmi_strategy() {
        let vmis = [vmi("a", "n1", None, None)];
        let nodes = [node("n1", true)];
        assert!(
            plan(&inputs(&vmis, &nodes, &[])).is_empty(),
            "KubeVirt's default is None"
        );
        let mut i = inputs(&vmis, &nodes, &[]);
        i.cluster_strategy = (None, Some("LiveMigrate"));
        assert_eq!(names(&plan(&i)), ["mark a", "migrate a"]);
    }

    #[test]
    fn parallel_limits_are_respected() {
        let vmis: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|n| vmi(n, "n1", Some("LiveMigrate"), Some("n1")))
            .collect();
        let nodes = [node("n1", false), node("n2", false)];
        // Two outbound per node.
        assert_eq!(
            names(&plan(&inputs(&vmis, &nodes, &[]))),
            ["migrate a", "migrate b"]
        );
        // One per cluster, already taken by another VMI's migration.
        let mut i = inputs(&vmis, &nodes, &[]);
        i.per_cluster = 1;
        let other = [vmim("zz", "Pending", "2027-01-15T08:00:00Z")];
        i.migrations = &other;
        assert!(plan(&i).is_empty());
    }

    #[test]
    fn a_failed_evacuation_is_retried_after_a_backoff() {
        let vmis = [vmi("a", "n1", Some("LiveMigrate"), Some("n1"))];
        let nodes = [node("n1", false), node("n2", false)];
        let failed = [vmim("a", "Failed", "2027-01-15T08:00:00Z")];
        let created = "2027-01-15T08:00:00Z"
            .parse::<k8s_openapi::jiff::Timestamp>()
            .unwrap()
            .as_second();
        let mut i = inputs(&vmis, &nodes, &failed);
        i.now = created + 5;
        assert!(plan(&i).is_empty());
        i.now = created + BACKOFF_BASE_SECS;
        assert_eq!(names(&plan(&i)), ["migrate a"]);
    }

    #[test]
    fn drain_taints_are_found() {
        let key = eviction::DRAIN_TAINT;
        assert!(has_drain_taint(&node("n", true), key));
        assert!(!has_drain_taint(&node("n", false), key));
        let vmis = [vmi("a", "n1", None, None)];
        assert!(!has_work(&vmis, &[node("n1", false)], key));
        assert!(has_work(&vmis, &[node("n1", true)], key));
        // The two halves the loop keeps apart (the VMIs' only looked at when a VMI changed).
        assert!(nodes_have_work(&[node("n1", true)], key));
        assert!(!nodes_have_work(&[node("n1", false)], key));
        assert!(!vmis_have_work(&vmis));
        let marked = [vmis[0].clone(), vmi("b", "n1", None, Some("n1"))];
        assert!(vmis_have_work(&marked));
        assert!(has_work(&marked, &[node("n1", false)], key));
    }

    #[test]
    fn a_configured_drain_taint_key_replaces_the_default() {
        let custom = "example.com/maintenance";
        let mut n1 = node("n1", false);
        n1.spec.as_mut().unwrap().taints = Some(vec![
            serde_json::from_value(json!({"key": custom, "effect": "NoSchedule"})).unwrap(),
        ]);
        let vmis = [vmi("a", "n1", Some("LiveMigrate"), None)];
        let nodes = [n1, node("n2", true)];
        assert!(has_work(&vmis, &nodes[..1], custom));
        assert!(!has_work(&vmis, &nodes[..1], eviction::DRAIN_TAINT));
        let mut i = inputs(&vmis, &nodes, &[]);
        assert!(
            plan(&i).is_empty(),
            "kubevirt.io/drain is not the key on n1"
        );
        i.drain_key = custom;
        let actions = plan(&i);
        assert_eq!(names(&actions), ["mark a", "migrate a"]);
        assert!(
            format!("{:?}", actions[0]).contains(custom),
            "{:?}",
            actions[0]
        );
        // The default key no longer drains n2 (its VMIs stay).
        let vmis = [vmi("b", "n2", Some("LiveMigrate"), None)];
        let mut i = inputs(&vmis, &nodes, &[]);
        i.drain_key = custom;
        assert!(plan(&i).is_empty());
    }
}
