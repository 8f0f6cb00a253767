//! KubeVirt's node overcommit settings and what they make a VMI ask of its node. The KubeVirt
//! CR's `spec.configuration.developerConfiguration`:
//! - `cpuAllocationRatio` (default 10): a VMI without a CPU request asks 1/ratio of a CPU per
//!   vCPU (100m by default), as KubeVirt's virt-launcher pod requests; a VMI with
//!   `dedicatedCpuPlacement` asks a whole CPU per vCPU whatever the ratio;
//! - `memoryOvercommit` (percent, default 100): a VMI that gives only `memory.guest` gets the
//!   memory request guest × 100 / percent at admission, as KubeVirt's VMI mutating webhook does.
//!
//! The HyperConverged sets both (`resourceRequirements.vmiCPUAllocationRatio`,
//! `higherWorkloadDensity.memoryOvercommitPercentage`). Pure: the scheduler, the quota and the
//! VMI admission read the KubeVirt CR they watch or list and call these.

use serde_json::Value;

/// KubeVirt's default `cpuAllocationRatio`.
pub const DEFAULT_CPU_ALLOCATION_RATIO: u32 = 10;
/// KubeVirt's default `memoryOvercommit` (percent): no overcommit.
pub const DEFAULT_MEMORY_OVERCOMMIT_PERCENT: u32 = 100;

/// The cluster's overcommit settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overcommit {
    /// vCPUs per requested CPU (≥ 1).
    pub cpu_allocation_ratio: u32,
    /// Guest memory as a percentage of the memory request (≥ 10, as HCO allows).
    pub memory_overcommit_percent: u32,
}

impl Default for Overcommit {
    fn default() -> Self {
        Self {
            cpu_allocation_ratio: DEFAULT_CPU_ALLOCATION_RATIO,
            memory_overcommit_percent: DEFAULT_MEMORY_OVERCOMMIT_PERCENT,
        }
    }
}

fn positive(v: Option<&Value>, min: u64) -> Option<u32> {
    v.and_then(Value::as_u64)
        .filter(|n| *n >= min)
        .and_then(|n| u32::try_from(n).ok())
}

impl Overcommit {
    /// The settings of a KubeVirt CR's `spec` (absent or out-of-range values: the defaults).
    pub fn from_kubevirt_spec(spec: Option<&Value>) -> Self {
        let dev = spec.and_then(|s| s.pointer("/configuration/developerConfiguration"));
        let d = Self::default();
        Self {
            cpu_allocation_ratio: positive(dev.and_then(|d| d.get("cpuAllocationRatio")), 1)
                .unwrap_or(d.cpu_allocation_ratio),
            memory_overcommit_percent: positive(dev.and_then(|d| d.get("memoryOvercommit")), 10)
                .unwrap_or(d.memory_overcommit_percent),
        }
    }

    /// The settings of the cluster's KubeVirt CRs: the first one's (ferrovirt keeps one, the
    /// HyperConverged's); the defaults without any.
    pub fn from_kubevirts<'a>(crs: impl IntoIterator<Item = &'a Value>) -> Self {
        crs.into_iter()
            .next()
            .map(|cr| Self::from_kubevirt_spec(cr.get("spec")))
            .unwrap_or_default()
    }

    /// Millicores a VMI without a CPU request asks for `vcpus`: vcpus × 1000 / ratio, rounded
    /// up; a whole CPU per vCPU with dedicated placement.
    pub fn cpu_request_millis(&self, vcpus: u64, dedicated: bool) -> u64 {
        let per_cpu = 1000u64.saturating_mul(vcpus);
        if dedicated {
            return per_cpu;
        }
        let ratio = u64::from(self.cpu_allocation_ratio.max(1));
        per_cpu.div_ceil(ratio)
    }

    /// The memory request for `guest_bytes` of guest memory: guest × 100 / percent.
    pub fn memory_request_bytes(&self, guest_bytes: u64) -> u64 {
        let pct = u128::from(self.memory_overcommit_percent.max(1));
        u64::try_from(u128::from(guest_bytes) * 100 / pct).unwrap_or(u64::MAX)
    }
}

