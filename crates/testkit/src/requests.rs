//! API requests by (component, verb, resource) between two reads of the server's `/metrics`
//! (`apiserver_request_total`, by user agent), shared by the request-count test
//! (`steady_state_requests`) and the scale benchmark (`ferrovirt-simnodes`), which prints them
//! per VMI for the create → Running phase and as totals for the idle window, so that a change
//! in what each VMI costs the control plane shows as a count, which the machine's load does
//! not distort. The benchmark's simulated nodes' user agents (`ferrovirt-simnodes/sim-042`)
//! fold into one component (`ferrovirt-simnodes/sim-*`).

use std::collections::BTreeMap;

/// (component, verb, resource) → requests.
pub type Counts = BTreeMap<(String, String, String), u64>;

/// The component a user agent belongs to: one simulated node's agent stands for all of them.
pub fn component(user_agent: &str) -> String {
    match user_agent.strip_prefix("ferrovirt-simnodes/sim-") {
        Some(_) => "ferrovirt-simnodes/sim-*".into(),
        None => user_agent.to_string(),
    }
}

/// Parses `apiserver_request_total{verb="…",resource="…",user_agent="…"} N` lines (other lines
/// are skipped), summing the user agents of one component.
pub fn parse(metrics: &str) -> Counts {
    let mut out = Counts::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, n)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Ok(n) = n.trim().parse::<u64>() else {
            continue;
        };
        let (mut verb, mut resource, mut agent) = (String::new(), String::new(), String::new());
        for part in labels.split("\",") {
            let Some((k, v)) = part.split_once("=\"") else {
                continue;
            };
            let v = v.trim_end_matches('"').replace("\\\"", "\"");
            match k {
                "verb" => verb = v,
                "resource" => resource = v,
                "user_agent" => agent = v,
                _ => {}
            }
        }
        *out.entry((component(&agent), verb, resource)).or_default() += n;
    }
    out
}

/// The requests made between `before` and `after` (keys with none left out).
pub fn between(before: &Counts, after: &Counts) -> Counts {
    after
        .iter()
        .filter_map(|(k, n)| {
            let d = n.saturating_sub(before.get(k).copied().unwrap_or(0));
            (d > 0).then(|| (k.clone(), d))
        })
        .collect()
}

/// One line per (component, verb, resource): the count and the count per `per` (e.g. per VMI),
/// busiest first.
pub fn table(counts: &Counts, per: usize) -> Vec<String> {
    let mut rows: Vec<_> = counts.iter().collect();
    rows.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    rows.into_iter()
        .map(|((component, verb, resource), n)| {
            format!(
                "{component:32} {verb:8} {resource:44} {n:>8} {:>8.3}",
                *n as f64 / per.max(1) as f64
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = "# HELP apiserver_request_total x\n\
        apiserver_request_total{verb=\"PATCH\",resource=\"virtualmachineinstances.kubevirt.io\",user_agent=\"ferrovirt-controller\"} 2\n\
        apiserver_request_total{verb=\"UPDATE\",resource=\"leases.coordination.k8s.io\",user_agent=\"ferrovirt-simnodes/sim-000\"} 3\n";
    const AFTER: &str = "apiserver_request_total{verb=\"PATCH\",resource=\"virtualmachineinstances.kubevirt.io\",user_agent=\"ferrovirt-controller\"} 12\n\
        apiserver_request_total{verb=\"UPDATE\",resource=\"leases.coordination.k8s.io\",user_agent=\"ferrovirt-simnodes/sim-000\"} 5\n\
        apiserver_request_total{verb=\"UPDATE\",resource=\"leases.coordination.k8s.io\",user_agent=\"ferrovirt-simnodes/sim-001\"} 4\n\
        apiserver_request_total{verb=\"GET\",resource=\"nodes\",user_agent=\"ferrovirt-simnodes/driver\"} 1\n\
        apiserver_request_total{verb=\"LIST\",resource=\"nodes\",user_agent=\"x\\\"y\"} 0\n";

    #[test]
    fn simulated_nodes_fold_into_one_component() {
        assert_eq!(
            component("ferrovirt-simnodes/sim-042"),
            "ferrovirt-simnodes/sim-*"
        );
        assert_eq!(
            component("ferrovirt-simnodes/driver"),
            "ferrovirt-simnodes/driver"
        );
        assert_eq!(component("ferrovirt-controller"), "ferrovirt-controller");
        let c = parse(AFTER);
        let lease = (
            "ferrovirt-simnodes/sim-*".to_string(),
            "UPDATE".to_string(),
            "leases.coordination.k8s.io".to_string(),
        );
        assert_eq!(c[&lease], 9);
        assert!(c.contains_key(&("x\"y".into(), "LIST".into(), "nodes".into())));
    }

    #[test]
    fn requests_between_two_reads_per_vmi() {
        let d = between(&parse(BEFORE), &parse(AFTER));
        assert_eq!(d.len(), 3, "{d:?}");
        let rows = table(&d, 5);
        // Busiest first: 10 controller PATCHes = 2 per VMI.
        assert!(rows[0].starts_with("ferrovirt-controller"), "{rows:?}");
        assert!(rows[0].contains("PATCH"), "{rows:?}");
        assert!(rows[0].trim_end().ends_with("2.000"), "{rows:?}");
        assert!(rows[1].contains("leases.coordination.k8s.io"), "{rows:?}");
        assert!(rows[1].trim_end().ends_with("1.200"), "{rows:?}");
    }
}
