//! Addresses and VXLAN identifiers of user-defined networks (pure decisions; the I/O is in
//! [`super::run`]). OVN-Kubernetes allocates a workload's address on a network with IPAM
//! centrally and hands it to the node in the pod's `k8s.ovn.org/pod-networks` annotation; with
//! `ipam.lifecycle: Persistent` the allocation of a VM's interface lives in an IPAMClaim
//! (`k8s.cni.cncf.io/v1alpha1`, named `<vm>.<network name in the VM>`, owned by the VM), so a
//! restarted VM — a new VMI — and a migrated one keep it. Here the controller, the one leader
//! that sees every network, VMI and claim, decides the same: [`decide`] turns networks, VMIs,
//! claims and the allocations it wrote itself (not yet in its caches) into claim and annotation
//! writes. An address is picked from a hash of the VMI's namespace and name, probing upwards
//! past addresses in use, so a decision repeated on stale caches lands on the same address.
//! [`pick_vni`] chooses a network's VNI the same way.
//!
//! Reserved in every subnet: the network and broadcast addresses (IPv4 up to /30), the
//! `excludeSubnets` (Localnet), and for Layer2 the first usable address, the network's gateway
//! (reported to Primary users in `gateway_ips`).
//!
//! Layer3 networks are split into per-node host subnets, as OVN-K's cluster manager does:
//! [`node_subnets`] gives every node one host subnet of each Layer3 network (the `hostSubnet`
//! prefix, default /24 and /64; hashed from the node name, probing past the other nodes'),
//! kept in the Node annotation `k8s.ovn.org/node-subnets`; a VMI on a Layer3 network gets its
//! address once it is bound to a node, from that node's host subnet, whose first address is
//! the node's gateway on the network.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;

use ferrovirt_api::kubevirt::vmi::{VirtualMachineInstance, VmiPhase};
use ferrovirt_api::network::IPAMClaim;
use ferrovirt_api::udn::{self, MAX_VNI, MIN_VNI, NetworkConfig, PodNetwork, Role};

/// One user-defined network with IPAM, as the allocator sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Network {
    /// The network name of its NAD config (`ns_udn`, `cluster_udn_x`); IPAMClaims name it.
    pub network: String,
    /// The NAD's name (the UDN's or CUDN's name).
    pub nad_name: String,
    /// The namespaces holding its NAD (a UDN's own; a CUDN's selected ones).
    pub namespaces: BTreeSet<String>,
    pub role: Role,
    pub subnets: Vec<IpNet>,
    pub exclude: Vec<IpNet>,
    /// Layer2: the first usable address of each subnet is the gateway, never handed out.
    pub gateway: bool,
    /// `ipam.lifecycle: Persistent`: VM interfaces keep their addresses in IPAMClaims.
    pub persistent: bool,
    /// Layer3: the prefix length of a node's host subnet, one per entry of `subnets`;
    /// empty for the other topologies.
    pub host_prefixes: Vec<u8>,
}

