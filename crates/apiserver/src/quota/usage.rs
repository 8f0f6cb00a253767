//! ResourceQuota decisions (pure): what one new object charges ([`charged`]: object counts
//! `count/<plural>[.<group>]` and the legacy names, a VMI's launcher-pod `requests.cpu` /
//! `requests.memory` and `pods`, a claim's `requests.storage` and `persistentvolumeclaims`),
//! whether a quota admits it ([`admit`], with Kubernetes' `exceeded quota: …` message), and the
//! quantities in Kubernetes' canonical notation. Values are kept in thousandths (milli-units)
//! so counts, cores and bytes share one exact integer type.

use std::collections::BTreeMap;

use ferrovirt_api::kubevirt::overcommit::Overcommit;
use serde_json::Value;

/// Resource name → amount in thousandths.
pub type Usage = BTreeMap<String, i128>;

/// Thousandths of a quantity string; None when it does not parse.
pub fn milli(s: &str) -> Option<i128> {
    ferrovirt_api::quantity::exact(s).ok()?.scaled_ceil(3)
}

/// Thousandths of a JSON quantity (string or number).
fn milli_of(v: &Value) -> Option<i128> {
    match v {
        Value::String(s) => milli(s),
        Value::Number(n) => milli(&n.to_string()),
        _ => None,
    }
}

/// Kubernetes' canonical form of an amount: binary suffixes for byte resources that divide
/// evenly, `m` for fractions, plain integers otherwise.
pub fn format(resource: &str, m: i128) -> String {
    if m % 1000 != 0 {
        return format!("{m}m");
    }
    let v = m / 1000;
    let bytes = resource.contains("memory") || resource.contains("storage");
    if bytes && v != 0 {
        for (suffix, unit) in [
            ("Ei", 1i128 << 60),
            ("Pi", 1 << 50),
            ("Ti", 1 << 40),
            ("Gi", 1 << 30),
            ("Mi", 1 << 20),
            ("Ki", 1 << 10),
        ] {
            if v % unit == 0 {
                return format!("{}{suffix}", v / unit);
            }
        }
    }
    v.to_string()
}

/// `a=1,b=2Gi` (sorted by name), as Kubernetes prints a ResourceList in quota messages.
pub fn pretty(u: &Usage) -> String {
    u.iter()
        .map(|(k, v)| format!("{k}={}", format(k, *v)))
        .collect::<Vec<_>>()
        .join(",")
}

/// Names Kubernetes also counts under their short, pre-`count/` names.
const LEGACY_COUNTS: &[&str] = &[
    "configmaps",
    "persistentvolumeclaims",
    "pods",
    "replicationcontrollers",
    "resourcequotas",
    "services",
    "secrets",
];

fn add(u: &mut Usage, k: &str, m: i128) {
    *u.entry(k.to_string()).or_default() += m;
}

/// The number of vCPUs of a VMI spec (sockets × cores × threads, each defaulting to 1).
fn vcpus(spec: &Value) -> u64 {
    let cpu = &spec["domain"]["cpu"];
    let n = |k: &str| cpu[k].as_u64().filter(|v| *v > 0).unwrap_or(1);
    n("sockets")
        .saturating_mul(n("cores"))
        .saturating_mul(n("threads"))
}

