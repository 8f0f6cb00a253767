//! Localnet networks (pure): the NetworkAttachmentDefinitions OVN-Kubernetes' user-defined
//! networks make (`"type": "ovn-k8s-cni-overlay"`) when a VMI names one as a Multus network.
//!
//! A Localnet (`"topology": "localnet"`, a ClusterUserDefinedNetwork's) is attached exactly
//! as a secondary `bridge` network ([`crate::secondary`]): its `physicalNetworkName` is
//! resolved through the node's OVN bridge mappings (`localnet` → `bridge`, applied by
//! NodeNetworkConfigurationPolicies) to a host bridge, `vlanID` becomes the access VLAN and
//! `mtu` the interface MTU ([`resolve`] gives the [`BridgeConfig`]). A Secondary Layer2 or
//! Layer3 network is handed on as its [`crate::udn::NadConfig`]: the agent joins the
//! interface to the network's bridge in its per-network namespace ([`crate::udn`],
//! [`crate::udn_l3`]).

use std::collections::BTreeMap;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::secondary::{BridgeConfig, parse_cni_config};

/// The CNI type of OVN-Kubernetes' NADs.
pub const OVN_CNI_TYPE: &str = "ovn-k8s-cni-overlay";

/// OVN-Kubernetes' default MTU of a localnet network.
pub const LOCALNET_DEFAULT_MTU: u16 = 1500;

/// What a NetworkAttachmentDefinition named as a Multus network is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NadNetwork {
    /// A bridge CNI configuration.
    Bridge(BridgeConfig),
    /// An OVN-Kubernetes localnet network.
    Localnet(LocalnetConfig),
    /// An OVN-Kubernetes Secondary Layer2 or Layer3 network (a user-defined network's).
    Udn(crate::udn::NadConfig),
}

/// An OVN-Kubernetes localnet network's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalnetConfig {
    /// The network's name (`name`).
    pub network: String,
    /// The bridge mapping's `localnet` name (OVN-K: the network name when absent).
    pub physical_network_name: String,
    /// `vlanID`: the access VLAN.
    pub vlan: Option<u16>,
    pub mtu: Option<u16>,
    /// `subnets` (comma list): the network has IPAM.
    pub subnets: Vec<String>,
}

fn bad(reason: impl Into<String>) -> Error {
    Error::InvalidNetworkConfig(reason.into())
}

/// Parses a NAD's `spec.config`: an OVN-Kubernetes localnet, or a bridge CNI configuration
/// ([`parse_cni_config`], whose errors are kept).
pub fn parse_nad_config(text: &str) -> Result<NadNetwork> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| bad(format!("spec.config is not JSON: {e}")))?;
    if v.get("type").and_then(Value::as_str) != Some(OVN_CNI_TYPE) {
        return parse_cni_config(text).map(NadNetwork::Bridge);
    }
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("");
    match s("topology") {
        "localnet" => {}
        "layer2" | "layer3" => {
            if s("role") == "primary" {
                return Err(bad(
                    "spec.config.role \"primary\": a Primary UserDefinedNetwork is the VMI's pod network, not a Multus network (use pod: {})",
                ));
            }
            return crate::udn::parse_nad_config(text).map(NadNetwork::Udn);
        }
        other => {
            return Err(bad(format!(
                "spec.config.topology {other:?} is not supported (localnet, layer2, layer3)"
            )));
        }
    }
    let network = s("name").to_string();
    let physical_network_name = match v.get("physicalNetworkName") {
        None | Some(Value::Null) => network.clone(),
        Some(Value::String(p)) if !p.is_empty() => p.clone(),
        Some(_) => {
            return Err(bad(
                "spec.config.physicalNetworkName must be a non-empty string",
            ));
        }
    };
    if physical_network_name.is_empty() {
        return Err(bad(
            "spec.config.physicalNetworkName is missing (and the network has no name)",
        ));
    }
    let vlan = match v.get("vlanID") {
        None | Some(Value::Null) => None,
        Some(x) => match x.as_u64() {
            Some(n @ 1..=4094) => Some(n as u16),
            _ => {
                return Err(bad(format!(
                    "spec.config.vlanID {x} is not a VLAN id (1-4094)"
                )));
            }
        },
    };
    let mtu = match v.get("mtu") {
        None | Some(Value::Null) => None,
        Some(x) => match x.as_u64() {
            Some(n @ 576..=65535) => Some(n as u16),
            _ => return Err(bad(format!("spec.config.mtu {x} is not a usable MTU"))),
        },
    };
    let subnets = match v.get("subnets") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => s
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect(),
        Some(_) => return Err(bad("spec.config.subnets must be a comma-separated string")),
    };
    Ok(NadNetwork::Localnet(LocalnetConfig {
        network,
        physical_network_name,
        vlan,
        mtu,
        subnets,
    }))
}

