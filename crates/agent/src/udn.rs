//! Primary user-defined networks (k8s.ovn.org) on the node: a VMI whose namespace is labelled
//! `k8s.ovn.org/primary-user-defined-network` gets its pod-network interface on the
//! namespace's Primary Layer2 (or Layer3: on its node's host subnet) UDN instead of the pod
//! network (docs/networking.md "User-defined networks"). [`decide`] is the pure decision (the namespace's label, its NADs, the VMI's
//! annotation → not a UDN VMI / wait / refuse / the network and address); [`resolve`] reads
//! the API and waits (bounded) while the controller has not yet annotated the NAD's VNI or the
//! VMI's address: an address is never guessed.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_api::udn::{NAD_LABEL, PRIMARY_NAMESPACE_LABEL};
use ferrovirt_network::udn::{
    self as net_udn, POD_NETWORKS_ANNOTATION, UdnAddress, UdnNetwork, VNI_ANNOTATION,
};

use crate::error::AgentError;

/// How long a start waits for the controller's annotations before it fails.
pub const ANNOTATION_WAIT: Duration = Duration::from_secs(90);
/// KubeVirt's network binding plugin name for a Primary UDN.
pub const L2BRIDGE_BINDING: &str = "l2bridge";

/// A NetworkAttachmentDefinition of the VMI's namespace, as [`decide`] needs it.
#[derive(Debug, Clone, Default)]
pub struct NadView {
    pub namespace: String,
    pub name: String,
    /// Labelled `k8s.ovn.org/user-defined-network`.
    pub udn: bool,
    pub config: String,
    /// The `ferrovirt.io/udn-vni` annotation.
    pub vni: Option<String>,
}

/// The VMI's interface on its Primary UDN.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrimaryUdn {
    /// `<nad namespace>/<nad name>`.
    pub nad: String,
    pub network: UdnNetwork,
    pub address: UdnAddress,
}

/// What to do with a VMI's pod-network interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Not in a Primary UDN namespace (or no pod network): the pod network as usual.
    NotUdn,
    /// The controller has not written what is needed yet; the message says what.
    Wait(String),
    Refuse(String, String),
    Ready(PrimaryUdn),
}

/// Where the VMI's pod network is declared (`spec.networks[j].pod`), if it has one.
fn pod_network_field(vmi: &VirtualMachineInstance) -> Option<String> {
    let spec = vmi.spec.as_ref()?;
    match spec.networks.as_deref() {
        // KubeVirt's default: one pod network.
        None => Some("spec.networks".to_string()),
        Some(nets) => nets
            .iter()
            .position(|n| n.pod.is_some())
            .map(|j| format!("spec.networks[{j}].pod")),
    }
}

/// The binding of the pod-network interface must put the guest on the network's L2 segment:
/// `bridge: {}` or `binding: {name: l2bridge}`; anything else is refused naming the field.
pub fn check_binding(vmi: &VirtualMachineInstance) -> Result<(), AgentError> {
    let Some(spec) = vmi.spec.as_ref() else {
        return Ok(());
    };
    let pod: Vec<&str> = spec
        .networks
        .iter()
        .flatten()
        .filter(|n| n.pod.is_some())
        .map(|n| n.name.as_str())
        .collect();
    for (i, iface) in spec.domain.devices.interfaces.iter().flatten().enumerate() {
        if !pod.contains(&iface.name.as_str()) {
            continue;
        }
        let field = format!("spec.domain.devices.interfaces[{i}]");
        let msg = "a Primary UserDefinedNetwork takes the bridge binding (bridge: {} or \
                   binding: {name: l2bridge})";
        if iface.bridge.is_some() {
            return Ok(());
        }
        if let Some(b) = &iface.binding {
            if b.name == L2BRIDGE_BINDING {
                return Ok(());
            }
            return Err(AgentError::unsupported(
                format!("{field}.binding.name"),
                format!("binding {:?}: {msg}", b.name),
            ));
        }
        let which = if iface.masquerade.is_some() {
            "masquerade"
        } else if iface.slirp.is_some() {
            "slirp"
        } else if iface.passt.is_some() {
            "passt"
        } else {
            "binding"
        };
        return Err(AgentError::unsupported(
            format!("{field}.{which}"),
            format!("{which} is not carried out on a Primary UserDefinedNetwork: {msg}"),
        ));
    }
    Ok(())
}

