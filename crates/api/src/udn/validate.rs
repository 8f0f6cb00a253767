//! Admission of UserDefinedNetwork and ClusterUserDefinedNetwork: the typed parse, then the
//! rules OVN-Kubernetes' CRDs publish (their CEL validations), each refused naming the field.
//! The network (a UDN's `spec`, a CUDN's `spec.network`) is immutable; a CUDN's
//! `namespaceSelector` may change.

use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::Value;

use super::{
    ClusterUserDefinedNetwork, IpamConfig, IpamLifecycle, IpamMode, Layer2Config, Layer3Config,
    LocalnetConfig, NetworkSpec, Role, Topology, UserDefinedNetwork, UserDefinedNetworkSpec,
    VlanMode,
};
use crate::admission::{FieldError, Operation, parse_typed};

/// Admission of the group's kinds.
pub fn admit(kind: &str, op: Operation, obj: &mut Value, old: Option<&Value>) -> Vec<FieldError> {
    let mut e = Vec::new();
    match kind {
        "UserDefinedNetwork" => match parse_typed::<UserDefinedNetwork>(obj) {
            Err(err) => e.push(err),
            Ok(udn) => match &udn.spec {
                None => e.push(FieldError::required("spec", "spec is required")),
                Some(spec) => {
                    validate_udn_spec(spec, &mut e);
                    if op == Operation::Update
                        && let Some(old) = old
                        && old.get("spec") != obj.get("spec")
                    {
                        e.push(FieldError::forbidden("spec", "Spec is immutable"));
                    }
                }
            },
        },
        "ClusterUserDefinedNetwork" => match parse_typed::<ClusterUserDefinedNetwork>(obj) {
            Err(err) => e.push(err),
            Ok(cudn) => match &cudn.spec {
                None => e.push(FieldError::required("spec", "spec is required")),
                Some(spec) => {
                    if spec.namespace_selector.is_none() {
                        e.push(FieldError::required(
                            "spec.namespaceSelector",
                            "namespaceSelector is required",
                        ));
                    }
                    match &spec.network {
                        None => e.push(FieldError::required("spec.network", "network is required")),
                        Some(net) => validate_network(net, &mut e),
                    }
                    if op == Operation::Update
                        && let Some(old) = old
                        && old.pointer("/spec/network") != obj.pointer("/spec/network")
                    {
                        e.push(FieldError::forbidden(
                            "spec.network",
                            "Network spec is immutable",
                        ));
                    }
                }
            },
        },
        _ => {}
    }
    e
}

fn topology_required(at: &str, e: &mut Vec<FieldError>) {
    e.push(FieldError::required(
        format!("{at}.topology"),
        "topology is required (Layer2 or Layer3; Localnet on a ClusterUserDefinedNetwork)",
    ));
}

/// `spec.layerN is required when topology is LayerN and forbidden otherwise`, as OVN-K says.
fn matching(at: &str, field: &str, want: bool, has: bool, topo: &str, e: &mut Vec<FieldError>) {
    if want != has {
        let path = format!("{at}.{field}");
        let msg = format!("{path} is required when topology is {topo} and forbidden otherwise");
        e.push(if want {
            FieldError::required(path, msg)
        } else {
            FieldError::forbidden(path, msg)
        });
    }
}

/// A UDN's spec: Layer2 or Layer3 only.
pub fn validate_udn_spec(spec: &UserDefinedNetworkSpec, e: &mut Vec<FieldError>) {
    let at = "spec";
    let Some(topo) = spec.topology else {
        return topology_required(at, e);
    };
    if topo == Topology::Localnet {
        e.push(FieldError::not_supported(
            "spec.topology",
            "Localnet is only supported on a ClusterUserDefinedNetwork; supported values: \"Layer2\", \"Layer3\"",
        ));
        return;
    }
    matching(
        at,
        "layer2",
        topo == Topology::Layer2,
        spec.layer2.is_some(),
        "Layer2",
        e,
    );
    matching(
        at,
        "layer3",
        topo == Topology::Layer3,
        spec.layer3.is_some(),
        "Layer3",
        e,
    );
    if let (Topology::Layer2, Some(c)) = (topo, &spec.layer2) {
        validate_layer2(&format!("{at}.layer2"), c, e);
    }
    if let (Topology::Layer3, Some(c)) = (topo, &spec.layer3) {
        validate_layer3(&format!("{at}.layer3"), c, e);
    }
}