/// The host bridge a localnet network attaches to on `node`, through the node's bridge
/// `mappings` (`localnet` → `bridge`). No mapping for the name: an error naming it and the
/// node.
pub fn resolve(
    cfg: &LocalnetConfig,
    mappings: &BTreeMap<String, String>,
    node: &str,
) -> Result<BridgeConfig> {
    let bridge = mappings.get(&cfg.physical_network_name).ok_or_else(|| {
        bad(format!(
            "physicalNetworkName {:?} has no bridge mapping on node {node}",
            cfg.physical_network_name
        ))
    })?;
    crate::plan::check_ifname(bridge).map_err(|e| {
        bad(format!(
            "bridge mapping {:?}: {e}",
            cfg.physical_network_name
        ))
    })?;
    Ok(BridgeConfig {
        bridge: bridge.clone(),
        vlan: cfg.vlan,
        mtu: Some(cfg.mtu.unwrap_or(LOCALNET_DEFAULT_MTU)),
    })
}

/// The VMI annotation in which OVN-Kubernetes' (here the controller's) IPAM records each
/// network's addresses, keyed `"<nad namespace>/<nad name>"`.
pub const POD_NETWORKS_ANNOTATION: &str = "k8s.ovn.org/pod-networks";

/// The IPv4 address (and its subnet) allotted to the VMI on NAD `nad` (`ns/name`), from the
/// value of its [`POD_NETWORKS_ANNOTATION`] (`{"ns/name": {"ip_addresses": ["10.0.0.5/24"],
/// "role": "secondary"}}`). `None`: not allotted yet (wait; never guess). A value that cannot
/// be read is an error naming the annotation.
pub fn allotted_address(
    annotation: Option<&str>,
    nad: &str,
) -> Result<Option<(std::net::Ipv4Addr, crate::Ipv4Cidr)>> {
    let Some(text) = annotation else {
        return Ok(None);
    };
    let v: Value = serde_json::from_str(text).map_err(|e| {
        bad(format!(
            "annotation {POD_NETWORKS_ANNOTATION} is not JSON: {e}"
        ))
    })?;
    let Some(entry) = v.get(nad) else {
        return Ok(None);
    };
    let addrs = entry
        .get("ip_addresses")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            bad(format!(
                "annotation {POD_NETWORKS_ANNOTATION}[{nad:?}].ip_addresses is missing"
            ))
        })?;
    for a in addrs.iter().filter_map(Value::as_str) {
        if let Ok(net) = a.parse::<ipnet::Ipv4Net>() {
            let t = net.trunc();
            let subnet = crate::Ipv4Cidr::new(t.network(), t.prefix_len())?;
            return Ok(Some((net.addr(), subnet)));
        }
    }
    Err(bad(format!(
        "annotation {POD_NETWORKS_ANNOTATION}[{nad:?}].ip_addresses has no IPv4 address/prefix ({addrs:?}); only IPv4 is served by DHCP"
    )))
}

