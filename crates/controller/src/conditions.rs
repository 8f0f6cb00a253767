//! Helpers for KubeVirt-style status conditions: set one (keeping `lastTransitionTime` when
//! the status did not change), remove one, find one.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use ferrovirt_api::kubevirt::vmi::Condition;

/// The condition of this type, if present.
pub fn find<'a>(conditions: Option<&'a [Condition]>, type_: &str) -> Option<&'a Condition> {
    conditions?.iter().find(|c| c.type_ == type_)
}

/// Whether a condition of this type has status `True`.
pub fn is_true(conditions: Option<&[Condition]>, type_: &str) -> bool {
    find(conditions, type_).is_some_and(|c| c.status == "True")
}

/// A condition with the given fields and no timestamps yet.
pub fn condition(
    type_: &str,
    status: bool,
    reason: Option<&str>,
    message: Option<&str>,
) -> Condition {
    Condition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        last_probe_time: None,
        last_transition_time: None,
        reason: reason.map(Into::into),
        message: message.map(Into::into),
    }
}

/// Insert or replace the condition of `new.type_`. `lastTransitionTime` is kept from the old
/// condition when the status is unchanged, else set to `now`.
pub fn set(conditions: &mut Vec<Condition>, mut new: Condition, now: &Time) {
    match conditions.iter_mut().find(|c| c.type_ == new.type_) {
        Some(old) => {
            new.last_transition_time = if old.status == new.status {
                old.last_transition_time
                    .clone()
                    .or_else(|| Some(now.clone()))
            } else {
                Some(now.clone())
            };
            *old = new;
        }
        None => {
            new.last_transition_time = Some(now.clone());
            conditions.push(new);
        }
    }
}

/// Remove the condition of this type.
pub fn remove(conditions: &mut Vec<Condition>, type_: &str) {
    conditions.retain(|c| c.type_ != type_);
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    #[test]
    fn transition_time_only_changes_with_status() {
        let t1 = Time(Timestamp::from_second(100).unwrap());
        let t2 = Time(Timestamp::from_second(200).unwrap());
        let mut conds = Vec::new();
        set(&mut conds, condition("Ready", false, Some("A"), None), &t1);
        set(&mut conds, condition("Ready", false, Some("B"), None), &t2);
        assert_eq!(conds[0].last_transition_time, Some(t1.clone()));
        assert_eq!(conds[0].reason.as_deref(), Some("B"));
        set(&mut conds, condition("Ready", true, None, None), &t2);
        assert_eq!(conds[0].last_transition_time, Some(t2));
        assert!(is_true(Some(&conds), "Ready"));
        remove(&mut conds, "Ready");
        assert!(conds.is_empty());
    }
}
