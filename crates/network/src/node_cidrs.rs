//! Node subnet allocation (pure), as Kubernetes' node IPAM does it: every Node gets a
//! `spec.podCIDR` from the cluster CIDR, never overlapping another Node's. [`assign`] is the
//! node IPAM controller's decision over all Nodes; [`check_own`] is what an agent started with
//! an explicit `--pod-cidr` checks before recording it on its Node.

use std::collections::BTreeSet;

use crate::error::{Error, Result};
use crate::ipam::{Ipam, Ipv4Cidr};

/// The controller's decision for one pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Assignment {
    /// Nodes without a podCIDR and the subnet each should get.
    pub assign: Vec<(String, Ipv4Cidr)>,
    /// Nodes whose podCIDR cannot be used (unparsable, outside the cluster CIDR, overlapping
    /// an earlier node's), with the reason; left as they are.
    pub conflicts: Vec<(String, String)>,
}

/// Decides subnets for the Nodes `(name, spec.podCIDR)` that have none. Existing subnets are
/// kept (and reported when they conflict); new ones are hashed from the node name
/// ([`Ipam::allocate_node_subnet`]), probing past every subnet in use, in name order so the
/// result does not depend on list order.
/// The indices of the node subnets of `ipam` that `c` overlaps (pure arithmetic: no walk over
/// every node subnet of the cluster CIDR, which a pass per Node change used to make).
fn touched_subnets(ipam: &Ipam, c: Ipv4Cidr) -> std::ops::Range<u32> {
    let np = u32::from(ipam.node_prefix);
    let base = u64::from(u32::from(ipam.cluster.network()));
    let count = ipam.node_subnet_count();
    let lo = u64::from(u32::from(c.network()));
    let hi = lo + (1u64 << (32 - u32::from(c.prefix()))); // exclusive
    let first = lo.max(base);
    let end = hi.min(base + (count << (32 - np)));
    if first >= end {
        return 0..0;
    }
    let step = 1u64 << (32 - np);
    let a = (first - base) / step;
    let b = (end - base).div_ceil(step);
    (a as u32)..(b.min(count) as u32)
}

pub fn assign(ipam: &Ipam, nodes: &[(String, Option<String>)]) -> Result<Assignment> {
    let mut out = Assignment::default();
    let mut sorted: Vec<&(String, Option<String>)> = nodes.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut taken: Vec<(String, Ipv4Cidr)> = Vec::new();
    let mut used = BTreeSet::new();
    for (name, cidr) in &sorted {
        let Some(text) = cidr else { continue };
        let c: Ipv4Cidr = match text.parse() {
            Ok(c) => c,
            Err(e) => {
                out.conflicts.push((name.clone(), format!("podCIDR: {e}")));
                continue;
            }
        };
        if let Some((other, oc)) = taken.iter().find(|(_, o)| o.overlaps(c)) {
            out.conflicts.push((
                name.clone(),
                Error::NodeCidrOverlap {
                    node: name.clone(),
                    cidr: c.to_string(),
                    other: other.clone(),
                    other_cidr: oc.to_string(),
                }
                .to_string(),
            ));
            continue;
        }
        if !ipam.cluster.contains(c.network()) {
            out.conflicts.push((
                name.clone(),
                format!("podCIDR {c} is outside the cluster CIDR {}", ipam.cluster),
            ));
        }
        taken.push((name.clone(), c));
        // Every node-sized subnet the existing one touches is in use.
        for i in touched_subnets(ipam, c) {
            used.insert(ipam.node_subnet(i)?);
        }
    }
    for (name, cidr) in &sorted {
        if cidr.is_some() {
            continue;
        }
        let s = ipam.allocate_node_subnet(name, &used)?;
        used.insert(s);
        out.assign.push((name.clone(), s));
    }
    Ok(out)
}