/// A CUDN's `spec.network`.
pub fn validate_network(net: &NetworkSpec, e: &mut Vec<FieldError>) {
    let at = "spec.network";
    let Some(topo) = net.topology else {
        return topology_required(at, e);
    };
    matching(
        at,
        "layer2",
        topo == Topology::Layer2,
        net.layer2.is_some(),
        "Layer2",
        e,
    );
    matching(
        at,
        "layer3",
        topo == Topology::Layer3,
        net.layer3.is_some(),
        "Layer3",
        e,
    );
    matching(
        at,
        "localnet",
        topo == Topology::Localnet,
        net.localnet.is_some(),
        "Localnet",
        e,
    );
    match topo {
        Topology::Layer2 => {
            if let Some(c) = &net.layer2 {
                validate_layer2(&format!("{at}.layer2"), c, e);
            }
        }
        Topology::Layer3 => {
            if let Some(c) = &net.layer3 {
                validate_layer3(&format!("{at}.layer3"), c, e);
            }
        }
        Topology::Localnet => {
            if let Some(c) = &net.localnet {
                validate_localnet(&format!("{at}.localnet"), c, e);
            }
        }
    }
}

fn role_required(at: &str, role: Option<Role>, e: &mut Vec<FieldError>) -> Option<Role> {
    if role.is_none() {
        e.push(FieldError::required(
            format!("{at}.role"),
            "role is required (Primary or Secondary)",
        ));
    }
    role
}

/// Parse a list of 1 or 2 CIDRs (one per family); errors name each bad item.
fn dual_stack(at: &str, list: &[String], e: &mut Vec<FieldError>) -> Vec<IpNet> {
    if list.is_empty() || list.len() > 2 {
        e.push(FieldError::invalid(
            at,
            "must have 1 or 2 items (one subnet per IP family)",
        ));
    }
    let nets = cidrs(at, list, e);
    if nets.len() == 2 && is_v6(&nets[0]) == is_v6(&nets[1]) {
        e.push(FieldError::invalid(
            at,
            "when 2 CIDRs are set, they must be from different IP families",
        ));
    }
    nets
}

fn cidrs(at: &str, list: &[String], e: &mut Vec<FieldError>) -> Vec<IpNet> {
    list.iter()
        .enumerate()
        .filter_map(|(i, s)| cidr(&format!("{at}[{i}]"), s, e))
        .collect()
}

fn cidr(at: &str, s: &str, e: &mut Vec<FieldError>) -> Option<IpNet> {
    if s.len() > 43 {
        e.push(FieldError::invalid(
            at,
            "may not be longer than 43 characters",
        ));
        return None;
    }
    match s.parse::<IpNet>() {
        Ok(n) => Some(n),
        Err(_) => {
            e.push(FieldError::invalid(
                at,
                format!("{s:?} is not a CIDR (e.g. 10.128.0.0/16)"),
            ));
            None
        }
    }
}

fn is_v6(n: &IpNet) -> bool {
    matches!(n.addr(), IpAddr::V6(_))
}

fn validate_mtu(at: &str, mtu: Option<i64>, nets: &[IpNet], e: &mut Vec<FieldError>) {
    let Some(mtu) = mtu else { return };
    let path = format!("{at}.mtu");
    if !(576..=65536).contains(&mtu) {
        e.push(FieldError::invalid(
            path,
            format!("{mtu}: must be between 576 and 65536"),
        ));
    } else if mtu < 1280 && nets.iter().any(is_v6) {
        e.push(FieldError::invalid(
            path,
            "MTU should be greater than or equal to 1280 when an IPv6 subnet is used",
        ));
    }
}

