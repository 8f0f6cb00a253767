//! The agent's per-VMI decisions, pure: from the VMI as stored and what the node observes of
//! its launcher, what to do next (start, stop, clean up) and which status to write (phase,
//! conditions, reasons). No I/O; unit-tested.

use std::collections::BTreeMap;

use ferrovirt_api::kubevirt::vmi::VirtualMachineInstance;
use ferrovirt_launcher::control::{ExitReason, ExitReport, LauncherStatus, RunPhase};
use serde_json::{Value, json};

/// The finalizer the agent keeps on VMIs it runs, so deletion waits for QEMU to stop.
pub const FINALIZER: &str = "ferrovirt.io/node-agent";
/// KubeVirt's default terminationGracePeriodSeconds for VMIs.
pub const DEFAULT_GRACE_SECONDS: u64 = 180;

/// What the node sees of a VMI's launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    /// No launcher directory, or a directory without a live launcher and without exit report.
    NoLauncher,
    /// The launcher answered.
    Running(LauncherStatus),
    /// The launcher wrote its exit report and is gone.
    Exited(ExitReport),
}

/// The next step for one VMI.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Prepare volumes and start a launcher.
    Start,
    /// Ask the launcher to shut QEMU down within `grace_seconds`.
    Stop { grace_seconds: u64 },
    /// Merge-patch the VMI's status with this value (the `status` object).
    PatchStatus(Value),
    /// Merge these annotations into the VMI's metadata (QEMU and launcher pids).
    Annotate(BTreeMap<String, String>),
    /// Remove the agent's finalizer and the VMI's directory.
    Cleanup,
}

fn phase(vmi: &VirtualMachineInstance) -> String {
    vmi.status
        .as_ref()
        .and_then(|s| s.phase.as_ref())
        .and_then(|p| {
            serde_json::to_value(p)
                .ok()
                .and_then(|v| v.as_str().map(String::from))
        })
        .unwrap_or_default()
}

fn is_final(phase: &str) -> bool {
    phase == "Succeeded" || phase == "Failed"
}

/// The grace period for stopping this VMI.
pub fn grace_seconds(vmi: &VirtualMachineInstance) -> u64 {
    vmi.spec
        .as_ref()
        .and_then(|s| s.termination_grace_period_seconds)
        .and_then(|g| u64::try_from(g).ok())
        .unwrap_or(DEFAULT_GRACE_SECONDS)
}

fn condition(type_: &str, status: bool, reason: &str, message: &str) -> Value {
    json!({
        "type": type_,
        "status": if status { "True" } else { "False" },
        "reason": reason,
        "message": message,
    })
}

/// Keeps `lastTransitionTime` of unchanged conditions, stamps changed ones with `now`.
pub fn merge_conditions(existing: Option<&Value>, wanted: Vec<Value>, now: &str) -> Vec<Value> {
    let old: BTreeMap<String, &Value> = existing
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
        .filter_map(|c| Some((c.get("type")?.as_str()?.to_string(), c)))
        .collect();
    wanted
        .into_iter()
        .map(|mut c| {
            let t = c["type"].as_str().unwrap_or_default().to_string();
            let since = old
                .get(&t)
                .filter(|o| o.get("status") == c.get("status"))
                .and_then(|o| o.get("lastTransitionTime").cloned())
                .unwrap_or_else(|| Value::String(now.to_string()));
            c["lastTransitionTime"] = since;
            c["lastProbeTime"] = Value::Null;
            c
        })
        .collect()
}

/// Annotation with the VMI's QEMU process id on its node.
pub const QEMU_PID_ANNOTATION: &str = "ferrovirt.io/qemu-pid";
/// Annotation with the VMI's launcher process id on its node.
pub const LAUNCHER_PID_ANNOTATION: &str = "ferrovirt.io/launcher-pid";

/// What the node knows beyond the launcher's state, for status reporting.
#[derive(Debug, Clone, Copy, Default)]
pub struct Report<'a> {
    /// The launcher's last guest-agent report.
    pub guest: Option<&'a Value>,
    /// The pod network attachment: (interface name, the VMI's address on the pod network).
    pub pod: Option<(&'a str, &'a str)>,
    /// Whether the VMI can be live-migrated (`Err((reason, message))`: not); `None`: not
    /// known (no `LiveMigratable` condition is reported).
    pub migratable: Option<Result<(), (&'a str, &'a str)>>,
}

