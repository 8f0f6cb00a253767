//! The HyperConverged's status conditions, pure: Available, Progressing, Degraded,
//! ReconcileComplete and Upgradeable with HCO's reasons (`Init`, `ReconcileCompleted`,
//! `ReconcileFailed`, `<Operand>NotAvailable`, `<Operand>Degraded`) from the reconcile's
//! outcome and the health of each platform component (API server, the controllers' leader,
//! each node agent, the importer), and their merge into the stored conditions (a transition
//! time moves only when the status does).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::kubevirt::misc::KubeVirtCondition;

/// HCO's condition types.
pub const AVAILABLE: &str = "Available";
pub const PROGRESSING: &str = "Progressing";
pub const DEGRADED: &str = "Degraded";
pub const RECONCILE_COMPLETE: &str = "ReconcileComplete";
pub const UPGRADEABLE: &str = "Upgradeable";

/// HCO's reasons and messages.
pub const REASON_COMPLETED: &str = "ReconcileCompleted";
pub const MESSAGE_COMPLETED: &str = "Reconcile completed successfully";
pub const REASON_INIT: &str = "Init";
pub const MESSAGE_INIT: &str = "Initializing HyperConverged cluster";
pub const REASON_FAILED: &str = "ReconcileFailed";

/// The health of one platform component, under the operand that owns it in KubeVirt's
/// picture (`KubeVirt`: virt-api, virt-controller, virt-handler; `CDI`: the importer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComponentHealth {
    /// `KubeVirt` or `CDI`.
    pub operand: &'static str,
    /// Which component, as a reader looks for it (`virt-handler on node node2`).
    pub component: String,
    pub healthy: bool,
    /// Without it the operand is not available (the API server, the controllers' leader, the
    /// last node agent); otherwise only degraded.
    pub critical: bool,
    /// Why it is unhealthy (or what it is when healthy).
    pub detail: String,
}

/// What one reconcile saw.
#[derive(Debug, Clone, Default)]
pub struct Observation {
    /// The reconcile failed with this error.
    pub reconcile_error: Option<String>,
    /// This pass created owned objects (the first reconcile).
    pub initializing: bool,
    pub components: Vec<ComponentHealth>,
}

/// One condition without timestamps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cond {
    pub type_: &'static str,
    pub status: bool,
    pub reason: String,
    pub message: String,
}

fn cond(type_: &'static str, status: bool, reason: &str, message: &str) -> Cond {
    Cond {
        type_,
        status,
        reason: reason.into(),
        message: message.into(),
    }
}

/// `<operand> is <what>: <component>: <detail>; …` for the unhealthy components of the first
/// operand that has any matching `pick`, with that operand's name.
fn first_failing(
    components: &[ComponentHealth],
    pick: impl Fn(&ComponentHealth) -> bool,
    what: &str,
) -> Option<(&'static str, String)> {
    let failing: Vec<&ComponentHealth> = components
        .iter()
        .filter(|c| !c.healthy && pick(c))
        .collect();
    let operand = failing.first()?.operand;
    let parts: Vec<String> = failing
        .iter()
        .filter(|c| c.operand == operand)
        .map(|c| format!("{}: {}", c.component, c.detail))
        .collect();
    Some((
        operand,
        format!("{operand} is {what}: {}", parts.join("; ")),
    ))
}

/// The five conditions for an observation.
pub fn conditions(o: &Observation) -> Vec<Cond> {
    let reconcile = match &o.reconcile_error {
        Some(e) => cond(
            RECONCILE_COMPLETE,
            false,
            REASON_FAILED,
            &format!("Error while reconciling: {e}"),
        ),
        None => cond(
            RECONCILE_COMPLETE,
            true,
            REASON_COMPLETED,
            MESSAGE_COMPLETED,
        ),
    };
    if o.initializing {
        return vec![
            cond(AVAILABLE, false, REASON_INIT, MESSAGE_INIT),
            cond(PROGRESSING, true, REASON_INIT, MESSAGE_INIT),
            cond(DEGRADED, false, REASON_INIT, MESSAGE_INIT),
            reconcile,
            cond(UPGRADEABLE, false, REASON_INIT, MESSAGE_INIT),
        ];
    }
    let available = match first_failing(&o.components, |c| c.critical, "not available") {
        Some((op, msg)) => cond(AVAILABLE, false, &format!("{op}NotAvailable"), &msg),
        None => cond(AVAILABLE, true, REASON_COMPLETED, MESSAGE_COMPLETED),
    };
    let degraded = match first_failing(&o.components, |_| true, "degraded") {
        Some((op, msg)) => cond(DEGRADED, true, &format!("{op}Degraded"), &msg),
        None => cond(DEGRADED, false, REASON_COMPLETED, MESSAGE_COMPLETED),
    };
    vec![
        available,
        cond(PROGRESSING, false, REASON_COMPLETED, MESSAGE_COMPLETED),
        degraded,
        reconcile,
        cond(UPGRADEABLE, true, REASON_COMPLETED, MESSAGE_COMPLETED),
    ]
}