/// KubeVirt's `l2bridge` binding plugin belongs to Primary UDNs: on the plain pod network it
/// is refused naming the field (see [`decide`] for where it is honoured).
pub fn l2bridge_outside_udn(vmi: &VirtualMachineInstance) -> Option<AgentError> {
    let spec = vmi.spec.as_ref()?;
    let (i, _) = spec
        .domain
        .devices
        .interfaces
        .iter()
        .flatten()
        .enumerate()
        .find(|(_, iface)| {
            iface
                .binding
                .as_ref()
                .is_some_and(|b| b.name == L2BRIDGE_BINDING)
        })?;
    Some(AgentError::unsupported(
        format!("spec.domain.devices.interfaces[{i}].binding.name"),
        "binding \"l2bridge\" is for a Primary UserDefinedNetwork; this VMI's namespace has none \
         (use bridge or masquerade on the pod network)",
    ))
}

/// The VMI as the live-migratability verdict sees it when its pod interface is on a Primary
/// UDN: that interface counts as a masquerade one (the guest keeps its address and MAC on a
/// network that spans the nodes; the target joins it, and QEMU's announcement after the
/// switch-over moves the MAC in the bridges' and VXLAN devices' tables).
pub fn migratable_view(vmi: &VirtualMachineInstance) -> VirtualMachineInstance {
    let mut v = serde_json::to_value(vmi).unwrap_or_default();
    let pod: Vec<String> = v["spec"]["networks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| n.get("pod").is_some())
        .filter_map(|n| n["name"].as_str().map(String::from))
        .collect();
    if let Some(ifaces) = v["spec"]["domain"]["devices"]["interfaces"].as_array_mut() {
        for i in ifaces {
            if i["name"]
                .as_str()
                .is_some_and(|n| pod.iter().any(|p| p == n))
                && let Some(o) = i.as_object_mut()
            {
                o.remove("bridge");
                o.remove("binding");
                o.insert("masquerade".into(), serde_json::json!({}));
            }
        }
    }
    serde_json::from_value(v).unwrap_or_else(|_| vmi.clone())
}

/// A VMI on a Layer3 network (Primary or Secondary) never live-migrates: its address is from
/// its node's host subnet, which the target node does not route.
pub fn layer3_not_migratable(network: &str) -> ferrovirt_api::migration::NotMigratable {
    ferrovirt_api::migration::NotMigratable {
        reason: ferrovirt_api::migration::reason::INTERFACE_NOT_LIVE_MIGRATABLE,
        message: format!(
            "cannot migrate VMI: an interface is on the Layer3 user-defined network {network}, \
             whose addresses belong to the node (its host subnet)"
        ),
    }
}

/// The pure decision for one VMI: `ns_labels` are its namespace's labels, `nads` the
/// NetworkAttachmentDefinitions of its namespace, `node_netns`/`local` the node's namespace
/// and underlay address.
pub fn decide(
    vmi: &VirtualMachineInstance,
    ns_labels: &BTreeMap<String, String>,
    nads: &[NadView],
    node_netns: Option<&str>,
    local: Option<std::net::Ipv4Addr>,
    node_subnets: Option<&str>,
) -> Decision {
    if !ns_labels.contains_key(PRIMARY_NAMESPACE_LABEL) {
        return Decision::NotUdn;
    }
    let Some(field) = pod_network_field(vmi) else {
        return Decision::NotUdn;
    };
    let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
    let mut primaries = Vec::new();
    for n in nads.iter().filter(|n| n.udn) {
        let Ok(c) = net_udn::parse_nad_config(&n.config) else {
            continue;
        };
        if c.role == "primary" {
            primaries.push((n, c));
        }
    }
    let (nad, config) = match primaries.as_slice() {
        [] => {
            return Decision::Wait(format!(
                "namespace {ns} is labelled {PRIMARY_NAMESPACE_LABEL} but has no Primary \
                 UserDefinedNetwork's NetworkAttachmentDefinition yet"
            ));
        }
        [one] => one,
        many => {
            let names: Vec<String> = many.iter().map(|(n, _)| n.name.clone()).collect();
            return Decision::Refuse(
                field,
                format!("namespace {ns} has more than one Primary UserDefinedNetwork: {names:?}"),
            );
        }
    };
    let key = format!("{}/{}", nad.namespace, nad.name);
    let vni = match net_udn::parse_vni(nad.vni.as_deref()) {
        Ok(Some(v)) => v,
        Ok(None) => {
            return Decision::Wait(format!(
                "NetworkAttachmentDefinition {key} has no {VNI_ANNOTATION} annotation yet"
            ));
        }
        Err(e) => {
            return Decision::Refuse(field, format!("NetworkAttachmentDefinition {key}: {e}"));
        }
    };
    let built = if config.topology == "layer3" && config.role == "primary" {
        // Layer3: this node's host subnet of the network (the controller's Node annotation).
        match ferrovirt_network::udn_l3::host_subnet(node_subnets, &config.name) {
            Ok(Some(host)) => UdnNetwork::from_layer3_nad(config, vni, host, node_netns, local),
            Ok(None) => {
                return Decision::Wait(format!(
                    "this node has no host subnet of network {} in its {} annotation yet",
                    config.name,
                    ferrovirt_network::udn_l3::NODE_SUBNETS_ANNOTATION
                ));
            }
            Err(e) => Err(e),
        }
    } else {
        UdnNetwork::from_nad(config, vni, node_netns, local)
    };
    let network = match built {
        Ok(n) => n,
        Err(e) => {
            return Decision::Refuse(field, format!("NetworkAttachmentDefinition {key}: {e}"));
        }
    };
    if let Err(e) = check_binding(vmi) {
        let (f, m) = match e {
            AgentError::Unsupported { field, message } => (field, message),
            other => (field, other.to_string()),
        };
        return Decision::Refuse(f, m);
    }
    let ann = vmi
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(POD_NETWORKS_ANNOTATION))
        .map(String::as_str);
    match net_udn::parse_pod_networks(ann, &key, network.subnet) {
        Ok(Some(address)) => Decision::Ready(PrimaryUdn {
            nad: key,
            network,
            address,
        }),
        Ok(None) => Decision::Wait(format!(
            "no address on {key} in the VMI's {POD_NETWORKS_ANNOTATION} annotation yet"
        )),
        Err(e) => Decision::Refuse("metadata.annotations".into(), e.to_string()),
    }
}