/// VMI `status.reason` of a VM whose launcher fenced itself (killed QEMU when the node's
/// lease could not be confirmed): it did not finish its work and fails.
pub const REASON_FENCED: &str = "Fenced";

/// The VMI's final phase and reason once QEMU ended, from the launcher's exit reason.
pub fn exit_phase_reason(reason: ExitReason) -> (&'static str, &'static str) {
    let phase = if reason.succeeded() {
        "Succeeded"
    } else {
        "Failed"
    };
    let reason = match reason {
        ExitReason::GuestShutdown => "GuestShutdown",
        ExitReason::Shutdown => "Stopped",
        ExitReason::Killed => "StoppedAfterGracePeriod",
        ExitReason::Crashed => "QemuCrashed",
        ExitReason::StartFailed => "QemuStartFailed",
        ExitReason::Fenced => REASON_FENCED,
        ExitReason::Migrated => "Migrated",
    };
    (phase, reason)
}

/// `status.interfaces` from the spec's interfaces (with their MACs) and, when the guest agent
/// answered, the guest's view of them (matched by MAC): IPs and guest interface names.
pub fn interfaces_status(vmi: &VirtualMachineInstance, report: Report<'_>) -> Vec<Value> {
    let guest = report.guest;
    let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
    let name = vmi.metadata.name.as_deref().unwrap_or("");
    let guest_ifaces: Vec<&Value> = guest
        .and_then(|g| g.get("interfaces"))
        .and_then(|i| i.as_array())
        .into_iter()
        .flatten()
        .collect();
    let spec_ifaces = vmi
        .spec
        .as_ref()
        .and_then(|s| s.domain.devices.interfaces.as_ref());
    spec_ifaces
        .into_iter()
        .flatten()
        .map(|i| {
            let mac = i
                .mac_address
                .clone()
                .map(|m| m.replace('-', ":").to_lowercase())
                .unwrap_or_else(|| crate::mapping::derived_mac(ns, name, &i.name));
            let mut out = json!({"name": i.name, "mac": mac, "infoSource": "domain"});
            let seen = guest_ifaces.iter().find(|g| {
                g.get("hardware-address")
                    .and_then(|m| m.as_str())
                    .is_some_and(|m| m.eq_ignore_ascii_case(&mac))
            });
            if let Some(g) = seen {
                let ips: Vec<String> = g
                    .get("ip-addresses")
                    .and_then(|a| a.as_array())
                    .into_iter()
                    .flatten()
                    .filter_map(|a| a.get("ip-address").and_then(|x| x.as_str()))
                    .map(String::from)
                    .collect();
                out["interfaceName"] = g.get("name").cloned().unwrap_or(Value::Null);
                out["infoSource"] = json!("domain, guest-agent");
                if let Some(first) = ips.first() {
                    out["ipAddress"] = json!(first);
                    out["ipAddresses"] = json!(ips);
                }
            }
            // The VMI's pod address is what KubeVirt reports for pod-network interfaces.
            if let Some((pod_iface, addr)) = report.pod
                && pod_iface == i.name
            {
                out["ipAddress"] = json!(addr);
                let mut ips = vec![json!(addr)];
                if let Some(more) = out.get("ipAddresses").and_then(|v| v.as_array()) {
                    ips.extend(more.iter().filter(|x| x.as_str() != Some(addr)).cloned());
                }
                out["ipAddresses"] = json!(ips);
            }
            out
        })
        .collect()
}

/// `status.guestOSInfo` from the guest agent's OS info.
pub fn guest_os_info(guest: &Value) -> Option<Value> {
    let os = guest.get("osInfo").filter(|o| o.is_object())?;
    let f = |k: &str| os.get(k).cloned().unwrap_or(Value::Null);
    Some(json!({
        "name": f("name"),
        "kernelRelease": f("kernel-release"),
        "version": f("version"),
        "prettyName": f("pretty-name"),
        "versionId": f("version-id"),
        "kernelVersion": f("kernel-version"),
        "machine": f("machine"),
        "id": f("id"),
    }))
}

