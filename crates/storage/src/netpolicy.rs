//! The address policy of imports (server-side request forgery defence): an import reaches
//! the addresses a user names, from inside the server, so by default it may not connect to
//! loopback (127.0.0.0/8, ::1), link-local (169.254.0.0/16, fe80::/10), unspecified
//! (0.0.0.0/8, ::), multicast or broadcast addresses, nor to any address of this machine's
//! own interfaces. An administrator allows ranges ([`Cidr`]s: HyperConverged
//! `spec.storageImport.allowedImportCIDRs`, the server flag `--import-allowed-cidrs`); an
//! allowed range wins over every class.
//!
//! [`decide`] is the pure decision; [`AddressPolicy::check`] adds this machine's interface
//! addresses; [`FilteringResolver`] is the DNS resolver of the HTTP client, which returns
//! only the allowed addresses of a name (so no connection to a refused address is ever
//! opened, and a name that changes its answer between lookups gains nothing), and
//! [`refusal`] is the error for IP-literal hosts and connected peers checked by the caller.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;

/// An address range `addr/prefix` (a bare address is `/32` or `/128`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// The range of exactly `addr`.
    pub fn host(addr: IpAddr) -> Cidr {
        let prefix = if addr.is_ipv4() { 32 } else { 128 };
        Cidr { addr, prefix }
    }

    /// Whether `ip` lies in the range (IPv4-mapped IPv6 addresses count as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl TryFrom<String> for Cidr {
    type Error = String;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Cidr> for String {
    fn from(c: Cidr) -> String {
        c.to_string()
    }
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?} is not an address range (e.g. 10.0.0.0/8, fd00::/8)"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{s:?}: the prefix length must be 0–{max}"))?,
        };
        Ok(Cidr { addr, prefix })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Parses a comma-separated list of ranges (empty entries are skipped).
pub fn parse_list(s: &str) -> Result<Vec<Cidr>, String> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(str::parse)
        .collect()
}

/// Why an address is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressClass {
    Loopback,
    LinkLocal,
    Unspecified,
    Multicast,
    Broadcast,
    /// An address of one of this machine's interfaces.
    ThisMachine,
}

impl fmt::Display for AddressClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AddressClass::Loopback => "a loopback address",
            AddressClass::LinkLocal => "a link-local address",
            AddressClass::Unspecified => "an unspecified address",
            AddressClass::Multicast => "a multicast address",
            AddressClass::Broadcast => "the broadcast address",
            AddressClass::ThisMachine => "an address of this machine's own interfaces",
        })
    }
}

/// `ip` with an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`) turned into IPv4.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// The refused class of `ip`, if any (`local`: this machine's interface addresses).
pub fn classify(ip: IpAddr, local: &[IpAddr]) -> Option<AddressClass> {
    let ip = canonical(ip);
    let class = match ip {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => classify_v6(v6),
    };
    class.or_else(|| {
        local
            .iter()
            .any(|l| canonical(*l) == ip)
            .then_some(AddressClass::ThisMachine)
    })
}

fn classify_v4(ip: Ipv4Addr) -> Option<AddressClass> {
    if ip.is_loopback() {
        Some(AddressClass::Loopback)
    } else if ip.is_link_local() {
        Some(AddressClass::LinkLocal)
    } else if ip.octets()[0] == 0 {
        // 0.0.0.0/8 ("this network"): Linux connects 0.0.0.0 to the local machine.
        Some(AddressClass::Unspecified)
    } else if ip.is_multicast() {
        Some(AddressClass::Multicast)
    } else if ip.is_broadcast() {
        Some(AddressClass::Broadcast)
    } else {
        None
    }
}

fn classify_v6(ip: Ipv6Addr) -> Option<AddressClass> {
    if ip.is_loopback() {
        Some(AddressClass::Loopback)
    } else if ip.is_unspecified() {
        Some(AddressClass::Unspecified)
    } else if ip.segments()[0] & 0xffc0 == 0xfe80 {
        Some(AddressClass::LinkLocal)
    } else if ip.is_multicast() {
        Some(AddressClass::Multicast)
    } else {
        None
    }
}

/// The decision for one address (pure): allowed when it lies in an `allowed` range or
/// belongs to no refused class (`local`: this machine's interface addresses).
pub fn decide(ip: IpAddr, local: &[IpAddr], allowed: &[Cidr]) -> Result<(), AddressClass> {
    if allowed.iter().any(|c| c.contains(ip)) {
        return Ok(());
    }
    match classify(ip, local) {
        Some(class) => Err(class),
        None => Ok(()),
    }
}