fn nad_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("k8s.cni.cncf.io", "v1", "NetworkAttachmentDefinition"),
        "network-attachment-definitions",
    )
}

/// Whether the VMI's namespace asks for a Primary UDN on its pod network.
pub async fn wants_primary(
    client: &Client,
    vmi: &VirtualMachineInstance,
) -> Result<bool, AgentError> {
    Ok(namespace_labels(client, vmi)
        .await?
        .contains_key(PRIMARY_NAMESPACE_LABEL)
        && pod_network_field(vmi).is_some())
}

async fn namespace_labels(
    client: &Client,
    vmi: &VirtualMachineInstance,
) -> Result<BTreeMap<String, String>, AgentError> {
    let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
    match Api::<Namespace>::all(client.clone()).get_opt(ns).await {
        Ok(n) => Ok(n.and_then(|n| n.metadata.labels).unwrap_or_default()),
        Err(e) => Err(AgentError::Reference(format!("namespace {ns}: {e}"))),
    }
}

/// The refusal on a node without the pod network (QEMU user networking).
pub fn needs_pod_network(vmi: &VirtualMachineInstance) -> AgentError {
    let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
    AgentError::unsupported(
        pod_network_field(vmi).unwrap_or_else(|| "spec.networks".into()),
        format!(
            "namespace {ns} is labelled {PRIMARY_NAMESPACE_LABEL}: its pod network is a Primary \
             UserDefinedNetwork, which needs the node's pod network (this node runs \
             --network-mode user)"
        ),
    )
}