/// The annotations the VMI should carry while its launcher runs.
pub fn pid_annotations(st: &LauncherStatus) -> BTreeMap<String, String> {
    let mut a = BTreeMap::new();
    a.insert(
        LAUNCHER_PID_ANNOTATION.to_string(),
        st.launcher_pid.to_string(),
    );
    if let Some(q) = st.qemu_pid {
        a.insert(QEMU_PID_ANNOTATION.to_string(), q.to_string());
    }
    a
}

/// The status the VMI should have while its launcher runs (`guest`: the launcher's last
/// guest-agent report, if any).
pub fn running_status(
    vmi: &VirtualMachineInstance,
    st: &LauncherStatus,
    node: &str,
    now: &str,
    report: Report<'_>,
) -> Value {
    let paused = st.phase == RunPhase::Paused;
    let ready = st.phase == RunPhase::Running;
    let wanted = vec![
        condition(
            "Ready",
            ready,
            if ready {
                ""
            } else if paused {
                "PausedByUser"
            } else {
                "NotRunning"
            },
            if ready {
                ""
            } else if paused {
                "the VMI is paused"
            } else {
                "the guest is not running"
            },
        ),
        condition(
            "Paused",
            paused,
            if paused { "PausedByUser" } else { "" },
            if paused { "VMI was paused by user" } else { "" },
        ),
        condition(
            "AgentConnected",
            st.guest_agent_connected,
            if st.guest_agent_connected {
                ""
            } else {
                "GuestAgentNotConnected"
            },
            "",
        ),
    ];
    let mut wanted = wanted;
    match report.migratable {
        Some(Ok(())) => wanted.push(condition("LiveMigratable", true, "", "")),
        Some(Err((reason, message))) => {
            wanted.push(condition("LiveMigratable", false, reason, message));
        }
        None => {}
    }
    let existing = serde_json::to_value(vmi.status.as_ref().and_then(|s| s.conditions.as_ref()))
        .unwrap_or(Value::Null);
    let mut out = json!({
        "phase": "Running",
        "nodeName": node,
        "reason": Value::Null,
        "conditions": merge_conditions(Some(&existing), wanted, now),
        "interfaces": interfaces_status(vmi, report),
    });
    if let Some(os) = report.guest.and_then(guest_os_info) {
        out["guestOSInfo"] = os;
    }
    out["fsFreezeStatus"] = if st.fs_frozen {
        json!("frozen")
    } else {
        Value::Null
    };
    out
}

/// The final status after QEMU ended.
pub fn exit_status(vmi: &VirtualMachineInstance, rep: &ExitReport, now: &str) -> Value {
    let (phase, reason) = exit_phase_reason(rep.reason);
    let message = rep.message.clone();
    let existing = serde_json::to_value(vmi.status.as_ref().and_then(|s| s.conditions.as_ref()))
        .unwrap_or(Value::Null);
    json!({
        "phase": phase,
        "reason": reason,
        "conditions": merge_conditions(
            Some(&existing),
            vec![
                condition("Ready", false, reason, &message),
                condition("Paused", false, "", ""),
                condition("AgentConnected", false, "GuestAgentNotConnected", ""),
            ],
            now,
        ),
    })
}

/// A Failed status for a VMI the node could not start (bad volume, unsupported device…).
pub fn start_failed_status(reason: &str, message: &str, now: &str) -> Value {
    json!({
        "phase": "Failed",
        "reason": reason,
        "conditions": [{
            "type": "Ready", "status": "False", "reason": reason, "message": message,
            "lastTransitionTime": now, "lastProbeTime": null,
        }],
    })
}

/// True when `patch` (a status object) would change nothing in the VMI's current status.
pub fn status_unchanged(vmi: &VirtualMachineInstance, patch: &Value) -> bool {
    let current = serde_json::to_value(&vmi.status).unwrap_or(Value::Null);
    patch.as_object().into_iter().flatten().all(|(k, v)| {
        let cur = current.get(k).unwrap_or(&Value::Null);
        if k == "conditions" {
            strip_times(cur) == strip_times(v)
        } else {
            cur == v
        }
    })
}

