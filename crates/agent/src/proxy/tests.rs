//! Unit tests of the subresource proxy's pure parts and of its agent connections.

use super::*;

fn vmi(phase: &str, conds: Value) -> Value {
    json!({"metadata": {"name": "v", "uid": "u-1"},
           "spec": {"terminationGracePeriodSeconds": 30},
           "status": {"phase": phase, "nodeName": "node1", "conditions": conds}})
}

#[test]
fn parses_subresource_paths() {
    let vmis = "virtualmachineinstances";
    assert_eq!(
        parse_op(vmis, "pause", &Method::PUT),
        Ok(Op::Vmi(VmiAction::Pause))
    );
    assert_eq!(
        parse_op(vmis, "vnc", &Method::GET),
        Ok(Op::Stream(StreamKind::Vnc))
    );
    assert_eq!(
        parse_op(vmis, "console", &Method::GET),
        Ok(Op::Stream(StreamKind::Console))
    );
    assert_eq!(
        parse_op(vmis, "guestosinfo", &Method::GET),
        Ok(Op::GuestOsInfo)
    );
    assert_eq!(parse_op(vmis, "userlist", &Method::GET), Ok(Op::UserList));
    assert_eq!(
        parse_op("virtualmachines", "restart", &Method::PUT),
        Ok(Op::Vm(VmVerb::Restart))
    );
    assert_eq!(parse_op(vmis, "pause", &Method::GET).unwrap_err().code, 405);
    assert_eq!(parse_op(vmis, "start", &Method::PUT).unwrap_err().code, 404);
    assert_eq!(
        parse_op("pods", "exec", &Method::GET).unwrap_err().code,
        404
    );
    let names: Vec<String> = resource_list()["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_string())
        .collect();
    assert!(names.contains(&"virtualmachineinstances/console".to_string()));
    assert!(names.contains(&"virtualmachines/stop".to_string()));
    assert_eq!(
        api_group()["preferredVersion"]["groupVersion"],
        "subresources.kubevirt.io/v1"
    );
}

#[test]
fn errors_are_statuses() {
    let s = ApiErr::not_found("virtualmachineinstances", "x").to_status();
    assert_eq!(s["kind"], "Status");
    assert_eq!(s["status"], "Failure");
    assert_eq!(s["reason"], "NotFound");
    assert_eq!(s["code"], 404);
    assert_eq!(
        s["message"],
        "virtualmachineinstances.kubevirt.io \"x\" not found"
    );
    let e = agent_error(409, br#"{"code":409,"message":"VMI is already paused"}"#);
    assert_eq!(
        (e.code, e.reason, e.message.as_str()),
        (409, "Conflict", "VMI is already paused")
    );
    assert_eq!(agent_error(401, b"").code, 500);
}

#[test]
fn targets_need_a_running_vmi() {
    assert_eq!(
        running_target(&vmi("Running", json!([]))),
        Ok(("u-1".into(), "node1".into()))
    );
    assert_eq!(
        running_target(&vmi("Scheduled", json!([])))
            .unwrap_err()
            .code,
        409
    );
    assert!(check_agent_connected(&vmi("Running", json!([]))).is_err());
    let c = json!([{"type": "AgentConnected", "status": "True"}]);
    assert!(check_agent_connected(&vmi("Running", c)).is_ok());
}

#[test]
fn guest_info_in_kubevirt_shapes() {
    let raw = json!({
        "osInfo": {"name": "Ferrovirt", "kernel-release": "6.1.0", "version": "1",
                   "pretty-name": "Ferrovirt 1", "version-id": "1",
                   "kernel-version": "#1 SMP", "machine": "x86_64",
                   "id": "ferrovirt-testguest"},
        "hostname": "g1",
        "users": [{"user": "root", "login-time": 1700000000.5, "domain": "d"}],
        "filesystems": [{"name": "vda1", "mountpoint": "/", "type": "vfat",
                         "used-bytes": 10, "total-bytes": 100, "disk": []}],
        "interfaces": []
    });
    let info = guest_agent_info(&raw);
    assert_eq!(info["hostname"], "g1");
    assert_eq!(info["os"]["id"], "ferrovirt-testguest");
    assert_eq!(info["os"]["kernelRelease"], "6.1.0");
    assert_eq!(info["os"]["versionId"], "1");
    assert_eq!(info["os"]["prettyName"], "Ferrovirt 1");
    assert_eq!(info["userList"][0]["userName"], "root");
    assert_eq!(info["fsInfo"]["disks"][0]["mountPoint"], "/");
    let users = user_list(&raw);
    assert_eq!(users["kind"], "VirtualMachineInstanceUserList");
    assert_eq!(
        users["items"][0],
        json!({"userName": "root", "domain": "d", "loginTime": 1700000000.5})
    );
    let fs = filesystem_list(&raw);
    assert_eq!(
        fs["items"][0],
        json!({"diskName": "vda1", "mountPoint": "/", "fileSystemType": "vfat",
               "usedBytes": 10, "totalBytes": 100})
    );
    // Missing data gives empty values, not errors.
    let empty = guest_agent_info(&json!({"osInfo": null}));
    assert_eq!(empty["os"]["id"], "");
    assert_eq!(empty["userList"], json!([]));
}

fn vm(spec: Value, status: Value) -> Value {
    json!({"metadata": {"name": "v"}, "spec": spec, "status": status})
}

fn plan(verb: VmVerb, vm: &Value, vmi: Option<&Value>) -> Result<VmPlan, ApiErr> {
    plan_vm(verb, vm, vmi, &VerbOptions::default())
}

#[test]
fn start_and_stop_flip_always_and_halted() {
    let halted = vm(json!({"runStrategy": "Halted"}), json!({}));
    let p = plan(VmVerb::Start, &halted, None).unwrap();
    assert_eq!(
        p.vm_patch,
        Some(
            json!([{"op": "test", "path": "/spec/runStrategy", "value": "Halted"},
                    {"op": "replace", "path": "/spec/runStrategy", "value": "Always"}])
        )
    );
    let always = vm(json!({"runStrategy": "Always"}), json!({}));
    let running = vmi("Running", json!([]));
    let e = plan(VmVerb::Start, &always, Some(&running)).unwrap_err();
    assert_eq!((e.code, e.message.as_str()), (409, "VM is already running"));
    let e = plan(VmVerb::Start, &always, None).unwrap_err();
    assert_eq!(e.message, "Always does not support manual start requests");
    let p = plan(VmVerb::Stop, &always, Some(&running)).unwrap();
    assert_eq!(p.vm_patch.unwrap()[1]["value"], "Halted");
    // The deprecated `running` field is flipped in place.
    let legacy = vm(json!({"running": false}), json!({}));
    let p = plan(VmVerb::Start, &legacy, None).unwrap();
    assert_eq!(
        p.vm_patch.unwrap()[1],
        json!({"op": "replace", "path": "/spec/running", "value": true})
    );
    // Halted stops only with a shorter grace period.
    let e = plan(VmVerb::Stop, &halted, Some(&running)).unwrap_err();
    assert_eq!(e.code, 409);
    let opts = VerbOptions {
        grace_period: Some(5),
        ..Default::default()
    };
    let p = plan_vm(VmVerb::Stop, &halted, Some(&running), &opts).unwrap();
    assert_eq!(p.vmi_patch.unwrap()[1]["value"], 5);
    assert_eq!(
        p.vm_status_patch.unwrap()[0]["value"]["stateChangeRequests"],
        json!([{"action": "Stop", "uid": "u-1"}])
    );
}

#[test]
fn manual_strategies_use_state_change_requests() {
    let manual = vm(
        json!({"runStrategy": "Manual"}),
        json!({"printableStatus": "Stopped"}),
    );
    let p = plan(VmVerb::Start, &manual, None).unwrap();
    assert_eq!(
        p.vm_status_patch,
        Some(json!([{"op": "add", "path": "/status/stateChangeRequests",
                     "value": [{"action": "Start"}]}]))
    );
    let done = vmi("Succeeded", json!([]));
    let p = plan(VmVerb::Start, &manual, Some(&done)).unwrap();
    assert_eq!(
        p.vm_status_patch.unwrap()[0]["value"],
        json!([{"action": "Stop", "uid": "u-1"}, {"action": "Start"}])
    );
    let e = plan(VmVerb::Stop, &manual, None).unwrap_err();
    assert_eq!((e.code, e.message.as_str()), (409, "VM is not running"));
    let rerun = vm(json!({"runStrategy": "RerunOnFailure"}), json!({}));
    let failed = vmi("Failed", json!([]));
    assert_eq!(
        plan(VmVerb::Start, &rerun, Some(&failed)).unwrap_err().code,
        409
    );
    // Pending requests: a lone Stop replaces them, anything else conflicts.
    let pending = vm(
        json!({"runStrategy": "Manual"}),
        json!({"stateChangeRequests": [{"action": "Start"}], "startFailure": {}}),
    );
    let running = vmi("Running", json!([]));
    let p = plan(VmVerb::Stop, &pending, Some(&running)).unwrap();
    let ops = p.vm_status_patch.unwrap();
    assert_eq!(ops[0]["op"], "test");
    assert_eq!(ops[1]["value"], json!([{"action": "Stop", "uid": "u-1"}]));
    assert_eq!(
        ops[2],
        json!({"op": "remove", "path": "/status/startFailure"})
    );
    let e = plan(VmVerb::Restart, &pending, Some(&running)).unwrap_err();
    assert!(e.message.contains("already underway"), "{e:?}");
}

#[test]
fn restart_is_stop_then_start() {
    let always = vm(json!({"runStrategy": "Always"}), json!({"ready": true}));
    let running = vmi("Running", json!([]));
    let p = plan(VmVerb::Restart, &always, Some(&running)).unwrap();
    assert_eq!(
        p.vm_status_patch.unwrap()[0]["value"],
        json!([{"action": "Stop", "uid": "u-1"}, {"action": "Start"}])
    );
    assert_eq!(plan(VmVerb::Restart, &always, None).unwrap_err().code, 409);
    let halted = vm(json!({"runStrategy": "Halted"}), json!({}));
    let e = plan(VmVerb::Restart, &halted, Some(&running)).unwrap_err();
    assert_eq!(
        e.message,
        "RunStrategy Halted does not support manual restart requests"
    );
    let force = VerbOptions {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    let p = plan_vm(VmVerb::Restart, &always, Some(&running), &force).unwrap();
    assert_eq!(p.vmi_patch.unwrap()[1]["value"], 0);
    let slow = VerbOptions {
        grace_period_seconds: Some(3),
        ..Default::default()
    };
    assert_eq!(
        plan_vm(VmVerb::Restart, &always, Some(&running), &slow)
            .unwrap_err()
            .code,
        400
    );
}

/// The proxy's agent client against a real (TLS) agent endpoint: the published fingerprint
/// works (the token still matters), any other is refused as a mismatch, and plain http is
/// refused to non-loopback agents.
#[tokio::test]
async fn agent_connections_pin_the_published_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let cert = crate::tls::load_or_create(dir.path(), &[]).unwrap();
    let cfg = crate::launchers::LauncherConfig {
        binary: "ferrovirt".into(),
        data_dir: dir.path().to_path_buf(),
        qemu_binary: "qemu-system-x86_64".into(),
    };
    let ep = crate::endpoint::serve(
        "127.0.0.1:0".parse().unwrap(),
        "127.0.0.1",
        "node1",
        cfg,
        Some("tok".into()),
        &cert,
    )
    .await
    .unwrap();
    let good = AgentAddr {
        node: "node1".into(),
        url: ep.url.clone(),
        fingerprint: Some(ep.fingerprint.clone()),
    };
    // Reached and authenticated: the (absent) launcher is the agent's answer.
    let e = agent_call(&good, Method::GET, "/vmis/abc/guestinfo", "tok")
        .await
        .unwrap_err();
    assert_eq!(e.code, 409, "{e:?}");
    let e = agent_call(&good, Method::GET, "/vmis/abc/guestinfo", "nope")
        .await
        .unwrap_err();
    assert_eq!(e.message, "the node agent refused the server's credentials");
    // The token derived for another node does not open this node's endpoint.
    let elsewhere = AgentAddr {
        node: "node2".into(),
        ..good.clone()
    };
    let e = agent_call(&elsewhere, Method::GET, "/vmis/abc/guestinfo", "tok")
        .await
        .unwrap_err();
    assert_eq!(e.message, "the node agent refused the server's credentials");
    // Another certificate's fingerprint: refused before any request is sent.
    let other = crate::tls::AgentCert::generate(&["127.0.0.1".into()]).unwrap();
    let wrong = AgentAddr {
        node: "node1".into(),
        url: ep.url.clone(),
        fingerprint: Some(other.fingerprint_hex()),
    };
    let e = agent_call(&wrong, Method::GET, "/vmis/abc/guestinfo", "tok")
        .await
        .unwrap_err();
    assert_eq!(e.code, 502, "{e:?}");
    assert!(e.message.contains("does not match its Node"), "{e:?}");
    let e = agent_stream(&wrong, "/vmis/abc/console", "tok")
        .await
        .err()
        .unwrap();
    assert_eq!(e.code, 502, "{e:?}");
    // An https URL without fingerprint, and plain http off loopback, are refused.
    let unpinned = AgentAddr {
        node: "node1".into(),
        url: ep.url.clone(),
        fingerprint: None,
    };
    let e = agent_call(&unpinned, Method::GET, "/vmis/abc/guestinfo", "tok")
        .await
        .unwrap_err();
    assert!(e.message.contains("no certificate fingerprint"), "{e:?}");
    let remote = AgentAddr {
        node: "node1".into(),
        url: "http://192.0.2.1:4000".into(),
        fingerprint: None,
    };
    let e = agent_call(&remote, Method::GET, "/vmis/abc/guestinfo", "tok")
        .await
        .unwrap_err();
    assert_eq!(e.code, 503);
    assert!(e.message.contains("refusing plain http"), "{e:?}");
    ep.task.abort();
}

#[test]
fn freeze_is_a_put_with_an_unfreeze_timeout() {
    let vmis = "virtualmachineinstances";
    assert_eq!(
        parse_op(vmis, "freeze", &Method::PUT),
        Ok(Op::Vmi(VmiAction::Freeze))
    );
    assert_eq!(
        parse_op(vmis, "unfreeze", &Method::PUT),
        Ok(Op::Vmi(VmiAction::Unfreeze))
    );
    assert_eq!(
        parse_op(vmis, "freeze", &Method::GET).unwrap_err().code,
        405
    );
    assert_eq!(unfreeze_timeout(b""), Ok(300));
    assert_eq!(unfreeze_timeout(b"{}"), Ok(300));
    assert_eq!(unfreeze_timeout(br#"{"unfreezeTimeout":"1m30s"}"#), Ok(90));
    for bad in [
        &br#"{"unfreezeTimeout":"0s"}"#[..],
        br#"{"unfreezeTimeout":"soon"}"#,
        br#"{"unfreezeTimeout":5}"#,
        b"not json",
    ] {
        let e = unfreeze_timeout(bad).unwrap_err();
        assert_eq!(e.code, 400, "{e:?}");
    }
    assert!(
        unfreeze_timeout(br#"{"unfreezeTimeout":"soon"}"#)
            .unwrap_err()
            .message
            .contains("unfreezeTimeout")
    );
}