/// Reads the namespace, its NADs and the VMI (again, for the controller's annotation) and
/// [`decide`]s; waits up to [`ANNOTATION_WAIT`] while the decision is to wait, then fails
/// saying what was missing.
pub async fn resolve(
    client: &Client,
    vmi: &VirtualMachineInstance,
    node_netns: Option<&str>,
    local: Option<std::net::Ipv4Addr>,
) -> Result<Option<PrimaryUdn>, AgentError> {
    let labels = namespace_labels(client, vmi).await?;
    if !labels.contains_key(PRIMARY_NAMESPACE_LABEL) {
        return Ok(None);
    }
    let ns = vmi
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let name = vmi.metadata.name.clone().unwrap_or_default();
    let nad_api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &nad_resource());
    let vmi_api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &ns,
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstance"),
            "virtualmachineinstances",
        ),
    );
    let node_api: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let started = std::time::Instant::now();
    let mut current = vmi.clone();
    loop {
        let node_name = current
            .status
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        let node_subnets = match node_name.is_empty() {
            true => None,
            false => node_api
                .get_opt(&node_name)
                .await
                .ok()
                .flatten()
                .and_then(|n| n.metadata.annotations)
                .and_then(|a| {
                    a.get(ferrovirt_network::udn_l3::NODE_SUBNETS_ANNOTATION)
                        .cloned()
                }),
        };
        let list = nad_api
            .list(&ListParams::default())
            .await
            .map_err(|e| AgentError::Reference(format!("API: {e}")))?;
        let nads: Vec<NadView> = list
            .items
            .iter()
            .map(|n| NadView {
                namespace: ns.clone(),
                name: n.metadata.name.clone().unwrap_or_default(),
                udn: n
                    .metadata
                    .labels
                    .as_ref()
                    .is_some_and(|l| l.contains_key(NAD_LABEL)),
                config: n.data["spec"]["config"].as_str().unwrap_or("").to_string(),
                vni: n
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(VNI_ANNOTATION).cloned()),
            })
            .collect();
        match decide(
            &current,
            &labels,
            &nads,
            node_netns,
            local,
            node_subnets.as_deref(),
        ) {
            Decision::NotUdn => return Ok(None),
            Decision::Ready(p) => return Ok(Some(p)),
            Decision::Refuse(field, message) => {
                return Err(AgentError::unsupported(field, message));
            }
            Decision::Wait(why) => {
                if started.elapsed() > ANNOTATION_WAIT {
                    return Err(AgentError::Reference(format!(
                        "Primary UserDefinedNetwork: {why} after {}s",
                        ANNOTATION_WAIT.as_secs()
                    )));
                }
                tracing::debug!(vmi = %format!("{ns}/{name}"), "waiting: {why}");
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let fresh = vmi_api.get_opt(&name).await;
        if let Ok(None) = fresh {
            return Err(AgentError::Reference(format!(
                "VMI {ns}/{name} was deleted while waiting for its Primary UserDefinedNetwork address"
            )));
        }
        if let Ok(Some(v)) = fresh {
            if v.metadata.uid != vmi.metadata.uid {
                return Err(AgentError::Reference(format!(
                    "VMI {ns}/{name} was replaced while waiting for its Primary UserDefinedNetwork address"
                )));
            }
            // Only the annotations are read again (the rest is the VMI being started).
            current.metadata.annotations = v.metadata.annotations;
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const CONFIG: &str = r#"{"cniVersion":"1.0.0","type":"ovn-k8s-cni-overlay","name":"ua_net",
        "netAttachDefName":"ua/net","topology":"layer2","role":"primary","subnets":"10.100.0.0/24","mtu":1400}"#;

    fn vmi(iface: serde_json::Value, annotated: bool) -> VirtualMachineInstance {
        let mut v = json!({"metadata": {"name": "a1", "namespace": "ua", "uid": "u1"},
            "spec": {"domain": {"devices": {"interfaces": [iface]}},
                     "networks": [{"name": "default", "pod": {}}]}});
        if annotated {
            v["metadata"]["annotations"] = json!({POD_NETWORKS_ANNOTATION:
                r#"{"ua/net":{"ip_addresses":["10.100.0.7/24"],"gateway_ips":["10.100.0.1"],"role":"primary"}}"#});
        }
        serde_json::from_value(v).unwrap()
    }

    fn nad(vni: Option<&str>) -> NadView {
        NadView {
            namespace: "ua".into(),
            name: "net".into(),
            udn: true,
            config: CONFIG.into(),
            vni: vni.map(String::from),
        }
    }

    fn labelled() -> BTreeMap<String, String> {
        BTreeMap::from([(PRIMARY_NAMESPACE_LABEL.to_string(), String::new())])
    }

    #[test]
    fn a_bridge_vmi_with_its_address_is_ready() {
        let v = vmi(json!({"name": "default", "bridge": {}}), true);
        let d = decide(
            &v,
            &labelled(),
            &[nad(Some("10001"))],
            Some("na"),
            None,
            None,
        );
        let Decision::Ready(p) = d else {
            panic!("{d:?}")
        };
        assert_eq!(p.nad, "ua/net");
        assert_eq!(p.network.vni, 10001);
        assert_eq!(p.address.address.to_string(), "10.100.0.7");
        // KubeVirt's l2bridge binding plugin too.
        let v = vmi(
            json!({"name": "default", "binding": {"name": "l2bridge"}}),
            true,
        );
        assert!(matches!(
            decide(&v, &labelled(), &[nad(Some("10001"))], None, None, None),
            Decision::Ready(_)
        ));
        // Not labelled: the pod network.
        assert_eq!(
            decide(
                &v,
                &BTreeMap::new(),
                &[nad(Some("10001"))],
                None,
                None,
                None
            ),
            Decision::NotUdn
        );
    }

    #[test]
    fn a_primary_udn_interface_is_judged_migratable() {
        let v = vmi(json!({"name": "default", "bridge": {}}), true);
        let no = |_: &str| None;
        let ok = |_: &str| Ok(());
        let e = ferrovirt_api::migration::live_migratable(&v, no, ok).unwrap_err();
        assert_eq!(e.reason, "InterfaceNotLiveMigratable");
        let view = migratable_view(&v);
        assert!(ferrovirt_api::migration::live_migratable(&view, no, ok).is_ok());
        // Only the view changes; the VMI keeps its binding.
        let iface = &view
            .spec
            .as_ref()
            .unwrap()
            .domain
            .devices
            .interfaces
            .as_ref()
            .unwrap()[0];
        assert!(iface.masquerade.is_some() && iface.bridge.is_none());
    }

    #[test]
    fn missing_annotations_wait_and_never_guess() {
        let v = vmi(json!({"name": "default", "bridge": {}}), false);
        let d = decide(&v, &labelled(), &[nad(Some("10001"))], None, None, None);
        assert!(
            matches!(&d, Decision::Wait(m) if m.contains(POD_NETWORKS_ANNOTATION)),
            "{d:?}"
        );
        let v = vmi(json!({"name": "default", "bridge": {}}), true);
        let d = decide(&v, &labelled(), &[nad(None)], None, None, None);
        assert!(
            matches!(&d, Decision::Wait(m) if m.contains(VNI_ANNOTATION)),
            "{d:?}"
        );
        let d = decide(&v, &labelled(), &[], None, None, None);
        assert!(
            matches!(&d, Decision::Wait(m) if m.contains("no Primary")),
            "{d:?}"
        );
        // A NAD without the UDN label is not the network.
        let mut foreign = nad(Some("10001"));
        foreign.udn = false;
        assert!(matches!(
            decide(&v, &labelled(), &[foreign], None, None, None),
            Decision::Wait(_)
        ));
    }

    #[test]
    fn masquerade_and_other_bindings_are_refused_naming_the_field_layer3_waits() {
        let v = vmi(json!({"name": "default", "masquerade": {}}), true);
        let d = decide(&v, &labelled(), &[nad(Some("10001"))], None, None, None);
        assert!(
            matches!(&d, Decision::Refuse(f, m) if f == "spec.domain.devices.interfaces[0].masquerade" && m.contains("Primary")),
            "{d:?}"
        );
        let v = vmi(
            json!({"name": "default", "binding": {"name": "passt"}}),
            true,
        );
        let d = decide(&v, &labelled(), &[nad(Some("10001"))], None, None, None);
        assert!(
            matches!(&d, Decision::Refuse(f, _) if f == "spec.domain.devices.interfaces[0].binding.name"),
            "{d:?}"
        );
        let mut l3 = nad(Some("10001"));
        l3.config = CONFIG.replace("layer2", "layer3");
        let v = vmi(json!({"name": "default", "bridge": {}}), true);
        // Layer3: waits for the node's host subnet, then the network is the host subnet with
        // its gateway as router.
        let d = decide(&v, &labelled(), std::slice::from_ref(&l3), None, None, None);
        assert!(
            matches!(&d, Decision::Wait(m) if m.contains("k8s.ovn.org/node-subnets")),
            "{d:?}"
        );
        let ann = r#"{"ua_net":["10.100.0.0/24"]}"#;
        let d = decide(&v, &labelled(), &[l3], None, None, Some(ann));
        let Decision::Ready(p) = d else {
            panic!("{d:?}")
        };
        assert!(p.network.layer3);
        assert_eq!(p.network.subnet.to_string(), "10.100.0.0/24");
        let e = needs_pod_network(&v).to_string();
        assert!(
            e.contains("spec.networks[0].pod") && e.contains("Primary UserDefinedNetwork"),
            "{e}"
        );
    }
}
