//! The pure half of the subresource proxy: where a VMI runs, KubeVirt's guest-agent info
//! shapes, and the VM start/stop/restart decision ([`plan_vm`]) as JSON patches or a 409.

use super::*;

pub(super) fn str_at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    path.iter().try_fold(v, |v, k| v.get(k))?.as_str()
}

pub(super) fn has_condition(vmi: &Value, type_: &str) -> bool {
    vmi.pointer("/status/conditions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|c| {
            c.get("type").and_then(Value::as_str) == Some(type_)
                && c.get("status").and_then(Value::as_str) == Some("True")
        })
}

/// Where a running VMI lives: (uid, node name).
pub fn running_target(vmi: &Value) -> Result<(String, String), ApiErr> {
    let phase = str_at(vmi, &["status", "phase"]).unwrap_or("");
    let node = str_at(vmi, &["status", "nodeName"]).unwrap_or("");
    let uid = str_at(vmi, &["metadata", "uid"]).unwrap_or("");
    if phase != "Running" || node.is_empty() || uid.is_empty() {
        return Err(ApiErr::conflict("VMI is not running"));
    }
    Ok((uid.to_string(), node.to_string()))
}

/// KubeVirt answers guest-agent queries only while the agent is connected.
pub fn check_agent_connected(vmi: &Value) -> Result<(), ApiErr> {
    if has_condition(vmi, "AgentConnected") {
        Ok(())
    } else {
        Err(ApiErr::conflict("VMI does not have guest agent connected"))
    }
}

pub(super) fn opt_str(v: &Value, keys: &[&str]) -> Value {
    keys.iter()
        .find_map(|k| v.get(*k).and_then(Value::as_str))
        .map(|s| Value::String(s.to_string()))
        .unwrap_or(Value::String(String::new()))
}

pub(super) fn items(v: &Value, key: &str) -> Vec<Value> {
    v.get(key)
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// The launcher's `guestInfo` users → KubeVirt's VirtualMachineInstanceGuestOSUser items.
pub(super) fn users(raw: &Value) -> Vec<Value> {
    items(raw, "users")
        .iter()
        .map(|u| {
            let mut o = json!({"userName": opt_str(u, &["user", "userName"])});
            if let Some(d) = u.get("domain").and_then(Value::as_str) {
                o["domain"] = json!(d);
            }
            if let Some(t) = u.get("login-time").or_else(|| u.get("loginTime")) {
                o["loginTime"] = t.clone();
            }
            o
        })
        .collect()
}

/// The launcher's `guestInfo` filesystems → KubeVirt's VirtualMachineInstanceFileSystem items.
pub(super) fn filesystems(raw: &Value) -> Vec<Value> {
    items(raw, "filesystems")
        .iter()
        .map(|f| {
            let num = |a: &str, b: &str| f.get(a).or_else(|| f.get(b)).cloned().unwrap_or(json!(0));
            json!({
                "diskName": opt_str(f, &["name"]),
                "mountPoint": opt_str(f, &["mountpoint", "mountPoint"]),
                "fileSystemType": opt_str(f, &["type", "fileSystemType"]),
                "usedBytes": num("used-bytes", "usedBytes"),
                "totalBytes": num("total-bytes", "totalBytes"),
            })
        })
        .collect()
}

/// The launcher's `guestInfo` → KubeVirt's VirtualMachineInstanceGuestAgentInfo.
pub fn guest_agent_info(raw: &Value) -> Value {
    let os = raw.get("osInfo").cloned().unwrap_or(Value::Null);
    let field = |kebab: &str| opt_str(&os, &[kebab]);
    json!({
        "kind": "VirtualMachineInstanceGuestAgentInfo",
        "apiVersion": "kubevirt.io/v1",
        "guestAgentVersion": opt_str(raw, &["guestAgentVersion", "version"]),
        "hostname": opt_str(raw, &["hostname"]),
        "os": {
            "name": field("name"),
            "kernelRelease": field("kernel-release"),
            "version": field("version"),
            "prettyName": field("pretty-name"),
            "versionId": field("version-id"),
            "kernelVersion": field("kernel-version"),
            "machine": field("machine"),
            "id": field("id"),
        },
        "timezone": opt_str(raw, &["timezone"]),
        "userList": users(raw),
        "fsInfo": {"disks": filesystems(raw)},
    })
}

/// The launcher's `guestInfo` → KubeVirt's VirtualMachineInstanceUserList.
pub fn user_list(raw: &Value) -> Value {
    json!({"kind": "VirtualMachineInstanceUserList", "apiVersion": "kubevirt.io/v1",
           "metadata": {}, "items": users(raw)})
}

/// The launcher's `guestInfo` → KubeVirt's VirtualMachineInstanceFileSystemList.
pub fn filesystem_list(raw: &Value) -> Value {
    json!({"kind": "VirtualMachineInstanceFileSystemList", "apiVersion": "kubevirt.io/v1",
           "metadata": {}, "items": filesystems(raw)})
}

/// The VM's run strategy (`spec.runStrategy`, else the deprecated `spec.running`).
pub fn run_strategy(vm: &Value) -> String {
    if let Some(s) = str_at(vm, &["spec", "runStrategy"]) {
        return s.to_string();
    }
    match vm.pointer("/spec/running").and_then(Value::as_bool) {
        Some(true) => "Always".into(),
        _ => "Halted".into(),
    }
}

pub(super) fn vmi_phase(vmi: &Value) -> &str {
    str_at(vmi, &["status", "phase"]).unwrap_or("")
}

pub(super) fn is_final(vmi: &Value) -> bool {
    matches!(vmi_phase(vmi), "Succeeded" | "Failed")
}

/// The body of a start/stop/restart request (all fields optional).
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VerbOptions {
    /// stop: the grace period to stop with.
    pub grace_period: Option<i64>,
    /// restart: only 0 (force) is supported, as in KubeVirt.
    pub grace_period_seconds: Option<i64>,
    /// start: start the VMI paused.
    #[serde(default)]
    pub paused: bool,
}

/// What a VM verb writes: JSON patches (RFC 6902) for the VMI, the VM and the VM's status.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VmPlan {
    pub vmi_patch: Option<Value>,
    pub vm_patch: Option<Value>,
    pub vm_status_patch: Option<Value>,
}

