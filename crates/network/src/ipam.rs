//! Address planning (pure): IPv4 CIDRs, the cluster CIDR split into per-node subnets, stable
//! per-VMI addresses (hashed from the VMI uid, probing past addresses already in use), overlap
//! checks between ranges, and stable locally administered MAC addresses.

use std::collections::BTreeSet;
use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The default cluster ("pod network") CIDR.
pub const DEFAULT_CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The default size of a node's subnet.
pub const DEFAULT_NODE_PREFIX: u8 = 24;

/// An IPv4 network: a network address with no host bits set, and a prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Ipv4Cidr {
    network: Ipv4Addr,
    prefix: u8,
}

impl Ipv4Cidr {
    /// A CIDR from its network address; fails when host bits are set or the prefix is > 32.
    pub fn new(network: Ipv4Addr, prefix: u8) -> Result<Self> {
        // The input is formatted only for an error: this runs for every node subnet.
        let input = || format!("{network}/{prefix}");
        if prefix > 32 {
            return Err(Error::InvalidCidr {
                input: input(),
                reason: "prefix length must be at most 32".into(),
            });
        }
        let c = Ipv4Cidr { network, prefix };
        if u32::from(network) & !c.mask_bits() != 0 {
            return Err(Error::InvalidCidr {
                input: input(),
                reason: format!("host bits are set (did you mean {}?)", c.truncated()),
            });
        }
        Ok(c)
    }

    fn truncated(self) -> Ipv4Cidr {
        Ipv4Cidr {
            network: Ipv4Addr::from(u32::from(self.network) & self.mask_bits()),
            prefix: self.prefix,
        }
    }

    fn mask_bits(self) -> u32 {
        if self.prefix == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(self.prefix))
        }
    }

    pub fn network(self) -> Ipv4Addr {
        self.network
    }

    pub fn prefix(self) -> u8 {
        self.prefix
    }

    /// The netmask, e.g. 255.255.255.0 for a /24.
    pub fn netmask(self) -> Ipv4Addr {
        Ipv4Addr::from(self.mask_bits())
    }

    /// The last address of the range.
    pub fn broadcast(self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) | !self.mask_bits())
    }

    /// Number of addresses in the range.
    pub fn size(self) -> u64 {
        1u64 << (32 - u32::from(self.prefix))
    }

    pub fn contains(self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & self.mask_bits() == u32::from(self.network)
    }

    /// Whether the two ranges share at least one address.
    pub fn overlaps(self, other: Ipv4Cidr) -> bool {
        self.contains(other.network) || other.contains(self.network)
    }

    /// The `n`th address of the range (0 is the network address), if inside.
    pub fn nth(self, n: u64) -> Option<Ipv4Addr> {
        (n < self.size()).then(|| Ipv4Addr::from(u32::from(self.network) + n as u32))
    }

    /// The conventional gateway: the first host address (`.1` of a /24).
    pub fn gateway(self) -> Ipv4Addr {
        self.nth(1).unwrap_or(self.network)
    }
}

impl fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl FromStr for Ipv4Cidr {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |reason: &str| Error::InvalidCidr {
            input: s.to_string(),
            reason: reason.to_string(),
        };
        let (addr, prefix) = s
            .split_once('/')
            .ok_or_else(|| bad("expected ADDRESS/PREFIX"))?;
        let addr: Ipv4Addr = addr.parse().map_err(|_| bad("not an IPv4 address"))?;
        let prefix: u8 = prefix.parse().map_err(|_| bad("prefix is not a number"))?;
        Ipv4Cidr::new(addr, prefix).map_err(|e| match e {
            Error::InvalidCidr { reason, .. } => bad(&reason),
            other => other,
        })
    }
}