/// Checks an explicitly configured subnet of node `me` against the other Nodes' podCIDRs.
pub fn check_own(me: &str, cidr: Ipv4Cidr, others: &[(String, Option<String>)]) -> Result<()> {
    for (name, other) in others {
        if name == me {
            continue;
        }
        if let Some(o) = other.as_deref().and_then(|o| o.parse::<Ipv4Cidr>().ok())
            && o.overlaps(cidr)
        {
            return Err(Error::NodeCidrOverlap {
                node: me.to_string(),
                cidr: cidr.to_string(),
                other: name.clone(),
                other_cidr: o.to_string(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(name: &str, cidr: Option<&str>) -> (String, Option<String>) {
        (name.into(), cidr.map(String::from))
    }

    #[test]
    fn touched_subnets_are_the_ones_a_walk_finds() {
        for (cluster, np) in [
            ("10.244.0.0/16", 24u8),
            ("10.0.0.0/14", 20),
            ("10.0.0.0/24", 26),
        ] {
            let ipam = Ipam::new(cluster.parse().unwrap(), np).unwrap();
            for c in [
                "10.244.7.0/24",
                "10.244.7.128/25",
                "10.244.6.0/23",
                "10.244.0.0/16",
                "10.0.0.0/8",
                "10.245.0.0/24",
                "10.0.0.64/26",
                "10.0.3.0/24",
                "192.168.0.0/24",
                "10.243.255.0/24",
                "0.0.0.0/0",
                "10.0.0.0/32",
            ] {
                let c: Ipv4Cidr = c.parse().unwrap();
                let walk: Vec<u32> = (0..ipam.node_subnet_count() as u32)
                    .filter(|i| ipam.node_subnet(*i).unwrap().overlaps(c))
                    .collect();
                let got: Vec<u32> = touched_subnets(&ipam, c).collect();
                assert_eq!(got, walk, "{cluster} /{np} {c}");
            }
        }
    }

    #[test]
    fn assigns_disjoint_stable_subnets_and_keeps_existing_ones() {
        let ipam = Ipam::default();
        let nodes = [n("b", None), n("a", Some("10.244.7.0/24")), n("c", None)];
        let a = assign(&ipam, &nodes).unwrap();
        assert!(a.conflicts.is_empty());
        assert_eq!(a.assign.len(), 2);
        assert_eq!(a.assign[0].0, "b");
        let all: Vec<Ipv4Cidr> = a
            .assign
            .iter()
            .map(|(_, c)| *c)
            .chain(["10.244.7.0/24".parse().unwrap()])
            .collect();
        for (i, x) in all.iter().enumerate() {
            assert!(ipam.cluster.contains(x.network()));
            for y in &all[i + 1..] {
                assert!(!x.overlaps(*y), "{x} {y}");
            }
        }
        // Same input, same answer, whatever the order.
        let rev = [n("c", None), n("a", Some("10.244.7.0/24")), n("b", None)];
        assert_eq!(assign(&ipam, &rev).unwrap(), a);
        // Nothing to do once everyone has one.
        assert_eq!(
            assign(&ipam, &[n("a", Some("10.244.7.0/24"))]).unwrap(),
            Assignment::default()
        );
    }

    #[test]
    fn a_new_node_never_gets_a_subnet_in_use() {
        let ipam = Ipam::default();
        let want = ipam
            .allocate_node_subnet("x", &BTreeSet::new())
            .unwrap()
            .to_string();
        let a = assign(&ipam, &[n("w", Some(&want)), n("x", None)]).unwrap();
        assert_ne!(a.assign[0].1.to_string(), want);
        // A bigger existing range blocks every /24 inside it.
        let a = assign(&ipam, &[n("w", Some("10.244.0.0/17")), n("x", None)]).unwrap();
        assert!(a.assign[0].1.network().octets()[2] >= 128);
    }

    #[test]
    fn conflicts_are_reported_clearly() {
        let ipam = Ipam::default();
        let a = assign(
            &ipam,
            &[
                n("a", Some("10.244.1.0/24")),
                n("b", Some("10.244.1.0/25")),
                n("c", Some("nope")),
                n("d", Some("192.168.1.0/24")),
            ],
        )
        .unwrap();
        let text = format!("{:?}", a.conflicts);
        assert!(
            text.contains("pod CIDR 10.244.1.0/25 of node b overlaps 10.244.1.0/24 of node a"),
            "{text}"
        );
        assert!(text.contains("\"c\", \"podCIDR: invalid CIDR"), "{text}");
        assert!(text.contains("outside the cluster CIDR"), "{text}");
    }

    #[test]
    fn own_subnet_must_not_overlap_others() {
        let c: Ipv4Cidr = "10.244.0.0/24".parse().unwrap();
        check_own(
            "a",
            c,
            &[n("a", Some("10.244.0.0/24")), n("b", Some("10.244.1.0/24"))],
        )
        .unwrap();
        let e = check_own("a", c, &[n("b", Some("10.244.0.0/23"))])
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "pod CIDR 10.244.0.0/24 of node a overlaps 10.244.0.0/23 of node b"
        );
    }
}