fn strip_times(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(a) = v.as_array_mut() {
        for c in a.iter_mut() {
            if let Some(o) = c.as_object_mut() {
                o.remove("lastTransitionTime");
                o.remove("lastProbeTime");
                o.retain(|_, x| !x.is_null() && x != "");
            }
        }
    }
    v
}

/// Decides the next steps for a VMI bound to this node.
/// `report`: what else the node knows (guest-agent data, pod address) for status.
pub fn decide(
    vmi: &VirtualMachineInstance,
    observed: &Observed,
    node: &str,
    now: &str,
    report: Report<'_>,
) -> Vec<Action> {
    let deleting = vmi.metadata.deletion_timestamp.is_some();
    let phase = phase(vmi);
    match (deleting, observed) {
        (true, Observed::Running(st)) if st.phase != RunPhase::ShuttingDown => {
            vec![Action::Stop {
                grace_seconds: grace_seconds(vmi),
            }]
        }
        (true, Observed::Running(_)) => vec![],
        (true, _) => vec![Action::Cleanup],
        (false, Observed::Exited(rep)) => {
            if is_final(&phase) {
                vec![]
            } else {
                vec![Action::PatchStatus(exit_status(vmi, rep, now))]
            }
        }
        (false, Observed::Running(st)) => {
            if is_final(&phase) {
                // Marked final from outside (node fenced, controller): stop what still runs.
                if st.phase == RunPhase::ShuttingDown {
                    vec![]
                } else {
                    vec![Action::Stop { grace_seconds: 0 }]
                }
            } else {
                let mut acts = Vec::new();
                let s = running_status(vmi, st, node, now, report);
                if !status_unchanged(vmi, &s) {
                    acts.push(Action::PatchStatus(s));
                }
                let want = pid_annotations(st);
                let have = vmi.metadata.annotations.clone().unwrap_or_default();
                if want.iter().any(|(k, v)| have.get(k) != Some(v)) {
                    acts.push(Action::Annotate(want));
                }
                acts
            }
        }
        (false, Observed::NoLauncher) => match phase.as_str() {
            "Succeeded" | "Failed" => vec![],
            "Running" => vec![Action::PatchStatus(start_failed_status(
                "LauncherLost",
                "the VMI's launcher and QEMU process are gone without an exit report",
                now,
            ))],
            _ => vec![Action::Start],
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(v: Value) -> VirtualMachineInstance {
        serde_json::from_value(v).unwrap()
    }

    fn st(phase: RunPhase) -> LauncherStatus {
        LauncherStatus {
            version: 1,
            launcher_pid: 10,
            qemu_pid: Some(11),
            vmi_uid: "u".into(),
            phase,
            guest_agent_connected: false,
            started_at: 0,
            fs_frozen: false,
        }
    }

    const NOW: &str = "2026-11-30T00:00:00Z";

    #[test]
    fn starts_scheduled_vmis() {
        let v = vmi(
            json!({"metadata": {"name": "a"}, "status": {"phase": "Scheduled", "nodeName": "n1"}}),
        );
        assert_eq!(
            decide(&v, &Observed::NoLauncher, "n1", NOW, Report::default()),
            vec![Action::Start]
        );
    }

    #[test]
    fn reports_running_then_nothing_when_unchanged() {
        let v = vmi(json!({"metadata": {"name": "a"}, "status": {"phase": "Scheduled"}}));
        let acts = decide(
            &v,
            &Observed::Running(st(RunPhase::Running)),
            "n1",
            NOW,
            Report::default(),
        );
        let Action::PatchStatus(p) = &acts[0] else {
            panic!("{acts:?}")
        };
        assert_eq!(p["phase"], "Running");
        assert_eq!(p["conditions"][0]["type"], "Ready");
        assert_eq!(p["conditions"][0]["status"], "True");
        let Action::Annotate(a) = &acts[1] else {
            panic!("{acts:?}")
        };
        assert_eq!(a[QEMU_PID_ANNOTATION], "11");
        assert_eq!(a[LAUNCHER_PID_ANNOTATION], "10");
        // Applying the patch makes the next decision a no-op.
        let mut applied = json!({"metadata": {"name": "a", "annotations": a}, "status": p.clone()});
        applied["status"]["reason"] = Value::Null;
        let v2 = vmi(applied);
        assert_eq!(
            decide(
                &v2,
                &Observed::Running(st(RunPhase::Running)),
                "n1",
                "2026-12-01T00:00:00Z",
                Report::default()
            ),
            vec![]
        );
        // Pausing flips Ready and Paused.
        let acts = decide(
            &v2,
            &Observed::Running(st(RunPhase::Paused)),
            "n1",
            NOW,
            Report::default(),
        );
        let Action::PatchStatus(p) = &acts[0] else {
            panic!()
        };
        assert_eq!(p["conditions"][0]["status"], "False");
        assert_eq!(p["conditions"][1]["type"], "Paused");
        assert_eq!(p["conditions"][1]["status"], "True");
    }

    #[test]
    fn reports_interfaces_and_guest_os() {
        let v = vmi(json!({
            "metadata": {"name": "a", "namespace": "ns"},
            "spec": {"domain": {"devices": {"interfaces": [
                {"name": "default", "masquerade": {}},
                {"name": "fixed", "masquerade": {}, "macAddress": "DE:AD:BE:EF:00:01"}
            ]}}},
            "status": {"phase": "Running"}
        }));
        let derived = crate::mapping::derived_mac("ns", "a", "default");
        let guest = json!({
            "osInfo": {"id": "ferrovirt-testguest", "pretty-name": "T 1", "kernel-release": "6.1"},
            "interfaces": [
                {"name": "lo", "hardware-address": "00:00:00:00:00:00",
                 "ip-addresses": [{"ip-address": "127.0.0.1", "ip-address-type": "ipv4", "prefix": 8}]},
                {"name": "eth0", "hardware-address": derived,
                 "ip-addresses": [{"ip-address": "10.0.2.15", "ip-address-type": "ipv4", "prefix": 24}]}
            ]
        });
        let s = running_status(
            &v,
            &st(RunPhase::Running),
            "n1",
            NOW,
            Report {
                guest: Some(&guest),
                pod: None,
                migratable: Some(Err(("DisksNotLiveMigratable", "PVC d is not shared"))),
            },
        );
        let lm = s["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "LiveMigratable")
            .unwrap();
        assert_eq!(lm["status"], "False");
        assert_eq!(lm["reason"], "DisksNotLiveMigratable");
        assert_eq!(s["guestOSInfo"]["id"], "ferrovirt-testguest");
        assert_eq!(s["guestOSInfo"]["prettyName"], "T 1");
        assert_eq!(s["interfaces"][0]["name"], "default");
        assert_eq!(s["interfaces"][0]["mac"], json!(derived));
        assert_eq!(s["interfaces"][0]["ipAddress"], "10.0.2.15");
        assert_eq!(s["interfaces"][0]["interfaceName"], "eth0");
        assert_eq!(s["interfaces"][1]["mac"], "de:ad:be:ef:00:01");
        assert!(s["interfaces"][1].get("ipAddress").is_none());
        // Without the guest agent: interfaces from the spec, no guestOSInfo.
        let s = running_status(&v, &st(RunPhase::Running), "n1", NOW, Report::default());
        assert!(s.get("guestOSInfo").is_none());
        assert_eq!(s["interfaces"].as_array().map(Vec::len), Some(2));
    }

    #[test]
    fn deletion_stops_then_cleans_up() {
        let v = vmi(json!({"metadata": {"name": "a", "deletionTimestamp": NOW},
            "spec": {"domain": {"devices": {}}, "terminationGracePeriodSeconds": 7},
            "status": {"phase": "Running"}}));
        assert_eq!(
            decide(
                &v,
                &Observed::Running(st(RunPhase::Running)),
                "n1",
                NOW,
                Report::default()
            ),
            vec![Action::Stop { grace_seconds: 7 }]
        );
        assert_eq!(
            decide(
                &v,
                &Observed::Running(st(RunPhase::ShuttingDown)),
                "n1",
                NOW,
                Report::default()
            ),
            vec![]
        );
        let rep = ExitReport {
            reason: ExitReason::Shutdown,
            message: "".into(),
            at: 0,
        };
        assert_eq!(
            decide(&v, &Observed::Exited(rep), "n1", NOW, Report::default()),
            vec![Action::Cleanup]
        );
        assert_eq!(
            decide(&v, &Observed::NoLauncher, "n1", NOW, Report::default()),
            vec![Action::Cleanup]
        );
    }

    #[test]
    fn exits_become_final_phases() {
        let v = vmi(json!({"metadata": {"name": "a"}, "status": {"phase": "Running"}}));
        let rep = ExitReport {
            reason: ExitReason::GuestShutdown,
            message: "off".into(),
            at: 0,
        };
        let acts = decide(&v, &Observed::Exited(rep), "n1", NOW, Report::default());
        let Action::PatchStatus(p) = &acts[0] else {
            panic!()
        };
        assert_eq!(p["phase"], "Succeeded");
        assert_eq!(p["reason"], "GuestShutdown");
        let rep = ExitReport {
            reason: ExitReason::Crashed,
            message: "boom".into(),
            at: 0,
        };
        let acts = decide(&v, &Observed::Exited(rep), "n1", NOW, Report::default());
        let Action::PatchStatus(p) = &acts[0] else {
            panic!()
        };
        assert_eq!(p["phase"], "Failed");
        assert_eq!(p["conditions"][0]["message"], "boom");
        // A running VMI whose launcher vanished is Failed.
        let acts = decide(&v, &Observed::NoLauncher, "n1", NOW, Report::default());
        let Action::PatchStatus(p) = &acts[0] else {
            panic!()
        };
        assert_eq!(p["reason"], "LauncherLost");
        // Final VMIs are left alone, but a still-running QEMU under a Failed VMI is stopped.
        let f = vmi(json!({"metadata": {"name": "a"}, "status": {"phase": "Failed"}}));
        assert_eq!(
            decide(&f, &Observed::NoLauncher, "n1", NOW, Report::default()),
            vec![]
        );
        assert_eq!(
            decide(
                &f,
                &Observed::Running(st(RunPhase::Running)),
                "n1",
                NOW,
                Report::default()
            ),
            vec![Action::Stop { grace_seconds: 0 }]
        );
    }

    #[test]
    fn fenced_vms_fail() {
        // A launcher that fenced itself: the VM did not finish its work.
        assert_eq!(exit_phase_reason(ExitReason::Fenced), ("Failed", "Fenced"));
        assert_eq!(
            exit_phase_reason(ExitReason::Killed),
            ("Succeeded", "StoppedAfterGracePeriod")
        );
        let v = vmi(json!({"metadata": {"name": "a"}, "status": {"phase": "Running"}}));
        let rep = ExitReport {
            reason: ExitReason::Fenced,
            message: "self-fencing: the node's lease could not be confirmed by …".into(),
            at: 0,
        };
        let acts = decide(
            &v,
            &Observed::Exited(rep.clone()),
            "n1",
            NOW,
            Report::default(),
        );
        let Action::PatchStatus(p) = &acts[0] else {
            panic!("{acts:?}")
        };
        assert_eq!(
            (&p["phase"], &p["reason"]),
            (&json!("Failed"), &json!("Fenced"))
        );
        assert_eq!(p["conditions"][0]["reason"], "Fenced");
        assert!(
            p["conditions"][0]["message"]
                .as_str()
                .unwrap()
                .contains("self-fencing")
        );
        // Never restarted: a final VMI whose launcher is gone needs nothing.
        let failed = vmi(json!({"metadata": {"name": "a"}, "status": {"phase": "Failed"}}));
        assert!(
            decide(
                &failed,
                &Observed::Exited(rep),
                "n1",
                NOW,
                Report::default()
            )
            .is_empty()
        );
        assert!(decide(&failed, &Observed::NoLauncher, "n1", NOW, Report::default()).is_empty());
    }

    #[test]
    fn condition_times_survive_unchanged_status() {
        let existing = json!([{"type": "Ready", "status": "True", "lastTransitionTime": "T0"}]);
        let out = merge_conditions(
            Some(&existing),
            vec![condition("Ready", true, "", "")],
            "T1",
        );
        assert_eq!(out[0]["lastTransitionTime"], "T0");
        let out = merge_conditions(
            Some(&existing),
            vec![condition("Ready", false, "x", "")],
            "T1",
        );
        assert_eq!(out[0]["lastTransitionTime"], "T1");
    }
}