/// The stored conditions after this pass: each of `new` with the old transition time when
/// its status did not change, else `now`.
pub fn merge(old: &[KubeVirtCondition], new: &[Cond], now: &Time) -> Vec<KubeVirtCondition> {
    new.iter()
        .map(|c| {
            let status = if c.status { "True" } else { "False" };
            let prev = old.iter().find(|o| o.type_ == c.type_);
            let since = match prev {
                Some(p) if p.status == status => p.last_transition_time.clone(),
                _ => None,
            };
            KubeVirtCondition {
                type_: c.type_.into(),
                status: status.into(),
                last_probe_time: None,
                last_transition_time: Some(since.unwrap_or_else(|| now.clone())),
                last_heartbeat_time: None,
                reason: Some(c.reason.clone()),
                message: Some(c.message.clone()),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handler(node: &str, healthy: bool) -> ComponentHealth {
        ComponentHealth {
            operand: "KubeVirt",
            component: format!("virt-handler on node {node}"),
            healthy,
            critical: false,
            detail: if healthy {
                "Ready".into()
            } else {
                "NodeStatusUnknown: its Lease expired".into()
            },
        }
    }

    fn get<'a>(cs: &'a [Cond], t: &str) -> &'a Cond {
        cs.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn healthy_is_available() {
        let cs = conditions(&Observation {
            components: vec![handler("node1", true), handler("node2", true)],
            ..Default::default()
        });
        assert!(get(&cs, AVAILABLE).status);
        assert!(!get(&cs, DEGRADED).status);
        assert!(!get(&cs, PROGRESSING).status);
        assert!(get(&cs, UPGRADEABLE).status);
        assert_eq!(get(&cs, RECONCILE_COMPLETE).reason, REASON_COMPLETED);
    }

    #[test]
    fn a_dead_agent_degrades_naming_its_node() {
        let cs = conditions(&Observation {
            components: vec![handler("node1", true), handler("node2", false)],
            ..Default::default()
        });
        let d = get(&cs, DEGRADED);
        assert!(d.status);
        assert_eq!(d.reason, "KubeVirtDegraded");
        assert_eq!(
            d.message,
            "KubeVirt is degraded: virt-handler on node node2: NodeStatusUnknown: its Lease expired"
        );
        assert!(
            get(&cs, AVAILABLE).status,
            "one agent down is not unavailable"
        );
        let mut critical = handler("node1", false);
        critical.critical = true;
        let cs = conditions(&Observation {
            components: vec![critical],
            ..Default::default()
        });
        assert_eq!(get(&cs, AVAILABLE).reason, "KubeVirtNotAvailable");
    }

    #[test]
    fn init_and_failure() {
        let cs = conditions(&Observation {
            initializing: true,
            reconcile_error: Some("boom".into()),
            ..Default::default()
        });
        assert_eq!(get(&cs, AVAILABLE).reason, REASON_INIT);
        assert!(get(&cs, PROGRESSING).status);
        let r = get(&cs, RECONCILE_COMPLETE);
        assert!(!r.status);
        assert_eq!(r.message, "Error while reconciling: boom");
    }

    #[test]
    fn merge_keeps_transition_times() {
        use k8s_openapi::jiff::Timestamp;
        let t0 = Time(Timestamp::from_second(1000).unwrap());
        let t1 = Time(Timestamp::from_second(2000).unwrap());
        let first = merge(&[], &conditions(&Observation::default()), &t0);
        let again = merge(&first, &conditions(&Observation::default()), &t1);
        assert_eq!(first, again);
        let degraded = conditions(&Observation {
            components: vec![handler("node2", false)],
            ..Default::default()
        });
        let after = merge(&again, &degraded, &t1);
        let d = after.iter().find(|c| c.type_ == DEGRADED).unwrap();
        assert_eq!(d.last_transition_time, Some(t1.clone()));
        let a = after.iter().find(|c| c.type_ == AVAILABLE).unwrap();
        assert_eq!(a.last_transition_time, Some(t0));
    }
}