/// What creating `obj` of `group`/`plural` charges against a namespace's quotas.
///
/// A VMI is charged as its virt-launcher Pod would be: `pods`, `requests.cpu` (the VMI's
/// `resources.requests.cpu`, else the CPU share of its vCPUs under the KubeVirt CR's
/// `cpuAllocationRatio`, [`Overcommit`]: 100m per vCPU by default) and `requests.memory`
/// (`resources.requests.memory`, else `memory.guest`); without the launcher's memory overhead.
pub fn charged(group: &str, plural: &str, obj: &Value, overcommit: &Overcommit) -> Usage {
    let mut u = Usage::new();
    let count = if group.is_empty() {
        format!("count/{plural}")
    } else {
        format!("count/{plural}.{group}")
    };
    add(&mut u, &count, 1000);
    if group.is_empty() && LEGACY_COUNTS.contains(&plural) {
        add(&mut u, plural, 1000);
    }
    match (group, plural) {
        ("kubevirt.io", "virtualmachineinstances") => {
            let spec = &obj["spec"];
            add(&mut u, "pods", 1000);
            add(&mut u, "count/pods", 1000);
            let req = &spec["domain"]["resources"]["requests"];
            let dedicated = spec["domain"]["cpu"]["dedicatedCpuPlacement"] == true;
            let cpu = milli_of(&req["cpu"]).unwrap_or_else(|| {
                i128::from(overcommit.cpu_request_millis(vcpus(spec), dedicated))
            });
            let mem = milli_of(&req["memory"])
                .or_else(|| milli_of(&spec["domain"]["memory"]["guest"]))
                .unwrap_or(0);
            for (k, v) in [
                ("requests.cpu", cpu),
                ("cpu", cpu),
                ("requests.memory", mem),
                ("memory", mem),
            ] {
                add(&mut u, k, v);
            }
        }
        ("", "persistentvolumeclaims") => {
            let s = milli_of(&obj["spec"]["resources"]["requests"]["storage"]).unwrap_or(0);
            add(&mut u, "requests.storage", s);
        }
        _ => {}
    }
    u
}

/// The resources a live migration's target (a second virt-launcher Pod) holds.
const TARGET_RESOURCES: &[&str] = &[
    "pods",
    "count/pods",
    "requests.cpu",
    "cpu",
    "requests.memory",
    "memory",
];

/// What the target of a live migration of `vmi` charges: the VMI's launcher-Pod resources a
/// second time (`pods`, `requests.cpu`, `requests.memory`, …), not its object count.
pub fn migration_target(vmi: &Value, overcommit: &Overcommit) -> Usage {
    charged("kubevirt.io", "virtualmachineinstances", vmi, overcommit)
        .into_iter()
        .filter(|(k, _)| TARGET_RESOURCES.contains(&k.as_str()))
        .collect()
}

/// Whether a VirtualMachineInstanceMigration in `phase` holds its target: from Scheduling
/// (the target is being chosen and started) until it Succeeds or Fails.
pub fn migration_holds_target(phase: &str) -> bool {
    matches!(
        phase,
        "Scheduling" | "Scheduled" | "PreparingTarget" | "TargetReady" | "Running"
    )
}

/// What a VirtualMachineInstanceMigration's update from `old` to `new` does to quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigrationQuota {
    /// It starts holding a target: charge it before the write.
    Charge,
    /// It stops holding one (Succeeded, Failed): recount after the write.
    Release,
    Nothing,
}

/// [`MigrationQuota`] for an update of a migration's status. Pure.
pub fn migration_transition(old: &Value, new: &Value) -> MigrationQuota {
    let holds = |o: &Value| migration_holds_target(o["status"]["phase"].as_str().unwrap_or(""));
    match (holds(old), holds(new)) {
        (false, true) => MigrationQuota::Charge,
        (true, false) => MigrationQuota::Release,
        _ => MigrationQuota::Nothing,
    }
}

/// A quota's `hard` (or `used`) as [`Usage`]; entries that do not parse are left out.
pub fn usage_of(list: &Value) -> Usage {
    list.as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| milli_of(v).map(|m| (k.clone(), m)))
                .collect()
        })
        .unwrap_or_default()
}

/// [`Usage`] as a ResourceList JSON object.
pub fn to_json(u: &Usage) -> Value {
    Value::Object(
        u.iter()
            .map(|(k, v)| (k.clone(), Value::String(format(k, *v))))
            .collect(),
    )
}

