//! The launcher Pod view (docs/migration.md "Eviction and drain"): every VMI placed on a node
//! appears as the core/v1 Pod `virt-launcher-<vmi>-<5 chars>` that KubeVirt's virt-launcher
//! Pod would be, computed from the VMI (nothing is stored). Pure: [`pod_for`] maps a VMI (as
//! JSON) to its Pod, [`pods_for`] adds the target's Pod while a migration runs;
//! [`vmi_name_of`] finds the VMI a Pod name belongs to. A placement on
//! another node (after a migration) is another Pod: another name suffix and uid, so
//! `kubectl drain` sees the old Pod disappear.

use serde_json::{Map, Value, json};

/// The label every launcher Pod carries (`kubevirt.io=virt-launcher`).
pub const APP_LABEL: &str = "kubevirt.io";
pub const APP_VALUE: &str = "virt-launcher";
/// The label naming the VMI's uid.
pub const CREATED_BY_LABEL: &str = "kubevirt.io/created-by";
/// The label naming the VMI.
pub const VM_NAME_LABEL: &str = "vm.kubevirt.io/name";
/// Name prefix of launcher Pods.
pub const NAME_PREFIX: &str = "virt-launcher-";
/// The one container of the view.
pub const CONTAINER: &str = "compute";

/// Characters of generated name suffixes (Kubernetes' `rand.String` alphabet: no vowels, no
/// look-alikes).
const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
/// Namespace for the view's uids (UUID v5).
const UID_NAMESPACE: uuid::Uuid = uuid::Uuid::from_u128(0x5d0c_9a51_4b7e_4f0e_9a3c_6f1e_2b8d_7c40);

fn s<'a>(v: &'a Value, ptr: &str) -> Option<&'a str> {
    v.pointer(ptr)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

/// What identifies one placement of a VMI: its uid, its node and, when it came there by a
/// migration, that migration's uid.
fn placement_key(vmi: &Value, node: &str) -> String {
    let uid = s(vmi, "/metadata/uid").unwrap_or_default();
    let st = vmi.pointer("/status/migrationState");
    let by_migration = st
        .filter(|m| m["completed"] == true && m["targetNode"].as_str() == Some(node))
        .and_then(|m| m["migrationUid"].as_str())
        .unwrap_or_default();
    format!("{uid}/{node}/{by_migration}")
}

/// The placement's Pod uid (a UUID v5 of the placement) and name suffix (5 characters of
/// the same digest).
fn identity(vmi: &Value, node: &str) -> (String, String) {
    let id = uuid::Uuid::new_v5(&UID_NAMESPACE, placement_key(vmi, node).as_bytes());
    let suffix = id.as_bytes()[10..15]
        .iter()
        .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
        .collect();
    (id.to_string(), suffix)
}

/// Whether a VMI phase ends the launcher (the view shows no Pod then).
fn is_final(phase: &str) -> bool {
    matches!(phase, "Succeeded" | "Failed")
}

/// The Pod phase for a VMI phase.
fn pod_phase(phase: &str) -> &'static str {
    match phase {
        "Running" => "Running",
        "Unknown" => "Unknown",
        _ => "Pending",
    }
}

