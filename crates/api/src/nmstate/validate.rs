//! Admission of the nmstate.io kinds. A policy's `desiredState` is parsed into
//! [`DesiredState`] (unknown fields refused naming them), then checked field by field
//! ([`validate_desired`], pure): names, types and the sections each type allows, VLAN ids,
//! bond modes, IPv4 addresses and routes, resolver entries, bridge mappings. `capture` and
//! `desiredStateTemplate` are refused (not carried out). What only the node can know (an
//! ethernet NIC that is not there, VLAN filtering missing in its kernel) fails that node's
//! enactment instead.

use std::collections::HashSet;
use std::net::Ipv4Addr;

use serde_json::Value;

use super::state::{
    BOND_MODES, DesiredState, Interface, InterfaceState, InterfaceType, PortVlanMode,
};
use super::{NodeNetworkConfigurationPolicy, max_unavailable};
use crate::admission::{FieldError, Operation, parse_typed};

/// Admission of the group's kinds.
pub fn admit(kind: &str, _op: Operation, obj: &mut Value, _old: Option<&Value>) -> Vec<FieldError> {
    let mut e = Vec::new();
    match kind {
        "NodeNetworkConfigurationPolicy" => {
            match parse_typed::<NodeNetworkConfigurationPolicy>(obj) {
                Err(err) => e.push(err),
                Ok(p) => {
                    let spec = p.spec.unwrap_or_default();
                    if spec.capture.is_some() {
                        e.push(FieldError::forbidden(
                            "spec.capture",
                            "capture is not supported by ferrovirt",
                        ));
                    }
                    if spec.desired_state_template.is_some() {
                        e.push(FieldError::forbidden(
                            "spec.desiredStateTemplate",
                            "desiredStateTemplate is not supported by ferrovirt",
                        ));
                    }
                    if let Err(m) = max_unavailable(spec.max_unavailable.as_ref(), 100) {
                        e.push(FieldError::invalid("spec.maxUnavailable", m));
                    }
                    match spec.desired_state {
                        None => e.push(FieldError::required(
                            "spec.desiredState",
                            "desiredState is required",
                        )),
                        Some(v) => match parse_desired(&v) {
                            Err(err) => e.push(err),
                            Ok(d) => validate_desired(&d, "spec.desiredState", &mut e),
                        },
                    }
                }
            }
        }
        "NodeNetworkConfigurationEnactment" => {
            if let Err(err) = parse_typed::<super::NodeNetworkConfigurationEnactment>(obj) {
                e.push(err);
            }
        }
        "NodeNetworkState" => {
            if let Err(err) = parse_typed::<super::NodeNetworkState>(obj) {
                e.push(err);
            }
        }
        _ => {}
    }
    e
}

/// Parse a desired state, refusing unknown fields with their path under `spec.desiredState`.
pub fn parse_desired(v: &Value) -> Result<DesiredState, FieldError> {
    serde_path_to_error::deserialize::<_, DesiredState>(v).map_err(|err| {
        let p = err.path().to_string();
        let path = if p == "." || p.is_empty() {
            "spec.desiredState".to_string()
        } else {
            format!("spec.desiredState.{p}")
        };
        let msg = err.inner().to_string();
        if msg.starts_with("unknown field") {
            FieldError::not_supported(path, format!("{msg} (not carried out by ferrovirt)"))
        } else {
            FieldError::type_invalid(path, msg)
        }
    })
}

/// Whether `name` is a usable Linux interface name.
fn ifname_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 15
        && name != "."
        && name != ".."
        && !name
            .chars()
            .any(|c| c == '/' || c == ':' || c.is_whitespace())
}

fn vlan_id_ok(id: i64) -> bool {
    (1..=4094).contains(&id)
}

