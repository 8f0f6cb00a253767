//! The node's current network state as the agent reads it (`ip -j -d addr show`,
//! `ip -j -4 route show table main`), parsed (pure) into [`Current`], and rendered in
//! nmstate's shape for the NodeNetworkState ([`Current::to_nmstate`]).

use serde_json::{Value, json};

/// One link.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Link {
    pub name: String,
    /// nmstate's type: linux-bridge, vlan, bond, ethernet, veth, loopback, or the kernel kind.
    pub kind: String,
    pub up: bool,
    pub mac: String,
    pub mtu: u32,
    pub master: Option<String>,
    /// A vlan's base interface and id.
    pub vlan: Option<(String, i64)>,
    /// A bond's mode.
    pub bond_mode: Option<String>,
    /// A bridge's STP.
    pub stp: Option<bool>,
    /// IPv4 addresses with prefix length.
    pub addrs: Vec<(String, i64)>,
}

/// One IPv4 route of the main table.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouteEntry {
    /// `default` is written `0.0.0.0/0`.
    pub dst: String,
    pub gateway: Option<String>,
    pub dev: Option<String>,
}

/// Links and routes of the node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Current {
    pub links: Vec<Link>,
    pub routes: Vec<RouteEntry>,
}

impl Current {
    /// The link named `name`.
    pub fn link(&self, name: &str) -> Option<&Link> {
        self.links.iter().find(|l| l.name == name)
    }

    /// The ports (links whose master is `name`), in name order.
    pub fn ports_of(&self, name: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .links
            .iter()
            .filter(|l| l.master.as_deref() == Some(name))
            .map(|l| l.name.clone())
            .collect();
        v.sort();
        v
    }

    /// nmstate's `currentState` shape: interfaces (name, type, state, mac-address, mtu, ipv4,
    /// bridge ports, vlan, link-aggregation), routes (`running`, `config`: the agent keeps no
    /// separate configured list, so both are the kernel's main table), plus what the caller
    /// adds (dns-resolver, ovn).
    pub fn to_nmstate(&self) -> Value {
        let interfaces: Vec<Value> = self
            .links
            .iter()
            .map(|l| {
                let mut i = json!({
                    "name": l.name, "type": l.kind,
                    "state": if l.up { "up" } else { "down" },
                    "mac-address": l.mac, "mtu": l.mtu,
                    "ipv4": {
                        "enabled": !l.addrs.is_empty(),
                        "address": l.addrs.iter()
                            .map(|(ip, p)| json!({"ip": ip, "prefix-length": p}))
                            .collect::<Vec<_>>(),
                    },
                });
                if l.kind == "linux-bridge" {
                    i["bridge"] = json!({
                        "options": {"stp": {"enabled": l.stp.unwrap_or(false)}},
                        "port": self.ports_of(&l.name).iter()
                            .map(|p| json!({"name": p})).collect::<Vec<_>>(),
                    });
                }
                if let Some((base, id)) = &l.vlan {
                    i["vlan"] = json!({"base-iface": base, "id": id});
                }
                if l.kind == "bond" {
                    i["link-aggregation"] = json!({
                        "mode": l.bond_mode.clone().unwrap_or_default(),
                        "port": self.ports_of(&l.name),
                    });
                }
                if let Some(m) = &l.master {
                    i["controller"] = json!(m);
                }
                i
            })
            .collect();
        let routes: Vec<Value> = self
            .routes
            .iter()
            .map(|r| {
                let mut v = json!({"destination": r.dst});
                if let Some(g) = &r.gateway {
                    v["next-hop-address"] = json!(g);
                }
                if let Some(d) = &r.dev {
                    v["next-hop-interface"] = json!(d);
                }
                v
            })
            .collect();
        json!({"interfaces": interfaces, "routes": {"running": routes.clone(), "config": routes}})
    }
}

fn kind_of(link: &Value) -> String {
    let info = link["linkinfo"]["info_kind"].as_str();
    match info {
        Some("bridge") => "linux-bridge".into(),
        Some("vlan") => "vlan".into(),
        Some("bond") => "bond".into(),
        Some(k) => k.to_string(),
        None => match link["link_type"].as_str() {
            Some("loopback") => "loopback".into(),
            Some("ether") => "ethernet".into(),
            Some(t) => t.to_string(),
            None => "unknown".into(),
        },
    }
}

/// Links from `ip -j -d addr show` (pure).
pub fn parse_links(text: &str) -> Result<Vec<Link>, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("ip -j addr: {e}"))?;
    let mut out = Vec::new();
    for l in v.as_array().into_iter().flatten() {
        let Some(name) = l["ifname"].as_str() else {
            continue;
        };
        let data = &l["linkinfo"]["info_data"];
        let kind = kind_of(l);
        let addrs = l["addr_info"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["family"] == "inet")
            .filter_map(|a| Some((a["local"].as_str()?.to_string(), a["prefixlen"].as_i64()?)))
            .collect();
        out.push(Link {
            name: name.to_string(),
            up: l["flags"]
                .as_array()
                .is_some_and(|f| f.iter().any(|x| x == "UP")),
            mac: l["address"].as_str().unwrap_or_default().to_string(),
            mtu: l["mtu"].as_u64().unwrap_or(0) as u32,
            master: l["master"].as_str().map(String::from),
            vlan: (kind == "vlan").then(|| {
                (
                    l["link"].as_str().unwrap_or_default().to_string(),
                    data["id"].as_i64().unwrap_or(0),
                )
            }),
            bond_mode: (kind == "bond")
                .then(|| data["mode"].as_str().map(String::from))
                .flatten(),
            stp: (kind == "linux-bridge")
                .then(|| data["stp_state"].as_i64().map(|s| s != 0))
                .flatten(),
            kind,
            addrs,
        });
    }
    Ok(out)
}

/// Routes from `ip -j -4 route show table main` (pure).
pub fn parse_routes(text: &str) -> Result<Vec<RouteEntry>, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("ip -j route: {e}"))?;
    Ok(v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| {
            let dst = r["dst"].as_str()?;
            let dst = match dst {
                "default" => "0.0.0.0/0".to_string(),
                d if d.contains('/') => d.to_string(),
                d => format!("{d}/32"),
            };
            Some(RouteEntry {
                dst,
                gateway: r["gateway"].as_str().map(String::from),
                dev: r["dev"].as_str().map(String::from),
            })
        })
        .collect())
}
