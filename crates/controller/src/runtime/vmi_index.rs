//! Which cached VMIs wait for a node and which are marked for evacuation, kept from the VMI
//! cache's watch events ([`super::stores::Stores::vmi_index`]), so the scheduler loop and the
//! evacuation loop learn "is anything to do?" without a pass over every cached VMI. At 10,000
//! VMIs such a pass per VMI change (each status write of an agent is one) was a fifth of the
//! server's CPU while the controllers' cache caught up (docs/scale.md, tenth pass).
//!
//! The index follows the reflector's events after the cache applied them (the cache is never
//! older than the index) and before the change is announced (a loop woken by the change finds
//! the index up to date). VMIs are known by uid: a VMI deleted and created again under its
//! name is another entry. A relist (the watch restarted) rebuilds both sets at `InitDone`, as
//! the cache swaps its contents then.

use std::collections::HashSet;

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use kube::runtime::watcher;

use super::resources::Vmi;
use crate::evacuation::marked_for_evacuation;
use crate::scheduler::needs_scheduling;

/// The uid a VMI is indexed under ("" for one without, which the API never serves).
pub fn uid(vmi: &VirtualMachineInstance) -> &str {
    vmi.metadata.uid.as_deref().unwrap_or("")
}

/// The two sets of uids.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Sets {
    waiting: HashSet<String>,
    evacuating: HashSet<String>,
}

impl Sets {
    fn put(&mut self, vmi: &VirtualMachineInstance) {
        let u = uid(vmi);
        set(&mut self.waiting, u, needs_scheduling(vmi));
        set(&mut self.evacuating, u, marked_for_evacuation(vmi));
    }

    fn remove(&mut self, vmi: &VirtualMachineInstance) {
        let u = uid(vmi);
        self.waiting.remove(u);
        self.evacuating.remove(u);
    }
}

fn set(s: &mut HashSet<String>, uid: &str, member: bool) {
    if member {
        if !s.contains(uid) {
            s.insert(uid.to_owned());
        }
    } else {
        s.remove(uid);
    }
}

/// The VMIs waiting for a node and those marked for evacuation, by uid.
#[derive(Debug, Default)]
pub struct VmiIndex {
    now: Sets,
    /// The sets being rebuilt by a relist (`Init` .. `InitDone`).
    relist: Option<Sets>,
}

impl VmiIndex {
    /// Follows one watch event of the VMI cache (after the cache applied it).
    pub fn apply(&mut self, event: &watcher::Event<Vmi>) {
        match event {
            watcher::Event::Apply(v) => self.now.put(&v.0),
            watcher::Event::Delete(v) => self.now.remove(&v.0),
            watcher::Event::Init => self.relist = Some(Sets::default()),
            watcher::Event::InitApply(v) => self.relist.get_or_insert_default().put(&v.0),
            watcher::Event::InitDone => self.now = self.relist.take().unwrap_or_default(),
        }
    }

    /// Whether a VMI waits for a node that `skip` does not account for (the scheduler's
    /// assumed bindings, by uid); stops at the first.
    pub fn any_waiting_except(&self, skip: impl Fn(&str) -> bool) -> bool {
        self.now.waiting.iter().any(|u| !skip(u))
    }

    /// How many VMIs wait for a node.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.now.waiting.len()
    }

    /// Whether a VMI is marked for evacuation (`status.evacuationNodeName`).
    pub fn any_evacuating(&self) -> bool {
        !self.now.evacuating.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrovirt_api::kubevirt::vmi::VmiPhase;

    fn vmi(name: &str) -> Vmi {
        Vmi(serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns", "uid": format!("u-{name}")},
            "spec": {"domain": {"devices": {}}}
        }))
        .unwrap())
    }

    fn bound(mut v: Vmi, node: &str) -> Vmi {
        let st = v.0.status.get_or_insert_default();
        st.node_name = Some(node.into());
        st.phase = Some(VmiPhase::Running);
        v
    }

    fn evacuating(mut v: Vmi) -> Vmi {
        v.0.status.get_or_insert_default().evacuation_node_name = Some("n1".into());
        v
    }

    #[test]
    fn created_bound_evacuated_and_deleted_vmis_are_followed() {
        let mut ix = VmiIndex::default();
        ix.apply(&watcher::Event::Apply(vmi("a")));
        ix.apply(&watcher::Event::Apply(vmi("b")));
        assert_eq!(ix.waiting(), 2);
        assert!(ix.any_waiting_except(|u| u == "u-a"));
        // Bound: no longer waiting.
        ix.apply(&watcher::Event::Apply(bound(vmi("a"), "n1")));
        assert_eq!(ix.waiting(), 1);
        assert!(!ix.any_evacuating());
        // Marked for evacuation, then cleared.
        ix.apply(&watcher::Event::Apply(evacuating(bound(vmi("a"), "n1"))));
        assert!(ix.any_evacuating());
        ix.apply(&watcher::Event::Apply(bound(vmi("a"), "n1")));
        assert!(!ix.any_evacuating());
        // Deleted while waiting, or while marked.
        ix.apply(&watcher::Event::Apply(evacuating(bound(vmi("a"), "n1"))));
        ix.apply(&watcher::Event::Delete(vmi("b")));
        ix.apply(&watcher::Event::Delete(vmi("a")));
        assert_eq!((ix.waiting(), ix.any_evacuating()), (0, false));
        // Being deleted: not waiting.
        let mut d = vmi("c");
        d.0.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-12-05T00:00:00Z".parse().unwrap(),
            ));
        ix.apply(&watcher::Event::Apply(d));
        assert_eq!(ix.waiting(), 0);
    }

    #[test]
    fn a_vmi_recreated_under_its_name_is_another_entry() {
        let mut ix = VmiIndex::default();
        ix.apply(&watcher::Event::Apply(vmi("a")));
        let mut again = vmi("a");
        again.0.metadata.uid = Some("u-other".into());
        ix.apply(&watcher::Event::Apply(again));
        ix.apply(&watcher::Event::Delete(vmi("a")));
        assert_eq!(ix.waiting(), 1);
        assert!(!ix.any_waiting_except(|u| u == "u-other"));
    }

    #[test]
    fn a_relist_rebuilds_the_sets_at_init_done() {
        let mut ix = VmiIndex::default();
        ix.apply(&watcher::Event::Apply(vmi("gone")));
        ix.apply(&watcher::Event::Init);
        ix.apply(&watcher::Event::InitApply(vmi("new")));
        ix.apply(&watcher::Event::InitApply(evacuating(bound(vmi("e"), "n"))));
        ix.apply(&watcher::Event::InitApply(bound(vmi("placed"), "n1")));
        // Until InitDone the old sets hold (as the cache's contents do).
        assert!(!ix.any_waiting_except(|u| u == "u-gone"));
        assert!(!ix.any_evacuating());
        ix.apply(&watcher::Event::InitDone);
        assert_eq!(ix.waiting(), 1);
        assert!(!ix.any_waiting_except(|u| u == "u-new"));
        assert!(ix.any_evacuating());
        // An empty relist empties them.
        ix.apply(&watcher::Event::Init);
        ix.apply(&watcher::Event::InitDone);
        assert_eq!((ix.waiting(), ix.any_evacuating()), (0, false));
    }
}
