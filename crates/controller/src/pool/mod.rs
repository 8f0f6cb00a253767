//! The VirtualMachinePool controller's pure part: given a pool and the VMs it controls,
//! [`decide`] which VMs to create (named `<pool>-<index>`, lowest free index first, owned by
//! the pool, labelled `kubevirt.io/vmpool`), which to delete on scale-in (by the selection
//! policy's sort order; highest index first by default), which to bring up to date with the
//! template (opportunistic: the VM object is updated, its running VMI changes at its next
//! start), and the pool's status. A paused pool changes nothing but its `ReplicaPaused`
//! condition. The loop that applies this is `crate::runtime::pool_controller`.

use std::collections::BTreeSet;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};
use serde_json::{Value, json};

use ferrovirt_api::kubevirt::pool::{
    POOL_GROUP, POOL_LABEL, POOL_VERSION, VirtualMachinePool, VirtualMachinePoolStatus,
};
use ferrovirt_api::kubevirt::vm::VirtualMachine;
use ferrovirt_api::kubevirt::vmi::Condition;

use crate::conditions;

#[cfg(test)]
mod tests;

/// Annotation on each VM: the hash of the template it was made from.
pub const TEMPLATE_HASH_ANNOTATION: &str = "ferrovirt.io/pool-template-hash";
/// Condition set while the pool is paused.
pub const PAUSED_CONDITION: &str = "ReplicaPaused";
/// Condition set when a VM could not be created or deleted.
pub const FAILURE_CONDITION: &str = "ReplicaFailure";

/// What the pool controller does next.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PoolDecision {
    /// Complete VirtualMachine objects to create.
    pub create: Vec<Value>,
    /// (name, uid) of VMs to delete.
    pub delete: Vec<(String, String)>,
    /// VMs to replace with an up-to-date version (complete objects, with resourceVersion).
    pub update: Vec<Value>,
    /// The pool's new status.
    pub status: VirtualMachinePoolStatus,
}

/// The index in a VM name `<pool>-<index>`.
pub fn index_of(pool: &str, vm: &str) -> Option<u32> {
    vm.strip_prefix(pool)?.strip_prefix('-')?.parse().ok()
}

/// The label selector in its string form (`a=b,c in (d,e),!f`), for `status.labelSelector`.
pub fn selector_string(sel: &LabelSelector) -> String {
    let mut parts: Vec<String> = sel
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for r in sel.match_expressions.iter().flatten() {
        let values = r.values.clone().unwrap_or_default().join(",");
        parts.push(match r.operator.as_str() {
            "In" => format!("{} in ({values})", r.key),
            "NotIn" => format!("{} notin ({values})", r.key),
            "Exists" => r.key.clone(),
            "DoesNotExist" => format!("!{}", r.key),
            other => format!("{} {other} ({values})", r.key),
        });
    }
    parts.join(",")
}