/// The checks on a parsed desired state (pure), errors under `at`.
pub fn validate_desired(d: &DesiredState, at: &str, e: &mut Vec<FieldError>) {
    let mut seen = HashSet::new();
    for (i, iface) in d.interfaces.iter().enumerate() {
        let p = format!("{at}.interfaces[{i}]");
        if !ifname_ok(&iface.name) {
            e.push(FieldError::invalid(
                format!("{p}.name"),
                format!(
                    "{:?} is not a valid interface name (1-15 characters, no '/', ':' or spaces)",
                    iface.name
                ),
            ));
        } else if !seen.insert(iface.name.as_str()) {
            e.push(FieldError::duplicate(
                format!("{p}.name"),
                format!("interface {} is listed twice", iface.name),
            ));
        }
        validate_interface(iface, &p, e);
    }
    if let Some(r) = &d.routes {
        for (i, route) in r.config.iter().enumerate() {
            let p = format!("{at}.routes.config[{i}]");
            if route.destination.parse::<ipnet::Ipv4Net>().is_err() {
                e.push(FieldError::invalid(
                    format!("{p}.destination"),
                    format!(
                        "{:?} is not an IPv4 CIDR (IPv6 is not supported)",
                        route.destination
                    ),
                ));
            }
            if let Some(gw) = &route.next_hop_address
                && gw.parse::<Ipv4Addr>().is_err()
            {
                e.push(FieldError::invalid(
                    format!("{p}.next-hop-address"),
                    format!("{gw:?} is not an IPv4 address"),
                ));
            }
            if let Some(dev) = &route.next_hop_interface
                && !ifname_ok(dev)
            {
                e.push(FieldError::invalid(
                    format!("{p}.next-hop-interface"),
                    format!("{dev:?} is not a valid interface name"),
                ));
            }
            if route.state.is_none()
                && route.next_hop_address.is_none()
                && route.next_hop_interface.is_none()
            {
                e.push(FieldError::required(
                    format!("{p}.next-hop-interface"),
                    "a route needs next-hop-address or next-hop-interface",
                ));
            }
        }
    }
    if let Some(dns) = &d.dns_resolver {
        let p = format!("{at}.dns-resolver.config");
        for (i, s) in dns.config.server.iter().enumerate() {
            if s.parse::<std::net::IpAddr>().is_err() {
                e.push(FieldError::invalid(
                    format!("{p}.server[{i}]"),
                    format!("{s:?} is not an IP address"),
                ));
            }
        }
        for (i, s) in dns.config.search.iter().enumerate() {
            let ok = !s.is_empty()
                && s.len() <= 253
                && s.split('.').all(|l| {
                    !l.is_empty()
                        && l.len() <= 63
                        && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                        && !l.starts_with('-')
                        && !l.ends_with('-')
                });
            if !ok {
                e.push(FieldError::invalid(
                    format!("{p}.search[{i}]"),
                    format!("{s:?} is not a DNS domain name"),
                ));
            }
        }
    }
    if let Some(ovn) = &d.ovn {
        let mut seen = HashSet::new();
        for (i, m) in ovn.bridge_mappings.iter().enumerate() {
            let p = format!("{at}.ovn.bridge-mappings[{i}]");
            let l = &m.localnet;
            if l.is_empty() || l.len() > 253 || l.contains(',') || l.contains(':') {
                e.push(FieldError::invalid(
                    format!("{p}.localnet"),
                    format!("{l:?} must be 1-253 characters without ',' or ':'"),
                ));
            } else if !seen.insert(l.as_str()) {
                e.push(FieldError::duplicate(
                    format!("{p}.localnet"),
                    format!("localnet {l} is mapped twice"),
                ));
            }
            let absent = m.state == Some(super::state::MappingState::Absent);
            match &m.bridge {
                None if !absent => e.push(FieldError::required(
                    format!("{p}.bridge"),
                    "bridge is required unless state is absent",
                )),
                Some(b) if !ifname_ok(b) => e.push(FieldError::invalid(
                    format!("{p}.bridge"),
                    format!("{b:?} is not a valid interface name"),
                )),
                _ => {}
            }
        }
    }
}

