//! Secondary (Multus) interfaces of a VMI on the agent's side: which interfaces name a
//! NetworkAttachmentDefinition, the host bridge a NAD's configuration resolves to on this node
//! (a bridge CNI config as it is, a Localnet through the node's NNCP bridge mappings), the
//! address the controller allotted on a Localnet or Secondary Layer2 UDN with IPAM, the VNI of
//! a Secondary Layer2 UDN, and the plans kept in the VMI directory (docs/networking.md
//! "Secondary networks", "Localnet data plane", "User-defined networks").

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::Duration;

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_network::SecondaryPlan;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};

use super::ns_name;
use crate::error::AgentError;
use crate::mapping;

/// File in the VMI directory with the secondary interfaces' plans.
const SECONDARY_PLANS: &str = "secondary-networks.json";

/// A VMI interface on a Multus network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecondaryInterface {
    pub name: String,
    /// `spec.networks[i]` of the interface's network (for error messages).
    pub network_field: String,
    /// The NetworkAttachmentDefinition: namespace and name.
    pub nad_namespace: String,
    pub nad_name: String,
    pub mac: ferrovirt_network::MacAddr,
}

/// The VMI's interfaces on Multus networks, in interface order. Only the bridge binding is
/// supported on them; any other binding is refused naming the interface.
pub fn secondary_interfaces(
    vmi: &VirtualMachineInstance,
) -> Result<Vec<SecondaryInterface>, AgentError> {
    let Some(spec) = vmi.spec.as_ref() else {
        return Ok(Vec::new());
    };
    let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
    let networks = spec.networks.as_deref().unwrap_or(&[]);
    let mut out = Vec::new();
    for (i, iface) in spec.domain.devices.interfaces.iter().flatten().enumerate() {
        let Some((j, net)) = networks
            .iter()
            .enumerate()
            .find(|(_, n)| n.name == iface.name)
        else {
            continue;
        };
        let Some(multus) = net.multus.as_ref() else {
            continue;
        };
        let field = format!("spec.domain.devices.interfaces[{i}]");
        if iface.bridge.is_none() {
            return Err(AgentError::unsupported(
                field,
                "interfaces on multus networks support only the bridge binding",
            ));
        }
        let (nad_namespace, nad_name) = match multus.network_name.split_once('/') {
            Some((n, name)) => (n.to_string(), name.to_string()),
            None => (ns.to_string(), multus.network_name.clone()),
        };
        let mac = mapping::nic_mac(i, iface, vmi)?;
        let mac = mac.parse().map_err(|_| {
            AgentError::invalid(
                format!("{field}.macAddress"),
                format!("{mac:?} is not a MAC"),
            )
        })?;
        out.push(SecondaryInterface {
            name: iface.name.clone(),
            network_field: format!("spec.networks[{j}].multus.networkName"),
            nad_namespace,
            nad_name,
            mac,
        });
    }
    Ok(out)
}

pub(super) fn nad_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("k8s.cni.cncf.io", "v1", "NetworkAttachmentDefinition"),
        "network-attachment-definitions",
    )
}

pub(crate) fn read_secondary_plans(dir: &Path) -> Vec<SecondaryPlan> {
    std::fs::read_to_string(dir.join(SECONDARY_PLANS))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default()
}

pub(super) fn write_secondary_plans(dir: &Path, plans: &[SecondaryPlan]) -> Result<(), AgentError> {
    let path = dir.join(SECONDARY_PLANS);
    let tmp = dir.join(format!("{SECONDARY_PLANS}.tmp"));
    let text = serde_json::to_vec_pretty(plans)
        .map_err(|e| AgentError::Reference(format!("encoding network plans: {e}")))?;
    std::fs::write(&tmp, text).map_err(|e| AgentError::io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| AgentError::io(&path, e))
}

/// Where a NAD's interface attaches on this node.
pub(super) enum NadAttach {
    /// A host bridge (and VLAN, MTU); `true`: the network has IPAM (the controller allots).
    Bridge(ferrovirt_network::BridgeConfig, bool),
    /// A Secondary Layer2 or Layer3 user-defined network: its bridge in its per-network
    /// namespace.
    Udn(ferrovirt_network::udn::NadConfig),
}

