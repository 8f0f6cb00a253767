//! Eviction of launcher Pods (docs/migration.md "Eviction and drain"), pure: a VMI's
//! effective `evictionStrategy` (its spec, else the cluster's: KubeVirt CR
//! `spec.configuration.evictionStrategy`, else HyperConverged `spec.evictionStrategy`, else
//! KubeVirt's default `None`) and what an eviction of its launcher Pod does ([`decide`]):
//! start an evacuation (mark the VMI's `status.evacuationNodeName`; the controller migrates
//! it) and answer 429 until it has left, refuse a VMI that can never be evicted, or evict
//! (stop the VMI).

/// `evictionStrategy` values (KubeVirt's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    None,
    LiveMigrate,
    LiveMigrateIfPossible,
    External,
}

impl Strategy {
    /// Parses KubeVirt's spelling; `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "None" => Self::None,
            "LiveMigrate" => Self::LiveMigrate,
            "LiveMigrateIfPossible" => Self::LiveMigrateIfPossible,
            "External" => Self::External,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "None",
            Self::LiveMigrate => "LiveMigrate",
            Self::LiveMigrateIfPossible => "LiveMigrateIfPossible",
            Self::External => "External",
        }
    }
}

/// KubeVirt's default when neither the VMI nor the cluster names a strategy.
pub const DEFAULT_STRATEGY: Strategy = Strategy::None;

/// The taint that asks for a node's VMIs to be migrated away (KubeVirt's
/// `nodeDrainTaintKey` default), effect NoSchedule.
pub const DRAIN_TAINT: &str = "kubevirt.io/drain";

/// The drain taint's key: the KubeVirt CR's `spec.configuration.migrations.nodeDrainTaintKey`
/// (given as the object's `spec` JSON), else [`DRAIN_TAINT`]. An empty key is not a key.
pub fn drain_taint_key(kubevirt_spec: Option<&serde_json::Value>) -> String {
    kubevirt_spec
        .and_then(|s| s.pointer("/configuration/migrations/nodeDrainTaintKey"))
        .and_then(serde_json::Value::as_str)
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .unwrap_or(DRAIN_TAINT)
        .to_string()
}

/// The annotation on migrations created for an evacuation: the node being left.
pub const EVACUATION_ANNOTATION: &str = "kubevirt.io/evacuationMigration";

/// The effective strategy: the VMI's, else the KubeVirt CR's, else the HyperConverged's,
/// else [`DEFAULT_STRATEGY`]. A cluster value that is not a strategy is skipped (the VMI's
/// own is validated at admission).
pub fn effective(vmi: Option<&str>, kubevirt: Option<&str>, hco: Option<&str>) -> Strategy {
    [vmi, kubevirt, hco]
        .into_iter()
        .flatten()
        .find_map(Strategy::parse)
        .unwrap_or(DEFAULT_STRATEGY)
}

/// What is known about the VMI behind an evicted Pod.
#[derive(Debug, Clone, Copy)]
pub struct Subject<'a> {
    /// `namespace/name`, for messages.
    pub vmi: &'a str,
    /// The node the Pod (the VMI) is on.
    pub node: &'a str,
    pub strategy: Strategy,
    /// The VMI runs (a migration can start).
    pub running: bool,
    /// The `LiveMigratable` condition when False: (reason, message).
    pub not_migratable: Option<(&'a str, &'a str)>,
    /// `status.evacuationNodeName`.
    pub evacuation_node: Option<&'a str>,
}

/// The answer to an eviction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// 429 TooManyRequests with `message`; `mark`: set `status.evacuationNodeName` to the node
    /// first. `event`: the Event to record on the VMI (reason, message, warning).
    Refuse {
        mark: bool,
        message: String,
        event: Option<(&'static str, String, bool)>,
    },
    /// The Pod is evicted: the VMI is stopped (deleted, with its grace period); its VM's
    /// runStrategy decides whether it runs again elsewhere.
    Stop { message: String },
}

/// Event reasons.
pub mod reasons {
    pub const EVACUATION: &str = "EvictionTriggeredEvacuation";
    pub const EXTERNAL: &str = "EvictionExternal";
    pub const REFUSED: &str = "EvictionRefused";
    pub const EVICTED: &str = "Evicted";
}