impl Network {
    /// The allocator's view of a network, None when it assigns no addresses (Layer3, IPAM
    /// disabled, no subnets) or a subnet does not parse (admission refuses that).
    pub fn from_config(
        network: String,
        nad_name: String,
        namespaces: BTreeSet<String>,
        cfg: NetworkConfig,
    ) -> Option<Network> {
        if let NetworkConfig::Layer3(l3) = cfg {
            let mut subnets = Vec::new();
            let mut host_prefixes = Vec::new();
            for s in l3.subnets.iter().flatten() {
                let net: IpNet = s.cidr.as_deref()?.parse().ok()?;
                let default = if net.addr().is_ipv4() { 24 } else { 64 };
                let host = s
                    .host_subnet
                    .map_or(Some(default), |h| u8::try_from(h).ok())?;
                if host <= net.prefix_len() || host > net.max_prefix_len() {
                    return None;
                }
                subnets.push(net);
                host_prefixes.push(host);
            }
            if subnets.is_empty() {
                return None;
            }
            return Some(Network {
                network,
                nad_name,
                namespaces,
                role: cfg.role().unwrap_or(Role::Secondary),
                subnets,
                exclude: Vec::new(),
                gateway: true,
                persistent: false,
                host_prefixes,
            });
        }
        if cfg
            .ipam()
            .is_some_and(|i| i.mode == Some(udn::IpamMode::Disabled))
        {
            return None;
        }
        let subnets: Vec<IpNet> = cfg
            .subnets()
            .iter()
            .map(|s| s.parse().ok())
            .collect::<Option<_>>()?;
        if subnets.is_empty() {
            return None;
        }
        let exclude = match cfg {
            NetworkConfig::Localnet(l) => l
                .exclude_subnets
                .iter()
                .flatten()
                .filter_map(|s| s.parse().ok())
                .collect(),
            _ => Vec::new(),
        };
        Some(Network {
            network,
            nad_name,
            namespaces,
            role: cfg.role().unwrap_or(Role::Secondary),
            subnets,
            exclude,
            gateway: matches!(cfg, NetworkConfig::Layer2(_)),
            persistent: cfg.persistent_ips(),
            host_prefixes: Vec::new(),
        })
    }

    fn key(&self, ns: &str) -> String {
        format!("{ns}/{}", self.nad_name)
    }

    /// Whether the network is split into per-node host subnets (Layer3).
    pub fn layer3(&self) -> bool {
        !self.host_prefixes.is_empty()
    }

    /// The gateways of a Primary Layer2 network (first usable address of each subnet).
    pub fn gateways(&self) -> Vec<String> {
        self.gateways_in(&self.subnets)
    }

    /// The gateways of a Primary network in `subnets` (a Layer3 node's host subnets).
    fn gateways_in(&self, subnets: &[IpNet]) -> Vec<String> {
        if !self.gateway || self.role != Role::Primary {
            return Vec::new();
        }
        subnets
            .iter()
            .filter_map(|s| first_usable(s).map(|a| a.to_string()))
            .collect()
    }

    /// Where a VMI on this network takes its addresses: the network's subnets, or (Layer3)
    /// its node's host subnets; None while a Layer3 VMI has no node or the node no subnet yet.
    fn subnets_for(
        &self,
        vmi: &VirtualMachineInstance,
        node_subnets: &BTreeMap<String, NodeSubnets>,
    ) -> Option<Vec<IpNet>> {
        if !self.layer3() {
            return Some(self.subnets.clone());
        }
        let node = vmi.status.as_ref()?.node_name.as_deref()?;
        let mine = node_subnets.get(node)?.get(&self.network)?;
        let parsed: Vec<IpNet> = mine.iter().filter_map(|s| s.parse().ok()).collect();
        (!parsed.is_empty()).then_some(parsed)
    }

    fn reserved(&self, subnet: &IpNet, a: IpAddr) -> bool {
        (self.gateway && first_usable(subnet) == Some(a))
            || self.exclude.iter().any(|x| x.contains(&a))
    }
}

/// A write the allocator wants.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Create the IPAMClaim `namespace/name` owned by the VM, then write `status.ips`.
    CreateClaim {
        namespace: String,
        name: String,
        vm_name: String,
        vm_uid: String,
        network: String,
        interface: String,
        ips: Vec<String>,
    },
    /// Write `status.ips` of an existing claim that has none.
    ClaimStatus {
        namespace: String,
        name: String,
        ips: Vec<String>,
    },
    /// Write the VMI's whole [`udn::POD_NETWORKS_ANNOTATION`] (precondition: its
    /// resourceVersion); `added` are the keys this decision allocated.
    Annotate {
        namespace: String,
        name: String,
        uid: String,
        resource_version: Option<String>,
        value: BTreeMap<String, PodNetwork>,
        added: Vec<String>,
    },
    /// No address could be given: a Warning Event on the VMI.
    Failed {
        namespace: String,
        name: String,
        message: String,
    },
}

