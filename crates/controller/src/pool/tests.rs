//! Unit tests of the pool decision.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

use super::*;

fn now() -> Time {
    Time(Timestamp::from_second(1_000).unwrap())
}

fn pool(replicas: i32, extra: Value) -> VirtualMachinePool {
    let mut p = json!({
        "apiVersion": "pool.kubevirt.io/v1beta1", "kind": "VirtualMachinePool",
        "metadata": {"name": "web", "namespace": "default", "uid": "pool-uid"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "web"}},
            "virtualMachineTemplate": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"runStrategy": "Always", "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {"domain": {"devices": {}}, "volumes": [
                        {"name": "cm", "configMap": {"name": "conf"}},
                        {"name": "s", "secret": {"secretName": "creds"}}]}}}}}});
    for (k, v) in extra.as_object().unwrap() {
        p["spec"][k] = v.clone();
    }
    serde_json::from_value(p).unwrap()
}

fn vm_of(p: &VirtualMachinePool, index: u32, ready: bool, created: i64) -> VirtualMachine {
    let mut v = vm_for(p, index);
    v["metadata"]["uid"] = json!(format!("uid-{index}"));
    v["metadata"]["resourceVersion"] = json!("5");
    v["metadata"]["creationTimestamp"] = json!(Time(Timestamp::from_second(created).unwrap()));
    v["status"] = json!({"ready": ready});
    serde_json::from_value(v).unwrap()
}