/// Whether quota `name` with `hard` limits and `used` so far admits `requested`: the new
/// `used` (every hard resource, the request added) or Kubernetes' message naming the
/// resources it would exceed. A quota that limits nothing requested is unchanged.
pub fn admit(name: &str, hard: &Usage, used: &Usage, requested: &Usage) -> Result<Usage, String> {
    let charged: Vec<&String> = hard
        .keys()
        .filter(|k| requested.get(*k).is_some_and(|v| *v > 0))
        .collect();
    let get = |u: &Usage, k: &str| u.get(k).copied().unwrap_or(0);
    let exceeded: Vec<&String> = charged
        .iter()
        .copied()
        .filter(|k| get(used, k) + get(requested, k) > get(hard, k))
        .collect();
    if !exceeded.is_empty() {
        let mask =
            |u: &Usage| -> Usage { exceeded.iter().map(|k| ((*k).clone(), get(u, k))).collect() };
        return Err(format!(
            "exceeded quota: {name}, requested: {}, used: {}, limited: {}",
            pretty(&mask(requested)),
            pretty(&mask(used)),
            pretty(&mask(hard))
        ));
    }
    Ok(hard
        .keys()
        .map(|k| (k.clone(), get(used, k) + get(requested, k)))
        .collect())
}

/// `used` after giving back `refund` (never below zero), for every hard resource.
pub fn release(hard: &Usage, used: &Usage, refund: &Usage) -> Usage {
    let get = |u: &Usage, k: &str| u.get(k).copied().unwrap_or(0);
    hard.keys()
        .map(|k| (k.clone(), (get(used, k) - get(refund, k)).max(0)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn u(pairs: &[(&str, &str)]) -> Usage {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), milli(v).unwrap()))
            .collect()
    }

    #[test]
    fn a_vmi_is_charged_as_its_launcher_pod() {
        let vmi = json!({"spec": {"domain": {"cpu": {"cores": 2},
            "resources": {"requests": {"memory": "1Gi"}}, "memory": {"guest": "512Mi"}}}});
        let c = charged(
            "kubevirt.io",
            "virtualmachineinstances",
            &vmi,
            &Overcommit::default(),
        );
        assert_eq!(c["requests.cpu"], 200);
        assert_eq!(c["requests.memory"], 1000 * (1 << 30));
        // The KubeVirt CR's cpuAllocationRatio 1: a CPU per vCPU.
        let one = Overcommit {
            cpu_allocation_ratio: 1,
            ..Overcommit::default()
        };
        let c = charged("kubevirt.io", "virtualmachineinstances", &vmi, &one);
        assert_eq!(c["requests.cpu"], 2000);
        assert_eq!(c["pods"], 1000);
        assert_eq!(c["count/virtualmachineinstances.kubevirt.io"], 1000);
        let guest_only = json!({"spec": {"domain": {"memory": {"guest": "128Mi"},
            "resources": {"requests": {"cpu": "1500m"}}}}});
        let c = charged(
            "kubevirt.io",
            "virtualmachineinstances",
            &guest_only,
            &Overcommit::default(),
        );
        assert_eq!(format("requests.memory", c["requests.memory"]), "128Mi");
        assert_eq!(format("requests.cpu", c["requests.cpu"]), "1500m");
        let pvc = json!({"spec": {"resources": {"requests": {"storage": "10Gi"}}}});
        let c = charged("", "persistentvolumeclaims", &pvc, &Overcommit::default());
        assert_eq!(format("requests.storage", c["requests.storage"]), "10Gi");
        assert_eq!(c["persistentvolumeclaims"], 1000);
        assert_eq!(c["count/persistentvolumeclaims"], 1000);
        let vm = charged(
            "kubevirt.io",
            "virtualmachines",
            &json!({}),
            &Overcommit::default(),
        );
        assert_eq!(
            vm.keys().collect::<Vec<_>>(),
            ["count/virtualmachines.kubevirt.io"]
        );
    }

    #[test]
    fn the_last_slot_is_given_once_with_kubernetes_message() {
        let hard = u(&[
            ("count/virtualmachines.kubevirt.io", "2"),
            ("requests.memory", "1Gi"),
        ]);
        let vm = charged(
            "kubevirt.io",
            "virtualmachines",
            &json!({}),
            &Overcommit::default(),
        );
        let used = admit("q", &hard, &Usage::new(), &vm).unwrap();
        let used = admit("q", &hard, &used, &vm).unwrap();
        assert_eq!(used["count/virtualmachines.kubevirt.io"], 2000);
        assert_eq!(used["requests.memory"], 0);
        assert_eq!(
            admit("q", &hard, &used, &vm).unwrap_err(),
            "exceeded quota: q, requested: count/virtualmachines.kubevirt.io=1, used: count/virtualmachines.kubevirt.io=2, limited: count/virtualmachines.kubevirt.io=2"
        );
        // Memory: only the exceeded resource is named.
        let vmi = json!({"spec": {"domain": {"memory": {"guest": "768Mi"}}}});
        let req = charged(
            "kubevirt.io",
            "virtualmachineinstances",
            &vmi,
            &Overcommit::default(),
        );
        let used = admit("q", &hard, &Usage::new(), &req).unwrap();
        assert_eq!(
            admit("q", &hard, &used, &req).unwrap_err(),
            "exceeded quota: q, requested: requests.memory=768Mi, used: requests.memory=768Mi, limited: requests.memory=1Gi"
        );
        // Releasing gives the slot back, never below zero.
        let back = release(&hard, &used, &req);
        assert_eq!(back["requests.memory"], 0);
        assert_eq!(release(&hard, &back, &req)["requests.memory"], 0);
    }

    #[test]
    fn quantities_round_trip_in_canonical_form() {
        for s in ["2", "1Gi", "500m", "3Mi", "0"] {
            assert_eq!(format("requests.memory", milli(s).unwrap()), s);
        }
        assert_eq!(format("requests.cpu", milli("2").unwrap()), "2");
        assert_eq!(
            format("requests.storage", milli("1G").unwrap()),
            "1000000000"
        );
        assert_eq!(
            usage_of(&json!({"pods": "3", "requests.cpu": "1", "bad": "x"})).len(),
            2
        );
        assert_eq!(
            to_json(&u(&[("requests.memory", "1Gi")])),
            json!({"requests.memory": "1Gi"})
        );
    }

    #[test]
    fn a_migration_target_charges_the_launcher_pod_again() {
        let vmi = json!({"spec": {"domain": {"memory": {"guest": "128Mi"},
            "cpu": {"cores": 2}}}});
        let t = migration_target(&vmi, &Overcommit::default());
        assert_eq!(
            t.get("requests.memory"),
            Some(&(128i128 * 1024 * 1024 * 1000))
        );
        assert_eq!(t.get("pods"), Some(&1000));
        assert_eq!(t.get("requests.cpu"), Some(&200));
        // The VMI object is not counted again.
        assert!(!t.contains_key("count/virtualmachineinstances.kubevirt.io"));
        let hard = u(&[("requests.memory", "200Mi")]);
        let used = u(&[("requests.memory", "128Mi")]);
        let e = admit("q", &hard, &used, &t).unwrap_err();
        assert_eq!(
            e,
            "exceeded quota: q, requested: requests.memory=128Mi, used: requests.memory=128Mi, limited: requests.memory=200Mi"
        );
        let hard = u(&[("requests.memory", "300Mi")]);
        assert!(admit("q", &hard, &used, &t).is_ok());
    }

    #[test]
    fn migration_phases_that_hold_a_target() {
        let m = |p: &str| json!({"status": {"phase": p}});
        use MigrationQuota::*;
        assert_eq!(
            migration_transition(&m("Pending"), &m("Scheduling")),
            Charge
        );
        assert_eq!(migration_transition(&json!({}), &m("Scheduling")), Charge);
        assert_eq!(
            migration_transition(&m("Scheduling"), &m("Scheduled")),
            Nothing
        );
        assert_eq!(
            migration_transition(&m("Running"), &m("Succeeded")),
            Release
        );
        assert_eq!(
            migration_transition(&m("TargetReady"), &m("Failed")),
            Release
        );
        // Pending (also when its rejection condition is written) and finished ones hold none.
        assert_eq!(migration_transition(&m("Pending"), &m("Pending")), Nothing);
        assert_eq!(migration_transition(&m("Pending"), &m("Failed")), Nothing);
        assert_eq!(
            migration_transition(&m("Succeeded"), &m("Succeeded")),
            Nothing
        );
    }
}