/// What [`decide`] reads.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    pub networks: &'a [Network],
    /// Namespaces labelled `k8s.ovn.org/primary-user-defined-network`.
    pub primary_namespaces: &'a BTreeSet<String>,
    pub vmis: &'a [&'a VirtualMachineInstance],
    pub claims: &'a [&'a IPAMClaim],
    /// Allocations written by this controller that its VMI cache may not show yet, by
    /// (VMI uid, annotation key).
    pub recent: &'a BTreeMap<(String, String), PodNetwork>,
    /// Each node's Layer3 host subnets (its annotation, with this pass's decisions).
    pub node_subnets: &'a BTreeMap<String, NodeSubnets>,
}

/// One node's `k8s.ovn.org/node-subnets`: network name → host subnets.
pub type NodeSubnets = BTreeMap<String, Vec<String>>;

/// The node annotations to write so that every node has one host subnet of each Layer3
/// network in each of its subnets (pure). `current` is every node's annotation (nodes
/// without one map to an empty map); entries are kept while they lie in the network's
/// subnets with the right prefix and no earlier node (name order) holds the same one;
/// entries of networks not in `known` (no such UDN/CUDN any more) are dropped. Returns the
/// nodes whose annotation changes, with the whole new value. None for a network whose host
/// subnets ran out on some node (that node gets no entry; the others keep theirs).
pub fn node_subnets(
    networks: &[Network],
    known: &BTreeSet<String>,
    current: &BTreeMap<String, NodeSubnets>,
) -> BTreeMap<String, NodeSubnets> {
    let mut next: BTreeMap<String, NodeSubnets> = current
        .iter()
        .map(|(node, m)| {
            let kept: NodeSubnets = m
                .iter()
                .filter(|(net, _)| known.contains(*net))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            (node.clone(), kept)
        })
        .collect();
    for n in networks.iter().filter(|n| n.layer3()) {
        let mut taken: BTreeSet<IpNet> = BTreeSet::new();
        // First pass: keep valid, unique entries, in node name order.
        let mut needs = Vec::new();
        for (node, m) in next.iter_mut() {
            let valid = m.get(&n.network).and_then(|have| {
                let parsed: Vec<IpNet> = have.iter().filter_map(|s| s.parse().ok()).collect();
                let ok =
                    parsed.len() == n.subnets.len()
                        && parsed.iter().zip(&n.subnets).zip(&n.host_prefixes).all(
                            |((h, c), p)| {
                                h.prefix_len() == *p && c.contains(h) && !taken.contains(h)
                            },
                        );
                ok.then_some(parsed)
            });
            match valid {
                Some(parsed) => taken.extend(parsed),
                None => {
                    m.remove(&n.network);
                    needs.push(node.clone());
                }
            }
        }
        for node in needs {
            let mut mine = Vec::new();
            for (cidr, prefix) in n.subnets.iter().zip(&n.host_prefixes) {
                match host_subnet(cidr, *prefix, &node, &taken) {
                    Some(h) => mine.push(h),
                    None => break,
                }
            }
            if mine.len() == n.subnets.len() {
                taken.extend(mine.iter().copied());
                if let Some(m) = next.get_mut(&node) {
                    m.insert(
                        n.network.clone(),
                        mine.iter().map(|h| h.to_string()).collect(),
                    );
                }
            }
        }
    }
    next.into_iter()
        .filter(|(node, m)| current.get(node) != Some(m))
        .collect()
}

/// A host subnet of `cidr` with `prefix` for `node`: hashed from the node name, probing past
/// `taken` (at most 65,536 tries).
fn host_subnet(cidr: &IpNet, prefix: u8, node: &str, taken: &BTreeSet<IpNet>) -> Option<IpNet> {
    let bits = u32::from(prefix - cidr.prefix_len());
    let count: u128 = if bits >= 127 {
        u128::MAX
    } else {
        1u128 << bits
    };
    let step_bits = u32::from(cidr.max_prefix_len() - prefix);
    let base = match cidr {
        IpNet::V4(n) => u128::from(u32::from(n.network())),
        IpNet::V6(n) => u128::from(n.network()),
    };
    let start = u128::from(fnv1a(node)) % count;
    (0..count.min(65_536))
        .map(|i| {
            let idx = (start + i) % count;
            let addr = base + (idx << step_bits);
            IpNet::new(to_addr(cidr, addr), prefix).ok()
        })
        .find(|h| h.is_some_and(|h| !taken.contains(&h)))
        .flatten()
}