/// Gives a VMI (JSON, before defaulting) that sets `spec.domain.memory.guest` and no memory
/// request the overcommitted request; returns whether it changed anything. Without overcommit
/// (100 %) the defaulting makes the request equal to the guest memory, as before.
pub fn apply_memory_overcommit(vmi: &mut Value, oc: &Overcommit) -> bool {
    if oc.memory_overcommit_percent == DEFAULT_MEMORY_OVERCOMMIT_PERCENT {
        return false;
    }
    let Some(domain) = vmi.pointer_mut("/spec/domain") else {
        return false;
    };
    let set = |v: Option<&Value>| v.is_some_and(|v| !v.is_null());
    if set(domain.pointer("/resources/requests/memory"))
        || set(domain.pointer("/resources/limits/memory"))
    {
        return false;
    }
    let Some(guest) = domain
        .pointer("/memory/guest")
        .and_then(Value::as_str)
        .and_then(|q| crate::quantity::bytes(q).ok())
    else {
        return false;
    };
    let request = format_bytes(oc.memory_request_bytes(guest));
    let Some(d) = domain.as_object_mut() else {
        return false;
    };
    let resources = d
        .entry("resources")
        .or_insert_with(|| Value::Object(Default::default()));
    if resources.is_null() {
        *resources = Value::Object(Default::default());
    }
    let Some(r) = resources.as_object_mut() else {
        return false;
    };
    let requests = r
        .entry("requests")
        .or_insert_with(|| Value::Object(Default::default()));
    if requests.is_null() {
        *requests = Value::Object(Default::default());
    }
    match requests.as_object_mut() {
        Some(q) => {
            q.insert("memory".into(), Value::String(request));
            true
        }
        None => false,
    }
}

/// Bytes as a Kubernetes quantity: the largest binary suffix that divides it, else plain.
fn format_bytes(b: u64) -> String {
    for (shift, suffix) in [(40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")] {
        if b != 0 && b.is_multiple_of(1u64 << shift) {
            return format!("{}{suffix}", b >> shift);
        }
    }
    b.to_string()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn settings_from_the_kubevirt_cr() {
        assert_eq!(Overcommit::from_kubevirts([]), Overcommit::default());
        let cr = json!({"spec": {"configuration": {"developerConfiguration":
            {"cpuAllocationRatio": 4, "memoryOvercommit": 150}}}});
        let oc = Overcommit::from_kubevirts([&cr]);
        assert_eq!(
            (oc.cpu_allocation_ratio, oc.memory_overcommit_percent),
            (4, 150)
        );
        // Out of range: the defaults.
        let bad = json!({"spec": {"configuration": {"developerConfiguration":
            {"cpuAllocationRatio": 0, "memoryOvercommit": 5}}}});
        assert_eq!(Overcommit::from_kubevirts([&bad]), Overcommit::default());
    }

    #[test]
    fn cpu_requests_follow_the_ratio() {
        let oc = Overcommit::default();
        assert_eq!(oc.cpu_request_millis(1, false), 100);
        assert_eq!(oc.cpu_request_millis(4, false), 400);
        assert_eq!(oc.cpu_request_millis(4, true), 4000);
        let three = Overcommit {
            cpu_allocation_ratio: 3,
            ..Overcommit::default()
        };
        // 1000/3 rounds up: never less than the ratio allows.
        assert_eq!(three.cpu_request_millis(1, false), 334);
        let one = Overcommit {
            cpu_allocation_ratio: 1,
            ..Overcommit::default()
        };
        assert_eq!(one.cpu_request_millis(2, false), 2000);
    }

    #[test]
    fn memory_overcommit_sets_the_request() {
        let oc = Overcommit {
            memory_overcommit_percent: 200,
            ..Overcommit::default()
        };
        let mut v = json!({"spec": {"domain": {"memory": {"guest": "1Gi"}}}});
        assert!(apply_memory_overcommit(&mut v, &oc));
        assert_eq!(
            v["spec"]["domain"]["resources"]["requests"]["memory"],
            "512Mi"
        );
        // 150 %: 1Gi × 100 / 150, in bytes.
        let oc = Overcommit {
            memory_overcommit_percent: 150,
            ..Overcommit::default()
        };
        let mut v = json!({"spec": {"domain": {"memory": {"guest": "1Gi"},
            "resources": null}}});
        assert!(apply_memory_overcommit(&mut v, &oc));
        assert_eq!(
            v["spec"]["domain"]["resources"]["requests"]["memory"],
            "715827882"
        );
        // A request (or a limit) the user gave is kept; nothing at 100 %.
        let mut v = json!({"spec": {"domain": {"memory": {"guest": "1Gi"},
            "resources": {"requests": {"memory": "1Gi"}}}}});
        assert!(!apply_memory_overcommit(&mut v, &oc));
        let mut v = json!({"spec": {"domain": {"memory": {"guest": "1Gi"}}}});
        assert!(!apply_memory_overcommit(&mut v, &Overcommit::default()));
        assert!(v["spec"]["domain"].get("resources").is_none());
    }
}
