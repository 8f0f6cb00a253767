//! From a node's current state and a policy's desired state to the `ip`/`bridge` commands
//! that make one the other ([`plan`], pure), and the desired state that restores a
//! checkpoint ([`restore_state`], pure): its plan is the rollback. Steps run in phases:
//! create bridges and bonds, then VLANs (their base may be new), then ports, addresses,
//! link states, routes, and deletions last. A field the agent cannot carry out fails the
//! plan naming it (`interfaces[0].type: …`), so nothing is half-done silently. DHCP is not a
//! step: [`dhcp_changes`] (pure) says which interfaces get a DHCP client and which lose
//! theirs, and the client leaves a DHCP interface's addresses to itself (`super::dhcp`).

use std::collections::BTreeSet;

use ferrovirt_api::nmstate::state::{
    Address, Bridge, BridgePort, DesiredState, Interface, InterfaceState, InterfaceType, Ipv4,
    LinkAggregation, PortVlanMode, Route, Routes, Vlan,
};

use super::current::{Current, Link};

/// One command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// `ip` or `bridge`.
    pub tool: &'static str,
    pub args: Vec<String>,
}

impl Step {
    fn ip(args: &[&str]) -> Step {
        Step {
            tool: "ip",
            args: args.iter().map(|s| s.to_string()).collect(),
        }
    }
    fn bridge(args: &[&str]) -> Step {
        Step {
            tool: "bridge",
            args: args.iter().map(|s| s.to_string()).collect(),
        }
    }
    /// `ip link set …` etc. as one line (logs, messages, tests).
    pub fn line(&self) -> String {
        format!("{} {}", self.tool, self.args.join(" "))
    }
}

/// Whether a current link of `kind` satisfies a desired `ty`.
fn kind_matches(kind: &str, ty: InterfaceType) -> bool {
    match ty {
        InterfaceType::Ethernet => kind == "ethernet" || kind == "veth",
        t => kind == t.as_str(),
    }
}

fn route_matches(r: &super::current::RouteEntry, want: &Route) -> bool {
    r.dst == want.destination
        && want
            .next_hop_address
            .as_ref()
            .is_none_or(|g| r.gateway.as_ref() == Some(g))
        && want
            .next_hop_interface
            .as_ref()
            .is_none_or(|d| r.dev.as_ref() == Some(d))
}

fn onoff(b: bool) -> &'static str {
    if b { "1" } else { "0" }
}

/// What a DHCP client of an interface installs from its lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DhcpOpts {
    /// The router as the default route (`auto-gateway` and `auto-routes`, default true).
    pub gateway: bool,
    /// The lease's DNS servers recorded and reported (`auto-dns`, default true).
    pub dns: bool,
}

/// The DHCP clients a desired state starts (`Some`) or stops (`None`), in interface order
/// (pure): `ipv4.dhcp: true` starts one; `dhcp: false`, `ipv4.enabled: false`, static
/// addresses or `state: absent` stop it; an interface without `ipv4` keeps what it has.
pub fn dhcp_changes(want: &DesiredState) -> Vec<(String, Option<DhcpOpts>)> {
    let mut out = Vec::new();
    for i in &want.interfaces {
        if i.state() == InterfaceState::Absent {
            out.push((i.name.clone(), None));
            continue;
        }
        let Some(v4) = &i.ipv4 else { continue };
        if v4.dhcp == Some(true) && v4.enabled != Some(false) {
            let routes = v4.auto_routes.unwrap_or(true);
            out.push((
                i.name.clone(),
                Some(DhcpOpts {
                    gateway: routes && v4.auto_gateway.unwrap_or(true),
                    dns: v4.auto_dns.unwrap_or(true),
                }),
            ));
        } else {
            out.push((i.name.clone(), None));
        }
    }
    out
}

