//! The settings a live migration runs with (docs/migration.md, "Policies"), pure: KubeVirt's
//! defaults, overridden by the HyperConverged `spec.liveMigrationConfig`, then by the KubeVirt
//! CR's `spec.configuration.migrations`, then by the MigrationPolicy that matches the VMI (the
//! one whose namespace and VMI selectors match the most labels; ties go to the first name).
//! Also the node-side arithmetic: the bandwidth cap in bytes per second and the timeouts.

use std::collections::BTreeMap;

use crate::hco::LiveMigrationConfig;
use crate::kubevirt::misc::{MigrationConfiguration, MigrationPolicy};

/// KubeVirt's defaults.
pub const DEFAULT_PARALLEL_PER_CLUSTER: u32 = 5;
pub const DEFAULT_PARALLEL_OUTBOUND_PER_NODE: u32 = 2;
pub const DEFAULT_COMPLETION_TIMEOUT_PER_GIB: i64 = 150;
pub const DEFAULT_PROGRESS_TIMEOUT: i64 = 150;

/// KubeVirt's defaults as a configuration (bandwidth unlimited).
pub fn defaults() -> MigrationConfiguration {
    MigrationConfiguration {
        parallel_migrations_per_cluster: Some(DEFAULT_PARALLEL_PER_CLUSTER),
        parallel_outbound_migrations_per_node: Some(DEFAULT_PARALLEL_OUTBOUND_PER_NODE),
        completion_timeout_per_gib: Some(DEFAULT_COMPLETION_TIMEOUT_PER_GIB),
        progress_timeout: Some(DEFAULT_PROGRESS_TIMEOUT),
        allow_auto_converge: Some(false),
        allow_post_copy: Some(false),
        ..Default::default()
    }
}

macro_rules! over {
    ($into:expr, $from:expr, $($f:ident),*) => {
        $( if $from.$f.is_some() { $into.$f = $from.$f.clone(); } )*
    };
}

/// The cluster-wide configuration: defaults ← HyperConverged ← KubeVirt CR.
pub fn cluster_configuration(
    hco: Option<&LiveMigrationConfig>,
    kubevirt: Option<&MigrationConfiguration>,
) -> MigrationConfiguration {
    let mut c = defaults();
    if let Some(h) = hco {
        over!(
            c,
            h,
            parallel_migrations_per_cluster,
            parallel_outbound_migrations_per_node,
            bandwidth_per_migration,
            completion_timeout_per_gib,
            progress_timeout,
            network,
            allow_auto_converge,
            allow_post_copy
        );
    }
    if let Some(k) = kubevirt {
        over!(
            c,
            k,
            parallel_migrations_per_cluster,
            parallel_outbound_migrations_per_node,
            bandwidth_per_migration,
            completion_timeout_per_gib,
            progress_timeout,
            network,
            allow_auto_converge,
            allow_post_copy,
            allow_workload_disruption
        );
        // Fields not modelled (KubeVirt's `disableTLS`, `unsafeMigrationOverride`, …).
        for (k, v) in &k.other {
            c.other.insert(k.clone(), v.clone());
        }
    }
    c
}

fn matches(
    selector: Option<&BTreeMap<String, String>>,
    labels: &BTreeMap<String, String>,
) -> Option<usize> {
    let Some(sel) = selector else {
        return Some(0);
    };
    sel.iter()
        .all(|(k, v)| labels.get(k) == Some(v))
        .then_some(sel.len())
}

/// The policy for a VMI with `vmi_labels` in a namespace with `ns_labels`: among the policies
/// whose selectors all match, the one matching the most labels; ties to the first name.
pub fn select_policy<'a>(
    policies: &'a [MigrationPolicy],
    vmi_labels: &BTreeMap<String, String>,
    ns_labels: &BTreeMap<String, String>,
) -> Option<&'a MigrationPolicy> {
    let mut best: Option<(usize, &str, &MigrationPolicy)> = None;
    for p in policies {
        let sel = p.spec.as_ref().and_then(|s| s.selectors.as_ref());
        let ns = matches(sel.and_then(|s| s.namespace_selector.as_ref()), ns_labels);
        let vmi = matches(
            sel.and_then(|s| s.virtual_machine_instance_selector.as_ref()),
            vmi_labels,
        );
        let (Some(ns), Some(vmi)) = (ns, vmi) else {
            continue;
        };
        let score = ns + vmi;
        if score == 0 {
            // A policy without selectors selects nothing (KubeVirt's rule).
            continue;
        }
        let name = p.metadata.name.as_deref().unwrap_or_default();
        let better = match &best {
            None => true,
            Some((s, n, _)) => score > *s || (score == *s && name < *n),
        };
        if better {
            best = Some((score, name, p));
        }
    }
    best.map(|(_, _, p)| p)
}

/// The configuration a migration runs with: the cluster's, with the selected policy's values
/// over it; and the policy's name.
pub fn effective(
    cluster: &MigrationConfiguration,
    policy: Option<&MigrationPolicy>,
) -> (MigrationConfiguration, Option<String>) {
    let mut c = cluster.clone();
    let Some(p) = policy else {
        return (c, None);
    };
    if let Some(s) = &p.spec {
        over!(
            c,
            s,
            allow_auto_converge,
            bandwidth_per_migration,
            completion_timeout_per_gib,
            allow_post_copy,
            allow_workload_disruption
        );
    }
    (c, p.metadata.name.clone())
}

