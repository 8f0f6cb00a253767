//! Conditions of enactments and policies, and the policy's `maxUnavailable` slots.
//! [`enactment_conditions`] and [`aggregate`] are pure; [`take_slot`] and [`release_slot`]
//! are compare-and-swaps on the policy's status (`status.unavailableNodeCount` written with
//! the resourceVersion read; a 409 reads again), so two agents can never both take the last
//! slot: the second write carries a stale resourceVersion and is refused.

use std::collections::BTreeMap;

use ferrovirt_api::nmstate::{self as api, NmstateCondition, condition, reason};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Client;
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Value, json};

use crate::error::AgentError;

const ENACTMENT_TYPES: [&str; 5] = [
    condition::AVAILABLE,
    condition::FAILING,
    condition::PROGRESSING,
    condition::PENDING,
    condition::ABORTED,
];

/// The type of the condition that is True, if one is.
pub fn true_type(conditions: Option<&Value>) -> Option<String> {
    conditions?
        .as_array()?
        .iter()
        .find(|c| c["status"] == "True")
        .and_then(|c| c["type"].as_str().map(String::from))
}

fn set(
    prev: &[NmstateCondition],
    ty: &str,
    on: bool,
    reason: Option<&str>,
    message: Option<&str>,
    now: &str,
) -> NmstateCondition {
    let status = if on { "True" } else { "False" };
    let since = prev
        .iter()
        .find(|c| c.type_ == ty && c.status == status)
        .and_then(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| now.to_string());
    NmstateCondition {
        type_: ty.to_string(),
        status: status.to_string(),
        reason: reason.map(String::from),
        message: message.map(String::from),
        last_heartbeat_time: Some(now.to_string()),
        last_transition_time: Some(since),
    }
}

/// An enactment's five conditions with `ty` True (reason, message) and the others False
/// (pure; transition times kept where the status did not change).
pub fn enactment_conditions(
    prev: &[NmstateCondition],
    ty: &str,
    reason: &str,
    message: &str,
    now: &str,
) -> Vec<NmstateCondition> {
    ENACTMENT_TYPES
        .iter()
        .map(|t| {
            if *t == ty {
                set(prev, t, true, Some(reason), Some(message), now)
            } else {
                set(prev, t, false, None, None, now)
            }
        })
        .collect()
}

/// A policy's conditions from the True condition types of its enactments for the current
/// generation among `matching` nodes (pure), with counts in the messages as nmstate writes
/// them.
pub fn aggregate(
    prev: &[NmstateCondition],
    matching: usize,
    enactments: &[String],
    now: &str,
) -> Vec<NmstateCondition> {
    let count = |t: &str| enactments.iter().filter(|e| *e == t).count();
    let (ok, failed) = (count(condition::AVAILABLE), count(condition::FAILING));
    let busy = count(condition::PROGRESSING) + count(condition::PENDING);
    let not_started = matching.saturating_sub(ok + failed + busy);
    let mk = |a: bool, d: bool, p: bool, r: &str, m: String| {
        vec![
            set(prev, condition::AVAILABLE, a, Some(r), Some(&m), now),
            set(prev, condition::DEGRADED, d, Some(r), Some(&m), now),
            set(prev, condition::PROGRESSING, p, Some(r), Some(&m), now),
        ]
    };
    if matching == 0 {
        return mk(
            true,
            false,
            false,
            reason::NO_MATCHING_NODE,
            "Policy does not match any node".into(),
        );
    }
    if busy + not_started > 0 {
        return mk(
            false,
            false,
            true,
            reason::CONFIGURATION_PROGRESSING,
            format!(
                "Policy is progressing {}/{matching} nodes finished",
                ok + failed
            ),
        );
    }
    if failed > 0 {
        return mk(
            false,
            true,
            false,
            reason::FAILED_TO_CONFIGURE,
            format!("{failed}/{matching} nodes failed to configure"),
        );
    }
    mk(
        true,
        false,
        false,
        reason::SUCCESSFULLY_CONFIGURED,
        format!("{ok}/{matching} nodes successfully configured"),
    )
}

fn policies(c: &Client) -> Api<kube::api::DynamicObject> {
    super::policies(c)
}