/// The spec patch that flips the run strategy to Always (`running`) or Halted.
pub(super) fn running_patch(vm: &Value, running: bool) -> Value {
    if let Some(s) = vm.pointer("/spec/runStrategy") {
        let to = if running { "Always" } else { "Halted" };
        json!([{"op": "test", "path": "/spec/runStrategy", "value": s},
               {"op": "replace", "path": "/spec/runStrategy", "value": to}])
    } else if let Some(r) = vm.pointer("/spec/running") {
        json!([{"op": "test", "path": "/spec/running", "value": r},
               {"op": "replace", "path": "/spec/running", "value": running}])
    } else {
        let to = if running { "Always" } else { "Halted" };
        json!([{"op": "add", "path": "/spec/runStrategy", "value": to}])
    }
}

/// The status patch that appends `changes` to `status.stateChangeRequests` (KubeVirt's rules:
/// onto an empty list; a lone Stop replaces pending requests; anything else is a conflict).
pub fn change_requests_patch(vm: &Value, changes: Vec<Value>) -> Result<Value, ApiErr> {
    let status = vm
        .get("status")
        .filter(|s| s.as_object().is_some_and(|o| !o.is_empty()));
    let Some(status) = status else {
        return Ok(json!([{"op": "add", "path": "/status",
                          "value": {"stateChangeRequests": changes}}]));
    };
    let mut ops = Vec::new();
    match status.get("stateChangeRequests") {
        None | Some(Value::Null) => {
            ops.push(json!({"op": "add", "path": "/status/stateChangeRequests", "value": changes}));
        }
        Some(existing) => {
            let empty = existing.as_array().is_none_or(Vec::is_empty);
            let lone_stop = changes.len() == 1 && changes[0]["action"] == "Stop";
            if !empty && !lone_stop {
                return Err(ApiErr::conflict(
                    "unable to complete request: stop/start already underway",
                ));
            }
            ops.push(
                json!({"op": "test", "path": "/status/stateChangeRequests", "value": existing}),
            );
            ops.push(
                json!({"op": "replace", "path": "/status/stateChangeRequests", "value": changes}),
            );
        }
    }
    if status.get("startFailure").is_some_and(|v| !v.is_null()) {
        ops.push(json!({"op": "remove", "path": "/status/startFailure"}));
    }
    Ok(Value::Array(ops))
}

pub(super) fn grace_patch(vmi: &Value, grace: i64) -> Value {
    let mut ops = Vec::new();
    if let Some(old) = vmi.pointer("/spec/terminationGracePeriodSeconds") {
        ops.push(
            json!({"op": "test", "path": "/spec/terminationGracePeriodSeconds", "value": old}),
        );
    }
    ops.push(json!({"op": "add", "path": "/spec/terminationGracePeriodSeconds", "value": grace}));
    Value::Array(ops)
}