/// The steps that turn `cur` into `want` (pure). Errors name the field under
/// `spec.desiredState`.
pub fn plan(cur: &Current, want: &DesiredState) -> Result<Vec<Step>, String> {
    let at = |i: usize| format!("spec.desiredState.interfaces[{i}]");
    let mut create = Vec::new();
    let mut create_vlan = Vec::new();
    let mut ports = Vec::new();
    let mut addrs = Vec::new();
    let mut states = Vec::new();
    let mut deletes = Vec::new();
    // Interfaces that exist once the plan has run (for ports and VLAN bases).
    let mut will_exist: BTreeSet<&str> = cur.links.iter().map(|l| l.name.as_str()).collect();
    for i in &want.interfaces {
        match i.state() {
            InterfaceState::Absent => {
                will_exist.remove(i.name.as_str());
            }
            _ => {
                will_exist.insert(i.name.as_str());
            }
        }
    }
    for (idx, i) in want.interfaces.iter().enumerate() {
        let p = at(idx);
        let existing = cur.link(&i.name);
        if i.state() == InterfaceState::Absent {
            match existing {
                None => {}
                Some(l) if l.kind == "ethernet" || l.kind == "veth" => {
                    // A NIC is not deleted: it is taken down without addresses.
                    for (ip, pl) in &l.addrs {
                        addrs.push(Step::ip(&[
                            "addr",
                            "del",
                            &format!("{ip}/{pl}"),
                            "dev",
                            &i.name,
                        ]));
                    }
                    if l.up {
                        states.push(Step::ip(&["link", "set", &i.name, "down"]));
                    }
                }
                Some(_) => deletes.push(Step::ip(&["link", "del", &i.name])),
            }
            continue;
        }
        let Some(ty) = i.type_ else {
            return Err(format!("{p}.type: type is required"));
        };
        match existing {
            Some(l) if !kind_matches(&l.kind, ty) => {
                return Err(format!(
                    "{p}.type: interface {} exists on this node as {}, not {}",
                    i.name,
                    l.kind,
                    ty.as_str()
                ));
            }
            Some(_) => {}
            None => match ty {
                InterfaceType::Ethernet => {
                    return Err(format!(
                        "{p}.name: interface {} (type ethernet) does not exist on this node",
                        i.name
                    ));
                }
                InterfaceType::LinuxBridge => {
                    let stp = bridge_stp(i.bridge.as_ref()).unwrap_or(true);
                    create.push(Step::ip(&[
                        "link",
                        "add",
                        &i.name,
                        "type",
                        "bridge",
                        "stp_state",
                        onoff(stp),
                    ]));
                }
                InterfaceType::Bond => {
                    let mode = i
                        .link_aggregation
                        .as_ref()
                        .map(|l| l.mode.as_str())
                        .unwrap_or("balance-rr");
                    create.push(Step::ip(&[
                        "link", "add", &i.name, "type", "bond", "mode", mode,
                    ]));
                }
                InterfaceType::Vlan => {
                    let v = i
                        .vlan
                        .as_ref()
                        .ok_or_else(|| format!("{p}.vlan: required for type vlan"))?;
                    if !will_exist.contains(v.base_iface.as_str()) {
                        return Err(format!(
                            "{p}.vlan.base-iface: interface {} does not exist on this node",
                            v.base_iface
                        ));
                    }
                    create_vlan.push(Step::ip(&[
                        "link",
                        "add",
                        "link",
                        &v.base_iface,
                        "name",
                        &i.name,
                        "type",
                        "vlan",
                        "id",
                        &v.id.to_string(),
                    ]));
                }
            },
        }
        if let Some(l) = existing {
            if let (Some(stp), Some(have)) = (bridge_stp(i.bridge.as_ref()), l.stp)
                && stp != have
            {
                create.push(Step::ip(&[
                    "link",
                    "set",
                    &i.name,
                    "type",
                    "bridge",
                    "stp_state",
                    onoff(stp),
                ]));
            }
            if let (Some(v), Some((base, id))) = (&i.vlan, &l.vlan)
                && (v.base_iface != *base || v.id != *id)
            {
                return Err(format!(
                    "{p}.vlan: vlan {} exists as {base}.{id}; base-iface and id cannot change",
                    i.name
                ));
            }
        }
        // Ports: the complete list when given.
        let listed: Option<Vec<(String, Option<&ferrovirt_api::nmstate::state::PortVlan>)>> =
            match ty {
                InterfaceType::LinuxBridge => {
                    i.bridge.as_ref().and_then(|b| b.port.as_ref()).map(|ps| {
                        ps.iter()
                            .map(|p| (p.name.clone(), p.vlan.as_ref()))
                            .collect()
                    })
                }
                InterfaceType::Bond => i
                    .link_aggregation
                    .as_ref()
                    .and_then(|l| l.port.as_ref())
                    .map(|ps| ps.iter().map(|p| (p.clone(), None)).collect()),
                _ => None,
            };
        if let Some(listed) = listed {
            let field = if ty == InterfaceType::Bond {
                "link-aggregation.port"
            } else {
                "bridge.port"
            };
            for (j, (port, vlan)) in listed.iter().enumerate() {
                if !will_exist.contains(port.as_str()) {
                    return Err(format!(
                        "{p}.{field}[{j}]: interface {port} does not exist on this node"
                    ));
                }
                let has = cur.link(port).and_then(|l| l.master.as_deref()) == Some(&i.name);
                if !has {
                    if ty == InterfaceType::Bond {
                        ports.push(Step::ip(&["link", "set", port, "down"]));
                    }
                    ports.push(Step::ip(&["link", "set", port, "master", &i.name]));
                    ports.push(Step::ip(&["link", "set", port, "up"]));
                }
                if let Some(v) = vlan {
                    ports.push(Step::ip(&[
                        "link",
                        "set",
                        &i.name,
                        "type",
                        "bridge",
                        "vlan_filtering",
                        "1",
                    ]));
                    match v.mode {
                        Some(PortVlanMode::Access) => {
                            let tag = v.tag.unwrap_or(0).to_string();
                            ports.push(Step::bridge(&[
                                "vlan", "add", "dev", port, "vid", &tag, "pvid", "untagged",
                            ]));
                            ports.push(Step::bridge(&["vlan", "del", "dev", port, "vid", "1"]));
                        }
                        Some(PortVlanMode::Trunk) => {
                            for t in v.trunk_tags.iter().flatten() {
                                ports.push(Step::bridge(&[
                                    "vlan",
                                    "add",
                                    "dev",
                                    port,
                                    "vid",
                                    &t.id.to_string(),
                                ]));
                            }
                            if let Some(tag) = v.tag {
                                ports.push(Step::bridge(&[
                                    "vlan",
                                    "add",
                                    "dev",
                                    port,
                                    "vid",
                                    &tag.to_string(),
                                    "pvid",
                                    "untagged",
                                ]));
                            }
                        }
                        None => {}
                    }
                }
            }
            for port in cur.ports_of(&i.name) {
                if !listed.iter().any(|(n, _)| *n == port) {
                    ports.push(Step::ip(&["link", "set", &port, "nomaster"]));
                }
            }
        }
        if let Some(v4) = &i.ipv4 {
            let have: Vec<(String, i64)> = existing.map(|l| l.addrs.clone()).unwrap_or_default();
            let wanted: Vec<(String, i64)> = if v4.enabled == Some(false) {
                Vec::new()
            } else {
                v4.address
                    .iter()
                    .flatten()
                    .map(|a| (a.ip.clone(), a.prefix_length))
                    .collect()
            };
            // With enabled and no address list, addresses stay as they are.
            if v4.enabled == Some(false) || v4.address.is_some() {
                for (ip, pl) in &have {
                    if !wanted.contains(&(ip.clone(), *pl)) {
                        addrs.push(Step::ip(&[
                            "addr",
                            "del",
                            &format!("{ip}/{pl}"),
                            "dev",
                            &i.name,
                        ]));
                    }
                }
                for (ip, pl) in &wanted {
                    if !have.contains(&(ip.clone(), *pl)) {
                        addrs.push(Step::ip(&[
                            "addr",
                            "add",
                            &format!("{ip}/{pl}"),
                            "dev",
                            &i.name,
                        ]));
                    }
                }
            }
        }
        let up = i.state() == InterfaceState::Up;
        if existing.is_none_or(|l| l.up != up) {
            states.push(Step::ip(&[
                "link",
                "set",
                &i.name,
                if up { "up" } else { "down" },
            ]));
        }
    }
    let mut routes = Vec::new();
    if let Some(r) = &want.routes {
        for (j, route) in r.config.iter().enumerate() {
            let present = cur.routes.iter().any(|c| route_matches(c, route));
            let mut args = vec!["route".to_string()];
            if route.state.is_some() {
                if !present {
                    continue;
                }
                args.push("del".into());
            } else {
                if present {
                    continue;
                }
                if let Some(d) = &route.next_hop_interface
                    && !will_exist.contains(d.as_str())
                {
                    return Err(format!(
                        "spec.desiredState.routes.config[{j}].next-hop-interface: interface {d} \
                         does not exist on this node"
                    ));
                }
                args.push("replace".into());
            }
            args.push(route.destination.clone());
            if let Some(g) = &route.next_hop_address {
                args.extend(["via".into(), g.clone()]);
            }
            if let Some(d) = &route.next_hop_interface {
                args.extend(["dev".into(), d.clone()]);
            }
            routes.push(Step { tool: "ip", args });
        }
    }
    let mut out = create;
    out.extend(create_vlan);
    out.extend(ports);
    out.extend(addrs);
    out.extend(states);
    out.extend(routes);
    out.extend(deletes);
    Ok(out)
}

