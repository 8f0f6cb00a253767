//! The agent's side of addresses that follow a live-migrated VMI (docs/networking.md
//! "Addresses that move"; the route decisions are `ferrovirt_network::routes`): which address
//! an incoming VMI keeps (the one in its status), which addresses the node must not hand to a
//! new VMI (those of VMIs running elsewhere), the claims the other Nodes publish, and the
//! set of addresses this node runs, published on its Node by the overlay loop
//! ([`crate::network::AgentNet::run_overlay`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::Ipv4Addr;

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_network::routes::{ROUTES_ANNOTATION, parse_claims};
use k8s_openapi::api::core::v1::Node;

/// The address `vmi`'s status records for its interface `iface` (`ipAddress`, else the first
/// IPv4 of `ipAddresses`).
pub fn status_address(vmi: &VirtualMachineInstance, iface: &str) -> Option<Ipv4Addr> {
    let st = vmi
        .status
        .as_ref()?
        .interfaces
        .as_ref()?
        .iter()
        .find(|i| i.name.as_deref() == Some(iface))?;
    st.ip_address
        .iter()
        .chain(st.ip_addresses.iter().flatten())
        .find_map(|a| a.parse::<Ipv4Addr>().ok())
}

fn is_final(vmi: &VirtualMachineInstance) -> bool {
    let phase = vmi
        .status
        .as_ref()
        .and_then(|s| s.phase.as_ref())
        .and_then(|p| serde_json::to_value(p).ok())
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default();
    phase == "Succeeded" || phase == "Failed"
}

/// The addresses of every other live VMI of the cluster (from their status): a new VMI never
/// gets one, wherever it runs now (a VMI migrated away keeps its home node's address).
pub fn reserved_addresses(vmis: &[VirtualMachineInstance], uid: &str) -> BTreeSet<Ipv4Addr> {
    vmis.iter()
        .filter(|v| v.metadata.uid.as_deref() != Some(uid) && !is_final(v))
        .filter_map(|v| v.status.as_ref()?.interfaces.as_ref())
        .flatten()
        .flat_map(|i| i.ip_address.iter().chain(i.ip_addresses.iter().flatten()))
        .filter_map(|a| a.parse::<Ipv4Addr>().ok())
        .collect()
}

/// The other Nodes' published addresses (name → addresses); unreadable values are named in
/// the notes and skipped.
pub fn claims(nodes: &[Node], me: &str) -> (BTreeMap<String, Vec<Ipv4Addr>>, Vec<String>) {
    let mut out = BTreeMap::new();
    let mut notes = Vec::new();
    for n in nodes {
        let name = n.metadata.name.clone().unwrap_or_default();
        if name == me {
            continue;
        }
        let Some(v) = n
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ROUTES_ANNOTATION))
        else {
            continue;
        };
        match parse_claims(v) {
            Ok(a) => {
                out.insert(name, a);
            }
            Err(e) => notes.push(format!("node {name}: {e}")),
        }
    }
    (out, notes)
}

/// The addresses of the VMIs this node runs (uid → address), as the runtime reports them.
#[derive(Debug, Default)]
pub struct Hosted {
    by_uid: std::sync::Mutex<HashMap<String, Ipv4Addr>>,
    changed: tokio::sync::Notify,
}

impl Hosted {
    /// Records that this node runs `uid` with `addr`; wakes the overlay loop on a change.
    pub fn insert(&self, uid: &str, addr: Ipv4Addr) {
        let prev = self
            .by_uid
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(uid.to_string(), addr);
        if prev != Some(addr) {
            self.changed.notify_one();
        }
    }

    /// Records that this node no longer runs `uid`.
    pub fn remove(&self, uid: &str) {
        let prev = self
            .by_uid
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(uid);
        if prev.is_some() {
            self.changed.notify_one();
        }
    }

    pub fn addresses(&self) -> BTreeSet<Ipv4Addr> {
        self.by_uid
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .copied()
            .collect()
    }

    /// Resolves at the next change.
    pub async fn changed(&self) {
        self.changed.notified().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vmi(uid: &str, phase: &str, ifaces: serde_json::Value) -> VirtualMachineInstance {
        serde_json::from_value(json!({
            "metadata": {"name": uid, "namespace": "default", "uid": uid},
            "status": {"phase": phase, "interfaces": ifaces}
        }))
        .unwrap()
    }

    #[test]
    fn an_incoming_vmi_keeps_the_address_in_its_status() {
        let v = vmi(
            "u1",
            "Running",
            json!([{"name": "other", "ipAddress": "10.1.0.1"},
                   {"name": "default", "ipAddresses": ["fd00::1", "10.244.1.7"]}]),
        );
        assert_eq!(
            status_address(&v, "default"),
            Some("10.244.1.7".parse().unwrap())
        );
        assert_eq!(status_address(&v, "missing"), None);
    }

    #[test]
    fn addresses_of_live_vmis_elsewhere_stay_reserved() {
        let vmis = [
            vmi(
                "me",
                "Scheduled",
                json!([{"name": "default", "ipAddress": "10.244.1.2"}]),
            ),
            vmi(
                "away",
                "Running",
                json!([{"name": "default", "ipAddress": "10.244.1.7"}]),
            ),
            vmi(
                "done",
                "Succeeded",
                json!([{"name": "default", "ipAddress": "10.244.1.8"}]),
            ),
        ];
        assert_eq!(
            reserved_addresses(&vmis, "me"),
            BTreeSet::from(["10.244.1.7".parse().unwrap()])
        );
    }

    #[test]
    fn claims_come_from_the_other_nodes_annotations() {
        let node = |name: &str, v: Option<&str>| -> Node {
            let mut n = json!({"metadata": {"name": name}});
            if let Some(v) = v {
                n["metadata"]["annotations"] = json!({ROUTES_ANNOTATION: v});
            }
            serde_json::from_value(n).unwrap()
        };
        let nodes = [
            node("a", Some(r#"["10.244.2.5"]"#)),
            node("b", Some(r#"["10.244.1.5"]"#)),
            node("c", Some("garbage")),
            node("d", None),
        ];
        let (c, notes) = claims(&nodes, "b");
        assert_eq!(
            c,
            BTreeMap::from([("a".to_string(), vec!["10.244.2.5".parse().unwrap()])])
        );
        assert_eq!(notes.len(), 1);
        assert!(
            notes[0].starts_with("node c: ")
                && notes[0].contains("ferrovirt.io/pod-routes \"garbage\""),
            "{notes:?}"
        );
    }

    #[test]
    fn hosted_addresses_wake_the_loop_only_on_change() {
        let h = Hosted::default();
        h.insert("u", "10.244.1.7".parse().unwrap());
        assert_eq!(h.addresses().len(), 1);
        h.remove("u");
        h.remove("u");
        assert!(h.addresses().is_empty());
    }
}