pub(super) fn stop_request(vmi: &Value) -> Value {
    json!({"action": "Stop", "uid": str_at(vmi, &["metadata", "uid"]).unwrap_or("")})
}

/// KubeVirt's start/stop/restart semantics as a pure function of the VM, its VMI (same name,
/// if any) and the request body: the patches to write, or the error to answer.
pub fn plan_vm(
    verb: VmVerb,
    vm: &Value,
    vmi: Option<&Value>,
    opts: &VerbOptions,
) -> Result<VmPlan, ApiErr> {
    let strategy = run_strategy(vm);
    let active = vmi.filter(|v| !is_final(v));
    let mut plan = VmPlan::default();
    match verb {
        VmVerb::Start => {
            if active.is_some_and(|v| !matches!(vmi_phase(v), "" | "Unknown")) {
                return Err(ApiErr::conflict("VM is already running"));
            }
            let mut start = json!({"action": "Start"});
            if opts.paused {
                start["data"] = json!({"paused": "true"});
            }
            match strategy.as_str() {
                "Halted" if opts.paused => {
                    plan.vm_status_patch = Some(change_requests_patch(vm, vec![start])?);
                }
                "Halted" => plan.vm_patch = Some(running_patch(vm, true)),
                "Manual" | "RerunOnFailure" => {
                    let phase = vmi.map(vmi_phase).unwrap_or("");
                    if strategy == "RerunOnFailure" && phase == "Failed" {
                        return Err(ApiErr::conflict(
                            "RerunOnFailure does not support starting VM from failed state",
                        ));
                    }
                    let restart = match vmi {
                        Some(v) if strategy == "Manual" => is_final(v),
                        Some(_) => phase == "Succeeded",
                        None => false,
                    };
                    let changes = match vmi {
                        Some(v) if restart => vec![stop_request(v), start],
                        _ => vec![start],
                    };
                    plan.vm_status_patch = Some(change_requests_patch(vm, changes)?);
                }
                other => {
                    return Err(ApiErr::conflict(format!(
                        "{other} does not support manual start requests"
                    )));
                }
            }
        }
        VmVerb::Stop => {
            if let (Some(v), Some(g)) = (active, opts.grace_period) {
                if g < 0 {
                    return Err(ApiErr::new(
                        400,
                        "gracePeriod has to be greater or equal to 0",
                    ));
                }
                plan.vmi_patch = Some(grace_patch(v, g));
            }
            match strategy.as_str() {
                "Halted" | "Manual" | "RerunOnFailure" => {
                    let Some(v) = active else {
                        return Err(ApiErr::conflict("VM is not running"));
                    };
                    if strategy == "Halted" {
                        let old = v
                            .pointer("/spec/terminationGracePeriodSeconds")
                            .and_then(Value::as_i64);
                        let shorter = match (opts.grace_period, old) {
                            (None, _) => false,
                            (Some(g), Some(o)) => g < o,
                            (Some(_), None) => true,
                        };
                        if !shorter {
                            return Err(ApiErr::conflict(
                                "Halted only supports manual stop requests with a shorter graceperiod",
                            ));
                        }
                    }
                    plan.vm_status_patch = Some(change_requests_patch(vm, vec![stop_request(v)])?);
                }
                _ => plan.vm_patch = Some(running_patch(vm, false)),
            }
        }
        VmVerb::Restart => {
            match opts.grace_period_seconds {
                Some(g) if g > 0 => {
                    return Err(ApiErr::new(
                        400,
                        "For force restart, only gracePeriod=0 is supported for now",
                    ));
                }
                Some(g) if g < 0 => {
                    return Err(ApiErr::new(
                        400,
                        "gracePeriod has to be greater or equal to 0",
                    ));
                }
                _ => {}
            }
            if matches!(strategy.as_str(), "Halted" | "Once") {
                return Err(ApiErr::conflict(format!(
                    "RunStrategy {strategy} does not support manual restart requests"
                )));
            }
            let Some(v) = vmi else {
                return Err(ApiErr::conflict("VM is not running"));
            };
            if opts.grace_period_seconds == Some(0) && !is_final(v) {
                plan.vmi_patch = Some(grace_patch(v, 0));
            }
            let changes = vec![stop_request(v), json!({"action": "Start"})];
            plan.vm_status_patch = Some(change_requests_patch(vm, changes)?);
        }
    }
    Ok(plan)
}

// ---------------------------------------------------------------------------------------------
// The router.