fn bridge_stp(b: Option<&Bridge>) -> Option<bool> {
    b?.options.as_ref()?.stp.as_ref()?.enabled
}

fn restore_interface(l: &Link, cur: &Current) -> Option<Interface> {
    let ty = match l.kind.as_str() {
        "linux-bridge" => InterfaceType::LinuxBridge,
        "vlan" => InterfaceType::Vlan,
        "bond" => InterfaceType::Bond,
        "ethernet" | "veth" => InterfaceType::Ethernet,
        _ => return None,
    };
    let ports = cur.ports_of(&l.name);
    Some(Interface {
        name: l.name.clone(),
        type_: Some(ty),
        state: Some(if l.up {
            InterfaceState::Up
        } else {
            InterfaceState::Down
        }),
        bridge: (ty == InterfaceType::LinuxBridge).then(|| Bridge {
            options: Some(ferrovirt_api::nmstate::state::BridgeOptions {
                stp: Some(ferrovirt_api::nmstate::state::Stp { enabled: l.stp }),
            }),
            port: Some(
                ports
                    .iter()
                    .map(|p| BridgePort {
                        name: p.clone(),
                        vlan: None,
                    })
                    .collect(),
            ),
        }),
        vlan: l.vlan.as_ref().map(|(b, id)| Vlan {
            base_iface: b.clone(),
            id: *id,
        }),
        link_aggregation: (ty == InterfaceType::Bond).then(|| LinkAggregation {
            mode: l.bond_mode.clone().unwrap_or_else(|| "balance-rr".into()),
            port: Some(ports.clone()),
        }),
        ipv4: Some(Ipv4 {
            enabled: Some(!l.addrs.is_empty()),
            address: Some(
                l.addrs
                    .iter()
                    .map(|(ip, p)| Address {
                        ip: ip.clone(),
                        prefix_length: *p,
                    })
                    .collect(),
            ),
            ..Default::default()
        }),
    })
}

