//! Resource accounting: what a VMI requests (CPU in millicores, memory in bytes, KVM), what a
//! node offers (allocatable) and whether a VMI fits beside the VMIs already bound there.

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use ferrovirt_api::kubevirt::overcommit::Overcommit;
use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;

/// Memory added to every VMI's request for what runs beside the guest: the launcher process,
/// QEMU itself (device emulation, I/O buffers, page tables) and its sockets. KubeVirt computes a
/// per-VMI overhead of roughly this size; ferrovirt uses a fixed constant: 128 MiB.
pub const VMI_MEMORY_OVERHEAD_BYTES: u64 = 128 * 1024 * 1024;

/// The extended resource KubeVirt's launcher pods request for `/dev/kvm`.
pub const KVM_RESOURCE: &str = "devices.kubevirt.io/kvm";
/// Node label (and VMI nodeSelector/annotation key) for hardware acceleration.
pub const ACCEL_LABEL: &str = "ferrovirt.io/accel";
/// Value of [`ACCEL_LABEL`] on nodes where KVM works.
pub const ACCEL_KVM: &str = "kvm";

/// CPU and memory in integral units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resources {
    pub cpu_millis: u64,
    pub memory_bytes: u64,
}

impl std::ops::AddAssign for Resources {
    fn add_assign(&mut self, rhs: Self) {
        self.cpu_millis = self.cpu_millis.saturating_add(rhs.cpu_millis);
        self.memory_bytes = self.memory_bytes.saturating_add(rhs.memory_bytes);
    }
}

/// Parse a Kubernetes quantity (`1Gi`, `500m`, `2`, `1.5e3`) into a number of base units.
pub fn parse_quantity(s: &str) -> Option<f64> {
    ferrovirt_api::quantity::parse(s).ok()
}

/// Millicores of a quantity, exact and rounded up (`9m` is 9).
fn millis(q: &Quantity) -> Option<u64> {
    ferrovirt_api::quantity::millis(&q.0).ok()
}

/// Bytes of a quantity, exact and rounded up.
fn bytes(q: &Quantity) -> Option<u64> {
    ferrovirt_api::quantity::bytes(&q.0).ok()
}

/// What a VMI asks of its node: `spec.domain.resources.requests` when set, else guest memory
/// (`domain.memory.guest`) and the CPU share of its vCPUs (cores × sockets × threads, each
/// defaulting to 1) under the cluster's `cpuAllocationRatio` ([`Overcommit`]: 100m per vCPU by
/// default, as KubeVirt's launcher pods request). The memory overhead is added by the caller
/// ([`SchedulerOptions`](super::SchedulerOptions)).
pub fn vmi_requests(vmi: &VirtualMachineInstance, overcommit: &Overcommit) -> Resources {
    let Some(spec) = vmi.spec.as_ref() else {
        return Resources::default();
    };
    let domain = &spec.domain;
    let requests = domain.resources.as_ref().and_then(|r| r.requests.as_ref());
    let cpu_millis = requests
        .and_then(|r| r.get("cpu"))
        .and_then(millis)
        .unwrap_or_else(|| {
            let dedicated = domain
                .cpu
                .as_ref()
                .and_then(|c| c.dedicated_cpu_placement)
                .unwrap_or(false);
            overcommit.cpu_request_millis(ferrovirt_api::expand::vcpus(spec), dedicated)
        });
    let memory_bytes = requests
        .and_then(|r| r.get("memory"))
        .and_then(bytes)
        .or_else(|| {
            domain
                .memory
                .as_ref()
                .and_then(|m| m.guest.as_ref())
                .and_then(bytes)
        })
        .unwrap_or(0);
    Resources {
        cpu_millis,
        memory_bytes,
    }
}

/// A node's allocatable CPU and memory (falling back to capacity).
pub fn node_allocatable(node: &Node) -> Resources {
    let status = node.status.as_ref();
    let get = |name: &str| {
        status
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get(name))
            .or_else(|| {
                status
                    .and_then(|s| s.capacity.as_ref())
                    .and_then(|c| c.get(name))
            })
    };
    Resources {
        cpu_millis: get("cpu").and_then(millis).unwrap_or(0),
        memory_bytes: get("memory").and_then(bytes).unwrap_or(0),
    }
}

/// Whether the VMI needs KVM: a `ferrovirt.io/accel: kvm` nodeSelector or annotation, or a
/// request/limit of `devices.kubevirt.io/kvm` (or a nodeSelector on that key).
pub fn vmi_needs_kvm(vmi: &VirtualMachineInstance) -> bool {
    let annotated = vmi
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ACCEL_LABEL))
        .is_some_and(|v| v == ACCEL_KVM);
    let Some(spec) = vmi.spec.as_ref() else {
        return annotated;
    };
    let selected = spec.node_selector.as_ref().is_some_and(|s| {
        s.get(ACCEL_LABEL).is_some_and(|v| v == ACCEL_KVM) || s.contains_key(KVM_RESOURCE)
    });
    let requested = spec.domain.resources.as_ref().is_some_and(|r| {
        [r.requests.as_ref(), r.limits.as_ref()]
            .into_iter()
            .flatten()
            .any(|m| m.contains_key(KVM_RESOURCE))
    });
    annotated || selected || requested
}