/// The bandwidth cap in bytes per second (`None`: unlimited; `0` also means unlimited).
pub fn bandwidth_bytes(c: &MigrationConfiguration) -> Option<u64> {
    let q = c.bandwidth_per_migration.as_ref()?;
    crate::quantity::bytes(&q.0).ok().filter(|b| *b > 0)
}

/// The longest a migration of a guest with `memory_bytes` may take:
/// `completionTimeoutPerGiB` × the memory in GiB (at least one GiB's worth).
pub fn completion_timeout_secs(c: &MigrationConfiguration, memory_bytes: u64) -> Option<u64> {
    let per = u64::try_from(c.completion_timeout_per_gib?).ok()?;
    let gib = memory_bytes.div_ceil(1 << 30).max(1);
    Some(per.saturating_mul(gib))
}

/// Why a running migration must be aborted, if it must: longer than the completion timeout,
/// or no progress (remaining memory not shrinking) for `progressTimeout` seconds.
pub fn timed_out(
    c: &MigrationConfiguration,
    memory_bytes: u64,
    elapsed_secs: u64,
    secs_without_progress: u64,
) -> Option<String> {
    if let Some(t) = completion_timeout_secs(c, memory_bytes)
        && elapsed_secs > t
    {
        return Some(format!(
            "the migration did not complete within {t} s (completionTimeoutPerGiB)"
        ));
    }
    if let Some(p) = c.progress_timeout.and_then(|p| u64::try_from(p).ok())
        && secs_without_progress > p
    {
        return Some(format!(
            "the migration made no progress for {p} s (progressTimeout)"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy(name: &str, spec: serde_json::Value) -> MigrationPolicy {
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap()
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn kubevirt_cr_beats_hyperconverged_beats_defaults() {
        let hco: LiveMigrationConfig = serde_json::from_value(
            json!({"bandwidthPerMigration": "64Mi", "progressTimeout": 100}),
        )
        .unwrap();
        let kv: MigrationConfiguration =
            serde_json::from_value(json!({"bandwidthPerMigration": "32Mi", "disableTLS": true}))
                .unwrap();
        let c = cluster_configuration(Some(&hco), Some(&kv));
        assert_eq!(bandwidth_bytes(&c), Some(32 << 20));
        assert_eq!(c.progress_timeout, Some(100));
        assert_eq!(c.other.get("disableTLS"), Some(&json!(true)));
        assert_eq!(
            c.completion_timeout_per_gib,
            Some(DEFAULT_COMPLETION_TIMEOUT_PER_GIB)
        );
        assert_eq!(bandwidth_bytes(&cluster_configuration(None, None)), None);
    }

    #[test]
    fn the_most_specific_policy_wins() {
        let ps = vec![
            policy(
                "b-ns",
                json!({"selectors": {"namespaceSelector": {"team": "a"}},
                "bandwidthPerMigration": "1Mi"}),
            ),
            policy(
                "c-both",
                json!({"selectors": {"namespaceSelector": {"team": "a"},
                "virtualMachineInstanceSelector": {"tier": "db"}}, "allowAutoConverge": true}),
            ),
            policy(
                "a-vmi",
                json!({"selectors": {"virtualMachineInstanceSelector": {"tier": "db"}}}),
            ),
            policy("none", json!({})),
        ];
        let ns = labels(&[("team", "a")]);
        let db = labels(&[("tier", "db")]);
        assert_eq!(
            select_policy(&ps, &db, &ns).and_then(|p| p.metadata.name.as_deref()),
            Some("c-both")
        );
        // One label each: the first name wins the tie.
        assert_eq!(
            select_policy(&ps, &labels(&[]), &ns).and_then(|p| p.metadata.name.as_deref()),
            Some("b-ns")
        );
        assert_eq!(
            select_policy(&ps, &db, &labels(&[])).and_then(|p| p.metadata.name.as_deref()),
            Some("a-vmi")
        );
        assert!(select_policy(&ps, &labels(&[]), &labels(&[])).is_none());
        let (c, name) = effective(&defaults(), select_policy(&ps, &labels(&[]), &ns));
        assert_eq!(name.as_deref(), Some("b-ns"));
        assert_eq!(bandwidth_bytes(&c), Some(1 << 20));
    }

    #[test]
    fn timeouts() {
        let c = defaults();
        assert_eq!(completion_timeout_secs(&c, 128 << 20), Some(150));
        assert_eq!(completion_timeout_secs(&c, 3 << 30), Some(450));
        assert!(timed_out(&c, 128 << 20, 100, 10).is_none());
        assert!(timed_out(&c, 128 << 20, 151, 0).unwrap().contains("150 s"));
        assert!(
            timed_out(&c, 128 << 20, 10, 151)
                .unwrap()
                .contains("progressTimeout")
        );
    }
}
