//! Where a volume's bytes are, and who moves them: [`placement`] (pure) tells a node-local
//! volume our `local` provisioner made — created, populated, grown and deleted by its node's
//! agent through [`NodeStorage`] — from a volume at a path the server's machine holds
//! (`shared` class, hand-made PVs), which the controllers still handle themselves. The
//! controllers never write a node's storage: they decide, the agent does (DESIGN.md §5).

use std::path::PathBuf;

use k8s_openapi::api::core::v1::PersistentVolume;

use ferrovirt_agent::nodestore::client::NodeStorage;

use super::classes::PROVISIONER_LOCAL;
use super::pvc::{HOSTNAME_LABEL, PROVISIONED_BY};
use crate::runtime::stores::Stores;

/// Where a volume lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// A `local`-class volume of ours: volume `volume` (its PV name) on node `node`.
    Node { node: String, volume: String },
    /// A directory the server's machine can reach (`hostPath`, or `local` of a hand-made PV).
    Path(PathBuf),
    /// No path at all.
    Unknown,
}

/// The node named by a PV's required node affinity (`kubernetes.io/hostname In [node]`).
pub fn affinity_node(pv: &PersistentVolume) -> Option<String> {
    pv.spec
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required
        .as_ref()?
        .node_selector_terms
        .iter()
        .flat_map(|t| t.match_expressions.iter().flatten())
        .find(|e| e.key == HOSTNAME_LABEL && e.operator == "In")
        .and_then(|e| e.values.as_ref()?.first().cloned())
}

/// Where `pv`'s data lives.
pub fn placement(pv: &PersistentVolume) -> Placement {
    let spec = pv.spec.clone().unwrap_or_default();
    let ours_local = pv
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(PROVISIONED_BY))
        .is_some_and(|p| p == PROVISIONER_LOCAL);
    if ours_local
        && spec.local.is_some()
        && let (Some(node), Some(volume)) = (affinity_node(pv), pv.metadata.name.clone())
    {
        return Placement::Node { node, volume };
    }
    match spec
        .host_path
        .map(|h| h.path)
        .or_else(|| spec.local.map(|l| l.path))
    {
        Some(p) => Placement::Path(p.into()),
        None => Placement::Unknown,
    }
}

/// The storage of `node` through its agent (the Node from the cache), or why not.
pub fn storage_of(stores: &Stores, node: &str, token: Option<&str>) -> Result<NodeStorage, String> {
    let Some(token) = token else {
        return Err("the controllers have no agent token to reach node storage".into());
    };
    let Some(n) = stores
        .node_list()
        .into_iter()
        .find(|n| n.metadata.name.as_deref() == Some(node))
    else {
        return Err(format!("node {node} does not exist"));
    };
    NodeStorage::of(&n, token).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pv(v: serde_json::Value) -> PersistentVolume {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn local_volumes_of_ours_live_on_their_node() {
        let affinity = json!({"required": {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node2"]}]}]}});
        let ours = pv(json!({
            "metadata": {"name": "pvc-1", "annotations": {PROVISIONED_BY: PROVISIONER_LOCAL}},
            "spec": {"local": {"path": "/n/volumes/pvc-1"}, "nodeAffinity": affinity},
        }));
        assert_eq!(
            placement(&ours),
            Placement::Node {
                node: "node2".into(),
                volume: "pvc-1".into()
            }
        );
        // Hand-made local PV: not ours to manage on the node.
        let hand = pv(json!({
            "metadata": {"name": "mine"},
            "spec": {"local": {"path": "/mnt/disk"}, "nodeAffinity": affinity},
        }));
        assert_eq!(placement(&hand), Placement::Path("/mnt/disk".into()));
        let shared = pv(json!({
            "metadata": {"name": "pvc-2", "annotations": {PROVISIONED_BY: "ferrovirt.io/shared"}},
            "spec": {"hostPath": {"path": "/d/volumes/pvc-2"}},
        }));
        assert_eq!(
            placement(&shared),
            Placement::Path("/d/volumes/pvc-2".into())
        );
        assert_eq!(placement(&pv(json!({"spec": {}}))), Placement::Unknown);
        // Ours but without a node: handled by path, never guessed.
        let no_node = pv(json!({
            "metadata": {"name": "pvc-3", "annotations": {PROVISIONED_BY: PROVISIONER_LOCAL}},
            "spec": {"local": {"path": "/x/pvc-3"}},
        }));
        assert_eq!(placement(&no_node), Placement::Path("/x/pvc-3".into()));
    }
}
