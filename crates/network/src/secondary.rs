//! Secondary networks (pure): the bridge CNI configuration of a Multus
//! NetworkAttachmentDefinition (`spec.config`), and per VMI interface on such a network a
//! [`SecondaryPlan`]: a veth from the named host bridge in the node namespace (an access port
//! of the configured VLAN, with `vlan_filtering` on that bridge) into the VMI namespace, where
//! it shares an in-namespace bridge with the tap QEMU opens. No addresses and no DHCP: the
//! guest configures the interface itself (the `ipam` section is ignored) — except for a
//! Localnet with IPAM ([`crate::localnet`]), whose plan carries the lease a DHCP server on
//! the in-namespace bridge offers.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::ipam::MacAddr;
use crate::plan::{NodeNetwork, check_ifname};
use crate::render::{Action, add_veth_pair, ip, strs};

/// What a bridge CNI configuration asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BridgeConfig {
    /// The host bridge (CNI's default: `cni0`).
    pub bridge: String,
    /// Access VLAN of the VMI's port (untagged inside the guest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vlan: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u16>,
}

fn bad(reason: impl Into<String>) -> Error {
    Error::InvalidNetworkConfig(reason.into())
}

/// Parses a CNI network configuration (a single plugin, or a `plugins` list whose `bridge`
/// plugin is used). Only `"type": "bridge"` is supported.
pub fn parse_cni_config(text: &str) -> Result<BridgeConfig> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| bad(format!("spec.config is not JSON: {e}")))?;
    let plugin = match v.get("plugins").and_then(Value::as_array) {
        Some(list) => list
            .iter()
            .find(|p| p.get("type").and_then(Value::as_str) == Some("bridge"))
            .ok_or_else(|| bad("spec.config.plugins has no plugin of type \"bridge\""))?,
        None => &v,
    };
    match plugin.get("type").and_then(Value::as_str) {
        Some("bridge") => {}
        Some(other) => {
            return Err(bad(format!(
                "spec.config.type {other:?} is not supported (only \"bridge\")"
            )));
        }
        None => return Err(bad("spec.config.type is missing")),
    }
    let bridge = match plugin.get("bridge") {
        None => "cni0".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(bad("spec.config.bridge must be a string")),
    };
    check_ifname(&bridge).map_err(|e| bad(format!("spec.config.bridge: {e}")))?;
    let vlan = match plugin.get("vlan") {
        None | Some(Value::Null) => None,
        Some(x) => match x.as_u64() {
            Some(0) => None,
            Some(n @ 1..=4094) => Some(n as u16),
            _ => {
                return Err(bad(format!(
                    "spec.config.vlan {x} is not a VLAN id (1-4094)"
                )));
            }
        },
    };
    let mtu = match plugin.get("mtu") {
        None | Some(Value::Null) => None,
        Some(x) => match x.as_u64() {
            Some(n @ 576..=65535) => Some(n as u16),
            _ => return Err(bad(format!("spec.config.mtu {x} is not a usable MTU"))),
        },
    };
    Ok(BridgeConfig { bridge, vlan, mtu })
}

/// One VMI interface on a secondary bridge network.
#[derive(Debug, Clone)]
pub struct SecondaryRequest {
    pub uid: String,
    /// The interface (and network) name in the VMI spec.
    pub interface: String,
    /// The NetworkAttachmentDefinition, `namespace/name`.
    pub nad: String,
    pub config: BridgeConfig,
    /// 1 for the first secondary interface of the VMI, 2 for the next… (`net1`, `tap1`).
    pub index: u32,
    pub mac: MacAddr,
    /// Queue pairs of the guest NIC; more than 1 makes a multi-queue tap.
    pub queues: u32,
}

/// Everything to create for one secondary interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SecondaryPlan {
    /// The VMI's network namespace.
    pub netns: String,
    /// The node's namespace (where the host bridge is); `None`: the agent's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_netns: Option<String>,
    pub interface: String,
    pub nad: String,
    /// The host bridge the veth is a port of.
    pub bridge: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vlan: Option<u16>,
    /// Node end of the veth (a port of `bridge`).
    pub host_veth: String,
    /// VMI-namespace end (`net<index>`).
    pub pod_veth: String,
    /// Bridge in the VMI namespace (`k6t-net<index>`).
    pub pod_bridge: String,
    /// The tap QEMU opens (`tap<index>`).
    pub tap: String,
    /// Queue pairs of the tap; more than 1: created `multi_queue`.
    #[serde(
        default = "crate::plan::one_queue",
        skip_serializing_if = "crate::plan::is_one_queue"
    )]
    pub queues: u32,
    pub mac: MacAddr,
    pub mtu: u16,
    /// The address a DHCP server offers the guest on this interface (a Localnet with IPAM);
    /// `None`: the guest configures the interface itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<crate::dhcp::LeaseConfig>,
    /// On a Secondary Layer2 user-defined network: the network (its namespace is
    /// `node_netns`, its bridge `bridge`), made before the interface and kept while a plan
    /// names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udn: Option<crate::udn::UdnNetwork>,
}