/// A stable (FNV-1a, 64-bit) hash of the template, hex.
pub fn template_hash(pool: &VirtualMachinePool) -> String {
    let t = pool
        .spec
        .as_ref()
        .and_then(|s| s.virtual_machine_template.as_ref());
    let text = serde_json::to_string(&t).unwrap_or_default();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn name_generation(pool: &VirtualMachinePool) -> (bool, bool) {
    let g = pool.spec.as_ref().and_then(|s| s.name_generation.as_ref());
    (
        g.and_then(|g| g.append_index_to_config_map_refs)
            .unwrap_or(false),
        g.and_then(|g| g.append_index_to_secret_refs)
            .unwrap_or(false),
    )
}

/// The VM for replica `index` (a complete object; no resourceVersion).
pub fn vm_for(pool: &VirtualMachinePool, index: u32) -> Value {
    let pool_name = pool.metadata.name.clone().unwrap_or_default();
    let template = pool
        .spec
        .as_ref()
        .and_then(|s| s.virtual_machine_template.clone())
        .unwrap_or_default();
    let meta = template.metadata.unwrap_or_default();
    let mut labels = meta.labels.unwrap_or_default();
    labels.insert(POOL_LABEL.into(), pool_name.clone());
    let mut annotations = meta.annotations.unwrap_or_default();
    annotations.insert(TEMPLATE_HASH_ANNOTATION.into(), template_hash(pool));
    let mut spec = serde_json::to_value(template.spec.unwrap_or_default()).unwrap_or_default();
    // The VMIs carry the pool label too.
    if let Some(t) = spec.get_mut("template").and_then(Value::as_object_mut) {
        let m = t.entry("metadata").or_insert_with(|| json!({}));
        if let Some(m) = m.as_object_mut() {
            let l = m.entry("labels").or_insert_with(|| json!({}));
            if let Some(l) = l.as_object_mut() {
                l.insert(POOL_LABEL.into(), json!(pool_name));
            }
        }
    }
    let (cms, secrets) = name_generation(pool);
    if let Some(vols) = spec
        .pointer_mut("/template/spec/volumes")
        .and_then(Value::as_array_mut)
    {
        for v in vols {
            let mut suffix = |ptr: &str| {
                if let Some(Value::String(s)) = v.pointer_mut(ptr) {
                    *s = format!("{s}-{index}");
                }
            };
            if cms {
                suffix("/configMap/name");
            }
            if secrets {
                suffix("/secret/secretName");
            }
        }
    }
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {
            "name": format!("{pool_name}-{index}"),
            "namespace": pool.metadata.namespace,
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [{
                "apiVersion": format!("{POOL_GROUP}/{POOL_VERSION}"),
                "kind": "VirtualMachinePool",
                "name": pool_name,
                "uid": pool.metadata.uid.clone().unwrap_or_default(),
                "controller": true,
                "blockOwnerDeletion": true,
            }],
        },
        "spec": spec,
    })
}

/// Whether `vm` is controlled by `pool`.
pub fn controlled_by(vm: &VirtualMachine, pool: &VirtualMachinePool) -> bool {
    vm.metadata.owner_references.iter().flatten().any(|o| {
        o.controller == Some(true)
            && o.kind == "VirtualMachinePool"
            && Some(&o.uid) == pool.metadata.uid.as_ref()
    })
}

/// The order in which scale-in removes VMs (first = removed first).
fn scale_in_order(pool: &VirtualMachinePool, vms: &mut [&VirtualMachine]) {
    let name = pool.metadata.name.clone().unwrap_or_default();
    let policy = pool
        .spec
        .as_ref()
        .and_then(|s| s.scale_in_strategy.as_ref())
        .and_then(|s| s.proactive.as_ref())
        .and_then(|p| p.selection_policy.as_ref())
        .and_then(|p| p.sort_policy.clone())
        .unwrap_or_else(|| "DescendingOrder".into());
    let idx = |vm: &VirtualMachine| index_of(&name, vm.metadata.name.as_deref().unwrap_or(""));
    let created = |vm: &VirtualMachine| vm.metadata.creation_timestamp.clone().map(|t| t.0);
    match policy.as_str() {
        "AscendingOrder" => vms.sort_by_key(|v| idx(v)),
        "Newest" => vms.sort_by_key(|v| std::cmp::Reverse((created(v), idx(v)))),
        "Oldest" => vms.sort_by_key(|v| (created(v), idx(v))),
        "Random" => vms.sort_by_key(|v| {
            // The uid is random: ordering by it picks VMs at random, yet repeatably.
            v.metadata.uid.clone().unwrap_or_default()
        }),
        _ => vms.sort_by_key(|v| std::cmp::Reverse(idx(v))),
    }
}

fn scale_in_is_proactive(pool: &VirtualMachinePool) -> bool {
    pool.spec
        .as_ref()
        .and_then(|s| s.scale_in_strategy.as_ref())
        .is_none_or(|s| s.unmanaged.is_none() && s.opportunistic.is_none())
}