/// The DHCP lease offering the allotted address on a Localnet interface: no router, no DNS
/// (the physical network's business), the interface's MTU, served from the link-local
/// address the bridge binding uses ([`crate::plan::BRIDGE_DHCP_ADDR`]).
pub fn lease(
    address: std::net::Ipv4Addr,
    subnet: crate::Ipv4Cidr,
    mac: crate::MacAddr,
    mtu: u16,
    hostname: &str,
) -> crate::dhcp::LeaseConfig {
    crate::dhcp::LeaseConfig {
        client_mac: mac,
        address,
        subnet,
        router: None,
        dns: Vec::new(),
        search: Vec::new(),
        server_id: crate::plan::BRIDGE_DHCP_ADDR,
        lease_secs: crate::plan::DEFAULT_LEASE_SECS,
        hostname: (!hostname.is_empty()).then(|| hostname.to_string()),
        mtu: Some(mtu),
        routes: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_allotted_address() {
        let ann = r#"{"ln/phys":{"ip_addresses":["10.77.0.5/24"],"role":"secondary"},"ln/other":{"ip_addresses":["fd00::5/64","10.8.0.9/16"]}}"#;
        let (a, s) = allotted_address(Some(ann), "ln/phys").unwrap().unwrap();
        assert_eq!(
            (a.to_string(), s.to_string()),
            ("10.77.0.5".into(), "10.77.0.0/24".into())
        );
        let (a, s) = allotted_address(Some(ann), "ln/other").unwrap().unwrap();
        assert_eq!(
            (a.to_string(), s.to_string()),
            ("10.8.0.9".into(), "10.8.0.0/16".into())
        );
        // Not yet: no annotation, or not for this network.
        assert_eq!(allotted_address(None, "ln/phys").unwrap(), None);
        assert_eq!(allotted_address(Some(ann), "ln/third").unwrap(), None);
        for (bad, needle) in [
            ("nope", "is not JSON"),
            (r#"{"ln/phys":{}}"#, "ip_addresses is missing"),
            (r#"{"ln/phys":{"ip_addresses":["fd00::1/64"]}}"#, "no IPv4"),
        ] {
            let e = allotted_address(Some(bad), "ln/phys")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(needle) && e.contains(POD_NETWORKS_ANNOTATION),
                "{e}"
            );
        }
        let l = lease(a, s, "02:00:00:00:00:09".parse().unwrap(), 1400, "vm");
        assert_eq!(l.router, None);
        assert_eq!(l.server_id, crate::plan::BRIDGE_DHCP_ADDR);
        assert_eq!((l.mtu, l.hostname.as_deref()), (Some(1400), Some("vm")));
    }

    fn cfg(extra: &str) -> String {
        format!(
            r#"{{"cniVersion":"1.0.0","type":"ovn-k8s-cni-overlay","name":"cluster_udn_phys","netAttachDefName":"ln/phys","topology":"localnet","role":"secondary"{extra}}}"#
        )
    }

    fn localnet(text: &str) -> LocalnetConfig {
        match parse_nad_config(text).unwrap() {
            NadNetwork::Localnet(l) => l,
            other => panic!("not a localnet: {other:?}"),
        }
    }

    #[test]
    fn parses_localnet_configs() {
        let l = localnet(&cfg(
            r#","physicalNetworkName":"physnet","vlanID":200,"mtu":1400,"subnets":"10.1.0.0/24, 10.2.0.0/24""#,
        ));
        assert_eq!(
            l,
            LocalnetConfig {
                network: "cluster_udn_phys".into(),
                physical_network_name: "physnet".into(),
                vlan: Some(200),
                mtu: Some(1400),
                subnets: vec!["10.1.0.0/24".into(), "10.2.0.0/24".into()],
            }
        );
        // OVN-K: without physicalNetworkName the network's name is the localnet name.
        let l = localnet(&cfg(""));
        assert_eq!(l.physical_network_name, "cluster_udn_phys");
        assert_eq!((l.vlan, l.mtu, l.subnets.len()), (None, None, 0));
        // A Secondary Layer2 or Layer3 network is handed on as a UDN config.
        for topology in ["layer2", "layer3"] {
            match parse_nad_config(
                &cfg(r#","subnets":"10.9.0.0/24""#).replace("localnet", topology),
            )
            .unwrap()
            {
                NadNetwork::Udn(c) => {
                    assert_eq!(
                        (c.name.as_str(), c.role.as_str(), c.topology.as_str()),
                        ("cluster_udn_phys", "secondary", topology)
                    );
                    assert_eq!(c.subnets, vec!["10.9.0.0/24".to_string()]);
                }
                other => panic!("not a UDN network: {other:?}"),
            }
        }
        // A bridge configuration still parses as one.
        assert!(matches!(
            parse_nad_config(r#"{"type":"bridge","bridge":"br1"}"#).unwrap(),
            NadNetwork::Bridge(b) if b.bridge == "br1"
        ));
    }

    #[test]
    fn refuses_naming_the_field() {
        for (text, needle) in [
            (cfg(r#","vlanID":5000"#), "spec.config.vlanID 5000"),
            (cfg(r#","vlanID":0"#), "spec.config.vlanID 0"),
            (cfg(r#","mtu":100"#), "spec.config.mtu 100"),
            (cfg(r#","physicalNetworkName":7"#), "physicalNetworkName"),
            (cfg(r#","subnets":["a"]"#), "spec.config.subnets"),
            (
                cfg("")
                    .replace("localnet", "layer2")
                    .replace("\"secondary\"", "\"primary\""),
                "spec.config.role \"primary\"",
            ),
            (
                cfg("").replace("localnet", "mesh"),
                "spec.config.topology \"mesh\"",
            ),
            (
                r#"{"type":"macvlan"}"#.to_string(),
                "spec.config.type \"macvlan\"",
            ),
        ] {
            let e = parse_nad_config(&text).unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn resolves_through_the_bridge_mappings() {
        let maps: BTreeMap<String, String> = [("physnet".to_string(), "br-ext".to_string())]
            .into_iter()
            .collect();
        let l = localnet(&cfg(r#","physicalNetworkName":"physnet","vlanID":10"#));
        assert_eq!(
            resolve(&l, &maps, "n1").unwrap(),
            BridgeConfig {
                bridge: "br-ext".into(),
                vlan: Some(10),
                mtu: Some(LOCALNET_DEFAULT_MTU)
            }
        );
        let l = localnet(&cfg(r#","physicalNetworkName":"other","mtu":9000"#));
        let e = resolve(&l, &maps, "n1").unwrap_err().to_string();
        assert_eq!(
            e,
            "physicalNetworkName \"other\" has no bridge mapping on node n1"
        );
        let maps: BTreeMap<String, String> = [("other".to_string(), "br-x".to_string())]
            .into_iter()
            .collect();
        assert_eq!(resolve(&l, &maps, "n1").unwrap().mtu, Some(9000));
        let maps: BTreeMap<String, String> =
            [("other".to_string(), "a-far-too-long-bridge".to_string())]
                .into_iter()
                .collect();
        assert!(resolve(&l, &maps, "n1").is_err());
    }
}