impl TryFrom<String> for Ipv4Cidr {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<Ipv4Cidr> for String {
    fn from(c: Ipv4Cidr) -> String {
        c.to_string()
    }
}

/// Fails with [`Error::Overlap`] naming the first two ranges that overlap.
pub fn check_disjoint(ranges: &[(&str, Ipv4Cidr)]) -> Result<()> {
    for (i, (a_name, a)) in ranges.iter().enumerate() {
        for (b_name, b) in &ranges[i + 1..] {
            if a.overlaps(*b) {
                return Err(Error::Overlap {
                    first_name: a_name.to_string(),
                    first: a.to_string(),
                    second_name: b_name.to_string(),
                    second: b.to_string(),
                });
            }
        }
    }
    Ok(())
}

/// FNV-1a over `parts`, each followed by a zero byte separator (except the last): a stable
/// spread of names over address ranges (also the controller's UDN addresses and VNIs).
pub fn fnv1a(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, p) in parts.iter().enumerate() {
        let sep: &[u8] = if i + 1 < parts.len() { &[0] } else { &[] };
        for b in p.bytes().chain(sep.iter().copied()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The cluster CIDR and how it is cut into node subnets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ipam {
    pub cluster: Ipv4Cidr,
    pub node_prefix: u8,
}

impl Default for Ipam {
    fn default() -> Self {
        Ipam {
            cluster: DEFAULT_CLUSTER_CIDR.parse().expect("valid default CIDR"),
            node_prefix: DEFAULT_NODE_PREFIX,
        }
    }
}

impl Ipam {
    /// Checks that node subnets fit the cluster CIDR and leave room for a gateway and VMIs.
    pub fn new(cluster: Ipv4Cidr, node_prefix: u8) -> Result<Self> {
        if node_prefix < cluster.prefix() || node_prefix > 29 {
            return Err(Error::InvalidPlan(format!(
                "node subnet prefix /{node_prefix} must be between /{} and /29",
                cluster.prefix()
            )));
        }
        Ok(Ipam {
            cluster,
            node_prefix,
        })
    }

    /// How many node subnets the cluster CIDR holds.
    pub fn node_subnet_count(&self) -> u64 {
        1u64 << (self.node_prefix - self.cluster.prefix())
    }

    /// The node subnet with `index` (0 is the first /24 of the cluster CIDR).
    pub fn node_subnet(&self, index: u32) -> Result<Ipv4Cidr> {
        let count = self.node_subnet_count();
        if u64::from(index) >= count {
            return Err(Error::NodeSubnetOutOfRange {
                index,
                cluster: self.cluster.to_string(),
                count,
                prefix: self.node_prefix,
            });
        }
        let step = 1u64 << (32 - u32::from(self.node_prefix));
        let net = u64::from(u32::from(self.cluster.network())) + u64::from(index) * step;
        Ipv4Cidr::new(Ipv4Addr::from(net as u32), self.node_prefix)
    }

    /// A stable subnet for the node `name`: hashed from the name, probing past `used`.
    pub fn allocate_node_subnet(&self, name: &str, used: &BTreeSet<Ipv4Cidr>) -> Result<Ipv4Cidr> {
        let count = self.node_subnet_count();
        let start = fnv1a(&[name]) % count;
        for i in 0..count {
            let s = self.node_subnet(((start + i) % count) as u32)?;
            if !used.contains(&s) {
                return Ok(s);
            }
        }
        Err(Error::SubnetFull(self.cluster.to_string()))
    }
}

/// A stable address for the VMI `uid` in `subnet`: never the network, gateway (`.1`) or
/// broadcast address; hashed from the uid, probing upwards past addresses in `used`. The same
/// uid with the same `used` set always gets the same address.
pub fn allocate_vmi_address(
    subnet: Ipv4Cidr,
    uid: &str,
    used: &BTreeSet<Ipv4Addr>,
) -> Result<Ipv4Addr> {
    // Usable: .2 ..= broadcast-1.
    let usable = subnet.size().saturating_sub(3);
    if usable == 0 {
        return Err(Error::SubnetFull(subnet.to_string()));
    }
    let start = fnv1a(&[uid]) % usable;
    for i in 0..usable {
        let ip = subnet
            .nth(2 + (start + i) % usable)
            .ok_or_else(|| Error::SubnetFull(subnet.to_string()))?;
        if !used.contains(&ip) {
            return Ok(ip);
        }
    }
    Err(Error::SubnetFull(subnet.to_string()))
}

/// A MAC address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// A locally administered unicast MAC derived from `parts` (e.g. namespace, VMI name,
    /// interface name); the same derivation as the agent's `derived_mac`.
    pub fn stable(parts: &[&str]) -> MacAddr {
        let b = fnv1a(parts).to_be_bytes();
        MacAddr([0x02, b[0], b[1], b[2], b[3], b[4]])
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            b[0], b[1], b[2], b[3], b[4], b[5]
        )
    }
}

impl FromStr for MacAddr {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::InvalidPlan(format!("invalid MAC address {s:?}"));
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for o in &mut out {
            let p = parts.next().ok_or_else(bad)?;
            if p.len() != 2 {
                return Err(bad());
            }
            *o = u8::from_str_radix(p, 16).map_err(|_| bad())?;
        }
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(MacAddr(out))
    }
}