/// The claim and annotation writes that give every VMI on a network with IPAM its addresses.
pub fn decide(inp: Inputs) -> Vec<Action> {
    let mut used: BTreeMap<&str, BTreeSet<IpAddr>> = BTreeMap::new();
    let net_of_key = |key: &str| -> Option<&Network> {
        let (ns, name) = key.split_once('/')?;
        inp.networks
            .iter()
            .find(|n| n.nad_name == name && n.namespaces.contains(ns))
    };
    for v in inp.vmis {
        for (key, pn) in udn::pod_networks(v.metadata.annotations.as_ref()) {
            if let Some(n) = net_of_key(&key) {
                used.entry(&n.network)
                    .or_default()
                    .extend(addresses(&pn.ip_addresses));
            }
        }
    }
    for c in inp.claims {
        let Some(net) = c.spec.as_ref().and_then(|s| s.network.as_deref()) else {
            continue;
        };
        if let Some(n) = inp.networks.iter().find(|n| n.network == net) {
            used.entry(&n.network)
                .or_default()
                .extend(addresses(claim_ips(c)));
        }
    }
    for ((_, key), pn) in inp.recent {
        if let Some(n) = net_of_key(key) {
            used.entry(&n.network)
                .or_default()
                .extend(addresses(&pn.ip_addresses));
        }
    }

    let mut vmis: Vec<&&VirtualMachineInstance> = inp.vmis.iter().collect();
    vmis.sort_by_key(|v| (v.metadata.namespace.clone(), v.metadata.name.clone()));
    let mut out = Vec::new();
    for v in vmis {
        if v.metadata.deletion_timestamp.is_some() || finished(v) {
            continue;
        }
        let ns = v.metadata.namespace.as_deref().unwrap_or("default");
        let name = v.metadata.name.as_deref().unwrap_or_default();
        let uid = v.metadata.uid.as_deref().unwrap_or_default();
        let current = udn::pod_networks(v.metadata.annotations.as_ref());
        let mut value = current.clone();
        let mut added = Vec::new();
        for (iface, nad_ns, n) in wanted(v, ns, &inp) {
            let key = n.key(&nad_ns);
            if current.contains_key(&key) {
                continue;
            }
            let Some(subnets) = n.subnets_for(v, inp.node_subnets) else {
                // Layer3: not bound to a node yet, or the node has no host subnet yet.
                continue;
            };
            let gateway_ips = n.gateways_in(&subnets);
            let role = match n.role {
                Role::Primary => "primary",
                Role::Secondary => "secondary",
            };
            let entry = |ips: Vec<String>| PodNetwork {
                ip_addresses: ips,
                gateway_ips: gateway_ips.clone(),
                role: role.into(),
            };
            if let Some(pn) = inp.recent.get(&(uid.to_string(), key.clone())) {
                value.insert(key.clone(), pn.clone());
                continue;
            }
            let used_here = used.entry(&n.network).or_default();
            let vm = owner_vm(v).filter(|_| n.persistent);
            let claim_name = vm.map(|(vm, _)| format!("{vm}.{iface}"));
            let claim = claim_name.as_ref().and_then(|c| {
                inp.claims.iter().find(|x| {
                    x.metadata.namespace.as_deref() == Some(ns)
                        && x.metadata.name.as_deref() == Some(c.as_str())
                })
            });
            if let Some(c) = claim {
                let claimed_for = c.spec.as_ref().and_then(|s| s.network.as_deref());
                if claimed_for != Some(n.network.as_str()) {
                    out.push(Action::Failed {
                        namespace: ns.into(),
                        name: name.into(),
                        message: format!(
                            "IPAMClaim {ns}/{} is for network {:?}, not {}",
                            claim_name.as_deref().unwrap_or_default(),
                            claimed_for.unwrap_or_default(),
                            n.network
                        ),
                    });
                    continue;
                }
                let ips = claim_ips(c);
                if !ips.is_empty() {
                    value.insert(key.clone(), entry(ips.to_vec()));
                    added.push(key);
                    continue;
                }
            }
            let Some(ips) = allocate_in(n, &subnets, &format!("{ns}/{name}"), used_here) else {
                out.push(Action::Failed {
                    namespace: ns.into(),
                    name: name.into(),
                    message: format!(
                        "network {} ({key}): no free address left in {}",
                        n.network,
                        subnets
                            .iter()
                            .map(|s| s.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                });
                continue;
            };
            used_here.extend(addresses(&ips));
            match (claim, claim_name, vm) {
                (Some(_), Some(c), _) => out.push(Action::ClaimStatus {
                    namespace: ns.into(),
                    name: c,
                    ips: ips.clone(),
                }),
                (None, Some(c), Some((vm_name, vm_uid))) => out.push(Action::CreateClaim {
                    namespace: ns.into(),
                    name: c,
                    vm_name: vm_name.into(),
                    vm_uid: vm_uid.into(),
                    network: n.network.clone(),
                    interface: iface.clone(),
                    ips: ips.clone(),
                }),
                _ => {}
            }
            value.insert(key.clone(), entry(ips));
            added.push(key);
        }
        if value != current {
            out.push(Action::Annotate {
                namespace: ns.into(),
                name: name.into(),
                uid: uid.into(),
                resource_version: v.metadata.resource_version.clone(),
                value,
                added,
            });
        }
    }
    out
}

/// The networks with IPAM a VMI attaches to, with the VMI's name for each interface and the
/// namespace of the NAD it uses: its
/// namespace's Primary network for its pod network (when the namespace is labelled), and each
/// Secondary network it names as a Multus network (`name` or `ns/name`).
fn wanted<'a>(
    v: &VirtualMachineInstance,
    ns: &str,
    inp: &Inputs<'a>,
) -> Vec<(String, String, &'a Network)> {
    let nets = v.spec.as_ref().and_then(|s| s.networks.as_ref());
    let mut out = Vec::new();
    if inp.primary_namespaces.contains(ns) {
        let pod = match nets {
            None => Some("default".to_string()),
            Some(n) => n.iter().find(|n| n.pod.is_some()).map(|n| n.name.clone()),
        };
        if let Some(iface) = pod
            && let Some(n) = inp
                .networks
                .iter()
                .find(|n| n.role == Role::Primary && n.namespaces.contains(ns))
        {
            out.push((iface, ns.to_string(), n));
        }
    }
    for net in nets.into_iter().flatten() {
        let Some(m) = &net.multus else { continue };
        let (nad_ns, nad) = match m.network_name.split_once('/') {
            Some((a, b)) => (a, b),
            None => (ns, m.network_name.as_str()),
        };
        if let Some(n) = inp.networks.iter().find(|n| {
            n.role == Role::Secondary && n.nad_name == nad && n.namespaces.contains(nad_ns)
        }) {
            out.push((net.name.clone(), nad_ns.to_string(), n));
        }
    }
    out
}

fn finished(v: &VirtualMachineInstance) -> bool {
    matches!(
        v.status.as_ref().and_then(|s| s.phase),
        Some(VmiPhase::Succeeded | VmiPhase::Failed)
    )
}

fn owner_vm(v: &VirtualMachineInstance) -> Option<(&str, &str)> {
    v.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.kind == "VirtualMachine")
        .map(|o| (o.name.as_str(), o.uid.as_str()))
}