fn names(values: &[Value]) -> Vec<String> {
    values
        .iter()
        .map(|v| v["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

fn deleted(d: &PoolDecision) -> Vec<&str> {
    d.delete.iter().map(|(n, _)| n.as_str()).collect()
}

#[test]
fn creates_missing_replicas_at_the_lowest_free_indexes_owned_and_labelled() {
    let p = pool(3, json!({}));
    let vms = vec![vm_of(&p, 1, true, 10)];
    let d = decide(&p, &vms, &now());
    assert_eq!(names(&d.create), vec!["web-0", "web-2"]);
    let vm = &d.create[0];
    assert_eq!(vm["metadata"]["labels"]["app"], "web");
    assert_eq!(vm["metadata"]["labels"][POOL_LABEL], "web");
    assert_eq!(
        vm["spec"]["template"]["metadata"]["labels"][POOL_LABEL],
        "web"
    );
    let owner = &vm["metadata"]["ownerReferences"][0];
    assert_eq!(owner["kind"], "VirtualMachinePool");
    assert_eq!(owner["uid"], "pool-uid");
    assert_eq!(owner["controller"], true);
    assert_eq!(vm["spec"]["runStrategy"], "Always");
    // Without nameGeneration the referenced names stay.
    assert_eq!(
        vm["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"],
        "conf"
    );
    assert_eq!(d.status.replicas, Some(1));
    assert_eq!(d.status.ready_replicas, Some(1));
    assert_eq!(d.status.label_selector.as_deref(), Some("app=web"));
}

#[test]
fn a_vm_being_deleted_is_replaced_under_a_new_name() {
    let p = pool(2, json!({}));
    let mut going = vm_of(&p, 0, true, 10);
    going.metadata.deletion_timestamp = Some(now());
    let vms = vec![going, vm_of(&p, 1, true, 10)];
    let d = decide(&p, &vms, &now());
    assert_eq!(names(&d.create), vec!["web-2"]);
    assert!(d.delete.is_empty());
    assert_eq!(d.status.replicas, Some(1));
}

#[test]
fn scales_in_highest_index_first_by_default_and_by_policy() {
    let p = pool(1, json!({}));
    let vms: Vec<_> = (0..3).map(|i| vm_of(&p, i, true, 100 - i as i64)).collect();
    let d = decide(&p, &vms, &now());
    assert_eq!(deleted(&d), vec!["web-2", "web-1"]);
    assert_eq!(d.delete[0].1, "uid-2");
    assert_eq!(d.status.replicas, Some(1));
    assert!(d.create.is_empty());
    let policy =
        |s: &str| json!({"scaleInStrategy": {"proactive": {"selectionPolicy": {"sortPolicy": s}}}});
    let p = pool(1, policy("AscendingOrder"));
    assert_eq!(deleted(&decide(&p, &vms, &now())), vec!["web-0", "web-1"]);
    // web-0 was created last (t=100), web-2 first (t=98).
    let p = pool(2, policy("Newest"));
    assert_eq!(deleted(&decide(&p, &vms, &now())), vec!["web-0"]);
    let p = pool(2, policy("Oldest"));
    assert_eq!(deleted(&decide(&p, &vms, &now())), vec!["web-2"]);
    let p = pool(0, policy("Random"));
    assert_eq!(decide(&p, &vms, &now()).delete.len(), 3);
}

#[test]
fn unmanaged_and_opportunistic_scale_in_delete_nothing() {
    for s in [json!({"unmanaged": {}}), json!({"opportunistic": {}})] {
        let p = pool(1, json!({"scaleInStrategy": s}));
        let vms: Vec<_> = (0..3).map(|i| vm_of(&p, i, false, 10)).collect();
        let d = decide(&p, &vms, &now());
        assert!(d.delete.is_empty() && d.create.is_empty());
        assert_eq!(d.status.replicas, Some(3));
        assert_eq!(d.status.ready_replicas, Some(0));
    }
}

#[test]
fn a_paused_pool_changes_nothing_and_says_so() {
    let p = pool(3, json!({"paused": true}));
    let d = decide(&p, &[], &now());
    assert!(d.create.is_empty() && d.delete.is_empty() && d.update.is_empty());
    let c = d.status.conditions.unwrap();
    assert_eq!(c[0].type_, PAUSED_CONDITION);
    assert_eq!(c[0].status, "True");
}

#[test]
fn name_generation_appends_the_index_to_config_maps_and_secrets() {
    let p = pool(
        1,
        json!({"nameGeneration": {"appendIndexToConfigMapRefs": true, "appendIndexToSecretRefs": true}}),
    );
    let vm = vm_for(&p, 4);
    let vols = &vm["spec"]["template"]["spec"]["volumes"];
    assert_eq!(vols[0]["configMap"]["name"], "conf-4");
    assert_eq!(vols[1]["secret"]["secretName"], "creds-4");
}

#[test]
fn template_changes_update_vms_unless_unmanaged() {
    let old = pool(1, json!({}));
    let vms = vec![vm_of(&old, 0, true, 10)];
    assert!(decide(&old, &vms, &now()).update.is_empty());
    let mut new = old.clone();
    new.spec
        .as_mut()
        .unwrap()
        .virtual_machine_template
        .as_mut()
        .unwrap()
        .metadata
        .as_mut()
        .unwrap()
        .labels
        .as_mut()
        .unwrap()
        .insert("tier".into(), "front".into());
    let d = decide(&new, &vms, &now());
    assert_eq!(names(&d.update), vec!["web-0"]);
    assert_eq!(d.update[0]["metadata"]["labels"]["tier"], "front");
    assert_eq!(d.update[0]["metadata"]["resourceVersion"], "5");
    let mut unmanaged = new.clone();
    unmanaged.spec.as_mut().unwrap().update_strategy =
        serde_json::from_value(json!({"unmanaged": {}})).unwrap();
    assert!(decide(&unmanaged, &vms, &now()).update.is_empty());
}

#[test]
fn selector_strings_and_indexes() {
    let sel: LabelSelector = serde_json::from_value(json!({"matchLabels": {"a": "b"},
        "matchExpressions": [{"key": "c", "operator": "In", "values": ["d", "e"]},
            {"key": "f", "operator": "DoesNotExist"}]}))
    .unwrap();
    assert_eq!(selector_string(&sel), "a=b,c in (d,e),!f");
    assert_eq!(index_of("web", "web-12"), Some(12));
    assert_eq!(index_of("web", "web-x"), None);
    assert_eq!(index_of("web", "webs-1"), None);
}

#[test]
fn failures_are_a_condition() {
    let s = with_failure(VirtualMachinePoolStatus::default(), Some("quota"), &now());
    assert_eq!(s.conditions.as_ref().unwrap()[0].type_, FAILURE_CONDITION);
    assert!(with_failure(s, None, &now()).conditions.is_none());
}