fn validate_join(
    at: &str,
    join: &Option<Vec<String>>,
    role: Option<Role>,
    e: &mut Vec<FieldError>,
) {
    let Some(join) = join else { return };
    let path = format!("{at}.joinSubnets");
    if role != Some(Role::Primary) {
        e.push(FieldError::forbidden(
            &path,
            "JoinSubnets is only supported for Primary network",
        ));
    }
    dual_stack(&path, join, e);
}

/// The IPAM rules shared by Layer2 and Localnet; returns whether IPAM is Enabled.
fn validate_ipam(
    at: &str,
    ipam: &Option<IpamConfig>,
    role: Option<Role>,
    has_subnets: bool,
    e: &mut Vec<FieldError>,
) -> bool {
    let Some(ipam) = ipam else { return true };
    let path = format!("{at}.ipam");
    if ipam.mode.is_none() && ipam.lifecycle.is_none() {
        e.push(FieldError::invalid(
            &path,
            "ipam must have at least one property (mode or lifecycle)",
        ));
    }
    let disabled = ipam.mode == Some(IpamMode::Disabled);
    if disabled && role == Some(Role::Primary) {
        e.push(FieldError::forbidden(
            format!("{path}.mode"),
            "Disabled ipam.mode is only supported for Secondary network",
        ));
    }
    if disabled && has_subnets {
        e.push(FieldError::forbidden(
            format!("{at}.subnets"),
            "Subnets must be unset when ipam.mode is Disabled",
        ));
    }
    if ipam.lifecycle == Some(IpamLifecycle::Persistent) && disabled {
        e.push(FieldError::forbidden(
            format!("{path}.lifecycle"),
            "lifecycle Persistent is only supported when ipam.mode is Enabled",
        ));
    }
    !disabled
}

fn validate_layer2(at: &str, c: &Layer2Config, e: &mut Vec<FieldError>) {
    let role = role_required(at, c.role, e);
    let nets = match &c.subnets {
        Some(s) => dual_stack(&format!("{at}.subnets"), s, e),
        None => Vec::new(),
    };
    let enabled = validate_ipam(at, &c.ipam, role, c.subnets.is_some(), e);
    if enabled && c.subnets.is_none() {
        e.push(FieldError::required(
            format!("{at}.subnets"),
            "Subnets is required with ipam.mode is Enabled or unset",
        ));
    }
    validate_join(at, &c.join_subnets, role, e);
    validate_mtu(at, c.mtu, &nets, e);
}

fn validate_layer3(at: &str, c: &Layer3Config, e: &mut Vec<FieldError>) {
    let role = role_required(at, c.role, e);
    let path = format!("{at}.subnets");
    let subnets = c.subnets.as_deref().unwrap_or_default();
    if subnets.is_empty() {
        e.push(FieldError::required(
            &path,
            "Subnets is required for Layer3 topology",
        ));
    } else if subnets.len() > 2 {
        e.push(FieldError::invalid(
            &path,
            "must have 1 or 2 items (one subnet per IP family)",
        ));
    }
    let mut nets = Vec::new();
    for (i, s) in subnets.iter().enumerate() {
        let item = format!("{path}[{i}]");
        let Some(c) = s.cidr.as_deref() else {
            e.push(FieldError::required(
                format!("{item}.cidr"),
                "cidr is required",
            ));
            continue;
        };
        let Some(net) = cidr(&format!("{item}.cidr"), c, e) else {
            continue;
        };
        if let Some(h) = s.host_subnet {
            let hp = format!("{item}.hostSubnet");
            let max = if is_v6(&net) { 127 } else { 32 };
            if !(1..=127).contains(&h) {
                e.push(FieldError::invalid(
                    hp,
                    format!("{h}: must be between 1 and 127"),
                ));
            } else if h > max || (!is_v6(&net) && h >= 32) {
                e.push(FieldError::invalid(
                    hp,
                    "HostSubnet must < 32 for ipv4 CIDR",
                ));
            } else if h <= i64::from(net.prefix_len()) {
                e.push(FieldError::invalid(
                    hp,
                    "HostSubnet must be smaller than CIDR subnet",
                ));
            }
        }
        nets.push(net);
    }
    if nets.len() == 2 && is_v6(&nets[0]) == is_v6(&nets[1]) {
        e.push(FieldError::invalid(
            &path,
            "when 2 CIDRs are set, they must be from different IP families",
        ));
    }
    validate_join(at, &c.join_subnets, role, e);
    validate_mtu(at, c.mtu, &nets, e);
}