/// The launcher Pod of `vmi` (a VirtualMachineInstance as JSON), or `None` when it has no
/// node yet or has finished.
pub fn pod_for(vmi: &Value) -> Option<Value> {
    let node = s(vmi, "/status/nodeName")?;
    let phase = s(vmi, "/status/phase").unwrap_or("Pending");
    if is_final(phase) {
        return None;
    }
    let name = s(vmi, "/metadata/name")?;
    let ns = s(vmi, "/metadata/namespace").unwrap_or("default");
    let vmi_uid = s(vmi, "/metadata/uid").unwrap_or_default();
    let (uid, suffix) = identity(vmi, node);
    let mut labels: Map<String, Value> = vmi
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    labels.insert(APP_LABEL.into(), json!(APP_VALUE));
    labels.insert(CREATED_BY_LABEL.into(), json!(vmi_uid));
    labels.insert(VM_NAME_LABEL.into(), json!(name));
    let st = vmi.pointer("/status/migrationState");
    let arrived = st
        .filter(|m| m["completed"] == true && m["targetNode"].as_str() == Some(node))
        .and_then(|m| m.get("endTimestamp"))
        .filter(|t| t.is_string());
    let created = arrived
        .or_else(|| vmi.pointer("/metadata/creationTimestamp"))
        .cloned()
        .unwrap_or(Value::Null);
    let running = phase == "Running";
    let ready = vmi
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
        .is_some_and(|c| c["status"] == "True");
    let ready_str = if running && ready { "True" } else { "False" };
    let ip = vmi
        .pointer("/status/interfaces/0/ipAddress")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty());
    let mut metadata = json!({
        "name": format!("{NAME_PREFIX}{name}-{suffix}"),
        "generateName": format!("{NAME_PREFIX}{name}-"),
        "namespace": ns,
        "uid": uid,
        "resourceVersion": vmi.pointer("/metadata/resourceVersion").cloned().unwrap_or(Value::Null),
        "creationTimestamp": created,
        "labels": labels,
        "annotations": {"kubevirt.io/domain": name},
        "ownerReferences": [{
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "name": name,
            "uid": vmi_uid, "controller": true, "blockOwnerDeletion": true,
        }],
    });
    if let Some(t) = vmi
        .pointer("/metadata/deletionTimestamp")
        .filter(|t| t.is_string())
    {
        metadata["deletionTimestamp"] = t.clone();
    }
    let grace = vmi
        .pointer("/spec/terminationGracePeriodSeconds")
        .and_then(Value::as_i64)
        .unwrap_or(30);
    let mut status = json!({
        "phase": pod_phase(phase),
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": created},
            {"type": "Ready", "status": ready_str, "lastTransitionTime": created},
            {"type": "ContainersReady", "status": ready_str, "lastTransitionTime": created},
        ],
        "containerStatuses": [{
            "name": CONTAINER, "image": "ferrovirt/launcher", "imageID": "",
            "ready": running && ready, "restartCount": 0, "started": running,
            "state": if running {
                json!({"running": {"startedAt": created}})
            } else {
                json!({"waiting": {"reason": "ContainerCreating"}})
            },
        }],
        "qosClass": "Burstable",
    });
    if running {
        status["startTime"] = created;
    }
    if let Some(ip) = ip {
        status["podIP"] = json!(ip);
        status["podIPs"] = json!([{"ip": ip}]);
    }
    Some(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "nodeName": node,
            "containers": [{"name": CONTAINER, "image": "ferrovirt/launcher"}],
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": grace,
            "serviceAccountName": "default",
        },
        "status": status,
    }))
}

/// The label KubeVirt puts on a migration target's launcher Pod: the migration's uid.
pub const MIGRATION_JOB_LABEL: &str = "kubevirt.io/migrationJobUID";

/// The unfinished migration of `vmi` to another node: (target node, migration uid).
fn migrating_to(vmi: &Value) -> Option<(&str, &str)> {
    let m = vmi.pointer("/status/migrationState")?;
    if m["completed"] == true || m["failed"] == true {
        return None;
    }
    let target = s(m, "/targetNode")?;
    let uid = s(m, "/migrationUid")?;
    (Some(target) != s(vmi, "/status/nodeName")).then_some((target, uid))
}