fn section_only(
    present: bool,
    want: bool,
    p: &str,
    field: &str,
    ty: &str,
    e: &mut Vec<FieldError>,
) {
    if present && !want {
        e.push(FieldError::forbidden(
            format!("{p}.{field}"),
            format!("{field} is only allowed on interfaces of type {ty}"),
        ));
    }
}

fn validate_interface(iface: &Interface, p: &str, e: &mut Vec<FieldError>) {
    if iface.state() == InterfaceState::Absent {
        for (has, f) in [
            (iface.bridge.is_some(), "bridge"),
            (iface.vlan.is_some(), "vlan"),
            (iface.link_aggregation.is_some(), "link-aggregation"),
            (iface.ipv4.is_some(), "ipv4"),
        ] {
            if has {
                e.push(FieldError::forbidden(
                    format!("{p}.{f}"),
                    "an interface with state absent takes no configuration",
                ));
            }
        }
        return;
    }
    let Some(ty) = iface.type_ else {
        e.push(FieldError::required(
            format!("{p}.type"),
            "type is required (linux-bridge, vlan, bond or ethernet) unless state is absent",
        ));
        return;
    };
    section_only(
        iface.bridge.is_some(),
        ty == InterfaceType::LinuxBridge,
        p,
        "bridge",
        "linux-bridge",
        e,
    );
    section_only(
        iface.vlan.is_some(),
        ty == InterfaceType::Vlan,
        p,
        "vlan",
        "vlan",
        e,
    );
    section_only(
        iface.link_aggregation.is_some(),
        ty == InterfaceType::Bond,
        p,
        "link-aggregation",
        "bond",
        e,
    );
    match ty {
        InterfaceType::Vlan => match &iface.vlan {
            None => e.push(FieldError::required(
                format!("{p}.vlan"),
                "vlan (base-iface, id) is required for type vlan",
            )),
            Some(v) => {
                if !ifname_ok(&v.base_iface) {
                    e.push(FieldError::required(
                        format!("{p}.vlan.base-iface"),
                        "base-iface must name an interface",
                    ));
                }
                if !vlan_id_ok(v.id) {
                    e.push(FieldError::invalid(
                        format!("{p}.vlan.id"),
                        format!("{} is not a VLAN id (1-4094)", v.id),
                    ));
                }
            }
        },
        InterfaceType::Bond => match &iface.link_aggregation {
            None => e.push(FieldError::required(
                format!("{p}.link-aggregation"),
                "link-aggregation (mode, port) is required for type bond",
            )),
            Some(la) => {
                if !BOND_MODES.contains(&la.mode.as_str()) {
                    e.push(FieldError::not_supported(
                        format!("{p}.link-aggregation.mode"),
                        format!("{:?}: supported values: {}", la.mode, BOND_MODES.join(", ")),
                    ));
                }
                for (j, port) in la.port.iter().flatten().enumerate() {
                    if !ifname_ok(port) || *port == iface.name {
                        e.push(FieldError::invalid(
                            format!("{p}.link-aggregation.port[{j}]"),
                            format!("{port:?} is not a usable port"),
                        ));
                    }
                }
            }
        },
        InterfaceType::LinuxBridge => {
            if let Some(b) = &iface.bridge {
                let mut seen = HashSet::new();
                for (j, port) in b.port.iter().flatten().enumerate() {
                    let pp = format!("{p}.bridge.port[{j}]");
                    if !ifname_ok(&port.name) || port.name == iface.name {
                        e.push(FieldError::invalid(
                            format!("{pp}.name"),
                            format!("{:?} is not a usable port", port.name),
                        ));
                    } else if !seen.insert(port.name.as_str()) {
                        e.push(FieldError::duplicate(
                            format!("{pp}.name"),
                            format!("port {} is listed twice", port.name),
                        ));
                    }
                    if let Some(v) = &port.vlan {
                        validate_port_vlan(v, &pp, e);
                    }
                }
            }
        }
        InterfaceType::Ethernet => {}
    }
    if let Some(v4) = &iface.ipv4 {
        let enabled = v4.enabled.unwrap_or(true);
        let dhcp = v4.dhcp.unwrap_or(false);
        let addrs = v4.address.as_deref().unwrap_or_default();
        if !enabled && (dhcp || !addrs.is_empty()) {
            e.push(FieldError::forbidden(
                format!("{p}.ipv4.enabled"),
                "dhcp and address need ipv4.enabled true",
            ));
        }
        for (has, f) in [
            (v4.auto_dns.is_some(), "auto-dns"),
            (v4.auto_gateway.is_some(), "auto-gateway"),
            (v4.auto_routes.is_some(), "auto-routes"),
            (v4.auto_route_table_id.is_some(), "auto-route-table-id"),
        ] {
            if has && !dhcp {
                e.push(FieldError::forbidden(
                    format!("{p}.ipv4.{f}"),
                    format!("{f} needs ipv4.dhcp true"),
                ));
            }
        }
        if let Some(t) = v4.auto_route_table_id
            && t != 0
        {
            e.push(FieldError::not_supported(
                format!("{p}.ipv4.auto-route-table-id"),
                format!("{t}: only 0 (the main table) is carried out by ferrovirt"),
            ));
        }
        if dhcp && !addrs.is_empty() {
            e.push(FieldError::forbidden(
                format!("{p}.ipv4.address"),
                "static addresses and dhcp are exclusive",
            ));
        }
        for (j, a) in addrs.iter().enumerate() {
            if a.ip.parse::<Ipv4Addr>().is_err() {
                e.push(FieldError::invalid(
                    format!("{p}.ipv4.address[{j}].ip"),
                    format!("{:?} is not an IPv4 address", a.ip),
                ));
            }
            if !(0..=32).contains(&a.prefix_length) {
                e.push(FieldError::invalid(
                    format!("{p}.ipv4.address[{j}].prefix-length"),
                    format!("{} is not a prefix length (0-32)", a.prefix_length),
                ));
            }
        }
    }
}