/// The addresses of this machine's interfaces (empty when they cannot be listed).
pub fn local_addresses() -> Vec<IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    addrs
        .filter_map(|a| a.address)
        .filter_map(|s| {
            if let Some(v4) = s.as_sockaddr_in() {
                Some(IpAddr::V4(v4.ip()))
            } else {
                s.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
            }
        })
        .collect()
}

/// Which addresses an import may connect to.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AddressPolicy {
    /// Ranges allowed whatever their class.
    pub allowed: Vec<Cidr>,
    /// Every address allowed (clients that do not import user-named URLs; tests).
    pub unrestricted: bool,
}

impl AddressPolicy {
    /// The default policy with `allowed` ranges added.
    pub fn allowing(allowed: Vec<Cidr>) -> Self {
        AddressPolicy {
            allowed,
            unrestricted: false,
        }
    }

    /// No restriction at all.
    pub fn unrestricted() -> Self {
        AddressPolicy {
            allowed: Vec::new(),
            unrestricted: true,
        }
    }

    /// The decision for `ip` on this machine.
    pub fn check(&self, ip: IpAddr) -> Result<(), AddressClass> {
        if self.unrestricted || self.allowed.iter().any(|c| c.contains(ip)) {
            return Ok(());
        }
        decide(ip, &local_addresses(), &self.allowed)
    }
}

/// An address the policy refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "refusing to connect to host {host} at {addr}: {class}; imports may not reach loopback, \
     link-local, unspecified, multicast or this machine's own addresses unless an \
     administrator allows the range (HyperConverged spec.storageImport.allowedImportCIDRs or \
     the server flag --import-allowed-cidrs)"
)]
pub struct Refusal {
    pub host: String,
    pub addr: IpAddr,
    pub class: AddressClass,
}

/// The refusal of `addr` (an address of `host`, or its connected peer), or `None` when the
/// policy allows it.
pub fn refusal(policy: &AddressPolicy, host: &str, addr: IpAddr) -> Option<Refusal> {
    policy.check(addr).err().map(|class| Refusal {
        host: host.to_string(),
        addr: canonical(addr),
        class,
    })
}

/// The HTTP client's DNS resolver: the system resolver's answer less the refused addresses;
/// a name with no allowed address fails with the [`Refusal`] of its first one.
#[derive(Debug, Clone)]
pub struct FilteringResolver {
    policy: Arc<AddressPolicy>,
}

impl FilteringResolver {
    pub fn new(policy: Arc<AddressPolicy>) -> Self {
        FilteringResolver { policy }
    }
}