fn updates_managed(pool: &VirtualMachinePool) -> bool {
    pool.spec
        .as_ref()
        .and_then(|s| s.update_strategy.as_ref())
        .is_none_or(|u| u.unmanaged.is_none())
}

fn is_deleting(vm: &VirtualMachine) -> bool {
    vm.metadata.deletion_timestamp.is_some()
}

/// Decide for `pool` given the VMs it controls (`vms`, including ones being deleted).
pub fn decide(pool: &VirtualMachinePool, vms: &[VirtualMachine], now: &Time) -> PoolDecision {
    let spec = pool.spec.clone().unwrap_or_default();
    let name = pool.metadata.name.clone().unwrap_or_default();
    let desired = spec.replicas.unwrap_or(1).max(0) as usize;
    let mut active: Vec<&VirtualMachine> = vms.iter().filter(|v| !is_deleting(v)).collect();
    let mut d = PoolDecision::default();
    let mut conds: Vec<Condition> = pool
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    let paused = spec.paused.unwrap_or(false);
    if paused {
        conditions::set(
            &mut conds,
            conditions::condition(
                PAUSED_CONDITION,
                true,
                Some("Paused"),
                Some("the pool is paused: its VMs are neither created, deleted nor updated"),
            ),
            now,
        );
    } else {
        conditions::remove(&mut conds, PAUSED_CONDITION);
        if active.len() < desired {
            let used: BTreeSet<u32> = vms
                .iter()
                .filter_map(|v| index_of(&name, v.metadata.name.as_deref().unwrap_or("")))
                .collect();
            let free = (0u32..).filter(|i| !used.contains(i));
            d.create = free
                .take(desired - active.len())
                .map(|i| vm_for(pool, i))
                .collect();
        } else if active.len() > desired && scale_in_is_proactive(pool) {
            scale_in_order(pool, &mut active);
            let excess = active.len() - desired;
            d.delete = active
                .drain(..excess)
                .map(|v| {
                    (
                        v.metadata.name.clone().unwrap_or_default(),
                        v.metadata.uid.clone().unwrap_or_default(),
                    )
                })
                .collect();
        }
        if updates_managed(pool) {
            let hash = template_hash(pool);
            for vm in &active {
                let current = vm
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(TEMPLATE_HASH_ANNOTATION));
                if current == Some(&hash) {
                    continue;
                }
                let Some(index) = index_of(&name, vm.metadata.name.as_deref().unwrap_or("")) else {
                    continue;
                };
                let mut want = vm_for(pool, index);
                want["metadata"]["resourceVersion"] = json!(vm.metadata.resource_version);
                d.update.push(want);
            }
        }
    }
    let remaining: Vec<&VirtualMachine> = vms
        .iter()
        .filter(|v| !is_deleting(v))
        .filter(|v| {
            !d.delete
                .iter()
                .any(|(n, _)| Some(n) == v.metadata.name.as_ref())
        })
        .collect();
    let ready = remaining
        .iter()
        .filter(|v| v.status.as_ref().and_then(|s| s.ready).unwrap_or(false))
        .count();
    d.status = VirtualMachinePoolStatus {
        replicas: Some(remaining.len() as i32),
        ready_replicas: Some(ready as i32),
        conditions: (!conds.is_empty()).then_some(conds),
        label_selector: spec.selector.as_ref().map(selector_string),
    };
    d
}

/// The status after a failed create/delete: `ReplicaFailure` naming the error.
pub fn with_failure(
    mut status: VirtualMachinePoolStatus,
    message: Option<&str>,
    now: &Time,
) -> VirtualMachinePoolStatus {
    let mut conds = status.conditions.take().unwrap_or_default();
    match message {
        Some(m) => conditions::set(
            &mut conds,
            conditions::condition(FAILURE_CONDITION, true, Some("FailedCreate"), Some(m)),
            now,
        ),
        None => conditions::remove(&mut conds, FAILURE_CONDITION),
    }
    status.conditions = (!conds.is_empty()).then_some(conds);
    status
}