impl SecondaryPlan {
    pub fn build(node: &NodeNetwork, req: &SecondaryRequest) -> Result<SecondaryPlan> {
        if req.uid.is_empty() || req.uid.contains('/') || req.uid.contains(char::is_whitespace) {
            return Err(Error::InvalidPlan(format!("invalid VMI uid {:?}", req.uid)));
        }
        if req.index == 0 || req.index > 999 {
            return Err(Error::InvalidPlan(format!(
                "secondary interface index {} is out of range",
                req.index
            )));
        }
        let host_veth = format!(
            "{}{}",
            node.veth_prefix,
            crate::plan::hash_hex(&format!("{}/{}", req.uid, req.interface))
        );
        check_ifname(&host_veth)?;
        Ok(SecondaryPlan {
            netns: format!("{}{}", node.netns_prefix, req.uid),
            node_netns: node.netns.clone(),
            interface: req.interface.clone(),
            nad: req.nad.clone(),
            bridge: req.config.bridge.clone(),
            vlan: req.config.vlan,
            host_veth,
            pod_veth: format!("net{}", req.index),
            pod_bridge: format!("k6t-net{}", req.index),
            tap: format!("tap{}", req.index),
            queues: req.queues.max(1),
            mac: req.mac,
            mtu: req.config.mtu.unwrap_or(node.mtu),
            lease: None,
            udn: None,
        })
    }
}

/// Turns on VLAN filtering on the plan's host bridge (needs a kernel with
/// CONFIG_BRIDGE_VLAN_FILTERING).
pub fn vlan_filtering_action(plan: &SecondaryPlan) -> Action {
    ip(
        &plan.node_netns,
        &[
            "link",
            "set",
            &plan.bridge,
            "type",
            "bridge",
            "vlan_filtering",
            "1",
        ],
    )
}

/// The VMI namespace's `bridge` table of one secondary interface (`fv-sec<k>`): nothing from
/// the host bridge's side (`net<k>`) is delivered to the namespace itself (its addresses — the
/// DHCP server's, a masquerade pod interface's — stay unreachable from the secondary network,
/// ARP included); with a lease, DHCP stays between the guest and its own server (the guest's
/// requests never reach the network, foreign offers never reach the guest, the server's
/// answers never leave for the network), as the bridge binding's filter does.
pub fn secondary_nft_script(plan: &SecondaryPlan) -> String {
    let (veth, tap) = (&plan.pod_veth, &plan.tap);
    let mut body = format!(
        "  chain input {{\n    type filter hook input priority 0; policy accept;\n    \
         iifname \"{veth}\" drop\n  }}\n"
    );
    if plan.lease.is_some() {
        body.push_str(&format!(
            "  chain forward {{\n    type filter hook forward priority 0; policy accept;\n    \
             iifname \"{tap}\" oifname \"{veth}\" udp dport 67 drop\n    \
             iifname \"{veth}\" oifname \"{tap}\" udp sport 67 drop\n  }}\n  \
             chain output {{\n    type filter hook output priority 0; policy accept;\n    \
             oifname \"{veth}\" udp sport 67 drop\n  }}\n"
        ));
    }
    let table = format!("fv-sec{}", plan.pod_veth.trim_start_matches("net"));
    crate::render::replace_table("bridge", &table, &body)
}