fn validate_localnet(at: &str, c: &LocalnetConfig, e: &mut Vec<FieldError>) {
    match c.role {
        None => e.push(FieldError::required(
            format!("{at}.role"),
            "role is required (Secondary)",
        )),
        Some(Role::Primary) => e.push(FieldError::not_supported(
            format!("{at}.role"),
            "Localnet topology supports role Secondary only",
        )),
        Some(Role::Secondary) => {}
    }
    let pnn = format!("{at}.physicalNetworkName");
    match c.physical_network_name.as_deref() {
        None | Some("") => e.push(FieldError::required(pnn, "physicalNetworkName is required")),
        Some(n) if n.len() > 253 => e.push(FieldError::invalid(
            pnn,
            "may not be longer than 253 characters",
        )),
        Some(n) if n.contains([',', ':']) => e.push(FieldError::invalid(
            pnn,
            "physicalNetworkName cannot contain `,` or `:` characters",
        )),
        Some(_) => {}
    }
    let nets = match &c.subnets {
        Some(s) => dual_stack(&format!("{at}.subnets"), s, e),
        None => Vec::new(),
    };
    let enabled = validate_ipam(at, &c.ipam, c.role, c.subnets.is_some(), e);
    if c.ipam
        .as_ref()
        .is_some_and(|i| i.mode != Some(IpamMode::Disabled))
        && c.subnets.is_none()
    {
        e.push(FieldError::required(
            format!("{at}.subnets"),
            "Subnets is required with ipam.mode is Enabled or unset",
        ));
    }
    if let Some(ex) = &c.exclude_subnets {
        let path = format!("{at}.excludeSubnets");
        if c.subnets.is_none() || !enabled {
            e.push(FieldError::forbidden(
                &path,
                "excludeSubnets must be unset when subnets is unset or ipam.mode is Disabled",
            ));
        }
        if ex.is_empty() || ex.len() > 25 {
            e.push(FieldError::invalid(&path, "must have 1 to 25 items"));
        }
        for (i, x) in cidrs(&path, ex, e).iter().enumerate() {
            if !nets.is_empty() && !nets.iter().any(|n| n.contains(x)) {
                e.push(FieldError::invalid(
                    format!("{path}[{i}]"),
                    "excludeSubnets must be subnetworks of the networks specified in the subnets field",
                ));
            }
        }
    }
    if let Some(v) = &c.vlan {
        let path = format!("{at}.vlan");
        match (v.mode, &v.access) {
            (Some(VlanMode::Access), None) => e.push(FieldError::required(
                format!("{path}.access"),
                "vlan access config is required when vlan mode is 'Access'",
            )),
            (None, Some(_)) => e.push(FieldError::forbidden(
                format!("{path}.access"),
                "vlan access config is forbidden when vlan mode is not 'Access'",
            )),
            _ => {}
        }
        if let Some(a) = &v.access {
            match a.id {
                None => e.push(FieldError::required(
                    format!("{path}.access.id"),
                    "id is required",
                )),
                Some(id) if !(1..=4094).contains(&id) => e.push(FieldError::invalid(
                    format!("{path}.access.id"),
                    format!("{id}: must be between 1 and 4094"),
                )),
                Some(_) => {}
            }
        }
    }
    validate_mtu(at, c.mtu, &nets, e);
}