/// Whether the node offers KVM: labelled `ferrovirt.io/accel=kvm`.
pub fn node_has_kvm(node: &Node) -> bool {
    node.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(ACCEL_LABEL))
        .is_some_and(|v| v == ACCEL_KVM)
}

/// Kubernetes' NodeResourcesFit reasons (`Insufficient cpu`, `Insufficient memory`,
/// `Insufficient devices.kubevirt.io/kvm`) for placing `want` on a node with `allocatable`
/// of which `used` is taken. Empty when it fits.
pub fn insufficient(want: Resources, used: Resources, allocatable: Resources) -> Vec<String> {
    let mut reasons = Vec::new();
    if want.cpu_millis > allocatable.cpu_millis.saturating_sub(used.cpu_millis) {
        reasons.push("Insufficient cpu".to_string());
    }
    if want.memory_bytes > allocatable.memory_bytes.saturating_sub(used.memory_bytes) {
        reasons.push("Insufficient memory".to_string());
    }
    reasons
}

/// Kubernetes' LeastAllocated score (0–100): the mean free fraction of CPU and memory after
/// placing the VMI.
pub fn least_requested_score(after: Resources, allocatable: Resources) -> i64 {
    let part = |used: u64, cap: u64| -> i64 {
        if cap == 0 || used > cap {
            0
        } else {
            ((cap - used) as u128 * 100 / cap as u128) as i64
        }
    };
    (part(after.cpu_millis, allocatable.cpu_millis)
        + part(after.memory_bytes, allocatable.memory_bytes))
        / 2
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::testutil::{node, vmi};

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("1Gi"), Some(1073741824.0));
        assert_eq!(parse_quantity("500m"), Some(0.5));
        assert_eq!(parse_quantity("2"), Some(2.0));
        assert_eq!(parse_quantity("1.5e3"), Some(1500.0));
        assert_eq!(parse_quantity("1G"), Some(1e9));
        assert_eq!(parse_quantity("abc"), None);
        assert_eq!(parse_quantity("1GB"), None);
    }

    #[test]
    fn requests_from_resources_or_guest() {
        let oc = Overcommit::default();
        let v = vmi("a").requests("1500m", "1Gi").build();
        assert_eq!(
            vmi_requests(&v, &oc),
            Resources {
                cpu_millis: 1500,
                memory_bytes: 1 << 30
            }
        );
        // Four vCPUs at KubeVirt's default ratio 10: 400m.
        let v = vmi("b").guest("2Gi").topology(2, 2, 1).build();
        assert_eq!(
            vmi_requests(&v, &oc),
            Resources {
                cpu_millis: 400,
                memory_bytes: 2 << 30
            }
        );
        let v = vmi("c").build();
        assert_eq!(vmi_requests(&v, &oc).cpu_millis, 100);
        let one = Overcommit {
            cpu_allocation_ratio: 1,
            ..oc
        };
        assert_eq!(vmi_requests(&v, &one).cpu_millis, 1000);
        // Exact: 9m stays 9 millicores (a float made it 10), 0.1Gi rounds up once.
        let v = vmi("d").requests("9m", "0.1Gi").build();
        assert_eq!(
            vmi_requests(&v, &oc),
            Resources {
                cpu_millis: 9,
                memory_bytes: 107_374_183
            }
        );
    }

    #[test]
    fn allocatable_and_fit() {
        let n = node("n").alloc("4", "8Gi").build();
        let a = node_allocatable(&n);
        assert_eq!(a.cpu_millis, 4000);
        assert_eq!(a.memory_bytes, 8 << 30);
        let want = Resources {
            cpu_millis: 1000,
            memory_bytes: 4 << 30,
        };
        assert!(insufficient(want, Resources::default(), a).is_empty());
        let used = Resources {
            cpu_millis: 3500,
            memory_bytes: 5 << 30,
        };
        assert_eq!(
            insufficient(want, used, a),
            vec!["Insufficient cpu", "Insufficient memory"]
        );
    }

    #[test]
    fn kvm_requirement() {
        assert!(!vmi_needs_kvm(&vmi("a").build()));
        assert!(vmi_needs_kvm(
            &vmi("a").annotation(ACCEL_LABEL, "kvm").build()
        ));
        assert!(vmi_needs_kvm(
            &vmi("a").selector(ACCEL_LABEL, "kvm").build()
        ));
        assert!(vmi_needs_kvm(
            &vmi("a").requests_extra(KVM_RESOURCE, "1").build()
        ));
        assert!(node_has_kvm(&node("n").label(ACCEL_LABEL, "kvm").build()));
        assert!(!node_has_kvm(&node("n").build()));
    }

    #[test]
    fn least_requested() {
        let a = Resources {
            cpu_millis: 4000,
            memory_bytes: 1000,
        };
        let s = least_requested_score(
            Resources {
                cpu_millis: 2000,
                memory_bytes: 500,
            },
            a,
        );
        assert_eq!(s, 50);
        assert_eq!(least_requested_score(Resources::default(), a), 100);
    }
}