fn validate_port_vlan(v: &super::state::PortVlan, pp: &str, e: &mut Vec<FieldError>) {
    match v.mode {
        None => e.push(FieldError::required(
            format!("{pp}.vlan.mode"),
            "mode is required (access or trunk)",
        )),
        Some(PortVlanMode::Access) => {
            match v.tag {
                Some(t) if vlan_id_ok(t) => {}
                Some(t) => e.push(FieldError::invalid(
                    format!("{pp}.vlan.tag"),
                    format!("{t} is not a VLAN id (1-4094)"),
                )),
                None => e.push(FieldError::required(
                    format!("{pp}.vlan.tag"),
                    "an access port needs its tag",
                )),
            }
            if v.trunk_tags.is_some() {
                e.push(FieldError::forbidden(
                    format!("{pp}.vlan.trunk-tags"),
                    "trunk-tags are only allowed with mode trunk",
                ));
            }
        }
        Some(PortVlanMode::Trunk) => {
            let tags = v.trunk_tags.as_deref().unwrap_or_default();
            if tags.is_empty() {
                e.push(FieldError::required(
                    format!("{pp}.vlan.trunk-tags"),
                    "a trunk port needs trunk-tags",
                ));
            }
            for (k, t) in tags.iter().enumerate() {
                if !vlan_id_ok(t.id) {
                    e.push(FieldError::invalid(
                        format!("{pp}.vlan.trunk-tags[{k}].id"),
                        format!("{} is not a VLAN id (1-4094)", t.id),
                    ));
                }
            }
            if let Some(t) = v.tag
                && !vlan_id_ok(t)
            {
                e.push(FieldError::invalid(
                    format!("{pp}.vlan.tag"),
                    format!("{t} is not a VLAN id (1-4094)"),
                ));
            }
        }
    }
}