impl TryFrom<String> for MacAddr {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<MacAddr> for String {
    fn from(m: MacAddr) -> String {
        m.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(s: &str) -> Ipv4Cidr {
        s.parse().unwrap()
    }

    #[test]
    fn parses_and_describes_cidrs() {
        let c = cidr("10.244.3.0/24");
        assert_eq!(c.netmask(), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(c.broadcast(), Ipv4Addr::new(10, 244, 3, 255));
        assert_eq!(c.gateway(), Ipv4Addr::new(10, 244, 3, 1));
        assert_eq!(c.size(), 256);
        assert!(c.contains(Ipv4Addr::new(10, 244, 3, 77)));
        assert!(!c.contains(Ipv4Addr::new(10, 244, 4, 1)));
        assert_eq!(c.to_string(), "10.244.3.0/24");
        assert_eq!(cidr("0.0.0.0/0").size(), 1 << 32);
    }

    #[test]
    fn rejects_bad_cidrs_with_clear_errors() {
        let e = "10.244.1.0/16".parse::<Ipv4Cidr>().unwrap_err().to_string();
        assert!(
            e.contains("host bits") && e.contains("10.244.0.0/16"),
            "{e}"
        );
        assert!("10.0.0.0".parse::<Ipv4Cidr>().is_err());
        assert!("10.0.0.0/33".parse::<Ipv4Cidr>().is_err());
        assert!("10.0.0/8".parse::<Ipv4Cidr>().is_err());
    }

    #[test]
    fn cidrs_and_macs_serialize_as_strings() {
        let c = cidr("10.244.0.0/16");
        assert_eq!(serde_json::to_value(c).unwrap(), "10.244.0.0/16");
        let back: Ipv4Cidr = serde_json::from_value("10.1.0.0/24".into()).unwrap();
        assert_eq!(back, cidr("10.1.0.0/24"));
        assert!(serde_json::from_value::<Ipv4Cidr>("10.1.0.1/24".into()).is_err());
        let m = MacAddr([2, 0, 0, 0, 0, 0xab]);
        assert_eq!(serde_json::to_value(m).unwrap(), "02:00:00:00:00:ab");
    }

    #[test]
    fn splits_the_cluster_cidr_into_node_subnets() {
        let ipam = Ipam::default();
        assert_eq!(ipam.node_subnet_count(), 256);
        assert_eq!(ipam.node_subnet(0).unwrap(), cidr("10.244.0.0/24"));
        assert_eq!(ipam.node_subnet(7).unwrap(), cidr("10.244.7.0/24"));
        assert_eq!(ipam.node_subnet(255).unwrap(), cidr("10.244.255.0/24"));
        let e = ipam.node_subnet(256).unwrap_err().to_string();
        assert!(e.contains("256"), "{e}");
        assert!(Ipam::new(cidr("10.244.0.0/16"), 8).is_err());
        assert!(Ipam::new(cidr("10.244.0.0/16"), 30).is_err());
    }

    #[test]
    fn node_subnets_are_stable_and_probe_past_used_ones() {
        let ipam = Ipam::new(cidr("10.0.0.0/22"), 24).unwrap();
        let a = ipam
            .allocate_node_subnet("node-a", &BTreeSet::new())
            .unwrap();
        assert_eq!(
            a,
            ipam.allocate_node_subnet("node-a", &BTreeSet::new())
                .unwrap()
        );
        let used: BTreeSet<_> = [a].into();
        let b = ipam.allocate_node_subnet("node-a", &used).unwrap();
        assert_ne!(a, b);
        let all: BTreeSet<_> = (0..4).map(|i| ipam.node_subnet(i).unwrap()).collect();
        assert!(ipam.allocate_node_subnet("x", &all).is_err());
    }

    #[test]
    fn vmi_addresses_are_stable_skip_reserved_and_probe() {
        let s = cidr("10.244.1.0/24");
        let none = BTreeSet::new();
        let a = allocate_vmi_address(s, "uid-1", &none).unwrap();
        assert_eq!(a, allocate_vmi_address(s, "uid-1", &none).unwrap());
        assert!(s.contains(a));
        assert!(![s.network(), s.gateway(), s.broadcast()].contains(&a));
        let used: BTreeSet<_> = [a].into();
        let b = allocate_vmi_address(s, "uid-1", &used).unwrap();
        assert_ne!(a, b);
        // Every usable address of a /29 (.2 ..= .6) is handed out once, then it is full.
        let small = cidr("10.0.0.8/29");
        let mut used = BTreeSet::new();
        for i in 0..5 {
            let ip = allocate_vmi_address(small, &format!("u{i}"), &used).unwrap();
            assert!(u32::from(ip) >= u32::from(small.nth(2).unwrap()));
            assert!(ip < small.broadcast());
            assert!(used.insert(ip));
        }
        let e = allocate_vmi_address(small, "u9", &used).unwrap_err();
        assert!(e.to_string().contains("no free address"));
    }

    #[test]
    fn different_uids_usually_get_different_addresses() {
        let s = cidr("10.244.1.0/24");
        let mut used = BTreeSet::new();
        for i in 0..50 {
            used.insert(allocate_vmi_address(s, &format!("uid-{i}"), &used).unwrap());
        }
        assert_eq!(used.len(), 50);
    }

    #[test]
    fn overlapping_ranges_are_rejected_by_name() {
        let ok = [
            ("cluster CIDR", cidr("10.244.0.0/16")),
            ("masquerade network", cidr("10.0.2.0/24")),
            ("service CIDR", cidr("10.96.0.0/12")),
        ];
        check_disjoint(&ok).unwrap();
        let bad = [
            ("cluster CIDR", cidr("10.0.0.0/8")),
            ("masquerade network", cidr("10.0.2.0/24")),
        ];
        let e = check_disjoint(&bad).unwrap_err().to_string();
        assert_eq!(
            e,
            "cluster CIDR 10.0.0.0/8 overlaps masquerade network 10.0.2.0/24"
        );
        assert!(cidr("10.1.0.0/16").overlaps(cidr("10.1.5.0/24")));
        assert!(!cidr("10.1.0.0/24").overlaps(cidr("10.1.1.0/24")));
    }

    #[test]
    fn stable_macs_are_local_unicast_and_roundtrip() {
        let m = MacAddr::stable(&["default", "vm1", "default"]);
        assert_eq!(m, MacAddr::stable(&["default", "vm1", "default"]));
        assert_ne!(m, MacAddr::stable(&["default", "vm2", "default"]));
        assert_eq!(m.0[0], 0x02);
        assert_eq!(m.to_string().parse::<MacAddr>().unwrap(), m);
        assert!("02:00:00:00:00".parse::<MacAddr>().is_err());
        assert!("02:00:00:00:00:zz".parse::<MacAddr>().is_err());
        assert!("02:00:00:00:00:00:00".parse::<MacAddr>().is_err());
    }
}