/// The desired state that puts back what `desired` changes, as `checkpoint` had it (pure):
/// every interface the policy names, every port it names, and every former master of those
/// ports as they were (absent when they did not exist), and its routes as they were. Its
/// [`plan`] against the state after the apply is the rollback.
pub fn restore_state(checkpoint: &Current, desired: &DesiredState) -> DesiredState {
    let mut names: BTreeSet<String> = BTreeSet::new();
    for i in &desired.interfaces {
        names.insert(i.name.clone());
        for p in i.bridge.iter().flat_map(|b| b.port.iter().flatten()) {
            names.insert(p.name.clone());
        }
        for p in i
            .link_aggregation
            .iter()
            .flat_map(|l| l.port.iter().flatten())
        {
            names.insert(p.clone());
        }
    }
    let masters: Vec<String> = names
        .iter()
        .filter_map(|n| checkpoint.link(n)?.master.clone())
        .collect();
    names.extend(masters);
    let mut interfaces = Vec::new();
    for n in &names {
        match checkpoint.link(n) {
            Some(l) => interfaces.extend(restore_interface(l, checkpoint)),
            None => interfaces.push(Interface {
                name: n.clone(),
                state: Some(InterfaceState::Absent),
                ..Default::default()
            }),
        }
    }
    let mut config = Vec::new();
    for r in desired.routes.iter().flat_map(|r| r.config.iter()) {
        let before: Vec<_> = checkpoint
            .routes
            .iter()
            .filter(|c| route_matches(c, r))
            .collect();
        if r.state.is_some() {
            config.extend(before.into_iter().map(|c| Route {
                destination: c.dst.clone(),
                next_hop_address: c.gateway.clone(),
                next_hop_interface: c.dev.clone(),
                state: None,
            }));
        } else if before.is_empty() {
            config.push(Route {
                state: Some(ferrovirt_api::nmstate::state::AbsentState::Absent),
                ..r.clone()
            });
        }
    }
    DesiredState {
        interfaces,
        routes: (!config.is_empty()).then_some(Routes { config }),
        dns_resolver: None,
        ovn: None,
    }
}