async fn matching_nodes(client: &Client, selector: Option<&Value>) -> Result<usize, AgentError> {
    let nodes: Api<Node> = Api::all(client.clone());
    let list = nodes
        .list(&ListParams::default())
        .await
        .map_err(|e| super::kube_err("listing Nodes", e))?;
    Ok(list
        .items
        .iter()
        .filter(|n| {
            let labels: BTreeMap<String, String> = n.metadata.labels.clone().unwrap_or_default();
            super::selects(selector, &labels)
        })
        .count())
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// The slot count to go by (pure): the recorded one, or, when it has not been written for
/// `grace`, the number of the policy's enactments that are Progressing now — a slot held by
/// an agent that died mid-apply is freed that way.
pub fn effective_count(
    recorded: usize,
    progressing: usize,
    age: Option<std::time::Duration>,
    grace: std::time::Duration,
) -> usize {
    if recorded > progressing && age.is_some_and(|a| a >= grace) {
        progressing
    } else {
        recorded
    }
}

async fn progressing(client: &Client, policy: &str) -> Result<usize, AgentError> {
    let list = super::enactments(client)
        .list(&ListParams::default().labels(&format!("{}={policy}", api::ENACTMENT_POLICY_LABEL)))
        .await
        .map_err(|e| super::kube_err("listing enactments", e))?;
    Ok(list
        .items
        .iter()
        .filter(|e| {
            true_type(e.data.pointer("/status/conditions")).as_deref()
                == Some(condition::PROGRESSING)
        })
        .count())
}

/// Takes one of the policy's maxUnavailable slots; `false` when all are taken.
pub async fn take_slot(
    client: &Client,
    policy: &str,
    node: &str,
    grace: std::time::Duration,
) -> Result<bool, AgentError> {
    let api = policies(client);
    for _ in 0..20 {
        let mut p = api
            .get(policy)
            .await
            .map_err(|e| super::kube_err("reading the policy", e))?;
        let m = matching_nodes(client, p.data.pointer("/spec/nodeSelector")).await?;
        let max: Option<IntOrString> = p
            .data
            .pointer("/spec/maxUnavailable")
            .and_then(|v| serde_json::from_value(v.clone()).ok());
        let limit = api::max_unavailable(max.as_ref(), m).unwrap_or(1);
        let n = p
            .data
            .pointer("/status/unavailableNodeCount")
            .and_then(Value::as_i64)
            .unwrap_or(0)
            .max(0) as usize;
        let n = if n >= limit {
            let age = p
                .data
                .pointer("/status/lastUnavailableNodeCountUpdate")
                .and_then(Value::as_str)
                .and_then(|t| t.parse::<jiff::Timestamp>().ok())
                .and_then(|t| jiff::Timestamp::now().duration_since(t).try_into().ok());
            let fixed = effective_count(n, progressing(client, policy).await?, age, grace);
            if fixed >= limit {
                tracing::info!(policy, node, n, limit, "nmstate: maxUnavailable reached");
                return Ok(false);
            }
            tracing::warn!(
                policy,
                recorded = n,
                fixed,
                "nmstate: freeing slots of dead agents"
            );
            fixed
        } else {
            n
        };
        let status = p.data["status"].as_object().cloned().unwrap_or_default();
        let mut status = Value::Object(status);
        status["unavailableNodeCount"] = json!(n + 1);
        status["lastUnavailableNodeCountUpdate"] = json!(super::now());
        p.data["status"] = status;
        match api.replace_status(policy, &PostParams::default(), &p).await {
            Ok(_) => return Ok(true),
            Err(e) if is_conflict(&e) => continue,
            Err(e) => return Err(super::kube_err("taking a maxUnavailable slot", e)),
        }
    }
    Ok(false)
}

/// Gives a slot back and rewrites the policy's conditions from its enactments.
pub async fn release_slot(client: &Client, policy: &str) -> Result<(), AgentError> {
    let api = policies(client);
    for _ in 0..20 {
        let mut p = api
            .get(policy)
            .await
            .map_err(|e| super::kube_err("reading the policy", e))?;
        let generation = p.metadata.generation.unwrap_or(0);
        let m = matching_nodes(client, p.data.pointer("/spec/nodeSelector")).await?;
        let list = super::enactments(client)
            .list(
                &ListParams::default().labels(&format!("{}={policy}", api::ENACTMENT_POLICY_LABEL)),
            )
            .await
            .map_err(|e| super::kube_err("listing enactments", e))?;
        let types: Vec<String> = list
            .items
            .iter()
            .filter(|e| {
                e.data
                    .pointer("/status/policyGeneration")
                    .and_then(Value::as_i64)
                    == Some(generation)
            })
            .filter_map(|e| true_type(e.data.pointer("/status/conditions")))
            .collect();
        let prev: Vec<NmstateCondition> = p
            .data
            .pointer("/status/conditions")
            .and_then(|c| serde_json::from_value(c.clone()).ok())
            .unwrap_or_default();
        let n = p
            .data
            .pointer("/status/unavailableNodeCount")
            .and_then(Value::as_i64)
            .unwrap_or(0);
        let mut status = Value::Object(p.data["status"].as_object().cloned().unwrap_or_default());
        status["unavailableNodeCount"] = json!((n - 1).max(0));
        status["lastUnavailableNodeCountUpdate"] = json!(super::now());
        status["conditions"] = json!(aggregate(&prev, m, &types, &super::now()));
        p.data["status"] = status;
        match api.replace_status(policy, &PostParams::default(), &p).await {
            Ok(_) => return Ok(()),
            Err(e) if is_conflict(&e) => continue,
            Err(e) => return Err(super::kube_err("releasing a maxUnavailable slot", e)),
        }
    }
    Err(AgentError::Reference(format!(
        "policy {policy}: too many conflicting status writes"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn types(c: &[NmstateCondition]) -> Vec<(String, String, Option<String>)> {
        c.iter()
            .map(|c| (c.type_.clone(), c.status.clone(), c.reason.clone()))
            .collect()
    }

    #[test]
    fn enactment_has_one_true_condition() {
        let c = enactment_conditions(&[], "Failing", "FailedToConfigure", "boom", "t1");
        assert_eq!(c.len(), 5);
        assert_eq!(c.iter().filter(|c| c.status == "True").count(), 1);
        assert_eq!(c[1].reason.as_deref(), Some("FailedToConfigure"));
        let again = enactment_conditions(&c, "Failing", "FailedToConfigure", "boom", "t2");
        assert_eq!(again[1].last_transition_time.as_deref(), Some("t1"));
        assert_eq!(again[1].last_heartbeat_time.as_deref(), Some("t2"));
    }

    #[test]
    fn policy_conditions_from_enactments() {
        let a = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let ok = aggregate(&[], 2, &a(&["Available", "Available"]), "t");
        assert_eq!(
            types(&ok)[0],
            (
                "Available".into(),
                "True".into(),
                Some("SuccessfullyConfigured".into())
            )
        );
        assert_eq!(
            ok[0].message.as_deref(),
            Some("2/2 nodes successfully configured")
        );
        let prog = aggregate(&[], 2, &a(&["Available"]), "t");
        assert_eq!(prog[2].status, "True");
        assert_eq!(
            prog[2].message.as_deref(),
            Some("Policy is progressing 1/2 nodes finished")
        );
        let deg = aggregate(&[], 2, &a(&["Available", "Failing"]), "t");
        assert_eq!(
            types(&deg)[1],
            (
                "Degraded".into(),
                "True".into(),
                Some("FailedToConfigure".into())
            )
        );
        assert_eq!(deg[0].status, "False");
        let none = aggregate(&[], 0, &[], "t");
        assert_eq!(none[0].reason.as_deref(), Some("NoMatchingNode"));
    }

    #[test]
    fn stale_slots_are_recounted_only_after_the_grace() {
        use std::time::Duration;
        let g = Duration::from_secs(120);
        assert_eq!(effective_count(1, 0, Some(Duration::from_secs(10)), g), 1);
        assert_eq!(effective_count(1, 0, Some(Duration::from_secs(200)), g), 0);
        assert_eq!(effective_count(2, 1, Some(Duration::from_secs(200)), g), 1);
        assert_eq!(effective_count(1, 1, Some(Duration::from_secs(200)), g), 1);
        assert_eq!(effective_count(1, 0, None, g), 1);
    }

    #[test]
    fn true_type_finds_it() {
        let v = json!([{"type": "Available", "status": "False"},
                       {"type": "Pending", "status": "True"}]);
        assert_eq!(true_type(Some(&v)).as_deref(), Some("Pending"));
        assert_eq!(true_type(None), None);
    }
}