/// Every launcher Pod of `vmi`: its own ([`pod_for`]) and, while a migration to another node
/// runs, the target's (KubeVirt shows a second launcher Pod then): on the target node,
/// labelled with the migration's uid, Pending until the target is ready, then Running, not
/// Ready. It has the name and uid the VMI's Pod has once the migration succeeded, so a watch
/// sees it ADDED at the start, and the source's Pod DELETED at the switch-over.
pub fn pods_for(vmi: &Value) -> Vec<Value> {
    let Some(own) = pod_for(vmi) else {
        return Vec::new();
    };
    let mut out = vec![own.clone()];
    if let Some((target, uid)) = migrating_to(vmi) {
        let key = format!(
            "{}/{target}/{uid}",
            s(vmi, "/metadata/uid").unwrap_or_default()
        );
        let id = uuid::Uuid::new_v5(&UID_NAMESPACE, key.as_bytes());
        let suffix: String = id.as_bytes()[10..15]
            .iter()
            .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
            .collect();
        let name = s(vmi, "/metadata/name").unwrap_or_default();
        let mut pod = own;
        pod["metadata"]["name"] = json!(format!("{NAME_PREFIX}{name}-{suffix}"));
        pod["metadata"]["uid"] = json!(id.to_string());
        pod["metadata"]["labels"][MIGRATION_JOB_LABEL] = json!(uid);
        if let Some(t) = vmi.pointer("/status/migrationState/startTimestamp") {
            pod["metadata"]["creationTimestamp"] = t.clone();
        }
        pod["spec"]["nodeName"] = json!(target);
        let ready = vmi
            .pointer("/status/migrationState/targetNodeDomainDetected")
            .and_then(Value::as_bool)
            == Some(true);
        let st = &mut pod["status"];
        st["phase"] = json!(if ready { "Running" } else { "Pending" });
        for c in st["conditions"].as_array_mut().into_iter().flatten() {
            if c["type"] != "PodScheduled" {
                c["status"] = json!("False");
            }
        }
        st["containerStatuses"][0]["ready"] = json!(false);
        st["containerStatuses"][0]["started"] = json!(ready);
        if let Some(o) = st.as_object_mut() {
            o.remove("podIP");
            o.remove("podIPs");
            if !ready {
                o.remove("startTime");
            }
        }
        out.push(pod);
    }
    out
}

/// The VMI name a launcher Pod name belongs to (`virt-launcher-<vmi>-<5 chars>`).
pub fn vmi_name_of(pod: &str) -> Option<&str> {
    let rest = pod.strip_prefix(NAME_PREFIX)?;
    let (vmi, suffix) = rest.rsplit_once('-')?;
    (!vmi.is_empty() && suffix.len() == 5).then_some(vmi)
}