/// Where a NAD's configuration attaches on this node: a bridge CNI configuration as it is, a
/// Localnet through the node's bridge mappings (`DATA_DIR/nmstate-bridge-mappings.json`,
/// written by the nmstate loop; IPAM when it has `subnets`), a Secondary Layer2 or Layer3 UDN
/// to its network.
pub(super) fn nad_attach(
    data_dir: &Path,
    vmi: &VirtualMachineInstance,
    config: &str,
) -> Result<NadAttach, ferrovirt_network::Error> {
    use ferrovirt_network::localnet::{NadNetwork, parse_nad_config, resolve};
    match parse_nad_config(config)? {
        NadNetwork::Bridge(b) => Ok(NadAttach::Bridge(b, false)),
        NadNetwork::Localnet(l) => {
            let node = vmi
                .status
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default();
            let mappings = crate::nmstate::read_bridge_mappings(data_dir);
            Ok(NadAttach::Bridge(
                resolve(&l, &mappings, &node)?,
                !l.subnets.is_empty(),
            ))
        }
        NadNetwork::Udn(c) => Ok(NadAttach::Udn(c)),
    }
}

/// The VNI the controller gave a Secondary Layer2 UDN's NAD (`ferrovirt.io/udn-vni`), read
/// again until it is there (bounded by [`crate::udn::ANNOTATION_WAIT`]; never guessed).
pub(super) async fn wait_vni(
    api: &Api<DynamicObject>,
    name: &str,
    first: &DynamicObject,
) -> Result<u32, ferrovirt_network::Error> {
    use ferrovirt_network::udn::{VNI_ANNOTATION, parse_vni};
    let started = std::time::Instant::now();
    let mut current = first.metadata.annotations.clone();
    loop {
        let ann = current
            .as_ref()
            .and_then(|a| a.get(VNI_ANNOTATION))
            .map(String::as_str);
        if let Some(v) = parse_vni(ann)? {
            return Ok(v);
        }
        if started.elapsed() > crate::udn::ANNOTATION_WAIT {
            return Err(ferrovirt_network::Error::InvalidNetworkConfig(format!(
                "metadata.annotations[{VNI_ANNOTATION}]: no VNI given to the network after {}s",
                crate::udn::ANNOTATION_WAIT.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        match api.get_opt(name).await {
            Ok(Some(n)) => current = n.metadata.annotations,
            Ok(None) => {}
            Err(e) => tracing::debug!("reading NAD {name}: {e}"),
        }
    }
}

/// How long a VMI on a Localnet (or Secondary Layer2 UDN) with IPAM waits for the controller to allot its address.
const ALLOT_WAIT: Duration = Duration::from_secs(60);

/// The address the controller allotted to the VMI on NAD `nad` (`ns/name`), from its
/// `k8s.ovn.org/pod-networks` annotation, read again until it is there (never guessed).
pub(super) async fn wait_allotted(
    client: &Client,
    vmi: &VirtualMachineInstance,
    nad: &str,
) -> Result<(Ipv4Addr, ferrovirt_network::Ipv4Cidr), ferrovirt_network::Error> {
    use ferrovirt_network::localnet::{POD_NETWORKS_ANNOTATION, allotted_address};
    let (ns, name) = ns_name(vmi);
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &crate::runtime::vmi_resource());
    let started = std::time::Instant::now();
    let mut current = vmi.metadata.annotations.clone();
    loop {
        let ann = current
            .as_ref()
            .and_then(|a| a.get(POD_NETWORKS_ANNOTATION))
            .map(String::as_str);
        if let Some(found) = allotted_address(ann, nad)? {
            return Ok(found);
        }
        if started.elapsed() > ALLOT_WAIT {
            return Err(ferrovirt_network::Error::InvalidNetworkConfig(format!(
                "spec.config.subnets: no address allotted to VMI {ns}/{name} on this network after {}s (annotation {POD_NETWORKS_ANNOTATION} has no entry {nad:?})",
                ALLOT_WAIT.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        match api.get_opt(&name).await {
            Ok(Some(v)) => current = v.metadata.annotations,
            Ok(None) => {}
            Err(e) => tracing::debug!("reading VMI {ns}/{name}: {e}"),
        }
    }
}

pub(super) fn secondary_field(secondaries: &[SecondaryInterface], p: &SecondaryPlan) -> String {
    secondaries
        .iter()
        .find(|s| s.name == p.interface)
        .map(|s| s.network_field.clone())
        .unwrap_or_else(|| p.interface.clone())
}