/// Steps that create (or repair) one secondary interface. The host bridge must exist
/// ([`crate::pod::setup_secondary`] checks it first).
pub fn secondary_actions(plan: &SecondaryPlan) -> Vec<Action> {
    let node_ns = &plan.node_netns;
    let pod = Some(plan.netns.clone());
    let mtu = plan.mtu.to_string();
    let (hv, veth, br, tap) = (
        plan.host_veth.as_str(),
        plan.pod_veth.as_str(),
        plan.pod_bridge.as_str(),
        plan.tap.as_str(),
    );
    let mut a = vec![
        Action::AddNetns(plan.netns.clone()),
        ip(&pod, &["link", "set", "lo", "up"]),
        // Before the links: the rules name interfaces, and nothing is up before its filter.
        Action::Nft {
            netns: pod.clone(),
            script: secondary_nft_script(plan),
        },
        add_veth_pair(node_ns, hv, veth, &plan.netns, &mtu),
        ip(
            node_ns,
            &["link", "set", hv, "master", &plan.bridge, "mtu", &mtu, "up"],
        ),
    ];
    if let Some(vlan) = plan.vlan {
        let vid = vlan.to_string();
        a.extend([
            vlan_filtering_action(plan),
            Action::Bridge {
                netns: node_ns.clone(),
                args: strs(&["vlan", "add", "vid", &vid, "pvid", "untagged", "dev", hv]),
                tolerate_failure: false,
            },
        ]);
        if vlan != 1 {
            // Ports join the default VLAN 1 when added; an access port belongs to one VLAN.
            a.push(Action::Bridge {
                netns: node_ns.clone(),
                args: strs(&["vlan", "del", "vid", "1", "dev", hv]),
                tolerate_failure: true,
            });
        }
    }
    a.extend([
        Action::AddLink {
            netns: pod.clone(),
            name: br.into(),
            args: strs(&["link", "add", br, "type", "bridge"]),
        },
        Action::AddLink {
            netns: pod.clone(),
            name: tap.into(),
            args: crate::render::tuntap_add_args(tap, plan.queues),
        },
        ip(&pod, &["link", "set", tap, "master", br, "mtu", &mtu, "up"]),
        ip(
            &pod,
            &["link", "set", veth, "master", br, "mtu", &mtu, "up"],
        ),
        ip(&pod, &["link", "set", br, "mtu", &mtu, "up"]),
    ]);
    if let Some(l) = &plan.lease {
        // The DHCP server's address (as the bridge binding's), on the VMI-side bridge.
        let addr = format!("{}/32", l.server_id);
        a.push(ip(&pod, &["addr", "replace", &addr, "dev", br]));
    }
    a
}