impl reqwest::dns::Resolve for FilteringResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.policy.clone();
        let host = name.as_str().to_string();
        Box::pin(async move {
            let found: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let mut first_refusal = None;
            let mut allowed = Vec::new();
            for a in found {
                match refusal(&policy, &host, a.ip()) {
                    None => allowed.push(a),
                    Some(r) => {
                        tracing::warn!(host = %host, addr = %a.ip(), class = %r.class, "import address refused");
                        first_refusal.get_or_insert(r);
                    }
                }
            }
            if allowed.is_empty()
                && let Some(r) = first_refusal
            {
                return Err(Box::new(r) as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn cidrs_parse_and_match() {
        let c: Cidr = "10.1.0.0/16".parse().unwrap();
        assert!(c.contains(ip("10.1.200.3")));
        assert!(!c.contains(ip("10.2.0.1")));
        assert!(c.contains(ip("::ffff:10.1.0.9")));
        assert!(!c.contains(ip("fd00::1")));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("127.0.0.1")));
        let v6: Cidr = "fd00::/8".parse().unwrap();
        assert!(v6.contains(ip("fdab::1")) && !v6.contains(ip("fe80::1")));
        let one: Cidr = "::1".parse().unwrap();
        assert_eq!(one.to_string(), "::1/128");
        assert!(one.contains(ip("::1")) && !one.contains(ip("::2")));
        assert_eq!(Cidr::host(ip("127.0.0.2")).to_string(), "127.0.0.2/32");
        for bad in ["10.0.0.0/33", "::/129", "host/8", "10.0.0.0/x", ""] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
        let l = parse_list(" 127.0.0.0/8, ::1/128,").unwrap();
        assert_eq!(l.len(), 2);
        assert!(parse_list("").unwrap().is_empty());
        assert!(parse_list("127.0.0.0/8,nope").is_err());
    }

    #[test]
    fn classes_are_refused_by_default() {
        let none: &[IpAddr] = &[];
        for (a, class) in [
            ("127.0.0.1", AddressClass::Loopback),
            ("127.255.0.9", AddressClass::Loopback),
            ("::1", AddressClass::Loopback),
            ("::ffff:127.0.0.1", AddressClass::Loopback),
            ("169.254.169.254", AddressClass::LinkLocal),
            ("fe80::1", AddressClass::LinkLocal),
            ("febf::1", AddressClass::LinkLocal),
            ("0.0.0.0", AddressClass::Unspecified),
            ("0.1.2.3", AddressClass::Unspecified),
            ("::", AddressClass::Unspecified),
            ("224.0.0.1", AddressClass::Multicast),
            ("ff02::1", AddressClass::Multicast),
            ("255.255.255.255", AddressClass::Broadcast),
        ] {
            assert_eq!(decide(ip(a), none, &[]), Err(class), "{a}");
        }
        for a in [
            "10.0.0.1",
            "192.168.1.1",
            "8.8.8.8",
            "fd00::1",
            "2001:db8::1",
            "fec0::1",
        ] {
            assert_eq!(decide(ip(a), none, &[]), Ok(()), "{a}");
        }
    }

    #[test]
    fn own_addresses_are_refused_and_allowed_ranges_win() {
        let local = [ip("10.0.0.5"), ip("fd00::5")];
        assert_eq!(
            decide(ip("10.0.0.5"), &local, &[]),
            Err(AddressClass::ThisMachine)
        );
        assert_eq!(
            decide(ip("::ffff:10.0.0.5"), &local, &[]),
            Err(AddressClass::ThisMachine)
        );
        assert_eq!(
            decide(ip("fd00::5"), &local, &[]),
            Err(AddressClass::ThisMachine)
        );
        assert_eq!(decide(ip("10.0.0.6"), &local, &[]), Ok(()));
        let allow = parse_list("127.0.0.2/32,10.0.0.0/24").unwrap();
        assert_eq!(decide(ip("127.0.0.2"), &local, &allow), Ok(()));
        assert_eq!(decide(ip("10.0.0.5"), &local, &allow), Ok(()));
        assert_eq!(
            decide(ip("127.0.0.1"), &local, &allow),
            Err(AddressClass::Loopback)
        );
    }

    #[test]
    fn policies_and_refusals() {
        let p = AddressPolicy::default();
        let r = refusal(&p, "localhost", ip("::ffff:127.0.0.1")).unwrap();
        assert_eq!(r.addr, ip("127.0.0.1"));
        let m = r.to_string();
        assert!(
            m.contains("localhost") && m.contains("loopback address") && m.contains("127.0.0.1"),
            "{m}"
        );
        assert!(m.contains("allowedImportCIDRs"), "{m}");
        assert!(refusal(&AddressPolicy::unrestricted(), "h", ip("127.0.0.1")).is_none());
        let p = AddressPolicy::allowing(parse_list("127.0.0.0/8").unwrap());
        assert!(refusal(&p, "h", ip("127.0.0.1")).is_none());
        assert!(refusal(&p, "h", ip("::1")).is_some());
        // This machine's loopback interface address is listed and refused.
        let local = local_addresses();
        assert!(local.contains(&ip("127.0.0.1")), "{local:?}");
    }

    #[tokio::test]
    async fn the_resolver_drops_refused_addresses() {
        use reqwest::dns::Resolve;
        let r = FilteringResolver::new(Arc::new(AddressPolicy::default()));
        let err = match r.resolve("localhost".parse().unwrap()).await {
            Ok(a) => panic!("resolved to {:?}", a.collect::<Vec<_>>()),
            Err(e) => e,
        };
        let refusal = err.downcast_ref::<Refusal>().expect("a Refusal");
        assert_eq!(refusal.class, AddressClass::Loopback);
        let r = FilteringResolver::new(Arc::new(AddressPolicy::allowing(
            parse_list("127.0.0.0/8,::1/128").unwrap(),
        )));
        let addrs: Vec<_> = r
            .resolve("localhost".parse().unwrap())
            .await
            .unwrap()
            .collect();
        assert!(addrs.iter().all(|a| a.ip().is_loopback()) && !addrs.is_empty());
    }
}