fn claim_ips(c: &IPAMClaim) -> &[String] {
    c.status
        .as_ref()
        .and_then(|s| s.ips.as_deref())
        .unwrap_or_default()
}

fn addresses(ips: &[String]) -> impl Iterator<Item = IpAddr> + '_ {
    ips.iter()
        .filter_map(|s| s.split('/').next()?.parse::<IpAddr>().ok())
}

/// FNV-1a, 64 bits, of one name: a stable spread of names over address and VNI ranges
/// (the pod network's, [`ferrovirt_network::ipam::fnv1a`], with one part).
fn fnv1a(s: &str) -> u64 {
    ferrovirt_network::ipam::fnv1a(&[s])
}

/// The usable host range of a subnet as (first, count) (IPv4 and IPv6, where
/// `ferrovirt_network::ipam::Ipv4Cidr` is IPv4 only): IPv4 without network and broadcast
/// addresses up to /30, IPv6 without the subnet-router anycast address; /31, /32 and /127,
/// /128 as they are.
fn host_range(s: &IpNet) -> (u128, u128) {
    let (base, bits, max) = match s {
        IpNet::V4(n) => (u128::from(u32::from(n.network())), n.prefix_len(), 32u8),
        IpNet::V6(n) => (u128::from(n.network()), n.prefix_len(), 128u8),
    };
    let host_bits = u32::from(max - bits);
    let size = if host_bits >= 128 {
        u128::MAX
    } else {
        1u128 << host_bits
    };
    match (s, host_bits) {
        (_, 0 | 1) => (base, size),
        (IpNet::V4(_), _) => (base + 1, size - 2),
        (IpNet::V6(_), _) => (base + 1, size - 1),
    }
}