/// Steps that remove one secondary interface: the host end of its veth (the peer goes with
/// it). The VMI namespace itself is removed with the VMI ([`crate::pod::teardown_netns`]).
pub fn secondary_teardown_actions(plan: &SecondaryPlan) -> Vec<Action> {
    vec![Action::DelLink {
        netns: plan.node_netns.clone(),
        name: plan.host_veth.clone(),
    }]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipam::Ipam;

    fn node() -> NodeNetwork {
        let ipam = Ipam::default();
        let mut n = NodeNetwork::new(ipam, ipam.node_subnet(1).unwrap());
        n.netns = Some("node-a".into());
        n
    }

    fn req(config: BridgeConfig) -> SecondaryRequest {
        SecondaryRequest {
            uid: "uid-1".into(),
            interface: "sec".into(),
            nad: "default/br-test".into(),
            config,
            index: 1,
            mac: "02:00:00:00:00:01".parse().unwrap(),
            queues: 1,
        }
    }

    #[test]
    fn multi_queue_secondary_tap() {
        let mut r = req(BridgeConfig {
            bridge: "br-test".into(),
            vlan: None,
            mtu: None,
        });
        r.queues = 4;
        let p = SecondaryPlan::build(&node(), &r).unwrap();
        assert_eq!(p.queues, 4);
        let a: Vec<String> = secondary_actions(&p).iter().map(render).collect();
        assert!(
            a.contains(&"ip -n fv-uid-1 tuntap add dev tap1 mode tap multi_queue".to_string()),
            "{a:?}"
        );
        // A plan recorded before queues existed reads back as one queue.
        let mut v = serde_json::to_value(&p).unwrap();
        v.as_object_mut().unwrap().remove("queues");
        let old: SecondaryPlan = serde_json::from_value(v).unwrap();
        assert_eq!(old.queues, 1);
    }

    fn render(a: &Action) -> String {
        a.command_line()
    }

    #[test]
    fn a_lease_puts_the_dhcp_address_on_the_vmi_side_bridge() {
        let mut p = SecondaryPlan::build(
            &node(),
            &req(BridgeConfig {
                bridge: "br-ext".into(),
                vlan: None,
                mtu: Some(1400),
            }),
        )
        .unwrap();
        let without: Vec<String> = secondary_actions(&p).iter().map(render).collect();
        assert!(!without.iter().any(|a| a.contains("addr")), "{without:?}");
        // Without a lease only the input filter; the guest's DHCP may use the network's.
        let nft = secondary_nft_script(&p);
        assert!(nft.contains("table bridge fv-sec1 {"), "{nft}");
        assert!(nft.contains("hook input") && nft.contains("iifname \"net1\" drop"));
        assert!(!nft.contains("udp"), "{nft}");
        let subnet: crate::Ipv4Cidr = "10.77.0.0/24".parse().unwrap();
        p.lease = Some(crate::localnet::lease(
            "10.77.0.5".parse().unwrap(),
            subnet,
            p.mac,
            p.mtu,
            "vm",
        ));
        let with: Vec<String> = secondary_actions(&p).iter().map(render).collect();
        assert_eq!(
            with.last().unwrap(),
            "ip -n fv-uid-1 addr replace 169.254.75.10/32 dev k6t-net1"
        );
        let nft = secondary_nft_script(&p);
        assert!(
            nft.contains("iifname \"tap1\" oifname \"net1\" udp dport 67 drop")
                && nft.contains("iifname \"net1\" oifname \"tap1\" udp sport 67 drop")
                && nft.contains("oifname \"net1\" udp sport 67 drop"),
            "{nft}"
        );
        // The plan (with its lease) reads back as written.
        let back: SecondaryPlan =
            serde_json::from_value(serde_json::to_value(&p).unwrap()).unwrap();
        assert_eq!(back, p);
    }

    #[test]
    fn parses_bridge_configs() {
        let c = parse_cni_config(
            r#"{"cniVersion":"0.3.1","type":"bridge","bridge":"br-test","vlan":100,"ipam":{}}"#,
        )
        .unwrap();
        assert_eq!(
            c,
            BridgeConfig {
                bridge: "br-test".into(),
                vlan: Some(100),
                mtu: None
            }
        );
        let c = parse_cni_config(
            r#"{"cniVersion":"0.4.0","name":"x","plugins":[{"type":"bridge","bridge":"br1","mtu":9000},{"type":"tuning"}]}"#,
        )
        .unwrap();
        assert_eq!(
            (c.bridge.as_str(), c.vlan, c.mtu),
            ("br1", None, Some(9000))
        );
        assert_eq!(
            parse_cni_config(r#"{"type":"bridge"}"#).unwrap().bridge,
            "cni0"
        );
    }

    #[test]
    fn rejects_what_it_cannot_do_naming_the_field() {
        for (cfg, needle) in [
            ("nope", "spec.config is not JSON"),
            (
                r#"{"type":"macvlan","master":"eth0"}"#,
                "spec.config.type \"macvlan\"",
            ),
            (r#"{"bridge":"br0"}"#, "spec.config.type is missing"),
            (r#"{"type":"bridge","vlan":5000}"#, "spec.config.vlan 5000"),
            (
                r#"{"type":"bridge","bridge":"a-much-too-long-name"}"#,
                "spec.config.bridge",
            ),
            (r#"{"plugins":[{"type":"tuning"}]}"#, "no plugin of type"),
        ] {
            let e = parse_cni_config(cfg).unwrap_err().to_string();
            assert!(e.contains(needle), "{cfg}: {e}");
        }
    }

    #[test]
    fn plan_and_actions_with_a_vlan() {
        let p = SecondaryPlan::build(
            &node(),
            &req(BridgeConfig {
                bridge: "br-test".into(),
                vlan: Some(100),
                mtu: None,
            }),
        )
        .unwrap();
        assert_eq!(p.netns, "fv-uid-1");
        assert_eq!((p.pod_veth.as_str(), p.tap.as_str()), ("net1", "tap1"));
        assert!(p.host_veth.starts_with("fv") && p.host_veth.len() == 12);
        let hv = &p.host_veth;
        let a: Vec<String> = secondary_actions(&p).iter().map(render).collect();
        let expect = [
            "AddNetns(\"fv-uid-1\")".to_string(),
            "ip -n fv-uid-1 link set lo up".into(),
            render(&Action::Nft {
                netns: Some("fv-uid-1".into()),
                script: secondary_nft_script(&p),
            }),
            format!("ip -n node-a link add {hv} mtu 1500 type veth peer name net1 netns fv-uid-1"),
            format!("ip -n node-a link set {hv} master br-test mtu 1500 up"),
            "ip -n node-a link set br-test type bridge vlan_filtering 1".into(),
            format!("bridge -n node-a vlan add vid 100 pvid untagged dev {hv}"),
            format!("bridge -n node-a vlan del vid 1 dev {hv}"),
            "ip -n fv-uid-1 link add k6t-net1 type bridge".into(),
            "ip -n fv-uid-1 tuntap add dev tap1 mode tap".into(),
            "ip -n fv-uid-1 link set tap1 master k6t-net1 mtu 1500 up".into(),
            "ip -n fv-uid-1 link set net1 master k6t-net1 mtu 1500 up".into(),
            "ip -n fv-uid-1 link set k6t-net1 mtu 1500 up".into(),
        ];
        assert_eq!(a, expect);
        let t = secondary_teardown_actions(&p);
        assert_eq!(
            t,
            vec![Action::DelLink {
                netns: Some("node-a".into()),
                name: hv.clone()
            }]
        );
        // Without a VLAN the bridge is left as it is.
        let p = SecondaryPlan::build(
            &node(),
            &req(BridgeConfig {
                bridge: "br-test".into(),
                vlan: None,
                mtu: None,
            }),
        )
        .unwrap();
        assert!(
            !secondary_actions(&p)
                .iter()
                .map(render)
                .any(|c| c.contains("vlan"))
        );
    }
}