/// What an eviction of the launcher Pod of `s` does (KubeVirt's rules):
/// - `LiveMigrate` (and `LiveMigrateIfPossible` when migratable): evacuation — the VMI is
///   marked, the controller migrates it, 429 until it has left the node;
/// - `LiveMigrate` and not migratable (or not running): 429 naming the reason; never evicted;
/// - `LiveMigrateIfPossible` not migratable, `None`: evicted (stopped);
/// - `External`: marked for an external controller, 429.
pub fn decide(s: &Subject<'_>) -> Answer {
    let marked = s.evacuation_node == Some(s.node);
    let migratable = match (s.running, s.not_migratable) {
        (_, Some((reason, message))) => Err(format!("{reason}: {message}")),
        (false, None) => Err("it is not running, so it cannot be live-migrated".to_string()),
        (true, None) => Ok(()),
    };
    let evacuate = || {
        if marked {
            Answer::Refuse {
                mark: false,
                message: format!(
                    "Eviction of VMI {} is in progress: it is being live-migrated away from node {} (evictionStrategy {}); retry until its Pod is gone",
                    s.vmi,
                    s.node,
                    s.strategy.as_str()
                ),
                event: None,
            }
        } else {
            let message = format!(
                "Eviction triggered evacuation of VMI {}: a live migration away from node {} starts (evictionStrategy {})",
                s.vmi,
                s.node,
                s.strategy.as_str()
            );
            Answer::Refuse {
                mark: true,
                message: message.clone(),
                event: Some((reasons::EVACUATION, message, false)),
            }
        }
    };
    let stop = || Answer::Stop {
        message: format!(
            "The launcher Pod of VMI {} on node {} was evicted (evictionStrategy {}): the VMI is stopped",
            s.vmi,
            s.node,
            s.strategy.as_str()
        ),
    };
    match (s.strategy, migratable) {
        (Strategy::LiveMigrate | Strategy::LiveMigrateIfPossible, Ok(())) => evacuate(),
        (Strategy::LiveMigrate, Err(why)) => {
            let message = format!(
                "VMI {} is not live-migratable ({why}); its evictionStrategy LiveMigrate keeps it from being evicted from node {}",
                s.vmi, s.node
            );
            Answer::Refuse {
                mark: false,
                message: message.clone(),
                event: Some((reasons::REFUSED, message, true)),
            }
        }
        (Strategy::LiveMigrateIfPossible, Err(_)) | (Strategy::None, _) => stop(),
        (Strategy::External, _) => {
            let message = format!(
                "VMI {} has evictionStrategy External: status.evacuationNodeName is set to {} for an external controller to act on",
                s.vmi, s.node
            );
            Answer::Refuse {
                mark: !marked,
                message: message.clone(),
                event: (!marked).then_some((reasons::EXTERNAL, message, false)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subject(strategy: Strategy) -> Subject<'static> {
        Subject {
            vmi: "default/vm1",
            node: "node1",
            strategy,
            running: true,
            not_migratable: None,
            evacuation_node: None,
        }
    }

    #[test]
    fn the_effective_strategy_falls_back_to_the_cluster_then_none() {
        assert_eq!(
            effective(Some("External"), Some("LiveMigrate"), None),
            Strategy::External
        );
        assert_eq!(
            effective(None, Some("LiveMigrate"), Some("None")),
            Strategy::LiveMigrate
        );
        assert_eq!(
            effective(None, None, Some("LiveMigrateIfPossible")),
            Strategy::LiveMigrateIfPossible
        );
        assert_eq!(effective(None, Some("bogus"), None), Strategy::None);
        assert_eq!(effective(None, None, None), Strategy::None);
    }

    #[test]
    fn live_migrate_marks_once_and_answers_429_until_gone() {
        let first = decide(&subject(Strategy::LiveMigrate));
        let Answer::Refuse {
            mark: true,
            event: Some((reasons::EVACUATION, _, false)),
            message,
        } = first
        else {
            panic!("{first:?}")
        };
        assert!(message.contains("evacuation") && message.contains("node1"));
        let mut again = subject(Strategy::LiveMigrate);
        again.evacuation_node = Some("node1");
        let second = decide(&again);
        assert!(
            matches!(&second, Answer::Refuse { mark: false, event: None, message } if message.contains("in progress")),
            "{second:?}"
        );
        // Marked for another node (an older drain): marked again for this one.
        again.evacuation_node = Some("node0");
        assert!(matches!(decide(&again), Answer::Refuse { mark: true, .. }));
    }

    #[test]
    fn a_vmi_that_cannot_migrate() {
        let mut s = subject(Strategy::LiveMigrate);
        s.not_migratable = Some(("DisksNotLiveMigratable", "claim root is ReadWriteOnce"));
        let a = decide(&s);
        assert!(
            matches!(&a, Answer::Refuse { mark: false, message, event: Some((reasons::REFUSED, _, true)) }
                if message.contains("DisksNotLiveMigratable") && message.contains("not live-migratable")),
            "{a:?}"
        );
        s.strategy = Strategy::LiveMigrateIfPossible;
        assert!(matches!(decide(&s), Answer::Stop { .. }));
        // Not running: no migration possible either.
        let mut s = subject(Strategy::LiveMigrate);
        s.running = false;
        assert!(matches!(decide(&s), Answer::Refuse { mark: false, .. }));
        s.strategy = Strategy::LiveMigrateIfPossible;
        assert!(matches!(decide(&s), Answer::Stop { .. }));
    }

    #[test]
    fn if_possible_migrates_when_it_can() {
        assert!(matches!(
            decide(&subject(Strategy::LiveMigrateIfPossible)),
            Answer::Refuse { mark: true, .. }
        ));
    }

    #[test]
    fn none_evicts_and_external_only_marks() {
        let a = decide(&subject(Strategy::None));
        assert!(matches!(&a, Answer::Stop { message } if message.contains("stopped")));
        let mut s = subject(Strategy::External);
        s.not_migratable = Some(("X", "y"));
        let a = decide(&s);
        assert!(
            matches!(&a, Answer::Refuse { mark: true, message, event: Some((reasons::EXTERNAL, _, false)) } if message.contains("evacuationNodeName")),
            "{a:?}"
        );
        s.evacuation_node = Some("node1");
        assert!(matches!(
            decide(&s),
            Answer::Refuse {
                mark: false,
                event: None,
                ..
            }
        ));
    }

    #[test]
    fn the_drain_taint_key_comes_from_the_kubevirt_cr() {
        assert_eq!(drain_taint_key(None), DRAIN_TAINT);
        let spec = serde_json::json!({"configuration": {"migrations":
            {"nodeDrainTaintKey": "example.com/maintenance"}}});
        assert_eq!(drain_taint_key(Some(&spec)), "example.com/maintenance");
        let empty = serde_json::json!({"configuration": {"migrations": {"nodeDrainTaintKey": ""}}});
        assert_eq!(drain_taint_key(Some(&empty)), DRAIN_TAINT);
        let other = serde_json::json!({"configuration": {"evictionStrategy": "LiveMigrate"}});
        assert_eq!(drain_taint_key(Some(&other)), DRAIN_TAINT);
    }
}