/// The watch events the view shows for one VMI change, before selectors: `(type, pod)` with
/// `type` one of `ADDED`, `MODIFIED`, `DELETED`. `prev`/`cur`: the VMI before and after
/// (`cur` `None`: deleted; `prev` `None`: created or not known). A placement that changed is
/// the old Pod DELETED and the new one ADDED.
pub fn view_changes(prev: Option<&Value>, cur: Option<&Value>) -> Vec<(&'static str, Value)> {
    let old = prev.map(pods_for).unwrap_or_default();
    let new = cur.map(pods_for).unwrap_or_default();
    let name = |p: &Value| p.pointer("/metadata/name").cloned();
    // The revision of the write that made the change.
    let rv = cur
        .or(prev)
        .and_then(|v| v.pointer("/metadata/resourceVersion"))
        .cloned();
    let mut out = Vec::new();
    for mut o in old
        .iter()
        .filter(|o| !new.iter().any(|n| name(n) == name(o)))
        .cloned()
    {
        if let Some(rv) = &rv {
            o["metadata"]["resourceVersion"] = rv.clone();
        }
        out.push(("DELETED", o));
    }
    for n in new {
        let kind = if old.iter().any(|o| name(o) == name(&n)) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        out.push((kind, n));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(node: Option<&str>, phase: &str) -> Value {
        json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {
                "name": "my-vm", "namespace": "ns1", "uid": "1111-2222",
                "resourceVersion": "42", "creationTimestamp": "2026-01-01T00:00:00Z",
                "labels": {"app": "web", "kubevirt.io/nodeName": node},
            },
            "spec": {"terminationGracePeriodSeconds": 5},
            "status": {
                "nodeName": node, "phase": phase,
                "conditions": [{"type": "Ready", "status": "True"}],
                "interfaces": [{"name": "default", "ipAddress": "10.244.1.5"}],
            },
        })
    }

    #[test]
    fn a_running_vmi_is_a_running_launcher_pod() {
        let p = pod_for(&vmi(Some("node1"), "Running")).unwrap();
        let name = p["metadata"]["name"].as_str().unwrap();
        assert!(name.starts_with("virt-launcher-my-vm-"), "{name}");
        assert_eq!(name.len(), "virt-launcher-my-vm-".len() + 5);
        assert_eq!(vmi_name_of(name), Some("my-vm"));
        assert_eq!(p["metadata"]["namespace"], "ns1");
        assert_eq!(p["metadata"]["resourceVersion"], "42");
        let l = &p["metadata"]["labels"];
        assert_eq!(l["kubevirt.io"], "virt-launcher");
        assert_eq!(l["kubevirt.io/created-by"], "1111-2222");
        assert_eq!(l["vm.kubevirt.io/name"], "my-vm");
        assert_eq!(l["app"], "web", "the VMI's labels are copied");
        let owner = &p["metadata"]["ownerReferences"][0];
        assert_eq!(owner["kind"], "VirtualMachineInstance");
        assert_eq!(owner["uid"], "1111-2222");
        assert_eq!(owner["controller"], true);
        assert_eq!(p["spec"]["nodeName"], "node1");
        assert_eq!(p["spec"]["terminationGracePeriodSeconds"], 5);
        assert_eq!(p["status"]["phase"], "Running");
        assert_eq!(p["status"]["podIP"], "10.244.1.5");
        let ready = p["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Ready")
            .unwrap();
        assert_eq!(ready["status"], "True");
        assert_eq!(p["status"]["containerStatuses"][0]["ready"], true);
        // The same placement always maps to the same Pod.
        assert_eq!(pod_for(&vmi(Some("node1"), "Running")).unwrap(), p);
    }

    #[test]
    fn no_pod_without_a_node_or_after_the_end() {
        assert!(pod_for(&vmi(None, "Pending")).is_none());
        assert!(pod_for(&vmi(Some("node1"), "Succeeded")).is_none());
        assert!(pod_for(&vmi(Some("node1"), "Failed")).is_none());
        let p = pod_for(&vmi(Some("node1"), "Scheduled")).unwrap();
        assert_eq!(p["status"]["phase"], "Pending");
        assert_eq!(p["status"]["containerStatuses"][0]["ready"], false);
    }

    #[test]
    fn a_migration_makes_another_pod() {
        let before = vmi(Some("node1"), "Running");
        let mut after = vmi(Some("node2"), "Running");
        after["metadata"]["resourceVersion"] = json!("50");
        after["status"]["migrationState"] = json!({
            "migrationUid": "m1", "sourceNode": "node1", "targetNode": "node2",
            "completed": true, "endTimestamp": "2026-01-01T01:00:00Z",
        });
        let a = pod_for(&before).unwrap();
        let b = pod_for(&after).unwrap();
        assert_ne!(a["metadata"]["name"], b["metadata"]["name"]);
        assert_ne!(a["metadata"]["uid"], b["metadata"]["uid"]);
        assert_eq!(b["spec"]["nodeName"], "node2");
        assert_eq!(b["metadata"]["creationTimestamp"], "2026-01-01T01:00:00Z");
        // And back: not the first Pod again (another migration uid).
        let mut back = after.clone();
        back["status"]["nodeName"] = json!("node1");
        back["status"]["migrationState"] = json!({
            "migrationUid": "m2", "sourceNode": "node2", "targetNode": "node1", "completed": true,
        });
        let c = pod_for(&back).unwrap();
        assert_ne!(c["metadata"]["name"], a["metadata"]["name"]);
        // The watch: old Pod deleted (at the new revision), new one added.
        let ev = view_changes(Some(&before), Some(&after));
        assert_eq!(ev.len(), 2);
        assert_eq!(ev[0].0, "DELETED");
        assert_eq!(ev[0].1["metadata"]["name"], a["metadata"]["name"]);
        assert_eq!(ev[0].1["metadata"]["resourceVersion"], "50");
        assert_eq!(ev[1].0, "ADDED");
        assert_eq!(ev[1].1["metadata"]["name"], b["metadata"]["name"]);
    }

    #[test]
    fn a_running_migration_shows_the_target_pod() {
        let idle = vmi(Some("node1"), "Running");
        assert_eq!(pods_for(&idle).len(), 1);
        let mut moving = idle.clone();
        moving["metadata"]["resourceVersion"] = json!("60");
        moving["status"]["migrationState"] = json!({
            "migrationUid": "m1", "sourceNode": "node1", "targetNode": "node2",
            "startTimestamp": "2026-01-01T00:59:00Z",
        });
        let pods = pods_for(&moving);
        assert_eq!(pods.len(), 2);
        let (src, dst) = (&pods[0], &pods[1]);
        assert_eq!(src["spec"]["nodeName"], "node1");
        assert_eq!(dst["spec"]["nodeName"], "node2");
        assert_eq!(dst["status"]["phase"], "Pending");
        assert_eq!(dst["metadata"]["labels"][MIGRATION_JOB_LABEL], "m1");
        assert_eq!(dst["metadata"]["labels"][CREATED_BY_LABEL], "1111-2222");
        assert_eq!(
            vmi_name_of(dst["metadata"]["name"].as_str().unwrap()),
            Some("my-vm")
        );
        assert!(dst["status"].get("podIP").is_none());
        // Ready target: Running, not Ready.
        moving["status"]["migrationState"]["targetNodeDomainDetected"] = json!(true);
        let dst = pods_for(&moving)[1].clone();
        assert_eq!(dst["status"]["phase"], "Running");
        assert_eq!(dst["status"]["conditions"][1]["status"], "False");
        // The watch: the target Pod is ADDED when the migration starts ...
        let ev = view_changes(Some(&idle), Some(&moving));
        let kinds: Vec<&str> = ev.iter().map(|e| e.0).collect();
        assert_eq!(kinds, ["MODIFIED", "ADDED"]);
        // ... and is the VMI's own Pod (same name and uid) after the switch-over, when
        // the source's is DELETED.
        let mut done = moving.clone();
        done["metadata"]["resourceVersion"] = json!("70");
        done["status"]["nodeName"] = json!("node2");
        done["status"]["migrationState"]["completed"] = json!(true);
        let after = pod_for(&done).unwrap();
        assert_eq!(after["metadata"]["name"], dst["metadata"]["name"]);
        assert_eq!(after["metadata"]["uid"], dst["metadata"]["uid"]);
        assert_eq!(pods_for(&done).len(), 1);
        let ev = view_changes(Some(&moving), Some(&done));
        let kinds: Vec<&str> = ev.iter().map(|e| e.0).collect();
        assert_eq!(kinds, ["DELETED", "MODIFIED"]);
        assert_eq!(ev[0].1["spec"]["nodeName"], "node1");
        assert_eq!(ev[0].1["metadata"]["resourceVersion"], "70");
        // A failed migration: the target Pod goes.
        let mut failed = moving.clone();
        failed["status"]["migrationState"]["failed"] = json!(true);
        let ev = view_changes(Some(&moving), Some(&failed));
        let kinds: Vec<&str> = ev.iter().map(|e| e.0).collect();
        assert_eq!(kinds, ["DELETED", "MODIFIED"]);
        assert_eq!(ev[0].1["spec"]["nodeName"], "node2");
    }

    #[test]
    fn watch_changes() {
        let pending = vmi(None, "Pending");
        let sched = vmi(Some("n"), "Scheduled");
        let run = vmi(Some("n"), "Running");
        assert!(view_changes(None, Some(&pending)).is_empty());
        assert_eq!(view_changes(Some(&pending), Some(&sched))[0].0, "ADDED");
        assert_eq!(view_changes(Some(&sched), Some(&run))[0].0, "MODIFIED");
        assert_eq!(view_changes(Some(&run), None)[0].0, "DELETED");
        let done = vmi(Some("n"), "Succeeded");
        assert_eq!(view_changes(Some(&run), Some(&done))[0].0, "DELETED");
    }

    #[test]
    fn pod_names_back_to_vmi_names() {
        assert_eq!(vmi_name_of("virt-launcher-a-b-c-x2z4q"), Some("a-b-c"));
        assert_eq!(vmi_name_of("virt-launcher-vm-abc"), None);
        assert_eq!(vmi_name_of("other-pod-x2z4q"), None);
        assert_eq!(vmi_name_of("virt-launcher--x2z4q"), None);
    }
}