fn to_addr(s: &IpNet, v: u128) -> IpAddr {
    match s {
        IpNet::V4(_) => IpAddr::V4(std::net::Ipv4Addr::from(v as u32)),
        IpNet::V6(_) => IpAddr::V6(std::net::Ipv6Addr::from(v)),
    }
}

fn first_usable(s: &IpNet) -> Option<IpAddr> {
    let (first, count) = host_range(s);
    (count > 0).then(|| to_addr(s, first))
}

/// One address in each of the network's subnets for `seed`, past those in `used` and the
/// reserved ones; None when a subnet has none left. Probing is bounded (65,536 tries per
/// subnet), which covers every IPv4 subnet up to /16 exactly and leaves IPv6 subnets, whose
/// addresses are spread by the hash, practically never exhausted.
pub fn allocate(n: &Network, seed: &str, used: &BTreeSet<IpAddr>) -> Option<Vec<String>> {
    allocate_in(n, &n.subnets, seed, used)
}

/// [`allocate`] from `subnets` (a Layer3 node's host subnets).
fn allocate_in(
    n: &Network,
    subnets: &[IpNet],
    seed: &str,
    used: &BTreeSet<IpAddr>,
) -> Option<Vec<String>> {
    const MAX_TRIES: u128 = 65_536;
    let h = u128::from(fnv1a(seed));
    subnets
        .iter()
        .map(|s| {
            let (first, count) = host_range(s);
            if count == 0 {
                return None;
            }
            let start = h % count;
            (0..count.min(MAX_TRIES))
                .map(|i| to_addr(s, first + (start + i) % count))
                .find(|a| !used.contains(a) && !n.reserved(s, *a))
                .map(|a| format!("{a}/{}", s.prefix_len()))
        })
        .collect()
}

/// A VNI for `network`: hashed into [`MIN_VNI`]..=[`MAX_VNI`], probing upwards past `used`.
pub fn pick_vni(network: &str, used: &BTreeSet<u32>) -> u32 {
    let span = u64::from(MAX_VNI - MIN_VNI + 1);
    let start = (fnv1a(network) % span) as u32;
    (0..span as u32)
        .map(|i| MIN_VNI + (start + i) % span as u32)
        .find(|v| !used.contains(v))
        .unwrap_or(MIN_VNI)
}

#[cfg(test)]
#[path = "ipam_tests.rs"]
mod tests;
